"""The cached step of DTensor params (mpext.optim._shard_plan.ShardedStepPlan): under FSDP2 and
on plain DTensor params, an optimizer that keeps its plan gives at every step the bits of one
that steps the long way (its plan never kept), in every format, and still does after each
event that makes a kept plan stale -- a group's settings edited, a param group added, a state
loaded, the params' local shards replaced (``to_empty``, which FSDP2 re-shards), a param
replaced by a new DTensor placed otherwise. A plan that went stale fails here.

Two gloo ranks on loopback (forked, as tests/test_distributed.py's) run every case and report;
each rank compares its own shards. The weights are cut by the 2-way shard inside an 8-bit
block, so the 8-bit formats step through the shared blocks' exchange.
"""
import functools
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import mpext
from mpext.optim._shard_plan import ShardedStepPlan
from mpext.optim._tensors import local_tensor
from test_distributed import _spawn  # forked gloo ranks; the NCCL one spawned

BF16 = torch.bfloat16
Q8 = dict(exp_avg_dtype=torch.int8, exp_avg_sq_dtype=torch.uint8)
# name -> (rule, param dtype, keywords)
FORMATS = {
    "fp32": ("AdamW", torch.float32, {}),
    "master": ("AdamW", BF16, {}),
    "remainder": ("AdamW", BF16, dict(param_remainders=True)),
    "sr": ("AdamW", BF16, dict(master_weights=False, stochastic_rounding=True)),
    "bf16_moments_ema": ("AdamW", BF16, dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16,
                                              ema_decay=0.9)),
    "sr_q8": ("AdamW", BF16, dict(master_weights=False, stochastic_rounding=True, **Q8)),
    "remainder_q8_ema": ("AdamW", BF16, dict(param_remainders=True, ema_decay=0.9, **Q8)),
    "lion_sr_q8": ("Lion", BF16, dict(master_weights=False, stochastic_rounding=True,
                                      exp_avg_dtype=torch.int8)),
    "sgd_master": ("SGD", BF16, dict(momentum=0.9, weight_decay=0.01)),
}
EVENTS = ("none", "group_edit", "add_param_group", "load_state_dict", "to_empty")
SCALE = 1024.0  # the "scaled" case's loss scale: the step unscales the gradients in place
STEPS, EVENT_AT, SAVE_AT = 6, 3, 1

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not available")


# --------------------------------------------------------------------------------------------
# What each rank runs.

def _model(dtype, device):
    """At 2 ranks the 1025 x 8 weight's shards meet inside block 16 (rank 0 holds 4104
    elements) and the 5 x 1025 one's inside block 12 (3075): both keep 8-bit moments."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 1025), nn.Tanh(), nn.Linear(1025, 5)).to(device, dtype)


def _batch(step, device):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(6, 8, generator=g).to(device), torch.randn(6, 5, generator=g).to(device)


def _local(t):
    return t.to_local() if isinstance(t, torch.distributed.tensor.DTensor) else t


def _bits(t):
    t = _local(t).detach()
    return t.reshape(-1).view(torch.uint8) if t.dtype.itemsize > 1 else t.reshape(-1)


def _differences(a, b, label):
    """Where two optimizers' params and states differ (their local shards, bit for bit)."""
    out = []
    pa = [p for g in a.param_groups for p in g["params"]]
    pb = [p for g in b.param_groups for p in g["params"]]
    for i, (p, q) in enumerate(zip(pa, pb)):
        if not torch.equal(_bits(p), _bits(q)):
            out.append("%s: param %d" % (label, i))
        if (p.grad is None) != (q.grad is None) or (
                p.grad is not None and not torch.equal(_bits(p.grad), _bits(q.grad))):
            out.append("%s: the gradient of param %d" % (label, i))  # unscaled in place
        sa, sb = a.state.get(p, {}), b.state.get(q, {})
        if sorted(sa) != sorted(sb):
            out.append("%s: param %d keys %s vs %s" % (label, i, sorted(sa), sorted(sb)))
            continue
        for key in sa:
            if not torch.equal(_bits(sa[key]), _bits(sb[key])):
                out.append("%s: param %d state %s" % (label, i, key))
    return out


