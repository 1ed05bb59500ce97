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
from mpext.memory.meter import live_bytes as _live_bytes
from mpext.memory.meter import measure_release as release_memory
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

_GRADS_ENV = "MPEXT_BENCH_STEP_GRADS"  # --step-grads, to the ranks
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
            # The backward of 100 linear layers without activations leaves gradients of 1e-23
            # in the first layers, whose squares are subnormal: every kernel (torch's too)
            # then runs 2-3x slower on floating-point assists, which is no host time. Unless
            # --step-grads backward, each local gradient (FSDP2's own tensors) is overwritten
            # in place with values of a trained model's magnitude, the same for every optimizer.
            if os.environ.get(_GRADS_ENV) != "backward":
                gen = torch.Generator().manual_seed(rank)
                with torch.no_grad():
                    for p in net.parameters():
                        g = p.grad.to_local()
                        g.copy_(torch.randn(g.shape, generator=gen) * 1e-3)
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


# ---- Gradient release under FSDP2: step cost and memory per device ------------------------

RELEASE_WIDTH, RELEASE_LAYERS, RELEASE_BUCKET = 512, 6, 1 << 20


def _release_worker(rank: int, out_path: str, rounds: int, inner: int) -> None:
    """FSDP2 over a BF16 MLP, remainders + 8-bit moments, mpext.GradScaler: a whole
    forward + backward + step, stepped after backward (scaler.step) and released (buckets of
    1 MiB, found_inf all-reduced per bucket), interleaved in each round; the per-bucket
    reduction alone; and each rank's live bytes."""
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method="file://" + os.path.join(
        os.path.dirname(out_path), "rendezvous"), rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=120))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from mpext.optim._release import _Mesh
        mesh = init_device_mesh("cpu", (WORLD,))
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(LOCAL_BATCH, RELEASE_WIDTH, generator=g).to(BF16)
        runs = {}
        for label in ("after", "released"):
            torch.manual_seed(0)
            net = nn.Sequential(*[nn.Linear(RELEASE_WIDTH, RELEASE_WIDTH)
                                  for _ in range(RELEASE_LAYERS)]).to(BF16)
            policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
            for layer in net:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(net, mesh=mesh, mp_policy=policy)
            params = list(net.parameters())
            opt = mpext.optim.AdamW(params, lr=1e-4, param_remainders=True, **Q8)
            scaler = mpext.GradScaler("cpu", init_scale=2.0 ** 10)
            live = {"peak": 0}

            def watch(p, params=params, live=live):  # runs before the release's hook
                live["peak"] = max(live["peak"], _live_bytes(q.grad for q in params))
            for p in params:
                p.register_post_accumulate_grad_hook(watch)
            release = (opt.release_grads(bucket_bytes=RELEASE_BUCKET, scaler=scaler)
                       if label == "released" else None)

            def step(net=net, opt=opt, scaler=scaler, release=release):
                loss = scaler.scale(net(x).float().square().mean())
                if release is not None:
                    release.backward(loss)
                else:
                    loss.backward()
                    scaler.step(opt)
                    opt.zero_grad(set_to_none=True)
                scaler.update()
            runs[label] = (step, params, opt, scaler, release, live, net)
        for step, *_ in runs.values():  # warm-up: the state exists
            for _ in range(3):
                step()
        mem = {}
        for label, (step, params, opt, scaler, release, live, net) in runs.items():
            live["peak"] = 0
            loss = scaler.scale(net(x).float().square().mean())
            if release is not None:
                release.backward(loss)
            else:
                loss.backward()
            state = [v for st in opt.state.values() for v in st.values()
                     if isinstance(v, torch.Tensor)]
            mem[label] = {"params": _live_bytes(params), "state": _live_bytes(state),
                          "grads_after_backward": _live_bytes(p.grad for p in params),
                          "grad_peak": live["peak"]}
            if release is None:
                scaler.step(opt)
                opt.zero_grad(set_to_none=True)
            scaler.update()
        flag = torch.zeros(())
        reducer = _Mesh(mesh)
        samples = {"after": [], "released": [], "reduce": []}
        for _ in range(rounds):
            for label in ("after", "released"):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(inner):
                    runs[label][0]()
                samples[label].append((time.perf_counter() - t0) / inner)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(inner):
                reducer.max_(flag)
            samples["reduce"].append((time.perf_counter() - t0) / inner)
        rel = runs["released"][4]
        out = {"samples": samples, "memory": mem,
               "buckets_per_step": rel.buckets_stepped / rel.backward_passes,
               "skipped": [runs[k][3].get_skipped_steps() for k in runs],
               "params": sum(p.numel() for p in runs["after"][1])}
        torch.save(out, out_path.replace("rank0", "rank%d" % rank))
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    os._exit(0)  # as _worker


