"""mpext.optim: Adam and AdamW on the fused ``mpext.ops.adam_step_`` kernel, with FP32 master
weights for BF16/FP16 params, or leaner state; Lion (``Lion``, lion-pytorch's arguments and
update, bit for bit on FP32 params, op ``lion_step_``) and SGD (``SGD``, torch.optim.SGD's
arguments and update, state ``momentum_buffer``, op ``sgd_step_``) on the same engine with the
same storage options (``master_weights``, ``param_remainders``, ``stochastic_rounding``,
``seed``, ``ema_decay``, ``unscale_grads``, ``moment_rounding``, ``block_size``; their moment
settings ``exp_avg_dtype`` / ``momentum_dtype``), GradScaler protocol and state_dict handling.

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

What torch's optimizers accept and mpext's kernels have no format for (sparse gradients for SGD,
amsgrad, float64 and complex params) is stepped by torch.optim's own implementation for those
params; non-contiguous params step through a contiguous copy; see docs/dropin.md.

The learning rate stays a Python float in ``param_groups`` (LR schedulers work unchanged); each
step it is written into a small cached tensor on the device (only when it changed), which the
kernel reads.

DTensor params (FSDP2's sharded ones, or any ``torch.distributed.tensor.DTensor``) are stepped
through their local shards, as torch's fused AdamW does: the update is element-wise, so each rank
updates its own shard with no communication. Their moments and masters are DTensors with the
param's mesh and placements (so ``torch.distributed.checkpoint`` saves and reshards them), and
``step`` is a plain scalar tensor on the param's device, as in torch. Stochastic rounding draws
each element's bits at its position in the whole param (a Shard(0) shard's global offset), so a
sharded run rounds as one process; under ``ZeroRedundancyOptimizer`` call
``use_global_sr_streams(zero)`` so that each param keeps the stream one process gives it.

The package, one job per module (docs/contributing.md, "Python optimizer package"):
``adam`` the Adam/AdamW rules, ``lion`` and ``sgd`` the Lion and SGD rules; ``formats`` the
state formats as objects (their Python codecs, keys, op arguments, sharding: nothing else asks
which format it holds; docs/lean_state.md, "Format objects");
``_state`` state creation and conversion; ``_engine`` the fused launch planner; ``_base`` the
shared optimizer base; ``lr_scheduler`` device-side schedules; ``_release`` gradient release
(``release_grads()``: the step inside backward, docs/gradient_release.md).
"""
import importlib as _importlib
import importlib.util as _importlib_util

from .._C import build_info as _build_info
from ._base import use_global_sr_streams
from .formats import MIN_8BIT_NUMEL, q8_decode, q8_encode
from . import formats
from . import lr_scheduler  # mpext.optim.lr_scheduler, as torch.optim has it


def _rule_modules(names):
    """The class module of each rule row (``names``: the rows of mpext/rules/rules.h, which
    mpext._C lists), once each, in row order: ``mpext.optim.<name>``, or, for a rule whose phases
    are several rows (Muon's muon_momentum and muon_update), the module named by the longest
    leading words of the row's name that has one (``muon``), as build_tools/rules.py finds the
    rule's C++ op entry. A rule's classes are found, not listed (docs/adding_a_rule.md)."""
    modules = []
    for name in names:
        words = name.split("_")
        found = next((m for m in ("_".join(words[:k]) for k in range(len(words), 0, -1))
                      if _importlib_util.find_spec("%s.%s" % (__name__, m)) is not None), None)
        if found is None:
            raise ImportError("mpext.optim: the rule row %r has no class module (expected "
                              "mpext/optim/%s.py)" % (name, name))
        if found not in modules:
            modules.append(found)
    return modules


__all__ = []
for _name in _rule_modules(_build_info()["rules"]):
    _module = _importlib.import_module("." + _name, __name__)
    globals().update({k: getattr(_module, k) for k in _module.__all__})  # its public names
    __all__ += _module.__all__
__all__ += ["formats", "lr_scheduler", "MIN_8BIT_NUMEL", "q8_decode", "q8_encode",
            "use_global_sr_streams"]
del _name, _module
