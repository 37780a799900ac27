"""A non-blocking save's writer (``defer``) leaves its small staged chunks to ``finish``, which its
background thread runs: the saving thread only gathers them, while the staging pool keeps two
places free (chunks cut from one shared buffer hold one place), at most ``MAX_DEFERRED`` of them."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deltackpt import kernels
from deltackpt.format.encodings import get
from deltackpt.io.staging import StagingPool
from deltackpt.io.writer import HAND_OFF_BYTES, MAX_DEFERRED, StepWriter
from deltackpt.storage import MemoryStorage


def put_tables(w: StepWriter, tables: list[torch.Tensor], ids: torch.Tensor) -> list[torch.Tensor]:
    hashes = [torch.zeros(ids.numel(), dtype=torch.int64) for _ in tables]
    for i, (t, h) in enumerate(zip(tables, hashes)):
        get("rows").encode(w, f"t{i}", "", t, ids, (ids.numel(), t.shape[1]), hash_into=h)
    return hashes


@pytest.mark.parametrize("buffers", [3, 4, 8])
@pytest.mark.parametrize("shared", [False, True], ids=["a-buffer-a-chunk", "one-buffer-shared"])
def test_small_chunks_are_appended_when_the_writer_finishes_while_two_places_stay_free(buffers, shared):
    # Each chunk's rows are cut from a shared buffer on a 4 KiB boundary: 4 KiB buffers take one
    # chunk each, those of 64 KiB all ten.
    storage, pool = MemoryStorage(), StagingPool(buffers, 65536 if shared else 4096)
    tables = [torch.randn(50, 8) + i for i in range(10)]  # more chunks than buffers
    ids = torch.tensor([2, 7, 30])
    want = [t[ids].clone() for t in tables]
    with ThreadPoolExecutor(2) as ex, ThreadPoolExecutor(1) as packer:
        w = StepWriter(storage, "steps/1-a", pool, ex, pack="pack.0", packer=packer, defer=True)
        hashes = put_tables(w, tables, ids)
        appended_at_put = sum(bool(h.any()) for h in hashes)
        for t in tables:
            t.fill_(-1.0)  # training goes on: the staged copies are written
        entries = w.finish()
    assert appended_at_put == (0 if shared else 10 - (buffers - 2))  # the rest waited for finish()
    pack = b"".join(storage.read(f"steps/1-a/pack.0/c.{i}") for i in range(len(w.packs["pack.0"]) - 1))
    for i, rows in enumerate(want):
        size, _, at = entries[(f"t{i}", "")]["rows/c.0.0"]
        assert pack[at : at + size] == rows.numpy().tobytes()
        assert torch.equal(hashes[i], kernels.hash_rows(rows))
    assert all(pool._slots.acquire(timeout=5) for _ in range(buffers))  # every buffer came back


def test_at_most_max_deferred_small_chunks_are_left_to_finish():
    # Room for all of them (one shared buffer): the first MAX_DEFERRED wait, the rest are appended
    # by the saving thread, so that the background's Python stays bounded.
    pool = StagingPool(8, 1 << 20)
    tables = [torch.randn(50, 8) + i for i in range(MAX_DEFERRED + 4)]
    ids = torch.tensor([2, 7, 30])
    with ThreadPoolExecutor(2) as ex, ThreadPoolExecutor(1) as packer:
        w = StepWriter(MemoryStorage(), "steps/1-a", pool, ex, pack="pack.0", packer=packer, defer=True)
        hashes = put_tables(w, tables, ids)
        appended_at_put = [bool(h.any()) for h in hashes]
        w.finish()
    assert appended_at_put == [False] * MAX_DEFERRED + [True] * 4
    assert all(torch.equal(h, kernels.hash_rows(t[ids])) for h, t in zip(hashes, tables))
    assert all(pool._slots.acquire(timeout=5) for _ in range(8))  # every buffer came back


def test_an_abandoned_writer_gives_back_the_buffers_of_its_deferred_chunks():
    pool = StagingPool(6, 4096)
    with ThreadPoolExecutor(2) as ex, ThreadPoolExecutor(1) as packer:
        w = StepWriter(MemoryStorage(), "steps/1-a", pool, ex, pack="pack.0", packer=packer, defer=True)
        hashes = put_tables(w, [torch.randn(50, 8) for _ in range(4)], torch.tensor([1, 2]))
        w.abandon()
    assert not any(h.any() for h in hashes)  # none was appended
    assert all(pool._slots.acquire(timeout=5) for _ in range(6))


def test_a_large_chunk_after_deferred_ones_does_not_wait_for_them():
    # The large chunk's hand-off to the pack thread needs a slot the deferred chunks hold.
    pool = StagingPool(4, 2 * HAND_OFF_BYTES)
    small = [torch.randn(10, 4) for _ in range(2)]
    large = torch.randn(4, HAND_OFF_BYTES // 4)
    out: list[list[torch.Tensor]] = []
    with ThreadPoolExecutor(2) as ex, ThreadPoolExecutor(1) as packer:
        w = StepWriter(MemoryStorage(), "steps/1-a", pool, ex, pack="pack.0", packer=packer, defer=True)
        saving = threading.Thread(daemon=True, target=lambda: out.extend([
            put_tables(w, small, torch.tensor([3])), put_tables(w, [large], torch.tensor([0, 3]))]))
        saving.start()
        saving.join(30)
        stuck = saving.is_alive()
        if stuck:  # let it go, so the test fails instead of hanging
            for _ in range(4):
                w._ahead.release()
            saving.join(30)
        w.finish()
    assert not stuck, "the saving thread waited for the chunks it deferred"
    small_hashes, (large_hashes,) = out
    assert all(torch.equal(h, kernels.hash_rows(t[[3]])) for h, t in zip(small_hashes, small))
    assert torch.equal(large_hashes, kernels.hash_rows(large[[0, 3]]))


def test_small_chunks_sharing_a_buffer_and_large_ones_held_back_leave_the_pack_a_place():
    # 4 places of 2 MiB: the buffer the four small chunks (512 kB each) share and two large
    # chunks (2 MiB) held back would leave the third large one's gather the last place, and the
    # pack none for the small ones' appends (in quarters of a buffer, cut from a fresh one).
    pool = StagingPool(4, 2 * HAND_OFF_BYTES)
    small = [torch.randn(4, HAND_OFF_BYTES // 16) + i for i in range(4)]
    large = [torch.randn(4, HAND_OFF_BYTES // 4) + i for i in range(3)]
    out: list[list[torch.Tensor]] = []
    ex, packer = ThreadPoolExecutor(2), ThreadPoolExecutor(1)
    w = StepWriter(MemoryStorage(), "steps/1-a", pool, ex, pack="pack.0", packer=packer, defer=True)
    ids = torch.tensor([0, 3])
    saving = threading.Thread(daemon=True, target=lambda: out.extend([
        put_tables(w, small, ids), put_tables(w, large, ids), put_tables(w, small, ids)]))
    saving.start()
    saving.join(30)
    stuck = saving.is_alive()
    if stuck:  # more places, so the test fails instead of hanging
        for _ in range(4):
            pool._slots.release()
            pool._free.put(torch.empty(pool.nbytes, dtype=torch.uint8))
        saving.join(30)
    w.finish()
    ex.shutdown()
    packer.shutdown()
    assert not stuck, "the pack waited for a place only the saving thread gives back"
    hashes = [h for hs in out for h in hs]
    assert all(torch.equal(h, kernels.hash_rows(t[ids])) for h, t in zip(hashes, small + large + small))
    assert all(pool._slots.acquire(timeout=5) for _ in range(4))  # every buffer came back
