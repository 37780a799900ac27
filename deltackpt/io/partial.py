"""Partial loads: some tensors of a step, or some rows of one tensor, read alone.

Selecting tensors reads only their parts of every record of the chain. Selecting rows goes
further: from a base it reads only the row chunks that hold a requested row, from a delta only the
id chunks of the tensor (8 bytes a row) and the row chunks holding a requested row, so reading a
few rows of a large table costs a few chunks per record of the chain, not the table.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Sequence
from functools import partial

import numpy as np
import torch

from ..errors import IntegrityError, KeyMismatchError, StateError
from ..format import dtypes
from ..format.layout import chunk_key
from ..format.manifest import Manifest, PartRecord, TensorRecord
from ..kernels import rowwise
from ..quantization import Rowwise
from .reader import ChainReader, Job


def select_keys(keys: Iterable[str], patterns: Sequence[str]) -> list[str]:
    """The keys that any of ``patterns`` selects, in the order of ``keys``.

    A pattern selects a key equal to it, the keys under it (``model`` selects ``model/emb.weight``)
    and the keys it matches as a shell glob (``model/*.weight``).

    Raises:
        KeyMismatchError: a pattern selects nothing (named as not in the checkpoint).

    Example:
        >>> select_keys(["model/a", "model/b", "optim/x"], ["model"])
        ['model/a', 'model/b']
    """
    if isinstance(patterns, str):
        patterns = [patterns]
    keys = list(keys)
    hits: dict[str, list[str]] = {}
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise StateError(f"a key pattern must be a non-empty str, got {p!r}")
        under = p.rstrip("/") + "/"
        hits[p] = [k for k in keys if k == p or k.startswith(under) or fnmatch.fnmatchcase(k, p)]
    unmatched = [p for p, found in hits.items() if not found]
    if unmatched:
        raise KeyMismatchError([], unmatched)
    chosen = {k for found in hits.values() for k in found}
    return [k for k in keys if k in chosen]


def row_ids(rows: torch.Tensor | Sequence[int] | np.ndarray, shape: tuple[int, ...],
            key: str) -> torch.Tensor:
    """``rows`` as an int64 CPU tensor, checked to be rows of a tensor of ``shape``.

    Raises:
        StateError: ``rows`` is not one-dimensional integers, names a row outside the tensor, or
            the tensor is 0-d.
    """
    if not shape:
        raise StateError(f"{key}: a 0-d tensor has no rows; load it with keys=[{key!r}]")
    nrows = shape[0]
    ids = torch.as_tensor(rows)
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8) or ids.dim() != 1:
        raise StateError(f"{key}: rows must be a 1-d integer tensor, got {ids.dtype} of shape "
                         f"{list(ids.shape)}")
    ids = ids.to("cpu", torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= nrows):
        bad = ids[(ids < 0) | (ids >= nrows)][0]
        raise StateError(f"{key}: row {int(bad)} is outside the tensor's {nrows} rows")
    return ids


class RowReader(ChainReader):
    """Reads chosen rows of one tensor along a chain (see :class:`ChainReader` for the arguments).

    Example:
        >>> import tempfile, torch
        >>> from deltackpt import Checkpointer
        >>> with Checkpointer(tempfile.mkdtemp()) as ckpt:
        ...     _ = ckpt.save(1, {"emb": torch.arange(12.).view(6, 2)})
        ...     ckpt.load(1, key="emb", rows=[4, 1]).tolist()
        [[8.0, 9.0], [2.0, 3.0]]
    """

    def read_rows(self, key: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64, any order, repeats allowed, checked by :func:`row_ids`) of
        ``key``'s value at the chain's last step, as a tensor of ``len(ids)`` rows."""
        rec = self._record(key)
        uniq, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        dest = torch.empty((uniq.numel(), *rec.shape[1:]), dtype=dtypes.from_name(rec.dtype))
        for m in self._chain:
            r = m.tensors.get(key)
            if r is None or r.dtype != rec.dtype or r.shape != rec.shape:
                raise IntegrityError(m.step, key, "the tensor is missing, or its dtype or shape "
                                     "differs along the chain")
            jobs: list[Job] = []
            for part in r.parts:
                a = int(torch.searchsorted(uniq, part.offset[0]))
                b = int(torch.searchsorted(uniq, part.offset[0] + part.shape[0]))
                if a < b:
                    jobs += self._part_jobs(m, key, r, part, uniq, a, dest)
            self._run(jobs)
        return dest[inverse] if uniq.numel() != ids.numel() or not torch.equal(uniq, ids) else dest

    def _record(self, key: str) -> TensorRecord:
        rec = self._chain[-1].tensors.get(key)
        if rec is None:
            raise KeyMismatchError([], [key])
        return rec

    def _part_jobs(self, m: Manifest, key: str, rec: TensorRecord, part: PartRecord,
                   uniq: torch.Tensor, a: int, dest: torch.Tensor) -> list[Job]:
        """Jobs copying the requested rows ``uniq[a:]`` that lie in ``part`` into ``dest``."""
        p0, pn = part.offset[0], part.shape[0]
        b = int(torch.searchsorted(uniq, p0 + pn))
        local = uniq[a:b] - p0  # requested rows within the part, sorted
        cols = tuple(slice(o, o + n) for o, n in zip(part.offset[1:], part.shape[1:]))
        rest = part.shape[1:]
        row_bytes = int(np.prod(rest, dtype=np.int64)) * dest.element_size()
        dim = len(rec.shape)
        decode = None
        if rec.encoding in ("rows", "qrows"):
            stored = self._ids_of(m, key, part)
            at = torch.searchsorted(stored, local + p0)
            hit = at < stored.numel()
            hit[hit.clone()] = stored[at[hit]] == local[hit] + p0
            where = torch.nonzero(hit).flatten() + a  # positions in dest
            at = at[hit]  # positions in the delta's rows
            folder, size = "rows/", part.chunk_shape[0]
            if rec.encoding == "qrows":
                folder, dim, decode = "qrows/", 2, quantized_rows(m, key, rec, part, dest.dtype)
        else:  # "full" (rows by chunk) and "chunks" (a 1-d tensor's elements by chunk)
            where, at = torch.arange(a, b), local
            folder, size = "", part.chunk_shape[0]
            if rec.encoding == "chunks":
                dim, row_bytes = 1, dest.element_size()
        groups = at // size
        jobs: list[Job] = []
        for g in torch.unique(groups).tolist():
            name = f"{folder}{chunk_key(g, dim)}"
            if rec.encoding == "chunks" and name not in part.chunks:
                continue  # a dense chunk this delta did not change
            sel = groups == g

            def copy(buf: torch.Tensor, src=at[sel] - g * size, dst=where[sel]) -> None:
                if decode is not None:
                    dest[(dst, *cols)] = decode(buf, src).view(len(src), *rest)
                    return
                rows = buf[: size * row_bytes].view(dest.dtype).view(size, *rest)
                dest[(dst, *cols)] = rows[src]

            nbytes = size * (part.chunk_shape[1] if decode is not None else row_bytes)
            jobs.append(partial(self._staged, m, key, part, name, torch.uint8 if decode else dest.dtype,
                                nbytes, copy, uncoded=decode is not None))
        return jobs


def quantized_rows(m: Manifest, key: str, rec: TensorRecord, part: PartRecord,
                   dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """For a ``qrows`` part: a function decoding rows ``at`` (positions within one chunk) of a
    chunk's bytes to ``dtype``, flat per row.

    Raises:
        IntegrityError: the part's row width does not fit its quantization scheme.
    """
    rule = Rowwise.from_scheme(rec.lossy.scheme if rec.lossy else None)
    cr, qbytes = part.chunk_shape
    width = int(np.prod(part.shape[1:], dtype=np.int64))
    if qbytes != rowwise.row_bytes(width, rule.bits, rule.scale_dtype):
        raise IntegrityError(m.step, f"{key} part {part.path!r}",
                             f"quantized rows of {qbytes} B do not fit {width} elements at {rule.scheme}")

    def decode(buf: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        packed = buf[: cr * qbytes].view(cr, qbytes)[at]
        return rowwise.dequantize_rows(packed, rule.bits, width, dtype, scale_dtype=rule.scale_dtype)

    return decode
