"""Gradient release on a mesh (docs/gradient_release.md, "On a mesh"): FSDP2 and HSDP on gloo.

One spawn per world size (1, 2, 3, 4 ranks) runs every scenario on a tiny model whose shards
are uneven (and empty on some ranks) and returns what each rank ends with; the tests compare,
in this process:

- released FSDP2 (the step run from FSDP2's post-reduce hook, in buckets) with the same run
  stepping after backward, bit for bit (params and every state tensor, gathered), in a table of
  rules x formats (reduce_dtype=float32), with reshard_after_forward both ways, and HSDP;
- a poisoned FP16 backward (an inf put into rank 0's shard of one gradient after the
  reduce-scatter): every rank skips the same buckets (that one and every later one; nothing at
  all with clip="exact");
- a DCP checkpoint of a released run resumed into fresh objects == the uninterrupted run;
- at 3 and 4 ranks, and HSDP (2 x 2), every row of the rules x formats table under FSDP2 and
  DDP (test_release_table.py's sweep, which it runs at 2 ranks in its own spawn).
"""
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import mpext
import test_release_table
from test_distributed import (SR_CASES, _batch, _equal_bits, _full, _full_state, _local, _spawn,
                              _sr_mlp, _sr_shard)

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not available")

STEPS = range(3)
INF = float("inf")
# (rule, keywords, param dtype): each rule, each param format (FP32 params, FP32 masters,
# 16-bit remainders, master-free SR) and moment format (FP32, BF16, 8-bit with the shared-block
# exchange), and SGD's and Lion's state.
FORMATS = {
    "adamw_fp32": ("AdamW", dict(weight_decay=0.1), torch.float32),
    "adam_l2_fp32": ("Adam", dict(weight_decay=0.1), torch.float32),
    "adamw_master_bf16_moments": SR_CASES["master_bf16_moments"] + (torch.bfloat16,),
    "adamw_remainder_bf16_moments": SR_CASES["remainder_bf16_moments"] + (torch.bfloat16,),
    "adamw_sr_fp32_moments": SR_CASES["sr_fp32_moments"] + (torch.bfloat16,),
    "lion_sr": SR_CASES["lion_sr"] + (torch.bfloat16,),
    "sgd_sr_bf16_momentum": SR_CASES["sgd_sr_bf16_momentum"] + (torch.bfloat16,),
    "adamw_remainder_q8": SR_CASES["remainder_q8"] + (torch.bfloat16,),
}
# bucket bytes per rank (the whole gradient's bytes over the mesh's size): 0 steps param by
# param; SEVERAL // mesh size cuts the tiny model's gradients into buckets of several params
BUCKETS = (0, "several")
SEVERAL = 1200


def _model(name, mesh, reshard_after_forward=True):
    rule, kw, dtype = FORMATS[name]
    model = _sr_mlp("sr_q8" if "q8" in name else None).to(dtype)
    _sr_shard(model, mesh, reshard_after_forward)
    opt = getattr(mpext.optim, rule)(list(model.parameters()), **dict(dict(lr=1e-2, seed=7), **kw))
    return model, opt


def _loss(model, step, rank):
    x, y = _batch(step + 100 * rank)  # each rank its own batch: the reduction is a real mean
    dtype = next(model.parameters()).dtype
    return ((model(x.to(dtype)).float() - y) ** 2).mean()


def _result(model, opt):
    params = list(model.parameters())
    return {"params": [_full(p.detach()) for p in params], "state": _full_state(opt, params)}


MICRO = 4  # micro-batches per step when accumulating
CLIP = 0.05  # below every step's gradient norm: every step is clipped


