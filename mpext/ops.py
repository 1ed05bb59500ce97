"""Typed Python wrappers of the torch.ops.mpext operators, their fake (meta) kernels and their
autograd formulas. The schemas live in csrc/torch/registration.cpp; the CPU kernels in
csrc/core (C) behind csrc/torch/*.cpp, the CUDA kernels in cuda/*.cu behind
csrc/torch/*_cuda.cpp.
"""
import math
import numbers
from typing import List, Optional, Sequence

import torch

from ._C import build_info as _build_info
from ._common import PARAM_DTYPES as _PARAM_DTYPES, dtype_name as _dtype_name
from ._common import is_dense as _is_dense

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
    ``seed`` is any int in [-2**63, 2**64), ``offset`` an int in [0, 2**63).
    """
    _check_strided(x, "to_bf16", "x")
    return _ops.to_bf16(x, stochastic=stochastic, seed=_seed64(seed, "to_bf16"),
                        offset=_offset63(offset, "to_bf16"))


def to_fp16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> fp16, round to nearest even, bit-identical to ``x.to(torch.float16)`` for every
    non-NaN input (subnormals rounded, not flushed; overflow to +-Inf)."""
    _check_strided(x, "to_fp16", "x")
    return _ops.to_fp16(x)


def to_fp32(x: torch.Tensor) -> torch.Tensor:
    """bf16 or fp16 -> fp32, exact."""
    _check_strided(x, "to_fp32", "x")
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
    dst, src = list(dst), list(src)
    for name, ts in (("dst", dst), ("src", src)):
        for i, t in enumerate(ts):
            _check_strided(t, "cast_", "%s[%d]" % (name, i))
    _ops.cast_(dst, src, stochastic=stochastic, seed=_seed64(seed, "cast_"),
               offset=_offset63(offset, "cast_"))


def _check_strided(t, op: str, name: str) -> None:
    """A sparse tensor would dispatch to a backend with no kernel and a generic error."""
    if isinstance(t, torch.Tensor) and t.layout != torch.strided:
        raise RuntimeError("mpext.%s: %s must be a strided (dense) tensor, got layout %s"
                           % (op, name, t.layout))


