"""Gradient release on the mesh in every row of the rules x formats table (tests/optim_table.py,
every param dtype of each format): at 2 gloo ranks, released FSDP2 (the step from FSDP2's
post-reduce hook, in buckets of several params) and released DDP (from DDP's comm hook) have,
bit for bit, the params and every state tensor of the same run stepping after backward, on
every rank. The FSDP2 model's shards are uneven and one layer's are empty on rank 1; the 8-bit
rows run on a model whose 8-bit blocks are cut by the shards (tests/test_distributed.py's
``_sr_mlp``). test_release_mesh.py and test_release_ddp.py check 8 representative rows at 1 to
4 ranks with reshard, accumulation, clipping and skips; this file only sweeps the table.

The rows are looped inside the ranks of one spawn (tests/release_world2.py, shared with
test_memory_release.py and test_release_trainers_ddp.py); the tests compare in this process."""
import warnings

import pytest
import torch
import torch.distributed as dist

import optim_table as T
from test_distributed import _batch, _equal_bits, _sr_mlp

pytest_plugins = ("release_world2",)  # the 2-rank spawn, one for the release files of world 2
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not available")

STEPS = range(2)  # the second steps from the state the first made
DDP_CAP_MB = 0.001  # several of DDP's buckets for the tiny models
BUCKET = 4096  # the release's bucket under FSDP2, bytes per rank


def _rows():
    """(id, rule, format, param dtype): every pair of the table with every dtype it takes."""
    return [("%s/%s/%s" % (rule.name, fmt.name, str(dtype)[6:]), rule, fmt, dtype)
            for rule, fmt in T.pairs() for dtype in fmt.param_dtypes]


def _runs():
    """The rows by (rule, param dtype): each such run trains one model of a branch per row,
    each branch with an optimizer (and a release) of its own, so that a run's collectives and
    setup serve all its rows."""
    out = {}
    for key, rule, fmt, dtype in _rows():
        out.setdefault((rule.name, dtype), []).append((key, fmt))
    return out


class Branches(torch.nn.Module):
    """A branch per row (the mesh tests' MLP; the 8-bit rows' larger one), their outputs
    summed."""

    def __init__(self, fmts, dtype):
        super().__init__()
        self.branches = torch.nn.ModuleList(
            _sr_mlp("sr_q8" if f.moment_format == "q8" else None).to(dtype) for f in fmts)

    def forward(self, x):
        return sum(b(x) for b in self.branches)


def _setup(rule, rows, dtype, mesh=None):
    """The model, its optimizers and its DDP module (None under FSDP2). FSDP2: one fully_shard
    unit (one all-gather and one reduce-scatter a step for every row: the sweep's cost; the
    mesh tests cut units per layer), uneven dim-0 shards, an optimizer per row (one optimizer
    with a param group per row fails under FSDP2 once a master and a remainder group share a
    launch with an empty shard: an mpext.adam_step_ check, reported; not the release's). DDP:
    one DDP module, whose comm hook one release takes: one optimizer, a param group per row."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = Branches([f for _, f in rows], dtype)
    rule = T.RULES[rule]
    with warnings.catch_warnings():  # round-to-nearest rows warn that they lose small updates
        warnings.simplefilter("ignore")
        if mesh is not None:
            fully_shard(model, mesh=mesh,
                        mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
            return model, [rule.cls(list(b.parameters()), **dict(
                rule.kwargs, seed=7, **f.kwargs_for(rule)))
                for b, (_, f) in zip(model.branches, rows)], None
        opt = rule.cls([dict(params=list(b.parameters()), **f.kwargs_for(rule))
                        for b, (_, f) in zip(model.branches, rows)],
                       **dict(rule.kwargs, seed=7))
    return model, [opt], DDP(model, bucket_cap_mb=DDP_CAP_MB)


def _local_state(model, opts, rows):
    """Per row, this rank's local shards (bits) of its branch's params and state tensors."""
    out = {}
    opts = opts * len(rows) if len(opts) == 1 else opts
    for b, opt, (key, _) in zip(model.branches, opts, rows):
        out[key] = [(_local(p.detach()).clone(),
                     {k: _local(v).clone() for k, v in opt.state[p].items()})
                    for p in b.parameters()]
    return out


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _diff(a, b):
    bad = []
    for i, ((pa, sa), (pb, sb)) in enumerate(zip(a, b)):
        if not _equal_bits(pa, pb):
            bad.append("param %d" % i)
        if sorted(sa) != sorted(sb):
            bad.append("param %d state keys" % i)
        else:
            bad += ["param %d %s" % (i, k) for k in sa if not _equal_bits(sa[k], sb[k])]
    return bad


def _train(model, opts, ddps, rank, released, bucket_bytes):
    """STEPS steps on this rank's batches: released (each optimizer's release_grads, under DDP
    with its branch's DDP module) or stepping after backward."""
    if released:
        for i, opt in enumerate(opts):
            opt.release_grads(bucket_bytes=bucket_bytes, ddp=ddps)
    params = list(model.parameters())
    dtype = params[0].dtype
    for step in STEPS:
        x, y = _batch(step + 100 * rank)
        out = (model if ddps is None else ddps)(x.to(dtype))
        ((out.float() - y) ** 2).mean().backward()
        if not released:
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in params)


def _table_cases(rank):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,))
    out = {}
    for (rule, dtype), rows in _runs().items():
        got = {}
        for released in (False, True):
            model, opts, _ = _setup(rule, rows, dtype, mesh)
            if released:
                before = _local_state(model, opts, rows)
            # buckets of several params (the small branches' in one; test_release_mesh cuts
            # them finer): fewer launches, the sweep's host time
            _train(model, opts, None, rank, released, BUCKET)
            got[released] = _local_state(model, opts, rows)
        for key, _ in rows:
            out[("fsdp2", key)] = {"diff": _diff(got[False][key], got[True][key]),
                                   "moved": [i for i, ((p, _), (q, _)) in enumerate(zip(
                                       before[key], got[True][key])) if not torch.equal(p, q)]}
        got = {}
        for released in (False, True):
            model, opts, ddps = _setup(rule, rows, dtype)
            _train(model, opts, ddps, rank, released, 0)
            got[released] = _local_state(model, opts, rows)
        for key, _ in rows:
            out[("ddp", key)] = {"diff": _diff(got[False][key], got[True][key])}
    return out


@pytest.fixture(scope="module")
def runs(release_world2):
    return [r["table"] for r in release_world2]


ROWS = [key for key, *_ in _rows()]


def test_every_row_of_the_table_is_swept():
    """Every rule and every format appears, and FP16 params too (the sweep is the table's)."""
    rules = {k.split("/")[0] for k in ROWS}
    formats = {k.split("/")[1] for k in ROWS}
    assert rules == set(T.RULES) and formats == set(T.FORMATS)
    assert any(k.endswith("/float16") for k in ROWS) and len(ROWS) > 100


@pytest.mark.parametrize("engine", ("fsdp2", "ddp"))
def test_released_mesh_has_the_bits_of_stepping_after_backward_in_every_row(runs, engine):
    """Every row, on both ranks: params and every state tensor equal, bit for bit (under FSDP2
    gathered whole); the FSDP2 training moved the params and state."""
    bad = {}
    for rank, r in enumerate(runs):
        for key in ROWS:
            got = r[(engine, key)]
            if got["diff"]:
                bad["%s rank %d" % (key, rank)] = got["diff"]
            if engine == "fsdp2" and not got["moved"] and rank == 0:
                bad["%s rank %d" % (key, rank)] = "nothing moved"
    assert bad == {}
