"""mpext under PyTorch's distributed engine: DDP, FSDP2 (fully_shard) and DTensor.

Spawned processes form a gloo group on loopback (a file rendezvous in the run's temporary
directory, a collective timeout, and a wall-clock bound on the spawn, so a hung collective fails
the test instead of hanging it): one spawn per world size (2, 3, 4), whose ranks run every
scenario of that size in sequence and save what every rank ends with; the tests
then compare it, in this process, with single-process references: the same model trained by one
process on the combined batch (DDP), or torch's own AdamW and GradScaler on the full tensors
(FSDP2, DTensor). Every scenario also checks that all ranks agree bit for bit.
"""
import copy
import math
import os
import pickle
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.tensor import DTensor

import mpext
import mpext.memory

WORLD = 2
SPAWN_TIMEOUT_S = 240  # per spawn (both ranks), on a loaded 2-core machine
INF = float("inf")

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not available")


# --------------------------------------------------------------------------------------------
# Spawning.


def _entry(rank, out_dir, body, world=WORLD, backend="gloo"):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    # The rendezvous goes through a file in the run's own directory: no port to pick (and lose
    # to another process between picking and binding); gloo's own sockets bind on loopback.
    dist.init_process_group(backend, init_method="file://" + os.path.join(out_dir, "rendezvous"),
                            rank=rank, world_size=world, timeout=timedelta(seconds=90))
    try:
        results = body(rank, out_dir)
        torch.save(results, os.path.join(out_dir, "rank%d.pt" % rank))
        # After a failed part the ranks may be out of step in their collectives: a barrier
        # could pair with a peer's pending one, so leave (the peer's collective then fails).
        if not _failed_part(results):
            dist.barrier()
    finally:
        dist.destroy_process_group()


# Ranks are forked where the platform can: a spawned rank imports torch, mpext and the test
# module again (~3 s of CPU each, some 45 ranks per suite); a forked one starts from this
# process's imports. _entry sets one torch thread before any collective, so no OpenMP pool
# inherited from the parent is ever used in the child. MPEXT_TEST_START_METHOD overrides.
START_METHOD = os.environ.get("MPEXT_TEST_START_METHOD") or (
    "fork" if "fork" in mp.get_all_start_methods() else "spawn")


def _spawn(body, out_dir, world=WORLD, backend="gloo", timeout_s=SPAWN_TIMEOUT_S):
    """Runs body(rank, out_dir) on `world` ranks; returns what each rank returned. An NCCL rank
    is spawned: a process that has initialised CUDA cannot be forked."""
    ctx = mp.start_processes(_entry, args=(str(out_dir), body, world, backend), nprocs=world,
                             join=False, start_method=START_METHOD if backend == "gloo"
                             else "spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):  # raises with the rank's traceback if one failed
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail("the %d-rank run did not finish within %d s (a hung collective?)"
                        % (world, timeout_s))
    return [torch.load(os.path.join(out_dir, "rank%d.pt" % r), weights_only=False)
            for r in range(world)]


# --------------------------------------------------------------------------------------------
# The model and data shared by the ranks and the references.

GLOBAL_BATCH = 8
LOCAL_BATCH = GLOBAL_BATCH // WORLD


def _mlp(dtype=torch.float32, wide=False):
    """Its last layer has one output row, so a 2-way Shard(0) leaves rank 1 empty shards.
    wide: a first layer large enough for 8-bit moments, whose 2-way shards meet inside an
    8-bit block (513 rows of 8 on rank 0: 4104 elements)."""
    torch.manual_seed(0)
    if wide:
        m = nn.Sequential(nn.Linear(8, 1025), nn.Tanh(), nn.Linear(1025, 1))
        return m.to(dtype)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4), nn.Tanh(), nn.Linear(4, 1))
    return m.to(dtype)


def _batch(step, rank=None, inf_row=None):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    y = torch.randn(GLOBAL_BATCH, 1, generator=g)
    if inf_row is not None:
        x[inf_row, 0] = INF
    if rank is not None:
        x, y = x[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH], y[rank * LOCAL_BATCH:
                                                                 (rank + 1) * LOCAL_BATCH]
    return x, y


def _train(model, params, opt, scaler, steps, dtype, *, rank=None, input_inf=None,
           grad_inf=None, grad_inf_ranks=(0,)):
    """Trains over `steps` (a range). input_inf: the step whose batch has an inf in row 5 (a
    row of rank 1). grad_inf: the step after whose backward (after DDP's all-reduce) the first
    gradient element of the first param is set to inf on grad_inf_ranks (rank None: the
    single-process reference). Returns the scale after each step."""
    scales = []
    wrapper = isinstance(opt, mpext.MixedPrecisionOptimizer)
    for step in steps:
        x, y = _batch(step, rank, 5 if step == input_inf else None)
        opt.zero_grad(set_to_none=True)
        loss = ((model(x.to(dtype)).float() - y) ** 2).mean()
        if wrapper:
            opt.backward(loss)
        else:
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if step == grad_inf and (rank is None or rank in grad_inf_ranks):
            _local(params[0].grad).view(-1)[0] = INF
        if wrapper:
            opt.step()
            scales.append(opt.get_scale())
        elif scaler is not None:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            opt.step()
    return scales


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _snapshot(params, scales=None, scaler=None):
    out = {"params": [p.detach().clone() for p in params], "scales": scales}
    if scaler is not None:
        out["skipped"] = scaler.get_skipped_steps()
    return out


def _all_body(rank, out_dir):
    """The DDP, DTensor and example scenarios: the 2-rank spawn's first part."""
    out = _ddp_body(rank, out_dir)
    out.update(_dt_body(rank, out_dir))
    out["example"] = _example_runs(out_dir)
    return out


EXAMPLE_RUNS = {"ddp_fp16": [], "ddp_bf16": ["--precision", "bf16"], "fsdp_fp16": ["--fsdp"],
                "fsdp_bf16_sync": ["--fsdp", "--precision", "bf16", "--sync-found-inf"]}


def _example_runs(out_dir):
    """examples/ddp_train.py's train() in this group (torchrun would start new processes);
    it raises if the ranks end with different params."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "examples", "ddp_train.py")
    spec = importlib.util.spec_from_file_location("ddp_train_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = {}
    for name, argv in EXAMPLE_RUNS.items():
        args = example.parse_args(argv + ["--steps", "4", "--width", "32"])
        out[name] = example.train(args, torch.device("cpu"))
    ckpt = os.path.join(out_dir, "example.pt")
    example.train(example.parse_args(["--steps", "2", "--width", "32", "--checkpoint", ckpt]),
                  torch.device("cpu"))
    dist.barrier()  # rank 0 wrote it
    out["resumed"] = example.train(example.parse_args(
        ["--steps", "2", "--width", "32", "--checkpoint", ckpt, "--resume"]),
        torch.device("cpu"))
    return out


# --------------------------------------------------------------------------------------------
# One spawn per world size (starting the processes, importing torch and forming the group cost
# more than most scenarios): each rank runs its world's parts in sequence, each part in a folder
# of its own. A part that raises is recorded with its traceback and ends the run (the ranks may
# be out of step in their collectives after it); the tests of that part then fail naming it,
# and the other parts' tests still report.

WORLD_PARTS = {  # world size -> its parts, in order (3's reshard loads 2's checkpoints)
    2: ("ddp_dtensor_example", "sr", "reshard"),
    3: ("sr", "reshard"),
    4: ("four",),
}
FAILED = "__failed__"


def _failed_part(results):
    return isinstance(results, dict) and any(isinstance(v, dict) and FAILED in v
                                             for v in results.values())


def _world_body(rank, out_dir):
    import traceback

    bodies = {"ddp_dtensor_example": _all_body, "sr": _sr_body, "reshard": _reshard_body,
              "four": _four_body}
    out = {}
    for part in WORLD_PARTS[dist.get_world_size()]:
        part_dir = os.path.join(out_dir, part)
        os.makedirs(part_dir, exist_ok=True)
        try:
            out[part] = bodies[part](rank, part_dir)
        except Exception:
            out[part] = {FAILED: traceback.format_exc()}
            break
    return out


class _Spawns:
    """world size -> each rank's parts, spawned on first use; the one-process checkpoints the
    2-rank reshard part loads are written before its spawn, the 3-rank spawn follows the
    2-rank one (it loads that one's)."""

    def __init__(self, base):
        self.base = base
        self.worlds = {}

    def world(self, world):
        if world not in self.worlds:
            if world == 2:
                for name in RESHARD_CASES:  # one process, no process group
                    model, opt = _reshard_setup(name)
                    _sr_train(model, opt, RESHARD_SAVED)
                    _reshard_save(model, opt, str(self.base / "at1" / name))
            if world == 3:
                self.world(2)
            out_dir = self.base / ("w%d" % world)
            out_dir.mkdir()
            self.worlds[world] = _spawn(_world_body, out_dir, world,
                                        timeout_s=SPAWN_TIMEOUT_S * len(WORLD_PARTS[world]))
        return self.worlds[world]

    def part(self, world, part):
        """Each rank's result of `part` at `world` ranks; fails naming the part if it did not
        finish on a rank."""
        ranks = self.world(world)
        for rank, got in enumerate(ranks):
            if part not in got:
                failed = [p for p, v in got.items() if isinstance(v, dict) and FAILED in v]
                pytest.fail("%d ranks, rank %d: part %r did not run, part %r failed before it"
                            % (world, rank, part, failed[0] if failed else None))
            if isinstance(got[part], dict) and FAILED in got[part]:
                pytest.fail("%d ranks, rank %d: part %r failed:\n%s"
                            % (world, rank, part, got[part][FAILED]))
        return [got[part] for got in ranks]


@pytest.fixture(scope="module")
def spawns(tmp_path_factory):
    return _Spawns(tmp_path_factory.mktemp("spawns"))


@pytest.fixture(scope="module")
def results(spawns):
    return spawns.part(2, "ddp_dtensor_example")


# --------------------------------------------------------------------------------------------
# DDP: the scenarios, their single-process references.

ADAM = dict(lr=1e-2, eps=1e-3)  # eps near the gradients' size: small differences stay small
STEPS = range(5)


def _ddp_setup(name, dtype, rank=None, **scaler_kw):
    model = _mlp(dtype)
    params = list(model.parameters())
    if name.startswith("mpo"):  # MixedPrecisionOptimizer: its fused and its generic path
        inner = (torch.optim.AdamW(params, foreach=False, **ADAM) if name == "mpo_adamw_sync"
                 else torch.optim.SGD(params, lr=0.1))
        opt = mpext.MixedPrecisionOptimizer(inner, loss_scale="dynamic", init_scale=2.0 ** 8,
                                            growth_interval=2, **scaler_kw)
        if rank is not None:
            model = nn.parallel.DistributedDataParallel(model)
        return model, params, opt, opt.scaler
    if name == "sgd_sync":  # the unscale_ path of a non-fused optimizer
        opt = torch.optim.SGD(params, lr=0.1)
    else:
        opt = mpext.optim.AdamW(params, **ADAM)
    scaler = None
    if dtype == torch.float16:
        scaler = mpext.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2, **scaler_kw)
    elif name == "sgd_sync":
        scaler = mpext.GradScaler("cpu", init_scale=2.0 ** 8, **scaler_kw)
    if rank is not None:
        model = nn.parallel.DistributedDataParallel(model)
    return model, params, opt, scaler


