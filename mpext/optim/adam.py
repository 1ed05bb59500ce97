"""mpext.optim.adam: the Adam and AdamW rules (``mpext.optim.Adam`` / ``mpext.optim.AdamW``):
torch's defaults and arguments, their checks, the rule's moments (``exp_avg``, ``exp_avg_sq``)
and its launch (``adam_step_`` through mpext.optim._engine). Everything else -- groups, state
formats, state_dict, EMA, GradScaler protocol, DTensors -- is mpext.optim._base's; the
behaviour is described in the package's docstring (``help(mpext.optim)``)."""
import math
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch.optim.adam import adam as _torch_adam

from .._common import is_real as _is_real
from ._base import FusedOptimizer
from ._engine import StepItem, adam_hyper, fused_adam_step
from ._tensors import local
from .formats import Quantity

__all__ = ["Adam", "AdamW"]


class Adam(FusedOptimizer):
    """Adam (``decoupled_weight_decay=False``: L2 weight decay added to the gradient) or AdamW
    (``decoupled_weight_decay=True``) with torch's math, on mpext's fused kernel.

    Args:
        params: iterable of params or of dicts defining param groups; params must be float32,
            bfloat16 or float16 tensors on a device mpext has a kernel for (CPU, CUDA), or
            DTensors of those (FSDP2): each rank steps its local shards, and the moments and
            masters are DTensors placed as the param (see the module docstring). float64 and
            complex params are stepped by torch.optim's implementation (docs/dropin.md);
            non-contiguous ones through a contiguous copy, with a contiguous clone's bits.
        lr (float or 1-element Tensor): learning rate (default 1e-3).
        betas (Tuple[float, float]): moment coefficients (default (0.9, 0.999)).
        eps (float): added to the denominator (default 1e-8).
        weight_decay (float): default 0 (Adam) / 1e-2 (AdamW).
        amsgrad (bool): the group's params are stepped by torch.optim's own implementation
            (``torch.optim.adam.adam``: torch's bits and state, no fused speed, no masters or
            lean formats; docs/dropin.md). Default False.
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
        exp_avg_dtype, exp_avg_sq_dtype (torch.dtype, or a moment format of
            mpext.optim.formats or its name): the storage of the first / second moment,
            ``torch.float32`` / ``"float32"`` (default) or ``torch.bfloat16`` /
            ``"bfloat16"`` (half the memory; stored with ``moment_rounding``), or together
            ``"q8"`` (``torch.int8`` / ``torch.uint8``): 8-bit codes of blocks of
            ``block_size`` elements with one FP32 scale per block (a quarter of the memory;
            params of fewer than ``MIN_8BIT_NUMEL`` elements keep FP32 moments; not for
            DTensor params). The group keeps the torch dtype. The update is computed in FP32
            either way.
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

    _force_decoupled = False  # AdamW: always decoupled, as torch.optim.AdamW
    _op = "adam_step_"
    # The rule's state quantities: exp_avg takes either sign, exp_avg_sq none.
    moments = (Quantity("exp_avg", "exp_avg_dtype", True),
               Quantity("exp_avg_sq", "exp_avg_sq_dtype", False))

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
        _torch_checks(lr, betas, foreach, capturable, fused, differentiable)
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
        super().__init__(params, defaults)

    # -----------------------------------------------------------------------------------------
    # The rule: its hyperparameters, their checks, its launch.

    def _check_rule(self, group: Dict[str, Any], where: str) -> None:
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

    # The torch path (docs/dropin.md): amsgrad groups and float64 / complex params are stepped
    # by torch.optim.adam.adam, as torch.optim.Adam/AdamW step them, with torch's state.
    _TORCH_DTYPES = frozenset((torch.float64, torch.complex64, torch.complex128))
    _RULE = FusedOptimizer._RULE_SIGNATURES[1][0]
    _RULE_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad")

    def _torch_group(self, group: Dict[str, Any]) -> bool:
        return bool(group.get("amsgrad", False))

    def _check_torch_grad(self, p: torch.Tensor, g: torch.Tensor, group: Dict[str, Any],
                          where: str) -> None:
        if g.layout != torch.strided:  # (a float64 or complex param's: torch's Adam refuses)
            raise RuntimeError("%s: %s does not support sparse gradients (a %s gradient); "
                               "use torch.optim.SparseAdam for sparse params"
                               % (where, type(self).__name__, g.layout))

    def _torch_step(self, group: Dict[str, Any], params: List[torch.Tensor],
                    grads: List[torch.Tensor]) -> None:
        # torch.optim.Adam's _init_group and step, for these params
        amsgrad = bool(group["amsgrad"])
        exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], []
        for p, g in zip(params, grads):
            if g.layout != torch.strided:
                raise RuntimeError("Adam does not support sparse gradients, please consider "
                                   "SparseAdam instead")
            state = self.state[p]
            if len(state) == 0:
                # torch's: step a float32 CPU scalar, moments in the param's dtype and layout
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if amsgrad and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if amsgrad:
                max_exp_avg_sqs.append(state["max_exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        _torch_adam(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
            amsgrad=amsgrad, has_complex=any(torch.is_complex(p) for p in params),
            beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=group["maximize"], foreach=group.get("foreach"),
            capturable=False, differentiable=False, fused=None,
            decoupled_weight_decay=bool(self._force_decoupled
                                        or group.get("decoupled_weight_decay", False)))

    def _fill_group(self, group: Dict[str, Any]) -> None:
        group.setdefault("amsgrad", False)
        group.setdefault("maximize", False)
        if self._force_decoupled:
            group["decoupled_weight_decay"] = True
        else:
            group.setdefault("decoupled_weight_decay", False)

    def _hyper(self, group: Dict[str, Any]):
        return adam_hyper(group, self._force_decoupled)

    def _launch(self, items: List[StepItem], inv_scale: Optional[torch.Tensor],
                found_inf: Optional[torch.Tensor]) -> None:
        fused_adam_step(items, self._lr_tensors, inv_scale, found_inf)

    def _import_param_state(self, param: torch.Tensor, value: Any, group: Dict[str, Any],
                            key: Any) -> Dict[str, Any]:
        if not (isinstance(value, dict) and "max_exp_avg_sq" in value) \
                or self._takes_torch_state(param, group, value):
            return super()._import_param_state(param, value, group, key)
        # An amsgrad state (amsgrad since turned off, or a torch checkpoint) into a group
        # without amsgrad: kept as torch keeps it, in the param's dtype, and left alone by the
        # step as torch's leaves it, until amsgrad is set again and torch's implementation
        # continues from it.
        value = dict(value)
        m = value.pop("max_exp_avg_sq")
        where = "%s.load_state_dict: the state of param %r" % (self._name(), key)
        if not (isinstance(m, torch.Tensor) and m.is_floating_point()
                and m.layout == torch.strided):
            raise TypeError("%s: max_exp_avg_sq must be a dense floating-point tensor, got %s"
                            % (where, type(m).__name__ if not isinstance(m, torch.Tensor)
                               else "%s %s" % (m.layout, m.dtype)))
        if m.shape != param.shape:
            raise ValueError("%s: max_exp_avg_sq has shape %s but the param has shape %s"
                             % (where, tuple(m.shape), tuple(param.shape)))
        out = super()._import_param_state(param, value, group, key)
        out["max_exp_avg_sq"] = m.detach().to(device=local(param).device, dtype=param.dtype,
                                              copy=True)
        return out


def _torch_checks(lr: Any, betas: Any, foreach: Any, capturable: Any, fused: Any,
                  differentiable: Any) -> None:
    """torch.optim.Adam's constructor checks that mpext's group checks do not make (the tensor
    lr and betas, fused with foreach or differentiable), in torch's order and words."""
    if isinstance(lr, torch.Tensor) and foreach and not capturable:
        raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
    if isinstance(betas, (list, tuple)) and len(betas) == 2:
        b0, b1 = betas
        if not ((isinstance(b0, float) and isinstance(b1, float))
                or (isinstance(b0, torch.Tensor) and isinstance(b1, torch.Tensor))):
            for i, b in enumerate(betas):  # torch checks the ranges first
                if (isinstance(b, torch.Tensor) and b.numel() == 1 or _is_real(b)) \
                        and not 0.0 <= b < 1.0:
                    raise ValueError(f"Invalid beta parameter at index {i}: {b}")
            raise ValueError("betas must be either both floats or both Tensors")
        for i, b in enumerate(betas):
            if isinstance(b, torch.Tensor):
                if not capturable and foreach:
                    raise ValueError("betas[%d] as a Tensor is not supported for "
                                     "capturable=False and foreach=True" % i)
                if b.numel() != 1:
                    raise ValueError("Tensor betas[%d] must be 1-element" % i)
    if fused and differentiable:
        raise RuntimeError("`fused` does not support `differentiable`")
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")


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
