"""mpext.optim as a drop-in for torch.optim (docs/dropin.md): what torch's optimizers accept,
mpext's take, with torch's results.

* Non-contiguous params step through a contiguous copy: the bits of a contiguous clone, and
  torch's update; the rest of the storage they view is untouched.
* Sparse gradients (SGD), amsgrad and float64 / complex params run through torch.optim's
  functional implementation: torch's bits and state, both ways through state_dict.
* What stays refused says so, and changes nothing.
* state_dict round trips add no key (SGD has no ``capturable``); torch's constructor checks;
  another rule's checkpoint is named as such.
"""
import copy
import re

import pytest
import torch

import mpext
from mpext.optim import Adam, AdamW, Lion, SGD

import optim_table

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
EPS32 = torch.finfo(F32).eps

# The rules of the rules x formats table (tests/optim_table.py): their classes, hyperparameters
# and references (torch.optim's; lion-pytorch's for Lion, a test skipped without it).
RULES = {name: optim_table.RULES[name] for name in ("adam", "adamw", "sgd", "lion")}


def _rule(name):
    """(mpext class, reference factory, hyperparameters) of a rule."""
    return RULES[name].cls, RULES[name].reference, RULES[name].kwargs


def _bits(t):
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else
                               torch.int32 if t.element_size() == 4 else torch.int64)


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _grads(shape, steps, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=dtype).to(device) for _ in range(steps)]


