"""A marked delta's rows are gathered and hashed in pieces by the I/O threads and the saving
thread together: the pieces never wait on a busy executor, errors reach the saver, and a delta of
half a table's rows writes them bit-exact with the hashes of their values."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deltackpt import Checkpointer, EveryK, MemoryStorage, kernels
from deltackpt.io.threads import run_shared


def test_jobs_run_on_this_thread_when_every_io_thread_is_busy():
    release = threading.Event()
    ran: list[int] = []
    with ThreadPoolExecutor(1) as ex:
        blocked = ex.submit(release.wait)  # the one I/O thread waits for this thread, as a pack writer does
        run_shared(ex, [lambda i=i: ran.append(i) for i in range(5)])
        assert sorted(ran) == [0, 1, 2, 3, 4]
        release.set()
        blocked.result()


def test_jobs_run_on_this_thread_when_the_executor_takes_no_more():
    # At the interpreter's exit, executors refuse new jobs while a save in flight still ends.
    ex = ThreadPoolExecutor(2)
    ex.shutdown()
    ran: list[int] = []
    run_shared(ex, [lambda i=i: ran.append(i) for i in range(3)])
    assert ran == [0, 1, 2]


def test_a_failing_piece_raises_after_every_piece_ended():
    ended = []

    def ok(i: int) -> None:
        ended.append(i)

    def bad() -> None:
        raise OSError("disk gone")

    with ThreadPoolExecutor(2) as ex, pytest.raises(OSError, match="disk gone"):
        run_shared(ex, [lambda: ok(0), bad, lambda: ok(2), lambda: ok(3)])
    assert sorted(ended) == [0, 2, 3]


@pytest.mark.parametrize("threads", [1, 3])
def test_a_marked_delta_of_half_the_rows(threads):
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(120_000, 32, generator=gen)  # 15 MiB: its gather splits into pieces
    policy = EveryK(100, max_delta_fraction=1.0)
    with Checkpointer(MemoryStorage(), threads=threads, policy=policy) as ckpt:
        ckpt.mark("t", torch.arange(0))  # tracked by marks from the base on
        ckpt.save(0, {"t": t})
        ids = torch.randperm(t.shape[0], generator=gen)[: t.shape[0] // 2]
        t[ids] += 1
        ckpt.mark("t", ids)
        scans = []
        scan = ckpt._tracker.scan
        ckpt._tracker.scan = lambda ts, held=None: scans.append(ch := scan(ts, held)) or ch
        info = ckpt.save(1, {"t": t})
        assert (info.kind, info.rows_changed) == ("delta", len(ids))
        assert scans[0]["t"].partial  # found from the marks; the writer hashed the rows
        assert torch.equal(ckpt._tracker._refs["t"].hashes, kernels.hash_rows(t))
        got = torch.empty_like(t)
        ckpt.restore({"t": got}, 1)
    assert torch.equal(got.view(torch.int32), t.view(torch.int32))


def test_a_marked_delta_adds_no_ids_in_torch(monkeypatch):
    """torch's elementwise ops over 32,768 elements or more (its grain size) wake its thread pool:
    1-8 ms each when another process holds the cores. A delta of 50,000 marked rows adds its ids'
    offsets in numpy."""
    gen = torch.Generator().manual_seed(1)
    t = torch.randn(100_000, 8, generator=gen)
    with Checkpointer(MemoryStorage(), policy=EveryK(100, max_delta_fraction=1.0)) as ckpt:
        ckpt.mark("t", torch.arange(0))
        ckpt.save(0, {"t": t})
        ids = torch.randperm(t.shape[0], generator=gen)[:50_000]
        t[ids] += 1
        ckpt.mark("t", ids)
        add = torch.Tensor.__add__

        def small_adds_only(a: torch.Tensor, b: object) -> torch.Tensor:
            assert a.numel() < 32_768, f"a torch add of {a.numel()} elements"
            return add(a, b)

        monkeypatch.setattr(torch.Tensor, "__add__", small_adds_only)
        assert ckpt.save(1, {"t": t}).rows_changed == len(ids)
        monkeypatch.undo()
        got = torch.empty_like(t)
        ckpt.restore({"t": got}, 1)
    assert torch.equal(got.view(torch.int32), t.view(torch.int32))