# label -> (mpext.optim.AdamW keywords (BF16 params), the calculator's mode of that format)
RELEASE_FORMATS = {
    "bf16 + fp32 master": ({}, "mpext-bf16-master-float32"),
    "bf16 + remainder": (dict(param_remainders=True), "mpext-bf16-remainder-float32"),
    "bf16 SR, bf16 moments": (dict(master_weights=False, stochastic_rounding=True,
                                   exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16),
                              "mpext-bf16-stochastic-bfloat16"),
    "bf16 SR, 8-bit moments": (dict(master_weights=False, stochastic_rounding=True, **Q8),
                               "mpext-bf16-stochastic-q8"),
}
# the memory table's release bucket, bytes per rank: less than a rank's sharded gradient at 2
# and 4 ranks (1.5 and 0.75 MiB), so that the peak shows the bucket on both
MEMORY_BUCKET = 256 * 1024


def _memory_prediction(label: str, world: int, rank: int, released: bool, engine: str):
    """``python -m mpext.memory``'s figures for one rank of the memory table's run (the
    model's shapes; FSDP2: a unit per layer, the last reduced first; DDP: its default
    buckets, the gradients ready last layer first)."""
    from mpext.memory import estimate
    shapes = [s for _ in range(RELEASE_LAYERS)
              for s in ((RELEASE_WIDTH, RELEASE_WIDTH), (RELEASE_WIDTH,))]
    kw = dict(mode=RELEASE_FORMATS[label][1], rule="adamw", world_size=world,
              grad_release=released, bucket_bytes=MEMORY_BUCKET)
    if engine == "fsdp2":
        return estimate(shapes, zero=3, sharding="torch", rank=rank, **kw, units=[
            [2 * i, 2 * i + 1] for i in reversed(range(RELEASE_LAYERS))])
    return estimate(shapes, ddp=True, **kw)


def _release_memory_worker(rank: int, out_path: str, rounds: int, inner: int) -> None:
    """Each rank's live bytes for every RELEASE_FORMATS format, FSDP2 and DDP, after backward
    and released (release_memory), with the calculator's prediction for that rank.
    ``rounds`` is the world size here."""
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    world = rounds
    dist.init_process_group("gloo", init_method="file://" + os.path.join(
        os.path.dirname(out_path), "rendezvous"), rank=rank, world_size=world,
        timeout=timedelta(seconds=120))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh("cpu", (world,))
        x = torch.randn(LOCAL_BATCH, RELEASE_WIDTH,
                        generator=torch.Generator().manual_seed(rank)).to(BF16)
        out = {}
        for label, (kw, _) in RELEASE_FORMATS.items():
            for engine in ("fsdp2", "ddp"):
                for released in (False, True):
                    torch.manual_seed(0)
                    net = nn.Sequential(*[nn.Linear(RELEASE_WIDTH, RELEASE_WIDTH)
                                          for _ in range(RELEASE_LAYERS)]).to(BF16)
                    ddp = None
                    if engine == "fsdp2":
                        policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
                        for layer in net:
                            fully_shard(layer, mesh=mesh, mp_policy=policy)
                        fully_shard(net, mesh=mesh, mp_policy=policy)
                    else:
                        ddp = nn.parallel.DistributedDataParallel(net)
                    params = list(net.parameters())
                    opt = mpext.optim.AdamW(params, lr=1e-4, **kw)
                    run = ddp if ddp is not None else net
                    got = release_memory(params, opt,
                                         lambda step: run(x).float().square().mean(),
                                         released, MEMORY_BUCKET, ddp=ddp)
                    b = _memory_prediction(label, world, rank, released, engine)
                    got["predicted"] = dict(
                        params=b.weights, state=b.master_weights + b.optimizer_states,
                        grads=b.gradients, ddp_buckets=b.comm_buffers, grad_peak=b.grad_peak,
                        persistent=b.persistent)
                    out[(label, engine, released)] = dict(
                        got, numel=sum(p.numel() for p in params))
        # every rank's figures against its prediction: the count of those that differ
        bad = torch.tensor(float(sum(
            v[k] != v["predicted"][k] for v in out.values()
            for k in ("params", "state", "grads", "grad_peak", "ddp_buckets") if k in v)))
        dist.all_reduce(bad)
        out["mispredicted"] = int(bad.item())
        torch.save(out, out_path.replace("rank0", "rank%d" % rank))
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    os._exit(0)


