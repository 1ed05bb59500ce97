#!/usr/bin/env python3
"""One command for a lent GPU machine: build, run every CUDA test and the GPU benchmark, and
leave the results in one folder (what `make gpu-check OUT=dir` runs).

    python3 build_tools/gpu_check.py --out DIR [--python PY] [--budget 470]

Meant for a machine with a GPU, nvcc and a CUDA build of torch but no network: it never calls
pip or anything else that fetches. A test dependency that is missing is reported in the summary
and the tests that need it skip (or fail to collect, reported) with a reason. Phases, each under
its own timeout (cut to what is left of --budget), so that a hung phase still leaves its log:

    env    versions of python, torch, CUDA, the GPU, the test dependencies    -> env.txt
    build  setup.py build_ext --inplace; MPEXT_FORCE_CUDA=1 when a GPU is
           visible (a CUDA build that silently fell back would test nothing),
           MPEXT_FORCE_CUDA=0 when none is                                    -> build.log
    tests  pytest over tests/ restricted to the CUDA tests (-k cuda: the      -> tests.log,
           `cuda` device parameter, the tests named for CUDA and                 junit.xml
           tests/test_cuda_parity.py); a run near its timeout is interrupted
           (SIGINT) first, so that pytest still writes junit.xml
    bench  python -m benchmarks.run_all --quick --device cuda (GPU only)      -> bench.log,
                                                                                 bench.md, bench.json
    grad-release  python -m benchmarks.measure_grad_release --memory-only
           --device cuda: gradient release's memory on the GPU's allocator,
           against mpext.memory (GPU only)                                    -> bench.log (appended)
    activations  python -m benchmarks.bench_activations --quick --device cuda:
           saved activations, FP8 off and on, the step's peak and time, the
           FP8 ops (GPU only)                                                 -> bench.log (appended)
and summary.md, which says what ran, what was cut or skipped and why, and the CUDA tests per
feature (FEATURES): passed, failed, skipped. At most 8 files, flat in DIR, named in letters,
digits and ._- alone. Exits 0 when every phase that ran passed and, where a GPU was found,
every feature ran at least one CUDA test and none failed: a feature whose CUDA tests all
skipped (or that has none) is a failure of the check, not a pass.
"""
import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: build_tools is then not on the path
from build_tools import rules  # noqa: E402

# What the phases write; nothing else goes into the folder.
FILES = ["summary.md", "env.txt", "build.log", "tests.log", "junit.xml", "bench.log", "bench.md",
         "bench.json"]
# Seconds per phase by default; together (470 s, the default --budget) under the 8 minutes a
# lent GPU's check may take, with what the script itself takes.
TIMEOUTS = {"env": 20, "build": 200, "tests": 130, "bench": 50, "grad-release": 35,
            "activations": 35}
# Import names; the summary names a missing one's package where the two differ (PACKAGES).
TEST_DEPS = ["pytest", "numpy", "hypothesis", "lightning", "accelerate", "transformers", "ninja",
             "matplotlib", "tqdm", "lion_pytorch"]
PACKAGES = {"lion_pytorch": "lion-pytorch"}
# Seconds before its timeout at which the tests phase is interrupted (SIGINT): pytest then ends
# the session and writes junit.xml with what ran, which a SIGTERM or SIGKILL would lose. Taken
# out of the phase's own timeout, so the budget is unchanged.
TESTS_GRACE = 10

