"""Writer fencing: one job at a time commits steps to a store.

The lease is one small JSON object, ``writer.lease``, that is only ever changed by
compare-and-swap (:meth:`Storage.swap`), so of any number of processes racing to take it exactly
one wins and every other one fails with :class:`WriterConflictError` naming the winner.

* The coordinator takes the lease at its first save and keeps it until :meth:`Holding.release`
  (``Checkpointer.close()``, or the interpreter's exit for a checkpointer never closed). A
  background thread renews it every ``ttl / 3`` seconds. The first save takes it already naming
  its ``head`` and ``attempt`` (below): one write, on an I/O thread, beside the save's scan.
* A lease is free when it was not renewed for ``ttl`` seconds, by the wall clock, or when its
  holder ran on this host and that process is gone: a job killed and restarted takes the lease of
  its dead predecessor by itself (at once on the same host, after at most ``ttl`` elsewhere).
  A lease that looks alive by the clock is watched for ``ttl`` seconds of this process's own clock:
  a renewal proves the holder alive (:class:`WriterConflictError`), none proves it dead; so two
  live writers stay fenced even when the hosts' clocks disagree.
* ``take_over=True`` replaces the lease that was there when the checkpointer was opened (held by a
  hung job, or unreadable), alive or not; a lease that changed since then (another job took it)
  is not taken.
* Each save publishes in the lease the step its delta applies to (``head``) and its attempt
  folder (``attempt``) before it writes anything; GC keeps both (see :mod:`deltackpt.ops.gc`).
* The commit re-reads the lease before and after creating the record. If the lease changed
  meanwhile, the record is withdrawn unless the new holder's published chain includes it (read
  again after the removal, which puts it back if it does by then). So a
  record stays only if its writer still held the lease after creating it, or the new holder
  builds on it, or its writer died between the creation and the re-check (then it is a complete
  step of the old holder's lineage, which the new holder builds on only if it restores it).
  Object stores give the same with conditional writes.

Readers (load, restore, verify, compaction, GC) need no lease.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
import weakref
from dataclasses import asdict, dataclass, replace

from ..errors import SettingError, WriterConflictError
from ..storage import Storage
from ..format.layout import LEASE

log = logging.getLogger(__name__)

DEFAULT_TTL = 30.0
MAX_TTL = 3600.0
"""The longest ttl a lease may have: a writer waits up to one ttl for another's lease, so a lease
file claiming more (damaged or hostile) is unreadable rather than a wait without end."""


@dataclass(frozen=True)
class Lease:
    """The content of ``writer.lease``.

    Attributes:
        holder: ``host:pid:random`` of the coordinator that holds it.
        epoch: one more than the lease it replaced.
        since: Unix time it was taken.
        renewed: Unix time of its last renewal.
        ttl: seconds without renewal after which it is free.
        head: ``(step, attempt)`` of the step the holder's next delta applies to, or None.
        attempt: the attempt folder of the holder's save in flight (or of its last save).
    """

    holder: str
    epoch: int
    since: float
    renewed: float
    ttl: float
    head: tuple[int, str] | None = None
    attempt: str | None = None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def from_json(data: bytes) -> Lease:
        """Parses a lease (older ones lack ``renewed``, ``ttl``, ``head`` and ``attempt``).

        Raises:
            ValueError: ``data`` is not a lease.
        """
        try:
            doc = json.loads(data)
            since = float(doc["since"])
            head = doc.get("head")
            lease = Lease(str(doc["holder"]), int(doc["epoch"]), since,
                          float(doc.get("renewed", since)), float(doc.get("ttl", DEFAULT_TTL)),
                          None if head is None else (int(head[0]), str(head[1])),
                          None if doc.get("attempt") is None else str(doc["attempt"]))
        except (ValueError, KeyError, TypeError, IndexError, RecursionError):
            raise ValueError("not a lease") from None
        if not all(math.isfinite(x) for x in (lease.since, lease.renewed)) or not 0 < lease.ttl <= MAX_TTL:
            raise ValueError("not a lease")
        return lease

    def describe(self, now: float | None = None) -> str:
        age = (time.time() if now is None else now) - self.renewed
        return f"{self.holder} (epoch {self.epoch}, renewed {age:.0f} s ago, ttl {self.ttl:g} s)"

    def free(self, now: float) -> bool:
        """Whether the lease can be taken without watching it: not renewed for ``ttl``
        seconds, or its holder ran on this host and is gone."""
        if now - self.renewed > self.ttl:
            return True
        host, _, pid = self.holder.partition(":")
        pid = pid.partition(":")[0]
        return host == _HOST and pid.isdigit() and not _alive(int(pid))


def check_ttl(ttl: float) -> float:
    """``ttl`` as a float, if it is a number of seconds in ``(0, MAX_TTL]``.

    Raises:
        SettingError: it is not.
    """
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= MAX_TTL:
        raise SettingError(f"lease_ttl must be a number of seconds above 0 and at most {MAX_TTL:g}, "
                           f"got {ttl!r}")
    return float(ttl)


def read(storage: Storage) -> tuple[bytes | None, Lease | None]:
    """The lease's bytes (None if absent) and the lease (None if absent or unreadable)."""
    try:
        raw = storage.read(LEASE)
    except FileNotFoundError:
        return None, None
    try:
        return raw, Lease.from_json(raw)
    except ValueError:
        return raw, None


