"""mpext.telemetry: what FP16/BF16 costs this run, counted on the device (issue 46).

The gradient and loss-scale half: an opt-in ``Telemetry`` attached to an ``mpext.GradScaler``
replaces the scaler's unscale-and-check pass with ``mpext.ops.unscale_stats_``, the same kernel
pass (the same bits in every gradient and in ``found_inf``) that also counts, per parameter, the
scaled gradient's zeros, underflows (subnormal at this loss scale), values without headroom
(they would overflow at twice the scale), non-finite values and the largest unscaled magnitude;
and records each step's loss scale, skip flag and overflow site into small device buffers.
Nothing is read on the host until ``read()`` (or ``poll()`` every ``every`` steps): one host sync
per read, none in between. docs/telemetry.md says how to read each number and what to do
when it is bad.

    tel = mpext.telemetry.attach(scaler, model=model, every=100)
    for batch in loader:
        ...
        scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
        metrics = tel.poll()          # None, or every 100 steps a flat dict for a logger
        if metrics: logger.log(metrics)

Counted: every gradient that the scaler unscales through mpext's kernels (dense float32,
bfloat16, float16 gradients on a device with an mpext kernel, no sparse or DTensor gradients,
no ``sync_found_inf``). A step the scaler unscales otherwise runs torch's/mpext's own path
unchanged and is reported in ``telemetry/uncounted_unscales``.

The optimizer-step half (``optimizer=``, any ``mpext.optim`` optimizer; mpext.telemetry._step):
the step kernels count, in the same pass and every step, per param: updates lost to rounding
(master-free, round to nearest), updates carried only in expectation (stochastic rounding),
low-precision params unchanged although their master moved, the bf16 and 8-bit moments'
rounding errors, 8-bit values flushed to zero and saturated blocks, and the EMA's lag. Without
a scaler (a bf16 run) the window counts optimizer steps:

    tel = mpext.telemetry.attach(None, model=model, optimizer=opt, every=100)
"""
import math
from collections import defaultdict
from typing import Any, Dict, List, Optional

import torch

from .._common import PARAM_DTYPES, has_kernel, is_dense
from ..ops import NO_INDEX, unscale_stats_
from ._step import STEP_COLUMNS, StepCounters

__all__ = ["Telemetry", "attach", "STEP_COLUMNS"]


def attach(scaler=None, model: Optional[torch.nn.Module] = None, every: int = 100,
           module_depth: int = 2, optimizer: Optional[torch.optim.Optimizer] = None,
           step_every: Optional[int] = None) -> "Telemetry":
    """Attaches a ``Telemetry`` to ``scaler`` (an ``mpext.GradScaler``, or None) and/or
    ``optimizer`` (an ``mpext.optim`` optimizer) and returns it; see ``Telemetry``."""
    return Telemetry(scaler, model=model, every=every, module_depth=module_depth,
                     optimizer=optimizer, step_every=step_every)


class _Layout:
    """The device buffers of one list of gradients as the kernel sees it (one optimizer's params
    that had a gradient, in the order passed to the kernel)."""

    def __init__(self, params: List[torch.Tensor], device: torch.device, every: int):
        self.params = params
        self.numel = [p.numel() for p in params]
        self.counts = torch.zeros((len(params), 4), dtype=torch.int64, device=device)
        self.max_abs = torch.zeros(len(params), dtype=torch.float32, device=device)
        # one slot per step of the window: the list position of the first gradient holding a
        # NaN/Inf at that step (NO_INDEX: none)
        self.site = torch.full((every,), NO_INDEX, dtype=torch.int64, device=device)
        self.calls = 0

    def reset(self) -> None:
        self.counts.zero_()
        self.max_abs.zero_()
        self.site.fill_(NO_INDEX)
        self.calls = 0


