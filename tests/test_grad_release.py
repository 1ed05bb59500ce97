"""Gradient release (``optimizer.release_grads()``): the fused step inside the backward pass.

The reference of every released run is the same optimizer stepping after backward
(``loss.backward(); opt.step()``) on an identical model, which tests/test_adam.py and friends
check against torch and float64 references: with no clipping and no inf/NaN the released run
must give the same bits, for every param and moment format.

Device-generic (the ``device`` fixture): on CUDA a param's post-accumulate-grad hook runs on
autograd's device thread, a path the CPU never takes; CUDA runs are also compared with CPU runs
on the same gradients, bit for bit. The framework refusals (Lightning, accelerate, HF, DDP on
gloo) are about the Python stack, not the device, and run on the CPU.
"""
import contextlib
import copy
import re
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import mpext
from mpext.optim import Adam, AdamW
from mpext.optim import lr_scheduler as mp_sched

import optim_table as T
from optim_table import bits, same_bits
from conftest import CUDA_OK, NO_CUDA_REASON

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


class Tied(nn.Module):
    """An embedding tied to the output head (one Parameter used twice), a 64x80 layer (big
    enough for 8-bit moments), an optional checkpointed block."""

    def __init__(self, dtype=F32, ckpt=None):
        super().__init__()
        self.emb = nn.Embedding(50, 80)
        self.body = nn.Sequential(nn.Linear(80, 64), nn.Tanh(), nn.Linear(64, 80))
        self.norm = nn.LayerNorm(80)
        self.ckpt = ckpt
        self.to(dtype)

    def forward(self, idx):
        h = self.emb(idx)
        if self.ckpt is None:
            h = h + self.body(h)
        else:
            h = h + checkpoint(self.body, h, use_reentrant=self.ckpt)
        return self.norm(h) @ self.emb.weight.t()  # the tied head


def loss_of(model, step):
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 50, (6, 7), generator=g)
    target = torch.randint(0, 50, (6 * 7,), generator=g)
    device = next(model.parameters()).device
    return nn.functional.cross_entropy(model(idx.to(device)).float().reshape(-1, 50),
                                       target.to(device))


def tied_buckets(model, bucket_bytes):
    """The buckets one backward of a Tied model makes, worked out from its params' gradient
    bytes in the order the architecture completes them: the head's matmul and the norm first,
    then the body from its last layer, the tied embedding last (its lookup is the first op of
    the forward). Within a layer weight and bias may come in either order; both orders give
    the same count for the bucket sizes used here (checked by taking both)."""
    layers = [model.norm, model.body[2], model.body[0]]
    counts = set()
    for bias_first in (False, True):
        order = [p for m in layers for p in ((m.bias, m.weight) if bias_first
                                               else (m.weight, m.bias))] + [model.emb.weight]
        n, pending = 0, 0
        for p in order:
            pending += p.numel() * p.element_size()
            if pending >= bucket_bytes:
                n, pending = n + 1, 0
        counts.add(n + (pending > 0))
    assert len(counts) == 1, counts
    return counts.pop()


FORMATS = {
    "fp32": (F32, {}),
    "bf16-master": (BF16, {}),
    "fp16-master": (F16, {}),
    "bf16-remainder": (BF16, dict(param_remainders=True)),
    "bf16-master-free-rne": (BF16, dict(master_weights=False)),
    "bf16-master-free-sr": (BF16, dict(master_weights=False, stochastic_rounding=True, seed=7)),
    "bf16-moments": (BF16, dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16, seed=3)),
    "q8-moments": (F32, dict(exp_avg_dtype=torch.int8, exp_avg_sq_dtype=torch.uint8)),
    "ema": (BF16, dict(param_remainders=True, ema_decay=0.9)),
}


def pair(fmt, cls=AdamW, ckpt=None, device="cpu", **extra):
    dtype, kw = FORMATS[fmt]
    torch.manual_seed(0)
    model = Tied(dtype, ckpt).to(device)
    twin = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # master-free round to nearest warns
        kw = dict(kw, lr=3e-3, **extra)
        return model, cls(model.parameters(), **kw), twin, cls(twin.parameters(), **kw)


def train_both(model, opt, twin, topt, steps, bucket_bytes=20000, wrap=None):
    """Releases ``topt``'s gradients, then makes ``steps`` steps of the reference (backward,
    then step) and of the released twin (one backward), each model called through ``wrap``
    (e.g. torch.compile) if given, checking after each step that both hold the same bits.
    Returns the GradRelease."""
    release = topt.release_grads(bucket_bytes=bucket_bytes)
    run, run_twin = (model, twin) if wrap is None else (wrap(model), wrap(twin))
    for step in range(steps):
        loss_of(run, step).backward()
        opt.step()
        opt.zero_grad()
        loss_of(run_twin, step).backward()
        assert_same_state(model, opt, twin, topt)
    return release


def assert_same_state(model, opt, twin, topt):
    if opt.param_groups[0].get("exp_avg_dtype") is torch.int8:  # the format is exercised
        assert "exp_avg_q8" in opt.state[model.body[0].weight]
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert same_bits(p, q), name
        s, t = opt.state[p], topt.state[q]
        assert s.keys() == t.keys(), name
        for k in s:
            assert same_bits(s[k], t[k]), (name, k)
        assert q.grad is None, name


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("bucket_bytes", [0, 20000, 2 ** 22])
def test_released_run_has_the_bits_of_step_after_backward(fmt, bucket_bytes, device):
    model, opt, twin, topt = pair(fmt, device=device)
    release = train_both(model, opt, twin, topt, 3, bucket_bytes)
    assert release.backward_passes == 3
    # 0: a bucket per param (7); 2^22: one; 20000: 3 of FP32 gradients, 2 of 16-bit ones
    want = tied_buckets(twin, bucket_bytes)
    assert want == {0: 7, 2 ** 22: 1, 20000: 3 if FORMATS[fmt][0] is F32 else 2}[bucket_bytes]
    assert release.buckets_stepped == 3 * want



# Release is the base's, so every rule takes it: Lion and SGD in their lean formats.
OTHER_RULES = {
    "lion-sr-bf16": (mpext.optim.Lion, "bf16-master-free-sr", dict(exp_avg_dtype=BF16)),
    "lion-remainder-q8": (mpext.optim.Lion, "bf16-remainder", dict(exp_avg_dtype="q8")),
    "sgd-sr-bf16": (mpext.optim.SGD, "bf16-master-free-sr",
                    dict(momentum=0.9, momentum_dtype=BF16)),
    "sgd-nesterov-q8": (mpext.optim.SGD, "bf16-master",
                        dict(momentum=0.9, nesterov=True, momentum_dtype="q8")),
    "sgd-no-momentum-ema": (mpext.optim.SGD, "ema", {}),
}


