"""A delta's chunks go into one pack per writing rank: one file of exactly its bytes however many
staging buffers it streams through, readable with zarr; a save that fails while filling the pack
gives its buffers back."""

from __future__ import annotations

import os
import threading

import numpy as np
import torch
import zarr

from deltackpt import Checkpointer, StoreError
from deltackpt.save import stage


def test_a_pack_longer_than_a_staging_buffer_is_one_unpadded_file(store_path):
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(4000, 5, generator=gen)
    vec = torch.randn(301, generator=gen)
    with Checkpointer(store_path, chunk_bytes=1000, memory_budget=4000, dense_chunk_bytes=64) as ckpt:
        ckpt.save(0, {"t": table, "v": vec})
        table[::10] += 1
        vec[::50] += 1
        ckpt.save(1, {"t": table, "v": vec})
        m = ckpt.store.manifest(1)
        assert sorted(m.packs["pack.0"]) == ["c.0", "zarr.json"]
        entries = [e for rec in m.tensors.values() for p in rec.parts for e in p.chunks.values()]
        total = max(at + size for size, _, at in entries)
        assert total > 4000  # more than the staging pool holds at once
        assert m.packs["pack.0"]["c.0"][0] == total == sum(size for size, _, _ in entries)
        assert ckpt.verify().ok
        got = ckpt.load(1)
        attempt = m.attempt
    assert torch.equal(got["t"], table) and torch.equal(got["v"], vec)
    arr = zarr.open_array(os.path.join(store_path, "steps", attempt, "pack.0"), mode="r")
    assert arr.dtype == np.uint8 and arr.shape == (total,) and arr.chunks == (total,)
    with open(os.path.join(store_path, "steps", attempt, "pack.0", "c.0"), "rb") as f:
        assert arr[:].tobytes() == f.read()


def test_a_save_failing_while_packing_gives_its_buffers_back(store_path, monkeypatch):
    table = torch.zeros(1000, 8)
    real = stage.stage_part
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) % 2 == 0:  # the second part of each save fails, the first is in the pack
            raise StoreError(None, "injected")
        return real(*args, **kwargs)

    # Two staging buffers: a buffer kept by a failed save would hang a later one, so the saves
    # run in a thread the test can give up on.
    ckpt = Checkpointer(store_path, chunk_bytes=4096, memory_budget=8192)
    ckpt.save(0, {"a": table, "b": table.clone()})
    errors = []

    def saves() -> None:
        with monkeypatch.context() as patch:
            patch.setattr("deltackpt.save.stage.stage_part", failing)
            for step in (1, 2, 3):
                table[step] += 1
                try:
                    ckpt.save(step, {"a": table, "b": table.clone()})
                except StoreError as e:
                    errors.append(str(e))
        ckpt.save(4, {"a": table, "b": table.clone()})

    worker = threading.Thread(target=saves, daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "a save hung: a failed save kept a staging buffer"
    assert errors == ["injected"] * 3
    assert ckpt.steps() == [0, 4] and torch.equal(ckpt.load(4)["a"], table)
    ckpt.close()
