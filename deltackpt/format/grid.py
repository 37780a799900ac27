"""A part's chunk grid, as a record lists it: which chunks a part must list and what each one's
size may be, so the work and memory a record drives are bounded by the record itself and the
real sizes of its files (see :mod:`deltackpt.format.limits`).

A base part lists every chunk of its grid and a delta part every chunk it reads; a raw chunk
has exactly the bytes of its place in the grid, a coded one at most those plus blosc's header.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ManifestError
from . import dtypes
from .limits import MAX_METADATA_BYTES, chunk_index, coded_size_fits

if TYPE_CHECKING:
    from .encodings import Array
    from .manifest import PartRecord, TensorRecord


def _arrays(rec: TensorRecord, part: PartRecord) -> tuple[Array, ...]:
    return rec.encoding.arrays(dtypes.from_name(rec.dtype), part.shape, part.chunk_shape, part.changed)


def chunk_bytes(rec: TensorRecord, part: PartRecord, name: str) -> tuple[int, bool]:
    """The bytes chunk ``name`` of a part decodes to (its rows or elements, padded as stored),
    and whether it is coded (blosc) rather than raw. ``name`` is a chunk of the part's grid."""
    folder = name.rsplit("/", 1)[0] if "/" in name else ""
    array = {a.name: a for a in _arrays(rec, part)}.get(folder)
    if array is None:
        raise ManifestError(f"chunk {name!r:.60} is in none of the part's arrays")
    return array.chunk_bytes, array.coded


def check_chunks(rec: TensorRecord, part: PartRecord, where: str,
                 arrays: tuple[Array, ...] | None = None) -> None:
    """The part's chunks are the ones its grid needs, each of a size that fits its bytes: every
    chunk of each of its arrays, or for a sparse encoding any chunks of its grid. ``arrays``:
    the part's arrays, if the caller has them."""
    arrays = _arrays(rec, part) if arrays is None else arrays
    if any(a.chunk_shape[1:] != a.shape[1:] for a in arrays):
        raise ManifestError(f"{where}: chunk_shape {list(part.chunk_shape)} must span the part's "
                            f"other dimensions {list(part.shape[1:])}")
    names = set(part.chunks) - {"zarr.json"}
    n = arrays[-1].chunks
    if rec.encoding.sparse:
        want = {name for name in names if any(
            a.chunk(k) == name for a in arrays if (k := chunk_index(name.rsplit("/", 1)[-1], len(a.shape)))
            is not None and k < a.chunks)}
        complete = True
    else:
        # Never more names than listed plus one per array: a record's grid may be huge.
        want = {a.chunk(i) for a in arrays for i in range(min(a.chunks, len(names) + 1))}
        complete = len(want) == sum(a.chunks for a in arrays)
    if names != want or not complete:
        bad = sorted(names - want) or sorted(want - names) or ["(more chunks than listed)"]
        raise ManifestError(f"{where}: chunk {bad[0]!r:.60} is not one of the part's grid "
                            f"({n} chunk(s) of {list(part.chunk_shape)} for {list(part.shape)})")
    by_name = {a.name: a for a in arrays}
    for name, entry in part.chunks.items():
        if name == "zarr.json":
            fits = entry[0] <= MAX_METADATA_BYTES
        else:
            array = by_name[name.rsplit("/", 1)[0] if "/" in name else ""]
            fits = (coded_size_fits(entry[0], array.chunk_bytes) if array.coded
                    else entry[0] == array.chunk_bytes)
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
