"""mpext.GradScaler: a drop-in replacement for torch.amp.GradScaler (and the older
torch.cuda.amp.GradScaler) built on the mpext loss-scaling ops.

Design: it subclasses ``torch.amp.GradScaler`` and replaces only the two places where the
numerics happen:

* ``_unscale_grads_`` (called by ``unscale_`` and, with an inv_scale of 1, by the fused-optimizer
  path of ``step``): gradients are grouped per device only, and each device's whole list, mixed
  dtypes included, goes to one ``mpext.ops.unscale_`` call (torch issues one call per device and
  dtype). Gradients mpext cannot take (float64, non-dense layouts, a device without an mpext
  kernel) fall back to ``torch._amp_foreach_non_finite_check_and_unscale_``.
* ``update``: the scale rule runs in ``mpext.ops.update_scale_``, which adds the opt-in
  extensions (hysteresis, min/max scale) and keeps the skip statistics on the device.

Everything else (the per-optimizer state machine, ``scale``, ``step`` with its single host sync,
or none for optimizers that set ``_step_supports_amp_scaling``, the getters and setters, the
exceptions for misuse) is torch's own code, so behaviour stays identical as torch evolves; the
methods this class relies on (``_unscale_grads_``, ``_lazy_init_scale_growth_tracker``,
``_check_scale_growth_tracker``, ``_per_optimizer_states``) have had the same contract since
torch 1.6. ``state_dict`` has torch's five keys with torch's types, so checkpoints move both ways;
extra keys appear only when the extra options are used.

Distributed training (docs/distributed.md): DTensor gradients (FSDP2's sharded ones) are unscaled
through their local shards and ``found_inf`` is all-reduced (MAX) over the mesh dimensions they are
not replicated on, as torch's DTensor rule for ``_amp_foreach_non_finite_check_and_unscale_``
does; ``sync_found_inf=True`` adds one all-reduce over a process group for ranks that may
disagree otherwise.
"""
import math
import numbers
import sys
import warnings
from collections import defaultdict
from typing import Any, Dict, List, Optional, Union

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from .. import ops as _mp_ops
from .._common import dtensor_type, has_kernel
from ._checks import check_rule_args, checked_state_dict
from ._flags import all_reduce_max, check_process_group, combine, dist
from ._flags import note_mesh
from ._overflow_watch import OverflowWatch
from ._unscale import PerDevice, unscale_device

__all__ = ["GradScaler"]

class _Default(float):
    """A float default that can be told apart from the same value passed by the caller."""
    __slots__ = ()


class _DefaultInt(int):
    __slots__ = ()


_INIT_SCALE = _Default(2.0 ** 16)
_GROWTH_FACTOR = _Default(2.0)
_BACKOFF_FACTOR = _Default(0.5)
_GROWTH_INTERVAL = _DefaultInt(2000)
_DEFAULTS = (_INIT_SCALE, _GROWTH_FACTOR, _BACKOFF_FACTOR, _GROWTH_INTERVAL)


def _plain(v):
    """Our sentinel defaults as the plain float / int torch stores."""
    if v is _GROWTH_INTERVAL:
        return int(v)
    if any(v is d for d in _DEFAULTS):
        return float(v)
    return v


