"""mpext.optim.sgd: the SGD rule (``mpext.optim.SGD``): torch.optim.SGD's arguments, defaults,
checks and update, its momentum buffer (``momentum_buffer``, none without momentum) and its
launch (``sgd_step_`` through mpext.optim._engine). Everything else is mpext.optim._base's."""
import math
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch.optim.sgd import sgd as _torch_sgd

from .._common import is_real as _is_real
from ._base import FusedOptimizer
from ._engine import StepItem, fused_step, rule_hyper, storage_hyper
from ._tensors import F32
from . import formats as F
from .formats import Quantity

__all__ = ["SGD"]


class SGDHyper(rule_hyper("_SGDFields", [("momentum", float), ("dampening", float),
                                          ("weight_decay", float), ("nesterov", bool),
                                          ("maximize", bool)])):
    """What the params of one ``sgd_step_`` call share besides device and learning rate (then
    the storage fields of :class:`~mpext.optim._engine.AdamHyper`)."""
    __slots__ = ()
    op = "sgd_step_"
    moment_lists = 1

    def quantities(self) -> tuple:
        return ("momentum_buffer",) if self.momentum != 0.0 else ()

    def rule_args(self) -> tuple:
        return (self.momentum, self.dampening, self.weight_decay, self.nesterov, self.maximize)


