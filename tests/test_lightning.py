"""mpext.integrations.lightning.MixedPrecision (also mpext.lightning) driven by a real
lightning.Trainer and lightning.Fabric on the CPU: BF16 and FP16 runs against an independent
plain-torch loop (FP32 masters, torch's AdamW, torch's clipping, torch's loss-scale rule), the
inf/NaN skip holding the mpext schedule still, bit-identical resume from a checkpoint, Fabric, and
what Lightning's own plugins refuse."""
import functools
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed "
                         "(pip install lightning)")
import lightning  # noqa: E402

from framework_examples import example, same_run  # noqa: E402
import mpext  # noqa: E402
import mpext.integrations.lightning  # noqa: E402
from mpext.optim import lr_scheduler as S  # noqa: E402

# Lightning 2.6 on torch 2.13 (its own code, not mpext's)
pytestmark = pytest.mark.filterwarnings(
    r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated")


# 16 samples, batches of 4: 4 optimizer steps per epoch.
GEN = torch.Generator().manual_seed(0)
X = torch.randn(16, 8, generator=GEN)
Y = torch.randn(16, 1, generator=GEN)
BATCH = 4
LR = 1e-2


def net():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 1))


def warmup(e):
    """The schedule's factor at step e, in torch ops (mpext) and Python (the reference)."""
    if isinstance(e, torch.Tensor):
        return torch.clamp((e + 1) / 4, max=1.0)
    return min((e + 1) / 4, 1.0)


class Tiny(pl.LightningModule):
    def __init__(self, overflow_at=(), clip=None, make_opt=torch.optim.AdamW):
        super().__init__()
        self.net = net()
        self.overflow_at = set(overflow_at)
        self.make_opt = make_opt
        self.lrs, self.applied = [], []

    def training_step(self, batch, i):
        x, y = batch
        loss = F.mse_loss(self.net(x).float(), y.float())
        if self.global_step in self.overflow_at:
            loss = loss * float("inf")
        return loss

    def on_train_batch_end(self, outputs, batch, i):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"].item())

    def configure_optimizers(self):
        opt = self.make_opt(self.parameters(), lr=LR)
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": S.LambdaLR(opt, warmup), "interval": "step"}}


def loader():
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=BATCH,
                                       shuffle=False)


def trainer(plugin, epochs, **kw):
    return pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin], max_epochs=epochs,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, **kw)


def reference(dtype, steps, overflow_at=(), clip=None, scale=None, growth_interval=None):
    """A plain torch loop: the model in ``dtype`` with the LayerNorm in FP32 (inputs cast up,
    output cast back), FP32 masters stepped by torch.optim.AdamW, gradients unscaled and checked
    by hand, torch's clip_grad_norm_, torch's dynamic loss-scale rule, the schedule evaluated
    at the number of applied steps. Returns the masters, the rates seen and the final scale."""
    model = net()
    model[1].register_forward_pre_hook(lambda m, a: (a[0].float(),))
    model[1].register_forward_hook(lambda m, a, out: out.to(dtype))
    for i in (0, 3):
        model[i].to(dtype)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(False) for p in params]
    opt = torch.optim.AdamW(masters, lr=LR, foreach=False)
    applied, tracker, lrs, norms = 0, 0, [], []
    batches = [(X[i:i + BATCH], Y[i:i + BATCH]) for i in range(0, 16, BATCH)]
    for step in range(steps):
        x, y = batches[step % len(batches)]
        loss = F.mse_loss(model(x.to(dtype)).float(), y.to(dtype).float())
        if step in overflow_at:
            loss = loss * float("inf")
        (loss * (scale if scale is not None else 1.0)).backward()
        inv = torch.tensor(1.0 / scale if scale is not None else 1.0, dtype=torch.float32)
        for p, m in zip(params, masters):
            m.grad = p.grad.float() * inv
            p.grad = None
        found = not all(torch.isfinite(m.grad).all() for m in masters)
        if clip is not None and not found:
            norms.append(torch.nn.utils.clip_grad_norm_(masters, clip).item())
        if not found:
            for g in opt.param_groups:
                g["lr"] = LR * warmup(applied)
            opt.step()
            applied += 1
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
        lrs.append(torch.tensor(LR * warmup(applied), dtype=torch.float64).float().item())
        if scale is not None:  # torch's rule (backoff 0.5, growth 2)
            if found:
                scale, tracker = scale * 0.5, 0
            else:
                tracker += 1
                if tracker == growth_interval:
                    scale, tracker = scale * 2.0, 0
    return masters, lrs, scale, norms


