"""A writer, a compactor, a GC and a reader on one store, as processes killed at random (SIGKILL)
and started again: no read ever gives other bits than the step's, and in the end every committed
step restores bit for bit and verify finds nothing. The jobs are in ``maintenance_procs``."""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from deltackpt import Checkpointer
from helpers import assert_same_state
from maintenance_procs import state_at

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DONE = ("saved", "compacted", "collected", "read")
GRACE = 3.0  # GC's grace period: short, so that it deletes folders while the jobs run
JOB = "import sys; sys.path.insert(0, {tests!r}); from maintenance_procs import run; run({args})"


class Jobs:
    """The four jobs, each restarted when killed; every run's output goes to a log file."""

    def __init__(self, path: str, logs, rng: random.Random) -> None:
        self.path, self.logs, self.rng = path, logs, rng
        self.procs: dict[str, subprocess.Popen] = {}
        self.runs: collections.Counter[str] = collections.Counter()

    def start(self, role: str) -> None:
        self.runs[role] += 1
        args = f"{role!r}, {self.path!r}, {self.rng.randrange(1 << 30)}, {GRACE}"
        with open(self.logs / f"{role}.{self.runs[role]}.log", "w") as out:
            self.procs[role] = subprocess.Popen(
                [sys.executable, "-c", JOB.format(tests=TESTS, args=args)], stdout=out, stderr=out)

    def kill(self, role: str) -> None:
        self.procs[role].send_signal(signal.SIGKILL)
        self.procs[role].wait()

    def check_alive(self) -> None:
        for role, proc in self.procs.items():
            if proc.poll() is not None:
                log = (self.logs / f"{role}.{self.runs[role]}.log").read_text()
                pytest.fail(f"{role} exited by itself ({proc.returncode}):\n{log[-3000:]}")

    def events(self) -> collections.Counter[str]:
        found: collections.Counter[str] = collections.Counter()
        for log in self.logs.iterdir():
            for line in log.read_text().splitlines():
                words = line.split() or [""]
                found[" ".join(words[:2]) if words[0] == "error" else words[0]] += 1
        return found


def run_and_kill(tmp_path, seconds: float, seed: int) -> None:
    path, logs = str(tmp_path / "store"), tmp_path / "logs"
    logs.mkdir()
    rng = random.Random(seed)
    jobs = Jobs(path, logs, rng)
    jobs.start("writer")
    deadline = time.monotonic() + 120
    while "saved" not in (logs / "writer.1.log").read_text():
        jobs.check_alive()
        assert time.monotonic() < deadline, "the writer saved nothing in 120 s"
        time.sleep(0.2)
    for role in ("compactor", "collector", "reader"):
        jobs.start(role)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            time.sleep(rng.uniform(0.5, 4.0))
            jobs.check_alive()
            role = rng.choice(["writer", "writer", "compactor", "collector"])
            jobs.kill(role)
            jobs.start(role)
        deadline = time.monotonic() + 120  # unkilled, until each job has done its work once
        while not all(jobs.events()[done] for done in DONE) and time.monotonic() < deadline:
            jobs.check_alive()
            time.sleep(0.5)
    finally:
        for role in jobs.procs:
            jobs.kill(role)
    events = jobs.events()
    print(dict(jobs.runs), dict(events))
    assert events["wrong"] == 0
    assert all(events[done] for done in DONE), dict(events)
    with Checkpointer(path, create=False, take_over=True) as ckpt:
        for _ in range(2):
            steps = ckpt.steps()
            assert steps
            for step in steps:
                assert_same_state(ckpt.load(step), state_at(step), f"step {step}")
            report = ckpt.verify()
            assert report.ok, report.problems
            ckpt.gc(grace_seconds=0)


def test_maintenance_beside_a_writer_all_killed_at_random(tmp_path):
    run_and_kill(tmp_path, seconds=25, seed=0)


@pytest.mark.slow
def test_maintenance_beside_a_writer_all_killed_at_random_for_minutes(tmp_path):
    run_and_kill(tmp_path, seconds=300, seed=1)
