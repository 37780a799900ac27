"""A parsed commit record's tensors, read from its part tables as a reader first asks for them.

A parsed record's tensors hold :class:`LazyParts`: a tensor's parts are read (only the tables of
the ranks that wrote it, each once), checked and built when a reader first asks for them, so
``ls`` reads roots only and a partial load reads the tables it needs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np

from ..errors import ManifestError
from ..sharding import Box
from .lossy import Lossy
from .encodings import Encoding
from .manifest import PartRecord, TensorRecord
from .part_layout import PartLayout
from .part_tables import METADATA, Seen, Table, check_parts, decode_table, idle_in
from .record_io import table_key


# Reads a rank's table (its key, size and checksum as the root records them), checked.
TableReader = Callable[[str, int, str], bytes]


class Tables:
    """The part tables of one parsed record, read and decoded on first use, each once.

    Args:
        attempt: the record's attempt folder.
        listed: size and checksum of each rank's table, as the root lists them.
        packs: bytes of each rank's pack, for the ranks that wrote one.
        ndims: each tensor's number of dimensions, by its index in the root.
        owners: the ranks each tensor lists, by index.
        read: reads a table, checked against its listed size and checksum.
        where: the record, for errors.
    """

    def __init__(self, attempt: str, listed: dict[int, tuple[int, str]], packs: dict[int, int],
                 ndims: list[int], owners: list[frozenset[int]], read: TableReader, where: str):
        self.attempt, self.listed, self.packs = attempt, listed, packs
        self.ndims, self.owners, self._read, self.where = ndims, owners, read, where
        self._tables: dict[int, Table] = {}
        self.lock = threading.RLock()  # also each of the record's LazyParts'

    def table(self, rank: int) -> Table:
        with self.lock:
            if rank not in self._tables:
                key = table_key(self.attempt, rank)
                if rank not in self.listed:
                    raise ManifestError(f"{self.where}: a tensor lists rank {rank}, whose table {key} "
                                        f"is not in 'tables'")
                size, digest = self.listed[rank]
                table = decode_table(self._read(key, size, digest), key, rank, self.ndims,
                                     self.packs.get(rank))
                stray = [t for t in table.by_tensor if rank not in self.owners[t]]
                if stray:
                    raise ManifestError(f"{key}: holds parts of tensor {stray[0]}, which does not "
                                        f"list rank {rank}")
                self._tables[rank] = table
            return self._tables[rank]


class LazyParts(Sequence[PartRecord]):
    """A parsed tensor's parts, sorted by path: read from its ranks' tables, checked whole
    (see :func:`deltackpt.format.part_tables.check_parts`, and against the tensor's layout if
    its root gives one) and built on first use; or, with a layout, only those that meet a box
    (:meth:`meeting`), read from the tables that hold them alone."""

    def __init__(self, tables: Tables, index: int, count: int, head: TensorRecord, layout: PartLayout | None,
                 key: str):
        # Thousands a record: what a reader may never ask for is made when it first does.
        self._tables, self._index, self._count, self._head, self._key = tables, index, count, head, key
        self._layout = layout
        self._parts: tuple[PartRecord, ...] | None = None
        self._seen: Seen | None = None  # shared by every table read
        self._met: dict[Box, list[PartRecord]] = {}

    @property
    def _where(self) -> str:
        return f"{self._tables.where}: tensor {self._key!r}"

    def _seen_so_far(self) -> Seen:
        if self._seen is None:
            self._seen = ({}, {(METADATA, 0): "zarr.json"})
        return self._seen

    def _load(self) -> tuple[PartRecord, ...]:
        with self._tables.lock:
            if self._parts is None:
                parts: list[PartRecord] = []
                for rank in sorted(self._tables.owners[self._index]):
                    got = self._tables.table(rank).parts(self._index, self._head, self._where, self._seen_so_far())
                    if not got:
                        raise ManifestError(f"{self._where}: lists rank {rank}, whose table holds "
                                            f"none of its parts")
                    parts += got
                if len(parts) != self._count:
                    raise ManifestError(f"{self._where}: field 'parts' says {self._count}, its "
                                        f"tables hold {len(parts)}")
                parts.sort(key=lambda p: int(p.path[1:]) if p.path else -1)
                rec = TensorRecord(self._head.dtype, self._head.shape, self._head.encoding,
                                   tuple(parts), self._head.lossy)
                check_parts(rec, self._where)
                if self._layout is not None:
                    self._check_layout(parts, self._layout)
                self._parts = tuple(parts)
            return self._parts

    def untouched(self, box: Box) -> bool:
        """Whether no part that meets ``box`` changed a row or lists a chunk (a delta's part of
        a tensor it left as it was), told from the columns of the tables that may hold such
        parts (with a layout, those of the writers of its cells that meet ``box``, as
        :meth:`meeting` reads), without building a part. False where such a table holds none of
        the tensor's parts or, without a layout, they do not add up to its count: a read then
        builds them, and fails on what is wrong."""
        layout = self._layout
        ranks = self._tables.owners[self._index] if layout is None else {layout.writer(i) for i in layout.meeting(box)}
        tables = [self._tables.table(rank) for rank in ranks]
        return (all(self._index in t.by_tensor and t.idle[self._index] for t in tables)
                and (layout is not None or sum(len(t.by_tensor[self._index]) for t in tables) == self._count))

    def _check_layout(self, parts: list[PartRecord], layout: PartLayout) -> None:
        """Checks every part (distinct paths, sorted) against ``layout``."""
        why: str | None = "its parts' paths are not those of its layout"
        if [p.path for p in parts] == [layout.path(i) for i in range(len(parts))]:
            why = layout.problem([p.box for p in parts], [p.rank for p in parts])
        if why is not None:
            raise ManifestError(f"{self._where}: {why}")

    def meeting(self, box: Box) -> Sequence[PartRecord]:
        """The parts that share an element with ``box``, sorted by path. With a layout, only the
        tables of their writers are read, and each such table's parts of the tensor are checked
        against the layout; without one, every part is read."""
        if self._layout is None:
            return [p for p in self._load() if (inter := p.box.intersect(box)) is not None and inter.numel]
        layout = self._layout
        with self._tables.lock:
            met = self._met.get(box)
            if met is not None:
                return met
            # Each part is looked up in its writer's table as the cells are walked, so a
            # hostile layout of many cells stops at the first one no table holds.
            tables: dict[int, dict[str, PartRecord]] = {}
            met = []
            for i in layout.meeting(box):
                rank = layout.writer(i)
                by_path = tables.get(rank)
                if by_path is None:
                    by_path = tables[rank] = self._written_by(rank, layout)
                part, want = by_path[layout.path(i)], layout.box(i)
                if part.box != want:
                    raise ManifestError(f"{self._where} (table {table_key(self._tables.attempt, rank)}): part "
                                        f"{part.path!r} at {list(part.offset)} of {list(part.shape)}, its layout "
                                        f"says at {list(want.offset)} of {list(want.shape)}")
                met.append(part)
            self._met[box] = met
            return met

    def _written_by(self, rank: int, layout: PartLayout) -> dict[str, PartRecord]:
        """The tensor's parts in ``rank``'s table by path: exactly those ``layout`` gives it."""
        got = self._tables.table(rank).parts(self._index, self._head, self._where, self._seen_so_far())
        paths, mine = sorted(p.path for p in got), sorted(layout.path(i) for i in layout.written_by(rank))
        if paths != mine:
            raise ManifestError(f"{self._where} (table {table_key(self._tables.attempt, rank)}): holds parts "
                                f"{paths[:8]} of the tensor, its layout says {mine[:8]}")
        return {p.path: p for p in got}

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, i: int) -> PartRecord: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[PartRecord]: ...

    def __getitem__(self, i: int | slice) -> PartRecord | Sequence[PartRecord]:
        return self._load()[i]

    def __iter__(self) -> Iterator[PartRecord]:
        return iter(self._load())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __reduce__(self) -> tuple[type, tuple[tuple[PartRecord, ...]]]:
        """Pickled (sent to other ranks) as the parts themselves, read here first."""
        return tuple, (self._load(),)


# A tensor's root fields: dtype, shape, encoding, loss, parts, the ranks whose tables hold them,
# and where its parts lie by rule (None: its root gives no layout).
TensorHead = tuple[str, tuple[int, ...], Encoding, Lossy | None, int, list[int], PartLayout | None]


class Heads:
    """A parsed record's tensors' root fields (:data:`TensorHead`, by key), with what is made of
    them once: each one's place in the root, dimensions, ranks and record without parts. Tensors
    of equal fields share what is made of them (thousands of small tensors have a few); roots of
    the same fields share all of it (a writer's commits of one plan)."""

    def __init__(self, heads: dict[str, TensorHead]):
        owners_of: dict[tuple[int, ...], frozenset[int]] = {}
        records: dict[tuple[Any, ...], TensorRecord] = {}
        self.heads = heads
        self.index = {key: i for i, key in enumerate(heads)}
        self.ndims = [len(h[1]) for h in heads.values()]
        self.owners: list[frozenset[int]] = []
        self.records: list[TensorRecord] = []
        for h in heads.values():
            ranks, fields = tuple(h[5]), h[:4]
            if ranks not in owners_of:
                owners_of[ranks] = frozenset(ranks)
            if fields not in records:
                records[fields] = TensorRecord(h[0], h[1], h[2], (), h[3])
            self.owners.append(owners_of[ranks])
            self.records.append(records[fields])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Heads) and self.heads == other.heads

    __hash__ = None  # type: ignore[assignment]  # compared by value, like the dict it holds


