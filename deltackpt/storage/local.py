"""A store in a local directory.

Durability covers exactly what a save wrote, never the whole file system. A file written through
the page cache is ``fsync``-ed by the thread that wrote it, right after its last byte, so the
files' flushes overlap each other and the writes still running; :meth:`LocalStorage.sync` then
``fsync``-s the files written direct (their bytes are on the disk already: what is left is the
journal's commit, which one commit does for them all), the folders holding the files, and the
parent of each folder this storage created, whose new name must last too.

Measured here side by side (the machine shared by other jobs, so figures moved a lot between
runs). For 200 files of 64 KiB: ``syncfs`` 0.14-0.7 s, one ``fsync`` per file at the end 1.1-1.4
s, ``sync_file_range`` at the write then ``fsync`` at the end 1.1-1.7 s, the same ``fsync`` s
spread over two threads 0.34-0.97 s, ``fsync`` by the writing thread 0.32-0.81 s. A ``syncfs``
waits for every other process's unsynced data on the same file system too: a 1% delta took 0.83 s
instead of 0.059 s after another process had written 1.5 GB. For a 2.2 GB base (124 files, its
chunks written direct): 0.62-0.84 of the disk's O_DIRECT bandwidth (median 0.73 of 3 rounds) with
every file ``fsync``-ed by its writer, 0.87-0.97 (median 0.89 of 4) with those written direct
left to ``sync``; a 1% delta (its pack written direct, its part table through the page cache)
took 0.043 s either way.

Large writes bypass the page cache (see :mod:`deltackpt.storage.direct`).

Keys are untrusted (they come from commit records): a key with an empty, ``.`` or ``..``
component or a NUL is refused, so every path stays under the root, and no operation follows a
link below the root. Reads open regular files only, without following a link and without
blocking (a FIFO in a store would hang a reader), and read no more than the file's size.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import threading
import uuid
from collections.abc import Iterable
from functools import partial

from ..errors import StorageFullError, StoreError
from .base import Capabilities, PointHook, Run, Storage, check_key, one_by_one
from .direct import DirectWriter


class LocalStorage(Storage):
    """A store in a local directory.

    Args:
        root: the directory; created if absent.
        on_point: called before each durable step (see :mod:`deltackpt.storage.base`).

    Example:
        >>> import tempfile
        >>> storage = LocalStorage(tempfile.mkdtemp())
        >>> storage.put_if_absent("commits/a.json", b"{}"), storage.put_if_absent("commits/a.json", b"")
        (True, False)
    """

    capabilities = Capabilities(shared=True, persistent=True)

    def __init__(self, root: str | os.PathLike[str], *, on_point: PointHook | None = None):
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root
        self.on_point = on_point
        self._fresh: set[str] = set()  # folders this storage created whose names are not durable yet
        self._unsynced: set[str] = set()  # files written direct, not fsync-ed yet
        self._lock = threading.Lock()
        self._writer = DirectWriter(self.root)
        self._real_dirs: set[str] = set()  # folders under the root known not to be links

    def _path(self, key: str) -> str:
        """The path of ``key``, which must stay under the root."""
        return os.path.join(self.root, *check_key(key))

    def _no_links(self, path: str) -> None:
        """Raises StoreError if a folder from the root down to ``path`` (included) is a link;
        folders that do not exist are fine (nothing can be reached through them)."""
        todo = []
        while len(path) > len(self.root) and path not in self._real_dirs:
            todo.append(path)
            path = os.path.dirname(path)
        for folder in reversed(todo):
            try:
                mode = os.lstat(folder).st_mode
            except FileNotFoundError:
                return
            except OSError as e:
                raise _store_error(e, folder) from e
            if stat.S_ISLNK(mode):
                raise StoreError(None, f"{folder} is a link; a store's folders must be real folders")
            if not stat.S_ISDIR(mode):
                return  # opening a path below a file fails on its own
            self._real_dirs.add(folder)

    def _open_file(self, key: str) -> tuple[int, int]:
        """Opens the regular file ``key`` for reading without following a link or blocking;
        returns the descriptor and the file's size."""
        path = self._path(key)
        self._no_links(os.path.dirname(path))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise StoreError(None, f"{path} is a link; a store holds regular files") from None
            raise _store_error(e, path) from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StoreError(None, f"{path} is not a regular file")
        except BaseException:
            os.close(fd)
            raise
        return fd, st.st_size

    def write(self, key: str, parts: Iterable[memoryview]) -> None:
        path = self._path(key)
        self.point("write_chunk", key)
        try:
            self._no_links(os.path.dirname(path))  # before making folders: never through a link
            self._makedirs(os.path.dirname(path))
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                if self._writer.write(fd, parts):
                    with self._lock:
                        self._unsynced.add(path)
                else:
                    self.point("fsync", key)
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise _store_error(e, path) from e

    def _makedirs(self, folder: str) -> None:
        """Creates ``folder`` and its missing parents, noting each one created here."""
        missing = []
        while not os.path.isdir(folder):
            missing.append(folder)
            folder = os.path.dirname(folder)
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                continue  # another thread or process made it, and makes its name durable
            with self._lock:
                self._fresh.add(d)

    def sync(self, keys: Iterable[str], *, run: Run = one_by_one) -> None:
        # The files written direct, then the folders (the files written through the page cache
        # were fsync-ed as they were written), and the parents of the folders made here, up to
        # the first one that existed already.
        paths = {k: self._path(k) for k in keys}
        with self._lock:
            direct = [(k, p) for k, p in paths.items() if p in self._unsynced]
        if direct:
            run([partial(self._sync_file, k, p) for k, p in direct])
        self._sync_dirs({os.path.dirname(p) for p in paths.values()}, run)

    def _sync_file(self, key: str, path: str) -> None:
        self.point("fsync", key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise _store_error(e, path) from e
        with self._lock:
            self._unsynced.discard(path)

    def sync_folders(self, folders: Iterable[str]) -> None:
        self._sync_dirs({self._path(f) for f in folders})

    def _sync_dirs(self, dirs: set[str], run: Run = one_by_one) -> None:
        todo = set()
        with self._lock:
            for d in dirs:
                todo.add(d)
                while d in self._fresh and len(d) > len(self.root):
                    d = os.path.dirname(d)
                    todo.add(d)
            fresh = todo & self._fresh

        def sync_dir(d: str) -> None:
            if os.path.isdir(d):  # a folder that holds nothing yet has nothing to make durable
                self.point("fsync_dir", d)
                try:
                    _fsync_dir(d)
                except OSError as e:
                    raise _store_error(e, d) from e

        # A folder's contents before its name, when run one by one. Every fsync flushes the
        # device's cache: while other processes wrote, fsyncs of 18 new folders took 1-64 ms
        # (40 ms typical) one by one, and 1-6 ms issued together from 3 threads (8 trials each).
        run([partial(sync_dir, d) for d in sorted(todo, key=len, reverse=True)])
        with self._lock:
            self._fresh -= fresh

    def read_into(self, key: str, out: memoryview, offset: int = 0) -> int:
        # preadv, not a file object's seek and readinto: a restore of 20,000 small tensors
        # reads as many chunks, and the object cost ~14 us of each read's ~16.
        fd, size = self._open_file(key)
        try:
            done, want = 0, min(size - offset, len(out))
            while done < want:
                n = os.preadv(fd, [out[done:want]], offset + done)
                if not n:
                    break
                done += n
            return size
        except OSError as e:
            raise _store_error(e, self._path(key)) from e
        finally:
            os.close(fd)

    def read(self, key: str) -> bytes:
        fd, size = self._open_file(key)
        try:
            with open(fd, "rb", closefd=False) as f:
                return f.read(size)  # no more than the size: a file growing meanwhile stops here
        except OSError as e:
            raise _store_error(e, self._path(key)) from e
        finally:
            os.close(fd)

    def size(self, key: str) -> int | None:
        path = self._path(key)
        self._no_links(os.path.dirname(path))
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise _store_error(e, path) from e
        if not stat.S_ISREG(st.st_mode):
            raise StoreError(None, f"{path} is not a regular file")
        return st.st_size

    def _scan(self, prefix: str) -> list[os.DirEntry[str]]:
        path = self._path(prefix) if prefix else self.root
        self._no_links(path)
        try:
            with os.scandir(path) as entries:
                return list(entries)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise _store_error(e, path) from e

    def files(self, prefix: str) -> list[str]:
        return sorted(e.name for e in self._scan(prefix) if e.is_file(follow_symlinks=False))

    def list(self, prefix: str) -> list[str]:
        return sorted(e.name for e in self._scan(prefix))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        folder = os.path.dirname(path)
        tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
        try:
            self._no_links(folder)
            self._makedirs(folder)
            self.point("write_manifest_tmp", key)
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                self.point("fsync", key)
                os.fsync(f.fileno())
            self.point("rename_manifest", key)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
            self._sync_dirs({folder})
            return True
        except OSError as e:
            raise _store_error(e, path) from e

    def swap(self, key: str, expected: bytes | None, new: bytes | None) -> bool:
        # Writers of ``key`` serialize on an advisory lock of a file beside it; readers need
        # none: they see the old or the new file (rename is atomic). The kernel drops the lock
        # of a process that dies, so a killed writer never leaves ``key`` locked. The folder is
        # not synced: after a power cut the object holds the old or the new bytes, both whole.
        path = self._path(key)
        folder = os.path.dirname(path)
        name = os.path.basename(path)
        try:
            os.makedirs(folder, exist_ok=True)
            fd = os.open(os.path.join(folder, f".{name}.lock"),
                         os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    current: bytes | None = self.read(key)
                except FileNotFoundError:
                    current = None
                if current != expected:
                    return False
                self.point("swap", key)
                if new is None:
                    os.unlink(path)
                else:
                    tmp = os.path.join(folder, f".{name}.{uuid.uuid4().hex}.tmp")
                    with open(tmp, "xb") as f:
                        f.write(new)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, path)
                return True
            finally:
                os.close(fd)
        except OSError as e:
            raise _store_error(e, path) from e

    def delete(self, key: str) -> None:
        path = self._path(key)
        self._no_links(os.path.dirname(path))
        self.point("gc_delete", key)
        try:
            os.unlink(path)  # a link is removed, not followed
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _store_error(e, path) from e

    def usage(self, prefix: str) -> tuple[int, float]:
        top = self._path(prefix)
        self._no_links(os.path.dirname(top))
        try:
            st = os.lstat(top)
            if not stat.S_ISDIR(st.st_mode):  # a file, or a link counted as itself
                return st.st_size, st.st_mtime
            total, newest = 0, st.st_mtime
            for folder, dirs, files in os.walk(top):  # never into linked folders
                for name in dirs + files:
                    fst = os.lstat(os.path.join(folder, name))
                    if not stat.S_ISDIR(fst.st_mode):
                        total += fst.st_size
                    newest = max(newest, fst.st_mtime)
            return total, newest
        except FileNotFoundError:
            return 0, 0.0
        except OSError as e:
            raise _store_error(e, top) from e

    def abort_stale_uploads(self, older_than: float) -> int:
        return 0  # a dead save's files are ordinary files: GC deletes them with their folder

    def delete_tree(self, prefix: str) -> None:
        path = self._path(prefix)
        self._no_links(os.path.dirname(path))
        self.point("gc_delete", prefix)
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                shutil.rmtree(path)  # removes links inside, never follows them
                self._real_dirs = {d for d in self._real_dirs if not (d + os.sep).startswith(path + os.sep)}
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _store_error(e, path) from e


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _store_error(e: OSError, path: str) -> StoreError:
    cls = StorageFullError if e.errno in (errno.ENOSPC, errno.EDQUOT) else StoreError
    if e.errno == errno.ENOTDIR and (file := _file_above(path)):
        return cls(e.errno, f"{file} is a file, where a folder of the store must be")
    return cls(e.errno, f"{os.strerror(e.errno) if e.errno else e}: {path}")


def _file_above(path: str) -> str | None:
    """The highest of ``path``'s parents that is there but is no folder (a store's path naming
    a file), if any."""
    found = None
    while (parent := os.path.dirname(path)) != path:
        path = parent
        if os.path.lexists(path) and not os.path.isdir(path):
            found = path
    return found
