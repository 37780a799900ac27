"""Reading a committed step into new tensors, from the store alone."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

import torch

from .. import statetree
from ..format import dtypes
from ..format.manifest import Manifest
from ..io.partial import select_keys
from ..io.reader import ChainReader
from ..io.staging import StagingPool
from ..sharding import Box, Shard, row_block
from ..storage import Storage


def read_step(storage: Storage, chain: list[Manifest], pool: StagingPool, executor: Executor, *,
              row_shard: tuple[int, int] | None = None, keys: Sequence[str] | None = None) -> dict[str, Any]:
    """The state of the last step of ``chain``, every tensor on the CPU; with ``keys`` only the
    tensors they select, as a flat dict by key (see :meth:`deltackpt.Checkpointer.load`)."""
    m = chain[-1]
    chosen = set(select_keys(m.tensors, keys)) if keys is not None else set(m.tensors)
    reader = ChainReader(storage, chain, pool, executor)
    out: dict[str, Any] = {}
    for key, rec in m.tensors.items():
        if key not in chosen:
            continue
        box = Box((0,) * len(rec.shape), rec.shape)
        if row_shard is not None and rec.shape:
            box = row_block(rec.shape, *row_shard)
        t = torch.empty(box.shape, dtype=dtypes.from_name(rec.dtype))
        reader.read(key, t, box)
        out[key] = t if row_shard is None or not rec.shape else Shard(
            t, global_shape=rec.shape, global_offset=box.offset)
    return out if keys is not None else statetree.build(m.tree, out)