def plugin_masters(trainer_):
    wrapper = trainer_.optimizers[0]
    model = trainer_.lightning_module
    out = []
    for p in model.parameters():
        m = wrapper.master_param(p)
        out.append(p.detach().float() if m is None else m.detach())
        if m is not None:
            assert torch.equal(p.detach(), m.to(p.dtype))  # the param is its rounded master
    return out


def assert_masters_close(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


def test_bf16_trainer_against_plain_loop():
    """BF16 params (the LayerNorm kept in FP32), FP32 masters, fused AdamW, gradient clipping
    after unscaling, a NaN step skipped on the device with the schedule held still."""
    plugin = mpext.integrations.lightning.MixedPrecision("bf16", keep_fp32=[nn.LayerNorm])
    model = Tiny(overflow_at={5})
    t = trainer(plugin, 3, gradient_clip_val=0.05)
    t.fit(model, loader())
    assert model.net[0].weight.dtype == torch.bfloat16
    assert model.net[1].weight.dtype == torch.float32
    assert isinstance(t.optimizers[0], mpext.MixedPrecisionOptimizer)
    masters, lrs, _, norms = reference(torch.bfloat16, 12, overflow_at={5}, clip=0.05)
    assert sum(n > 0.05 for n in norms) >= 3  # clipping really engaged
    assert_masters_close(plugin_masters(t), masters)
    assert model.lrs == lrs
    assert t.lr_scheduler_configs[0].scheduler.last_epoch == 11  # 12 steps, one skipped


def test_fp16_trainer_loss_scaling_against_plain_loop():
    """FP16 params, dynamic loss scale (torch's rule, here from 1024 with growth every 3
    steps), two overflowing steps skipped: same masters, rates and scale as the plain loop."""
    plugin = mpext.integrations.lightning.MixedPrecision("fp16", keep_fp32=["net.1"],
                                                         init_scale=1024.0, growth_interval=3)
    model = Tiny(overflow_at={2, 7})
    t = trainer(plugin, 3, gradient_clip_val=1.0)
    t.fit(model, loader())
    masters, lrs, scale, _ = reference(torch.float16, 12, overflow_at={2, 7}, clip=1.0,
                                       scale=1024.0, growth_interval=3)
    assert_masters_close(plugin_masters(t), masters)
    assert model.lrs == lrs
    assert t.optimizers[0].get_scale() == scale
    assert t.optimizers[0].scaler.get_skipped_steps() == 2


def fp16_run_and_resume(tmp_path, make_opt):
    """FP16 (scale from 512, growth every 3 steps), overflows at steps 1 and 10: a 4-epoch
    run, and a 2-epoch run checkpointed and resumed by a new Trainer for 2 more."""
    def fit(epochs, ckpt_path=None):
        model = Tiny(overflow_at={1, 10}, make_opt=make_opt)
        t = trainer(mpext.integrations.lightning.MixedPrecision("fp16", init_scale=512.0,
                                                                growth_interval=3),
                    epochs, gradient_clip_val=0.5)
        t.fit(model, loader(), ckpt_path=ckpt_path)
        return t, model

    t_full, full = fit(4)
    t1, _ = fit(2)
    ckpt = str(tmp_path / "half.ckpt")
    t1.save_checkpoint(ckpt)
    t2, resumed = fit(4, ckpt)
    return t_full, full, t2, resumed


def test_resume_from_checkpoint_is_bit_identical(tmp_path):
    """FP16 with skips in both halves: 2 epochs, checkpoint, a new Trainer resumes for 2 more;
    params, masters, moments, loss scale and schedule equal an uninterrupted 4-epoch run bit for
    bit."""
    t_full, full, t2, resumed = fp16_run_and_resume(tmp_path, torch.optim.AdamW)
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert a.dtype == torch.float16 and torch.equal(a, b)
    for a, b in zip(plugin_masters(t_full), plugin_masters(t2)):
        assert torch.equal(a, b)
    sa, sb = t_full.optimizers[0].state_dict(), t2.optimizers[0].state_dict()
    for i, st in sa["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, sb["optimizer"]["state"][i][k]), (i, k)
    assert sa["scaler"] == sb["scaler"]
    assert full.lrs[8:] == resumed.lrs
    assert t2.lr_scheduler_configs[0].scheduler.last_epoch == 14


class EmaTiny(Tiny):
    """Tiny with mpext.optim.AdamW(ema_decay=...) as its optimizer, recording the masters
    (FP32 values) after every batch."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.masters = []

    def on_train_batch_end(self, outputs, batch, i):
        self.masters.append([m.clone() for m in plugin_masters(self.trainer)])

    def configure_optimizers(self):
        return mpext.optim.AdamW(self.parameters(), lr=LR, ema_decay=0.75)


def ema_state(trainer_):
    """The optimizer's FP32 EMA of each model param's master, in model order (the plugin steps
    mpext.optim.AdamW as it is, so its state is keyed by the model's params)."""
    opt = trainer_.optimizers[0]
    assert isinstance(opt, mpext.optim.AdamW)
    return [opt.state[p]["ema_param"] for p in trainer_.lightning_module.parameters()]


def test_ema_of_the_masters_through_the_plugin_and_a_checkpoint(tmp_path):
    """mpext.optim.AdamW(ema_decay=0.75) returned by configure_optimizers, under the BF16
    plugin (LayerNorm kept FP32) with a NaN step: the EMA follows the masters of the applied
    steps (torch.lerp of them, the skipped step left out), ema_weights() on the trainer's
    optimizer puts it into the model and back, and a resumed run's EMA equals the
    uninterrupted run's bit for bit (it travels in the Lightning checkpoint)."""
    def plugin():
        return mpext.integrations.lightning.MixedPrecision("bf16", keep_fp32=[nn.LayerNorm])

    full = EmaTiny(overflow_at={5})
    t_full = trainer(plugin(), 3)
    t_full.fit(full, loader())
    ema = None
    for k, ms in enumerate(full.masters):
        if k == 5:  # skipped: the masters did not move, nor may the EMA
            assert all(torch.equal(a, b) for a, b in zip(ms, full.masters[4]))
            continue
        ema = [m.clone() for m in ms] if ema is None else \
            [torch.lerp(e, m, 0.25) for e, m in zip(ema, ms)]
    got = ema_state(t_full)
    for a, b in zip(got, ema):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(a, m) for a, m in zip(got, full.masters[-1]))  # an average
    before = [p.detach().clone() for p in full.parameters()]
    with t_full.optimizers[0].ema_weights():
        for p, e in zip(full.parameters(), got):
            assert torch.equal(p.detach(), e.to(p.dtype))
    assert all(torch.equal(p.detach(), x) for p, x in zip(full.parameters(), before))

    first = EmaTiny(overflow_at={5})
    t1 = trainer(plugin(), 2)
    t1.fit(first, loader())
    ckpt = str(tmp_path / "ema.ckpt")
    t1.save_checkpoint(ckpt)
    resumed = EmaTiny(overflow_at={5})
    t2 = trainer(plugin(), 3)
    t2.fit(resumed, loader(), ckpt_path=ckpt)
    for a, b in zip(ema_state(t_full), ema_state(t2)):
        assert torch.equal(a, b)
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_manual_optimization_and_value_clipping_refused():
    class Manual(Tiny):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, i):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(super().training_step(batch, i))
            opt.step()
            self.lr_schedulers().step()

    model = Manual()
    t = trainer(mpext.integrations.lightning.MixedPrecision("fp16", init_scale=256.0), 1)
    t.fit(model, loader())
    masters, _, _, _ = reference(torch.float16, 4, scale=256.0, growth_interval=2000)
    # the plugin converts the LayerNorm too here (no keep_fp32): compare the Linear layers
    got = plugin_masters(t)
    for i in (0, 1, 4, 5):
        torch.testing.assert_close(got[i], masters[i], rtol=1e-3, atol=1e-4)

    t = trainer(mpext.integrations.lightning.MixedPrecision("bf16"), 1, gradient_clip_val=0.1,
                gradient_clip_algorithm="value")
    with pytest.raises(NotImplementedError, match="'norm'"):
        t.fit(Tiny(), loader())


@pytest.mark.parametrize("direct", [False, True], ids=["torch-wrapped", "mpext-direct"])
def test_fabric_explicit_wrapper_checkpoint_resume(tmp_path, direct):
    """Fabric, FP16 with an overflow: torch's AdamW through the plugin's wrapper (its
    state_dict holds the masters and the scale), or a master-free mpext.optim.AdamW stepped as
    it is (the plugin, in the saved state, holds the scale); fabric.save/load resume bit for
    bit."""
    def run(steps, plugin, start=0, load=None, save=None):
        fabric = lightning.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model = fabric.setup_module(net())
        if direct:
            opt = mpext.optim.AdamW(model.parameters(), lr=LR, master_weights=False,
                                    stochastic_rounding=True)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
        sched = S.LambdaLR(opt, warmup)
        opt = fabric.setup_optimizers(plugin.wrap_optimizer(opt))
        state = {"model": model, "optimizer": opt, "sched": sched, "precision": plugin}
        if load:
            fabric.load(load, state)
        for step in range(steps):
            x, y = X[:BATCH], Y[:BATCH]
            loss = F.mse_loss(model(x), y)
            if (start + step) == 2:
                loss = loss * float("inf")
            fabric.backward(loss)
            plugin.clip_gradients(opt, 0.5)
            opt.step()
            sched.step()
            opt.zero_grad()
        if save:
            fabric.save(save, state)
        return model, opt, sched

    def plugin():
        return mpext.integrations.lightning.MixedPrecision("fp16", init_scale=512.0,
                                                           growth_interval=2)

    def scaler(opt, plugin_):
        return plugin_._scaler if direct else opt.optimizer.scaler

    full_plugin = plugin()
    full_model, full_opt, full_sched = run(6, full_plugin)
    assert full_model.module[0].weight.dtype == torch.float16
    assert (type(full_opt.optimizer) is mpext.optim.AdamW) == direct
    assert scaler(full_opt, full_plugin).get_skipped_steps() == 1
    path = str(tmp_path / "fabric.ckpt")
    run(3, plugin(), save=path)
    resumed_plugin = plugin()
    model, opt, sched = run(3, resumed_plugin, start=3, load=path)
    for a, b in zip(full_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert scaler(full_opt, full_plugin).get_scale() == \
        scaler(opt, resumed_plugin).get_scale() != 512.0
    assert full_sched.last_epoch == sched.last_epoch == 5


def test_fabric_lazy_wrap_bf16_and_clip_gradients_refused():
    plugin = mpext.integrations.lightning.MixedPrecision("bf16")
    fabric = lightning.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = net()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    loss = F.mse_loss(model(X[:BATCH]), Y[:BATCH])
    assert loss.dtype == torch.float32  # outputs back in FP32
    fabric.backward(loss)
    with pytest.raises(RuntimeError, match="plugin.clip_gradients"):
        fabric.clip_gradients(model, opt, max_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(UserWarning, match="first step"):
        opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # a NaN step changes nothing
    opt.zero_grad()
    fabric.backward(F.mse_loss(model(X[:BATCH]), Y[:BATCH]) * float("nan"))
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert bool(S.step_was_skipped(plugin.wrap_optimizer(opt)))


def test_lightning_own_plugins_refuse_what_mpext_does():
    """What docs/integrations.md says Lightning's own plugins lack, checked on the installed
    Lightning: bf16-mixed refuses any scaler (no inf/NaN skip in BF16); 16-mixed refuses
    clipping with an optimizer that unscales in its step (mpext's fused AdamW)."""
    from lightning.pytorch.plugins.precision import MixedPrecision as LMP
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
    with pytest.raises(MisconfigurationException, match="does not use a scaler"):
        LMP("bf16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    fp16 = LMP("16-mixed", "cpu")
    opt = mpext.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        fp16.clip_gradients(opt, 1.0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="precision"):
        mpext.integrations.lightning.MixedPrecision("fp8")
    with pytest.raises(TypeError, match="unknown option"):
        mpext.integrations.lightning.MixedPrecision("fp16", growth=3)
    with pytest.raises(TypeError, match="keep_fp32"):
        mpext.integrations.lightning.MixedPrecision("bf16", keep_fp32=[3])
    plugin = mpext.integrations.lightning.MixedPrecision("bf16")
    model = net()
    with pytest.raises(ValueError, match="not converted"):
        plugin.wrap_optimizer(torch.optim.AdamW(model.parameters()))
    fp16 = mpext.integrations.lightning.MixedPrecision("fp16")
    m = fp16.convert_module(net())
    fp16.wrap_optimizer(torch.optim.AdamW(m[0].parameters()))
    with pytest.raises(NotImplementedError, match="several optimizers"):
        fp16.wrap_optimizer(torch.optim.AdamW(m[3].parameters()))
    with pytest.raises(NotImplementedError, match="several optimizers"):
        fp16.wrap_optimizer(mpext.optim.AdamW(m[3].parameters()))
    # a bad scaler state is refused when loaded, not at the first step
    good = mpext.GradScaler("cpu").state_dict()
    fresh = mpext.integrations.lightning.MixedPrecision("fp16")
    with pytest.raises(ValueError, match="scale must be > 0"):
        fresh.load_state_dict({"dtype": "float16", "loss_scale": "dynamic",
                               "scaler": dict(good, scale=-1.0)})
    with pytest.raises(TypeError, match="'scaler' must be"):
        fresh.load_state_dict({"dtype": "float16", "loss_scale": "dynamic", "scaler": 3})
    assert "scaler" not in fresh.state_dict()



# ---------------------------------------------------------------------------------------------
# The examples of docs/integrations.md, run as users run them (in process, smaller).


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_example_lightning_train_and_resume(tmp_path, precision):
    run = example("lightning_train").main
    small = ["--precision", precision, "--samples", "256"]
    full = run(small + ["--epochs", "4"])
    assert full["skipped_steps"] >= 1 and full["applied_steps"] == 16 - full["skipped_steps"]
    assert full["param_dtype"] == "torch." + {"bf16": "bfloat16", "fp16": "float16"}[precision]
    ckpt = str(tmp_path / "half.ckpt")
    run(small + ["--epochs", "2", "--save", ckpt])
    assert same_run(run(small + ["--epochs", "4", "--resume", ckpt]), full, precision)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_example_fabric_train_and_resume(tmp_path, precision):
    run = example("fabric_train").main
    small = ["--precision", precision, "--total", "20"]
    full = run(small + ["--steps", "20"])
    assert full["skipped_steps"] >= 1 and full["applied_steps"] == 20 - full["skipped_steps"]
    ckpt = str(tmp_path / "half.ckpt")
    run(small + ["--steps", "10", "--save", ckpt])
    assert same_run(run(small + ["--steps", "10", "--start", "10", "--resume", ckpt]), full,
                    precision)


# ---------------------------------------------------------------------------------------------
# mpext.optim optimizers stepped as they are: every storage format gets the skip, clipping and
# the schedule, compared with a run that never saw the NaN batch.

BF = torch.bfloat16
# name -> mpext.optim.AdamW storage options
FORMATS = {
    "fp32-master": {},
    "remainder": dict(param_remainders=True),
    "remainder-bf16-moments": dict(param_remainders=True, exp_avg_dtype=BF, exp_avg_sq_dtype=BF),
    "bf16-moments": dict(exp_avg_dtype=BF, exp_avg_sq_dtype=BF),
    "sr-bf16-moments": dict(master_weights=False, stochastic_rounding=True, exp_avg_dtype=BF,
                            exp_avg_sq_dtype=BF),
    "8bit": dict(exp_avg_dtype=torch.int8, exp_avg_sq_dtype=torch.uint8),
    "master-free-sr": dict(master_weights=False, stochastic_rounding=True),
}
NAN_BATCH = 5  # of 12 batches of 4
GEN2 = torch.Generator().manual_seed(2)
X2 = torch.randn(48, 8, generator=GEN2)
Y2 = torch.randn(48, 1, generator=GEN2)


def lean_net():
    """Small, with one weight of 4096 elements so that 8-bit moments really are 8-bit."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 64), nn.LayerNorm(64), nn.Tanh(), nn.Linear(64, 64),
                         nn.Tanh(), nn.Linear(64, 1))


def lean_loaders():
    """The run's batches with batch NAN_BATCH all NaN, and the same batches without it."""
    x = X2.clone()
    rows = slice(NAN_BATCH * BATCH, (NAN_BATCH + 1) * BATCH)
    x[rows] = float("nan")
    keep = torch.ones(48, dtype=torch.bool)
    keep[rows] = False

    def dl(a, b):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(a, b),
                                           batch_size=BATCH, shuffle=False)
    return dl(x, Y2), dl(X2[keep], Y2[keep])


def snapshot(opt, params):
    """Every tensor of the optimizer's state and the params, cloned (in a fixed order)."""
    out = [p.detach().clone() for p in params]
    for p in params:
        for k in sorted(opt.state.get(p, {})):
            v = opt.state[p][k]
            if isinstance(v, torch.Tensor):
                out.append(v.detach().clone())
    return out


def all_equal(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y)
                                    for x, y in zip(a, b))


def finite(ts):
    return all(bool(torch.isfinite(t.float()).all()) for t in ts if t.is_floating_point())


class Lean(pl.LightningModule):
    def __init__(self, options):
        super().__init__()
        self.net = lean_net()
        self.options = options
        self.lrs, self.snaps, self.scales = [], [], []

    def training_step(self, batch, i):
        x, y = batch
        return F.mse_loss(self.net(x).float(), y.float())

    def on_train_batch_end(self, outputs, batch, i):
        opt = self.trainer.optimizers[0]
        self.lrs.append(opt.param_groups[0]["lr"].item())
        self.snaps.append(snapshot(opt, list(self.parameters())))
        scaler = self.trainer.precision_plugin._scaler
        self.scales.append(scaler.get_scale())

    def configure_optimizers(self):
        opt = mpext.optim.AdamW(self.parameters(), lr=LR, **self.options)
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": S.LambdaLR(opt, warmup), "interval": "step"}}


def lean_fit(options, loader_, precision="bf16", clip=0.05, **plugin_kw):
    model = Lean(options)
    plugin = mpext.integrations.lightning.MixedPrecision(precision, keep_fp32=[nn.LayerNorm],
                                                         **plugin_kw)
    t = trainer(plugin, 1, gradient_clip_val=clip)
    t.fit(model, loader_)
    return t, model


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_trainer_nan_batch_skipped_in_every_lean_format(fmt):
    """BF16 plugin, mpext.optim.AdamW in each storage format, clipping on, a NaN batch in the
    middle: the plugin steps the optimizer as it is (no FP32-master wrapper); on the NaN step
    params and every state tensor stay as they were and the schedule holds; nothing is NaN at
    the end; and the run equals, bit for bit, one that never saw that batch (the step count
    does not advance on the skip, so even the stochastic rounding draws the same bits after
    it)."""
    nan_loader, ref_loader = lean_loaders()
    t, model = lean_fit(FORMATS[fmt], nan_loader)
    opt = t.optimizers[0]
    assert type(opt) is mpext.optim.AdamW  # not wrapped
    assert model.net[0].weight.dtype == BF and model.net[1].weight.dtype == torch.float32
    if fmt == "8bit":
        assert opt.state[model.net[3].weight]["exp_avg_q8"].dtype == torch.int8
    if "remainder" in fmt:
        assert "param_remainder" in opt.state[model.net[3].weight]
    assert all_equal(model.snaps[NAN_BATCH], model.snaps[NAN_BATCH - 1])
    assert not all_equal(model.snaps[NAN_BATCH + 1], model.snaps[NAN_BATCH])
    assert model.lrs[NAN_BATCH] == model.lrs[NAN_BATCH - 1]
    assert all(finite(s) for s in model.snaps)
    sched = t.lr_scheduler_configs[0].scheduler
    assert sched.last_epoch == 11
    assert t.precision_plugin._scaler.get_skipped_steps() == 1

    t_ref, ref = lean_fit(FORMATS[fmt], ref_loader)
    assert all_equal(model.snaps[-1], ref.snaps[-1])
    assert model.lrs[:NAN_BATCH] + model.lrs[NAN_BATCH + 1:] == ref.lrs
    assert t_ref.lr_scheduler_configs[0].scheduler.last_epoch == 11


def test_trainer_clipping_and_fp32_masters_match_torch():
    """The direct path's numerics against an independent plain loop (FP32 masters stepped by
    torch.optim.AdamW, torch's clip_grad_norm_, the schedule at the count of applied steps)."""
    plugin = mpext.integrations.lightning.MixedPrecision("bf16", keep_fp32=[nn.LayerNorm])

    model = Tiny(overflow_at={5}, make_opt=mpext.optim.AdamW)
    t = trainer(plugin, 3, gradient_clip_val=0.05)
    t.fit(model, loader())
    assert type(t.optimizers[0]) is mpext.optim.AdamW
    masters, lrs, _, norms = reference(torch.bfloat16, 12, overflow_at={5}, clip=0.05)
    assert sum(n > 0.05 for n in norms) >= 3  # clipping really engaged
    assert_masters_close(plugin_masters(t), masters)
    assert model.lrs == lrs


@pytest.mark.parametrize("fmt", ["fp32-master", "master-free-sr"])
def test_trainer_fp16_dynamic_scale_backs_off_on_the_nan_batch(fmt):
    """FP16 params, mpext.optim.AdamW stepped as it is under the plugin's dynamic scale (from
    1024, growth every 4 steps): the NaN step changes nothing, holds the schedule and halves
    the scale; the other steps follow torch's rule; the weights stay finite and follow a plain
    torch loop over the same batches within FP16's rounding."""
    nan_loader, _ = lean_loaders()
    kw = dict(init_scale=1024.0, growth_interval=4)
    t, model = lean_fit(FORMATS[fmt], nan_loader, precision="fp16", clip=1.0, **kw)
    assert type(t.optimizers[0]) is mpext.optim.AdamW
    assert model.net[0].weight.dtype == torch.float16
    assert all_equal(model.snaps[NAN_BATCH], model.snaps[NAN_BATCH - 1])
    assert model.lrs[NAN_BATCH] == model.lrs[NAN_BATCH - 1]
    assert all(finite(s) for s in model.snaps)
    want, scale, tracker = [], 1024.0, 0
    for k in range(12):
        if k == NAN_BATCH:
            scale, tracker = scale * 0.5, 0
        else:
            tracker += 1
            if tracker == 4:
                scale, tracker = scale * 2.0, 0
        want.append(scale)
    assert model.scales == want
    assert t.lr_scheduler_configs[0].scheduler.last_epoch == 11
    # Against a plain torch loop on the same 12 batches (the NaN one skipped there too): each
    # param within one FP16 ulp per applied step at the largest magnitude it can have passed
    # (each step rounds an FP16 param once and moves it by about lr at most), and, as a
    # control, most of each param's elements moved further than that from their start.
    ref = lean_reference(nan_loader, scale=1024.0, growth_interval=4, clip=1.0)
    start = list(lean_net().parameters())
    applied = 11
    for i, (a, b, a0) in enumerate(zip(model.parameters(), ref, start)):
        fp16 = a.dtype == torch.float16
        a, b, a0 = a.detach().double(), b.detach().double(), a0.detach().to(a.dtype).double()
        if not fp16 and fmt != "fp32-master":
            # the LayerNorm, kept FP32, whose gradients carry the FP16 layers' rounding: with
            # stochastic rounding that noise moves it by more than an FP16 ulp per step
            continue
        path = torch.maximum(a0.abs(), b.abs()) + applied * LR
        tol = applied * torch.clamp(path * 2.0 ** -10, min=2.0 ** -24)
        assert bool(((a - b).abs() <= tol).all()), (i, ((a - b).abs() / tol).max().item())
        moved = (a - a0).abs() > tol
        assert moved.double().mean().item() >= 0.5, (i, moved.double().mean().item())


def lean_reference(loader_, scale, growth_interval, clip):
    """A plain torch loop over lean_net: FP16 Linear layers with the LayerNorm in FP32 (inputs
    cast up, output back), FP32 masters stepped by torch.optim.AdamW, gradients unscaled and
    checked by hand, torch's clip_grad_norm_, torch's dynamic loss-scale rule, the schedule
    evaluated at the number of applied steps. Returns the model's params (each its master's
    round to nearest even)."""
    model = lean_net()
    model[1].register_forward_pre_hook(lambda m, a: (a[0].float(),))
    model[1].register_forward_hook(lambda m, a, out: out.half())
    for i in (0, 3, 5):
        model[i].half()
    params = list(model.parameters())
    masters = [p.detach().float().clone() for p in params]
    opt = torch.optim.AdamW(masters, lr=LR, foreach=False)
    applied, tracker = 0, 0
    for x, y in loader_:
        loss = F.mse_loss(model(x.half()).float(), y.half().float())
        (loss * scale).backward()
        inv = torch.tensor(1.0 / scale, dtype=torch.float32)
        for p, m in zip(params, masters):
            m.grad = p.grad.float() * inv
            p.grad = None
        found = not all(bool(torch.isfinite(m.grad).all()) for m in masters)
        if found:
            scale, tracker = scale * 0.5, 0
            continue
        torch.nn.utils.clip_grad_norm_(masters, clip)
        for g in opt.param_groups:
            g["lr"] = LR * warmup(applied)
        opt.step()
        applied += 1
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        tracker += 1
        if tracker == growth_interval:
            scale, tracker = scale * 2.0, 0
    return params


def test_trainer_fp16_direct_resume_is_bit_identical(tmp_path):
    """The scale of an optimizer stepped as it is lives in the plugin's state_dict, which the
    Lightning checkpoint carries: a resumed FP16 run (NaN batches in both halves) equals the
    uninterrupted one bit for bit, scale included."""
    t_full, full, t2, resumed = fp16_run_and_resume(tmp_path, functools.partial(
        mpext.optim.AdamW, master_weights=False, stochastic_rounding=True))
    assert type(t2.optimizers[0]) is mpext.optim.AdamW
    assert all_equal(snapshot(t_full.optimizers[0], list(full.parameters())),
                     snapshot(t2.optimizers[0], list(resumed.parameters())))
    assert t_full.precision_plugin._scaler.get_scale() == \
        t2.precision_plugin._scaler.get_scale() != 512.0
    assert full.lrs[8:] == resumed.lrs


@pytest.mark.parametrize("fmt", ["remainder", "sr-bf16-moments", "8bit"])
def test_fabric_nan_batch_skipped_in_lean_formats(fmt):
    """Fabric, BF16: an mpext.optim.AdamW handed to setup_optimizers as it is, clipped with
    plugin.clip_gradients and scheduled by an mpext schedule; the NaN batch changes nothing and
    the run equals, bit for bit, one without that batch."""
    def run(skip_nan):
        plugin = mpext.integrations.lightning.MixedPrecision("bf16", keep_fp32=[nn.LayerNorm])
        fabric = lightning.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model = fabric.setup_module(lean_net())
        opt = mpext.optim.AdamW(model.parameters(), lr=LR, **FORMATS[fmt])
        sched = S.LambdaLR(opt, warmup)
        opt = fabric.setup_optimizers(opt)
        snaps, lrs = [], []
        for k in range(12):
            x, y = X2[k * BATCH:(k + 1) * BATCH], Y2[k * BATCH:(k + 1) * BATCH]
            if k == NAN_BATCH:
                if skip_nan:
                    continue
                x = torch.full_like(x, float("nan"))
            fabric.backward(F.mse_loss(model(x), y))
            plugin.clip_gradients(opt, 0.05)
            opt.step()
            sched.step()
            opt.zero_grad()
            snaps.append(snapshot(opt.optimizer, list(model.parameters())))
            lrs.append(opt.param_groups[0]["lr"].item())
        return snaps, lrs, sched, plugin

    snaps, lrs, sched, plugin = run(False)
    assert all_equal(snaps[NAN_BATCH], snaps[NAN_BATCH - 1])
    assert lrs[NAN_BATCH] == lrs[NAN_BATCH - 1]
    assert all(finite(s) for s in snaps)
    assert sched.last_epoch == 11 and plugin._scaler.get_skipped_steps() == 1
    ref_snaps, ref_lrs, _, _ = run(True)
    assert all_equal(snaps[-1], ref_snaps[-1])
    assert lrs[:NAN_BATCH] + lrs[NAN_BATCH + 1:] == ref_lrs


def test_torch_optimizers_keep_the_wrapper_and_the_bf16_true_route_has_no_skip():
    """An optimizer that is not mpext's is still wrapped (FP32 masters); and what the plugin
    adds over Lightning's own bf16-true with mpext.optim.AdamW: there a NaN batch makes every
    weight NaN."""
    plugin = mpext.integrations.lightning.MixedPrecision("bf16")
    fabric = lightning.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = fabric.setup_module(net())
    assert isinstance(plugin.wrap_optimizer(torch.optim.AdamW(model.parameters())),
                      mpext.MixedPrecisionOptimizer)
    fused = torch.optim.AdamW(model.parameters(), fused=True)
    assert isinstance(plugin.wrap_optimizer(fused), mpext.MixedPrecisionOptimizer)

    fabric = lightning.Fabric(accelerator="cpu", devices=1, precision="bf16-true")
    model = fabric.setup_module(net())
    opt = fabric.setup_optimizers(mpext.optim.AdamW(model.parameters(), lr=LR,
                                                    param_remainders=True))
    fabric.backward(F.mse_loss(model(torch.full((BATCH, 8), float("nan"))), Y[:BATCH]))
    opt.step()
    assert all(bool(p.isnan().all()) for p in model.parameters())
