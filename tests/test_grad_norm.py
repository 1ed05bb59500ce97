"""mpext.ops.grad_norm, the multi-tensor L2 norm with an optional fused inv_scale, against
torch.nn.utils.clip_grad_norm_'s total norm (rtol 1e-5) and a float64 reference computed
independently here (rtol 1e-6: the result is a double sum rounded once to fp32). Also: NaN/Inf
propagation, empty lists and zero-size tensors, squares beyond the fp32 range, identical bits
for every thread count (every ISA path: tests/test_fuzz.py's
test_every_cpu_path_gives_identical_bits; CUDA against the CPU: tests/test_cuda_parity.py), bad
input, opcheck, fake tensors, torch.compile."""
import functools
import math

import pytest
import torch

import mpext
from mpext import ops

from conftest import CUDA_OK, HostReads

FLOATS = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 3, 15, 16, 17, 31, 33, 255, 1000, 65535, 65536, 65537, 200003]
SHAPES = [(7, 13), (3, 5, 7, 11), (2, 3, 4, 5, 6), (1, 1), (129, 257)]
INV_SCALES = [None, 2.0 ** -16, 1.0 / 3.0, 3.0]
CUDA_SKIP = pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA device and a CUDA build of mpext")


def inv_tensor(inv, device):
    return None if inv is None else torch.full((), inv, dtype=torch.float32, device=device)


def unscaled_fp32(tensors, inv):
    """The gradients an unscale pass leaves: each value widened to fp32, times inv in fp32."""
    out = []
    for t in tensors:
        y = t.detach().float()
        if inv is not None:
            y = y * torch.tensor(inv, dtype=torch.float32, device=t.device)
        out.append(y)
    return out


def torch_clip_norm(tensors, inv):
    """The total norm torch.nn.utils.clip_grad_norm_ returns for these gradients after an
    unscale (max_norm=inf: nothing is clipped), on copies."""
    ys = [y for y in unscaled_fp32(tensors, inv) if y.numel() > 0]
    if not ys:
        return 0.0
    params = []
    for y in ys:
        p = torch.nn.Parameter(torch.empty_like(y))
        p.grad = y.clone()
        params.append(p)
    return torch.nn.utils.clip_grad_norm_(params, max_norm=float("inf")).item()


def torch_vector_norm(tensors, inv):
    """clip_grad_norm_'s formula spelled out: the vector norm of the per-tensor vector norms."""
    ys = [y for y in unscaled_fp32(tensors, inv) if y.numel() > 0]
    if not ys:
        return 0.0
    return torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(y) for y in ys])).item()


def ref64(tensors, inv):
    """sqrt of the sum of squares in float64 of the fp32 unscaled values, rounded to fp32 at
    the end (so +Inf beyond the fp32 range), as a Python float."""
    s = 0.0
    for y in unscaled_fp32(tensors, inv):
        s += float((y.double().cpu() ** 2).sum())
    return torch.tensor(math.sqrt(s), dtype=torch.float64).float().item()


def ours(tensors, inv, device):
    r = ops.grad_norm(tensors, inv_scale=inv_tensor(inv, device))
    assert r.dtype == torch.float32 and r.shape == () and r.device.type == device
    return r.item()


def assert_close(got, want, rtol, what=""):
    if math.isnan(want):
        assert math.isnan(got), (what, got, want)
    elif math.isinf(want):
        assert got == want, (what, got, want)
    else:
        assert abs(got - want) <= rtol * abs(want), (what, got, want, abs(got - want) / want)


def bits(x: torch.Tensor) -> int:
    return int(x.cpu().view(torch.int32).item())