def _clone_state_dict(opt):
    sd = opt.state_dict()
    return {"param_groups": sd["param_groups"],
            "state": {k: {n: v.clone() if isinstance(v, torch.Tensor) else v
                          for n, v in st.items()} for k, st in sd["state"].items()}}


def _event(event, opt, model, saved):
    """Applies the event to one optimizer (and its model) before the step at EVENT_AT."""
    if event == "group_edit":
        for group in opt.param_groups:
            group["lr"] = group["lr"] * 0.5
            group["weight_decay"] = 0.2
            if "betas" in group:
                group["betas"] = (0.8, 0.95)
            if group.get("exp_avg_dtype") is torch.int8:
                group["block_size"] = 512  # re-blocked: decoded and coded again
    elif event == "add_param_group":
        opt.add_param_group({"params": list(model[2].parameters())})
    elif event == "load_state_dict":
        opt.load_state_dict(saved)
    elif event == "to_empty":
        # New local shards for the same param objects (FSDP2 re-pads and re-points them),
        # holding the same values.
        values = [_local(p).detach().clone() for p in model.parameters()]
        model.to_empty(device=values[0].device)
        with torch.no_grad():
            for p, v in zip(model.parameters(), values):
                _local(p).copy_(v)


def _record(out, plan):
    """Notes the cached optimizer's plan after a step: its class, which of the case's plans it
    is (0 the first; the plans are kept alive, so no two share an id), and its params."""
    alive = out.setdefault("alive", [])
    which = next((i for i, q in enumerate(alive) if q is plan), None)
    if which is None:
        which = len(alive)
        alive.append(plan)
    out["plans"].append((type(plan).__name__, which, len(plan) if plan else 0))


def _fsdp_case(name, event, mesh, device):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    rule, dtype, kw = FORMATS[name]
    runs = []
    for cached in (True, False):
        model = _model(dtype, device)
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        params = (list(model[0].parameters()) if event == "add_param_group"
                  else list(model.parameters()))
        opt = getattr(mpext.optim, rule)(params, lr=1e-2, seed=3, **kw)
        if not cached:
            opt._new_plan = lambda *args: None  # the long way at every step
        runs.append((model, opt))
    first = [_local(p).detach().clone() for p in runs[0][0].parameters()]
    out = {"differences": [], "plans": [], "saved": None}
    saved = [None, None]
    for step in range(STEPS):
        x, y = _batch(step, device)
        for k, (model, opt) in enumerate(runs):
            if step == EVENT_AT and event != "none":
                _event(event, opt, model, saved[k])
            opt.zero_grad(set_to_none=True)
            loss = ((model(x.to(dtype)).float() - y) ** 2).mean()
            if event == "scaled":
                (loss * SCALE).backward()
                opt.step(grad_scale=torch.tensor(SCALE, device=device))
            else:
                loss.backward()
                opt.step()
            if step == SAVE_AT:
                saved[k] = _clone_state_dict(opt)
        out["differences"] += _differences(runs[0][1], runs[1][1], "step %d" % step)
        _record(out, runs[0][1]._plan)
    out["moved"] = [not torch.equal(_bits(a), _bits(p))
                    for a, p in zip(first, runs[0][0].parameters())]
    # After zero_grad(set_to_none=True) no gradient of the last step may stay alive (the plan
    # keeps none: FSDP2's gradient memory is free during the next forward), cached or not.
    out["grads_alive"] = []
    for model, opt in runs:
        # the tensors the DTensor gradients hold (to_local() would make a new view)
        refs = [weakref.ref(local_tensor(p.grad)) for p in model.parameters()]
        before = sum(r() is not None for r in refs)
        opt.zero_grad(set_to_none=True)
        out["grads_alive"].append((before, sum(r() is not None for r in refs)))
    del out["alive"]
    return out