# name -> (param dtype, _train keywords, scaler keywords on the ranks)
DDP_CASES = {
    "bf16_masters": (torch.bfloat16, {}, {}),
    "fp16_scaling": (torch.float16, {}, {}),
    "inf_before_allreduce": (torch.float16, {"input_inf": 2}, {}),
    "inf_after_allreduce_sync": (torch.float16, {"grad_inf": 2}, {"sync_found_inf": True}),
    "sgd_sync": (torch.float32, {"grad_inf": 1}, {"sync_found_inf": True, "group": True}),
    "mpo_adamw_sync": (torch.float16, {"grad_inf": 2}, {"sync_found_inf": True}),
    "mpo_sgd_sync": (torch.float16, {"grad_inf": 2}, {"sync_found_inf": True}),
    # The control: without sync_found_inf an inf seen by one rank after the all-reduce
    # splits the ranks (which is why the option exists).
    "inf_after_allreduce_nosync": (torch.float16, {"grad_inf": 2}, {}),
}


def _ddp_body(rank, out_dir):
    out = {}
    for name, (dtype, train_kw, scaler_kw) in DDP_CASES.items():
        scaler_kw = dict(scaler_kw)
        if scaler_kw.pop("group", False):
            scaler_kw["process_group"] = dist.new_group(list(range(WORLD)))
        model, params, opt, scaler = _ddp_setup(name, dtype, rank, **scaler_kw)
        scales = _train(model, params, opt, scaler, STEPS, dtype, rank=rank, **train_kw)
        out[name] = _snapshot(params, scales, scaler)

    # Checkpoint: 3 steps, save on rank 0, load everywhere into fresh objects, 2 more steps.
    path = os.path.join(out_dir, "ckpt.pt")
    model, params, opt, scaler = _ddp_setup("ckpt", torch.float16, rank)
    _train(model, params, opt, scaler, range(3), torch.float16, rank=rank)
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                    "scaler": scaler.state_dict()}, path)
    dist.barrier()
    ckpt = torch.load(path, weights_only=True)
    model, params, opt, scaler = _ddp_setup("ckpt", torch.float16, rank)
    model.module.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    scaler.load_state_dict(ckpt["scaler"])
    scales = _train(model, params, opt, scaler, range(3, 5), torch.float16, rank=rank)
    out["checkpoint"] = _snapshot(params, scales, scaler)
    out["checkpoint"]["scaler_keys"] = sorted(ckpt["scaler"])
    out["pickling"] = _pickling_checks()
    out.update(_zero_body(rank, out_dir))
    return out


# --------------------------------------------------------------------------------------------
# ZeroRedundancyOptimizer: each rank steps its partition with an mpext optimizer, then ZeRO
# broadcasts every partition's params from its owner.

ZERO_MPO = {"zero_mpo_bf16": (torch.bfloat16, {}),
            "zero_mpo_fp16": (torch.float16, dict(loss_scale="dynamic", init_scale=2.0 ** 8,
                                                  growth_interval=2))}
ZERO_INF_STEP = 2


def _mpo_factory(dtype, sync):
    """An optimizer_class for ZeRO: ZeRO calls it with the rank's param groups."""
    _, mpo_kw = ZERO_MPO["zero_mpo_bf16" if dtype == torch.bfloat16 else "zero_mpo_fp16"]

    def make(params, **defaults):
        kw = dict(mpo_kw, sync_found_inf=True) if sync and mpo_kw else mpo_kw
        return mpext.MixedPrecisionOptimizer(torch.optim.AdamW(params, foreach=False,
                                                               **defaults), **kw)
    return make


def _zero_train(model, params, zero, mpo_of, steps, dtype, rank=None):
    """The DDP loop with the scaled backward of the rank's MixedPrecisionOptimizer (mpo_of()
    gives it); an inf in every rank's copy of the first gradient at ZERO_INF_STEP (after DDP's
    all-reduce: only the owner of that param sees it, sync_found_inf tells the others)."""
    scales = []
    for step in steps:
        x, y = _batch(step, rank)
        zero.zero_grad(set_to_none=True)
        mpo_of().backward(((model(x.to(dtype)).float() - y) ** 2).mean())
        if step == ZERO_INF_STEP and dtype == torch.float16:
            params[0].grad.view(-1)[0] = INF
        zero.step()
        scales.append(mpo_of().get_scale())
    return scales


def _zero_body(rank, out_dir):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    out = {}
    for name, (dtype, _) in ZERO_MPO.items():
        model = _mlp(dtype)
        params = list(model.parameters())
        ddp = nn.parallel.DistributedDataParallel(model)
        zero = ZeroRedundancyOptimizer(params, optimizer_class=_mpo_factory(dtype, True), **ADAM)
        # ZeRO keeps its partitions as param-group dicts: they must still hold the model's
        # params after the wrapper made its masters.
        partitions_ok = all(p.dtype == dtype for part in zero._partition_parameters()
                            for g in part for p in g["params"])
        scales = _zero_train(ddp, params, zero, lambda: zero.optim, STEPS, dtype, rank)
        out[name] = _snapshot(params, scales)
        out[name]["partitions_ok"] = partitions_ok
        out[name]["skipped"] = zero.optim.scaler.get_skipped_steps()

    # mpext.optim.AdamW under ZeRO, saved and loaded mid-run: ZeRO's load_state_dict moves the
    # 0-dim step to the CPU; the optimizer takes it back to the param's device.
    path = os.path.join(out_dir, "zero.pt")

    def setup():
        model = _mlp(torch.bfloat16)
        params = list(model.parameters())
        zero = ZeroRedundancyOptimizer(params, optimizer_class=mpext.optim.AdamW, **ADAM)
        return nn.parallel.DistributedDataParallel(model), model, params, zero

    def train(ddp, zero, steps):
        for step in steps:
            x, y = _batch(step, rank)
            zero.zero_grad(set_to_none=True)
            ((ddp(x.to(torch.bfloat16)).float() - y) ** 2).mean().backward()
            zero.step()

    ddp, model, params, zero = setup()
    train(ddp, zero, range(3))
    zero.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": zero.state_dict()}, path)
    dist.barrier()
    ckpt = torch.load(path, weights_only=True)
    ddp, model, params, zero = setup()
    model.load_state_dict(ckpt["model"])
    zero.load_state_dict(ckpt["opt"])
    train(ddp, zero, range(3, 5))
    out["zero_adamw_resume"] = _snapshot(params)
    return out


def _zero_reference(name):
    dtype, mpo_kw = ZERO_MPO[name]
    model = _mlp(dtype)
    params = list(model.parameters())
    mpo = _mpo_factory(dtype, False)(params, **ADAM)
    scales = _zero_train(model, params, mpo, lambda: mpo, STEPS, dtype)
    out = _snapshot(params, scales)
    out["skipped"] = mpo.scaler.get_skipped_steps()
    return out


@pytest.mark.parametrize("name", sorted(ZERO_MPO))
def test_zero_with_mixed_precision_optimizer_matches_one_process(results, name):
    """ZeroRedundancyOptimizer(optimizer_class=<a MixedPrecisionOptimizer factory>): the ranks
    agree and match one process on the combined batch; an overflow seen only by the owner of a
    partition skips the step on every rank."""
    for r in results:
        assert r[name]["partitions_ok"]
    _assert_ranks_identical(results, name)
    ref = _zero_reference(name)
    atol = 4e-3 if name == "zero_mpo_bf16" else 1e-3  # one bf16 ulp near 0.5 is 2e-3
    _assert_close_to(ref, results[0][name], atol=atol)
    assert _moved(name, ref) > 10 * atol
    assert ref["skipped"] == (1 if name == "zero_mpo_fp16" else 0)


def test_zero_with_mpext_adamw_resumes_from_a_consolidated_checkpoint(results):
    """3 steps, consolidate, save, load into new objects, 2 more: the same as 5 steps of one
    process on the combined batch."""
    _assert_ranks_identical(results, "zero_adamw_resume")
    model = _mlp(torch.bfloat16)
    params = list(model.parameters())
    opt = mpext.optim.AdamW(params, **ADAM)
    _train(model, params, opt, None, STEPS, torch.bfloat16)
    _assert_close_to(_snapshot(params), results[0]["zero_adamw_resume"], atol=4e-3)


def _pickling_checks():
    """A pickled scaler keeps sync_found_inf but not its process group (groups cannot be
    pickled): the copy refuses to reduce until the group is set again."""
    group = dist.new_group(list(range(WORLD)))
    scaler = mpext.GradScaler("cpu", sync_found_inf=True, process_group=group)
    copy_ = pickle.loads(pickle.dumps(scaler))
    flag = torch.full((), float(dist.get_rank() == 1))
    try:
        copy_._reduce_found_inf_(flag)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    untouched = flag.item()
    copy_.process_group = group
    copy_._reduce_found_inf_(flag)
    return {"sync": copy_._sync_found_inf, "error": error, "untouched": untouched,
            "reduced": flag.item(), "keys": sorted(scaler.state_dict())}


def _ddp_reference(name):
    dtype, train_kw, _ = DDP_CASES[name]
    model, params, opt, scaler = _ddp_setup(name, dtype)
    scales = _train(model, params, opt, scaler, STEPS, dtype, **train_kw)
    return _snapshot(params, scales, scaler)




def _assert_ranks_identical(results, name):
    r0 = results[0][name]
    for r in results[1:]:
        assert r[name]["scales"] == r0["scales"], name
        assert r[name].get("skipped") == r0.get("skipped"), name
        for a, b in zip(r0["params"], r[name]["params"]):
            assert torch.equal(a, b), name


def _assert_close_to(ref, got, atol, rtol=0.0):
    assert got["scales"] == ref["scales"]
    assert got.get("skipped") == ref.get("skipped")
    for i, (a, b) in enumerate(zip(ref["params"], got["params"])):
        torch.testing.assert_close(b.float(), a.float(), atol=atol, rtol=rtol,
                                   msg=lambda m: "param %d: %s" % (i, m))


def _moved(name, snapshot):
    """How far training moved the params: the tolerances below must be far smaller."""
    init = list(_mlp(snapshot["params"][0].dtype).parameters())
    return max((a.float() - b.detach().float()).abs().max().item()
               for a, b in zip(snapshot["params"], init))


@pytest.mark.parametrize("name,atol", [("bf16_masters", 4e-3), ("fp16_scaling", 1e-3),
                                       ("inf_before_allreduce", 1e-3),
                                       ("inf_after_allreduce_sync", 1e-3),
                                       ("sgd_sync", 1e-5), ("mpo_adamw_sync", 1e-3),
                                       ("mpo_sgd_sync", 1e-3)])
def test_ddp_matches_one_process_on_the_combined_batch(results, name, atol):
    _assert_ranks_identical(results, name)
    ref = _ddp_reference(name)
    _assert_close_to(ref, results[0][name], atol=atol)
    assert _moved(name, ref) > 10 * atol  # the comparison is not trivially met
    if name in ("inf_before_allreduce", "inf_after_allreduce_sync", "sgd_sync",
                "mpo_adamw_sync", "mpo_sgd_sync"):
        assert ref["skipped"] == 1  # the injected overflow was skipped everywhere
    elif name == "fp16_scaling":
        assert ref["scales"] == [256.0, 512.0, 512.0, 1024.0, 1024.0]  # grew without overflow


def test_ddp_inf_after_allreduce_without_sync_splits_the_ranks(results):
    r0, r1 = (r["inf_after_allreduce_nosync"] for r in results)
    assert (r0["skipped"], r1["skipped"]) == (1, 0)
    assert r0["scales"] != r1["scales"]


def test_ddp_checkpoint_save_and_load(results):
    _assert_ranks_identical(results, "checkpoint")
    full = results[0]["fp16_scaling"]
    resumed = results[0]["checkpoint"]
    assert resumed["scales"] == full["scales"][3:]
    for a, b in zip(full["params"], resumed["params"]):
        assert torch.equal(a, b)
    # torch's GradScaler state_dict keys, unchanged by the distributed options
    assert resumed["scaler_keys"] == sorted(torch.amp.GradScaler("cpu").state_dict())


# --------------------------------------------------------------------------------------------
# Sharded gradients: DTensor directly, then FSDP2.

