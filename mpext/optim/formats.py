"""mpext.optim.formats: the state formats of mpext's optimizers, as named objects, each with its
Python codec (decode to FP32, encode from FP32 with its rounding). This is the one place the
8-bit block code and the 16-bit remainder are written in Python -- for conversions between
formats (``load_state_dict``, a group edited between steps) and for the tests' references; the
kernels' codecs are the C core's (``mpext/adam_rule.h``), which these match bit for bit.

Two kinds of format, chosen per param group:

* **param formats** -- where a param's FP32 value lives (``param_format(param, group)``):

  ==================  =========================================================  ==========
  name                what the state holds                                       bytes/elem
  ==================  =========================================================  ==========
  ``"fp32_param"``    nothing: an FP32 param is its own FP32 value               0
  ``"master"``        ``master_param``, an FP32 copy (``master_weights=True``)   4
  ``"remainder"``     ``param_remainder``, int16: the master's low 16 bits under 2
                      its BF16 param (``param_remainders=True``)
  ``"nearest"``       nothing; each update is rounded to nearest even            0
                      (``master_weights=False``)
  ``"stochastic"``    nothing; each update is rounded stochastically             0
                      (``master_weights=False, stochastic_rounding=True``)
  ==================  =========================================================  ==========

* **moment formats** -- how each moment quantity (``exp_avg``, ``exp_avg_sq``) is stored, given
  as ``exp_avg_dtype`` / ``exp_avg_sq_dtype``:

  ==============  ==================================================================  ==========
  name            stored as                                                           bytes/elem
  ==============  ==================================================================  ==========
  ``"float32"``   ``<quantity>``, float32 values                                      4
  ``"bfloat16"``  ``<quantity>``, bfloat16 values (rounded per ``moment_rounding``)   2
  ``"q8"``        ``<quantity>_q8``: 8-bit codes (int8 for a signed quantity, uint8    1 + 4/block
                  otherwise) and ``<quantity>_q8_scale``: one float32 absmax per
                  block of ``block_size`` elements
  ==============  ==================================================================  ==========

  A moment setting takes a format object (``FP32``, ``BF16``, ``Q8``), its name, or, as before,
  a torch dtype or its name (``torch.float32`` / ``"float32"``, ``torch.bfloat16`` /
  ``"bfloat16"``, ``torch.int8`` / ``"int8"`` for ``exp_avg`` and ``torch.uint8`` /
  ``"uint8"`` for ``exp_avg_sq``); the param groups keep the torch dtype
  (:func:`moment_dtype`), and ``state_dict()`` names it by the dtype's name, so checkpoints
  load in older mpext versions too.

The state keys follow docs/lean_state.md, "State keys": torch's names hold values only; a
coded quantity is stored under ``<quantity>_<code>`` and its metadata under
``<quantity>_<code>_<meta>`` (:meth:`MomentFormat.keys`).
"""
import math
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch

from .._common import MIN_8BIT_NUMEL, Q8_BLOCK_MAX, Q8_BLOCK_MIN
from ._tensors import F32, flat_view, fp32_copy, local

__all__ = ["Quantity", "ParamFormat", "MomentFormat", "FP32_PARAM", "MASTER", "REMAINDER",
           "NEAREST", "STOCHASTIC", "FP32", "BF16", "Q8", "PARAM_FORMATS", "MOMENT_FORMATS",
           "param_format", "moment_format", "moment_dtype", "q8_decode", "q8_encode",
           "join_remainder", "split_master", "MIN_8BIT_NUMEL"]

BF16_DTYPE = torch.bfloat16


class Quantity(NamedTuple):
    """A moment a rule keeps per param: its state name, the group setting that picks its
    format, and whether it takes negative values (which 8-bit code it gets)."""
    name: str
    setting: str
    signed: bool


# ---- 16-bit remainders (the kernel's mp_bf16_join / mp_bf16_remainder) ----------------------

