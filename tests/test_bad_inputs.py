"""The bad-input matrix: every public op and API of mpext against every kind of bad input.

One table, ``CASES``, drives one parametrized test. A case is

    Case(api, category, description, build, expect)

* ``build()`` returns fresh inputs: ``(call, watched)``, where ``call()`` makes the call under
  test and ``watched`` is every object the call may touch (tensors, lists and dicts of them,
  optimizers, scalers);
* ``expect`` is ``ok(check)``: the call succeeds and ``check(result, before, watched)`` compares
  it with an independent reference (``before`` holds clones of the watched tensors), or
  ``raises(type, regex)``: the call raises that exception, its message matches the regex (which
  names the offending argument), and afterwards every watched tensor is bitwise unchanged --
  the whole storage behind it, so the entries earlier in a list and the memory around a view
  are covered too, NaN payloads included -- and so is every optimizer / scaler setting.

Categories (``CATEGORIES``): wrong dtype, wrong device, mixed devices in a list, non-contiguous,
zero-size, empty lists, mismatched list lengths, mismatched shapes, the same tensor twice,
overlapping views, scalars of the wrong shape/dtype, NaN/Inf/zero/negative hyperparameters, and
state dicts with missing/extra/mis-shaped entries. ``test_matrix_coverage`` prints the number
of cases per API and category (``pytest -s``) and fails if an API lacks a category that applies
to it.

Without a GPU the "other device" is ``meta``: a list mixing CPU and meta tensors dispatches to
the fake kernel, which refuses it in the planner's words; with CUDA it is ``cuda``.
"""
import math
import re
import warnings
from collections import Counter
from typing import Any, Callable, NamedTuple, Optional

import numpy as np
import pytest
import torch

import mpext
from mpext import ops

from conftest import CUDA_OK
from reference import adam_step_reference, assert_bits_or_both_nan

OTHER = "cuda" if CUDA_OK else "meta"
F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
NAN, INF = float("nan"), float("inf")

CATEGORIES = ("dtype", "device", "mixed-devices", "non-contiguous", "zero-size", "empty",
              "length", "shape", "duplicate", "overlap", "scalar", "hyper", "state-dict")


class Case(NamedTuple):
    api: str
    category: str
    what: str
    build: Callable[[], tuple]
    expect: tuple
    xfail: Optional[str] = None  # a known bug: the reason (the case must fail: strict)


def ok(check):
    return ("ok", check)


def raises(exc, regex):
    return ("raises", exc, regex)


CASES = []


def case(api, category, what, expect, xfail=None):
    """Decorator: registers the decorated builder as a case."""
    assert category in CATEGORIES, category

    def register(build):
        CASES.append(Case(api, category, what, build, expect, xfail))
        return build
    return register


# ---------------------------------------------------------------------------------------------
# Snapshots: every tensor reachable from `watched`, bitwise, plus optimizer / scaler settings.


def _storage_bytes(t):
    """The whole storage behind t (not just its view) as uint8 on the CPU."""
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    return raw.cpu().clone()


def _fingerprint_tensor(t):
    if t.layout != torch.strided:  # sparse: its indices and values
        t = t.coalesce() if t.layout == torch.sparse_coo and not t.is_coalesced() else t
        return ("sparse", t.layout, t.dtype, tuple(t.shape),
                _fingerprint_tensor(t._indices()), _fingerprint_tensor(t._values()))
    meta = (t.dtype, str(t.device), tuple(t.shape), t.stride(), t.storage_offset())
    if t.device.type == "meta":
        return meta
    return meta + (_storage_bytes(t),)


def _scaler_settings(s):
    names = ("_enabled", "_init_scale", "_growth_factor", "_backoff_factor", "_growth_interval",
             "_init_growth_tracker", "_hysteresis", "_min_scale", "_max_scale",
             "_init_hysteresis_tracker", "_init_stats")
    return {n: repr(getattr(s, n, None)) for n in names}


def fingerprint(obj):
    """A nested structure of comparable snapshots of everything in obj."""
    if isinstance(obj, torch.Tensor):
        return _fingerprint_tensor(obj)
    if isinstance(obj, (list, tuple)):
        return [fingerprint(o) for o in obj]
    if isinstance(obj, dict):
        return {repr(k): fingerprint(v) for k, v in obj.items()}
    if isinstance(obj, torch.optim.Optimizer):
        # the params by identity too: a call must not swap a param for an equal copy
        groups = [{k: (fingerprint(v) if k == "params" else repr(v)) for k, v in g.items()}
                  for g in obj.param_groups]
        groups.append([id(p) for g in obj.param_groups for p in g["params"]])
        params = [p for g in obj.param_groups for p in g["params"]]
        return {"groups": groups, "grads": [fingerprint(p.grad) for p in params],
                "state": [{} if _is_initial_state(obj.state.get(p, {}), p)
                          else fingerprint(dict(obj.state[p])) for p in params]}
    if isinstance(obj, torch.amp.GradScaler):
        # Its state as state_dict() reports it (the scale tensor is made lazily, holding the
        # initial scale: making it changes nothing), plus the settings and counters.
        h, stats = getattr(obj, "_hysteresis_tracker", None), getattr(obj, "_stats", None)
        counters = (getattr(obj, "_init_hysteresis_tracker", None) if h is None else h.tolist(),
                    getattr(obj, "_init_stats", None) if stats is None else tuple(stats.tolist()))
        return {"settings": _scaler_settings(obj), "state": repr(obj.state_dict()),
                "counters": repr(counters)}
    return repr(obj)


def _is_initial_state(state, p):
    """Whether a param's optimizer state is what its first step starts from (step 0, zero
    moments, a master equal to the param): the lazy initialisation a step makes before the
    kernel runs, equivalent to no state at all."""
    if not state:
        return True
    if set(state) - {"step", "exp_avg", "exp_avg_sq", "master_param"}:
        return False
    zero = all(torch.equal(state[k], torch.zeros_like(state[k]))
               for k in ("step", "exp_avg", "exp_avg_sq") if k in state)
    master = state.get("master_param")
    return zero and (master is None or torch.equal(master, p.detach().float()))


def _same(a, b, path="watched"):
    """Asserts two fingerprints are equal, naming the first difference."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), "%s: the bytes changed" % path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), "%s: keys changed" % path
        for k in a:
            _same(a[k], b[k], "%s[%s]" % (path, k))
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), "%s: length changed" % path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, "%s[%d]" % (path, i))
    else:
        assert a == b, "%s: %r became %r" % (path, a, b)


def clone_tree(obj):
    """Clones of the tensors in obj, in its structure (other objects as they are)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(o) for o in obj)
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    return obj


# ---------------------------------------------------------------------------------------------
# Reference comparisons for the cases that must succeed.


def _int_view(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        t.element_size()])


def check_unary(target):
    def check(out, before, w):
        ref = before["x"].to(target)
        assert out.dtype == target and out.shape == ref.shape and out.device == w["x"].device
        if out.device.type != "meta":
            assert_bits_or_both_nan(out, ref)
    return check


def check_cast(out, before, w):
    assert out is None
    for d, s in zip(w["dst"], before["src"]):
        assert_bits_or_both_nan(d, s.to(d.dtype))


def check_unscale(out, before, w):
    """torch's op on the clones, one call per dtype as torch.amp.GradScaler makes them."""
    grads, found, inv = before["grads"], before["found_inf"], before["inv_scale"]
    by_dtype = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(same, found, inv.reshape(()))
    for ours, ref in zip(w["grads"], grads):
        assert_bits_or_both_nan(ours, ref)
    assert torch.equal(w["found_inf"], found)


def check_update_scale(out, before, w):
    scale, tracker = before["scale"], before["growth_tracker"]
    torch._amp_update_scale_(scale, tracker, before["found_inf"], *w["factors"])
    assert torch.equal(_int_view(w["scale"]), _int_view(scale))
    assert torch.equal(w["growth_tracker"], tracker)


