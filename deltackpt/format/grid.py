"""A part's chunk sizes and a pack's files, as a record lists them, so the work and memory a
record drives are bounded by the record itself and the real sizes of its files (see
:mod:`deltackpt.format.limits`; a part table's grid checks are
:class:`deltackpt.format.part_tables.Grid`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ManifestError
from . import dtypes
from .limits import MAX_METADATA_BYTES

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
