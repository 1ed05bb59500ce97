"""mpext.memory: the training-memory calculator ("will it fit?").

For a model of ``params`` parameters trained with ``optimizer`` in a precision ``mode``, under
ZeRO stage ``zero`` over ``world_size`` devices, :func:`estimate` returns the bytes one device
holds, split into the persistent tensors (weights, gradients, FP32 master weights, optimizer
states, loss-scaler scalars) and the memory that exists only while a step runs (activations saved
for the backward pass, and autocast's low-precision weight copies). ``python -m mpext.memory``
prints the same as a table; ``docs/memory.md`` documents every row.

Bytes per parameter, per mode (ZeRO 0, one device; ``k`` = FP32 optimizer-state tensors per
param: AdamW 2, SGD with momentum 1, ...)::

    mode         weights  grads  masters  optimizer states  transient (per step)
    fp32            4       4       0          4k           activations in fp32
    amp-bf16        4       4       0          4k           activations in bf16 + 2 B/param
    amp-fp16        4       4       0          4k           bf16 -> fp16; + 2 scaler scalars
    mpext-bf16      2       2       4          4k           activations in bf16
    mpext-fp16      2       2       4          4k           as bf16; + 2 scaler scalars

Native AMP keeps the model in FP32 (its FP32 weights are the masters) and autocast casts each
weight to 16 bits on every forward; those copies live until the backward has used them, so they
are counted as step-time memory (``autocast_copies``), not as persistent memory. mpext keeps the
model in BF16/FP16 with FP32 masters inside the optimizer and casts nothing per forward.

ZeRO (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", section 5): stage 1 partitions the optimizer states (the FP32 master weights are part of
them, as in the paper's K = 12 bytes for mixed-precision Adam) over ``world_size`` devices, stage
2 also the gradients, stage 3 also the weights. A partition holds ceil(params / world_size)
elements. Temporary all-gather buffers and communication buckets are not counted.

Activations (optional; needs batch, sequence, hidden, layers, heads): per transformer layer,
Korthikanti et al., 2022, "Reducing Activation Recomputation in Large Transformer Models",
section 4.1, without tensor/sequence parallelism or recomputation. With 16-bit activations it is
``s*b*h*(34 + 5*a*s/h)`` bytes; written per saved tensor it is ``s*b*h*(16*d + 2*m) +
a*s*s*b*(2*d + m)`` with ``d`` the activation dtype's bytes and ``m`` = 1 byte per dropout-mask
element (0 without dropout), which gives 34 and 5 for d = 2, m = 1. Plus the paper's terms
outside the layers: the embedding dropout mask (``s*b*h*m``), the final layer norm's input
(``s*b*h*d``) and the FP32 logits kept by the cross entropy (``4*s*b*v``, when a vocabulary size
is given). Activations are replicated data-parallel work and are not divided by ZeRO.
"""
import argparse
import dataclasses
import importlib.util
import json
import math
import numbers
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

__all__ = ["MODES", "OPTIMIZERS", "MODELS", "ModeSpec", "ModelSpec", "Breakdown", "estimate",
           "optimizer_states", "activation_bytes", "gpt_params", "llama_params", "measure",
           "model_names", "model_spec", "main"]

_FP32, _HALF = 4, 2
SCALER_SCALARS = 2  # the loss scale (fp32) and the growth tracker (int32), kept between steps


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


MODES: Dict[str, ModeSpec] = {
    "fp32": ModeSpec(_FP32, _FP32, 0, _FP32, 0, False,
                     "FP32 weights, grads and activations"),
    "amp-bf16": ModeSpec(_FP32, _FP32, 0, _HALF, _HALF, False,
                         "native AMP: FP32 model, torch.autocast(bfloat16)"),
    "amp-fp16": ModeSpec(_FP32, _FP32, 0, _HALF, _HALF, True,
                         "native AMP: FP32 model, torch.autocast(float16) + GradScaler"),
    "mpext-bf16": ModeSpec(_HALF, _HALF, _FP32, _HALF, 0, False,
                           "mpext: BF16 model, FP32 masters in the optimizer"),
    "mpext-fp16": ModeSpec(_HALF, _HALF, _FP32, _HALF, 0, True,
                           "mpext: FP16 model, FP32 masters + dynamic loss scaling"),
}