class LazyTensors(Mapping[str, TensorRecord]):
    """A parsed record's tensors by key, each made when first asked for, its parts read from the
    tables on first use (a writer's record is parsed at each commit; most of its thousands of
    tensors may never be asked for)."""

    def __init__(self, heads: Heads, tables: Tables):
        self._heads, self._tables = heads, tables
        self._made: dict[str, TensorRecord] = {}

    def __getitem__(self, key: str) -> TensorRecord:
        rec = self._made.get(key)
        if rec is None:
            h, i = self._heads.heads[key], self._heads.index[key]
            with self._tables.lock:
                rec = self._made.get(key)
                if rec is None:
                    parts = LazyParts(self._tables, i, h[4], self._heads.records[i], h[6], key)
                    rec = self._made[key] = TensorRecord(h[0], h[1], h[2], parts, h[3])
        return rec

    def __contains__(self, key: object) -> bool:  # no record made (Mapping's makes one)
        return key in self._heads.heads

    def __iter__(self) -> Iterator[str]:
        return iter(self._heads.heads)

    def __len__(self) -> int:
        return len(self._heads.heads)

    def idle(self, keys: Iterable[str], like: LazyTensors) -> frozenset[str]:
        """Of ``keys``, those of the tensors this record left as they were in every box (see
        :meth:`LazyParts.untouched`): in a delta's encoding, of the dtype and shape ``like``
        gives them, without a layout. Told of all at once, no record made (a load of thousands
        of tensors asks it of each delta of the chain)."""
        heads, index, owners = self._heads.heads, self._heads.index, self._heads.owners
        want = like._heads.heads
        groups: dict[frozenset[int], list[tuple[str, int, int]]] = {}
        for key in keys:
            h, w = heads.get(key), want.get(key)
            if (h is not None and w is not None and h[6] is None and not h[2].whole
                    and h[0] == w[0] and h[1] == w[1]):
                i = index[key]
                groups.setdefault(owners[i], []).append((key, i, h[4]))
        out: list[str] = []
        for ranks, members in groups.items():
            names, at, counts = zip(*members)
            idle = idle_in([self._tables.table(rank) for rank in ranks], np.array(at), np.array(counts))
            out += [key for key, yes in zip(names, idle.tolist()) if yes]
        return frozenset(out)

    def __reduce__(self) -> tuple[type, tuple[dict[str, TensorRecord]]]:
        """Pickled (sent to other ranks) as a dict of the records, their parts read here first."""
        return dict, (dict(self.items()),)


def lazy_tensors(heads: Heads, attempt: str, listed: dict[int, tuple[int, str]], packs: dict[int, int],
                 read: TableReader, where: str) -> LazyTensors:
    """A parsed record's tensors from their root fields, their parts read from the tables on
    first use."""
    return LazyTensors(heads, Tables(attempt, listed, packs, heads.ndims, heads.owners, read, where))
