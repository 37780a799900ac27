"""A committed step opened for streaming reads, tensor by tensor and block of rows by block.

What export and the other tools that write a step elsewhere share: which tensors to take (keys,
a subtree), the names they get outside (the dotted paths PyTorch state dicts use), and reads in
row blocks of a bounded size, so a tool holds one block of one tensor at a time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from .. import statetree
from ..errors import ConvertError
from ..format import dtypes
from ..format.manifest import Manifest
from ..io.partial import select_keys
from ..io.reader import ChainReader
from ..sharding import Box
from ..io.staging import StagingPool
from ..storage import Storage
from ..storage import open_storage
from ..storage.direct import BLOCK
from ..store import Store

MiB = 1 << 20
Path = tuple[str | int, ...]


def tensor_paths(node: dict[str, Any], path: Path = ()) -> Iterator[tuple[Path, str]]:
    """``(path, flat key)`` of every tensor under a skeleton node, in order; a path holds dict
    keys as str and list or tuple positions as int, as PyTorch's state-dict walkers do."""
    (kind, body), = node.items()
    if kind == "tensor":
        yield path, body
    elif kind == "dict":
        for k, child in body:
            yield from tensor_paths(child, (*path, str(k)))
    elif kind in ("list", "tuple"):
        for i, child in enumerate(body):
            yield from tensor_paths(child, (*path, i))


def dotted(path: Path) -> str:
    """The fully qualified name of a path: its parts joined by dots (``model.emb.weight``)."""
    return ".".join(map(str, path))


