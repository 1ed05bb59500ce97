"""Generic optimizer tests over the rules x formats table (tests/optim_table.py): every valid
(rule, format) pair runs every test here, each against an independent reference -- the rule's
reference optimizer (torch.optim's, or the rule's published implementation), a bit-for-bit twin
run (uninterrupted vs resumed, remainder vs master, 1 vs 2 threads, one ISA vs another, eager vs
compiled), torch's own rounding (``Tensor.to``) or a float32 / float64 recomputation.

The tests that step a pair are device-generic (the ``device`` fixture: CUDA rows skip with the
reason where no GPU is present; the thread-count and ISA test is the CPU kernel's own);
tests/test_cuda_parity.py's test_table_steps_bitwise_as_the_cpu compares every pair's CUDA
steps with its CPU steps bit for bit.

Kept small (a few thousand elements, a few steps) so the whole table runs in a couple of
minutes on two cores.
"""
import warnings

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounter

import mpext
from mpext.optim import formats as F

import optim_table as T
from optim_table import BF16, F16, F32, INF, LOW
from reference import lerp_f32

PAIRS = list(T.pairs())
PAIR_IDS = [T.pair_id(p) for p in PAIRS]
SCALERS = {"torch": torch.amp.GradScaler, "mpext": mpext.GradScaler}
STEPS = 4