def _check_int(v, op: str, name: str) -> int:
    """v as an int; a float, bool or anything else that is not an integer raises TypeError."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError("mpext.%s: %s must be an int, got %r" % (op, name, v))
    return int(v)


def _seed64(seed: int, op: str = "cast") -> int:
    """Maps any Python int seed onto the int64 the schema carries (the kernels read it as
    uint64), so seeds in [0, 2**64) all work."""
    seed = _check_int(seed, op, "seed")
    if not -(2 ** 63) <= seed < 2 ** 64:
        raise ValueError("mpext.%s: seed must be in [-2**63, 2**64), got %d" % (op, seed))
    return seed - 2 ** 64 if seed >= 2 ** 63 else seed


def _offset63(offset: int, op: str) -> int:
    """The stochastic-rounding stream offset: an int64 >= 0 (the C++ layer rejects negatives
    too; this catches values the schema's int64 cannot carry)."""
    offset = _check_int(offset, op, "offset")
    if offset < 0:
        raise ValueError("mpext.%s: offset must be >= 0, got %d" % (op, offset))
    if offset >= 2 ** 63:
        raise ValueError("mpext.%s: offset must be < 2**63, got %d" % (op, offset))
    return offset


# ---------------------------------------------------------------------------------------------
# Fake kernels: shapes, dtypes and layouts without touching data (torch.compile, meta tensors).


def _cast_out_fake(x, op, from_dtypes, to_dtype):
    """The checks of a one-tensor cast (x's dtype, x dense) and its output: x's shape and
    layout in ``to_dtype``."""
    torch._check(x.dtype in from_dtypes,
                 lambda: "mpext.%s: x must have dtype %s, got %s"
                 % (op, " or ".join(_dtype_name(d) for d in from_dtypes), _dtype_name(x.dtype)))
    _check_fake_dense_named(x, op, "x")
    return torch.empty_like(x, dtype=to_dtype)


@torch.library.register_fake("mpext::to_bf16")
def _to_bf16_fake(x, *, stochastic=False, seed=0, offset=0):
    return _cast_out_fake(x, "to_bf16", (torch.float32,), torch.bfloat16)


@torch.library.register_fake("mpext::to_fp16")
def _to_fp16_fake(x):
    return _cast_out_fake(x, "to_fp16", (torch.float32,), torch.float16)


@torch.library.register_fake("mpext::to_fp32")
def _to_fp32_fake(x):
    return _cast_out_fake(x, "to_fp32", (torch.bfloat16, torch.float16), torch.float32)


@torch.library.register_fake("mpext::cast_")
def _cast_fake(dst, src, *, stochastic=False, seed=0, offset=0):
    torch._check(len(dst) == len(src),
                 lambda: "mpext.cast_: dst and src must have the same length, got %d and %d"
                 % (len(dst), len(src)))
    device = dst[0].device if len(dst) else None
    for i, (d, s) in enumerate(zip(dst, src)):
        for name, t in (("dst", d), ("src", s)):
            torch._check(t.device == device,
                         lambda: "mpext.cast_: %s[%d] is on %s but dst[0] is on %s; all tensors "
                         "must be on one device" % (name, i, t.device, device))
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


# ---------------------------------------------------------------------------------------------
# Loss scaling: the fused unscale-and-check-non-finite op and the on-device loss-scale rule.

__all__ += ["unscale_", "update_scale_"]


def unscale_(grads: Sequence[torch.Tensor], found_inf: torch.Tensor,
             inv_scale: torch.Tensor) -> None:
    """``g *= inv_scale`` in place for every tensor ``g`` of ``grads``, in one pass over the
    whole list, and ``found_inf`` set to 1 if any element (before the multiply) is NaN or
    +-Inf; ``found_inf`` is never cleared, so several calls accumulate into one flag.

    The same results as ``torch._amp_foreach_non_finite_check_and_unscale_``: each value is
    widened to fp32, multiplied in fp32 and rounded back to its dtype (nearest even), bit for
    bit for every non-NaN input (a NaN stays NaN; its payload bits may differ). ``grads`` may mix
    float32, bfloat16 and float16 tensors; each must be dense (contiguous, channels_last, ...)
    and none may share memory with another or with ``found_inf`` / ``inv_scale``.
    ``found_inf`` and ``inv_scale`` are one-element float32 tensors on the grads' device; both
    stay on the device (no host synchronisation). When ``inv_scale`` is 1 the gradients are
    only read, never written: a pure non-finite check. Every argument is checked before
    anything is written.
    """
    grads = list(grads)
    for i, g in enumerate(grads):
        # A sparse tensor would dispatch to a backend with no kernel and a generic error.
        if isinstance(g, torch.Tensor) and g.layout != torch.strided:
            raise RuntimeError("mpext.unscale_: grads[%d] must be a strided (dense) tensor, got "
                               "layout %s (for a sparse gradient pass its _values())"
                               % (i, g.layout))
    _ops.unscale_(grads, found_inf, inv_scale)


def update_scale_(scale: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor,
                  growth_factor: float, backoff_factor: float, growth_interval: int, *,
                  hysteresis_tracker: Optional[torch.Tensor] = None, hysteresis: int = 1,
                  min_scale: Optional[float] = None, max_scale: Optional[float] = None,
                  stats: Optional[torch.Tensor] = None) -> None:
    """One step of the dynamic loss-scale rule, on the device (no host synchronisation).

    ``scale`` (float32, one element), ``growth_tracker`` (int32, one element) are updated in
    place from ``found_inf`` (float32, one element; non-zero = the step overflowed). With the
    defaults this is exactly ``torch._amp_update_scale_``:

    * overflow: ``scale *= backoff_factor`` (computed in double, rounded to float32) and the
      tracker is reset to 0;
    * clean step: the tracker counts up; when it reaches ``growth_interval`` the scale is
      multiplied by ``growth_factor`` (kept only if the result is finite) and the tracker reset.

    Opt-in extensions:

    * ``hysteresis=N`` (needs ``hysteresis_tracker``, an int32 one-element tensor holding the
      tolerance left, initialised to N): an overflow backs off only when the tracker is at most
      1, otherwise it decrements the tracker; a clean step refills it to N. Every overflow still
      resets ``growth_tracker``.
    * ``min_scale``: a back-off never takes the scale below it (a scale already below it stays).
    * ``max_scale``: growth never takes the scale above it (it is clamped to ``max_scale``).
    * ``stats``: an int64 tensor of 2 elements, ``[skipped steps, consecutive overflows]``:
      ``stats[0]`` counts every overflow, ``stats[1]`` the current run of them (0 after a clean
      step).

    ``None`` (or 0) bounds mean unbounded. Every tensor must be on ``scale``'s device. Every
    argument is checked before anything is written.
    """
    _ops.update_scale_(scale, growth_tracker, found_inf, float(growth_factor),
                       float(backoff_factor),
                       _check_int(growth_interval, "update_scale_", "growth_interval"),
                       hysteresis_tracker=hysteresis_tracker,
                       hysteresis=_check_int(hysteresis, "update_scale_", "hysteresis"),
                       min_scale=0.0 if min_scale is None else float(min_scale),
                       max_scale=0.0 if max_scale is None else float(max_scale), stats=stats)


def _check_fake_device(t: torch.Tensor, op: str, name: str, device: torch.device, owner: str,
                       cpu_ok: bool = False) -> None:
    """The fake-kernel twin of the C++ check_device: the one wording of a device mismatch."""
    torch._check(t.device == device or (cpu_ok and t.device.type == "cpu"),
                 lambda: "mpext.%s: %s is on %s but %s is on %s%s"
                 % (op, name, t.device, owner, device, " (it may also be on the CPU)" if cpu_ok
                    else "; all tensors must be on one device"))


def _check_fake_scalar(t: torch.Tensor, op: str, name: str, dtype: torch.dtype, numel: int,
                       device: torch.device, owner: str, cpu_ok: bool = False) -> None:
    """The fake-kernel twin of the C++ check_scalars: dtype, element count, device, layout."""
    torch._check(t.dtype == dtype, lambda: "mpext.%s: %s must have dtype %s, got %s"
                 % (op, name, _dtype_name(dtype), _dtype_name(t.dtype)))
    torch._check(t.numel() == numel, lambda: "mpext.%s: %s must have %d %s, got %s"
                 % (op, name, numel, "element" if numel == 1 else "elements", t.numel()))
    _check_fake_device(t, op, name, device, owner, cpu_ok)
    _check_fake_dense_named(t, op, name)


@torch.library.register_fake("mpext::unscale_")
def _unscale_fake(grads, found_inf, inv_scale):
    op = "unscale_"
    device = found_inf.device
    _check_fake_scalar(found_inf, op, "found_inf", torch.float32, 1, device, "found_inf")
    _check_fake_scalar(inv_scale, op, "inv_scale", torch.float32, 1, device, "found_inf")
    for i, g in enumerate(grads):
        torch._check(g.device == device,
                     lambda: "mpext.%s: grads[%d] is on %s but found_inf is on %s; all tensors "
                     "must be on one device" % (op, i, g.device, device))
        torch._check(g.dtype in (torch.float32, torch.bfloat16, torch.float16),
                     lambda: "mpext.%s: grads[%d] must have dtype float32 or bfloat16 or "
                     "float16, got %s" % (op, i, _dtype_name(g.dtype)))
        torch._check(g.layout == torch.strided,
                     lambda: "mpext.%s: grads[%d] must be a strided (dense) tensor" % (op, i))
    return None


@torch.library.register_fake("mpext::update_scale_")
def _update_scale_fake(scale, growth_tracker, found_inf, growth_factor, backoff_factor,
                       growth_interval, *, hysteresis_tracker=None, hysteresis=1, min_scale=0.0,
                       max_scale=0.0, stats=None):
    op = "update_scale_"
    device = scale.device
    _check_fake_scalar(scale, op, "scale", torch.float32, 1, device, "scale")
    _check_fake_scalar(growth_tracker, op, "growth_tracker", torch.int32, 1, device, "scale")
    _check_fake_scalar(found_inf, op, "found_inf", torch.float32, 1, device, "scale")
    torch._check_value(math.isfinite(growth_factor) and growth_factor > 0,
                       lambda: "mpext.%s: growth_factor must be a positive finite number, got %s"
                       % (op, growth_factor))
    torch._check_value(math.isfinite(backoff_factor) and backoff_factor > 0,
                       lambda: "mpext.%s: backoff_factor must be a positive finite number, got "
                       "%s" % (op, backoff_factor))
    torch._check_value(1 <= growth_interval <= 2 ** 31 - 1,
                       lambda: "mpext.%s: growth_interval must be in [1, 2^31), got %s"
                       % (op, growth_interval))
    torch._check_value(1 <= hysteresis <= 2 ** 31 - 1,
                       lambda: "mpext.%s: hysteresis must be in [1, 2^31), got %s"
                       % (op, hysteresis))
    torch._check_value(hysteresis == 1 or hysteresis_tracker is not None,
                       lambda: "mpext.%s: hysteresis=%s needs a hysteresis_tracker tensor"
                       % (op, hysteresis))
    if hysteresis_tracker is not None:
        _check_fake_scalar(hysteresis_tracker, op, "hysteresis_tracker", torch.int32, 1, device,
                           "scale")
    if stats is not None:
        _check_fake_scalar(stats, op, "stats", torch.int64, 2, device, "scale")
    for name, v in (("min_scale", min_scale), ("max_scale", max_scale)):
        torch._check_value(math.isfinite(v) and v >= 0,
                           lambda: "mpext.%s: %s must be a finite number >= 0 (0 = no bound), "
                           "got %s" % (op, name, v))
    torch._check_value(min_scale == 0 or max_scale == 0 or min_scale <= max_scale,
                       lambda: "mpext.%s: min_scale (%s) must not exceed max_scale (%s)"
                       % (op, min_scale, max_scale))
    return None


# ---------------------------------------------------------------------------------------------
# Adam / AdamW: one fused pass over memory per step, with optional master weights, fused
# unscale and on-device skip.

__all__ += ["adam_step_"]

def adam_step_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
               exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
               masters: Optional[Sequence[torch.Tensor]], steps: Sequence[torch.Tensor],
               lr, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
               weight_decay: float = 0.0, decoupled: bool = False, maximize: bool = False, *,
               inv_scale: Optional[torch.Tensor] = None,
               found_inf: Optional[torch.Tensor] = None, unscale_grads: bool = False,
               remainders: Optional[Sequence[torch.Tensor]] = None, master_free: bool = False,
               stochastic_rounding: bool = False, moments_round_nearest: bool = False,
               seed: int = 0, sr_streams: Optional[Sequence[int]] = None,
               exp_avg_scales: Optional[Sequence[torch.Tensor]] = None,
               exp_avg_sq_scales: Optional[Sequence[torch.Tensor]] = None,
               block_size: int = 256, ema_params: Optional[Sequence[torch.Tensor]] = None,
               ema_decay: float = 0.0, offsets: Optional[Sequence[int]] = None,
               stats: Optional[torch.Tensor] = None) -> None:
    """One Adam (``decoupled=False``: L2 weight decay added to the gradient, as
    ``torch.optim.Adam``) or AdamW (``decoupled=True``: ``p *= 1 - lr * weight_decay``, as
    ``torch.optim.AdamW``) step for every param of the lists, in one pass over memory.

    Per param ``i``: ``steps[i]`` (a one-element float32 tensor) is incremented, the gradient
    ``grads[i]`` is multiplied by ``inv_scale`` (when given; a fused unscale), negated with
    ``maximize``, and the fp32 moments ``exp_avgs[i]`` / ``exp_avg_sqs[i]`` and the param are
    updated with torch's formulas (bias corrections from the new step count, eps added after
    dividing ``sqrt(v)`` by ``sqrt(1 - beta2^t)``). A bfloat16/float16 param needs an fp32
    master, ``masters[i]``: the update is computed on the master, and the param is written as
    the round-to-nearest-even of the new master. For a float32 param ``masters[i]`` is an empty
    float32 tensor; ``masters`` may also be empty (or None) when every param is float32.

    ``grads[i]`` has the param's dtype or float32; moments and masters are float32, with the
    param's shape and memory layout (any dense layout). Every tensor is on the params' device,
    except ``lr``, which may also be on the CPU: a one-element float32 tensor (a Python number is
    accepted and put in one on the params' device). ``inv_scale`` and ``found_inf`` are optional
    one-element float32 tensors. With ``unscale_grads`` each gradient is also overwritten with
    its unscaled value (``grads[i] * inv_scale`` rounded to its dtype, in the same pass), which
    is what torch's fused optimizers leave in ``.grad``; nothing is written into the gradients
    when ``inv_scale`` is absent or 1. Written tensors (params, moments, masters, steps, and the
    gradients with ``unscale_grads``) must not share memory with any other tensor of the call.
    When ``found_inf`` is non-zero,
    nothing at all is written and the steps are not advanced -- decided on the device, with no
    host synchronisation. Every argument is checked before anything is written.

    Leaner state. A bfloat16 param may keep its fp32 value as an int16 *remainder*
    (``remainders[i]``, the low 16 bits of the master: the master is exactly
    ``(param bits << 16) + remainder``), which gives the same bits as an fp32 master in 2 bytes
    instead of 4. With ``master_free=True`` a bfloat16/float16 param with neither master nor
    remainder is updated from its own value and written back to nearest even, or with
    ``stochastic_rounding=True`` rounded stochastically (unbiased). ``exp_avgs[i]`` and
    ``exp_avg_sqs[i]`` may be bfloat16: they are stored with stochastic rounding (unbiased), or
    to nearest even with ``moments_round_nearest=True`` (biased; kept for comparisons). An
    empty tensor in ``masters`` or ``remainders`` means "none" for its param. Stochastic
    rounding is reproducible: its bits depend only on ``seed`` (an int in [-2**63, 2**64)), the
    param's step count, its ``sr_streams`` entry (in [0, 2^32); default: its position in the
    list) and the element's position -- not on threads, CPU ISA or device.

    8-bit moments: ``exp_avgs[i]`` int8 and ``exp_avg_sqs[i]`` uint8 (together) hold codes, one
    per element, of blocks of ``block_size`` elements (a power of two in [32, 2048]); each
    block's float32 absmax is in ``exp_avg_scales[i]`` / ``exp_avg_sq_scales[i]``
    (``ceil(numel / block_size)`` elements; an empty tensor for a param with other moments).
    The step decodes them, updates in fp32 and writes each block's new codes and scale in the
    same pass, rounding stochastically (or to nearest with ``moments_round_nearest``);
    docs/moments_8bit.md has the format.
    EMA. ``ema_params[i]`` (float32, in the param's layout; an empty tensor for none) is moved
    towards the param's new fp32 value in the same pass, ``ema = torch.lerp(ema, value, 1 -
    ema_decay)`` (torch's formula, ``a + w * (b - a)`` for ``w < 0.5`` else ``b - (b - a) * (1 -
    w)``, each operation rounded to fp32; torch's vectorized CPU kernel fuses the multiply-add
    and can differ in the last bit), and copied from it on the param's first step (its step
    count 0), as ``torch.optim.swa_utils.AveragedModel`` with ``get_ema_multi_avg_fn`` averages:
    the value is the master (as stored), or without one the fp32 update before rounding.
    ``ema_decay`` is in [0, 1].
    Shards. ``offsets[i]`` (default 0) is the position of the tensor's first element in its
    whole parameter: the random bits are drawn at that position plus the element's, so that a
    shard rounds as the unsharded param would (with 8-bit moments, a multiple of
    ``block_size``).
    Telemetry (every step op). ``stats``, a contiguous float64 ``[len(params), 13]`` tensor on
    the params' device, gets the step's counters added to it, row ``i`` param ``i``'s (the
    columns are ``mpext.telemetry.STEP_COLUMNS``: lost and unmoved updates, moment rounding
    errors, 8-bit flushed values and saturated blocks, the EMA's lag; docs/telemetry.md), in
    the same pass and with the same bits in every other tensor; ``None`` runs the uncounted
    kernels. CPU only so far.
    """
    (params, grads, (exp_avgs, exp_avg_sqs), masters, steps, lr,
     kw) = _prepare_step("adam_step_", params, grads, (("exp_avgs", exp_avgs),
                                                       ("exp_avg_sqs", exp_avg_sqs)),
                         masters, steps, lr, remainders, ema_params, seed, sr_streams,
                         (("exp_avg_scales", exp_avg_scales),
                          ("exp_avg_sq_scales", exp_avg_sq_scales)),
                         block_size, offsets, inv_scale, found_inf)
    _ops.adam_step_(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr,
                    float(beta1), float(beta2), float(eps), float(weight_decay), bool(decoupled),
                    bool(maximize), inv_scale=inv_scale, found_inf=found_inf,
                    unscale_grads=bool(unscale_grads), master_free=bool(master_free),
                    stochastic_rounding=bool(stochastic_rounding),
                    moments_round_nearest=bool(moments_round_nearest),
                    ema_decay=float(ema_decay), stats=stats, **kw)


