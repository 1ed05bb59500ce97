"""The training modes and their ``Trainer`` (benchmarks/README.md, "Files")."""
import dataclasses
from typing import Optional

import torch

import mpext

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# mpext.optim.AdamW's option sets, which the studies combine too
REM = dict(param_remainders=True)
BF16M = dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
Q8 = dict(exp_avg_dtype=torch.int8, exp_avg_sq_dtype=torch.uint8)
SR = dict(master_weights=False, stochastic_rounding=True)


@dataclasses.dataclass(frozen=True)
class Mode:
    """How a mode trains: dtypes, optimizer kind, loss scaling, mpext.memory's mode, options."""

    param_dtype: torch.dtype
    autocast: Optional[torch.dtype]
    kind: str
    scaled: bool
    memory_mode: Optional[str]
    options: dict = dataclasses.field(default_factory=dict)


def _optim(memory_mode, options=None, param_dtype=BF16, scaled=False):
    return Mode(param_dtype, None, "mpext-optim", scaled, memory_mode, options or {})


MODES = {
    "fp32": Mode(FP32, None, "torch", False, "fp32"),
    "amp_bf16": Mode(FP32, BF16, "torch", False, "amp-bf16"),
    "amp_fp16": Mode(FP32, FP16, "torch", True, "amp-fp16"),
    "mpext_bf16": Mode(BF16, None, "mpext-wrapper", False, "mpext-bf16"),
    "mpext_fp16": Mode(FP16, None, "mpext-wrapper", True, "mpext-fp16"),
    "mpext_optim_fp16": _optim("mpext-fp16", param_dtype=FP16, scaled=True),
    # mpext.optim.AdamW on BF16 params; its lean-state options come as optimizer options
    "mpext_optim_bf16": _optim("mpext-bf16"),
    "mpext_bf16_remainder": _optim("mpext-bf16-remainder", REM),
    "mpext_bf16_remainder_bf16m": _optim("mpext-bf16-remainder-bf16moments", dict(REM, **BF16M)),
    "mpext_bf16_sr": _optim("mpext-bf16-sr", dict(SR, **BF16M)),
    # 8-bit moments (params under mpext.optim.MIN_8BIT_NUMEL keep FP32 ones)
    "mpext_bf16_remainder_8bit": _optim("mpext-bf16-remainder-8bit", dict(REM, **Q8)),
    "mpext_bf16_sr_8bit": _optim("mpext-bf16-sr-8bit", dict(SR, **Q8)),
    # ... and an FP32 EMA of the masters, in the same pass
    "mpext_bf16_remainder_bf16m_ema": _optim("mpext-bf16-remainder-bf16moments",
                                             dict(REM, ema_decay=0.999, **BF16M)),
    # BF16 params stepped by a torch optimizer with no FP32 masters: what mpext is for
    "bf16_naive": Mode(BF16, None, "torch", False, None),
}


class Trainer:
    """A mode's model, optimizer and scaler (``for_mode``) and its training step."""

    @classmethod
    def for_mode(cls, key: str, model: torch.nn.Module, device=None, *, fused: bool = False,
                 scaler_options: Optional[dict] = None, **options) -> "Trainer":
        """``model`` in mode ``key``'s dtype with its optimizer (``torch.optim.AdamW``, wrapped or
        not, or ``mpext.optim.AdamW``, given ``options``) and scaler. The trainer's own options:
        ``max_grad_norm`` (clip after backward), ``release`` (its keywords), ``scaler``."""
        tr, mode = cls(), MODES[key]
        tr.model = model.to(device=device, dtype=mode.param_dtype)
        tr.params, tr.kind, tr.autocast_dtype = list(model.parameters()), mode.kind, mode.autocast
        tr.grad_norm = None  # the latest global gradient norm, when clipping
        tr.device_type, tr.scaler = tr.params[0].device.type, None
        options = dict(mode.options, **options)
        tr.max_grad_norm, release = options.pop("max_grad_norm", None), options.pop("release", None)
        if (release is not None or tr.max_grad_norm is not None) and mode.kind == "mpext-wrapper":
            raise ValueError("mode %s: release and max_grad_norm are for the other kinds" % key)
        scaler_options = dict(scaler_options or {}, **options.pop("scaler", {}))
        if mode.kind == "torch":
            tr.opt = torch.optim.AdamW(tr.params, fused=fused or None, **options)
            if mode.scaled:
                tr.scaler = torch.amp.GradScaler(tr.device_type, **scaler_options)
        elif mode.kind == "mpext-wrapper":
            tr.opt = mpext.MixedPrecisionOptimizer(torch.optim.AdamW(tr.params, **options), **(
                dict(loss_scale="dynamic", **scaler_options) if mode.scaled else
                dict(loss_scale=None)))
            tr.scaler = tr.opt.scaler
        else:  # "mpext-optim"
            tr.opt = mpext.optim.AdamW(tr.params, **options)
            if mode.scaled:
                tr.scaler = mpext.GradScaler(tr.device_type, **scaler_options)
        tr.release = None if release is None else tr.opt.release_grads(scaler=tr.scaler, **release)
        return tr

    def autocast(self):
        """The mode's autocast region for the forward (a no-op without one)."""
        return torch.autocast(self.device_type, dtype=self.autocast_dtype or BF16,
                              enabled=self.autocast_dtype is not None)

    def set_lr(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr

    def train_step(self, x, y, zero_grad: bool = True):
        """Forward, backward (the step inside it when released; else clip_grad_norm_ after it
        when asked), the step and update; returns (loss, whether applied or None)."""
        with self.autocast():
            _, loss = self.model(x, y)
        applied, scaler = None, self.scaler
        if self.kind == "mpext-wrapper":  # it scales, steps and updates itself
            self.opt.backward(loss)
            applied, scaler = self.opt.step(), None
        elif self.release is not None:
            self.release.backward(loss if scaler is None else scaler.scale(loss))
            self.grad_norm = self.release.last_grad_norm
        else:
            (loss if scaler is None else scaler.scale(loss)).backward()
            if self.max_grad_norm is not None:
                if scaler is not None:
                    scaler.unscale_(self.opt)
                self.grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
            self.opt.step() if scaler is None else scaler.step(self.opt)
        if scaler is not None:
            scaler.update()
        if zero_grad:
            self.opt.zero_grad(set_to_none=True)
        return loss, applied

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


def add_gemm_arg(parser):
    parser.add_argument("--native-lowp-gemm", action="store_true",
                        help="on the CPU, use PyTorch's BF16/FP16 GEMMs (slow without "
                             "AVX512-BF16) instead of computing them in FP32 from rounded "
                             "operands (gpt.Linear)")
    return parser


def fp32_gemm(ctx) -> bool:
    """Whether a training benchmark computes BF16/FP16 GEMMs in FP32 (the CPU, by default)."""
    return not ctx.is_cuda and not getattr(ctx.args, "native_lowp_gemm", False)
