"""The int8 block code of saved activations as native ops (mpext.ops.int8_block_quantize /
int8_block_dequantize, behind mpext.activations_codes) against the torch-op code they replaced,
kept here as the reference: bit for bit on every dtype, ISA path and device, including the
never-to-zero rule, signs, the 2^-126 floor, power-of-two scales, short last blocks, empty
tensors and NaN/Inf blocks (a NaN is compared as NaN: its payload is not part of the code, and
torch's own vector and scalar paths give different ones); the op under torch.compile gives the
eager bits; bad arguments raise errors that name them; opcheck. The float64 reference of the
code's accuracy is tests/test_activations.py's (test_int8_code_*)."""
import pytest
import torch

import mpext
from mpext import activations_codes as codes
from mpext import ops

QMAX, MIN_SCALE = 127, 2.0 ** -126
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def pow2_up(s):
    """s rounded up to a power of two, exactly (a nonzero mantissa carries into the exponent);
    NaN and Inf unchanged. The torch-op code took exp2(ceil(log2(s))), whose float32 log2
    returns the exponent itself for s a few ulps above a power of two: that rounded down
    (test_the_old_pow2_rounded_down shows it)."""
    bits = s.view(torch.int32)
    up = ((bits + 0x7FFFFF) & 0x7F800000).view(torch.float32)
    return torch.where(torch.isfinite(s), up, s)


