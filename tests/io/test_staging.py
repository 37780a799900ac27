"""StagingPool: a bounded set of buffers, touched ahead of the first copy, left by a closed pool to
the next one of the process until released."""

from __future__ import annotations

import re
import resource
import subprocess
import sys
import threading
import time

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


def huge_bytes(address: int) -> int:
    """The bytes of this process's memory mapping that holds ``address`` in huge pages."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            if m := re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line):
                inside = int(m[1], 16) <= address < int(m[2], 16)
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_warmed_buffer_takes_no_page_fault_at_its_first_copy():
    n = 40 * MiB  # above malloc's largest mmap threshold: fresh pages, never a freed block's
    src = torch.ones(n, dtype=torch.uint8)
    cold, warm = StagingPool(2, n), StagingPool(2, n)
    warm.warm(2)
    buf = cold.acquire(n)
    cold_faults = faults_of(lambda: buf.copy_(src))
    warm_faults = faults_of(lambda: warm.acquire(n).copy_(src))
    pages = n // (staging.HUGE_PAGE if huge_bytes(buf.data_ptr()) else 4096)
    assert cold_faults >= pages // 4  # a quarter of its pages at least: torch's threads take the others
    assert warm_faults < min(64, pages // 4)


def test_a_large_buffer_is_in_huge_pages_where_the_kernel_has_them():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            modes = f.read()
    except OSError:
        pytest.skip("no transparent huge pages on this kernel")
    if "[never]" in modes:
        pytest.skip("transparent huge pages are off on this machine")
    pool = StagingPool(1, 8 * MiB + 4096)
    buf = pool.acquire(8 * MiB + 4096)
    buf.fill_(1)
    assert buf.data_ptr() % staging.HUGE_PAGE == 0
    assert huge_bytes(buf.data_ptr()) >= 4 * MiB  # half of its whole huge pages at least
    small = StagingPool(1, 1 * MiB).acquire(1 * MiB)
    assert small.data_ptr() % 4096 == 0


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


def test_warming_waits_while_a_save_copies_into_the_pool_and_goes_on_after():
    pool = StagingPool(4, 1 << 16)
    with pool.staging():
        warming = threading.Thread(target=pool.warm, args=(3,))
        warming.start()
        warming.join(0.3)
        assert warming.is_alive() and not pool._buffers  # made none beside the copies
        taken = pool.acquire(10)  # the save makes what it needs meanwhile, without waiting
    warming.join(10)
    assert not warming.is_alive()
    assert len(pool._buffers) == 3
    pool.release(taken)
    with pool.staging():  # a pool closed while its warm waits: the warm ends, making none
        waiting = threading.Thread(target=pool.warm, args=(4,))
        waiting.start()
        pool.close()
        waiting.join(10)
    assert not waiting.is_alive() and len(pool._buffers) == 0  # the free ones went to the reserve
    assert deltackpt.release_staging_memory() == 3 * (1 << 16)


def test_a_closed_pool_leaves_its_buffers_to_the_next_until_released():
    first = StagingPool(3, 1 << 16)
    held = [first.acquire(1 << 16) for _ in range(3)]
    addresses = {b.data_ptr() for b in held}
    for b in held[:2]:
        first.release(b)
    first.close()  # the third is still in use: not left to another pool
    second = StagingPool(4, 1 << 16)
    taken = [second.acquire(1 << 15) for _ in range(3)]  # each more than a quarter: a whole buffer
    assert {b.data_ptr() for b in taken[:2]} == {held[0].data_ptr(), held[1].data_ptr()}
    assert taken[2].data_ptr() not in addresses
    first.release(held[2])  # given back to its own pool, which still works
    assert first.acquire(1 << 15).data_ptr() == held[2].data_ptr()
    for b in taken:
        second.release(b)
    second.close()
    assert deltackpt.release_staging_memory() == 3 * (1 << 16)
    assert deltackpt.release_staging_memory() == 0


def test_the_reserve_keeps_no_more_buffers_than_the_largest_pool_closed():
    pools = [StagingPool(2, 1 << 16) for _ in range(3)]
    for p in pools:
        for b in [p.acquire(1 << 16) for _ in range(2)]:
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
            deadline = time.monotonic() + 10
            while len(ckpt._pool._buffers) < 6 and time.monotonic() < deadline:
                time.sleep(0.01)  # the one the save's own warm in the background is making
            return set(ckpt._pool._buffers)

    first = first_base(tmp_path / "a")
    assert len(first) == 6
    assert first_base(tmp_path / "b") == first


def buffers_once_settled(pool: StagingPool, want: int) -> int:
    """How many buffers ``pool`` holds once it holds ``want`` (or 10 s passed), and 0.2 s more."""
    deadline = time.monotonic() + 10
    while len(pool._buffers) < want and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # a warm that would make more has had time to
    return len(pool._buffers)


def test_track_warms_the_buffers_a_base_of_the_model_and_its_optimizer_takes(tmp_path):
    model = torch.nn.Sequential(torch.nn.Embedding(MiB // 8 - 1, 8))  # 4 MiB less a row
    opt = torch.optim.Adagrad(model.parameters())  # as many bytes of sums, and a step, made now
    with Checkpointer(tmp_path / "a", chunk_bytes=MiB, memory_budget=32 * MiB, threads=1) as ckpt:
        assert buffers_once_settled(ckpt._pool, 2) == 2  # the two any save may take
        ckpt.track(model, optimizer=opt)
        assert buffers_once_settled(ckpt._pool, 10) == 10  # 8 MiB in 1 MiB buffers, and those two
    deltackpt.release_staging_memory()
    with Checkpointer(tmp_path / "b", chunk_bytes=MiB, memory_budget=6 * MiB, threads=1) as ckpt:
        ckpt.track(model, optimizer=opt)
        assert buffers_once_settled(ckpt._pool, 6) == 6  # never past the budget


EXIT_DURING_WARM = """
import atexit, sys, time, torch
from deltackpt import Checkpointer
from deltackpt.io import staging
touch = staging._touch
staging._touch = lambda buf: (time.sleep(0.2), touch(buf))[1]  # a slow warm: 4 s for 20 buffers
made = []
atexit.register(lambda: print(len(made[0]._buffers)))  # runs after the warm's thread has stopped
ckpt = Checkpointer(sys.argv[1], chunk_bytes=1 << 20, memory_budget=64 << 20, threads=1)
made.append(ckpt._pool)
ckpt.track(torch.nn.Embedding(18 << 16, 4))  # 18 MiB: 20 buffers with the two any save takes
while len(ckpt._pool._buffers) < 3:  # the warm of track() has begun (jobs not begun are dropped)
    time.sleep(0.01)
