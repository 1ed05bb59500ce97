"""The inf/NaN flags (``found_inf``) of mpext.GradScaler across devices and ranks: combining
several into one, and the all-reduce (MAX) over the mesh dimensions a DTensor gradient is
sharded on and over a process group (``sync_found_inf``), as torch's DTensor rule for
``_amp_foreach_non_finite_check_and_unscale_`` reduces them (docs/distributed.md)."""
from typing import List

import torch

try:
    import torch.distributed as dist
except ImportError:  # a torch built without distributed support
    dist = None


def check_process_group(group, what: str) -> None:
    if group is None:
        return
    if dist is None or not isinstance(group, dist.ProcessGroup):
        raise TypeError("%s must be None or a torch.distributed.ProcessGroup, got %s"
                        % (what, type(group).__name__))


def note_mesh(t, mesh_dims: List[tuple]) -> None:
    """Adds (mesh, the mesh dims t is not replicated on) to mesh_dims if new: the dims where
    the shards of a gradient differ, over which torch's DTensor rule takes found_inf's MAX."""
    from torch.distributed.tensor import Replicate  # imported already: t is a DTensor
    dims = tuple(i for i, p in enumerate(t.placements) if not isinstance(p, Replicate))
    if dims:
        key = (t.device_mesh, dims)
        if key not in mesh_dims:
            mesh_dims.append(key)


# Flag dtypes every backend (gloo, NCCL) reduces with MAX; torch's found_inf is float32.
REDUCIBLE = (torch.float32, torch.float64, torch.int32, torch.int64)


def all_reduce_max(flag: torch.Tensor, group) -> None:
    if flag.dtype in REDUCIBLE:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    else:
        tmp = flag.to(torch.float32)
        dist.all_reduce(tmp, op=dist.ReduceOp.MAX, group=group)
        flag.copy_(tmp)


def combine(found_infs: List[torch.Tensor]) -> torch.Tensor:
    """The sum of several found_inf flags on one device, as a new tensor (torch adds in place
    into the first, which would change an optimizer's recorded flag)."""
    if len(found_infs) == 1:
        return found_infs[0]
    return torch.stack(found_infs).sum()