def _prepare_step(op, params, grads, moments, masters, steps, lr, remainders, ema_params, seed,
                  sr_streams, scales, block_size, offsets, inv_scale, found_inf):
    """The arguments of any rule's step op as the schema takes them (lists, an lr tensor, a
    64-bit seed), sparse tensors refused with a clear error: (params, grads, moment lists,
    masters, steps, lr, the storage keywords by their op names)."""
    params, grads = list(params), list(grads)
    masters = [] if masters is None else list(masters)
    remainders = None if remainders is None else list(remainders)
    ema_params = None if ema_params is None else list(ema_params)
    moment_lists = tuple(list(ts) for _, ts in moments)
    scale_lists = tuple(None if ts is None else list(ts) for _, ts in scales)
    steps = list(steps)
    # A sparse tensor would dispatch to a backend with no kernel and a generic error.
    named = ([("params", params), ("grads", grads)]
             + [(name, ts) for (name, _), ts in zip(moments, moment_lists)]
             + [("masters", masters), ("steps", steps), ("remainders", remainders or [])]
             + [(name, ts or []) for (name, _), ts in zip(scales, scale_lists)]
             + [("ema_params", ema_params or [])])
    for name, ts in named:
        for i, t in enumerate(ts):
            if isinstance(t, torch.Tensor) and t.layout != torch.strided:
                raise RuntimeError("mpext.%s: %s[%d] must be a strided (dense) tensor, "
                                   "got layout %s" % (op, name, i, t.layout))
    for name, t in (("lr", lr), ("inv_scale", inv_scale), ("found_inf", found_inf)):
        if isinstance(t, torch.Tensor) and t.layout != torch.strided:
            raise RuntimeError("mpext.%s: %s must be a strided (dense) tensor, got "
                               "layout %s" % (op, name, t.layout))
    seed = _seed64(seed, op)
    if sr_streams is not None:
        sr_streams = [_check_int(k, op, "sr_streams[%d]" % i) for i, k in enumerate(sr_streams)]
    if offsets is not None:
        offsets = [_check_int(k, op, "offsets[%d]" % i) for i, k in enumerate(offsets)]
    block_size = _check_int(block_size, op, "block_size")
    if not isinstance(lr, torch.Tensor):
        device = params[0].device if params else torch.device("cpu")
        lr = torch.full((), float(lr), dtype=torch.float32, device=device)
    kw = dict(remainders=remainders, seed=seed, sr_streams=sr_streams, block_size=block_size,
              ema_params=ema_params, offsets=offsets)
    for (name, _), ts in zip(scales, scale_lists):
        kw[name] = ts
    return params, grads, moment_lists, masters, steps, lr, kw


