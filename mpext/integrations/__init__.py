"""mpext.integrations: mpext in other frameworks' training loops and checkpoint formats.

* ``lightning``: ``MixedPrecision``, a Lightning ``Precision`` plugin (needs ``lightning``);
* ``accelerate``: an ``accelerate.Accelerator`` and a ``transformers.Trainer`` on
  ``mpext.GradScaler`` and device-side schedules (needs ``accelerate``; ``transformers`` for
  ``setup_trainer``);
* ``dcp``: a ``torch.distributed.checkpoint`` load planner that converts between state formats;
* ``checkpoint``: atomic, checksummed checkpoint files.

Nothing is imported here, so ``import mpext`` imports no framework: each module raises a
clear ImportError where its framework is missing. The modules were ``mpext.lightning``,
``mpext.accelerate``, ``mpext.dcp`` and ``mpext.checkpoint``; those names still work
(mpext/_moved.py). ``mpext.optim`` never imports this package (tests/test_layout.py).
"""
