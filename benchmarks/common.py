"""What the benchmarks share: the method of benchmarks/README.md, written once."""
import argparse
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

import mpext
from mpext import memory
from mpext.memory.meter import peak_bytes as peak_memory_many

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "results"
GB = 1e9
MiB = float(1 << 20)


# ---- options and context

def add_common_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    a = parser.add_argument
    a("--quick", action="store_true", help="reduced sizes and repeats (a noisier smoke run)")
    a("--device", choices=("auto", "cpu", "cuda"), default="auto",
      help="auto: cuda when a GPU is visible and mpext was built with CUDA (default: %(default)s)")
    a("--out", default=str(DEFAULT_OUT), help="directory for the results (default: %(default)s)")
    a("--repeats", type=int, default=None,
      help="timed samples per measurement (default: 11, or 5 with --quick)")
    a("--threads", type=int, default=None,
      help="torch.set_num_threads(N) (default: %(default)s; None: torch's own)")
    a("--no-progress", action="store_true", help="no progress bars")
    a("--no-plots", action="store_true", help="skip the PNG plots")
    return parser


def require_kernel(device: torch.device, op: str) -> None:
    """Raises unless ``torch.ops.mpext.<op>`` has a kernel for ``device`` in this build."""
    if device.type == "cuda" and not torch._C._dispatch_has_kernel_for_dispatch_key(
            "mpext::" + op, "CUDA"):
        raise RuntimeError("mpext.%s has no CUDA kernel in this build; run with --device cpu" % op)


def resolve_device(name: str) -> torch.device:
    """auto: cuda when usable, else cpu; an explicit cuda that cannot run is an error."""
    built, seen = bool(mpext.build_info().get("cuda_built")), torch.cuda.is_available()
    if name == "cuda" and not (built and seen):
        raise SystemExit("--device cuda: " + ("mpext was built without CUDA (see "
                         "mpext.build_info())" if seen else "torch sees no CUDA device"))
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" \
        else torch.device("cuda" if name == "auto" and built and seen else "cpu")


class Context:
    """What one run shares: options, device, output directory, machine info."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.quick = args, bool(args.quick)
        if args.threads:
            torch.set_num_threads(args.threads)
        self.device = resolve_device(args.device)
        self.is_cuda = self.device.type == "cuda"
        self.repeats = args.repeats or (5 if self.quick else 11)
        self.warmup = 1 if self.quick else 2
        self.out_dir = Path(args.out)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.show_progress, self.plots = not args.no_progress, not args.no_plots
        self.machine = machine_info(self.device)
        self.in_suite = False  # set by run_all: sections then omit the shared header
        self.last_roofline = None  # (read, roofline): the last benchmark's closing one

    def progress(self, iterable=None, **kw):
        return progress(iterable, disable=not self.show_progress, **kw)

    def time_fns(self, fns: Dict[str, Callable[[], object]], *, desc: Optional[str] = None
                 ) -> Dict[str, "Timing"]:
        return time_fns(fns, device=self.device, repeats=self.repeats, warmup=self.warmup,
                        desc=desc, show_progress=self.show_progress)

    def roofline(self, read: bool = False) -> dict:
        return measure_roofline(self.device, quick=self.quick, repeats=self.repeats,
                                read=read, show_progress=self.show_progress)


# ---- timing

class Timing:
    """Seconds per call over ``samples`` of ``inner`` calls each; ``cpu_busy``: the cores busy."""

    def __init__(self, samples: Sequence[float], inner: int, cpu_busy=None):
        s = sorted(samples)
        self.q1, _, self.q3 = statistics.quantiles(s, n=4, method="inclusive") \
            if len(s) >= 4 else (s[0], None, s[-1])
        self.median, self.inner, self.samples = statistics.median(s), inner, list(samples)
        self.cpu_busy = statistics.median(cpu_busy) if cpu_busy else None

    def gbps(self, nbytes: float) -> float:
        return nbytes / self.median / GB

    def to_json(self) -> dict:
        return {"median_s": self.median, "q1_s": self.q1, "q3_s": self.q3,
                "iqr_s": self.q3 - self.q1, "min_s": min(self.samples),
                "max_s": max(self.samples), "inner": self.inner, "samples_s": self.samples,
                "cpu_busy": self.cpu_busy}


def _sample(fn: Callable, inner: int, device: torch.device) -> Tuple[float, Optional[float]]:
    """(seconds per call over ``inner`` back-to-back calls, CPU time / wall time or None)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / inner, None
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(inner):
        fn()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall / inner, (cpu / wall if wall > 0 else None)


