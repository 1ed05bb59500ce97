"""mpext.optim: Adam and AdamW on the fused ``mpext.ops.adam_step_`` kernel, with FP32 master
weights for BF16/FP16 params, or leaner state.

Drop-in for ``torch.optim.Adam`` / ``torch.optim.AdamW``: the same constructor arguments and
defaults, the same param-group keys (plus mpext's: ``master_weights``, ``param_remainders``,
``unscale_grads``, ``exp_avg_dtype``, ``exp_avg_sq_dtype``, ``moment_rounding``,
``stochastic_rounding``, ``seed``, ``block_size``, ``ema_decay``), the same ``state_dict``
layout (``step``, ``exp_avg``, ``exp_avg_sq``, plus ``master_param`` or ``param_remainder``
where one exists and ``ema_param`` with an EMA; 8-bit moments, being codes, not values, are
``exp_avg_q8`` / ``exp_avg_sq_q8`` with ``exp_avg_q8_scale`` / ``exp_avg_sq_q8_scale`` instead
of ``exp_avg`` / ``exp_avg_sq``: see docs/lean_state.md, "State keys"), and the same math. What differs is how a step runs:

* One ``adam_step_`` call per device and set of hyperparameters covers every param with a
  gradient, whatever its group or dtype: one pass over memory that reads the gradient, updates
  the FP32 moments and the FP32 master (or the FP32 param) and writes the param.
* BF16/FP16 params get an FP32 master copy (``state["master_param"]``, made from the param the
  first time it is stepped); the update happens on the master and the param is written as its
  round-to-nearest-even, so small updates accumulate instead of being rounded away. ``step`` is
  a float32 scalar tensor on the param's device.
* Leaner state, per param group (see docs/lean_state.md for the figures):

  - ``param_remainders=True``: a BF16 param keeps only the low 16 bits of its FP32 master
    (``state["param_remainder"]``, int16): the param is the master's high half, so the pair is
    the master exactly -- the same bits as ``param_remainders=False`` in 2 bytes instead of 4.
    (An FP16 param is not an FP32 value's high half: refused.)
  - ``master_weights=False``: no master; the update is computed from the param and written
    back to nearest even (updates below half an ulp are lost), or with
    ``stochastic_rounding=True`` rounded stochastically, which is unbiased: small updates
    survive in expectation.
  - ``exp_avg_dtype`` / ``exp_avg_sq_dtype=torch.bfloat16``: moments stored in BF16 with
    stochastic rounding (``moment_rounding="stochastic"``, unbiased; ``"nearest"`` is biased
    and kept for comparisons).
  - ``exp_avg_dtype=torch.int8, exp_avg_sq_dtype=torch.uint8``: 8-bit block-quantized moments
    (1 byte per element each, plus one FP32 absmax per block of ``block_size`` elements, in
    ``state["exp_avg_q8_scale"]`` / ``state["exp_avg_sq_q8_scale"]``, the codes in
    ``state["exp_avg_q8"]`` / ``state["exp_avg_sq_q8"]``), decoded, updated in FP32 and
    re-encoded with ``moment_rounding`` in the same pass; params of fewer than
    ``MIN_8BIT_NUMEL`` elements keep FP32 moments. See docs/moments_8bit.md.

  Stochastic rounding is reproducible: its bits depend only on the group's ``seed``, the
  param's position in the optimizer, its step count and the element's position -- not on
  threads, CPU ISA or device, and a resumed run draws what the uninterrupted one would have.
* ``ema_decay``: an exponential moving average of the FP32 masters (``state["ema_param"]``),
  updated inside the same fused pass (4 more bytes per param, read and written), with
  :meth:`Adam.ema_weights` to evaluate with it. ``torch.optim.swa_utils.AveragedModel`` averages
  the model's BF16/FP16 params in their own precision, where an update of ``(1 - decay) *
  (p - ema)`` is mostly below half an ulp and lost.
* ``_step_supports_amp_scaling`` is set, so ``torch.amp.GradScaler`` and ``mpext.GradScaler``
  hand ``step`` the loss scale and the inf/NaN flag: the gradients are unscaled inside the
  kernel and an overflowing step is skipped on the device (nothing written, ``step`` not
  advanced). A step makes no host synchronisation.

The learning rate stays a Python float in ``param_groups`` (LR schedulers work unchanged); each
step it is written into a small cached tensor on the device (only when it changed), which the
kernel reads.

DTensor params (FSDP2's sharded ones, or any ``torch.distributed.tensor.DTensor``) are stepped
through their local shards, as torch's fused AdamW does: the update is element-wise, so each rank
updates its own shard with no communication. Their moments and masters are DTensors with the
param's mesh and placements (so ``torch.distributed.checkpoint`` saves and reshards them), and
``step`` is a plain scalar tensor on the param's device, as in torch.
"""
import contextlib
import math
import warnings
from collections import defaultdict
from copy import deepcopy
from itertools import chain
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple, Union

import torch

from .._common import LOW_DTYPES as _LOW_DTYPES, PARAM_DTYPES as _PARAM_DTYPES, LrTensors
from .._common import dtype_name as _dtype_name, has_kernel, is_dense, is_real as _is_real
from .._common import MIN_8BIT_NUMEL, Q8_BLOCK_MAX, Q8_BLOCK_MIN, same_layout

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch built without distributed support
    _DTensor = None

__all__ = ["Adam", "AdamW"]

_STRIDED, _F32 = torch.strided, torch.float32


