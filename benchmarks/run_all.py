"""Runs the mpext benchmark suite, what `make bench` calls (benchmarks/README.md)."""
import argparse
import importlib
import sys
import time
import traceback

from .common import (Context, add_common_args, load_average, machine_header, write_json,
                     write_text)

# Each exposes NAME and run(ctx) -> common.Bench.finish's dict (README, "Adding a benchmark").
BENCHMARKS = ["bench_cast", "bench_scaler", "bench_adam", "bench_distributed", "bench_train",
              "bench_grad_norm", "bench_convergence"]


def main() -> int:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--only", nargs="+", metavar="NAME", choices=BENCHMARKS,
                        help="run only these benchmarks")
    args = parser.parse_args()
    t0 = time.perf_counter()
    ctx = Context(args)
    ctx.in_suite = True
    sections, results, errors = [], {}, {}
    for name in args.only or BENCHMARKS:
        print("[run_all] %s ..." % name, file=sys.stderr, flush=True)
        t_start = time.perf_counter()
        try:
            res = importlib.import_module("." + name, __package__).run(ctx)
        except Exception as exc:  # report, keep going, fail at the end
            tb = traceback.format_exc()
            print(tb, file=sys.stderr, flush=True)
            errors[name] = "%s: %s" % (type(exc).__name__, exc)
            results[name] = {"error": errors[name], "traceback": tb,
                             "seconds": time.perf_counter() - t_start}
            sections.append("## %s\n\n**FAILED**: %s\n" % (name, errors[name]))
            continue
        dt = time.perf_counter() - t_start
        print("[run_all] %s done in %.1f s" % (name, dt), file=sys.stderr, flush=True)
        results[name] = {"seconds": dt, "files": res["files"],
                         "targets_missed": res["targets_missed"], "result": res["json"]}
        sections.append(res["markdown"])
    total, la_end = time.perf_counter() - t0, load_average()
    head = ["# mpext benchmarks%s" % (" (quick)" if ctx.quick else ""), ""] + \
        machine_header(ctx.machine)
    tail = "Total %.0f s; load average at end %s. %s" % (
        total, "/".join("%.2f" % v for v in la_end) if la_end else "n/a",
        "%d benchmark(s) FAILED: %s" % (len(errors), ", ".join(sorted(errors))) if errors
        else "All benchmarks ran.")
    summary = "\n".join(head) + "\n" + "\n\n".join(sections) + "\n\n" + tail + "\n"
    print(summary)
    files = [write_text(ctx.out_dir / "summary.md", summary), write_json(
        ctx.out_dir / "summary.json", {
            "quick": ctx.quick, "device": str(ctx.device), "seconds": total,
            "machine": ctx.machine, "load_average_end": la_end, "benchmarks": results,
            "errors": errors})]
    print("[run_all] wrote %s and %s (%.0f s)" % (*files, total), file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
