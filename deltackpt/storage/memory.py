"""A store held in this process's memory, for tests and for trying the library without a disk.

It models durability as the protocol defines it: :meth:`MemoryStorage.crash` keeps only what was
made durable (objects passed to ``sync``, records created by ``put_if_absent``, removals under
folders passed to ``sync_folders``) and drops the rest, as a power cut would on a file system.
"""

from __future__ import annotations

import errno
import itertools
import threading
import time
from collections.abc import Iterable

from ..errors import StoreError
from .base import Capabilities, PointHook, Run, Storage, check_key, one_by_one

_urls = itertools.count()


class MemoryStorage(Storage):
    """Objects in a dictionary, visible to this process only.

    Args:
        on_point: called before each durable step (see :mod:`deltackpt.storage.base`).

    Example:
        >>> storage = MemoryStorage()
        >>> storage.write("steps/a/0", [memoryview(b"abc")])
        >>> storage.list("steps"), storage.read("steps/a/0")
        (['a'], b'abc')
        >>> storage.crash(); storage.size("steps/a/0") is None  # never synced
        True
    """

    capabilities = Capabilities(shared=False, persistent=False)

    def __init__(self, *, on_point: PointHook | None = None):
        self.url = f"memory://{next(_urls)}"
        self.on_point = on_point
        self._lock = threading.Lock()
        self._objects: dict[str, tuple[bytes, float]] = {}
        self._durable: dict[str, tuple[bytes, float]] = {}

    def write(self, key: str, parts: Iterable[memoryview]) -> None:
        check_key(key)
        self.point("write_chunk", key)
        data = b"".join(bytes(p.cast("B")) for p in parts)
        with self._lock:
            if key in self._objects:
                raise StoreError(errno.EEXIST, f"object exists: {self.url}/{key}")
            self._objects[key] = (data, time.time())

    def sync(self, keys: Iterable[str], *, run: Run = one_by_one) -> None:
        keys = list(keys)
        if keys:
            self.point("fsync", keys[0])
        with self._lock:
            for k in keys:
                if k in self._objects:
                    self._durable[k] = self._objects[k]

    def sync_folders(self, folders: Iterable[str]) -> None:
        with self._lock:
            for folder in folders:
                self.point("fsync_dir", folder)
                inside = f"{folder}/" if folder else ""
                for k in [k for k in self._durable if k.startswith(inside)]:
                    if k not in self._objects:
                        del self._durable[k]

    def read_into(self, key: str, out: memoryview, offset: int = 0) -> int:
        data = self._get(key)
        piece = data[offset: offset + len(out)]
        out.cast("B")[: len(piece)] = piece
        return len(data)

    def read(self, key: str) -> bytes:
        return self._get(key)

    def size(self, key: str) -> int | None:
        with self._lock:
            found = self._objects.get(key)
        return None if found is None else len(found[0])

    def files(self, prefix: str) -> list[str]:
        inside = f"{prefix}/" if prefix else ""
        with self._lock:
            names = {k[len(inside):] for k in self._objects if k.startswith(inside)}
        return sorted(n for n in names if "/" not in n)

    def list(self, prefix: str) -> list[str]:
        inside = f"{prefix}/" if prefix else ""
        with self._lock:
            names = {k[len(inside):].split("/", 1)[0] for k in self._objects if k.startswith(inside)}
        return sorted(names)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        check_key(key)
        self.point("write_manifest_tmp", key)
        self.point("rename_manifest", key)
        with self._lock:
            if key in self._objects:
                return False
            self._objects[key] = self._durable[key] = (bytes(data), time.time())
            return True

    def swap(self, key: str, expected: bytes | None, new: bytes | None) -> bool:
        with self._lock:
            found = self._objects.get(key)
            if (None if found is None else found[0]) != expected:
                return False
            self.point("swap", key)
            if new is None:
                self._objects.pop(key, None)
                self._durable.pop(key, None)
            else:
                self._objects[key] = self._durable[key] = (bytes(new), time.time())
            return True

    def delete(self, key: str) -> None:
        self.point("gc_delete", key)
        with self._lock:
            self._objects.pop(key, None)

    def usage(self, prefix: str) -> tuple[int, float]:
        with self._lock:
            found = [v for k, v in self._objects.items() if k == prefix or k.startswith(f"{prefix}/")]
        return sum(len(d) for d, _ in found), max((t for _, t in found), default=0.0)

    def abort_stale_uploads(self, older_than: float) -> int:
        return 0  # writes are whole at once

    def delete_tree(self, prefix: str) -> None:
        check_key(prefix)
        self.point("gc_delete", prefix)
        with self._lock:
            for k in [k for k in self._objects if k == prefix or k.startswith(f"{prefix}/")]:
                del self._objects[k]

    def crash(self) -> None:
        """Forgets everything not made durable, as a power cut would."""
        with self._lock:
            self._objects = dict(self._durable)

    def _get(self, key: str) -> bytes:
        check_key(key)
        with self._lock:
            found = self._objects.get(key)
        if found is None:
            raise FileNotFoundError(f"no such object: {self.url}/{key}")
        return found[0]
