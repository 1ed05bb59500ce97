"""The activation model of mpext.memory: what autograd saves in one forward of a GPT or
LLaMA layout, tensor by tensor (``activation_bytes``, ``activation_formula``), and what
mpext.activations' compression stores of it (``activation_compression``). docs/memory.md,
"Activations", has the formula and the measured table."""
import collections
import inspect
from typing import Dict, List, Optional, Sequence, Tuple

from .. import activations as _act
from .. import activations_recompute as _rc
from ._args import check_count as _check_count


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
# ``recompute``: the ops of the pointwise recipe mpext.activations_recompute stores it as, when
# the policy picks it and every leaf of the recipe is stored (0: no recipe, an 8-bit copy).
_Saved = collections.namedtuple(
    "_Saved", "name count coef unit size cols kind grad store recompute", defaults=(0,))

# What the MLP's activation function leaves saved between the up- and the down-projection, one
# row per ffn-wide tensor: (name, store, kind, bytes, recompute ops), ``bytes`` "d" (the
# products' dtype) or "4" (float32: CUDA autocast runs pow in float32, and what follows it).
# Read off each function's autograd nodes (torch 2.13) and the recompute rules of
# mpext.activations_recompute (POINTWISE, MAX_OPS): a row whose ``recompute`` is nonzero is
# stored as a recipe of that many ops over the rows above it when the policy picks it. These
# are the rows that move if those rules change: GELU's, SiLU's and gelu_new's outputs and
# gelu_new's intermediates (recomputed today), ReLU's output (an 8-bit copy: its input, the
# up-projection's output, is saved by no one, so no recipe reaches a stored leaf).
_FUSED = lambda fn: [  # noqa: E731  (F.gelu, F.silu: the input saved, the output by c_proj)
    ("%s input" % fn, "gelu_in", "activation", "d", 0),
    ("MLP down-projection input (%s output)" % fn, "gelu_out", "linear", "d", 1)]
_MLP_ACTIVATIONS = {
    "gelu": _FUSED("GELU"), "gelu_pytorch_tanh": _FUSED("GELU"), "silu": _FUSED("SiLU"),
    "swish": _FUSED("SiLU"),
    # HF's NewGELUActivation: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * pow(x, 3)))):
    # pow saves x, tanh its output, the last product both factors; c_proj the result
    "gelu_new": [("GELU input (pow's)", "gelu_in", None, "d", 0),
                 ("tanh output", "g_tanh", "activation", "4c", 5),
                 ("0.5 * x", "g_half", None, "d", 1),
                 ("1 + tanh", "g_onep", None, "4c", 6),
                 ("MLP down-projection input (GELU output)", "gelu_out", "linear", "d", 8)],
    # F.relu saves its output, which c_proj saves too: one storage
    "relu": [("MLP down-projection input (ReLU output)", "gelu_out", "activation", "d", 0)],
}
ACTIVATIONS = tuple(_MLP_ACTIVATIONS)


def _saved_tensors(dropout: bool, attention: str, device: str, d: int, f: int,
                   vocab: bool, activation: str = "gelu") -> Tuple[List[_Saved], List[_Saved]]:
    """(per layer, outside the layers): what a pre-LayerNorm GPT saves, tensor by tensor, as
    torch's saved-tensor hooks see it on tests/small_gpt.py and transformers' GPT-2, with the
    MLP's ``activation`` (``_MLP_ACTIVATIONS``)."""
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
             T("MLP input", 1, 1, x, "d", "h", "linear", True, "mlp_in")] + [
             T(name, 1, 4, x, size, "4*h", kind, True, store, ops)
             for name, store, kind, size, ops in _MLP_ACTIVATIONS[activation]]
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