class GradScaler(OverflowWatch, torch.amp.GradScaler):
    """Dynamic loss scaling, a drop-in for ``torch.amp.GradScaler``.

    Same constructor, defaults, methods, exceptions and ``state_dict`` as the installed torch's
    ``torch.amp.GradScaler`` (switch by changing the import); the unscale is one fused
    ``mpext.ops.unscale_`` pass per device over all gradients (fp32, fp16 and bf16 mixed) and the
    scale update is ``mpext.ops.update_scale_`` on the device. By default every decision, scale
    and gradient is bit-identical to torch's.

    ``torch.cuda.amp.GradScaler`` users can switch too: ``device`` defaults to ``"cuda"``, and a
    number given as the first positional argument is taken as ``init_scale`` (the old
    signature ``GradScaler(init_scale, growth_factor, backoff_factor, growth_interval,
    enabled)``).

    Opt-in extensions (keyword-only; the defaults keep exact parity with torch):

    Args:
        hysteresis (int): back off only after this many consecutive overflowing steps (a clean
            step refills the tolerance); 1 (default) backs off on every overflow, as torch does.
            Overflowing steps are skipped either way.
        min_scale (float, optional): a back-off never takes the scale below this. Without it
            the scale still never falls below the smallest normal float32 (2^-126), where
            torch's rule would go on to subnormals and 0 and make 1/scale infinite; more than
            140 consecutive overflowing steps (from 2^16) are needed to get there.
        max_scale (float, optional): growth never takes the scale above this.
        bf16_check_only (bool): for BF16 mixed precision, whose gradients need no loss scaling:
            the scale is held at 1.0 (``scale()`` multiplies by 1, ``update()`` never changes
            it), so unscaling is a read-only inf/NaN check (inv_scale 1: gradients are read,
            never written) and overflowing steps are still skipped and counted. A float16
            gradient raises ``ValueError`` in this mode.
        warn_consecutive_overflows (int, optional): warn (once) when this many consecutive
            steps overflowed (default ``None``: off, as in torch; 10 is a good value), and,
            with ``min_scale``, when a step overflows although the scale already sits at
            ``min_scale``: backing off further cannot help, so the inf/NaN comes from the
            model, not from scaling. The check
            never synchronises: it reads a host copy of the counters made asynchronously by the
            previous ``update()`` (on CPU it reads them at once).

    Distributed training (keyword-only):

    Args:
        sync_found_inf (bool): all-reduce (MAX) the inf/NaN flag over ``process_group`` after
            every unscale, so that all ranks skip the same steps and keep the same scale even
            when their gradients can differ (gradients changed after DDP's all-reduce, a model
            part that is not data-parallel, ...). Under plain DDP the gradients are already
            all-reduced and the default (False) suffices. DTensor gradients (FSDP2) need no
            option: their flag is always reduced over the mesh dimensions they are sharded on.
            A rank without gradients still takes part in every reduction.
        process_group (ProcessGroup, optional): the group for ``sync_found_inf`` (default: the
            default process group). Not saved by ``state_dict`` or pickling (see
            :attr:`process_group`).

    Skip reporting (no host sync): :meth:`last_step_skipped` (a bool tensor on the scale's
    device), :meth:`skipped_steps` (the running count as a device tensor) and
    :meth:`get_skipped_steps` (the same as a Python int, which synchronises).
    """

    # Defaults for scalers pickled before these options existed.
    _sync_found_inf = False
    _process_group = None
    _process_group_dropped = False

    def __init__(self, device: str = "cuda", init_scale: float = _INIT_SCALE,
                 growth_factor: float = _GROWTH_FACTOR, backoff_factor: float = _BACKOFF_FACTOR,
                 growth_interval: int = _GROWTH_INTERVAL, enabled: bool = True, *,
                 hysteresis: int = 1, min_scale: Optional[float] = None,
                 max_scale: Optional[float] = None, bf16_check_only: bool = False,
                 warn_consecutive_overflows: Optional[int] = None,
                 sync_found_inf: bool = False, process_group=None) -> None:
        if isinstance(device, numbers.Real) and not isinstance(device, bool):
            # torch.cuda.amp.GradScaler(init_scale, growth_factor, ...): shift the arguments
            # given positionally (those before the first untouched default) one place right.
            slots = [device, init_scale, growth_factor, backoff_factor, growth_interval]
            positional = 1
            while positional < len(slots) and not any(slots[positional] is d for d in _DEFAULTS):
                positional += 1
            targets = [init_scale, growth_factor, backoff_factor, growth_interval, enabled]
            for i in range(positional):
                targets[i] = slots[i]
            init_scale, growth_factor, backoff_factor, growth_interval, enabled = targets
            device = "cuda"
        init_scale, growth_factor, backoff_factor, growth_interval = (
            _plain(init_scale), _plain(growth_factor), _plain(backoff_factor),
            _plain(growth_interval))

        check_rule_args("mpext.GradScaler", init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval)
        if isinstance(hysteresis, bool) or not isinstance(hysteresis, numbers.Integral) \
                or not 1 <= hysteresis < 2 ** 31:
            raise ValueError("mpext.GradScaler: hysteresis must be an int in [1, 2^31), got %r"
                             % (hysteresis,))
        for name, v in (("min_scale", min_scale), ("max_scale", max_scale)):
            if v is not None and not (isinstance(v, numbers.Real) and math.isfinite(v)
                                      and v > 0):
                raise ValueError("mpext.GradScaler: %s must be None or a finite number > 0, got "
                                 "%r" % (name, v))
        if min_scale is not None and max_scale is not None and min_scale > max_scale:
            raise ValueError("mpext.GradScaler: min_scale (%r) must not exceed max_scale (%r)"
                             % (min_scale, max_scale))
        if warn_consecutive_overflows is not None and (
                isinstance(warn_consecutive_overflows, bool)
                or not isinstance(warn_consecutive_overflows, numbers.Integral)
                or warn_consecutive_overflows < 1):
            raise ValueError("mpext.GradScaler: warn_consecutive_overflows must be None or an "
                             "int >= 1, got %r" % (warn_consecutive_overflows,))

        if not isinstance(sync_found_inf, bool):
            raise TypeError("mpext.GradScaler: sync_found_inf must be a bool, got %r"
                            % (sync_found_inf,))
        check_process_group(process_group, "mpext.GradScaler: process_group")

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                             backoff_factor=backoff_factor, growth_interval=growth_interval,
                             enabled=enabled)
        for w in caught:  # e.g. "... CUDA is not available. Disabling.": point at the caller
            warnings.warn(w.message, w.category, stacklevel=2)

        self._hysteresis = int(hysteresis)
        self._min_scale = None if min_scale is None else float(min_scale)
        self._max_scale = None if max_scale is None else float(max_scale)
        self._bf16_check_only = bool(bf16_check_only)
        self._warn_after = warn_consecutive_overflows
        # Device state beside torch's _scale / _growth_tracker, created with them (lazily).
        self._hysteresis_tracker: Optional[torch.Tensor] = None
        self._init_hysteresis_tracker = self._hysteresis
        self._stats: Optional[torch.Tensor] = None  # int64 [skipped steps, overflow streak]
        self._init_stats = (0, 0)
        # Skip reporting: the found_inf of the last update(), and each optimizer's latest state.
        self._last_found_inf: Optional[torch.Tensor] = None
        self._stepped_states: Dict[int, Dict[str, Any]] = {}
        self._stepped_since_update: List[int] = []
        # The overflow warning: a host snapshot in flight, and whether we warned already.
        self._watch_pending: Optional[tuple] = None
        self._watch_buffers: Optional[tuple] = None
        self._warned = False
        if self._enabled and self._bf16_check_only:
            self._init_scale = 1.0
        self._sync_found_inf = sync_found_inf
        self._process_group = process_group
        self._process_group_dropped = False  # set on unpickling a scaler that had a group

    @property
    def process_group(self):
        """The process group ``sync_found_inf`` reduces over (None: the default group). It is
        not pickled: a scaler unpickled from one that had a group refuses to reduce until it is
        set again."""
        return self._process_group

    @process_group.setter
    def process_group(self, group) -> None:
        check_process_group(group, "mpext.GradScaler.process_group")
        self._process_group = group
        self._process_group_dropped = False

    # -----------------------------------------------------------------------------------------
    # Device state.

    def _uses_extras(self) -> bool:
        return (self._hysteresis > 1 or self._min_scale is not None
                or self._max_scale is not None or self._bf16_check_only)

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._init_extra_state(dev)

    def _init_extra_state(self, dev: torch.device) -> None:
        self._stats = torch.tensor(list(self._init_stats), dtype=torch.int64, device=dev)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker,
                                              dtype=torch.int32, device=dev)

    def _scale_on(self, dev: torch.device) -> torch.Tensor:
        """The scale tensor, made on ``dev`` if there is none yet. For mpext's own wrappers
        (``MixedPrecisionOptimizer``), which keep their scale in a GradScaler."""
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(dev)
        return self._scale

    # -----------------------------------------------------------------------------------------
    # Released steps: gradient release (mpext.optim's release_grads) steps inside backward,
    # not through step(); these are its public hooks into the scaler.

    @property
    def bf16_check_only(self) -> bool:
        """Whether the scale is held at 1 (``bf16_check_only=True``): the loss is not
        multiplied, and unscaling is a read-only inf/NaN check."""
        return self._bf16_check_only

    def release_scale(self, device: Union[torch.device, str],
                      where: str = "mpext.GradScaler.release_scale") -> torch.Tensor:
        """The scale the gradients of a released backward carry, for the release's check
        before anything is stepped (``where`` names the caller in the error). With
        ``bf16_check_only`` it is 1 whether or not the loss went through ``scale()`` (made on
        ``device`` if there is none yet), so an unscaled loss gets the inf/NaN skip too; a
        scaling scaler whose ``scale()`` was never called cannot have scaled this loss, and is
        refused with the way out (RuntimeError)."""
        if not isinstance(where, str):
            raise TypeError("mpext.GradScaler.release_scale: where must be a str, got %s"
                            % type(where).__name__)
        if self._scale is None:
            if not self._bf16_check_only:
                raise RuntimeError(
                    "%s: the release's mpext.GradScaler has no scale yet (its scale() was never "
                    "called), so this backward's loss was not scaled by it: call "
                    "release.backward(scaler.scale(loss)) (or scaler.scale(loss).backward()); "
                    "BF16 training that needs no scaling can use "
                    "mpext.GradScaler(bf16_check_only=True), which takes an unscaled loss"
                    % where)
            try:
                device = torch.device(device)
            except (TypeError, RuntimeError) as exc:
                raise TypeError("mpext.GradScaler.release_scale: device must be a torch.device "
                                "or a device string, got %r (%s)" % (device, exc)) from None
            self._lazy_init_scale_growth_tracker(device)
        return self._scale

    def record_released_step(self, optimizer: torch.optim.Optimizer,
                             found_inf: torch.Tensor) -> None:
        """Records a step ``optimizer`` made itself inside backward (gradient release) with
        this backward's ``found_inf`` (a one-element tensor, non-zero when the step was
        skipped), as ``step()`` records one, so that ``update()`` and
        :meth:`last_step_skipped` see it. A no-op when the scaler is disabled."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("mpext.GradScaler.record_released_step: optimizer must be a "
                            "torch.optim.Optimizer, got %s" % type(optimizer).__name__)
        if not (isinstance(found_inf, torch.Tensor) and found_inf.numel() == 1):
            raise TypeError("mpext.GradScaler.record_released_step: found_inf must be a "
                            "one-element tensor, got %s" % (
                                "a tensor of shape %s" % list(found_inf.shape)
                                if isinstance(found_inf, torch.Tensor)
                                else type(found_inf).__name__))
        if not self._enabled:
            return
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = {found_inf.device: found_inf}
        state["stage"] = OptState.STEPPED
        self._stepped_states[id(optimizer)] = state
        self._stepped_since_update.append(id(optimizer))

    # -----------------------------------------------------------------------------------------
    # Unscaling: one fused mpext pass per device.

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool) -> Dict[torch.device,
                                                                           torch.Tensor]:
        per_device_inv_scale = PerDevice(inv_scale)
        per_device_found_inf = PerDevice(found_inf)
        per_device_grads: Dict[torch.device, List[torch.Tensor]] = defaultdict(list)
        # (mesh, dims) of the DTensor params, in the order of the params, so that every rank
        # (the same model on each) runs the same reductions in the same order, also a rank
        # whose gradients are missing or empty.
        mesh_dims: List[tuple] = []
        dtensor = dtensor_type()
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if not isinstance(param, torch.Tensor):
                        raise AssertionError(
                            f"expected param to be torch.Tensor, got {type(param).__name__}")
                    grad = param.grad
                    if dtensor is not None and (isinstance(param, dtensor)
                                                 or isinstance(grad, dtensor)):
                        note_mesh(grad if isinstance(grad, dtensor) else param, mesh_dims)
                    if grad is None:
                        continue
                    if (not allow_fp16) and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if self._bf16_check_only and grad.dtype == torch.float16:
                        raise ValueError(
                            "mpext.GradScaler(bf16_check_only=True) does not scale the loss, "
                            "but a float16 gradient needs loss scaling; use bf16_check_only="
                            "False for float16 training")
                    if grad.is_sparse:
                        # Duplicate indices of an uncoalesced fp16 grad could overflow once
                        # summed: coalesce first so the values checked are the final ones.
                        if grad.dtype is torch.float16:
                            param.grad = grad.coalesce()
                            grad = param.grad
                        grad = grad._values()
                    elif dtensor is not None and isinstance(grad, dtensor):
                        grad = grad.to_local()  # this rank's shard (possibly empty)
                    per_device_grads[grad.device].append(grad)

            for device, grads in per_device_grads.items():
                unscale_device(grads, per_device_found_inf.get(device),
                                per_device_inv_scale.get(device))
            copies = per_device_found_inf.copies
            if mesh_dims or (self._sync_found_inf and self._enabled):
                if not copies:  # no gradients here: take part with a clean flag
                    copies[found_inf.device] = found_inf
                self._reduce_flags(list(copies.values()), mesh_dims)
        return copies

    def _reduce_flags(self, flags: List[torch.Tensor], mesh_dims: List[tuple]) -> None:
        """All-reduces (MAX) this rank's found_inf flags over the sharded mesh dimensions and,
        with sync_found_inf, over the process group: one flag, one collective per group, the
        result written back into every flag (on their devices, without a host sync)."""
        flag = flags[0] if len(flags) == 1 else torch.stack(
            [f.to(flags[0].device, non_blocking=True) for f in flags]).amax()
        for mesh, dims in mesh_dims:
            for d in dims:
                all_reduce_max(flag, mesh.get_group(d))
        self._reduce_found_inf_(flag)
        if len(flags) > 1:
            for f in flags:
                f.copy_(flag, non_blocking=True)

    def _reduce_found_inf_(self, found_inf: torch.Tensor) -> None:
        """All-reduces ``found_inf`` in place (MAX) over the process group when the scaler was
        made with ``sync_found_inf=True`` (a no-op otherwise, and when disabled). Every rank of
        the group must call it the same number of times. No host sync: on an accelerator the
        collective is queued on the device like any other op."""
        if not (self._sync_found_inf and self._enabled):
            return
        if not isinstance(found_inf, torch.Tensor):
            raise TypeError("mpext.GradScaler._reduce_found_inf_: found_inf must be a tensor, "
                            "got %s" % type(found_inf).__name__)
        if self._process_group_dropped:
            raise RuntimeError(
                "mpext.GradScaler(sync_found_inf=True) was unpickled without its process_group "
                "(process groups cannot be pickled): set scaler.process_group before stepping")
        if dist is None or not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "mpext.GradScaler(sync_found_inf=True) needs an initialized process group "
                "(torch.distributed.init_process_group) to reduce found_inf over")
        all_reduce_max(found_inf, self._process_group)

    # -----------------------------------------------------------------------------------------
    # scale / step / update.

    def scale(self, outputs):
        """torch's ``scale``. While an optimizer's gradients are released (``release_grads``),
        a scaled tensor that requires grad is also marked, so that the release refuses its
        backward when made without this scaler (its buckets would step with gradients
        multiplied by the scale) before anything is stepped. Not marked: a disabled scaler,
        ``bf16_check_only=True`` (scale 1), a list or tuple of outputs."""
        scaled = super().scale(outputs)
        if self._enabled and not self._bf16_check_only and isinstance(scaled, torch.Tensor) \
                and scaled.requires_grad:
            release = sys.modules.get("mpext.optim._release")
            if release is not None and len(release._ACTIVE):
                scaled.register_hook(release.scaled_backward_hook(self))
        return scaled

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        release = getattr(optimizer, "_grad_release", None)
        if release is not None:  # before torch's "already called since the last update()"
            raise RuntimeError(release.refusal("scaler.step(optimizer)"))
        retval = super().step(optimizer, *args, **kwargs)
        if self._enabled:
            state = self._per_optimizer_states.get(id(optimizer))
            if state is not None:
                self._stepped_states[id(optimizer)] = state
                self._stepped_since_update.append(id(optimizer))
        return retval

    def update(self, new_scale: Optional[Union[float, torch.Tensor]] = None) -> None:
        """Updates the scale factor, as ``torch.amp.GradScaler.update`` does (see there), with
        the rule of ``mpext.ops.update_scale_``: no host sync, plus the opt-in hysteresis and
        min/max bounds and the skip statistics."""
        if not self._enabled:
            return

        _scale, _growth_tracker = self._check_scale_growth_tracker("update")
        found_infs = [found_inf.to(device=_scale.device, non_blocking=True)
                      for state in self._per_optimizer_states.values()
                      for found_inf in state["found_inf_per_device"].values()]

        if new_scale is not None:
            if isinstance(new_scale, float):
                if not self._bf16_check_only:
                    self._scale.fill_(new_scale)
            else:
                reason = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                          "torch.FloatTensor with requires_grad=False.")
                if new_scale.device.type != self._device:
                    raise AssertionError(reason)
                if new_scale.numel() != 1:
                    raise AssertionError(reason)
                if new_scale.requires_grad is True:
                    raise AssertionError(reason)
                if not self._bf16_check_only:
                    self._scale.copy_(new_scale)
            if found_infs:
                self._last_found_inf = combine(found_infs)
        else:
            if len(found_infs) == 0:
                raise AssertionError("No inf checks were recorded prior to update.")
            self._update_from(combine(found_infs))
            return

        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._stepped_since_update = []

    def _update_from(self, found_inf: torch.Tensor) -> None:
        """The dynamic update after an iteration whose combined inf/NaN flag is ``found_inf``
        (a tensor on any device): the second half of ``update()``, for mpext's own wrappers,
        which compute the flag themselves rather than through the per-optimizer records."""
        _scale, _growth_tracker = self._check_scale_growth_tracker("update")
        found_inf = found_inf.to(device=_scale.device, non_blocking=True)
        if self._stats is None or self._stats.device != _scale.device:
            self._init_extra_state(_scale.device)
        watching = self._watching()
        pre_scale = _scale.clone() if watching and self._min_scale is not None else None
        self._update_rule(_scale, _growth_tracker, found_inf)
        self._last_found_inf = found_inf
        if watching:
            self._watch(pre_scale)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._stepped_since_update = []

    def _update_rule(self, scale: torch.Tensor, growth_tracker: torch.Tensor,
                     found_inf: torch.Tensor) -> None:
        if self._bf16_check_only:  # the scale stays at 1; counters and tracker still advance
            growth_factor, backoff_factor = 1.0, 1.0
        else:
            growth_factor, backoff_factor = self._growth_factor, self._backoff_factor
        if has_kernel("update_scale_", scale.device):
            _mp_ops.update_scale_(
                scale, growth_tracker, found_inf, growth_factor, backoff_factor,
                self._growth_interval,
                hysteresis_tracker=self._hysteresis_tracker if self._hysteresis > 1 else None,
                hysteresis=self._hysteresis,
                min_scale=_SCALE_FLOOR if self._min_scale is None else self._min_scale,
                max_scale=self._max_scale, stats=self._stats)
            return
        # A device mpext has no kernel for: torch's rule, the statistics by tensor ops.
        if self._hysteresis > 1 or self._min_scale is not None or self._max_scale is not None:
            raise RuntimeError(
                "mpext.GradScaler: hysteresis/min_scale/max_scale need mpext's update_scale_ "
                "kernel, which this build of mpext does not have for device type '%s'"
                % scale.device.type)
        torch._amp_update_scale_(scale, growth_tracker, found_inf, growth_factor,
                                 backoff_factor, self._growth_interval)
        overflow = (found_inf != 0).to(torch.int64)
        self._stats[0].add_(overflow)
        self._stats[1].add_(overflow).mul_(overflow)

    # -----------------------------------------------------------------------------------------
    # Skip reporting.

    def last_step_skipped(self, optimizer: Optional[torch.optim.Optimizer] = None
                          ) -> torch.Tensor:
        """Whether the last step was skipped (its gradients had an inf/NaN), as a 0-dim bool
        tensor on the scale's device: no host sync.

        With ``optimizer``: its latest ``step()``. Without: the current iteration (any
        optimizer stepped since the last ``update()`` skipped), or, right after ``update()``,
        the iteration it concluded. False before any step, and always False when disabled.
        """
        if not self._enabled:
            return torch.zeros((), dtype=torch.bool)
        dev = self._scale.device if self._scale is not None else torch.device("cpu")
        if optimizer is not None:
            states = [self._stepped_states.get(id(optimizer))]
        elif self._stepped_since_update:
            states = [self._stepped_states.get(i) for i in self._stepped_since_update]
        else:
            if self._last_found_inf is None:
                return torch.zeros((), dtype=torch.bool, device=dev)
            return self._last_found_inf != 0
        found = [f.to(dev, non_blocking=True) for s in states if s is not None
                 for f in s["found_inf_per_device"].values()]
        if not found:
            return torch.zeros((), dtype=torch.bool, device=dev)
        return combine(found) != 0

    # The skip-flag protocol (mpext/_skip.py): the record of the optimizer's latest step.
    _mpext_skip_flag = last_step_skipped

    def skipped_steps(self) -> torch.Tensor:
        """The number of skipped iterations so far (``update()`` calls that found an inf/NaN)
        as a 0-dim int64 tensor on the scale's device: a snapshot, no host sync."""
        if not self._enabled:
            return torch.zeros((), dtype=torch.int64)
        if self._stats is None:
            return torch.full((), self._init_stats[0], dtype=torch.int64)
        return self._stats[0].clone()

    def get_skipped_steps(self) -> int:
        """The number of skipped iterations so far as a Python int (a host sync)."""
        if not self._enabled:
            return 0
        if self._stats is None:
            return int(self._init_stats[0])
        return int(self._stats[0].item())

    def _consecutive_overflows(self) -> int:
        if not self._enabled:
            return 0
        if self._stats is None:
            return int(self._init_stats[1])
        return int(self._stats[1].item())

    # -----------------------------------------------------------------------------------------
    # state_dict and pickling.

    def state_dict(self) -> Dict[str, Any]:
        """torch's state (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``, with torch's types), so a checkpoint loads into
        either scaler. When the extra options are used it also holds ``hysteresis`` and
        ``_hysteresis_tracker`` (with hysteresis > 1), ``min_scale`` / ``max_scale`` (when set),
        and ``_skipped_steps`` / ``_consecutive_overflows``. Empty when disabled."""
        sd = super().state_dict()
        if self._enabled and self._uses_extras():
            if self._hysteresis > 1:
                sd["hysteresis"] = self._hysteresis
                sd["_hysteresis_tracker"] = (
                    self._init_hysteresis_tracker if self._hysteresis_tracker is None
                    else int(self._hysteresis_tracker.item()))
            if self._min_scale is not None:
                sd["min_scale"] = self._min_scale
            if self._max_scale is not None:
                sd["max_scale"] = self._max_scale
            stats = self._init_stats if self._stats is None else self._stats.tolist()
            sd["_skipped_steps"] = int(stats[0])
            sd["_consecutive_overflows"] = int(stats[1])
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state saved by this class or by ``torch.amp.GradScaler``. Extra keys (see
        :meth:`state_dict`) restore the options and counters they hold; absent ones keep this
        scaler's options and reset its counters. With ``bf16_check_only`` the scale stays 1."""
        if self._enabled and len(state_dict) != 0:
            # Every entry is checked before anything is written: torch's own load writes the
            # scale first and would leave a half-loaded scaler behind a bad later entry.
            extras = checked_state_dict(state_dict, self._hysteresis)
        super().load_state_dict(state_dict)
        if not self._enabled:
            return
        for key in ("hysteresis", "min_scale", "max_scale"):
            if key in extras:
                setattr(self, "_" + key, extras[key])
        self._init_hysteresis_tracker = extras["_hysteresis_tracker"]
        self._init_stats = (extras["_skipped_steps"], extras["_consecutive_overflows"])
        if self._bf16_check_only:
            self._init_scale = 1.0
            if self._scale is not None:
                self._scale.fill_(1.0)
        if self._scale is not None:
            self._init_extra_state(self._scale.device)
        self._warned = False
        self._watch_pending = None

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()  # raises mid-iteration, as torch does
        if self._enabled:
            if self._hysteresis_tracker is not None:
                state["_init_hysteresis_tracker"] = int(self._hysteresis_tracker.item())
            if self._stats is not None:
                state["_init_stats"] = tuple(int(v) for v in self._stats.tolist())
        state["_hysteresis_tracker"] = None
        state["_stats"] = None
        state["_last_found_inf"] = None
        state["_stepped_states"] = {}
        state["_stepped_since_update"] = []
        state["_watch_pending"] = None
        state["_watch_buffers"] = None
        state["_process_group_dropped"] = (self._process_group is not None
                                           or self._process_group_dropped)
        state["_process_group"] = None
        return state


# The lowest scale the default rule backs off to: the smallest normal float32, 2^-126. torch's
# rule goes on halving through the subnormals to 0; from 2^-128 on 1/scale is inf in float32,
# and finite gradients unscaled by it write inf/NaN into the params without any overflow being
# found. Only a run of more than 140 consecutive overflows from 2^16 ever gets here, so every
# scale before that is torch's, value for value.
_SCALE_FLOOR = float(torch.finfo(torch.float32).tiny)


