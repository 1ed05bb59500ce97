"""Gradient release driven by transformers.Trainer (mpext.accelerate.release_trainer): the
Trainer's own loop, its optimizer.step()/zero_grad() no-ops for the released optimizer, its
gradient_accumulation_steps through release.accumulate(), its max_grad_norm through the
release's clipping. Compared with the same Trainer stepping after backward
(mpext.accelerate.setup_trainer: the same scaler and skip-aware schedule)."""
import pytest
import torch
import torch.nn as nn

import mpext

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import mpext.accelerate  # noqa: E402,F401
from release_trainer_cases import (BATCH, FORMATS, STEPS, Regression,  # noqa: E402
                                   _accelerate_loop, _same, _train)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("accumulation", (1, 2))
def test_released_trainer_has_the_bits_of_the_trainer_stepping_after_backward(tmp_path, fmt,
                                                                              accumulation):
    """No clipping, no skip: params, state and every logged loss and learning rate equal, bit
    for bit; the released run's gradients freed."""
    after = _train(tmp_path / "a", False, fmt, accumulation)
    got = _train(tmp_path / "b", True, fmt, accumulation)
    assert got["released"] and not after["released"]
    assert _same(after, got) == []
    assert [(h["loss"], h["learning_rate"]) for h in got["logs"]] == \
        [(h["loss"], h["learning_rate"]) for h in after["logs"]]
    assert len(got["logs"]) == STEPS
    assert all(g is None for g in got["grads"])
    moved = _same(after, {"params": list(Regression(FORMATS[fmt][0]).parameters()),
                          "state": []})
    assert len(moved) == 4


def test_a_nan_batch_is_skipped_and_the_schedule_holds(tmp_path):
    """A NaN sample in one batch: that released step is skipped (every gradient is NaN, so no
    bucket steps) as the Trainer's after backward is; the skip-aware schedule holds still on
    it in both, so the learning rates and the params stay equal, bit for bit."""
    after = _train(tmp_path / "a", False, nan_at=5)  # (one epoch: its batch is used)
    got = _train(tmp_path / "b", True, nan_at=5)
    assert got["skipped"] == after["skipped"] == 1
    assert _same(after, got) == []
    assert got["lr"] == after["lr"]
    clean = _train(tmp_path / "c", True)
    assert got["lr"] != clean["lr"]  # the schedule held still once


@pytest.mark.parametrize("fmt", ("fp32", "bf16_sr_q8"))
def test_a_released_trainer_resumes_from_its_checkpoint_bit_for_bit(tmp_path, fmt):
    """The Trainer's checkpoint at step 2 of a released run (optimizer state, scheduler, RNG,
    data position), resumed by a fresh released Trainer: the bits of the uninterrupted run."""
    whole = _train(tmp_path / "a", True, fmt, save_steps=2)
    resumed = _train(tmp_path / "b", True, fmt,
                     resume=str(tmp_path / "a" / "checkpoint-2"))
    assert _same(whole, resumed) == []
    assert resumed["lr"] == whole["lr"]
    # (the checkpoint's log history, then the resumed steps' losses)
    assert [h["loss"] for h in resumed["logs"]] == [h["loss"] for h in whole["logs"]]


def test_max_grad_norm_clips_with_the_global_norm(tmp_path):
    """max_grad_norm=0.05 (every step clipped) through the release's exact clipping: the
    params follow the Trainer's clip_grad_norm_ to a few ulps of the clipped steps, and the
    logged grad_norm is the same norm."""
    after = _train(tmp_path / "a", False, max_grad_norm=0.05)
    got = _train(tmp_path / "b", True, max_grad_norm=0.05)
    for a, b in zip(after["params"], got["params"]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    na = torch.tensor([h["grad_norm"] for h in after["logs"]])
    nb = torch.tensor([float(h["grad_norm"]) for h in got["logs"]])
    assert (na > 0.05).all()
    torch.testing.assert_close(nb, na, rtol=1e-5, atol=0)


def test_exact_clipping_with_accumulation_is_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match=r"release_trainer: max_grad_norm=1.0 with "
                                         r"gradient_accumulation_steps=2 and clip=\"exact\".*"
                                         r"clip=\"previous\""):
        _train(tmp_path, True, accumulation=2, max_grad_norm=1.0)


# ---- accelerate, a loop of its own --------------------------------------------------------------

@pytest.mark.parametrize("accumulation", (1, 2))
def test_accelerate_loop_released_has_the_bits_of_stepping_after_backward(accumulation):
    after = _accelerate_loop(False, accumulation)
    got = _accelerate_loop(True, accumulation)
    assert _same(after, got) == []
    assert all(g is None for g in got["grads"])
    moved = _same(after, {"params": list(Regression(torch.float32).parameters()), "state": []})
    assert len(moved) == 4


def test_accelerate_loop_nan_step_is_skipped():
    after = _accelerate_loop(False, 1, nan_step=1)
    got = _accelerate_loop(True, 1, nan_step=1)
    assert got["skipped"] == after["skipped"] == 1
    assert _same(after, got) == []


