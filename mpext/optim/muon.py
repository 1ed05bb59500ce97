"""mpext.optim.muon: the Muon rule (``mpext.optim.Muon``): torch.optim.Muon's arguments, defaults
and update, its state (``momentum_buffer``), and its launch: two elementwise phases on the step
engine (``muon_momentum_step_``; ``muon_update_step_``: decay and update in every param format)
around Newton-Schulz through torch's BF16 matmuls. Param groups with ``use_muon=False`` are
stepped by AdamW (any mpext format) in the same optimizer, as Muon's recipe trains embeddings,
heads, norms and biases (:func:`muon_param_groups`). Everything else -- groups, formats,
state_dict, EMA, GradScaler protocol -- is mpext.optim._base's."""
import math
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

import torch

from .._common import LrTensors, is_real as _is_real
from ._base import FusedOptimizer
from ._engine import AdamHyper, StepItem, adam_hyper, fused_step, rule_hyper, storage_hyper
from ._engine import device_step
from ._tensors import F32, is_dtensor
from .formats import Quantity

__all__ = ["Muon", "muon_param_groups"]

# torch.optim.Muon's constants (Keller Jordan's coefficients).
EPS = 1e-7
DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5

_ADAM_MOMENTS = (Quantity("exp_avg", "exp_avg_dtype", True),
                 Quantity("exp_avg_sq", "exp_avg_sq_dtype", False))
_MUON_MOMENTS = (Quantity("momentum_buffer", "momentum_dtype", True),)


class MuonMomentumHyper(rule_hyper("_MuonMomentumFields", [("momentum", float),
                                                            ("nesterov", bool)])):
    """One ``muon_momentum_step_`` call's shared values (phase 1) besides device and learning
    rate, then the storage fields of :class:`~mpext.optim._engine.AdamHyper`."""
    __slots__ = ()
    op = "muon_momentum_step_"
    moment_lists = 1

    def quantities(self) -> tuple:
        return ("momentum_buffer",)

    def rule_args(self) -> tuple:
        return (self.momentum, self.nesterov)


class MuonUpdateHyper(rule_hyper("_MuonUpdateFields", [("lr_ratio", float),
                                                        ("weight_decay", float)])):
    """One ``muon_update_step_`` call's shared values (phase 3), then the storage fields."""
    __slots__ = ()
    op = "muon_update_step_"
    moment_lists = 0

    def quantities(self) -> tuple:
        return ()

    def rule_args(self) -> tuple:
        return (self.lr_ratio, self.weight_decay)


class MuonGroup(NamedTuple):
    """A Muon group's settings as its step reads them (hashable: the key of its launches)."""
    momentum: float
    nesterov: bool
    ns_coefficients: Tuple[float, float, float]
    eps: float
    ns_steps: int
    adjust_lr_fn: Optional[str]
    weight_decay: float
    ns_batched: bool
    storage: tuple  # storage_hyper(group)
    ns_sharded: str = "designated"  # a sharded param's NS: "designated" or "all_gather"


def adjust_lr_ratio(adjust_lr_fn: Optional[str], shape) -> float:
    """torch.optim.Muon's ``_adjust_lr`` as a factor of lr (Python doubles, as torch)."""
    a, b = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, a / b))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(a, b))
    return 1.0


def newton_schulz(x: torch.Tensor, coefficients, steps: int, eps: float) -> torch.Tensor:
    """torch.optim.Muon's ``_zeropower_via_newtonschulz`` over a matrix, or over a batch of
    same-shaped matrices (``x`` of shape (B, m, n)) with batched matmuls: BF16, the spectral
    norm brought to at most 1 by the Frobenius norm, ``steps`` quintic iterations."""
    a, b, c = coefficients
    y = x.bfloat16()
    tall = y.size(-2) > y.size(-1)
    if tall:
        y = y.mT
    if y.dim() == 2:
        y = y.div(y.norm().clamp(min=eps))
        for _ in range(steps):
            g = y @ y.T
            u = torch.addmm(g, g, g, beta=b, alpha=c)
            y = torch.addmm(y, u, y, beta=a)
    else:
        norms = torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True)
        y = y.div(norms.clamp(min=eps))
        for _ in range(steps):
            g = y @ y.mT
            u = torch.baddbmm(g, g, g, beta=b, alpha=c)
            y = torch.baddbmm(y, u, y, beta=a)
    return y.mT if tall else y


