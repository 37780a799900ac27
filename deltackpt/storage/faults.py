"""Fault injection: a backend wrapping another that lets a test act at each durable step.

Example:
    >>> from deltackpt.storage import MemoryStorage
    >>> seen = []
    >>> storage = FaultInjection(MemoryStorage(), lambda phase, key: seen.append(phase))
    >>> storage.put_if_absent("commits/a.json", b"{}")
    True
    >>> seen
    ['write_manifest_tmp', 'rename_manifest']
"""

from __future__ import annotations

from collections.abc import Iterable

from .base import Capabilities, PointHook, Run, Storage, one_by_one


class FaultInjection(Storage):
    """``inner`` with ``fault(phase, key)`` called before each of its durable steps and at the
    phases a save or compaction announces; ``fault`` may raise, sleep or end the process.

    The wrapped backend's own hook is taken over: its steps inside one operation (a record's temp
    file, its link, its folder's sync) reach ``fault`` too.

    Args:
        inner: the backend that stores the bytes.
        fault: what to do at each point.
    """

    def __init__(self, inner: Storage, fault: PointHook):
        self.inner = inner
        self.url = inner.url
        self.capabilities: Capabilities = inner.capabilities
        self.on_point: PointHook | None = fault
        inner.on_point = self.point

    def write(self, key: str, parts: Iterable[memoryview]) -> None:
        self.inner.write(key, parts)

    def sync(self, keys: Iterable[str], *, run: Run = one_by_one) -> None:
        self.inner.sync(keys, run=run)

    def sync_folders(self, folders: Iterable[str]) -> None:
        self.inner.sync_folders(folders)

    def read_into(self, key: str, out: memoryview, offset: int = 0) -> int:
        return self.inner.read_into(key, out, offset)

    def read(self, key: str) -> bytes:
        return self.inner.read(key)

    def size(self, key: str) -> int | None:
        return self.inner.size(key)

    def files(self, prefix: str) -> list[str]:
        return self.inner.files(prefix)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self.inner.put_if_absent(key, data)

    def swap(self, key: str, expected: bytes | None, new: bytes | None) -> bool:
        return self.inner.swap(key, expected, new)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def usage(self, prefix: str) -> tuple[int, float]:
        return self.inner.usage(prefix)

    def delete_tree(self, prefix: str) -> None:
        self.inner.delete_tree(prefix)

    def abort_stale_uploads(self, older_than: float) -> int:
        return self.inner.abort_stale_uploads(older_than)