def _state_equal(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            x, y = a[k], b[k]
            if x.layout != torch.strided:
                x, y = x.coalesce().to_dense(), y.coalesce().to_dense()
            assert _same_bits(x.cpu(), y.cpu()), k
        else:
            assert a[k] == b[k], k


def _sd_equal(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert sorted(a["state"]) == sorted(b["state"])
    for k in a["state"]:
        _state_equal(a["state"][k], b["state"][k])


# ---- Non-contiguous params ------------------------------------------------------------------

@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("moments", ["float32", "q8"])
def test_non_contiguous_param_steps_as_a_contiguous_clone(device, rule, dtype, moments):
    """A param with gaps (a slice of a bigger tensor) steps with the bits of a contiguous clone
    of it, in every format (8-bit blocks and SR positions by the element's logical index), and
    the elements of the storage it does not view stay as they were."""
    cls, _, hp = _rule(rule)
    kw = dict(hp)
    if moments == "q8":
        kw.update({q.setting: "q8" for q in cls.moments})
    if dtype is BF16:
        kw.update(master_weights=False, stochastic_rounding=True, seed=7)
    base = torch.randn(64, 40, 2, generator=torch.Generator().manual_seed(1)).to(dtype)
    base = base.to(device)
    untouched = base[..., 1].clone()
    p = torch.nn.Parameter(base[..., 0])  # strides (80, 2): not dense
    assert not p.is_contiguous() and p.stride() == (80, 2)
    q = torch.nn.Parameter(p.detach().clone())
    start = q.detach().clone()
    a, b = cls([p], **kw), cls([q], **kw)
    for g in _grads(p.shape, 4, dtype, device):
        p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    assert p.stride() == (80, 2) and p.data_ptr() == base.data_ptr()
    assert not torch.equal(p, start)  # it moved
    assert _same_bits(p, q)
    assert _same_bits(base[..., 1], untouched)  # the elements between its own
    _state_equal(a.state[p], b.state[q])


@pytest.mark.parametrize("rule", list(RULES))
def test_non_contiguous_param_matches_the_reference(device, rule):
    """The same non-contiguous FP32 param stepped by torch.optim (lion-pytorch for Lion):
    within the few ulps the fused kernel may differ from torch's op order per step."""
    cls, ref_cls, hp = _rule(rule)
    base = torch.randn(10, 5, 2, generator=torch.Generator().manual_seed(2)).to(device)
    p = torch.nn.Parameter(base.clone()[..., 0])
    r = torch.nn.Parameter(base.clone()[..., 0])
    a, ref = cls([p], **hp), ref_cls([r], **hp)
    start = p.detach().clone()
    steps = 5
    for g in _grads(p.shape, steps, F32, device):
        p.grad, r.grad = g.clone(), g.clone()
        a.step()
        ref.step()
    moved = (r - start).abs()
    assert moved.min().item() > 0  # every element moved: a skipped write-back would show
    # each step may round differently by an ulp of the param (and of the update), so
    # the difference after n steps stays within n ulps of the largest value
    tol = steps * 2 * EPS32 * float(r.detach().abs().max())
    assert float((p - r).abs().max()) <= tol, rule


def test_non_contiguous_param_skipped_step_and_scaled_grads(device):
    """grad_scale is undone and found_inf skips, for a param stepped through its copy."""
    base = torch.randn(8, 6, 2).to(device)
    p = torch.nn.Parameter(base.clone()[..., 0])
    q = torch.nn.Parameter(p.detach().clone())
    a, b = AdamW([p], lr=1e-2), AdamW([q], lr=1e-2)
    g = torch.randn(p.shape, device=device)
    p.grad, q.grad = g * 1024, g.clone()  # a power of two: exact in FP32
    a.step(grad_scale=torch.tensor(1024.0, device=device),
           found_inf=torch.zeros(1, device=device))
    b.step()
    assert _same_bits(p, q)
    assert _same_bits(p.grad, q.grad)  # the unscaled gradient written back, as torch's fused
    before = p.detach().clone()
    state = {k: v.clone() for k, v in a.state[p].items()}
    p.grad = g.clone()
    a.step(grad_scale=torch.tensor(1.0, device=device), found_inf=torch.ones(1, device=device))
    assert _same_bits(p, before)
    _state_equal(a.state[p], state)


def _overlaps_by_enumeration(shape, strides):
    offsets = [0]
    for n, st in zip(shape, strides):
        offsets = [o + i * st for o in offsets for i in range(n)]
    return len(set(offsets)) < len(offsets)


def test_overlapping_is_exact():
    """mpext.optim._engine.overlapping against every element's offset counted, over random
    small shapes and strides (interleaved strides, zeros, size-1 dimensions)."""
    from mpext.optim._engine import overlapping
    g = torch.Generator().manual_seed(0)
    base = torch.zeros(4096)
    seen = set()
    for _ in range(600):
        dims = int(torch.randint(1, 4, (), generator=g))
        shape = tuple(int(x) for x in torch.randint(1, 5, (dims,), generator=g))
        strides = tuple(int(x) for x in torch.randint(0, 9, (dims,), generator=g))
        want = _overlaps_by_enumeration(shape, strides)
        assert overlapping(base.as_strided(shape, strides)) == want, (shape, strides)
        seen.add(want)
    assert seen == {True, False}


def _overlapping_params(dtype, device):
    return {"expand": lambda: torch.zeros(1, 4, dtype=dtype, device=device).expand(3, 4),
            "as_strided": lambda: torch.zeros(6, dtype=dtype, device=device).as_strided(
                (2, 4), (2, 1))}


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("kind", ["expand", "as_strided"])
@pytest.mark.parametrize("dtype", [F32, F64])
def test_overlapping_param_refused(device, rule, kind, dtype):
    """A param whose elements share memory is refused when added, naming it: an in-place step
    of it depends on the order of the writes (torch's SGD steps the shared elements twice, its
    Adam raises once it has updated the moments)."""
    cls, _, hp = _rule(rule)
    if dtype is F64 and cls is Lion:
        pytest.skip("Lion refuses float64 params (test_refused_with_a_reason)")
    q = torch.nn.Parameter(torch.zeros(3, dtype=dtype, device=device))
    p = torch.nn.Parameter(_overlapping_params(dtype, device)[kind]())
    with pytest.raises(ValueError, match=r"mpext\.optim\.%s: params\[1\] \(param group 0\) has "
                                         r"elements that share memory \(sizes %s, strides %s"
                       % (cls.__name__, re.escape(str(tuple(p.shape))),
                          re.escape(str(p.stride())))):
        cls([q, p], **hp)
    opt = cls([q], **hp)
    with pytest.raises(ValueError, match=r"params\[0\] \(param group 1\) has elements that "
                                         r"share memory"):
        opt.add_param_group({"params": [p]})
    assert len(opt.param_groups) == 1


def test_torch_steps_overlapping_params_by_write_order():
    """Why they are refused: torch's SGD on an overlapping view is not the step of a clone."""
    base = torch.zeros(6)
    p = torch.nn.Parameter(base.as_strided((2, 4), (2, 1)))
    p.grad = torch.ones(2, 4)
    torch.optim.SGD([p], lr=0.1).step()
    # elements 2 and 3 stepped twice; a clone's step would be -0.1 everywhere
    assert torch.equal(base, torch.tensor([-0.1, -0.1, -0.2, -0.2, -0.1, -0.1]))


@pytest.mark.parametrize("planned", [False, True])
def test_param_made_overlapping_after_refused_at_step(device, planned):
    """A param whose .data was replaced by an overlapping view after it was added: the step
    refuses it before anything is written (the other param, the view's memory, the state)."""
    p = torch.nn.Parameter(torch.zeros(2, 4, device=device))
    q = torch.nn.Parameter(torch.zeros(5, device=device))
    opt = SGD([q, p], lr=0.1, momentum=0.9)
    if planned:  # a step made: its plan is kept
        p.grad, q.grad = torch.ones(2, 4, device=device), torch.ones(5, device=device)
        opt.step()
    base = torch.zeros(6, device=device)
    p.data = base.as_strided((2, 4), (2, 1))
    p.grad, q.grad = torch.ones(2, 4, device=device), torch.ones(5, device=device)
    before, sd = q.detach().clone(), copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"has elements that share memory \(sizes \(2, 4\), "
                                         r"strides \(2, 1\)"):
        opt.step()
    assert _same_bits(q, before) and torch.equal(base, torch.zeros(6, device=device))
    _sd_equal(opt.state_dict(), sd)


# ---- Sparse gradients -----------------------------------------------------------------------

SPARSE_HYPER = [dict(lr=0.1), dict(lr=0.1, momentum=0.9), dict(lr=0.1, momentum=0.9,
                                                               dampening=0.5, maximize=True),
                dict(lr=0.1, momentum=0.9, nesterov=True)]


@pytest.mark.parametrize("hp", SPARSE_HYPER, ids=lambda h: "-".join(map(str, h.values())))
def test_sparse_embedding_sgd_is_torchs(device, hp):
    """nn.Embedding(sparse=True) with a dense layer beside it, mpext SGD against torch.optim.SGD:
    the same bits in the params and the momentum buffers (sparse for the embedding, as torch's
    SGD keeps it), and state dicts that move between the two."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(30, 6, sparse=True),
                                torch.nn.Linear(6, 3)).to(device)
    ref = copy.deepcopy(model)
    a, b = SGD(model.parameters(), **hp), torch.optim.SGD(ref.parameters(), **hp)
    g = torch.Generator().manual_seed(3)

    def train(steps):
        for _ in range(steps):
            idx = torch.randint(0, 30, (12,), generator=g).to(device)
            for m, o in ((model, a), (ref, b)):
                o.zero_grad()
                m(idx).pow(2).sum().backward()
                o.step()

    train(4)
    assert model[0].weight.grad.is_sparse
    for x, y in zip(model.parameters(), ref.parameters()):
        assert _same_bits(x, y)
    emb = a.state[model[0].weight]
    if hp.get("momentum"):
        assert emb["momentum_buffer"].is_sparse and "step" not in emb  # torch's state
        _state_equal(emb, b.state[ref[0].weight])
    else:
        assert len(emb) == 0
    # mpext's checkpoint into torch's SGD and torch's into mpext's: both continue alike
    a2, b2 = SGD(model.parameters(), **hp), torch.optim.SGD(ref.parameters(), **hp)
    a2.load_state_dict(b.state_dict())
    b2.load_state_dict(a.state_dict())
    a, b = a2, b2
    train(2)
    for x, y in zip(model.parameters(), ref.parameters()):
        assert _same_bits(x, y)


def test_sparse_grad_with_a_loss_scale(device):
    """A GradScaler's scale and inf flag on a sparse gradient: unscaled as torch's GradScaler
    unscales one for torch's SGD, skipped on an inf."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True).to(device)
    ref = copy.deepcopy(emb)
    a = SGD(emb.parameters(), lr=0.5, momentum=0.9)
    b = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    idx = torch.tensor([1, 3, 3, 7], device=device)
    emb(idx).sum().mul(256.0).backward()  # the loss scaled by 256: exact
    ref(idx).sum().backward()
    a.step(grad_scale=torch.tensor(256.0, device=device),
           found_inf=torch.zeros(1, device=device))
    b.step()
    assert _same_bits(emb.weight, ref.weight)
    before = emb.weight.detach().clone()
    buf = a.state[emb.weight]["momentum_buffer"].clone()
    emb.zero_grad()
    emb(idx).sum().backward()
    a.step(grad_scale=torch.tensor(1.0, device=device), found_inf=torch.ones(1, device=device))
    assert _same_bits(emb.weight, before)
    _state_equal({"b": a.state[emb.weight]["momentum_buffer"]}, {"b": buf})


def test_sparse_grad_after_dense_steps_in_a_planned_step(device):
    """A sparse gradient where the cached plan of earlier dense steps expects a dense one: the
    op refuses it before writing, the step sorts the param out to torch's path."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(5, 3, device=device)) for _ in range(2)]
    rs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    a, b = SGD(ps, lr=0.1), torch.optim.SGD(rs, lr=0.1)
    for step in range(3):
        for p, r in zip(ps, rs):
            g = torch.randn(5, 3, device=device)
            if step == 2 and p is ps[1]:
                g = g.to_sparse()
            p.grad, r.grad = g.clone(), g.clone()
        a.step()
        b.step()
    for p, r in zip(ps, rs):
        assert _same_bits(p, r)


@pytest.mark.parametrize("cls", [Adam, AdamW, Lion])
def test_sparse_grad_refused_like_torch(device, cls):
    """Adam refuses sparse gradients as torch.optim.Adam does (RuntimeError; Lion too, as
    lion-pytorch cannot step one), before anything is written."""
    p = torch.nn.Parameter(torch.randn(4, device=device))
    q = torch.nn.Parameter(torch.randn(4, device=device))
    opt = cls([q, p])
    q.grad = torch.randn(4, device=device)
    p.grad = torch.ones(4, device=device).to_sparse()
    before = (p.detach().clone(), q.detach().clone())
    with pytest.raises(RuntimeError, match=r"does not support sparse gradients \(param 1 of "
                                           r"group 0"):
        opt.step()
    assert _same_bits(p, before[0]) and _same_bits(q, before[1]) and len(opt.state) == 0
    if cls is not Lion:
        t = torch.nn.Parameter(torch.randn(4))
        t.grad = torch.ones(4).to_sparse()
        with pytest.raises(RuntimeError, match=r"does not support sparse gradients"):
            getattr(torch.optim, cls.__name__)([t]).step()


class _TorchPathNet(torch.nn.Module):
    """A float64 param (torch's path), an embedding (dense or sparse gradients) and a Linear."""

    def __init__(self, dtype):
        super().__init__()
        self.extra = torch.nn.Parameter(torch.randn(3, dtype=F64))
        self.emb = torch.nn.Embedding(6, 4).to(dtype)
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, idx):
        return self.lin(self.emb(idx).float()).pow(2).sum() + self.extra.pow(2).sum().float()


# (rule, hyperparameters, the embedding's dtype, gradients of earlier steps (sparse or dense),
# the failing step's, what torch's message says, what mpext's says, the group change or
# gradient that makes the step valid)
TORCH_REFUSES = {
    "sgd-sparse-weight-decay": (SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-4), F32, [],
                                "sparse", r"add\(sparse, dense\) is not supported",
                                r"param 1 of group 0 has a sparse gradient with "
                                r"weight_decay=0.0001", dict(weight_decay=0.0)),
    "sgd-sparse-nesterov-dense-buffer": (
        SGD, dict(lr=0.1, momentum=0.9, nesterov=True), F32, ["dense"], "sparse",
        r"add\(sparse, dense\) is not supported",
        r"param 1 of group 0 has a sparse gradient with nesterov=True and a dense momentum "
        r"buffer", dict(nesterov=False)),
    "sgd-dense-grad-sparse-buffer": (
        SGD, dict(lr=0.1, momentum=0.9), F32, ["sparse"], "dense",
        r"add\(sparse, dense\) is not supported",
        r"param 1 of group 0 has a dense gradient and a sparse momentum buffer", "sparse"),
    "adam-float64-sparse": (Adam, dict(lr=0.1), F64, [], "sparse",
                            r"Adam does not support sparse gradients",
                            r"param 1 of group 0: Adam does not support sparse gradients",
                            "dense"),
}


