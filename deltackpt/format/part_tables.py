"""A rank's part table: the parts of a step that one rank wrote, as packed binary columns.

The root record (:mod:`deltackpt.format.record_io`) names every table with its size and
checksum; a table holds, for each part, its tensor (by index in the root's ``tensors``), path,
changed count, box and chunk shape, and for each chunk its array, grid index, size, checksum and
place in the rank's pack. ``docs/format.md`` lists the columns. Decoding checks every column
with numpy before any part is built, naming the table in a :class:`ManifestError`; the parts
of one tensor are built only when a reader asks for them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ManifestError, StateError
from ..sharding import check_tiling
from . import dtypes
from .layout import pack_name, table_name
from .limits import MAX_METADATA_BYTES, MAX_STEP, chunk_index, coded_size_fits
from .manifest import PartRecord, TensorRecord

if TYPE_CHECKING:
    from .encodings import Array

MAGIC = b"DCKPTAB1"
HEADER = len(MAGIC) + 3 * 8  # the magic, then parts, dims and chunks as uint64
LIMIT = 2**62  # no size, offset, shape or index in a table reaches this
METADATA = -1  # the array index of a part's own zarr.json
# (name, dtype, counted by): the columns in the order they follow the header.
COLUMNS = (
    ("path", "<i8", "parts"), ("changed", "<i8", "parts"), ("nchunks", "<i8", "parts"),
    ("dims", "<i8", "dims"), ("index", "<i8", "chunks"), ("size", "<i8", "chunks"),
    ("at", "<i8", "chunks"), ("hash", "<u8", "chunks"), ("tensor", "<u4", "parts"),
    ("array", "<i2", "chunks"), ("packed", "u1", "parts"), ("cdims", "u1", "parts"),
)


def table_bytes(parts: int, dims: int, chunks: int) -> int:
    """The size of a table of ``parts`` parts, ``dims`` box numbers and ``chunks`` chunks."""
    counts = {"parts": parts, "dims": dims, "chunks": chunks}
    return HEADER + sum(np.dtype(d).itemsize * counts[n] for _, d, n in COLUMNS)


Entry = tuple[int, TensorRecord, PartRecord]  # a part, with its tensor's index in the root record


def encode_table(entries: Sequence[Entry]) -> bytes:
    """The table of one rank's parts, each given with its tensor's index in the root record.

    Raises:
        StateError: a chunk name is none of its part's arrays' (a writer's bug, never stored).
    """
    cols = _columns(entries)
    return _encoded({name: np.array(cols[name], dtype=d) for name, d, _ in COLUMNS})


Dims = tuple[int, ...]  # an offset, shape or chunk shape


class Unchanged:
    """The columns of the table of ``parts`` that hold nothing (a delta's unchanged parts), each
    as its tensor's index in the root, its path, offset, shape and chunk shape, made once:
    :meth:`encode` gives the table of the same parts with some of them changed, at the cost of
    those alone (a delta of thousands of tensors changes a few)."""

    def __init__(self, parts: Sequence[tuple[int, str, Dims, Dims, Dims]]):
        nothing = np.zeros(len(parts), dtype=np.int64)
        dims = [p[2] + p[3] + p[4] for p in parts]
        self.parts = {name: np.array([], dtype=d) for name, d, counted in COLUMNS if counted == "chunks"} | {
            "tensor": np.array([p[0] for p in parts], dtype="<u4"),
            "path": np.array([path_column(p[1]) for p in parts], dtype="<i8"),
            "changed": nothing, "nchunks": nothing, "packed": nothing.astype("u1"),
            "cdims": np.array([len(p[4]) for p in parts], dtype="u1"),
            "dims": np.fromiter(itertools.chain.from_iterable(dims), dtype="<i8"),
        }
        self.dims_at = np.cumsum([0, *map(len, dims)])

    def encode(self, changed: Sequence[tuple[int, Entry]]) -> bytes:
        """The table with the entry each of ``changed`` gives (by position, ascending) in place of
        its unchanged one. Raises as :func:`encode_table`."""
        new = _columns([e for _, e in changed])
        at = [n for n, _ in changed]
        cols = dict(self.parts)
        for name, d, counted in COLUMNS:
            if counted == "parts":
                cols[name] = cols[name].copy()
                cols[name][at] = new[name]
            elif counted == "chunks":  # the unchanged parts have none
                cols[name] = np.array(new[name], dtype=d)
        # The box numbers: the unchanged parts' runs between the changed ones, and theirs.
        old, start = self.parts["dims"], self.dims_at
        dims, k, after = [], 0, 0
        for n, (_, (_, _, part)) in zip(at, changed):
            width = len(part.offset) + len(part.shape) + len(part.chunk_shape)
            dims += [old[start[after]:start[n]], np.array(new["dims"][k:k + width], dtype=np.int64)]
            k, after = k + width, n + 1
        cols["dims"] = np.concatenate([*dims, old[start[after]:]])
        return _encoded(cols)


def _encoded(cols: dict[str, np.ndarray]) -> bytes:
    counts = (len(cols["tensor"]), len(cols["dims"]), len(cols["size"]))
    out = [MAGIC, np.array(counts, dtype="<u8").tobytes()]
    out += [cols[name].astype(d, copy=False).tobytes() for name, d, _ in COLUMNS]
    return b"".join(out)


def _columns(entries: Sequence[Entry]) -> dict[str, list[int]]:
    """Each column's values for ``entries``, in order."""
    cols: dict[str, list[int]] = {name: [] for name, _, _ in COLUMNS}
    # A chunk's array and index follow from its name and its array's folder and rank alone: the
    # same for every part of one encoding and rank, whatever its shape.
    located: dict[tuple[str, int], tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]] = {}
    for index, rec, part in entries:
        cols["tensor"].append(index)
        cols["path"].append(path_column(part.path))
        cols["changed"].append(part.changed)
        cols["packed"].append(part.pack is not None)
        cols["nchunks"].append(len(part.chunks))
        cols["cdims"].append(len(part.chunk_shape))
        cols["dims"] += [*part.offset, *part.shape, *part.chunk_shape]
        if not part.chunks:
            continue
        key = (rec.encoding.name, len(part.shape))
        if key not in located:
            arrays = rec.encoding.arrays(dtypes.from_name(rec.dtype), part.shape, part.chunk_shape, part.changed)
            located[key] = ({a.name: (i, len(a.shape)) for i, a in enumerate(arrays)}, {})
        folders, names = located[key]
        for name, entry in part.chunks.items():
            pair = names.get(name)
            if pair is None:
                pair = names[name] = _locate(folders, name)
            cols["array"].append(pair[0])
            cols["index"].append(pair[1])
            cols["size"].append(entry[0])
            cols["hash"].append(int(entry[1], 16))
            cols["at"].append(entry[2] if len(entry) == 3 else -1)
    return cols


def path_column(path: str) -> int:
    """A part's path in the table: ``p<i>`` as i, the one part ``""`` as -1."""
    return int(path[1:]) if path else -1


def _locate(arrays: dict[str, tuple[int, int]], name: str) -> tuple[int, int]:
    """A chunk's array and grid index (``METADATA``, 0 for the part's ``zarr.json``), given
    each array's index and dimensions by folder."""
    if name == "zarr.json":
        return METADATA, 0
    folder, _, leaf = name.rpartition("/")
    a, ndim = arrays.get(folder, (-1, 0))
    k = chunk_index(leaf, ndim) if a >= 0 else None
    if k is None:
        raise StateError(f"chunk {name!r} is in none of its part's arrays")
    return a, k


# The grids by (shape, chunk shape, changed) and the chunk names by (array, index) of one tensor.
Seen = tuple[dict[tuple[tuple[int, ...], tuple[int, ...], int], "Grid"], dict[tuple[int, int], str]]


@dataclass(frozen=True)
class Grid:
    """The chunk grid of the parts of one shape, chunk shape and changed count."""

    arrays: tuple[Array, ...]
    counts: tuple[int, ...]  # chunks along dimension 0 of each array
    sizes: tuple[int, ...]  # bytes each array's chunk decodes to
    coded: tuple[bool, ...]  # each array's chunks blosc coded

    @classmethod
    def of(cls, rec: TensorRecord, shape: tuple[int, ...], chunk_shape: tuple[int, ...], changed: int) -> Grid:
        arrays = rec.encoding.arrays(dtypes.from_name(rec.dtype), shape, chunk_shape, changed)
        return cls(arrays, tuple(a.chunks for a in arrays), tuple(a.chunk_bytes for a in arrays),
                   tuple(a.coded for a in arrays))

    def problem(self, sparse: bool, pairs: list[tuple[int, int]], sizes: list[int]) -> str | None:
        """Why a part's chunks, as (array, index) pairs of these sizes, are not its grid (every
        chunk of each array, or for a sparse encoding any of them, and at most one ``zarr.json``
        of at most 1 MiB), each of a size that holds its place; None if they are."""
        if any(a.chunk_shape[1:] != a.shape[1:] for a in self.arrays):
            return "its chunk_shape does not span the part's other dimensions"
        if len(set(pairs)) != len(pairs):
            return "a chunk is listed twice"
        data = 0
        for (a, k), size in zip(pairs, sizes):
            if a == METADATA:
                if k != 0 or size > MAX_METADATA_BYTES:
                    return f"its zarr.json entry ({k}, {size} B) is bad"
                continue
            data += 1
            if a >= len(self.arrays) or k >= self.counts[a]:
                return (f"chunk {k} of array {a} is not one of the part's grid "
                        f"({self.counts} chunk(s) of its {len(self.arrays)} arrays)")
            if not (coded_size_fits(size, self.sizes[a]) if self.coded[a] else size == self.sizes[a]):
                return f"chunk {self.arrays[a].chunk(k)!r} of {size} B cannot hold its place in the grid"
        if not sparse and data != sum(self.counts):
            return (f"it lists {data} chunks, its grid has {sum(self.counts)} "
                    f"({self.counts} chunk(s) of its arrays)")
        return None


@dataclass(frozen=True)
class Table:
    """One rank's decoded, checked table: its columns, and where each tensor's parts lie."""

    rank: int
    where: str
    cols: dict[str, np.ndarray]
    dim_at: np.ndarray  # first box number of each part
    chunk_at: np.ndarray  # first chunk of each part
    by_tensor: dict[int, np.ndarray]  # tensor index -> its parts' rows
    idle: np.ndarray  # by tensor index: none of its parts here changed a row or lists a chunk
    held: np.ndarray  # by tensor index: how many of its parts this table holds
    _lists: dict[str, list[int]] = field(default_factory=dict, compare=False, repr=False)

    def columns(self) -> dict[str, list[int]]:
        """The columns as Python lists (made once: a part's few numbers read faster so)."""
        if not self._lists:
            lists = {name: col.tolist() for name, col in self.cols.items()}
            lists |= {"dim_at": self.dim_at.tolist(), "chunk_at": self.chunk_at.tolist()}
            self._lists.update(lists)
        return self._lists

    def parts(self, index: int, rec: TensorRecord, where: str, seen: Seen) -> list[PartRecord]:
        """The parts of tensor ``index`` (recorded as ``rec``) this table holds, each checked:
        its box inside the tensor, its chunk shape fitting its encoding, its chunks its grid
        (see :meth:`Grid.problem`). ``seen``: the grids and chunk names of the tensor's parts
        in other tables, shared by every table the tensor's parts are read from."""
        rows = self.by_tensor.get(index)
        if rows is None:
            return []
        c, n = self.columns(), len(rec.shape)
        pack, label = pack_name(self.rank), f"{where} (table {table_name(self.rank)})"
        grids, names = seen
        out = []
        dims = c["dims"]
        for j in rows.tolist():
            d = c["dim_at"][j]
            offset, shape = tuple(dims[d:d + n]), tuple(dims[d + n:d + 2 * n])
            chunk_shape = tuple(dims[d + 2 * n:d + 2 * n + c["cdims"][j]])
            changed, packed, path = c["changed"][j], c["packed"][j], c["path"][j]
            path = f"p{path}" if path >= 0 else ""
            if any(o + k > s for o, k, s in zip(offset, shape, rec.shape)):
                raise ManifestError(f"{label}: part {path!r}: box at {list(offset)} of {list(shape)} "
                                    f"is outside {list(rec.shape)}")
            sig = (shape, chunk_shape, changed)
            grid = grids.get(sig)
            if grid is None:
                # A chunk spans at least one element along each dimension, but one the part
                # holds none of (an empty tensor's).
                if (any(c < 1 and (i >= len(shape) or shape[i] > 0) for i, c in enumerate(chunk_shape))
                        or not rec.encoding.fits(chunk_shape, shape, changed)):
                    raise ManifestError(f"{label}: part {path!r}: chunk_shape {list(chunk_shape)} does "
                                        f"not fit shape {list(shape)} and encoding {rec.encoding!r}")
                grid = grids[sig] = Grid.of(rec, shape, chunk_shape, changed)
            lo, hi = c["chunk_at"][j], c["chunk_at"][j] + c["nchunks"][j]
            pairs = list(zip(c["array"][lo:hi], c["index"][lo:hi]))
            sizes = c["size"][lo:hi]
            why = grid.problem(rec.encoding.sparse, pairs, sizes)
            if why is not None:
                raise ManifestError(f"{label}: part {path!r} of {list(shape)} by {list(chunk_shape)}: {why}")
            chunks: dict[str, tuple[int, str] | tuple[int, str, int]] = {}
            for pair, size, h, at in zip(pairs, sizes, c["hash"][lo:hi], c["at"][lo:hi]):
                name = names.get(pair)
                if name is None:
                    name = names[pair] = grid.arrays[pair[0]].chunk(pair[1])
                chunks[name] = (size, f"{h:016x}", at) if packed else (size, f"{h:016x}")
            out.append(PartRecord(offset, shape, path, chunk_shape, changed, chunks,
                                  pack if packed else None, self.rank))
        return out


def decode_table(data: bytes, where: str, rank: int, ndims: Sequence[int],
                 pack_room: int | None) -> Table:
    """Decodes and checks a table: its length against its header, every column's range, and
    each part's box numbers and chunks against its tensor's rank (``ndims``, by tensor index)
    and against the rank's pack (``pack_room`` bytes; None: the rank wrote no pack).

    Raises:
        ManifestError: naming ``where`` (the table) and what is wrong.
    """
    if len(data) < HEADER or data[:len(MAGIC)] != MAGIC:
        raise ManifestError(f"{where}: not a part table (bad magic or {len(data)} bytes)")
    parts, dims, chunks = (int(v) for v in np.frombuffer(data, "<u8", 3, len(MAGIC)))
    if max(parts, dims, chunks) > len(data) or len(data) != table_bytes(parts, dims, chunks):
        raise ManifestError(f"{where}: {len(data)} bytes, but its header counts {parts} parts, "
                            f"{dims} box numbers and {chunks} chunks")
    counts = {"parts": parts, "dims": dims, "chunks": chunks}
    cols, at = {}, HEADER
    for name, d, n in COLUMNS:
        cols[name] = np.frombuffer(data, d, counts[n], at)
        at += cols[name].nbytes

    def bad(what: str) -> ManifestError:
        return ManifestError(f"{where}: {what}")

    tensor = cols["tensor"].astype(np.int64)
    if parts and int(tensor.max()) >= len(ndims):
        raise bad(f"a part names tensor {int(tensor.max())} of {len(ndims)}")
    if np.any(cols["path"] < -1) or np.any(cols["path"] >= LIMIT):
        raise bad("a part's path index is out of range")
    if np.any((cols["changed"] < 0) | (cols["changed"] > MAX_STEP)):
        raise bad("a part's changed count is out of range")
    if np.any(cols["packed"] > 1) or (pack_room is None and np.any(cols["packed"])):
        raise bad(f"a part is packed, but {pack_name(rank)} is {'absent' if pack_room is None else 'bad'}")
    if np.any(cols["nchunks"] < 0) or int(cols["nchunks"].sum()) != chunks:
        raise bad(f"its parts' chunk counts do not add up to its {chunks} chunks")
    per_part = (2 * np.asarray(ndims, dtype=np.int64)[tensor] + cols["cdims"]) if parts else np.zeros(0, np.int64)
    if int(per_part.sum()) != dims:
        raise bad(f"its parts' boxes need {int(per_part.sum())} numbers, it holds {dims}")
    for name in ("dims", "index", "size"):
        if np.any((cols[name] < 0) | (cols[name] >= LIMIT)):
            raise bad(f"a {name} value is out of range")
    if np.any(cols["array"] < METADATA):
        raise bad("a chunk's array index is out of range")
    chunk_at = np.concatenate(([0], np.cumsum(cols["nchunks"])[:-1])).astype(np.int64) if parts else np.zeros(0, np.int64)
    packed = np.repeat(cols["packed"].astype(bool), cols["nchunks"])
    at_col, size = cols["at"], cols["size"]
    if np.any(at_col[~packed] != -1) or np.any(at_col[packed] < 0):
        raise bad("a chunk's pack offset disagrees with its part being packed")
    if pack_room is not None and np.any(at_col[packed] + size[packed] > pack_room):
        raise bad(f"a chunk lies outside {pack_name(rank)} ({pack_room} B)")
    order = np.argsort(tensor, kind="stable")
    bounds = np.flatnonzero(np.diff(tensor[order])) + 1
    by_tensor = {int(tensor[g[0]]): g for g in np.split(order, bounds) if len(g)}
    dim_at = np.concatenate(([0], np.cumsum(per_part)[:-1])).astype(np.int64) if parts else np.zeros(0, np.int64)
    idle = np.ones(len(ndims), bool)
    idle[tensor[(cols["changed"] != 0) | (cols["nchunks"] != 0)]] = False
    return Table(rank, where, cols, dim_at, chunk_at, by_tensor, idle, np.bincount(tensor, minlength=len(ndims)))


def idle_in(tables: Sequence[Table], at: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Whether each tensor of index ``at`` is idle in every one of ``tables`` (those of the
    ranks it lists), which hold its ``counts`` parts between them."""
    idle = np.ones(len(at), bool)
    held = np.zeros(len(at), np.int64)
    for table in tables:
        idle &= table.idle[at] & (table.held[at] > 0)
        held += table.held[at]
    return idle & (held == counts)


def check_parts(rec: TensorRecord, where: str) -> None:
    """Checks a tensor's parts together (each was checked on its own as its table gave it):
    paths distinct (``""`` only for a single part) and a whole encoding's parts tiling it."""
    parts = rec.parts
    paths = [p.path for p in parts]
    if len(set(paths)) != len(paths) or ("" in paths and len(paths) > 1):
        raise ManifestError(f"{where}: part paths must be distinct, and '' only for a single part")
    if rec.encoding.whole:
        try:
            check_tiling(where, tuple(rec.shape), [p.box for p in parts])
        except StateError as e:
            raise ManifestError(str(e)) from None
