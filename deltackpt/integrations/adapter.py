"""What both framework adapters hold: where to checkpoint, how often, whether to resume."""

from __future__ import annotations

import os

from ..checkpointer import Checkpointer
from ..errors import SettingError
from ..hooks import CheckpointHook
from ..storage import Storage


class AdapterSettings:
    """The settings of an adapter, and the hook it drives once training starts.

    Args:
        checkpointer: a Checkpointer, or a path or storage to open one on.
        every: save every this many optimizer steps.
        resume: restore before training: True for the latest step, or a step.
        track: track embedding rows by marks.
        blocking: whether saves block training until they commit (default: they write and
            commit in the background once the state is staged).

    Raises:
        SettingError: ``every`` is not a positive int.
    """

    def __init__(
        self,
        checkpointer: Checkpointer | str | os.PathLike[str] | Storage,
        *,
        every: int,
        resume: bool | int = False,
        track: bool = True,
        blocking: bool = False,
    ):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise SettingError(f"every must be a positive int, got {every!r}")
        self.checkpointer = checkpointer
        self.every = every
        self.resume = resume
        self.track = track
        self.blocking = blocking
        self.hook: CheckpointHook | None = None
        self.restored_step: int | None = None

