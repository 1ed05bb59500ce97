"""Where the eager step-time overhead of mpext.activations goes, per zoo model: the step (CPU
time, one thread, interleaved rounds) with no hooks, identity hooks, the recipe recorder alone,
the default with recompute=False, the default without the chain tables (a recipe of one
16-bit tensor rerun op by op instead of gathered from the table of its 2^16 values), and the
default, with the minor page faults and system time per step (medians: fresh pages first
touched by the ops' outputs show there); then one step of the default with the hooks' parts
timed (CPU time, inclusive of the other parts a part runs, but a part running inside itself
counted once: a recomputation reading another recomputed tensor; % of the BF16 step).

    PYTHONPATH=. python -m benchmarks.bench_activations_split [models] [rounds]

``--tables`` instead: the backward's recomputing alone (``Recomputed._raw``, CPU time per step)
without and with the chain tables, paired round by round, beside the BF16 step (a part's time
is steadier than a step ratio on a shared machine).

    PYTHONPATH=. python -m benchmarks.bench_activations_split --tables [models] [rounds]
"""
import collections
import contextlib
import functools
import os
import resource
import statistics
import sys
import time

import torch

from mpext import activations as A
from mpext import activations_recompute as rc

from .bench_activations import zoo_models

PARTS = [(A.fp8_saved_tensors, "_pack", "pack (all of it)"),
         (A._Packed, "__init__", "pack: the 8-bit code"),
         (rc.Bits, "make", "pack: masks as bits"),
         (A.fp8_saved_tensors, "_recomputed", "pack: resolving a recipe"),
         (A, "_recipe", "recorder: making a recipe"),
         (A._Recorder, "__torch_function__", "recorder (with the ops it runs)"),
         (rc.Recomputed, "_raw", "unpack: recomputing"),
         (rc, "_from_table", "unpack: recomputing, chain tables"),
         (A._Packed, "_raw", "unpack: decoding 8 bits"),
         (rc.Bits, "_raw", "unpack: bits")]


def _timed(spent, calls):
    depth = collections.Counter()  # a part's calls running now: only the outermost is timed
    for obj, name, label in PARTS:
        f = getattr(obj, name)

        @functools.wraps(f)
        def g(*a, _f=f, _label=label, **k):
            # a recomputation reading another recomputed tensor (the CNN's residual input,
            # GPT-2's dropout outputs) runs inside it: counted once, not twice
            depth[_label] += 1
            t0 = time.process_time()
            try:
                return _f(*a, **k)
            finally:
                depth[_label] -= 1
                if not depth[_label]:
                    spent[_label] += time.process_time() - t0
                calls[_label] += 1
        setattr(obj, name, g)


def _zoo(names):
    """(name, the model in BF16 train mode, its batch, its loss) of each zoo model named (all
    when ``names`` is empty), each built after seeding 0."""
    for name, (build, batch, loss_fn) in zoo_models(False).items():
        if names and name not in names:
            continue
        torch.manual_seed(0)
        yield name, build().to("cpu", torch.bfloat16).train(), tuple(batch(torch.bfloat16)), loss_fn


