"""A param's optimizer state: its creation, its conversion into its group's formats
(:func:`conform_state`), and the import of a saved state (:func:`import_param_state`). Every
conversion goes through the formats' one decode / encode pair (mpext.optim.formats).

Shared with ``mpext.mixed_precision`` (whose fused path keeps an inner optimizer's state):
:func:`new_moments` and :func:`conform_state`. ``moments`` is always the rule's tuple of
:class:`~mpext.optim.formats.Quantity` (``Adam.moments``).
"""
from typing import Any, Dict, Optional, Tuple

import torch

from .._common import LOW_DTYPES, Q8_BLOCK_MAX, Q8_BLOCK_MIN
from .._common import dtype_name, is_real
from . import _q8_shards as q8_shards
from . import formats as F
from ._tensors import F32, copy_like, flat_view, is_dtensor, same_memory_order
# Names of the step's path (conform_state runs for every param at every step), bound here.
from .formats import STORAGE_KEYS, moment_format, moment_of, param_format, q8_blocks

Moments = Tuple[F.Quantity, ...]


def check_q8_param(param: torch.Tensor, group: Dict[str, Any], moments: Moments,
                   where: str) -> None:
    """8-bit moments of a DTensor param lie on its whole index (mpext.optim._q8_shards), which
    needs shards that are runs of the whole param split along one mesh dimension."""
    if is_dtensor(param) and any(F.moment_format(param, group, q)[0] is F.Q8 for q in moments):
        why = q8_shards.unsupported(param)
        if why is not None:
            raise ValueError("%s: %s" % (where, why))


def new_moments(param: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any],
                moments: Moments) -> None:
    """Zero moments for a param's first step in its group's formats: in the param's layout,
    with zero scales for 8-bit codes (which decode to zero)."""
    for q in moments:
        fmt, dt = F.moment_format(param, group, q)
        zeros = torch.zeros_like(param, dtype=dt, memory_format=torch.preserve_format)
        if fmt is F.Q8:
            block = group.get("block_size", 256)
            code_key, scale_key = fmt.keys(q.name)
            state[code_key] = zeros
            state[scale_key] = q8_shards.tag(torch.zeros(
                q8_shards.local_count(param, block), dtype=F32, device=param.device), block)
        else:
            state[q.name] = zeros


def conform_state(param: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any],
                  moments: Moments, where: str, storage: bool = True) -> None:
    """Converts a param's state in place into its group's formats: each moment that is in
    another format is decoded (exactly) and encoded in the group's (to nearest even when
    narrowed; to the nearest code with the group's block size), the FP32 value into the group's
    param format (a master from a remainder and the param, a remainder from a master whose
    round is the param, a new master or a zero remainder from the param itself, nothing
    without a master). The one conversion of optimizer state, for a group changed between steps
    and for load_state_dict (which converts the moments only, ``storage=False``: the rest reads
    the param)."""
    check_q8_param(param, group, moments, where)
    block = group.get("block_size", 256)
    for q in moments:
        fmt, dtype = moment_format(param, group, q)
        t, scale = moment_of(state, q.name)
        if t is None:
            continue
        sharded = is_dtensor(param)
        if scale is not None:
            if sharded:  # a shard's scales are told apart by the block size they were made for
                had = q8_shards.block_of(param, scale, block, where)
                if t.dtype is dtype and had == block:
                    continue
                value = q8_shards.decode_shard(param, t, scale, had)
            elif t.dtype is dtype and scale.numel() == q8_blocks(param.numel(), block):
                continue  # the group's form already (blocks of one size agree in number)
            else:
                value = F.Q8.decode(t, scale)
        elif t.dtype is dtype:
            continue
        else:
            value = F.FORMAT_OF_DTYPE.get(t.dtype, F.FP32).decode(t, None)
        for fm in F.MOMENT_FORMATS.values():
            for k in fm.keys(q.name):
                state.pop(k, None)
        if fmt is F.Q8 and sharded:  # on the whole param's blocks (a collective)
            codes, scales = q8_shards.encode_whole(param, value, dtype, block)
            state.update(zip(fmt.keys(q.name), (codes, scales)))
        else:
            state.update(fmt.encode(value, q, block))
    if not storage:
        return
    want = param_format(param, group, where)
    # What the EMA starts from: the group's storage, or the param itself when there is none or
    # it was made from the param just now (the same value, without reading it back).
    source = want if want.key is not None else None
    if want.key is not None and want.key not in state:
        have = F.stored_param_format(state)
        # A master is used as it is (not copied) to split it into a remainder.
        value = None if have is None else (state["master_param"] if have is F.MASTER
                                           else have.decode(param, state))
        state[want.key] = want.encode(param, value, where)
        if have is None:
            source = None
    for key in STORAGE_KEYS:
        if key != want.key:
            state.pop(key, None)
    if group.get("ema_decay") is None:
        state.pop("ema_param", None)
    elif "ema_param" not in state:  # from the fp32 value now (a first step copies it anyway)
        state["ema_param"] = (source or F.FP32_PARAM).decode(param, state)


