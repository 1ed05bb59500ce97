"""FP8 saved activations inside ``torch.compile``'d code, through AOTAutograd's inlined
saved-tensor hooks: when the innermost saved-tensor hooks are ``fx.GraphModule``s
(``torch._functorch._aot_autograd.utils.saved_tensors_hooks_are_inlineable``, torch 2.8 and
later), AOTAutograd traces pack into the compiled forward's epilogue and unpack into the
compiled backward's prologue, and turns the hooks off around the compiled function at run time.

``fp8_saved_tensors`` installs such a pair. Each is a GraphModule of one call to a
``torch.fx.wrap``'d function, which AOTAutograd calls on every saved tensor's fake value and
traces: the choice of tensor and its layout are plain Python at compile time, and only
``mpext::fp8_quantize`` / ``fp8_dequantize`` reach the graph. Called by eager autograd (outside
AOTAutograd's hook context) the same functions hand the tensor to the innermost active context's
eager pack, so one pair of hooks serves eager and compiled code.

A boolean saved tensor (a dropout's mask, a comparison the partitioner keeps) is stored as
bits (``activations_recompute.pack_bits``: torch ops, exact).

AOTAutograd offers the hooks the graph's intermediates only (``saved_tensors_hooks_filtering_mode
= "donated"``, its default): never a parameter, an input or an output of the graph, which stay
alive anyway. The tensors the compiled backward saves are the partitioner's choice, so they may
differ from the eager ones; a tensor saved in both is compressed to the same bits. While the
context is active, graphs are partitioned with ``PARTITIONER`` (one 8-bit copy per pointwise
chain, rerun in the backward, and bases rather than views: one code per storage).
"""
import operator
import threading

import torch

from . import activations_codes as _codes
from . import activations_recompute as _rc
from . import ops

__all__ = ["supported", "hooks", "active"]

_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)
_TAG = "mpext_fp8"
_TAG_BITS = "mpext_bits"


def supported() -> bool:
    """Whether this torch inlines GraphModule saved-tensor hooks into compiled graphs."""
    try:
        from torch._functorch._aot_autograd import graph_compile
        from torch._functorch._aot_autograd import utils as aot_utils
    except ImportError:
        return False
    return (hasattr(aot_utils, "saved_tensors_hooks_are_inlineable")
            and hasattr(graph_compile, "_get_saved_tensor_hook_context"))


def _compiling() -> bool:
    """Whether AOTAutograd is inlining the hooks now (it calls them on fake values under this
    context); otherwise eager autograd is calling them on a real tensor."""
    from torch._functorch._aot_autograd import graph_compile
    return graph_compile._get_saved_tensor_hook_context() is not None


# The eager pack of each active context, innermost last, per thread (hooks are thread-local).
_TLS = threading.local()


# The partitioner's options for graphs compiled while the context is active. By default the
# min-cut partitioner will not recompute a pointwise op whose output a matmul or convolution
# reads in the backward ("materialized backward"), nor long pointwise chains, nor ops whose
# inputs were made far apart: it saves a norm's input and its output, a conv's output and the
# ReLU after its BatchNorm, SwiGLU's two projections and their product. With 8-bit copies one
# copy of the chain's input and a rerun of the cheap pointwise ops in the backward is the
# better trade (what eager compression's recipes do: activations_recompute). Only these three
# bans are lifted, not ``aggressive_recomputation``'s fourth, the allowlist: outside it are
# undecomposed ops such as the functional batch norm, whose rerun would save the running
# statistics the forward then updates in place (autograd's version check fails). Matmuls,
# convolutions, attention, reductions and random ops are never recomputed.
PARTITIONER = {"ban_recompute_materialized_backward": False,
               "ban_recompute_long_fusible_chains": False,
               "ban_recompute_used_far_apart": False, "recompute_views": True}


class active:
    """While the block runs: ``eager_pack`` is what the hooks call on real tensors, and graphs
    compiled in it are partitioned with ``PARTITIONER`` (AOTAutograd reads it when it compiles;
    dynamo guards on the hooks, so graphs compiled inside are not reused outside)."""

    def __init__(self, eager_pack):
        self.eager_pack = eager_pack
        self._config = None

    def __enter__(self):
        if not hasattr(_TLS, "stack"):
            _TLS.stack = []
        _TLS.stack.append(self.eager_pack)
        self._config = torch._functorch.config.patch(**PARTITIONER)
        self._config.__enter__()
        return self

    def __exit__(self, *exc):
        self._config.__exit__(*exc)
        _TLS.stack.pop()
        return False


