"""Change-tracking kernels: mark, hash and gather rows; hash dense chunks.

Every function takes ``backend="auto" | "triton" | "torch"``. ``"torch"`` is the reference in
:mod:`deltackpt.kernels.reference` (the CPU path and the test oracle); ``"triton"`` runs the
kernels of :mod:`deltackpt.kernels.triton_kernels` on CUDA tensors; ``"auto"`` picks Triton for
CUDA tensors when triton is importable and the reference otherwise. Both backends give the same
bits for every supported dtype. Small CPU inputs are hashed by :mod:`deltackpt.kernels.small`
(the ``xxhash`` library, same bits) unless ``"triton"`` is asked for or the compiled kernels are
warm (:func:`warm`), and the compiled reference is imported on first use, so that importing the
package and a small save need no numba.

Example:
    >>> import torch
    >>> from deltackpt import kernels
    >>> kernels.hash_rows(torch.zeros(3, 4)).shape
    torch.Size([3])
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from functools import partial
from types import ModuleType
from typing import Any

import numpy as np
import torch

from . import small

BACKENDS = ("auto", "triton", "torch")

PARALLEL_MIN = 4 << 20
"""Inputs smaller than this many bytes per thread are hashed on the calling thread: waking a
second thread costs more than it saves there (a 1000 x 16 fp32 tensor hashed in 0.02 ms on idle
cores in parallel, 0.04-0.09 ms on one thread, and 8.7-15.5 ms in parallel when both cores were
busy elsewhere), while 4 MiB is about 0.5 ms of hashing on one core."""

_warm = False
"""Whether :func:`warm` has loaded the compiled kernels."""

WARM_SMALL_PIECES = 8
"""Once the compiled kernels are warm, only inputs of fewer rows or chunks than this are hashed
by :mod:`small`: a library call a row costs ~0.4 us, so 500 rows of 128 B took 0.18 ms there and
0.018 ms in the compiled kernel (16 such tensors make a 1% delta of a small state); under 8 rows
both take 7-9 us a call."""


def _small(t: torch.Tensor, pieces: int, backend: str) -> bool:
    """Whether ``t``, in ``pieces`` rows or chunks, is hashed by :mod:`small`."""
    return backend != "triton" and (not _warm or pieces < WARM_SMALL_PIECES) and small.fits(t, pieces)


def __getattr__(name: str) -> Any:
    # The compiled reference (numba) is imported on first use, not with the package: importing
    # numba costs a fresh process ~0.25 s, and small inputs never need it (see small.py).
    if name == "reference":
        return importlib.import_module(".reference", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _triton() -> ModuleType | None:
    try:
        from . import triton_kernels
    except ImportError:
        return None
    return triton_kernels


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _impl(t: torch.Tensor, backend: str) -> ModuleType | type[_OnHost]:
    _check_backend(backend)
    reference = __getattr__("reference")
    if backend == "torch":
        return reference if t.device.type == "cpu" else _OnHost
    if backend == "triton":
        mod = _triton()
        if mod is None:
            raise RuntimeError("backend='triton' needs the triton package, which is not importable")
        return mod
    mod = _triton() if t.device.type == "cuda" else None  # "auto"
    if mod is not None:
        return mod
    return reference if t.device.type == "cpu" else _OnHost


class _OnHost:
    """The reference on a device tensor: computes on a host copy, returns on the device."""

    @staticmethod
    def hash_rows(t: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        return __getattr__("reference").hash_rows(t.cpu(), threads).to(t.device)

    @staticmethod
    def hash_chunks(t: torch.Tensor, chunk_bytes: int, threads: int | None = None) -> torch.Tensor:
        return __getattr__("reference").hash_chunks(t.cpu(), chunk_bytes, threads).to(t.device)

    @staticmethod
    def mark_rows(mask: torch.Tensor, ids: torch.Tensor) -> None:
        __getattr__("reference").mark_rows(mask, ids)

    @staticmethod
    def gather_rows(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return __getattr__("reference").gather_rows(t, ids)


def hash_rows(t: torch.Tensor, *, backend: str = "auto", threads: int | None = None) -> torch.Tensor:
    """XXH64 (seed 0) of the bytes of every row ``t[i]``, as int64 bit patterns.

    Args:
        t: a tensor with at least one dimension; rows are along dimension 0.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        threads: the most CPU threads the hash may use (None: ``torch.get_num_threads()``); an
            input under ``reference.PARALLEL_MIN`` bytes a thread is hashed on the calling one.

    Returns:
        An int64 tensor of ``t.shape[0]`` hashes on ``t``'s device.
    """
    if t.dim() == 0:
        raise ValueError("hash_rows needs a tensor with at least one dimension, got a 0-d tensor")
    _check_threads(threads)
    _check_backend(backend)
    if _small(t, t.shape[0], backend):
        return small.hash_rows(t)
    impl = _impl(t, backend)
    if impl is _OnHost or impl.__name__.endswith(".reference"):
        return impl.hash_rows(t.contiguous(), threads)
    return impl.hash_rows(t.contiguous())


def hash_chunks(t: torch.Tensor, chunk_bytes: int, *, backend: str = "auto",
                threads: int | None = None) -> torch.Tensor:
    """XXH64 (seed 0) of every ``chunk_bytes`` piece of ``t``'s flat bytes; the last may be short.

    Args:
        t: any tensor; its bytes are taken in C order.
        chunk_bytes: piece size, a positive multiple of ``t.element_size()``.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        threads: as for :func:`hash_rows`.

    Returns:
        An int64 tensor of ``ceil(t.nbytes / chunk_bytes)`` hashes on ``t``'s device.
    """
    if chunk_bytes <= 0 or chunk_bytes % t.element_size():
        raise ValueError(
            f"chunk_bytes must be a positive multiple of the element size {t.element_size()}, "
            f"got {chunk_bytes}"
        )
    _check_threads(threads)
    _check_backend(backend)
    if _small(t, -(-t.numel() * t.element_size() // chunk_bytes), backend):
        return small.hash_chunks(t, chunk_bytes)
    impl = _impl(t, backend)
    if impl is _OnHost or impl.__name__.endswith(".reference"):
        return impl.hash_chunks(t.contiguous(), chunk_bytes, threads)
    return impl.hash_chunks(t.contiguous(), chunk_bytes)


def hash_segments(tensors: Sequence[torch.Tensor], pieces: Sequence[int]) -> torch.Tensor:
    """XXH64 (seed 0) of every ``pieces[i]``-byte piece of each tensor's bytes, for many small
    tensors in one call on the calling thread: the hashes of ``tensors[0]``'s pieces, then of
    ``tensors[1]``'s, and so on; each tensor's are the bits :func:`hash_rows` (rows of
    ``pieces[i]`` bytes) or :func:`hash_chunks` (``pieces[i]``-byte chunks) give it. One call in
    place of one per tensor: per-call overhead, not hashing, is what a state of thousands of tiny
    tensors costs.

    Args:
        tensors: contiguous CPU tensors, each of a whole, non-zero number of its pieces.
        pieces: the piece size of each tensor, in bytes.

    Returns:
        An int64 tensor of ``sum(t.nbytes // p)`` hashes on the CPU.

    Raises:
        ValueError: a tensor is not a contiguous CPU tensor of whole pieces, or the lengths differ.

    Example:
        >>> hash_segments([torch.zeros(3, 4), torch.zeros(2)], [16, 8]).shape
        torch.Size([4])
    """
    return Segments(tensors, pieces).hash()


class Segments:
    """Tensors that :func:`hash_segments` hashes together again and again (a state's small
    tensors, at every save): checked and sized once, so that each :meth:`hash` asks each tensor
    only where its bytes lie now (a state of thousands of tiny tensors pays for every question).

    The tensors must keep their dtypes and shapes while it is used (the change tracker passes the
    saver's own views of the state, which nothing reshapes); it holds them, so their memory lives.

    Raises:
        ValueError: as :func:`hash_segments`.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], pieces: Sequence[int]):
        if len(tensors) != len(pieces):
            raise ValueError(f"{len(tensors)} tensors but {len(pieces)} piece sizes")
        sizes = []
        for t, p in zip(tensors, pieces):
            n = t.nbytes
            if p <= 0 or not n or n % p or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"cannot hash a {t.device.type} tensor of {n} bytes "
                                 f"({'' if t.is_contiguous() else 'not '}contiguous) in pieces of {p} bytes")
            sizes.append(n)
        self.tensors, self.pieces = list(tensors), list(pieces)
        nbytes, steps = np.array(sizes, dtype=np.int64), np.array(pieces, dtype=np.int64)
        self.ends = np.cumsum(nbytes // steps)  # where each tensor's hashes end among hash()'s
        self.count = int(self.ends[-1]) if len(sizes) else 0
        self.nbytes = sum(sizes)
        # The compiled kernel's arguments, but the addresses (None: small enough for small.py).
        small_enough = self.count <= small.SMALL_PIECES and self.nbytes <= small.SMALL_BYTES
        self._sizes = None if small_enough else (nbytes, steps)

    def hash(self) -> torch.Tensor:
        """The hashes of every tensor's pieces as its bytes are now, one tensor after another."""
        if self._sizes is None:
            return small.hash_segments(self.tensors, self.pieces)
        out = torch.empty(self.count, dtype=torch.int64)
        (whole,) = self.jobs(out, self.nbytes)  # one job: the whole call
        whole()
        return out

    def jobs(self, out: torch.Tensor, piece: int) -> list[Callable[[], object]]:
        """Jobs that put :meth:`hash`'s hashes into ``out`` (a contiguous int64 tensor of
        ``count``) together, for threads to share: each hashes the next tensors of about ``piece``
        bytes in one compiled call that holds no lock (where the bytes lie is asked here, on the
        calling thread). Only for a call too large for the small inputs' path.

        Raises:
            ValueError: the call takes the small inputs' path.
        """
        if self._sizes is None:
            raise ValueError(f"{self.nbytes} bytes take the small inputs' path: use hash()")
        nbytes, steps = self._sizes
        reference = __getattr__("reference")
        addresses = reference.addresses_of(self.tensors)
        o = out.numpy().view(np.uint64)
        # A job ends after the tensor that reaches each multiple of ``piece`` bytes.
        cuts = np.searchsorted(np.cumsum(nbytes), np.arange(piece, self.nbytes, piece)) + 1
        bounds = [0, *sorted(set(cuts.tolist()) - {len(nbytes)}), len(nbytes)]
        return [partial(reference.hash_segments_at, addresses[lo:hi], nbytes[lo:hi], steps[lo:hi],
                        o[(self.ends[lo - 1] if lo else 0) : self.ends[hi - 1]])
                for lo, hi in zip(bounds, bounds[1:])]


def _check_threads(threads: int | None) -> None:
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise ValueError(f"threads must be a positive int or None, got {threads!r}")


def mark_rows(mask: torch.Tensor, ids: torch.Tensor, *, backend: str = "auto") -> None:
    """Sets ``mask[ids] = 1`` in place; ``mask`` is a 1-D bool or uint8 tensor, ``ids`` int64/int32."""
    _impl(mask, backend).mark_rows(mask, ids)


def gather_rows(t: torch.Tensor, ids: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Returns ``t[ids]`` (rows along dimension 0) as a new contiguous tensor."""
    return _impl(t, backend).gather_rows(t, ids)


def warm() -> None:
    """Compiles the CPU kernels, or loads them from numba's cache, on tiny inputs of every
    signature a save uses, so that no save pays for it: a checkpointer runs this on a background
    thread when it is built.

    Example:
        >>> warm()
    """
    global _warm
    reference = __getattr__("reference")  # called directly: these inputs would take the small path
    reference.hash_rows(torch.zeros(2, 8, dtype=torch.uint8), 1)  # rows of whole 8-byte words
    reference.hash_rows(torch.zeros(2, 3, dtype=torch.uint8), 1)  # rows of any bytes
    reference.hash_chunks(torch.zeros(24, dtype=torch.uint8), 8, 1)
    reference.hash_segments_at(reference.addresses_of([torch.zeros(24, dtype=torch.uint8)]), np.array([24]),
                               np.array([8]), np.empty(3, dtype=np.uint64))
    mask = torch.zeros(4, dtype=torch.bool)
    reference.mark_rows(mask, torch.tensor([1], dtype=torch.int64))
    reference.mark_rows(mask, torch.tensor([2], dtype=torch.int32))
    log = torch.zeros(4, dtype=torch.int64).numpy()
    reference.mark_rows_logged(mask, torch.tensor([3], dtype=torch.int64), 0, log, 0)
    reference.mark_rows_logged(mask, torch.tensor([0], dtype=torch.int32), 0, log, 1)
    _warm = True
