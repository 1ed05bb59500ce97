"""Gradient-norm benchmark: ``mpext.ops.grad_norm`` vs the norm PyTorch computes for gradient
clipping, in the same run on the same device (issue 5).

- **norm**: ``torch.ops.mpext.grad_norm(grads)`` vs ``torch.nn.utils.get_total_norm(grads)``,
  the computation inside ``torch.nn.utils.clip_grad_norm_`` (``torch._foreach_norm`` per tensor,
  then ``torch.linalg.vector_norm`` over the per-tensor norms);
- **after unscale**: mpext's fused form ``grad_norm(grads, inv_scale=inv)`` (one read-only pass,
  the gradients are not modified) vs the native AMP sequence before clipping:
  ``torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)`` followed by
  ``get_total_norm(grads)`` (a read-write pass, then a read pass). The native calls alternate
  inv_scale 0.5 and 2.0, so the gradients stay in range over repeated calls;
- on a GPT-2-small-shaped gradient list (124M elements, 148 tensors; a 4-layer, 8K-vocabulary
  version with ``--quick``) and on flat 16M and 64M tensors (4M and 16M with ``--quick``), in
  fp32 and in bf16.

Bytes counted: what each side has to move. mpext and the plain torch norm read every gradient
once; the native unscale-then-norm sequence reads, writes and reads again (3x). GB/s = bytes /
median time; the fraction is of the **read roofline** measured in the same run: ``x.sum()``
over an fp32 buffer far larger than the caches (4 bytes per element), the streaming read speed
of the device. The copy and in-place rooflines of ``common.measure_roofline`` are reported too.

Correctness is checked once before timing, against a float64 reference of the unscaled fp32
values (rtol 1e-6; and loosely against ``get_total_norm`` on fp32-upcast gradients): both sides' relative
errors are in the table (torch's ``_foreach_norm`` returns bf16 norms for bf16 gradients). The
timed results are checked again after timing.

    python benchmarks/bench_grad_norm.py [--quick] [--device auto|cpu|cuda]
"""
import math
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

import mpext  # noqa: F401  (loads the extension: registers torch.ops.mpext)
from common import (Context, combine_rooflines, figure_title, fmt_ms, free_memory, markdown_table,
                    payload_header, pct, report_footer, roofline_line, run_standalone, save_figure,
                    section_head, stopwatch, time_fns, write_json, write_text)

from bench_scaler import _Alternate, _t, gpt2_small_shapes  # inv_scale 0.5 / 2.0 in turn

NAME = "bench_grad_norm"
TITLE = "Gradient norm: mpext grad_norm vs clip_grad_norm_'s norm"

BF16, FP32 = torch.bfloat16, torch.float32
GRAD_STD = 1e-3
INV = 2.0 ** -16  # the fused rows' inv_scale (mpext side; the gradients are left as they are)


class CorrectnessError(AssertionError):
    pass


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _lists(ctx, gen):
    """name -> (label, fp32 list): the GPT-2 list and the flat tensors."""
    shapes = gpt2_small_shapes(n_layer=4, vocab=8192) if ctx.quick else gpt2_small_shapes()
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


