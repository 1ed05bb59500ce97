"""The optimizer-step half of mpext.telemetry: counters of what the step's rounding costs,
accumulated on the device by the step kernels themselves (the ops' ``stats`` argument: the C
core's ``mp_step_stats``, the CUDA kernel's counting variant), every step, into one float64 row per param; read with the gradient
half in ``Telemetry.read()`` (one host sync per read).

Every launch of an ``mpext.optim`` optimizer (any rule, the cached plan or not, Muon's two
phases, ``MixedPrecisionOptimizer``'s fused path) goes through ``mpext.optim._engine.
run_launches``; :class:`StepCounters` registers a source there that gives a launch whose params
(or, for Muon's momentum phase, whose momentum buffers) are the optimizer's a stats tensor of
its own, kept between steps. A launch it cannot name (a non-dense param stepped through a copy)
runs uncounted and is reported in ``telemetry/uncounted_launches``.
"""
import functools
import weakref
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..optim import _engine

# The columns of a param's row (csrc/include/mpext/telemetry.h, MP_STS_*).
STEP_COLUMNS = ("elems", "changed", "unmoved", "subhalf", "m_err", "m_abs", "v_err", "v_abs",
                "q8_flushed", "q8_satblocks", "q8_blocks", "ema_lag", "ema_abs")
NCOLS = len(STEP_COLUMNS)
(ELEMS, CHANGED, UNMOVED, SUBHALF, M_ERR, M_ABS, V_ERR, V_ABS, Q8_FLUSHED, Q8_SATBLOCKS,
 Q8_BLOCKS, EMA_LAG, EMA_ABS) = range(NCOLS)

# Ops whose params are scratch (Muon's momentum phase writes the update into them): only their
# state columns are read, and their rows are found by their moment buffers.
_STATE_ONLY = {"muon_momentum_step_"}


@functools.lru_cache(maxsize=None)
def _moment_lists(op: str) -> Optional[int]:
    """The moment lists of the step op ``op`` (its schema's lists between grads and masters),
    or None for an op that is not a rule's step."""
    if not op.endswith("_step_") or not hasattr(torch.ops.mpext, op):
        return None
    names = [a.name for a in getattr(torch.ops.mpext, op).default._schema.arguments]
    return names.index("masters") - 2 if "masters" in names else None


def _op_name(op: Any) -> str:
    name = getattr(op, "_qualified_op_name", None) or getattr(op, "__name__", str(op))
    return name.split("::")[-1]


def _format(t: Optional[torch.Tensor]) -> str:
    if t is None:
        return "none"
    return {torch.bfloat16: "bf16", torch.int8: "q8", torch.uint8: "q8"}.get(t.dtype, "fp32")


class _Rows:
    """The stats tensor of one launch shape (an op and its list of params) and what each row
    is: its param, the param's storage (fp32, master, remainder, rne, sr) and moment formats."""

    def __init__(self, op: str, owners: List[torch.Tensor], keyed: List[torch.Tensor],
                 args: tuple, kwargs: dict, device: torch.device):
        self.op = op
        self.owners = owners
        # the tensors whose ids key these rows, held weakly: a key is only an id, which a new
        # tensor may reuse once the keyed one is freed (Muon's buffers after a state load)
        self.keyed = [weakref.ref(t) for t in keyed]
        self.stats = torch.zeros((len(owners), NCOLS), dtype=torch.float64, device=device)
        params = args[0]
        nlists = _moment_lists(op) or 0
        moments = [args[2 + j] for j in range(nlists)]
        masters = args[2 + nlists] if len(args) > 2 + nlists else []
        rems = kwargs.get("remainders") or []
        self.kinds, self.m_fmt, self.v_fmt = [], [], []
        for i, p in enumerate(params):
            if op in _STATE_ONLY:
                kind = "scratch"
            elif p.dtype == torch.float32:
                kind = "fp32"
            elif masters and masters[i].numel() > 0:
                kind = "master"
            elif rems and rems[i].numel() > 0:
                kind = "remainder"
            else:
                kind = "sr" if kwargs.get("stochastic_rounding") else "rne"
            self.kinds.append(kind)
            # (a rule's list may be empty: SGD without momentum keeps none)
            self.m_fmt.append(_format(moments[0][i]) if nlists >= 1 and moments[0] else "none")
            self.v_fmt.append(_format(moments[1][i]) if nlists >= 2 and moments[1] else "none")


