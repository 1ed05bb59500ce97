"""build_tools/core.py's check of whether an object must be compiled again, which setup.py (the
C core) and tests/cuda_emu/run.py use: it must follow the source, every header the compiler says
the source includes, and the command, so that an incremental build never links a stale object."""
import os
import shutil
import subprocess
import sys

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