__all__ += ["lion_step_", "sgd_step_"]


def lion_step_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
               exp_avgs: Sequence[torch.Tensor], masters: Optional[Sequence[torch.Tensor]],
               steps: Sequence[torch.Tensor], lr, beta1: float = 0.9, beta2: float = 0.99,
               weight_decay: float = 0.0, maximize: bool = False, *,
               inv_scale: Optional[torch.Tensor] = None,
               found_inf: Optional[torch.Tensor] = None, unscale_grads: bool = False,
               remainders: Optional[Sequence[torch.Tensor]] = None, master_free: bool = False,
               stochastic_rounding: bool = False, moments_round_nearest: bool = False,
               seed: int = 0, sr_streams: Optional[Sequence[int]] = None,
               exp_avg_scales: Optional[Sequence[torch.Tensor]] = None,
               block_size: int = 256, ema_params: Optional[Sequence[torch.Tensor]] = None,
               ema_decay: float = 0.0, offsets: Optional[Sequence[int]] = None,
               stats: Optional[torch.Tensor] = None) -> None:
    """One Lion step (lion-pytorch's update) for every param of the lists, in one pass over
    memory, with the storage of :func:`adam_step_` (masters, remainders, master-free params
    with stochastic rounding, fused unscale, on-device skip, ema, sr_streams, offsets). Per
    element, in fp32 and lion-pytorch's order (torch's ``add(x, alpha=a)`` is one fused
    multiply-add, as here)::

        g = grad * inv_scale;  g = -g if maximize
        p = p * (1 - lr * weight_decay)
        p = p - lr * sign(exp_avg * beta1 + (1 - beta1) * g)
        exp_avg = exp_avg * beta2 + (1 - beta2) * g

    with beta1, beta2 in [0, 1]. One moment, ``exp_avgs[i]``: float32, bfloat16 (stochastic
    rounding, or to nearest with ``moments_round_nearest``) or int8 block codes with one
    float32 absmax per block in ``exp_avg_scales[i]`` (the signed code of adam_step_'s
    exp_avg). ``steps[i]`` advances by one (it names the random streams)."""
    (params, grads, (exp_avgs,), masters, steps, lr,
     kw) = _prepare_step("lion_step_", params, grads, (("exp_avgs", exp_avgs),), masters,
                         steps, lr, remainders, ema_params, seed, sr_streams,
                         (("exp_avg_scales", exp_avg_scales),), block_size, offsets,
                         inv_scale, found_inf)
    _ops.lion_step_(params, grads, exp_avgs, masters, steps, lr, float(beta1), float(beta2),
                    float(weight_decay), bool(maximize), inv_scale=inv_scale,
                    found_inf=found_inf, unscale_grads=bool(unscale_grads),
                    master_free=bool(master_free), stochastic_rounding=bool(stochastic_rounding),
                    moments_round_nearest=bool(moments_round_nearest),
                    ema_decay=float(ema_decay), stats=stats, **kw)


