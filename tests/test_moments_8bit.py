"""8-bit block-quantized Adam moments: mpext.optim.Adam/AdamW(exp_avg_dtype=torch.int8,
exp_avg_sq_dtype=torch.uint8) and adam_step_ with int8/uint8 moments.

References written independently of the kernel (which works on fp32 bits):
- the format restated from its definition: every code's value from a table built in float64,
  the nearest code and the stochastic choice found by comparing against those values, the
  block reference from the absmax in float64;
- a whole step of the quantized algorithm in numpy float32 arithmetic (one rounding per
  operation, in the documented order), with the stochastic-rounding generator of
  tests/reference.py, compared bit for bit with the kernel (every ISA path and thread count give
  the kernel's bits, and a poisoned step writes nothing: the 8-bit rows of the rules x formats
  table, tests/test_optim_table.py).
Then the optimizer: state layout, small params, resume, state_dict across modes, the v floor,
bad options and inputs."""
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

import mpext
from mpext import ops
from mpext.optim import Adam, AdamW, MIN_8BIT_NUMEL, q8_decode, q8_encode

import optim_table as T
from conftest import CUDA_OK
from optim_table import assert_bits as assert_bitwise, assert_opt_unchanged, assert_opts_bitwise
from optim_table import snapshot_opt
from reference import Q8_FMT as FMT, q8_decode_array, q8_encode_array, sr_bits, sr_key
from reference import q8_ref_decode as ref_decode, q8_ref_encode as ref_encode
from reference import q8_ref_exp as ref_exp

I8, U8, F32, BF16, F16 = torch.int8, torch.uint8, torch.float32, torch.bfloat16, torch.float16


# --------------------------------------------------------------------------------------------
# The reference: the documented format (tests/reference.py) and step, restated.

f32 = np.float32


def scalars(lr, b1, b2, eps, wd, decoupled, t, inv_scale):
    """The per-step scalars, from their definition in double (powers exact, via Fraction)."""
    lr = float(f32(lr))
    bc1 = 1.0 - float(Fraction(b1) ** int(t))
    bc2 = 1.0 - float(Fraction(b2) ** int(t))
    w = f32(1.0 - b1)
    r = b1 * b1 / b2 if b2 > 0 else (2.0 if b1 > 0 else 0.0)
    return dict(inv=f32(inv_scale), wd=f32(wd), decay=f32(1.0 - lr * wd) if decoupled else f32(1),
                w=w, rest=f32(f32(1) - w), b2=f32(b2), omb2=f32(1.0 - b2), eps=f32(eps),
                nstep=-f32(lr / bc1), bc2s=f32(math.sqrt(bc2)), decoupled=decoupled,
                inv_k=f32(((1.0 - b2) * (1.0 - r)) / ((1.0 - b1) * (1.0 - b1))) if r < 1
                else f32(0))


def ref_element(g, p, m, v, s, maximize):
    g = f32(g * s["inv"])
    if maximize:
        g = -g
    if s["decoupled"]:
        p = f32(p * s["decay"])
    else:
        g = f32(g + f32(s["wd"] * p))
    diff = f32(g - m)
    m = f32(m + f32(s["w"] * diff)) if s["w"] < 0.5 else f32(g - f32(diff * s["rest"]))
    v = f32(f32(v * s["b2"]) + f32(f32(s["omb2"] * g) * g))
    denom = f32(f32(np.sqrt(v) / s["bc2s"]) + s["eps"])
    return f32(p + f32(f32(s["nstep"] * m) / denom)), m, v


def bf16_bits(x):
    return int(np.array([x], dtype=np.float32).view(np.uint32)[0])


def ref_step(p32, g32, mc, vc, ms, vs, step, hp, block, seed, stream, nearest, sr_param=None):
    """One step of the quantized algorithm on flat numpy arrays: p32 the fp32 value of the param
    (master, joined remainder, or the widened param), g32 the widened grad. Returns the new fp32
    param values and the new codes and scales."""
    n = len(p32)
    t = int(step) + 1
    s = scalars(hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"],
                hp["decoupled"], t, hp.get("inv", 1.0))
    key = sr_key(seed, t, (1 << 33) + stream)
    p_new = np.empty(n, np.float32)
    mc_new, vc_new = np.empty(n, np.uint8), np.empty(n, np.uint8)
    ms_new, vs_new = np.empty(len(ms), np.float32), np.empty(len(vs), np.float32)
    for b in range(len(ms)):
        lo, hi = b * block, min(n, (b + 1) * block)
        em, ev = ref_exp("m", ms[b]), ref_exp("v", vs[b])
        mnew, vnew = np.empty(hi - lo, np.float32), np.empty(hi - lo, np.float32)
        for i in range(lo, hi):
            m = ref_decode("m", int(mc[i]), em)
            v = ref_decode("v", int(vc[i]), ev)
            w = f32(f32(m * m) * s["inv_k"])
            v = w if w > v else v
            p_new[i], mnew[i - lo], vnew[i - lo] = ref_element(g32[i], p32[i], m, v, s,
                                                              hp["maximize"])
        ms_new[b], vs_new[b] = np.abs(mnew).max(), np.abs(vnew).max()
        nem, nev = ref_exp("m", ms_new[b]), ref_exp("v", vs_new[b])
        for i in range(lo, hi):
            r = sr_bits(key, i)
            mc_new[i] = ref_encode("m", mnew[i - lo], nem, r & 0xFFFF, nearest)
            vc_new[i] = ref_encode("v", vnew[i - lo], nev, r >> 16, nearest)
    return p_new, mc_new, vc_new, ms_new, vs_new


