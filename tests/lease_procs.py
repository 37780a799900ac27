"""Jobs for the lease and concurrent-GC tests, run as real processes (forkserver children).

Each job writes what happened to a JSON file: ``{"ok": ...}`` or ``{"error": type, "message":
...}``. :class:`Pause` stops a job at a chosen persist point until the test lets it go on (or
kills it there), so the tests can force the interleavings they check.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from typing import Any

from deltackpt import Checkpointer, StepExistsError
from deltackpt.ops import lease
from deltackpt.ops.gc import Retention
from deltackpt.storage import FaultInjection, open_storage
from faults import state_at

SMALL = {"chunk_bytes": 1024, "memory_budget": 4096}


def context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numba", "deltackpt", "faults", "lease_procs"])
    return ctx


class Pause:
    """At the ``nth`` persist point of ``phase`` whose key contains ``key``: creates
    ``ctl/<name>.paused`` and waits for ``ctl/<name>.go`` (``kill``: dies there, as kill -9)."""

    def __init__(self, ctl: str, name: str, phase: str, key: str = "", nth: int = 1,
                 kill: bool = False):
        self.ctl, self.name, self.phase, self.key, self.nth, self.kill = ctl, name, phase, key, nth, kill
        self.count = 0

    def __call__(self, phase: str, key: str) -> None:
        if phase != self.phase or self.key not in key:
            return
        self.count += 1
        if self.count != self.nth:
            return
        Path(self.ctl, f"{self.name}.paused").touch()
        if self.kill:
            os.kill(os.getpid(), signal.SIGKILL)
        while not Path(self.ctl, f"{self.name}.go").exists():
            time.sleep(0.01)


def wait_paused(ctl: str, name: str, proc: Any, timeout: float = 120.0) -> None:
    """Waits until job ``name`` (process ``proc``) reached its pause point."""
    deadline = time.monotonic() + timeout
    while not Path(ctl, f"{name}.paused").exists():
        assert proc.exitcode is None, f"{name} ended (exit code {proc.exitcode}) before its pause"
        assert time.monotonic() < deadline, f"{name} did not reach its pause point"
        time.sleep(0.01)


def go(ctl: str, name: str) -> None:
    Path(ctl, f"{name}.go").touch()


def result(out: str) -> dict:
    return json.loads(Path(out).read_text())


def _report(out: str, job) -> None:
    try:
        doc = {"ok": job()}
    except Exception as e:
        doc = {"error": type(e).__name__, "message": str(e)}
    Path(out).write_text(json.dumps(doc))


def _open(path: str, pause: Pause | list[Pause] | None, storage_options: dict | None = None,
          **kwargs: Any) -> Checkpointer:
    """The store at ``path`` (a folder or an ``s3://`` URL reached with ``storage_options``),
    stopping at ``pause``."""
    pauses = [] if pause is None else pause if isinstance(pause, list) else [pause]

    def at_point(phase: str, key: str) -> None:
        for p in pauses:
            p(phase, key)

    storage = FaultInjection(open_storage(path, storage_options), at_point)
    return Checkpointer(storage, **SMALL, **kwargs)


def race_save(path: str, barrier: Any, step: int, out: str,
              storage_options: dict | None = None) -> None:
    """Opens the store with ``take_over=True``, restores the latest step, waits for every racer,
    then saves ``step``."""

    def job() -> str:
        ckpt = _open(path, None, storage_options, take_over=True)
        latest = ckpt.latest_step()
        ckpt.restore(state_at(latest), latest)
        barrier.wait()
        ckpt.save(step, state_at(step))
        holder = lease.read(ckpt.store.storage)[1].holder
        ckpt.close()
        return holder

    _report(out, job)


def take_over_race(path: str, racers: int, folder: Path, step: int,
                   storage_options: dict | None = None) -> None:
    """Runs ``racers`` processes of :func:`race_save` at once against the store at ``path`` and
    checks that exactly one commits ``step`` and every other gets a ``WriterConflictError``."""
    ctx = context()
    barrier = ctx.Barrier(racers)
    outs = [str(folder / f"race.{i}.json") for i in range(racers)]
    procs = [ctx.Process(target=race_save, args=(path, barrier, step, out, storage_options))
             for out in outs]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    results = [result(out) for out in outs]
    winners = [r["ok"] for r in results if "ok" in r]
    assert len(winners) == 1, results
    for r in results:
        if "ok" not in r:
            assert r["error"] == "WriterConflictError", r
            assert winners[0] in r["message"] or "unknown" in r["message"], r


def save_steps(path: str, steps: list[int], out: str, pause: Pause | list[Pause] | None = None,
               restore: int | None = None, take_over: bool = False, ttl: float = lease.DEFAULT_TTL,
               host: str | None = None, then_sleep: float = 0.0,
               storage_options: dict | None = None, committed: int | None = None) -> None:
    """Restores ``restore`` (default: the latest step, if any) and saves ``steps``; then holds
    the lease ``then_sleep`` seconds (renewing it) and closes. ``host`` pretends to run there.
    ``committed``: a step committed already, saved first: its ``StepExistsError`` is expected
    (the save takes the lease, naming no head, before it reports the step)."""
    if host is not None:
        lease._HOST = host

    def job() -> dict:
        ckpt = _open(path, pause, storage_options, take_over=take_over, lease_ttl=ttl)
        at = ckpt.latest_step() if restore is None else restore
        if at is not None:
            ckpt.restore(state_at(at), at)
        kinds = {}
        if committed is not None:
            try:
                ckpt.save(committed, state_at(committed))
            except StepExistsError as e:
                kinds[committed] = ["exists", str(e)]
        for step in steps:
            info = ckpt.save(step, state_at(step))
            kinds[step] = [info.kind, info.reason]
        Path(out + ".saved").touch()
        time.sleep(then_sleep)
        ckpt.close()
        return kinds

    _report(out, job)


def gc_job(path: str, keep_last: int, out: str, pause: Pause | None = None,
           storage_options: dict | None = None) -> None:
    """Runs GC keeping the newest ``keep_last`` steps, with no grace period."""

    def job() -> dict:
        with _open(path, pause, storage_options) as ckpt:
            report = ckpt.gc(Retention(keep_last=keep_last), grace_seconds=0)
        return {"dropped_steps": report.dropped_steps, "deleted": report.deleted}

    _report(out, job)


def hook_job_killed(path: str, until: int, every: int, data: Any, shapes: dict) -> None:
    """A plain training loop with a CheckpointHook (a DLRM from :func:`dlrm_run`) that trains to
    ``until`` saving every ``every`` steps, then dies by SIGKILL without closing anything."""
    from deltackpt.examples import deterministic, dlrm_run, train
    from deltackpt.hooks import CheckpointHook

    with deterministic(0):
        state, loss = dlrm_run(data, seed=0, **shapes)
        hook = CheckpointHook(path, state, every=every)
        train(state, loss, until, hook=hook)
        hook.checkpointer.wait()  # its last save commits (saves run in the background)
    os.kill(os.getpid(), signal.SIGKILL)