def main(names=None, rounds=5):
    torch.set_num_threads(1)
    print("load average %.1f %.1f %.1f" % os.getloadavg(), flush=True)
    spent, calls = collections.Counter(), collections.Counter()
    timing = [False]
    gather_cost = rc._GATHER_COST
    for name, model, xb, loss_fn in _zoo(names):
        ctxs = {
            "bf16": contextlib.nullcontext,
            "identity hooks": lambda: torch.autograd.graph.saved_tensors_hooks(
                lambda t: t, lambda t: t),
            "recorder only": lambda: A._Recorder(A._State()),
            "recompute=False": (lambda c=A.fp8_saved_tensors(
                params=model, warn_unmatched=False, recompute=False): c),
            "no chain tables": (lambda c=A.fp8_saved_tensors(params=model,
                                                              warn_unmatched=False): c),
            "default": (lambda c=A.fp8_saved_tensors(params=model, warn_unmatched=False): c)}

        def step(k):
            # the tables' cost threshold: never reached, every chain reruns its ops
            rc._GATHER_COST = float("inf") if k == "no chain tables" else gather_cost
            with ctxs[k]():
                loss = loss_fn(model, xb)
            loss.float().backward()
            model.zero_grad(set_to_none=True)
        for k in ctxs:
            step(k)
        ts = {k: [] for k in ctxs}
        faults = {k: [] for k in ctxs}
        for _ in range(rounds):
            for k in ctxs:
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                t0 = time.process_time()
                step(k)
                ts[k].append(time.process_time() - t0)
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                faults[k].append((r1.ru_minflt - r0.ru_minflt, r1.ru_stime - r0.ru_stime))
        base = statistics.median(ts["bf16"])
        print("%s: BF16 step %.1f ms CPU; " % (name, 1e3 * base) + ", ".join(
            "%s x%.3f" % (k, statistics.median([a / b for a, b in zip(v, ts["bf16"])]))
            for k, v in ts.items() if k != "bf16"), flush=True)
        print("    minor faults / system ms per step: " + ", ".join(
            "%s %d / %.1f" % (k, statistics.median(f for f, _ in v),
                              1e3 * statistics.median(st for _, st in v))
            for k, v in faults.items()), flush=True)
        if not timing[0]:
            _timed(spent, calls)
            timing[0] = True
        step("default")
        spent.clear()
        calls.clear()
        step("default")
        rc._GATHER_COST = gather_cost
        for label, s in spent.most_common():
            print("    %-34s %6.2f ms %4d calls %5.1f%% of the BF16 step" % (
                label, 1e3 * s, calls[label], 100 * s / base))


def tables(names=None, rounds=15):
    torch.set_num_threads(1)
    print("load average %.1f %.1f %.1f" % os.getloadavg(), flush=True)
    spent, depth, raw, gather_cost = [0.0], [0], rc.Recomputed._raw, rc._GATHER_COST

    def timed(self):
        depth[0] += 1  # the outermost recomputation only: nested ones run inside it
        t0 = time.process_time()
        try:
            return raw(self)
        finally:
            depth[0] -= 1
            if not depth[0]:
                spent[0] += time.process_time() - t0
    rc.Recomputed._raw = timed
    try:
        for name, model, xb, loss_fn in _zoo(names):
            ctx = A.fp8_saved_tensors(params=model, warn_unmatched=False)
            got = {"no tables": [], "tables": [], "bf16": []}
            for i in range(rounds + 2):  # two warm-up rounds
                for k, cost in (("no tables", float("inf")), ("tables", gather_cost)):
                    rc._GATHER_COST, spent[0] = cost, 0.0
                    with ctx:
                        loss = loss_fn(model, xb)
                    loss.float().backward()
                    model.zero_grad(set_to_none=True)
                    if i >= 2:
                        got[k].append(spent[0])
                t0 = time.process_time()
                loss_fn(model, xb).float().backward()
                model.zero_grad(set_to_none=True)
                if i >= 2:
                    got["bf16"].append(time.process_time() - t0)
            rc._GATHER_COST = gather_cost
            base = statistics.median(got["bf16"])
            print("%s: BF16 step %.1f ms CPU; recomputing per step: no tables %.2f ms (%.1f%%),"
                  " tables %.2f ms (%.1f%%); tables / no tables, median of rounds %.2f" % (
                      name, 1e3 * base, 1e3 * statistics.median(got["no tables"]),
                      100 * statistics.median(got["no tables"]) / base,
                      1e3 * statistics.median(got["tables"]),
                      100 * statistics.median(got["tables"]) / base,
                      statistics.median([a / b for a, b in zip(got["tables"],
                                                               got["no tables"]) if b > 0]
                                        or [1.0])), flush=True)
    finally:
        rc.Recomputed._raw, rc._GATHER_COST = raw, gather_cost
    print("load average %.1f %.1f %.1f" % os.getloadavg(), flush=True)


if __name__ == "__main__":
    argv = sys.argv[1:]
    run = tables if argv[:1] == ["--tables"] else main
    argv = argv[1:] if run is tables else argv
    kw = {"rounds": int(argv[1])} if len(argv) > 1 else {}
    run([n for n in argv[0].split(",") if n] if argv else None, **kw)
