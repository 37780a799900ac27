"""A store in an S3-compatible bucket (AWS S3, SeaweedFS, Ceph RGW, MinIO, ...), through obstore.

``s3://BUCKET/PREFIX`` names the store; the bucket must exist. Commits never rename or copy: a
commit record (and the writer lease) is created by a ``PUT`` with ``If-None-Match: *``, which the
server refuses with ``412`` when the key exists, and :meth:`S3Storage.swap` replaces a small
object by a ``PUT`` (or ``DELETE``) with ``If-Match`` on its ETag. Before its first conditional
write the backend checks that the server honours both preconditions, on ``PUT`` and ``DELETE``
(a server that ignores ``If-None-Match`` would let two writers both "commit" a step, one that
ignores ``If-Match`` two writers both hold the lease) and refuses the store with
:class:`~deltackpt.errors.StoreError` otherwise, unless ``conditional_writes=False`` says to go on
without it, which is unsafe with two writers.

Data objects are written with one ``PUT``, or a multipart upload in parallel parts above
``multipart_bytes``, with an unsigned payload (the signed commit record holds their checksums);
reads of part of an object are ranged ``GET`` s, so a chunk inside a pack never downloads the
whole pack. A completed ``PUT`` is durable, so :meth:`S3Storage.sync` has nothing to
do. Requests are retried with exponential backoff on throttling (``503 SlowDown``), other ``5xx``
and dropped connections until ``retry_timeout`` seconds have passed since the first attempt.

The client was chosen by measurement on this project's machine (``bench/bench_s3_clients.py``):
against a local SeaweedFS, obstore made 2-3x more ranged GETs per second than s3fs and boto3 and
read large objects fastest; large uploads were bound by the server for every client.
"""

from __future__ import annotations

import builtins
import errno
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any, TypeVar

from ..errors import StoreError
from .base import Capabilities, PointHook, Run, Storage, check_key, one_by_one
from .s3_config import S3Config
from .s3_errors import (RangeNotSatisfiable, Refused, first_line, past_the_end, retried_by_client,
                        transient)
from .s3_requests import SignedRequests

log = logging.getLogger(__name__)

PROBE_PREFIX = ".deltackpt-probe"
STALE_ETAG = '"00000000000000000000000000000000"'  # an ETag no probe object has
T = TypeVar("T")


