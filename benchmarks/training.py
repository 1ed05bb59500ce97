"""The training modes the benchmarks and tests compare, written once: for a mode, the model's
dtype, native AMP's autocast, the optimizer, the loss scaler, and how backward and step go.

- ``MODES``: the modes by key (FP32, native AMP, mpext's wrapper and optimizer, naive BF16);
  a mode with mpext's optimizer takes its lean-state options (``param_remainders``, ...) as
  optimizer options;
- ``Trainer``: a mode's optimizer and scaler over a model's params (``Trainer.for_mode``, or
  built directly), with ``autocast()``, ``backward(loss)``, ``step()`` and a ``state_dict``.

bench_train.py and bench_convergence.py train gpt.py's model with it, tests/resume_worker.py a
small MLP.
"""
import dataclasses
from typing import Optional

import torch

import mpext
from mpext import memory

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@dataclasses.dataclass(frozen=True)
class Mode:
    """How a mode trains: the params' dtype, autocast's (native AMP), the optimizer's kind (see
    ``Trainer``), dynamic loss scaling, the matching ``mpext.memory`` mode, and options for the
    optimizer (``mpext.optim.AdamW``'s lean state)."""

    param_dtype: torch.dtype
    autocast: Optional[torch.dtype]
    kind: str
    scaled: bool
    memory_mode: Optional[str]
    options: dict = dataclasses.field(default_factory=dict)

    def memory_estimate(self, params, **shape) -> "memory.Breakdown":
        """``mpext.memory.estimate`` of this mode with AdamW for ``params`` (the model's
        tensors, each counted as the optimizer keeps it), with its EMA if it keeps one;
        ``shape``: the activation estimate's arguments."""
        return memory.estimate([p.numel() for p in params], "adamw", self.memory_mode,
                               ema=self.options.get("ema_decay") is not None, **shape)


MODES = {
    "fp32": Mode(FP32, None, "torch", False, "fp32"),
    "amp_bf16": Mode(FP32, BF16, "torch", False, "amp-bf16"),
    "amp_fp16": Mode(FP32, FP16, "torch", True, "amp-fp16"),
    "mpext_bf16": Mode(BF16, None, "mpext-wrapper", False, "mpext-bf16"),
    "mpext_fp16": Mode(FP16, None, "mpext-wrapper", True, "mpext-fp16"),
    "mpext_optim_fp16": Mode(FP16, None, "mpext-optim", True, "mpext-fp16"),
    # mpext.optim.AdamW on BF16 params; its lean-state options come as optimizer options
    "mpext_optim_bf16": Mode(BF16, None, "mpext-optim", False, "mpext-bf16"),
    # mpext.optim.AdamW's leaner state on BF16 params
    "mpext_bf16_remainder": Mode(BF16, None, "mpext-optim", False, "mpext-bf16-remainder",
                                 dict(param_remainders=True)),
    "mpext_bf16_remainder_bf16m": Mode(BF16, None, "mpext-optim", False,
                                       "mpext-bf16-remainder-bf16moments",
                                       dict(param_remainders=True, exp_avg_dtype=BF16,
                                            exp_avg_sq_dtype=BF16)),
    "mpext_bf16_sr": Mode(BF16, None, "mpext-optim", False, "mpext-bf16-sr",
                          dict(master_weights=False, stochastic_rounding=True,
                               exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)),
    # ... with 8-bit moments (params under mpext.optim.MIN_8BIT_NUMEL keep FP32 ones)
    "mpext_bf16_remainder_8bit": Mode(BF16, None, "mpext-optim", False,
                                      "mpext-bf16-remainder-8bit",
                                      dict(param_remainders=True, exp_avg_dtype=torch.int8,
                                           exp_avg_sq_dtype=torch.uint8)),
    "mpext_bf16_sr_8bit": Mode(BF16, None, "mpext-optim", False, "mpext-bf16-sr-8bit",
                               dict(master_weights=False, stochastic_rounding=True,
                                    exp_avg_dtype=torch.int8, exp_avg_sq_dtype=torch.uint8)),
    # ... and an FP32 EMA of the masters, in the same pass
    "mpext_bf16_remainder_bf16m_ema": Mode(BF16, None, "mpext-optim", False,
                                           "mpext-bf16-remainder-bf16moments",
                                           dict(param_remainders=True, exp_avg_dtype=BF16,
                                                exp_avg_sq_dtype=BF16, ema_decay=0.999)),
    # BF16 params stepped by a torch optimizer with no FP32 masters: what mpext is for
    "bf16_naive": Mode(BF16, None, "torch", False, None),
}


