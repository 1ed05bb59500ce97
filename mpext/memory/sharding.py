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
