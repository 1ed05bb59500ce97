"""A param's optimizer state: its creation, its conversion into its group's formats
(:func:`conform_state`), and the import of a saved state (:func:`import_param_state`). Every
conversion goes through the formats' one decode / encode pair (mpext.optim.formats).

Shared with ``mpext.mixed_precision`` (whose fused path keeps an inner optimizer's state):
:func:`new_moments` and :func:`conform_state`. ``moments`` is always the rule's tuple of
:class:`~mpext.optim.formats.Quantity` (``Adam.moments``).
"""
from typing import Any, Dict, Tuple

import torch

from .._common import LOW_DTYPES
from .._common import is_real
from . import formats as F
from ._tensors import F32, copy_like, fp32_copy
# Names of the step's path (conform_state runs for every param at every step), bound here.
from .formats import STORAGE_KEYS, held, moment_format, param_format

Moments = Tuple[F.Quantity, ...]


def check_formats_param(param: torch.Tensor, group: Dict[str, Any], moments: Moments,
                        where: str) -> None:
    """Refuses a param one of its group's moment formats cannot be kept for (8-bit moments of
    a DTensor param lie on its whole index, which needs shards that are runs of the whole
    param split along one mesh dimension: mpext.optim._q8_shards)."""
    F.check_param(param, group, moments, where)


def new_moments(param: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any],
                moments: Moments) -> None:
    """Zero moments for a param's first step in its group's formats (in the param's layout;
    coded formats with zero metadata, which decodes to zero)."""
    block = group.get("block_size", 256)
    for q in moments:
        state.update(moment_format(param, group, q)[0].new(param, q, block))


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
    F.check_param(param, group, moments, where)
    block = group.get("block_size", 256)
    for q in moments:
        have = held(state, q.name)
        if have is None:
            continue
        fmt = moment_format(param, group, q)[0]
        if have is fmt and fmt.conforms(param, state, q, block, where):
            continue  # the group's form already
        value = have.value_of(param, state, q, block, where)
        F.drop(state, q.name)
        state.update(fmt.store(param, value, q, block))
    if not storage:
        return
    want = param_format(param, group, where)
    # What the EMA starts from: the group's storage, or the param itself when there is none or
    # it was made from the param just now (the same value, without reading it back).
    source = want if want.key is not None else None
    if want.key is not None and want.key not in state:
        have = F.stored_param_format(state)
        # (a master is used as it is, not copied, to split it into a remainder)
        value = None if have is None else have.source(param, state)
        state[want.key] = want.encode(param, value, where)
        if have is None:
            source = None
    for key in STORAGE_KEYS:
        if key != want.key:
            state.pop(key, None)
    if group.get("ema_decay") is None:
        state.pop("ema_param", None)
    elif "ema_param" not in state:  # from the fp32 value now (a first step copies it anyway)
        state["ema_param"] = fp32_copy(param) if source is None else source.decode(param, state)


# ---- Importing a saved state ---------------------------------------------------------------

def known_keys(moments: Moments) -> Tuple[str, ...]:
    """The state keys mpext writes or reads for a rule with these moments."""
    keys = ("step", "ema_param") + F.STORAGE_KEYS
    for q in moments:
        keys += F.saved_keys(q.name)
    return keys


def _keep_unknown_keys(out: Dict[str, Any], value: Dict[str, Any],
                       moments: Moments) -> Dict[str, Any]:
    """A loaded param state with the saved entries mpext does not know kept as torch keeps
    them."""
    known = known_keys(moments)
    for name, v in value.items():
        if name not in known:
            out[name] = v
    return out


def _check_entry(param: torch.Tensor, name: str, t: Any, where: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError("%s: %s must be a tensor, got %s" % (where, name, type(t).__name__))
    if t.shape != param.shape:
        raise ValueError("%s: %s has shape %s but the param has shape %s"
                         % (where, name, tuple(t.shape), tuple(param.shape)))


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
    value = F.upgrade(value, moments)
    if "step" not in value:
        raise ValueError("%s has no 'step' (it has %s)" % (where, sorted(value)))
    saved = [(q,) + F.saved_entry(value, q, where) for q in moments]
    out: Dict[str, Any] = {"step": _import_step(value, param, where)}
    block = group.get("block_size", 256)
    for q, fmt, key in saved:
        _check_entry(param, key, value[key], where)
        out.update(fmt.load(param, q, value[key], value, block, where))
    if param.dtype in LOW_DTYPES:  # (an FP32 param's FP32 value is itself)
        for fmt in F.STORAGE_FORMATS:
            if fmt.key in value:
                _check_entry(param, fmt.key, value[fmt.key], where)
                out[fmt.key] = fmt.load(param, value[fmt.key], where)
    if "ema_param" in value:
        t = value["ema_param"]
        _check_entry(param, "ema_param", t, where)
        if not t.is_floating_point() or t.layout != torch.strided:
            raise TypeError("%s: ema_param must be a dense floating-point tensor, got %s %s"
                            % (where, t.layout, t.dtype))
        out["ema_param"] = copy_like(param, t, F32)
    stored = [f for f in F.STORAGE_FORMATS if f.key in out]
    if len(stored) > 1:
        raise ValueError("%s has both a %s" % (where, " and a ".join(f.key for f in stored)))
    want = F.param_format(param, group, where)
    if stored and stored[0].reads_param and want.key is not None and want is not stored[0]:
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
