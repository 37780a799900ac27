"""Saves that finish behind training: the handle a non-blocking save returns, and the one
background thread per checkpointer that writes and commits them, one at a time.

``Checkpointer.save(..., blocking=False)`` runs every phase up to ``stage`` on the calling thread,
then hands ``write`` and ``commit`` to :class:`Background` and returns a :class:`SaveHandle`.
The next ``save``, ``restore``, ``load``, ``wait`` or ``close`` first waits for it, and raises its
error if it failed (on every rank: the background phases are collectives too).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from concurrent.futures import Future

from ..errors import ClosedError
from ..io.threads import started_pool
from .types import SaveInfo


class SaveHandle:
    """A save whose write and commit run in the background.

    Attributes:
        step: the step being saved.
        blocked_seconds: how long the call blocked the caller (planning, change detection and
            staging; with a base larger than the memory budget, the writes that made room).

    Example:
        >>> import tempfile, torch, deltackpt
        >>> with deltackpt.Checkpointer(tempfile.mkdtemp()) as ckpt:
        ...     handle = ckpt.save(1, {"t": torch.zeros(8)}, blocking=False)
        ...     handle.result().kind, ckpt.steps()
        ('base', [1])
    """

    def __init__(self, step: int, blocked_seconds: float, future: Future[SaveInfo],
                 hurry: Callable[[], None]):
        self.step = step
        self.blocked_seconds = blocked_seconds
        self._future = future
        self._hurry = hurry
        self.reported = False  # whether the caller has seen the outcome

    def done(self) -> bool:
        """Whether the save committed or failed."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> SaveInfo:
        """Waits for the commit and returns what was written. From the first wait on, the save's
        files are written by every I/O thread free, no longer only by the cores training leaves
        (see ``Checkpointer``'s ``threads``): the caller's training is not running beside them.

        Raises:
            TimeoutError: ``timeout`` seconds passed first (the save goes on).
            DeltackptError: the save failed; nothing was committed.
        """
        if not self._future.done():
            self._hurry()
        try:
            info = self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the save of step {self.step} did not finish within {timeout} s") from None
        except BaseException:
            self.reported = True
            raise
        self.reported = True
        return info


class Background:
    """One thread that finishes saves, at most one in flight."""

    def __init__(self) -> None:
        self._thread = started_pool(1, "deltackpt-save")
        self._pending: SaveHandle | None = None
        self.closed = False

    def start(self, step: int, blocked_seconds: float, finish: Callable[[], SaveInfo],
              hurry: Callable[[], None]) -> SaveHandle:
        """Runs ``finish`` (the write and commit of ``step``) behind the caller; ``hurry`` lifts
        the bound on its writes, once the caller waits for them."""
        handle = SaveHandle(step, blocked_seconds, self._thread.submit(finish), hurry)
        self._pending = handle
        return handle

    def wait(self) -> SaveInfo | None:
        """Waits for the save in flight; returns what it wrote (None without one).

        Raises:
            DeltackptError: it failed, and the caller has not been told through its handle.
            ClosedError: :meth:`close` has run (every call of the checkpointer waits first).
        """
        if self.closed:
            raise ClosedError("the Checkpointer is closed")
        pending = self._pending  # forgotten once it has ended: a wait on another thread waits too
        if pending is None:
            return None
        told = pending.reported  # a failure its handle already raised is not raised twice
        try:
            return pending.result()
        except BaseException:
            if told:
                return None
            raise
        finally:
            if self._pending is pending:
                self._pending = None

    def close(self) -> None:
        """Waits for the thread to end (after :meth:`wait`)."""
        self.closed = True
        self._thread.shutdown(wait=True)