def check_adam(out, before, w):
    """One step against the float64 reference (tests/reference.py)."""
    hp = dict(w["hyper"])
    if isinstance(hp["lr"], torch.Tensor):
        hp["lr"] = hp["lr"].item()
    for i, p in enumerate(w["params"]):
        if p.numel() == 0:
            assert w["steps"][i].item() == before["steps"][i].item() + 1
            continue
        master = before["masters"][i] if p.dtype != F32 else before["params"][i]
        ref_p, ref_m, ref_v, t = adam_step_reference(
            master.double().numpy(), before["grads"][i].double().numpy(),
            before["exp_avgs"][i].numpy(), before["exp_avg_sqs"][i].numpy(),
            before["steps"][i].item(), **hp)
        ours = (w["masters"][i] if p.dtype != F32 else p).double().numpy()
        np.testing.assert_allclose(ours, ref_p, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(w["exp_avgs"][i].numpy(), ref_m, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(w["exp_avg_sqs"][i].numpy(), ref_v, rtol=1e-5, atol=1e-10)
        assert w["steps"][i].item() == t
        if p.dtype != F32:  # the param is the master rounded to nearest even
            assert torch.equal(_int_view(p), _int_view(w["masters"][i].to(p.dtype)))


# ---------------------------------------------------------------------------------------------
# The unary casts: to_bf16, to_fp16, to_fp32.

UNARY = {"to_bf16": (ops.to_bf16, F32, BF16), "to_fp16": (ops.to_fp16, F32, F16),
         "to_fp32": (ops.to_fp32, BF16, F32)}


def _unary(name, x, **kw):
    fn = UNARY[name][0]
    return (lambda: fn(x, **kw)), {"x": x}


def _values(n, dtype, device="cpu"):
    """n values with specials (NaN, +-Inf, -0, a subnormal) among ordinary ones."""
    x = torch.linspace(-3.0, 3.0, n, dtype=torch.float64)
    specials = [NAN, INF, -INF, -0.0, 1e-40, 7e4, 3e38]
    for i, v in enumerate(specials[:n]):
        x[(i * 7) % n] = v
    return x.to(F32).to(dtype).to(device)


for _name, (_fn, _in, _out) in UNARY.items():
    _allowed = "float32" if _in == F32 else "bfloat16 or float16"
    for _bad in (F64, torch.int32, (F32 if _in != F32 else F16)):
        case(_name, "dtype", "x is %s" % _bad, raises(
            RuntimeError, r"%s: x must have dtype %s, got %s"
            % (_name, _allowed, ops._dtype_name(_bad))))(
            lambda n=_name, d=_bad: _unary(n, torch.ones(5).to(d)))
    case(_name, "device", "x on the meta device: the fake kernel's result",
         ok(check_unary(_out)))(lambda n=_name, i=_in: _unary(n, torch.ones(3, 4, device="meta",
                                                                           dtype=i)))
    case(_name, "device", "x is sparse", raises(
        RuntimeError, r"%s: x must be a strided \(dense\) tensor" % _name))(
        lambda n=_name, i=_in: _unary(n, torch.ones(4).to(i).to_sparse()))
    case(_name, "non-contiguous", "x is a strided slice", raises(
        RuntimeError, r"%s: x must be dense and non-overlapping" % _name))(
        lambda n=_name, i=_in: _unary(n, _values(12, i).view(3, 4)[:, ::2]))
    case(_name, "overlap", "x overlaps itself (expanded)", raises(
        RuntimeError, r"%s: x must be dense and non-overlapping" % _name))(
        lambda n=_name, i=_in: _unary(n, _values(4, i).expand(3, 4)))
    for _shape in ((0,), (3, 0), (0, 5, 2)):
        case(_name, "zero-size", "x of shape %s" % (_shape,), ok(check_unary(_out)))(
            lambda n=_name, i=_in, s=_shape: _unary(n, torch.empty(s, dtype=i)))
    case(_name, "scalar", "x is 0-dim", ok(check_unary(_out)))(
        lambda n=_name, i=_in: _unary(n, torch.tensor(-1.5).to(i)))
    case(_name, "non-contiguous", "x is channels_last: any dense layout works",
         ok(check_unary(_out)))(
        lambda n=_name, i=_in: _unary(n, _values(120, i).view(2, 3, 4, 5).to(
            memory_format=torch.channels_last)))
    case(_name, "scalar", "x is not a tensor", raises(
        (TypeError, RuntimeError), r"argument 'x'"))(lambda n=_name: _unary(n, [1.0, 2.0]))

for _kw, _exc, _re in [
        (dict(offset=-1), ValueError, r"to_bf16: offset must be >= 0, got -1"),
        (dict(offset=2 ** 63), ValueError,
         r"to_bf16: offset must be < 2\*\*63, got 9223372036854775808"),
        (dict(seed=2 ** 64), ValueError, r"to_bf16: seed must be in \[-2\*\*63, 2\*\*64\)"),
        (dict(seed=-2 ** 63 - 1), ValueError, r"to_bf16: seed must be in"),
        (dict(seed=NAN), TypeError, r"to_bf16: seed must be an int, got nan"),
        (dict(seed=1.5), TypeError, r"to_bf16: seed must be an int, got 1.5"),
        (dict(offset=2.0), TypeError, r"to_bf16: offset must be an int, got 2.0")]:
    case("to_bf16", "hyper", "stochastic with %s" % _kw, raises(_exc, _re))(
        lambda kw=_kw: _unary("to_bf16", _values(9, F32), stochastic=True, **kw))
case("to_bf16", "hyper", "stochastic, NaN/Inf/-0/subnormal values: neighbours or NaN",
     ok(lambda out, before, w: _check_sr_neighbours(out, before["x"])))(
    lambda: _unary("to_bf16", _values(40, F32), stochastic=True, seed=3))


def _check_sr_neighbours(out, x):
    """Each stochastically rounded value is x rounded down or up (toward zero or away) in
    bf16; Inf stays Inf, NaN stays NaN."""
    down = _int_view(x) >> 16  # truncation keeps the sign
    got = _int_view(out).to(torch.int32)
    nan = torch.isnan(x)
    assert torch.equal(torch.isnan(out), nan)
    ok_ = (got == down) | (got == down + 1)
    assert ok_[~nan].all()


# ---------------------------------------------------------------------------------------------
# cast_: the multi-tensor copy-cast.


def _cast_lists(dev2=None):
    """Three valid pairs (down, up, same dtype); the bad entry goes last, so a partial write
    would show in the earlier ones."""
    src = [_values(5, F32), _values(12, BF16).view(3, 4), _values(6, F16)]
    dst = [torch.zeros(5, dtype=BF16), torch.zeros(3, 4), torch.zeros(6, dtype=F16)]
    return dst, src


def _cast(dst, src, **kw):
    return (lambda: ops.cast_(dst, src, **kw)), {"dst": dst, "src": src}


def _cast_with(last_dst=None, last_src=None, **kw):
    dst, src = _cast_lists()
    if last_dst is not None:
        dst[2] = last_dst
    if last_src is not None:
        src[2] = last_src
    return _cast(dst, src, **kw)


case("cast_", "dtype", "dst[2] is float64", raises(
    RuntimeError, r"cast_: dst\[2\] must have dtype float32 or bfloat16 or float16, got float64"))(
    lambda: _cast_with(torch.zeros(6, dtype=F64)))
case("cast_", "dtype", "src[2] is int32", raises(
    RuntimeError, r"cast_: src\[2\] must have dtype float32 or bfloat16 or float16, got int32"))(
    lambda: _cast_with(last_src=torch.zeros(6, dtype=torch.int32)))
case("cast_", "dtype", "bfloat16 -> float16 pair", raises(
    RuntimeError, r"cannot cast src\[2\] \(bfloat16\) to dst\[2\] \(float16\)"))(
    lambda: _cast_with(last_src=_values(6, BF16)))
case("cast_", "device", "dst[2] on the other device", raises(
    RuntimeError, r"dst\[2\] is on %s but dst\[0\] is on .*; all tensors must be on one device" % OTHER))(
    lambda: _cast_with(torch.zeros(6, dtype=F16, device=OTHER)))
case("cast_", "mixed-devices", "src[2] on the other device", raises(
    RuntimeError, r"src\[2\] is on %s but dst\[0\] is on .*; all tensors must be on one device" % OTHER))(
    lambda: _cast_with(last_src=_values(6, F16, OTHER)))
case("cast_", "device", "dst[1] sparse", raises(
    RuntimeError, r"cast_: dst\[1\] must be a strided \(dense\) tensor"))(
    lambda: (lambda d, s: (d.__setitem__(1, torch.zeros(3, 4).to_sparse()), _cast(d, s))[1])(
        *_cast_lists()))
case("cast_", "non-contiguous", "dst[2] is a strided slice", raises(
    RuntimeError, r"cast_: dst\[2\] must be dense and non-overlapping"))(
    lambda: _cast_with(torch.zeros(12, dtype=F16)[::2]))
case("cast_", "non-contiguous", "src[2] is a strided slice", raises(
    RuntimeError, r"cast_: src\[2\] must be dense and non-overlapping"))(
    lambda: _cast_with(last_src=_values(12, F16)[::2]))
case("cast_", "non-contiguous", "channels_last pair: any dense layout works", ok(check_cast))(
    lambda: _cast_with(torch.zeros(1, 2, 3, 1, dtype=F16).to(memory_format=torch.channels_last),
                       _values(6, F16).view(1, 2, 3, 1).to(memory_format=torch.channels_last)))
case("cast_", "shape", "pairs with one shape, different layouts", raises(
    ValueError, r"cast_: dst\[2\] \(sizes \[3, 2\], strides \[1, 3\]\) must match "
                r"src\[2\] \(sizes \[3, 2\], strides \[2, 1\]\)"))(
    lambda: _cast_with(torch.zeros(2, 3, dtype=F16).t(), _values(6, F16).view(3, 2)))
case("cast_", "shape", "dst[2] and src[2] of different shapes", raises(
    ValueError, r"cast_: dst\[2\] has shape \[7\] but src\[2\] has shape \[6\]"))(
    lambda: _cast_with(torch.zeros(7, dtype=F16)))
case("cast_", "shape", "same numel, different shapes", raises(
    ValueError, r"cast_: dst\[2\] has shape \[2, 3\] but src\[2\] has shape \[6\]"))(
    lambda: _cast_with(torch.zeros(2, 3, dtype=F16)))
case("cast_", "length", "dst longer than src", raises(
    ValueError, r"cast_: dst and src must have the same length, got 3 and 2"))(
    lambda: (lambda d, s: _cast(d, s[:2]))(*_cast_lists()))
case("cast_", "length", "src longer than dst", raises(
    ValueError, r"cast_: dst and src must have the same length, got 0 and 3"))(
    lambda: (lambda d, s: _cast([], s))(*_cast_lists()))
case("cast_", "empty", "both lists empty", ok(lambda out, before, w: None))(
    lambda: _cast([], []))
case("cast_", "zero-size", "a zero-size pair among others", ok(check_cast))(
    lambda: _cast_with(torch.zeros(0, 3, dtype=F16), torch.zeros(0, 3, dtype=F16)))
case("cast_", "zero-size", "only zero-size pairs", ok(check_cast))(
    lambda: _cast([torch.zeros(0, dtype=BF16), torch.zeros(2, 0)],
                  [torch.zeros(0), torch.zeros(2, 0, dtype=F16)]))
case("cast_", "duplicate", "the same dst twice", raises(
    RuntimeError, r"cast_: dst\[0\] and dst\[2\] overlap in memory"))(
    lambda: (lambda d, s: _cast(d[:2] + [d[0]], s[:2] + [s[0]]))(*_cast_lists()))
case("cast_", "duplicate", "the same src twice: sources are only read", ok(check_cast))(
    lambda: (lambda d, s: _cast(d[:2] + [torch.zeros(5, dtype=BF16)], s[:2] + [s[0]]))(
        *_cast_lists()))
case("cast_", "duplicate", "the same zero-size dst twice: no memory, no overlap",
     ok(check_cast))(
    lambda: (lambda z: _cast([z, z], [torch.zeros(0), torch.zeros(0)]))(
        torch.zeros(0, dtype=BF16)))
case("cast_", "overlap", "dst[2] a view overlapping dst[0] through another dtype", raises(
    RuntimeError, r"cast_: dst\[0\] and dst\[2\] overlap"))(
    lambda: (lambda d, s: _cast(d[:2] + [d[0].view(F16)[:5]], s[:2] + [_values(5, F32)]))(
        *_cast_lists()))
case("cast_", "overlap", "dst[2] overlaps src[2] (views of one buffer)", raises(
    RuntimeError, r"cast_: (dst\[2\] and src\[2\]|src\[2\] and dst\[2\]) overlap"))(
    lambda: (lambda buf: _cast_with(buf[:6], buf[3:9]))(_values(9, F16)))
case("cast_", "overlap", "adjacent views of one buffer do not overlap", ok(check_cast))(
    lambda: (lambda buf: _cast_with(buf[:6], buf[6:]))(_values(12, F16)))
case("cast_", "hyper", "stochastic with a float16 dst", raises(
    ValueError, r"stochastic rounding is implemented for float32 -> bfloat16 only, but "
                r"dst\[2\] is float16"))(
    lambda: _cast_with(torch.zeros(6, dtype=F16), _values(6, F32), stochastic=True))
case("cast_", "hyper", "offset = -1", raises(ValueError, r"cast_: offset must be >= 0"))(
    lambda: _cast_with(stochastic=True, offset=-1))
case("cast_", "hyper", "offset = 2**63", raises(
    ValueError, r"cast_: offset must be < 2\*\*63, got 9223372036854775808"))(
    lambda: _cast_with(stochastic=True, offset=2 ** 63))
case("cast_", "hyper", "seed = 2**64", raises(ValueError, r"seed must be in"))(
    lambda: _cast_with(stochastic=True, seed=2 ** 64))
case("cast_", "scalar", "a list entry that is not a tensor", raises(
    (TypeError, RuntimeError), r"argument 'src'"))(
    lambda: (lambda d, s: _cast(d, s[:2] + [1.0]))(*_cast_lists()))


# ---------------------------------------------------------------------------------------------
# unscale_.


def _unscale(grads=None, found_inf=None, inv_scale=None):
    grads = [_values(9, F32), _values(6, F16).view(2, 3), _values(7, BF16)] \
        if grads is None else grads
    found_inf = torch.zeros(()) if found_inf is None else found_inf
    inv_scale = torch.full((), 0.25) if inv_scale is None else inv_scale
    return (lambda: ops.unscale_(grads, found_inf, inv_scale)), {
        "grads": grads, "found_inf": found_inf, "inv_scale": inv_scale}


def _finite_grads():
    return [torch.linspace(-4, 4, 9), torch.linspace(-2, 2, 6, dtype=F16),
            torch.linspace(-1, 1, 7, dtype=BF16)]


def _plus(extra, base=None):
    return (_finite_grads() if base is None else base) + [extra]


for _bad, _msg in ((F64, "float64"), (torch.int32, "int32"), (torch.float8_e4m3fn, ".*")):
    case("unscale_", "dtype", "grads[3] is %s" % _msg, raises(
        RuntimeError, r"unscale_: grads\[3\] must have dtype float32 or bfloat16 or float16, "
                      r"got %s" % _msg))(
        lambda d=_bad: _unscale(_plus(torch.ones(4).to(d))))
case("unscale_", "dtype", "found_inf is int32", raises(
    RuntimeError, r"unscale_: found_inf must have dtype float32, got int32"))(
    lambda: _unscale(found_inf=torch.zeros((), dtype=torch.int32)))
case("unscale_", "dtype", "inv_scale is float64", raises(
    RuntimeError, r"unscale_: inv_scale must have dtype float32, got float64"))(
    lambda: _unscale(inv_scale=torch.full((), 0.5, dtype=F64)))
case("unscale_", "device", "found_inf and inv_scale on the other device", raises(
    RuntimeError, r"unscale_: grads\[0\] is on cpu but found_inf is on %s" % OTHER))(
    lambda: _unscale(found_inf=torch.zeros((), device=OTHER),
                     inv_scale=torch.ones((), device=OTHER)))
case("unscale_", "device", "inv_scale on the other device", raises(
    RuntimeError, r"unscale_: inv_scale is on %s.* but found_inf is on cpu" % OTHER))(
    lambda: _unscale(inv_scale=torch.ones((), device=OTHER)))
case("unscale_", "mixed-devices", "grads[3] on the other device", raises(
    RuntimeError, r"unscale_: grads\[3\] is on %s.* but found_inf is on cpu; all tensors must "
                  r"be on one device" % OTHER))(
    lambda: _unscale(_plus(torch.ones(4, device=OTHER))))
case("unscale_", "device", "grads[3] sparse", raises(
    RuntimeError, r"unscale_: grads\[3\] must be a strided \(dense\) tensor"))(
    lambda: _unscale(_plus(torch.ones(4).to_sparse())))
case("unscale_", "non-contiguous", "grads[3] a strided slice", raises(
    RuntimeError, r"unscale_: grads\[3\] must be dense and non-overlapping"))(
    lambda: _unscale(_plus(torch.ones(4, 2)[:, 0])))
case("unscale_", "overlap", "grads[3] overlaps itself (expanded)", raises(
    RuntimeError, r"unscale_: grads\[3\] must be dense and non-overlapping"))(
    lambda: _unscale(_plus(torch.ones(1).expand(5))))
case("unscale_", "non-contiguous", "channels_last and transposed grads", ok(check_unscale))(
    lambda: _unscale([_values(24, F32).view(1, 2, 3, 4).to(memory_format=torch.channels_last),
                      _values(6, F16).view(2, 3).t()]))
case("unscale_", "zero-size", "zero-size grads among others", ok(check_unscale))(
    lambda: _unscale(_finite_grads() + [torch.zeros(0, dtype=F16), torch.zeros(3, 0)]))
case("unscale_", "zero-size", "found_inf with 0 elements", raises(
    RuntimeError, r"unscale_: found_inf must have 1 element, got 0"))(
    lambda: _unscale(found_inf=torch.zeros(0)))
case("unscale_", "empty", "no grads: found_inf untouched", ok(check_unscale))(
    lambda: _unscale([], found_inf=torch.full((), 0.0)))
case("unscale_", "empty", "no grads, found_inf already set", ok(check_unscale))(
    lambda: _unscale([], found_inf=torch.full((), 1.0)))
case("unscale_", "scalar", "found_inf of 2 elements", raises(
    RuntimeError, r"unscale_: found_inf must have 1 element, got 2"))(
    lambda: _unscale(found_inf=torch.zeros(2)))
case("unscale_", "scalar", "inv_scale of 2 elements", raises(
    RuntimeError, r"unscale_: inv_scale must have 1 element, got 2"))(
    lambda: _unscale(inv_scale=torch.ones(2)))
case("unscale_", "scalar", "inv_scale of shape (1, 1): one element is enough",
     ok(check_unscale))(lambda: _unscale(_finite_grads(), inv_scale=torch.full((1, 1), 0.5)))
case("unscale_", "duplicate", "the same grad twice", raises(
    RuntimeError, r"unscale_: grads\[0\] and grads\[3\] overlap in memory"))(
    lambda: (lambda g: _unscale(g + [g[0]]))(_finite_grads()))
case("unscale_", "duplicate", "the same zero-size grad twice", ok(check_unscale))(
    lambda: (lambda z: _unscale(_finite_grads() + [z, z]))(torch.zeros(0)))
case("unscale_", "overlap", "grads[3] a view into grads[0]", raises(
    RuntimeError, r"unscale_: grads\[0\] and grads\[3\] overlap in memory"))(
    lambda: (lambda g: _unscale(g + [g[0][3:5]]))(_finite_grads()))
case("unscale_", "overlap", "grads[3] aliases grads[2] through another dtype", raises(
    RuntimeError, r"unscale_: grads\[2\] and grads\[3\] overlap"))(
    lambda: (lambda g: _unscale(g + [g[2].view(F16)[1:3]]))(_finite_grads()))
case("unscale_", "overlap", "found_inf inside a grad", raises(
    RuntimeError, r"unscale_: (grads\[0\] and found_inf|found_inf and grads\[0\]) overlap"))(
    lambda: (lambda g: _unscale(g, found_inf=g[0][2:3]))(_finite_grads()))
case("unscale_", "overlap", "inv_scale inside a grad", raises(
    RuntimeError, r"unscale_: (grads\[0\] and inv_scale|inv_scale and grads\[0\]) overlap"))(
    lambda: (lambda g: _unscale(g, inv_scale=g[0][0:1]))(_finite_grads()))
case("unscale_", "overlap", "inv_scale is found_inf", raises(
    RuntimeError, r"unscale_: (inv_scale and found_inf|found_inf and inv_scale) overlap"))(
    lambda: (lambda f: _unscale(found_inf=f, inv_scale=f))(torch.zeros(())))
for _inv in (NAN, INF, -INF, 0.0, -0.0, -3.0, 2.0 ** -149, 3e38):
    case("unscale_", "hyper", "inv_scale = %r: as torch" % _inv, ok(check_unscale))(
        lambda v=_inv: _unscale(inv_scale=torch.full((), v)))
case("unscale_", "scalar", "a list entry that is not a tensor", raises(
    (TypeError, RuntimeError), r"argument 'grads'"))(lambda: _unscale(_plus(1.0)))


# ---------------------------------------------------------------------------------------------
# update_scale_.


def _update(factors=(2.0, 0.5, 3), found=1.0, **kw):
    t = dict(scale=torch.full((), 1024.0), growth_tracker=torch.full((), 2, dtype=torch.int32),
             found_inf=torch.full((), found))
    t.update({k: v for k, v in kw.items() if k in t})
    opts = {k: v for k, v in kw.items() if k not in t}
    watched = dict(t, factors=factors, **{k: v for k, v in opts.items()
                                          if isinstance(v, torch.Tensor)})
    return (lambda: ops.update_scale_(t["scale"], t["growth_tracker"], t["found_inf"], *factors,
                                      **opts)), watched


_I32 = torch.int32
for _arg, _val, _re in [
        ("scale", torch.ones((), dtype=F64), r"scale must have dtype float32, got float64"),
        ("growth_tracker", torch.zeros((), dtype=torch.int64),
         r"growth_tracker must have dtype int32, got int64"),
        ("found_inf", torch.ones((), dtype=torch.bool), r"found_inf must have dtype float32, "
                                                        r"got bool"),
        ("hysteresis_tracker", torch.ones((), dtype=torch.int64),
         r"hysteresis_tracker must have dtype int32, got int64"),
        ("stats", torch.zeros(2, dtype=_I32), r"stats must have dtype int64, got int32")]:
    _extra = dict(hysteresis=2) if _arg == "hysteresis_tracker" else {}
    case("update_scale_", "dtype", "%s is %s" % (_arg, _val.dtype), raises(
        RuntimeError, r"update_scale_: " + _re))(
        lambda a=_arg, v=_val, e=_extra: _update(**{a: v.clone()}, **e))
for _arg in ("found_inf", "stats", "hysteresis_tracker", "scale"):
    _val = {"found_inf": torch.ones((), device=OTHER),
            "stats": torch.zeros(2, dtype=torch.int64, device=OTHER),
            "hysteresis_tracker": torch.ones((), dtype=_I32, device=OTHER),
            "scale": torch.ones((), device=OTHER)}[_arg]
    _re = (r"growth_tracker is on cpu but scale is on %s" % OTHER if _arg == "scale"
           else r"%s is on %s.* but scale is on cpu" % (_arg, OTHER))
    case("update_scale_", "device" if _arg != "stats" else "mixed-devices",
         "%s on the other device" % _arg, raises(RuntimeError, r"update_scale_: " + _re))(
        lambda a=_arg, v=_val: _update(**{a: v}, **(dict(hysteresis=2)
                                                    if a == "hysteresis_tracker" else {})))
case("update_scale_", "non-contiguous", "stats a strided slice", raises(
    RuntimeError, r"update_scale_: stats must be dense and non-overlapping"))(
    lambda: _update(stats=torch.zeros(4, dtype=torch.int64)[::2]))
case("update_scale_", "non-contiguous", "scale a 1-element strided view", ok(check_update_scale))(
    lambda: _update(scale=torch.full((3,), 512.0)[1:2]))
for _arg in ("scale", "found_inf", "growth_tracker"):
    _dt = _I32 if _arg == "growth_tracker" else F32
    case("update_scale_", "zero-size", "%s with 0 elements" % _arg, raises(
        RuntimeError, r"update_scale_: %s must have 1 element, got 0" % _arg))(
        lambda a=_arg, d=_dt: _update(**{a: torch.zeros(0, dtype=d)}))
    case("update_scale_", "scalar", "%s with 3 elements" % _arg, raises(
        RuntimeError, r"update_scale_: %s must have 1 element, got 3" % _arg))(
        lambda a=_arg, d=_dt: _update(**{a: torch.ones(3, dtype=d)}))
case("update_scale_", "scalar", "stats with 3 elements", raises(
    RuntimeError, r"update_scale_: stats must have 2 elements, got 3"))(
    lambda: _update(stats=torch.zeros(3, dtype=torch.int64)))
case("update_scale_", "scalar", "found_inf of shape (1, 1)", ok(check_update_scale))(
    lambda: _update(found_inf=torch.ones(1, 1)))
for _found in (NAN, INF, -1.0, -0.0, 1e-45):
    case("update_scale_", "hyper", "found_inf = %r: as torch" % _found, ok(check_update_scale))(
        lambda f=_found: _update(found=f))
for _factors, _re in [
        ((0.0, 0.5, 3), r"growth_factor must be a positive finite number, got 0"),
        ((-2.0, 0.5, 3), r"growth_factor must be a positive finite number, got -2"),
        ((NAN, 0.5, 3), r"growth_factor must be a positive finite number, got nan"),
        ((INF, 0.5, 3), r"growth_factor must be a positive finite number, got inf"),
        ((2.0, 0.0, 3), r"backoff_factor must be a positive finite number, got 0"),
        ((2.0, -0.5, 3), r"backoff_factor must be a positive finite number, got -0.5"),
        ((2.0, NAN, 3), r"backoff_factor must be a positive finite number, got nan"),
        ((2.0, 0.5, 0), r"growth_interval must be in \[1, 2\^31\), got 0"),
        ((2.0, 0.5, -1), r"growth_interval must be in \[1, 2\^31\), got -1"),
        ((2.0, 0.5, 2 ** 31), r"growth_interval must be in \[1, 2\^31\), got 2147483648")]:
    case("update_scale_", "hyper", "factors %r" % (_factors,), raises(
        ValueError, r"update_scale_: " + _re))(lambda f=_factors: _update(f))
case("update_scale_", "hyper", "growth_interval = 3.5 (not an integer)", raises(
    TypeError, r"update_scale_: growth_interval must be an int, got 3.5"))(
    lambda: _update((2.0, 0.5, 3.5)))
for _kw, _re in [
        (dict(hysteresis=0), r"hysteresis must be in \[1, 2\^31\), got 0"),
        (dict(hysteresis=-2, hysteresis_tracker=torch.ones((), dtype=_I32)),
         r"hysteresis must be in \[1, 2\^31\), got -2"),
        (dict(hysteresis=3), r"hysteresis=3 needs a hysteresis_tracker tensor"),
        (dict(min_scale=-1.0), r"min_scale must be a finite number >= 0"),
        (dict(min_scale=INF), r"min_scale must be a finite number >= 0"),
        (dict(max_scale=NAN), r"max_scale must be a finite number >= 0"),
        (dict(max_scale=-INF), r"max_scale must be a finite number >= 0"),
        (dict(min_scale=10.0, max_scale=5.0), r"min_scale \(10\) must not exceed max_scale \(5\)")]:
    case("update_scale_", "hyper", repr(_kw), raises(ValueError, r"update_scale_: " + _re))(
        lambda kw=_kw: _update(**clone_tree(kw)))
case("update_scale_", "duplicate", "scale passed as found_inf too", raises(
    RuntimeError, r"update_scale_: (scale and found_inf|found_inf and scale) overlap"))(
    lambda: (lambda s: _update(scale=s, found_inf=s))(torch.full((), 8.0)))
case("update_scale_", "overlap", "growth_tracker inside stats", raises(
    RuntimeError, r"update_scale_: (growth_tracker and stats|stats and growth_tracker) overlap"))(
    lambda: (lambda st: _update(stats=st, growth_tracker=st.view(_I32)[1]))(
        torch.tensor([4, 1], dtype=torch.int64)))
case("update_scale_", "overlap", "hysteresis_tracker is growth_tracker", raises(
    RuntimeError, r"update_scale_: (growth_tracker and hysteresis_tracker|hysteresis_tracker "
                  r"and growth_tracker) overlap"))(
    lambda: (lambda t: _update(growth_tracker=t, hysteresis_tracker=t, hysteresis=2))(
        torch.ones((), dtype=_I32)))


# ---------------------------------------------------------------------------------------------
# adam_step_.

ADAM_HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled=True,
                  maximize=False)


def _adam_lists():
    """Three params (fp32, bf16 with an fp32 grad, fp16): the bad entry goes last."""
    g = torch.Generator().manual_seed(0)
    masters = [torch.empty(0), torch.randn(4, 3, generator=g), torch.randn(5, generator=g)]
    params = [torch.randn(6, generator=g), masters[1].to(BF16), masters[2].to(F16)]
    grads = [torch.randn(6, generator=g), torch.randn(4, 3, generator=g),
             torch.randn(5, generator=g).to(F16)]
    exp_avgs = [torch.randn(p.shape, generator=g) * 0.1 for p in params]
    exp_avg_sqs = [torch.rand(p.shape, generator=g) * 0.01 for p in params]
    steps = [torch.full((), 3.0), torch.full((), 0.0), torch.full((), 7.0)]
    return dict(params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                masters=masters, steps=steps)


def _adam(lists=None, hyper=None, set_=None, **kw):
    """lists: changes to the default lists (name -> (index, tensor) or a whole list)."""
    L = _adam_lists()
    for name, change in (lists or {}).items():
        if isinstance(change, tuple):
            L[name][change[0]] = change[1](L) if callable(change[1]) else change[1]
        else:
            L[name] = change(L) if callable(change) else change
    hp = dict(ADAM_HYPER, **(hyper or {}))
    watched = dict(L, hyper=hp, **{k: v for k, v in kw.items() if isinstance(v, torch.Tensor)})
    if isinstance(hp["lr"], torch.Tensor):
        watched["lr"] = hp["lr"]
    return (lambda: ops.adam_step_(L["params"], L["grads"], L["exp_avgs"], L["exp_avg_sqs"],
                                   L["masters"], L["steps"], **hp, **kw)), watched


# adam_step_'s own checks on every device (tensor dtypes, list lengths, shapes, sparse
# tensors, element counts, the hyperparameters' ranges, overlaps) are tests/test_adam.py's
# OP_BAD and OP_OVERLAP; these are the rest, and the categories' cases.
case("adam_step_", "dtype", "lr tensor is int64", raises(
    RuntimeError, r"adam_step_: lr must have dtype float32, got int64"))(
    lambda: _adam(hyper=dict(lr=torch.ones((), dtype=torch.int64))))
case("adam_step_", "dtype", "found_inf is float64", raises(
    RuntimeError, r"adam_step_: found_inf must have dtype float32, got float64"))(
    lambda: _adam(found_inf=torch.zeros((), dtype=F64)))
for _name in ("params", "grads", "exp_avgs", "exp_avg_sqs", "masters", "steps"):
    case("adam_step_", "mixed-devices", "%s[2] on the other device" % _name, raises(
        RuntimeError, r"adam_step_: %s\[2\] is on %s.* but params\[0\] is on cpu"
        % (_name, OTHER)))(
        lambda n=_name: _adam({n: (2, lambda L, n=n: L[n][2].to(OTHER))}))
case("adam_step_", "device", "found_inf on the other device", raises(
    RuntimeError, r"adam_step_: found_inf is on %s.* but params\[0\] is on cpu" % OTHER))(
    lambda: _adam(found_inf=torch.zeros((), device=OTHER)))
case("adam_step_", "device", "inv_scale on the other device", raises(
    RuntimeError, r"adam_step_: inv_scale is on %s.* but params\[0\] is on cpu" % OTHER))(
    lambda: _adam(inv_scale=torch.ones((), device=OTHER)))
case("adam_step_", "device", "lr on the other device", raises(
    RuntimeError, r"adam_step_: lr is on %s.* but params\[0\] is on cpu \(it may also be on "
                  r"the CPU\)" % OTHER))(
    lambda: _adam(hyper=dict(lr=torch.full((), 1e-2, device=OTHER))))
for _name in ("params", "grads", "exp_avgs", "exp_avg_sqs", "masters"):
    case("adam_step_", "non-contiguous", "%s[2] a strided slice" % _name, raises(
        RuntimeError, r"adam_step_: %s\[2\] must be dense and non-overlapping" % _name))(
        lambda n=_name: _adam({n: (2, lambda L, n=n: torch.stack(
            [L[n][2], L[n][2]], 1)[:, 0])}))
case("adam_step_", "overlap", "exp_avg_sqs[1] expanded (overlaps itself)", raises(
    RuntimeError, r"adam_step_: exp_avg_sqs\[1\] must be dense and non-overlapping"))(
    lambda: _adam({"exp_avg_sqs": (1, torch.zeros(1, 3).expand(4, 3))}))
case("adam_step_", "shape", "exp_avgs[1] transposed (same shape, other strides)", raises(
    ValueError, r"adam_step_: exp_avgs\[1\] \(sizes \[4, 3\], strides \[1, 4\]\) must match "
                r"params\[1\] \(sizes \[4, 3\], strides \[3, 1\]\)"))(
    lambda: _adam({"exp_avgs": (1, torch.zeros(3, 4).t())}))
case("adam_step_", "non-contiguous", "channels_last everywhere", ok(check_adam))(
    lambda: _adam({n: (1, lambda L, n=n: L[n][1].view(1, 4, 3, 1).to(
        memory_format=torch.channels_last)) for n in ("params", "grads", "exp_avgs",
                                                       "exp_avg_sqs", "masters")}))
case("adam_step_", "length", "masters empty with bf16 params", raises(
    ValueError, r"adam_step_: params\[1\] is bfloat16 and needs an fp32 master \(masters\[1\]\) "
                r"or a remainder \(remainders\[1\]\); pass master_free=True"))(
    lambda: _adam({"masters": []}))
case("adam_step_", "empty", "every list empty", ok(lambda out, before, w: None))(
    lambda: _adam({n: [] for n in ("params", "grads", "exp_avgs", "exp_avg_sqs", "masters",
                                   "steps")}))
case("adam_step_", "empty", "only fp32 params, masters None", ok(check_adam))(
    lambda: _adam({n: (lambda L, n=n: L[n][:1]) for n in (
        "params", "grads", "exp_avgs", "exp_avg_sqs", "steps")} | {"masters": None}))
case("adam_step_", "zero-size", "a zero-size bf16 param among others", ok(check_adam))(
    lambda: _adam({"params": (1, torch.zeros(0, 3, dtype=BF16)),
                   "grads": (1, torch.zeros(0, 3)), "exp_avgs": (1, torch.zeros(0, 3)),
                   "exp_avg_sqs": (1, torch.zeros(0, 3)), "masters": (1, torch.zeros(0, 3))}))
case("adam_step_", "zero-size", "steps[2] of 0 elements", raises(
    RuntimeError, r"adam_step_: steps\[2\] must have 1 element, got 0"))(
    lambda: _adam({"steps": (2, torch.zeros(0))}))
for _kw, _re in [(dict(inv_scale=torch.ones(2)), r"inv_scale must have 1 element, got 2"),
                 (dict(found_inf=torch.zeros(0)), r"found_inf must have 1 element, got 0")]:
    case("adam_step_", "scalar", repr(_kw), raises(RuntimeError, r"adam_step_: " + _re))(
        lambda kw=_kw: _adam(**clone_tree(kw)))
case("adam_step_", "scalar", "lr a 0-dim float32 tensor", ok(check_adam))(
    lambda: _adam(hyper=dict(lr=torch.full((), 1e-2))))
case("adam_step_", "duplicate", "the same grad twice: grads are only read", ok(check_adam))(
    lambda: _adam({"params": (2, torch.randn(6)), "masters": (2, torch.empty(0)),
                   "grads": (2, lambda L: L["grads"][0]), "exp_avgs": (2, torch.zeros(6)),
                   "exp_avg_sqs": (2, torch.zeros(6))}))
case("adam_step_", "overlap", "lr inside a moment", raises(
    RuntimeError, r"adam_step_: (exp_avgs\[0\] and lr|lr and exp_avgs\[0\]) overlap"))(
    lambda: (lambda L: _adam({"exp_avgs": (0, L["exp_avgs"][0])},
                             hyper=dict(lr=L["exp_avgs"][0][1:2])))(_adam_lists()))
for _hk, _hv, _re in [
        ("lr", NAN, r"lr must be a finite number >= 0, got nan"),
        ("lr", -1.0, r"lr must be a finite number >= 0, got -1"),
        ("lr", INF, r"lr must be a finite number >= 0, got inf"),
        ("weight_decay", NAN, r"weight_decay must be in \[0, inf\), got nan")]:
    case("adam_step_", "hyper", "%s = %r" % (_hk, _hv), raises(ValueError, r"adam_step_: " + _re))(
        lambda k=_hk, v=_hv: _adam(hyper={k: v}))
for _hk, _hv in [("lr", 0.0), ("beta1", 0.0), ("beta2", 0.0), ("eps", 0.0),
                 ("weight_decay", 0.0)]:
    case("adam_step_", "hyper", "%s = 0: the reference" % _hk, ok(check_adam))(
        lambda k=_hk, v=_hv: _adam(hyper={k: v}))
# (found_inf = NaN, Inf or -2 skips the step: tests/test_adam.py's
# test_op_found_inf_skips_everything)
case("adam_step_", "scalar", "a list entry that is not a tensor", raises(
    (TypeError, RuntimeError), r"argument 'grads'"))(
    lambda: _adam({"grads": (2, 1.0)}))


# ---------------------------------------------------------------------------------------------
# grad_norm: read-only, so a duplicate or overlapping input is fine.


def _grad_norm(tensors, inv_scale=None):
    return (lambda: ops.grad_norm(tensors, inv_scale=inv_scale)), {
        "tensors": tensors, "inv_scale": inv_scale}


def check_grad_norm(out, before, w):
    """torch's total norm (the norm of the per-tensor norms) of the fp32 values times
    inv_scale, as clip_grad_norm_ computes it, in float64 then rounded to float32."""
    inv = before["inv_scale"]
    vals = [t.float().reshape(-1) for t in before["tensors"]]
    if inv is not None:
        vals = [v * inv.reshape(()) for v in vals]  # the fp32 product, as the op forms it
    ref = torch.linalg.vector_norm(torch.cat([v.double() for v in vals] + [
        torch.zeros(0, dtype=F64)])).float()
    assert out.dtype == F32 and out.shape == () and out.device.type == "cpu"
    if torch.isnan(ref):
        assert torch.isnan(out)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)


