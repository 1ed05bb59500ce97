"""mpext.MixedPrecisionOptimizer: FP32 master weights, loss scaling and gradient clipping around
any ``torch.optim`` optimizer over BF16/FP16 model params.

How it works (docs/mixed_precision.md has the user-facing account):

* At construction every BF16/FP16 param of the wrapped optimizer gets an FP32 master (one
  multi-tensor ``mpext.ops.cast_``), and the optimizer's ``param_groups`` are pointed at the
  masters, so the inner optimizer -- its state, its math, its ``state_dict`` -- is plain torch in
  FP32. FP32 params (e.g. norms kept in FP32) stay as they are and get no master.
* ``backward(loss)`` backpropagates ``loss * scale``. The model's gradients keep their dtype.
* ``step()`` works on the device from start to end:

  - Fast path (inner optimizer ``torch.optim.Adam``/``AdamW`` or ``mpext.optim.Adam``/``AdamW``,
    no amsgrad): one read-only non-finite check of the gradients
    (``unscale_`` with an inverse scale of 1; skipped when clipping, whose norm already
    propagates NaN/Inf), then the step of mpext.optim's rule (``_engine_rule``: its
    hyperparameters, its state, its launch -- the door mpext.optim's own step goes through), one
    launch per set of hyperparameters that reads the model's gradients, unscales them
    (the clip coefficient folded into the inverse scale), updates the FP32 moments and masters
    and writes the rounded model params, and is skipped on the device when ``found_inf`` is set.
  - Generic path (any other optimizer): the gradients of the masters are made by one
    ``cast_`` pass and unscaled and checked by one ``unscale_`` pass (clip coefficient folded
    in), the inner optimizer steps the masters, and one ``cast_`` pass copies them back into the
    model params. An overflow is skipped on the device when the inner optimizer takes
    ``found_inf`` itself (``_step_supports_amp_scaling``, e.g. ``torch.optim.SGD(fused=True)``)
    and has stepped every param before; otherwise the skip decision reads ``found_inf`` on the
    host once per step, as ``torch.amp.GradScaler.step`` does for such optimizers.
  - The loss scale is an ``mpext.GradScaler`` kept inside (``"dynamic"``: its rule and options;
    a fixed float: ``min_scale == max_scale``; ``None``: ``bf16_check_only``), updated on the
    device from the same ``found_inf``, after ``GradScaler._reduce_found_inf_`` (an all-reduce
    when ``sync_found_inf=True``).
"""
import contextlib
import inspect
import math
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import ops as _mp_ops
from .. import optim as _mp_optim
from ..optim import _engine as _mp_engine, _state as _mp_state
from ..optim._base import FusedOptimizer as _FusedOptimizer, ema_swapped as _ema_swapped
from .._common import LOW_DTYPES as _LOW, PARAM_DTYPES as _PARAM_DTYPES, LrTensors
from .._common import dtype_name as _dtype_name, has_kernel as _has_kernel, is_dense
from .._common import is_real as _is_real, same_layout
from .grad_scaler import GradScaler

__all__ = ["MixedPrecisionOptimizer"]

_NAME = "mpext.MixedPrecisionOptimizer"
# The inner mpext.optim optimizers the fast path takes, and torch's optimizers it steps by an
# mpext.optim rule. The door is the rule's (any rule enters it: tests/test_amp_door.py), but
# only these keep the bits the wrapper has always given; Lion and SGD stay on the generic path
# (their own FP32-param step over the masters): SGD's master format differs from that by an
# ulp here and there (as tests/test_sgd.py allows).
_FAST_RULES = (_mp_optim.Adam, _mp_optim.AdamW)
_TORCH_RULES = {torch.optim.Adam: _mp_optim.Adam, torch.optim.AdamW: _mp_optim.AdamW}
# GradScaler options that only make sense for a dynamic scale, and those the wrapper sets itself.
_DYNAMIC_ONLY = ("init_scale", "growth_factor", "backoff_factor", "growth_interval",
                 "hysteresis", "min_scale", "max_scale")
_RESERVED = ("device", "enabled", "bf16_check_only")
_AUTO = object()