def _release_memory(world: int) -> dict:
    global WORLD
    saved, WORLD = WORLD, world  # _measure spawns WORLD ranks
    try:
        return _measure(world, 0, _release_memory_worker)
    finally:
        WORLD = saved


def _release_section(ctx, b) -> tuple:
    rounds, inner = max(ctx.repeats, 7), 2 if ctx.quick else 4
    res = _measure(rounds, inner, _release_worker)
    b.phase("2-rank FSDP2 release run")
    check(all(n == 0 for n in res["skipped"]), "steps were skipped: %s" % res["skipped"])
    s = res["samples"]
    after, rel, red = (Timing(s[k], inner) for k in ("after", "released", "reduce"))
    ratio = Timing([a / r for a, r in zip(s["released"], s["after"])], 1)
    nb = res["buckets_per_step"]
    ms = lambda t: "%.2f (%.2f–%.2f)" % (t.median * 1e3, t.q1 * 1e3, t.q3 * 1e3)  # noqa: E731
    rows = [["forward + backward + scaler.step after backward", ms(after), "—"],
            ["forward + backward, released (%.0f buckets a step)" % nb, ms(rel),
             "%.2f× (%.2f–%.2f)" % (ratio.median, ratio.q1, ratio.q3)],
            ["one bucket's found_inf all-reduce (MAX) alone", "%.3f" % (red.median * 1e3),
             "%.1f%% of a step after backward, ×%.0f buckets" % (
                 100 * red.median * nb / after.median, nb)]]
    mib = lambda n: "%.2f" % (n / 2 ** 20)  # noqa: E731
    mrows = []
    for label in ("after", "released"):
        m = res["memory"][label]
        mrows.append([label, mib(m["params"]), mib(m["state"]),
                      mib(m["grads_after_backward"]),
                      mib(m["params"] + m["state"] + m["grads_after_backward"]),
                      mib(m["grad_peak"])])
    md = [markdown_table(["what", "ms per step: median (q1–q3)", "÷ after backward (same round)"],
                         rows), "",
          markdown_table(["rank 0", "params MiB", "optimizer state MiB",
                          ".grad alive after backward MiB", "persistent MiB",
                          "sharded .grad peak during backward MiB"], mrows), "",
          "FSDP2 over %d × `Linear(%d, %d)` in BF16 (%s params; `reduce_dtype=float32`), "
          "`mpext.optim.AdamW(param_remainders=True)` with 8-bit moments and "
          "`mpext.GradScaler`, 2 gloo ranks (one thread each), batch %d per rank; released "
          "with `bucket_bytes=1 MiB`; %d rounds of %d steps, the two interleaved in each round "
          "after a barrier; rank 0's clock. Memory: the distinct storages of rank 0's local "
          "shards (params, every state tensor, `.grad`), and the largest sum of the sharded "
          "`.grad` storages seen as each gradient completes (a hook that runs before the "
          "release's); FSDP2's own unsharded and reduce-scatter buffers, alive in both modes, "
          "are not counted." % (RELEASE_LAYERS, RELEASE_WIDTH, RELEASE_WIDTH,
                                "{:,}".format(res["params"]), LOCAL_BATCH, rounds, inner)]
    per_world = {}
    mem_rows = []
    for world in (2, 4):
        got = _release_memory(world)
        b.phase("%d-rank FSDP2 and DDP release memory" % world)
        check(got["mispredicted"] == 0, "%d figures of %d ranks differ from python -m "
              "mpext.memory's" % (got["mispredicted"], world))
        per_world[world] = {"%s|%s|%s" % (k[0], k[1], "released" if k[2] else "after"): v
                            for k, v in got.items() if isinstance(k, tuple)}
        for engine in ("fsdp2", "ddp"):
            for label in RELEASE_FORMATS:
                a, r = got[(label, engine, False)], got[(label, engine, True)]
                n = a["numel"] / (world if engine == "fsdp2" else 1)  # params per rank
                pa, pr = (v["params"] + v["state"] + v["grads"] + v.get("ddp_buckets", 0)
                          for v in (a, r))
                mem_rows.append([str(world), "FSDP2" if engine == "fsdp2" else "DDP", label,
                                 "%.2f" % (pa / n), "%.2f" % (pr / n),
                                 "%s / %s" % (mib(a["grad_peak"]), mib(r["grad_peak"]))])
    md += ["", markdown_table(["ranks", "engine", "format",
                               "persistent B/param per rank, after backward", "released",
                               ".grad peak in backward MiB, after / released"], mem_rows), "",
           "Rank 0's live storages after a second step (the state exists; DDP's buckets "
           "rebuilt), per parameter it holds (FSDP2: the model's over the ranks; DDP: all), "
           "the per-param step scalars left out; DDP's persistent bytes include its gradient "
           "buckets (2 B/param, released or not); the `.grad` peak from a hook that runs before "
           "the release's (under DDP the local gradients). Released with `bucket_bytes=%d KiB` "
           "per rank. Every figure of every rank equals `python -m mpext.memory`'s prediction "
           "(`--zero fsdp2` / `--zero ddp`, the model's shapes; checked in the run). 8-bit "
           "rows: the 512 x 512 weights keep 8-bit moments, the 512-element biases FP32 ones."
           % (MEMORY_BUCKET // 1024)]
    return md, dict(rounds=rounds, inner=inner, timings={k: Timing(v, inner).to_json()
                                                         for k, v in s.items()},
                    ratio=ratio.to_json(), memory=res["memory"], buckets_per_step=nb,
                    memory_per_world=per_world)


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


# ---- Muon under FSDP2: where Newton-Schulz runs (--mode muon) -----------------------------

# GPT-2 small's hidden matrices of one layer (c_attn, attn c_proj, c_fc, mlp c_proj), as
# nn.Linear weights (out, in)
MUON_SHAPES = ((2304, 768), (768, 768), (3072, 768), (768, 3072))
MUON_MODES = ("all_gather", "designated")


def _muon_bytes(shape, world, rank, k, mode):
    """Payload bytes (fp32 over gloo) rank ``rank`` sends and receives for one sharded matrix,
    the k-th of the step: all-gather (its shard to every other rank, every other shard to
    it) or designated (its padded piece to rank k mod world and back; that rank receives and
    sends every other piece)."""
    rows, cols = shape
    piece = -(-rows // world)
    local = max(0, min(piece, rows - rank * piece))
    if mode == "all_gather":
        return 4 * cols * (local * (world - 1) + rows - local)
    if rank == k % world:
        return 4 * cols * piece * (world - 1) * 2
    return 4 * cols * piece * 2


def _muon_worker(rank: int, out_path: str, rounds: int, inner: int) -> None:
    """mpext.optim.Muon over FSDP2-sharded GPT-2-small matrices, ``opt.step()`` alone on fixed
    gradients, NS on every rank (all-gather) against one designated rank per matrix, the two
    interleaved in every round after a barrier; and whether they leave the same bits."""
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method="file://" + os.path.join(
        os.path.dirname(out_path), "rendezvous"), rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=120))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import distribute_tensor
        mesh = init_device_mesh("cpu", (WORLD,))
        opts = {}
        for mode in MUON_MODES:
            torch.manual_seed(0)
            net = nn.Sequential(*[nn.Linear(i, o, bias=False) for o, i in MUON_SHAPES])
            fully_shard(net, mesh=mesh)
            params = list(net.parameters())
            g = torch.Generator().manual_seed(1)
            for p in params:
                p.grad = distribute_tensor(torch.randn(p.shape, generator=g) * 1e-3, mesh,
                                           p.placements)
            opts[mode] = (mpext.optim.Muon(params, lr=0.02, ns_sharded=mode), params)
        for opt, _ in opts.values():  # warm-up: state created
            for _ in range(2):
                opt.step()
        same = all(torch.equal(a.to_local(), b.to_local()) for a, b in
                   zip(opts[MUON_MODES[0]][1], opts[MUON_MODES[1]][1]))
        samples = {mode: [] for mode in opts}
        for _ in range(rounds):
            for mode, (opt, _) in opts.items():
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(inner):
                    opt.step()
                samples[mode].append((time.perf_counter() - t0) / inner)
        nbytes = {mode: [sum(_muon_bytes(s, WORLD, r, k, mode) for k, s in enumerate(MUON_SHAPES))
                         for r in range(WORLD)] for mode in MUON_MODES}
        if rank == 0:
            torch.save({"samples": samples, "same_bits": same, "bytes": nbytes,
                        "params": sum(a * b for a, b in MUON_SHAPES)}, out_path)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    os._exit(0)  # as _worker


def _muon_section(ctx, b) -> tuple:
    rounds, inner = (5, 1) if ctx.quick else (max(ctx.repeats, 9), 2)
    res = _measure(rounds, inner, _muon_worker)
    b.phase("2-rank Muon run")
    check(res["same_bits"], "designated NS left other bits than all-gather NS")
    t = {m: Timing(res["samples"][m], inner) for m in MUON_MODES}
    ratio = Timing([a / d for a, d in zip(res["samples"]["all_gather"],
                                          res["samples"]["designated"])], 1)
    rows = [[m, "%.1f (%.1f–%.1f)" % (t[m].median * 1e3, t[m].q1 * 1e3, t[m].q3 * 1e3),
             " / ".join("%.1f" % (x / 2 ** 20) for x in res["bytes"][m]),
             "—" if m == "all_gather" else "%.2f× (%.2f–%.2f)" % (ratio.median, ratio.q1,
                                                                   ratio.q3)]
            for m in MUON_MODES]
    md = [markdown_table(["Newton-Schulz of a sharded matrix", "step ms: median (q1–q3)",
                          "MiB sent + received per step, rank 0 / rank 1",
                          "all-gather ÷ designated (same round)"], rows), "",
          "`mpext.optim.Muon` over FSDP2 `fully_shard` of GPT-2 small's hidden matrices of one "
          "layer (%s; %s params) on 2 gloo ranks, one thread each, `opt.step()` alone on fixed "
          "gradients, %d rounds of %d steps, the two interleaved in every round; rank 0's clock. "
          "Bytes: the payload each rank sends and receives (fp32 over gloo), from the shard "
          "sizes. Both leave the same bits: %s." % (
              ", ".join("%dx%d" % s for s in MUON_SHAPES), "{:,}".format(res["params"]), rounds,
              inner, "yes" if res["same_bits"] else "NO")]
    return md, dict(rounds=rounds, inner=inner, same_bits=res["same_bits"], bytes=res["bytes"],
                    timings={m: t[m].to_json() for m in MUON_MODES}, ratio=ratio.to_json())


def _step_section(ctx, b) -> tuple:
    """The FSDP2 step-host-time table (Markdown lines) and its payload."""
    rounds, inner = max(ctx.repeats, 15), 3 if ctx.quick else 5
    grads = getattr(ctx.args, "step_grads", "trained")
    os.environ[_GRADS_ENV] = grads
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
          "(one thread each), `opt.step()` alone on fixed gradients (%s): %d rounds, every "
          "optimizer in each round after a barrier, %d steps per sample; rank 0's clock. "
          "\"long way\": the same mpext optimizer with its step plan never kept (every step "
          "re-derives the local views, the 8-bit shard split and the launch lists). The wall "
          "time of an 8-bit format includes its all-reduce of the blocks two shards share, "
          "which waits for the other rank (on a loaded machine, for it to be scheduled); the "
          "CPU time (`time.process_time()`, the process's threads) leaves that wait out. The "
          "target (≤ 1) is on the wall time's median."
          % (STEP_LAYERS, STEP_WIDTH, STEP_WIDTH, res["tensors"]["fp32 (default)"],
             "the backward's, overwritten with N(0, 1e-6) values" if grads == "trained" else
             "the backward's own, subnormal squares in the first layers", rounds, inner)]
    return md, dict(rounds=rounds, inner=inner, formats=table, tensors=res["tensors"],
                    grads=grads)


