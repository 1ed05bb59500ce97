"""Casts: mpext's casts against PyTorch's (``to_bf16``/``to_fp16``/``to_fp32`` vs ``Tensor.to``,
``cast_`` vs ``copy_`` and ``torch._foreach_copy_``), in the same run on the same device.
Method, cases and columns: benchmarks/README.md, "Casts".

    python -m benchmarks.bench_cast [--quick] [--device auto|cpu|cuda]
"""
import math
import sys


import torch

import mpext
from .common import (Context, MiB, PhaseClock, Timing, busy, combine_rooflines, expect_same,
                    figure_title, fmt_count, fmt_ms, free_memory, gpt2_shapes, markdown_table,
                    pair_metrics, payload_header, pct, peak_memory_many, plot_lines,
                    report_footer, results, roofline_hlines, roofline_line, run_standalone,
                    section_head, time_pairs)

NAME = "bench_cast"
TITLE = "Casts: mpext vs PyTorch"

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
BYTES_PER_ELEM = 6  # every cast here reads 4 (2) and writes 2 (4) bytes per element
COPY_TARGET = 0.80  # target: >= 80% of the copy (memcpy) roofline; reported, never asserted
NOISE_RATIO = 0.95  # a speed ratio in [0.95, 1) shows as "≈" (within run-to-run noise)

SIZES_FULL = [1 << 20, 4 << 20, 16 << 20, 64 << 20]
SIZES_QUICK = [1 << 20, 4 << 20, 16 << 20]

# (key, label) of the single-tensor cases of the sweep, in display order
SWEEP_CASES = [
    ("bf16", "fp32→bf16"),
    ("fp16", "fp32→fp16"),
    ("f32_from_bf16", "bf16→fp32"),
    ("f32_from_fp16", "fp16→fp32"),
    ("bf16_sr", "fp32→bf16 stochastic"),
]
PREALLOC_CASES = [
    ("bf16_pre", "fp32→bf16 into preallocated (cast_ vs copy_)"),
    ("fp16_pre", "fp32→fp16 into preallocated (cast_ vs copy_)"),
]


def _sanity(x, masters):
    """Every timed cast that has a torch counterpart, once, against it (exactly)."""
    for key, (f_mp, f_t) in _single_fns(x, x.to(BF16), x.to(FP16)).items():
        if f_t is not None:
            expect_same(key, f_mp(), f_t())
    for dtype in (BF16, FP16):
        got = [torch.empty_like(m, dtype=dtype) for m in masters]
        mpext.ops.cast_(got, masters)
        expect_same("cast_ list to %s" % dtype, got, [m.to(dtype) for m in masters])


def _single_fns(x, xb, xh):
    """key -> (mpext fn, torch fn or None) for the out-of-place single-tensor cases."""
    return {
        "bf16": (lambda: mpext.ops.to_bf16(x), lambda: x.to(BF16)),
        "fp16": (lambda: mpext.ops.to_fp16(x), lambda: x.to(FP16)),
        "f32_from_bf16": (lambda: mpext.ops.to_fp32(xb), lambda: xb.float()),
        "f32_from_fp16": (lambda: mpext.ops.to_fp32(xh), lambda: xh.float()),
        "bf16_sr": (lambda: mpext.ops.to_bf16(x, stochastic=True, seed=1), None),
    }


def _prealloc_fns(x, db, dh):
    """The fp32 -> bf16/fp16 conversions into an existing tensor: cast_([dst], [x]) vs
    dst.copy_(x) (the kernels without the cost of allocating and faulting in a result)."""
    return {
        "bf16_pre": (lambda: mpext.ops.cast_([db], [x]), lambda: db.copy_(x)),
        "fp16_pre": (lambda: mpext.ops.cast_([dh], [x]), lambda: dh.copy_(x)),
    }