# --------------------------------------------------------------------------------------------
# The codec of the state conversions (q8_encode / q8_decode) against the restated format.

def test_codec_against_the_definition_with_error_bounds():
    gen = torch.Generator().manual_seed(1)
    n, block = 4 * 256 + 77, 256
    # blocks of very different scales, heavy tails, zeros, one all-zero block
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3)
    x[256:512] *= 1e-20
    x[512:768] = 0
    x[5] = -0.0
    for kind, dtype, vals in (("m", I8, x), ("v", U8, x * x)):
        codes, scale = q8_encode(vals, dtype, block)
        back = q8_decode(codes, scale)
        c = codes.view(U8).numpy().astype(int)
        # the reference's array forms (tests/optim_table.py's) are its scalar definitions
        ac, ascale = q8_encode_array(kind, vals.numpy(), block)
        assert (ascale == scale.numpy()).all()
        aback = q8_decode_array(kind, ac, ascale, block)
        for b in range(scale.numel()):
            seg = vals[b * block:(b + 1) * block].numpy()
            assert scale[b].item() == float(np.abs(seg).max())
            ea = ref_exp(kind, scale[b].item())
            for i, xv in enumerate(seg):
                k = b * block + i
                want = ref_encode(kind, xv, ea, 0, nearest=True)
                assert c[k] == want == ac[k], (kind, k, xv, ac[k])
                assert aback[k] == ref_decode(kind, want, ea), (kind, k)
                assert back[k].item() == ref_decode(kind, want, ea) or (
                    np.isnan(back[k].item()) and ea == 255)
            # the error bound of a nearest code: half the spacing of the codes around the value
            # (relative 2^-4 above the smallest normal code; absolute half the subnormal step,
            # 2^(-T-3) R, below)
            eb, mb, _ = FMT[kind]
            ref = 2.0 ** (ea - 127)
            err = np.abs(back[b * block:(b + 1) * block].double().numpy() - seg.astype(np.float64))
            bound = np.maximum(np.abs(seg) * 2.0 ** -(mb + 1), ref * 2.0 ** (-(2 ** eb - 1) - mb))
            assert (err <= bound).all(), (kind, b, float((err / bound).max()))
    # -0.0 keeps its sign bit in the signed code
    assert codes.numel() and q8_encode(torch.tensor([-0.0, 1.0]), I8, 32)[0].view(U8)[0] == 0x80


def test_codec_of_nonfinite_block_decodes_to_nan():
    x = torch.ones(64)
    x[3] = float("nan")
    codes, scale = q8_encode(x, I8, 32)
    back = q8_decode(codes, scale)
    assert back[:32].isnan().all() and (back[32:] == 1).all()


# --------------------------------------------------------------------------------------------
# The op against the reference, bit for bit.

HYPER = dict(lr=2e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05, decoupled=True,
             maximize=False)

# (param dtype, grad dtype, storage, numel, block, nearest)
OP_CASES = [
    (F32, F32, "none", 1000, 256, False),
    (BF16, BF16, "master", 777, 32, False),
    (BF16, BF16, "remainder", 4096 + 77, 256, False),
    (BF16, F32, "sr", 3000, 2048, False),
    (F16, F16, "master", 513, 128, True),
    (BF16, BF16, "rne", 700, 64, True),
]