def identity(raw: bytes | None, lease: Lease | None) -> tuple[str, int] | bytes | None:
    """What ``take_over`` compares: the holder and epoch of a lease (renewals do not change
    them), the bytes of an unreadable one, None for none."""
    return (lease.holder, lease.epoch) if lease is not None else raw


class Holding:
    """The lease this process holds: renewed in the background until :meth:`release`.

    Args:
        storage: the store's storage.
        lease: the lease as written.
    """

    def __init__(self, storage: Storage, lease: Lease):
        self.storage = storage
        self.lease = lease
        self._lock = threading.Lock()
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="deltackpt-lease", daemon=True)
        self._thread.start()

    def _swap(self, new: Lease | None) -> bool:
        """Replaces the lease by ``new`` if it is still ours; notes the loss if not."""
        with self._lock:
            if self._lost is not None:
                return False
            if self.storage.swap(LEASE, self.lease.to_json(), None if new is None else new.to_json()):
                if new is not None:
                    self.lease = new
                return True
            _, current = read(self.storage)
            self._lost = current.describe() if current is not None else "unknown"
            return False

    def _beat(self) -> None:
        while not self._stop.wait(self.lease.ttl / 3):
            try:
                if not self._swap(replace(self.lease, renewed=time.time())):
                    return
            except Exception as e:  # a storage hiccup: the next beat tries again
                log.warning("could not renew the writer lease of %s: %s", self.storage.url, e)

    def publish(self, head: tuple[int, str] | None, attempt: str) -> None:
        """Writes the step the next delta applies to and the attempt folder about to be written.

        Raises:
            WriterConflictError: the lease was taken over.
        """
        if not self._swap(replace(self.lease, renewed=time.time(), head=head, attempt=attempt)):
            self._conflict()

    def check(self) -> None:
        """Raises WriterConflictError unless the stored lease is still exactly ours."""
        with self._lock:
            if self._lost is None:
                raw, current = read(self.storage)
                if raw != self.lease.to_json():
                    self._lost = current.describe() if current is not None else "unknown"
        if self._lost is not None:
            self._conflict()

    def _conflict(self) -> None:
        raise WriterConflictError(
            f"the lease on {self.storage.url} was taken over by {self._lost}")

    def release(self) -> None:
        """Stops renewing and removes the lease if it is still ours (idempotent)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._swap(None)


class Claim:
    """A checkpointer's hold on the lease: taken at its first save, kept until :meth:`release`,
    released also when the checkpointer is collected or the interpreter exits without it.

    Args:
        storage: the store's storage.
        ttl: the lease's ttl (see :func:`check_ttl`).
        take_over: replace the lease found now (read here), alive or not, and no later one.

    Raises:
        SettingError: ``ttl`` is not in ``(0, MAX_TTL]``.
    """

    def __init__(self, storage: Storage, *, ttl: float, take_over: bool):
        self.storage = storage
        self.ttl = check_ttl(ttl)
        self.take_over = take_over
        self.seen = identity(*read(storage)) if take_over else None
        self.holding: Holding | None = None
        self._release: weakref.finalize | None = None

    def hold(self) -> Holding:
        """The lease, taken first if not held yet (see :func:`acquire`)."""
        return self.holding if self.holding is not None else self._take(None, None)

    def publish(self, head: tuple[int, str] | None, attempt: str) -> None:
        """Publishes ``head`` and ``attempt`` (see :meth:`Holding.publish`), taking the lease
        with them in one write if it is not held yet (see :func:`acquire`).

        Raises:
            WriterConflictError: another writer holds the lease or took it over.
        """
        if self.holding is not None:
            self.holding.publish(head, attempt)
        else:
            self._take(head, attempt)

    def _take(self, head: tuple[int, str] | None, attempt: str | None) -> Holding:
        holding = self.holding = acquire(self.storage, ttl=self.ttl, take_over=self.take_over,
                                         seen=self.seen, head=head, attempt=attempt)
        self._release = weakref.finalize(self, holding.release)
        return holding

    def release(self) -> None:
        """Gives the lease up if held (idempotent)."""
        if self._release is not None:
            self._release()
        self.holding = self._release = None


def acquire(storage: Storage, *, ttl: float, take_over: bool,
            seen: tuple[str, int] | bytes | None = None, head: tuple[int, str] | None = None,
            attempt: str | None = None) -> Holding:
    """Takes the lease for this process.

    Args:
        storage: the store's storage.
        ttl: seconds without renewal after which the new lease is free.
        take_over: replace the lease whose :func:`identity` is ``seen``, alive or not.
        seen: with ``take_over``, the identity of the lease found when the store was opened.
        head, attempt: what the new lease publishes (see :meth:`Holding.publish`).

    Raises:
        WriterConflictError: another live holder has the lease, took it first, or it is
            unreadable (and ``take_over`` is False); the message names the holder or says
            ``unknown``.
    """
    watched: tuple[bytes | None, float] | None = None
    while True:
        raw, current = read(storage)
        now = time.time()
        if take_over:
            if identity(raw, current) != seen:
                raise _taken(storage, current)
        elif raw is not None and current is None:
            raise WriterConflictError(f"{storage.url}/{LEASE} is unreadable; remove it or take "
                                      "over the lease explicitly (take_over=True)")
        elif current is not None and not current.free(now):
            host, _, pid = current.holder.partition(":")
            if host == _HOST and pid.partition(":")[0] == str(os.getpid()):
                raise _held(storage, current)  # a live checkpointer of this very process
            if watched is None:
                watched = (raw, time.monotonic() + current.ttl)
                log.warning("the writer lease of %s is held by %s: waiting up to %g s for a "
                            "renewal that proves its holder alive", storage.url, current.describe(now),
                            current.ttl)
            if raw != watched[0]:
                raise _held(storage, current)  # renewed while we watched: its holder lives
            if time.monotonic() < watched[1]:
                time.sleep(min(1.0, current.ttl / 10))
                continue
        lease = Lease(f"{_HOST}:{os.getpid()}:{uuid.uuid4().hex[:8]}",
                      current.epoch + 1 if current is not None else 1, now, now, ttl, head, attempt)
        if storage.swap(LEASE, raw, lease.to_json()):
            return Holding(storage, lease)
        raise _taken(storage, read(storage)[1])


def _held(storage: Storage, current: Lease) -> WriterConflictError:
    return WriterConflictError(
        f"another writer holds {storage.url}: {current.describe()}; if that job is dead the "
        "lease frees itself after its ttl, or take over with Checkpointer(..., take_over=True)")


def _taken(storage: Storage, current: Lease | None) -> WriterConflictError:
    who = current.describe() if current is not None else "unknown"
    return WriterConflictError(f"another writer took the lease on {storage.url}: {who}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_HOST = socket.gethostname()