def _cnn_block(x: str, out_ops: int) -> List[_Saved]:
    """One residual block ``relu(bn2(conv2(relu(bn1(conv1(x))))) + x)`` (tests/zoo.py's
    ResBlock, torchvision's BasicBlock without a downsampling branch), as torch's saved-tensor
    hooks see it: each conv saves its input (the block's input, ReLU 1's output: saved by the
    ReLU already), each BatchNorm in training its input (the conv's output) and the batch's
    mean and inverse std (``C`` each, in the input's dtype; the running statistics are
    buffers), each ReLU its output; BatchNorm's outputs and the residual sum are saved by no
    one. ``out_ops``: the recipe mpext.activations stores the block's output as (ReLU of the
    sum of BatchNorm 2's affine map and the block's input: 3 ops, plus the input's own)."""
    T = _Saved
    return [T("conv 1 output (BatchNorm 1 input)", 1, 1, x, "d", "w", "norm", True, "a1"),
            T("BatchNorm 1 mean, invstd", 2, 1, "h", "f", "1", None, False, "bn1"),
            T("ReLU 1 output (conv 2 input)", 1, 1, x, "d", "w", "activation", True, "r1", 2),
            T("conv 2 output (BatchNorm 2 input)", 1, 1, x, "d", "w", "norm", True, "a2"),
            T("BatchNorm 2 mean, invstd", 2, 1, "h", "f", "1", None, False, "bn2"),
            T("block output: ReLU(BatchNorm 2 + input) (the next conv's input)", 1, 1, x, "d",
              "w", "activation", True, "out", out_ops)]


def _cnn_saved_tensors(vocab: bool) -> Tuple[List[_Saved], List[_Saved]]:
    """(one block whose input is stored, the stem and the head): the CNN of tests/zoo.py, a
    stem conv + BatchNorm + ReLU to ``C`` channels and residual blocks at ``C`` channels and
    ``H x W``, then global average pooling and a linear classifier (``vocab``: its classes,
    with the cross entropy's float32 log-softmax). ``s`` = H*W, ``h`` = C."""
    T, x = _Saved, "s*b*h"
    outside = [T("stem conv output (BatchNorm input)", 1, 1, x, "d", "w", "norm", True, "c0"),
               T("stem BatchNorm mean, invstd", 2, 1, "h", "f", "1", None, False, "bn0"),
               T("stem ReLU output (block 1's input)", 1, 1, x, "d", "w", "activation", True,
                 "r0", 2),
               T("classifier input (pooled)", 1, 1, "b*h", "d", "h", "linear", True, "pool")]
    if vocab:
        outside += [T("cross entropy's log-softmax", 1, 1, "b*v", "4", "v", None, True, "logp"),
                    T("nll_loss's total weight (0-d)", 1, 1, "1", "4", "1", None, False, "tw")]
    return _cnn_block(x, 5), outside


def _cnn_bytes(n: int, env: Dict[str, int], opts) -> int:
    """The CNN's saved bytes: the stem, ``n`` blocks and the head. Under compression each
    ReLU output a recipe stores costs its BatchNorm's scale and shift (``C`` float32 each,
    the recipe's leaves), and the block outputs form one chain of recipes (each reads the
    previous block's output), which mpext.activations cuts where it would pass MAX_OPS ops:
    that block's output is an 8-bit copy and the next chain starts from it."""
    _, outside = _cnn_saved_tensors(env["v*"] > 0)
    leaves = _Saved("BatchNorm scale, shift (a recipe's leaves)", 2, 1, "h", "4", "1", None,
                    False, "")

    def recipe_leaves(rows):
        return sum(_saved_bytes([leaves._replace(store=t.store + "_leaves")], env, None)
                   for t in rows if _stored_as(t, env, opts) == "recomputed")
    total = _saved_bytes(outside, env, opts) + recipe_leaves(outside)
    prev = 2 if _stored_as(outside[2], env, opts) == "recomputed" else 0
    for _ in range(n):
        block = _cnn_block("s*b*h", 3 + prev)
        total += _saved_bytes(block, env, opts) + recipe_leaves(block)
        prev = block[-1].recompute if _stored_as(block[-1], env, opts) == "recomputed" else 0
    return total


# The activation formulas the calculator knows, by model family: a family whose formula is not
# here is refused, never estimated with another family's.
FAMILIES = ("gpt", "llama", "cnn")
# The tensors saved outside the layers before the first layer runs (the rest, the final norm,
# the head and the loss, is freed by the backward before the layers' backward starts: under
# activation checkpointing they are not alive while a layer is recomputed).
_BEFORE_LAYERS = ("positions", "emask", "rope")
# Each family's block input (the residual stream, in f), as a storage of its layer list: what
# activation checkpointing keeps per layer.
_BLOCK_INPUT = {"gpt": "ln1", "llama": "x"}


def _family_tensors(family: str, dropout: bool, attention: str, device: str, d: int, f: int,
                    vocab: bool, activation: str = "gelu") -> Tuple[List[_Saved], List[_Saved]]:
    if family == "llama":
        return _llama_saved_tensors(attention, d, f, vocab)
    if family == "cnn":
        return _cnn_saved_tensors(vocab)
    return _saved_tensors(dropout, attention, device, d, f, vocab, activation)


