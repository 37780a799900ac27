"""The stage and write phases of a save, on every rank.

``stage`` copies everything the rank's part of the step writes out of the live tensors into
buffers of the staging pool, queuing each buffer's write as it fills: a base's large parts chunk
by chunk, its small parts and a delta's changed rows and chunks into the rank's pack. The pool bounds the memory this
adds: once every buffer is taken, staging waits for a write to give one back, so copying the next
chunk overlaps writing the last. After ``stage`` returns, nothing reads the live tensors: training
may change them while ``write`` waits for the queued writes and makes them durable.

The coordinator also writes every array's zarr metadata (``describe``), beside the chunks.
``sizes`` is ``(chunk_bytes, dense_chunk_bytes)``, the same on every rank (the planner checks),
so the coordinator and the rank that writes a part's chunks agree on the chunk grid.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from typing import TypeVar

import numpy as np
import torch

from ..format import dtypes
from ..format.encodings import CHUNKS, FULL, ROWS, Array, Packed, choose, in_pack
from ..format.hash_files import encode_hashes
from ..format.layout import STEPS, pack_name, part_folder
from ..format.manifest import ChunkMap
from ..format.part_tables import path_column
from ..io.staging import StagingPool
from ..io.writer import StepWriter
from ..quantization import Rowwise
from ..storage import Storage
from ..tracking.changes import SMALL_TENSOR_BYTES, TensorChange, is_row_sparse
from ..tracking.references import is_small, stores_row_hashes
from .planner import GlobalPlan
from .types import Kind, SavePlan, WriteItem, WriteResult

T = TypeVar("T")
_FIRST = np.zeros(1, np.int64)  # the one part of a tensor of one part


def describe(writer: StepWriter, save: SavePlan, plan: GlobalPlan, sizes: tuple[int, int]) -> None:
    """Coordinator: queues the zarr metadata of every array and group of the step (of a base's
    large parts; packed chunks are described by their packs, which their writers write). A
    tensor's parts come in a few shapes (a grid's cells), each looked at once: the work grows
    with the tensors and the arrays described, not with every part."""
    folders = {""}
    if save.kind == Kind.BASE:
        for t in plan.tensors.values():
            dtype = dtypes.from_name(t.dtype)
            shapes = plan.shape[t.first:t.first + t.count, :len(t.global_shape)]
            for shape, parts in _by_shape(shapes) if t.count > 1 else [(tuple(shapes[0].tolist()), _FIRST)]:
                arrays = described(save.kind, dtype, t.global_shape, shape, sizes)
                for i in parts.tolist() if arrays else ():
                    path = "" if t.count == 1 else f"p{i}"
                    for a in arrays:
                        writer.array(t.key, f"{path}/{a.name}".strip("/"), a.shape, a.chunk_shape, a.dtype,
                                     raw=not a.coded)
                    names = part_folder(t.key, path).split("/")
                    folders.update("/".join(names[:j]) for j in range(1, len(names)))
    writer.groups(sorted(folders))


def _by_shape(shapes: np.ndarray) -> list[tuple[tuple[int, ...], np.ndarray]]:
    """The distinct rows of ``shapes``, each with the rows that hold it: the first row's, which
    most cells of a grid share, found by one comparison, then the others'."""
    same = np.all(shapes == shapes[0], axis=1)
    out = [(tuple(shapes[0].tolist()), np.flatnonzero(same))]
    if not same.all():
        rest = np.flatnonzero(~same)
        kinds, which = np.unique(shapes[rest], axis=0, return_inverse=True)
        out += [(tuple(k), rest[np.reshape(which, -1) == i]) for i, k in enumerate(kinds.tolist())]
    return out


def described(kind: Kind, dtype: torch.dtype, global_shape: tuple[int, ...], shape: tuple[int, ...],
              sizes: tuple[int, int]) -> tuple[Array, ...]:
    """The arrays of a part of ``shape`` whose zarr metadata :func:`describe` writes: those of a
    base's part that is not packed; none of a packed part or a delta's."""
    if kind != Kind.BASE:
        return ()
    enc = choose(kind, global_shape, False)
    rows = shape[0] if shape else 1
    cs = enc.chunk_shape(shape, dtype.itemsize, rows, sizes, None)
    return () if in_pack(shape, dtype.itemsize, cs) else enc.arrays(dtype, shape, cs, rows)


