"""Crash and resume: a training process killed with SIGKILL, at random points and inside
checkpoint writes, resumes from its newest good checkpoint and ends bit for bit where an
uninterrupted run ends.

The worker (tests/resume_worker.py) trains a small low-precision model, checkpointing model,
optimizer and scaler every EVERY steps with mpext.checkpoint.save_checkpoint. Each chain of
launches below kills it

1. half-way through writing the payload of a checkpoint into its temporary file (the worker
   pauses there when asked, so the kill lands inside the write every time): the partial
   temporary file is on disk and fails verification, and the previous checkpoint is the newest;
2. after the temporary file is complete and fsync'ed but before the rename: a complete,
   verifying temporary file exists, and is still not taken for a checkpoint;
3. then the newest real checkpoint is truncated by the test (a torn file, as a file system
   without atomic rename, or a failing disk, could leave): it is skipped;
4. at a random step, chosen with a seeded RNG, plus a random delay of up to 5 ms;

and after every kill checks that the next launch resumes from the newest checkpoint that
verifies. The last launch runs to the end; its params, optimizer state (FP32 masters, moments,
step counts) and scaler state must be bitwise those of an uninterrupted run of the same worker
code (run in this process). A second chain kills only at random points, twice.
"""
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import zlib

import pytest
import torch

import mpext
import mpext.checkpoint as ckpt

import resume_worker
from test_checkpoint import assert_same_state

STEPS, EVERY = 60, 10
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resume_worker.py")
LAUNCH_TIMEOUT = 120  # s for a launch to reach a line (importing torch on a loaded machine)

HAS_MPO = hasattr(mpext, "MixedPrecisionOptimizer")
VARIANTS = ["adamw-gradscaler-fp16"] + [
    pytest.param(v, marks=pytest.mark.skipif(
        not HAS_MPO, reason="mpext.MixedPrecisionOptimizer is not in this mpext yet"))
    for v in ("mpo-fp16", "mpo-bf16")]


