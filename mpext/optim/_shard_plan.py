"""The cached step of DTensor params (FSDP2, HSDP, DTensor models): a :class:`StepPlan` whose
op calls are those :func:`~mpext.optim._engine.fused_step` makes after the 8-bit shard split
(:func:`mpext.optim._q8_shards.split_bound`), kept between steps together with the split's
exchange (its buffer and the views it copies). A step then reads each param's new gradient
through its local shard, checks that what the plan was made from still holds, and points the
planned items at the gradient: the whole local gradient, a slice of its flat view (an 8-bit
param's inner blocks) or an entry of the exchange's fill (a block two shards share).

Without it every step rebuilt the local views of every param and state tensor, the 8-bit
split and the launch lists: several times the kernel's time under FSDP2.
"""
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from . import _q8_shards as q8_shards
from ._engine import StepPlan, _PlannedCall, _lr_key, _plan_calls, device_step, planned_launch
from ._engine import fused_step, run_launches
from .._common import dtensor_type
from ._tensors import is_dtensor, local_tensor


_STRIDED = torch.strided


class _Owner:
    """A param of the plan and what its planned entries were made from."""
    __slots__ = ("param", "state", "ids", "dtype", "shard", "spec", "placement", "held",
                 "grad_dtype", "grad_shape", "grad_stride", "device", "whole", "pieces")


class _ShardCall(_PlannedCall):
    # sources: per entry, (owner index, None | (a, b) | "buffer"); batch: 0, stepped in place,
    # 1, the exchange's copies; lr_key: its learning-rate buffer's key
    __slots__ = ("sources", "batch", "lr_key")


def _spec(t: torch.Tensor) -> Any:
    # DTensor's spec object: FSDP2 gives a param and each step's gradient the same one, so
    # that identity is the cheap check; a differing one is compared by its parts.
    return getattr(t, "_spec", None)


def _placement(t: torch.Tensor) -> tuple:
    """What a DTensor's shards depend on: its mesh, placements, global sizes and strides."""
    return t.device_mesh, tuple(t.placements), tuple(t.shape), t.stride()


