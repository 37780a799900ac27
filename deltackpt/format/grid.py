"""A part's chunk grid, as a record lists it: which chunks a part must list and what each one's
size may be, so the work and memory a record drives are bounded by the record itself and the
real sizes of its files (see :mod:`deltackpt.format.limits`).

A base part lists every chunk of its grid and a delta part every chunk it reads; a raw chunk
has exactly the bytes of its place in the grid, a coded one at most those plus blosc's header.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..errors import ManifestError
from . import dtypes
from .layout import chunk_key
from .limits import MAX_METADATA_BYTES, chunk_index, coded_size_fits

if TYPE_CHECKING:
    from .manifest import PartRecord, TensorRecord


def chunk_bytes(rec: TensorRecord, part: PartRecord, name: str) -> tuple[int, bool]:
    """The bytes chunk ``name`` of a part decodes to (its rows or elements, padded as stored),
    and whether it is coded (blosc) rather than raw. ``name`` is a chunk of the part's grid."""
    dtype = dtypes.from_name(rec.dtype)
    itemsize = dtype.itemsize
    coded = dtypes.compresses(dtype)
    if rec.encoding == "chunks":
        return part.chunk_shape[0] * itemsize, coded
    if not part.shape:
        return itemsize, coded
    rows = part.chunk_shape[0]
    if name.startswith("ids/"):
        return rows * 8, True  # int64 row ids, coded like every integer array
    if rec.encoding == "qrows":
        return rows * part.chunk_shape[1], False  # raw uint8 rows of chunk_shape[1] bytes
    return rows * math.prod(part.shape[1:]) * itemsize, coded


def check_chunks(rec: TensorRecord, part: PartRecord, where: str) -> None:
    """The part's chunks are the ones its grid needs, each of a size that fits its bytes."""
    ndim = len(part.shape)
    if rec.encoding in ("full", "rows") and part.chunk_shape[1:] != part.shape[1:]:
        raise ManifestError(f"{where}: chunk_shape {list(part.chunk_shape)} must span the part's "
                            f"other dimensions {list(part.shape[1:])}")
    names = set(part.chunks) - {"zarr.json"}
    if rec.encoding == "full":
        n = -(-part.shape[0] // part.chunk_shape[0]) if ndim and math.prod(part.shape) else int(not ndim)
        want = {chunk_key(i, ndim) for i in range(min(n, len(names) + 1))}
    elif rec.encoding in ("rows", "qrows"):
        n = -(-part.changed // part.chunk_shape[0])
        rows = ("rows", ndim) if rec.encoding == "rows" else ("qrows", 2)
        want = {f"{a}/{chunk_key(i, d)}" for i in range(min(n, len(names) + 1))
                for a, d in (("ids", 1), rows)}
    else:
        n = -(-max(1, math.prod(part.shape)) // part.chunk_shape[0])
        want = {name for name in names if (k := chunk_index(name, 1)) is not None and k < n}
    if names != want or (rec.encoding != "chunks" and len(want) != n * (1 + (rec.encoding != "full"))):
        bad = sorted(names - want) or sorted(want - names) or ["(more chunks than listed)"]
        raise ManifestError(f"{where}: chunk {bad[0]!r:.60} is not one of the part's grid "
                            f"({n} chunk(s) of {list(part.chunk_shape)} for {list(part.shape)})")
    for name, entry in part.chunks.items():
        if name == "zarr.json":
            fits = entry[0] <= MAX_METADATA_BYTES
        else:
            decoded, coded = chunk_bytes(rec, part, name)
            fits = coded_size_fits(entry[0], decoded) if coded else entry[0] == decoded
        if not fits:
            raise ManifestError(f"{where}: chunk {name!r} of {entry[0]} B cannot hold its place in "
                                f"the grid ({list(part.chunk_shape)} of {rec.dtype})")


def check_pack(files: dict[str, tuple[int, str]], where: str) -> None:
    """A pack's files are ``c.0`` (or, in earlier stores, ``c.0``, ``c.1``, ... of one size)
    and its ``zarr.json``."""
    data = {f: e for f, e in files.items() if f != "zarr.json"}
    size = data["c.0"][0] if "c.0" in data else 0
    if (set(data) != {f"c.{i}" for i in range(len(data))} or size < 1
            or any(e[0] != size for e in data.values())
            or files.get("zarr.json", (0, ""))[0] > MAX_METADATA_BYTES):
        raise ManifestError(f"{where} must be files c.0, c.1, ... of one size and its zarr.json, "
                            f"got {sorted(files)!r:.120}")
