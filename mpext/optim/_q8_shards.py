"""Blocked moments (the 8-bit code: mpext.optim.formats' ``BlockCodeFormat``) of sharded
(DTensor) params -- FSDP2, HSDP -- coded on the whole param's blocks, so that a sharded run holds,
on any mesh, the codes, scales and params of one process. The mesh mechanics only: which keys
are per element and per block, and the codec, are the format's (it calls these with them).

The blocks of an 8-bit moment lie on the param's whole flattened index: block j is elements
[j B, (j + 1) B) of the unsharded param, whatever the mesh. A rank keeps the codes of its shard
and the scales of every block its shard touches (:class:`ShardBlocks`). A block inside one
shard is stepped where it lies, as one process steps it. A block that two or more shards share
is stepped whole by every rank that holds a part of it: before the step one all-reduce over the
shard group -- a sum of bytes that each rank fills only where it holds the block, so exact --
gives those ranks the block's params, gradients, masters or remainders, codes and EMA; the
same step op runs on that copy with the block's global offset and scale (the same inputs on
every rank, so the same bits), and each rank keeps its own part (:class:`SharedBlocks`). The
collective runs at every step on every rank of the group, a skipped step included (the op then
writes nothing), with no host synchronisation; it carries at most one block per shard boundary
and param.

For checkpoints the scales are given whole (:func:`global_scales`: a Replicate DTensor of every
block's scale), so that DCP moves codes (sharded as the param) and scales to any mesh exactly;
:func:`local_scales` takes this rank's part back.
"""
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from .._common import same_layout
from ._tensors import F32, flat_view, is_dtensor, local, shard_offset


