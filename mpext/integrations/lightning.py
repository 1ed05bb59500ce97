"""mpext.lightning: a Lightning precision plugin that trains with BF16/FP16 params, FP32 master
weights (or mpext's leaner storage), loss scaling, fused clipping after unscaling and the
inf/NaN skip, all on the device.

    trainer = lightning.Trainer(plugins=[mpext.lightning.MixedPrecision("bf16")], ...)
    fabric = lightning.Fabric(plugins=[mpext.lightning.MixedPrecision("fp16")], ...)

What Lightning's own plugins lack and this one adds (docs/integrations.md has the measurements):
``bf16-true``/``16-true`` keep no FP32 masters (updates smaller than half a unit in the last
place are lost) and have no loss scaling or inf/NaN skip; ``bf16-mixed`` refuses any scaler,
so a BF16 run never skips an inf/NaN step; ``16-mixed`` refuses gradient clipping with an
optimizer that unscales inside its step (a fused one).

How: ``convert_module`` casts the model's floating params and buffers to the compute dtype
(modules named in ``keep_fp32`` stay FP32, with their inputs cast to FP32 and outputs back).
Two kinds of optimizer:

* an ``mpext.optim`` optimizer keeps its own storage of the FP32 value (master, remainder, or
  none) and takes ``grad_scale``/``found_inf`` in its fused step, so the plugin drives it
  directly through one ``mpext.GradScaler`` (FP16: the dynamic scale; BF16: ``bf16_check_only``,
  the scale held at 1): ``scaler.step`` runs the fused read-only inf/NaN check and hands
  ``found_inf`` to the step, which is skipped on the device. Every storage format thus gets the
  skip. Clipping measures the norm of the unscaled gradients (``mpext.ops.grad_norm``) and
  folds the coefficient into the step's unscale. The scaler's state is the plugin's
  ``state_dict``, which Lightning checkpoints.
* any other optimizer is wrapped in an ``mpext.MixedPrecisionOptimizer`` (FP32 masters;
  torch's Adam/AdamW take the fused ``adam_step_`` path, any other optimizer runs its own math
  on the masters); the loss is scaled through the wrapper; clipping is the wrapper's
  ``clip_grad_norm_``. The wrappers' ``state_dict`` carries the masters and the loss scale.

Either way steps with an inf/NaN gradient are skipped on the device in BF16 too, a Lightning
checkpoint resumes bit for bit, and schedulers from ``mpext.optim.lr_scheduler`` hold still on
skipped steps (they read the ``found_inf`` the step received, or the wrapper's skip flag).
"""
import contextlib
import fnmatch
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Union

import torch

try:
    import lightning.pytorch as _pl
    from lightning.pytorch.plugins.precision import Precision as _Precision
    from lightning.pytorch.utilities import GradClipAlgorithmType as _ClipAlgo
except ImportError as _exc:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "mpext.lightning needs the Lightning package (lightning.pytorch), which could not be "
        "imported (%s). Install it with `pip install lightning`." % _exc) from _exc

from .. import ops as _mp_ops
from ..amp.grad_scaler import GradScaler
from ..amp._checks import checked_state_dict as _checked_state_dict
from ..amp.mixed_precision import MixedPrecisionOptimizer, _make_scaler

__all__ = ["MixedPrecision", "ReleaseGrads"]

_DTYPES = {"bf16": torch.bfloat16, "bf16-true": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "16": torch.float16, "16-true": torch.float16,
           "float16": torch.float16}
_NAME = "mpext.lightning.MixedPrecision"


def _drives_itself(optimizer: Any) -> bool:
    """Whether the plugin steps ``optimizer`` as it is: an ``mpext.optim`` optimizer, which
    keeps its own FP32 value (or a leaner one) and skips on ``found_inf`` in its fused step.
    Other optimizers (torch's fused ones included) get the FP32-master wrapper."""
    return (isinstance(optimizer, torch.optim.Optimizer)
            and type(optimizer).__module__.startswith("mpext.optim")
            and getattr(optimizer, "_step_supports_amp_scaling", False))


