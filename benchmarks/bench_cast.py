"""Cast benchmark: mpext casts vs native PyTorch, in the same run on the same device.

- single tensor, out of place: ``mpext.ops.to_bf16(x)`` vs ``x.to(torch.bfloat16)``, ``to_fp16`` vs
  ``x.to(torch.float16)``, ``to_fp32`` (from bf16 and from fp16) vs ``.float()``, and stochastic
  ``to_bf16(x, stochastic=True)`` (no torch equivalent: GB/s only), over a size sweep;
- single tensor into a preallocated destination at the main size: ``cast_([dst], [x])`` vs
  ``dst.copy_(x)`` (the same kernels without the cost of a fresh output allocation);
- list form on a GPT-2-small-shaped parameter list (124M parameters, 148 tensors): FP32 masters
  -> BF16 / FP16 params, ``mpext.ops.cast_(dst, src)`` vs ``torch._foreach_copy_(dst, src)``.

Bytes counted: bytes read + bytes written (6 per element for every cast here). Correctness is
checked once before timing: RNE casts must equal torch's bit for bit (NaN: stays NaN).

    python benchmarks/bench_cast.py [--quick] [--device auto|cpu|cuda]
"""
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

import mpext
from common import (Context, MiB, Timing, PhaseClock, combine_rooflines, fmt_count, fmt_ms,
                    free_memory, markdown_table, payload_header, pct, peak_memory_many, plot_lines,
                    report_footer, roofline_line, run_standalone, section_head, stopwatch,
                    write_json, write_text)

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


# ---------------------------------------------------------------------------------------------
# GPT-2 small


def gpt2_small_shapes(n_layer=12, d=768, vocab=50257, ctx=1024):
    """(name, shape) of GPT-2 small's parameters (HF naming, Conv1D weights are (in, out))."""
    shapes = [("wte.weight", (vocab, d)), ("wpe.weight", (ctx, d))]
    for i in range(n_layer):
        p = "h.%d." % i
        shapes += [
            (p + "ln_1.weight", (d,)), (p + "ln_1.bias", (d,)),
            (p + "attn.c_attn.weight", (d, 3 * d)), (p + "attn.c_attn.bias", (3 * d,)),
            (p + "attn.c_proj.weight", (d, d)), (p + "attn.c_proj.bias", (d,)),
            (p + "ln_2.weight", (d,)), (p + "ln_2.bias", (d,)),
            (p + "mlp.c_fc.weight", (d, 4 * d)), (p + "mlp.c_fc.bias", (4 * d,)),
            (p + "mlp.c_proj.weight", (4 * d, d)), (p + "mlp.c_proj.bias", (d,)),
        ]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return shapes


GPT2_SMALL_PARAMS = 124_439_808


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


# ---------------------------------------------------------------------------------------------
# Correctness (fail loudly)


