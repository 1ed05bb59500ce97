"""The precision modes of mpext.memory: what each stores per parameter (``ModeSpec``), the
native modes, every state format of mpext.optim as a mode (``FORMAT_MODES``, made from
mpext.optim.formats' own tables and bytes), the calculator's named modes (``ALIASES`` of some
of them), mpext.optim's rules (``RULES``, from the classes' moments) and torch's optimizers
(``OPTIMIZERS``). The accounting is in mpext.memory.estimate's docstring."""
import dataclasses
import itertools
import numbers
from typing import Dict, Optional, Tuple

import torch

from .. import optim as _optim
from ..optim import formats as _F
from ..optim._base import FusedOptimizer as _FusedOptimizer, _LEAN_DEFAULTS

_FP32, _HALF = 4, 2
_ADAM = ("adam", "adamw")  # the optimizers with mpext's lean state (mpext.optim.Adam / AdamW)
SCALER_SCALARS = 2  # the loss scale (fp32) and the growth tracker (int32), kept between steps
Q8_BLOCK = _LEAN_DEFAULTS["block_size"]  # mpext.optim's default block_size
# The param dtypes of mpext's modes, by their short names: (bytes per element, the param
# formats mpext.optim gives such a param), asked of mpext.optim.formats.param_format under every
# combination of the settings it reads, so that a new param format appears here by itself.
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_FORMAT_SETTINGS = ("master_weights", "param_remainders", "stochastic_rounding")


def _param_formats(dtype: torch.dtype) -> Tuple[str, ...]:
    found = set()
    probe = torch.empty(0, dtype=dtype)
    for values in itertools.product((True, False), repeat=len(_FORMAT_SETTINGS)):
        try:
            found.add(_F.param_format(probe, dict(zip(_FORMAT_SETTINGS, values))).name)
        except ValueError:  # a combination the dtype refuses (float16 remainders)
            continue
    return tuple(name for name in _F.PARAM_FORMATS if name in found)


