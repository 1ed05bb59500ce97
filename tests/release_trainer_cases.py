"""The HF Trainer and accelerate runs the release's trainer tests share (one process:
test_release_trainers.py; under accelerate's DDP: test_release_trainers_ddp.py, whose ranks so
import neither Lightning nor the tests of one process)."""
import torch
import torch.nn as nn
import transformers

import mpext
import mpext.accelerate

BATCH, STEPS = 4, 4


class Regression(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 37), nn.Tanh(), nn.Linear(37, 1)).to(dtype)

    def forward(self, x, labels):
        out = self.net(x.to(self.net[0].weight.dtype)).float()
        return {"loss": nn.functional.mse_loss(out, labels)}


def _data(nan_at=None):
    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(8, generator=g), "labels": torch.randn(1, generator=g)}
            for _ in range(BATCH * STEPS)]  # one epoch: every sample is used
    if nan_at is not None:
        for item in data:  # every sample of one value: whichever batch holds it
            if torch.equal(item["x"], data[nan_at]["x"]):
                item["x"] = item["x"].clone()
                item["x"][0] = float("nan")
    return data


FORMATS = {
    "fp32": (torch.float32, {}),
    "bf16_remainder": (torch.bfloat16, dict(param_remainders=True)),
    "bf16_sr_q8": (torch.bfloat16, dict(master_weights=False, stochastic_rounding=True,
                                        exp_avg_dtype=torch.int8, exp_avg_sq_dtype=torch.uint8)),
}


def _train(tmp_path, released, fmt="fp32", accumulation=1, max_grad_norm=0.0, nan_at=None,
           clip="exact", save_steps=None, resume=None):
    dtype, kw = FORMATS[fmt]
    save = dict(save_strategy="no") if save_steps is None else dict(
        save_strategy="steps", save_steps=save_steps)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=BATCH // accumulation,
        gradient_accumulation_steps=accumulation, max_steps=STEPS, use_cpu=True,
        report_to=[], logging_strategy="steps", logging_steps=1, **save,
        disable_tqdm=True, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=1,
        max_grad_norm=max_grad_norm, seed=0, dataloader_drop_last=True)
    model = Regression(dtype)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=_data(nan_at),
        optimizer_cls_and_kwargs=(mpext.optim.AdamW, dict(kw, seed=7)))
    if released:
        mpext.accelerate.release_trainer(trainer, bucket_bytes=0, clip=clip)
    else:
        mpext.accelerate.setup_trainer(trainer)
    trainer.train(resume_from_checkpoint=resume)
    opt = trainer.optimizer.optimizer
    params = list(model.parameters())
    return {"params": [p.detach().clone() for p in params],
            "state": [{k: v.clone() for k, v in opt.state[p].items()} for p in params],
            "grads": [p.grad for p in params],
            "lr": [g["lr"] for g in opt.param_groups],
            "logs": [h for h in trainer.state.log_history if "loss" in h],
            "skipped": trainer.accelerator.scaler.get_skipped_steps(),
            "released": getattr(opt, "_grad_release", None) is not None}


def _same(a, b):
    bad = ["param %d" % i for i, (x, y) in enumerate(zip(a["params"], b["params"]))
           if not (x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8)))]
    for i, (sa, sb) in enumerate(zip(a["state"], b["state"])):
        bad += ["param %d %s" % (i, k) for k in sa
                if not torch.equal(sa[k].reshape(-1).view(torch.uint8),
                                   sb[k].reshape(-1).view(torch.uint8))]
    return bad


def _accelerate_loop(released, accumulation, nan_step=None, max_grad_norm=None, rank=0):
    """accelerator.prepare(model, opt), accelerator.accumulate(model), accelerator.backward,
    opt.step(), opt.zero_grad(), the Accelerator's mpext.GradScaler (bf16_check_only). Under
    accelerate's DDP (test_release_trainers_ddp.py) each ``rank`` takes batches of its own."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    scaler = mpext.accelerate.use_grad_scaler(accelerator)
    model = Regression(torch.float32)
    opt = mpext.optim.AdamW(model.parameters(), lr=1e-2, seed=7)
    release = (mpext.accelerate.release_accelerator(accelerator, opt, bucket_bytes=0,
                                                    max_grad_norm=max_grad_norm)
               if released else None)
    model, wrapped = accelerator.prepare(model, opt)
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    data = _data() + _data()[::-1]
    for i in range(STEPS * accumulation):
        j = i + rank * STEPS * accumulation
        batch = data[j * 2:(j + 1) * 2]
        x = torch.stack([b["x"] for b in batch])
        if i // accumulation == nan_step:
            x = x.clone()
            x[0, 0] = float("nan")
        y = torch.stack([b["labels"] for b in batch])
        with accelerator.accumulate(model):
            loss = model(x, y)["loss"]
            accelerator.backward(loss)
            if max_grad_norm is not None and not released and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
            wrapped.step()
            wrapped.zero_grad()
    params = list(model.parameters())
    out = {"params": [p.detach().clone() for p in params],
           "state": [{k: v.clone() for k, v in opt.state[p].items()} for p in params],
           "skipped": scaler.get_skipped_steps(), "grads": [p.grad for p in params], "ddp": ddp}
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return out
