"""mpext.optim.formats: the state formats of mpext's optimizers, as objects with behaviour. The
one place a format is named: the optimizer (mpext.optim._base), its state code (_state), the
launch planner (_engine) and the shard exchange (_q8_shards) call a format's methods -- ``new``,
``encode`` / ``decode`` (its Python codec), ``keys``, ``op_args``, ``shard``, ``load`` /
``export`` -- and never ask which format they hold (tests/test_layout.py checks it). A user's
setting becomes a format once, in :func:`parse`. The codecs here are for conversions between
formats (``load_state_dict``, a group edited between steps) and the tests' references; the
kernels' codecs are the C core's, which these match bit for bit. docs/lean_state.md, "Format
objects", says how to add one.

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

from .._common import MIN_8BIT_NUMEL, Q8_BLOCK_MAX, Q8_BLOCK_MIN, dtype_name
from . import _q8_shards as q8_shards
from ._tensors import F32, copy_like, flat_view, fp32_copy, is_dtensor, local
from ._tensors import same_memory_order

__all__ = ["Quantity", "ParamFormat", "MasterFormat", "RemainderFormat", "MomentFormat",
           "BlockCodeFormat", "FP32_PARAM", "MASTER", "REMAINDER", "NEAREST", "STOCHASTIC",
           "FP32", "BF16", "Q8", "PARAM_FORMATS", "MOMENT_FORMATS", "parse", "param_format",
           "moment_format", "moment_dtype", "held", "fp32_value", "q8_decode", "q8_encode",
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
    remainder, exactly as the kernel joins them (mpext/step_common.h, mp_bf16_join)."""
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


# ---- 8-bit block code (docs/moments_8bit.md; the kernel's format is mpext/formats/q8.h's)

# (exponent bits, mantissa bits) of each code dtype: mpext/formats/q8.h's MP_Q8_{M,V}_{E,M}BITS
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


# ---- Param formats ---------------------------------------------------------------------------

