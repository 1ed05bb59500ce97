"""mpext.optim.lr_scheduler: learning-rate schedules that live on the device and hold still on
skipped steps, without a host synchronisation.

With loss scaling (FP16), or with the inf/NaN skip of BF16 training, some optimizer steps change
nothing. torch's schedulers count ``scheduler.step()`` calls on the host, so a skipped step still
advances the schedule, and knowing whether a fused step was skipped would take a host sync (which
is why accelerate's ``step_was_skipped`` is always False for fused optimizers). The schedulers
here keep the step count as a tensor on the device and advance it by ``found_inf == 0``; the
learning rate is computed on the device from that count and written into a device tensor that
``param_groups[i]["lr"]`` holds, where mpext's optimizers (and torch's fused/capturable ones)
read it with no host sync. A step makes no host sync, and no Python value changes from step to
step, so it works under ``torch.compile`` and inside a captured CUDA graph.

The classes mirror torch's (same names, arguments and values): :class:`LambdaLR`,
:class:`ConstantLR`, :class:`LinearLR`, :class:`CosineAnnealingLR` and :class:`SequentialLR`
for composing them, plus ``get_linear_schedule_with_warmup``, ``get_cosine_schedule_with_warmup``
and ``get_constant_schedule_with_warmup`` with the formulas of the same functions in
``transformers``. When no step is skipped the learning rates are the float32 roundings of
torch's closed-form formulas (computed in float64 with the same operations in the same order).

Where the skip flag comes from (see :func:`step_was_skipped`): the ``found_inf`` a GradScaler
hands the optimizer's ``step()`` (torch's and mpext's, for optimizers that take it, such as
``mpext.optim.Adam``/``AdamW`` and torch's fused ones), a ``MixedPrecisionOptimizer``'s own
scaler, or an ``mpext.GradScaler`` given as ``scaler=`` (its record of the optimizer's latest
step, which also covers optimizers the scaler steps only when nothing overflowed). A flag given
to ``step(skipped=...)`` overrides them.
"""
import math
import numbers
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
from torch.optim.lr_scheduler import LRScheduler as _TorchLRScheduler
from torch.optim.optimizer import register_optimizer_step_post_hook as _register_post_hook

from .._skip import skip_flag_source as _skip_flag_source

__all__ = ["LRScheduler", "LambdaLR", "ConstantLR", "LinearLR", "CosineAnnealingLR",
           "SequentialLR", "get_linear_schedule_with_warmup", "get_cosine_schedule_with_warmup",
           "get_constant_schedule_with_warmup", "step_was_skipped"]


# ---------------------------------------------------------------------------------------------
# Where each optimizer's latest skip flag is recorded: a step post-hook (global, so that it sees
# wrappers too) notes the found_inf that the step received, or asks an optimizer that keeps its
# own flag (the skip-flag protocol, mpext/_skip.py: a MixedPrecisionOptimizer). Records are made
# only for the optimizers a scheduler or step_was_skipped() asked about, and kept as an attribute
# of each optimizer of the chain: for every other optimizer the hook is one failed attribute
# lookup. Not a global weak dictionary: under torch.compile the hook's lookup in it became guards
# on the dictionary's keys, which a garbage collection of some unrelated optimizer could remove
# while the guards were being built (an IndexError inside dynamo), or invalidate later (a
# recompile).


class _Record:
    __slots__ = ("flag", "seen")

    def __init__(self) -> None:
        self.flag: Any = None  # the latest step's found_inf (tensor), True (skipped), or None
        # Whether a step() was seen (only for the first-step warning). The hook only ever
        # stores True, never reads it: under torch.compile a value the step reads becomes a
        # guard, and a count would fail it, recompiling every step.
        self.seen = False


_RECORD_ATTR = "_mpext_skip_record"
_hook_handle = None


def _record_of(opt: Any) -> Optional[_Record]:
    record = getattr(opt, _RECORD_ATTR, None)
    return record if isinstance(record, _Record) else None


def _after_step(opt: Any, args: tuple, kwargs: Dict[str, Any]) -> None:
    record = _record_of(opt)
    own_flag = _skip_flag_source(opt)
    if record is None and own_flag is not None:  # a scheduler made on the optimizer it wraps
        record = next((r for r in map(_record_of, _chain(opt)[1:]) if r is not None), None)
    if record is None:
        return
    record.seen = True
    if own_flag is not None:
        record.flag = own_flag()
        return
    flag = kwargs.get("found_inf")
    if flag is None:
        flag = getattr(opt, "found_inf", None)  # what a GradScaler sets during step()
    if flag is not None and not isinstance(flag, torch.Tensor):
        flag = True if flag else None
    record.flag = flag


