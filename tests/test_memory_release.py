"""The memory calculator against live tensors for gradient release on the mesh: at 2 gloo ranks,
per rank, FSDP2 and DDP, released and stepping after backward, a few formats, the persistent
bytes (params, optimizer state, the ``.grad`` alive after backward, DDP's buckets) and the
``.grad`` peak during backward that ``mpext.memory.estimate`` predicts are the bytes measured
(``mpext.memory.meter.measure_release``: distinct storages of the live tensors,
a hook that runs before the release's; DDP's buckets read from its Reducer), to the byte.

One spawn of 2 ranks (tests/release_world2.py, shared with test_release_table.py and
test_release_trainers_ddp.py) measures every case; the tests compare in this process."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import mpext
from mpext.memory import estimate
from mpext.memory.meter import measure_release, peak_bytes
from test_distributed import _batch, _sr_mlp, _sr_shard

pytest_plugins = ("release_world2",)  # the 2-rank spawn, one for the release files
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not available")

WORLD = 2
# name -> (param dtype, AdamW keywords, the calculator's mode: the same format)
FORMATS = {
    "fp32": (torch.float32, {}, "mpext-fp32-param-float32"),
    "master_bf16_moments": (torch.bfloat16, dict(exp_avg_dtype=torch.bfloat16,
                                                 exp_avg_sq_dtype=torch.bfloat16),
                            "mpext-bf16-master-bfloat16"),
    "sr_fp32_moments": (torch.bfloat16, dict(master_weights=False, stochastic_rounding=True),
                        "mpext-bf16-stochastic-float32"),
    "remainder_q8": (torch.bfloat16, dict(param_remainders=True, exp_avg_dtype=torch.int8,
                                          exp_avg_sq_dtype=torch.uint8),
                     "mpext-bf16-remainder-q8"),
}
# bytes per rank: param by param, and a few params a bucket; for the BF16 MLP, 722 is reached
# at the 19 x 37 weight by the whole gradients' bytes over the mesh size (as the release cuts
# buckets, the same on every rank) but not by rank 1's own shards' bytes (666)
FSDP2_BUCKETS = (0, 722)
DDP_CAP_MB = 0.001  # DDP's bucket_cap_mb: several of its buckets for the tiny models


def _model(name):
    """The mesh tests' MLPs (tests/test_distributed.py): uneven shards, empty ones, 8-bit
    blocks cut by shards for the 8-bit format."""
    return _sr_mlp("sr_q8" if "q8" in name else None).to(FORMATS[name][0])


def _loss_fn(model, rank):
    dtype = next(model.parameters()).dtype

    def loss(step):
        x, y = _batch(step + 100 * rank)
        return ((model(x.to(dtype)).float() - y) ** 2).mean()
    return loss


def _memory_cases(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP
    mesh = init_device_mesh("cpu", (WORLD,))
    out = {}
    for name, (_, kw, _) in FORMATS.items():
        for released in (False, True):
            for bucket in FSDP2_BUCKETS if released else (0,):
                model = _sr_shard(_model(name), mesh)
                params = list(model.parameters())
                opt = mpext.optim.AdamW(params, lr=1e-2, seed=7, **kw)
                out[("fsdp2", name, released, bucket)] = measure_release(
                    params, opt, _loss_fn(model, rank), released, bucket)
            model = _model(name)
            ddp = DDP(model, bucket_cap_mb=DDP_CAP_MB)
            params = list(model.parameters())
            opt = mpext.optim.AdamW(params, lr=1e-2, seed=7, **kw)
            out[("ddp", name, released)] = measure_release(
                params, opt, _loss_fn(ddp, rank), released, 0, ddp=ddp)
    out["ddp_allocator"] = _ddp_allocator_peaks(rank)
    return out


DDP_WEIGHTS, DDP_WIDTH = 4, 256  # 256 KiB FP32 weights, each one of DDP's buckets


def _ddp_allocator_peaks(rank):
    """The allocator's peak (torch's CPU profiler: mpext.memory.meter.peak_bytes) of a
    DDP forward + backward over DDP_WEIGHTS bias-free square FP32 layers, each its own DDP
    bucket, batch 2: stepped after backward (zero_grad(set_to_none=True): every local gradient
    alive at its end) and released (one bucket's at a time), with DDP's
    gradient_as_bucket_view False (its default) and True (each local gradient copied into its
    bucket and .grad made the bucket's view as it completes). The weights' gradient bytes come
    with it, and what .grad holds after the last backward."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    x = torch.randn(2, DDP_WIDTH, generator=torch.Generator().manual_seed(rank))
    fns, grads = {}, {}
    for as_view in (False, True):
        for released in (False, True):
            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Linear(DDP_WIDTH, DDP_WIDTH, bias=False)
                                    for _ in range(DDP_WEIGHTS)])
            ddp = DDP(model, bucket_cap_mb=DDP_WIDTH * DDP_WIDTH * 4 / 2 ** 20,
                      gradient_as_bucket_view=as_view)
            opt = mpext.optim.AdamW(model.parameters(), lr=1e-3)
            if released:
                opt.release_grads(ddp=ddp, bucket_bytes=0)

            def step(ddp=ddp, opt=opt, released=released):
                ddp(x).square().mean().backward()
                if not released:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            for _ in range(3):  # DDP's buckets rebuilt, the state made
                step()
            fns[(released, as_view)] = step
            ddp(x).square().mean().backward()  # what the backward leaves in .grad
            grads[(released, as_view)] = sum(p.grad is not None for p in model.parameters())
            if not released:
                opt.zero_grad(set_to_none=True)
    peaks = peak_bytes(fns, "cpu")
    return {"peaks": {k: peaks[(k, False)] for k in (False, True)},
            "as_view": {k: peaks[(k, True)] for k in (False, True)}, "grads": grads,
            "weight_bytes": DDP_WIDTH * DDP_WIDTH * 4}