def time_fns(fns: Dict[str, Callable[[], object]], *, device: torch.device, repeats: int = 15,
             warmup: int = 2, min_sample_s: Optional[float] = None, max_inner: int = 1000,
             desc: Optional[str] = None, show_progress: bool = True) -> Dict[str, Timing]:
    """The callables interleaved round by round (benchmarks/README.md, "Timing")."""
    if min_sample_s is None:
        min_sample_s = 2e-3 if device.type == "cuda" else 5e-3
    labels, inner = list(fns), {}
    for label in labels:
        for _ in range(max(1, warmup) - 1):
            fns[label]()
        t, _ = _sample(fns[label], 1, device)
        inner[label] = int(min(max_inner, max(1, math.ceil(min_sample_s / max(t, 1e-9)))))
    samples, busy = {k: [] for k in labels}, {k: [] for k in labels}
    with progress(total=repeats * len(labels), desc=desc, leave=False,
                  disable=not show_progress) as bar:
        for r in range(repeats):
            k = r % len(labels)
            for label in labels[k:] + labels[:k]:
                t, b = _sample(fns[label], inner[label], device)
                samples[label].append(t)
                if b is not None:
                    busy[label].append(b)
                bar.update(1)
    return {k: Timing(samples[k], inner[k], busy[k]) for k in labels}


def _pair_fns(pairs: Dict[str, Tuple[Callable, Optional[Callable]]]) -> Dict[tuple, Callable]:
    return {(k, side): f for k, fs in pairs.items() for side, f in enumerate(fs) if f is not None}


def time_pairs(ctx: "Context", pairs: Dict[str, Tuple[Callable, Optional[Callable]]],
               desc: str) -> Dict[str, Tuple[Timing, Optional[Timing]]]:
    """``time_fns`` over ``key -> (mpext fn, torch fn or None)``, all interleaved."""
    t = ctx.time_fns(_pair_fns(pairs), desc=desc)
    return {key: (t[key, 0], t.get((key, 1))) for key in pairs}


def pair_metrics(t_mp: Timing, t_torch: Optional[Timing], nbytes: float, roof: dict,
                 torch_bytes: Optional[float] = None, peak=(None, None)) -> dict:
    """One mpext-vs-torch row: timings, GB/s, speed ratio, fractions of every roofline and
    ``peak``, both sides' bytes (``peak_pairs``)."""
    gb = {"mpext": t_mp.gbps(nbytes),
          "torch": t_torch.gbps(torch_bytes or nbytes) if t_torch is not None else None}
    out = {"bytes": nbytes, "torch_bytes": torch_bytes or nbytes, "mpext": t_mp.to_json(),
           "torch": t_torch.to_json() if t_torch is not None else None,
           "mpext_gbps": gb["mpext"], "torch_gbps": gb["torch"],
           "speed_ratio": (t_torch.median / t_mp.median) if t_torch is not None else None,
           "peak_bytes_mpext": peak[0], "peak_bytes_torch": peak[1]}
    for kind in ("inplace", "copy", "read"):
        for side in ("mpext", "torch") if kind + "_gbps" in roof else ():
            out["%s_frac_%s_roofline" % (side, kind)] = \
                gb[side] / roof[kind + "_gbps"] if gb[side] else None
    return out


# ---- rooflines