@pytest.mark.parametrize("case", list(TORCH_REFUSES))
def test_what_torchs_step_refuses_changes_nothing(device, case):
    """A param whose step torch.optim's implementation refuses (it raises while stepping, once
    the params before it are stepped), beside a float64 param before it (torch's path too) and
    a Linear (the fused path): mpext's optimizer raises and steps nothing, and no state changes
    (torch's over the same params, the refused one first, raises and changes no param); made
    valid, the step is that of an optimizer that never met the refused one (not a second)."""
    cls, hp, dtype, before_steps, bad, torch_words, words, fix = TORCH_REFUSES[case]
    torch.manual_seed(0)
    model = _TorchPathNet(dtype).to(device)
    ref, clean = copy.deepcopy(model), copy.deepcopy(model)
    idx = torch.tensor([1, 2, 2], device=device)

    def backward(m, layout):
        m.emb.sparse = layout == "sparse"
        m.zero_grad(set_to_none=True)
        m(idx).backward()

    made = []
    for m, make in ((model, cls), (ref, getattr(torch.optim, cls.__name__)), (clean, cls)):
        ps = [m.emb.weight, m.lin.weight, m.lin.bias]
        o = make(ps if m is ref else [m.extra] + ps, **hp)
        for layout in before_steps:
            backward(m, layout)
            o.step()
        made.append(o)
    a, b, c = made
    for m, o in ((model, a), (ref, b)):
        backward(m, bad)
    params = [t.detach().clone() for t in model.parameters()]
    assert model.extra.grad is not None
    sd = copy.deepcopy(a.state_dict())
    ref_params = [t.detach().clone() for t in ref.parameters()]
    with pytest.raises(RuntimeError, match=torch_words):
        b.step()
    assert all(_same_bits(x, y) for x, y in zip(ref.parameters(), ref_params))  # torch's
    with pytest.raises(RuntimeError, match=words):
        a.step()
    assert all(_same_bits(x, y) for x, y in zip(model.parameters(), params))
    _sd_equal(a.state_dict(), sd)
    # made valid: the same bits as the optimizer that never met the refused step
    for m, o in ((model, a), (clean, c)):
        if isinstance(fix, dict):
            o.param_groups[0].update(fix)
            if m is clean:
                backward(m, bad)
        else:
            backward(m, fix)
        o.step()
    assert all(_same_bits(x, y) for x, y in zip(model.parameters(), clean.parameters()))
    _sd_equal(a.state_dict(), c.state_dict())


