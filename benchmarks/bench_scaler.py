"""Loss scaler: mpext.unscale_ vs torch's AMP unscale (benchmarks/README.md, "Loss scaler")."""
import random

import torch

from .common import (PAIR_HEADERS, Alternate, Bench, check, count_subnormals, expect_same,
                     free_memory, gpt2_shapes, markdown_table, pair_cells, pair_metrics, pct,
                     peak_pairs, require_kernel, run_standalone, time_pairs, yes_no)

NAME = "bench_scaler"
TITLE = "Loss-scaler unscale_: mpext vs PyTorch"
BF16, FP32 = torch.bfloat16, torch.float32
COPY_TARGET = 0.80  # large list: >= 80% of the copy roofline; reported, never asserted
SPEED_TARGET = 1.5  # many small tensors: >= 1.5x torch; reported, never asserted
NOISE_RATIO = 0.95
N_SMALL, SMALL_MAX, SMALL_SEED = 10_000, 2000, 20240601
GRAD_STD = 1e-3  # gradient-like magnitudes; x0.5 / x2 keeps them far from the subnormal range
T_UNSCALE = torch._amp_foreach_non_finite_check_and_unscale_
CASES = [  # key, list, scaled (inv_scale 0.5 / 2; else 1: check only), group, target, label
    ("gpt2_fp32", "gpt2_fp32", True, "big", "copy", "GPT-2 list fp32, inv_scale 0.5/2"),
    ("gpt2_bf16", "gpt2_bf16", True, "big", "copy", "GPT-2 list bf16, inv_scale 0.5/2"),
    ("gpt2_fp32_check", "gpt2_fp32", False, "big", None,
     "GPT-2 list fp32, inv_scale 1 (check only, reads)"),
    ("small_fp32", "small_fp32", True, "small", "speed", "10,000 small fp32, inv_scale 0.5/2"),
    ("small_mixed", "small_mixed", True, "small", "speed",
     "10,000 small fp32+bf16 (torch: 2 calls), inv_scale 0.5/2"),
    ("small_fp32_check", "small_fp32", False, "small", "speed",
     "10,000 small fp32, inv_scale 1 (check only, reads)"),
    ("tiny_fp32", "tiny_fp32", True, "small", None,
     "10,000 × 1-element fp32, inv_scale 0.5/2 (fixed cost per tensor)"),
]


def _make_fns(grads, found, inv):
    """(mpext fn, torch fn: one call per dtype, as GradScaler) unscaling by ``inv()``."""
    groups = [[t for t in grads if t.dtype == d] for d in dict.fromkeys(t.dtype for t in grads)]

    def f_t():
        scale = inv()
        for g in groups:
            T_UNSCALE(g, found, scale)
    return lambda: torch.ops.mpext.unscale_(grads, found, inv()), f_t


