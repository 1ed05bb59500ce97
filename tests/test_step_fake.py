"""The step ops' fake kernel (mpext/ops.py, ``_step_fake``) checks nothing a trace needs, so a
bad argument under torch.compile meets the C++ planner when the compiled graph runs: the same
exception, the same message, as in eager mode, and nothing written. The planner's messages
live in the planner alone (the fake used to restate them, and a bad input under compile then
failed while tracing, inside a ``TorchRuntimeError`` of dynamo's).

One call reaches the fake kernel and no real one: meta tensors mixed with tensors on a real
device (the dispatcher picks the Meta kernel). The fake refuses it with the planner's wording of
a device mismatch; a call on meta tensors alone is a no-op.

Each compiled case traces its own graph (``aot_eager``: dynamo, fake tensors and
functionalization, as a user's compile has them, without inductor's code generation), about
half a second: the cases are one per kind of check the planner makes, not every check of the
eager suites (tests/test_bad_inputs.py, tests/test_adam.py, ...), which run the same planner.
"""
import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from mpext import ops

from conftest import cuda_only
from optim_table import same_bits

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _adam(dev, change=None, **kw):
    """adam_step_ over three params (fp32, bf16 with an fp32 master, fp16 with one), after
    change(lists): (call, watched tensors)."""
    g = torch.Generator().manual_seed(0)
    masters = [torch.empty(0), torch.randn(4, 3, generator=g), torch.randn(5, generator=g)]
    L = dict(params=[torch.randn(6, generator=g), masters[1].to(BF16), masters[2].to(F16)],
             grads=[torch.randn(6, generator=g), torch.randn(4, 3, generator=g),
                    torch.randn(5, generator=g).to(F16)],
             exp_avgs=[torch.randn(6, generator=g) * 0.1, torch.zeros(4, 3), torch.zeros(5)],
             exp_avg_sqs=[torch.rand(6, generator=g) * 0.01, torch.zeros(4, 3), torch.zeros(5)],
             masters=masters, steps=[torch.full((), 3.0), torch.zeros(()), torch.zeros(())])
    L = {k: [t.to(dev) for t in v] for k, v in L.items()}
    # an lr given stays where it is (on the CPU its value is read on the host)
    kw = {k: v.to(dev) if isinstance(v, torch.Tensor) and k != "lr" else v
          for k, v in kw.items()}
    kw.setdefault("lr", torch.full((), 1e-2, device=dev))
    if change is not None:
        change(L, dev)
    watched = [t for v in L.values() for t in v] + [v for v in kw.values()
                                                     if isinstance(v, torch.Tensor)]

    def call():
        ops.adam_step_(L["params"], L["grads"], L["exp_avgs"], L["exp_avg_sqs"], L["masters"],
                       L["steps"], **kw)
    return call, watched


# Each other rule's wrapper: its lists in order (the first one is the planner's "params", the
# second its "grads"), and whether it takes an lr.
RULES = {"lion_step_": (("params", "grads", "exp_avgs", "masters", "steps"), True),
         "sgd_step_": (("params", "grads", "momentum_buffers", "masters", "steps"), True),
         "muon_momentum_step_": (("updates", "grads", "momentum_buffers", "steps"), False),
         "muon_update_step_": (("params", "updates", "masters", "steps"), True)}


def _one_param(op, dev, meta=None, **kw):
    """A call of another rule's op on one fp32 param of 512 elements, with the tensor of list
    number `meta` on the meta device if given: (call, watched)."""
    names, takes_lr = RULES[op]
    g = torch.Generator().manual_seed(1)
    lists = [[] if n == "masters" else [torch.zeros((), device=dev)] if n == "steps"
             else [torch.randn(512, generator=g).to(dev)] for n in names]
    if meta is not None:  # (a meta tensor in an optional list, such as ema_params, would not
        lists[meta][0] = lists[meta][0].to("meta")  # make the dispatcher pick the Meta kernel)
    if takes_lr:
        kw.setdefault("lr", torch.full((), 1e-3, device=dev))
    watched = [t for ts in lists for t in ts] + [v for v in kw.values()
                                                 if isinstance(v, torch.Tensor)]
    fn = getattr(ops, op)
    return (lambda: fn(*lists, **kw)), watched


def _set(name, i, make):
    def change(L, dev):
        L[name][i] = make(L, dev)
    return change


