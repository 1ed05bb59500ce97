"""Saved activations in 8 bits: tensors autograd keeps for the backward pass, stored with one
float32 scale per block of 128 elements along their rows and restored when the backward pass
needs them. The default code is int8 on a uniform grid under each block's absmax
(``mpext.activations_codes``: gradients within 2x BF16's error, where E4M3's 3 mantissa bits
were 3-4x); ``fp8_dtype=torch.float8_e4m3fn`` / ``float8_e5m2`` select the FP8 codes
(``mpext.ops.fp8_quantize``), which stochastic rounding needs.

    with mpext.activations.fp8_saved_tensors():          # default: the "all" policy, int8
        loss = model(x).sum()
    loss.backward()

    model = mpext.activations.FP8Activations(model, policy="size", min_bytes=1 << 20)

Policies pick which saved tensors are compressed:

- ``"all"`` (default): every floating saved tensor the rules below leave eligible (not a
  parameter, not the batch, not an index, mask or statistic without a grad_fn), one FP8 copy
  per storage. Whitelists of ops miss what stock models save: gelu_new's pointwise chain
  (four ffn-wide tensors), a hand-written RMSNorm's float32 copy of the residual stream,
  SwiGLU's product, eager attention's probabilities, a conv's input; on the zoo of stock
  models (docs/activations.md) "layers" saves 19-48%, "all" 45-53%.
- ``"layers"``: the activations the standard layers save: the inputs of linear
  layers and products (``F.linear``, ``matmul``/``@``, ``mm``, ``bmm``, ``addmm``, ``baddbmm``,
  ``einsum``: ``LINEAR_FUNCTIONS``), everything attention (``F.scaled_dot_product_attention``)
  saves (q, k, v, its output, the probabilities of the math path), what the functions of
  ``ACTIVATION_FUNCTIONS`` (GELU, SiLU, ReLU, tanh, ..., softmax) save, and the inputs of the
  normalizations of ``NORM_FUNCTIONS`` (layer, RMS, group and batch norm; their statistics stay
  exact), and the masks of ``DROPOUT_FUNCTIONS`` where they are floating (the CPU keeps them
  in the input's dtype: 0 and 1/(1-p), which FP8 restores to an ulp). These are nearly all
  of a transformer's saved bytes (the inputs of linear layers
  alone are under half), and the backward pass reads them only to form gradients, where an FP8
  rounding error averages out; the loss's softmax, masks, indices and statistics stay exact.
- ``"linear"``: the inputs of ``LINEAR_FUNCTIONS`` only.
- ``"size"``: every floating saved tensor of at least ``min_bytes``.
- a callable ``policy(tensor) -> bool``, asked about every floating saved tensor.

Whatever the policy, a tensor is saved untouched when it is a parameter, shares a parameter's
storage, or is derived from one by a view or a cast, or is a leaf of the graph such as the batch
(compressing what stays alive anyway frees nothing); when autograd saves it for exact use (integer and boolean tensors: indices, masks);
when it is smaller than ``min_numel`` elements, not float32/bfloat16/float16, or when its blocks
would not make it smaller; when it is an expanded (overlapping) view. A tensor saved several
times (one input of three projections) is compressed once. One copy per storage: a storage a
saver holds raw is compressed for no other saver (both copies would stay alive), and every
later saver of a compressed storage gets an FP8 copy, whatever the policy. A tensor changed in
place between two saves is packed anew (its version counter). Restored tensors have the saved
size and strides (a sliced view's storage offset is 0). NaN and Inf stay non-finite (E4M3 turns Inf into NaN), so a loss scaler still
sees an overflow in the gradients they produce.

Fewer tensors (``mpext.activations_recompute``; ``recompute=False`` turns the recipes off):
masks (boolean, or a CPU dropout's 0 and 1/(1-p)) are stored as bits, exactly, whatever the
policy; a tensor the policy picks that a recorded pointwise op (arithmetic, tanh, GELU, ReLU,
..., BatchNorm in training, dropout) made from stored tensors is stored as that recipe and
rerun in the backward; views covering the same dense memory share one copy. 8-bit copies alone
cannot pass 48.4% on a model whose saved tensors are all BF16 (1 B + 4 B per 128 for 2 B).

A policy that matched nothing by the end of a forward pass warns once (it usually means the
model computes its products in a way the policy does not see); one that matched float64 tensors
says so instead, once per context (the ops take 32 and 16 bits). Inside ``torch.compile``'d
code the compiled graph's own intermediates are compressed by AOTAutograd's inlined saved-tensor
hooks (``mpext.activations_compiled``: a torch whose AOTAutograd inlines GraphModule hooks,
2.13 tested; not with ``stochastic=True``), with no graph break; where that is not available
they pass unchanged and the context warns once. ``stats`` counts eager saves:
what was seen and stored: ``bytes_before`` the storages the backward no longer holds,
``bytes_after`` their FP8 copies, ``net_bytes_freed`` the difference.
"""
import collections
import contextlib
import functools
import sys
import warnings
import weakref
from typing import Callable, Optional, Union

import torch
from torch.overrides import TorchFunctionMode

from . import activations_codes as _codes
from . import activations_compiled as _compiled
from . import activations_recompute as _rc
from . import ops

