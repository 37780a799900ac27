"""One object that checkpoints a plain training loop: saves on a schedule, tracks rows, restores.

Call order, per training step::

    hook = CheckpointHook(path, state, every=100)   # tracks the model's embedding rows
    start = hook.restore()                           # None on a fresh store
    for step in range(start or 0, total):
        loss(step).backward()
        hook.before_optimizer_step()                 # marks rows of sparse gradients
        optimizer.step()
        hook.on_step_end(step + 1)                   # saves when (step + 1) % every == 0
    hook.close()

The adapters in :mod:`deltackpt.integrations` drive the same object from Lightning and Hugging
Face trainers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping
from typing import Any, Self

import torch
from torch import nn

from .checkpointer import Checkpointer, SaveInfo
from .errors import HookClosedError, SettingError, StateError
from .save.pending import SaveHandle
from .statetree import child_key, is_stateful, walk
from .storage import Storage
from .tracking.rows import TrackHandle

log = logging.getLogger(__name__)


class CheckpointHook:
    """Saves ``state`` every ``every`` steps, restores it, and tracks the model's embedding rows.

    At construction the hook finds ``model`` (default: ``state["model"]``) and its optimizers in
    ``state`` and tracks the model with :meth:`Checkpointer.track`: every ``nn.Embedding`` and
    ``nn.EmbeddingBag`` lookup marks the rows a delta must write, and the optimizer that holds
    most of the tables shares their marks for its row-aligned state.

    A step that is already committed is not saved again (a warning says so): a run restored at
    an earlier step and retrained deterministically reaches the same state at those steps, and a
    committed step never changes.

    Args:
        checkpointer: a :class:`~deltackpt.Checkpointer`, or a path or storage to open one on
            (the hook then owns it and closes it in :meth:`close`).
        state: what to save and restore, as :meth:`Checkpointer.save` takes it, e.g. a
            :class:`~deltackpt.examples.TrainState`.
        every: save when ``step % every == 0``.
        model: the model whose embedding rows to track; default ``state["model"]`` when that is
            an ``nn.Module``. It must be somewhere in ``state`` (nested mappings and lists).
        track: whether to track rows; without it every save finds changes by hashing.
        blocking: whether a save blocks until it committed; by default it returns once the state
            is staged and writes in the background (see :meth:`Checkpointer.save`).

    Raises:
        SettingError: ``every`` is not a positive int.
        StateError: ``state`` is not a mutable mapping, or ``model`` is not inside it.

    Example:
        >>> import tempfile
        >>> model = nn.EmbeddingBag(100, 4, mode="sum")
        >>> state = {"model": model, "step": 0}
        >>> with CheckpointHook(tempfile.mkdtemp(), state, every=2) as hook:
        ...     for step in range(1, 5):
        ...         state["step"] = step
        ...         _ = hook.on_step_end(step)
        ...     _ = hook.checkpointer.wait()
        ...     hook.checkpointer.steps()
        [2, 4]
    """

    def __init__(
        self,
        checkpointer: Checkpointer | str | os.PathLike[str] | Storage,
        state: MutableMapping[str, Any],
        *,
        every: int,
        model: nn.Module | None = None,
        track: bool = True,
        blocking: bool = False,
    ):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise SettingError(f"every must be a positive int, got {every!r}")
        if not isinstance(state, MutableMapping):
            raise StateError(f"state must be a mutable mapping, got {type(state).__name__}")
        self.every = every
        self.state = state
        self.blocking = blocking
        self._owned = not isinstance(checkpointer, Checkpointer)
        self.checkpointer: Checkpointer = (
            checkpointer if isinstance(checkpointer, Checkpointer) else Checkpointer(checkpointer))
        self._closed = False
        if model is None and isinstance(state.get("model"), nn.Module):
            model = state["model"]
        self.model = model
        self._handle: TrackHandle | None = None
        # (flat key, parameter) of parameters whose sparse gradients the forward hooks cannot
        # see; before_optimizer_step marks their rows.
        self._unhooked: list[tuple[str, nn.Parameter]] = []
        if model is not None and track:
            self._track(model)

    def _track(self, model: nn.Module) -> None:
        stateful = _stateful(self.state)
        prefix = next((path for path, obj in stateful if obj is model), None)
        if prefix is None:
            raise StateError(
                f"the model ({type(model).__name__}) is not in the state, so its tensors' keys "
                f"are unknown; put it there (e.g. state['model'] = model) or pass track=False"
            )
        tables = [m.weight for m in model.modules()
                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
        optimizer, optimizer_prefix = _table_optimizer(stateful, tables)
        handle = self.checkpointer.track(model, prefix=prefix, optimizer=optimizer,
                                         optimizer_prefix=optimizer_prefix)
        self._handle = handle
        hooked = set(handle.keys)
        for name, p in model.named_parameters():
            key = child_key(prefix, name)
            if key not in hooked:
                self._unhooked.append((key, p))

    # -- the training loop's calls ----------------------------------------------------------------

    def before_optimizer_step(self) -> None:
        """Marks the rows of every sparse gradient the embedding hooks did not see.

        A parameter outside ``nn.Embedding``/``nn.EmbeddingBag`` that gets a sparse gradient (a
        custom module calling ``F.embedding(..., sparse=True)``) changes only the rows the
        gradient holds under SGD, Adagrad and SparseAdam; marking them keeps its delta small.
        Call it after ``backward()`` and before ``optimizer.step()``.

        Raises:
            HookClosedError: the hook is closed.
        """
        self._check_open()
        for key, p in self._unhooked:
            grad = p.grad
            if grad is not None and grad.is_sparse:
                # _indices(): an uncoalesced gradient's ids, duplicates included, without the
                # sort that coalesce() would cost; marking is idempotent.
                self.checkpointer.mark(key, grad._indices()[0])

    def on_step_end(self, step: int) -> SaveInfo | SaveHandle | None:
        """Saves the state as ``step`` when ``step % every == 0``.

        Args:
            step: the steps done so far (after the optimizer step).

        Returns:
            What the save did, or None when no save was due or ``step`` is committed already.

        Raises:
            SettingError: ``step`` is not a non-negative int.
            HookClosedError: the hook is closed.
        """
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise SettingError(f"step must be a non-negative int, got {step!r}")
        return self.save(step) if step % self.every == 0 else None

    def save(self, step: int) -> SaveInfo | SaveHandle | None:
        """Saves the state as ``step`` now, off the schedule (e.g. the last step of a run).

        Args:
            step: the steps done so far.

        Returns:
            What the save did (a handle to it unless the hook blocks), or None when ``step``
            is committed already.

        Raises:
            HookClosedError: the hook is closed.
            StepExistsError: ``step`` is before the latest committed step but not committed.
        """
        self._check_open()
        if step in self.checkpointer.steps():
            log.warning("step %d is committed already; not saving it again", step)
            return None
        if self.blocking:
            return self.checkpointer.save(step, self.state)
        return self.checkpointer.save(step, self.state, blocking=False)

    def restore(self, step: int | None = None) -> int | None:
        """Restores ``step`` (default: the latest) into the state in place.

        Returns:
            The step restored, or None when ``step`` is None and nothing is committed yet (a
            fresh start).

        Raises:
            StepNotFoundError: ``step`` is not committed.
            HookClosedError: the hook is closed.
            KeyMismatchError, ShapeMismatchError, DtypeMismatchError: the state does not match
                what was saved; nothing was changed.
        """
        self._check_open()
        if step is None and self.checkpointer.latest_step() is None:
            return None
        return self.checkpointer.restore(self.state, step)

    # -- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for the save in flight, removes the tracking hooks, and closes the checkpointer if
        the hook opened it.

        Calling it again does nothing.
        """
        if self._closed:
            return
        self._closed = True
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._owned:
            self.checkpointer.close()
        else:
            self.checkpointer.wait()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def tracked_keys(self) -> tuple[str, ...]:
        """Flat keys of the tables whose rows lookups mark; empty when nothing is tracked."""
        return self._handle.keys if self._handle is not None else ()

    def _check_open(self) -> None:
        if self._closed:
            raise HookClosedError("the CheckpointHook is closed")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stateful(state: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(flat-key path, object) of every stateful object (module, optimizer...) in ``state``; the
    paths are those :func:`deltackpt.statetree.flatten` gives the object's tensors."""
    return [(path, obj) for path, obj in walk(state) if is_stateful(obj) and not isinstance(obj, Mapping)]


def _table_optimizer(
    stateful: list[tuple[str, Any]], tables: list[torch.Tensor]
) -> tuple[torch.optim.Optimizer | None, str]:
    """The optimizer holding the most ``tables``, and its path; (None, "") if none holds any.
    Tables under another optimizer still restore exactly: their optimizer state is hashed."""
    wanted = {id(t) for t in tables}
    best: tuple[torch.optim.Optimizer | None, str] = (None, "")
    best_count = 0
    for path, obj in stateful:
        if isinstance(obj, torch.optim.Optimizer):
            count = sum(id(p) in wanted for g in obj.param_groups for p in g["params"])
            if count > best_count:
                best, best_count = (obj, path), count
    return best