def _is_dtensor(t: Any) -> bool:
    return _DTensor is not None and isinstance(t, _DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself, sharing memory), or a plain tensor as is."""
    if _is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


class Adam(torch.optim.Optimizer):
    """Adam (``decoupled_weight_decay=False``: L2 weight decay added to the gradient) or AdamW
    (``decoupled_weight_decay=True``) with torch's math, on mpext's fused kernel.

    Args:
        params: iterable of params or of dicts defining param groups; params must be float32,
            bfloat16 or float16 tensors on a device mpext has a kernel for (CPU, CUDA), or
            DTensors of those (FSDP2): each rank steps its local shards, and the moments and
            masters are DTensors placed as the param (see the module docstring).
        lr (float or 1-element Tensor): learning rate (default 1e-3).
        betas (Tuple[float, float]): moment coefficients (default (0.9, 0.999)).
        eps (float): added to the denominator (default 1e-8).
        weight_decay (float): default 0 (Adam) / 1e-2 (AdamW).
        amsgrad (bool): not supported; True raises ``NotImplementedError``.
        maximize (bool): maximize the objective (default False).
        foreach, fused, capturable: accepted for compatibility with torch and ignored (the step
            is always fused, sync-free and keeps ``step`` on the device).
        differentiable (bool): must be False.
        decoupled_weight_decay (bool): AdamW's decoupled decay (default False).
        master_weights (bool): keep the FP32 value of every bfloat16/float16 param (default
            True): an FP32 master copy (``state["master_param"]``), or its remainder (see
            ``param_remainders``). False: nothing; the param is updated from its own value and
            rounded back each step (see ``stochastic_rounding``). FP32 params never have a
            master.
        param_remainders (bool): keep a bfloat16 param's master as the master's low 16 bits
            (``state["param_remainder"]``, int16, 2 bytes per element instead of 4): the
            param and its remainder are the master exactly, so the results are bitwise those
            of ``param_remainders=False``. Needs ``master_weights=True``; a float16 param is
            refused (its master is not an FP32 value's high half); FP32 params need none.
            Default False.
        stochastic_rounding (bool): with ``master_weights=False``, write the updated param with
            stochastic rounding (unbiased: an update below half an ulp lands with a probability
            proportional to its size) instead of to nearest even (where it is lost). Default
            False; True with a master is refused (the master makes it unnecessary).
        exp_avg_dtype, exp_avg_sq_dtype (torch.dtype): the storage of the first / second moment,
            ``torch.float32`` (default) or ``torch.bfloat16`` (half the memory; stored with
            ``moment_rounding``), or together ``torch.int8`` / ``torch.uint8``: 8-bit codes
            of blocks of ``block_size`` elements with one FP32 scale per block (a quarter of
            the memory; params of fewer than ``MIN_8BIT_NUMEL`` elements keep FP32 moments;
            not for DTensor params). The update is computed in FP32 either way.
        block_size (int): elements per block of 8-bit moments, a power of two in [32, 2048]
            (default 256: the scales then cost 1/32 byte per element and moment).
        moment_rounding (str): how BF16 moments are rounded: "stochastic" (default, unbiased) or
            "nearest" (biased: small contributions to a moment can be lost; for comparisons).
        seed (int): the seed of the stochastic rounding, in [0, 2**64) (default 0). Two runs
            with one seed round identically.
        ema_decay (float, optional): keep an EMA of every param's FP32 value (its master, or
            the FP32 param; with no master, the FP32 update before rounding), ``ema =
            torch.lerp(ema, value, 1 - ema_decay)`` after each applied step, starting as a copy
            of the value after the param's first step -- what
            ``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(ema_decay))`` computes, in
            FP32 (torch.lerp's formula with each operation rounded; see
            ``mpext.ops.adam_step_``). In [0, 1]; None (default): no EMA. See
            :meth:`ema_weights`.
        unscale_grads (bool): when a GradScaler hands the step its loss scale, also write the
            unscaled gradient back into ``.grad`` in the same pass (default True), which is what
            torch's fused optimizers leave there, so that code reading ``.grad`` after the step
            (gradient-norm logging, say) sees unscaled values. False leaves ``.grad`` scaled and
            saves that write (2 bytes per bf16 gradient element). Nothing is written without a
            loss scale or with a scale of 1.

    If the model's low-precision params are changed outside the optimizer after their first
    step (e.g. ``model.load_state_dict``), the masters are stale: load the optimizer state too,
    or call :meth:`reset_masters`.
    """

    _step_supports_amp_scaling = True
    _force_decoupled = False  # AdamW: always decoupled, as torch.optim.AdamW

    def __init__(self, params, lr: Union[float, torch.Tensor] = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, amsgrad: bool = False, *,
                 foreach: Optional[bool] = None, maximize: bool = False,
                 capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, decoupled_weight_decay: bool = False,
                 master_weights: bool = True, unscale_grads: bool = True,
                 param_remainders: bool = False, stochastic_rounding: bool = False,
                 exp_avg_dtype: torch.dtype = torch.float32,
                 exp_avg_sq_dtype: torch.dtype = torch.float32,
                 moment_rounding: str = "stochastic", seed: int = 0,
                 block_size: int = 256, ema_decay: Optional[float] = None) -> None:
        if isinstance(betas, (list, tuple)) and len(betas) == 2:
            betas = tuple(float(b) if isinstance(b, torch.Tensor) else b for b in betas)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay,
                        master_weights=master_weights, unscale_grads=unscale_grads,
                        param_remainders=param_remainders,
                        stochastic_rounding=stochastic_rounding, exp_avg_dtype=exp_avg_dtype,
                        exp_avg_sq_dtype=exp_avg_sq_dtype, moment_rounding=moment_rounding,
                        seed=seed, block_size=block_size, ema_decay=ema_decay)
        self._check_group(defaults, "")
        self._init_caches()
        super().__init__(params, defaults)

    # -----------------------------------------------------------------------------------------
    # Construction and validation.

    def _name(self) -> str:
        return "mpext.optim." + type(self).__name__

    def _init_caches(self) -> None:
        self._lr_tensors = LrTensors()

    def _check_group(self, group: Dict[str, Any], where: str) -> None:
        """Checks a group's hyperparameters (raises before anything changes). Messages of the
        checks torch also makes are torch's."""
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                raise ValueError("Tensor lr must be 1-element")
            if not lr.is_floating_point():
                raise TypeError("%s: a Tensor lr must be floating point, got %s"
                                % (self._name(), lr.dtype))
        elif not _is_real(lr):
            raise TypeError("%s: lr must be a float or a 1-element Tensor, got %r%s"
                            % (self._name(), lr, where))
        elif not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        elif not math.isfinite(lr):
            raise ValueError("%s: lr must be finite, got %r%s" % (self._name(), lr, where))
        eps = group.get("eps")
        if not _is_real(eps) or not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not math.isfinite(eps):
            raise ValueError("%s: eps must be finite, got %r%s" % (self._name(), eps, where))
        betas = group.get("betas")
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ValueError("%s: betas must be a pair of floats, got %r%s"
                             % (self._name(), betas, where))
        for i, b in enumerate(betas):
            if isinstance(b, torch.Tensor):
                if b.numel() != 1:
                    raise ValueError("Tensor betas[%d] must be 1-element" % i)
                continue
            if not _is_real(b) or not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b}")
        wd = group.get("weight_decay")
        if not _is_real(wd) or not 0.0 <= wd:
            raise ValueError(f"Invalid weight_decay value: {wd}")
        if not math.isfinite(wd):
            raise ValueError("%s: weight_decay must be finite, got %r%s"
                             % (self._name(), wd, where))
        if group.get("amsgrad", False):
            raise NotImplementedError(
                "%s: amsgrad=True is not supported (the fused kernel implements plain "
                "Adam/AdamW); use torch.optim.%s(amsgrad=True)%s"
                % (self._name(), type(self).__name__, where))
        if group.get("differentiable", False):
            raise ValueError("%s: differentiable=True is not supported: the fused step is not "
                             "differentiable%s" % (self._name(), where))
        for flag in ("master_weights", "unscale_grads", "param_remainders",
                     "stochastic_rounding"):
            if not isinstance(group.get(flag, False), bool):
                raise TypeError("%s: %s must be a bool, got %r%s"
                                % (self._name(), flag, group.get(flag), where))
        mw = group.get("master_weights", True)
        if group.get("param_remainders", False) and not mw:
            raise ValueError("%s: param_remainders=True stores the masters compactly; it needs "
                             "master_weights=True%s" % (self._name(), where))
        if group.get("stochastic_rounding", False) and mw:
            raise ValueError("%s: stochastic_rounding=True rounds params that have no master; "
                             "it needs master_weights=False%s" % (self._name(), where))
        for key, q8 in (("exp_avg_dtype", torch.int8), ("exp_avg_sq_dtype", torch.uint8)):
            dt = group.get(key, _F32)
            if isinstance(dt, str) and dt in _FORMAT_BY_NAME:
                # state_dict() names formats by string (torch's gather of full state dicts
                # takes no dtype objects); groups keep the dtype, whichever they were given.
                dt = group[key] = _FORMAT_BY_NAME[dt]
            if dt is not _F32 and dt is not torch.bfloat16 and dt is not q8:
                raise ValueError("%s: %s must be torch.float32, torch.bfloat16 or %s, got %r%s"
                                 % (self._name(), key, q8, dt, where))
        md, vd = group.get("exp_avg_dtype", _F32), group.get("exp_avg_sq_dtype", _F32)
        if (md is torch.int8) != (vd is torch.uint8):
            raise ValueError("%s: 8-bit moments come as a pair: exp_avg_dtype=torch.int8 with "
                             "exp_avg_sq_dtype=torch.uint8, got %r and %r%s"
                             % (self._name(), md, vd, where))
        block = group.get("block_size", 256)
        if not (isinstance(block, int) and not isinstance(block, bool)
                and Q8_BLOCK_MIN <= block <= Q8_BLOCK_MAX and block & (block - 1) == 0):
            raise ValueError("%s: block_size must be a power of two in [%d, %d], got %r%s"
                             % (self._name(), Q8_BLOCK_MIN, Q8_BLOCK_MAX, block, where))
        rounding = group.get("moment_rounding", "stochastic")
        if rounding not in ("stochastic", "nearest"):
            raise ValueError("%s: moment_rounding must be \"stochastic\" or \"nearest\", got "
                             "%r%s" % (self._name(), rounding, where))
        ema_decay = group.get("ema_decay")
        if ema_decay is not None and not (_is_real(ema_decay) and 0.0 <= ema_decay <= 1.0):
            raise ValueError("%s: ema_decay must be None or a number in [0, 1], got %r%s"
                             % (self._name(), ema_decay, where))
        seed = group.get("seed", 0)
        if not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2 ** 64):
            raise ValueError("%s: seed must be an int in [0, 2**64), got %r%s"
                             % (self._name(), seed, where))

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        where = " (param group %d)" % (len(self.param_groups) - 1)
        try:
            self._check_group(group, where)
            for j, p in enumerate(group["params"]):
                if p.layout != torch.strided:
                    raise ValueError("%s: params[%d]%s is a %s tensor; only dense params are "
                                     "supported" % (self._name(), j, where, p.layout))
                if p.dtype not in _PARAM_DTYPES:
                    raise TypeError("%s: params[%d]%s has dtype %s; only float32, bfloat16 and "
                                    "float16 params are supported"
                                    % (self._name(), j, where, _dtype_name(p.dtype)))
                if p.dtype is torch.float16 and group["param_remainders"]:
                    raise ValueError(_FP16_REMAINDER % ("%s: params[%d]%s"
                                                        % (self._name(), j, where)))
                _check_q8_param(p, group, "%s: params[%d]%s" % (self._name(), j, where))
                if not has_kernel("adam_step_", p.device):
                    raise ValueError("%s: params[%d]%s is on %s, a device this build of mpext "
                                     "has no adam_step_ kernel for"
                                     % (self._name(), j, where, p.device))
                if not is_dense(p) or not is_dense(_local(p)):
                    raise ValueError("%s: params[%d]%s must be dense and non-overlapping (e.g. "
                                     "contiguous or channels_last); got sizes %s and strides %s"
                                     % (self._name(), j, where, tuple(p.shape),
                                        tuple(p.stride())))
        except BaseException:
            self.param_groups.pop()
            raise
        if group["master_weights"] is False and not group["stochastic_rounding"] \
                and any(p.dtype in _LOW_DTYPES for p in group["params"]):
            warnings.warn("%s: master_weights=False without stochastic_rounding=True rounds "
                          "every update of the BF16/FP16 params%s to nearest even, which loses "
                          "the updates below half an ulp: at small learning rates most weights "
                          "stop moving (docs/lean_state.md, \"When round to nearest fails\"); "
                          "pass stochastic_rounding=True" % (self._name(), where),
                          UserWarning, stacklevel=3)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        if not hasattr(self, "_lr_tensors"):
            self._init_caches()
        master_default = self.defaults.get("master_weights", True)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)
            group.setdefault("master_weights", master_default)
            for key, value in _LEAN_DEFAULTS.items():
                group.setdefault(key, self.defaults.get(key, value))
            if self._force_decoupled:
                group["decoupled_weight_decay"] = True
            else:
                group.setdefault("decoupled_weight_decay", False)

    # -----------------------------------------------------------------------------------------
    # The step.

    def _items(self) -> List[tuple]:
        """Every param with a gradient, checked, as an item of :func:`fused_adam_step`:
        (param, grad, state, storage, lr, hyperparameters, stream), with DTensors as their local
        shards. Raises before anything is written (state is created lazily, which changes no
        value a reader relies on)."""
        checked = []
        stream = -1  # the param's position in the optimizer: its stochastic-rounding stream
        for gi, group in enumerate(self.param_groups):
            self._check_group(group, " (param group %d)" % gi)
            hyper = adam_hyper(group, self._force_decoupled)
            for j, p in enumerate(group["params"]):
                stream += 1
                g = p.grad
                if g is None:
                    continue
                pdt, gdt, device = p.dtype, g.dtype, p.device
                if not (g.layout == _STRIDED and (gdt is pdt or gdt is _F32)
                        and pdt in _PARAM_DTYPES and g.device == device
                        and g.shape == p.shape):
                    self._bad_grad(p, g, j, gi)
                if _is_dtensor(p) or _is_dtensor(g):
                    g = self._local_grad(p, g, j, gi)
                checked.append((p, g, group, hyper, stream, "param %d of group %d" % (j, gi)))
        # Every param's state in its group's form, converted on copies: a conversion refused
        # for one param (a master that is not its param's round) leaves every state as it was.
        staged = [self._state_of(p, group, where) for p, _, group, _, _, where in checked]
        items = []
        for (p, g, group, hyper, stream, _), new in zip(checked, staged):
            state = self.state[p]
            state.clear()
            state.update(new)
            storage = state.get("master_param")
            if storage is None:
                storage = state.get("param_remainder")
            items.append((_local(p), g, state, None if storage is None else _local(storage),
                          group["lr"], hyper, stream))
        return items

    def _local_grad(self, p: torch.Tensor, g: torch.Tensor, j: int, gi: int) -> torch.Tensor:
        """The local shard of a DTensor param's gradient, which must be a DTensor sharded as
        the param is (what FSDP2 and DTensor's autograd produce)."""
        where = "param %d of group %d" % (j, gi)
        if not (_is_dtensor(p) and _is_dtensor(g)):
            raise TypeError("%s: %s is a %s but its gradient is a %s; a DTensor param needs a "
                            "DTensor gradient and a plain param a plain one"
                            % (self._name(), where, type(p).__name__, type(g).__name__))
        if g.device_mesh != p.device_mesh or tuple(g.placements) != tuple(p.placements):
            raise ValueError("%s: the gradient of %s is placed as %s on %s but the param as %s "
                             "on %s; redistribute the gradient to the param's placements"
                             % (self._name(), where, tuple(g.placements), g.device_mesh,
                                tuple(p.placements), p.device_mesh))
        gl = _local(g)
        if gl.shape != _local(p).shape:
            raise ValueError("%s: the local shard of the gradient of %s has shape %s but the "
                             "param's has %s" % (self._name(), where, tuple(gl.shape),
                                                 tuple(_local(p).shape)))
        return gl

    def _bad_grad(self, p: torch.Tensor, g: torch.Tensor, j: int, gi: int) -> None:
        """Raises the error for a param / gradient pair the kernel cannot take."""
        where = "param %d of group %d" % (j, gi)
        if g.layout != torch.strided:
            raise RuntimeError(
                "%s does not support sparse gradients (%s has a %s gradient); use "
                "torch.optim.SparseAdam for sparse params" % (self._name(), where, g.layout))
        if p.dtype not in _PARAM_DTYPES:  # changed in place after construction
            raise TypeError("%s: %s has dtype %s; only float32, bfloat16 and float16 params are "
                            "supported" % (self._name(), where, _dtype_name(p.dtype)))
        if g.dtype != p.dtype and g.dtype != torch.float32:
            raise TypeError(
                "%s: the gradient of %s has dtype %s; it must have the param's dtype (%s) or "
                "float32" % (self._name(), where, _dtype_name(g.dtype),
                             _dtype_name(p.dtype)))
        if g.device != p.device:
            raise ValueError("%s: the gradient of %s is on %s but the param is on %s"
                             % (self._name(), where, g.device, p.device))
        raise ValueError("%s: the gradient of %s has shape %s but the param has shape %s"
                         % (self._name(), where, tuple(g.shape), tuple(p.shape)))

    def _state_of(self, p: torch.Tensor, group: Dict[str, Any], where: str) -> Dict[str, Any]:
        """The param's state as its step needs it, in a new dict (the caller stores it): created
        on its first step (a float32 step on its device, moments in the group's dtypes and the
        param's layout, the master or remainder its group asks for) and kept in the group's
        form: a group whose settings changed since (or a loaded state) has its state converted
        here, before the step."""
        state = dict(self.state.get(p, {}))
        if len(state) == 0:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            new_moments(p, state, group)
        _conform_state(p, state, group, "%s: %s" % (self._name(), where))
        return state

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, *,
             grad_scale: Optional[torch.Tensor] = None,
             found_inf: Optional[torch.Tensor] = None) -> Optional[float]:
        """Performs one optimization step.

        Args:
            closure (callable, optional): re-evaluates the model and returns the loss.
            grad_scale (Tensor, optional): the loss scale the gradients carry; they are
                unscaled inside the kernel (multiplied by ``1 / grad_scale``). Defaults to the
                ``grad_scale`` attribute a GradScaler sets.
            found_inf (Tensor, optional): a one-element flag; when non-zero the step is skipped
                on the device (params, masters, moments and steps unchanged). Defaults to the
                ``found_inf`` attribute a GradScaler sets.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and not isinstance(found_inf, torch.Tensor):
            if found_inf:  # a host-side flag (e.g. a scaler that recorded no inf checks)
                return loss
            found_inf = None

        items = self._items()
        if not items:
            return loss
        inv_scale = None
        if grad_scale is not None:
            if isinstance(grad_scale, torch.Tensor):
                # As GradScaler.unscale_ computes it: the reciprocal in double, rounded to fp32.
                inv_scale = grad_scale.detach().double().reciprocal().float()
            else:
                inv_scale = torch.full((), 1.0 / float(grad_scale), dtype=torch.float32)
        fused_adam_step(items, self._lr_tensors, inv_scale, found_inf)
        return loss

    def reset_masters(self) -> None:
        """Re-makes every FP32 master from its (low-precision) param (a remainder becomes 0:
        the master is the param), e.g. after the model's params were loaded or changed outside
        the optimizer."""
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state.get(p)
                    if state and "master_param" in state:
                        state["master_param"].copy_(p)
                    if state and "param_remainder" in state:
                        state["param_remainder"].zero_()

    def ema_param(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """A copy of the FP32 EMA kept for ``param`` (see ``ema_decay``), or None when its
        group keeps none or it has not been stepped yet."""
        ema = (self.state.get(param) or {}).get("ema_param")
        return None if ema is None else ema.detach().clone()

    @contextlib.contextmanager
    def ema_weights(self):
        """A context in which every param that has an EMA holds it (rounded to the param's
        dtype to nearest even, as ``param.copy_(ema)``), for evaluation::

            with opt.ema_weights():
                evaluate(model)

        On exit each param gets back its exact value (masters and remainders stay valid). Do
        not step the optimizer inside. Raises ``RuntimeError`` if no param group keeps an EMA.
        Params whose EMA does not exist yet (never stepped) are left as they are."""
        if all(g.get("ema_decay") is None for g in self.param_groups):
            raise RuntimeError("%s.ema_weights: no param group keeps an EMA; construct the "
                               "optimizer with ema_decay=..." % self._name())
        with _ema_swapped(self, [(p, p) for g in self.param_groups for p in g["params"]]):
            yield self

    def master_param(self, param: torch.Tensor) -> torch.Tensor:
        """The FP32 value the optimizer holds for ``param``: a copy of its master, its master
        rebuilt from the param and its remainder, or (no master, or an FP32 param, or no state
        yet) the param widened to FP32."""
        state = self.state.get(param) or {}
        with torch.no_grad():
            if "master_param" in state:
                return state["master_param"].detach().clone()
            if "param_remainder" in state:
                return _join_remainder(param, state["param_remainder"])
            return _fp32_copy(param)

    # -----------------------------------------------------------------------------------------
    # state_dict: torch's, in values every client can carry.

    def state_dict(self) -> Dict[str, Any]:
        """torch's ``state_dict``, with two changes that let torch's gather of full state
        dicts (``get_optimizer_state_dict(..., full_state_dict=True)``) and its collectives
        take it: the moment formats of the param groups are named by string ("float32",
        "bfloat16", "int8", "uint8"; ``load_state_dict`` and the groups take either), and the
        int16 ``param_remainder`` of a DTensor param is given as an int32 DTensor of the same
        values (gloo and NCCL have no int16; any loader's cast back to int16 is exact)."""
        sd = super().state_dict()
        for group in sd["param_groups"]:
            for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
                if isinstance(group.get(key), torch.dtype) and group[key] in _FORMAT_NAMES:
                    group[key] = _FORMAT_NAMES[group[key]]
        state = sd["state"]
        for k, st in state.items():
            rem = st.get("param_remainder") if isinstance(st, dict) else None
            if _is_dtensor(rem):
                st = state[k] = dict(st)  # the optimizer's own dict stays as it is
                st["param_remainder"] = _DTensor.from_local(
                    rem.to_local().to(torch.int32), rem.device_mesh, rem.placements,
                    run_check=False, shape=rem.shape, stride=rem.stride())
        return sd

    # -----------------------------------------------------------------------------------------
    # state_dict loading: torch's procedure with mpext's own conversion of each param's state.

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state saved by this class, by the other mpext Adam class, or by
        ``torch.optim.Adam`` / ``torch.optim.AdamW``.

        The storage settings -- ``master_weights``, ``param_remainders``,
        ``stochastic_rounding``, ``exp_avg_dtype``, ``exp_avg_sq_dtype``, ``block_size`` -- are
        this optimizer's, and the loaded state is converted into
        them (so a checkpoint with FP32 masters resumes with remainders, say); every other
        group setting (lr, betas, ..., ``seed``, ``moment_rounding``, ``ema_decay``) comes from
        ``state_dict``, as in torch (a ``UserWarning`` names each of those three that differs
        from this optimizer's). Moments are converted to the group's dtypes (FP32 -> BF16 to nearest even) and
        to the param's device and memory layout, ``step`` to a float32 scalar tensor on the
        param's device; a low-precision param's FP32 value comes from the state's
        ``master_param`` or ``param_remainder`` or, when it has neither (a torch checkpoint),
        from the param itself (at the next step) -- a master becomes a remainder only if the
        param is its round to nearest even (load the model first), else a ``ValueError`` says
        so, and a remainder becomes a master at the next step, joined with the param as it is
        then (so the model may be loaded after the optimizer). Every tensor is copied, so the
        loaded state never shares memory with ``state_dict``. For a DTensor param the state
        may hold DTensors (placed otherwise: redistributed) or full tensors of the param's
        global shape (each rank keeps its shard). Everything is checked first: on an error (a group or size mismatch,
        moments whose shape is not the param's, an amsgrad state, ...) nothing is modified.
        """
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result

        groups = self.param_groups
        saved_groups = deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match "
                             "the size of optimizer's group")
        master_default = self.defaults.get("master_weights", True)
        new_groups = []
        for gi, (group, saved) in enumerate(zip(groups, saved_groups)):
            saved["params"] = group["params"]
            if "param_names" in group and "param_names" not in saved:
                saved["param_names"] = group["param_names"]
            saved.setdefault("master_weights", master_default)
            for key, value in _LEAN_DEFAULTS.items():
                saved.setdefault(key, self.defaults.get(key, value))
            for key in _STORAGE_SETTINGS:  # how the state is kept: this optimizer's choice
                saved[key] = group.get(key, saved[key])
            saved.setdefault("decoupled_weight_decay", False)
            saved.setdefault("maximize", False)
            if self._force_decoupled:
                saved["decoupled_weight_decay"] = True
            self._check_group(saved, " (loaded param group %d)" % gi)
            new_groups.append(saved)

        id_map = dict(zip(chain.from_iterable(g["params"] for g in state_dict["param_groups"]),
                          chain.from_iterable(g["params"] for g in groups)))
        group_of = {id(p): g for g in new_groups for p in g["params"]}
        new_state: Dict[Any, Dict[str, Any]] = defaultdict(dict)
        for k, v in state_dict["state"].items():
            if k in id_map:
                param = id_map[k]
                new_state[param] = self._import_param_state(param, v, group_of[id(param)], k)
            else:
                new_state[k] = v
        replaced = [(gi, key, group.get(key), saved.get(key))
                    for gi, (group, saved) in enumerate(zip(groups, new_groups))
                    for key in _REPLACED_SETTINGS if group.get(key) != saved.get(key)]
        self.__setstate__({"state": new_state, "param_groups": new_groups})
        for gi, key, mine, theirs in replaced:
            # As in torch the checkpoint's settings win (a resumed run draws and averages as
            # the saved one did), but these change what the optimizer keeps: say so.
            warnings.warn("%s.load_state_dict: param group %d takes the checkpoint's %s=%r "
                          "instead of this optimizer's %r; set param_groups[%d][%r] after "
                          "loading to keep another" % (self._name(), gi, key, theirs, mine,
                                                       gi, key), UserWarning, stacklevel=2)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _import_param_state(self, param: torch.Tensor, value: Any, group: Dict[str, Any],
                            key: Any) -> Dict[str, Any]:
        where = "%s.load_state_dict: the state of param %r" % (self._name(), key)
        if not isinstance(value, dict):
            raise TypeError("%s must be a dict, got %s" % (where, type(value).__name__))
        if len(value) == 0:
            return {}
        if "max_exp_avg_sq" in value:
            raise NotImplementedError("%s has max_exp_avg_sq (amsgrad), which %s does not "
                                      "support" % (where, self._name()))
        value = _upgrade_keys(value)
        if "step" not in value:
            raise ValueError("%s has no 'step' (it has %s)" % (where, sorted(value)))
        for name in _Q8_DTYPES:
            if name not in value and name + _Q8 not in value:
                raise ValueError("%s has no %r (it has %s)" % (where, name, sorted(value)))
            if name in value and name + _Q8 in value:
                raise ValueError("%s has both %r and %r" % (where, name, name + _Q8))
        out: Dict[str, Any] = {}
        step = value["step"]
        if isinstance(step, torch.Tensor):
            if step.numel() != 1 or step.is_complex() or step.layout != torch.strided:
                raise ValueError("%s: step must be a number or a 1-element tensor, got a tensor "
                                 "of shape %s" % (where, tuple(step.shape)))
            out["step"] = step.detach().to(device=param.device, dtype=torch.float32,
                                           copy=True).reshape(())
        elif _is_real(step):
            out["step"] = torch.full((), float(step), dtype=torch.float32, device=param.device)
        else:
            raise TypeError("%s: step must be a number or a 1-element tensor, got %r"
                            % (where, step))
        low = param.dtype in _LOW_DTYPES
        for name in ("exp_avg", "exp_avg_q8", "exp_avg_sq", "exp_avg_sq_q8", "master_param",
                     "param_remainder", "ema_param"):
            if name not in value or (name in _STORAGE_KEYS and not low):
                continue
            t = value[name]
            if not isinstance(t, torch.Tensor):
                raise TypeError("%s: %s must be a tensor, got %s"
                                % (where, name, type(t).__name__))
            if t.shape != param.shape:
                raise ValueError("%s: %s has shape %s but the param has shape %s"
                                 % (where, name, tuple(t.shape), tuple(param.shape)))
            if name.endswith(_Q8):
                moment = name[:-len(_Q8)]
                codes, scale = _import_codes(param, moment, t, value, where)
                if scale is None:  # decoded
                    out[moment] = codes
                else:
                    out[name], out[name + "_scale"] = codes, scale
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
                                     "bfloat16 param has one" % (where, _dtype_name(param.dtype)))
                out[name] = _copy_like(param, t, torch.int16)
                continue
            if not t.is_floating_point() or t.layout != torch.strided:
                raise TypeError("%s: %s must be a dense floating-point tensor, got %s %s"
                                % (where, name, t.layout, t.dtype))
            # Moments in their saved precision (converted to the group's by _conform_state).
            keep = t.dtype if name in ("exp_avg", "exp_avg_sq") and t.dtype is torch.bfloat16 \
                else _F32
            out[name] = _copy_like(param, t, keep)
        if "master_param" in out and "param_remainder" in out:
            raise ValueError("%s has both a master_param and a param_remainder" % where)
        want = _storage_key(param, group, where)
        if "param_remainder" in out and want == "master_param":
            # A remainder becomes a master by joining it with the param, which the model's
            # state may not hold yet (nothing here can tell): join it at the next step, when
            # it surely does. The moments are converted now.
            _conform_state(param, out, group, where, storage=False)
            if group.get("ema_decay") is not None and "ema_param" not in out:
                out.pop("ema_param", None)  # made from the joined value at that step
            return _keep_unknown_keys(out, value)
        # Into the group's form (a master becomes a remainder only if the param is its round,
        # i.e. the model was loaded first).
        _conform_state(param, out, group, where)
        if not any(k in value for k in _STORAGE_KEYS):
            # No fp32 value in the state (a torch checkpoint, a master-free one): the master (or
            # remainder) and the EMA start from the param at the next step, so the model's
            # state may be loaded before or after the optimizer's.
            for key in _STORAGE_KEYS:
                out.pop(key, None)
            if "ema_param" not in value:
                out.pop("ema_param", None)
        return _keep_unknown_keys(out, value)


def _keep_unknown_keys(out: Dict[str, Any], value: Dict[str, Any]) -> Dict[str, Any]:
    """A loaded param state with the saved entries mpext does not know kept as torch keeps
    them."""
    for name, v in value.items():
        if name not in ("step", "exp_avg", "exp_avg_sq", "ema_param") + _STORAGE_KEYS \
                + _CODE_KEYS + _OLD_SCALE_KEYS:
            out[name] = v
    return out


_MOMENTS = (("exp_avg", "exp_avg_dtype"), ("exp_avg_sq", "exp_avg_sq_dtype"))
# Settings load_state_dict takes from the checkpoint (as torch does) that change what the
# optimizer keeps or draws, so that a difference is warned about.
_REPLACED_SETTINGS = ("seed", "moment_rounding", "ema_decay")
_FORMAT_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int8: "int8",
                 torch.uint8: "uint8"}
_FORMAT_BY_NAME = {v: k for k, v in _FORMAT_NAMES.items()}
_STORAGE_KEYS = ("master_param", "param_remainder")
_STORAGE_SETTINGS = ("master_weights", "param_remainders", "stochastic_rounding", "exp_avg_dtype",
                     "exp_avg_sq_dtype", "block_size")
# mpext's param-group keys beyond torch's (master_weights aside), with their defaults.
_LEAN_DEFAULTS = {"unscale_grads": True, "param_remainders": False, "stochastic_rounding": False,
                  "exp_avg_dtype": torch.float32, "exp_avg_sq_dtype": torch.float32,
                  "moment_rounding": "stochastic", "seed": 0, "block_size": 256,
                  "ema_decay": None}

@contextlib.contextmanager
def _ema_swapped(opt: "Adam", pairs: Iterable[Tuple[torch.Tensor, torch.Tensor]]):
    """For each (target, param) of ``pairs`` whose param has an EMA in ``opt``'s state: the
    target holds the EMA (``target.copy_(ema)``) inside the context and gets back its exact
    value on exit. ``ema_weights`` of mpext.optim and of MixedPrecisionOptimizer (whose
    targets are the model params of the inner optimizer's masters)."""
    saved = []
    try:
        with torch.no_grad():
            for target, p in pairs:
                ema = (opt.state.get(p) or {}).get("ema_param")
                if ema is not None:
                    saved.append((target, target.detach().clone()))
                    target.copy_(ema)
        yield
    finally:
        with torch.no_grad():
            for target, value in saved:
                target.copy_(value)


# ---- 8-bit moments (docs/moments_8bit.md; the kernel's format is mpext/adam.h's) ----
# Coded state has keys of its own (docs/lean_state.md, "State keys"): torch's names hold only
# values, so no loader can take a code for a moment. A moment's 8-bit codes are
# "<moment>_q8", their blocks' scales "<moment>_q8_scale".
_Q8, _Q8_SCALE = "_q8", "_q8_scale"
_Q8_DTYPES = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}
_CODE_KEYS = tuple(m + sfx for m in _Q8_DTYPES for sfx in (_Q8, _Q8_SCALE))
# Checkpoints written before coded state had keys of its own: codes under the moment's name.
_OLD_SCALE_KEYS = ("exp_avg_scale", "exp_avg_sq_scale")


def _moment_of(state: Dict[str, Any], key: str) -> Tuple[Optional[torch.Tensor],
                                                         Optional[torch.Tensor]]:
    """A moment's stored tensor in a param's state and, for 8-bit codes, its blocks' scales
    (None for values)."""
    codes = state.get(key + _Q8)
    if codes is not None:
        return codes, state.get(key + _Q8_SCALE)
    return state.get(key), None


def _upgrade_keys(value: Dict[str, Any]) -> Dict[str, Any]:
    """A saved param state in the current key scheme: 8-bit codes saved under a moment's own
    name (with "<moment>_scale") move to "<moment>_q8" / "<moment>_q8_scale"."""
    if not any(isinstance(value.get(m), torch.Tensor) and value[m].dtype in _Q8_FORMAT
               for m in _Q8_DTYPES):
        return value
    value = dict(value)
    for m in _Q8_DTYPES:
        t = value.get(m)
        if isinstance(t, torch.Tensor) and t.dtype in _Q8_FORMAT and m + _Q8 not in value:
            value[m + _Q8] = value.pop(m)
            if m + "_scale" in value:
                value[m + _Q8_SCALE] = value.pop(m + "_scale")
    return value
# (exponent bits, mantissa bits) of each moment's code: adam_rule.h's MP_Q8_{M,V}_{E,M}BITS
_Q8_FORMAT = {torch.int8: (3, 4), torch.uint8: (4, 4)}
_Q8_TABLES: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _moment_dtype(param: torch.Tensor, group: Dict[str, Any], dtype_key: str) -> torch.dtype:
    """The dtype a param's moment is kept in: its group's, but FP32 instead of 8-bit codes for
    a param of fewer than MIN_8BIT_NUMEL elements."""
    dt = group.get(dtype_key, _F32)
    if isinstance(dt, str):  # a group edited by name that no check has normalized yet
        dt = _FORMAT_BY_NAME.get(dt, dt)
    if dt in _Q8_FORMAT and param.numel() < MIN_8BIT_NUMEL:
        return _F32
    return dt


def _check_q8_param(param: torch.Tensor, group: Dict[str, Any], where: str) -> None:
    """8-bit moments are per local block of memory: a DTensor's shards would each have their
    own blocks, which no DTensor placement describes, so they are refused."""
    if _is_dtensor(param) and _moment_dtype(param, group, "exp_avg_dtype") is torch.int8:
        raise NotImplementedError("%s is a DTensor; 8-bit moments are not supported for "
                                  "DTensor (FSDP2) params: use exp_avg_dtype=exp_avg_sq_dtype="
                                  "torch.bfloat16 for them" % where)


def new_moments(param: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any]) -> None:
    """Zero moments for a param's first step in its group's form: in the param's layout, with
    zero scales for 8-bit codes (which decode to zero)."""
    for key, dtype_key in _MOMENTS:
        dt = _moment_dtype(param, group, dtype_key)
        zeros = torch.zeros_like(param, dtype=dt, memory_format=torch.preserve_format)
        if dt in _Q8_FORMAT:
            nblocks = _q8_blocks(param.numel(), group.get("block_size", 256))
            state[key + _Q8] = zeros
            state[key + _Q8_SCALE] = torch.zeros(nblocks, dtype=_F32, device=param.device)
        else:
            state[key] = zeros


def _q8_blocks(n: int, block: int) -> int:
    return -(-n // block)


def _q8_block_of(n: int, nblocks: int) -> Optional[int]:
    """The block size of n elements in nblocks blocks: with power-of-two sizes only one gives
    more than one block, and any size >= n gives one (then n itself). None if none fits."""
    if nblocks == 1 and n >= 1:
        return max(n, 1)
    b = Q8_BLOCK_MIN
    while b <= Q8_BLOCK_MAX:
        if _q8_blocks(n, b) == nblocks:
            return b
        b *= 2
    return None


def _flat_view(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements in memory order, as a 1-D view: the order of the kernel's
    blocks."""
    if t.is_contiguous():
        return t.view(-1)
    order = sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d)), reverse=True)
    return t.permute(order).view(-1)


def _q8_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every magnitude code's value relative to its block's reference, by its definition
    (float64, increasing with the code): 2^(e-T) (1 + f/2^M), or 2^(1-T) f/2^M for e = 0."""
    key = (dtype, device)
    if key not in _Q8_TABLES:
        ebits, mbits = _Q8_FORMAT[dtype]
        t = (1 << ebits) - 1
        vals = [math.ldexp(1 + f / 2 ** mbits, e - t) if e else math.ldexp(f / 2 ** mbits, 1 - t)
                for e in range(1 << ebits) for f in range(1 << mbits)]
        _Q8_TABLES[key] = torch.tensor(vals, dtype=torch.float64, device=device)
    return _Q8_TABLES[key]


def _q8_ref(amax_bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each block's reference 2^(E - 127) (float64; NaN for a block that is not finite) from
    the bits of its absmax (int64): E its exponent field rounded up to the code's precision, at
    least 2^ebits."""
    ebits, mbits = _Q8_FORMAT[dtype]
    e = ((amax_bits + (1 << (23 - mbits)) - 1) >> 23).clamp_min(1 << ebits)
    return torch.where(e >= 255, torch.full_like(e, math.nan, dtype=torch.float64),
                       torch.pow(2.0, (e.clamp_max(254) - 127).double()))


def _f32_bits(t: torch.Tensor) -> torch.Tensor:
    """The magnitude bits of a float32 tensor, as int64."""
    return t.contiguous().view(torch.int32).to(torch.int64) & 0x7FFFFFFF


def q8_decode(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values of 8-bit moment codes (int8: exp_avg, uint8: exp_avg_sq) with their
    blocks' scales, in the codes' shape and layout: exact, as the kernel decodes them."""
    flat = _flat_view(codes)
    n = flat.numel()
    block = _q8_block_of(n, scale.numel())
    c = flat.view(torch.uint8).to(torch.int64)
    signed = codes.dtype is torch.int8
    table = _q8_table(codes.dtype, codes.device)
    ref = _q8_ref(_f32_bits(scale.float()), codes.dtype)
    val = table[c & 0x7F if signed else c] * ref.repeat_interleave(block)[:n]
    if signed:
        val = torch.where(c >= 128, -val, val)
    out = torch.empty_like(codes, dtype=_F32, memory_format=torch.preserve_format)
    _flat_view(out).copy_(val)
    return out


def q8_encode(x: torch.Tensor, dtype: torch.dtype, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The 8-bit codes (``dtype`` int8 for exp_avg, uint8 for exp_avg_sq; x's shape and layout)
    and blocks' scales (their absmax) of float32 values x, each rounded to the nearest code
    (ties to the even code): what the kernel writes with moment_rounding="nearest". A block
    that is not finite gets code 0 (it decodes to NaN whatever its codes)."""
    flat = _flat_view(x.float())
    n = flat.numel()
    nb = _q8_blocks(n, block)
    bits = _f32_bits(flat)
    amax = torch.zeros(nb * block, dtype=torch.int64, device=x.device)
    amax[:n] = bits
    amax = amax.view(nb, block).amax(1) if n else amax.view(0)
    scale = amax.to(torch.int32).view(_F32)
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
    _flat_view(out).view(torch.uint8).copy_(code)
    return out, scale


def _import_codes(param: torch.Tensor, moment: str, t: torch.Tensor, value: Dict[str, Any],
                  where: str) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A loaded moment's 8-bit codes and its scales, checked and copied to the param; or, for
    codes saved in another memory layout than the param's, or full codes for a DTensor param,
    their fp32 values and None."""
    name, skey = moment + _Q8, moment + _Q8_SCALE
    if t.dtype is not _Q8_DTYPES[moment] or t.layout != torch.strided:
        raise TypeError("%s: %s holds 8-bit codes, which must be a dense %s tensor, got %s %s"
                        % (where, name, _Q8_DTYPES[moment], t.layout, t.dtype))
    if _is_dtensor(t):
        raise NotImplementedError("%s: 8-bit moments are not supported for DTensor params" % where)
    sc = value.get(skey)
    if not (isinstance(sc, torch.Tensor) and sc.dtype is _F32 and sc.dim() == 1
            and not _is_dtensor(sc) and _q8_block_of(param.numel(), sc.numel()) is not None):
        raise ValueError("%s: %s holds 8-bit codes, so %s must be a 1-D float32 tensor of one "
                         "scale per block (a power-of-two block size in [%d, %d]), got %s"
                         % (where, name, skey, Q8_BLOCK_MIN, Q8_BLOCK_MAX,
                            tuple(sc.shape) if isinstance(sc, torch.Tensor) else sc))
    if _is_dtensor(param):
        # Full codes (a single-process checkpoint): their blocks span the whole tensor, so they
        # are decoded whole (exactly) and each rank keeps its shard of the values.
        return _copy_like(param, q8_decode(t.detach(), sc.detach()), _F32), None
    t, sc = t.detach().to(param.device), sc.detach().to(device=param.device, copy=True)
    codes = torch.empty_like(param, dtype=t.dtype, memory_format=torch.preserve_format)
    if not _same_memory_order(t, codes):
        # The blocks follow memory order: codes saved in another layout (channels_last vs
        # contiguous) group other elements, so they are decoded there (exactly), and
        # _conform_state quantizes the values again in the param's layout if the group keeps
        # 8-bit moments.
        return torch.empty_like(codes, dtype=_F32).copy_(q8_decode(t, sc)), None
    _flat_view(codes).copy_(_flat_view(t))
    return codes, sc


def _same_memory_order(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two dense tensors of one shape hold their elements in the same memory order
    (what :func:`_flat_view` walks)."""
    if a.stride() == b.stride():
        return True
    index = torch.arange(a.numel(), device=a.device).view(a.shape)
    order = [_flat_view(torch.empty_like(t, dtype=torch.int64).copy_(index)) for t in (a, b)]
    return torch.equal(*order)


_FP16_REMAINDER = ("%s is float16, and param_remainders=True needs bfloat16 params (a "
                   "float16 value is not the high half of an fp32 one); give float16 params a "
                   "group with param_remainders=False, or master_weights=False with "
                   "stochastic_rounding=True")


def _storage_key(param: torch.Tensor, group: Dict[str, Any], where: str) -> Optional[str]:
    """The state entry that holds the param's fp32 value under its group's settings:
    "master_param", "param_remainder" (bf16 params), or None (fp32 params; no master)."""
    if param.dtype is _F32 or not group.get("master_weights", True):
        return None
    if group.get("param_remainders", False):
        if param.dtype is not torch.bfloat16:  # changed in place after construction
            raise ValueError(_FP16_REMAINDER % where)
        return "param_remainder"
    return "master_param"


def _conform_state(param: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any],
                   where: str, storage: bool = True) -> None:
    """Converts a param's state in place into its group's form: moments into the group's
    dtypes (to nearest even when narrowed; 8-bit codes decoded exactly, or encoded to the
    nearest code with the group's block size), the fp32 value into the group's storage (a master
    from a remainder and the param, a remainder from a master whose round is the param, a new
    master or a zero remainder from the param itself, nothing without a master). The one
    conversion of optimizer state, for a group changed between steps and for load_state_dict
    (which converts the moments only, ``storage=False``: the rest reads the param)."""
    _check_q8_param(param, group, where)
    block = group.get("block_size", 256)
    for key, dtype_key in _MOMENTS:
        dtype = _moment_dtype(param, group, dtype_key)
        t, scale = _moment_of(state, key)
        if t is None:
            continue
        if scale is not None:
            if t.dtype is dtype and scale.numel() == _q8_blocks(param.numel(), block):
                continue  # the group's form already (blocks of one size agree in number)
            value = q8_decode(t, scale)
        elif t.dtype is dtype:
            continue
        else:
            value = t
        for k in (key, key + _Q8, key + _Q8_SCALE):
            state.pop(k, None)
        if dtype in _Q8_FORMAT:
            state[key + _Q8], state[key + _Q8_SCALE] = q8_encode(value, dtype, block)
        else:
            state[key] = value.to(dtype)
    if not storage:
        return
    want = _storage_key(param, group, where)
    fresh = False  # a remainder made here from the param: the master is the param
    if want is not None and want not in state:
        if want == "master_param":
            rem = state.get("param_remainder")
            state[want] = _fp32_copy(param) if rem is None else _join_remainder(param, rem)
        else:
            master = state.get("master_param")
            fresh = master is None
            state[want] = (_split_master(param, master, where) if master is not None
                           else torch.zeros_like(param, dtype=torch.int16,
                                                 memory_format=torch.preserve_format))
    for key in _STORAGE_KEYS:
        if key != want:
            state.pop(key, None)
    if group.get("ema_decay") is None:
        state.pop("ema_param", None)
    elif "ema_param" not in state:  # from the fp32 value now (a first step copies it anyway)
        rem = None if fresh else state.get("param_remainder")
        state["ema_param"] = (_join_remainder(param, rem) if rem is not None
                              else _fp32_copy(param, state.get("master_param")))


def _u32(t: torch.Tensor) -> torch.Tensor:
    """The bits of a float32 tensor as int64 values in [0, 2^32)."""
    return t.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _join_remainder(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master of a bf16 param and its int16 remainder: (param bits << 16) +
    remainder, exactly as the kernel joins them (mpext/adam_rule.h, mp_bf16_join)."""
    out = torch.empty_like(param, dtype=_F32, memory_format=torch.preserve_format)
    p, r = _local(param).detach(), _local(remainder)
    bits = (((p.view(torch.int16).to(torch.int64) & 0xFFFF) << 16) + r.to(torch.int64))
    bits = bits & 0xFFFFFFFF
    _local(out).copy_(torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32)
                      .view(_F32))
    return out


def _split_master(param: torch.Tensor, master: torch.Tensor, where: str) -> torch.Tensor:
    """The int16 remainder of an fp32 master under its bf16 param, as the kernel stores it
    (mp_bf16_master_bits, mp_bf16_remainder): a master halfway above an even bf16 value is one
    ulp lower first. The param must be the master's round to nearest even; otherwise the master
    belongs to other weights (e.g. the model's state is not loaded yet) and it is refused."""
    p, m = _local(param).detach(), _local(master).detach()
    x = _u32(m)
    finite = (x & 0x7F800000) != 0x7F800000
    x = x - (((x & 0x1FFFF) == 0x8000) & finite).to(torch.int64)
    nudged = torch.where(x >= 2 ** 31, x - 2 ** 32, x).to(torch.int32).view(_F32)
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
    _local(out).copy_(rem)
    return out


def _copy_like(param: torch.Tensor, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor of ``dtype`` in the param's device and memory layout, holding ``src``. For
    a DTensor param the copy is a DTensor placed as the param, and ``src`` may be a DTensor
    placed otherwise (redistributed) or a plain tensor of the param's global shape (each rank
    keeps its own shard, without communication)."""
    out = torch.empty_like(param, dtype=dtype, memory_format=torch.preserve_format)
    src = src.detach()
    if _is_dtensor(out):
        if not _is_dtensor(src):
            from torch.distributed.tensor import distribute_tensor
            src = distribute_tensor(src.to(out.device), out.device_mesh, out.placements,
                                    src_data_rank=None)
        elif src.device_mesh != out.device_mesh or src.placements != out.placements:
            src = src.redistribute(out.device_mesh, out.placements)
    elif _is_dtensor(src):
        src = src.full_tensor()
    return out.copy_(src)


def _fp32_copy(param: torch.Tensor, src: Optional[torch.Tensor] = None) -> torch.Tensor:
    """An fp32 :func:`_copy_like` of ``src`` (default: the param itself)."""
    return _copy_like(param, param if src is None else src, _F32)


def _to_device(t: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    if t is None:
        return None
    # Non-blocking only towards an accelerator: a host tensor must hold its value when used.
    return t.to(device=device, dtype=torch.float32, non_blocking=device.type != "cpu")


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


def _device_step(state: Dict[str, Any], device: torch.device) -> torch.Tensor:
    """The param's step count as the kernel needs it: a float32 scalar tensor on the param's
    device. A state loaded by other code (ZeroRedundancyOptimizer moves 0-dim state to the CPU,
    torch's non-fused Adam keeps a float or an int64 tensor) is converted once, in place."""
    step = state["step"]
    if not (isinstance(step, torch.Tensor) and step.dtype is _F32 and step.device == device
            and step.dim() == 0):
        step = torch.as_tensor(step).detach().to(device=device, dtype=_F32).reshape(())
        state["step"] = step
    return step


def fused_adam_step(items: Iterable[tuple], lr_tensors: LrTensors,
                    inv_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor]) -> None:
    """Steps every item with as few ``adam_step_`` calls as possible: one per device, learning
    rate and :class:`AdamHyper`, whatever the params' groups or dtypes. The one planner of the
    fused step, used by :class:`Adam` and by ``MixedPrecisionOptimizer``'s fast path.

    items: (param, grad, state, storage, lr, hyper, stream) per param: plain tensors (DTensors
    already as their local shards), ``state`` a dict with torch's ``exp_avg``, ``exp_avg_sq``
    (float32 or bfloat16), or 8-bit ``exp_avg_q8`` / ``exp_avg_sq_q8`` codes with their
    ``*_q8_scale``,
    and ``step`` (a step that is not a float32 scalar on the param's
    device is converted in place), ``storage`` the fp32 master (float32) or the remainder
    (int16) of a bf16/fp16 param, or None (an fp32 param, or none kept), ``lr`` a float or a
    tensor, ``hyper`` an :class:`AdamHyper`, ``stream`` the param's stochastic-rounding stream
    (an int in [0, 2^32)). Every call's arguments are assembled before the first launch, so a
    failing check leaves everything unchanged."""
    calls: Dict[tuple, list] = {}
    for item in items:
        lr = item[4]
        lr_key = ("tensor", id(lr)) if isinstance(lr, torch.Tensor) else float(lr)
        calls.setdefault((item[0].device, lr_key, item[5]), []).append(item)
    launches = []
    copied = []  # (the gradient, its copy in the param's layout) whose copy may be written
    per_device: Dict[torch.device, tuple] = {}
    slots: Dict[torch.device, int] = defaultdict(int)
    for (device, _, hyper), entries in calls.items():
        if device not in per_device:
            per_device[device] = (_to_device(inv_scale, device), _to_device(found_inf, device),
                                  torch.empty(0, dtype=_F32, device=device),
                                  torch.empty(0, dtype=torch.int16, device=device))
        dev_inv, dev_found, empty, empty16 = per_device[device]
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        masters, remainders, streams, m_scales, v_scales, emas = [], [], [], [], [], []
        for p, g, state, storage, _, _, stream in entries:
            if g.stride() != p.stride() and not same_layout(g, p):
                # e.g. a channels_last param with a contiguous gradient
                copy = torch.empty_like(p, dtype=g.dtype).copy_(g)
                if hyper.unscale_grads and dev_inv is not None:
                    copied.append((g, copy))
                g = copy
            params.append(p)
            grads.append(g)
            m, ms = _moment_of(state, "exp_avg")
            v, vs = _moment_of(state, "exp_avg_sq")
            exp_avgs.append(_local(m))
            exp_avg_sqs.append(_local(v))
            steps.append(_device_step(state, device))
            is_remainder = storage is not None and storage.dtype is torch.int16
            masters.append(empty if storage is None or is_remainder else storage)
            remainders.append(storage if is_remainder else empty16)
            streams.append(stream)
            m_scales.append(empty if ms is None else ms)
            v_scales.append(empty if vs is None else vs)
            ema = state.get("ema_param")
            emas.append(empty if ema is None else _local(ema))
        if all(m is empty for m in masters):
            masters = []
        q8 = any(m is not empty for m in m_scales)
        lr_t = lr_tensors.get((device, slots[device]), device, entries[0][4])
        slots[device] += 1
        seed = hyper.seed - 2 ** 64 if hyper.seed >= 2 ** 63 else hyper.seed  # the schema's int64
        launches.append(((params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr_t)
                         + tuple(hyper[:6]),
                         dict(inv_scale=dev_inv, found_inf=dev_found,
                              unscale_grads=hyper.unscale_grads,
                              remainders=None if all(r is empty16 for r in remainders)
                              else remainders,
                              master_free=hyper.master_free,
                              stochastic_rounding=hyper.stochastic_rounding,
                              moments_round_nearest=hyper.moments_round_nearest, seed=seed,
                              sr_streams=streams, exp_avg_scales=m_scales if q8 else None,
                              exp_avg_sq_scales=v_scales if q8 else None,
                              block_size=hyper.block_size,
                              ema_params=None if all(e is empty for e in emas) else emas,
                              ema_decay=hyper.ema_decay)))
    for args, kwargs in launches:
        torch.ops.mpext.adam_step_(*args, **kwargs)
    for g, copy in copied:  # the unscaled values back into the gradient's own layout
        g.copy_(copy)


class AdamW(Adam):
    """AdamW (decoupled weight decay, ``weight_decay=1e-2`` by default) with torch's math, on
    mpext's fused kernel; see :class:`Adam` for the arguments and the master weights."""

    _force_decoupled = True

    def __init__(self, params, lr: Union[float, torch.Tensor] = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, foreach: Optional[bool] = None,
                 capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, master_weights: bool = True,
                 unscale_grads: bool = True, param_remainders: bool = False,
                 stochastic_rounding: bool = False,
                 exp_avg_dtype: torch.dtype = torch.float32,
                 exp_avg_sq_dtype: torch.dtype = torch.float32,
                 moment_rounding: str = "stochastic", seed: int = 0,
                 block_size: int = 256, ema_decay: Optional[float] = None) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable,
                         differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, master_weights=master_weights,
                         unscale_grads=unscale_grads, param_remainders=param_remainders,
                         stochastic_rounding=stochastic_rounding,
                         exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype,
                         moment_rounding=moment_rounding, seed=seed, block_size=block_size,
                         ema_decay=ema_decay)


from . import lr_scheduler  # noqa: E402  (mpext.optim.lr_scheduler, as torch.optim has it)