__all__ = ["fp8_saved_tensors", "FP8Activations", "LINEAR_FUNCTIONS", "ATTENTION_FUNCTIONS",
           "ACTIVATION_FUNCTIONS", "NORM_FUNCTIONS", "DROPOUT_FUNCTIONS", "POLICIES"]

# The functions whose activation inputs the "linear" policy compresses.
LINEAR_FUNCTIONS = frozenset([
    torch.nn.functional.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
    torch.Tensor.__rmatmul__, torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm,
    torch.Tensor.addmm, torch.baddbmm, torch.Tensor.baddbmm, torch.einsum])
# Every floating tensor saved while one of these runs is an attention intermediate.
ATTENTION_FUNCTIONS = frozenset([torch.nn.functional.scaled_dot_product_attention])
F = torch.nn.functional
ACTIVATION_FUNCTIONS = frozenset([
    F.gelu, F.silu, F.relu, torch.relu, torch.Tensor.relu, F.mish, F.softplus, F.elu, F.selu,
    F.leaky_relu, F.hardswish, torch.tanh, torch.Tensor.tanh, torch.sigmoid,
    torch.Tensor.sigmoid, F.glu, F.softmax, torch.softmax, torch.Tensor.softmax])
NORM_FUNCTIONS = frozenset([F.layer_norm, F.rms_norm, F.group_norm, F.batch_norm])
# What these save (besides their arguments) is the dropout mask: in the input's dtype on the
# CPU, values 0 and 1 / (1 - p), which FP8 with a block scale restores (to an ulp of 1/(1-p)).
DROPOUT_FUNCTIONS = frozenset([F.dropout, torch.dropout, F.dropout1d, F.dropout2d,
                               F.dropout3d])
del F
POLICIES = ("all", "layers", "linear", "size")
_COMPILED = _compiled.supported()  # compiled graphs compress their saved tensors
_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)  # what fp8_quantize takes
_KIND = dict([(f, "linear") for f in LINEAR_FUNCTIONS] + [(f, "attention") for f in
             ATTENTION_FUNCTIONS] + [(f, "activation") for f in ACTIVATION_FUNCTIONS] +
             [(f, "norm") for f in NORM_FUNCTIONS] + [(f, "dropout") for f in DROPOUT_FUNCTIONS])

_VIEW_OR_CAST = ("ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0",
                 "PermuteBackward0", "ExpandBackward0", "UnsqueezeBackward0", "SliceBackward0",
                 "AliasBackward0", "UnsafeViewBackward0")


_APPLY = torch.autograd.Function.apply.__func__.__code__


def _saved_by_compiled_graph() -> bool:
    """Whether the tensor being packed is saved by a compiled graph's autograd function (AOT
    autograd's, at run time): its backward was compiled for exactly those tensors. A look at
    the few frames between the hook and autograd.Function.apply (hooks wrapping ours add one)."""
    f = sys._getframe(2)
    for _ in range(3):
        if f is None:
            return False
        if f.f_code is _APPLY:
            mod = getattr(f.f_locals.get("cls"), "__module__", "") or ""
            return mod.startswith(("torch._functorch", "torch._dynamo", "torch._inductor"))
        f = f.f_back
    return False


def _storage_ref(t: torch.Tensor):
    """A weak reference alive exactly while ``t``'s memory is: to its storage (whose Python
    object torch keeps while the storage lives), or to ``t`` where that cannot be had. A
    reference to the tensor or its ``_base`` dies with a view's Python object while the memory
    lives on (HF's Conv1D output), and the storage would then be coded twice."""
    try:
        return weakref.ref(t.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError):
        return weakref.ref(t._base if t._base is not None else t)


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (fake, functional)
        return -1


class _ParamStorages:
    """The storages of the parameters seen, by address, each valid only while its parameter
    lives and still holds that storage: FSDP2 frees an all-gathered parameter's storage after
    its layer's forward, and the allocator hands the same address to the next activation,
    which a bare set of addresses would then take for a parameter and never compress."""

    def __init__(self):
        self._refs = {}

    def add(self, p: torch.Tensor):
        ptr = _storage_ptr(p)
        if ptr > 0:
            self._refs.setdefault(ptr, []).append(weakref.ref(p))

    def update(self, other: "_ParamStorages"):
        for refs in other._refs.values():
            for r in refs:
                p = r()
                if p is not None:
                    self.add(p)

    def __contains__(self, ptr: int) -> bool:
        refs = self._refs.get(ptr)
        if not refs:
            return False
        alive = [r for r in refs if r() is not None and _storage_ptr(r()) == ptr
                 and r().untyped_storage().nbytes() > 0]
        self._refs[ptr] = alive
        return bool(alive)


_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter


def _is_parameter(t) -> bool:
    """``isinstance(t, Parameter)`` without the metaclass's check for a plain tensor (~0.8 us,
    several per recorded op: ~1% of GPT-2's step), which ``Parameter()`` never makes (it
    returns a Parameter, or a subclass's tensor marked ``_is_param``, which the check sees)."""
    cls = type(t)
    return cls is _Parameter or (cls is not _Tensor and isinstance(t, _Parameter))


