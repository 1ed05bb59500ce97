"""A training process for tests/test_resume.py: it trains, checkpoints every K steps with
mpext.checkpoint, and resumes from the newest good checkpoint when started again.

    python tests/resume_worker.py DIR --variant NAME --steps N --every K

Deterministic: fixed seeds, torch.use_deterministic_algorithms(True), one thread, and the batch
of step s is made from a generator seeded with s, so a resumed run sees exactly the data the
uninterrupted one saw. Some steps get a NaN gradient (a function of the step number), so skipped
steps and scale back-offs cross checkpoint boundaries too. It prints ``RESUMED s`` (the step it
starts from), ``STEP s`` after each step, ``SAVED s`` after each checkpoint and ``DONE`` after
writing DIR/final.pt (params, optimizer state and scaler state at the end).

For the tests that kill it inside a checkpoint write, the environment variable
``MPEXT_TEST_PAUSE`` = ``<step>:payload`` stops the save of checkpoint ``<step>`` half-way through
writing the payload into the temporary file (flushed, so the partial file is on disk), and
``<step>:rename`` stops it after the temporary file is complete and fsync'ed, just before the
rename; either prints ``PAUSED <temporary file>`` and sleeps until killed.
"""
import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import mpext  # noqa: E402
import mpext.checkpoint as ckpt  # noqa: E402

PATTERN = "step_*.pt"
VARIANTS = ("adamw-gradscaler-fp16", "mpo-fp16", "mpo-bf16")


def say(*words):
    print(*words, flush=True)


def setup_determinism():
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)


def make_model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4)).to(dtype)


class AdamWScaler:
    """mpext.optim.AdamW (FP32 masters for low-precision params) + mpext.GradScaler."""

    def __init__(self, model, lr=1e-2, weight_decay=1e-2, **scaler_options):
        self.opt = mpext.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        self.scaler = mpext.GradScaler("cpu", **scaler_options)

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def step(self):
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)

    def state_dict(self):
        return {"optimizer": self.opt.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state):
        self.opt.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])


class MixedPrecision:
    """mpext.MixedPrecisionOptimizer around torch.optim.AdamW (its fused path) or
    torch.optim.Adamax (its generic path), dynamic loss scaling (its state_dict holds the
    scaler's); ``step()`` also sets the gradients to None."""

    def __init__(self, model, inner="adamw", lr=1e-2, weight_decay=1e-2, **scaler_options):
        cls = {"adamw": torch.optim.AdamW, "adamax": torch.optim.Adamax}[inner]
        self.opt = mpext.MixedPrecisionOptimizer(
            cls(model.parameters(), lr=lr, weight_decay=weight_decay), loss_scale="dynamic",
            **scaler_options)
        self.scaler = self.opt.scaler

    def backward(self, loss):
        self.opt.backward(loss)

    def step(self):
        applied = self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return applied

    def state_dict(self):
        return {"optimizer": self.opt.state_dict()}

    def load_state_dict(self, state):
        self.opt.load_state_dict(state["optimizer"])


SCALING = dict(init_scale=2.0 ** 10, growth_interval=5)


def make_trainer(variant, model):
    if variant == "adamw-gradscaler-fp16":
        return AdamWScaler(model, **SCALING)
    return MixedPrecision(model, **SCALING)


def variant_dtype(variant):
    return torch.bfloat16 if variant == "mpo-bf16" else torch.float16


def batch(step, dtype):
    g = torch.Generator().manual_seed(1_000_003 * (step + 1))
    x = torch.randn(16, 8, generator=g)
    y = torch.sin(x[:, :4] * 2) + x[:, 4:] ** 2 / 4
    return x.to(dtype), y


def poisoned(step):
    return step % 23 == 7


def pause_hooks(step):
    """Installs the MPEXT_TEST_PAUSE hook for the save of checkpoint ``step``, if asked."""
    spec = os.environ.get("MPEXT_TEST_PAUSE", "")
    if not spec:
        return
    at, mode = spec.split(":")
    if int(at) != step:
        return

    def hang(tmp):
        say("PAUSED", tmp)
        while True:
            time.sleep(60)

    if mode == "payload":
        real_open = open

        class HalfWriter:
            """Writes the header, then half of the payload, flushes and hangs."""

            def __init__(self, path, mode):
                self.path = path
                self.f = real_open(path, mode)
                self.writes = 0

            def write(self, data):
                self.writes += 1
                if self.writes == 1:  # the header
                    return self.f.write(data)
                self.f.write(bytes(data[:len(data) // 2]))
                self.f.flush()
                os.fsync(self.f.fileno())
                hang(self.path)

            def __getattr__(self, name):
                return getattr(self.f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

        ckpt.open = HalfWriter  # a module global shadows the builtin inside mpext.checkpoint
    elif mode == "rename":
        def replace(src, dst):
            hang(src)
        os.replace = replace  # this process does nothing else after it
    else:
        raise ValueError("MPEXT_TEST_PAUSE: unknown mode %r" % mode)


def final_state(model, trainer):
    return {"model": model.state_dict(), **trainer.state_dict()}


def train(directory, variant, steps, every):
    """Trains to ``steps``, resuming from the newest good checkpoint in ``directory``; returns
    the final state (also written to directory/final.pt)."""
    setup_determinism()
    dtype = variant_dtype(variant)
    model = make_model(dtype)
    trainer = make_trainer(variant, model)
    start = 0
    path = ckpt.latest_checkpoint(directory, PATTERN)
    if path is not None:
        state = ckpt.load_checkpoint(path)
        model.load_state_dict(state["model"])
        trainer.load_state_dict(state)
        start = state["step"]
    say("RESUMED", start)
    for step in range(start, steps):
        x, y = batch(step, dtype)
        loss = (model(x).float() - y).pow(2).mean()
        trainer.backward(loss)
        if poisoned(step):
            next(model.parameters()).grad.view(-1)[step % 5] = float("nan")
        trainer.step()
        say("STEP", step + 1)
        if (step + 1) % every == 0:
            pause_hooks(step + 1)
            ckpt.save_checkpoint(os.path.join(directory, "step_%06d.pt" % (step + 1)),
                                 {"step": step + 1, "model": model.state_dict(),
                                  **trainer.state_dict()})
            say("SAVED", step + 1)
    state = final_state(model, trainer)
    ckpt.save_checkpoint(os.path.join(directory, "final.pt"), state)
    say("DONE")
    return state


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory")
    ap.add_argument("--variant", choices=VARIANTS, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, required=True)
    args = ap.parse_args(argv)
    train(args.directory, args.variant, args.steps, args.every)


if __name__ == "__main__":
    main()
