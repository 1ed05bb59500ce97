"""mpext.GradScaler against torch.amp.GradScaler.

A differential harness runs the same small training runs (same seeds, identical model copies,
the same batches) with both scalers in lock step and, after every step, asserts the same scale
and growth tracker (bit for bit), the same skip decision per optimizer, bitwise-identical
params, gradients and optimizer state, equal state_dicts and the same number of host reads.
Then: misuse raises what torch raises, checkpoints and pickles move both ways, and the opt-in
extensions (hysteresis, min/max scale, skip reporting, the overflow warning, bf16_check_only)
follow a pure-Python model (tests/reference.py)."""
import contextlib
import copy
import io
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F

import mpext
from mpext import ops

from conftest import CUDA_OK, HostReads
from reference import ScaleRuleModel, assert_bits_or_both_nan
from reference import raw_bytes as bits

NAN, INF = float("nan"), float("inf")


# --------------------------------------------------------------------------------------------
# Helpers: host-read counting, bitwise comparisons (bits and the NaN-aware comparison are
# tests/reference.py's).


def assert_bitwise(a, b, what=""):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(bits(a), bits(b)), what


def assert_optimizer_states_equal(o1, o2):
    s1, s2 = o1.state_dict(), o2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    assert s1["state"].keys() == s2["state"].keys()
    for k in s1["state"]:
        a, b = s1["state"][k], s2["state"][k]
        assert a.keys() == b.keys()
        for name in a:
            if isinstance(a[name], torch.Tensor):
                assert_bitwise(a[name], b[name], "optimizer state %s/%s" % (k, name))
            else:
                assert a[name] == b[name]


def sd_types(sd):
    return {k: type(v) for k, v in sd.items()}


# --------------------------------------------------------------------------------------------
# The harness.


class Net(torch.nn.Module):
    def __init__(self, sparse=False, dtype=torch.float32, half_dtype=None):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 6, sparse=sparse)
        self.fc1 = torch.nn.Linear(6, 24)
        self.fc2 = torch.nn.Linear(24, 24)
        self.head = torch.nn.Linear(24, 3)
        self.to(dtype)
        if half_dtype is not None:  # some params in a low-precision dtype: a mixed-dtype list
            self.fc2.to(half_dtype)

    def forward(self, idx):
        h = self.emb(idx).mean(1)
        h = torch.relu(self.fc1(h))
        h = torch.relu(self.fc2(h.to(self.fc2.weight.dtype))).to(self.head.weight.dtype)
        return self.head(h)


def make_optimizers(cfg, model):
    kind = cfg.get("opt", "sgd")
    extra = {k: cfg[k] for k in ("foreach", "fused") if k in cfg}
    params = list(model.parameters())

    def one(ps, which):
        if which == "sgd":
            return torch.optim.SGD(ps, lr=0.05, **extra)
        if which == "sgd_momentum":
            return torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, **extra)
        if which == "adam":
            return torch.optim.Adam(ps, lr=1e-2, **extra)
        if which == "adamw":
            return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **extra)
        raise ValueError(which)

    if kind == "two":
        # Two optimizers over disjoint params, one scaler: each is skipped on its own.
        first = list(model.emb.parameters()) + list(model.fc1.parameters())
        rest = [p for p in params if all(p is not q for q in first)]
        return [one(first, "sgd_momentum"), one(rest, "adam")]
    return [one(params, kind)]


def make_scaler(cls, cfg, device):
    kw = dict(init_scale=cfg.get("init_scale", 2.0 ** 16),
              growth_interval=cfg.get("growth_interval", 3),
              enabled=cfg.get("enabled", True))
    for k in ("growth_factor", "backoff_factor"):
        if k in cfg:
            kw[k] = cfg[k]
    return cls(device, **kw)


def batch(step, micro, device):
    g = torch.Generator().manual_seed(1000 * step + micro)
    idx = torch.randint(0, 20, (8, 5), generator=g)
    y = torch.randn(8, 3, generator=g)
    return idx.to(device), y.to(device)


class Side:
    def __init__(self, model, cls, cfg, device):
        self.model = model
        self.opts = make_optimizers(cfg, model)
        self.scaler = make_scaler(cls, cfg, device)
        self.reads = HostReads()
        self.skips = []

    def params_of(self, opt):
        return [p for g in opt.param_groups for p in g["params"]]


def autocast_ctx(cfg, device):
    if not cfg.get("autocast"):
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if device == "cpu" else torch.float16
    return torch.autocast(device_type=device, dtype=dtype)


