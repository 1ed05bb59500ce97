"""mpext.ops.lion_step_ and mpext.optim.Lion: bit for bit lion-pytorch's Lion on FP32 params (its
order of operations; torch's add(x, alpha=a) is one fused multiply-add, on every length, tails
included), every param storage and moment format of the engine, opcheck and fake kernels,
offsets for sharded stochastic rounding; on every device of the conftest fixture ``device``
(a CUDA step against the reference computed on the CPU, bit for bit: the rule header's explicit
fmas are the same on both tiers). The checks every rule passes in every format are the
rows "lion" of tests/optim_table.py, run by tests/test_optim_table.py."""
import pytest
import torch

import mpext
from mpext import ops
from mpext.optim import Lion

import optim_table as T
from optim_table import f32
from conftest import device_cases

# The reference is lion-pytorch (a test dependency): without it the tests that compare with it
# skip, with the reason, and the others still run (a lent GPU installs nothing).
try:
    from lion_pytorch import Lion as RefLion
    from lion_pytorch.lion_pytorch import update_fn as ref_update
    NO_REFERENCE = None
except ImportError as exc:
    RefLion = ref_update = None
    NO_REFERENCE = "lion-pytorch, the reference, is not installed (%s)" % exc
needs_reference = pytest.mark.skipif(NO_REFERENCE is not None, reason=str(NO_REFERENCE))

# Round-to-nearest master-free params are one of the formats under test: its advice is expected.
pytestmark = pytest.mark.filterwarnings("ignore:.*master_weights=False without stochastic")

# --------------------------------------------------------------------------------------------
# The op against lion-pytorch's update_fn.

SIZES = [1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 100, 511, 512, 513, 1000, 4099]


@needs_reference
@pytest.mark.parametrize("wd", [0.0, 0.1, 1.5])
@pytest.mark.parametrize("betas", [(0.9, 0.99), (0.95, 0.98), (0.0, 1.0), (1.0, 0.5)])
def test_op_bitwise_lion_pytorch(device, wd, betas):
    """The op on the device; lion-pytorch's update on the CPU."""
    gen = torch.Generator().manual_seed(0)
    lr = f32(3e-4)
    for n in SIZES:
        p_ref = torch.randn(n, generator=gen)
        m_ref = torch.zeros(n)
        p, m = p_ref.to(device), m_ref.to(device)
        step = torch.zeros((), device=device)
        for k in range(6):
            g = torch.randn(n, generator=gen) * (10.0 ** (k - 3))
            if k == 4:
                g[::3] = 0.0  # update signs of exactly 0
            ref_update(p_ref, g, m_ref, lr, wd, *betas)
            ops.lion_step_([p], [g.to(device)], [m], [], [step], lr, *betas, wd)
            T.assert_bits(p.cpu(), p_ref, "param n=%d k=%d" % (n, k))
            T.assert_bits(m.cpu(), m_ref, "exp_avg n=%d k=%d" % (n, k))
        assert step.item() == 6


@needs_reference
def test_op_every_isa_path_bitwise_lion_pytorch(isa):
    """On the ISA path of the conftest fixture ``isa``."""
    gen = torch.Generator().manual_seed(1)
    for n in SIZES:
        p, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.01
        p_ref, m_ref = p.clone(), m.clone()
        g = torch.randn(n, generator=gen)
        ref_update(p_ref, g, m_ref, f32(1e-3), 0.2, 0.9, 0.99)
        ops.lion_step_([p], [g], [m], [], [torch.zeros(())], f32(1e-3), 0.9, 0.99, 0.2)
        T.assert_bits(p, p_ref)
        T.assert_bits(m, m_ref)


def test_op_fused_unscale_and_skip(device):
    gen = torch.Generator().manual_seed(3)
    p, m, g = (torch.randn(300, generator=gen).to(device) for _ in range(3))
    a = [p.clone(), m.clone(), (g * 1024).clone()]
    b = [p.clone(), m.clone(), g.clone()]

    def zero():
        return torch.zeros((), device=device)

    ops.lion_step_([a[0]], [a[2]], [a[1]], [], [zero()], 1e-3, inv_scale=torch.tensor(
        1 / 1024, device=device), found_inf=zero(), unscale_grads=True)
    ops.lion_step_([b[0]], [b[2]], [b[1]], [], [zero()], 1e-3)
    for x, y in zip(a, b):
        T.assert_bits(x, y)
    before = [t.clone() for t in a]
    s = zero()
    ops.lion_step_([a[0]], [a[2]], [a[1]], [], [s], 1e-3, found_inf=torch.ones((), device=device))
    for x, y in zip(a, before):
        T.assert_bits(x, y)
    assert s.item() == 0