def _run(name, mesh, rank, released, bucket_bytes=0, reshard_after_forward=True,
         accumulate=None, clip=None):
    """accumulate: None (a backward per step), "no_sync" (FSDP2's
    set_requires_gradient_sync(False) around every micro-batch but the last) or "release"
    (release.accumulate() around them, FSDP2 reducing every one). clip: None, "exact" or
    "previous" (stepping after backward: mpext.ops.grad_norm of the DTensor gradients, the
    global norm, and torch's clip_grads_with_norm_ with this step's or the previous one)."""
    model, opt = _model(name, mesh, reshard_after_forward)
    release = None
    if released:
        kw = {} if clip is None else dict(max_grad_norm=CLIP, clip=clip)
        release = opt.release_grads(bucket_bytes=bucket_bytes, **kw)
    params = list(model.parameters())
    freed, norms, prev = True, [], None
    for step in STEPS:
        micro = MICRO if accumulate else 1
        for m in range(micro):
            last = m == micro - 1
            model.set_requires_gradient_sync(last or accumulate != "no_sync")
            loss = _loss(model, step + 10 * m, rank)
            if released and accumulate == "release" and not last:
                with release.accumulate():
                    loss.backward()
            elif released:
                release.backward(loss)
            else:
                loss.backward()
        if released:
            freed = freed and all(p.grad is None for p in params)
            if clip is not None:
                norms.append(release.last_grad_norm.item())
        else:
            if clip is not None:
                norm = mpext.ops.grad_norm([p.grad for p in params])
                use = norm if clip == "exact" else prev
                if use is not None:
                    torch.nn.utils.clip_grads_with_norm_(params, CLIP, use)
                norms.append(norm.item())
                prev = norm
            opt.step()
            opt.zero_grad(set_to_none=True)
    out = _result(model, opt)
    out["norms"] = norms
    if released:
        out["buckets"] = release.buckets_stepped
        out["freed"] = freed
    return out