def run(ctx) -> dict:
    dev = ctx.device
    require_kernel(dev, "unscale_")
    b = Bench(ctx, NAME, TITLE)
    b.start_roofline()
    g = torch.Generator().manual_seed(0)
    shapes = gpt2_shapes(reduced=ctx.quick)

    def grad(n, dtype=FP32):
        return (torch.randn(n, generator=g) * GRAD_STD).to(dev, dtype)

    big32 = [grad(s) for _, s in shapes]
    rng = random.Random(SMALL_SEED)
    small_sizes = [rng.randint(1, SMALL_MAX) for _ in range(N_SMALL)]
    lists = {"gpt2_fp32": big32, "gpt2_bf16": [t.to(BF16) for t in big32],
             "small_fp32": [grad(n) for n in small_sizes],
             "small_mixed": [grad(n, BF16 if i % 2 else FP32) for i, n in enumerate(small_sizes)],
             "tiny_fp32": [grad(1) for _ in range(N_SMALL)]}
    b.phase("inputs")
    # the sanity guard: one call per list on both sides, on copies, with inverse scale 1/3
    inv = torch.full((), 1.0 / 3.0, dtype=FP32, device=dev)
    for name, grads in lists.items():
        g_mp, g_t = [t.clone() for t in grads], [t.clone() for t in grads]
        f_mp, f_t = (torch.zeros((), dtype=FP32, device=dev) for _ in range(2))
        _make_fns(g_mp, f_mp, lambda: inv)[0]()
        _make_fns(g_t, f_t, lambda: inv)[1]()
        expect_same(name, g_mp + [f_mp], g_t + [f_t])
        check(count_subnormals(grads) == 0, "%s: %d subnormal inputs"
              % (name, count_subnormals(grads)))
    b.phase("correctness")

    found = torch.zeros((), dtype=FP32, device=dev)
    one = torch.ones((), dtype=FP32, device=dev)
    alts = {name: Alternate(0.5, 2.0, dev) for name in lists}
    refs = {name: [t.clone() for t in grads] for name, grads in lists.items()}
    # peak memory (in place: expected 0), not with --quick (README)
    peaks = {} if ctx.quick else peak_pairs(
        {name: _make_fns(grads, found, alts[name]) for name, grads in lists.items()}, dev)
    b.phase("peak_memory")
    times = {}
    for group, desc in (("big", "GPT-2 list"), ("small", "%d tensors" % N_SMALL)):
        times.update(time_pairs(ctx, {key: _make_fns(lists[ln], found, alts[ln] if scaled else
                                                     lambda: one)
                                      for key, ln, scaled, g, *_ in CASES if g == group}, desc))
        b.phase(group)
    sizes = {name: (sum(t.numel() for t in grads), len(grads),
                    sum(t.numel() * t.element_size() for t in grads))
             for name, grads in lists.items()}  # elements, tensors, bytes
    # after the timed calls every tensor holds exactly its starting values x 1 or x 0.5
    drift = {name: {"factor": alts[name].factor(), "calls": alts[name].calls, "not_exact": sum(
        not torch.equal(t, (ref.float() * alts[name].factor()).to(t.dtype))
        for t, ref in zip(grads, refs[name]))} for name, grads in lists.items()}
    check(not any(d["not_exact"] for d in drift.values()), "tensors drifted during timing (not "
          "their starting values x factor): %s" % drift)
    check(float(found) == 0.0, "found_inf became %r during timing (finite inputs)" % float(found))
    del lists, big32, refs
    free_memory(dev)
    roof = b.end_roofline()

    rows, cases_json = [], []
    for key, ln, scaled, _, target, label in CASES:
        n, ntens, nbytes = sizes[ln]
        m = pair_metrics(*times[key], nbytes * (2 if scaled else 1), roof,
                         peak=peaks.get(key, (None, None)) if scaled else (None, None))
        r, fc = m["speed_ratio"], m["mpext_frac_copy_roofline"]
        met, mark = None, "—"
        if target == "copy":
            met = b.target(fc >= COPY_TARGET, "%s: %s of copy roofline" % (label, pct(fc)))
            mark = "≥ 80%% copy: %s" % yes_no(met)
        elif target == "speed":
            met = b.target(r >= SPEED_TARGET, "%s: mpext %.2fx torch's speed" % (label, r))
            mark = "≥ %.1fx torch: %s" % (SPEED_TARGET, yes_no(met))
        rows.append([label, str(ntens), "%.1fM" % (n / 1e6) if n >= 1e6 else str(n)]
                    + pair_cells(m) + [mark + (" (mpext slower)" if r < NOISE_RATIO else "")])
        cases_json.append(dict(m, key=key, case=label, elements=n, tensors=ntens,
                               target=target, target_met=met))

    tiny = next(c for c in cases_json if c["key"] == "tiny_fp32")
    md = [markdown_table(["case", "tensors", "elements"] + PAIR_HEADERS + ["target"], rows), "",
          "%d samples per row%s. Fixed cost per tensor (the 1-element row): mpext %.2f µs, "
          "torch %.2f µs. After the timings every tensor held exactly its starting values × 1 "
          "or × 0.5. Method, cases and columns: benchmarks/README.md, \"Loss scaler\" (the host "
          "reads per step: tests/test_grad_scaler.py::test_host_syncs)."
          % (ctx.repeats, "; peak memory not measured with --quick" if ctx.quick else "",
             tiny["mpext"]["median_s"] / N_SMALL * 1e6,
             tiny["torch"]["median_s"] / N_SMALL * 1e6)]
    payload = {"copy_target_fraction": COPY_TARGET, "speed_target": SPEED_TARGET,
               "gpt2_list": {"elements": sizes["gpt2_fp32"][0], "tensors": len(shapes),
                             "reduced": ctx.quick},
               "small_list": {"tensors": N_SMALL, "elements": sum(small_sizes),
                              "max_size": SMALL_MAX, "seed": SMALL_SEED},
               "cases": cases_json, "drift_check": drift}
    return b.finish(md, payload)


if __name__ == "__main__":
    run_standalone(run, __doc__)