def q8_blocks(n: int, block: int) -> int:
    """The number of blocks of ``block`` elements that cover n elements."""
    return -(-n // block)


class ShardBlocks(NamedTuple):
    """Where a param's 8-bit blocks lie relative to this rank's shard (element and block
    indices of the whole param)."""
    numel: int  # the whole param's
    block: int
    start: int  # this rank's shard: elements [start, stop)
    stop: int
    first: int  # the first block the shard touches: its scales are blocks [first, first + count)
    count: int
    inner: Tuple[int, int]  # the blocks [lo, hi) wholly inside the shard
    shared: Tuple[int, ...]  # every block that two or more shards share (the same on all ranks)
    group: Any  # the process group of the shards (None when there is one shard)

    def span(self, j: int) -> Tuple[int, int]:
        """Block j's elements [begin, end) in the whole param."""
        return j * self.block, min((j + 1) * self.block, self.numel)


_LAYOUTS: Dict[tuple, ShardBlocks] = {}


def unsupported(p: torch.Tensor) -> Optional[str]:
    """Why a DTensor param's 8-bit blocks cannot be laid on its whole index (None: they can):
    its shards must be runs of the whole param's memory split along one mesh dimension --
    Replicate, and Shard(0) on at most one mesh dimension (FSDP2, HSDP), dim 0 outermost."""
    placements = tuple(p.placements)
    sharded = [d for d, pl in enumerate(placements) if not pl.is_replicate()]
    if shard_offset(p) is None or len(sharded) > 1:
        return ("it is a DTensor placed as %s on a mesh of shape %s (sizes %s, strides %s); "
                "8-bit moments of a DTensor param need Replicate and Shard(0) on at most one "
                "mesh dimension (FSDP2, HSDP) with dim 0 outermost in memory: use BF16 "
                "moments for this placement" % (placements, tuple(p.device_mesh.shape),
                                                tuple(p.shape), tuple(p.stride())))
    return None


def shard_blocks(p: torch.Tensor, block: int) -> ShardBlocks:
    """The :class:`ShardBlocks` of a DTensor param (its placement is one :func:`unsupported`
    accepts) for blocks of ``block`` elements; kept per shape, mesh and placement."""
    mesh, placements = p.device_mesh, tuple(p.placements)
    key = (tuple(p.shape), tuple(p.stride()), mesh, placements, block)
    layout = _LAYOUTS.get(key)
    if layout is not None:
        return layout
    n = p.numel()
    nblocks = q8_blocks(n, block)
    sharded = [d for d, pl in enumerate(placements) if not pl.is_replicate()]
    if not sharded or n == 0:
        layout = ShardBlocks(n, block, 0, n, 0, nblocks, (0, nblocks), (), None)
    else:
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
        dim = sharded[0]
        row = n // p.shape[0]
        coord = list(mesh.get_coordinate())
        starts = []
        for i in range(mesh.size(dim)):
            coord[dim] = i
            _, offset = _compute_local_shape_and_global_offset(p.shape, mesh.shape, coord,
                                                               placements)
            starts.append(min(int(offset[0]) * row, n))
        start = starts[mesh.get_coordinate()[dim]]
        stop = start + local(p).numel()
        if start != shard_offset(p):
            raise RuntimeError("mpext.optim: the shard offsets computed for a %s DTensor do "
                               "not match its own (%d, %d): this torch's sharding is not the "
                               "one mpext knows" % (placements, start, shard_offset(p)))
        shared = tuple(sorted({s // block for s in starts if 0 < s < n and s % block}))
        if start == stop:
            first, count, inner = start // block, 0, (start // block,) * 2
        else:
            first, last = start // block, (stop - 1) // block
            lo = -(-start // block)
            hi = last + 1 if min((last + 1) * block, n) <= stop else last
            first, count, inner = first, last - first + 1, (lo, max(lo, hi))
        layout = ShardBlocks(n, block, start, stop, first, count, inner, shared,
                             mesh.get_group(dim))
    _LAYOUTS[key] = layout
    return layout


# A shard's scales do not tell the block size they were made for by their number (a shard
# touches one block of 256 as of 512): mpext's own scales tensors carry it.
_BLOCK_ATTR = "_mpext_block_size"


def tag(scales: torch.Tensor, block: int) -> torch.Tensor:
    """``scales`` (this rank's, of a DTensor param), marked as made for ``block``."""
    setattr(scales, _BLOCK_ATTR, block)
    return scales


def block_of(p: torch.Tensor, scales: torch.Tensor, block: int, where: str) -> int:
    """The block size a DTensor param's local scales were made for (:func:`tag`); untagged
    scales are taken as the group's ``block`` if their number fits it, else refused."""
    had = getattr(scales, _BLOCK_ATTR, None)
    if had is not None:
        return had
    if scales.numel() == local_count(p, block):
        return block
    raise ValueError("%s: its 8-bit scales (%d) are not this rank's scales of blocks of %d "
                     "elements (%d); load sharded 8-bit state through load_state_dict"
                     % (where, scales.numel(), block, local_count(p, block)))


def local_count(p: torch.Tensor, block: int) -> int:
    """The number of scales this rank keeps for a param: every block its shard touches."""
    if is_dtensor(p):
        return shard_blocks(p, block).count
    return q8_blocks(p.numel(), block)


# ---- Conversions: decode a shard, encode a DTensor, scales whole and back ---------------------

def _like(p: torch.Tensor, local_value: torch.Tensor) -> torch.Tensor:
    """A DTensor placed as ``p`` whose local shard is ``local_value`` (p's local shape)."""
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local_value, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def decode_shard(p: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 block: int, decode: Any) -> torch.Tensor:
    """The FP32 values (exact, a DTensor placed as ``p``) of a DTensor param's local codes and
    local scales (blocks of ``block`` elements on the whole index), by the format's ``decode``
    (codes, scales) -> values."""
    lay = shard_blocks(p, block)
    mine = local(codes)
    pad = lay.start - lay.first * block
    flat = torch.zeros(lay.count * block, dtype=mine.dtype, device=mine.device)
    flat[pad:pad + mine.numel()] = flat_view(mine)
    values = decode(flat, scales)[pad:pad + mine.numel()]
    out = torch.empty_like(mine, dtype=F32)
    flat_view(out).copy_(values)
    return _like(p, out)


def encode_whole(p: torch.Tensor, value: torch.Tensor, dtype: torch.dtype,
                 block: int, encode: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """The codes (a DTensor placed as ``p``) and this rank's scales of FP32 ``value`` (placed as
    ``p``), by the format's ``encode`` (values, dtype, block) -> (codes, scales), on the whole
    param's blocks: the value is gathered (a collective: every rank of the mesh calls this for
    the param at once)."""
    lay = shard_blocks(p, block)
    codes, scales = encode(value.full_tensor(), dtype, block)
    mine = torch.empty_like(local(p), dtype=dtype)
    flat_view(mine).copy_(flat_view(codes)[lay.start:lay.stop])
    return _like(p, mine), tag(scales[lay.first:lay.first + lay.count].clone(), block)


def global_scales(p: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """Every block's scale of a DTensor param, from each rank's: a Replicate DTensor on the
    param's mesh (a collective over the shard group; each block is taken from the rank whose
    shard holds its first element, bit for bit)."""
    from torch.distributed.tensor import DTensor, Replicate
    import torch.distributed as dist
    lay = shard_blocks(p, block)
    whole = torch.zeros(q8_blocks(lay.numel, block), dtype=F32, device=scales.device)
    if lay.count:
        lo = -(-lay.start // block)  # blocks whose first element is in the shard
        hi = lay.first + lay.count
        whole[lo:hi] = scales[lo - lay.first:]
    if lay.group is not None:
        bits = whole.view(torch.int32)
        dist.all_reduce(bits, group=lay.group)  # one nonzero term per block: exact
    return DTensor.from_local(whole, p.device_mesh, [Replicate()] * p.device_mesh.ndim,
                              run_check=False)


def local_scales(p: torch.Tensor, whole: torch.Tensor, block: int) -> torch.Tensor:
    """This rank's scales (a new plain tensor, tagged) from every block's (a plain tensor or a
    Replicate DTensor)."""
    if is_dtensor(whole):
        whole = whole.full_tensor()
    lay = shard_blocks(p, block)
    return tag(whole[lay.first:lay.first + lay.count].detach().to(
        device=local(p).device, dtype=F32, copy=True), block)


# ---- The step: blocks two shards share -------------------------------------------------------

def _slots(sizes: List[int]) -> Tuple[List[int], int]:
    """Byte offsets of consecutive slots of these sizes, each 64-byte aligned, and the total."""
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += -(-size // 64) * 64
    return offsets, at


class SharedBlocks:
    """The exchange of one step: built by :func:`split` from the step's items, it replaces each
    sharded 8-bit param by its inner blocks and a copy of every shared block its shard touches;
    :meth:`gather` fills the copies (the collective), the step op runs on the items, and
    :meth:`scatter` writes each rank's part of the copies back."""

    def __init__(self) -> None:
        self.buffers: List[Tuple[torch.Tensor, Any]] = []  # (bytes, group)
        # fill's (copy part, local part) pairs as two lists, the foreach call's arguments: a
        # cached step (mpext.optim._shard_plan) writes each step's gradient parts into parts
        self.copies: List[torch.Tensor] = []
        self.parts: List[torch.Tensor] = []
        self.steps: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (copy's step, param's)
        # the same, per buffer: (the copies' steps as one 1-D tensor, the params' steps)
        self.step_sets: List[Tuple[torch.Tensor, List[torch.Tensor]]] = []
        # The fill entries whose local part is a gradient's, as (index in fill, index of the
        # param's item in split's input, [a, b) of its flat local gradient).
        self.grad_fills: List[Tuple[int, int, int, int]] = []
        self._cached: Optional[tuple] = None  # _lists()

    @property
    def fill(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(copy part, local part) per array of every block copy this rank fills."""
        return list(zip(self.copies, self.parts))

    def gather(self) -> None:
        for work in self.start():
            work.wait()

    def _lists(self) -> tuple:
        # scatter's foreach argument lists without the gradients' entries, made once for a
        # cached step's exchange (the long way makes a new exchange per step)
        if self._cached is None:
            grads = {at for at, _, _, _ in self.grad_fills}
            kept = [at for at in range(len(self.copies)) if at not in grads]
            self._cached = ([self.copies[at] for at in kept], [self.parts[at] for at in kept])
        return self._cached

    def start(self) -> list:
        """:meth:`gather` begun: the copies filled and their all-reduce under way; returns its
        works, to ``wait()`` on before the copies are stepped (the inner blocks, which the
        exchange does not touch, may be stepped meanwhile)."""
        import torch.distributed as dist
        for buf, _ in self.buffers:
            buf.zero_()
        # One foreach call per list instead of a copy_ per array: each part is copied alone
        # either way (the same bytes), at a fraction of the host time.
        if self.copies:
            torch._foreach_copy_(self.copies, self.parts)
        for own, steps in self.step_sets:
            if steps:
                torch.stack(steps, out=own)
        # Every byte is nonzero on one rank at most, so the sum of the 32-bit words is their
        # OR: exact, never carrying; as words it is a third of a byte sum's time over gloo
        # (the buffer is whole 64-byte slots).
        return [dist.all_reduce(buf.view(torch.int32), group=group, async_op=True)
                for buf, group in self.buffers]

    def scatter(self, grads: bool = True) -> None:
        """Writes each rank's part of the stepped copies back; ``grads=False`` leaves out the
        gradients' parts, which the op wrote nothing into (no ``inv_scale``: they hold what
        fill copied)."""
        copies, parts = (self.copies, self.parts) if grads else self._lists()
        if copies:
            torch._foreach_copy_(parts, copies)


def out_of_param_order(item: Any) -> bool:
    """Whether a blocked item's gradient lies in another memory order than its param's."""
    return item.blocks is not None and not same_layout(item.grad, item.param)


def grads_in_param_order(items: List[Any]) -> Tuple[List[Any], List[Tuple[torch.Tensor,
                                                                             torch.Tensor]]]:
    """The items with each blocked item's gradient in its param's memory order, and the
    (gradient, copy) pairs to write the unscaled values back into after the step. The split
    cuts a param and its gradient at the same flat positions (:func:`flat_view`), so a gradient
    laid out otherwise (a hand-made DTensor gradient: FSDP2 makes none) paired other elements
    with each param element; it is stepped through a copy in the param's layout instead, as the
    unsplit step does (``_engine._plan_calls``)."""
    out, copied = [], []
    for it in items:
        if out_of_param_order(it):
            copy = torch.empty_like(it.param, dtype=it.grad.dtype).copy_(it.grad)
            copied.append((it.grad, copy))
            it = it._replace(grad=copy)
        out.append(it)
    return out, copied


def _arrays(item: Any, state: Dict[str, torch.Tensor]) -> List[Tuple[str, torch.Tensor]]:
    """The per-element arrays of an item the step reads or writes, as flat local views:
    ("param", ...), ("grad", ...), ("storage", ...), the moments' per-element state entries by
    key (the format's: ``item.blocks.element_keys``), and ("ema_param", ...)."""
    out = [("param", flat_view(item.param)), ("grad", flat_view(item.grad))]
    if item.storage is not None:
        out.append(("storage", flat_view(item.storage)))
    for key in item.blocks.element_keys:
        out.append((key, flat_view(local(state[key]))))
    if state.get("ema_param") is not None:
        out.append(("ema_param", flat_view(local(state["ema_param"]))))
    return out


_ITEM_ARRAYS = ("param", "grad", "storage")  # the arrays an item holds outside its state


def split(items: List[Any]) -> Tuple[List[Any], Optional[SharedBlocks]]:
    """The step's items with every sharded 8-bit param (an item with ``blocks``) replaced by
    its inner blocks and its copies of shared blocks, and the :class:`SharedBlocks` that fills
    them (None when no item has blocks)."""
    out, ex, _ = split_bound(items)
    return out, ex


GradSource = Tuple[int, Any]


def split_bound(items: List[Any]) -> Tuple[List[Any], Optional[SharedBlocks],
                                           List[GradSource]]:
    """:func:`split`, and, for each output item, the index ``i`` in ``items`` of the param it
    steps and where its gradient comes from, so that a cached step can point the same items
    at the next step's gradients: ``(i, None)``, the gradient of ``items[i]`` as it is;
    ``(i, (a, b))``, elements [a, b) of its flat view; ``(i, "buffer")``, a copy in the
    exchange's buffer (filled through ``SharedBlocks.grad_fills``)."""
    if not any(it.blocks is not None for it in items):
        return items, None, [(i, None) for i in range(len(items))]
    ex = SharedBlocks()
    out, sources = [], []
    groups: Dict[tuple, List[tuple]] = {}  # (group, device) -> [(item, arrays, step)]
    for i, it in enumerate(items):
        if it.blocks is None:
            out.append(it)
            sources.append((i, None))
            continue
        lay = it.blocks.layout
        device = it.param.device
        step = it.state["step"]  # a float32 scalar on the device (fused_step made it one)
        arrays = _arrays(it, it.state)
        scale_keys = it.blocks.block_keys
        # The inner blocks, in place: the param's own step and a slice of its scales.
        lo, hi = lay.inner
        a, b = (lay.span(lo)[0], lay.span(hi - 1)[1]) if hi > lo else (lo * lay.block,) * 2
        a, b = a - lay.start, b - lay.start
        if lay.count == 0:
            a = b = 0
        # An empty piece gets no op entry (its host cost is a full entry's) unless it is all
        # the rank steps of the param (an empty shard): then it alone advances the step.
        inner = b > a or not any(max(lay.span(j)[0], lay.start) < min(lay.span(j)[1], lay.stop)
                                 for j in lay.shared)
        if inner:
            views = dict((k, v[a:b]) for k, v in arrays)
            state = {"step": step}
            for k in scale_keys:
                state[k] = it.state[k][lo - lay.first:hi - lay.first]
            out.append(_item(it, views, state, lo * lay.block))
            sources.append((i, (a, b)))
        if lay.shared:
            groups.setdefault((lay.group, device), []).append((i, it, arrays, step,
                                                               scale_keys, inner))
    for (group, device), members in groups.items():
        sizes, where = [], []
        for _, it, arrays, step, scale_keys, _ in members:
            lay = it.blocks.layout
            for j in lay.shared:
                begin, end = lay.span(j)
                for k, v in arrays:
                    sizes.append((end - begin) * v.element_size())
                    where.append((it, j, k, v))
        offsets, total = _slots(sizes)
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        ex.buffers.append((buf, group))
        copies: Dict[tuple, Dict[str, torch.Tensor]] = {}
        for at, size, (it, j, k, v) in zip(offsets, sizes, where):
            copies.setdefault((id(it), j), {})[k] = buf[at:at + size].view(v.dtype)
        # The copies' own steps (where another entry advances the param's), elements of one
        # tensor that start() fills with one stack instead of a copy per step.
        touched = [sum(max(lay.span(j)[0], lay.start) < min(lay.span(j)[1], lay.stop)
                       for j in lay.shared) - (not stepped)
                   for lay, stepped in ((m[1].blocks.layout, m[5]) for m in members)]
        own_steps = torch.empty(sum(touched), dtype=torch.float32, device=device)
        ex.step_sets.append((own_steps, []))
        for i, it, arrays, step, scale_keys, stepped in members:
            lay = it.blocks.layout
            for j in lay.shared:
                begin, end = lay.span(j)
                lo, hi = max(begin, lay.start), min(end, lay.stop)
                if lo >= hi:
                    continue  # a block of other shards only: filled and stepped by them
                views = copies[(id(it), j)]
                for k, v in arrays:
                    if k == "grad":
                        ex.grad_fills.append((len(ex.copies), i, lo - lay.start, hi - lay.start))
                    ex.copies.append(views[k][lo - begin:hi - begin])
                    ex.parts.append(v[lo - lay.start:hi - lay.start])
                if stepped:  # the step is advanced by another entry: this one reads a copy
                    sources_of = ex.step_sets[-1][1]
                    own = own_steps[len(sources_of)]
                    sources_of.append(step)
                    ex.steps.append((own, step))
                    state = {"step": own}
                else:  # no inner entry: the first copy advances the param's step
                    state = {"step": step}
                    stepped = True
                for k in scale_keys:
                    state[k] = it.state[k][j - lay.first:j - lay.first + 1]
                out.append(_item(it, views, state, begin))
                sources.append((i, "buffer"))
    return out, ex, sources


def _item(it: Any, views: Dict[str, torch.Tensor], state: Dict[str, torch.Tensor],
          offset: int) -> Any:
    """A step item over ``views`` (by array name) with ``state``'s step and scales: the
    param's stream and hyperparameters, the given global offset, no blocks."""
    for k, v in views.items():
        if k not in _ITEM_ARRAYS:  # a moment's per-element entry, or the EMA
            state[k] = v
    return it._replace(param=views["param"], grad=views["grad"],
                       storage=views.get("storage"), state=state, offset=offset, blocks=None)