"""


def test_the_interpreter_exit_stops_a_warm_rather_than_wait_for_it(tmp_path):
    out = subprocess.run([sys.executable, "-c", EXIT_DURING_WARM, str(tmp_path / "s")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) < 10  # the exit came at once: the warm made a few of its 20


def test_small_requests_are_cut_from_one_shared_buffer_that_goes_back_with_the_last():
    pool = StagingPool(6, 64 << 10)  # places for every request: a regression fails, never waits
    cuts = [pool.acquire(n) for n in (5000, 0, 8192, 16 << 10)]  # 8 + 4 + 8 + 16 KiB of it
    starts = [staging._address(c) for c in cuts]
    assert pool.taken() == 1 and len(pool._buffers) == 1
    assert all(s % 4096 == 0 for s in starts) and len(set(starts)) == 4
    assert [c.numel() for c in cuts] == [5000, 0, 8192, 16 << 10]
    for c in cuts:
        c.fill_(7)
    assert all(int(c.sum()) == 7 * c.numel() for c in cuts)  # no cut overlaps another
    whole = pool.acquire(40 << 10)  # more than a quarter: a buffer of its own
    assert pool.taken() == 2
    for c in cuts[:3]:
        pool.release(c)
    assert pool.taken() == 2  # one cut still held keeps its buffer
    pool.release(cuts[3])
    pool.release(whole)
    assert pool.taken() == 0 and pool._free.qsize() == 2
    again = [pool.acquire(16 << 10) for _ in range(5)]  # the fifth is too many for one: another
    assert pool.taken() == 2
    for c in again:
        pool.release(c)
    assert pool.taken() == 0 and pool._free.qsize() == 2


@pytest.mark.parametrize("shared", [True, False])
def test_a_base_of_tables_and_their_small_sums_stages_whole_in_a_budget_of_its_size(tmp_path, monkeypatch, shared):
    # 4 tables of 8 MiB (a chunk each), their row-wise sums of 1.5 MiB and a small dense layer (in
    # the pack): within 5 buffers of 8 MiB when the sums' chunks and the pack's share one; a buffer
    # each (shared=False, as before they were shared) takes more places than the budget's.
    if not shared:
        monkeypatch.setattr(staging, "SHARED_PART", 1 << 40)  # every request a buffer of its own
    state = {f"t{i}": torch.randn(2048, 1024) for i in range(4)}
    state.update({f"sum{i}": torch.rand(3 << 17) for i in range(4)})
    state["dense"] = torch.randn(64, 64)
    full = []
    real = StagingPool._take_place

    def take_place(self):
        full.append(self.taken() == self.buffers)  # every place taken: this one waits
        real(self)

    monkeypatch.setattr(StagingPool, "_take_place", take_place)
    with Checkpointer(tmp_path, chunk_bytes=8 * MiB, memory_budget=40 * MiB, threads=1) as ckpt:
        ckpt.save(1, state, blocking=False).result()
        loaded = ckpt.load(1)
    assert loaded.keys() == state.keys() and all(loaded[k].equal(v) for k, v in state.items())
    if shared:  # a place a table, one the sums' chunks and the pack's share (again, if all were given
        assert 5 <= len(full) < 9 and not any(full)  # back before the next): none waited for a write
    else:  # a place each, 9 of the budget's 5, taken as writes give them back (a take may wait: a race)
        assert len(full) == 9
