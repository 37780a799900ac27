"""What a state or a store may hold: tensor keys that are safe file names, and the bounds that
keep reading an untrusted store within what its real files justify.

A store on disk is untrusted input. Tensor keys become folders, so a key component must be a
plain file name (not empty, ``.``, ``..``, ``zarr.json``, nor holding NUL or a lone surrogate),
and a first component must not name a rank's pack or part table (``pack.<n>``, ``parts.<n>``);
the state is refused at ``save`` and a record at parsing. Every number in a record that drives
work or memory is checked against the record itself (a base lists every chunk of its grid, raw
chunks have exactly the size of their rows) and against the real size of each file before a
buffer is sized by it; a coded chunk's header must announce the decoded size its place in the
grid implies before it is decompressed.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from .layout import RANK_FILE

MAX_STEP = 2**63 - 1  # the records' 20-digit names and int64 readers hold no more
MAX_DEPTH = 100  # nodes of a state's skeleton below its root
MAX_RECORD_BYTES = 256 << 20  # a commit record (20,000 tensors take ~6 MB)
MAX_METADATA_BYTES = 1 << 20  # an array's zarr.json
MAX_NAME_BYTES = 255  # a key component, as the file systems' NAME_MAX
BLOSC_HEADER = 16  # bytes of a blosc chunk's header (and its largest overhead)
MAX_RATIO = 256  # LZ4, blosc's codec here, never shrinks data more than 255 times
RESERVED = frozenset({"", ".", "..", "zarr.json"})


def key_problem(key: str) -> str | None:
    """Why the flat tensor key ``key`` cannot name a folder of the store, or None if it can.

    Example:
        >>> key_problem("model/emb.weight") is None, key_problem("a/../b")
        (True, "component '..' is reserved")
        >>> key_problem("pack.0/x"), key_problem("model/pack.0") is None
        ("first component 'pack.0' is reserved (a rank's pack, part table or row hashes)", True)
    """
    first = key.split("/", 1)[0]
    if RANK_FILE.fullmatch(first):
        return f"first component {first!r} is reserved (a rank's pack, part table or row hashes)"
    for part in key.split("/"):
        if part in RESERVED:
            return f"component {part!r} is reserved"
        if "\x00" in part:
            return "a component holds a NUL character"
        try:
            size = len(part.encode("utf-8"))
        except UnicodeEncodeError:
            return "a component holds a lone surrogate"
        if size > MAX_NAME_BYTES:
            return f"a component is {size} bytes long (at most {MAX_NAME_BYTES})"
    return None


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object from its pairs (``json.loads``'s ``object_pairs_hook``), refusing a
    duplicate key: two readers could otherwise take different values from one record."""
    doc = dict(pairs)
    if len(doc) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"duplicate key {dup!r:.80}")
    return doc


def has_surrogate(text: str) -> bool:
    """Whether ``text`` holds a lone surrogate (it cannot be written as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


_CHUNK = re.compile(r"c(?:\.(0|[1-9][0-9]*))?((?:\.0)*)", re.ASCII)


def chunk_index(name: str, ndim: int) -> int | None:
    """The index along dimension 0 of the chunk file ``name`` of an array of ``ndim`` dimensions
    chunked by rows (``c.<i>.0...``, ``c`` for 0-d), or None if ``name`` is no such chunk."""
    m = _CHUNK.fullmatch(name)
    if m is None:
        return None
    if ndim == 0:
        return 0 if name == "c" else None
    if m.group(1) is None or len(m.group(2)) != 2 * (ndim - 1):
        return None
    return int(m.group(1))


def coded_size_fits(size: int, decoded: int) -> bool:
    """Whether a blosc chunk of ``size`` bytes can hold ``decoded`` bytes: at least the header
    and a 256th of the data, at most the data plus the header (blosc stores an incompressible
    chunk as it is)."""
    return BLOSC_HEADER <= size <= decoded + BLOSC_HEADER and decoded <= size * MAX_RATIO


def coded_problem(data: np.ndarray, decoded: int) -> str | None:
    """Why the blosc chunk ``data`` (uint8) must not be decompressed into ``decoded`` bytes, read
    from its header before any decompression, or None if it may."""
    if data.size < BLOSC_HEADER:
        return f"{data.size} bytes are too short for a blosc chunk"
    # The header: version, codec version, flags, type size, then uint32 little-endian
    # decoded bytes, block size and coded bytes.
    nbytes, _, cbytes = (int(v) for v in data[4:BLOSC_HEADER].view("<u4"))
    if cbytes != data.size:
        return f"its header says {cbytes} coded bytes, the chunk has {data.size}"
    if nbytes != decoded:
        return f"decodes to {nbytes} bytes, its place in the array holds {decoded}"
    return None
