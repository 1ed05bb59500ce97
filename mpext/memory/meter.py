"""The live measurement of mpext.memory: the bytes a training setup's tensors hold now, by the
rows of the estimate (``mpext.memory.estimator``), to check one against the other."""
from typing import Dict, Optional

__all__ = ["measure", "HeapMeter", "live_bytes", "measure_release", "peak_bytes"]

def _local(t):
    """A DTensor's local shard (what this device holds), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _storage_key(t) -> Optional[tuple]:
    st = t.untyped_storage()
    if st.nbytes() == 0:
        return None
    return (t.device.type, t.device.index, st.data_ptr())


def measure(params, optimizer=None, scaler=None) -> Dict[str, int]:
    """Bytes held now by a training setup's persistent tensors, by category, each storage
    counted once (the sum of ``untyped_storage().nbytes()`` over unique storages):

    - ``weights``: the model's ``params`` (an iterable of tensors, e.g. ``model.parameters()``);
    - ``gradients``: their ``.grad``, plus the ``.grad`` of any FP32 master an inner optimizer
      steps;
    - ``master_weights``: state entries whose key names a master (``master_param``) or a
      master's remainder (``param_remainder``, what ``param_remainders=True`` keeps instead),
      and the params of a wrapped inner optimizer (``optimizer.optimizer``) that are not model
      params;
    - ``optimizer_states``: every other per-param state tensor but the scalars (moments and
      buffers in whatever format they are stored, 8-bit codes with their per-block scales);
    - ``ema``: the FP32 EMA of the weights the optimizer keeps (``ema_param``, with
      ``ema_decay``);
    - ``scaler``: tensors held by ``scaler``, or by a scaler the optimizer keeps as
      ``.scaler`` (``mpext.MixedPrecisionOptimizer``);
    - ``other``: everything else the optimizer objects hold (``step`` and other per-param
      scalars, cached lr tensors, ...).

    A DTensor (FSDP2's params, gradients and state) counts its local shard's storage: for
    FSDP2's params the padded chunk they live in, for its gradients the reduce-scatter's output
    that the gradients of one ``fully_shard`` unit share. The optimizer chain is followed
    through a wrapper's ``optimizer`` (``mpext.MixedPrecisionOptimizer``) and a
    ``ZeroRedundancyOptimizer``'s ``optim`` (the rank's partition).

    Use it after a step (before ``zero_grad``) to compare with :func:`estimate`.
    """
    import torch

    out = {"weights": 0, "gradients": 0, "master_weights": 0, "optimizer_states": 0,
           "ema": 0, "scaler": 0, "other": 0}
    seen = set()

    def add(cat, t):
        if not isinstance(t, torch.Tensor):
            return
        t = _local(t)
        key = _storage_key(t)
        if key is None or key in seen:
            return
        seen.add(key)
        out[cat] += t.untyped_storage().nbytes()

    model_params = list(params)
    model_ids = {id(p) for p in model_params}
    for p in model_params:
        add("weights", p)
    for p in model_params:
        add("gradients", p.grad)

    chain, obj = [], optimizer
    while obj is not None and obj not in chain:
        chain.append(obj)
        inner = getattr(obj, "optimizer", None)
        if inner is None and isinstance(getattr(obj, "optim", None), torch.optim.Optimizer):
            inner = obj.optim  # ZeroRedundancyOptimizer: the rank's partition
        obj = inner if inner is not obj else None
    for opt in chain:
        for group in getattr(opt, "param_groups", ()):
            for q in group["params"]:
                if id(q) not in model_ids:
                    add("master_weights", q)
                    add("gradients", q.grad)
        for q, st in getattr(opt, "state", {}).items():
            if not isinstance(st, dict):
                continue
            for name, v in st.items():
                if not isinstance(v, torch.Tensor):
                    continue
                if "master" in str(name) or "remainder" in str(name):
                    add("master_weights", v)
                elif name == "ema_param":
                    add("ema", v)
                elif name == "step" or (v.dim() == 0 and v.numel() != getattr(q, "numel", int)()):
                    add("other", v)  # per-param scalars: the step count, NAdam's mu_product
                else:  # moments in any format, with their block scales, whatever their keys
                    add("optimizer_states", v)
    for sc in [scaler] + [getattr(o, "scaler", None) for o in chain]:
        if isinstance(sc, torch.amp.GradScaler):
            for t in _tensors_in(vars(sc)):
                add("scaler", t)
    for opt in chain:  # whatever else the optimizer objects keep
        for t in _tensors_in(vars(opt)):
            add("other", t)
    return out


def _tensors_in(obj, depth: int = 4):
    """Tensors inside nested dicts / lists / tuples (not inside other objects)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 0 and isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, depth - 1)
    elif depth > 0 and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v, depth - 1)