@pytest.fixture(scope="module")
def runs(release_world2):
    return [r["memory"] for r in release_world2]


def _shapes(name):
    return [tuple(p.shape) for p in _model(name).parameters()]


def _units(name):
    """FSDP2's units as _sr_shard makes them: one per Linear (weight, bias), the last reduced
    first (the root holds no param)."""
    n = len(_shapes(name))
    return [[i, i + 1] for i in reversed(range(0, n, 2))]


@pytest.mark.parametrize("name", FORMATS)
def test_fsdp2_release_memory_is_the_calculators_per_rank(runs, name):
    """Per rank, released (param by param and in buckets) and not: the persistent bytes
    (padded param chunks, the shard's state, the sharded .grad after backward) and the .grad
    peak during backward (the units' reduce-scatter outputs alive) equal the estimate's."""
    mode = FORMATS[name][2]
    for rank, r in enumerate(runs):
        for released in (False, True):
            for bucket in FSDP2_BUCKETS if released else (0,):
                got = r[("fsdp2", name, released, bucket)]
                b = estimate(_shapes(name), mode=mode, rule="adamw", zero=3, sharding="torch",
                             world_size=WORLD, rank=rank, grad_release=released,
                             bucket_bytes=bucket, units=_units(name))
                where = (name, rank, released, bucket)
                assert got["params"] == b.weights, where
                assert got["state"] == b.master_weights + b.optimizer_states, where
                assert got["grads"] == b.gradients, where
                assert got["params"] + got["state"] + got["grads"] == b.persistent, where
                assert got["grad_peak"] == b.grad_peak, where
                if released:
                    assert got["grads"] == 0 and 0 < got["grad_peak"]
        whole = r[("fsdp2", name, False, 0)]["grad_peak"]
        # the buckets of a few params hold more than one at a time, and less than all
        assert r[("fsdp2", name, True, 0)]["grad_peak"] < r[("fsdp2", name, True, 722)][
            "grad_peak"] < whole, (name, rank)


@pytest.mark.parametrize("name", FORMATS)
def test_ddp_release_memory_is_the_calculators(runs, name):
    """Every rank alike: the persistent bytes (params, state, .grad after backward unless
    released, DDP's bucket buffers) and the .grad peak during backward (released: the largest
    of DDP's rebuilt buckets of local gradients) equal the estimate's."""
    mode = FORMATS[name][2]
    for rank, r in enumerate(runs):
        for released in (False, True):
            got = r[("ddp", name, released)]
            b = estimate(_shapes(name), mode=mode,
                         rule="adamw", ddp=True, world_size=WORLD, grad_release=released,
                         ddp_bucket_cap_mb=DDP_CAP_MB)
            where = (name, rank, released)
            assert got["params"] == b.weights, where
            assert got["state"] == b.master_weights + b.optimizer_states, where
            assert got["grads"] == b.gradients, where
            assert got["ddp_buckets"] == b.comm_buffers, where
            assert got["params"] + got["state"] + got["grads"] + got["ddp_buckets"] == \
                b.persistent, where
            assert got["grad_peak"] == b.grad_peak, where
        assert r[("ddp", name, True)]["grad_peak"] < r[("ddp", name, False)]["grad_peak"]