def _is_param_like(t: torch.Tensor, param_ptrs) -> bool:
    """A parameter, a tensor sharing a parameter's storage, or a view or cast of one."""
    if _is_parameter(t) or (t.is_leaf and t.requires_grad):
        return True
    if _storage_ptr(t) in param_ptrs:
        return True
    base = t._base
    if base is not None and (_is_parameter(base) or
                             (base.is_leaf and base.requires_grad)):
        return True
    fn = t.grad_fn
    for _ in range(3):  # a short chain of views and casts down to an AccumulateGrad
        if fn is None or fn.name() not in _VIEW_OR_CAST:
            return False
        nexts = [f for f, _ in fn.next_functions if f is not None]
        if len(nexts) != 1:
            return False
        fn = nexts[0]
        if type(fn).__name__ == "AccumulateGrad":
            return True
    return False


block_cols = _codes.block_cols  # the rows every code quantizes (memory_estimate uses it)


def _non_overlapping(t: torch.Tensor) -> bool:
    """No two elements share memory (sufficient test: each dimension, by increasing stride,
    steps past everything the smaller ones span), so a tensor of its strides can be written."""
    span = 0
    for st, n in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if st <= span:
            return False
        span += (n - 1) * st
    return True


class _Packed(_rc.Reuse):
    """One compressed tensor: its FP8 codes, their scales, and how to rebuild it with the
    saved tensor's exact size and strides (a compiled backward asserts them, and a kernel may
    pick its path by them)."""
    __slots__ = ("q", "scales", "shape", "stride", "contiguous", "dtype", "block", "nbytes",
                 "merged", "pending", "uses", "unpacked", "mshape")

    def __init__(self, t: torch.Tensor, block: int, fp8_dtype, pow2: bool, stochastic: bool,
                 seed: int, offset: int):
        x = t.detach()
        self.mshape = None
        if not x.is_contiguous() and fp8_dtype == torch.int8 and _dense(x):
            # transposed, permuted, channels_last: coded in memory order (its dims by
            # decreasing stride: a contiguous view, no copy), restored as a view of that
            # order: a transposing copy each way cost more than the code itself (0.4-2 ns
            # per element against 0.4-0.6; 31-37% of the ViT's and GPT's coded elements)
            order = sorted(range(x.dim()), key=lambda d: -x.stride(d))
            xm = x.permute(order)
            if xm.is_contiguous():
                x, self.mshape = xm, xm.shape
        if not x.is_contiguous():
            x = x.contiguous()  # the blocks run along the last dimension of the row-major copy
        self.shape, self.stride, self.dtype, self.block = t.shape, t.stride(), t.dtype, block
        self.contiguous = t.is_contiguous()
        if fp8_dtype == torch.int8:
            self.merged = None
            self.q, self.scales = _codes.quantize(x, block, pow2)
        else:
            cols = block_cols(x.numel(), x.shape[-1], block)
            self.merged = cols != x.shape[-1]
            if self.merged:  # short rows: whole blocks of consecutive elements instead
                x = x.view(-1, cols)
            self.q, self.scales = ops.fp8_quantize(x, block_size=block, fp8_dtype=fp8_dtype,
                                                   pow2_scale=pow2, stochastic=stochastic,
                                                   seed=seed, offset=offset)
        self.nbytes = self.q.numel() + 4 * self.scales.numel()
        self.pending, self.uses, self.unpacked = None, 1, 0

    def _raw(self) -> torch.Tensor:
        if self.merged is None:
            return _codes.dequantize(self.q, self.scales, self.block, self.dtype,
                                     self.mshape if self.mshape is not None else self.shape)
        out = ops.fp8_dequantize(self.q, self.scales, block_size=self.block, dtype=self.dtype)
        return out.view(self.shape) if self.merged else out

    def _finish(self, out) -> torch.Tensor:
        if out.stride() == self.stride and self.mshape is None:
            return out
        if self.contiguous or self.mshape is not None:
            # the same addressing: contiguous but for the strides of size-1 dims, or the
            # memory order's contiguous copy of a dense layout
            return out.as_strided(self.shape, self.stride)
        # transposed, permuted, channels_last, sliced: the layout the saver had (a sliced
        # tensor's storage offset is not kept: nothing reads it, and a fresh one is aligned)
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype,
                                   device=out.device).copy_(out)


def _used_again(obj):
    """One more save returned ``obj``: one more unpack to keep its restored value for."""
    if isinstance(obj, _Reshaped):
        obj = obj.packed
    if hasattr(obj, "uses"):
        obj.uses += 1


def _entry(cache: dict, t: torch.Tensor) -> "_Storage":
    """The entry of ``t``'s storage, made if the address has none or the storage that had it
    died (an address handed out again)."""
    ptr = _storage_ptr(t)
    entry = cache.get(ptr)
    storage = _storage_ref(t)
    if entry is None or not entry.alive(storage):
        entry = cache[ptr] = _Storage()
        entry.refs.append(storage)
    return entry


def _dense(t: torch.Tensor) -> bool:
    """Its elements fill a span of memory with no gap and no overlap (contiguous, transposed,
    permuted, channels_last)."""
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 1)
    return t.numel() > 0 and span == t.numel() and _non_overlapping(t)


