"""Precision telemetry, the optimizer-step half (issue 46): the step kernels' counters
(``stats`` of the step ops, ``mpext.telemetry.attach(..., optimizer=)``).

The counts are checked exactly on every ISA path and storage mode by tests/c/test_step_telemetry.c;
here, through the optimizers and the flat dict, against a float64 reference computed from the
same tensors: the state before and after one step from fresh state, and the fp32 values the
step rounded, taken from the same rule run on FP32 state (identical up to the rounding the
counters count: the first step from zero moments reads the same values whatever the format).
"""
import pytest
import torch

import mpext
from mpext.optim import formats as F
from mpext.telemetry._step import STEP_COLUMNS

from conftest import HostReads
from optim_table import FORMATS, clone_params, covering_pairs, fp32_value, pairs
from optim_table import make_grads, moment_value, pair_id, set_grads, snapshot, assert_same
from test_telemetry import SyncCounter

# the second quantized with 8-bit moments (at least MIN_8BIT_NUMEL), its last block short
SHAPES = ((37, 5), (F.MIN_8BIT_NUMEL + 300,))

# round to nearest without masters warns at construction: here it is what is measured
pytestmark = pytest.mark.filterwarnings("ignore:.*master_weights=False without stochastic")


@pytest.fixture(autouse=True)
def _detach_sources():
    """Every test's telemetries stop counting when it ends (the engine's list is global)."""
    from mpext.optim import _engine
    before = list(_engine.STATS_SOURCES)
    yield
    # (not `before` itself: a source that left the list meanwhile, its telemetry freed, stays out)
    _engine.STATS_SOURCES[:] = [s for s in _engine.STATS_SOURCES if s in before]


def test_dropped_telemetry_frees_its_optimizer():
    """The engine holds a telemetry's source weakly: a Telemetry and optimizer dropped without
    detach() are freed, and the source leaves the list at the next launch."""
    import gc
    import weakref
    from mpext.optim import _engine
    params = _params(torch.bfloat16, "cpu")
    opt = mpext.optim.AdamW(params, lr=1e-3, master_weights=False, stochastic_rounding=True)
    tel = mpext.telemetry.attach(None, optimizer=opt, step_every=1)
    source = tel._step._source  # (the engine's entry: it holds the telemetry weakly)
    assert source in _engine.STATS_SOURCES
    alive = weakref.ref(opt)
    del opt, tel
    gc.collect()
    assert alive() is None
    other = mpext.optim.AdamW(params, lr=1e-3, master_weights=False, stochastic_rounding=True)
    set_grads(params, _grads(params))
    other.step()
    # (by identity, not the list's length: sources freed before this test leave it too)
    assert source not in _engine.STATS_SOURCES


def test_a_freed_telemetry_hides_no_other_launch(device):
    """A telemetry freed without detach() leaves the engine's list at the next launch; the
    telemetry after it in the list still counts that launch (the full suite's gw0 failures: a
    Trainer test's telemetry freed before this file made every test's first step uncounted)."""
    import gc
    params = _params(torch.bfloat16, device)
    numel = sum(p.numel() for p in params)
    old = mpext.optim.AdamW(_params(torch.bfloat16, device, seed=3), lr=1e-3,
                            master_weights=False, stochastic_rounding=True)
    mpext.telemetry.attach(None, optimizer=old, step_every=1)
    del old
    gc.collect()  # (the optimizer and its telemetry hold each other)
    opt = mpext.optim.AdamW(params, lr=1e-3, master_weights=False, stochastic_rounding=True)
    tel = mpext.telemetry.attach(None, optimizer=opt, step_every=1)
    set_grads(params, _grads(params))
    opt.step()
    r = tel.read()
    assert r["update/elements"] == numel and r["telemetry/counted_steps"] == 1
    tel.detach()


