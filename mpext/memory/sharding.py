"""The sharding arithmetic of mpext.memory: ZeRO's even partition and PyTorch's engines per
rank (FSDP2's dim-0 chunks, ZeroRedundancyOptimizer's whole tensors), and the state one rank
keeps of a tensor in a mode (8-bit blocks cut by a shard included)."""
import math
from typing import Dict, List, Sequence, Tuple

from .._common import MIN_8BIT_NUMEL
from .modes import ModeSpec, _FP32


def stage_label(zero: int, sharding: str, world_size: int) -> str:
    """How a table names a ZeRO stage over ``world_size`` devices: 'ZeRO-1/8', and for
    PyTorch's engines 'ZeRO-1/8 torch' (ZeroRedundancyOptimizer) and 'FSDP2/8'."""
    if sharding == "torch" and zero == 3:
        return "FSDP2/%d" % world_size
    return "ZeRO-%d/%d%s" % (zero, world_size, " torch" if sharding == "torch" else "")


SHARDINGS = ("even", "torch")


def fsdp2_shard(shape: Sequence[int], world_size: int, rank: int) -> Tuple[int, int]:
    """(elements of ``rank``'s shard, elements it allocates) of a tensor of ``shape`` under
    FSDP2's ``fully_shard`` over ``world_size`` ranks: dim 0 is cut into chunks of
    ceil(dim0 / world_size) rows, so the last ranks hold fewer rows or none, and every rank
    allocates the padded chunk (the parameter's storage and its gradient's; the optimizer's
    state is made like the shard itself, unpadded)."""
    if not shape:
        raise ValueError("params: FSDP2 shards dim 0, and a 0-d tensor has none")
    rows, row = shape[0], math.prod(shape[1:])
    chunk = -(-rows // world_size)
    return max(0, min(chunk, rows - rank * chunk)) * row, chunk * row


def zero_partition(sizes: Sequence[int], world_size: int) -> List[List[int]]:
    """The tensors (their indices in ``sizes``) each rank's optimizer steps under
    ``torch.distributed.optim.ZeroRedundancyOptimizer`` with one param group: largest first
    (equal sizes in their order), each to the rank that holds the fewest elements so far (the
    lowest such rank). A tensor's state lives whole on one rank."""
    totals, out = [0] * world_size, [[] for _ in range(world_size)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = totals.index(min(totals))
        out[r].append(i)
        totals[r] += sizes[i]
    return out


def _tensor_state(spec: ModeSpec, size: int) -> int:
    """Bytes of one moment of a tensor of ``size`` elements kept whole, as mpext.optim keeps
    it: 8-bit codes and their block scales, or FP32 for a tensor under MIN_8BIT_NUMEL."""
    if not spec.state_block:
        return spec.state * size
    if size < MIN_8BIT_NUMEL:
        return _FP32 * size
    return spec.state * size + spec.state_meta * -(-size // spec.state_block)


def _torch_rank(spec: ModeSpec, k: int, n: int, sizes, shapes, zero: int, w: int, r: int,
                ema: bool, mpext_ema: bool, step_buffers: bool) -> Dict[str, int]:
    """The persistent rows of rank ``r`` under PyTorch's engines (``sharding='torch'``)."""
    if zero == 1:  # ZeroRedundancyOptimizer: whole tensors' state on one rank; model replicated
        mine = [sizes[i] for i in zero_partition(sizes, w)[r]]
        own = sum(mine)
        return dict(weights=spec.weight * n, gradients=spec.grad * n,
                    master_weights=spec.master * own,
                    optimizer_states=k * sum(_tensor_state(spec, s) for s in mine),
                    ema=0 if not ema else _FP32 * (own if mpext_ema else n),
                    step_buffers=_FP32 * own if step_buffers else 0)
    shapes = shapes or [(n,)]
    shards = [fsdp2_shard(shape, w, r) for shape in shapes]
    own, padded = sum(s for s, _ in shards), sum(p for _, p in shards)
    states = sum(_shard_state(spec, shape, mine, w, r) for shape, (mine, _) in zip(shapes, shards))
    return dict(weights=spec.weight * padded, gradients=spec.grad * padded,
                master_weights=spec.master * own, optimizer_states=k * states,
                ema=0 if not ema else _FP32 * (own if mpext_ema else padded), step_buffers=0)


def _shard_state(spec: ModeSpec, shape: Sequence[int], mine: int, w: int, r: int) -> int:
    """Bytes of one moment of rank ``r``'s FSDP2 shard (``mine`` elements) of a tensor of
    ``shape``: 8-bit codes with the scales of every block of the whole tensor the shard
    touches (mpext.optim._q8_shards), or FP32 for a tensor under MIN_8BIT_NUMEL, or the
    format's bytes per element."""
    size = math.prod(shape)
    if not spec.state_block or size < MIN_8BIT_NUMEL:
        return (_FP32 if spec.state_block else spec.state) * mine
    if mine == 0:
        return 0
    start = r * fsdp2_shard(shape, w, 0)[0]  # every shard before r is a full chunk
    touched = (start + mine - 1) // spec.state_block - start // spec.state_block + 1
    return spec.state * mine + spec.state_meta * touched


# ---- Gradient release on a mesh: the gradients alive during a backward ------------------------
#
# Both figures follow the live `.grad` storages of one rank as each gradient completes (what a
# post-accumulate-grad hook registered before the release's sees: benchmarks/bench_distributed.py
# --mode release, tests/test_memory_release.py).

MB = 1024 * 1024  # DDP's "MB" (torch.nn.parallel.distributed._MB_TO_BYTES)
DDP_BUCKET_CAP_MB = 25  # DDP's default bucket_cap_mb
DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # DDP's first bucket when bucket_cap_mb is its default


def default_units(count: int) -> List[List[int]]:
    """FSDP2 units when none are given: every tensor its own, the last reduced first (the
    reverse of the forward, for a chain listed in forward order)."""
    return [[i] for i in reversed(range(count))]


def check_order(name: str, groups, count: int) -> List[List[int]]:
    """``groups``: lists of the indices 0..count-1, each exactly once (a ValueError naming
    ``name`` otherwise)."""
    try:
        out = [[int(i) for i in g] for g in groups]
    except TypeError:
        raise TypeError("%s: must be lists of param indices, got %r" % (name, groups)) from None
    flat = sorted(i for g in out for i in g)
    if flat != list(range(count)):
        raise ValueError("%s: must name every one of the %d params once (indices 0..%d), got "
                         "%r" % (name, count, count - 1, groups))
    return out


def fsdp2_release_peak(grad: int, shapes: Sequence[Sequence[int]], w: int, r: int,
                       bucket_bytes: int, units: Sequence[Sequence[int]]) -> int:
    """The largest sum of rank ``r``'s live sharded ``.grad`` storages during a released
    FSDP2 backward, as each gradient completes. FSDP2 reduces a unit's gradients into one
    flat output of the unit's padded chunks (``grad`` bytes an element: the param's dtype),
    which each of the unit's sharded gradients views (so it is alive while one of them is),
    and runs each param's hooks in the unit's order, the units last first. The release buckets
    the params by the whole gradient's bytes over the mesh size, the same on every rank
    (``GradRelease._grad_bytes``), and frees a bucket's gradients once its bytes reach
    ``bucket_bytes`` (the rest at the end of the backward)."""
    unit_of = {i: u for u, unit in enumerate(units) for i in unit}
    storage = [grad * sum(fsdp2_shard(shapes[i], w, r)[1] for i in unit) for unit in units]
    alive = [0] * len(units)  # live gradients of each unit
    peak, pending, bucket = 0, 0, []
    for unit in units:
        for i in unit:
            alive[unit_of[i]] += 1
            peak = max(peak, sum(s for s, a in zip(storage, alive) if a))
            bucket.append(i)
            pending += math.prod(shapes[i]) * grad // w
            if pending >= bucket_bytes:
                for j in bucket:
                    alive[unit_of[j]] -= 1
                bucket, pending = [], 0
    return peak


def ddp_buckets(grad: int, sizes: Sequence[int], order: Sequence[int], cap: int,
                first: int) -> List[List[int]]:
    """DDP's buckets from its second iteration on (the Reducer rebuilds them in the order the
    gradients became ready): params in ``order`` added to a bucket until its bytes reach its
    limit (``first`` for the first bucket, ``cap`` after), as
    ``torch.distributed._compute_bucket_assignment_by_size`` (one dtype)."""
    out, cur, size = [], [], 0
    for i in order:
        cur.append(i)
        size += grad * sizes[i]
        if size >= (first if not out else cap):
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def ddp_release_peak(grad: int, sizes: Sequence[int], order: Sequence[int], cap: int,
                     first: int) -> int:
    """The largest sum of one rank's live ``.grad`` storages during a released DDP backward:
    each gradient lives from its accumulation until its DDP bucket's all-reduce (the release's
    comm hook points it at the averaged bucket, steps and frees it), and the buckets fill in
    ``order``, so it is the largest bucket's gradients."""
    return max((grad * sum(sizes[i] for i in b) for b in ddp_buckets(grad, sizes, order, cap,
                                                                     first)), default=0)
