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
import io
from typing import Any, Callable, Dict, Iterator, NamedTuple, Optional, Tuple

import numpy as np
import pytest
import torch

import mpext.optim
from mpext.optim import formats as F
from reference import (Q8_VALUES, bf16_sr_array, fp16_sr_array, q8_decode_array, q8_encode_array,
                       q8_exp_array, sr_bits_array, sr_key)

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
    # SGD's is the gradient itself): with the param, the magnitude a step's fp32 roundings
    # are roundings of (reference_step)
    update_scale: float = 1.0
    # mpext-only constructor kwargs the reference does not take (it is given the others)
    mpext_only: Tuple[str, ...] = ()
    # The fp32 roundings by which one step of the mpext rule may differ from one step of the
    # reference from the same state (its order of operations is the reference's, op for op,
    # where this is 0): the slack of the per-step check, in fp32 ulps of the compared value
    # and of the step (lr x update_scale).
    ulps: int = 0
    # whether the reference takes ``maximize`` (else it is fed the negated gradient, which is
    # what maximize means for every rule here)
    reference_maximize: bool = True
    # whether the reference's state counts steps (torch's Adam: ``state["step"]``)
    reference_steps: bool = False
    # what the rule does to its moments as decoded from 8-bit codes before it steps
    # ({name: fp32 value}, the rule's kwargs -> the same, changed in place), if anything
    q8_decoded: Optional[Callable[[Dict[str, torch.Tensor], Dict[str, Any]], None]] = None
    # False: these kwargs keep no moment (SGD without momentum), whatever the class declares
    keeps_moments: bool = True
    # (muon) The shapes of the table's params for a rule that takes matrices only (Muon),
    # instead of SHAPES; None: any shape. See fit_shapes.
    shapes: Optional[Tuple[Tuple[int, ...], ...]] = None
    # (muon) whether the rule takes ``maximize`` (torch.optim.Muon has none: mpext's refuses it)
    maximize: bool = True
    # (muon) the graph breaks a compiled step has by design (fragments of their reasons): Muon's
    # Newton-Schulz runs eagerly (torch's GEMM calls, torch's bits)
    graph_breaks: Tuple[str, ...] = ()
    # (muon) the most frames a compiled step compiles (torch.compile's first step, which makes
    # the state, and the steady step; Muon's: measured 5, its break cutting each in two)
    max_frames: int = 2
    # (muon) the test families the rule's rows cannot run, each with why: ((family, reason),
    # ...). Its rows there are collected and skipped with the reason (table_params), never
    # dropped.
    excluded: Tuple[Tuple[str, str], ...] = ()
    # (muon) the formats (FORMATS names) the rule's rows run in pairs(), for a rule whose every
    # test costs more than the others' (Muon's Newton-Schulz and its compiled frames) and would
    # add minutes to CI over every format: a covering set (covering_sweep); None: every format
    sweep: Optional[Tuple[str, ...]] = None

    def exclusion(self, family: str) -> Optional[str]:
        """Why this rule's rows cannot run test family ``family`` (None: they run)."""
        return dict(self.excluded).get(family)

    def fit_shapes(self, shapes):
        """(muon) The param shapes a test asks for, as this rule takes them: unchanged for a
        rule of any shape; for a matrices-only rule, its own ``shapes`` in place of the
        table's SHAPES, and any other shape that is not 2-D made one with the same elements
        ((n,) -> (1, n), (a, b, ...) -> (a, b * ...)), so a test's sizes keep their point."""
        if self.shapes is None:
            return shapes
        if shapes is SHAPES:
            return self.shapes
        return tuple(s if len(s) == 2 else (1, s[0]) if len(s) == 1
                     else (s[0], int(np.prod(s[1:]))) for s in shapes)

    @property
    def moments(self) -> Tuple[F.Quantity, ...]:
        return tuple(self.cls.moments) if self.keeps_moments else ()

    def make(self, params, **kw) -> torch.optim.Optimizer:
        return self.cls(params, **dict(self.kwargs, **kw))

    def make_reference(self, params, **extra) -> torch.optim.Optimizer:
        kw = {k: v for k, v in self.kwargs.items() if k not in self.mpext_only}
        return self.reference(params, **dict(kw, **extra))

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


