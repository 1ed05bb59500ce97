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
the scale backs off as usual). A ``bf16_check_only`` scaler's scale is 1, so its loss may go
unscaled (``GradScaler.release_scale``).

Clipping by the global norm: ``clip="exact"`` computes the norm in a first backward pass
(:meth:`GradRelease.backward`, which also checks every gradient for inf/NaN first, so a
skipped step then changes nothing at all) and steps in a second; ``clip="previous"`` clips with
the global norm of the previous backward (one pass). The clip coefficient is folded into the
kernel's gradient multiplier (``inv_scale``), on the device.

On a mesh (docs/gradient_release.md, "On a mesh"): FSDP2 runs a sharded param's
post-accumulate-grad hooks itself after its reduce-scatter, so the release steps there; every
rank cuts the same buckets (by the whole gradient's bytes over the mesh size) and all-reduces
each bucket's found_inf (MAX) before its step, so every rank skips the same buckets; clipping
sums the squared norms over the sharded dimensions once per pass. Under DDP (``ddp=``) the step
runs in DDP's comm hook, after each bucket's all-reduce.

Refused, before anything is stepped (docs/gradient_release.md): plain params in a process group
of more than one without ``ddp=`` (at ``release_grads()`` and at the first gradient of every
backward); frameworks that step the
optimizer themselves (Lightning automatic optimization, accelerate's AcceleratedOptimizer and
gradient accumulation, transformers.Trainer), recognised by their objects on the Python stack,
by name and with the way out (:func:`framework_refusal`); a loss scaled by an mpext.GradScaler
the release was not made with (:func:`scaled_backward_hook`), or not scaled by its scaling
scaler (every backward, micro-batches of accumulate() too, whose accumulated gradients are
then dropped); float16 params with a check-only scaler.

A backward that fails (here or anywhere) is forgotten at once, its unstepped gradients dropped,
so that nothing of it reaches the next (GradRelease._on_grad, _token_died).
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


# The releases in force (not removed): while there are any, mpext.GradScaler.scale() marks the
# loss it scales (scaled_backward_hook).
_ACTIVE: "weakref.WeakSet[GradRelease]" = weakref.WeakSet()


def _world_size() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _ddp_refusal(name: str, world: int) -> str:
    return ("%s: gradient release of plain (not sharded) params is not supported with more "
            "than one process (a process group of %d) unless DDP steps them: under DDP the "
            "post-accumulate-grad hooks fire on each rank's local, unreduced gradient, so each "
            "rank would step its own (docs/gradient_release.md). The way out: under DDP, "
            "release_grads(ddp=ddp_model) (the step runs in DDP's comm hook, after each "
            "bucket's all-reduce); FSDP2 (fully_shard) params are released as they are; or "
            "step after backward (release.remove(), then loss.backward(); opt.step())"
            % (name, world))


class _Mesh:
    """The device mesh of released DTensor params (FSDP2, HSDP): the collectives a release
    adds there, on the device and without a host read. Every rank makes the same calls in
    the same order (the buckets are cut by a rank-independent size), so they pair up."""

    def __init__(self, mesh) -> None:
        self.mesh = mesh
        self.groups = [mesh.get_group(d) for d in range(mesh.ndim)]
        self.size = mesh.size()

    def max_(self, t: torch.Tensor) -> None:
        """``t`` becomes its maximum over every rank of the mesh (an inf/NaN flag)."""
        import torch.distributed as dist
        for group in self.groups:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)

    def sum_over(self, t: torch.Tensor, dims: tuple) -> None:
        """``t`` becomes its sum over the mesh dimensions ``dims`` (those a param is sharded
        on: over a replicate dimension every rank holds the same values)."""
        import torch.distributed as dist
        for d in dims:
            if dist.get_world_size(self.groups[d]) > 1:
                dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.groups[d])


def _sharded_dims(p: torch.Tensor) -> tuple:
    """The mesh dimensions a DTensor is sharded on (partial placements are not a param's)."""
    return tuple(d for d, pl in enumerate(p.placements) if not pl.is_replicate())