SHAPES = [(6, 5), (1, 5), (3,)]  # (1, 5): rank 1 holds an empty shard; (3,): replicated
DT_STEPS, DT_INF_STEP, DT_SCALE = 4, 2, 2.0 ** 10


def _dt_full(dtype):
    g = torch.Generator().manual_seed(7)
    params = [torch.randn(s, generator=g).to(dtype) for s in SHAPES]
    grads = [[torch.randn(s, generator=g).to(dtype) for s in SHAPES] for _ in range(DT_STEPS)]
    # The overflow sits in row 0 of the (1, 5) param: in rank 0's shard only.
    grads[DT_INF_STEP][1][0, 3] = INF
    return params, grads


def _dt_body(rank, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    out = {}

    def placements(i):
        return [Replicate()] if len(SHAPES[i]) == 1 else [Shard(0)]

    def run(dtype, make_opt, only=None, no_grad_rank=None):
        full_params, full_grads = _dt_full(dtype)
        idx = list(range(len(SHAPES))) if only is None else only
        params = [nn.Parameter(distribute_tensor(full_params[i], mesh, placements(i)))
                  for i in idx]
        opt = make_opt(params)
        scaler = mpext.GradScaler("cpu", init_scale=DT_SCALE, growth_interval=1000)
        scaler.scale(torch.ones(()))  # creates the scale
        found = []
        for step in range(DT_STEPS):
            for p, i in zip(params, idx):
                p.grad = distribute_tensor(full_grads[step][i] * DT_SCALE, mesh, placements(i))
                if rank == no_grad_rank:
                    p.grad = None
            scaler.step(opt)
            found.append(bool(scaler.last_step_skipped()))
            scaler.update()
        return params, opt, scaler, found

    def record(name, params, opt, scaler, found):
        out[name] = {"params": [p.detach().full_tensor() for p in params],
                     "local_numel": [p.to_local().numel() for p in params],
                     "found": found, "scale": scaler.get_scale(),
                     "skipped": scaler.get_skipped_steps()}

    for dtype in (torch.float32, torch.bfloat16):
        name = "mpext_adamw_%s" % str(dtype).split(".")[-1]
        params, opt, scaler, found = run(dtype, lambda ps: mpext.optim.AdamW(ps, **ADAM))
        record(name, params, opt, scaler, found)
        st = opt.state[params[0]]
        out[name]["state_types"] = {k: (type(v).__name__, tuple(v.placements)
                                        if hasattr(v, "placements") else None)
                                    for k, v in st.items()}
        out[name]["exp_avg"] = [opt.state[p]["exp_avg"].full_tensor() for p in params]
        if dtype == torch.bfloat16:
            out[name]["masters"] = [opt.state[p]["master_param"].full_tensor() for p in params]
            # state_dict round trip into a fresh sharded optimizer (DTensor -> DTensor)
            fresh = mpext.optim.AdamW(params, **ADAM)
            fresh.load_state_dict(opt.state_dict())
            out[name]["reloaded_masters"] = [fresh.state[p]["master_param"].full_tensor()
                                             for p in params]
            # ... and from a state placed otherwise (replicated): redistributed on loading
            sd = opt.state_dict()
            sd["state"] = {k: {n: v.redistribute(mesh, [Replicate()]) if isinstance(v, DTensor)
                               else v for n, v in st.items()} for k, st in sd["state"].items()}
            fresh = mpext.optim.AdamW(params, **ADAM)
            fresh.load_state_dict(sd)
            out[name]["redistributed"] = [
                (tuple(fresh.state[p]["exp_avg"].placements) == tuple(p.placements)
                 and torch.equal(fresh.state[p]["master_param"].full_tensor(), m))
                for p, m in zip(params, out[name]["masters"])]

    # The lean modes on shards: remainders (+ bf16 moments, + an EMA), and no master with
    # stochastic rounding. Each rank keeps shard-local state of each kind.
    lean = {"remainder": dict(param_remainders=True),
            "remainder_bf16_moments_ema": dict(param_remainders=True, ema_decay=0.9,
                                               exp_avg_dtype=torch.bfloat16,
                                               exp_avg_sq_dtype=torch.bfloat16),
            "master_free_sr": dict(master_weights=False, stochastic_rounding=True,
                                   exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)}
    for mode, kw in lean.items():
        params, opt, scaler, found = run(torch.bfloat16,
                                         lambda ps: mpext.optim.AdamW(ps, **ADAM, **kw))
        name = "lean_" + mode
        record(name, params, opt, scaler, found)
        out[name]["state"] = {k: (type(v).__name__, str(v.dtype),
                                  tuple(v.placements) == tuple(params[0].placements)
                                  if hasattr(v, "placements") else None)
                              for k, v in opt.state[params[0]].items()}
        out[name]["masters"] = [opt.master_param(p).full_tensor() for p in params]
        if "ema_decay" in kw:
            out[name]["ema"] = [opt.ema_param(p).full_tensor() for p in params]
        # a checkpoint of this mode resumed with FP32 masters: converted shard by shard (a
        # remainder is joined with its param at the next step, which master_param() shows)
        fresh = mpext.optim.AdamW(params, **ADAM)
        fresh.load_state_dict(opt.state_dict())
        out[name]["as_masters"] = [fresh.master_param(p).full_tensor()
                                   if {"master_param", "param_remainder"} & set(fresh.state[p])
                                   else None for p in params]

    # torch's own foreach AdamW: the scaler's unscale_ path unscales the local shards.
    params, opt, scaler, found = run(torch.float32,
                                     lambda ps: torch.optim.AdamW(ps, foreach=True, **ADAM))
    record("torch_adamw_unscale_path", params, opt, scaler, found)

    # Only the (1, 5) param: rank 1's shards are all empty, yet it must see the overflow.
    params, opt, scaler, found = run(torch.float32, lambda ps: mpext.optim.AdamW(ps, **ADAM),
                                     only=[1])
    record("empty_shards_only", params, opt, scaler, found)
    # ... and the same when rank 1 has no gradient at all.
    params, opt, scaler, found = run(torch.float32, lambda ps: mpext.optim.AdamW(ps, **ADAM),
                                     only=[1], no_grad_rank=1)
    record("no_grads_on_rank_1", params, opt, scaler, found)

    # A torch checkpoint of full tensors loaded into a sharded optimizer: each rank keeps its
    # own shard of the moments (and makes its masters from its params).
    full_params, _ = _dt_full(torch.float32)
    ref_params = [nn.Parameter(t.clone()) for t in full_params]
    ref_opt = torch.optim.AdamW(ref_params, **ADAM)
    for p in ref_params:
        p.grad = torch.ones_like(p)
    ref_opt.step()
    params = [nn.Parameter(distribute_tensor(t.to(torch.bfloat16), mesh, placements(i)))
              for i, t in enumerate(full_params)]
    opt = mpext.optim.AdamW(params, **ADAM)
    opt.load_state_dict(ref_opt.state_dict())
    out["load_full_checkpoint"] = {
        "exp_avg": [opt.state[p]["exp_avg"].full_tensor() for p in params],
        "ref_exp_avg": [ref_opt.state[p]["exp_avg"] for p in ref_params],
        "is_dtensor": [type(opt.state[p]["exp_avg"]).__name__ for p in params]}
    out["bad_grads"] = _bad_grad_checks(mesh)
    out.update(_fsdp_body(rank, mesh, out_dir))
    return out


def _bad_grad_checks(mesh):
    """A DTensor param whose gradient is plain, or placed otherwise: a clear error before
    anything is written."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    p = nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    opt = mpext.optim.AdamW([p])
    out = []
    for grad in (torch.ones(4, 2), distribute_tensor(torch.ones(4, 2), mesh, [Replicate()])):
        p.grad = grad
        try:
            opt.step()
            out.append(None)
        except (TypeError, ValueError) as exc:
            out.append((type(exc).__name__, str(exc)))
    out.append(len(opt.state) == 0 and bool(torch.equal(p.to_local(), torch.ones(2, 2))))
    return out


def _dt_reference(dtype, only=None):
    """torch.optim.AdamW and torch.amp.GradScaler on the full (unsharded) tensors, FP32 masters
    for a bfloat16 run."""
    full_params, full_grads = _dt_full(dtype)
    idx = list(range(len(SHAPES))) if only is None else only
    masters = [nn.Parameter(full_params[i].float()) for i in idx]
    opt = torch.optim.AdamW(masters, foreach=False, **ADAM)
    scaler = torch.amp.GradScaler("cpu", init_scale=DT_SCALE, growth_interval=1000)
    scaler.scale(torch.ones(()))
    for step in range(DT_STEPS):
        for m, i in zip(masters, idx):
            m.grad = full_grads[step][i].float() * DT_SCALE
        scaler.step(opt)
        scaler.update()
    return ([m.detach().to(dtype) for m in masters], [m.detach() for m in masters],
            [opt.state[m]["exp_avg"] for m in masters], scaler.get_scale())




def _assert_dt_case(results, name, dtype, only=None, atol=0.0):
    for r in results:  # every rank skipped exactly the overflowing step, same scale
        assert r[name]["found"] == [s == DT_INF_STEP for s in range(DT_STEPS)], (name, r[name])
        assert r[name]["skipped"] == 1
        assert r[name]["scale"] == DT_SCALE / 2
        for a, b in zip(results[0][name]["params"], r[name]["params"]):
            assert torch.equal(a, b)
    params, masters, exp_avgs, scale = _dt_reference(dtype, only)
    got = results[0][name]
    assert got["scale"] == scale
    for a, b in zip(params, got["params"]):
        torch.testing.assert_close(b, a, atol=atol, rtol=0)
    return masters, exp_avgs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtensor_mpext_adamw_and_scaler_match_torch_on_full_tensors(results, dtype):
    name = "mpext_adamw_%s" % str(dtype).split(".")[-1]
    masters, exp_avgs = _assert_dt_case(results, name, dtype,
                                        atol=1e-6 if dtype == torch.float32 else 0.0)
    got = results[0][name]
    assert got["local_numel"] == [15, 5, 3] and results[1][name]["local_numel"] == \
        [15, 0, 3]
    for a, b in zip(exp_avgs, got["exp_avg"]):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    # state as torch keeps it: DTensor moments (and masters) placed as the param, plain step
    assert got["state_types"]["step"] == ("Tensor", None)
    assert got["state_types"]["exp_avg"][0] == "DTensor"
    assert "Shard(dim=0)" in str(got["state_types"]["exp_avg"][1])
    if dtype == torch.bfloat16:
        assert got["state_types"]["master_param"][0] == "DTensor"
        for a, b, c in zip(masters, got["masters"], got["reloaded_masters"]):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
            assert torch.equal(b, c)
        assert got["redistributed"] == [True] * len(SHAPES)


@pytest.mark.parametrize("mode", ["remainder", "remainder_bf16_moments_ema", "master_free_sr"])
def test_dtensor_lean_modes_keep_shard_local_state(results, mode):
    """Every lean mode on sharded params: the state is DTensors placed as the param; ranks
    agree; remainders give the FP32-master run's bits; a checkpoint resumes with masters."""
    name = "lean_" + mode
    for r in results:
        assert r[name]["found"] == [s == DT_INF_STEP for s in range(DT_STEPS)]
        for a, b in zip(results[0][name]["params"], r[name]["params"]):
            assert torch.equal(a, b)
    got = results[0][name]
    state = got["state"]
    assert state["step"][0] == "Tensor"
    for key, dtype in (("exp_avg", "torch.float32" if mode == "remainder" else "torch.bfloat16"),
                       ("exp_avg_sq",
                        "torch.float32" if mode == "remainder" else "torch.bfloat16")):
        assert state[key] == ("DTensor", dtype, True)
    if mode.startswith("remainder"):
        assert state["param_remainder"] == ("DTensor", "torch.int16", True)
        assert "master_param" not in state
        assert all(m is not None for m in got["as_masters"])  # loaded: each param has one
        for a, b in zip(got["masters"], got["as_masters"]):
            assert torch.equal(a, b)
    else:
        assert "param_remainder" not in state and "master_param" not in state
    if mode == "remainder":
        ref = results[0]["mpext_adamw_bfloat16"]
        for a, b in zip(ref["params"], got["params"]):
            assert torch.equal(a, b)
        for a, b in zip(ref["masters"], got["masters"]):
            assert torch.equal(a, b)
    if mode == "remainder_bf16_moments_ema":
        assert state["ema_param"] == ("DTensor", "torch.float32", True)
        for e, m in zip(got["ema"], got["masters"]):
            assert e.shape == m.shape and torch.isfinite(e).all()
    # close to the FP32-master reference on the full tensors (bf16 moments and stochastic
    # rounding move the result by a few bf16 ulps at most over these steps)
    params, _, _, _ = _dt_reference(torch.bfloat16)
    for a, b in zip(params, got["params"]):
        torch.testing.assert_close(b.float(), a.float(), atol=0.05, rtol=0.05)


def test_dtensor_unscale_path_with_torch_adamw(results):
    _assert_dt_case(results, "torch_adamw_unscale_path", torch.float32, atol=1e-6)


@pytest.mark.parametrize("name", ["empty_shards_only", "no_grads_on_rank_1"])
def test_dtensor_rank_without_local_gradients_takes_part(results, name):
    assert results[1][name]["local_numel"] == [0]
    _assert_dt_case(results, name, torch.float32, only=[1], atol=1e-6)


def test_dtensor_optimizer_loads_a_full_tensor_checkpoint(results):
    got = results[0]["load_full_checkpoint"]
    assert got["is_dtensor"] == ["DTensor"] * len(SHAPES)
    for a, b in zip(got["ref_exp_avg"], got["exp_avg"]):
        assert torch.equal(a, b)


# FSDP2 --------------------------------------------------------------------------------------

FSDP_CASES = {  # name -> (compute dtype, grad_inf step)
    "fsdp_bf16": (torch.bfloat16, None),
    "fsdp_fp16_scaling": (torch.float16, 2),
}


def _fsdp_body(rank, mesh, out_dir):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    out = {}
    for name, (dtype, grad_inf) in FSDP_CASES.items():
        model = _mlp(torch.float32)
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        params = list(model.parameters())
        opt = mpext.optim.AdamW(params, **ADAM)
        scaler = (mpext.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
                  if dtype == torch.float16 else None)
        # The overflow goes into rank 0's shard of the first weight, after the
        # reduce-scatter: rank 1 sees only finite gradients.
        scales = _train(model, params, opt, scaler, STEPS, torch.float32, rank=rank,
                        grad_inf=grad_inf)
        out[name] = {"params": [p.detach().full_tensor() for p in params], "scales": scales,
                     "skipped": scaler.get_skipped_steps() if scaler else None,
                     "placements": [str(p.placements) for p in params]}
    out["fsdp_dcp"] = _dcp_checks(rank, mesh, out_dir)
    out["fsdp_full_state_dict"] = _full_state_dict_checks(rank, mesh)
    out["fsdp_one_to_two"] = _one_to_two_ranks_checks(rank, mesh, out_dir)
    return out


def _fsdp_model(mesh, wide=False, **opt_kw):
    """The BF16 MLP under FSDP2 (each Linear and the whole) with an mpext.optim.AdamW."""
    from torch.distributed.fsdp import fully_shard

    model = _mlp(torch.bfloat16, wide)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, list(model.parameters()), mpext.optim.AdamW(model.parameters(), **ADAM,
                                                              **opt_kw)


# The formats of the FSDP2 checkpoint checks, and what a single-process checkpoint is loaded
# from (the pairs): one process's 8-bit codes and scales into 8-bit FSDP2 ranks are their
# shards, bit for bit; other formats into 8-bit are coded on the whole param's blocks.
Q8_MOMENTS = dict(exp_avg_dtype=torch.int8, exp_avg_sq_dtype=torch.uint8)
FSDP_FORMATS = {"master": {}, "remainder": dict(param_remainders=True),
                "sr": dict(master_weights=False, stochastic_rounding=True),
                "bf16_moments": dict(exp_avg_dtype=torch.bfloat16,
                                     exp_avg_sq_dtype=torch.bfloat16),
                "ema": dict(ema_decay=0.9), "q8": Q8_MOMENTS}
ONE_PROCESS_FORMATS = FSDP_FORMATS
DCP_PAIRS = [("q8", "bf16_moments"), ("q8", "master"), ("master", "remainder"),
             ("remainder", "master"), ("sr", "remainder"), ("bf16_moments", "ema"),
             ("q8", "q8"), ("bf16_moments", "q8")]


def _full(t):
    """A state tensor in full, as a plain tensor (gloo gathers no int16: remainders go through
    int32, exactly)."""
    if not isinstance(t, DTensor):
        return t.clone()
    if t.dtype == torch.int16:
        return t.to(torch.int32).full_tensor().to(torch.int16)
    return t.full_tensor()


def _full_state(opt, params):
    """Every state entry of every param, as full plain tensors (in param order), read through
    state_dict() (a collective under FSDP2 with 8-bit moments: a rank keeps the scales of its
    shard's blocks, and state_dict() gives every block's)."""
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    state = opt.state_dict()["state"]
    return [{k: _full(v) for k, v in state.get(index[id(p)], {}).items()} for p in params]


def _full_state_dict_checks(rank, mesh):
    """get_optimizer_state_dict(full_state_dict=True) in every FSDP2 format: the gathered
    entries against the sharded state's full tensors, and the gathered state loaded back with
    set_optimizer_state_dict(full_state_dict=True) into a fresh run, whose state must then be
    the original's, bit for bit; also with broadcast_from_rank0=True (rank 0 alone holds the
    gathered state; the others pass an empty one)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict)

    full = StateDictOptions(full_state_dict=True)
    from_rank0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    out = {}
    for name, kw in FSDP_FORMATS.items():
        wide = name == "q8"  # a weight large enough for 8-bit moments
        model, params, opt = _fsdp_model(mesh, wide, **kw)
        _train(model, params, opt, None, range(2), torch.bfloat16, rank=rank)
        try:
            sd = get_optimizer_state_dict(model, opt, options=full)
        except BaseException as exc:  # what the test reports
            out[name] = "%s: %s" % (type(exc).__name__, exc)
            continue
        model2, params2, opt2 = _fsdp_model(mesh, wide, **kw)
        with torch.no_grad():
            for a, b in zip(params2, params):
                a.copy_(b)
        set_optimizer_state_dict(model2, opt2, sd, options=full)
        model3, params3, opt3 = _fsdp_model(mesh, wide, **kw)
        with torch.no_grad():
            for a, b in zip(params3, params):
                a.copy_(b)
        set_optimizer_state_dict(model3, opt3, sd if rank == 0 else {}, options=from_rank0)
        out[name] = {"gathered": [sd["state"][n] for n, _ in model.named_parameters()],
                     "state": _full_state(opt, params), "loaded": _full_state(opt2, params2),
                     "broadcast": _full_state(opt3, params3), "groups": sd["param_groups"]}
    return out


def _one_process_checkpoints(rank, out_dir):
    """On rank 0 alone, one single-process run per format: a DCP checkpoint (no_dist) and its
    torch.save twin. Returns the directory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = os.path.join(out_dir, "one_process")
    if rank == 0:
        for name in {src for src, _ in DCP_PAIRS}:
            model = _mlp(torch.bfloat16, wide=True)
            opt = mpext.optim.AdamW(model.parameters(), **ADAM, **ONE_PROCESS_FORMATS[name])
            _train(model, list(model.parameters()), opt, None, range(3), torch.bfloat16)
            codes = [v for v in opt.state_dict()["state"][0].values() if v.dtype == torch.int8]
            assert bool(codes) == (name == "q8")  # the first layer's moments are 8-bit
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, name),
                     no_dist=True)
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()},
                       os.path.join(root, name + ".pt"))
    dist.barrier()
    return root