def _u32(t: torch.Tensor) -> torch.Tensor:
    """The bits of a float32 tensor as int64 values in [0, 2^32)."""
    return t.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def join_remainder(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master of a bf16 param and its int16 remainder: (param bits << 16) +
    remainder, exactly as the kernel joins them (mpext/adam_rule.h, mp_bf16_join)."""
    out = torch.empty_like(param, dtype=F32, memory_format=torch.preserve_format)
    p, r = local(param).detach(), local(remainder)
    bits = (((p.view(torch.int16).to(torch.int64) & 0xFFFF) << 16) + r.to(torch.int64))
    bits = bits & 0xFFFFFFFF
    local(out).copy_(torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32)
                     .view(F32))
    return out


def split_master(param: torch.Tensor, master: torch.Tensor, where: str) -> torch.Tensor:
    """The int16 remainder of an fp32 master under its bf16 param, as the kernel stores it
    (mp_bf16_master_bits, mp_bf16_remainder): a master halfway above an even bf16 value is one
    ulp lower first. The param must be the master's round to nearest even; otherwise the master
    belongs to other weights (e.g. the model's state is not loaded yet) and it is refused."""
    p, m = local(param).detach(), local(master).detach()
    x = _u32(m)
    finite = (x & 0x7F800000) != 0x7F800000
    x = x - (((x & 0x1FFFF) == 0x8000) & finite).to(torch.int64)
    nudged = torch.where(x >= 2 ** 31, x - 2 ** 32, x).to(torch.int32).view(F32)
    rounded = nudged.to(torch.bfloat16)
    same = (rounded.view(torch.int16) == p.view(torch.int16)) | (rounded.isnan() & p.isnan())
    if not bool(same.all()):
        bad = int((~same).sum())
        raise ValueError("%s: its master_param does not round to the param's current value at "
                         "%d of %d elements, so it cannot become a param_remainder; load the "
                         "model's state before the optimizer's (or call reset_masters() to "
                         "start the masters from the params)" % (where, bad, same.numel()))
    pbits = (p.view(torch.int16).to(torch.int64) & 0xFFFF) << 16
    rem = (x - pbits) & 0xFFFF
    rem = torch.where(rem >= 2 ** 15, rem - 2 ** 16, rem).to(torch.int16)
    out = torch.empty_like(param, dtype=torch.int16, memory_format=torch.preserve_format)
    local(out).copy_(rem)
    return out


# ---- 8-bit block code (docs/moments_8bit.md; the kernel's format is mpext/adam.h's) ----------

# (exponent bits, mantissa bits) of each code dtype: adam_rule.h's MP_Q8_{M,V}_{E,M}BITS
_Q8_LAYOUT = {torch.int8: (3, 4), torch.uint8: (4, 4)}
_Q8_TABLES: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}


def q8_blocks(n: int, block: int) -> int:
    """The number of blocks of ``block`` elements that cover n elements."""
    return -(-n // block)


def q8_block_of(n: int, nblocks: int) -> Optional[int]:
    """The block size of n elements in nblocks blocks: with power-of-two sizes only one gives
    more than one block, and any size >= n gives one (then n itself). None if none fits."""
    if nblocks == 1 and n >= 1:
        return max(n, 1)
    b = Q8_BLOCK_MIN
    while b <= Q8_BLOCK_MAX:
        if q8_blocks(n, b) == nblocks:
            return b
        b *= 2
    return None


def _q8_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every magnitude code's value relative to its block's reference, by its definition
    (float64, increasing with the code): 2^(e-T) (1 + f/2^M), or 2^(1-T) f/2^M for e = 0."""
    key = (dtype, device)
    if key not in _Q8_TABLES:
        ebits, mbits = _Q8_LAYOUT[dtype]
        t = (1 << ebits) - 1
        vals = [math.ldexp(1 + f / 2 ** mbits, e - t) if e else math.ldexp(f / 2 ** mbits, 1 - t)
                for e in range(1 << ebits) for f in range(1 << mbits)]
        _Q8_TABLES[key] = torch.tensor(vals, dtype=torch.float64, device=device)
    return _Q8_TABLES[key]


def _q8_ref(amax_bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each block's reference 2^(E - 127) (float64; NaN for a block that is not finite) from
    the bits of its absmax (int64): E its exponent field rounded up to the code's precision, at
    least 2^ebits."""
    ebits, mbits = _Q8_LAYOUT[dtype]
    e = ((amax_bits + (1 << (23 - mbits)) - 1) >> 23).clamp_min(1 << ebits)
    return torch.where(e >= 255, torch.full_like(e, math.nan, dtype=torch.float64),
                       torch.pow(2.0, (e.clamp_max(254) - 127).double()))


def _f32_bits(t: torch.Tensor) -> torch.Tensor:
    """The magnitude bits of a float32 tensor, as int64."""
    return t.contiguous().view(torch.int32).to(torch.int64) & 0x7FFFFFFF


def q8_decode(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values of 8-bit moment codes (int8: exp_avg, uint8: exp_avg_sq) with their
    blocks' scales, in the codes' shape and layout: exact, as the kernel decodes them."""
    flat = flat_view(codes)
    n = flat.numel()
    block = q8_block_of(n, scale.numel())
    c = flat.view(torch.uint8).to(torch.int64)
    signed = codes.dtype is torch.int8
    table = _q8_table(codes.dtype, codes.device)
    ref = _q8_ref(_f32_bits(scale.float()), codes.dtype)
    val = table[c & 0x7F if signed else c] * ref.repeat_interleave(block)[:n]
    if signed:
        val = torch.where(c >= 128, -val, val)
    out = torch.empty_like(codes, dtype=F32, memory_format=torch.preserve_format)
    flat_view(out).copy_(val)
    return out


def q8_encode(x: torch.Tensor, dtype: torch.dtype, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The 8-bit codes (``dtype`` int8 for exp_avg, uint8 for exp_avg_sq; x's shape and layout)
    and blocks' scales (their absmax) of float32 values x, each rounded to the nearest code
    (ties to the even code): what the kernel writes with moment_rounding="nearest". A block
    that is not finite gets code 0 (it decodes to NaN whatever its codes)."""
    flat = flat_view(x.float())
    n = flat.numel()
    nb = q8_blocks(n, block)
    bits = _f32_bits(flat)
    amax = torch.zeros(nb * block, dtype=torch.int64, device=x.device)
    amax[:n] = bits
    amax = amax.view(nb, block).amax(1) if n else amax.view(0)
    scale = amax.to(torch.int32).view(F32)
    table = _q8_table(dtype, x.device)
    y = flat.double().abs() / _q8_ref(amax, dtype).repeat_interleave(block)[:n]
    lo = (torch.searchsorted(table, y.nan_to_num(0.0), right=True) - 1).clamp(0, len(table) - 1)
    hi = (lo + 1).clamp_max(len(table) - 1)
    d_lo, d_hi = y - table[lo], table[hi] - y
    up = (hi > lo) & ((d_hi < d_lo) | ((d_hi == d_lo) & (lo % 2 == 1)))
    code = torch.where(y.isnan(), torch.zeros_like(lo), torch.where(up, hi, lo))
    if dtype is torch.int8:  # the sign bit, -0.0's included, as the kernel keeps it
        code = code | ((flat.contiguous().view(torch.int32) < 0).long() << 7)
    out = torch.empty_like(x, dtype=dtype, memory_format=torch.preserve_format)
    flat_view(out).view(torch.uint8).copy_(code)
    return out, scale


# ---- The formats -----------------------------------------------------------------------------

class ParamFormat:
    """Where a param's FP32 value lives: ``key`` the state entry that holds it (None: none
    does), of ``dtype``, ``bytes_per_element`` beyond the param itself."""
    __slots__ = ("name", "key", "dtype", "bytes_per_element")

    def __init__(self, name: str, key: Optional[str], dtype: Optional[torch.dtype],
                 bytes_per_element: int) -> None:
        self.name, self.key, self.dtype = name, key, dtype
        self.bytes_per_element = bytes_per_element

    def __repr__(self) -> str:
        return "mpext.optim.formats.ParamFormat(%r)" % self.name

    def decode(self, param: torch.Tensor, state: Dict[str, Any]) -> torch.Tensor:
        """The param's FP32 value, a new tensor placed as the param: its master, the param
        joined with its remainder, or the param itself widened."""
        if self is MASTER:
            return fp32_copy(param, state["master_param"])
        if self is REMAINDER:
            return join_remainder(param, state["param_remainder"])
        return fp32_copy(param)

    def encode(self, param: torch.Tensor, value: Optional[torch.Tensor],
               where: str) -> Optional[torch.Tensor]:
        """The state entry (``key``) that holds FP32 ``value`` (None: the param's own value)
        under this format, or None for a format that keeps none. A remainder is exact only
        for a master the param is the round of; another is refused (``ValueError``)."""
        if self is MASTER:
            return fp32_copy(param, value)
        if self is REMAINDER:
            if value is None:  # the master is the param: its low half is zero
                return torch.zeros_like(param, dtype=torch.int16,
                                        memory_format=torch.preserve_format)
            return split_master(param, value, where)
        return None


FP32_PARAM = ParamFormat("fp32_param", None, None, 0)
MASTER = ParamFormat("master", "master_param", F32, 4)
REMAINDER = ParamFormat("remainder", "param_remainder", torch.int16, 2)
NEAREST = ParamFormat("nearest", None, None, 0)
STOCHASTIC = ParamFormat("stochastic", None, None, 0)
PARAM_FORMATS = {f.name: f for f in (FP32_PARAM, MASTER, REMAINDER, NEAREST, STOCHASTIC)}
# The state entries that hold a param's FP32 value, one per format that keeps one.
STORAGE_KEYS = tuple(f.key for f in PARAM_FORMATS.values() if f.key is not None)

FP16_REMAINDER = ("%s is float16, and param_remainders=True needs bfloat16 params (a "
                  "float16 value is not the high half of an fp32 one); give float16 params a "
                  "group with param_remainders=False, or master_weights=False with "
                  "stochastic_rounding=True")


def param_format(param: torch.Tensor, group: Dict[str, Any], where: str = "") -> ParamFormat:
    """The param format of ``param`` under its group's settings (a group without mpext's keys,
    torch's, keeps masters). A float16 param with ``param_remainders`` is refused."""
    if param.dtype is F32:
        return FP32_PARAM
    if not group.get("master_weights", True):
        return STOCHASTIC if group.get("stochastic_rounding", False) else NEAREST
    if group.get("param_remainders", False):
        if param.dtype is not torch.bfloat16:  # changed in place after construction
            raise ValueError(FP16_REMAINDER % where)
        return REMAINDER
    return MASTER


def stored_param_format(state: Dict[str, Any]) -> Optional[ParamFormat]:
    """The param format a state holds the FP32 value in (MASTER, REMAINDER), or None when it
    holds none (the value is the param's own)."""
    if "master_param" in state:
        return MASTER
    if "param_remainder" in state:
        return REMAINDER
    return None


class MomentFormat:
    """How a moment quantity is stored: ``code`` None for values under the quantity's own
    name (of ``dtype``), else the code's suffix, with ``meta`` the suffixes of its metadata;
    ``bytes_per_element`` of the values or codes (metadata aside), ``meta_bytes_per_block``
    of each metadata entry per block of ``block_size`` elements (0: no blocks)."""
    __slots__ = ("name", "dtype", "code", "meta", "bytes_per_element", "meta_bytes_per_block")

    def __init__(self, name: str, bytes_per_element: int, dtype: Optional[torch.dtype] = None,
                 code: Optional[str] = None, meta: Tuple[str, ...] = (),
                 meta_bytes_per_block: int = 0) -> None:
        self.name, self.dtype, self.code, self.meta = name, dtype, code, meta
        self.bytes_per_element = bytes_per_element
        self.meta_bytes_per_block = meta_bytes_per_block

    def __repr__(self) -> str:
        return "mpext.optim.formats.MomentFormat(%r)" % self.name

    def keys(self, quantity: str) -> Tuple[str, ...]:
        """The state keys of ``quantity`` in this format: its name for values, else
        ``<quantity>_<code>`` and ``<quantity>_<code>_<meta>`` for each metadata."""
        if self.code is None:
            return (quantity,)
        coded = quantity + "_" + self.code
        return (coded,) + tuple(coded + "_" + m for m in self.meta)

    def storage_dtype(self, quantity: Quantity) -> torch.dtype:
        """The dtype of the stored values or codes of ``quantity``."""
        if self.dtype is not None:
            return self.dtype
        return torch.int8 if quantity.signed else torch.uint8

    def decode(self, stored: torch.Tensor, meta: Optional[torch.Tensor]) -> torch.Tensor:
        """The FP32 values (exact) of a stored tensor of this format and its metadata."""
        if self.code is None:
            return stored.to(F32)
        return q8_decode(stored, meta)

    def encode(self, value: torch.Tensor, quantity: Quantity,
               block: int) -> Dict[str, torch.Tensor]:
        """The state entries of FP32 ``value`` in this format, rounded to nearest (even)."""
        if self.code is None:
            return {quantity.name: value.to(self.dtype)}
        codes, scale = q8_encode(value, self.storage_dtype(quantity), block)
        code_key, scale_key = self.keys(quantity.name)
        return {code_key: codes, scale_key: scale}


FP32 = MomentFormat("float32", 4, dtype=F32)
BF16 = MomentFormat("bfloat16", 2, dtype=BF16_DTYPE)
Q8 = MomentFormat("q8", 1, code="q8", meta=("scale",), meta_bytes_per_block=4)  # fp32 absmax
MOMENT_FORMATS = {f.name: f for f in (FP32, BF16, Q8)}
# The format each storage dtype belongs to (the groups keep dtypes).
FORMAT_OF_DTYPE = {F32: FP32, BF16_DTYPE: BF16, torch.int8: Q8, torch.uint8: Q8}
# The names state_dict() gives the groups' dtypes (torch's gather of full state dicts takes no
# dtype objects), which load_state_dict and the groups take back.
DTYPE_NAMES = {F32: "float32", BF16_DTYPE: "bfloat16", torch.int8: "int8", torch.uint8: "uint8"}
_DTYPE_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}
# Kept as the fixed strings of the earlier suffix constants: "<quantity>_q8", "..._q8_scale".
CODE_SUFFIX, SCALE_SUFFIX = "_q8", "_q8_scale"


def moment_dtype(value: Any, quantity: Quantity) -> Any:
    """The torch dtype a moment setting names (a format object, its name, a dtype's name, or
    a dtype, returned as is); anything else is returned unchanged, for the caller to refuse."""
    if isinstance(value, str):
        if value == Q8.name:
            return Q8.storage_dtype(quantity)
        return _DTYPE_BY_NAME.get(value, value)
    if isinstance(value, MomentFormat):
        return value.storage_dtype(quantity)
    return value


def moment_format(param: torch.Tensor, group: Dict[str, Any],
                  quantity: Quantity) -> Tuple[MomentFormat, torch.dtype]:
    """The moment format (and its storage dtype) a param's ``quantity`` is kept in: its
    group's, but FP32 instead of 8-bit codes for a param of fewer than MIN_8BIT_NUMEL
    elements."""
    dt = group.get(quantity.setting, F32)
    if dt is F32:  # the common case first: this runs for every moment at every step
        return FP32, F32
    if not isinstance(dt, torch.dtype):  # a group edited by name that no check has seen yet
        dt = moment_dtype(dt, quantity)
    fmt = FORMAT_OF_DTYPE.get(dt)
    if fmt is Q8 and param.numel() < MIN_8BIT_NUMEL:
        return FP32, F32
    return fmt, dt


def moment_of(state: Dict[str, Any], key: str) -> Tuple[Optional[torch.Tensor],
                                                        Optional[torch.Tensor]]:
    """A moment's stored tensor in a param's state and, for 8-bit codes, its blocks' scales
    (None for values)."""
    codes = state.get(key + CODE_SUFFIX)
    if codes is not None:
        return codes, state.get(key + SCALE_SUFFIX)
    return state.get(key), None
