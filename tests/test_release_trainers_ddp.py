"""Gradient release driven by transformers.Trainer and accelerate under their DDP (MULTI_CPU,
2 gloo ranks): the release is made by accelerator.prepare, with the DDP model it makes, and
steps from DDP's comm hook. Compared, on every rank, with the same Trainer / accelerate loop
stepping after backward (mpext.accelerate.setup_trainer / use_grad_scaler): the same bits
(no clipping, no skip), and a NaN batch on one rank skipped on every rank.

One spawn of 2 ranks (tests/release_world2.py, shared with test_memory_release.py and
test_release_table.py) runs every case; the tests compare in this process."""
import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from release_trainer_cases import STEPS, _same  # noqa: E402

pytest_plugins = ("release_world2",)  # the 2-rank spawn, one for the release files
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not available")

WORLD = 2
# (format, gradient_accumulation_steps, NaN sample): every rank gets BATCH // accumulation
# samples a micro-batch from the Trainer's DistributedSampler (an epoch of BATCH * STEPS)
TRAINER_CASES = (("fp32", 1, None), ("bf16_sr_q8", 2, None), ("fp32", 1, 5))


def _accelerate_env(rank):
    """What accelerate reads to see a 2-process CPU run (the process group exists already:
    accelerate uses it)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="true")


def _trainer_cases(rank, out_dir):
    _accelerate_env(rank)
    import release_trainer_cases as T
    out = {}
    for fmt, acc, nan_at in TRAINER_CASES:
        for released in (False, True):
            got = T._train(os.path.join(out_dir, "t%d%s%d%s" % (rank, fmt, acc, released)),
                           released, fmt, acc, nan_at=nan_at)
            got["ddp"] = _was_ddp()
            out[("trainer", fmt, acc, nan_at, released)] = got
    for acc in (1, 2):
        for released in (False, True):
            got = T._accelerate_loop(released, acc, rank=rank)
            out[("accelerate", acc, released)] = got
    return out


def _was_ddp():
    from accelerate.state import PartialState
    state = PartialState()
    return state.distributed_type.name == "MULTI_CPU" and state.num_processes == WORLD


@pytest.fixture(scope="module")
def runs(release_world2):
    return [r["trainers"] for r in release_world2]


@pytest.mark.parametrize("fmt,acc", [(f, a) for f, a, n in TRAINER_CASES if n is None])
def test_released_trainer_under_ddp_has_the_bits_of_the_trainer_stepping_after(runs, fmt, acc):
    """Params, state, every logged loss and learning rate equal, bit for bit, on both ranks;
    both ranks hold the same params (DDP's average stepped everywhere); the released run's
    gradients freed."""
    for rank, r in enumerate(runs):
        after, got = r[("trainer", fmt, acc, None, False)], r[("trainer", fmt, acc, None, True)]
        assert got["ddp"] and got["released"] and not after["released"]
        assert _same(after, got) == [], rank
        assert [(h["loss"], h["learning_rate"]) for h in got["logs"]] == \
            [(h["loss"], h["learning_rate"]) for h in after["logs"]]
        assert len(got["logs"]) == STEPS
        assert all(g is None for g in got["grads"])
    assert _same(runs[0][("trainer", fmt, acc, None, True)],
                 runs[1][("trainer", fmt, acc, None, True)]) == []


def test_a_nan_batch_on_one_rank_is_skipped_on_every_rank(runs):
    """A NaN sample reaches one rank's batch; DDP's average carries it to both: the released
    step is skipped on every rank, as the Trainer's after backward is, the schedule holds."""
    for r in runs:
        after, got = r[("trainer", "fp32", 1, 5, False)], r[("trainer", "fp32", 1, 5, True)]
        # per rank 2 steps an epoch: 2 epochs, the NaN sample in one batch of each
        assert got["skipped"] == after["skipped"] == 2
        assert _same(after, got) == []
        assert got["lr"] == after["lr"] != r[("trainer", "fp32", 1, None, True)]["lr"]


@pytest.mark.parametrize("acc", (1, 2))
def test_accelerate_loop_under_ddp_released_has_the_bits_of_stepping_after(runs, acc):
    """accelerator.prepare(model, opt) (MULTI_CPU: DDP), accumulate(model), backward, step,
    zero_grad: released == stepping after backward, bit for bit, on both ranks."""
    for r in runs:
        after, got = r[("accelerate", acc, False)], r[("accelerate", acc, True)]
        assert _same(after, got) == []
        assert all(g is None for g in got["grads"])
        assert got["ddp"]
