"""FP8 saved activations inside torch.compile'd code (mpext.activations_compiled): the compiled
graph's intermediates are packed by the FP8 ops AOTAutograd inlines, with the bits eager
compression gives the same tensors, fewer bytes held for backward, and no graph break."""
import contextlib
import warnings

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager
from torch._functorch.aot_autograd import make_boxed_func

import mpext.activations as act
from mpext import activations_compiled
from mpext.memory.meter import HeapMeter

pytestmark = pytest.mark.skipif(not activations_compiled.supported(),
                                reason="this torch does not inline saved-tensor hooks")


def mlp(d=256, h=512, out=256):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.GELU(), torch.nn.Linear(h, out))


def grads(model, x, fwd, ctx=None):
    model.zero_grad(set_to_none=True)
    with ctx if ctx is not None else contextlib.nullcontext():
        y = fwd(x)
    y.float().square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / a.double().norm()).item()


class Graphs:
    """aot_eager (torch's partitioner, no code generation), keeping the forward and backward
    graphs it is given."""

    def __init__(self):
        self.fw, self.bw, self.dynamo = [], [], []

    @staticmethod
    def _keep(store):
        def compiler(gm, inputs):
            store.append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    def __call__(self, gm, inputs):
        self.dynamo.append(gm)
        return aot_eager(gm, inputs, fw_compiler=self._keep(self.fw),
                         bw_compiler=self._keep(self.bw))


def _ops_in(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _quantized(gm):
    """The quantizations in a graph: FP8 ops, the int8 code's native op, or the int8 code's
    casts to its codes where it is traced from torch ops (a node making int8 from a tensor that
    is not, not its views)."""
    def dtype(a):
        v = getattr(a, "meta", {}).get("val")
        return v.dtype if isinstance(v, torch.Tensor) else None
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and (
        str(n.target) in ("mpext.fp8_quantize.default", "mpext.int8_block_quantize.default") or (
            dtype(n) == torch.int8 and n.args and dtype(n.args[0]) not in (torch.int8, None))))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("code", [torch.int8, torch.float8_e4m3fn])
def test_compiled_saved_tensors_are_fp8_and_gradients_are_eager_compressions_bits(device, code):
    """Linear-GELU-Linear: eager (without recomputing GELU's output from its input) and
    compiled save the same two intermediates (the GELU's input and output); compiled under the
    context, the forward graph hands the backward 8-bit codes and their scales instead, and the
    gradients equal eager compression's bit for bit (and differ from the uncompressed ones by
    the code's rounding)."""
    m = mlp().to(device)
    x = torch.randn(64, 256, device=device)
    be = Graphs()
    cm = torch.compile(m, backend=be, fullgraph=True)
    ctx = act.fp8_saved_tensors(fp8_dtype=code)
    got = grads(m, x, cm, ctx)
    eager = grads(m, x, m, act.fp8_saved_tensors(fp8_dtype=code, recompute=False))
    plain = grads(m, x, m)
    (fw,), (bw,) = be.fw, be.bw
    fw_out = [n for n in fw.graph.nodes if n.op == "output"][0].args[0]
    saved = [n.meta["val"] for n in fw_out[1:]]  # after the model's output
    codes = [t for t in saved if t.dtype == code]
    assert len(codes) == 2 and all(t.numel() == 64 * 512 for t in codes)
    assert not any(t.dtype == torch.float32 and t.shape == (64, 512) for t in saved)
    assert _quantized(fw) == 2
    assert sum(n.op == "placeholder" and n.meta["val"].dtype == code
               for n in bw.graph.nodes) == 2
    if code != torch.int8:
        assert _ops_in(bw).count("mpext.fp8_dequantize.default") == 2
    assert all(torch.equal(a, b) for a, b in zip(eager, got))
    # the compression is really there: 8 bits move the weight gradients
    assert max(rel_err(p, g) for p, g in zip(plain, got)) > 1e-3
    assert ctx.stats["compiled"] == 0  # nothing passed through uncompressed


def test_inductor_gradients_are_eager_compressions_to_float32_rounding(device):
    """Inductor runs the same FP8 ops on the same saved tensors (eager without recompute saves
    them too); its own kernels (fused GELU
    backward, reordered sums) change the float32 rounding only: gradients within a few ulps
    of float32 (relative L2 2**-17) of eager compression's, while compression alone moves them
    by more than 1e-3."""
    m = mlp().to(device)
    x = torch.randn(64, 256, device=device)
    cm = torch.compile(m, fullgraph=True)
    got = grads(m, x, cm, act.fp8_saved_tensors())
    eager = grads(m, x, m, act.fp8_saved_tensors(recompute=False))
    plain = grads(m, x, m)
    assert max(rel_err(e, g) for e, g in zip(eager, got)) < 2.0 ** -17
    assert max(rel_err(p, e) for p, e in zip(plain, eager)) > 1e-3