def train_step(side, cfg, step, device):
    """One iteration in the standard AMP recipe; returns the per-optimizer skip decisions."""
    scaler, model = side.scaler, side.model
    for o in side.opts:
        o.zero_grad(set_to_none=True)
    accum = cfg.get("accum", 1)
    inject = cfg.get("inject", {}).get(step)
    for micro in range(accum):
        idx, y = batch(step, micro, device)
        with autocast_ctx(cfg, device):
            out = model(idx)
            loss = F.mse_loss(out.float(), y) * cfg.get("loss_mult", 1.0) / accum
        if inject is not None and inject[0] == "loss":
            loss = loss * inject[1]
        scaler.scale(loss).backward()
    if inject is not None and inject[0] == "grad":
        _, param_index, value = inject
        p = list(model.parameters())[param_index]
        with torch.no_grad():
            if p.grad.is_sparse:
                p.grad._values().view(-1)[1] = value
            else:
                p.grad.view(-1)[p.grad.numel() // 2] = value
    with side.reads.counting():
        if cfg.get("unscale_clip"):
            for o in side.opts:
                scaler.unscale_(o)
    if cfg.get("unscale_clip"):
        for o in side.opts:
            torch.nn.utils.clip_grad_norm_(side.params_of(o), 0.5)
    skipped = []
    for o in side.opts:
        with side.reads.counting():
            scaler.step(o)
        if scaler.is_enabled():
            state = scaler._per_optimizer_states[id(o)]
            skipped.append(bool(sum(v.item() for v in state["found_inf_per_device"].values())))
    with side.reads.counting():
        scaler.update()
    side.skips.append(skipped)
    return skipped


def compare(t, m, step, reads=True):
    """Everything the two sides hold must agree (and, for two sides that ran the same steps,
    the host reads they made)."""
    assert t.skips[-1] == m.skips[-1], step
    st, sm = t.scaler, m.scaler
    assert st.is_enabled() == sm.is_enabled()
    if st.is_enabled():
        assert_bitwise(st._scale, sm._scale, "scale at step %d" % step)
        assert_bitwise(st._growth_tracker, sm._growth_tracker, "tracker at step %d" % step)
        for o_m, skipped in zip(m.opts, m.skips[-1]):
            assert sm.last_step_skipped(o_m).item() is skipped
        assert sm.last_step_skipped().item() is any(m.skips[-1])
    assert st.get_scale() == sm.get_scale()
    for (n, pt), pm in zip(t.model.named_parameters(), m.model.parameters()):
        assert_bitwise(pt, pm, "param %s at step %d" % (n, step))
        assert (pt.grad is None) == (pm.grad is None)
        if pt.grad is not None:
            assert_bits_or_both_nan(pt.grad, pm.grad, "grad %s at step %d" % (n, step))
    for ot, om in zip(t.opts, m.opts):
        assert_optimizer_states_equal(ot, om)
    sdt, sdm = st.state_dict(), sm.state_dict()
    assert sdt == sdm and sd_types(sdt) == sd_types(sdm), step
    if reads:
        assert t.reads.count == m.reads.count, (step, t.reads.calls, m.reads.calls)


def make_sides(cfg, device, model=None):
    torch.manual_seed(cfg.get("seed", 0))
    if model is None:
        model = Net(sparse=cfg.get("sparse", False), dtype=cfg.get("dtype", torch.float32),
                    half_dtype=cfg.get("half_dtype")).to(device)
    t = Side(copy.deepcopy(model), torch.amp.GradScaler, cfg, device)
    m = Side(copy.deepcopy(model), mpext.GradScaler, cfg, device)
    return t, m


def run_lockstep(t, m, cfg, device, steps, first=0):
    for step in range(first, first + steps):
        train_step(t, cfg, step, device)
        train_step(m, cfg, step, device)
        compare(t, m, step)


INJECT = {2: ("grad", 1, NAN), 5: ("grad", 3, INF), 6: ("grad", 5, -INF), 9: ("loss", NAN),
          10: ("loss", INF)}

CASES = {
    "sgd": dict(opt="sgd", inject=INJECT),
    "sgd_momentum_gi1": dict(opt="sgd_momentum", growth_interval=1, inject=INJECT),
    "sgd_fused": dict(opt="sgd", fused=True, inject=INJECT),
    "adam_foreach": dict(opt="adam", foreach=True, inject=INJECT),
    "adam_for_loop": dict(opt="adam", foreach=False, inject=INJECT, growth_interval=1),
    "adam_fused": dict(opt="adam", fused=True, inject=INJECT),
    "adamw_foreach": dict(opt="adamw", foreach=True, inject=INJECT),
    "adamw_fused": dict(opt="adamw", fused=True, inject=INJECT, growth_interval=1),
    "two_optimizers": dict(opt="two", inject={1: ("grad", 0, NAN), 3: ("grad", 6, INF),
                                              4: ("loss", NAN), 7: ("grad", 2, -INF)}),
    "unscale_clip": dict(opt="adamw", foreach=True, unscale_clip=True, inject=INJECT),
    "unscale_clip_fused": dict(opt="adam", fused=True, unscale_clip=True, inject=INJECT),
    "unscale_clip_two": dict(opt="two", unscale_clip=True, inject={2: ("grad", 1, NAN)}),
    "accumulation": dict(opt="adam", foreach=True, accum=3, inject=INJECT),
    "autocast": dict(opt="adamw", foreach=True, autocast=True, inject=INJECT),
    "autocast_fused_clip": dict(opt="adam", fused=True, autocast=True, unscale_clip=True,
                                inject=INJECT),
    "natural_overflow": dict(opt="sgd", init_scale=2.0 ** 125, growth_interval=2, loss_mult=1e3,
                             growth_factor=4.0, backoff_factor=0.125),
    "growth_to_fp32_max": dict(opt="sgd", init_scale=2.0 ** 110, growth_interval=1),
    "bf16_params": dict(opt="sgd_momentum", half_dtype=torch.bfloat16, inject=INJECT),
    "float64_model": dict(opt="adam", foreach=True, dtype=torch.float64, inject=INJECT),
    "sparse_sgd": dict(opt="sgd", sparse=True, inject={3: ("grad", 0, NAN), 6: ("loss", INF)}),
    "sparse_sgd_momentum": dict(opt="sgd", sparse=True, growth_interval=1,
                                inject={4: ("grad", 0, INF)}),
    "disabled": dict(opt="adam", enabled=False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_differential_training(device, name):
    cfg = CASES[name]
    if device == "cuda" and cfg.get("sparse") and cfg.get("fused"):
        pytest.skip("fused optimizers take no sparse gradients")
    t, m = make_sides(cfg, device)
    if cfg.get("half_dtype") == torch.bfloat16 and not torch_unscales_bf16(device):
        # torch's CUDA kernel has no bf16: torch's scaler cannot run this at all; mpext can.
        with pytest.raises(NotImplementedError):
            train_step(t, cfg, 0, device)
        for step in range(12):
            train_step(m, cfg, step, device)
        assert [s[0] for s in m.skips] == [step in cfg["inject"] for step in range(12)]
        return
    run_lockstep(t, m, cfg, device, steps=12)
    if t.scaler.is_enabled() and cfg.get("inject"):
        assert any(any(s) for s in t.skips) and not all(all(s) for s in t.skips)
    if cfg.get("inject") is INJECT and t.scaler.is_enabled() and not (
            cfg.get("autocast") and device != "cpu"):
        # No natural overflow in these runs (fp32 or bf16 activations; fp16 autocast on a GPU
        # may overflow on its own): exactly the injected steps were skipped.
        assert [any(s) for s in m.skips] == [step in INJECT for step in range(12)]


def torch_unscales_bf16(device):
    """Whether torch's own _amp_foreach_non_finite_check_and_unscale_ takes bf16 on device (its
    CPU kernel does; its CUDA kernel did not in the torch versions we know)."""
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(
            [torch.ones(2, dtype=torch.bfloat16, device=device)],
            torch.zeros((), device=device), torch.ones((), device=device))
        return True
    except (NotImplementedError, RuntimeError):
        return False


def test_harness_sees_natural_overflow_and_growth():
    """The natural-overflow case backs off on its own and the growth case reaches the top of the
    float32 range: the harness exercises both ends of the rule."""
    cfg = CASES["natural_overflow"]
    t, m = make_sides(cfg, "cpu")
    run_lockstep(t, m, cfg, "cpu", steps=8)
    assert any(s[0] for s in t.skips) and not all(s[0] for s in t.skips)
    # From 2^110, growing every step (interval 1), no gradient overflows (the loss is well
    # below 2^128 / 2^127): the scale doubles to 2^127, the largest power of two in float32,
    # then stays there, as torch grows a scale only while the grown one is finite -- never Inf.
    cfg = CASES["growth_to_fp32_max"]
    t, m = make_sides(cfg, "cpu")
    scales = []
    for step in range(25):
        run_lockstep(t, m, cfg, "cpu", steps=1, first=step)
        scales.append((t.scaler.get_scale(), m.scaler.get_scale()))
    want = [2.0 ** min(111 + step, 127) for step in range(25)]
    assert scales == list(zip(want, want)), scales
    assert [s[0] for s in t.skips] == [False] * 25 and [s[0] for s in m.skips] == [False] * 25


def test_two_optimizers_skip_independently():
    cfg = dict(opt="two", inject={2: ("grad", 0, NAN)})
    t, m = make_sides(cfg, "cpu")
    run_lockstep(t, m, cfg, "cpu", steps=4)
    assert m.skips[2] == [True, False]
    assert m.scaler.get_skipped_steps() == 1


# --------------------------------------------------------------------------------------------
# Resume from a state_dict in both directions, and pickling.


@pytest.mark.parametrize("direction", ["torch_to_mpext", "mpext_to_torch"])
def test_resume_from_state_dict(device, direction):
    cfg = dict(opt="adam", foreach=True, growth_interval=4, inject={2: ("grad", 1, NAN),
                                                                    9: ("loss", INF)})
    t, m = make_sides(cfg, device)
    run_lockstep(t, m, cfg, device, steps=5)
    src = t if direction == "torch_to_mpext" else m
    sd = src.scaler.state_dict()
    assert sd["_growth_tracker"] != 0  # saved mid-growth-interval
    assert set(sd) == {"scale", "growth_factor", "backoff_factor", "growth_interval",
                       "_growth_tracker"}
    assert sd_types(sd) == {"scale": float, "growth_factor": float, "backoff_factor": float,
                            "growth_interval": int, "_growth_tracker": int}
    # Through a real checkpoint file, as users do.
    buf = io.BytesIO()
    torch.save({"scaler": sd, "model": src.model.state_dict(),
                "opt": src.opts[0].state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    sides = []
    for cls in (torch.amp.GradScaler, mpext.GradScaler):
        torch.manual_seed(0)
        side = Side(Net().to(device), cls, dict(cfg, init_scale=1.0, growth_interval=1000),
                    device)
        side.model.load_state_dict(ckpt["model"])
        side.opts[0].load_state_dict(copy.deepcopy(ckpt["opt"]))  # it would share tensors
        side.scaler.load_state_dict(ckpt["scaler"])
        sides.append(side)
    new_t, new_m = sides
    assert new_t.scaler.state_dict() == new_m.scaler.state_dict() == sd
    run_lockstep(new_t, new_m, cfg, device, steps=6, first=5)
    # And both agree with the run that never stopped.
    run_lockstep(t, m, cfg, device, steps=6, first=5)
    compare(new_t, m, 10, reads=False)
    compare(t, new_m, 10, reads=False)


def test_load_state_dict_before_first_step():
    """Loading into a scaler whose scale is not created yet sets the initial values."""
    for a_cls, b_cls in [(torch.amp.GradScaler, mpext.GradScaler),
                         (mpext.GradScaler, torch.amp.GradScaler)]:
        a = a_cls("cpu", init_scale=512.0, growth_interval=7)
        b = b_cls("cpu")
        b.load_state_dict(a.state_dict())
        assert b.state_dict() == a.state_dict()
        assert b.get_scale() == 512.0


def test_pickling(device):
    cfg = dict(opt="sgd_momentum", growth_interval=3, inject={1: ("grad", 0, INF)})
    t, m = make_sides(cfg, device)
    run_lockstep(t, m, cfg, device, steps=5)
    t.scaler = pickle.loads(pickle.dumps(t.scaler))
    m.scaler = pickle.loads(pickle.dumps(m.scaler))
    assert type(m.scaler) is mpext.GradScaler
    assert m.scaler._scale is None  # re-created lazily, as torch does
    assert m.scaler.state_dict() == t.scaler.state_dict()
    run_lockstep(t, m, cfg, device, steps=4, first=5)
    # deepcopy goes through the same path
    m2 = copy.deepcopy(m.scaler)
    assert m2.state_dict() == m.scaler.state_dict()
    # Fresh and disabled scalers pickle too.
    for s in (mpext.GradScaler(device), mpext.GradScaler(device, enabled=False)):
        assert pickle.loads(pickle.dumps(s)).state_dict() == s.state_dict()


def test_pickling_mid_iteration_raises_like_torch():
    def fn(cls):
        model = torch.nn.Linear(3, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        s = cls("cpu")
        s.scale(model(torch.ones(2, 3)).sum()).backward()
        s.unscale_(opt)
        pickle.dumps(s)
    assert_same_exception(fn)


# --------------------------------------------------------------------------------------------
# Misuse: the same exception types and messages as torch.


def capture(fn, cls):
    try:
        fn(cls)
    except Exception as e:  # noqa: BLE001 - compared below
        return type(e), str(e)
    return None


def assert_same_exception(fn):
    want = capture(fn, torch.amp.GradScaler)
    got = capture(fn, mpext.GradScaler)
    assert want is not None, "torch raised nothing"
    assert got == want


def setup_iter(cls, dtype=torch.float32, fused=False, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 3).to(dtype)
    opt = torch.optim.Adam(model.parameters(), fused=True) if fused else \
        torch.optim.SGD(model.parameters(), lr=0.1)
    s = cls("cpu", **kw)
    s.scale(model(torch.ones(2, 3, dtype=dtype)).float().sum()).backward()
    return model, opt, s


MISUSE = {
    "unscale_twice": lambda cls: [(s.unscale_(o), s.unscale_(o))
                                  for _, o, s in [setup_iter(cls)]],
    "step_twice": lambda cls: [(s.step(o), s.step(o)) for _, o, s in [setup_iter(cls)]],
    "step_twice_fused": lambda cls: [(s.step(o), s.step(o))
                                     for _, o, s in [setup_iter(cls, fused=True)]],
    "unscale_after_step": lambda cls: [(s.step(o), s.unscale_(o))
                                       for _, o, s in [setup_iter(cls)]],
    "closure": lambda cls: [s.step(o, closure=lambda: 0.0) for _, o, s in [setup_iter(cls)]],
    "empty_state_dict": lambda cls: cls("cpu").load_state_dict({}),
    "state_dict_of_disabled": lambda cls: cls("cpu").load_state_dict(
        cls("cpu", enabled=False).state_dict()),
    "update_without_inf_checks": lambda cls: [s.update() for _, o, s in [setup_iter(cls)]],
    "step_before_scale": lambda cls: cls("cpu").step(torch.optim.SGD(
        torch.nn.Linear(2, 2).parameters(), lr=0.1)),
    "unscale_before_scale": lambda cls: cls("cpu").unscale_(torch.optim.SGD(
        torch.nn.Linear(2, 2).parameters(), lr=0.1)),
    "update_before_scale": lambda cls: cls("cpu").update(),
    "fp16_grads": lambda cls: [s.step(o) for _, o, s in [setup_iter(cls, torch.float16)]],
    "fp16_grads_unscale": lambda cls: [s.unscale_(o) for _, o, s in
                                       [setup_iter(cls, torch.float16)]],
    "growth_factor": lambda cls: cls("cpu", growth_factor=1.0),
    "backoff_factor": lambda cls: cls("cpu", backoff_factor=1.0),
    "new_scale_bad_numel": lambda cls: [(s.step(o), s.update(torch.ones(2)))
                                        for _, o, s in [setup_iter(cls)]],
    "new_scale_requires_grad": lambda cls: [
        (s.step(o), s.update(torch.ones((), requires_grad=True))) for _, o, s in [setup_iter(cls)]],
    "new_scale_int": lambda cls: [(s.step(o), s.update(3)) for _, o, s in [setup_iter(cls)]],
    "scale_non_tensor": lambda cls: cls("cpu").scale([torch.ones(2), 3]),
}


@pytest.mark.parametrize("name", list(MISUSE))
def test_misuse_raises_like_torch(name):
    assert_same_exception(MISUSE[name])


def test_fp16_grads_allowed_for_fused_inf_check():
    """The fused path checks fp16 grads (allow_fp16=True) without raising, as torch does."""
    for cls in (torch.amp.GradScaler, mpext.GradScaler):
        model = torch.nn.Linear(3, 3)
        opt = torch.optim.Adam(model.parameters(), fused=True)
        s = cls("cpu")
        s.scale(model(torch.ones(2, 3)).sum()).backward()
        found = s._check_inf_per_device(opt)
        assert [v.item() for v in found.values()] == [0.0]


def test_disabled_scaler_is_a_passthrough():
    s = mpext.GradScaler("cpu", enabled=False)
    x = torch.ones(3)
    assert s.scale(x) is x
    assert s.get_scale() == 1.0 and s.state_dict() == {} and not s.is_enabled()
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    s.unscale_(opt)
    s.step(opt)
    s.update()
    s.load_state_dict({})
    assert s.last_step_skipped().item() is False
    assert s.skipped_steps().item() == 0 and s.get_skipped_steps() == 0


# --------------------------------------------------------------------------------------------
# Drop-in details: the API surface, the legacy torch.cuda.amp signature, subclassing.


def test_same_api_and_defaults():
    import inspect
    ours = inspect.signature(mpext.GradScaler.__init__).parameters
    theirs = inspect.signature(torch.amp.GradScaler.__init__).parameters
    for name, p in theirs.items():
        assert name in ours
        assert ours[name].default == p.default and ours[name].kind == p.kind, name
    assert list(ours)[:len(theirs)] == list(theirs)
    assert all(ours[n].kind is inspect.Parameter.KEYWORD_ONLY for n in list(ours)[len(theirs):])
    for name in ("scale", "unscale_", "step", "update", "get_scale", "get_growth_factor",
                 "set_growth_factor", "get_backoff_factor", "set_backoff_factor",
                 "get_growth_interval", "set_growth_interval", "is_enabled", "state_dict",
                 "load_state_dict", "__getstate__", "__setstate__"):
        assert callable(getattr(mpext.GradScaler, name))
    s = mpext.GradScaler("cpu")
    assert isinstance(s, torch.amp.GradScaler)
    assert s.state_dict() == torch.amp.GradScaler("cpu").state_dict()
    assert sd_types(s.state_dict()) == sd_types(torch.amp.GradScaler("cpu").state_dict())
    s.set_growth_factor(3.0)
    s.set_backoff_factor(0.25)
    s.set_growth_interval(17)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == \
        (3.0, 0.25, 17)


def test_scale_nested_outputs_like_torch():
    outs = [torch.ones(2), (torch.full((3,), 2.0), [torch.ones(1)])]
    t = torch.amp.GradScaler("cpu", init_scale=4.0).scale(outs)
    m = mpext.GradScaler("cpu", init_scale=4.0).scale(outs)
    assert type(m) is type(t) and type(m[1]) is type(t[1]) and type(m[1][1]) is type(t[1][1])
    assert torch.equal(m[0], t[0]) and torch.equal(m[1][0], t[1][0])
    assert torch.equal(m[1][1][0], t[1][1][0])


@pytest.mark.parametrize("args,kwargs", [
    ((), {}), ((1024.0,), {}), ((1024.0, 3.0), {}), ((1024.0, 3.0, 0.25, 7), {}),
    ((1024.0, 3.0, 0.25, 7, False), {}), ((1024.0,), {"backoff_factor": 0.125}),
    ((), {"init_scale": 8.0, "growth_interval": 5}), ((2 ** 10,), {}),
])
def test_legacy_cuda_amp_signature(monkeypatch, args, kwargs):
    """torch.cuda.amp.GradScaler(init_scale, growth_factor, backoff_factor, growth_interval,
    enabled) users switch by changing the name: the same arguments mean the same thing."""
    monkeypatch.setattr(torch.cuda.amp.common, "amp_definitely_not_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        legacy = torch.cuda.amp.GradScaler(*args, **kwargs)
    ours = mpext.GradScaler(*args, **kwargs)
    assert ours._device == legacy._device == "cuda"
    assert ours.is_enabled() == legacy.is_enabled()
    if legacy.is_enabled():
        for attr in ("_init_scale", "_growth_factor", "_backoff_factor", "_growth_interval"):
            assert getattr(ours, attr) == getattr(legacy, attr), attr
            assert type(getattr(ours, attr)) is type(getattr(legacy, attr)), attr


def test_cuda_default_without_cuda_disables_like_torch():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.warns(UserWarning, match="CUDA is not available.  Disabling.") as rec:
        s = mpext.GradScaler()
    assert not s.is_enabled()
    assert rec[0].filename == __file__  # points at the caller


# --------------------------------------------------------------------------------------------
# One fused mpext call per device; host syncs.


def test_one_unscale_call_per_device_for_mixed_dtypes(monkeypatch):
    calls, torch_calls = [], []
    real_ours, real_theirs = ops.unscale_, torch._amp_foreach_non_finite_check_and_unscale_
    monkeypatch.setattr(ops, "unscale_", lambda g, f, i: (calls.append([x.dtype for x in g]),
                                                          real_ours(g, f, i))[1])
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_",
                        lambda g, f, i: (torch_calls.append(len(g)), real_theirs(g, f, i))[1])
    model = Net(half_dtype=torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = mpext.GradScaler("cpu")
    idx, y = batch(0, 0, "cpu")
    s.scale(F.mse_loss(model(idx).float(), y)).backward()
    s.step(opt)
    s.update()
    assert len(calls) == 1 and torch_calls == []
    assert set(calls[0]) == {torch.float32, torch.bfloat16} and len(calls[0]) == 7
    # float64 grads are not mpext's: they go to torch's op, the rest still in one call.
    calls.clear()
    model.head.double()
    model.head.weight.grad = torch.ones_like(model.head.weight)
    model.head.bias.grad = torch.ones_like(model.head.bias)
    s.scale(torch.ones(()))
    s.unscale_(opt)
    assert len(calls) == 1 and len(calls[0]) == 5 and torch_calls == [2]


def test_host_syncs(device):
    """0 host reads per step with an optimizer that takes grad_scale/found_inf (fused Adam,
    AdamW, SGD), exactly 1 with a plain one (to decide the skip), as torch; the extensions add
    none."""
    def reads_per_step(cls, make_opt, **kw):
        torch.manual_seed(0)
        model = torch.nn.Linear(5, 5).to(device)
        opt = make_opt(model.parameters())
        s = cls(device, growth_interval=2, **kw)
        counts = []
        for step in range(6):
            opt.zero_grad()
            loss = model(torch.randn(3, 5, device=device)).sum()
            s.scale(loss * (INF if step == 3 else 1.0)).backward()
            reads = HostReads()
            with reads.counting():
                s.step(opt)
                s.update()
            counts.append(reads.count)
        return counts

    fused = [lambda p: torch.optim.Adam(p, fused=True), lambda p: torch.optim.AdamW(p, fused=True),
             lambda p: torch.optim.SGD(p, lr=0.1, fused=True)]
    extras = dict(hysteresis=2, min_scale=1.0, max_scale=2.0 ** 20)
    for make in fused:
        assert reads_per_step(torch.amp.GradScaler, make) == [0] * 6
        assert reads_per_step(mpext.GradScaler, make) == [0] * 6
        assert reads_per_step(mpext.GradScaler, make, **extras) == [0] * 6
    plain = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    assert reads_per_step(torch.amp.GradScaler, plain) == [1] * 6
    assert reads_per_step(mpext.GradScaler, plain) == [1] * 6
    assert reads_per_step(mpext.GradScaler, plain, **extras) == [1] * 6


@pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA device and a CUDA build of mpext")
def test_no_cuda_sync_with_fused_optimizer():
    """The real check on a GPU: with sync debug mode on, a fused-Adam step + update makes no
    synchronising call at all (the extensions and the overflow watch included)."""
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    s = mpext.GradScaler("cuda", hysteresis=2, min_scale=1.0, max_scale=2.0 ** 24)
    for step in range(8):
        opt.zero_grad()
        loss = model(torch.randn(8, 64, device="cuda")).sum()
        s.scale(loss * (INF if step in (2, 3) else 1.0)).backward()
        torch.cuda.set_sync_debug_mode("error")
        try:
            s.step(opt)
            s.update()
            s.last_step_skipped()
            s.skipped_steps()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert s.get_skipped_steps() == 2


# --------------------------------------------------------------------------------------------
# The extensions against the pure-Python model.


def drive(scaler, found_seq, device="cpu", two_opts=False, report=True):
    """Runs iterations whose gradients are clean or not as found_seq says, returning after each
    (scale, tracker, skipped count, overflow streak, skipped after step(), skipped after
    update()); only (scale, tracker) with report=False (for torch's scaler)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(device)
    opts = [torch.optim.SGD([model.weight], lr=1e-3), torch.optim.SGD([model.bias], lr=1e-3)] \
        if two_opts else [torch.optim.SGD(model.parameters(), lr=1e-3)]
    out = []
    for bad in found_seq:
        for o in opts:
            o.zero_grad()
        loss = model(torch.ones(3, 4, device=device)).sum()
        scaler.scale(loss).backward()
        if bad:
            model.weight.grad[0, 0] = NAN if bad == "nan" else INF
        for o in opts:
            scaler.step(o)
        if not report:
            scaler.update()
            out.append((scaler.get_scale(), scaler._get_growth_tracker()))
            continue
        step_skipped = scaler.last_step_skipped().item()
        scaler.update()
        out.append((scaler.get_scale(), scaler._get_growth_tracker(), scaler.get_skipped_steps(),
                    scaler._consecutive_overflows(), step_skipped,
                    scaler.last_step_skipped().item()))
    return out


def model_trace(model, found_seq):
    out = []
    for bad in found_seq:
        model.step(bool(bad))
        out.append((model.scale, model.tracker, model.skipped, model.streak, bool(bad),
                    bool(bad)))
    return out


SEQ = [0, "inf", "inf", 0, 0, "nan", "inf", "inf", "inf", 0, 0, 0, 0, 0, 0, "inf", 0, "nan",
       "nan", "nan", "nan", "nan", 0, 0, 0, 0, 0, 0, 0]


@pytest.mark.filterwarnings("ignore:mpext.GradScaler:RuntimeWarning")
@pytest.mark.parametrize("options", [
    dict(), dict(hysteresis=2), dict(hysteresis=4), dict(min_scale=256.0),
    dict(max_scale=2.0 ** 17), dict(hysteresis=3, min_scale=1024.0, max_scale=2.0 ** 16),
])
@pytest.mark.parametrize("growth_interval", [1, 3])
def test_options_follow_model(device, options, growth_interval):
    scaler = mpext.GradScaler(device, init_scale=4096.0, growth_interval=growth_interval,
                              warn_consecutive_overflows=None, **options)
    got = drive(scaler, SEQ, device)
    want = model_trace(ScaleRuleModel(4096.0, growth_interval=growth_interval, **options), SEQ)
    assert got == want
    if not options:  # the defaults are torch's rule: torch's scaler gives the same trace
        theirs = torch.amp.GradScaler(device, init_scale=4096.0, growth_interval=growth_interval)
        assert drive(theirs, SEQ, device, report=False) == [row[:2] for row in got]


def test_hysteresis_still_skips_every_overflowing_step():
    scaler = mpext.GradScaler("cpu", init_scale=64.0, growth_interval=100, hysteresis=3)
    rows = drive(scaler, [0, "inf", "inf", "inf", 0], "cpu")
    assert [r[0] for r in rows] == [64.0, 64.0, 64.0, 32.0, 32.0]
    assert [r[4] for r in rows] == [False, True, True, True, False]
    assert scaler.get_skipped_steps() == 3


def test_skip_reporting_with_two_optimizers():
    scaler = mpext.GradScaler("cpu", init_scale=64.0, growth_interval=2)
    rows = drive(scaler, [0, "inf", 0, "nan", "nan"], "cpu", two_opts=True)
    assert [r[2] for r in rows] == [0, 1, 1, 2, 3]
    assert [r[3] for r in rows] == [0, 1, 0, 1, 2]
    assert scaler.skipped_steps().dtype == torch.int64 and scaler.skipped_steps().item() == 3
    assert scaler.last_step_skipped().dtype == torch.bool


def test_skip_reporting_tensors_stay_on_device_and_are_snapshots():
    s = mpext.GradScaler("cpu")
    drive(s, [0, "inf"])
    count = s.skipped_steps()
    assert count.device.type == "cpu" and count.shape == () and count.item() == 1
    drive(s, ["inf"])
    assert count.item() == 1 and s.skipped_steps().item() == 2


def test_extra_state_dict_keys_only_when_used():
    plain = mpext.GradScaler("cpu")
    drive(plain, [0, "inf"])
    assert set(plain.state_dict()) == set(torch.amp.GradScaler("cpu").state_dict())
    s = mpext.GradScaler("cpu", init_scale=1024.0, growth_interval=2, hysteresis=3,
                         min_scale=16.0, max_scale=2.0 ** 20)
    drive(s, [0, "inf", "inf", 0, "inf"])
    sd = s.state_dict()
    assert sd == {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                  "growth_interval": 2, "_growth_tracker": 0, "hysteresis": 3,
                  "_hysteresis_tracker": 2, "min_scale": 16.0, "max_scale": 2.0 ** 20,
                  "_skipped_steps": 3, "_consecutive_overflows": 1}
    # mpext -> mpext restores the extra state; the runs then continue identically.
    a = mpext.GradScaler("cpu")
    a.load_state_dict(sd)
    assert a.state_dict() == sd
    seq = ["inf", "inf", 0, 0, "inf", 0]
    assert drive(a, seq) == drive(s, seq)
    # mpext (with extras) -> torch: torch takes its five keys.
    t = torch.amp.GradScaler("cpu")
    t.load_state_dict(sd)
    assert t.state_dict() == {k: sd[k] for k in t.state_dict()}
    # torch -> mpext with options: the options stay, the counters start afresh.
    b = mpext.GradScaler("cpu", hysteresis=2)
    b.load_state_dict(t.state_dict())
    sd_b = b.state_dict()
    assert sd_b["hysteresis"] == 2 and sd_b["_hysteresis_tracker"] == 2
    assert sd_b["_skipped_steps"] == 0 and sd_b["scale"] == t.get_scale()


def test_extras_survive_pickling():
    s = mpext.GradScaler("cpu", init_scale=1024.0, hysteresis=3, min_scale=16.0)
    drive(s, [0, "inf", "inf"])
    s2 = pickle.loads(pickle.dumps(s))
    assert s2.state_dict() == s.state_dict()
    seq = ["inf", 0, "inf", "inf", "inf"]
    assert drive(s2, seq) == drive(s, seq)


# --------------------------------------------------------------------------------------------
# The overflow warning.


def test_warns_once_after_consecutive_overflows():
    s = mpext.GradScaler("cpu", init_scale=2.0 ** 16, warn_consecutive_overflows=5)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        drive(s, ["nan"] * 4)
        assert not rec
        drive(s, ["nan"])
        assert len(rec) == 1 and issubclass(rec[0].category, RuntimeWarning)
        assert "5 consecutive steps had inf/NaN gradients" in str(rec[0].message)
        drive(s, ["nan"] * 10 + [0] + ["nan"] * 10)
        assert len(rec) == 1  # once


def test_no_warning_for_interrupted_overflows_or_when_disabled():
    s = mpext.GradScaler("cpu", warn_consecutive_overflows=3)
    off = mpext.GradScaler("cpu", warn_consecutive_overflows=None)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        drive(s, ["inf", "inf", 0] * 5)
        drive(off, ["inf"] * 30)
    assert not rec


def test_warns_when_overflowing_at_min_scale():
    s = mpext.GradScaler("cpu", init_scale=8.0, min_scale=2.0, warn_consecutive_overflows=None)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        drive(s, ["inf", "inf"])  # 8 -> 4 -> 2: reached the floor, no warning yet
        assert not rec and s.get_scale() == 2.0
        drive(s, [0, "inf"])  # an overflow while sitting at min_scale
        assert len(rec) == 1 and "min_scale=2" in str(rec[0].message)
        drive(s, ["inf"] * 3)
        assert len(rec) == 1


def test_overflow_watch_reads_a_stale_snapshot_without_syncing():
    """The watch works from a host copy made by update(): on CPU it reads it at once; the
    reads go through host memory, never Tensor.item and friends."""
    s = mpext.GradScaler("cpu", warn_consecutive_overflows=2)
    reads = HostReads()
    with warnings.catch_warnings(record=True) as rec, reads.counting():
        warnings.simplefilter("always")
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.Adam(model.parameters(), fused=True)
        for _ in range(3):
            opt.zero_grad()
            s.scale(model(torch.ones(1, 2)).sum() * NAN).backward()
            s.step(opt)
            s.update()
    assert reads.count == 0 and len(rec) == 1


# --------------------------------------------------------------------------------------------
# bf16_check_only: no loss scaling, unscale is a read-only check.


def test_bf16_check_only():
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    s = mpext.GradScaler("cpu", init_scale=2.0 ** 16, bf16_check_only=True)
    assert s.get_scale() == 1.0
    for step in range(6):
        idx, y = batch(step, 0, "cpu")
        opt.zero_grad()
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(model(idx).float(), y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_loss = F.mse_loss(ref(idx).float(), y)
        scaled = s.scale(loss)
        assert torch.equal(scaled, loss)
        scaled.backward()
        ref_loss.backward()
        if step == 3:
            model.fc1.weight.grad[0, 0] = NAN
        before = [bits(p.grad) for p in model.parameters()]
        ptrs = [p.grad.data_ptr() for p in model.parameters()]
        s.unscale_(opt)
        # A read-only check: the gradients' memory is untouched (NaN payload included).
        for p, b, ptr in zip(model.parameters(), before, ptrs):
            assert torch.equal(bits(p.grad), b) and p.grad.data_ptr() == ptr
        s.step(opt)
        s.update()
        if step != 3:
            ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_bitwise(p, q, "step %d" % step)
        assert s.get_scale() == 1.0
    assert s.get_skipped_steps() == 1
    sd = s.state_dict()
    assert sd["scale"] == 1.0 and sd["_skipped_steps"] == 1
    # A checkpoint with a big scale does not turn scaling back on.
    s.load_state_dict(torch.amp.GradScaler("cpu").state_dict())
    assert s.get_scale() == 1.0


def test_bf16_check_only_rejects_fp16_grads():
    model = torch.nn.Linear(2, 2).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = mpext.GradScaler("cpu", bf16_check_only=True)
    s.scale(model(torch.ones(1, 2).half()).float().sum()).backward()
    with pytest.raises(ValueError, match="bf16_check_only"):
        s._check_inf_per_device(opt)


# ---- Released steps: the public hooks gradient release uses (mpext.optim's release_grads) ----

def test_record_released_step_is_a_step_for_update(device):
    """A step recorded by record_released_step counts for update() exactly as a step through
    scaler.step() does in torch.amp.GradScaler: same scale and growth tracker after each
    iteration (an overflow backs off, clean ones grow it), and the skip flag and counter."""
    p = torch.zeros(4, device=device, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    ref_p = torch.zeros(4, device=device, requires_grad=True)
    ref_opt = torch.optim.SGD([ref_p], lr=0.1)
    kw = dict(init_scale=2.0 ** 10, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
    s = mpext.GradScaler(device, **kw)
    ref = torch.amp.GradScaler(device, **kw)
    skipped = 0
    for it, overflow in enumerate([False, False, True, False, False, True, True, False]):
        s.scale(torch.ones((), device=device))
        ref.scale(torch.ones((), device=device))
        ref_p.grad = torch.full((4,), float("inf") if overflow else 1.0, device=device)
        ref.step(ref_opt)
        found = torch.full((), float(overflow), device=device)
        s.record_released_step(opt, found)
        assert bool(s.last_step_skipped(opt)) is overflow, it
        s.update()
        ref.update()
        skipped += overflow
        assert s.get_scale() == ref.get_scale(), it
        assert int(s._growth_tracker) == int(ref._growth_tracker), it
        assert bool(s.last_step_skipped()) is overflow, it
        assert s.get_skipped_steps() == skipped, it


def test_release_scale(device):
    """release_scale: the scaler's own scale tensor (what the release unscales by) once
    scale() was called; a refusal naming the caller before; 1 for bf16_check_only."""
    s = mpext.GradScaler(device, init_scale=2.0 ** 5)
    assert s.bf16_check_only is False
    with pytest.raises(RuntimeError, match="my_release: the release's mpext.GradScaler has no "
                                           "scale yet"):
        s.release_scale(device, "my_release")
    assert s._scale is None  # nothing made by the refusal
    s.scale(torch.ones((), device=device))
    t = s.release_scale(torch.device(device))
    assert t is s._scale and t.item() == 2.0 ** 5
    b = mpext.GradScaler(device, init_scale=2.0 ** 5, bf16_check_only=True)
    assert b.bf16_check_only is True
    t = b.release_scale(device)
    assert t is b._scale and t.item() == 1.0 and t.device.type == device
    with pytest.raises(AttributeError):
        b.bf16_check_only = False


def test_released_step_bad_inputs_change_nothing():
    s = mpext.GradScaler("cpu")
    s.scale(torch.ones(()))
    opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    for args, match in (((object(), torch.zeros(())),
                         "optimizer must be a torch.optim.Optimizer"),
                        ((opt, 0.0), "found_inf must be a one-element tensor, got float"),
                        ((opt, torch.zeros(2)), r"found_inf must be a one-element tensor, got a "
                                                r"tensor of shape \[2\]")):
        with pytest.raises(TypeError, match=match):
            s.record_released_step(*args)
        assert s._stepped_since_update == [] and s._stepped_states == {}
        assert all(st["stage"] is not torch.amp.grad_scaler.OptState.STEPPED
                   for st in s._per_optimizer_states.values())
    b = mpext.GradScaler("cpu", bf16_check_only=True)
    with pytest.raises(TypeError, match="device must be a torch.device or a device string"):
        b.release_scale("no-such-device")
    assert b._scale is None
    with pytest.raises(TypeError, match="where must be a str"):
        b.release_scale("cpu", 3)
    assert b._scale is None
    # A disabled scaler records nothing, as its step() records nothing.
    d = mpext.GradScaler("cpu", enabled=False)
    d.record_released_step(opt, torch.ones(()))
    assert d._stepped_since_update == []
