"""Bytes a compiled model's forward leaves alive for backward, with and without
mpext.activations.fp8_saved_tensors(), measured by the allocator (HeapMeter), in one run.

    PYTHONPATH=. python tools/activations_compiled_memory.py [--backend inductor] [--dtype bf16]
"""
import argparse
import contextlib

import torch
import transformers

import mpext.activations as act
from mpext.memory.meter import HeapMeter


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    # GPT2Config's hub defaults (gelu_new, dropout 0.1) at small sizes
    cfg = transformers.GPT2Config(n_embd=256, n_layer=4, n_head=4, n_positions=256,
                                  vocab_size=1024, attn_implementation=a.attn)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).to(dtype).train()
    ids = torch.randint(0, 1024, (8, 256))
    compiled = torch.compile(model, backend=a.backend)
    meter = HeapMeter("cpu")
    out = {}
    for _ in range(a.repeats + 1):  # the first round compiles
        for name, ctx in (("plain", contextlib.nullcontext), ("fp8", act.fp8_saved_tensors)):
            model.zero_grad(set_to_none=True)
            before = meter()
            with ctx():
                logits = compiled(input_ids=ids).logits
            held = meter() - before - logits.untyped_storage().nbytes()
            logits.float().square().mean().backward()
            out.setdefault(name, []).append(held)
    plain = sorted(out["plain"][1:])[a.repeats // 2]
    fp8 = sorted(out["fp8"][1:])[a.repeats // 2]
    print("GPT-2 (4x256, seq 256, batch 8) %s %s attn=%s: held for backward %.2f MiB plain, "
          "%.2f MiB fp8: %+.1f%%" % (a.backend, a.dtype, a.attn, plain / 2**20, fp8 / 2**20,
                                     100.0 * (fp8 - plain) / plain))


if __name__ == "__main__":
    main()