@pytest.mark.parametrize("case", list(OTHER_RULES))
def test_other_rules_released_have_the_bits_of_step_after_backward(case, device):
    cls, fmt, extra = OTHER_RULES[case]
    dtype, kw = FORMATS[fmt]
    kw = {k: v for k, v in kw.items() if not k.startswith("exp_avg")}
    torch.manual_seed(0)
    model = Tied(dtype, None).to(device)
    twin = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw = dict(kw, lr=3e-3, **extra)
        opt, topt = cls(model.parameters(), **kw), cls(twin.parameters(), **kw)
    release = train_both(model, opt, twin, topt, 3)
    assert release.backward_passes == 3
    assert release.buckets_stepped == 3 * tied_buckets(twin, 20000)
    key = opt.moments[0].name if opt.param_groups[0].get("momentum", 1) else None
    if "q8" in case:  # the 8-bit code is exercised, not a fallback to FP32
        assert key + "_q8" in opt.state[model.body[0].weight]

# Every (rule, format) pair of the rules x formats table (tests/optim_table.py), every param
# dtype of the format, on every CPU ISA path: the released run against the same optimizer
# stepped after backward. The gradients are the table's own (make_grads), reached through a
# backward: the loss sum((param.float() * grad.float())) has exactly ``grad`` as the param's
# gradient (widening and rounding back are exact), in whatever layout autograd gives it.
TABLE = [(rule, fmt, dtype) for rule, fmt in T.pairs() for dtype in fmt.param_dtypes]


