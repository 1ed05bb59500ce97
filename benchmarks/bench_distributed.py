"""Distributed: sync_found_inf, FSDP2 8-bit moments and step host time, 2 CPU ranks (README.md)."""
import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import mpext
from mpext.optim import _q8_shards
from .common import Bench, Timing, check, markdown_table, mlp, run_standalone

NAME = "bench_distributed"
TITLE = ("sync_found_inf's all-reduce of the inf/NaN flag, and 8-bit moments' shared blocks "
         "under FSDP2: their cost per step (2 CPU ranks)")
WORLD, WIDTH, LOCAL_BATCH, TIMEOUT_S = 2, 256, 32, 300


def _worker(rank: int, out_path: str, rounds: int, inner: int) -> None:
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method="file://" + os.path.join(
        os.path.dirname(out_path), "rendezvous"), rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=120))
    try:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(mlp([64, WIDTH, WIDTH, 1]))
        opt = mpext.optim.AdamW(model.parameters(), lr=1e-4)
        scalers = {s: mpext.GradScaler("cpu", init_scale=2.0 ** 10, sync_found_inf=s)
                   for s in (False, True)}
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(LOCAL_BATCH, 64, generator=g), torch.randn(LOCAL_BATCH, 1, generator=g)
        flag = torch.zeros(())

        def step(scaler):
            opt.zero_grad(set_to_none=True)
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()

        def timed(fn):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            return (time.perf_counter() - t0) / inner

        # FSDP2 with BF16 params, remainders, FP32 or 8-bit moments: shards of 1025 x 250 and
        # 1023 x 2049 elements, so each weight has a block the two ranks share
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh, fsdp = init_device_mesh("cpu", (WORLD,)), {}
        for label, kw in (("fp32", {}), ("q8", dict(exp_avg_dtype=torch.int8,
                                                   exp_avg_sq_dtype=torch.uint8))):
            torch.manual_seed(0)
            net = mlp([250, 2049, 2045, 1]).to(torch.bfloat16)
            for layer in net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(net, mesh=mesh)
            fopt = mpext.optim.AdamW(net.parameters(), lr=1e-4, param_remainders=True, **kw)
            net(torch.randn(4, 250, dtype=torch.bfloat16)).float().sum().backward()
            fsdp[label] = fopt
        # the step's items the long way (a whole step's _items() is the cached plan)
        q8_params = fsdp["q8"].param_groups[0]["params"]
        items, shared = _q8_shards.split(fsdp["q8"]._items(only={id(p) for p in q8_params}))
        for sync in (False, True):  # warm-up
            for _ in range(3):
                step(scalers[sync])
                fsdp["fp32" if sync else "q8"].step()
        samples = {"off": [], "on": [], "reduce": [], "fp32": [], "q8": [], "exchange": []}
        for _ in range(rounds):
            samples["off"].append(timed(lambda: step(scalers[False])))
            samples["on"].append(timed(lambda: step(scalers[True])))
            samples["reduce"].append(timed(lambda: scalers[True]._reduce_found_inf_(flag)))
            samples["fp32"].append(timed(fsdp["fp32"].step))
            samples["q8"].append(timed(fsdp["q8"].step))
            samples["exchange"].append(timed(shared.gather))
        if rank == 0:
            torch.save({"samples": samples,
                        "skipped": [scalers[s].get_skipped_steps() for s in (False, True)],
                        "params": sum(p.numel() for p in model.parameters()),
                        "fsdp_params": sum(p.numel() for p in fsdp["q8"].param_groups[0][
                            "params"]),
                        "exchange_bytes": sum(b.numel() for b, _ in shared.buffers)}, out_path)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Both ranks are done and the results saved: leave without tearing down. Freeing the DDP
    # model after the group can run gloo's destructor with the GIL held while its loop thread
    # waits for the GIL to free a tensor, a deadlock that hung the rank for good.
    os._exit(0)


# ---- FSDP2 step host time per tensor, every format against torch's fused AdamW ------------

STEP_LAYERS, STEP_WIDTH = 100, 100  # 100 x Linear(100, 100) under fully_shard(root): 200 tensors
BF16, Q8 = torch.bfloat16, dict(exp_avg_dtype=torch.int8, exp_avg_sq_dtype=torch.uint8)
# label -> (param dtype, mpext.optim.AdamW keywords; None: torch.optim.AdamW(fused=True)),
# and whether it steps the long way (its plan never kept: the step before the cache)
STEP_FORMATS = {
    "torch fused, fp32 params": (torch.float32, None, False),
    "torch fused, bf16 params": (BF16, None, False),
    "fp32 (default)": (torch.float32, {}, False),
    "bf16 + fp32 master": (BF16, {}, False),
    "bf16 + remainder": (BF16, dict(param_remainders=True), False),
    "bf16 SR": (BF16, dict(master_weights=False, stochastic_rounding=True), False),
    "bf16 + master, bf16 moments": (BF16, dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16),
                                    False),
    "bf16 + master, 8-bit moments": (BF16, dict(Q8), False),
    "bf16 + remainder, 8-bit moments": (BF16, dict(param_remainders=True, **Q8), False),
    "bf16 SR, 8-bit moments": (BF16, dict(master_weights=False, stochastic_rounding=True,
                                          **Q8), False),
    "fp32 (default), long way": (torch.float32, {}, True),
    "bf16 SR, 8-bit moments, long way": (BF16, dict(master_weights=False,
                                                    stochastic_rounding=True, **Q8), True),
}