# FP32 state tensors of the size of the param each optimizer keeps (torch.optim's defaults; the
# scalar per-param ``step`` tensors are not counted).
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


def _gpt(name, layers, hidden, heads, vocab=50257, seq=1024, note="", dropout=True):
    return ModelSpec(name, gpt_params(layers, hidden, vocab, seq), layers, hidden, heads,
                     vocab, seq, note, dropout)


def _llama(name, layers, hidden, heads, ffn, vocab=32000, seq=2048):
    return ModelSpec(name, llama_params(layers, hidden, ffn, vocab), layers, hidden, heads,
                     vocab, seq, "LLaMA layout; the activation formula is the GPT one "
                     "(SwiGLU saves more in its MLP)", dropout=False)


MODELS: Dict[str, ModelSpec] = {m.name: m for m in (
    _gpt("gpt2", 12, 768, 12), _gpt("gpt2-medium", 24, 1024, 16),
    _gpt("gpt2-large", 36, 1280, 20), _gpt("gpt2-xl", 48, 1600, 25),
    _llama("llama-7b", 32, 4096, 32, 11008), _llama("llama-13b", 40, 5120, 40, 13824),
    _llama("llama-70b-mha", 80, 8192, 64, 28672),
)}

_BENCH_GPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpt.py"
_bench_cache: Dict[str, object] = {}


def _bench_gpt():
    """benchmarks/gpt.py of a source checkout (None in an installed package), loaded once."""
    if "module" not in _bench_cache:
        mod = None
        if _BENCH_GPT.is_file():
            spec = importlib.util.spec_from_file_location("_mpext_bench_gpt", _BENCH_GPT)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        _bench_cache["module"] = mod
    return _bench_cache["module"]


def model_names() -> List[str]:
    """The names ``model_spec`` knows: ``MODELS``, plus ``bench-<preset>`` for each preset of
    benchmarks/gpt.py when running from a source checkout."""
    gpt = _bench_gpt()
    return sorted(MODELS) + ["bench-" + k for k in (gpt.PRESETS if gpt else ())]


def model_spec(name: str) -> ModelSpec:
    """A known model by name (see ``model_names``). ``bench-<preset>`` is benchmarks/gpt.py's
    GPTConfig preset on its generated corpus's vocabulary, read from that file."""
    if name in MODELS:
        return MODELS[name]
    gpt = _bench_gpt()
    preset = name[len("bench-"):] if isinstance(name, str) and name.startswith("bench-") else None
    if gpt is None or preset not in gpt.PRESETS:
        raise ValueError("model: unknown model %r; choose one of %s"
                         % (name, ", ".join(model_names())))
    if "vocab" not in _bench_cache:
        _bench_cache["vocab"] = len(gpt.load_corpus()[1])
    cfg = gpt.GPTConfig.preset(preset, _bench_cache["vocab"])
    return _gpt(name, cfg.n_layer, cfg.n_embd, cfg.n_head, vocab=cfg.vocab_size,
                seq=cfg.block_size, note="benchmarks/gpt.py preset %r" % preset,
                dropout=cfg.dropout > 0)


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

    PERSISTENT = ("weights", "gradients", "master_weights", "optimizer_states", "scaler")
    TRANSIENT = ("activations", "autocast_copies", "step_buffers")

    @property
    def persistent(self) -> int:
        return sum(getattr(self, k) for k in self.PERSISTENT)

    @property
    def transient(self) -> int:
        """The larger of the forward/backward peak (activations + autocast copies) and the
        optimizer step's buffers: the two are not alive at the same time."""
        return max((self.activations or 0) + self.autocast_copies, self.step_buffers)

    @property
    def total(self) -> int:
        return self.persistent + self.transient

    def bytes_per_param(self, field: str) -> float:
        """Per-device bytes of ``field`` (or 'persistent' / 'total') over the model's params."""
        v = getattr(self, field)
        return (v or 0) / self.params

    def label(self) -> str:
        return self.mode + ("" if self.zero == 0 else " ZeRO-%d/%d" % (self.zero, self.world_size))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(persistent=self.persistent, transient=self.transient, total=self.total,
                 bytes_per_param={k: self.bytes_per_param(k)
                                  for k in self.PERSISTENT + self.TRANSIENT
                                  + ("persistent", "total")})
        return d


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


