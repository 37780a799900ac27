"""The stage and write phases of a save, on every rank.

``stage`` copies everything the rank's part of the step writes out of the live tensors into
buffers of the staging pool, queuing each buffer's write as it fills: a base's tensors chunk by
chunk, a delta's changed rows and chunks into the rank's pack. The pool bounds the memory this
adds: once every buffer is taken, staging waits for a write to give one back, so copying the next
chunk overlaps writing the last. After ``stage`` returns, nothing reads the live tensors: training
may change them while ``write`` waits for the queued writes and makes them durable.

The coordinator also writes every array's zarr metadata (``describe``), beside the chunks.
``sizes`` is ``(chunk_bytes, dense_chunk_bytes)``, the same on every rank (the planner checks),
so the coordinator and the rank that writes a part's chunks agree on the chunk grid.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import replace
from functools import partial

import numpy as np
import torch

from ..format import dtypes
from ..format.encodings import Encoding, chunk_shape
from ..format.layout import STEPS, pack_name, part_folder
from ..format.manifest import ChunkMap
from ..io.staging import StagingPool
from ..io.writer import StepWriter
from ..quantization import Rowwise
from ..storage import Storage
from ..tracking.changes import TensorChange, is_row_sparse
from .decide import itemsize, part_chunk_shape
from .planner import GlobalPlan
from .types import Kind, SavePlan, WriteItem, WriteResult


def describe(writer: StepWriter, save: SavePlan, plan: GlobalPlan, sizes: tuple[int, int]) -> None:
    """Coordinator: queues the zarr metadata of every array and group of the step (of a base;
    a delta's chunks go into packs, which their writers describe)."""
    folders = {""}
    if save.kind == Kind.BASE:
        for t in plan.tensors.values():
            for p in t.parts:
                cs = chunk_shape(Encoding.FULL, p.box.shape, itemsize(t.dtype),
                                 p.box.shape[0] if p.box.shape else 1, *sizes)
                writer.array(t.key, p.path, p.box.shape, cs, dtypes.from_name(t.dtype))
                names = part_folder(t.key, p.path).split("/")
                folders.update("/".join(names[:i]) for i in range(1, len(names)))
    writer.groups(sorted(folders))


def stage_part(writer: StepWriter, pool: StagingPool, kind: Kind, item: WriteItem,
               change: TensorChange, n: int, sizes: tuple[int, int],
               rule: Rowwise | None = None) -> TensorChange:
    """Copies what the step writes of one part into staging buffers (a delta's rows quantized by
    ``rule``) and queues their writes. Returns ``change``, with the hashes of what a delta wrote
    filled in where the change set left them to the save."""
    t, part = item.tensor, item.part
    enc = Encoding.of(kind, tuple(t.shape), rule is not None)
    cs = part_chunk_shape(enc, part.box.shape, t.element_size(), n, sizes, rule)
    if enc == Encoding.FULL:
        # A base's row hashes, where the scan left them to the save, come from the staged copies,
        # taken by the write threads beside the writes rather than in a pass before them.
        hashes = None
        if is_row_sparse(t) and t.numel() and (change.hashes is None or change.partial):
            hashes = torch.empty(t.shape[0], dtype=torch.int64)
        _stage_whole(writer, pool, item.key, part.path, t, cs, hashes)
        return change if hashes is None else TensorChange(change.changed, hashes)
    assert change.changed is not None  # a delta has a change set for every part
    hashes = torch.empty(n, dtype=torch.int64) if change.partial and change.hashes is None else None
    if enc in (Encoding.ROWS, Encoding.QROWS):
        writer.rows(item.key, part.path, t, change.changed, part.box.offset[0], cs[0], hash_into=hashes,
                    rule=rule)
    else:
        writer.chunks(item.key, part.path, t, change.changed.tolist(), cs[0], hash_into=hashes)
    return change if hashes is None else replace(change, hashes=hashes)


def _stage_whole(writer: StepWriter, pool: StagingPool, key: str, path: str, t: torch.Tensor,
                 chunks: tuple[int, ...], hash_into: torch.Tensor | None = None) -> None:
    """Copies ``t`` chunk by chunk into staging buffers, each written and given back on its own
    (each row hashed into ``hash_into`` first, if given)."""
    rows = t.shape[0] if t.dim() else 1
    flat = t.reshape(rows, math.prod(t.shape[1:]))  # -1 is ambiguous for a tensor without elements
    per_row = flat.shape[1]
    cr = chunks[0] if chunks else 1
    for i in range(-(-rows // cr) if t.numel() else 0):
        lo, hi = i * cr, min(rows, (i + 1) * cr)
        buf = pool.acquire((hi - lo) * per_row * t.element_size())
        try:
            staged = buf.view(t.dtype).view(hi - lo, per_row)
            if t.device.type == "cpu":
                # numpy, on this thread: torch's copy_ wakes its thread pool, and with the cores
                # busy elsewhere it copied 32 MiB at 0.73 GB/s where numpy copied 2.8 GB/s.
                np.copyto(buf.numpy(), flat[lo:hi].reshape(-1).view(torch.uint8).numpy())
            else:
                staged.copy_(flat[lo:hi])
        except BaseException:
            pool.release(buf)
            raise
        writer.full(key, path, staged.view((hi - lo, *t.shape[1:]) if t.dim() else ()), chunks,
                    first_chunk=i, release=partial(pool.release, buf),
                    hash_into=None if hash_into is None else hash_into[lo:hi])


def open_writer(storage: Storage, save: SavePlan, rank: int, pool: StagingPool,
                executor: Executor) -> StepWriter:
    """The writer of ``rank``'s chunks of the step (into its pack, for a delta)."""
    return StepWriter(storage, f"{STEPS}/{save.attempt}", pool, executor,
                      pack=pack_name(rank) if save.kind == Kind.DELTA else None)


def stage(writers: list[StepWriter], pool: StagingPool, save: SavePlan, items: tuple[WriteItem, ...],
          changes: Mapping[str, TensorChange], held: Mapping[tuple[str, str], int],
          sizes: tuple[int, int], *, plan: GlobalPlan | None) -> dict[str, TensorChange]:
    """Stages every item (holding ``held`` rows or chunks, by tensor key and part path) into
    ``writers[0]``, and on the coordinator, which passes the global ``plan``, the step's metadata
    into ``writers[1]``; returns the items' change sets, hashes filled in. On failure every queued
    write ends and every buffer goes back before the error propagates."""
    try:
        if plan is not None:
            describe(writers[1], save, plan, sizes)
        return {it.key: stage_part(writers[0], pool, save.kind, it, changes[it.key],
                                   held[(it.key, it.part.path)], sizes,
                                   save.quantize[it.key].rule if it.key in save.quantize else None)
                for it in items}
    except BaseException:
        for w in writers:
            w.abandon()
        raise


def write(storage: Storage, writers: list[StepWriter]) -> WriteResult:
    """Waits for every staged write and makes the files durable.

    Raises:
        StoreError: a write failed (after every write ended).
    """
    files: dict[tuple[str, str], ChunkMap] = {}
    packs: dict[str, ChunkMap] = {}
    bounds: dict[str, float] = {}
    error: BaseException | None = None
    for w in writers:
        try:
            for where, chunks in w.finish().items():
                files.setdefault(where, {}).update(chunks)
            packs.update(w.packs)
            for key, bound in w.bounds.items():
                bounds[key] = max(bounds.get(key, 0.0), bound)
        except BaseException as e:  # noqa: BLE001 - every writer must end before raising
            error = error or e
    storage.sync([k for w in writers for k in w.written])
    if error is not None:
        raise error
    return WriteResult(files, packs, bounds)
