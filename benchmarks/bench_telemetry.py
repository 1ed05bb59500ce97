"""Precision telemetry overhead (issue 46): ``scaler.unscale_(opt); scaler.step(opt);
scaler.update()`` with an ``mpext.telemetry`` attached vs the same without (the gradient half),
and ``opt.step()`` with the optimizer's step counters on vs off (the step half:
``attach(None, optimizer=opt)``, every step counted), on GPT-2 small's
parameter shapes (``--quick``: 4 layers, 8K vocabulary), FP16 params with FP32 masters under
``mpext.optim.AdamW`` and ``mpext.GradScaler``. The two runs are interleaved (on, off, on, ...)
so that the machine's drift hits both alike; each repeat times ``--inner`` steps; reported: the
median step time of each and the median and spread (min..max, interquartile range) of the per-pair
ratio on/off. Target: on <= 1.03 x off (reported, never asserted). Telemetry is read (one host
sync) every ``--every`` steps, inside the timed steps, as a training loop would. Each time is
taken twice: wall clock and the process's CPU time (all its threads: on a machine shared with
other jobs, time spent waiting for a core is not counted, so the CPU-time ratio is the steadier
one); the load average is recorded before and after.

    python -m benchmarks.bench_telemetry [--quick] [--repeats 15] [--inner 3] [--every 10]
    python -m benchmarks.bench_telemetry --quick --step-only --step-every 1   # every step counted
"""
import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

import mpext

from .common import gpt2_shapes, machine_header, machine_info


# (param dtype, explicit scaler.unscale_ before step): torch refuses unscale_ on fp16 gradients,
# so fp16 goes through the fused optimizer's check-only pass, bf16 through unscale_ + step
CONFIGS = [(torch.bfloat16, True), (torch.float16, False)]


def make(shapes, device, dtype, on, every):
    torch.manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s) * 0.02).to(device, dtype)) for _, s in shapes]
    opt = mpext.optim.AdamW(params, lr=1e-4)
    scaler = mpext.GradScaler(device.type, init_scale=2.0 ** 12)
    scaler.scale(torch.ones((), device=device))  # creates the scale tensor, as a loss would
    tel = mpext.telemetry.attach(scaler, every=every) if on else None
    return params, opt, scaler, tel


def measure(args, device, shapes, dtype, explicit):
    """Median step times on/off and the per-pair ratios, interleaved."""
    g = torch.Generator().manual_seed(0)
    # gradient-like scaled values (|g| ~ 1e-3 x 2^12), shared by both runs
    grads = [(torch.randn(s, generator=g) * 1e-3 * 2 ** 12).to(device, dtype) for _, s in shapes]
    runs = {on: make(shapes, device, dtype, on, args.every) for on in (True, False)}
    for params, *_ in runs.values():
        for prm, gr in zip(params, grads):
            prm.grad = gr.clone()

    def steps(on):
        params, opt, scaler, tel = runs[on]
        t = 0.0
        for _ in range(args.inner):
            for prm, gr in zip(params, grads):  # fresh scaled gradients, not timed
                prm.grad.copy_(gr)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            if explicit:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            if tel is not None:
                tel.poll()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t += time.perf_counter() - t0
        return t / args.inner

    for on in (True, False):  # warm-up
        steps(on)
    spent, ratios = {True: [], False: []}, []
    for r in range(args.repeats):
        order = (True, False) if r % 2 == 0 else (False, True)
        t = {on: steps(on) for on in order}
        spent[True].append(t[True])
        spent[False].append(t[False])
        ratios.append(t[True] / t[False])
        print("%s repeat %d/%d: on %.2f ms, off %.2f ms, ratio %.3f"
              % (str(dtype).replace("torch.", ""), r + 1, args.repeats, 1e3 * t[True],
                 1e3 * t[False], ratios[-1]), flush=True)
    q = statistics.quantiles(ratios, n=4)
    return {"dtype": str(dtype).replace("torch.", ""),
            "path": "unscale_ + step" if explicit else "step (fused check)",
            "median_ms_on": 1e3 * statistics.median(spent[True]),
            "median_ms_off": 1e3 * statistics.median(spent[False]),
            "median_ratio": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "ratio_q1": q[0], "ratio_q3": q[2]}


