"""The committed steps of one store: listing them, reading their records, walking a chain, and
committing a record.

A save writes its arrays into a fresh attempt folder, so a crashed save never touches a folder that
a committed step refers to, and commits by creating its record only if absent. Readers list
``commits/`` and ignore everything else (temp files start with a dot). The layout is in
:mod:`deltackpt.format.layout`.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from typing import Protocol, TypeVar

from .errors import (
    BrokenChainError,
    ManifestError,
    MissingChunkError,
    StepExistsError,
    StepNotFoundError,
    StoreError,
)
from .format.layout import BASES, COMMITS, RECORD_NAME, STEPS, base_key, commit_key
from .format.limits import MAX_RECORD_BYTES, MAX_STEP
from .format.manifest import FORMAT, Manifest, StepSummary
from .format.record_checks import parse_manifest, parse_summary
from .format.record_io import checksum, encode_record, table_key
from .format.zarr_meta import group_doc
from .storage import Storage

log = logging.getLogger(__name__)
T = TypeVar("T")


class Store:
    """Committed steps and their records in one storage; records are cached (they are immutable).

    Args:
        storage: where the store lives.
    """

    def __init__(self, storage: Storage):
        self.storage = storage
        self._manifests: dict[int, Manifest] = {}
        self._bases: dict[int, Manifest] = {}
        # The last records known whole, by key: bytes, step and attempt (see holds).
        self._known: dict[str, tuple[bytes, int, str]] = {}
        self._roots: dict[str, bytes] = {}  # the bytes of each cached record, by key (see root)
        self._summaries: dict[str, StepSummary] = {}  # by record key (see summary)

    def exists(self) -> bool:
        return self.storage.size("zarr.json") is not None

    def create(self) -> None:
        """Makes the root and ``steps/`` groups if absent (idempotent)."""
        root = group_doc({"deltackpt": {"format": FORMAT}})
        for key, doc in (("zarr.json", root), (f"{STEPS}/zarr.json", group_doc())):
            if self.storage.size(key) is None:
                self.storage.put_if_absent(key, doc)

    def check_exists(self) -> None:
        """Raises StoreError unless a deltackpt store is at this storage's root."""
        if not self.exists():
            raise StoreError(None, f"no deltackpt store at {self.storage.url}")
        try:
            doc = json.loads(self._read_small("zarr.json"))
            fmt = doc["attributes"]["deltackpt"]["format"]
        except FileNotFoundError:  # removed since it was sized
            raise StoreError(None, f"no deltackpt store at {self.storage.url}") from None
        except (ValueError, KeyError, TypeError):
            raise StoreError(None, f"{self.storage.url}/zarr.json is not a deltackpt store root") from None
        if fmt != FORMAT:
            raise StoreError(None, f"store format {fmt!r} is not supported (this version reads {FORMAT})")

    def steps(self) -> list[int]:
        """Committed steps, ascending: the records in ``commits/`` (files whose name is a step of
        20 ASCII digits, at most ``MAX_STEP``; anything else there is no step)."""
        return _record_steps(self.storage.files(COMMITS))

    def compacted_steps(self) -> list[int]:
        """Steps that have a base made by compaction, ascending."""
        return _record_steps(self.storage.files(BASES))

    def _read_small(self, key: str, limit: int = MAX_RECORD_BYTES) -> bytes:
        """Reads a record or metadata document, refusing one larger than ``limit`` unread."""
        size = self.storage.size(key)
        if size is not None and size > limit:
            raise StoreError(None, f"{self.storage.url}/{key} is too large: {size} bytes "
                                   f"(a record holds at most {limit})")
        return self.storage.read(key)

    def read_table(self, key: str, size: int, digest: str) -> bytes:
        """A record's part table, refused unless its size and checksum are those the root lists
        (sized before it is read).

        Raises:
            ManifestError: naming the table.
        """
        got = self.storage.size(key)
        data = None
        if got == size:
            try:
                data = self.storage.read(key)
            except FileNotFoundError:  # deleted since it was sized
                got = None
        if data is None:
            raise ManifestError(f"{key}: the record lists a part table of {size} bytes, "
                                + ("it is missing" if got is None else f"it has {got}"))
        if len(data) != size or checksum(data) != digest:
            raise ManifestError(f"{key}: the part table does not match its checksum in the record")
        return data

    def compacted(self, step: int) -> Manifest | None:
        """The base compaction made for ``step``, or None."""
        if step in self._bases:
            return self._bases[step]
        key = base_key(step)
        try:
            data = self._read_small(key)
        except FileNotFoundError:
            return None
        m = self.parse(key, data)
        if m.step != step or m.compacts is None:
            raise ManifestError(f"{key}: is not a compacted base of step {step}")
        self._bases[step] = m
        self._roots[key] = data
        return m

    def manifest(self, step: int) -> Manifest:
        """The commit record of ``step``.

        Raises:
            StepNotFoundError: ``step`` is not committed.
            ManifestError: its record is corrupt.
        """
        if step in self._manifests:
            return self._manifests[step]
        key = commit_key(step)
        try:
            data = self._read_small(key)
        except FileNotFoundError:
            raise StepNotFoundError(step, self.steps()) from None
        m = self.parse(key, data)
        if m.step != step:
            raise ManifestError(f"{key}: records step {m.step}, not {step}")
        self._manifests[step] = m
        self._roots[key] = data
        return m

    def summary(self, step: int) -> StepSummary:
        """The own fields of the commit record of ``step`` (see
        :func:`~deltackpt.format.record_checks.parse_summary`): what ``ls`` shows, its tree and
        tensors left unread.

        Raises:
            StepNotFoundError: ``step`` is not committed.
            ManifestError: those fields are corrupt.
        """
        found = self._summary(commit_key(step), step)
        if found is None:
            raise StepNotFoundError(step, self.steps())
        return found

    def compacted_summary(self, step: int) -> StepSummary | None:
        """:meth:`summary` of the base compaction made for ``step``, or None."""
        s = self._summary(base_key(step), step)
        if s is not None and s.compacts is None:
            raise ManifestError(f"{base_key(step)}: is not a compacted base of step {step}")
        return s

    def _summary(self, key: str, step: int) -> StepSummary | None:
        if key not in self._summaries:
            try:
                data = self._read_small(key)
            except FileNotFoundError:
                return None
            s = parse_summary(data, key)
            if s.step != step:
                raise ManifestError(f"{key}: records step {s.step}, not {step}")
            self._summaries[key] = s
        return self._summaries[key]

    def parse(self, key: str, data: bytes) -> Manifest:
        """The record ``data`` read from ``key`` of this store, its parts read from its part
        tables on first use (see :func:`~deltackpt.format.record_checks.parse_manifest`)."""
        return parse_manifest(data, key, self.read_table)

    def root(self, m: Manifest) -> tuple[str, bytes]:
        """The key and bytes of the root record a record this store read or committed was made
        of: what another rank parses it from (:meth:`parse`), reading only the tables it needs."""
        key = base_key(m.step) if m.compacts is not None else commit_key(m.step)
        return key, self._roots[key]

    def chain(self, step: int) -> list[Manifest]:
        """The records to replay for ``step``, base first: back along the parents to a base,
        stopping early at a base that compaction made for a step on the way.

        Raises:
            StepNotFoundError: ``step`` is not committed.
            BrokenChainError: a parent is missing, corrupt or of another lineage.
        """
        return _chain(step, self.manifest, self.compacted)

    def read_chain(self, chain: list[Manifest], read: Callable[[list[Manifest]], T]) -> T:
        """``read(chain)``; if that finds a part table or a chunk gone and the chain of its step
        now resolves to other records, ``read`` of that chain instead, once.

        Between resolving a chain and reading it, a compaction may commit a base on the way and
        GC delete the folders that base replaced: GC deletes a folder once nothing refers to it
        and its files are older than the grace period, as a chain's earlier saves long are (the
        grace period keeps saves in flight, not reads). A chain that resolves the same again is
        damaged, and its error is raised.

        Raises:
            StepNotFoundError: the step was garbage-collected meanwhile (with the read's error
                as its context).
        """
        try:
            return read(chain)
        except (ManifestError, MissingChunkError):
            again = self.chain(chain[-1].step)
            if [m.attempt for m in again] == [m.attempt for m in chain]:
                raise
            log.info("step %d: its chain was compacted and collected while it was read; reading "
                     "it again from step %d", chain[-1].step, again[0].step)
            return read(again)

    def summary_chain(self, step: int) -> list[StepSummary]:
        """:meth:`chain` of the records' own fields alone (see :meth:`summary`)."""
        return _chain(step, self.summary, self.compacted_summary)

    def check_new_step(self, step: int) -> None:
        """Raises StepExistsError unless ``step`` is after every committed step."""
        steps = self.steps()
        if steps and step <= steps[-1]:
            if step in steps:
                raise StepExistsError(f"step {step} is committed already")
            raise StepExistsError(f"step {step} is not after the latest committed step {steps[-1]}")

    def new_attempt(self, step: int) -> str:
        return f"{step}-{uuid.uuid4().hex[:12]}"

    def commit(self, manifest: Manifest) -> bool:
        """Writes the step's part tables into its attempt folder and makes them durable, then
        creates its root record (or, for a compacted base, its base record) if absent; returns
        False if it exists already."""
        key = base_key(manifest.step) if manifest.compacts is not None else commit_key(manifest.step)
        if self.storage.size(key) is not None:
            return False
        root, tables = encode_record(manifest)
        keys = [table_key(manifest.attempt, rank) for rank in tables]
        for at, data in zip(keys, tables.values()):
            if self.storage.size(at) is None:  # a retried commit of this attempt wrote it
                self.storage.write(at, [memoryview(data)])
        self.storage.sync(keys)
        done = self.storage.put_if_absent(key, root)
        if manifest.compacts is not None:
            return done
        if done:
            self._manifests[manifest.step] = manifest
            self._roots[key] = root
            self._remember(key, root, manifest.step, manifest.attempt)
        return done

    def commit_root(self, step: int, root: bytes, *, parsed: Manifest | None = None) -> Manifest | None:
        """Creates the root record ``root`` of ``step`` if absent, every part table it names
        durable already (a save's ranks each wrote their own); returns the record as parsed (its
        parts read from the tables on first use; ``parsed``: what :meth:`parse` gives of
        ``root``, made by its maker), or None if the step exists already.

        Raises:
            ManifestError: ``root`` is not a record of ``step``.
        """
        key = commit_key(step)
        manifest = self.parse(key, root) if parsed is None else parsed
        if manifest.step != step:
            raise ManifestError(f"{key}: records step {manifest.step}, not {step}")
        if not self.storage.put_if_absent(key, root):
            return None
        self._manifests[step] = manifest
        self._roots[key] = root
        self._remember(key, root, step, manifest.attempt)
        return manifest

    def holds(self, step: int, attempt: str) -> bool:
        """Whether the store holds now (read afresh, not from the cache) the record of ``step``
        saved as ``attempt``, or a base that compaction made of it as ``attempt``. Only the two
        fields are looked at: readers check the rest of the record when they use it. A record
        read back with the very bytes this store last committed or looked at is not parsed again
        (a delta's parent is checked twice a save, and its record grows with the tensors)."""
        for key in (commit_key(step), base_key(step)):
            try:
                data = self.storage.read(key)
            except FileNotFoundError:
                continue
            known = self._known.get(key)
            if known is not None and known[0] == data:
                if known[1:] == (step, attempt):
                    return True
                continue
            try:
                doc = json.loads(data)
            except (ValueError, RecursionError):
                continue
            if isinstance(doc, dict) and doc.get("step") == step and doc.get("attempt") == attempt:
                self._remember(key, data, step, attempt)
                return True
        return False

    def _remember(self, key: str, data: bytes, step: int, attempt: str) -> None:
        """Keeps the bytes of the record ``key`` for :meth:`holds`: the last two, a delta's own
        and its parent's."""
        self._known.pop(key, None)
        self._known[key] = (data, step, attempt)
        while len(self._known) > 2:
            del self._known[next(iter(self._known))]

    def withdraw(self, step: int) -> None:
        """Removes the record of ``step`` that this process just committed."""
        self._manifests.pop(step, None)
        self._roots.pop(commit_key(step), None)
        self._summaries.pop(commit_key(step), None)
        self.storage.delete(commit_key(step))
        self.storage.sync_folders([COMMITS])

    def forget(self) -> None:
        """Drops cached records (after records were deleted)."""
        self._manifests.clear()
        self._bases.clear()
        self._roots.clear()
        self._summaries.clear()


