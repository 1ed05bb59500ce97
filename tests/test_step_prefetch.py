"""The step pipeline's software prefetch (csrc/core/step.c, ``prefetch_tile``) survives
compilation. It is a hint with no visible effect, so no test of the bits can see it go; GCC once
deleted every prefetch of a fast path unseen (tests/test_build_tools.py), so the object's code is
read here, compiled exactly as the build compiles it."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from build_tools import core  # noqa: E402

CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@pytest.mark.skipif(CC is None or not core.X86, reason="needs a C compiler and an x86 target")
def test_the_tile_pipeline_keeps_its_prefetch(tmp_path):
    # the build without the fast paths: step.c's own code alone
    (src, cmd, obj), = [j for j in core.core_jobs([CC], str(tmp_path), fast=False)
                        if j[0] == "csrc/core/step.c" and "-DMP_ISA_SUFFIX=avx512" in j[1]]
    out = str(tmp_path / "step.s")
    subprocess.run([{"-c": "-S", obj: out}.get(a, a) for a in cmd], check=True, cwd=ROOT)
    asm = Path(out).read_text()
    # prefetch_tile's loops: one per array it may stream (grad, param, master, remainder,
    # exp_avg, ema)
    found = re.findall(r"\bprefetch(?:t0|t1|t2|nta|w)\b", asm)
    assert len(found) >= 6, "the tile pipeline lost its software prefetch"
