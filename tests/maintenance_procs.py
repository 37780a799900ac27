"""The jobs of the random-kill maintenance test, each a process of its own that loops until it is
killed: a writer (resumes from the latest step, then saves one step after another), a compactor
(compacts the latest step), a collector (GC) and a reader (loads a committed step and compares
it bit for bit; exits with :data:`WRONG` on a difference). Each prints a line per thing done:
``saved S``, ``compacted S``, ``collected N``, ``read S`` or ``error TYPE message``."""

from __future__ import annotations

import random
import sys
import time

import torch

from deltackpt import Checkpointer, DeltackptError
from deltackpt.ops.gc import Retention
from helpers import assert_same_state

WRONG = 3


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


def writer(path: str, rng: random.Random) -> None:
    with Checkpointer(path, take_over=True, base_every=rng.choice([3, 5, 50]),
                      chunk_bytes=1024, memory_budget=1 << 16) as ckpt:
        latest = ckpt.latest_step()
        if latest is not None:
            ckpt.restore(state_at(latest), latest)
        step = (latest or 0) + 1
        while True:
            ckpt.save(step, state_at(step), blocking=rng.random() < 0.5)
            print("saved", step, flush=True)
            step += 1
            time.sleep(rng.uniform(0, 0.1))


def compactor(path: str, rng: random.Random) -> None:
    while True:
        with Checkpointer(path, create=False) as ckpt:
            print("compacted", ckpt.compact().step, flush=True)
        time.sleep(rng.uniform(0, 0.5))


def collector(path: str, rng: random.Random, grace: float) -> None:
    while True:
        with Checkpointer(path, create=False) as ckpt:
            report = ckpt.gc(Retention(keep_last=rng.choice([2, 3, 6])), grace_seconds=grace)
            print("collected", len(report.deleted), flush=True)
        time.sleep(rng.uniform(0, 0.5))


def reader(path: str, rng: random.Random) -> None:
    while True:
        with Checkpointer(path, create=False) as ckpt:
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


def run(role: str, path: str, seed: int, grace: float) -> None:
    """Runs ``role`` on the store at ``path``; a DeltackptError is printed and the loop goes on
    (a reader's step collected under it, a compaction that lost a race)."""
    rng = random.Random(seed)
    while True:
        try:
            if role == "collector":
                collector(path, rng, grace)
            else:
                {"writer": writer, "compactor": compactor, "reader": reader}[role](path, rng)
        except DeltackptError as e:
            print("error", type(e).__name__, " ".join(str(e).split())[:300], flush=True)
            time.sleep(rng.uniform(0, 0.3))