def _gn_list():
    return [torch.linspace(-3, 3, 9), torch.linspace(-2, 2, 6, dtype=F16).view(2, 3),
            torch.linspace(-1, 1, 7, dtype=BF16)]


for _bad in (F64, torch.int32):
    case("grad_norm", "dtype", "tensors[3] is %s" % _bad, raises(
        RuntimeError, r"grad_norm: tensors\[3\] must have dtype float32 or bfloat16 or "
                      r"float16, got %s" % ops._dtype_name(_bad)))(
        lambda d=_bad: _grad_norm(_gn_list() + [torch.ones(4, dtype=d)]))
case("grad_norm", "dtype", "inv_scale is float64", raises(
    RuntimeError, r"grad_norm: inv_scale must have dtype float32, got float64"))(
    lambda: _grad_norm(_gn_list(), torch.ones((), dtype=F64)))
case("grad_norm", "device", "inv_scale on the other device", raises(
    RuntimeError, r"grad_norm: inv_scale is on %s.* but tensors\[0\] is on cpu" % OTHER))(
    lambda: _grad_norm(_gn_list(), torch.ones((), device=OTHER)))
case("grad_norm", "device", "tensors[3] sparse", raises(
    RuntimeError, r"grad_norm: tensors\[3\] must be a strided \(dense\) tensor"))(
    lambda: _grad_norm(_gn_list() + [torch.ones(3).to_sparse()]))