def _contiguous(shape, stride) -> bool:
    expect = 1
    for n, st in reversed(list(zip(shape, stride))):
        if n != 1 and st != expect:
            return False
        expect *= n
    return True


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _Reshaped:
    """A compressed tensor restored in another shape: the same elements, saved again as
    another contiguous view (no second FP8 copy)."""
    __slots__ = ("packed", "shape", "stride", "nbytes", "ops")

    def __init__(self, packed, shape, stride):
        self.packed, self.shape, self.stride = packed, shape, stride
        self.nbytes = 0  # the bytes are the other view's
        self.ops = getattr(packed, "ops", 0)

    def restore(self) -> torch.Tensor:
        return self._view(self.packed.restore())

    def value(self) -> torch.Tensor:
        return self._view(self.packed.value() if hasattr(self.packed, "value") else
                          self.packed.restore())

    def _view(self, base) -> torch.Tensor:
        # base: dense, in the saved layout: the same memory span
        if base.is_contiguous() and _contiguous(self.shape, self.stride):
            return base.reshape(self.shape).as_strided(self.shape, self.stride)
        return base.as_strided(self.shape, self.stride, base.storage_offset())


class _Storage:
    """What a context knows of one storage: weak references to the tensors saved from it
    (alive: the address still means this storage), whether a saver holds it raw, and its
    compressed views by (version, offset, shape, stride, dtype)."""
    __slots__ = ("refs", "raw", "views", "rawviews")

    def __init__(self):
        self.refs, self.raw, self.views, self.rawviews = [], False, {}, {}

    def alive(self, storage=None) -> bool:
        """Whether the storage this entry describes still lives (and, given ``storage``, the
        weak reference to the storage now at its address, is that one)."""
        for r in self.refs:
            s = r()
            if s is not None:
                return storage is None or storage() is None or storage() is s
        return False