class StepCounters:
    """The step counters of one optimizer: a source of ``stats`` tensors for its launches, on
    one step in ``sample`` (the optimizer's steps numbered from attach: 0, sample, 2 sample,
    ...); the other steps run the uncounted kernels (their fast paths included)."""

    def __init__(self, optimizer: torch.optim.Optimizer, sample: int = 1):
        self.optimizer = optimizer
        self.sample = sample
        self.total = 0        # optimizer steps since attach
        self.counted = 0      # steps counted since the last read
        self._rows: Dict[tuple, Optional[_Rows]] = {}
        self._by_id: Dict[int, torch.Tensor] = {}     # id(param) -> param
        # id(state tensor) -> (the state tensor, weakly: its id may be reused; its param)
        self._state_id: Dict[int, Tuple[Any, torch.Tensor]] = {}
        self._retired = 0     # rows whose keyed tensors were freed (kept until the next read)
        self._mapped_at = -1
        self.steps = 0        # optimizer steps since the last read (the post hook)
        self.uncounted = 0    # launches run uncounted since the last read
        # the launches are counted only inside this optimizer's step(): another optimizer over
        # the same params (or one made after this telemetry, still alive) steps uncounted here
        self._stepping = False
        self._pre_hook = optimizer.register_step_pre_hook(self._before_step)
        self._hook = optimizer.register_step_post_hook(self._after_step)
        # the engine holds this weakly: a Telemetry dropped without detach() frees its
        # optimizer, and its source then answers None and leaves the list
        ref = weakref.ref(self)

        def source(op, args, kwargs):
            me = ref()
            if me is None:
                if source in _engine.STATS_SOURCES:
                    _engine.STATS_SOURCES.remove(source)
                return None
            return me(op, args, kwargs)
        self._source = source
        _engine.STATS_SOURCES.append(source)

    def detach(self) -> None:
        self._pre_hook.remove()
        self._hook.remove()
        self._stepping = False
        if self._source in _engine.STATS_SOURCES:
            _engine.STATS_SOURCES.remove(self._source)

    def _before_step(self, *_):
        self._stepping = True

    def _after_step(self, *_):
        self._stepping = False
        if self.total % self.sample == 0:
            self.counted += 1
        self.steps += 1
        self.total += 1

    def _remap(self) -> None:
        self._by_id.clear()
        self._state_id.clear()
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                self._by_id[id(p)] = p
                for v in self.optimizer.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor):
                        self._state_id[id(v)] = (weakref.ref(v), p)
        self._mapped_at = self.steps

    def _owners(self, op: str, args: tuple) -> Optional[List[torch.Tensor]]:
        """The optimizer's params of a launch's rows, or None when it is not this optimizer's."""
        if op in _STATE_ONLY:  # the params are scratch: the momentum buffers name the rows
            return [self._state_owner(b) for b in args[2]]
        return [self._by_id.get(id(p)) for p in args[0]]

    def _state_owner(self, b: torch.Tensor) -> Optional[torch.Tensor]:
        hit = self._state_id.get(id(b))
        return hit[1] if hit is not None and hit[0]() is b else None

    def __call__(self, op: Any, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
        if not self._stepping and getattr(self.optimizer, "_grad_release", None) is None:
            return None  # another optimizer's step() (gradient release steps outside step())
        if self.total % self.sample != 0:
            return None  # not a sampled step
        name = _op_name(op)
        if _moment_lists(name) is None or not args[0]:
            return None
        keyed = args[0] if name not in _STATE_ONLY else args[2]
        key = (name,) + tuple(map(id, keyed))
        rows = self._rows.get(key)
        if rows is not None:
            if all(r() is t for r, t in zip(rows.keyed, keyed)):
                return rows.stats
            # a recycled id: these rows were another list's; they keep their counts to the read
            self._rows[(name, "retired", self._retired)] = self._rows.pop(key)
            self._retired += 1
        owners = self._owners(name, args)
        if any(o is None for o in owners) and self._mapped_at != self.steps:
            self._remap()  # state made since (the first step), or params added
            owners = self._owners(name, args)
        if all(o is None for o in owners):
            return None  # another optimizer's launch
        if any(o is None for o in owners):
            self.uncounted += 1  # e.g. a non-dense param stepped through a copy
            return None
        rows = self._rows[key] = _Rows(name, owners, keyed, args, kwargs, args[0][0].device)
        return rows.stats

    # -------------------------------------------------------------------------------------
    # Reading (Telemetry.read gathers the tensors into its one host transfer).

    def tensors(self) -> List[torch.Tensor]:
        return [r.stats.reshape(-1) for r in self._rows.values()]

    def reset(self) -> None:
        for k in [k for k in self._rows if k[1:2] == ("retired",)]:
            del self._rows[k]  # read: their tensors are gone, no launch will name them again
        for r in self._rows.values():
            r.stats.zero_()
        self.steps = 0
        self.counted = 0
        self.uncounted = 0

    def summarize(self, host: List[float], module_of, name_of) -> Dict[str, Any]:
        """The flat dict of the step's counters from ``host`` (the values of :meth:`tensors`,
        in order): totals and per-module fractions (docs/telemetry.md)."""
        tot: Dict[str, List[float]] = defaultdict(lambda: [0.0] * NCOLS)
        per_mod: Dict[str, Dict[str, List[float]]] = defaultdict(
            lambda: defaultdict(lambda: [0.0] * NCOLS))
        pos = 0
        for r in self._rows.values():
            for i, p in enumerate(r.owners):
                row = host[pos + i * NCOLS:pos + (i + 1) * NCOLS]
                mod = module_of(name_of(p))
                for key in _keys(r.kinds[i], r.m_fmt[i], r.v_fmt[i]):
                    t, m = tot[key], per_mod[mod][key]
                    for j in range(NCOLS):
                        t[j] += row[j]
                        m[j] += row[j]
            pos += len(r.owners) * NCOLS
        out: Dict[str, Any] = {}
        _fractions(out, "", tot)
        for mod, sums in sorted(per_mod.items()):
            _fractions(out, "%s/" % mod, sums)
        out["telemetry/optimizer_steps"] = self.steps
        out["telemetry/counted_steps"] = self.counted
        out["telemetry/uncounted_launches"] = self.uncounted
        return out


def _keys(kind: str, m_fmt: str, v_fmt: str) -> Tuple[str, ...]:
    """The aggregates a row adds to: its param storage's, its moments' formats', the ema's."""
    keys = ["param/" + kind, "ema"]
    if m_fmt in ("bf16", "q8"):
        keys.append("m/" + m_fmt)
    if v_fmt in ("bf16", "q8"):
        keys.append("v/" + v_fmt)
    return tuple(keys)


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _fractions(out: Dict[str, Any], mod: str, sums: Dict[str, List[float]]) -> None:
    """The fractions of one scope (all params, or a module's: ``mod`` is then "<module>/")."""
    rne, sr = sums.get("param/rne"), sums.get("param/sr")
    master = [a + b for a, b in zip(sums.get("param/master", [0.0] * NCOLS),
                                    sums.get("param/remainder", [0.0] * NCOLS))]
    if rne is not None:
        out["update/%slost_frac" % mod] = _ratio(rne[UNMOVED], rne[CHANGED])
    if sr is not None:
        out["update/%ssr_expectation_frac" % mod] = _ratio(sr[SUBHALF], sr[CHANGED])
        out["update/%ssr_unmoved_frac" % mod] = _ratio(sr[UNMOVED], sr[CHANGED])
    if "param/master" in sums or "param/remainder" in sums:
        out["update/%sunchanged_under_master_frac" % mod] = _ratio(master[UNMOVED],
                                                                   master[CHANGED])
    if not mod:
        counted = [sums[k] for k in ("param/rne", "param/sr", "param/master", "param/remainder")
                   if k in sums]
        out["update/elements"] = sum(c[ELEMS] for c in counted)
        out["update/changed"] = sum(c[CHANGED] for c in counted)
        out["update/unmoved"] = sum(c[UNMOVED] for c in counted)
    for mom, tag in (("m", ""), ("v", "_sq")):
        bf, q8 = sums.get(mom + "/bf16"), sums.get(mom + "/q8")
        if bf is not None:
            err, ab = (M_ERR, M_ABS) if mom == "m" else (V_ERR, V_ABS)
            out["state/%sbf16_moment%s_rel_error" % (mod, tag)] = _ratio(bf[err], bf[ab])
        if q8 is not None:
            err, ab = (M_ERR, M_ABS) if mom == "m" else (V_ERR, V_ABS)
            out["state/%sq8%s_rel_error" % (mod, tag)] = _ratio(q8[err], q8[ab])
    q8 = sums.get("m/q8")
    if q8 is not None:
        # flushed values of both codes (a row's count holds its pair's) over the coded values
        coded = q8[ELEMS] + sums.get("v/q8", [0.0] * NCOLS)[ELEMS]
        out["state/%sq8_flushed_frac" % mod] = _ratio(q8[Q8_FLUSHED], coded)
        out["state/%sq8_saturated_frac" % mod] = _ratio(q8[Q8_SATBLOCKS], q8[Q8_BLOCKS])
    ema = sums.get("ema")
    if ema is not None and ema[EMA_ABS] > 0:
        out["ema/%slag_rel" % mod] = _ratio(ema[EMA_LAG], ema[EMA_ABS])