def _step_worker(rank: int, out_path: str, rounds: int, inner: int) -> None:
    """Every STEP_FORMATS optimizer on its own FSDP2 copy of one model, on fixed gradients;
    ``opt.step()`` alone, the optimizers interleaved in every round, each after a barrier."""
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method="file://" + os.path.join(
        os.path.dirname(out_path), "rendezvous"), rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=120))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (WORLD,))
        opts = {}
        for label, (dtype, kw, long_way) in STEP_FORMATS.items():
            torch.manual_seed(0)
            net = nn.Sequential(*[nn.Linear(STEP_WIDTH, STEP_WIDTH)
                                  for _ in range(STEP_LAYERS)]).to(dtype)
            fully_shard(net, mesh=mesh)
            if kw is None:
                opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
            else:
                opt = mpext.optim.AdamW(net.parameters(), lr=1e-4, **kw)
                if long_way:
                    opt._new_plan = lambda *args: None
            net(torch.randn(4, STEP_WIDTH, dtype=dtype)).float().sum().backward()
            opts[label] = (opt, sum(1 for _ in net.parameters()))
        for opt, _ in opts.values():  # warm-up: state created, plans kept
            for _ in range(3):
                opt.step()
        samples = {label: [] for label in opts}
        cpu = {label: [] for label in opts}
        for _ in range(rounds):
            for label, (opt, n) in opts.items():
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(inner):
                    opt.step()
                samples[label].append((time.perf_counter() - t0) / inner / n)
                # the process's CPU time: the host work without the time spent descheduled or
                # waiting for the other rank inside a collective (gloo's threads included)
                cpu[label].append((time.process_time() - c0) / inner / n)
        if rank == 0:
            torch.save({"samples": samples, "cpu": cpu,
                        "tensors": {k: n for k, (_, n) in opts.items()}}, out_path)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    os._exit(0)  # as _worker


def _measure(rounds: int, inner: int, worker=None) -> dict:
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory() as d:
        out_path = os.path.join(d, "rank0.pt")
        ctx = mp.start_processes(worker or _worker, args=(out_path, rounds, inner),
                                 nprocs=WORLD, join=False, start_method=method)
        deadline = time.monotonic() + TIMEOUT_S
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise RuntimeError("the 2-rank run did not finish within %d s" % TIMEOUT_S)
        res = torch.load(out_path, weights_only=False)
    return dict(res, start_method=method)


def _step_section(ctx, b) -> tuple:
    """The FSDP2 step-host-time table (Markdown lines) and its payload."""
    rounds, inner = max(ctx.repeats, 15), 3 if ctx.quick else 5
    res = _measure(rounds, inner, _step_worker)
    b.phase("2-rank FSDP2 step run")
    samples, cpu = res["samples"], res["cpu"]
    rows, table = [], {}

    def cells(t, ratio, native):
        return ["%.1f (%.1f–%.1f)" % (t.median * 1e6, t.q1 * 1e6, t.q3 * 1e6),
                "—" if native else "%.2f× (%.2f–%.2f)" % (ratio.median, ratio.q1, ratio.q3)]

    for label, (dtype, kw, _) in STEP_FORMATS.items():
        t, c = Timing(samples[label], inner), Timing(cpu[label], inner)
        torch_label = "torch fused, %s params" % ("fp32" if dtype is torch.float32 else "bf16")
        # per round against torch's in the same round (interleaved): the ratio's median and
        # quartiles
        per_round = Timing([a / r for a, r in zip(samples[label], samples[torch_label])], 1)
        cpu_round = Timing([a / r for a, r in zip(cpu[label], cpu[torch_label])], 1)
        table[label] = {"timing": t.to_json(), "vs_torch": per_round.to_json(),
                        "cpu": c.to_json(), "cpu_vs_torch": cpu_round.to_json(),
                        "torch": torch_label}
        rows.append([label] + cells(t, per_round, kw is None) + cells(c, cpu_round, kw is None))
        if kw is not None and not STEP_FORMATS[label][2]:
            b.target(per_round.median <= 1.0, "FSDP2 step host time, %s: %.2f× torch's fused "
                     "AdamW (target ≤ 1)" % (label, per_round.median))
    md = [markdown_table(["optimizer / format", "wall µs per tensor: median (q1–q3)",
                          "÷ torch fused AdamW (same dtype, same round)",
                          "CPU µs per tensor", "÷ torch's CPU µs"], rows), "",
          "FSDP2 `fully_shard(root)` over %d × `Linear(%d, %d)` (%d tensors) on 2 gloo ranks "
          "(one thread each), `opt.step()` alone on fixed gradients: %d rounds, every "
          "optimizer in each round after a barrier, %d steps per sample; rank 0's clock. "
          "\"long way\": the same mpext optimizer with its step plan never kept (every step "
          "re-derives the local views, the 8-bit shard split and the launch lists). The wall "
          "time of an 8-bit format includes its all-reduce of the blocks two shards share, "
          "which waits for the other rank (on a loaded machine, for it to be scheduled); the "
          "CPU time (`time.process_time()`, the process's threads) leaves that wait out. The "
          "target (≤ 1) is on the wall time's median."
          % (STEP_LAYERS, STEP_WIDTH, STEP_WIDTH, res["tensors"]["fp32 (default)"], rounds,
             inner)]
    return md, dict(rounds=rounds, inner=inner, formats=table, tensors=res["tensors"])


