"""Framework detection for gradient release: Lightning automatic optimization, accelerate's
AcceleratedOptimizer and gradient accumulation, transformers.Trainer, recognised by their
objects on the Python stack of the call, so that a release they would drive without an mpext
integration is refused by name with the way out (docs/gradient_release.md, "Frameworks that
step the optimizer themselves"). Registers itself with mpext.optim._release when imported
(optim imports no integration)."""
import sys
from typing import Optional

from ..optim import _release
from ..optim._release import _scales

# Lightning's automatic optimization calls optimizer.step(closure) (its closure runs
# training_step and backward; the mixed-precision plugins run the closure first and then
# scaler.step), accelerate's AcceleratedOptimizer steps after backward (every
# gradient_accumulation_steps-th one), and transformers.Trainer is built on both of
# accelerate's Accelerator.backward and AcceleratedOptimizer. None can drive a released
# optimizer, which steps inside every backward. They are recognised by the objects on the
# Python stack of the call (the LightningModule, the Trainer, the Accelerator, the
# AcceleratedOptimizer, a precision plugin and its scaler), looked for only in frames of
# those packages' own code and only when the package is imported.

_LIGHTNING = ("lightning.pytorch", "pytorch_lightning")
_HF = ("accelerate", "transformers")

_WAY_OUT = ("let the framework drive the release through mpext's integration "
            "(mpext.accelerate.release_trainer(trainer) before trainer.train() for the HF "
            "Trainer; mpext.accelerate.release_accelerator(accelerator, optimizer) before "
            "accelerator.prepare; mpext.lightning.ReleaseGrads() as a Lightning callback), or "
            "use a plain loop (loss.backward() or release.backward(loss), no optimizer.step(); "
            "examples/grad_release_train.py; micro-batches through release.accumulate()) or "
            "Lightning manual optimization (automatic_optimization = False, "
            "self.manual_backward(loss), no opt.step(); examples/lightning_grad_release.py)")


def _stack(all_threads: bool):
    """The Python frames of this call, innermost first; with ``all_threads``, those of every
    thread (a post-accumulate-grad hook of a CUDA param runs on autograd's device thread,
    while the frames of whoever called backward are on the thread that waits for it)."""
    f = sys._getframe(1)
    while f is not None:
        yield f
        f = f.f_back
    if all_threads:
        me = sys._getframe(0)
        for frame in list(sys._current_frames().values()):
            while frame is not None:
                if frame is me:
                    break
                yield frame
                frame = frame.f_back


def _classes(*names):
    """The classes ``"module:Class"`` whose modules are imported (never importing one)."""
    out = []
    for name in names:
        mod, _, cls = name.partition(":")
        m = sys.modules.get(mod)
        c = getattr(m, cls, None) if m is not None else None
        if isinstance(c, type):
            out.append(c)
    return tuple(out)


def _lightning_context(all_threads: bool):
    """(module, plugin): the LightningModule a Lightning Trainer is running on this stack (or
    None), and the precision plugin whose backward is on it (or None)."""
    if not any(n in sys.modules for n in _LIGHTNING):
        return None, None
    modules = _classes("lightning.pytorch.core.module:LightningModule",
                       "pytorch_lightning.core.module:LightningModule")
    trainers = _classes("lightning.pytorch.trainer.trainer:Trainer",
                        "pytorch_lightning.trainer.trainer:Trainer")
    plugins = _classes("lightning.pytorch.plugins.precision.precision:Precision",
                       "pytorch_lightning.plugins.precision.precision:Precision")
    module = plugin = None
    for f in _stack(all_threads):
        if not (f.f_globals.get("__name__") or "").startswith(_LIGHTNING):
            continue
        local = f.f_locals
        for key in ("self", "model", "pl_module", "module", "trainer"):
            obj = local.get(key)
            if module is None and isinstance(obj, modules):
                module = obj
            elif module is None and isinstance(obj, trainers):
                module = obj.lightning_module
            elif plugin is None and isinstance(obj, plugins):
                plugin = obj
        if module is not None and plugin is not None:
            break
    if module is not None and getattr(module, "_trainer", None) is None:
        module = None  # a LightningModule outside a Trainer (Fabric, a plain loop)
    if module is not None:  # the plugin the Trainer runs (its backward may be all its own)
        plugin = getattr(module._trainer, "precision_plugin", None) or plugin
    return module, plugin


