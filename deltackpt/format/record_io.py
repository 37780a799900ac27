"""A commit record as stored: a small JSON root plus one part table per writing rank.

:func:`encode_record` gives the root's bytes and each rank's table; a store writes the tables
(``steps/<attempt>/parts.<rank>``) durably before it creates the root, so the record stays one
create-only write. A parsed record's tensors are read from them as a reader asks (see
:mod:`.lazy_records`).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from json.encoder import encode_basestring_ascii as _string  # json.dumps's, for a key
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from ..collector import paused
from ..errors import ManifestError
from .layout import STEPS, hashes_name, table_name
from .manifest import LOSSY_FORMAT, Manifest, PartRecord, TensorRecord
from .part_layout import PartLayout, describe
from .part_tables import encode_table


def table_key(attempt: str, rank: int) -> str:
    """Where the part table of ``rank`` lies in a step's attempt folder."""
    return f"{STEPS}/{attempt}/{table_name(rank)}"


def hashes_key(attempt: str, rank: int) -> str:
    """Where the row hashes of ``rank``'s base parts lie in a step's attempt folder."""
    return f"{STEPS}/{attempt}/{hashes_name(rank)}"


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