case("grad_norm", "mixed-devices", "tensors[3] on the other device", raises(
    RuntimeError, r"grad_norm: tensors\[3\] is on %s.* but tensors\[0\] is on cpu" % OTHER))(
    lambda: _grad_norm(_gn_list() + [torch.ones(3, device=OTHER)]))
case("grad_norm", "mixed-devices", "tensors[0] on the other device, the rest on the CPU", raises(
    RuntimeError, r"grad_norm: tensors\[1\] is on cpu but tensors\[0\] is on %s" % OTHER))(
    lambda: _grad_norm([torch.ones(3, device=OTHER)] + _gn_list()))
case("grad_norm", "non-contiguous", "tensors[3] a strided slice", raises(
    RuntimeError, r"grad_norm: tensors\[3\] must be dense and non-overlapping"))(
    lambda: _grad_norm(_gn_list() + [torch.ones(6)[::2]]))
case("grad_norm", "overlap", "tensors[3] expanded (overlaps itself)", raises(
    RuntimeError, r"grad_norm: tensors\[3\] must be dense and non-overlapping"))(
    lambda: _grad_norm(_gn_list() + [torch.ones(1).expand(4)]))
case("grad_norm", "non-contiguous", "channels_last and transposed", ok(check_grad_norm))(
    lambda: _grad_norm([_values(24, F32).abs().nan_to_num(0.0, 0.0).view(1, 2, 3, 4).to(
        memory_format=torch.channels_last), torch.linspace(-1, 1, 6, dtype=F16).view(2, 3).t()]))