class _Recorder(TorchFunctionMode):
    """Notes parameters as they are used and, for the "linear" policy, which call of a matrix
    product is running and which of its arguments are activations."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            # dynamo traces this mode: storage addresses do not trace (a graph break per
            # parameter), and a compiled graph's saved tensors pass the hooks unchanged
            return func(*args, **kwargs)
        st = self.state
        flat = [a for a in args if isinstance(a, torch.Tensor)]
        if func is torch.einsum:
            flat += [a for a in args if isinstance(a, (list, tuple))
                     for a in a if isinstance(a, torch.Tensor)]
        for a in flat:
            if _is_parameter(a):
                st.param_ptrs.add(a)
        kind = _KIND.get(func)
        pointwise = func in _rc.POINTWISE and st.recompute
        if kind is None:
            if not pointwise:
                return func(*args, **kwargs)
            kind = "pointwise"  # seen by the pack hook only to tell its output apart
        acts = [(a.numel(), a.shape[-1] if a.dim() else 0) for a in flat
                if not _is_parameter(a) and a.is_floating_point()]
        # [] collects the masks a dropout saves; [None]: the recipe of the output, if the op
        # saved its own output (tanh, relu) and the pack hook made it then: one Node per op
        call = (func, args, kwargs, [], [None])
        st.linear_stack.append((kind, acts, {_storage_ptr(a) for a in flat}, call))
        try:
            out = func(*args, **kwargs)
        finally:
            st.linear_stack.pop()
        if st.recompute and isinstance(out, torch.Tensor) and out.grad_fn is not None \
                and out.is_floating_point():
            node = call[4][0]
            if node is None or node.version != out._version:
                node = _recipe(st, func, args, kwargs, call[3], out)
            if node is not None:
                try:
                    out._mpext_node = node
                except (AttributeError, RuntimeError):  # a tensor type without attributes
                    pass
        return out


_BATCH_NORM_NODES = ("NativeBatchNormBackward0", "CudnnBatchNormBackward0")


def _recipe(st, func, args, kwargs, masks, out):
    """The recipe of ``out = func(*args, **kwargs)``: a pointwise op over tensors none of which
    is a parameter (gradient release may step one before the backward reads ``out``), a
    dropout (its input times the mask it saved), BatchNorm in training (a per-channel affine
    map of its input with the batch's statistics); None for anything else."""
    if func in _rc.POINTWISE:
        if kwargs.get("inplace") or "out" in kwargs or any(
                isinstance(v, torch.Tensor) for v in kwargs.values()):
            return None
        refs = []
        for a in args:
            if isinstance(a, torch.Tensor):
                if _is_param_like(a, st.param_ptrs) or not a.is_floating_point():
                    return None
                refs.append(_rc.Ref(a, _entry(st.cache, a)))
            elif isinstance(a, (int, float)) and not isinstance(a, bool):
                refs.append(a)  # a bool is F.relu's / F.silu's positional inplace: no recipe
            else:
                return None
        return _rc.Node(func, refs, dict(kwargs), out._version)
    if func in DROPOUT_FUNCTIONS:
        x = args[0] if args else kwargs.get("input")
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        if len(masks) != 1 or not isinstance(x, torch.Tensor) or kwargs.get("inplace") or \
                _is_param_like(x, st.param_ptrs) or masks[0].shape != out.shape:
            return None
        return _rc.Node(_rc.dropout_apply, [_rc.Ref(x, _entry(st.cache, x)), _rc.Leaf(masks[0]),
                                            1.0 / (1.0 - p)], {}, out._version)
    if func is torch.nn.functional.batch_norm:
        names = ("input", "running_mean", "running_var", "weight", "bias", "training",
                 "momentum", "eps")
        a = dict(zip(names, args), **kwargs)
        x, gf = a.get("input"), out.grad_fn
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or gf.name() not in _BATCH_NORM_NODES \
                or _is_param_like(x, st.param_ptrs):
            return None
        if not (a.get("training") or a.get("running_mean") is None):
            return None  # eval: running statistics, which the step updates in place
        with torch.no_grad():
            invstd = gf._saved_result2.float()
            w, b = a.get("weight"), a.get("bias")
            scale = invstd * w.float() if w is not None else invstd
            shift = -gf._saved_result1.float() * scale
            if b is not None:
                shift = shift + b.float()
        return _rc.Node(_rc.affine, [_rc.Ref(x, _entry(st.cache, x)), _rc.Leaf(scale),
                                     _rc.Leaf(shift)], {}, out._version)
    return None


class _State:
    def __init__(self):
        self.param_ptrs = _ParamStorages()
        self.linear_stack = []
        self.recompute = True
        self.cache = {}  # storage address -> _Storage (the pack hook's)
        self.calls = {}  # recorded op (Node) -> its Call in the recipes (shared)


class fp8_saved_tensors(contextlib.ContextDecorator):
    """Context manager (and decorator): tensors autograd saves inside it are stored in FP8 as the
    policy selects (see the module's documentation) and restored for the backward pass.

    Args:
        policy: ``"all"`` (default), ``"layers"``, ``"linear"``, ``"size"`` or a callable
            ``(tensor) -> bool``.
        fp8_dtype: the 8-bit code: ``None`` (default) is ``torch.int8`` (a uniform grid under
            each block's absmax, ``mpext.activations_codes``: the gradient error within 2x
            BF16's), or ``torch.float8_e4m3fn`` when ``stochastic``; ``torch.float8_e4m3fn``
            (3 mantissa bits: ~3x BF16's gradient error) or ``torch.float8_e5m2``.
        block_size: elements of the last dimension per scale (128, as DeepSeek-V3's 1x128);
            a tensor whose rows are shorter is scaled per block of consecutive elements.
        pow2_scale: round every scale up to a power of two.
        stochastic: stochastic rounding (counter-based, reproducible from ``seed``).
        min_bytes: the ``"size"`` policy's threshold.
        min_numel: tensors smaller than this are never compressed.
        params: parameters (or a module) whose storage is never compressed; parameters the
            forward pass uses are recognised without it.
        warn_unmatched: warn when the policy compressed nothing, or matched float64 tensors.
        recompute: store a tensor the policy picks that a recorded pointwise chain made from
            stored tensors (GELU's output, gelu_new's chain, ReLU after BatchNorm, a dropout's
            output) as that chain, rerun in the backward (``mpext.activations_recompute``);
            False: an 8-bit copy of it instead.
    """

    def __init__(self, policy: Union[str, Callable[[torch.Tensor], bool]] = "all", *,
                 fp8_dtype: Optional[torch.dtype] = None, block_size: int = 128,
                 pow2_scale: bool = False, stochastic: bool = False, seed: int = 0,
                 min_bytes: int = 1 << 16, min_numel: int = 1024, params=None,
                 warn_unmatched: bool = True, recompute: bool = True):
        if not (callable(policy) or policy in POLICIES):
            raise ValueError("mpext.activations: policy must be one of %s or a callable "
                             "(tensor) -> bool, got %r" % (", ".join(map(repr, POLICIES)), policy))
        code = fp8_dtype
        if code is None:  # stochastic rounding exists for the FP8 codes only
            code = torch.float8_e4m3fn if stochastic else torch.int8
        if code not in ops.FP8_DTYPES + (torch.int8,):
            raise ValueError("mpext.activations: fp8_dtype must be torch.int8, "
                             "torch.float8_e4m3fn or torch.float8_e5m2, got %s" % (fp8_dtype,))
        if stochastic and code == torch.int8:
            raise ValueError("mpext.activations: stochastic=True needs an FP8 fp8_dtype "
                             "(torch.float8_e4m3fn or torch.float8_e5m2); the int8 code rounds "
                             "to nearest only")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError("mpext.activations: block_size must be an int >= 1, got %r"
                             % (block_size,))
        if not isinstance(recompute, bool):
            raise ValueError("mpext.activations: recompute must be True or False, got %r"
                             % (recompute,))
        self.recompute = recompute
        self.policy, self.fp8_dtype, self.block_size = policy, fp8_dtype, block_size
        self.code = code  # fp8_dtype as given (None: the default); code: the one in use
        self.pow2_scale, self.stochastic, self.seed = pow2_scale, stochastic, seed
        self.min_bytes, self.min_numel, self.warn_unmatched = min_bytes, min_numel, warn_unmatched
        if isinstance(params, torch.nn.Module):
            params = list(params.parameters())
        self._fixed_params = _ParamStorages()
        for p in params or ():
            self._fixed_params.add(p)
        self.stats = {}
        self._stack, self._warned = [], set()  # the warnings given (once per context)

    # -- the hooks

    def _eligible(self, t: torch.Tensor, st: _State) -> bool:
        """Whether ``t`` can be compressed at all, whatever the policy: a floating activation
        (not a parameter, its view or cast, nor a leaf such as the batch: they stay alive
        anyway) whose elements occupy memory of their own (not an expanded view)."""
        if not t.is_floating_point() or t.dtype in ops.FP8_DTYPES:
            return False  # integer, boolean (exact use), already fp8
        if t.layout != torch.strided or t.dim() == 0 or not _non_overlapping(t):
            return False
        if t.grad_fn is None:  # a leaf (the batch the caller holds), or a mask made here
            return self._is_mask(t, st)
        return not _is_param_like(t, st.param_ptrs)

    @staticmethod
    def _is_mask(t: torch.Tensor, st: _State) -> bool:
        """A tensor outside the graph that a dropout made while it ran: none of its arguments
        (which the caller holds). Not attention's: its log-sum-exp has no grad_fn either, and
        an exponent must stay exact."""
        if not st.linear_stack or t.requires_grad:
            return False
        kind, _, args, _ = st.linear_stack[-1]
        return kind == "dropout" and _storage_ptr(t) not in args

    def _wants(self, t: torch.Tensor, st: _State) -> bool:
        """The policy's choice for an eligible ``t`` (float64 counted as matched, not taken)."""
        if not self._matches(t, st):
            return False
        if t.dtype not in _SUPPORTED:  # float64: matched, but the ops take 32 and 16 bits
            self.stats["unsupported"][t.dtype] += 1
            return False
        return True

    def _matches(self, t: torch.Tensor, st: _State) -> bool:
        if t.numel() < self.min_numel:
            return False
        cols = block_cols(t.numel(), t.shape[-1], self.block_size)
        packed = 1 + 4.0 / max(1, min(self.block_size, cols))
        if packed > 0.75 * t.element_size():
            return False  # blocks too short to save anything
        if self.policy in ("layers", "linear"):
            if not st.linear_stack or st.linear_stack[-1][0] == "pointwise":
                return False
            kind, acts, _, _ = st.linear_stack[-1]
            if kind != "linear" and self.policy == "linear":
                return False
            # attention: all it saves; dropout: its mask; the others: the tensors shaped as an
            # activation argument (not a weight's cast, transpose or view)
            return kind in ("attention", "dropout") or any(t.numel() == n and t.shape[-1] == c
                                                           for n, c in acts)
        if self.policy == "all":
            return True
        if self.policy == "size":
            return t.numel() * t.element_size() >= self.min_bytes
        return bool(self.policy(t))

    def _pack(self, t: torch.Tensor, st: _State, cache: dict):
        if torch.compiler.is_compiling() or _saved_by_compiled_graph():
            # A compiled graph's saved tensors are traced with it: this hook's bookkeeping
            # (weak references, a cache, a Python policy) does not trace, so they stay as they
            # are; __exit__ says so (warning here would break the graph being traced).
            self.stats["compiled"] = self.stats.get("compiled", 0) + 1
            return t
        s = self.stats
        s["saved"] = s.get("saved", 0) + 1
        # One entry per storage: whether some saver holds it raw, and its compressed views at
        # the version they were made of. A storage is compressed only if every saver of it gets
        # a compressed copy: a raw saver keeps the whole storage alive, and an FP8 copy beside
        # it would add bytes (a CNN's ReLU output, which the next conv saves too).
        entry = _entry(cache, t)
        view = (t._version, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if not entry.raw and self._is_bits_mask(t, st):
            hit = entry.views.get(view)
            if hit is not None:
                _used_again(hit)
            else:
                hit = _rc.Bits.make(t)
                if hit is not None:
                    entry.views[view] = hit
                    s["compressed"] = s.get("compressed", 0) + 1
                    s["bytes_before"] += t.untyped_storage().nbytes()
                    s["bytes_after"] += hit.nbytes
                    s["net_bytes_freed"] = s["bytes_before"] - s["bytes_after"]
            if hit is not None:
                if st.linear_stack:  # the dropout's output is its input times this mask
                    st.linear_stack[-1][3][3].append(hit)
                return hit
        if entry.raw or not self._eligible(t, st):
            entry.raw = True
            entry.rawviews[view] = t  # a leaf a recomputation may read: kept alive anyway
            return t
        hit = entry.views.get(view)
        if hit is not None:
            _used_again(hit)
            return hit
        # the same elements in another shape or layout (a 3-d activation and linear's 2-d view
        # of it; the CPU's SDPA output, saved transposed by SDPA and as a (b*s, h) view by the
        # out-projection): one copy for every view that covers the same dense memory
        dense = _dense(t)
        same = entry.views.get((t._version, t.storage_offset(), t.numel(), t.dtype))
        if same is not None and dense:
            entry.views[view] = out = _Reshaped(same, t.shape, t.stride())
            _used_again(same)  # restoring the view unpacks ``same``
            return out
        # another view of a storage compressed at this version: compressed too, whatever the
        # policy says (raw, it would keep the storage alive beside the FP8 copies)
        compressed_here = any(k[0] == t._version for k in entry.views)
        if not compressed_here:
            if entry.views:  # made of older values: this save is the storage's first again
                entry.views.clear()
            if not self._wants(t, st):
                entry.raw = True
                entry.rawviews[view] = t
                return t
        elif t.dtype not in _SUPPORTED:
            entry.raw = True
            entry.rawviews[view] = t
            return t
        packed = self._recomputed(t, st, cache) if st.recompute else None
        if packed is None:
            packed = _Packed(t, self.block_size, self.code, self.pow2_scale, self.stochastic,
                             self.seed, self._offset)
            self._offset += t.numel()
        entry.views[view] = packed
        if dense:
            entry.views[(t._version, t.storage_offset(), t.numel(), t.dtype)] = packed
        s["compressed"] = s.get("compressed", 0) + 1
        if not compressed_here:  # the storage the backward no longer holds
            s["bytes_before"] = s.get("bytes_before", 0) + t.untyped_storage().nbytes()
        s["bytes_after"] = s.get("bytes_after", 0) + packed.nbytes
        s["net_bytes_freed"] = s["bytes_before"] - s["bytes_after"]
        return packed

    def _is_bits_mask(self, t: torch.Tensor, st: _State) -> bool:
        """A mask autograd keeps for exact use, stored as bits (``activations_recompute.Bits``,
        exact, whatever the policy): a boolean tensor (CUDA's dropout) or the floating mask a
        CPU dropout made (0 and 1/(1-p); ``Bits.make`` checks the values)."""
        if t.layout != torch.strided or t.numel() < self.min_numel or t.requires_grad or \
                not _non_overlapping(t):
            return False
        if t.dtype == torch.bool:
            return True
        if not t.is_floating_point() or t.grad_fn is not None or not st.linear_stack:
            return False
        # a dropout's mask, or the one the CPU's SDPA math path makes with dropout (beside it
        # attention saves its log-sum-exp without a grad_fn: Bits.make finds other values)
        kind, _, args, _ = st.linear_stack[-1]
        return kind in ("dropout", "attention") and _storage_ptr(t) not in args

    def _recomputed(self, t: torch.Tensor, st: _State, cache: dict):
        """``t`` as a recipe over stored leaves (``activations_recompute``), or None: ``t`` is
        the output of a recorded pointwise op (or a view covering it), and every tensor the
        recipe reads is stored (an 8-bit copy, a bit mask, a raw tensor a saver keeps) or
        itself recomputable, in at most ``MAX_OPS`` ops."""
        node, src = getattr(t, "_mpext_node", None), t
        base = t._base
        if node is None and base is not None and t.is_contiguous() and base.is_contiguous() \
                and t.numel() == base.numel() and t.storage_offset() == base.storage_offset():
            node, src = getattr(base, "_mpext_node", None), base
        if node is not None and node.version != src._version:
            node = None  # changed in place since it was made
        if node is None and st.linear_stack:
            kind, _, ptrs, call = st.linear_stack[-1]
            if kind in ("pointwise", "activation") and t.grad_fn is not None and \
                    _storage_ptr(t) not in ptrs:  # the running op's output (tanh's, relu's)
                node = call[4][0]
                if node is None:
                    node = call[4][0] = _recipe(st, call[0], call[1], call[2], call[3], t)
        if node is None:
            return None
        budget = [_rc.MAX_OPS]
        tree = self._resolve_node(node, cache, budget, st.calls)
        if tree is None:
            return None
        return _rc.Recomputed(tree, t.shape, t.stride(), _rc.MAX_OPS - budget[0])

    def _resolve_node(self, node, cache, budget, calls):
        # one Call per recorded op, shared by every recipe reaching it, so that restoring one
        # saved tensor of a chain hands the values it computes to the others (Reuse)
        call = calls.get(node)
        if call is not None:
            budget[0] -= call.nops
            return call if budget[0] >= 0 else None
        start = budget[0]
        budget[0] -= 1
        if budget[0] < 0:
            return None
        args = []
        for a in node.args:
            if isinstance(a, _rc.Ref):
                a = self._resolve_ref(a, cache, budget, calls)
                if a is None:
                    return None
            args.append(a)
        call = calls[node] = _rc.Call(node.func, args, node.kwargs, node.amp)
        call.nops = start - budget[0]
        return call

    def _resolve_ref(self, ref, cache, budget, calls):
        entry = ref.entry  # the storage's entry when the op ran: it may have died since
        if entry is not None:
            obj = entry.views.get(ref.key)
            if obj is None:
                obj = entry.rawviews.get(ref.key)
            if obj is None and not entry.raw:  # the same elements in another contiguous view
                version, offset, shape, stride, dtype = ref.key
                same = entry.views.get((version, offset, _numel(shape), dtype))
                if same is not None and _contiguous(shape, stride) and \
                        getattr(same, "contiguous", True):
                    obj = _Reshaped(same, shape, stride)
            if obj is not None:
                ops = getattr(obj, "ops", 0) if not isinstance(obj, torch.Tensor) else 0
                budget[0] -= ops
                return _rc.Leaf(obj) if budget[0] >= 0 else None
        if ref.node is not None:
            return self._resolve_node(ref.node, cache, budget, calls)
        return None

    @staticmethod
    def _unpack(obj):
        return obj if isinstance(obj, torch.Tensor) else obj.restore()

    def pack(self, t: torch.Tensor):
        """The pack hook of the innermost active use of this context, to call from a hook of
        one's own (a measurement wrapping the compression): returns what the backward pass will
        hold, ``t`` itself or an object with ``nbytes`` and ``restore()``."""
        if not self._stack:
            raise RuntimeError("mpext.activations: pack() needs the context to be active")
        _, _, st, cache, _ = self._stack[-1]
        return self._pack(t, st, cache)

    unpack = _unpack

    # -- the context

    def __enter__(self):
        if torch.compiler.is_compiling():  # dynamo is tracing a `with` inside compiled code
            _entered_while_compiling(self)
        st = _State()
        st.recompute = self.recompute
        st.param_ptrs.update(self._fixed_params)
        cache = st.cache
        self._offset = getattr(self, "_offset", 0)
        self.stats = {"saved": 0, "compressed": 0, "bytes_before": 0, "bytes_after": 0,
                      "net_bytes_freed": 0, "compiled": 0, "unsupported": collections.Counter()}
        eager_pack = functools.partial(self._pack, st=st, cache=cache)
        if _COMPILED and not self.stochastic:
            # GraphModule hooks, which AOTAutograd inlines into compiled graphs; on a real
            # tensor they call eager_pack (a compiled stochastic rounding would repeat its
            # random stream every step: those graphs keep the pass-through)
            active = _compiled.active(eager_pack)
            hooks = torch.autograd.graph.saved_tensors_hooks(*_compiled.hooks(
                self.block_size, self.code, self.pow2_scale, self.min_numel, self.policy,
                self.min_bytes))
        else:
            active = contextlib.nullcontext()
            hooks = torch.autograd.graph.saved_tensors_hooks(eager_pack, self._unpack)
        recorder = _Recorder(st)
        active.__enter__()
        hooks.__enter__()
        try:
            recorder.__enter__()
        except BaseException:
            hooks.__exit__(None, None, None)
            active.__exit__(None, None, None)
            raise
        self._stack.append((hooks, recorder, st, cache, active))
        return self

    def __exit__(self, *exc):
        hooks, recorder, _, _, active = self._stack.pop()
        recorder.__exit__(*exc)
        hooks.__exit__(*exc)
        active.__exit__(*exc)
        if exc[0] is None:
            self._warn()
        return False

    def _warn(self):
        s, once = self.stats, self._warned
        if s["compiled"] and "compiled" not in once:
            once.add("compiled")
            warnings.warn(
                "mpext.activations: %d tensors were saved inside torch.compile'd code and are NOT "
                "compressed (%s). To compress them, run that part eagerly: leave it out of "
                "torch.compile or wrap it in torch.compiler.disable." % (
                    s["compiled"], "stochastic rounding is eager only" if _COMPILED else
                    "torch %s does not inline saved-tensor hooks into compiled graphs "
                    "(saved_tensors_hooks_are_inlineable; 2.13 does)" % torch.__version__), stacklevel=3)
        if not self.warn_unmatched:
            return
        if s["unsupported"]:
            if "dtype" in once:
                return
            once.add("dtype")
            kinds = " and ".join("%d %s" % (n, str(d).replace("torch.", ""))
                                 for d, n in s["unsupported"].items())
            warnings.warn(
                "mpext.activations: the policy %r matched %s saved tensors, left uncompressed: "
                "FP8 compression takes float32, bfloat16 and float16 only; run the model in one "
                "of them (model.float() or model.bfloat16(); autocast leaves float64 as it is)"
                % (self.policy, kinds), stacklevel=3)
        elif s["saved"] > 0 and s["compressed"] == 0:
            warnings.warn("mpext.activations: the policy %r compressed none of the %d tensors "
                          "autograd saved" % (self.policy, s["saved"]), stacklevel=3)


@torch.compiler.disable
def _entered_while_compiling(ctx):
    """Called (not traced: a graph break of its own) when dynamo traces the context's entry.
    Dynamo cannot trace the saved-tensor hooks' entry either, so the compiled function is cut
    into graphs at the ``with``, and the pieces' saved tensors may pass uncompressed (a
    compiled MLP's did: its gradients were the uncompressed ones bit for bit); entered around
    the compiled call it costs no break and compresses."""
    if "entered compiled" in ctx._warned:
        return
    ctx._warned.add("entered compiled")
    warnings.warn(
        "mpext.activations: fp8_saved_tensors was entered inside a torch.compile'd function: "
        "dynamo cannot trace the context's entry (saved-tensor hooks), so the function is split "
        "into several graphs there (graph breaks), and the saved tensors of the pieces may "
        "not be compressed at all. "
        "Enter the context around the compiled call instead -- `with fp8_saved_tensors(): "
        "loss = compiled_model(x)` -- where the compiled graph compresses its saved tensors "
        "with no graph break.", stacklevel=3)


class FP8Activations(torch.nn.Module):
    """Wraps a module so that its forward pass runs under :class:`fp8_saved_tensors` (same
    arguments); its parameters are never compressed. ``stats`` holds the last forward's counts."""

    def __init__(self, module: torch.nn.Module, policy="all", **kwargs):
        super().__init__()
        self.module = module
        kwargs.pop("params", None)
        # one context for every call, so that stochastic rounding moves on through its stream
        self.ctx = fp8_saved_tensors(policy, params=module, **kwargs)

    @property
    def stats(self):
        return self.ctx.stats

    def forward(self, *args, **kwargs):
        with self.ctx:
            return self.module(*args, **kwargs)