_PARAM_DTYPES = {short: (torch.finfo(dtype).bits // 8, _param_formats(dtype))
                 for short, dtype in _DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class ModeSpec:
    """Bytes per parameter (or per activation element) a precision mode stores."""

    weight: int          # the model's parameters
    grad: int            # their .grad
    master: int          # FP32 master copy held by the optimizer (0: the weights are FP32)
    activation: int      # bytes per saved activation element
    autocast_copy: int   # per-forward low-precision weight copies (native AMP autocast)
    scaler: bool         # dynamic loss scaling (scale, growth tracker, found_inf)
    description: str
    state: int = _FP32   # bytes per element of each optimizer-state tensor (moments)
    optimizers: Optional[Tuple[str, ...]] = None  # the optimizers it exists for (None: all)
    state_block: int = 0  # elements per block of metadata of each state tensor (0: none)
    state_meta: int = 0   # bytes of metadata per block (8-bit codes: one FP32 scale)
    # the mpext.optim.formats it is, for the modes of mpext.optim (None: a native mode)
    param_format: Optional[str] = None
    moment_format: Optional[str] = None

    @property
    def norm_activation(self) -> int:
        """Bytes per element of what the norms, the softmax and the residual stream save: the
        weights' dtype (native AMP's autocast runs them in FP32 over its FP32 model)."""
        return self.weight if self.autocast_copy else self.activation

    @property
    def stepped_by_mpext(self) -> bool:
        """16-bit weights stepped by mpext (with a master or without): an EMA, when asked
        for, is the optimizer's."""
        return self.weight == _HALF


def format_mode(dtype: str, param_format: str, moment_format: str, description: str = "",
                optimizers: Optional[Tuple[str, ...]] = _ADAM) -> ModeSpec:
    """The mode of mpext.optim's state formats (mpext.optim.formats): params of ``dtype``
    ('fp32', 'bf16', 'fp16') whose FP32 value lives as ``param_format`` says, every moment
    stored in ``moment_format``; the bytes are the formats' own (``bytes_per_element``, and
    for 8-bit codes ``meta_bytes_per_block`` per block of the default ``block_size``)."""
    size, allowed = _PARAM_DTYPES[dtype]
    if param_format not in allowed:
        raise ValueError("param_format: %s params have no %r format (they take %s)"
                         % (dtype, param_format, ", ".join(allowed)))
    pf, mf = _F.PARAM_FORMATS[param_format], _F.MOMENT_FORMATS[moment_format]
    meta = mf.meta_bytes_per_block * len(mf.meta)
    return ModeSpec(size, size, pf.bytes_per_element, size, 0, dtype == "fp16",
                    description or "mpext.optim: %s params, %s, %s moments"
                    % (dtype, param_format, moment_format),
                    mf.bytes_per_element, optimizers, Q8_BLOCK if meta else 0, meta,
                    param_format, moment_format)


def format_mode_name(dtype: str, param_format: str, moment_format: str) -> str:
    """The FORMAT_MODES name of a format: mpext-<dtype>-<param format>-<moment format>."""
    return "mpext-%s-%s-%s" % (dtype, "param" if param_format == "fp32_param" else param_format,
                               moment_format)


# Every format of mpext.optim, by a name of its parts: mpext-<dtype>-<param format>-<moment
# format> (e.g. mpext-bf16-remainder-q8, mpext-fp32-param-bfloat16).
FORMAT_MODES: Dict[str, ModeSpec] = {
    format_mode_name(d, pf, mf): format_mode(d, pf, mf)
    for d, (_, pfs) in _PARAM_DTYPES.items() for pf in pfs for mf in _F.MOMENT_FORMATS}

# The named modes of the calculator that are formats: (dtype, param format, moment format,
# description).
_NAMED = {
    "mpext-bf16": ("bf16", "master", "float32",
                   "mpext: BF16 model, FP32 masters in the optimizer"),
    "mpext-fp16": ("fp16", "master", "float32",
                   "mpext: FP16 model, FP32 masters + dynamic loss scaling"),
    "mpext-bf16-bf16moments": ("bf16", "master", "bfloat16",
                               "mpext.optim: BF16 model, FP32 masters, BF16 moments"),
    "mpext-bf16-remainder": ("bf16", "remainder", "float32",
                             "mpext.optim: BF16 model, FP32 masters kept as 16-bit remainders"),
    "mpext-bf16-remainder-bf16moments": (
        "bf16", "remainder", "bfloat16",
        "mpext.optim: BF16 model, 16-bit remainders, BF16 moments"),
    "mpext-bf16-sr-fp32moments": (
        "bf16", "stochastic", "float32",
        "mpext.optim: BF16 model, no master (stochastic rounding), FP32 moments"),
    "mpext-bf16-sr": ("bf16", "stochastic", "bfloat16",
                      "mpext.optim: BF16 model, no master (stochastic rounding), BF16 moments"),
    "mpext-fp16-sr": ("fp16", "stochastic", "bfloat16",
                      "mpext.optim: FP16 model, no master (stochastic rounding), BF16 moments + "
                      "dynamic loss scaling"),
    "mpext-bf16-8bit": ("bf16", "master", "q8",
                        "mpext.optim: BF16 model, FP32 masters, 8-bit moments"),
    "mpext-bf16-remainder-8bit": ("bf16", "remainder", "q8",
                                  "mpext.optim: BF16 model, 16-bit remainders, 8-bit moments"),
    "mpext-bf16-sr-8bit": ("bf16", "stochastic", "q8",
                           "mpext.optim: BF16 model, no master (stochastic rounding), 8-bit "
                           "moments"),
    "mpext-fp16-sr-8bit": ("fp16", "stochastic", "q8",
                           "mpext.optim: FP16 model, no master (stochastic rounding), 8-bit "
                           "moments + dynamic loss scaling"),
}
# Each named mode's format: (dtype, param format, moment format).
ALIASES: Dict[str, Tuple[str, str, str]] = {k: v[:3] for k, v in _NAMED.items()}
# FP32 masters with FP32 moments exist for every optimizer (MixedPrecisionOptimizer wraps any);
# the leaner formats are mpext.optim's.
_ANY_OPTIMIZER = ("mpext-bf16", "mpext-fp16")

MODES: Dict[str, ModeSpec] = {
    "fp32": ModeSpec(_FP32, _FP32, 0, _FP32, 0, False,
                     "FP32 weights, grads and activations"),
    "amp-bf16": ModeSpec(_FP32, _FP32, 0, _HALF, _HALF, False,
                         "native AMP: FP32 model, torch.autocast(bfloat16)"),
    "amp-fp16": ModeSpec(_FP32, _FP32, 0, _HALF, _HALF, True,
                         "native AMP: FP32 model, torch.autocast(float16) + GradScaler"),
}
MODES.update({name: format_mode(*row, None if name in _ANY_OPTIMIZER else _ADAM)
              for name, row in _NAMED.items()})


def _spec(mode: str) -> ModeSpec:
    spec = MODES.get(mode) if isinstance(mode, str) else None
    return spec if spec is not None else FORMAT_MODES[mode]


def known_mode(mode) -> bool:
    """Whether ``mode`` names a mode: one of ``MODES`` or of ``FORMAT_MODES``."""
    return isinstance(mode, str) and (mode in MODES or mode in FORMAT_MODES)


def mode_supports(mode: str, optimizer: str, ema: bool = False,
                  rule: Optional[str] = None) -> bool:
    """Whether precision ``mode`` exists for ``optimizer`` (the lean modes are
    ``mpext.optim.Adam``/``AdamW``'s), with an EMA of the weights if ``ema`` (mpext's is
    ``mpext.optim.Adam``/``AdamW``'s ``ema_decay``; ``MixedPrecisionOptimizer`` keeps none).
    With ``rule`` (one of ``RULES``: the optimizer is mpext.optim's) every mode exists, an EMA
    too."""
    if rule is not None:
        return True
    spec = _spec(mode)
    allowed = _ADAM if ema and spec.stepped_by_mpext else spec.optimizers
    return allowed is None or optimizer in allowed


# mpext.optim's rules and the moments each keeps per param (their classes' ``moments``): the
# state tensors a format stores, by the class's name in lower case ('adam', 'adamw', 'lion',
# 'sgd'). SGD keeps its momentum_buffer only with a momentum.
RULES: Dict[str, Tuple[str, ...]] = {
    cls.__name__.lower(): tuple(q.name for q in cls.moments)
    for cls in vars(_optim).values()
    if isinstance(cls, type) and issubclass(cls, _FusedOptimizer) and cls.moments}


def rule_states(rule: str, momentum: float = 0.0) -> int:
    """The number of moment tensors mpext.optim's ``rule`` keeps per param (see ``RULES``)."""
    if not isinstance(rule, str) or rule not in RULES:
        raise ValueError("rule: unknown rule %r; choose one of %s" % (rule, ", ".join(RULES)))
    if not isinstance(momentum, numbers.Real) or isinstance(momentum, bool) \
            or not 0.0 <= momentum:
        raise ValueError("momentum: must be a number >= 0, got %r" % (momentum,))
    if momentum and rule != "sgd":
        raise ValueError("momentum: SGD's option; rule %r has none" % rule)
    if rule == "sgd" and not momentum:
        return 0
    return len(RULES[rule])


# State tensors of the size of the param each optimizer keeps (torch.optim's defaults, FP32
# unless a mode stores them narrower; the scalar per-param ``step`` tensors are not counted).
OPTIMIZERS: Dict[str, int] = {
    "adamw": 2,             # exp_avg, exp_avg_sq
    "adam": 2,
    "nadam": 2,
    "radam": 2,
    "adamax": 2,            # exp_avg, exp_inf
    "sgd": 0,               # momentum=0: no state
    "sgd-momentum": 1,      # momentum_buffer
    "adagrad": 1,           # sum
    "rmsprop": 1,           # square_avg
    "rmsprop-momentum": 2,  # square_avg, momentum_buffer
}


def optimizer_states(optimizer: str) -> int:
    """The number of param-sized FP32 state tensors ``optimizer`` keeps (see ``OPTIMIZERS``)."""
    try:
        return OPTIMIZERS[optimizer]
    except (KeyError, TypeError):
        raise ValueError("optimizer: unknown optimizer %r; choose one of %s"
                         % (optimizer, ", ".join(OPTIMIZERS))) from None
