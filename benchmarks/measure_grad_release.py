"""Gradient release's memory and speed (benchmarks/README.md; docs/gradient_release.md)."""
import argparse
import inspect

import torch
import torch.nn as nn

from mpext.memory import estimate, measure
from mpext.optim import AdamW

from .common import markdown_table, mlp, peak_memory_many, resolve_device, time_fns
from .training import BF16M, Q8, REM, SR

# release_grads' own default bucket size
DEFAULT_BUCKET_BYTES = inspect.signature(AdamW.release_grads).parameters["bucket_bytes"].default

BF16, F32 = torch.bfloat16, torch.float32
FORMATS = [  # label, param dtype, mpext.optim.AdamW's options, mpext.memory's mode
    ("FP32 params", F32, {}, "fp32"),
    ("BF16 + FP32 master", BF16, {}, "mpext-bf16"),
    ("BF16 + remainder", BF16, REM, "mpext-bf16-remainder"),
    ("BF16 master-free SR", BF16, SR, "mpext-bf16-sr-fp32moments"),
    ("remainder + BF16 moments", BF16, dict(REM, **BF16M), "mpext-bf16-remainder-bf16moments"),
    ("SR + BF16 moments", BF16, dict(SR, **BF16M), "mpext-bf16-sr"),
    ("remainder + 8-bit moments", BF16, dict(REM, **Q8), "mpext-bf16-remainder-8bit"),
    ("SR + 8-bit moments", BF16, dict(SR, **Q8), "mpext-bf16-sr-8bit"),
    ("remainder + EMA", BF16, dict(REM, ema_decay=0.999), "mpext-bf16-remainder"),
]


def models(device, batch=1, width=512, depth=8):
    """name -> (build(), loss(model), the activation estimate's shape or None) on ``batch``
    sequences (at 4 the activations, not the gradients, set the step's peak either way)."""
    from .gpt import GPT, GPTConfig, get_batch, hf_gpt2, load_corpus
    ids, vocab = load_corpus()
    cfg = GPTConfig.preset("small", len(vocab), n_layer=4, n_embd=256)
    x, y = (t.to(device) for t in get_batch(ids, batch, cfg.block_size,
                                            torch.Generator().manual_seed(0)))
    shape = dict(batch=batch, seq=cfg.block_size, hidden=cfg.n_embd, layers=cfg.n_layer,
                 heads=cfg.n_head, vocab=len(vocab), device=device.type)
    xm = torch.randn(16, width, generator=torch.Generator().manual_seed(0)).to(device)
    out = {"MLP %dx%d" % (depth, width): (lambda: mlp([width] * (depth + 2), nn.Tanh), lambda m: m(
        xm.to(m[0].weight.dtype)).float().square().mean(), None),
        "benchmark GPT": (lambda: GPT(cfg), lambda m: m(x, y)[1], dict(shape, dropout=False))}
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("(transformers is not installed: no HF GPT-2 rows)")
        return out
    out["HF GPT-2"] = (lambda: hf_gpt2(cfg), lambda m: m(x, labels=x).loss.float(),
                       dict(shape, dropout=True))  # GPT-2's dropout 0.1
    return out


def memory(build, loss_of, shape, bucket, device):
    """Per format, after backward and released: the memory table's rows (docs/gradient_release.md,
    "Memory"), the model's params and whether every persistent figure is the estimate's."""
    rows, exact = [], True
    for label, dtype, kw, mode in FORMATS:
        row = [label]
        for released in (False, True):
            torch.manual_seed(0)
            model = build().to(device, dtype)
            params = list(model.parameters())
            opt, live = AdamW(params, **kw), [0]
            for p in params:  # before release's hooks: what is alive as each gradient completes
                p.register_post_accumulate_grad_hook(lambda _: live.append(max(live[-1], sum(
                    q.grad.nbytes for q in params if q.grad is not None))))
            if released:
                opt.release_grads(bucket_bytes=bucket)

            def step(model=model, opt=opt, released=released):
                loss_of(model).backward()
                if not released:
                    opt.step()
            step(), opt.zero_grad(), step()
            held = measure(params, opt)  # by category, the scalars ("other") left out
            persistent = sum(held.values()) - held["other"]
            opt.zero_grad()
            peak = persistent - held["gradients"] + peak_memory_many({0: step}, device)[0]
            est = estimate([p.numel() for p in params], "adamw", mode, grad_release=released,
                           bucket_bytes=bucket, ema="ema_decay" in kw, **(shape or {}))
            exact &= persistent == est.persistent
            n, mib = est.params, lambda v: "%.1f" % (v / 2 ** 20)
            row += ["%.2f (%.2f)" % (persistent / n, est.persistent / n),
                    "%s (%s)" % (mib(peak), mib(est.total) if shape else "-")]
            if released:
                row.append("%s (%s)" % (mib(max(live)), mib(est.grad_bucket)))
        rows.append(row)
    return rows, n, exact


def speed(bucket_bytes, repeats, width=512, depth=8):
    """Timings of a BF16 + remainder step on the memory MLP, after backward and released."""
    fns = {}
    for released in (False, True):
        torch.manual_seed(0)
        model = mlp([width] * (depth + 2), nn.Tanh).to(BF16)
        opt = AdamW(model.parameters(), param_remainders=True)
        x = torch.randn(64, width, dtype=BF16)
        if released:
            opt.release_grads(bucket_bytes=bucket_bytes)

        def step(model=model, opt=opt, x=x, released=released):
            model(x).float().square().mean().backward()
            if not released:
                opt.step()
                opt.zero_grad()
        fns[released] = step
    t = time_fns(fns, device=torch.device("cpu"), repeats=repeats, show_progress=False)
    return t[False], t[True]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bucket-bytes", type=int, default=2 ** 20)
    ap.add_argument("--repeats", type=int, default=15, help="timed samples per path")
    ap.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu",
                    help="the memory section's device (the speed section runs on the CPU)")
    ap.add_argument("--memory-only", action="store_true", help="the memory section alone")
    args = ap.parse_args()
    dev = resolve_device(args.device)
    print("Memory (%s, bucket_bytes=%d), measured (mpext.memory's prediction): persistent "
          "bytes per param element; a training step's peak, MiB (the allocator's); released, the "
          "live gradients' peak in backward, MiB" % (dev, args.bucket_bytes))
    exact = True
    for name, (build, loss_of, shape) in models(dev).items():
        rows, numel, ok = memory(build, loss_of, shape, args.bucket_bytes, dev)
        exact &= ok
        print("\n%s, %d params\n" % (name, numel))
        print(markdown_table(["format", "persistent, step after backward", "step peak, after",
                              "persistent, released", "step peak, released",
                              "live grads, released"], rows))
    print("\npersistent bytes = mpext.memory's prediction in every row: %s" % exact)
    if args.memory_only:
        return int(not exact)
    print("\nForward + backward + step, BF16 + remainder, the memory MLP, batch 64, %d "
          "interleaved samples, ms (median [quartiles])\n" % args.repeats)
    rows = []
    for bucket in sorted({args.bucket_bytes, DEFAULT_BUCKET_BYTES}):
        after, released = speed(bucket, args.repeats)
        rows.append([bucket] + ["%.2f [%.2f, %.2f]" % (t.median * 1e3, t.q1 * 1e3, t.q3 * 1e3)
                                for t in (after, released)]
                    + ["%.3f" % (released.median / after.median)])
    print(markdown_table(["bucket_bytes", "step after backward", "released", "released / after"],
                         rows))
    return int(not exact)


if __name__ == "__main__":
    raise SystemExit(main())