def _scales(scaler) -> bool:
    """Whether ``scaler`` (a torch.amp or mpext GradScaler, or None) multiplies a loss."""
    return (scaler is not None and scaler.is_enabled()
            and not getattr(scaler, "bf16_check_only", False))


# ---- Frameworks that drive the optimizer themselves -----------------------------------------
#
# Recognising them (their objects on the Python stack) is the integrations' business, in
# mpext.integrations.detect, which registers itself here when imported: optim imports no integration.

_detector = None  # the module mpext.integrations.detect, once imported


def _detection():
    global _detector
    if _detector is None:  # `import mpext` imports mpext.integrations.detect, which registers
        raise RuntimeError("mpext.optim._release: mpext.integrations.detect was not imported "
                           "(import mpext, not mpext.optim alone)")
    return _detector


def framework_refusal(name: str, opt, scaler, in_backward: bool = False,
                      wrapped: bool = False) -> Optional[str]:
    """Why a framework on this call's stack cannot drive ``opt`` released, with the way out,
    or None (mpext.integrations.detect.framework_refusal)."""
    return _detection().framework_refusal(name, opt, scaler, in_backward, wrapped)


# The latest backward pass of a loss scaled by an mpext.GradScaler while a release was in force:
# (its graph task id, a weak reference to the scaler), set by the hook that scale() puts on the
# scaled loss, which autograd runs first in that backward (scaled_backward_hook).
_scaled_task = (None, None)


def scaled_backward_hook(scaler):
    """A tensor hook for a loss ``scaler`` scaled: it notes, at the start of the loss's
    backward, that this backward's gradients carry ``scaler``'s scale; a release made without
    that scaler refuses the backward at its first gradient (GradRelease._check_context)."""
    ref = weakref.ref(scaler)

    def hook(grad):
        global _scaled_task
        _scaled_task = (_task_id(), ref)
    return hook


def _scaler_of(task: int):
    """The mpext.GradScaler whose scale the loss of backward ``task`` carries, or None."""
    seen, ref = _scaled_task
    return ref() if seen == task and ref is not None else None


# The framework making a release inside driven_by() (None: none).
_driving: Optional[str] = None


@contextlib.contextmanager
def driven_by(name: str):
    """Releases made inside are driven by the framework ``name`` (an mpext integration that
    makes its step()/zero_grad() no-ops and routes its backward, clipping and accumulation
    into the release): framework_refusal does not apply to them."""
    global _driving
    _driving, before = name, _driving
    try:
        yield
    finally:
        _driving = before