def _chain(optimizer: Any) -> List[Any]:
    """The optimizer and the ones it wraps (accelerate's AcceleratedOptimizer and Fabric's
    _FabricOptimizer hold theirs as ``optimizer``, Lightning's LightningOptimizer as
    ``_optimizer``, a MixedPrecisionOptimizer its inner one as ``optimizer``): a step runs the
    hooks of whichever of them is a hooked ``torch.optim.Optimizer``, innermost first."""
    out = [optimizer]
    while len(out) < 8:
        inner = None
        attrs = getattr(out[-1], "__dict__", {})
        for name in ("_optimizer", "optimizer"):
            cand = attrs.get(name)
            if cand is not None and cand is not out[-1] and hasattr(cand, "param_groups"):
                inner = cand
                break
        if inner is None or any(inner is o for o in out):
            break
        out.append(inner)
    return out


def _record_for(optimizer: Any) -> _Record:
    global _hook_handle
    chain = _chain(optimizer)
    record = next((r for r in map(_record_of, chain) if r is not None), None)
    if record is None:
        record = _Record()
    for o in chain:
        try:
            object.__setattr__(o, _RECORD_ATTR, record)
        except (AttributeError, TypeError):  # no __dict__: its steps are seen through the others
            pass
    if _hook_handle is None:
        _hook_handle = _register_post_hook(_after_step)
    return record


def step_was_skipped(optimizer: Any, scaler: Any = None) -> torch.Tensor:
    """Whether the optimizer's latest step left everything unchanged because a gradient held an
    inf/NaN, as a 0-dim bool tensor on the device: no host sync.

    The answer comes from, in this order: ``scaler`` (an ``mpext.GradScaler``: its record of
    this optimizer's latest ``scaler.step``); a ``MixedPrecisionOptimizer``'s own scaler; the
    ``found_inf`` the optimizer's latest ``step()`` received from a GradScaler (optimizers that
    set ``_step_supports_amp_scaling``: ``mpext.optim.Adam``/``AdamW``, torch's fused ones) or as
    an argument. Steps are seen from the first call of this function (or the first scheduler
    made) for the optimizer on; before any, and for a step that received no flag, it is False.
    ``optimizer`` may be wrapped (accelerate, Lightning, Fabric wrappers are looked through).
    """
    if scaler is not None:
        if _skip_flag_source(scaler) is None:
            raise TypeError("step_was_skipped: scaler must be an mpext.GradScaler (torch's "
                            "GradScaler keeps no skip record), got %s" % type(scaler).__name__)
        return _skip_flag_source(scaler)(_unwrap_for_scaler(optimizer))
    own_flag = _own_skip_flag(optimizer)
    if own_flag is not None:
        return own_flag()
    return _flag_as_bool(_record_for(optimizer).flag, _device_of(optimizer))


def _own_skip_flag(optimizer: Any) -> Optional[Callable[..., torch.Tensor]]:
    """The skip flag of the first of the optimizer and its wrapped ones that keeps its own
    (a MixedPrecisionOptimizer), or None."""
    for o in _chain(optimizer):
        source = _skip_flag_source(o)
        if source is not None:
            return source
    return None


def _unwrap_for_scaler(optimizer: Any) -> Any:
    """The optimizer a GradScaler was given: through the framework wrappers, down to the first
    hooked torch optimizer."""
    for o in _chain(optimizer):
        if isinstance(o, torch.optim.Optimizer) and "_optimizer_step_pre_hooks" in o.__dict__:
            return o
    return optimizer


def _flag_as_bool(flag: Any, device: torch.device) -> torch.Tensor:
    if isinstance(flag, torch.Tensor):
        return (flag != 0).reshape(())
    return torch.full((), bool(flag), dtype=torch.bool, device=device)


def _device_of(optimizer: Any) -> torch.device:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# The schedulers.


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


