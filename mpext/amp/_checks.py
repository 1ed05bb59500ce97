"""The checks of mpext.GradScaler's loss-scale rule arguments and of a state dict loaded into
it, made whole before anything is written."""
import math
import numbers
from typing import Any, Dict

import torch


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_rule_args(where: str, **args: Any) -> None:
    """Rejects loss-scale rule values torch.amp.GradScaler would take and fail on later (or
    silently misuse): a non-finite or non-positive scale, NaN/Inf factors, a backoff factor
    <= 0, a growth interval that is not an int >= 1. torch's own checks (growth_factor > 1,
    backoff_factor < 1, AssertionError) still run after these, unchanged."""
    for name, v in args.items():
        if name == "growth_interval":
            if not _is_int(v) or v < 1:
                raise ValueError("%s: growth_interval must be an int >= 1, got %r" % (where, v))
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise ValueError("%s: %s must be a finite number, got %r" % (where, name, v))
        if name in ("init_scale", "scale", "backoff_factor") and not v > 0:
            raise ValueError("%s: %s must be > 0, got %r" % (where, name, v))


def checked_state_dict(sd: Dict[str, Any], hysteresis: int) -> Dict[str, Any]:
    """Checks a GradScaler state dict whole (torch's keys and mpext's extras) and returns the
    extras' values, converted, with the defaults for absent ones. Raises KeyError for a missing
    torch key and ValueError naming the key for a bad value."""
    where = "mpext.GradScaler.load_state_dict"
    for key in ("scale", "growth_factor", "backoff_factor", "growth_interval",
                "_growth_tracker"):
        if key not in sd:
            raise KeyError("%s: the state dict has no %r entry" % (where, key))
    scale = sd["scale"]
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError("%s: 'scale' must be a number or a 1-element tensor, got a tensor "
                             "of shape %s" % (where, list(scale.shape)))
        scale = float(scale.detach().cpu())
    check_rule_args(where, scale=scale, growth_factor=sd["growth_factor"],
                     backoff_factor=sd["backoff_factor"], growth_interval=sd["growth_interval"])
    out: Dict[str, Any] = {}
    ints = {"hysteresis": (1, 2 ** 31), "_growth_tracker": (0, 2 ** 63),
            "_hysteresis_tracker": (0, 2 ** 31), "_skipped_steps": (0, 2 ** 63),
            "_consecutive_overflows": (0, 2 ** 63)}
    for key, (lo, hi) in ints.items():
        if key in sd:
            v = sd[key]
            if not _is_int(v) or not lo <= v < hi:
                raise ValueError("%s: %s must be an int in [%d, 2^%d), got %r"
                                 % (where, key, lo, hi.bit_length() - 1, v))
            out[key] = int(v)
    for key in ("min_scale", "max_scale"):
        if key in sd:
            v = sd[key]
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (
                    math.isfinite(v) and v > 0):
                raise ValueError("%s: %s must be a finite number > 0, got %r" % (where, key, v))
            out[key] = float(v)
    lo, hi = out.get("min_scale"), out.get("max_scale")
    if lo is not None and hi is not None and lo > hi:
        raise ValueError("%s: min_scale (%r) must not exceed max_scale (%r)" % (where, lo, hi))
    out.setdefault("_hysteresis_tracker", out.get("hysteresis", hysteresis))
    out.setdefault("_skipped_steps", 0)
    out.setdefault("_consecutive_overflows", 0)
    return out
