"""The fused launch planner of every rule: a list of :class:`StepItem` (one per param with a
gradient) into as few step-op calls as possible -- one per device, learning rate and
hyperparameters (:class:`AdamHyper`, or another rule's: the hyper names its op, its moment
quantities and its positional hyperparameters) -- and :func:`_op_call`, the one place that maps
a launch's lists and hyperparameters to the op's arguments. :class:`StepPlan` keeps an
optimizer's calls between steps, so that a step over many small params costs little more than
reading their gradients.

Shared with ``mpext.mixed_precision`` (whose fast path steps an inner Adam/AdamW through the
same planner): :class:`StepItem`, :class:`AdamHyper`, :func:`adam_hyper` and
:func:`fused_adam_step`.
"""
from collections import defaultdict
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Union

import torch

from .._common import LrTensors, is_dense, same_layout
from . import _q8_shards as q8_shards
from .formats import launch_moments, launch_storage
from ._tensors import F32, local


class AdamHyper(NamedTuple):
    """What the params of one ``adam_step_`` call share besides device and learning rate.

    A rule's hyper (this, ``LionHyper``, ``SGDHyper``) ends with the storage fields from
    ``unscale_grads`` on, and tells the planner its ``op``, ``moment_lists`` (how many moment
    lists the op's schema takes), :meth:`quantities` (the state quantities it keeps, in the
    op's order: at most ``moment_lists``) and :meth:`rule_args` (the op's positional
    hyperparameters after ``lr``). What each moment adds to the call (an 8-bit code's scales)
    is its format's (formats.launch_moments)."""
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    maximize: bool
    unscale_grads: bool
    master_free: bool
    stochastic_rounding: bool
    moments_round_nearest: bool
    seed: int
    block_size: int
    ema_decay: float  # 0 when the group keeps no EMA (the kernel then has none to update)

    op = "adam_step_"
    moment_lists = 2

    def quantities(self) -> tuple:
        return ("exp_avg", "exp_avg_sq")

    def rule_args(self) -> tuple:
        return (self.beta1, self.beta2, self.eps, self.weight_decay, self.decoupled,
                self.maximize)


# The storage fields every rule's hyper ends with, as (name, type): AdamHyper's, and the
# fields rule_hyper gives another rule's.
STORAGE_FIELDS = [(name, AdamHyper.__annotations__[name])
                  for name in AdamHyper._fields[AdamHyper._fields.index("unscale_grads"):]]


def rule_hyper(name: str, fields: List[tuple]) -> type:
    """The NamedTuple base of a rule's hyper: its own fields, then STORAGE_FIELDS (the rule
    subclasses it with op, moment_lists, quantities and rule_args, as AdamHyper has them)."""
    return NamedTuple(name, list(fields) + STORAGE_FIELDS)


def storage_hyper(group: Dict[str, Any]) -> tuple:
    """The storage fields every rule's hyper ends with (see :class:`AdamHyper`), as Python
    values, with mpext's defaults for a group without mpext's keys."""
    return (bool(group.get("unscale_grads", True)), group.get("master_weights", True) is False,
            bool(group.get("stochastic_rounding", False)),
            group.get("moment_rounding", "stochastic") == "nearest",
            int(group.get("seed", 0)), int(group.get("block_size", 256)),
            float(group.get("ema_decay") or 0.0))


def adam_hyper(group: Dict[str, Any], force_decoupled: bool = False) -> AdamHyper:
    """A param group's :class:`AdamHyper`, as Python values (a tensor beta is read once here,
    as torch's own optimizers read it). A group without mpext's keys (torch's Adam) gets their
    defaults: the unscaled gradient written back, as torch's fused optimizers do, and FP32
    masters."""
    beta1, beta2 = (float(b) for b in group["betas"])
    wd = float(group["weight_decay"])
    decoupled = (force_decoupled or bool(group.get("decoupled_weight_decay", False))) and wd != 0
    return AdamHyper(beta1, beta2, float(group["eps"]), wd, decoupled,
                     bool(group.get("maximize", False)), *storage_hyper(group))


