#!/usr/bin/env python3
"""Builds and runs the C core's own tests (tests/c/test_core.c) with the system C compiler.

The core is compiled exactly as setup.py compiles it, from build_tools/core.py (sources, per-ISA
flags, macros): every kernel source once per ISA path into its own object directory, cpu.c once.
By default everything is built with AddressSanitizer and UndefinedBehaviorSanitizer at -O1 (the
ISA flags are kept). The core's objects go under build/core/<flag set>/, shared with the CUDA
emulation harness, and the test's under build/ctest/; each is compiled again only when its
source, a header it includes or its command changed.

    python3 tests/c/run.py                          # ASan + UBSan build, run
    python3 tests/c/run.py --no-sanitize            # plain -O3 build, run
    python3 tests/c/run.py --valgrind               # plain build, under valgrind (sparser sweep)
    python3 tests/c/run.py --no-fast-paths          # the core without csrc/core/fast (as
                                                    # MPEXT_FAST_PATHS=0 does; CI runs it once)
    python3 tests/c/run.py -- --stride 4099         # arguments after -- go to the test binary

Needs only python3 and a C compiler (CC, else cc, else gcc); it does not import torch. Exits with
the test binary's status.
"""
import argparse
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

SANITIZE_CFLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-g", "-O1",
                   "-fno-omit-frame-pointer"]
SANITIZE_LDFLAGS = ["-fsanitize=address,undefined"]
TEST_SOURCE = os.path.join(HERE, "test_core.c")
# Further test binaries, each its own main, built and run after test_core with the same core.
EXTRA_TEST_SOURCES = [os.path.join(HERE, "test_telemetry.c"),  # telemetry (issue 46)
                      os.path.join(HERE, "test_act_codes.c")]  # int8 block code (issue 42)
VALGRIND_TEST_ARGS = ["--stride", "4369", "--random", "200000"]
TEST_CFLAGS = ["-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"]


def find_cc():
    env = os.environ.get("CC")
    if env:
        return shlex.split(env)
    for name in ("cc", "gcc"):
        if shutil.which(name):
            return [name]
    sys.exit("run.py: no C compiler found (set CC, or install cc/gcc)")


macro_flags = core.macro_flags


def run_cmd(cmd):
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True)
    return cmd, proc.returncode, proc.stdout


def core_extra(sanitize):
    """The flags a test build adds to the core's own (last, so that -O1 overrides -O3)."""
    return SANITIZE_CFLAGS if sanitize else ["-g"]


def core_objects(cc, sanitize, own_jobs=()):
    """Compiles the core for a test build, and the build's own jobs (source, command, object)
    in the same parallel pool, each only if it changed; returns the core's objects and how many
    objects were compiled. The C tests and the CUDA emulation harness share the core's objects:
    one directory per flag set under build/core/, so a CI run compiles the sanitized core once."""
    out_dir = os.path.join(ROOT, "build", "core", "asan-ubsan" if sanitize else "plain")
    jobs = core.core_jobs(cc, out_dir, core_extra(sanitize))
    compiled = compile_or_exit(jobs + list(own_jobs), lock=os.path.join(out_dir, ".lock"))
    return [obj for _, _, obj in jobs], compiled


def compile_or_exit(jobs, lock=None):
    """core.compile_all, exiting with the compiler's messages if a unit fails."""
    try:
        return core.compile_all(jobs, log=print, lock=lock)
    except core.CompileError as exc:
        print("run.py: %s" % exc)
        sys.exit(1)


def link(cmd):
    _, rc, output = run_cmd(cmd)
    if output.strip():
        print(output.rstrip())
    if rc != 0:
        print("run.py: link failed (%d): %s" % (rc, " ".join(shlex.quote(c) for c in cmd)))
        sys.exit(1)