def last_level_cache_bytes(device: torch.device) -> int:
    """The largest cache (CPU: cpu0's from sysfs; CUDA: the L2); 64 MiB when unknown."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
                   or (64 << 20))
    best = 0
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (idx / "size").read_text().strip().upper()
            best = max(best, int(text.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20,
                                                        "G": 1 << 30}.get(text[-1:], 1))
        except (OSError, ValueError):
            continue
    return best or (64 << 20)


def measure_roofline(device: torch.device, *, quick: bool = False, repeats: int = 15,
                     read: bool = False, show_progress: bool = True) -> dict:
    """Streaming GB/s: copy, in-place and read (benchmarks/README.md, "Roofline")."""
    factor, floor = (4, 32 << 20) if quick else (16, 64 << 20)
    llc = last_level_cache_bytes(device)
    n = max(floor, factor * llc // 4)
    x = torch.zeros(n, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    y.zero_()  # touch every page before timing
    fns = {"copy": lambda: y.copy_(x), "inplace": lambda: x.add_(0.5)}
    if read:
        fns["read"] = lambda: x.sum()
    t = time_fns(fns, device=device, repeats=repeats, warmup=2, min_sample_s=0.0,
                 desc="roofline", show_progress=show_progress)
    del x, y
    gc.collect()
    res = {"numel": n, "buffer_mib": 4.0 * n / MiB, "llc_bytes": llc, "reference": "inplace"}
    for kind, tk in t.items():
        res[kind + "_gbps"] = tk.gbps((4.0 if kind == "read" else 8.0) * n)
        res[kind] = tk.to_json()
    return res


def combine_rooflines(*measurements: dict) -> dict:
    """Per kind the best of several measurements; all of them under ``measurements``."""
    ms = [{k: v for k, v in m.items() if k != "measurements"} for m in measurements]
    res = dict(ms[0], measurements=ms)
    for kind in ("inplace", "copy", "read"):
        if kind + "_gbps" in res:
            best = max(ms, key=lambda m: m[kind + "_gbps"])
            res[kind + "_gbps"], res[kind] = best[kind + "_gbps"], best[kind]
    return res


def roofline_line(roof: dict) -> str:
    line = ("roofline (%s fp32 elements, %.0f MiB per buffer): in-place x.add_(0.5) %.1f GB/s "
            "(reference), copy y.copy_(x) %.1f GB/s (ratio %.2f)"
            % (fmt_count(roof["numel"]), roof["buffer_mib"], roof["inplace_gbps"],
               roof["copy_gbps"], roof["inplace_gbps"] / roof["copy_gbps"]))
    if "read_gbps" in roof:
        line += ", read x.sum() %.1f GB/s" % roof["read_gbps"]
    ms = roof.get("measurements") or []
    if len(ms) > 1:
        line += "; best of %d measurements in this run (in-place %s, copy %s GB/s)" % (
            len(ms), " / ".join("%.1f" % m["inplace_gbps"] for m in ms),
            " / ".join("%.1f" % m["copy_gbps"] for m in ms))
    return line


# ---- peak memory (the meter is mpext.memory.meter.peak_bytes: tests use it too)

def peak_pairs(pairs: Dict[str, Tuple[Callable, Optional[Callable]]],
               device: torch.device) -> Dict[str, List[Optional[float]]]:
    """``peak_memory_many`` over ``time_pairs``' input: ``key -> [mpext, torch bytes]``."""
    peaks = peak_memory_many(_pair_fns(pairs), device)
    return {k: [peaks.get((k, 0)), peaks.get((k, 1))] for k in pairs}


# ---- machine description

def load_average() -> Optional[List[float]]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def machine_info(device: torch.device) -> dict:
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f
                        if ln.startswith("model name")), None)
    except OSError:
        cpu = None
    info = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(), "platform": platform.platform(),
        "cpu_model": cpu or platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "load_average": load_average(), "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda, "mpext_build_info": mpext.build_info(),
        "device": str(device), "gpu_name": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu_name=props.name, gpu_memory_gib=props.total_memory / (1 << 30),
                    gpu_capability="%d.%d" % (props.major, props.minor))
    elif torch.cuda.is_available():
        info["gpu_name"] = torch.cuda.get_device_name(0) + " (not used)"
    return info


