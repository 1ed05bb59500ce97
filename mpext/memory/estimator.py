"""The estimate of mpext.memory: what a training configuration holds per device. The modes,
model shapes, activation model and sharding arithmetic it adds up are in modules of their own
(``modes``, ``models``, ``activation_model``, ``sharding``); this docstring is the accounting
of them all.

For a model of ``params`` parameters trained with ``optimizer`` in a precision ``mode``, under
ZeRO stage ``zero`` over ``world_size`` devices, :func:`estimate` returns the bytes one device
holds, split into the persistent tensors (weights, gradients, FP32 master weights, optimizer
states, loss-scaler scalars) and the memory that exists only while a step runs (activations saved
for the backward pass, and autocast's low-precision weight copies). ``python -m mpext.memory``
prints it as a table (``mpext.memory.cli``); ``docs/memory.md`` documents every row.

Bytes per parameter, per mode (ZeRO 0, one device; ``k`` = optimizer-state tensors per param:
AdamW 2, SGD with momentum 1, ...)::

    mode                              weights grads masters states transient (per step)
    fp32                                 4      4      0      4k   activations in fp32
    amp-bf16                             4      4      0      4k   activations in bf16 + 2 B/param
    amp-fp16                             4      4      0      4k   bf16 -> fp16; + 2 scaler scalars
    mpext-bf16                           2      2      4      4k   activations in bf16
    mpext-fp16                           2      2      4      4k   as bf16; + 2 scaler scalars
    mpext-bf16-bf16moments               2      2      4      2k   as mpext-bf16
    mpext-bf16-remainder                 2      2      2      4k   as mpext-bf16
    mpext-bf16-remainder-bf16moments     2      2      2      2k   as mpext-bf16
    mpext-bf16-sr-fp32moments            2      2      0      4k   as mpext-bf16
    mpext-bf16-sr                        2      2      0      2k   as mpext-bf16
    mpext-fp16-sr                        2      2      0      2k   as mpext-fp16
    mpext-bf16-8bit                      2      2      4   1.016k  as mpext-bf16
    mpext-bf16-remainder-8bit            2      2      2   1.016k  as mpext-bf16
    mpext-bf16-sr-8bit                   2      2      0   1.016k  as mpext-bf16
    mpext-fp16-sr-8bit                   2      2      0   1.016k  as mpext-fp16

The mpext modes are not written by hand: each is a state format of ``mpext.optim.formats`` (a
param format: where the FP32 value lives, and a moment format) on params of one dtype, with the
formats' own bytes (:func:`format_mode`); ``FORMAT_MODES`` holds every one by the name of its
parts (``mpext-bf16-remainder-q8``, ...) and the names above are aliases of some of them
(``ALIASES``). The state is those bytes times the moments of the rule (``RULES``: Adam 2, Lion
1, SGD 0 or 1 with momentum; ``estimate(..., rule=...)``), or of ``optimizer`` (torch's).
``grad_release=True`` (mpext.optim's ``release_grads``): no gradient persists; one bucket of
them is alive during the backward (``grad_bucket``).

Native AMP keeps the model in FP32 (its FP32 weights are the masters) and autocast casts each
weight to 16 bits on every forward; those copies live until the backward has used them, so they
are counted as step-time memory (``autocast_copies``), not as persistent memory. mpext keeps the
model in BF16/FP16 with FP32 masters inside the optimizer and casts nothing per forward. The
lean modes are ``mpext.optim.Adam``/``AdamW``'s leaner state (Adam/AdamW only): a BF16 param's
master kept as its 16-bit remainder (``param_remainders=True``: the masters row is the
remainders), moments stored in BF16 (``exp_avg_dtype=exp_avg_sq_dtype=torch.bfloat16``), or no
master at all (``master_weights=False``; ``-sr`` for ``stochastic_rounding=True``, which is what
makes that mode train well; round to nearest holds the same bytes). The ``-8bit`` modes are ``mpext.optim.Adam``/``AdamW`` with 8-bit moments
(``exp_avg_dtype=torch.int8, exp_avg_sq_dtype=torch.uint8``): one byte per element and moment
plus an FP32 scale per block of 256 elements (docs/moments_8bit.md), with the master as an FP32
copy, as its 16-bit remainder (``param_remainders=True``) or none (``master_weights=False``,
``-sr``: ``stochastic_rounding=True``). Params under 4096 elements (``MIN_8BIT_NUMEL``) keep
FP32 moments in those modes: given the parameter count alone, the estimate counts every element
as 8-bit; given the tensors' sizes (a known model's ``ModelSpec.sizes`` too), it counts each as
the optimizer keeps it. Under FSDP2 the blocks lie on each tensor's whole index, so a rank
keeps the scales of every block its shard touches (one more where a block straddles two
shards).

An EMA of the weights (``ema=True``) is one more FP32 copy, 4 bytes per parameter: mpext's is
``mpext.optim.Adam``/``AdamW``'s ``ema_decay`` (an EMA of the FP32 masters, kept in the optimizer
state and partitioned with it by ZeRO), native's an FP32 ``torch.optim.swa_utils.AveragedModel``
of the FP32 model (a model copy: partitioned only where the weights are, stage 3).

ZeRO (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", section 5): stage 1 partitions the optimizer states (the FP32 master weights are part of
them, as in the paper's K = 12 bytes for mixed-precision Adam) over ``world_size`` devices, stage
2 also the gradients, stage 3 also the weights. A partition holds ceil(params / world_size)
elements. Temporary all-gather buffers and communication buckets are not counted.

PyTorch's own engines partition otherwise (``sharding="torch"``, per rank, exact given the
tensors' shapes; ``--zero fsdp2`` / ``zero1-torch`` on the command line): ``zero=3`` is FSDP2's
``fully_shard``, which cuts dim 0 of every tensor into chunks of ceil(dim0 / world_size) rows
(the last ranks hold fewer rows or none) and allocates every rank's parameter, and the
gradient buffer of each ``fully_shard`` unit, at the padded chunk, while mpext.optim makes the
masters, remainders, moments and EMA like the local shard itself (unpadded); ``zero=1`` is
``ZeroRedundancyOptimizer``, whose ranks each step whole tensors (``zero_partition``), so a
tensor's state, 8-bit or FP32 by its whole size, lives on one rank. With FP32 sharded params
and ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` the param is the FP32 value
(``mpext-fp32-param-<moments>``: 4 + 4 bytes of param and gradient, no master; the BF16
all-gathered copies exist only during the step); BF16 sharded params take every format of a
BF16 param.

Activations (optional; needs batch, sequence, hidden, layers, heads): what autograd saves in
one forward, derived from the saved-tensor hooks on a pre-LayerNorm GPT (tests/small_gpt.py, the
benchmarks' layout) and transformers' GPT-2
(``activation_bytes``; docs/memory.md has the formula and the measured table). Per layer
``s*b*h*(14*d + 2*f + 2*m) + 4*s*b*f`` plus, with fused attention (``attention="sdpa"``, the
default), a float32 log-sum-exp ``4*a*s*b`` or, with ``"eager"``, the probabilities
``a*s^2*b*(f + d' + m)``; ``d`` the matrix products' bytes, ``f`` the residual stream's and the
norms' (FP32 under native AMP), ``m`` a dropout mask's. Eager attention on CUDA in 16 bits is
Korthikanti et al. 2022, section 4.1, plus the norms' statistics. That is the ``gpt`` family's
formula; ``family="llama"`` is LLaMA's (RMSNorm with FP32 copies, RoPE, SwiGLU,
``_llama_saved_tensors``), measured on transformers' ``LlamaForCausalLM``; a family with no
formula (``FAMILIES``) is refused. ``checkpointing=True`` keeps each block's input and one
recomputed block at a time. Activations are replicated data-parallel work and are not divided
by ZeRO. ``compress=...`` (``--compress-activations``)
counts the tensors ``mpext.activations`` stores in FP8 as it stores them: one byte per element
and a float32 scale per block of their last dimension (``activation_compression``).
"""
import dataclasses
import math
import numbers
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..optim._release import DEFAULT_BUCKET_BYTES
from ._args import check_count as _check_count
from .activation_model import (ATTENTIONS, DEVICES, FAMILIES, activation_bytes,
                               activation_compression, activation_formula)
