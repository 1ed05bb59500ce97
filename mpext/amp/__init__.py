"""mpext.amp: loss scaling and mixed precision around an optimizer.

* :class:`GradScaler` (``grad_scaler.py``): the drop-in for ``torch.amp.GradScaler``; its jobs
  in modules of their own: unscaling a device's gradients (``_unscale.py``), the inf/NaN flags
  across devices and ranks (``_flags.py``), the overflow warning (``_overflow_watch.py``), the
  checks of its arguments and state dicts (``_checks.py``).
* :class:`MixedPrecisionOptimizer` (``mixed_precision.py``): FP32 masters, loss scaling and
  clipping around any ``torch.optim`` optimizer over BF16/FP16 params.

The package builds on ``mpext.optim``; ``mpext.optim`` never imports it (tests/test_layout.py).
Both names are also ``mpext.GradScaler`` and ``mpext.MixedPrecisionOptimizer``.
"""
from .grad_scaler import GradScaler
from .mixed_precision import MixedPrecisionOptimizer

__all__ = ["GradScaler", "MixedPrecisionOptimizer"]