class CorrectnessError(AssertionError):
    pass


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _check_same(name, got, want):
    """Bitwise equality; NaN positions must be NaN on both sides (payloads may differ)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        raise CorrectnessError("%s: got %s %s, expected %s %s"
                               % (name, got.dtype, tuple(got.shape), want.dtype, tuple(want.shape)))
    if torch.equal(_bits(got), _bits(want)):  # fast path: identical bits
        return
    gnan, wnan = torch.isnan(got), torch.isnan(want)
    bad = (gnan != wnan) | (~wnan & (_bits(got) != _bits(want)))
    nbad = int(bad.sum())
    if nbad:
        i = int(bad.flatten().nonzero()[0])
        mask = (1 << (8 * got.element_size())) - 1
        raise CorrectnessError(
            "%s: %d of %d elements differ from PyTorch; first at flat index %d: mpext %r (0x%x) "
            "vs torch %r (0x%x)" % (name, nbad, got.numel(), i, got.flatten()[i].item(),
                                    _bits(got).flatten()[i].item() & mask,
                                    want.flatten()[i].item(),
                                    _bits(want).flatten()[i].item() & mask))


def _special_fp32(device):
    """Edge values plus 1M random fp32 bit patterns (every class: NaN payloads, Inf,
    subnormals, huge, tiny)."""
    vals = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 1e-45, -1e-45,
            1e-40, -1e-40, 1.1754942e-38, 1.17549435e-38, 3.4028235e38, -3.4028235e38,
            3.3961776e38, 65504.0, 65519.996, 65520.0, -65520.0, 1e5, 6.1035156e-05,
            6.0975552e-05, 5.9604645e-08, 2.9802322e-08, 2.9802326e-08, 1.0 + 2 ** -8,
            1.0 + 2 ** -8 + 2 ** -20, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11]
    g = torch.Generator().manual_seed(1234)
    rnd = torch.randint(-(2 ** 31), 2 ** 31, (1 << 20,), dtype=torch.int64, generator=g)
    rnd = rnd.to(torch.int32).view(FP32)
    return torch.cat([torch.tensor(vals, dtype=FP32), rnd]).to(device)


def _random_16bit(dtype, device):
    g = torch.Generator().manual_seed(4321)
    r = torch.randint(-(2 ** 15), 2 ** 15, (1 << 20,), dtype=torch.int32, generator=g)
    return r.to(torch.int16).view(dtype).to(device)


SR_CHECK_SAMPLE = 4 << 20


def _check_stochastic(name, x, sr):
    """Stochastic bf16 must be x truncated to bf16 or one bf16 step further from zero (exact
    when the discarded bits are zero), and round up about as often as the discarded fractions
    say (unbiased). Large tensors are checked on their first and last 2M elements."""
    x, sr = x.flatten(), sr.flatten()
    if x.numel() > SR_CHECK_SAMPLE:
        h = SR_CHECK_SAMPLE // 2
        x, sr = torch.cat([x[:h], x[-h:]]), torch.cat([sr[:h], sr[-h:]])
    xi = x.view(torch.int32)
    hi = (xi >> 16) & 0xFFFF
    lo = xi & 0xFFFF
    d = (sr.view(torch.int16).to(torch.int32) & 0xFFFF) - hi
    fin = torch.isfinite(x)
    inexact = fin & (lo != 0)
    ok = (d == 0) | (inexact & (d == 1)) | ~fin
    if not bool(ok.all()):
        i = int((~ok).nonzero()[0])
        raise CorrectnessError("%s: %d elements are neither the truncation nor the next bf16 "
                               "away from zero; first at %d: x=%r (0x%08x) -> 0x%04x"
                               % (name, int((~ok).sum()), i, x[i].item(),
                                  xi[i].item() & 0xFFFFFFFF, int(hi[i] + d[i])))
    # an element rounds up with probability lo / 2**16 (the discarded fraction of a step):
    # compare the share of round-ups with the mean discarded fraction in four bins of that
    # fraction (catches a biased rounding and plain round-to-nearest alike)
    band = lo >> 14
    for b in range(4):
        m = inexact & (band == b)
        cnt = int(m.sum())
        if cnt < 25000:
            continue
        up = int(((d == 1) & m).sum()) / cnt
        want = float(torch.where(m, lo, 0).sum(dtype=torch.int64)) / 65536.0 / cnt
        if abs(up - want) > 0.02:
            raise CorrectnessError("%s: with discarded fraction in [%.2f, %.2f) it rounded up "
                                   "%.4f of elements, expected %.4f" %
                                   (name, b / 4, (b + 1) / 4, up, want))


def check_correctness(x, masters, dev):
    """Runs every benchmarked mpext call once and compares it with PyTorch (bit for bit for
    the round-to-nearest-even casts; NaN stays NaN). Stochastic rounding: valid outcomes,
    unbiased, deterministic, and the documented stream positions (element k of a list uses
    offset + k, so splitting a tensor or a list changes no bit). Raises CorrectnessError."""
    special = _special_fp32(dev)
    for inp, tag in ((special, "edge values + random bit patterns"), (x, "benchmark input")):
        _check_same("to_bf16 (%s)" % tag, mpext.ops.to_bf16(inp), inp.to(BF16))
        _check_same("to_fp16 (%s)" % tag, mpext.ops.to_fp16(inp), inp.to(FP16))
    for dtype in (BF16, FP16):
        r16 = _random_16bit(dtype, dev)
        _check_same("to_fp32 from %s (random bit patterns)" % dtype, mpext.ops.to_fp32(r16),
                    r16.float())
        xl = x.to(dtype)
        _check_same("to_fp32 from %s (benchmark input)" % dtype, mpext.ops.to_fp32(xl),
                    xl.float())
        d = torch.empty_like(x, dtype=dtype)
        mpext.ops.cast_([d], [x])
        _check_same("cast_ fp32->%s single (benchmark input)" % dtype, d, x.to(dtype))
        del xl, d
    # stochastic rounding
    sr = mpext.ops.to_bf16(x, stochastic=True, seed=7, offset=0)
    _check_stochastic("to_bf16 stochastic (benchmark input)", x, sr)
    _check_same("to_bf16 stochastic: same seed, same bits",
                mpext.ops.to_bf16(x, stochastic=True, seed=7, offset=0), sr)
    k = x.numel() // 3 + 1
    _check_same("to_bf16 stochastic: offset continues the stream",
                mpext.ops.to_bf16(x[k:], stochastic=True, seed=7, offset=k), sr[k:])
    _check_stochastic("to_bf16 stochastic (edge values + random bit patterns)", special,
                      mpext.ops.to_bf16(special, stochastic=True, seed=7))
    del sr
    # list form
    for dtype in (BF16, FP16):
        got = [torch.empty_like(m, dtype=dtype) for m in masters]
        want = [torch.empty_like(m, dtype=dtype) for m in masters]
        mpext.ops.cast_(got, masters)
        torch._foreach_copy_(want, masters)
        for i, (g_, w_) in enumerate(zip(got, want)):
            _check_same("cast_ list fp32->%s, tensor %d" % (dtype, i), g_, w_)
        del got, want
    got = [torch.empty_like(m, dtype=BF16) for m in masters]
    mpext.ops.cast_(got, masters, stochastic=True, seed=3, offset=5)
    pos = 5
    for i, (g_, m) in enumerate(zip(got, masters)):
        _check_same("cast_ list stochastic, tensor %d vs to_bf16 at offset %d" % (i, pos), g_,
                    mpext.ops.to_bf16(m, stochastic=True, seed=3, offset=pos))
        pos += m.numel()
    _check_stochastic("cast_ list stochastic (first tensor)", masters[0], got[0])
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ---------------------------------------------------------------------------------------------
# Benchmark


def _row_metrics(t_mp, t_torch, nbytes, roof):
    gb_mp = t_mp.gbps(nbytes)
    gb_t = t_torch.gbps(nbytes) if t_torch is not None else None
    return {
        "bytes": nbytes,
        "mpext": t_mp.to_json(),
        "torch": t_torch.to_json() if t_torch is not None else None,
        "mpext_gbps": gb_mp,
        "torch_gbps": gb_t,
        "speed_ratio": (t_torch.median / t_mp.median) if t_torch is not None else None,
        "mpext_frac_inplace_roofline": gb_mp / roof["inplace_gbps"],
        "mpext_frac_copy_roofline": gb_mp / roof["copy_gbps"],
        "torch_frac_inplace_roofline": (gb_t / roof["inplace_gbps"]) if gb_t else None,
        "torch_frac_copy_roofline": (gb_t / roof["copy_gbps"]) if gb_t else None,
    }


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


def _time_pairs(ctx, pairs, desc):
    """pairs: key -> (mpext fn, torch fn or None). Times everything interleaved."""
    fns = {}
    for key, (f_mp, f_t) in pairs.items():
        fns[key + "/mpext"] = f_mp
        if f_t is not None:
            fns[key + "/torch"] = f_t
    t = ctx.time_fns(fns, desc=desc)
    return {key: (t[key + "/mpext"], t.get(key + "/torch")) for key in pairs}


def run(ctx: Context) -> dict:
    dev = ctx.device
    sizes = SIZES_QUICK if ctx.quick else SIZES_FULL
    main_n = sizes[-1]
    with stopwatch() as elapsed:
        phase = PhaseClock(elapsed)
        phases = phase.times

        roof_start = ctx.roofline()
        phase("roofline")

        g = torch.Generator().manual_seed(0)
        x_main = torch.randn(main_n, generator=g, dtype=FP32).to(dev)
        shapes = gpt2_small_shapes()
        total = sum(_numel(s) for _, s in shapes)
        assert total == GPT2_SMALL_PARAMS, total
        masters = [(torch.randn(s, generator=g) * 0.02).to(dev) for _, s in shapes]
        phase("inputs")

        # correctness before any timing
        check_correctness(x_main, masters, dev)
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
                res = _time_pairs(ctx, pairs, desc="%s elements" % fmt_count(n))
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
        lst = _time_pairs(ctx, {
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
        sweep = {n: {k: _row_metrics(*v, roof) for k, v in d.items()} for n, d in sweep.items()}
        lst = {k: _row_metrics(*v, roof) for k, v in lst.items()}
        seconds = elapsed()

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
            fmt_ms(_t(m["mpext"])), fmt_ms(_t(m["torch"])) if m["torch"] else "—",
            "%.1f" % m["mpext_gbps"], "%.1f" % m["torch_gbps"] if m["torch_gbps"] else "—",
            "%.2f" % ratio if ratio is not None else "—",
            pct(m["mpext_frac_inplace_roofline"]), pct(frac_copy), peak_s,
            _busy(m),
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
           "Median ms ± half the IQR over %d samples after warm-up (mpext and torch interleaved). "
           "GB/s = (bytes read + written) / median time (6 bytes per element). Speed ratio > 1: "
           "mpext faster. Targets (reported, not asserted): at least as fast as torch, and "
           "≥ 80%% of the copy (memcpy) roofline; ≈: within 5%% of torch (noise level). "
           "Out-of-place rows include allocating the "
           "result%s; the preallocated rows time the same conversion into an existing tensor. "
           "Peak MiB: extra memory at the call's peak%s.%s"
           % (ctx.repeats,
              " (on CPU a fresh, page-faulted buffer every call for large sizes)"
              if not ctx.is_cuda else "",
              " (torch's CPU allocator, from the profiler's allocation records)"
              if not ctx.is_cuda else " (CUDA caching allocator statistics)",
              "" if ctx.is_cuda else
              (" Cores busy: process CPU time / wall time (%d torch threads; about 1.0 means "
               "the call ran on one core)." % ctx.machine["torch_threads"])),
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
    files = [write_json(ctx.out_dir / (NAME + ".json"), payload),
             write_text(ctx.out_dir / (NAME + ".md"), markdown)]
    if ctx.plots:
        files.append(_plot(ctx, sizes, sweep, roof))
    return {"name": NAME, "markdown": markdown, "json": payload, "files": [str(f) for f in files],
            "seconds": seconds, "targets_missed": misses}


def _t(d):
    return Timing(median=d["median_s"], q1=d["q1_s"], q3=d["q3_s"], min=d["min_s"],
                  max=d["max_s"], inner=d["inner"], samples=d["samples_s"],
                  cpu_busy=d.get("cpu_busy"))


def _busy(m):
    """'1.0 / 1.9': median CPU time / wall time of the mpext and torch calls (CPU only)."""
    b_mp = m["mpext"].get("cpu_busy")
    if b_mp is None:
        return ""
    b_t = (m["torch"] or {}).get("cpu_busy")
    return "%.1f / %s" % (b_mp, "—" if b_t is None else "%.1f" % b_t)


def _plot(ctx, sizes, sweep, roof):
    hl = {"in-place roofline %.1f GB/s" % roof["inplace_gbps"]: roof["inplace_gbps"],
          "copy roofline %.1f GB/s" % roof["copy_gbps"]: roof["copy_gbps"],
          "80%% of copy (target) %.1f GB/s" % (COPY_TARGET * roof["copy_gbps"]):
              COPY_TARGET * roof["copy_gbps"]}
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
    m = ctx.machine
    title = "%s on %s, %s threads, torch %s, mpext ISA %s%s" % (
        TITLE, m["gpu_name"] if ctx.is_cuda else m["cpu_model"], m["torch_threads"],
        m["torch_version"], m["mpext_build_info"].get("cpu_isa_active"),
        " (quick)" if ctx.quick else "")
    return plot_lines(ctx.out_dir / (NAME + ".png"), panels, title=title)


def main(argv=None):
    return run_standalone(run, __doc__, None, argv)


if __name__ == "__main__":
    sys.exit(main())
