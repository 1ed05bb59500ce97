"""FP8 saved activations inside ``torch.compile``'d code, through AOTAutograd's inlined
saved-tensor hooks (torch >= 2.8's ``saved_tensors_hooks_are_inlineable``: pack and unpack given
as ``fx.GraphModule``s are traced into the compiled forward's epilogue and the compiled
backward's prologue).

The hooks are GraphModules of one call each, to a ``torch.fx.wrap``'d function: AOTAutograd
calls it on every saved tensor's fake value and traces what it does, so the decision (which
tensor, which layout) is plain Python at compile time and only the FP8 ops reach the graph.
AOTAutograd offers the hooks the graph's intermediates only ("donated" filtering, its default):
never a parameter, an input or an output, which stay alive anyway.
"""
import torch

from . import ops

__all__ = ["supported", "hooks"]

_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)
_TAG = "mpext_fp8"


def supported() -> bool:
    """Whether this torch inlines GraphModule saved-tensor hooks into compiled graphs."""
    try:
        from torch._functorch._aot_autograd import utils as aot_utils
        from torch._functorch._aot_autograd import graph_compile
    except ImportError:
        return False
    return (hasattr(aot_utils, "saved_tensors_hooks_are_inlineable")
            and hasattr(graph_compile, "maybe_inline_graph_saved_tensors_hooks"))


def _worth_it(x: torch.Tensor, block: int, min_numel: int, min_bytes: int) -> bool:
    """Whether the FP8 copy of ``x`` is a saving worth a kernel: the eager context's tests
    (floating, supported dtype, large enough, its blocks long enough to pay for their scales,
    no two elements at one address)."""
    if x.dtype not in _SUPPORTED or x.layout != torch.strided or x.dim() == 0:
        return False
    n = x.numel()
    if not isinstance(n, int) or n < min_numel or n * x.element_size() < min_bytes:
        return False  # a symbolic size is left alone: its blocks could not be checked
    cols = x.shape[-1]
    if 1 + 4.0 / max(1, min(block, cols)) > 0.75 * x.element_size():
        return False
    span = 0
    for st, s in sorted((st, s) for st, s in zip(x.stride(), x.shape) if s > 1):
        if st <= span:
            return False  # an expanded (overlapping) view
        span += (s - 1) * st
    return True


@torch.fx.wrap
def _pack(x, block, fp8_dtype, pow2, min_numel, min_bytes):
    if not _worth_it(x, block, min_numel, min_bytes):
        return x
    q, scales = ops.fp8_quantize(x.contiguous(), block_size=block, fp8_dtype=fp8_dtype,
                                 pow2_scale=pow2)
    # the layout is a constant of the graph: the backward was compiled for exactly it
    return (_TAG, q, scales, x.dtype, tuple(x.shape), tuple(x.stride()), x.is_contiguous(),
            block)


@torch.fx.wrap
def _unpack(p):
    if isinstance(p, torch.Tensor):
        return p
    _, q, scales, dtype, shape, stride, contiguous, block = p
    out = ops.fp8_dequantize(q, scales, block_size=block, dtype=dtype)
    if tuple(out.stride()) == stride:
        return out
    if contiguous:  # only the strides of size-1 dims differ
        return out.as_strided(shape, stride)
    return torch.empty_strided(shape, stride, dtype=dtype, device=out.device).copy_(out)


_HOOKS = {}


def hooks(block_size: int, fp8_dtype: torch.dtype, pow2_scale: bool, min_numel: int,
          min_bytes: int):
    """The (pack, unpack) GraphModules for these settings, one pair per settings for the
    process: dynamo guards on the hooks' identities, so a new pair per ``with`` would
    recompile every step."""
    key = (block_size, fp8_dtype, pow2_scale, min_numel, min_bytes)
    pair = _HOOKS.get(key)
    if pair is None:
        def pack(x):
            return _pack(x, block_size, fp8_dtype, pow2_scale, min_numel, min_bytes)

        def unpack(p):
            return _unpack(p)

        pair = _HOOKS[key] = (torch.fx.symbolic_trace(pack), torch.fx.symbolic_trace(unpack))
    return pair