# ---- amsgrad, float64 and complex params through torch's implementation ---------------------

TORCH_PATH = [
    ("adam", F32, dict(amsgrad=True)), ("adamw", F32, dict(amsgrad=True)),
    ("adam", F64, {}), ("adamw", F64, dict(amsgrad=True, maximize=True)),
    ("adam", torch.complex64, {}), ("adamw", torch.complex128, {}),
    ("sgd", F64, {}), ("sgd", torch.complex64, dict(nesterov=True, dampening=0.0)),
]


@pytest.mark.parametrize("rule,dtype,extra", TORCH_PATH,
                         ids=["%s-%s-%s" % (r, str(d)[6:], "-".join(e)) for r, d, e in TORCH_PATH])
def test_torch_path_is_torchs_bitwise(device, rule, dtype, extra):
    """Params mpext's kernels have no format for, beside an FP32 param the fused kernel steps:
    torch's bits and state for them (and the fused param as an mpext-only run steps it), a
    state dict that torch's optimizer continues from, and one mpext continues from."""
    cls, ref_cls, hp = _rule(rule)
    hp = dict(hp, **extra)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 4, generator=g, dtype=dtype).to(device)
    y = torch.randn(7, generator=g).to(device)
    p, q = torch.nn.Parameter(x.clone()), torch.nn.Parameter(y.clone())
    r = torch.nn.Parameter(x.clone())
    fused_only = torch.nn.Parameter(y.clone())
    fused_amsgrad = extra.get("amsgrad", False)
    a = cls([p, q], **hp)
    b = ref_cls([r], **hp)
    c = cls([fused_only], **hp)
    steps = 4

    def train(n, a, b, seed):
        for gx, gy in zip(_grads(x.shape, n, dtype, device, seed),
                          _grads(y.shape, n, F32, device, seed + 1)):
            p.grad, r.grad, q.grad, fused_only.grad = gx.clone(), gx.clone(), gy.clone(), \
                gy.clone()
            a.step()
            b.step()
            c.step()

    train(steps, a, b, 10)
    assert _same_bits(p, r) and not torch.equal(p, x)
    _state_equal(a.state[p], b.state[r])
    assert _same_bits(q, fused_only)  # (an amsgrad group steps both through torch's)
    if not fused_amsgrad:
        assert sorted(a.state[q]) == sorted(c.state[fused_only])
    # both ways through state_dict
    sd_a, sd_b = copy.deepcopy(a.state_dict()), copy.deepcopy(b.state_dict())
    a2, b2 = cls([p, q], **hp), ref_cls([r], **hp)
    b2.load_state_dict({"state": {0: sd_a["state"][0]},
                        "param_groups": [dict(sd_b["param_groups"][0])]})
    a2.load_state_dict(sd_a)
    _sd_equal(a2.state_dict(), sd_a)
    train(2, a2, b2, 20)
    assert _same_bits(p, r)