class S3Storage(Storage):
    """Objects under ``prefix`` in one bucket of an S3-compatible server.

    Args:
        config: where the bucket is and how to reach it (see :class:`S3Config`).
        on_point: called before each durable step (see :mod:`deltackpt.storage.base`).

    Example:
        >>> from deltackpt.storage import open_storage
        >>> storage = open_storage("s3://my-bucket/run1", {"endpoint_url": "http://127.0.0.1:8333",
        ...     "access_key_id": "KEY", "secret_access_key": "SECRET"})  # doctest: +SKIP
    """

    capabilities = Capabilities(shared=True, persistent=True)

    def __init__(self, config: S3Config, *, on_point: PointHook | None = None):
        try:
            import obstore
            from obstore.store import S3Store
        except ImportError:
            raise StoreError(None, f"{config.url} needs the S3 client: pip install "
                                   "'deltackpt[s3]'") from None
        self._obs = obstore
        self.config = config
        self.url = config.url
        self.on_point = on_point
        self._root = f"{config.prefix}/" if config.prefix else ""
        kwargs: dict[str, Any] = {"region": config.region}
        if config.endpoint_url:
            kwargs["endpoint"] = config.endpoint_url
        if config.access_key_id:
            kwargs["access_key_id"] = config.access_key_id
            kwargs["secret_access_key"] = config.secret_access_key
            if config.session_token:
                kwargs["session_token"] = config.session_token
        deadline = timedelta(seconds=config.retry_timeout)

        def client(*, unsigned_payload: bool) -> Any:
            return S3Store(
                config.bucket,
                client_options={"allow_http": config.endpoint_url.startswith("http://"),
                                "connect_timeout": timedelta(seconds=10),
                                "timeout": timedelta(seconds=max(30.0, config.retry_timeout))},
                retry_config={"max_retries": 1000, "retry_timeout": deadline,
                              "backoff": {"init_backoff": timedelta(milliseconds=50),
                                          "max_backoff": timedelta(seconds=5), "base": 2}},
                unsigned_payload=unsigned_payload, **kwargs)

        self._store = client(unsigned_payload=False)
        # Data objects go up without a SHA-256 of their body in the signature, which client and
        # server would each compute over every byte: the commit record (signed) holds each
        # object's checksum, which every read checks.
        self._data_store = client(unsigned_payload=True)
        self._signed = SignedRequests(config)
        self._probe_lock = threading.Lock()
        self._probed = not config.conditional_writes

    # -- the protocol -------------------------------------------------------------------------

    def write(self, key: str, parts: Iterable[memoryview]) -> None:
        check_key(key)
        self.point("write_chunk", key)
        # Each part is copied as it comes: a writer may reuse a part's memory for the next one
        # (a pack streams through one staging buffer), and the request goes out only at the end.
        body = bytearray()
        for p in parts:
            body += p.cast("B") if p.format != "B" or p.ndim != 1 else p
        if len(body) < self.config.multipart_bytes:
            try:
                self._create(key, body, self._data_store)
            except FileExistsError:
                raise StoreError(errno.EEXIST, f"object exists: {self.url}/{key}") from None
            return
        # A multipart upload cannot be made create-only by this client; attempt folders have
        # fresh random names, so an existing key here means a bug: refuse it.
        if self.size(key) is not None:
            raise StoreError(errno.EEXIST, f"object exists: {self.url}/{key}")
        self._call("write", key, lambda: self._obs.put(
            self._data_store, self._root + key, body, use_multipart=True,
            chunk_size=self.config.part_bytes, max_concurrency=self.config.part_concurrency))

    def sync(self, keys: Iterable[str], *, run: Run = one_by_one) -> None:
        keys = list(keys)
        if keys:
            self.point("fsync", keys[0])  # a completed PUT is durable: nothing else to do

    def sync_folders(self, folders: Iterable[str]) -> None:
        for folder in folders:
            self.point("fsync_dir", folder)  # a completed DELETE is durable

    def read_into(self, key: str, out: memoryview, offset: int = 0) -> int:
        out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        if len(out) == 0:
            size = self.size(key)
            if size is None:
                raise FileNotFoundError(f"no such object: {self.url}/{key}")
            return size

        def fetch() -> int:
            # The body streams in pieces; a connection dropped in the middle fails this whole
            # call, which is then retried.
            result = self._obs.get(self._store, self._root + key,
                                   options={"range": (offset, offset + len(out))})
            size = int(result.meta["size"])
            want = max(0, min(len(out), size - offset))
            done = 0
            for piece in result:
                n = len(piece)
                if done + n > want:
                    raise StoreError(errno.EIO, f"read {self.url}/{key}: the server answered more "
                                                f"than the {want} bytes asked at {offset}")
                out[done: done + n] = memoryview(piece)
                done += n
            if done != want:
                raise StoreError(errno.EIO, f"read {self.url}/{key}: the server answered {done} of "
                                            f"the {want} bytes asked at {offset}")
            return size

        try:
            return int(self._call("read", key, fetch))
        except RangeNotSatisfiable:
            size = self.size(key)  # offset at or past the end: nothing to copy
            if size is None:
                raise FileNotFoundError(f"no such object: {self.url}/{key}") from None
            return size

    def read(self, key: str) -> bytes:
        check_key(key)
        return bytes(self._call("read", key, lambda: self._obs.get(self._store, self._root + key).bytes()))

    def size(self, key: str) -> int | None:
        try:
            return int(self._call("stat", key, lambda: self._obs.head(self._store, self._root + key))["size"])
        except FileNotFoundError:
            return None

    def files(self, prefix: str) -> list[str]:
        inside = f"{self._root}{prefix}/" if prefix else self._root
        found = self._call("files", prefix, lambda: self._obs.list_with_delimiter(
            self._store, inside or None))
        return sorted({o["path"].rsplit("/", 1)[-1] for o in found["objects"]})

    def list(self, prefix: str) -> list[str]:
        inside = f"{self._root}{prefix}/" if prefix else self._root
        found = self._call("list", prefix, lambda: self._obs.list_with_delimiter(
            self._store, inside or None))
        names = {p.rstrip("/").rsplit("/", 1)[-1] for p in found["common_prefixes"]}
        names |= {o["path"].rsplit("/", 1)[-1] for o in found["objects"]}
        return sorted(names)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        check_key(key)
        self._check_conditional_writes()
        self.point("write_manifest_tmp", key)
        self.point("rename_manifest", key)
        if not self.config.conditional_writes:
            if self.size(key) is not None:
                return False
            self._call("commit", key, lambda: self._obs.put(
                self._store, self._root + key, data, use_multipart=False))
            return True
        try:
            self._create(key, data)
        except FileExistsError:
            return False
        return True

    def swap(self, key: str, expected: bytes | None, new: bytes | None) -> bool:
        """Compare-and-swap on one small object: a read of its bytes and ETag, then a ``PUT``
        (or ``DELETE``) with ``If-Match`` on that ETag, or a create-only ``PUT`` when
        ``expected`` is None."""
        self._check_conditional_writes()
        self.point("swap", key)
        def fetch() -> tuple[bytes, str | None]:
            result = self._obs.get(self._store, self._root + key)
            return bytes(result.bytes()), result.meta["e_tag"]

        current: bytes | None
        etag: str | None
        try:
            current, etag = self._call("read", key, fetch)
        except FileNotFoundError:
            current, etag = None, None
        if current != expected:
            return False
        if new is None:
            return True if etag is None else self._signed.delete_if_match(key, etag)
        if etag is None:
            try:
                self._create(key, new)
            except FileExistsError:
                return False
            return True
        mode = {"e_tag": etag}
        try:
            self._call("swap", key, lambda: self._obs.put(self._store, self._root + key, new, mode=mode,
                                                          use_multipart=False))
        except Refused as e:
            return e.retried and self._holds(key, new)
        return True

    def abort_stale_uploads(self, older_than: float) -> int:
        """Aborts the multipart uploads under the store begun before Unix time ``older_than``
        (left by saves that died); returns how many."""
        stale = [u for u in self._signed.uploads(self._root) if u.initiated < older_than]
        for upload in stale:
            self.point("gc_delete", upload.key)
            self._signed.abort(upload)
        return len(stale)

    def delete(self, key: str) -> None:
        self.point("gc_delete", key)
        try:
            self._call("delete", key, lambda: self._obs.delete(self._store, self._root + key))
        except FileNotFoundError:
            pass

    def usage(self, prefix: str) -> tuple[int, float]:
        total, newest = 0, 0.0
        for meta in self._objects_under(prefix):
            total += int(meta["size"])
            newest = max(newest, meta["last_modified"].timestamp())
        return total, newest

    def delete_tree(self, prefix: str) -> None:
        check_key(prefix)
        self.point("gc_delete", prefix)
        paths = [m["path"] for m in self._objects_under(prefix)]
        # Servers that keep a file system behind S3 (SeaweedFS) list a folder emptied this way
        # as an object of its own: delete the folders too, deepest first (elsewhere a no-op).
        whole = self._root + prefix
        folders = {p.rsplit("/", i)[0] for p in paths for i in range(1, p[len(whole):].count("/") + 1)}
        paths += sorted(folders, key=len, reverse=True)
        for i in range(0, len(paths), 1000):
            batch = paths[i: i + 1000]
            self._call("delete", prefix, lambda: self._obs.delete(self._store, batch))

    # -- conditional writes -------------------------------------------------------------------

    def _create(self, key: str, body: Any, store: Any = None) -> None:
        """PUTs ``key`` only if absent (unless conditional writes are off) through ``store``
        (default: the signed client); raises FileExistsError when another object has the key. A
        request sent again after its answer was lost, then refused, finds its own object there:
        that counts as created."""
        mode = "create" if self.config.conditional_writes else "overwrite"
        try:
            self._call("write", key, lambda: self._obs.put(
                store or self._store, self._root + key, body, mode=mode, use_multipart=False))
        except Refused as e:
            if not (e.retried and self._holds(key, bytes(body))):
                raise

    def _holds(self, key: str, data: bytes) -> bool:
        """Whether ``key`` holds ``data``: after a request was sent again and refused, whether
        the first one went through (its answer was lost)."""
        try:
            return self.read(key) == data
        except FileNotFoundError:
            return False

    def _check_conditional_writes(self) -> None:
        """Once per storage, on a probe object: a second create-only ``PUT``, and a ``PUT`` and a
        ``DELETE`` with ``If-Match`` on an ETag the object does not have, must each be refused
        (commits rely on the first, the writer lease on the other two)."""
        if self._probed:
            return
        with self._probe_lock:
            if self._probed:
                return
            key = f"{PROBE_PREFIX}/{uuid.uuid4().hex}"
            body = b"deltackpt checks that this server honours If-None-Match and If-Match"
            self._create(key, body)

            def refused(mode: Any) -> bool:
                try:
                    self._call("probe", key, lambda: self._obs.put(
                        self._store, self._root + key, body + b"!", mode=mode, use_multipart=False))
                except FileExistsError:
                    return True
                return False

            try:
                ignored = [name for name, honoured in (
                    ("If-None-Match on PUT", lambda: refused("create")),
                    ("If-Match on PUT", lambda: refused({"e_tag": STALE_ETAG})),
                    ("If-Match on DELETE", lambda: not self._signed.delete_if_match(key, STALE_ETAG)),
                ) if not honoured()]
            finally:
                self.delete(key)
            if ignored:
                raise StoreError(None, f"the S3 server at {self.config.server} ignores "
                                       f"{' and '.join(ignored)}, so two writers could both commit "
                                       "a step or hold the writer lease; refusing it "
                                       "(storage_options conditional_writes=False goes on "
                                       "without, unsafe with two writers)")
            self._probed = True

    # -- plumbing ------------------------------------------------------------------------------

    def _objects_under(self, prefix: str) -> builtins.list[dict[str, Any]]:
        """Every object at ``prefix`` or under ``prefix/``."""
        whole = self._root + prefix
        try:  # the client lists what is under a folder, never the object of that name
            found = [self._call("stat", prefix, lambda: self._obs.head(self._store, whole))]
        except FileNotFoundError:
            found = []
        listed = self._call("list", prefix, lambda: [m for batch in self._obs.list(self._store, whole)
                                                     for m in batch])
        found.extend(m for m in listed if m["path"].startswith(whole + "/"))
        return found

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """Runs one client call, retrying what the client gives up on too early (a connection
        dropped in the middle of a request that is not idempotent) until ``retry_timeout``;
        maps the client's errors to the protocol's."""
        if key:
            check_key(key)  # keys come from records: none may leave the store's prefix
        exceptions = self._obs.exceptions
        deadline = time.monotonic() + self.config.retry_timeout
        delay = 0.05
        tries = 0
        while True:
            try:
                tries += 1
                return fn()
            except exceptions.NotFoundError:
                raise FileNotFoundError(f"no such object: {self.url}/{key}") from None
            except (exceptions.AlreadyExistsError, exceptions.PreconditionError) as e:
                retried = tries > 1 or retried_by_client(str(e))
                raise Refused(retried, f"object exists: {self.url}/{key}") from None
            except (exceptions.PermissionDeniedError, exceptions.UnauthenticatedError) as e:
                raise StoreError(errno.EACCES, f"{op} {self.url}/{key} refused: "
                                               f"{first_line(e)}") from None
            except exceptions.BaseError as e:
                text = str(e)
                if past_the_end(text):
                    raise RangeNotSatisfiable() from None
                if time.monotonic() + delay > deadline or not transient(text):
                    raise StoreError(errno.EIO, f"{op} {self.url}/{key} failed: "
                                                f"{first_line(e)}") from None
                log.debug("%s %s/%s: %s; retrying in %.2f s", op, self.url, key, first_line(e), delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)


def open_s3(url: str, options: Mapping[str, Any]) -> S3Storage:
    """The opener of ``s3://`` URLs (registered in :data:`~deltackpt.storage.schemes.OPENERS`)."""
    return S3Storage(S3Config.resolve(url, options))