def ref_quantize(x, block, pow2=False):
    """The torch-op code of mpext.activations_codes before the native op (pow2 as pow2_up)."""
    cols = codes.block_cols(x.numel(), x.shape[-1], block)
    rows = x.reshape(-1, cols)
    nb = -(-cols // block)
    pad = nb * block - cols
    if pad:  # zeros: they change no block's absmax
        rows = torch.nn.functional.pad(rows, (0, pad))
    y = rows.reshape(-1, nb, block).to(torch.float32, copy=True)
    scales = y.abs().amax(-1, keepdim=True).div_(QMAX).clamp_min_(MIN_SCALE)
    if pow2:
        scales = pow2_up(scales)
    sign = y.sign()
    q = y.div_(scales).round_().clamp_(-QMAX, QMAX)
    q = torch.where(q == 0, sign, q).to(torch.int8).view(-1, nb * block)
    if pad:
        q = q[:, :cols].contiguous()
    return q, scales.view(-1, nb)


def ref_dequantize(q, scales, block, dtype, shape):
    cols, nb = q.shape[-1], scales.shape[-1]
    pad = nb * block - cols
    if pad:
        q = torch.nn.functional.pad(q, (0, pad))
    q3, s = q.view(-1, nb, block), scales.view(-1, nb, 1)
    if dtype == torch.float16:  # a small scale would underflow in half
        out = (q3.float() * s).to(dtype)
    else:  # codes are exact in bfloat16; one rounding of the scale, one of the product
        out = q3.to(dtype) * s.to(dtype)
    out = out.view(-1, nb * block)
    if pad:
        out = out[:, :cols].contiguous()
    return out.view(shape)


def same(got, want):
    """Equal bits, a NaN matching any NaN (of either sign or payload)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.shape, want.shape)
    got, want = got.cpu(), want.cpu()
    if got.is_floating_point():
        gn, wn = torch.isnan(got), torch.isnan(want)
        assert torch.equal(gn, wn), "NaN at %s, want %s" % (gn.nonzero()[:4].tolist(),
                                                            wn.nonzero()[:4].tolist())
        ibits = {4: torch.int32, 2: torch.int16}[got.element_size()]
        got, want = got.view(ibits)[~gn], want.view(ibits)[~wn]
    bad = (got != want).nonzero()
    assert bad.numel() == 0, "%d differ, first at %s: %s, want %s" % (
        bad.shape[0], bad[:3].tolist(), got[tuple(bad[0])].item(), want[tuple(bad[0])].item())


def inputs(shape, dtype, seed, special=False):
    """Blocks of very different sizes, zeros, values far below a step, exact ties of x / scale
    (powers of two times k + 1/2), and optionally NaN / +-Inf in some blocks."""
    n = 1
    for d in shape:
        n *= d
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp2(
        torch.randint(-20, 10, (n,), generator=gen).float().div(4).floor())
    x[::17] = 0
    x[1::29] = -0.0
    x[5::23] *= 1e-6
    x[7::31] = (torch.randint(-127, 127, x[7::31].shape, generator=gen) + 0.5) * 2.0 ** -7
    if special and n > 300:
        x[200] = float("nan")
        x[450 % n] = float("inf")
        x[333 % n] = -float("inf")
    return x.to(dtype).view(shape)


SHAPES = [(128, (128 * 40,)), (128, (5000,)), (32, (999,)), (1, (7,)), (128, (6, 300)),
          (128, (40, 32)), (128, (3, 5, 24)), (64, (4, 130))]


def isa_paths(device):
    """Runs the body once per CPU ISA path this CPU supports (once on CUDA), restoring the
    active one after: the reference is computed once for all of them."""
    if device != "cpu":
        yield None
        return
    previous = mpext.cpu_isa()
    try:
        for name in mpext.build_info()["cpu_isas_compiled"]:
            if mpext.cpu_isa_supported(name):
                mpext.set_cpu_isa(name)
                yield name
    finally:
        mpext.set_cpu_isa(previous)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_op_gives_the_torch_code_bits(device, dtype):
    for block, shape in SHAPES:
        x = inputs(shape, dtype, block + len(shape), special=True).to(device)
        for pow2 in (False, True):
            rq, rs = ref_quantize(x, block, pow2)
            want = [ref_dequantize(rq, rs, block, out, x.shape) for out in DTYPES]
            for isa in isa_paths(device):
                q, s = codes.quantize(x, block, pow2)
                same(q, rq)
                same(s, rs)
                for out, w in zip(DTYPES, want):  # every restore dtype, from the same codes
                    same(codes.dequantize(q, s, block, out, x.shape), w)


def test_every_16bit_input_in_blocks_of_two():
    """Every bf16 and fp16 bit pattern, beside a partner that makes it the absmax or not (on the
    best ISA path: tests/c/test_act_codes.c does so on every one)."""
    for dtype, partner, pow2 in ((torch.bfloat16, 1.0, False), (torch.float16, -2.0 ** -14, True)):
        if True:
            x = torch.empty(65536, 2, dtype=torch.int16)
            x[:, 0] = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
            x[:, 1] = torch.tensor([partner], dtype=dtype).view(torch.int16)
            x = x.view(dtype)
            q, s = ops.int8_block_quantize(x, block_size=2, pow2_scale=pow2)
            rq, rs = ref_quantize(x, 2, pow2)
            same(q, rq)
            same(s, rs)
            same(ops.int8_block_dequantize(q, s, block_size=2, dtype=dtype),
                 ref_dequantize(rq, rs, 2, dtype, x.shape))


def test_pow2_scales_are_the_least_power_of_two_at_or_above_absmax_over_127():
    """Against float64 frexp: 2^ceil(log2(fp32(absmax / 127))) for scales at, a few ulps above
    and well above every power of two. (The torch-op code's exp2(ceil(log2(s))) rounded a scale
    a few ulps above a power of two down to it where its float32 log2 was vectorized: absmax
    then coded as 127 came back up to 16 ulps small.)"""
    import math
    e = torch.arange(-120, 121, dtype=torch.int32)
    s = torch.cat([((e + 127) << 23) + k for k in (0, 1, 3, 16, 0x400000)]).view(torch.float32)
    x = (s.double() * 127).float().view(-1, 1)  # blocks of one element
    _, got = ops.int8_block_quantize(x, block_size=1, pow2_scale=True)
    want = []
    for v in x.view(-1).tolist():
        sc = max(float(torch.tensor(v, dtype=torch.float32) / 127), MIN_SCALE)
        m, ex = math.frexp(sc)
        want.append(sc if m == 0.5 else math.ldexp(1.0, ex))
    assert torch.equal(got.view(-1).double(), torch.tensor(want, dtype=torch.float64))


def near_ties(dtype, count):
    """(absmax, values) pairs: blocks whose scale s = fp32(absmax / 127) makes x * fp32(1 / s)
    round to another integer than x / s for some x of the block (found by enumerating every
    positive bf16 below absmax, or fp32 values a few ulps around (k + 1/2) s)."""
    allpos = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(
        torch.bfloat16).float()
    gen, out = torch.Generator().manual_seed(1), []
    while len(out) < count:
        a = (torch.rand(1, generator=gen) * 4 + 0.5).to(dtype).float()
        s = (a / QMAX).clamp_min(MIN_SCALE)
        if dtype == torch.bfloat16:
            x = allpos[allpos <= a]
        else:
            bits = ((torch.arange(QMAX).float() + 0.5) * s).view(torch.int32)
            x = torch.cat([(bits + d).view(torch.float32) for d in range(-64, 65)])
            x = x[(x > 0) & (x <= a)]
        x = x[torch.round(x / s) != torch.round(x * (1.0 / s))]
        if x.numel():
            out.append((a, x[:64]))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_where_the_product_rounds_otherwise_than_the_quotient(device, dtype):
    """Rows of 1024 in blocks of 128 (the vector paths' blocks) holding elements whose product
    with the inverse scale rounds otherwise than their quotient by the scale: such a block is
    coded by division (mp_i8b_near), and must give the torch-op code's bits."""
    rows = []
    for a, x in near_ties(dtype, 8):
        block = torch.zeros(128)
        block[0] = a
        block[1:1 + x.numel()] = x
        block[64:64 + x.numel()] = -x  # both signs
        rows.append(block)
    x = torch.stack(rows).reshape(-1, 1024).to(dtype).to(device)
    rq, rs = ref_quantize(x, 128)
    # the reference divides; the inverse scale's product would differ here (not vacuous)
    prod = (x.float().view(-1, 8, 128) * (1.0 / rs.view(-1, 8, 1))).round().clamp(-QMAX, QMAX)
    assert not torch.equal(prod.to(torch.int8).view_as(rq).cpu(), rq.cpu())
    for _ in isa_paths(device):
        q, s = ops.int8_block_quantize(x, block_size=128)
        same(s, rs)
        same(q, rq)


@pytest.mark.parametrize("shape", [(0,), (0, 128), (4, 0), (2, 0, 3)])
def test_empty(device, shape):
    x = torch.empty(shape, device=device)
    q, s = ops.int8_block_quantize(x, block_size=128)
    assert q.shape == shape and q.dtype == torch.int8
    assert s.shape == shape[:-1] + (0 if shape[-1] == 0 else 1,)
    out = ops.int8_block_dequantize(q, s, block_size=128, dtype=torch.bfloat16)
    assert out.shape == shape and out.dtype == torch.bfloat16
    q, s = codes.quantize(torch.empty(0, 128, device=device), 128)
    assert codes.dequantize(q, s, 128, torch.float16, (0, 128)).shape == (0, 128)


def test_threads_split_whole_rows(threads):
    """Many rows over several threads: the same bits as one thread (a block never crosses a
    task's rows)."""
    x = inputs((3000, 70), torch.bfloat16, 5)
    torch.set_num_threads(1)
    q1, s1 = ops.int8_block_quantize(x, block_size=32)
    o1 = ops.int8_block_dequantize(q1, s1, block_size=32, dtype=torch.float32)
    torch.set_num_threads(4)
    q4, s4 = ops.int8_block_quantize(x, block_size=32)
    same(q4, q1)
    same(s4, s1)
    same(ops.int8_block_dequantize(q1, s1, block_size=32, dtype=torch.float32), o1)


def test_bad_arguments_name_what_is_wrong(device):
    x = torch.randn(4, 256, device=device)
    with pytest.raises(RuntimeError, match="x must have dtype float32 or bfloat16 or float16, "
                       "got float64"):
        ops.int8_block_quantize(x.double())
    with pytest.raises(RuntimeError, match="x must have dtype .* got int32"):
        ops.int8_block_quantize(x.int())
    for bad in (0, -3):
        with pytest.raises(ValueError, match="block_size must be >= 1, got %d" % bad):
            ops.int8_block_quantize(x, block_size=bad)
    with pytest.raises(TypeError, match="block_size must be an int"):
        ops.int8_block_quantize(x, block_size=128.0)
    with pytest.raises(ValueError, match="x must be contiguous .*strides"):
        ops.int8_block_quantize(x.t())
    with pytest.raises(ValueError, match="at least one dimension"):
        ops.int8_block_quantize(torch.tensor(1.0, device=device))
    with pytest.raises(RuntimeError, match="x must be a strided"):
        ops.int8_block_quantize(x.to_sparse())
    q, s = ops.int8_block_quantize(x, block_size=64)
    q0, s0 = q.clone(), s.clone()
    with pytest.raises(RuntimeError, match="q must have dtype int8, got uint8"):
        ops.int8_block_dequantize(q.view(torch.uint8), s, block_size=64)
    with pytest.raises(RuntimeError, match="scales must have dtype float32, got float64"):
        ops.int8_block_dequantize(q, s.double(), block_size=64)
    with pytest.raises(ValueError, match=r"scales must have shape \[4, 2\] .* got \[4, 4\]"):
        ops.int8_block_dequantize(q, s, block_size=128)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        ops.int8_block_dequantize(q, s, block_size=0)
    with pytest.raises(ValueError, match="q must be contiguous"):
        ops.int8_block_dequantize(q.t(), s.t(), block_size=64)
    with pytest.raises(ValueError, match="scales must be contiguous"):
        ops.int8_block_dequantize(q, s.t().contiguous().t(), block_size=64)
    with pytest.raises(ValueError, match="dtype must be float32, bfloat16 or float16, got "
                       "float64"):
        ops.int8_block_dequantize(q, s, block_size=64, dtype=torch.float64)
    assert torch.equal(q, q0) and torch.equal(s, s0)  # nothing was written


def test_opcheck(device):
    x = inputs((3, 200), torch.bfloat16, 1).to(device)
    torch.library.opcheck(torch.ops.mpext.int8_block_quantize.default, (x,),
                          {"block_size": 64, "pow2_scale": True})
    q, s = ops.int8_block_quantize(x, block_size=64)
    torch.library.opcheck(torch.ops.mpext.int8_block_dequantize.default, (q, s),
                          {"block_size": 64, "dtype": torch.bfloat16})


def test_compiled_gives_the_eager_and_reference_bits(device):
    """mpext.activations_codes under torch.compile (fullgraph: the ops trace through their fake
    kernels, no graph break; inductor calls them, as the compiled saved-tensor hooks do) ==
    eagerly == the torch-op reference, bit for bit. Inductor's fusion of the torch-op code was
    slower inside compiled training steps than the ops (benchmarks/bench_act_codes.py
    --compiled), so both paths run the ops; one case keeps the compile cheap."""
    def roundtrip(x, pow2):
        q, s = codes.quantize(x, 64, pow2)
        return q, s, codes.dequantize(q, s, 64, x.dtype, x.shape)

    compiled = torch.compile(roundtrip, fullgraph=True, dynamic=False)
    x = inputs((6, 300), torch.bfloat16, 7, special=True).to(device)
    got, eager = compiled(x, True), roundtrip(x, True)
    rq, rs = ref_quantize(x, 64, True)
    for g, e, r in zip(got, eager, (rq, rs, ref_dequantize(rq, rs, 64, x.dtype, x.shape))):
        same(g, e)
        same(g, r)