def stage_part(writer: StepWriter, kind: Kind, item: WriteItem, change: TensorChange, n: int,
               sizes: tuple[int, int], rule: Rowwise | None = None, batch: dict[str, list[Packed]] | None = None
               ) -> TensorChange:
    """Copies what the step writes of one part into staging buffers (a delta's rows quantized by
    ``rule``) and queues their writes; a delta's changed chunks of a CPU tensor, and changed rows
    of a small one (of the registered ``chunks`` and ``rows`` encodings), go to ``batch`` under
    the encoding's name instead, for the caller to append at once (their ``encode_packed``).
    Returns ``change``, with the hashes of what a delta wrote filled in where the change set
    left them to the save (those of ``batch`` once it is appended)."""
    t, part = item.tensor, item.part
    if kind == Kind.DELTA and not n:  # nothing changed: nothing to stage
        return change
    enc = choose(kind, tuple(t.shape), rule is not None, change.aligned)
    cs = enc.chunk_shape(part.box.shape, t.element_size(), n, sizes, rule)
    if enc.whole:
        # A base's row hashes (an aligned 1-d tensor's are its elements'), where the scan left
        # them to the save, come from the staged copies, taken by the write threads beside the
        # writes rather than on this thread before it returns (a base of 8 row-wise Adagrad
        # sums of 524,288 rows: 68 ms); a small tensor's are left to the one batched call of
        # ChangeTracker.hash_whole.
        hashes = None
        if ((is_row_sparse(t) or change.aligned) and t.nbytes > SMALL_TENSOR_BYTES
                and (change.hashes is None or change.partial)):
            hashes = torch.empty(t.shape[0], dtype=torch.int64)
        enc.encode(writer, item.key, part.path, t, None, cs, hash_into=hashes)
        return change if hashes is None else TensorChange(change.changed, hashes, aligned=change.aligned)
    assert change.changed is not None  # a delta has a change set for every part
    hashes = torch.empty(n, dtype=torch.int64) if change.partial and change.hashes is None else None
    offset = part.box.offset[0] if part.box.offset else 0
    if batch is not None and t.is_cpu and (enc is CHUNKS or enc is ROWS and is_small(t)):
        batch.setdefault(enc.name, []).append((item.key, part.path, t, change.changed, cs, offset, hashes))
    else:
        enc.encode(writer, item.key, part.path, t, change.changed, cs, row_offset=offset, hash_into=hashes,
                   rule=rule)
    return change if hashes is None else change._replace(hashes=hashes)


def row_hash_file(kind: Kind, items: Sequence[WriteItem], index: Sequence[int],
                  staged: Mapping[str, TensorChange]) -> list[memoryview] | None:
    """A base's row hash file of ``items`` (their tensors' places in the root ``index``): the
    hash of every row of each part whose rows a base stores the hashes of
    (:func:`~deltackpt.tracking.references.stores_row_hashes`), as the change sets ``staged``
    hold them once the writes ended (the references of the next delta; see
    :mod:`deltackpt.format.hash_files`). None for a delta or a rank that wrote no such part."""
    if kind != Kind.BASE:
        return None
    entries = []
    for it, i in zip(items, index):
        t, hashes = it.tensor, staged[it.key].hashes
        if (hashes is not None and stores_row_hashes(tuple(t.shape), t.element_size())
                and hashes.shape == (t.shape[0],) and tuple(t.shape) == it.part.box.shape):
            entries.append((i, path_column(it.part.path), hashes.cpu().contiguous()))
    return encode_hashes(entries) if entries else None


def open_writer(storage: Storage, save: SavePlan, rank: int, pool: StagingPool,
                executor: Executor, packer: Executor | None = None, *, blocking: bool = True,
                gate: Future[None] | None = None, background: int | None = None) -> StepWriter:
    """The writer of ``rank``'s chunks of the step, with its pack (appended by ``packer``, and
    without ``blocking`` its small chunks by the background, its files held until staging ends
    and written by at most ``background`` I/O threads; its files written once ``gate`` is done,
    see :class:`~deltackpt.io.writer.StepWriter`)."""
    return StepWriter(storage, f"{STEPS}/{save.attempt}", pool, executor, pack=pack_name(rank),
                      packer=packer, defer=not blocking, gate=gate, hold=not blocking,
                      workers=None if blocking else background)


