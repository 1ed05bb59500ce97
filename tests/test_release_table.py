"""Gradient release on the mesh in every row of the rules x formats table (tests/optim_table.py,
every param dtype of each format): released FSDP2 (the step from FSDP2's post-reduce hook, in
buckets of several params), released HSDP and released DDP (from DDP's comm hook) have, bit
for bit, the params and every state tensor of the same run stepping after backward, on every
rank. The FSDP2 shards are uneven and some are empty (the last layer's one row); the 8-bit rows
run on a model whose 8-bit blocks are cut by the shards at 2, 3 and 4 ranks (the dims of
tests/test_distributed.py's ``_sr_mlp``); a rule that takes matrices only (RuleInfo.shapes)
gets the same layers without biases. test_release_mesh.py and test_release_ddp.py check 8
representative rows with reshard, accumulation, clipping and skips; this file only sweeps the
table.

The 2-rank sweep runs in the spawn of tests/release_world2.py (shared with
test_memory_release.py and test_release_trainers_ddp.py); the 3- and 4-rank sweeps and HSDP
(2 x 2) in test_release_mesh.py's spawn of 4 ranks, whose tests check them with
:func:`check_table`. What makes a sweep cheap (CI time): every row's released and reference
branches live in one model, each dtype's branches one fully_shard unit, so one forward and
backward a step serve every row under FSDP2; under DDP one module a rule (its comm hook takes
one release, one optimizer), every dtype in it; the base modules are made once and copied."""
import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import optim_table as T
from test_distributed import _batch, _equal_bits

pytest_plugins = ("release_world2",)  # the 2-rank spawn, one for the release files of world 2
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not available")

STEPS = range(2)  # the second steps from the state the first made
DDP_CAP_MB = 0.001  # several of DDP's buckets for the tiny models
BUCKET = 4096  # the release's bucket under FSDP2, bytes per rank
# tests/test_distributed.py's _sr_mlp: dims no world size of 2, 3 or 4 divides (uneven shards,
# 256-element blocks cut by them), a last layer of one row (empty shards); the 8-bit rows'
# weights of 4096+ elements whose blocks the shards of 2, 3 and 4 ranks cut
DIMS = (8, 37, 19, 1)
Q8_DIMS = (8, 2050, 2, 67, 71, 1)


def _rows():
    """(id, rule, format, param dtype): every pair of the table with every dtype it takes."""
    return [("%s/%s/%s" % (rule.name, fmt.name, str(dtype)[6:]), rule, fmt, dtype)
            for rule, fmt in T.pairs() for dtype in fmt.param_dtypes]


_BASES = {}


def _branch(fmt, dtype, rule):
    """A fresh copy of the branch for a row: an MLP of Linear and Tanh in ``dtype`` (the same
    init for every row of its kind: made once, then copied, as torch.manual_seed and module
    init cost more than the rows' steps)."""
    key = (fmt.moment_format == "q8", dtype, rule.shapes is not None)
    if key not in _BASES:
        torch.manual_seed(0)
        dims = Q8_DIMS if key[0] else DIMS
        layers = []
        for a, b in zip(dims, dims[1:]):
            layers += [nn.Linear(a, b, bias=not key[2]), nn.Tanh()]
        _BASES[key] = nn.Sequential(*layers[:-1]).to(dtype)
    return copy.deepcopy(_BASES[key])


