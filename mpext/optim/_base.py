"""The base of mpext's fused optimizers: :class:`FusedOptimizer` owns everything that does not
depend on the update rule -- the param groups and their format settings, the state and its
conversion, ``state_dict`` / ``load_state_dict``, the EMA, the GradScaler protocol
(``_step_supports_amp_scaling``, ``grad_scale`` / ``found_inf``) and DTensor params. A rule
class (:class:`mpext.optim.Adam`) adds its defaults, its hyperparameter checks, its moment
quantities and its launch; docs/contributing.md, "Python optimizer package", lists what it
provides.

Shared with ``mpext.mixed_precision``: :class:`FusedOptimizer` (to recognize mpext's
optimizers) and :func:`ema_swapped`.
"""
import contextlib
import math
import operator
import warnings
import weakref
from collections import defaultdict
from copy import deepcopy
from itertools import chain
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from .._common import LOW_DTYPES, PARAM_DTYPES, LrTensors
from .._common import dtype_name, has_kernel, is_dense, is_real
from . import formats as F
from ._engine import StepItem, StepPlan, overlap_refusal, overlapping
from ._release import DEFAULT_BUCKET_BYTES, GradRelease
from ._shard_plan import ShardedStepPlan
from ._state import check_formats_param, conform_state, import_param_state, new_moments
from ._tensors import F32, is_dtensor, local, shard_offset

_STRIDED = torch.strided
_MISSING = object()  # a group setting that is not there

# Settings load_state_dict takes from the checkpoint (as torch does) that change what the
# optimizer keeps or draws, so that a difference is warned about.
_REPLACED_SETTINGS = ("seed", "moment_rounding", "ema_decay")
# The settings that choose the formats: how the state is kept, this optimizer's choice when a
# checkpoint is loaded (the moment settings are the rule's, FusedOptimizer.moments).
_PARAM_FORMAT_SETTINGS = ("master_weights", "param_remainders", "stochastic_rounding")
# mpext's param-group keys beyond torch's (master_weights and the moment settings aside), with
# their defaults.
_LEAN_DEFAULTS = {"unscale_grads": True, "param_remainders": False, "stochastic_rounding": False,
                  "moment_rounding": "stochastic", "seed": 0, "block_size": 256,
                  "ema_decay": None}


class _TorchPath(RuntimeError):
    """A param the fused step met that torch's implementation of the rule steps (a sparse
    gradient, say): raised before anything is changed, so that step() sorts it out and retries;
    elsewhere (gradient release) its message is the refusal."""


class FusedOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose step is one fused kernel launch per device and set of
    hyperparameters, with mpext's state formats (mpext.optim.formats). Not used directly: a rule
    class (:class:`mpext.optim.Adam`) subclasses it; see docs/contributing.md."""

    _step_supports_amp_scaling = True
    # The rule's moment quantities, in the order its kernel takes them.
    moments: Tuple[F.Quantity, ...] = ()

    # -----------------------------------------------------------------------------------------
    # What a rule provides.

    def _check_rule(self, group: Dict[str, Any], where: str) -> None:
        """Checks the rule's own hyperparameters of a group (raises; changes nothing)."""
        raise NotImplementedError

    def _fill_group(self, group: Dict[str, Any]) -> None:
        """Gives a group (unpickled, or loaded from a checkpoint) the rule's keys it lacks."""

    def _hyper(self, group: Dict[str, Any]) -> Any:
        """The group's hyperparameters as its launch takes them (a hashable value: params with
        equal ones share a launch)."""
        raise NotImplementedError

    def _launch(self, items: List[StepItem], inv_scale: Optional[torch.Tensor],
                found_inf: Optional[torch.Tensor]) -> None:
        """Steps the items (mpext.optim._engine)."""
        raise NotImplementedError

    def _check_saved_state(self, value: Dict[str, Any], where: str) -> None:
        """Refuses a saved param state the rule cannot continue from."""

    # The torch path (docs/dropin.md): params that torch.optim's own implementation of the rule
    # steps, with torch's math and state keys, where mpext's kernels have no format for them.
    # A rule that has such an implementation lists the param dtypes it hands over and says
    # whether sparse gradients go too, and steps them in _torch_step.
    _TORCH_DTYPES: frozenset = frozenset()
    _TORCH_SPARSE = False

    def _torch_group(self, group: Dict[str, Any]) -> bool:
        """Whether a group's settings send all its params to torch's implementation."""
        return False

    def _torch_step(self, group: Dict[str, Any], params: List[torch.Tensor],
                    grads: List[torch.Tensor]) -> None:
        """Steps ``params`` (a group's torch-path params with gradients) with torch.optim's
        functional implementation of the rule, their state under torch's keys."""
        raise NotImplementedError

    def _torch_state(self, p: torch.Tensor, state: Dict[str, Any]) -> bool:
        """Whether a param's state was made by torch's implementation and only it can continue
        it (SGD: a sparse momentum buffer)."""
        return False

    def _check_torch_grad(self, p: torch.Tensor, g: torch.Tensor, group: Dict[str, Any],
                          where: str) -> None:
        """Raises the error torch's implementation would raise for the torch-path param ``p``
        with gradient ``g`` (and its state), in mpext's words, before anything is stepped:
        torch's step raises only once it has stepped the params before it."""

    # The rule a checkpoint's param group belongs to, told by the keys of its hyperparameters
    # and of its params' state together (first match): (name, keys it has, keys it lacks).
    # Each row's keys are ones that rule's optimizer writes and the others' do not (a key
    # several rules share, as momentum or betas, tells nothing alone), so that a checkpoint of
    # any of torch.optim's optimizers is named as its own rule. The first three rows are
    # mpext's rules, in this order (every rule's _RULE names its row).
    _RULE_SIGNATURES = (
        ("SGD (torch.optim.SGD or mpext.optim.SGD)", ("momentum", "dampening", "nesterov"), ()),
        ("Adam/AdamW (torch.optim.Adam/AdamW or mpext.optim.Adam/AdamW)",
         ("betas", "eps", "amsgrad"), ()),
        ("Lion (lion_pytorch.Lion or mpext.optim.Lion)", ("betas",), ("eps",)),
        ("NAdam (torch.optim.NAdam)", ("momentum_decay",), ()),
        ("RMSprop (torch.optim.RMSprop)", ("alpha", "centered"), ()),
        ("ASGD (torch.optim.ASGD)", ("lambd", "t0"), ()),
        ("Rprop (torch.optim.Rprop)", ("etas", "step_sizes"), ()),
        ("Adadelta (torch.optim.Adadelta)", ("rho",), ()),
        ("Adagrad (torch.optim.Adagrad)", ("lr_decay",), ()),
        ("LBFGS (torch.optim.LBFGS)", ("history_size",), ()),
        ("SparseAdam (torch.optim.SparseAdam)", ("betas", "eps"), ("weight_decay",)),
        # Adamax keeps exp_inf where RAdam keeps exp_avg_sq (torch before 2.4 wrote no
        # decoupled_weight_decay for RAdam: its state tells)
        ("Adamax (torch.optim.Adamax)", ("betas", "eps"),
         ("amsgrad", "decoupled_weight_decay", "exp_avg_sq")),
        ("RAdam (torch.optim.RAdam)", ("betas", "eps"), ("amsgrad", "exp_inf")),
    )
    _RULE = ""  # the row of _RULE_SIGNATURES that is this class's rule
    # The keys of torch's optimizer of the rule that mpext's groups keep (given a group that
    # lacks them: an older pickle), with torch's defaults.
    _TORCH_GROUP_DEFAULTS = {"foreach": None, "capturable": False, "differentiable": False,
                             "fused": None}
    _RULE_KEYS: Tuple[str, ...] = ()  # the rule's hyperparameters, named in a refusal

    # -----------------------------------------------------------------------------------------
    # Construction and validation.

    def _name(self) -> str:
        return "mpext.optim." + type(self).__name__

    def __init__(self, params, defaults: Dict[str, Any]) -> None:
        # Every rule's defaults are checked before torch's constructor sees any param, so a bad
        # argument raises with nothing built.
        self._check_group(defaults, "")
        self._init_caches()
        super().__init__(params, defaults)

    def _init_caches(self) -> None:
        self._lr_tensors = LrTensors()
        self._plan: Optional[StepPlan] = None  # the last step's calls (_items)
        # Whether a param may take the torch path (a dtype or a sparse gradient seen): only
        # then does a step sort params per step (_torch_part), so others pay nothing.
        self._torch_seen = False

    def _moments_of(self, group: Dict[str, Any]) -> Tuple[F.Quantity, ...]:
        """The moment quantities a group's params keep: the rule's ``moments`` (SGD keeps none
        without momentum)."""
        return self.moments

    def _moment_settings(self) -> Tuple[str, ...]:
        return tuple(q.setting for q in self.moments)

    def _check_lr(self, group: Dict[str, Any], where: str) -> None:
        """Checks a group's lr, which schedulers change between steps (raises)."""
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                raise ValueError("Tensor lr must be 1-element")
            if not lr.is_floating_point():
                raise TypeError("%s: a Tensor lr must be floating point, got %s"
                                % (self._name(), lr.dtype))
        elif not is_real(lr):
            raise TypeError("%s: lr must be a float or a 1-element Tensor, got %r%s"
                            % (self._name(), lr, where))
        elif not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        elif not math.isfinite(lr):
            raise ValueError("%s: lr must be finite, got %r%s" % (self._name(), lr, where))

    def _check_group(self, group: Dict[str, Any], where: str) -> None:
        """Checks a group's settings (raises before anything changes). Messages of the checks
        torch also makes are torch's."""
        self._check_lr(group, where)
        self._check_rule(group, where)
        if group.get("differentiable", False):
            raise ValueError("%s: differentiable=True is not supported: the fused step is not "
                             "differentiable%s" % (self._name(), where))
        self._check_formats(group, where)
        rounding = group.get("moment_rounding", "stochastic")
        if rounding not in ("stochastic", "nearest"):
            raise ValueError("%s: moment_rounding must be \"stochastic\" or \"nearest\", got "
                             "%r%s" % (self._name(), rounding, where))
        ema_decay = group.get("ema_decay")
        if ema_decay is not None and not (is_real(ema_decay) and 0.0 <= ema_decay <= 1.0):
            raise ValueError("%s: ema_decay must be None or a number in [0, 1], got %r%s"
                             % (self._name(), ema_decay, where))
        seed = group.get("seed", 0)
        if not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2 ** 64):
            raise ValueError("%s: seed must be an int in [0, 2**64), got %r%s"
                             % (self._name(), seed, where))

    def _check_formats(self, group: Dict[str, Any], where: str) -> None:
        """Checks the settings that choose the group's param and moment formats; a moment
        format given by name or format object is kept as its torch dtype (formats.parse)."""
        for flag in ("master_weights", "unscale_grads", "param_remainders",
                     "stochastic_rounding"):
            if not isinstance(group.get(flag, False), bool):
                raise TypeError("%s: %s must be a bool, got %r%s"
                                % (self._name(), flag, group.get(flag), where))
        mw = group.get("master_weights", True)
        if group.get("param_remainders", False) and not mw:
            raise ValueError("%s: param_remainders=True stores the masters compactly; it needs "
                             "master_weights=True%s" % (self._name(), where))
        if group.get("stochastic_rounding", False) and mw:
            raise ValueError("%s: stochastic_rounding=True rounds params that have no master; "
                             "it needs master_weights=False%s" % (self._name(), where))
        F.parse(group, self.moments, self._name(), where)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self._plan = None
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        where = " (param group %d)" % (len(self.param_groups) - 1)
        try:
            self._check_group(group, where)
            for j, p in enumerate(group["params"]):
                if p.layout != torch.strided:
                    raise ValueError("%s: params[%d]%s is a %s tensor; only dense params are "
                                     "supported" % (self._name(), j, where, p.layout))
                if not is_dtensor(p) and overlapping(p):
                    raise ValueError(overlap_refusal(p, "%s: params[%d]%s"
                                                     % (self._name(), j, where)))
                if self._torch_group(group) or p.dtype in self._TORCH_DTYPES:
                    self._check_torch_param(p, group, "%s: params[%d]%s"
                                            % (self._name(), j, where))
                    self._torch_seen = True
                    continue
                if p.dtype not in PARAM_DTYPES:
                    raise TypeError("%s: params[%d]%s has dtype %s; only float32, bfloat16 and "
                                    "float16 params are supported%s"
                                    % (self._name(), j, where, dtype_name(p.dtype),
                                       self._torch_dtypes_note()))
                # (a float16 param with param_remainders is refused by its param format)
                F.param_format(p, group, "%s: params[%d]%s" % (self._name(), j, where))
                check_formats_param(p, group, self._moments_of(group),
                                    "%s: params[%d]%s" % (self._name(), j, where))
                if not has_kernel(self._op, p.device):
                    raise ValueError("%s: params[%d]%s is on %s, a device this build of mpext "
                                     "has no %s kernel for"
                                     % (self._name(), j, where, p.device, self._op))
                if is_dtensor(p) and not is_dense(local(p)):
                    # A plain non-dense param steps through a contiguous copy (_engine); a
                    # shard's 8-bit blocks and SR positions assume its own flat memory.
                    raise ValueError("%s: params[%d]%s is a DTensor whose local shard is not "
                                     "dense and non-overlapping (sizes %s, strides %s)"
                                     % (self._name(), j, where, tuple(local(p).shape),
                                        tuple(local(p).stride())))
        except BaseException:
            self.param_groups.pop()
            raise
        if group["master_weights"] is False and not group["stochastic_rounding"] \
                and any(p.dtype in LOW_DTYPES for p in group["params"]):
            warnings.warn("%s: master_weights=False without stochastic_rounding=True rounds "
                          "every update of the BF16/FP16 params%s to nearest even, which loses "
                          "the updates below half an ulp: at small learning rates most weights "
                          "stop moving (docs/lean_state.md, \"When round to nearest fails\"); "
                          "pass stochastic_rounding=True" % (self._name(), where),
                          UserWarning, stacklevel=3)

    def _torch_reasons(self) -> str:
        why = []
        if any(self._torch_group(g) for g in self.param_groups):
            why.append("a group's settings")
        if any(p.dtype in self._TORCH_DTYPES for g in self.param_groups for p in g["params"]):
            why.append("a param's dtype")
        return " and ".join(why) or "a sparse gradient"

    def _torch_dtypes_note(self) -> str:
        if not self._TORCH_DTYPES:
            return ""
        return " (and %s, which torch's implementation of the rule steps)" % ", ".join(
            sorted(dtype_name(d) for d in self._TORCH_DTYPES))

    def _check_torch_param(self, p: torch.Tensor, group: Dict[str, Any], where: str) -> None:
        """Refuses a torch-path param whose group asks for what only the fused step keeps: a
        master, an 8-bit or BF16 moment, an EMA (torch's implementation keeps none of them)."""
        if p.device.type == "meta":  # as on the fused path (docs/dropin.md)
            raise ValueError("%s is on meta, a device mpext steps no params on" % where)
        if p.layout != torch.strided:
            raise ValueError("%s is a %s tensor; only dense params are supported"
                             % (where, p.layout))
        why = "torch.optim's implementation of the rule steps it (docs/dropin.md)"
        for q in self._moments_of(group):
            if not F.is_default(group.get(q.setting, F32), q):
                raise ValueError("%s: %s=%r is not available for it: %s, with its state in the "
                                 "param's dtype" % (where, q.setting, group.get(q.setting), why))
        for key, default in (("param_remainders", False), ("stochastic_rounding", False),
                             ("ema_decay", None)):
            if group.get(key, default) != default:
                raise ValueError("%s: %s=%r is not available for it: %s"
                                 % (where, key, group[key], why))
        if p.dtype in LOW_DTYPES and group.get("master_weights", True):
            raise ValueError("%s is %s in a group that keeps FP32 masters, which %s does not "
                             "do; pass master_weights=False for that group to step it as torch "
                             "does" % (where, dtype_name(p.dtype), why.split(" steps")[0]))

    def _fill_defaults(self, group: Dict[str, Any]) -> None:
        """Gives a group the format keys it lacks (this optimizer's defaults), then the rule's."""
        group.setdefault("master_weights", self.defaults.get("master_weights", True))
        for key in self._moment_settings():
            group.setdefault(key, self.defaults.get(key, F32))
        for key, value in _LEAN_DEFAULTS.items():
            group.setdefault(key, self.defaults.get(key, value))
        self._fill_group(group)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        if not hasattr(self, "_lr_tensors"):
            self._init_caches()
        self._plan = None
        for group in self.param_groups:
            # the rule's torch keys only: a key added here would make a loaded state_dict
            # differ from the saved one (SGD has no capturable)
            for key, value in self._TORCH_GROUP_DEFAULTS.items():
                group.setdefault(key, value)
            self._fill_defaults(group)
            if any(p.dtype in self._TORCH_DTYPES for p in group["params"]):
                self._torch_seen = True

    # -----------------------------------------------------------------------------------------
    # The step.

    def _items(self, only: Optional[set] = None) -> Union[List[StepItem], StepPlan]:
        """Every param with a gradient (of those whose ids are in ``only``, if given), checked,
        as a :class:`StepItem` of the engine, with DTensors as their local shards; for a whole
        step, the cached :class:`StepPlan` of those items where it still holds (see
        :meth:`_ready_plan`). Raises before anything is written (state is created lazily,
        which changes no value a reader relies on)."""
        if only is None:
            plan = self._ready_plan()
            if plan is not None:
                return plan
        items, owners, groups = self._checked_items(only)
        if only is None and items:
            plan = self._new_plan(items, owners, groups)
            if plan is not None:
                return plan
        return items

    # The group settings every rule reads besides its defaults' keys (lr aside: it is checked
    # at every step).
    _READ_SETTINGS = ("differentiable", "master_weights") + tuple(_LEAN_DEFAULTS)

    def _settings(self, group: Dict[str, Any], keys: Tuple[str, ...]) -> Optional[list]:
        """What a group's checks and hyperparameters were computed from, to compare between
        steps (a container as a tuple of its items: betas may be a list edited in place);
        None when a setting is a tensor (which may change in place unseen)."""
        out = []
        for key in keys:
            v = group.get(key, _MISSING)
            t = type(v)
            if t is list or t is tuple:
                v = tuple(v)
                if any(isinstance(x, torch.Tensor) for x in v):
                    return None
            elif isinstance(v, torch.Tensor):
                return None
            out.append((t, v))
        return out

    def _new_plan(self, items: List[StepItem], owners: List[torch.Tensor],
                  groups: List[Dict[str, Any]]) -> Optional[StepPlan]:
        """The plan of this step's items, kept for the next steps (None where the long way is
        kept: streams numbered by a ZeroRedundancyOptimizer, a tensor setting, a gradient in
        another layout than its param's). DTensor params (FSDP2, ...) get a
        :class:`~mpext.optim._shard_plan.ShardedStepPlan`, which keeps their local views and
        8-bit shard split too."""
        self._plan = None
        if getattr(self, "_sr_stream_index", None) is not None:
            return None
        sharded = any(is_dtensor(p) or is_dtensor(p.grad) for p in owners)
        keys = tuple(k for k in dict.fromkeys(tuple(self.defaults) + self._READ_SETTINGS
                                              + self._moment_settings())
                     if k not in ("lr", "params"))
        info = []
        for group in self.param_groups:
            settings = self._settings(group, keys)
            if settings is None:
                return None
            info.append((group, group["params"], tuple(group["params"]), settings))
        idle = [p for g in self.param_groups for p in g["params"] if p.grad is None]
        plan = (ShardedStepPlan if sharded else StepPlan).build(items, owners, groups, idle,
                                                               self._lr_tensors)
        if plan is None:
            return None
        plan.owner = weakref.ref(self)  # no cycle: del frees the state
        plan.keys, plan.info = keys, info
        plan.state, plan.groups = self.state, self.param_groups
        self._plan = plan
        return plan

    def _long_items(self) -> List[StepItem]:
        """The items of a whole step the long way, the plan dropped (a call it made was
        refused)."""
        self._plan = None
        return self._checked_items(None)[0]

    def _ready_plan(self) -> Optional[StepPlan]:
        """The cached plan with this step's gradients, or None (dropped) when it no longer
        holds: the state or the groups replaced (load_state_dict, add_param_group), streams
        numbered by a ZeroRedundancyOptimizer since (use_global_sr_streams), a group's
        params or settings changed (any key its checks or hyperparameters read; lr is checked
        here at every step and read by the launch), or a param's gradient, dtype or state
        changed (StepPlan.refresh)."""
        plan = self._plan
        if plan is None:
            return None
        groups = self.param_groups
        if self.state is not plan.state or groups is not plan.groups \
                or len(groups) != len(plan.info) \
                or getattr(self, "_sr_stream_index", None) is not None:
            self._plan = None
            return None
        for gi, (group, (planned, params, held, settings)) in enumerate(zip(groups, plan.info)):
            # The list's elements too: a param replaced in place by a new param object.
            if group is not planned or group["params"] is not params \
                    or len(params) != len(held) \
                    or not all(map(operator.is_, params, held)) \
                    or self._settings(group, plan.keys) != settings:
                self._plan = None
                return None
            self._check_lr(group, " (param group %d)" % gi)
        if not plan.refresh(self.state.get):
            self._plan = None
            return None
        return plan

    def _checked_items(self, only: Optional[set]) -> tuple:
        """(items, their params, their groups): the long way of :meth:`_items`."""
        checked = []
        # The param's stochastic-rounding stream: its position in the optimizer, or in the
        # whole model's optimizer where this one steps a partition (use_global_sr_streams).
        index = getattr(self, "_sr_stream_index", None)
        index = None if index is None else index()
        stream = -1
        for gi, group in enumerate(self.param_groups):
            self._check_group(group, " (param group %d)" % gi)
            hyper = self._hyper(group)
            for j, p in enumerate(group["params"]):
                stream += 1
                g = p.grad
                if g is None or (only is not None and id(p) not in only):
                    continue
                pdt, gdt, device = p.dtype, g.dtype, p.device
                if not (g.layout == _STRIDED and (gdt is pdt or gdt is F32)
                        and pdt in PARAM_DTYPES and g.device == device
                        and g.shape == p.shape):
                    self._bad_grad(p, g, j, gi)
                offset = 0
                if is_dtensor(p) or is_dtensor(g):
                    g = self._local_grad(p, g, j, gi)
                    offset = self._shard_offset(p, group, j, gi)
                sr = stream if index is None else self._global_stream(index, p, j, gi)
                checked.append((p, g, group, hyper, sr, offset,
                                "param %d of group %d" % (j, gi)))
        # Every param's state in its group's form, converted on copies: a conversion refused
        # for one param (a master that is not its param's round) leaves every state as it was.
        staged = [self._state_of(p, group, where) for p, _, group, _, _, _, where in checked]
        items = []
        owners, groups = [], []
        for (p, g, group, hyper, stream, offset, _), new in zip(checked, staged):
            owners.append(p)
            groups.append(group)
            state = self.state[p]
            state.clear()
            state.update(new)
            storage = F.stored_value(state)
            items.append(StepItem(local(p), g, state,
                                  None if storage is None else local(storage),
                                  group["lr"], hyper, stream, offset,
                                  self._blocks(p, group) if is_dtensor(p) else None))
        return items, owners, groups

    def _blocks(self, p: torch.Tensor, group: Dict[str, Any]) -> Optional[Any]:
        """Where a DTensor param's blocked moments lie (formats.shard_layout), or None when its
        moments' formats are elementwise."""
        return F.shard_layout(p, group, self._moments_of(group))

    def _draws_bits(self, p: torch.Tensor, group: Dict[str, Any]) -> bool:
        """Whether the step of ``p`` draws stochastic-rounding bits (which depend on its
        elements' positions): a master-free SR param, or a 16-bit or 8-bit moment rounded
        stochastically."""
        if group.get("stochastic_rounding", False) and not group.get("master_weights", True) \
                and p.dtype in LOW_DTYPES:
            return True
        return group.get("moment_rounding", "stochastic") == "stochastic" and F.draws_bits(
            p, group, self._moments_of(group))

    def _shard_offset(self, p: torch.Tensor, group: Dict[str, Any], j: int, gi: int) -> int:
        """The global offset of a DTensor param's local shard (_tensors.shard_offset); a
        placement whose shard is not one run of the whole param is refused where the step
        draws bits by position, and position-free formats take any placement."""
        offset = shard_offset(p)
        if offset is not None:
            return offset
        if not self._draws_bits(p, group):
            return 0
        raise ValueError(
            "%s: param %d of group %d is a DTensor placed as %s on a mesh of shape %s, with "
            "sizes %s and strides %s: stochastic rounding (master-free SR or 16-bit moments) "
            "draws its bits by the element's position in the whole param, which is supported "
            "for Replicate and Shard(0) placements (FSDP2, HSDP) with dim 0 outermost in "
            "memory; use FP32 moments with masters or remainders, or moment_rounding="
            "\"nearest\", for this placement"
            % (self._name(), j, gi, tuple(p.placements), tuple(p.device_mesh.shape),
               tuple(p.shape), tuple(p.stride())))

    def _global_stream(self, index: Dict[torch.Tensor, int], p: torch.Tensor, j: int,
                       gi: int) -> int:
        stream = index.get(p)
        if stream is None:
            raise ValueError("%s: param %d of group %d is not among the params of the "
                             "optimizer that use_global_sr_streams numbers its streams by"
                             % (self._name(), j, gi))
        return stream

    def _local_grad(self, p: torch.Tensor, g: torch.Tensor, j: int, gi: int) -> torch.Tensor:
        """The local shard of a DTensor param's gradient, which must be a DTensor sharded as
        the param is (what FSDP2 and DTensor's autograd produce)."""
        where = "param %d of group %d" % (j, gi)
        if not (is_dtensor(p) and is_dtensor(g)):
            raise TypeError("%s: %s is a %s but its gradient is a %s; a DTensor param needs a "
                            "DTensor gradient and a plain param a plain one"
                            % (self._name(), where, type(p).__name__, type(g).__name__))
        if g.device_mesh != p.device_mesh or tuple(g.placements) != tuple(p.placements):
            raise ValueError("%s: the gradient of %s is placed as %s on %s but the param as %s "
                             "on %s; redistribute the gradient to the param's placements"
                             % (self._name(), where, tuple(g.placements), g.device_mesh,
                                tuple(p.placements), p.device_mesh))
        gl = local(g)
        if gl.shape != local(p).shape:
            raise ValueError("%s: the local shard of the gradient of %s has shape %s but the "
                             "param's has %s" % (self._name(), where, tuple(gl.shape),
                                                 tuple(local(p).shape)))
        return gl

    def _needs_torch(self, p: torch.Tensor, group: Dict[str, Any]) -> bool:
        """Whether torch's implementation of the rule steps ``p`` now."""
        if self._torch_group(group) or p.dtype in self._TORCH_DTYPES:
            return True
        if not self._TORCH_SPARSE:
            return False
        g = p.grad
        return (g is not None and g.layout != _STRIDED) or self._torch_state(
            p, self.state.get(p) or {})

    def _torch_part(self) -> Optional[Tuple[set, List[tuple]]]:
        """(ids of the params with gradients the fused step takes, [(group, params, grads)] of
        those torch's implementation steps), or None when torch's steps none (the fused step
        then takes every param, through its cached plan). Sorts params only where a torch-path
        param was seen or a group asks for it."""
        groups = self.param_groups
        if not self._torch_seen and not any(self._torch_group(g) for g in groups):
            return None
        fused, torch_part = set(), []
        for gi, group in enumerate(groups):
            params = []
            for j, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if self._needs_torch(p, group):
                    # a group edited since (amsgrad set on BF16 params with masters, say)
                    where = "%s: param %d of group %d" % (self._name(), j, gi)
                    self._check_torch_param(p, group, where)
                    self._check_torch_grad(p, p.grad, group, where)
                    params.append(p)
                else:
                    fused.add(id(p))
            if params:
                torch_part.append((group, params, [p.grad for p in params]))
        return (fused, torch_part) if torch_part else None

    def _run_torch(self, part: List[tuple], inv_scale: Optional[torch.Tensor],
                   found_inf: Optional[torch.Tensor]) -> None:
        """Steps the torch-path params of ``part`` (see :meth:`_torch_part`). With a loss scale
        their gradients are unscaled first as GradScaler.unscale_ does for torch's own
        optimizers (a sparse one through its values), and a found inf/NaN skips them, read on
        the host as GradScaler.step does for those optimizers."""
        if found_inf is not None and bool(found_inf.detach().reshape(-1)[0].item()):
            return
        for group, params, grads in part:
            if inv_scale is not None:
                grads = self._unscaled(group, params, grads, inv_scale)
            self._torch_step(group, params, grads)

    def _unscaled(self, group: Dict[str, Any], params: List[torch.Tensor],
                  grads: List[torch.Tensor], inv_scale: torch.Tensor) -> List[torch.Tensor]:
        out = []
        for p, g in zip(params, grads):
            if not group.get("unscale_grads", True):
                g = g.clone()  # .grad stays scaled, as asked
            elif g.layout != _STRIDED and g.dtype is torch.float16:
                g = p.grad = g.coalesce()  # as GradScaler: fp16 duplicates could overflow
            values = g._values() if g.layout != _STRIDED else g
            scratch = torch.zeros(1, dtype=F32, device=values.device)
            torch._amp_foreach_non_finite_check_and_unscale_(
                [values], scratch, inv_scale.to(values.device))
            out.append(g)
        return out

    def _bad_grad(self, p: torch.Tensor, g: torch.Tensor, j: int, gi: int) -> None:
        """Raises the error for a param / gradient pair the kernel cannot take: _TorchPath
        where torch's implementation steps it (step() retries, the param now sorted out)."""
        where = "param %d of group %d" % (j, gi)
        group = self.param_groups[gi]
        if self._needs_torch(p, group):
            self._check_torch_param(p, group, "%s: %s" % (self._name(), where))
            self._torch_seen = True
            raise _TorchPath("%s: %s is stepped by torch.optim's implementation of the rule (a "
                             "%s %s gradient); step() does that, gradient release does not"
                             % (self._name(), where, g.layout, dtype_name(p.dtype)))
        if g.layout != torch.strided:
            raise RuntimeError(
                "%s does not support sparse gradients (%s has a %s gradient); use "
                "torch.optim.SparseAdam for sparse params" % (self._name(), where, g.layout))
        if p.dtype not in PARAM_DTYPES:  # changed in place after construction
            raise TypeError("%s: %s has dtype %s; only float32, bfloat16 and float16 params are "
                            "supported" % (self._name(), where, dtype_name(p.dtype)))
        if g.dtype != p.dtype and g.dtype != torch.float32:
            raise TypeError(
                "%s: the gradient of %s has dtype %s; it must have the param's dtype (%s) or "
                "float32" % (self._name(), where, dtype_name(g.dtype),
                             dtype_name(p.dtype)))
        if g.device != p.device:
            raise ValueError("%s: the gradient of %s is on %s but the param is on %s"
                             % (self._name(), where, g.device, p.device))
        raise ValueError("%s: the gradient of %s has shape %s but the param has shape %s"
                         % (self._name(), where, tuple(g.shape), tuple(p.shape)))

    def _state_of(self, p: torch.Tensor, group: Dict[str, Any], where: str) -> Dict[str, Any]:
        """The param's state as its step needs it, in a new dict (the caller stores it): created
        on its first step (a float32 step on its device, moments in the group's formats and the
        param's layout, the master or remainder its group asks for) and kept in the group's
        form: a group whose settings changed since (or a loaded state) has its state converted
        here, before the step."""
        if not is_dense(p) and not is_dtensor(p) and overlapping(p):
            # refused when added; its .data replaced since (and the plan's op refuses it)
            raise ValueError(overlap_refusal(p, "%s: %s" % (self._name(), where)))
        state = dict(self.state.get(p, {}))
        if len(state) == 0:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            new_moments(p, state, group, self._moments_of(group))
        conform_state(p, state, group, self._moments_of(group),
                      "%s: %s" % (self._name(), where))
        return state

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, *,
             grad_scale: Optional[torch.Tensor] = None,
             found_inf: Optional[torch.Tensor] = None) -> Optional[float]:
        """Performs one optimization step.

        Args:
            closure (callable, optional): re-evaluates the model and returns the loss.
            grad_scale (Tensor, optional): the loss scale the gradients carry; they are
                unscaled inside the kernel (multiplied by ``1 / grad_scale``). Defaults to the
                ``grad_scale`` attribute a GradScaler sets.
            found_inf (Tensor, optional): a one-element flag; when non-zero the step is skipped
                on the device (params, masters, moments and steps unchanged). Defaults to the
                ``found_inf`` attribute a GradScaler sets.
        """
        if self._grad_release is not None:
            raise RuntimeError(self._grad_release.refusal("%s.step()" % self._name()))
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and not isinstance(found_inf, torch.Tensor):
            if found_inf:  # a host-side flag (e.g. a scaler that recorded no inf checks)
                return loss
            found_inf = None

        part = self._torch_part()
        try:
            items = self._items(None if part is None else part[0])
        except _TorchPath:  # a param newly sorted out (nothing was changed): sort again
            part = self._torch_part()
            items = self._items(None if part is None else part[0])
        if not items and part is None:
            return loss
        inv_scale = None
        if grad_scale is not None:
            if isinstance(grad_scale, torch.Tensor):
                # As GradScaler.unscale_ computes it: the reciprocal in double, rounded to fp32.
                inv_scale = grad_scale.detach().double().reciprocal().float()
            else:
                inv_scale = torch.full((), 1.0 / float(grad_scale), dtype=torch.float32)
        if part is not None:
            # torch's part first: what it refuses is refused above (_check_torch_grad), and
            # should it raise anyway, the fused params are not stepped yet (every check of
            # theirs was made by _items, so their launch does not raise after it).
            self._run_torch(part[1], inv_scale, found_inf)
        if items:
            try:
                self._launch(items, inv_scale, found_inf)
            except _TorchPath:
                # A cached plan's op refused a newly sparse gradient before writing anything
                # (the long way then sorted the param out): the step again, sorted. (Only a
                # plan's launch raises it, and a step with a torch part has none.)
                self.step(grad_scale=grad_scale, found_inf=found_inf)
                return loss
        return loss

    # -----------------------------------------------------------------------------------------
    # Gradient release (mpext.optim._release): the step inside the backward pass.

    _grad_release = None  # the GradRelease while one is active

    def release_grads(self, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, scaler=None,
                      max_grad_norm: Optional[float] = None, clip: str = "exact", ddp=None):
        """Steps the params inside every backward pass from now on, as their gradients
        complete, and frees each gradient once stepped (docs/gradient_release.md). Returns the
        :class:`~mpext.optim._release.GradRelease`; its ``remove()`` ends the release.

        Params are stepped in buckets of about ``bucket_bytes`` of gradients (one fused launch
        each); the last, partial bucket when the backward ends. With no clipping and no inf/NaN
        the result has the same bits as ``step()`` after backward. ``step()`` (and so
        ``scaler.step``) is refused meanwhile; ``zero_grad()`` has nothing left to clear;
        gradient accumulation goes through the handle's ``accumulate()``.

        Args:
            bucket_bytes: gradient bytes per launch (default 4 MiB; 0: one launch per param).
            scaler: an ``mpext.GradScaler`` whose scale the loss carries: each bucket is
                unscaled in the kernel and checked for inf/NaN on the device; from the first
                bucket with one, that bucket and every later one of the backward change
                nothing, and the step is recorded as skipped (``scaler.update()`` backs off).
            max_grad_norm: clip the gradients' global (unscaled) norm to this.
            clip: "exact" (default): the norm is computed in a first backward pass, so every
                step goes through ``release.backward(loss)``; "previous": one pass, clipping
                with the previous step's global norm (the first step is not clipped).
            ddp: the ``DistributedDataParallel`` module of the params, when there is one: the
                params are then stepped from DDP's comm hook, after each bucket's all-reduce
                (the averaged gradient). FSDP2's sharded params need nothing: FSDP2 runs the
                release's hooks after its reduce-scatter.
        """
        if self._torch_seen or any(self._torch_group(g) for g in self.param_groups):
            raise ValueError("%s.release_grads: some params are stepped by torch.optim's "
                             "implementation of the rule (%s), which gradient release does not "
                             "do; see docs/dropin.md" % (self._name(), self._torch_reasons()))
        return GradRelease(self, bucket_bytes=bucket_bytes, scaler=scaler,
                           max_grad_norm=max_grad_norm, clip=clip, ddp=ddp)

    # -----------------------------------------------------------------------------------------
    # The FP32 values: masters and EMA.

    def reset_masters(self) -> None:
        """Re-makes every FP32 master from its (low-precision) param (a remainder becomes 0:
        the master is the param), e.g. after the model's params were loaded or changed outside
        the optimizer."""
        self._plan = None
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    fmt = F.stored_param_format(self.state.get(p) or {})
                    if fmt is not None:
                        fmt.reset(p, self.state[p])

    def ema_param(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """A copy of the FP32 EMA kept for ``param`` (see ``ema_decay``), or None when its
        group keeps none or it has not been stepped yet."""
        ema = (self.state.get(param) or {}).get("ema_param")
        return None if ema is None else ema.detach().clone()

    @contextlib.contextmanager
    def ema_weights(self):
        """A context in which every param that has an EMA holds it (rounded to the param's
        dtype to nearest even, as ``param.copy_(ema)``), for evaluation::

            with opt.ema_weights():
                evaluate(model)

        On exit each param gets back its exact value (masters and remainders stay valid). Do
        not step the optimizer inside. Raises ``RuntimeError`` if no param group keeps an EMA.
        Params whose EMA does not exist yet (never stepped) are left as they are."""
        if all(g.get("ema_decay") is None for g in self.param_groups):
            raise RuntimeError("%s.ema_weights: no param group keeps an EMA; construct the "
                               "optimizer with ema_decay=..." % self._name())
        with ema_swapped(self, [(p, p) for g in self.param_groups for p in g["params"]]):
            yield self

    def master_param(self, param: torch.Tensor) -> torch.Tensor:
        """The FP32 value the optimizer holds for ``param``: a copy of its master, its master
        rebuilt from the param and its remainder, or (no master, or an FP32 param, or no state
        yet) the param widened to FP32."""
        state = self.state.get(param) or {}
        with torch.no_grad():
            return F.fp32_value(param, state)

    # -----------------------------------------------------------------------------------------
    # state_dict: torch's, in values every client can carry.

    def state_dict(self) -> Dict[str, Any]:
        """torch's ``state_dict``, with two changes that let torch's gather of full state
        dicts (``get_optimizer_state_dict(..., full_state_dict=True)``) and its collectives
        take it: the moment formats of the param groups are named by string ("float32",
        "bfloat16", "int8", "uint8"; ``load_state_dict`` and the groups take either), and the
        int16 ``param_remainder`` of a DTensor param is given as an int32 DTensor of the same
        values (gloo and NCCL have no int16; any loader's cast back to int16 is exact). The 8-bit
        scales of a DTensor param, kept per shard, are given whole, as a Replicate DTensor of
        every block's scale (so DCP reshards them with the codes; a collective over the shard
        group: every rank calls ``state_dict()``, as ``get_optimizer_state_dict`` does)."""
        sd = super().state_dict()
        for group in sd["param_groups"]:
            for key in self._moment_settings():
                if isinstance(group.get(key), torch.dtype) and group[key] in F.DTYPE_NAMES:
                    group[key] = F.DTYPE_NAMES[group[key]]
        state = sd["state"]
        # torch numbers the params in group order from 0 (the keys of sd["state"])
        params = [(p, g) for g in self.param_groups for p in g["params"]]
        for k, st in state.items():
            if not (isinstance(st, dict) and isinstance(k, int) and k < len(params)
                    and is_dtensor(params[k][0])):
                continue
            p, group = params[k]
            mine = st
            st = state[k] = dict(st)  # the optimizer's own dict stays as it is
            fmt = F.stored_param_format(mine)
            if fmt is not None:
                fmt.export(p, mine, st)
            for q in self._moments_of(group):
                fmt = F.held(mine, q.name)
                if fmt is not None:
                    fmt.export(p, mine, st, q, group.get("block_size", 256),
                               "%s.state_dict: param %d" % (self._name(), k))
        return sd

    # -----------------------------------------------------------------------------------------
    # state_dict loading: torch's procedure with mpext's own conversion of each param's state.

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state saved by this class, by another mpext optimizer of the same rule, or
        by torch's optimizer of the rule (``torch.optim.Adam`` / ``torch.optim.AdamW``).

        The storage settings -- ``master_weights``, ``param_remainders``,
        ``stochastic_rounding``, the moment formats (``exp_avg_dtype``, ``exp_avg_sq_dtype``),
        ``block_size`` -- are this optimizer's, and the loaded state is converted into
        them (so a checkpoint with FP32 masters resumes with remainders, say); every other
        group setting (lr, betas, ..., ``seed``, ``moment_rounding``, ``ema_decay``) comes from
        ``state_dict``, as in torch (a ``UserWarning`` names each of those three that differs
        from this optimizer's). Moments are converted to the group's formats (FP32 -> BF16 to
        nearest even) and to the param's device and memory layout, ``step`` to a float32 scalar
        tensor on the param's device; a low-precision param's FP32 value comes from the state's
        ``master_param`` or ``param_remainder`` or, when it has neither (a torch checkpoint),
        from the param itself (at the next step) -- a master becomes a remainder only if the
        param is its round to nearest even (load the model first), else a ``ValueError`` says
        so, and a remainder becomes a master at the next step, joined with the param as it is
        then (so the model may be loaded after the optimizer). Every tensor is copied, so the
        loaded state never shares memory with ``state_dict``. For a DTensor param the state
        may hold DTensors (placed otherwise: redistributed) or full tensors of the param's
        global shape (each rank keeps its shard). Everything is checked first: on an error (a
        group or size mismatch, moments whose shape is not the param's, ...)
        nothing is modified.
        """
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result

        groups = self.param_groups
        saved_groups = deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match "
                             "the size of optimizer's group")
        for gi, saved in enumerate(saved_groups):
            self._check_same_rule(saved, state_dict, gi)
        storage = _PARAM_FORMAT_SETTINGS + self._moment_settings() + ("block_size",)
        new_groups = []
        for gi, (group, saved) in enumerate(zip(groups, saved_groups)):
            saved["params"] = group["params"]
            if "param_names" in group and "param_names" not in saved:
                saved["param_names"] = group["param_names"]
            self._fill_defaults(saved)
            for key in storage:  # how the state is kept: this optimizer's choice
                saved[key] = group.get(key, saved[key])
            self._check_group(saved, " (loaded param group %d)" % gi)
            for j, p in enumerate(saved["params"]):
                if self._torch_group(saved) or p.dtype in self._TORCH_DTYPES:
                    self._check_torch_param(p, saved, "%s.load_state_dict: params[%d] (loaded "
                                            "param group %d)" % (self._name(), j, gi))
            new_groups.append(saved)

        id_map = dict(zip(chain.from_iterable(g["params"] for g in state_dict["param_groups"]),
                          chain.from_iterable(g["params"] for g in groups)))
        group_of = {id(p): g for g in new_groups for p in g["params"]}
        new_state: Dict[Any, Dict[str, Any]] = defaultdict(dict)
        for k, v in state_dict["state"].items():
            if k in id_map:
                param = id_map[k]
                new_state[param] = self._import_param_state(param, v, group_of[id(param)], k)
            else:
                new_state[k] = v
        replaced = [(gi, key, group.get(key), saved.get(key))
                    for gi, (group, saved) in enumerate(zip(groups, new_groups))
                    for key in _REPLACED_SETTINGS if group.get(key) != saved.get(key)]
        self.__setstate__({"state": new_state, "param_groups": new_groups})
        for gi, key, mine, theirs in replaced:
            # As in torch the checkpoint's settings win (a resumed run draws and averages as
            # the saved one did), but these change what the optimizer keeps: say so.
            warnings.warn("%s.load_state_dict: param group %d takes the checkpoint's %s=%r "
                          "instead of this optimizer's %r; set param_groups[%d][%r] after "
                          "loading to keep another" % (self._name(), gi, key, theirs, mine,
                                                       gi, key), UserWarning, stacklevel=2)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _takes_torch_state(self, param: torch.Tensor, group: Dict[str, Any],
                           value: Dict[str, Any]) -> bool:
        """Whether a saved state of ``param`` is loaded as torch's (the torch path's)."""
        return self._torch_group(group) or param.dtype in self._TORCH_DTYPES \
            or self._torch_state(param, value)

    def _check_same_rule(self, saved: Dict[str, Any], state_dict: Dict[str, Any],
                         gi: int) -> None:
        """Refuses a checkpoint's param group that is another rule's (told by its
        hyperparameter keys), naming the rule, its keys and this rule's."""
        if not isinstance(saved, dict):
            return
        ids = set(saved.get("params") or ())
        state_keys = sorted({str(k) for pid, st in state_dict.get("state", {}).items()
                             if pid in ids and isinstance(st, dict) for k in st})
        keys = set(saved) | set(state_keys)
        theirs = next((name for name, has, lacks in self._RULE_SIGNATURES
                       if all(k in keys for k in has) and not any(k in keys for k in lacks)),
                      None)
        if theirs == self._RULE or (theirs is None
                                    and all(k in saved for k in self._RULE_KEYS)):
            return
        raise ValueError(
            "%s.load_state_dict: param group %d of the checkpoint is %s; this optimizer's rule "
            "is %s. The checkpoint's group has the hyperparameters %s and its params' state "
            "the keys %s; %s expects the hyperparameters %s. Nothing was loaded."
            % (self._name(), gi, "another rule's: " + theirs if theirs else
               "not one of a rule mpext knows", self._RULE,
               sorted(k for k in saved if k != "params"), state_keys or "(none)",
               self._name(), list(self._RULE_KEYS)))

    def _import_param_state(self, param: torch.Tensor, value: Any, group: Dict[str, Any],
                            key: Any) -> Dict[str, Any]:
        where = "%s.load_state_dict: the state of param %r" % (self._name(), key)
        if not isinstance(value, dict):
            raise TypeError("%s must be a dict, got %s" % (where, type(value).__name__))
        if len(value) == 0:
            return {}
        if self._takes_torch_state(param, group, value):
            # torch's state, loaded as torch.optim loads it (floating tensors to the param's
            # dtype and device, step as it is), copied
            out = {}
            for k, v in value.items():
                if isinstance(v, torch.Tensor):
                    if k == "step":
                        t = v
                    elif param.is_floating_point():
                        t = v.to(dtype=param.dtype, device=param.device)
                    else:
                        t = v.to(device=param.device)
                    v = t.clone() if t is v else t
                else:
                    v = deepcopy(v)
                out[k] = v
            self._torch_seen = True
            return out
        self._check_saved_state(value, where)
        return import_param_state(param, value, group, self._moments_of(group), where)


def use_global_sr_streams(zero: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Makes the mpext optimizer that ``zero`` (a
    ``torch.distributed.optim.ZeroRedundancyOptimizer``) built for this rank's partition draw
    each param's stochastic-rounding bits from the stream one process would: the param's
    position among all of ``zero``'s params (ZeRO's own global order, ``_param_to_index``,
    which follows params added later too), not its position in the partition. Call it on every
    rank after constructing ``zero``; returns ``zero``. Needed only for formats that round
    stochastically (master-free SR, 16-bit moments); docs/distributed.md."""
    local_opt = getattr(zero, "optim", None)
    if not isinstance(local_opt, FusedOptimizer) or not hasattr(zero, "_param_to_index"):
        raise TypeError("use_global_sr_streams: zero must be a ZeroRedundancyOptimizer whose "
                        "optimizer_class is an mpext.optim optimizer, got %s (optim %s)"
                        % (type(zero).__name__, type(local_opt).__name__))
    ref = weakref.ref(zero)  # the wrapper owns the local optimizer, not the other way round

    def index():
        wrapper = ref()
        if wrapper is None:
            raise RuntimeError("use_global_sr_streams: the ZeroRedundancyOptimizer this "
                               "optimizer numbers its streams by no longer exists")
        return wrapper._param_to_index

    local_opt._sr_stream_index = index
    return zero


@contextlib.contextmanager
def ema_swapped(opt: torch.optim.Optimizer, pairs: Iterable[Tuple[torch.Tensor, torch.Tensor]]):
    """For each (target, param) of ``pairs`` whose param has an EMA in ``opt``'s state: the
    target holds the EMA (``target.copy_(ema)``) inside the context and gets back its exact
    value on exit. ``ema_weights`` of mpext.optim and of MixedPrecisionOptimizer (whose
    targets are the model params of the inner optimizer's masters)."""
    saved = []
    try:
        with torch.no_grad():
            for target, p in pairs:
                ema = (opt.state.get(p) or {}).get("ema_param")
                if ema is not None:
                    saved.append((target, target.detach().clone()))
                    target.copy_(ema)
        yield
    finally:
        with torch.no_grad():
            for target, value in saved:
                target.copy_(value)
