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
    """Linear-GELU-Linear: compiled under the context, the graph is partitioned to rerun the
    GELU from its input in the backward (activations_compiled.PARTITIONER), as eager
    compression's recipe does: both store one intermediate, the GELU's input, whose 8-bit
    code and scales the forward graph hands the backward, and the gradients equal eager
    compression's bit for bit (and differ from the uncompressed ones by the code's
    rounding)."""
    m = mlp().to(device)
    x = torch.randn(64, 256, device=device)
    be = Graphs()
    cm = torch.compile(m, backend=be, fullgraph=True)
    ctx = act.fp8_saved_tensors(fp8_dtype=code)
    got = grads(m, x, cm, ctx)
    eager = grads(m, x, m, act.fp8_saved_tensors(fp8_dtype=code))
    plain = grads(m, x, m)
    (fw,), (bw,) = be.fw, be.bw
    fw_out = [n for n in fw.graph.nodes if n.op == "output"][0].args[0]
    saved = [n.meta["val"] for n in fw_out[1:]]  # after the model's output
    codes = [t for t in saved if t.dtype == code]
    assert len(codes) == 1 and all(t.numel() == 64 * 512 for t in codes)
    assert not any(t.dtype == torch.float32 and t.shape == (64, 512) for t in saved)
    assert _quantized(fw) == 1
    assert sum(n.op == "placeholder" and n.meta["val"].dtype == code
               for n in bw.graph.nodes) == 1
    if code != torch.int8:
        assert _ops_in(bw).count("mpext.fp8_dequantize.default") == 1
    assert all(torch.equal(a, b) for a, b in zip(eager, got))
    # the compression is really there: 8 bits move the weight gradients
    assert max(rel_err(p, g) for p, g in zip(plain, got)) > 1e-3
    assert ctx.stats["compiled"] == 0  # nothing passed through uncompressed


def test_inductor_gradients_are_eager_compressions_to_float32_rounding(device):
    """Inductor runs the same 8-bit code on the same saved tensor (the GELU's input; eager
    compression stores it too and reruns the GELU from it); its own kernels (fused GELU
    backward, reordered sums) change the float32 rounding only: gradients within a few ulps
    of float32 (relative L2 2**-17) of eager compression's, while compression alone moves them
    by more than 1e-3."""
    m = mlp().to(device)
    x = torch.randn(64, 256, device=device)
    cm = torch.compile(m, fullgraph=True)
    got = grads(m, x, cm, act.fp8_saved_tensors())
    eager = grads(m, x, m, act.fp8_saved_tensors())
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


def _min_cut(fw, bw=None, outputs=None):
    """aot_autograd with inductor's decompositions and partitioner (min-cut, recomputing
    pointwise ops): the graphs inductor would generate code for, kept and run without it;
    ``outputs`` gets what each forward returns at run time (its codes for the backward)."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    def fw_compiler(gm, inputs):
        fw.append(gm)
        boxed = make_boxed_func(gm.forward)

        def run(args):
            out = boxed(args)
            if outputs is not None:
                outputs.append(list(out))
            return out
        run._boxed_call = True
        return run
    return aot_autograd(fw_compiler=fw_compiler, bw_compiler=Graphs._keep(
        bw if bw is not None else []), partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table())


def _saved(fw):
    """The values the forward graph hands its backward (after the model's one output)."""
    return [n.meta["val"] for n in [n for n in fw.graph.nodes if n.op == "output"][0]
            .args[0][1:] if isinstance(n, torch.fx.Node)]


class ConvBnRelu(torch.nn.Module):
    """Two Conv2d + BatchNorm (training) + ReLU, the CNN's block without the residual."""

    def __init__(self, c=16):
        super().__init__()
        torch.manual_seed(0)
        self.c1, self.c2 = torch.nn.Conv2d(4, c, 3, padding=1), torch.nn.Conv2d(c, c, 3,
                                                                                padding=1)
        self.b1, self.b2 = torch.nn.BatchNorm2d(c), torch.nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))).mean((2, 3))


def _eager_codes(m, x, ctx):
    """The int8 codes eager compression stores in one forward (ctx.pack called from a hook of
    our own inside the context), as (codes, scales) pairs."""
    got = []

    def pack(t):
        p = ctx.pack(t)
        if hasattr(p, "q"):
            got.append((p.q, p.scales))
        return p
    with ctx, torch.autograd.graph.saved_tensors_hooks(pack, ctx.unpack):
        m(x).sum().backward()
    return got