def _cast_floating(data: Any, dtype: torch.dtype) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(dtype) if data.is_floating_point() and data.dtype != dtype else data
    if isinstance(data, (list, tuple)) and not hasattr(data, "_fields"):
        return type(data)(_cast_floating(d, dtype) for d in data)
    if isinstance(data, tuple):  # a namedtuple
        return type(data)(*(_cast_floating(d, dtype) for d in data))
    if isinstance(data, dict):
        return type(data)((k, _cast_floating(v, dtype)) for k, v in data.items())
    return data


class MixedPrecision(_Precision):
    """Lightning precision plugin: BF16/FP16 model params with FP32 masters (or the leaner
    storage of an ``mpext.optim`` optimizer), loss scaling, clipping and the inf/NaN skip.

    Args:
        precision: ``"bf16"`` or ``"fp16"`` (``"bf16-true"``/``"16-true"`` are accepted too).
        keep_fp32: modules to keep in FP32 (e.g. normalization layers): module classes, or
            glob patterns matched against qualified module names (``"encoder.*.norm"``). Their
            floating inputs are cast to FP32 and their floating outputs back to the compute
            dtype. Default: none.
        loss_scale: ``"dynamic"`` (the default for ``"fp16"``), a fixed positive number, or
            ``None`` (the default for ``"bf16"``: no scaling; steps with an inf/NaN gradient
            are still skipped).
        **scaler_options: options of ``mpext.GradScaler`` for the loss scale
            (``init_scale``, ``growth_interval``, ``hysteresis``, ``min_scale``, ...), as
            ``mpext.MixedPrecisionOptimizer`` takes them.

    ``mpext.optim`` optimizers (every storage format: FP32 masters, ``param_remainders``,
    BF16 or 8-bit moments, ``master_weights=False``) are stepped as they are, through the
    plugin's ``mpext.GradScaler``: their fused step unscales, clips and skips on the device.
    Any other optimizer is wrapped in an ``mpext.MixedPrecisionOptimizer`` (FP32 masters).

    With the Trainer, nothing else is needed: the optimizers from ``configure_optimizers`` are
    taken over when the Trainer connects the plugin, ``gradient_clip_val`` (algorithm
    ``"norm"``) clips after unscaling without a host sync, and checkpoints hold the masters and
    the scale. With Fabric, pass an ``mpext.optim`` optimizer to ``fabric.setup_optimizers`` as
    it is (keep the plugin in the state given to ``fabric.save``/``fabric.load``: it holds the
    FP16 scale); wrap any other one with :meth:`wrap_optimizer` after ``fabric.setup_module``
    (so that its params are already converted) and pass the wrapper to
    ``fabric.setup_optimizers``; its ``state_dict`` then holds the masters and the scale. Clip
    with :meth:`clip_gradients` (``fabric.clip_gradients`` runs torch's clipping on the
    gradients as they are, scaled under FP16, and raises here). A torch optimizer handed to
    Fabric unwrapped is wrapped at its first step (a warning says that its checkpoints will
    then lack the masters and the scale).

    FP16 loss scaling covers one optimizer (the scale of a backward pass belongs to the
    optimizer that steps it); with several, use BF16 or one plugin-wrapped optimizer.
    """

    def __init__(self, precision: str = "bf16", *, keep_fp32: Iterable[Any] = (),
                 loss_scale: Any = "auto", **scaler_options: Any) -> None:
        if precision not in _DTYPES:
            raise ValueError("%s: precision must be 'bf16' or 'fp16', got %r"
                             % (_NAME, precision))
        self._dtype = _DTYPES[precision]
        self.precision = "bf16-true" if self._dtype == torch.bfloat16 else "16-true"
        if loss_scale == "auto":
            loss_scale = "dynamic" if self._dtype == torch.float16 else None
        self._loss_scale = loss_scale
        self._scaler_options = dict(scaler_options)
        keep = list(keep_fp32) if not isinstance(keep_fp32, (str, type)) else [keep_fp32]
        for k in keep:
            if not (isinstance(k, str) or (isinstance(k, type)
                                           and issubclass(k, torch.nn.Module))):
                raise TypeError("%s: keep_fp32 entries must be nn.Module classes or name "
                                "patterns, got %r" % (_NAME, k))
        self._keep = keep
        # Fail now, not at the first step, on options the wrapper would reject: build one on a
        # throwaway param (no state is kept from it).
        probe = torch.zeros(1, dtype=self._dtype, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._make_wrapper(torch.optim.SGD([probe], lr=0.0))
        self._wrappers: Dict[int, MixedPrecisionOptimizer] = {}  # id(raw or wrapper) -> wrapper
        # The mpext.optim optimizers the plugin steps as they are, and the one scaler they
        # share (made on the device of the first loss or step; its state may be loaded first).
        self._direct: Dict[int, torch.optim.Optimizer] = {}
        self._scaler: Optional[GradScaler] = None
        self._scaler_state: Optional[Dict[str, Any]] = None
        # id(optimizer stepped as it is) -> this iteration's clip coefficient (a device tensor)
        self._clip_coef: Dict[int, torch.Tensor] = {}

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the converted params (torch.bfloat16 or torch.float16)."""
        return self._dtype

    # -----------------------------------------------------------------------------------------
    # The model.

    def _kept_modules(self, module: torch.nn.Module) -> List[torch.nn.Module]:
        kept = []
        for name, m in module.named_modules():
            for k in self._keep:
                if (isinstance(k, type) and isinstance(m, k)) or (
                        isinstance(k, str) and fnmatch.fnmatchcase(name, k)):
                    kept.append(m)
                    break
        return kept

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Casts the floating params and buffers to the compute dtype in place (the Parameter
        objects stay, so optimizers made before keep working), except those of the
        ``keep_fp32`` modules, which get hooks casting their inputs to FP32 and their outputs
        back."""
        kept = self._kept_modules(module)
        keep_ids = {id(t) for m in kept for t in list(m.parameters()) + list(m.buffers())}
        dtype = self._dtype
        module._apply(lambda t: t.to(dtype) if t.is_floating_point() and id(t) not in keep_ids
                      else t)
        for m in kept:
            if getattr(m, "_mpext_fp32_hooks", None) is None:
                m._mpext_fp32_hooks = (
                    m.register_forward_pre_hook(
                        lambda _m, args, kwargs: (_cast_floating(args, torch.float32),
                                                  _cast_floating(kwargs, torch.float32)),
                        with_kwargs=True),
                    m.register_forward_hook(
                        lambda _m, _args, out: _cast_floating(out, self._dtype)))
        return module

    def forward_context(self):
        """Tensors made during the forward pass default to the compute dtype, as in Lightning's
        ``bf16-true``/``16-true``."""
        return _default_dtype(self._dtype)

    def convert_input(self, data: Any) -> Any:
        return _cast_floating(data, self._dtype)

    def convert_output(self, data: Any) -> Any:
        """Fabric: floating outputs back to torch's default dtype (the loss in FP32)."""
        return _cast_floating(data, torch.get_default_dtype())

    # -----------------------------------------------------------------------------------------
    # The optimizers.

    def _make_wrapper(self, optimizer: torch.optim.Optimizer) -> MixedPrecisionOptimizer:
        return MixedPrecisionOptimizer(optimizer, loss_scale=self._loss_scale,
                                       **self._scaler_options)

    def wrap_optimizer(self, optimizer: Any) -> torch.optim.Optimizer:
        """What the plugin steps for ``optimizer``: an ``mpext.optim`` optimizer itself (it
        keeps its own storage and skips in its fused step), any other one the
        ``mpext.MixedPrecisionOptimizer`` around it (made on the first call; the same one
        after). ``optimizer``'s params must already be converted (call it after
        ``convert_module``, e.g. after ``fabric.setup_module``). Framework wrappers (Fabric's,
        Lightning's) are looked through."""
        opt = _unwrap(optimizer)
        found = self._wrappers.get(id(opt), self._direct.get(id(opt)))
        if found is not None:
            return found
        if isinstance(opt, MixedPrecisionOptimizer):
            self._check_wrapper(opt)
            self._check_one_scale()
            self._wrappers[id(opt)] = opt
            return opt
        low = [p for g in opt.param_groups for p in g["params"] if p.dtype == self._dtype]
        if not low:
            raise ValueError(
                "%s: the optimizer's params are not %s: the module was not converted yet. Call "
                "wrap_optimizer after convert_module (fabric.setup_module / fabric.setup), on an "
                "optimizer made over the converted module's params"
                % (_NAME, str(self._dtype).replace("torch.", "")))
        self._check_one_scale()
        if _drives_itself(opt):
            self._direct[id(opt)] = opt
            return opt
        wrapper = self._make_wrapper(opt)
        self._wrappers[id(opt)] = wrapper
        self._wrappers[id(wrapper)] = wrapper
        return wrapper

    def _check_one_scale(self) -> None:
        if self._loss_scale is not None and (self._wrappers or self._direct):
            raise NotImplementedError(
                "%s: FP16 loss scaling with several optimizers is not supported (each wrapper "
                "keeps its own scale, and a backward pass can carry only one); use precision="
                "'bf16', or one optimizer over all params" % _NAME)

    def _check_wrapper(self, wrapper: MixedPrecisionOptimizer) -> None:
        if wrapper.loss_scale != self._loss_scale:
            raise ValueError("%s: the MixedPrecisionOptimizer has loss_scale=%r but the plugin "
                             "has loss_scale=%r" % (_NAME, wrapper.loss_scale, self._loss_scale))

    def connect(self, model: torch.nn.Module, optimizers: List[Any],
                lr_schedulers: List[Any]):
        """Trainer: takes over every optimizer: an ``mpext.optim`` one stays as it is, any
        other is wrapped (the wrappers replace them in the Trainer, so the checkpoints save the
        wrappers' state)."""
        return model, [self.wrap_optimizer(o) for o in optimizers], lr_schedulers

    def _the_wrapper(self, optimizer: Any) -> torch.optim.Optimizer:
        """What steps ``optimizer`` (see :meth:`wrap_optimizer`), taken over at its first step
        if it was not before (Fabric)."""
        opt = _unwrap(optimizer)
        found = self._wrappers.get(id(opt), self._direct.get(id(opt)))
        if found is None:
            if not isinstance(opt, MixedPrecisionOptimizer) and not _drives_itself(opt):
                warnings.warn(
                    "%s: wrapping %s at its first step: its checkpoints (state_dict) will not "
                    "hold the FP32 masters and the loss scale. With Fabric, pass "
                    "plugin.wrap_optimizer(optimizer) to fabric.setup_optimizers instead"
                    % (_NAME, type(opt).__name__), UserWarning, stacklevel=3)
            found = self.wrap_optimizer(opt)
        return found

    def _direct_scaler(self, device: torch.device) -> GradScaler:
        """The scaler of the optimizers the plugin steps as they are (made on first use)."""
        if self._scaler is None:
            scaler = _make_scaler(self._loss_scale, device, self._scaler_options)
            if self._scaler_state is not None:
                scaler.load_state_dict(self._scaler_state)
                self._scaler_state = None
            self._scaler = scaler
        return self._scaler

    def _scale_loss(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._loss_scale is None:
            return tensor
        wrappers = {id(w): w for w in self._wrappers.values()}
        if len(wrappers) == 1:
            return next(iter(wrappers.values())).scale_loss(tensor)
        # An optimizer stepped as it is, or (Fabric) none stepped yet: the plugin's scaler,
        # whose scale a wrapper made at the first step also starts with.
        return self._direct_scaler(tensor.device).scale(tensor)

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        if _in_trainer(module):
            return super().pre_backward(tensor, module)
        return tensor

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        """Backpropagates the loss times the loss scale (through the wrapper's
        ``scale_loss``, so the wrapper knows its gradients carry the scale)."""
        scaled = self._scale_loss(tensor)
        if _in_trainer(model):  # Lightning: (tensor, model, optimizer, *args)
            model.backward(scaled, *args[1:], **kwargs)
        else:
            scaled.backward(*args, **kwargs)

    def post_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        if _in_trainer(module):
            return super().post_backward(tensor, module)
        return tensor.detach()

    def optimizer_step(self, optimizer: Any, model: Any = None,
                       closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        """Trainer: runs the closure (forward and backward), the pre-step hooks and clipping,
        then the step (skipped on the device on an inf/NaN gradient). Fabric: the step."""
        wrapper = self._the_wrapper(optimizer)
        direct = wrapper is _unwrap(optimizer) and id(wrapper) in self._direct
        if not _in_trainer(model):
            if not direct:
                if closure is not None:
                    kwargs["closure"] = closure
                return wrapper.step(**kwargs)
            if kwargs:
                raise TypeError("%s.optimizer_step: unexpected arguments %s"
                                % (_NAME, sorted(kwargs)))
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._step_direct(wrapper)
            return loss
        if kwargs:
            raise TypeError("%s.optimizer_step: unexpected arguments %s" % (_NAME,
                                                                             sorted(kwargs)))
        closure_result = closure()
        self._after_closure(model, optimizer)
        # As Lightning's own plugins: a training_step that returned None made no gradients.
        if closure_result is None and model.automatic_optimization:
            self._clip_coef.pop(id(wrapper), None)
            return closure_result
        if direct:
            self._step_direct(wrapper)
            return closure_result
        wrapper.step()
        inner = wrapper.optimizer
        if hasattr(inner.step, "_wrapped_by_lr_sched"):
            # torch's schedulers on the inner optimizer warn unless its step ran; the fused
            # path steps its params without calling it
            inner._opt_called = True
        return closure_result

    def clip_gradients(self, optimizer: Any, clip_val: Union[int, float] = 0.0,
                       gradient_clip_algorithm: Any = _ClipAlgo.NORM) -> Optional[torch.Tensor]:
        """Clips this iteration's gradients to the total L2 norm ``clip_val``, measured after
        unscaling, through the wrapper's fused norm: no host sync, the coefficient is applied
        inside the step. Returns the total norm before clipping (a device tensor).
        ``gradient_clip_algorithm="value"`` is refused: clamping the (scaled) gradients would
        turn an inf into a finite value before the overflow check sees it."""
        if clip_val is None or clip_val <= 0:
            return None
        if _ClipAlgo(gradient_clip_algorithm) != _ClipAlgo.NORM:
            raise NotImplementedError(
                "%s: gradient_clip_algorithm=%r is not supported: clamping the gradients before "
                "the inf/NaN check would hide an overflow from it; use 'norm'"
                % (_NAME, str(gradient_clip_algorithm)))
        wrapper = self._the_wrapper(optimizer)
        if id(wrapper) not in self._direct:
            return wrapper.clip_grad_norm_(float(clip_val))
        return self._clip_direct(wrapper, float(clip_val))

    def _inv_scale(self, opt: torch.optim.Optimizer) -> torch.Tensor:
        """1 / scale, as GradScaler.unscale_ computes it, times the clip coefficient so far."""
        inv = self._direct_scaler(_device_of(opt))._scale_on(_device_of(opt))
        inv = inv.double().reciprocal().float()
        coef = self._clip_coef.get(id(opt))
        return inv if coef is None else inv * coef

    def _clip_direct(self, opt: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """torch's clip_grad_norm_ coefficient, from the norm of the unscaled gradients
        (one read-only pass, on the device); the step applies it in its unscale."""
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=_device_of(opt))
        norm = _mp_ops.grad_norm(grads, inv_scale=self._inv_scale(opt))
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch's expression
        prev = self._clip_coef.get(id(opt))
        self._clip_coef[id(opt)] = coef if prev is None else prev * coef
        return norm

    def _step_direct(self, opt: torch.optim.Optimizer) -> None:
        """The GradScaler protocol: ``scaler.step`` runs the fused read-only inf/NaN check and
        hands the optimizer ``found_inf`` (and the scale), so its fused step unscales and is
        skipped on the device; the scale is then updated on the device."""
        device = _device_of(opt)
        scaler = self._direct_scaler(device)
        scale = scaler._scale_on(device)
        coef = self._clip_coef.pop(id(opt), None)
        kwargs = {}
        if coef is not None:
            # The step unscales by 1 / grad_scale: the clip coefficient folded in. A NaN
            # coefficient comes only from a NaN/Inf gradient, whose step is skipped anyway.
            kwargs["grad_scale"] = scale / coef
        scaler.step(opt, **kwargs)
        scaler.update()

    def unscale_gradients(self, optimizer: Any) -> None:
        raise RuntimeError(
            "%s: fabric.clip_gradients runs torch's clipping on the gradients as they are "
            "(multiplied by the loss scale under FP16) with a host sync; call "
            "plugin.clip_gradients(optimizer, max_norm) instead (fused clipping after "
            "unscaling, no host sync)" % _NAME)

    # -----------------------------------------------------------------------------------------
    # Checkpoints: the wrappers' state_dicts (saved as the Trainer's optimizer states) hold the
    # masters and the scale; the plugin's own state is its configuration, checked on load.

    def state_dict(self) -> Dict[str, Any]:
        """The configuration, and the state of the scaler of the ``mpext.optim`` optimizers
        stepped as they are (``"scaler"``, once there is one): the FP16 scale and the skip
        counters."""
        out = {"dtype": str(self._dtype).replace("torch.", ""), "loss_scale": self._loss_scale}
        if self._scaler is not None:
            out["scaler"] = self._scaler.state_dict()
        elif self._scaler_state is not None:
            out["scaler"] = self._scaler_state
        return out

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if not state_dict:
            return
        mine = self.state_dict()
        if state_dict.get("dtype", mine["dtype"]) != mine["dtype"]:
            raise ValueError("%s: the checkpoint was saved with %s params but this plugin "
                             "trains in %s" % (_NAME, state_dict["dtype"], mine["dtype"]))
        scaler_state = state_dict.get("scaler")
        if scaler_state is not None:
            if not isinstance(scaler_state, dict):
                raise TypeError("%s.load_state_dict: 'scaler' must be a GradScaler state_dict, "
                                "got %s" % (_NAME, type(scaler_state).__name__))
            if self._scaler is not None:
                self._scaler.load_state_dict(scaler_state)
            else:  # checked now, loaded into the scaler when it is made
                _checked_state_dict(scaler_state, 1)
                self._scaler_state = dict(scaler_state)

    def __repr__(self) -> str:
        return "%s(%r, keep_fp32=%r, loss_scale=%r)" % (
            _NAME, "bf16" if self._dtype == torch.bfloat16 else "fp16", self._keep,
            self._loss_scale)


def _in_trainer(module: Any) -> bool:
    """Whether the call comes from Lightning's Trainer (a LightningModule attached to one)
    rather than from Fabric."""
    return isinstance(module, _pl.LightningModule) and module._trainer is not None


def _device_of(optimizer: torch.optim.Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")


def _unwrap(optimizer: Any) -> Any:
    """The optimizer inside Lightning's LightningOptimizer or Fabric's _FabricOptimizer."""
    for _ in range(4):
        inner = optimizer.__dict__.get("_optimizer") if hasattr(optimizer, "__dict__") else None
        if inner is None or inner is optimizer:
            return optimizer
        optimizer = inner
    return optimizer


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class ReleaseGrads(_pl.Callback):
    """Gradient release (docs/gradient_release.md) under Lightning's automatic optimization:
    ``lightning.Trainer(callbacks=[mpext.lightning.ReleaseGrads(...)])`` releases each
    ``mpext.optim`` optimizer ``configure_optimizers`` returns, when fitting starts. Then:

    - the optimizer's ``step(closure)`` runs the closure (training_step and backward, which
      steps the params) and the scaler's ``update()``; ``zero_grad()`` has nothing to clear;
    - the LightningModule's ``backward`` runs the release's (``release.backward``: exact
      clipping's two passes), inside ``release.accumulate()`` on the batches Lightning
      accumulates (``accumulate_grad_batches``), so the last one steps with the sum;
    - ``gradient_clip_val`` (the "norm" algorithm) is the release's ``max_grad_norm``.

    ``scaler``: an ``mpext.GradScaler`` for the inf/NaN skip (``bf16_check_only=True`` for
    FP32/BF16, whose loss is not scaled); the schedules of ``mpext.optim.lr_scheduler`` hold
    still on a skipped step. Its state is this callback's ``state_dict`` (checkpointed).
    Precision plugins that scale the loss themselves (``16-mixed``, ``MixedPrecision("fp16")``)
    are refused: scale with ``scaler`` instead (a plugin that does not scale)."""

    def __init__(self, *, bucket_bytes: Optional[int] = None, scaler: Optional[GradScaler] = None,
                 clip: str = "exact") -> None:
        if scaler is not None and not isinstance(scaler, GradScaler):
            raise TypeError("mpext.lightning.ReleaseGrads: scaler must be an mpext.GradScaler, "
                            "got %s" % type(scaler).__name__)
        self.bucket_bytes, self.scaler, self.clip = bucket_bytes, scaler, clip
        self.releases: List[Any] = []

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        from ..optim._base import FusedOptimizer
        from ..optim._release import driven_by
        name = "mpext.lightning.ReleaseGrads"
        if not pl_module.automatic_optimization:
            raise RuntimeError("%s is for automatic optimization; under manual optimization "
                               "call release_grads() yourself (examples/lightning_grad_release"
                               ".py)" % name)
        plugin = trainer.precision_plugin
        theirs = getattr(plugin, "scaler", None) or getattr(plugin, "_scaler", None)
        if theirs is not None and theirs.is_enabled() \
                and not getattr(theirs, "bf16_check_only", False):
            raise RuntimeError("%s: the precision plugin %s scales the loss with its own %s; use "
                               "a plugin that does not scale (precision=32, \"bf16-mixed\", "
                               "\"bf16-true\") and pass an mpext.GradScaler as scaler="
                               % (name, type(plugin).__name__, type(theirs).__name__))
        clip_val = trainer.gradient_clip_val
        max_norm = None
        if clip_val:
            if str(trainer.gradient_clip_algorithm) not in ("norm", "GradClipAlgorithmType.NORM"):
                raise ValueError("%s: gradient_clip_algorithm=%r; a released step clips by the "
                                 "global norm only (\"norm\")"
                                 % (name, trainer.gradient_clip_algorithm))
            max_norm = float(clip_val)
            if self.clip == "exact" and trainer.accumulate_grad_batches > 1:
                raise ValueError("%s: gradient_clip_val with accumulate_grad_batches=%d and "
                                 "clip=\"exact\": its norm pass would free the accumulated "
                                 "gradients; pass clip=\"previous\""
                                 % (name, trainer.accumulate_grad_batches))
        kw = {} if self.bucket_bytes is None else {"bucket_bytes": self.bucket_bytes}
        # Lightning's DDP strategies (strategy="ddp", "ddp_spawn", ...) wrap the module in
        # DistributedDataParallel before fitting starts: the release then steps from DDP's
        # comm hook, on the averaged gradients (the batches Lightning accumulates run under
        # its no_sync and release.accumulate())
        from torch.nn.parallel import DistributedDataParallel
        wrapped = getattr(trainer.strategy, "model", None)
        if isinstance(wrapped, DistributedDataParallel):
            kw["ddp"] = wrapped
        for opt in trainer.optimizers:
            inner = _unwrap(opt)
            if not isinstance(inner, FusedOptimizer):
                raise TypeError("%s: %s is not an mpext.optim optimizer; gradient release "
                                "needs one" % (name, type(inner).__name__))
            with driven_by("lightning"):
                release = inner.release_grads(scaler=self.scaler, max_grad_norm=max_norm,
                                              clip=self.clip, **kw)
            self.releases.append(release)
            inner.step = self._step(release)
            inner.zero_grad = lambda set_to_none=True: None
        if len(self.releases) != 1:
            raise NotImplementedError("%s: %d optimizers; release drives one (its backward is "
                                      "the LightningModule's)" % (name, len(self.releases)))
        release = self.releases[0]
        loop = trainer.fit_loop.epoch_loop

        def backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            if loop._should_accumulate():
                with release.accumulate():
                    loss.backward(*args, **kwargs)
            else:
                release.backward(loss, *args, **kwargs)

        pl_module.backward = backward

    def _step(self, release: Any) -> Callable:
        scaler = self.scaler

        def step(closure: Optional[Callable] = None, **kwargs: Any) -> Any:
            out = closure() if closure is not None else None  # its backward steps
            if scaler is not None and scaler.is_enabled():
                scaler.update()
            return out
        return step

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        for release in self.releases:
            opt = release.optimizer
            release.remove()
            for key in ("step", "zero_grad"):  # the class's methods again
                opt.__dict__.pop(key, None)
        self.releases = []
        pl_module.__dict__.pop("backward", None)

    def state_dict(self) -> Dict[str, Any]:
        return {} if self.scaler is None else {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["scaler"])