class HeapMeter:
    """Bytes in use by the allocator now, independent of any mpext bookkeeping: glibc's heap
    (mallinfo2: arena chunks in use + mmapped blocks, where torch's CPU allocator gets its
    memory) on the CPU, torch's allocator (``memory_allocated``) on CUDA. Collects garbage
    first, so that what it reads is what is still referenced."""

    def __init__(self, device="cpu"):
        import torch
        self.device = torch.device(device)
        if self.device.type == "cpu":
            import ctypes

            class MallInfo2(ctypes.Structure):
                _fields_ = [(n, ctypes.c_size_t) for n in (
                    "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                    "uordblks", "fordblks", "keepcost")]
            libc = ctypes.CDLL("libc.so.6")
            libc.mallinfo2.restype = MallInfo2
            self._info = libc.mallinfo2

    def __call__(self) -> int:
        import gc
        import torch
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device)
        info = self._info()
        return info.uordblks + info.hblkhd


# ---- a training run's live bytes, and the allocator's peak of a callable (the tests' and the
# benchmarks' meters, independent of mpext's own accounting)

def live_bytes(tensors) -> int:
    """Bytes of the distinct storages behind these tensors (DTensors by their local shard):
    what is alive, counted by the storages themselves, not by mpext's own accounting."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        st = t.untyped_storage()
        if st.data_ptr() not in seen and st.nbytes():
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def measure_release(params, opt, loss_fn, released: bool, bucket_bytes: int = 0, ddp=None,
                    steps: int = 2) -> dict:
    """One rank's live bytes in a training run of ``steps`` steps (the last measured: the
    state exists, DDP's buckets are rebuilt), stepped after backward or released (under DDP
    through ``ddp``'s comm hook): ``params``, ``state`` (every state tensor but the per-param
    scalars), ``grads`` (the ``.grad`` alive after the backward), ``grad_peak`` (the largest sum
    of the ``.grad`` storages seen as each gradient completes: a post-accumulate-grad hook that
    runs before the release's; under DDP the local gradients: views of DDP's buckets are its)
    and, under DDP, ``ddp_buckets`` (the Reducer's bucket buffers, read from DDP itself). All
    by the distinct storages (DTensors by their local shard): what is alive, not mpext's own
    accounting. ``loss_fn(step)`` makes a step's loss."""
    import torch
    live = {"peak": 0}

    def watch(p):
        # Under DDP (gradient_as_bucket_view=False) a local gradient is never a view; a view is
        # the average in DDP's bucket (the release points a stepped .grad there until the end
        # of backward), whose storage is DDP's, counted in ddp_buckets
        grads = (q.grad for q in params if ddp is None or q.grad is None or q.grad._base is None)
        live["peak"] = max(live["peak"], live_bytes(grads))
    handles = [p.register_post_accumulate_grad_hook(watch) for p in params]
    release = opt.release_grads(bucket_bytes=bucket_bytes, ddp=ddp) if released else None
    try:
        for step in range(steps):
            live["peak"] = 0
            loss_fn(step).backward()
            grads = live_bytes(p.grad for p in params)
            if not released:
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        for h in handles:
            h.remove()
        if release is not None:
            release.remove()
    state = [v for st in opt.state.values() for v in st.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    out = {"params": live_bytes(params), "state": live_bytes(state), "grads": grads,
           "grad_peak": live["peak"]}
    if ddp is not None:
        out["ddp_buckets"] = sum(b.buffer().untyped_storage().nbytes()
                                 for b in ddp.reducer._get_zeros_like_grad_buckets())
    return out


def _walk(nodes):
    for node in nodes:
        yield node
        yield from _walk(node.children)


def peak_bytes(fns, device) -> Dict[object, Optional[float]]:
    """Bytes each callable (a dict of them) needs at its peak above what was allocated when it
    started, as torch's allocator sees it: on CUDA its peak statistics, on the CPU one profiler
    session's allocation records (None where this torch does not expose them). The benchmarks'
    peak memory (benchmarks/README.md, "Peak memory") and the tests' allocator checks."""
    import gc
    import torch
    device = torch.device(device)
    gc.collect()
    if device.type == "cuda":
        res = {}
        for k, fn in fns.items():
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            out = fn()
            torch.cuda.synchronize(device)
            res[k] = float(torch.cuda.max_memory_allocated(device) - before)
            del out
        return res
    none = {k: None for k in fns}
    try:
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile, record_function
    except ImportError:
        return none
    tags = {"mpext_bench_peak_%d" % i: k for i, k in enumerate(fns)}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for tag, k in tags.items():
            with record_function(tag):
                out = fns[k]()
                del out
    try:
        res = dict(none)
        for root in _walk(prof.profiler.kineto_results.experimental_event_tree()):
            if root.name in tags:
                allocs = sorted((n.start_time_ns, int(n.extra_fields.alloc_size),
                                 int(n.extra_fields.total_allocated))
                                for n in _walk(root.children) if n.tag == _EventType.Allocation)
                res[tags[root.name]] = float(max(0, max(a[2] for a in allocs) - (
                    allocs[0][2] - allocs[0][1]))) if allocs else 0.0
        return res
    except (AttributeError, RuntimeError):
        return none
