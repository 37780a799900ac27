"""Finding what changed since the last commit, exactly, from content hashes.

Tensors with two or more dimensions are row-sparse: a 64-bit hash per row (along dimension 0)
finds changed rows. Others (0-d, 1-d) are dense: a hash per fixed-size chunk of their bytes finds
changed chunks. Hashes compare bits, so a row holding the same NaN payload is unchanged and
``-0.0`` differs from ``0.0``. A change goes unseen only on a 64-bit hash collision (XXH64,
probability about 2^-64 per changed row or chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels


def is_row_sparse(t: torch.Tensor) -> bool:
    return t.dim() >= 2


@dataclass(frozen=True)
class TensorChange:
    """What changed in one tensor.

    Attributes:
        hashes: the tensor's hashes now (per row or per chunk), on the CPU.
        changed: sorted changed row ids or chunk indices (int64), or None when there is nothing
            to compare with (a new tensor, or a new dtype or shape): the tensor must be written whole.
    """

    hashes: torch.Tensor
    changed: torch.Tensor | None


class ChangeTracker:
    """Hashes of every tensor as of the last commit.

    Args:
        dense_chunk_bytes: chunk size for dense tensors' hashes and delta chunks.
    """

    def __init__(self, dense_chunk_bytes: int):
        self.dense_chunk_bytes = dense_chunk_bytes
        self._hashes: dict[str, tuple[torch.dtype, tuple[int, ...], torch.Tensor]] = {}

    def chunk_elems(self, t: torch.Tensor) -> int:
        """Elements per dense chunk of ``t``: one chunk for a tensor smaller than a chunk, so a
        small tensor's delta is not padded to the full chunk size."""
        return max(1, min(t.numel(), self.dense_chunk_bytes // t.element_size()))

    def hash(self, t: torch.Tensor) -> torch.Tensor:
        if is_row_sparse(t):
            return kernels.hash_rows(t).cpu()
        return kernels.hash_chunks(t, self.chunk_elems(t) * t.element_size()).cpu()

    def scan(self, tensors: dict[str, torch.Tensor]) -> dict[str, TensorChange]:
        """Hashes every tensor and compares with the last commit."""
        out = {}
        for key, t in tensors.items():
            h = self.hash(t)
            prev = self._hashes.get(key)
            if prev is None or prev[0] != t.dtype or prev[1] != tuple(t.shape):
                out[key] = TensorChange(h, None)
            else:
                out[key] = TensorChange(h, (h != prev[2]).nonzero().flatten())
        return out

    def adopt(self, tensors: dict[str, torch.Tensor], changes: dict[str, TensorChange]) -> None:
        """Makes the scanned hashes the reference, after the save that used them committed."""
        self._hashes = {
            k: (t.dtype, tuple(t.shape), changes[k].hashes) for k, t in tensors.items()
        }

    def reset(self, tensors: dict[str, torch.Tensor]) -> None:
        """Takes ``tensors`` (just restored) as the reference."""
        self.adopt(tensors, {k: TensorChange(self.hash(t), None) for k, t in tensors.items()})

    def keys(self) -> set[str]:
        return set(self._hashes)