def run(ctx: Context) -> dict:
    dev = ctx.device
    sizes = SIZES_QUICK if ctx.quick else SIZES_FULL
    main_n = sizes[-1]
    phase = PhaseClock()
    phases = phase.times

    roof_start = ctx.roofline()
    phase("roofline")

    g = torch.Generator().manual_seed(0)
    x_main = torch.randn(main_n, generator=g, dtype=FP32).to(dev)
    shapes = gpt2_shapes()
    total = sum(math.prod(s) for _, s in shapes)
    masters = [(torch.randn(s, generator=g) * 0.02).to(dev) for _, s in shapes]
    phase("inputs")

    _sanity(x_main, masters)
    phase("correctness")

    # ---- size sweep (single tensor: out of place, and into a preallocated tensor)
    sweep = {}
    bar = ctx.progress(total=len(sizes), desc="cast sweep")
    with bar:
        for n in sizes:
            x = x_main[:n].clone()
            xb, xh = x.to(BF16), x.to(FP16)
            db, dh = torch.zeros_like(xb), torch.zeros_like(xh)
            pairs = dict(_single_fns(x, xb, xh), **_prealloc_fns(x, db, dh))
            res = time_pairs(ctx, pairs, desc="%s elements" % fmt_count(n))
            sweep[n] = {key: (tm, tt, BYTES_PER_ELEM * n) for key, (tm, tt) in res.items()}
            del x, xb, xh, db, dh, pairs
            free_memory(dev)
            bar.update(1)

    phase("sweep")

    # ---- peak memory at the main size
    x = x_main
    xb, xh = x.to(BF16), x.to(FP16)
    peak_fns = {}
    for key, (f_mp, f_t) in _single_fns(x, xb, xh).items():
        peak_fns[(key, 0)] = f_mp
        if f_t is not None:
            peak_fns[(key, 1)] = f_t
    pb = [torch.zeros_like(m, dtype=BF16) for m in masters]
    ph = [torch.zeros_like(m, dtype=FP16) for m in masters]
    for key, dst in (("list_bf16", pb), ("list_fp16", ph)):
        peak_fns[(key, 0)] = lambda dst=dst: mpext.ops.cast_(dst, masters)
        peak_fns[(key, 1)] = lambda dst=dst: torch._foreach_copy_(dst, masters)
    measured = peak_memory_many(peak_fns, dev)
    peaks = {}
    for (key, side), v in measured.items():
        peaks.setdefault(key, [None, None])[side] = v
    del xb, xh, peak_fns
    free_memory(dev)
    phase("peak_memory")

    # ---- list form, GPT-2 small (pb, ph: the bf16 / fp16 params)
    lst = time_pairs(ctx, {
        "list_bf16": (lambda: mpext.ops.cast_(pb, masters),
                      lambda: torch._foreach_copy_(pb, masters)),
        "list_fp16": (lambda: mpext.ops.cast_(ph, masters),
                      lambda: torch._foreach_copy_(ph, masters)),
        "list_bf16_sr": (lambda: mpext.ops.cast_(pb, masters, stochastic=True, seed=1), None),
    }, desc="GPT-2 list")
    lst = {k: (tm, tt, BYTES_PER_ELEM * total) for k, (tm, tt) in lst.items()}
    del pb, ph, masters, x_main, x
    free_memory(dev)
    phase("gpt2_list")
    roof = combine_rooflines(roof_start, ctx.roofline())
    phase("roofline_end")
    sweep = {n: {k: pair_metrics(*v, roof) for k, v in d.items()} for n, d in sweep.items()}
    lst = {k: pair_metrics(*v, roof) for k, v in lst.items()}
    seconds = phase.elapsed()

    # ---- report
    labels = dict(SWEEP_CASES + PREALLOC_CASES)
    rows_spec = [(labels[k], main_n, sweep[main_n][k], k) for k, _ in SWEEP_CASES]
    rows_spec += [(labels[k], main_n, sweep[main_n][k], None) for k, _ in PREALLOC_CASES]
    rows_spec += [
        ("GPT-2 list fp32→bf16 (cast_ vs _foreach_copy_)", total, lst["list_bf16"], "list_bf16"),
        ("GPT-2 list fp32→fp16 (cast_ vs _foreach_copy_)", total, lst["list_fp16"], "list_fp16"),
        ("GPT-2 list fp32→bf16 stochastic (cast_)", total, lst["list_bf16_sr"], None),
    ]
    headers = ["case", "elements", "mpext ms", "torch ms", "mpext GB/s", "torch GB/s",
               "speed mpext/torch", "mpext % in-place roof", "mpext % copy roof",
               "peak MiB mpext/torch", "cores busy mpext/torch", "≥ torch", "≥ 80% copy"]
    rows = []
    cases_json = []
    misses = []
    for label, n, m, peak_key in rows_spec:
        ratio = m["speed_ratio"]
        frac_copy = m["mpext_frac_copy_roofline"]
        peak = peaks.get(peak_key) if peak_key else None
        peak_s = ""
        if peak and peak[0] is not None:
            peak_s = "%.0f / %s" % (peak[0] / MiB, "—" if peak[1] is None else
                                    "%.0f" % (peak[1] / MiB))
        ge_torch = None if ratio is None else ratio >= 1.0
        ge_copy = frac_copy >= COPY_TARGET
        if ratio is None:
            torch_mark = "—"
        elif ratio >= 1.0:
            torch_mark = "yes"
        elif ratio >= NOISE_RATIO:
            torch_mark = "≈"
        else:
            torch_mark = "**no**"
            misses.append("%s: mpext %.2fx torch's speed" % (label, ratio))
        if not ge_copy:
            misses.append("%s: %s of copy roofline" % (label, pct(frac_copy)))
        rows.append([
            label, fmt_count(n),
            fmt_ms(Timing.from_json(m["mpext"])),
            fmt_ms(Timing.from_json(m["torch"])) if m["torch"] else "—",
            "%.1f" % m["mpext_gbps"], "%.1f" % m["torch_gbps"] if m["torch_gbps"] else "—",
            "%.2f" % ratio if ratio is not None else "—",
            pct(m["mpext_frac_inplace_roofline"]), pct(frac_copy), peak_s,
            busy(m),
            torch_mark,
            "yes" if ge_copy else "**no**",
        ])
        cases_json.append(dict(m, case=label, elements=n,
                               peak_bytes_mpext=peak[0] if peak else None,
                               peak_bytes_torch=peak[1] if peak else None,
                               target_ge_torch=ge_torch, target_ge_80pct_copy=ge_copy))

    sweep_keys = [k for k, _ in SWEEP_CASES] + ["bf16_pre", "fp16_pre"]
    short = dict(SWEEP_CASES, bf16_pre="fp32→bf16 prealloc", fp16_pre="fp32→fp16 prealloc")
    sweep_headers = ["elements"] + [short[k] for k in sweep_keys]
    sweep_rows = []
    for n in sizes:
        r = [fmt_count(n)]
        for k in sweep_keys:
            m = sweep[n][k]
            if m["torch_gbps"] is None:
                r.append("%.1f" % m["mpext_gbps"])
            else:
                r.append("%.1f / %.1f (%.2f)" % (m["mpext_gbps"], m["torch_gbps"],
                                                 m["speed_ratio"]))
        sweep_rows.append(r)

    md = section_head(ctx, TITLE)
    md += [roofline_line(roof), ""]
    md += [markdown_table(headers, rows), "",
           "%d samples per row; peak memory from %s%s. Method, cases and columns: "
           "benchmarks/README.md, \"Casts\"."
           % (ctx.repeats, "the CUDA caching allocator's statistics" if ctx.is_cuda else
              "the profiler's allocation records",
              "" if ctx.is_cuda else "; %d torch threads" % ctx.machine["torch_threads"]),
          "",
          "Size sweep, GB/s mpext / torch (speed ratio):", "",
          markdown_table(sweep_headers, sweep_rows), ""]
    md += report_footer(NAME, misses, seconds, phases)
    markdown = "\n".join(md)

    payload = {
        **payload_header(ctx, NAME, TITLE, dev, seconds, phases, roof),
        "bytes_per_element": BYTES_PER_ELEM,
        "copy_target_fraction": COPY_TARGET,
        "gpt2_small": {"params": total, "tensors": len(shapes)},
        "cases": cases_json,
        "sweep": {str(n): sweep[n] for n in sizes},
        "targets_missed": misses,
    }
    return results(ctx, NAME, markdown, payload, seconds, misses,
                   lambda: _plot(ctx, sizes, sweep, roof))


