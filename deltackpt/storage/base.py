"""The storage interface every backend implements, and the flags that say what a backend can do.

Keys are ``/``-separated paths relative to the store's root. The commit primitive is
:meth:`Storage.put_if_absent`: create a small object only if no object has that key, durably. On a
file system it is a temp file, ``fsync``, ``link()`` (which fails if the name exists, unlike
``rename``) and an ``fsync`` of the directory; object stores implement it as a conditional put.

Data objects are made durable in bulk: :meth:`Storage.write` creates one and :meth:`Storage.sync`
makes the ones written so far durable; removals become durable with
:meth:`Storage.sync_folders`. Nothing is committed before ``sync`` returns.

Before each durable step a backend calls its :attr:`Storage.on_point` hook, if one is set, with
the step's phase name (``write_chunk``, ``fsync``, ``write_manifest_tmp``, ``rename_manifest``,
``fsync_dir``, ``gc_delete``, ``swap``) and key; saves and compaction announce their own phases through
:meth:`Storage.point` (``plan_local``, ``plan_global``, ``compact_commit``). Tests inject faults
there with :class:`~deltackpt.storage.faults.FaultInjection`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..errors import StoreError

PointHook = Callable[[str, str], None]
"""Called with ``(phase, key)`` before a durable step."""

Run = Callable[[Sequence[Callable[[], object]]], None]
"""Runs independent jobs, on whatever threads it has, and raises the first error once all ended."""


def one_by_one(jobs: Sequence[Callable[[], object]]) -> None:
    """A :data:`Run` that runs ``jobs`` one after the other on this thread."""
    for job in jobs:
        job()


def check_key(key: str) -> list[str]:
    """The components of ``key``, once it names a place under the store.

    Raises:
        StoreError: a component is empty, ``.`` or ``..``, or holds a NUL.
    """
    parts = key.split("/")
    if any(p in ("", ".", "..") or "\x00" in p for p in parts):
        raise StoreError(None, f"bad key {key!r:.200}: keys are '/'-separated names under the store")
    return parts


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond the protocol's guarantees.

    Attributes:
        shared: other processes (ranks, other hosts) see the same objects; a distributed save
            needs it.
        persistent: objects outlive the process that wrote them.
    """

    shared: bool
    persistent: bool


class Storage(Protocol):
    """What a store needs from its backend. Every method may be called from several threads.

    Missing keys: :meth:`read` and :meth:`read_into` raise :class:`FileNotFoundError`,
    :meth:`size` returns None, :meth:`list` returns ``[]``, :meth:`delete` does nothing.

    Keys come from commit records, which are untrusted: a backend refuses a key that would
    leave the store (an empty, ``.`` or ``..`` component, a NUL) with
    :class:`~deltackpt.StoreError`, and reads only plain objects (on a file system: regular
    files, never through a link).
    """

    url: str
    capabilities: Capabilities
    on_point: PointHook | None

    def point(self, phase: str, key: str) -> None:
        """Marks the start of durable step ``phase`` on ``key``: calls :attr:`on_point` if set
        (a backend that subclasses this protocol inherits this)."""
        if self.on_point is not None:
            self.on_point(phase, key)

    def write(self, key: str, parts: Iterable[memoryview]) -> None:
        """Creates object ``key`` from ``parts``; ``key`` must not exist. Durable after
        :meth:`sync`."""

    def sync(self, keys: Iterable[str], *, run: Run = one_by_one) -> None:
        """Makes the objects ``keys`` (written before) durable, names included; ``run`` runs the
        independent steps this takes (the flushes of a file system's folders: issued together,
        the device merges them)."""

    def sync_folders(self, folders: Iterable[str]) -> None:
        """Makes the removals of names under ``folders`` durable."""

    def read_into(self, key: str, out: memoryview, offset: int = 0) -> int:
        """Reads object ``key`` from byte ``offset`` on into ``out``; returns the object's size,
        which may not cover ``offset + len(out)`` (then ``out`` holds only the bytes there are)."""

    def read(self, key: str) -> bytes:
        """The whole object ``key``."""

    def size(self, key: str) -> int | None:
        """Size of object ``key``, or None if absent."""

    def files(self, prefix: str) -> list[str]:
        """Names of the objects directly under ``prefix``, sorted: no folders, links or special
        files (a store's records are listed this way)."""

    def list(self, prefix: str) -> list[str]:
        """Names directly under ``prefix`` (objects, folders and anything else there), sorted."""

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Durably creates ``key`` with ``data`` unless it exists; returns whether it did."""

    def swap(self, key: str, expected: bytes | None, new: bytes | None) -> bool:
        """Replaces object ``key`` by ``new`` (None: removes it) if it holds exactly ``expected``
        (None: if it is absent), as one atomic compare-and-swap; returns whether it did (if not,
        nothing changed). Every process sees the change once it returns; after a power cut the
        object may hold the bytes before it, never a mix. Meant for small objects that only live
        processes act on (the writer lease): object stores implement it with a conditional put
        or delete on the object's ETag. ``new`` must be bytes no other swap writes (the lease's
        name their holder and time): a request sent again and refused tells whether its first
        try went through by the bytes the object holds."""

    def delete(self, key: str) -> None:
        """Removes object ``key`` if present."""

    def usage(self, prefix: str) -> tuple[int, float]:
        """Bytes of everything under ``prefix`` (an object or a folder) and the newest
        modification time among them (0.0 if nothing is there)."""

    def delete_tree(self, prefix: str) -> None:
        """Removes everything under ``prefix`` (a link is removed, never followed)."""

    def abort_stale_uploads(self, older_than: float) -> int:
        """Abandons uploads begun before Unix time ``older_than`` and never finished (an object
        store's multipart uploads left by saves that died), freeing their parts; returns how
        many. Backends whose writes leave nothing behind return 0."""