class Telemetry:
    """Device-side precision counters of one ``mpext.GradScaler`` (and through it of every
    optimizer it unscales).

    Args:
        scaler: the ``mpext.GradScaler`` whose unscale pass is counted. Its methods
            ``_unscale_grads_``, ``_check_inf_per_device`` and ``update`` are wrapped on this
            instance only (``detach()`` restores them); nothing changes in what they compute.
        model: names the parameters (``model.named_parameters()``) for the per-module
            aggregates and the overflow site; without it parameters are named ``param<i>``.
        every: the window: ``poll()`` reads (one host sync) every ``every`` scaler updates,
            and the per-step history (scale, skip, overflow site) holds that many steps.
        module_depth: per-module aggregates group parameters by the first ``module_depth``
            components of their module's name (``transformer.h`` for depth 2).
        optimizer: an ``mpext.optim`` optimizer whose steps are counted too (the ``update/``,
            ``state/`` and ``ema/`` keys) by its kernels. With no scaler the window is
            ``every`` optimizer steps.
        step_every: the optimizer's steps are counted on one step in ``step_every`` (the
            first of each run of that many; the others run the uncounted kernels): default
            ``every``, one counted step per window, since a counted step costs about 1-3
            times an uncounted one on a CPU (docs/telemetry.md, "Overhead"); 1 counts every
            step. The fractions are over the counted steps.
    """

    def __init__(self, scaler=None, model: Optional[torch.nn.Module] = None, every: int = 100,
                 module_depth: int = 2, optimizer: Optional[torch.optim.Optimizer] = None,
                 step_every: Optional[int] = None):
        from .. import GradScaler  # the package's export: wherever the class lives (amp/)
        if scaler is None and optimizer is None:
            raise ValueError("mpext.telemetry.attach: give a scaler (an mpext.GradScaler), an "
                             "optimizer (an mpext.optim optimizer), or both")
        if scaler is not None and not isinstance(scaler, GradScaler):
            raise TypeError("mpext.telemetry.attach: scaler must be an mpext.GradScaler, got %s"
                            % type(scaler).__name__)
        if step_every is not None and (isinstance(step_every, bool)
                                       or not isinstance(step_every, int) or step_every < 1):
            raise ValueError("mpext.telemetry.attach: step_every must be an int >= 1 or None, "
                             "got %r" % (step_every,))
        if optimizer is not None:
            from ..optim._base import FusedOptimizer
            if not isinstance(optimizer, FusedOptimizer):
                raise TypeError("mpext.telemetry.attach: optimizer must be an mpext.optim "
                                "optimizer (its kernels count the step), got %s"
                                % type(optimizer).__name__)
            if getattr(optimizer, "_mpext_telemetry", None) is not None:
                raise RuntimeError("mpext.telemetry.attach: this optimizer already has a "
                                   "Telemetry attached (detach() it first)")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError("mpext.telemetry.attach: every must be an int >= 1, got %r"
                             % (every,))
        if isinstance(module_depth, bool) or not isinstance(module_depth, int) \
                or module_depth < 1:
            raise ValueError("mpext.telemetry.attach: module_depth must be an int >= 1, got %r"
                             % (module_depth,))
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError("mpext.telemetry.attach: model must be a torch.nn.Module, got %s"
                            % type(model).__name__)
        if scaler is not None and getattr(scaler, "_mpext_telemetry", None) is not None:
            raise RuntimeError("mpext.telemetry.attach: this scaler already has a Telemetry "
                               "attached (detach() it first)")
        self.scaler = scaler
        self.every = every
        self.module_depth = module_depth
        self._names: Dict[int, str] = {}
        if model is not None:
            for name, p in model.named_parameters(remove_duplicate=False):
                self._names.setdefault(id(p), name)
        self._layouts: Dict[tuple, _Layout] = {}
        self._steps = 0           # scaler updates in this window (host count)
        self._total_steps = 0
        self._uncounted = 0
        self._cleared = -1        # the step whose reused site slot was last cleared
        self._checking = False    # inside _check_inf_per_device: inv_scale is a dummy 1
        self._hist_device = None
        self._scale_hist = self._skip_hist = None
        self.history: List[Dict[str, Any]] = []  # per step, filled at each read
        self._orig = {}
        if scaler is not None:
            self._orig = {k: getattr(scaler, k) for k in
                          ("_unscale_grads_", "_check_inf_per_device", "update")}
            scaler._unscale_grads_ = self._unscale_grads_
            scaler._check_inf_per_device = self._check_inf_per_device
            scaler.update = self._update
            scaler._mpext_telemetry = self
        self.optimizer = optimizer
        self._step = None
        if optimizer is not None:
            if model is None:  # the optimizer's params, named by their place in it
                k = 0
                for gi, group in enumerate(optimizer.param_groups):
                    for p in group["params"]:
                        self._names.setdefault(id(p), "group%d.param%d" % (gi, k))
                        k += 1
            self._step = StepCounters(optimizer, every if step_every is None else step_every)
            optimizer._mpext_telemetry = self

    def detach(self) -> None:
        """Restores the scaler's own methods and stops counting the optimizer's steps."""
        if self.scaler is not None:
            for k in self._orig:
                self.scaler.__dict__.pop(k, None)
            self.scaler._mpext_telemetry = None
        if self._step is not None:
            self._step.detach()
            self.optimizer._mpext_telemetry = None

    # ---------------------------------------------------------------------------------------
    # The hooks.

    def _check_inf_per_device(self, optimizer):
        self._checking = True
        try:
            return self._orig["_check_inf_per_device"](optimizer)
        finally:
            self._checking = False

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        pairs = self._countable(optimizer, found_inf, allow_fp16)
        if pairs is None:
            self._uncounted += 1
            return self._orig["_unscale_grads_"](optimizer, inv_scale, found_inf, allow_fp16)
        # Backward order: the first gradient in the kernel's list holding a NaN/Inf is the one
        # nearest the loss, where an overflow in backward began (it flows on to every earlier
        # layer's gradient).
        pairs.reverse()
        params = [p for p, _ in pairs]
        key = (id(optimizer),) + tuple(id(p) for p in params)
        layout = self._layouts.get(key)
        device = found_inf.device
        if layout is None:
            layout = self._layouts[key] = _Layout(params, device, self.every)
        stat_inv = None
        if self._checking:  # the fused-optimizer path: the grads stay scaled by scaler._scale
            stat_inv = self.scaler._scale.double().reciprocal().float()
        slot = self._steps % self.every
        if self._steps >= self.every and self._cleared != self._total_steps:
            # not read for a whole window: this step reuses the oldest slot, which must not keep
            # that older step's site (the kernel lowers a slot, it never raises it); once per
            # step, whatever the number of optimizers
            for lay in self._layouts.values():
                lay.site[slot:slot + 1].fill_(NO_INDEX)
            self._cleared = self._total_steps
        with torch.no_grad():
            unscale_stats_([g for _, g in pairs], found_inf, inv_scale, layout.counts,
                           layout.max_abs, layout.site[slot:slot + 1], stat_inv_scale=stat_inv)
        layout.calls += 1
        return {device: found_inf}

    def _countable(self, optimizer, found_inf, allow_fp16):
        """The (param, grad) pairs of the kernel's list, or None when this unscale is for the
        scaler's own path (anything unscale_stats_ does not take, or its errors to raise)."""
        s = self.scaler
        if getattr(s, "_sync_found_inf", False) or not has_kernel("unscale_stats_",
                                                                  found_inf.device):
            return None
        pairs = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if (type(g) is not torch.Tensor or g.layout != torch.strided
                        or g.dtype not in PARAM_DTYPES or g.device != found_inf.device
                        or not is_dense(g)):
                    return None
                if g.dtype == torch.float16 and (not allow_fp16
                                                 or getattr(s, "_bf16_check_only", False)):
                    return None  # the scaler raises its own error
                pairs.append((p, g))
        return pairs

    def _update(self, new_scale=None):
        self._orig["update"](new_scale)
        if not self.scaler.is_enabled() or self.scaler._scale is None:
            return
        scale = self.scaler._scale
        if self._hist_device != scale.device:
            self._hist_device = scale.device
            self._scale_hist = torch.zeros(self.every, dtype=torch.float32, device=scale.device)
            self._skip_hist = torch.zeros(self.every, dtype=torch.float32, device=scale.device)
        slot = self._steps % self.every
        # the scale after this update, and whether this step was skipped: device copies only
        self._scale_hist[slot:slot + 1].copy_(scale.reshape(1))
        last = getattr(self.scaler, "_last_found_inf", None)
        if isinstance(last, torch.Tensor):
            self._skip_hist[slot:slot + 1].copy_((last.reshape(1) != 0).float(),
                                                 non_blocking=True)
        self._steps += 1
        self._total_steps += 1

    # ---------------------------------------------------------------------------------------
    # Reading.

    def poll(self) -> Optional[Dict[str, Any]]:
        """The plain-loop helper: ``read()`` once ``every`` updates have passed since the last
        read (one host sync), else None (nothing read, no sync)."""
        steps = self._steps if self.scaler is not None else self._step.steps
        if steps >= self.every:
            return self.read()
        return None

    def name_of(self, p: torch.Tensor) -> str:
        name = self._names.get(id(p))
        if name is None:
            name = self._names[id(p)] = "param%d" % len(self._names)
        return name

    def _module_of(self, name: str) -> str:
        parts = name.split(".")[:-1] or ["<root>"]
        return ".".join(parts[:self.module_depth])

    def read(self) -> Dict[str, Any]:
        """Reads and resets the window's counters (one host sync) and returns them as a flat
        dict: fractions of the window's gradient elements (``grad/*_frac``), the largest
        unscaled |g| (``grad/max_abs``), the same per module (``grad/<module>/...``) and per
        dtype, the loss scale (``scale/value`` now, ``scale/min``, ``scale/max`` over the
        window), skipped steps (``scale/skips`` in the window, ``scale/skips_total``) and the
        overflow site (``overflow/site``: the parameter names holding the first NaN/Inf, nearest
        the loss, at the window's first skipped step; ``overflow/params``: how many parameters
        held one in the window). docs/telemetry.md says what to change when one is bad."""
        steps = min(self._steps, self.every)
        layouts = list(self._layouts.values())
        parts = []
        for lay in layouts:
            parts += [lay.counts.reshape(-1).double(), lay.max_abs.double(),
                      lay.site.double()]
        if self._scale_hist is not None:
            parts += [self._scale_hist.double(), self._skip_hist.double()]
        stats = getattr(self.scaler, "_stats", None)
        if isinstance(stats, torch.Tensor):
            parts.append(stats.reshape(-1)[:1].double())
        step_parts = self._step.tensors() if self._step is not None else []
        parts += step_parts
        if parts:
            dev = parts[0].device
            host = torch.cat([t.to(dev) for t in parts]).cpu().tolist()  # the one host sync
        else:
            host = []
        # the window's slots, oldest first (the history keeps the last `every` steps)
        order = [(self._steps - steps + k) % self.every for k in range(steps)]
        out: Dict[str, Any] = {}
        tot = [0, 0, 0, 0]
        elems = 0
        gmax = 0.0
        per_mod: Dict[str, list] = defaultdict(lambda: [0, 0, 0, 0, 0, 0.0])
        per_dtype: Dict[str, list] = defaultdict(lambda: [0, 0, 0, 0, 0])
        nonfinite_params = set()
        first_site = None
        pos = 0
        for lay in layouts:
            n = len(lay.params)
            counts = host[pos:pos + 4 * n]
            amax = host[pos + 4 * n:pos + 5 * n]
            site = host[pos + 5 * n:pos + 5 * n + self.every]
            pos += 5 * n + self.every
            for i, p in enumerate(lay.params):
                c = [int(x) for x in counts[4 * i:4 * i + 4]]
                e = lay.numel[i] * lay.calls
                name = self.name_of(p)
                m = per_mod[self._module_of(name)]
                d = per_dtype[str(p.grad.dtype if p.grad is not None else p.dtype)
                              .replace("torch.", "")]
                for j in range(4):
                    tot[j] += c[j]
                    m[j] += c[j]
                    d[j] += c[j]
                elems += e
                m[4] += e
                d[4] += e
                m[5] = max(m[5], amax[i])
                gmax = max(gmax, amax[i])
                if c[3]:
                    nonfinite_params.add(name)
            for k, slot in enumerate(order):
                idx = int(site[slot])
                if idx < n and (first_site is None or k < first_site[0]):
                    first_site = (k, [self.name_of(lay.params[idx])])
                elif idx < n and first_site is not None and k == first_site[0]:
                    first_site[1].append(self.name_of(lay.params[idx]))

        def fracs(prefix, c, e):
            out[prefix + "zeros_frac"] = c[0] / e if e else 0.0
            out[prefix + "underflow_frac"] = c[1] / e if e else 0.0
            out[prefix + "headroom_overflow_frac"] = c[2] / e if e else 0.0
            out[prefix + "nonfinite_frac"] = c[3] / e if e else 0.0

        fracs("grad/", tot, elems)
        out["grad/elements"] = elems
        out["grad/underflow_count"] = tot[1]
        out["grad/max_abs"] = gmax
        for mod, m in sorted(per_mod.items()):
            fracs("grad/%s/" % mod, m, m[4])
            out["grad/%s/max_abs" % mod] = m[5]
        for dt, d in sorted(per_dtype.items()):
            fracs("grad_dtype/%s/" % dt, d, d[4])
        skips = 0
        if self._scale_hist is not None:
            scales = host[pos:pos + self.every]
            skip = host[pos + self.every:pos + 2 * self.every]
            pos += 2 * self.every
            window = [(scales[i], skip[i] != 0) for i in order]
            first_step = self._total_steps - steps
            for k, (sc, sk) in enumerate(window):
                self.history.append({"step": first_step + k, "scale": sc, "skipped": sk})
            skips = sum(1 for _, sk in window if sk)
            if window:
                out["scale/value"] = window[-1][0]
                out["scale/min"] = min(sc for sc, _ in window)
                out["scale/max"] = max(sc for sc, _ in window)
        out["scale/skips"] = skips
        if isinstance(stats, torch.Tensor):
            out["scale/skips_total"] = int(host[pos])
        out["overflow/params"] = len(nonfinite_params)
        out["overflow/site"] = ", ".join(first_site[1]) if first_site else ""
        if step_parts:
            pos += 1 if isinstance(stats, torch.Tensor) else 0
            out.update(self._step.summarize(host[pos:], self._module_of, self.name_of))
        elif self._step is not None:
            out.update(self._step.summarize([], self._module_of, self.name_of))
        if self.scaler is None:
            steps = self._step.steps
        out["telemetry/steps"] = steps
        out["telemetry/uncounted_unscales"] = self._uncounted
        if self._step is not None:
            self._step.reset()
        if self.scaler is None:  # no gradient half: only the step's keys
            out = {k: v for k, v in out.items()
                   if not k.startswith(("grad/", "grad_dtype/", "scale/", "overflow/"))
                   and k != "telemetry/uncounted_unscales"}
        for lay in layouts:
            lay.reset()
        self._steps = 0
        self._uncounted = 0
        return out
