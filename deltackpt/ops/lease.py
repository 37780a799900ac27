"""Writer fencing: one job at a time may commit steps to a store.

The coordinator of the first save takes the lease: ``writer.lease``, created only if absent,
naming the holder (host, process, a random id) and an epoch. A second writer fails fast with
:class:`WriterConflictError` naming the holder. A lease left by a dead job is taken over only
explicitly (``Checkpointer(..., take_over=True)``), which bumps the epoch; before each commit the
holder checks the lease is still its own, so a writer whose lease was taken over cannot commit.
Readers (load, restore, verify, compaction, GC) need no lease.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass

from ..errors import WriterConflictError
from ..format.layout import LEASE
from ..store import Store


@dataclass(frozen=True)
class Lease:
    holder: str
    epoch: int
    since: float

    def describe(self) -> str:
        return f"{self.holder} (epoch {self.epoch}, since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.since))})"


def holder_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def read(store: Store) -> Lease | None:
    try:
        doc = json.loads(store.storage.read(LEASE))
        return Lease(str(doc["holder"]), int(doc["epoch"]), float(doc["since"]))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        raise WriterConflictError(f"{store.storage.url}/{LEASE} is unreadable; remove it or "
                                  "take over the lease explicitly") from None


def acquire(store: Store, holder: str, *, take_over: bool) -> Lease:
    """Takes the lease for ``holder``.

    Raises:
        WriterConflictError: another holder has it (and ``take_over`` is False).
    """
    current = read(store) if not take_over else _read_lenient(store)
    if current is not None and current.holder == holder:
        return current
    if current is not None and not take_over:
        raise WriterConflictError(
            f"another writer holds {store.storage.url}: {current.describe()}; if that job is "
            "dead, take over with Checkpointer(..., take_over=True)"
        )
    lease = Lease(holder, (current.epoch + 1) if current else 1, time.time())
    if current is not None:
        store.storage.delete(LEASE)
    if not store.storage.put_if_absent(LEASE, json.dumps(asdict(lease)).encode()):
        winner = read(store)
        raise WriterConflictError(f"another writer took {store.storage.url}: "
                                  f"{winner.describe() if winner else 'its lease is gone again'}")
    return lease


def check(store: Store, lease: Lease) -> None:
    """Raises WriterConflictError unless ``lease`` is still the store's lease."""
    current = _read_lenient(store)
    if current != lease:
        who = current.describe() if current else "nobody"
        raise WriterConflictError(f"the lease on {store.storage.url} was taken over by {who}")


def release(store: Store, lease: Lease) -> None:
    if _read_lenient(store) == lease:
        store.storage.delete(LEASE)


def _read_lenient(store: Store) -> Lease | None:
    try:
        return read(store)
    except WriterConflictError:
        return None
