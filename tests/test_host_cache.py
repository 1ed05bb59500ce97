"""The cached step plan (mpext.optim._engine.StepPlan): whatever changes between steps, an
optimizer that reuses its plan gives the same bits as a reference that steps the long way at
every step (its plan never kept), so a plan that went stale fails here."""
import gc
import weakref

import pytest
import torch

import mpext
from mpext.optim._engine import StepPlan

import optim_table as T
from optim_table import FORMATS, RULES, pairs, table_params

BF16 = torch.bfloat16
SHAPES = [(4096,), (64,), (8, 8), (5,)]  # the first big enough to keep 8-bit moments


def params(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in SHAPES]


def pair(fmt="master", rule="adamw", groups=None, **extra):
    """(cached, reference) optimizers over equal params, with tests/optim_table.py's rule and
    format; the reference never keeps a plan, so it steps the long way every time."""
    info, form = RULES[rule], FORMATS[fmt]
    dtype = BF16 if BF16 in form.param_dtypes else form.param_dtypes[0]
    kw = dict(info.kwargs, **form.kwargs_for(info))
    kw.update(extra)
    opts = []
    for _ in range(2):
        ps = params(dtype)
        opts.append(info.cls(ps if groups is None else groups(ps), **kw))
    opts[1]._new_plan = lambda *args: None
    return opts


def all_params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def give_grads(opt, step, skip=()):
    """New gradient tensors (as zero_grad(set_to_none=True) and backward give), the same for
    every optimizer at a step; the params at ``skip`` get none."""
    g = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(all_params(opt)):
        grad = torch.randn(p.shape, generator=g).to(p.dtype)
        p.grad = None if i in skip else grad


def assert_same(a, b):
    """The same bits in every param, state tensor and group setting."""
    T.assert_same(T.snapshot(a, all_params(a)), T.snapshot(b, all_params(b)))


def step_both(opts, step, edit=None, skip=()):
    for opt in opts:
        if edit is not None:
            edit(opt, step)
        give_grads(opt, step, skip)
        opt.step()


def run(opts, steps=6, edit=None, skip=lambda step: ()):
    for s in range(steps):
        step_both(opts, s, edit, skip(s))
        assert_same(*opts)


@pytest.mark.parametrize("rule,fmt", table_params("step_plan",
                                                  [(r.name, f.name) for r, f in pairs()]))
def test_plain_steps_reuse_the_plan_and_match(rule, fmt):
    a, b = pair(fmt, rule)
    run((a, b))
    assert isinstance(a._plan, StepPlan) and b._plan is None
    plan = a._plan
    step_both((a, b), 99)
    assert a._plan is plan  # reused, not rebuilt
    assert_same(a, b)


@pytest.mark.parametrize("fmt", ["fp32", "remainder-bf16", "stochastic"])
def test_lr_changed_every_step_float_and_tensor(fmt):
    run(pair(fmt), edit=lambda o, s: o.param_groups[0].__setitem__("lr", 1e-2 / (s + 1)))
    a, b = pair(fmt)
    for o in (a, b):
        o.param_groups[0]["lr"] = torch.tensor(1e-2)
    run((a, b), edit=lambda o, s: o.param_groups[0]["lr"].fill_(1e-2 * 0.5 ** s))


def test_groups_sharing_a_launch_split_when_their_lrs_part():
    a, b = pair(groups=lambda ps: [{"params": ps[:2]}, {"params": ps[2:]}])
    run((a, b), steps=2)
    assert len(a._plan.calls) == 1  # equal lrs and hyperparameters: one launch
    run((a, b), edit=lambda o, s: o.param_groups[1].__setitem__("lr", 1e-3 * (s + 1)))


@pytest.mark.parametrize("fmt", ["master", "master-q8"])
def test_hyperparameters_edited_in_place(fmt):
    def edit(o, s):
        g = o.param_groups[0]
        if s == 1:
            g["betas"] = [0.9, 0.999]  # a list, edited in place below
        if s >= 2:
            g["betas"][0] = 0.5 + 0.05 * s
            g["weight_decay"] = 0.1 * s
        if s == 4:
            g["eps"] = 1e-3
    run(pair(fmt, ema_decay=0.9), edit=edit)


def test_formats_changed_between_steps():
    def edit(o, s):
        g = o.param_groups[0]
        if s == 2:
            g["exp_avg_dtype"] = g["exp_avg_sq_dtype"] = BF16
        if s == 3:
            g["param_remainders"] = True
        if s == 4:
            g["ema_decay"] = 0.5
    run(pair("master"), edit=edit)


@pytest.mark.parametrize("fmt", ["master", "remainder", "stochastic-bf16"])
def test_gradients_missing_in_some_steps(fmt):
    run(pair(fmt), steps=8, skip=lambda s: {0: (1,), 1: (1, 3), 2: (), 3: (0, 1, 2, 3), 4: (2,),
                                            5: (2,)}.get(s, ()))