def activation_bytes(batch: int, seq: int, hidden: int, layers: int, heads: int,
                     act_bytes: int = 2, vocab: Optional[int] = None,
                     dropout: bool = True) -> int:
    """Activation memory of one forward of a GPT-style transformer (Korthikanti et al. 2022,
    section 4.1): per layer ``s*b*h*(16*d + 2*m) + a*s^2*b*(2*d + m)`` bytes (``d`` =
    ``act_bytes``, ``m`` = 1 with dropout masks, else 0), plus the embedding dropout mask, the
    final LayerNorm input and, with ``vocab``, the FP32 logits of the cross entropy
    (``4*s*b*vocab``)."""
    b = _check_count("batch", batch)
    s = _check_count("seq", seq)
    h = _check_count("hidden", hidden)
    n = _check_count("layers", layers)
    a = _check_count("heads", heads)
    if a > h:
        raise ValueError("heads: %d heads cannot exceed hidden=%d" % (a, h))
    if act_bytes not in (2, 4):
        raise ValueError("act_bytes: must be 2 or 4, got %r" % (act_bytes,))
    m = 1 if dropout else 0
    per_layer = s * b * h * (16 * act_bytes + 2 * m) + a * s * s * b * (2 * act_bytes + m)
    outside = s * b * h * (m + act_bytes)
    if vocab is not None:
        outside += 4 * s * b * _check_count("vocab", vocab)
    return n * per_layer + outside