class GradRelease:
    """The release of an optimizer's gradients inside the backward pass: made by
    ``optimizer.release_grads(...)`` (see there); :meth:`remove` ends it."""

    def __init__(self, optimizer, bucket_bytes: int = DEFAULT_BUCKET_BYTES, scaler=None,
                 max_grad_norm: Optional[float] = None, clip: str = "exact",
                 ddp=None) -> None:
        name = optimizer._name() + ".release_grads"
        if getattr(optimizer, "_grad_release", None) is not None:
            raise RuntimeError("%s: this optimizer's gradients are already released; call "
                               "remove() on the first GradRelease first" % name)
        if not (isinstance(bucket_bytes, int) and not isinstance(bucket_bytes, bool)
                and bucket_bytes >= 0):
            raise ValueError("%s: bucket_bytes must be an int >= 0, got %r" % (name, bucket_bytes))
        if scaler is not None:
            # duck-typed on the public method (optim never imports mpext.amp)
            if not callable(getattr(scaler, "record_released_step", None)):
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
        if ddp is not None:
            from torch.nn.parallel import DistributedDataParallel
            if not isinstance(ddp, DistributedDataParallel):
                raise TypeError("%s: ddp must be the torch.nn.parallel.DistributedDataParallel "
                                "module whose params the optimizer steps, got %s"
                                % (name, type(ddp).__name__))
            ddp_params = {id(p) for p in ddp.module.parameters()}
        refused = None if _driving is not None else framework_refusal(name, optimizer, scaler)
        if refused is not None:
            raise RuntimeError(refused)
        params = []
        mesh = None
        for gi, group in enumerate(optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                where = "%s: param %d of group %d" % (name, j, gi)
                if is_dtensor(p):
                    # FSDP2 / HSDP: FSDP2 runs a sharded param's post-accumulate-grad hooks
                    # itself, after its reduce-scatter, with the reduced DTensor gradient
                    if mesh is None:
                        mesh = p.device_mesh
                    elif p.device_mesh != mesh:
                        raise NotImplementedError(
                            "%s is a DTensor on the mesh %s, another param's is on %s: a "
                            "release decides each bucket's skip over one mesh; use one "
                            "optimizer (and one release) per mesh" % (where, p.device_mesh,
                                                                      mesh))
                elif ddp is not None:
                    if id(p) not in ddp_params:
                        raise ValueError("%s is not a param of the DDP module (ddp=): DDP's comm "
                                         "hook, which steps the params, never sees it" % where)
                elif world > 1 and mesh is None and not any(
                        is_dtensor(q) for g in optimizer.param_groups for q in g["params"]):
                    raise NotImplementedError(_ddp_refusal(name, world))
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
                if p.dtype is torch.float16 and scaler is not None and scaler.is_enabled() \
                        and scaler.bf16_check_only:
                    # as the scaler's own unscale_ refuses a float16 gradient in this mode
                    raise ValueError(
                        "%s is float16, and mpext.GradScaler(bf16_check_only=True) does not "
                        "scale the loss, but a float16 gradient needs loss scaling; use "
                        "bf16_check_only=False for float16 training" % where)
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
        self._paused_task = -1     # the latest backward checked inside accumulate()
        self._accumulated = False  # accumulate() ran since the last step
        self._last_task = -1
        self._norm_pass = False           # exact clipping: the pass that measures the norm
        self._norm_ready = False          # exact clipping: the norm of this step is known
        self._found: Optional[torch.Tensor] = None
        self._inv_scale: Optional[torch.Tensor] = None
        self._sumsq: Optional[torch.Tensor] = None
        self._sumsq_parts: Dict[tuple, torch.Tensor] = {}  # on a mesh: by sharded dims
        self._norm: Optional[torch.Tensor] = None  # the latest step's global norm (clipping)
        self._mult: Optional[torch.Tensor] = None  # this backward's gradient multiplier
        self._one: Dict[torch.device, torch.Tensor] = {}
        self.buckets_stepped = 0  # counters: buckets launched / backward passes seen
        self.backward_passes = 0
        if mesh is not None and len(params) != sum(is_dtensor(p) for p in params):
            raise NotImplementedError(
                "%s: the optimizer holds both DTensor (FSDP2) and plain params: the plain ones' "
                "hooks would fire on unreduced gradients, in another order on each rank; shard "
                "every module of the model with fully_shard, or use one optimizer for each"
                % name)
        if ddp is not None and mesh is not None:
            raise NotImplementedError("%s: DTensor params under DDP (ddp=): release steps "
                                      "FSDP2's sharded params by themselves; leave ddp out"
                                      % name)
        self._mesh = None if mesh is None else _Mesh(mesh)
        self._ddp = ddp
        # The framework driving this release (mpext.accelerate.release_trainer, ...): its
        # step()/zero_grad() are no-ops there and its backward goes through the release, so
        # framework_refusal does not apply to it.
        self._driver: Optional[str] = _driving
        self._held: List[torch.Tensor] = []  # DDP, exact clipping: stepped at the end
        # DDP: stepped params whose .grad points back at their bucket's view until the end
        self._viewed: List[torch.Tensor] = []
        if ddp is None:
            self._handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                             for p in params]
        else:
            # Under DDP a param's post-accumulate-grad hook sees its local, unreduced
            # gradient; DDP's comm hook sees each bucket after its all-reduce (the average).
            self._handles = []
            self._mine = {id(p) for p in params}
            try:
                ddp.register_comm_hook(ddp.process_group, self._ddp_hook)
            except RuntimeError as e:
                raise RuntimeError("%s: DDP did not take the release's comm hook (%s): DDP "
                                   "takes one comm hook, registered before its first backward; "
                                   "release the optimizer right after wrapping the model, and "
                                   "leave out any other comm hook" % (name, e)) from None
        # accelerator.prepare(optimizer) reads the optimizer's state_dict (to place it): the
        # first point where wrapping it in an AcceleratedOptimizer can be seen
        self._handles.append(optimizer.register_state_dict_pre_hook(self._on_state_dict))
        optimizer._grad_release = self
        _ACTIVE.add(self)

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
        if self.max_grad_norm is not None and self.clip == "exact" and self._ddp is None:
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
        _ACTIVE.discard(self)
        opt = self.optimizer
        if opt is not None and getattr(opt, "_grad_release", None) is self:
            opt._grad_release = None

    def refusal(self, what: str) -> str:
        """The message of the error that refuses ``what`` (``step()``, ``scaler.step``) while
        released: a framework's own refusal when one is driving the step."""
        framework = framework_refusal(self._name, self._opt, self.scaler)
        if framework is not None:
            return "%s is refused. %s" % (what, framework)
        return ("%s is refused while the optimizer's gradients are released: each backward "
                "steps the params as their gradients complete and frees the gradients (to "
                "accumulate over micro-batches, run all but the last backward inside "
                "release.accumulate()); call remove() on the GradRelease to step by hand "
                "again" % what)

    # -----------------------------------------------------------------------------------------
    # The hooks.

    def _on_state_dict(self, optimizer) -> None:
        """The optimizer's state_dict pre-hook: refuses accelerate's AcceleratedOptimizer,
        which reads the state_dict when it wraps the optimizer (accelerator.prepare)."""
        if self._driver is None and _detection().accelerate_wrapper_on_stack():
            raise RuntimeError(framework_refusal(self._name, self._opt, self.scaler,
                                                 wrapped=True))

    def _check_context(self, p: torch.Tensor, task: int) -> None:
        """At the first gradient of each backward, before anything is stepped: more than one
        process, a loss scaled by an mpext.GradScaler this release was not made with, or a
        framework that drives the optimizer itself (see framework_refusal). The refused
        backward's gradient is dropped (as a failed backward's, _abandon)."""
        world = _world_size()
        refused = None if (world == 1 or self._mesh is not None or self._ddp is not None) \
            else _ddp_refusal(self._name, world)
        if refused is None and self._driver is None:
            refused = framework_refusal(self._name, self._opt, self.scaler, in_backward=True)
        theirs = _scaler_of(task)
        if refused is None and getattr(self.scaler, "_scale", None) is not None:
            # (a scaler whose scale() was never called: its own refusal, release_scale)
            refused = self._unscaled_refusal(task)
        if refused is None and theirs is not None and theirs is not self.scaler:
            refused = ("%s: the loss of this backward was scaled by an mpext.GradScaler that "
                       "this release was %s, so its buckets would step with gradients "
                       "multiplied by the scale: pass that scaler to release_grads(scaler=...)"
                       % (self._name, "made without (scaler=None)" if self.scaler is None
                          else "not made with (it has another)"))
        if refused is not None:  # (its gradient is dropped by _on_grad)
            raise (RuntimeError if world == 1 else NotImplementedError)(refused)

    def _unscaled_refusal(self, task: int) -> Optional[str]:
        """Why backward ``task`` is refused when its loss was not scaled by this release's
        scaling scaler (each bucket would be unscaled by 1/scale all the same: a step scale
        times too small, with no error), or None. Gradients accumulated since the last step
        (accumulate()) are dropped with it, as they hold part of this backward's."""
        if not _scales(self.scaler) or _scaler_of(task) is not None:
            return None
        dropped = ""
        if self._accumulated or self._paused:
            self._drop_accumulated()
            dropped = (" The gradients accumulated since the last step were dropped (they "
                       "hold part of this backward's): start its micro-batches again.")
        return ("%s: the loss of this backward was not scaled by the release's "
                "mpext.GradScaler, whose scale every bucket is unscaled by (the step would be "
                "that many times too small). Scale every loss: release.backward("
                "scaler.scale(loss)) or scaler.scale(loss).backward(), also inside "
                "accumulate(); a loss that needs no scaling wants a release made without the "
                "scaler, or mpext.GradScaler(bf16_check_only=True) for BF16.%s"
                % (self._name, dropped))

    def _drop_accumulated(self) -> None:
        for group in self._opt.param_groups:
            for q in group["params"]:
                q.grad = None
        self._accumulated = False

    def _on_grad(self, p: torch.Tensor) -> None:
        task = _task_id()
        if self._paused:
            # A micro-batch's backward: only its loss's scale is checked, at its first
            # gradient (a refusal drops what was accumulated, this one's part included).
            if task != self._paused_task:
                self._paused_task = task
                refused = self._unscaled_refusal(task)
                if refused is not None:
                    raise RuntimeError(refused)
            return
        try:
            self._take(p, task)
        except BaseException:
            # This backward fails: forget it now, dropping its unstepped gradients, so that
            # nothing of it (a gradient the next backward would add to, an open step) is left
            # for the next one, however long the exception and its traceback live.
            if self._task == task:
                self._abandon()
            elif self._task is None:  # refused as it began: its first gradient goes too
                p.grad = None
            raise

    def _take(self, p: torch.Tensor, task: int) -> None:
        """The hook's work for param ``p`` in backward ``task``."""
        if self._task is not None and task != self._task and self._token() is None:
            self._abandon()  # the open backward failed: its callback will never run
        if self._task is None:
            self._check_context(p, task)
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
        self._pending += self._grad_bytes(p.grad)
        if self._pending >= self.bucket_bytes:
            self._flush()

    def _grad_bytes(self, g: torch.Tensor) -> int:
        """A gradient's bytes for cutting buckets: on a mesh the whole gradient's over the
        mesh's size, the same on every rank (a shard's own size differs from rank to rank
        with uneven shards, and every rank must cut the same buckets: the skip flag's
        reduction and the 8-bit blocks' exchange are collectives per bucket)."""
        if self._mesh is not None:
            return g.numel() * g.element_size() // self._mesh.size
        return g.numel() * g.element_size()

    def _ddp_hook(self, process_group, bucket):
        """DDP's comm hook: the bucket's all-reduce as DDP makes it without a hook (each
        gradient times 1/world, then summed), then, the average in hand, the bucket's params
        are taken as their gradients complete (stepped, or held for exact clipping)."""
        import torch.distributed as dist
        buf = bucket.buffer()
        # as DDP's reducer without a comm hook: multiplied by the reciprocal, not divided
        buf.mul_(1.0 / dist.get_world_size(process_group))
        fut = dist.all_reduce(buf, group=process_group, async_op=True).get_future()
        fut = fut.then(lambda f: f.value()[0])
        fut.wait()  # on the host for gloo; a stream wait for NCCL
        if self._opt._grad_release is not self:
            return fut  # removed (DDP keeps its comm hook): DDP's plain averaging
        taken = []
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            if id(p) not in self._mine:
                continue
            if not self._paused:
                p.grad = g  # the average, a view of DDP's bucket (its local one goes)
                taken.append((p, g))
            self._on_grad(p)
        if not self._paused and self._task is not None:
            self._flush()
            # Stepped and freed: pointed back at the bucket (no memory of its own), as DDP's
            # end-of-backward copy of each bucket into .grad would otherwise allocate a whole
            # gradient (clone_obey_contract); _free_grads lets them go after it.
            for p, g in taken:
                if p.grad is None:
                    p.grad = g
                    self._viewed.append(p)
        return fut

    def _step_held(self) -> None:
        """DDP with exact clipping: every bucket was checked and measured as it came; now the
        global norm is known, every held param is stepped with the clipped gradient."""
        held, self._held = self._held, []
        norm = self._global_sumsq().sqrt().to(F32)
        if self._found is not None:  # the norm is inf/NaN when a gradient is
            torch.maximum(self._found, (~torch.isfinite(norm)).to(F32).to(self._found.device),
                          out=self._found)
        self._norm = norm
        self._mult = self._multiplier()
        opt = self.optimizer
        with torch.no_grad():
            opt._launch(opt._items(only={id(p) for p in held}), self._mult, self._found)
        self.buckets_stepped += 1
        for p in held:
            p.grad = None

    def _free_grads(self) -> None:
        self._viewed = []
        if self._opt._grad_release is not self:
            return
        for group in self._opt.param_groups:
            for p in group["params"]:
                if id(p) in self._mine and not self._paused:
                    p.grad = None

    def _abandon(self) -> None:
        """Forgets a backward that raised before its end: the gradients it had not stepped
        yet (the bucket's, that of a bucket whose step raised included) are dropped, its
        earlier buckets stay stepped."""
        for p in self._bucket + self._held + self._viewed:
            p.grad = None
        self._bucket, self._pending, self._held, self._viewed = [], 0, [], []
        self._last_task, self._task = self._task, None
        self._token = lambda: None

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
        if clipping and self.clip == "exact" and self._ddp is None \
                and not (self._norm_pass or self._norm_ready):
            raise RuntimeError("%s: clip=\"exact\" needs the norm pass: call "
                               "release.backward(loss) instead of loss.backward()" % self._name)
        # Everything that can raise (the step pre-hooks, the scaler's checks) runs before the
        # backward is opened below, so a refused backward leaves no open step behind.
        if self._norm_ready:  # exact clipping's stepping pass: the norm pass set up the step
            mult = self._multiplier()
        else:
            self._run_pre_hooks(opt)
            device = self._state_device(opt)
            scaler = self.scaler
            if scaler is not None and scaler.is_enabled():
                # 1 for a check-only scaler, also when the loss was not scaled
                scale = scaler.release_scale(device, self._name)
                # As FusedOptimizer.step computes it from the grad_scale the scaler hands it.
                self._inv_scale = scale.detach().double().reciprocal().float()
                self._found = torch.zeros((), dtype=F32, device=scale.device)
            else:
                self._inv_scale = self._found = None
            if clipping:
                self._sumsq = torch.zeros((), dtype=torch.float64, device=device)
                self._sumsq_parts = {}
            mult = None if self._norm_pass else self._multiplier()
        if not self._norm_pass:
            self._mult = mult
        self._task = task
        self.backward_passes += 1
        # The callback holds the only reference to the token (made last, so that no frame of a
        # traceback holds it): if the backward fails, the engine drops its callbacks, the token
        # dies and the finalizer forgets the backward at once (_token_died); the next backward
        # also checks (see _on_grad).
        token = _Token()
        self._token = weakref.ref(token)
        weakref.finalize(token, self._token_died, task).atexit = False  # (none at exit)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end(token))

    def _token_died(self, task: int) -> None:
        """The callback of backward ``task`` is gone: if that backward is still open, it failed
        before its end (by an error anywhere in it): its unstepped gradients are dropped."""
        if self._task == task:
            self._abandon()

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
        bucket = self._bucket
        if not bucket:
            return
        self._flush_bucket(bucket)
        # only once stepped: a bucket whose step raised stays, for _abandon to drop
        self._bucket, self._pending = [], 0

    def _flush_bucket(self, bucket: List[torch.Tensor]) -> None:
        with torch.no_grad():
            if self._norm_pass:
                self._add_norm(bucket)
                for p in bucket:
                    p.grad = None
                return
            if self._ddp is not None and self.max_grad_norm is not None \
                    and self.clip == "exact":
                # DDP's buckets hold every averaged gradient until the end of backward
                # anyway: the exact norm needs no second pass there (_end steps them)
                if self._found is not None:
                    self._check_finite(bucket)
                self._add_norm(bucket)
                self._held += bucket
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
        if self._mesh is not None:
            # Every rank decides the same skip before the bucket's step: an inf/NaN in any
            # rank's shard of the bucket (its flag stays set for the rest of the backward).
            self._mesh.max_(found)

    def _add_norm(self, bucket: List[torch.Tensor]) -> None:
        """Adds the bucket's squared (unscaled) norm to this backward's sum: on a mesh this
        rank's shards' part, one sum per set of sharded mesh dimensions (reduced over them
        once, at the end of the pass: _global_sumsq)."""
        by: Dict[tuple, List[torch.Tensor]] = {}
        for p in bucket:
            dims = _sharded_dims(p) if is_dtensor(p) else ()
            by.setdefault((p.grad.device, dims), []).append(local(p.grad))
        for (device, dims), grads in by.items():
            inv = None if self._inv_scale is None else self._inv_scale.to(device)
            n = _ops.grad_norm(grads, inv_scale=inv).to(self._sumsq.device, torch.float64)
            part = self._sumsq if not dims else self._sumsq_parts.get(dims)
            if part is None:
                part = self._sumsq_parts[dims] = torch.zeros_like(self._sumsq)
            part.add_(n * n)

    def _global_sumsq(self) -> torch.Tensor:
        """This pass's squared global norm: on a mesh, each part summed over the dimensions
        its shards are cut along (one all-reduce for FSDP2's and HSDP's params)."""
        total = self._sumsq
        for dims, part in self._sumsq_parts.items():
            self._mesh.sum_over(part, dims)
            total = total + part
        self._sumsq_parts = {}
        return total

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
        if self._token() is not token:
            return  # a backward already forgotten (_abandon)
        try:
            if self._accumulated and not self._norm_pass:
                # Params that had gradients accumulated but none from this backward: step()
                # would step them too.
                queued = {id(p) for p in self._bucket + self._viewed}
                self._bucket += [p for group in self._opt.param_groups for p in group["params"]
                                 if p.grad is not None and id(p) not in queued]
            self._flush()
            if self._held:
                self._step_held()
        except BaseException:
            self._abandon()
            raise
        if self._ddp is not None:
            # DDP's own end-of-backward callback, queued after this one (at its last
            # bucket), writes every bucket back into .grad: free them after it
            torch.autograd.Variable._execution_engine.queue_callback(self._free_grads)
        self._last_task, self._task = self._task, None
        opt = self.optimizer
        if self._norm_pass:
            norm = self._global_sumsq().sqrt().to(F32)
            self._norm = norm
            if self._found is not None:  # the norm is inf/NaN when a gradient is
                self._found.copy_((~torch.isfinite(norm)).to(F32))
            return
        if self.max_grad_norm is not None and self.clip == "previous":
            norm = self._global_sumsq().sqrt().to(F32)
            if self._found is not None:  # a skipped step keeps the norm before it (0: none)
                prev = torch.zeros_like(norm) if self._norm is None else self._norm
                norm = torch.where(self._found.to(norm.device) != 0, prev, norm)
            self._norm = norm
        self._accumulated = False
        found = self._found
        if found is not None:
            self.scaler.record_released_step(opt, found)
        opt._opt_called = True  # what torch's LR schedulers look for, as a step() sets it
        kwargs = {} if found is None else {"found_inf": found}
        for hook in chain_hooks(_global_optimizer_post_hooks, opt._optimizer_step_post_hooks):
            hook(opt, (), kwargs)


class _Token:
    """Lives as long as the callback of an open backward (see _begin)."""


def chain_hooks(*dicts):
    for d in dicts:
        yield from list(d.values())
