"""A torch.save file written from a step tensor by tensor, without holding the state.

Two passes: ``torch.save`` of the state with empty tensors under ``torch.serialization.skip_data``
lays out the zip (its ``data.pkl``, and a record of the right size per storage, left as a hole),
with each record's data on a 4 KiB boundary; then each tensor's bytes are streamed into its record,
whole 4 KiB blocks past the page cache where the file system allows, and the zip's CRC-32 fields
are set to match, so any zip reader accepts the file and ``torch.load(weights_only=True)`` reads it.
"""

from __future__ import annotations

import errno
import os
import struct
import zipfile
import zlib
from typing import Any

import torch

from .. import statetree
from ..errors import ConvertError
from ..storage.direct import BLOCK

DIRECT_MIN = 1 << 20


def write_torch(src: Any, path: str) -> None:
    """Writes the selection of ``src`` (an export source) as a new torch.save file ``path``."""
    from torch.utils.serialization import config

    # Never touched (skip_data writes no storage bytes), so these take address space, not memory.
    fakes = {k: torch.empty(src.snap.shape(k), dtype=src.dtype(k)) for k in src.sel.names}
    if src.sel.tree is None:
        obj: Any = {src.sel.names[k]: fakes[k] for k in src.sel.names}
    else:
        obj = statetree.build(src.sel.tree, fakes)
    # torch.save names storages "0", "1", ... as pickling meets them: depth first, in order.
    order = _pickle_order(obj, {id(v): k for k, v in fakes.items()})
    alignment = config.save.storage_alignment
    config.save.storage_alignment = BLOCK
    try:
        with torch.serialization.skip_data():
            torch.save(obj, path)
    finally:
        config.save.storage_alignment = alignment
    del obj, fakes
    with zipfile.ZipFile(path) as z:
        records = {i.filename.split("/", 1)[1]: i for i in z.infolist() if "/" in i.filename}
        central = z.start_dir
    crcs: dict[str, int] = {}
    with open(path, "r+b", buffering=0) as f, _Direct(path) as direct:
        for i, key in enumerate(order):
            info = records.get(f"data/{i}")
            if info is None or info.file_size != src.nbytes(key):
                raise ConvertError(f"{key}: torch.save laid out storage {i} unlike the state "
                                   f"({None if info is None else info.file_size} B)")
            f.seek(info.header_offset + 26)
            name_len, extra_len = struct.unpack("<HH", f.read(4))
            at = info.header_offset + 30 + name_len + extra_len
            crc = 0
            for block in src.blocks(key, reuse=True):
                data = memoryview(block.reshape(-1).view(torch.uint8).numpy().data)
                direct.pwrite(f.fileno(), data, at)
                at += len(data)
                crc = zlib.crc32(data, crc)
            crcs[info.filename] = crc
            os.pwrite(f.fileno(), struct.pack("<I", crc), info.header_offset + 14)
        _patch_central_crcs(f, central, crcs)
        f.flush()
        os.fsync(f.fileno())


class _Direct:
    """A second descriptor of the file opened with ``O_DIRECT`` (None where refused)."""

    def __init__(self, path: str):
        self._fd: int | None = None
        flag = getattr(os, "O_DIRECT", 0)
        if flag:
            try:
                self._fd = os.open(path, os.O_WRONLY | flag)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise

    def pwrite(self, fd: int, data: memoryview, at: int) -> None:
        """Writes ``data`` at ``at``: whole aligned blocks through ``O_DIRECT``, the rest through
        the buffered descriptor ``fd``."""
        n = 0
        address = torch.frombuffer(data, dtype=torch.uint8).data_ptr() if len(data) else 0
        if self._fd is not None and at % BLOCK == 0 and address % BLOCK == 0 and len(data) >= DIRECT_MIN:
            n = len(data) // BLOCK * BLOCK
            try:
                _pwrite_all(self._fd, data[:n], at)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                os.close(self._fd)
                self._fd, n = None, 0
        _pwrite_all(fd, data[n:], at + n)

    def __enter__(self) -> _Direct:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)


def _pwrite_all(fd: int, data: memoryview, at: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, at)
        data, at = data[n:], at + n


def _pickle_order(obj: Any, ids: dict[int, str]) -> list[str]:
    if id(obj) in ids:
        return [ids[id(obj)]]
    if isinstance(obj, dict):
        return [k for v in obj.values() for k in _pickle_order(v, ids)]
    if isinstance(obj, (list, tuple)):
        return [k for v in obj for k in _pickle_order(v, ids)]
    return []


def _patch_central_crcs(f: Any, at: int, crcs: dict[str, int]) -> None:
    """Sets the CRC-32 of the central directory entries named in ``crcs``."""
    left = len(crcs)
    while left:
        f.seek(at)
        head = f.read(46)
        if head[:4] != b"PK\x01\x02":
            raise ConvertError("torch.save wrote a zip this export cannot patch")
        name_len, extra_len, comment_len = struct.unpack("<HHH", head[28:34])
        name = f.read(name_len).decode()
        if name in crcs:
            f.seek(at + 16)
            f.write(struct.pack("<I", crcs[name]))
            left -= 1
        at += 46 + name_len + extra_len + comment_len
