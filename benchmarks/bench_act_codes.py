"""The int8 block code of saved activations: native ops vs the torch-op code they replaced
(benchmarks/README.md).

--codes (default): int8_block_quantize and int8_block_dequantize on a tensor far larger than
the caches, bf16 and fp32, against the same-run streaming roofline (copy and in-place), and the
torch-op code eagerly (the speed ratio). Bytes counted: quantize reads x and writes the codes
and scales; dequantize reads those and writes the restored tensor; the round trip is both.
Target: the round trip at >= 70% of the copy roofline.

Every op writes a freshly allocated output, and an output of 32 MiB or more is a fresh mmap
whose pages the kernel zeroes on first touch (a full write pass before the op's own; measured:
a 32 MiB bf16 dequantize 19 ms fresh, 5.8 ms into a warm buffer, one thread). The copy into a
buffer of its own does not pay that, so an allocating copy (``x.clone()``, fresh pages as the
ops get) is timed in the same rounds too: the reference an op that allocates can reach.

--compiled: the training step of zoo models (benchmarks/bench_activations.py) under
torch.compile, compressed with the native ops (opaque to inductor: no fusion with the ops that
make or read a saved tensor) and with the torch-op code (traced, fused by inductor), each as a
ratio to the compiled BF16 step measured interleaved with it, and the two compressed steps
against each other.
"""
import contextlib
import functools
import statistics

import torch

from mpext import activations as act
from mpext import activations_codes as codes
from mpext import ops

from .common import (Bench, check, fmt_ms, free_memory, markdown_table, pair_metrics, pct,
                     require_kernel, run_standalone, time_fns, time_pairs)

NAME = "bench_act_codes"
TITLE = "Int8 block code of saved activations: native ops vs the torch-op code"
BLOCK = 128
QMAX, MIN_SCALE = 127, 2.0 ** -126


# ---- the torch-op code the native ops replaced (what inductor fuses when traced)