def run(ctx) -> dict:
    b = Bench(ctx, NAME, TITLE)
    if getattr(ctx.args, "mode", "all") == "fsdp-step":
        md, payload = _step_section(ctx, b)
        return b.finish(md, dict(fsdp_step=payload), device="cpu (2 gloo ranks)")
    rounds, inner = ctx.repeats, 10 if ctx.quick else 40
    res = _measure(rounds, inner)
    b.phase("2-rank run")
    s = {k: Timing(v, inner).to_json() for k, v in res["samples"].items()}
    off, on, red, f32, q8, ex = (s[k]["median_s"] for k in ("off", "on", "reduce", "fp32", "q8",
                                                            "exchange"))
    check(res["skipped"] == [0, 0], "steps were skipped during the benchmark: %s" % res["skipped"])

    us = {k: "%.1f ±%.1f" % (t["median_s"] * 1e6, t["iqr_s"] * 1e6 / 2) for k, t in s.items()}
    rows = [["step, sync_found_inf=False", us["off"], "—"],
            ["step, sync_found_inf=True", us["on"], "%+.1f%%" % (100 * (on - off) / off)],
            ["found_inf all-reduce alone", us["reduce"], "%.1f%%" % (100 * red / off)]]
    rows8 = [["FSDP2 optimizer step, FP32 moments", us["fp32"], "—"],
             ["FSDP2 optimizer step, 8-bit moments", us["q8"],
              "%+.1f%%" % (100 * (q8 - f32) / f32)],
             ["the shared blocks' exchange alone (%s bytes)" % "{:,}".format(res["exchange_bytes"]),
              us["exchange"], "%.1f%%" % (100 * ex / f32)]]
    md = [markdown_table(["what", "µs per step / call", "of a step without sync"], rows), "",
          "2 gloo ranks (started with `%s`), a %s-parameter MLP (batch %d per rank); %d rounds of "
          "%d steps (or calls). Measured difference per step: %+.1f µs; the flag's all-reduce "
          "alone: %.1f µs (%.1f%% of a step). Method: benchmarks/README.md, \"Distributed\"."
          % (res["start_method"], "{:,}".format(res["params"]), LOCAL_BATCH, rounds, inner,
             (on - off) * 1e6, red * 1e6, 100 * red / off), "",
          markdown_table(["what", "µs per step / call", "of the step with FP32 moments"], rows8),
          "", "FSDP2 over a BF16 %s-parameter MLP (2049 x 250 and 2045 x 2049 weights cut "
          "inside 8-bit blocks), `mpext.optim.AdamW(param_remainders=True)`, `opt.step()` alone on "
          "fixed gradients." % "{:,}".format(res["fsdp_params"])]
    step_md, step_payload = _step_section(ctx, b)
    md += ["", "### FSDP2 step host time per tensor, every format against torch's fused AdamW",
           ""] + step_md
    # the timings by key (rows above); the differences and fractions follow from their medians
    payload = dict({k: v for k, v in res.items() if k != "samples"}, world_size=WORLD,
                   local_batch=LOCAL_BATCH, rounds=rounds, inner=inner, timings=s,
                   fsdp_step=step_payload)
    return b.finish(md, payload, device="cpu (2 gloo ranks)")


def add_args(parser):
    parser.add_argument("--mode", choices=("all", "fsdp-step"), default="all",
                        help="fsdp-step: only the FSDP2 step host time per tensor of every "
                             "format against torch's fused AdamW (default: %(default)s)")
    return parser


if __name__ == "__main__":
    run_standalone(run, __doc__, add_args)
