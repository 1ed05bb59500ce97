"""mpext.amp: loss scaling and mixed precision around an optimizer: :class:`GradScaler` (the
drop-in for ``torch.amp.GradScaler``) and :class:`MixedPrecisionOptimizer` (FP32 masters, loss
scaling and clipping around any ``torch.optim`` optimizer over BF16/FP16 params). Both are also
``mpext.GradScaler`` and ``mpext.MixedPrecisionOptimizer``."""
from .grad_scaler import GradScaler
from .mixed_precision import MixedPrecisionOptimizer

__all__ = ["GradScaler", "MixedPrecisionOptimizer"]