def _op_case(device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(17, generator=gen)
    params = [torch.randn(33, generator=gen), master.bfloat16(), torch.randn(5).half()]
    grads = [torch.randn(33, generator=gen), torch.randn(17, generator=gen).bfloat16(),
             torch.randn(5, generator=gen)]
    exp_avgs = [torch.zeros(33), torch.zeros(17, dtype=torch.bfloat16), torch.zeros(5)]
    masters = [torch.empty(0), master, params[2].float()]
    steps = [torch.zeros(()) for _ in range(3)]
    return tuple([t.to(device) for t in ts] for ts in (params, grads, exp_avgs, masters, steps))


def test_opcheck(device):
    params, grads, ms, masters, steps = _op_case(device)

    def full(v, *shape, **kw):
        return torch.full(shape, v, device=device, **kw)

    lr, inv = full(1e-3), full(0.5)
    q8p, q8g = (torch.randn(512, device=device) for _ in range(2))
    q8m, q8s = full(0, 512, dtype=torch.int8), full(0.0, 2)
    cases = [
        ((params, grads, ms, masters, steps, lr, 0.9, 0.99, 0.01, False), {}),
        ((params, grads, ms, masters, steps, lr, 0.8, 0.9, 0.1, True),
         {"inv_scale": inv, "found_inf": full(0.0), "unscale_grads": True}),
        ((params, grads, ms, masters, steps, lr, 0.9, 0.99, 0.0, False),
         {"found_inf": full(1.0)}),
        (([q8p], [q8g], [q8m], [], [full(0.0)], lr, 0.9, 0.99, 0.0, False),
         {"exp_avg_scales": [q8s], "offsets": [256]}),
        (([], [], [], [], [], lr, 0.9, 0.99, 0.0, False), {}),
    ]
    for args, kwargs in cases:
        torch.library.opcheck(torch.ops.mpext.lion_step_.default, args, kwargs)


BAD = [
    (dict(beta1=-0.1), ValueError, r"beta1 must be in \[0, 1\], got -0.1"),
    (dict(weight_decay=float("nan")), ValueError, r"weight_decay must be in"),
    (dict(exp_avgs=[]), ValueError, r"exp_avgs must have one entry per param \(1\), got 0"),
    (dict(exp_avgs=[torch.zeros(512, dtype=torch.uint8)]), RuntimeError,
     r"exp_avgs\[0\] must have dtype float32 or bfloat16 or int8, got uint8"),
    (dict(exp_avgs=[torch.zeros(512, dtype=torch.int8)]), ValueError,
     r"exp_avgs\[0\] holds 8-bit codes, which need exp_avg_scales"),
    (dict(exp_avgs=[torch.zeros(512, dtype=torch.int8)], exp_avg_scales=[torch.zeros(2)],
          offsets=[100]), ValueError,
     r"offsets\[0\] \(100\) must be a multiple of block_size \(256\)"),
    (dict(offsets=[-1]), ValueError, r"offsets\[0\] must be >= 0"),
    (dict(offsets=[0, 0]), ValueError, r"offsets must have one entry per param \(1\), got 2"),
]


# Through each device's kernel (the fake kernel checks no argument: tests/test_step_fake.py).
@pytest.mark.parametrize("device,change,exc,match", device_cases(
    BAD, [str(i) for i in range(len(BAD))]))
def test_op_bad_input_changes_nothing(device, change, exc, match):
    base = dict(params=[torch.randn(512)], grads=[torch.randn(512)], exp_avgs=[torch.randn(512)],
                 masters=[], steps=[torch.zeros(())], lr=torch.full((), 1e-3), beta1=0.9,
                 beta2=0.99, weight_decay=0.0)
    T.op_bad_input_changes_nothing(ops.lion_step_, base, change, exc, match, device)


# --------------------------------------------------------------------------------------------
# offsets: a shard draws the random bits of its position in the whole param (the pieces get the
# bits of the whole: tests/test_optim_table.py, test_op_offsets_shards_round_as_the_whole).

def test_offsets_change_the_draws(device):
    """Without the offset the second half would draw the first half's bits: they differ."""
    gen = torch.Generator().manual_seed(5)
    p0 = torch.randn(2048, generator=gen).bfloat16().to(device)
    g = torch.randn(2048, generator=gen).to(device)
    out = []
    for off in (0, 1024):
        p = p0[1024:].clone()
        ops.lion_step_([p], [g[1024:].bfloat16()], [torch.zeros(1024, device=device)], [],
                       [torch.zeros((), device=device)], 1e-2, master_free=True,
                       stochastic_rounding=True, offsets=[off])
        out.append(p)
    assert not torch.equal(out[0], out[1])


# --------------------------------------------------------------------------------------------
# The optimizer class.

@needs_reference
@pytest.mark.parametrize("opts", [dict(), dict(weight_decay=0.1), dict(betas=(0.95, 0.98),
                                                                       weight_decay=1.0),
                                  dict(lr=f32(1e-2), decoupled_weight_decay=True,
                                       weight_decay=1e-4)])
def test_class_bitwise_lion_pytorch(device, opts):
    """mpext's Lion on the device, lion-pytorch's on the CPU."""
    opts = dict(opts)
    opts.setdefault("lr", f32(3e-4))
    gen = torch.Generator().manual_seed(6)
    shapes = [(257, 3), (1,), (64,), (1000,)]
    ws = [torch.randn(s, generator=gen) for s in shapes]
    a = [torch.nn.Parameter(w.to(device, copy=True)) for w in ws]
    b = [torch.nn.Parameter(w.clone()) for w in ws]
    o1, o2 = Lion(a, **opts), RefLion(b, **opts)
    T.lockstep(a, b, o1, o2, gen, 12)
    for x, y in zip(a, b):
        assert x.device.type == device
        T.assert_bits(x.detach().cpu(), y.detach())
        T.assert_bits(o1.state[x]["exp_avg"].cpu(), o2.state[y]["exp_avg"])


def test_class_arguments():
    """Lion's defaults and what the table's error rows (tests/optim_table.py) do not say."""
    p = [torch.nn.Parameter(torch.zeros(3))]
    opt = Lion(p)
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["weight_decay"]) == (1e-4, (0.9, 0.99), 0.0)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1: 1.5"):
        Lion(p, betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="use_triton"):
        Lion(p, use_triton=True)
    with pytest.raises(ValueError, match="exp_avg_dtype must be"):
        Lion(p, exp_avg_dtype=torch.float16)
    assert "Lion" in mpext.optim.__all__

