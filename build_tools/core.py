"""How the C core is compiled: one source of truth for setup.py and the C tests (tests/c/run.py).

The core is C11, compiled as C (not C++). The kernel sources are compiled once per CPU ISA path
with that path's flags and MP_ISA_SUFFIX; cpu.c (dispatch and the public entry points) is compiled
once with baseline flags. No -march=native: the result must run on any CPU of the architecture.
"""
import os
import platform
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INCLUDE_DIRS = [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc", "core")]

# Compiled once per ISA path.
KERNEL_SOURCES = ["csrc/core/cast.c", "csrc/core/scale.c", "csrc/core/adam.c",
                  "csrc/core/norm.c", "csrc/core/table.c"]
# Compiled once.
COMMON_SOURCES = ["csrc/core/cpu.c"]

# -fno-math-errno lets sqrtf & co. vectorize; -fno-trapping-math lets the vectorizer if-convert.
# Neither changes a result: the core never reads errno or floating-point exception flags.
COMMON_CFLAGS = ["-std=c11", "-O3", "-fno-math-errno", "-fno-trapping-math", "-fPIC",
                 "-Wall", "-Wextra", "-Wno-unused-parameter"]

X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")

ISA_FLAGS = {"scalar": []}
if X86:
    ISA_FLAGS["avx2"] = ["-mavx2", "-mfma", "-mf16c"]
    ISA_FLAGS["avx512"] = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
                           "-mf16c", "-mprefer-vector-width=512"]

COMMON_MACROS = [("MP_X86_PATHS", "1")] if X86 else []


def compile_units():
    """Yields (source, output subdirectory, extra cflags, macros) for every object of the core."""
    for isa, flags in ISA_FLAGS.items():
        for src in KERNEL_SOURCES:
            yield src, isa, COMMON_CFLAGS + flags, COMMON_MACROS + [("MP_ISA_SUFFIX", isa)]
    for src in COMMON_SOURCES:
        yield src, "common", COMMON_CFLAGS, list(COMMON_MACROS)


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