case("grad_norm", "zero-size", "zero-size tensors among others", ok(check_grad_norm))(
    lambda: _grad_norm(_gn_list() + [torch.zeros(0, dtype=F16), torch.zeros(3, 0)]))
case("grad_norm", "empty", "an empty list: 0", ok(check_grad_norm))(lambda: _grad_norm([]))
case("grad_norm", "empty", "an empty list with inv_scale: 0", ok(check_grad_norm))(
    lambda: _grad_norm([], torch.full((), 0.5)))
case("grad_norm", "scalar", "inv_scale of 2 elements", raises(
    RuntimeError, r"grad_norm: inv_scale must have 1 element, got 2"))(
    lambda: _grad_norm(_gn_list(), torch.ones(2)))
case("grad_norm", "scalar", "inv_scale of shape (1, 1)", ok(check_grad_norm))(
    lambda: _grad_norm(_gn_list(), torch.full((1, 1), 0.25)))
case("grad_norm", "duplicate", "the same tensor twice: counted twice", ok(check_grad_norm))(
    lambda: (lambda t: _grad_norm([t, t]))(torch.linspace(-2, 2, 5)))
case("grad_norm", "overlap", "overlapping views: each counted", ok(check_grad_norm))(
    lambda: (lambda t: _grad_norm([t[:4], t[2:]]))(torch.linspace(-2, 2, 6)))
for _inv in (NAN, INF, 0.0, -2.0, 2.0 ** -149, 3e38):
    case("grad_norm", "hyper", "inv_scale = %r" % _inv, ok(check_grad_norm))(
        lambda v=_inv: _grad_norm(_gn_list(), torch.full((), v)))
case("grad_norm", "hyper", "NaN and Inf values", ok(check_grad_norm))(
    lambda: _grad_norm([_values(9, F32), _values(5, BF16)]))
