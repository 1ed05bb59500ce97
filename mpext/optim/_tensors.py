"""Where a state tensor lives: DTensor shards and memory order. The helpers every other module
of mpext.optim uses to make a tensor in a param's device, layout and placement; no format and
no rule knowledge here."""
from typing import Any, Optional

import torch

from .._common import is_dtensor

F32 = torch.float32


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself, sharing memory), or a plain tensor as is."""
    if is_dtensor(t):
        if not torch.is_grad_enabled():  # the step's case: no_grad's enter and exit cost more
            return t.to_local()          # than to_local itself
        with torch.no_grad():
            return t.to_local()
    return t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor a DTensor keeps as its local shard, itself (a plain tensor as is): the same
    object at every call, where ``to_local()`` of a DTensor Parameter (FSDP2's params) makes a
    new view at every call. What a cached step compares (is the shard the one it planned for?)
    and reads each step's gradient through, at the cost of an attribute read."""
    inner = getattr(t, "_local_tensor", None)
    if inner is None or not is_dtensor(t):
        return local(t)
    return inner


def shard_offset(t: torch.Tensor) -> Optional[int]:
    """The position, in the whole tensor's memory order, of the first element of a DTensor's
    local shard (0 for a plain tensor): what the kernels add to an element's position in the
    shard so that its random bits are the unsharded tensor's. None when the shard is not one
    run of the whole tensor's memory: a placement other than Replicate and Shard(0) (FSDP2 on
    one mesh dimension, HSDP's replicate x shard, ...), or a dim 0 that is not outermost."""
    if not is_dtensor(t):
        return 0
    placements = tuple(t.placements)
    key = (tuple(t.shape), tuple(t.stride()), t.device_mesh, placements)
    if key in _OFFSETS:  # computed from the placement at every step otherwise (~50 us)
        return _OFFSETS[key]
    from torch.distributed.tensor import Shard  # imported already: t is a DTensor
    if all(pl.is_replicate() for pl in placements):
        offset = 0
    elif not all(pl.is_replicate() or (type(pl) is Shard and pl.dim == 0)
                 for pl in placements) or (t.size(0) > 1
                                          and t.stride(0) * t.size(0) != t.numel()):
        offset = None
    else:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        _, start = compute_local_shape_and_global_offset(t.shape, t.device_mesh, placements)
        offset = int(start[0]) * t.stride(0) if start else 0
    _OFFSETS[key] = offset
    return offset


_OFFSETS: dict = {}  # shard_offset's, per shape, strides, mesh and placements


def copy_like(param: torch.Tensor, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor of ``dtype`` in the param's device and memory layout, holding ``src``. For
    a DTensor param the copy is a DTensor placed as the param, and ``src`` may be a DTensor
    placed otherwise (redistributed) or a plain tensor of the param's global shape (each rank
    keeps its own shard, without communication)."""
    out = torch.empty_like(param, dtype=dtype, memory_format=torch.preserve_format)
    src = src.detach()
    if is_dtensor(out):
        if not is_dtensor(src):
            from torch.distributed.tensor import distribute_tensor
            src = distribute_tensor(src.to(out.device), out.device_mesh, out.placements,
                                    src_data_rank=None)
        elif src.device_mesh != out.device_mesh or src.placements != out.placements:
            src = src.redistribute(out.device_mesh, out.placements)
    elif is_dtensor(src):
        src = src.full_tensor()
    return out.copy_(src)


def fp32_copy(param: torch.Tensor, src: Optional[torch.Tensor] = None) -> torch.Tensor:
    """An fp32 :func:`copy_like` of ``src`` (default: the param itself)."""
    return copy_like(param, param if src is None else src, F32)


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements in memory order, as a 1-D view: the order of the kernel's
    blocks."""
    if t.is_contiguous():
        return t.view(-1)
    order = sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d)), reverse=True)
    return t.permute(order).view(-1)


def same_memory_order(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two dense tensors of one shape hold their elements in the same memory order
    (what :func:`flat_view` walks)."""
    if a.stride() == b.stride():
        return True
    index = torch.arange(a.numel(), device=a.device).view(a.shape)
    order = [flat_view(torch.empty_like(t, dtype=torch.int64).copy_(index)) for t in (a, b)]
    return torch.equal(*order)