# What a lent GPU must test, feature by feature: the test modules whose CUDA tests count for it
# (their `cuda` device parameter; docs/gpu_check.md). tests/test_cuda_parity.py (PARITY) counts
# each test for the feature its name starts with (test_<feature>_...). A feature none of whose
# CUDA tests ran fails the check where a GPU was found.
FEATURES = {
    "scaler": ("test_grad_scaler", "test_scale_ops"),
    "adam": ("test_adam", "test_ema", "test_lean_state", "test_moments_8bit", "test_long_lists"),
    "table": ("test_optim_table",),
    "release": ("test_grad_release",),
    "dcp": ("test_dcp_formats",),
    "activations": ("test_activations",),
    "casts": ("test_cast",),
    "norm": ("test_grad_norm",),
    "amp": ("test_mixed_precision",),
    "telemetry": ("test_telemetry", "test_telemetry_step"),
}
# Each other rule of the rows whose own test module exists (tests/test_lion.py, test_sgd.py,
# test_muon.py) is a feature of its own: a new rule is found, not listed (build_tools/rules.py).
FEATURES.update(
    (word, ("test_" + word,)) for word in rules.rule_modules(os.path.join(ROOT, "tests"), "test_")
    if not any("test_" + word in modules for modules in FEATURES.values()))
PARITY = "test_cuda_parity"

ENV_SCRIPT = r"""
import importlib, platform, sys
print("python", sys.version.split()[0], sys.executable)
print("platform", platform.platform())
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("torch.cuda.is_available()", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print("device %d: %s, capability %d.%d, %.1f GiB, %d SMs"
          % (i, p.name, p.major, p.minor, p.total_memory / 2**30, p.multi_processor_count))
for name in sys.argv[1:]:
    try:
        m = importlib.import_module(name)
        print("module %s %s" % (name, getattr(m, "__version__", "?")))
    except Exception as exc:
        print("module %s MISSING (%s)" % (name, type(exc).__name__))
"""


def gpu_present():
    """A GPU is there when nvidia-smi lists one (asked without importing torch, which the
    script's own python may lack)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False, "nvidia-smi not found"
    try:
        out = subprocess.run([smi, "-L"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             universal_newlines=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, "nvidia-smi -L failed (%s)" % exc
    gpus = [line for line in out.splitlines() if line.startswith("GPU ")]
    return (True, "; ".join(gpus)) if gpus else (False, "nvidia-smi lists no GPU")


def run_phase(name, cmd, log_path, timeout, env=None, cwd=ROOT, grace=0.0):
    """Runs cmd (a list) with its output in log_path; a run past `timeout` seconds is stopped,
    with every process it started (its own process group): SIGTERM, then SIGKILL. With
    `grace`, a run still going `grace` seconds before its timeout is first sent SIGINT (pytest
    then ends its session, reports and writes its junit XML) and given those seconds to end.
    Returns {name, status: passed|failed|timed out, rc, seconds, cmd}."""
    t0 = time.time()
    grace = min(grace, timeout / 2)
    with open(log_path, "ab") as log:
        log.write(("$ %s\n" % " ".join(shlex.quote(c) for c in cmd)).encode())
        log.flush()
        # SIGINT back to its default in the phase: a shell's background job (`cmd &`, nohup)
        # starts with SIGINT ignored, which exec keeps, and pytest would never see the grace
        # interrupt (no junit XML)
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_default_sigint)
        try:
            try:
                rc = proc.wait(timeout=max(timeout - grace, 0.01))
            except subprocess.TimeoutExpired:
                if not grace:
                    raise
                log.write(("\n*** gpu_check: %s interrupted (SIGINT) %.0f s before its "
                           "timeout\n" % (name, grace)).encode())
                log.flush()
                _signal_group(proc, signal.SIGINT)
                proc.wait(timeout=grace)
                raise
            status = "passed" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            _stop(proc)
            rc, status = proc.returncode, "timed out"
            log.write(("\n*** gpu_check: %s cut after its %.0f s timeout\n"
                       % (name, timeout)).encode())
    return {"name": name, "status": status, "rc": rc, "seconds": time.time() - t0,
            "timeout": timeout, "cmd": cmd}


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _stop(proc):
    """SIGTERM to the phase's process group, SIGKILL if it has not ended 5 s later, SIGKILL to
    whatever of the group outlived its leader, and a wait (at most 5 s) until the group is gone:
    a killed process lives on until the kernel has torn it down, which on a busy machine is
    not at once."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=5)
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    deadline = time.time() + 5
    while time.time() < deadline and _group_alive(proc.pid):
        time.sleep(0.02)


