"""Private helpers shared by mpext's Python modules: the kernel probe, dtype names and sets,
layout predicates, and the cached learning-rate tensors of the fused optimizers. Nothing here is
public API."""
import math
import numbers
import sys
from typing import Any, Dict, Optional

import torch

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOW_DTYPES = (torch.bfloat16, torch.float16)
# The block sizes of Adam's 8-bit moments: mpext/adam.h's MP_Q8_BLOCK_MIN / MAX.
Q8_BLOCK_MIN, Q8_BLOCK_MAX = 32, 2048
# A param smaller than this keeps FP32 moments in a group with 8-bit ones: biases and norm
# weights, a negligible share of a model's elements whose precision matters most (the size
# bitsandbytes and torchao use). mpext.optim.MIN_8BIT_NUMEL; the memory estimate counts by it.
MIN_8BIT_NUMEL = 4096

_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}

_DTENSOR: Optional[type] = None


def dtensor_type() -> Optional[type]:
    """torch's DTensor class once ``torch.distributed.tensor`` has been imported, else None: no
    tensor can be a DTensor before that module is, and importing it (which brings in
    torch._dynamo) costs about as much CPU time as ``import torch`` itself, which ``import mpext``
    would otherwise pay in every process that never shards a tensor."""
    global _DTENSOR
    if _DTENSOR is None:
        _DTENSOR = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return _DTENSOR


def is_dtensor(t: Any) -> bool:
    cls = _DTENSOR or dtensor_type()
    return cls is not None and isinstance(t, cls)


_kernels: Dict[tuple, bool] = {}


def has_kernel(op: str, device: torch.device) -> bool:
    """Whether mpext registered a kernel of ``op`` for ``device``'s backend (a CPU-only build on
    a CUDA machine has none for CUDA). Registrations are fixed once ``mpext._C`` is loaded, so
    the answer is cached: a training step never probes the dispatcher."""
    key = (op, device.type)
    found = _kernels.get(key)
    if found is None:
        dispatch_key = _DISPATCH_KEYS.get(device.type)
        found = bool(dispatch_key) and torch._C._dispatch_has_kernel_for_dispatch_key(
            "mpext::" + op, dispatch_key)
        _kernels[key] = found
    return found


def is_real(v: Any) -> bool:
    """A real number that is not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


_DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
                torch.bfloat16: "bfloat16", torch.int32: "int32", torch.int64: "int64",
                torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8",
                torch.bool: "bool"}


def dtype_name(dtype: torch.dtype) -> str:
    """The name Python users know a dtype by ("float32", as the C++ layer's messages)."""
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape lay their elements out in the same memory order (the
    strides of size-1 dimensions do not matter)."""
    return a.shape == b.shape and all(
        sa == sb for size, sa, sb in zip(a.shape, a.stride(), b.stride()) if size != 1)


def is_dense(t: torch.Tensor) -> bool:
    """Whether t is strided and covers its memory exactly once (contiguous, channels_last, any
    permutation of dimensions): what the element-wise kernels accept."""
    if t.layout != torch.strided:
        return False
    if t.numel() <= 1 or t.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1),
                               key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


class LrTensors:
    """One-element float32 tensors on the device that hold the learning rates the fused kernels
    read. A Python float lr (what LR schedulers write into ``param_groups``) is written into a
    cached tensor only when it changed, on the device, so a step makes no host sync and no
    allocation; a tensor lr is used as it is (moved to the device and float32)."""

    def __init__(self) -> None:
        self._buffers: Dict[Any, list] = {}  # key -> [tensor, the float last written]

    def get(self, key: Any, device: torch.device, lr: Any) -> torch.Tensor:
        if isinstance(lr, torch.Tensor):
            return lr.detach().to(device=device, dtype=torch.float32, non_blocking=True)
        lr = float(lr)
        buf = self._buffers.get(key)
        if buf is None or buf[0].device != device:
            buf = [torch.full((), lr, dtype=torch.float32, device=device), lr]
            self._buffers[key] = buf
        elif buf[1] != lr or math.copysign(1.0, buf[1]) != math.copysign(1.0, lr):
            buf[0].fill_(lr)  # on the device: no host sync
            buf[1] = lr
        return buf[0]

    def clear(self) -> None:
        self._buffers.clear()
