"""The random-kill maintenance test: :func:`run_and_kill` runs four jobs on one store, each a
process of its own that loops until it is killed, and kills and restarts them at random. The
jobs: a writer (resumes from the latest step, then saves one step after another), a compactor
(compacts the latest step), a collector (GC) and a reader (loads a committed step and compares it
bit for bit; exits with :data:`WRONG` on a difference). Each prints a line per thing done:
``saved S``, ``compacted S``, ``collected N``, ``read S`` or ``error TYPE message``."""

from __future__ import annotations

import collections
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deltackpt import Checkpointer, DeltackptError
from deltackpt.ops.gc import Retention
from helpers import assert_same_state

WRONG = 3
GRACE = 3.0  # GC's grace period: short, so that it deletes folders while the jobs run
DONE = ("saved", "compacted", "collected", "read")
JOB = "import sys; sys.path.insert(0, {tests!r}); from maintenance_procs import run; run({args})"


def state_at(step: int) -> dict:
    """The state at ``step`` (any step): rows of a table, a slice of a dense tensor and plain
    values change every step."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(2048, 8, generator=gen)
    dense = torch.randn(4096, generator=gen)
    for s in range(1, step + 1):
        table[torch.randint(0, 2048, (16,), generator=gen)] += s
        dense[s * 61 % 4000: s * 61 % 4000 + 96] = s
    return {"table": table, "dense": dense, "step": step, "lr": 0.5 ** (step % 9)}


def writer(path: str, options: dict, rng: random.Random) -> None:
    with Checkpointer(path, storage_options=options, take_over=True, chunk_bytes=1024,
                      memory_budget=1 << 16, base_every=rng.choice([3, 5, 50])) as ckpt:
        latest = ckpt.latest_step()
        if latest is not None:
            ckpt.restore(state_at(latest), latest)
        step = (latest or 0) + 1
        while True:
            ckpt.save(step, state_at(step), blocking=rng.random() < 0.5)
            print("saved", step, flush=True)
            step += 1
            time.sleep(rng.uniform(0, 0.1))


def compactor(path: str, options: dict, rng: random.Random) -> None:
    while True:
        with Checkpointer(path, storage_options=options, create=False) as ckpt:
            print("compacted", ckpt.compact().step, flush=True)
        time.sleep(rng.uniform(0, 0.5))


def collector(path: str, options: dict, rng: random.Random) -> None:
    while True:
        with Checkpointer(path, storage_options=options, create=False) as ckpt:
            report = ckpt.gc(Retention(keep_last=rng.choice([2, 3, 6])), grace_seconds=GRACE)
            print("collected", len(report.deleted), flush=True)
        time.sleep(rng.uniform(0, 0.5))


def reader(path: str, options: dict, rng: random.Random) -> None:
    while True:
        with Checkpointer(path, storage_options=options, create=False) as ckpt:
            steps = ckpt.steps()
            if steps:
                step = rng.choice(steps)
                got = ckpt.load(step)
                try:
                    assert_same_state(got, state_at(step))
                except AssertionError as e:
                    print("wrong", step, e, flush=True)
                    sys.exit(WRONG)
                print("read", step, flush=True)
        time.sleep(rng.uniform(0, 0.2))


JOBS = {"writer": writer, "compactor": compactor, "collector": collector, "reader": reader}


def run(role: str, path: str, options: dict, seed: int) -> None:
    """Runs ``role`` on the store at ``path``; a DeltackptError is printed and the loop goes on
    (a reader's step collected under it, a compaction that lost a race)."""
    rng = random.Random(seed)
    while True:
        try:
            JOBS[role](path, options, rng)
        except DeltackptError as e:
            print("error", type(e).__name__, " ".join(str(e).split())[:300], flush=True)
            time.sleep(rng.uniform(0, 0.3))


class Jobs:
    """The four jobs, each restarted when killed; every run's output goes to a log file."""

    def __init__(self, path: str, options: dict, logs: Path, rng: random.Random) -> None:
        self.path, self.options, self.logs, self.rng = path, options, logs, rng
        self.procs: dict[str, subprocess.Popen] = {}
        self.runs: collections.Counter[str] = collections.Counter()

    def start(self, role: str) -> None:
        self.runs[role] += 1
        args = f"{role!r}, {self.path!r}, {self.options!r}, {self.rng.randrange(1 << 30)}"
        with open(self.logs / f"{role}.{self.runs[role]}.log", "w") as out:
            code = JOB.format(tests=str(Path(__file__).parent), args=args)
            self.procs[role] = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=out)

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


def run_and_kill(path: str, options: dict, logs: Path, seconds: float, seed: int) -> None:
    """Runs the four jobs on the store at ``path`` for ``seconds``, killing and restarting one
    of the first three every 0.5-4 s, then checks the store; the jobs log into ``logs``."""
    logs.mkdir()
    rng = random.Random(seed)
    jobs = Jobs(path, options, logs, rng)
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
    with Checkpointer(path, storage_options=options, create=False, take_over=True) as ckpt:
        for _ in range(2):
            steps = ckpt.steps()
            assert steps
            for step in steps:
                assert_same_state(ckpt.load(step), state_at(step), f"step {step}")
            report = ckpt.verify()
            assert report.ok, report.problems
            ckpt.gc(grace_seconds=0)
