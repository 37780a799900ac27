"""The Encoding interface and its registry.

An encoding is how a part's data lies in a step: which zarr arrays it holds and their chunk grid
(``arrays``, ``chunk_shape``), what its record fields may say (``fits``, ``record_problem``), how
a save writes it (``encode``, into a :class:`ChunkSink`), how a restore reads it back
(``read``, ``read_rows``, ``changes``, from a :class:`ChunkSource`) and what ``verify`` checks in
its chunks beyond their sizes and checksums (``verify_chunk``). Each one is a class registered
here by name, the name its tensors' records carry; a save stores each tensor in the last
registered encoding that :meth:`Encoding.chosen` accepts it for.

Example:
    >>> from deltackpt.format import encodings
    >>> encodings.choose("delta", (100, 8), False), encodings.choose("base", (), False)
    ('rows', 'full')
    >>> encodings.choose("delta", (100,), False), encodings.choose("delta", (100,), False, aligned=True)
    ('chunks', 'rows')
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

import numpy as np
import torch

from ...errors import ManifestError, StateError
from .. import dtypes
from ..layout import chunk_key

if TYPE_CHECKING:
    from ...io.cover import Covers
    from ...io.row_hashes import RowHashes
    from ...io.staging import StagingPool
    from ...quantization import Rowwise
    from ...sharding import Box
    from ..lossy import Lossy
    from ..manifest import Manifest, PartRecord, TensorRecord

Job = Callable[[], object]


PAD_BLOCK = 4096  # a disk block: the edge chunk pads less than one per chunk


def rows_per_chunk(rows: int, row_bytes: int, chunk_bytes: int) -> int:
    """Rows per chunk: at most ``chunk_bytes`` each (one row at least), split evenly, so the edge
    chunk pads less than one row per chunk; for rows wider than :data:`PAD_BLOCK`, fewer rows a
    chunk until it pads less than one block per chunk (one row a chunk pads none).

    Example:
        >>> rows_per_chunk(1000, 4, 1024), rows_per_chunk(401, 10_000, 1 << 20)
        (250, 67)
    """
    if rows == 0:
        return 1
    target = max(1, chunk_bytes // max(1, row_bytes))
    per = -(-rows // -(-rows // target))
    while per > 1 and (-(-rows // per) * per - rows) * row_bytes >= -(-rows // per) * PAD_BLOCK:
        per -= 1
    return per


def dense_chunk_elems(numel: int, itemsize: int, dense_chunk_bytes: int) -> int:
    """Elements per dense chunk: about ``dense_chunk_bytes``, split evenly so that the edge chunk
    pads less than one element per chunk (one chunk for a part smaller than a chunk)."""
    return rows_per_chunk(numel, itemsize, dense_chunk_bytes)


@dataclass(frozen=True)
class Array:
    """One zarr array of a part, chunked along dimension 0.

    Attributes:
        name: its folder under the part's folder (``""``: the part's folder itself).
        shape: its shape.
        chunk_shape: its chunk shape (spanning every dimension but the first).
        dtype: the dtype of its elements.
        coded: whether its chunks are blosc coded (else raw bytes).
        chunks: chunk files along dimension 0 that the part lists (for a sparse encoding, the
            most it may list).
    """

    name: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    dtype: torch.dtype
    coded: bool
    chunks: int

    def chunk(self, index: int) -> str:
        """The name of chunk ``index``, relative to the part's folder."""
        key = chunk_key(index, len(self.shape))
        return f"{self.name}/{key}" if self.name else key

    @property
    def chunk_bytes(self) -> int:
        """The bytes one chunk decodes to (padded as stored)."""
        return math.prod(self.chunk_shape) * self.dtype.itemsize


Packed = tuple[str, str, torch.Tensor, torch.Tensor, tuple[int, ...], int, torch.Tensor | None]
"""A delta's part appended at once with others (``encode_packed`` of ``chunks`` and ``rows``): key,
path, CPU tensor, its changed rows or chunks, chunk shape, first row's global id, ``hash_into``."""