class ParamFormat:
    """Where a param's FP32 value lives: ``key`` the state entry that holds it (None: none
    does), of ``dtype``, ``bytes_per_element`` beyond the param itself. The interface every
    param format implements (the optimizer never asks which one it holds): :meth:`keys`,
    :meth:`new`, :meth:`encode` / :meth:`decode` (the Python codec), :meth:`source`,
    :meth:`reset`, ``op_arg`` (the step op's list its entry goes in), :meth:`load` /
    :meth:`export` (checkpoints). This base class keeps nothing: the FP32 value is the param's
    own (an FP32 param) or kept nowhere (rounded to nearest or stochastically)."""
    __slots__ = ("name", "key", "dtype", "bytes_per_element", "op_arg", "reads_param")

    def __init__(self, name: str, key: Optional[str] = None, dtype: Optional[torch.dtype] = None,
                 bytes_per_element: int = 0, op_arg: Optional[str] = None,
                 reads_param: bool = False) -> None:
        self.name, self.key, self.dtype = name, key, dtype
        self.bytes_per_element = bytes_per_element
        # op_arg: the step op's argument its entry is passed in; reads_param: whether its
        # value is made from the param too (then a conversion away from it waits for the
        # model's state to be loaded)
        self.op_arg, self.reads_param = op_arg, reads_param

    def __repr__(self) -> str:
        return "mpext.optim.formats.ParamFormat(%r)" % self.name

    def keys(self) -> Tuple[str, ...]:
        """Its state keys."""
        return () if self.key is None else (self.key,)

    def decode(self, param: torch.Tensor, state: Dict[str, Any]) -> torch.Tensor:
        """The param's FP32 value, a new tensor placed as the param."""
        return fp32_copy(param)

    def encode(self, param: torch.Tensor, value: Optional[torch.Tensor],
               where: str) -> Optional[torch.Tensor]:
        """The state entry (``key``) that holds FP32 ``value`` (None: the param's own value)
        under this format, or None for a format that keeps none."""
        return None

    def new(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """Its entry for a param whose FP32 value is the param itself."""
        return self.encode(param, None, "")

    def source(self, param: torch.Tensor, state: Dict[str, Any]) -> torch.Tensor:
        """The FP32 value a conversion into another format starts from (the stored tensor
        itself where it is one: not copied)."""
        return self.decode(param, state)

    def reset(self, param: torch.Tensor, state: Dict[str, Any]) -> None:
        """Makes the held FP32 value the param's own, in place."""

    def load(self, param: torch.Tensor, t: torch.Tensor, where: str) -> torch.Tensor:
        """A saved entry (a tensor of the param's shape) checked and copied to the param."""
        raise NotImplementedError

    def export(self, param: torch.Tensor, state: Dict[str, Any], out: Dict[str, Any]) -> None:
        """Puts in ``out`` (a copy of a DTensor param's state_dict entry) its entry as saved,
        where that is not the state's tensor."""


class MasterFormat(ParamFormat):
    """An FP32 master copy (``master_param``, ``master_weights=True``)."""
    __slots__ = ()

    def decode(self, param: torch.Tensor, state: Dict[str, Any]) -> torch.Tensor:
        return fp32_copy(param, state[self.key])

    def encode(self, param: torch.Tensor, value: Optional[torch.Tensor],
               where: str) -> Optional[torch.Tensor]:
        return fp32_copy(param, value)

    def source(self, param: torch.Tensor, state: Dict[str, Any]) -> torch.Tensor:
        return state[self.key]

    def reset(self, param: torch.Tensor, state: Dict[str, Any]) -> None:
        state[self.key].copy_(param)

    def load(self, param: torch.Tensor, t: torch.Tensor, where: str) -> torch.Tensor:
        if not t.is_floating_point() or t.layout != torch.strided:
            raise TypeError("%s: %s must be a dense floating-point tensor, got %s %s"
                            % (where, self.key, t.layout, t.dtype))
        return copy_like(param, t, F32)


class RemainderFormat(ParamFormat):
    """The master's low 16 bits under its BF16 param (``param_remainder``, int16,
    ``param_remainders=True``): the param and its remainder are the master exactly."""
    __slots__ = ()

    def decode(self, param: torch.Tensor, state: Dict[str, Any]) -> torch.Tensor:
        return join_remainder(param, state[self.key])

    def encode(self, param: torch.Tensor, value: Optional[torch.Tensor],
               where: str) -> Optional[torch.Tensor]:
        """A remainder is exact only for a master the param is the round of; another is
        refused (``ValueError``)."""
        if value is None:  # the master is the param: its low half is zero
            return torch.zeros_like(param, dtype=self.dtype, memory_format=torch.preserve_format)
        return split_master(param, value, where)

    def reset(self, param: torch.Tensor, state: Dict[str, Any]) -> None:
        state[self.key].zero_()

    def load(self, param: torch.Tensor, t: torch.Tensor, where: str) -> torch.Tensor:
        # int32: what state_dict() gives for a DTensor param (collectives have no int16)
        if t.dtype not in (torch.int16, torch.int32) or t.layout != torch.strided:
            raise TypeError("%s: param_remainder must be a dense int16 tensor (or int32 "
                            "of int16 values), got %s %s" % (where, t.layout, t.dtype))
        if t.dtype is torch.int32 and t.numel() and not bool(
                ((t >= -2 ** 15) & (t < 2 ** 15)).all()):
            raise ValueError("%s: param_remainder is int32 with values outside int16's "
                             "range; it must hold int16 values" % where)
        if param.dtype != torch.bfloat16:
            raise ValueError("%s: it has a param_remainder but the param is %s; only a "
                             "bfloat16 param has one" % (where, dtype_name(param.dtype)))
        return copy_like(param, t, self.dtype)

    def export(self, param: torch.Tensor, state: Dict[str, Any], out: Dict[str, Any]) -> None:
        """An int32 DTensor of the same values (gloo and NCCL have no int16; any loader's
        cast back to int16 is exact)."""
        rem = state.get(self.key)
        if is_dtensor(rem):
            from torch.distributed.tensor import DTensor
            out[self.key] = DTensor.from_local(
                rem.to_local().to(torch.int32), rem.device_mesh, rem.placements,
                run_check=False, shape=rem.shape, stride=rem.stride())


FP32_PARAM = ParamFormat("fp32_param")
MASTER = MasterFormat("master", "master_param", F32, 4, op_arg="masters")
REMAINDER = RemainderFormat("remainder", "param_remainder", torch.int16, 2, op_arg="remainders",
                            reads_param=True)
NEAREST = ParamFormat("nearest")
STOCHASTIC = ParamFormat("stochastic")
PARAM_FORMATS = {f.name: f for f in (FP32_PARAM, MASTER, REMAINDER, NEAREST, STOCHASTIC)}
# The formats that keep the FP32 value in the state, and their entries' keys.
STORAGE_FORMATS = tuple(f for f in PARAM_FORMATS.values() if f.key is not None)
STORAGE_KEYS = tuple(f.key for f in STORAGE_FORMATS)
_STORAGE_OF_DTYPE = {f.dtype: f for f in STORAGE_FORMATS}

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
    for f in STORAGE_FORMATS:
        if f.key in state:
            return f
    return None


def stored_value(state: Dict[str, Any]) -> Optional[torch.Tensor]:
    """The state entry that holds a param's FP32 value (its master or remainder), or None."""
    for f in STORAGE_FORMATS:
        t = state.get(f.key)
        if t is not None:
            return t
    return None


def fp32_value(param: torch.Tensor, state: Dict[str, Any]) -> torch.Tensor:
    """A param's FP32 value as its state holds it (a new tensor): its master, the param joined
    with its remainder, or (none held) the param itself widened."""
    fmt = stored_param_format(state)
    return fp32_copy(param) if fmt is None else fmt.decode(param, state)


def launch_storage(storages: list, placeholder: Any) -> Dict[str, Optional[list]]:
    """The step op's lists of the params' stored FP32 values, by op argument (``masters``,
    ``remainders``): each param's entry in its format's list and ``placeholder(dtype)`` in the
    others; a list no param has an entry in is None. (A storage tensor's format is told by its
    dtype: the StepItem holds the tensor, as MixedPrecisionOptimizer's FP32 params make it.)"""
    cols: Dict[str, list] = {}
    n = len(storages)
    for i, t in enumerate(storages):
        if t is not None:
            fmt = _STORAGE_OF_DTYPE[t.dtype]
            col = cols.get(fmt.op_arg)
            if col is None:
                col = cols[fmt.op_arg] = [placeholder(fmt.dtype)] * n
            col[i] = t
    return {f.op_arg: cols.get(f.op_arg) for f in STORAGE_FORMATS}


# ---- Moment formats --------------------------------------------------------------------------
#
# A moment format is an object with behaviour: the optimizer, its state code and the launch
# planner call these methods and never ask which format they hold. ``quantity`` is a
# :class:`Quantity` (or, where only keys matter, its name); ``block`` the group's block_size.

class MomentFormat:
    """How a moment quantity is stored. The interface every moment format implements:

    * ``name``, its spellings (:meth:`accepts`), ``bytes_per_element`` (of its values or
      codes), ``meta`` (suffixes of its per-block metadata) and ``meta_bytes_per_block``;
      ``draws_bits``: whether storing rounds stochastically (by element position);
      ``together``: whether every moment of a rule must then be in it (one kernel launch
      codes all moments or none);
    * :meth:`keys` -- its state keys (checkpoint keys: never changed);
    * :meth:`new` -- zero state for a param; :meth:`encode` / :meth:`decode` -- the Python
      codec (from / to FP32), :meth:`store` / :meth:`value_of` -- the same on a param's state
      (DTensor params included); :meth:`conforms` -- whether a state already is in it;
    * :meth:`op_args` -- what the step op is passed for it; :meth:`shard` -- where its blocks
      lie for a sharded param (None: elementwise, nothing to share);
    * :meth:`load` / :meth:`export` -- a saved entry in, the state_dict's entries out.

    This base class is a value format: the quantity's values under its own name, of
    ``dtype``."""
    __slots__ = ("name", "dtype", "code", "meta", "bytes_per_element", "meta_bytes_per_block",
                 "draws_bits", "together", "checks_params", "_keys")

    def __init__(self, name: str, bytes_per_element: int, dtype: Optional[torch.dtype] = None,
                 code: Optional[str] = None, meta: Tuple[str, ...] = (),
                 meta_bytes_per_block: int = 0, draws_bits: bool = False,
                 together: bool = False) -> None:
        self.name, self.dtype, self.code, self.meta = name, dtype, code, meta
        self.bytes_per_element = bytes_per_element
        self.meta_bytes_per_block = meta_bytes_per_block
        self.draws_bits, self.together = draws_bits, together
        # whether check_param can refuse a param (the step's path skips it otherwise)
        self.checks_params = type(self).check_param is not MomentFormat.check_param
        self._keys: Dict[str, Tuple[str, ...]] = {}

    def __repr__(self) -> str:
        return "mpext.optim.formats.MomentFormat(%r)" % self.name

    # -- identity ------------------------------------------------------------------------------

    def keys(self, quantity: str) -> Tuple[str, ...]:
        """The state keys of ``quantity`` in this format: its name for values, else
        ``<quantity>_<code>`` and ``<quantity>_<code>_<meta>`` for each metadata."""
        keys = self._keys.get(quantity)
        if keys is None:
            if self.code is None:
                keys = (quantity,)
            else:
                coded = quantity + "_" + self.code
                keys = (coded,) + tuple(coded + "_" + m for m in self.meta)
            self._keys[quantity] = keys
        return keys

    def storage_dtype(self, quantity: Quantity) -> torch.dtype:
        """The dtype of the stored values or codes of ``quantity`` (what the groups keep)."""
        return self.dtype

    def storage_dtypes(self) -> Tuple[torch.dtype, ...]:
        """Every dtype its values or codes are stored in (each names this format alone)."""
        return (self.dtype,)

    def accepts(self, value: Any, quantity: Quantity) -> bool:
        """Whether a moment setting names this format: the object, its name, its storage
        dtype for the quantity or that dtype's name."""
        dt = self.storage_dtype(quantity)
        return value is self or value is dt or value == self.name or value == DTYPE_NAMES[dt]

    def for_param(self, param: torch.Tensor) -> "MomentFormat":
        """The format a param actually keeps in this one's place (itself)."""
        return self

    def holds(self, state: Dict[str, Any], quantity: str) -> bool:
        """Whether ``state`` holds ``quantity`` in this format."""
        t = state.get(quantity)
        return t is not None and t.dtype is self.dtype

    # -- values --------------------------------------------------------------------------------

    def new(self, param: torch.Tensor, quantity: Quantity, block: int) -> Dict[str, Any]:
        """Zero state of ``quantity`` for a param's first step, in the param's layout."""
        return {quantity.name: torch.zeros_like(param, dtype=self.dtype,
                                                memory_format=torch.preserve_format)}

    def decode(self, stored: torch.Tensor, meta: Optional[torch.Tensor]) -> torch.Tensor:
        """The FP32 values (exact) of a stored tensor of this format and its metadata."""
        return stored.to(F32)

    def encode(self, value: torch.Tensor, quantity: Quantity,
               block: int) -> Dict[str, torch.Tensor]:
        """The state entries of FP32 ``value`` in this format, rounded to nearest (even)."""
        return {quantity.name: value.to(self.dtype)}

    def value_of(self, param: torch.Tensor, state: Dict[str, Any], quantity: Quantity,
                 block: int, where: str) -> torch.Tensor:
        """The FP32 values (exact; placed as the param) of ``quantity`` held in this format."""
        return state[quantity.name].to(F32)

    def store(self, param: torch.Tensor, value: torch.Tensor, quantity: Quantity,
              block: int) -> Dict[str, Any]:
        """:meth:`encode` for a param's state (a DTensor value placed as the param)."""
        return self.encode(value, quantity, block)

    def conforms(self, param: torch.Tensor, state: Dict[str, Any], quantity: Quantity,
                 block: int, where: str) -> bool:
        """Whether ``state`` (which :meth:`holds` ``quantity`` in this format) needs no
        conversion for a group of block size ``block``."""
        return state[quantity.name].dtype is self.dtype

    # -- the step ------------------------------------------------------------------------------

    def check_param(self, param: torch.Tensor, where: str) -> None:
        """Refuses a param this format cannot be kept for (raises ``ValueError``)."""

    def op_args(self, state: Dict[str, Any], quantity: str) -> Tuple[torch.Tensor, dict]:
        """The step op's moment tensor of ``quantity`` and the keyword arguments (name ->
        this param's tensor) the format adds."""
        return local(state[quantity]), _NO_ARGS

    def shard(self, param: torch.Tensor, block: int) -> Optional[Any]:
        """Where a DTensor param's blocks lie, when the format has blocks that shards share
        (mpext.optim._q8_shards); None for an elementwise format."""
        return None

    def shard_keys(self, quantity: str) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
        """The state keys of ``quantity`` per element and per block (for :meth:`shard`)."""
        return (quantity,), ()

    # -- checkpoints ---------------------------------------------------------------------------

    def load(self, param: torch.Tensor, quantity: Quantity, t: torch.Tensor,
             saved: Dict[str, Any], block: int, where: str) -> Dict[str, Any]:
        """The state entries of a saved ``quantity`` held under its name (``t``, checked to be
        a tensor of the param's shape): values in their saved precision, BF16 kept, others
        made FP32 (conform_state converts them into the group's format)."""
        if not t.is_floating_point() or t.layout != torch.strided:
            raise TypeError("%s: %s must be a dense floating-point tensor, got %s %s"
                            % (where, quantity.name, t.layout, t.dtype))
        keep = t.dtype if t.dtype is BF16_DTYPE else F32
        return {quantity.name: copy_like(param, t, keep)}

    def export(self, param: torch.Tensor, state: Dict[str, Any], out: Dict[str, Any],
               quantity: Quantity, block: int, where: str) -> None:
        """Puts in ``out`` (a copy of a DTensor param's state_dict entry) the entries of
        ``quantity`` that are not saved as the state holds them."""


_NO_ARGS: Dict[str, torch.Tensor] = {}


class BlockCodeFormat(MomentFormat):
    """A moment stored as codes (``<quantity>_<code>``, the param's shape) with one float32
    absmax per block of ``block_size`` elements (``<quantity>_<code>_scale``): the 8-bit code
    (int8 for a signed quantity, uint8 otherwise). Params of fewer than ``MIN_8BIT_NUMEL``
    elements keep FP32. On a DTensor param the blocks lie on the whole param's index
    (mpext.optim._q8_shards)."""
    __slots__ = ("signed_dtype", "unsigned_dtype", "small")

    def __init__(self, name: str, code: str, signed_dtype: torch.dtype,
                 unsigned_dtype: torch.dtype, small: MomentFormat) -> None:
        super().__init__(name, 1, code=code, meta=("scale",), meta_bytes_per_block=4,
                         draws_bits=True, together=True)
        self.signed_dtype, self.unsigned_dtype, self.small = signed_dtype, unsigned_dtype, small

    def storage_dtype(self, quantity: Quantity) -> torch.dtype:
        return self.signed_dtype if quantity.signed else self.unsigned_dtype

    def storage_dtypes(self) -> Tuple[torch.dtype, ...]:
        return (self.signed_dtype, self.unsigned_dtype)

    def for_param(self, param: torch.Tensor) -> MomentFormat:
        return self.small if param.numel() < MIN_8BIT_NUMEL else self

    def holds(self, state: Dict[str, Any], quantity: str) -> bool:
        return self.keys(quantity)[0] in state

    def new(self, param: torch.Tensor, quantity: Quantity, block: int) -> Dict[str, Any]:
        code_key, scale_key = self.keys(quantity.name)
        return {code_key: torch.zeros_like(param, dtype=self.storage_dtype(quantity),
                                           memory_format=torch.preserve_format),
                scale_key: q8_shards.tag(torch.zeros(q8_shards.local_count(param, block),
                                                     dtype=F32, device=param.device), block)}

    def decode(self, stored: torch.Tensor, meta: Optional[torch.Tensor]) -> torch.Tensor:
        return q8_decode(stored, meta)

    def encode(self, value: torch.Tensor, quantity: Quantity,
               block: int) -> Dict[str, torch.Tensor]:
        codes, scale = q8_encode(value, self.storage_dtype(quantity), block)
        code_key, scale_key = self.keys(quantity.name)
        return {code_key: codes, scale_key: scale}

    def value_of(self, param: torch.Tensor, state: Dict[str, Any], quantity: Quantity,
                 block: int, where: str) -> torch.Tensor:
        code_key, scale_key = self.keys(quantity.name)
        t, scale = state[code_key], state[scale_key]
        if is_dtensor(param):  # a shard's scales are told apart by the block size they were
            had = q8_shards.block_of(param, scale, block, where)  # made for
            return q8_shards.decode_shard(param, t, scale, had, q8_decode)
        return q8_decode(t, scale)

    def store(self, param: torch.Tensor, value: torch.Tensor, quantity: Quantity,
              block: int) -> Dict[str, Any]:
        if is_dtensor(param):  # on the whole param's blocks (a collective)
            codes, scales = q8_shards.encode_whole(param, value, self.storage_dtype(quantity),
                                                   block, q8_encode)
            return dict(zip(self.keys(quantity.name), (codes, scales)))
        return self.encode(value, quantity, block)

    def conforms(self, param: torch.Tensor, state: Dict[str, Any], quantity: Quantity,
                 block: int, where: str) -> bool:
        code_key, scale_key = self.keys(quantity.name)
        scale = state[scale_key]
        if is_dtensor(param):  # (refuses scales of no block size first, as before)
            had = q8_shards.block_of(param, scale, block, where)
            return state[code_key].dtype is self.storage_dtype(quantity) and had == block
        # blocks of one size agree in number with the group's
        return state[code_key].dtype is self.storage_dtype(quantity) \
            and scale.numel() == q8_blocks(param.numel(), block)

    def check_param(self, param: torch.Tensor, where: str) -> None:
        if is_dtensor(param):
            why = q8_shards.unsupported(param)
            if why is not None:
                raise ValueError("%s: %s" % (where, why))

    def op_args(self, state: Dict[str, Any], quantity: str) -> Tuple[torch.Tensor, dict]:
        code_key, scale_key = self.keys(quantity)
        return local(state[code_key]), {_SCALES_ARG % quantity: state[scale_key]}

    def shard(self, param: torch.Tensor, block: int) -> Optional[Any]:
        return q8_shards.shard_blocks(param, block) if is_dtensor(param) else None

    def shard_keys(self, quantity: str) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
        code_key, scale_key = self.keys(quantity)
        return (code_key,), (scale_key,)

    def upgrade(self, saved: Dict[str, Any], quantity: Quantity) -> None:
        """Moves codes saved before coded state had keys of its own (under the quantity's
        name, with "<quantity>_scale") to this format's keys, in place."""
        t = saved.get(quantity.name)
        code_key, scale_key = self.keys(quantity.name)
        if isinstance(t, torch.Tensor) and t.dtype in self._codes() and code_key not in saved:
            saved[code_key] = saved.pop(quantity.name)
            if quantity.name + OLD_META_SUFFIX in saved:
                saved[scale_key] = saved.pop(quantity.name + OLD_META_SUFFIX)

    def _codes(self) -> Tuple[torch.dtype, torch.dtype]:
        return (self.signed_dtype, self.unsigned_dtype)

    def load(self, param: torch.Tensor, quantity: Quantity, t: torch.Tensor,
             saved: Dict[str, Any], block: int, where: str) -> Dict[str, Any]:
        """A loaded moment's codes and its scales, checked and copied to the param; or, for
        codes saved in another memory layout than the param's, or (a DTensor param) on blocks
        of another size than its group's, their fp32 values under the quantity's name (which
        conform_state codes again)."""
        name, skey = self.keys(quantity.name)
        dtype = self.storage_dtype(quantity)
        if t.dtype is not dtype or t.layout != torch.strided:
            raise TypeError("%s: %s holds 8-bit codes, which must be a dense %s tensor, got %s %s"
                            % (where, name, dtype, t.layout, t.dtype))
        sc = saved.get(skey)
        if is_dtensor(sc):  # a sharded run's checkpoint: every block's scale, replicated
            sc = sc.full_tensor()
        if not (isinstance(sc, torch.Tensor) and sc.dtype is F32 and sc.dim() == 1
                and q8_block_of(param.numel(), sc.numel()) is not None):
            raise ValueError("%s: %s holds 8-bit codes, so %s must be a 1-D float32 tensor of "
                             "one scale per block of the whole param (a power-of-two block "
                             "size in [%d, %d]), got %s"
                             % (where, name, skey, Q8_BLOCK_MIN, Q8_BLOCK_MAX,
                                tuple(sc.shape) if isinstance(sc, torch.Tensor) else sc))
        if is_dtensor(param):
            # Codes of a sharded or a single-process run: the blocks lie on the whole param's
            # index, so each rank takes its shard of the codes and the scales of the blocks it
            # touches, bit for bit; on blocks of another size they are decoded (exactly) and
            # coded again on the group's (conform_state).
            if q8_blocks(param.numel(), block) != sc.numel():  # (equal counts: same blocks)
                whole = t.full_tensor() if is_dtensor(t) else t
                return {quantity.name: copy_like(param, q8_decode(whole.detach(), sc.detach()),
                                                 F32)}
            return {name: copy_like(param, t, dtype),
                    skey: q8_shards.local_scales(param, sc, block)}
        if is_dtensor(t):
            t = t.full_tensor()
        t, sc = t.detach().to(param.device), sc.detach().to(device=param.device, copy=True)
        codes = torch.empty_like(param, dtype=t.dtype, memory_format=torch.preserve_format)
        if not same_memory_order(t, codes):
            # The blocks follow memory order: codes saved in another layout (channels_last vs
            # contiguous) group other elements, so they are decoded there (exactly), and
            # conform_state quantizes the values again in the param's layout if the group
            # keeps 8-bit moments.
            return {quantity.name: torch.empty_like(codes, dtype=F32).copy_(q8_decode(t, sc))}
        flat_view(codes).copy_(flat_view(t))
        return {name: codes, skey: sc}

    def export(self, param: torch.Tensor, state: Dict[str, Any], out: Dict[str, Any],
               quantity: Quantity, block: int, where: str) -> None:
        """The scales of a DTensor param, kept per shard, given whole (a Replicate DTensor of
        every block's scale: a collective over the shard group), so that DCP reshards them
        with the codes."""
        key = self.keys(quantity.name)[1]
        scales = state.get(key)
        if isinstance(scales, torch.Tensor) and not is_dtensor(scales):
            had = q8_shards.block_of(param, scales, block, where)
            out[key] = q8_shards.global_scales(param, scales, had)


_SCALES_ARG = "%s_scales"  # the step ops' keyword of a quantity's block scales

# Checkpoints written before coded state had keys of its own held the codes under the
# moment's name, with the scales under "<moment>_scale".
OLD_META_SUFFIX = "_scale"

FP32 = MomentFormat("float32", 4, dtype=F32)
BF16 = MomentFormat("bfloat16", 2, dtype=BF16_DTYPE, draws_bits=True)
Q8 = BlockCodeFormat("q8", "q8", torch.int8, torch.uint8, small=FP32)  # fp32 absmax per block
# The table: every moment format, by name. A new format is its object (and its C codec) and a
# row here (and in tests/optim_table.py); docs/lean_state.md, "Format objects". What follows
# is derived from it.
MOMENT_FORMATS = {f.name: f for f in (FP32, BF16, Q8)}
_CODED = tuple(f for f in MOMENT_FORMATS.values() if f.code is not None)
_VALUES = tuple(f for f in MOMENT_FORMATS.values() if f.code is None)
# The format each storage dtype belongs to (the groups keep dtypes).
FORMAT_OF_DTYPE = {dt: f for f in MOMENT_FORMATS.values() for dt in f.storage_dtypes()}
_VALUE_OF_DTYPE = {f.dtype: f for f in _VALUES}
# The names state_dict() gives the groups' dtypes (torch's gather of full state dicts takes no
# dtype objects), which load_state_dict and the groups take back.
DTYPE_NAMES = {dt: dtype_name(dt) for dt in FORMAT_OF_DTYPE}
_DTYPE_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}
# Kept as the fixed strings of the earlier suffix constants: "<quantity>_q8", "..._q8_scale".
CODE_SUFFIX, SCALE_SUFFIX = "_q8", "_q8_scale"
BLOCK_MIN, BLOCK_MAX = Q8_BLOCK_MIN, Q8_BLOCK_MAX