def torch_quantize(x, block, pow2=False):
    cols = codes.block_cols(x.numel(), x.shape[-1], block)
    rows = x.reshape(-1, cols)
    nb = -(-cols // block)
    pad = nb * block - cols
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    y = rows.reshape(-1, nb, block).to(torch.float32, copy=True)
    scales = y.abs().amax(-1, keepdim=True).div_(QMAX).clamp_min_(MIN_SCALE)
    if pow2:
        bits = scales.view(torch.int32)
        scales = torch.where(torch.isfinite(scales),
                             ((bits + 0x7FFFFF) & 0x7F800000).view(torch.float32), scales)
    sign = y.sign()
    q = y.div_(scales).round_().clamp_(-QMAX, QMAX)
    q = torch.where(q == 0, sign, q).to(torch.int8).view(-1, nb * block)
    if pad:
        q = q[:, :cols].contiguous()
    return q, scales.view(-1, nb)


def torch_dequantize(q, scales, block, dtype, shape):
    cols, nb = q.shape[-1], scales.shape[-1]
    pad = nb * block - cols
    if pad:
        q = torch.nn.functional.pad(q, (0, pad))
    q3, s = q.view(-1, nb, block), scales.view(-1, nb, 1)
    if dtype == torch.float16:
        out = (q3.float() * s).to(dtype)
    else:
        out = q3.to(dtype) * s.to(dtype)
    out = out.view(-1, nb * block)
    if pad:
        out = out[:, :cols].contiguous()
    return out.view(shape)


@contextlib.contextmanager
def torch_code():
    """activations_codes' functions swapped for the torch-op code while the block runs (eager
    and traced callers look them up on the module at call time)."""
    saved = codes.quantize, codes.dequantize
    codes.quantize, codes.dequantize = torch_quantize, torch_dequantize
    try:
        yield
    finally:
        codes.quantize, codes.dequantize = saved


# ---- --codes: the kernels against the roofline

def run_codes(ctx, b):
    dev = ctx.device
    # at least 7 interleaved rounds: on a shared 2-core machine one round can lose half its time
    ctx.repeats = max(ctx.repeats, 7)
    # 2^26 elements: 128 MiB of bf16, 256 MiB of fp32, the torch-op code peaking near 1.5 GiB
    n = (16 << 20) if ctx.quick else (64 << 20)
    gen = torch.Generator().manual_seed(0)
    rows, table = [], []
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(n // 1024, 1024, generator=gen)).to(dtype).to(dev)
        q, s = ops.int8_block_quantize(x, block_size=BLOCK)
        tq, ts = torch_quantize(x, BLOCK)
        check(torch.equal(q, tq) and torch.equal(s, ts), "%s: the op's codes are not the "
              "torch-op code's" % dtype)
        es, nb = x.element_size(), s.numel()
        qbytes = float(n * es + n + 4 * nb)
        dbytes = float(n + 4 * nb + n * es)
        pairs = {
            "quantize": (lambda: ops.int8_block_quantize(x, block_size=BLOCK),
                         lambda: torch_quantize(x, BLOCK)),
            "dequantize": (lambda: ops.int8_block_dequantize(q, s, block_size=BLOCK, dtype=dtype),
                           lambda: torch_dequantize(q, s, BLOCK, dtype, x.shape)),
            "round trip": (lambda: ops.int8_block_dequantize(
                *ops.int8_block_quantize(x, block_size=BLOCK), block_size=BLOCK, dtype=dtype),
                lambda: torch_dequantize(*torch_quantize(x, BLOCK), BLOCK, dtype, x.shape)),
        }
        # a copy of x into a buffer of its own, timed in the same rounds as the kernels: the
        # roofline of this tensor, at this moment (the start/end rooflines bracket the run)
        y = torch.empty_like(x)
        pairs["copy"] = (lambda: y.copy_(x), None)
        pairs["clone"] = (lambda: x.clone(), None)  # allocating: fresh pages, as every op's
        t = time_pairs(ctx, pairs, str(dtype))
        rows.append({"dtype": str(dtype), "numel": n, "times": t, "copy_bytes": 2.0 * n * es,
                     "bytes": {"quantize": qbytes, "dequantize": dbytes,
                               "round trip": qbytes + dbytes}})
        del x, q, s, tq, ts, y
        free_memory(dev)
        b.phase(str(dtype))
    roof = b.end_roofline()
    for r in rows:
        t = r.pop("times")
        copy = t.pop("copy")[0]
        clone = t.pop("clone")[0]
        r["copy"] = copy.to_json()
        r["copy_gbps"] = copy.gbps(r["copy_bytes"])
        r["clone"] = clone.to_json()
        r["clone_gbps"] = clone.gbps(r["copy_bytes"])
        r["metrics"] = {}
        for kind in ("quantize", "dequantize", "round trip"):
            m = r["metrics"][kind] = pair_metrics(*t[kind], r["bytes"][kind], roof)
            m["mpext_frac_interleaved_copy"] = m["mpext_gbps"] / r["copy_gbps"]
            m["mpext_frac_interleaved_clone"] = m["mpext_gbps"] / r["clone_gbps"]
            table.append(["%s %s" % (r["dtype"].replace("torch.", ""), kind), fmt_ms(m["mpext"]),
                          fmt_ms(m["torch"]), "%.2fx" % m["speed_ratio"],
                          "%.1f" % m["mpext_gbps"], pct(m["mpext_frac_interleaved_copy"]),
                          pct(m["mpext_frac_interleaved_clone"]),
                          pct(m["mpext_frac_copy_roofline"]),
                          pct(m["mpext_frac_inplace_roofline"]),
                          pct(m["torch_frac_copy_roofline"])])
        rt = r["metrics"]["round trip"]["mpext_frac_copy_roofline"]
        b.target(rt >= 0.7, "%s round trip at %.0f%% of the copy roofline (target 70%%)"
                 % (r["dtype"], 100 * rt))
    return [markdown_table(["case", "native ms", "torch ops ms", "speed ratio", "native GB/s",
                            "native / interleaved copy", "native / interleaved clone",
                            "native / copy roofline",
                            "native / in-place roofline", "torch ops / copy roofline"], table),
            "",
            "%d elements (blocks of %d along rows of 1024), %d samples per row, interleaved "
            "(ms: median ± half the interquartile range). Bytes: x read + codes and scales "
            "written (quantize), the reverse (dequantize). Interleaved copy: x copied into a "
            "buffer of its own in the same rounds (read + write: %s); interleaved clone: x.clone(), "
            "an allocating copy, whose output's fresh pages are zeroed on first touch as the "
            "ops' are (%s)." % (
                rows[0]["numel"], BLOCK, ctx.repeats, ", ".join(
                    "%s %.1f GB/s" % (r["dtype"].replace("torch.", ""), r["copy_gbps"])
                    for r in rows), ", ".join(
                    "%s %.1f GB/s" % (r["dtype"].replace("torch.", ""), r["clone_gbps"])
                    for r in rows))], rows


# ---- --compiled: native ops vs inductor-fused torch ops inside a compiled step

def run_compiled(ctx, b, names):
    from . import bench_activations as ba
    dev, out, table = ctx.device, [], []
    models = ba.zoo_models(small=ctx.quick)
    for name in names:
        build, batch, loss_fn = models[name]
        res = {}
        for variant in ("native", "torch ops"):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = build().to(dev, torch.bfloat16).train()
            xb = tuple(t.to(dev) for t in batch(torch.bfloat16))
            fwd = torch.compile(model)
            comp = act.fp8_saved_tensors(params=model, warn_unmatched=False)

            def step(c, fwd=fwd, model=model, xb=xb, loss_fn=loss_fn):
                with c or contextlib.nullcontext():
                    loss = loss_fn(fwd, xb)
                loss.float().backward()
                model.zero_grad(set_to_none=True)
            with torch_code() if variant == "torch ops" else contextlib.nullcontext():
                for _ in range(2):  # compiles both graphs, warms up
                    step(None)
                    step(comp)
                t = time_fns({"bf16": functools.partial(step, None),
                              "compressed": functools.partial(step, comp)},
                             device=dev, repeats=ctx.repeats, warmup=1, max_inner=1,
                             show_progress=False)
            ratios = sorted(c / a for a, c in zip(t["bf16"].samples, t["compressed"].samples))
            q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
            res[variant] = {"bf16": t["bf16"].to_json(), "compressed": t["compressed"].to_json(),
                            "ratio": statistics.median(ratios), "ratio_q1": q1, "ratio_q3": q3}
            b.phase("%s %s" % (name, variant))
        out.append({"model": name, **res})
        table.append([name] + ["%.1f / %.1f" % (1e3 * res[v]["bf16"]["median_s"],
                                                1e3 * res[v]["compressed"]["median_s"])
                               for v in res] +
                     ["%.3f (%.3f-%.3f)" % (res[v]["ratio"], res[v]["ratio_q1"],
                                            res[v]["ratio_q3"]) for v in res])
    return [markdown_table(["model", "native: BF16 / compressed ms",
                            "torch ops: BF16 / compressed ms", "native: step ratio (IQR)",
                            "torch ops: step ratio (IQR)"], table), "",
            "Compiled (inductor), one training step per sample, %d samples; each ratio is the "
            "compressed step over the compiled BF16 step timed interleaved with it (median and "
            "quartiles of the paired rounds)." % ctx.repeats], out


def run(ctx) -> dict:
    require_kernel(ctx.device, "int8_block_quantize")
    b = Bench(ctx, NAME, TITLE)
    args = ctx.args
    lines, payload = [], {}
    if getattr(args, "codes", False) or not getattr(args, "compiled", False):
        b.start_roofline()
        md, payload["codes"] = run_codes(ctx, b)
        lines += ["### Kernels against the streaming roofline", ""] + md + [""]
    if getattr(args, "compiled", False):
        md, payload["compiled"] = run_compiled(ctx, b, args.models.split(","))
        lines += ["### Inside a compiled training step", ""] + md
    return b.finish(lines, payload)


def add_args(parser):
    a = parser.add_argument
    a("--codes", action="store_true", help="the kernels against the roofline (the default)")
    a("--compiled", action="store_true", help="native ops vs fused torch ops, compiled steps")
    a("--models", default="vit,gpt", help="--compiled: zoo models (comma list)")
    return parser


if __name__ == "__main__":
    run_standalone(run, __doc__, add_args)