def test_conv_batchnorm_relu_compiled_saves_one_code_per_conv_with_eagers_bits(device):
    """The min-cut partitioner saves a conv's output (BatchNorm's input) and the ReLU after the
    BatchNorm (the next conv's input) when it saves 16-bit tensors; under the context graphs are
    partitioned to recompute the BatchNorm and ReLU from the conv's 8-bit copy in the backward
    (activations_compiled.PARTITIONER), as the eager recipes do: the forward hands the
    backward one code per conv output, the codes eager compression stores for the same conv
    outputs bit for bit, and no copy of a ReLU output; the allocator sees under half the
    uncompressed compiled bytes, and the gradients are within 2x eager compression's error of
    the uncompressed compiled model's."""
    m = ConvBnRelu().to(device).train()
    x = torch.randn(8, 4, 32, 32, device=device)  # 512 KiB per conv output: the heap's scale
    shape, fw, outs = (8, 16, 32, 32), [], []
    cm = torch.compile(m, backend=_min_cut(fw), fullgraph=True)
    plain = grads(m, x, cm)
    assert sum(tuple(t.shape) == shape for t in _saved(fw[-1])) >= 3  # conv and ReLU outputs
    raw = _held_for_backward(m, x, cm, contextlib.nullcontext())
    torch._dynamo.reset()
    fw.clear()
    cm = torch.compile(m, backend=_min_cut(fw, outputs=outs), fullgraph=True)
    got = grads(m, x, cm, act.fp8_saved_tensors())
    saved = _saved(fw[-1])
    codes = [t for t in saved if t.dtype == torch.int8]
    assert len(codes) == 2 and all(t.numel() == 8 * 16 * 32 * 32 for t in codes), \
        [(t.dtype, tuple(t.shape)) for t in saved]
    assert not any(tuple(t.shape) == shape for t in saved)  # nothing 16 or 32-bit that big
    compiled = [t for t in outs[-1] if isinstance(t, torch.Tensor) and t.dtype == torch.int8]
    eager = [q for q, _ in _eager_codes(m, x, act.fp8_saved_tensors())
             if q.numel() == 8 * 16 * 32 * 32]
    assert len(eager) == 2 and all(any(torch.equal(c, e) for c in compiled) for e in eager)
    held = _held_for_backward(m, x, cm, act.fp8_saved_tensors())
    assert held < 0.5 * raw, (held, raw)
    eager = grads(m, x, m, act.fp8_saved_tensors())
    errs = [(rel_err(p, g), rel_err(p, e)) for p, g, e in zip(plain, got, eager)]
    assert max(c for c, _ in errs) > 1e-4  # compressed
    assert all(c <= 2 * e + 1e-6 for c, e in errs), errs


class Attention(torch.nn.Module):
    """q, k, v as transposed (b, h, s, d) views of one projection's output, into SDPA, whose
    CPU output is (b, h, s, d) in (b, s, h, d) memory: strided, and not a view."""

    def __init__(self, d=128, heads=2):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.out, self.heads = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d), heads

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


def test_views_share_one_code_and_strided_tensors_restore_their_layout(device):
    """SDPA saves q, k, v (three views of the projection's output) and its output (strided),
    which the out-projection saves again as a 2-d view. Under the context the partitioner
    saves bases, never views (their views are rerun in the backward): one code per storage,
    the projection's and the attention output's, as eager keeps one copy per storage. The
    attention output is restored with its saved strides (the backward graph's restored value
    is non-contiguous), and the gradients are within 2x eager compression's error of the
    uncompressed ones: a restore that read the codes in the saved strides would scramble
    them."""
    m = Attention().to(device)
    x = torch.randn(2, 64, 128, device=device)
    fw, bw = [], []
    cm = torch.compile(m, backend=_min_cut(fw, bw), fullgraph=True)
    got = grads(m, x, cm, act.fp8_saved_tensors())
    eager = grads(m, x, m, act.fp8_saved_tensors())
    plain = grads(m, x, m)
    saved = _saved(fw[-1])
    codes = sorted(t.numel() for t in saved if t.dtype == torch.int8)
    assert codes == [2 * 64 * 128, 2 * 64 * 384], [(t.dtype, tuple(t.shape)) for t in saved]
    out = [n for n in fw[-1].graph.nodes if n.op == "output"][0].args[0][1:]
    assert not any(n.op != "placeholder" and n.meta["val"].is_floating_point() and
                   n.meta["val"].numel() >= 1024 for n in out), out  # raw intermediates
    restored = [n.meta["val"] for n in bw[-1].graph.nodes if n.op == "call_function"
                and isinstance(n.meta.get("val"), torch.Tensor)
                and tuple(n.meta["val"].shape) == (2, 2, 64, 64)]
    assert any(tuple(t.stride()) == (8192, 64, 128, 1) for t in restored), \
        [t.stride() for t in restored]
    errs = [(rel_err(p, g), rel_err(p, e)) for p, g, e in zip(plain, got, eager)
            if p.norm() > 0]
    assert max(c for c, _ in errs) > 1e-4  # compressed
    assert all(c <= 2 * e + 1e-6 for c, e in errs), errs
