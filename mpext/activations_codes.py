"""The int8 block code of saved activations: one signed byte per element on a uniform grid of
255 levels, ``round(x / scale)`` with one float32 ``scale = absmax / 127`` per block of
``block`` elements along the rows of the tensor's row-major copy (``block_cols``: the rows
``fp8_quantize`` is given, so both codes cost the same bytes).

Why not E4M3: its 3 mantissa bits round every element to ~2^-4 of itself, and a weight gradient
formed from such inputs is off by ~3% where BF16-vs-FP32 is ~0.9% (3-4x, on every HF zoo model
and every linear layer, docs/activations.md). A uniform grid under the block's absmax has an
error of ~absmax/255/sqrt(3) per element, whatever the element's size, which is ~0.7% of a
Gaussian block's L2 norm: the same bytes (1 B + 4 B per block), under 1.5x BF16's gradient error
on every zoo parameter. What it gives up is the small elements of a block with an outlier (the
FP8 codes keep their relative precision): they round to a step of absmax/127.

The kernels are native ops beside ``fp8_quantize`` (``mpext.ops.int8_block_quantize`` /
``int8_block_dequantize``: one pass over memory each, every CPU ISA path and CUDA, fake kernels
for torch.compile), eagerly and inside compiled graphs alike: inductor's fusion of the torch-op
code they replaced made compiled training steps slower than the opaque ops do
(benchmarks/bench_act_codes.py --compiled). Their bits are that code's (tests/test_act_codes.py
keeps it as the reference), but for ``pow2``: that code's float32 ``log2`` rounded a scale just above a
power of two down to it, so the block's absmax coded as 127 lost up to ~16 float32 ulps; the
op rounds up exactly. NaN and Inf make their whole block non-finite on restore (the scale is NaN
or Inf), so a loss scaler still sees them.
"""
import torch

from . import ops

__all__ = ["quantize", "dequantize", "block_cols"]

QMAX = 127
MIN_SCALE = 2.0 ** -126  # as fp8_quantize: 1 / scale stays finite


def block_cols(numel: int, cols: int, block: int) -> int:
    """The row length a tensor of ``numel`` elements and last dimension ``cols`` is coded in:
    its own rows, or, when they are shorter than a block and the elements fill whole blocks,
    rows of one block (the row-major copy read as (numel / block, block)): a scale per 32-wide
    image row or 64-wide head would cost an eighth or a sixteenth of a byte per value, which
    alone keeps a copy above half its BF16 bytes. The same rows for every code, so that a
    tensor costs the same bytes in each (the memory calculator counts them so)."""
    if 0 < cols < block and numel % block == 0:
        return block
    return cols


def _rows(numel: int, shape, cols: int) -> int:
    if cols:
        return numel // cols
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows


def quantize(x: torch.Tensor, block: int, pow2: bool = False):
    """``(q, scales)``: ``x`` (any float dtype, contiguous, at least 1-d) as int8 codes of shape
    (rows, cols) (``block_cols``) and float32 scales of shape (rows, ceil(cols / block)): blocks
    of ``block`` elements along each row, the last one of a row possibly shorter."""
    cols = block_cols(x.numel(), x.shape[-1], block)
    rows = x.reshape(_rows(x.numel(), x.shape, cols), cols)
    return ops.int8_block_quantize(rows, block_size=block, pow2_scale=pow2)


def dequantize(q: torch.Tensor, scales: torch.Tensor, block: int, dtype: torch.dtype,
               shape) -> torch.Tensor:
    """The contiguous tensor of ``shape`` and ``dtype`` that ``quantize`` coded."""
    return ops.int8_block_dequantize(q, scales, block_size=block, dtype=dtype).view(shape)
