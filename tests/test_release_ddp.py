"""Gradient release under DDP (docs/gradient_release.md, "On a mesh"): the step runs in DDP's
comm hook, after each bucket's all-reduce, on the averaged gradient.

One spawn of 3 gloo ranks runs every scenario on 2 ranks (a group of ranks 0 and 1) and on 3
(whose average multiplies by a reciprocal that is not a power of two); the tests compare, in
this process, each rank's released run with the same DDP run stepping after backward in the
same process: bit for bit in a table of rules x formats and with micro-batch accumulation
(no_sync() windows, and release.accumulate() without them); within float32's rounding of the
norm with both clip modes against torch's clip_grad_norm_; a poisoned FP16 batch skipped on
every rank.
"""
import contextlib
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import mpext
from test_distributed import _batch, _equal_bits, _spawn
from test_release_mesh import FORMATS

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not available")

STEPS = range(3)
MICRO = 4  # micro-batches per step when accumulating
BUCKET_CAP_MB = 0.0015  # a few of DDP's buckets for the tiny model


def _model(name):
    torch.manual_seed(0)
    big = "q8" in name  # weights of 4096+ elements: 8-bit moments
    model = nn.Sequential(nn.Linear(8, 520 if big else 37), nn.Tanh(),
                          nn.Linear(520 if big else 37, 19), nn.Tanh(), nn.Linear(19, 1))
    return model.to(FORMATS[name][2])


def _opt(name, params):
    rule, kw, _ = FORMATS[name]
    return getattr(mpext.optim, rule)(params, **dict(dict(lr=1e-2, seed=7), **kw))


def _loss(model, step, rank, micro=0, poison=False):
    x, y = _batch(1000 * micro + step + 100 * rank)
    if poison:
        x[0, 0] = float("inf")
    dtype = next(model.parameters()).dtype
    return ((model(x.to(dtype)).float() - y) ** 2).mean()


def _result(model, opt):
    params = list(model.parameters())
    return {"params": [p.detach().clone() for p in params],
            "state": [{k: v.clone() for k, v in opt.state[p].items()} for p in params]}


def _same(a, b):
    bad = ["param %d" % i for i, (x, y) in enumerate(zip(a["params"], b["params"]))
           if not _equal_bits(x, y)]
    for i, (sa, sb) in enumerate(zip(a["state"], b["state"])):
        if sorted(sa) != sorted(sb):
            bad.append("param %d state keys" % i)
            continue
        bad += ["param %d %s" % (i, k) for k in sa if not _equal_bits(sa[k], sb[k])]
    return bad


def _ddp(model, group, as_view=False):
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(model, process_group=group, bucket_cap_mb=BUCKET_CAP_MB,
               gradient_as_bucket_view=as_view)


def _run(name, group, rank, released, accumulate=None, as_view=False, clip=None,
         scaler=False, poison_step=None):
    """accumulate: None (a backward per step), "no_sync" (DDP's no_sync() around every
    micro-batch but the last) or "release" (release.accumulate() around them, DDP reducing
    every one). clip: None, "exact" or "previous" (max_grad_norm 0.05: every step clipped;
    stepping after backward, torch's clip_grad_norm_ with the exact or previous norm)."""
    model = _model(name)
    ddp = _ddp(model, group, as_view)
    params = list(model.parameters())
    opt = _opt(name, params)
    sc = mpext.GradScaler("cpu", init_scale=2.0 ** 8) if scaler else None
    release = None
    if released:
        kw = {} if clip is None else dict(max_grad_norm=0.05, clip=clip)
        release = opt.release_grads(ddp=ddp, bucket_bytes=0, scaler=sc, **kw)
    prev = None
    freed, norms = True, []
    for step in STEPS:
        micro = MICRO if accumulate else 1
        for m in range(micro):
            last = m == micro - 1
            if accumulate == "no_sync" and not last:
                ctx = ddp.no_sync()  # the forward too: DDP decides at the forward
            elif accumulate == "release" and not last and released:
                ctx = release.accumulate()
            else:
                ctx = contextlib.nullcontext()
            with ctx:
                loss = _loss(ddp, step, rank, m, poison=step == poison_step and rank == 0)
                if sc is not None:
                    loss = sc.scale(loss)
                if released and isinstance(ctx, contextlib.nullcontext):
                    release.backward(loss)
                else:
                    loss.backward()
        if released:
            freed = freed and all(p.grad is None for p in params)
            if clip is not None:
                norms.append(release.last_grad_norm.item())
        else:
            if clip is not None:
                if sc is not None:
                    sc.unscale_(opt)
                norm = torch.nn.utils.get_total_norm([p.grad for p in params])
                use = norm if clip == "exact" else prev
                if use is not None:
                    torch.nn.utils.clip_grads_with_norm_(params, 0.05, use)
                norms.append(norm.item())
                prev = norm
            if sc is not None:
                sc.step(opt)
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
        if sc is not None:
            sc.update()
    out = _result(model, opt)
    out["freed"], out["norms"] = freed, norms
    if sc is not None:
        out["skipped"], out["scale"] = sc.get_skipped_steps(), sc.get_scale()
    if released:
        out["buckets"] = release.buckets_stepped
    return out


