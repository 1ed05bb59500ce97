"""Gradient release: the fused step inside the backward pass (docs/gradient_release.md).

``FusedOptimizer.release_grads(...)`` makes a :class:`GradRelease`: a post-accumulate-grad hook
on every param of the optimizer puts the param into a bucket once its gradient is complete
(after every contribution, so a tied weight is bucketed once); a bucket whose gradients reach
``bucket_bytes`` is stepped by the rule's own launch (one fused call per device and set of
hyperparameters, exactly as ``step()`` would make for those params) and its gradients are freed
(``p.grad = None``). The first hook of a backward queues a callback on the autograd engine that
runs when that backward ends: it steps the last, partial bucket and records the step (the
GradScaler's record, the optimizer's step hooks).

Loss scaling (with an ``mpext.GradScaler``), on the device and with no host sync: each backward
has one ``found_inf`` flag, zero at its start; every bucket is checked for inf/NaN into it
(``mpext.ops.unscale_`` with a scale of 1: a read-only check, as the scaler's own check of a
fused optimizer) before its step, which the kernel skips when the flag is set. So the first
bucket with an inf/NaN and every later bucket of that backward change nothing; earlier buckets
keep their update; the scaler's ``update()`` sees the flag (the step is recorded as skipped and
the scale backs off as usual).

Clipping by the global norm: ``clip="exact"`` computes the norm in a first backward pass
(:meth:`GradRelease.backward`, which also checks every gradient for inf/NaN first, so a
skipped step then changes nothing at all) and steps in a second; ``clip="previous"`` clips with
the global norm of the previous backward (one pass). The clip coefficient is folded into the
kernel's gradient multiplier (``inv_scale``), on the device.
"""
import contextlib
import math
import weakref
from typing import Any, Dict, List, Optional

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from .. import ops as _ops
from ._tensors import F32, is_dtensor, local

DEFAULT_BUCKET_BYTES = 4 * 2 ** 20
_CLIP_MODES = ("exact", "previous")


def _task_id() -> int:
    return torch._C._current_graph_task_id()


def _world_size() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _ddp_refusal(name: str, world: int) -> str:
    return ("%s: gradient release is not supported with more than one process (a process group "
            "of %d): under DDP the post-accumulate-grad hooks fire on each rank's local, "
            "unreduced gradient, so each rank would step its own; FSDP2's sharded params are "
            "not supported either (docs/gradient_release.md). The way out: step after backward "
            "(release.remove(), then loss.backward(); opt.step() as usual: DDP has averaged "
            "the gradients by then), sharding the optimizer state with FSDP2 (fully_shard) or "
            "ZeroRedundancyOptimizer if memory is the reason; release works in one process"
            % (name, world))


