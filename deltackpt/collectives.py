"""The control plane of a save or restore: phases run on every rank, and their outcomes agree.

Each phase runs a local function on every rank, then exchanges (ok, result) or (failed, error)
with the others, so every rank learns of any rank's failure and raises one
:class:`CheckpointAborted` listing the failing ranks. The exchange runs on a dedicated gloo group
with a bounded timeout, so it never blocks on the training group's (possibly NCCL) traffic, and a
dead or hung peer turns into the same typed error instead of a raw gloo error or a hang. A world
of one needs no process group and runs the same code.

Call order (every rank, the same sequence): ``Collective(...)`` then, per operation, the same
phases in the same order.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from .errors import REQUEST_ERRORS, CheckpointAborted, DeltackptError, SettingError
from .wire import Wire

log = logging.getLogger(__name__)
T = TypeVar("T")
K = TypeVar("K")


class Collective:
    """Ranks taking part in checkpoint operations.

    Args:
        process_group: the ranks to checkpoint with; default: the whole default group when
            torch.distributed is initialized, else a world of one. A gloo group but the default
            one is used as it is (its ranks alone build the checkpointer), with its own timeout;
            over the default group or another backend's, a gloo group over the same ranks is
            created (a collective call of every rank of the job).
        timeout: how long a phase waits for a peer (but on a gloo group passed, see above).
        coordinator_rank: the rank (within the group) that plans and commits.
    """

    def __init__(self, process_group: Any = None, *, timeout: datetime.timedelta,
                 coordinator_rank: int = 0):
        if not isinstance(timeout, datetime.timedelta) or timeout <= datetime.timedelta(0):
            raise SettingError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")
        self.group: Any = None
        self.rank, self.size = 0, 1
        if process_group is not None and not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
            raise SettingError(f"process_group must be a torch.distributed ProcessGroup, got {process_group!r}")
        if process_group is not None or (dist.is_available() and dist.is_initialized()):
            pg = process_group or dist.group.WORLD
            if dist.get_backend(pg) == "gloo" and pg is not dist.group.WORLD:
                self.group = pg  # the caller's, with its timeout: its ranks alone get here
            else:
                # Over the default group too: gloo waits as long as the group's timeout says
                # (init_process_group's: 30 minutes by default), not this one.
                self.group = dist.new_group(dist.get_process_group_ranks(pg), backend="gloo", timeout=timeout)
            self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)
        if not 0 <= coordinator_rank < self.size:
            raise SettingError(f"coordinator_rank must be in [0, {self.size}), got {coordinator_rank}")
        self.coordinator = coordinator_rank
        self._wire: Wire | None = Wire(self.group, self.rank, self.size, coordinator_rank)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.coordinator

    def all(self, phase: str, fn: Callable[[], T]) -> list[T]:
        """Runs ``fn`` on every rank; returns every rank's result, by rank.

        Raises:
            CheckpointAborted: ``fn`` failed on some rank, or a peer died or timed out.
            DeltackptError: in a world of one, ``fn``'s own error, unchanged.
        """
        outcome = _run(fn)
        if self.size == 1:
            if not outcome[0]:
                raise outcome[1]
            return [outcome[1]]
        return self._results(phase, self._exchange(phase, lambda: self._net.all_gather(_portable(outcome))))

    def each(self, phase: str, fn: Callable[[], tuple[T, K]]) -> tuple[list[T], K]:
        """Like :meth:`all` for an ``fn`` that returns ``(sent, kept)``: every rank's ``sent``,
        by rank, and this rank's ``kept`` (which never crosses the wire)."""
        kept: list[K] = []

        def run() -> T:
            sent, keep = fn()
            kept.append(keep)
            return sent

        return self.all(phase, run), kept[0]

    def one(self, phase: str, fn: Callable[[], T]) -> T:
        """Runs ``fn`` on the coordinator only and hands its result (or error) to every rank."""
        outcome: tuple[bool, Any] = _run(fn) if self.is_coordinator else (True, None)
        if self.size == 1:
            if not outcome[0]:
                raise outcome[1]
            return outcome[1]
        ok, value = self._exchange(phase, lambda: self._net.broadcast(_portable(outcome)))
        if not ok:
            if isinstance(value, REQUEST_ERRORS):
                raise value  # a bad request (an unknown step, ...), the same on every rank
            raise CheckpointAborted({self.coordinator: (phase, _describe(value))})
        return value

    def gather(self, phase: str, fn: Callable[[], tuple[T, K]], then: Callable[[list[T]], Any],
               *, then_phase: str, per_rank: bool = False) -> tuple[Any, K]:
        """Runs ``fn``, which returns ``(sent, kept)``, on every rank; the coordinator alone
        receives every rank's ``sent``, by rank, and runs ``then`` on them; its result (or error)
        reaches every rank, beside this rank's ``kept``. With ``per_rank``, ``then`` returns one
        answer per rank and each rank receives only its own. No rank but the coordinator
        receives another rank's message.

        Raises:
            CheckpointAborted: ``fn`` failed on some rank (every failing rank is listed), ``then``
                failed on the coordinator, or a peer died or timed out.
            DeltackptError: in a world of one, ``fn``'s or ``then``'s own error, unchanged; on
                any world, ``then``'s error when it is a bad request (``REQUEST_ERRORS``).
        """
        kept: list[K] = []

        def run() -> T:
            sent, keep = fn()
            kept.append(keep)
            return sent

        outcome = _run(run)
        if self.size == 1:
            if not outcome[0]:
                raise outcome[1]
            answer = then([outcome[1]])
            return (answer[0] if per_rank else answer), kept[0]

        def reply(gathered: list[tuple[bool, Any]]) -> Any:
            failures = {r: (phase, _describe(v)) for r, (ok, v) in enumerate(gathered) if not ok}
            result: tuple[bool, Any] = (False, CheckpointAborted(failures)) if failures else _run(
                lambda: then([v for _, v in gathered]))
            ok, value = result
            if not ok:
                return [_portable((ok, value))] * self.size if per_rank else _portable((ok, value))
            return [(True, v) for v in value] if per_rank else (True, value)

        ok, value = self._exchange(phase, lambda: self._net.gather_reply(
            _portable(outcome), reply, per_rank=per_rank))
        if not ok:
            if isinstance(value, (CheckpointAborted, *REQUEST_ERRORS)):
                raise value
            raise CheckpointAborted({self.coordinator: (then_phase, _describe(value))})
        return value, kept[0]

    def close(self) -> None:
        """Lets go of the process group. A group still referenced when the interpreter exits
        outlives ``destroy_process_group``: its worker threads then drop their last collective's
        tensors during finalization, which aborts the process ("terminate called without an
        active exception")."""
        self.group = self._wire = None

    @property
    def _net(self) -> Wire:
        if self._wire is None:
            raise DeltackptError("the checkpointer is closed")
        return self._wire

    def _exchange(self, phase: str, op: Callable[[], T]) -> T:
        try:
            return op()
        except Exception as e:  # a dead peer ("Connection reset by peer") or a timeout
            log.error("checkpoint phase %s failed in the collective: %s", phase, e)
            raise CheckpointAborted({-1: (phase, f"a peer is unreachable: {e}")}) from e

    def _results(self, phase: str, gathered: list[Any]) -> list[Any]:
        failures = {r: (phase, _describe(v)) for r, (ok, v) in enumerate(gathered) if not ok}
        if failures:
            raise CheckpointAborted(failures)
        return [v for _, v in gathered]


def _run(fn: Callable[[], T]) -> tuple[bool, Any]:
    try:
        return True, fn()
    except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
        log.debug("checkpoint phase failed locally", exc_info=True)
        return False, e


def _portable(outcome: tuple[bool, Any]) -> tuple[bool, Any]:
    """Errors cross the wire as themselves when they pickle, else as their text."""
    ok, value = outcome
    if ok:
        return outcome
    import pickle

    try:
        pickle.loads(pickle.dumps(value))
        return outcome
    except Exception:  # noqa: BLE001 - any exception type, any pickling failure
        return False, _describe(value)


def _describe(e: Any) -> str:
    return e if isinstance(e, str) else f"{type(e).__name__}: {e}"
