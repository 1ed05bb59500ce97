"""mpext.telemetry.hf: precision telemetry in a ``transformers.Trainer``, logged with its metrics.

    trainer = Trainer(..., args=TrainingArguments(..., fp16=True),
                      optimizer_cls_and_kwargs=(mpext.optim.AdamW, {}))
    scaler = mpext.accelerate.setup_trainer(trainer)    # the Trainer's mpext.GradScaler
    tel = mpext.telemetry.hf.attach(trainer, scaler, every=50)
    trainer.train()          # every 50 steps the telemetry joins the next logged metrics

The callback reads the counters (one host sync) every ``every`` optimizer steps and adds them to
the next ``on_log`` call's ``logs``; it goes first among the Trainer's callbacks, so that the
reporting integrations (TensorBoard, W&B, ...) and ``state.log_history`` see the keys. The
overflow site (a string) is logged too; reporters that take numbers only skip it.
"""
from typing import Any, Dict, Optional

try:
    import transformers as _transformers
except ImportError as _exc:  # pragma: no cover - a clear error where transformers is missing
    raise ImportError("mpext.telemetry.hf needs transformers (pip install transformers): %s"
                      % _exc) from _exc

from . import Telemetry, attach as _attach

__all__ = ["TelemetryCallback", "attach"]


class TelemetryCallback(_transformers.TrainerCallback):
    """Polls ``telemetry`` at every optimizer step and merges what it read into the next logs."""

    def __init__(self, telemetry: Telemetry):
        if not isinstance(telemetry, Telemetry):
            raise TypeError("TelemetryCallback: telemetry must be an mpext.telemetry.Telemetry, "
                            "got %s" % type(telemetry).__name__)
        self.telemetry = telemetry
        self.pending: Dict[str, Any] = {}
        self.last: Optional[Dict[str, Any]] = None

    def on_step_end(self, args, state, control, **kwargs):
        read = self.telemetry.poll()
        if read is not None:
            self.last = read
            self.pending.update(read)
            control.should_log = True  # log at this step, whatever logging_steps says

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self.pending:
            logs.update(self.pending)
            # log_history holds a copy made before the callbacks ran: add the keys there too
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update(self.pending)
            self.pending = {}


def attach(trainer, scaler, every: int = 100, module_depth: int = 2) -> Telemetry:
    """Attaches a Telemetry to ``scaler`` (the ``mpext.GradScaler`` that
    ``mpext.accelerate.setup_trainer(trainer)`` returned), named by ``trainer.model``, and puts
    its callback first among the Trainer's callbacks. Returns the Telemetry."""
    if not isinstance(trainer, _transformers.Trainer):
        raise TypeError("mpext.telemetry.hf.attach: trainer must be a transformers.Trainer, got %s"
                        % type(trainer).__name__)
    if getattr(trainer.accelerator, "scaler", None) is not scaler:
        raise ValueError("mpext.telemetry.hf.attach: scaler is not the Trainer's scaler; pass the "
                         "one mpext.accelerate.setup_trainer(trainer) returned")
    tel = _attach(scaler, model=trainer.model, every=every, module_depth=module_depth)
    trainer.callback_handler.callbacks.insert(0, TelemetryCallback(tel))
    return tel
