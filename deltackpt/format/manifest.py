"""The commit record (manifest) of a step, whose presence makes a step exist: the types a
reader and a writer share, and their JSON fields.

Format 4 is documented in ``docs/format.md``: a root record plus the part tables of
:mod:`deltackpt.format.part_tables`. Storing one is :mod:`deltackpt.format.record_io`; parsing
and checking one read from a store, :mod:`deltackpt.format.record_checks`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..sharding import Box
from .encodings import Encoding
from .lossy import Lossy

FORMAT = 4
LOSSY_FORMAT = 5  # format 4 plus quantized deltas: written only by a checkpointer with quantize=
FORMATS = (FORMAT, LOSSY_FORMAT)
KINDS = ("base", "delta")


# A chunk's [size, xxh3-64 hex], and for a chunk in a pack, its byte offset there.
Entry = tuple[int, str] | tuple[int, str, int]
ChunkMap = dict[str, Entry]


@dataclass(frozen=True)
class PartRecord:
    """One part of a tensor in one step: a box of the global tensor, written by one rank.

    Attributes:
        offset: the box's global offset.
        shape: the box's shape.
        path: the part's folder under the tensor's folder (``""``: the tensor's folder itself,
            used when one part covers the whole tensor; else ``"p<i>"``).
        chunk_shape: the chunk shape of the stored array (of ``rows`` for ``"rows"``).
        changed: rows written (``"full"``, ``"rows"``) or chunks written (``"chunks"``).
        chunks: every chunk written, by key relative to the part's folder (``c.3.0``,
            ``ids/c.0``, ``zarr.json``), as ``[size_in_bytes, xxh3_64_hex]``, or for a chunk in
            a pack ``[size_in_bytes, xxh3_64_hex, offset_in_pack]``.
        pack: the pack holding the part's chunks (a delta's ``pack.<rank>``), or None when each
            chunk is a file.
        rank: the rank whose part table lists the part: the one that wrote it (in a base made
            by compaction, the rank whose pack holds a packed part, or whose row hash file lists
            the part, else rank 0).
    """

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    path: str
    chunk_shape: tuple[int, ...]
    changed: int
    chunks: dict[str, tuple[int, str] | tuple[int, str, int]] = field(default_factory=dict)
    pack: str | None = None
    rank: int = 0

    @property
    def box(self) -> Box:
        return Box(self.offset, self.shape)

    @property
    def nbytes_written(self) -> int:
        return sum(entry[0] for entry in self.chunks.values())

    @property
    def touched(self) -> bool:
        """Whether it changed a row or lists a chunk (else a read has nothing in it to read)."""
        return bool(self.changed or self.chunks)

    def to_doc(self) -> dict[str, Any]:
        return {"offset": list(self.offset), "shape": list(self.shape), "path": self.path,
                "chunk_shape": list(self.chunk_shape), "changed": self.changed,
                "chunks": {k: list(v) for k, v in self.chunks.items()}, "pack": self.pack,
                "rank": self.rank}


@dataclass(frozen=True)
class TensorRecord:
    """How one tensor is stored in one step.

    Attributes:
        dtype: torch dtype name (``"bfloat16"``).
        shape: global shape.
        encoding: how the parts are stored (see :mod:`deltackpt.format.encodings`): ``full``
            (each part whole, one zarr array chunked by rows), ``rows`` (per part, arrays
            ``ids`` and ``rows``: sorted global row ids and those rows, restricted to the part's
            columns), ``qrows`` (the same, rows quantized) or ``chunks`` (per part, a flat zarr
            array of which only the changed chunks were written).
        parts: the parts, sorted by offset; a base's parts tile the tensor.
        lossy: for a tensor whose restored values may differ from the saved ones (quantized in
            this step or earlier in the chain), the scheme and bounds; None when exact.
    """

    dtype: str
    shape: tuple[int, ...]
    encoding: Encoding
    parts: Sequence[PartRecord]
    lossy: Lossy | None = None

    @property
    def changed(self) -> int:
        return sum(p.changed for p in self.parts)

    def parts_meeting(self, box: Box) -> Sequence[PartRecord]:
        """The parts that share an element with ``box``, sorted by path. A record read from a
        store reads only the part tables that hold them where its root gives their layout (see
        :mod:`deltackpt.format.part_layout`)."""
        # Not isinstance: a protocol's check walks its attributes (a load of 20,000 tensors
        # made 60,000 of them).
        meeting = getattr(self.parts, "meeting", None)
        if meeting is not None:
            return meeting(box)
        return [p for p in self.parts if (inter := p.box.intersect(box)) is not None and inter.numel]

    def untouched(self, box: Box) -> bool:
        """Whether no part that meets ``box`` changed a row or lists a chunk: a delta's record
        of a tensor it left as it was there, which a read of the chain skips (most tensors of
        most deltas)."""
        untouched = getattr(self.parts, "untouched", None)  # a record read from a store's
        if untouched is not None:
            return untouched(box)
        return not any(p.touched for p in self.parts_meeting(box))

    @property
    def nbytes_written(self) -> int:
        return sum(p.nbytes_written for p in self.parts)

    def root_doc(self) -> dict[str, Any]:
        """Its fields in the root record (without its parts)."""
        doc: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape), "encoding": self.encoding.name}
        if self.lossy is not None:
            doc["lossy"] = self.lossy.to_doc()
        return doc


@dataclass(frozen=True)
class StepSummary:
    """A commit record's own fields, without its tree and tensors: what a listing of steps
    shows and a chain is walked by (see :func:`deltackpt.format.record_checks.parse_summary`).
    The attributes are :class:`Manifest`'s of the same names."""

    step: int
    kind: str
    attempt: str
    parent: int | None
    parent_attempt: str | None
    base: int
    chain_length: int
    world_size: int
    created: float
    bytes_written: int
    state_bytes: int
    compacts: str | None
    lossy: bool
    format: int


