"""Gradient norm: ``mpext.ops.grad_norm`` against the norm ``clip_grad_norm_`` computes
(``torch.nn.utils.get_total_norm``), plain and after unscaling, in the same run on the same
device. Method, cases and columns: benchmarks/README.md, "Gradient norm".

    python -m benchmarks.bench_grad_norm [--quick] [--device auto|cpu|cuda]
"""
import math
import sys


import torch

import mpext  # noqa: F401  (loads the extension: registers torch.ops.mpext)
from .common import (Alternate, Context, PhaseClock, Timing, check, combine_rooflines, figure_title,
                     fmt_ms, free_memory, gpt2_shapes, markdown_table, payload_header, pct, pyplot,
                     report_footer, require_kernel, results, roofline_line, run_standalone,
                     save_figure, section_head, time_fns)

NAME = "bench_grad_norm"
TITLE = "Gradient norm: mpext grad_norm vs clip_grad_norm_'s norm"

BF16, FP32 = torch.bfloat16, torch.float32
GRAD_STD = 1e-3
INV = 2.0 ** -16  # the fused rows' inv_scale (mpext side; the gradients are left as they are)


def _lists(ctx, gen):
    """name -> (label, fp32 list): the GPT-2 list and the flat tensors."""
    shapes = gpt2_shapes(reduced=ctx.quick)
    flat = [4 << 20, 16 << 20] if ctx.quick else [16 << 20, 64 << 20]
    out = {"gpt2": ("GPT-2%s list (%d tensors)" % (" (reduced)" if ctx.quick else " small",
                                                   len(shapes)),
                    [(torch.randn(s, generator=gen) * GRAD_STD).to(ctx.device)
                     for _, s in shapes])}
    for n in flat:
        out["flat%dM" % (n >> 20)] = ("flat %dM" % (n >> 20),
                                      [(torch.randn(n, generator=gen) * GRAD_STD).to(ctx.device)])
    return out


def _ref64(grads, inv):
    """The norm of the unscaled fp32 values in float64 (the fp32 product, squared in double)."""
    s = 0.0
    inv_t = None if inv is None else torch.tensor(inv, dtype=FP32, device=grads[0].device)
    for g in grads:
        y = g.float() if inv_t is None else g.float() * inv_t
        s += float((y.double() ** 2).sum())
    return math.sqrt(s)


def _rel(a, b):
    return abs(a - b) / abs(b)


def _errors(grads, inv_t):
    """Relative errors against float64 of mpext's norm and of torch's on the gradients' own
    dtype (as clip_grad_norm_ would run), without and with inv_scale; mpext's must be within
    1e-6."""
    errs = {}
    for key, scale in (("plain", None), ("inv", inv_t.item())):
        want = _ref64(grads, scale)
        got = torch.ops.mpext.grad_norm(grads, inv_scale=None if scale is None else inv_t).item()
        check(_rel(got, want) <= 1e-6, "%s: mpext %r, float64 %r" % (key, got, want))
        own = [g if scale is None else (g.float() * inv_t).to(g.dtype) for g in grads]
        errs[key] = {"mpext": _rel(got, want),
                     "torch": _rel(torch.nn.utils.get_total_norm(own).item(), want)}
    return errs


def measure_read_roofline(ctx, numel):
    """Streaming read bandwidth: ``x.sum()`` over an fp32 buffer of numel elements, 4 bytes per
    element."""
    x = torch.ones(numel, dtype=FP32, device=ctx.device)
    t = time_fns({"read": lambda: x.sum()}, device=ctx.device, repeats=ctx.repeats, warmup=2,
                 min_sample_s=0.0, desc="read roofline", show_progress=ctx.show_progress)["read"]
    del x
    free_memory(ctx.device)
    return {"numel": numel, "read_gbps": t.gbps(4.0 * numel), "read": t.to_json()}