# ---- Lightning automatic optimization -----------------------------------------------------------

pl = pytest.importorskip("lightning.pytorch")
import mpext.lightning  # noqa: E402
from mpext.optim import lr_scheduler as S  # noqa: E402

L_STEPS = 6


class Module(pl.LightningModule):
    def __init__(self, fmt, nan_batch=None):
        super().__init__()
        self.fmt = fmt
        self.net = Regression(FORMATS[fmt][0]).net
        self.nan_batch = nan_batch
        self.epochs = 1
        self.lrs = []

    def training_step(self, batch, i):
        x, y = batch
        if i == self.nan_batch:
            x = x.clone()
            x[0, 0] = float("nan")
        return nn.functional.mse_loss(self.net(x.to(self.net[0].weight.dtype)).float(), y)

    def on_train_batch_end(self, outputs, batch, i):
        self.lrs.append(float(self.trainer.optimizers[0].param_groups[0]["lr"]))

    def configure_optimizers(self):
        opt = mpext.optim.AdamW(self.parameters(), lr=1e-2, seed=7, **FORMATS[self.fmt][1])
        sched = S.get_linear_schedule_with_warmup(opt, 1, L_STEPS * self.epochs + 1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _fit(released, fmt="fp32", accumulation=1, nan_batch=None, drop=None, clip_val=None,
         epochs=1, ckpt=None, resume=None):
    g = torch.Generator().manual_seed(0)
    n = BATCH * L_STEPS * accumulation
    x, y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)
    if drop is not None:  # the run without that batch
        keep = [i for i in range(n) if i // BATCH != drop]
        x, y = x[keep], y[keep]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                         batch_size=BATCH, shuffle=False)
    module = Module(fmt, nan_batch)
    module.epochs = epochs
    scaler = mpext.GradScaler("cpu", bf16_check_only=True)
    callbacks = [mpext.lightning.ReleaseGrads(bucket_bytes=0, scaler=scaler)] if released else []
    if ckpt is not None:  # a checkpoint at the end of the first epoch
        callbacks = callbacks + [_SaveAfterFirstEpoch(ckpt)]
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         accumulate_grad_batches=accumulation, callbacks=callbacks,
                         gradient_clip_val=clip_val)
    opt_holder = {}
    configure = module.configure_optimizers

    def keep():
        out = configure()
        opt_holder["opt"] = out["optimizer"]
        return out
    module.configure_optimizers = keep
    trainer.fit(module, loader, ckpt_path=resume)
    opt = opt_holder["opt"]
    params = list(module.net.parameters())
    return {"params": [p.detach().clone() for p in params],
            "state": [{k: v.clone() for k, v in opt.state[p].items()} for p in params],
            "lrs": module.lrs, "skipped": scaler.get_skipped_steps(),
            "grads": [p.grad for p in params]}


@pytest.mark.parametrize("fmt", ("fp32", "bf16_sr_q8"))
@pytest.mark.parametrize("accumulation", (1, 2))
def test_lightning_automatic_optimization_released_has_the_bits_of_stepping_after(fmt,
                                                                                  accumulation):
    """Lightning's automatic optimization (optimizer.step(closure), its LR scheduler, its
    accumulate_grad_batches) with ReleaseGrads: the bits of the same Trainer without it, and
    the learning rates seen; every gradient freed."""
    after = _fit(False, fmt, accumulation)
    got = _fit(True, fmt, accumulation)
    assert _same(after, got) == []
    assert got["lrs"] == after["lrs"] and len(set(got["lrs"])) > 2
    assert all(g is None for g in got["grads"])


def test_lightning_nan_batch_changes_nothing_and_the_schedule_holds():
    """A NaN in batch 2: the released run equals, bit for bit, the run without that batch (the
    skipped step changed no param, state or step count, and the schedule held still)."""
    got = _fit(True, nan_batch=2)
    without = _fit(True, drop=2)
    assert got["skipped"] == 1 and without["skipped"] == 0
    assert _same(without, got) == []
    assert got["lrs"][3:] == without["lrs"][2:]


class _SaveAfterFirstEpoch(pl.Callback):
    def __init__(self, path):
        self.path = path

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("fmt", ("fp32", "bf16_sr_q8"))
def test_lightning_released_run_resumes_bit_for_bit(tmp_path, fmt):
    """Two epochs released, a Lightning checkpoint after the first (optimizer state, the
    schedule, the callback's scaler), resumed by a fresh Trainer with a fresh ReleaseGrads:
    the bits of the uninterrupted run."""
    ckpt = str(tmp_path / "epoch0.ckpt")
    whole = _fit(True, fmt, epochs=2, ckpt=ckpt)
    resumed = _fit(True, fmt, epochs=2, resume=ckpt)
    assert _same(whole, resumed) == []
    assert resumed["lrs"] == whole["lrs"][L_STEPS:] and min(resumed["lrs"]) > 0
    first = _fit(True, fmt)  # the second epoch moved the params
    assert len(_same(first, whole)) >= 4
