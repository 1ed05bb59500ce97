"""Gradient norm: mpext grad_norm vs clip_grad_norm_'s (benchmarks/README.md)."""
import math

import torch

from .common import (Alternate, Bench, check, fmt_ms, free_memory, gpt2_shapes, markdown_table,
                     pair_metrics, pct, require_kernel, run_standalone, time_pairs)

NAME = "bench_grad_norm"
TITLE = "Gradient norm: mpext grad_norm vs clip_grad_norm_'s norm"
BF16, FP32 = torch.bfloat16, torch.float32
GRAD_STD = 1e-3
INV = 2.0 ** -16  # the fused rows' inv_scale (mpext side; the gradients are left as they are)
# kind, torch's bytes / mpext's, label, errors' key
KINDS = [("norm", 1.0, "norm", "plain"), ("after_unscale", 3.0,
          "norm after unscale (mpext: fused inv_scale; torch: unscale_ + norm)", "inv")]


def _lists(ctx, gen):
    """name -> (label, fp32 list): the GPT-2 list and the flat tensors."""
    shapes = [s for _, s in gpt2_shapes(reduced=ctx.quick)]
    sizes = [4 << 20, 16 << 20] if ctx.quick else [16 << 20, 64 << 20]
    out = {"gpt2": ("GPT-2%s list (%d tensors)" % (" (reduced)" if ctx.quick else " small",
                                                   len(shapes)), shapes)}
    out.update({"flat%dM" % (n >> 20): ("flat %dM" % (n >> 20), [(n,)]) for n in sizes})
    return {k: (label, [(torch.randn(s, generator=gen) * GRAD_STD).to(ctx.device) for s in ss])
            for k, (label, ss) in out.items()}


def _ref64(grads, inv_t=None):
    """The norm of the unscaled fp32 values in float64 (the fp32 product, squared in double)."""
    return math.sqrt(sum(float(((g.float() if inv_t is None else g.float() * inv_t).double()
                                ** 2).sum()) for g in grads))


def _rel(a, b):
    return abs(a - b) / abs(b)


def _errors(grads, inv_t):
    """Relative errors vs float64 of mpext's norm (≤ 1e-6 asserted) and torch's."""
    errs = {}
    for key, scale in (("plain", None), ("inv", inv_t)):
        want = _ref64(grads, scale)
        got = torch.ops.mpext.grad_norm(grads, inv_scale=scale).item()
        check(_rel(got, want) <= 1e-6, "%s: mpext %r, float64 %r" % (key, got, want))
        own = [g if scale is None else (g.float() * scale).to(g.dtype) for g in grads]
        errs[key] = {"mpext": _rel(got, want),
                     "torch": _rel(torch.nn.utils.get_total_norm(own).item(), want)}
    return errs


def run(ctx) -> dict:
    dev = ctx.device
    require_kernel(dev, "grad_norm")
    b = Bench(ctx, NAME, TITLE)
    b.start_roofline(read=True)
    base = _lists(ctx, torch.Generator().manual_seed(0))
    inv_t = torch.full((), INV, dtype=FP32, device=dev)
    found = torch.zeros((), dtype=FP32, device=dev)
    b.phase("inputs")
    total_norm, mp_norm = torch.nn.utils.get_total_norm, torch.ops.mpext.grad_norm
    unscale = torch._amp_foreach_non_finite_check_and_unscale_
    rows = []
    for name, (label, grads32) in ctx.progress(list(base.items()), desc="cases"):
        for dname, dtype in (("fp32", FP32), ("bf16", BF16)):
            grads = grads32 if dtype == FP32 else [g.to(dtype) for g in grads32]
            errs, want, alt = _errors(grads, inv_t), _ref64(grads), Alternate(0.5, 2.0, dev)

            def native_unscale_norm(grads=grads, alt=alt):
                unscale(grads, found, alt())
                return total_norm(grads)

            pairs = {"norm": (lambda g=grads: mp_norm(g), lambda g=grads: total_norm(g)),
                     "after_unscale": (lambda g=grads: mp_norm(g, inv_scale=inv_t),
                                       native_unscale_norm)}
            t = time_pairs(ctx, pairs, "%s %s" % (name, dname))
            # after timing: mpext's result unchanged (gradients x 1 or x 0.5), found_inf clear
            got = mp_norm(grads).item() / alt.factor()
            check(_rel(got, want) <= 1e-6 and found.item() == 0.0,
                  "%s %s after timing: norm %r (expected %r), found_inf %r"
                  % (name, dname, got, want, found.item()))
            rows.append({"list": name, "label": label, "dtype": dname,
                         "elements": sum(g.numel() for g in grads), "tensors": len(grads),
                         "bytes": float(sum(g.numel() * g.element_size() for g in grads)),
                         "times": t, "errors": errs})
            del grads
        b.phase(name)
    del base
    free_memory(dev)
    roof = b.end_roofline()
    table = []
    for r in rows:
        t, r["metrics"] = r.pop("times"), {}
        for kind, t_mult, what, err_key in KINDS:
            m = r["metrics"][kind] = pair_metrics(*t[kind], r["bytes"], roof, t_mult * r["bytes"])
            e = r["errors"][err_key]
            table.append(["%s %s, %s" % (r["label"], r["dtype"], what), fmt_ms(m["mpext"]),
                          fmt_ms(m["torch"]), "%.2fx" % m["speed_ratio"],
                          "%.1f" % m["mpext_gbps"], pct(m["mpext_frac_read_roofline"]),
                          pct(m["torch_frac_read_roofline"]),
                          "%.1e / %.1e" % (e["mpext"], e["torch"])])
    md = [markdown_table(["case", "mpext ms", "torch ms", "speed ratio", "mpext GB/s",
                          "mpext / read roofline", "torch / read roofline",
                          "rel. error vs fp64 (mpext / torch)"], table), "",
          "%d samples per row; the read roofline is the reference here. Method, cases and "
          "columns: benchmarks/README.md, \"Gradient norm\"." % ctx.repeats]
    return b.finish(md, {"inv_scale": INV, "rows": rows})


if __name__ == "__main__":
    run_standalone(run, __doc__)
