"""The fused launch planner: a list of :class:`StepItem` (one per param with a gradient) into as
few ``torch.ops.mpext.adam_step_`` calls as possible -- one per device, learning rate and
:class:`AdamHyper` -- and :func:`_op_call`, the one place that maps a launch's lists and
hyperparameters to the op's arguments.

Shared with ``mpext.mixed_precision`` (whose fast path steps an inner Adam/AdamW through the
same planner): :class:`StepItem`, :class:`AdamHyper`, :func:`adam_hyper` and
:func:`fused_adam_step`.
"""
from collections import defaultdict
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Union

import torch

from .._common import LrTensors, same_layout
from .formats import moment_of
from ._tensors import F32, local


class AdamHyper(NamedTuple):
    """What the params of one ``adam_step_`` call share besides device and learning rate."""
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    maximize: bool
    unscale_grads: bool
    master_free: bool
    stochastic_rounding: bool
    moments_round_nearest: bool
    seed: int
    block_size: int
    ema_decay: float  # 0 when the group keeps no EMA (the kernel then has none to update)


def adam_hyper(group: Dict[str, Any], force_decoupled: bool = False) -> AdamHyper:
    """A param group's :class:`AdamHyper`, as Python values (a tensor beta is read once here,
    as torch's own optimizers read it). A group without mpext's keys (torch's Adam) gets their
    defaults: the unscaled gradient written back, as torch's fused optimizers do, and FP32
    masters."""
    beta1, beta2 = (float(b) for b in group["betas"])
    wd = float(group["weight_decay"])
    decoupled = (force_decoupled or bool(group.get("decoupled_weight_decay", False))) and wd != 0
    return AdamHyper(beta1, beta2, float(group["eps"]), wd, decoupled,
                     bool(group.get("maximize", False)), bool(group.get("unscale_grads", True)),
                     group.get("master_weights", True) is False,
                     bool(group.get("stochastic_rounding", False)),
                     group.get("moment_rounding", "stochastic") == "nearest",
                     int(group.get("seed", 0)), int(group.get("block_size", 256)),
                     float(group.get("ema_decay") or 0.0))


class StepItem(NamedTuple):
    """One param to step. Plain tensors (DTensors already as their local shards)."""
    param: torch.Tensor
    grad: torch.Tensor
    # torch's exp_avg, exp_avg_sq (float32 or bfloat16), or 8-bit exp_avg_q8 / exp_avg_sq_q8
    # codes with their *_q8_scale, an optional ema_param, and step (converted in place to a
    # float32 scalar on the param's device if it is not one)
    state: Dict[str, Any]
    # the fp32 master (float32) or the remainder (int16) of a bf16/fp16 param, or None (an
    # fp32 param, or none kept)
    storage: Optional[torch.Tensor]
    lr: Union[float, torch.Tensor]
    hyper: AdamHyper
    stream: int  # the param's stochastic-rounding stream, in [0, 2^32)


def _to_device(t: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    if t is None:
        return None
    # Non-blocking only towards an accelerator: a host tensor must hold its value when used.
    return t.to(device=device, dtype=torch.float32, non_blocking=device.type != "cpu")


def device_step(state: Dict[str, Any], device: torch.device) -> torch.Tensor:
    """The param's step count as the kernel needs it: a float32 scalar tensor on the param's
    device. A state loaded by other code (ZeroRedundancyOptimizer moves 0-dim state to the CPU,
    torch's non-fused Adam keeps a float or an int64 tensor) is converted once, in place."""
    step = state["step"]
    if not (isinstance(step, torch.Tensor) and step.dtype is F32 and step.device == device
            and step.dim() == 0):
        step = torch.as_tensor(step).detach().to(device=device, dtype=F32).reshape(())
        state["step"] = step
    return step


class _Launch(NamedTuple):
    """The per-param lists of one ``adam_step_`` call."""
    params: list
    grads: list
    exp_avgs: list
    exp_avg_sqs: list
    masters: list
    steps: list
    remainders: list
    streams: list
    m_scales: list
    v_scales: list
    emas: list


def _op_call(launch: _Launch, lr: torch.Tensor, hyper: AdamHyper,
             inv_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor],
             empty: torch.Tensor, empty16: torch.Tensor) -> tuple:
    """(args, kwargs) of ``torch.ops.mpext.adam_step_`` for one launch: a list the kernel
    would only read as placeholders (``empty``) is passed as None or left out."""
    masters = [] if all(m is empty for m in launch.masters) else launch.masters
    q8 = any(m is not empty for m in launch.m_scales)
    seed = hyper.seed - 2 ** 64 if hyper.seed >= 2 ** 63 else hyper.seed  # the schema's int64
    args = (launch.params, launch.grads, launch.exp_avgs, launch.exp_avg_sqs, masters,
            launch.steps, lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay,
            hyper.decoupled, hyper.maximize)
    kwargs = dict(inv_scale=inv_scale, found_inf=found_inf, unscale_grads=hyper.unscale_grads,
                  remainders=None if all(r is empty16 for r in launch.remainders)
                  else launch.remainders,
                  master_free=hyper.master_free, stochastic_rounding=hyper.stochastic_rounding,
                  moments_round_nearest=hyper.moments_round_nearest, seed=seed,
                  sr_streams=launch.streams, exp_avg_scales=launch.m_scales if q8 else None,
                  exp_avg_sq_scales=launch.v_scales if q8 else None,
                  block_size=hyper.block_size,
                  ema_params=None if all(e is empty for e in launch.emas) else launch.emas,
                  ema_decay=hyper.ema_decay)
    return args, kwargs


