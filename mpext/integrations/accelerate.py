"""mpext.accelerate: makes an ``accelerate.Accelerator`` (and so a ``transformers.Trainer``) use
``mpext.GradScaler``, and gives the Trainer learning-rate schedules that hold still on skipped
steps.

    accelerator = Accelerator(mixed_precision="fp16")
    mpext.accelerate.use_grad_scaler(accelerator)          # before accelerator.prepare(...)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)

    trainer = Trainer(..., optimizer_cls_and_kwargs=(mpext.optim.AdamW, {"weight_decay": 0.1}))
    mpext.accelerate.setup_trainer(trainer)                # before trainer.train()

Why a helper: accelerate makes its own ``torch.amp.GradScaler`` only on a GPU (on the CPU
``mixed_precision="fp16"`` silently trains without autocast or scaling) and hands it to each
``AcceleratedOptimizer`` when ``prepare()`` wraps it; a scaler swapped in afterwards is used by
``accelerator.backward`` but not by the optimizers, which go on unscaling with the old one (or
none), so the run diverges. With FP16 the helper installs an ``mpext.GradScaler`` (dynamic
scale; ``GradScalerKwargs`` and keyword options are honoured) and turns on accelerate's native
AMP path on any device; otherwise (BF16 autocast, or a model whose params are already BF16) it
installs one with ``bf16_check_only=True``: no scaling, but a step with an inf/NaN gradient is
skipped on the device. With ``mpext.optim.Adam``/``AdamW`` the unscale and the skip happen inside
the fused step, with no host sync.

Skipped steps and schedules: accelerate and the Trainer advance the scheduler unless
``optimizer_step_was_skipped``, which for a fused optimizer is always False (knowing would take a
host sync). The schedulers of ``mpext.optim.lr_scheduler`` decide on the device instead: stepped
every iteration, they advance only on applied steps. ``setup_trainer`` makes the Trainer create
them in place of its own for ``lr_scheduler_type`` ``linear``, ``cosine``, ``constant`` and
``constant_with_warmup`` (same values as transformers' when nothing is skipped).
"""
import functools
import types
from typing import Any, Optional

try:
    import accelerate as _accelerate
    from accelerate.utils import DistributedType as _DistributedType
except ImportError as _exc:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "mpext.accelerate needs the accelerate package, which could not be imported (%s). "
        "Install it with `pip install accelerate` (and `pip install transformers` for "
        "setup_trainer)." % _exc) from _exc

from ..amp import GradScaler
from ..optim import lr_scheduler as _lr_scheduler

__all__ = ["use_grad_scaler", "setup_trainer", "release_trainer", "release_accelerator"]

_NAME = "mpext.accelerate"
_SUPPORTED = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU",
              "MULTI_MUSA", "MULTI_SDAA", "MULTI_HPU")


def use_grad_scaler(accelerator: Any, **scaler_options: Any) -> GradScaler:
    """Makes ``accelerator`` use an ``mpext.GradScaler`` and returns it. Call it before
    ``accelerator.prepare``: it raises ``RuntimeError`` once a model or optimizer was prepared.

    With ``mixed_precision="fp16"``: dynamic loss scaling (torch's rule by default; options such
    as ``init_scale``, ``growth_interval``, ``hysteresis``, ``min_scale`` from ``scaler_options``
    over those of a ``GradScalerKwargs`` handler), with accelerate's autocast and unscaling on
    every device, the CPU included. Otherwise: ``bf16_check_only=True`` (no scaling, the inf/NaN
    skip). ``accelerator.save_state``/``load_state`` keep the scale as they keep torch's (same
    ``state_dict``).
    """
    if not isinstance(accelerator, _accelerate.Accelerator):
        raise TypeError("%s.use_grad_scaler: accelerator must be an accelerate.Accelerator, got "
                        "%s" % (_NAME, type(accelerator).__name__))
    if accelerator._optimizers or accelerator._models:
        raise RuntimeError(
            "%s.use_grad_scaler: call it before accelerator.prepare(): prepare() already wrapped "
            "%s, and an AcceleratedOptimizer keeps the scaler it was made with (%s), so a scaler "
            "set now would scale the loss in backward() while the optimizers unscale with the "
            "old one (or not at all), and the run would diverge"
            % (_NAME, "optimizers" if accelerator._optimizers else "a model",
               type(accelerator.scaler).__name__ if accelerator.scaler is not None else "none"))
    dist = accelerator.distributed_type
    if dist.name not in _SUPPORTED and not (dist == _DistributedType.FSDP
                                            and getattr(accelerator, "is_fsdp2", False)):
        raise NotImplementedError(
            "%s.use_grad_scaler: distributed type %s is not supported (DeepSpeed and Megatron "
            "scale the loss themselves; FSDP1 needs its ShardedGradScaler); DDP and FSDP2 are"
            % (_NAME, dist.name))
    options = {}
    if accelerator.scaler_handler is not None:
        options.update(accelerator.scaler_handler.to_kwargs())
    options.update(scaler_options)
    fp16 = accelerator.mixed_precision == "fp16"
    if not fp16:
        options["bf16_check_only"] = True
    scaler = GradScaler(accelerator.device.type, **options)
    if not scaler.is_enabled():
        raise ValueError("%s.use_grad_scaler: the scaler disabled itself on %s"
                         % (_NAME, accelerator.device))
    accelerator.scaler = scaler
    if fp16:
        # accelerate leaves native AMP off for fp16 on the CPU: no autocast, and
        # unscale_gradients (clip_grad_norm_) would skip the unscale
        accelerator.native_amp = True
    return scaler