def _group_alive(pgid):
    """Whether a process of group pgid is still running (a zombie, dead but not yet reaped by
    its new parent, does not count). Without /proc (not Linux), none is known to be."""
    if not os.path.isdir("/proc"):
        return False
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def plan(py, gpu, out, bench_dir):
    """The phases: (name, command, log file, environment changes), or (name, None, reason) for
    one that is skipped."""
    phases = [("env", [py, "-c", ENV_SCRIPT] + TEST_DEPS, "env.txt", {})]
    phases.append(("build", [py, "setup.py", "-q", "build_ext", "--inplace"], "build.log",
                   {"MPEXT_FORCE_CUDA": "1" if gpu else "0"}))
    phases.append(("tests", [py, "-m", "pytest", "tests", "-k", "cuda", "-q", "-rs",
                             "-p", "no:cacheprovider", "--continue-on-collection-errors",
                             "--junitxml", os.path.join(out, "junit.xml")], "tests.log", {}))
    if gpu:
        phases.append(("bench", [py, "-m", "benchmarks.run_all", "--quick", "--device", "cuda",
                                 "--no-progress", "--no-plots", "--out", bench_dir],
                       "bench.log", {}))
        phases.append(("grad-release", [py, "-m", "benchmarks.measure_grad_release",
                                        "--memory-only", "--device", "cuda"], "bench.log", {}))
        phases.append(("activations", [py, "-m", "benchmarks.bench_activations", "--quick",
                                       "--device", "cuda", "--out", bench_dir], "bench.log", {}))
    else:
        phases += [(name, None, "no GPU: the GPU benchmark needs one (the CPU benchmark is "
                                "`make bench`)") for name in ("bench", "grad-release",
                                                             "activations")]
    return phases


def junit_counts(path):
    """(tests, failures, errors, skipped) and the distinct skip reasons from pytest's junit XML."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None, []
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = [sum(int(s.get(k, 0)) for s in suites)
              for k in ("tests", "failures", "errors", "skipped")]
    reasons = {}
    for case in root.iter("testcase"):
        for sk in case.findall("skipped"):
            msg = (sk.get("message") or "").strip()
            reasons[msg] = reasons.get(msg, 0) + 1
    return counts, sorted(reasons.items(), key=lambda kv: -kv[1])


def _module_of(classname, name):
    """The test module of a junit testcase: the first dotted part of its classname that names
    one (tests.test_x, tests.test_x.TestY), or of its name for a module that failed to collect
    (pytest reports those with an empty classname and the module as the name)."""
    for part in (classname or name).split("."):
        if part.startswith("test_"):
            return part
    return None


def feature_of(module, name):
    """The feature a CUDA test counts for (FEATURES; PARITY's tests by their name's first word;
    a module of no feature stands for itself, without the test_ prefix)."""
    if module == PARITY:
        word = name[len("test_"):].split("_")[0] if name.startswith("test_") else ""
        return word if word in FEATURES else "parity"
    for feature, modules in FEATURES.items():
        if module in modules:
            return feature
    return module[len("test_"):] if module else "(unknown)"


def feature_counts(path):
    """{feature: {passed, failed, errors, skipped, parity}} over the CUDA tests of pytest's
    junit XML at path (those whose id names cuda, every test of PARITY, and every module that
    failed to collect, an error), or None if there is no readable file. ``parity``: the passed
    tests of PARITY among them."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    out = {}
    for case in root.iter("testcase"):
        classname, name = case.get("classname") or "", case.get("name") or ""
        module = _module_of(classname, name)
        collect_error = not classname and case.find("error") is not None
        if not (collect_error or module == PARITY or "cuda" in (classname + name).lower()):
            continue
        c = out.setdefault(feature_of(module, name), dict(passed=0, failed=0, errors=0,
                                                          skipped=0, parity=0))
        if case.find("error") is not None:
            c["errors"] += 1
        elif case.find("failure") is not None:
            c["failed"] += 1
        elif case.find("skipped") is not None:
            c["skipped"] += 1
        else:
            c["passed"] += 1
            c["parity"] += module == PARITY
    return out