from .models import (MODELS, ModelSpec, gpt_params, gpt_shapes, llama_params, llama_shapes,
                     model_names, model_spec)
from .modes import (ALIASES, FORMAT_MODES, MODES, OPTIMIZERS, RULES, SCALER_SCALARS, ModeSpec,
                    format_mode, format_mode_name, known_mode, mode_supports, optimizer_states,
                    rule_states, _ADAM, _FP32, _spec)
from .sharding import (DDP_BUCKET_CAP_MB, DDP_FIRST_BUCKET_BYTES, MB, SHARDINGS, check_order,
                       ddp_buckets, ddp_release_peak, default_units, fsdp2_release_peak,
                       fsdp2_shard, stage_label, zero_partition)
from .sharding import _tensor_state, _torch_rank

__all__ = ["MODES", "FORMAT_MODES", "ALIASES", "RULES", "OPTIMIZERS", "MODELS", "ModeSpec",
           "ModelSpec", "Breakdown", "estimate", "SHARDINGS", "fsdp2_shard",
           "zero_partition", "stage_label", "optimizer_states", "rule_states",
           "format_mode", "format_mode_name", "activation_bytes", "activation_formula",
           "activation_compression",
           "ATTENTIONS", "DEVICES", "gpt_params", "gpt_shapes", "llama_params",
           "llama_shapes", "model_names", "model_spec", "mode_supports",
           "DEFAULT_BUCKET_BYTES", "FAMILIES", "GpuBudget", "fit_changes", "gpu_memory_bytes",
           "CUDA_CONTEXT_BYTES", "ALLOCATOR_SLACK", "fsdp2_release_peak", "ddp_release_peak",
           "ddp_buckets"]


