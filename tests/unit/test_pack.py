"""A delta's chunks go into one pack per writing rank: chunks may span the pack's files, the
pack reads with zarr, and a save that fails while filling the pack gives its buffers back."""

from __future__ import annotations

import os
import threading

import numpy as np
import torch
import zarr

from deltackpt import Checkpointer, StoreError
from deltackpt.save import stage


def test_chunks_spanning_pack_files_restore_bit_exactly(store_path):
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(400, 5, generator=gen)
    vec = torch.randn(301, generator=gen)
    with Checkpointer(store_path, chunk_bytes=1000, memory_budget=4000, dense_chunk_bytes=64) as ckpt:
        ckpt.save(0, {"t": table, "v": vec})
        table[::3] += 1
        vec[::50] += 1
        ckpt.save(1, {"t": table, "v": vec})
        m = ckpt.store.manifest(1)
        files = sorted(n for n in m.packs["pack.0"] if n != "zarr.json")
        assert files == [f"c.{i}" for i in range(len(files))] and len(files) >= 4
        assert all(m.packs["pack.0"][n][0] == 1000 for n in files)
        entries = [e for rec in m.tensors.values() for p in rec.parts for e in p.chunks.values()]
        assert any(at // 1000 != (at + size - 1) // 1000 for size, _, at in entries)
        assert ckpt.verify().ok
        got = ckpt.load(1)
        attempt = m.attempt
    assert torch.equal(got["t"], table) and torch.equal(got["v"], vec)
    arr = zarr.open_array(os.path.join(store_path, "steps", attempt, "pack.0"), mode="r")
    total = max(at + size for size, _, at in entries)
    assert arr.dtype == np.uint8 and arr.shape == (total,) and arr.chunks == (1000,)


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