def test_torch_path_with_a_loss_scale(device):
    """A float64 param with a GradScaler's scale and flag: its gradient unscaled as torch's
    GradScaler.unscale_ does for torch's Adam, and a found inf skips it."""
    x = torch.randn(9, dtype=F64, device=device)
    p, r = torch.nn.Parameter(x.clone()), torch.nn.Parameter(x.clone())
    a, b = Adam([p], lr=1e-2), torch.optim.Adam([r], lr=1e-2)
    g = torch.randn(9, dtype=F64, device=device)
    p.grad, r.grad = g * 512, g.clone()
    a.step(grad_scale=torch.tensor(512.0, device=device),
           found_inf=torch.zeros(1, device=device))
    b.step()
    assert _same_bits(p, r) and _same_bits(p.grad, r.grad)
    before, state = p.detach().clone(), copy.deepcopy(a.state[p])
    p.grad = g.clone()
    a.step(grad_scale=torch.tensor(1.0, device=device), found_inf=torch.ones(1, device=device))
    assert _same_bits(p, before)
    _state_equal(a.state[p], state)


def test_amsgrad_set_on_a_stepped_group_continues_as_torch(device):
    """amsgrad switched on in a group of FP32 params already stepped by the fused kernel: torch's
    implementation continues from that state (which has torch's keys), a zero max_exp_avg_sq
    added, as torch's Adam continues an Adam state loaded into an amsgrad group."""
    x = torch.randn(11, device=device)
    p, r = torch.nn.Parameter(x.clone()), torch.nn.Parameter(x.clone())
    a = Adam([p], lr=1e-2)
    gs = _grads(x.shape, 4, F32, device)
    for gg in gs[:2]:
        p.grad = gg.clone()
        a.step()
    b = torch.optim.Adam([r], lr=1e-2, amsgrad=True)
    r.data.copy_(p.detach())
    sd = copy.deepcopy(a.state_dict())
    sd["state"][0]["step"] = sd["state"][0]["step"].cpu()
    sd["state"][0]["max_exp_avg_sq"] = torch.zeros_like(sd["state"][0]["exp_avg"])
    sd["param_groups"][0] = dict(b.state_dict()["param_groups"][0])
    b.load_state_dict(sd)
    a.param_groups[0]["amsgrad"] = True
    for gg in gs[2:]:
        p.grad, r.grad = gg.clone(), gg.clone()
        a.step()
        b.step()
    assert _same_bits(p, r)