_SCHEDULES = {
    "linear": lambda opt, w, t, kw: _lr_scheduler.get_linear_schedule_with_warmup(opt, w, t),
    "cosine": lambda opt, w, t, kw: _lr_scheduler.get_cosine_schedule_with_warmup(
        opt, w, t, **{k: v for k, v in kw.items() if k == "num_cycles"}),
    "constant": lambda opt, w, t, kw: _lr_scheduler.LambdaLR(opt, lambda e: 1.0),
    "constant_with_warmup": lambda opt, w, t, kw: _lr_scheduler.get_constant_schedule_with_warmup(
        opt, w),
}


def setup_trainer(trainer: Any, *, grad_scaler: bool = True, lr_schedule: bool = True,
                  **scaler_options: Any) -> Optional[GradScaler]:
    """Sets up a ``transformers.Trainer`` (before ``trainer.train()``): its Accelerator gets an
    ``mpext.GradScaler`` (:func:`use_grad_scaler`; ``grad_scaler=False`` leaves it alone), and,
    unless ``lr_schedule=False`` or the Trainer was given a scheduler, the scheduler it creates
    for ``args.lr_scheduler_type`` is the skip-aware mpext one (``linear``, ``cosine``,
    ``constant``, ``constant_with_warmup``; another type raises ``ValueError``). Returns the
    scaler (or None)."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("%s.setup_trainer needs transformers (pip install transformers): %s"
                          % (_NAME, exc)) from exc
    if not isinstance(trainer, transformers.Trainer):
        raise TypeError("%s.setup_trainer: trainer must be a transformers.Trainer, got %s"
                        % (_NAME, type(trainer).__name__))
    if lr_schedule and trainer.lr_scheduler is None:
        kind = str(getattr(trainer.args.lr_scheduler_type, "value",
                           trainer.args.lr_scheduler_type))
        make = _SCHEDULES.get(kind)
        if make is None:
            raise ValueError("%s.setup_trainer: lr_scheduler_type=%r has no skip-aware mpext "
                             "schedule (supported: %s); pass lr_schedule=False to keep "
                             "transformers' own" % (_NAME, kind, ", ".join(sorted(_SCHEDULES))))
        kwargs = dict(trainer.args.lr_scheduler_kwargs or {})

        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                opt = self.optimizer if optimizer is None else optimizer
                self.lr_scheduler = make(opt, self.args.get_warmup_steps(num_training_steps),
                                         num_training_steps, kwargs)
                self._created_lr_scheduler = True
            return self.lr_scheduler

        trainer.create_scheduler = types.MethodType(create_scheduler, trainer)
    if not grad_scaler:
        return None
    return use_grad_scaler(trainer.accelerator, **scaler_options)


# ---- Gradient release under the Trainer and accelerate ------------------------------------------

def release_trainer(trainer: Any, *, bucket_bytes: Optional[int] = None, clip: str = "exact",
                    **scaler_options: Any) -> None:
    """Gradient release (docs/gradient_release.md) under a ``transformers.Trainer`` (call it
    before ``trainer.train()``, in place of :func:`setup_trainer`, whose scaler and skip-aware
    schedules it sets up too). The Trainer's optimizer must be an ``mpext.optim`` one
    (``optimizer_cls_and_kwargs=(mpext.optim.AdamW, {...})``). Once the Trainer creates it,
    it is released with the Accelerator's ``mpext.GradScaler``, the Trainer's
    ``max_grad_norm`` (0: no clipping) and ``clip``; then:

    - ``accelerator.backward`` runs the release's backward (``release.backward``: exact
      clipping's two passes), inside ``release.accumulate()`` on the micro-batches that do
      not sync (``gradient_accumulation_steps``), so the last one steps with the sum;
    - the wrapped optimizer's ``step()`` only calls the scaler's ``update()`` (the step was
      made in backward) and ``zero_grad()`` has nothing to clear;
    - the Trainer's clipping call returns the release's global norm (logged as ``grad_norm``).

    With ``gradient_accumulation_steps > 1`` exact clipping is refused (its norm pass would
    free the accumulated sum): pass ``clip="previous"`` or ``max_grad_norm=0``.

    Under accelerate's DDP (``MULTI_CPU``, ``MULTI_GPU``, ...) the release is made by the
    ``accelerator.prepare`` that wraps the model in ``DistributedDataParallel``, with that
    model (``release_grads(ddp=...)``: the step runs in DDP's comm hook, on the averaged
    gradients, so every rank steps alike and a NaN on one rank is skipped on all); the micro-
    batches that do not sync run under DDP's ``no_sync`` (accelerate's ``accumulate``) and
    ``release.accumulate()``. Other distributed types (FSDP, DeepSpeed, ...) are refused."""
    import transformers
    if not isinstance(trainer, transformers.Trainer):
        raise TypeError("%s.release_trainer: trainer must be a transformers.Trainer, got %s"
                        % (_NAME, type(trainer).__name__))
    args = trainer.args
    clipping = bool(args.max_grad_norm and args.max_grad_norm > 0)
    if clipping and clip == "exact" and args.gradient_accumulation_steps > 1:
        raise ValueError(
            "%s.release_trainer: max_grad_norm=%s with gradient_accumulation_steps=%d and "
            "clip=\"exact\": exact clipping's norm pass would free the accumulated gradients; "
            "pass clip=\"previous\" (the previous step's global norm) or max_grad_norm=0"
            % (_NAME, args.max_grad_norm, args.gradient_accumulation_steps))
    scaler = setup_trainer(trainer, **scaler_options)
    accelerator = trainer.accelerator
    state: dict = {}
    create_optimizer = trainer.create_optimizer

    def create(self, model=None):
        opt = create_optimizer() if model is None else create_optimizer(model)
        if state.get("release") is None and state.get("make") is None:
            make = functools.partial(_release, opt, "transformers.Trainer", bucket_bytes,
                                     scaler, args.max_grad_norm if clipping else None, clip)
            if _ddp_type(accelerator):  # made by prepare, with the DDP model it makes
                state["make"] = make
            else:
                state["release"] = make()
        return opt

    trainer.create_optimizer = types.MethodType(create, trainer)

    def clip_grad_norm(self, model):
        release = state["release"]
        return release.last_grad_norm

    def get_grad_norm(self, model, grad_norm=None):
        return grad_norm

    trainer._clip_grad_norm = types.MethodType(clip_grad_norm, trainer)
    trainer._get_grad_norm = types.MethodType(get_grad_norm, trainer)
    _drive_accelerator(accelerator, state)


def release_accelerator(accelerator: Any, optimizer: Any, *,
                        bucket_bytes: Optional[int] = None, max_grad_norm: Optional[float] = None,
                        clip: str = "exact") -> Any:
    """Gradient release under ``accelerate`` with ``accelerator.prepare(optimizer)`` and
    ``accelerator.accumulate(model)`` / ``gradient_accumulation_steps``: releases ``optimizer``
    (an ``mpext.optim`` optimizer, before ``prepare``) with the Accelerator's scaler when it is
    an ``mpext.GradScaler`` (:func:`use_grad_scaler`), and makes the Accelerator drive it as
    :func:`release_trainer` describes. Returns the ``GradRelease``.

    Under accelerate's DDP the release steps from DDP's comm hook, so it needs the DDP model:
    called after ``accelerator.prepare(model)``, it is made at once with it; called before
    (``prepare(model, optimizer)`` at once), it is made by the ``prepare`` that wraps the model,
    and this returns None (the release is then ``optimizer``'s, made before any backward)."""
    scaler = accelerator.scaler if isinstance(accelerator.scaler, GradScaler) else None
    make = functools.partial(_release, optimizer, "accelerate", bucket_bytes, scaler,
                             max_grad_norm, clip)
    state: dict = {}
    if _ddp_type(accelerator):
        ddp = _ddp_of(accelerator._models, optimizer)
        if ddp is None:  # made by the prepare() that wraps the model in DDP
            state["make"] = make
        else:
            state["release"] = make(ddp)
    else:
        state["release"] = make()
    _drive_accelerator(accelerator, state)
    return state.get("release")


def _release(opt: Any, driver: str, bucket_bytes: Optional[int], scaler: Optional[GradScaler],
             max_grad_norm: Optional[float], clip: str, ddp: Any = None) -> Any:
    from ..optim._base import FusedOptimizer
    if not isinstance(opt, FusedOptimizer):
        raise TypeError("%s: gradient release under %s needs an mpext.optim optimizer (e.g. "
                        "optimizer_cls_and_kwargs=(mpext.optim.AdamW, {...})), got %s"
                        % (_NAME, driver, type(opt).__name__))
    kw = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    if scaler is not None and not scaler.is_enabled():
        scaler = None
    from ..optim._release import driven_by
    with driven_by(driver):
        return opt.release_grads(scaler=scaler, max_grad_norm=max_grad_norm, clip=clip, ddp=ddp,
                                 **kw)


# accelerate's types whose prepare() wraps the model in DistributedDataParallel
_DDP_TYPES = ("MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_MUSA",
              "MULTI_SDAA", "MULTI_HPU")


def _ddp_type(accelerator: Any) -> bool:
    return accelerator.distributed_type.name in _DDP_TYPES


def _ddp_of(objects: Any, opt: Any) -> Any:
    """The DistributedDataParallel module among ``objects`` that holds ``opt``'s params."""
    from torch.nn.parallel import DistributedDataParallel
    mine = {id(p) for g in opt.param_groups for p in g["params"]}
    for obj in objects:
        if isinstance(obj, DistributedDataParallel) and mine <= {
                id(p) for p in obj.module.parameters()}:
            return obj
    return None


def _drive_accelerator(accelerator: Any, state: dict) -> None:
    """The Accelerator's backward through the release, and its wrapper of the released
    optimizer (made by prepare) stepping nothing but the scaler's update."""
    def backward(loss, **kwargs):
        release = state.get("release")
        if release is None or release._handles == []:  # not released (yet), or removed
            return original_backward(loss, **kwargs)
        kwargs.pop("learning_rate", None)
        # as Accelerator.backward (no DeepSpeed here): divided, then scaled
        loss = loss / accelerator.gradient_accumulation_steps
        scaler = release.scaler
        if scaler is not None and scaler.is_enabled():
            loss = scaler.scale(loss)
        if accelerator.sync_gradients:
            release.backward(loss, **kwargs)
        else:
            with release.accumulate():
                loss.backward(**kwargs)

    def prepare(*objects, **kwargs):
        out = original_prepare(*objects, **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        make = state.get("make")
        if make is not None:
            # Under DDP the release steps from DDP's comm hook: made once prepare has wrapped
            # the model, before its first backward
            ddp = _ddp_of(list(outs) + list(accelerator._models), make.args[0])
            if ddp is not None:
                state["release"], state["make"] = make(ddp), None
                for wrapped in accelerator._optimizers:  # a wrapper made by an earlier prepare
                    if getattr(wrapped, "optimizer", None) is make.args[0]:
                        _released_wrapper(wrapped, state["release"])
        for wrapped in outs:
            release = state.get("release")
            if release is not None and getattr(wrapped, "optimizer", None) is release.optimizer:
                _released_wrapper(wrapped, release)
        return out

    original_backward, original_prepare = accelerator.backward, accelerator.prepare
    if accelerator.distributed_type != _DistributedType.NO and not _ddp_type(accelerator):
        raise NotImplementedError(
            "%s: gradient release driven by accelerate runs in one process or under its DDP "
            "(MULTI_CPU, MULTI_GPU, ...); under %s use a plain loop with release_grads() "
            "(FSDP2's sharded params: fully_shard the model yourself) or step after backward"
            % (_NAME, accelerator.distributed_type))
    accelerator.backward = backward
    accelerator.prepare = prepare


def _released_wrapper(wrapped: Any, release: Any) -> None:
    """An AcceleratedOptimizer around a released optimizer: step() is the scaler's update()
    (once per optimizer step, as accelerate's step calls it), zero_grad() nothing."""
    def step(closure=None):
        if closure is not None:
            raise RuntimeError("%s: a closure cannot run in a released step (the step is made "
                               "inside backward)" % _NAME)
        if wrapped.gradient_state.sync_gradients and release.scaler is not None \
                and release.scaler.is_enabled():
            release.scaler.update()
        wrapped._is_overflow = False  # mpext's schedules hold still on the device instead

    def zero_grad(set_to_none=None):
        pass

    wrapped.step = step
    wrapped.zero_grad = zero_grad