def make_q8_case(pdt, gdt, storage, n, block, seed):
    gen = torch.Generator().manual_seed(seed)
    master = (torch.randn(n, generator=gen) * 0.5).float()
    param = master.to(pdt) if pdt != F32 else master.clone()
    if pdt == BF16:  # a master whose round is the param, as the kernel stores it
        master = mpext.optim.formats.join_remainder(param, mpext.optim.formats.split_master(
            param, master, "test"))
    grad = (torch.randn(n, generator=gen) * 1e-2).to(gdt)
    nb = -(-n // block)
    mc = torch.randint(-128, 128, (n,), generator=gen, dtype=torch.int64).to(I8)
    vc = torch.randint(0, 256, (n,), generator=gen, dtype=torch.int64).to(U8)
    ms = torch.exp(torch.randn(nb, generator=gen) * 4 - 6).float()
    vs = torch.exp(torch.randn(nb, generator=gen) * 4 - 12).float()
    rem = torch.zeros(n, dtype=torch.int16)
    if storage == "remainder":
        rem = mpext.optim.formats.split_master(param, master, "test")
    return dict(param=param, grad=grad, master=master.clone(), rem=rem, mc=mc, vc=vc, ms=ms,
                vs=vs, step=torch.full((), 3.0))


def run_q8_op(c, storage, block, nearest, seed=11, stream=5, inv=None, found_inf=None,
              device="cpu", **hp):
    hp = dict(HYPER, **hp)
    d = {k: v.to(device, copy=True) for k, v in c.items()}
    low = d["param"].dtype != F32
    masters = [d["master"]] if storage == "master" else [torch.empty(0, device=device)]
    ops.adam_step_([d["param"]], [d["grad"]], [d["mc"]], [d["vc"]], masters, [d["step"]],
                   hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"],
                   hp["decoupled"], hp["maximize"], inv_scale=inv, found_inf=found_inf,
                   remainders=[d["rem"]] if storage == "remainder" else None,
                   master_free=low and storage in ("sr", "rne"),
                   stochastic_rounding=storage == "sr", moments_round_nearest=nearest,
                   seed=seed, sr_streams=[stream], exp_avg_scales=[d["ms"]],
                   exp_avg_sq_scales=[d["vs"]], block_size=block)
    return {k: v.cpu() for k, v in d.items()}


def fp32_value(c, storage):
    if storage == "master":
        return c["master"].numpy()
    if storage == "remainder":
        return mpext.optim.formats.join_remainder(c["param"], c["rem"]).numpy()
    return c["param"].float().numpy()


def check_against_reference(c0, c1, pdt, storage, block, nearest, seed=11, stream=5, steps=1):
    """c1 is c0 after the op; every output compared bit for bit with ref_step."""
    p_new, mc, vc, ms, vs = ref_step(fp32_value(c0, storage), c0["grad"].float().numpy(),
                                     c0["mc"].view(U8).numpy(), c0["vc"].numpy(),
                                     c0["ms"].numpy(), c0["vs"].numpy(), c0["step"].item(),
                                     HYPER, block, seed, stream, nearest)
    np.testing.assert_array_equal(c1["mc"].view(U8).numpy(), mc)
    np.testing.assert_array_equal(c1["vc"].numpy(), vc)
    np.testing.assert_array_equal(c1["ms"].numpy().view(np.uint32), ms.view(np.uint32))
    np.testing.assert_array_equal(c1["vs"].numpy().view(np.uint32), vs.view(np.uint32))
    pt = torch.from_numpy(p_new)
    if pdt == F32:
        assert_bitwise(c1["param"], pt)
    elif storage in ("master", "remainder"):
        x = pt.view(torch.int32)
        if pdt == BF16:  # a tie above an even bf16 value is kept one ulp lower
            x = x - (((x & 0x1FFFF) == 0x8000) & ((x & 0x7F800000) != 0x7F800000)).int()
        assert_bitwise(c1["param"], x.view(F32).to(pdt))
        got = c1["master"] if storage == "master" else \
            mpext.optim.formats.join_remainder(c1["param"], c1["rem"])
        assert_bitwise(got, x.view(F32))
    elif storage == "rne":
        assert_bitwise(c1["param"], pt.to(pdt))
    else:  # bf16 stochastic rounding: r's low 16 bits added below the kept half
        key = sr_key(seed, int(c0["step"].item()) + 1, 2 * stream + 1)
        want = [((bf16_bits(v) + (sr_bits(key, i) & 0xFFFF)) >> 16) & 0xFFFF
                for i, v in enumerate(p_new)]
        assert c1["param"].view(torch.int16).numpy().astype(np.uint16).tolist() == want


@pytest.mark.parametrize("case", range(len(OP_CASES)))
def test_op_matches_reference_bitwise(case):
    pdt, gdt, storage, n, block, nearest = OP_CASES[case]
    c = make_q8_case(pdt, gdt, storage, n, block, seed=case)
    for step in range(2):
        c1 = run_q8_op(c, storage, block, nearest)
        check_against_reference(c, c1, pdt, storage, block, nearest)
        c = c1


def test_op_unscales_and_writes_the_grad():
    c = make_q8_case(BF16, BF16, "master", 600, 64, seed=4)
    scaled = dict(c, grad=(c["grad"].float() * 1024).to(BF16))
    c1 = run_q8_op(scaled, "master", 64, False, inv=torch.full((), 1 / 1024))
    c2 = run_q8_op(c, "master", 64, False)
    for k in ("param", "master", "mc", "vc", "ms", "vs"):
        assert_bitwise(c1[k], c2[k], k)


def test_v_floor_bounds_the_update():
    """A block whose large second moment leaves the others' v at code 0 while their m is not:
    without the floor m / (sqrt(v) + eps) would be m / eps."""
    n, lr = 256, 1e-3
    c = dict(param=torch.ones(n), grad=torch.zeros(n), master=torch.empty(0),
             rem=torch.empty(0, dtype=torch.int16),
             mc=torch.full((n,), 0x7F, dtype=I8), vc=torch.zeros(n, dtype=U8),
             ms=torch.tensor([1e-3]), vs=torch.tensor([1.0]), step=torch.full((), 9.0))
    c["mc"][0], c["vc"][0] = 0, 0xFF
    k = 0.01 / (0.001 * (1 - 0.81 / 0.999))
    for t in (10, 11):  # the raised v is below the block's range again: the floor holds twice
        c1 = run_q8_op(c, "none", 256, False, lr=lr, beta1=0.9, beta2=0.999, weight_decay=0.0)
        bound = lr * math.sqrt(k) * math.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
        upd = (c1["param"][1:] - c["param"][1:]).abs()
        assert 0 < upd.max().item() <= bound * 1.001, t
        c = c1


# --------------------------------------------------------------------------------------------
# The op's argument checks: a clear error, nothing written; the fake kernel says the same.

def q8_call_args(device="cpu", n=300, block=64):
    p = torch.randn(n, device=device)
    return dict(params=[p], grads=[torch.randn(n, device=device)],
                exp_avgs=[torch.zeros(n, dtype=I8, device=device)],
                exp_avg_sqs=[torch.zeros(n, dtype=U8, device=device)], masters=[],
                steps=[torch.zeros((), device=device)],
                exp_avg_scales=[torch.zeros(-(-n // block), device=device)],
                exp_avg_sq_scales=[torch.zeros(-(-n // block), device=device)], block_size=block)


def call_op(a):
    ops.adam_step_(a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], a["masters"],
                   a["steps"], 1e-3, 0.9, 0.999, 1e-8, 0.0, True, False,
                   exp_avg_scales=a["exp_avg_scales"], exp_avg_sq_scales=a["exp_avg_sq_scales"],
                   block_size=a["block_size"])


OP_BAD = [
    (lambda a: a.update(block_size=48), ValueError,
     r"block_size must be a power of two in \[32, 2048\], got 48"),
    (lambda a: a.update(block_size=4096), ValueError, r"block_size must be a power of two"),
    (lambda a: a.update(block_size=16), ValueError, r"block_size must be a power of two"),
    (lambda a: a.update(exp_avg_scales=None), ValueError,
     r"exp_avgs\[0\] holds 8-bit codes, which need exp_avg_scales \(one float32 scale per "
     r"block of 64 elements\); got none"),
    (lambda a: a.update(exp_avg_sq_scales=[]), ValueError,
     r"exp_avgs\[0\] holds 8-bit codes, which need exp_avg_sq_scales"),
    (lambda a: a["exp_avg_scales"].__setitem__(0, torch.zeros(4)), ValueError,
     r"exp_avg_scales\[0\] must have 5 elements \(one per block of 64 elements of "
     r"params\[0\]\), got 4"),
    (lambda a: a["exp_avg_sq_scales"].__setitem__(0, torch.zeros(5, dtype=torch.float64)),
     RuntimeError, r"exp_avg_sq_scales\[0\] must have dtype float32, got float64"),
    (lambda a: a["exp_avg_scales"].__setitem__(0, torch.zeros(10)[::2]), RuntimeError,
     r"exp_avg_scales\[0\] must be dense and non-overlapping"),
    (lambda a: a.update(exp_avg_scales=[]), ValueError, r"need exp_avg_scales"),
    (lambda a: a.update(exp_avg_scales=a["exp_avg_scales"] * 2), ValueError,
     r"exp_avg_scales must be empty or have one entry per param \(1\), got 2"),
    (lambda a: a["exp_avg_sqs"].__setitem__(0, torch.zeros(300)), RuntimeError,
     r"exp_avgs\[0\] is int8 \(8-bit moment codes\), so exp_avg_sqs\[0\] must be uint8, got "
     r"float32"),
    (lambda a: a["exp_avgs"].__setitem__(0, torch.zeros(300, dtype=BF16)), RuntimeError,
     r"exp_avg_sqs\[0\] is uint8 \(8-bit moment codes\), so exp_avgs\[0\] must be int8, got "
     r"bfloat16"),
    (lambda a: a["exp_avgs"].__setitem__(0, torch.zeros(300, dtype=U8)), RuntimeError,
     r"exp_avgs\[0\] must have dtype float32 or bfloat16 or int8, got uint8"),
    (lambda a: (a["exp_avgs"].__setitem__(0, torch.zeros(300)),
                a["exp_avg_sqs"].__setitem__(0, torch.zeros(300))), ValueError,
     r"exp_avg_scales\[0\] must be an empty tensor \(exp_avgs\[0\] is not 8-bit\), got 5 "
     r"elements"),
    (lambda a: a["exp_avg_scales"].__setitem__(0, a["exp_avg_sq_scales"][0]), RuntimeError,
     r"overlap"),
]


@pytest.mark.parametrize("case", range(len(OP_BAD)))
def test_op_bad_input_changes_nothing(case):
    change, exc, match = OP_BAD[case]
    a = q8_call_args()
    change(a)
    before = [t.clone() for k in ("params", "exp_avgs", "exp_avg_sqs", "steps")
              for t in a[k]] + [t.clone() for t in a["exp_avg_scales"] or []]
    with pytest.raises(exc, match=match):
        call_op(a)
    after = [t for k in ("params", "exp_avgs", "exp_avg_sqs", "steps")
             for t in a[k]] + list(a["exp_avg_scales"] or [])
    for x, y in zip(before, after):
        assert_bitwise(x, y)


def test_opcheck():
    a = q8_call_args(n=700, block=128)
    a["exp_avgs"][0] = torch.randint(-128, 128, (700,), dtype=I8)
    a["exp_avg_scales"][0].fill_(0.5)
    torch.library.opcheck(torch.ops.mpext.adam_step_.default,
                          (a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"],
                           a["masters"], a["steps"], torch.full((), 1e-3), 0.9, 0.999, 1e-8, 0.0,
                           True, False),
                          dict(exp_avg_scales=a["exp_avg_scales"],
                               exp_avg_sq_scales=a["exp_avg_sq_scales"], block_size=128))


# --------------------------------------------------------------------------------------------
# The optimizers.

Q8 = dict(exp_avg_dtype=I8, exp_avg_sq_dtype=U8)


def model_params(dtype=BF16, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(64, 96), (96,), (40, 40, 3), (5000,)]
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(dtype).to(device))
            for s in shapes]


def set_grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype).to(p.device)


def train(opt, params, steps, first=0, scaler=None):
    for k in range(first, first + steps):
        set_grads(params, 1000 + k)
        opt.step()




@pytest.mark.parametrize("name", ["q8", "object"])
def test_moment_formats_by_their_names(name):
    """The 8-bit code by its format name ("q8" for both moments) or its object is the
    int8 / uint8 pair: the groups keep those dtypes, state_dict() names them as before, and the
    steps are bitwise the dtypes' steps; the value formats' names and objects are theirs."""
    fmt = "q8" if name == "q8" else mpext.optim.formats.Q8
    a, b = model_params(), model_params()
    oa = AdamW(a, lr=1e-3, **Q8)
    ob = AdamW(b, lr=1e-3, exp_avg_dtype=fmt, exp_avg_sq_dtype=fmt)
    assert ob.param_groups[0]["exp_avg_dtype"] is I8
    assert ob.param_groups[0]["exp_avg_sq_dtype"] is U8
    train(oa, a, 3)
    train(ob, b, 3)
    assert_opts_bitwise(oa, ob)
    group = ob.state_dict()["param_groups"][0]
    assert (group["exp_avg_dtype"], group["exp_avg_sq_dtype"]) == ("int8", "uint8")
    for value, dtype in ((mpext.optim.formats.BF16, BF16), (mpext.optim.formats.FP32, F32),
                         ("bfloat16", BF16)):
        ob.param_groups[0]["exp_avg_dtype"] = ob.param_groups[0]["exp_avg_sq_dtype"] = value
        train(ob, b, 1, first=3)
        assert ob.param_groups[0]["exp_avg_dtype"] is dtype
        assert ob.state[b[-1]]["exp_avg"].dtype == dtype and "exp_avg_q8" not in ob.state[b[-1]]
    with pytest.raises(ValueError, match=r"8-bit moments come as a pair"):
        AdamW(model_params(), exp_avg_dtype="q8")


def test_optimizer_step_is_the_op_step():
    """One optimizer step equals adam_step_ on the same state (the optimizer adds nothing)."""
    params = model_params(F32)
    opt = AdamW(params, lr=1e-3, **Q8, block_size=64)
    train(opt, params, 3)
    p = params[0]
    st = {k: v.clone() for k, v in opt.state[p].items()}
    before = p.detach().clone()
    set_grads(params, 77)
    opt.step()
    c = dict(param=before, grad=p.grad, master=torch.empty(0), rem=torch.empty(0),
             mc=st["exp_avg_q8"].view(-1), vc=st["exp_avg_sq_q8"].view(-1),
             ms=st["exp_avg_q8_scale"], vs=st["exp_avg_sq_q8_scale"], step=st["step"])
    c1 = run_q8_op({k: v.reshape(-1) if k in ("param", "grad") else v for k, v in c.items()},
                   "none", 64, False, seed=0, stream=0, lr=1e-3, beta1=0.9, beta2=0.999,
                   weight_decay=1e-2)
    assert_bitwise(c1["param"], p.detach().reshape(-1))
    assert_bitwise(c1["mc"], opt.state[p]["exp_avg_q8"].view(-1))


def test_state_dict_across_modes_both_ways():
    """A checkpoint loads into the loading optimizer's moment storage (its dtypes and block
    size are storage settings): fp32 moments quantized to the nearest code, codes decoded
    exactly (then rounded to bf16), a torch AdamW checkpoint into 8-bit codes."""
    params = model_params(F32)
    fp32 = AdamW(params, lr=1e-3)
    train(fp32, params, 3)
    sd32 = fp32.state_dict()
    q8 = AdamW(params, lr=1e-3, **Q8, block_size=128)
    q8.load_state_dict(sd32)
    assert q8.param_groups[0]["block_size"] == 128
    st = q8.state[params[0]]
    for q in AdamW.moments:  # the nearest codes, by the restated format (tests/reference.py)
        T.assert_nearest_q8(st, q, fp32.state[params[0]][q.name], 128, "fp32 into q8")
    sd8 = q8.state_dict()
    for dt in (F32, BF16):
        other = AdamW(params, lr=1e-3, exp_avg_dtype=dt, exp_avg_sq_dtype=dt)
        other.load_state_dict(sd8)
        want = q8_decode(st["exp_avg_sq_q8"], st["exp_avg_sq_q8_scale"]).to(dt)
        assert_bitwise(other.state[params[0]]["exp_avg_sq"], want)
        assert "exp_avg_sq_q8_scale" not in other.state[params[0]]
    tparams = model_params(F32)
    torch_opt = torch.optim.AdamW(tparams, lr=1e-3)
    train(torch_opt, tparams, 2)
    q = AdamW(tparams, lr=1e-3, **Q8)
    q.load_state_dict(torch_opt.state_dict())
    assert q.state[tparams[0]]["exp_avg_q8"].dtype == I8
    train(q, tparams, 2, first=2)
    assert q.state[tparams[0]]["exp_avg_q8"].dtype == I8


def test_checkpoint_loads_into_the_optimizers_block_size_and_group_change_requantizes():
    params = model_params(F32)
    opt = AdamW(params, lr=1e-3, **Q8, block_size=64)
    train(opt, params, 2)
    same = AdamW(model_params(F32), lr=1e-3, **Q8, block_size=64)
    params2 = same.param_groups[0]["params"]
    with torch.no_grad():
        for a, b in zip(params2, params):
            a.copy_(b)
    same.load_state_dict(opt.state_dict())  # the same block size: resumes bit for bit
    other = AdamW(params2, lr=1e-3, **Q8)  # block 256: the checkpoint's codes are re-made
    other.load_state_dict(opt.state_dict())
    assert other.param_groups[0]["block_size"] == 256
    st = opt.state[params[0]]
    want = q8_encode(q8_decode(st["exp_avg_q8"], st["exp_avg_q8_scale"]), I8, 256)
    assert_bitwise(other.state[params2[0]]["exp_avg_q8"], want[0])
    train(opt, params, 1, first=2)
    train(same, params2, 1, first=2)
    assert_opts_bitwise(opt, same)
    # a group's block size changed between steps: the codes are re-made at the next step
    st = opt.state[params[0]]
    want_m = q8_encode(q8_decode(st["exp_avg_q8"], st["exp_avg_q8_scale"]), I8, 512)
    opt.param_groups[0]["block_size"] = 512
    snap = [p.detach().clone() for p in params]
    opt.step(found_inf=torch.ones(()))  # a skipped step: converts, then writes nothing
    assert_bitwise(opt.state[params[0]]["exp_avg_q8"], want_m[0])
    assert opt.state[params[0]]["exp_avg_q8_scale"].numel() == -(-params[0].numel() // 512)
    for p, x in zip(params, snap):
        assert_bitwise(p.detach(), x)
    train(opt, params, 1, first=3)


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_small_updates_survive_in_expectation(rounding):
    """The 8-bit second moment decays by beta2 = 0.999 per step on average, as in FP32; round
    to nearest holds it still (0.999 is within half a code step of 1). The mean of 2^15
    independent roundings has a relative standard deviation near 0.3% after 200 steps: the 2%
    tolerance is more than 6 of them, and 9 times less than what nearest rounding loses."""
    n = 1 << 15
    params = [torch.nn.Parameter(torch.zeros(n))]
    opt = Adam(params, lr=0.0, betas=(0.9, 0.999), moment_rounding=rounding, **Q8)
    params[0].grad = torch.full((n,), 1.0)
    opt.step()
    v0 = q8_decode(opt.state[params[0]]["exp_avg_sq_q8"],
                   opt.state[params[0]]["exp_avg_sq_q8_scale"]).double().mean().item()
    params[0].grad = torch.zeros(n)
    for _ in range(200):
        opt.step()
    v = q8_decode(opt.state[params[0]]["exp_avg_sq_q8"],
                  opt.state[params[0]]["exp_avg_sq_q8_scale"]).double().mean().item()
    if rounding == "stochastic":
        assert v == pytest.approx(v0 * 0.999 ** 200, rel=0.02)
    else:
        assert v == pytest.approx(v0, rel=0.02)


BAD_OPTIONS = [
    (dict(exp_avg_dtype=I8), ValueError, r"8-bit moments come as a pair: exp_avg_dtype="
     r"torch.int8 with exp_avg_sq_dtype=torch.uint8, got torch.int8 and torch.float32"),
    (dict(exp_avg_sq_dtype=U8, exp_avg_dtype=BF16), ValueError, r"come as a pair"),
    (dict(exp_avg_dtype=U8, exp_avg_sq_dtype=I8), ValueError,
     r"exp_avg_dtype must be torch.float32, torch.bfloat16 or torch.int8, got torch.uint8"),
    (dict(Q8, block_size=100), ValueError,
     r"block_size must be a power of two in \[32, 2048\], got 100"),
    (dict(Q8, block_size=4096), ValueError, r"block_size must be a power of two"),
    (dict(Q8, block_size=256.0), ValueError, r"block_size must be a power of two"),
    (dict(Q8, block_size=True), ValueError, r"block_size must be a power of two"),
]


@pytest.mark.parametrize("case", range(len(BAD_OPTIONS)))
def test_bad_options_are_refused(case):
    kw, exc, match = BAD_OPTIONS[case]
    with pytest.raises(exc, match=match):
        AdamW(model_params(), **kw)


def test_bad_group_change_changes_nothing():
    params = model_params()
    opt = AdamW(params, lr=1e-3, **Q8)
    train(opt, params, 1)
    snap = snapshot_opt(opt)
    opt.param_groups[0]["block_size"] = 3
    set_grads(params, 9)
    with pytest.raises(ValueError, match=r"block_size must be a power of two"):
        opt.step()
    assert_opt_unchanged(opt, snap)


def test_bad_checkpoint_scales_are_refused():
    params = model_params(F32)
    opt = AdamW(params, lr=1e-3, **Q8)
    train(opt, params, 1)
    sd = opt.state_dict()
    sd["state"][0]["exp_avg_q8_scale"] = torch.zeros(7)  # no power-of-two block gives 7 blocks
    with pytest.raises(ValueError, match=r"exp_avg_q8 holds 8-bit codes, so exp_avg_q8_scale "
                                         r"must be a 1-D float32 tensor of one scale per block"):
        AdamW(params, lr=1e-3, **Q8).load_state_dict(sd)


def test_mixed_precision_optimizer_takes_8bit_moments():
    model = torch.nn.Linear(128, 64).to(BF16)
    inner = AdamW(model.parameters(), lr=1e-3, **Q8)
    opt = mpext.MixedPrecisionOptimizer(inner)
    x = torch.randn(8, 128, dtype=BF16)
    for _ in range(2):
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    st = inner.state[inner.param_groups[0]["params"][0]]
    assert st["exp_avg_q8"].dtype == I8 and st["exp_avg_q8_scale"].numel() == 32


@pytest.mark.skipif(not CUDA_OK, reason="no CUDA device")
def test_cuda_same_bits_as_cpu():
    for case in range(len(OP_CASES)):
        pdt, gdt, storage, n, block, nearest = OP_CASES[case]
        c = make_q8_case(pdt, gdt, storage, n, block, seed=case)
        a = run_q8_op(c, storage, block, nearest)
        b = run_q8_op(c, storage, block, nearest, device="cuda")
        for k in a:
            assert_bitwise(a[k], b[k], k)


def test_codes_saved_in_another_memory_layout():
    """Blocks follow memory order: 8-bit codes saved for a channels_last param and loaded for
    a contiguous one (and back) are decoded in their own layout and requantized in the
    param's: the codes are in the param's layout, every element keeps its value (to the
    nearest code) at its logical index, and loaded into fp32 moments the values are exact."""
    torch.manual_seed(0)
    p = torch.randn(4, 16, 8, 8).to(BF16).to(memory_format=torch.channels_last)
    p.requires_grad_()
    opt = AdamW([p], lr=1e-3, **Q8)
    g = torch.randn(4, 16, 8, 8)
    g[0, 0] = torch.arange(1.0, 65.0).view(8, 8)  # a logical pattern the layouts place apart
    p.grad = g.to(BF16).to(memory_format=torch.channels_last)
    opt.step()
    st = opt.state[p]
    saved = {k: q8_decode(st[k + "_q8"], st[k + "_q8_scale"]) for k in ("exp_avg", "exp_avg_sq")}
    for fmt in (torch.contiguous_format, torch.channels_last):
        q = p.detach().clone(memory_format=fmt).requires_grad_()
        o2 = AdamW([q], lr=1e-3, **Q8)
        o2.load_state_dict(opt.state_dict())
        s2 = o2.state[q]
        for k in ("exp_avg", "exp_avg_sq"):
            codes = s2[k + "_q8"]
            assert codes.stride() == q.stride(), (fmt, k)  # in the param's layout
            got = q8_decode(codes, s2[k + "_q8_scale"])
            want_codes, want_scale = q8_encode(
                torch.empty_like(q, dtype=torch.float32).copy_(saved[k]), codes.dtype, 256)
            assert torch.equal(got, q8_decode(want_codes, want_scale)), (fmt, k)
            # the ramp, the largest values of their blocks in either layout: within a code step
            assert torch.allclose(got[0, 0], saved[k][0, 0], rtol=2 ** -4, atol=0), (fmt, k)
        # and fp32 moments: the exact decoded values, at their logical indices
        o3 = AdamW([q], lr=1e-3)
        o3.load_state_dict(opt.state_dict())
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(o3.state[q][k], saved[k]), (fmt, k)


def _old_layout(sd):
    """A state_dict as mpext wrote it before coded state had keys of its own: 8-bit codes under
    the moment's name, their scales under "<moment>_scale"."""
    sd = {"state": {k: dict(v) for k, v in sd["state"].items()},
          "param_groups": [dict(g) for g in sd["param_groups"]]}
    for st in sd["state"].values():
        for m in ("exp_avg", "exp_avg_sq"):
            if m + "_q8" in st:
                st[m] = st.pop(m + "_q8")
                st[m + "_scale"] = st.pop(m + "_q8_scale")
    return sd


def test_checkpoints_with_codes_under_the_moment_names_still_load():
    params = model_params(F32)
    opt = AdamW(params, lr=1e-3, **Q8)
    train(opt, params, 2)
    old = _old_layout(opt.state_dict())
    assert old["state"][0]["exp_avg"].dtype == I8 and "exp_avg_scale" in old["state"][0]
    same = AdamW(params, lr=1e-3, **Q8)
    same.load_state_dict(old)
    for p in params:
        assert same.state[p].keys() == opt.state[p].keys()
        for k, v in opt.state[p].items():
            assert_bitwise(same.state[p][k], v, k)
    fp32 = AdamW(params, lr=1e-3)
    fp32.load_state_dict(old)
    st = opt.state[params[0]]
    assert_bitwise(fp32.state[params[0]]["exp_avg"],
                   q8_decode(st["exp_avg_q8"], st["exp_avg_q8_scale"]))
    assert set(fp32.state[params[0]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_torch_adamw_never_takes_codes_for_moments():
    """torch.optim.AdamW loading an 8-bit state finds no exp_avg and fails at its first step,
    before writing anything, instead of stepping with codes as moment values; the other way,
    torch's state becomes codes of its moments."""
    params = model_params(F32)
    opt = AdamW(params, lr=1e-3, **Q8)
    train(opt, params, 2)
    tparams = [torch.nn.Parameter(p.detach().clone()) for p in params]
    topt = torch.optim.AdamW(tparams, lr=1e-3)
    topt.load_state_dict(opt.state_dict())
    before = [p.detach().clone() for p in tparams]
    set_grads(tparams, 5)
    with pytest.raises(KeyError, match="exp_avg"):
        topt.step()
    for p, b in zip(tparams, before):
        assert_bitwise(p.detach(), b)
    ref = torch.optim.AdamW(tparams, lr=1e-3)
    train(ref, tparams, 2)
    back = AdamW(tparams, lr=1e-3, **Q8)
    back.load_state_dict(ref.state_dict())
    codes, scale = q8_encode(ref.state[tparams[0]]["exp_avg"], I8, 256)
    assert_bitwise(back.state[tparams[0]]["exp_avg_q8"], codes)
    assert_bitwise(back.state[tparams[0]]["exp_avg_q8_scale"], scale)