def busy_cores(info: dict) -> int:
    return info.get("cpu_affinity") or info.get("cpu_count") or 1


def machine_header(info: dict) -> List[str]:
    """Markdown lines: the machine, and a warning when it was busy at start."""
    b, la = info["mpext_build_info"], info.get("load_average")
    line = ("CPU %s (%s cores, torch threads %s); torch %s; mpext %s, CPU ISA %s, CUDA built: %s; "
            "device %s%s" % (info["cpu_model"], info["cpu_count"], info["torch_threads"],
                             info["torch_version"], b.get("mpext_version"),
                             b.get("cpu_isa_active"), b.get("cuda_built"), info["device"],
                             " (%s)" % info["gpu_name"] if info.get("gpu_name") else ""))
    if la is not None:
        line += "; load average at start " + "/".join("%.2f" % v for v in la)
    out = [line, ""]
    if la and la[0] > 0.5 * busy_cores(info):
        out += ["WARNING: 1-minute load average %.2f on %d cores at start: other processes share "
                "the CPU, timings are noisy and understate bandwidth." % (la[0], busy_cores(info)),
                ""]
    return out


# ---- inputs

def gpt2_shapes(reduced: bool = False) -> List[Tuple[str, tuple]]:
    """GPT-2 small's (name, shape)s; ``reduced``: 4 layers, 8K vocabulary."""
    spec = memory.MODELS["gpt2"]
    layers, vocab = (4, 8192) if reduced else (spec.layers, spec.vocab)
    return memory.gpt_shapes(layers, spec.hidden, vocab, spec.seq)


class Alternate:
    """``a``, ``b``, ``a``, ... as 0-dim tensors (benchmarks/README.md, "Repeated in-place")."""

    def __init__(self, a: float, b: float, device: torch.device):
        self.vals = [torch.full((), v, dtype=torch.float32, device=device) for v in (a, b)]
        self.calls = 0

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        return self.vals[(self.calls - 1) % 2]

    def factor(self) -> float:
        return float(self.vals[0]) if self.calls % 2 else 1.0


def mlp(sizes: Sequence[int], act=torch.nn.GELU, last_act: bool = False) -> torch.nn.Sequential:
    """Linear layers ``sizes[i] -> sizes[i + 1]``, ``act()`` between (and last: ``last_act``)."""
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if last_act or i < len(sizes) - 2:
            layers.append(act())
    return torch.nn.Sequential(*layers)


def count_subnormals(tensors: Sequence[torch.Tensor]) -> int:
    """Elements below the smallest normal fp32 (bf16's range too) that are not zero."""
    tiny = torch.finfo(torch.float32).tiny
    return sum(int(((t.float().abs() < tiny) & (t != 0)).sum()) for t in tensors)


# ---- the sanity guard: correctness is tests/' job; a benchmark checks once, before timing,
# that what it times computes what its reference computes.

class CorrectnessError(AssertionError):
    """What a benchmark timed is wrong: run_all reports it and exits non-zero."""


def check(ok: bool, message: str) -> None:
    if not ok:
        raise CorrectnessError(message)


def expect_same(name: str, got, want, rtol: float = 0.0, atol: float = 0.0) -> None:
    """``got`` equals ``want`` (tensors or lists): exactly by default, NaN equal to NaN."""
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as exc:
        raise CorrectnessError("%s: %s" % (name, exc)) from None


# ---- output

