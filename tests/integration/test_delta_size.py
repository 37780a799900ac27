"""A delta's size follows what changed."""

from __future__ import annotations

import os

import torch

from deltackpt import Checkpointer
from deltackpt.format.dtypes import compresses


def disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def test_one_percent_delta_of_a_million_row_table(store_path):
    rows, dim = 1_000_000, 64
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(rows, dim, generator=gen)
    changed = torch.randperm(rows, generator=gen)[: rows // 100]
    with Checkpointer(store_path) as ckpt:
        ckpt.save(0, {"table": table})
        table[changed] += 0.001
        info = ckpt.save(1, {"table": table})
        folder = os.path.join(store_path, "steps", ckpt.store.manifest(1).attempt)
    on_disk = disk_bytes(folder)
    assert info.kind == "delta" and info.rows_changed == changed.numel()
    bound = 1.1 * changed.numel() * (dim * 4 + 8)
    assert on_disk <= bound, (on_disk, bound)
    assert info.bytes_written <= on_disk


def test_a_delta_pads_less_than_one_block_per_chunk(store_path):
    """The pack's files hold the changed rows and chunks with less than one 4 KiB block of
    padding per chunk, however many staging buffers and chunks the delta spans, and so does
    each part's rows, rows wider than a block too."""
    gen = torch.Generator().manual_seed(1)
    state = {
        "table": torch.randn(200_000, 24, generator=gen),  # 96 B rows
        "wide": torch.randn(3000, 1000, generator=gen),  # 4000 B rows
        "wider": torch.randn(1203, 2500, generator=gen),  # 10,000 B rows
        "vec": torch.randn(1_300_001, generator=gen),  # chunks of about 1 MiB, an odd number
        "count": torch.arange(5000),
    }
    with Checkpointer(store_path, chunk_bytes=1 << 20, memory_budget=4 << 20) as ckpt:
        ckpt.save(0, state)
        state["table"][::7] += 1  # 2.7 MB of rows: three rows chunks
        state["wide"][::3] += 1
        state["wider"][::3] += 1  # 401 rows, a prime: an even split of 101 a chunk pads 3 rows
        state["vec"][::100_000] += 1  # every chunk, the short last one too
        state["count"][-1] += 1
        info = ckpt.save(1, state)
        m = ckpt.store.manifest(1)
    assert info.kind == "delta"
    payload, chunks = 0, 0
    for key, rec in m.tensors.items():
        t = state[key]
        for part in rec.parts:
            chunks += len(part.chunks)
            if rec.encoding.name == "rows":  # the rows, and the ids as stored (coded)
                rows = part.changed * t[0].numel() * t.element_size()
                stored = [c[0] for name, c in part.chunks.items() if name.startswith("rows/")]
                assert 0 <= sum(stored) - rows < 4096 * len(stored), (key, sum(stored), rows, len(stored))
                payload += rows
                payload += sum(c[0] for name, c in part.chunks.items() if name.startswith("ids/"))
            elif compresses(t.dtype):  # coded, padding and all: as stored
                payload += sum(c[0] for c in part.chunks.values())
            else:
                ce = part.chunk_shape[0]
                payload += sum(min(ce, t.numel() - int(n[2:]) * ce) * t.element_size()
                               for n in part.chunks)
    folder = os.path.join(store_path, "steps", m.attempt)
    packs = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs if f != "zarr.json"]
    on_disk = sum(os.path.getsize(p) for p in packs)
    chunks += len(packs)
    assert chunks >= 8 and on_disk > 4 << 20
    assert 0 <= on_disk - payload < 4096 * chunks, (on_disk, payload, chunks)
