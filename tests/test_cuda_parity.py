"""CPU <-> CUDA bit equality, through torch: the same inputs through the CPU binding
(csrc/torch/*.cpp) and the CUDA binding (csrc/torch/*_cuda.cpp) give the same bits.

The emulation harness (`make cuda-emu`) runs the CUDA kernels on the CPU against the C core, but
never the CUDA bindings nor torch's dispatch to them; on a GPU these tests do. Each test runs a
case on the CPU and on CUDA and compares every output bit for bit (NaN payloads included):
every rule x format of the optimizers' table (tests/optim_table.py; plain steps, then steps
under mpext.GradScaler with an overflow, with an EMA), gradient release (the step inside
backward, on the autograd engine's CUDA thread), the FP8 ops of mpext.activations, the casts
(stochastic rounding included: its counter-based generator gives the same bits on each device),
unscale_ and update_scale_. Where the kernels' headers say a NaN's payload may differ on the GPU
(the round-to-nearest casts, unscale_, a product such as fp8_dequantize's), NaNs must be at the
same places, any payload. grad_norm is the other exception the kernels document (norm_cuda.h: the
double sums run in another order): within one float32 ulp of the CPU's and of a float64 sum.

The test names say which feature of build_tools/gpu_check.py's summary each counts for
(test_<feature>_...). Without a CUDA device they skip, with the reason.
"""
import warnings

import pytest
import torch

import mpext
from mpext import ops

import optim_table as T
from conftest import cuda_only

pytestmark = cuda_only("compares mpext's CUDA kernels with its CPU kernels bit for bit")

CUDA = "cuda"
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def cpu(x):
    """x with every tensor in it (dicts, lists, tuples) copied to the CPU."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(cpu(v) for v in x)
    return x


INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_bits_but_nan_payloads(a, b, what=""):
    """a and b hold the same bits, except that where a holds a NaN b holds a NaN of any
    payload: what the kernels promise where the GPU's arithmetic or conversion instructions
    make a NaN (its canonical NaN, not the CPU's quieted input; scale_cuda.h, cast_cuda.h)."""
    assert (a.dtype, a.shape) == (b.dtype, b.shape), "%s: %s %s vs %s %s" % (
        what, a.dtype, tuple(a.shape), b.dtype, tuple(b.shape))
    nan_a, nan_b = a.float().isnan(), b.float().isnan()
    assert torch.equal(nan_a, nan_b), "%s: NaNs at different places" % what
    ia = a.contiguous().view(INT_OF_SIZE[a.element_size()])[~nan_a]
    ib = b.contiguous().view(INT_OF_SIZE[b.element_size()])[~nan_b]
    assert torch.equal(ia, ib), "%s: %d elements differ" % (what, int((ia != ib).sum()))


def assert_same(a, b, what="", device=None, nan_payloads=True):
    """b (computed on ``device``, CUDA by default) holds a's bits (a computed on the CPU):
    tensors bit for bit, in the same dtype and shape (NaN payloads aside with
    nan_payloads=False); anything else equal."""
    device = device or CUDA
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and b.device.type == device, \
            "%s: %r is not a tensor on %s" % (what, type(b), device)
        if nan_payloads or not a.is_floating_point():
            T.assert_bits(a, b.cpu(), what)
        else:
            assert_bits_but_nan_payloads(a, b.cpu(), what)
    elif isinstance(a, dict):
        assert sorted(a) == sorted(b), "%s: keys %s vs %s" % (what, sorted(a), sorted(b))
        for k in a:
            assert_same(a[k], b[k], "%s[%r]" % (what, k), device, nan_payloads)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), "%s: %d vs %d entries" % (what, len(a), len(b))
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, "%s[%d]" % (what, i), device, nan_payloads)
    else:
        assert a == b, "%s: %r vs %r" % (what, a, b)


