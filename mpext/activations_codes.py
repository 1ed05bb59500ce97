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

Written in torch ops, so that AOTAutograd traces them into a compiled graph (inductor fuses each
into one pass) and every device runs them; eagerly they take several passes (docs: the step
time; a C kernel beside fp8_quantize is the way to the roofline). NaN and Inf make their whole
block non-finite on restore (the scale is NaN or Inf), so a loss scaler still sees them.
"""
import torch

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


def quantize(x: torch.Tensor, block: int, pow2: bool = False):
    """``(q, scales)``: ``x`` (any float dtype, contiguous, at least 1-d) as int8 codes of shape
    (rows, cols) (``block_cols``) and float32 scales of shape (rows, ceil(cols / block)): blocks
    of ``block`` elements along each row, the last one of a row possibly shorter."""
    cols = block_cols(x.numel(), x.shape[-1], block)
    rows = x.reshape(-1, cols)
    nb = -(-cols // block)
    pad = nb * block - cols
    if pad:  # zeros: they change no block's absmax
        rows = torch.nn.functional.pad(rows, (0, pad))
    # one float32 copy, divided in place: the only small tensor made is the scales kept (small
    # temporaries stay in the C heap's per-size caches, which an allocator meter counts)
    y = rows.reshape(-1, nb, block).to(torch.float32, copy=True)
    scales = y.abs().amax(-1, keepdim=True).div_(QMAX).clamp_min_(MIN_SCALE)
    if pow2:
        scales = torch.exp2(torch.ceil(torch.log2(scales)))
    sign = y.sign()
    q = y.div_(scales).round_().clamp_(-QMAX, QMAX)
    # a nonzero element never restores as zero: ReLU's backward reads its saved output as the
    # mask of where it passed (round to nearest blocked a CNN's gradients, 19% off where E4M3
    # is 1%); the sign stays too
    q = torch.where(q == 0, sign, q).to(torch.int8).view(-1, nb * block)
    if pad:
        q = q[:, :cols].contiguous()
    return q, scales.view(-1, nb)


def dequantize(q: torch.Tensor, scales: torch.Tensor, block: int, dtype: torch.dtype,
               shape) -> torch.Tensor:
    """The contiguous tensor of ``shape`` and ``dtype`` that ``quantize`` coded."""
    cols, nb = q.shape[-1], scales.shape[-1]
    pad = nb * block - cols
    if pad:
        q = torch.nn.functional.pad(q, (0, pad))
    q3, s = q.view(-1, nb, block), scales.view(-1, nb, 1)
    if dtype == torch.float16:  # a small scale would underflow in half
        out = (q3.float() * s).to(dtype)
    else:  # codes are exact in bfloat16; one rounding of the scale, one of the product
        out = q3.to(dtype) * s.to(dtype)
    out = out.view(-1, nb * block)
    if pad:  # a copy without the padding: the callers restore strides over dense memory
        out = out[:, :cols].contiguous()
    return out.view(shape)
