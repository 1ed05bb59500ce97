"""build_tools/core.py's check of whether an object must be compiled again, which setup.py (the
C core) and tests/cuda_emu/run.py use: it must follow the source, every header the compiler says
the source includes, and the command, so that an incremental build never links a stale object;
and the -O level every unit is built at (MPEXT_OPT_LEVEL)."""
import glob
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from build_tools import core  # noqa: E402

CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def compile_(cmd, obj, while_compiling=None):
    began = core.begin(obj)
    subprocess.run(cmd + ["-MMD", "-MF", obj + ".d"], check=True)
    if while_compiling is not None:
        while_compiling()
    core.record(obj, cmd, began)


def changed(path, obj, after=True):
    """path changed after obj was built (or, after=False, long before)."""
    t = os.path.getmtime(obj) + (10 if after else -10)
    os.utime(path, (t, t))


@pytest.mark.skipif(CC is None, reason="no C compiler on PATH")
def test_up_to_date_follows_source_headers_and_command(tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "used.h").write_text("#define VALUE 3\n")
    (inc / "unused.h").write_text("#define OTHER 4\n")
    src = tmp_path / "a.c"
    src.write_text('#include "used.h"\nint value(void) { return VALUE; }\n')
    obj = str(tmp_path / "out" / "a.o")
    os.makedirs(os.path.dirname(obj))
    cmd = [CC, "-c", str(src), "-o", obj, "-I" + str(inc)]

    assert not core.up_to_date(obj, cmd)  # never compiled
    compile_(cmd, obj)
    assert core.up_to_date(obj, cmd)
    assert not core.up_to_date(obj, cmd + ["-O2"])  # another command

    changed(inc / "unused.h", obj)  # a header the source does not include
    assert core.up_to_date(obj, cmd)
    changed(inc / "used.h", obj)  # one it does
    assert not core.up_to_date(obj, cmd)
    changed(inc / "used.h", obj, after=False)
    assert core.up_to_date(obj, cmd)
    changed(src, obj)
    assert not core.up_to_date(obj, cmd)
    changed(src, obj, after=False)

    compile_(cmd, obj)
    os.remove(inc / "used.h")  # a dependency gone: compile again (and fail there, visibly)
    assert not core.up_to_date(obj, cmd)
    (inc / "used.h").write_text("#define VALUE 3\n")
    compile_(cmd, obj)
    os.remove(obj + ".d")  # no dependency list: nothing is known
    assert not core.up_to_date(obj, cmd)

    # a header edited while the compiler ran (after it read the old one): compiled again
    compile_(cmd, obj)
    assert core.up_to_date(obj, cmd)
    compile_(cmd, obj, while_compiling=lambda: (inc / "used.h").write_text("#define VALUE 4\n"))
    assert not core.up_to_date(obj, cmd)

    # a compile cut short leaves no stamp: the old command cannot vouch for a new object
    compile_(cmd, obj)
    core.begin(obj)
    assert not core.up_to_date(obj, cmd)


@pytest.mark.skipif(CC is None, reason="no C compiler on PATH")
def test_compile_all_in_parallel_keeps_the_good_objects_when_one_fails(tmp_path):
    """A failing unit fails the build with the compiler's message; the units that compiled are
    recorded, so the next build compiles only what failed, and a build with nothing changed
    compiles nothing."""
    srcs = {}
    for name, body in (("a", "int a(void) { return 1; }\n"), ("b", "int b(void) { return }\n"),
                       ("c", "int c(void) { return 3; }\n")):
        srcs[name] = tmp_path / (name + ".c")
        srcs[name].write_text(body)
    out = tmp_path / "out"
    jobs = [(str(src), [CC, "-c", str(src), "-o", str(out / (n + ".o"))], str(out / (n + ".o")))
            for n, src in srcs.items()]
    lines = []
    with pytest.raises(core.CompileError) as err:
        core.compile_all(jobs, workers=3, log=lines.append)
    assert "b.c" in str(err.value) and "error" in str(err.value)
    assert "a.c" not in str(err.value)
    ok = {n: core.up_to_date(obj, cmd) for n, (_, cmd, obj) in zip(srcs, jobs)}
    assert ok == {"a": True, "b": False, "c": True}
    assert any("compiled" in line and "a.c" in line for line in lines)

    srcs["b"].write_text("int b(void) { return 2; }\n")
    assert core.compile_all(jobs, workers=3, log=lines.append) == 1
    assert core.compile_all(jobs, workers=3, log=lines.append) == 0
    assert all(core.up_to_date(obj, cmd) for _, cmd, obj in jobs)


