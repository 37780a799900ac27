"""A restored step as torch files, for the ``restore`` command: the state in one file, or one
file per rank of a row-sharded restore, each with where its shards sit."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..errors import DeltackptError, OutputExistsError
from ..sharding import Shard
from ..statetree import child_key, flatten

if TYPE_CHECKING:
    from ..checkpointer import Checkpointer


def write_step(ckpt: Checkpointer, step: int, out: str, *, world_size: int | None = None,
               keys: Sequence[str] | None = None, overwrite: bool = False,
               progress: Callable[[int], None] = lambda n: None) -> list[str]:
    """Writes ``step`` (its tensors ``keys``, if given) to the file ``out``, or with
    ``world_size`` to one file per rank in the folder ``out``
    (``rank00000-of-00002.pt``...); returns the files written. ``progress`` is called with the
    tensor bytes of each file written.

    Raises:
        OutputExistsError: a file to write exists and ``overwrite`` is False (checked before
            anything is written).
        DeltackptError: a bad ``world_size`` or ``out``, or a file that cannot be written.
    """
    if world_size is not None and world_size < 1:
        raise DeltackptError(f"--world-size must be >= 1, got {world_size}")
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise DeltackptError(f"--out: the folder {parent} does not exist")
    if world_size is None and os.path.isdir(out):
        raise DeltackptError(f"--out: {out} is a folder; name the file to write (or pass --world-size)")
    if keys or world_size is None:
        _check_absent([out], overwrite)
        loaded = ckpt.load(step, keys=keys) if keys else ckpt.load(step)
        _save_atomic(loaded, out)
        progress(_tensor_bytes(loaded))
        return [out]
    _check_absent((_rank_file(out, rank, world_size) for rank in range(world_size)), overwrite)
    os.makedirs(out, exist_ok=True)
    written = []
    for rank in range(world_size):
        path = _rank_file(out, rank, world_size)
        shards: dict[str, dict[str, list[int]]] = {}
        loaded = ckpt.load(step, row_shard=(rank, world_size))
        state = _unshard(loaded, "", shards)
        doc = {"step": step, "rank": rank, "world_size": world_size, "state": state, "shards": shards}
        _save_atomic(doc, path)
        written.append(path)
        progress(_tensor_bytes(loaded))
    return written


def _tensor_bytes(state: Any) -> int:
    return sum(s.local.nbytes for s in flatten(state).tensors.values())


def _rank_file(out: str, rank: int, world_size: int) -> str:
    return os.path.join(out, f"rank{rank:05d}-of-{world_size:05d}.pt")


def _check_absent(paths: Iterable[str], overwrite: bool) -> None:
    if not overwrite:
        for path in paths:
            if os.path.lexists(path):
                raise OutputExistsError(f"{path} exists; pass --force to replace it")


def _save_atomic(obj: Any, path: str) -> None:
    """Writes ``obj`` to a temp file beside ``path`` and renames it there; no temp file stays
    behind when either step fails."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, (OSError, RuntimeError)):  # torch.save reports a bad path as RuntimeError
            raise DeltackptError(f"--out: cannot write {path}: {e}") from None
        raise


def _unshard(obj: Any, path: str, shards: dict[str, dict[str, list[int]]]) -> Any:
    """Replaces Shards by their local tensors, noting where each sits in ``shards`` by its flat
    key."""
    if isinstance(obj, Shard):
        shards[path] = {"global_shape": list(obj.global_shape), "global_offset": list(obj.global_offset)}
        return obj.local
    if isinstance(obj, dict):
        return {k: _unshard(v, child_key(path, k), shards) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unshard(v, child_key(path, i), shards) for i, v in enumerate(obj))
    return obj
