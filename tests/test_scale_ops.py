"""The loss-scaling operators unscale_ and update_scale_, against PyTorch's own
torch._amp_foreach_non_finite_check_and_unscale_ / torch._amp_update_scale_ (bit for bit) and a
pure-Python model of the extended rule (tests/reference.py)."""
import math
import random

import numpy as np
import pytest
import torch

from mpext import ops

from conftest import CUDA_OK
from reference import (ScaleRuleModel, all_16bit, assert_same_bits_or_both_nan,
                       assert_unchanged, raw_bytes, snapshot)

FLOATS = [torch.float32, torch.float16, torch.bfloat16]


def torch_unscale_(grads, found_inf, inv_scale):
    """torch's op, one call per dtype as GradScaler makes them (its CUDA kernel lacks bf16; its
    CPU kernel has it)."""
    by_dtype = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(same, found_inf, inv_scale)


def torch_reference_device(device, dtype):
    """Where torch's op is run for the reference: bf16 on CUDA has no torch kernel, so those
    references are computed on the CPU (same arithmetic: fp32 multiply, RNE back)."""
    return "cpu" if (device != "cpu" and dtype == torch.bfloat16) else device


def random_bits(n, dtype, gen):
    """n values of dtype with uniformly random bit patterns: NaN, +-Inf, subnormals, zeros and
    everything else."""
    if dtype == torch.float32:
        b = torch.randint(-(1 << 31), 1 << 31, (n,), generator=gen, dtype=torch.int64)
        return b.to(torch.int32).view(torch.float32)
    b = torch.randint(-(1 << 15), 1 << 15, (n,), generator=gen, dtype=torch.int32)
    return b.to(torch.int16).view(dtype)


def finite_values(n, dtype, gen, scale=1.0):
    x = torch.randn(n, generator=gen) * scale
    return x.to(dtype)


INV_SCALES = [1.0 / 65536, 0.5, 1.0 / 3, 3.0, 1e-30, 1e30, 2.0 ** -140,
              float(np.float32(1.0 / 1023.0))]


def run_both(xs, inv, device, found0=0.0):
    """(ours, found_ours), (theirs, found_theirs) for one list."""
    ours = [x.clone().to(device) for x in xs]
    fo = torch.full((), found0, device=device)
    ops.unscale_(ours, fo, torch.full((), inv, device=device))
    theirs = [x.clone().to(torch_reference_device(device, x.dtype)) for x in xs]
    ft = {}
    for t in theirs:
        ft.setdefault(t.device, torch.full((), found0, device=t.device))
    for dev, f in ft.items():
        torch_unscale_([t for t in theirs if t.device == dev], f,
                       torch.full((), inv, device=dev))
    found_t = max(f.item() for f in ft.values())
    return ours, fo.item(), theirs, found_t


# --------------------------------------------------------------------------------------------
# unscale_: bit-identical to torch.


@pytest.mark.parametrize("dtype", FLOATS)
def test_unscale_random_bits_match_torch(isa, device, dtype):
    gen = torch.Generator().manual_seed(0)
    for n in [1, 3, 7, 8, 15, 16, 17, 31, 33, 64, 1000, 65537]:
        x = random_bits(n, dtype, gen)
        for inv in INV_SCALES:
            (ours,), fo, (theirs,), ft = run_both([x], inv, device)
            assert_same_bits_or_both_nan(ours, theirs, x)
            assert fo == ft


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_unscale_all_16bit_patterns_match_torch(isa, device, dtype):
    x = all_16bit(dtype)
    for inv in INV_SCALES + [1.0]:
        (ours,), fo, (theirs,), ft = run_both([x], inv, device)
        assert_same_bits_or_both_nan(ours, theirs, x)
        assert fo == ft == 1.0


@pytest.mark.parametrize("dtype", FLOATS)
def test_unscale_finite_values_found_inf_stays_zero(isa, device, dtype):
    gen = torch.Generator().manual_seed(1)
    x = finite_values(100003, dtype, gen, scale=1000.0)
    for inv in [1.0 / 1024, 0.7, 1.0]:
        (ours,), fo, (theirs,), ft = run_both([x], inv, device)
        assert fo == ft == 0.0
        assert torch.equal(raw_bytes(ours.cpu()), raw_bytes(theirs.cpu()))