def _one_to_two_ranks_checks(rank, mesh, out_dir):
    """Single-process checkpoints into FSDP2 runs of other formats, through DCP with
    mpext.dcp.LoadPlanner and through load_state_dict of the full-tensor state_dict, against
    the same loads into a single-process optimizer (the reference conversion)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import mpext.dcp

    root = _one_process_checkpoints(rank, out_dir)
    out = {}
    for src, dst in DCP_PAIRS:
        saved = torch.load(os.path.join(root, src + ".pt"), weights_only=False)
        ref_model = _mlp(torch.bfloat16, wide=True)
        ref = mpext.optim.AdamW(ref_model.parameters(), **ADAM, **FSDP_FORMATS[dst])
        ref_model.load_state_dict(saved["model"])
        ref.load_state_dict(saved["optim"])
        model, params, opt = _fsdp_model(mesh, wide=True, **FSDP_FORMATS[dst])
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=os.path.join(root, src),
                 planner=mpext.dcp.LoadPlanner())
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        model2, params2, opt2 = _fsdp_model(mesh, wide=True, **FSDP_FORMATS[dst])
        with torch.no_grad():
            for a, b in zip(params2, ref_model.parameters()):
                a.copy_(distribute_like(b, a))
        try:
            opt2.load_state_dict(saved["optim"])  # full tensors: each rank keeps its shard
            direct = _full_state(opt2, params2)
        except BaseException as exc:
            direct = "%s: %s" % (type(exc).__name__, exc)
        out[(src, dst)] = {"ref": _full_state(ref, list(ref_model.parameters())),
                           "dcp": _full_state(opt, params), "direct": direct,
                           "placements": [str(next(v for v in opt.state[p].values()
                                                   if isinstance(v, DTensor)).placements)
                                          for p in params]}
    return out


def distribute_like(full, like):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def _dcp_checks(rank, mesh, out_dir):
    """torch.distributed.checkpoint with FSDP2, BF16 sharded params and mpext.optim.AdamW's
    sharded FP32 masters: save after 3 steps, load into fresh objects, 2 more steps on both;
    returns whether the resumed run equals the uninterrupted one, params and masters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def make():
        return _fsdp_model(mesh)

    model, params, opt = make()
    _train(model, params, opt, None, range(3), torch.bfloat16, rank=rank)
    model_sd, opt_sd = get_state_dict(model, opt)
    path = os.path.join(out_dir, "dcp")
    dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=path)
    model2, params2, opt2 = make()
    model_sd2, opt_sd2 = get_state_dict(model2, opt2)
    loaded = {"model": model_sd2, "optim": opt_sd2}
    dcp.load(loaded, checkpoint_id=path)
    set_state_dict(model2, opt2, model_state_dict=loaded["model"],
                   optim_state_dict=loaded["optim"])
    for m, ps, o in ((model, params, opt), (model2, params2, opt2)):
        _train(m, ps, o, None, range(3, 5), torch.bfloat16, rank=rank)
    return {"params": [torch.equal(a.full_tensor(), b.full_tensor())
                       for a, b in zip(params, params2)],
            "masters": [torch.equal(opt.state[a]["master_param"].full_tensor(),
                                    opt2.state[b]["master_param"].full_tensor())
                        for a, b in zip(params, params2)],
            "moved": max((a.full_tensor().float() - b.float()).abs().max().item()
                         for a, b in zip(params, _mlp(torch.bfloat16).parameters())),
            "state_keys": sorted(next(iter(opt_sd["state"].values())))}


