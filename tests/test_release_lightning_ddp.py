"""Gradient release under Lightning's automatic optimization with its DDP strategy
(strategy="ddp", 2 gloo ranks on the CPU): mpext.lightning.ReleaseGrads takes the
DistributedDataParallel module Lightning made and steps from its comm hook, on the averaged
gradients. Compared, on every rank, with the same Trainer without release: the same bits
(params, state, the learning rates seen; no clipping, no skip), with and without
accumulate_grad_batches=2; a NaN in one rank's batch skipped on every rank (the run equals the
one without that batch, the schedule held); a Lightning checkpoint resumed by a fresh Trainer
== the uninterrupted run.

The ranks are those of tests/release_world2.py's spawn (one for the release files of world
2): the process group exists, and Lightning, told the ranks by LOCAL_RANK (its
LightningEnvironment: it launches nothing), uses it."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

pytest.importorskip("lightning.pytorch")
pytest_plugins = ("release_world2",)
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not available")

WORLD = 2
BATCH = 4  # per rank
STEPS = 3  # optimizer steps an epoch, per rank
NAN_BATCH = 1  # the batch (per rank) that holds a NaN on rank 0 only
# name -> (param dtype, optimizer kwargs): FP32 params, BF16 SR + 8-bit moments (weights of
# 4096+ elements: the 8-bit code)
FORMATS = {
    "fp32": (torch.float32, {}),
    "bf16_sr_q8": (torch.bfloat16, dict(master_weights=False, stochastic_rounding=True,
                                        exp_avg_dtype=torch.int8, exp_avg_sq_dtype=torch.uint8)),
}


def _module_class():
    import lightning.pytorch as pl

    import mpext
    from mpext.optim import lr_scheduler as S

    class Module(pl.LightningModule):
        def __init__(self, fmt, epochs=1, nan_batch=None):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 520), nn.Tanh(), nn.Linear(520, 19), nn.Tanh(),
                                     nn.Linear(19, 1)).to(FORMATS[fmt][0])
            self.fmt, self.epochs, self.nan_batch = fmt, epochs, nan_batch
            self.lrs, self.opt = [], None

        def training_step(self, batch, i):
            x, y = batch
            if i == self.nan_batch and self.global_rank == 0:
                x = x.clone()
                x[0, 0] = float("nan")
            return nn.functional.mse_loss(self.net(x.to(self.net[0].weight.dtype)).float(), y)

        def on_train_batch_end(self, outputs, batch, i):
            self.lrs.append(float(self.trainer.optimizers[0].param_groups[0]["lr"]))

        def configure_optimizers(self):
            self.opt = mpext.optim.AdamW(self.parameters(), lr=1e-2, seed=7,
                                         **FORMATS[self.fmt][1])
            sched = S.get_linear_schedule_with_warmup(self.opt, 1, 2 * STEPS * self.epochs + 1)
            return {"optimizer": self.opt, "lr_scheduler": {"scheduler": sched,
                                                             "interval": "step"}}
    return Module


def _fit(rank, released, fmt="fp32", accumulation=1, nan_batch=None, drop=None, epochs=1,
         ckpt=None, resume=None):
    """A Trainer(strategy="ddp", devices=2) fit on this rank. The data: STEPS * accumulation
    batches of BATCH a rank an epoch, rank r the samples r, r + 2, ... in order (its own
    loader: Lightning's DistributedSampler would shuffle them); drop: the run without every
    rank's batch of that index."""
    import lightning.pytorch as pl

    import mpext
    import mpext.lightning
    g = torch.Generator().manual_seed(0)
    n = WORLD * BATCH * STEPS * accumulation
    x, y = torch.randn(n, 8, generator=g)[rank::WORLD], torch.randn(n, 1, generator=g)[rank::WORLD]
    if drop is not None:
        keep = [i for i in range(len(x)) if i // BATCH != drop]
        x, y = x[keep], y[keep]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                         batch_size=BATCH, shuffle=False)
    module = _module_class()(fmt, epochs, nan_batch)
    scaler = mpext.GradScaler("cpu", bf16_check_only=True)
    callbacks = [mpext.lightning.ReleaseGrads(bucket_bytes=0, scaler=scaler)] if released else []
    if ckpt is not None:
        callbacks.append(_save_after_first_epoch(ckpt))
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy="ddp", max_epochs=epochs,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         accumulate_grad_batches=accumulation, callbacks=callbacks,
                         use_distributed_sampler=False)
    trainer.fit(module, loader, ckpt_path=resume)
    params = list(module.net.parameters())
    opt = module.opt
    return {"params": [p.detach().clone() for p in params],
            "state": [{k: v.clone() for k, v in opt.state[p].items()} for p in params],
            "lrs": module.lrs, "skipped": scaler.get_skipped_steps(),
            "grads": [p.grad for p in params],
            "ddp": type(trainer.strategy).__name__ == "DDPStrategy"
            and trainer.world_size == WORLD and trainer.global_rank == rank}