class StepItem(NamedTuple):
    """One param to step. Plain tensors (DTensors already as their local shards)."""
    param: torch.Tensor
    grad: torch.Tensor
    # the rule's moments, each under its format's keys (mpext.optim.formats), an optional
    # ema_param, and step (converted in place to a float32 scalar on the param's device if it
    # is not one)
    state: Dict[str, Any]
    # the state entry that holds the FP32 value of a bf16/fp16 param (its param format's:
    # a master or a remainder), or None (an fp32 param, or none kept)
    storage: Optional[torch.Tensor]
    lr: Union[float, torch.Tensor]
    hyper: Any  # AdamHyper, or another rule's (see AdamHyper)
    stream: int  # the param's stochastic-rounding stream, in [0, 2^32)
    # the position of the param's first element in its whole parameter (a DTensor's shard:
    # its global offset), added to every element's stochastic-rounding position
    offset: int = 0
    # a DTensor param with blocked moments: where its blocks lie (formats.Blocks); the step
    # splits it into its inner blocks and copies of the blocks other shards share
    blocks: Any = None


def overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of the strided tensor ``t`` share memory (an ``expand``, an
    ``as_strided`` view whose rows overlap): an in-place update of such a tensor depends on the
    order its elements are written in."""
    if is_dense(t):
        return False
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1)
    span = 0  # the furthest offset the smaller strides reach
    for st, n in dims:
        if st <= span:
            break
        span += st * (n - 1)
    else:
        return False
    if dims[0][0] == 0:
        return True
    # Strides interleave (rare): the elements' offsets, counted.
    offsets = torch.zeros((), dtype=torch.int64)
    for st, n in dims:
        offsets = (offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st).reshape(-1)
    return offsets.unique().numel() < offsets.numel()


def overlap_refusal(t: torch.Tensor, where: str) -> str:
    return ("%s has elements that share memory (sizes %s, strides %s: an expand() or an "
            "overlapping as_strided view), which an in-place step writes in an order-dependent "
            "way (torch's optimizers raise or step such a param by the order they write); "
            "make it a param of its own memory (e.g. Parameter(t.clone()))"
            % (where, tuple(t.shape), tuple(t.stride())))


def _to_device(t: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    if t is None:
        return None
    # Non-blocking only towards an accelerator: a host tensor must hold its value when used.
    return t.to(device=device, dtype=torch.float32, non_blocking=device.type != "cpu")


def device_step(state: Dict[str, Any], device: torch.device) -> torch.Tensor:
    """The param's step count as the kernel needs it: a float32 scalar tensor on the param's
    device. A state loaded by other code (ZeroRedundancyOptimizer moves 0-dim state to the CPU,
    torch's non-fused Adam keeps a float or an int64 tensor) is converted once, in place."""
    step = state["step"]
    if not (isinstance(step, torch.Tensor) and step.dtype is F32 and step.device == device
            and step.dim() == 0):
        step = torch.as_tensor(step).detach().to(device=device, dtype=F32).reshape(())
        state["step"] = step
    return step


class _Launch(NamedTuple):
    """The per-param lists of one step-op call (the moments' come from formats.launch_moments:
    one list per moment list the op takes, and the keyword lists their formats add)."""
    params: list
    grads: list
    states: list
    storages: list  # each param's stored FP32 value (formats.launch_storage), or None
    steps: list
    streams: list
    offsets: list
    emas: list


def _op_call(launch: _Launch, lr: torch.Tensor, hyper: Any,
             inv_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor],
             empty: torch.Tensor, placeholder: Any) -> tuple:
    """(args, kwargs) of the hyper's op (``torch.ops.mpext.adam_step_``, ...) for one launch: a
    list the kernel would only read as placeholders (``empty``) is passed as None or left
    out."""
    storage = launch_storage(launch.storages, placeholder)
    masters = storage.pop("masters") or []
    moments, extra = launch_moments(launch.states, hyper.quantities(), hyper.moment_lists,
                                    empty)
    seed = hyper.seed - 2 ** 64 if hyper.seed >= 2 ** 63 else hyper.seed  # the schema's int64
    args = ((launch.params, launch.grads) + tuple(moments)
            + (masters, launch.steps, lr) + hyper.rule_args())
    kwargs = dict(inv_scale=inv_scale, found_inf=found_inf, unscale_grads=hyper.unscale_grads,
                  master_free=hyper.master_free, stochastic_rounding=hyper.stochastic_rounding,
                  moments_round_nearest=hyper.moments_round_nearest, seed=seed,
                  sr_streams=launch.streams,
                  offsets=launch.offsets if any(launch.offsets) else None, block_size=hyper.block_size,
                  ema_params=None if all(e is empty for e in launch.emas) else launch.emas,
                  ema_decay=hyper.ema_decay, **storage)
    kwargs.update(extra)
    return args, kwargs


