"""Host overhead of an mpext.optim.AdamW step over many small params, per state format, against
torch.optim.AdamW(fused=True) on FP32 params in the same run (interleaved).

    python tools/bench_host.py [--params 300] [--numel 1024] [--repeats 7]

Per format: the whole step (mpext, torch), the bare op with the lists the step built (mpext's
``adam_step_``, torch's ``_fused_adamw_``), and host = step - op per param. The 8-bit row uses
params of at least MIN_8BIT_NUMEL elements (smaller ones keep FP32 moments), torch's too.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mpext  # noqa: E402  (this checkout's, as benchmarks.common below)
from mpext._common import MIN_8BIT_NUMEL  # noqa: E402
from mpext.optim import _engine  # noqa: E402

from benchmarks.common import machine_header, machine_info, markdown_table, time_fns  # noqa: E402

BF16 = torch.bfloat16
FORMATS = {  # name -> (param dtype, AdamW keywords)
    "fp32 params": (torch.float32, {}),
    "bf16 + fp32 master": (BF16, {}),
    "remainder": (BF16, dict(param_remainders=True)),
    "remainder + bf16 moments": (BF16, dict(param_remainders=True, exp_avg_dtype=BF16,
                                            exp_avg_sq_dtype=BF16)),
    "master-free SR": (BF16, dict(master_weights=False, stochastic_rounding=True)),
    "SR + bf16 moments": (BF16, dict(master_weights=False, stochastic_rounding=True,
                                     exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)),
    "bf16 moments to nearest": (BF16, dict(param_remainders=True, exp_avg_dtype=BF16,
                                           exp_avg_sq_dtype=BF16, moment_rounding="nearest")),
    "8-bit moments": (BF16, dict(exp_avg_dtype="q8", exp_avg_sq_dtype="q8")),
    "remainder + 8-bit": (BF16, dict(param_remainders=True, exp_avg_dtype="q8",
                                     exp_avg_sq_dtype="q8")),
    "SR + 8-bit": (BF16, dict(master_weights=False, stochastic_rounding=True,
                              exp_avg_dtype="q8", exp_avg_sq_dtype="q8")),
}


def make_params(n, numel, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(numel, generator=g).to(dtype).requires_grad_() for _ in range(n)]
    for p in ps:
        p.grad = torch.randn(numel, generator=g).mul_(1e-3).to(dtype)
    return ps


def captured_op_calls(opt):
    """The (op, args, kwargs) of each op call of ``opt.step()``, captured (not launched) from
    one step through the engine: the bare op calls, to time without the host work."""
    calls, real = [], _engine.run_launches
    _engine.run_launches = lambda launches, copied: calls.extend(launches)
    try:
        opt.step()
    finally:
        _engine.run_launches = real
    return calls


def torch_op_call(opt):
    """A bare ``torch._fused_adamw_`` call over the lists torch's fused AdamW steps."""
    group = opt.param_groups[0]
    ps = [p for p in group["params"]]
    st = [opt.state[p] for p in ps]
    lists = ([p.grad for p in ps], [s["exp_avg"] for s in st], [s["exp_avg_sq"] for s in st],
             [], [s["step"] for s in st])
    beta1, beta2 = group["betas"]
    return lambda: torch._fused_adamw_(ps, *lists, lr=group["lr"], beta1=beta1, beta2=beta2,
                                       weight_decay=group["weight_decay"], eps=group["eps"],
                                       amsgrad=False, maximize=False)


def run_format(name, args):
    dtype, kw = FORMATS[name]
    numel = max(args.numel, MIN_8BIT_NUMEL) if "8-bit" in name else args.numel
    ours = mpext.optim.AdamW(make_params(args.params, numel, dtype), lr=1e-3, **kw)
    ref = torch.optim.AdamW(make_params(args.params, numel, torch.float32), lr=1e-3, fused=True)
    ours.step()
    ref.step()
    calls = captured_op_calls(ours)
    ref_op = torch_op_call(ref)

    def our_op():
        for op, (a, k) in calls:
            op(*a, **k)

    t = time_fns({"mp": ours.step, "torch": ref.step, "mp_op": our_op, "torch_op": ref_op},
                 device=torch.device("cpu"), repeats=args.repeats, min_sample_s=0.03,
                 show_progress=False)
    ms = {k: v.median * 1e3 for k, v in t.items()}
    spread = {k: "%.3f (%.3f–%.3f)" % (ms[k], min(v.samples) * 1e3, max(v.samples) * 1e3)
              for k, v in t.items()}
    host = {k: (ms[k] - ms[k + "_op"]) * 1e3 / args.params for k in ("mp", "torch")}
    return [name + (" (%d el.)" % numel if numel != args.numel else ""), spread["mp"],
            spread["torch"], "%.2f" % (ms["mp"] / ms["torch"]),
            "%.3f" % ms["mp_op"], "%.3f" % ms["torch_op"],
            "%.2f" % host["mp"], "%.2f" % host["torch"],
            "%.2f" % (ms["mp"] * 1e3 / args.params)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=300)
    ap.add_argument("--numel", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--formats", nargs="*", default=list(FORMATS), choices=list(FORMATS))
    args = ap.parse_args(argv)
    print("\n".join(machine_header(machine_info(torch.device("cpu")))))
    print("\n%d params x %d elements; median ms/step of %d repeats (min–max)\n"
          % (args.params, args.numel, args.repeats))
    rows = [run_format(name, args) for name in args.formats]
    print(markdown_table(["format", "mpext ms/step", "torch fused ms/step", "ratio",
                          "mpext op ms", "torch op ms", "mpext host µs/param",
                          "torch host µs/param", "mpext µs/param"], rows))


if __name__ == "__main__":
    main()