def build(rule, fmt, params, ema_half=False, **kw):
    """The pair's optimizer over params (master-free round to nearest warns, as documented);
    ``ema_half``: every second param in a group of its own that keeps an EMA, so that a test
    sees the step with and without one in each run."""
    if ema_half:
        params = [dict(params=params[::2]), dict(params=params[1::2], ema_decay=0.9)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*master_weights=False without")
        return rule.make(params, **dict(fmt.kwargs_for(rule), **kw))


def train(opt, params, steps, start=0, seed=0):
    for s in range(start, start + steps):
        T.set_grads(params, T.make_grads(params, s, seed))
        opt.step()


def pair_params(rule, fmt, seed=0, device="cpu"):
    """The table's params for the pair, in the shapes the rule takes (RuleInfo.fit_shapes)."""
    return T.make_params(fmt.param_dtypes, seed, device=device, rule=rule)


# ---- Against the reference optimizer ---------------------------------------------------------

@pytest.mark.parametrize("rule,fmt", PAIRS, ids=PAIR_IDS)
def test_tracks_the_reference_optimizer(rule, fmt, device):
    """Each step, from the state mpext holds, the reference optimizer steps once on the same
    (upcast) gradient, and every param, FP32 value (master, param + remainder) and moment mpext
    stores is exactly its format's rounding of the reference's result (to nearest even, or
    stochastically with the documented bits, or to the 8-bit codes around it) up to the fp32
    roundings the rule's arithmetic may differ by (optim_table.check_step). The last two steps
    maximize (a group setting, as torch reads it each step). Over the whole run, the exact
    formats' FP32 values and moments also follow the reference stepped on its own, within the
    existing parity tolerances."""
    params = pair_params(rule, fmt, device=device)
    ref_params = [p.detach().cpu().float().clone().requires_grad_() for p in params]
    opt, ref = build(rule, fmt, params, seed=SEED), rule.make_reference(ref_params)
    for s in range(STEPS):
        maximize = s >= STEPS // 2 and rule.maximize  # (Muon has none: refused, tested there)
        opt.param_groups[0]["maximize"] = maximize
        if rule.reference_maximize:
            ref.param_groups[0]["maximize"] = maximize
        grads = T.make_grads(params, s)
        T.set_grads(params, grads)
        sign = -1.0 if maximize and not rule.reference_maximize else 1.0
        T.set_grads(ref_params, [g.cpu().float() * sign for g in grads])
        refs = T.reference_step(rule, opt, params, grads, maximize)
        opt.step()
        ref.step()
        T.check_step(rule, fmt, opt, params, refs, SEED, "step %d" % s)
    if not fmt.exact:
        return
    for i, (p, q) in enumerate(zip(params, ref_params)):
        torch.testing.assert_close(T.fp32_value(opt, p).cpu(), q.detach(), rtol=rule.rtol,
                                   atol=rule.atol, msg=lambda m: "param %d: %s" % (i, m))
        for m in rule.moments:
            if m.name in ref.state[q]:
                torch.testing.assert_close(T.moment_value(opt, p, m).cpu(), ref.state[q][m.name],
                                           rtol=rule.rtol, atol=rule.atol)


SEED = 7


# ---- Every pair steps in its format -----------------------------------------------------------

MOMENT_DTYPE = {"float32": F32, "bfloat16": BF16, "q8": F32}  # q8: below MIN_8BIT_NUMEL


@pytest.mark.parametrize("rule,fmt", PAIRS, ids=PAIR_IDS)
def test_every_pair_moves_and_keeps_its_format(rule, fmt, device):
    """Every pair steps: every param moves, nothing turns NaN or Inf, and the state holds each
    moment under the format's keys (8-bit codes under ``<moment>_q8`` for a param of at least
    MIN_8BIT_NUMEL elements, as docs/lean_state.md says, in the param's shape and layout with
    one fp32 scale per block; the values in the format's dtype otherwise); a rule's kwargs
    that keep no moment keep none; a master or a remainder exactly where the format keeps
    one."""
    params = pair_params(rule, fmt, device=device)
    start = [p.detach().clone() for p in params]
    opt = build(rule, fmt, params, seed=7)
    train(opt, params, STEPS)
    for i, (p, p0) in enumerate(zip(params, start)):
        assert bool(torch.isfinite(p.detach().float()).all()), i
        assert not T.same_bits(p, p0), "param %d did not move" % i
        st = opt.state[p]
        for q in rule.cls.moments:
            if not rule.moments:
                assert q.name not in st and q.name + F.CODE_SUFFIX not in st, (i, sorted(st))
                continue
            coded = fmt.moment_format == "q8" and p.numel() >= F.MIN_8BIT_NUMEL
            assert (q.name + F.CODE_SUFFIX in st) == coded, (i, q.name, sorted(st))
            assert (q.name in st) == (not coded), (i, q.name, sorted(st))
            if not coded:
                assert st[q.name].dtype == MOMENT_DTYPE[fmt.moment_format], (i, q.name)
                assert q.name + F.SCALE_SUFFIX not in st, (i, q.name, sorted(st))
                continue
            # codes in the param's shape (int8 for a signed moment), one fp32 scale per block
            codes, scale = st[q.name + F.CODE_SUFFIX], st[q.name + F.SCALE_SUFFIX]
            assert codes.dtype == (torch.int8 if q.signed else torch.uint8), (i, q.name)
            assert codes.shape == p.shape and codes.stride() == p.stride(), (i, q.name)
            assert scale.dtype == F32 and scale.shape == (-(-p.numel() // fmt.block),), (
                i, q.name, scale.shape)
        # the FP32 value where the format keeps one: a master, or a 16-bit remainder
        low = p.dtype != F32
        assert ("master_param" in st) == (low and fmt.param_format == "master"), (i, sorted(st))
        assert ("param_remainder" in st) == (fmt.param_format == "remainder"), (i, sorted(st))


# ---- Exactness between formats ---------------------------------------------------------------

TWINS = [(r, f) for r, f in PAIRS if f.twin is not None]


@pytest.mark.parametrize("rule,fmt", TWINS, ids=[T.pair_id(p) for p in TWINS])
def test_remainder_is_the_fp32_master_bitwise(rule, fmt, device):
    """BF16 params with 16-bit remainders give the bits of FP32 masters (the twin format): the
    params, the joined FP32 value and the master, the moments, the steps."""
    twin = T.FORMATS[fmt.twin]
    pa, pb = pair_params(rule, fmt, device=device), pair_params(rule, fmt, device=device)
    a, b = build(rule, fmt, pa), build(rule, twin, pb)
    for s in range(STEPS):
        for opt, ps in ((a, pa), (b, pb)):
            T.set_grads(ps, T.make_grads(ps, s))
            opt.step()
        for i, (p, q) in enumerate(zip(pa, pb)):
            assert T.same_bits(p, q), "step %d param %d" % (s, i)
            assert "param_remainder" in a.state[p] and "master_param" in b.state[q]
            assert T.same_bits(T.fp32_value(a, p), b.state[q]["master_param"]), (s, i)
            assert T.same_bits(a.master_param(p), b.master_param(q)), (s, i)
            assert T.same_bits(b.state[q]["master_param"].to(BF16), q.detach()), (s, i)
            for m in rule.moments:
                assert T.same_bits(T.moment_value(a, p, m), T.moment_value(b, q, m)), (s, i, m)
            assert T.same_bits(a.state[p]["step"], b.state[q]["step"])


# ---- Skipped steps -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["inf", "nan"])
@pytest.mark.parametrize("scaler_name", sorted(SCALERS))
@pytest.mark.parametrize("rule,fmt", PAIRS, ids=PAIR_IDS)
def test_poisoned_step_changes_nothing(rule, fmt, scaler_name, kind, device):
    """Under either GradScaler a step whose gradients hold an inf or NaN writes nothing: the
    params, every state tensor (the step count and the EMA of the params that keep one
    included) keep their bits; the scale backs off; the next clean step goes on."""
    params = pair_params(rule, fmt, device=device)
    opt = build(rule, fmt, params, ema_half=True)
    scaler = SCALERS[scaler_name](device, init_scale=2.0 ** 8, growth_interval=100)
    for s in range(4):
        targets = T.make_grads(params, s)
        opt.zero_grad()
        loss = sum((p.float() * g.float()).sum() for p, g in zip(params, targets))
        scaler.scale(loss).backward()
        if s == 2:
            params[1].grad[5] = float(kind)
        before, scale = T.snapshot(opt, params), scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if s == 2:
            T.assert_same(before, T.snapshot(opt, params), "poisoned step")
            assert scaler.get_scale() == scale * 0.5
        else:
            assert any(not T.same_bits(a, b) for a, b in zip(before[0], params))
    assert all(opt.state[p]["step"].item() == 3 for p in params)


@pytest.mark.parametrize("scaler_name", sorted(SCALERS))
@pytest.mark.parametrize("rule,fmt", PAIRS, ids=PAIR_IDS)
def test_fused_unscale_is_unscale_then_step(rule, fmt, scaler_name, device):
    """Under either GradScaler the step unscales the gradients itself (the optimizer takes
    grad_scale and found_inf): the bits of scaler.unscale_ then the step, after every step, a
    skipped one (an inf at step 2) included. (bf16 and fp32 params: both scalers' unscale_
    refuses fp16 gradients, as torch's does.)"""
    dtypes = tuple(d for d in fmt.param_dtypes if d != F16)
    runs = []
    for fused in (True, False):
        params = T.make_params(dtypes, device=device, rule=rule)
        scaler = SCALERS[scaler_name](device, init_scale=2.0 ** 10, growth_interval=3)
        runs.append((params, build(rule, fmt, params), scaler, fused))
    for s in range(5):
        for params, opt, scaler, fused in runs:
            targets = T.make_grads(params, s)
            opt.zero_grad()
            loss = sum((p.float() * g.float()).sum() for p, g in zip(params, targets))
            scaler.scale(loss).backward()
            if s == 2:
                params[0].grad.view(-1)[3] = INF
            if not fused:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        (pa, a, sa, _), (pb, b, sb, _) = runs
        T.assert_same(T.snapshot(a, pa), T.snapshot(b, pb), "step %d" % s)
        assert sa.get_scale() == sb.get_scale(), s
    assert all(a.state[p]["step"].item() == 4 for p in pa)


# ---- Resume ----------------------------------------------------------------------------------

@pytest.mark.parametrize("rule,fmt", PAIRS, ids=PAIR_IDS)
def test_resume_is_bit_exact(rule, fmt, device):
    """Saved after 2 steps (torch.save of the model's params and opt.state_dict()), loaded into
    a fresh optimizer over fresh params, and continued for 2: the bits of the uninterrupted run
    (stochastic rounding draws what it would have drawn; the EMA the params of the second group
    keep goes on)."""
    ps = pair_params(rule, fmt, device=device)
    full = build(rule, fmt, ps, ema_half=True, seed=7)
    train(full, ps, STEPS)
    qs = pair_params(rule, fmt, device=device)
    half = build(rule, fmt, qs, ema_half=True, seed=7)
    train(half, qs, STEPS // 2)
    saved_params, saved = T.roundtrip([p.detach() for p in qs]), T.roundtrip(half.state_dict())
    rs = [t.clone().requires_grad_() for t in saved_params]
    resumed = build(rule, fmt, rs, ema_half=True, seed=0)  # the checkpoint's seed wins
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*takes the checkpoint's seed")
        resumed.load_state_dict(saved)
    train(resumed, rs, STEPS - STEPS // 2, start=STEPS // 2)
    T.assert_same(T.snapshot(full, ps), T.snapshot(resumed, rs), "resumed")


# ---- State dict conversions between formats --------------------------------------------------

CONVERSIONS = list(T.conversions())


def _holds(b, a):
    """Whether moment format b holds every value of moment format a (of one block size)."""
    return b == "float32" or b == a


@pytest.mark.parametrize("rule,a,dtype", CONVERSIONS, ids=[T.pair_id(c) for c in CONVERSIONS])
def test_state_dict_converts_between_formats(rule, a, dtype, device):
    """Format a's checkpoint loaded by an optimizer of each format b of the rule (a itself
    included): the params are not touched by the load; the FP32 value b keeps is a's exactly
    (a master, a remainder of it, or the param where a kept none); each moment is a's exactly
    where b can hold it, else a's rounded to nearest (even) in b (torch's own rounding for
    bf16); then b steps on."""
    ps = T.make_params((dtype,), device=device, rule=rule)
    saver = build(rule, a, ps)
    train(saver, ps, 2)
    sd = T.roundtrip(saver.state_dict())
    for b in T.loaders(rule, dtype):
        qs = [p.detach().clone().requires_grad_() for p in ps]
        loader = build(rule, b, qs)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*takes the checkpoint's")
            loader.load_state_dict(sd)
        for i, (p, q) in enumerate(zip(ps, qs)):
            what = "%s into %s, param %d" % (a.name, b.name, i)
            assert T.same_bits(q.detach(), p.detach()), "the load changed " + what
            if b.keeps_value or F.stored_param_format(loader.state[q]) is not None:
                assert T.same_bits(T.fp32_value(loader, q), T.fp32_value(saver, p)), what
            for m in rule.moments:
                want = T.moment_value(saver, p, m)
                got = T.moment_value(loader, q, m)
                fmt_b = F.moment_format(q, loader.param_groups[0], m)[0].name
                fmt_a = F.moment_format(p, saver.param_groups[0], m)[0].name
                if _holds(fmt_b, fmt_a):
                    assert T.same_bits(got, want), (what, m.name)
                elif fmt_b == "bfloat16":
                    assert T.same_bits(got, want.to(BF16).float()), (what, m.name)
                else:  # 8-bit codes: the nearest ones (ties to even), by the reference
                    T.assert_nearest_q8(loader.state[q], m, want, b.block, what)
        train(loader, qs, 1, start=2)
        for q in qs:
            assert loader.state[q]["step"].item() == 3, b.name
            assert bool(q.detach().isfinite().all()), b.name


# ---- Bad options -----------------------------------------------------------------------------

def format_errors(rule):
    """The format options every rule refuses (mpext.optim._base's checks), per its moments."""
    out = [
        (dict(master_weights="yes"), TypeError, r"master_weights must be a bool, got 'yes'"),
        (dict(param_remainders=True, master_weights=False), ValueError,
         r"param_remainders=True stores the masters compactly; it needs master_weights=True"),
        (dict(stochastic_rounding=True), ValueError,
         r"stochastic_rounding=True rounds params that have no master"),
        (dict(moment_rounding="down"), ValueError,
         r"moment_rounding must be \"stochastic\" or \"nearest\", got 'down'"),
        (dict(seed=-1), ValueError, r"seed must be an int in \[0, 2\*\*64\), got -1"),
        (dict(seed=2 ** 64), ValueError,
         r"seed must be an int in \[0, 2\*\*64\), got 18446744073709551616"),
        (dict(ema_decay=1.5), ValueError, r"ema_decay must be None or a number in \[0, 1\]"),
        (dict(block_size=100), ValueError, r"block_size must be a power of two"),
    ]
    for q in rule.moments:
        out.append(({q.setting: torch.float16}, ValueError,
                    r"%s must be torch.float32, torch.bfloat16 or %s, got torch.float16"
                    % (q.setting, F.Q8.storage_dtype(q))))
    if len(rule.moments) > 1:
        out.append(({rule.moments[0].setting: "q8"}, ValueError,
                    r"8-bit moments come as a pair"))
    return [T.ErrorInput(*e) for e in out]


# (rule, error, whether the message names the param group: mpext's format options do)
ERRORS = [(rule, e, False) for rule in T.RULES.values() for e in rule.error_inputs] + [
    (rule, e, True) for rule in T.RULES.values() for e in format_errors(rule)]


@pytest.mark.parametrize("rule,err,named", ERRORS,
                         ids=["%s-%s" % (r.name, "-".join(map(str, e.kwargs)))
                              + str(i) for i, (r, e, _) in enumerate(ERRORS)])
def test_bad_options_raise_and_change_nothing(rule, err, named):
    """A bad option: the constructor raises the error naming it; set in a param group of a
    trained optimizer, the next step raises it before anything is written; given to
    add_param_group, it is refused and no group is added. A format option's message names
    the group (0 at the step, 1 for the new group)."""
    with pytest.raises(err.exc, match=err.match):
        rule.make([torch.zeros(3, requires_grad=True)], **err.kwargs)
    params = T.make_params((F32, BF16), shapes=((5, 7), (64, 80)))
    opt = rule.make(params)
    train(opt, params, 2)
    T.set_grads(params, T.make_grads(params, 2))
    before = T.snapshot(opt, params)
    opt.param_groups[0].update(err.kwargs)
    with pytest.raises(err.exc, match=err.match + (r".*\(param group 0\)" if named else "")):
        opt.step()
    after = T.snapshot(opt, params)
    T.assert_same((before[0], before[1], []), (after[0], after[1], []), "refused step")
    opt.param_groups[0].update(before[2][0])  # the good settings back
    with pytest.raises(err.exc, match=err.match + (r".*\(param group 1\)" if named else "")):
        opt.add_param_group(dict(params=[torch.zeros(4, 6, requires_grad=True)], **err.kwargs))
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("rule", list(T.RULES.values()), ids=list(T.RULES))
def test_fp16_params_with_remainders_are_refused(rule):
    """An fp16 param among bf16 ones, in the constructor or add_param_group: refused, naming
    the param, its group and why; no group is added."""
    p16 = torch.zeros(8, dtype=F16, requires_grad=True)
    bf16 = [torch.zeros(2, 4, dtype=BF16, requires_grad=True) for _ in range(2)]
    msg = (r"params\[1\] \(param group 0\) is float16, and param_remainders=True needs "
           r"bfloat16 params \(a float16 value is not the high half of an fp32 one\)")
    with pytest.raises(ValueError, match=msg):
        rule.make([bf16[0], p16], param_remainders=True)
    opt = rule.make([bf16[1]], param_remainders=True)
    with pytest.raises(ValueError, match=r"params\[0\] \(param group 1\) is float16"):
        opt.add_param_group({"params": [p16]})
    assert len(opt.param_groups) == 1


# ---- Reproducibility -------------------------------------------------------------------------

def _big_run(rule, fmt, threads, isa, ema_big):
    """Two steps on a param big enough for the CPU kernel to split it across threads (its
    tasks are 2^16 elements or more) and a small one, one of the two in a group that keeps an
    EMA (the big one if ``ema_big``), on ``threads`` threads and ISA path ``isa``, the
    gradients scaled and unscaled in the step (grad_scale: the fused unscale on each path)."""
    previous = mpext.cpu_isa()
    shapes = ((2 ** 17 + 5,), (37, 5))
    ps = T.make_params(fmt.param_dtypes, seed=3, shapes=shapes[::-1] if ema_big else shapes,
                       rule=rule)
    opt = build(rule, fmt, ps, ema_half=True, seed=11)
    try:
        mpext.set_cpu_isa(isa)
        for s in range(2):
            T.set_grads(ps, T.make_grads(ps, s, scale=16.0))
            torch.set_num_threads(threads)
            opt.step(grad_scale=torch.tensor(16.0))
            torch.set_num_threads(1)
    finally:
        mpext.set_cpu_isa(previous)
    return T.snapshot(opt, ps)


@pytest.mark.parametrize("rule,fmt", PAIRS, ids=PAIR_IDS)
def test_same_bits_for_every_thread_count_and_isa(rule, fmt, threads):
    """1 and 2 threads, on every CPU ISA path this machine runs: the same bits, the EMA's
    included. The split param keeps the EMA in a checkerboard of (param format, moment row),
    so that each rule's split step runs with and without one in every param format and every
    moment format (remainders with fp32 moments among those with)."""
    isas = mpext.build_info()["cpu_isas_supported"]
    k = list(T.FORMATS).index(fmt.name)
    ema_big = (k // len(T._MOMENT_ROWS) + k % len(T._MOMENT_ROWS)) % 2 == 0
    first = _big_run(rule, fmt, 1, isas[0], ema_big)
    for isa in isas:
        for n in (1, 2):
            if (isa, n) != (isas[0], 1):
                T.assert_same(first, _big_run(rule, fmt, n, isa, ema_big),
                              "%s, %d threads" % (isa, n))


# ---- torch.compile ---------------------------------------------------------------------------

def compiled_cases():
    """(rule, formats): each covering pair's format alone; a rule with a sweep (Muon: its
    compile takes five frames, seconds each) as one case whose optimizer holds every format of
    its sweep in param groups of their own (each format a group setting): one compile covers
    every param and moment format."""
    out = []
    for rule, fmt in T.covering_pairs():
        if rule.sweep is None:
            out.append((rule, (fmt,)))
        elif not any(r is rule for r, _ in out):
            out.append((rule, tuple(T.FORMATS[f] for f in rule.sweep)))
    return out


COVERING = compiled_cases()


def _compiled_run(rule, fmts, device):
    """The case's params and optimizer: per format, SMALL params of each of its dtypes, every
    second one in a group that keeps an EMA (as ``ema_half``)."""
    if len(fmts) == 1:
        ps = T.make_params(fmts[0].param_dtypes, shapes=SMALL, device=device, rule=rule)
        return ps, build(rule, fmts[0], ps, ema_half=True)
    params, groups = [], []
    for fmt in fmts:
        ps = T.make_params(fmt.param_dtypes, shapes=SMALL, device=device, rule=rule)
        params += ps
        kw = fmt.kwargs_for(rule)
        groups += [dict(params=ps[::2], **kw), dict(params=ps[1::2], ema_decay=0.9, **kw)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*master_weights=False without")
        return params, rule.make(groups)


@pytest.mark.parametrize("rule,fmts", COVERING, ids=["%s-%s" % (r.name, "+".join(
    f.name for f in fs)) for r, fs in COVERING])
def test_compiled_step(rule, fmts, device):
    """torch.compile(opt.step) for 20 steps, found_inf passed to every step (set on step 5: a
    skipped step): no graph break but the rule's own (``rule.graph_breaks``: Muon's eager
    Newton-Schulz), at most ``rule.max_frames`` compiles (2: the first step's state setup,
    then the steady step; Muon's break cuts each in two), and the eager run's bits, an EMA
    (of one of the two params) included. (Over the covering pairs: every param format and
    every moment format of each rule; a compile costs seconds: compiled_cases.)"""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ps, eager = _compiled_run(rule, fmts, device)
    qs, comp = _compiled_run(rule, fmts, device)
    counter = CompileCounter()
    step = torch.compile(comp.step, backend=counter)
    for s in range(20):
        grads = T.make_grads(ps, s)
        T.set_grads(ps, grads)
        T.set_grads(qs, grads)
        before = T.snapshot(comp, qs)
        eager.step(found_inf=torch.tensor(float(s == 5), device=device))
        step(found_inf=torch.tensor(float(s == 5), device=device))
        if s == 5:  # the skipped step wrote nothing, the step counts included
            T.assert_same(before, T.snapshot(comp, qs), "compiled, skipped step")
    assert all(opt.state[p]["step"].item() == 19 for opt, ps_ in ((eager, ps), (comp, qs))
               for p in ps_)
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    torch._dynamo.reset()
    # only the breaks the rule has by design (Muon's eager Newton-Schulz), each reason named
    unexpected = {r: n for r, n in breaks.items()
                  if not any(b in str(r) for b in rule.graph_breaks)}
    assert not unexpected, unexpected
    assert 1 <= counter.frame_count <= rule.max_frames, counter.frame_count
    T.assert_same(T.snapshot(eager, ps), T.snapshot(comp, qs), "compiled")


SMALL = ((37, 5), (64, 80))


# ---- EMA -------------------------------------------------------------------------------------

@pytest.mark.parametrize("rule,fmt", PAIRS, ids=PAIR_IDS)
def test_ema(rule, fmt, device):
    """ema_decay: after each step the EMA is lerp(previous, the FP32 value, 1 - decay) in
    float32 (a copy of the value after the first step), bit for bit where the format keeps that
    value; without a master the value is the update before rounding, which is kept nowhere:
    it is the reference optimizer's step from the state (optim_table.reference_step), so the
    EMA must be the lerp towards it, up to the rule's fp32 slack (exactly, where it has none).
    The decay is a group setting read each step: 0.9 for the first steps, then 0.3 (a lerp
    weight of 0.5 or more, torch.lerp's other form). The EMA keeps its param's layout
    (channels_last); empty and one-element params take part."""
    params = T.make_params(fmt.param_dtypes, shapes=T.SHAPES + ((0, 3), (1,)), device=device,
                           rule=rule)
    opt = build(rule, fmt, params, ema_decay=0.9)
    want = [None] * len(params)
    for s in range(STEPS):
        decay = 0.9 if s < STEPS // 2 else 0.3
        w = float(np.float32(1.0 - decay))
        opt.param_groups[0]["ema_decay"] = decay
        grads = T.make_grads(params, s)
        T.set_grads(params, grads)
        refs = None if fmt.keeps_value else T.reference_step(rule, opt, params, grads)
        prev = [opt.state[p]["ema_param"].to("cpu", copy=True)
                if "ema_param" in opt.state[p] else None for p in params]
        opt.step()
        for i, p in enumerate(params):
            got = opt.state[p]["ema_param"]
            assert got.dtype == F32 and got.shape == p.shape and got.device == p.device
            assert got.stride() == p.stride() or p.numel() <= 1, (s, i, got.stride())
            got = got.cpu()
            if fmt.keeps_value:
                value = T.fp32_value(opt, p).cpu()
                want[i] = value.clone() if want[i] is None else lerp_f32(want[i], value, w)
                assert T.same_bits(got.contiguous(), want[i].reshape(p.shape).contiguous()), (
                    s, i)
                continue
            lo, hi = T.fp32_bracket(refs[i].value, rule.ulps, refs[i].value_mag)
            if prev[i] is not None:
                lo, hi = lerp_f32(prev[i], lo, w), lerp_f32(prev[i], hi, w)
            T.assert_in(got, lo, hi, "step %d param %d: the EMA" % (s, i))


# ---- MixedPrecisionOptimizer around each rule ------------------------------------------------

@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("rule", list(T.RULES.values()), ids=list(T.RULES))
def test_mixed_precision_optimizer_tracks_the_reference(rule, dtype, monkeypatch):
    """mpext.MixedPrecisionOptimizer around the rule's optimizer over BF16/FP16 params steps
    the Adam rules on its fused path (adam_step_ over the model's params) and every other rule
    on its generic path (the inner optimizer steps the FP32 masters, an overflow skipped on
    the device once each param has stepped); either way the masters follow the reference
    optimizer on FP32 copies fed the same gradients, each param is its master rounded to
    nearest even, and an overflowing step (under FP16's dynamic loss scale, or BF16's check)
    changes nothing."""
    paths = []
    for name in ("_step_fused", "_step_generic"):
        def spy(self, *args, _real=getattr(mpext.MixedPrecisionOptimizer, name), _name=name):
            paths.append(_name)
            return _real(self, *args)
        monkeypatch.setattr(mpext.MixedPrecisionOptimizer, name, spy)
    params = T.make_params((dtype,), shapes=SMALL, rule=rule)
    ref_params = [p.detach().float().clone().requires_grad_() for p in params]
    scaling = dict(init_scale=2.0 ** 8) if dtype == F16 else {}
    mpo = mpext.MixedPrecisionOptimizer(rule.make(params), **scaling)
    ref = rule.make_reference(ref_params)
    masters = mpo.optimizer.param_groups[0]["params"]
    for s in range(STEPS + 1):
        scale = mpo.get_scale()
        for p, q, g in zip(params, ref_params, T.make_grads(params, s)):
            p.grad = (g.float() * scale).to(dtype)  # exact: a power-of-two scale
            q.grad = g.float()
        if s == 2:
            params[1].grad.view(-1)[7] = INF
        before = T.snapshot(mpo.optimizer, masters), [p.detach().clone() for p in params]
        applied = mpo.step()
        if s == 2:
            assert not bool(applied)
            T.assert_same(before[0], T.snapshot(mpo.optimizer, masters), "overflow")
            assert all(T.same_bits(a, b) for a, b in zip(before[1], params))
            continue
        assert bool(applied), s
        ref.step()
        for i, (p, q) in enumerate(zip(params, ref_params)):
            m = mpo.master_param(p)
            torch.testing.assert_close(m, q.detach(), rtol=rule.rtol, atol=rule.atol,
                                       msg=lambda msg: "step %d param %d: %s" % (s, i, msg))
            assert T.same_bits(p.detach(), m.to(dtype)), (s, i)
    fused = rule.cls in (mpext.optim.Adam, mpext.optim.AdamW)
    assert paths == ["_step_fused" if fused else "_step_generic"] * (STEPS + 1), paths


# ---- offsets: a shard of a param draws the random bits of its place in the whole -------------

def _step_pieces(rule, p, g, moments, scales, pieces, steps, block=256):
    """One step of ``rule``'s op (master-free bf16 params, stochastic rounding) over the pieces
    [a, b) of the flat tensors, each piece told its offset in the whole."""
    def cut(t):
        return [t[a:b] for a, b in pieces]

    def blocks(s):
        return [s[a // block:b // block + (b % block > 0)] for a, b in pieces]

    kw = dict(master_free=True, stochastic_rounding=True, seed=5, sr_streams=[1] * len(pieces),
              offsets=[a for a, _ in pieces], block_size=block)
    if rule == "adam":
        if scales:
            kw.update(exp_avg_scales=blocks(scales[0]), exp_avg_sq_scales=blocks(scales[1]))
        mpext.ops.adam_step_(cut(p), cut(g), cut(moments[0]), cut(moments[1]), [], steps, 1e-2,
                             0.9, 0.999, 1e-8, 0.01, True, False, **kw)
    elif rule == "lion":
        if scales:
            kw.update(exp_avg_scales=blocks(scales[0]))
        mpext.ops.lion_step_(cut(p), cut(g), cut(moments[0]), [], steps, 1e-2, 0.9, 0.99, 0.1,
                             **kw)
    else:
        if scales:
            kw.update(momentum_buffer_scales=blocks(scales[0]))
        mpext.ops.sgd_step_(cut(p), cut(g), cut(moments[0]), [], steps, 0.1, 0.9, 0.0, 0.01,
                            False, **kw)


OFFSET_OPS = {"adam": (torch.int8, torch.uint8), "lion": (torch.int8,), "sgd": (torch.int8,)}


@pytest.mark.parametrize("fmt", ["bfloat16", "q8"])
@pytest.mark.parametrize("rule", sorted(OFFSET_OPS))
def test_op_offsets_shards_round_as_the_whole(device, rule, fmt):
    """Each rule's op: a param stepped as pieces (offsets 0 and n/2, the second half off the
    hand-fused loops' path; with bf16 moments also pieces off any block grid) gets the bits of
    the whole -- params, moments, 8-bit block scales -- in the stochastic-rounding formats; an
    offset off the 8-bit block grid is refused."""
    n, block = 4096, 256
    gen = torch.Generator().manual_seed(4)
    p0 = torch.randn(n, generator=gen).to(BF16, copy=True).to(device)
    grads = [torch.randn(n, generator=gen).to(BF16).to(device) for _ in range(3)]
    q8 = fmt == "q8"
    dtypes = OFFSET_OPS[rule] if q8 else (BF16,) * len(OFFSET_OPS[rule])

    def run(cuts):
        p = p0.clone()
        moments = [torch.zeros(n, dtype=dt, device=device) for dt in dtypes]
        scales = [torch.zeros(n // block, device=device) for _ in dtypes] if q8 else []
        bounds = list(cuts) + [n]
        pieces = list(zip(bounds[:-1], bounds[1:]))
        steps = [torch.zeros((), device=device) for _ in pieces]
        for g in grads:
            _step_pieces(rule, p, g, moments, scales, pieces, steps, block)
        return [p] + moments + scales

    whole = run([0])
    for cuts in [[0, n // 2]] + ([] if q8 else [[0, 1000, 3001]]):
        for i, (a, b) in enumerate(zip(whole, run(cuts))):
            T.assert_bits(a, b, "%s, tensor %d" % (cuts, i))
    if q8:
        with pytest.raises(ValueError, match=r"offsets\[0\] \(8\) must be a multiple of "
                                             r"block_size \(256\)"):
            run([8])