def stage(writers: list[StepWriter], save: SavePlan, items: tuple[WriteItem, ...],
          changes: Mapping[str, TensorChange], held: Sequence[int],
          sizes: tuple[int, int], *, plan: GlobalPlan | None) -> dict[str, TensorChange]:
    """Stages every item (holding ``held`` rows or chunks each) into ``writers[0]``, and on the
    coordinator, which passes the global ``plan``, the step's metadata into ``writers[1]``;
    returns the change sets of the items' tensors (``changes``, of exactly those), hashes filled
    in, once every writer has all of them (:meth:`~deltackpt.io.writer.StepWriter.staged`). On
    failure the caller abandons the writers (see :meth:`~deltackpt.io.writer.StepWriter.abandon`).

    A base's packed parts come last: the pack's file keeps an I/O thread until the pack ends, and
    the files of the large parts, queued before it, must not wait for a thread behind it. Those
    of small CPU tensors go in together, last (thousands of tiny tensors cost one call), as do a
    delta's changed chunks of CPU tensors and changed rows of small ones. A delta's parts that
    hold nothing are not looked at (most of a delta of many tensors'): their change sets are
    whole (a partial one that holds nothing has the hashes of nothing)."""
    small: list[WriteItem] = []  # packed parts of small CPU tensors: into the pack in one call
    batch: dict[str, list[Packed]] = {}  # a delta's chunks of CPU tensors, rows of small ones: likewise
    if save.kind == Kind.BASE:
        large: list[tuple[WriteItem, int]] = []
        packed: list[tuple[WriteItem, int]] = []
        for it, n in zip(items, held):
            if not _packed(it, sizes):
                large.append((it, n))
            elif is_small(it.tensor):  # into the pack with the others at once
                small.append(it)
            else:
                packed.append((it, n))
        work = [*large, *packed]
    else:
        work = list(itertools.compress(zip(items, held), held))
    if plan is not None:
        describe(writers[1], save, plan, sizes)
    staged = dict(changes)
    for it, n in work:
        staged[it.key] = stage_part(writers[0], save.kind, it, changes[it.key], n, sizes,
                                    save.quantize[it.key].rule if it.key in save.quantize else None, batch)
    for enc in (CHUNKS, ROWS):
        if enc.name in batch:
            enc.encode_packed(writers[0], batch[enc.name])
    if small:
        FULL.encode_packed(writers[0], [(it.key, it.part.path, it.tensor, _chunk_shape(it, sizes)) for it in small])
    for w in writers:
        w.staged()
    return staged


def _packed(item: WriteItem, sizes: tuple[int, int]) -> bool:
    """Whether a base's part lies in the pack (see :func:`deltackpt.format.encodings.in_pack`)."""
    return in_pack(item.part.box.shape, item.tensor.element_size(), _chunk_shape(item, sizes))


def _chunk_shape(item: WriteItem, sizes: tuple[int, int]) -> tuple[int, ...]:
    shape, itemsize = item.part.box.shape, item.tensor.element_size()
    return FULL.chunk_shape(shape, itemsize, shape[0] if shape else 1, sizes, None)


def write(storage: Storage, writers: list[StepWriter],
          record: Callable[[WriteResult], tuple[Mapping[str, Sequence[memoryview]], T]], *,
          helping: bool = True) -> T:
    """Waits for every staged write, writes the files that ``record`` makes of what was written
    (the rank's part table and row hashes, each in pieces) and makes every file durable;
    returns what ``record`` returns beside its files. ``helping``: this thread writes and
    checks the files no I/O thread has started (a blocking save's; see
    :meth:`~deltackpt.io.writer.StepWriter.finish`).

    Raises:
        StoreError: a write failed (after every write ended).
    """
    files: dict[tuple[str, str], ChunkMap] = {}
    packs: dict[str, ChunkMap] = {}
    bounds: dict[str, float] = {}
    error: BaseException | None = None
    for w in writers:
        try:
            for where, chunks in w.finish(helping=helping).items():
                # The writer's own maps, merged where two writers wrote to one place: a base of
                # 20,000 small tensors made as many dicts here, 28 collections of the objects
                # its paused stage phase made (0.2 s).
                if where in files:
                    files[where].update(chunks)
                else:
                    files[where] = chunks
            packs.update(w.packs)
            for key, bound in w.bounds.items():
                bounds[key] = max(bounds.get(key, 0.0), bound)
        except BaseException as e:  # noqa: BLE001 - every writer must end before raising
            error = error or e
    written = [k for w in writers for k in w.written]
    run = writers[0].run  # the folders' fsyncs, on the I/O threads and this one
    if error is not None:
        storage.sync(written, run=run)
        raise error
    more, out = record(WriteResult(files, packs, bounds))
    for key, pieces in more.items():
        storage.write(key, pieces)
    storage.sync([*written, *more], run=run)
    return out