def sgd_step_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
              momentum_buffers: Sequence[torch.Tensor],
              masters: Optional[Sequence[torch.Tensor]], steps: Sequence[torch.Tensor], lr,
              momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
              nesterov: bool = False, maximize: bool = False, *,
              inv_scale: Optional[torch.Tensor] = None,
              found_inf: Optional[torch.Tensor] = None, unscale_grads: bool = False,
              remainders: Optional[Sequence[torch.Tensor]] = None, master_free: bool = False,
              stochastic_rounding: bool = False, moments_round_nearest: bool = False,
              seed: int = 0, sr_streams: Optional[Sequence[int]] = None,
              momentum_buffer_scales: Optional[Sequence[torch.Tensor]] = None,
              block_size: int = 256, ema_params: Optional[Sequence[torch.Tensor]] = None,
              ema_decay: float = 0.0, offsets: Optional[Sequence[int]] = None,
              stats: Optional[torch.Tensor] = None) -> None:
    """One SGD step (torch.optim.SGD's update) for every param of the lists, in one pass over
    memory, with the storage of :func:`adam_step_`. Per element, in fp32 and torch's order
    (each ``add(x, alpha=a)`` one fused multiply-add, as torch's CPU kernels compute it)::

        g = grad * inv_scale;  g = -g if maximize;  g = g + weight_decay * p (if weight_decay)
        with momentum: buf = g on the param's first step (steps[i] == 0), else
                       buf = buf * momentum + (1 - dampening) * g;
                       g = g + momentum * buf with nesterov, else buf
        p = p - lr * g

    ``momentum_buffers`` is empty when ``momentum`` is 0 (no buffer is kept), else one buffer
    per param: float32, bfloat16 or int8 block codes with ``momentum_buffer_scales``.
    ``nesterov`` needs a momentum and zero dampening (torch's check)."""
    (params, grads, (buffers,), masters, steps, lr,
     kw) = _prepare_step("sgd_step_", params, grads, (("momentum_buffers", momentum_buffers),),
                         masters, steps, lr, remainders, ema_params, seed, sr_streams,
                         (("momentum_buffer_scales", momentum_buffer_scales),), block_size,
                         offsets, inv_scale, found_inf)
    _ops.sgd_step_(params, grads, buffers, masters, steps, lr, float(momentum),
                   float(dampening), float(weight_decay), bool(nesterov), bool(maximize),
                   inv_scale=inv_scale, found_inf=found_inf, unscale_grads=bool(unscale_grads),
                   master_free=bool(master_free), stochastic_rounding=bool(stochastic_rounding),
                   moments_round_nearest=bool(moments_round_nearest),
                   ema_decay=float(ema_decay), stats=stats, **kw)


# muon
__all__ += ["muon_momentum_step_", "muon_update_step_"]


def muon_momentum_step_(updates: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                        momentum_buffers: Sequence[torch.Tensor], steps: Sequence[torch.Tensor],
                        momentum: float = 0.95, nesterov: bool = True, *,
                        inv_scale: Optional[torch.Tensor] = None,
                        found_inf: Optional[torch.Tensor] = None, unscale_grads: bool = False,
                        moments_round_nearest: bool = False, seed: int = 0,
                        sr_streams: Optional[Sequence[int]] = None,
                        momentum_buffer_scales: Optional[Sequence[torch.Tensor]] = None,
                        block_size: int = 256, offsets: Optional[Sequence[int]] = None,
                        stats: Optional[torch.Tensor] = None) -> None:
    """Muon's first phase (torch.optim.Muon's momentum lines) for every param of the lists, in
    one pass over memory: the buffer in its format (float32, bfloat16 rounded per
    ``moments_round_nearest``, or int8 block codes with ``momentum_buffer_scales``), the fused
    unscale and skip of :func:`adam_step_`. Per element, in fp32 and torch's order (torch's
    lerp is one fused multiply-add from the nearer end)::

        g = grad * inv_scale
        buf = lerp(buf, g, 1 - momentum)
        updates[i] = lerp(g, buf, momentum) if nesterov else buf

    ``updates`` are written in their dtype, to nearest even (bfloat16: torch's ``.bfloat16()``
    of the fp32 update, which Newton-Schulz reads). ``steps`` name the random streams and
    advance by one, as every rule's op (mpext.optim.Muon passes copies: its third phase ends
    the step)."""
    (updates, grads, (buffers,), _, steps, lr,
     kw) = _prepare_step("muon_momentum_step_", updates, grads,
                         (("momentum_buffers", momentum_buffers),), None, steps, 0.0, None, None,
                         seed, sr_streams, (("momentum_buffer_scales", momentum_buffer_scales),),
                         block_size, offsets, inv_scale, found_inf)
    _ops.muon_momentum_step_(updates, grads, buffers, [], steps, lr, float(momentum),
                             bool(nesterov), inv_scale=inv_scale, found_inf=found_inf,
                             unscale_grads=bool(unscale_grads), master_free=True,
                             moments_round_nearest=bool(moments_round_nearest), stats=stats,
                             **kw)


