"""build_tools/gpu_check.py (`make gpu-check OUT=dir`), with its phases stubbed by tiny commands:
its timeouts, its result folder, what it says with no GPU. The real phases (a build, the CUDA
tests, the benchmark) are what the script runs on a lent GPU machine."""
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from build_tools import gpu_check  # noqa: E402

PY = sys.executable


def py(code):
    return [PY, "-c", textwrap.dedent(code)]


def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_phase_past_its_timeout_is_cut_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    cmd = py("""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(%r, "w").write(str(child.pid))
        print("phase started", flush=True)
        time.sleep(600)
    """ % str(pid_file))
    log = tmp_path / "phase.log"
    r = gpu_check.run_phase("build", cmd, str(log), timeout=2)
    assert r["status"] == "timed out" and r["rc"] != 0
    text = log.read_text()
    assert "phase started" in text and "build cut after its 2 s timeout" in text
    assert not alive(int(pid_file.read_text()))  # the phase's own child went with it


def test_a_phase_reports_its_exit_status(tmp_path):
    log = tmp_path / "x.log"
    assert gpu_check.run_phase("env", py("print('hi')"), str(log), 60)["status"] == "passed"
    r = gpu_check.run_phase("env", py("import sys; sys.exit(3)"), str(log), 60)
    assert (r["status"], r["rc"]) == ("failed", 3)
    assert log.read_text().count("$ ") == 2  # each command heads its output


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0"
failures="0" skipped="2" tests="2"><testcase classname="t" name="test_x[cuda]"><skipped
type="pytest.skip" message="no CUDA device">x</skipped></testcase><testcase classname="t"
name="test_y[cuda]"><skipped type="pytest.skip" message="no CUDA device">x</skipped></testcase>
</testsuite></testsuites>"""


REAL_PLAN = gpu_check.plan


def stub_plan(build_seconds=0):
    def plan(python, gpu, out, bench_dir):
        real = {p[0]: p for p in REAL_PLAN(python, gpu, out, bench_dir)}
        junit = os.path.join(out, "junit.xml")
        return [
            ("env", py("print('module lightning MISSING (ModuleNotFoundError)')"), "env.txt", {}),
            ("build", py("import os, time; print('MPEXT_FORCE_CUDA=' + os.environ"
                         "['MPEXT_FORCE_CUDA'], flush=True); time.sleep(%d)" % build_seconds),
             "build.log", real["build"][3]),
            ("tests", py("open(%r, 'w').write(%r)" % (junit, JUNIT)), "tests.log", {}),
            real["bench"], real["grad-release"], real["activations"],
        ]
    return plan


def result_files(out):
    names = sorted(os.listdir(out))
    assert len(names) <= 8 and set(names) <= set(gpu_check.FILES), names
    for name in names:
        assert os.path.isfile(os.path.join(out, name)) and re.fullmatch(r"[A-Za-z0-9._-]+", name)
    return names


def test_no_gpu_dry_run(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "gpu_present", lambda: (False, "nvidia-smi not found"))
    monkeypatch.setattr(gpu_check, "plan", stub_plan())
    out = tmp_path / "out"
    assert gpu_check.main(["--out", str(out)]) == 0
    assert result_files(out) == ["build.log", "env.txt", "junit.xml", "summary.md", "tests.log"]
    summary = (out / "summary.md").read_text()
    assert "**No GPU found** (nvidia-smi not found)" in summary
    assert "MPEXT_FORCE_CUDA=0" in (out / "build.log").read_text()
    assert "| bench | skipped: no GPU" in summary and "| grad-release | skipped: no GPU" in summary
    assert "| activations | skipped: no GPU" in summary
    assert "2 collected, 0 failed, 0 errors, 2 skipped" in summary
    assert "- 2 x no CUDA device" in summary
    assert "Not installed (not fetched: no network; what needs them skips): lightning" in summary


def test_a_hung_build_is_cut_and_the_summary_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "gpu_present", lambda: (True, "GPU 0: Fake"))
    monkeypatch.setattr(gpu_check, "plan", stub_plan(build_seconds=600))
    out = tmp_path / "out"
    (out).mkdir()
    (out / "junit.xml").write_text("stale")  # an earlier run's results are not reported
    assert gpu_check.main(["--out", str(out), "--timeout", "build=1"]) == 1
    result_files(out)
    summary = (out / "summary.md").read_text()
    assert "GPU found: GPU 0: Fake" in summary
    assert re.search(r"\| build \| \*\*TIMED OUT\*\*: cut after 1 s \|", summary)
    assert "| tests | skipped: the build did not pass" in summary
    assert "| bench | skipped: the build did not pass" in summary
    assert "| grad-release | skipped: the build did not pass" in summary
    assert "| activations | skipped: the build did not pass" in summary
    assert "MPEXT_FORCE_CUDA=1" in (out / "build.log").read_text()
    assert not (out / "junit.xml").exists()


def test_the_budget_cuts_the_phases_that_remain(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "gpu_present", lambda: (False, "none"))
    monkeypatch.setattr(gpu_check, "plan", stub_plan(build_seconds=600))
    out = tmp_path / "out"
    assert gpu_check.main(["--out", str(out), "--budget", "3"]) == 1
    assert re.search(r"\| build \| \*\*TIMED OUT\*\*", (out / "summary.md").read_text())


@pytest.mark.parametrize("gpu", [False, True])
def test_the_real_plan(gpu, tmp_path):
    """What runs there: the CUDA tests only, a build that must have CUDA when a GPU is there
    (and cannot try to when none is), the benchmark on the GPU; no pip, no fetch."""
    phases = {p[0]: p for p in gpu_check.plan("python3", gpu, str(tmp_path), "/tmp/b")}
    assert phases["build"][3] == {"MPEXT_FORCE_CUDA": "1" if gpu else "0"}
    tests = phases["tests"][1]
    assert tests[tests.index("-k") + 1] == "cuda" and tests[tests.index("pytest") + 1] == "tests"
    if gpu:
        bench = phases["bench"][1]
        assert "benchmarks.run_all" in bench and bench[bench.index("--device") + 1] == "cuda"
        assert "--quick" in bench
        release = phases["grad-release"][1]  # the memory figures, GPU allocator
        assert release[release.index("-m") + 1] == "benchmarks.measure_grad_release"
        assert "--memory-only" in release and release[release.index("--device") + 1] == "cuda"
        assert phases["grad-release"][2] == "bench.log"  # appended after run_all's output
        assert gpu_check.TIMEOUTS["grad-release"] <= 60
        acts = phases["activations"][1]  # the activation figures on the GPU's allocator
        assert acts[acts.index("-m") + 1] == "benchmarks.bench_activations"
        assert acts[acts.index("--device") + 1] == "cuda" and phases["activations"][2] == \
            "bench.log"
    else:
        assert all(phases[k][1] is None for k in ("bench", "grad-release", "activations"))
    assert sum(gpu_check.TIMEOUTS.values()) <= 480  # the check fits 8 minutes
    for p in phases.values():
        words = " ".join(p[1] or [])
        assert not re.search(r"\bpip\b|install|curl|wget", words), words
    files = [p[2] for p in phases.values() if p[1] is not None] + ["summary.md", "junit.xml",
                                                                   "bench.md", "bench.json"]
    assert set(files) <= set(gpu_check.FILES) and len(gpu_check.FILES) <= 8


def test_no_build_tests_the_extension_as_it_is(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "gpu_present", lambda: (False, "none"))
    monkeypatch.setattr(gpu_check, "plan", stub_plan(build_seconds=600))
    out = tmp_path / "out"
    assert gpu_check.main(["--out", str(out), "--no-build"]) == 0
    summary = (out / "summary.md").read_text()
    assert "| build | skipped: --no-build" in summary and "| tests | passed" in summary
    assert not (out / "build.log").exists()


def test_the_benchmark_modules_of_the_real_plan_start(tmp_path):
    """Each benchmark a lent GPU would run imports and parses its options (`--help`) here: a
    module that failed at import (a helper it names moved away) would cost the GPU's one run
    that phase, and nothing else runs these modules before it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    phases = gpu_check.plan(PY, True, str(tmp_path), str(tmp_path / "b"))
    modules = [argv[argv.index("-m") + 1] for _, argv, *_ in phases
               if argv is not None and "-m" in argv and
               argv[argv.index("-m") + 1].startswith("benchmarks.")]
    assert {"benchmarks.run_all", "benchmarks.measure_grad_release",
            "benchmarks.bench_activations"} <= set(modules)
    # One interpreter runs every module as `python -m module --help` would (runpy, argv,
    # SystemExit(0) from argparse): a process per module cost ~3 s of imports each.
    script = """
import contextlib, io, runpy, sys
for module in sys.argv[1:]:
    out = io.StringIO()
    sys.argv = [module, "--help"]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code or 0
    ok = code == 0 and "usage:" in out.getvalue()
    print("%s %s" % ("OK" if ok else "FAILED", module), flush=True)
"""
    done = subprocess.run([PY, "-c", script] + modules, cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [w for m in modules for w in ("OK", m)], \
        (done.stdout, done.stderr[-2000:])


# ---- the CUDA tests per feature ---------------------------------------------------------------

def junit(cases):
    """A junit XML as pytest writes it: cases are (classname, name, outcome) with outcome one
    of passed, failed, error, skipped."""
    body = {"passed": "", "failed": '<failure message="assert 0">x</failure>',
            "error": '<error message="collection failure">x</error>',
            "skipped": '<skipped type="pytest.skip" message="no CUDA device">x</skipped>'}
    rows = "".join('<testcase classname="%s" name="%s" time="0.1">%s</testcase>'
                   % (c, n, body[o]) for c, n, o in cases)
    return ('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" '
            'errors="0" failures="0" skipped="0" tests="%d">%s</testsuite></testsuites>'
            % (len(cases), rows))


def every_feature_passing():
    """One passed CUDA test in a module of each feature."""
    return [("tests." + mods[0], "test_x[cuda]", "passed")
            for mods in gpu_check.FEATURES.values()]


def test_feature_counts_from_junit(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(junit([
        ("tests.test_lion", "test_op[cuda-0.1]", "passed"),
        ("tests.test_lion", "test_op[cuda-0.2]", "failed"),
        ("tests.test_lion", "test_op[cpu-0.1]", "passed"),  # not a CUDA test: not counted
        ("tests.test_scale_ops", "test_unscale[cuda]", "skipped"),
        ("tests.test_grad_scaler.TestCuda", "test_y", "passed"),  # a class named for CUDA
        ("tests.test_cuda_parity", "test_table_steps_bitwise_as_the_cpu[adam-fp32]", "passed"),
        ("tests.test_cuda_parity", "test_release_steps_bitwise_as_the_cpu[x]", "skipped"),
        ("tests.test_cuda_parity", "test_casts_to_bf16_bitwise_as_the_cpu[sr]", "failed"),
        ("tests.test_cuda_parity", "test_whatever_else", "passed"),
        ("", "tests.test_dcp_formats", "error"),  # a module that failed to collect
        ("tests.test_build_tools", "test_cuda_flags", "passed"),  # of no feature: its own
    ]))
    counts = gpu_check.feature_counts(str(path))

    def c(passed=0, failed=0, errors=0, skipped=0, parity=0):
        return dict(passed=passed, failed=failed, errors=errors, skipped=skipped, parity=parity)

    assert counts == {"lion": c(passed=1, failed=1), "scaler": c(passed=1, skipped=1),
                      "table": c(passed=1, parity=1), "release": c(skipped=1),
                      "casts": c(failed=1), "parity": c(passed=1, parity=1),
                      "dcp": c(errors=1), "build_tools": c(passed=1)}
    assert gpu_check.feature_counts(str(tmp_path / "missing.xml")) is None


def test_a_feature_with_no_gpu_test_run_fails_the_check():
    counts = {"lion": dict(passed=3, failed=0, errors=0, skipped=1, parity=0),
              "sgd": dict(passed=0, failed=0, errors=0, skipped=9, parity=0),  # all skipped
              "casts": dict(passed=5, failed=1, errors=0, skipped=0, parity=2),
              "dcp": dict(passed=0, failed=0, errors=1, skipped=0, parity=0),
              "build_tools": dict(passed=0, failed=0, errors=0, skipped=2, parity=0)}
    rows = {f: (verdict, ok) for f, verdict, ok, _ in gpu_check.feature_checks(counts, True)}
    assert list(rows)[:len(gpu_check.FEATURES)] == list(gpu_check.FEATURES)
    assert rows["lion"] == ("pass", True)
    assert rows["sgd"] == ("**FAIL**: no CUDA test ran (9 skipped)", False)
    assert rows["activations"] == ("**FAIL**: no CUDA test ran (0 skipped)", False)  # none
    assert rows["casts"] == ("**FAIL**: 1 failed, 0 errors", False)
    assert rows["dcp"] == ("**FAIL**: 0 failed, 1 errors", False)
    assert rows["build_tools"][1]  # not a feature: reported, required of nothing
    assert [ok for _, ok in rows.values()].count(True) == 2
    # without a GPU nothing could run: reported, and that fails nothing
    assert all(ok and v == "not run: no GPU" for _, v, ok, _ in
               gpu_check.feature_checks({"sgd": counts["sgd"]}, False))
    # with a GPU and no junit.xml (the tests were cut before pytest wrote it), nothing is known
    assert not any(ok for _, _, ok, _ in gpu_check.feature_checks(None, True))


def test_every_feature_names_test_modules_that_exist():
    tests = os.path.dirname(os.path.abspath(__file__))
    for feature, modules in gpu_check.FEATURES.items():
        assert modules, feature
        for m in modules:
            assert os.path.exists(os.path.join(tests, m + ".py")), (feature, m)
    assert os.path.exists(os.path.join(tests, gpu_check.PARITY + ".py"))
    # each test of the parity module counts for a feature, by its name's first word
    with open(os.path.join(tests, gpu_check.PARITY + ".py")) as f:
        names = re.findall(r"^def (test_\w+)", f.read(), re.M)
    assert names and all(gpu_check.feature_of(gpu_check.PARITY, n) in gpu_check.FEATURES
                         for n in names), names


def gpu_plan_with_junit(xml):
    """The stubbed plan with a GPU present, its tests phase writing `xml` as junit.xml."""
    def plan(python, gpu, out, bench_dir):
        junit_path = os.path.join(out, "junit.xml")
        phases = stub_plan()(python, gpu, out, bench_dir)
        phases[2] = ("tests", py("open(%r, 'w').write(%r)" % (junit_path, xml)), "tests.log",
                     {})
        return phases[:3]  # no benchmarks: they are not what is checked here
    return plan


@pytest.mark.parametrize("missing", [None, "release"])
def test_the_summary_lists_each_feature_and_a_silent_one_fails(monkeypatch, tmp_path, missing):
    monkeypatch.setattr(gpu_check, "gpu_present", lambda: (True, "GPU 0: Fake"))
    cases = [c for c in every_feature_passing() if missing is None or
             c[0] != "tests." + gpu_check.FEATURES[missing][0]]
    cases.append(("tests.test_cuda_parity", "test_norm_grad_norm_within_an_ulp[0.3]", "passed"))
    monkeypatch.setattr(gpu_check, "plan", gpu_plan_with_junit(junit(cases)))
    out = tmp_path / "out"
    rc = gpu_check.main(["--out", str(out)])
    summary = (out / "summary.md").read_text()
    assert "| tests | passed" in summary
    assert "| lion | pass | 1 | 0 | 0 | 0 | 0 | test_lion |" in summary
    assert "| norm | pass | 2 | 0 | 0 | 0 | 1 | test_grad_norm |" in summary
    if missing is None:
        assert rc == 0 and "**FAIL**" not in summary
    else:  # every phase passed, yet a feature ran no CUDA test: the check fails
        assert rc == 1
        assert "| release | **FAIL**: no CUDA test ran (0 skipped) | 0 | 0 | 0 | 0 | 0 |" \
            in summary


def test_a_cut_tests_phase_still_leaves_its_junit(tmp_path):
    """pytest past the tests phase's timeout is interrupted (SIGINT) first: it ends its session
    and writes junit.xml with the tests that ran, which the per-feature summary reads."""
    (tmp_path / "test_slow.py").write_text(textwrap.dedent("""
        import time
        def test_quick_cuda():
            pass
        def test_hangs_cuda():
            time.sleep(600)
    """))
    xml = tmp_path / "junit.xml"
    cmd = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-k", "cuda",
           str(tmp_path / "test_slow.py"), "--junitxml", str(xml)]
    # launched as a shell's background job is (CI started with `&`): SIGINT ignored, which a
    # child keeps unless the phase restores it
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        r = gpu_check.run_phase("tests", cmd, str(tmp_path / "tests.log"), timeout=16, grace=8,
                                cwd=str(tmp_path))
    finally:
        signal.signal(signal.SIGINT, ignored)
    assert r["status"] == "timed out" and r["seconds"] < 16 + 12
    assert "tests interrupted (SIGINT) 8 s before its timeout" in (tmp_path / "tests.log"
                                                                   ).read_text()
    counts = gpu_check.feature_counts(str(xml))
    assert counts == {"slow": dict(passed=1, failed=0, errors=0, skipped=0, parity=0)}


def test_lion_pytorch_is_a_listed_dependency(tmp_path):
    assert "lion_pytorch" in gpu_check.TEST_DEPS and "lion-pytorch" in \
        gpu_check.PACKAGES.values()
    (tmp_path / "env.txt").write_text("module lion_pytorch MISSING (ModuleNotFoundError)\n")
    text = gpu_check.summary([], False, "none", str(tmp_path), 470, 1)
    assert "lion_pytorch (package lion-pytorch)" in text