def fused_adam_step(items: Iterable[StepItem], lr_tensors: LrTensors,
                    inv_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor]) -> None:
    """Steps every item with as few ``adam_step_`` calls as possible: one per device, learning
    rate and :class:`AdamHyper`, whatever the params' groups or dtypes. The one planner of the
    fused step, used by :class:`~mpext.optim.Adam` and by ``MixedPrecisionOptimizer``'s fast
    path. Every call's arguments are assembled before the first launch, so a failing check
    leaves everything unchanged."""
    calls: Dict[tuple, List[StepItem]] = {}
    for item in items:
        p, _, _, _, lr, hyper, _ = item  # unpacked: cheaper than seven field reads per param
        lr_key = ("tensor", id(lr)) if isinstance(lr, torch.Tensor) else float(lr)
        calls.setdefault((p.device, lr_key, hyper), []).append(item)
    launches = []
    copied = []  # (the gradient, its copy in the param's layout) whose copy may be written
    per_device: Dict[torch.device, tuple] = {}
    slots: Dict[torch.device, int] = defaultdict(int)
    for (device, _, hyper), entries in calls.items():
        if device not in per_device:
            per_device[device] = (_to_device(inv_scale, device), _to_device(found_inf, device),
                                  torch.empty(0, dtype=F32, device=device),
                                  torch.empty(0, dtype=torch.int16, device=device))
        dev_inv, dev_found, empty, empty16 = per_device[device]
        launch = _Launch([], [], [], [], [], [], [], [], [], [], [])
        for p, g, state, storage, _, _, stream in entries:
            if g.stride() != p.stride() and not same_layout(g, p):
                # e.g. a channels_last param with a contiguous gradient
                copy = torch.empty_like(p, dtype=g.dtype).copy_(g)
                if hyper.unscale_grads and dev_inv is not None:
                    copied.append((g, copy))
                g = copy
            launch.params.append(p)
            launch.grads.append(g)
            m, ms = moment_of(state, "exp_avg")
            v, vs = moment_of(state, "exp_avg_sq")
            launch.exp_avgs.append(local(m))
            launch.exp_avg_sqs.append(local(v))
            launch.steps.append(device_step(state, device))
            is_remainder = storage is not None and storage.dtype is torch.int16
            launch.masters.append(empty if storage is None or is_remainder else storage)
            launch.remainders.append(storage if is_remainder else empty16)
            launch.streams.append(stream)
            launch.m_scales.append(empty if ms is None else ms)
            launch.v_scales.append(empty if vs is None else vs)
            ema = state.get("ema_param")
            launch.emas.append(empty if ema is None else local(ema))
        lr_t = lr_tensors.get((device, slots[device]), device, entries[0].lr)
        slots[device] += 1
        launches.append(_op_call(launch, lr_t, hyper, dev_inv, dev_found, empty, empty16))
    for args, kwargs in launches:
        torch.ops.mpext.adam_step_(*args, **kwargs)
    for g, copy in copied:  # the unscaled values back into the gradient's own layout
        g.copy_(copy)