def _plan_calls(items: Iterable[StepItem], lr_tensors: LrTensors,
                inv_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor]) -> tuple:
    """The op calls that step the items, as ``(calls, copied)``: each call a :class:`_Call`,
    with ``positions`` the indices in ``items`` of its params; ``copied`` the (tensor, copy)
    pairs to write back after the launches: a gradient's copy in the param's layout that the
    kernel may write, a non-dense param's contiguous copy that it steps."""
    calls: Dict[tuple, List[int]] = {}
    items = list(items)
    for i, item in enumerate(items):
        p, _, _, _, lr, hyper, _, _, _ = item  # unpacked: cheaper than field reads per param
        calls.setdefault((p.device, _lr_key(lr), type(hyper), hyper), []).append(i)
    out = []
    copied = []
    per_device: Dict[torch.device, tuple] = {}
    slots: Dict[torch.device, int] = defaultdict(int)
    for (device, _, _, hyper), positions in calls.items():
        if device not in per_device:
            per_device[device] = (_to_device(inv_scale, device), _to_device(found_inf, device),
                                  torch.empty(0, dtype=F32, device=device), {})
        dev_inv, dev_found, empty, zeros = per_device[device]

        def placeholder(dtype, device=device, zeros=zeros):
            # one zero-size tensor per dtype and device: what the op reads as "none"
            t = zeros.get(dtype)
            if t is None:
                t = zeros[dtype] = torch.empty(0, dtype=dtype, device=device)
            return t

        launch = _Launch([], [], [], [], [], [], [], [])
        for i in positions:
            p, g, state, storage, _, _, stream, offset, _ = items[i]
            if not is_dense(p):
                if overlapping(p):  # (refused when added; its .data replaced since)
                    raise ValueError(overlap_refusal(p, "a param"))
                # A param with gaps (a slice of a bigger tensor): the kernel takes
                # flat memory, so it steps a contiguous copy, written back after the launch.
                # Its state is contiguous (zeros_like of such a param is), so the bits are
                # those of a contiguous param.
                copy = p.contiguous()
                copied.append((p, copy))
                p = copy
            if g.stride() != p.stride() and not same_layout(g, p):
                # e.g. a channels_last param with a contiguous gradient
                copy = torch.empty_like(p, dtype=g.dtype).copy_(g)
                if hyper.unscale_grads and dev_inv is not None:
                    copied.append((g, copy))
                g = copy
            launch.params.append(p)
            launch.grads.append(g)
            launch.states.append(state)
            launch.steps.append(device_step(state, device))
            launch.storages.append(storage)
            launch.streams.append(stream)
            launch.offsets.append(offset)
            ema = state.get("ema_param")
            launch.emas.append(empty if ema is None else local(ema))
        slot = slots[device]
        slots[device] += 1
        lr_t = lr_tensors.get((device, slot), device, items[positions[0]].lr)
        args, kwargs = _op_call(launch, lr_t, hyper, dev_inv, dev_found, empty, placeholder)
        out.append(_Call(getattr(torch.ops.mpext, hyper.op), args, kwargs, device, slot,
                         positions))
    return out, copied


def _lr_key(lr: Any) -> Any:
    """What params must share to share a launch's learning rate: the tensor, or the value."""
    return ("tensor", id(lr)) if isinstance(lr, torch.Tensor) else float(lr)


class _Call(NamedTuple):
    op: Any
    args: tuple
    kwargs: dict
    device: torch.device
    slot: int  # the launch's learning-rate buffer among its device's
    positions: List[int]