def _held_for_backward(model, x, fwd, ctx):
    """Bytes the forward pass leaves alive (output and what backward holds), by the allocator."""
    meter = HeapMeter(x.device)
    model.zero_grad(set_to_none=True)
    before = meter()
    with ctx:
        y = fwd(x)
    held = meter() - before
    y.sum().backward()
    return held


def test_compiled_model_holds_fewer_bytes_for_backward_with_the_context(device):
    """Measured by the allocator (mpext.memory.meter.HeapMeter), not by the context's own
    counts: the compiled forward holds two 256x4096 float32 intermediates for backward
    without the context, their FP8 codes and scales with it: 1 + 4/128 bytes per element
    instead of 4, a ratio of 0.258 (plus the small output in both)."""
    m = mlp(1024, 4096, 64).to(device)
    x = torch.randn(256, 1024, device=device)
    cm = torch.compile(m, backend="aot_eager", fullgraph=True)
    for _ in range(2):  # the first calls compile
        raw = _held_for_backward(m, x, cm, contextlib.nullcontext())
        fp8 = _held_for_backward(m, x, cm, act.fp8_saved_tensors())
    two = 2 * 256 * 4096 * 4
    assert raw >= two, raw
    assert fp8 < 0.3 * raw, (fp8, raw)


def test_no_graph_break_added_and_fullgraph_compiles(device):
    """The project's GPT compiled with fullgraph=True inside the context: as many dynamo graphs
    as without it (one), its forward graph quantizes, the loss equals the uncompressed one (the
    forward is untouched) and a second step reuses the compiled code (the hooks are the same
    objects for the same settings: no recompile)."""
    from small_gpt import SmallGPT
    torch.manual_seed(0)
    model = SmallGPT(65, 32, 64, 2, 4).to(device)
    x, y = (torch.randint(0, 65, (2, 32), device=device) for _ in range(2))
    counts, losses, quantized = {}, {}, {}
    for inside in (False, True):
        torch._dynamo.reset()
        be = Graphs()
        compiled = torch.compile(model, backend=be, fullgraph=True)
        for _ in range(2):
            with act.fp8_saved_tensors() if inside else contextlib.nullcontext():
                losses[inside] = compiled(x, y)
            losses[inside].backward()
        counts[inside] = len(be.dynamo)
        quantized[inside] = sum(_quantized(g) for g in be.fw)
    assert counts[True] == counts[False] == 1, counts
    assert quantized[False] == 0 and quantized[True] > 0, quantized
    assert torch.equal(losses[True], losses[False])