class SGD(FusedOptimizer):
    """SGD with torch.optim.SGD's arguments, defaults, checks and math (momentum, dampening,
    Nesterov, L2 weight decay, maximize), on mpext's fused kernel, with mpext's storage
    options. The momentum buffer is ``state["momentum_buffer"]`` (torch's key), a copy of the
    gradient after the param's first step as torch makes it; with ``momentum=0`` there is none.

    Args:
        params: iterable of params or of dicts defining param groups, as
            :class:`mpext.optim.Adam`. Params with sparse gradients (``nn.Embedding(sparse=
            True)``) and float64 / complex params are stepped by torch.optim's own
            implementation (``torch.optim.sgd.sgd``: torch's bits and state; docs/dropin.md).
        lr (float or 1-element Tensor): learning rate (default 1e-3).
        momentum (float): momentum factor (default 0).
        dampening (float): dampening for momentum (default 0).
        weight_decay (float): L2 penalty (default 0).
        nesterov (bool): Nesterov momentum (default False; needs a momentum and zero dampening).
        maximize (bool): maximize the objective (default False).
        foreach, fused: accepted for compatibility with torch and ignored (always fused).
        differentiable (bool): must be False.
        momentum_dtype: the buffer's storage: ``torch.float32`` (default), ``torch.bfloat16``
            (rounded per ``moment_rounding``) or ``"q8"`` / ``torch.int8`` (signed 8-bit block
            codes, state ``momentum_buffer_q8`` / ``momentum_buffer_q8_scale``); only with a
            momentum.
        master_weights, param_remainders, stochastic_rounding, moment_rounding, seed,
        block_size, ema_decay, unscale_grads: as :class:`mpext.optim.Adam`'s.

    ``state["step"]`` (which torch's SGD does not keep) counts the param's steps: it names the
    stochastic-rounding streams and tells the kernel the buffer's first step.
    """

    _op = "sgd_step_"
    moments = (Quantity("momentum_buffer", "momentum_dtype", True),)

    def __init__(self, params, lr: Union[float, torch.Tensor] = 1e-3, momentum: float = 0,
                 dampening: float = 0, weight_decay: float = 0, nesterov: bool = False, *,
                 maximize: bool = False, foreach: Optional[bool] = None,
                 differentiable: bool = False, fused: Optional[bool] = None,
                 master_weights: bool = True, unscale_grads: bool = True,
                 param_remainders: bool = False, stochastic_rounding: bool = False,
                 momentum_dtype: torch.dtype = torch.float32,
                 moment_rounding: str = "stochastic", seed: int = 0, block_size: int = 256,
                 ema_decay: Optional[float] = None) -> None:
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:  # torch's checks, in its order
            raise ValueError("Tensor lr must be 1-element")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                        foreach=foreach, differentiable=differentiable, fused=fused,
                        master_weights=master_weights, unscale_grads=unscale_grads,
                        param_remainders=param_remainders,
                        stochastic_rounding=stochastic_rounding, momentum_dtype=momentum_dtype,
                        moment_rounding=moment_rounding, seed=seed, block_size=block_size,
                        ema_decay=ema_decay)
        if fused and differentiable:  # torch's (made before mpext's differentiable refusal)
            raise RuntimeError("`fused` does not support `differentiable`")
        if fused and foreach:
            raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
        super().__init__(params, defaults)

    def _check_rule(self, group: Dict[str, Any], where: str) -> None:
        momentum = group.get("momentum")
        if not _is_real(momentum) or not 0.0 <= momentum or not math.isfinite(momentum):
            raise ValueError(f"Invalid momentum value: {momentum}")
        dampening = group.get("dampening")
        if not _is_real(dampening) or not math.isfinite(dampening):
            raise ValueError("%s: dampening must be a finite number, got %r%s"
                             % (self._name(), dampening, where))
        wd = group.get("weight_decay")
        if not _is_real(wd) or not 0.0 <= wd or not math.isfinite(wd):
            raise ValueError(f"Invalid weight_decay value: {wd}")
        if group.get("nesterov", False) and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        dt = group.get("momentum_dtype", F32)
        if momentum == 0 and not F.is_default(dt, self.moments[0]):
            dt = F.moment_dtype(dt, self.moments[0])
            raise ValueError("%s: momentum_dtype=%r stores the momentum buffer, but momentum=0 "
                             "keeps none; leave momentum_dtype at torch.float32 or give a "
                             "momentum%s" % (self._name(), dt, where))

    # The torch path (docs/dropin.md): sparse gradients and float64 / complex params are
    # stepped by torch.optim.sgd.sgd, as torch.optim.SGD steps them, with torch's state (a
    # momentum_buffer, sparse for a sparse gradient, and no step).
    _TORCH_DTYPES = frozenset((torch.float64, torch.complex64, torch.complex128))
    _TORCH_SPARSE = True
    _TORCH_GROUP_DEFAULTS = {"foreach": None, "differentiable": False, "fused": None}
    _RULE = FusedOptimizer._RULE_SIGNATURES[0][0]
    _RULE_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov")

    def _torch_state(self, p: torch.Tensor, state: Dict[str, Any]) -> bool:
        buf = state.get("momentum_buffer")
        return isinstance(buf, torch.Tensor) and buf.layout != torch.strided

    def _check_torch_grad(self, p: torch.Tensor, g: torch.Tensor, group: Dict[str, Any],
                          where: str) -> None:
        # What torch.optim.sgd.sgd cannot add: a sparse tensor and a dense one ("add(sparse,
        # dense) is not supported"), raised there only once the params before are stepped.
        sparse = g.layout != torch.strided
        buf = (self.state.get(p) or {}).get("momentum_buffer") if group["momentum"] else None
        buf_sparse = isinstance(buf, torch.Tensor) and buf.layout != torch.strided
        if sparse and group["weight_decay"] != 0:
            why = ("a sparse gradient with weight_decay=%r: torch's SGD adds the dense "
                   "param to the gradient; pass weight_decay=0 for this param's group"
                   % group["weight_decay"])
        elif sparse and group["nesterov"] and buf is not None and not buf_sparse:
            why = ("a sparse gradient with nesterov=True and a dense momentum buffer (kept "
                   "from dense gradients): torch's SGD adds the buffer to the gradient")
        elif not sparse and buf_sparse:
            why = ("a dense gradient and a sparse momentum buffer (kept from sparse gradients): "
                   "torch's SGD adds the gradient to the buffer")
        else:
            return
        raise RuntimeError("%s has %s; torch.optim.SGD refuses it too (add(sparse, dense) is "
                           "not supported). Nothing was stepped" % (where, why))

    def _torch_step(self, group: Dict[str, Any], params: List[torch.Tensor],
                    grads: List[torch.Tensor]) -> None:
        # torch.optim.SGD's _init_group and step, for these params
        momentum = group["momentum"]
        bufs = [self.state[p].get("momentum_buffer") for p in params] if momentum != 0 else []
        _torch_sgd(
            params, grads, bufs, weight_decay=group["weight_decay"], momentum=momentum,
            lr=group["lr"], dampening=group["dampening"], nesterov=group["nesterov"],
            maximize=group["maximize"],
            has_sparse_grad=any(g.layout != torch.strided for g in grads),
            foreach=group.get("foreach"), fused=None)
        if momentum != 0:
            for p, buf in zip(params, bufs):
                self.state[p]["momentum_buffer"] = buf

    def _fill_group(self, group: Dict[str, Any]) -> None:
        group.setdefault("maximize", False)
        group.setdefault("nesterov", False)
        group.setdefault("dampening", 0)

    def _moments_of(self, group: Dict[str, Any]):
        return self.moments if group["momentum"] != 0 else ()

    def _import_param_state(self, param: torch.Tensor, value: Any, group: Dict[str, Any],
                            key: Any) -> Dict[str, Any]:
        if isinstance(value, dict) and "momentum_buffer" in value and "step" not in value \
                and not self._takes_torch_state(param, group, value):
            # torch.optim.SGD's state: a buffer (None without momentum) and no step count. A
            # saved state means a stepped param: step 1 (the buffer is not made anew).
            value = {k: v for k, v in value.items() if v is not None}
            value["step"] = torch.tensor(1.0)
        return super()._import_param_state(param, value, group, key)

    def _hyper(self, group: Dict[str, Any]) -> SGDHyper:
        return SGDHyper(float(group["momentum"]), float(group["dampening"]),
                        float(group["weight_decay"]), bool(group.get("nesterov", False)),
                        bool(group.get("maximize", False)), *storage_hyper(group))

    def _launch(self, items: List[StepItem], inv_scale: Optional[torch.Tensor],
                found_inf: Optional[torch.Tensor]) -> None:
        fused_step(items, self._lr_tensors, inv_scale, found_inf)