def run(ctx: Context) -> dict:
    dev = ctx.device
    require_kernel(dev, "grad_norm")
    phase = PhaseClock()
    phases = phase.times

    roof_start = ctx.roofline()
    read_start = measure_read_roofline(ctx, roof_start["numel"])
    phase("roofline")

    gen = torch.Generator().manual_seed(0)
    base = _lists(ctx, gen)
    inv_t = torch.full((), INV, dtype=FP32, device=dev)
    found = torch.zeros((), dtype=FP32, device=dev)
    phase("inputs")

    rows, errs = [], {}
    total_norm = torch.nn.utils.get_total_norm
    unscale = torch._amp_foreach_non_finite_check_and_unscale_
    mp_norm = torch.ops.mpext.grad_norm
    for name, (label, grads32) in ctx.progress(list(base.items()), desc="cases"):
        for dtype in (FP32, BF16):
            grads = grads32 if dtype == FP32 else [g.to(dtype) for g in grads32]
            dname = "fp32" if dtype == FP32 else "bf16"
            errs[(name, dname)] = _errors(grads, inv_t)
            want = _ref64(grads, None)
            nbytes = float(sum(g.numel() * g.element_size() for g in grads))
            alt = Alternate(0.5, 2.0, dev)

            def native_unscale_norm(grads=grads, alt=alt):
                unscale(grads, found, alt())
                return total_norm(grads)

            fns = {"mp_norm": lambda grads=grads: mp_norm(grads),
                   "t_norm": lambda grads=grads: total_norm(grads),
                   "mp_fused": lambda grads=grads: mp_norm(grads, inv_scale=inv_t),
                   "t_fused": native_unscale_norm}
            t = ctx.time_fns(fns, desc="%s %s" % (name, dname))
            # after timing: mpext's results did not change, the native side left the
            # gradients at their values x 1 or x 0.5 (exact) and found_inf clear
            got = mp_norm(grads).item() / alt.factor()
            check(_rel(got, want) <= 1e-6 and found.item() == 0.0,
                  "%s %s after timing: norm %r (expected %r), found_inf %r"
                  % (name, dname, got, want, found.item()))
            n = sum(g.numel() for g in grads)
            rows.append({"list": name, "label": label, "dtype": dname, "elements": n,
                         "tensors": len(grads), "bytes": nbytes,
                         "times": {k: v.to_json() for k, v in t.items()},
                         "errors": errs[(name, dname)]})
            del grads, fns
        phase(name)
    del base
    free_memory(dev)
    roof = combine_rooflines(roof_start, ctx.roofline())
    read_end = measure_read_roofline(ctx, roof["numel"])
    read = max(read_start, read_end, key=lambda r: r["read_gbps"])
    phase("roofline_end")
    seconds = phase.elapsed()

    # ---- metrics and report
    headers = ["case", "mpext ms", "torch ms", "speed ratio", "mpext GB/s",
               "mpext / read roofline", "torch / read roofline",
               "rel. error vs fp64 (mpext / torch)"]
    table = []
    for r in rows:
        for kind, mp_key, t_key, t_mult, what in (
                ("norm", "mp_norm", "t_norm", 1.0, "norm"),
                ("after_unscale", "mp_fused", "t_fused", 3.0,
                 "norm after unscale (mpext: fused inv_scale; torch: unscale_ + norm)")):
            tm, tt = Timing.from_json(r["times"][mp_key]), Timing.from_json(r["times"][t_key])
            gb_mp, gb_t = tm.gbps(r["bytes"]), tt.gbps(t_mult * r["bytes"])
            m = {"speed_ratio": tt.median / tm.median, "mpext_gbps": gb_mp, "torch_gbps": gb_t,
                 "mpext_frac_read_roofline": gb_mp / read["read_gbps"],
                 "torch_frac_read_roofline": gb_t / read["read_gbps"],
                 "torch_bytes": t_mult * r["bytes"]}
            r.setdefault("metrics", {})[kind] = m
            e = r["errors"]["plain" if kind == "norm" else "inv"]
            table.append(["%s %s, %s" % (r["label"], r["dtype"], what), fmt_ms(tm), fmt_ms(tt),
                          "%.2fx" % m["speed_ratio"], "%.1f" % gb_mp,
                          pct(m["mpext_frac_read_roofline"]), pct(m["torch_frac_read_roofline"]),
                          "%.1e / %.1e" % (e["mpext"], e["torch"])])

    md = section_head(ctx, TITLE)
    md += [roofline_line(roof) + "; read x.sum() %.1f GB/s (reference here)" % read["read_gbps"],
           "", markdown_table(headers, table), "",
           "%d samples per row. Method, cases and columns: benchmarks/README.md, \"Gradient "
           "norm\"." % ctx.repeats, ""]
    md += report_footer(NAME, [], seconds, phases)
    markdown = "\n".join(md)
    payload = {**payload_header(ctx, NAME, TITLE, dev, seconds, phases, roof),
               "read_roofline": read, "read_roofline_measurements": [read_start, read_end],
               "inv_scale": INV, "rows": rows}
    return results(ctx, NAME, markdown, payload, seconds, [],
                   lambda: _plot(ctx, rows, read, roof))


def _plot(ctx, rows, read, roof):
    """Grouped bars: GB/s of each contender per case, with the read roofline."""
    plt = pyplot()

    labels = ["%s %s" % (r["list"], r["dtype"]) for r in rows]
    series = [("mpext grad_norm", "norm", "mpext_gbps"),
              ("torch get_total_norm", "norm", "torch_gbps"),
              ("mpext grad_norm(inv_scale)", "after_unscale", "mpext_gbps"),
              ("torch unscale_ + get_total_norm", "after_unscale", "torch_gbps")]
    fig, ax = plt.subplots(figsize=(11, 5.5))
    w = 0.2
    for k, (name, kind, key) in enumerate(series):
        ax.bar([i + (k - 1.5) * w for i in range(len(rows))],
               [r["metrics"][kind][key] for r in rows], w, label=name)
    ax.axhline(read["read_gbps"], color="black", linestyle="--", linewidth=1,
               label="read roofline x.sum() %.1f GB/s" % read["read_gbps"])
    ax.axhline(roof["inplace_gbps"], color="grey", linestyle=":", linewidth=1,
               label="in-place roofline %.1f GB/s" % roof["inplace_gbps"])
    ax.set_xticks(list(range(len(rows))))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("GB/s (bytes each side moves / median time)")
    ax.set_ylim(bottom=0)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, ctx.out_dir / (NAME + ".png"), figure_title(ctx, TITLE))


def main(argv=None):
    return run_standalone(run, __doc__, None, argv)


if __name__ == "__main__":
    sys.exit(main())