def test_amsgrad_turned_off_loads_and_steps_as_torch(device):
    """amsgrad turned off on a stepped amsgrad group, as against torch.optim.Adam: the step
    leaves max_exp_avg_sq as torch's does (it reads it no more), the optimizer's own
    state_dict loads (as into torch's Adam) and round trips, and amsgrad set again continues
    from the kept maximum as torch does."""
    x = torch.randn(11, device=device)
    p, r = torch.nn.Parameter(x.clone()), torch.nn.Parameter(x.clone())
    a = Adam([p], lr=1e-2, amsgrad=True)
    b = torch.optim.Adam([r], lr=1e-2, amsgrad=True)
    gs = _grads(x.shape, 7, F32, device)

    def steps(gg, opts):
        for g in gg:
            for q, o in opts:
                q.grad = g.clone()
                o.step()

    def close(u, v):  # the fused step is torch's math in another order: a few ulps of FP32
        torch.testing.assert_close(u, v, rtol=8 * EPS32, atol=8 * EPS32 * float(v.abs().max()))

    steps(gs[:2], [(p, a), (r, b)])  # both through torch's implementation: the same bits
    kept = a.state[p]["max_exp_avg_sq"].clone()
    assert _same_bits(kept, b.state[r]["max_exp_avg_sq"])
    a.param_groups[0]["amsgrad"] = b.param_groups[0]["amsgrad"] = False
    steps(gs[2:4], [(p, a), (r, b)])
    close(p.detach(), r.detach())
    assert _same_bits(a.state[p]["max_exp_avg_sq"], kept)
    assert _same_bits(b.state[r]["max_exp_avg_sq"], kept)
    sd = copy.deepcopy(a.state_dict())
    p2, r2 = (torch.nn.Parameter(p.detach().clone()), torch.nn.Parameter(p.detach().clone()))
    a2, b2 = Adam([p2], lr=1e-2), torch.optim.Adam([r2], lr=1e-2)
    a2.load_state_dict(sd)
    b2.load_state_dict(copy.deepcopy(sd))
    _sd_equal(a2.state_dict(), sd)
    steps(gs[4:5], [(p2, a2), (r2, b2)])
    close(p2.detach(), r2.detach())
    assert _same_bits(a2.state[p2]["max_exp_avg_sq"], kept)
    a2.param_groups[0]["amsgrad"] = b2.param_groups[0]["amsgrad"] = True
    steps(gs[5:], [(p2, a2), (r2, b2)])
    close(p2.detach(), r2.detach())
    close(a2.state[p2]["max_exp_avg_sq"], b2.state[r2]["max_exp_avg_sq"])


REFUSED = [
    (lambda d: Adam([torch.nn.Parameter(torch.zeros(3, device=d))], differentiable=True),
     ValueError, r"differentiable=True is not supported"),
    (lambda d: SGD([torch.nn.Parameter(torch.zeros(3, device=d))], differentiable=True),
     ValueError, r"differentiable=True is not supported"),
    (lambda d: AdamW([torch.nn.Parameter(torch.zeros(3, device="meta"))]), ValueError,
     r"params\[0\] \(param group 0\) is on meta"),
    (lambda d: Adam([torch.nn.Parameter(torch.zeros(3, device="meta", dtype=F64))]),
     ValueError, r"params\[0\] \(param group 0\) is on meta, a device mpext steps no params on"),
    (lambda d: Lion([torch.nn.Parameter(torch.zeros(3, device=d, dtype=F64))]), TypeError,
     r"params\[0\] \(param group 0\) has dtype float64; only float32, bfloat16 and float16 "
     r"params are supported$"),
    (lambda d: SGD([torch.zeros(3, device=d, dtype=torch.int32)]),
     TypeError, r"has dtype int32; only float32, bfloat16 and float16 params are supported "
                r"\(and complex128, complex64, float64, which torch's implementation"),
    (lambda d: AdamW([torch.nn.Parameter(torch.zeros(3, device=d, dtype=BF16))], amsgrad=True),
     ValueError, r"params\[0\] \(param group 0\) is bfloat16 in a group that keeps FP32 masters, "
                 r"which torch.optim's implementation of the rule does not do; pass "
                 r"master_weights=False"),
    (lambda d: AdamW([torch.nn.Parameter(torch.zeros(3, device=d))], amsgrad=True,
                     exp_avg_sq_dtype=torch.bfloat16), ValueError,
     r"exp_avg_sq_dtype=torch.bfloat16 is not available for it: torch.optim's implementation"),
    (lambda d: SGD([torch.nn.Parameter(torch.zeros(3, device=d, dtype=F64))], momentum=0.9,
                   ema_decay=0.9), ValueError, r"ema_decay=0.9 is not available for it"),
    (lambda d: AdamW([torch.nn.Parameter(torch.zeros(3, device=d))],
                     amsgrad=True).release_grads(), ValueError,
     r"release_grads: some params are stepped by torch.optim's implementation of the rule \(a "
     r"group's settings\)"),
]


@pytest.mark.parametrize("make,exc,match", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_refused_with_a_reason(device, make, exc, match):
    with pytest.raises(exc, match=match):
        make(device)


def test_release_refuses_a_sparse_gradient(device):
    emb = torch.nn.Embedding(8, 3, sparse=True).to(device)
    opt = SGD(emb.parameters(), lr=0.1)
    before = emb.weight.detach().clone()
    release = opt.release_grads(bucket_bytes=0)
    with pytest.raises(RuntimeError, match=r"param 0 of group 0 is stepped by torch.optim's "
                                           r"implementation of the rule \(a torch.sparse_coo "
                                           r"float32 gradient\); step\(\) does that, gradient "
                                           r"release does not"):
        release.backward(emb(torch.tensor([1, 2], device=device)).sum())
    assert _same_bits(emb.weight, before)


# ---- state_dict round trips, torch's constructor checks -------------------------------------

@pytest.mark.parametrize("rule", list(RULES))
def test_load_state_dict_round_trip_adds_nothing(rule):
    """b.load_state_dict(a.state_dict()) makes b.state_dict() == a.state_dict(): no key
    added to the groups (SGD and Lion have no capturable; torch's SGD neither)."""
    cls, _, hp = _rule(rule)
    p, q = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(5))
    a, b = cls([p], **hp), cls([q], **hp)
    p.grad = torch.randn(5)
    a.step()
    sd = a.state_dict()
    b.load_state_dict(sd)
    _sd_equal(b.state_dict(), a.state_dict())
    if rule == "sgd":
        assert sorted(torch.optim.SGD([q]).state_dict()["param_groups"][0]) == sorted(
            k for k in sd["param_groups"][0] if k in torch.optim.SGD([q]).defaults
            or k == "params")
        assert "capturable" not in b.state_dict()["param_groups"][0]


