"""Python objects between ranks in fixed-size frames: one collective operation when they fit.

torch's object collectives send every message in two or three operations (its size, then its
bytes), and a save's control plane is a handful of small messages, so round trips, not bytes,
make its cost. Here every message travels in a frame of a size all ranks know: a header and, when
it fits, the pickled message itself. A message that does not fit costs one more
operation, sized by the headers:

- ``all_gather``: every rank sees every header, so all ranks send their messages again in frames
  of the longest one's size.
- ``gather_reply``: only the root sees the headers. Its reply frame then says "resend, in frames of
  N bytes" instead of the reply; every rank resends and waits for the reply again.
- ``broadcast`` and the reply: a frame holds the reply's length, and the reply itself when it fits;
  otherwise a second broadcast (or scatter) of that length follows.

The frame's size shrinks with the world so that the root receives at most ``FRAME_BUDGET`` bytes
in a round.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .collector import paused

FRAME_BUDGET = 1 << 20
"""Bytes the root receives in one round of frames, from all ranks together."""
FRAME_MAX = 16 << 10
FRAME_MIN = 256
_HEADER = 16  # two little-endian int64: a message's (length, 0), or a reply's (kind, length)
_REPLY, _RESEND = 0, 1


class Wire:
    """The frames of one process group.

    Args:
        group: the (gloo) process group; None for a world of one, which sends nothing.
        rank: this process's rank in ``group``.
        size: the group's size.
        root: the rank (in ``group``) that gathers, replies and broadcasts.
    """

    def __init__(self, group: Any, rank: int, size: int, root: int):
        self._group = group
        self._rank = rank
        self._size = size
        self._root = root
        self._src = root if group is None else dist.get_global_rank(group, root)
        self.frame = min(FRAME_MAX, max(FRAME_MIN, FRAME_BUDGET // size))

    @property
    def _is_root(self) -> bool:
        return self._rank == self._root

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank, on every rank."""
        data = _dumps(obj)
        frames = self._frames(self._size, self.frame)
        dist.all_gather(list(frames), _frame(self.frame, len(data), 0, data), group=self._group)
        lengths = [_header(f)[0] for f in frames]
        longest = max(lengths)
        if longest <= self.frame - _HEADER:
            return [_loads(f, n) for f, n in zip(frames, lengths)]
        again = self._frames(self._size, longest + _HEADER)
        dist.all_gather(list(again), _frame(longest + _HEADER, len(data), 0, data), group=self._group)
        return [_loads(f, n) for f, n in zip(again, lengths)]

    def broadcast(self, obj: Any) -> Any:
        """The root's ``obj`` (ignored elsewhere), on every rank."""
        if not self._is_root:
            return self._receive_reply(per_rank=False, resend=None)
        self._send_reply([_dumps(obj)], per_rank=False)
        return obj

    def gather_reply(self, obj: Any, reply: Callable[[list[Any]], Any], *, per_rank: bool) -> Any:
        """Every rank's ``obj`` goes to the root alone, which calls ``reply`` on them (by rank);
        its result reaches every rank (``per_rank``: a list with one answer per rank, each rank
        receiving only its own). Returns this rank's answer."""
        data = _dumps(obj)
        frames = self._frames(self._size, self.frame) if self._is_root else None
        dist.gather(_frame(self.frame, len(data), 0, data), None if frames is None else list(frames),
                    dst=self._src, group=self._group)
        if frames is None:
            return self._receive_reply(per_rank, resend=data)
        lengths = [_header(f)[0] for f in frames]
        longest = max(lengths)
        if longest > self.frame - _HEADER:  # some did not fit: every rank sends again, larger
            self._send_frames(_frame(self.frame, _RESEND, longest + _HEADER, b""), per_rank)
            frames = self._frames(self._size, longest + _HEADER)
            dist.gather(_frame(longest + _HEADER, len(data), 0, data), list(frames), dst=self._src,
                        group=self._group)
        with paused():  # thousands of local plans unpickled: collections took 85% of the time
            answer = reply([_loads(f, n) for f, n in zip(frames, lengths)])
        datas = [_dumps(a) for a in answer] if per_rank else [_dumps(answer)]
        self._send_reply(datas, per_rank)
        return answer[self._rank] if per_rank else answer

    # A reply frame's header is (_REPLY, n) with n bytes inline, or (_REPLY, -m): a second
    # broadcast (or scatter) of m-byte frames follows, each a frame of its own.

    def _send_reply(self, datas: list[bytes], per_rank: bool) -> None:
        longest = max(len(d) for d in datas)
        if longest <= self.frame - _HEADER:
            self._send_frames([_frame(self.frame, _REPLY, len(d), d) for d in datas], per_rank)
            return
        size = longest + _HEADER
        self._send_frames([_frame(self.frame, _REPLY, -size, b"")] * len(datas), per_rank)
        self._send_frames([_frame(size, len(d), 0, d) for d in datas], per_rank)

    def _receive_reply(self, per_rank: bool, resend: bytes | None) -> Any:
        """A rank but the root: the root's reply; on its request, ``resend`` (this rank's
        message) goes to it again in larger frames first."""
        while True:
            frame = self._receive_frame(self.frame, per_rank)
            kind, n = _header(frame)
            if kind == _RESEND and resend is not None:
                dist.gather(_frame(n, len(resend), 0, resend), None, dst=self._src, group=self._group)
                continue
            if kind != _REPLY:
                raise ValueError(f"a reply frame of unknown kind {kind}")
            if n >= 0:
                return _loads(frame, n)
            body = self._receive_frame(-n, per_rank)
            return _loads(body, _header(body)[0])

    def _receive_frame(self, size: int, per_rank: bool) -> torch.Tensor:
        frame = torch.zeros(size, dtype=torch.uint8)
        if per_rank:
            dist.scatter(frame, None, src=self._src, group=self._group)
        else:
            dist.broadcast(frame, src=self._src, group=self._group)
        return frame

    def _send_frames(self, frames: torch.Tensor | list[torch.Tensor], per_rank: bool) -> None:
        """Root: one frame to every rank (a list: one per rank with ``per_rank``, else its only
        frame); a lone frame with ``per_rank`` goes to every rank."""
        if isinstance(frames, torch.Tensor):
            frames = [frames] * self._size if per_rank else [frames]
        if per_rank:
            mine = torch.zeros_like(frames[self._rank])
            dist.scatter(mine, frames, src=self._src, group=self._group)
        else:
            dist.broadcast(frames[0], src=self._src, group=self._group)

    @staticmethod
    def _frames(count: int, size: int) -> torch.Tensor:
        return torch.zeros(count, size, dtype=torch.uint8)


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _frame(size: int, first: int, second: int, data: bytes) -> torch.Tensor:
    """A frame of ``size`` bytes: the header ``(first, second)`` and ``data`` when it fits."""
    frame = torch.zeros(size, dtype=torch.uint8)
    view = frame.numpy()
    view[:_HEADER].view("<i8")[:] = (first, second)
    if len(data) <= size - _HEADER:
        view[_HEADER:_HEADER + len(data)] = np.frombuffer(data, dtype=np.uint8)
    return frame


def _header(frame: torch.Tensor) -> tuple[int, int]:
    first, second = frame.numpy()[:_HEADER].view("<i8")
    return int(first), int(second)


def _loads(frame: torch.Tensor, n: int) -> Any:
    return pickle.loads(frame.numpy()[_HEADER:_HEADER + n].data)
