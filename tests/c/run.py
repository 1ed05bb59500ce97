#!/usr/bin/env python3
"""Builds and runs the C core's own tests (tests/c/test_*.c) with the system C compiler.

Every tests/c/test_*.c is a test binary of its own (a new file is picked up by its name; nothing
lists it). A source that includes test_common.h is linked with test_common.c, which holds main
and the shared bookkeeping; any other (test_step_telemetry.c, ...) has its own main. All of them get
the same arguments and run under the same tool, CPU-count binaries at a time (--jobs), the
longest of the last run first; each one's output is printed when it ends.

The core is compiled exactly as setup.py compiles it, from build_tools/core.py (sources, per-ISA
flags, macros): every kernel source once per ISA path into its own object directory, cpu.c once.
By default everything is built with AddressSanitizer and UndefinedBehaviorSanitizer at -O1 (the
ISA flags are kept). The core's objects go under build/core/<flag set>/, shared with the CUDA
emulation harness, and the tests' under build/ctest/; each is compiled again only when its
source, a header it includes or its command changed.

    python3 tests/c/run.py                          # ASan + UBSan build, run
    python3 tests/c/run.py --no-sanitize            # plain -O3 build, run
    python3 tests/c/run.py --valgrind               # plain build, under valgrind (sparser sweep)
    python3 tests/c/run.py --no-fast-paths          # the step's tests on the core without
                                                    # csrc/core/fast (as MPEXT_FAST_PATHS=0
                                                    # does; CI runs it once)
    python3 tests/c/run.py --only test_scale,test_norm   # some binaries
    python3 tests/c/run.py -- --stride 4099         # arguments after -- go to the test binaries

The fast paths are compiled into step.c alone, so without them only the binaries that call the
step can change: --no-fast-paths runs test_step*.c and test_fast_paths.c, and refuses a test
file of another name that calls the step (STEP_CALL), so that none is left out unnoticed.

Needs only python3 and a C compiler (CC, else cc, else gcc); it does not import torch. Exits with
the status of the first test binary that failed (0 if none did).
"""
import argparse
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from build_tools import core  # noqa: E402

SANITIZE_CFLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-g", "-O1",
                   "-fno-omit-frame-pointer"]
SANITIZE_LDFLAGS = ["-fsanitize=address,undefined"]
COMMON_SOURCE = os.path.join(HERE, "test_common.c")  # main, for sources that include:
COMMON_HEADER = re.compile(r'^\s*#\s*include\s+"test_common\.h"', re.M)
# The step's tests (the only ones --no-fast-paths runs), and what calling the step looks like.
STEP_TEST = re.compile(r"^test_(step\w*|fast_paths)\.c$")
STEP_CALL = re.compile(r"\bmp_(?:step|step_advance_steps|adam_step|adam_advance_steps)\s*\(|"
                       r"->step(?:_generic)?\s*\(")
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


def sanitized_fast_at_o0(job):
    """The hand-fused rows (csrc/core/fast/) under the sanitizers at -O0 rather than -O1: GCC
    took 25-39 s per ISA path on them at -O1 (96 s of CI's compile, the largest part), 2.7x
    less at -O0, whose checks are the same (nothing is optimised away); their one test binary
    runs a few seconds longer."""
    src, cmd, obj = job
    if os.sep + os.path.join("core", "fast") + os.sep not in src:
        return job
    return src, [flag if flag != "-O1" else "-O0" for flag in cmd], obj


def core_objects(cc, sanitize, own_jobs=()):
    """Compiles the core for a test build, and the build's own jobs (source, command, object)
    in the same parallel pool, each only if it changed; returns the core's objects and how many
    objects were compiled. The C tests and the CUDA emulation harness share the core's objects:
    one directory per flag set under build/core/, so a CI run compiles the sanitized core once."""
    out_dir = os.path.join(ROOT, "build", "core", "asan-ubsan" if sanitize else "plain")
    jobs = [sanitized_fast_at_o0(job) if sanitize else job
            for job in core.core_jobs(cc, out_dir, core_extra(sanitize))]
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


def test_sources(fast=True):
    """The test sources (absolute paths, sorted): every tests/c/test_*.c but test_common.c; only
    the step's (STEP_TEST) when fast is false. Exits if a source of another name calls the step
    (it would be left out of the run without the fast paths)."""
    sources = []
    for path in sorted(glob.glob(os.path.join(HERE, "test_*.c"))):
        name = os.path.basename(path)
        if path == COMMON_SOURCE:
            continue
        is_step = STEP_TEST.match(name) is not None
        if not is_step:
            with open(path) as f:
                if STEP_CALL.search(f.read()):
                    sys.exit("run.py: %s calls the step: name it test_step_*.c, so that "
                             "--no-fast-paths runs it" % name)
        if fast or is_step:
            sources.append(path)
    return sources


def uses_common(source):
    with open(source) as f:
        return COMMON_HEADER.search(f.read()) is not None


def test_job(cc, out_dir, sanitize, source):
    """The compile job (source, command, object) of one test source."""
    stem = os.path.splitext(os.path.basename(source))[0]
    obj = os.path.join(out_dir, "test", stem + ".o")
    # The tests are baseline code (they run on every CPU); they see the core's macros so that
    # they can tell "not compiled in" from "CPU lacks it".
    test_opt = [] if sanitize else ["-O2"]
    return (os.path.relpath(source, ROOT),
            cc + ["-c", source, "-o", obj] + core.macro_flags(core.COMMON_MACROS)
            + ["-I" + d for d in core.INCLUDE_DIRS] + TEST_CFLAGS + test_opt
            + core_extra(sanitize), obj)