def _dtensor_case(name, mesh, device):
    """DTensor params without FSDP (gradients given): at EVENT_AT the first param is replaced,
    in its group's list, by a new param of the same value placed Replicate (its state starts
    anew, as it would for any new param object)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    rule, dtype, kw = FORMATS[name]
    torch.manual_seed(0)
    full = [torch.randn(1025, 8).to(device, dtype), torch.randn(5, 1025).to(device, dtype)]
    runs = []
    for cached in (True, False):
        params = [nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in full]
        opt = getattr(mpext.optim, rule)(params, lr=1e-2, seed=3, **kw)
        if not cached:
            opt._new_plan = lambda *args: None
        runs.append(opt)
    out = {"differences": [], "plans": []}
    for step in range(STEPS):
        g = torch.Generator().manual_seed(200 + step)
        grads = [torch.randn(t.shape, generator=g).to(device, dtype) for t in full]
        for opt in runs:
            group = opt.param_groups[0]
            if step == EVENT_AT:
                old = group["params"][0]
                group["params"][0] = nn.Parameter(old.detach().redistribute(
                    mesh, [Replicate()]).clone())
            for p, gr in zip(group["params"], grads):
                p.grad = distribute_tensor(gr, mesh, p.placements)
            opt.step()
        out["differences"] += _differences(runs[0], runs[1], "step %d" % step)
        _record(out, runs[0]._plan)
    del out["alive"]
    return out


def _layout_case(name, mesh, device):
    """DTensor params whose gradients' local shards are column-major (hand-made: FSDP2 makes
    none) against the same params given the same gradient values row-major, loss-scaled (so
    the step writes the unscaled values back into each gradient): the differences, and the
    column-major gradients' strides after the steps."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    rule, dtype, kw = FORMATS[name]
    torch.manual_seed(0)
    full = [torch.randn(1025, 8).to(device, dtype), torch.randn(5, 1025).to(device, dtype)]
    runs = [getattr(mpext.optim, rule)(
        [nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in full],
        lr=1e-2, seed=3, **kw) for _ in range(2)]
    out = []
    for step in range(3):
        g = torch.Generator().manual_seed(300 + step)
        grads = [(SCALE * torch.randn(t.shape, generator=g)).to(device, dtype) for t in full]
        for k, opt in enumerate(runs):
            for p, gr in zip(opt.param_groups[0]["params"], grads):
                d = distribute_tensor(gr, mesh, p.placements)
                if k:  # the same local values, column-major
                    d = DTensor.from_local(d.to_local().t().contiguous().t(), mesh,
                                           p.placements, shape=d.shape, stride=d.stride())
                p.grad = d
            opt.step(grad_scale=torch.tensor(SCALE, device=device))
        out += _differences(runs[0], runs[1], "step %d" % step)
    return out, [p.grad.to_local().stride() for p in runs[1].param_groups[0]["params"]]


def _body(rank, out_dir, device):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    out = {}
    for name in FORMATS:
        for event in EVENTS + ("scaled",):
            out[(name, event)] = _fsdp_case(name, event, mesh, device)
        out[(name, "new_param")] = _dtensor_case(name, mesh, device)
        if "q8" in name:
            out[(name, "grad_layout")] = _layout_case(name, mesh, device)
    return out


_RUNS = {}


@pytest.fixture
def runs(device, tmp_path_factory):
    """Every case's results per rank: 2 gloo ranks on the CPU; on CUDA one NCCL rank (all a
    one-GPU machine has: local views and plans, no shared blocks)."""
    if device not in _RUNS:
        world, backend = (2, "gloo") if device == "cpu" else (1, "nccl")
        _RUNS[device] = _spawn(functools.partial(_body, device=device),
                               tmp_path_factory.mktemp("fsdp_cache_" + device), world, backend)
    return _RUNS[device]


