"""mpext.telemetry.hf: precision telemetry in a ``transformers.Trainer``, logged with its metrics.

    trainer = Trainer(..., args=TrainingArguments(..., fp16=True),
                      optimizer_cls_and_kwargs=(mpext.optim.AdamW, {}))
    scaler = mpext.accelerate.setup_trainer(trainer)    # the Trainer's mpext.GradScaler
    tel = mpext.telemetry.hf.attach(trainer, scaler, every=50, optimizer="trainer")
    trainer.train()          # every 50 steps the telemetry joins the next logged metrics

``optimizer="trainer"`` counts the optimizer's steps too (the ``update/``, ``state/`` and ``ema/``
keys: lost updates, moment rounding error; see docs/telemetry.md): the Trainer's optimizer, made
now if the Trainer has not made it yet (``trainer.create_optimizer()``, which ``train()`` then
reuses); it must be an ``mpext.optim`` optimizer. A run without loss scaling (bf16) passes
``scaler=None`` with the optimizer: the window is then ``every`` optimizer steps.

The callback reads the counters (one host sync) every ``every`` optimizer steps and adds them to
the next ``on_log`` call's ``logs``; it goes first among the Trainer's callbacks, so that the
reporting integrations (TensorBoard, W&B, ...) and ``state.log_history`` see the keys. The
overflow site (a string) is logged too; reporters that take numbers only skip it.
"""
from typing import Any, Dict, Optional

try:
    import transformers as _transformers
except ImportError as _exc:  # pragma: no cover - a clear error where transformers is missing
    raise ImportError("mpext.telemetry.hf needs transformers (pip install transformers): %s"
                      % _exc) from _exc

from . import Telemetry, attach as _attach

__all__ = ["TelemetryCallback", "attach"]


class TelemetryCallback(_transformers.TrainerCallback):
    """Polls ``telemetry`` at every optimizer step and merges what it read into the next logs."""

    def __init__(self, telemetry: Telemetry):
        if not isinstance(telemetry, Telemetry):
            raise TypeError("TelemetryCallback: telemetry must be an mpext.telemetry.Telemetry, "
                            "got %s" % type(telemetry).__name__)
        self.telemetry = telemetry
        self.pending: Dict[str, Any] = {}
        self.last: Optional[Dict[str, Any]] = None

    def on_step_end(self, args, state, control, **kwargs):
        read = self.telemetry.poll()
        if read is not None:
            self.last = read
            self.pending.update(read)
            control.should_log = True  # log at this step, whatever logging_steps says

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self.pending:
            logs.update(self.pending)
            # log_history holds a copy made before the callbacks ran: add the keys there too
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update(self.pending)
            self.pending = {}


def attach(trainer, scaler=None, every: int = 100, module_depth: int = 2,
           optimizer: Optional[str] = None, step_every: Optional[int] = None) -> Telemetry:
    """Attaches a Telemetry to ``scaler`` (the ``mpext.GradScaler`` that
    ``mpext.accelerate.setup_trainer(trainer)`` returned, or None) and, with
    ``optimizer="trainer"``, to the Trainer's optimizer (``step_every`` as in
    ``mpext.telemetry.attach``), named by ``trainer.model``, and puts its callback first among
    the Trainer's callbacks. Returns the Telemetry."""
    if not isinstance(trainer, _transformers.Trainer):
        raise TypeError("mpext.telemetry.hf.attach: trainer must be a transformers.Trainer, got %s"
                        % type(trainer).__name__)
    if optimizer not in (None, "trainer"):
        raise ValueError("mpext.telemetry.hf.attach: optimizer must be None or \"trainer\" (the "
                         "Trainer's optimizer), got %r" % (optimizer,))
    if scaler is None and optimizer is None:
        raise ValueError("mpext.telemetry.hf.attach: give the scaler, optimizer=\"trainer\", "
                         "or both")
    if scaler is not None and getattr(trainer.accelerator, "scaler", None) is not scaler:
        raise ValueError("mpext.telemetry.hf.attach: scaler is not the Trainer's scaler; pass the "
                         "one mpext.accelerate.setup_trainer(trainer) returned")
    opt = None
    if optimizer == "trainer":
        from ..optim._base import FusedOptimizer
        if trainer.optimizer is None:
            # made now rather than in train(), which reuses it: the counters need the object
            trainer.create_optimizer()
        opt = trainer.optimizer
        opt = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps it
        if not isinstance(opt, FusedOptimizer):
            raise TypeError("mpext.telemetry.hf.attach: the Trainer's optimizer must be an "
                            "mpext.optim optimizer to count its steps (e.g. "
                            "optimizer_cls_and_kwargs=(mpext.optim.AdamW, {})), got %s"
                            % type(opt).__name__)
    tel = _attach(scaler, model=trainer.model, every=every, module_depth=module_depth,
                  optimizer=opt, step_every=step_every)
    trainer.callback_handler.callbacks.insert(0, TelemetryCallback(tel))
    return tel