# ---- From a group's settings to formats ------------------------------------------------------

def moment_dtype(value: Any, quantity: Quantity) -> Any:
    """The torch dtype a moment setting names (a format object, its name, a dtype's name, or
    a dtype, returned as is); anything else is returned unchanged, for the caller to refuse."""
    if isinstance(value, str):
        fmt = MOMENT_FORMATS.get(value)
        if fmt is not None:
            return fmt.storage_dtype(quantity)
        return _DTYPE_BY_NAME.get(value, value)
    if isinstance(value, MomentFormat):
        return value.storage_dtype(quantity)
    return value


def parse(group: Dict[str, Any], moments: Tuple[Quantity, ...], owner: str,
          where: str) -> Tuple[MomentFormat, ...]:
    """The one mapping of a group's moment settings (a format object, its name, a torch dtype
    or a dtype's name) to formats: checks them (raises before anything is changed) and leaves
    each setting as the torch dtype the group keeps (what state_dict() names); returns the
    formats, in the order of ``moments``."""
    out, dtypes = [], []
    for q in moments:
        value = group.get(q.setting, F32)
        fmt = FP32 if value is F32 else next(
            (f for f in MOMENT_FORMATS.values() if f.accepts(value, q)), None)
        if fmt is None:
            raise ValueError("%s: %s must be %s, got %r%s"
                             % (owner, q.setting, _spellings(q), moment_dtype(value, q), where))
        dt = fmt.storage_dtype(q)
        if not isinstance(value, torch.dtype):
            # state_dict() names formats by string (torch's gather of full state dicts takes
            # no dtype objects); groups keep the dtype, whichever they were given.
            group[q.setting] = dt
        out.append(fmt)
        dtypes.append(dt)
    for fmt in set(f for f in out if f.together):
        if not all(f is fmt for f in out):  # one kernel launch codes all moments or none
            raise ValueError("%s: 8-bit moments come as a pair: %s, got %s%s"
                             % (owner, " with ".join("%s=%s" % (q.setting, fmt.storage_dtype(q))
                                                     for q in moments),
                                " and ".join(repr(dt) for dt in dtypes), where))
    block = group.get("block_size", 256)
    if not (isinstance(block, int) and not isinstance(block, bool)
            and BLOCK_MIN <= block <= BLOCK_MAX and block & (block - 1) == 0):
        raise ValueError("%s: block_size must be a power of two in [%d, %d], got %r%s"
                         % (owner, BLOCK_MIN, BLOCK_MAX, block, where))
    return tuple(out)