def _worth_it(x: torch.Tensor, s) -> bool:
    """The eager context's tests that a fake value can answer: a float32/bfloat16/float16
    tensor of at least ``min_numel`` elements whose blocks pay for their scales, no two of its
    elements at one address, and what the policy asks ("size": ``min_bytes``; a callable:
    its answer for the fake value, which has shape, dtype and strides but no values)."""
    block, _, _, min_numel, policy, min_bytes = s
    if x.dtype not in _SUPPORTED or x.layout != torch.strided or x.dim() == 0:
        return False
    n = x.numel()
    if not isinstance(n, int) or n < min_numel:
        return False  # a symbolic size is left alone: its blocks could not be checked
    # the int8 code reads short rows as whole blocks, as eagerly; the FP8 op gets its rows
    cols = _codes.block_cols(n, x.shape[-1], block) if s[1] == torch.int8 else x.shape[-1]
    if 1 + 4.0 / max(1, min(block, cols)) > 0.75 * x.element_size():
        return False
    span = 0
    for st, d in sorted((st, d) for st, d in zip(x.stride(), x.shape) if d > 1):
        if st <= span:
            return False  # an expanded (overlapping) view
        span += (d - 1) * st
    if policy == "size":
        return n * x.element_size() >= min_bytes
    if callable(policy):
        return bool(policy(x))
    return True  # "layers", "linear": the graph's intermediates are the layers' activations


def _statistic() -> bool:
    """Whether the tensor being saved is a later output of a multi-output op: attention's
    log-sum-exp, a norm's mean and reciprocal deviation. They stay exact, as eagerly (an
    exponent's FP8 error is multiplied, not added); the first output is the activation."""
    from torch._functorch._aot_autograd import graph_compile
    node = (graph_compile._get_saved_tensor_hook_context() or {}).get("_node")
    return (node is not None and node.op == "call_function" and node.target is operator.getitem
            and node.args[1] != 0)


# The settings of each hook pair, by the index its graph carries (a graph's arguments must be
# printable constants; a policy callable is not).
_SETTINGS = []
_HOOKS = {}


@torch.fx.wrap
def _pack(x, idx):
    if not _compiling():
        stack = getattr(_TLS, "stack", None)
        return stack[-1](x) if stack else x
    s = _SETTINGS[idx]
    if x.dtype == torch.bool and x.layout == torch.strided and isinstance(x.numel(), int) \
            and x.numel() >= s[3]:
        # a mask (ReLU's x > 0 the partitioner keeps, a dropout's): one bit per element, exact,
        # the bits eager mode stores (activations_recompute.pack_bits)
        return (_TAG_BITS, _rc.pack_bits(x), tuple(x.shape), tuple(x.stride()), x.numel())
    if _statistic() or not _worth_it(x, s):
        return x
    block, fp8_dtype, pow2 = s[:3]
    if fp8_dtype == torch.int8:  # torch ops: traced into the graph, fused by inductor
        q, scales = _codes.quantize(x.contiguous(), block, pow2)
    else:
        q, scales = ops.fp8_quantize(x.contiguous(), block_size=block, fp8_dtype=fp8_dtype,
                                     pow2_scale=pow2)
    # the layout is a constant of the graph: the backward was compiled for exactly it
    return (_TAG, q, scales, x.dtype, tuple(x.shape), tuple(x.stride()), x.is_contiguous(),
            block)


@torch.fx.wrap
def _unpack(p):
    if isinstance(p, torch.Tensor):
        return p
    if isinstance(p, tuple) and p and p[0] == _TAG_BITS:
        _, bits, shape, stride, numel = p
        out = _rc.unpack_bits(bits, numel).view(shape)
        if tuple(out.stride()) == stride:
            return out
        return torch.empty_strided(shape, stride, dtype=torch.bool,
                                   device=out.device).copy_(out)
    if not (isinstance(p, tuple) and p and p[0] == _TAG):
        return p.restore()  # what the eager pack made
    _, q, scales, dtype, shape, stride, contiguous, block = p
    if q.dtype == torch.int8:
        out = _codes.dequantize(q, scales, block, dtype, shape)
    else:
        out = ops.fp8_dequantize(q, scales, block_size=block, dtype=dtype)
    if tuple(out.stride()) == stride:
        return out
    if contiguous:  # the same addressing; only the strides of size-1 dims differ
        return out.as_strided(shape, stride)
    return torch.empty_strided(shape, stride, dtype=dtype, device=out.device).copy_(out)


def hooks(block_size: int, fp8_dtype: torch.dtype, pow2_scale: bool, min_numel: int,
          policy, min_bytes: int):
    """The (pack, unpack) GraphModules for these settings, one pair per settings for the
    process: dynamo guards on the hooks' identities, so a new pair per ``with`` would
    recompile every step."""
    key = (block_size, fp8_dtype, pow2_scale, min_numel, policy,
           min_bytes if policy == "size" else None)
    pair = _HOOKS.get(key)
    if pair is None:
        idx = len(_SETTINGS)
        _SETTINGS.append(key)

        def pack(x):
            return _pack(x, idx)

        def unpack(p):
            return _unpack(p)

        pair = _HOOKS[key] = (torch.fx.symbolic_trace(pack), torch.fx.symbolic_trace(unpack))
        for gm in pair:
            # Eager autograd calls a hook once per saved tensor and once per restore: straight
            # to the generated forward, what nn.Module's call machinery reaches ~1.7 us later
            # (no module hooks are ever registered on these). A GraphModule's class is its
            # own (GraphModule.__new__), so only these two change; AOTAutograd inlines their
            # graphs, and a call during its tracing runs the same forward.
            type(gm).__call__ = _call_forward
    return pair


def _call_forward(self, *args):
    return self.forward(*args)