def _shape_env(b, s, h, a, v, d, f, mask_d, mask_f, ffn=None, device="cuda",
               width=None) -> Dict[str, int]:
    return {"4c": 4 if device == "cuda" and d != f else d, "b*h": b * h, "b*v": b * (v or 0),
            "w": width or 1, "v*": v or 0,
            "s*b*h": s * b * h, "s*b": s * b, "a*s*b": a * s * b, "a*s^2*b": a * s * s * b,
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


def _stored_as(t: _Saved, env: Dict[str, int], opts) -> Optional[str]:
    """How mpext.activations stores ``t`` under ``opts`` (None: as it is): "bits" for a
    dropout mask of at least ``min_numel`` elements (exact, whatever the policy; the CPU's
    SDPA math path's too), "recomputed"
    for a tensor the policy picks that a recorded pointwise op made from stored tensors (GELU's
    output from its saved input; eager attention's dropped probabilities from the softmax
    output and the mask's bits), "fp8" for the rest the policy picks."""
    if opts is None:
        return None
    numel = t.coef * env[t.unit]
    if (t.kind == "dropout" or t.store == "pmask") and not t.grad:
        return "bits" if numel >= opts["min_numel"] else None
    if not _compressed(t, env, opts):
        return None
    if opts.get("recompute", True) and (0 < t.recompute <= _rc.MAX_OPS or (
            t.store == "pdrop" and t.kind == "linear" and numel >= opts["min_numel"]
            and env["d"] == env["f"])):  # under autocast P@V saves a cast, not the product
        return "recomputed"
    return "fp8"


def _saved_bytes(tensors: Sequence[_Saved], env: Dict[str, int], opts) -> int:
    """The bytes of ``tensors``: FP8 codes and scales of each compressed one, a bit per element
    of each mask, nothing for a recomputed one, each storage once of the rest. A storage one
    saver holds raw is compressed for no later saver (mpext.activations keeps one copy per
    storage); views of one storage's memory share its copy (P@V's view of the softmax output,
    the out-projection's view of attention's output)."""
    total, stores, raw, coded = 0, set(), set(), set()
    for t in tensors:
        numel = t.coef * env[t.unit]
        how = _stored_as(t, env, opts) if t.store not in raw else None
        if how == "bits":
            total += t.count * -(-numel // 8)
        elif how == "recomputed":
            continue
        elif how == "fp8":
            if (t.store, numel) in coded:
                continue  # the same memory in another view (P@V's view of the softmax
                # output; the out-projection's (b*s, h) view of attention's output): one copy
            coded.add((t.store, numel))
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
                     checkpointing: bool = False, activation: str = "gelu",
                     width: Optional[int] = None) -> int:
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
    quantizes them), counted once per memory (attention's output and the out-projection's
    input, two views of one storage, share a copy). Dropout masks of at least ``min_numel``
    elements are stored as bits (``ceil(n/8)`` bytes each, whatever the policy); GELU's output
    and eager attention's dropped probabilities, when the policy picks them, are recomputed in
    the backward from tensors stored anyway and cost nothing (``recompute=False``: FP8 copies).
    The rest is counted as without compression: what no policy compresses (indices,
    norm statistics, the log-sum-exp: no grad_fn), tensors under ``min_numel`` elements and
    those whose blocks would not make them smaller; the "layers" policy keeps the softmax of
    eager attention and the loss's log-softmax, "linear" also attention's, the norms' and the
    GELU's tensors, "size" those under ``min_bytes``.

    ``activation``: the gpt family's MLP activation function, by its transformers name
    (``ACTIVATIONS``): ``"gelu"`` (``F.gelu``; also ``gelu_pytorch_tanh``, ``silu``: the input
    and the output saved), ``"gelu_new"`` (GPT-2's hub default, a pointwise chain: its input,
    tanh's output, ``0.5*x``, ``1 + tanh`` and the output, five ffn-wide tensors; under the
    compression the four after the input are recipes), ``"relu"`` (its output only).

    ``family="cnn"``: tests/zoo.py's CNN (a stem conv + BatchNorm + ReLU, ``layers`` residual
    blocks of two 3x3 convs with BatchNorm and ReLU, global pooling, a linear classifier of
    ``vocab`` classes) with ``batch`` images, ``seq`` = H*W pixels, ``hidden`` = the channels,
    ``heads`` = 1; ``width`` = W (for where the compression's blocks fall; None: a square
    image). Per block ``4*s*b*h*d + 4*h*f``; see :func:`_cnn_block`."""
    b, s, h, n, a, v, dropout, f, opts, ffn = _check_activation_args(
        batch, seq, hidden, layers, heads, act_bytes, vocab, dropout, norm_bytes, attention,
        device, compress, family, ffn, checkpointing, activation)
    width = _check_width(family, s, width)
    layer, outside = _family_tensors(family, dropout, attention, device, act_bytes, f,
                                     v is not None, activation)
    cpu = device == "cpu"
    mask_d = (act_bytes if cpu else 1) if dropout else 0  # the residual (d-dtype) dropouts'
    mask_f = (f if cpu else 1) if dropout else 0  # the embedding's (in the weights' dtype)
    env = _shape_env(b, s, h, a, v, act_bytes, f, mask_d, mask_f, ffn, device, width)
    if family == "cnn":
        return _cnn_bytes(n, env, opts)
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


def _check_width(family: str, seq: int, width) -> Optional[int]:
    """The cnn family's image width: given (it must divide ``seq`` = H*W) or, for None, the
    side of a square image."""
    if family != "cnn":
        if width is not None:
            raise ValueError("width: only the cnn family reads it (an image's width)")
        return None
    if width is None:
        w = int(round(seq ** 0.5))
        if w * w != seq:
            raise ValueError("width: seq=%d pixels is not a square image; give the image's "
                             "width (seq = height * width)" % seq)
        return w
    w = _check_count("width", width)
    if seq % w:
        raise ValueError("width: must divide seq = height * width = %d, got %d" % (seq, w))
    return w


def _check_activation_args(batch, seq, hidden, layers, heads, act_bytes, vocab, dropout,
                           norm_bytes, attention, device, compress, family, ffn,
                           checkpointing, activation="gelu"):
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
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError("activation: the gpt family's MLP activation must be one of %s, got %r"
                         % (", ".join(ACTIVATIONS), activation))
    if activation != "gelu" and family != "gpt":
        raise ValueError("activation: only the gpt family's MLP takes one (the %s family's "
                         "is its own), got %r" % (family, activation))
    if dropout is None:
        dropout = family == "gpt"  # GPT-2 trains with dropout, LLaMA and the CNN without
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
    if family == "cnn":
        if a != 1:
            raise ValueError("heads: the cnn family has no attention; give heads=1, got %d" % a)
        if dropout:
            raise ValueError("dropout: the cnn formula has no dropout; give dropout=False")
        if checkpointing:
            raise ValueError("checkpointing: not estimated for the cnn family (its checkpointed "
                             "peak is not measured)")
    if checkpointing and opts is not None:
        raise ValueError("compress: not estimated together with checkpointing (the recomputed "
                         "block's compression is not measured)")
    return b, s, h, n, a, v, dropout, f, opts, ffn


def _terms(tensors: Sequence[_Saved], env: Dict[str, int], opts) -> str:
    """The compressed estimate's terms as text: the bytes kept as they are, by unit, then
    fp8(n, c) for the compressed tensors of n elements in all, last dimension c."""
    plain, fp8, bits, stores, coded = {}, {}, {}, set(), set()
    for t in tensors:
        how = _stored_as(t, env, opts)
        if how == "recomputed" or (how == "fp8" and (t.store, t.coef) in coded):
            continue  # nothing, or a view of a copy counted already
        if how == "bits":
            bits[t.unit] = bits.get(t.unit, 0) + t.count * t.coef
        elif how == "fp8":
            coded.add((t.store, t.coef))
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
    out += ["bits(%s)" % unit(c, u) for u, c in bits.items()]
    return " + ".join(out) or "0"


def activation_formula(act_bytes: int, norm_bytes: Optional[int] = None, vocab: bool = False,
                       dropout: Optional[bool] = None, attention: str = "sdpa",
                       device: str = "cuda", *, compress=None,
                       shape: Optional[Dict[str, int]] = None, family: str = "gpt",
                       checkpointing: bool = False, activation: str = "gelu") -> str:
    """The formula :func:`activation_bytes` evaluates, with its parameters, as text. With
    ``compress``, which tensors are compressed depends on their sizes, so ``shape`` (a dict of
    ``batch``, ``seq``, ``hidden``, ``heads`` and, with ``vocab``, ``vocab``) is needed: the
    text gives the bytes kept as they are (d, f and m evaluated) and fp8(n, c) for the
    compressed tensors. ``family`` names the model family's formula (``FAMILIES``), and with
    ``checkpointing`` the text says how a checkpointed run's peak is made of it; ``activation``
    is the gpt family's MLP activation (``ACTIVATIONS``)."""
    if family not in FAMILIES:
        raise ValueError("family: no activation formula for %r (the calculator knows %s)"
                         % (family, ", ".join(FAMILIES)))
    if activation not in ACTIVATIONS or (activation != "gelu" and family != "gpt"):
        raise ValueError("activation: the gpt family's MLP activation, one of %s; got %r for "
                         "the %s family" % (", ".join(ACTIVATIONS), activation, family))
    if dropout is None:
        dropout = family == "gpt"
    text = _formula(act_bytes, norm_bytes, vocab, dropout, attention, device, compress, shape,
                    family, activation)
    if not checkpointing:
        return text
    f = act_bytes if norm_bytes is None else norm_bytes
    own = family == "llama" and f != 4  # the block's input is not what its first norm saves
    before = "2*s*(h/a)*f" if family == "llama" else "8*s%s" % (" + s*b*h*m'" if dropout else "")
    return ("checkpointed per block: max(layers*s*b*h*f + all outside the layers, "
            "(layers-1)*s*b*h*f + %sone layer + %s) with %s" % (
                "s*b*h*f + " if own else "", before, text))