def feature_checks(counts, gpu):
    """[(feature, verdict, passed)] for every feature of FEATURES and every other one that has
    CUDA tests: with a GPU a feature passes when at least one of its CUDA tests ran (passed or
    failed; a skip is not a run) and none failed or erred. Without one nothing could run:
    every feature is reported as not run, and that fails nothing."""
    zero = dict(passed=0, failed=0, errors=0, skipped=0, parity=0)
    rows = []
    for feature in list(FEATURES) + sorted(set(counts or {}) - set(FEATURES)):
        c = (counts or {}).get(feature, zero)
        ran = c["passed"] + c["failed"] + c["errors"]
        if counts is None:
            verdict, ok = "**FAIL**: no junit.xml, nothing known" if gpu else "not run: no GPU", \
                not gpu
        elif c["failed"] or c["errors"]:
            verdict, ok = "**FAIL**: %d failed, %d errors" % (c["failed"], c["errors"]), False
        elif not ran:
            verdict = ("**FAIL**: no CUDA test ran (%d skipped)" % c["skipped"] if gpu else
                       "not run: no GPU")
            ok = not gpu or feature not in FEATURES
            if gpu and feature not in FEATURES:
                verdict = "no CUDA test ran (%d skipped; not a feature of FEATURES)" % c["skipped"]
        else:
            verdict, ok = "pass", True
        rows.append((feature, verdict, ok, c))
    return rows


