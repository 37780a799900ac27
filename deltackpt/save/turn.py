"""One save, restore or close of a checkpointer at a time, whatever the thread."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from ..errors import ReentrantCallError


class Turn:
    """Taken by each save, restore and close of a checkpointer: another thread's waits for it.

    The thread that holds it cannot take it again. A signal handler runs on the thread whose
    call it interrupted, which holds the locks that call took (the standard library's among
    them) and has its work half done: a save there waited for itself (a pool's lock, the
    lease's) or started on what the interrupted save had taken. It raises
    :class:`~deltackpt.errors.ReentrantCallError` instead.
    """

    def __init__(self) -> None:
        # Re-entrant, so that the thread that holds it gets in to be refused: a plain lock
        # would wait for itself for ever.
        self._lock = threading.RLock()
        self._held_by: str | None = None  # the call that holds it, set and cleared in one step

    @contextlib.contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        """Holds the turn for the call ``what`` ("save", "restore", "close")."""
        with self._lock:
            # A handler that runs before the line below, or after the one in finally, runs
            # whole, before the call starts or after it ends: only one inside it is refused.
            if self._held_by is not None:
                raise ReentrantCallError(
                    f"{what} was called inside this thread's {self._held_by} (from a signal "
                    f"handler?), where it cannot run: note the request there and {what} after")
            self._held_by = what
            try:
                yield
            finally:
                self._held_by = None
