"""The live measurement of mpext.memory: the bytes a training setup's tensors hold now, by the
rows of the estimate (``mpext.memory.estimator``), to check one against the other."""
from typing import Dict, Optional

__all__ = ["measure", "HeapMeter"]

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
