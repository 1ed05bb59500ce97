"""Gradient release in a plain training loop: each param is stepped inside ``backward`` as its
gradient completes and the gradient is freed, so the gradients never all exist at once
(docs/gradient_release.md).

    python examples/grad_release_train.py                    # BF16 params + remainders
    python examples/grad_release_train.py --fp16             # FP16 params, dynamic loss scale
    python examples/grad_release_train.py --clip exact       # global-norm clipping, 2 passes
    python examples/grad_release_train.py --clip previous    # clipped by last step's norm

A synthetic regression task (no downloads); the GPU is used when there is one.
"""
import argparse

import torch
import torch.nn as nn

import mpext
from mpext.optim import AdamW, lr_scheduler


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fp16", action="store_true", help="FP16 params with loss scaling")
    p.add_argument("--clip", choices=("none", "exact", "previous"), default="none")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--nan-at", type=int, nargs="*", default=[50], help="steps with a NaN loss")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and mpext.build_info()["cuda_built"] else "cpu"
    dtype = torch.float16 if args.fp16 else torch.bfloat16

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                          nn.Linear(256, 1)).to(device, dtype)
    opt = AdamW(model.parameters(), lr=3e-3, param_remainders=not args.fp16)
    # The loss scale for FP16; for BF16 only the inf/NaN skip. Only mpext.GradScaler takes a
    # released step's record (torch's does not).
    scaler = mpext.GradScaler(device, bf16_check_only=not args.fp16)
    release = opt.release_grads(scaler=scaler,
                                max_grad_norm=None if args.clip == "none" else 1.0,
                                clip="exact" if args.clip == "none" else args.clip)
    sched = lr_scheduler.get_cosine_schedule_with_warmup(opt, 20, args.steps)

    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 1, generator=g) / 32 ** 0.5
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=g)
        x, y = x.to(device, dtype), torch.tanh(2 * x @ w).to(device)
        loss = nn.functional.mse_loss(model(x).float(), y)
        if step in args.nan_at:
            loss = loss * float("nan")  # a bad batch: the step changes nothing
        # The step happens inside backward: no opt.step(), no scaler.step(opt), no
        # zero_grad() (the gradients are freed as they are stepped).
        release.backward(scaler.scale(loss))
        scaler.update()  # the scale backs off after an inf/NaN, as usual
        sched.step()     # holds still on a skipped step
        if step % 50 == 0 or step == args.steps - 1:
            print("step %d loss %.5f" % (step, loss.item()))
    return loss.item()


if __name__ == "__main__":
    main()
