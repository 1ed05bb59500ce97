"""Loss scaler: ``mpext.unscale_`` against ``torch._amp_foreach_non_finite_check_and_unscale_``
on a large and a many-tensor gradient list, and the host reads per ``GradScaler`` step, in the
same run on the same device. Method, cases and columns: benchmarks/README.md, "Loss scaler".

    python -m benchmarks.bench_scaler [--quick] [--device auto|cpu|cuda]
"""
import collections
import contextlib
import math
import random
import sys


import torch

import mpext  # noqa: F401  (loads the extension: registers torch.ops.mpext)
from .common import (Alternate, Context, MiB, PhaseClock, Timing, busy, check, combine_rooflines,
                     count_subnormals, expect_same, figure_title, fmt_ms, free_memory, gpt2_shapes,
                     markdown_table, pair_metrics, payload_header, pct, peak_memory_many, pyplot,
                     report_footer, require_kernel, results, roofline_line, run_standalone,
                     save_figure, section_head, time_pairs)

NAME = "bench_scaler"
TITLE = "Loss-scaler unscale_: mpext vs PyTorch"

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
COPY_TARGET = 0.80  # large list: >= 80% of the copy (memcpy) roofline; reported, never asserted
SPEED_TARGET = 1.5  # many small tensors: >= 1.5x torch; reported, never asserted
NOISE_RATIO = 0.95  # a speed ratio in [0.95, 1) shows as "≈" (within run-to-run noise)

N_SMALL = 10_000
SMALL_MAX = 2000
SMALL_SEED = 20240601

GRAD_STD = 1e-3  # gradient-like magnitudes; x0.5 / x2 keeps them far from the subnormal range


def _nbytes(tensors, write=True):
    """Bytes the operation reads (and writes) over a list."""
    return sum(t.numel() * t.element_size() for t in tensors) * (2 if write else 1)


def _group_by_dtype(tensors):
    """As GradScaler._unscale_grads_ does: one list per dtype, in first-seen order."""
    groups = collections.OrderedDict()
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


def _sanity(lists, dev):
    """One call per list on both sides, on copies, with a non-power-of-two inverse scale: the
    same values and the same found_inf."""
    inv = torch.full((), 1.0 / 3.0, dtype=FP32, device=dev)
    for name, grads in lists.items():
        g_mp, g_t = [g.clone() for g in grads], [g.clone() for g in grads]
        f_mp, f_t = (torch.zeros((), dtype=FP32, device=dev) for _ in range(2))
        torch.ops.mpext.unscale_(g_mp, f_mp, inv)
        for group in _group_by_dtype(g_t):
            torch._amp_foreach_non_finite_check_and_unscale_(group, f_t, inv)
        expect_same(name, g_mp + [f_mp], g_t + [f_t])


# ---------------------------------------------------------------------------------------------
# Host syncs per optimizer step

SYNC_METHODS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist")


@contextlib.contextmanager
def count_host_reads():
    """Counts calls of the torch.Tensor methods that read a value back to the host (.item(),
    bool(t), float(t), int(t), .tolist()): one per host sync on an accelerator."""
    counts = collections.Counter()
    saved = {n: getattr(torch.Tensor, n) for n in SYNC_METHODS}

    def wrap(name, fn):
        def counted(self, *a, **k):
            counts[name] += 1
            return fn(self, *a, **k)
        return counted

    for n, fn in saved.items():
        setattr(torch.Tensor, n, wrap(n, fn))
    try:
        yield counts
    finally:
        for n, fn in saved.items():
            setattr(torch.Tensor, n, fn)


def _toy_model(dev, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 16)).to(dev)


def _backward(model, scale, dev, poison=False):
    x = torch.randn(32, 64, device=dev)
    loss = model(x).square().mean()
    (loss * scale).backward()
    if poison:  # an overflow in one gradient
        p = next(model.parameters())
        p.grad.view(-1)[3] = float("inf")


