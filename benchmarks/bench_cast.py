"""Casts: mpext's casts vs PyTorch's (benchmarks/README.md, "Casts")."""
import math

import torch

import mpext
from .common import (PAIR_HEADERS, Bench, expect_same, fmt_count, free_memory, gpt2_shapes,
                     markdown_table, pair_cells, pair_metrics, pct, peak_pairs, run_standalone,
                     time_pairs, yes_no)

NAME = "bench_cast"
TITLE = "Casts: mpext vs PyTorch"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
BYTES_PER_ELEM = 6  # every cast here reads 4 (2) and writes 2 (4) bytes per element
COPY_TARGET = 0.80  # >= 80% of the copy roofline; reported, never asserted
NOISE_RATIO = 0.95  # a speed ratio in [0.95, 1) shows as "≈" (within run-to-run noise)
SIZE_FULL, SIZE_QUICK = 64 << 20, 16 << 20  # elements of the single-tensor cases
# the single-tensor cases (key, label), then the casts into an existing tensor
SINGLE_CASES = [("bf16", "fp32→bf16"), ("fp16", "fp32→fp16"), ("f32_from_bf16", "bf16→fp32"),
                ("f32_from_fp16", "fp16→fp32"), ("bf16_sr", "fp32→bf16 stochastic"),
                ("bf16_pre", "fp32→bf16 into preallocated (cast_ vs copy_)"),
                ("fp16_pre", "fp32→fp16 into preallocated (cast_ vs copy_)")]
LIST_CASES = [("list_bf16", "GPT-2 list fp32→bf16 (cast_ vs _foreach_copy_)"),
              ("list_fp16", "GPT-2 list fp32→fp16 (cast_ vs _foreach_copy_)"),
              ("list_bf16_sr", "GPT-2 list fp32→bf16 stochastic (cast_)")]


def _single_fns(x):
    """key -> (mpext fn, torch fn or None): out of place, then into existing tensors."""
    xb, xh = x.to(BF16), x.to(FP16)
    db, dh = torch.zeros_like(xb), torch.zeros_like(xh)
    return {"bf16": (lambda: mpext.ops.to_bf16(x), lambda: x.to(BF16)),
            "fp16": (lambda: mpext.ops.to_fp16(x), lambda: x.to(FP16)),
            "f32_from_bf16": (lambda: mpext.ops.to_fp32(xb), lambda: xb.float()),
            "f32_from_fp16": (lambda: mpext.ops.to_fp32(xh), lambda: xh.float()),
            "bf16_sr": (lambda: mpext.ops.to_bf16(x, stochastic=True, seed=1), None),
            "bf16_pre": (lambda: mpext.ops.cast_([db], [x]), lambda: db.copy_(x)),
            "fp16_pre": (lambda: mpext.ops.cast_([dh], [x]), lambda: dh.copy_(x))}


def _list_fns(masters, pb, ph):
    return {"list_bf16": (lambda: mpext.ops.cast_(pb, masters),
                          lambda: torch._foreach_copy_(pb, masters)),
            "list_fp16": (lambda: mpext.ops.cast_(ph, masters),
                          lambda: torch._foreach_copy_(ph, masters)),
            "list_bf16_sr": (lambda: mpext.ops.cast_(pb, masters, stochastic=True, seed=1), None)}


def run(ctx) -> dict:
    b = Bench(ctx, NAME, TITLE)
    dev, main_n = ctx.device, SIZE_QUICK if ctx.quick else SIZE_FULL
    b.start_roofline()
    g = torch.Generator().manual_seed(0)
    x_main = torch.randn(main_n, generator=g, dtype=FP32).to(dev)
    shapes = gpt2_shapes()
    total = sum(math.prod(s) for _, s in shapes)
    masters = [(torch.randn(s, generator=g) * 0.02).to(dev) for _, s in shapes]
    pb = [torch.zeros_like(m, dtype=BF16) for m in masters]
    ph = [torch.zeros_like(m, dtype=FP16) for m in masters]
    b.phase("inputs")
    # the sanity guard: every timed cast that has a torch counterpart, once, exactly
    for key, (f_mp, f_t) in _single_fns(x_main).items():
        if f_t is not None and not key.endswith("_pre"):
            expect_same(key, f_mp(), f_t())
    for dtype in (BF16, FP16):
        got = [torch.empty_like(m, dtype=dtype) for m in masters]
        mpext.ops.cast_(got, masters)
        expect_same("cast_ list to %s" % dtype, got, [m.to(dtype) for m in masters])
    b.phase("correctness")

    times = time_pairs(ctx, _single_fns(x_main), desc="%s elements" % fmt_count(main_n))
    free_memory(dev)
    b.phase("single")
    peaks = peak_pairs(dict({k: v for k, v in _single_fns(x_main).items()
                             if not k.endswith("_pre")}, **_list_fns(masters, pb, ph)), dev)
    free_memory(dev)
    b.phase("peak_memory")
    times.update(time_pairs(ctx, _list_fns(masters, pb, ph), desc="GPT-2 list"))
    del pb, ph, masters, x_main
    free_memory(dev)
    b.phase("gpt2_list")
    roof = b.end_roofline()
    rows, cases = [], []
    for key, label in SINGLE_CASES + LIST_CASES:
        n = total if key.startswith("list") else main_n
        m = pair_metrics(*times[key], BYTES_PER_ELEM * n, roof, peak=peaks.get(key, (None, None)))
        r, frac_copy = m["speed_ratio"], m["mpext_frac_copy_roofline"]
        ge_torch = None if r is None else r >= 1.0
        if r is not None:
            b.target(r >= NOISE_RATIO, "%s: mpext %.2fx torch's speed" % (label, r))
        ge_copy = b.target(frac_copy >= COPY_TARGET, "%s: %s of copy roofline"
                           % (label, pct(frac_copy)))
        rows.append([label, fmt_count(n)] + pair_cells(m) + [
            "≈" if r is not None and NOISE_RATIO <= r < 1 else yes_no(ge_torch),
            yes_no(ge_copy)])
        cases.append(dict(m, case=label, elements=n, target_ge_torch=ge_torch,
                          target_ge_80pct_copy=ge_copy))
    md = [markdown_table(["case", "elements"] + PAIR_HEADERS + ["≥ torch", "≥ 80% copy"], rows),
          "", "%d samples per row. Method, cases and columns: benchmarks/README.md, \"Casts\"."
          % ctx.repeats]
    payload = {"bytes_per_element": BYTES_PER_ELEM, "copy_target_fraction": COPY_TARGET,
               "gpt2_small": {"params": total, "tensors": len(shapes)}, "cases": cases}
    return b.finish(md, payload)


if __name__ == "__main__":
    run_standalone(run, __doc__)
