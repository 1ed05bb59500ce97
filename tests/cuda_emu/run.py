#!/usr/bin/env python3
"""Builds and runs the CUDA emulation harness (tests/cuda_emu, see README.md there).

cuda/*.cu are compiled with the host C++ compiler against the shim in tests/cuda_emu/include; the
C core they are compared with is compiled exactly as setup.py and tests/c/run.py compile it (from
build_tools/core.py); the tests call the public mp_*_cuda functions and the core's mp_* ones on
the same inputs. By default everything is built with AddressSanitizer and
UndefinedBehaviorSanitizer at -O1, as the C core's tests are; the core's objects are the C tests'
(build/core/<flag set>/, so CI compiles them once), the harness's own go under build/cuda-emu/;
each is rebuilt only when its source, a header it includes or its flags changed.

    python3 tests/cuda_emu/run.py                      # ASan + UBSan build, run
    python3 tests/cuda_emu/run.py --no-sanitize        # -O2, no sanitizers
    python3 tests/cuda_emu/run.py -- --seed 7 adam     # after --: for the test binary
                                                       # (--seed N, --list, name substrings)

Needs only python3 and a C/C++ compiler (CC/CXX, else cc/c++); no torch, no CUDA runtime, no GPU.
When the CUDA toolkit's headers are found (CUDA_HOME, else /usr/local/cuda), the shim's
conversions are also compared with NVIDIA's own host implementation in cuda_fp16.hpp and
cuda_bf16.hpp. Exits with the test binary's status.
"""
import argparse
import glob
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from build_tools import core  # noqa: E402

# The C tests' runner: its compiler lookup, macro flags, command runner and sanitizer flags.
_spec = importlib.util.spec_from_file_location("ctest_run", os.path.join(ROOT, "tests", "c", "run.py"))
ctest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ctest)

SHIM_INCLUDE = os.path.join(HERE, "include")
CUDA_SOURCES = sorted(glob.glob(os.path.join(ROOT, "cuda", "*.cu")))
TEST_SOURCES = sorted(glob.glob(os.path.join(HERE, "*.cpp")))
NV_REFERENCE = os.path.join(HERE, "nv_reference", "nv_reference.cpp")
# -ffp-contract=off: a * b + c in device code stays two roundings, as the kernels' _rn
# intrinsics are on the GPU. -fno-strict-aliasing: the kernels read 16- and 32-bit arrays through
# uint4, which is what the GPU does and what C++ aliasing rules do not allow.
CXXFLAGS = ["-std=c++17", "-ffp-contract=off", "-fno-strict-aliasing", "-Wall", "-Wextra",
            "-Wno-unknown-pragmas"]


def find_cxx():
    env = os.environ.get("CXX")
    if env:
        return shlex.split(env)
    for name in ("c++", "g++", "clang++"):
        if shutil.which(name):
            return [name]
    sys.exit("run.py: no C++ compiler found (set CXX, or install c++/g++)")


def cuda_include():
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    inc = os.path.join(home, "include")
    ok = all(os.path.exists(os.path.join(inc, h)) for h in ("cuda_fp16.h", "cuda_bf16.h"))
    return inc if ok else None


def step_at_og(src, extra):
    """The step kernel under the sanitizers at -Og rather than -O1: its templates over every
    rule, storage and format (and the counting variant) took GCC 123 s at -O1 and 45 s at
    -Og, the longest compile of CI's sanitized chain; the sanitizers check the same code."""
    if os.path.basename(src) != "step.cu" or "-O1" not in extra:
        return extra
    return [flag if flag != "-O1" else "-Og" for flag in extra]


def build(cc, cxx, out_dir, sanitize, nv_inc):
    """Compiles the harness (the core's objects are the C tests', tests/c/run.py) and links it;
    returns the binary's path and the number of objects compiled."""
    extra = ctest.SANITIZE_CFLAGS if sanitize else ["-g", "-O2"]
    cuda_inc = ["-I" + SHIM_INCLUDE, "-I" + os.path.join(ROOT, "csrc", "include"),
                "-I" + os.path.join(ROOT, "cuda")]
    jobs = []
    for src in CUDA_SOURCES:
        obj = os.path.join(out_dir, "cuda", os.path.basename(src)[:-3] + ".o")
        jobs.append((src, cxx + ["-x", "c++", "-c", src, "-o", obj] + cuda_inc + CXXFLAGS
                     + step_at_og(src, extra), obj))
    test_flags = [] if nv_inc is None else ["-DMP_EMU_NV_REFERENCE=1"]
    for src in TEST_SOURCES:
        obj = os.path.join(out_dir, "test", os.path.basename(src)[:-4] + ".o")
        jobs.append((src, cxx + ["-c", src, "-o", obj] + cuda_inc + test_flags + CXXFLAGS + extra,
                     obj))
    if nv_inc is not None:
        # NVIDIA's headers, compiled for the host (their host code paths), in their own object.
        obj = os.path.join(out_dir, "test", "nv_reference.o")
        jobs.append((NV_REFERENCE, cxx + ["-c", NV_REFERENCE, "-o", obj, "-I" + nv_inc,
                                          "-std=c++17", "-w"] + extra, obj))
    core_objects, compiled = ctest.core_objects(cc, sanitize, jobs)
    exe = os.path.join(out_dir, "test_cuda_emu")
    ctest.link(cxx + ["-o", exe] + core_objects + [obj for _, _, obj in jobs]
               + (ctest.SANITIZE_LDFLAGS if sanitize else []) + ["-lm"])
    return exe, compiled


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-sanitize", action="store_true",
                        help="no sanitizers: the harness at -O2, the core as the plain C tests build it")
    parser.add_argument("test_args", nargs="*", help="arguments for the test binary (after --)")
    args = parser.parse_args()
    sanitize = not args.no_sanitize

    cc, cxx = ctest.find_cc(), find_cxx()
    nv_inc = cuda_include()
    out_dir = os.path.join(ROOT, "build", "cuda-emu", "asan-ubsan" if sanitize else "plain")
    t0 = time.time()
    exe, compiled = build(cc, cxx, out_dir, sanitize, nv_inc)
    print("run.py: built %s with %s / %s in %.1f s (%d objects compiled; %s; %s)"
          % (os.path.relpath(exe, ROOT), " ".join(cc), " ".join(cxx), time.time() - t0, compiled,
             "-fsanitize=address,undefined -O1" if sanitize else "no sanitizers, -O2",
             "shim checked against " + nv_inc if nv_inc else
             "no CUDA headers found: the shim's conversions are not compared with NVIDIA's"),
          flush=True)

    env = dict(os.environ)
    if sanitize:
        env.setdefault("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0:halt_on_error=1")
        env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
    cmd = [exe] + args.test_args
    print("run.py: running " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    t0 = time.time()
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    print("run.py: test binary exited with status %d after %.1f s" % (rc, time.time() - t0))
    if rc < 0:  # killed by a signal: report it as a failure the shell understands
        rc = 128 - rc
    return rc


if __name__ == "__main__":
    sys.exit(main())