@dataclass(frozen=True)
class Manifest:
    """The commit record of one step.

    Attributes:
        step: the training step.
        kind: ``"base"`` or ``"delta"``.
        attempt: the folder under ``steps/`` holding this step's arrays (unique per save attempt).
        parent: the step this delta applies to (None for a base).
        parent_attempt: the parent's attempt, or that of the compacted base the parent was
            restored from; checked on replay so deltas of two lineages never mix.
        base: the step of the base this step's chain starts from (itself for a base).
        chain_length: deltas between the base and this step, this one included.
        world_size: ranks that saved it.
        created: wall-clock time of the commit (informational only; order comes from steps).
        policy: the base-cadence policy's name, its decision and the reason.
        tree: the JSON skeleton of the state (see :mod:`deltackpt.statetree`).
        tensors: every tensor of the state by flat key.
        packs: the files of each pack (a delta's chunks, back to back, per writing rank), by
            pack name and file key (``c.0``, ``zarr.json``), as ``[size_in_bytes, xxh3_64_hex]``.
        bytes_written: bytes of all files of this step.
        state_bytes: bytes of every tensor of the state, what a full checkpoint writes.
        compacts: for a base made by compaction (``bases/``), the attempt of the step's own
            record that it stands in for; None otherwise.
        quantize: for a checkpointer with ``quantize=`` (format 5), ``{"restores": N,
            "tensors": {key: {"pattern", "scheme", "reason"}}}``: the restores the run had made
            before this save and each quantized tensor's rule and why; None otherwise.
        hashes: the row hash files of a base (see :mod:`deltackpt.format.hash_files`), by the
            rank that wrote each, as ``(size_in_bytes, xxh3_64_hex)``.
    """

    step: int
    kind: str
    attempt: str
    parent: int | None
    parent_attempt: str | None
    base: int
    chain_length: int
    world_size: int
    created: float
    policy: dict[str, Any]
    tree: dict[str, Any]
    tensors: Mapping[str, TensorRecord]
    packs: dict[str, ChunkMap]
    bytes_written: int
    state_bytes: int
    compacts: str | None = None
    quantize: dict[str, Any] | None = None
    format: int = FORMAT
    hashes: Mapping[int, tuple[int, str]] = field(default_factory=dict)

    @property
    def lossy(self) -> bool:
        """Whether restoring this step may give values other than those saved."""
        return any(t.lossy is not None for t in self.tensors.values())

    def pack_chunk(self, pack: str) -> int:
        """The size of every file of a pack (its zarr chunk size)."""
        return self.packs[pack]["c.0"][0]

    def root_doc(self) -> dict[str, Any]:
        """The root record's fields but the part tables' names (see
        :func:`deltackpt.format.record_io.encode_record`)."""
        doc = {name: getattr(self, name) for name in (
            "step", "kind", "attempt", "parent", "parent_attempt", "base", "chain_length",
            "world_size", "created", "policy", "tree", "bytes_written", "state_bytes", "compacts",
            "format")}
        if self.format == LOSSY_FORMAT:
            doc["lossy"] = self.lossy
            doc["quantize"] = self.quantize
        doc["tensors"] = {k: t.root_doc() for k, t in self.tensors.items()}
        doc["packs"] = {k: {n: list(e) for n, e in files.items()} for k, files in self.packs.items()}
        if self.hashes:
            doc["hashes"] = [[rank, size, digest] for rank, (size, digest) in sorted(self.hashes.items())]
        return doc

    def to_doc(self) -> dict[str, Any]:
        """The whole record as one JSON document, every part inline (what ``show --json``
        prints; stores hold a root and part tables instead)."""
        doc = self.root_doc()
        for key, t in self.tensors.items():
            doc["tensors"][key]["parts"] = [p.to_doc() for p in t.parts]
        return doc