class GradRelease:
    """The release of an optimizer's gradients inside the backward pass: made by
    ``optimizer.release_grads(...)`` (see there); :meth:`remove` ends it."""

    def __init__(self, optimizer, bucket_bytes: int = DEFAULT_BUCKET_BYTES, scaler=None,
                 max_grad_norm: Optional[float] = None, clip: str = "exact") -> None:
        name = optimizer._name() + ".release_grads"
        if getattr(optimizer, "_grad_release", None) is not None:
            raise RuntimeError("%s: this optimizer's gradients are already released; call "
                               "remove() on the first GradRelease first" % name)
        if not (isinstance(bucket_bytes, int) and not isinstance(bucket_bytes, bool)
                and bucket_bytes >= 0):
            raise ValueError("%s: bucket_bytes must be an int >= 0, got %r" % (name, bucket_bytes))
        if scaler is not None:
            from ..grad_scaler import GradScaler
            if not isinstance(scaler, GradScaler):
                raise TypeError(
                    "%s: scaler must be an mpext.GradScaler, got %s: a released step is made "
                    "inside backward, not by scaler.step(), and only mpext.GradScaler takes the "
                    "record of such a step (for update() and the skip flag)"
                    % (name, type(scaler).__name__))
        if max_grad_norm is not None and not (
                isinstance(max_grad_norm, (int, float)) and not isinstance(max_grad_norm, bool)
                and max_grad_norm > 0 and math.isfinite(max_grad_norm)):
            raise ValueError("%s: max_grad_norm must be None or a finite number > 0, got %r"
                             % (name, max_grad_norm))
        if clip not in _CLIP_MODES:
            raise ValueError("%s: clip must be \"exact\" or \"previous\", got %r" % (name, clip))
        world = _world_size()
        if world > 1:
            raise NotImplementedError(_ddp_refusal(name, world))
        params = []
        for gi, group in enumerate(optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                where = "%s: param %d of group %d" % (name, j, gi)
                if is_dtensor(p):
                    raise NotImplementedError("%s is a DTensor; release is not supported for "
                                              "sharded params (FSDP2)" % where)
                if not p.requires_grad or p.grad_fn is not None:
                    raise ValueError(
                        "%s is not a leaf that requires grad: a released param is stepped only "
                        "when backward computes its gradient, so it would never be (the FP32 "
                        "masters of a MixedPrecisionOptimizer are such params); remove it from "
                        "the optimizer or set requires_grad" % where)
                if p.grad is not None:
                    raise RuntimeError(
                        "%s already has a gradient; release steps each param from the gradient "
                        "of one backward: call zero_grad(set_to_none=True) first" % where)
                params.append(p)
        self._name = name
        self._opt = optimizer  # a released optimizer lives as long as its params' hooks
        self.bucket_bytes = bucket_bytes
        self.scaler = scaler
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.clip = clip
        self._bucket: List[torch.Tensor] = []
        self._pending = 0
        self._task: Optional[int] = None  # the graph task of the open backward, None: none open
        self._token = lambda: None
        self._paused = False       # inside accumulate()
        self._accumulated = False  # accumulate() ran since the last step
        self._last_task = -1
        self._norm_pass = False           # exact clipping: the pass that measures the norm
        self._norm_ready = False          # exact clipping: the norm of this step is known
        self._found: Optional[torch.Tensor] = None
        self._inv_scale: Optional[torch.Tensor] = None
        self._sumsq: Optional[torch.Tensor] = None
        self._norm: Optional[torch.Tensor] = None  # the latest step's global norm (clipping)
        self._mult: Optional[torch.Tensor] = None  # this backward's gradient multiplier
        self._one: Dict[torch.device, torch.Tensor] = {}
        self.buckets_stepped = 0  # counters: buckets launched / backward passes seen
        self.backward_passes = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        optimizer._grad_release = self

    # -----------------------------------------------------------------------------------------
    # The user's side.

    @property
    def optimizer(self):
        return self._opt

    @property
    def last_grad_norm(self) -> Optional[torch.Tensor]:
        """The global gradient norm (unscaled) of the latest step, a 0-dim float32 device
        tensor, when clipping (None before the first, or without ``max_grad_norm``)."""
        return self._norm

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward(**kwargs)``, which steps the params. With ``clip="exact"`` this is how
        a step is made: a first backward (``retain_graph=True``) computes the global norm of the
        gradients, freeing each as soon as it is read, and checks them for inf/NaN; the second
        steps every param with the clipped gradient."""
        if self.max_grad_norm is not None and self.clip == "exact":
            if self._accumulated:
                raise RuntimeError(
                    "%s: clip=\"exact\" cannot follow accumulate(): its norm pass frees the "
                    "accumulated gradients before the pass that steps; use clip=\"previous\""
                    % self._name)
            retain = kwargs.pop("retain_graph", None)
            self._norm_pass = True
            try:
                torch.autograd.backward(loss, retain_graph=True, **kwargs)
            finally:
                self._norm_pass = False
            self._norm_ready = True
            try:
                torch.autograd.backward(loss, retain_graph=retain, **kwargs)
            finally:
                self._norm_ready = False
            return
        loss.backward(**kwargs)

    @contextlib.contextmanager
    def accumulate(self):
        """A context in which backward passes only accumulate the gradients (nothing is
        stepped or freed): gradient accumulation over micro-batches, whose last backward,
        outside the context, steps with the sum (the same bits as accumulating and then
        ``step()``)::

            for x in micro_batches[:-1]:
                with release.accumulate():
                    loss_fn(model(x)).backward()
            loss_fn(model(micro_batches[-1])).backward()   # steps

        The accumulated gradients are alive until that step, as without release."""
        if self._task is not None:
            raise RuntimeError("%s: accumulate() during a backward pass" % self._name)
        self._paused = True
        try:
            yield self
        finally:
            self._paused = False
        self._accumulated = True

    def remove(self) -> None:
        """Ends the release: the hooks go, ``step()`` works again."""
        if self._task is not None:
            raise RuntimeError("%s: remove() during a backward pass" % self._name)
        for h in self._handles:
            h.remove()
        self._handles = []
        opt = self.optimizer
        if opt is not None and getattr(opt, "_grad_release", None) is self:
            opt._grad_release = None

    def refusal(self, what: str) -> str:
        return ("%s is refused while the optimizer's gradients are released: each backward "
                "steps the params as their gradients complete and frees the gradients (to "
                "accumulate over micro-batches, run all but the last backward inside "
                "release.accumulate()); call remove() on the GradRelease to step by hand "
                "again" % what)

    # -----------------------------------------------------------------------------------------
    # The hooks.

    def _check_context(self, p: torch.Tensor) -> None:
        """At the first gradient of each backward, before anything is stepped: more than one
        process (a release made before the process group was). The refused backward's
        gradient is dropped (as a failed backward's, _abandon)."""
        world = _world_size()
        if world > 1:
            p.grad = None
            raise NotImplementedError(_ddp_refusal(self._name, world))

    def _on_grad(self, p: torch.Tensor) -> None:
        if self._paused:
            return
        task = _task_id()
        if self._task is not None and task != self._task and self._token() is None:
            self._abandon()  # the open backward failed: its callback will never run
        if self._task is None:
            self._check_context(p)
            self._begin(task)
        elif task != self._task:
            raise RuntimeError(
                "%s: a second backward pass (graph task %d) reached the params while the step "
                "of another (graph task %d) is not complete: concurrent or nested backward "
                "passes (torch.utils.checkpoint(use_reentrant=True), a backward inside a "
                "backward) are not supported; use use_reentrant=False"
                % (self._name, task, self._task))
        if p.grad is None:
            return
        self._bucket.append(p)
        self._pending += local(p.grad).numel() * p.grad.element_size()
        if self._pending >= self.bucket_bytes:
            self._flush()

    def _abandon(self) -> None:
        """Forgets a backward that raised before its end: the gradients it had not stepped
        yet are dropped (its earlier buckets stay stepped)."""
        for p in self._bucket:
            p.grad = None
        self._bucket, self._pending = [], 0
        self._last_task, self._task = self._task, None

    def _begin(self, task: int) -> None:
        if task < self._last_task:
            # Graph task ids grow: an older one still running encloses the backward that
            # just ended, which had taken the step of this iteration.
            raise RuntimeError(
                "%s: the params' gradients came from nested backward passes (e.g. "
                "torch.utils.checkpoint(use_reentrant=True)), whose inner pass ended the step "
                "early; use use_reentrant=False" % self._name)
        opt = self.optimizer
        clipping = self.max_grad_norm is not None
        if clipping and self.clip == "exact" and not (self._norm_pass or self._norm_ready):
            raise RuntimeError("%s: clip=\"exact\" needs the norm pass: call "
                               "release.backward(loss) instead of loss.backward()" % self._name)
        self._task = task
        self.backward_passes += 1
        # The callback holds the only reference to the token: if the backward fails, the
        # engine drops its callbacks, the token dies, and the next backward knows this one is
        # over (see _on_grad).
        token = _Token()
        self._token = weakref.ref(token)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end(token))
        if self._norm_ready:  # exact clipping's stepping pass: the norm pass set up the step
            self._mult = self._multiplier()
            return
        self._run_pre_hooks(opt)
        device = self._state_device(opt)
        scaler = self.scaler
        if scaler is not None and scaler.is_enabled():
            scale = scaler._check_scale_growth_tracker("release_grads")[0]
            # As FusedOptimizer.step computes it from the grad_scale the scaler hands it.
            self._inv_scale = scale.detach().double().reciprocal().float()
            self._found = torch.zeros((), dtype=F32, device=scale.device)
        else:
            self._inv_scale = self._found = None
        if clipping:
            self._sumsq = torch.zeros((), dtype=torch.float64, device=device)
        if not self._norm_pass:
            self._mult = self._multiplier()

    def _run_pre_hooks(self, opt) -> None:
        """The optimizer's step pre-hooks (global, then its own), when a step begins."""
        for hook in chain_hooks(_global_optimizer_pre_hooks, opt._optimizer_step_pre_hooks):
            if hook(opt, (), {}) is not None:
                raise RuntimeError("%s: an optimizer step pre-hook returned new arguments, "
                                   "which a released step cannot take" % self._name)

    @staticmethod
    def _state_device(opt) -> torch.device:
        for group in opt.param_groups:
            for p in group["params"]:
                return p.device
        return torch.device("cpu")

    def _flush(self) -> None:
        bucket, self._bucket, self._pending = self._bucket, [], 0
        if not bucket:
            return
        with torch.no_grad():
            if self._norm_pass:
                self._add_norm(bucket)
                for p in bucket:
                    p.grad = None
                return
            opt = self.optimizer
            items = opt._items(only={id(p) for p in bucket})
            if self._found is not None:
                self._check_finite(bucket)
            if self.max_grad_norm is not None and self.clip == "previous":
                self._add_norm(bucket)  # the norm that clips the next step
            opt._launch(items, self._mult, self._found)
            self.buckets_stepped += 1
            for p in bucket:
                p.grad = None

    def _by_device(self, bucket: List[torch.Tensor]) -> Dict[torch.device, List[torch.Tensor]]:
        out: Dict[torch.device, List[torch.Tensor]] = {}
        for p in bucket:
            out.setdefault(p.grad.device, []).append(local(p.grad))
        return out

    def _one_on(self, device: torch.device) -> torch.Tensor:
        one = self._one.get(device)
        if one is None:
            one = self._one[device] = torch.ones((), dtype=F32, device=device)
        return one

    def _check_finite(self, bucket: List[torch.Tensor]) -> None:
        """Sets this backward's found_inf if a gradient of the bucket holds an inf/NaN (a
        read-only pass; the flag stays set for the rest of the backward)."""
        found = self._found
        for device, grads in self._by_device(bucket).items():
            flag = found if found.device == device else found.to(device)
            _ops.unscale_(grads, flag, self._one_on(device))
            if flag is not found:
                torch.maximum(found, flag.to(found.device), out=found)

    def _add_norm(self, bucket: List[torch.Tensor]) -> None:
        """Adds the bucket's squared (unscaled) norm to this backward's sum."""
        for device, grads in self._by_device(bucket).items():
            inv = None if self._inv_scale is None else self._inv_scale.to(device)
            n = _ops.grad_norm(grads, inv_scale=inv).to(self._sumsq.device, torch.float64)
            self._sumsq.add_(n * n)

    def _multiplier(self) -> Optional[torch.Tensor]:
        """The kernel's gradient multiplier for this backward's buckets: 1/scale, times the
        clip coefficient (made once per backward, on the device)."""
        if self.max_grad_norm is None or self._norm is None:  # "previous" has none at first
            return self._inv_scale
        # torch.nn.utils.clip_grad_norm_'s coefficient
        coef = (self.max_grad_norm / (self._norm.to(F32) + 1e-6)).clamp(max=1.0)
        return coef if self._inv_scale is None else self._inv_scale * coef.to(
            self._inv_scale.device)

    def _end(self, token: "_Token") -> None:
        """The end of a backward pass: the last bucket, then the step's records."""
        try:
            if self._accumulated and not self._norm_pass:
                # Params that had gradients accumulated but none from this backward: step()
                # would step them too.
                queued = {id(p) for p in self._bucket}
                self._bucket += [p for group in self._opt.param_groups for p in group["params"]
                                 if p.grad is not None and id(p) not in queued]
            self._flush()
        finally:
            self._last_task, self._task = self._task, None
        opt = self.optimizer
        if self._norm_pass:
            norm = self._sumsq.sqrt().to(F32)
            self._norm = norm
            if self._found is not None:  # the norm is inf/NaN when a gradient is
                self._found.copy_((~torch.isfinite(norm)).to(F32))
            return
        if self.max_grad_norm is not None and self.clip == "previous":
            norm = self._sumsq.sqrt().to(F32)
            if self._found is not None:  # a skipped step keeps the norm before it (0: none)
                prev = torch.zeros_like(norm) if self._norm is None else self._norm
                norm = torch.where(self._found.to(norm.device) != 0, prev, norm)
            self._norm = norm
        self._accumulated = False
        found = self._found
        if found is not None:
            self.scaler._record_released_step(opt, found)
        opt._opt_called = True  # what torch's LR schedulers look for, as a step() sets it
        kwargs = {} if found is None else {"found_inf": found}
        for hook in chain_hooks(_global_optimizer_post_hooks, opt._optimizer_step_post_hooks):
            hook(opt, (), kwargs)


class _Token:
    """Lives as long as the callback of an open backward (see _begin)."""


def chain_hooks(*dicts):
    for d in dicts:
        yield from list(d.values())
