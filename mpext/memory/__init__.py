"""mpext.memory: the training-memory calculator ("will it fit?").

One module per job: ``estimator`` (``estimate``: the bytes a training configuration holds per
device, and whether it fits a GPU), ``modes`` (the precision modes, made from mpext.optim's
formats), ``models`` (model shapes and known models), ``activation_model`` (what autograd
saves), ``sharding`` (ZeRO and PyTorch's engines per rank), ``meter`` (``measure``: what live
tensors hold; ``HeapMeter``: the C heap), ``cli`` (``python -m mpext.memory``). docs/memory.md
documents every row. ``mpext.memory_estimate`` and ``mpext.memory_measure`` are the old names
of ``estimator`` and ``meter`` (mpext/_moved.py).
"""
from .cli import *  # noqa: F401,F403  (the calculator's names, as mpext.memory had them)
from .cli import (ALLOCATOR_SLACK, ATTENTIONS, CUDA_CONTEXT_BYTES,  # noqa: F401
                  DEFAULT_BUCKET_BYTES, DEVICES, ROWS, SCALER_SCALARS, build_parser,
                  format_table, plot)
from .cli import __all__  # noqa: F401
from .meter import HeapMeter  # noqa: F401
