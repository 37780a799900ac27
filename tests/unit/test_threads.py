"""A save works on no more threads than it is given: ``threads``, by default
``torch.get_num_threads()``; its I/O and its hashing share them."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deltackpt import Checkpointer, kernels
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
    kernel warm-up thread (with an empty kernel cache it compiles while the first save runs)."""
    before = cpu_ticks()
    save()
    after = cpu_ticks()
    others = {threading.get_native_id()} | {
        t.native_id for t in threading.enumerate() if t.name == "deltackpt-warm"}
    return sum(1 for tid, t in after.items() if tid not in others and t > before.get(tid, 0))


@pytest.fixture
def one_torch_thread():
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(was)


@pytest.mark.parametrize("threads", [None, 1, 2])
def test_a_save_uses_at_most_its_threads(tmp_path, threads, one_torch_thread):
    limit = torch.get_num_threads() if threads is None else threads
    # 128 MiB: a base of 128 files and a delta found by hashing every row, enough work for every
    # thread taking part to show in its CPU time.
    table = torch.randn(1 << 21, 16)
    dense = torch.randn(8 * MiB)
    state = {"table": table, "dense": dense, "small": [torch.randn(50, 4) for _ in range(30)]}
    with Checkpointer(tmp_path, chunk_bytes=MiB, memory_budget=16 * MiB, threads=threads) as ckpt:
        assert helpers_used(lambda: ckpt.save(1, state)) <= limit
        table[::1000] += 1
        dense[::1000] += 1
        assert helpers_used(lambda: ckpt.save(2, state)) <= limit
        assert ckpt.steps() == [1, 2]
        assert ckpt.load(2)["table"].equal(table)


def test_threads_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="threads must be a positive int, got 0"):
        Checkpointer(tmp_path, threads=0)


@pytest.mark.parametrize("threads", [2, 3])
def test_a_hash_split_across_threads_matches_one_thread(threads):
    rows = torch.randn(300_001, 33)  # 39.6 MB: split in pieces that do not divide it evenly
    flat = torch.randn(10 * MiB + 7)
    with ThreadPoolExecutor(threads) as ex:
        hasher = Hasher(ex, threads)
        assert hasher.rows(rows).equal(kernels.hash_rows(rows, threads=1))
        for chunk in (MiB, 3 * MiB + 4, 12):
            assert hasher.chunks(flat, chunk).equal(kernels.hash_chunks(flat, chunk, threads=1))


def test_a_split_hash_goes_on_while_every_io_thread_waits_for_a_core():
    """On a node whose cores are busy elsewhere, the I/O threads a hash wakes may wait long for a
    core: the calling thread hashes every piece none of them has started."""
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