def test_another_optimizers_telemetry_takes_no_launch(device):
    """Two optimizers over the same params, each with a telemetry (a Trainer's optimizer made
    anew while the old one's telemetry is alive): each step is counted by its optimizer's
    telemetry only, whichever was attached first."""
    params = _params(torch.bfloat16, device)
    numel = sum(p.numel() for p in params)
    kw = dict(lr=1e-3, master_weights=False, stochastic_rounding=True)
    first = mpext.optim.AdamW(params, **kw)
    second = mpext.optim.AdamW(params, **kw)
    tel1 = mpext.telemetry.attach(None, optimizer=first, step_every=1)
    tel2 = mpext.telemetry.attach(None, optimizer=second, step_every=1)
    opts = dict(first=first, second=second)
    for steps in (("second",), ("first", "second", "second")):
        for name in steps:
            set_grads(params, _grads(params, seed=len(steps)))
            opts[name].step()
        r1, r2 = tel1.read(), tel2.read()
        assert r1["update/elements"] == steps.count("first") * numel, steps
        assert r2["update/elements"] == steps.count("second") * numel, steps
    tel1.detach()
    tel2.detach()


def _params(dtype, device, seed=0, rule=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in SHAPES if rule is None else rule.fit_shapes(SHAPES):
        # magnitudes from 2^-3 to 2^3: updates of lr 1e-2..1e-4 fall on both sides of half an ulp
        x = torch.rand(shape, generator=g) + 1.0
        x = x * torch.exp2(torch.randint(-3, 4, shape, generator=g).float())
        x = x * (torch.randint(0, 2, shape, generator=g) * 2 - 1)
        out.append(torch.nn.Parameter(x.to(device=device, dtype=dtype)))
    return out


def _grads(params, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in params:
        x = torch.randn(p.shape, generator=g) * 0.1
        x[torch.rand(p.shape, generator=g) < 0.05] = 0.0
        out.append(x.to(device=p.device, dtype=p.dtype))
    return out


def _half_ulp(bits16: torch.Tensor, dtype) -> torch.Tensor:
    """Half an ulp of each stored 16-bit value (its exponent's spacing; a subnormal's is the
    smallest normal's), in float64."""
    b = bits16.to(torch.int32) & 0xFFFF
    if dtype is torch.bfloat16:
        e = ((b >> 7) & 0xFF).clamp(min=1)
        return torch.exp2((e - 127 - 8).double())
    e = ((b >> 10) & 0x1F).clamp(min=1)
    return torch.exp2((e - 15 - 11).double())


def _ratio(a, b):
    return float(a) / float(b) if b else 0.0


def _reference(rule, fmt, params, grads, opt, before, kw):
    """The dict's step keys for one step from fresh state, computed in float64 from the
    tensors: ``before`` the params' bits and fp32 values before the step, the reference run
    (the rule on FP32 params and moments from the same values) for the values rounded."""
    ref_params = [torch.nn.Parameter(v.clone()) for _, v in before]
    ref = rule.make(ref_params, **dict(kw, **FORMATS["fp32"].kwargs_for(rule)))
    for rp, g in zip(ref_params, grads):
        rp.grad = g.float()
    ref.step()
    sums = {}

    def add(key, vals):
        acc = sums.setdefault(key, [0.0, 0.0])
        acc[0] += float(vals[0])
        acc[1] += float(vals[1])

    for p, rp, (bits0, old) in zip(params, ref_params, before):
        kind = fmt.param_format
        if p.dtype is not torch.float32:
            # x: the master as stored, or the fp32 result before rounding (master-free)
            x = fp32_value(opt, p) if kind in ("master", "remainder") else rp.detach()
            bits1 = p.detach().view(torch.int16)
            changed = x != old
            unmoved = changed & (bits1 == bits0)
            add("changed_unmoved/" + kind, (changed.sum(), unmoved.sum()))
            if kind in ("nearest", "stochastic"):
                sub = changed & ((x.double() - old.double()).abs() < _half_ulp(bits0, p.dtype))
                add("changed_subhalf/" + kind, (changed.sum(), sub.sum()))
        else:
            x = p.detach()
        for q in rule.moments:
            held = F.moment_of(opt.state[p], q.name)[0].dtype  # (a small param keeps fp32)
            if held is torch.float32:
                continue
            xm = ref.state[rp][q.name].double()
            stored = moment_value(opt, p, q).double()
            tag = "bf16" if held is torch.bfloat16 else "q8"
            sq = "_sq" if q.name == "exp_avg_sq" else ""
            add("%s%s" % (tag, sq), ((stored - xm).abs().sum(), xm.abs().sum()))
        if "ema_param" in opt.state[p]:
            add("ema", ((opt.state[p]["ema_param"].double() - x.double()).abs().sum(),
                        x.double().abs().sum()))
    want = {}
    for key, (a, b) in sums.items():
        if key == "changed_unmoved/nearest":
            want["update/lost_frac"] = _ratio(b, a)
        elif key == "changed_unmoved/stochastic":
            want["update/sr_unmoved_frac"] = _ratio(b, a)
        elif key == "changed_subhalf/stochastic":
            want["update/sr_expectation_frac"] = _ratio(b, a)
        elif key.startswith("changed_unmoved/"):
            want["update/unchanged_under_master_frac"] = _ratio(b, a)
        elif key in ("bf16", "bf16_sq"):
            want["state/bf16_moment%s_rel_error" % key[4:]] = _ratio(a, b)
        elif key in ("q8", "q8_sq"):
            want["state/q8%s_rel_error" % key[2:]] = _ratio(a, b)
        elif key == "ema":
            want["ema/lag_rel"] = _ratio(a, b)
    return want


def _step_pairs():
    """Every rule with every param format, the moment formats in turn, and every moment
    format at least once per rule keeping one (the cheap covering subset of the table)."""
    for rule, fmt in covering_pairs():
        yield rule, fmt


@pytest.mark.parametrize("pair", list(_step_pairs()), ids=pair_id)
def test_step_counts_equal_reference(device, pair):
    """One step from fresh state with telemetry on: the dict's update/state/ema fractions are
    those of a float64 reference on the same tensors (counts exact: the fractions equal; the
    error sums to 1e-12, the same terms added in another order)."""
    rule, fmt = pair
    dtype = fmt.param_dtypes[-1] if torch.float16 in fmt.param_dtypes and \
        fmt.param_format == "nearest" else fmt.param_dtypes[0]
    params = _params(dtype, device, rule=rule)
    grads = _grads(params)
    kw = dict(lr=3e-3)
    if fmt.keeps_value or fmt.lossy_params:
        kw["ema_decay"] = 0.9
    opt = rule.make(params, **dict(kw, **fmt.kwargs_for(rule)))
    tel = mpext.telemetry.attach(None, optimizer=opt, every=1)  # (one step: it is counted)
    before = [(p.detach().view(torch.int16).clone() if p.dtype is not torch.float32 else None,
               p.detach().float().clone()) for p in params]
    set_grads(params, grads)
    opt.step()
    got = tel.read()
    want = _reference(rule, fmt, params, grads, opt, before, kw)
    assert want, "the pair counts nothing: the test could not fail"
    for key, value in want.items():
        assert key in got, (key, sorted(got))
        assert got[key] == pytest.approx(value, rel=1e-12, abs=0.0), key
    numel = sum(p.numel() for p in params)
    if dtype is not torch.float32:
        assert got["update/elements"] == numel
    assert got["telemetry/optimizer_steps"] == 1 and got["telemetry/uncounted_launches"] == 0
    tel.detach()


@pytest.mark.parametrize("rule,fmt", list(pairs()), ids=lambda x: repr(x))
def test_step_telemetry_on_off_same_bits(device, rule, fmt):
    """The whole rules x formats table: three steps with the step's counters on and off give
    the same bits in every param and state tensor (the counted pipeline writes what the
    uncounted kernels, fast paths included, write)."""
    dtype = fmt.param_dtypes[0]
    runs = []
    for on in (False, True):
        params = _params(dtype, device, rule=rule)
        kw = dict(lr=1e-3)
        if fmt.keeps_value or fmt.lossy_params:
            kw["ema_decay"] = 0.99
        opt = rule.make(params, **dict(kw, **fmt.kwargs_for(rule)))
        tel = mpext.telemetry.attach(None, optimizer=opt, every=2, step_every=1) \
            if on else None
        for k in range(3):
            set_grads(params, _grads(params, seed=10 + k))
            opt.step()
            if tel is not None:
                tel.poll()
        runs.append(snapshot(opt, params))
        if tel is not None:
            assert tel._step.tensors(), "nothing was counted"
            tel.detach()
    assert_same(runs[0], runs[1], "telemetry on vs off")


def test_step_counters_accumulate_and_reset(device):
    """Counters add up over the window's steps and restart at each read; a skipped step
    (found_inf) counts nothing."""
    params = _params(torch.bfloat16, device)
    opt = mpext.optim.AdamW(params, lr=1e-3, master_weights=False, stochastic_rounding=True)
    tel = mpext.telemetry.attach(None, optimizer=opt, every=2, step_every=1)
    numel = sum(p.numel() for p in params)
    for k in range(2):
        set_grads(params, _grads(params, seed=k))
        opt.step()
    set_grads(params, _grads(params, seed=9))
    opt.step(found_inf=torch.ones((), device=device))  # skipped: nothing counted
    r = tel.read()
    assert r["update/elements"] == 2 * numel and r["telemetry/optimizer_steps"] == 3
    assert r["telemetry/counted_steps"] == 3
    assert 0.0 < r["update/sr_expectation_frac"] <= 1.0
    r = tel.read()
    assert r["update/elements"] == 0 and r["telemetry/steps"] == 0


def test_step_counters_sample_one_step_in_step_every(device):
    """By default one step per window is counted (the first of each ``every``); step_every=k
    counts steps 0, k, 2k, ... (the others run the uncounted kernels)."""
    numel = sum(s[0] * (s[1] if len(s) > 1 else 1) for s in SHAPES)
    for kw, steps, counted in ((dict(every=4), 8, 1), (dict(every=8, step_every=3), 8, 3)):
        params = _params(torch.bfloat16, device)
        opt = mpext.optim.AdamW(params, lr=1e-3, master_weights=False)
        tel = mpext.telemetry.attach(None, optimizer=opt, **kw)
        r = None
        for k in range(steps):
            set_grads(params, _grads(params, seed=k))
            opt.step()
            r = tel.poll() or r
        assert r["update/elements"] == counted * numel, kw
        assert r["telemetry/counted_steps"] == counted and r["telemetry/steps"] == kw["every"]
    with pytest.raises(ValueError, match="step_every must be an int >= 1"):
        mpext.telemetry.attach(None, optimizer=opt, step_every=0)


def test_step_lost_updates_at_small_lr(device):
    """The issue's case: bf16 params without masters, round to nearest, a small lr: most
    updates are lost (each is below half an ulp of its param), and the count says which
    fraction; the same run with a master loses none of the master's moves, and keeps most of
    the bf16 params unchanged (the master carries them)."""
    got = {}
    for name, kw in (("rne", dict(master_weights=False)), ("master", {})):
        params = _params(torch.bfloat16, device)
        opt = mpext.optim.AdamW(params, lr=1e-4, **kw)
        tel = mpext.telemetry.attach(None, optimizer=opt, every=3, step_every=1)
        for k in range(3):
            set_grads(params, _grads(params, seed=k))
            opt.step()
        got[name] = tel.poll()
    # lr 1e-4 against half-ulps of 2^-9..2^-3 (params of 2^-3..2^3): every Adam update
    # (|update| <= ~lr) is below half an ulp
    assert got["rne"]["update/lost_frac"] == 1.0
    assert got["master"]["update/unchanged_under_master_frac"] > 0.9


def test_muon_counts_both_phases(device):
    """Muon: phase 1 (momentum, bf16 buffers) counts the buffers' rounding error, phase 3 (the
    update into master-free params) the lost updates; each against the fp32 run."""
    torch.manual_seed(0)
    p = torch.nn.Parameter((torch.randn(64, 32) * 4).bfloat16().to(device))
    ref_p = torch.nn.Parameter(p.detach().float().clone())
    g = (torch.randn(64, 32) * 0.1).bfloat16().to(device)
    opt = mpext.optim.Muon([p], lr=2e-3, momentum_dtype=torch.bfloat16, master_weights=False)
    ref = mpext.optim.Muon([ref_p], lr=2e-3)
    tel = mpext.telemetry.attach(None, optimizer=opt, every=1)
    p.grad, ref_p.grad = g, g.float()
    opt.step()
    ref.step()
    r = tel.read()
    buf = opt.state[p]["momentum_buffer"].double()
    xm = ref.state[ref_p]["momentum_buffer"].double()
    assert r["state/bf16_moment_rel_error"] == pytest.approx(
        float((buf - xm).abs().sum() / xm.abs().sum()), rel=1e-12)
    assert 0.0 < r["update/lost_frac"] < 1.0
    assert r["telemetry/uncounted_launches"] == 0


def test_step_telemetry_no_host_sync_between_reads(device):
    """Between reads the step's counters add no host read (ops or Python-level); the read is
    one host transfer."""
    params = _params(torch.bfloat16, device)
    opt = mpext.optim.AdamW(params, lr=1e-3, master_weights=False, stochastic_rounding=True,
                            exp_avg_dtype=torch.bfloat16)
    tel = mpext.telemetry.attach(None, optimizer=opt, every=4, step_every=1)
    set_grads(params, _grads(params))
    opt.step()  # lazy state and plan: outside the count
    mode, host = SyncCounter(), HostReads()
    with host.counting(), mode:
        for k in range(2):
            set_grads(params, _grads(params, seed=k))
            opt.step()
            assert tel.poll() is None
    assert (len(mode.syncs), host.count) == (0, 0), (mode.syncs, host.calls)
    with host.counting():
        tel.read()
    assert host.count == 1


def test_step_stats_bad_arguments(device):
    """A bad stats tensor is refused naming it, before anything is written; attach refuses a
    torch optimizer and a call with neither scaler nor optimizer."""
    p = torch.randn(10, device=device).bfloat16()
    g = torch.randn(10, device=device).bfloat16()
    m, v, st = torch.zeros(10, device=device), torch.zeros(10, device=device), \
        torch.zeros((), device=device)
    p0 = p.clone()
    for bad, exc, match in ((torch.zeros(1, 12, dtype=torch.float64), ValueError,
                             r"stats must have shape \[len\(params\), 13\]"),
                            (torch.zeros(1, 13), RuntimeError, "stats must have dtype float64"),
                            (torch.zeros(13, 2, dtype=torch.float64).t()[:1], ValueError,
                             "stats must be contiguous")):
        with pytest.raises(exc, match=match):
            mpext.ops.adam_step_([p], [g], [m], [v], None, [st], 1e-3, master_free=True,
                                 stats=bad.to(device))
        assert torch.equal(p, p0) and float(st) == 0.0
    with pytest.raises(TypeError, match="optimizer must be an mpext.optim optimizer"):
        mpext.telemetry.attach(None, optimizer=torch.optim.SGD([torch.nn.Parameter(p.float())],
                                                                lr=1.0))
    with pytest.raises(ValueError, match="give a scaler"):
        mpext.telemetry.attach(None)
    assert len(STEP_COLUMNS) == 13


def test_step_stats_opcheck():
    """The ops with stats pass torch.library.opcheck (schema, fake kernel, mutation)."""
    p = torch.randn(40).bfloat16()
    args = ([p], [torch.randn(40).bfloat16()], [torch.zeros(40)], [torch.zeros(40)], [],
            [torch.zeros(())], torch.tensor(1e-3), 0.9, 0.999, 1e-8, 0.0, True, False)
    torch.library.opcheck(torch.ops.mpext.adam_step_.default, args,
                          dict(master_free=True, stats=torch.zeros(1, 13, dtype=torch.float64)))
