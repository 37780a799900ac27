"""Python's cyclic garbage collector, paused while the control plane builds or parses a plan or
a commit record, and while a restore or load reads.

At a thousand ranks these hold millions of small objects and make no reference cycles; every
collection of the older generations walks all of them again, which took half or more of the
time of planning, writing and parsing a record of a simulated 128-rank x 1,000-tensor job
(``bench/bench_control_plane.py``). A restore allocates enough to start a collection of the
whole process, whose heap is a trainer's: 0.22 s on each rank of a TorchRec restore that took
0.2 s without it. Reference counting still frees everything they drop.
"""

from __future__ import annotations

import gc
import threading
from contextlib import ContextDecorator
from typing import Any


class _Pauses:
    """The sections in progress, over every thread: the collector runs again after the last."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.was_enabled = False


_pauses = _Pauses()


class paused(ContextDecorator):  # noqa: N801 - reads as a decorator and a ``with`` statement
    """Pauses the cyclic collector for a block or a function (threads may nest them); restores
    it as it was once every paused section has ended.

    Example:
        >>> import gc
        >>> with paused():
        ...     gc.isenabled()
        False
    """

    def __enter__(self) -> paused:
        with _pauses.lock:
            if _pauses.depth == 0:
                _pauses.was_enabled = gc.isenabled()
                gc.disable()
            _pauses.depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        with _pauses.lock:
            _pauses.depth -= 1
            if _pauses.depth == 0 and _pauses.was_enabled:
                gc.enable()