def _torch_error(make):
    try:
        make()
    except Exception as e:  # noqa: BLE001 - the type and words are what is compared
        return type(e), str(e)
    return None


P = [torch.nn.Parameter(torch.zeros(3))]
T = torch.tensor
CTOR_CASES = [
    ("Adam", dict(betas=(0.9, T(0.99)))), ("Adam", dict(betas=(T(0.9), 0.99))),
    ("AdamW", dict(betas=(0, 0.99))), ("Adam", dict(betas=(0.9, 1))),
    ("Adam", dict(betas=(T(0.9), T(0.99)), foreach=True)),
    ("Adam", dict(betas=(0.9, T(1.5)))),
    ("Adam", dict(lr=T(0.1), foreach=True)), ("Adam", dict(lr=T([0.1, 0.2]))),
    ("AdamW", dict(fused=True, foreach=True)), ("AdamW", dict(fused=True, differentiable=True)),
    ("SGD", dict(fused=True, foreach=True)), ("SGD", dict(fused=True, differentiable=True)),
    ("SGD", dict(lr=T([0.1, 0.2]))), ("SGD", dict(momentum=-1.0)),
    ("SGD", dict(nesterov=True)), ("SGD", dict(weight_decay=-1.0)),
]


@pytest.mark.parametrize("name,kw", CTOR_CASES, ids=[str(i) for i in range(len(CTOR_CASES))])
def test_constructor_checks_are_torchs(name, kw):
    """Each of torch's constructor checks: the same exception type and words from mpext."""
    want = _torch_error(lambda: getattr(torch.optim, name)(P, **kw))
    assert want is not None, "torch accepts %r" % kw
    with pytest.raises(want[0], match="^" + re.escape(want[1]) + "$"):
        getattr(mpext.optim, name)(P, **kw)


def test_tensor_betas_step_as_floats(device):
    p, q = torch.nn.Parameter(torch.randn(6, device=device)), None
    q = torch.nn.Parameter(p.detach().clone())
    a = AdamW([p], betas=(T(0.8), T(0.95)))
    b = AdamW([q], betas=(0.8, 0.95))
    for g in _grads(p.shape, 3, F32, device):
        p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    assert _same_bits(p, q)


# ---- Another rule's checkpoint --------------------------------------------------------------

def _lion_pytorch():
    return pytest.importorskip("lion_pytorch", reason="lion-pytorch is Lion's reference").Lion


def _without(make, key):
    """A checkpoint of ``make``'s optimizer whose groups lack ``key`` (an older torch's)."""
    class Older:
        def __init__(self, ps):
            self.opt = make(ps)
            self.state = self.opt.state

        def step(self):
            self.opt.step()

        def state_dict(self):
            sd = self.opt.state_dict()
            for g in sd["param_groups"]:
                del g[key]
            return sd
    return Older


O = torch.optim
# name: (the optimizer, its rule). Every optimizer of torch.optim but LBFGS (whose step needs a
# closure) and SparseAdam (sparse gradients only), with the options that add keys.
SOURCES = {
    "mpext.Adam": (lambda ps: Adam(ps), "adam"),
    "mpext.AdamW": (lambda ps: AdamW(ps), "adam"),
    "mpext.SGD": (lambda ps: SGD(ps, momentum=0.9), "sgd"),
    "mpext.Lion": (lambda ps: Lion(ps), "lion"),
    "torch.Adam": (lambda ps: O.Adam(ps), "adam"),
    "torch.Adam-amsgrad": (lambda ps: O.Adam(ps, amsgrad=True), "adam"),
    "torch.AdamW": (lambda ps: O.AdamW(ps), "adam"),
    "torch.SGD": (lambda ps: O.SGD(ps, lr=0.1, momentum=0.9), "sgd"),
    "torch.SGD-plain": (lambda ps: O.SGD(ps, lr=0.1), "sgd"),
    "lion_pytorch.Lion": (lambda ps: _lion_pytorch()(ps), "lion"),
    "torch.RMSprop": (lambda ps: O.RMSprop(ps), "rmsprop"),
    "torch.RMSprop-momentum": (lambda ps: O.RMSprop(ps, momentum=0.9, centered=True), "rmsprop"),
    "torch.NAdam": (lambda ps: O.NAdam(ps), "nadam"),
    "torch.NAdam-decoupled": (lambda ps: O.NAdam(ps, decoupled_weight_decay=True), "nadam"),
    "torch.RAdam": (lambda ps: O.RAdam(ps), "radam"),
    "torch.RAdam-older": (_without(lambda ps: O.RAdam(ps), "decoupled_weight_decay"), "radam"),
    "torch.Adamax": (lambda ps: O.Adamax(ps), "adamax"),
    "torch.Adagrad": (lambda ps: O.Adagrad(ps), "adagrad"),
    "torch.ASGD": (lambda ps: O.ASGD(ps), "asgd"),
    "torch.Rprop": (lambda ps: O.Rprop(ps), "rprop"),
    "torch.Adadelta": (lambda ps: O.Adadelta(ps), "adadelta"),
}
DESTS = {"Adam": (Adam, "adam"), "AdamW": (AdamW, "adam"), "SGD": (SGD, "sgd"),
         "Lion": (Lion, "lion")}
