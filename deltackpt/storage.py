"""Where the bytes go: the storage interface and the local file system implementation.

Keys are ``/``-separated paths relative to the store's root. The commit primitive is
:meth:`Storage.put_if_absent`: create a small object only if no object has that key, durably. On a
file system it is a temp file, ``fsync``, ``link()`` (which fails if the name exists, unlike
``rename``) and an ``fsync`` of the directory; object stores implement it as a conditional put.

Data files are made durable in bulk: :meth:`Storage.write` creates a file and
:meth:`Storage.sync` makes every file written so far durable, with their folders. On Linux that is
one ``syncfs`` of the store's file system, measured here 24-47x faster than an ``fsync`` per file
and per folder for a delta of a hundred small tensors; elsewhere each file is ``fsync``-ed as it
is written and each folder at ``sync``. Either way nothing is committed before ``sync`` returns.

Large aligned writes bypass the page cache (``O_DIRECT``): the whole 4 KiB blocks of a part whose
memory starts on a block boundary, written at a block-aligned offset, go straight to the disk; the
rest goes through the page cache. On this project's VM a new file's page cache costs a page fault
per page in memory the host has reclaimed, so buffered writes of fresh files run at 0.3-2.4 GB/s
and direct ones at 1.4-4.3 GB/s (``shared/baselines.md``, and 5.2 MB: 3.7 ms direct vs 16 ms
buffered measured beside each other). The staging pool hands out aligned buffers for this. A file
system that refuses ``O_DIRECT`` gets buffered writes.

Every durable operation first calls :meth:`LocalStorage.persist_point` with its phase name, so
tests can stop a process at each one (``write_chunk``, ``fsync``, ``write_manifest_tmp``,
``rename_manifest``, ``fsync_dir``, ``gc_delete``).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import shutil
import uuid
from collections.abc import Iterable
from typing import Protocol

import numpy as np

from .errors import StorageFullError, StoreError

log = logging.getLogger(__name__)

BLOCK = 4096  # the alignment O_DIRECT needs, of memory, file offset and length
DIRECT_MIN = 1 << 20  # smaller writes go through the page cache: the syncfs that follows is cheap


class Storage(Protocol):
    """What a store needs from its backend. Every method may be called from several threads."""

    url: str

    def write(self, key: str, parts: Iterable[memoryview]) -> None:
        """Creates object ``key`` from ``parts``; ``key`` must not exist. Durable after
        :meth:`sync`."""

    def sync(self, keys: Iterable[str]) -> None:
        """Makes the objects ``keys`` (written before) durable, names included."""

    def read_into(self, key: str, out: memoryview, offset: int = 0) -> int:
        """Reads object ``key`` from byte ``offset`` on into ``out``; returns the object's size,
        which may not cover ``offset + len(out)`` (then ``out`` holds only the bytes there are)."""

    def read(self, key: str) -> bytes:
        """The whole object ``key``."""

    def size(self, key: str) -> int | None:
        """Size of object ``key``, or None if absent."""

    def list(self, prefix: str) -> list[str]:
        """Names directly under ``prefix`` (objects and folders), sorted."""

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Durably creates ``key`` with ``data`` unless it exists; returns whether it did."""

    def delete(self, key: str) -> None:
        """Removes object ``key`` if present."""

    def usage(self, prefix: str) -> tuple[int, float]:
        """Bytes of everything under ``prefix`` (an object or a folder) and the newest
        modification time among them (0.0 if nothing is there)."""

    def delete_tree(self, prefix: str) -> None:
        """Removes everything under ``prefix``."""


