"""The rules x formats table of mpext's optimizers (the model: torch's ``optim_db`` in
torch/testing/_internal/common_optimizers.py): one :class:`RuleInfo` row per update rule, one
:class:`FormatInfo` row per state format, and :func:`pairs`, the valid (rule, format) pairs that
tests/test_optim_table.py runs every generic test over.

A new rule is one ``RuleInfo`` row in ``RULES``; a new format one ``FormatInfo`` row in
``FORMATS``. Nothing here is a reference value: the references are the rows' ``reference``
optimizers (torch's own, or a rule's published implementation) and the tests' float64 / bitwise
comparisons.
"""
import dataclasses
import importlib
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import pytest
import torch

import mpext.optim
from mpext.optim import formats as F

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
LOW = (BF16, F16)
NAN, INF = float("nan"), float("inf")

# The params every pair is run on, per param dtype: odd sizes, a channels_last 4-D tensor, and
# one of at least MIN_8BIT_NUMEL elements, so that 8-bit moments are really quantized.
SHAPES = ((37, 5), (128,), (3, 4, 5, 6), (64, 80))
assert max(a * b for a, b in (SHAPES[0], SHAPES[3])) >= F.MIN_8BIT_NUMEL


@dataclasses.dataclass(frozen=True)
class ErrorInput:
    """Constructor kwargs a rule refuses, with the error type and a fragment of its message."""
    kwargs: Dict[str, Any]
    exc: type
    match: str


@dataclasses.dataclass(frozen=True)
class RuleInfo:
    """One update rule.

    ``cls`` the mpext optimizer, ``kwargs`` its constructor kwargs for the tests (its rule's
    hyperparameters only; a format adds its own), ``reference`` a factory (params, kwargs) ->
    the independent optimizer it must match on FP32 params, ``error_inputs`` the bad
    hyperparameters. The moments and their format keywords are the class's own
    (``cls.moments``: the quantities and the settings that pick their formats)."""
    name: str
    cls: Any
    kwargs: Dict[str, Any]
    reference: Callable[..., torch.optim.Optimizer]
    error_inputs: Tuple[ErrorInput, ...] = ()
    # FP32 params vs the reference after a few steps: the existing parity tolerances of
    # tests/test_adam.py (test_fp32_matches_torch_1000_steps).
    rtol: float = 1e-5
    atol: float = 1e-6
    # the largest step a param takes, in units of lr (Adam's normalized update is about 1;
    # SGD's is the gradient itself): the scale of a lossy format's error per step
    update_scale: float = 1.0
    # A lossy format's error per step, in units of the step (lr x update_scale), per moment
    # format: Adam's normalized update moves by a fraction of the moments' rounding; Lion's
    # sign can flip (2 steps at worst).
    lossy: Tuple[Tuple[str, float], ...] = (("float32", 1e-3), ("bfloat16", 0.05), ("q8", 0.5))
    # mpext-only constructor kwargs the reference does not take (it is given the others)
    mpext_only: Tuple[str, ...] = ()
    # False: these kwargs keep no moment (SGD without momentum), whatever the class declares
    keeps_moments: bool = True

    @property
    def moments(self) -> Tuple[F.Quantity, ...]:
        return tuple(self.cls.moments) if self.keeps_moments else ()

    def make(self, params, **kw) -> torch.optim.Optimizer:
        return self.cls(params, **dict(self.kwargs, **kw))

    def make_reference(self, params) -> torch.optim.Optimizer:
        kw = {k: v for k, v in self.kwargs.items() if k not in self.mpext_only}
        return self.reference(params, **kw)

    def __repr__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class FormatInfo:
    """One state format: a param format of mpext.optim.formats (where the FP32 value lives)
    with a moment format (how every moment of the rule is stored).

    ``param_format`` / ``moment_format`` name formats.PARAM_FORMATS / MOMENT_FORMATS entries;
    ``kwargs`` are the param-format constructor kwargs (the moment kwargs come from the rule's
    moments, :meth:`kwargs_for`); ``param_dtypes`` the param dtypes it applies to;
    ``storage_bytes`` / ``moment_bytes`` the state bytes per param element (FP32 value's
    storage; each moment's values or codes, block scales aside), written here as facts for
    the tests to check formats.py and the live tensors against; ``exact``: its params and FP32
    values are bit for bit those of FP32 masters with FP32 moments; ``twin``: the format it
    must equal bit for bit (a remainder's master twin); ``block``: elements per FP32 scale of
    its moments (0: none)."""
    name: str
    param_format: str
    moment_format: str
    kwargs: Dict[str, Any]
    param_dtypes: Tuple[torch.dtype, ...]
    storage_bytes: int
    moment_bytes: int
    exact: bool = False
    twin: Optional[str] = None
    block: int = 0
    moment_rounding: str = "stochastic"

    @property
    def keeps_value(self) -> bool:
        """Whether the FP32 value a step computes is observable (the FP32 param, a master or a
        remainder), so that an EMA of it can be checked bit for bit."""
        return self.param_format in ("fp32_param", "master", "remainder")

    @property
    def lossy_params(self) -> bool:
        """Whether the params are rounded from an FP32 value that is kept nowhere."""
        return self.param_format in ("nearest", "stochastic")

    def kwargs_for(self, rule: RuleInfo) -> Dict[str, Any]:
        kw = dict(self.kwargs)
        for q in rule.moments:
            kw[q.setting] = self.moment_format  # by the format's name, as formats.py takes it
        if self.moment_format == "bfloat16":
            kw["moment_rounding"] = self.moment_rounding
        if self.block:
            kw["block_size"] = self.block
        return kw

    def __repr__(self) -> str:
        return self.name