# ---- Importing a saved state ---------------------------------------------------------------

# Checkpoints written before coded state had keys of its own held the codes under the
# moment's name, with the scales under "<moment>_scale".
_OLD_SCALE_SUFFIX = "_scale"


def known_keys(moments: Moments) -> Tuple[str, ...]:
    """The state keys mpext writes or reads for a rule with these moments."""
    keys = ("step", "ema_param") + F.STORAGE_KEYS
    for q in moments:
        keys += tuple(k for fmt in F.MOMENT_FORMATS.values() for k in fmt.keys(q.name))
        keys += (q.name + _OLD_SCALE_SUFFIX,)
    return keys


def upgrade_keys(value: Dict[str, Any], moments: Moments) -> Dict[str, Any]:
    """A saved param state in the current key scheme: 8-bit codes saved under a moment's own
    name (with "<moment>_scale") move to "<moment>_q8" / "<moment>_q8_scale"."""
    codes = (torch.int8, torch.uint8)
    if not any(isinstance(value.get(q.name), torch.Tensor) and value[q.name].dtype in codes
               for q in moments):
        return value
    value = dict(value)
    for q in moments:
        t = value.get(q.name)
        code_key, scale_key = F.Q8.keys(q.name)
        if isinstance(t, torch.Tensor) and t.dtype in codes and code_key not in value:
            value[code_key] = value.pop(q.name)
            if q.name + _OLD_SCALE_SUFFIX in value:
                value[scale_key] = value.pop(q.name + _OLD_SCALE_SUFFIX)
    return value


def _keep_unknown_keys(out: Dict[str, Any], value: Dict[str, Any],
                       moments: Moments) -> Dict[str, Any]:
    """A loaded param state with the saved entries mpext does not know kept as torch keeps
    them."""
    known = known_keys(moments)
    for name, v in value.items():
        if name not in known:
            out[name] = v
    return out


def _import_codes(param: torch.Tensor, q: F.Quantity, t: torch.Tensor, value: Dict[str, Any],
                  block: int, where: str) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A loaded moment's 8-bit codes and its scales, checked and copied to the param; or, for
    codes saved in another memory layout than the param's, or (a DTensor param) on blocks of
    another size than its group's, their fp32 values and None."""
    name, skey = F.Q8.keys(q.name)
    dtype = F.Q8.storage_dtype(q)
    if t.dtype is not dtype or t.layout != torch.strided:
        raise TypeError("%s: %s holds 8-bit codes, which must be a dense %s tensor, got %s %s"
                        % (where, name, dtype, t.layout, t.dtype))
    sc = value.get(skey)
    if is_dtensor(sc):  # a sharded run's checkpoint: every block's scale, replicated
        sc = sc.full_tensor()
    if not (isinstance(sc, torch.Tensor) and sc.dtype is F32 and sc.dim() == 1
            and F.q8_block_of(param.numel(), sc.numel()) is not None):
        raise ValueError("%s: %s holds 8-bit codes, so %s must be a 1-D float32 tensor of one "
                         "scale per block of the whole param (a power-of-two block size in "
                         "[%d, %d]), got %s"
                         % (where, name, skey, Q8_BLOCK_MIN, Q8_BLOCK_MAX,
                            tuple(sc.shape) if isinstance(sc, torch.Tensor) else sc))
    if is_dtensor(param):
        # Codes of a sharded or a single-process run: the blocks lie on the whole param's
        # index, so each rank takes its shard of the codes and the scales of the blocks it
        # touches, bit for bit; on blocks of another size they are decoded (exactly) and
        # coded again on the group's (conform_state).
        if q8_blocks(param.numel(), block) != sc.numel():  # (equal counts: the same blocks)
            whole = t.full_tensor() if is_dtensor(t) else t
            return copy_like(param, F.Q8.decode(whole.detach(), sc.detach()), F32), None
        return copy_like(param, t, dtype), q8_shards.local_scales(param, sc, block)
    if is_dtensor(t):
        t = t.full_tensor()
    t, sc = t.detach().to(param.device), sc.detach().to(device=param.device, copy=True)
    codes = torch.empty_like(param, dtype=t.dtype, memory_format=torch.preserve_format)
    if not same_memory_order(t, codes):
        # The blocks follow memory order: codes saved in another layout (channels_last vs
        # contiguous) group other elements, so they are decoded there (exactly), and
        # conform_state quantizes the values again in the param's layout if the group keeps
        # 8-bit moments.
        return torch.empty_like(codes, dtype=F32).copy_(F.Q8.decode(t, sc)), None
    flat_view(codes).copy_(flat_view(t))
    return codes, sc