class _Record(Protocol):
    """What walking a chain reads of a record (a :class:`Manifest` or a :class:`StepSummary`)."""

    @property
    def step(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def attempt(self) -> str: ...
    @property
    def parent(self) -> int | None: ...
    @property
    def parent_attempt(self) -> str | None: ...
    @property
    def compacts(self) -> str | None: ...


R = TypeVar("R", bound=_Record)


def _chain(step: int, record: Callable[[int], R], compacted: Callable[[int], R | None]) -> list[R]:
    """The records of :meth:`Store.chain`, read by ``record`` (a step's) and ``compacted`` (the
    base compaction made for a step, if any)."""

    def stand_in(at: int, attempt: str | None) -> R | None:
        """The compacted base of step ``at`` if it stands in for the record ``attempt`` or is
        ``attempt`` itself (a delta saved after a restore that replayed from that base)."""
        try:
            base = compacted(at)
        except ManifestError as e:
            raise BrokenChainError(step, at, str(e)) from None
        return base if base is not None and attempt in (base.compacts, base.attempt) else None

    head = record(step)
    chain = [stand_in(step, head.attempt) or head]
    while chain[-1].kind == "delta":
        child = chain[-1]
        at = child.parent
        if at is None:  # the record parser refuses such a record
            raise ManifestError(f"{commit_key(child.step)}: a delta without a parent")
        found = stand_in(at, child.parent_attempt)
        if found is not None:
            chain.append(found)
            break
        try:
            parent = record(at)
        except StepNotFoundError:
            raise BrokenChainError(step, at, "its commit record is missing") from None
        except ManifestError as e:
            raise BrokenChainError(step, at, str(e)) from None
        if parent.attempt != child.parent_attempt:
            raise BrokenChainError(step, at, f"step {child.step} was saved on another lineage")
        chain.append(parent)
    chain.reverse()
    return chain


def _record_steps(names: list[str]) -> list[int]:
    found = (RECORD_NAME.fullmatch(name) for name in names)
    return sorted(s for m in found if m and (s := int(m.group(1))) <= MAX_STEP)
