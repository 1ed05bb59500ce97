"""The model shapes of mpext.memory: parameter counts and tensor shapes of GPT and LLaMA
layouts (``gpt_params``, ``gpt_shapes``, ...), and the known models by name (``MODELS``)."""
import dataclasses
import math
from typing import Dict, List, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A known model: its parameter count and the shape the activation estimate needs."""

    name: str
    params: int
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    note: str = ""
    dropout: bool = True  # whether the model trains with dropout (masks in the activations)
    # each parameter tensor's element count: the 8-bit modes keep FP32 moments for the small
    # ones (biases, norms), which a bare count cannot tell
    sizes: Tuple[int, ...] = ()
    # each parameter tensor's shape: FSDP2 cuts dim 0 (``sharding='torch'``)
    shapes: Tuple[Tuple[int, ...], ...] = ()
    # whose activation formula applies (``FAMILIES``) and, for a SwiGLU MLP, its width
    family: str = "gpt"
    ffn: Optional[int] = None


def gpt_params(layers: int, hidden: int, vocab: int, seq: int, bias: bool = True,
               tied: bool = True) -> int:
    """Parameters of a GPT-2-style model (nanoGPT layout): token and position embeddings, per
    layer two LayerNorms, the QKV and output projections and a 4x MLP, a final LayerNorm, and an
    LM head tied to the token embedding unless ``tied`` is False."""
    h = hidden
    b = 1 if bias else 0
    per_layer = 12 * h * h + b * 9 * h + (2 if bias else 1) * 2 * h  # matrices, biases, LNs
    total = vocab * h + seq * h + layers * per_layer + (2 if bias else 1) * h
    return total + (0 if tied else vocab * h)


def llama_params(layers: int, hidden: int, ffn: int, vocab: int) -> int:
    """Parameters of a LLaMA-style model: embedding, per layer 4 h*h attention projections, a
    SwiGLU MLP (3 h*ffn) and two RMSNorms, a final RMSNorm and an untied LM head."""
    return 2 * vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden) \
        + hidden


def gpt_shapes(layers: int, hidden: int, vocab: int, seq: int) -> List[Tuple[str, tuple]]:
    """(name, shape) of each parameter of the GPT-2 layout ``gpt_params`` counts (with biases,
    tied head), named and shaped as transformers' ``GPT2LMHeadModel`` (Conv1D weights (in, out))."""
    d = hidden
    shapes = [("wte.weight", (vocab, d)), ("wpe.weight", (seq, d))]
    for i in range(layers):
        p = "h.%d." % i
        shapes += [(p + "ln_1.weight", (d,)), (p + "ln_1.bias", (d,)),
                   (p + "attn.c_attn.weight", (d, 3 * d)), (p + "attn.c_attn.bias", (3 * d,)),
                   (p + "attn.c_proj.weight", (d, d)), (p + "attn.c_proj.bias", (d,)),
                   (p + "ln_2.weight", (d,)), (p + "ln_2.bias", (d,)),
                   (p + "mlp.c_fc.weight", (d, 4 * d)), (p + "mlp.c_fc.bias", (4 * d,)),
                   (p + "mlp.c_proj.weight", (4 * d, d)), (p + "mlp.c_proj.bias", (d,))]
    return shapes + [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]


def llama_shapes(layers: int, hidden: int, ffn: int, vocab: int) -> List[Tuple[str, tuple]]:
    """(name, shape) of each parameter of the LLaMA layout ``llama_params`` counts, named as
    transformers' ``LlamaForCausalLM`` (full multi-head attention)."""
    h = hidden
    shapes = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = "model.layers.%d." % i
        shapes += [(p + "self_attn.%s_proj.weight" % x, (h, h)) for x in "qkvo"]
        shapes += [(p + "mlp.gate_proj.weight", (ffn, h)), (p + "mlp.up_proj.weight", (ffn, h)),
                   (p + "mlp.down_proj.weight", (h, ffn)), (p + "input_layernorm.weight", (h,)),
                   (p + "post_attention_layernorm.weight", (h,))]
    return shapes + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def _sizes_of(shapes) -> Tuple[int, ...]:
    return tuple(math.prod(shape) for _, shape in shapes)


def _gpt(name, layers, hidden, heads, vocab=50257, seq=1024):
    shapes = tuple(shape for _, shape in gpt_shapes(layers, hidden, vocab, seq))
    sizes = _sizes_of(gpt_shapes(layers, hidden, vocab, seq))
    assert sum(sizes) == gpt_params(layers, hidden, vocab, seq)
    return ModelSpec(name, sum(sizes), layers, hidden, heads, vocab, seq, sizes=sizes,
                     shapes=shapes)


def _llama(name, layers, hidden, heads, ffn, vocab=32000, seq=2048):
    shapes = tuple(shape for _, shape in llama_shapes(layers, hidden, ffn, vocab))
    sizes = _sizes_of(llama_shapes(layers, hidden, ffn, vocab))
    assert sum(sizes) == llama_params(layers, hidden, ffn, vocab)
    return ModelSpec(name, sum(sizes), layers, hidden, heads, vocab, seq,
                     "LLaMA layout and activation formula (RMSNorm, RoPE, SwiGLU)",
                     dropout=False, sizes=sizes, shapes=shapes, family="llama", ffn=ffn)


MODELS: Dict[str, ModelSpec] = {m.name: m for m in (
    _gpt("gpt2", 12, 768, 12), _gpt("gpt2-medium", 24, 1024, 16),
    _gpt("gpt2-large", 36, 1280, 20), _gpt("gpt2-xl", 48, 1600, 25),
    _llama("llama-7b", 32, 4096, 32, 11008), _llama("llama-13b", 40, 5120, 40, 13824),
    _llama("llama-70b-mha", 80, 8192, 64, 28672),
)}

def model_names() -> List[str]:
    """The names ``model_spec`` knows (``MODELS``): published models only. A model of your own
    is estimated from its tensors: ``estimate([p.numel() for p in model.parameters()], ...)``."""
    return sorted(MODELS)


def model_spec(name: str) -> ModelSpec:
    """A known model by name (see ``model_names``)."""
    spec = MODELS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError("model: unknown model %r; choose one of %s"
                         % (name, ", ".join(model_names())))
    return spec