def _save_after_first_epoch(path):
    import lightning.pytorch as pl

    class Save(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.current_epoch == 0:
                trainer.save_checkpoint(path)
    return Save()


def _lightning_cases(rank, out_dir):
    """Every case on this rank (Lightning reads the ranks from the environment)."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1")
    out = {}
    for fmt, acc in (("fp32", 1), ("bf16_sr_q8", 2)):
        for released in (False, True):
            out[(fmt, acc, released)] = _fit(rank, released, fmt, acc)
    out["nan"] = _fit(rank, True, nan_batch=NAN_BATCH)
    out["without"] = _fit(rank, True, drop=NAN_BATCH)
    ckpt = os.path.join(out_dir, "lightning_epoch0.ckpt")  # rank 0 writes it
    out["whole"] = _fit(rank, True, epochs=2, ckpt=ckpt)
    dist.barrier()
    out["resumed"] = _fit(rank, True, epochs=2, resume=ckpt)
    return out


@pytest.fixture(scope="module")
def runs(release_world2):
    return [r["lightning"] for r in release_world2]


def _same(a, b):
    from release_trainer_cases import _same as same
    return same(a, b)


@pytest.mark.parametrize("fmt,acc", (("fp32", 1), ("bf16_sr_q8", 2)))
def test_lightning_ddp_released_has_the_bits_of_the_trainer_without_release(runs, fmt, acc):
    """Params, state and every learning rate seen equal, bit for bit, on both ranks; both ranks
    hold the same params (the average stepped everywhere); every gradient freed."""
    for rank, r in enumerate(runs):
        after, got = r[(fmt, acc, False)], r[(fmt, acc, True)]
        assert got["ddp"] and after["ddp"], rank
        assert _same(after, got) == [], rank
        assert got["lrs"] == after["lrs"] and len(got["lrs"]) == STEPS * acc
        assert len(set(got["lrs"])) > 2
        assert all(g is None for g in got["grads"]), rank
    assert _same(runs[0][(fmt, acc, True)], runs[1][(fmt, acc, True)]) == []


def test_lightning_ddp_nan_batch_on_one_rank_is_skipped_on_every_rank(runs):
    """A NaN in rank 0's batch 1 reaches rank 1 through DDP's average: both ranks skip that step
    and end, bit for bit, where the run without every rank's batch 1 ends; the schedule held
    still at the skipped step."""
    for rank, r in enumerate(runs):
        got, without = r["nan"], r["without"]
        assert got["skipped"] == 1 and without["skipped"] == 0, rank
        assert _same(without, got) == [], rank
        assert got["lrs"][NAN_BATCH + 1:] == without["lrs"][NAN_BATCH:], rank


def test_lightning_ddp_released_run_resumes_bit_for_bit(runs):
    """Two epochs released; a Lightning checkpoint after the first resumed by a fresh Trainer
    and ReleaseGrads on both ranks: the bits of the uninterrupted run."""
    for rank, r in enumerate(runs):
        whole, resumed = r["whole"], r["resumed"]
        assert _same(whole, resumed) == [], rank
        assert resumed["lrs"] == whole["lrs"][STEPS:] and min(resumed["lrs"]) > 0
        assert len(_same(r[("fp32", 1, True)], whole)) >= 4  # the second epoch moved them