def randn(shape, dtype, gen, device, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


# --------------------------------------------------------------------------------------------
# Against torch and float64.


@pytest.mark.parametrize("dtype", FLOATS)
def test_sizes_match_torch_and_float64(isa, device, dtype):
    gen = torch.Generator().manual_seed(0)
    for n in SIZES:
        x = randn(n, dtype, gen, device, scale=3.0)
        for inv in INV_SCALES:
            got = ours([x], inv, device)
            assert_close(got, ref64([x], inv), 1e-6, (n, inv))
            assert_close(got, torch_clip_norm([x], inv), 1e-5, (n, inv))


@pytest.mark.parametrize("dtype", FLOATS)
def test_shapes_and_lists_match_clip_grad_norm(isa, device, dtype):
    gen = torch.Generator().manual_seed(1)
    xs = [randn(s, dtype, gen, device, scale=0.01 * (k + 1)) for k, s in enumerate(SHAPES)]
    for inv in INV_SCALES:
        got = ours(xs, inv, device)
        assert_close(got, torch_clip_norm(xs, inv), 1e-5, inv)
        assert_close(got, torch_vector_norm(xs, inv), 1e-5, inv)
        assert_close(got, ref64(xs, inv), 1e-6, inv)


def test_mixed_dtype_list_with_zero_size_tensors(isa, device):
    gen = torch.Generator().manual_seed(2)
    xs = [randn(17, torch.bfloat16, gen, device), torch.empty(0, device=device),
          randn((65, 3), torch.float32, gen, device, 1e-3), torch.empty(3, 0, dtype=torch.half,
                                                                     device=device),
          randn(70001, torch.float16, gen, device, 10.0), randn(1, torch.float32, gen, device)]
    for inv in INV_SCALES:
        got = ours(xs, inv, device)
        assert_close(got, torch_clip_norm(xs, inv), 1e-5, inv)
        assert_close(got, ref64(xs, inv), 1e-6, inv)
        # zero-size tensors contribute nothing: the same bits without them
        nonempty = [x for x in xs if x.numel() > 0]
        assert bits(ops.grad_norm(nonempty, inv_scale=inv_tensor(inv, device))) == \
            bits(ops.grad_norm(xs, inv_scale=inv_tensor(inv, device)))


def test_views_at_offsets_and_layouts(isa, device):
    """Views starting at odd element offsets (any alignment) give the same bits as contiguous
    copies (the summation order depends only on the values' order in memory); permuted dense
    layouts match the references."""
    gen = torch.Generator().manual_seed(3)
    for dtype in FLOATS:
        buf = randn(300000, dtype, gen, device)
        views = [buf[1:38], buf[41:42], buf[45:45], buf[51:100050], buf[100051:299999]]
        copies = [v.clone() for v in views]
        for inv in [None, 0.125]:
            a = ops.grad_norm(views, inv_scale=inv_tensor(inv, device))
            b = ops.grad_norm(copies, inv_scale=inv_tensor(inv, device))
            assert bits(a) == bits(b), dtype
            assert_close(a.item(), torch_clip_norm(views, inv), 1e-5)
    x = torch.randn(2, 6, 5, 7, generator=gen).to(device).to(memory_format=torch.channels_last)
    t = torch.randn(6, 40, generator=gen).half().to(device).t()  # a permuted, dense view
    assert not x.is_contiguous() and not t.is_contiguous()
    for inv in [None, 0.25]:
        got = ours([x, t], inv, device)
        assert_close(got, torch_clip_norm([x, t], inv), 1e-5)
        assert_close(got, ref64([x, t], inv), 1e-6)


def test_many_small_tensors(device):
    gen = torch.Generator().manual_seed(4)
    sizes = torch.randint(1, 300, (2000,), generator=gen).tolist()
    xs = [randn(n, FLOATS[i % 3], gen, device, 1e-2) for i, n in enumerate(sizes)]
    inv = 1.0 / 1024
    got = ours(xs, inv, device)
    assert_close(got, torch_clip_norm(xs, inv), 1e-5)
    assert_close(got, ref64(xs, inv), 1e-6)


def test_all_16bit_values(isa, device):
    """Every finite bf16 / fp16 bit pattern (subnormals included) in one tensor."""
    for dtype in [torch.bfloat16, torch.float16]:
        x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
        x = x[torch.isfinite(x.float())].to(device)
        for inv in [None, 2.0 ** -20, 1.0 / 3.0]:
            got = ours([x], inv, device)
            assert_close(got, ref64([x], inv), 1e-6, (dtype, inv))


def test_subnormal_and_zero_values(isa, device):
    tiny = torch.tensor([1e-45, -1e-45, 1e-40, 2.0 ** -126, 0.0, -0.0] * 7, device=device)
    for inv in [None, 0.5, 2.0 ** 20]:
        assert_close(ours([tiny], inv, device), ref64([tiny], inv), 1e-6, inv)
    assert ours([torch.zeros(1001, device=device)], 0.5, device) == 0.0


# --------------------------------------------------------------------------------------------
# inv_scale before squaring; the range beyond fp32 squares.


def test_inv_scale_is_applied_before_squaring(isa, device):
    """Scaled fp32 gradients whose squares (and whose norm) overflow fp32: multiplied by
    inv_scale first, the result is finite and right. Without inv_scale the norm itself is beyond
    the fp32 range: +Inf."""
    x = torch.full((1000,), 3.0e38, device=device)
    x[::2] = -3.0e38
    inv = 2.0 ** -100
    got = ours([x], inv, device)
    assert math.isfinite(got)
    assert_close(got, ref64([x], inv), 1e-6)
    assert_close(got, torch_clip_norm([x], inv), 1e-5)
    assert ours([x], None, device) == math.inf


def test_squares_beyond_fp32_are_exact(isa, device):
    """Values whose squares overflow fp32 while the norm does not: with inv_scale they match
    torch; without, mpext still gives the exact norm (squares and sums in double), where
    torch's fp32 sum of squares overflows to Inf."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.rand(5001, generator=gen) + 0.5).mul(1e25).to(device)  # x^2 ~ 1e50
    inv = 2.0 ** -60
    got = ours([x], inv, device)
    assert_close(got, torch_clip_norm([x], inv), 1e-5)
    assert_close(got, ref64([x], inv), 1e-6)
    plain = ours([x], None, device)
    assert math.isfinite(plain)
    assert_close(plain, ref64([x], None), 1e-6)
    assert math.isinf(torch_vector_norm([x], None))  # what an fp32 sum of squares gives


def test_product_overflow_with_large_inv_scale(device):
    """float(x) * inv_scale is rounded to fp32 first (as an unscale pass would store it): a
    product beyond the fp32 range is Inf, so the norm is Inf."""
    x = torch.tensor([1.0, 2.0e38], device=device)
    assert ours([x], 4.0, device) == math.inf
    assert ours([x], 1.0, device) == pytest.approx(2.0e38, rel=1e-6)


# --------------------------------------------------------------------------------------------
# NaN / Inf, empty.


@functools.lru_cache(maxsize=None)
def _nan_inf_cases(dtype, device):
    """(what, lists, inv, want, torch's norm) of test_nan_and_inf_anywhere, built once per dtype
    and device: the inputs and torch's reference do not depend on the ISA path, and torch's
    clip_grad_norm_ was three quarters of the test's time when recomputed for every path."""
    gen = torch.Generator().manual_seed(6)
    cases = []
    for n in [1, 7, 17, 33, 130, 65537]:
        for pos in sorted({0, n // 2, n - 1}):
            for bad, want in [(float("nan"), math.nan), (float("inf"), math.inf),
                              (float("-inf"), math.inf)]:
                for where in range(3):
                    xs = [randn(n if k == where else 9, dtype, gen, device) for k in range(3)]
                    xs[where][pos] = bad
                    for inv in [None, 0.5]:
                        cases.append(((n, pos, bad, where), xs, inv, want,
                                      torch_clip_norm(xs, inv)))
    return cases


@pytest.mark.parametrize("dtype", FLOATS)
def test_nan_and_inf_anywhere(isa, device, dtype):
    """One NaN anywhere gives NaN, one +-Inf (and no NaN) +Inf: every position class of odd
    sizes (vector body and tails), in the first, a middle or the last tensor of a list."""
    for what, xs, inv, want, ref in _nan_inf_cases(dtype, device):
        got = ours(xs, inv, device)
        assert_close(got, want, 0, what)
        assert_close(got, ref, 0, what)


def test_nan_result_is_the_canonical_nan(isa, device):
    """Whatever the NaN payloads and signs met (which one the sums meet first depends on the
    ISA path), the result's bits are the canonical quiet NaN 0x7FC00000."""
    payloads = torch.tensor([0x7F800001, 0xFFC00123, 0x7FBFFFFF, 0xFFFFFFFF], dtype=torch.int64)
    for k in range(len(payloads)):
        x = torch.randn(1000)
        x[17 * (k + 1)] = payloads[k:k + 1].to(torch.int32).view(torch.float32)
        x[900] = payloads[(k + 1) % len(payloads):][:1].to(torch.int32).view(torch.float32)
        got = mpext.ops.grad_norm([x.to(device)])
        assert got.view(torch.int32).item() == 0x7FC00000, hex(got.view(torch.int32).item())


def test_nan_wins_over_inf(isa, device):
    x = torch.tensor([1.0, float("inf"), 2.0, float("-inf")], device=device)
    y = torch.tensor([float("nan")], device=device).bfloat16()
    assert math.isnan(ours([x, y], None, device))
    assert math.isnan(ours([y, x], 0.5, device))
    assert ours([x], 0.5, device) == math.inf


def test_nonfinite_inv_scale(device):
    x = torch.tensor([1.0, 2.0], device=device)
    assert ours([x], math.inf, device) == math.inf
    assert math.isnan(ours([x], math.nan, device))
    assert ours([x], 0.0, device) == 0.0


def test_empty(device):
    for r in [ops.grad_norm([], inv_scale=inv_tensor(0.5, device)),
              ops.grad_norm([torch.empty(0, device=device),
                             torch.empty(2, 0, dtype=torch.bfloat16, device=device)]),
              ops.grad_norm([torch.empty(0, dtype=torch.half, device=device)],
                            inv_scale=inv_tensor(0.5, device))]:
        assert r.dtype == torch.float32 and r.shape == () and r.device.type == device
        assert r.item() == 0.0
    r = ops.grad_norm([])  # no tensor at all: the CPU
    assert r.dtype == torch.float32 and r.shape == () and r.device.type == "cpu"
    assert r.item() == 0.0
    assert torch.ops.mpext.grad_norm([]).item() == 0.0


def test_inputs_are_not_modified(isa, device):
    gen = torch.Generator().manual_seed(7)
    xs = [randn(1001, d, gen, device) for d in FLOATS]
    xs[0][5] = float("nan")
    before = [x.clone() for x in xs]
    ops.grad_norm(xs, inv_scale=inv_tensor(0.5, device))
    for a, b in zip(before, xs):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# --------------------------------------------------------------------------------------------
# Determinism: thread counts.


def _determinism_list():
    gen = torch.Generator().manual_seed(8)
    sizes = [int(n) for n in torch.randint(0, 150000, (23,), generator=gen)] + \
        [65536, 65537, 3 * 65536 + 5, 1]
    return [(torch.randn(n, generator=gen) * (1 + k)).to(FLOATS[k % 3])
            for k, n in enumerate(sizes)]


def test_same_bits_for_every_thread_count(threads):
    xs = _determinism_list()
    inv = torch.full((), 1.0 / 3.0)
    results = set()
    for nt in range(1, max(4, torch.get_num_threads()) + 1):
        torch.set_num_threads(nt)
        results.add((bits(ops.grad_norm(xs)), bits(ops.grad_norm(xs, inv_scale=inv))))
    assert len(results) == 1, results
    a, _ = results.pop()
    assert_close(torch.tensor(a, dtype=torch.int32).view(torch.float32).item(), ref64(xs, None),
                 1e-6)


def test_repeated_calls_same_bits(device):
    xs = [x.to(device) for x in _determinism_list()]
    first = bits(ops.grad_norm(xs))
    for _ in range(3):
        assert bits(ops.grad_norm(xs)) == first


# --------------------------------------------------------------------------------------------
# CUDA only.


@CUDA_SKIP
def test_cuda_no_host_sync_and_current_stream():
    """No host synchronisation (torch's sync debug mode set to error, and no Python-level
    reads), and the work goes to the current stream."""
    xs = [torch.randn(100003, device="cuda"), torch.randn(77, device="cuda").bfloat16()]
    inv = torch.full((), 0.25, device="cuda")
    ops.grad_norm(xs, inv_scale=inv)  # warm-up: lazy initialisations
    reads = HostReads()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_sync_debug_mode("error")
    try:
        with reads.counting(), torch.cuda.stream(side):
            r = ops.grad_norm(xs, inv_scale=inv)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    side.synchronize()
    assert reads.calls == []
    assert_close(r.item(), ref64(xs, 0.25), 1e-6)


@CUDA_SKIP
def test_cuda_many_tensors_span_launches():
    """More tensors than one launch's argument holds, and a tensor of several chunks."""
    gen = torch.Generator().manual_seed(9)
    xs = [torch.randn(int(n), generator=gen).cuda()
          for n in torch.randint(1, 3000, (700,), generator=gen)] + [torch.randn(1 << 20).cuda()]
    assert_close(ours(xs, 0.5, "cuda"), ref64(xs, 0.5), 1e-6)


# --------------------------------------------------------------------------------------------
# opcheck, fake tensors, torch.compile.


def test_opcheck(device):
    g = [torch.randn(3, 5, device=device), torch.randn(4, device=device).bfloat16(),
         torch.randn(7, device=device).half()]
    inv = torch.full((), 0.5, device=device)
    cases = [((g,), {}), ((g,), {"inv_scale": inv}), (([],), {"inv_scale": inv}),
             (([torch.empty(0, device=device)],), {})]
    for args, kwargs in cases:
        torch.library.opcheck(torch.ops.mpext.grad_norm.default, args, kwargs)
    torch.library.opcheck(torch.ops.mpext.grad_norm.default, ([],), {})


def test_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        r = ops.grad_norm([torch.empty(4, 6), torch.empty(3, dtype=torch.bfloat16)],
                          inv_scale=torch.ones(()))
        assert r.shape == () and r.dtype == torch.float32
        with pytest.raises(RuntimeError, match=r"tensors\[1\] must have dtype float32 or "
                                                r"bfloat16 or float16, got float64"):
            ops.grad_norm([torch.empty(2), torch.empty(2, dtype=torch.float64)])
        with pytest.raises(RuntimeError, match=r"inv_scale must have 1 element, got 2"):
            ops.grad_norm([torch.empty(2)], inv_scale=torch.ones(2))


def test_torch_compile_graph():
    def clip(grads, inv):
        norm = ops.grad_norm(grads, inv_scale=inv)
        return torch.clamp(1.0 / (norm + 1e-6), max=1.0) * inv, norm

    grads = [torch.tensor([3.0, 4.0, 12.0]), torch.ones(3).bfloat16()]
    inv = torch.full((), 0.5)
    eager = clip(grads, inv)
    compiled = torch.compile(clip, backend="eager", fullgraph=True)(grads, inv)
    for a, b in zip(eager, compiled):
        assert bits(a) == bits(b)
    assert compiled[1].item() == pytest.approx(0.5 * math.sqrt(9 + 16 + 144 + 3), rel=1e-6)


# --------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, nothing modified.


def bad_case(device):
    return [torch.tensor([1.0, 2.0, 3.0], device=device),
            torch.tensor([2.0, 4.0], device=device).half()], torch.full((), 0.5, device=device)


BAD = [
    (lambda g, i, d: ([g[0], torch.ones(2, dtype=torch.float64, device=d)], i),
     r"grad_norm: tensors\[1\] must have dtype float32 or bfloat16 or float16, got float64"),
    (lambda g, i, d: (g + [torch.ones(2, dtype=torch.int32, device=d)], i),
     r"grad_norm: tensors\[2\] must have dtype .* got int32"),
    (lambda g, i, d: (g, torch.full((), 0.5, dtype=torch.float64, device=d)),
     r"grad_norm: inv_scale must have dtype float32, got float64"),
    (lambda g, i, d: (g, torch.full((2,), 0.5, device=d)),
     r"grad_norm: inv_scale must have 1 element, got 2"),
    (lambda g, i, d: (g, torch.full((0,), 0.5, device=d)),
     r"grad_norm: inv_scale must have 1 element, got 0"),
    (lambda g, i, d: ([g[0], torch.ones(4, 2, device=d)[:, 0]], i),
     r"grad_norm: tensors\[1\] must be dense and non-overlapping"),
    (lambda g, i, d: ([g[0], torch.ones(1, device=d).expand(5)], i),
     r"grad_norm: tensors\[1\] must be dense and non-overlapping"),
    (lambda g, i, d: (g + [torch.ones(3, device=d).to_sparse()], i),
     r"grad_norm: tensors\[2\] must be a strided \(dense\) tensor"),
]


@pytest.mark.parametrize("mutate,match", BAD)
def test_bad_input(device, mutate, match):
    tensors, inv = mutate(*bad_case(device), device)
    dense = [t for t in tensors if t.layout == torch.strided]
    before = [t.clone() for t in dense + [inv]]
    with pytest.raises(RuntimeError, match=match):
        ops.grad_norm(tensors, inv_scale=inv)
    for a, b in zip(before, dense + [inv]):
        assert torch.equal(a, b)