@pytest.mark.parametrize("rule,fmt,dtype", TABLE, ids=[T.pair_id(c) for c in TABLE])
def test_every_rule_and_format_released_has_the_bits_of_step_after_backward(rule, fmt, dtype,
                                                                          isa):
    params = T.make_params([dtype], rule=rule)
    twin = T.clone_params(params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # master-free round to nearest warns
        kw = dict(fmt.kwargs_for(rule), seed=7)
        opt, topt = rule.make(params, **kw), rule.make(twin, **kw)
    # buckets of one or two params (the largest, 5120 elements, alone)
    release = topt.release_grads(bucket_bytes=300 * torch.finfo(dtype).bits // 8)
    for step in range(3):
        grads = T.make_grads(params, step)
        T.set_grads(params, grads)
        opt.step()
        sum((q.float() * g.float()).sum() for q, g in zip(twin, grads)).backward()
        assert all(q.grad is None for q in twin)
    assert release.buckets_stepped >= 3 * 2
    T.assert_same(T.snapshot(opt, params), T.snapshot(topt, twin), "%s %s" % (rule, fmt))


def _on_cpu(snap):
    params, state, groups = snap
    return ([p.cpu() for p in params],
            [{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
             for st in state], groups)


PAIRS = list(T.pairs())


@pytest.mark.skipif(not CUDA_OK, reason=NO_CUDA_REASON)
@pytest.mark.parametrize("rule,fmt", PAIRS, ids=[T.pair_id(c) for c in PAIRS])
def test_every_rule_and_format_released_on_cuda_has_the_bits_of_cpu(rule, fmt):
    """The same released steps on CUDA (hooks on autograd's device thread, the CUDA kernels)
    and on the CPU, from the same params and gradients (the table's, reached through a
    backward as above), every param dtype of the format together: the same bits."""
    snaps = {}
    for device in ("cpu", "cuda"):
        params = [p.detach().to(device).requires_grad_()
                  for p in T.make_params(fmt.param_dtypes, rule=rule)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # master-free round to nearest warns
            opt = rule.make(params, **dict(fmt.kwargs_for(rule), seed=7))
        release = opt.release_grads(bucket_bytes=600)
        for step in range(3):
            grads = [g.to(device) for g in T.make_grads(params, step)]
            sum((q.float() * g.float()).sum() for q, g in zip(params, grads)).backward()
            assert all(q.grad is None for q in params)
        assert release.buckets_stepped >= 3 * 2
        snaps[device] = _on_cpu(T.snapshot(opt, params))
    T.assert_same(snaps["cpu"], snaps["cuda"], "%s %s: cpu vs cuda" % (rule, fmt))


def test_adam_with_l2_decay_and_param_groups():
    torch.manual_seed(0)
    model = Tied(BF16)
    twin = copy.deepcopy(model)

    def groups(m):
        return [dict(params=list(m.emb.parameters()) + list(m.norm.parameters())),
                dict(params=list(m.body.parameters()), lr=1e-2, weight_decay=0.1)]
    opt, topt = Adam(groups(model), lr=3e-3), Adam(groups(twin), lr=3e-3)
    train_both(model, opt, twin, topt, 3, 5000)


def test_accumulation_over_micro_batches_has_the_bits_of_accumulate_then_step(device):
    model, opt, twin, topt = pair("bf16-remainder", device=device)
    scaler, tscaler = mpext.GradScaler(device), mpext.GradScaler(device)
    release = topt.release_grads(bucket_bytes=20000, scaler=tscaler, max_grad_norm=1.0,
                                 clip="previous")
    head_only = twin.emb.weight.sum()  # a last micro-batch that leaves the body without grads
    for micro in range(3):
        scaler.scale(loss_of(model, micro)).backward()
    norm = nn.utils.get_total_norm([p.grad.float() for p in model.parameters()])
    scaler.step(opt)
    scaler.update()
    for micro in range(2):
        with release.accumulate():
            tscaler.scale(loss_of(twin, micro)).backward()
    assert twin.body[0].weight.grad is not None  # accumulated, not stepped
    tscaler.scale(loss_of(twin, 2)).backward()
    tscaler.update()
    assert_same_state(model, opt, twin, topt)  # the first step is not clipped
    assert torch.allclose(release.last_grad_norm, norm / scaler.get_scale(), rtol=1e-4)
    with release.accumulate():
        tscaler.scale(loss_of(twin, 99)).backward()
    tscaler.scale(head_only * 0).backward()  # steps the params with only accumulated ones too
    assert all(p.grad is None for p in twin.parameters())
    with release.accumulate():
        tscaler.scale(loss_of(twin, 98)).backward()
    release.clip = "exact"
    with pytest.raises(RuntimeError, match="cannot follow accumulate"):
        release.backward(loss_of(twin, 97))


def test_the_tied_weight_is_stepped_once_with_its_whole_gradient(device):
    model, opt, twin, topt = pair("fp32", device=device)
    topt.release_grads(bucket_bytes=0)
    order = []
    for p in twin.parameters():
        p.register_post_accumulate_grad_hook(lambda p: order.append(p))
    loss_of(twin, 0).backward()
    assert len(order) == len(list(twin.parameters()))  # the tied weight's hook fired once
    assert topt.state[twin.emb.weight]["step"].item() == 1
    loss_of(model, 0).backward()
    opt.step()
    assert same_bits(model.emb.weight, twin.emb.weight)


# ---------------------------------------------------------------------------------------------
# Loss scaling and inf/NaN gradients.


class OnGrad(torch.autograd.Function):
    """Identity whose backward hands the gradient flowing into its input to ``OnGrad.action``
    when one is set (to make it inf, or to fail)."""
    action = None

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g if OnGrad.action is None else OnGrad.action(g)


@contextlib.contextmanager
def on_grad(action):
    OnGrad.action = action
    try:
        yield
    finally:
        OnGrad.action = None


def poisoned():
    return on_grad(lambda g: g * float("inf"))


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 1:  # the inf reaches layers 0 and 1, whose grads come last in backward
                x = OnGrad.apply(x)
        return x.square().mean()


def test_a_bucket_with_an_inf_and_every_later_one_change_nothing(device):
    torch.manual_seed(0)
    model = Chain().to(device)
    ref = copy.deepcopy(model)
    x = torch.randn(5, 8).to(device)
    scaler = mpext.GradScaler(device, init_scale=2.0 ** 10)
    opt = AdamW(model.parameters(), lr=1e-2)
    release = opt.release_grads(bucket_bytes=0, scaler=scaler)
    sched = mp_sched.LambdaLR(opt, lambda s: 1.0 / (1 + s), scaler=scaler)
    # the clean reference, for the params stepped before the inf appeared
    ref_opt = AdamW(ref.parameters(), lr=1e-2)
    ref_scaler = mpext.GradScaler(device, init_scale=2.0 ** 10)
    ref_scaler.scale(ref(x)).backward()
    ref_scaler.step(ref_opt)
    before = [p.detach().clone() for p in model.parameters()]
    with poisoned(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no "scheduler before optimizer" warning
        scaler.scale(model(x)).backward()
        scaler.update()
        sched.step()
    stepped = {id(p) for layer in model.layers[2:] for p in layer.parameters()}
    for p, r, b in zip(model.parameters(), ref.parameters(), before):
        if id(p) in stepped:  # earlier buckets keep their update
            assert same_bits(p, r)
            assert opt.state[p]["step"].item() == 1
        else:  # the bucket with the inf and every later one: nothing changed
            assert same_bits(p, b)
            assert opt.state[p]["step"].item() == 0
            assert not opt.state[p]["exp_avg"].any() and not opt.state[p]["exp_avg_sq"].any()
        assert p.grad is None
    assert release.buckets_stepped == 8
    assert scaler.get_scale() == 2.0 ** 9  # backed off as after a skipped step
    assert scaler.last_step_skipped(opt).item()
    assert sched.step_count.item() == 0  # held still
    # the next, clean iteration steps everything and the schedule moves on
    scaler.scale(model(x)).backward()
    scaler.update()
    sched.step()
    assert not scaler.last_step_skipped(opt).item()
    assert sched.step_count.item() == 1
    assert scaler.get_scale() == 2.0 ** 9
    assert all(opt.state[p]["step"].item() in (1, 2) for p in model.parameters())


class Deep(nn.Module):
    """Four 8x8 layers; their gradients complete from the last layer to the first."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


@pytest.mark.parametrize("bucket_bytes", [0, 300])
def test_from_the_first_bucket_with_an_inf_every_later_one_changes_nothing(bucket_bytes,
                                                                            device):
    """One param's gradient alone is made inf (a tensor hook on that param: the gradients
    flowing on to the earlier layers stay finite), so the buckets completed after its bucket
    hold finite gradients only. They, and the params of its own bucket, must change nothing
    (params, moments, step counts); the buckets completed before it keep their update, the
    bits of the same optimizer stepped after a clean backward. The buckets are worked out here
    from the order in which the gradients complete and their bytes (a bucket is stepped once
    its bytes reach bucket_bytes)."""
    torch.manual_seed(0)
    model = Deep().to(device)
    clean = copy.deepcopy(model)
    x = torch.randn(5, 8).to(device)
    params = list(model.parameters())
    done = []  # (param, gradient bytes), as the gradients complete (hooked before release)
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: done.append((p, p.grad.nbytes)))
    scaler = mpext.GradScaler(device, init_scale=2.0 ** 10)
    opt = AdamW(params, lr=1e-2)
    release = opt.release_grads(bucket_bytes=bucket_bytes, scaler=scaler)
    poisoned = model.layers[1].weight  # its gradient completes after layers 3 and 2
    poisoned.register_hook(lambda g: torch.full_like(g, float("inf")))
    before = [p.detach().clone() for p in params]
    clean_opt = AdamW(clean.parameters(), lr=1e-2)
    clean_scaler = mpext.GradScaler(device, init_scale=2.0 ** 10)
    clean_scaler.scale(clean(x)).backward()
    clean_scaler.step(clean_opt)

    scaler.scale(model(x)).backward()
    scaler.update()

    buckets, current, pending = [], [], 0
    for p, nbytes in done:
        current.append(p)
        pending += nbytes
        if pending >= bucket_bytes:
            buckets.append(current)
            current, pending = [], 0
    buckets += [current] if current else []
    first_bad = next(i for i, b in enumerate(buckets) if any(p is poisoned for p in b))
    earlier = {id(p) for b in buckets[:first_bad] for p in b}
    later_finite = [p for b in buckets[first_bad + 1:] for p in b]
    assert earlier and later_finite  # a real test: updates before, finite buckets after
    for p, c, b in zip(params, clean.parameters(), before):
        if id(p) in earlier:  # earlier buckets keep their update
            assert same_bits(p, c)
            assert opt.state[p]["step"].item() == 1
        else:  # the bucket with the inf and every later one, finite or not: nothing changed
            assert same_bits(p, b)
            assert opt.state[p]["step"].item() == 0
            assert not opt.state[p]["exp_avg"].any() and not opt.state[p]["exp_avg_sq"].any()
        assert p.grad is None
    assert release.buckets_stepped == len(buckets)
    assert scaler.last_step_skipped(opt).item()
    assert scaler.get_scale() == 2.0 ** 9


@pytest.mark.parametrize("fmt", ["bf16-master", "bf16-remainder", "q8-moments", "ema"])
def test_scaled_released_run_has_the_bits_of_scaler_step(fmt, device):
    model, opt, twin, topt = pair(fmt, device=device)
    scaler, tscaler = mpext.GradScaler(device), mpext.GradScaler(device)
    topt.release_grads(bucket_bytes=20000, scaler=tscaler)
    for step in range(3):
        scaler.scale(loss_of(model, step)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        tscaler.scale(loss_of(twin, step)).backward()
        tscaler.update()
        assert scaler.get_scale() == tscaler.get_scale()
    assert_same_state(model, opt, twin, topt)


@pytest.mark.parametrize("clip", [None, "previous", "exact"])
def test_a_released_step_makes_no_host_read(clip, device):
    from conftest import HostReads
    model, _, twin, topt = pair("bf16-remainder", device=device)
    scaler = mpext.GradScaler(device)
    release = topt.release_grads(bucket_bytes=20000, scaler=scaler,
                                 max_grad_norm=None if clip is None else 1.0,
                                 clip=clip or "exact")
    for step in range(2):
        loss = scaler.scale(loss_of(twin, step))
        with HostReads().counting() as reads:
            release.backward(loss)
            scaler.update()
        assert reads.count == 0, reads.calls


# ---------------------------------------------------------------------------------------------
# Refusals.


def test_step_and_scaler_step_are_refused_while_released():
    model, _, twin, topt = pair("fp32")
    scaler = mpext.GradScaler("cpu")
    release = topt.release_grads(scaler=scaler)
    scaler.scale(loss_of(twin, 0)).backward()
    with pytest.raises(RuntimeError, match=r"step\(\) is refused while .* released"):
        topt.step()
    with pytest.raises(RuntimeError, match=r"scaler.step\(optimizer\) is refused"):
        scaler.step(topt)
    scaler.update()
    release.remove()
    loss_of(twin, 1).backward()
    assert twin.emb.weight.grad is not None
    topt.step()  # stepping by hand again
    assert topt.state[twin.emb.weight]["step"].item() == 2


def test_bad_settings_are_refused_before_anything_changes():
    model, opt, twin, topt = pair("fp32")
    with pytest.raises(TypeError, match="mpext.GradScaler"):
        topt.release_grads(scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="bucket_bytes"):
        topt.release_grads(bucket_bytes=-1)
    with pytest.raises(ValueError, match="max_grad_norm"):
        topt.release_grads(max_grad_norm=0.0)
    with pytest.raises(ValueError, match="clip"):
        topt.release_grads(max_grad_norm=1.0, clip="sometimes")
    assert topt._grad_release is None
    topt.release_grads()
    with pytest.raises(RuntimeError, match="already released"):
        topt.release_grads()
    # a param that already has a gradient (accumulated before release)
    loss_of(model, 0).backward()
    with pytest.raises(RuntimeError, match="already has a gradient"):
        opt.release_grads()
    # a frozen param would never be stepped
    frozen = nn.Linear(3, 3)
    frozen.bias.requires_grad_(False)
    with pytest.raises(ValueError, match="param 1 of group 0 is not a leaf that requires grad"):
        AdamW(frozen.parameters()).release_grads()


def test_mixed_precision_optimizer_is_refused():
    model = nn.Linear(4, 4).to(BF16)
    mpo = mpext.MixedPrecisionOptimizer(AdamW(model.parameters()))
    with pytest.raises(NotImplementedError, match="MixedPrecisionOptimizer"):
        mpo.release_grads()
    with pytest.raises(ValueError, match="MixedPrecisionOptimizer"):
        mpo.optimizer.release_grads()  # its params are the FP32 masters


def test_nested_backward_is_refused():
    """A backward started inside another's (reentrant checkpoint runs one) is refused, in
    either order of the params' hooks."""
    for reentrant_first in (False, True):
        torch.manual_seed(0)
        model = Tied(F32, ckpt=True)
        if reentrant_first:  # the checkpointed block's params are hooked first in backward
            model.norm.requires_grad_(False)
            model.emb.requires_grad_(False)
            model.emb.weight.requires_grad_(True)
        params = [p for p in model.parameters() if p.requires_grad]
        AdamW(params).release_grads(bucket_bytes=0)
        with pytest.raises(RuntimeError, match="use_reentrant=False"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss_of(model, 0).backward()


def test_a_failed_backward_does_not_block_the_next(device):
    model, opt, twin, topt = pair("fp32", device=device)
    topt.release_grads(bucket_bytes=0)

    out = twin(torch.zeros(2, 3, dtype=torch.long, device=device))

    def fail(g):
        raise ValueError("boom")
    with pytest.raises(ValueError, match="boom"), on_grad(fail):
        (OnGrad.apply(twin.emb.weight).sum() + out.sum()).backward()
    loss_of(twin, 1).backward()  # the next backward steps as usual
    assert twin.body[0].weight.grad is None


class Boom(Exception):
    pass


def _fail_in_pre_hook(topt):
    """A step pre-hook that raises: it runs inside the release's hook at the first gradient
    of a backward, before anything is stepped."""
    def hook(*args):
        raise Boom("in a step pre-hook")
    return topt.register_step_pre_hook(hook)


def _fail_in_second_bucket(topt):
    """The optimizer's launch raises at its second call: the first bucket is stepped, the
    second's step fails mid-backward inside the release's hook."""
    launch, calls = topt._launch, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise Boom("in the second bucket's step")
        return launch(*args, **kwargs)
    topt._launch = failing

    class Undo:
        def remove(self):
            topt._launch = launch
    return Undo()


def _fail_outside(twin):
    """A plain tensor hook (not the release's) raises mid-backward, at the body's first
    weight: the gradients of the norm and the body's last layer wait in a bucket."""
    return twin.body[0].weight.register_hook(lambda g: (_ for _ in ()).throw(Boom("elsewhere")))


@pytest.mark.parametrize("where", ["pre_hook", "second_bucket", "outside"])
def test_a_backward_that_fails_mid_way_leaves_nothing_for_the_next(where, device):
    """An exception raised mid-backward (inside the release's hook, or elsewhere), caught and
    kept alive with its traceback: the next backward is not refused and steps every param
    from its own gradients only, with the bits of the same optimizer stepped after backward
    from the state the failed backward left (its earlier buckets stay stepped)."""
    model, opt, twin, topt = pair("bf16-master", device=device)
    # two buckets a backward: the body's first weight fills the first, the rest (the tied
    # embedding, maybe the body's first bias) is stepped at the end
    release = topt.release_grads(bucket_bytes=20000)
    assert tied_buckets(twin, 20000) == 2
    loss_of(twin, 0).backward()  # a first, clean step: the state is not empty
    undo = {"pre_hook": _fail_in_pre_hook, "second_bucket": _fail_in_second_bucket,
            "outside": lambda t: _fail_outside(twin)}[where](topt)
    try:
        loss_of(twin, 1).backward()
    except Boom as exc:
        kept = exc  # its traceback holds the frames of the failed backward
    undo.remove()
    assert kept.__traceback__ is not None
    assert all(p.grad is None for p in twin.parameters())  # nothing left to add to
    stepped = release.buckets_stepped
    assert stepped == (3 if where == "second_bucket" else 2)
    # the reference: the state the failed backward left, stepped after backward
    model.load_state_dict(twin.state_dict())
    opt.load_state_dict(topt.state_dict())
    loss_of(model, 2).backward()
    opt.step()
    loss_of(twin, 2).backward()
    assert release.buckets_stepped == stepped + 2
    assert_same_state(model, opt, twin, topt)


def test_a_loss_the_release_scaler_never_scaled_is_refused_before_anything_steps(device):
    """A scaling mpext.GradScaler whose scale() was never called cannot have scaled the loss:
    mpext's own message (not torch's assertion), before anything is stepped, and the next
    backward, scaled, works although the exception is still alive."""
    model, opt, twin, topt = pair("bf16-master", device=device)
    scaler = mpext.GradScaler(device)
    release = topt.release_grads(bucket_bytes=0, scaler=scaler)
    before = [p.detach().clone() for p in twin.parameters()]
    with pytest.raises(RuntimeError, match=r"no scale yet.*release.backward\(scaler.scale"
                                           r"\(loss\)\).*bf16_check_only=True") as info:
        release.backward(loss_of(twin, 0))
    assert all(same_bits(p, b) and p.grad is None for p, b in zip(twin.parameters(), before))
    assert release.buckets_stepped == 0 and not topt.state
    release.backward(scaler.scale(loss_of(twin, 0)))
    scaler.update()
    assert info.value is not None and release.buckets_stepped == 7
    ref_scaler = mpext.GradScaler(device)
    ref_scaler.scale(loss_of(model, 0)).backward()
    ref_scaler.step(opt)
    ref_scaler.update()
    assert_same_state(model, opt, twin, topt)


@pytest.mark.parametrize("where", ["later", "accumulated", "after-accumulated"])
def test_an_unscaled_loss_under_a_scaling_scaler_is_refused_every_time(where, device):
    """With a scaling mpext.GradScaler, a backward whose loss was not scaled (after scaled
    ones; as a micro-batch of accumulate(); as the last micro-batch) would be unscaled by
    1/scale all the same, a step 2**16 times too small: refused by mpext's message at its
    first gradient, before anything steps, with what was accumulated dropped. The next
    backward, scaled, steps as a release that never met the refused one (and with the
    exception alive: nothing of it is left for the next)."""
    model, opt, twin, topt = pair("fp32", device=device)
    scaler, tscaler = mpext.GradScaler(device), mpext.GradScaler(device)
    release = topt.release_grads(bucket_bytes=20000, scaler=tscaler)

    def both(step):  # a scaled step of each: the reference steps after backward
        scaler.scale(loss_of(model, step)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        tscaler.scale(loss_of(twin, step)).backward()
        tscaler.update()

    both(0)
    assert_same_state(model, opt, twin, topt)
    before = [p.detach().clone() for p in twin.parameters()]
    state = {id(p): {k: v.clone() for k, v in topt.state[p].items()} for p in twin.parameters()}
    stepped, scale = release.buckets_stepped, tscaler.get_scale()
    words = r"mpext.optim.AdamW?.release_grads: the loss of this backward was not scaled by the " \
            r"release's mpext.GradScaler.*release.backward\(scaler.scale\(loss\)\)"
    if where != "later":
        words += r".*The gradients accumulated since the last step were dropped"
        with release.accumulate():
            tscaler.scale(loss_of(twin, 1)).backward()
    with pytest.raises(RuntimeError, match=words) as info:
        if where == "accumulated":
            with release.accumulate():
                loss_of(twin, 2).backward()
        else:
            loss_of(twin, 2).backward()
    assert all(p.grad is None for p in twin.parameters())
    for p, b in zip(twin.parameters(), before):
        assert same_bits(p, b)
        for k, v in state[id(p)].items():
            assert same_bits(topt.state[p][k], v), k
    assert release.buckets_stepped == stepped and tscaler.get_scale() == scale
    both(3)
    assert info.value is not None
    assert_same_state(model, opt, twin, topt)


def test_check_only_scaler_with_float16_params_is_refused_at_release(device):
    """A float16 gradient needs loss scaling, which a check-only scaler does not do: refused
    when the release is made (as the scaler's unscale_ refuses one), nothing changed."""
    model, opt, twin, topt = pair("fp16-master", device=device)
    scaler = mpext.GradScaler(device, bf16_check_only=True)
    with pytest.raises(ValueError, match=r"param 0 of group 0 is float16.*bf16_check_only="
                                         r"False"):
        topt.release_grads(scaler=scaler)
    assert topt._grad_release is None
    loss_of(twin, 0).backward()  # no hooks were left behind: the gradients stay
    assert all(p.grad is not None for p in twin.parameters())


@pytest.mark.parametrize("scaled", [False, True])
def test_check_only_scaler_takes_an_unscaled_loss_with_the_skip(scaled, device):
    """mpext.GradScaler(bf16_check_only=True) with release: release.backward(loss) on an
    unscaled loss (as the docs' "without scaling" invites) gives the bits of the same
    optimizer stepped by scaler.step after backward, and a NaN step changes nothing (params,
    moments, masters, step counts) and is counted as skipped, with the scale held at 1."""
    model, opt, twin, topt = pair("bf16-master", device=device)
    scaler = mpext.GradScaler(device, bf16_check_only=True)
    tscaler = mpext.GradScaler(device, bf16_check_only=True)
    release = topt.release_grads(bucket_bytes=20000, scaler=tscaler)
    for step in range(4):
        nan = step == 2
        loss, tloss = loss_of(model, step), loss_of(twin, step)
        if nan:
            loss, tloss = loss * float("nan"), tloss * float("nan")
            before = [p.detach().clone() for p in twin.parameters()]
            state = {id(p): {k: v.clone() for k, v in topt.state[p].items()}
                     for p in twin.parameters()}
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        release.backward(tscaler.scale(tloss) if scaled else tloss)
        tscaler.update()
        assert_same_state(model, opt, twin, topt)
        assert bool(tscaler.last_step_skipped(topt)) == nan
        if nan:
            for p, b in zip(twin.parameters(), before):
                assert same_bits(p, b)
                for k, v in state[id(p)].items():
                    assert same_bits(topt.state[p][k], v), k
    assert tscaler.get_scale() == 1.0 and tscaler.get_skipped_steps() == 1
    assert release.buckets_stepped == 4 * tied_buckets(twin, 20000)


def test_checkpoint_without_reentrance_has_the_same_bits():
    model, opt, twin, topt = pair("bf16-remainder", ckpt=False)
    train_both(model, opt, twin, topt, 2)


def test_compiled_model_has_the_same_bits():
    model, opt, twin, topt = pair("bf16-master")
    # aot_eager keeps the test quick; inductor gives the same bits too (checked by hand: its
    # kernels differ from eager's, so both runs must be compiled).
    train_both(model, opt, twin, topt, 2, wrap=lambda m: torch.compile(m, backend="aot_eager"))


def test_a_loss_scaled_by_a_scaler_the_release_lacks_is_refused_before_anything_steps(device):
    """A loss scaled by an mpext.GradScaler reaching a release made without it (none, or
    another) would step with gradients multiplied by the scale: refused at the first gradient
    of that backward, which is dropped. A bf16_check_only scaler (scale 1) is not refused, nor
    is a scaled loss that reaches no released param."""
    model, opt, twin, topt = pair("fp32", device=device)
    before = [p.detach().clone() for p in twin.parameters()]
    release = topt.release_grads(bucket_bytes=0)
    scaler = mpext.GradScaler(device)
    with pytest.raises(RuntimeError, match=r"scaled by an mpext.GradScaler that this release "
                                           r"was made without \(scaler=None\).*release_grads\("
                                           r"scaler=\.\.\.\)"):
        scaler.scale(loss_of(twin, 0)).backward()
    assert all(same_bits(p, b) and p.grad is None for p, b in zip(twin.parameters(), before))
    assert release.buckets_stepped == 0 and not topt.state
    scaler.scale(loss_of(model, 0)).backward()  # another model, another optimizer: allowed
    scaler.step(opt)
    release.remove()
    release = topt.release_grads(bucket_bytes=0, scaler=mpext.GradScaler(device))
    with pytest.raises(RuntimeError, match=r"was not made with \(it has another\)"):
        scaler.scale(loss_of(twin, 0)).backward()
    assert all(same_bits(p, b) and p.grad is None for p, b in zip(twin.parameters(), before))
    release.remove()
    topt.release_grads(bucket_bytes=0)
    mpext.GradScaler(device, bf16_check_only=True).scale(loss_of(twin, 0)).backward()
    assert topt.state[twin.emb.weight]["step"].item() == 1


# ---------------------------------------------------------------------------------------------
# Frameworks that step the optimizer themselves: Lightning automatic optimization, accelerate's
# AcceleratedOptimizer, transformers.Trainer. Refused by name, with the way out, at the first
# point that can see them, before anything is stepped.

LIGHTNING_WAY_OUT = (r"Lightning automatic optimization.*automatic_optimization = False.*"
                     r"self.manual_backward\(loss\)")
HF_WAY_OUT = r"plain loop.*Lightning manual optimization"


def _unchanged(params, before, opt):
    """The params hold their values (in their dtype: a precision plugin may have cast them),
    have no gradient, and the optimizer stepped none of them."""
    for p, b in zip(params, before):
        assert same_bits(p, b.to(p.dtype)) and p.grad is None
    assert all(st["step"].item() == 0 for st in opt.state.values())


def _lightning_setup():
    pl = pytest.importorskip("lightning.pytorch")

    class Regressor(pl.LightningModule):
        def __init__(self, automatic, release_in_configure=False):
            super().__init__()
            self.automatic_optimization = automatic
            self.release_in_configure = release_in_configure
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
            self.opt = AdamW(self.net.parameters(), lr=1e-2)
            self.before = [p.detach().clone() for p in self.parameters()]

        def training_step(self, batch, i):
            loss = nn.functional.mse_loss(self.net(batch[0]).float(), batch[1])
            if not self.automatic_optimization:
                self.manual_backward(loss)
            return loss

        def configure_optimizers(self):
            if self.release_in_configure:
                self.opt.release_grads()
            return self.opt

    def fit(module, **kw):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(8, 8, generator=g),
                                              torch.randn(8, 1, generator=g))
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    return Regressor, fit


@pytest.mark.parametrize("case", ["release_in_configure_optimizers", "step_with_closure",
                                  "closure_before_step"])
def test_lightning_automatic_optimization_is_refused_by_name(case):
    """Each way Lightning's automatic optimization reaches a released optimizer: the release
    made in configure_optimizers (refused there); made before fit, then optimizer.step(closure)
    from the default precision plugin (refused before the closure runs); or a precision plugin
    that runs the closure (training_step and backward) before the step (refused at the first
    gradient of that backward)."""
    Regressor, fit = _lightning_setup()
    import mpext.lightning
    module = Regressor(automatic=True, release_in_configure=case.startswith("release"))
    if not case.startswith("release"):
        module.opt.release_grads()
    plugins = [mpext.lightning.MixedPrecision("bf16")] if case == "closure_before_step" else []
    where = {"release_in_configure_optimizers": r"^mpext.optim.AdamW.release_grads: ",
             "step_with_closure": r"^mpext.optim.AdamW.step\(\) is refused. ",
             "closure_before_step": r"^mpext.optim.AdamW.release_grads: "}[case]
    with pytest.raises(RuntimeError, match=where + ".*" + LIGHTNING_WAY_OUT):
        fit(module, plugins=plugins)
    _unchanged(module.parameters(), module.before, module.opt)


def test_lightning_precision_plugin_that_scales_is_refused_in_manual_optimization():
    """Manual optimization is the supported way, but a precision plugin that scales the loss
    in manual_backward with a scaler the release lacks (Lightning's own 16-mixed one, or mpext's
    FP16 plugin) would step with scaled gradients: refused at the first gradient."""
    Regressor, fit = _lightning_setup()
    from lightning.pytorch.plugins.precision import MixedPrecision
    import mpext.lightning
    for plugin in (MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")),
                   mpext.lightning.MixedPrecision("fp16")):
        module = Regressor(automatic=False)
        module.opt.release_grads()
        with pytest.raises(RuntimeError, match=r"precision plugin MixedPrecision scales the "
                                               r"loss with its own GradScaler.*16-true"):
            fit(module, plugins=[plugin])
        _unchanged(module.parameters(), module.before, module.opt)
    module = Regressor(automatic=False)  # the supported way steps
    release = module.opt.release_grads()
    fit(module)
    assert release.backward_passes == 2 and release.buckets_stepped == 2


def _accelerate_setup():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    g = torch.Generator().manual_seed(0)
    batch = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    return accelerate, model, opt, before, batch


@pytest.mark.parametrize("accumulation", [1, 2])
def test_accelerate_prepare_of_a_released_optimizer_is_refused_by_name(accumulation):
    """accelerator.prepare(optimizer) wraps it in an AcceleratedOptimizer, which steps after
    backward (with accumulation, every N-th): refused in prepare (when the wrapper reads the
    optimizer's state_dict to place it), before any micro-batch."""
    accelerate, model, opt, before, _ = _accelerate_setup()
    opt.release_grads()
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    with pytest.raises(RuntimeError, match=r"^mpext.optim.AdamW.release_grads: gradient "
                                           r"release cannot run with accelerate's "
                                           r"AcceleratedOptimizer.*" + HF_WAY_OUT):
        acc.prepare(model, opt)
    assert not acc._optimizers
    _unchanged(model.parameters(), before, opt)


def test_accelerate_accumulation_is_refused_at_the_first_backward():
    """Where prepare does not read the state_dict (device_placement=False), or the optimizer
    is not prepared but the Accelerator accumulates: accelerator.backward of micro-batch 0 is
    refused at its first gradient, before anything is stepped."""
    accelerate, model, opt, before, (x, y) = _accelerate_setup()
    opt.release_grads()
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, wrapped = acc.prepare(model, opt, device_placement=[True, False])
    with pytest.raises(RuntimeError, match=r"AcceleratedOptimizer.*" + HF_WAY_OUT):
        with acc.accumulate(model):
            acc.backward(nn.functional.mse_loss(model(x), y))
    _unchanged(model.parameters(), before, opt)

    accelerate, model, opt, before, (x, y) = _accelerate_setup()
    opt.release_grads()
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = acc.prepare(model)
    with pytest.raises(RuntimeError, match=r"accelerate's gradient accumulation \("
                                           r"gradient_accumulation_steps=2\).*" + HF_WAY_OUT):
        with acc.accumulate(model):
            acc.backward(nn.functional.mse_loss(model(x), y))
    _unchanged(model.parameters(), before, opt)


def test_accelerate_wrapper_made_before_the_release_is_refused_by_name():
    """prepare() before release_grads(), with accumulation over 2 micro-batches:
    accelerator.backward is refused at its first gradient. A plain loss.backward() shows
    nothing of accelerate, so (as the docs say) each micro-batch's backward steps, the
    wrapper's step() does nothing on micro-batch 0 and is refused by name on micro-batch 1,
    its sync point."""
    accelerate, model, opt, before, (x, y) = _accelerate_setup()
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, wrapped = acc.prepare(model, opt)
    release = opt.release_grads()
    with pytest.raises(RuntimeError, match=r"AcceleratedOptimizer.*" + HF_WAY_OUT):
        acc.backward(nn.functional.mse_loss(model(x), y))
    _unchanged(model.parameters(), before, opt)
    with acc.accumulate(model):
        nn.functional.mse_loss(model(x), y).backward()
        wrapped.step()
    assert release.buckets_stepped == 1
    assert all(st["step"].item() == 1 for st in opt.state.values())
    with acc.accumulate(model):
        nn.functional.mse_loss(model(x), y).backward()
        with pytest.raises(RuntimeError, match=r"step\(\) is refused. .*AcceleratedOptimizer"
                                               r".*" + HF_WAY_OUT):
            wrapped.step()
    assert release.buckets_stepped == 2


def test_accelerate_backward_with_the_accelerators_scaler():
    """accelerator.backward scales the loss with the Accelerator's scaler: refused when the
    release was made without it; with it (mpext.accelerate.use_grad_scaler's), the release
    steps, and the optimizer is simply not prepared."""
    accelerate, model, opt, before, (x, y) = _accelerate_setup()
    import mpext.accelerate
    acc = accelerate.Accelerator(cpu=True, mixed_precision="fp16")
    scaler = mpext.accelerate.use_grad_scaler(acc, init_scale=2.0 ** 4)
    release = opt.release_grads()
    model = acc.prepare(model)
    with pytest.raises(RuntimeError, match=r"accelerator.backward scales the loss with the "
                                           r"Accelerator's GradScaler, which this release was "
                                           r"not made with.*release_grads\(scaler=\.\.\.\)"):
        acc.backward(nn.functional.mse_loss(model(x), y))
    _unchanged(model.parameters(), before, opt)
    release.remove()
    release = opt.release_grads(scaler=scaler)
    acc.backward(nn.functional.mse_loss(model(x), y))
    scaler.update()
    assert release.buckets_stepped == 1 and not scaler.last_step_skipped(opt).item()
    assert all(st["step"].item() == 1 for st in opt.state.values())


def test_hf_trainer_is_refused_by_name(tmp_path):
    """transformers.Trainer prepares the optimizer it is given with accelerate: refused there,
    naming the Trainer, before any step."""
    transformers = pytest.importorskip("transformers")
    accelerate, model, opt, before, _ = _accelerate_setup()

    class Regression(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, labels):
            return {"loss": nn.functional.mse_loss(self.net(x), labels)}

    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(8, generator=g), "labels": torch.randn(1, generator=g)}
            for _ in range(8)]
    opt.release_grads()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, use_cpu=True,
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=Regression(model), args=args, train_dataset=data,
                                   optimizers=(opt, None))
    with pytest.raises(RuntimeError, match=r"cannot run under transformers.Trainer \(HF "
                                           r"Trainer\).*" + HF_WAY_OUT):
        trainer.train()
    _unchanged(model.parameters(), before, opt)


# ---------------------------------------------------------------------------------------------
# More than one process with plain params and no ddp= is refused, naming the way out (DDP's
# comm hook: tests/test_release_ddp.py), at release_grads() and at every backward (a release
# made before the process group existed).


def _ddp_release_body(rank, out_dir):
    import os
    from datetime import timedelta
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    out = {}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    ddp = DDP(model)
    opt = AdamW(model.parameters(), lr=1e-2)
    try:
        opt.release_grads()
    except NotImplementedError as e:
        out["at_release"] = str(e)
    out["released"] = opt._grad_release is not None
    # a release made in one process, then the group formed: refused at the first gradient
    world = dist.get_world_size()
    dist.destroy_process_group()
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = AdamW(model.parameters(), lr=1e-2)
    release = opt.release_grads(bucket_bytes=0)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(out_dir, "again"),
                            rank=rank, world_size=world, timeout=timedelta(seconds=90))
    ddp = DDP(model)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        ddp(torch.randn(4, 8)).sum().backward()
    except NotImplementedError as e:
        out["at_backward"] = str(e)
    out["unchanged"] = all(same_bits(p, b) and p.grad is None
                           for p, b in zip(model.parameters(), before))
    out["stepped"] = release.buckets_stepped
    return out


def test_ddp_is_refused_on_two_gloo_processes(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available")
    from test_distributed import _spawn
    for out in _spawn(_ddp_release_body, tmp_path):
        for key in ("at_release", "at_backward"):
            assert re.search(r"^mpext.optim.AdamW.release_grads: gradient release of plain "
                             r"\(not sharded\) params is not supported with more than one "
                             r"process \(a process group of 2\) unless DDP steps them.*"
                             r"The way out: under DDP, release_grads\(ddp=ddp_model\).*"
                             r"FSDP2.*release.remove\(\).*opt.step\(\)", out[key]), out
        assert not out["released"]
        assert out["unchanged"] and out["stepped"] == 0


# ---------------------------------------------------------------------------------------------
# Clipping.


def test_exact_clipping_matches_clip_grad_norm_then_step(device):
    torch.manual_seed(0)
    model = Tied(F32).to(device)
    twin = copy.deepcopy(model)
    opt, topt = AdamW(model.parameters(), lr=1e-2), AdamW(twin.parameters(), lr=1e-2)
    release = topt.release_grads(bucket_bytes=20000, max_grad_norm=0.5)
    with pytest.raises(RuntimeError, match=r"release.backward\(loss\)"):
        loss_of(twin, 0).backward()
    release.remove()
    for p in twin.parameters():
        p.grad = None
    release = topt.release_grads(bucket_bytes=20000, max_grad_norm=0.5)
    for step in range(3):
        loss_of(model, step).backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        release.backward(loss_of(twin, step))
        assert torch.allclose(release.last_grad_norm, norm, rtol=1e-5)
    assert norm > 0.5  # it did clip
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6)
        assert q.grad is None
    assert release.backward_passes == 6  # two per step: the cost of the exact mode


def test_previous_norm_clipping_uses_the_last_steps_norm(device):
    torch.manual_seed(0)
    model = Tied(F32).to(device)
    twin = copy.deepcopy(model)
    opt, topt = AdamW(model.parameters(), lr=1e-2), AdamW(twin.parameters(), lr=1e-2)
    release = topt.release_grads(bucket_bytes=20000, max_grad_norm=0.5, clip="previous")
    prev = None
    for step in range(3):
        loss_of(model, step).backward()
        norm = nn.utils.get_total_norm([p.grad for p in model.parameters()])
        if prev is not None:  # the previous step's norm clips this one
            nn.utils.clip_grads_with_norm_(model.parameters(), 0.5, prev)
        prev = norm
        opt.step()
        opt.zero_grad()
        loss_of(twin, step).backward()
        assert torch.allclose(release.last_grad_norm, norm, rtol=1e-5)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6)