case("grad_norm", "scalar", "a list entry that is not a tensor", raises(
    (TypeError, RuntimeError), r"argument 'tensors'"))(lambda: _grad_norm(_gn_list() + [1.0]))


# ---------------------------------------------------------------------------------------------
# mpext.GradScaler.


def _scaler_setup(grads, **kw):
    """A CPU scaler after scale(), an SGD optimizer over params with the given grads."""
    params = [torch.zeros(2, requires_grad=True) if g is None else
              torch.zeros(g.shape, dtype=g.dtype, device=g.device, requires_grad=True)
              for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = mpext.GradScaler("cpu", init_scale=4.0, **kw)
    scaler.scale(torch.ones(()))
    return scaler, opt


def _scaler_unscale(grads):
    scaler, opt = _scaler_setup(grads)
    twin_grads = [None if g is None else g.clone() for g in grads]
    t_scaler, t_opt = torch.amp.GradScaler("cpu", init_scale=4.0), None
    t_opt = torch.optim.SGD([p.detach().clone().requires_grad_()
                             for p in opt.param_groups[0]["params"]], lr=0.1)
    for p, g in zip(t_opt.param_groups[0]["params"], twin_grads):
        p.grad = g
    t_scaler.scale(torch.ones(()))

    def call():
        scaler.unscale_(opt)
        t_scaler.unscale_(t_opt)
    return call, {"grads": grads, "twin": twin_grads, "scaler": scaler, "t_scaler": t_scaler,
                  "opt": opt, "t_opt": t_opt}


def _check_scaler_unscale(out, before, w):
    for ours, ref in zip(w["grads"], w["twin"]):
        if ours is not None and ours.layout != torch.strided:
            ours, ref = ours._values(), ref._values()
        if ours is not None:
            assert_bits_or_both_nan(ours, ref)
    f = w["scaler"]._per_optimizer_states[id(w["opt"])]["found_inf_per_device"]
    t = w["t_scaler"]._per_optimizer_states[id(w["t_opt"])]["found_inf_per_device"]
    assert {d: v.item() for d, v in f.items()} == {d: v.item() for d, v in t.items()}


# torch's own checks are asserts (AssertionError); mpext's options raise ValueError
for _kw, _re in [(dict(growth_factor=0.5), r"growth factor must be > 1"),
                 (dict(backoff_factor=1.5), r"backoff factor must be < 1"),
                 (dict(hysteresis=0), r"hysteresis must be an int in \[1, 2\^31\), got 0"),
                 (dict(hysteresis=2.5), r"hysteresis must be an int"),
                 (dict(min_scale=-1.0), r"min_scale must be None or a finite number > 0"),
                 (dict(min_scale=0.0), r"min_scale must be None or a finite number > 0"),
                 (dict(max_scale=-1.0), r"max_scale must be None or a finite number > 0"),
                 (dict(max_scale=INF), r"max_scale must be None or a finite number > 0"),
                 (dict(min_scale=NAN), r"min_scale must be None or a finite number > 0"),
                 (dict(min_scale=8.0, max_scale=2.0), r"min_scale \(8.0\) must not exceed "
                                                      r"max_scale \(2.0\)"),
                 (dict(warn_consecutive_overflows=0), r"warn_consecutive_overflows must be")]:
    case("GradScaler", "hyper", "GradScaler(%r)" % _kw, raises(
        AssertionError if "factor" in _re else ValueError, _re))(
        lambda kw=_kw: ((lambda: mpext.GradScaler("cpu", **kw)), {}))
for _kw, _re in [(dict(growth_factor=NAN), r"growth_factor"),
                 (dict(backoff_factor=-1.0), r"backoff_factor"),
                 (dict(backoff_factor=NAN), r"backoff_factor"),
                 (dict(growth_interval=0), r"growth_interval"),
                 (dict(init_scale=NAN), r"init_scale"),
                 (dict(init_scale=-2.0), r"init_scale")]:
    case("GradScaler", "hyper", "GradScaler(%r) is rejected by the constructor" % _kw,
         raises((ValueError, AssertionError), _re))(
        lambda kw=_kw: ((lambda: mpext.GradScaler("cpu", **kw)), {}))
case("GradScaler", "dtype", "float64 and float32 grads: as torch (float64 by torch's op)",
     ok(_check_scaler_unscale))(
    lambda: _scaler_unscale([_values(9, F32), _values(5, F64), _values(4, BF16)]))
case("GradScaler", "non-contiguous", "a strided grad: as torch (by torch's op)",
     ok(_check_scaler_unscale))(
    lambda: _scaler_unscale([_values(9, F32), _values(10, BF16)[::2]]))
case("GradScaler", "zero-size", "zero-size grads: as torch", ok(_check_scaler_unscale))(
    lambda: _scaler_unscale([torch.zeros(0), torch.zeros(3, 0, dtype=BF16), _values(3, BF16)]))
case("GradScaler", "empty", "no param has a grad: as torch", ok(_check_scaler_unscale))(
    lambda: _scaler_unscale([None, None]))
case("GradScaler", "device", "a sparse grad: its values, as torch", ok(_check_scaler_unscale))(
    lambda: _scaler_unscale([_values(4, F32), torch.sparse_coo_tensor(
        torch.tensor([[0, 2, 2]]), torch.tensor([1.0, INF, 3.0]), (5,),
        check_invariants=True)]))
case("GradScaler", "duplicate", "one param twice in the optimizer", raises(
    RuntimeError, r"unscale_: grads\[0\] and grads\[1\] overlap in memory"))(
    lambda: (lambda s, o: ((lambda: s.unscale_(o)), {"scaler": s, "opt": o}))(
        *_dup_param_scaler()))


def _dup_param_scaler():
    p = torch.zeros(4, requires_grad=True)
    p.grad = _values(4, F32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about the duplicate and keeps it
        opt = torch.optim.SGD([p, p], lr=0.1)
    scaler = mpext.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    return scaler, opt


case("GradScaler", "mixed-devices", "grads on two devices: one unscale_ per device",
     ok(lambda out, before, w: _check_two_device_scaler(w)))(
    lambda: (lambda s, o: ((lambda: s.unscale_(o)), {"scaler": s, "opt": o}))(
        *_scaler_setup([_values(9, F32), torch.ones(3, device=OTHER)])))


def _check_two_device_scaler(w):
    found = w["scaler"]._per_optimizer_states[id(w["opt"])]["found_inf_per_device"]
    assert set(found) == {torch.device("cpu"), torch.device(OTHER)}
    assert found[torch.device("cpu")].item() == 1.0  # _values plants NaN/Inf


def _scaler_sd(**changes):
    sd = {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 10,
          "_growth_tracker": 3}
    for k, v in changes.items():
        if v is None:
            del sd[k]
        else:
            sd[k] = v
    return sd


def _scaler_load(sd):
    scaler = mpext.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))  # the scale tensor exists: a partial load would show in it
    return (lambda: scaler.load_state_dict(sd)), {"scaler": scaler}


def _check_scaler_load_like_torch(out, before, w):
    ours = w["scaler"]
    ref = torch.amp.GradScaler("cpu", init_scale=4.0)
    ref.scale(torch.ones(()))
    ref.load_state_dict(w["sd"])
    assert ours.state_dict() == ref.state_dict()
    assert ours._scale.item() == ref._scale.item()


case("GradScaler", "state-dict", "empty state dict", raises(
    RuntimeError, r"state dict is empty"))(lambda: _scaler_load({}))
for _key in ("growth_factor", "_growth_tracker"):
    case("GradScaler", "state-dict", "missing %r" % _key, raises(KeyError, _key))(lambda k=_key: _scaler_load(_scaler_sd(**{k: None})))
case("GradScaler", "state-dict", "missing 'scale'", raises(KeyError, "scale"))(
    lambda: _scaler_load(_scaler_sd(scale=None)))
case("GradScaler", "state-dict", "an extra unknown key: ignored, as torch",
     ok(_check_scaler_load_like_torch))(
    lambda: (lambda sd: (lambda c, w: (c, dict(w, sd=sd)))(*_scaler_load(sd)))(
        _scaler_sd(foo=1)))
case("GradScaler", "state-dict", "scale of 2 elements", raises(
    (RuntimeError, ValueError, TypeError), r"scale"))(
    lambda: _scaler_load(_scaler_sd(scale=torch.ones(2))))
for _key, _val, _re in [("hysteresis", 0, r"hysteresis must be an int in \[1, 2\^31\), got 0"),
                        ("min_scale", "x", r"min_scale"),
                        ("_hysteresis_tracker", "x", r"_hysteresis_tracker")]:
    case("GradScaler", "state-dict", "bad extra key %s=%r" % (_key, _val), raises(
        (ValueError, TypeError), _re))(
        lambda k=_key, v=_val: _scaler_load(_scaler_sd(**{k: v})))


# ---------------------------------------------------------------------------------------------
# mpext.optim.Adam / AdamW.

OPTIMIZERS = {"Adam": mpext.optim.Adam, "AdamW": mpext.optim.AdamW}
TORCH_OPTIMIZERS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}


def _opt_construct(name, params, **kw):
    return (lambda: OPTIMIZERS[name](params, **kw)), {"params": params}


def _opt_step(name, params, grads, **kw):
    """An optimizer over params (with the given grads), stepped once by call()."""
    for p, g in zip(params, grads):
        if g is not None and g.dtype != p.dtype:
            p.grad_dtype = None  # torch checks the dtype on assignment unless told not to
        p.grad = g
    opt = OPTIMIZERS[name](params, **dict(dict(lr=1e-2), **kw))
    return (lambda: opt.step()), {"opt": opt, "params": params}


def _check_like_torch(name, dtype=F32):
    """The same step with torch's optimizer on float32 copies (masters for low precision)."""
    def check(out, before, w):
        ref = [p.float().detach().clone().requires_grad_() for p in before["params"]]
        for r, p in zip(ref, w["params"]):
            r.grad = None if p.grad is None else p.grad.float()
        TORCH_OPTIMIZERS[name](ref, lr=1e-2).step()
        for r, p in zip(ref, w["params"]):
            state = w["opt"].state.get(p, {})
            got = state.get("master_param", p).float()
            torch.testing.assert_close(got, r.detach(), rtol=1e-6, atol=1e-7)
    return check


def _p(*shape, dtype=F32):
    return torch.randn(shape).to(dtype).requires_grad_()


