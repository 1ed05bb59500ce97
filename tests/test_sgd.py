"""mpext.ops.sgd_step_ and mpext.optim.SGD: torch.optim.SGD's arguments, checks and math (within
Adam's parity tolerances; on this build's CPU kernels the bits agree too), the buffer's first
step as torch's clone (the table's "sgd" row has a dampening, which the first step must not
apply), momentum=0 keeping no buffer, every param storage and buffer format,
opcheck and fake kernels, offsets. The checks every rule passes in every format are the rows
"sgd" (a buffer in every format) and "sgd-plain" (none) of tests/optim_table.py, run by
tests/test_optim_table.py. Every test of the op or the class runs on each device of the conftest
fixture ``device``, against torch's SGD on the CPU (the rule header's explicit fmas are the same
on both tiers, so the bits agree there too)."""
import pytest
import torch

import mpext
from mpext import ops
from mpext.optim import SGD

import optim_table as T
from conftest import device_cases

# Round-to-nearest master-free params are one of the formats under test: its advice is expected.
pytestmark = pytest.mark.filterwarnings("ignore:.*master_weights=False without stochastic")

CONFIGS = [dict(), dict(momentum=0.9), dict(momentum=0.9, dampening=0.1),
           dict(momentum=0.9, nesterov=True, weight_decay=1e-2),
           dict(momentum=0.5, weight_decay=0.1, maximize=True), dict(weight_decay=0.3)]


def _pair(opts, shapes, gen, device="cpu"):
    """Params on the device (a) and their twins on the CPU (b, for torch's SGD)."""
    ws = [torch.randn(s, generator=gen) for s in shapes]
    a = [torch.nn.Parameter(w.to(device, copy=True)) for w in ws]
    b = [torch.nn.Parameter(w.clone()) for w in ws]
    return a, b


def cpu(t):
    return t.detach().cpu()


@pytest.mark.parametrize("opts", CONFIGS, ids=range(len(CONFIGS)))
def test_class_matches_torch_sgd(device, opts):
    gen = torch.Generator().manual_seed(0)
    a, b = _pair(opts, [(257, 3), (1,), (17,), (1000,)], gen, device)
    o1, o2 = SGD(a, lr=0.05, **opts), torch.optim.SGD(b, lr=0.05, **opts)
    for _ in range(30):
        T.lockstep(a, b, o1, o2, gen)
        for x, y in zip(a, b):
            torch.testing.assert_close(cpu(x), cpu(y), rtol=1e-5, atol=1e-6)
    for x, y in zip(a, b):
        assert x.device.type == device
        T.assert_bits(cpu(x), cpu(y))  # both fuse each add(alpha=) on this build
        if opts.get("momentum"):
            T.assert_bits(cpu(o1.state[x]["momentum_buffer"]), o2.state[y]["momentum_buffer"])
        else:
            assert "momentum_buffer" not in o1.state[x]


def test_op_every_isa_path_matches_torch(isa):
    """On the ISA path of the conftest fixture ``isa``."""
    gen = torch.Generator().manual_seed(1)
    opts = dict(momentum=0.9, nesterov=True, weight_decay=0.05)
    for n in [1, 7, 8, 15, 16, 17, 33, 100, 513, 4099]:
        a, b = _pair(opts, [(n,)], gen)
        o1, o2 = SGD(a, lr=0.1, **opts), torch.optim.SGD(b, lr=0.1, **opts)
        T.lockstep(a, b, o1, o2, gen, 3)
        T.assert_bits(a[0], b[0])


def test_class_arguments():
    """SGD's defaults and what the table's error rows (tests/optim_table.py) do not say."""
    p = [torch.nn.Parameter(torch.zeros(3))]
    g = SGD(p).param_groups[0]
    assert (g["lr"], g["momentum"], g["dampening"], g["weight_decay"], g["nesterov"],
            g["maximize"]) == (1e-3, 0, 0, 0, False, False)
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero "
                                         "dampening"):
        SGD(p, nesterov=True, momentum=0.9, dampening=0.1)
    for dt in (torch.bfloat16, "q8"):
        with pytest.raises(ValueError, match="momentum=0 keeps none"):
            SGD(p, momentum_dtype=dt)
    SGD(p, momentum=0.9, momentum_dtype="q8")
    assert "SGD" in mpext.optim.__all__


# --------------------------------------------------------------------------------------------
# The op.