class _Unit(nn.Module):
    """The branches of one param dtype (one fully_shard unit: FSDP2 takes one dtype a unit);
    the loss is the sum of each branch's own mean squared error, so each branch's gradient
    is, bit for bit, the one it would get alone."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype
        self.branches = nn.ModuleList()

    def forward(self, x, y):
        loss = 0.0
        for b in self.branches:
            loss = loss + ((b(x.to(self.dtype)).float() - y) ** 2).mean()
        return loss


class Branches(nn.Module):
    """A branch per spec (rule, format, dtype), in ``branches`` in their order; ``units``: a
    _Unit per dtype."""

    def __init__(self, specs):
        super().__init__()
        dtypes = sorted({s[2] for s in specs}, key=str)
        self.units = nn.ModuleList(_Unit(d) for d in dtypes)
        self.branches = []
        for rule, fmt, dtype in specs:
            b = _branch(fmt, dtype, rule)
            self.units[dtypes.index(dtype)].branches.append(b)
            self.branches.append(b)

    def forward(self, x, y):
        return sum(unit(x, y) for unit in self.units)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _local_state(branch, opt):
    """This rank's local shards (bits) of a branch's params and their state tensors."""
    return [(_local(p.detach()).clone(), {k: _local(v).clone() for k, v in opt.state[p].items()})
            for p in branch.parameters()]


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


def _moved(before, after):
    """The params a run changed (on this rank's shards)."""
    return [i for i, ((p, _), (q, _)) in enumerate(zip(before, after)) if not torch.equal(p, q)]


def _train(model, opts, released, rank, run=None):
    """STEPS steps on this rank's batches; the optimizers in ``opts`` not released step after
    backward. Returns whether every released param's gradient was freed."""
    for step in STEPS:
        x, y = _batch(step + 100 * rank)  # each rank its own batch: the reduction is a real mean
        (run or model)(x, y).backward()
        for opt, rel in zip(opts, released):
            if not rel:
                opt.step()
                opt.zero_grad(set_to_none=True)
    return all(p.grad is None for opt, rel in zip(opts, released) if rel
               for g in opt.param_groups for p in g["params"])


def _fsdp2_sweep(rank, mesh):
    """Every row at once under FSDP2 (or HSDP, a 2-D mesh): a released and a reference branch
    per row, an optimizer each (one optimizer with a group per row fails under FSDP2 once a
    master and a remainder group share a launch with an empty shard: an mpext.adam_step_
    check, reported; not the release's)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    rows = _rows()
    model = Branches([(rule, fmt, dtype) for _, rule, fmt, dtype in rows for _ in (0, 1)])
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for unit in model.units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opts, released = [], []
    with warnings.catch_warnings():  # round-to-nearest rows warn that they lose small updates
        warnings.simplefilter("ignore")
        for i, b in enumerate(model.branches):
            _, rule, fmt, _ = rows[i // 2]
            opts.append(rule.cls(list(b.parameters()),
                                 **dict(rule.kwargs, seed=7, **fmt.kwargs_for(rule))))
            released.append(i % 2 == 1)
    before = [_local_state(b, o) for b, o in zip(model.branches[1::2], opts[1::2])]
    for opt, rel in zip(opts, released):
        if rel:
            opt.release_grads(bucket_bytes=BUCKET)
    freed = _train(model, opts, released, rank)
    out = {}
    for r, (key, *_) in enumerate(rows):
        ref = _local_state(model.branches[2 * r], opts[2 * r])
        got = _local_state(model.branches[2 * r + 1], opts[2 * r + 1])
        out[key] = {"diff": _diff(ref, got), "moved": _moved(before[r], got), "freed": freed}
    return out


def _ddp_sweep(rank, group):
    """Every row under DDP on ``group`` (None: the world): a DDP module a rule and run (the
    comm hook takes one release: one optimizer, a param group per row), its rows' branches of
    every dtype in it."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    by_rule = {}
    for key, rule, fmt, dtype in _rows():
        by_rule.setdefault(rule.name, []).append((key, rule, fmt, dtype))
    out = {}
    for rows in by_rule.values():
        rule = rows[0][1]
        got = {}
        for released in (False, True):
            model = Branches([(rule, fmt, dtype) for _, rule, fmt, dtype in rows])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt = rule.cls([dict(params=list(b.parameters()), **fmt.kwargs_for(rule))
                                for b, (_, _, fmt, _) in zip(model.branches, rows)],
                               **dict(rule.kwargs, seed=7))
            ddp = DDP(model, process_group=group, bucket_cap_mb=DDP_CAP_MB)
            if released:
                before = [_local_state(b, opt) for b in model.branches]
                opt.release_grads(bucket_bytes=0, ddp=ddp)
            freed = _train(model, [opt], [released], rank, run=ddp)
            got[released] = [_local_state(b, opt) for b in model.branches]
        for r, (key, *_) in enumerate(rows):
            out[key] = {"diff": _diff(got[False][r], got[True][r]),
                        "moved": _moved(before[r], got[True][r]), "freed": freed}
    return out


def _table_cases(rank, mesh=None, group=None, ddp=True):
    """The sweep on ``mesh`` (FSDP2; a 2-D one: HSDP) and, with ``ddp``, under DDP on
    ``group``; by default both on the world. {engine: {row: result}}."""
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {"fsdp2": _fsdp2_sweep(rank, mesh)}
    if ddp:
        out["ddp"] = _ddp_sweep(rank, group)
    return out


def check_table(ranks, engine):
    """Every row, on every rank: params and every state tensor equal, bit for bit (under FSDP2
    and HSDP each rank's shards); every released gradient freed; on rank 0 (which holds a shard
    of every param) the training moved the params."""
    bad = {}
    for rank, r in enumerate(ranks):
        rows = r[engine]
        assert sorted(rows) == sorted(ROWS)
        for key in ROWS:
            got = rows[key]
            where = "%s rank %d" % (key, rank)
            if got["diff"]:
                bad[where] = got["diff"]
            if not got["freed"]:
                bad[where] = "gradients left"
            if rank == 0 and not got["moved"]:
                bad[where] = "nothing moved"
    assert bad == {}


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
    """At 2 ranks (3, 4 and HSDP: test_release_mesh.py)."""
    check_table(runs, engine)