def fused_step(items: Union[Iterable[StepItem], "StepPlan"], lr_tensors: LrTensors,
               inv_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor]) -> None:
    """Steps every item with as few calls of its hyper's op as possible: one per device,
    learning rate and hyperparameters, whatever the params' groups or dtypes. The one planner
    of the fused step of every rule (``fused_adam_step`` is its name for Adam), used by the
    rule classes and by ``MixedPrecisionOptimizer``'s fast path. Every call's arguments are
    assembled before the first launch, so a failing check leaves everything unchanged.
    ``items`` may also be a :class:`StepPlan` (an optimizer's cached calls)."""
    if isinstance(items, StepPlan):
        items.run(lr_tensors, inv_scale, found_inf)
        return
    items = list(items)
    for it in items:
        if it.blocks is not None:  # split() shares the step with the copies: a kernel's first
            device_step(it.state, it.param.device)
    items, regrads = q8_shards.grads_in_param_order(items)
    items, shared = q8_shards.split(items)
    calls, copied = _plan_calls(items, lr_tensors, inv_scale, found_inf)
    if shared is not None:
        shared.gather()
    run_launches([(c.op, (c.args, c.kwargs)) for c in calls], copied)
    if shared is not None:
        shared.scatter()
    if inv_scale is not None:  # the unscaled values the op wrote into the copies
        for g, copy in regrads:
            g.copy_(copy)


# Step telemetry (mpext.telemetry): callables ``source(op, args, kwargs)`` that return the
# ``stats`` tensor a launch counts into (rows: its params), or None. Every launch of every rule
# goes through run_launches, so this is the one place a step is counted; with no source (the
# default) a launch is exactly the uncounted call.
STATS_SOURCES: List[Any] = []


def run_launches(launches: List[tuple], copied: List[tuple]) -> None:
    """Makes the planned op calls ((op, (args, kwargs)) each), then copies the unscaled values
    of the gradients that were stepped through a copy in the param's layout back into them."""
    for op, (args, kwargs) in launches:
        if STATS_SOURCES:
            # a snapshot: a source whose telemetry was freed leaves the list while it is walked,
            # and walking the list itself would then skip the source after it
            for source in tuple(STATS_SOURCES):
                stats = source(op, args, kwargs)
                if stats is not None:
                    kwargs = dict(kwargs, stats=stats)
                    break
        op(*args, **kwargs)
    for g, copy in copied:
        g.copy_(copy)


class _PlannedCall:
    """One op call of a :class:`StepPlan`: its arguments but the gradients, learning rate and
    scaler tensors, and what each of its params' entries depended on when it was planned."""
    __slots__ = ("op", "args", "kwargs", "device", "slot", "lr_at", "lr_group", "lr_groups",
                 "owners", "states", "ids", "dtypes", "grads")


def planned_launch(c: "_PlannedCall", lr: Any, per_device: Dict[torch.device, tuple],
                   inv_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor]) -> tuple:
    """A planned call's launch for this step: its gradients, ``lr`` and the scaler's tensors on
    its device (moved once per device, through ``per_device``)."""
    dev = per_device.get(c.device)
    if dev is None:
        dev = per_device[c.device] = (_to_device(inv_scale, c.device),
                                      _to_device(found_inf, c.device))
    args = list(c.args)
    args[1] = c.grads
    args[c.lr_at] = lr
    kwargs = dict(c.kwargs)
    kwargs["inv_scale"], kwargs["found_inf"] = dev
    return c.op, (args, kwargs)


