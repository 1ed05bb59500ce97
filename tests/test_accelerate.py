"""mpext.integrations.accelerate (also mpext.accelerate) with the real accelerate and transformers
on the CPU: an Accelerator with FP16 loss scaling (which accelerate alone does not do on a CPU)
against a plain torch AMP loop, the BF16 inf/NaN skip, refusal after prepare(),
save_state/load_state and transformers.Trainer resume continuing bit for bit, skip-aware schedules
with transformers' values."""
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

for _k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_k, "1")
os.environ.setdefault("WANDB_DISABLED", "true")

accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed "
                                 "(pip install accelerate)")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from framework_examples import example, same_run  # noqa: E402
import mpext  # noqa: E402
import mpext.integrations.accelerate  # noqa: E402
from mpext.optim import lr_scheduler as S  # noqa: E402

GEN = torch.Generator().manual_seed(0)
X = torch.randn(8, 4, 8, generator=GEN)  # 8 batches of 4
Y = torch.randn(8, 4, 1, generator=GEN)
LR = 1e-2


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps process-wide singletons; each test makes its own Accelerator."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def net():
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def warmup(e):
    if isinstance(e, torch.Tensor):
        return torch.clamp((e + 1) / 3, max=1.0)
    return min((e + 1) / 3, 1.0)


def accelerate_run(steps, overflow_at=(), mixed_precision="fp16", model_dtype=None,
                   save=None, load=None, start=0, **scaler_options):
    acc = accelerate.Accelerator(mixed_precision=mixed_precision, cpu=True)
    scaler = mpext.integrations.accelerate.use_grad_scaler(acc, **scaler_options)
    model = net()
    if model_dtype is not None:
        model = model.to(model_dtype)
    dtypes = []
    model[0].register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    opt = mpext.optim.AdamW(model.parameters(), lr=LR)
    sched = S.LambdaLR(opt, warmup)
    model, opt, sched = acc.prepare(model, opt, sched)
    if load:
        acc.load_state(load)
    lrs = []
    for step in range(start, start + steps):
        out = model(X[step].to(model_dtype or torch.float32))
        loss = F.mse_loss(out.float(), Y[step])
        if step in overflow_at:
            loss = loss * float("inf")
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        opt.zero_grad()
        lrs.append(opt.param_groups[0]["lr"].item())
    if save:
        acc.save_state(save)
    return acc, model, opt, sched, scaler, lrs, dtypes


