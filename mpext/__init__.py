"""mpext: mixed-precision training kernels for PyTorch.

Importing mpext loads the native library mpext._C, which registers the torch.ops.mpext operators
(see mpext.ops for their typed wrappers).
"""
import os as _os

import torch as _torch

try:
    from . import _C
except ImportError as _exc:  # never swallowed: a half-working mpext is worse than none
    raise ImportError(
        "mpext: the native library mpext._C failed to load (%s). It must be built against the "
        "installed PyTorch (%s): reinstall PyTorch first if needed, then rebuild with "
        "`pip install --no-build-isolation -e .` (or `make build`) in the mpext source tree."
        % (_exc, _torch.__version__)
    ) from _exc

from . import ops  # noqa: E402  (registers fake kernels and autograd formulas)
from . import optim  # noqa: E402  (mpext.optim.Adam / AdamW on the fused adam_step_)
from . import amp  # noqa: E402
from .amp import GradScaler, MixedPrecisionOptimizer  # noqa: E402
from . import _moved  # noqa: E402
from .integrations import detect as _detect  # noqa: E402,F401  (registers with the release)
from . import telemetry  # noqa: E402  (mpext.telemetry, opt-in counters)

_moved.install()  # mpext.grad_scaler, mpext.lightning, ...: the modules' old paths

__version__ = "0.1.0"


def cpu_isa():
    """The CPU ISA path ('scalar', 'avx2' or 'avx512') the CPU kernels use now."""
    return _C.cpu_isa()


def set_cpu_isa(name):
    """Selects the CPU ISA path; raises RuntimeError if this CPU does not support it and
    ValueError for an unknown name. MPEXT_CPU_ISA does the same at import time."""
    _C.set_cpu_isa(name)


def cpu_isa_supported(name):
    """Whether this CPU can run the named ISA path."""
    return _C.cpu_isa_supported(name)


def build_info():
    """What was built and what is in use: a dict with the CPU ISA paths compiled, supported and
    active, whether CUDA was built and for which archs, the torch it was built against and the
    torch running now."""
    info = dict(_C.build_info())
    info["cpu_isas_supported"] = [i for i in info["cpu_isas_compiled"] if _C.cpu_isa_supported(i)]
    info["cpu_isa_best"] = _C.cpu_isa_best()
    info["cpu_isa_active"] = _C.cpu_isa()
    info["torch_running"] = _torch.__version__
    info["cuda_available"] = bool(info["cuda_built"] and _torch.cuda.is_available())
    info["mpext_version"] = __version__
    return info


_isa = _os.environ.get("MPEXT_CPU_ISA")
if _isa:
    try:
        _C.set_cpu_isa(_isa.strip().lower())
    except (RuntimeError, ValueError) as _exc:
        raise RuntimeError("MPEXT_CPU_ISA=%s: %s" % (_isa, _exc)) from None
del _isa

__all__ = ["ops", "optim", "amp", "GradScaler", "MixedPrecisionOptimizer", "build_info", "cpu_isa",
           "set_cpu_isa", "cpu_isa_supported"]