def muon_update_step_(params: Sequence[torch.Tensor], updates: Sequence[torch.Tensor],
                      masters: Optional[Sequence[torch.Tensor]], steps: Sequence[torch.Tensor],
                      lr, lr_ratio: float = 1.0, weight_decay: float = 0.1, *,
                      found_inf: Optional[torch.Tensor] = None,
                      remainders: Optional[Sequence[torch.Tensor]] = None,
                      master_free: bool = False, stochastic_rounding: bool = False,
                      seed: int = 0, sr_streams: Optional[Sequence[int]] = None,
                      ema_params: Optional[Sequence[torch.Tensor]] = None,
                      ema_decay: float = 0.0, offsets: Optional[Sequence[int]] = None,
                      stats: Optional[torch.Tensor] = None) -> None:
    """Muon's third phase (torch.optim.Muon's param lines) for every param of the lists, with the
    param storage of :func:`adam_step_` (masters, remainders, master-free params with
    stochastic rounding, on-device skip, ema, sr_streams, offsets). Per element, in fp32 and
    torch's order (``add_(x, alpha=a)`` one fused multiply-add)::

        p = p * (1 - lr * weight_decay)
        p = p - (lr * lr_ratio) * updates[i]

    ``updates`` the orthogonalised updates (float32, or the param's dtype); ``steps`` advance
    by one."""
    (params, updates, _, masters, steps, lr,
     kw) = _prepare_step("muon_update_step_", params, updates, (), masters, steps, lr,
                         remainders, ema_params, seed, sr_streams, (), 256, offsets, None,
                         found_inf)
    _ops.muon_update_step_(params, updates, masters, steps, lr, float(lr_ratio),
                           float(weight_decay), found_inf=found_inf,
                           master_free=bool(master_free),
                           stochastic_rounding=bool(stochastic_rounding),
                           ema_decay=float(ema_decay), stats=stats, **kw)


def _sizes(t: torch.Tensor) -> str:
    return "[%s]" % ", ".join(str(int(d)) for d in t.shape)


def _strides(t: torch.Tensor) -> str:
    return "[%s]" % ", ".join(str(int(d)) for d in t.stride())


def _check_fake_dense_named(t: torch.Tensor, op: str, name: str) -> None:
    """The fake-kernel twin of the C++ check_dense."""
    torch._check(t.layout == torch.strided, lambda: "mpext.%s: %s must be a strided (dense) "
                 "tensor, got layout %s" % (op, name, t.layout))
    torch._check(_is_dense(t), lambda: "mpext.%s: %s must be dense and non-overlapping (e.g. "
                 "contiguous or channels_last); got sizes %s and strides %s. Call .contiguous() "
                 "on it first." % (op, name, _sizes(t), _strides(t)))


def _step_fake_of(op):
    """The fake kernel of the step op ``op``: _step_fake over the arguments its schema names.
    The param's tensors go in the planner's order: the schema's lists after params, with steps
    before masters (plan_step checks a param's step count before its storage)."""
    arguments = getattr(_ops, op).default._schema.arguments
    positional = [a.name for a in arguments if not a.kwarg_only]
    lists = [a.name for a in arguments if a.name != "params"
             and str(a.type) in ("List[Tensor]", "Optional[List[Tensor]]")]
    lists.remove("steps")
    lists.insert(lists.index("masters"), "steps")

    def fake(*args, **kwargs):
        bound = dict(zip(positional, args), **kwargs)
        return _step_fake(op, bound["params"], bound["lr"], bound.get("inv_scale"),
                          bound.get("found_inf"), [(name, bound.get(name)) for name in lists])
    fake.__name__ = "_%s_fake" % op.rstrip("_")
    return fake


# One fake for every rule's step op, "<name>_step_" of each row of mpext/rules/rules.h (which
# mpext._C lists): it binds nothing rule-specific, so a rule registers none of its own.
for _rule in _build_info()["rules"]:
    torch.library.register_fake("mpext::%s_step_" % _rule)(_step_fake_of(_rule + "_step_"))
del _rule


def _step_fake(op, params, lr, inv_scale, found_inf, lists):
    """The fake kernel of every rule's step op. A step writes its arguments in place and
    returns nothing, so tracing (torch.compile, FakeTensorMode) needs nothing of it: it checks
    no argument, and a bad one meets the C++ planner (plan_step) when the op runs, with the
    planner's exception and message, as in eager mode. The planner's messages live there
    alone.

    One call ends here and in no real kernel: meta tensors mixed with tensors on a real device
    (the dispatcher picks the Meta kernel for a meta tensor in a required list or scalar). It
    is refused as the planner refuses two devices, in its order (lr, inv_scale, found_inf, then
    each param's tensors; ``lists``: the (name, list or None) pairs after params) and wording;
    a call on meta tensors alone is a no-op."""
    if not params:  # the planner then checks each scalar on its own device: nothing to mix
        return None
    named = [("lr", lr, True), ("inv_scale", inv_scale, False), ("found_inf", found_inf, False)]
    for i, p in enumerate(params):
        named.append(("params[%d]" % i, p, False))
        named += [("%s[%d]" % (name, i), ts[i], False) for name, ts in lists
                  if ts is not None and i < len(ts)]
    named = [(name, t, cpu_ok) for name, t, cpu_ok in named if isinstance(t, torch.Tensor)]
    if not any(t.device.type == "meta" for _, t, _ in named):
        return None
    for name, t, cpu_ok in named:
        _check_fake_device(t, op, name, params[0].device, "params[0]", cpu_ok)
    return None


# ---------------------------------------------------------------------------------------------
# Multi-tensor L2 norm (gradient clipping after unscaling, without a host sync).

__all__ += ["grad_norm"]