class LocalStorage:
    """A store in a local directory.

    Args:
        root: the directory; created if absent.
    """

    def __init__(self, root: str | os.PathLike[str]):
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root
        self._syncfs = _libc_syncfs()
        self._direct = getattr(os, "O_DIRECT", 0)  # 0 once the file system refuses it

    def persist_point(self, phase: str, key: str) -> None:
        """Called before each durable step; a no-op that fault-injecting tests override."""

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def write(self, key: str, parts: Iterable[memoryview]) -> None:
        path = self._path(key)
        self.persist_point("write_chunk", key)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                at = 0
                for part in parts:
                    data = part.cast("B")
                    if (self._direct and at % BLOCK == 0 and len(data) >= DIRECT_MIN
                            and _address(data) % BLOCK == 0):
                        n = self._write_direct(fd, data[: len(data) // BLOCK * BLOCK])
                        at, data = at + n, data[n:]
                    _write_all(fd, data)
                    at += len(data)
                if self._syncfs is None:
                    self.persist_point("fsync", key)
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise _store_error(e, path) from e

    def _write_direct(self, fd: int, data: memoryview) -> int:
        """Writes aligned whole blocks past the page cache; returns the bytes written, 0 when the
        file system refuses (then direct writes stay off)."""
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | self._direct)
            done = os.write(fd, data)  # a refusal shows here or in the line above
        except OSError as e:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
            if e.errno != errno.EINVAL:
                raise
            log.debug("%s: no O_DIRECT on this file system (%s); writing through the page cache",
                      self.root, e)
            self._direct = 0
            return 0
        try:
            _write_all(fd, data[done:])
        finally:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        return len(data)

    def sync(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        if self._syncfs is not None:
            if keys:
                self.persist_point("fsync", self.root)
                fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    if self._syncfs(fd) != 0:
                        err = ctypes.get_errno()
                        raise _store_error(OSError(err, os.strerror(err)), self.root)
                finally:
                    os.close(fd)
            return
        dirs = {os.path.dirname(self._path(k)) for k in keys}
        # Parents first, up to the root: a new folder's own name must be durable too.
        todo = set()
        for d in dirs:
            while len(d) >= len(self.root):
                todo.add(d)
                d = os.path.dirname(d)
        for d in sorted(todo, key=len, reverse=True):
            if os.path.isdir(d):  # a folder that holds nothing yet has nothing to make durable
                self.persist_point("fsync_dir", d)
                _fsync_dir(d)

    def read_into(self, key: str, out: memoryview, offset: int = 0) -> int:
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(offset)
                done = 0
                while done < min(size - offset, len(out)):
                    n = f.readinto(out[done:])
                    if not n:
                        break
                    done += n
                return size
        except FileNotFoundError:
            raise
        except OSError as e:
            raise _store_error(e, path) from e

    def read(self, key: str) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise
        except OSError as e:
            raise _store_error(e, path) from e

    def size(self, key: str) -> int | None:
        try:
            return os.stat(self._path(key)).st_size
        except FileNotFoundError:
            return None

    def list(self, prefix: str) -> list[str]:
        try:
            return sorted(os.listdir(self._path(prefix) if prefix else self.root))
        except FileNotFoundError:
            return []

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        folder = os.path.dirname(path)
        tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
        try:
            os.makedirs(folder, exist_ok=True)
            self.persist_point("write_manifest_tmp", key)
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                self.persist_point("fsync", key)
                os.fsync(f.fileno())
            self.persist_point("rename_manifest", key)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
            self.persist_point("fsync_dir", key)
            _fsync_dir(folder)
            return True
        except OSError as e:
            raise _store_error(e, path) from e

    def delete(self, key: str) -> None:
        self.persist_point("gc_delete", key)
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    def usage(self, prefix: str) -> tuple[int, float]:
        top = self._path(prefix)
        total, newest = 0, 0.0
        try:
            st = os.stat(top)
        except FileNotFoundError:
            return 0, 0.0
        if not os.path.isdir(top):
            return st.st_size, st.st_mtime
        newest = st.st_mtime
        for folder, _, files in os.walk(top):
            newest = max(newest, os.stat(folder).st_mtime)
            for f in files:
                fst = os.stat(os.path.join(folder, f))
                total += fst.st_size
                newest = max(newest, fst.st_mtime)
        return total, newest

    def delete_tree(self, prefix: str) -> None:
        self.persist_point("gc_delete", prefix)
        path = self._path(prefix)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            self.delete(prefix)


def persist_point(storage: Storage, phase: str) -> None:
    """Tells a fault-injecting storage (tests) that ``phase`` starts; a storage without the
    ``persist_point`` hook needs nothing."""
    hook = getattr(storage, "persist_point", None)
    if hook is not None:
        hook(phase, "")


def _libc_syncfs():
    """Linux's ``syncfs(fd)``, or None where the C library has no such call."""
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None)
    except OSError:
        return None


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _address(data: memoryview) -> int:
    return np.frombuffer(data, np.uint8).ctypes.data if len(data) else 0


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _store_error(e: OSError, path: str) -> StoreError:
    cls = StorageFullError if e.errno in (errno.ENOSPC, errno.EDQUOT) else StoreError
    return cls(e.errno, f"{os.strerror(e.errno) if e.errno else e}: {path}")
