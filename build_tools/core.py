"""How the C core is compiled: one source of truth for setup.py, the C tests (tests/c/run.py) and
the CUDA emulation harness (tests/cuda_emu/run.py), which all compile it through core_jobs() and
compile_all() (parallel, incremental).

The core is C11, compiled as C (not C++). The kernel sources are compiled once per CPU ISA path
with that path's flags and MP_ISA_SUFFIX; cpu.c (dispatch and the public entry points) is compiled
once with baseline flags. No -march=native: the result must run on any CPU of the architecture.
"""
import contextlib
import fcntl
import os
import platform
import shlex
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INCLUDE_DIRS = [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc", "core")]

# Compiled once per ISA path.
KERNEL_SOURCES = ["csrc/core/cast.c", "csrc/core/scale.c", "csrc/core/step.c",
                  "csrc/core/norm.c", "csrc/core/table.c", "csrc/core/fp8.c",
                  "csrc/core/telemetry.c",
                  "csrc/core/int8_block.c"]  # the int8 block code of saved activations
# The fast paths (csrc/core/fast/README.md): an optional cache over the step's pipeline, compiled
# once per ISA path unless MPEXT_FAST_PATHS=0. Without them, the sources of FAST_USERS are
# compiled with MP_NO_FAST_PATHS (the engine's lookup then finds none) into objects of their own
# (a subdirectory "<isa>-nofast"), so both builds' objects can sit side by side and every other
# object is shared.
FAST_SOURCES = ["csrc/core/fast/adam_fused.c", "csrc/core/fast/lion_fused.c"]
FAST_USERS = ["csrc/core/step.c"]
# Compiled once.
COMMON_SOURCES = ["csrc/core/cpu.c",
                  "csrc/core/telemetry_cpu.c",  # telemetry (issue 46): its dispatch
                  "csrc/core/int8_block_cpu.c"]  # the int8 block code (issue 42): its dispatch

# -fno-math-errno lets sqrtf & co. vectorize; -fno-trapping-math lets the vectorizer if-convert.
# Neither changes a result: the core never reads errno or floating-point exception flags. The -O
# level goes first (common_cflags()). -g0, as the C++ units have: setup.py's compiler command
# carries Python's -g, which made the core's -O3 compile ~20% longer (76 -> 93 s of CPU); the
# C tests' and the emulation's builds add their own -g after it.
COMMON_CFLAGS = ["-std=c11", "-g0", "-fno-math-errno", "-fno-trapping-math", "-fPIC",
                 "-Wall", "-Wextra", "-Wno-unused-parameter"]

# MPEXT_OPT_LEVEL: the -O level of every unit the build compiles (the C core, the C++ binding,
# the CUDA sources), 3 unless set. .ci/package_check builds its wheel at 0: it checks packaging,
# not speed (make build and the suite test the -O3 build), and -O0 compiles in a fraction of the
# CPU time (docs/contributing.md, "CI"). A value of its own so that a user's pip install, which
# sets nothing, always gets -O3.
OPT_LEVEL_VAR = "MPEXT_OPT_LEVEL"
OPT_LEVELS = ("0", "1", "2", "3", "s", "g")

X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")

ISA_FLAGS = {"scalar": []}
if X86:
    ISA_FLAGS["avx2"] = ["-mavx2", "-mfma", "-mf16c"]
    ISA_FLAGS["avx512"] = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
                           "-mf16c", "-mprefer-vector-width=512"]

COMMON_MACROS = [("MP_X86_PATHS", "1")] if X86 else []


def fast_paths():
    """Whether the fast paths are built: the environment's MPEXT_FAST_PATHS, default on (any
    value but 0)."""
    return os.environ.get("MPEXT_FAST_PATHS", "1").strip() != "0"


def opt_flag():
    """The -O flag of every compiled unit: -O3, or -O<MPEXT_OPT_LEVEL>. Raises ValueError naming
    the variable for a value that is not a GCC/Clang level."""
    level = os.environ.get(OPT_LEVEL_VAR, "").strip() or "3"
    if level not in OPT_LEVELS:
        raise ValueError("%s=%r is not an optimisation level: expected one of %s (the -O level "
                         "of every compiled unit; unset means 3)"
                         % (OPT_LEVEL_VAR, os.environ[OPT_LEVEL_VAR], ", ".join(OPT_LEVELS)))
    return "-O" + level


def common_cflags():
    """The C core's flags but the ISA's: the -O level (opt_flag()), then COMMON_CFLAGS."""
    return [COMMON_CFLAGS[0], opt_flag()] + COMMON_CFLAGS[1:]


def extension_cflags():
    """The C++ binding's and the CUDA sources' own flags (setup.py), at the same -O level as the
    core. No debug info (-g0): it triples compile time and the size of _C. -fopenmp:
    at::parallel_for is inline code over OpenMP; without the flag it silently runs on one thread
    (torch's CPU builds link the same runtime, libgomp)."""
    opt = opt_flag()
    return {"cxx": [opt, "-g0", "-fopenmp"], "nvcc": [opt, "--expt-relaxed-constexpr"]}