class Worker:
    """One launch of the worker, its stdout read line by line on a thread."""

    def __init__(self, directory, variant, pause=None):
        env = dict(os.environ)
        env.pop("MPEXT_TEST_PAUSE", None)
        if pause:
            env["MPEXT_TEST_PAUSE"] = pause
        self.proc = subprocess.Popen(
            [sys.executable, WORKER, str(directory), "--variant", variant, "--steps", str(STEPS),
             "--every", str(EVERY)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
            text=True)
        self.directory = directory
        self.lines = queue.Queue()
        self.seen = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            if line.endswith("\n") and line.strip():  # not the torn last line of a killed run
                self.lines.put(line.split())
        self.lines.put(None)

    def wait_for(self, word, at_least=None, timeout=LAUNCH_TIMEOUT):
        """Reads lines until one starts with ``word`` (and, if given, its number is >=
        ``at_least``); returns its words."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                words = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                pytest.fail("worker: no %r line within %d s; lines so far: %s"
                            % (word, timeout, self.seen[-5:]))
            if words is None:
                self.proc.wait(timeout=30)
                pytest.fail("worker exited (rc %s) before a %r line: %s"
                            % (self.proc.returncode, word, self.proc.stderr.read()[-3000:]))
            self.seen.append(words)
            if words and words[0] == word and (at_least is None or int(words[1]) >= at_least):
                return words

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        assert self.proc.returncode == -signal.SIGKILL

    def finish(self):
        self.wait_for("DONE")
        self.proc.wait(timeout=60)
        assert self.proc.returncode == 0, self.proc.stderr.read()[-3000:]


def newest_good_step(directory):
    path = ckpt.latest_checkpoint(directory, resume_worker.PATTERN)
    return 0 if path is None else int(os.path.basename(path)[5:11])


def temporaries(directory):
    return sorted(n for n in os.listdir(directory) if ckpt.is_temporary_file(n))


def resume(directory, variant, pause=None):
    """Launches the worker and checks it resumes from the newest checkpoint that verifies."""
    expected = newest_good_step(directory)
    w = Worker(directory, variant, pause)
    assert int(w.wait_for("RESUMED")[1]) == expected
    return w, expected


def kill_at_random_step(w, rng, start):
    """Kills the worker at a random step after ``start`` (and early enough that it cannot
    finish first), then checks the newest good checkpoint against what the worker printed:
    at least its last SAVED step (a save can complete after the last line read), and at most
    its last STEP rounded down to a checkpoint."""
    target = rng.randrange(start + 1, STEPS - 4)
    w.wait_for("STEP", at_least=target)
    time.sleep(rng.random() * 0.005)
    w.kill()
    while True:  # the lines the worker printed before it died
        try:
            words = w.lines.get(timeout=10)
        except queue.Empty:
            break
        if words is None:
            break
        w.seen.append(words)
    saved = [int(x[1]) for x in w.seen if x[0] == "SAVED" and len(x) == 2]
    last_step = max(int(x[1]) for x in w.seen if x[0] == "STEP" and len(x) == 2)
    newest = newest_good_step(w.directory)
    assert max(saved + [start]) <= newest <= last_step // EVERY * EVERY


def train_here(directory, variant, steps=STEPS):
    """resume_worker.train in this process, restoring the global torch settings it changes."""
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    rng = torch.get_rng_state()
    try:
        return resume_worker.train(str(directory), variant, steps, EVERY)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        torch.set_rng_state(rng)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final states of uninterrupted runs, by variant (trained in this process)."""
    cache = {}

    def get(variant):
        if variant not in cache:
            cache[variant] = train_here(tmp_path_factory.mktemp("uninterrupted"), variant)
        return cache[variant]
    return get


@pytest.mark.parametrize("variant", VARIANTS)
def test_kills_inside_writes_torn_file_and_random_kill(tmp_path, variant, reference):
    rng = random.Random(zlib.crc32(variant.encode()))
    # 1. Killed half-way through writing checkpoint 20's payload.
    w, start = resume(tmp_path, variant, pause="20:payload")
    assert start == 0
    tmp = w.wait_for("PAUSED")[1]
    w.kill()
    assert temporaries(tmp_path) == [os.path.basename(tmp)]
    with pytest.raises(ckpt.CheckpointError, match="truncated"):
        ckpt.verify_checkpoint(tmp)
    assert newest_good_step(tmp_path) == 10

    # 2. Killed with checkpoint 40 complete in its temporary file, before the rename.
    w, start = resume(tmp_path, variant, pause="40:rename")
    assert start == 10
    tmp40 = w.wait_for("PAUSED")[1]
    w.kill()
    ckpt.verify_checkpoint(tmp40)  # complete and valid, but never taken for a checkpoint
    assert len(temporaries(tmp_path)) == 2
    assert newest_good_step(tmp_path) == 30

    # 3. The newest checkpoint torn: truncated to half.
    newest = os.path.join(tmp_path, "step_000030.pt")
    with open(newest, "r+b") as f:
        f.truncate(os.path.getsize(newest) // 2)
    assert newest_good_step(tmp_path) == 20

    # 4. Killed at a random step, then run to the end.
    w, start = resume(tmp_path, variant)
    assert start == 20
    kill_at_random_step(w, rng, start)
    w, _ = resume(tmp_path, variant)
    w.finish()
    assert_same_state(reference(variant), ckpt.load_checkpoint(tmp_path / "final.pt"))


@pytest.mark.parametrize("variant", VARIANTS[:1])
def test_random_kills(tmp_path, variant, reference):
    rng = random.Random(12345)
    start = 0
    for _ in range(2):
        w, start = resume(tmp_path, variant)
        kill_at_random_step(w, rng, start)
    w, _ = resume(tmp_path, variant)
    w.finish()
    assert_same_state(reference(variant), ckpt.load_checkpoint(tmp_path / "final.pt"))


def test_a_different_run_is_detected(tmp_path, reference):
    """The comparison can fail: a run with one more step differs from the reference."""
    other = train_here(tmp_path, "adamw-gradscaler-fp16", STEPS + 1)
    with pytest.raises(AssertionError):
        assert_same_state(reference("adamw-gradscaler-fp16"), other)