def test_unscale_subnormal_results_and_inputs(isa, device):
    """Products that land in (and inputs that start in) the subnormal range of each dtype are
    rounded, not flushed."""
    tiny = {torch.float32: 2.0 ** -126, torch.float16: 2.0 ** -14, torch.bfloat16: 2.0 ** -126}
    for dtype, t in tiny.items():
        base = torch.tensor([t, t * 1.5, t * 0.75, t * 2 ** -5, -t * 3.3, t * 2 ** -9,
                             7 * t, 1.0, 0.0, -0.0], dtype=torch.float32).to(dtype)
        for inv in [0.5, 0.25, 1.0 / 3, 2.0 ** -10, 3.0]:
            (ours,), fo, (theirs,), ft = run_both([base], inv, device)
            assert torch.equal(raw_bytes(ours.cpu()), raw_bytes(theirs.cpu())), (dtype, inv)
            assert fo == ft == 0.0


@pytest.mark.parametrize("dtype", FLOATS)
def test_unscale_single_nonfinite_anywhere(isa, device, dtype):
    """One NaN / +Inf / -Inf at any position of an odd-sized tensor (SIMD body and tails) is
    found."""
    for n in [1, 7, 9, 33, 130]:
        for pos in sorted({0, n // 2, n - 1}):
            for bad in [float("nan"), float("inf"), float("-inf")]:
                x = torch.ones(n, dtype=dtype)
                x[pos] = bad
                (ours,), fo, (theirs,), ft = run_both([x], 0.5, device)
                assert fo == ft == 1.0, (n, pos, bad)
                assert_same_bits_or_both_nan(ours, theirs, x)


def test_unscale_mixed_dtype_list_and_views(isa, device):
    gen = torch.Generator().manual_seed(2)
    base32 = random_bits(5003, torch.float32, gen)
    base16 = random_bits(4001, torch.float16, gen)
    xs = [random_bits(17, torch.bfloat16, gen), base32[3:1003],
          finite_values(0, torch.float32, gen), base16[1:2050], random_bits(1, torch.float32, gen),
          random_bits(65539, torch.bfloat16, gen), base32[1003:1004],
          finite_values(129, torch.float16, gen)]
    for inv in [1.0 / 128, 1.0 / 3]:
        ours, fo, theirs, ft = run_both(xs, inv, device)
        assert fo == ft == 1.0
        for o, t, x in zip(ours, theirs, xs):
            assert o.dtype == x.dtype and o.shape == x.shape
            assert_same_bits_or_both_nan(o, t, x)


def test_unscale_views_at_offsets_touch_only_the_view(isa, device):
    """Views that start at odd element offsets inside bigger buffers: results as torch, and the
    memory around each view is untouched."""
    gen = torch.Generator().manual_seed(3)
    for dtype in FLOATS:
        buf = finite_values(300, dtype, gen).to(device)
        before = buf.clone()
        views = [buf[1:38], buf[41:42], buf[45:45], buf[50:250]]
        ref_views = [v.clone().to(torch_reference_device(device, dtype)) for v in views]
        torch_unscale_(ref_views, torch.zeros((), device=ref_views[0].device),
                       torch.full((), 0.125, device=ref_views[0].device))
        found = torch.zeros((), device=device)
        ops.unscale_(views, found, torch.full((), 0.125, device=device))
        for v, r in zip(views, ref_views):
            assert torch.equal(raw_bytes(v.cpu()), raw_bytes(r.cpu()))
        untouched = torch.ones(300, dtype=torch.bool)
        for a, b in [(1, 38), (41, 42), (50, 250)]:
            untouched[a:b] = False
        assert torch.equal(raw_bytes(buf[untouched.to(device)].cpu()),
                           raw_bytes(before[untouched.to(device)].cpu()))
        assert found.item() == 0.0


def test_unscale_layouts(isa, device):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 5, 7, generator=gen).to(device).to(memory_format=torch.channels_last)
    t = torch.randn(6, 4, generator=gen).half().to(device).t()  # a permuted, dense view
    ours = [x.clone(memory_format=torch.preserve_format), t.clone().t().contiguous().t()]
    assert not ours[1].is_contiguous()
    ops.unscale_(ours, torch.zeros((), device=device), torch.full((), 0.25, device=device))
    assert ours[0].is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(ours[0], x * 0.25)
    assert torch.equal(ours[1], (t.float() * 0.25).half())


def test_unscale_found_inf_is_never_cleared(isa, device):
    x = [torch.randn(100, device=device), torch.randn(7, device=device).bfloat16()]
    for start in [1.0, 2.0, 0.5]:
        found = torch.full((), start, device=device)
        ops.unscale_(x, found, torch.full((), 0.5, device=device))
        assert found.item() == start
    found = torch.zeros(1, device=device)  # a 1-element (not 0-dim) flag works too
    y = torch.tensor([1.0, float("inf")], device=device)
    ops.unscale_([y], found, torch.full((1,), 0.5, device=device))
    assert found.item() == 1.0
    ops.unscale_(x, found, torch.full((), 0.5, device=device))
    assert found.item() == 1.0


@pytest.mark.parametrize("dtype", FLOATS)
def test_unscale_inv_scale_one_is_read_only(isa, device, dtype):
    """With inv_scale == 1 the op is a pure check: memory stays bitwise identical, NaN payloads
    and signaling NaNs included."""
    gen = torch.Generator().manual_seed(5)
    x = all_16bit(dtype) if dtype != torch.float32 else random_bits(200001, dtype, gen)
    if dtype == torch.float32:
        x[:4] = torch.tensor([0x7F800001, 0xFFBFFFFF, 0x00000001, 0x7FC00001],
                             dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = x.to(device)
    y = x.clone()
    found = torch.zeros((), device=device)
    ops.unscale_([y], found, torch.ones((), device=device))
    assert torch.equal(raw_bytes(x.cpu()), raw_bytes(y.cpu()))
    assert found.item() == 1.0


def test_unscale_empty(device):
    found = torch.zeros((), device=device)
    ops.unscale_([], found, torch.full((), 0.5, device=device))
    ops.unscale_([torch.empty(0, device=device), torch.empty(3, 0, dtype=torch.half,
                                                             device=device)],
                 found, torch.full((), 0.5, device=device))
    assert found.item() == 0.0


def test_unscale_threads_and_chunk_boundaries(threads):
    """Many tensors whose boundaries fall inside and across the threads' work ranges: the same
    bits as torch whatever the thread count."""
    gen = torch.Generator().manual_seed(6)
    sizes = [int(n) for n in torch.randint(0, 90000, (37,), generator=gen)] + [1, 65536, 65537]
    dtypes = [FLOATS[i % 3] for i in range(len(sizes))]
    xs = [finite_values(n, d, gen, 300.0) for n, d in zip(sizes, dtypes)]
    xs[17][-1] = float("inf")
    results = []
    for nt in (1, 2, 3):
        torch.set_num_threads(nt)
        ours, fo, theirs, ft = run_both(xs, 1.0 / 4096, "cpu")
        assert fo == ft == 1.0
        results.append(ours)
    for ours in results:
        for o, t, x in zip(ours, theirs, xs):
            assert_same_bits_or_both_nan(o, t, x)


@pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA device and a CUDA build of mpext")
def test_unscale_cpu_and_cuda_agree():
    gen = torch.Generator().manual_seed(7)
    xs = [random_bits(n, d, gen) for n, d in [(1001, torch.float32), (77, torch.float16),
                                              (5000, torch.bfloat16), (3, torch.float16)]]
    for inv in INV_SCALES:
        c, fc, _, _ = run_both(xs, inv, "cpu")
        g, fg, _, _ = run_both(xs, inv, "cuda")
        assert fc == fg
        for a, b, x in zip(c, g, xs):
            assert_same_bits_or_both_nan(b, a, x)


# --------------------------------------------------------------------------------------------
# update_scale_: torch's rule by default.


def scalars(device, scale, tracker=0):
    return (torch.full((), scale, dtype=torch.float32, device=device),
            torch.full((), tracker, dtype=torch.int32, device=device))


def found_tensor(v, device):
    return torch.full((), v, dtype=torch.float32, device=device)


@pytest.mark.parametrize("growth_interval", [1, 2, 3, 7, 2000])
@pytest.mark.parametrize("factors", [(2.0, 0.5), (1.7, 0.3), (1.0001, 0.9999), (3.0, 0.125)])
def test_update_scale_matches_torch_random_sequences(device, growth_interval, factors):
    rng = random.Random(growth_interval * 1000 + int(factors[0] * 100))
    gf, bf = factors
    for init in [2.0 ** 16, 1.0, 3.3e-20, 1.5e30]:
        s_o, t_o = scalars(device, init)
        s_t, t_t = scalars(device, init)
        for step in range(300):
            p = rng.choice([0.0, 0.05, 0.3, 0.8])
            f = rng.choice([1.0, 2.0, float("nan")]) if rng.random() < p else 0.0
            ops.update_scale_(s_o, t_o, found_tensor(f, device), gf, bf, growth_interval)
            torch._amp_update_scale_(s_t, t_t, found_tensor(f, device), gf, bf, growth_interval)
            assert torch.equal(s_o.view(torch.int32), s_t.view(torch.int32)), (step, s_o, s_t)
            assert torch.equal(t_o, t_t), (step, t_o, t_t)


@pytest.mark.parametrize("growth_interval", [1, 4])
def test_update_scale_growth_until_fp32_overflow(device, growth_interval):
    """The scale grows until the next growth would be infinite, then stays put (the tracker
    keeps resetting), exactly as torch."""
    for gf in [2.0, 3.0, 1.5]:
        s_o, t_o = scalars(device, 2.0 ** 100)
        s_t, t_t = scalars(device, 2.0 ** 100)
        for _ in range(growth_interval * 200):
            ops.update_scale_(s_o, t_o, found_tensor(0.0, device), gf, 0.5, growth_interval)
            torch._amp_update_scale_(s_t, t_t, found_tensor(0.0, device), gf, 0.5,
                                     growth_interval)
            assert torch.equal(s_o, s_t) and torch.equal(t_o, t_t)
        assert math.isfinite(s_o.item()) and s_o.item() * gf > 3.4028234663852886e38
        # A 0.5 back-off from there is exact.
        ops.update_scale_(s_o, t_o, found_tensor(1.0, device), gf, 0.5, growth_interval)
        torch._amp_update_scale_(s_t, t_t, found_tensor(1.0, device), gf, 0.5, growth_interval)
        assert torch.equal(s_o, s_t) and t_o.item() == 0


def test_update_scale_model_matches_torch(device):
    """The pure-Python model agrees with torch on its default rule (so that the extension tests
    below compare against something anchored to torch)."""
    rng = random.Random(9)
    for gi, gf, bf in [(1, 2.0, 0.5), (5, 1.3, 0.37)]:
        model = ScaleRuleModel(1234.5, gf, bf, gi)
        s, t = scalars(device, 1234.5)
        for _ in range(400):
            f = 1.0 if rng.random() < 0.2 else 0.0
            model.step(f)
            torch._amp_update_scale_(s, t, found_tensor(f, device), gf, bf, gi)
            assert s.item() == model.scale and t.item() == model.tracker


# --------------------------------------------------------------------------------------------
# update_scale_: the extensions, against the pure-Python model.


def run_extended(device, model, kwargs, seq):
    s, t = scalars(device, model.scale, model.tracker)
    h = torch.full((), model.hysteresis_left, dtype=torch.int32, device=device)
    stats = torch.tensor([model.skipped, model.streak], dtype=torch.int64, device=device)
    for i, f in enumerate(seq):
        ops.update_scale_(s, t, found_tensor(f, device), model.growth_factor,
                          model.backoff_factor, model.growth_interval,
                          hysteresis_tracker=h if model.hysteresis > 1 else None,
                          hysteresis=model.hysteresis, min_scale=kwargs.get("min_scale"),
                          max_scale=kwargs.get("max_scale"), stats=stats)
        model.step(f)
        got = (s.item(), t.item(), stats.tolist())
        want = (model.scale, model.tracker, [model.skipped, model.streak])
        assert got == want, (i, f, got, want)
        if model.hysteresis > 1:
            assert h.item() == model.hysteresis_left, i


@pytest.mark.parametrize("case", [
    dict(hysteresis=2), dict(hysteresis=5), dict(min_scale=1.0), dict(min_scale=3.0e-3),
    dict(max_scale=2.0 ** 20), dict(max_scale=1000.0), dict(min_scale=1.0, max_scale=1.0),
    dict(hysteresis=3, min_scale=0.75, max_scale=3.0e5), dict(),
])
@pytest.mark.parametrize("growth_interval", [1, 3])
def test_update_scale_extensions_match_model(device, case, growth_interval):
    rng = random.Random(len(str(case)) * 7 + growth_interval)
    for init in [2.0 ** 16, 1.0, 700.0]:
        for p in [0.1, 0.5, 0.9]:
            seq = [1.0 if rng.random() < p else 0.0 for _ in range(250)]
            model = ScaleRuleModel(init, 2.0 if p != 0.5 else 1.6, 0.5 if p != 0.5 else 0.3,
                                   growth_interval, **case)
            run_extended(device, model, case, seq)


def test_update_scale_hysteresis_semantics(device):
    """hysteresis=3: two overflows are tolerated (skipped, not backed off), the third backs off;
    a clean step refills the tolerance; every overflow resets the growth tracker."""
    s, t = scalars(device, 1024.0, tracker=5)
    h = torch.full((), 3, dtype=torch.int32, device=device)
    stats = torch.zeros(2, dtype=torch.int64, device=device)

    def upd(f):
        ops.update_scale_(s, t, found_tensor(f, device), 2.0, 0.5, 100, hysteresis_tracker=h,
                          hysteresis=3, stats=stats)
        return s.item(), t.item(), h.item(), stats.tolist()

    assert upd(1.0) == (1024.0, 0, 2, [1, 1])
    assert upd(1.0) == (1024.0, 0, 1, [2, 2])
    assert upd(1.0) == (512.0, 0, 1, [3, 3])
    assert upd(1.0) == (256.0, 0, 1, [4, 4])
    assert upd(0.0) == (256.0, 1, 3, [4, 0])
    assert upd(1.0) == (256.0, 0, 2, [5, 1])


def test_update_scale_bounds_semantics(device):
    # min_scale: the back-off stops at the floor; a scale already below it stays.
    s, t = scalars(device, 3.0)
    for want in [2.0, 2.0, 2.0]:
        ops.update_scale_(s, t, found_tensor(1.0, device), 2.0, 0.5, 1, min_scale=2.0)
        assert s.item() == want
    s.fill_(1.0)
    ops.update_scale_(s, t, found_tensor(1.0, device), 2.0, 0.5, 1, min_scale=2.0)
    assert s.item() == 1.0
    # max_scale: growth is clamped to the ceiling; a scale already above it stays.
    s.fill_(48.0)
    for want in [64.0, 64.0]:
        ops.update_scale_(s, t, found_tensor(0.0, device), 2.0, 0.5, 1, max_scale=64.0)
        assert s.item() == want
    s.fill_(100.0)
    ops.update_scale_(s, t, found_tensor(0.0, device), 2.0, 0.5, 1, max_scale=64.0)
    assert s.item() == 100.0
    # 0 means unbounded, like None.
    s.fill_(1.0)
    ops.update_scale_(s, t, found_tensor(1.0, device), 2.0, 0.5, 1, min_scale=0.0, max_scale=0.0)
    assert s.item() == 0.5


# --------------------------------------------------------------------------------------------
# opcheck, fake tensors, torch.compile.


def test_opcheck(device):
    g = [torch.randn(3, 5, device=device), torch.randn(4, device=device).bfloat16(),
         torch.randn(7, device=device).half()]
    found = torch.zeros((), device=device)
    inv = torch.full((), 0.5, device=device)
    s, t = scalars(device, 1024.0)
    h = torch.full((), 2, dtype=torch.int32, device=device)
    stats = torch.zeros(2, dtype=torch.int64, device=device)
    cases = [
        (torch.ops.mpext.unscale_.default, (g, found, inv), {}),
        (torch.ops.mpext.unscale_.default, ([], found, inv), {}),
        (torch.ops.mpext.update_scale_.default, (s, t, found, 2.0, 0.5, 3), {}),
        (torch.ops.mpext.update_scale_.default, (s, t, torch.ones((), device=device), 2.0, 0.5, 1),
         {"hysteresis_tracker": h, "hysteresis": 2, "min_scale": 1.0, "max_scale": 1e6,
          "stats": stats}),
    ]
    for op, args, kwargs in cases:
        torch.library.opcheck(op, args, kwargs)


def test_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        g = [torch.empty(4, 6), torch.empty(3, dtype=torch.bfloat16)]
        assert ops.unscale_(g, torch.zeros(()), torch.ones(())) is None
        s, t = torch.ones(()), torch.zeros((), dtype=torch.int32)
        assert ops.update_scale_(s, t, torch.zeros(()), 2.0, 0.5, 10) is None
        with pytest.raises(RuntimeError, match=r"grads\[1\] must have dtype float32 or bfloat16 "
                                                r"or float16, got float64"):
            ops.unscale_([g[0], torch.empty(2, dtype=torch.float64)], torch.zeros(()),
                         torch.ones(()))
        with pytest.raises(ValueError, match=r"growth_interval must be in \[1, 2\^31\), got 0"):
            ops.update_scale_(s, t, torch.zeros(()), 2.0, 0.5, 0)


def test_torch_compile_graph():
    def f(grads, found, inv, s, t):
        ops.unscale_(grads, found, inv)
        ops.update_scale_(s, t, found, 2.0, 0.5, 1)
        return s * 1

    def args():
        return ([torch.tensor([1.0, 2.0, float("inf")]), torch.ones(3).bfloat16()],
                torch.zeros(()), torch.full((), 0.5), torch.full((), 8.0),
                torch.zeros((), dtype=torch.int32))

    eager, compiled = args(), args()
    f(*eager)
    torch.compile(f, backend="eager", fullgraph=True)(*compiled)
    for a, b in zip(eager[0] + list(eager[1:]), compiled[0] + list(compiled[1:])):
        assert torch.equal(raw_bytes(a), raw_bytes(b))
    assert compiled[3].item() == 4.0 and compiled[2].item() == 0.5


# --------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, and nothing modified.


def unscale_case(device):
    grads = [torch.tensor([1.0, float("inf"), 3.0], device=device),
             torch.tensor([2.0, 4.0], device=device).half(),
             torch.tensor([8.0, 16.0, 32.0, 64.0], device=device).bfloat16()]
    return grads, torch.zeros((), device=device), torch.full((), 0.5, device=device)


UNSCALE_BAD = [
    (lambda g, f, i, d: ([g[0], torch.ones(2, dtype=torch.float64, device=d)], f, i),
     RuntimeError, r"unscale_: grads\[1\] must have dtype float32 or bfloat16 or float16, "
                   r"got float64"),
    (lambda g, f, i, d: (g + [torch.ones(2, dtype=torch.int32, device=d)], f, i),
     RuntimeError, r"grads\[3\] must have dtype .* got int32"),
    (lambda g, f, i, d: (g, torch.zeros((), dtype=torch.int32, device=d), i),
     RuntimeError, r"unscale_: found_inf must have dtype float32, got int32"),
    (lambda g, f, i, d: (g, torch.zeros((), dtype=torch.float64, device=d), i),
     RuntimeError, r"found_inf must have dtype float32, got float64"),
    (lambda g, f, i, d: (g, torch.zeros(2, device=d), i),
     RuntimeError, r"unscale_: found_inf must have 1 element, got 2"),
    (lambda g, f, i, d: (g, torch.zeros(0, device=d), i),
     RuntimeError, r"found_inf must have 1 element, got 0"),
    (lambda g, f, i, d: (g, f, torch.full((), 0.5, dtype=torch.float64, device=d)),
     RuntimeError, r"unscale_: inv_scale must have dtype float32, got float64"),
    (lambda g, f, i, d: (g, f, torch.full((2,), 0.5, device=d)),
     RuntimeError, r"inv_scale must have 1 element, got 2"),
    (lambda g, f, i, d: ([g[0], torch.ones(4, 2, device=d)[:, 0]], f, i),
     RuntimeError, r"grads\[1\] must be dense and non-overlapping"),
    (lambda g, f, i, d: ([g[0], torch.ones(1, device=d).expand(5)], f, i),
     RuntimeError, r"grads\[1\] must be dense and non-overlapping"),
    (lambda g, f, i, d: (g + [g[0]], f, i),
     RuntimeError, r"grads\[0\] and grads\[3\] overlap in memory"),
    (lambda g, f, i, d: (g + [g[0][1:]], f, i),
     RuntimeError, r"grads\[0\] and grads\[3\] overlap in memory"),
    (lambda g, f, i, d: (g + [g[2].view(torch.float16)[1:3]], f, i),
     RuntimeError, r"grads\[2\] and grads\[3\] overlap"),
    (lambda g, f, i, d: (g, g[0][2:3], i),
     RuntimeError, r"(grads\[0\] and found_inf|found_inf and grads\[0\]) overlap in memory"),
    (lambda g, f, i, d: (g, f, g[0][0:1]),
     RuntimeError, r"(grads\[0\] and inv_scale|inv_scale and grads\[0\]) overlap in memory"),
    (lambda g, f, i, d: (g, f, f),
     RuntimeError, r"(inv_scale and found_inf|found_inf and inv_scale) overlap in memory"),
    (lambda g, f, i, d: (g + [torch.ones(3, device=d).to_sparse()], f, i),
     RuntimeError, r"grads\[3\] must be a strided \(dense\) tensor"),
]


@pytest.mark.parametrize("mutate,exc,match", UNSCALE_BAD)
def test_unscale_bad_input_changes_nothing(device, mutate, exc, match):
    grads, found, inv = mutate(*unscale_case(device), device)
    dense = [g for g in grads if g.layout == torch.strided]
    before = snapshot(dense + [found, inv])
    with pytest.raises(exc, match=match):
        ops.unscale_(grads, found, inv)
    assert_unchanged(before, dense + [found, inv])


def test_unscale_two_sources_may_share_memory(device):
    """inv_scale is only read, so a flag of 1.0 may serve as inv_scale for two calls, and the
    same read-only inv_scale tensor may back several calls at once."""
    g, f, inv = unscale_case(device)
    ops.unscale_(g[:1], f, inv)
    ops.unscale_(g[1:], f, inv)
    assert f.item() == 1.0


def update_case(device):
    s, t = scalars(device, 1024.0, tracker=3)
    return dict(scale=s, growth_tracker=t, found_inf=found_tensor(1.0, device),
                growth_factor=2.0, backoff_factor=0.5, growth_interval=5,
                hysteresis_tracker=torch.full((), 2, dtype=torch.int32, device=device),
                hysteresis=3, min_scale=None, max_scale=None,
                stats=torch.tensor([4, 1], dtype=torch.int64, device=device))


UPDATE_BAD = [
    (dict(scale=lambda d: torch.ones((), dtype=torch.float64, device=d)), RuntimeError,
     r"update_scale_: scale must have dtype float32, got float64"),
    (dict(scale=lambda d: torch.ones(2, device=d)), RuntimeError,
     r"scale must have 1 element, got 2"),
    (dict(growth_tracker=lambda d: torch.zeros((), dtype=torch.int64, device=d)), RuntimeError,
     r"growth_tracker must have dtype int32, got int64"),
    (dict(growth_tracker=lambda d: torch.zeros(3, dtype=torch.int32, device=d)), RuntimeError,
     r"growth_tracker must have 1 element, got 3"),
    (dict(found_inf=lambda d: torch.ones((), dtype=torch.bool, device=d)), RuntimeError,
     r"found_inf must have dtype float32, got bool"),
    (dict(found_inf=lambda d: torch.ones(2, device=d)), RuntimeError,
     r"found_inf must have 1 element, got 2"),
    (dict(hysteresis_tracker=lambda d: torch.full((), 2, dtype=torch.int64, device=d)),
     RuntimeError, r"hysteresis_tracker must have dtype int32, got int64"),
    (dict(stats=lambda d: torch.zeros(3, dtype=torch.int64, device=d)), RuntimeError,
     r"stats must have 2 elements, got 3"),
    (dict(stats=lambda d: torch.zeros(2, dtype=torch.int32, device=d)), RuntimeError,
     r"stats must have dtype int64, got int32"),
    (dict(growth_factor=0.0), ValueError, r"growth_factor must be a positive finite number"),
    (dict(growth_factor=-2.0), ValueError, r"growth_factor must be a positive finite number"),
    (dict(growth_factor=float("nan")), ValueError, r"growth_factor must be a positive finite"),
    (dict(growth_factor=float("inf")), ValueError, r"growth_factor must be a positive finite"),
    (dict(backoff_factor=0.0), ValueError, r"backoff_factor must be a positive finite number"),
    (dict(backoff_factor=float("nan")), ValueError, r"backoff_factor must be a positive finite"),
    (dict(growth_interval=0), ValueError, r"growth_interval must be in \[1, 2\^31\), got 0"),
    (dict(growth_interval=2 ** 31), ValueError, r"growth_interval must be in \[1, 2\^31\)"),
    (dict(hysteresis=0), ValueError, r"hysteresis must be in \[1, 2\^31\), got 0"),
    (dict(hysteresis_tracker=lambda d: None), ValueError,
     r"hysteresis=3 needs a hysteresis_tracker tensor"),
    (dict(min_scale=-1.0), ValueError, r"min_scale must be a finite number >= 0"),
    (dict(min_scale=float("inf")), ValueError, r"min_scale must be a finite number >= 0"),
    (dict(max_scale=float("nan")), ValueError, r"max_scale must be a finite number >= 0"),
    (dict(min_scale=10.0, max_scale=5.0), ValueError,
     r"min_scale \(10\) must not exceed max_scale \(5\)"),
]


@pytest.mark.parametrize("change,exc,match", UPDATE_BAD)
def test_update_scale_bad_input_changes_nothing(device, change, exc, match):
    kw = update_case(device)
    for k, v in change.items():
        kw[k] = v(device) if callable(v) else v
    tensors = [v for v in kw.values() if isinstance(v, torch.Tensor)]
    before = snapshot(tensors)
    args = [kw.pop(k) for k in ("scale", "growth_tracker", "found_inf", "growth_factor",
                                "backoff_factor", "growth_interval")]
    with pytest.raises(exc, match=match):
        ops.update_scale_(*args, **kw)
    assert_unchanged(before, tensors)


def test_update_scale_aliasing_rejected(device):
    kw = update_case(device)
    s = kw["scale"]
    before = snapshot([s, kw["growth_tracker"], kw["stats"]])
    with pytest.raises(RuntimeError, match=r"(scale and found_inf|found_inf and scale) overlap"):
        ops.update_scale_(s, kw["growth_tracker"], s, 2.0, 0.5, 5)
    both = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match=r"overlap"):
        ops.update_scale_(s, both[0], kw["found_inf"], 2.0, 0.5, 5, hysteresis_tracker=both[0],
                          hysteresis=2)
    tracker_in_stats = kw["stats"].view(torch.int32)[1]
    with pytest.raises(RuntimeError,
                       match=r"(growth_tracker and stats|stats and growth_tracker) overlap"):
        ops.update_scale_(s, tracker_in_stats, kw["found_inf"], 2.0, 0.5, 5, stats=kw["stats"])
    assert_unchanged(before, [s, kw["growth_tracker"], kw["stats"]])
    assert both.tolist() == [0, 0]