def test_exact_clipping_with_an_inf_skips_the_whole_step(device):
    torch.manual_seed(0)
    model = Chain().to(device)
    before = [p.detach().clone() for p in model.parameters()]
    scaler = mpext.GradScaler(device)
    opt = AdamW(model.parameters(), lr=1e-2)
    release = opt.release_grads(bucket_bytes=0, scaler=scaler, max_grad_norm=1.0)
    with poisoned():
        release.backward(scaler.scale(model(torch.randn(5, 8).to(device))))
    scaler.update()
    for p, b in zip(model.parameters(), before):  # the norm pass saw the inf: nothing moved
        assert same_bits(p, b)
    assert scaler.last_step_skipped(opt).item()


def test_previous_norm_clipping_keeps_the_norm_over_a_skipped_step(device):
    torch.manual_seed(0)
    model = Chain().to(device)
    scaler = mpext.GradScaler(device)
    opt = AdamW(model.parameters(), lr=1e-2)
    release = opt.release_grads(bucket_bytes=0, scaler=scaler, max_grad_norm=1.0,
                                clip="previous")
    x = torch.randn(5, 8).to(device)
    with poisoned():
        scaler.scale(model(x)).backward()
    scaler.update()
    assert release.last_grad_norm.item() == 0.0  # none before: the next step is not clipped
    scaler.scale(model(x)).backward()
    scaler.update()
    norm = release.last_grad_norm
    with poisoned():
        scaler.scale(model(x)).backward()
    scaler.update()
    assert release.last_grad_norm.item() == norm.item() > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# Memory: the gradients are not all alive at once.