def _spellings(quantity: Quantity) -> str:
    """The moment formats' dtypes for ``quantity``, as a refusal names them."""
    names = ["torch.%s" % DTYPE_NAMES[f.storage_dtype(quantity)] for f in MOMENT_FORMATS.values()]
    return ", ".join(names[:-1]) + " or " + names[-1]


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
    if fmt is None:  # a setting parse() refuses
        return None, dt
    kept = fmt.for_param(param)
    return (fmt, dt) if kept is fmt else (kept, kept.storage_dtype(quantity))


def is_default(value: Any, quantity: Quantity) -> bool:
    """Whether a moment setting names the default format (FP32 values)."""
    return moment_dtype(value, quantity) is F32


def draws_bits(param: torch.Tensor, group: Dict[str, Any],
               moments: Tuple[Quantity, ...]) -> bool:
    """Whether storing any of a param's moments rounds stochastically (by element position)."""
    return any(moment_format(param, group, q)[0].draws_bits for q in moments)


def check_param(param: torch.Tensor, group: Dict[str, Any], moments: Tuple[Quantity, ...],
                where: str) -> None:
    """Refuses a param one of its moments' formats cannot be kept for."""
    for q in moments:
        fmt = moment_format(param, group, q)[0]
        if fmt.checks_params:
            fmt.check_param(param, where)


