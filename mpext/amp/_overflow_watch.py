"""The overflow warning of mpext.GradScaler (``warn_consecutive_overflows``, an overflow at
``min_scale``), without a host sync: each ``update()`` starts an asynchronous copy of the
counters to the host, and the next one reads it once it has landed."""
import warnings
from typing import Optional

import torch


def host_values(t: torch.Tensor) -> list:
    """The values of a CPU tensor that holds a host-side snapshot. Reading host memory is never
    a device synchronisation; numpy reads it without going through Tensor.item/tolist."""
    try:
        return t.numpy().tolist()
    except (RuntimeError, ImportError):  # torch without numpy
        return t.tolist()


class OverflowWatch:
    """GradScaler's overflow warning. A mixin: its state (``_warn_after``, ``_min_scale``,
    ``_warned``, ``_watch_pending``, ``_watch_buffers``, ``_scale``, ``_stats``) lives on the
    scaler itself, so pickles keep their layout."""

    def _watching(self) -> bool:
        return not self._warned and (self._warn_after is not None or self._min_scale is not None)

    def _watch(self, pre_scale: Optional[torch.Tensor]) -> None:
        pending = self._watch_pending
        if pending is not None:
            host_f, host_i, event = pending
            if event is not None and not event.query():
                return  # the previous snapshot has not landed yet: look again next time
            self._watch_pending = None
            self._inspect(host_f, host_i)
            if self._warned:
                return
        scale = self._scale
        if scale.device.type == "cpu":
            event = None
            pin = False
        elif scale.device.type == "cuda":
            pin = True
        else:
            return  # no event API we rely on: no warning on this device type
        if self._watch_buffers is None:  # reused: a new copy starts only once the last landed
            self._watch_buffers = (torch.empty(2, dtype=torch.float32, pin_memory=pin),
                                   torch.empty(2, dtype=torch.int64, pin_memory=pin))
        host_f, host_i = self._watch_buffers
        snap_f = torch.stack([pre_scale if pre_scale is not None else scale, scale])
        host_f.copy_(snap_f.view(2), non_blocking=pin)
        host_i.copy_(self._stats, non_blocking=pin)
        if pin:
            event = torch.cuda.Event()
            event.record()
            self._watch_pending = (host_f, host_i, event)
        else:
            self._inspect(host_f, host_i)  # CPU: the copy is done; reading it is free

    def _inspect(self, host_f: torch.Tensor, host_i: torch.Tensor) -> None:
        pre_scale, _ = host_values(host_f)
        _, streak = host_values(host_i)
        if self._warn_after is not None and streak >= self._warn_after:
            self._warned = True
            warnings.warn(
                "mpext.GradScaler: %d consecutive steps had inf/NaN gradients and were skipped, "
                "and backing off the scale has not cured it. This is rarely an overflow that a "
                "smaller scale fixes: look for NaN/Inf in the model's forward pass or the loss."
                % streak, RuntimeWarning, stacklevel=4)
        elif self._min_scale is not None and streak >= 1 and pre_scale <= self._min_scale:
            self._warned = True
            warnings.warn(
                "mpext.GradScaler: a step had inf/NaN gradients although the scale already sat "
                "at min_scale=%g, so backing off cannot help: the inf/NaN comes from the model "
                "(forward pass or loss), not from loss scaling." % self._min_scale,
                RuntimeWarning, stacklevel=4)
