"""16 writers commit the same step to one bucket at once, as threads and as processes: exactly one
commits, every other gets a typed error, and the committed step is the winner's, bit for bit."""

from __future__ import annotations

import multiprocessing as mp
import threading
import uuid

import pytest
import torch
from dist_harness import by_file, call
from s3_server import BUCKET

from deltackpt import Checkpointer, DeltackptError

WRITERS = 16


def state_of(writer: int) -> dict:
    gen = torch.Generator().manual_seed(writer)
    return {"emb": torch.randn(500, 8, generator=gen), "writer": writer}


def commit_once(url: str, options: dict, writer: int, start, end) -> tuple[str, str]:
    """One writer: waits for the others, saves step 1, waits for the others again (so the
    winner holds the writer lease while they try); returns ("ok", kind) or ("error", type)."""
    try:
        with Checkpointer(url, storage_options=options) as ckpt:
            start.wait(60)
            try:
                return "ok", ckpt.save(1, state_of(writer)).kind
            finally:
                end.wait(120)
    except DeltackptError as e:
        return "error", type(e).__name__
    except Exception as e:  # noqa: BLE001 - an untyped error fails the test below
        return "untyped", f"{type(e).__name__}: {e}"


def _in_process(url: str, options: dict, writer: int, start, end, results) -> None:
    results[writer] = commit_once(url, options, writer, start, end)


def check_round(url: str, options: dict, results: dict[int, tuple[str, str]]) -> None:
    assert len(results) == WRITERS, results
    winners = [w for w, (status, _) in results.items() if status == "ok"]
    assert len(winners) == 1, results
    losers = {detail for status, detail in results.values() if status != "ok"}
    untyped = [r for r in results.values() if r[0] == "untyped"]
    assert not untyped, untyped
    assert losers <= {"WriterConflictError", "StepExistsError"}, results
    with Checkpointer(url, storage_options=options, create=False) as ckpt:
        assert ckpt.steps() == [1]
        got = ckpt.load(1)
    want = state_of(winners[0])
    assert got["writer"] == winners[0] and torch.equal(got["emb"], want["emb"])


def race_threads(s3_server) -> None:
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    options = s3_server.options()
    start, end = threading.Barrier(WRITERS), threading.Barrier(WRITERS)
    results: dict[int, tuple[str, str]] = {}
    threads = [threading.Thread(target=lambda w=w: results.__setitem__(
        w, commit_once(url, options, w, start, end))) for w in range(WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    check_round(url, options, results)


def race_processes(s3_server) -> None:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "deltackpt", "dist_harness"])
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    options = s3_server.options()
    with ctx.Manager() as manager:
        results = manager.dict()
        start, end = ctx.Barrier(WRITERS), ctx.Barrier(WRITERS)
        # By file, not by module: the forkserver may have been started by another test.
        procs = [ctx.Process(target=call, args=(by_file(_in_process), url, options, w, start, end, results))
                 for w in range(WRITERS)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
        for p in procs:
            if p.is_alive():
                p.kill()
        check_round(url, options, dict(results))


def test_16_threads_commit_one_step_once(s3_server):
    for _ in range(2):
        race_threads(s3_server)


def test_16_processes_commit_one_step_once(s3_server):
    race_processes(s3_server)


@pytest.mark.slow
def test_16_threads_commit_one_step_once_20_of_20(s3_server):
    for _ in range(20):
        race_threads(s3_server)


@pytest.mark.slow
def test_16_processes_commit_one_step_once_20_of_20(s3_server):
    for _ in range(20):
        race_processes(s3_server)
