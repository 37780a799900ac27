"""A save works on no more threads than it is given: ``threads``, by default
``torch.get_num_threads()``; its I/O and its hashing share them."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deltackpt import Checkpointer, SettingError, kernels
from deltackpt.io import threads as io_threads
from deltackpt.io.threads import cores_beside_training, idle_cores, run_shared
from deltackpt.tracking import hashing
from deltackpt.tracking.hashing import Hasher

MiB = 1 << 20

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc/self/task")


def cpu_ticks() -> dict[int, int]:
    """CPU time (user + system clock ticks) of every thread of this process, by thread id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue  # ended meanwhile
        out[int(tid)] = int(fields[11]) + int(fields[12])
    return out


def helpers_used(save) -> int:
    """Threads other than the calling one that ran during ``save()``, but for the process's one
    kernel warm-up thread (with an empty kernel cache it compiles while the first save runs) and
    a background save's thread, which finishes the save as the calling thread does a blocking
    one (the calling thread waits meanwhile)."""
    before = cpu_ticks()
    save()
    after = cpu_ticks()
    others = {threading.get_native_id()} | {
        t.native_id for t in threading.enumerate() if t.name.startswith(("deltackpt-warm", "deltackpt-save"))}
    return sum(1 for tid, t in after.items() if tid not in others and t > before.get(tid, 0))


@pytest.fixture
def one_torch_thread():
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(was)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
@pytest.mark.parametrize("threads", [None, 1, 2, 3])
def test_a_save_uses_at_most_its_threads(tmp_path, threads, blocking, one_torch_thread):
    limit = torch.get_num_threads() if threads is None else threads
    # 128 MiB: a base of 128 files and a delta found by hashing every row, enough work for every
    # thread taking part to show in its CPU time.
    table = torch.randn(1 << 21, 16)
    dense = torch.randn(8 * MiB)
    state = {"table": table, "dense": dense, "small": [torch.randn(50, 4) for _ in range(30)]}
    with Checkpointer(tmp_path, chunk_bytes=MiB, memory_budget=16 * MiB, threads=threads) as ckpt:
        def save(step: int) -> None:
            out = ckpt.save(step, state, blocking=blocking)
            assert (out if blocking else out.result()).step == step

        assert helpers_used(lambda: save(1)) <= limit
        table[::1000] += 1
        dense[::1000] += 1
        assert helpers_used(lambda: save(2)) <= limit
        # Half the rows: chunks of rows large enough to go to the pack on a thread of their own
        # where the limit leaves room for one.
        table[::2] += 1
        assert helpers_used(lambda: save(3)) <= limit
        assert ckpt.steps() == [1, 2, 3]
        assert ckpt.load(3)["table"].equal(table)


def test_threads_must_be_positive(tmp_path):
    with pytest.raises(SettingError, match="threads must be a positive int, got 0"):
        Checkpointer(tmp_path, threads=0)


@pytest.fixture
def idle(monkeypatch):
    """Sets how many cores the hasher finds idle."""
    def set_idle(n: int | None) -> None:
        monkeypatch.setattr(hashing, "idle_cores", lambda: n)
    return set_idle


class CountingPool(ThreadPoolExecutor):
    """A pool that counts the jobs submitted to it."""

    def __init__(self, workers: int):
        super().__init__(workers)
        self.submitted = 0

    def submit(self, *args, **kwargs):
        self.submitted += 1
        return super().submit(*args, **kwargs)


@pytest.mark.parametrize("cpus, training, workers, want", [(8, 1, 4, 4), (8, 6, 4, 2), (8, 8, 4, 1), (2, 1, 2, 1)])
def test_a_background_save_writes_on_the_cores_training_leaves(monkeypatch, cpus, training, workers, want):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: training)
    assert cores_beside_training(workers) == want


def test_idle_cores_counts_this_thread_as_running():
    idle = idle_cores()
    assert idle is not None and idle <= len(os.sched_getaffinity(0)) - 1


