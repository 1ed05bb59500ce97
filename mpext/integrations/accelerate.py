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

__all__ = ["use_grad_scaler", "setup_trainer"]

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