def _opt_levels(cmd):
    return [a for a in cmd if re.fullmatch(r"-O[0-3sg]?", a)]


def _setup_py_compile_args(monkeypatch):
    """The extra_compile_args setup.py gives the extension, read by running setup.py here with
    setuptools.setup replaced (nothing is built; torch is imported already)."""
    import setuptools
    from torch.utils import cpp_extension
    got = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: got.update(kw))
    monkeypatch.setattr(sys, "argv", ["setup.py", "build_ext"])
    # what setup.py may set when it finds CUDA, put back afterwards
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cpp_extension.CUDA_HOME)
    for var in ("CUDA_HOME", "TORCH_CUDA_ARCH_LIST"):
        monkeypatch.setenv(var, os.environ.get(var, ""))
        if not os.environ[var]:
            monkeypatch.delenv(var)
    runpy.run_path(os.path.join(core.ROOT, "setup.py"), run_name="__main__")
    ext, = got["ext_modules"]
    return ext.extra_compile_args


def test_every_unit_is_built_at_o3_unless_mpext_opt_level_says_otherwise(monkeypatch):
    """A build that sets nothing -- a user's pip install -- compiles every C core object, the
    C++ binding and the CUDA sources at -O3 (the last -O flag wins, so it must come after the
    compiler's own, e.g. Python's CFLAGS); MPEXT_OPT_LEVEL=0, which .ci/package_check sets for
    its wheel, at -O0; a value that is not a level fails naming the variable, before anything
    is compiled. A sanitized C test build still overrides the level with its own -O1."""
    cc = ["gcc", "-g", "-O2"]  # a compiler command with a level of its own, as Python's has
    for level, want in ((None, "-O3"), ("0", "-O0"), ("", "-O3"), (" 2 ", "-O2")):
        if level is None:
            monkeypatch.delenv("MPEXT_OPT_LEVEL", raising=False)
        else:
            monkeypatch.setenv("MPEXT_OPT_LEVEL", level)
        jobs = core.core_jobs(cc, "/nonexistent")
        assert len(jobs) == len(list(core.compile_units())) > 0
        assert {_opt_levels(cmd)[-1] for _, cmd, _ in jobs} == {want}, level
        args = _setup_py_compile_args(monkeypatch)
        assert set(args) <= {"cxx", "nvcc"} and "cxx" in args
        assert {_opt_levels(flags)[-1] for flags in args.values()} == {want}, (level, args)
        sanitized = core.core_jobs(cc, "/nonexistent", ["-O1"])
        assert {_opt_levels(cmd)[-1] for _, cmd, _ in sanitized} == {"-O1"}
    monkeypatch.setenv("MPEXT_OPT_LEVEL", "fast")
    with pytest.raises(ValueError, match="MPEXT_OPT_LEVEL='fast' is not an optimisation level"):
        core.core_jobs(cc, "/nonexistent")
    with pytest.raises(SystemExit, match="MPEXT_OPT_LEVEL='fast'"):
        _setup_py_compile_args(monkeypatch)


def test_the_extensions_core_has_no_debug_info_the_test_builds_do(monkeypatch):
    """setup.py compiles the core with Python's compiler command, which has -g: the core's own
    -g0 must come after it (debug info made the -O3 compile ~20% longer; the C++ units are -g0
    too). The C tests and the CUDA emulation add -g after that, for their stack traces."""
    ctest = _load(os.path.join(core.ROOT, "tests", "c", "run.py"), "ctest_run_g")

    def debug(cmd):
        return [a for a in cmd if re.fullmatch(r"-g\d?", a)][-1]

    cc = ["gcc", "-g", "-O3"]
    assert {debug(cmd) for _, cmd, _ in core.core_jobs(cc, "/nonexistent")} == {"-g0"}
    for sanitize in (True, False):
        jobs = core.core_jobs(cc, "/nonexistent", ctest.core_extra(sanitize))
        assert {debug(cmd) for _, cmd, _ in jobs} == {"-g"}, sanitize