def _formula(act_bytes, norm_bytes, vocab, dropout, attention, device, compress, shape,
             family, activation="gelu") -> str:
    f = act_bytes if norm_bytes is None else norm_bytes
    if family == "cnn":
        opts = activation_compression(compress)
        text = ("stem s*b*h*2*d + 2*h*f, per block s*b*h*4*d + 4*h*f, head b*h*d%s, d=%d, f=%d "
                "(CNN: stem conv + BatchNorm + ReLU, residual blocks of two 3x3 convs with "
                "BatchNorm and ReLU; s = H*W pixels, h = channels, b = images)"
                % (" + 4*b*v" if vocab else "", act_bytes, f))
        if opts is None:
            return text
        return (text + "; compressed (policy %r): each conv output an fp8 copy (n + 4*(n/c)*"
                "ceil(c/%d)), each ReLU output recomputed from it (its BatchNorm's scale and "
                "shift kept, 8*h), the block outputs a chain of recipes cut into an fp8 copy "
                "where it would pass %d ops" % (opts["policy"], opts["block_size"], _rc.MAX_OPS))
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
        env["4c"] = 4 if device == "cuda" and act_bytes != f else act_bytes
        layer, outside = _saved_tensors(dropout, attention, device, act_bytes, f, vocab,
                                        activation)
        return ("layers*(%s) + %s, fp8(n, c) = n + 4*(n/c)*ceil(c/%d) (FP8 codes and a float32 "
                "scale per block of the last dimension c, c = the block where rows are shorter; "
                "bits(n) = ceil(n/8) per mask; recomputed tensors cost nothing; "
                "mpext.activations policy %r), d=%d, f=%d, m=%s (GPT: pre-LayerNorm, %s MLP; "
                "%s attention, %s)" % (
                    _terms(layer, env, opts), _terms(outside, env, opts), opts["block_size"],
                    opts["policy"], act_bytes, f, m, "GELU" if activation == "gelu" else
                    activation, attention, device))
    math = attention == "sdpa" and dropout and device == "cpu"
    att = ("3*s*b*h*(4-d) + 12*a*s^2*b" if math else "4*a*s*b" if attention == "sdpa" else
           "a*s^2*b*(f+%s+m)" % ("d" if dropout or act_bytes != f else "0"))
    # the MLP's activation: 4*h wide tensors in d, and in float32 where CUDA autocast makes them
    f32 = device == "cuda" and act_bytes != f
    mlp = _MLP_ACTIVATIONS[activation]
    in_d = 4 * sum(1 for r in mlp if r[3] == "d" or not f32)
    in_4 = 4 * len(mlp) - in_d
    return ("layers*(s*b*h*(%d*d%s+2*f+2*m) + 4*s*b*f + %s) + s*b*h*(f+d+m) + 2*s*b*f + 8*s%s, "
            "d=%d, f=%d, m=%s (GPT: pre-LayerNorm, %s MLP; %s attention, %s)"
            % (6 + in_d, " + %d*4" % in_4 if in_4 else "", att, " + 4*s*b*v" if vocab else "",
               act_bytes, f, m, "GELU" if activation == "gelu" else activation, attention,
               device))