class Trainer:
    """An optimizer and a loss scaler over ``params``, by ``kind``:

    - ``"torch"``: ``inner(params)`` (``fused=True`` with ``fused``); ``scaled``: a
      ``torch.amp.GradScaler``;
    - ``"mpext-wrapper"``: ``mpext.MixedPrecisionOptimizer(inner(params))`` (its own scaler;
      ``scaled``: a dynamic loss scale);
    - ``"mpext-optim"``: ``mpext.optim.AdamW(params)`` (FP32 masters in its state); ``scaled``:
      an ``mpext.GradScaler``.

    ``optim_options`` go to the optimizer, ``scaler_options`` (``init_scale``, ...) to the
    scaler; ``autocast`` is the dtype native AMP computes in (None: no autocast)."""

    def __init__(self, params, kind: str = "torch", *, scaled: bool = False,
                 inner=torch.optim.AdamW, fused: bool = False,
                 autocast: Optional[torch.dtype] = None, scaler_options: Optional[dict] = None,
                 **optim_options):
        self.params = list(params)
        self.kind, self.autocast_dtype = kind, autocast
        self.device_type = self.params[0].device.type
        scaler_options = scaler_options or {}
        self.scaler = None
        if kind == "torch":
            self.opt = inner(self.params, **dict(optim_options, **({"fused": True} if fused
                                                                  else {})))
            if scaled:
                self.scaler = torch.amp.GradScaler(self.device_type, **scaler_options)
        elif kind == "mpext-wrapper":
            inner_opt = inner(self.params, **optim_options)
            self.opt = (mpext.MixedPrecisionOptimizer(inner_opt, loss_scale="dynamic",
                                                      **scaler_options) if scaled else
                        mpext.MixedPrecisionOptimizer(inner_opt, loss_scale=None))
            self.scaler = self.opt.scaler
        elif kind == "mpext-optim":
            self.opt = mpext.optim.AdamW(self.params, **optim_options)
            if scaled:
                self.scaler = mpext.GradScaler(self.device_type, **scaler_options)
        else:
            raise ValueError("Trainer: unknown kind %r" % (kind,))

    @classmethod
    def for_mode(cls, key: str, model: torch.nn.Module, device=None, **options) -> "Trainer":
        """``model`` moved to ``device`` in mode ``key``'s dtype (kept as ``.model``), with the
        mode's optimizer (and its options) and scaler."""
        mode = MODES[key]
        model.to(device=device, dtype=mode.param_dtype)
        if not mode.scaled:
            options.pop("scaler_options", None)
        tr = cls(model.parameters(), mode.kind, scaled=mode.scaled, autocast=mode.autocast,
                 **dict(mode.options, **options))
        tr.model = model
        return tr

    def autocast(self):
        """The mode's autocast region for the forward (a no-op without one)."""
        return torch.autocast(self.device_type, dtype=self.autocast_dtype or BF16,
                              enabled=self.autocast_dtype is not None)

    def backward(self, loss: torch.Tensor) -> None:
        if self.kind == "mpext-wrapper":
            self.opt.backward(loss)
        elif self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self, zero_grad: bool = True) -> Optional[torch.Tensor]:
        """The optimizer step, with the scaler's skip test and update, then (``zero_grad``) the
        gradients set to None. Returns MixedPrecisionOptimizer.step's result (whether the step
        was applied, on the device), else None."""
        applied = None
        if self.kind == "mpext-wrapper":
            applied = self.opt.step()
        elif self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        if zero_grad:
            self.opt.zero_grad(set_to_none=True)
        return applied

    def get_scale(self) -> Optional[float]:
        """The loss scale (a host sync), None without a scaler."""
        if self.kind == "mpext-wrapper":
            return self.opt.get_scale()
        return None if self.scaler is None else self.scaler.get_scale()

    def skipped_steps(self) -> Optional[int]:
        """The steps the scaler skipped (mpext's scalers count them; torch's does not: None)."""
        if isinstance(self.scaler, mpext.GradScaler):
            return int(self.scaler.skipped_steps().item())
        return None

    def state_dict(self) -> dict:
        state = {"optimizer": self.opt.state_dict()}
        if self.scaler is not None and self.kind != "mpext-wrapper":  # the wrapper's has it
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["optimizer"])
        if "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