def test_compiled_hf_gpt2_trains_with_fp8_saved_tensors(device):
    """A stock HF GPT-2 (GPT2Config's defaults but small sizes, dropout off so that eager and
    compiled see the same values), compiled with fullgraph=True inside the context: its forward
    graph quantizes what it saves, and each gradient's error against the uncompressed compiled
    model is no more than twice eager compression's error on the same gradient (the two save
    partly different tensors: the partitioner recomputes some pointwise ops)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  vocab_size=128, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).to(device).train()
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(2)).to(device)
    be = Graphs()
    compiled = torch.compile(model, backend=be, fullgraph=True)

    def step(fwd, ctx):
        model.zero_grad(set_to_none=True)
        with ctx:
            logits = fwd(input_ids=ids).logits  # the loss outside: HF's logs (a break)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                                 ids[:, 1:].flatten())
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]
    plain = step(compiled, contextlib.nullcontext())
    got = step(compiled, act.fp8_saved_tensors())
    eager_plain = step(model, contextlib.nullcontext())
    eager = step(model, act.fp8_saved_tensors())
    assert sum(_quantized(g) for g in be.fw) >= 4
    errs = [(rel_err(p, g), rel_err(ep, e)) for p, g, ep, e in zip(plain, got, eager_plain, eager)
            if p.norm() > 0]
    assert max(c for c, _ in errs) > 1e-4  # compressed
    assert all(c <= 2 * e + 1e-5 for c, e in errs), errs


def _mpext_warnings(fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(x.message) for x in w if str(x.message).startswith("mpext")]


@pytest.mark.parametrize("why", ["old torch", "stochastic"])
def test_without_inlined_hooks_compiled_tensors_pass_unchanged_warned_once(device, monkeypatch,
                                                                            why):
    """Where torch cannot inline the hooks (simulated: what activations.py found at import)
    or stochastic rounding is asked for (a compiled graph would repeat its random stream every
    step), the compiled graph keeps its saved tensors: the gradients are the uncompressed ones
    bit for bit, and the context warns once, saying why."""
    if why == "old torch":
        monkeypatch.setattr(act, "_COMPILED", False)
    m = mlp().to(device)
    x = torch.randn(64, 256, device=device)
    cm = torch.compile(m, backend="aot_eager")
    ref = grads(m, x, cm)
    ctx = act.fp8_saved_tensors(stochastic=why == "stochastic")
    (a, b), said = _mpext_warnings(lambda: (grads(m, x, cm, ctx), grads(m, x, cm, ctx)))
    assert len(said) == 1 and "NOT compressed" in said[0], said
    assert ("saved_tensors_hooks_are_inlineable" if why == "old torch" else "stochastic") \
        in said[0]
    assert all(torch.equal(r, g) for r, g in zip(ref, a + b))


def test_context_entered_inside_compiled_code_warns_once_and_still_compresses(device):
    """torch.compile of a function that enters the context itself: dynamo cannot trace the
    hooks' entry, so the function is cut into several graphs (and the pieces' saved tensors
    passed uncompressed). Not silently: one warning that says where to put the context; the
    model compiled with the context around the call is one graph, compressed, no warning."""
    m = mlp().to(device)
    x = torch.randn(64, 256, device=device)

    def inside(x):
        with act.fp8_saved_tensors():
            return m(x)
    be = Graphs()
    ci = torch.compile(inside, backend=be)
    got, said = _mpext_warnings(lambda: grads(m, x, ci))
    assert len(said) == 1 and "entered inside a torch.compile'd function" in said[0], said
    assert "around the compiled call" in said[0]
    assert len(be.dynamo) > 1  # the split the warning is about
    plain = grads(m, x, m)
    eager = grads(m, x, m, act.fp8_saved_tensors())
    torch._dynamo.reset()
    be = Graphs()
    cm = torch.compile(m, backend=be)
    outside, said = _mpext_warnings(lambda: grads(m, x, cm, act.fp8_saved_tensors()))
    assert said == [] and len(be.dynamo) == 1
    # compressed: off the uncompressed gradients, by no more than twice eager compression
    errs = [(rel_err(p, g), rel_err(p, e)) for p, g, e in zip(plain, outside, eager)]
    assert max(c for c, _ in errs) > 1e-3
    assert all(c <= 2 * e + 1e-6 for c, e in errs), errs


def test_a_boolean_mask_the_compiled_graph_saves_is_stored_as_bits(device):
    """Linear-dropout-Linear partitioned as inductor does (min-cut), which saves the dropout's
    mask as bool: under the context the forward hands the backward one
    bit per mask element (``activations_recompute.pack_bits``, exact) and no bool tensor; with
    a policy that takes no floating tensor the gradients are the uncompressed compiled run's,
    bit for bit."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    fw = []

    def keep(store):
        def compiler(gm, inputs):
            store.append(gm)
            return make_boxed_func(gm.forward)
        return compiler
    backend = aot_autograd(fw_compiler=keep(fw), bw_compiler=keep([]),
                           partition_fn=min_cut_rematerialization_partition)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Dropout(0.5),
                            torch.nn.Linear(512, 256)).to(device)
    x = torch.randn(64, 256, device=device)
    cm = torch.compile(m, backend=backend, fullgraph=True)
    torch.manual_seed(1)
    plain = grads(m, x, cm)
    assert any(t.dtype == torch.bool for t in [n.meta["val"] for n in [
        n for n in fw[-1].graph.nodes if n.op == "output"][0].args[0][1:]])
    torch._dynamo.reset()
    fw.clear()
    torch.manual_seed(1)  # the same mask
    got = grads(m, x, cm, act.fp8_saved_tensors(lambda t: False, warn_unmatched=False))
    saved = [n.meta["val"] for n in [n for n in fw[-1].graph.nodes
                                     if n.op == "output"][0].args[0][1:]]
    assert not any(t.dtype == torch.bool for t in saved), [(t.dtype, t.shape) for t in saved]
    assert sum(t.dtype == torch.uint8 and t.numel() == 64 * 512 // 8 for t in saved) == 1
    assert all(torch.equal(a, b) for a, b in zip(plain, got))