def test_a_busy_thread_of_this_process_leaves_its_core_idle(monkeypatch, tmp_path):
    """Right after a training step torch's OpenMP workers spin before they sleep: this process's
    own runnable threads are no other process's load, so a save still finds the core idle."""
    import hashlib

    stop = threading.Event()
    data = os.urandom(1 << 22)

    def spin() -> None:
        while not stop.is_set():
            hashlib.sha256(data).digest()  # runs without the GIL: the thread stays runnable

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:  # the spinner and this thread, runnable whatever else the machine runs
        here = max(io_threads._running_here() for _ in range(20))
    finally:
        stop.set()
        spinner.join()
    assert here >= 2
    # Four runnable tasks on the machine, three of them this process's: one other process's.
    loadavg = tmp_path / "loadavg"
    loadavg.write_bytes(b"0.50 0.40 0.30 4/321 12345\n")
    fd = os.open(loadavg, os.O_RDONLY)
    try:
        monkeypatch.setattr(io_threads, "_loadavg", [fd])
        monkeypatch.setattr(io_threads, "_running_here", lambda: 3)
        assert idle_cores() == len(os.sched_getaffinity(0)) - 1 - 1
    finally:
        os.close(fd)


@pytest.mark.parametrize("found", [1, 2, None])
def test_a_table_of_a_few_mib_is_split_while_a_core_is_idle(idle, found):
    """A 6.4 MB table is hashed by the calling thread and the I/O threads as long as a core is
    idle (or where the system cannot tell), by at most one thread per idle core."""
    idle(found)
    table = torch.randn(50_000, 32)
    with CountingPool(3) as ex:
        got = Hasher(ex, 3).rows(table)
    assert ex.submitted == (2 if found is None else min(2, found))
    assert got.equal(kernels.hash_rows(table, threads=1))


def test_tables_hashed_together_wake_the_threads_once(idle):
    """A scan of several tables of a few MiB hands all their pieces to the I/O threads at once:
    one wake-up a helper, not one a table."""
    idle(1)
    tables = [torch.randn(50_000 + i, 32) for i in range(4)]
    flat = torch.randn(3 * MiB)
    with CountingPool(3) as ex:
        got = Hasher(ex, 3).many([*((t, None) for t in tables), (flat, MiB)])
    assert ex.submitted == 1
    for t, h in zip(tables, got):
        assert h.equal(kernels.hash_rows(t, threads=1))
    assert got[-1].equal(kernels.hash_chunks(flat, MiB, threads=1))


@pytest.mark.parametrize("found, helped", [(2, 2), (1, 1), (0, 0)])
def test_rows_drawn_from_several_tables_are_gathered_and_hashed_together(idle, found, helped):
    """A canary's samples: rows from all over each table (and a row-wise sum, a view of one
    column), gathered and hashed a table a job, the jobs shared with one thread per idle core,
    for the bits of hashing each gathered copy; a non-contiguous table and no rows hash too."""
    idle(found)
    gen = torch.Generator().manual_seed(0)
    tables = [torch.randn(20_000 + i, 32, generator=gen) for i in range(3)]
    sums = torch.rand(20_000, generator=gen).view(-1, 1)
    strided = torch.randn(32, 20_000, generator=gen).t()
    ids = [torch.randperm(t.shape[0], generator=gen)[:1024].sort().values for t in (*tables, sums, strided)]
    inputs = [*zip((*tables, sums, strided), ids), (tables[0], torch.empty(0, dtype=torch.int64))]
    with CountingPool(3) as ex:
        got = Hasher(ex, 3).rows_at(inputs)
    assert ex.submitted == helped
    for (t, i), h in zip(inputs, got):
        assert h.equal(kernels.hash_rows(t[i], threads=1))


