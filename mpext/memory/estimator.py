"""The estimate of mpext.memory: what a training configuration holds per device.

For a model of ``params`` parameters trained with ``optimizer`` in a precision ``mode``, under
ZeRO stage ``zero`` over ``world_size`` devices, :func:`estimate` returns the bytes one device
holds, split into the persistent tensors (weights, gradients, FP32 master weights, optimizer
states, loss-scaler scalars) and the memory that exists only while a step runs (activations saved
for the backward pass, and autocast's low-precision weight copies). ``python -m mpext.memory``
prints it as a table (``mpext.memory``); ``docs/memory.md`` documents every row.

Bytes per parameter, per mode (ZeRO 0, one device; ``k`` = optimizer-state tensors per param:
AdamW 2, SGD with momentum 1, ...)::

    mode                              weights grads masters states transient (per step)
    fp32                                 4      4      0      4k   activations in fp32
    amp-bf16                             4      4      0      4k   activations in bf16 + 2 B/param
    amp-fp16                             4      4      0      4k   bf16 -> fp16; + 2 scaler scalars
    mpext-bf16                           2      2      4      4k   activations in bf16
    mpext-fp16                           2      2      4      4k   as bf16; + 2 scaler scalars
    mpext-bf16-bf16moments               2      2      4      2k   as mpext-bf16
    mpext-bf16-remainder                 2      2      2      4k   as mpext-bf16
    mpext-bf16-remainder-bf16moments     2      2      2      2k   as mpext-bf16
    mpext-bf16-sr-fp32moments            2      2      0      4k   as mpext-bf16
    mpext-bf16-sr                        2      2      0      2k   as mpext-bf16
    mpext-fp16-sr                        2      2      0      2k   as mpext-fp16
    mpext-bf16-8bit                      2      2      4   1.016k  as mpext-bf16
    mpext-bf16-remainder-8bit            2      2      2   1.016k  as mpext-bf16
    mpext-bf16-sr-8bit                   2      2      0   1.016k  as mpext-bf16
    mpext-fp16-sr-8bit                   2      2      0   1.016k  as mpext-fp16

The mpext modes are not written by hand: each is a state format of ``mpext.optim.formats`` (a
param format: where the FP32 value lives, and a moment format) on params of one dtype, with the
formats' own bytes (:func:`format_mode`); ``FORMAT_MODES`` holds every one by the name of its
parts (``mpext-bf16-remainder-q8``, ...) and the names above are aliases of some of them
(``ALIASES``). The state is those bytes times the moments of the rule (``RULES``: Adam 2, Lion
1, SGD 0 or 1 with momentum; ``estimate(..., rule=...)``), or of ``optimizer`` (torch's).
``grad_release=True`` (mpext.optim's ``release_grads``): no gradient persists; one bucket of
them is alive during the backward (``grad_bucket``).

Native AMP keeps the model in FP32 (its FP32 weights are the masters) and autocast casts each
weight to 16 bits on every forward; those copies live until the backward has used them, so they
are counted as step-time memory (``autocast_copies``), not as persistent memory. mpext keeps the
model in BF16/FP16 with FP32 masters inside the optimizer and casts nothing per forward. The
lean modes are ``mpext.optim.Adam``/``AdamW``'s leaner state (Adam/AdamW only): a BF16 param's
master kept as its 16-bit remainder (``param_remainders=True``: the masters row is the
remainders), moments stored in BF16 (``exp_avg_dtype=exp_avg_sq_dtype=torch.bfloat16``), or no
master at all (``master_weights=False``; ``-sr`` for ``stochastic_rounding=True``, which is what
makes that mode train well; round to nearest holds the same bytes). The ``-8bit`` modes are ``mpext.optim.Adam``/``AdamW`` with 8-bit moments
(``exp_avg_dtype=torch.int8, exp_avg_sq_dtype=torch.uint8``): one byte per element and moment
plus an FP32 scale per block of 256 elements (docs/moments_8bit.md), with the master as an FP32
copy, as its 16-bit remainder (``param_remainders=True``) or none (``master_weights=False``,
``-sr``: ``stochastic_rounding=True``). Params under 4096 elements (``MIN_8BIT_NUMEL``) keep
FP32 moments in those modes: given the parameter count alone, the estimate counts every element
as 8-bit; given the tensors' sizes (a known model's ``ModelSpec.sizes`` too), it counts each as
the optimizer keeps it. Under FSDP2 the blocks lie on each tensor's whole index, so a rank
keeps the scales of every block its shard touches (one more where a block straddles two
shards).

An EMA of the weights (``ema=True``) is one more FP32 copy, 4 bytes per parameter: mpext's is
``mpext.optim.Adam``/``AdamW``'s ``ema_decay`` (an EMA of the FP32 masters, kept in the optimizer
state and partitioned with it by ZeRO), native's an FP32 ``torch.optim.swa_utils.AveragedModel``
of the FP32 model (a model copy: partitioned only where the weights are, stage 3).

ZeRO (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", section 5): stage 1 partitions the optimizer states (the FP32 master weights are part of
them, as in the paper's K = 12 bytes for mixed-precision Adam) over ``world_size`` devices, stage
2 also the gradients, stage 3 also the weights. A partition holds ceil(params / world_size)
elements. Temporary all-gather buffers and communication buckets are not counted.

PyTorch's own engines partition otherwise (``sharding="torch"``, per rank, exact given the
tensors' shapes; ``--zero fsdp2`` / ``zero1-torch`` on the command line): ``zero=3`` is FSDP2's
``fully_shard``, which cuts dim 0 of every tensor into chunks of ceil(dim0 / world_size) rows
(the last ranks hold fewer rows or none) and allocates every rank's parameter, and the
gradient buffer of each ``fully_shard`` unit, at the padded chunk, while mpext.optim makes the
masters, remainders, moments and EMA like the local shard itself (unpadded); ``zero=1`` is
``ZeroRedundancyOptimizer``, whose ranks each step whole tensors (``zero_partition``), so a
tensor's state, 8-bit or FP32 by its whole size, lives on one rank. With FP32 sharded params
and ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` the param is the FP32 value
(``mpext-fp32-param-<moments>``: 4 + 4 bytes of param and gradient, no master; the BF16
all-gathered copies exist only during the step); BF16 sharded params take every format of a
BF16 param.

Activations (optional; needs batch, sequence, hidden, layers, heads): what autograd saves in
one forward, derived from the saved-tensor hooks on a pre-LayerNorm GPT (tests/small_gpt.py, the
benchmarks' layout) and transformers' GPT-2
(``activation_bytes``; docs/memory.md has the formula and the measured table). Per layer
``s*b*h*(14*d + 2*f + 2*m) + 4*s*b*f`` plus, with fused attention (``attention="sdpa"``, the
default), a float32 log-sum-exp ``4*a*s*b`` or, with ``"eager"``, the probabilities
``a*s^2*b*(f + d' + m)``; ``d`` the matrix products' bytes, ``f`` the residual stream's and the
norms' (FP32 under native AMP), ``m`` a dropout mask's. Eager attention on CUDA in 16 bits is
Korthikanti et al. 2022, section 4.1, plus the norms' statistics. That is the ``gpt`` family's
formula; ``family="llama"`` is LLaMA's (RMSNorm with FP32 copies, RoPE, SwiGLU,
``_llama_saved_tensors``), measured on transformers' ``LlamaForCausalLM``; a family with no
formula (``FAMILIES``) is refused. ``checkpointing=True`` keeps each block's input and one
recomputed block at a time. Activations are replicated data-parallel work and are not divided
by ZeRO. ``compress=...`` (``--compress-activations``)
counts the tensors ``mpext.activations`` stores in FP8 as it stores them: one byte per element
and a float32 scale per block of their last dimension (``activation_compression``).
"""
import collections
import dataclasses
import inspect
import math
import numbers
from typing import Dict, List, Optional, Sequence, Tuple, Union

from .. import activations as _act
from .._common import MIN_8BIT_NUMEL
from ..optim import formats as _F
from ..optim._base import _LEAN_DEFAULTS
from ..optim._release import DEFAULT_BUCKET_BYTES

__all__ = ["MODES", "FORMAT_MODES", "ALIASES", "RULES", "OPTIMIZERS", "MODELS", "ModeSpec",
           "ModelSpec", "Breakdown", "estimate", "SHARDINGS", "fsdp2_shard",
           "zero_partition", "stage_label", "optimizer_states", "rule_states",
           "format_mode", "format_mode_name", "activation_bytes", "activation_formula",
           "activation_compression",
           "ATTENTIONS", "DEVICES", "gpt_params", "gpt_shapes", "llama_params",
           "llama_shapes", "model_names", "model_spec", "mode_supports",
           "DEFAULT_BUCKET_BYTES", "FAMILIES", "GpuBudget", "fit_changes", "gpu_memory_bytes",
           "CUDA_CONTEXT_BYTES", "ALLOCATOR_SLACK"]

_FP32, _HALF = 4, 2
_ADAM = ("adam", "adamw")  # the optimizers with mpext's lean state (mpext.optim.Adam / AdamW)
SCALER_SCALARS = 2  # the loss scale (fp32) and the growth tracker (int32), kept between steps
Q8_BLOCK = _LEAN_DEFAULTS["block_size"]  # mpext.optim's default block_size
# The param dtypes of mpext's modes, by their short names: (bytes per element, formats).
_PARAM_DTYPES = {"fp32": (_FP32, ("fp32_param",)),
                 "bf16": (_HALF, ("master", "remainder", "nearest", "stochastic")),
                 "fp16": (_HALF, ("master", "nearest", "stochastic"))}