def _phase(rank, group):
    out = {}
    for name in FORMATS:
        after = _run(name, group, rank, False)
        got = _run(name, group, rank, True)
        out[("format", name)] = {"diff": _same(after, got), "freed": got["freed"],
                                 "buckets": got["buckets"]}
    name = "adamw_remainder_bf16_moments"
    after = _run(name, group, rank, False, as_view=True)
    got = _run(name, group, rank, True, as_view=True)
    out[("format", "bucket_view")] = {"diff": _same(after, got), "freed": got["freed"],
                                      "buckets": got["buckets"]}
    for acc in ("no_sync", "release"):
        # release.accumulate() without no_sync(): DDP averages every micro-batch, as the
        # reference does when it accumulates without no_sync()
        after = _run(name, group, rank, False, accumulate="no_sync" if acc == "no_sync"
                     else "all_reduced")
        got = _run(name, group, rank, True, accumulate=acc)
        out[("accumulate", acc)] = {"diff": _same(after, got), "freed": got["freed"],
                                    "buckets": got["buckets"]}
    for clip in ("exact", "previous"):
        after = _run("adamw_fp32", group, rank, False, clip=clip)
        got = _run("adamw_fp32", group, rank, True, clip=clip)
        out[("clip", clip)] = {"after": after, "got": got}
    for clip in (None, "exact"):
        out[("poisoned", clip)] = {
            "after": _run("adamw_fp32", group, rank, False, scaler=True, poison_step=1,
                          clip=clip),
            "got": _run("adamw_fp32", group, rank, True, scaler=True, poison_step=1, clip=clip)}
    return out


def _refusals(group):
    """What a DDP release refuses, before anything changes: a param the DDP module does not
    hold, a DDP module that already has a comm hook, plain params without ddp=."""
    out = {}
    model = _model("adamw_fp32")
    ddp = _ddp(model, group)
    stray = nn.Parameter(torch.zeros(3))
    opt = _opt("adamw_fp32", list(model.parameters()) + [stray])
    for key, call in (("stray", lambda: opt.release_grads(ddp=ddp)),
                      ("no_ddp", lambda: _opt("adamw_fp32", list(model.parameters()))
                       .release_grads())):
        try:
            call()
            out[key] = None
        except (ValueError, NotImplementedError) as e:
            out[key] = "%s: %s" % (type(e).__name__, e)
    ddp.register_comm_hook(None, lambda state, bucket: None)
    opt = _opt("adamw_fp32", list(model.parameters()))
    try:
        opt.release_grads(ddp=ddp)
        out["hooked"] = None
    except RuntimeError as e:
        out["hooked"] = str(e)
    out["left_alone"] = opt._grad_release is None and all(p.grad is None
                                                           for p in model.parameters())
    # remove(): DDP keeps the comm hook, which then only averages; step() works again
    model = _model("adamw_fp32")
    ddp = _ddp(model, group)
    opt = _opt("adamw_fp32", list(model.parameters()))
    opt.release_grads(ddp=ddp, bucket_bytes=0).remove()
    ref = _model("adamw_fp32")
    ref_ddp = _ddp(ref, group)
    for m in (ddp, ref_ddp):
        _loss(m, 0, dist.get_rank()).backward()
    out["removed_grads"] = all(p.grad is not None and torch.equal(p.grad, q.grad)
                               for p, q in zip(model.parameters(), ref.parameters()))
    opt.step()
    out["removed_steps"] = opt.state[next(iter(model.parameters()))]["step"].item() == 1
    return out