def summary(results, gpu, gpu_note, out, budget, total):
    lines = ["# mpext GPU check", ""]
    lines.append(("GPU found: %s" % gpu_note) if gpu else
                 "**No GPU found** (%s): built without CUDA (MPEXT_FORCE_CUDA=0), the CUDA tests "
                 "are reported as skipped, the GPU benchmark did not run." % gpu_note)
    lines += ["", "Total %.0f s of a %.0f s budget. No pip or network call is made." % (total, budget),
              "", "| phase | status | seconds | timeout | output |", "|---|---|---|---|---|"]
    for r in results:
        if "skipped" in r:
            lines.append("| %s | skipped: %s | | | |" % (r["name"], r["skipped"]))
            continue
        status = r["status"] if r["status"] != "failed" else "failed (exit %s)" % r["rc"]
        if r["status"] == "timed out":
            status = "**TIMED OUT**: cut after %.0f s" % r["timeout"]
        lines.append("| %s | %s | %.1f | %.0f | %s |"
                     % (r["name"], status, r["seconds"], r["timeout"], ", ".join(r["files"])))
    counts, reasons = junit_counts(os.path.join(out, "junit.xml"))
    if counts is not None:
        lines += ["", "CUDA tests: %d collected, %d failed, %d errors, %d skipped." % tuple(counts)]
        if reasons:
            lines += ["", "Skip reasons:"] + ["- %d x %s" % (n, m or "(none given)")
                                              for m, n in reasons[:10]]
    lines += ["", "CUDA tests per feature (each must run at least one, where a GPU is found; "
              "parity: tests/test_cuda_parity.py's CPU <-> CUDA bit-equality tests passed):", "",
              "| feature | check | passed | failed | errors | skipped | parity | modules |",
              "|---|---|---|---|---|---|---|---|"]
    for feature, verdict, _, c in feature_checks(feature_counts(os.path.join(out, "junit.xml")),
                                                 gpu):
        lines.append("| %s | %s | %d | %d | %d | %d | %d | %s |" % (
            feature, verdict, c["passed"], c["failed"], c["errors"], c["skipped"], c["parity"],
            ", ".join(FEATURES.get(feature, ())) or "-"))
    missing = []
    env_txt = os.path.join(out, "env.txt")
    if os.path.exists(env_txt):
        with open(env_txt) as f:
            missing = [line.split()[1] for line in f
                       if line.startswith("module ") and " MISSING " in line]
    if missing:
        lines += ["", "Not installed (not fetched: no network; what needs them skips): "
                  + ", ".join(m if m not in PACKAGES else "%s (package %s)" % (m, PACKAGES[m])
                              for m in missing)]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the result files")
    parser.add_argument("--python", default=sys.executable,
                        help="the python with (CUDA) torch to build and test with")
    parser.add_argument("--budget", type=float, default=sum(TIMEOUTS.values()),
                        help="seconds for all phases together (default %(default)s)")
    parser.add_argument("--no-build", action="store_true",
                        help="test the extension already built in place, as it is")
    parser.add_argument("--timeout", action="append", default=[], metavar="PHASE=SECONDS",
                        help="a phase's own timeout (defaults: %s)"
                        % ", ".join("%s=%d" % kv for kv in TIMEOUTS.items()))
    args = parser.parse_args(argv)
    timeouts = dict(TIMEOUTS)
    for item in args.timeout:
        name, _, value = item.partition("=")
        if name not in timeouts or not value:
            parser.error("--timeout %r: expected PHASE=SECONDS with PHASE one of %s"
                         % (item, ", ".join(timeouts)))
        timeouts[name] = float(value)

    t0 = time.time()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    for name in FILES:  # results of an earlier run would read as this one's
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    gpu, gpu_note = gpu_present()
    env = dict(os.environ, PYTHONUNBUFFERED="1", PIP_NO_INDEX="1")
    # The checkout first on the path (the extension is built in place); no user site packages.
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    bench_dir = tempfile.mkdtemp(prefix="mpext-gpu-bench-")
    results = []
    try:
        for phase in plan(args.python, gpu, out, bench_dir):
            name = phase[0]
            if phase[1] is None:
                results.append({"name": name, "skipped": phase[2]})
                continue
            _, cmd, log_name, extra_env = phase
            if name == "build" and args.no_build:
                results.append({"name": name, "skipped": "--no-build: the extension built in "
                                "place is tested as it is", "status": "passed"})
                continue
            left = args.budget - (time.time() - t0)
            if name not in ("env", "build") and results[1].get("status") != "passed":
                results.append({"name": name, "skipped": "the build did not pass (build.log)"})
                continue
            if left <= 1:
                results.append({"name": name, "skipped": "no time left of the %.0f s budget"
                                % args.budget})
                continue
            r = run_phase(name, cmd, os.path.join(out, log_name), min(timeouts[name], left),
                          env=dict(env, **extra_env), grace=TESTS_GRACE if name == "tests" else 0)
            r["files"] = [log_name]
            if name == "tests" and os.path.exists(os.path.join(out, "junit.xml")):
                r["files"].append("junit.xml")
            if name == "bench":
                for src, dst in (("summary.md", "bench.md"), ("summary.json", "bench.json")):
                    if os.path.exists(os.path.join(bench_dir, src)):
                        shutil.copyfile(os.path.join(bench_dir, src), os.path.join(out, dst))
                        r["files"].append(dst)
            results.append(r)
            print("gpu_check: %s %s in %.1f s" % (name, r["status"], r["seconds"]), flush=True)
    finally:
        shutil.rmtree(bench_dir, ignore_errors=True)
    text = summary(results, gpu, gpu_note, out, args.budget, time.time() - t0)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    print(text)
    features_ok = all(ok for _, _, ok, _ in feature_checks(
        feature_counts(os.path.join(out, "junit.xml")), gpu))
    phases_ok = all(r.get("status", "passed") == "passed" for r in results)
    return 0 if phases_ok and features_ok else 1


if __name__ == "__main__":
    sys.exit(main())
