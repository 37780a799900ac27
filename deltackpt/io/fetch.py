"""Reading a stored chunk or file, checked against its commit record before its bytes are used.

A chunk is a file of its part's folder, or (in a delta, or for a base's small part) a byte range
of its step's pack, which may span several of the pack's files. Sizes are checked before anything
is allocated for them, and every byte read is checked against the record's xxh3-64 checksum.
"""

from __future__ import annotations

import torch
import xxhash

from ..errors import IntegrityError, MissingChunkError
from ..format.layout import STEPS, chunk_key, chunk_path
from ..format.manifest import Entry, Manifest, PartRecord
from ..storage import Storage


def _pack_files(m: Manifest, pack: str, at: int, size: int) -> list[tuple[str, int, int]]:
    """The files of a pack that bytes ``[at, at + size)`` lie in: (name, offset there, bytes)."""
    chunk = m.pack_chunk(pack)
    out = []
    while size > 0:
        i, within = divmod(at, chunk)
        n = min(size, chunk - within)
        out.append((chunk_key(i, 1), within, n))
        at, size = at + n, size - n
    return out


def _check_size(step: int, path: str, entry: Entry | None, size: int | None) -> int:
    """``size`` (None: the file is absent) once it is the recorded one."""
    if entry is None or size is None:
        raise MissingChunkError(step, path)
    if size != entry[0]:
        raise IntegrityError(step, path, f"{size} bytes on disk, the record says {entry[0]}")
    return size


def file_size(storage: Storage, step: int, path: str, entry: Entry | None) -> int:
    """The recorded size of a file, once the file is known to have it, so no allocation is
    driven by a number read from a damaged record."""
    return _check_size(step, path, entry, storage.size(path))


def stored_size(storage: Storage, m: Manifest, key: str, part: PartRecord, name: str,
                sized: set[str] | None = None) -> int:
    """The recorded size of a chunk, once its file (or the files of its pack) have theirs.
    ``sized``: pack files found to have their size already, skipped and added to (a pack holds
    the chunks of thousands of small parts)."""
    entry = part.chunks.get(name)
    if part.pack is None or entry is None or len(entry) != 3:
        return file_size(storage, m.step, chunk_path(m, key, part, name), entry)
    folder = f"{STEPS}/{m.attempt}/{part.pack}"
    for file, _, _ in _pack_files(m, part.pack, entry[2], entry[0]):
        path = f"{folder}/{file}"
        if sized is None or path not in sized:
            file_size(storage, m.step, path, m.packs[part.pack].get(file))
            if sized is not None:
                sized.add(path)
    return entry[0]


def fetch(storage: Storage, m: Manifest, key: str, part: PartRecord, name: str,
          into: torch.Tensor) -> None:
    """Reads chunk ``name`` of a part into ``into`` (uint8, exactly the recorded size) and checks
    it against the record.

    Raises:
        MissingChunkError: the record lists no such chunk, or the file is gone.
        IntegrityError: the file's size or checksum differs from the record.
    """
    entry = part.chunks.get(name)
    if part.pack is None or entry is None or len(entry) != 3:
        fetch_file(storage, m.step, chunk_path(m, key, part, name), entry, into)
        return
    view = into.numpy().data
    folder = f"{STEPS}/{m.attempt}/{part.pack}"
    done = 0
    for file, within, n in _pack_files(m, part.pack, entry[2], entry[0]):
        path = f"{folder}/{file}"
        try:
            got = storage.read_into(path, view[done : done + n], within)
        except FileNotFoundError:
            got = None
        _check_size(m.step, path, m.packs[part.pack].get(file), got)
        done += n
    if xxhash.xxh3_64_hexdigest(view) != entry[1]:
        raise IntegrityError(m.step, chunk_path(m, key, part, name), "checksum mismatch")


def fetch_file(storage: Storage, step: int, path: str, entry: Entry | None, into: torch.Tensor) -> None:
    """Reads the file ``path`` into ``into`` (uint8, exactly the recorded size) and checks it
    against its record ``entry`` (None: the record lists no such file)."""
    if entry is None:
        raise MissingChunkError(step, path)
    view = into.numpy().data
    try:
        got = storage.read_into(path, view)
    except FileNotFoundError:
        got = None
    _check_size(step, path, entry, got)
    if xxhash.xxh3_64_hexdigest(view) != entry[1]:
        raise IntegrityError(step, path, "checksum mismatch")


def fetch_file_in_pieces(storage: Storage, step: int, path: str, entry: Entry | None,
                         buf: torch.Tensor) -> None:
    """As :func:`fetch_file`, for a file of any size: reads it through ``buf`` (uint8, any size
    from one byte on) a piece at a time."""
    if entry is None:
        raise MissingChunkError(step, path)
    view = buf.numpy().data
    h = xxhash.xxh3_64()
    at = 0
    while True:
        try:
            got = storage.read_into(path, view, at)
        except FileNotFoundError:
            got = None
        size = _check_size(step, path, entry, got)
        n = min(len(view), size - at)
        h.update(view[:n])
        at += n
        if at >= size:
            break
    if h.hexdigest() != entry[1]:
        raise IntegrityError(step, path, "checksum mismatch")
