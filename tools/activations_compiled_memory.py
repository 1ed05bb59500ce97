"""Bytes a compiled zoo model's forward leaves alive for backward, BF16 and under
mpext.activations.fp8_saved_tensors() (the default policy), measured by the allocator
(mpext.memory.meter.HeapMeter, independent of mpext's counters), in one run, with the same
compiled model (inductor unless --backend).

    PYTHONPATH=.:tests python tools/activations_compiled_memory.py [--models cnn,hf-llama]
        [--small] [--backend inductor|aot_eager] [--repeats 2]

The zoo is tests/zoo.py's (benchmarks/bench_activations.py's steptime measures the same
figures with step times).
"""
import argparse
import contextlib

import torch

import mpext.activations as act
from mpext.memory.meter import HeapMeter
from zoo import zoo_models


def held(name, backend="inductor", small=False, repeats=2, dev="cpu"):
    """(BF16 bytes, compressed bytes) the forward leaves alive, the last of ``repeats`` rounds
    after a compiling one (both settle after the first)."""
    build, batch, loss_fn = zoo_models(small)[name]
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build().to(dev, torch.bfloat16).train()
    xb = tuple(t.to(dev) for t in batch(torch.bfloat16))
    fwd = torch.compile(model, backend=backend)
    heap = HeapMeter(torch.device(dev))
    out = {}
    for _ in range(repeats + 1):
        for key, ctx in (("bf16", contextlib.nullcontext),
                         ("fp8", lambda: act.fp8_saved_tensors(params=model,
                                                               warn_unmatched=False))):
            before = heap()
            with ctx():
                loss = loss_fn(fwd, xb)
            out[key] = heap() - before
            loss.float().backward()
            del loss
            model.zero_grad(set_to_none=True)
    return out["bf16"], out["fp8"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="hf-gpt2-eager,hf-gpt2-sdpa,hf-llama,vit,cnn,gpt")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print("| model | BF16 MiB | compressed MiB | saved |\n|---|---:|---:|---:|")
    for name in a.models.split(","):
        b, c = held(name, a.backend, a.small, a.repeats)
        print("| %s | %.2f | %.2f | %.1f%% |" % (name, b / 2**20, c / 2**20, 100 * (1 - c / b)),
              flush=True)


if __name__ == "__main__":
    main()