# The constructor's hyperparameter checks are the rules x formats table's (ADAM_ERRORS in
# tests/optim_table.py, run by test_optim_table.py's test_bad_options_raise_and_change_nothing:
# refused by the constructor and, set in a trained optimizer's group, by the step, nothing
# written) and tests/test_adam.py's CTOR_BAD; these are the rest.
for _name in OPTIMIZERS:
    # amsgrad=True runs through torch's implementation (docs/dropin.md): torch's step exactly
    for _kw in (dict(lr=0.0), dict(eps=0.0), dict(betas=(0.0, 0.0)), dict(weight_decay=0.0),
                dict(amsgrad=True)):
        case(_name, "hyper", "%s(%r): a step as torch's" % (_name, _kw),
             ok(lambda out, before, w, n=_name, kw=_kw: _check_hyper_step(n, kw, before, w)))(
            lambda n=_name, kw=_kw: _opt_step(n, [_p(5)], [torch.randn(5)], **kw))
    case(_name, "dtype", "a int32 param", raises(
        TypeError, r"params\[1\] \(param group 0\) has dtype int32"))(
        lambda n=_name: _opt_construct(n, [_p(3), torch.zeros(3, dtype=torch.int32)]))
    # float64 params run through torch's implementation (docs/dropin.md)
    case(_name, "dtype", "a float64 param: a step as torch's",
         ok(lambda out, before, w, n=_name: _check_hyper_step(n, {}, before, w)))(
        lambda n=_name: _opt_step(n, [_p(3), _p(4, dtype=F64)],
                                  [torch.randn(3), torch.randn(4, dtype=F64)]))
    case(_name, "dtype", "a float64 grad on a float32 param", raises(
        TypeError, r"the gradient of param 1 of group 0 has dtype float64"))(
        lambda n=_name: _opt_step(n, [_p(3), _p(4)], [torch.randn(3), torch.randn(4, dtype=F64)]))
    case(_name, "dtype", "an fp32 grad on a bf16 param", ok(_check_like_torch(_name)))(
        lambda n=_name: _opt_step(n, [_p(3, dtype=BF16)], [torch.randn(3)]))
    case(_name, "mixed-devices", "params on two devices, one without a kernel", raises(
        ValueError, r"params\[1\] \(param group 0\) is on %s" % OTHER))(
        lambda n=_name: _opt_construct(n, [_p(3), torch.zeros(3, device="meta")]))
    case(_name, "device", "a sparse grad", raises(
        RuntimeError, r"does not support sparse gradients \(param 0 of group 0"))(
        lambda n=_name: _opt_step(n, [_p(3)], [torch.randn(3).to_sparse()]))
    case(_name, "non-contiguous", "a strided param: stepped through a contiguous copy",
         ok(_check_like_torch(_name)))(
        lambda n=_name: _opt_step(n, [torch.randn(6)[::2].requires_grad_()], [torch.randn(3)]))
    case(_name, "non-contiguous", "a transposed grad of a contiguous param: copied, as torch",
         ok(_check_like_torch(_name)))(
        lambda n=_name: _opt_step(n, [_p(3, 4)], [torch.randn(4, 3).t()]))
    case(_name, "zero-size", "a zero-size param among others", ok(_check_like_torch(_name)))(
        lambda n=_name: _opt_step(n, [_p(0, 3), _p(4)], [torch.zeros(0, 3), torch.randn(4)]))
    case(_name, "empty", "no params", raises(ValueError, r"empty parameter list"))(
        lambda n=_name: _opt_construct(n, []))
    case(_name, "empty", "params without grads: nothing to do", ok(_check_like_torch(_name)))(
        lambda n=_name: _opt_step(n, [_p(3), _p(2)], [None, None]))
    case(_name, "duplicate", "one param twice in a group (torch warns): step rejected", raises(
        RuntimeError, r"adam_step_: .*\[0\] and .*\[1\] overlap in memory"))(
        lambda n=_name: _dup_param_opt(n))
    case(_name, "overlap", "two params that are overlapping views", raises(
        RuntimeError, r"adam_step_: params\[0\] and params\[1\] overlap in memory"))(
        lambda n=_name: (lambda b: _opt_step(n, [b[:4].requires_grad_(), b[2:].requires_grad_()],
                                             [torch.ones(4), torch.ones(4)]))(torch.zeros(6)))
    case(_name, "scalar", "step(found_inf=) of 2 elements", raises(
        RuntimeError, r"adam_step_: found_inf must have 1 element, got 2"))(
        lambda n=_name: (lambda c, w: ((lambda: w["opt"].step(found_inf=torch.zeros(2))), w))(
            *_opt_step(n, [_p(3)], [torch.randn(3)])))
    case(_name, "scalar", "a non-tensor param", raises(
        TypeError, r"optimizer can only optimize Tensors"))(
        lambda n=_name: _opt_construct(n, [1.0]))
    case(_name, "length", "state dict with a group of another size", raises(
        ValueError, r"doesn't match the size of optimizer's group"))(
        lambda n=_name: _opt_load(n, lambda sd: sd["param_groups"][0]["params"].pop()))
    # (the other bad state dicts: tests/test_adam.py's test_bad_state_dict_changes_nothing, a
    # load into an optimizer whose live state differs from the checkpoint's, so that a partial
    # load shows)
    for _key in ("exp_avg", "step"):
        case(_name, "state-dict", "param state without %r" % _key, raises(
            ValueError, r"the state of param 1 has no '%s'" % _key))(
            lambda n=_name, k=_key: _opt_load(n, lambda sd: sd["state"][1].pop(k)))
    case(_name, "state-dict", "an extra key in a param state: kept, as torch keeps it",
         ok(lambda out, before, w: _check_extra_state_key(w)))(
        lambda n=_name: _opt_load(n, lambda sd: sd["state"][1].update(extra=torch.ones(1))))


def _dup_param_opt(name):
    p = _p(4)
    p.grad = torch.randn(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = OPTIMIZERS[name]([p, p], lr=1e-2)
    return (lambda: opt.step()), {"opt": opt, "params": [p]}


def _check_hyper_step(name, kw, before, w):
    ref = [p.detach().clone().requires_grad_() for p in before["params"]]
    for r, p in zip(ref, w["params"]):
        r.grad = p.grad.clone()
    TORCH_OPTIMIZERS[name](ref, **dict(dict(lr=1e-2), **kw)).step()
    for r, p in zip(ref, w["params"]):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)


def _opt_load(name, mutate):
    """An optimizer (bf16 + fp32 params) after one step, its state dict mutated, loaded into a
    second optimizer that has stepped once too (so a partial load would show)."""
    def make():
        torch.manual_seed(0)
        params = [_p(2, dtype=BF16), _p(4)]
        for p in params:
            p.grad = torch.randn(p.shape).to(p.dtype)
        opt = OPTIMIZERS[name](params, lr=1e-2)
        opt.step()
        return opt
    sd = make().state_dict()
    sd = {"state": {k: dict(v) for k, v in sd["state"].items()},
          "param_groups": [dict(g, params=list(g["params"])) for g in sd["param_groups"]]}
    mutate(sd)
    target = make()
    return (lambda: target.load_state_dict(sd)), {"opt": target, "sd": sd}


def _check_extra_state_key(w):
    opt = w["opt"]
    p = opt.param_groups[0]["params"][1]
    assert torch.equal(opt.state[p]["extra"], torch.ones(1))
    assert opt.state[p]["exp_avg"].dtype == F32


# ---------------------------------------------------------------------------------------------
# mpext.MixedPrecisionOptimizer.

MPO = "MixedPrecisionOptimizer"


def _mpo_params():
    torch.manual_seed(1)
    return [torch.randn(4, 3).to(BF16).requires_grad_(), torch.randn(5).requires_grad_(),
            torch.randn(6).to(F16).requires_grad_()]


def _mpo(params=None, inner=torch.optim.AdamW, grads=True, **kw):
    """A wrapper over `inner` (lr 1e-2) on the model params; grads set after wrapping."""
    params = _mpo_params() if params is None else params
    opt = mpext.MixedPrecisionOptimizer(inner(params, lr=1e-2), **kw)
    if grads:
        for p in params:
                p.grad = torch.randn(p.shape).to(p.dtype)
    return opt, params


def _mpo_watch(opt, params, **extra):
    return dict({"opt": opt, "model": params, "scaler": opt.scaler}, **extra)


def _mpo_construct(params, **kw):
    inner = torch.optim.AdamW(params, lr=1e-2)
    return (lambda: mpext.MixedPrecisionOptimizer(inner, **kw)), {"inner": inner,
                                                                  "params": params}


def _mpo_call(method, *args, **kw):
    """(call, watched) for opt.method(*args) on a fresh wrapper with gradients."""
    def build():
        opt, params = _mpo(**kw)
        return (lambda: getattr(opt, method)(*args)), _mpo_watch(opt, params)
    return build


def _check_mpo_step_like_torch(out, before, w):
    """The masters after one step equal torch.optim.AdamW's step on FP32 copies (no float16
    param, so no loss scale: the gradients are taken as they are)."""
    assert w["opt"].loss_scale is None
    ref = [p.detach().float().clone().requires_grad_() for p in before["model"]]
    for r, p in zip(ref, w["model"]):
        r.grad = None if p.grad is None else p.grad.float()
    torch.optim.AdamW(ref, lr=1e-2).step()
    for r, p in zip(ref, w["model"]):
        got = w["opt"].master_param(p)
        got = p if got is None else got
        torch.testing.assert_close(got.detach().float(), r.detach(), rtol=1e-6, atol=1e-7)
        if p.dtype != F32:
            assert torch.equal(_int_view(p.detach()), _int_view(got.detach().to(p.dtype)))


def _mpo_sd(mutate):
    """A wrapper after one step, its state dict mutated, loaded into a second stepped one."""
    def make():
        opt, params = _mpo()
        opt.step()
        for p in params:
            p.grad = torch.randn(p.shape).to(p.dtype)
        return opt, params
    src, _ = make()
    sd = src.state_dict()
    sd = dict(sd, masters=dict(sd["masters"]))
    mutate(sd)
    opt, params = make()
    return (lambda: opt.load_state_dict(sd)), _mpo_watch(opt, params)


case(MPO, "dtype", "a float64 param", raises(
    TypeError, r"MixedPrecisionOptimizer: param 1 of group 0 has dtype float64"))(
    lambda: _mpo_construct([_p(3, dtype=BF16), torch.zeros(3, dtype=F64, requires_grad=True)]))
