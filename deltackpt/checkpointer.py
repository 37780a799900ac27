"""The Checkpointer: save, list, load and restore steps of one store."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from . import dtypes, statetree
from .changes import ChangeTracker, TensorChange, is_row_sparse
from .errors import StepExistsError, StepNotFoundError
from .manifest import Manifest
from .policy import BasePolicy, ChainState, EveryK
from .reader import ChainReader
from .restoring import plan_restore
from .staging import StagingPool
from .storage import Storage
from .store import STEPS, Store, open_storage
from .verify import VerifyReport, verify
from .writer import StepWriter

log = logging.getLogger(__name__)

MiB = 1 << 20


@dataclass(frozen=True)
class SaveInfo:
    """What one save did.

    Attributes:
        step: the step saved.
        kind: ``"base"`` or ``"delta"``.
        bytes_written: bytes of every chunk file written.
        state_bytes: bytes of every tensor of the state (what a full checkpoint writes).
        rows_changed: rows written for row-sparse tensors (all rows, for a base).
        seconds: wall time of the save.
        reason: why the policy chose this kind.
    """

    step: int
    kind: str
    bytes_written: int
    state_bytes: int
    rows_changed: int
    seconds: float
    reason: str


class Checkpointer:
    """Saves training state as bases and deltas into a zarr v3 store, and restores any step.

    Args:
        path: a local directory (created if absent) or a :class:`~deltackpt.storage.Storage`.
        base_every: a base every this many saves (ignored when ``policy`` is given).
        policy: the base-cadence policy; default ``EveryK(base_every)``.
        chunk_bytes: target size of a chunk file.
        dense_chunk_bytes: change-detection granularity of dense (0-d, 1-d) tensors.
        memory_budget: bytes of host staging memory a save or restore may add.
        io_threads: parallel reads and writes.
        create: create the store if absent; if False, a missing store raises StoreError.

    Example:
        >>> import tempfile, torch
        >>> ckpt = Checkpointer(tempfile.mkdtemp())
        >>> ckpt.save(1, {"emb": torch.zeros(4, 2), "step": 1}).kind
        'base'
        >>> ckpt.load(1)["step"]
        1
        >>> ckpt.close()
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Storage,
        *,
        base_every: int = 10,
        policy: BasePolicy | None = None,
        chunk_bytes: int = 32 * MiB,
        dense_chunk_bytes: int = 1 * MiB,
        memory_budget: int = 256 * MiB,
        io_threads: int = 4,
        create: bool = True,
    ):
        for name, value in (("chunk_bytes", chunk_bytes), ("dense_chunk_bytes", dense_chunk_bytes),
                            ("io_threads", io_threads)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if memory_budget < 2 * chunk_bytes:
            raise ValueError(
                f"memory_budget ({memory_budget}) must hold at least two chunks of {chunk_bytes} B"
            )
        self.policy: BasePolicy = policy if policy is not None else EveryK(base_every)
        self.store = Store(open_storage(path))
        if create:
            self.store.create()
        self.store.check_exists()
        self._chunk_bytes = chunk_bytes
        self._tracker = ChangeTracker(dense_chunk_bytes)
        self._pool = StagingPool(memory_budget // chunk_bytes, chunk_bytes,
                                 pin=torch.cuda.is_available())
        self._executor = ThreadPoolExecutor(io_threads, thread_name_prefix="deltackpt-io")
        self._head: Manifest | None = None  # the step the next delta applies to
        self._chain = ChainState(0, 0, 0)

    # -- listing --------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return self.store.steps()

    def latest_step(self) -> int | None:
        """The highest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    # -- save -----------------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any]) -> SaveInfo:
        """Saves ``state`` as ``step``: a base or a delta against the last step saved or restored.

        Args:
            step: the training step; must be after every committed step.
            state: nested dict of tensors, modules, optimizers and JSON-able values.

        Returns:
            What was written.

        Raises:
            StepExistsError: ``step`` is committed already or not after the latest step.
            StateError: ``state`` holds something that cannot be saved.
            StoreError: writing failed; nothing was committed, and the changes it would have
                saved go into the next save.
        """
        t0 = time.perf_counter()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise StepExistsError(f"step must be a non-negative int, got {step!r}")
        latest = self.latest_step()
        if latest is not None and step <= latest:
            if step in self.steps():
                raise StepExistsError(f"step {step} is committed already")
            raise StepExistsError(f"step {step} is not after the latest committed step {latest}")
        flat = statetree.flatten(state)
        tensors = {k: t if t.is_contiguous() else t.contiguous() for k, t in flat.tensors.items()}
        for t in tensors.values():
            dtypes.name(t.dtype)  # raises StateError for an unsupported dtype
        changes = self._tracker.scan(tensors)
        full_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        kind, reason = self._decide(tensors, changes, full_bytes)

        attempt = self.store.new_attempt(step)
        writer = StepWriter(self.store.storage, f"{STEPS}/{attempt}", self._pool, self._executor,
                            self._chunk_bytes)
        rows_changed = 0
        for key, t in tensors.items():
            ch = changes[key].changed
            if kind == "base":
                writer.full(key, t)
                rows_changed += t.shape[0] if is_row_sparse(t) else 0
            elif is_row_sparse(t):
                writer.rows(key, t, ch)
                rows_changed += ch.numel()
            else:
                writer.chunks(key, t, ch.tolist(), self._tracker.chunk_elems(t))
        try:
            records = writer.finish()
        finally:
            self.store.storage.sync(writer.written)
        head = self._head
        manifest = Manifest(
            step=step,
            kind=kind,
            attempt=attempt,
            parent=None if kind == "base" else head.step,
            parent_attempt=None if kind == "base" else head.attempt,
            base=step if kind == "base" else head.base,
            chain_length=0 if kind == "base" else head.chain_length + 1,
            world_size=1,
            created=time.time(),
            policy={"name": self.policy.name, "decision": kind, "reason": reason},
            tree=flat.tree,
            tensors=records,
            bytes_written=sum(r.nbytes_written for r in records.values()),
            state_bytes=full_bytes,
        )
        if not self.store.commit(manifest):
            raise StepExistsError(f"step {step} was committed by another writer meanwhile")
        self._tracker.adopt(tensors, changes)
        self._head = manifest
        self._chain = (
            ChainState(0, 0, manifest.bytes_written)
            if kind == "base"
            else ChainState(self._chain.deltas + 1, self._chain.delta_bytes + manifest.bytes_written,
                            self._chain.base_bytes)
        )
        info = SaveInfo(step, kind, manifest.bytes_written, full_bytes, rows_changed,
                        time.perf_counter() - t0, reason)
        log.info("saved step %d: %s, %d B of %d B in %.3f s", step, kind, info.bytes_written,
                 full_bytes, info.seconds)
        return info

    def _decide(
        self, tensors: dict[str, torch.Tensor], changes: dict[str, TensorChange], full_bytes: int
    ) -> tuple[str, str]:
        if self._head is None:
            return "base", "no earlier step saved or restored by this checkpointer"
        if set(tensors) != self._tracker.keys() or any(c.changed is None for c in changes.values()):
            return "base", "the set of tensors, a dtype or a shape changed"
        delta_bytes = 0
        for key, t in tensors.items():
            n = changes[key].changed.numel()
            if is_row_sparse(t):
                delta_bytes += n * (t[0].numel() * t.element_size() + 8)
            else:
                delta_bytes += n * self._tracker.chunk_elems(t) * t.element_size()
        decision = self.policy.decide(self._chain, delta_bytes, full_bytes)
        return decision.kind, decision.reason

    # -- load and restore ---------------------------------------------------------------------

    def _resolve(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise StepNotFoundError(-1, [])
        return step

    def load(self, step: int | None = None) -> dict[str, Any]:
        """The state saved at ``step`` (default: the latest), with every tensor on the CPU.

        Raises:
            StepNotFoundError: ``step`` is not committed.
            BrokenChainError, IntegrityError, MissingChunkError: the store is damaged.
        """
        chain = self.store.chain(self._resolve(step))
        m = chain[-1]
        reader = ChainReader(self.store.storage, chain, self._pool, self._executor)
        tensors = {}
        for key, rec in m.tensors.items():
            t = torch.empty(rec.shape, dtype=dtypes.from_name(rec.dtype))
            reader.read(key, t)
            tensors[key] = t
        return statetree.build(m.tree, tensors)

    def restore(self, state: Mapping[str, Any], step: int | None = None) -> int:
        """Restores ``step`` (default: the latest) into ``state`` in place.

        Tensors are filled in place; modules get their parameters and buffers filled in place;
        other objects with ``load_state_dict`` (optimizers) are loaded from the saved state;
        plain values are replaced in their dicts and lists. Afterwards the next save can be a
        delta against ``step``.

        Returns:
            The step restored.

        Raises:
            KeyMismatchError, DtypeMismatchError, ShapeMismatchError: ``state`` does not match
                what was saved; nothing was changed.
            StepNotFoundError, BrokenChainError, IntegrityError: as for :meth:`load`.
        """
        step = self._resolve(step)
        chain = self.store.chain(step)
        m = chain[-1]
        plan = plan_restore(state, m)
        reader = ChainReader(self.store.storage, chain, self._pool, self._executor)
        final = {}
        for key, rec in m.tensors.items():
            target = plan.targets.get(key)
            if target is not None and target.device.type == "cpu" and target.is_contiguous():
                dest = target
            else:
                dest = torch.empty(rec.shape, dtype=dtypes.from_name(rec.dtype))
            reader.read(key, dest)
            if target is not None and dest is not target:
                target.copy_(dest)
            final[key] = target if target is not None else dest
        plan.finish(final)
        restored = statetree.flatten(state).tensors
        self._tracker.reset({k: t if t.is_contiguous() else t.contiguous() for k, t in restored.items()})
        self._head = m
        base_bytes = chain[0].bytes_written
        self._chain = ChainState(m.chain_length, sum(c.bytes_written for c in chain[1:]), base_bytes)
        return step

    def verify(
        self, step: int | None = None, progress: Callable[[int], None] = lambda n: None
    ) -> VerifyReport:
        """Re-reads every chunk of ``step``'s chain (default: of every committed step) and checks
        sizes, checksums and parent links; returns what it found instead of raising."""
        steps = self.steps()
        if step is not None:
            if step not in steps:
                raise StepNotFoundError(step, steps)
            steps = [step]
        return verify(self.store, steps, self._pool, self._executor, progress)

    # -- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for pending I/O and releases the threads."""
        self._executor.shutdown(wait=True)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