def grad_norm(tensors: Sequence[torch.Tensor], *,
              inv_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The L2 norm of a whole list of tensors, as one 0-dim float32 tensor on their device:
    ``sqrt(sum over every element x of every tensor of (float(x) * inv_scale) ** 2)``.

    This is the total norm ``torch.nn.utils.clip_grad_norm_`` computes (the vector norm of the
    per-tensor norms) of the gradients after an unscale pass, in one read-only pass and with no
    host synchronisation: pass the loss scaler's ``inv_scale`` (a one-element float32 tensor on
    the tensors' device) to get the norm of the unscaled gradients without unscaling them. Each
    value is widened to fp32 and multiplied by ``inv_scale`` in fp32 before squaring (as an
    unscale pass would store it); squares and sums are in double, so scaled gradients whose
    squares overflow fp32 still give the right norm. The result is +Inf beyond the fp32 range.

    NaN anywhere gives NaN; an Inf (and no NaN) gives +Inf, so the result doubles as the
    overflow check. ``tensors`` may mix float32, bfloat16 and float16, each dense in any layout
    (contiguous, channels_last, ...; read as flat memory); zero-size tensors count for nothing,
    and an empty list gives 0.0 (on ``inv_scale``'s device if given, else the CPU). All tensors
    must be on one device. The result is deterministic: on the CPU it has the same bits for any
    thread count and CPU ISA path (fixed pieces of 65536 elements per tensor, combined in a fixed
    order); on CUDA it is the same on every run (no atomics).

    DTensors (FSDP2's sharded gradients) give the norm of the whole tensors, a plain tensor
    equal on every rank: each rank's shards in one pass, then one all-reduce (SUM, in double)
    of the squared norm per mesh and sharded mesh dimension (a collective: every rank of the
    mesh calls it, with the same list). It differs from one process's norm of the full tensors
    by the rounding of each rank's partial norm to fp32 (relative 2^-23 at most).
    """
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        # A sparse tensor would dispatch to a backend with no kernel and a generic error.
        if isinstance(t, torch.Tensor) and t.layout != torch.strided:
            raise RuntimeError("mpext.grad_norm: tensors[%d] must be a strided (dense) tensor, "
                               "got layout %s" % (i, t.layout))
    if any(type(t).__name__ == "DTensor" and hasattr(t, "placements") for t in tensors):
        return _sharded_grad_norm(tensors, inv_scale)
    return _ops.grad_norm(tensors, inv_scale=inv_scale)


def _sharded_grad_norm(tensors: List[torch.Tensor],
                       inv_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """grad_norm of a list with DTensors: the squared norm of each (mesh, sharded dims) group's
    local shards summed over those dims, plus the rest's (replicated: counted once)."""
    import torch.distributed as dist
    groups = {}  # (mesh, sharded dims) -> local tensors, in first-seen order on every rank
    for t in tensors:
        key = None
        if hasattr(t, "placements"):
            dims = tuple(d for d, pl in enumerate(t.placements) if not pl.is_replicate())
            key = (t.device_mesh, dims) if dims else None
            t = t.to_local()
        groups.setdefault(key, []).append(t)
    total = None
    for key, local in groups.items():
        sq = _ops.grad_norm(local, inv_scale=inv_scale).double() ** 2
        if key is not None:
            mesh, dims = key
            for d in dims:
                dist.all_reduce(sq, group=mesh.get_group(d))
        total = sq if total is None else total + sq
    return total.sqrt().float()


@torch.library.register_fake("mpext::grad_norm")
def _grad_norm_fake(tensors, *, inv_scale=None):
    """The checks of the C++ check_grad_norm, in its order and with its messages."""
    op = "grad_norm"
    if len(tensors):
        device = tensors[0].device
    else:
        device = inv_scale.device if inv_scale is not None else torch.device("cpu")
    for i, t in enumerate(tensors):
        torch._check(t.device == device,
                     lambda: "mpext.%s: tensors[%d] is on %s but tensors[0] is on %s; all "
                     "tensors must be on one device" % (op, i, t.device, device))
        torch._check(t.dtype in _PARAM_DTYPES,
                     lambda: "mpext.%s: tensors[%d] must have dtype float32 or bfloat16 or "
                     "float16, got %s" % (op, i, _dtype_name(t.dtype)))
        _check_fake_dense_named(t, op, "tensors[%d]" % i)
    if inv_scale is not None:
        _check_fake_scalar(inv_scale, op, "inv_scale", torch.float32, 1, device, "tensors[0]")
    return torch.empty((), dtype=torch.float32, device=device)


# ---------------------------------------------------------------------------------------------
# FP8 with one scale per block of the last dimension (the storage of mpext.activations).

__all__ += ["fp8_quantize", "fp8_dequantize", "FP8_DTYPES"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_quantize(x: torch.Tensor, *, block_size: int = 128,
                 fp8_dtype: torch.dtype = torch.float8_e4m3fn, pow2_scale: bool = False,
                 stochastic: bool = False, seed: int = 0, offset: int = 0):
    """``(q, scales)``: ``x`` (float32, bfloat16 or float16, contiguous, at least 1-d) in FP8
    with one float32 scale per block of ``block_size`` elements of the last dimension (the last
    block of a row may be shorter). A block's scale is its largest finite ``|x|`` divided by the
    format's largest value (448 for ``float8_e4m3fn``, 57344 for ``float8_e5m2``), rounded up to
    a power of two when ``pow2_scale``, and at least ``2**-126``; ``q`` is
    ``(x.float() * (1 / scale)).to(fp8_dtype)`` bit for bit, or rounded stochastically with the
    random bits of stream position ``offset + i`` (``i`` the element's flat index) under
    ``seed``, as :func:`to_bf16`. ``scales`` has shape ``x.shape[:-1] + (nblocks,)``.

    NaN stays NaN; Inf stays Inf in E5M2 and becomes NaN in E4M3 (which has no Inf), so a
    non-finite value never comes back finite. Non-contiguous inputs are rejected (copy them
    with ``.contiguous()``).
    """
    _check_strided(x, "fp8_quantize", "x")
    return _ops.fp8_quantize(x, block_size=_check_int(block_size, "fp8_quantize", "block_size"),
                             fp8_dtype=fp8_dtype, pow2_scale=pow2_scale, stochastic=stochastic,
                             seed=_seed64(seed, "fp8_quantize"),
                             offset=_offset63(offset, "fp8_quantize"))


def fp8_dequantize(q: torch.Tensor, scales: torch.Tensor, *, block_size: int = 128,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of :func:`fp8_quantize`: ``(q.float() * scale).to(dtype)`` for each block
    (dtype float32, bfloat16 or float16, round to nearest even)."""
    _check_strided(q, "fp8_dequantize", "q")
    return _ops.fp8_dequantize(q, scales,
                               block_size=_check_int(block_size, "fp8_dequantize", "block_size"),
                               dtype=dtype)


def _fp8_scale_shape(shape, block_size):
    return tuple(shape[:-1]) + ((shape[-1] + block_size - 1) // block_size,)


def _check_fake_rows(t, op, name):
    torch._check(t.dim() >= 1, lambda: "mpext.%s: %s must have at least one dimension (the "
                 "blocks run along the last one)" % (op, name))
    torch._check(t.is_contiguous(), lambda: "mpext.%s: %s must be contiguous (the blocks run "
                 "along its last dimension); call .contiguous() on it first" % (op, name))


@torch.library.register_fake("mpext::fp8_quantize")
def _fp8_quantize_fake(x, *, block_size=128, fp8_dtype=None, pow2_scale=False, stochastic=False,
                       seed=0, offset=0):
    op = "fp8_quantize"
    _check_fake_rows(x, op, "x")
    torch._check(x.dtype in _PARAM_DTYPES, lambda: "mpext.%s: x must have dtype float32 or "
                 "bfloat16 or float16, got %s" % (op, _dtype_name(x.dtype)))
    torch._check(block_size >= 1, lambda: "mpext.%s: block_size must be >= 1" % op)
    fp8 = torch.float8_e4m3fn if fp8_dtype is None else fp8_dtype
    torch._check(fp8 in FP8_DTYPES, lambda: "mpext.%s: fp8_dtype must be float8_e4m3fn or "
                 "float8_e5m2" % op)
    return (torch.empty(x.shape, dtype=fp8, device=x.device),
            torch.empty(_fp8_scale_shape(x.shape, block_size), dtype=torch.float32,
                        device=x.device))


@torch.library.register_fake("mpext::fp8_dequantize")
def _fp8_dequantize_fake(q, scales, *, block_size=128, dtype=None):
    op = "fp8_dequantize"
    _check_fake_rows(q, op, "q")
    torch._check(q.dtype in FP8_DTYPES, lambda: "mpext.%s: q must have dtype float8_e4m3fn or "
                 "float8_e5m2, got %s" % (op, _dtype_name(q.dtype)))
    torch._check(block_size >= 1, lambda: "mpext.%s: block_size must be >= 1" % op)
    torch._check(tuple(scales.shape) == _fp8_scale_shape(q.shape, block_size),
                 lambda: "mpext.%s: scales must have shape %s" % (
                     op, _fp8_scale_shape(q.shape, block_size)))
    out = torch.float32 if dtype is None else dtype
    torch._check(out in _PARAM_DTYPES, lambda: "mpext.%s: dtype must be float32, bfloat16 or "
                 "float16" % op)
    return torch.empty(q.shape, dtype=out, device=q.device)


# --- unscale_stats_: unscale_ with per-gradient statistics (precision telemetry, mpext.telemetry;
# kernels in csrc/core/telemetry.c and cuda/telemetry.cu) ---
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

__all__ += ["unscale_stats_"]


# --- int8 block code (issue 42), begin: the int8 block code of saved activations
# (mpext.activations_codes; kernels in csrc/core/int8_block.c and cuda/int8_block.cu) ---
__all__ += ["int8_block_quantize", "int8_block_dequantize"]


def int8_block_quantize(x: torch.Tensor, *, block_size: int = 128, pow2_scale: bool = False):
    """``(q, scales)``: ``x`` (float32, bfloat16 or float16, contiguous, at least 1-d) as int8
    codes of ``x``'s shape and one float32 scale per block of ``block_size`` elements of the last
    dimension (the last block of a row may be shorter; ``scales`` has shape
    ``x.shape[:-1] + (nblocks,)``). A block's scale is ``max(absmax / 127, 2**-126)`` in float32,
    rounded up to a power of two when ``pow2_scale``; an element's code is
    ``clamp(round(x / scale), -127, 127)`` (round half to even), or the sign of ``x`` where that
    is 0 and ``x`` is not. A NaN or Inf makes its block's scale NaN or Inf, so the whole block
    restores non-finite. Non-contiguous inputs are rejected (copy them with ``.contiguous()``).
    """
    _check_strided(x, "int8_block_quantize", "x")
    return _ops.int8_block_quantize(
        x, block_size=_check_int(block_size, "int8_block_quantize", "block_size"),
        pow2_scale=pow2_scale)


def int8_block_dequantize(q: torch.Tensor, scales: torch.Tensor, *, block_size: int = 128,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of :func:`int8_block_quantize`: ``q * scale`` in float32 rounded to ``dtype``
    (float32, bfloat16 or float16, round to nearest even); for bfloat16 the scale is rounded to
    bfloat16 first (the product is then exact before its one rounding)."""
    _check_strided(q, "int8_block_dequantize", "q")
    return _ops.int8_block_dequantize(
        q, scales, block_size=_check_int(block_size, "int8_block_dequantize", "block_size"),
        dtype=dtype)


@torch.library.register_fake("mpext::int8_block_quantize")
def _int8_block_quantize_fake(x, *, block_size=128, pow2_scale=False):
    op = "int8_block_quantize"
    _check_fake_rows(x, op, "x")
    torch._check(x.dtype in _PARAM_DTYPES, lambda: "mpext.%s: x must have dtype float32 or "
                 "bfloat16 or float16, got %s" % (op, _dtype_name(x.dtype)))
    torch._check(block_size >= 1, lambda: "mpext.%s: block_size must be >= 1, got %d"
                 % (op, block_size))
    return (torch.empty(x.shape, dtype=torch.int8, device=x.device),
            torch.empty(_fp8_scale_shape(x.shape, block_size), dtype=torch.float32,
                        device=x.device))


@torch.library.register_fake("mpext::int8_block_dequantize")
def _int8_block_dequantize_fake(q, scales, *, block_size=128, dtype=None):
    op = "int8_block_dequantize"
    _check_fake_rows(q, op, "q")
    torch._check(q.dtype == torch.int8, lambda: "mpext.%s: q must have dtype int8, got %s"
                 % (op, _dtype_name(q.dtype)))
    torch._check(block_size >= 1, lambda: "mpext.%s: block_size must be >= 1, got %d"
                 % (op, block_size))
    torch._check(scales.dtype == torch.float32, lambda: "mpext.%s: scales must have dtype "
                 "float32, got %s" % (op, _dtype_name(scales.dtype)))
    torch._check(tuple(scales.shape) == _fp8_scale_shape(q.shape, block_size),
                 lambda: "mpext.%s: scales must have shape %s" % (
                     op, _fp8_scale_shape(q.shape, block_size)))
    out = torch.float32 if dtype is None else dtype
    torch._check(out in _PARAM_DTYPES, lambda: "mpext.%s: dtype must be float32, bfloat16 or "
                 "float16" % op)
    return torch.empty(q.shape, dtype=out, device=q.device)
# --- int8 block code (issue 42), end ---