def build(cc, out_dir, sanitize, source=TEST_SOURCE):
    """Compiles the core and the test `source` into out_dir; returns the path of the test
    binary."""
    stem = os.path.splitext(os.path.basename(source))[0]
    test_obj = os.path.join(out_dir, "test", stem + ".o")
    # The test itself is baseline code (it runs on every CPU); it sees the core's macros so that
    # it can tell "not compiled in" from "CPU lacks it".
    test_opt = [] if sanitize else ["-O2"]
    test_job = (os.path.relpath(source, ROOT),
                cc + ["-c", source, "-o", test_obj] + macro_flags(core.COMMON_MACROS)
                + ["-I" + d for d in core.INCLUDE_DIRS] + TEST_CFLAGS + test_opt
                + core_extra(sanitize), test_obj)
    objects, _ = core_objects(cc, sanitize, [test_job])
    exe = os.path.join(out_dir, stem)
    link(cc + ["-o", exe] + objects + [test_obj] + (SANITIZE_LDFLAGS if sanitize else [])
         + ["-lm"])
    return exe


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-sanitize", action="store_true",
                        help="plain build with the core's own flags (-O3), no sanitizers")
    parser.add_argument("--valgrind", action="store_true",
                        help="run the non-sanitized build under valgrind (implies --no-sanitize)")
    parser.add_argument("--no-fast-paths", action="store_true",
                        help="build the core without its fast paths (csrc/core/fast/README.md), "
                        "as MPEXT_FAST_PATHS=0 does")
    parser.add_argument("test_args", nargs="*", help="arguments for the test binary (after --)")
    args = parser.parse_args()
    sanitize = not (args.no_sanitize or args.valgrind)
    if args.no_fast_paths:
        os.environ["MPEXT_FAST_PATHS"] = "0"  # build_tools/core.py reads it

    cc = find_cc()
    out_dir = os.path.join(ROOT, "build", "ctest", "asan-ubsan" if sanitize else "plain")
    t0 = time.time()
    exe = build(cc, out_dir, sanitize)
    t_build = time.time() - t0
    print("run.py: built %s with %s in %.1f s (%s; %s)"
          % (os.path.relpath(exe, ROOT), " ".join(cc), t_build,
             "-fsanitize=address,undefined -O1" if sanitize else "no sanitizers, -O3",
             "with the fast paths" if core.fast_paths() else "without the fast paths"),
          flush=True)

    env = dict(os.environ)
    cmd = [exe] + args.test_args
    if sanitize:
        env.setdefault("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0:halt_on_error=1")
        env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
    if args.valgrind:
        valgrind = shutil.which("valgrind")
        if not valgrind:
            sys.exit("run.py: --valgrind given but valgrind is not installed")
        cmd = [valgrind, "--error-exitcode=1", "--leak-check=full", "--errors-for-leak-kinds=all",
               "--quiet"] + cmd
        if not args.test_args:
            # valgrind runs ~30x slower; a sparser sweep checks memory just as well (every code
            # path still runs) and keeps the run near a minute. 4369 = 17 * 257 divides 2^32 - 1.
            cmd += VALGRIND_TEST_ARGS
    print("run.py: running " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    t0 = time.time()
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    print("run.py: test binary exited with status %d after %.1f s" % (rc, time.time() - t0))
    if rc < 0:  # killed by a signal: report it as a failure the shell understands
        rc = 128 - rc
    for source in EXTRA_TEST_SOURCES:  # the other binaries, under the same tool (valgrind, ...)
        extra = build(cc, out_dir, sanitize, source)
        ecmd = [c if c != exe else extra for c in cmd]
        print("run.py: running " + " ".join(shlex.quote(c) for c in ecmd), flush=True)
        erc = subprocess.call(ecmd, cwd=ROOT, env=env)
        print("run.py: %s exited with status %d" % (os.path.basename(extra), erc))
        if erc != 0 and rc == 0:
            rc = 128 - erc if erc < 0 else erc
    return rc


if __name__ == "__main__":
    sys.exit(main())
