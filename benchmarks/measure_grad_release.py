"""Gradient release (``optimizer.release_grads()``): the figures behind docs/gradient_release.md.
Per state format the persistent bytes per param and the peak of live gradient bytes in
backward, with and without release, on an MLP; a small training run with no clipping, torch's
``clip_grad_norm_`` (the reference) and release's exact and previous-norm modes: the final loss,
the backward passes and FLOPs (``torch.utils.flop_counter``) of a step; the same run in FP16
under a dynamic loss scale, released (a skipped step keeps its earlier buckets' update) and
stepped after backward; and a whole forward + backward + step with and without release, timed
interleaved in one run (the ratio, not the times, is the figure on a shared CPU).

    python -m benchmarks.measure_grad_release [--steps 300] [--seeds 3]
"""
import argparse
import contextlib
import inspect

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from mpext import GradScaler
from mpext.memory import measure
from mpext.optim import AdamW

from .common import markdown_table, mlp, time_fns

# release_grads' own default bucket size
DEFAULT_BUCKET_BYTES = inspect.signature(AdamW.release_grads).parameters["bucket_bytes"].default

BF16, F32 = torch.bfloat16, torch.float32
FORMATS = [
    ("FP32 params", F32, {}),
    ("BF16 + FP32 master", BF16, {}),
    ("BF16 + remainder", BF16, dict(param_remainders=True)),
    ("BF16 master-free SR", BF16, dict(master_weights=False, stochastic_rounding=True)),
    ("BF16 + remainder, BF16 moments", BF16,
     dict(param_remainders=True, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)),
    ("BF16 + remainder, 8-bit moments", BF16,
     dict(param_remainders=True, exp_avg_dtype=torch.int8, exp_avg_sq_dtype=torch.uint8)),
    ("BF16 + remainder + EMA", BF16, dict(param_remainders=True, ema_decay=0.999)),
]


def memory(bucket_bytes, width=512, depth=8):
    rows = []
    for label, dtype, kw in FORMATS:
        row = [label]
        for released in (False, True):
            torch.manual_seed(0)
            model = mlp([width] * (depth + 2), nn.Tanh).to(dtype)
            params = list(model.parameters())
            numel = sum(p.numel() for p in params)
            opt = AdamW(params, **kw)
            live = [0]
            for p in params:  # before release's hooks: what is alive as each gradient completes
                p.register_post_accumulate_grad_hook(lambda _: live.append(max(live[-1], sum(
                    q.grad.nbytes for q in params if q.grad is not None))))
            if released:
                opt.release_grads(bucket_bytes=bucket_bytes)
            for step in range(2):  # the second step: state exists
                model(torch.randn(16, width, dtype=dtype)).float().square().mean().backward()
                if not released:
                    opt.step()
                    if not step:
                        opt.zero_grad()
            held = measure(params, opt)  # by category, the scalars ("other") left out
            persistent = sum(held.values()) - held["other"]
            row += ["%.2f" % (persistent / numel), "%.2f" % (max(live) / numel)]
        rows.append(row)
    return rows, numel


def train(mode, seed, steps, max_norm):
    torch.manual_seed(seed)
    model = mlp([64] * 4 + [1], nn.Tanh)
    gen = torch.Generator().manual_seed(seed)
    w_true = torch.randn(64, 1, generator=gen) / 4
    opt = AdamW(model.parameters(), lr=3e-3)
    release = None
    if mode in ("exact", "previous"):
        release = opt.release_grads(bucket_bytes=0, max_grad_norm=max_norm, clip=mode)
    for step in range(steps):
        x = torch.randn(128, 64, generator=gen)
        y = torch.sin(x @ w_true) + 0.05 * torch.randn(128, 1, generator=gen)
        counting = step == steps - 1
        with FlopCounterMode(display=False) if counting else contextlib.nullcontext() as fc:
            loss = (model(x) - y).square().mean()
            passes = release.backward_passes if release else 0
            if release is None:
                loss.backward()
                if mode == "clip_grad_norm_":
                    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                opt.step()
                opt.zero_grad()
                passes = 1
            else:
                release.backward(loss)
                passes = release.backward_passes - passes
    with torch.no_grad():
        x = torch.randn(4096, 64, generator=gen)
        final = (model(x) - torch.sin(x @ w_true)).square().mean().item()
    return final, fc.get_total_flops(), passes


def fp16(released, seed, steps):
    """The training run of ``train`` with FP16 params and a dynamic loss scale that starts at
    2^24 and grows every 25 steps, so that it overflows now and then: the held-out MSE and the
    number of skipped steps."""
    torch.manual_seed(seed)
    model = mlp([64] * 4 + [1], nn.Tanh).half()
    gen = torch.Generator().manual_seed(seed)
    w_true = torch.randn(64, 1, generator=gen) / 4
    opt = AdamW(model.parameters(), lr=3e-3)
    scaler = GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=25)
    release = opt.release_grads(scaler=scaler, bucket_bytes=0) if released else None
    skipped = 0
    for _ in range(steps):
        x = torch.randn(128, 64, generator=gen)
        y = torch.sin(x @ w_true) + 0.05 * torch.randn(128, 1, generator=gen)
        loss = (model(x.half()).float() - y).square().mean()
        if released:
            release.backward(scaler.scale(loss))
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            opt.zero_grad()
        skipped += bool(scaler.last_step_skipped(opt))
        scaler.update()
    with torch.no_grad():
        x = torch.randn(4096, 64, generator=gen)
        final = (model(x.half()).float() - torch.sin(x @ w_true)).square().mean().item()
    return final, skipped


def speed(bucket_bytes, repeats, width=512, depth=8):
    """Seconds of a forward + backward + step of the BF16 remainder format on the memory MLP,
    stepped after backward and released, interleaved."""
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
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--max-norm", type=float, default=0.1)
    ap.add_argument("--bucket-bytes", type=int, default=2 ** 20)
    ap.add_argument("--repeats", type=int, default=15, help="timed samples per path")
    args = ap.parse_args()
    rows, numel = memory(args.bucket_bytes)
    print("Memory, bytes per param element (%d params; bucket_bytes=%d)\n"
          % (numel, args.bucket_bytes))
    print(markdown_table(["format", "persistent, step after backward",
                          "peak live grads in backward", "persistent, released",
                          "peak live grads, released"], rows))
    print("\nClipping (max_grad_norm=%g, %d steps), held-out MSE per seed; cost of one step\n"
          % (args.max_norm, args.steps))
    rows = []
    for mode in ("none", "clip_grad_norm_", "exact", "previous"):
        res = [train(mode, s, args.steps, args.max_norm) for s in range(args.seeds)]
        rows.append([mode] + ["%.5f" % r[0] for r in res] + [res[0][2], res[0][1]])
    print(markdown_table(["mode"] + ["seed %d" % s for s in range(args.seeds)]
                         + ["backward passes", "FLOPs"], rows))
    print("\nFP16, dynamic loss scale (init 2^24, growth every 25 steps), %d steps: held-out MSE "
          "per seed (skipped steps)\n" % args.steps)
    rows = [[name] + ["%.5f (%d)" % fp16(released, s, args.steps) for s in range(args.seeds)]
            for name, released in (("step after backward", False), ("released", True))]
    print(markdown_table(["mode"] + ["seed %d" % s for s in range(args.seeds)], rows))
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


if __name__ == "__main__":
    main()