class Blocks(NamedTuple):
    """Where a DTensor param's blocked moments lie (mpext.optim._q8_shards.ShardBlocks) and
    their state keys: per element and per block."""
    layout: Any
    element_keys: Tuple[str, ...]
    block_keys: Tuple[str, ...]


def shard_layout(param: torch.Tensor, group: Dict[str, Any],
                 moments: Tuple[Quantity, ...]) -> Optional[Blocks]:
    """The :class:`Blocks` of a DTensor param whose moments have blocks shards share, or None
    (elementwise formats: each shard steps alone)."""
    layout, elements, blocks = None, (), ()
    for q in moments:
        fmt = moment_format(param, group, q)[0]
        lay = fmt.shard(param, group.get("block_size", 256))
        if lay is not None:
            layout = lay
            e, b = fmt.shard_keys(q.name)
            elements, blocks = elements + e, blocks + b
    return None if layout is None else Blocks(layout, elements, blocks)


# ---- A param's state, per moment --------------------------------------------------------------

_CODED_KEYS: Dict[str, tuple] = {}  # held()'s, per quantity: (coded format, its codes' key)


def held(state: Dict[str, Any], quantity: str) -> Optional[MomentFormat]:
    """The format a param's state holds ``quantity`` in (None: it holds none); values of a
    dtype no format stores (a torch checkpoint's) are read as FP32 values."""
    t = state.get(quantity)
    if t is not None:  # values (a state never holds a quantity in two formats)
        return _VALUE_OF_DTYPE.get(t.dtype, FP32)
    coded = _CODED_KEYS.get(quantity)
    if coded is None:  # (a coded format holds a quantity where its codes' key is)
        coded = _CODED_KEYS[quantity] = tuple((f, f.keys(quantity)[0]) for f in _CODED)
    for fmt, key in coded:
        if key in state:
            return fmt
    return None