@dataclasses.dataclass(frozen=True)
class ModeSpec:
    """Bytes per parameter (or per activation element) a precision mode stores."""

    weight: int          # the model's parameters
    grad: int            # their .grad
    master: int          # FP32 master copy held by the optimizer (0: the weights are FP32)
    activation: int      # bytes per saved activation element
    autocast_copy: int   # per-forward low-precision weight copies (native AMP autocast)
    scaler: bool         # dynamic loss scaling (scale, growth tracker, found_inf)
    description: str
    state: int = _FP32   # bytes per element of each optimizer-state tensor (moments)
    optimizers: Optional[Tuple[str, ...]] = None  # the optimizers it exists for (None: all)
    state_block: int = 0  # elements per block of metadata of each state tensor (0: none)
    state_meta: int = 0   # bytes of metadata per block (8-bit codes: one FP32 scale)
    # the mpext.optim.formats it is, for the modes of mpext.optim (None: a native mode)
    param_format: Optional[str] = None
    moment_format: Optional[str] = None

    @property
    def norm_activation(self) -> int:
        """Bytes per element of what the norms, the softmax and the residual stream save: the
        weights' dtype (native AMP's autocast runs them in FP32 over its FP32 model)."""
        return self.weight if self.autocast_copy else self.activation

    @property
    def stepped_by_mpext(self) -> bool:
        """16-bit weights stepped by mpext (with a master or without): an EMA, when asked
        for, is the optimizer's."""
        return self.weight == _HALF


def format_mode(dtype: str, param_format: str, moment_format: str, description: str = "",
                optimizers: Optional[Tuple[str, ...]] = _ADAM) -> ModeSpec:
    """The mode of mpext.optim's state formats (mpext.optim.formats): params of ``dtype``
    ('fp32', 'bf16', 'fp16') whose FP32 value lives as ``param_format`` says, every moment
    stored in ``moment_format``; the bytes are the formats' own (``bytes_per_element``, and
    for 8-bit codes ``meta_bytes_per_block`` per block of the default ``block_size``)."""
    size, allowed = _PARAM_DTYPES[dtype]
    if param_format not in allowed:
        raise ValueError("param_format: %s params have no %r format (they take %s)"
                         % (dtype, param_format, ", ".join(allowed)))
    pf, mf = _F.PARAM_FORMATS[param_format], _F.MOMENT_FORMATS[moment_format]
    meta = mf.meta_bytes_per_block * len(mf.meta)
    return ModeSpec(size, size, pf.bytes_per_element, size, 0, dtype == "fp16",
                    description or "mpext.optim: %s params, %s, %s moments"
                    % (dtype, param_format, moment_format),
                    mf.bytes_per_element, optimizers, Q8_BLOCK if meta else 0, meta,
                    param_format, moment_format)


def format_mode_name(dtype: str, param_format: str, moment_format: str) -> str:
    """The FORMAT_MODES name of a format: mpext-<dtype>-<param format>-<moment format>."""
    return "mpext-%s-%s-%s" % (dtype, "param" if param_format == "fp32_param" else param_format,
                               moment_format)


# Every format of mpext.optim, by a name of its parts: mpext-<dtype>-<param format>-<moment
# format> (e.g. mpext-bf16-remainder-q8, mpext-fp32-param-bfloat16).
FORMAT_MODES: Dict[str, ModeSpec] = {
    format_mode_name(d, pf, mf): format_mode(d, pf, mf)
    for d, (_, pfs) in _PARAM_DTYPES.items() for pf in pfs for mf in _F.MOMENT_FORMATS}

# The named modes of the calculator that are formats: (dtype, param format, moment format,
# description).
_NAMED = {
    "mpext-bf16": ("bf16", "master", "float32",
                   "mpext: BF16 model, FP32 masters in the optimizer"),
    "mpext-fp16": ("fp16", "master", "float32",
                   "mpext: FP16 model, FP32 masters + dynamic loss scaling"),
    "mpext-bf16-bf16moments": ("bf16", "master", "bfloat16",
                               "mpext.optim: BF16 model, FP32 masters, BF16 moments"),
    "mpext-bf16-remainder": ("bf16", "remainder", "float32",
                             "mpext.optim: BF16 model, FP32 masters kept as 16-bit remainders"),
    "mpext-bf16-remainder-bf16moments": (
        "bf16", "remainder", "bfloat16",
        "mpext.optim: BF16 model, 16-bit remainders, BF16 moments"),
    "mpext-bf16-sr-fp32moments": (
        "bf16", "stochastic", "float32",
        "mpext.optim: BF16 model, no master (stochastic rounding), FP32 moments"),
    "mpext-bf16-sr": ("bf16", "stochastic", "bfloat16",
                      "mpext.optim: BF16 model, no master (stochastic rounding), BF16 moments"),
    "mpext-fp16-sr": ("fp16", "stochastic", "bfloat16",
                      "mpext.optim: FP16 model, no master (stochastic rounding), BF16 moments + "
                      "dynamic loss scaling"),
    "mpext-bf16-8bit": ("bf16", "master", "q8",
                        "mpext.optim: BF16 model, FP32 masters, 8-bit moments"),
    "mpext-bf16-remainder-8bit": ("bf16", "remainder", "q8",
                                  "mpext.optim: BF16 model, 16-bit remainders, 8-bit moments"),
    "mpext-bf16-sr-8bit": ("bf16", "stochastic", "q8",
                           "mpext.optim: BF16 model, no master (stochastic rounding), 8-bit "
                           "moments"),
    "mpext-fp16-sr-8bit": ("fp16", "stochastic", "q8",
                           "mpext.optim: FP16 model, no master (stochastic rounding), 8-bit "
                           "moments + dynamic loss scaling"),
}
# Each named mode's format: (dtype, param format, moment format).
ALIASES: Dict[str, Tuple[str, str, str]] = {k: v[:3] for k, v in _NAMED.items()}
# FP32 masters with FP32 moments exist for every optimizer (MixedPrecisionOptimizer wraps any);
# the leaner formats are mpext.optim's.
_ANY_OPTIMIZER = ("mpext-bf16", "mpext-fp16")

MODES: Dict[str, ModeSpec] = {
    "fp32": ModeSpec(_FP32, _FP32, 0, _FP32, 0, False,
                     "FP32 weights, grads and activations"),
    "amp-bf16": ModeSpec(_FP32, _FP32, 0, _HALF, _HALF, False,
                         "native AMP: FP32 model, torch.autocast(bfloat16)"),
    "amp-fp16": ModeSpec(_FP32, _FP32, 0, _HALF, _HALF, True,
                         "native AMP: FP32 model, torch.autocast(float16) + GradScaler"),
}
MODES.update({name: format_mode(*row, None if name in _ANY_OPTIMIZER else _ADAM)
              for name, row in _NAMED.items()})


def _spec(mode: str) -> ModeSpec:
    spec = MODES.get(mode) if isinstance(mode, str) else None
    return spec if spec is not None else FORMAT_MODES[mode]


def known_mode(mode) -> bool:
    """Whether ``mode`` names a mode: one of ``MODES`` or of ``FORMAT_MODES``."""
    return isinstance(mode, str) and (mode in MODES or mode in FORMAT_MODES)


def mode_supports(mode: str, optimizer: str, ema: bool = False,
                  rule: Optional[str] = None) -> bool:
    """Whether precision ``mode`` exists for ``optimizer`` (the lean modes are
    ``mpext.optim.Adam``/``AdamW``'s), with an EMA of the weights if ``ema`` (mpext's is
    ``mpext.optim.Adam``/``AdamW``'s ``ema_decay``; ``MixedPrecisionOptimizer`` keeps none).
    With ``rule`` (one of ``RULES``: the optimizer is mpext.optim's) every mode exists, an EMA
    too."""
    if rule is not None:
        return True
    spec = _spec(mode)
    allowed = _ADAM if ema and spec.stepped_by_mpext else spec.optimizers
    return allowed is None or optimizer in allowed


# mpext.optim's rules and the moments each keeps per param (their classes' ``moments``): the
# state tensors a format stores. SGD keeps its momentum_buffer only with a momentum.
RULES: Dict[str, Tuple[str, ...]] = {
    "adam": ("exp_avg", "exp_avg_sq"),
    "adamw": ("exp_avg", "exp_avg_sq"),
    "lion": ("exp_avg",),
    "sgd": ("momentum_buffer",),
}


def rule_states(rule: str, momentum: float = 0.0) -> int:
    """The number of moment tensors mpext.optim's ``rule`` keeps per param (see ``RULES``)."""
    if not isinstance(rule, str) or rule not in RULES:
        raise ValueError("rule: unknown rule %r; choose one of %s" % (rule, ", ".join(RULES)))
    if not isinstance(momentum, numbers.Real) or isinstance(momentum, bool) \
            or not 0.0 <= momentum:
        raise ValueError("momentum: must be a number >= 0, got %r" % (momentum,))
    if momentum and rule != "sgd":
        raise ValueError("momentum: SGD's option; rule %r has none" % rule)
    if rule == "sgd" and not momentum:
        return 0
    return len(RULES[rule])


# State tensors of the size of the param each optimizer keeps (torch.optim's defaults, FP32
# unless a mode stores them narrower; the scalar per-param ``step`` tensors are not counted).
OPTIMIZERS: Dict[str, int] = {
    "adamw": 2,             # exp_avg, exp_avg_sq
    "adam": 2,
    "nadam": 2,
    "radam": 2,
    "adamax": 2,            # exp_avg, exp_inf
    "sgd": 0,               # momentum=0: no state
    "sgd-momentum": 1,      # momentum_buffer
    "adagrad": 1,           # sum
    "rmsprop": 1,           # square_avg
    "rmsprop-momentum": 2,  # square_avg, momentum_buffer
}


def optimizer_states(optimizer: str) -> int:
    """The number of param-sized FP32 state tensors ``optimizer`` keeps (see ``OPTIMIZERS``)."""
    try:
        return OPTIMIZERS[optimizer]
    except (KeyError, TypeError):
        raise ValueError("optimizer: unknown optimizer %r; choose one of %s"
                         % (optimizer, ", ".join(OPTIMIZERS))) from None


# ---------------------------------------------------------------------------------------------
# Model presets


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