def _load(path, name):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("sanitize", [True, False])
def test_c_tests_and_cuda_emulation_share_one_core_build(monkeypatch, tmp_path, sanitize):
    """tests/c/run.py and tests/cuda_emu/run.py ask for the same core objects, compiled by the
    same commands, so a CI run that runs both compiles the core once per flag set."""
    ctest = _load(os.path.join(core.ROOT, "tests", "c", "run.py"), "ctest_run_t")
    emu = _load(os.path.join(core.ROOT, "tests", "cuda_emu", "run.py"), "emu_run_t")
    asked = {}

    def fake_compile_all(jobs, workers=None, log=print, lock=None):
        asked.setdefault("calls", []).append((list(jobs), lock))
        return 0

    monkeypatch.setattr(core, "compile_all", fake_compile_all)
    for module in (ctest, emu.ctest):
        monkeypatch.setattr(module, "link", lambda cmd: None)
    ctest.build(["cc"], str(tmp_path / "ctest"), sanitize)
    emu.build(["cc"], ["c++"], str(tmp_path / "emu"), sanitize, None)
    (c_jobs, c_lock), (e_jobs, e_lock) = asked["calls"]
    c_core = [j for j in c_jobs if j[0].startswith("csrc/core/")]
    e_core = [j for j in e_jobs if j[0].startswith("csrc/core/")]
    assert len(c_core) == len(list(core.compile_units())) and c_core == e_core
    assert c_lock == e_lock and c_lock.startswith(os.path.join(core.ROOT, "build", "core"))
    # and each still compiles its own sources
    c_own = {j[0] for j in c_jobs if not j[0].startswith("csrc/core/")}
    assert c_own == {os.path.relpath(s, core.ROOT) for s in ctest.test_sources()} | {
        os.path.join("tests", "c", "test_common.c")}
    assert any(j[0].endswith(".cu") for j in e_jobs)


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on PATH")
def test_the_makefiles_venv_imports_mpext_from_any_directory(tmp_path):
    """`make` puts the checkout on its own .venv's path: that venv's python imports this
    checkout's mpext from another directory with no PYTHONPATH. The venv here is a fresh one
    (no pip) that sees this interpreter's packages, torch among them, through a .pth of its own."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, stdout=subprocess.PIPE,
                             universal_newlines=True).stdout.strip()
    here = [p for p in sys.path if p.endswith("site-packages")]
    (Path(purelib) / "parent.pth").write_text("\n".join(here) + "\n")
    (venv / ".stamp").touch()  # the venv counts as made: make installs nothing
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHON", "MAKEFLAGS")}
    subprocess.run(["make", "-s", "-C", core.ROOT, "venv-path", "VENV=" + str(venv)], check=True,
                   env=env)
    proc = subprocess.run([py, "-c", "import mpext; print(mpext.__file__)"], cwd=str(tmp_path),
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True)
    assert proc.returncode == 0, proc.stdout
    assert os.path.realpath(proc.stdout.strip()) == os.path.realpath(
        os.path.join(core.ROOT, "mpext", "__init__.py"))


def test_import_mpext_leaves_dynamo_and_dtensor_to_those_who_use_them():
    """`import mpext` imports neither torch._dynamo nor torch.distributed.tensor (each about as
    much CPU time as `import torch`: every process of a job, every rank, paid it). A DTensor
    module imported later is still seen: the lookup is not cached as absent, and a Muon made
    later still gets its compile-disabled Newton-Schulz."""
    code = """if 1:
        import sys
        import torch
        import mpext
        from mpext import _common
        heavy = [m for m in ("torch._dynamo", "torch.distributed.tensor") if m in sys.modules]
        assert not heavy, heavy
        assert _common.dtensor_type() is None and not _common.is_dtensor(torch.zeros(1))
        from torch.distributed.tensor import DTensor
        assert _common.dtensor_type() is DTensor
        from mpext.optim import muon
        assert muon._orthogonalize_eagerly is None
        mpext.optim.Muon([torch.nn.Parameter(torch.zeros(4, 4))])
        assert muon._orthogonalize_eagerly is not None
        assert getattr(muon._orthogonalize_eagerly, "_torchdynamo_disable", False)
        print("ok")
    """
    proc = subprocess.run([sys.executable, "-c", code], cwd=core.ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, universal_newlines=True)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on PATH")
def test_a_noop_make_build_starts_no_python_and_a_changed_header_rebuilds(tmp_path):
    """`make build` runs setup.py (and the build_info print, each a Python start importing torch)
    only when a build source changed: here on a copy of the Makefile with a stand-in Python that
    logs its calls, a second build calls nothing, a touched header builds again."""
    for d in ("csrc/core", "cuda", "build_tools", "mpext"):
        (tmp_path / d).mkdir(parents=True)
    shutil.copy(os.path.join(core.ROOT, "Makefile"), tmp_path / "Makefile")
    (tmp_path / "setup.py").write_text("")
    (tmp_path / "csrc/core/x.h").write_text("")
    (tmp_path / "cuda/x.cu").write_text("")
    log = tmp_path / "calls.log"
    py = tmp_path / "python"
    py.write_text('#!/bin/sh\necho "$*" >> %s\n[ "$1" = setup.py ] && touch mpext/_C.so\n'
                  '[ "$1" = -c ] && echo "mpext build: {}"\nexit 0\n' % log)
    py.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MAKEFLAGS")}

    def build():
        log.write_text("")
        out = subprocess.run(["make", "-s", "-C", str(tmp_path), "build", "PYTHON=" + str(py)],
                             check=True, env=env, stdout=subprocess.PIPE,
                             universal_newlines=True).stdout
        assert "mpext build: {}" in out  # printed on a no-op build too, from the stored file
        return [c for c in log.read_text().splitlines() if "import mpext" in c or
                c.startswith("setup.py")]

    assert len(build()) == 2  # setup.py, then the build_info print
    assert build() == []
    stamp = tmp_path / "build" / ".stamp-build"
    t = os.path.getmtime(stamp) - 10  # the stamp made earlier, the header edited after it
    os.utime(stamp, (t, t))
    os.utime(tmp_path / "csrc/core/x.h", (t + 5, t + 5))
    assert len(build()) == 2
    assert build() == []
    (tmp_path / "mpext/_C.so").unlink()  # the extension gone: built again
    assert len(build()) == 2


def _built_object(src, isa):
    """The object `make build` (setup.py) made of `src` for `isa`, if it is up to date with the
    command setup.py would run now (build_tools/core.py's check), else None."""
    from setuptools._distutils.ccompiler import new_compiler
    from setuptools._distutils.sysconfig import customize_compiler
    cc = new_compiler()
    customize_compiler(cc)
    for lib_dir in sorted(glob.glob(os.path.join(core.ROOT, "build", "temp.*", "core"))):
        for s, cmd, obj in core.core_jobs(cc.compiler_so, lib_dir):
            if s == src and "-DMP_ISA_SUFFIX=" + isa in cmd and core.up_to_date(obj, cmd):
                return obj
    return None


@pytest.mark.skipif(CC is None or not core.X86, reason="needs a C compiler and an x86 target")
@pytest.mark.parametrize("src", ["csrc/core/fast/adam_fused.c", "csrc/core/fast/lion_fused.c"])
def test_the_avx512_fast_rows_keep_their_software_prefetches(tmp_path, src):
    """The AVX-512 rows' loops prefetch ahead on every array (adam_bf16x32.h a kilobyte, 8-26%
    faster at 16M elements on an Intel Xeon; lion_fused.c 512 elements, the whole of its rows'
    gain over the pipeline: docs/fast_paths.md). GCC once dropped every prefetch without a word
    (the wrapper was taken for a function without side effects), so the object's code is read
    here: the build's own object where it is up to date (the suite runs after `make build`:
    disassembling it takes a fraction of a second, compiling the unit again at -O3 took 10-30 s
    of CI's CPU), else the unit compiled exactly as the build does."""
    built = _built_object(src, "avx512") if shutil.which("objdump") else None
    if built is not None:
        asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", built], check=True,
                             stdout=subprocess.PIPE, universal_newlines=True).stdout
    else:
        (_, cmd, obj), = [j for j in core.core_jobs([CC], str(tmp_path))
                          if j[0] == src and "-DMP_ISA_SUFFIX=avx512" in j[1]]
        out = str(tmp_path / (Path(src).stem + ".s"))
        subprocess.run([{"-c": "-S", obj: out}.get(a, a) for a in cmd], check=True)
        asm = Path(out).read_text()
    # one per array in each hand-written row's loop: far more than a handful (Adam's: 32
    # elements a loop; Lion's four rows: 38)
    assert asm.count("prefetcht0") >= 16, "the AVX-512 rows of %s lost their software " \
        "prefetches" % src