def test_add_param_group():
    a, b = pair()
    run((a, b), steps=2)
    for o in (a, b):
        new = torch.randn(33, generator=torch.Generator().manual_seed(5))
        o.add_param_group({"params": [new.to(BF16).requires_grad_()], "lr": 1e-3})
    run((a, b), steps=3)


def test_load_state_dict_and_a_fresh_optimizer():
    a, b = pair("remainder-bf16")
    run((a, b), steps=3)
    other, _ = pair("remainder-bf16")
    run((other, _), steps=5)
    sd = other.state_dict()
    for o in (a, b):
        o.load_state_dict(sd)
        for p, q in zip(all_params(o), all_params(other)):
            p.data.copy_(q.data)
    run((a, b), steps=3)
    # and as an optimizer built anew from the checkpoint
    c, _ = pair("remainder-bf16")
    c.load_state_dict(sd)
    for p, q in zip(all_params(c), all_params(other)):
        p.data.copy_(q.data)
    for s in range(3):
        step_both((c,), s)
    assert_same(a, c)


def test_a_params_state_replaced():
    def edit(o, s):
        p = all_params(o)[1]
        if s == 2:  # a new dict
            o.state[p] = {k: v.clone() * (1 if k == "step" else 0.5)
                          for k, v in o.state[p].items()}
        if s == 3:  # a tensor in another format (converted before the step)
            o.state[p]["exp_avg"] = o.state[p]["exp_avg"].to(BF16)
        if s == 4:  # a tensor in the same format
            o.state[p]["exp_avg_sq"] = o.state[p]["exp_avg_sq"] * 2
        if s == 5:
            o.state[p]["step"] = torch.tensor(100.0)
        if s == 6:
            o.state[p] = {}
    run(pair("master"), steps=8, edit=edit)


@pytest.mark.parametrize("to", [torch.float32, torch.float16])
def test_params_dtype_changed_by_to(to):
    a, b = pair("master")
    modules = []
    for o in (a, b):
        m = torch.nn.Module()
        for i, p in enumerate(all_params(o)):
            m.register_parameter("p%d" % i, torch.nn.Parameter(p.detach()))
        modules.append(m)
    a, b = (mpext.optim.AdamW(m.parameters(), lr=1e-2) for m in modules)
    b._new_plan = lambda *args: None
    run((a, b), steps=2)
    for m in modules:
        m.to(to)
    run((a, b), steps=3)


def test_reset_masters():
    a, b = pair("remainder")
    run((a, b), steps=3)
    for o in (a, b):
        with torch.no_grad():
            for p in all_params(o):
                p.mul_(0.5)
        o.reset_masters()
    run((a, b), steps=3)


def test_a_bad_gradient_raises_naming_it_with_nothing_written():
    """A param changed under its gradient (one launch: the op refuses the planned call; two: the
    plan's own check) raises the long way's error, naming the param, with nothing written."""
    for groups in (None, lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "eps": 1e-6}]):
        a, b = pair(groups=groups)
        run((a, b), steps=2)
        assert isinstance(a._plan, StepPlan)
        give_grads(a, 9)
        p = all_params(a)[2]
        saved = p.data
        before = [t.clone() for t in all_params(a)] + [
            t.clone() for st in a.state.values() for t in st.values()]
        for data, error, match in ((torch.zeros(3, dtype=BF16), ValueError, "has shape"),
                                   (saved.to(torch.float16), TypeError, "bfloat16")):
            p.data = data
            with pytest.raises(error, match="(param 2 of group 0|param 0 of group 1).*" + match):
                a.step()
            p.data = saved
            after = [t for t in all_params(a)] + [t for st in a.state.values()
                                                  for t in st.values()]
            assert len(after) == len(before)
            assert all(torch.equal(x, y) for x, y in zip(after, before))
        run((a, b), steps=2)


def test_a_gradient_in_another_layout_than_its_param():
    a, b = pair()
    run((a, b), steps=2)

    def edit(o, s):
        if s >= 1:
            p = all_params(o)[2]
            with torch.no_grad():
                p.data = p.data.t().contiguous().t()  # the same values, the other layout
    for o in (a, b):
        edit(o, 1)
        for st in (o.state[all_params(o)[2]],):
            st.clear()  # fresh state in the param's new layout
    run((a, b), steps=3)


def test_the_plan_keeps_the_optimizer_out_of_reference_cycles():
    """``del opt`` frees its state at once (a device's memory included), plan or not."""
    a, b = pair()
    run((a, b), steps=2)
    assert isinstance(a._plan, StepPlan)
    gone = weakref.ref(a)
    gc.disable()
    try:
        del a
        assert gone() is None
    finally:
        gc.enable()


def test_streams_numbered_globally_after_the_plan_was_made():
    """use_global_sr_streams called after some steps: the stochastic rounding draws from the
    params' new streams (as use_global_sr_streams sets them up, without a process group)."""
    a, b = pair("stochastic-bf16")
    run((a, b), steps=2)
    for o in (a, b):
        index = {p: 10 + i for i, p in enumerate(all_params(o))}
        o._sr_stream_index = lambda index=index: index
    run((a, b), steps=3)