def estimate(params, optimizer: str = "adamw", mode: str = "mpext-bf16", *, zero: int = 0,
             world_size: int = 1, batch: Optional[int] = None, seq: Optional[int] = None,
             hidden: Optional[int] = None, layers: Optional[int] = None,
             heads: Optional[int] = None, vocab: Optional[int] = None,
             dropout: bool = True) -> Breakdown:
    """Per-device memory of training a ``params``-parameter model.

    Args:
        params: the number of parameters (an int, or an integral float such as ``7e9``).
        optimizer: a key of ``OPTIMIZERS`` ('adamw', 'sgd', 'sgd-momentum', ...).
        mode: a key of ``MODES`` ('fp32', 'amp-bf16', 'amp-fp16', 'mpext-bf16', 'mpext-fp16').
        zero: ZeRO stage 0-3 (1: optimizer states and masters partitioned, 2: + gradients,
            3: + weights).
        world_size: data-parallel devices the partitions are spread over.
        batch, seq, hidden, layers, heads: the activation estimate's shape; all five or none.
        vocab: adds the FP32 logits of the cross entropy to the activations.
        dropout: count the dropout masks (1 byte per element) as Korthikanti et al. do.

    Returns a :class:`Breakdown`. Raises ``ValueError`` / ``TypeError`` naming the argument.
    """
    n = _check_count("params", params)
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError("mode: unknown mode %r; choose one of %s" % (mode, ", ".join(MODES)))
    k = optimizer_states(optimizer)
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
    spec = MODES[mode]

    def part(stage: int) -> int:  # elements per device of a tensor partitioned from `stage` on
        return -(-n // w) if zero >= stage else n

    # MixedPrecisionOptimizer's generic path (any optimizer but Adam/AdamW) makes FP32
    # gradients for the masters during step() and frees them after: one per master element.
    fused = optimizer in ("adam", "adamw")
    step_buffers = 0 if (fused or spec.master == 0) else _FP32 * part(1)
    acts, formula = None, ""
    if given:
        acts = activation_bytes(batch, seq, hidden, layers, heads, spec.activation, vocab,
                                dropout)
        formula = ("Korthikanti et al. 2022: layers*(s*b*h*(16*d+2*m) + a*s^2*b*(2*d+m)) "
                   "+ s*b*h*(m+d)%s, d=%d, m=%d" % (" + 4*s*b*v" if vocab else "",
                                                    spec.activation, 1 if dropout else 0))
    return Breakdown(
        mode=mode, optimizer=optimizer, params=n, zero=zero, world_size=w,
        weights=spec.weight * part(3),
        gradients=spec.grad * part(2),
        master_weights=spec.master * part(1),
        optimizer_states=_FP32 * k * part(1),
        scaler=_FP32 * SCALER_SCALARS if spec.scaler else 0,
        activations=acts,
        autocast_copies=spec.autocast_copy * n,
        step_buffers=step_buffers,
        activation_formula=formula,
    )


# ---------------------------------------------------------------------------------------------
# Measuring a live training setup


def _storage_key(t) -> Optional[tuple]:
    st = t.untyped_storage()
    if st.nbytes() == 0:
        return None
    return (t.device.type, t.device.index, st.data_ptr())


def measure(params, optimizer=None, scaler=None) -> Dict[str, int]:
    """Bytes held now by a training setup's persistent tensors, by category, each storage
    counted once (the sum of ``untyped_storage().nbytes()`` over unique storages):

    - ``weights``: the model's ``params`` (an iterable of tensors, e.g. ``model.parameters()``);
    - ``gradients``: their ``.grad``, plus the ``.grad`` of any FP32 master an inner optimizer
      steps;
    - ``master_weights``: state entries whose key names a master (``master_param``) and the
      params of a wrapped inner optimizer (``optimizer.optimizer``) that are not model params;
    - ``optimizer_states``: other state tensors as large as their param (moments, buffers);
    - ``scaler``: tensors held by ``scaler``, or by a scaler the optimizer keeps as
      ``.scaler`` (``mpext.MixedPrecisionOptimizer``);
    - ``other``: everything else the optimizer objects hold (``step`` scalars, cached lr
      tensors, ...).

    Use it after a step (before ``zero_grad``) to compare with :func:`estimate`.
    """
    import torch

    out = {"weights": 0, "gradients": 0, "master_weights": 0, "optimizer_states": 0,
           "scaler": 0, "other": 0}
    seen = set()

    def add(cat, t):
        if not isinstance(t, torch.Tensor):
            return
        key = _storage_key(t)
        if key is None or key in seen:
            return
        seen.add(key)
        out[cat] += t.untyped_storage().nbytes()

    model_params = list(params)
    model_ids = {id(p) for p in model_params}
    for p in model_params:
        add("weights", p)
    for p in model_params:
        add("gradients", p.grad)

    chain, obj = [], optimizer
    while obj is not None and obj not in chain:
        chain.append(obj)
        inner = getattr(obj, "optimizer", None)
        obj = inner if inner is not obj else None
    for opt in chain:
        for group in getattr(opt, "param_groups", ()):
            for q in group["params"]:
                if id(q) not in model_ids:
                    add("master_weights", q)
                    add("gradients", q.grad)
        for q, st in getattr(opt, "state", {}).items():
            if not isinstance(st, dict):
                continue
            for name, v in st.items():
                if not isinstance(v, torch.Tensor):
                    continue
                if "master" in str(name):
                    add("master_weights", v)
                elif isinstance(q, torch.Tensor) and v.numel() == q.numel() and v.numel() > 1:
                    add("optimizer_states", v)
                else:
                    add("other", v)
    for sc in [scaler] + [getattr(o, "scaler", None) for o in chain]:
        if isinstance(sc, torch.amp.GradScaler):
            for t in _tensors_in(vars(sc)):
                add("scaler", t)
    for opt in chain:  # whatever else the optimizer objects keep
        for t in _tensors_in(vars(opt)):
            add("other", t)
    return out


def _tensors_in(obj, depth: int = 4):
    """Tensors inside nested dicts / lists / tuples (not inside other objects)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 0 and isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, depth - 1)
    elif depth > 0 and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v, depth - 1)


# ---------------------------------------------------------------------------------------------
# The command line

ROWS = [("weights", "weights"), ("gradients", "gradients"), ("master_weights", "master weights"),
        ("optimizer_states", "optimizer states"), ("scaler", "loss scaler"),
        ("persistent", "**persistent**"), ("activations", "activations (per step)"),
        ("autocast_copies", "autocast weight copies (per step)"),
        ("step_buffers", "FP32 master grads (during step)"), ("total", "**total**")]

OPTIONAL_ROWS = ("scaler", "autocast_copies", "step_buffers")  # shown when not all zero
_SUFFIX = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def _count_arg(minimum: int = 1):
    def parse(text: str) -> int:
        t = text.strip()
        mult = 1.0
        if t[-1:].upper() in _SUFFIX:
            mult, t = _SUFFIX[t[-1].upper()], t[:-1]
        try:
            v = float(t) * mult
        except ValueError:
            raise argparse.ArgumentTypeError("not a number: %r" % (text,)) from None
        if not math.isfinite(v) or v != int(v):
            raise argparse.ArgumentTypeError("must be a whole number, got %r" % (text,))
        if v < minimum:
            raise argparse.ArgumentTypeError("must be >= %d, got %r" % (minimum, text))
        return int(v)
    return parse


def _list_arg(name: str, choices: Sequence[str]):
    def parse(text: str) -> List[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        if items == ["all"]:
            return list(choices)
        bad = [s for s in items if s not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError("unknown %s %r; choose from %s (comma-separated, "
                                             "or 'all')" % (name, ",".join(bad) or text,
                                                            ", ".join(choices)))
        return items
    return parse


def _zero_arg(text: str) -> List[int]:
    out = []
    for s in text.split(","):
        if s.strip() not in ("0", "1", "2", "3"):
            raise argparse.ArgumentTypeError("ZeRO stage must be 0, 1, 2 or 3 (comma-separated "
                                             "for several), got %r" % text)
        out.append(int(s))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mpext.memory",
        description="Per-device training memory: weights, gradients, master weights, optimizer "
                    "states, activations, for native AMP and mpext modes, with ZeRO stages.",
        epilog="Example: python -m mpext.memory --model llama-7b --mode fp32,amp-bf16,mpext-bf16 "
               "--zero 0,1,2,3 --world-size 8 --batch 1. Accounting: docs/memory.md.")
    # So that "--params -7e9" reaches the check (and its message) instead of reading as an
    # option: argparse's own pattern knows no exponents. No option looks like a number.
    p._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?[KMBGTkmbgt]?$")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=_count_arg(),
                     help="parameter count: 7e9, 7B, 124M, 1300000")
    src.add_argument("--model", choices=model_names(),
                     help="a known model (sets params and the activation shape)")
    p.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZERS),
                   help="default: %(default)s")
    p.add_argument("--mode", type=_list_arg("mode", list(MODES)), default=list(MODES),
                   help="one or more of %s, comma-separated, or 'all' (default)"
                        % ", ".join(MODES))
    p.add_argument("--zero", type=_zero_arg, default=[0],
                   help="ZeRO stage(s) 0-3, comma-separated (default 0)")
    p.add_argument("--world-size", type=_count_arg(), default=1,
                   help="data-parallel devices (default 1)")
    act = p.add_argument_group("activations (all of batch, seq, hidden, layers, heads; "
                               "--model fills in all but batch)")
    act.add_argument("--batch", type=_count_arg(), help="micro-batch size per device")
    act.add_argument("--seq", type=_count_arg(), help="sequence length")
    act.add_argument("--hidden", type=_count_arg(), help="hidden size")
    act.add_argument("--layers", type=_count_arg(), help="transformer layers")
    act.add_argument("--heads", type=_count_arg(), help="attention heads")
    act.add_argument("--vocab", type=_count_arg(),
                     help="vocabulary size (adds the FP32 logits)")
    act.add_argument("--no-dropout", action="store_true",
                     help="no dropout masks in the activation estimate")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--png", metavar="PATH", help="also write a stacked bar chart of the columns")
    return p


def _configs(args, parser) -> List[Breakdown]:
    shape = {k: getattr(args, k) for k in ("batch", "seq", "hidden", "layers", "heads", "vocab")}
    dropout = not args.no_dropout
    if args.model:
        m = model_spec(args.model)
        params = m.params
        dropout = dropout and m.dropout
        for k, v in (("seq", m.seq), ("hidden", m.hidden), ("layers", m.layers),
                     ("heads", m.heads), ("vocab", m.vocab)):
            if shape[k] is None:
                shape[k] = v
        if shape["batch"] is None:  # no batch: persistent memory only
            shape = {k: None for k in shape}
    else:
        params = args.params
    if shape["heads"] is not None and shape["hidden"] is not None \
            and shape["heads"] > shape["hidden"]:
        parser.error("argument --heads: %d heads cannot exceed --hidden %d"
                     % (shape["heads"], shape["hidden"]))
    core = [k for k in ("batch", "seq", "hidden", "layers", "heads")]
    given = [k for k in core if shape[k] is not None]
    if given and len(given) != len(core):
        parser.error("the activation estimate needs --%s as well (given: --%s)"
                     % (", --".join(k for k in core if shape[k] is None), ", --".join(given)))
    if shape["vocab"] is not None and not given:
        parser.error("argument --vocab: only used with the activation shape (--batch, --seq, "
                     "--hidden, --layers, --heads)")
    if any(z > 0 for z in args.zero) and args.world_size == 1:
        print("note: ZeRO with --world-size 1 partitions over one device (no saving)",
              file=sys.stderr)
    out = []
    for mode in args.mode:
        for z in args.zero:
            out.append(estimate(params, args.optimizer, mode, zero=z, world_size=args.world_size,
                                dropout=dropout, **shape))
    return out


def _unit(results: Sequence[Breakdown]) -> tuple:
    """(name, bytes) of the unit a table or chart of ``results`` is shown in: GiB, or MiB / KiB
    for small models."""
    top = max(r.total for r in results)
    for name, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if top >= size:
            return name, float(size)
    return "B", 1.0


def format_table(results: Sequence[Breakdown]) -> str:
    """Markdown table: one row per component, one column per configuration, each cell
    'size (bytes/param)' in the unit of the header (GiB, or MiB/KiB for small models)."""
    unit, size = _unit(results)
    head = ["per device: %s (bytes/param)" % unit] + [r.label() for r in results]
    rows = []
    for field, name in ROWS:
        if field in OPTIONAL_ROWS and not any(getattr(r, field) for r in results):
            continue
        cells = [name]
        for r in results:
            v = getattr(r, field)
            if v is None:
                cells.append("—")
            elif 0 < v < 0.01 * size:  # e.g. the scaler's scalars: in bytes
                cells.append("%d B (%.2g)" % (v, v / r.params))
            else:
                cells.append("%.3g (%.3g)" % (v / size, v / r.params))
        rows.append(cells)
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                       for i, (c, w) in enumerate(zip(r, widths))) + " |"
    sep = "|:" + "-" * (widths[0] + 1) + "|" + "|".join("-" * (w + 1) + ":"
                                                          for w in widths[1:]) + "|"
    return "\n".join([line(head), sep] + [line(r) for r in rows])


def plot(results: Sequence[Breakdown], path: str, title: str = "") -> str:
    """A stacked bar chart (GiB, or MiB/KiB, per device) of each configuration's components."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, size = _unit(results)
    parts = [f for f in Breakdown.PERSISTENT + Breakdown.TRANSIENT]
    names = dict(ROWS)

    def shown(r, f):  # the step's buffers and the forward/backward peak do not overlap
        if f in Breakdown.PERSISTENT:
            return getattr(r, f)
        step_peak = r.step_buffers > (r.activations or 0) + r.autocast_copies
        return (r.step_buffers if step_peak else 0) if f == "step_buffers" else \
            (0 if step_peak else getattr(r, f) or 0)

    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(results) + 2), 4.5))
    x = list(range(len(results)))
    bottom = [0.0] * len(results)
    for f in parts:
        ys = [shown(r, f) / size for r in results]
        if not any(ys):
            continue
        hatch = "//" if f in Breakdown.TRANSIENT else None
        ax.bar(x, ys, bottom=bottom, label=names[f], hatch=hatch)
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax.set_xticks(x)
    ax.set_xticklabels([r.label() for r in results], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("%s per device" % unit)
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``python -m mpext.memory`` command; returns the exit status (argparse exits with 2 on
    bad arguments)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    results = _configs(args, parser)
    what = args.model or "%s params" % format(results[0].params, ",")
    title = "%s, %s, world size %d" % (what, args.optimizer, args.world_size)
    if args.json:
        print(json.dumps({"model": args.model, "optimizer": args.optimizer,
                          "results": [r.to_dict() for r in results]}, indent=1))
    else:
        print("## Training memory per device: %s" % title)
        print()
        print(format_table(results))
        print()
        f = next((r.activation_formula for r in results if r.activation_formula), "")
        print("Activations: %s." % (f if f else "not estimated (give --batch with --model, or "
                                    "--batch --seq --hidden --layers --heads)"))
        print("Per-step rows exist only while a step runs; see docs/memory.md for each row.")
    if args.png:
        plot(results, args.png, title)
        print("wrote %s" % args.png, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
