"""Unscaling one device's gradients for mpext.GradScaler: what mpext's kernel takes in one
``mpext.ops.unscale_`` call, the rest with torch's op; and a scalar tensor copied to each
device on first use."""
from collections import defaultdict
from typing import Dict, List

import torch

from .. import ops
from .._common import PARAM_DTYPES, has_kernel


class PerDevice:
    """A tensor and its copies on other devices, made on first request (non-blocking)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.master = tensor
        self.copies: Dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        t = self.copies.get(device)
        if t is None:
            t = self.master.to(device=device, non_blocking=True, copy=True)
            self.copies[device] = t
        return t


def dense(t: torch.Tensor) -> bool:
    """Whether t covers its memory exactly once (contiguous, channels_last, any permutation):
    what mpext's element-wise kernels accept."""
    if t.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted((d for d in zip(t.shape, t.stride()) if d[0] != 1),
                               key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def unscale_device(grads: List[torch.Tensor], found_inf: torch.Tensor,
                    inv_scale: torch.Tensor) -> None:
    """Unscales one device's gradients: everything mpext takes in one mpext.ops.unscale_ call,
    the rest (float64, non-dense layouts, no mpext kernel for the device) with torch's op, one
    call per dtype."""
    ours: List[torch.Tensor] = []
    rest: Dict[torch.dtype, List[torch.Tensor]] = defaultdict(list)
    mpext_ok = has_kernel("unscale_", found_inf.device)
    for g in grads:
        if (mpext_ok and g.dtype in PARAM_DTYPES and g.layout == torch.strided
                and dense(g)):
            ours.append(g)
        else:
            rest[g.dtype].append(g)
    if ours:
        ops.unscale_(ours, found_inf, inv_scale)
    for same_dtype in rest.values():
        torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, found_inf, inv_scale)