# ---------------------------------------------------------------------------------------------
# The estimate


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Per-device bytes of one training configuration (see the module docstring for the
    accounting). ``persistent`` is what lives between steps; ``total`` adds what a step needs
    while it runs."""

    mode: str
    optimizer: str
    params: int
    zero: int
    world_size: int
    weights: int
    gradients: int
    master_weights: int
    optimizer_states: int
    scaler: int
    activations: Optional[int]   # None: not estimated (no batch/sequence/shape given)
    autocast_copies: int
    step_buffers: int = 0
    activation_formula: str = ""
    ema: int = 0                 # an FP32 EMA of the weights (``ema=True``)
    grad_bucket: int = 0         # gradient release: the one bucket of gradients alive
    sharding: str = "even"       # how ZeRO partitions (``estimate``'s ``sharding``)
    rank: Optional[int] = None   # the rank these bytes are of (sharding='torch')
    family: str = "gpt"          # whose activation formula (``FAMILIES``)
    checkpointing: bool = False  # activations with every block checkpointed

    PERSISTENT = ("weights", "gradients", "master_weights", "optimizer_states", "ema", "scaler")
    TRANSIENT = ("activations", "autocast_copies", "grad_bucket", "step_buffers")

    @property
    def persistent(self) -> int:
        return sum(getattr(self, k) for k in self.PERSISTENT)

    @property
    def transient(self) -> int:
        """The larger of the forward/backward peak (activations + autocast copies, + the
        released gradients' bucket) and the optimizer step's buffers: the two are not alive at
        the same time."""
        return max((self.activations or 0) + self.autocast_copies + self.grad_bucket,
                   self.step_buffers)

    @property
    def total(self) -> int:
        return self.persistent + self.transient

    def bytes_per_param(self, field: str) -> float:
        """Per-device bytes of ``field`` (or 'persistent' / 'total') over the model's params."""
        v = getattr(self, field)
        return (v or 0) / self.params

    def label(self) -> str:
        return self.mode + ("" if self.zero == 0 else " " + stage_label(self.zero, self.sharding,
                                                                        self.world_size))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(persistent=self.persistent, transient=self.transient, total=self.total,
                 bytes_per_param={k: self.bytes_per_param(k)
                                  for k in self.PERSISTENT + self.TRANSIENT
                                  + ("persistent", "total")})
        return d


def stage_label(zero: int, sharding: str, world_size: int) -> str:
    """How a table names a ZeRO stage over ``world_size`` devices: 'ZeRO-1/8', and for
    PyTorch's engines 'ZeRO-1/8 torch' (ZeroRedundancyOptimizer) and 'FSDP2/8'."""
    if sharding == "torch" and zero == 3:
        return "FSDP2/%d" % world_size
    return "ZeRO-%d/%d%s" % (zero, world_size, " torch" if sharding == "torch" else "")


def _check_count(name: str, value, minimum: int = 1) -> int:
    """An integer count >= minimum (an integral float such as 7e9 is accepted)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError("%s: must be an integer, got %r" % (name, value))
    if not isinstance(value, numbers.Integral):
        if not math.isfinite(value) or value != int(value):
            raise ValueError("%s: must be a whole number, got %r" % (name, value))
    value = int(value)
    if value < minimum:
        raise ValueError("%s: must be >= %d, got %d" % (name, minimum, value))
    return value


ATTENTIONS = ("sdpa", "eager")
DEVICES = ("cuda", "cpu")

# One kind of tensor autograd saves in a forward (docs/memory.md, "Activations"): ``count``
# tensors of ``coef`` * ``unit`` elements each, ``size`` bytes per element, last dimension
# ``cols`` as saved (the symbols are evaluated by _shape_env); ``kind``: the functions whose
# saved tensors mpext.activations' "layers" policy compresses (its default, "all", takes every
# kind; "linear": a matrix product's
# activation input, "attention": F.scaled_dot_product_attention's, "activation", "norm": a
# normalization's input; None: another function's); ``grad``: it has a grad_fn (masks,
# statistics and the log-sum-exp have none, and no policy compresses them); ``store``: the
# storage it lives in (tensors sharing one are counted once when kept as they are).
_Saved = collections.namedtuple("_Saved", "name count coef unit size cols kind grad store")


def _saved_tensors(dropout: bool, attention: str, device: str, d: int, f: int,
                   vocab: bool) -> Tuple[List[_Saved], List[_Saved]]:
    """(per layer, outside the layers): what a pre-LayerNorm GPT saves, tensor by tensor, as
    torch's saved-tensor hooks see it on tests/small_gpt.py and transformers' GPT-2."""
    T, x, P = _Saved, "s*b*h", "a*s^2*b"
    if attention == "sdpa" and not (dropout and device == "cpu"):  # fused: q, k, v, out, lse
        att = [T("q, k, v", 3, 1, x, "d", "h/a", "attention", True, "qkv"),
               T("attention output", 1, 1, x, "d", "h/a", "attention", True, "attn_out"),
               T("log-sum-exp", 1, 1, "a*s*b", "4", "s", "attention", False, "lse")]
    elif attention == "sdpa":  # the CPU's math fallback with dropout: float32 whatever d is
        att = [T("q, v (float32 copies)", 2, 1, x, "4", "h/a", "attention", True, "qv"),
               T("k^T (float32 copy)", 1, 1, x, "4", "s", "attention", True, "kt"),
               T("softmax output", 1, 1, P, "4", "s", "attention", True, "probs"),
               T("attention dropout mask", 1, 1, P, "4", "s", "attention", False, "pmask"),
               T("dropped probabilities", 1, 1, P, "4", "s", "attention", True, "pdrop")]
    else:  # eager: two matmuls around a softmax
        att = [T("q, v", 2, 1, x, "d", "h/a", "linear", True, "qv"),
               T("k^T", 1, 1, x, "d", "s", "linear", True, "kt"),
               T("softmax output", 1, 1, P, "f", "s", "activation", True, "probs")]
        if dropout:
            att += [T("attention dropout mask", 1, 1, P, "m", "s", "dropout", False, "pmask"),
                    T("dropped probabilities", 1, 1, P, "d", "s", "linear", True, "pdrop")]
        elif d != f:
            att += [T("probabilities cast for P@V", 1, 1, P, "d", "s", "linear", True, "pcast")]
        else:  # P@V saves a view of the softmax output: the same memory, another tensor
            att += [T("probabilities as P@V saves them", 1, 1, P, "d", "s", "linear", True,
                      "probs")]
    layer = [T("LayerNorm 1 input", 1, 1, x, "f", "h", "norm", True, "ln1"),
             T("LayerNorm 1 mean, rstd", 2, 1, "s*b", "f", "1", "norm", False, "ln1_stats"),
             T("QKV projection input", 1, 1, x, "d", "h", "linear", True, "qkv_in")] + att + [
             T("out-projection input", 1, 1, x, "d", "h", "linear", True, "attn_out"),
             T("LayerNorm 2 input", 1, 1, x, "f", "h", "norm", True, "ln2"),
             T("LayerNorm 2 mean, rstd", 2, 1, "s*b", "f", "1", "norm", False, "ln2_stats"),
             T("MLP input", 1, 1, x, "d", "h", "linear", True, "mlp_in"),
             T("GELU input", 1, 4, x, "d", "4*h", "activation", True, "gelu_in"),
             T("MLP down-projection input", 1, 4, x, "d", "4*h", "linear", True, "gelu_out")]
    if dropout:
        layer.append(T("residual dropout masks", 2, 1, x, "m", "h", "dropout", False, "masks"))
    outside = [T("position indices (int64)", 1, 1, "s", "8", "1", None, False, "positions"),
               T("final LayerNorm input", 1, 1, x, "f", "h", "norm", True, "lnf"),
               T("final LayerNorm mean, rstd", 2, 1, "s*b", "f", "1", "norm", False,
                 "lnf_stats"),
               T("head input", 1, 1, x, "d", "h", "linear", True, "head_in")]
    if dropout:  # in the weights' dtype (the embeddings')
        outside.append(T("embedding dropout mask", 1, 1, x, "m'", "h", "dropout", False, "emask"))
    if vocab:
        outside += [T("cross entropy's log-softmax", 1, 1, "s*b*v", "4", "v", None, True,
                      "logp"),
                    T("nll_loss's total weight (0-d)", 1, 1, "1", "4", "1", None, False, "tw")]
    return layer, outside


def _llama_saved_tensors(attention: str, d: int, f: int,
                         vocab: bool) -> Tuple[List[_Saved], List[_Saved]]:
    """(per layer, outside the layers): what transformers' LlamaForCausalLM (full multi-head
    attention, no dropout) saves, tensor by tensor, as torch's saved-tensor hooks see it
    (tests/test_memory.py measures a small stock model). Read off LlamaDecoderLayer's forward:

    - LlamaRMSNorm: ``x.to(float32)`` (the input itself when it is FP32) is saved by ``pow``
      and by the product with ``rsqrt(mean + eps)``, which saves that rstd (one float per
      token) too; the normalized value cast back to the weights' dtype ``f`` is saved by the
      product with the weight, whose output the projections read (``d``: under autocast
      each projection saves a cast of its own: three for q, k, v, two for gate and up).
    - RoPE: ``q * cos + rotate_half(q) * sin`` saves only cos and sin (they need no grad),
      computed once per forward for all layers: ``2*s*(h/a)`` in ``f`` (positions broadcast
      over the batch).
    - SDPA saves the rotated q and k, v, its output (the o-projection's input, one storage)
      and a float32 log-sum-exp; eager attention saves q, k^T, v, the float32 softmax output,
      its cast to ``d`` (when ``d`` is not 4) for P@V, and the o-projection's input (a copy).
    - SwiGLU (``down(silu(gate(x)) * up(x))``): the gate's output (SiLU's input), SiLU's
      output, the up-projection's output and their product (the down-projection's input),
      four ffn-wide tensors in ``d``.
    """
    T, x, F = _Saved, "s*b*h", "s*b*F"
    cast = d != f  # autocast: each projection casts the norm's output for itself
    fp32_in = f == 4  # x.to(float32) is x: the norm's copy is the block's input itself

    def norm(i, store_in):
        return [T("RMSNorm %d input as float32" % i, 1, 1, x, "4", "h", "norm", True,
                  store_in),
                T("RMSNorm %d rstd" % i, 1, 1, "s*b", "4", "1", None, True, "rstd%d" % i),
                T("RMSNorm %d normalized, in f" % i, 1, 1, x, "f", "h", "norm", True,
                  "xn%d" % i)]
    layer = norm(1, "x" if fp32_in else "x32_1") + [
        T("q, k, v projection input%s" % ("s (autocast's casts)" if cast else ""),
          3 if cast else 1, 1, x, "d", "h", "linear", True, "n1")]
    if attention == "sdpa":
        layer += [T("q, k after RoPE, v", 3, 1, x, "d", "h/a", "attention", True, "qkv"),
                  T("attention output (o-projection input)", 1, 1, x, "d", "h", "linear", True,
                    "attn_out"),
                  T("log-sum-exp", 1, 1, "a*s*b", "4", "s", None, False, "lse")]
    else:
        layer += [T("q after RoPE, v", 2, 1, x, "d", "h/a", "linear", True, "qv"),
                  T("k^T", 1, 1, x, "d", "s", "linear", True, "kt"),
                  T("softmax output (float32)", 1, 1, "a*s^2*b", "4", "s", None, True,
                    "probs"),
                  T("probabilities cast for P@V", 1, 1, "a*s^2*b", "d", "s", "linear", True,
                    "probs" if d == 4 else "pcast"),
                  T("o-projection input", 1, 1, x, "d", "h", "linear", True, "attn_out")]
    layer += norm(2, "x32_2") + [
        T("gate, up projection input%s" % ("s (autocast's casts)" if cast else ""),
          2 if cast else 1, 1, x, "d", "h", "linear", True, "n2"),
        T("gate output (SiLU input), SiLU output, up output", 3, 1, F, "d", "F", "activation",
          True, "swiglu"),
        T("SiLU * up (down-projection input)", 1, 1, F, "d", "F", "linear", True, "down_in")]
    outside = [T("RoPE cos, sin", 2, 1, "s*h/a", "f", "h/a", None, False, "rope"),
               T("final RMSNorm input as float32", 1, 1, x, "4", "h", "norm", True, "xf"),
               T("final RMSNorm rstd", 1, 1, "s*b", "4", "1", None, True, "rstdf"),
               T("final RMSNorm normalized, in f", 1, 1, x, "f", "h", "norm", True, "xnf"),
               T("head input", 1, 1, x, "d", "h", "linear", True, "head_in")]
    if vocab:
        outside += [T("cross entropy's log-softmax", 1, 1, "s*b*v", "4", "v", None, True,
                      "logp"),
                    T("nll_loss's total weight (0-d)", 1, 1, "1", "4", "1", None, False, "tw")]
    return layer, outside


# The activation formulas the calculator knows, by model family: a family whose formula is not
# here is refused, never estimated with another family's.
FAMILIES = ("gpt", "llama")
# The tensors saved outside the layers before the first layer runs (the rest, the final norm,
# the head and the loss, is freed by the backward before the layers' backward starts: under
# activation checkpointing they are not alive while a layer is recomputed).
_BEFORE_LAYERS = ("positions", "emask", "rope")
# Each family's block input (the residual stream, in f), as a storage of its layer list: what
# activation checkpointing keeps per layer.
_BLOCK_INPUT = {"gpt": "ln1", "llama": "x"}


def _family_tensors(family: str, dropout: bool, attention: str, device: str, d: int, f: int,
                    vocab: bool) -> Tuple[List[_Saved], List[_Saved]]:
    if family == "llama":
        return _llama_saved_tensors(attention, d, f, vocab)
    return _saved_tensors(dropout, attention, device, d, f, vocab)


def _shape_env(b, s, h, a, v, d, f, mask_d, mask_f, ffn=None) -> Dict[str, int]:
    return {"s*b*h": s * b * h, "s*b": s * b, "a*s*b": a * s * b, "a*s^2*b": a * s * s * b,
            "s*b*v": s * b * (v or 0), "s": s, "1": 1, "h": h, "h/a": h // a, "4*h": 4 * h,
            "v": v or 1, "d": d, "f": f, "m": mask_d, "m'": mask_f, "4": 4, "8": 8,
            "s*b*F": s * b * (ffn or 0), "F": ffn or 1, "s*h/a": s * (h // a)}


# The options of mpext.activations.fp8_saved_tensors that the estimate reads (the others, the
# FP8 format, the scales' rounding and stochastic rounding, change no byte).
_COMPRESS_IGNORED = ("fp8_dtype", "pow2_scale", "stochastic", "seed", "params",
                     "warn_unmatched")


def activation_compression(compress) -> Optional[Dict[str, object]]:
    """``compress`` of :func:`activation_bytes` as the options of
    ``mpext.activations.fp8_saved_tensors`` it stands for (their defaults filled in), or None
    for no compression. ``compress`` is None or False (none), True (the module's defaults:
    policy "all", blocks of 128), a policy name (``"all"``, ``"layers"``, ``"linear"``,
    ``"size"``) or
    a dict of ``fp8_saved_tensors``' keyword arguments (``policy``, ``block_size``,
    ``min_bytes``, ``min_numel``; ``fp8_dtype``, ``pow2_scale``, ``stochastic``, ``seed``,
    ``params`` and ``warn_unmatched`` are accepted and change no byte)."""
    if compress is None or compress is False:
        return None
    if compress is True:
        given = {}
    elif isinstance(compress, str):
        given = {"policy": compress}
    elif isinstance(compress, dict):
        given = dict(compress)
    else:
        raise TypeError("compress: None, True, a policy name or a dict of "
                        "mpext.activations.fp8_saved_tensors' options, got %r" % (compress,))
    defaults = {k: p.default for k, p in
                inspect.signature(_act.fp8_saved_tensors.__init__).parameters.items()
                if k != "self"}
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError("compress: unknown option(s) %s; fp8_saved_tensors takes %s"
                         % (", ".join(unknown), ", ".join(defaults)))
    opts = dict(defaults, **given)
    if callable(opts["policy"]):
        raise ValueError("compress: a callable policy decides per tensor at run time, which "
                         "no estimate can know; give one of %s" % ", ".join(_act.POLICIES))
    if opts["policy"] not in _act.POLICIES:
        raise ValueError("compress: policy must be one of %s, got %r"
                         % (", ".join(_act.POLICIES), opts["policy"]))
    opts["block_size"] = _check_count("compress: block_size", opts["block_size"])
    for k in ("min_bytes", "min_numel"):
        opts[k] = _check_count("compress: " + k, opts[k], 0)
    return opts


def _fp8_bytes(numel: int, cols: int, block: int) -> int:
    """What mpext.activations keeps of a compressed tensor: one byte per element (the FP8
    codes) and a float32 scale per block of ``block`` elements of each row of the last
    dimension (``cols`` long; the last block of a row may be shorter)."""
    return numel + 4 * (numel // cols) * -(-cols // block)


def _compressed(t: _Saved, env: Dict[str, int], opts) -> bool:
    """Whether mpext.activations compresses ``t`` under ``opts``: its policy picks it, it has a
    grad_fn or is a floating dropout mask (statistics and indices are kept), it is
    float32/16-bit, of at least ``min_numel`` elements, and its blocks make it smaller (the
    module's own tests)."""
    numel, size = t.coef * env[t.unit], env[t.size]
    cols = _act.block_cols(numel, env[t.cols], opts["block_size"]) if opts else env[t.cols]
    if opts is None or not (t.grad or t.kind == "dropout") or size not in (2, 4) \
            or numel < opts["min_numel"]:
        return False
    if 1 + 4.0 / max(1, min(opts["block_size"], cols)) > 0.75 * size:
        return False
    if opts["policy"] == "all":
        return True
    if opts["policy"] == "layers":
        return t.kind is not None
    if opts["policy"] == "linear":
        return t.kind == "linear"
    return numel * size >= opts["min_bytes"]  # "size"


def _saved_bytes(tensors: Sequence[_Saved], env: Dict[str, int], opts) -> int:
    """The bytes of ``tensors``: FP8 codes and scales of each compressed one, each storage
    once of the rest. A storage one saver holds raw is compressed for no later saver
    (mpext.activations keeps one copy per storage); P@V's view of the softmax output shares
    that output's FP8 copy."""
    total, stores, raw = 0, set(), set()
    for t in tensors:
        numel = t.coef * env[t.unit]
        if t.store not in raw and _compressed(t, env, opts):
            if t.name == "probabilities as P@V saves them":
                continue  # the same elements as the softmax output's FP8 copy
            total += t.count * _fp8_bytes(numel, _act.block_cols(
                numel, env[t.cols], opts["block_size"]), opts["block_size"])
        elif t.store not in stores:
            stores.add(t.store)
            raw.add(t.store)
            total += t.count * numel * env[t.size]
    return total


def activation_bytes(batch: int, seq: int, hidden: int, layers: int, heads: int,
                     act_bytes: int = 2, vocab: Optional[int] = None,
                     dropout: Optional[bool] = None, *, norm_bytes: Optional[int] = None,
                     attention: str = "sdpa", device: str = "cuda", compress=None,
                     family: str = "gpt", ffn: Optional[int] = None,
                     checkpointing: bool = False) -> int:
    """Bytes autograd saves in one forward of a GPT-style (pre-LayerNorm, GELU) transformer:
    every saved tensor, each storage once, the parameters and the batch left out. Derived from
    the tensors torch's saved-tensor hooks see (docs/memory.md, "Activations"); Korthikanti et
    al. 2022's section 4.1 is the eager, CUDA, 16-bit case plus the norms' statistics.

    ``d`` = ``act_bytes`` (what the matrix products read), ``f`` = ``norm_bytes`` (what the
    residual stream, the norms and the softmax run in: 4 under native AMP, whose autocast keeps
    them in FP32; ``act_bytes`` when None). Per layer ``s*b*h*(14*d + 2*f + 2*m) + 4*s*b*f``
    (the two LayerNorms' inputs in ``f`` and their mean and rstd; the QKV input, q, k, v, the
    attention output, the MLP's input, GELU input and output in ``d``; two residual dropout
    masks) plus the attention's own: ``attention="sdpa"`` (fused flash / memory-efficient, what
    torch and transformers use) keeps a float32 log-sum-exp, ``4*a*s*b``; ``"eager"`` keeps the
    probabilities, ``a*s^2*b*(f + d' + m)`` (the softmax output in ``f``, its ``d`` copy for the
    product with V when that is another dtype or when dropout makes one, the dropout mask).
    Outside the layers: the final LayerNorm's input (``f``), output (``d``, the head's input)
    and statistics, the embedding dropout mask, the position indices (int64) and, with
    ``vocab``, the cross entropy's FP32 log-softmax (``4*s*b*vocab``).

    Dropout masks (``m``) are one byte on CUDA (bool); on the CPU torch keeps them in the
    dtype of the dropout's input, and its SDPA with dropout falls back to the math path, which
    saves what ``"eager"`` does, in float32 whatever the inputs' dtype (q, k, v copied to it,
    ``3*s*b*h*(4 - d) + 12*a*s^2*b``; ``device="cpu"``).

    ``compress``: the saved tensors stored in FP8 by ``mpext.activations.fp8_saved_tensors``
    (None: none; True: its defaults; a policy name; or a dict of its keyword arguments, see
    :func:`activation_compression`). Each tensor its policy compresses holds one byte per
    element plus a float32 scale per block of ``block_size`` elements along its last dimension
    as saved (``h``, ``h/a`` for attention's q, k, v and output, ``4h`` in the MLP, ``s`` for
    k^T and the probabilities, ``v`` for the log-softmax; where that is shorter than a block
    and the elements fill whole blocks, per block of consecutive elements, as the module
    quantizes them), and is counted once per tensor
    saved: attention's output and the out-projection's input (one storage, two tensors) become
    two. The rest is counted as without compression: what no policy compresses (masks, indices,
    norm statistics, the log-sum-exp: no grad_fn), tensors under ``min_numel`` elements and
    those whose blocks would not make them smaller; the "layers" policy keeps the softmax of
    eager attention and the loss's log-softmax, "linear" also attention's, the norms' and the
    GELU's tensors, "size" those under ``min_bytes``."""
    b, s, h, n, a, v, dropout, f, opts, ffn = _check_activation_args(
        batch, seq, hidden, layers, heads, act_bytes, vocab, dropout, norm_bytes, attention,
        device, compress, family, ffn, checkpointing)
    layer, outside = _family_tensors(family, dropout, attention, device, act_bytes, f,
                                     v is not None)
    cpu = device == "cpu"
    mask_d = (act_bytes if cpu else 1) if dropout else 0  # the residual (d-dtype) dropouts'
    mask_f = (f if cpu else 1) if dropout else 0  # the embedding's (in the weights' dtype)
    env = _shape_env(b, s, h, a, v, act_bytes, f, mask_d, mask_f, ffn)
    if not checkpointing:
        return n * _saved_bytes(layer, env, opts) + _saved_bytes(outside, env, opts)
    # Checkpointing each block: the forward keeps each block's input (the residual stream, in
    # f) and what is saved outside the blocks; the backward recomputes one block at a time and
    # holds its whole saved set until that block's backward is done. By then the final norm,
    # head and loss have been freed, so the peak is the larger of the two moments. A block's
    # input that its own first norm saves as it is (an FP32 residual) is one storage.
    inp = [_Saved("block input", 1, 1, "s*b*h", "f", "h", None, True, _BLOCK_INPUT[family])]
    before = [t for t in outside if t.store in _BEFORE_LAYERS]
    end_of_forward = n * _saved_bytes(inp, env, None) + _saved_bytes(outside, env, None)
    recompute = ((n - 1) * _saved_bytes(inp, env, None) + _saved_bytes(inp + layer, env, None)
                 + _saved_bytes(before, env, None))
    return max(end_of_forward, recompute)


def _check_activation_args(batch, seq, hidden, layers, heads, act_bytes, vocab, dropout,
                           norm_bytes, attention, device, compress, family, ffn,
                           checkpointing):
    """The checked arguments of :func:`activation_bytes`, before anything is computed."""
    b = _check_count("batch", batch)
    s = _check_count("seq", seq)
    h = _check_count("hidden", hidden)
    n = _check_count("layers", layers)
    a = _check_count("heads", heads)
    if a > h:
        raise ValueError("heads: %d heads cannot exceed hidden=%d" % (a, h))
    if act_bytes not in (2, 4):
        raise ValueError("act_bytes: must be 2 or 4, got %r" % (act_bytes,))
    f = act_bytes if norm_bytes is None else norm_bytes
    if f not in (2, 4):
        raise ValueError("norm_bytes: must be 2 or 4, got %r" % (norm_bytes,))
    if attention not in ATTENTIONS:
        raise ValueError("attention: must be one of %s, got %r" % (", ".join(ATTENTIONS),
                                                                 attention))
    if device not in DEVICES:
        raise ValueError("device: must be one of %s, got %r" % (", ".join(DEVICES), device))
    if not isinstance(family, str) or family not in FAMILIES:
        raise ValueError("family: no activation formula for %r (the calculator knows %s, and "
                         "does not estimate one family's model with another's formula)"
                         % (family, ", ".join(FAMILIES)))
    if dropout is None:
        dropout = family == "gpt"  # GPT-2 trains with dropout, LLaMA without
    if not isinstance(dropout, bool):
        raise TypeError("dropout: must be True or False, got %r" % (dropout,))
    if not isinstance(checkpointing, bool):
        raise TypeError("checkpointing: must be True or False, got %r" % (checkpointing,))
    v = None if vocab is None else _check_count("vocab", vocab)
    opts = activation_compression(compress)
    if opts is not None and h % a:
        raise ValueError("heads: the compressed estimate splits hidden=%d into %d heads, which "
                         "do not divide it" % (h, a))
    if family == "llama":
        if ffn is None:
            raise ValueError("ffn: the llama formula needs the SwiGLU MLP's width "
                             "(intermediate_size; LLaMA-7B: 11008)")
        ffn = _check_count("ffn", ffn)
        if h % a:
            raise ValueError("heads: LLaMA's heads split hidden=%d evenly (head_dim = "
                             "hidden / heads), got %d" % (h, a))
        if dropout:
            raise ValueError("dropout: the llama formula is LLaMA's training without dropout "
                             "(attention_dropout=0, no residual dropout); give dropout=False")
        if opts is not None:
            raise ValueError("compress: no compressed estimate for the llama formula yet (which "
                             "of its tensors mpext.activations compresses is not measured); "
                             "the gpt family has one")
    elif ffn is not None:
        raise ValueError("ffn: only the llama formula reads it (the gpt family's MLP is 4*hidden "
                         "wide)")
    if checkpointing and opts is not None:
        raise ValueError("compress: not estimated together with checkpointing (the recomputed "
                         "block's compression is not measured)")
    return b, s, h, n, a, v, dropout, f, opts, ffn


def _terms(tensors: Sequence[_Saved], env: Dict[str, int], opts) -> str:
    """The compressed estimate's terms as text: the bytes kept as they are, by unit, then
    fp8(n, c) for the compressed tensors of n elements in all, last dimension c."""
    plain, fp8, stores = {}, {}, set()
    for t in tensors:
        if _compressed(t, env, opts):
            numel = t.coef * env[t.unit]  # short rows quantized as rows of one block
            key = (t.unit, t.cols if _act.block_cols(numel, env[t.cols], opts["block_size"]) ==
                   env[t.cols] else str(opts["block_size"]))
            fp8[key] = fp8.get(key, 0) + t.count * t.coef
        elif t.store not in stores:
            stores.add(t.store)
            plain[t.unit] = plain.get(t.unit, 0) + t.count * t.coef * env[t.size]
    unit = lambda c, u: u if c == 1 else str(c) if u == "1" else "%d*%s" % (c, u)  # noqa: E731
    out = [unit(c, u) for u, c in plain.items() if c]
    out += ["fp8(%s, %s)" % (unit(c, u), col) for (u, col), c in fp8.items()]
    return " + ".join(out) or "0"


def activation_formula(act_bytes: int, norm_bytes: Optional[int] = None, vocab: bool = False,
                       dropout: Optional[bool] = None, attention: str = "sdpa",
                       device: str = "cuda", *, compress=None,
                       shape: Optional[Dict[str, int]] = None, family: str = "gpt",
                       checkpointing: bool = False) -> str:
    """The formula :func:`activation_bytes` evaluates, with its parameters, as text. With
    ``compress``, which tensors are compressed depends on their sizes, so ``shape`` (a dict of
    ``batch``, ``seq``, ``hidden``, ``heads`` and, with ``vocab``, ``vocab``) is needed: the
    text gives the bytes kept as they are (d, f and m evaluated) and fp8(n, c) for the
    compressed tensors. ``family`` names the model family's formula (``FAMILIES``), and with
    ``checkpointing`` the text says how a checkpointed run's peak is made of it."""
    if family not in FAMILIES:
        raise ValueError("family: no activation formula for %r (the calculator knows %s)"
                         % (family, ", ".join(FAMILIES)))
    if dropout is None:
        dropout = family == "gpt"
    text = _formula(act_bytes, norm_bytes, vocab, dropout, attention, device, compress, shape,
                    family)
    if not checkpointing:
        return text
    f = act_bytes if norm_bytes is None else norm_bytes
    own = family == "llama" and f != 4  # the block's input is not what its first norm saves
    before = "2*s*(h/a)*f" if family == "llama" else "8*s%s" % (" + s*b*h*m'" if dropout else "")
    return ("checkpointed per block: max(layers*s*b*h*f + all outside the layers, "
            "(layers-1)*s*b*h*f + %sone layer + %s) with %s" % (
                "s*b*h*f + " if own else "", before, text))


def _formula(act_bytes, norm_bytes, vocab, dropout, attention, device, compress, shape,
             family) -> str:
    f = act_bytes if norm_bytes is None else norm_bytes
    if family == "llama":
        att = "4*a*s*b" if attention == "sdpa" else \
            "a*s^2*b*(4+d)" if act_bytes != 4 else "4*a*s^2*b"
        return ("layers*(s*b*h*(8+2*f+%d*d) + 4*d*s*b*F + 8*s*b + %s) + 2*s*(h/a)*f + "
                "s*b*h*(4+f+d) + 4*s*b%s, d=%d, f=%d, F=ffn (LLaMA: two RMSNorms with their "
                "float32 copies, RoPE'd q and k, a SwiGLU MLP, no dropout; %s attention, %s)"
                % (6 if act_bytes == f else 9, att, " + 4*s*b*v" if vocab else "", act_bytes,
                   f, attention, device))
    m = ("d" if device == "cpu" else "1") if dropout else "0"
    opts = activation_compression(compress)
    if opts is not None:
        if not shape:
            raise ValueError("shape: the compressed formula depends on the tensors' sizes; "
                             "give shape=dict(batch=..., seq=..., hidden=..., heads=...)")
        cpu = device == "cpu"
        env = _shape_env(shape["batch"], shape["seq"], shape["hidden"], shape["heads"],
                         shape.get("vocab"), act_bytes, f,
                         (act_bytes if cpu else 1) if dropout else 0,
                         (f if cpu else 1) if dropout else 0)
        layer, outside = _saved_tensors(dropout, attention, device, act_bytes, f, vocab)
        return ("layers*(%s) + %s, fp8(n, c) = n + 4*(n/c)*ceil(c/%d) (FP8 codes and a float32 "
                "scale per block of the last dimension c, c = the block where rows are shorter; "
                "mpext.activations policy %r), d=%d, f=%d, m=%s (GPT: pre-LayerNorm, GELU MLP; "
                "%s attention, %s)" % (
                    _terms(layer, env, opts), _terms(outside, env, opts), opts["block_size"],
                    opts["policy"], act_bytes, f, m, attention, device))
    math = attention == "sdpa" and dropout and device == "cpu"
    att = ("3*s*b*h*(4-d) + 12*a*s^2*b" if math else "4*a*s*b" if attention == "sdpa" else
           "a*s^2*b*(f+%s+m)" % ("d" if dropout or act_bytes != f else "0"))
    return ("layers*(s*b*h*(14*d+2*f+2*m) + 4*s*b*f + %s) + s*b*h*(f+d+m) + 2*s*b*f + 8*s%s, "
            "d=%d, f=%d, m=%s (GPT: pre-LayerNorm, GELU MLP; %s attention, %s)"
            % (att, " + 4*s*b*v" if vocab else "",
                                                    act_bytes, f, m, attention, device))


def _sizes(params) -> Tuple[int, Optional[List[int]], Optional[List[Tuple[int, ...]]]]:
    """(total, per-tensor sizes or None, per-tensor shapes or None) of ``estimate``'s
    ``params``; a tensor given by its element count has the 1-D shape of it."""
    if isinstance(params, (str, bytes)) or not hasattr(params, "__iter__"):
        return _check_count("params", params), None, None
    sizes, shapes = [], []
    for i, v in enumerate(params):
        if isinstance(v, (tuple, list)):  # a shape (torch.Size is a tuple)
            shape = tuple(_check_count("params[%d][%d]" % (i, j), d, 0) for j, d in enumerate(v))
        else:
            shape = (_check_count("params[%d]" % i, v, 0),)
        shapes.append(shape)
        sizes.append(math.prod(shape))
    if sum(sizes) < 1:
        raise ValueError("params: the tensors' sizes must add up to at least 1, got %r"
                         % (sizes,))
    return sum(sizes), sizes, shapes


SHARDINGS = ("even", "torch")


def fsdp2_shard(shape: Sequence[int], world_size: int, rank: int) -> Tuple[int, int]:
    """(elements of ``rank``'s shard, elements it allocates) of a tensor of ``shape`` under
    FSDP2's ``fully_shard`` over ``world_size`` ranks: dim 0 is cut into chunks of
    ceil(dim0 / world_size) rows, so the last ranks hold fewer rows or none, and every rank
    allocates the padded chunk (the parameter's storage and its gradient's; the optimizer's
    state is made like the shard itself, unpadded)."""
    if not shape:
        raise ValueError("params: FSDP2 shards dim 0, and a 0-d tensor has none")
    rows, row = shape[0], math.prod(shape[1:])
    chunk = -(-rows // world_size)
    return max(0, min(chunk, rows - rank * chunk)) * row, chunk * row


def zero_partition(sizes: Sequence[int], world_size: int) -> List[List[int]]:
    """The tensors (their indices in ``sizes``) each rank's optimizer steps under
    ``torch.distributed.optim.ZeroRedundancyOptimizer`` with one param group: largest first
    (equal sizes in their order), each to the rank that holds the fewest elements so far (the
    lowest such rank). A tensor's state lives whole on one rank."""
    totals, out = [0] * world_size, [[] for _ in range(world_size)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = totals.index(min(totals))
        out[r].append(i)
        totals[r] += sizes[i]
    return out


def estimate(params: Union[int, Sequence[int]], optimizer: str = "adamw",
             mode: str = "mpext-bf16", *, zero: int = 0, world_size: int = 1,
             batch: Optional[int] = None, seq: Optional[int] = None,
             hidden: Optional[int] = None, layers: Optional[int] = None,
             heads: Optional[int] = None, vocab: Optional[int] = None,
             dropout: Optional[bool] = None, ema: bool = False, rule: Optional[str] = None,
             momentum: float = 0.0, grad_release: bool = False,
             bucket_bytes: int = DEFAULT_BUCKET_BYTES, attention: str = "sdpa",
             device: str = "cuda", sharding: str = "even",
             rank: Optional[int] = None, compress=None, family: str = "gpt",
             ffn: Optional[int] = None, checkpointing: bool = False) -> Breakdown:
    """Per-device memory of training a ``params``-parameter model.

    Args:
        params: the number of parameters (an int, or an integral float such as ``7e9``), or
            the element count of each parameter tensor (e.g. ``[p.numel() for p in
            model.parameters()]``): then the 8-bit modes keep FP32 moments for the tensors
            under ``MIN_8BIT_NUMEL`` elements and per-tensor blocks, as the optimizer does.
        optimizer: a key of ``OPTIMIZERS`` ('adamw', 'sgd', 'sgd-momentum', ...): a torch
            optimizer (inside ``MixedPrecisionOptimizer`` in the mpext modes), or for 'adam' /
            'adamw' mpext.optim's.
        mode: a key of ``MODES`` or of ``FORMAT_MODES`` (every format of mpext.optim, by its
            parts: ``mpext-<fp32|bf16|fp16>-<param format>-<moment format>``; the lean modes
            of ``MODES`` are aliases of some of them) ('fp32', 'amp-bf16', 'amp-fp16', 'mpext-bf16', 'mpext-fp16', or
            one of mpext.optim's lean modes, for 'adam' and 'adamw' only:
            'mpext-bf16-bf16moments', 'mpext-bf16-remainder',
            'mpext-bf16-remainder-bf16moments', 'mpext-bf16-sr-fp32moments', 'mpext-bf16-sr',
            'mpext-fp16-sr', and with 8-bit moments 'mpext-bf16-8bit',
            'mpext-bf16-remainder-8bit', 'mpext-bf16-sr-8bit', 'mpext-fp16-sr-8bit').
        zero: ZeRO stage 0-3 (1: optimizer states and masters partitioned, 2: + gradients,
            3: + weights).
        world_size: data-parallel devices the partitions are spread over.
        batch, seq, hidden, layers, heads: the activation estimate's shape; all five or none.
        vocab: adds the FP32 logits of the cross entropy to the activations.
        dropout: count the dropout masks (1 byte per element on CUDA); None (default): the
            family's own (GPT-2 trains with dropout, LLaMA without, and its formula has none).
        family: whose activation formula (``FAMILIES``): 'gpt' (pre-LayerNorm, GELU MLP:
            GPT-2, the benchmarks' GPT) or 'llama' (RMSNorm, RoPE, SwiGLU: transformers'
            LlamaForCausalLM with full multi-head attention, ``ffn`` = its intermediate_size).
            Another family is refused: no model is estimated with another family's formula.
        ffn: the llama family's MLP width (intermediate_size).
        checkpointing: activation checkpointing of every block (torch.utils.checkpoint, as
            transformers' ``gradient_checkpointing_enable``): each block's input is kept and
            one block at a time is recomputed in the backward (``activation_bytes``).
        attention: 'sdpa' (fused attention, the default of torch and transformers: no
            s x s tensor is saved) or 'eager' (the softmax probabilities are saved).
        device: 'cuda' (default) or 'cpu', where dropout keeps its masks in the input's dtype
            and SDPA with dropout saves what eager attention does (``activation_bytes``).
        compress: the saved activations stored in FP8 by ``mpext.activations`` (None: none;
            True: its default policy "all"; a policy name; or a dict of
            ``fp8_saved_tensors``' options: ``activation_bytes``, ``activation_compression``).
        ema: add an FP32 EMA of the weights (mpext modes: ``ema_decay`` of
            ``mpext.optim.Adam``/``AdamW``, so adam or adamw only; native modes: an FP32
            ``AveragedModel``).
        rule: mpext.optim's optimizer, a key of ``RULES`` ('adam', 'adamw', 'lion', 'sgd'),
            instead of ``optimizer``: every mode and format exists for it, its moments are the
            state (``rule_states``), its step needs no FP32 gradient buffers, and an EMA is
            its ``ema_decay``.
        momentum: SGD's momentum (with ``rule='sgd'``): a momentum_buffer when not 0.
        grad_release: the step runs inside the backward pass (``release_grads()`` of
            mpext.optim, one process only): no gradient persists between steps; during the
            backward one bucket of them is alive (``grad_bucket``): a bucket is stepped once
            its bytes reach ``bucket_bytes``, so at most ``bucket_bytes`` - 1 plus the largest
            gradient (given the tensors' sizes; given a count alone, every gradient is taken
            as smaller than the bucket: ``bucket_bytes``), or all of them when they are fewer.
        bucket_bytes: the release's bucket (default 4 MiB, as ``release_grads``).
        sharding: how a ZeRO stage partitions. 'even' (default): the paper's, ceil(params /
            world_size) elements per device for every partitioned tensor class (DeepSpeed's
            flat buffers). 'torch': PyTorch's own engines, per rank and per tensor: ``zero=1``
            is ``ZeroRedundancyOptimizer`` (each tensor's state whole on one rank, the largest
            tensors first to the rank holding the fewest elements, ``zero_partition``),
            ``zero=3`` is FSDP2's ``fully_shard`` (each tensor cut on dim 0 into chunks of
            ceil(dim0 / world_size) rows: the weights and gradients hold the padded chunk, the
            optimizer state the rank's rows, ``fsdp2_shard``). Exact given the tensors'
            shapes (``[p.shape for p in model.parameters()]``); given counts, each is a 1-D
            tensor, and a bare total is spread evenly under ``zero=1``. PyTorch has no ZeRO-2
            of its own (FSDP2 with ``reshard_after_forward=False`` holds stage 3's bytes
            between steps), so 'torch' takes ``zero`` 0, 1 or 3.
        rank: with ``sharding='torch'``, the rank whose bytes to give; default the busiest
            (the largest persistent total; the lowest such rank).

    Returns a :class:`Breakdown`. Raises ``ValueError`` / ``TypeError`` naming the argument.
    """
    n, sizes, shapes = _sizes(params)
    if not known_mode(mode):
        raise ValueError("mode: unknown mode %r; choose one of %s" % (mode, ", ".join(MODES)))
    if rule is not None:
        k = rule_states(rule, momentum)
        optimizer = rule + ("-momentum" if momentum else "")
    else:
        if momentum:
            raise ValueError("momentum: SGD's option of rule='sgd'; for torch's SGD use "
                             "optimizer='sgd-momentum'")
        k = optimizer_states(optimizer)
    if not mode_supports(mode, optimizer, rule=rule):
        raise ValueError("mode: %s is mpext.optim.Adam/AdamW's leaner state; the optimizer "
                         "must be %s, got %r" % (mode, " or ".join(_spec(mode).optimizers),
                                                 optimizer))
    if not isinstance(ema, bool):
        raise TypeError("ema: must be True or False, got %r" % (ema,))
    if not mode_supports(mode, optimizer, ema, rule):
        raise ValueError("ema: mpext keeps an FP32 EMA of the weights in mpext.optim.Adam/AdamW "
                         "(ema_decay=...); with optimizer %r, %s has none (use adam or adamw)"
                         % (optimizer, mode))
    if isinstance(zero, bool) or not isinstance(zero, numbers.Integral) \
            or zero not in (0, 1, 2, 3):
        raise ValueError("zero: the ZeRO stage must be 0, 1, 2 or 3, got %r" % (zero,))
    zero = int(zero)
    w = _check_count("world_size", world_size)
    shape = {"batch": batch, "seq": seq, "hidden": hidden, "layers": layers, "heads": heads}
    given = [name for name, v in shape.items() if v is not None]
    if given and len(given) != len(shape):
        raise ValueError("activations need batch, seq, hidden, layers and heads together; "
                         "missing %s" % ", ".join(nm for nm in shape if nm not in given))
    if vocab is not None and not given:
        raise ValueError("vocab: only used by the activation estimate, which needs batch, "
                         "seq, hidden, layers and heads")
    if activation_compression(compress) is not None and not given:
        raise ValueError("compress: only used by the activation estimate, which needs batch, "
                         "seq, hidden, layers and heads")
    if not isinstance(family, str) or family not in FAMILIES:
        raise ValueError("family: no activation formula for %r (the calculator knows %s, and "
                         "does not estimate one family's model with another's formula)"
                         % (family, ", ".join(FAMILIES)))
    if not isinstance(checkpointing, bool):
        raise TypeError("checkpointing: must be True or False, got %r" % (checkpointing,))
    for name, v in (("checkpointing", checkpointing or None), ("ffn", ffn)):
        if v is not None and not given:
            raise ValueError("%s: only used by the activation estimate, which needs batch, "
                             "seq, hidden, layers and heads" % name)
    spec = _spec(mode)
    if not isinstance(grad_release, bool):
        raise TypeError("grad_release: must be True or False, got %r" % (grad_release,))
    bucket = _check_count("bucket_bytes", bucket_bytes, 0)
    if grad_release and rule is None and optimizer not in _ADAM:
        raise ValueError("grad_release: the release is mpext.optim's (release_grads()); give "
                         "rule=... or optimizer 'adam' / 'adamw', got optimizer %r" % optimizer)
    if grad_release and w > 1:
        raise ValueError("grad_release: not supported with more than one process (the "
                         "release steps before DDP/FSDP reduce the gradients), got "
                         "world_size=%d" % w)
    if not isinstance(sharding, str) or sharding not in SHARDINGS:
        raise ValueError("sharding: must be one of %s, got %r" % (", ".join(SHARDINGS), sharding))
    by_torch = sharding == "torch" and zero > 0
    if by_torch and zero == 2:
        raise ValueError("zero: PyTorch has no ZeRO-2 of its own; with sharding='torch' give "
                         "zero=1 (ZeroRedundancyOptimizer) or zero=3 (FSDP2's fully_shard, "
                         "whose reshard_after_forward=False holds stage 3's bytes between "
                         "steps)")
    if rank is not None:
        if sharding != "torch":
            raise ValueError("rank: only with sharding='torch' (the even partition is the same "
                             "on every rank)")
        rank = _check_count("rank", rank, 0)
        if rank >= w:
            raise ValueError("rank: must be < world_size=%d, got %d" % (w, rank))
    if by_torch and zero == 3:
        if grad_release:
            raise ValueError("grad_release: not supported for FSDP2's DTensor params")
        if rule is None and spec.param_format is not None and optimizer not in _ADAM:
            raise ValueError("optimizer: %s with %r is mpext.MixedPrecisionOptimizer, which has "
                             "no DTensor support, so no FSDP2; give rule=... (mpext.optim's) "
                             "or optimizer 'adam' / 'adamw'" % (mode, optimizer))

    def part(stage: int) -> int:  # elements per device of a tensor partitioned from `stage` on
        return -(-n // w) if zero >= stage else n

    # MixedPrecisionOptimizer's generic path (any optimizer but Adam/AdamW) makes FP32
    # gradients for the masters during step() and frees them after: one per master element.
    fused = rule is not None or optimizer in ("adam", "adamw")
    step_buffers = 0 if (fused or spec.master == 0) else _FP32 * part(1)
    acts, formula = None, ""
    if given:
        acts = activation_bytes(batch, seq, hidden, layers, heads, spec.activation, vocab,
                                dropout, norm_bytes=spec.norm_activation, attention=attention,
                                device=device, compress=compress, family=family, ffn=ffn,
                                checkpointing=checkpointing)
        formula = activation_formula(spec.activation, spec.norm_activation, vocab is not None,
                                     dropout, attention, device, compress=compress,
                                     shape=dict(batch=batch, seq=seq, hidden=hidden,
                                                heads=heads, vocab=vocab), family=family,
                                     checkpointing=checkpointing)
    if not spec.state_block:
        states = k * spec.state * part(1)
    elif sizes is None:  # 8-bit: codes and one FP32 scale per block, every element counted
        states = k * (spec.state * part(1) + spec.state_meta * -(-part(1) // spec.state_block))
    else:  # as the optimizer keeps each tensor (small ones in FP32), then partitioned
        states = k * sum(_tensor_state(spec, s) for s in sizes)
        states = -(-states // w) if zero >= 1 else states
    mpext_ema = spec.stepped_by_mpext or rule is not None  # the optimizer's, else a model copy
    rows = dict(weights=spec.weight * part(3),
                gradients=0 if grad_release else spec.grad * part(2),
                master_weights=spec.master * part(1), optimizer_states=states,
                ema=0 if not ema else _FP32 * (part(1) if mpext_ema else part(3)),
                step_buffers=step_buffers)
    picked = None
    if by_torch and (zero == 3 or sizes is not None):
        per_rank = [_torch_rank(spec, k, n, sizes, shapes, zero, w, r, ema, mpext_ema,
                                step_buffers > 0) for r in range(w)]
        picked = rank if rank is not None else max(
            range(w), key=lambda r: (sum(per_rank[r][f] for f in Breakdown.PERSISTENT
                                         if f in per_rank[r]), -r))
        rows = per_rank[picked]
    elif sharding == "torch":  # no partition, or a bare count spread evenly: every rank alike
        picked = 0 if rank is None else rank
    return Breakdown(
        mode=mode, optimizer=optimizer, params=n, zero=zero, world_size=w,
        scaler=_FP32 * SCALER_SCALARS if spec.scaler else 0,
        activations=acts,
        autocast_copies=spec.autocast_copy * n,
        activation_formula=formula,
        grad_bucket=_release_peak(spec, n, sizes, bucket) if grad_release else 0,
        sharding=sharding, rank=picked, family=family, checkpointing=checkpointing, **rows)


def _release_peak(spec: ModeSpec, n: int, sizes, bucket: int) -> int:
    """The released gradients alive at most during a backward: a bucket is stepped once its
    bytes reach ``bucket``, so just before that it holds under ``bucket`` plus the gradient that
    filled it (0: one gradient), never more than all of them. A count alone (no ``sizes``)
    takes every gradient as smaller than the bucket."""
    total = spec.grad * n
    if sizes is None:
        return min(bucket, total)
    return min(total, max(bucket - 1, 0) + spec.grad * max(sizes))


def _tensor_state(spec: ModeSpec, size: int) -> int:
    """Bytes of one moment of a tensor of ``size`` elements kept whole, as mpext.optim keeps
    it: 8-bit codes and their block scales, or FP32 for a tensor under MIN_8BIT_NUMEL."""
    if not spec.state_block:
        return spec.state * size
    if size < MIN_8BIT_NUMEL:
        return _FP32 * size
    return spec.state * size + spec.state_meta * -(-size // spec.state_block)


def _torch_rank(spec: ModeSpec, k: int, n: int, sizes, shapes, zero: int, w: int, r: int,
                ema: bool, mpext_ema: bool, step_buffers: bool) -> Dict[str, int]:
    """The persistent rows of rank ``r`` under PyTorch's engines (``sharding='torch'``)."""
    if zero == 1:  # ZeroRedundancyOptimizer: whole tensors' state on one rank; model replicated
        mine = [sizes[i] for i in zero_partition(sizes, w)[r]]
        own = sum(mine)
        return dict(weights=spec.weight * n, gradients=spec.grad * n,
                    master_weights=spec.master * own,
                    optimizer_states=k * sum(_tensor_state(spec, s) for s in mine),
                    ema=0 if not ema else _FP32 * (own if mpext_ema else n),
                    step_buffers=_FP32 * own if step_buffers else 0)
    shapes = shapes or [(n,)]
    shards = [fsdp2_shard(shape, w, r) for shape in shapes]
    own, padded = sum(s for s, _ in shards), sum(p for _, p in shards)
    states = sum(_shard_state(spec, shape, mine, w, r) for shape, (mine, _) in zip(shapes, shards))
    return dict(weights=spec.weight * padded, gradients=spec.grad * padded,
                master_weights=spec.master * own, optimizer_states=k * states,
                ema=0 if not ema else _FP32 * (own if mpext_ema else padded), step_buffers=0)


def _shard_state(spec: ModeSpec, shape: Sequence[int], mine: int, w: int, r: int) -> int:
    """Bytes of one moment of rank ``r``'s FSDP2 shard (``mine`` elements) of a tensor of
    ``shape``: 8-bit codes with the scales of every block of the whole tensor the shard
    touches (mpext.optim._q8_shards), or FP32 for a tensor under MIN_8BIT_NUMEL, or the
    format's bytes per element."""
    size = math.prod(shape)
    if not spec.state_block or size < MIN_8BIT_NUMEL:
        return (_FP32 if spec.state_block else spec.state) * mine
    if mine == 0:
        return 0
    start = r * fsdp2_shard(shape, w, 0)[0]  # every shard before r is a full chunk
    touched = (start + mine - 1) // spec.state_block - start // spec.state_block + 1
    return spec.state * mine + spec.state_meta * touched


# ---------------------------------------------------------------------------------------------
# Does it fit? A GPU's memory against the estimate (``GpuBudget``), and what would make a
# configuration fit (``fit_changes``), every figure from ``estimate``

# What a process holds on a GPU besides its tensors, assumed (no GPU measured them here): the
# CUDA context with torch's kernels loaded lazily, a few hundred MiB on recent drivers; and the
# caching allocator's slack, the memory it reserves beyond the live tensors (block rounding,
# fragmentation), taken as a share of the estimate.
CUDA_CONTEXT_BYTES = 512 * 2 ** 20
ALLOCATOR_SLACK = 0.10
_GPU_UNITS = {"": 10 ** 9, "gb": 10 ** 9, "gib": 2 ** 30, "mb": 10 ** 6, "mib": 2 ** 20,
              "tb": 10 ** 12, "tib": 2 ** 40}


def gpu_memory_bytes(text: str, name: str = "gpu_memory") -> int:
    """Bytes of a memory size written ``24GB``, ``80GiB``, ``512MiB``, ``24`` (a bare number is
    GB, 10^9 bytes, the unit GPUs are sold by; a card sold as "80GB" usually holds about 80
    GiB, so give GiB for its whole memory)."""
    import re
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _GPU_UNITS:
        raise ValueError("%s: a size such as 24GB, 80GiB or 24 (GB), got %r" % (name, text))
    value = float(m.group(1)) * _GPU_UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise ValueError("%s: must be a positive size, got %r" % (name, text))
    return int(value)


@dataclasses.dataclass(frozen=True)
class GpuBudget:
    """A GPU of ``capacity`` bytes: ``context`` of it is not for tensors, and the allocator
    needs ``slack`` (a share) beyond the live tensors the estimate counts."""

    capacity: int
    context: int = CUDA_CONTEXT_BYTES
    slack: float = ALLOCATOR_SLACK

    def __post_init__(self):
        for name in ("capacity", "context"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ValueError("%s: must be a whole number of bytes >= 0, got %r" % (name, v))
        if isinstance(self.slack, bool) or not isinstance(self.slack, numbers.Real) \
                or not 0 <= self.slack < 10 or not math.isfinite(self.slack):
            raise ValueError("slack: a share of the estimate between 0 and 10, got %r"
                             % (self.slack,))
        if self.context >= self.capacity:
            raise ValueError("context: %d bytes leave nothing of a %d-byte GPU"
                             % (self.context, self.capacity))

    @property
    def usable(self) -> int:
        return self.capacity - self.context

    def need(self, b: Breakdown) -> int:
        """What ``b`` needs of the GPU: its total plus the allocator's slack."""
        return int(math.ceil(b.total * (1 + self.slack)))

    def fits(self, b: Breakdown) -> bool:
        return self.need(b) <= self.usable


# The named formats in the order a change of format is proposed: from the most state kept (the
# FP32 master's exact steps) to the least; the first that fits is proposed.
_LEANER = ("mpext-bf16", "mpext-bf16-remainder", "mpext-bf16-remainder-bf16moments",
           "mpext-bf16-remainder-8bit", "mpext-bf16-sr", "mpext-bf16-sr-8bit")
_LEANER_FP16 = ("mpext-fp16", "mpext-fp16-sr", "mpext-fp16-sr-8bit")


def fit_changes(kwargs: Dict[str, object], budget: GpuBudget) -> List[Tuple[str, Breakdown]]:
    """What to change so that ``estimate(**kwargs)`` fits ``budget``, as (what, the estimate
    with it) pairs, every figure computed by ``estimate``. First each change alone that
    applies and saves memory: a leaner format (the first of the formats, from the most state
    kept to the least, that fits; the leanest when none does), gradient release, activation
    checkpointing, compressed activations, the largest smaller micro-batch that fits. When
    none fits alone, the smallest combinations of them that fit (each with the first format
    that makes it fit); when none does, all of them with the leanest format, and with it the
    largest micro-batch that fits, if one does."""
    base = estimate(**kwargs)

    def tried(**changes):
        try:
            b = estimate(**dict(kwargs, **changes))
        except ValueError:  # a change this configuration cannot take
            return None
        return b if b.total < base.total else None

    mode = kwargs.get("mode", "mpext-bf16")
    formats = [m for m in (_LEANER_FP16 if "fp16" in mode else _LEANER) if m != mode]

    def with_format(changes):
        """(name, estimate) with the first format that makes ``changes`` fit, or the leanest."""
        found = [(m, b) for m in formats for b in [tried(mode=m, **changes)] if b is not None]
        for m, b in found:
            if budget.fits(b):
                return m, b
        return min(found, key=lambda mb: mb[1].total) if found else (None, None)

    shaped = base.activations is not None
    others = []  # (what, change) other than the format
    if not kwargs.get("grad_release"):
        others.append(("gradient release", dict(grad_release=True)))
    if shaped and not kwargs.get("checkpointing") and kwargs.get("compress") is None:
        others.append(("activation checkpointing", dict(checkpointing=True)))
        others.append(("compressed activations (FP8, policy layers)", dict(compress=True)))
    others = [(w, c) for w, c in others if tried(**c) is not None]
    out = []
    m, b = with_format({})
    if m is not None:
        out.append(("mode %s" % m, b))
    out += [(w, tried(**c)) for w, c in others]
    batch = kwargs.get("batch")

    def largest_batch(changes):
        lo, hi = 0, (batch or 1) - 1  # bisection: the total grows with the micro-batch
        while lo < hi:
            mid = (lo + hi + 1) // 2
            b = tried(batch=mid, **changes)
            lo, hi = (mid, hi) if b is not None and budget.fits(b) else (lo, mid - 1)
        return lo

    if shaped and (batch or 0) > 1:
        mb = largest_batch({})
        if mb:
            out.append(("micro-batch %d (accumulate gradients over micro-batches for the same "
                        "batch)" % mb, tried(batch=mb)))
    if any(budget.fits(b) for _, b in out):
        return out
    import itertools
    exclusive = ("checkpointing", "compress")  # not estimated together
    for r in range(1, len(others) + 2):
        fitting = []
        for use_format in (False, True):
            for combo in itertools.combinations(others, r - use_format):
                changes = {}
                for _, c in combo:
                    changes.update(c)
                if all(k in changes for k in exclusive) or not (combo or use_format):
                    continue
                names = [w for w, _ in combo]
                if use_format:
                    m, b = with_format(changes)
                    if m is None:
                        continue
                    names.insert(0, "mode %s" % m)
                else:
                    b = tried(**changes)
                if b is not None and budget.fits(b) and r > 1:
                    fitting.append((" + ".join(names), b))
        if fitting:
            return out + fitting
    # nothing fits: every change at once (checkpointing rather than compression), the leanest
    changes = {}
    for w, c in others:
        if not (set(c) & set(exclusive) and any(k in changes for k in exclusive)):
            changes.update(c)
    m, b = with_format(changes)
    if b is None:
        return out
    names = (["mode %s" % m] if m else []) + [w for w, c in others if set(c) <= set(changes)]
    out.append((" + ".join(names), b))
    if shaped and (batch or 0) > 1:
        mb = largest_batch(dict(changes, **({"mode": m} if m else {})))
        if mb:
            out.append((" + ".join(names + ["micro-batch %d" % mb]),
                        tried(batch=mb, **dict(changes, **({"mode": m} if m else {})))))
    return out