@pytest.mark.parametrize("found", [0, -2])
def test_no_thread_is_woken_while_every_core_is_busy(idle, found):
    """Under BUSY_SPLIT_BYTES a thread (13 MB and 10 MiB on two threads: 16 MiB each is the
    least), each hash runs on the calling thread."""
    idle(found)
    table, flat = torch.randn(100_001, 33), torch.randn(10 * MiB // 4)
    with CountingPool(2) as ex:
        hasher = Hasher(ex, 2)
        assert hasher.rows(table).equal(kernels.hash_rows(table, threads=1))
        assert hasher.chunks(flat, MiB).equal(kernels.hash_chunks(flat, MiB, threads=1))
    assert ex.submitted == 0


@pytest.mark.parametrize("found", [0, -2])
def test_large_work_is_split_even_while_every_core_is_busy(idle, found):
    """BUSY_SPLIT_BYTES a thread or more pays for a thread that waits for a core: all the
    threads allowed take part, for the same bits."""
    idle(found)
    flat = torch.randn(3 * hashing.BUSY_SPLIT_BYTES // 4)
    with CountingPool(3) as ex:
        got = Hasher(ex, 3).chunks(flat, MiB)
    assert ex.submitted == 2
    assert got.equal(kernels.hash_chunks(flat, MiB, threads=1))


@pytest.mark.parametrize("found, helped", [(1, 1), (0, 0)])
def test_the_small_tensors_of_a_state_are_hashed_together_by_the_idle_cores(idle, found, helped):
    """The one call that hashes a state's small tensors (7.2 MB of 4,000 of them) is shared, in
    runs of whole tensors, with an I/O thread while a core is idle, for the bits of one call;
    on one thread while none is."""
    idle(found)
    tensors = [torch.randn(16, 25 + i % 7) for i in range(4_000)]
    segments = kernels.Segments(tensors, [t.nbytes // 16 for t in tensors])
    with CountingPool(3) as ex:
        got = Hasher(ex, 2).segments(segments)
    assert ex.submitted == helped
    assert got.equal(segments.hash())


@pytest.mark.parametrize("threads", [2, 3])
def test_a_hash_split_across_threads_matches_one_thread(threads, idle):
    idle(threads)
    rows = torch.randn(300_001, 33)  # 39.6 MB: split in pieces that do not divide it evenly
    flat = torch.randn(10 * MiB + 7)
    with ThreadPoolExecutor(threads) as ex:
        hasher = Hasher(ex, threads)
        assert hasher.rows(rows).equal(kernels.hash_rows(rows, threads=1))
        for chunk in (MiB, 3 * MiB + 4, 12):
            assert hasher.chunks(flat, chunk).equal(kernels.hash_chunks(flat, chunk, threads=1))


def test_a_split_hash_goes_on_while_every_io_thread_waits_for_a_core(idle):
    """On a node whose cores are busy elsewhere, the I/O threads a hash wakes may wait long for a
    core: the calling thread hashes every piece none of them has started."""
    idle(1)
    rows = torch.randn(300_001, 33)
    release = threading.Event()
    with ThreadPoolExecutor(2) as ex:
        stuck = [ex.submit(release.wait) for _ in range(2)]  # both I/O threads held elsewhere
        hasher = Hasher(ex, 2)
        done: list[torch.Tensor] = []
        worker = threading.Thread(target=lambda: done.append(hasher.rows(rows)), daemon=True)
        worker.start()
        worker.join(timeout=30)
        finished_meanwhile = bool(done)
        release.set()
        for f in stuck:
            f.result()
        worker.join()
    assert finished_meanwhile
    assert done[0].equal(kernels.hash_rows(rows, threads=1))


def test_shared_jobs_run_once_each_on_the_helpers_asked_for():
    ran: list[int] = []
    with CountingPool(3) as ex:
        run_shared(ex, [lambda i=i: ran.append(i) for i in range(40)], helpers=1)
    assert ex.submitted == 1
    assert sorted(ran) == list(range(40))