def _update_dtype(g: torch.Tensor) -> torch.dtype:
    # Phase 1 writes the update in BF16 (torch's .bfloat16() of its fp32 value, so NS reads the
    # same bits) where the kernel takes the gradient's dtype with it: an fp32 or bf16 gradient.
    return torch.bfloat16 if g.dtype in (F32, torch.bfloat16) else F32


def _gather(owner: Any, u: torch.Tensor) -> torch.Tensor:
    """The whole update of a DTensor param (FSDP2's Shard(0), HSDP, ...) from every rank's
    shard ``u``: an all-gather (in fp32 on the CPU, which gloo carries; exact both ways)."""
    from torch.distributed.tensor import DTensor
    src = u.float() if u.device.type == "cpu" else u
    whole = DTensor.from_local(src, owner.device_mesh, owner.placements, run_check=False,
                               shape=owner.shape, stride=owner.stride()).full_tensor()
    return whole.to(u.dtype)


def _own_shard(owner: Any, whole: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a whole (replicated) tensor, placed as the DTensor param ``owner``
    (a local chunk: no communication)."""
    from torch.distributed.tensor import DTensor, Replicate
    mesh = owner.device_mesh
    rep = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return rep.redistribute(mesh, owner.placements).to_local()


def _shard_dim(owner: Any) -> Optional[tuple]:
    """(process group, this rank's index in it, its size) of the one mesh dim over which the
    DTensor param ``owner`` is Shard(0), its other dims Replicate (FSDP2, HSDP); else None."""
    from torch.distributed.tensor import Replicate, Shard
    pls = owner.placements
    dims = [d for d, pl in enumerate(pls) if type(pl) is Shard and pl.dim == 0]
    if len(dims) != 1 or not all(type(pl) is Replicate for d, pl in enumerate(pls)
                                 if d != dims[0]):
        return None
    mesh = owner.device_mesh
    return mesh.get_group(dims[0]), mesh.get_local_rank(dims[0]), mesh.size(dims[0])


def _designated(owner: Any, u: torch.Tensor, k: int) -> tuple:
    """Starts the gather of the sharded update ``u`` (this rank's Shard(0) rows of ``owner``)
    to the rank k mod n of its shard group (round-robin over the step's params). The shards
    go padded to torch.chunk's piece (uneven ones, empty ones), in fp32 on the CPU (gloo
    carries it; exact). Returns (work, designated index, the pieces gathered there (None
    elsewhere), this rank's padded piece, group, this rank's index)."""
    import torch.distributed as dist
    pg, me, n = _shard_dim(owner)
    piece = -(-owner.shape[0] // n)  # torch.chunk's (DTensor's Shard(0)) rows per rank
    send = u.new_zeros((piece,) + tuple(u.shape[1:]),
                       dtype=F32 if u.device.type == "cpu" else u.dtype)
    send[:u.shape[0]] = u
    dst = k % n
    pieces = [torch.empty_like(send) for _ in range(n)] if me == dst else None
    work = dist.gather(send, pieces, dst=dist.get_global_rank(pg, dst), group=pg, async_op=True)
    return work, dst, pieces, send, pg, me


def _scatter_back(ortho: Optional[torch.Tensor], state: tuple) -> tuple:
    """Starts the scatter of the whole orthogonalised update ``ortho`` (on the designated
    rank; None elsewhere) into the ranks' padded pieces; returns (work, this rank's piece)."""
    import torch.distributed as dist
    _, dst, pieces, send, pg, me = state
    recv = torch.empty_like(send)
    chunks = None
    if me == dst:
        whole = ortho.to(recv.dtype)
        pad = whole.new_zeros((send.shape[0] * len(pieces) - whole.shape[0],)
                              + tuple(whole.shape[1:]))
        chunks = list(torch.cat([whole, pad]).split(send.shape[0]))
    work = dist.scatter(recv, chunks, src=dist.get_global_rank(pg, dst), group=pg,
                        async_op=True)
    return work, recv


def _orthogonalize(items: List[StepItem], updates: List[torch.Tensor],
                   owners: Optional[list] = None) -> list:
    """Newton-Schulz of every update, eagerly even under torch.compile (a graph break): the
    same GEMM calls, so the same bits, as torch.optim.Muon's eager step. A sharded param's
    update (``owners[i]`` its DTensor) is orthogonalised whole: gathered to every rank, which
    each run NS and keep their own shard (``ns_sharded="all_gather"``); or gathered to one
    rank of its shard group, round-robin over the params, which runs NS and scatters the
    shards back (``"designated"``: NS work divided among the ranks). Either way, the bits of
    one process."""
    owners = owners or [None] * len(items)
    local_rows = [u.shape[0] for u in updates]
    designated: Dict[int, tuple] = {}
    k = 0
    for i, (o, it) in enumerate(zip(owners, items)):
        if o is not None and it.hyper.ns_sharded == "designated" and _shard_dim(o) is not None:
            designated[i] = _designated(o, updates[i], k)
            k += 1
    updates = [u if o is None or i in designated else _gather(o, u)
               for i, (o, u) in enumerate(zip(owners, updates))]
    for i, state in designated.items():
        work, dst, pieces, _, _, me = state
        work.wait()
        # on the designated rank the whole update (BF16, as phase 1 wrote it; exact); nothing
        # to orthogonalise elsewhere
        updates[i] = torch.cat(pieces)[:owners[i].shape[0]].to(updates[i].dtype) \
            if me == dst else None
    ortho = [None] * len(items)
    groups: Dict[tuple, List[int]] = {}
    for i, it in enumerate(items):
        h = it.hyper
        if updates[i] is None:
            continue
        if h.ns_batched:
            groups.setdefault((tuple(updates[i].shape), it.param.device, h.ns_coefficients,
                               h.ns_steps, h.eps), []).append(i)
        else:
            ortho[i] = newton_schulz(updates[i], h.ns_coefficients, h.ns_steps, h.eps)
    for (_, _, coeffs, steps, eps), idx in groups.items():
        if len(idx) == 1:
            ortho[idx[0]] = newton_schulz(updates[idx[0]], coeffs, steps, eps)
            continue
        out = newton_schulz(torch.stack([updates[i] for i in idx]), coeffs, steps, eps)
        for k, i in enumerate(idx):
            ortho[i] = out[k]
    scattered = {i: _scatter_back(ortho[i], state) for i, state in designated.items()}
    for i, (work, recv) in scattered.items():
        work.wait()
        ortho[i] = recv[:local_rows[i]].to(torch.bfloat16)
    return [x if o is None or i in designated else _own_shard(o, x)
            for i, (o, x) in enumerate(zip(owners, ortho))]


# _orthogonalize under torch.compiler.disable (the graph break), made by Muon's constructor and
# not at import: disable imports torch._dynamo, about as much CPU time as `import torch`, which
# `import mpext` need not pay where no Muon is made.
_orthogonalize_eagerly = None


def _make_orthogonalize_eager() -> None:
    global _orthogonalize_eagerly
    if _orthogonalize_eagerly is None:
        _orthogonalize_eagerly = torch.compiler.disable(_orthogonalize)


def muon_step(items: List[StepItem], lr_tensors: LrTensors, inv_scale: Optional[torch.Tensor],
              found_inf: Optional[torch.Tensor], owners: Optional[list] = None) -> None:
    """Steps Muon items (hyper a :class:`MuonGroup`): phase 1 on the engine (one call per
    device and group settings: the momentum and the update, with the fused unscale and skip),
    Newton-Schulz per matrix (or batched over same-shaped ones, ``ns_batched``), phase 3 on the
    engine (decay and update in the param's format; one call per lr ratio)."""
    updates = []
    phase1 = []
    widened = []
    for it in items:
        h = it.hyper
        device_step(it.state, it.param.device)
        if it.grad.dtype is torch.float16:
            # the kernel takes a gradient in the update's dtype (BF16, as NS reads it) or fp32:
            # an fp16 gradient is widened (exact), its unscaled values written back after
            widened.append((it.grad, it.grad.float()))
            it = it._replace(grad=widened[-1][1])
        u = torch.empty_like(it.param, dtype=_update_dtype(it.grad))
        updates.append(u)
        # the update is a master-free scratch written to nearest even, its stream the param's;
        # the state without the EMA (phase 3 moves it towards the new param), and a copy of
        # the step count: the op advances the counts it is given, and phase 3 ends the step
        st = {k: v for k, v in it.state.items() if k != "ema_param"}
        st["step"] = st["step"].clone()
        store = h.storage
        hyper = MuonMomentumHyper(h.momentum, h.nesterov, store[0], True, False, store[3],
                                  store[4], store[5], 0.0)
        phase1.append(it._replace(param=u, state=st, storage=None, hyper=hyper))
    fused_step(phase1, lr_tensors, inv_scale, found_inf)
    if inv_scale is not None:
        for g, wide in widened:
            g.copy_(wide)
    if _orthogonalize_eagerly is None:  # a Muon unpickled in a process that made none
        _make_orthogonalize_eager()
    ortho = _orthogonalize_eagerly(items, updates, owners)
    phase3 = []
    owners = owners or [None] * len(items)
    for it, o, owner in zip(items, ortho, owners):
        h = it.hyper
        # the kernel takes a bf16 update for a bf16 param, fp32 otherwise (torch's add of a
        # bf16 tensor to an fp32 param widens it: exact)
        o = o.to(it.param.dtype if it.param.dtype is torch.bfloat16 else F32,
                 memory_format=torch.contiguous_format)
        shape = it.param.shape if owner is None else owner.shape  # a shard's: the whole's
        hyper = MuonUpdateHyper(adjust_lr_ratio(h.adjust_lr_fn, shape), h.weight_decay, False,
                                *h.storage[1:])
        phase3.append(it._replace(grad=o, hyper=hyper, blocks=None))
    fused_step(phase3, lr_tensors, None, found_inf)


def muon_param_groups(model: torch.nn.Module, **muon_kwargs) -> List[Dict[str, Any]]:
    """The param groups of Muon's recipe (Keller Jordan's MuonWithAuxAdam, Moonlight): the 2-D
    weights of hidden layers get Muon (``use_muon=True``); embeddings (every param of an
    ``nn.Embedding``, and any param tied to one), the output head (the last 2-D weight of a
    module named ``lm_head`` / ``head`` / ``classifier`` / ``score``, or tied to an embedding),
    norms, biases and every other non-2-D param get AdamW (``use_muon=False``). Conv weights
    (4-D) go to AdamW too. ``muon_kwargs`` go into the Muon group (lr, momentum, ...); set the
    AdamW group's keys on the returned dict, or through Muon's ``adamw_*`` arguments."""
    embed_ids = set()
    head_ids = set()
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Embedding):
            embed_ids.update(id(p) for p in mod.parameters(recurse=False))
        last = name.rsplit(".", 1)[-1]
        if last in ("lm_head", "head", "classifier", "score", "output"):
            head_ids.update(id(p) for p in mod.parameters(recurse=False))
    muon, adamw = [], []
    for p in model.parameters():  # each param once (tied ones too)
        if not p.requires_grad:
            continue
        if p.ndim == 2 and id(p) not in embed_ids and id(p) not in head_ids:
            muon.append(p)
        else:
            adamw.append(p)
    groups = []
    if muon:
        groups.append(dict(params=muon, use_muon=True, **muon_kwargs))
    if adamw:
        groups.append(dict(params=adamw, use_muon=False))
    return groups


class Muon(FusedOptimizer):
    """Muon (Keller Jordan et al.) with torch.optim.Muon's arguments, defaults and update, bit
    for bit on FP32 params, its elementwise phases on mpext's fused engine::

        buf = lerp(buf, g, 1 - momentum)
        u = lerp(g, buf, momentum) if nesterov else buf
        O = NewtonSchulz(u)                          (BF16, torch's matmuls)
        p = p * (1 - lr * weight_decay)
        p = p - lr * ratio(shape) * O                (adjust_lr_fn)

    A param group with ``use_muon=False`` is stepped by AdamW (decoupled weight decay, keys
    ``betas``, ``eps``, ``weight_decay``, ``lr``; moments ``exp_avg`` / ``exp_avg_sq`` in any
    mpext format): one optimizer for a whole model (:func:`muon_param_groups`). Muon groups take
    2-D params only (torch's check).

    Args:
        params: params or param groups (float32, bfloat16 or float16, on CPU or CUDA).
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn:
            torch.optim.Muon's (defaults 1e-3, 0.1, 0.95, True, (3.4445, -4.7750, 2.0315),
            1e-7, 5, None).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the defaults of ``use_muon=False``
            groups (None: lr / weight_decay; betas (0.9, 0.999), eps 1e-8 as torch.optim.AdamW).
        momentum_dtype: the buffer's storage: ``torch.float32`` (default), ``torch.bfloat16``
            (rounded per ``moment_rounding``) or ``"q8"`` / ``torch.int8`` (signed 8-bit block
            codes, state ``momentum_buffer_q8`` / ``momentum_buffer_q8_scale``).
        exp_avg_dtype, exp_avg_sq_dtype: the AdamW groups' moments, as mpext.optim.AdamW's.
        ns_batched (bool): Newton-Schulz over same-shaped matrices as one batched matmul
            (default False: per matrix, torch's exact call).
        ns_sharded (str): how a Shard(0) DTensor param (FSDP2, HSDP) is orthogonalised:
            ``"designated"`` (default: one rank per param, round-robin, gathers the update,
            runs NS and scatters the shards; measured faster, NS work divided) or
            ``"all_gather"`` (every rank gathers the whole update and runs NS). The same
            bits either way (docs/muon.md, "FSDP2 / DTensor").
        master_weights, param_remainders, stochastic_rounding, moment_rounding, seed,
        block_size, ema_decay, unscale_grads: as :class:`mpext.optim.Adam`'s.

    ``state["step"]`` (which torch's Muon does not keep) counts the param's steps: it names the
    stochastic-rounding streams and starts the EMA.
    """

    _op = "muon_update_step_"
    # The rule's own moment (mpext.memory's RULES reads it); AdamW groups keep Adam's
    # (_moments_of), so the settings of both are the optimizer's (_moment_settings).
    moments = _MUON_MOMENTS

    def _moment_settings(self) -> Tuple[str, ...]:
        return tuple(q.setting for q in _MUON_MOMENTS + _ADAM_MOMENTS)

    def __init__(self, params, lr: Union[float, torch.Tensor] = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: Tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
                 eps: float = EPS, ns_steps: int = DEFAULT_NS_STEPS,
                 adjust_lr_fn: Optional[str] = None, *,
                 adamw_lr: Optional[float] = None,
                 adamw_betas: Tuple[float, float] = (0.9, 0.999), adamw_eps: float = 1e-8,
                 adamw_weight_decay: Optional[float] = None,
                 master_weights: bool = True, unscale_grads: bool = True,
                 param_remainders: bool = False, stochastic_rounding: bool = False,
                 momentum_dtype: torch.dtype = F32, exp_avg_dtype: torch.dtype = F32,
                 exp_avg_sq_dtype: torch.dtype = F32, moment_rounding: str = "stochastic",
                 seed: int = 0, block_size: int = 256, ema_decay: Optional[float] = None,
                 ns_batched: bool = False, ns_sharded: str = "designated") -> None:
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:  # torch's checks, in its order
            raise ValueError("Tensor lr must be 1-element")
        _make_orthogonalize_eager()
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn, use_muon=True,
                        adamw_lr=adamw_lr, adamw_betas=adamw_betas, adamw_eps=adamw_eps,
                        adamw_weight_decay=adamw_weight_decay,
                        master_weights=master_weights, unscale_grads=unscale_grads,
                        param_remainders=param_remainders,
                        stochastic_rounding=stochastic_rounding, momentum_dtype=momentum_dtype,
                        exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype,
                        moment_rounding=moment_rounding, seed=seed, block_size=block_size,
                        ema_decay=ema_decay, ns_batched=ns_batched, ns_sharded=ns_sharded)
        super().__init__(params, defaults)

    def _init_caches(self) -> None:
        super()._init_caches()
        self._muon_lr = LrTensors()

    @staticmethod
    def _is_muon(group: Dict[str, Any]) -> bool:
        return group.get("use_muon", True) is not False

    def _moments_of(self, group: Dict[str, Any]) -> Tuple[Quantity, ...]:
        return _MUON_MOMENTS if self._is_muon(group) else _ADAM_MOMENTS

    def _check_formats(self, group: Dict[str, Any], where: str) -> None:
        # the base checks the formats of `moments`: here the group's own (a Muon group's 8-bit
        # buffer is a single moment, an AdamW group's 8-bit moments a pair)
        self.moments = self._moments_of(group)
        try:
            super()._check_formats(group, where)
        finally:
            del self.moments

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if isinstance(param_group, dict) and not self._is_muon(param_group):
            d = self.defaults
            for key, value in (("lr", d.get("adamw_lr")), ("betas", d.get("adamw_betas")),
                               ("eps", d.get("adamw_eps")),
                               ("weight_decay", d.get("adamw_weight_decay"))):
                if key not in param_group and value is not None:
                    param_group[key] = value
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if self._is_muon(group):
            for p in group["params"]:
                if p.ndim != 2:
                    self.param_groups.pop()
                    raise ValueError("Muon only supports 2D parameters whereas we found a "
                                     "parameter with size: %s (param group %d); put it in a "
                                     "use_muon=False group (AdamW), e.g. with "
                                     "mpext.optim.muon_param_groups(model)"
                                     % (p.size(), len(self.param_groups)))

    def _check_rule(self, group: Dict[str, Any], where: str) -> None:
        if not isinstance(group.get("use_muon", True), bool):
            raise TypeError("%s: use_muon must be a bool, got %r%s"
                            % (self._name(), group.get("use_muon"), where))
        wd = group.get("weight_decay")
        if not _is_real(wd) or not 0.0 <= wd or not math.isfinite(wd):
            raise ValueError(f"weight decay should be >= 0 but is: {wd}")
        if not self._is_muon(group):
            betas = group.get("betas")
            if not isinstance(betas, (list, tuple)) or len(betas) != 2:
                raise ValueError("%s: betas of an AdamW group (use_muon=False) must be a pair "
                                 "of floats, got %r%s" % (self._name(), betas, where))
            for i, b in enumerate(betas):
                if not _is_real(b) or not 0.0 <= b < 1.0:
                    raise ValueError(f"Invalid beta parameter at index {i}: {b}")
            eps = group.get("eps")
            if not _is_real(eps) or not 0.0 <= eps or not math.isfinite(eps):
                raise ValueError(f"Invalid epsilon value: {eps}")
            return
        if group.get("maximize", False):
            # torch.optim.Muon has no maximize, and the momentum kernel takes none: refused,
            # not ignored (an AdamW group takes it)
            raise ValueError("%s: maximize=True is not supported by a Muon group (torch.optim."
                             "Muon has no maximize); negate the loss instead%s"
                             % (self._name(), where))
        momentum = group.get("momentum")
        if not _is_real(momentum) or not 0.0 <= momentum or not math.isfinite(momentum):
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not isinstance(group.get("nesterov"), bool):
            raise TypeError("%s: nesterov must be a bool, got %r%s"
                            % (self._name(), group.get("nesterov"), where))
        fn = group.get("adjust_lr_fn")
        if fn is not None and fn not in ("original", "match_rms_adamw"):
            raise ValueError(f"Adjust learning rate function {fn} is not supported")
        coeffs = group.get("ns_coefficients")
        if not isinstance(coeffs, (list, tuple)) or len(coeffs) != 3 \
                or not all(_is_real(c) and math.isfinite(c) for c in coeffs):
            raise ValueError("%s: ns_coefficients must be a tuple of exactly 3 finite floats, "
                             "got %r%s" % (self._name(), coeffs, where))
        steps = group.get("ns_steps")
        if not isinstance(steps, int) or isinstance(steps, bool) or not 0 <= steps < 100:
            raise ValueError("%s: ns_steps must be an int in [0, 100) (torch: less than 100 for "
                             "computational efficiency), got %r%s" % (self._name(), steps, where))
        eps = group.get("eps")
        if not _is_real(eps) or not 0.0 <= eps or not math.isfinite(eps):
            raise ValueError("%s: eps must be a finite number >= 0, got %r%s"
                             % (self._name(), eps, where))
        if not isinstance(group.get("ns_batched", False), bool):
            raise TypeError("%s: ns_batched must be a bool, got %r%s"
                            % (self._name(), group.get("ns_batched"), where))
        if group.get("ns_sharded", "designated") not in ("all_gather", "designated"):
            raise ValueError("%s: ns_sharded must be 'all_gather' or 'designated', got %r%s"
                             % (self._name(), group.get("ns_sharded"), where))

    _RULE = "Muon (torch.optim.Muon or mpext.optim.Muon)"
    _RULE_KEYS = ("lr", "weight_decay", "momentum", "ns_coefficients", "ns_steps")
    _TORCH_GROUP_DEFAULTS: Dict[str, Any] = {}  # torch.optim.Muon's groups have none of them

    def _check_same_rule(self, saved: Dict[str, Any], state_dict: Dict[str, Any],
                         gi: int) -> None:
        # A checkpoint's group is checked against the rule of this optimizer's group gi: an
        # AdamW group (use_muon=False) takes a mixed Muon's AdamW group (whose keys alone look
        # like RAdam's: betas and eps, no amsgrad) or an Adam/AdamW group, never a Muon group.
        mine = self.param_groups[gi] if gi < len(self.param_groups) else {}
        theirs_muon = saved.get("use_muon") if isinstance(saved, dict) else None
        if self._is_muon(mine):
            if theirs_muon is False:
                raise ValueError("%s.load_state_dict: param group %d of the checkpoint is an "
                                 "AdamW group (use_muon=False) and this optimizer's is a Muon "
                                 "group; make the groups in the same order. Nothing was loaded."
                                 % (self._name(), gi))
            return super()._check_same_rule(saved, state_dict, gi)
        if theirs_muon is False:
            return
        if theirs_muon is True:
            raise ValueError("%s.load_state_dict: param group %d of the checkpoint is a Muon "
                             "group and this optimizer's is an AdamW group (use_muon=False); "
                             "make the groups in the same order. Nothing was loaded."
                             % (self._name(), gi))
        from .adam import AdamW
        self._RULE, self._RULE_KEYS = AdamW._RULE, AdamW._RULE_KEYS
        try:
            super()._check_same_rule(saved, state_dict, gi)
        finally:
            del self._RULE, self._RULE_KEYS
        saved["use_muon"] = False  # (load_state_dict's copy) a torch AdamW group: AdamW's

    def _import_param_state(self, param: torch.Tensor, value: Any, group: Dict[str, Any],
                            key: Any) -> Dict[str, Any]:
        if isinstance(value, dict) and "momentum_buffer" in value and "step" not in value:
            # torch.optim.Muon's state: a buffer and no step count. A saved state means a
            # stepped param: step 1.
            value = dict(value, step=torch.tensor(1.0))
        return super()._import_param_state(param, value, group, key)

    def _fill_group(self, group: Dict[str, Any]) -> None:
        group.setdefault("use_muon", True)
        group.setdefault("ns_batched", False)
        group.setdefault("ns_sharded", "designated")

    def _hyper(self, group: Dict[str, Any]) -> Any:
        if not self._is_muon(group):
            return adam_hyper(group, force_decoupled=True)
        return MuonGroup(float(group["momentum"]), bool(group["nesterov"]),
                         tuple(float(c) for c in group["ns_coefficients"]), float(group["eps"]),
                         int(group["ns_steps"]), group["adjust_lr_fn"],
                         float(group["weight_decay"]), bool(group.get("ns_batched", False)),
                         storage_hyper(group), str(group.get("ns_sharded", "designated")))

    def _items(self, only: Optional[set] = None):
        # Always the item list (no cached StepPlan): the launch runs three phases per param;
        # the DTensor params by their local shards, for the gather of their updates.
        items, owners, _ = self._checked_items(only)
        self._sharded = {id(it.param): p for it, p in zip(items, owners) if is_dtensor(p)}
        return items

    def _launch(self, items: List[StepItem], inv_scale: Optional[torch.Tensor],
                found_inf: Optional[torch.Tensor]) -> None:
        adam = [it for it in items if type(it.hyper) is AdamHyper]
        muon = [it for it in items if type(it.hyper) is MuonGroup]
        if muon:
            sharded = getattr(self, "_sharded", {})
            owners = [sharded.get(id(it.param)) for it in muon] if sharded else None
            muon_step(muon, self._muon_lr, inv_scale, found_inf, owners)
        if adam:
            fused_step(adam, self._lr_tensors, inv_scale, found_inf)
