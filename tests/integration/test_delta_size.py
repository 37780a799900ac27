"""A delta's size follows what changed."""

from __future__ import annotations

import os

import torch

from deltackpt import Checkpointer


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
