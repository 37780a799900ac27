"""A commit record as stored: a small JSON root plus one part table per writing rank.

:func:`encode_record` gives the root's bytes and each rank's table; a store writes the tables
(``steps/<attempt>/parts.<rank>``) durably before it creates the root, so the record stays one
create-only write. A parsed record's tensors hold :class:`LazyParts`: a tensor's parts are read
(only the tables of the ranks that wrote it, each once), checked and built when a reader first
asks for them, so ``ls`` reads roots only and a partial load reads the tables it needs.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import replace
from json.encoder import encode_basestring_ascii as _string  # json.dumps's, for a key
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import xxhash

from ..collector import paused
from ..errors import ManifestError
from ..sharding import Box
from .layout import STEPS, table_name
from .lossy import Lossy
from .encodings import Encoding
from .manifest import LOSSY_FORMAT, Manifest, PartRecord, TensorRecord
from .part_layout import PartLayout, describe
from .part_tables import METADATA, Seen, Table, check_parts, decode_table, encode_table

# Reads a rank's table (its key, size and checksum as the root records them), checked.
TableReader = Callable[[str, int, str], bytes]


def table_key(attempt: str, rank: int) -> str:
    """Where the part table of ``rank`` lies in a step's attempt folder."""
    return f"{STEPS}/{attempt}/{table_name(rank)}"


def checksum(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


# A root's last field: the checksum of its text without that field (see docs/format.md).
_SEALED = re.compile(rb',"checksum":"([0-9a-f]{16})"}')
_SEAL_BYTES = len(b',"checksum":"') + 16 + len(b'"}')


def seal(root: bytes) -> bytes:
    """``root``, a JSON object's text, with its ``checksum`` field appended last."""
    return root[:-1] + b',"checksum":"' + checksum(root).encode() + b'"}'


def check_seal(data: bytes, where: str) -> None:
    """Checks the text of a root whose object has a ``checksum`` field against it.

    Raises:
        ManifestError: the field is not the text's last one, or the text does not match it.
    """
    sealed = _SEALED.fullmatch(data, max(0, len(data) - _SEAL_BYTES))
    if sealed is None:
        raise ManifestError(f"{where}: field 'checksum' must end the record as "
                            "',\"checksum\":\"<16 hex digits>\"}'")
    if checksum(data[:-_SEAL_BYTES] + b"}") != sealed[1].decode():
        raise ManifestError(f"{where}: the record does not match its checksum (damaged)")


@paused()
def encode_record(m: Manifest) -> tuple[bytes, dict[int, bytes]]:
    """The root record's bytes and each writing rank's part table."""
    index = {key: i for i, key in enumerate(m.tensors)}
    by_rank: dict[int, list[tuple[int, TensorRecord, PartRecord]]] = {}
    held: dict[str, tuple[int, list[int], PartLayout | None]] = {}
    for key, rec in m.tensors.items():
        for part in rec.parts:
            by_rank.setdefault(part.rank, []).append((index[key], rec, part))
        held[key] = (len(rec.parts), sorted({p.rank for p in rec.parts}), layout_of(rec.shape, rec.parts))
    tables = {rank: encode_table(entries) for rank, entries in sorted(by_rank.items())}
    return encode_root(m, {rank: (len(data), checksum(data)) for rank, data in tables.items()}, held), tables


def layout_of(shape: Sequence[int], parts: Sequence[PartRecord]) -> PartLayout | None:
    """The layout of a tensor's parts (see :mod:`deltackpt.format.part_layout`), if they
    follow one: listed by path, ``p0``, ``p1``, ... or the one part ``""``."""
    paths = [p.path for p in parts]
    if paths != ([""] if len(parts) == 1 else [f"p{i}" for i in range(len(parts))]):
        return None
    return describe(shape, [p.box for p in parts], [p.rank for p in parts])


def encode_root(m: Manifest, tables: Mapping[int, tuple[int, str]],
                held: Mapping[str, tuple[int, Sequence[int], PartLayout | None]], *,
                encoded: Mapping[str, str] | None = None) -> bytes:
    """The root record of ``m``, whose part tables (by writing rank, their size and checksum)
    are ``tables``; ``held`` gives each tensor's part count, the sorted ranks whose tables
    hold its parts and their layout, if any (``m``'s parts are not read: a save's coordinator
    never holds them). ``encoded``: fields already encoded (``tree``, and ``tensors`` as
    :func:`tensor_entries` encodes them), which ``m``'s own fields are not read for."""
    fields = dict(encoded or {})
    if "tree" not in fields:
        fields["tree"] = _dumps(m.tree)
    if "tensors" not in fields:
        fields["tensors"] = tensor_entries(m.tensors, held)
    doc = replace(m, tensors={}, tree={}).root_doc()
    if m.format == LOSSY_FORMAT:
        doc["lossy"] = m.lossy
    doc["tables"] = [[rank, size, digest] for rank, (size, digest) in sorted(tables.items())]
    # What json.dumps makes of ``doc`` with those fields' values in place, sealed.
    return seal(("{" + ",".join(f"{_dumps(k)}:{fields[k] if k in fields else _dumps(v)}"
                                for k, v in doc.items()) + "}").encode())


def tensor_entries(tensors: Mapping[str, TensorRecord],
                   held: Mapping[str, tuple[int, Sequence[int], PartLayout | None]]) -> str:
    """The root's ``tensors`` field, encoded: each tensor's root fields, with its part count,
    ranks and layout from ``held`` (see :func:`encode_root`), as ``json.dumps`` encodes them.
    Tensors of equal fields without a layout share their encoding (thousands of small tensors
    have a few)."""
    made: dict[tuple[Any, ...], str] = {}
    out = []
    for key, t in tensors.items():
        parts, ranks, layout = held[key]
        at = (t.dtype, t.shape, t.encoding.name, t.lossy, parts, tuple(ranks)) if layout is None else None
        entry = made.get(at) if at is not None else None
        if entry is None:
            doc = t.root_doc() | {"parts": parts, "ranks": _ranges(ranks)}
            if layout is not None:
                doc["layout"] = layout.to_doc()
            entry = _dumps(doc)
            if at is not None:
                made[at] = entry
        out.append(f"{_string(key)}:{entry}")
    return "{" + ",".join(out) + "}"


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def _ranges(ranks: Sequence[int]) -> list[list[int]]:
    """Sorted ranks as ``[first, last]`` runs: a tensor every rank wrote takes one."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return runs


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

    def __iter__(self) -> Iterator[str]:
        return iter(self._heads.heads)

    def __len__(self) -> int:
        return len(self._heads.heads)

    def __reduce__(self) -> tuple[type, tuple[dict[str, TensorRecord]]]:
        """Pickled (sent to other ranks) as a dict of the records, their parts read here first."""
        return dict, (dict(self.items()),)


def lazy_tensors(heads: Heads, attempt: str, listed: dict[int, tuple[int, str]], packs: dict[int, int],
                 read: TableReader, where: str) -> LazyTensors:
    """A parsed record's tensors from their root fields, their parts read from the tables on
    first use."""
    return LazyTensors(heads, Tables(attempt, listed, packs, heads.ndims, heads.owners, read, where))