def _fsdp_reference(name):
    """One process on the combined batch, as FSDP2's policy computes: the forward and backward
    in the low-precision dtype, gradients reduced in float32, torch.optim.AdamW (and
    torch.amp.GradScaler) on the float32 params."""
    dtype, grad_inf = FSDP_CASES[name]
    master = _mlp(torch.float32)
    params = list(master.parameters())
    opt = torch.optim.AdamW(params, foreach=False, **ADAM)
    scaler = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
              if dtype == torch.float16 else None)
    scales, skipped = [], 0
    for step in STEPS:
        low = copy.deepcopy(master).to(dtype)
        x, y = _batch(step)
        loss = ((low(x.to(dtype)).float() - y) ** 2).mean()
        (scaler.scale(loss) if scaler else loss).backward()
        for p, q in zip(params, low.parameters()):
            p.grad = q.grad.float()
        if step == grad_inf:
            params[0].grad.view(-1)[0] = INF
        if scaler:
            scaler.step(opt)
            skipped += any(f.item() for f in scaler._found_inf_per_device(opt).values())
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            opt.step()
    return {"params": [p.detach() for p in params], "scales": scales,
            "skipped": skipped if scaler else None}


@pytest.mark.parametrize("name", list(FSDP_CASES))
def test_fsdp2_matches_one_process_on_the_combined_batch(results, name):
    for r in results:
        assert r[name]["scales"] == results[0][name]["scales"]
        assert r[name]["skipped"] == results[0][name]["skipped"]
        for a, b in zip(results[0][name]["params"], r[name]["params"]):
            assert torch.equal(a, b)
    got = results[0][name]
    assert all("Shard(dim=0)" in p for p in got["placements"])
    ref = _fsdp_reference(name)
    _assert_close_to(ref, got, atol=1e-3)
    assert _moved(name, ref) > 10 * 1e-3
    if name == "fsdp_fp16_scaling":
        assert got["skipped"] == 1 and got["scales"][2] == got["scales"][1] / 2


def test_pickled_scaler_keeps_sync_found_inf_but_needs_its_group_again(results):
    for r in results:
        got = r["pickling"]
        assert got["sync"] is True
        assert "process_group" in got["error"] and got["untouched"] == float(r is results[1])
        assert got["reduced"] == 1.0  # rank 1's flag reached rank 0
        assert got["keys"] == sorted(torch.amp.GradScaler("cpu").state_dict())


def test_dtensor_param_with_a_mismatched_gradient_raises_before_writing(results):
    for r in results:
        plain, replicated, untouched = r["bad_grads"]
        assert plain[0] == "TypeError" and "DTensor gradient" in plain[1]
        assert replicated[0] == "ValueError" and "placed as" in replicated[1]
        assert untouched


# --------------------------------------------------------------------------------------------
# The options, in one process.


def test_distributed_options_are_checked():
    with pytest.raises(TypeError, match="sync_found_inf must be a bool"):
        mpext.GradScaler("cpu", sync_found_inf=1)
    with pytest.raises(TypeError, match="process_group must be None or a torch.distributed"):
        mpext.GradScaler("cpu", sync_found_inf=True, process_group="world")
    scaler = mpext.GradScaler("cpu")
    with pytest.raises(TypeError, match="process_group must be None"):
        scaler.process_group = 0
    assert scaler.process_group is None


def test_reduce_found_inf_is_a_no_op_without_sync_found_inf():
    flag = torch.ones(())
    mpext.GradScaler("cpu")._reduce_found_inf_(flag)  # no process group needed
    mpext.GradScaler("cpu", sync_found_inf=True, enabled=False)._reduce_found_inf_(flag)
    assert flag.item() == 1.0


@pytest.mark.skipif(dist.is_initialized(), reason="a process group is already initialized")
def test_sync_found_inf_without_a_process_group_raises():
    scaler = mpext.GradScaler("cpu", sync_found_inf=True)
    with pytest.raises(RuntimeError, match="init_process_group"):
        scaler._reduce_found_inf_(torch.zeros(()))
    assert sorted(scaler.state_dict()) == sorted(torch.amp.GradScaler("cpu").state_dict())


def test_fsdp2_distributed_checkpoint_resumes_bit_identically(results):
    for r in results:
        got = r["fsdp_dcp"]
        assert got["state_keys"] == ["exp_avg", "exp_avg_sq", "master_param", "step"]
        assert all(got["params"]) and all(got["masters"]) and len(got["params"]) == 6
        assert got["moved"] > 0.01


def test_the_example_runs_ddp_and_fsdp2(results):
    got = results[0]["example"]
    for r in results:  # the ranks agree on the scale and skips (train() checks the params);
        for name, res in r["example"].items():  # the loss is each rank's own batch's
            assert (res["scale"], res["skipped"]) == (got[name]["scale"], got[name]["skipped"])
    for name in EXAMPLE_RUNS:
        assert math.isfinite(got[name]["loss"]) and got[name]["skipped"] == 0
    assert got["ddp_fp16"]["scale"] == 2.0 ** 12 and got["ddp_bf16"]["scale"] == 1.0
    # 2 steps, a checkpoint, 2 more steps from it: the 4-step run, to the bit
    for r in results:
        assert r["example"]["resumed"] == r["example"]["ddp_fp16"]


def _equal_bits(a, b):
    if a.dtype != b.dtype and {a.dtype, b.dtype} == {torch.int16, torch.int32}:
        return torch.equal(a.long(), b.long())  # a remainder, given to the gather as int32
    return a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8),
                                              b.view(-1).view(torch.uint8))


@pytest.mark.parametrize("name", sorted(FSDP_FORMATS))
def test_fsdp2_full_state_dict_gathers_and_loads_back_bit_for_bit(results, name):
    for r in results:
        got = r["fsdp_full_state_dict"][name]
        assert isinstance(got, dict), got
        for gathered, state, loaded, broadcast in zip(got["gathered"], got["state"],
                                                      got["loaded"], got["broadcast"]):
            assert set(gathered) == set(state) == set(loaded) == set(broadcast)
            for k in state:
                assert not isinstance(gathered[k], DTensor), k
                assert _equal_bits(gathered[k], state[k]), (name, k)
                assert _equal_bits(loaded[k], state[k]), (name, k)
                assert _equal_bits(broadcast[k], state[k]), (name, k)
        if name == "q8":
            assert any(k.endswith("_q8_scale") for st in got["state"] for k in st)
        for g in got["groups"]:
            assert all(not isinstance(v, torch.dtype) for v in g.values())


@pytest.mark.parametrize("src,dst", DCP_PAIRS)
def test_one_process_checkpoint_into_two_fsdp2_ranks_of_another_format(results, src, dst):
    """Through DCP with mpext.dcp.LoadPlanner and through load_state_dict of the full-tensor
    state: the state each FSDP2 run ends with is the single-process conversion's, bit for
    bit (8-bit codes decoded whole, each rank keeping its shard)."""
    for r in results:
        got = r["fsdp_one_to_two"][(src, dst)]
        assert isinstance(got["direct"], list), got["direct"]
        assert all("Shard" in p or "Replicate" in p for p in got["placements"])
        for ref, via_dcp, direct in zip(got["ref"], got["dcp"], got["direct"]):
            assert set(ref) == set(via_dcp) == set(direct)
            for k in ref:
                assert _equal_bits(via_dcp[k], ref[k]), (src, dst, k)
                assert _equal_bits(direct[k], ref[k]), (src, dst, k)


# --------------------------------------------------------------------------------------------
# Stochastic rounding on any mesh: a sharded run draws the bits of one process. Every rank
# trains on the same full batch, so the reduced gradients are one process's (an fp32
# reduce-scatter of equal bf16 values, divided by the world size, is exact).

SR_STEPS = range(6)
SR_LR = dict(lr=1e-2)
SR_CASES = {  # name -> (rule, keywords): every format whose bits depend on the position
    "remainder_bf16_moments": ("AdamW", dict(param_remainders=True,
                                             exp_avg_dtype=torch.bfloat16,
                                             exp_avg_sq_dtype=torch.bfloat16)),
    "sr_bf16_moments": ("AdamW", dict(master_weights=False, stochastic_rounding=True,
                                      exp_avg_dtype=torch.bfloat16,
                                      exp_avg_sq_dtype=torch.bfloat16)),
    "sr_fp32_moments": ("AdamW", dict(master_weights=False, stochastic_rounding=True)),
    "sr_bf16_moments_ema": ("AdamW", dict(master_weights=False, stochastic_rounding=True,
                                          exp_avg_dtype=torch.bfloat16,
                                          exp_avg_sq_dtype=torch.bfloat16, ema_decay=0.9)),
    "lion_sr": ("Lion", dict(master_weights=False, stochastic_rounding=True, lr=1e-3)),
    "sgd_sr_bf16_momentum": ("SGD", dict(master_weights=False, stochastic_rounding=True,
                                         momentum=0.9, momentum_dtype=torch.bfloat16)),
    # 8-bit moments: blocks on the whole param's index, those the shards share stepped whole
    "remainder_q8": ("AdamW", dict(param_remainders=True, **Q8_MOMENTS)),
    "sr_q8": ("AdamW", dict(master_weights=False, stochastic_rounding=True, **Q8_MOMENTS)),
    "master_q8_ema_block2048": ("AdamW", dict(ema_decay=0.9, block_size=2048, **Q8_MOMENTS)),
    "lion_sr_q8": ("Lion", dict(master_weights=False, stochastic_rounding=True, lr=1e-3,
                                exp_avg_dtype=torch.int8)),
    "sgd_sr_q8_momentum": ("SGD", dict(master_weights=False, stochastic_rounding=True,
                                       momentum=0.9, momentum_dtype=torch.int8)),
    "sr_q8_reblocked": ("AdamW", dict(master_weights=False, stochastic_rounding=True,
                                      **Q8_MOMENTS)),
    "master_bf16_moments": ("AdamW", dict(exp_avg_dtype=torch.bfloat16,
                                          exp_avg_sq_dtype=torch.bfloat16)),
    "fp16_sr_q8": ("AdamW", dict(master_weights=False, stochastic_rounding=True, **Q8_MOMENTS)),
}
SR_DTYPES = {"fp16_sr_q8": torch.float16}  # the params' dtype (else bfloat16)
# name -> (step, group settings set before it): a block size changed between steps (the codes
# are decoded on the old blocks and coded again on the new, a collective under FSDP2)
SR_EDITS = {"sr_q8_reblocked": (3, dict(block_size=512))}


def _q8_case(name):
    return any(v is torch.int8 for v in SR_CASES.get(name, ("", {}))[1].values())


def _sr_mlp(name=None):
    """Dims no world size of 2 or 3 divides: shards are uneven, the 37 x 8 and 19 x 37 weights
    are cut inside a 256-element block, and the last layer's one row leaves empty shards. For
    8-bit cases, weights of at least 4096 elements (8-bit moments) cut by every world size of
    2, 3 and 4 inside a block of 256 (2050 x 8: 8200 at 2 ranks, 5472 at 3, 4104 at 4) and of
    2048 (71 x 67: at 3 and 4 ranks a block of 2048 spans three shards), a 2 x 2050 one that
    leaves empty shards at 3 and 4 ranks, and small ones that keep FP32 moments."""
    torch.manual_seed(0)
    if name is not None and _q8_case(name):
        return nn.Sequential(nn.Linear(8, 2050), nn.Tanh(), nn.Linear(2050, 2), nn.Tanh(),
                             nn.Linear(2, 67), nn.Tanh(), nn.Linear(67, 71), nn.Tanh(),
                             nn.Linear(71, 1)).to(SR_DTYPES.get(name, torch.bfloat16))
    return nn.Sequential(nn.Linear(8, 37), nn.Tanh(), nn.Linear(37, 19), nn.Tanh(),
                         nn.Linear(19, 1)).to(torch.bfloat16)