# ---------------------------------------------------------------------------------------------
# The estimate


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Per-device bytes of one training configuration (see the module docstring for the
    accounting). ``persistent`` is what lives between steps; ``total`` adds what a step needs
    while it runs."""

    mode: str
    optimizer: str
    params: int
    zero: int
    world_size: int
    weights: int
    gradients: int
    master_weights: int
    optimizer_states: int
    scaler: int
    activations: Optional[int]   # None: not estimated (no batch/sequence/shape given)
    autocast_copies: int
    step_buffers: int = 0
    activation_formula: str = ""
    ema: int = 0                 # an FP32 EMA of the weights (``ema=True``)
    grad_bucket: int = 0         # gradient release: the gradients alive at most in backward
    sharding: str = "even"       # how ZeRO partitions (``estimate``'s ``sharding``)
    rank: Optional[int] = None   # the rank these bytes are of (sharding='torch')
    family: str = "gpt"          # whose activation formula (``FAMILIES``)
    checkpointing: bool = False  # activations with every block checkpointed
    comm_buffers: int = 0        # DDP's gradient buckets (``ddp=True``), alive for the model's life
    grad_release: bool = False   # the step inside backward (``grad_release=True``)
    ddp: bool = False            # the replicas are DistributedDataParallel's

    PERSISTENT = ("weights", "gradients", "master_weights", "optimizer_states", "ema", "scaler",
                  "comm_buffers")
    TRANSIENT = ("activations", "autocast_copies", "grad_bucket", "step_buffers")

    @property
    def persistent(self) -> int:
        return sum(getattr(self, k) for k in self.PERSISTENT)

    @property
    def transient(self) -> int:
        """The larger of the forward/backward peak (activations + autocast copies, + the
        released gradients' bucket) and the optimizer step's buffers: the two are not alive at
        the same time."""
        return max((self.activations or 0) + self.autocast_copies + self.grad_bucket,
                   self.step_buffers)

    @property
    def total(self) -> int:
        return self.persistent + self.transient

    @property
    def grad_peak(self) -> int:
        """The ``.grad`` bytes alive at most during a backward: released, ``grad_bucket``;
        else every gradient (``gradients``: they live from backward to ``zero_grad``). DDP's
        buckets (``comm_buffers``) are apart."""
        return self.grad_bucket if self.grad_release else self.gradients

    def bytes_per_param(self, field: str) -> float:
        """Per-device bytes of ``field`` (or 'persistent' / 'total') over the model's params."""
        v = getattr(self, field)
        return (v or 0) / self.params

    def label(self) -> str:
        if self.ddp:
            return "%s DDP/%d" % (self.mode, self.world_size)
        return self.mode + ("" if self.zero == 0 else " " + stage_label(self.zero, self.sharding,
                                                                        self.world_size))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(persistent=self.persistent, transient=self.transient, total=self.total,
                 grad_peak=self.grad_peak,
                 bytes_per_param={k: self.bytes_per_param(k)
                                  for k in self.PERSISTENT + self.TRANSIENT
                                  + ("persistent", "total")})
        return d


def _sizes(params) -> Tuple[int, Optional[List[int]], Optional[List[Tuple[int, ...]]]]:
    """(total, per-tensor sizes or None, per-tensor shapes or None) of ``estimate``'s
    ``params``; a tensor given by its element count has the 1-D shape of it."""
    if isinstance(params, (str, bytes)) or not hasattr(params, "__iter__"):
        return _check_count("params", params), None, None
    sizes, shapes = [], []
    for i, v in enumerate(params):
        if isinstance(v, (tuple, list)):  # a shape (torch.Size is a tuple)
            shape = tuple(_check_count("params[%d][%d]" % (i, j), d, 0) for j, d in enumerate(v))
        else:
            shape = (_check_count("params[%d]" % i, v, 0),)
        shapes.append(shape)
        sizes.append(math.prod(shape))
    if sum(sizes) < 1:
        raise ValueError("params: the tensors' sizes must add up to at least 1, got %r"
                         % (sizes,))
    return sum(sizes), sizes, shapes


def estimate(params: Union[int, Sequence[int]], optimizer: str = "adamw",
             mode: str = "mpext-bf16", *, zero: int = 0, world_size: int = 1,
             batch: Optional[int] = None, seq: Optional[int] = None,
             hidden: Optional[int] = None, layers: Optional[int] = None,
             heads: Optional[int] = None, vocab: Optional[int] = None,
             dropout: Optional[bool] = None, ema: bool = False, rule: Optional[str] = None,
             momentum: float = 0.0, grad_release: bool = False,
             bucket_bytes: int = DEFAULT_BUCKET_BYTES, attention: str = "sdpa",
             device: str = "cuda", sharding: str = "even",
             rank: Optional[int] = None, compress=None, family: str = "gpt",
             ffn: Optional[int] = None, checkpointing: bool = False, ddp: bool = False,
             ddp_bucket_cap_mb: Optional[float] = None,
             units: Optional[Sequence[Sequence[int]]] = None,
             grad_order: Optional[Sequence[int]] = None,
             activation: str = "gelu") -> Breakdown:
    """Per-device memory of training a ``params``-parameter model.

    Args:
        params: the number of parameters (an int, or an integral float such as ``7e9``), or
            the element count of each parameter tensor (e.g. ``[p.numel() for p in
            model.parameters()]``): then the 8-bit modes keep FP32 moments for the tensors
            under ``MIN_8BIT_NUMEL`` elements and per-tensor blocks, as the optimizer does.
        optimizer: a key of ``OPTIMIZERS`` ('adamw', 'sgd', 'sgd-momentum', ...): a torch
            optimizer (inside ``MixedPrecisionOptimizer`` in the mpext modes), or for 'adam' /
            'adamw' mpext.optim's.
        mode: a key of ``MODES`` or of ``FORMAT_MODES`` (every format of mpext.optim, by its
            parts: ``mpext-<fp32|bf16|fp16>-<param format>-<moment format>``; the lean modes
            of ``MODES`` are aliases of some of them) ('fp32', 'amp-bf16', 'amp-fp16', 'mpext-bf16', 'mpext-fp16', or
            one of mpext.optim's lean modes, for 'adam' and 'adamw' only:
            'mpext-bf16-bf16moments', 'mpext-bf16-remainder',
            'mpext-bf16-remainder-bf16moments', 'mpext-bf16-sr-fp32moments', 'mpext-bf16-sr',
            'mpext-fp16-sr', and with 8-bit moments 'mpext-bf16-8bit',
            'mpext-bf16-remainder-8bit', 'mpext-bf16-sr-8bit', 'mpext-fp16-sr-8bit').
        zero: ZeRO stage 0-3 (1: optimizer states and masters partitioned, 2: + gradients,
            3: + weights).
        world_size: data-parallel devices the partitions are spread over.
        batch, seq, hidden, layers, heads: the activation estimate's shape; all five or none.
        vocab: adds the FP32 logits of the cross entropy to the activations.
        dropout: count the dropout masks (1 byte per element on CUDA); None (default): the
            family's own (GPT-2 trains with dropout, LLaMA without, and its formula has none).
        family: whose activation formula (``FAMILIES``): 'gpt' (pre-LayerNorm, GELU MLP:
            GPT-2, the benchmarks' GPT) or 'llama' (RMSNorm, RoPE, SwiGLU: transformers'
            LlamaForCausalLM with full multi-head attention, ``ffn`` = its intermediate_size).
            Another family is refused: no model is estimated with another family's formula.
        ffn: the llama family's MLP width (intermediate_size).
        checkpointing: activation checkpointing of every block (torch.utils.checkpoint, as
            transformers' ``gradient_checkpointing_enable``): each block's input is kept and
            one block at a time is recomputed in the backward (``activation_bytes``).
        activation: the MLP's activation function ('gelu', 'gelu_new',
            'gelu_pytorch_tanh', 'relu', 'silu'): how many ffn-wide tensors it saves
            (``activation_bytes``; HF GPT-2's hub default is 'gelu_new').
        attention: 'sdpa' (fused attention, the default of torch and transformers: no
            s x s tensor is saved) or 'eager' (the softmax probabilities are saved).
        device: 'cuda' (default) or 'cpu', where dropout keeps its masks in the input's dtype
            and SDPA with dropout saves what eager attention does (``activation_bytes``).
        compress: the saved activations stored in FP8 by ``mpext.activations`` (None: none;
            True: its default policy "all"; a policy name; or a dict of
            ``fp8_saved_tensors``' options: ``activation_bytes``, ``activation_compression``).
        ema: add an FP32 EMA of the weights (mpext modes: ``ema_decay`` of
            ``mpext.optim.Adam``/``AdamW``, so adam or adamw only; native modes: an FP32
            ``AveragedModel``).
        rule: mpext.optim's optimizer, a key of ``RULES`` ('adam', 'adamw', 'lion', 'sgd'),
            instead of ``optimizer``: every mode and format exists for it, its moments are the
            state (``rule_states``), its step needs no FP32 gradient buffers, and an EMA is
            its ``ema_decay``.
        momentum: SGD's momentum (with ``rule='sgd'``): a momentum_buffer when not 0.
        grad_release: the step runs inside the backward pass (``release_grads()`` of
            mpext.optim): no gradient persists between steps; ``grad_bucket`` (and
            ``grad_peak``) is the gradients alive at most during the backward. In one process
            a bucket is stepped once its bytes reach ``bucket_bytes``, so at most
            ``bucket_bytes`` - 1 plus the largest gradient (given the tensors' sizes; given a
            count alone, every gradient is taken as smaller than the bucket:
            ``bucket_bytes``), or all of them when they are fewer. On more than one process
            only PyTorch's engines: FSDP2 (``sharding='torch', zero=3``: the rank's sharded
            gradients, exact given the shapes and ``units``, ``fsdp2_release_peak``) and DDP
            (``ddp=True``: the largest of DDP's buckets of local gradients, exact given the
            sizes and ``grad_order``, ``ddp_release_peak``).
        bucket_bytes: the release's bucket (default 4 MiB, as ``release_grads``).
        ddp: the replicas (``zero=0``) are ``DistributedDataParallel``'s: its gradient buckets
            (one flat buffer per bucket, the whole gradient in the params' dtype, for the
            model's life, ``gradient_as_bucket_view=False``: its default) are counted as
            ``comm_buffers``; with ``grad_release`` the step runs in DDP's comm hook
            (``release_grads(ddp=...)``), which frees the ``.grad`` but not DDP's buckets.
        ddp_bucket_cap_mb: DDP's ``bucket_cap_mb`` (default None: DDP's, 25, with a first
            bucket of 1 MiB; given, every bucket's limit, as DDP does).
        units: FSDP2's ``fully_shard`` units, each a list of param indices (into ``params``)
            in the unit's order, the units in the order FSDP2 reduces them (the last applied
            first); default each tensor its own unit, the last first. A unit's sharded
            gradients share one storage (its reduce-scatter output, padded chunks).
        grad_order: DDP's order of the gradients becoming ready (param indices); default the
            reverse of ``params`` (a chain given in forward order).
        sharding: how a ZeRO stage partitions. 'even' (default): the paper's, ceil(params /
            world_size) elements per device for every partitioned tensor class (DeepSpeed's
            flat buffers). 'torch': PyTorch's own engines, per rank and per tensor: ``zero=1``
            is ``ZeroRedundancyOptimizer`` (each tensor's state whole on one rank, the largest
            tensors first to the rank holding the fewest elements, ``zero_partition``),
            ``zero=3`` is FSDP2's ``fully_shard`` (each tensor cut on dim 0 into chunks of
            ceil(dim0 / world_size) rows: the weights and gradients hold the padded chunk, the
            optimizer state the rank's rows, ``fsdp2_shard``). Exact given the tensors'
            shapes (``[p.shape for p in model.parameters()]``); given counts, each is a 1-D
            tensor, and a bare total is spread evenly under ``zero=1``. PyTorch has no ZeRO-2
            of its own (FSDP2 with ``reshard_after_forward=False`` holds stage 3's bytes
            between steps), so 'torch' takes ``zero`` 0, 1 or 3.
        rank: with ``sharding='torch'``, the rank whose bytes to give; default the busiest
            (the largest persistent total; the lowest such rank).

    Returns a :class:`Breakdown`. Raises ``ValueError`` / ``TypeError`` naming the argument.
    """
    n, sizes, shapes = _sizes(params)
    if not known_mode(mode):
        raise ValueError("mode: unknown mode %r; choose one of %s" % (mode, ", ".join(MODES)))
    if rule is not None:
        k = rule_states(rule, momentum)
        optimizer = rule + ("-momentum" if momentum else "")
    else:
        if momentum:
            raise ValueError("momentum: SGD's option of rule='sgd'; for torch's SGD use "
                             "optimizer='sgd-momentum'")
        k = optimizer_states(optimizer)
    if not mode_supports(mode, optimizer, rule=rule):
        raise ValueError("mode: %s is mpext.optim.Adam/AdamW's leaner state; the optimizer "
                         "must be %s, got %r" % (mode, " or ".join(_spec(mode).optimizers),
                                                 optimizer))
    if not isinstance(ema, bool):
        raise TypeError("ema: must be True or False, got %r" % (ema,))
    if not mode_supports(mode, optimizer, ema, rule):
        raise ValueError("ema: mpext keeps an FP32 EMA of the weights in mpext.optim.Adam/AdamW "
                         "(ema_decay=...); with optimizer %r, %s has none (use adam or adamw)"
                         % (optimizer, mode))
    if isinstance(zero, bool) or not isinstance(zero, numbers.Integral) \
            or zero not in (0, 1, 2, 3):
        raise ValueError("zero: the ZeRO stage must be 0, 1, 2 or 3, got %r" % (zero,))
    zero = int(zero)
    w = _check_count("world_size", world_size)
    shape = {"batch": batch, "seq": seq, "hidden": hidden, "layers": layers, "heads": heads}
    given = [name for name, v in shape.items() if v is not None]
    if given and len(given) != len(shape):
        raise ValueError("activations need batch, seq, hidden, layers and heads together; "
                         "missing %s" % ", ".join(nm for nm in shape if nm not in given))
    if vocab is not None and not given:
        raise ValueError("vocab: only used by the activation estimate, which needs batch, "
                         "seq, hidden, layers and heads")
    if activation_compression(compress) is not None and not given:
        raise ValueError("compress: only used by the activation estimate, which needs batch, "
                         "seq, hidden, layers and heads")
    if not isinstance(family, str) or family not in FAMILIES:
        raise ValueError("family: no activation formula for %r (the calculator knows %s, and "
                         "does not estimate one family's model with another's formula)"
                         % (family, ", ".join(FAMILIES)))
    if not isinstance(checkpointing, bool):
        raise TypeError("checkpointing: must be True or False, got %r" % (checkpointing,))
    for name, v in (("checkpointing", checkpointing or None), ("ffn", ffn)):
        if v is not None and not given:
            raise ValueError("%s: only used by the activation estimate, which needs batch, "
                             "seq, hidden, layers and heads" % name)
    spec = _spec(mode)
    if not isinstance(grad_release, bool):
        raise TypeError("grad_release: must be True or False, got %r" % (grad_release,))
    bucket = _check_count("bucket_bytes", bucket_bytes, 0)
    if grad_release and rule is None and optimizer not in _ADAM:
        raise ValueError("grad_release: the release is mpext.optim's (release_grads()); give "
                         "rule=... or optimizer 'adam' / 'adamw', got optimizer %r" % optimizer)
    if not isinstance(ddp, bool):
        raise TypeError("ddp: must be True or False, got %r" % (ddp,))
    if ddp and zero != 0:
        raise ValueError("ddp: DistributedDataParallel replicates the model (zero=0), got "
                         "zero=%d" % zero)
    engine = ddp or (sharding == "torch" and zero == 3)
    if grad_release and w > 1 and not engine:
        raise ValueError("grad_release: not supported with more than one process but under "
                         "PyTorch's DDP (ddp=True, release_grads(ddp=...)) or FSDP2 "
                         "(sharding='torch', zero=3): the release steps the reduced "
                         "gradients those engines hand it; got world_size=%d, zero=%d, "
                         "sharding=%r" % (w, zero, sharding))
    if ddp_bucket_cap_mb is not None and (
            isinstance(ddp_bucket_cap_mb, bool) or not isinstance(ddp_bucket_cap_mb, numbers.Real)
            or not ddp_bucket_cap_mb > 0 or not math.isfinite(ddp_bucket_cap_mb)):
        raise ValueError("ddp_bucket_cap_mb: must be a number > 0, got %r" % (ddp_bucket_cap_mb,))
    fsdp2 = "sharding='torch', zero=3 (FSDP2)"
    for name, v, ok, need in (("ddp_bucket_cap_mb", ddp_bucket_cap_mb, ddp, "ddp=True"),
                              ("grad_order", grad_order, ddp, "ddp=True"),
                              ("units", units, sharding == "torch" and zero == 3, fsdp2)):
        if v is not None and not ok:
            raise ValueError("%s: only with %s" % (name, need))
        if v is not None and name != "ddp_bucket_cap_mb" and sizes is None:
            raise ValueError("%s: needs the tensors' sizes or shapes as params" % name)
    if units is not None:
        units = check_order("units", units, len(sizes))
    if grad_order is not None:
        grad_order = check_order("grad_order", [grad_order], len(sizes))[0]
    if not isinstance(sharding, str) or sharding not in SHARDINGS:
        raise ValueError("sharding: must be one of %s, got %r" % (", ".join(SHARDINGS), sharding))
    by_torch = sharding == "torch" and zero > 0
    if by_torch and zero == 2:
        raise ValueError("zero: PyTorch has no ZeRO-2 of its own; with sharding='torch' give "
                         "zero=1 (ZeroRedundancyOptimizer) or zero=3 (FSDP2's fully_shard, "
                         "whose reshard_after_forward=False holds stage 3's bytes between "
                         "steps)")
    if rank is not None:
        if sharding != "torch":
            raise ValueError("rank: only with sharding='torch' (the even partition is the same "
                             "on every rank)")
        rank = _check_count("rank", rank, 0)
        if rank >= w:
            raise ValueError("rank: must be < world_size=%d, got %d" % (w, rank))
    if by_torch and zero == 3:
        if rule is None and spec.param_format is not None and optimizer not in _ADAM:
            raise ValueError("optimizer: %s with %r is mpext.MixedPrecisionOptimizer, which has "
                             "no DTensor support, so no FSDP2; give rule=... (mpext.optim's) "
                             "or optimizer 'adam' / 'adamw'" % (mode, optimizer))

    def part(stage: int) -> int:  # elements per device of a tensor partitioned from `stage` on
        return -(-n // w) if zero >= stage else n

    # MixedPrecisionOptimizer's generic path (any optimizer but Adam/AdamW) makes FP32
    # gradients for the masters during step() and frees them after: one per master element.
    fused = rule is not None or optimizer in ("adam", "adamw")
    step_buffers = 0 if (fused or spec.master == 0) else _FP32 * part(1)
    acts, formula = None, ""
    if given:
        acts = activation_bytes(batch, seq, hidden, layers, heads, spec.activation, vocab,
                                dropout, norm_bytes=spec.norm_activation, attention=attention,
                                device=device, compress=compress, family=family, ffn=ffn,
                                checkpointing=checkpointing, activation=activation)
        formula = activation_formula(spec.activation, spec.norm_activation, vocab is not None,
                                     dropout, attention, device, compress=compress,
                                     shape=dict(batch=batch, seq=seq, hidden=hidden,
                                                heads=heads, vocab=vocab), family=family,
                                     checkpointing=checkpointing, activation=activation)
    if not spec.state_block:
        states = k * spec.state * part(1)
    elif sizes is None:  # 8-bit: codes and one FP32 scale per block, every element counted
        states = k * (spec.state * part(1) + spec.state_meta * -(-part(1) // spec.state_block))
    else:  # as the optimizer keeps each tensor (small ones in FP32), then partitioned
        states = k * sum(_tensor_state(spec, s) for s in sizes)
        states = -(-states // w) if zero >= 1 else states
    mpext_ema = spec.stepped_by_mpext or rule is not None  # the optimizer's, else a model copy
    rows = dict(weights=spec.weight * part(3),
                gradients=0 if grad_release else spec.grad * part(2),
                master_weights=spec.master * part(1), optimizer_states=states,
                ema=0 if not ema else _FP32 * (part(1) if mpext_ema else part(3)),
                step_buffers=step_buffers)
    picked = None
    if by_torch and (zero == 3 or sizes is not None):
        per_rank = [_torch_rank(spec, k, n, sizes, shapes, zero, w, r, ema, mpext_ema,
                                step_buffers > 0) for r in range(w)]
        picked = rank if rank is not None else max(
            range(w), key=lambda r: (sum(per_rank[r][f] for f in Breakdown.PERSISTENT
                                         if f in per_rank[r]), -r))
        rows = per_rank[picked]
    elif sharding == "torch":  # no partition, or a bare count spread evenly: every rank alike
        picked = 0 if rank is None else rank
    peak = _release_peak(spec, n, sizes, bucket) if grad_release else 0
    if by_torch and zero == 3 and grad_release:
        rows = dict(rows, gradients=0)
        if shapes is not None:
            peak = fsdp2_release_peak(spec.grad, shapes, w, picked, bucket,
                                      units if units is not None else default_units(len(shapes)))
        else:  # a bare count: one 1-D tensor
            peak = fsdp2_release_peak(spec.grad, [(n,)], w, picked, bucket, [[0]])
    comm = 0
    if ddp:
        comm = spec.grad * n  # DDP's buckets: one flat buffer per bucket, no padding
        if grad_release:
            cap = int((DDP_BUCKET_CAP_MB if ddp_bucket_cap_mb is None else ddp_bucket_cap_mb)
                      * MB)
            first = DDP_FIRST_BUCKET_BYTES if ddp_bucket_cap_mb is None else cap
            if sizes is None:  # a count alone: every gradient smaller than a bucket
                peak = min(spec.grad * n, cap)
            else:
                order = grad_order if grad_order is not None else \
                    list(reversed(range(len(sizes))))
                peak = ddp_release_peak(spec.grad, sizes, order, cap, first)
    return Breakdown(
        mode=mode, optimizer=optimizer, params=n, zero=zero, world_size=w,
        scaler=_FP32 * SCALER_SCALARS if spec.scaler else 0,
        activations=acts,
        autocast_copies=spec.autocast_copy * n,
        activation_formula=formula,
        grad_bucket=peak, comm_buffers=comm, grad_release=grad_release, ddp=ddp,
        sharding=sharding, rank=picked, family=family, checkpointing=checkpointing, **rows)


def _release_peak(spec: ModeSpec, n: int, sizes, bucket: int) -> int:
    """The released gradients alive at most during a backward: a bucket is stepped once its
    bytes reach ``bucket``, so just before that it holds under ``bucket`` plus the gradient that
    filled it (0: one gradient), never more than all of them. A count alone (no ``sizes``)
    takes every gradient as smaller than the bucket."""
    total = spec.grad * n
    if sizes is None:
        return min(bucket, total)
    return min(total, max(bucket - 1, 0) + spec.grad * max(sizes))


# ---------------------------------------------------------------------------------------------
# Does it fit? A GPU's memory against the estimate (``GpuBudget``), and what would make a
# configuration fit (``fit_changes``), every figure from ``estimate``

# What a process holds on a GPU besides its tensors, assumed (no GPU measured them here): the
# CUDA context with torch's kernels loaded lazily, a few hundred MiB on recent drivers; and the
# caching allocator's slack, the memory it reserves beyond the live tensors (block rounding,
# fragmentation), taken as a share of the estimate.
CUDA_CONTEXT_BYTES = 512 * 2 ** 20
ALLOCATOR_SLACK = 0.10
_GPU_UNITS = {"": 10 ** 9, "gb": 10 ** 9, "gib": 2 ** 30, "mb": 10 ** 6, "mib": 2 ** 20,
              "tb": 10 ** 12, "tib": 2 ** 40}


def gpu_memory_bytes(text: str, name: str = "gpu_memory") -> int:
    """Bytes of a memory size written ``24GB``, ``80GiB``, ``512MiB``, ``24`` (a bare number is
    GB, 10^9 bytes, the unit GPUs are sold by; a card sold as "80GB" usually holds about 80
    GiB, so give GiB for its whole memory)."""
    import re
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _GPU_UNITS:
        raise ValueError("%s: a size such as 24GB, 80GiB or 24 (GB), got %r" % (name, text))
    value = float(m.group(1)) * _GPU_UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise ValueError("%s: must be a positive size, got %r" % (name, text))
    return int(value)


@dataclasses.dataclass(frozen=True)
class GpuBudget:
    """A GPU of ``capacity`` bytes: ``context`` of it is not for tensors, and the allocator
    needs ``slack`` (a share) beyond the live tensors the estimate counts."""

    capacity: int
    context: int = CUDA_CONTEXT_BYTES
    slack: float = ALLOCATOR_SLACK

    def __post_init__(self):
        for name in ("capacity", "context"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ValueError("%s: must be a whole number of bytes >= 0, got %r" % (name, v))
        if isinstance(self.slack, bool) or not isinstance(self.slack, numbers.Real) \
                or not 0 <= self.slack < 10 or not math.isfinite(self.slack):
            raise ValueError("slack: a share of the estimate between 0 and 10, got %r"
                             % (self.slack,))
        if self.context >= self.capacity:
            raise ValueError("context: %d bytes leave nothing of a %d-byte GPU"
                             % (self.context, self.capacity))

    @property
    def usable(self) -> int:
        return self.capacity - self.context

    def need(self, b: Breakdown) -> int:
        """What ``b`` needs of the GPU: its total plus the allocator's slack."""
        return int(math.ceil(b.total * (1 + self.slack)))

    def fits(self, b: Breakdown) -> bool:
        return self.need(b) <= self.usable


# The named formats in the order a change of format is proposed: from the most state kept (the
# FP32 master's exact steps) to the least; the first that fits is proposed.
_LEANER = ("mpext-bf16", "mpext-bf16-remainder", "mpext-bf16-remainder-bf16moments",
           "mpext-bf16-remainder-8bit", "mpext-bf16-sr", "mpext-bf16-sr-8bit")
_LEANER_FP16 = ("mpext-fp16", "mpext-fp16-sr", "mpext-fp16-sr-8bit")


def fit_changes(kwargs: Dict[str, object], budget: GpuBudget) -> List[Tuple[str, Breakdown]]:
    """What to change so that ``estimate(**kwargs)`` fits ``budget``, as (what, the estimate
    with it) pairs, every figure computed by ``estimate``. First each change alone that
    applies and saves memory: a leaner format (the first of the formats, from the most state
    kept to the least, that fits; the leanest when none does), gradient release, activation
    checkpointing, compressed activations, the largest smaller micro-batch that fits. When
    none fits alone, the smallest combinations of them that fit (each with the first format
    that makes it fit); when none does, all of them with the leanest format, and with it the
    largest micro-batch that fits, if one does."""
    base = estimate(**kwargs)

    def tried(**changes):
        try:
            b = estimate(**dict(kwargs, **changes))
        except ValueError:  # a change this configuration cannot take
            return None
        return b if b.total < base.total else None

    mode = kwargs.get("mode", "mpext-bf16")
    formats = [m for m in (_LEANER_FP16 if "fp16" in mode else _LEANER) if m != mode]

    def with_format(changes):
        """(name, estimate) with the first format that makes ``changes`` fit, or the leanest."""
        found = [(m, b) for m in formats for b in [tried(mode=m, **changes)] if b is not None]
        for m, b in found:
            if budget.fits(b):
                return m, b
        return min(found, key=lambda mb: mb[1].total) if found else (None, None)

    shaped = base.activations is not None
    others = []  # (what, change) other than the format
    if not kwargs.get("grad_release"):
        others.append(("gradient release", dict(grad_release=True)))
    if shaped and not kwargs.get("checkpointing") and kwargs.get("compress") is None:
        others.append(("activation checkpointing", dict(checkpointing=True)))
        others.append(("compressed activations (FP8, policy layers)", dict(compress=True)))
    others = [(w, c) for w, c in others if tried(**c) is not None]
    out = []
    m, b = with_format({})
    if m is not None:
        out.append(("mode %s" % m, b))
    out += [(w, tried(**c)) for w, c in others]
    batch = kwargs.get("batch")

    def largest_batch(changes):
        lo, hi = 0, (batch or 1) - 1  # bisection: the total grows with the micro-batch
        while lo < hi:
            mid = (lo + hi + 1) // 2
            b = tried(batch=mid, **changes)
            lo, hi = (mid, hi) if b is not None and budget.fits(b) else (lo, mid - 1)
        return lo

    if shaped and (batch or 0) > 1:
        mb = largest_batch({})
        if mb:
            out.append(("micro-batch %d (accumulate gradients over micro-batches for the same "
                        "batch)" % mb, tried(batch=mb)))
    if any(budget.fits(b) for _, b in out):
        return out
    import itertools
    exclusive = ("checkpointing", "compress")  # not estimated together
    for r in range(1, len(others) + 2):
        fitting = []
        for use_format in (False, True):
            for combo in itertools.combinations(others, r - use_format):
                changes = {}
                for _, c in combo:
                    changes.update(c)
                if all(k in changes for k in exclusive) or not (combo or use_format):
                    continue
                names = [w for w, _ in combo]
                if use_format:
                    m, b = with_format(changes)
                    if m is None:
                        continue
                    names.insert(0, "mode %s" % m)
                else:
                    b = tried(**changes)
                if b is not None and budget.fits(b) and r > 1:
                    fitting.append((" + ".join(names), b))
        if fitting:
            return out + fitting
    # nothing fits: every change at once (checkpointing rather than compression), the leanest
    changes = {}
    for w, c in others:
        if not (set(c) & set(exclusive) and any(k in changes for k in exclusive)):
            changes.update(c)
    m, b = with_format(changes)
    if b is None:
        return out
    names = (["mode %s" % m] if m else []) + [w for w, c in others if set(c) <= set(changes)]
    out.append((" + ".join(names), b))
    if shaped and (batch or 0) > 1:
        mb = largest_batch(dict(changes, **({"mode": m} if m else {})))
        if mb:
            out.append((" + ".join(names + ["micro-batch %d" % mb]),
                        tried(batch=mb, **dict(changes, **({"mode": m} if m else {})))))
    return out