def build(cc, out_dir, sanitize, sources=None):
    """Compiles the core and the test `sources` (default: test_sources()) in one parallel pool
    into out_dir and links one binary per source (in parallel too); returns their paths."""
    sources = test_sources() if sources is None else sources
    common = [s for s in sources if uses_common(s)]
    jobs = {s: test_job(cc, out_dir, sanitize, s) for s in sources + ([COMMON_SOURCE] if common else [])}
    objects, _ = core_objects(cc, sanitize, list(jobs.values()))
    ldflags = (SANITIZE_LDFLAGS if sanitize else []) + ["-lm"]

    def link_one(source):
        exe = os.path.join(out_dir, os.path.splitext(os.path.basename(source))[0])
        own = [jobs[source][2]] + ([jobs[COMMON_SOURCE][2]] if source in common else [])
        link(cc + ["-o", exe] + objects + own + ldflags)
        return exe

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(link_one, sources))


def run_all(exes, cmd_of, env, jobs, times_path):
    """Runs the binaries, `jobs` at a time, the longest of the last run (times_path) first, and
    prints each one's output when it ends; returns the status of the first that failed (in
    `exes` order), 0 if none did, and records this run's times."""
    try:
        with open(times_path) as f:
            last = json.load(f)
    except (OSError, ValueError):
        last = {}
    name = os.path.basename
    order = sorted(exes, key=lambda e: -last.get(name(e), float("inf")))

    def run_one(exe):
        cmd = cmd_of(exe)
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, universal_newlines=True)
        return exe, cmd, proc.returncode, proc.stdout, time.time() - t0

    status, took = {}, {}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for done in as_completed([pool.submit(run_one, e) for e in order]):
            exe, cmd, rc, output, seconds = done.result()
            print("run.py: ran " + " ".join(shlex.quote(c) for c in cmd))
            print(output.rstrip())
            print("run.py: %s exited with status %d after %.1f s" % (name(exe), rc, seconds),
                  flush=True)
            status[exe], took[name(exe)] = rc, seconds
    last.update(took)
    with open(times_path, "w") as f:
        json.dump(last, f, indent=1, sort_keys=True)
    for exe in exes:
        rc = status[exe]
        if rc != 0:
            print("run.py: FAILED: %s (status %d)" % (name(exe), rc))
    failed = [status[e] for e in exes if status[e] != 0]
    if not failed:
        return 0
    rc = failed[0]
    return 128 - rc if rc < 0 else rc  # killed by a signal: a status the shell understands


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-sanitize", action="store_true",
                        help="plain build with the core's own flags (-O3), no sanitizers")
    parser.add_argument("--valgrind", action="store_true",
                        help="run the non-sanitized build under valgrind (implies --no-sanitize)")
    parser.add_argument("--no-fast-paths", action="store_true",
                        help="build the core without its fast paths (csrc/core/fast/README.md), "
                        "as MPEXT_FAST_PATHS=0 does, and run the step's tests on it")
    parser.add_argument("--only", default="",
                        help="comma-separated test names (test_scale or test_scale.c): run these")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="test binaries run at once (default: the CPU count)")
    parser.add_argument("test_args", nargs="*", help="arguments for the test binaries (after --)")
    args = parser.parse_args()
    sanitize = not (args.no_sanitize or args.valgrind)
    if args.no_fast_paths:
        os.environ["MPEXT_FAST_PATHS"] = "0"  # build_tools/core.py reads it

    sources = test_sources(fast=not args.no_fast_paths)
    if args.only:
        wanted = {os.path.splitext(w.strip())[0] for w in args.only.split(",") if w.strip()}
        unknown = wanted - {os.path.splitext(os.path.basename(s))[0] for s in sources}
        if unknown:
            sys.exit("run.py: --only: no such test here: %s" % ", ".join(sorted(unknown)))
        sources = [s for s in sources if os.path.splitext(os.path.basename(s))[0] in wanted]
    cc = find_cc()
    out_dir = os.path.join(ROOT, "build", "ctest", "asan-ubsan" if sanitize else "plain")
    t0 = time.time()
    exes = build(cc, out_dir, sanitize, sources)
    print("run.py: built %d test binaries in %s with %s in %.1f s (%s; %s)"
          % (len(exes), os.path.relpath(out_dir, ROOT), " ".join(cc), time.time() - t0,
             "-fsanitize=address,undefined -O1" if sanitize else "no sanitizers, -O3",
             "with the fast paths" if core.fast_paths() else
             "without the fast paths: the step's tests only"), flush=True)

    env = dict(os.environ)
    prefix, extra = [], []
    if sanitize:
        env.setdefault("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0:halt_on_error=1")
        env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
    if args.valgrind:
        valgrind = shutil.which("valgrind")
        if not valgrind:
            sys.exit("run.py: --valgrind given but valgrind is not installed")
        prefix = [valgrind, "--error-exitcode=1", "--leak-check=full",
                  "--errors-for-leak-kinds=all", "--quiet"]
        if not args.test_args:
            # valgrind runs ~30x slower; a sparser sweep checks memory just as well (every code
            # path still runs) and keeps the run near a minute. 4369 = 17 * 257 divides 2^32 - 1.
            extra = VALGRIND_TEST_ARGS
    t0 = time.time()
    rc = run_all(exes, lambda exe: prefix + [exe] + args.test_args + extra, env, args.jobs,
                 os.path.join(out_dir, "times%s.json" % ("" if core.fast_paths() else "-nofast")))
    print("run.py: %d test binaries, %s, in %.1f s" % (len(exes), "all passed" if rc == 0 else
                                                        "some FAILED", time.time() - t0))
    return rc


if __name__ == "__main__":
    sys.exit(main())
