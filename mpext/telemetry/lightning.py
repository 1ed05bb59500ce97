"""mpext.telemetry.lightning: precision telemetry logged through Lightning's ``log_dict``.

    tel = mpext.telemetry.attach(scaler, model=model, every=50)   # the scaler the run steps with
    trainer = L.Trainer(callbacks=[mpext.telemetry.lightning.TelemetryCallback(tel)], ...)

After every training batch the callback polls the Telemetry (nothing is read between reads);
every ``every`` scaler updates it logs the numbers with ``pl_module.log_dict`` (to every logger
of the Trainer, at that step) and keeps the whole read, strings included, in ``last``.
"""
from typing import Any, Dict, Optional

try:
    import lightning.pytorch as _pl
except ImportError:
    try:
        import pytorch_lightning as _pl
    except ImportError as _exc:  # pragma: no cover - a clear error where Lightning is missing
        raise ImportError("mpext.telemetry.lightning needs Lightning (pip install lightning): %s"
                          % _exc) from _exc

from . import Telemetry

__all__ = ["TelemetryCallback"]


class TelemetryCallback(_pl.Callback):
    """Logs ``telemetry``'s reads with the module's other metrics (numbers only: the overflow
    site string is kept in ``last``)."""

    def __init__(self, telemetry: Telemetry):
        if not isinstance(telemetry, Telemetry):
            raise TypeError("TelemetryCallback: telemetry must be an mpext.telemetry.Telemetry, "
                            "got %s" % type(telemetry).__name__)
        self.telemetry = telemetry
        self.last: Optional[Dict[str, Any]] = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        read = self.telemetry.poll()
        if read is None:
            return
        self.last = read
        numbers = {"telemetry/" + k if not k.startswith(("grad", "scale", "overflow",
                                                         "telemetry")) else k: float(v)
                   for k, v in read.items() if isinstance(v, (int, float))}
        pl_module.log_dict(numbers, on_step=True, on_epoch=False)
