"""The Checkpointer: save, list, load and restore steps of one store, on one rank or many.

Save protocol (every rank calls ``save`` with the same step), one function of :mod:`deltackpt.save`
per phase, each over the frozen values of the ones before:

1. ``plan_local`` (all ranks): flatten the state; each rank's plan lists its tensors' boxes.
2. ``plan_global`` (coordinator): check the step, validate the boxes and give every distinct box
   one writer (:mod:`deltackpt.save.planner`); cached while no rank's local plan changes.
3. ``scan`` (all): each rank finds what changed in the parts it writes; its summary goes to the
   coordinator alone.
4. ``decide`` (coordinator): base or delta by the policy, a :class:`~deltackpt.save.types.SavePlan` for every rank.
5. ``stage`` (all): each rank copies what it writes into staging buffers, queuing their writes;
   the coordinator adds every array's metadata. After it, nothing reads the live state.
6. ``write`` (all): each rank waits for its writes and makes them durable; what it wrote goes to
   the coordinator alone.
7. ``commit`` (coordinator): the commit record, created only if absent; every rank learns its
   totals (:class:`~deltackpt.save.types.Committed`), not the record.

A failure in any phase on any rank raises :class:`CheckpointAborted` on every rank; nothing is
committed, and the change trackers keep their state, so the next save carries the changes.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, Literal, overload

import torch

from .collectives import Collective
from .errors import SettingError, StepNotFoundError, StoreError
from .format.layout import as_step
from .io.staging import StagingPool
from .io.threads import Lane, cores_beside_training, started_pool
from .ops.compaction import CompactInfo, compact
from .ops.gc import GCReport, Retention, collect
from .ops.lease import DEFAULT_TTL
from .ops.verify import VerifyReport, verify
from .policy import BasePolicy, ChainState, EveryK, check_policy
from .quantization import QuantizePlan, Rule
from .restore.load import read_step
from .restore.restorer import restore
from .save.pending import Background, SaveHandle
from .save.saver import Saver
from .save.turn import Turn
from .save.types import SaveInfo
from .storage import Storage, open_storage
from .statetree import held_bytes
from .store import Store
from .stream import StepDelta, deltas
from .tracking.changes import ChangeTracker
from .tracking.hashing import Hasher, warm_kernels
from .tracking.rows import Canary, TrackHandle

MiB = 1 << 20


class Checkpointer:
    """Saves training state as bases and deltas into a zarr v3 store, and restores any step.

    Args:
        path: a local directory (created if absent), a URL :func:`~deltackpt.storage.open_storage`
            opens, or a :class:`~deltackpt.storage.Storage`.
        base_every: a base every this many saves (ignored when ``policy`` is given).
        policy: the base-cadence policy; default ``EveryK(base_every)``.
        process_group: the ranks that checkpoint together; default: all ranks when
            torch.distributed is initialized, else this process alone.
        coordinator_rank: the rank (in ``process_group``) that plans and commits.
        timeout: how long a rank waits for the others in a save or restore (a gloo ``process_group`` keeps its own).
        chunk_bytes: target size of a chunk file.
        dense_chunk_bytes: change-detection granularity of dense (0-d, 1-d) tensors.
        memory_budget: bytes of host staging memory a save or restore may add.
        io_threads: parallel reads and writes per rank, at most ``threads``.
        threads: the most threads a save or restore works on besides the calling one, its I/O
            and hashing (from a non-blocking save's return until it is waited for, the cores training
            leaves: the CPUs less torch's threads, at least one); default ``torch.get_num_threads()``.
        create: create the store if absent; if False, a missing store raises StoreError.
        take_over: take the writer lease found now at the first save, even if its holder looks
            alive or it is unreadable; a dead holder's is taken anyway (:mod:`deltackpt.ops.lease`).
        lease_ttl: seconds (at most 3600) without a renewal after which a writer's lease is free.
        storage_options: settings for the backend ``path`` names (see
            :func:`~deltackpt.storage.open_storage`).
        quantize: opt-in lossy deltas, ``{fnmatch pattern: Rowwise(...)}`` (:mod:`.quantization`).
        aligned: ``{flat key: its table's flat key}`` of 1-d tensors with a value per row of a table
            (row-wise optimizer state in a dict): deltas write their changed values as rows.

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
        process_group: Any = None,
        coordinator_rank: int = 0,
        timeout: datetime.timedelta = datetime.timedelta(minutes=10),
        chunk_bytes: int = 32 * MiB,
        dense_chunk_bytes: int = 1 * MiB,
        memory_budget: int = 256 * MiB,
        io_threads: int = 4,
        threads: int | None = None,
        create: bool = True,
        take_over: bool = False,
        lease_ttl: float = DEFAULT_TTL,
        storage_options: Mapping[str, Any] | None = None,
        quantize: Mapping[str, Rule] | None = None,
        aligned: Mapping[str, str] | None = None,
    ):
        threads = torch.get_num_threads() if threads is None else threads
        for name, value in (("chunk_bytes", chunk_bytes), ("dense_chunk_bytes", dense_chunk_bytes),
                            ("memory_budget", memory_budget), ("io_threads", io_threads), ("threads", threads)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SettingError(f"{name} must be a positive int, got {value!r}")
        if memory_budget < 2 * chunk_bytes:
            raise SettingError(f"memory_budget ({memory_budget}) must hold two chunks of {chunk_bytes} B")
        self.policy: BasePolicy = check_policy(policy) if policy is not None else EveryK(base_every)
        self._quantize = QuantizePlan(quantize)  # and the restores made, carried through records
        self._coll = Collective(process_group, timeout=timeout, coordinator_rank=coordinator_rank)
        self.store = Store(open_storage(path, storage_options))
        if self._coll.size > 1 and not self.store.storage.capabilities.shared:
            raise StoreError(None, f"{self.store.storage.url} is visible to this process only; "
                                   f"{self._coll.size} ranks need a shared storage")
        if create:
            self._coll.one("open", self.store.create)
        self.store.check_exists()
        self._sizes = (chunk_bytes, dense_chunk_bytes)
        self._pool = StagingPool(memory_budget // chunk_bytes, chunk_bytes, pin=torch.cuda.is_available())
        workers = min(io_threads, threads)
        self._executor = started_pool(workers, "deltackpt-io")
        self._tracker = ChangeTracker(dense_chunk_bytes, Hasher(self._executor, workers), aligned)
        self._saver = Saver(self.store, self._coll, self.policy, self._tracker, self._pool, self._executor,
                            Lane(self._executor) if workers > 1 else None, self._sizes, self._quantize,
                            take_over=take_over, lease_ttl=lease_ttl, background=cores_beside_training(workers))
        self._background = Background()
        self._turn = Turn()  # one save, restore or close at a time, whatever the thread
        warm_kernels()
        self._pool.warm_ahead(0)  # the two buffers any save may take, touched

    @property
    def rank(self) -> int:
        """This process's rank among the checkpointing ranks."""
        return self._coll.rank

    @property
    def world_size(self) -> int:
        """How many ranks checkpoint together."""
        return self._coll.size

    # -- listing --------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return self.store.steps()

    def latest_step(self) -> int | None:
        """The highest committed step, or None."""
        return max(self.steps(), default=None)

    # -- save -----------------------------------------------------------------------------------

    @overload
    def save(self, step: int, state: Mapping[str, Any], *, blocking: Literal[True] = True) -> SaveInfo: ...

    @overload
    def save(self, step: int, state: Mapping[str, Any], *, blocking: Literal[False]) -> SaveHandle: ...

    def save(self, step: int, state: Mapping[str, Any], *, blocking: bool = True) -> SaveInfo | SaveHandle:
        """Saves ``state`` as ``step``: a base or a delta against the last step saved or restored.

        Every rank calls it with the same step and its own state (its shards, replicas of the rest); a save in
        flight, or another thread's save or restore, is waited for first.

        Args:
            step: the training step; must be after every committed step.
            state: nested dict of tensors, :class:`Shard` s, DTensors, modules, optimizers and
                JSON-able values.
            blocking: False returns as soon as every rank has staged what the save writes (the
                state may change from then on); the write and the commit run in the background.

        Returns:
            What was written, over all ranks; without ``blocking``, a
            :class:`~deltackpt.save.pending.SaveHandle` whose ``result()`` returns it.

        Raises:
            StepExistsError: ``step`` is committed already or not after the latest step.
            SettingError: ``step`` is no int (a bool, a string, a float).
            StateError: ``state`` holds something that cannot be saved.
            StoreError: writing failed; nothing was committed, and the changes it would have
                saved go into the next save (raised by the next call after a background save).
            CheckpointAborted: on several ranks, any rank's failure, a dead or hung rank.
        """
        step = as_step(step)  # numpy's ints are steps: the record's and the handle's are ints
        with self._turn("save"):
            self.wait()
            t0 = time.perf_counter()
            finish = self._saver.stage(step, state, t0, blocking=blocking)
            if blocking:
                return finish(None)
            blocked = time.perf_counter() - t0
            return self._background.start(step, blocked, partial(finish, blocked), self._saver.hurry)

    def wait(self) -> SaveInfo | None:
        """Waits for the save in flight, if any, and returns what it wrote.

        Raises:
            DeltackptError: it failed (unless its handle raised that already); nothing of it was
                committed, and its changes go into the next save.
        """
        return self._background.wait()

    # -- load and restore ---------------------------------------------------------------------

    def _resolve(self, step: int | None) -> int:
        if (step := self.latest_step() if step is None else step) is None:
            raise StepNotFoundError(-1, [])
        return step

    def load(self, step: int | None = None, *, row_shard: tuple[int, int] | None = None,
             keys: Sequence[str] | None = None, key: str | None = None, rows: Any = None) -> Any:
        """The state saved at ``step`` (default: the latest), with every tensor on the CPU.

        Reads from the store alone, on the calling rank only (not a collective); with ``keys``,
        or ``key`` and ``rows``, only the chunks those need (see :mod:`deltackpt.io.partial`).

        Args:
            step: the step.
            row_shard, keys, key, rows: a rank's row block, some tensors (a flat dict by key),
                some rows of one tensor; see :func:`deltackpt.restore.load.read_step`.

        Raises:
            StepNotFoundError: ``step`` is not committed (or was garbage-collected meanwhile).
            KeyMismatchError, StateError: a key selects nothing; a bad row, or ``rows`` alone.
            BrokenChainError, IntegrityError, MissingChunkError: the store is damaged.
        """
        self.wait()
        return read_step(self.store, self._resolve(step), self._pool, self._executor,
                         row_shard=row_shard, keys=keys, key=key, rows=rows)

    def deltas(self, since: int | None = None) -> Iterator[StepDelta]:
        """The delta stream after step ``since`` (None: from the first); see :mod:`deltackpt.stream`.

        Raises:
            StreamGapError: the steps after ``since`` were garbage-collected; start from a base.
        """
        self.wait()
        return deltas(self.store, self._pool, self._executor, since)

    def restore(self, state: Mapping[str, Any], step: int | None = None) -> int:
        """Restores ``step`` (default: the latest) into ``state`` in place, on every rank.

        Each rank reads only the parts of the chain that intersect its tensors (its shards), so a step saved on
        N ranks restores on any M. Tensors, Shards and DTensors are filled in place; modules get their
        parameters and buffers filled in place; other objects with ``load_state_dict`` (optimizers) are loaded
        from the saved state; plain values are replaced in their dicts and lists. Afterwards the next save can
        be a delta against ``step`` (the restore takes the hashes of what it wrote, for it); after a failed
        restore it is a base. On several ranks, a rank may hold only some tensors; together they hold all.

        Returns:
            The step restored.

        Raises:
            KeyMismatchError, DtypeMismatchError, ShapeMismatchError: ``state`` does not match
                what was saved; nothing was changed.
            StepNotFoundError, BrokenChainError, IntegrityError: as for :meth:`load`; ``state``
                may hold part of the step.
            CheckpointAborted: on several ranks, any rank's failure.
        """
        with self._turn("restore"):
            self.wait()
            self._saver.restored(None, ChainState(0, 0, 0))  # until it succeeds: no delta fits a part-read state
            chain = restore(state, lambda: self._resolve(step), store=self.store, coll=self._coll, pool=self._pool,
                            executor=self._executor, tracker=self._tracker)
            m = chain[-1]
            self._quantize.restored(m.quantize)
            self._saver.restored(m, ChainState(m.chain_length, sum(c.bytes_written for c in chain[1:]),
                                               chain[0].bytes_written))
            return m.step

    def verify(self, step: int | None = None, progress: Callable[[int], None] = lambda n: None) -> VerifyReport:
        """Re-reads every chunk of ``step``'s chain (default: of every committed step) and checks
        sizes, checksums and parent links; returns what it found instead of raising."""
        self.wait()
        return verify(self.store, step, self._pool, self._executor, progress)

    # -- compaction and GC ----------------------------------------------------------------------

    def compact(self, upto: int | None = None) -> CompactInfo:
        """Commits a base for step ``upto`` (default: the latest) made from its chain, so its restore and those
        of later steps replay from there. Every rank calls it; see :mod:`deltackpt.ops.compaction`. Needs no
        writer lease: it may run beside training.

        Example:
            >>> import tempfile, torch
            >>> with Checkpointer(tempfile.mkdtemp()) as ckpt:
            ...     t = torch.zeros(10, 2)
            ...     _ = ckpt.save(1, {"t": t}); t[3] = 1; _ = ckpt.save(2, {"t": t})
            ...     ckpt.compact(2).chain_length
            2
        """
        self.wait()
        return compact(self.store, self._coll, self._pool, self._executor, self._sizes, upto)

    def gc(self, retention: Retention | None = None, *, grace_seconds: float = 3600.0,
           dry_run: bool = False) -> GCReport:
        """Drops steps ``retention`` does not keep (default: keeps all) and deletes what no remaining step
        refers to, once older than ``grace_seconds`` (:mod:`deltackpt.ops.gc`); run by the coordinator for all."""
        self.wait()
        return self._coll.one("gc", lambda: collect(self.store, retention or Retention(),
                                                    grace_seconds=grace_seconds, dry_run=dry_run))

    # -- tracking -------------------------------------------------------------------------------

    def track(self, model: torch.nn.Module, *, prefix: str = "model", optimizer: torch.optim.Optimizer | None = None,
              optimizer_prefix: str = "optim", canary: Canary | None = None) -> TrackHandle:
        """Marks the rows that ``model``'s embedding lookups touch, so deltas need not hash them.

        Hooks every ``nn.Embedding``, ``nn.EmbeddingBag`` and TorchRec ``EmbeddingBagCollection``; a delta then
        writes each table's marked rows, and those of ``optimizer``'s state aligned with the table, checked by a
        canary (see :mod:`deltackpt.tracking.rows`, :mod:`deltackpt.tracking.changes`). Touches in the
        background the staging buffers a base of both takes (within the budget), for a first base to come.

        Args:
            model: the model, as it sits in the saved state.
            prefix: its path in the state: ``"model"`` for ``{"model": model, ...}``.
            optimizer: the optimizer whose per-row state shares the tables' marks.
            optimizer_prefix: its path in the state: ``"optim"`` for ``{"optim": optimizer}``.
            canary: how many unmarked rows each delta re-hashes (default ``Canary()``).

        Returns:
            The tracked flat keys, and ``remove()`` to stop.

        Raises:
            StateError: ``model`` is not an ``nn.Module``.

        Example:
            >>> import tempfile, torch
            >>> model = torch.nn.Sequential(torch.nn.Embedding(100, 4))
            >>> with Checkpointer(tempfile.mkdtemp()) as ckpt:
            ...     ckpt.track(model, prefix="model").keys
            ('model/0.weight',)
        """
        self._pool.warm_ahead(held_bytes(model, optimizer))
        return self._tracker.rows.track(model, prefix=prefix, optimizer=optimizer,
                                        optimizer_prefix=optimizer_prefix, canary=canary)

    def mark(self, key: str, ids: torch.Tensor) -> None:
        """Marks rows ``ids`` of the tensor at flat key ``key`` as changed, and tracks it by marks
        from its next save on (for tables that no hooked module looks up).

        Raises:
            StateError: ``ids`` is not an int64 or int32 tensor.

        Example:
            >>> import tempfile, torch
            >>> with Checkpointer(tempfile.mkdtemp()) as ckpt:
            ...     table = torch.zeros(100, 4)
            ...     _ = ckpt.save(0, {"table": table})
            ...     table[7] = 1.0
            ...     ckpt.mark("table", torch.tensor([7]))
            ...     ckpt.save(1, {"table": table}).rows_changed
            1
        """
        self._tracker.rows.mark(key, ids)

    # -- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for the save in flight and pending I/O, releases the writer lease, the threads and
        the staging buffers (see :mod:`.io.staging`); raises the save's error, if any, at the end.
        Any later call but this one (which does nothing) raises :class:`~deltackpt.errors.ClosedError`."""
        with self._turn("close"):  # after another thread's save or restore
            if self._background.closed:
                return
            try:
                self.wait()
            finally:
                self._background.close()
                self._saver.close()
                self._executor.shutdown(wait=True)
                self._pool.close()
                self._coll.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