def compile_units(fast=None):
    """Yields (source, output subdirectory, extra cflags, macros) for every object of the core,
    with the fast paths or without them (fast: default fast_paths())."""
    fast = fast_paths() if fast is None else fast
    common = common_cflags()
    for isa, flags in ISA_FLAGS.items():
        for src in KERNEL_SOURCES + (FAST_SOURCES if fast else []):
            macros = COMMON_MACROS + [("MP_ISA_SUFFIX", isa)]
            if src in FAST_USERS and not fast:
                yield (src, isa + "-nofast", common + flags,
                       macros + [("MP_NO_FAST_PATHS", "1")])
            else:
                yield src, isa, common + flags, macros
    for src in COMMON_SOURCES:
        yield src, "common", common, list(COMMON_MACROS)


def up_to_date(obj, cmd):
    """True if obj was compiled by cmd (a list of strings: compiler, flags, source), as record()
    noted, and every file of the dependency list the compiler wrote beside it (obj + ".d", from
    -MMD -MF) is older than the object's time, which record() sets to when its compile began."""
    stamp, dep = obj + ".cmd", obj + ".d"
    if not (os.path.exists(obj) and os.path.exists(stamp) and os.path.exists(dep)):
        return False
    with open(stamp) as f:
        if f.read() != " ".join(cmd):
            return False
    with open(dep) as f:
        deps = f.read().replace("\\\n", " ").split(":", 1)[-1].split()
    t = os.path.getmtime(obj)
    return all(os.path.exists(d) and os.path.getmtime(d) < t for d in deps)


def begin(obj):
    """Call before compiling obj: forgets its command, so that a compile cut short never leaves
    an object beside the stamp of another, and returns the time record() needs."""
    if os.path.exists(obj + ".cmd"):
        os.remove(obj + ".cmd")
    return time.time()


def record(obj, cmd, began):
    """Notes that obj was just compiled by cmd, the compile having begun at `began` (begin()),
    and dates obj then: a file edited while the compiler ran is newer, so the next build
    compiles again."""
    os.utime(obj, (began, began))
    with open(obj + ".cmd", "w") as f:
        f.write(" ".join(cmd))


def object_path(out_dir, subdir, src):
    """Where the object of `src` (a path relative to ROOT) for `subdir` goes under out_dir: the
    source's relative path is kept, as distutils does."""
    return os.path.join(out_dir, subdir, os.path.splitext(src)[0] + ".o")


def macro_flags(macros):
    """-D flags for (name, value) pairs; a value of None defines the bare name."""
    return ["-D%s" % n if v is None else "-D%s=%s" % (n, v) for n, v in macros]


def core_jobs(cc, out_dir, extra=(), fast=None):
    """The compile jobs (source, command, object) of every core unit, for the compiler command
    `cc` (a list) with `extra` flags last (so that a sanitizer build's -O1 overrides -O3; the ISA
    flags stay), objects under out_dir. setup.py, tests/c/run.py and tests/cuda_emu/run.py all
    compile the core through this, so one flag set gives one command, and its objects can be
    shared. fast: with the fast paths (default fast_paths())."""
    includes = ["-I" + d for d in INCLUDE_DIRS]
    jobs = []
    for src, subdir, cflags, macros in compile_units(fast):
        obj = object_path(os.path.abspath(out_dir), subdir, src)
        jobs.append((src, list(cc) + ["-c", os.path.join(ROOT, src), "-o", obj] + macro_flags(macros)
                     + includes + list(cflags) + list(extra), obj))
    return jobs


class CompileError(RuntimeError):
    """Some units failed to compile; the message holds each failing command and its output."""


def _compile_one(job):
    src, cmd, obj = job
    if up_to_date(obj, cmd):
        return job, None, "", 0.0
    os.makedirs(os.path.dirname(obj), exist_ok=True)
    began = begin(obj)
    proc = subprocess.run(cmd + ["-MMD", "-MF", obj + ".d"], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, universal_newlines=True)
    if proc.returncode == 0:
        record(obj, cmd, began)
    return job, proc.returncode, proc.stdout, time.time() - began


def compile_all(jobs, workers=None, log=print, lock=None):
    """Compiles, in parallel (`workers` processes, default os.cpu_count()), every job
    (source, command, object) whose object is not up_to_date(); the largest sources start
    first, so that the slowest units do not run last and alone. Each unit is recorded as soon as
    it compiled, so when one fails the others stay valid and the next build compiles only what
    failed. Prints each compiled unit's time (and the compiler's output) through `log`; returns
    the number compiled; raises CompileError naming every failure. `lock`: a file held
    exclusively meanwhile, so that two builds sharing objects never write the same one at once."""
    order = sorted(jobs, key=lambda j: -os.path.getsize(os.path.join(ROOT, j[0])))
    failures, compiled = [], 0
    with _locked(lock):
        workers = max(1, min(workers or os.cpu_count() or 1, len(order) or 1))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            # reported as each finishes, so that a long build shows its progress
            for done in as_completed([pool.submit(_compile_one, job) for job in order]):
                (src, cmd, obj), rc, output, seconds = done.result()
                if rc is None:
                    continue
                compiled += 1
                if rc != 0:
                    failures.append("compile failed (status %d): %s\n%s"
                                    % (rc, " ".join(shlex.quote(c) for c in cmd), output.rstrip()))
                    continue
                if output.strip():  # warnings
                    log(output.rstrip())
                log("compiled %s -> %s in %.1f s" % (src, os.path.relpath(obj, ROOT), seconds))
    if failures:
        raise CompileError("\n".join(failures))
    return compiled


@contextlib.contextmanager
def _locked(path):
    if path is None:
        yield
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