class StepPlan:
    """An optimizer's op calls, kept between steps by its owner (mpext.optim._base): every list
    but the gradients, so that a step reads the gradients, checks that each param's dtype,
    state dict and state tensors are the ones planned, and launches. :meth:`refresh` (False: the
    plan no longer holds, plan anew), :meth:`run` (through :func:`fused_step`). The op checks
    every argument before it writes anything, so a call it refuses falls back to the long way
    (``owner``, a weak reference set by the optimizer: its ``_long_items()``, the StepItems
    the long way, whose checks name the bad argument); with
    more than one call the gradients are checked here first, so that no call runs before a
    later one is refused. DTensor params get ``_shard_plan.ShardedStepPlan``, which extends it
    with each param's local views and the 8-bit shared-block exchange."""

    def __init__(self, calls: List[_PlannedCall], idle: List[torch.Tensor]) -> None:
        self.calls, self.idle, self.owner = calls, idle, None
        self.size = sum(len(c.owners) for c in calls)

    def __len__(self) -> int:
        return self.size

    @classmethod
    def build(cls, items: List[StepItem], owners: List[torch.Tensor], groups: List[dict],
              idle: List[torch.Tensor], lr_tensors: LrTensors) -> Optional["StepPlan"]:
        """The plan of a step of ``items`` (with ``owners`` the params whose ``.grad`` is read
        and ``groups`` their param groups; ``idle`` the params without a gradient), or None
        where a gradient needs a copy in its param's layout (those step the long way)."""
        planned, _ = _plan_calls(items, lr_tensors, None, None)
        calls = []
        for c in planned:
            if any(g is not items[i].grad for g, i in zip(c.args[1], c.positions)) \
                    or any(p is not items[i].param for p, i in zip(c.args[0], c.positions)):
                return None
            pc = _PlannedCall()
            # args without the gradients (refresh reads them at every step, run lets go of
            # them): a kept plan holds no gradient past its step, as zero_grad's set_to_none
            # expects
            pc.op, pc.args, pc.kwargs, pc.device, pc.slot = c.op, c.args[:1] + (None,) \
                + c.args[2:], c.kwargs, c.device, c.slot
            pc.lr_at = len(c.args) - len(items[c.positions[0]].hyper.rule_args()) - 1
            pc.lr_groups = list({id(groups[i]): groups[i] for i in c.positions}.values())
            pc.lr_group = pc.lr_groups[0]
            pc.owners = [owners[i] for i in c.positions]
            pc.states = [items[i].state for i in c.positions]
            pc.ids = [tuple(map(id, st.values())) for st in pc.states]
            pc.dtypes = [p.dtype for p in pc.owners]
            pc.grads = c.args[1]
            calls.append(pc)
        return cls(calls, idle)

    def refresh(self, state_of: Any) -> bool:
        """Reads every param's gradient; False if the plan no longer holds: a param with a
        gradient it did not plan for, or without one, or whose dtype, state dict or state
        tensors changed, or (several calls) a gradient the op would refuse."""
        check = len(self.calls) > 1
        for c in self.calls:
            if len(c.lr_groups) > 1 and len({_lr_key(g["lr"]) for g in c.lr_groups}) > 1:
                return False
            grads = [p.grad for p in c.owners]
            for p, g, st, ids, dt in zip(c.owners, grads, c.states, c.ids, c.dtypes):
                if g is None or p.dtype is not dt or state_of(p) is not st \
                        or tuple(map(id, st.values())) != ids:
                    return False
                if check and not (g.layout == torch.strided and (g.dtype is dt or g.dtype is F32)
                                  and g.device == p.device and g.stride() == p.stride()
                                  and g.shape == p.shape):
                    return False
            c.grads = grads
        return all(p.grad is None for p in self.idle)

    def run(self, lr_tensors: LrTensors, inv_scale: Optional[torch.Tensor],
            found_inf: Optional[torch.Tensor]) -> None:
        per_device: Dict[torch.device, tuple] = {}
        launches = [planned_launch(c, lr_tensors.get((c.device, c.slot), c.device,
                                                      c.lr_group["lr"]),
                                   per_device, inv_scale, found_inf) for c in self.calls]
        for c in self.calls:
            c.grads = None  # held by the launches only
        if len(launches) > 1:
            run_launches(launches, [])
            return
        try:
            run_launches(launches, [])
            return
        except (RuntimeError, ValueError, TypeError):
            pass  # refused before anything was written: the long way names what is wrong
        del launches
        fused_step(self.owner()._long_items(), lr_tensors, inv_scale, found_inf)


# Adam's name for the planner (MixedPrecisionOptimizer and earlier callers use it).
fused_adam_step = fused_step