class MixedPrecisionOptimizer(torch.optim.Optimizer):
    """Mixed-precision training around any ``torch.optim`` optimizer built over BF16/FP16 model
    params: FP32 master weights, loss scaling, gradient clipping after unscaling, and steps
    with an inf/NaN gradient skipped.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the model's params (float32, bfloat16 or
            float16, all on one device, each once, dense). Its ``param_groups`` list then
            holds copies of the group dicts with the FP32 masters in place of the BF16/FP16
            params (FP32 params stay), so its state and ``state_dict`` are torch's FP32 ones;
            the dicts it was built from (which may be the caller's) are left as they were.
            State it already holds for a BF16/FP16 param moves to the master, its tensors of
            the param's shape upcast to FP32.
        loss_scale: ``"dynamic"`` (the default when a param is float16): the scale follows the
            dynamic rule of ``mpext.GradScaler`` (torch's by default; ``scaler_options`` such as
            ``init_scale``, ``growth_interval``, ``hysteresis``, ``min_scale``, ``max_scale``
            tune it). A positive float: a fixed scale. ``None`` (the default otherwise): no
            scaling. In every mode a step whose gradients hold an inf/NaN is skipped.
        max_grad_norm: when set, every ``step()`` clips the gradients to this total L2 norm
            (computed on the unscaled gradients), as ``torch.nn.utils.clip_grad_norm_``.
        **scaler_options: keyword arguments of ``mpext.GradScaler`` (not ``device``,
            ``enabled``, ``bf16_check_only``); with a fixed or no scale only those that do not
            shape the scale (e.g. ``warn_consecutive_overflows``, ``sync_found_inf``,
            ``process_group``).

    Raises (before anything is modified): ``TypeError`` for something that is not an
    optimizer, an optimizer already wrapped, a param that is not a float32/bfloat16/float16
    tensor, or an unknown option; ``ValueError`` for params on several devices, a param that
    appears twice, a non-dense param, a bad ``loss_scale``/``max_grad_norm``, or a scaler
    option that does not fit ``loss_scale``. An optimizer that holds FP32 params only is
    wrapped (loss scaling and clipping still work) with a ``UserWarning``, as there are no
    masters to keep.

    The wrapper is a ``torch.optim.Optimizer`` whose ``param_groups``, ``state`` and
    ``defaults`` are the inner optimizer's, so LR schedulers take it directly.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, loss_scale: Any = _AUTO,
                 max_grad_norm: Optional[float] = None, **scaler_options: Any) -> None:
        if isinstance(optimizer, MixedPrecisionOptimizer):
            raise TypeError("%s: optimizer is already a MixedPrecisionOptimizer; wrap the "
                            "torch optimizer only once" % _NAME)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("%s: optimizer must be a torch.optim.Optimizer, got %s"
                            % (_NAME, type(optimizer).__name__))
        params = _check_params(optimizer, optimizer.param_groups, "")
        if not params:
            raise ValueError("%s: optimizer has no params" % _NAME)
        device = params[0][2].device
        has_low = any(p.dtype in _LOW for _, _, p in params)
        has_fp16 = any(p.dtype == torch.float16 for _, _, p in params)
        if loss_scale is _AUTO:
            loss_scale = "dynamic" if has_fp16 else None
        loss_scale = _check_loss_scale(loss_scale)
        max_grad_norm = _check_max_norm(max_grad_norm, "max_grad_norm")
        scaler = _make_scaler(loss_scale, device, scaler_options)
        if has_low and not _has_kernel("cast_", device):
            raise ValueError("%s: the params are on %s, a device this build of mpext has no "
                             "kernels for" % (_NAME, device))
        if not has_low:
            warnings.warn("%s: the optimizer holds FP32 params only, so there are no master "
                          "weights to keep; only loss scaling, the inf/NaN skip and clipping "
                          "apply" % _NAME, UserWarning, stacklevel=2)

        # Everything is checked: from here on the optimizer is modified.
        self.optimizer = optimizer
        self._device = device
        self._loss_scale = loss_scale
        self._max_grad_norm = max_grad_norm
        self._scaler = scaler
        self._use_fused = True  # the fused path where the optimizer allows it
        self._optimizer_step_pre_hooks: Dict[int, Any] = OrderedDict()
        self._optimizer_step_post_hooks: Dict[int, Any] = OrderedDict()
        self._patch_step_function()  # step pre/post hooks, as torch.optim.Optimizer has them
        self._master_of: Dict[int, torch.Tensor] = {}  # id(model param) -> master
        self._model_of: Dict[int, torch.Tensor] = {}   # id(master) -> model param
        self._install_masters(params)
        self._entries: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self._refresh_entries()
        self._watch_backward()
        self._one = torch.ones((), dtype=torch.float32, device=device)
        self._lr_tensors = LrTensors()
        # Fixed for the wrapper's life (the optimizer's class and the device do not change):
        # decided once, so a step never probes the dispatcher.
        self._rule = _engine_rule(optimizer, device)
        self._fused_kernel = self._rule is not None
        self._stepped: set = set()  # ids of the inner params stepped on the generic path
        self._reset_iteration()

    # -----------------------------------------------------------------------------------------
    # The inner optimizer's view, shared.

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """The inner optimizer's param groups (the same list): they hold the FP32 masters of
        the BF16/FP16 params. Changing a hyperparameter here (e.g. an LR scheduler) changes it
        for the inner optimizer."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: List[Dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):
        """The inner optimizer's state, keyed by the masters (and FP32 params)."""
        return self.optimizer.state

    @property
    def defaults(self) -> Dict[str, Any]:
        """The inner optimizer's defaults."""
        return self.optimizer.defaults

    @property
    def loss_scale(self) -> Any:
        """The loss-scale mode: ``"dynamic"``, the fixed scale (a float), or ``None``."""
        return self._loss_scale

    @property
    def max_grad_norm(self) -> Optional[float]:
        """The norm ``step()`` clips to, or ``None``."""
        return self._max_grad_norm

    @property
    def scaler(self) -> GradScaler:
        """The ``mpext.GradScaler`` that holds the scale (its skip counters, e.g.
        ``skipped_steps()``, are live)."""
        return self._scaler

    def _mpext_skip_flag(self, optimizer: Any = None) -> torch.Tensor:
        """Whether the latest step was skipped (see mpext/_skip.py): its own scaler's record of
        the iteration; the wrapper is the optimizer asked about, whatever is passed."""
        return self._scaler.last_step_skipped()

    @property
    def scale(self) -> torch.Tensor:
        """The current loss scale as a 0-dim float32 tensor on the params' device (a
        snapshot; no host sync)."""
        return self._scale_tensor().clone()

    def get_scale(self) -> float:
        """The current loss scale as a Python float (a host sync on an accelerator)."""
        return float(self._scale_tensor().item())

    def master_param(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """The FP32 master of a model param, or ``None`` for an FP32 param (or one not in the
        optimizer)."""
        return self._master_of.get(id(param))

    @contextlib.contextmanager
    def ema_weights(self):
        """With an inner ``mpext.optim.Adam``/``AdamW(..., ema_decay=...)``, which keeps an
        FP32 EMA of the masters in its fused step: a context in which every model param whose
        master has an EMA holds it (rounded to the param's dtype to nearest even), for
        evaluation::

            with opt.ema_weights():
                evaluate(model)

        On exit each param (and each FP32 param, which is its own master) gets back its exact
        value. Do not step inside. Raises ``RuntimeError`` when the inner optimizer keeps no
        EMA (``torch.optim`` optimizers keep none)."""
        inner = self.optimizer
        if not isinstance(inner, _FusedOptimizer) or \
                all(g.get("ema_decay") is None for g in inner.param_groups):
            raise RuntimeError("MixedPrecisionOptimizer.ema_weights: the inner optimizer (%s) "
                               "keeps no EMA; wrap mpext.optim.Adam/AdamW(..., "
                               "ema_decay=...)" % type(inner).__name__)
        with _ema_swapped(inner, self._entries):
            yield self

    # -----------------------------------------------------------------------------------------
    # Construction helpers.

    def _install_masters(self, params: List[Tuple[int, int, torch.Tensor]]) -> None:
        """Makes the FP32 masters of the low-precision params (one cast_ pass) and puts them
        in the param groups in their place."""
        low = [(gi, j, p) for gi, j, p in params if p.dtype in _LOW]
        masters = [torch.empty_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                   for _, _, p in low]
        if low:
            with torch.no_grad():
                _mp_ops.cast_(masters, [p.detach() for _, _, p in low])
        state = self.optimizer.state
        groups = self.optimizer.param_groups
        # The group dicts may belong to the caller (torch keeps the dicts it was given, and e.g.
        # ZeroRedundancyOptimizer keeps its partitions): masters go into copies, so whatever
        # else holds those dicts still sees the model's params.
        for gi in sorted({gi for gi, _, _ in low}):
            groups[gi] = dict(groups[gi], params=list(groups[gi]["params"]))
        for (gi, j, p), m in zip(low, masters):
            groups[gi]["params"][j] = m
            self._master_of[id(p)] = m
            self._model_of[id(m)] = p
            if p in state:  # state made before wrapping (e.g. Adagrad's, made eagerly)
                state[m] = {k: _fp32_state(v, p) for k, v in state.pop(p).items()}

    def _refresh_entries(self) -> None:
        """(model param, inner param) for every param, in the order of the param groups (the
        order of the inner state_dict's indices); the two are one tensor for an FP32 param."""
        self._entries = [(self._model_of.get(id(q), q), q)
                         for group in self.optimizer.param_groups for q in group["params"]]

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Adds a param group of model params (BF16/FP16 ones get masters), checked as in the
        constructor; on an error nothing is modified."""
        if not isinstance(param_group, dict):
            raise TypeError("%s.add_param_group: param_group must be a dict, got %s"
                            % (_NAME, type(param_group).__name__))
        group = dict(param_group)
        ps = group.get("params")
        if isinstance(ps, torch.Tensor):
            ps = [ps]
        elif isinstance(ps, set) or ps is None:
            raise TypeError("%s.add_param_group: params must be an ordered collection of "
                            "tensors" % _NAME)
        group["params"] = list(ps)
        new = _check_params(self.optimizer, [group], ".add_param_group")
        known = {id(t): i for i, pq in enumerate(self._entries) for t in pq}
        for _, j, p in new:
            if id(p) in known:
                raise ValueError("%s.add_param_group: new param %d is the same tensor as param "
                                 "%d (or its master); each param may appear only once"
                                 % (_NAME, j, known[id(p)]))
            if p.device != self._device:
                raise ValueError("%s.add_param_group: params on several devices: new param %d "
                                 "is on %s but the optimizer's params are on %s"
                                 % (_NAME, j, p.device, self._device))
        if any(p.dtype in _LOW for _, _, p in new) and not _has_kernel("cast_", self._device):
            raise ValueError("%s.add_param_group: no mpext kernels for %s" % (_NAME, self._device))
        gi = len(self.optimizer.param_groups)
        self.optimizer.add_param_group(group)  # torch's checks of the group itself
        # The inner optimizer now holds the model params of the new group: swap in masters.
        self._install_masters([(gi, j, p) for _, j, p in new])
        self._refresh_entries()
        self._watch_backward()

    # -----------------------------------------------------------------------------------------
    # The training step.

    def _scale_tensor(self) -> torch.Tensor:
        return self._scaler._scale_on(self._device)

    def _reset_iteration(self) -> None:
        self._found_inf: Optional[torch.Tensor] = None  # set by clipping this iteration
        self._clip_coef: Optional[torch.Tensor] = None
        # Set when a backward pass that did not start at scale_loss's product reached the
        # model's params this iteration (a plain loss.backward(): gradients without the scale).
        self._unscaled_backward = False

    def _watch_backward(self) -> None:
        """With loss scaling: a hook that fires once per backward pass reaching the model's
        params, to tell passes rooted at :meth:`scale_loss`'s product from plain ones.
        Gradients assigned by hand run no hook: they are taken to carry the scale."""
        handle = getattr(self, "_backward_hook", None)
        if handle is not None:
            handle.remove()
        self._backward_hook = None
        self._scaled_depth = 0  # scaled backward passes running now (nested: reentrant checkpoint)
        params = [p for p, _ in self._entries if p.requires_grad]
        if self._loss_scale is None or not params:
            return
        ref = weakref.ref(self)

        def reached_params(_grad: torch.Tensor) -> None:
            opt = ref()
            if opt is not None and opt._scaled_depth == 0:
                opt._unscaled_backward = True

        self._backward_hook = torch.autograd.graph.register_multi_grad_hook(
            params, reached_params, mode="any")

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``: the loss to call ``.backward()`` on, for code that runs the
        backward pass itself (a framework's backward hook, ``torch.autograd.backward``). The
        product is marked, so that ``step()`` knows the gradients carry the scale; with no loss
        scaling ``loss`` is returned as it is. :meth:`backward` is
        ``scale_loss(loss).backward()``."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError("%s.scale_loss: loss must be a tensor, got %s"
                            % (_NAME, type(loss).__name__))
        if self._loss_scale is None:
            return loss
        scaled = loss * self._scale_tensor().to(device=loss.device, non_blocking=True)
        if scaled.requires_grad:
            scaled.register_hook(self._scaled_backward_starts)
        return scaled

    def _scaled_backward_starts(self, grad: torch.Tensor) -> None:
        # The root of a backward pass: its gradients carry the scale until the pass ends
        # (passes nested inside it, e.g. a reentrant checkpoint's, included).
        self._scaled_depth += 1
        torch.autograd.Variable._execution_engine.queue_callback(self._scaled_backward_ends)

    def _scaled_backward_ends(self) -> None:
        self._scaled_depth -= 1

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``scale_loss(loss).backward(**kwargs)``: backpropagates the scaled loss (``loss``
        itself when there is no loss scaling)."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError("%s.backward: loss must be a tensor, got %s"
                            % (_NAME, type(loss).__name__))
        self.scale_loss(loss).backward(**kwargs)

    def release_grads(self, **kwargs: Any) -> None:
        """Refused: a released step (mpext.optim's ``release_grads``) steps the params from
        their gradients inside backward, and this wrapper's inner optimizer holds masters whose
        gradients are copied from the model's only at ``step()``."""
        raise NotImplementedError(
            "%s does not support gradient release: its inner optimizer steps FP32 masters whose "
            "gradients exist only once step() copies them; use an mpext.optim optimizer's "
            "release_grads() on the model params (it keeps the masters itself)" % _NAME)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients of the model params (and of the masters): set to ``None``
        (default) or zeroed."""
        for p, q in self._entries:
            for t in (p, q) if p is not q else (p,):
                if t.grad is None:
                    continue
                if set_to_none:
                    t.grad = None
                else:
                    if t.grad.grad_fn is not None:
                        t.grad.detach_()
                    else:
                        t.grad.requires_grad_(False)
                    t.grad.zero_()
        self._reset_iteration()

    def _with_grads(self, where: str) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """The (model param, inner param) pairs whose model param has a gradient, checked."""
        out = []
        for i, (p, q) in enumerate(self._entries):
            g = p.grad
            if g is None:
                continue
            what = "%s%s: the gradient of param %d" % (_NAME, where, i)
            if g.layout != torch.strided:
                raise RuntimeError("%s is %s; only dense gradients are supported"
                                   % (what, g.layout))
            if g.dtype != p.dtype and g.dtype != torch.float32:
                raise TypeError("%s has dtype %s; it must have the param's dtype (%s) or float32"
                                % (what, _dtype_name(g.dtype),
                                   _dtype_name(p.dtype)))
            if g.shape != p.shape:
                raise ValueError("%s has shape %s but the param has shape %s"
                                 % (what, tuple(g.shape), tuple(p.shape)))
            if g.device != p.device:
                raise ValueError("%s is on %s but the param is on %s" % (what, g.device, p.device))
            out.append((p, q))
        return out

    def _inv_scale(self) -> torch.Tensor:
        """1 / scale as GradScaler.unscale_ computes it (in double, rounded to float32)."""
        return self._scale_tensor().double().reciprocal().float()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clips the gradients of this iteration to the total L2 norm ``max_norm``, measured on
        the unscaled gradients, as ``torch.nn.utils.clip_grad_norm_`` does (coefficient
        ``min(1, max_norm / (norm + 1e-6))``, computed on the device). Returns the total norm
        before clipping (a 0-dim float32 tensor on the device, inf/NaN when a gradient is).

        Call it after ``backward`` and before ``step()``. The gradients are not rewritten: the
        coefficient is folded into the unscaling inside ``step()``, so clipping costs one read
        of the gradients and no host sync. A non-finite norm skips the step like an overflow.
        Called twice, the second call measures the once-clipped gradients, as with torch.
        """
        max_norm = _check_max_norm(max_norm, "max_norm", required=True)
        entries = self._with_grads(".clip_grad_norm_")
        if entries:
            self._check_scaled(".clip_grad_norm_")
        return self._clip(entries, max_norm)

    def _clip(self, entries: List[Tuple[torch.Tensor, torch.Tensor]],
              max_norm: float) -> torch.Tensor:
        inv = self._inv_scale()
        if self._clip_coef is not None:
            inv = inv * self._clip_coef
        if not entries:
            return torch.zeros((), dtype=torch.float32, device=self._device)
        norm = _mp_ops.grad_norm([p.grad for p, _ in entries], inv_scale=inv)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch's expression
        self._clip_coef = coef if self._clip_coef is None else self._clip_coef * coef
        bad = (~torch.isfinite(norm)).to(torch.float32)
        self._found_inf = bad if self._found_inf is None else torch.maximum(self._found_inf, bad)
        return norm

    def _fused_ok(self) -> bool:
        opt = self.optimizer
        if not (self._use_fused and self._fused_kernel):
            return False
        for group in opt.param_groups:
            # a group the rule hands to torch's implementation (Adam's amsgrad)
            if self._rule._torch_group(group) or group.get("differentiable", False):
                return False
            lr = group.get("lr")
            if isinstance(lr, torch.Tensor) and lr.requires_grad:
                return False
        return True

    def _check_scaled(self, where: str) -> None:
        """Refuses gradients that did not come through the loss scale: unscaling them would
        divide them by the scale once too often, a silently wrong update."""
        if self._loss_scale is not None and self._unscaled_backward:
            raise RuntimeError(
                "%s%s: a backward pass that did not go through the loss scale (loss_scale=%r) "
                "wrote gradients this iteration, so unscaling them would shrink the update by "
                "the scale: call "
                "opt.backward(loss), or opt.scale_loss(loss).backward() where a framework runs "
                "the backward pass, instead of loss.backward(); or pass loss_scale=None to "
                "train without loss scaling" % (_NAME, where, self._loss_scale))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One optimizer step on the gradients of this iteration: non-finite check and
        unscaling, clipping (``max_grad_norm``, or a ``clip_grad_norm_`` call before), the
        inner optimizer's update of the FP32 masters, the copy back into the model params
        (round to nearest even), and the loss-scale update.

        ``closure``, as for torch's optimizers, re-evaluates the model: it is called first,
        with gradients enabled, and must run its backward pass through :meth:`backward` or
        :meth:`scale_loss` when there is loss scaling. ``step`` then returns the closure's
        result. Without a closure it returns whether the step was applied, as a 0-dim bool
        tensor on the device: when any gradient holds an inf/NaN nothing is changed (params,
        masters, optimizer state) and the scale backs off.

        With loss scaling, gradients that did not come through the scale (a plain
        ``loss.backward()``) raise a ``RuntimeError`` before anything is changed. No host sync
        on the fast path (torch/mpext Adam/AdamW) or with an inner optimizer that takes
        ``found_inf`` itself (``torch.optim.SGD(fused=True)``, ...); other inner optimizers
        read the inf/NaN flag on the host once, as ``torch.amp.GradScaler.step`` does for them.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        applied = self._step()
        return applied if closure is None else loss

    def _step(self) -> torch.Tensor:
        entries = self._with_grads(".step")
        if entries:
            self._check_scaled(".step")
        device = self._device
        self._scale_tensor()
        if self._max_grad_norm is not None:
            self._clip(entries, self._max_grad_norm)
        clipped = self._found_inf is not None
        found_inf = (self._found_inf if clipped
                     else torch.zeros((), dtype=torch.float32, device=device))
        inv = None
        if self._loss_scale is not None:
            inv = self._inv_scale()
        if self._clip_coef is not None:
            inv = self._clip_coef if inv is None else inv * self._clip_coef
        if entries:
            if self._fused_ok():
                self._step_fused(entries, found_inf, inv, clipped)
            else:
                self._step_generic(entries, found_inf, inv)
            if isinstance(self._loss_scale, float):
                with warnings.catch_warnings():
                    # The scaler's "overflow at min_scale: the model is at fault" warning does
                    # not hold for a scale the user fixed (it may simply be too large).
                    warnings.filterwarnings("ignore", message=".*min_scale",
                                            category=RuntimeWarning)
                    self._scaler._update_from(found_inf)
            else:
                self._scaler._update_from(found_inf)
        self._reset_iteration()
        return found_inf == 0

    def _inner_state(self, q: torch.Tensor, group: Dict[str, Any]) -> Dict[str, Any]:
        """The inner optimizer's state of a param in its rule's layout (torch's keys: ``step``
        and the rule's moments, e.g. ``exp_avg``, ``exp_avg_sq``), created on its first step
        with ``step`` a float32 tensor on the device, as the fused kernel needs (torch's own
        format with ``capturable``/``fused``), and moments in the formats an inner
        ``mpext.optim`` group asks for (bf16 or 8-bit moments; the masters are the inner
        optimizer's fp32 params, so remainders do not apply)."""
        if id(q) in self._model_of:  # a group whose options changed since construction
            _check_inner_storage(self.optimizer, group, _NAME)
        moments = self._rule._moments_of(group)
        state = self.optimizer.state[q]
        if len(state) == 0:
            state["step"] = torch.zeros((), dtype=torch.float32, device=q.device)
            _mp_state.new_moments(q, state, group, moments)
        _mp_state.conform_state(q, state, group, moments, _NAME)
        return state

    def _step_fused(self, entries, found_inf, inv, clipped) -> None:
        if not clipped:  # the norm already carries any inf/NaN; else one read-only check
            _mp_ops.unscale_([p.grad for p, _ in entries], found_inf, self._one)
        self._scaler._reduce_found_inf_(found_inf)
        rule = self._rule
        group_of = {id(q): g for g in self.optimizer.param_groups for q in g["params"]}
        # a param's position in the inner optimizer: its stochastic-rounding stream (bf16 moments)
        stream_of = {id(q): k for k, q in enumerate(
            q for g in self.optimizer.param_groups for q in g["params"])}
        hypers: Dict[int, tuple] = {}
        items = []
        for p, q in entries:
            group = group_of[id(q)]
            hyper = hypers.get(id(group))
            if hyper is None:
                # The model's gradients are left as backward made them (scaled), as on the
                # generic path: no write-back.
                hyper = hypers[id(group)] = rule._hyper(group)._replace(unscale_grads=False)
            items.append(_mp_engine.StepItem(p, p.grad, self._inner_state(q, group),
                                             q if q is not p else None, group["lr"], hyper,
                                             stream_of[id(q)]))
        rule._launch(items, inv, found_inf)

    def _step_generic(self, entries, found_inf, inv) -> None:
        low = [(p, q) for p, q in entries if p is not q]
        dst, src = [], []
        for p, q in low:
            q.grad = torch.empty_like(q)
            g = p.grad
            if same_layout(g, q):
                dst.append(q.grad)
                src.append(g)
            else:
                q.grad.copy_(g)
        if dst:
            _mp_ops.cast_(dst, src)
        try:
            # One pass: the inf/NaN check and the unscale (clip coefficient included) of the
            # FP32 gradients the inner optimizer reads; read-only when inv is 1 or absent.
            _mp_ops.unscale_([q.grad for _, q in entries], found_inf,
                             self._one if inv is None else inv)
            self._scaler._reduce_found_inf_(found_inf)
            opt = self.optimizer
            # An optimizer that takes found_inf skips on the device, but only once every param
            # has been stepped: on a param's first step torch's fused kernels make its state
            # (e.g. fused SGD an uninitialised momentum buffer) before the skip, so that step
            # is decided on the host.
            if getattr(opt, "_step_supports_amp_scaling", False) and all(
                    id(q) in self._stepped for _, q in entries):
                opt.grad_scale = None  # already unscaled
                opt.found_inf = found_inf
                try:
                    opt.step()
                finally:
                    del opt.grad_scale
                    del opt.found_inf
            elif found_inf.item() != 0:  # the one host read of this path
                return
            else:
                opt.step()
                self._stepped.update(id(q) for _, q in entries)
            if low:
                _mp_ops.cast_([p.detach() for p, _ in low], [q for _, q in low])
        finally:
            for _, q in low:
                q.grad = None  # the FP32 gradient copies live only during the step

    # -----------------------------------------------------------------------------------------
    # Masters, state_dict.

    def reset_masters(self) -> None:
        """Re-makes every FP32 master from its model param (e.g. after the model's weights
        were loaded or changed outside the optimizer)."""
        low = [(p, q) for p, q in self._entries if p is not q]
        if low:
            with torch.no_grad():
                _mp_ops.cast_([q for _, q in low], [p.detach() for p, _ in low])

    def state_dict(self) -> Dict[str, Any]:
        """``{"optimizer": the inner optimizer's state_dict (torch's format, its params being
        the masters and FP32 params in group order), "masters": {index: FP32 master} for the
        BF16/FP16 params (indices as in the inner state_dict), "scaler": the GradScaler's
        state_dict, "loss_scale": the mode}``. Tensors are references, as in torch's
        ``Optimizer.state_dict``; reading the scaler state is a host sync."""
        masters = {i: q for i, (p, q) in enumerate(self._entries) if p is not q}
        return {"optimizer": self.optimizer.state_dict(), "masters": masters,
                "scaler": self._scaler.state_dict(), "loss_scale": self._loss_scale}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state saved by :meth:`state_dict`: the inner optimizer's state, the masters
        (copied, then also written into the model params, rounded) and the loss scale, so
        training continues bit for bit. Everything is checked first; on an error (a missing
        key, another loss-scale mode, masters that do not match, a state the inner optimizer
        rejects) nothing is modified."""
        where = "%s.load_state_dict" % _NAME
        if not isinstance(state_dict, dict):
            raise TypeError("%s: state_dict must be a dict, got %s"
                            % (where, type(state_dict).__name__))
        keys = {"optimizer", "masters", "scaler", "loss_scale"}
        if set(state_dict) != keys:
            raise ValueError("%s: state_dict must have the keys %s (a MixedPrecisionOptimizer "
                             "state_dict), got %s" % (where, sorted(keys), sorted(state_dict)))
        saved_mode = state_dict["loss_scale"]
        if saved_mode != self._loss_scale:
            raise ValueError("%s: the state was saved with loss_scale=%r but this optimizer has "
                             "loss_scale=%r" % (where, saved_mode, self._loss_scale))
        masters = state_dict["masters"]
        if not isinstance(masters, dict):
            raise TypeError("%s: masters must be a dict, got %s" % (where, type(masters).__name__))
        want = {i: q for i, (p, q) in enumerate(self._entries) if p is not q}
        if set(masters) != set(want):
            raise ValueError("%s: masters has entries for params %s but this optimizer's "
                             "BF16/FP16 params are %s" % (where, sorted(masters), sorted(want)))
        for i, t in masters.items():
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError("%s: masters[%d] must be a floating-point tensor, got %r"
                                % (where, i, t if not isinstance(t, torch.Tensor) else t.dtype))
            if t.shape != want[i].shape:
                raise ValueError("%s: masters[%d] has shape %s but the param has shape %s"
                                 % (where, i, tuple(t.shape), tuple(want[i].shape)))
        scaler_sd = state_dict["scaler"]
        if not isinstance(scaler_sd, dict) or "scale" not in scaler_sd:
            raise ValueError("%s: scaler must be a GradScaler state_dict (with 'scale'), got %r"
                             % (where, scaler_sd))
        inner = state_dict["optimizer"]
        if not isinstance(inner, dict) or "state" not in inner or "param_groups" not in inner:
            raise ValueError("%s: optimizer must be an optimizer state_dict (with 'state' and "
                             "'param_groups')" % where)
        _check_inner_state_shapes(self.optimizer, inner, where)
        self.optimizer.load_state_dict(inner)  # checks everything before it modifies anything
        self._refresh_entries()
        with torch.no_grad():
            for i, q in want.items():
                q.copy_(masters[i])
        low = [(p, q) for p, q in self._entries if p is not q]
        if low:
            with torch.no_grad():
                _mp_ops.cast_([p.detach() for p, _ in low], [q for _, q in low])
        self._scaler.load_state_dict(scaler_sd)
        self._lr_tensors.clear()
        self._stepped = {id(q) for _, q in self._entries if self.optimizer.state.get(q)}
        self._reset_iteration()

    # -----------------------------------------------------------------------------------------
    # What torch.optim.Optimizer offers and the wrapper routes elsewhere.

    def _no_state_dict_hooks(self, *args: Any, **kwargs: Any):
        raise NotImplementedError("%s: register state_dict hooks on the inner optimizer "
                                  "(.optimizer); its state_dict()/load_state_dict() run them"
                                  % _NAME)

    register_state_dict_pre_hook = _no_state_dict_hooks
    register_state_dict_post_hook = _no_state_dict_hooks
    register_load_state_dict_pre_hook = _no_state_dict_hooks
    register_load_state_dict_post_hook = _no_state_dict_hooks

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        for k in ("_master_of", "_model_of", "_stepped"):  # keyed by id(): rebuilt on load
            del state[k]
        state.pop("_rule", None)  # derived from the inner optimizer: rebuilt on load
        state["_backward_hook"] = None  # a hook handle: registered again on load
        state.pop("step", None)  # an LR scheduler's per-instance wrapper, as torch drops it
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._master_of = {id(p): q for p, q in self._entries if p is not q}
        self._model_of = {id(q): p for p, q in self._entries if p is not q}
        self._stepped = {id(q) for _, q in self._entries if self.optimizer.state.get(q)}
        self._rule = _engine_rule(self.optimizer, self._device)
        self._fused_kernel = self._rule is not None
        self._patch_step_function()
        self._watch_backward()

    def __repr__(self) -> str:
        return "%s(loss_scale=%r, max_grad_norm=%r,\n  %r)" % (
            type(self).__name__, self._loss_scale, self._max_grad_norm, self.optimizer)


# ---------------------------------------------------------------------------------------------
# Argument checks (all raise before anything is modified).


def _check_params(optimizer: torch.optim.Optimizer, groups: List[Dict[str, Any]],
                  where: str) -> List[Tuple[int, int, torch.Tensor]]:
    """(group index, position, param) for every param of ``groups``, checked: a float32,
    bfloat16 or float16 dense tensor, every one on the first one's device, none twice."""
    out = []
    seen: Dict[int, str] = {}
    first = None
    for gi, group in enumerate(groups):
        for j, p in enumerate(group["params"]):
            name = "param %d of group %d" % (j, gi)
            if not isinstance(p, torch.Tensor):
                raise TypeError("%s%s: %s is a %s, not a tensor"
                                % (_NAME, where, name, type(p).__name__))
            if id(p) in seen:
                raise ValueError("%s%s: %s is the same tensor as %s; each param may appear "
                                 "only once" % (_NAME, where, name, seen[id(p)]))
            seen[id(p)] = name
            if p.dtype not in _PARAM_DTYPES:
                raise TypeError("%s%s: %s has dtype %s; only float32, bfloat16 and float16 "
                                "params are supported"
                                % (_NAME, where, name, _dtype_name(p.dtype)))
            if first is None:
                first = (name, p.device)
            elif p.device != first[1]:
                raise ValueError("%s%s: params on several devices: %s is on %s but %s is on %s; "
                                 "wrap one optimizer per device"
                                 % (_NAME, where, name, p.device, first[0], first[1]))
            if p.layout != torch.strided or not is_dense(p):
                raise ValueError("%s%s: %s must be dense and non-overlapping (e.g. contiguous "
                                 "or channels_last); got layout %s, sizes %s, strides %s"
                                 % (_NAME, where, name, p.layout, tuple(p.shape),
                                    tuple(p.stride()) if p.layout == torch.strided else ()))
            out.append((gi, j, p))
        if any(p.dtype in _LOW for p in group["params"]):
            _check_inner_storage(optimizer, group, "%s%s: group %d" % (_NAME, where, gi))
    _check_no_overlap([("param %d of group %d" % (j, gi), p) for gi, j, p in out], where)
    return out


def _engine_rule(optimizer: torch.optim.Optimizer,
                 device: torch.device) -> Optional[_FusedOptimizer]:
    """The mpext.optim optimizer whose rule the fast path steps ``optimizer``'s groups by (its
    ``_hyper``, ``_moments_of``, ``_torch_group`` and ``_launch``: what mpext.optim's own step
    uses): ``optimizer`` itself when it is an mpext.optim one of ``_FAST_RULES``; for
    ``torch.optim.Adam`` /
    ``AdamW``, mpext.optim's optimizer of that rule made over the same params, which holds no
    state and is never stepped itself; None for any other optimizer, or where this build has no
    kernel of the rule for ``device`` (the generic path)."""
    if type(optimizer) in _FAST_RULES:
        return optimizer if _has_kernel(optimizer._op, device) else None
    cls = _TORCH_RULES.get(type(optimizer))
    if cls is None or not _has_kernel(cls._op, device):
        return None
    return cls([q for g in optimizer.param_groups for q in g["params"]])


def _check_inner_storage(optimizer: torch.optim.Optimizer, group: Dict[str, Any],
                         where: str) -> None:
    """Refuses an inner mpext.optim group that asks for its own storage of the fp32 value
    (remainders, or none): the wrapper's masters are the inner optimizer's fp32 params, so
    those options would silently not apply and each param would hold a 4-byte master."""
    if not isinstance(optimizer, _FusedOptimizer):
        return
    asked = [text for key, text, default in (("param_remainders", "param_remainders=True", False),
                                              ("master_weights", "master_weights=False", True))
             if group.get(key, optimizer.defaults.get(key, default)) != default]
    if asked:
        raise ValueError(
            "%s of the inner %s asks for %s, which MixedPrecisionOptimizer cannot honour: it "
            "keeps FP32 masters as the inner optimizer's params (4 bytes per parameter). Use "
            "%s directly on the model's params (with an mpext.GradScaler; in Lightning, "
            "the mpext plugin steps it unwrapped), or drop the option "
            "(BF16 or 8-bit moments and ema_decay are honoured)"
            % (where, type(optimizer).__name__, " and ".join(asked),
               "mpext.optim." + type(optimizer).__name__))


def _check_no_overlap(named: List[Tuple[str, torch.Tensor]], where: str) -> None:
    """Rejects params whose memory overlaps (distinct views of one buffer): the copy back from
    the masters would write the shared elements twice, with different values."""
    spans = []
    for name, p in named:
        if p.numel() == 0:
            continue
        size = p.element_size()
        extent = 1 + sum((n - 1) * st for n, st in zip(p.shape, p.stride()))
        start = p.untyped_storage().data_ptr() + p.storage_offset() * size
        spans.append((start, start + extent * size, name))
    spans.sort(key=lambda t: t[0])
    for (s0, e0, n0), (s1, _, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ValueError("%s%s: %s and %s overlap in memory (views of one tensor); each "
                             "param must have memory of its own" % (_NAME, where, n0, n1))


# State entries of torch's optimizers that hold one value per param element (torch's own
# load_state_dict checks no shapes: a wrong one would only fail, or broadcast, at a later step).
_ELEMENTWISE_STATE = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum",
                      "square_avg", "grad_avg", "acc_delta", "exp_inf", "ax", "prev",
                      "step_size", "mu_product_buffer"}


def _check_inner_state_shapes(optimizer: torch.optim.Optimizer, inner: Dict[str, Any],
                              where: str) -> None:
    params = [q for g in optimizer.param_groups for q in g["params"]]
    state = inner["state"]
    if not isinstance(state, dict):
        raise ValueError("%s: optimizer['state'] must be a dict, got %s"
                         % (where, type(state).__name__))
    for i, entry in state.items():
        if not (isinstance(i, int) and 0 <= i < len(params)) or not isinstance(entry, dict):
            continue  # torch's own load reports these
        for key, v in entry.items():
            if key in _ELEMENTWISE_STATE and isinstance(v, torch.Tensor) and v.dim() > 0 \
                    and v.shape != params[i].shape:
                raise ValueError("%s: optimizer state of param %d: %r has shape %s but the "
                                 "param has shape %s" % (where, i, key, tuple(v.shape),
                                                         tuple(params[i].shape)))


def _fp32_state(v: Any, p: torch.Tensor) -> Any:
    """A state value of a low-precision param, moved to its master: a tensor of the param's
    shape and dtype (a moment, a momentum buffer, ...) becomes an FP32 copy (exact), anything
    else (a step count, a scalar) stays as it is."""
    if isinstance(v, torch.Tensor) and v.dtype == p.dtype and v.shape == p.shape:
        return torch.empty_like(v, dtype=torch.float32,
                                memory_format=torch.preserve_format).copy_(v)
    return v


def _check_loss_scale(loss_scale: Any) -> Any:
    if loss_scale is None or loss_scale == "dynamic":
        return loss_scale
    if _is_real(loss_scale) and math.isfinite(loss_scale) and loss_scale > 0:
        return float(loss_scale)
    raise ValueError("%s: loss_scale must be 'dynamic', a finite number > 0 or None, got %r"
                     % (_NAME, loss_scale))


def _check_max_norm(v: Any, name: str, required: bool = False) -> Optional[float]:
    if v is None and not required:
        return None
    if isinstance(v, torch.Tensor) and v.numel() == 1 and v.device.type == "cpu":
        v = v.item()
    if _is_real(v) and math.isfinite(v) and v > 0:
        return float(v)
    raise ValueError("%s: %s must be a finite number > 0%s, got %r"
                     % (_NAME, name, "" if required else " or None", v))


_SCALER_PARAMS = None


def _make_scaler(loss_scale: Any, device: torch.device,
                 options: Dict[str, Any]) -> GradScaler:
    """The GradScaler that holds the scale: the dynamic rule, a fixed scale (min_scale ==
    max_scale == init_scale, so neither back-off nor growth moves it), or none (bf16_check_only:
    held at 1)."""
    global _SCALER_PARAMS
    if _SCALER_PARAMS is None:
        _SCALER_PARAMS = set(inspect.signature(GradScaler.__init__).parameters) - {"self"}
    for k in options:
        if k in _RESERVED:
            raise TypeError("%s: %s is set by the wrapper and cannot be passed as a scaler "
                            "option" % (_NAME, k))
        if k not in _SCALER_PARAMS:
            raise TypeError("%s: unknown option %r (the options are mpext.GradScaler's: %s)"
                            % (_NAME, k, ", ".join(sorted(_SCALER_PARAMS - set(_RESERVED)))))
        if loss_scale != "dynamic" and k in _DYNAMIC_ONLY:
            raise ValueError("%s: the scaler option %s needs loss_scale='dynamic' (loss_scale "
                             "is %r)" % (_NAME, k, loss_scale))
    opts = dict(options)
    if loss_scale is None:
        opts["bf16_check_only"] = True
    elif loss_scale != "dynamic":
        opts.update(init_scale=loss_scale, min_scale=loss_scale, max_scale=loss_scale)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = GradScaler(device.type, **opts)
    if not scaler.is_enabled():  # e.g. torch's "CUDA is not available. Disabling."
        raise ValueError("%s: cannot keep a loss scale on %s: %s" % (
            _NAME, device, "; ".join(str(w.message) for w in caught) or "GradScaler disabled"))
    for w in caught:
        warnings.warn(w.message, w.category, stacklevel=3)
    return scaler