def _hf_context(all_threads: bool):
    """(trainer, accelerator, wrapper): the transformers.Trainer, accelerate Accelerator and
    AcceleratedOptimizer found on this stack (None each where there is none)."""
    if not any(n in sys.modules for n in _HF):
        return None, None, None
    trainers = _classes("transformers.trainer:Trainer")
    accelerators = _classes("accelerate.accelerator:Accelerator")
    wrappers = _classes("accelerate.optimizer:AcceleratedOptimizer")
    trainer = accelerator = wrapper = None
    for f in _stack(all_threads):
        if not (f.f_globals.get("__name__") or "").startswith(_HF):
            continue
        obj = f.f_locals.get("self")
        if trainer is None and isinstance(obj, trainers):
            trainer = obj
        elif accelerator is None and isinstance(obj, accelerators):
            accelerator = obj
        elif wrapper is None and isinstance(obj, wrappers):
            wrapper = obj
    return trainer, accelerator, wrapper


def framework_refusal(name: str, opt, scaler, in_backward: bool = False,
                      wrapped: bool = False) -> Optional[str]:
    """Why a framework on this call's stack cannot drive ``opt``, released (with ``scaler``,
    or None) and named ``name`` in the message, with the way out, or None: Lightning automatic
    optimization, transformers.Trainer, accelerate's AcceleratedOptimizer (``wrapped``: known
    to wrap ``opt``), an Accelerator accumulating gradients, and (``in_backward``: called at
    the first gradient of a backward, whose caller may be on another thread) a loss scaled by a
    Lightning precision plugin's or an Accelerator's scaler that is not ``scaler``."""
    module, plugin = _lightning_context(in_backward)
    if module is not None and module.automatic_optimization:
        return ("%s: gradient release cannot run under Lightning automatic optimization "
                "(%s.automatic_optimization is True): Lightning calls optimizer.step(closure) "
                "itself, its closure running training_step and backward, while a released "
                "optimizer steps inside backward. Use Lightning manual optimization: set "
                "self.automatic_optimization = False in the LightningModule's __init__ and call "
                "self.manual_backward(loss) in training_step, which steps (no opt.step(), no "
                "zero_grad(); examples/lightning_grad_release.py); or keep automatic "
                "optimization and let it drive the release: lightning.Trainer(callbacks="
                "[mpext.lightning.ReleaseGrads()]) instead of calling release_grads() yourself"
                % (name, type(module).__name__))
    theirs = None
    if plugin is not None and in_backward:  # Lightning's plugins: scaler; mpext's: _scaler
        theirs = getattr(plugin, "scaler", None) or getattr(plugin, "_scaler", None)
    if _scales(theirs) and theirs is not scaler:
        return ("%s: Lightning's precision plugin %s scales the loss with its own %s, which this "
                "release was not made with, so its buckets would step with scaled gradients. "
                "Use a plugin that does not scale (precision=\"16-true\", \"bf16-true\" or "
                "32) and scale the loss yourself with an mpext.GradScaler passed to "
                "release_grads(scaler=...): self.manual_backward(scaler.scale(loss)), then "
                "scaler.update()" % (name, type(plugin).__name__, type(theirs).__name__))
    trainer, accelerator, wrapper = _hf_context(in_backward)
    if trainer is not None:
        return ("%s: gradient release cannot run under transformers.Trainer (HF Trainer): it "
                "steps the optimizer itself after backward, through accelerate's "
                "AcceleratedOptimizer, while a released optimizer steps inside every backward. "
                "The way out: %s" % (name, _WAY_OUT))
    if wrapped or wrapper is not None or (accelerator is not None and any(
            getattr(o, "optimizer", None) is opt for o in accelerator._optimizers)):
        return ("%s: gradient release cannot run with accelerate's AcceleratedOptimizer "
                "(accelerator.prepare(optimizer)): it steps the optimizer after backward (with "
                "gradient_accumulation_steps > 1 every N-th), while a released optimizer steps "
                "inside every backward. Do not pass the optimizer to accelerator.prepare; the "
                "way out: %s" % (name, _WAY_OUT))
    if accelerator is not None and accelerator.gradient_accumulation_steps > 1:
        return ("%s: gradient release cannot run under accelerate's gradient accumulation "
                "(gradient_accumulation_steps=%d): each backward would step. The way out: %s"
                % (name, accelerator.gradient_accumulation_steps, _WAY_OUT))
    if in_backward and accelerator is not None and _scales(accelerator.scaler) \
            and accelerator.scaler is not scaler:
        return ("%s: accelerator.backward scales the loss with the Accelerator's %s, which this "
                "release was not made with, so its buckets would step with scaled gradients. "
                "Pass that scaler to release_grads(scaler=...) (an mpext.GradScaler, e.g. from "
                "mpext.accelerate.use_grad_scaler), or the way out: %s"
                % (name, type(accelerator.scaler).__name__, _WAY_OUT))
    return None


def accelerate_wrapper_on_stack() -> bool:
    """Whether accelerate's AcceleratedOptimizer is on this call's stack (wrapping an
    optimizer in accelerator.prepare reads its state_dict)."""
    return bool(_classes("accelerate.optimizer:AcceleratedOptimizer")) \
        and _hf_context(False)[2] is not None


_release._detector = sys.modules[__name__]
