"""Typed Python wrappers of the torch.ops.mpext operators, their fake (meta) kernels and their
autograd formulas. The schemas live in csrc/torch/registration.cpp; the CPU kernels in
csrc/core (C) behind csrc/torch/*.cpp, the CUDA kernels in cuda/*.cu behind
csrc/torch/*_cuda.cpp.
"""
from typing import List, Sequence

import torch

__all__ = ["to_bf16", "to_fp16", "to_fp32", "cast_"]

_ops = torch.ops.mpext


def to_bf16(x: torch.Tensor, *, stochastic: bool = False, seed: int = 0,
            offset: int = 0) -> torch.Tensor:
    """fp32 -> bf16. Round to nearest even (bit-identical to ``x.to(torch.bfloat16)`` for every
    non-NaN input; NaN stays NaN), or with ``stochastic=True`` stochastic rounding: each element
    rounds up with probability equal to the fraction truncation would discard, using random bits
    that depend only on ``(seed, offset + i)`` where ``i`` is the element's position in memory,
    so results are reproducible across runs, thread counts and devices (CPU and CUDA agree).

    ``x`` must be float32 and dense (contiguous, channels_last, ...); the result has its layout.
    """
    return _ops.to_bf16(x, stochastic=stochastic, seed=_seed64(seed), offset=offset)


def to_fp16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> fp16, round to nearest even, bit-identical to ``x.to(torch.float16)`` for every
    non-NaN input (subnormals rounded, not flushed; overflow to +-Inf)."""
    return _ops.to_fp16(x)


def to_fp32(x: torch.Tensor) -> torch.Tensor:
    """bf16 or fp16 -> fp32, exact."""
    return _ops.to_fp32(x)


def cast_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], *, stochastic: bool = False,
          seed: int = 0, offset: int = 0) -> None:
    """Multi-tensor copy-cast ``dst[i].copy_(src[i])`` in one pass over the whole list.

    Pairs may be fp32 -> bf16/fp16 (round to nearest even, e.g. FP32 masters to model params),
    bf16/fp16 -> fp32 (exact), or the same dtype (copy); lists may mix them. Each pair must have
    one shape and one dense memory layout; all tensors one device. ``stochastic=True`` rounds the
    fp32 -> bf16 pairs stochastically, element ``k`` of the concatenated list using random
    stream position ``offset + k``. Every argument is checked before anything is written.
    """
    _ops.cast_(list(dst), list(src), stochastic=stochastic, seed=_seed64(seed), offset=offset)


def _seed64(seed: int) -> int:
    """Maps any Python int seed onto the int64 the schema carries (the kernels read it as
    uint64), so seeds in [0, 2**64) all work."""
    seed = int(seed)
    if not -(2 ** 63) <= seed < 2 ** 64:
        raise ValueError("mpext: seed must be in [-2**63, 2**64), got %d" % seed)
    return seed - 2 ** 64 if seed >= 2 ** 63 else seed


# ---------------------------------------------------------------------------------------------
# Fake kernels: shapes, dtypes and layouts without touching data (torch.compile, meta tensors).


def _check_fake_dense(x: torch.Tensor, op: str) -> None:
    torch._check(x.layout == torch.strided,
                 lambda: "mpext.%s: x must be a strided (dense) tensor" % op)


@torch.library.register_fake("mpext::to_bf16")
def _to_bf16_fake(x, *, stochastic=False, seed=0, offset=0):
    torch._check(x.dtype == torch.float32,
                 lambda: "mpext.to_bf16: x must have dtype float32, got %s" % x.dtype)
    _check_fake_dense(x, "to_bf16")
    return torch.empty_like(x, dtype=torch.bfloat16)


@torch.library.register_fake("mpext::to_fp16")
def _to_fp16_fake(x):
    torch._check(x.dtype == torch.float32,
                 lambda: "mpext.to_fp16: x must have dtype float32, got %s" % x.dtype)
    _check_fake_dense(x, "to_fp16")
    return torch.empty_like(x, dtype=torch.float16)


@torch.library.register_fake("mpext::to_fp32")
def _to_fp32_fake(x):
    torch._check(x.dtype in (torch.bfloat16, torch.float16),
                 lambda: "mpext.to_fp32: x must have dtype bfloat16 or float16, got %s" % x.dtype)
    _check_fake_dense(x, "to_fp32")
    return torch.empty_like(x, dtype=torch.float32)


@torch.library.register_fake("mpext::cast_")
def _cast_fake(dst, src, *, stochastic=False, seed=0, offset=0):
    torch._check(len(dst) == len(src),
                 lambda: "mpext.cast_: dst and src must have the same length, got %d and %d"
                 % (len(dst), len(src)))
    device = dst[0].device if len(dst) else None
    for i, (d, s) in enumerate(zip(dst, src)):
        torch._check(d.device == device and s.device == device,
                     lambda: "mpext.cast_: all tensors must be on one device; dst[%d] is on %s "
                     "and src[%d] on %s but dst[0] is on %s" % (i, d.device, i, s.device, device))
        torch._check(d.shape == s.shape,
                     lambda: "mpext.cast_: dst[%d] has shape %s but src[%d] has shape %s"
                     % (i, tuple(d.shape), i, tuple(s.shape)))
    return None


# ---------------------------------------------------------------------------------------------
# Autograd: a cast's gradient is the cast back (stochastic rounding is treated as
# straight-through), matching Tensor.to.


def _setup_ctx_dtype(ctx, inputs, output, keyword_only_inputs=None):
    ctx.in_dtype = inputs[0].dtype


def _backward_to_input_dtype(ctx, grad):
    return grad.to(ctx.in_dtype)


for _name in ("mpext::to_bf16", "mpext::to_fp16", "mpext::to_fp32"):
    torch.library.register_autograd(_name, _backward_to_input_dtype,
                                    setup_context=_setup_ctx_dtype)
del _name