# ---- The rules ------------------------------------------------------------------------------

def _error_inputs(*rows) -> Tuple[ErrorInput, ...]:
    return tuple(ErrorInput(*r) for r in rows)


# The hyperparameter checks every rule shares (mpext.optim._base), plus the rule's own.
COMMON_ERRORS = (
    (dict(lr=-1e-3), ValueError, r"Invalid learning rate: -0.001"),
    (dict(lr=INF), ValueError, r"lr must be finite"),
    (dict(lr="0.1"), TypeError, r"lr must be a float or a 1-element Tensor"),
    (dict(weight_decay=-0.1), ValueError, r"Invalid weight_decay value: -0.1"),
)
# torch.optim's differentiable=True, refused by the fused step (Lion, as lion-pytorch, has none)
DIFFERENTIABLE = (dict(differentiable=True), ValueError, r"differentiable=True is not supported")

ADAM_ERRORS = _error_inputs(
    *COMMON_ERRORS, DIFFERENTIABLE,
    (dict(betas=(1.0, 0.9)), ValueError, r"Invalid beta parameter at index 0: 1.0"),
    (dict(betas=(0.9, -0.1)), ValueError, r"Invalid beta parameter at index 1: -0.1"),
    (dict(betas=(0.9,)), ValueError, r"betas must be a pair of floats"),
    (dict(eps=-1.0), ValueError, r"Invalid epsilon value: -1.0"),
    (dict(eps=NAN), ValueError, r"Invalid epsilon value: nan"),
    (dict(amsgrad=True), NotImplementedError, r"amsgrad=True is not supported"),
)

RULES = {
    "adam": RuleInfo("adam", mpext.optim.Adam,
                     dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05),
                     torch.optim.Adam, ADAM_ERRORS),
    "adamw": RuleInfo("adamw", mpext.optim.AdamW,
                      dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
                      torch.optim.AdamW, ADAM_ERRORS),
}


def _optional_rule(name: str, make: Callable[[], RuleInfo]) -> None:
    """Adds a rule whose optimizer (or reference) may not exist in this tree yet."""
    try:
        RULES[name] = make()
    except (AttributeError, ImportError):
        pass


def _lion() -> RuleInfo:
    lion = importlib.import_module("lion_pytorch").Lion
    return RuleInfo("lion", mpext.optim.Lion, dict(lr=1e-4, betas=(0.9, 0.99),
                                                   weight_decay=0.1),
                    lion, update_scale=1.5,
                    lossy=(("float32", 1e-3), ("bfloat16", 2.0), ("q8", 2.0)),
                    error_inputs=_error_inputs(
                        *COMMON_ERRORS,
                        (dict(betas=(1.5, 0.99)), ValueError, r"Invalid beta parameter at "
                                                              r"index 0: 1.5"),
                        (dict(betas=(0.9, -0.1)), ValueError, r"Invalid beta parameter at "
                                                               r"index 1: -0.1")))


def _sgd(momentum: float) -> Callable[[], RuleInfo]:
    def make() -> RuleInfo:
        kw = dict(lr=1e-2, momentum=momentum, weight_decay=0.05)
        if momentum:
            kw["dampening"] = 0.1
        return RuleInfo("sgd" if momentum else "sgd-plain", mpext.optim.SGD, kw,
                        torch.optim.SGD, update_scale=10.0 if momentum else 5.0,
                        keeps_moments=bool(momentum), error_inputs=_error_inputs(
                            *COMMON_ERRORS, DIFFERENTIABLE,
                            (dict(momentum=-0.5), ValueError, r"Invalid momentum value: -0.5"),
                            (dict(momentum=0.0, nesterov=True), ValueError,
                             r"Nesterov momentum requires a momentum and zero dampening")))
    return make