def test_opcheck(device):
    gen = torch.Generator().manual_seed(3)
    master = torch.randn(17, generator=gen)
    params = [torch.randn(33, generator=gen), master.bfloat16()]
    grads = [torch.randn(33, generator=gen), torch.randn(17, generator=gen).bfloat16()]
    bufs = [torch.zeros(33), torch.zeros(17, dtype=torch.bfloat16)]
    masters = [torch.empty(0), master]
    steps = [torch.zeros(()), torch.ones(())]
    params, grads, bufs, masters, steps = ([t.to(device) for t in ts] for ts in (
        params, grads, bufs, masters, steps))

    def full(v, *shape, **kw):
        return torch.full(shape, v, device=device, **kw)

    lr = full(1e-3)
    cases = [
        ((params, grads, bufs, masters, steps, lr, 0.9, 0.0, 0.01, True, False), {}),
        ((params, grads, [], masters, steps, lr, 0.0, 0.0, 0.01, False, True),
         {"inv_scale": full(0.5), "found_inf": full(0.0)}),
        ((params, grads, bufs, masters, steps, lr, 0.9, 0.5, 0.0, False, False),
         {"found_inf": full(1.0)}),
        (([torch.randn(512, device=device)], [torch.randn(512, device=device)],
          [full(0, 512, dtype=torch.int8)], [], [full(0.0)], lr, 0.9, 0.0, 0.0, False, False),
         {"momentum_buffer_scales": [full(0.0, 2)]}),
        (([], [], [], [], [], lr, 0.9, 0.0, 0.0, False, False), {}),
    ]
    for args, kwargs in cases:
        torch.library.opcheck(torch.ops.mpext.sgd_step_.default, args, kwargs)


BAD = [
    (dict(momentum=-1.0), ValueError, r"momentum must be in \[0, inf\), got -1"),
    (dict(nesterov=True, dampening=0.5), ValueError, r"Nesterov momentum requires"),
    (dict(momentum=0.0), ValueError, r"momentum is 0, which keeps no buffer, so "
                                     r"momentum_buffers must be empty, got 1 tensors"),
    (dict(momentum_buffers=[]), ValueError, r"momentum_buffers must have one entry per param"),
    (dict(momentum_buffers=[torch.zeros(512, dtype=torch.int8)]), ValueError,
     r"momentum_buffers\[0\] holds 8-bit codes, which need momentum_buffer_scales"),
    (dict(momentum_buffers=[torch.zeros(512, dtype=torch.int8)],
          momentum_buffer_scales=[torch.zeros(2)], offsets=[128]), ValueError,
     r"offsets\[0\] \(128\) must be a multiple of block_size \(256\)"),
]


# Through each device's kernel (the fake kernel checks no argument: tests/test_step_fake.py).
@pytest.mark.parametrize("device,change,exc,match", device_cases(
    BAD, [str(i) for i in range(len(BAD))]))
def test_op_bad_input_changes_nothing(device, change, exc, match):
    base = dict(params=[torch.randn(512)], grads=[torch.randn(512)],
                 momentum_buffers=[torch.randn(512)], masters=[], steps=[torch.zeros(())],
                 lr=torch.full((), 1e-3), momentum=0.9, dampening=0.0, weight_decay=0.0,
                 nesterov=False)
    T.op_bad_input_changes_nothing(ops.sgd_step_, base, change, exc, match, device)


# --------------------------------------------------------------------------------------------
# Checkpoints of torch.optim.SGD.


@pytest.mark.parametrize("opts", [dict(momentum=0.9, nesterov=True), dict()], ids=["momentum",
                                                                                 "plain"])
def test_checkpoints_move_between_torch_and_mpext(device, opts):
    """A torch.optim.SGD state dict (no step count; a None buffer without momentum) loads into
    mpext's SGD and the run continues as torch's does; mpext's loads back into torch's. mpext's
    on the device, torch's on the CPU (each load moves the state to its params' device)."""
    gen = torch.Generator().manual_seed(8)
    a, b = _pair(opts, [(300,), (7, 3)], gen, device)
    ref = torch.optim.SGD(b, lr=0.05, **opts)
    for _ in range(3):
        for y in b:
            y.grad = torch.randn(y.shape, generator=gen)
        ref.step()
    for x, y in zip(a, b):
        x.data.copy_(y.detach())
    opt = SGD(a, lr=0.05, **opts)
    opt.load_state_dict(ref.state_dict())
    back = torch.optim.SGD([torch.nn.Parameter(y.detach().clone()) for y in b], lr=0.05, **opts)
    T.lockstep(b, a, ref, opt, gen, 3)
    for x, y in zip(a, b):
        assert x.device.type == device
        T.assert_bits(cpu(x), cpu(y))
    back.load_state_dict(opt.state_dict())
    if opts:
        for x, y in zip(a, back.param_groups[0]["params"]):
            T.assert_bits(back.state[y]["momentum_buffer"], cpu(opt.state[x]["momentum_buffer"]))