# (id, builder(dev) -> (call, watched), exception type, message regex): one case per kind of
# check the planner makes (lengths, dtypes, layouts, density, overlap, each rule's
# hyperparameters, storages, 8-bit codes, scalars, values read from an lr on the CPU).
CASES = [
    ("length", lambda d: _adam(d, lambda L, d: L["grads"].pop()), ValueError,
     r"^mpext\.adam_step_: grads must have one entry per param \(3\), got 2$"),
    ("dtype", lambda d: _adam(d, _set("grads", 2, lambda L, d: torch.zeros(5, device=d,
                                                                            dtype=BF16))),
     RuntimeError, r"^mpext\.adam_step_: grads\[2\] must have the dtype of params\[2\] "
                   r"\(float16\) or float32, got bfloat16$"),
    ("layout", lambda d: _adam(d, _set("exp_avgs", 1, lambda L, d: torch.zeros(3, 4, device=d)
                                       .t())), ValueError,
     r"^mpext\.adam_step_: exp_avgs\[1\] \(sizes \[4, 3\], strides \[1, 4\]\) must match "
     r"params\[1\] \(sizes \[4, 3\], strides \[3, 1\]\)$"),
    ("non-dense", lambda d: _adam(d, _set("masters", 2, lambda L, d: torch.zeros(10, device=d)
                                          [::2])), RuntimeError,
     r"^mpext\.adam_step_: masters\[2\] must be dense and non-overlapping"),
    ("overlap", lambda d: _adam(d, _set("exp_avg_sqs", 2, lambda L, d: L["exp_avgs"][2])),
     RuntimeError, r"^mpext\.adam_step_: exp_avgs\[2\] and exp_avg_sqs\[2\] overlap in memory"),
    ("adam hyper", lambda d: _adam(d, beta2=1.0), ValueError,
     r"^mpext\.adam_step_: beta2 must be in \[0, 1\), got 1$"),
    ("storage", lambda d: _adam(d, _set("masters", 1, lambda L, d: torch.empty(0, device=d))),
     ValueError,
     r"^mpext\.adam_step_: params\[1\] is bfloat16 and needs an fp32 master \(masters\[1\]\) "
     r"or a remainder \(remainders\[1\]\); pass master_free=True"),
    ("8-bit codes", lambda d: _adam(d, lambda L, d: (
        L["exp_avgs"].__setitem__(0, torch.zeros(6, device=d, dtype=torch.int8)),
        L["exp_avg_sqs"].__setitem__(0, torch.zeros(6, device=d, dtype=torch.uint8)))),
     ValueError, r"^mpext\.adam_step_: exp_avgs\[0\] holds 8-bit codes, which need "
                 r"exp_avg_scales"),
    ("scalar", lambda d: _adam(d, found_inf=torch.zeros(2)), RuntimeError,
     r"^mpext\.adam_step_: found_inf must have 1 element, got 2$"),
    ("lr value", lambda d: _adam(d, lr=torch.full((), -1e-3)), ValueError,
     r"^mpext\.adam_step_: lr must be a finite number >= 0, got -0\.001$"),
    ("lion hyper", lambda d: _one_param("lion_step_", d, beta1=1.5),
     ValueError, r"^mpext\.lion_step_: beta1 must be in \[0, 1\], got 1\.5$"),
    ("sgd hyper", lambda d: _one_param("sgd_step_", d, momentum=0.9,
                                       dampening=0.5, nesterov=True), ValueError,
     r"^mpext\.sgd_step_: Nesterov momentum requires a momentum and zero dampening"),
    ("muon_momentum hyper", lambda d: _one_param("muon_momentum_step_", d,
                                                 momentum=-1.0), ValueError,
     r"^mpext\.muon_momentum_step_: momentum must be in \[0, inf\), got -1$"),
    ("muon_update hyper", lambda d: _one_param("muon_update_step_", d, lr_ratio=0.0),
     ValueError, r"^mpext\.muon_update_step_: lr_ratio must be in \(0, inf\), got 0$"),
]