def _import_step(value: Any, param: torch.Tensor, where: str) -> torch.Tensor:
    step = value["step"]
    if isinstance(step, torch.Tensor):
        if step.numel() != 1 or step.is_complex() or step.layout != torch.strided:
            raise ValueError("%s: step must be a number or a 1-element tensor, got a tensor "
                             "of shape %s" % (where, tuple(step.shape)))
        return step.detach().to(device=param.device, dtype=torch.float32, copy=True).reshape(())
    if is_real(step):
        return torch.full((), float(step), dtype=torch.float32, device=param.device)
    raise TypeError("%s: step must be a number or a 1-element tensor, got %r" % (where, step))


def import_param_state(param: torch.Tensor, value: Dict[str, Any], group: Dict[str, Any],
                       moments: Moments, where: str) -> Dict[str, Any]:
    """A saved param state (``value``, a non-empty dict in any format mpext or torch writes)
    checked, copied to the param's device, layout and placement, and converted into the group's
    formats. Raises before anything is modified."""
    value = upgrade_keys(value, moments)
    if "step" not in value:
        raise ValueError("%s has no 'step' (it has %s)" % (where, sorted(value)))
    for q in moments:
        code_key = F.Q8.keys(q.name)[0]
        if q.name not in value and code_key not in value:
            raise ValueError("%s has no %r (it has %s)" % (where, q.name, sorted(value)))
        if q.name in value and code_key in value:
            raise ValueError("%s has both %r and %r" % (where, q.name, code_key))
    out: Dict[str, Any] = {"step": _import_step(value, param, where)}
    low = param.dtype in LOW_DTYPES
    by_code = {F.Q8.keys(q.name)[0]: q for q in moments}
    names = tuple(k for q in moments for k in (q.name, F.Q8.keys(q.name)[0]))
    for name in names + F.STORAGE_KEYS + ("ema_param",):
        if name not in value or (name in F.STORAGE_KEYS and not low):
            continue
        t = value[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError("%s: %s must be a tensor, got %s"
                            % (where, name, type(t).__name__))
        if t.shape != param.shape:
            raise ValueError("%s: %s has shape %s but the param has shape %s"
                             % (where, name, tuple(t.shape), tuple(param.shape)))
        if name in by_code:
            q = by_code[name]
            codes, scale = _import_codes(param, q, t, value,
                                         group.get("block_size", 256), where)
            if scale is None:  # decoded
                out[q.name] = codes
            else:
                out[name], out[F.Q8.keys(q.name)[1]] = codes, scale
            continue
        if name == "param_remainder":
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
            out[name] = copy_like(param, t, torch.int16)
            continue
        if not t.is_floating_point() or t.layout != torch.strided:
            raise TypeError("%s: %s must be a dense floating-point tensor, got %s %s"
                            % (where, name, t.layout, t.dtype))
        # Moments in their saved precision (converted to the group's by conform_state).
        keep = t.dtype if any(name == q.name for q in moments) and t.dtype is torch.bfloat16 \
            else F32
        out[name] = copy_like(param, t, keep)
    if "master_param" in out and "param_remainder" in out:
        raise ValueError("%s has both a master_param and a param_remainder" % where)
    want = F.param_format(param, group, where).key
    if "param_remainder" in out and want == "master_param":
        # A remainder becomes a master by joining it with the param, which the model's
        # state may not hold yet (nothing here can tell): join it at the next step, when
        # it surely does. The moments are converted now.
        conform_state(param, out, group, moments, where, storage=False)
        if group.get("ema_decay") is not None and "ema_param" not in out:
            out.pop("ema_param", None)  # made from the joined value at that step
        return _keep_unknown_keys(out, value, moments)
    # Into the group's form (a master becomes a remainder only if the param is its round,
    # i.e. the model was loaded first).
    conform_state(param, out, group, moments, where)
    if not any(k in value for k in F.STORAGE_KEYS):
        # No fp32 value in the state (a torch checkpoint, a master-free one): the master (or
        # remainder) and the EMA start from the param at the next step, so the model's
        # state may be loaded before or after the optimizer's.
        for key in F.STORAGE_KEYS:
            out.pop(key, None)
        if "ema_param" not in value:
            out.pop("ema_param", None)
    return _keep_unknown_keys(out, value, moments)