def _mesh_cases(rank, mesh):
    """Accumulation (both ways) and clipping (both modes) on the mesh."""
    out = {}
    for acc in ("no_sync", "release"):
        for name in ("adamw_sr_fp32_moments", "adamw_remainder_q8"):
            after = _run(name, mesh, rank, False, accumulate="no_sync" if acc == "no_sync"
                         else "every")
            got = _run(name, mesh, rank, True, SEVERAL // mesh.size(), accumulate=acc)
            out[("accumulate", acc, name)] = {"diff": _same(after, got), "freed": got["freed"],
                                              "buckets": got["buckets"]}
    for clip in ("exact", "previous"):
        after = _run("adamw_fp32", mesh, rank, False, clip=clip)
        got = _run("adamw_fp32", mesh, rank, True, SEVERAL // mesh.size(), clip=clip)
        out[("clip", clip)] = {"after": {k: after[k] for k in ("params", "norms")},
                               "got": {k: got[k] for k in ("params", "norms", "freed")}}
    return out


def _same(a, b):
    """Where two results differ (an empty list: the same bits)."""
    bad = ["param %d" % i for i, (x, y) in enumerate(zip(a["params"], b["params"]))
           if not _equal_bits(x, y)]
    for i, (sa, sb) in enumerate(zip(a["state"], b["state"])):
        if sorted(sa) != sorted(sb):
            bad.append("param %d state keys %s != %s" % (i, sorted(sa), sorted(sb)))
            continue
        bad += ["param %d %s" % (i, k) for k in sa if not _equal_bits(sa[k], sb[k])]
    return bad


# At 1, 3 and 4 ranks (CI time): FP32 params, master-free SR (bits by position) and 8-bit
# moments (the exchange of the blocks shards share), in buckets of several params.
FEW = ("adamw_fp32", "adamw_sr_fp32_moments", "adamw_remainder_q8")


def _format_cases(rank, mesh, every=True):
    out = {}
    for name in FORMATS if every else FEW:
        after = _run(name, mesh, rank, False)
        for bucket in BUCKETS if every else BUCKETS[1:]:
            got = _run(name, mesh, rank, True,
                       bucket if bucket == 0 else SEVERAL // mesh.size())
            out[(name, bucket)] = {"diff": _same(after, got), "buckets": got["buckets"],
                                   "freed": got["freed"],
                                   "moved": _same(after, _result(*_model(name, mesh)))}
        if "q8" in name:  # unsharded params kept between forward and backward
            got = _run(name, mesh, rank, True, SEVERAL // mesh.size(),
                       reshard_after_forward=False)
            out[(name, "kept")] = {"diff": _same(after, got), "buckets": got["buckets"],
                                   "freed": got["freed"]}
    return out


# ---- A poisoned FP16 backward -----------------------------------------------------------------

POISONED = (("master", None), ("sr_q8", None), ("master", "exact"), ("sr_q8", "exact"))
POISONED_STEP = 1
POISONED_PARAM = 0  # the first layer's weight: stepped late (autograd's order) and cut unevenly


def _poisoned(rank, mesh, name, clip=None):
    """FP16 params under mpext.GradScaler, released param by param: at POISONED_STEP an inf is
    put into rank 0's shard of param POISONED_PARAM's gradient after the reduce-scatter (a
    hook that runs before the release's). Returns the hook order, which params' local shards
    (and states) the poisoned step changed on this rank, the skip and the scale."""
    kw = dict(master_weights=False, stochastic_rounding=True, exp_avg_dtype=torch.int8,
              exp_avg_sq_dtype=torch.uint8) if name == "sr_q8" else {}
    model = _sr_mlp("sr_q8" if name == "sr_q8" else None).to(torch.float16)
    _sr_shard(model, mesh)
    params = list(model.parameters())
    opt = mpext.optim.AdamW(params, lr=1e-2, seed=7, **kw)
    scaler = mpext.GradScaler("cpu", init_scale=2.0 ** 8)
    order, state = [], {"step": -1}

    def watch(i):
        def hook(p):
            order.append(i)
            if state["step"] == POISONED_STEP and i == POISONED_PARAM and rank == 0:
                _local(p.grad).view(-1)[0] = INF
        return hook
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(watch(i))
    release = opt.release_grads(bucket_bytes=0, scaler=scaler,
                                **({} if clip is None else dict(max_grad_norm=1.0, clip=clip)))
    out = {}
    for step in STEPS:
        state["step"] = step
        del order[:]
        if step == POISONED_STEP:
            before = [(_local(p).detach().clone(),
                       [_local(v).clone() for v in opt.state[p].values()]) for p in params]
        release.backward(scaler.scale(_loss(model, step, rank)))
        if step == POISONED_STEP:
            out["order"] = list(order)
            out["changed"] = [not torch.equal(_local(p).detach(), b) or not all(
                torch.equal(_local(v), w) for v, w in zip(opt.state[p].values(), s))
                for p, (b, s) in zip(params, before)]
            out["local_numel"] = [_local(p).numel() for p in params]
            out["skipped"] = scaler.last_step_skipped(opt)
        scaler.update()
    out["scale"] = scaler.get_scale()
    return out


def _refusals(mesh):
    """An optimizer with both sharded and plain params, and DTensor params with ddp=: refused
    at release_grads(), nothing registered."""
    model, _ = _model("adamw_fp32", mesh)
    plain = nn.Parameter(torch.zeros(3))
    out = {}
    for key, params in (("mixed", list(model.parameters()) + [plain]),):
        opt = mpext.optim.AdamW(params)
        try:
            opt.release_grads()
            out[key] = None
        except NotImplementedError as e:
            out[key] = str(e)
        out[key + "_left_alone"] = opt._grad_release is None
    return out


# ---- DCP resume -------------------------------------------------------------------------------

RESUME_AT = 2


def _dcp_resume(rank, mesh, out_dir):
    """remainder + 8-bit AdamW, released: 4 steps uninterrupted, and 2 steps, a DCP checkpoint,
    fresh objects loaded from it (then released), 2 more steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    name = "adamw_remainder_q8"
    steps = range(4)
    model, opt = _model(name, mesh)
    opt.release_grads(bucket_bytes=600)
    path = os.path.join(out_dir, "dcp")
    for step in steps:
        if step == RESUME_AT:
            model_sd, opt_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=path,
                     process_group=mesh.get_group())
        _loss(model, step, rank).backward()
    whole = _result(model, opt)
    model, opt = _model(name, mesh)
    model_sd, opt_sd = get_state_dict(model, opt)
    loaded = {"model": model_sd, "optim": opt_sd}
    dcp.load(loaded, checkpoint_id=path, process_group=mesh.get_group())
    set_state_dict(model, opt, model_state_dict=loaded["model"],
                   optim_state_dict=loaded["optim"])
    opt.release_grads(bucket_bytes=600)
    for step in steps[RESUME_AT:]:
        _loss(model, step, rank).backward()
    return {"diff": _same(whole, _result(model, opt))}


def _phase(rank, mesh, world, out_dir):
    """Everything at one world size, on a mesh of the ranks [0, world)."""
    out = {"formats": _format_cases(rank, mesh, world == 2)}
    if world in (2, 3):
        out["mesh"] = _mesh_cases(rank, mesh)
    if world == 4:  # HSDP: replicate x shard, 2 x 2
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        out["hsdp"] = _format_cases(rank, hsdp, False)
    if world == 2:
        out["refused"] = _refusals(mesh)
    out["poisoned"] = {(name, clip): _poisoned(rank, mesh, name, clip)
                       for name, clip in (POISONED if world == 2 else POISONED[1:3])}
    if world == 4:  # the inf on rank 0 only: the flag's MAX must cross both mesh dimensions
        out["poisoned_hsdp"] = {(name, clip): _poisoned(rank, hsdp, name, clip)
                                for name, clip in POISONED[1:3]}
    path = os.path.join(out_dir, "dcp%d" % world)
    out["dcp"] = _dcp_resume(rank, mesh, path)
    if world in (3, 4):  # every row of the table (at 2 ranks: test_release_table.py's spawn)
        t, cpu = time.perf_counter(), time.process_time()
        out["table"] = test_release_table._table_cases(rank, mesh, mesh.get_group())
        if world == 4:
            out["table"]["hsdp"] = test_release_table._table_cases(rank, hsdp, ddp=False)["fsdp2"]
        out["table_seconds"] = (time.perf_counter() - t, time.process_time() - cpu)
    return out


def init_device_mesh(*args, **kwargs):
    from torch.distributed.device_mesh import init_device_mesh as init
    return init(*args, **kwargs)


def _body(rank, out_dir):
    """One spawn of 4 ranks runs the 1-, 2-, 3- and 4-rank meshes one after the other (the
    ranks outside a mesh wait for the next): the processes start once."""
    from torch.distributed.device_mesh import DeviceMesh

    # every rank takes part in making every mesh (their groups are collectives)
    meshes = {w: DeviceMesh("cpu", list(range(w))) for w in WORLDS if w < 4}
    meshes[4] = init_device_mesh("cpu", (4,))
    out = {}
    for world in WORLDS:
        if rank < world:
            t = time.perf_counter()
            out[world] = _phase(rank, meshes[world], world, out_dir)
            out[world]["seconds"] = time.perf_counter() - t
        dist.barrier()
    return out


WORLDS = (1, 2, 3, 4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """world size -> what each rank of that mesh returned."""
    # 4 processes on a shared 2-core machine, every world size and the 3-, 4-rank and HSDP
    # sweeps of the table in one spawn: more than _spawn's default limit when loaded
    ranks = _spawn(_body, tmp_path_factory.mktemp("release"), 4, timeout_s=600)
    return {w: [r[w] for r in ranks[:w]] for w in WORLDS}


@pytest.mark.parametrize("world,mesh", [(w, "fsdp2") for w in WORLDS] + [(4, "hsdp")])
def test_released_fsdp2_has_the_bits_of_stepping_after_backward(runs, world, mesh):
    """Every rule x format, param by param and in buckets: the params and every state tensor
    of the released run equal the run stepping after backward, bit for bit, on every rank;
    every gradient freed; the training moved the params."""
    if mesh == "hsdp" and world != 4:
        pytest.skip("HSDP runs at 4 ranks (2 x 2)")
    for rank, r in enumerate(runs[world]):
        for (name, bucket), got in r["formats" if mesh == "fsdp2" else "hsdp"].items():
            where = "%s, bucket %s, rank %d of %d" % (name, bucket, rank, world)
            assert got["diff"] == [], where
            assert got["freed"], where
            assert got["buckets"] >= (len(STEPS) * 2 if bucket != 0 else 9), where
            if "moved" in got:
                assert len(got["moved"]) >= 4, where  # the params did change


@pytest.mark.parametrize("world,engine", [(3, "fsdp2"), (3, "ddp"), (4, "fsdp2"), (4, "ddp"),
                                          (4, "hsdp")])
def test_released_mesh_has_the_bits_of_stepping_after_backward_in_every_row(runs, world,
                                                                             engine):
    """Every row of the rules x formats table (test_release_table.py, which sweeps it at 2
    ranks) at 3 and 4 ranks, FSDP2 (uneven and empty shards) and DDP, and HSDP on a 2 x 2
    mesh of the 4: the released run's params and state equal, bit for bit, on every rank,
    those of the run stepping after backward."""
    test_release_table.check_table([r["table"] for r in runs[world]], engine)


@pytest.mark.parametrize("world,name,clip", [(2,) + c for c in POISONED]
                         + [(w,) + c for w in (1, 3, 4) for c in POISONED[1:3]])
def test_a_poisoned_fp16_backward_skips_the_same_buckets_on_every_rank(runs, world, name, clip):
    """An inf in rank 0's shard of one gradient: on every rank the buckets before it keep
    their step and that one and every later one change nothing (clip="exact": nothing at all);
    the step is recorded as skipped and the scale backs off, on every rank."""
    _check_poisoned([r["poisoned"][(name, clip)] for r in runs[world]], clip)


@pytest.mark.parametrize("name,clip", POISONED[1:3])
def test_a_poisoned_fp16_backward_skips_the_same_buckets_on_every_rank_of_hsdp(runs, name, clip):
    """The same on HSDP's 2 x 2 mesh: the inf in rank 0's shard reaches the flag of its shard
    peer and of both ranks of the other replica."""
    _check_poisoned([r["poisoned_hsdp"][(name, clip)] for r in runs[4]], clip)


def _check_poisoned(results, clip):
    for rank, got in enumerate(results):
        order = got["order"]
        if clip == "exact":  # both passes ran the hooks
            order = order[len(order) // 2:]
        assert sorted(order) == list(range(len(got["changed"])))
        at = order.index(POISONED_PARAM)
        assert 0 < at < len(order) - 1  # params both before and after it
        for k, i in enumerate(order):
            if got["local_numel"][i] == 0:
                continue
            expect = clip is None and k < at
            assert got["changed"][i] == expect, (rank, i, k, at)
        assert got["skipped"] and got["scale"] == 2.0 ** 7


@pytest.mark.parametrize("world", WORLDS)
def test_dcp_resume_of_a_released_fsdp2_run_has_the_bits_of_the_uninterrupted_one(runs, world):
    for r in runs[world]:
        assert r["dcp"]["diff"] == []


@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.parametrize("how", ("no_sync", "release"))
def test_accumulation_on_the_mesh_has_the_bits_of_accumulate_then_step(runs, world, how):
    """4 micro-batches a step: under set_requires_gradient_sync(False) (FSDP2 reduces the
    sum once, then the release steps), or inside release.accumulate() (FSDP2 reduces each and
    adds the shards): the bits of accumulating and then step(), params and state."""
    for rank, r in enumerate(runs[world]):
        for name in ("adamw_sr_fp32_moments", "adamw_remainder_q8"):
            got = r["mesh"][("accumulate", how, name)]
            assert got["diff"] == [], (name, rank)
            assert got["freed"] and got["buckets"] >= 2 * len(STEPS), (name, rank)


@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.parametrize("clip", ("exact", "previous"))
def test_clipping_on_the_mesh_uses_the_global_norm(runs, world, clip):
    """The released norm is the global one over the mesh (each rank's squared sums reduced
    once): it equals mpext.ops.grad_norm of the DTensor gradients to float32's rounding of a
    sum in another order, on every rank, and so do the params after 3 clipped steps (every
    step clipped; a norm of one shard only would be several times off)."""
    for r in runs[world]:
        after, got = r["mesh"][("clip", clip)]["after"], r["mesh"][("clip", clip)]["got"]
        assert all(n > CLIP for n in after["norms"])
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(after["norms"]),
                                   rtol=1e-5, atol=0)
        for a, b in zip(after["params"], got["params"]):
            # the clip coefficient's few ulps on steps of lr 1e-2: under 1e-6 of a param
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
        assert got["freed"]


def test_a_mesh_release_of_sharded_and_plain_params_is_refused_by_name(runs):
    for r in runs[2]:
        assert r["refused"]["mixed"].startswith(
            "mpext.optim.AdamW.release_grads: the optimizer holds both DTensor (FSDP2) and "
            "plain params")
        assert "fully_shard" in r["refused"]["mixed"]
        assert r["refused"]["mixed_left_alone"]