def subtree(tree: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The skeleton node at the flat-key ``prefix`` (``model``, ``model/encoder``).

    Raises:
        ConvertError: no dict entry lies at ``prefix``.
    """
    node = tree
    for part in prefix.strip("/").split("/"):
        (kind, body), = node.items()
        match = [child for k, child in body if statetree.key_part(k) == part] if kind == "dict" else []
        if not match:
            raise ConvertError(f"prefix {prefix!r}: the saved state has no entry {part!r} there")
        node = match[0]
    return node


@dataclass(frozen=True)
class Selection:
    """What an export takes from a step.

    Attributes:
        tree: the skeleton to write (the step's, or the subtree at a prefix), or None when keys
            were chosen: then only tensors are written, as a flat mapping by name.
        names: the chosen tensors' names outside, by flat key, in the skeleton's order.
    """

    tree: dict[str, Any] | None
    names: dict[str, str]


class Snapshot:
    """One committed step of a store, read tensor by tensor.

    Args:
        path: the store (a path or a :class:`Storage`).
        step: the step (default: the latest).
        memory_budget: bytes of reads in flight plus the block handed out.
        io_threads: parallel chunk reads.

    Raises:
        StoreError, StepNotFoundError, BrokenChainError: as :meth:`Checkpointer.load`.
    """

    def __init__(self, path: str | os.PathLike[str] | Storage, step: int | None = None, *,
                 memory_budget: int = 256 * MiB, io_threads: int = 4):
        if memory_budget < 4 * MiB:
            raise ConvertError(f"memory_budget must be at least 4 MiB, got {memory_budget}")
        self.store = Store(open_storage(path))
        self.store.check_exists()
        if step is None:
            steps = self.store.steps()
            if not steps:
                raise ConvertError(f"{self.store.storage.url} holds no committed step")
            step = steps[-1]
        self.chain = self.store.chain(step)
        self.manifest: Manifest = self.chain[-1]
        # Two blocks at a time (one handed out, the next being read), and staging for the reads.
        self.block_bytes = memory_budget // 4
        chunk = min(32 * MiB, memory_budget // 8)
        self._executor = ThreadPoolExecutor(io_threads, thread_name_prefix="deltackpt-export")
        self._ahead = ThreadPoolExecutor(1, thread_name_prefix="deltackpt-export-ahead")
        # Two long-lived, 4 KiB-aligned block buffers, used in turn: fresh memory is slow to touch
        # on many VMs, and aligned blocks can be written past the page cache.
        self._buffers: list[torch.Tensor] = []
        self._reader = ChainReader(self.store.storage, self.chain,
                                   StagingPool(max(2, (memory_budget - self.block_bytes) // chunk), chunk),
                                   self._executor, self.manifest.tensors.keys())

    @property
    def step(self) -> int:
        return self.manifest.step

    def select(self, keys: Sequence[str] | None = None, prefix: str | None = None) -> Selection:
        """The tensors an export takes: all, those under ``prefix`` (named relative to it, the
        rest of the state kept), or those ``keys`` select (see :func:`select_keys`).

        Raises:
            KeyMismatchError: a key pattern selects nothing.
            ConvertError: ``prefix`` is not in the state, or two tensors get one name.
        """
        tree = subtree(self.manifest.tree, prefix) if prefix else self.manifest.tree
        paths = list(tensor_paths(tree))
        chosen = set(select_keys([k for _, k in paths], keys)) if keys is not None else None
        names: dict[str, str] = {}
        seen: dict[str, str] = {}
        for path, key in paths:
            if chosen is not None and key not in chosen:
                continue
            name = dotted(path)
            if name in seen:
                raise ConvertError(f"tensors {seen[name]!r} and {key!r} would both be named {name!r}")
            names[key] = seen[name] = name
        return Selection(None if chosen is not None else tree, names)

    def dtype(self, key: str) -> torch.dtype:
        return dtypes.from_name(self.manifest.tensors[key].dtype)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.manifest.tensors[key].shape

    def rows_per_block(self, key: str) -> int:
        shape = self.shape(key)
        row = max(1, torch.Size(shape[1:]).numel() * torch.empty((), dtype=self.dtype(key)).element_size())
        return max(1, self.block_bytes // row)

    def read(self, key: str, box: Box | None = None, into: torch.Tensor | None = None) -> torch.Tensor:
        """The box ``box`` (default: all) of ``key``'s value, read from the chain (into the
        uint8 buffer ``into`` if given, which must hold it)."""
        shape = self.shape(key)
        box = box or Box((0,) * len(shape), shape)
        dtype = self.dtype(key)
        if into is None:
            out = torch.empty(box.shape, dtype=dtype)
        else:
            nbytes = torch.Size(box.shape).numel() * torch.empty((), dtype=dtype).element_size()
            out = into[:nbytes].view(dtype).view(box.shape)
        self._reader.read(key, out, box)
        return out

    def _buffer(self, i: int) -> torch.Tensor:
        while len(self._buffers) <= i:
            raw = torch.empty(self.block_bytes + BLOCK, dtype=torch.uint8)
            start = -raw.data_ptr() % BLOCK
            self._buffers.append(raw[start : start + self.block_bytes])
        return self._buffers[i]

    def blocks(self, key: str, start: int = 0, stop: int | None = None, *,
               reuse: bool = False) -> Iterator[torch.Tensor]:
        """Rows ``[start, stop)`` of ``key`` (all of a 0-d tensor) in blocks of at most
        :meth:`rows_per_block` rows. With ``reuse``, blocks are views of two long-lived aligned
        buffers, so a caller must be done with a block when it asks for the next one."""
        shape = self.shape(key)
        if not shape:
            yield self.read(key)
            return
        stop = shape[0] if stop is None else stop
        step = self.rows_per_block(key)
        boxes = [Box((r, *[0] * (len(shape) - 1)), (min(step, stop - r), *shape[1:]))
                 for r in range(start, stop, step)]
        boxes = boxes or [Box((start, *[0] * (len(shape) - 1)), (0, *shape[1:]))]
        # The next block is read (into the other buffer) while the caller writes this one.
        fits = reuse and boxes[0].numel * self.dtype(key).itemsize <= self.block_bytes
        buffers = [self._buffer(0), self._buffer(1)] if fits else [None, None]
        pending = self._ahead.submit(self.read, key, boxes[0], buffers[0])
        for i, nxt in enumerate([*boxes[1:], None]):
            block = pending.result()
            if nxt is not None:
                pending = self._ahead.submit(self.read, key, nxt, buffers[(i + 1) % 2])
            yield block

    def close(self) -> None:
        self._ahead.shutdown(wait=True)
        self._executor.shutdown(wait=True)

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