def _body(rank, out_dir):
    pair = dist.new_group([0, 1])  # every rank takes part in making it
    out = {}
    for world, group in ((2, pair), (3, None)):
        if rank < world:
            t = time.perf_counter()
            out[world] = _phase(rank, group)
            if world == 2:
                out[world]["refusals"] = _refusals(group)
            out[world]["seconds"] = time.perf_counter() - t
        dist.barrier()
    return out


WORLDS = (2, 3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ranks = _spawn(_body, tmp_path_factory.mktemp("release_ddp"), 3)
    return {w: [r[w] for r in ranks[:w]] for w in WORLDS}


@pytest.mark.parametrize("world", WORLDS)
def test_released_ddp_has_the_bits_of_ddp_and_step_after_backward(runs, world):
    """Every rule x format (and DDP's gradient_as_bucket_view): params and state equal, bit
    for bit, on every rank; the gradients freed; a launch per DDP bucket param."""
    for rank, r in enumerate(runs[world]):
        for key, got in r.items():
            if key in ("seconds", "refusals") or key[0] != "format":
                continue
            assert got["diff"] == [], (key, rank)
            assert got["freed"], (key, rank)
            assert got["buckets"] == 6 * len(STEPS), (key, rank)  # bucket_bytes=0: 6 params, one by one


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("how", ("no_sync", "release"))
def test_accumulation_over_micro_batches_has_the_bits_of_accumulate_then_step(runs, world, how):
    for rank, r in enumerate(runs[world]):
        got = r[("accumulate", how)]
        assert got["diff"] == [], rank
        assert got["freed"] and got["buckets"] == 6 * len(STEPS)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("clip", ("exact", "previous"))
def test_clipping_under_ddp_follows_clip_grad_norm(runs, world, clip):
    """The global norm of the averaged gradients (the same on every rank, no reduction)
    equals torch's get_total_norm to float32's rounding of a sum in another order, and so do
    the params after 3 clipped steps (exact: this step's norm; previous: the last step's)."""
    for r in runs[world]:
        after, got = r[("clip", clip)]["after"], r[("clip", clip)]["got"]
        assert all(n > 0.05 for n in after["norms"])  # every step clipped
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(after["norms"]),
                                   rtol=1e-5, atol=0)
        for a, b in zip(after["params"], got["params"]):
            # a few ulps of the 1e-2 steps' coefficient: 1e-6 of a param near 1
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
        assert got["freed"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("clip", (None, "exact"))
def test_a_poisoned_fp16_batch_is_skipped_on_every_rank(runs, world, clip):
    """An inf in rank 0's batch reaches every rank through the all-reduce: the released step
    is recorded as skipped on every rank, which all hold the same params and state after it
    (the scaler backs off once; with exact clipping nothing changes at that step, as with
    scaler.step after backward)."""
    results = [r[("poisoned", clip)] for r in runs[world]]
    for got in results:
        assert got["got"]["skipped"] == got["after"]["skipped"] == 1
        assert got["got"]["scale"] == got["after"]["scale"] == 2.0 ** 7
        if clip == "exact":  # the whole step skipped, as scaler.step after backward skips it
            for a, b in zip(got["after"]["params"], got["got"]["params"]):
                torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
        # (clip=None: only the first layer's weight gradient is NaN, the tanh saturating, so
        # the buckets before it keep their step, as documented: not the reference's bits)
    ref = results[0]["got"]
    for got in results[1:]:  # every rank holds the same params and state
        assert _same(ref, got["got"]) == []


def test_what_a_ddp_release_cannot_do_is_refused_by_name(runs):
    for r in runs[2]:
        got = r["refusals"]
        assert got["stray"].startswith("ValueError: mpext.optim.AdamW.release_grads: param 6 "
                                       "of group 0 is not a param of the DDP module (ddp=)")
        assert got["no_ddp"].startswith("NotImplementedError: mpext.optim.AdamW.release_grads: "
                                        "gradient release of plain (not sharded) params")
        assert "release_grads(ddp=ddp_model)" in got["no_ddp"]
        assert got["hooked"].startswith("mpext.optim.AdamW.release_grads: DDP did not take the "
                                        "release's comm hook")
        assert got["left_alone"]
        assert got["removed_grads"] and got["removed_steps"]


def test_ddp_must_be_a_ddp_module():
    model = _model("adamw_fp32")
    with pytest.raises(TypeError, match=r"release_grads: ddp must be the torch.nn.parallel."
                                        r"DistributedDataParallel module.*got Sequential"):
        _opt("adamw_fp32", list(model.parameters())).release_grads(ddp=model)