def _plot(ctx, sizes, sweep, roof):
    hl = roofline_hlines(roof, COPY_TARGET)
    panels = []
    for key, label in SWEEP_CASES[:4]:
        series = {"mpext": (sizes, [sweep[n][key]["mpext_gbps"] for n in sizes]),
                  "torch": (sizes, [sweep[n][key]["torch_gbps"] for n in sizes])}
        if key in ("bf16", "fp16"):
            pk = key + "_pre"
            series["mpext cast_ (preallocated)"] = (sizes, [sweep[n][pk]["mpext_gbps"]
                                                           for n in sizes])
            series["torch copy_ (preallocated)"] = (sizes, [sweep[n][pk]["torch_gbps"]
                                                           for n in sizes])
        if key == "bf16":
            series["mpext stochastic"] = (sizes, [sweep[n]["bf16_sr"]["mpext_gbps"]
                                                  for n in sizes])
        panels.append({"title": label, "xlabel": "elements", "ylabel": "GB/s (read + write)",
                       "logx": True, "series": series, "hlines": hl})
    return plot_lines(ctx.out_dir / (NAME + ".png"), panels,
                      title=figure_title(ctx, TITLE, isa=True))


def main(argv=None):
    return run_standalone(run, __doc__, None, argv)


if __name__ == "__main__":
    sys.exit(main())