def moment_of(state: Dict[str, Any], key: str) -> Tuple[Optional[torch.Tensor],
                                                        Optional[torch.Tensor]]:
    """A moment's stored tensor in a param's state and its blocks' scales (None for values)."""
    fmt = held(state, key)
    if fmt is None:
        return None, None
    keys = fmt.keys(key)
    return state[keys[0]], (state[keys[1]] if len(keys) > 1 else None)


def drop(state: Dict[str, Any], quantity: str) -> None:
    """Removes ``quantity`` from a state, in whichever format it is held."""
    for fmt in MOMENT_FORMATS.values():
        for k in fmt.keys(quantity):
            state.pop(k, None)


def saved_keys(quantity: str) -> Tuple[str, ...]:
    """Every state key of ``quantity`` that mpext writes or reads (older checkpoints' too)."""
    keys = tuple(k for fmt in MOMENT_FORMATS.values() for k in fmt.keys(quantity))
    return keys + (quantity + OLD_META_SUFFIX,)


def upgrade(saved: Dict[str, Any], moments: Tuple[Quantity, ...]) -> Dict[str, Any]:
    """A saved param state in the current key scheme (a new dict where anything moved)."""
    out = None
    for q in moments:
        for fmt in _CODED:
            t = saved.get(q.name)
            if isinstance(t, torch.Tensor) and t.dtype in fmt._codes():
                out = out or dict(saved)
                fmt.upgrade(out, q)
    return saved if out is None else out