def _sr_shard(model, mesh, reshard_after_forward=True, reduce_dtype=torch.float32):
    """FSDP2 over each linear layer and the root, reducing in fp32 (by default)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype),
              reshard_after_forward=reshard_after_forward)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kw)
    return fully_shard(model, **kw)


def _sr_opt(name, params):
    rule, kw = SR_CASES[name]
    return getattr(mpext.optim, rule)(params, **dict(SR_LR, seed=7, **kw))


def _sr_train(model, opt, steps=SR_STEPS, name=None):
    edit_at, edit = SR_EDITS.get(name, (None, None))
    for step in steps:
        if step == edit_at:
            for group in opt.param_groups:
                group.update(edit)
        x, y = _batch(step)  # the full batch on every rank
        opt.zero_grad(set_to_none=True)
        dtype = next(model.parameters()).dtype
        ((model(x.to(dtype)).float() - y) ** 2).mean().backward()
        opt.step()


def _sr_cases(runs):
    """(label, case name, mesh[, reshard_after_forward, reduce_dtype]) -> what 6 steps of the
    case under FSDP2 on the mesh end with."""
    out = {}
    for label, name, run_mesh, *shard_args in runs:
        model = _sr_shard(_sr_mlp(name), run_mesh, *shard_args)
        params = list(model.parameters())
        opt = _sr_opt(name, params)
        _sr_train(model, opt, name=name)
        out[label] = {"params": [p.detach().full_tensor() for p in params],
                      "state": _full_state(opt, params),
                      "local_numel": [p.to_local().numel() for p in params],
                      "placements": [str(p.placements) for p in params],
                      "entries": _plan_entries(opt, params)}
    return out


def _plan_entries(opt, params):
    """The kept plan's op entries, as (param index, elements, batch: 0 in place, 1 a copy of
    a block two shards share), or None when no plan is kept."""
    plan = opt._plan
    if plan is None:
        return None
    index = {id(p): i for i, p in enumerate(params)}
    return [(index[id(p)], piece.numel(), c.batch) for c in plan.calls
            for p, piece in zip(c.owners, c.args[0])]


Q8_FP16_CASES = {"fp16_master_q8": Q8_MOMENTS,
                 "fp16_sr_q8": dict(master_weights=False, stochastic_rounding=True,
                                    **Q8_MOMENTS)}
Q8_FP16_POISONED = 2  # the step whose gradient has an inf, in a block two shards share


def _q8_fp16_skips(rank, mesh):
    """FP16 params sharded by FSDP2 with 8-bit moments and mpext.GradScaler: an inf put into
    rank 0's part of a shared block after the reduce-scatter. Returns, per format, the full
    params and state before and after the poisoned step and at the end, and the skips."""
    out = {}
    for name, kw in Q8_FP16_CASES.items():
        model = _sr_shard(_sr_mlp("sr_q8").to(torch.float16), mesh)
        params = list(model.parameters())
        opt = mpext.optim.AdamW(params, lr=1e-2, seed=7, **kw)
        scaler = mpext.GradScaler("cpu", init_scale=2.0 ** 8)
        got = {}
        for step in range(4):
            x, y = _batch(step)
            opt.zero_grad(set_to_none=True)
            scaler.scale(((model(x.to(torch.float16)).float() - y) ** 2).mean()).backward()
            if step == Q8_FP16_POISONED:
                got["before"] = ([p.detach().full_tensor() for p in params],
                                 _full_state(opt, params))
                if rank == 0:  # rank 0's last elements of 2050 x 8 lie in a shared block
                    _local(params[0].grad).view(-1)[-3] = INF
            scaler.step(opt)
            scaler.update()
            if step == Q8_FP16_POISONED:
                got["after"] = ([p.detach().full_tensor() for p in params],
                                _full_state(opt, params))
        got["end"] = [p.detach().full_tensor() for p in params]
        got["skipped"] = scaler.get_skipped_steps()
        out[name] = got
    return out


CLIP_NORM = 0.05  # below every step's gradient norm: every step is clipped


def _clipped_run(mesh=None):
    """remainder + 8-bit AdamW, its gradients clipped to CLIP_NORM by mpext's fused norm
    (mpext.ops.grad_norm: a DTensor list's global norm under FSDP2) and torch's
    clip_grads_with_norm_; on `mesh`, or one process without. The norms and final params."""
    model = _sr_mlp("remainder_q8")
    if mesh is not None:
        _sr_shard(model, mesh)
    params = list(model.parameters())
    opt = _sr_opt("remainder_q8", params)
    norms = []
    for step in SR_STEPS:
        x, y = _batch(step)
        opt.zero_grad(set_to_none=True)
        ((model(x.to(torch.bfloat16)).float() - y) ** 2).mean().backward()
        norm = mpext.ops.grad_norm([p.grad for p in params])
        assert not isinstance(norm, DTensor)
        torch.nn.utils.clip_grads_with_norm_(params, CLIP_NORM, norm)
        norms.append(norm.item())
        opt.step()
    return {"norms": norms, "params": [_full(p.detach()) for p in params]}


def _sr_body(rank, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor import Shard, distribute_tensor

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    # HSDP (a 2-D mesh: Replicate x Shard(0)) with a replicate dimension of 1, in the 2-rank
    # group: the same offsets through the 2-D placements.
    runs = [(name, name, mesh) for name in SR_CASES]
    runs += [("remainder_q8_kept_after_forward", "remainder_q8", mesh, False),
             ("remainder_q8_bf16_reduce", "remainder_q8", mesh, True, None)]
    if world == 2:
        hsdp = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
        runs += [("hsdp_sr_bf16_moments", "sr_bf16_moments", hsdp),
                 ("hsdp_remainder_q8", "remainder_q8", hsdp)]
    out = _sr_cases(runs)
    out["q8_fp16_skips"] = _q8_fp16_skips(rank, mesh)
    out["clipped"] = _clipped_run(mesh)

    # A shard that is not one run of the whole param: refused where bits depend on the
    # position, stepped where they do not.
    full = torch.randn(4, 6).to(torch.bfloat16)
    refused = {}
    for label, kw in (("sr", dict(master_weights=False, stochastic_rounding=True)),
                      ("master", {})):
        p = nn.Parameter(distribute_tensor(full, mesh, [Shard(1)]))
        p.grad = distribute_tensor(torch.ones(4, 6, dtype=torch.bfloat16), mesh, [Shard(1)])
        opt = mpext.optim.AdamW([p], **kw)
        before = p.detach().full_tensor()
        try:
            opt.step()
            refused[label] = None
        except ValueError as e:
            refused[label] = str(e)
            refused[label + "_unchanged"] = torch.equal(p.detach().full_tensor(), before)
    try:  # 8-bit blocks need shards that are runs of the whole param: at construction
        mpext.optim.AdamW([nn.Parameter(distribute_tensor(torch.zeros(64, 70), mesh,
                                                          [Shard(1)]))], **Q8_MOMENTS)
        refused["q8"] = None
    except ValueError as e:
        refused["q8"] = str(e)
    out["refused"] = refused

    if world == 2:  # the control of the 8-bit cases: without the exchange they must differ
        out["no_exchange"] = _without_the_exchange(mesh)
    if world == 2:  # per-device bytes, at 2 ranks in this spawn (4: memory_runs)
        out["memory"] = _memory_body(rank, out_dir)
    if world == 2:  # ZeRO: each rank steps a partition; the global order gives the streams
        for label, use_global in (("zero", True), ("zero_local_streams", False)):
            model = _sr_mlp()
            params = list(model.parameters())
            zero = ZeroRedundancyOptimizer(params, optimizer_class=mpext.optim.AdamW,
                                           **SR_LR, seed=7, **SR_CASES["sr_bf16_moments"][1])
            if use_global:
                assert mpext.optim.use_global_sr_streams(zero) is zero
            _sr_train(model, zero)
            out[label] = {"params": [p.detach().clone() for p in params],
                          "partition": [len(g["params"]) for g in zero.optim.param_groups]}
    return out


def _start_without_all_reduce(self):
    """SharedBlocks.start (which gather and the cached step's exchange both begin with) with
    its all-reduce removed: each rank's copy of a block two shards share holds its own part
    only (zeros for the other rank's codes and values); no work to wait on."""
    for buf, _ in self.buffers:
        buf.zero_()
    for dst, src in self.fill:
        dst.copy_(src)
    for dst, src in self.steps:
        dst.copy_(src)
    return []


def _without_the_exchange(mesh):
    """Every 8-bit case of SR_CASES under FSDP2 with the exchange's all-reduce removed (a
    planted bug: the control that shows the exchange is what makes the shared blocks right)."""
    from mpext.optim import _q8_shards

    start = _q8_shards.SharedBlocks.start
    _q8_shards.SharedBlocks.start = _start_without_all_reduce
    try:
        return _sr_cases([(name, name, mesh) for name in SR_CASES if _q8_case(name)])
    finally:
        _q8_shards.SharedBlocks.start = start


SR_WORLDS = (2, 3)


@pytest.fixture(scope="module")
def sr_runs(spawns):
    """world size -> what each rank of that group returned."""
    return {w: spawns.part(w, "sr") for w in SR_WORLDS}


def _sr_reference(name):
    model = _sr_mlp(name)
    params = list(model.parameters())
    opt = _sr_opt(name, params)
    _sr_train(model, opt, name=name)
    return params, _full_state(opt, params)


@pytest.mark.parametrize("world,label,name",
                         [(w, n, n) for w in SR_WORLDS + (4,) for n in SR_CASES]
                         + [(2, "hsdp_sr_bf16_moments", "sr_bf16_moments"),
                            (2, "hsdp_remainder_q8", "remainder_q8")])
def test_fsdp2_stochastic_rounding_gives_the_bits_of_one_process(sr_runs, request, world,
                                                                 label, name):
    """After 6 steps under FSDP2 (uneven and empty shards, blocks cut by shards; and HSDP's
    2-D placements), every rank holds one process's params and state, bit for bit, at 2, 3 and
    4 ranks; with 8-bit moments the codes and every block's scale too."""
    sr_results = (sr_runs[world] if world in sr_runs
                  else [r["sr"] for r in request.getfixturevalue("four_ranks")])
    assert any(n == 0 for n in sr_results[-1][label]["local_numel"])  # an empty shard
    if label.startswith("hsdp"):
        assert sr_results[0][label]["placements"][0] == "(Replicate(), Shard(dim=0))"
    params, state = _sr_reference(name)
    init = list(_sr_mlp(name).parameters())
    assert any(not torch.equal(a, b) for a, b in zip(params, init))  # training moved them
    if _q8_case(name):  # the large weights keep codes, the small ones FP32 moments
        assert all(any(k.endswith("_q8") for k in st) == (p.numel() >= 4096)
                   for p, st in zip(params, state))
    for rank, r in enumerate(sr_results):
        got = r[label]
        # Stepped through the kept plan, whose only empty entries are empty shards' (they
        # advance the step): a shard inside blocks other shards share has its copies only.
        entries = got["entries"]
        assert entries is not None, "%s, rank %d: no plan kept" % (name, rank)
        assert all(n > 0 or got["local_numel"][i] == 0 for i, n, _ in entries), \
            "%s, rank %d: an op entry for an empty piece: %s" % (name, rank, entries)
        if name == "master_q8_ema_block2048" and world == 3 and rank == 1:
            # not vacuous: this rank's 4757-element 71 x 67 shard, [1608, 3216), lies inside
            # the two blocks of 2048 it shares, so it is stepped by its copies alone
            assert [b for i, _, b in entries if i == 6] == [1, 1], entries
        for i, (a, b) in enumerate(zip(params, got["params"])):
            assert _equal_bits(a.detach(), b), "%s: param %d" % (name, i)
        for i, (sa, sb) in enumerate(zip(state, got["state"])):
            assert sorted(sa) == sorted(sb), name
            for key in sa:
                assert _equal_bits(sa[key], sb[key]), "%s: param %d %s" % (name, i, key)


@pytest.mark.parametrize("name", [n for n in SR_CASES if _q8_case(n)])
def test_fsdp2_8bit_without_the_exchange_differs_from_one_process(sr_runs, name):
    """docs/distributed.md: with the exchange's all-reduce removed, every 8-bit case differs
    from one process (at 2 ranks, on every rank), so the bitwise equality of
    test_fsdp2_stochastic_rounding_gives_the_bits_of_one_process is the exchange's doing."""
    params, state = _sr_reference(name)
    for rank, r in enumerate(sr_runs[2]):
        got = r["no_exchange"][name]
        same = all(_equal_bits(a.detach(), b) for a, b in zip(params, got["params"]))
        same = same and all(sorted(sa) == sorted(sb) and all(_equal_bits(sa[k], sb[k])
                                                             for k in sa)
                            for sa, sb in zip(state, got["state"]))
        assert not same, "%s, rank %d: one process's bits without the exchange" % (name, rank)


@pytest.mark.parametrize("world", SR_WORLDS)
def test_dtensor_placement_without_global_positions_is_refused_for_stochastic_rounding(
        sr_runs, world):
    refused = sr_runs[world][0]["refused"]
    assert "Shard(dim=1)" in refused["sr"] and "param 0 of group 0" in refused["sr"]
    assert refused["sr_unchanged"]
    assert refused["master"] is None  # FP32 masters and moments draw no bits: any placement
    assert "Shard(dim=1)" in refused["q8"] and "8-bit moments of a DTensor param" in \
        refused["q8"] and "params[0] (param group 0)" in refused["q8"]


@pytest.mark.parametrize("world", SR_WORLDS)
def test_fsdp2_8bit_kept_after_forward_gives_the_same_bits(sr_runs, world):
    """reshard_after_forward=False (ZeRO-2's bytes between forward and backward) steps the same
    shards: one process's bits, as with the default."""
    params, state = _sr_reference("remainder_q8")
    for r in sr_runs[world]:
        got = r["remainder_q8_kept_after_forward"]
        assert all(_equal_bits(a.detach(), b) for a, b in zip(params, got["params"]))
        for sa, sb in zip(state, got["state"]):
            assert sorted(sa) == sorted(sb) and all(_equal_bits(sa[k], sb[k]) for k in sa)


def _cuda_body(rank, out_dir):
    """On one GPU, NCCL, world size 1: 8-bit formats under FSDP2 and the same model unsharded,
    6 steps each."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (1,))
    out = {}
    for name in ("remainder_q8", "sr_q8"):
        for label, sharded in ((name, True), (name + "_plain", False)):
            model = _sr_mlp(name).cuda()
            if sharded:
                _sr_shard(model, mesh)
            params = list(model.parameters())
            opt = _sr_opt(name, params)
            for step in SR_STEPS:
                x, y = _batch(step)
                opt.zero_grad(set_to_none=True)
                ((model(x.cuda().to(torch.bfloat16)).float() - y.cuda()) ** 2).mean().backward()
                opt.step()
            out[label] = {"params": [_full(p.detach()).cpu() for p in params],
                          "state": [{k: v.cpu() for k, v in st.items()}
                                    for st in _full_state(opt, params)]}
    return out


@pytest.mark.skipif(not (torch.cuda.is_available() and mpext.build_info()["cuda_built"]
                         and dist.is_nccl_available()),
                    reason="needs a GPU, mpext built with CUDA and NCCL")
def test_fsdp2_8bit_on_cuda_with_nccl_world_size_1(tmp_path):
    """The GPU machine's check of the sharded 8-bit step: FSDP2 on one GPU with NCCL gives the
    params and state (codes, scales) of the same model stepped unsharded on that GPU."""
    got = _spawn(_cuda_body, tmp_path, 1, backend="nccl")[0]
    for name in ("remainder_q8", "sr_q8"):
        a, b = got[name], got[name + "_plain"]
        assert all(_equal_bits(x, y) for x, y in zip(a["params"], b["params"]))
        for sa, sb in zip(a["state"], b["state"]):
            assert sorted(sa) == sorted(sb) and all(_equal_bits(sa[k], sb[k]) for k in sa)
        assert any(k.endswith("_q8") for st in a["state"] for k in st)


def test_fsdp2_reducing_bf16_gradients_in_bf16_rounds_at_3_ranks(sr_runs):
    """Why docs/distributed.md recommends reduce_dtype=torch.float32: without it the
    reduce-scatter sums BF16 gradients in BF16, exact for 2 equal terms but not for 3, so at
    3 ranks the run leaves one process's bits (at 2 it keeps them)."""
    params, _ = _sr_reference("remainder_q8")
    for world, same in ((2, True), (3, False)):
        for r in sr_runs[world]:
            got = r["remainder_q8_bf16_reduce"]["params"]
            assert all(_equal_bits(a.detach(), b) for a, b in zip(params, got)) == same, world


@pytest.mark.parametrize("world", SR_WORLDS)
def test_fsdp2_clipping_by_mpexts_fused_norm_of_dtensor_gradients(sr_runs, world):
    """mpext.ops.grad_norm of FSDP2's DTensor gradients is the global norm on every rank:
    within 2^-22 (relative) of one process's norm of the full gradients at every step, so the
    clipped run stays within a BF16 ulp of one process's; the ranks agree bit for bit."""
    ref = _clipped_run()
    assert all(n > CLIP_NORM for n in ref["norms"])  # every step clipped
    for r in sr_runs[world]:
        got = r["clipped"]
        for a, b in zip(ref["norms"], got["norms"]):
            assert abs(a - b) <= 2.0 ** -22 * a, (a, b)
        for a, b in zip(ref["params"], got["params"]):
            torch.testing.assert_close(b, a.detach(), atol=0, rtol=2.0 ** -7)
        first = sr_runs[world][0]["clipped"]
        assert got["norms"] == first["norms"]
        assert all(_equal_bits(a, b) for a, b in zip(got["params"], first["params"]))


@pytest.mark.parametrize("world", SR_WORLDS)
@pytest.mark.parametrize("name", list(Q8_FP16_CASES))
def test_fsdp2_8bit_poisoned_fp16_step_is_skipped_on_every_rank(sr_runs, world, name):
    """FP16 params under FSDP2 with 8-bit moments and mpext.GradScaler: an inf in one rank's
    part of a block two shards share makes every rank skip that step with every param, code,
    scale, master and step unchanged (the shared blocks' collective runs all the same); the
    other steps train."""
    for r in sr_runs[world]:
        got = r["q8_fp16_skips"][name]
        assert got["skipped"] == 1
        (p0, s0), (p1, s1) = got["before"], got["after"]
        assert all(_equal_bits(a, b) for a, b in zip(p0, p1))
        assert any(k.endswith("_q8_scale") for st in s0 for k in st)
        for a, b in zip(s0, s1):
            assert sorted(a) == sorted(b) and all(_equal_bits(a[k], b[k]) for k in a)
        assert any(not torch.equal(a, b) for a, b in zip(p1, got["end"]))  # trained after
        for a, b in zip(got["end"], sr_runs[world][0]["q8_fp16_skips"][name]["end"]):
            assert _equal_bits(a, b)  # every rank holds the same params


def test_zero_with_global_sr_streams_gives_the_bits_of_one_process(sr_runs):
    """ZeroRedundancyOptimizer(optimizer_class=mpext.optim.AdamW) in master-free SR with BF16
    moments at 2 ranks, after use_global_sr_streams: one process's params; without it the
    partition's own numbering of the streams rounds otherwise (the control that shows the test
    can fail)."""
    sr_results = sr_runs[2]
    params, _ = _sr_reference("sr_bf16_moments")
    for r in sr_results:
        assert 0 < r["zero"]["partition"][0] < len(params)  # each rank steps a part
        for i, (a, b) in enumerate(zip(params, r["zero"]["params"])):
            assert _equal_bits(a.detach(), b), "param %d" % i
    assert any(not _equal_bits(a.detach(), b)
               for a, b in zip(params, sr_results[0]["zero_local_streams"]["params"]))


def test_use_global_sr_streams_takes_only_a_zero_of_an_mpext_optimizer():
    opt = mpext.optim.AdamW([nn.Parameter(torch.zeros(3))])
    with pytest.raises(TypeError, match="use_global_sr_streams: zero must be a "
                                        "ZeroRedundancyOptimizer"):
        mpext.optim.use_global_sr_streams(opt)
    assert not hasattr(opt, "_sr_stream_index")


# --------------------------------------------------------------------------------------------
# Resharding a DCP checkpoint: saved at 2 FSDP2 ranks after 3 steps, loaded by one plain
# process and by 3 FSDP2 ranks (and one process's checkpoint by 2 ranks), 3 more steps: the
# bits of the uninterrupted 6-step run of one process.

RESHARD_CASES = {  # name -> (rule, keywords)
    "fp32_master": ("AdamW", {}),
    "remainder": ("AdamW", dict(param_remainders=True)),
    "remainder_bf16_moments": SR_CASES["remainder_bf16_moments"],
    "sr_bf16_moments": SR_CASES["sr_bf16_moments"],
    "sr_bf16_moments_ema": SR_CASES["sr_bf16_moments_ema"],
    "lion_sr": SR_CASES["lion_sr"],
    "sgd_sr_bf16_momentum": SR_CASES["sgd_sr_bf16_momentum"],
    "remainder_q8": SR_CASES["remainder_q8"],
    "sr_q8": SR_CASES["sr_q8"],
    "master_q8_ema_block2048": SR_CASES["master_q8_ema_block2048"],
}
RESHARD_SAVED, RESHARD_RESUMED = range(3), range(3, 6)


def _reshard_setup(name, mesh=None):
    """The SR tests' model and data; FSDP2 (reduce in fp32) on `mesh`, a plain module without."""
    model = _sr_mlp(name)
    if mesh is not None:
        _sr_shard(model, mesh)
    rule, kw = RESHARD_CASES[name]
    opt = getattr(mpext.optim, rule)(list(model.parameters()), **dict(SR_LR, seed=7, **kw))
    return model, opt


def _reshard_save(model, opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, opt_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=path)


def _reshard_load(model, opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, opt_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": opt_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _reshard_result(model, opt):
    params = list(model.parameters())
    return {"params": [_full(p.detach()) for p in params], "state": _full_state(opt, params)}


def _reshard_resume(name, path, mesh=None):
    """Loads the checkpoint at `path` into a fresh model and optimizer; 3 more steps."""
    model, opt = _reshard_setup(name, mesh)
    try:
        _reshard_load(model, opt, path)
        _sr_train(model, opt, RESHARD_RESUMED)
    except Exception as exc:  # reported by the test of this format, not by the spawn
        return "%s: %s" % (type(exc).__name__, exc)
    return _reshard_result(model, opt)


def _reshard_body(rank, out_dir):
    """At 2 ranks: saves every format after 3 steps, and resumes one process's checkpoints.
    At 3 ranks: resumes the 2-rank checkpoints."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    base = os.path.dirname(os.path.dirname(out_dir))  # <base>/w<world>/reshard
    out = {}
    for name in RESHARD_CASES:
        if world == 2:
            model, opt = _reshard_setup(name, mesh)
            _sr_train(model, opt, RESHARD_SAVED)
            _reshard_save(model, opt, os.path.join(base, "at2", name))
            out[name] = _reshard_resume(name, os.path.join(base, "at1", name), mesh)
        else:
            out[name] = _reshard_resume(name, os.path.join(base, "at2", name), mesh)
    return out


@pytest.fixture(scope="module")
def reshard_runs(spawns):
    """'1to2', '2to3', '2to1' -> format -> what each rank (a list) ended with."""
    at2 = spawns.part(2, "reshard")
    at3 = spawns.part(3, "reshard")
    base = spawns.base
    return {"1to2": {n: [r[n] for r in at2] for n in RESHARD_CASES},
            "2to3": {n: [r[n] for r in at3] for n in RESHARD_CASES},
            "2to1": {n: [_reshard_resume(n, str(base / "at2" / n))] for n in RESHARD_CASES},
            "_base": str(base)}


@pytest.mark.parametrize("name", list(RESHARD_CASES))
@pytest.mark.parametrize("move", ["2to1", "2to3", "1to2"])
def test_dcp_checkpoint_reshards_to_the_bits_of_the_uninterrupted_run(reshard_runs, move, name):
    """3 steps, dcp.save, dcp.load on another world size (a plain module at 1), 3 more steps:
    every rank holds the params and state of one process's uninterrupted 6 steps, bit for bit."""
    model, opt = _reshard_setup(name)
    _sr_train(model, opt, SR_STEPS)
    ref = _reshard_result(model, opt)
    for rank, got in enumerate(reshard_runs[move][name]):
        assert not isinstance(got, str), "rank %d: %s" % (rank, got)
        for i, (a, b) in enumerate(zip(ref["params"], got["params"])):
            assert _equal_bits(a, b), "rank %d: param %d" % (rank, i)
        for i, (sa, sb) in enumerate(zip(ref["state"], got["state"])):
            assert sorted(sa) == sorted(sb), "rank %d: param %d" % (rank, i)
            for key in sa:
                assert _equal_bits(sa[key], sb[key]), "rank %d: param %d %s" % (rank, i, key)


@pytest.mark.parametrize("name", list(RESHARD_CASES))
def test_dcp_reshard_control_without_the_optimizer_state_differs(reshard_runs, name):
    """The control that shows the resharding test can fail: the 2-rank checkpoint's model alone,
    a fresh optimizer, 3 steps: not the uninterrupted run's bits."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model, opt = _reshard_setup(name)
    _sr_train(model, opt, SR_STEPS)
    ref = [p.detach().clone() for p in model.parameters()]
    model2, opt2 = _reshard_setup(name)  # a fresh optimizer
    sd = {"model": get_model_state_dict(model2)}
    dcp.load(sd, checkpoint_id=reshard_runs["_base"] + "/at2/" + name)
    set_model_state_dict(model2, sd["model"])
    _sr_train(model2, opt2, RESHARD_RESUMED)
    assert any(not _equal_bits(a, b.detach()) for a, b in zip(ref, model2.parameters()))


# --------------------------------------------------------------------------------------------
# Per-device bytes: what each rank's params, gradients and optimizer state hold, counted from
# the live tensors (mpext.memory.measure: local shards, each storage once), equal to
# mpext.memory.estimate(..., sharding="torch", rank=r) field by field, under FSDP2 and under
# ZeroRedundancyOptimizer, at 2 ranks (inside the SR spawn) and 4 (a spawn of its own).

MEMORY_WORLDS = (2, 4)
MEMORY_ROWS = ("weights", "gradients", "master_weights", "optimizer_states", "ema")
_BF16_MOMENTS = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
_SR = dict(master_weights=False, stochastic_rounding=True)
MEMORY_CASES = {  # name -> (engine, mpext.memory mode, param dtype, rule, keywords)
    "fsdp2_fp32_master": ("fsdp2", "mpext-bf16", torch.bfloat16, "AdamW", {}),
    "fsdp2_remainder": ("fsdp2", "mpext-bf16-remainder", torch.bfloat16, "AdamW",
                        dict(param_remainders=True)),
    "fsdp2_remainder_bf16_moments": ("fsdp2", "mpext-bf16-remainder-bf16moments",
                                     torch.bfloat16, "AdamW",
                                     dict(param_remainders=True, **_BF16_MOMENTS)),
    "fsdp2_sr_bf16_moments": ("fsdp2", "mpext-bf16-sr", torch.bfloat16, "AdamW",
                              dict(_SR, **_BF16_MOMENTS)),
    "fsdp2_remainder_bf16_moments_ema": ("fsdp2", "mpext-bf16-remainder-bf16moments",
                                         torch.bfloat16, "AdamW",
                                         dict(param_remainders=True, ema_decay=0.9,
                                              **_BF16_MOMENTS)),
    # FP32 sharded params, MixedPrecisionPolicy(param_dtype=bf16): the param is the FP32 value
    "fsdp2_fp32_params_policy": ("fsdp2", "mpext-fp32-param-float32", torch.float32, "AdamW",
                                 {}),
    "fsdp2_fp32_params_policy_bf16_moments": ("fsdp2", "mpext-fp32-param-bfloat16",
                                              torch.float32, "AdamW", dict(_BF16_MOMENTS)),
    "fsdp2_fp16_master": ("fsdp2", "mpext-fp16", torch.float16, "AdamW", {}),
    "fsdp2_lion_sr_bf16_moment": ("fsdp2", "mpext-bf16-stochastic-bfloat16", torch.bfloat16,
                                  "Lion", dict(_SR, exp_avg_dtype=torch.bfloat16)),
    "fsdp2_sgd_sr_bf16_momentum": ("fsdp2", "mpext-bf16-stochastic-bfloat16", torch.bfloat16,
                                   "SGD", dict(_SR, momentum=0.9, momentum_dtype=torch.bfloat16)),
    # 8-bit: the scales of every block the shard touches (67 x 64 cut inside a block)
    "fsdp2_remainder_8bit": ("fsdp2", "mpext-bf16-remainder-8bit", torch.bfloat16, "AdamW",
                             dict(param_remainders=True, **Q8_MOMENTS)),
    "fsdp2_sr_8bit_ema": ("fsdp2", "mpext-bf16-sr-8bit", torch.bfloat16, "AdamW",
                          dict(_SR, ema_decay=0.9, **Q8_MOMENTS)),
    "zero1_fp32_master": ("zero1", "mpext-bf16", torch.bfloat16, "AdamW", {}),
    "zero1_remainder_bf16_moments": ("zero1", "mpext-bf16-remainder-bf16moments",
                                     torch.bfloat16, "AdamW",
                                     dict(param_remainders=True, **_BF16_MOMENTS)),
    "zero1_remainder_8bit": ("zero1", "mpext-bf16-remainder-8bit", torch.bfloat16, "AdamW",
                             dict(param_remainders=True, **Q8_MOMENTS)),
    "zero1_sr_8bit_ema": ("zero1", "mpext-bf16-sr-8bit", torch.bfloat16, "AdamW",
                          dict(_SR, ema_decay=0.9, **Q8_MOMENTS)),
}


def _memory_mlp(dtype):
    """Rows no world size of 2 or 4 divides (67, 5, 1): uneven shards and, at 4 ranks, empty
    ones; the first weight (67 x 64) is large enough for 8-bit moments, the others are not."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 67), nn.Tanh(), nn.Linear(67, 5), nn.Tanh(),
                         nn.Linear(5, 1)).to(dtype)


def _memory_body(rank, out_dir):
    """One step of every case; each rank's measured bytes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 64, generator=g), torch.randn(8, 1, generator=g)
    out = {}
    for name, (engine, _, dtype, rule, kw) in MEMORY_CASES.items():
        model = _memory_mlp(dtype)
        shapes = [tuple(p.shape) for p in model.parameters()]
        if engine == "fsdp2":
            compute = torch.bfloat16 if dtype == torch.float32 else dtype
            policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            opt = getattr(mpext.optim, rule)(model.parameters(), lr=1e-2, **kw)
        else:  # the same full batch on every rank: the gradients need no reduction
            opt = ZeroRedundancyOptimizer(model.parameters(),
                                          optimizer_class=getattr(mpext.optim, rule), lr=1e-2,
                                          **kw)
        opt.zero_grad(set_to_none=True)
        ((model(x.to(dtype)).float() - y) ** 2).mean().backward()
        opt.step()
        out[name] = {"shapes": shapes, "measured": mpext.memory.measure(model.parameters(), opt),
                     "local_numel": [_local(p).numel() for p in model.parameters()]}
    return out


def _four_body(rank, out_dir):
    """At 4 ranks: the per-device bytes and every SR case."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    return {"memory": _memory_body(rank, out_dir),
            "sr": _sr_cases([(n, n, mesh) for n in SR_CASES])}


@pytest.fixture(scope="module")
def four_ranks(spawns):
    return spawns.part(4, "four")


@pytest.fixture(scope="module")
def memory_runs(sr_runs, four_ranks):
    """world size -> each rank's _memory_body: 2 from the SR part, 4 from the 4-rank one."""
    return {2: [r["memory"] for r in sr_runs[2]], 4: [r["memory"] for r in four_ranks]}


def _memory_predicted(name, shapes, world, rank):
    engine, mode, _, rule, kw = MEMORY_CASES[name]
    by_rule = {} if rule == "AdamW" else dict(rule=rule.lower(), momentum=kw.get("momentum", 0.0))
    return mpext.memory.estimate(shapes, "adamw", mode, zero=3 if engine == "fsdp2" else 1,
                                 world_size=world, sharding="torch", rank=rank,
                                 ema="ema_decay" in kw, **by_rule)


@pytest.mark.parametrize("world", MEMORY_WORLDS)
@pytest.mark.parametrize("name", list(MEMORY_CASES))
def test_per_device_bytes_measured_equal_the_estimate(memory_runs, world, name):
    """Every rank's live weights, gradients, masters (or remainders), moments and EMA, in
    bytes, are what mpext.memory predicts for that rank, exactly. Under FSDP2 the weights and
    gradients are the padded chunks (dim 0 rounded up to a multiple of the world size: the
    storage FSDP2 allocates, which the last ranks' shorter or empty shards still hold), the
    optimizer state the rank's own rows."""
    runs = memory_runs[world]
    if name.startswith("fsdp2") and world == 4:
        assert 0 in runs[-1][name]["local_numel"]  # an empty shard on the last rank
    for rank, run in enumerate(runs):
        got = run[name]["measured"]
        want = _memory_predicted(name, run[name]["shapes"], world, rank)
        assert {f: got[f] for f in MEMORY_ROWS} == {f: getattr(want, f) for f in MEMORY_ROWS}, \
            "rank %d" % rank
    engine, mode = MEMORY_CASES[name][:2]
    if engine == "zero1" and mode.endswith("8bit"):  # rank 0 steps the 67 x 64 weight, in 8 bits
        assert runs[0][name]["measured"]["optimizer_states"] < 2 * 4 * 67 * 64
    if engine == "fsdp2" and mode.endswith("8bit"):  # rank 0's 17 or 34 rows of it, in 8 bits
        rows = -(-67 // world)
        assert runs[0][name]["measured"]["optimizer_states"] < 2 * 2 * rows * 64


def memory_table(runs):
    """The table of docs/distributed.md: per case and world size, each rank's measured and
    predicted bytes (weights + gradients + masters + moments + EMA)."""
    lines = ["| engine, rule, format (mpext.memory mode) | ranks | measured per rank (B) | "
             "predicted per rank (B) |", "|---|---:|---:|---:|"]
    for name, (engine, mode, _, rule, kw) in MEMORY_CASES.items():
        for world in MEMORY_WORLDS:
            got = [sum(r[name]["measured"][f] for f in MEMORY_ROWS) for r in runs[world]]
            want = [_memory_predicted(name, r[name]["shapes"], world, i)
                    for i, r in enumerate(runs[world])]
            want = [sum(getattr(b, f) for f in MEMORY_ROWS) for b in want]
            label = "%s, %s, %s%s" % ("FSDP2" if engine == "fsdp2" else "ZeRO-1", rule,
                                      mode, " + EMA" if "ema_decay" in kw else "")
            lines.append("| %s | %d | %s | %s |" % (label, world, " / ".join(map(str, got)),
                                                    " / ".join(map(str, want))))
    return "\n".join(lines) + "\n"


def test_per_device_bytes_table_in_the_docs_is_this_run(memory_runs):
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                        "distributed.md")
    with open(path) as f:
        text = f.read()
    table = memory_table(memory_runs)
    assert table in text, "docs/distributed.md should hold this table:\n" + table