def special_values(n, seed=0):
    """n float32 values: random bit patterns (every exponent, subnormals, NaNs with payloads)
    then zeros, infinities, the float32 and bfloat16/float16 limits and ties."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2 ** 31, 2 ** 31, (n,), generator=gen, dtype=torch.int64)
    x = bits.to(torch.int32).view(F32).clone()
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0,
                            65504.0, 65520.0, -65536.0, 3.4028235e38, 1.1754944e-38, 1e-45,
                            5.960464477539063e-08, 1.00390625, 1.01171875, 448.0, 57344.0,
                            1 + 2 ** -8, 1 + 3 * 2 ** -9])
    x[:special.numel()] = special
    return x


# ---- the optimizers: every rule x format -----------------------------------------------------

PAIRS = list(T.pairs())
PAIR_IDS = [T.pair_id(p) for p in PAIRS]
PLAIN_STEPS, SCALED_STEPS, INF_STEP = 2, 3, 3  # steps 0-1 plain, 2-4 scaled, 3 overflows


def build(rule, fmt, params, **kw):
    with warnings.catch_warnings():  # master-free round to nearest warns, as documented
        warnings.filterwarnings("ignore", message=".*master_weights=False without")
        return rule.make(params, **dict(fmt.kwargs_for(rule), **kw))


def run_pair(rule, fmt, device):
    """The pair's optimizer, with an EMA, over the table's params on ``device``: plain steps,
    then steps under mpext.GradScaler (the fused unscale), one of which overflows (an inf in one
    gradient: the whole step is skipped, the scale backs off). Returns (initial params, per
    step the snapshot of params, state and groups, the scaler's state)."""
    params = [p.detach().to(device).requires_grad_()
              for p in T.make_params(fmt.param_dtypes, rule=rule)]
    initial = [p.detach().clone() for p in params]
    opt = build(rule, fmt, params, ema_decay=0.9)
    scaler = mpext.GradScaler(device, init_scale=2.0 ** 8, growth_interval=1)
    snaps = []
    for s in range(PLAIN_STEPS):
        T.set_grads(params, [g.to(device) for g in T.make_grads(params, s)])
        opt.step()
        snaps.append(T.snapshot(opt, params))
    for s in range(PLAIN_STEPS, PLAIN_STEPS + SCALED_STEPS):
        scale = float(scaler.scale(torch.ones((), device=device)))
        grads = T.make_grads(params, s, scale=scale)
        if s == INF_STEP:
            grads[-1].view(-1)[7] = float("inf")
        T.set_grads(params, [g.to(device) for g in grads])
        scaler.step(opt)
        scaler.update()
        snaps.append(T.snapshot(opt, params))
    return initial, snaps, scaler.state_dict()


@pytest.mark.parametrize("rule,fmt", PAIRS, ids=PAIR_IDS)
def test_table_steps_bitwise_as_the_cpu(rule, fmt):
    """Params, every state tensor (moments in their format, codes and scales, masters,
    remainders, EMA, step counts), the groups after every step, and the scaler: CUDA's bits
    are the CPU's (the rule headers and codecs are shared; stochastic rounding is keyed by
    position, not by device; the overflowing step is skipped on each device alike)."""
    initial, snap_cpu, scaler_cpu = run_pair(rule, fmt, "cpu")
    _, snap_cuda, scaler_cuda = run_pair(rule, fmt, CUDA)
    assert any(not T.same_bits(p, q) for p, q in zip(initial, snap_cpu[-1][0])), "nothing stepped"
    assert_same(snap_cpu, snap_cuda, "%s/%s" % (rule.name, fmt.name))
    assert_same(scaler_cpu, scaler_cuda, "scaler")
    assert scaler_cpu["scale"] < 2.0 ** 8 * 2 ** SCALED_STEPS  # the overflow backed off


# ---- gradient release --------------------------------------------------------------------

def run_release(rule, fmt, device, bucket_bytes):
    """Four released backward passes of a loss whose gradients are exact on every device
    (sum(p * c): the gradient of p is c times the loss scale, a power of two), under
    mpext.GradScaler; every gradient of the third holds an inf, so that pass skips whatever
    the buckets' order. Returns (initial params, snapshot, scaler state, buckets stepped)."""
    params = [p.detach().to(device).requires_grad_()
              for p in T.make_params(fmt.param_dtypes, rule=rule)]
    initial = [p.detach().clone() for p in params]
    opt = build(rule, fmt, params)
    scaler = mpext.GradScaler(device, init_scale=2.0 ** 8, growth_interval=1)
    release = opt.release_grads(scaler=scaler, bucket_bytes=bucket_bytes)
    for s in range(4):
        cs = T.make_grads(params, s)
        if s == 2:
            for c in cs:
                c.view(-1)[0] = float("inf")
        loss = sum((p * c.to(device)).float().sum() for p, c in zip(params, cs))
        release.backward(scaler.scale(loss))
        scaler.update()
    stepped = release.buckets_stepped
    release.remove()
    return initial, T.snapshot(opt, params), scaler.state_dict(), stepped


@pytest.mark.parametrize("bucket_bytes", [0, 2 ** 22], ids=["per-param", "one-bucket"])
@pytest.mark.parametrize("rule,fmt", list(T.covering_pairs()),
                         ids=[T.pair_id(p) for p in T.covering_pairs()])
def test_release_steps_bitwise_as_the_cpu(rule, fmt, bucket_bytes):
    """A released step on CUDA (its hooks on the autograd engine's CUDA thread) gives the
    CPU's released step's bits, per param and in one bucket."""
    initial, snap_cpu, scaler_cpu, n_cpu = run_release(rule, fmt, "cpu", bucket_bytes)
    _, snap_cuda, scaler_cuda, n_cuda = run_release(rule, fmt, CUDA, bucket_bytes)
    assert any(not T.same_bits(p, q) for p, q in zip(initial, snap_cpu[0])), "nothing stepped"
    assert n_cpu == n_cuda
    assert_same(snap_cpu, snap_cuda, "%s/%s" % (rule.name, fmt.name))
    assert_same(scaler_cpu, scaler_cuda, "scaler")


# ---- FP8 (mpext.activations) ---------------------------------------------------------------

FP8_CASES = [(fp8, block, pow2, sr) for fp8 in FP8 for block in (32, 128)
             for pow2 in (False, True) for sr in (False, True)]


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("fp8,block,pow2,sr", FP8_CASES,
                         ids=["%s-%d-%s-%s" % (str(f)[11:], b, "pow2" if p else "exact",
                                               "sr" if s else "rne")
                              for f, b, p, s in FP8_CASES])
def test_activations_fp8_quantize_dequantize_bitwise_as_the_cpu(dtype, fp8, block, pow2, sr):
    """torch.ops.mpext.fp8_quantize (codes and scales) and fp8_dequantize into every output
    dtype: rows of a length no block divides, special values in some blocks, all-zero and
    all-NaN blocks, stochastic rounding at an offset."""
    x = special_values(37 * 300, seed=1).reshape(37, 300)
    gen = torch.Generator().manual_seed(2)
    x[5:] = torch.randn(32, 300, generator=gen) * torch.logspace(-30, 30, 300)
    x[7, :block] = 0.0
    x[8, :block] = float("nan")
    x = x.to(dtype)
    kw = dict(block_size=block, fp8_dtype=fp8, pow2_scale=pow2, stochastic=sr, seed=11,
              offset=3 * 2 ** 33 + 5)
    q, s = torch.ops.mpext.fp8_quantize(x, **kw)
    qc, sc = torch.ops.mpext.fp8_quantize(x.to(CUDA), **kw)
    assert_same((q, s), (qc, sc), "fp8_quantize")  # bit logic (fp8_rule.h): NaN codes too
    for out in (None, F32, BF16, F16):
        y = torch.ops.mpext.fp8_dequantize(q, s, block_size=block, dtype=out)
        yc = torch.ops.mpext.fp8_dequantize(qc, sc, block_size=block, dtype=out)
        assert_same(y, yc, "fp8_dequantize to %s" % out, nan_payloads=False)


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3fn", "e5m2"])
def test_activations_fp8_every_code_dequantizes_as_the_cpu(fp8):
    """Every one of the 256 codes, in blocks with scales from subnormal to huge."""
    q = torch.arange(256, dtype=torch.uint8).repeat(8).reshape(8, 256).view(fp8)
    scales = torch.tensor([2.0 ** -126, 1e-30, 0.5, 1.0, 3.0, 1e10, 2.0 ** 100, 1.5e38])
    scales = scales.reshape(8, 1).repeat(1, 2)  # two blocks of 128 per row
    for out in (F32, BF16, F16):
        y = torch.ops.mpext.fp8_dequantize(q, scales, block_size=128, dtype=out)
        yc = torch.ops.mpext.fp8_dequantize(q.to(CUDA), scales.to(CUDA), block_size=128,
                                            dtype=out)
        assert_same(y, yc, "dequantize %s" % out, nan_payloads=False)


# ---- casts -----------------------------------------------------------------------------------

@pytest.mark.parametrize("stochastic", [False, True], ids=["rne", "sr"])
def test_casts_to_bf16_bitwise_as_the_cpu(stochastic):
    """Stochastic rounding's bits are the CPU's, NaNs included (cast_cuda.h)."""
    x = special_values(1 << 20, seed=3)
    for offset in (0, 12345, 2 ** 40 + 7):
        kw = dict(stochastic=stochastic, seed=2 ** 63 + 9, offset=offset) if stochastic else {}
        assert_same(ops.to_bf16(x, **kw), ops.to_bf16(x.to(CUDA), **kw), "to_bf16 %r" % kw,
                    nan_payloads=stochastic)


def test_casts_to_fp16_and_back_bitwise_as_the_cpu():
    x = special_values(1 << 20, seed=4)
    assert_same(ops.to_fp16(x), ops.to_fp16(x.to(CUDA)), "to_fp16", nan_payloads=False)
    every = torch.arange(2 ** 16, dtype=torch.int32).to(torch.int16)  # every 16-bit pattern
    for dt in (BF16, F16):
        h = every.view(dt)
        assert_same(ops.to_fp32(h), ops.to_fp32(h.to(CUDA)), "to_fp32 from %s" % dt,
                    nan_payloads=False)


@pytest.mark.parametrize("stochastic", [False, True], ids=["rne", "sr"])
def test_casts_multi_tensor_cast_bitwise_as_the_cpu(stochastic):
    """cast_ over a list mixing the pairs it takes (fp32 -> bf16/fp16, back, same dtype),
    odd sizes, a channels_last pair and an empty one; the SR stream runs over the whole list."""
    x = special_values(70001, seed=5)
    srcs = [x[:1000], x[1000:1017], x[2000:4000].to(BF16), x[5000:5001].to(F16), x[6000:6120],
            x[7000:7000], x[8000:8000 + 2 * 3 * 4 * 5].reshape(2, 3, 4, 5).to(
                memory_format=torch.channels_last), x[9000:70001]]
    # stochastic rounding is float32 -> bfloat16 only (cast_ refuses the others)
    dst_dtypes = [BF16, BF16 if stochastic else F16, F32, F32, F32, BF16, BF16, BF16]
    out = []
    for dev in ("cpu", CUDA):
        src = [s.to(dev) for s in srcs]
        dst = [torch.empty_like(s, dtype=d) for s, d in zip(src, dst_dtypes)]
        ops.cast_(dst, src, stochastic=stochastic, seed=77, offset=999)
        out.append(dst)
    for i, (a, b) in enumerate(zip(*out)):  # stochastic pairs bit for bit, NaNs included
        sr = stochastic and srcs[i].dtype == F32 and dst_dtypes[i] == BF16
        assert_same(a, b, "cast_ pair %d" % i, nan_payloads=sr)


# ---- loss scaling --------------------------------------------------------------------------

@pytest.mark.parametrize("inv_scale", [2.0 ** -16, 0.3, 1.0, 7.5e37], ids=str)
@pytest.mark.parametrize("bad", ["finite", "inf", "nan"])
def test_scaler_unscale_bitwise_as_the_cpu(inv_scale, bad):
    """unscale_ over fp32, bf16 and fp16 gradients of odd sizes: the gradients and found_inf."""
    x = special_values(300000, seed=6)
    x = torch.where(torch.isfinite(x), x, torch.zeros(()))  # non-finite only where placed
    grads = [x[:100001], x[100001:100018].to(BF16), x[200000:265536].to(F16),
             x[270000:270000], x[280000:281000].reshape(10, 100)]
    grads = [torch.where(torch.isfinite(g), g, torch.zeros((), dtype=g.dtype)) for g in grads]
    if bad != "finite":
        grads[2][31] = float(bad)
    out = []
    for dev in ("cpu", CUDA):
        g = [t.to(dev, copy=True) for t in grads]
        found = torch.zeros((), device=dev)
        ops.unscale_(g, found, torch.full((), inv_scale, device=dev))
        out.append((g, found))
    assert_same(out[0], out[1], "unscale_", nan_payloads=False)
    assert out[0][1].item() == (0.0 if bad == "finite" else 1.0)


UPDATE_CASES = [dict(), dict(hysteresis=3), dict(min_scale=2.0 ** 10, max_scale=2.0 ** 20),
                dict(hysteresis=2, min_scale=1.0, max_scale=2.0 ** 127)]


@pytest.mark.parametrize("kw", UPDATE_CASES, ids=range(len(UPDATE_CASES)))
def test_scaler_update_scale_bitwise_as_the_cpu(kw):
    """A sequence of clean and overflowing steps from a few starting scales (the largest
    float32 power of two, so growth overflows): scale, trackers and stats at every step."""
    pattern = [0, 0, 1, 0, 1, 1, 1, 0, 0, 0, 1, 0] * 3
    for init in (2.0 ** 16, 3.0, 2.0 ** 127):
        runs = []
        for dev in ("cpu", CUDA):
            scale = torch.full((), init, device=dev)
            tracker = torch.zeros((), dtype=torch.int32, device=dev)
            hyst = torch.full((), kw.get("hysteresis", 1), dtype=torch.int32, device=dev)
            stats = torch.zeros(2, dtype=torch.int64, device=dev)
            seen = []
            for f in pattern:
                ops.update_scale_(scale, tracker, torch.full((), float(f), device=dev), 2.0, 0.5,
                                  2, hysteresis_tracker=hyst, stats=stats, **kw)
                seen.append([t.clone() for t in (scale, tracker, hyst, stats)])
            runs.append(seen)
        assert_same(runs[0], runs[1], "update_scale_ from %g with %r" % (init, kw))


# ---- grad_norm: within a float32 ulp -------------------------------------------------------

def _ulp32(v: float) -> float:
    return max(abs(v) * 2.0 ** -23, 2.0 ** -149)


@pytest.mark.parametrize("inv_scale", [None, 2.0 ** -10, 0.3], ids=str)
def test_norm_grad_norm_within_an_ulp_of_the_cpu(inv_scale):
    """The CUDA and CPU norms differ at most by the rounding of their double sums (another
    order: norm_cuda.h), so by at most one float32 ulp; each is within one ulp of a float64
    sum. NaN and Inf propagate the same."""
    gen = torch.Generator().manual_seed(7)
    tensors = [torch.randn(200003, generator=gen) * 1e3, torch.randn(17, generator=gen).to(BF16),
               (torch.randn(70000, generator=gen) * 1e-3).to(F16), torch.empty(0),
               torch.full((65537,), 3e19)]  # squares beyond float32's range
    runs = []
    for dev in ("cpu", CUDA):
        kw = {} if inv_scale is None else dict(inv_scale=torch.full((), inv_scale, device=dev))
        runs.append(ops.grad_norm([t.to(dev) for t in tensors], **kw))
    got_cpu, got_cuda = runs[0].item(), runs[1].item()
    assert runs[1].device.type == CUDA and runs[1].dtype == F32
    inv = 1.0 if inv_scale is None else inv_scale
    ys = [(t.float() * torch.tensor(inv, dtype=F32)).double() for t in tensors]
    ref = float(torch.sqrt(sum((y * y).sum() for y in ys)).float())
    assert abs(got_cuda - got_cpu) <= _ulp32(got_cpu), (got_cpu, got_cuda)
    assert abs(got_cuda - ref) <= _ulp32(ref), (got_cuda, ref)
    for bad in (float("inf"), float("nan")):
        t = tensors[1].clone()
        t[3] = bad
        a = ops.grad_norm(tensors[:1] + [t])
        b = ops.grad_norm([tensors[0].to(CUDA), t.to(CUDA)])
        assert_same(a, b, "grad_norm with %r" % bad, nan_payloads=False)
        assert (a.isnan() if bad != bad else a == bad).item()