# rule: (the name a refusal gives it, a hyperparameter its groups have)
RULE_WORDS = {"adam": ("Adam/AdamW", "amsgrad"), "sgd": ("SGD", "nesterov"),
              "lion": ("Lion", "betas"), "rmsprop": ("RMSprop", "alpha"),
              "nadam": ("NAdam", "momentum_decay"), "radam": ("RAdam", "betas"),
              "adamax": ("Adamax", "betas"), "adagrad": ("Adagrad", "lr_decay"),
              "asgd": ("ASGD", "lambd"), "rprop": ("Rprop", "etas"),
              "adadelta": ("Adadelta", "rho")}


@pytest.mark.parametrize("src", list(SOURCES))
@pytest.mark.parametrize("dst", list(DESTS))
def test_another_rules_checkpoint(src, dst):
    """A checkpoint of every optimizer of torch.optim (of an older torch too), of lion-pytorch's
    Lion and of mpext's into every mpext optimizer: one of the same rule loads; another rule's
    is refused naming that rule (not another that shares a key: RMSprop has momentum, NAdam
    and RAdam betas and eps), its group's hyperparameters and its state's keys, with nothing
    changed."""
    make, src_rule = SOURCES[src]
    dst_cls, dst_rule = DESTS[dst]
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4))
    a = make([p])
    p.grad = torch.randn(4)
    a.step()
    sd = a.state_dict()
    q = torch.nn.Parameter(torch.randn(4))
    b = dst_cls([q], momentum=0.9) if dst_cls is SGD else dst_cls([q])
    q.grad = torch.randn(4)
    b.step()
    before = copy.deepcopy(b.state_dict())
    if src_rule == dst_rule:
        b.load_state_dict(sd)
        moment = {"adam": "exp_avg", "sgd": "momentum_buffer", "lion": "exp_avg"}[dst_rule]
        if a.state[p].get(moment) is not None:  # (plain SGD keeps a None buffer)
            assert _same_bits(b.state[q][moment], a.state[p][moment])
        return
    state_keys = sorted({k for st in sd["state"].values() for k in st}) or "(none)"
    with pytest.raises(ValueError) as info:
        b.load_state_dict(sd)
    msg = str(info.value)
    assert re.search(r"mpext\.optim\.%s\.load_state_dict: param group 0 of the checkpoint is "
                     r"another rule's: %s \(" % (dst, re.escape(RULE_WORDS[src_rule][0])),
                     msg), msg
    assert "this optimizer's rule is %s" % RULE_WORDS[dst_rule][0] in msg
    assert "the keys %s" % state_keys in msg, msg
    assert "'%s'" % RULE_WORDS[src_rule][1] in msg.split("the hyperparameters")[1]
    _sd_equal(b.state_dict(), before)


@pytest.mark.parametrize("scaler", ["torch", "mpext"])
def test_grad_scaler_over_sparse_and_float64_params(device, scaler):
    """A GradScaler driving mpext's SGD over a sparse embedding and a float64 layer (both on
    torch's path) as torch.amp.GradScaler drives torch's SGD: the same bits, an overflowing
    step skipped by both and the scale backed off alike."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True),
                                torch.nn.Linear(4, 2).double()).to(device)
    ref = copy.deepcopy(model)
    a = SGD(model.parameters(), lr=0.1, momentum=0.9)
    b = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    make = torch.amp.GradScaler if scaler == "torch" else mpext.GradScaler
    sa, sb = make(device, init_scale=256.0), torch.amp.GradScaler(device, init_scale=256.0)
    for step in range(4):
        idx = torch.tensor([1, 2, 2, 5 + step], device=device)
        for m, o, s in ((model, a, sa), (ref, b, sb)):
            o.zero_grad()
            s.scale(m[1](m[0](idx).double()).pow(2).sum()).backward()
            if step == 2:  # an overflow: the step is skipped
                m[1].weight.grad[0, 0] = float("inf")
            s.step(o)
            s.update()
        for x, y in zip(model.parameters(), ref.parameters()):
            assert _same_bits(x, y), step
        assert sa.get_scale() == sb.get_scale()
    assert sa.get_scale() == 128.0