# --------------------------------------------------------------------------------------------
# The tests.

@pytest.mark.parametrize("case", ["none", "scaled"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_cached_fsdp2_steps_match_the_long_way_and_keep_one_plan(runs, name, case):
    """Plain steps, and steps with a loss scale (the gradients unscaled in place, through the
    exchange's copies for the blocks two shards share)."""
    for rank, res in enumerate(runs):
        r = res[(name, case)]
        assert r["differences"] == [], "rank %d: %s" % (rank, r["differences"])
        assert all(r["moved"]), "rank %d: a param never moved: %s" % (rank, r["moved"])
        kinds, ids, sizes = zip(*r["plans"])
        # Not vacuous: the cached optimizer stepped through one ShardedStepPlan, built at the
        # first step and kept.
        assert set(kinds) == {ShardedStepPlan.__name__} and len(set(ids)) == 1, r["plans"]
        assert sizes[-1] == 4


@pytest.mark.parametrize("name", [n for n in FORMATS if "q8" in n])
def test_a_gradient_in_another_memory_order_steps_as_its_row_major_twin(runs, name):
    """The 8-bit split cuts a param and its gradient at the same flat positions: a gradient
    whose local shard is column-major must be stepped in the param's order (it paired other
    elements before), and its unscaled values written back into it."""
    for rank, res in enumerate(runs):
        differences, strides = res[(name, "grad_layout")]
        assert differences == [], "rank %d: %s" % (rank, differences)
        # not vacuous: the gradients stayed column-major (a stride of 1 on dim 0)
        assert all(st[0] == 1 and st[1] > 1 for st in strides), (rank, strides)


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_kept_plan_holds_no_gradient_after_zero_grad(runs, name):
    """The cached step reads each step's gradients and lets go of them after the launch: after
    ``zero_grad(set_to_none=True)`` every gradient of the last step is freed, as it is with
    the long way (the control, which keeps nothing)."""
    for rank, res in enumerate(runs):
        (cached_before, cached), (long_before, long_way) = res[(name, "none")]["grads_alive"]
        assert cached_before == long_before == 4  # every gradient alive before zero_grad
        assert long_way == 0, "rank %d: the control keeps %d gradients" % (rank, long_way)
        assert cached == 0, "rank %d: %d gradients kept alive by the plan" % (rank, cached)


def test_a_kept_plan_of_plain_params_holds_no_gradient_after_zero_grad(device):
    """The same for plain (not DTensor) params, whose plan is the engine's StepPlan."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n, dtype=BF16, device=device)) for n in (300, 5000)]
    opt = mpext.optim.AdamW(params, lr=1e-2, exp_avg_dtype=torch.int8,
                            exp_avg_sq_dtype=torch.uint8)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    assert opt._plan is not None  # not vacuous: the steps went through a kept plan
    refs = [weakref.ref(p.grad) for p in params]
    opt.zero_grad(set_to_none=True)
    assert [r() is None for r in refs] == [True, True]


@pytest.mark.parametrize("event", [e for e in EVENTS if e != "none"] + ["new_param"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_cached_step_after_an_invalidating_event_matches_the_long_way(runs, name, event):
    for rank, res in enumerate(runs):
        r = res[(name, event)]
        assert r["differences"] == [], "rank %d: %s" % (rank, r["differences"])
        kinds, ids, sizes = zip(*r["plans"])
        assert set(kinds) == {ShardedStepPlan.__name__}, r["plans"]
        # The plan kept before the event, a new one from the event's step on.
        assert len(set(ids[:EVENT_AT])) == 1 and ids[EVENT_AT] not in ids[:EVENT_AT], r["plans"]
        if event == "add_param_group":
            assert sizes[EVENT_AT - 1] == 2 and sizes[-1] == 4