def fmt_count(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return "%d%s" % (n // div, unit)
    return "%.1fM" % (n / (1 << 20)) if n >= 1 << 20 else str(n)


def fmt_ms(t) -> str:
    """'12.34 ±0.56': median ms ± half the IQR of a ``Timing`` or its JSON form."""
    d = t.to_json() if isinstance(t, Timing) else t
    return "%.3g ±%.2g" % (d["median_s"] * 1e3, d["iqr_s"] * 1e3 / 2)


def pct(x: Optional[float]) -> str:
    """A fraction as a whole percentage, rounded down (so 79.8% never shows as a met 80%)."""
    return "" if x is None else "%d%%" % math.floor(100.0 * x + 1e-9)


def ratio(x: Optional[float]) -> str:
    return "—" if x is None else "%.2fx" % x


def yes_no(ok: Optional[bool]) -> str:
    return "—" if ok is None else ("yes" if ok else "**no**")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub Markdown table, the first column aligned left, the others right."""
    cells = [[str(c) for c in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(r, widths))) + " |"

    sep = "|" + "|".join((":" + "-" * (w + 1)) if i == 0 else ("-" * (w + 1) + ":")
                         for i, w in enumerate(widths)) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


PAIR_HEADERS = ["mpext ms", "torch ms", "mpext GB/s", "torch GB/s", "speed mpext/torch",
                "mpext % in-place roof", "mpext % copy roof", "cores busy mpext/torch",
                "peak MiB mpext/torch"]


def pair_cells(m: dict) -> List[str]:
    """The ``PAIR_HEADERS`` cells of a ``pair_metrics`` row."""
    t, peak = m["torch"], (m["peak_bytes_mpext"], m["peak_bytes_torch"])
    b_mp, b_t = m["mpext"].get("cpu_busy"), (t or {}).get("cpu_busy")

    def pair(a, b, scale=1.0):
        return "%.1f / %s" % (a / scale, "—" if b is None else "%.1f" % (b / scale))

    return [fmt_ms(m["mpext"]), fmt_ms(t) if t else "—",
            "%.1f" % m["mpext_gbps"], "—" if t is None else "%.1f" % m["torch_gbps"],
            "—" if t is None else "%.2f" % m["speed_ratio"],
            pct(m["mpext_frac_inplace_roofline"]), pct(m["mpext_frac_copy_roofline"]),
            "" if b_mp is None else pair(b_mp, b_t),
            "" if peak[0] is None else pair(peak[0], peak[1], MiB)]


def _json_default(o):
    """Timings as their JSON, tensors' scalars as numbers, devices, dtypes and paths as text."""
    return o.to_json() if hasattr(o, "to_json") else o.item() if hasattr(o, "item") else str(o)


def write_json(path: Path, payload: dict) -> Path:
    return write_text(path, json.dumps(payload, indent=1, default=_json_default))


def write_text(path: Path, text: str) -> Path:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text if text.endswith("\n") else text + "\n")
    return Path(path)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path, title: str = "", fontsize: int = 9) -> Path:
    """Titles, lays out, writes and closes a figure."""
    if title:
        fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return Path(path)


