"""Shared fixtures: devices and CPU ISA paths to parametrize over; host-read counting."""
import contextlib
import sys

import pytest
import torch

import mpext

BUILD = mpext.build_info()
CUDA_OK = BUILD["cuda_available"]
NO_CUDA_REASON = ("no CUDA device" if BUILD["cuda_built"] else
                  "mpext was built without CUDA (torch has no CUDA or nvcc was not found)")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA_OK,
                                                                   reason=NO_CUDA_REASON))]


def isa_params():
    """Every ISA path compiled in; those this CPU cannot run are skipped with the reason."""
    out = []
    for name in BUILD["cpu_isas_compiled"]:
        ok = mpext.cpu_isa_supported(name)
        out.append(pytest.param(name, marks=pytest.mark.skipif(
            not ok, reason="this CPU does not support the %s path" % name)))
    return out


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(params=isa_params())
def isa(request):
    """Runs the test with the given CPU ISA path active, restoring the previous one after."""
    previous = mpext.cpu_isa()
    mpext.set_cpu_isa(request.param)
    yield request.param
    mpext.set_cpu_isa(previous)


@pytest.fixture
def threads():
    """Restores torch's thread count after a test changes it."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


class HostReads:
    """Counts the Python-level reads of tensor values (item, tolist, bool(), float(), int(),
    index): each is a host synchronisation when the tensor lives on an accelerator."""
    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self):
        self.calls = []

    @contextlib.contextmanager
    def counting(self):
        originals = {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def wrap(name):
            def reader(t, *args, **kwargs):
                self.calls.append(name)
                return originals[name](t, *args, **kwargs)
            return reader

        for n in self.NAMES:
            setattr(torch.Tensor, n, wrap(n))
        try:
            yield self
        finally:
            for n, f in originals.items():
                setattr(torch.Tensor, n, f)

    @property
    def count(self):
        return len(self.calls)


def pytest_terminal_summary(terminalreporter):
    """The bad-input matrix's size, when it ran (issue: print the number of cases covered)."""
    module = sys.modules.get("test_bad_inputs")
    if module is not None:
        terminalreporter.write_line(module.matrix_summary())