class ShardedStepPlan(StepPlan):
    """A :class:`StepPlan` over params some of which are DTensors (built by the optimizer's
    ``_new_plan``): :meth:`refresh` reads and checks the gradients, :meth:`run` fills the
    exchange of shared 8-bit blocks, launches and writes the exchange back -- what
    ``fused_step`` does with the same items (those stepped in place while the exchange's
    all-reduce runs, then its copies), so the same bits."""

    def __init__(self, calls: List[_ShardCall], idle: List[torch.Tensor],
                 owners: List[_Owner], shared: Optional[q8_shards.SharedBlocks]) -> None:
        super().__init__(calls, idle)
        self.owners, self.shared = owners, shared
        self.size = len(owners)
        # Where each param's gradient goes, written by refresh into lists the launches and
        # the exchange keep: whole, as (list, index); a run [a, a + n) of its flat local view,
        # as (list, index, a, n), made by one as_strided (refresh checks that the gradient has
        # the planned shape and strides, so it is dense and its flat view starts at its
        # storage offset: the slice of a flat view, without making the view).
        for o in owners:
            o.whole, o.pieces = [], []
        for c in calls:
            c.grads = list(c.grads)
            for k, (i, where) in enumerate(c.sources):
                if where is None:
                    owners[i].whole.append((c.grads, k))
                elif where != "buffer":
                    owners[i].pieces.append((c.grads, k, where[0], where[1] - where[0]))
        if shared is not None:
            for at, i, a, b in shared.grad_fills:
                owners[i].pieces.append((shared.parts, at, a, b - a))
        # Each such list with its gradients' entries None: what it holds between steps (no
        # gradient of the last step is kept alive by the plan past its step, as zero_grad's
        # set_to_none expects).
        cleared: Dict[int, tuple] = {}
        for o in owners:
            for t in o.whole + o.pieces:
                lst = t[0]
                cleared.setdefault(id(lst), (lst, list(lst)))[1][t[1]] = None
        self.cleared = list(cleared.values())

    @classmethod
    def build(cls, items: List[Any], owners: List[torch.Tensor], groups: List[dict],
              idle: List[torch.Tensor], lr_tensors: Any) -> Optional["ShardedStepPlan"]:
        """The plan of a step of ``items`` (``owners`` their params, ``groups`` their groups,
        ``idle`` the params without a gradient), or None where a gradient is stepped through a
        copy in its param's layout (those step the long way)."""
        if any(q8_shards.out_of_param_order(it) for it in items):
            return None  # a gradient in another memory order than its param's: the long way
        for it in items:  # as fused_step: the split shares the step with the copies
            if it.blocks is not None:
                device_step(it.state, it.param.device)
        out, shared, sources = q8_shards.split_bound(items)
        # Two batches of calls: the items stepped in place, which the exchange does not touch,
        # run while its all-reduce is under way; then the copies it fills. Their elements and
        # draws are the same as in one call, so are their bits.
        batches = ([i for i, src in enumerate(sources) if src[1] != "buffer"],
                   [i for i, src in enumerate(sources) if src[1] == "buffer"])
        calls = []
        for batch, where in enumerate(batches):
            if not where:
                continue
            sub = [out[i] for i in where]
            planned, _ = _plan_calls(sub, lr_tensors, None, None)
            for c in planned:
                positions = [where[k] for k in c.positions]
                if any(g is not out[i].grad for g, i in zip(c.args[1], positions)):
                    return None
                pc = _ShardCall()
                # args without the gradients (held by grads, each step's), so that the plan
                # keeps no gradient of this step alive
                pc.op, pc.args, pc.kwargs, pc.device, pc.slot = c.op, c.args[:1] + (None,) \
                    + c.args[2:], c.kwargs, c.device, c.slot
                # each batch's own learning-rate buffers (LrTensors keys), as _plan_calls
                # numbers its slots from 0
                pc.lr_key = (c.device, c.slot) if batch == 0 else (c.device, "copies", c.slot)
                pc.batch = batch
                pc.lr_at = len(c.args) - len(sub[c.positions[0]].hyper.rule_args()) - 1
                mine = [sources[i][0] for i in positions]
                pc.lr_groups = list({id(groups[k]): groups[k] for k in mine}.values())
                pc.lr_group = pc.lr_groups[0]
                pc.owners = [owners[k] for k in mine]
                pc.states = pc.ids = pc.dtypes = None  # checked per owner (self.owners)
                pc.grads = list(c.args[1])
                pc.sources = [sources[i] for i in positions]
                calls.append(pc)
        kept = []
        for p, it in zip(owners, items):
            o = _Owner()
            o.param, o.state, o.dtype = p, it.state, p.dtype
            o.ids = tuple(map(id, it.state.values()))
            o.held = [(t, local_tensor(t)) for t in it.state.values() if is_dtensor(t)]
            if is_dtensor(p):
                o.shard, o.spec, o.placement = local_tensor(p), _spec(p), _placement(p)
            else:
                o.shard = o.spec = o.placement = None
            g = it.grad  # the local gradient the long way stepped
            o.grad_dtype, o.grad_shape, o.grad_stride = g.dtype, g.shape, g.stride()
            o.device = g.device
            kept.append(o)
        return cls(calls, idle, kept, shared)

    def refresh(self, state_of: Callable[[torch.Tensor], Any]) -> bool:
        """Reads every param's gradient and points the planned entries at it; False if the
        plan no longer holds: a param without a gradient or one it did not plan for, a
        param whose dtype, state dict or state tensors changed, a DTensor param whose local
        shard or placement changed (resharded, moved, a new DTensor), a gradient placed,
        typed, shaped or laid out otherwise than the one planned for, or a learning rate
        that parts a launch's groups."""
        for c in self.calls:
            if len(c.lr_groups) > 1 and len({_lr_key(g["lr"]) for g in c.lr_groups}) > 1:
                return False
        # The owner loop is the cached step's host cost per param: local_tensor and _spec
        # inlined. (Without _local_tensor, a torch that renamed it, no plan holds: the long way.)
        dtensor = dtensor_type() or ()  # isinstance(x, ()) is False
        for o in self.owners:
            p = o.param
            g = p.grad
            st = o.state
            if g is None or p.dtype is not o.dtype or state_of(p) is not st \
                    or tuple(map(id, st.values())) != o.ids:
                return False
            if o.spec is not None:
                if (type(g) is not dtensor and not isinstance(g, dtensor)) \
                        or getattr(p, "_local_tensor", None) is not o.shard:
                    return False
                spec = getattr(p, "_spec", None)
                if spec is not o.spec and _placement(p) != o.placement:
                    return False
                if getattr(g, "_spec", None) is not spec and _placement(g) != _placement(p):
                    return False
                for t, inner in o.held:
                    if getattr(t, "_local_tensor", None) is not inner:
                        return False
                g = getattr(g, "_local_tensor", None)
                if g is None:
                    return False
            elif is_dtensor(g):
                return False
            if g.dtype is not o.grad_dtype or g.layout is not _STRIDED \
                    or g.shape != o.grad_shape or g.stride() != o.grad_stride \
                    or g.device != o.device:
                return False
            for grads, k in o.whole:
                grads[k] = g
            if o.pieces:
                base = g.storage_offset()
                for grads, k, a, n in o.pieces:
                    grads[k] = g.as_strided((n,), (1,), base + a)
        for p in self.idle:
            if p.grad is not None:
                return False
        return True

    def run(self, lr_tensors: Any, inv_scale: Optional[torch.Tensor],
            found_inf: Optional[torch.Tensor]) -> None:
        per_device: Dict[torch.device, tuple] = {}
        batches: Tuple[list, list] = ([], [])
        for c in self.calls:
            batches[c.batch].append(planned_launch(
                c, lr_tensors.get(c.lr_key, c.device, c.lr_group["lr"]), per_device,
                inv_scale, found_inf))
        try:
            self._launch(batches, inv_scale is not None)
        except (RuntimeError, ValueError, TypeError):
            if len(self.calls) > 1:  # refresh checked every gradient: not refused midway
                raise
            # Refused before anything was written, by something unplanned: the long way
            # names what is wrong.
            fused_step(self.owner()._long_items(), lr_tensors, inv_scale, found_inf)
        finally:
            for lst, cleared in self.cleared:
                lst[:] = cleared

    def _launch(self, batches: Tuple[list, list], unscaled: bool) -> None:
        shared = self.shared
        works = shared.start() if shared is not None else []
        try:
            run_launches(batches[0], [])
        finally:
            for work in works:  # never left pending, whatever happened
                work.wait()
        run_launches(batches[1], [])
        if shared is not None:
            # without an inv_scale the op wrote no gradient: its parts need no copy back
            shared.scatter(grads=unscaled)
