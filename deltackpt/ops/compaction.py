"""Compaction: folding a step's chain into a new base, so later restores replay from there.

The new base is written into a fresh attempt folder and committed as ``bases/<step>.json``
(created only if absent), a record that stands in for the step's own record when a chain is
replayed (see ``Store.chain``). Nothing a committed record refers to is touched, so compaction
runs while training keeps saving to the same store: deltas after the step keep their parents,
and their chains simply stop at the new base. Running it again finds the base and does nothing.

It streams: each unit of work is one chunk of rows of one tensor, read from the chain into a
staging buffer and written as one chunk of the new base, so memory stays within the staging
pool. As in a base a save writes, a small part (one chunk of at most 1 MiB, see
:func:`~deltackpt.format.encodings.in_pack`) goes into its writer's pack instead of a zarr array
of its own: compacting thousands of small tensors writes a few files. As a save's base, it stores
the row hashes of its large tables (see :mod:`deltackpt.format.hash_files`), those of each table
whose every unit one rank wrote. Under several ranks the units are dealt round-robin and the
coordinator commits once.

Call order (every rank): ``compact(...)``; phases ``compact_plan`` (coordinator),
``compact_write`` (all), ``compact_commit`` (coordinator).
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch

from ..collectives import Collective
from ..errors import StepNotFoundError, StoreError
from ..format import dtypes
from ..format.encodings import FULL, in_pack, write_block
from ..format.hash_files import digest, encode_hashes
from ..format.layout import STEPS, chunk_path, pack_name
from ..format.lossy import Lossy
from ..format.manifest import (
    FORMAT,
    LOSSY_FORMAT,
    ChunkMap,
    Manifest,
    PartRecord,
    TensorRecord,
)
from ..format.record_io import hashes_key
from ..io.reader import ChainReader
from ..io.staging import StagingPool
from ..io.writer import StepWriter
from ..sharding import Box
from ..store import Store
from ..tracking.references import stores_row_hashes


@dataclass(frozen=True)
class CompactInfo:
    """What a compaction did.

    Attributes:
        step: the step compacted.
        done: False when the step already was a base (its own, or one compaction made).
        chain_length: records its restore replayed before (1 when ``done`` is False).
        bytes_written: bytes of the new base.
        seconds: wall time on this rank.
    """

    step: int
    done: bool
    chain_length: int
    bytes_written: int
    seconds: float


@dataclass(frozen=True)
class _Work:
    chain: list[Manifest]
    attempt: str
    units: list[tuple[str, int, int, bool]]  # tensor key, first row, rows (one chunk each), packed
    docs: dict[tuple[str, str], ChunkMap]


class _Written(NamedTuple):
    """What one rank wrote: its chunks, its pack's files, its row hash file (size, checksum) and
    the tensors it lists."""

    chunks: dict[tuple[str, str], ChunkMap]
    packs: dict[str, ChunkMap]
    hashes: tuple[int, str] | None
    hashed: list[str]


def compact(store: Store, coll: Collective, pool: StagingPool, executor: Executor,
            sizes: tuple[int, int], upto: int | None) -> CompactInfo:
    """Commits a base for step ``upto`` (default: the latest) made from its chain."""
    t0 = time.perf_counter()

    def plan() -> tuple[int, _Work | None]:
        steps = store.steps()
        step = upto if upto is not None else (steps[-1] if steps else None)
        if step is None:
            raise StepNotFoundError(-1, [])
        if store.compacted(step) is not None:
            return step, None  # done before (GC may since have dropped the step's own record)
        chain = store.chain(step)
        if chain[0].step == step:
            return step, None
        attempt = store.new_attempt(step)
        writer = StepWriter(store.storage, f"{STEPS}/{attempt}", pool, executor)
        units, packed = [], []
        for key, rec in chain[-1].tensors.items():
            dt = dtypes.from_name(rec.dtype)
            cs = _chunks(rec, sizes)
            if in_pack(rec.shape, dt.itemsize, cs):
                if math.prod(rec.shape):
                    packed.append((key, 0, rec.shape[0] if rec.shape else 1, True))
                continue
            for a in FULL.arrays(dt, rec.shape, cs, 0):
                writer.array(key, a.name, a.shape, a.chunk_shape, a.dtype, raw=not a.coded)
            rows = rec.shape[0] if rec.shape else 1
            if math.prod(rec.shape):
                cr = cs[0] if cs else 1
                units += [(key, lo, min(cr, rows - lo), False) for lo in range(0, rows, cr)]
        arrays = {key for key, *_ in units}
        names = {"/".join(k.split("/")[:i]) for k in arrays for i in range(1, k.count("/") + 1)}
        writer.groups(sorted(names | {""}))
        try:
            docs = writer.finish()
        finally:
            store.storage.sync(writer.written)
        # Packed units last: the pack keeps an I/O thread until it ends (as a save stages them).
        return step, _Work(chain, attempt, units + packed, docs)

    step, work = coll.one("compact_plan", plan)
    if work is None:
        return CompactInfo(step, False, 1, 0, time.perf_counter() - t0)
    m = work.chain[-1]

    def write() -> _Written:
        mine = [unit for i, unit in enumerate(work.units) if i % coll.size == coll.rank]
        # The row hashes of each large table whose every chunk this rank writes (every table,
        # on one rank), as a base a save writes stores them: a restore then takes them.
        others = {key for i, (key, *_) in enumerate(work.units) if i % coll.size != coll.rank}
        hashes = {key: torch.empty(m.tensors[key].shape[0], dtype=torch.int64) for key, *_ in mine
                  if key not in others and coll.rank < m.world_size
                  and stores_row_hashes(m.tensors[key].shape, _itemsize(m.tensors[key]))}
        reader = ChainReader(store.storage, work.chain, pool, executor, {key for key, _, _, _ in mine})
        writer = StepWriter(store.storage, f"{STEPS}/{work.attempt}", pool, executor,
                            pack=pack_name(coll.rank))
        # Blocks come from a pool of their own: reads wait on the main pool, and a read must
        # never wait for a block that a queued write would free.
        blocks = StagingPool(2, sizes[0])
        try:
            for key, lo, n, packed in mine:
                rec = m.tensors[key]
                dt = dtypes.from_name(rec.dtype)
                box = Box((lo, *(0,) * (len(rec.shape) - 1)), (n, *rec.shape[1:])) if rec.shape else Box((), ())
                buf = blocks.acquire(math.prod(box.shape) * _itemsize(rec))
                block = buf.view(dt).view(box.shape)
                reader.read(key, block, box)
                cs = _chunks(rec, sizes)
                write_block(writer, key, "", block, cs, first_chunk=lo // cs[0] if cs else 0,
                            release=partial(blocks.release, buf), packed=packed,
                            hash_into=hashes[key][lo : lo + n] if key in hashes else None)
        except BaseException:  # a damaged chain: end the writes started, the pack's among them
            writer.abandon()
            raise
        written, stored = writer.written, None
        try:
            chunks = writer.finish()
            if hashes:  # once the writes that fill them have ended
                index = {key: i for i, key in enumerate(m.tensors)}
                pieces = encode_hashes([(index[key], -1, h) for key, h in hashes.items()])
                store.storage.write(hashes_key(work.attempt, coll.rank), pieces)
                written, stored = [*written, hashes_key(work.attempt, coll.rank)], digest(pieces)
            return _Written(chunks, writer.packs, stored, list(hashes))
        finally:
            store.storage.sync(written)

    results = coll.all("compact_write", write)

    def commit() -> int:
        files: dict[tuple[str, str], ChunkMap] = {}
        packs: dict[str, ChunkMap] = {}
        in_packs: dict[str, int] = {}  # the rank whose pack holds each packed tensor
        hashes = {r: res.hashes for r, res in enumerate(results) if res.hashes is not None}
        hashed = {key: r for r, res in enumerate(results) for key in res.hashed}  # by the rank whose file lists it
        for rank, per_rank in [(None, work.docs), *((r, res.chunks) for r, res in enumerate(results))]:
            for where, chunks in per_rank.items():
                files.setdefault(where, {}).update(chunks)
                if rank is not None and any(len(e) == 3 for e in chunks.values()):
                    in_packs[where[0]] = rank
        for res in results:
            packs.update(res.packs)
        tensors = {}
        for key, rec in m.tensors.items():
            part = PartRecord((0,) * len(rec.shape), rec.shape, "", _chunks(rec, sizes),
                              rec.shape[0] if rec.shape else 1, files.get((key, ""), {}),
                              None if key not in in_packs else pack_name(in_packs[key]),
                              in_packs.get(key, hashed.get(key, 0)))
            # A chain with quantized rows decodes to a base with their loss: marked, never exact.
            lossy = None if rec.lossy is None else Lossy(None, rec.lossy.chain_bound, rec.lossy.chain_bound)
            tensors[key] = TensorRecord(rec.dtype, rec.shape, FULL, (part,), lossy)
        base = Manifest(
            step=m.step, kind="base", attempt=work.attempt, parent=None, parent_attempt=None,
            base=m.step, chain_length=0, world_size=m.world_size, created=time.time(),
            policy={"name": "compaction", "decision": "base",
                    "reason": f"compacted a chain of {len(work.chain)} records"},
            tree=m.tree, tensors=tensors, packs=packs,
            # Files only: a packed chunk's bytes are counted in its pack's files.
            bytes_written=sum(e[0] for chunks in [*files.values(), *packs.values()]
                              for e in chunks.values() if len(e) == 2) + sum(e[0] for e in hashes.values()),
            state_bytes=m.state_bytes, compacts=m.attempt, quantize=m.quantize,
            format=LOSSY_FORMAT if m.format == LOSSY_FORMAT or m.lossy else FORMAT, hashes=hashes,
        )
        store.storage.point("compact_commit", "")
        _check_files(store, base)
        store.commit(base)  # False: another compaction of this step won; its base serves
        return base.bytes_written

    written = coll.one("compact_commit", commit)
    return CompactInfo(m.step, True, len(work.chain), written, time.perf_counter() - t0)


def _check_files(store: Store, base: Manifest) -> None:
    """Raises unless every file ``base`` refers to is in the store: GC deletes the folder of a
    compaction that stalled past the grace period (nothing names it before its commit), and a
    base committed without its files would end every chain through its step."""
    paths = [chunk_path(base, key, part, name) for key, rec in base.tensors.items()
             for part in rec.parts for name, entry in part.chunks.items() if len(entry) == 2]
    paths += [f"{STEPS}/{base.attempt}/{pack}/{name}" for pack, files in base.packs.items()
              for name in files]
    paths += [hashes_key(base.attempt, rank) for rank in base.hashes]
    wanted: dict[str, set[str]] = {}
    for path in paths:
        folder, _, name = path.rpartition("/")
        wanted.setdefault(folder, set()).add(name)
    for folder, names in wanted.items():
        gone = sorted(names - set(store.storage.files(folder)))
        if gone:
            more = f" and {len(gone) - 1} more files" if len(gone) > 1 else ""
            raise StoreError(f"compaction of step {base.step}: {folder}/{gone[0]}{more} of its new "
                             "base went while it ran (a GC deletes the folder of a compaction "
                             "stalled past the grace period): nothing was committed")


def _itemsize(rec: TensorRecord) -> int:
    return torch.empty((), dtype=dtypes.from_name(rec.dtype)).element_size()


def _chunks(rec: TensorRecord, sizes: tuple[int, int]) -> tuple[int, ...]:
    return FULL.chunk_shape(rec.shape, _itemsize(rec), 0, sizes, None)

