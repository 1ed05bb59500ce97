"""Data-parallel mixed-precision training with mpext on PyTorch's own distributed engine.

    torchrun --nproc-per-node 2 examples/ddp_train.py                   # DDP, fp16 + scaling
    torchrun --nproc-per-node 2 examples/ddp_train.py --precision bf16  # DDP, BF16 + masters
    torchrun --nproc-per-node 2 examples/ddp_train.py --fsdp            # FSDP2 (fully_shard)
    python examples/ddp_train.py                                        # one process

On CPUs it uses the gloo backend, on GPUs NCCL (one GPU per rank). Each rank trains on its own
part of every batch of a synthetic regression task; at the end the ranks check that they hold
identical parameters; with ``--checkpoint PATH`` (DDP) rank 0 saves a checkpoint there at the
end, which ``--resume`` continues from.

The pieces, as docs/distributed.md explains them:

* DDP, ``--precision fp16``: FP32 params, ``torch.autocast`` in float16, ``mpext.GradScaler`` and
  ``mpext.optim.AdamW`` (the unscale and the inf/NaN skip are fused into the optimizer step).
* DDP, ``--precision bf16``: the model's params in bfloat16; ``mpext.optim.AdamW`` keeps FP32
  master weights; no loss scaling (``GradScaler(bf16_check_only=True)`` still skips a step with
  an inf/NaN gradient).
* ``--fsdp``: ``fully_shard`` with a ``MixedPrecisionPolicy`` (compute in fp16/bf16, gradients
  reduced in FP32, FP32 sharded params); ``mpext.GradScaler`` reduces its inf/NaN flag over the
  shards by itself and ``mpext.optim.AdamW`` steps each rank's shards.
* ``--sync-found-inf``: ``GradScaler(sync_found_inf=True)``: one extra all-reduce per step so
  that ranks agree on skipping even when their gradients could differ.
"""
import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import mpext


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", choices=("fp16", "bf16"), default="fp16")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP")
    p.add_argument("--sync-found-inf", action="store_true",
                   help="all-reduce the scaler's inf/NaN flag every step")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=64, help="global batch size")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--checkpoint", default="",
                   help="DDP: rank 0 saves a checkpoint here at the end (default: none)")
    p.add_argument("--resume", action="store_true", help="start from --checkpoint (DDP)")
    return p.parse_args(argv)


def init_distributed():
    """torchrun sets RANK/WORLD_SIZE/MASTER_ADDR/...; without it this is a 1-process group."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend)
    return device


def make_model(width, device):
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                         nn.Linear(width, 1)).to(device)


def batch(step, args, device):
    """Rank r's part of the global batch of this step (the ranks see different data)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(args.batch, 32, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True).sin()
    world, rank = dist.get_world_size(), dist.get_rank()
    per = args.batch // world
    return x[rank * per:(rank + 1) * per].to(device), y[rank * per:(rank + 1) * per].to(device)


def main():
    args = parse_args()
    device = init_distributed()
    try:
        train(args, device)
    finally:
        dist.destroy_process_group()


def train(args, device):
    """Trains in the process group that is set up; returns the final loss, scale and number of
    skipped steps (the same on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    low = torch.float16 if args.precision == "fp16" else torch.bfloat16
    model = make_model(args.width, device)

    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (world,))
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        train_model, autocast = model, False  # the policy casts; params stay FP32 shards
    else:
        if args.precision == "bf16":
            model = model.to(torch.bfloat16)  # BF16 params; AdamW keeps FP32 masters
        ddp_kw = {"device_ids": [device.index]} if device.type == "cuda" else {}
        train_model = nn.parallel.DistributedDataParallel(model, **ddp_kw)
        autocast = args.precision == "fp16"

    opt = mpext.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = mpext.GradScaler(device.type, init_scale=2.0 ** 12,
                              bf16_check_only=args.precision == "bf16",
                              sync_found_inf=args.sync_found_inf)

    start = 0
    if args.resume and (args.fsdp or not args.checkpoint):
        raise SystemExit("--resume needs --checkpoint PATH and DDP (this example saves DDP "
                         "checkpoints only)")
    if args.resume:
        ckpt = torch.load(args.checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start = ckpt["step"]

    t0 = time.perf_counter()
    for step in range(start, start + args.steps):
        x, y = batch(step, args, device)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=low, enabled=autocast):
            out = train_model(x.to(low) if (args.precision == "bf16" and not args.fsdp) else x)
        loss = nn.functional.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)  # fused unscale + skip-on-inf in the AdamW kernel, no host sync
        scaler.update()
        if rank == 0 and (step % 10 == 0 or step == start + args.steps - 1):
            print("step %4d  loss %.5f  scale %g  skipped %d"
                  % (step, loss.item(), scaler.get_scale(), scaler.get_skipped_steps()),
                  flush=True)
    seconds = time.perf_counter() - t0

    # Every rank must hold the same model: compare a checksum of the (full) parameters.
    with torch.no_grad():
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
        checksum = torch.stack([p.double().sum() for p in full]).sum().reshape(1)
    sums = [torch.zeros_like(checksum) for _ in range(world)]
    dist.all_gather(sums, checksum)
    if any(not torch.equal(s, sums[0]) for s in sums):
        raise SystemExit("rank %d: the ranks' parameters differ: %s" % (rank, sums))
    if rank == 0:
        print("%s, %s, %d rank(s) on %s: %d steps in %.2f s; all ranks hold identical params"
              % ("FSDP2" if args.fsdp else "DDP", args.precision, world, device, args.steps,
                 seconds))
        if args.checkpoint and not args.fsdp:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "scaler": scaler.state_dict(), "step": start + args.steps},
                       args.checkpoint)
            print("saved", args.checkpoint)
    return {"loss": loss.item(), "scale": scaler.get_scale(),
            "skipped": scaler.get_skipped_steps()}


if __name__ == "__main__":
    main()