# ---- The rules' op entries, generated from the rows (build_tools/rules.py) -------------------

from build_tools import rules  # noqa: E402


@pytest.mark.skipif(CC is None, reason="no C compiler on PATH")
def test_rule_names_are_the_rows_the_compiler_sees():
    """rule_names() reads MP_RULES's rows as the C preprocessor expands them (mpext/step.h
    includes the rows and every rule header), in order."""
    src = '#include "mpext/step.h"\n#define NAME_(ID, name, MIN, MAX) RULE=name\nMP_RULES(NAME_)\n'
    out = subprocess.run([CC, "-E", "-P", "-x", "c", "-", "-I", core.INCLUDE_DIRS[0]], input=src,
                         check=True, stdout=subprocess.PIPE, universal_newlines=True).stdout
    import re
    assert rules.rule_names() == re.findall(r"RULE=(\w+)", out)
    assert len(rules.rule_names()) >= 3


def _rows(tmp_path, rows, entries):
    """A rows header with ``rows`` (name list) and entry headers ``entries`` (name -> body)."""
    header = tmp_path / "rules_rows.h"
    header.write_text("#define MP_RULES(X) \\\n%s\n\nint after;\n" % " \\\n".join(
        "  X(%s, %s, 0, 1)" % (n.upper(), n) for n in rows))
    entry_dir = tmp_path / "entries"
    entry_dir.mkdir(exist_ok=True)
    for name, body in entries.items():
        (entry_dir / (name + ".h")).write_text(body)
    return str(header), str(entry_dir)


