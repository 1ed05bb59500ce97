"""Shared fixtures: devices and CPU ISA paths to parametrize over; host-read counting; under
pytest-xdist (make test runs the suite in TEST_WORKERS processes), tests marked ``exclusive`` run
alone; the modules that take longest are collected first (LONGEST_MODULES)."""
import contextlib
import fcntl
import os
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


# The marks of each device (CUDA's skip where there is none), for parametrizations that pair a
# device with other values (device_cases).
DEVICE_MARKS = {"cpu": (), "cuda": DEVICES[1].marks, "meta": ()}


def device_cases(cases, ids=None, devices=("cpu", "cuda"), keep=None):
    """pytest.param(device, *case) for every device and case, to parametrize "device,..."
    directly (it overrides the ``device`` fixture): for a test whose cases differ per device, so
    that a pair that can run on no machine (the fake kernel's check once per real device, a
    cross-device case on the CPU) is never collected, instead of collected and skipped.
    ``devices`` may name "meta" (the fake kernels); ``keep(device, case)`` drops the pairs that
    can never run; a case that is not a tuple is one value."""
    out = []
    for i, case in enumerate(cases):
        values = tuple(case) if isinstance(case, tuple) else (case,)
        name = ids[i] if ids is not None else "-".join(str(v) for v in values)
        for dev in devices:
            if keep is None or keep(dev, case):
                out.append(pytest.param(dev, *values, marks=DEVICE_MARKS[dev],
                                        id="%s-%s" % (dev, name)))
    return out


def cuda_only(reason="needs a CUDA device and a CUDA build of mpext"):
    """The skip of a test that compares CUDA against the CPU (no device fixture), with why."""
    return pytest.mark.skipif(not CUDA_OK, reason="%s: %s" % (reason, NO_CUDA_REASON))


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


# ---- pytest-xdist

# The modules with the longest runs, longest first (seconds of wall in a 2-worker run of the
# whole suite on the loaded 2-core CI machine, --durations: the exhaustive RNE sweep 274; the
# 4-rank release spawn 196; four kill-and-resume chains 236; the soaks 164; ...). Under
# `--dist loadfile` a worker takes the next module whenever it runs low, so a module that takes
# minutes is best started first: pytest-xdist's own order (the modules with the most tests
# first) started these few-test modules last, and the run ended on one of them with the other
# worker idle. The Makefile passes --no-loadscope-reorder so that this order is the one used.
# (Not test_large.py: its test is exclusive, so it waits for the other worker's current test to
# end; among the long modules that could be minutes with a core idle.)
LONGEST_MODULES = ["test_cast.py", "test_resume.py", "test_release_mesh.py", "test_soak.py",
                   "test_activations.py", "test_memory_release.py", "test_fsdp_step_cache.py",
                   "test_distributed.py"]


def pytest_collection_modifyitems(config, items):
    """LONGEST_MODULES first, in that order; then every other module by its number of tests,
    most first (pytest-xdist's own reordering, which --no-loadscope-reorder turns off). The
    order of the tests inside a module is kept."""
    def module(item):
        return item.nodeid.split("::", 1)[0]

    count = {}
    for item in items:
        count[module(item)] = count.get(module(item), 0) + 1

    def key(item):
        path = module(item)
        name = os.path.basename(path)
        first = LONGEST_MODULES.index(name) if name in LONGEST_MODULES else len(LONGEST_MODULES)
        return first, -count[path], path

    items.sort(key=key)  # stable: a module's tests keep their order


def pytest_configure(config):
    """Each xdist worker takes its share of the cores for torch's intra-op threads (make test:
    2 workers on 2 cores, 1 thread each). torch's default, a thread per core in every worker,
    oversubscribes the cores, and every small op then waits in OpenMP's barrier for a thread
    the other worker has descheduled (a 300-step Linear(64, 64) loop took 24 s instead of 1 s).
    The tests that compare thread counts set theirs (the ``threads`` fixture restores it)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and hasattr(config, "workerinput"):
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked ``exclusive`` (tests/test_large.py: 13 GB) runs alone, as in a one-process
    run: its setup, call and teardown hold a lock file exclusively, every other test's hold it
    shared. A turnstile keeps the exclusive test from waiting forever: while it waits, it holds
    the turnstile, and no other test starts. The files lie in the run's base temporary
    directory, which xdist's workers share (each one's own is a folder in it)."""
    if not hasattr(item.config, "workerinput"):  # no xdist: one test at a time anyway
        yield
        return
    run_dir = item.config._tmp_path_factory.getbasetemp().parent
    exclusive = item.get_closest_marker("exclusive") is not None
    with open(run_dir / "turnstile.lock", "a") as turn, open(run_dir / "tests.lock", "a") as lock:
        fcntl.flock(turn, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        fcntl.flock(turn, fcntl.LOCK_UN)
        threads = torch.get_num_threads()
        if exclusive:  # alone on the machine: every core (pytest_configure gave it its share)
            torch.set_num_threads(len(os.sched_getaffinity(0)))
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            fcntl.flock(lock, fcntl.LOCK_UN)


def _matrix_summary():
    module = sys.modules.get("test_bad_inputs")
    return None if module is None else module.matrix_summary()


def pytest_sessionfinish(session):
    """Each xdist worker hands the bad-input matrix's summary to the controller
    (pytest_testnodedown), which prints it."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None and _matrix_summary() is not None:
        workeroutput["bad_inputs_matrix"] = _matrix_summary()


@pytest.hookimpl(optionalhook=True)  # an xdist hook, called on the controller only
def pytest_testnodedown(node, error):
    line = getattr(node, "workeroutput", {}).get("bad_inputs_matrix")
    if line is not None:
        node.config.bad_inputs_matrix = line


def pytest_terminal_summary(terminalreporter):
    """The bad-input matrix's size, when it ran (issue: print the number of cases covered)."""
    line = _matrix_summary() or getattr(terminalreporter.config, "bad_inputs_matrix", None)
    if line is not None:
        terminalreporter.write_line(line)