def check_correctness(grads, inv_t):
    """mpext's norm vs float64 (rtol 1e-6) and vs get_total_norm on fp32-upcast gradients,
    without and with inv_scale; NaN and Inf propagate. Returns the relative errors of both
    sides (torch on the gradients' own dtype, as clip_grad_norm_ would run) vs float64."""
    inv = inv_t.item()
    errs = {}
    for key, scale in (("plain", None), ("inv", inv)):
        want = _ref64(grads, scale)
        got = torch.ops.mpext.grad_norm(grads, inv_scale=None if scale is None else inv_t).item()
        up = [g.float() if scale is None else g.float() * inv_t for g in grads]
        t32 = torch.nn.utils.get_total_norm(up).item()
        # torch's fp32 sums drift on tens of millions of elements (5e-3 relative on the GPT-2
        # list here), so torch is only a sanity check: the float64 reference is the real one
        if _rel(got, want) > 1e-6 or _rel(got, t32) > 5e-2:
            raise CorrectnessError("%s: mpext %r, float64 %r, torch on fp32 %r"
                                   % (key, got, want, t32))
        own = [g if scale is None else (g.float() * inv_t).to(g.dtype) for g in grads]
        errs[key] = {"mpext": _rel(got, want),
                     "torch": _rel(torch.nn.utils.get_total_norm(own).item(), want)}
    probe = grads[0].clone()
    for bad, check in ((float("nan"), math.isnan), (float("inf"), math.isinf)):
        probe.view(-1)[probe.numel() // 2] = bad
        r = torch.ops.mpext.grad_norm([probe] + grads[1:]).item()
        if not check(r):
            raise CorrectnessError("a %r element gave %r" % (bad, r))
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
    if dev.type == "cuda" and not torch._C._dispatch_has_kernel_for_dispatch_key(
            "mpext::grad_norm", "CUDA"):
        raise RuntimeError("mpext.grad_norm has no CUDA kernel in this build; use --device cpu")
    with stopwatch() as elapsed:
        phases = {}
        t_phase = [elapsed()]

        def phase(name):
            now = elapsed()
            phases[name] = now - t_phase[0]
            t_phase[0] = now

        roof_start = ctx.roofline()
        read_start = measure_read_roofline(ctx, roof_start["numel"])
        phase("roofline")

        gen = torch.Generator().manual_seed(0)
        base = _lists(ctx, gen)
        inv_t = torch.full((), INV, dtype=FP32, device=dev)
        found = torch.zeros((), dtype=FP32, device=dev)
        phase("inputs")

        rows, errors = [], {}
        total_norm = torch.nn.utils.get_total_norm
        unscale = torch._amp_foreach_non_finite_check_and_unscale_
        mp_norm = torch.ops.mpext.grad_norm
        for name, (label, grads32) in ctx.progress(list(base.items()), desc="cases"):
            for dtype in (FP32, BF16):
                grads = grads32 if dtype == FP32 else [g.to(dtype) for g in grads32]
                dname = "fp32" if dtype == FP32 else "bf16"
                errors[(name, dname)] = check_correctness(grads, inv_t)
                want = _ref64(grads, None)
                nbytes = float(sum(g.numel() * g.element_size() for g in grads))
                alt = _Alternate(dev)

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
                if _rel(got, want) > 1e-6 or found.item() != 0.0:
                    raise CorrectnessError("%s %s after timing: norm %r (expected %r), found_inf"
                                           " %r" % (name, dname, got, want, found.item()))
                n = sum(g.numel() for g in grads)
                rows.append({"list": name, "label": label, "dtype": dname, "elements": n,
                             "tensors": len(grads), "bytes": nbytes,
                             "times": {k: v.to_json() for k, v in t.items()},
                             "errors": errors[(name, dname)]})
                del grads, fns
            phase(name)
        del base
        free_memory(dev)
        roof = combine_rooflines(roof_start, ctx.roofline())
        read_end = measure_read_roofline(ctx, roof["numel"])
        read = max(read_start, read_end, key=lambda r: r["read_gbps"])
        phase("roofline_end")
        seconds = elapsed()

    # ---- metrics and report
    headers = ["case", "mpext ms", "torch ms", "speed ratio", "mpext GB/s",
               "mpext / read roofline", "torch / read roofline", "rel. error vs fp64 (mpext / torch)"]
    table = []
    for r in rows:
        for kind, mp_key, t_key, t_mult, what in (
                ("norm", "mp_norm", "t_norm", 1.0, "norm"),
                ("after_unscale", "mp_fused", "t_fused", 3.0,
                 "norm after unscale (mpext: fused inv_scale; torch: unscale_ + norm)")):
            tm, tt = _t(r["times"][mp_key]), _t(r["times"][t_key])
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
           "Medians of %d samples after warm-up, mpext and torch interleaved. torch's norm is "
           "`torch.nn.utils.get_total_norm` (what `clip_grad_norm_` computes: `_foreach_norm` "
           "then `vector_norm`). GB/s and roofline fractions count the bytes each side moves: "
           "one read of the gradients for the norms, three passes (read, write, read) for "
           "torch's unscale-then-norm; the speed ratio (> 1: mpext faster) is per call. The "
           "fused row's inv_scale is 2^-16. Errors are relative to a float64 norm of the same "
           "values (torch's per-tensor norms of bf16 gradients are bf16)." % ctx.repeats, ""]
    md += report_footer(NAME, [], seconds, phases)
    markdown = "\n".join(md)
    payload = {**payload_header(ctx, NAME, TITLE, dev, seconds, phases, roof),
               "read_roofline": read, "read_roofline_measurements": [read_start, read_end],
               "inv_scale": INV, "rows": rows}
    files = [write_json(ctx.out_dir / (NAME + ".json"), payload),
             write_text(ctx.out_dir / (NAME + ".md"), markdown)]
    if ctx.plots:
        files.append(_plot(ctx, rows, read, roof))
    return {"name": NAME, "markdown": markdown, "json": payload, "files": [str(f) for f in files],
            "seconds": seconds, "targets_missed": []}


def _plot(ctx, rows, read, roof):
    """Grouped bars: GB/s of each contender per case, with the read roofline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