def test_fp16_on_cpu_against_torch_amp_loop():
    """accelerate alone, on the CPU, ignores fp16 (no autocast, no scaler); with the helper the
    run is torch AMP: autocast in float16, dynamic loss scale, unscale before clipping, the
    overflowing steps skipped and the schedule held. Reference: torch.autocast +
    torch.amp.GradScaler + torch's fused AdamW, the schedule stepped only on applied steps."""
    acc, model, opt, sched, scaler, lrs, dtypes = accelerate_run(
        8, overflow_at={1, 5}, init_scale=1024.0, growth_interval=2)
    assert set(dtypes) == {torch.float16}
    assert isinstance(opt.scaler, mpext.GradScaler) and opt.scaler is acc.scaler

    ref = net()
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
    rsched = torch.optim.lr_scheduler.LambdaLR(ropt, warmup)
    rscaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    rlrs = []
    for step in range(8):
        with torch.autocast("cpu", dtype=torch.float16):
            out = ref(X[step])
        loss = F.mse_loss(out.float(), Y[step])
        if step in {1, 5}:
            loss = loss * float("inf")
        rscaler.scale(loss).backward()
        rscaler.unscale_(ropt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        skipped = not all(torch.isfinite(p.grad).all() for p in ref.parameters())
        rscaler.step(ropt)
        rscaler.update()
        if not skipped:
            rsched.step()
        ropt.zero_grad()
        rlrs.append(torch.tensor(ropt.param_groups[0]["lr"]).float().item())
    for a, b in zip(acc.unwrap_model(model).parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert lrs == rlrs
    assert scaler.get_scale() == rscaler.get_scale()
    assert scaler.get_skipped_steps() == 2
    assert sched.scheduler.last_epoch == 6
    # accelerate's own flag is blind to the fused skip; mpext's is not (and syncs nothing)
    assert opt.step_was_skipped is False


def test_bf16_model_skips_nan_steps():
    """A BF16 model (mpext.optim.AdamW keeps FP32 masters) with mixed_precision="no": the
    helper's scaler only checks (scale 1) and skips the NaN step on the device."""
    acc, model, opt, sched, scaler, lrs, _ = accelerate_run(
        4, overflow_at={2}, mixed_precision="no", model_dtype=torch.bfloat16)
    assert scaler.get_scale() == 1.0 and scaler.get_skipped_steps() == 1
    assert sched.scheduler.last_epoch == 3
    raw = opt.optimizer
    for p in acc.unwrap_model(model).parameters():
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, raw.state[p]["master_param"].to(torch.bfloat16))


def test_refused_after_prepare_and_bad_arguments():
    acc = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    assert acc.scaler is None and not acc.native_amp  # what accelerate does on a CPU
    model = acc.prepare(net())
    with pytest.raises(RuntimeError, match="before accelerator.prepare"):
        mpext.integrations.accelerate.use_grad_scaler(acc)
    with pytest.raises(TypeError, match="accelerate.Accelerator"):
        mpext.integrations.accelerate.use_grad_scaler(object())
    AcceleratorState._reset_state(True)
    acc = accelerate.Accelerator(mixed_precision="fp16", cpu=True,
                                 kwargs_handlers=[accelerate.utils.GradScalerKwargs(
                                     init_scale=256.0, growth_interval=7)])
    scaler = mpext.integrations.accelerate.use_grad_scaler(acc, hysteresis=2)
    assert scaler.get_scale() == 256.0 and scaler.get_growth_interval() == 7
    assert scaler.state_dict()["hysteresis"] == 2
    del model


def test_save_state_load_state_resume_bit_identical(tmp_path):
    opts = dict(overflow_at={1, 6}, init_scale=512.0, growth_interval=2)
    _, full, _, full_sched, full_scaler, full_lrs, _ = accelerate_run(8, **opts)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerate_run(4, save=str(tmp_path / "state"), **opts)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc, model, _, sched, scaler, lrs, _ = accelerate_run(4, load=str(tmp_path / "state"),
                                                          start=4, **opts)
    for a, b in zip(full.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert lrs == full_lrs[4:]
    assert scaler.state_dict() == full_scaler.state_dict()
    assert sched.scheduler.last_epoch == full_sched.scheduler.last_epoch == 6


# ---------------------------------------------------------------------------------------------
# transformers.Trainer


def hf_trainer(tmp_path, precision, max_steps, overflow_at=()):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.x = torch.randint(0, 64, (24, 12), generator=g)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.x[i]}

    class Overflowing(transformers.Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            return loss * float("inf") if self.state.global_step in overflow_at else loss

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    if precision == "bf16":
        model = model.to(torch.bfloat16)  # BF16 params; mpext.optim.AdamW keeps the masters
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=max_steps,
        per_device_train_batch_size=4, learning_rate=1e-3, warmup_steps=2,
        lr_scheduler_type="cosine", max_grad_norm=1.0, fp16=precision == "fp16",
        save_steps=3, logging_steps=1, report_to=[], seed=0, disable_tqdm=True,
        dataloader_pin_memory=False)
    trainer = Overflowing(model=model, args=args, train_dataset=Tokens(),
                          optimizer_cls_and_kwargs=(mpext.optim.AdamW, {"weight_decay": 0.1}))
    mpext.integrations.accelerate.setup_trainer(trainer, **({"init_scale": 1024.0}
                                               if precision == "fp16" else {}))
    return trainer


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_hf_trainer_recipe_skip_and_resume(tmp_path, precision):
    """The documented recipes: optimizer_cls_and_kwargs=(mpext.optim.AdamW, ...), a BF16 model
    (or fp16=True through the helper), the skip-aware cosine schedule with transformers' values
    at the count of applied steps, and resume from checkpoint-3 equal to the run without a
    break, bit for bit."""
    import transformers
    full = hf_trainer(tmp_path / "full", precision, 6, overflow_at={1})
    full.train()
    assert isinstance(full.optimizer.optimizer, mpext.optim.AdamW)
    assert isinstance(full.lr_scheduler, S.LambdaLR)
    assert full.accelerator.scaler.get_skipped_steps() == 1
    assert full.lr_scheduler.last_epoch == 5
    # transformers' own schedule, evaluated at the number of applied steps before each step
    _, probe = S.LambdaLR, torch.optim.SGD([torch.zeros(1)], lr=1e-3)
    ref = transformers.get_cosine_schedule_with_warmup(probe, 2, 6)
    applied = [0, 1, 1, 2, 3, 4]  # step 1 was skipped
    logged = [h["learning_rate"] for h in full.state.log_history if "learning_rate" in h]
    want = []
    for a in applied:
        ref.last_epoch = a
        with torch.optim.lr_scheduler._enable_get_lr_call(ref):
            want.append(torch.tensor(ref.get_lr()[0]).float().item())
    assert logged == want

    first = hf_trainer(tmp_path / "half", precision, 6, overflow_at={1})
    first.args.max_steps = 3
    first.train()
    resumed = hf_trainer(tmp_path / "half", precision, 6, overflow_at={1})
    resumed.train(resume_from_checkpoint=str(tmp_path / "half" / "checkpoint-3"))
    for (n, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), n
    sa, sb = full.optimizer.state_dict(), resumed.optimizer.state_dict()
    for i, st in sa["state"].items():
        for k, v in st.items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)
    assert full.accelerator.scaler.state_dict() == resumed.accelerator.scaler.state_dict()
    assert resumed.lr_scheduler.last_epoch == 5