# ---- The command line and bad arguments ------------------------------------------------------

def test_cli_predicts_released_fsdp2_and_ddp_per_device(capsys):
    """--zero fsdp2,ddp with --grad-release on 4 ranks: the columns are estimate's (each
    tensor its own FSDP2 unit; DDP's default buckets), released: no gradient persists, DDP's
    buckets do."""
    import json
    from mpext.memory import main
    assert main(["--model", "gpt2", "--rule", "adamw", "--mode", "mpext-bf16-sr-8bit",
                 "--zero", "fsdp2,ddp", "--world-size", "4", "--grad-release", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    from mpext.memory import model_spec
    shapes = list(model_spec("gpt2").shapes)
    fsdp2, ddp = data["results"]
    want = estimate(shapes, mode="mpext-bf16-sr-8bit", rule="adamw", zero=3, sharding="torch",
                    world_size=4, grad_release=True)
    assert fsdp2["persistent"] == want.persistent and fsdp2["grad_peak"] == want.grad_peak
    assert fsdp2["gradients"] == 0 and fsdp2["comm_buffers"] == 0
    want = estimate(shapes, mode="mpext-bf16-sr-8bit", rule="adamw", ddp=True, world_size=4,
                    grad_release=True)
    assert ddp["persistent"] == want.persistent and ddp["grad_peak"] == want.grad_peak
    n = sum(torch.Size(s).numel() for s in shapes)
    assert ddp["gradients"] == 0 and ddp["comm_buffers"] == 2 * n
    assert main(["--model", "gpt2", "--rule", "adamw", "--zero", "ddp", "--world-size", "2",
                 "--ddp-bucket-cap-mb", "5", "--grad-release", "--mode", "mpext-bf16"]) == 0
    out = capsys.readouterr().out
    assert "mpext-bf16 DDP/2" in out and "DDP's gradient buckets" in out


@pytest.mark.parametrize("argv,message", [
    (["--zero", "1", "--world-size", "2", "--grad-release"],
     "argument --grad-release: not supported with more than one process (--world-size 2) but "
     "under --zero fsdp2 or ddp"),
    (["--zero", "fsdp2", "--world-size", "2", "--ddp-bucket-cap-mb", "5"],
     "argument --ddp-bucket-cap-mb: a number > 0, with --zero ddp only"),
    (["--zero", "ddp", "--world-size", "2", "--ddp-bucket-cap-mb", "0"],
     "argument --ddp-bucket-cap-mb: a number > 0"),
])
def test_cli_release_mesh_errors(capsys, argv, message):
    from mpext.memory import main
    with pytest.raises(SystemExit) as e:
        main(["--params", "1e6", "--rule", "adamw"] + argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


SHAPES = [(37, 8), (37,), (1, 37), (1,)]


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(zero=1, world_size=2, sharding="torch", grad_release=True), ValueError,
     "grad_release: not supported with more than one process but under PyTorch's DDP"),
    (dict(ddp=True, zero=1), ValueError, "ddp: DistributedDataParallel replicates the model "
                                         "(zero=0), got zero=1"),
    (dict(ddp=1), TypeError, "ddp: must be True or False"),
    (dict(units=[[0, 1], [2, 3]]), ValueError, "units: only with sharding='torch', zero=3"),
    (dict(grad_order=[3, 2, 1, 0]), ValueError, "grad_order: only with ddp=True"),
    (dict(ddp_bucket_cap_mb=1.0), ValueError, "ddp_bucket_cap_mb: only with ddp=True"),
    (dict(ddp=True, ddp_bucket_cap_mb=0), ValueError, "ddp_bucket_cap_mb: must be a number > 0"),
    (dict(zero=3, sharding="torch", world_size=2, units=[[0, 1], [2]]), ValueError,
     "units: must name every one of the 4 params once (indices 0..3)"),
    (dict(ddp=True, world_size=2, grad_order=[3, 2, 1, 1]), ValueError,
     "grad_order: must name every one of the 4 params once"),
])
def test_release_mesh_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match.replace("(", r"\(").replace(")", r"\)")
                       .replace(".", r"\.")):
        estimate(SHAPES, **dict(dict(mode="mpext-bf16", rule="adamw"), **kwargs))
    with pytest.raises(ValueError, match="units: needs the tensors' sizes"):
        estimate(1000, mode="mpext-bf16", rule="adamw", zero=3, sharding="torch",
                 units=[[0]])