def plot_lines(path: Path, panels: Sequence[dict], *, title: str = "") -> Path:
    """One PNG of panels {title, xlabel, ylabel, logx, series: {label: (xs, ys)}, hlines}."""
    ncols = min(2, len(panels))
    nrows = (len(panels) + ncols - 1) // ncols
    fig, axes = pyplot().subplots(nrows, ncols, figsize=(6.2 * ncols, 4.2 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for i, (label, (xs, ys)) in enumerate(panel.get("series", {}).items()):
            ax.plot(xs, ys, marker="o", linestyle=["-", "--", "-.", ":"][i % 4], label=label)
        for i, (label, y) in enumerate(panel.get("hlines", {}).items()):
            ax.axhline(y, color=["black", "grey", "tab:red", "tab:purple"][i % 4],
                       linestyle=":" if i else "--", linewidth=1, label=label)
        if panel.get("logx"):
            ax.set_xscale("log", base=2)
        ax.set(title=panel.get("title", ""), xlabel=panel.get("xlabel", ""),
               ylabel=panel.get("ylabel", ""))
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    return save_figure(fig, path, title, fontsize=10)


def figure_title(ctx, title: str) -> str:
    """A figure's title with the machine its figures come from."""
    m = ctx.machine
    return "%s on %s, %s threads, torch %s%s" % (
        title, m["gpu_name"] if ctx.is_cuda else m["cpu_model"], torch.get_num_threads(),
        m["torch_version"], " (quick)" if ctx.quick else "")


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def progress(iterable=None, *, disable: bool = False, **kw):
    """A tqdm bar on stderr (stdout is the Markdown summary's)."""
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=disable, file=sys.stderr, dynamic_ncols=True, **kw)


class Bench:
    """One benchmark's run: phase clock, rooflines, missed targets, report and files."""

    def __init__(self, ctx: Context, name: str, title: str):
        self.ctx, self.name, self.title = ctx, name, title
        self._t0 = self._start = time.perf_counter()
        self.phases: Dict[str, float] = {}
        self.misses: List[str] = []
        self.roof: Optional[dict] = None
        self._roofs: List[dict] = []

    def phase(self, name: str) -> None:
        """Adds the seconds since the last phase to ``name``'s."""
        now = time.perf_counter()
        self.phases[name], self._start = self.phases.get(name, 0.0) + now - self._start, now

    def start_roofline(self, read: bool = False) -> dict:
        self._read = read
        last = self.ctx.last_roofline
        if self.ctx.in_suite and last is not None and last[0] == read:
            # in a suite the previous benchmark's closing roofline was measured just before
            # this one starts: the same bracket, one measurement fewer (~2 s each, quick)
            self._roofs.append(last[1])
        else:
            self._roofs.append(self.ctx.roofline(read))
        self.phase("roofline")
        return self._roofs[0]

    def end_roofline(self) -> dict:
        end = self.ctx.roofline(self._read)
        self.ctx.last_roofline = (self._read, end)
        self.roof = combine_rooflines(*self._roofs, end)
        self.phase("roofline_end")
        return self.roof

    def target(self, ok: bool, miss: str) -> bool:
        if not ok:
            self.misses.append(miss)
        return ok

    def finish(self, lines: Sequence[str], payload: dict, plot: Optional[Callable] = None,
               device=None) -> dict:
        """Writes ``<name>.json``, ``<name>.md`` and ``plot()``'s PNGs; returns ``run``'s dict."""
        ctx, seconds, phases = self.ctx, time.perf_counter() - self._t0, self.phases
        md = ["## %s" % self.title, ""] + ([] if ctx.in_suite else machine_header(ctx.machine))
        if self.roof:
            md += [roofline_line(self.roof), ""]
        md += list(lines) + [""]
        if self.misses:
            md += ["Targets missed: " + "; ".join(self.misses) + ".", ""]
        md.append("(%s: %.0f s: %s)" % (self.name, seconds, ", ".join(
            "%s %.0f s" % kv for kv in phases.items())))
        markdown = "\n".join(md)
        payload = {"name": self.name, "title": self.title, "quick": ctx.quick,
                   "device": str(device or ctx.device), "repeats": ctx.repeats,
                   "warmup": ctx.warmup, "seconds": seconds, "phase_seconds": phases,
                   "machine": ctx.machine, "roofline": self.roof, **payload,
                   "targets_missed": self.misses}
        files = [write_json(ctx.out_dir / (self.name + ".json"), payload),
                 write_text(ctx.out_dir / (self.name + ".md"), markdown)]
        if plot is not None and ctx.plots:
            out = plot()
            files += out if isinstance(out, list) else [out]
        return {"name": self.name, "markdown": markdown, "json": payload,
                "files": [str(f) for f in files], "seconds": seconds,
                "targets_missed": list(self.misses)}


def run_standalone(run: Callable, doc: str, add_args: Optional[Callable] = None) -> None:
    """A module run on its own: the common options and ``add_args``'s, ``run``, its Markdown."""
    parser = add_common_args(argparse.ArgumentParser(description=doc.splitlines()[0]))
    if add_args is not None:
        parser = add_args(parser)
    print(run(Context(parser.parse_args()))["markdown"])