# ---------------------------------------------------------------------------------------------
# The examples of docs/integrations.md, run as users run them (in process, smaller).


def reset_accelerate():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_example_accelerate_train_and_resume(tmp_path, precision):
    run = example("accelerate_train").main
    small = ["--precision", precision, "--total", "20"]
    full = run(small + ["--steps", "20"])
    assert full["skipped_steps"] >= 1 and full["applied_steps"] == 20 - full["skipped_steps"]
    assert full["accelerate_step_was_skipped"] is False
    reset_accelerate()
    run(small + ["--steps", "10", "--save", str(tmp_path / "state")])
    reset_accelerate()
    assert same_run(run(small + ["--steps", "20", "--resume", str(tmp_path / "state")]), full,
                    precision)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_example_hf_trainer_and_resume(tmp_path, precision):
    pytest.importorskip("transformers", reason="transformers is not installed")
    run = example("hf_trainer").main
    out = str(tmp_path / "out")
    small = ["--precision", precision, "--steps", "20", "--save-steps", "10"]
    full = run(small + ["--output-dir", out])
    assert full["last_loss"] < full["first_loss"] - 0.3  # it learns
    assert full["optimizer"] == "AdamW" and full["applied_steps"] == 20
    reset_accelerate()
    resumed = run(small + ["--output-dir", out, "--resume", out + "/checkpoint-10"])
    assert resumed["last_loss"] == full["last_loss"]
    assert resumed["applied_steps"] == 20


def test_example_framework_gaps_measures_what_is_missing():
    """The measurement behind docs/integrations.md, shortened: bf16-true rounds updates away
    and drifts from the FP32 run where mpext's masters do not; bf16-mixed turns NaN on one bad
    batch; accelerate's torch schedule advances on every skipped step, mpext's on none; fp16 on
    a CPU is silently off in accelerate alone."""
    pytest.importorskip("lightning", reason="lightning is not installed")
    out = example("framework_gaps").main(["--steps", "40", "--lrs", "1e-4"])
    true, ours = out["masters"]
    assert true["run"] == "bf16-true" and ours["run"] == "mpext"
    # (a master element stays put only where its gradient was exactly zero)
    assert true["updates_lost_pct"] > 30 and ours["updates_lost_pct"] < 0.1
    assert true["weight_error_vs_fp32"] > 5 * ours["weight_error_vs_fp32"]
    mixed, ours = out["nan"]
    assert mixed["nan_weights"] == mixed["weights"] and ours["nan_weights"] == 0
    torch_s, mpext_s = out["schedule"]
    assert torch_s["schedule_advances_on_skipped_steps"] == torch_s["skipped"] > 0
    assert mpext_s["schedule_advances_on_skipped_steps"] == 0
    assert torch_s["step_was_skipped_reported"] == 0
    plain, helped = out["fp16_cpu"]
    assert plain == {"scaler": None, "autocast": False, "forward_dtype": "torch.float32"}
    assert helped["forward_dtype"] == "torch.float16"