def test_release_peaks_by_hand():
    """The two peaks worked by hand on a 2-rank BF16 chain of (37, 8), (37,), (1, 37), (1,):
    FSDP2, each Linear a unit: rank 1 holds rows 19..36 and no row of the (1, 37) weight, but
    allocates the padded chunks (19 x 8 + 19, 1 x 37 + 1 rows); DDP, buckets in the reversed
    order closing at 100 bytes."""
    units = [[2, 3], [0, 1]]
    kw = dict(mode="mpext-bf16", rule="adamw", zero=3, sharding="torch", world_size=2, rank=1,
              grad_release=True, units=units)
    big, small = 2 * (19 * 8 + 19), 2 * (37 + 1)  # the units' reduce-scatter outputs, bytes
    # bucket 0: every param alone; the first unit's storage is freed before the second's
    assert estimate(SHAPES, bucket_bytes=0, **kw).grad_peak == big
    # one bucket for everything: both units alive at the last gradient
    assert estimate(SHAPES, bucket_bytes=10 ** 6, **kw).grad_peak == big + small
    # the small unit's gradients count 74 // 2 + 2 // 2 = 38 bytes (whole over 2): a bucket
    # of 38 frees them before the big unit's come, one of 39 does not
    assert estimate(SHAPES, bucket_bytes=38, **kw).grad_peak == big
    assert estimate(SHAPES, bucket_bytes=39, **kw).grad_peak == big + small
    # DDP: reversed order 1, 37, 37, 296 elements (2 B): 2 + 74 + 74 = 150 >= 100 closes
    # the first bucket, (37, 8) alone the second
    cap = 100 / 2 ** 20
    b = estimate(SHAPES, mode="mpext-bf16", rule="adamw", ddp=True, world_size=2,
                 grad_release=True, ddp_bucket_cap_mb=cap)
    assert b.grad_peak == 2 * 37 * 8 and b.comm_buffers == 2 * (296 + 37 + 37 + 1)
    b = estimate(SHAPES, mode="mpext-bf16", rule="adamw", ddp=True, world_size=2,
                 grad_release=True, ddp_bucket_cap_mb=cap, grad_order=[1, 3, 0, 2])
    assert b.grad_peak == 2 * (37 + 1 + 296)  # 74 + 2 < 100, then + 592 closes it


def test_released_ddp_holds_one_bucket_of_gradients_by_the_allocator(runs):
    """Torch's allocator (its CPU profiler's records, not the live-tensor meter above): a
    released DDP backward needs about one bucket of gradients where stepping after backward
    needs all four: DDP's end-of-backward copy of its buckets into .grad makes no new
    gradients (the release points a stepped .grad back at its bucket's view until then)."""
    for r in runs:
        got = r["ddp_allocator"]
        after, released = got["peaks"][False], got["peaks"][True]
        if after is None:
            pytest.skip("this torch's profiler gives no allocation records")
        w = got["weight_bytes"]
        assert after >= DDP_WEIGHTS * w  # every local gradient at the end of backward
        # one weight's local gradient, and less than one more of everything else
        assert released < 2 * w < after - 2 * w, (after, released, w)


def test_released_ddp_with_gradient_as_bucket_view_needs_what_stepping_after_backward_does(runs):
    """gradient_as_bucket_view=True, by the allocator: DDP's buckets are the gradients there
    (each local gradient copied into its bucket and dropped as it completes), so stepping after
    backward already holds one weight's local gradient at a time, and the release neither saves
    nor costs anything: its peak is no more than that, under two weights (a release that kept
    its own copy of a bucket's average while stepping needs about 2.02 weights); the release
    leaves no .grad, stepping after backward the bucket views (the bits:
    tests/test_release_ddp.py)."""
    for r in runs:
        got = r["ddp_allocator"]
        after, released = got["as_view"][False], got["as_view"][True]
        if after is None:
            pytest.skip("this torch's profiler gives no allocation records")
        w = got["weight_bytes"]
        assert w <= after < 2 * w, (after, w)
        assert released <= after, (after, released, w)
        assert got["grads"][(True, True)] == 0 and got["grads"][(False, True)] == DDP_WEIGHTS
