"""mpext.optim.lion: the Lion rule (``mpext.optim.Lion``): lion-pytorch's arguments, defaults and
update, its one moment (``exp_avg``) and its launch (``lion_step_`` through
mpext.optim._engine). Everything else -- groups, state formats, state_dict, EMA, GradScaler
protocol, DTensors -- is mpext.optim._base's."""
import math
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from .._common import is_real as _is_real
from ._base import FusedOptimizer
from ._engine import StepItem, fused_step, rule_hyper, storage_hyper
from .formats import Quantity

__all__ = ["Lion"]


class LionHyper(rule_hyper("_LionFields", [("beta1", float), ("beta2", float),
                                            ("weight_decay", float), ("maximize", bool)])):
    """What the params of one ``lion_step_`` call share besides device and learning rate (then
    the storage fields of :class:`~mpext.optim._engine.AdamHyper`)."""
    __slots__ = ()
    op = "lion_step_"
    moment_lists = 1

    def quantities(self) -> tuple:
        return ("exp_avg",)

    def rule_args(self) -> tuple:
        return (self.beta1, self.beta2, self.weight_decay, self.maximize)


class Lion(FusedOptimizer):
    """Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023) with
    lion-pytorch's arguments, defaults and update, bit for bit on FP32 params, on mpext's fused
    kernel::

        p = p * (1 - lr * weight_decay)
        p = p - lr * sign(beta1 * exp_avg + (1 - beta1) * grad)
        exp_avg = beta2 * exp_avg + (1 - beta2) * grad

    Args:
        params: iterable of params or of dicts defining param groups (float32, bfloat16 or
            float16, on CPU, or DTensors of those), as :class:`mpext.optim.Adam`.
        lr (float or 1-element Tensor): learning rate (default 1e-4).
        betas (Tuple[float, float]): the interpolation of the update and the decay of the
            moment, each in [0, 1] (default (0.9, 0.99)).
        weight_decay (float): decoupled weight decay, ``p *= 1 - lr * weight_decay`` (default 0).
        decoupled_weight_decay (bool): lion-pytorch's option: the decay is divided by the
            initial lr (default False).
        use_triton (bool): lion-pytorch's option; must be False (the kernel is mpext's).
        maximize (bool): maximize the objective (default False; not in lion-pytorch).
        master_weights, param_remainders, stochastic_rounding, moment_rounding, seed,
        block_size, ema_decay, unscale_grads: as :class:`mpext.optim.Adam`'s.
        exp_avg_dtype: the moment's storage: ``torch.float32`` (default), ``torch.bfloat16``
            (rounded per ``moment_rounding``) or ``"q8"`` / ``torch.int8`` (signed 8-bit
            block codes with one FP32 scale per block, state ``exp_avg_q8`` /
            ``exp_avg_q8_scale``; params below ``MIN_8BIT_NUMEL`` elements keep FP32).
    """

    _op = "lion_step_"
    moments = (Quantity("exp_avg", "exp_avg_dtype", True),)

    def __init__(self, params, lr: Union[float, torch.Tensor] = 1e-4,
                 betas: Tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0,
                 use_triton: bool = False, decoupled_weight_decay: bool = False, *,
                 maximize: bool = False, master_weights: bool = True,
                 unscale_grads: bool = True, param_remainders: bool = False,
                 stochastic_rounding: bool = False,
                 exp_avg_dtype: torch.dtype = torch.float32,
                 moment_rounding: str = "stochastic", seed: int = 0, block_size: int = 256,
                 ema_decay: Optional[float] = None) -> None:
        if use_triton:
            raise ValueError("mpext.optim.Lion: use_triton=True is lion-pytorch's Triton kernel; "
                             "mpext's step is its own fused kernel (use_triton must be False)")
        if isinstance(betas, (list, tuple)) and len(betas) == 2:
            betas = tuple(float(b) if isinstance(b, torch.Tensor) else b for b in betas)
        self._init_lr = float(lr)
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize,
                        decoupled_weight_decay=decoupled_weight_decay,
                        master_weights=master_weights, unscale_grads=unscale_grads,
                        param_remainders=param_remainders,
                        stochastic_rounding=stochastic_rounding, exp_avg_dtype=exp_avg_dtype,
                        moment_rounding=moment_rounding, seed=seed, block_size=block_size,
                        ema_decay=ema_decay)
        super().__init__(params, defaults)

    def _check_rule(self, group: Dict[str, Any], where: str) -> None:
        betas = group.get("betas")
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ValueError("%s: betas must be a pair of floats, got %r%s"
                             % (self._name(), betas, where))
        for i, b in enumerate(betas):
            if not _is_real(b) or not 0.0 <= b <= 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b}")
        wd = group.get("weight_decay")
        if not _is_real(wd) or not 0.0 <= wd or not math.isfinite(wd):
            raise ValueError(f"Invalid weight_decay value: {wd}")
        if group.get("decoupled_weight_decay", False) and not self._init_lr > 0.0:
            raise ValueError("%s: decoupled_weight_decay=True divides weight_decay by the "
                             "initial lr, which must then be > 0, got %r%s"
                             % (self._name(), self._init_lr, where))

    # lion-pytorch has no functional implementation to hand float64 params or sparse
    # gradients to: they are refused (docs/dropin.md).
    _RULE = FusedOptimizer._RULE_SIGNATURES[2][0]
    _RULE_KEYS = ("lr", "betas", "weight_decay")
    _TORCH_GROUP_DEFAULTS: Dict[str, Any] = {}  # lion-pytorch's groups have none of torch's

    def _import_param_state(self, param: torch.Tensor, value: Any, group: Dict[str, Any],
                            key: Any) -> Dict[str, Any]:
        if isinstance(value, dict) and "exp_avg" in value and "step" not in value:
            # lion-pytorch's state: the moment and no step count (Lion's update reads none;
            # mpext's names its SR streams by it). A saved state means a stepped param: step 1.
            value = dict(value, step=torch.tensor(1.0))
        return super()._import_param_state(param, value, group, key)

    def _fill_group(self, group: Dict[str, Any]) -> None:
        group.setdefault("maximize", False)
        group.setdefault("decoupled_weight_decay", False)

    def _hyper(self, group: Dict[str, Any]) -> LionHyper:
        beta1, beta2 = (float(b) for b in group["betas"])
        wd = float(group["weight_decay"])
        if group.get("decoupled_weight_decay", False):
            wd /= self._init_lr  # lion-pytorch's reading of the option
        return LionHyper(beta1, beta2, wd, bool(group.get("maximize", False)),
                         *storage_hyper(group))

    def _launch(self, items: List[StepItem], inv_scale: Optional[torch.Tensor],
                found_inf: Optional[torch.Tensor]) -> None:
        fused_step(items, self._lr_tensors, inv_scale, found_inf)
