"""A rank's part table: the parts of a step that one rank wrote, as packed binary columns.

The root record (:mod:`deltackpt.format.record_io`) names every table with its size and
checksum; a table holds, for each part, its tensor (by index in the root's ``tensors``), path,
changed count, box and chunk shape, and for each chunk its array, grid index, size, checksum and
place in the rank's pack. ``docs/format.md`` lists the columns. Decoding checks every column
with numpy before any part is built, naming the table in a :class:`ManifestError`; the parts
of one tensor are built only when a reader asks for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ManifestError, StateError
from ..sharding import check_tiling
from . import dtypes
from .grid import check_chunks
from .layout import pack_name
from .limits import MAX_STEP, chunk_index
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


def encode_table(entries: list[tuple[int, TensorRecord, PartRecord]]) -> bytes:
    """The table of one rank's parts, each given with its tensor's index in the root record.

    Raises:
        StateError: a chunk name is none of its part's arrays' (a writer's bug, never stored).
    """
    cols: dict[str, list[int]] = {name: [] for name, _, _ in COLUMNS}
    folders: dict[tuple[str, str, tuple[int, ...], tuple[int, ...], int], dict[str, tuple[int, int]]] = {}
    for index, rec, part in entries:
        cols["tensor"].append(index)
        cols["path"].append(int(part.path[1:]) if part.path else -1)
        cols["changed"].append(part.changed)
        cols["packed"].append(part.pack is not None)
        cols["nchunks"].append(len(part.chunks))
        cols["cdims"].append(len(part.chunk_shape))
        cols["dims"] += [*part.offset, *part.shape, *part.chunk_shape]
        if not part.chunks:
            continue
        sig = (rec.encoding.name, rec.dtype, part.shape, part.chunk_shape, part.changed)
        if sig not in folders:
            arrays = rec.encoding.arrays(dtypes.from_name(rec.dtype), part.shape, part.chunk_shape, part.changed)
            folders[sig] = {a.name: (i, len(a.shape)) for i, a in enumerate(arrays)}
        where = folders[sig]
        for name, entry in part.chunks.items():
            a, k = _locate(where, name)
            cols["array"].append(a)
            cols["index"].append(k)
            cols["size"].append(entry[0])
            cols["hash"].append(int(entry[1], 16))
            cols["at"].append(entry[2] if len(entry) == 3 else -1)
    counts = (len(cols["tensor"]), len(cols["dims"]), len(cols["size"]))
    out = [MAGIC, np.array(counts, dtype="<u8").tobytes()]
    out += [np.array(cols[name], dtype=d).tobytes() for name, d, _ in COLUMNS]
    return b"".join(out)


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


@dataclass(frozen=True)
class Table:
    """One rank's decoded, checked table: its columns, and where each tensor's parts lie."""

    rank: int
    where: str
    cols: dict[str, np.ndarray]
    dim_at: np.ndarray  # first box number of each part
    chunk_at: np.ndarray  # first chunk of each part
    by_tensor: dict[int, np.ndarray]  # tensor index -> its parts' rows

    def parts(self, index: int, rec: TensorRecord, where: str) -> list[PartRecord]:
        """The parts of tensor ``index`` (recorded as ``rec``) this table holds, each checked
        against its grid (see :func:`deltackpt.format.grid.check_chunks`)."""
        rows = self.by_tensor.get(index)
        if rows is None:
            return []
        c, n = self.cols, len(rec.shape)
        dtype = dtypes.from_name(rec.dtype)
        pack = pack_name(self.rank)
        grids: dict[tuple[tuple[int, ...], tuple[int, ...], int], tuple[Array, ...]] = {}
        names: dict[tuple[int, int], str] = {(METADATA, 0): "zarr.json"}
        out = []
        for i in rows.tolist():
            d = int(self.dim_at[i])
            box = c["dims"][d:d + 2 * n + int(c["cdims"][i])].tolist()
            offset, shape, chunk_shape = tuple(box[:n]), tuple(box[n:2 * n]), tuple(box[2 * n:])
            changed, packed = int(c["changed"][i]), bool(c["packed"][i])
            lo, hi = int(self.chunk_at[i]), int(self.chunk_at[i] + c["nchunks"][i])
            sig = (shape, chunk_shape, changed)
            if sig not in grids:
                if any(s < 1 for s in chunk_shape) or not rec.encoding.fits(chunk_shape, shape, changed):
                    raise ManifestError(f"{self.where}: a part of tensor {index} has chunk_shape "
                                        f"{list(chunk_shape)}, which does not fit shape {list(shape)}")
                grids[sig] = rec.encoding.arrays(dtype, shape, chunk_shape, changed)
                names = {(METADATA, 0): "zarr.json"}
            grid = grids[sig]
            chunks: dict[str, tuple[int, str] | tuple[int, str, int]] = {}
            for a, k, size, h, at in zip(c["array"][lo:hi].tolist(), c["index"][lo:hi].tolist(),
                                         c["size"][lo:hi].tolist(), c["hash"][lo:hi].tolist(),
                                         c["at"][lo:hi].tolist()):
                name = names.get((a, k))
                if name is None:
                    if a >= len(grid) or a == METADATA:
                        raise ManifestError(f"{self.where}: a chunk of tensor {index} names array {a} "
                                            f"of {len(grid)}")
                    name = names[(a, k)] = grid[a].chunk(k)
                chunks[name] = (size, f"{h:016x}", at) if packed else (size, f"{h:016x}")
            path = f"p{c['path'][i]}" if c["path"][i] >= 0 else ""
            part = PartRecord(offset, shape, path, chunk_shape, changed, chunks,
                              pack if packed else None, self.rank)
            if any(o + k > s for o, k, s in zip(offset, shape, rec.shape)):
                raise ManifestError(f"{where} (table parts.{self.rank}): a part's box at "
                                    f"{list(offset)} of {list(shape)} is outside {list(rec.shape)}")
            check_chunks(rec, part, f"{where} part {path or '(whole)'} (table parts.{self.rank})", grid)
            out.append(part)
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
    return Table(rank, where, cols, dim_at, chunk_at, by_tensor)


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