class LRScheduler(_TorchLRScheduler):
    """Base class of the device-side schedulers (a ``torch.optim.lr_scheduler.LRScheduler``, so
    frameworks that check for one take it). Subclasses define :meth:`_lr_at`.

    At construction each ``param_groups[i]["lr"]`` becomes a 0-dim float32 tensor on the device
    of the optimizer's first param (a view into one buffer of all groups' rates), set to the
    schedule's value at step 0; ``initial_lr`` is set as torch sets it and is the base rate.
    Every :meth:`step` then advances the count of applied steps by one unless the step was
    skipped, and writes the new rates into those tensors, on the device. If something replaces a
    group's ``lr`` (loading an optimizer state, assigning a float), the scheduler puts its tensor
    back at the next step (at once after ``optimizer.load_state_dict``).

    Args:
        optimizer: the optimizer (or a wrapper of one: accelerate's, Lightning's, Fabric's, a
            ``MixedPrecisionOptimizer``) whose learning rates it sets.
        scaler: an ``mpext.GradScaler`` to take the skip flag from (see
            :func:`step_was_skipped`); needed only with optimizers that the scaler steps after
            a host check (those that do not set ``_step_supports_amp_scaling``).
    """

    def __init__(self, optimizer: Any, *, scaler: Any = None) -> None:
        name = type(self).__name__
        if not hasattr(optimizer, "param_groups") or not callable(getattr(optimizer, "step",
                                                                           None)):
            raise TypeError("mpext.optim.lr_scheduler.%s: optimizer must be an optimizer, got %s"
                            % (name, type(optimizer).__name__))
        if scaler is not None and _skip_flag_source(scaler) is None:
            raise TypeError("mpext.optim.lr_scheduler.%s: scaler must be an mpext.GradScaler, "
                            "got %s" % (name, type(scaler).__name__))
        groups = optimizer.param_groups
        if not groups:
            raise ValueError("mpext.optim.lr_scheduler.%s: the optimizer has no param groups"
                             % name)
        self.optimizer = optimizer
        self._scaler = scaler
        self._owner: Optional["LRScheduler"] = None  # a SequentialLR that composes this one
        base = []
        for i, group in enumerate(groups):
            initial = group.setdefault("initial_lr", group["lr"])
            if isinstance(initial, torch.Tensor):
                if initial.numel() != 1:
                    raise ValueError("mpext.optim.lr_scheduler.%s: param group %d has a tensor lr "
                                     "of %d elements; it must have one" % (name, i,
                                                                           initial.numel()))
                initial = float(initial.detach().reshape(()).cpu())  # once, at construction
                group["initial_lr"] = initial
            if not _is_real(initial) or not math.isfinite(initial) or initial < 0:
                raise ValueError("mpext.optim.lr_scheduler.%s: param group %d has lr %r; it must "
                                 "be a finite number >= 0" % (name, i, initial))
            base.append(float(initial))
        self.base_lrs = base
        device = _device_of(optimizer)
        self._device = device
        # float64 as torch's Python formulas, where the device has it
        self._math_dtype = torch.float32 if device.type == "mps" else torch.float64
        self._count = torch.zeros((), dtype=torch.int64, device=device)
        self._base = torch.tensor(base, dtype=self._math_dtype, device=device)
        self._lr = torch.empty(len(base), dtype=torch.float32, device=device)
        self._views = list(self._lr.unbind(0))
        self._record = _record_for(optimizer)
        self._warned = False
        self._step_count = 1  # torch's attribute (accelerate adjusts it); unused here
        self._load_hook = None
        self._check_args()

    # Subclasses: validate arguments (called at the end of __init__), then _start().
    def _check_args(self) -> None:
        self._start()

    def _start(self) -> None:
        """Writes the rates of step 0 and binds them into the param groups."""
        self._write()
        self._rebind()
        self._watch_loads()

    def _lr_at(self, e: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """The rates of all groups (``base``: their base rates) at step ``e`` (a 0-dim tensor of
        the math dtype), as a tensor of the math dtype: device ops only."""
        raise NotImplementedError

    # -----------------------------------------------------------------------------------------

    def _write(self) -> None:
        e = self._count.to(self._math_dtype)
        self._lr.copy_(self._lr_at(e, self._base))

    def _rebind(self) -> None:
        for group, view in zip(self.optimizer.param_groups, self._views):
            if group["lr"] is not view:
                group["lr"] = view

    def _watch_loads(self) -> None:
        """Rebinds the rate tensors right after the optimizer loads a state (which replaces each
        group's ``lr`` with the saved one)."""
        # The first torch optimizer down the chain that runs load hooks (a wrapper such as
        # MixedPrecisionOptimizer runs its inner optimizer's).
        target = next((o for o in _chain(self.optimizer)
                       if isinstance(o, torch.optim.Optimizer)
                       and "_optimizer_load_state_dict_post_hooks" in o.__dict__), None)
        if target is None:
            return
        ref = weakref.ref(self)

        def rebind(_opt: Any) -> None:
            sched = ref()
            if sched is not None and sched._owner is None:
                sched._rebind()

        self._load_hook = target.register_load_state_dict_post_hook(rebind)

    @property
    def last_epoch(self) -> int:
        """The number of applied steps counted so far (torch's ``last_epoch``), as a Python int:
        a host sync. :attr:`step_count` is the same as a device tensor."""
        return int(self._count.item())

    @property
    def step_count(self) -> torch.Tensor:
        """The number of applied steps counted so far, as a 0-dim int64 tensor on the device
        (a snapshot; no host sync)."""
        return self._count.clone()

    def step(self, epoch: Optional[int] = None, *, skipped: Any = None) -> None:
        """Advances the schedule by one step unless the optimizer's latest step was skipped,
        and writes the new rates, all on the device.

        Args:
            epoch: not supported (deprecated in torch); passing one raises ``TypeError``.
            skipped: whether the step was skipped: a bool, or a tensor on any device (a bool
                flag, or a ``found_inf`` whose non-zero value means skipped). Default: taken
                from the optimizer, see :func:`step_was_skipped`.
        """
        if epoch is not None:
            raise TypeError("mpext.optim.lr_scheduler.%s.step: the epoch argument is not "
                            "supported (it is deprecated in torch); call step() once per "
                            "optimizer step" % type(self).__name__)
        if self._owner is not None:
            raise RuntimeError("mpext.optim.lr_scheduler.%s is part of a SequentialLR: step the "
                               "SequentialLR instead" % type(self).__name__)
        if skipped is None:
            skipped = self._skip_flag()
        self._rebind()
        if isinstance(skipped, torch.Tensor):
            applied = (skipped.detach().to(self._device, non_blocking=True) == 0)
            self._count.add_(applied.reshape(()).to(torch.int64))
        elif not skipped:
            self._count.add_(1)
        self._write()

    def _skip_flag(self) -> Any:
        record = self._record
        if not self._warned and not record.seen:
            self._warned = True
            warnings.warn(
                "mpext.optim.lr_scheduler.%s.step() was called before any step() of its "
                "optimizer was seen, so it cannot know whether steps are skipped and counts "
                "every call; call optimizer.step() first, or pass step(skipped=...)"
                % type(self).__name__, UserWarning, stacklevel=3)
        if self._scaler is not None:
            return _skip_flag_source(self._scaler)(_unwrap_for_scaler(self.optimizer))
        own_flag = _own_skip_flag(self.optimizer)
        if own_flag is not None:
            return own_flag()
        return record.flag

    def get_last_lr(self) -> List[torch.Tensor]:
        """The current rates, one 0-dim float32 device tensor per group (copies)."""
        return [v.clone() for v in self._lr.unbind(0)]

    def get_lr(self) -> List[torch.Tensor]:
        """The current rates (as :meth:`get_last_lr`)."""
        return self.get_last_lr()

    def state_dict(self) -> Dict[str, Any]:
        """``{"last_epoch": the count of applied steps (a 0-dim int64 tensor), "base_lrs":
        [float]}``: what resuming needs (the rates follow from them)."""
        return {"last_epoch": self._count.detach().clone(), "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state saved by :meth:`state_dict` (or torch's, whose ``last_epoch`` is an
        int): the count is copied into the device tensor the scheduler already uses, so a
        compiled or captured step stays valid. Checked before anything changes."""
        where = "mpext.optim.lr_scheduler.%s.load_state_dict" % type(self).__name__
        if not isinstance(state_dict, dict) or "last_epoch" not in state_dict:
            raise ValueError("%s: expected a dict with 'last_epoch', got %r" % (where,
                                                                               state_dict))
        count = state_dict["last_epoch"]
        if isinstance(count, torch.Tensor):
            if count.numel() != 1 or count.is_floating_point() or count.is_complex():
                raise ValueError("%s: last_epoch must be an integer (tensor), got %r"
                                 % (where, count))
        elif not _is_int(count) or count < 0:
            raise ValueError("%s: last_epoch must be an int >= 0, got %r" % (where, count))
        base = state_dict.get("base_lrs", self.base_lrs)
        if len(base) != len(self.base_lrs) or not all(_is_real(b) for b in base):
            raise ValueError("%s: base_lrs must be %d numbers, got %r"
                             % (where, len(self.base_lrs), base))
        if isinstance(count, torch.Tensor):
            self._count.copy_(count.detach().reshape(()).to(torch.int64))
        else:
            self._count.fill_(int(count))
        self.base_lrs = [float(b) for b in base]
        self._base.copy_(torch.tensor(self.base_lrs, dtype=self._math_dtype))
        self._write()
        self._rebind()

    def __repr__(self) -> str:
        return "mpext.optim.lr_scheduler.%s(%s)" % (type(self).__name__, ", ".join(
            "%s=%r" % kv for kv in self._describe()))

    def _describe(self) -> List[tuple]:
        return []


class LambdaLR(LRScheduler):
    """``base_lr * lr_lambda(step)``, as ``torch.optim.lr_scheduler.LambdaLR``, with the lambda
    written in torch ops: it receives the step as a 0-dim float64 tensor on the device and
    returns a tensor (or a number), without reading values on the host (no ``float()``,
    ``.item()``, ``if`` on a tensor: use ``torch.where``/``torch.clamp``). A list gives one
    lambda per param group."""

    def __init__(self, optimizer: Any, lr_lambda: Union[Callable, Sequence[Callable]], *,
                 scaler: Any = None) -> None:
        self._lambdas = lr_lambda
        super().__init__(optimizer, scaler=scaler)

    def _check_args(self) -> None:
        lams = self._lambdas
        if isinstance(lams, (list, tuple)):
            if len(lams) != len(self.base_lrs):
                raise ValueError("mpext.optim.lr_scheduler.LambdaLR: expected %d lr_lambdas (one "
                                 "per param group), got %d" % (len(self.base_lrs), len(lams)))
        else:
            lams = [lams] * len(self.base_lrs)
        if not all(callable(f) for f in lams):
            raise TypeError("mpext.optim.lr_scheduler.LambdaLR: lr_lambda must be a callable or "
                            "a list of callables")
        self._lams = list(lams)
        self._single = not isinstance(self._lambdas, (list, tuple))
        self._start()

    def _lr_at(self, e, base):
        if self._single:
            return base * self._lams[0](e)
        return torch.stack([base[i] * torch.as_tensor(f(e), dtype=base.dtype, device=base.device)
                            for i, f in enumerate(self._lams)])


class ConstantLR(LRScheduler):
    """``base_lr * factor`` for the first ``total_iters`` steps, then ``base_lr``, as
    ``torch.optim.lr_scheduler.ConstantLR`` (the same expression: ``base_lr * (factor + (step >=
    total_iters) * (1 - factor))``). With ``factor=1`` it is a constant rate."""

    def __init__(self, optimizer: Any, factor: float = 1.0 / 3, total_iters: int = 5, *,
                 scaler: Any = None) -> None:
        self.factor, self.total_iters = factor, total_iters
        super().__init__(optimizer, scaler=scaler)

    def _check_args(self) -> None:
        if not _is_real(self.factor) or not 0 <= self.factor <= 1:
            raise ValueError("mpext.optim.lr_scheduler.ConstantLR: factor must be in [0, 1], "
                             "got %r" % (self.factor,))
        if not _is_int(self.total_iters) or self.total_iters < 0:
            raise ValueError("mpext.optim.lr_scheduler.ConstantLR: total_iters must be an int "
                             ">= 0, got %r" % (self.total_iters,))
        self._start()

    def _lr_at(self, e, base):
        f = float(self.factor)
        return base * (f + (e >= self.total_iters).to(e.dtype) * (1 - f))

    def _describe(self):
        return [("factor", self.factor), ("total_iters", self.total_iters)]


class LinearLR(LRScheduler):
    """Linear change of the factor from ``start_factor`` to ``end_factor`` over ``total_iters``
    steps, then constant, as ``torch.optim.lr_scheduler.LinearLR`` (``base_lr * (start + (end -
    start) * min(total_iters, step) / total_iters)``). Linear warm-up from zero
    (``start_factor=0``, which torch does not allow) and linear decay (``end_factor=0``) are
    both this."""

    def __init__(self, optimizer: Any, start_factor: float = 1.0 / 3, end_factor: float = 1.0,
                 total_iters: int = 5, *, scaler: Any = None) -> None:
        self.start_factor, self.end_factor, self.total_iters = start_factor, end_factor, \
            total_iters
        super().__init__(optimizer, scaler=scaler)

    def _check_args(self) -> None:
        for n in ("start_factor", "end_factor"):
            v = getattr(self, n)
            if not _is_real(v) or not 0 <= v <= 1:
                raise ValueError("mpext.optim.lr_scheduler.LinearLR: %s must be in [0, 1], got %r"
                                 % (n, v))
        if not _is_int(self.total_iters) or self.total_iters < 1:
            raise ValueError("mpext.optim.lr_scheduler.LinearLR: total_iters must be an int >= "
                             "1, got %r" % (self.total_iters,))
        self._start()

    def _lr_at(self, e, base):
        s, d, n = float(self.start_factor), float(self.end_factor - self.start_factor), \
            self.total_iters
        return base * (s + d * torch.clamp(e, max=n) / n)

    def _describe(self):
        return [("start_factor", self.start_factor), ("end_factor", self.end_factor),
                ("total_iters", self.total_iters)]


class CosineAnnealingLR(LRScheduler):
    """Cosine annealing from ``base_lr`` to ``eta_min`` over ``T_max`` steps, as
    ``torch.optim.lr_scheduler.CosineAnnealingLR``'s closed form (``eta_min + (base_lr -
    eta_min) * (1 + cos(pi * step / T_max)) / 2``; past ``T_max`` the cosine rises again, as in
    torch: follow it with a ``ConstantLR`` in a :class:`SequentialLR` to hold the minimum)."""

    def __init__(self, optimizer: Any, T_max: int, eta_min: float = 0.0, *,
                 scaler: Any = None) -> None:
        self.T_max, self.eta_min = T_max, eta_min
        super().__init__(optimizer, scaler=scaler)

    def _check_args(self) -> None:
        if not _is_int(self.T_max) or self.T_max < 1:
            raise ValueError("mpext.optim.lr_scheduler.CosineAnnealingLR: T_max must be an int "
                             ">= 1, got %r" % (self.T_max,))
        if not _is_real(self.eta_min) or not math.isfinite(self.eta_min) or self.eta_min < 0:
            raise ValueError("mpext.optim.lr_scheduler.CosineAnnealingLR: eta_min must be a "
                             "finite number >= 0, got %r" % (self.eta_min,))
        self._start()

    def _lr_at(self, e, base):
        m = float(self.eta_min)
        return m + (base - m) * (1 + torch.cos(math.pi * e / self.T_max)) / 2

    def _describe(self):
        return [("T_max", self.T_max), ("eta_min", self.eta_min)]


class SequentialLR(LRScheduler):
    """Runs ``schedulers`` one after the other, switching at ``milestones``, as
    ``torch.optim.lr_scheduler.SequentialLR``: from milestone ``m[k-1]`` on, scheduler ``k``
    runs with its step counted from 0. The schedulers must be mpext schedulers of the same
    optimizer; they become parts of this one (step only the SequentialLR). All are evaluated on
    the device each step and the active one selected with ``torch.where``: no host branch."""

    def __init__(self, optimizer: Any, schedulers: Sequence[LRScheduler],
                 milestones: Sequence[int], *, scaler: Any = None) -> None:
        self._children = list(schedulers)
        self._milestones = list(milestones)
        super().__init__(optimizer, scaler=scaler)

    def _check_args(self) -> None:
        where = "mpext.optim.lr_scheduler.SequentialLR"
        kids, ms = self._children, self._milestones
        if len(kids) < 1:
            raise ValueError("%s: expects at least one scheduler" % where)
        for i, s in enumerate(kids):
            if not isinstance(s, LRScheduler):
                raise TypeError("%s: schedulers[%d] is a %s; it must be an mpext.optim."
                                "lr_scheduler scheduler (torch's are stepped on the host)"
                                % (where, i, type(s).__name__))
            if s.optimizer is not self.optimizer:
                raise ValueError("%s: schedulers[%d] belongs to another optimizer; all must "
                                 "belong to the SequentialLR's" % (where, i))
            if s._owner is not None:
                raise ValueError("%s: schedulers[%d] is already part of a SequentialLR"
                                 % (where, i))
        if len(ms) != len(kids) - 1:
            raise ValueError("%s: expects %d milestones (one fewer than schedulers), got %d"
                             % (where, len(kids) - 1, len(ms)))
        if not all(_is_int(m) and m >= 0 for m in ms) or any(a >= b for a, b in zip(ms,
                                                                                  ms[1:])):
            raise ValueError("%s: milestones must be increasing ints >= 0, got %r" % (where, ms))
        for s in kids:
            s._owner = self
            if s._load_hook is not None:
                s._load_hook.remove()
                s._load_hook = None
        self._start()

    def _lr_at(self, e, base):
        out = self._children[0]._lr_at(e, base)
        for m, child in zip(self._milestones, self._children[1:]):
            local = torch.clamp(e - m, min=0)
            out = torch.where(e >= m, child._lr_at(local, base), out)
        return out

    def _describe(self):
        return [("schedulers", self._children), ("milestones", self._milestones)]


# ---------------------------------------------------------------------------------------------
# transformers' schedules with warm-up: the same formulas, operation for operation.


def _check_steps(where: str, **kv: Any) -> None:
    for k, v in kv.items():
        if not _is_int(v) or v < 0:
            raise ValueError("mpext.optim.lr_scheduler.%s: %s must be an int >= 0, got %r"
                             % (where, k, v))


def get_linear_schedule_with_warmup(optimizer: Any, num_warmup_steps: int,
                                    num_training_steps: int, *, scaler: Any = None) -> LambdaLR:
    """Linear warm-up from 0 over ``num_warmup_steps``, then linear decay to 0 at
    ``num_training_steps``: ``transformers.get_linear_schedule_with_warmup``'s values, on the
    device, holding still on skipped steps."""
    _check_steps("get_linear_schedule_with_warmup", num_warmup_steps=num_warmup_steps,
                 num_training_steps=num_training_steps)
    w, t = num_warmup_steps, num_training_steps
    w_div, t_div = float(max(1, w)), float(max(1, t - w))

    def factor(e):
        return torch.where(e < w, e / w_div, torch.clamp((t - e) / t_div, min=0.0))

    return LambdaLR(optimizer, factor, scaler=scaler)


def get_cosine_schedule_with_warmup(optimizer: Any, num_warmup_steps: int,
                                    num_training_steps: int, num_cycles: float = 0.5, *,
                                    scaler: Any = None) -> LambdaLR:
    """Linear warm-up from 0 over ``num_warmup_steps``, then a cosine from the base rate to 0
    at ``num_training_steps`` (``num_cycles`` waves, 0.5 by default):
    ``transformers.get_cosine_schedule_with_warmup``'s values, on the device, holding still on
    skipped steps."""
    _check_steps("get_cosine_schedule_with_warmup", num_warmup_steps=num_warmup_steps,
                 num_training_steps=num_training_steps)
    if not _is_real(num_cycles) or not math.isfinite(num_cycles):
        raise ValueError("mpext.optim.lr_scheduler.get_cosine_schedule_with_warmup: num_cycles "
                         "must be a finite number, got %r" % (num_cycles,))
    w, t = num_warmup_steps, num_training_steps
    w_div, t_div = float(max(1, w)), float(max(1, t - w))
    c = math.pi * float(num_cycles) * 2.0

    def factor(e):
        progress = (e - w) / t_div
        return torch.where(e < w, e / w_div,
                           torch.clamp(0.5 * (1.0 + torch.cos(c * progress)), min=0.0))

    return LambdaLR(optimizer, factor, scaler=scaler)


def get_constant_schedule_with_warmup(optimizer: Any, num_warmup_steps: int, *,
                                      scaler: Any = None) -> LambdaLR:
    """Linear warm-up from 0 over ``num_warmup_steps``, then the base rate:
    ``transformers.get_constant_schedule_with_warmup``'s values, on the device."""
    _check_steps("get_constant_schedule_with_warmup", num_warmup_steps=num_warmup_steps)
    w = num_warmup_steps
    w_div = float(max(1.0, w))

    def factor(e):
        return torch.where(e < w, e / w_div, 1.0)

    return LambdaLR(optimizer, factor, scaler=scaler)