# ---- The rules (Muon's row after the formats, which its sweep names) -----------------------

def _error_inputs(*rows) -> Tuple[ErrorInput, ...]:
    return tuple(ErrorInput(*r) for r in rows)


# The hyperparameter checks every rule shares (mpext.optim._base), plus the rule's own.
COMMON_ERRORS = (
    (dict(lr=-1e-3), ValueError, r"Invalid learning rate: -0.001"),
    (dict(lr=INF), ValueError, r"lr must be finite"),
    (dict(lr="0.1"), TypeError, r"lr must be a float or a 1-element Tensor"),
    (dict(weight_decay=-0.1), ValueError, r"Invalid weight_decay value: -0.1"),
    (dict(lr=NAN), ValueError, r"Invalid learning rate: nan"),
    (dict(weight_decay=NAN), ValueError, r"Invalid weight_decay value: nan"),
)
# torch.optim's differentiable=True, refused by the fused step (Lion, as lion-pytorch, has none)
DIFFERENTIABLE = (dict(differentiable=True), ValueError, r"differentiable=True is not supported")

ADAM_ERRORS = _error_inputs(
    *COMMON_ERRORS, DIFFERENTIABLE,
    (dict(betas=(1.0, 0.9)), ValueError, r"Invalid beta parameter at index 0: 1.0"),
    (dict(betas=(NAN, 0.9)), ValueError, r"Invalid beta parameter at index 0: nan"),
    (dict(betas=(0.9, -0.1)), ValueError, r"Invalid beta parameter at index 1: -0.1"),
    (dict(betas=(0.9, 1.0)), ValueError, r"Invalid beta parameter at index 1: 1.0"),
    (dict(betas=(0.9,)), ValueError, r"betas must be a pair of floats"),
    (dict(eps=-1.0), ValueError, r"Invalid epsilon value: -1.0"),
    (dict(eps=NAN), ValueError, r"Invalid epsilon value: nan"),
    (dict(eps=INF), ValueError, r"eps must be finite, got inf"),
    (dict(weight_decay=INF), ValueError, r"weight_decay must be finite, got inf"),
    (dict(lr=torch.ones(2)), ValueError, r"Tensor lr must be 1-element"),
)

def _adam_v_floor(moments: Dict[str, torch.Tensor], kw: Dict[str, Any]) -> None:
    """docs/moments_8bit.md, "The second moment near zero": a v decoded from 8-bit codes is
    raised to m^2 / K (K = (1-b1)^2 / ((1-b2)(1 - b1^2/b2)), for b1^2 < b2), in fp32 as the
    kernel computes it (mp_adam_q8_floor_v)."""
    b1, b2 = kw["betas"]
    r = b1 * b1 / b2
    if r >= 1.0:
        return
    inv_k = torch.tensor((1.0 - b2) * (1.0 - r) / ((1.0 - b1) * (1.0 - b1)), dtype=F32)
    m, v = moments["exp_avg"].float(), moments["exp_avg_sq"].float()
    w = (m * m) * inv_k
    moments["exp_avg_sq"] = torch.where(w > v, w, v)


# Adam's update divides by sqrt(v) and bias corrections that torch and the kernel compute in
# another order: a few fp32 roundings apart per step.
ADAM_ULPS = 2

RULES = {
    "adam": RuleInfo("adam", mpext.optim.Adam,
                     dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05),
                     torch.optim.Adam, ADAM_ERRORS, ulps=ADAM_ULPS, reference_steps=True,
                     q8_decoded=_adam_v_floor),
    "adamw": RuleInfo("adamw", mpext.optim.AdamW,
                      dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
                      torch.optim.AdamW, ADAM_ERRORS, ulps=ADAM_ULPS, reference_steps=True,
                     q8_decoded=_adam_v_floor),
}