# The step half: bf16 params in the optimizer's storage modes (the master-free case
# first). A counted step takes the mode's counted fast row where one is kept (AdamW's rows,
# csrc/core/fast/), else the counted tile pipeline (Lion, SGD, the modes without a row).
STEP_CONFIGS = [
    ("AdamW bf16 no master, SR, bf16 moments", "AdamW",
     dict(master_weights=False, stochastic_rounding=True, exp_avg_dtype=torch.bfloat16,
          exp_avg_sq_dtype=torch.bfloat16)),
    ("AdamW bf16 no master, RNE", "AdamW", dict(master_weights=False)),
    ("AdamW bf16 + fp32 master", "AdamW", {}),
    ("AdamW bf16 + remainder, 8-bit moments", "AdamW",
     dict(param_remainders=True, exp_avg_dtype=torch.int8, exp_avg_sq_dtype=torch.uint8)),
    # no row: the counted pipeline's own cost
    ("Lion bf16 + remainder (no row)", "Lion", dict(param_remainders=True)),
    ("SGD momentum bf16 no master, SR (no row)", "SGD",
     dict(momentum=0.9, master_weights=False, stochastic_rounding=True)),
    ("AdamW bf16 + remainder, 8-bit moments, ema (no row)", "AdamW",
     dict(param_remainders=True, exp_avg_dtype=torch.int8, exp_avg_sq_dtype=torch.uint8,
          ema_decay=0.999)),
]