def saved_entry(saved: Dict[str, Any], quantity: Quantity,
                where: str) -> Tuple[MomentFormat, str]:
    """The format and key a saved state holds ``quantity`` under: its values (under its
    name) or a coded format's codes; raises if it holds none, or more than one."""
    found = [(f, f.keys(quantity.name)[0]) for f in _CODED
             if f.keys(quantity.name)[0] in saved]
    if quantity.name in saved:
        if found:
            raise ValueError("%s has both %r and %r" % (where, quantity.name, found[0][1]))
        return FP32, quantity.name
    if not found:
        raise ValueError("%s has no %r (it has %s)" % (where, quantity.name, sorted(saved)))
    return found[0]


def launch_moments(states: list, quantities: Tuple[str, ...], nlists: int,
                   empty: torch.Tensor) -> Tuple[list, Dict[str, list]]:
    """The step op's moment lists (``nlists``, the op's; those past ``quantities`` empty) and
    the keyword arguments the formats add, for params with these states: a keyword some
    param's format adds gets a placeholder (``empty``) for every other param, and one none
    adds is left out (the op's default)."""
    lists: list = [[] for _ in range(nlists)]
    extra: Dict[str, list] = {}
    n = len(states)
    for j, name in enumerate(quantities):
        tensors = lists[j]
        for i, st in enumerate(states):
            fmt = held(st, name)
            if fmt is None:  # (refused by the op too, less clearly)
                raise RuntimeError("mpext.optim: a param's state has no %r, which its rule keeps "
                                   "with its group's settings now (a setting that adds a moment, "
                                   "e.g. SGD's momentum, changed after the param was stepped "
                                   "without it); its state has %s" % (name, sorted(st)))
            t, args = fmt.op_args(st, name)
            tensors.append(t)
            for kw, v in args.items():
                col = extra.get(kw)
                if col is None:
                    col = extra[kw] = [empty] * n
                col[i] = v
    return lists, extra