_optional_rule("lion", _lion)
_optional_rule("sgd", _sgd(0.9))  # a momentum_buffer
_optional_rule("sgd-plain", _sgd(0.0))  # no state at all


# ---- The formats ----------------------------------------------------------------------------

_PARAM_KW = {
    "fp32_param": ({}, (F32,), 0),
    "master": ({}, LOW, 4),
    "remainder": (dict(param_remainders=True), (BF16,), 2),
    "nearest": (dict(master_weights=False), LOW, 0),
    "stochastic": (dict(master_weights=False, stochastic_rounding=True), LOW, 0),
}


def _format(name: str, param: str, moment: str = "float32", **extra) -> FormatInfo:
    kw, dtypes, storage = _PARAM_KW[param]
    moment_bytes = {"float32": 4, "bfloat16": 2, "q8": 1}[moment]
    block = 256 if moment == "q8" else 0
    exact = moment == "float32" and param in ("fp32_param", "master", "remainder")
    return FormatInfo(name, param, moment, kw, dtypes, storage, moment_bytes, exact=exact,
                      block=block, **extra)


# Every param format with every moment format: the name is the param format's, then the
# moment format's suffix; a remainder's twin is the master format with the same moments.
_PARAM_NAMES = (("fp32", "fp32_param"), ("master", "master"), ("remainder", "remainder"),
                ("nearest", "nearest"), ("stochastic", "stochastic"))
_MOMENT_ROWS = (("", "float32", {}), ("-bf16", "bfloat16", {}),
                ("-bf16-rne", "bfloat16", dict(moment_rounding="nearest")), ("-q8", "q8", {}))
FORMATS = {f.name: f for f in (
    _format(name + suffix, param, moment,
            twin="master" + suffix if param == "remainder" else None, **extra)
    for name, param in _PARAM_NAMES for suffix, moment, extra in _MOMENT_ROWS)}


def applies(rule: RuleInfo, fmt: FormatInfo) -> bool:
    """Whether a format exists for a rule: a moment format needs a moment to store (SGD without
    momentum keeps none, so only the float32 rows, which differ in nothing else, apply)."""
    if not rule.moments:
        return fmt.moment_format == "float32"
    return True


def pairs() -> Iterator[Tuple[RuleInfo, FormatInfo]]:
    """Every valid (rule, format) pair. The param dtypes of each are the format's
    (``param_dtypes``: a remainder needs bfloat16 params), and the params include one of at
    least MIN_8BIT_NUMEL elements so that 8-bit moments really quantize."""
    for rule in RULES.values():
        for fmt in FORMATS.values():
            if applies(rule, fmt):
                yield rule, fmt


def covering_pairs() -> Iterator[Tuple[RuleInfo, FormatInfo]]:
    """Per rule, one pair per param format, the moment formats taken in turn so that each
    appears: for the tests too slow to run over every pair (torch.compile's tracing), which
    the formats' combinations do not change beyond their parts."""
    for rule in RULES.values():
        used: Dict[str, int] = {}
        by_param: Dict[str, list] = {}
        for r, f in pairs():
            if r is rule:
                by_param.setdefault(f.param_format, []).append(f)
        for fmts in by_param.values():
            f = min(fmts, key=lambda f: used.get(f.moment_format, 0))
            used[f.moment_format] = used.get(f.moment_format, 0) + 1
            yield rule, f


def conversions() -> Iterator[Tuple[RuleInfo, FormatInfo, torch.dtype]]:
    """Every (rule, saved format, param dtype): a checkpoint of that format, for loading by an
    optimizer of each other format of the rule that takes the dtype (:func:`loaders`)."""
    for rule, a in pairs():
        for dt in a.param_dtypes:
            yield rule, a, dt


def loaders(rule: RuleInfo, dtype: torch.dtype) -> Iterator[FormatInfo]:
    """The formats of ``rule`` for params of ``dtype``."""
    for b in FORMATS.values():
        if applies(rule, b) and dtype in b.param_dtypes:
            yield b


def pair_id(pair) -> str:
    return "-".join(getattr(x, "name", None) or str(x).replace("torch.", "") for x in pair)


# ---- Params, gradients, states --------------------------------------------------------------

def make_params(dtypes, seed: int = 0, shapes=SHAPES):
    """Leaf params of each dtype and shape, seeded (the 4-D ones channels_last)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for dt in dtypes:
        for s in shapes:
            p = torch.randn(s, generator=gen).to(dt)
            if len(s) == 4:
                p = p.to(memory_format=torch.channels_last)
            out.append(p.requires_grad_())
    return out


def clone_params(params):
    return [p.detach().clone().requires_grad_() for p in params]


def make_grads(params, step: int, seed: int = 0, scale: float = 1.0):
    """Gradients for a step, each in its param's dtype (the scale multiplies them, as a
    GradScaler's loss scale would)."""
    gen = torch.Generator().manual_seed(1000 * seed + step)
    return [(torch.randn(p.shape, generator=gen) * scale).to(p.dtype) for p in params]