def measure_step(args, device, shapes, label, cls, kw):
    """opt.step() with the step's counters on vs off: median times and per-pair ratios,
    interleaved as measure() does."""
    g = torch.Generator().manual_seed(0)
    grads = [(torch.randn(s, generator=g) * 1e-3).to(device, torch.bfloat16) for _, s in shapes]
    runs = {}
    for on in (True, False):
        torch.manual_seed(0)
        params = [torch.nn.Parameter((torch.randn(s) * 0.02).to(device, torch.bfloat16))
                  for _, s in shapes]
        opt = getattr(mpext.optim, cls)(params, lr=1e-4, **kw)
        tel = mpext.telemetry.attach(None, optimizer=opt, every=args.every,
                                     step_every=args.step_every) if on else None
        for prm, gr in zip(params, grads):
            prm.grad = gr.clone()
        runs[on] = (opt, tel)

    def steps(on):
        opt, tel = runs[on]
        t = c = 0.0
        for _ in range(args.inner):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.process_time()
            opt.step()
            if tel is not None:
                tel.poll()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t += time.perf_counter() - t0
            c += time.process_time() - c0
        return t / args.inner, c / args.inner

    for on in (True, False):
        steps(on)
    spent, cpu, ratios, cpu_ratios = {True: [], False: []}, {True: [], False: []}, [], []
    load0 = os.getloadavg()[0]
    for r in range(args.repeats):
        order = (True, False) if r % 2 == 0 else (False, True)
        t = {on: steps(on) for on in order}
        for on in (True, False):
            spent[on].append(t[on][0])
            cpu[on].append(t[on][1])
        ratios.append(t[True][0] / t[False][0])
        cpu_ratios.append(t[True][1] / t[False][1])
        print("step %s repeat %d/%d: on %.2f ms, off %.2f ms, ratio %.3f (cpu %.3f)"
              % (label, r + 1, args.repeats, 1e3 * t[True][0], 1e3 * t[False][0], ratios[-1],
                 cpu_ratios[-1]), flush=True)
    q = statistics.quantiles(ratios, n=4)
    cq = statistics.quantiles(cpu_ratios, n=4)
    return {"dtype": "bfloat16", "path": "step: " + label,
            "median_ms_on": 1e3 * statistics.median(spent[True]),
            "median_ms_off": 1e3 * statistics.median(spent[False]),
            "median_ratio": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "ratio_q1": q[0], "ratio_q3": q[2],
            "cpu_median_ratio": statistics.median(cpu_ratios), "cpu_ratio_q1": cq[0],
            "cpu_ratio_q3": cq[2], "cpu_ratio_min": min(cpu_ratios),
            "cpu_ratio_max": max(cpu_ratios), "load_before": load0,
            "load_after": os.getloadavg()[0]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--inner", type=int, default=3)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--device", default="cpu")
    p.add_argument("--step-only", action="store_true", help="only the step half's rows")
    p.add_argument("--step-every", type=int, default=None,
                   help="count the optimizer's step on one step in N (default: --every, "
                   "telemetry's default of one per window; 1: every step, the counted step's "
                   "own cost)")
    p.add_argument("--only", default=None,
                   help="the step half's rows whose label contains one of these (comma-separated)")
    p.add_argument("--out", default="results/bench_telemetry")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    shapes = gpt2_shapes(reduced=args.quick)
    n_params = sum(math.prod(s) for _, s in shapes)
    rows = [] if args.step_only else [measure(args, device, shapes, dt, ex)
                                      for dt, ex in CONFIGS]
    if device.type == "cpu":  # the step's counters are the C core's so far
        rows += [measure_step(args, device, shapes, label, cls, kw)
                 for label, cls, kw in STEP_CONFIGS
                 if args.only is None or any(o in label for o in args.only.split(","))]
    result = {"machine": machine_info(device), "params": n_params, "tensors": len(shapes),
              "repeats": args.repeats, "inner": args.inner, "every": args.every,
              "step_every": args.step_every or args.every, "target_ratio": 1.03, "rows": rows}
    lines = ["# Telemetry overhead: scaler.unscale_ + step + update (gradient half) and "
             "opt.step() (step half), on vs off", ""]
    lines += machine_header(result["machine"])
    lines += ["GPT-2 small shapes%s: %d tensors, %.1f M params (FP32 masters), "
              "mpext.optim.AdamW, read every %d steps, the step half counted on one step in %d; "
              "%d interleaved repeats of %d steps."
              % (" (reduced)" if args.quick else "", len(shapes), n_params / 1e6, args.every,
                 args.step_every or args.every, args.repeats, args.inner), "",
              "| params | path | median step off | on | ratio on/off (median) | IQR | min..max "
              "| <= 1.03 |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| %s | %s | %.2f ms | %.2f ms | %.3f | %.3f..%.3f | %.3f..%.3f | %s |"
                     % (r["dtype"], r["path"], r["median_ms_off"], r["median_ms_on"],
                        r["median_ratio"], r["ratio_q1"], r["ratio_q3"], r["ratio_min"],
                        r["ratio_max"], "yes" if r["median_ratio"] <= 1.03 else "no"))
    step_rows = [r for r in rows if "cpu_median_ratio" in r]
    if step_rows:
        lines += ["", "The step half in CPU time (the process's, all threads), same runs:", "",
                  "| path | CPU ratio on/off (median) | IQR | min..max | load avg before, after "
                  "| <= 1.03 |", "|---|---|---|---|---|---|"]
        for r in step_rows:
            lines.append("| %s | %.3f | %.3f..%.3f | %.3f..%.3f | %.1f, %.1f | %s |"
                         % (r["path"], r["cpu_median_ratio"], r["cpu_ratio_q1"],
                            r["cpu_ratio_q3"], r["cpu_ratio_min"], r["cpu_ratio_max"],
                            r["load_before"], r["load_after"],
                            "yes" if r["cpu_median_ratio"] <= 1.03 else "no"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_telemetry.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "bench_telemetry.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
