"""Reading a committed step into new tensors, from the store alone."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from functools import partial
from typing import Any

import torch

from .. import statetree
from ..collector import paused
from ..format import dtypes
from ..format.manifest import Manifest
from ..errors import KeyMismatchError, StateError
from ..io.partial import RowReader, row_ids, select_keys
from ..io.reader import ChainReader
from ..io.staging import StagingPool
from ..sharding import Box, Shard, row_block
from ..storage import Storage
from ..store import Store


@paused()  # per-tensor objects, no cycles: see restore
def read_step(store: Store, step: int, pool: StagingPool, executor: Executor, *,
              row_shard: tuple[int, int] | None = None, keys: Sequence[str] | None = None,
              key: str | None = None, rows: torch.Tensor | Sequence[int] | None = None) -> Any:
    """The state of ``step``, every tensor on the CPU (see :meth:`deltackpt.Checkpointer.load`),
    read from its chain; from the chain resolved again where a compaction and GC replace it
    meanwhile (see :meth:`~deltackpt.store.Store.read_chain`).

    Args:
        row_shard: ``(rank, world_size)`` to read only that rank's rows of a row-wise sharding
            (blocks of ``ceil(rows / world_size)`` rows, as ``torch.chunk`` splits); tensors
            with dimensions then come back as :class:`Shard` s, 0-d ones whole.
        keys: flat keys, key prefixes or globs (``"model/*.weight"``) of the only tensors to
            read; the result is then a flat dict by key instead of the nested state.
        key: with ``rows``, the one tensor to read rows of.
        rows: row ids (any order, repeats allowed); the result is then a tensor of
            ``len(rows)`` rows, read from the chunks that hold them alone.
    """
    return store.read_chain(store.chain(step), partial(_read_from, store.storage, pool=pool, executor=executor,
                                                       row_shard=row_shard, keys=keys, key=key, rows=rows))


def _read_from(storage: Storage, chain: list[Manifest], *, pool: StagingPool, executor: Executor,
                row_shard: tuple[int, int] | None, keys: Sequence[str] | None, key: str | None,
                rows: torch.Tensor | Sequence[int] | None) -> Any:
    """:func:`read_step` of the last step of ``chain``."""
    if key is not None or rows is not None:
        if keys is not None or row_shard is not None:
            raise StateError("key= and rows= read rows of one tensor: they go without keys= and row_shard=")
        return read_rows(storage, chain, pool, executor, key, rows)
    m = chain[-1]
    chosen = set(select_keys(m.tensors, keys)) if keys is not None else set(m.tensors)
    reader = ChainReader(storage, chain, pool, executor, chosen)
    out: dict[str, Any] = {}
    for key, rec in m.tensors.items():
        if key not in chosen:
            continue
        box = Box((0,) * len(rec.shape), rec.shape)
        if row_shard is not None and rec.shape:
            box = row_block(rec.shape, *row_shard)
        reader.check_files(key, box)  # the files justify the tensor before it is allocated
        t = torch.empty(box.shape, dtype=dtypes.from_name(rec.dtype))
        reader.read(key, t, box)
        out[key] = t if row_shard is None or not rec.shape else Shard(
            t, global_shape=rec.shape, global_offset=box.offset)
    return out if keys is not None else statetree.build(m.tree, out)


def read_rows(storage: Storage, chain: list[Manifest], pool: StagingPool, executor: Executor,
              key: str | None, rows: torch.Tensor | Sequence[int] | None) -> torch.Tensor:
    """Rows ``rows`` of the tensor ``key`` at the last step of ``chain`` (see
    :meth:`deltackpt.Checkpointer.load`).

    Raises:
        StateError: only one of ``key`` and ``rows`` given, or a bad row.
        KeyMismatchError: no tensor ``key``.
    """
    if key is None or rows is None:
        raise StateError("rows= and key= go together: the rows of one tensor")
    rec = chain[-1].tensors.get(key)
    if rec is None:
        raise KeyMismatchError([], [key])
    return RowReader(storage, chain, pool, executor).read_rows(key, row_ids(rows, rec.shape, key))
