"""The skip-flag protocol: how an object that decides whether an optimizer step is skipped (an
``mpext.GradScaler``, a ``MixedPrecisionOptimizer``) tells whoever needs to know (the LR
schedules of ``mpext.optim.lr_scheduler``), without either importing the other.

A class takes part by defining ``_mpext_skip_flag(self, optimizer=None)``: whether the latest
step was skipped (a gradient held an inf/NaN, so nothing changed), as a 0-dim bool tensor on the
device, with no host sync. A scaler answers for the ``optimizer`` it stepped; a wrapper that owns
its scaler answers for its own step and ignores the argument. Nothing here is public API."""
from typing import Any, Callable, Optional

import torch

SKIP_FLAG = "_mpext_skip_flag"


def skip_flag_source(obj: Any) -> Optional[Callable[..., torch.Tensor]]:
    """``obj``'s skip-flag method (bound) when its class takes part in the protocol, else
    None. Looked up on the class, so that a wrapper forwarding unknown attributes to what it
    wraps (``__getattr__``) is not taken for a source."""
    if getattr(type(obj), SKIP_FLAG, None) is None:
        return None
    return getattr(obj, SKIP_FLAG)