def measure_host_syncs(dev, steps=3):
    """Host reads per optimizer step (the unscale / inf check / skip decision / optimizer step;
    update is counted apart), on three paths. The last step of each path has an Inf in one
    gradient: the step must then be skipped, and how many reads it took is counted too."""
    paths = {}

    def run_scaler(key, label, make_opt):
        model = _toy_model(dev)
        opt = make_opt(model.parameters())
        scaler = torch.amp.GradScaler(dev.type, init_scale=2.0 ** 10)
        per_step, per_update, skipped_ok = [], [], None
        for s in range(steps):
            opt.zero_grad(set_to_none=True)
            poison = s == steps - 1
            _backward(model, scaler.scale(torch.ones((), device=dev)), dev, poison)
            before = [p.detach().clone() for p in model.parameters()]
            with count_host_reads() as c:
                scaler.step(opt)
            with count_host_reads() as cu:
                scaler.update()
            per_step.append(sum(c.values()))
            per_update.append(sum(cu.values()))
            if poison:
                skipped_ok = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        paths[key] = {"label": label, "per_step": per_step, "per_update": per_update,
                      "inf_step_skipped": skipped_ok}

    run_scaler("torch_sgd", "torch GradScaler.step + SGD (non-fused: "
               "_amp_foreach_non_finite_check_and_unscale_, then found_inf on the host)",
               lambda ps: torch.optim.SGD(ps, lr=0.1))
    try:
        run_scaler("torch_fused", "torch GradScaler.step + AdamW(fused=True) "
                   "(_step_supports_amp_scaling: found_inf stays on the device)",
                   lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True))
    except (RuntimeError, NotImplementedError) as exc:
        paths["torch_fused"] = {"label": "torch GradScaler.step + AdamW(fused=True)",
                                "error": "%s: %s" % (type(exc).__name__, exc)}

    # mpext: unscale_ + a fused optimizer that reads found_inf on the device + update_scale_
    try:
        model = _toy_model(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        scale = torch.full((), 2.0 ** 10, dtype=FP32, device=dev)
        tracker = torch.zeros((), dtype=torch.int32, device=dev)
        found = torch.zeros((), dtype=FP32, device=dev)
        per_step, skipped_ok = [], None
        for s in range(steps):
            opt.zero_grad(set_to_none=True)
            poison = s == steps - 1
            _backward(model, scale, dev, poison)
            before = [p.detach().clone() for p in model.parameters()]
            with count_host_reads() as c:
                found.zero_()
                inv = scale.double().reciprocal().float()
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                torch.ops.mpext.unscale_(grads, found, inv)
                opt.found_inf = found  # the fused step skips itself on the device
                opt.step()
                del opt.found_inf
                torch.ops.mpext.update_scale_(scale, tracker, found, 2.0, 0.5, 2000)
            per_step.append(sum(c.values()))
            if poison:
                skipped_ok = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        paths["mpext_fused"] = {"label": "mpext unscale_ + AdamW(fused=True) reading found_inf "
                                         "on the device + mpext update_scale_",
                                "per_step": per_step, "per_update": [0] * steps,
                                "update_in_step": True, "inf_step_skipped": skipped_ok}
    except (RuntimeError, NotImplementedError) as exc:
        paths["mpext_fused"] = {"label": "mpext unscale_ + AdamW(fused=True)",
                                "error": "%s: %s" % (type(exc).__name__, exc)}
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return paths


# ---------------------------------------------------------------------------------------------
# Benchmark


def _make_fns(grads, alt, found, one):
    """(mpext fn, torch fn) for a list: alternate inv_scale (alt) or check only (alt None)."""
    groups = _group_by_dtype(grads)
    mp_op = torch.ops.mpext.unscale_
    t_op = torch._amp_foreach_non_finite_check_and_unscale_
    if alt is None:
        def f_mp():
            mp_op(grads, found, one)

        def f_t():
            for g in groups:
                t_op(g, found, one)
    else:
        def f_mp():
            mp_op(grads, found, alt())

        def f_t():
            inv = alt()
            for g in groups:
                t_op(g, found, inv)
    return f_mp, f_t


def _drift_refs(lists):
    """Copies of every list's starting values (checked to hold no subnormal), to compare with
    after the timings."""
    refs = {}
    for name, grads in lists.items():
        n = count_subnormals(grads)
        check(n == 0, "%s: %d subnormal inputs" % (name, n))
        refs[name] = [t.clone() for t in grads]
    return refs


def _check_drift(lists, refs, alts):
    """After the timed calls every tensor must hold exactly its starting values times 1 or 0.5
    (x0.5 / x2 are exact for normal numbers): no drift towards zero, no subnormals."""
    out = {}
    for name, grads in lists.items():
        factor = alts[name].factor()
        bad = [i for i, (t, ref) in enumerate(zip(grads, refs[name]))
               if not torch.equal(t, ref if factor == 1.0 else (ref.float() * factor).to(t.dtype))]
        out[name] = {"factor": factor, "calls": alts[name].calls, "tensors_checked": len(grads),
                     "tensors_not_exact": len(bad)}
        check(not bad, "%s: %d tensors (first: %s) drifted during timing: not their starting "
              "values x %r" % (name, len(bad), bad[:1], factor))
    return out


def run(ctx: Context) -> dict:
    dev = ctx.device
    require_kernel(dev, "unscale_")
    phase = PhaseClock()
    phases = phase.times

    roof_start = ctx.roofline()
    phase("roofline")

    # ---- inputs
    g = torch.Generator().manual_seed(0)
    shapes = gpt2_shapes(reduced=ctx.quick)
    big_total = sum(math.prod(s) for _, s in shapes)
    big32 = [(torch.randn(s, generator=g) * GRAD_STD).to(dev) for _, s in shapes]
    big16 = [t.to(BF16) for t in big32]
    rng = random.Random(SMALL_SEED)
    small_sizes = [rng.randint(1, SMALL_MAX) for _ in range(N_SMALL)]
    small32 = [(torch.randn(n, generator=g) * GRAD_STD).to(dev) for n in small_sizes]
    small_mixed = [(torch.randn(n, generator=g) * GRAD_STD).to(dev, BF16 if i % 2 else FP32)
                   for i, n in enumerate(small_sizes)]
    big_lists = {"gpt2_fp32": big32, "gpt2_bf16": big16}
    tiny32 = [(torch.randn(1, generator=g) * GRAD_STD).to(dev) for _ in range(N_SMALL)]
    small_lists = {"small_fp32": small32, "small_mixed": small_mixed, "tiny_fp32": tiny32}
    phase("inputs")

    _sanity(dict(big_lists, **small_lists), dev)
    phase("correctness")

    syncs = measure_host_syncs(dev)
    phase("host_syncs")

    found = torch.zeros((), dtype=FP32, device=dev)
    one = torch.ones((), dtype=FP32, device=dev)
    lists = dict(big_lists, **small_lists)
    alts = {name: Alternate(0.5, 2.0, dev) for name in lists}
    refs = _drift_refs(lists)

    # ---- peak memory (in place on both sides: expected 0). Skipped with --quick: starting
    # the profiler costs seconds of the quick suite's budget.
    peaks = {}
    if not ctx.quick:
        peak_fns = {}
        for name, grads in lists.items():
            f_mp, f_t = _make_fns(grads, alts[name], found, one)
            peak_fns[(name, 0)], peak_fns[(name, 1)] = f_mp, f_t
        for (name, side), v in peak_memory_many(peak_fns, dev).items():
            peaks.setdefault(name, [None, None])[side] = v
        del peak_fns
        phase("peak_memory")

    # ---- (a) the GPT-2 list; (b) 10,000 small tensors
    cases = {}  # key -> (t_mp, t_t, bytes)
    for group, specs, desc in (
            ("big", [("gpt2_fp32", "gpt2_fp32", True), ("gpt2_bf16", "gpt2_bf16", True),
                     ("gpt2_fp32_check", "gpt2_fp32", False)], "GPT-2 list"),
            ("small", [("small_fp32", "small_fp32", True),
                       ("small_mixed", "small_mixed", True),
                       ("small_fp32_check", "small_fp32", False),
                       ("tiny_fp32", "tiny_fp32", True)], "%d tensors" % N_SMALL)):
        pairs, nbytes = {}, {}
        for key, lname, scaled in specs:
            grads = lists[lname]
            pairs[key] = _make_fns(grads, alts[lname] if scaled else None, found, one)
            nbytes[key] = _nbytes(grads, write=scaled)
        res = time_pairs(ctx, pairs, desc=desc)
        for key, (tm, tt) in res.items():
            cases[key] = (tm, tt, nbytes[key])
        phase(group)
    found_after = float(found)
    drift = _check_drift(lists, refs, alts)
    check(found_after == 0.0, "found_inf became %r during timing (finite inputs)"
          % found_after)
    del big32, big16, small32, small_mixed, tiny32, lists, big_lists, small_lists, refs
    free_memory(dev)
    roof = combine_rooflines(roof_start, ctx.roofline())
    phase("roofline_end")
    metrics = {k: pair_metrics(tm, tt, nb, roof) for k, (tm, tt, nb) in cases.items()}
    seconds = phase.elapsed()

    # ---- report
    n_small = sum(small_sizes)
    n_mixed_bf16 = sum(n for i, n in enumerate(small_sizes) if i % 2)
    ns = "{:,}".format(N_SMALL)
    row_specs = [
        # key, label, elements, tensors, target kind, peak key
        ("gpt2_fp32", "GPT-2 list fp32, inv_scale 0.5/2", big_total, len(shapes), "copy",
         "gpt2_fp32"),
        ("gpt2_bf16", "GPT-2 list bf16, inv_scale 0.5/2", big_total, len(shapes), "copy",
         "gpt2_bf16"),
        ("gpt2_fp32_check", "GPT-2 list fp32, inv_scale 1 (check only, reads)", big_total,
         len(shapes), None, None),
        ("small_fp32", "%s small fp32, inv_scale 0.5/2" % ns, n_small, N_SMALL, "speed",
         "small_fp32"),
        ("small_mixed", "%s small fp32+bf16 (torch: 2 calls), inv_scale 0.5/2" % ns, n_small,
         N_SMALL, "speed", "small_mixed"),
        ("small_fp32_check", "%s small fp32, inv_scale 1 (check only, reads)" % ns, n_small,
         N_SMALL, "speed", None),
        ("tiny_fp32", "%s × 1-element fp32, inv_scale 0.5/2 (fixed cost per tensor)" % ns,
         N_SMALL, N_SMALL, None, "tiny_fp32"),
    ]
    headers = ["case", "tensors", "elements", "MB counted", "mpext ms", "torch ms", "mpext GB/s",
               "torch GB/s", "speed mpext/torch", "mpext % in-place roof", "mpext % copy roof",
               "torch % copy roof", "cores busy mpext/torch", "peak MiB mpext/torch", "target"]
    rows, cases_json, misses = [], [], []
    for key, label, n, ntens, target, peak_key in row_specs:
        m = metrics[key]
        ratio, frac_copy = m["speed_ratio"], m["mpext_frac_copy_roofline"]
        if target == "copy":
            met = frac_copy >= COPY_TARGET
            mark = "≥ 80%% copy: %s" % ("yes" if met else "**no**")
            if not met:
                misses.append("%s: %s of copy roofline" % (label, pct(frac_copy)))
        elif target == "speed":
            met = ratio >= SPEED_TARGET
            mark = "≥ %.1fx torch: %s" % (SPEED_TARGET, "yes" if met else "**no**")
            if not met:
                misses.append("%s: mpext %.2fx torch's speed" % (label, ratio))
        else:
            met, mark = None, "—"
        if ratio < NOISE_RATIO:
            mark += " (mpext slower)"
        peak = peaks.get(peak_key) if peak_key else None
        peak_s = ""
        if peak and peak[0] is not None:
            peak_s = "%.1f / %s" % (peak[0] / MiB, "—" if peak[1] is None else
                                    "%.1f" % (peak[1] / MiB))
        rows.append([label, str(ntens), _fmt_elems(n), "%.3g" % (m["bytes"] / 1e6),
                     fmt_ms(Timing.from_json(m["mpext"])), fmt_ms(Timing.from_json(m["torch"])),
                     "%.1f" % m["mpext_gbps"], "%.1f" % m["torch_gbps"], "%.2f" % ratio,
                     pct(m["mpext_frac_inplace_roofline"]), pct(frac_copy),
                     pct(m["torch_frac_copy_roofline"]), busy(m), peak_s, mark])
        cases_json.append(dict(m, key=key, case=label, elements=n, tensors=ntens,
                               target=target, target_met=met,
                               peak_bytes_mpext=peak[0] if peak else None,
                               peak_bytes_torch=peak[1] if peak else None))

    sync_headers = ["path", "host reads per step (step() only)", "per update()",
                    "Inf step skipped"]
    sync_rows = []
    for p in syncs.values():
        if "error" in p:
            sync_rows.append([p["label"], "failed: " + p["error"], "", ""])
            continue
        sync_rows.append([
            p["label"], _per_step(p["per_step"]),
            "(in step)" if p.get("update_in_step") else _per_step(p["per_update"]),
            "yes" if p["inf_step_skipped"] else "**no**"])

    md = section_head(ctx, TITLE)
    md += [roofline_line(roof), ""]
    md += [markdown_table(headers, rows), "",
           "%d samples per row; peak memory %s. The GPT-2 list: %s elements in %d tensors%s; "
           "the small tensors: %s elements (%.0f MB in fp32, %s of them bf16 in the mixed list), "
           "against a %.0f MiB last-level cache. Fixed cost per tensor (the 1-element row): "
           "mpext %.2f µs, torch %.2f µs. After the timings every tensor held exactly its "
           "starting values × 1 or × 0.5 (%s). Method, cases and columns: benchmarks/README.md, "
           "\"Loss scaler\"."
           % (ctx.repeats, "not measured with --quick" if ctx.quick else
              ("from the CUDA caching allocator's statistics" if ctx.is_cuda else
               "from the profiler's allocation records"),
              "{:,}".format(big_total), len(shapes),
              " (reduced with --quick: 4 layers, 8K vocabulary)" if ctx.quick
              else " (GPT-2 small)", "{:,}".format(n_small), 4 * n_small / 1e6,
              "{:,}".format(n_mixed_bf16), ctx.machine["llc_bytes_cpu"] / MiB,
              metrics["tiny_fp32"]["mpext"]["median_s"] / N_SMALL * 1e6,
              metrics["tiny_fp32"]["torch"]["median_s"] / N_SMALL * 1e6,
              ", ".join("%s ×%g after %d calls" % (k, v["factor"], v["calls"])
                        for k, v in drift.items())),
           "",
           "Host reads of a device value per optimizer step, steps 1..%d; the last step has an "
           "Inf in one gradient and must be skipped:" % len(next(
               p["per_step"] for p in syncs.values() if "per_step" in p)),
           "", markdown_table(sync_headers, sync_rows, align="lrrr"), ""]
    md += report_footer(NAME, misses, seconds, phases)
    markdown = "\n".join(md)

    payload = {
        **payload_header(ctx, NAME, TITLE, dev, seconds, phases, roof),
        "copy_target_fraction": COPY_TARGET,
        "speed_target": SPEED_TARGET,
        "gpt2_list": {"elements": big_total, "tensors": len(shapes), "reduced": ctx.quick},
        "small_list": {"tensors": N_SMALL, "elements": n_small, "max_size": SMALL_MAX,
                       "seed": SMALL_SEED, "mixed_bf16_elements": n_mixed_bf16},
        "cases": cases_json,
        "drift_check": drift,
        "host_syncs": syncs,
        "targets_missed": misses,
    }
    return results(ctx, NAME, markdown, payload, seconds, misses,
                   lambda: _plot(ctx, row_specs, metrics, roof))


def _fmt_elems(n):
    """124.4M (decimal millions), or the plain count below a million."""
    return "%.1fM" % (n / 1e6) if n >= 1_000_000 else str(n)


def _per_step(values):
    """'1' when every step took the same count, else '1, 1, 2'."""
    return str(values[0]) if len(set(values)) == 1 else ", ".join(str(v) for v in values)


def _plot(ctx, row_specs, metrics, roof):
    """Grouped bars: GB/s of mpext and torch per case, with the rooflines."""
    plt = pyplot()

    import textwrap

    specs = [spec for spec in row_specs if spec[0] != "tiny_fp32"]  # GB/s means nothing there
    labels = [textwrap.fill(spec[1], 24) for spec in specs]
    mp = [metrics[spec[0]]["mpext_gbps"] for spec in specs]
    tt = [metrics[spec[0]]["torch_gbps"] for spec in specs]
    fig, ax = plt.subplots(figsize=(11, 5.5))
    xs = range(len(labels))
    w = 0.38
    ax.bar([x - w / 2 for x in xs], mp, w, label="mpext unscale_")
    ax.bar([x + w / 2 for x in xs], tt, w, label="torch _amp_foreach_non_finite_check_and_unscale_")
    for r, (mv, tv) in enumerate(zip(mp, tt)):
        ax.text(r, max(mv, tv), "%.2fx" % (tv and mv / tv), ha="center", va="bottom", fontsize=8)
    ax.axhline(roof["inplace_gbps"], color="black", linestyle="--", linewidth=1,
               label="in-place roofline %.1f GB/s" % roof["inplace_gbps"])
    ax.axhline(roof["copy_gbps"], color="grey", linestyle=":", linewidth=1,
               label="copy roofline %.1f GB/s" % roof["copy_gbps"])
    ax.axhline(COPY_TARGET * roof["copy_gbps"], color="tab:red", linestyle=":", linewidth=1,
               label="80%% of copy (target, large list) %.1f GB/s"
               % (COPY_TARGET * roof["copy_gbps"]))
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("GB/s (bytes counted / median time)")
    ax.set_ylim(bottom=0)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, ctx.out_dir / (NAME + ".png"), figure_title(ctx, TITLE, isa=True))


def main(argv=None):
    return run_standalone(run, __doc__, None, argv)


if __name__ == "__main__":
    sys.exit(main())
