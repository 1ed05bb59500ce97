"""Distributed: sync_found_inf and FSDP2 8-bit moments on 2 CPU ranks (benchmarks/README.md)."""
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
        items, shared = _q8_shards.split(fsdp["q8"]._items())
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


def _measure(rounds: int, inner: int) -> dict:
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory() as d:
        out_path = os.path.join(d, "rank0.pt")
        ctx = mp.start_processes(_worker, args=(out_path, rounds, inner), nprocs=WORLD,
                                 join=False, start_method=method)
        deadline = time.monotonic() + TIMEOUT_S
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise RuntimeError("the 2-rank run did not finish within %d s" % TIMEOUT_S)
        res = torch.load(out_path, weights_only=False)
    return dict(res, start_method=method)


def run(ctx) -> dict:
    b = Bench(ctx, NAME, TITLE)
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
    # the timings by key (rows above); the differences and fractions follow from their medians
    payload = dict({k: v for k, v in res.items() if k != "samples"}, world_size=WORLD,
                   local_batch=LOCAL_BATCH, rounds=rounds, inner=inner, timings=s)
    return b.finish(md, payload, device="cpu (2 gloo ranks)")


if __name__ == "__main__":
    run_standalone(run, __doc__)
