"""A non-blocking save's writer (``defer``) holds its large staged chunks back from the pack thread
until the caller has staged every chunk (``staged``): the pack thread's hashing and copying do
not compete with the caller's gathers. Out of buffers, it hands them over at once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deltackpt import kernels
from deltackpt.format.encodings import get
from deltackpt.io.staging import StagingPool
from deltackpt.io.writer import HAND_OFF_BYTES, StepWriter
from deltackpt.storage import MemoryStorage

ROW = 1024  # elements of a row: 4 KiB of float32


def put_large(w: StepWriter, tables: list[torch.Tensor], ids: torch.Tensor) -> list[torch.Tensor]:
    hashes = [torch.zeros(ids.numel(), dtype=torch.int64) for _ in tables]
    for i, (t, h) in enumerate(zip(tables, hashes)):
        get("rows").encode(w, f"t{i}", "", t, ids, (ids.numel(), ROW), hash_into=h)
    return hashes


def appended(hashes: list[torch.Tensor]) -> int:
    return sum(bool(h.any()) for h in hashes)


@pytest.mark.parametrize("defer", [True, False])
def test_large_chunks_wait_for_staged_only_in_a_deferred_writer(defer):
    ids = torch.arange(0, 2 * HAND_OFF_BYTES // (4 * ROW), 2)  # a chunk of HAND_OFF_BYTES
    tables = [torch.randn(int(ids[-1]) + 1, ROW) + i for i in range(3)]
    want = [t[ids].clone() for t in tables]
    pool = StagingPool(8, 2 * HAND_OFF_BYTES)
    storage = MemoryStorage()
    with ThreadPoolExecutor(2) as ex, ThreadPoolExecutor(1) as packer:
        w = StepWriter(storage, "steps/1-a", pool, ex, pack="pack.0", packer=packer, defer=defer)
        hashes = put_large(w, tables, ids)
        packer.submit(lambda: None).result()  # what the packer was given is appended by now
        before = appended(hashes)
        w.staged()
        packer.submit(lambda: None).result()
        after = appended(hashes)
        for t in tables:
            t.fill_(-1.0)  # training goes on: the staged copies are written
        entries = w.finish()
    assert (before, after) == ((0, 3) if defer else (3, 3))
    pack = b"".join(storage.read(f"steps/1-a/pack.0/c.{i}") for i in range(len(w.packs["pack.0"]) - 1))
    for i, rows in enumerate(want):
        size, _, at = entries[(f"t{i}", "")]["rows/c.0.0"]
        assert pack[at : at + size] == rows.numpy().tobytes()
        assert torch.equal(hashes[i], kernels.hash_rows(rows))
    assert all(pool._slots.acquire(timeout=5) for _ in range(8))  # every buffer came back


def test_a_deferred_writer_out_of_buffers_hands_its_held_chunks_over_and_goes_on():
    ids = torch.arange(0, 2 * HAND_OFF_BYTES // (4 * ROW), 2)
    tables = [torch.randn(int(ids[-1]) + 1, ROW) for _ in range(6)]  # more chunks than buffers
    pool = StagingPool(4, 2 * HAND_OFF_BYTES)
    with ThreadPoolExecutor(2) as ex, ThreadPoolExecutor(1) as packer:
        w = StepWriter(MemoryStorage(), "steps/1-a", pool, ex, pack="pack.0", packer=packer, defer=True)
        hashes = put_large(w, tables, ids)
        entries = w.finish()
    assert len(entries) == 6
    assert all(torch.equal(h, kernels.hash_rows(t[ids])) for h, t in zip(hashes, tables))
    assert all(pool._slots.acquire(timeout=5) for _ in range(4))


def test_an_abandoned_writer_gives_back_the_buffers_of_its_held_chunks():
    ids = torch.arange(0, 2 * HAND_OFF_BYTES // (4 * ROW), 2)
    pool = StagingPool(6, 2 * HAND_OFF_BYTES)
    with ThreadPoolExecutor(2) as ex, ThreadPoolExecutor(1) as packer:
        w = StepWriter(MemoryStorage(), "steps/1-a", pool, ex, pack="pack.0", packer=packer, defer=True)
        hashes = put_large(w, [torch.randn(int(ids[-1]) + 1, ROW) for _ in range(3)], ids)
        w.abandon()
    assert appended(hashes) == 0
    assert all(pool._slots.acquire(timeout=5) for _ in range(6))