def _raised(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 -- the exception is the result under test
        return exc
    raise AssertionError("the call raised nothing")


def _assert_unchanged(watched, before, what):
    for i, (t, b) in enumerate(zip(watched, before)):
        assert same_bits(t, b), "%s: tensor %d was written" % (what, i)


@pytest.mark.parametrize("build,exc,match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_under_compile_raises_as_eager(device, build, exc, match):
    """Eager: the planner's exception and message, nothing written. Compiled (one graph, no
    break, the op inside it): the same exception type and message when the graph runs, nothing
    written."""
    call, watched = build(device)
    before = [t.clone() for t in watched]
    eager = _raised(call)
    assert type(eager) is exc and re.search(match, str(eager)), repr(eager)
    _assert_unchanged(watched, before, "eager")

    call, watched = build(device)
    before = [t.clone() for t in watched]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = _raised(torch.compile(call, backend=counter, fullgraph=True))
    assert type(compiled) is type(eager) and str(compiled) == str(eager), repr(compiled)
    assert counter.frame_count == 1 and counter.op_count >= 1  # the op ran in the graph
    _assert_unchanged(watched, before, "compiled")


@cuda_only("needs a second real device")
def test_tensors_on_two_devices_under_compile_raise_as_eager():
    """A param on the CPU among CUDA tensors: the planner's device message at run time, as in
    eager mode (the fake does not check real devices)."""
    device = "cuda"
    change = _set("params", 2, lambda L, d: L["params"][2].cpu())
    call, watched = _adam(device, change)
    eager = _raised(call)
    assert "params[2] is on cpu but params[0] is on cuda" in str(eager), repr(eager)
    call, watched = _adam(device, change)
    torch._dynamo.reset()
    compiled = _raised(torch.compile(call, backend="aot_eager", fullgraph=True))
    assert type(compiled) is type(eager) and str(compiled) == str(eager), repr(compiled)


# A meta tensor among CPU tensors, per op: the fake kernel is the only one reached.
META_MIX = [
    ("adam_step_", lambda: _adam("cpu", _set("exp_avg_sqs", 1, lambda L, d: L["exp_avg_sqs"][1]
                                             .to("meta"))),
     r"^mpext\.adam_step_: exp_avg_sqs\[1\] is on meta but params\[0\] is on cpu; all tensors "
     r"must be on one device$"),
    ("adam_step_ lr", lambda: _adam("cpu", lr=torch.full((), 1e-2, device="meta")),
     r"^mpext\.adam_step_: lr is on meta but params\[0\] is on cpu \(it may also be on the "
     r"CPU\)$"),
    ("lion_step_", lambda: _one_param("lion_step_", "cpu",
                                      found_inf=torch.zeros((), device="meta")),
     r"^mpext\.lion_step_: found_inf is on meta but params\[0\] is on cpu"),
    ("sgd_step_", lambda: _one_param("sgd_step_", "cpu", 4, momentum=0.9),
     r"^mpext\.sgd_step_: steps\[0\] is on meta but params\[0\] is on cpu"),
    ("muon_momentum_step_", lambda: _one_param("muon_momentum_step_", "cpu", 2, momentum=0.9),
     r"^mpext\.muon_momentum_step_: momentum_buffers\[0\] is on meta but params\[0\] is on "
     r"cpu"),
    ("muon_update_step_", lambda: _one_param("muon_update_step_", "cpu", 1, lr_ratio=1.0),
     r"^mpext\.muon_update_step_: grads\[0\] is on meta but params\[0\] is on cpu"),
]


@pytest.mark.parametrize("build,match", [c[1:] for c in META_MIX], ids=[c[0] for c in META_MIX])
def test_meta_among_real_tensors_refused_in_the_planners_words(build, match):
    call, watched = build()
    real = [t for t in watched if t.device.type != "meta"]
    before = [t.clone() for t in real]
    with pytest.raises(RuntimeError, match=match):
        call()
    _assert_unchanged(real, before, "refused")


# Per step op, a call the planner refuses (a bad hyperparameter; adam_step_ also a short list).
META_ALONE = [
    ("adam_step_", lambda: _adam("meta", lambda L, d: L["grads"].pop(), beta2=1.0,
                                 lr=torch.full((), 1e-2, device="meta"))),
    ("lion_step_", lambda: _one_param("lion_step_", "meta", beta2=1.5,
                                      lr=torch.full((), 1e-3, device="meta"))),
    ("sgd_step_", lambda: _one_param("sgd_step_", "meta", momentum=-1.0,
                                     lr=torch.full((), 1e-3, device="meta"))),
    ("muon_momentum_step_", lambda: _one_param("muon_momentum_step_", "meta", momentum=-1.0)),
    ("muon_update_step_", lambda: _one_param("muon_update_step_", "meta", lr_ratio=0.0,
                                             lr=torch.full((), 1e-3, device="meta"))),
]


@pytest.mark.parametrize("build", [c[1] for c in META_ALONE], ids=[c[0] for c in META_ALONE])
def test_meta_tensors_alone_trace_without_checks(build):
    """On meta tensors alone every step op is a no-op whatever the arguments: what a trace
    needs (the fake of every rule is one, mpext/ops.py's _step_fake). The planner's checks
    come at run time."""
    call, _ = build()
    assert call() is None