class ChunkSink(Protocol):
    """Where a save's chunks go (:class:`deltackpt.io.writer.StepWriter`)."""

    @property
    def pool(self) -> StagingPool: ...

    def put(self, key: str, path: str, name: str, data: torch.Tensor, pad: int, dtype: torch.dtype,
            release: Callable[[], None] | None = None, uncoded: bool = False,
            hash_into: torch.Tensor | None = None, packed: bool | None = None, kept: bool = False) -> None:
        """Queues chunk ``name`` of a part: ``data`` then ``pad`` zero bytes, coded as an array of
        ``dtype`` is unless ``uncoded``; ``release`` runs once it is written, and until then
        ``data`` must not change (without ``release``, a packed chunk is copied before this
        returns, unless ``kept``: ``data`` does not change until the save ends). With
        ``hash_into``, the hash of each of ``data``'s rows goes there, on an I/O thread (a large
        file's beside its write, see :mod:`deltackpt.io.files`). ``packed``: into the writer's
        pack, or a file of its own (None: into the pack if the writer has one)."""

    def put_packed(self, chunks: Sequence[tuple[str, str, str, torch.Tensor, int]]) -> None:
        """Appends each ``(key, path, name, data, pad)`` chunk, ``data`` a contiguous CPU tensor
        read before this returns, to the writer's pack, coded as :meth:`put` codes it."""

    def gather(self, flat: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copies rows ``ids`` of ``flat`` (on the CPU) into ``out``, on the writer's threads
        and this one."""

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Copies the bytes ``src`` into ``dst`` (a staging buffer's), on this thread or shared
        with the writer's idle threads."""

    def note_bound(self, key: str, bound: float) -> None:
        """Records the largest error bound of the quantized rows written for ``key``."""


class ChunkSource(Protocol):
    """Where a restore's chunks come from (:class:`deltackpt.io.reader.ChainReader`)."""

    def staged(self, m: Manifest, key: str, part: PartRecord, name: str, dtype: torch.dtype,
               decoded_bytes: int, use: Callable[[torch.Tensor], None], uncoded: bool = False) -> None:
        """Reads a chunk through a staging buffer, checked and decoded (as an array of ``dtype``
        unless ``uncoded``), and hands its ``decoded_bytes`` uint8 bytes to ``use``."""

    def fetch(self, m: Manifest, key: str, part: PartRecord, name: str, into: torch.Tensor) -> None:
        """Reads a raw chunk, checked, straight into ``into`` (uint8, exactly its size)."""

    def ids(self, m: Manifest, key: str, part: PartRecord) -> torch.Tensor:
        """The global row ids a row-sparse part holds, checked: sorted, unique, in the part."""

    def stored_hashes(self, m: Manifest, key: str, part: PartRecord) -> torch.Tensor | None:
        """The hash of every row of a base's part, as stored beside it (None: none stored)."""

    def run(self, jobs: list[Job]) -> None:
        """Runs ``jobs`` on the I/O threads; raises the first error once every job ended."""


class Encoding(abc.ABC):
    """How a part's data is stored in a step; one instance per registered class.

    Attributes:
        name: the ``encoding`` its tensors' records carry.
        whole: each part is stored whole (a base): the parts tile the tensor, and a save needs
            no change set for it.
        quantized: lossy; the tensor's record names the scheme in its ``lossy`` field.
        sparse: a part lists only the chunks of its grid that it wrote.
        claims: what a delta of this encoding claims when a chain is replayed newest delta
            first (see :mod:`deltackpt.io.cover`): ``"rows"`` or ``"spans"`` (of flat
            elements); None for a whole encoding, read first as the chain's base.
    """

    name: ClassVar[str]
    whole: ClassVar[bool] = False
    quantized: ClassVar[bool] = False
    sparse: ClassVar[bool] = False
    claims: ClassVar[str | None] = None

    def __repr__(self) -> str:
        return repr(self.name)  # shows as the record shows it

    def __str__(self) -> str:
        return self.name

    # -- choosing and describing ------------------------------------------------------------------

    @abc.abstractmethod
    def chosen(self, kind: str, shape: tuple[int, ...], quantized: bool, aligned: bool) -> bool:
        """Whether a tensor of ``shape`` may be stored this way in a step of ``kind`` (``"base"``
        or ``"delta"``); ``quantized``: a quantization rule names the tensor; ``aligned``: a 1-d
        tensor with one value per row of a table, whose changes are rows (its elements)."""

    @abc.abstractmethod
    def chunk_shape(self, shape: tuple[int, ...], itemsize: int, changed: int,
                    sizes: tuple[int, int], rule: Rowwise | None) -> tuple[int, ...]:
        """The ``chunk_shape`` a part of ``shape`` holding ``changed`` rows or chunks records;
        ``sizes`` is ``(chunk_bytes, dense_chunk_bytes)``."""

    @abc.abstractmethod
    def fits(self, chunk_shape: tuple[int, ...], shape: tuple[int, ...], changed: int) -> bool:
        """Whether a record's ``chunk_shape`` and ``changed`` can describe a part of ``shape``."""

    @abc.abstractmethod
    def arrays(self, dtype: torch.dtype, shape: tuple[int, ...], chunk_shape: tuple[int, ...],
               changed: int) -> tuple[Array, ...]:
        """The zarr arrays a part holds."""

    def record_problem(self, dtype: str, lossy: Lossy | None) -> str | None:
        """What is wrong with a tensor record of this encoding (None: nothing)."""
        return None

    # -- writing and reading ---------------------------------------------------------------------

    @abc.abstractmethod
    def encode(self, sink: ChunkSink, key: str, path: str, t: torch.Tensor, changed: torch.Tensor | None,
               chunk_shape: tuple[int, ...], *, row_offset: int = 0,
               hash_into: torch.Tensor | None = None, rule: Rowwise | None = None) -> None:
        """Copies a part's data out of ``t`` (the part) into staging buffers and queues its chunks.

        Args:
            sink: where the chunks go.
            key, path: the tensor and the part.
            t: the part's data (live: read only here).
            changed: the changed rows (local, sorted, unique, int64 on CPU) or chunks; None when
                the encoding stores the part whole.
            chunk_shape: as :meth:`chunk_shape` gave it.
            row_offset: the part's first global row.
            hash_into: where to put the hash of each changed row or chunk, if given.
            rule: the quantization, for a quantized encoding.
        """

    @abc.abstractmethod
    def read(self, source: ChunkSource, m: Manifest, key: str, rec: TensorRecord, part: PartRecord,
             inter: Box, dest: torch.Tensor, box: Box, covers: Covers | None,
             hashes: RowHashes | None = None) -> list[Job]:
        """Jobs that write the values ``part`` holds inside ``inter`` into ``dest``, the box
        ``box`` of the tensor: all of them for a base (``covers`` None), else those that no newer
        delta wrote, claimed from ``covers`` (a delta's jobs then run beside every other
        delta's). With ``hashes``, each job hashes the whole rows of ``dest`` it wrote into it
        (or takes their hashes stored beside them, see :meth:`ChunkSource.stored_hashes`), and
        marks those it wrote in part as unknown.

        Raises:
            IntegrityError: the part cannot be read this way (a row delta of a 0-d tensor).
        """

    @abc.abstractmethod
    def read_rows(self, source: ChunkSource, m: Manifest, key: str, rec: TensorRecord,
                  part: PartRecord, want: torch.Tensor, first: int, dest: torch.Tensor) -> list[Job]:
        """Jobs that write the rows ``want`` (global, sorted, unique, all inside ``part``) that
        the part holds into rows ``first``, ``first + 1``... of ``dest``."""

    def changes(self, source: ChunkSource, m: Manifest, key: str, rec: TensorRecord,
                part: PartRecord) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows (elements, for a 0-d or 1-d tensor) the part holds and their values, the
        part's columns only. This default reads the part whole."""
        dest = torch.empty(part.shape, dtype=dtypes.from_name(rec.dtype))
        source.run(self.read(source, m, key, rec, part, part.box, dest, part.box, None))
        if not part.shape:
            return torch.zeros(1, dtype=torch.int64), dest.view(1)
        return torch.arange(part.offset[0], part.offset[0] + part.shape[0]), dest

    def verify_chunk(self, rec: TensorRecord, part: PartRecord, name: str, buf: torch.Tensor) -> str | None:
        """What ``verify`` finds wrong in chunk ``name`` (its checked bytes, decoded if coded, in
        ``buf``) beyond its size and checksum (None: nothing)."""
        return None


E = TypeVar("E", bound=type[Encoding])

REGISTRY: dict[str, Encoding] = {}


def register(cls: E) -> E:
    """Class decorator: registers an encoding under its ``name``.

    Raises:
        StateError: an encoding of that name is registered already.
    """
    if cls.name in REGISTRY:
        raise StateError(f"an encoding named {cls.name!r} is registered already")
    REGISTRY[cls.name] = cls()
    return cls


def get(name: str, where: str = "record") -> Encoding:
    """The registered encoding called ``name``.

    Raises:
        ManifestError: none is (``where`` names the record).
    """
    enc = REGISTRY.get(name)
    if enc is None:
        raise ManifestError(f"{where}: field 'encoding' must be one of {tuple(REGISTRY)}, got {name!r:.40}")
    return enc


def choose(kind: str, shape: tuple[int, ...], quantized: bool, aligned: bool = False) -> Encoding:
    """The encoding a save stores a tensor of ``shape`` in, in a step of ``kind``: the last
    registered one that accepts it (see :meth:`Encoding.chosen`).

    Raises:
        StateError: none does.
    """
    for enc in reversed(REGISTRY.values()):
        if enc.chosen(kind, shape, quantized, aligned):
            return enc
    raise StateError(f"no encoding stores a tensor of shape {list(shape)} in a {kind}"
                     f"{' quantized' if quantized else ''}")


def dense_rows(source: ChunkSource, m: Manifest, key: str, part: PartRecord, want: torch.Tensor,
               first: int, dest: torch.Tensor, *, sparse: bool) -> list[Job]:
    """:meth:`Encoding.read_rows` for a part stored by position: rows (elements of a 1-d part)
    in chunks of ``chunk_shape[0]``; ``sparse``: only the chunks the part lists hold rows."""
    local = want - part.offset[0]
    cols = tuple(slice(o, o + n) for o, n in zip(part.offset[1:], part.shape[1:]))
    rest = part.shape[1:]
    size = part.chunk_shape[0]
    row_bytes = math.prod(rest) * dest.element_size()
    where = torch.arange(first, first + want.numel())
    groups = local // size
    jobs: list[Job] = []
    for g in torch.unique(groups).tolist():
        name = chunk_key(g, len(part.shape))
        if sparse and name not in part.chunks:
            continue  # a chunk this delta did not change
        sel = groups == g

        def copy(buf: torch.Tensor, src: torch.Tensor = local[sel] - g * size,
                 dst: torch.Tensor = where[sel]) -> None:
            rows = buf[: size * row_bytes].view(dest.dtype).view(size, *rest)
            index: tuple[torch.Tensor | slice, ...] = (dst, *cols)
            dtypes.as_bits(dest)[index] = dtypes.as_bits(rows)[src]

        jobs.append(partial(source.staged, m, key, part, name, dest.dtype, size * row_bytes, copy))
    return jobs
