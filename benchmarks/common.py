"""What the mpext benchmarks share (the method: benchmarks/README.md).

Every ``bench_*.py`` module here exposes ``NAME`` and ``run(ctx) -> dict``, and runs on its own
(``python -m benchmarks.bench_x [--quick] [--device auto|cpu|cuda]``) or through ``run_all.py``.
This module holds the options and ``Context``, the timing (``time_fns``, ``time_pairs``), the
rooflines, peak memory, the machine description, the shared inputs (``gpt2_shapes``,
``Alternate``), the one sanity guard (``check``, ``expect_same``) and the output (tables, JSON,
plots, ``results``). Targets are reported, never enforced.
"""
import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from mpext import memory

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "results"

GB = 1e9
MiB = float(1 << 20)

# ---------------------------------------------------------------------------------------------
# Options and context


def add_common_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--quick", action="store_true",
                        help="reduced sizes and repeats (a smoke run, figures are noisier)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda when a GPU is visible and mpext was built with CUDA")
    parser.add_argument("--out", default=str(DEFAULT_OUT),
                        help="directory for JSON, Markdown and PNG results (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed samples per measurement (default: 11, or 5 with --quick)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads(N) (default: torch's default, all cores)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    return parser


def resolve_device(name: str) -> torch.device:
    """auto -> cuda when a GPU is visible and mpext was built with CUDA, else cpu. An explicit
    'cuda' that cannot run is an error, not a silent fallback."""
    import mpext

    cuda_built = bool(mpext.build_info().get("cuda_built"))
    if name == "auto":
        return torch.device("cuda" if (cuda_built and torch.cuda.is_available()) else "cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device")
        if not cuda_built:
            raise SystemExit("--device cuda: mpext was built without CUDA (see mpext.build_info())")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def require_kernel(device: torch.device, op: str) -> None:
    """Raises unless ``torch.ops.mpext.<op>`` has a kernel for ``device`` in this build."""
    if device.type == "cuda" and not torch._C._dispatch_has_kernel_for_dispatch_key(
            "mpext::" + op, "CUDA"):
        raise RuntimeError("mpext.%s has no CUDA kernel in this build; run with --device cpu"
                           % op)


class Context:
    """What one benchmark run shares: options, device, output directory, machine info."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.quick = bool(args.quick)
        if args.threads:
            torch.set_num_threads(args.threads)
        self.device = resolve_device(args.device)
        self.is_cuda = self.device.type == "cuda"
        self.repeats = args.repeats or (5 if self.quick else 11)
        self.warmup = 1 if self.quick else 2
        self.out_dir = Path(args.out)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.show_progress = not args.no_progress
        self.plots = not args.no_plots
        self.machine = machine_info(self.device)
        self.in_suite = False  # set by run_all: sections then omit the shared header

    def progress(self, iterable=None, **kw):
        return progress(iterable, disable=not self.show_progress, **kw)

    def time_fns(self, fns: Dict[str, Callable[[], object]], *, repeats: Optional[int] = None,
                 warmup: Optional[int] = None, desc: Optional[str] = None) -> Dict[str, "Timing"]:
        return time_fns(fns, device=self.device, repeats=repeats or self.repeats,
                        warmup=self.warmup if warmup is None else warmup,
                        desc=desc, show_progress=self.show_progress)

    def roofline(self) -> dict:
        """Measures the roofline now (each benchmark measures its own, next to its timings)."""
        return measure_roofline(self.device, quick=self.quick, repeats=self.repeats,
                                show_progress=self.show_progress)


# ---------------------------------------------------------------------------------------------
# Timing


@dataclasses.dataclass
class Timing:
    """Seconds per call. ``inner`` calls were timed together in each of the ``len(samples)``
    samples (so that short calls are not dominated by timer resolution). ``cpu_busy`` (CPU
    device only): median over samples of process CPU time / wall time, i.e. how many cores were
    busy on average; about 1.0 for a single-threaded kernel, about the thread count for a
    well-parallelized one (waiting threads that spin count too)."""

    median: float
    q1: float
    q3: float
    min: float
    max: float
    inner: int
    samples: List[float]
    cpu_busy: Optional[float] = None

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    @classmethod
    def from_samples(cls, samples: Sequence[float], inner: int,
                     cpu_busy: Optional[Sequence[float]] = None) -> "Timing":
        s = sorted(samples)
        if len(s) >= 4:
            q1, _, q3 = statistics.quantiles(s, n=4, method="inclusive")
        else:
            q1, q3 = s[0], s[-1]
        return cls(median=statistics.median(s), q1=q1, q3=q3, min=s[0], max=s[-1], inner=inner,
                   samples=list(samples),
                   cpu_busy=statistics.median(cpu_busy) if cpu_busy else None)

    @classmethod
    def from_json(cls, d: dict) -> "Timing":
        """The inverse of ``to_json``."""
        return cls(median=d["median_s"], q1=d["q1_s"], q3=d["q3_s"], min=d["min_s"],
                   max=d["max_s"], inner=d["inner"], samples=d["samples_s"],
                   cpu_busy=d.get("cpu_busy"))

    def gbps(self, nbytes: float) -> float:
        return nbytes / self.median / GB

    def to_json(self) -> dict:
        return {"median_s": self.median, "q1_s": self.q1, "q3_s": self.q3, "iqr_s": self.iqr,
                "min_s": self.min, "max_s": self.max, "inner": self.inner,
                "samples_s": self.samples, "cpu_busy": self.cpu_busy}


def _sample(fn: Callable, inner: int, device: torch.device) -> Tuple[float, Optional[float]]:
    """(seconds per call over ``inner`` back-to-back calls, CPU time / wall time or None)."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / inner, None
    c0 = time.process_time()
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    return wall / inner, (cpu / wall if wall > 0 else None)


def time_fns(fns: Dict[str, Callable[[], object]], *, device: torch.device, repeats: int = 15,
             warmup: int = 2, min_sample_s: Optional[float] = None, max_inner: int = 1000,
             desc: Optional[str] = None, show_progress: bool = True) -> Dict[str, Timing]:
    """Times each callable: ``warmup`` untimed calls, then ``repeats`` samples, the callables
    interleaved round by round (rotating the order each round) so that drifting background load
    affects them alike. A sample runs a callable ``inner`` times back to back, ``inner`` chosen
    so that one sample lasts about ``min_sample_s``. Returns median/IQR seconds per call."""
    if min_sample_s is None:
        min_sample_s = 2e-3 if device.type == "cuda" else 5e-3
    labels = list(fns)
    inner = {}
    for label in labels:
        fn = fns[label]
        for _ in range(max(1, warmup) - 1):
            fn()
        t, _ = _sample(fn, 1, device)  # the last warm-up call also sizes the samples
        inner[label] = int(min(max_inner, max(1, math.ceil(min_sample_s / max(t, 1e-9)))))
    samples: Dict[str, List[float]] = {label: [] for label in labels}
    busy: Dict[str, List[float]] = {label: [] for label in labels}
    bar = progress(total=repeats * len(labels), desc=desc, leave=False,
                   disable=not show_progress)
    with bar:
        for r in range(repeats):
            k = r % len(labels)
            for label in labels[k:] + labels[:k]:
                t, b = _sample(fns[label], inner[label], device)
                samples[label].append(t)
                if b is not None:
                    busy[label].append(b)
                bar.update(1)
    return {label: Timing.from_samples(samples[label], inner[label], busy[label])
            for label in labels}


def time_pairs(ctx: "Context", pairs: Dict[str, Tuple[Callable, Optional[Callable]]],
               desc: str) -> Dict[str, Tuple[Timing, Optional[Timing]]]:
    """``time_fns`` for ``key -> (mpext fn, torch fn or None)``, every callable interleaved;
    returns ``key -> (mpext timing, torch timing or None)``."""
    fns = {}
    for key, (f_mp, f_t) in pairs.items():
        fns[key + "/mpext"] = f_mp
        if f_t is not None:
            fns[key + "/torch"] = f_t
    t = ctx.time_fns(fns, desc=desc)
    return {key: (t[key + "/mpext"], t.get(key + "/torch")) for key in pairs}


def pair_metrics(t_mp: Timing, t_torch: Optional[Timing], nbytes: float, roof: dict) -> dict:
    """One mpext-vs-torch row: both timings, GB/s, the speed ratio (> 1: mpext faster) and the
    fractions of both rooflines (torch's None where it has no contender)."""
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


def busy(m: dict) -> str:
    """'1.0 / 1.9': the cores busy (CPU time / wall time) of a ``pair_metrics`` row's mpext and
    torch calls; empty off the CPU."""
    b_mp = m["mpext"].get("cpu_busy")
    if b_mp is None:
        return ""
    b_t = (m["torch"] or {}).get("cpu_busy")
    return "%.1f / %s" % (b_mp, "—" if b_t is None else "%.1f" % b_t)


# ---------------------------------------------------------------------------------------------
# Roofline


def last_level_cache_bytes(device: torch.device) -> int:
    """Size of the largest cache in front of memory (CPU: the biggest cache level of cpu0 from
    sysfs; CUDA: the L2). Falls back to 64 MiB."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(getattr(props, "L2_cache_size", 0) or (64 << 20))
    best = 0
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for idx in sorted(base.glob("index*")) if base.exists() else []:
        try:
            text = (idx / "size").read_text().strip().upper()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            size = int(text.rstrip("KMG")) * mult
        except ValueError:
            continue
        best = max(best, size)
    return best or (64 << 20)


def roofline_numel(device: torch.device, quick: bool) -> int:
    """fp32 elements per roofline buffer: at least 16x (quick: 4x) the last-level cache, and at
    least 64M (quick: 32M) elements."""
    llc = last_level_cache_bytes(device)
    factor, floor = (4, 32 << 20) if quick else (16, 64 << 20)
    return max(floor, factor * llc // 4)


def measure_roofline(device: torch.device, *, quick: bool = False, repeats: int = 15,
                     numel: Optional[int] = None, show_progress: bool = True) -> dict:
    """Streaming bandwidth on ``device``, measured now:

    - ``copy``: ``y.copy_(x)`` on fp32 buffers, counted as 4 bytes read + 4 written per element.
      Understates what memory delivers (on CPU writing a fresh destination line also reads it).
    - ``inplace``: ``x.add_(0.5)`` on one fp32 buffer, 8 bytes per element: the reference
      bandwidth ("the roofline").

    Buffers are far larger than the last-level cache (see ``roofline_numel``)."""
    n = numel or roofline_numel(device, quick)
    x = torch.zeros(n, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    y.zero_()  # touch every page before timing
    t = time_fns({"copy": lambda: y.copy_(x), "inplace": lambda: x.add_(0.5)}, device=device,
                 repeats=repeats, warmup=2, min_sample_s=0.0, desc="roofline",
                 show_progress=show_progress)
    del x, y
    gc.collect()
    nbytes = 8.0 * n
    res = {
        "numel": n,
        "buffer_mib": 4.0 * n / MiB,
        "llc_bytes": last_level_cache_bytes(device),
        "copy_gbps": t["copy"].gbps(nbytes),
        "inplace_gbps": t["inplace"].gbps(nbytes),
        "copy": t["copy"].to_json(),
        "inplace": t["inplace"].to_json(),
        "reference": "inplace",
    }
    return res


def combine_rooflines(*measurements: dict) -> dict:
    """One roofline from several measurements in the run (e.g. before and after a benchmark):
    per kind, the measurement with the highest median bandwidth (background load only ever
    lowers it). All measurements are kept under ``measurements``."""
    best_copy = max(measurements, key=lambda r: r["copy_gbps"])
    best_inplace = max(measurements, key=lambda r: r["inplace_gbps"])
    res = dict(best_inplace)
    res.pop("measurements", None)
    res["copy_gbps"] = best_copy["copy_gbps"]
    res["copy"] = best_copy["copy"]
    res["measurements"] = [{k: v for k, v in m.items() if k != "measurements"}
                           for m in measurements]
    return res


def roofline_hlines(roof: dict, target: float) -> Dict[str, float]:
    """The horizontal lines of a GB/s plot: both rooflines and ``target`` x the copy one."""
    return {"in-place roofline %.1f GB/s" % roof["inplace_gbps"]: roof["inplace_gbps"],
            "copy roofline %.1f GB/s" % roof["copy_gbps"]: roof["copy_gbps"],
            "%d%% of copy (target) %.1f GB/s" % (round(100 * target), target * roof["copy_gbps"]):
                target * roof["copy_gbps"]}


def roofline_line(roof: dict) -> str:
    line = ("roofline (%s fp32 elements, %.0f MiB per buffer): in-place x.add_(0.5) %.1f GB/s "
            "(reference), copy y.copy_(x) %.1f GB/s (ratio %.2f)"
            % (fmt_count(roof["numel"]), roof["buffer_mib"], roof["inplace_gbps"],
               roof["copy_gbps"], roof["inplace_gbps"] / roof["copy_gbps"]))
    ms = roof.get("measurements")
    if ms and len(ms) > 1:
        line += "; best of %d measurements in this run (in-place %s, copy %s GB/s)" % (
            len(ms), " / ".join("%.1f" % m["inplace_gbps"] for m in ms),
            " / ".join("%.1f" % m["copy_gbps"] for m in ms))
    return line


# ---------------------------------------------------------------------------------------------
# Peak memory


def _cpu_peaks_profiler(fns: Dict[str, Callable[[], object]]) -> Dict[str, Optional[float]]:
    """Peak bytes held through torch's CPU allocator while each callable runs (its result
    included), from the profiler's allocation records (running ``total_allocated``), all in one
    profiler session (starting one costs seconds). None where this torch's profiler does not
    expose the records."""
    none = {k: None for k in fns}
    try:
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile, record_function
    except ImportError:
        return none
    tags = {"mpext_bench_peak_%d" % i: k for i, k in enumerate(fns)}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for tag, k in tags.items():
            with record_function(tag):
                out = fns[k]()
                del out
    try:
        res = dict(none)
        for root in _walk(prof.profiler.kineto_results.experimental_event_tree()):
            if root.name not in tags:
                continue
            allocs = sorted((n.start_time_ns, int(n.extra_fields.alloc_size),
                             int(n.extra_fields.total_allocated))
                            for n in _walk(root.children) if n.tag == _EventType.Allocation)
            if not allocs:
                res[tags[root.name]] = 0.0
                continue
            base = allocs[0][2] - allocs[0][1]
            res[tags[root.name]] = float(max(0, max(a[2] for a in allocs) - base))
        return res
    except (AttributeError, RuntimeError):
        return none


def _walk(nodes):
    stack = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children)


def peak_memory_many(fns: Dict[str, Callable[[], object]],
                     device: torch.device) -> Dict[str, Optional[float]]:
    """Bytes each callable needs at its peak above what was allocated before it ran (a result
    it returns counts; it is dropped afterwards), as seen by torch's allocator: on CUDA the
    caching allocator's peak statistics, on CPU the profiler's allocation records (None where
    unavailable). mpext allocates through torch, so both sides are measured alike."""
    gc.collect()
    if device.type != "cuda":
        return _cpu_peaks_profiler(fns)
    res = {}
    for k, fn in fns.items():
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        res[k] = float(torch.cuda.max_memory_allocated(device) - before)
        del out
    return res


# ---------------------------------------------------------------------------------------------
# Machine description


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total_gib() -> Optional[float]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return None


def load_average() -> Optional[List[float]]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def machine_info(device: torch.device) -> dict:
    import mpext

    info = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "llc_bytes_cpu": last_level_cache_bytes(torch.device("cpu")),
        "mem_total_gib": _mem_total_gib(),
        "load_average": load_average(),
        "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "mpext_build_info": mpext.build_info(),
        "device": str(device),
        "gpu_name": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu_name"] = props.name
        info["gpu_memory_gib"] = props.total_memory / (1 << 30)
        info["gpu_capability"] = "%d.%d" % (props.major, props.minor)
    elif torch.cuda.is_available():
        info["gpu_name"] = torch.cuda.get_device_name(0) + " (not used)"
    return info


def machine_line(info: dict) -> str:
    b = info["mpext_build_info"]
    parts = [
        "CPU %s (%s cores, torch threads %s)" % (info["cpu_model"], info["cpu_count"],
                                                info["torch_threads"]),
        "torch %s" % info["torch_version"],
        "mpext %s, CPU ISA %s, CUDA built: %s" % (b.get("mpext_version"), b.get("cpu_isa_active"),
                                                  b.get("cuda_built")),
        "device %s%s" % (info["device"],
                         (" (%s)" % info["gpu_name"]) if info.get("gpu_name") else ""),
    ]
    if info.get("load_average") is not None:
        parts.append("load average at start %s" % "/".join("%.2f" % v
                                                           for v in info["load_average"]))
    return "; ".join(parts)


def load_warning(info: dict) -> Optional[str]:
    """A warning when the machine was busy at start (other processes share the cores, so timings
    mostly measure contention)."""
    la = info.get("load_average")
    cores = info.get("cpu_affinity") or info.get("cpu_count") or 1
    if la and la[0] > 0.5 * cores:
        return ("WARNING: 1-minute load average %.2f on %d cores at start: other processes share "
                "the CPU, timings are noisy and understate bandwidth." % (la[0], cores))
    return None


# ---------------------------------------------------------------------------------------------
# Inputs


def gpt2_shapes(reduced: bool = False) -> List[Tuple[str, tuple]]:
    """(name, shape) of GPT-2 small's parameters, the calculator's ``gpt2`` (124M parameters in
    148 tensors; HF naming, Conv1D weights are (in, out)); ``reduced``: 4 layers on an 8K
    vocabulary (35M parameters, 52 tensors), the --quick list."""
    spec = memory.MODELS["gpt2"]
    layers, vocab = (4, 8192) if reduced else (spec.layers, spec.vocab)
    return memory.gpt_shapes(layers, spec.hidden, vocab, spec.seq)


class Alternate:
    """``a``, ``b``, ``a``, ``b``, ... as 0-dim float32 tensors: the inverse scales of repeated
    timed calls, so that with ``a * b == 1`` the tensors they scale stay where they started
    (times 1 or ``a``: ``factor()``) whatever the number of calls."""

    def __init__(self, a: float, b: float, device: torch.device):
        self.vals = [torch.full((), a, dtype=torch.float32, device=device),
                     torch.full((), b, dtype=torch.float32, device=device)]
        self.calls = 0

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        return self.vals[(self.calls - 1) % 2]

    def factor(self) -> float:
        """What the values handed out so far multiply to."""
        return float(self.vals[0]) if self.calls % 2 else 1.0


def count_subnormals(tensors: Sequence[torch.Tensor]) -> int:
    """Elements below the smallest normal fp32 (bf16's range too) that are not zero."""
    tiny = torch.finfo(torch.float32).tiny
    return sum(int(((t.float().abs() < tiny) & (t != 0)).sum()) for t in tensors)


# ---------------------------------------------------------------------------------------------
# The sanity guard: the full correctness suites are tests/; a benchmark checks only that what it
# times computes what the reference computes, once, before timing.


class CorrectnessError(AssertionError):
    """What a benchmark timed is wrong: run_all reports it and exits non-zero."""


def check(ok: bool, message: str) -> None:
    if not ok:
        raise CorrectnessError(message)


def expect_same(name: str, got, want, rtol: float = 0.0, atol: float = 0.0) -> None:
    """``got`` equals ``want`` (tensors or lists of them, same dtypes): exactly by default (NaN
    equal to NaN), else within ``rtol``/``atol`` (``torch.testing.assert_close``)."""
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as exc:
        raise CorrectnessError("%s: %s" % (name, exc)) from None


# ---------------------------------------------------------------------------------------------
# Output


def fmt_count(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return "%d%s" % (n // div, unit)
    if n >= 1 << 20:
        return "%.1fM" % (n / (1 << 20))
    return str(n)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]],
                   align: Optional[str] = None) -> str:
    """A GitHub Markdown table; ``align`` is one char per column ('l' or 'r', default: first
    column left, others right)."""
    if align is None:
        align = "l" + "r" * (len(headers) - 1)
    cells = [[str(c) for c in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "| " + " | ".join(c.ljust(w) if a == "l" else c.rjust(w)
                                 for c, w, a in zip(r, widths, align)) + " |"

    sep = "|" + "|".join((":" + "-" * (w + 1)) if a == "l" else ("-" * (w + 1) + ":")
                         for w, a in zip(widths, align)) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def section_head(ctx, title: str) -> List[str]:
    """The opening lines of a benchmark's Markdown section: its title and, when it runs on its
    own (run_all prints them once for the whole suite), the machine line and any load warning."""
    md = ["## %s" % title, ""]
    if not ctx.in_suite:
        md += [machine_line(ctx.machine), ""]
        warn = load_warning(ctx.machine)
        if warn:
            md += [warn, ""]
    return md


def report_footer(name: str, misses: Sequence[str], seconds: float,
                  phases: Dict[str, float]) -> List[str]:
    """The closing lines every benchmark section ends with: the targets it missed, then where
    its time went."""
    lines = ["Targets missed: " + "; ".join(misses) + ".", ""] if misses else []
    lines.append("(%s: %.0f s: %s)" % (name, seconds, ", ".join("%s %.0f s" % kv
                                                            for kv in phases.items())))
    return lines


def payload_header(ctx, name: str, title: str, device, seconds: float,
                   phases: Dict[str, float], roof: dict) -> dict:
    """The fields every benchmark's JSON starts with (the run's settings, machine, roofline)."""
    return {"name": name, "title": title, "quick": ctx.quick, "device": str(device),
            "repeats": ctx.repeats, "warmup": ctx.warmup, "seconds": seconds,
            "phase_seconds": phases, "machine": ctx.machine, "roofline": roof}


def _json_default(o):
    if isinstance(o, (torch.device, torch.dtype, Path)):
        return str(o)
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError("not JSON serializable: %r" % (o,))


def write_json(path: Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=_json_default, allow_nan=True)
        f.write("\n")
    os.replace(tmp, path)
    return path


def write_text(path: Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text.endswith("\n") else text + "\n")
    return path


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (benchmarks never open a window)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_lines(path: Path, panels: Sequence[dict], *, title: str = "", ncols: int = 2) -> Path:
    """One PNG with one or more panels. Each panel: ``{"title", "xlabel", "ylabel", "logx",
    "series": {label: (xs, ys)}, "hlines": {label: y}}``."""
    plt = pyplot()

    n = len(panels)
    ncols = min(ncols, n)
    nrows = (n + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.2 * ncols, 4.2 * nrows), squeeze=False)
    styles = ["-", "--", "-.", ":"]
    for ax, panel in zip(axes.flat, panels):
        for i, (label, (xs, ys)) in enumerate(panel.get("series", {}).items()):
            ax.plot(xs, ys, marker="o", linestyle=styles[i % len(styles)], label=label)
        colors = ["black", "grey", "tab:red"]
        for i, (label, y) in enumerate(panel.get("hlines", {}).items()):
            ax.axhline(y, color=colors[i % len(colors)], linestyle=":" if i else "--",
                       linewidth=1, label=label)
        if panel.get("logx"):
            ax.set_xscale("log", base=2)
        ax.set_title(panel.get("title", ""))
        ax.set_xlabel(panel.get("xlabel", ""))
        ax.set_ylabel(panel.get("ylabel", ""))
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    return save_figure(fig, path, title, fontsize=10)


def results(ctx, name: str, markdown: str, payload: dict, seconds: float,
            misses: Sequence[str] = (), plot: Optional[Callable[[], object]] = None) -> dict:
    """Writes a benchmark's ``<name>.json`` and ``<name>.md`` and, unless --no-plots, the PNG
    file(s) ``plot()`` returns; returns what ``run(ctx)`` returns."""
    files = [write_json(ctx.out_dir / (name + ".json"), payload),
             write_text(ctx.out_dir / (name + ".md"), markdown)]
    if plot is not None and ctx.plots:
        out = plot()
        files += out if isinstance(out, list) else [out]
    return {"name": name, "markdown": markdown, "json": payload, "files": [str(f) for f in files],
            "seconds": seconds, "targets_missed": list(misses)}


def figure_title(ctx, title: str, isa: bool = False) -> str:
    """A figure's title with the machine its figures come from (device, threads, torch, with
    ``isa`` mpext's CPU instruction set, and a note when the run was --quick)."""
    m = ctx.machine
    return "%s on %s, %s threads, torch %s%s%s" % (
        title, m["gpu_name"] if ctx.is_cuda else m["cpu_model"], m["torch_threads"],
        m["torch_version"],
        ", mpext ISA %s" % m["mpext_build_info"].get("cpu_isa_active") if isa else "",
        " (quick)" if ctx.quick else "")


def save_figure(fig, path, title: str = "", fontsize: int = 9) -> Path:
    """Titles, lays out and writes a matplotlib figure as a PNG (creating its directory), then
    closes it; returns the path."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# Progress


class _NullBar:
    def __init__(self, iterable=None):
        self._it = iterable

    def __iter__(self):
        return iter(self._it if self._it is not None else ())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1):
        pass

    def set_postfix_str(self, s=""):
        pass


def progress(iterable=None, *, disable: bool = False, **kw):
    """A tqdm progress bar on stderr (stdout stays clean for the Markdown summary); a no-op
    when disabled or when tqdm is missing."""
    if disable:
        return _NullBar(iterable)
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NullBar(iterable)
    kw.setdefault("file", sys.stderr)
    kw.setdefault("dynamic_ncols", True)
    return tqdm(iterable, **kw)


class PhaseClock:
    """Where a benchmark's time goes: ``clock(name)`` records the seconds since the previous call
    (or since the clock was made) under ``name`` in ``times``; ``elapsed()`` is the total."""

    def __init__(self) -> None:
        self._t0 = self._start = time.perf_counter()
        self.times: Dict[str, float] = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.times[name] = now - self._start
        self._start = now


def run_standalone(run: Callable, doc: str, add_args: Optional[Callable] = None,
                   argv=None) -> int:
    """``main()`` of a benchmark module run on its own: the common options (plus the module's
    own, from ``add_args(parser)``), ``run(ctx)``, its Markdown on stdout."""
    parser = add_common_args(argparse.ArgumentParser(description=doc.splitlines()[0]))
    if add_args is not None:
        parser = add_args(parser)
    print(run(Context(parser.parse_args(argv)))["markdown"])
    return 0


def fmt_ms(t: Timing) -> str:
    """'12.34 ±0.56' (median ms, ± half the IQR)."""
    return "%.3g ±%.2g" % (t.median * 1e3, t.iqr * 1e3 / 2)


def pct(x: Optional[float]) -> str:
    """A fraction as a whole percentage, rounded down (so 79.8% never shows as a met 80%)."""
    return "" if x is None else "%d%%" % math.floor(100.0 * x + 1e-9)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