case(MPO, "dtype", "a float64 gradient", raises(
    TypeError, r"MixedPrecisionOptimizer.step: the gradient of param 2 has dtype float64"))(
    lambda: (lambda o, ps: (ps[2].__setattr__("grad_dtype", None),
                            ps[2].__setattr__("grad", torch.zeros(6, dtype=F64)),
                            ((lambda: o.step()), _mpo_watch(o, ps)))[2])(*_mpo()))
case(MPO, "device", "a sparse gradient", raises(
    RuntimeError, r"MixedPrecisionOptimizer.step: the gradient of param 1 is torch.sparse_coo"))(
    lambda: (lambda o, ps: (ps[1].__setattr__("grad", torch.ones(5).to_sparse()),
                            ((lambda: o.step()), _mpo_watch(o, ps)))[1])(*_mpo()))
case(MPO, "mixed-devices", "params on two devices", raises(
    ValueError, r"params on several devices: param 1 of group 0 is on %s" % OTHER))(
    lambda: _mpo_construct([_p(3, dtype=BF16), torch.zeros(3, device=OTHER,
                                                            requires_grad=True)]))
case(MPO, "non-contiguous", "a strided param", raises(
    ValueError, r"param 1 of group 0 must be dense and non-overlapping"))(
    lambda: _mpo_construct([_p(3, dtype=BF16),
                            torch.zeros(6, dtype=BF16)[::2].requires_grad_()]))
case(MPO, "zero-size", "a zero-size bf16 param among others", ok(_check_mpo_step_like_torch))(
    lambda: (lambda o, ps: ((lambda: o.step()), _mpo_watch(o, ps)))(
        *_mpo([torch.zeros(0, 3, dtype=BF16, requires_grad=True)] + _mpo_params()[:2])))
case(MPO, "empty", "an optimizer without params", raises(
    ValueError, r"MixedPrecisionOptimizer: optimizer has no params"))(
    lambda: (lambda inner: ((lambda: mpext.MixedPrecisionOptimizer(inner)),
                            {"inner": inner}))(torch.optim.SGD([{"params": []}], lr=0.1)))
case(MPO, "empty", "no gradients: step changes nothing", ok(
    lambda out, before, w: _same(fingerprint(before["model"]), fingerprint(w["model"]))))(
    lambda: (lambda o, ps: ((lambda: o.step()), _mpo_watch(o, ps)))(*_mpo(grads=False)))
case(MPO, "duplicate", "one param twice", raises(
    ValueError, r"param 1 of group 0 is the same tensor as param 0 of group 0"))(
    lambda: (lambda p: _mpo_construct_dup([p, p]))(_p(3, dtype=BF16)))
for _cls in (torch.optim.AdamW, torch.optim.SGD):
    case(MPO, "overlap", "overlapping bf16 params (%s): rejected at construction" % _cls.__name__,
         raises(ValueError, r"param 0 of group 0 and param 1 of group 0 overlap in memory"))(
        lambda c=_cls: _mpo_overlap(c))
case(MPO, "scalar", "backward(a float)", raises(
    TypeError, r"MixedPrecisionOptimizer.backward: loss must be a tensor, got float"))(
    _mpo_call("backward", 1.0))
case(MPO, "scalar", "clip_grad_norm_(a 2-element tensor)", raises(
    ValueError, r"max_norm must be a finite number > 0"))(
    _mpo_call("clip_grad_norm_", torch.ones(2)))
for _v in (NAN, 0.0, -1.0, INF):
    case(MPO, "hyper", "clip_grad_norm_(%r)" % _v, raises(
        ValueError, r"max_norm must be a finite number > 0, got %r" % _v))(
        _mpo_call("clip_grad_norm_", _v))
    case(MPO, "hyper", "max_grad_norm=%r" % _v, raises(
        ValueError, r"max_grad_norm must be a finite number > 0 or None, got %r" % _v))(
        lambda v=_v: _mpo_construct(_mpo_params(), max_grad_norm=v))
for _v in (NAN, 0.0, -2.0, INF, "static"):
    case(MPO, "hyper", "loss_scale=%r" % (_v,), raises(
        ValueError, r"loss_scale must be 'dynamic', a finite number > 0 or None"))(
        lambda v=_v: _mpo_construct(_mpo_params(), loss_scale=v))
for _kw, _exc, _re in [
        (dict(device="cpu"), TypeError, r"device is set by the wrapper"),
        (dict(growth_intervall=3), TypeError, r"unknown option 'growth_intervall'"),
        (dict(loss_scale=8.0, growth_interval=3), ValueError,
         r"the scaler option growth_interval needs loss_scale='dynamic'"),
        (dict(loss_scale="dynamic", hysteresis=0), ValueError,
         r"hysteresis must be an int in \[1, 2\^31\), got 0")]:
    case(MPO, "hyper", "options %r" % _kw, raises(_exc, _re))(
        lambda kw=_kw: _mpo_construct(_mpo_params(), **kw))
case(MPO, "hyper", "growth_factor=nan with a dynamic scale is rejected at construction",
     raises((ValueError, AssertionError), r"growth_factor"))(
    lambda: _mpo_construct(_mpo_params(), loss_scale="dynamic", growth_factor=NAN))
for _what, _mut, _exc, _re in [
        ("a missing key", lambda sd: sd.pop("scaler"), ValueError,
         r"state_dict must have the keys"),
        ("an extra key", lambda sd: sd.update(extra=1), ValueError,
         r"state_dict must have the keys"),
        ("another loss-scale mode", lambda sd: sd.update(loss_scale=None), ValueError,
         r"saved with loss_scale=None but this optimizer has loss_scale='dynamic'"),
        ("a mis-shaped master", lambda sd: sd["masters"].update({0: torch.zeros(3, 4)}),
         ValueError, r"masters\[0\] has shape \(3, 4\) but the param has shape \(4, 3\)"),
        ("an integer master", lambda sd: sd["masters"].update(
            {0: torch.zeros(4, 3, dtype=torch.int32)}), TypeError,
         r"masters\[0\] must be a floating-point tensor"),
        ("a scaler state without 'scale'", lambda sd: sd.update(scaler={}), ValueError,
         r"scaler must be a GradScaler state_dict"),
        ("an inner state with a mis-shaped moment", lambda sd: sd["optimizer"]["state"][1].update(
            exp_avg=torch.zeros(7)), (ValueError, RuntimeError), r"exp_avg|size|shape")]:
    case(MPO, "state-dict", _what, raises(_exc, _re))(lambda m=_mut: _mpo_sd(m))
case(MPO, "length", "masters for a param too many", raises(
    ValueError, r"masters has entries for params \[0, 2, 5\]"))(
    lambda: _mpo_sd(lambda sd: sd["masters"].update({5: torch.zeros(2)})))


def _mpo_construct_dup(params):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about the duplicate and keeps it
        inner = torch.optim.AdamW(params, lr=1e-2)
    return (lambda: mpext.MixedPrecisionOptimizer(inner)), {"inner": inner, "params": params}


def _mpo_overlap(inner_cls):
    b = torch.randn(6).to(BF16)
    params = [b[:4].requires_grad_(), b[2:].requires_grad_()]
    inner = inner_cls(params, lr=1e-2)
    return (lambda: mpext.MixedPrecisionOptimizer(inner)), {"inner": inner, "params": params}


# ---------------------------------------------------------------------------------------------
# The test.

APIS = ("to_bf16", "to_fp16", "to_fp32", "cast_", "unscale_", "update_scale_", "adam_step_",
        "grad_norm", "GradScaler", "Adam", "AdamW", MPO)
# Categories that do not apply: a single-tensor op has no list (no lengths, no mixed devices, no
# duplicates, no empty list); update_scale_ takes no lists; the ops hold no state dicts.
NOT_APPLICABLE = {
    "to_bf16": {"mixed-devices", "length", "shape", "duplicate", "empty", "state-dict"},
    "cast_": {"state-dict"}, "unscale_": {"length", "shape", "state-dict"},
    "update_scale_": {"mixed-devices", "length", "shape", "empty", "state-dict"},
    "adam_step_": {"state-dict"}, "grad_norm": {"length", "shape", "state-dict"},
    "GradScaler": {"overlap", "scalar", "length", "shape"},
    "Adam": {"shape"},
}
for _n in ("to_fp16", "to_fp32"):
    NOT_APPLICABLE[_n] = NOT_APPLICABLE["to_bf16"] | ({"hyper"})
NOT_APPLICABLE["AdamW"] = NOT_APPLICABLE["Adam"]
NOT_APPLICABLE[MPO] = {"shape"}


def _id(c):
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", "%s-%s-%s" % (c.api, c.category, c.what))[:90]


def _param(c):
    marks = [pytest.mark.xfail(strict=True, reason=c.xfail)] if c.xfail else []
    return pytest.param(c, id=_id(c), marks=marks)


@pytest.mark.parametrize("c", [_param(c) for c in CASES])
def test_bad_input(c):
    call, watched = c.build()
    before_fp = fingerprint(watched)
    before = clone_tree(watched)
    if c.expect[0] == "ok":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = call()
        c.expect[1](out, before, watched)
        return
    _, exc, regex = c.expect
    with pytest.raises(exc) as info:
        call()
    assert re.search(regex, str(info.value)), "message %r does not match %r" % (
        str(info.value), regex)
    _same(before_fp, fingerprint(watched))


def matrix_summary() -> str:
    """One line: how many cases over how many APIs (printed at the end of every pytest run that
    collected this module, by conftest.pytest_terminal_summary)."""
    return ("bad-input matrix: %d cases over %d APIs (%d known bugs, xfail)"
            % (len(CASES), len({c.api for c in CASES}), sum(1 for c in CASES if c.xfail)))


def test_matrix_coverage():
    """Every API has a case in every category that applies to it; prints the counts."""
    counts = Counter((c.api, c.category) for c in CASES)
    missing = [(api, cat) for api in APIS for cat in CATEGORIES
               if cat not in NOT_APPLICABLE.get(api, set()) and not counts[(api, cat)]]
    print("\n" + matrix_summary())
    for api in APIS:
        row = ", ".join("%s %d" % (cat, counts[(api, cat)]) for cat in CATEGORIES
                        if counts[(api, cat)])
        print("  %-14s %3d: %s" % (api, sum(counts[(api, cat)] for cat in CATEGORIES), row))
    assert not missing, "categories without a case: %s" % missing
    assert {c.api for c in CASES} <= set(APIS)
