"""Row hash files: ``steps/<attempt>/hashes.<rank>``, the hash of every row of the large row-sparse
parts one rank wrote in a base, so that a restore of the base takes the references of the next
delta from them instead of hashing every row it read (``docs/format.md``, "Row hashes").

A file starts with the 8 bytes ``DCKPTRH1`` and a uint64 count ``E`` of entries, then three int64
columns of ``E`` numbers each: ``tensor`` (the tensor's index in the root's ``tensors``), ``path``
(``i`` for the part ``p<i>``, ``-1`` for ``""``) and ``rows``; then, back to back in the entries'
order, each entry's ``rows`` hashes (XXH64 of each row's bytes in the part's columns, as
:func:`deltackpt.kernels.hash_rows` gives them; 8 bytes each, little endian). A file is exactly
``16 + 24 E + 8 sum(rows)`` bytes.

Example:
    >>> data = b"".join(encode_hashes([(0, -1, torch.tensor([7, -8]))]))
    >>> len(data), decode_hashes(data, "f", 1)[(0, -1)].tolist()
    (56, [7, -8])
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from ..errors import ManifestError

MAGIC = b"DCKPTRH1"

HASHED_ROW_BYTES = 512
"""The fewest bytes a row of a part must hold for a base to store its hash: a file adds at most 1/64
to the bytes of the parts it covers. Measured on 2.2 GB of tables (fresh processes alternated,
medians of 8-12): in rows of 512 bytes, a blocking base took 1.067 s with the file against 1.050 s
without, and its restore 0.934 s against 1.053 s; in rows of 128 bytes (a file of 128 MB), the base
took 1.151 s against 0.987 s, and the restore 1.179 s against 1.074 s (the file is read before the
rows, hashing such rows costs less)."""

_MAX = 2**62


def encode_hashes(entries: Sequence[tuple[int, int, torch.Tensor]]) -> list[memoryview]:
    """The file of ``(tensor, path, hashes)`` entries (hashes int64, one a row, contiguous on the
    CPU), in pieces: the hashes are not copied."""
    cols = np.array([(t, p, h.numel()) for t, p, h in entries], dtype="<i8").reshape(-1, 3)
    head = MAGIC + np.array([len(entries)], dtype="<u8").tobytes() + cols.T.tobytes()
    return [memoryview(head), *(h.numpy().astype("<i8", copy=False).data for _, _, h in entries)]


def digest(pieces: Sequence[memoryview]) -> tuple[int, str]:
    """The size and xxh3-64 hex digest of the file ``pieces`` make."""
    h = xxhash.xxh3_64()
    for p in pieces:
        h.update(p)
    return sum(p.nbytes for p in pieces), h.hexdigest()


def decode_hashes(data: bytes | memoryview | np.ndarray, where: str, tensors: int
                  ) -> dict[tuple[int, int], np.ndarray]:
    """The hashes of a file (checked against its checksum already), by ``(tensor, path)``, each an
    int64 array over ``data``; ``tensors``: how many the root lists.

    Raises:
        ManifestError: the file is not one (its length, its counts, a tensor index outside the
            root, a part listed twice).
    """
    buf = np.frombuffer(data, dtype=np.uint8)
    if buf.size < 16 or buf[:8].tobytes() != MAGIC:
        raise ManifestError(f"{where}: not a row hash file (no {MAGIC.decode()} header)")
    count = int(buf[8:16].view("<u8")[0])
    if count > (buf.size - 16) // 24:
        raise ManifestError(f"{where}: {count} entries do not fit its {buf.size} bytes")
    tensor, path, rows = buf[16 : 16 + 24 * count].view("<i8").reshape(3, count)
    if ((tensor < 0) | (tensor >= tensors) | (path < -1) | (path >= _MAX) | (rows < 0) | (rows >= _MAX)).any():
        raise ManifestError(f"{where}: an entry names no part of the record")
    size = 16 + 24 * count + 8 * sum(rows.tolist())
    if size != buf.size:
        raise ManifestError(f"{where}: {buf.size} bytes, where its entries make {size}")
    ends = 16 + 24 * count + 8 * np.cumsum(rows)
    out: dict[tuple[int, int], np.ndarray] = {}
    for t, p, n, end in zip(tensor.tolist(), path.tolist(), rows.tolist(), ends.tolist()):
        if (t, p) in out:
            raise ManifestError(f"{where}: part {p} of tensor {t} is listed twice")
        out[t, p] = buf[end - 8 * n : end].view("<i8")
    return out