def _package_reference(module: str, attr: str, package: str) -> Callable[..., Any]:
    """A reference optimizer from a package that may not be installed: imported when a test
    asks for it, and a missing package skips that test with the reason (the rule's other
    tests, which need no reference, still run)."""
    def make(params, **kw):
        ref = pytest.importorskip(module, reason="%s (the reference of this rule) is not "
                                                 "installed: pip install %s" % (package, package))
        return getattr(ref, attr)(params, **kw)
    make.__name__ = "%s.%s" % (module, attr)
    return make


def _lion() -> RuleInfo:
    lion = _package_reference("lion_pytorch", "Lion", "lion-pytorch")
    return RuleInfo("lion", mpext.optim.Lion, dict(lr=1e-4, betas=(0.9, 0.99),
                                                   weight_decay=0.1),
                    lion, update_scale=1.5, reference_maximize=False,
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


# Every rule is always listed: a missing mpext.optim class is an error here, not a silent
# drop of its rows; only a reference package that is not installed skips (its tests only).
RULES["lion"] = _lion()
RULES["sgd"] = _sgd(0.9)()  # a momentum_buffer
RULES["sgd-plain"] = _sgd(0.0)()  # no state at all




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


def covering_sweep() -> Tuple[str, ...]:
    """The formats a costly rule's rows run (RuleInfo.sweep; Muon's): one per param format,
    every moment row (format and rounding) among them, the leanest combinations included --
    each param format i with the moment row i of (float32, bf16 SR, 8-bit, bf16 to nearest),
    the last param format (stochastic params) with 8-bit momentum: fp32, master-bf16,
    remainder-q8 (the issue's 5.03 B), nearest-bf16-rne, stochastic-q8 (its 3.03 B). A
    mismatch in a combination is a mismatch of its parts: each part runs here (and each
    loads and is loaded from each other: conversions/loaders), and tests/test_muon.py checks
    the lean rows' bytes and convergence."""
    rows = ("", "-bf16", "-q8", "-bf16-rne", "-q8")
    out = tuple(name + row for (name, _), row in zip(_PARAM_NAMES, rows))
    assert {FORMATS[f].param_format for f in out} == {p for _, p in _PARAM_NAMES}
    assert {f[len(n):] for f, (n, _) in zip(out, _PARAM_NAMES)} == {r for r, _, _ in
                                                                   _MOMENT_ROWS}
    return out


# (muon) Muon: matrices only (odd sizes, tall and wide, one of at least MIN_8BIT_NUMEL
# elements), torch.optim.Muon the reference, the covering sweep of the formats. An lr that is
# an fp32 value: mpext keeps lr in fp32, and torch's Muon then computes the same bits
# (tests/test_muon.py).
MUON_SHAPES = ((37, 5), (8, 16), (64, 80))  # params[1] has rows 0-7 (a test poisons row 5)
MUON = RuleInfo(
    "muon", mpext.optim.Muon, dict(lr=2.0 ** -6, weight_decay=0.1, momentum=0.9),
    torch.optim.Muon, update_scale=3.0, reference_maximize=False, shapes=MUON_SHAPES,
    maximize=False, graph_breaks=("_orthogonalize",), max_frames=5, sweep=covering_sweep(),
    excluded=(("step_plan", "Muon keeps no StepPlan (its _items builds the three phases' "
                            "items afresh each step), so there is no cached plan to go stale"),),
    error_inputs=_error_inputs(
        *COMMON_ERRORS[:3],
        (dict(weight_decay=-0.1), ValueError, r"weight decay should be >= 0 but is: -0.1"),
        (dict(momentum=-0.5), ValueError, r"momentum should be >= 0 but is: -0.5"),
        (dict(ns_steps=100), ValueError, r"ns_steps must be an int in \[0, 100\)"),
        (dict(adjust_lr_fn="sqrt"), ValueError, r"Adjust learning rate function sqrt")))
RULES["muon"] = MUON


def applies(rule: RuleInfo, fmt: FormatInfo) -> bool:
    """Whether a format exists for a rule: a moment format needs a moment to store (SGD without
    momentum keeps none, so only the float32 rows, which differ in nothing else, apply)."""
    if not rule.moments:
        return fmt.moment_format == "float32"
    return True


def pairs() -> Iterator[Tuple[RuleInfo, FormatInfo]]:
    """Every valid (rule, format) pair; of a rule with a ``sweep`` (Muon), the pairs of its
    sweep only. The param dtypes of each are the format's (``param_dtypes``: a remainder needs
    bfloat16 params), and the params include one of at least MIN_8BIT_NUMEL elements so that
    8-bit moments really quantize."""
    for rule in RULES.values():
        for fmt in FORMATS.values():
            if applies(rule, fmt) and (rule.sweep is None or fmt.name in rule.sweep):
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
    """The formats of ``rule`` for params of ``dtype`` (of its sweep, for a rule with one:
    every param format and moment row loads, and is loaded from, each other)."""
    for b in FORMATS.values():
        if applies(rule, b) and dtype in b.param_dtypes and (rule.sweep is None
                                                             or b.name in rule.sweep):
            yield b


def table_params(family: str, rows, ids=None) -> list:
    """``rows`` (tuples whose first element is a RuleInfo or a RULES name) as pytest params of
    the test family ``family``: the rows of a rule that cannot run it (RuleInfo.excluded)
    skipped with the reason, so that the exclusion shows in every run."""
    out = []
    for i, row in enumerate(rows):
        rule = row[0] if isinstance(row[0], RuleInfo) else RULES[row[0]]
        why = rule.exclusion(family)
        marks = (pytest.mark.skip(reason="%s: %s" % (rule.name, why)),) if why else ()
        out.append(pytest.param(*row, marks=marks,
                                id=ids[i] if ids is not None else pair_id(row)))
    return out


def pair_id(pair) -> str:
    return "-".join(getattr(x, "name", None) or str(x).replace("torch.", "") for x in pair)


# ---- Params, gradients, states --------------------------------------------------------------

def make_params(dtypes, seed: int = 0, shapes=SHAPES, device="cpu", rule=None):
    """Leaf params of each dtype and shape, seeded (the 4-D ones channels_last), on
    ``device`` (the same values on every device: drawn on the CPU); the shapes as ``rule``
    takes them (RuleInfo.fit_shapes)."""
    if rule is not None:
        shapes = rule.fit_shapes(shapes)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for dt in dtypes:
        for s in shapes:
            p = torch.randn(s, generator=gen).to(dt)
            if len(s) == 4:
                p = p.to(memory_format=torch.channels_last)
            out.append(p.to(device).requires_grad_())
    return out


def clone_params(params):
    return [p.detach().clone().requires_grad_() for p in params]


def make_grads(params, step: int, seed: int = 0, scale: float = 1.0):
    """Gradients for a step, each in its param's dtype (the scale multiplies them, as a
    GradScaler's loss scale would)."""
    gen = torch.Generator().manual_seed(1000 * seed + step)
    return [(torch.randn(p.shape, generator=gen) * scale).to(p.dtype).to(p.device)
            for p in params]


def set_grads(params, grads) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()


def lockstep(a, b, opt_a, opt_b, gen, steps: int = 1) -> None:
    """Steps two optimizers side by side on the same gradients, with params on any devices:
    each drawn on the CPU from ``gen`` (a run's draws are the same on every device), rounded to
    a's dtype, and copied to each param's dtype and device."""
    for _ in range(steps):
        for x, y in zip(a, b):
            g = torch.randn(x.shape, generator=gen).to(x.dtype)
            x.grad = g.to(x.device)
            y.grad = g.to(device=y.device, dtype=y.dtype, copy=True)
        opt_a.step()
        opt_b.step()


def f32(x: float) -> float:
    """x rounded to float32 (to nearest even), as a Python float: the lr mpext keeps in an fp32
    tensor."""
    return float(torch.tensor(x, dtype=F32))


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes in logical order, on the CPU."""
    t = t.detach().contiguous().reshape(-1).cpu()
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_bits(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """a and b hold the same bits, in the same dtype, shape and device."""
    assert a.device == b.device, "%s: on %s and %s" % (what, a.device, b.device)
    assert same_bits(a, b), "%s: %s %s vs %s %s differ" % (what, a.dtype, tuple(a.shape), b.dtype,
                                                          tuple(b.shape))


def roundtrip(obj):
    """``obj`` through torch.save / torch.load(weights_only=True), as a checkpoint goes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def allow_any_grad_dtype(params) -> None:
    """torch >= 2.10 checks that an assigned .grad has the param's dtype unless the param's
    grad_dtype is cleared; fp32 gradients for bf16/fp16 params need that."""
    for p in params:
        if hasattr(p, "grad_dtype"):
            p.grad_dtype = None


def opt_tensors(opt):
    """Every tensor an optimizer holds (each group's params and their state), in a fixed
    order, with a name."""
    out = []
    for gi, group in enumerate(opt.param_groups):
        for j, p in enumerate(group["params"]):
            out.append(("param %d.%d" % (gi, j), p))
            for k, v in sorted(opt.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    out.append(("%s %d.%d" % (k, gi, j), v))
    return out


def snapshot_opt(opt):
    return [(name, t.detach().clone()) for name, t in opt_tensors(opt)]


def assert_opt_unchanged(opt, snap) -> None:
    """The optimizer holds the tensors of ``snap`` (snapshot_opt), bit for bit."""
    now = opt_tensors(opt)
    assert [n for n, _ in now] == [n for n, _ in snap]
    for (name, a), (_, b) in zip(now, snap):
        assert_bits(a, b, name)


def assert_opts_bitwise(o1, o2) -> None:
    """Two optimizers hold the same tensors under the same names, bit for bit."""
    t1, t2 = opt_tensors(o1), opt_tensors(o2)
    assert [n for n, _ in t1] == [n for n, _ in t2]
    for (name, a), (_, b) in zip(t1, t2):
        assert_bits(a, b, name)


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
    return F.fp32_value(p, opt.state[p])


def moment_value(opt, p: torch.Tensor, q: F.Quantity) -> torch.Tensor:
    """A moment's FP32 values as the state holds them (decoded exactly)."""
    t, scale = F.moment_of(opt.state[p], q.name)
    return F.held(opt.state[p], q.name).decode(t, scale)


# ---- One reference step from the optimizer's own state, and the formats' rounding ------------
#
# A lossy format (narrow moments, no master) cannot follow the reference run by a fixed
# tolerance that is also tight: its error grows by a rounding each step. So each step is
# checked on its own: the reference optimizer is given the state mpext holds (decoded exactly)
# and steps once on the same gradient; mpext must then hold exactly what its format's rounding
# makes of the reference's fp32 results -- round to nearest even (Tensor.to), stochastic
# rounding with the documented bits (tests/reference.py: stream sr_key(seed, t, 2k + 1) for
# the param, 2k for bf16 moments, 2^33 + k for 8-bit codes, drawn at each element's position
# in memory; the block's absmax before it, its code exponent) -- up to the fp32
# roundings by which the rule's arithmetic may differ from the reference's (``rule.ulps``).
# Every rounding is monotone, so the rounding of [x - slack, x + slack] is a bracket [lo, hi]
# that the stored value must lie in; with no slack it is the one value the format stores.


class RefStep(NamedTuple):
    """One param's reference step: its fp32 value after it, {moment name: fp32 value after
    it}, and (float64) the magnitude of the inputs each was computed from -- the fp32
    roundings that may differ from the reference's are roundings of these."""
    value: torch.Tensor
    moments: Dict[str, torch.Tensor]
    value_mag: torch.Tensor
    moment_mag: torch.Tensor


def reference_step(rule: RuleInfo, opt, params, grads, maximize: bool = False):
    """The reference optimizer's step from ``opt``'s state on ``grads``, per param a
    :class:`RefStep` (before any format's rounding)."""
    values = [fp32_value(opt, p).detach().cpu().clone().requires_grad_() for p in params]
    step = rule.update_scale * rule.kwargs["lr"]
    mags = [(q.detach().double().abs() + step,
             q.detach().double().abs() + g.detach().cpu().double().abs()) for q, g in zip(values, grads)]
    extra = dict(maximize=True) if maximize and rule.reference_maximize else {}
    ref = rule.make_reference(values, **extra)
    for p, q, g in zip(params, values, grads):
        st = opt.state[p]
        step = float(st["step"]) if "step" in st else 0.0
        if step > 0 and rule.moments:
            ref.state[q] = {m.name: moment_value(opt, p, m).detach().cpu().clone()
                            for m in rule.moments}
            coded = F.moment_of(st, rule.moments[0].name)[1] is not None
            if coded and rule.q8_decoded is not None:
                rule.q8_decoded(ref.state[q], rule.kwargs)
            for m in rule.moments:
                mags[len(ref.state) - 1][1].add_(ref.state[q][m.name].double().abs())
            if rule.reference_steps:
                ref.state[q]["step"] = torch.tensor(step)
        g = g.detach().cpu().float()
        q.grad = -g if maximize and not rule.reference_maximize else g
    ref.step()
    return [RefStep(q.detach(), {m.name: ref.state[q][m.name] for m in rule.moments}, vm, mm)
            for q, (vm, mm) in zip(values, mags)]


def _ulp32(x: torch.Tensor) -> torch.Tensor:
    """One fp32 ulp at |x| (float64; the smallest subnormal's at 0)."""
    x = x.double().abs()
    return torch.where(x > 0, x * 2.0 ** -23, torch.zeros_like(x)).clamp_min(2.0 ** -149)


def fp32_bracket(x: torch.Tensor, ulps: int, mag=None):
    """float32 tensors (lo, hi) around float32 x: ``ulps`` fp32 ulps of |x| + ``mag`` (the
    magnitude of the inputs x was computed from) each way (x itself twice where ulps is 0)."""
    x = x.float()
    if ulps == 0:
        return x, x
    if mag is not None and mag.numel() > 1:
        mag = mag.reshape(x.shape)
    d = ulps * _ulp32(x.double().abs() + (0.0 if mag is None else mag))
    lo, hi = (x.double() - d).float(), (x.double() + d).float()
    # outward, so that rounding the float64 ends to float32 never narrows the bracket
    return (torch.nextafter(lo, torch.tensor(-INF)), torch.nextafter(hi, torch.tensor(INF)))


def u32(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(torch.int32).numpy().view(np.uint32).reshape(-1)


def positions(t: torch.Tensor) -> np.ndarray:
    """Each element's position in memory (the generator's key), in logical order."""
    pos = torch.as_strided(torch.arange(t.numel(), dtype=torch.int64), t.shape, t.stride())
    return pos.contiguous().numpy().astype(np.uint64).reshape(-1)


def sr_round(x: torch.Tensor, dtype: torch.dtype, r: np.ndarray) -> torch.Tensor:
    """float32 x rounded stochastically to ``dtype`` with the random bits r (uint32, x's
    logical order), by tests/reference.py's definitions; float64 values in x's shape."""
    rounded, nan = (bf16_sr_array if dtype == BF16 else fp16_sr_array)(u32(x), r)
    assert not nan.any(), "a NaN where none was expected"
    return torch.from_numpy(rounded.view(np.int16)).view(dtype).double().reshape(x.shape)


def nudge(x: torch.Tensor) -> torch.Tensor:
    """A bf16 param's fp32 master as stored: one fp32 ulp lower where it lies exactly halfway
    above an even bf16 value (so that the param, its round to nearest even, and a remainder
    agree; formats.split_master)."""
    b = x.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    tie = ((b & 0x1FFFF) == 0x8000) & ((b & 0x7F800000) != 0x7F800000)
    b = b - tie.long()
    return torch.where(b >= 2 ** 31, b - 2 ** 32, b).to(torch.int32).view(F32).reshape(x.shape)


def q8_bracket(lo: torch.Tensor, hi: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
               block: int, r16: Optional[torch.Tensor] = None):
    """The 8-bit code values (float64) nearest below lo and above hi, on the code grid of
    blocks with float32 absmax ``scale``: every rounding of a value in [lo, hi] lies there.
    With ``r16`` (each element's 16 random bits, lo's logical order): the stochastic roundings
    of lo and of hi with those bits instead (tests/reference.py's q8_ref_encode: up where
    floor(frac * 2^16) + r16 >= 2^16), between which the code of any value of [lo, hi]
    rounded with the same bits lies (the rounding is monotone for fixed bits)."""
    kind = "m" if dtype == torch.int8 else "v"
    table = torch.from_numpy(Q8_VALUES[kind])
    n = lo.numel()
    ea = torch.from_numpy(q8_exp_array(kind, scale.float().numpy()))
    ref = torch.where(ea >= 255, torch.tensor(NAN, dtype=torch.float64),
                      torch.pow(2.0, (ea - 127).double())).repeat_interleave(block)[:n]

    def on_grid(x, up):
        x = x.double().reshape(-1)
        y = x.abs() / ref
        above = torch.searchsorted(table, y, right=False).clamp_max(len(table) - 1)
        below = (torch.searchsorted(table, y, right=True) - 1).clamp_min(0)
        if r16 is None:
            # towards +inf: up in magnitude for x >= 0, down in magnitude for x < 0
            mag = torch.where((x >= 0) == up, table[above], table[below]) * ref
        else:  # the magnitude's stochastic code (frac exact: codes a power of two apart)
            gap = table[above] - table[below]
            frac = torch.where(gap > 0, (y - table[below]) / gap, torch.zeros_like(y))
            go_up = torch.floor(frac * 65536.0) + r16.reshape(-1).double() >= 65536.0
            mag = torch.where(go_up, table[above], table[below]) * ref
        return torch.where(x >= 0, mag, -mag)

    return on_grid(lo, False).reshape(lo.shape), on_grid(hi, True).reshape(hi.shape)


def memory_order(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements in memory order (the order of a block code's blocks)."""
    return t.detach().cpu().as_strided((t.numel(),), (1,))


def assert_nearest_q8(state, q: F.Quantity, value: torch.Tensor, block: int, what: str) -> None:
    """The 8-bit codes and block scales ``state`` holds for moment ``q`` are the nearest codes
    (ties to even) of the fp32 ``value`` by tests/reference.py's restated format (not
    formats.py's encoder), and decode to the reference's values."""
    kind = "m" if q.signed else "v"
    codes, scale = F.moment_of(state, q.name)
    want_codes, want_scale = q8_encode_array(kind, memory_order(value).float().numpy(), block)
    got_codes = memory_order(codes).view(torch.uint8).numpy()
    assert (scale.cpu().float().numpy().view(np.uint32) == want_scale.view(np.uint32)).all(), (
        what, q.name, "block scales")
    bad = np.flatnonzero(got_codes != want_codes)
    assert bad.size == 0, (what, q.name, "%d codes not the nearest; element %d: %d, not %d" % (
        bad.size, bad[0], got_codes[bad[0]], want_codes[bad[0]]) if bad.size else "")
    got = memory_order(F.held(state, q.name).decode(codes, scale)).numpy()
    assert (got == q8_decode_array(kind, want_codes, want_scale, block)).all(), (what, q.name)


def assert_in(got: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, what: str) -> None:
    """lo <= got <= hi elementwise (float64 values), with the worst element named."""
    g, lo, hi = got.double().reshape(-1), lo.double().reshape(-1), hi.double().reshape(-1)
    bad = ~((g >= lo) & (g <= hi))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise AssertionError("%s: %d of %d elements outside the format's rounding of the "
                             "reference; element %d: %.9g not in [%.9g, %.9g]" % (
                                 what, int(bad.sum()), g.numel(), i, g[i], lo[i], hi[i]))


def check_step(rule: RuleInfo, fmt: FormatInfo, opt, params, refs, seed: int,
               what: str = "") -> None:
    """After a step, every param, FP32 value and moment of ``opt`` is its format's rounding of
    the reference step's results (``refs``, :func:`reference_step`) within the rule's fp32
    slack. The params are the optimizer's only group, in order (param k draws streams 2k and
    2k + 1)."""
    for k, (p, ref) in enumerate(zip(params, refs)):
        x, moments = ref.value, ref.moments
        st = opt.state[p]
        t = int(st["step"])
        pos = positions(p)
        where = "%s param %d (%s, step %d)" % (what, k, str(p.dtype).replace("torch.", ""), t)
        lo, hi = fp32_bracket(x, rule.ulps, ref.value_mag)
        got_p = p.detach().cpu()
        if p.dtype == F32:
            assert_in(got_p, lo, hi, where + ": the fp32 param")
        elif fmt.keeps_value:  # a master or a remainder: the fp32 value, then the param its RNE
            if p.dtype == BF16:
                lo, hi = nudge(lo), nudge(hi)
            value = fp32_value(opt, p).cpu()
            assert_in(value, lo, hi, where + ": the fp32 master")
            assert same_bits(got_p, value.to(p.dtype)), where + ": the param is not its master's RNE"
        elif fmt.param_format == "nearest":
            assert_in(got_p, lo.to(p.dtype), hi.to(p.dtype), where + ": the param (to nearest)")
        else:
            r = sr_bits_array(sr_key(seed, t, 2 * k + 1), pos)
            assert_in(got_p, sr_round(lo, p.dtype, r), sr_round(hi, p.dtype, r),
                      where + ": the param (stochastic)")
        r_m = sr_bits_array(sr_key(seed, t, 2 * k), pos)
        for j, q in enumerate(rule.moments):
            m = moments[q.name].float()
            mlo, mhi = fp32_bracket(m, rule.ulps, ref.moment_mag)
            stored, scale = F.moment_of(st, q.name)
            got = moment_value(opt, p, q).cpu()
            mwhere = "%s: %s (%s)" % (where, q.name, fmt.moment_format)
            if stored.dtype == F32:
                assert_in(got, mlo, mhi, mwhere)
            elif stored.dtype == BF16:
                if fmt.moment_rounding == "nearest":
                    assert_in(got, mlo.to(BF16), mhi.to(BF16), mwhere)
                else:  # exp_avg rounds with r's low 16 bits, exp_avg_sq with its high 16
                    r = r_m if j == 0 else r_m >> np.uint32(16)
                    assert_in(got, sr_round(mlo, BF16, r), sr_round(mhi, BF16, r), mwhere)
            else:  # 8-bit codes: the block's absmax, then the value's code
                amax = m.abs().reshape(-1)
                pad = (-amax.numel()) % fmt.block
                amax = torch.cat([amax, amax.new_zeros(pad)]).view(-1, fmt.block).amax(1)
                alo, ahi = fp32_bracket(amax, rule.ulps, ref.moment_mag.max())
                assert_in(scale.cpu(), alo, ahi, mwhere + " block absmax")
                r16 = None
                if fmt.moment_rounding == "stochastic":  # the 8-bit stream, 2^33 + k
                    r = sr_bits_array(sr_key(seed, t, (1 << 33) + k), pos)
                    r = r if j == 0 else r >> np.uint32(16)  # exp_avg low 16, exp_avg_sq high
                    r16 = torch.from_numpy((r & np.uint32(0xFFFF)).astype(np.int64))
                qlo, qhi = q8_bracket(mlo, mhi, scale.cpu(), stored.dtype, fmt.block, r16)
                assert_in(got, qlo, qhi, mwhere + " codes")