def set_grads(params, grads) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()


def lockstep(a, b, opt_a, opt_b, gen, steps: int = 1) -> None:
    """Steps two optimizers side by side on the same gradients: a's drawn from ``gen`` in a's
    dtypes, b's copies of them in b's dtypes."""
    for _ in range(steps):
        for x, y in zip(a, b):
            x.grad = torch.randn(x.shape, generator=gen).to(x.dtype)
            y.grad = x.grad.to(y.dtype, copy=True)
        opt_a.step()
        opt_b.step()


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_bits(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """a and b hold the same bits, in the same dtype, shape and device."""
    assert a.device == b.device, "%s: on %s and %s" % (what, a.device, b.device)
    assert same_bits(a, b), "%s: %s %s vs %s %s differ" % (what, a.dtype, tuple(a.shape), b.dtype,
                                                          tuple(b.shape))


def op_bad_input_changes_nothing(op, base, change, exc, match, device) -> None:
    """A call of the op ``op`` with keyword arguments ``base`` (CPU tensors) changed by
    ``change`` raises ``exc`` matching ``match`` and writes nothing, through the real kernel
    (``device`` "cpu") or the fake one ("meta")."""
    def to(v):
        return v.to(device) if isinstance(v, torch.Tensor) else v

    kw = {k: [to(t) for t in v] if isinstance(v, list) else to(v)
          for k, v in dict(base, **change).items()}
    tensors = [t for v in kw.values() for t in (v if isinstance(v, list) else [v])
               if isinstance(t, torch.Tensor)]
    before = [t.clone() for t in tensors] if device != "meta" else []
    with pytest.raises(exc, match=match):
        op(**kw)
    for i, (a, b) in enumerate(zip(tensors, before)):
        assert_bits(a, b, "tensor %d of the refused call" % i)


_TORCH_GROUP_DEFAULTS = dict(foreach=None, capturable=False, differentiable=False, fused=None)


def snapshot(opt, params):
    """Copies of every param, every state tensor and every group setting but the params."""
    state = [{k: v.detach().clone() if isinstance(v, torch.Tensor) else v
              for k, v in sorted(opt.state[p].items())} for p in params]
    # torch's own group keys at their defaults where a group lacks them (torch's __setstate__
    # adds them on load: not a difference in behaviour)
    groups = [dict(_TORCH_GROUP_DEFAULTS, **{k: v for k, v in g.items() if k != "params"})
              for g in opt.param_groups]
    return [p.detach().clone() for p in params], state, groups


def assert_same(snap_a, snap_b, what: str = "") -> None:
    """Two snapshots hold the same bits (params, state keys and tensors, group settings)."""
    (pa, sa, ga), (pb, sb, gb) = snap_a, snap_b
    for i, (x, y) in enumerate(zip(pa, pb)):
        assert same_bits(x, y), "%s: param %d differs" % (what, i)
    for i, (x, y) in enumerate(zip(sa, sb)):
        assert sorted(x) == sorted(y), "%s: param %d's state keys %s vs %s" % (what, i,
                                                                             sorted(x), sorted(y))
        for k in x:
            if isinstance(x[k], torch.Tensor):
                assert same_bits(x[k], y[k]), "%s: state %r of param %d differs" % (what, k, i)
            else:
                assert x[k] == y[k], "%s: state %r of param %d differs" % (what, k, i)
    for i, (x, y) in enumerate(zip(ga, gb)):
        diff = {k: (x.get(k), y.get(k)) for k in set(x) | set(y) if x.get(k) != y.get(k)}
        assert not diff, "%s: group %d's settings differ: %s" % (what, i, diff)


def fp32_value(opt, p: torch.Tensor) -> torch.Tensor:
    """A param's FP32 value as its optimizer state holds it (master, param + remainder, or the
    param itself widened), through formats.py's decoders."""
    fmt = F.stored_param_format(opt.state[p])
    return (fmt or F.FP32_PARAM).decode(p, opt.state[p])


def moment_value(opt, p: torch.Tensor, q: F.Quantity) -> torch.Tensor:
    """A moment's FP32 values as the state holds them (decoded exactly)."""
    t, scale = F.moment_of(opt.state[p], q.name)
    return (F.Q8 if scale is not None else F.FORMAT_OF_DTYPE[t.dtype]).decode(t, scale)
