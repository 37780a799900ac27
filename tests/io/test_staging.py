"""StagingPool: a bounded set of buffers, touched ahead of the first copy, left by a closed pool to
the next one of the process until released."""

from __future__ import annotations

import resource
import threading

import pytest
import torch

import deltackpt
from deltackpt import Checkpointer
from deltackpt.io import staging
from deltackpt.io.staging import StagingPool

MiB = 1 << 20


@pytest.fixture(autouse=True)
def empty_reserve():
    deltackpt.release_staging_memory()
    yield
    deltackpt.release_staging_memory()


def faults_of(work) -> int:
    """Page faults the calling thread took in ``work()``."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    work()
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def test_a_warmed_buffer_takes_no_page_fault_at_its_first_copy():
    n = 40 * MiB  # above malloc's largest mmap threshold: fresh pages, never a freed block's
    src = torch.ones(n, dtype=torch.uint8)
    cold, warm = StagingPool(2, n), StagingPool(2, n)
    warm.warm(2)
    cold_faults = faults_of(lambda: cold.acquire(n).copy_(src))
    warm_faults = faults_of(lambda: warm.acquire(n).copy_(src))
    assert cold_faults >= n // 4096 // 2  # at least half its pages (huge pages aside)
    assert warm_faults < 64


def test_a_pool_closed_while_warming_leaves_the_buffer_being_made_and_makes_no_more(monkeypatch):
    making, go = threading.Event(), threading.Event()
    touch = staging._touch

    def slow_touch(buf):
        making.set()
        go.wait(10)
        return touch(buf)

    monkeypatch.setattr(staging, "_touch", slow_touch)
    pool = StagingPool(4, 1 << 16)
    warming = threading.Thread(target=pool.warm, args=(4,))
    warming.start()
    assert making.wait(10)
    pool.close()
    go.set()
    warming.join(10)
    assert not warming.is_alive()
    assert deltackpt.release_staging_memory() == 1 << 16  # the one being made, and no more


def test_a_closed_pool_leaves_its_buffers_to_the_next_until_released():
    first = StagingPool(3, 1 << 16)
    held = [first.acquire(1 << 16) for _ in range(3)]
    addresses = {b.data_ptr() for b in held}
    for b in held[:2]:
        first.release(b)
    first.close()  # the third is still in use: not left to another pool
    second = StagingPool(4, 1 << 16)
    taken = [second.acquire(100) for _ in range(3)]
    assert {b.data_ptr() for b in taken[:2]} == {held[0].data_ptr(), held[1].data_ptr()}
    assert taken[2].data_ptr() not in addresses
    first.release(held[2])  # given back to its own pool, which still works
    assert first.acquire(10).data_ptr() == held[2].data_ptr()
    for b in taken:
        second.release(b)
    second.close()
    assert deltackpt.release_staging_memory() == 3 * (1 << 16)
    assert deltackpt.release_staging_memory() == 0


def test_the_reserve_keeps_no_more_buffers_than_the_largest_pool_closed():
    pools = [StagingPool(2, 1 << 16) for _ in range(3)]
    for p in pools:
        for b in [p.acquire(1) for _ in range(2)]:
            p.release(b)
        p.close()
    assert deltackpt.release_staging_memory() == 2 * (1 << 16)


def test_warming_never_makes_a_pool_exceed_its_buffers():
    pool = StagingPool(3, 1 << 16)
    warmers = [threading.Thread(target=pool.warm, args=(10,)) for _ in range(4)]
    for t in warmers:
        t.start()
    held = [pool.acquire(1 << 16) for _ in range(3)]
    for t in warmers:
        t.join()
    assert len({b.data_ptr() for b in held}) == 3
    assert len(pool._buffers) == 3


def test_a_later_checkpointer_stages_into_the_buffers_an_earlier_one_touched(tmp_path):
    state = {"t": torch.randn(16 * MiB // 4)}  # 16 MiB, staged by a background base

    def first_base(path) -> set[int]:
        with Checkpointer(path, chunk_bytes=4 * MiB, memory_budget=24 * MiB, threads=1) as ckpt:
            ckpt.save(1, state, blocking=False).result()
            assert ckpt.load(1)["t"].equal(state["t"])
            ckpt._pool.warm(6)  # every buffer its budget allows, whatever the save took
            return set(ckpt._pool._buffers)

    first = first_base(tmp_path / "a")
    assert len(first) == 6
    assert first_base(tmp_path / "b") == first