def run(ctx) -> dict:
    b = Bench(ctx, NAME, TITLE)
    if getattr(ctx.args, "mode", "all") == "fsdp-step":
        md, payload = _step_section(ctx, b)
        return b.finish(md, dict(fsdp_step=payload), device="cpu (2 gloo ranks)")
    if getattr(ctx.args, "mode", "all") == "muon":
        md, payload = _muon_section(ctx, b)
        return b.finish(md, dict(muon=payload), device="cpu (2 gloo ranks)")
    if getattr(ctx.args, "mode", "all") == "release":
        md, payload = _release_section(ctx, b)
        return b.finish(md, dict(release=payload), device="cpu (2 gloo ranks)")
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
    parser.add_argument("--mode", choices=("all", "fsdp-step", "release", "muon"), default="all",
                        help="fsdp-step: only the FSDP2 step host time per tensor of every "
                             "format against torch's fused AdamW; release: gradient release "
                             "under FSDP2 against stepping after backward, time and memory "
                             "; muon: mpext.optim.Muon under FSDP2, Newton-Schulz on every rank "
                             "(all-gather) against one designated rank per matrix "
                             "(default: %(default)s)")
    parser.add_argument("--step-grads", choices=("trained", "backward"), default="trained",
                        help="fsdp-step's gradients: the backward's, overwritten with normal "
                             "values of std 1e-3 (trained), or the backward's own (backward: "
                             "1e-23 in the first layers, subnormal squares) "
                             "(default: %(default)s)")
    return parser


if __name__ == "__main__":
    run_standalone(run, __doc__, add_args)