def test_gradient_bytes_are_not_all_alive_at_once(device):
    peaks = {}
    for released in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]).to(device)
        params = list(model.parameters())
        opt = AdamW(params)
        live = []
        for p in params:  # registered before release's hooks: each new gradient is counted
            p.register_post_accumulate_grad_hook(lambda _: live.append(
                sum(q.grad.nbytes for q in params if q.grad is not None)))
        if released:
            opt.release_grads(bucket_bytes=2 * 64 * 64 * 4)
        model(torch.randn(4, 64).to(device)).sum().backward()
        peaks[released] = max(live)
        if not released:
            opt.step()
    total = sum(p.numel() * 4 for p in model.parameters())
    assert peaks[False] == total
    # at most one bucket (two weights) plus the gradient that filled it
    assert peaks[True] <= 2 * 64 * 64 * 4 + 64 * 4 + 64 * 64 * 4
    assert peaks[True] < total / 2


def test_lr_schedules_see_released_steps(device):
    """torch's schedulers (no "lr_scheduler.step() before optimizer.step()" warning) and the
    device-side ones (counting each released step) follow released steps; the optimizer's
    step hooks run once per step."""
    model, _, twin, topt = pair("fp32", device=device)
    topt.release_grads(bucket_bytes=20000)
    torch_sched = torch.optim.lr_scheduler.StepLR(topt, step_size=1, gamma=0.5)
    calls = []
    topt.register_step_pre_hook(lambda *a: calls.append("pre"))
    topt.register_step_post_hook(lambda *a: calls.append("post"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(2):
            loss_of(twin, step).backward()
            torch_sched.step()
    assert topt.param_groups[0]["lr"] == 3e-3 / 4
    assert calls == ["pre", "post"] * 2
    model2, _, twin2, topt2 = pair("fp32", device=device)
    topt2.release_grads(bucket_bytes=20000)
    sched = mp_sched.LambdaLR(topt2, lambda s: 1.0 / (1 + s))
    for step in range(2):
        loss_of(twin2, step).backward()
        sched.step()
    assert sched.step_count.item() == 2


# ---------------------------------------------------------------------------------------------
# The examples, run as users run them (in process, shorter).


@pytest.mark.parametrize("argv", [["--steps", "60"], ["--fp16", "--clip", "previous",
                                                      "--steps", "60"],
                                  ["--clip", "exact", "--steps", "60"]])
def test_plain_loop_example_trains_through_a_nan(argv):
    """It learns, and its NaN step changes nothing: params, moments, masters or remainders
    and step counts hold the bits they had before it (seen through the global optimizer step
    hooks, which a released step runs at its start and its end), while the step before it
    changed them."""
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)
    from framework_examples import example

    def snap(opt):
        params = [p for g in opt.param_groups for p in g["params"]]
        return [p.detach().clone() for p in params], [
            {k: v.clone() for k, v in opt.state[p].items()} for p in params]

    steps = []  # (state before, state after, found_inf) of each step

    def pre(opt, args, kwargs):
        steps.append([snap(opt)])

    def post(opt, args, kwargs):
        steps[-1] += [snap(opt), float(kwargs["found_inf"])]
    handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
    try:
        loss = example("grad_release_train").main(argv + ["--nan-at", "10"])
    finally:
        for h in handles:
            h.remove()
    assert loss < 0.2  # it learned (the start is ~0.64)
    assert len(steps) == 60 and [s[2] for s in steps] == [float(i == 10) for i in range(60)]

    def same(a, b):
        (pa, sa), (pb, sb) = a, b
        return all(same_bits(x, y) for x, y in zip(pa, pb)) and all(
            x.keys() == y.keys() and all(same_bits(x[k], y[k]) for k in x)
            for x, y in zip(sa, sb))
    before, after, _ = steps[10]
    assert any(k != "step" for k in before[1][0])  # moments (and masters) to compare
    assert same(before, after)  # the NaN step changed nothing
    assert not same(*steps[9][:2])  # the step before it did


def test_lightning_manual_optimization_example():
    pytest.importorskip("lightning")
    from framework_examples import example
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, model = example("lightning_grad_release").main(["--epochs", "2"])
    assert loss < 0.3
    assert all(p.grad is None for p in model.parameters())