@pytest.mark.skipif(CC is None, reason="no C compiler on PATH")
def test_the_generated_entries_compile_from_the_build_tree(tmp_path):
    """Each row's entry is included once, in row order: <name>.h, or the header of the longest
    leading words of its name (two phases' rows, one header); the generated header, compiled
    from where it is written, reaches them all (the compiler resolves its relative paths)."""
    header, entry_dir = _rows(tmp_path, ["alpha", "beta_one", "beta_two", "gamma_x"],
                              {"alpha": "int alpha;\n", "beta": "int beta;\n",
                               "gamma": "int gamma_short;\n", "gamma_x": "int gamma_x;\n"})
    out = str(tmp_path / "gen")
    path = rules.write_entries(out, header, entry_dir)
    assert path == os.path.join(out, "rules", "rules.h")
    # by its path, with no -I: its includes resolve from its own folder alone
    pre = subprocess.run([CC, "-E", "-P", "-x", "c", path], check=True, cwd=str(tmp_path),
                         stdout=subprocess.PIPE, universal_newlines=True).stdout
    import re
    assert re.findall(r"int (\w+);", pre) == ["alpha", "beta", "gamma_x"]


def test_the_generated_entries_are_rewritten_only_when_they_change(tmp_path):
    """An unchanged list keeps its file's time (an incremental build compiles nothing again);
    a new row rewrites it; a row without an entry is refused, naming the row."""
    header, entry_dir = _rows(tmp_path, ["alpha"], {"alpha": "", "beta": ""})
    out = str(tmp_path / "gen")
    path = rules.write_entries(out, header, entry_dir)
    t = os.path.getmtime(path) - 100
    os.utime(path, (t, t))
    rules.write_entries(out, header, entry_dir)
    assert os.path.getmtime(path) == t
    header, _ = _rows(tmp_path, ["alpha", "beta"], {})
    rules.write_entries(out, header, entry_dir)
    assert os.path.getmtime(path) != t and "beta.h" in Path(path).read_text()
    header, _ = _rows(tmp_path, ["alpha", "delta_phase"], {})
    with pytest.raises(RuntimeError, match=r"the rule row 'delta_phase' has no op entry: "
                                           r"expected .*delta_phase\.h"):
        rules.write_entries(out, header, entry_dir)
