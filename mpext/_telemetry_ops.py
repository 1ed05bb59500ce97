"""The typed wrapper and fake kernel of ``torch.ops.mpext.unscale_stats_`` (precision telemetry,
issue 46; the schema is in csrc/torch/registration.cpp, the kernels in csrc/core/telemetry.c and
cuda/telemetry.cu). Re-exported as ``mpext.ops.unscale_stats_``."""
from typing import Optional, Sequence

import torch

from ._common import dtype_name as _dtype_name
from .ops import _check_fake_scalar, _unscale_fake

_ops = torch.ops.mpext

# Columns of a gradient's row of counts (mpext/telemetry.h MP_TEL_*).
COUNT_NAMES = ("zeros", "subnormal", "headroom", "nonfinite")
# first_nonfinite holds this until a call finds a non-finite gradient (the op keeps a minimum).
NO_INDEX = torch.iinfo(torch.int64).max


def unscale_stats_(grads: Sequence[torch.Tensor], found_inf: torch.Tensor,
                   inv_scale: torch.Tensor, counts: torch.Tensor, max_abs: torch.Tensor,
                   first_nonfinite: torch.Tensor, *,
                   stat_inv_scale: Optional[torch.Tensor] = None) -> None:
    """``mpext.ops.unscale_`` (the same bits in ``grads`` and ``found_inf``) that also counts,
    in the same pass, what each gradient's dtype costs at the current loss scale.

    Taken on the values as stored before the multiply (the scaled gradient backward produced),
    for gradient ``i``, added to ``counts[i]`` (int64, shape ``[len(grads), 4]``):
    ``[zeros, subnormal (0 < |g| < the dtype's smallest normal), headroom (finite and
    |g| * 2 > the dtype's max: it would overflow at twice the scale), non-finite]``; merged as
    a maximum into ``max_abs[i]`` (float32, ``[len(grads)]``, start it at 0): the largest
    ``fp32(|g| * stat_inv_scale)`` over finite elements (the unscaled magnitude before it is
    rounded back to the gradient's dtype); and ``first_nonfinite`` (int64, one element, start it
    at ``NO_INDEX``) lowered to the position in ``grads`` of the first gradient that holds a
    NaN/Inf. ``stat_inv_scale`` (float32, one element) is the inverse of the loss scale the
    stored values carry; it defaults to ``inv_scale`` (pass it when ``inv_scale`` is 1 for a
    check-only call on scaled gradients). Everything stays on the device: no host sync.
    Every argument is checked before anything is written.
    """
    grads = list(grads)
    for i, g in enumerate(grads):
        if isinstance(g, torch.Tensor) and g.layout != torch.strided:
            raise RuntimeError("mpext.unscale_stats_: grads[%d] must be a strided (dense) tensor, "
                               "got layout %s (for a sparse gradient pass its _values())"
                               % (i, g.layout))
    _ops.unscale_stats_(grads, found_inf, inv_scale, counts, max_abs, first_nonfinite,
                        stat_inv_scale=stat_inv_scale)


@torch.library.register_fake("mpext::unscale_stats_")
def _unscale_stats_fake(grads, found_inf, inv_scale, counts, max_abs, first_nonfinite, *,
                        stat_inv_scale=None):
    op = "unscale_stats_"
    _unscale_fake(grads, found_inf, inv_scale)
    device = found_inf.device
    n = len(grads)
    _check_fake_scalar(first_nonfinite, op, "first_nonfinite", torch.int64, 1, device,
                       "found_inf")
    if stat_inv_scale is not None:
        _check_fake_scalar(stat_inv_scale, op, "stat_inv_scale", torch.float32, 1, device,
                           "found_inf")
    torch._check(counts.dtype == torch.int64, lambda: "mpext.%s: counts must have dtype int64, "
                 "got %s" % (op, _dtype_name(counts.dtype)))
    torch._check(counts.dim() == 2 and counts.shape[0] == n and counts.shape[1] == 4,
                 lambda: "mpext.%s: counts must have shape [len(grads), 4] = [%d, 4], got %s"
                 % (op, n, list(counts.shape)))
    torch._check(max_abs.dtype == torch.float32, lambda: "mpext.%s: max_abs must have dtype "
                 "float32, got %s" % (op, _dtype_name(max_abs.dtype)))
    torch._check(max_abs.dim() == 1 and max_abs.shape[0] == n,
                 lambda: "mpext.%s: max_abs must have shape [len(grads)] = [%d], got %s"
                 % (op, n, list(max_abs.shape)))
    for name, t in (("counts", counts), ("max_abs", max_abs)):
        torch._check(t.device == device, lambda: "mpext.%s: %s is on %s but found_inf is on %s; "
                     "all tensors must be on one device" % (op, name, t.device, device))
    return None
