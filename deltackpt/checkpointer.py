"""The Checkpointer: save, list, load and restore steps of one store, on one rank or many.

Save protocol (every rank calls ``save`` with the same step):

1. ``plan_local`` (all ranks): flatten the state; each rank's plan lists its tensors' boxes.
2. ``plan_global`` (coordinator): check the step, validate the boxes and give every distinct box
   one writer (:mod:`deltackpt.save.planner`); cached while no rank's local plan changes.
3. ``scan`` (all): each rank finds what changed in the parts it writes.
4. ``decide`` (coordinator): base or delta by the policy; writes every array's metadata.
5. ``write`` (all): each rank writes its parts' chunks and makes them durable.
6. ``commit`` (coordinator): the commit record, created only if absent.

A failure in any phase on any rank raises :class:`CheckpointAborted` on every rank; nothing is
committed, and the change trackers keep their state, so the next save carries the changes.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from . import statetree
from .collectives import Collective
from .errors import (
    KeyMismatchError,
    StateError,
    StepExistsError,
    StepNotFoundError,
    StoreError,
)
from .format import dtypes
from .format.layout import STEPS
from .format.manifest import ChunkMap, Manifest
from .io.reader import ChainReader
from .io.staging import StagingPool
from .io.writer import StepWriter
from .ops import lease
from .ops.compaction import CompactInfo, compact
from .ops.gc import GCReport, Retention, collect
from .ops.verify import VerifyReport, verify
from .policy import BasePolicy, ChainState, EveryK
from .restore.planning import fill, plan_restore
from .save.phases import (
    PartScan,
    build_manifest,
    decide,
    describe,
    pack_name,
    summarize,
    write_part,
)
from .save.planner import GlobalPlan, ItemInfo, LocalPlan, make_global_plan
from .sharding import Box, Shard, row_block
from .storage import Storage, open_storage
from .store import Store
from .tracking.changes import ChangeTracker
from .tracking.rows import Canary, TrackHandle

log = logging.getLogger(__name__)

MiB = 1 << 20


@dataclass(frozen=True)
class SaveInfo:
    """What one save did (over all ranks).

    Attributes:
        step: the step saved.
        kind: ``"base"`` or ``"delta"``.
        bytes_written: bytes of every file written.
        state_bytes: bytes of every tensor of the state (what a full checkpoint writes).
        rows_changed: rows written for row-sparse tensors (all rows, for a base).
        seconds: wall time of the save on this rank.
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
        path: a local directory (created if absent), a URL :func:`~deltackpt.storage.open_storage`
            opens, or a :class:`~deltackpt.storage.Storage`.
        base_every: a base every this many saves (ignored when ``policy`` is given).
        policy: the base-cadence policy; default ``EveryK(base_every)``.
        process_group: the ranks that checkpoint together; default: all ranks when
            torch.distributed is initialized, else this process alone.
        coordinator_rank: the rank (in ``process_group``) that plans and commits.
        timeout: how long a rank waits for the others in a save or restore.
        chunk_bytes: target size of a chunk file.
        dense_chunk_bytes: change-detection granularity of dense (0-d, 1-d) tensors.
        memory_budget: bytes of host staging memory a save or restore may add.
        io_threads: parallel reads and writes per rank.
        create: create the store if absent; if False, a missing store raises StoreError.
        take_over: take the writer lease even if another job holds it (after that job died);
            by default a second writer fails with WriterConflictError at its first save.
        storage_options: settings for the backend ``path`` names (see
            :func:`~deltackpt.storage.open_storage`).

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
        create: bool = True,
        take_over: bool = False,
        storage_options: Mapping[str, Any] | None = None,
    ):
        for name, value in (("chunk_bytes", chunk_bytes), ("dense_chunk_bytes", dense_chunk_bytes),
                            ("io_threads", io_threads)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if memory_budget < 2 * chunk_bytes:
            raise ValueError(
                f"memory_budget ({memory_budget}) must hold at least two chunks of {chunk_bytes} B"
            )
        self.policy: BasePolicy = policy if policy is not None else EveryK(base_every)
        self._coll = Collective(process_group, timeout=timeout, coordinator_rank=coordinator_rank)
        self.store = Store(open_storage(path, storage_options))
        if self._coll.size > 1 and not self.store.storage.capabilities.shared:
            raise StoreError(None, f"{self.store.storage.url} is visible to this process only; "
                                   f"{self._coll.size} ranks need a shared storage")
        if create:
            self._coll.one("open", self.store.create)
        self.store.check_exists()
        self._sizes = (chunk_bytes, dense_chunk_bytes)
        self._tracker = ChangeTracker(dense_chunk_bytes)
        self._pool = StagingPool(memory_budget // chunk_bytes, chunk_bytes,
                                 pin=torch.cuda.is_available())
        self._executor = ThreadPoolExecutor(io_threads, thread_name_prefix="deltackpt-io")
        self._head: Manifest | None = None  # the step the next delta applies to
        self._chain = ChainState(0, 0, 0)
        self._sent_digest: str | None = None  # this rank's last local plan, as sent
        self._local_plans: dict[int, LocalPlan] = {}  # coordinator: the ranks' last local plans
        self._plan: tuple[tuple[str, ...], GlobalPlan] | None = None  # digests -> cached plan
        self._take_over = take_over
        self._lease: lease.Lease | None = None  # coordinator: held from the first save on

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
        steps = self.steps()
        return steps[-1] if steps else None

    # -- save -----------------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any]) -> SaveInfo:
        """Saves ``state`` as ``step``: a base or a delta against the last step saved or restored.

        Every rank of the process group calls it with the same step; each passes its own state
        (its shards, and replicas of everything else).

        Args:
            step: the training step; must be after every committed step.
            state: nested dict of tensors, :class:`Shard` s, DTensors, modules, optimizers and
                JSON-able values.

        Returns:
            What was written, over all ranks.

        Raises:
            StepExistsError: ``step`` is committed already or not after the latest step.
            StateError: ``state`` holds something that cannot be saved.
            StoreError: writing failed; nothing was committed, and the changes it would have
                saved go into the next save.
            CheckpointAborted: on several ranks, any rank's failure, a dead or hung rank.
        """
        t0 = time.perf_counter()
        local: dict[str, Any] = {}

        def plan_local() -> tuple[int, str, LocalPlan | None]:
            self.store.storage.point("plan_local", "")
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise StepExistsError(f"step must be a non-negative int, got {step!r}")
            flat = statetree.flatten(state)
            shards = {k: s if s.local.is_contiguous() else
                      Shard(s.local.contiguous(), global_shape=s.global_shape, global_offset=s.global_offset)
                      for k, s in flat.tensors.items()}
            items = tuple(
                ItemInfo(k, dtypes.name(s.local.dtype), s.global_shape, s.box, s.local.element_size())
                for k, s in sorted(shards.items())
            )
            plan = LocalPlan(self.rank, items, flat.tree, self._sizes)
            local.update(shards=shards, digest=plan.digest())
            return step, local["digest"], None if local["digest"] == self._sent_digest else plan

        sent = self._coll.all("plan_local", plan_local)
        plan = self._global_plan(sent)
        self._sent_digest = local["digest"]
        owned = plan.owned(self.rank)

        def scan() -> list[PartScan]:
            tensors = {tp.key: local["shards"][tp.key].local for tp, _ in owned}
            changes = self._tracker.scan(tensors)
            local.update(tensors=tensors, changes=changes)
            return [summarize(tp.key, part.path, tensors[tp.key], changes[tp.key],
                              self._tracker.chunk_elems(tensors[tp.key])) for tp, part in owned]

        scans = [s for per_rank in self._coll.all("scan", scan) for s in per_rank]
        kind, reason, attempt, changed = self._coll.one(
            "decide", lambda: self._decide_and_describe(step, plan, scans, local))

        def write() -> tuple[dict[tuple[str, str], ChunkMap], dict[str, ChunkMap]]:
            writer = StepWriter(self.store.storage, f"{STEPS}/{attempt}", self._pool, self._executor,
                                pack=pack_name(self.rank) if kind == "delta" else None)
            try:
                for tp, part in owned:
                    local["changes"][tp.key] = write_part(
                        writer, kind, tp.key, part, local["tensors"][tp.key], local["changes"][tp.key],
                        changed[(tp.key, part.path)], self._sizes)
            except BaseException:
                writer.abandon()
                raise
            try:
                return writer.finish(), writer.packs
            finally:
                self.store.storage.sync(writer.written)

        results = self._coll.all("write", write)
        manifest = self._coll.one(
            "commit", lambda: self._commit(step, kind, reason, attempt, plan, changed, results, local))
        if kind == "base" or not getattr(self.policy, "differential", False):
            self._tracker.adopt(local["tensors"], local["changes"])
            self._head = manifest
        # A differential policy's deltas all apply to the base: keep it as the reference.
        self._chain = (
            ChainState(0, 0, manifest.bytes_written) if kind == "base"
            else ChainState(self._chain.deltas + 1, self._chain.delta_bytes + manifest.bytes_written,
                            self._chain.base_bytes)
        )
        rows = sum(r.changed for r in manifest.tensors.values() if len(r.shape) >= 2)
        info = SaveInfo(step, kind, manifest.bytes_written, manifest.state_bytes, rows,
                        time.perf_counter() - t0, reason)
        if self._coll.is_coordinator:
            log.info("saved step %d: %s, %d B of %d B in %.3f s", step, kind, info.bytes_written,
                     info.state_bytes, info.seconds)
        return info

    def _global_plan(self, sent: list[tuple[int, str, LocalPlan | None]]) -> GlobalPlan:
        """The coordinator's global plan, reused while every rank's local plan is unchanged."""

        def plan_global() -> GlobalPlan | None:
            for rank, (_, _, plan) in enumerate(sent):
                if plan is not None:
                    self._local_plans[rank] = plan
            self.store.storage.point("plan_global", "")
            steps = {s for s, _, _ in sent}
            if len(steps) != 1:
                raise StepExistsError(f"ranks save different steps: {sorted(steps)}")
            self._check_step(steps.pop())
            if self._lease is None:
                self._lease = lease.acquire(self.store, lease.holder_id(), take_over=self._take_over)
            digests = tuple(d for _, d, _ in sent)
            if self._plan is not None and self._plan[0] == digests:
                return None
            plans = [self._local_plans[r] for r in range(self.world_size)]
            if len({p.settings for p in plans}) != 1:
                raise StateError(f"ranks use different chunk sizes: {sorted({p.settings for p in plans})}")
            return make_global_plan(plans, statetree.merge([p.tree for p in plans]))

        fresh = self._coll.one("plan_global", plan_global)
        if fresh is not None:
            self._plan = (tuple(d for _, d, _ in sent), fresh)
        return self._plan[1]

    def _check_step(self, step: int) -> None:
        latest = self.latest_step()
        if latest is not None and step <= latest:
            if step in self.steps():
                raise StepExistsError(f"step {step} is committed already")
            raise StepExistsError(f"step {step} is not after the latest committed step {latest}")

    def _decide_and_describe(self, step: int, plan: GlobalPlan, scans: list[PartScan],
                             local: dict[str, Any]) -> tuple[str, str, str, dict[tuple[str, str], int]]:
        """Coordinator: base or delta, a fresh attempt folder, and every array's metadata (its
        writes go on beside the chunks' and are waited for at the commit)."""
        kind, reason, changed = decide(self.policy, self._head, self._chain, plan, scans)
        attempt = self.store.new_attempt(step)
        local["docs"] = StepWriter(self.store.storage, f"{STEPS}/{attempt}", self._pool, self._executor)
        describe(local["docs"], plan, kind, changed, self._sizes)
        return kind, reason, attempt, changed

    def _commit(self, step: int, kind: str, reason: str, attempt: str, plan: GlobalPlan,
                changed: dict[tuple[str, str], int],
                results: list[tuple[dict[tuple[str, str], ChunkMap], dict[str, ChunkMap]]],
                local: dict[str, Any]) -> Manifest:
        """Coordinator: the commit record from every rank's files, created only if absent."""
        docs = local["docs"]
        try:
            written = docs.finish()
        finally:
            self.store.storage.sync(docs.written)
        files: dict[tuple[str, str], ChunkMap] = {}
        packs: dict[str, ChunkMap] = {}
        for per_rank, rank_packs in [(written, {}), *results]:
            for where, chunks in per_rank.items():
                files.setdefault(where, {}).update(chunks)
            packs.update(rank_packs)
        manifest = build_manifest(
            step=step, kind=kind, attempt=attempt, head=self._head, world_size=self.world_size,
            policy={"name": self.policy.name, "decision": kind, "reason": reason},
            plan=plan, changed=changed, files=files, packs=packs, sizes=self._sizes,
        )
        lease.check(self.store, self._lease)
        if not self.store.commit(manifest):
            raise StepExistsError(f"step {step} was committed by another writer meanwhile")
        return manifest

    # -- load and restore ---------------------------------------------------------------------

    def _resolve(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise StepNotFoundError(-1, [])
        return step

    def load(self, step: int | None = None, *, row_shard: tuple[int, int] | None = None) -> dict[str, Any]:
        """The state saved at ``step`` (default: the latest), with every tensor on the CPU.

        Reads from the store alone, on the calling rank only (not a collective).

        Args:
            step: the step.
            row_shard: ``(rank, world_size)`` to read only that rank's rows of a row-wise
                sharding (blocks of ``ceil(rows / world_size)`` rows, as ``torch.chunk`` splits);
                tensors with dimensions then come back as :class:`Shard` s, 0-d ones whole.

        Raises:
            StepNotFoundError: ``step`` is not committed.
            BrokenChainError, IntegrityError, MissingChunkError: the store is damaged.
        """
        chain = self.store.chain(self._resolve(step))
        m = chain[-1]
        reader = ChainReader(self.store.storage, chain, self._pool, self._executor)
        out: dict[str, Any] = {}
        for key, rec in m.tensors.items():
            box = Box((0,) * len(rec.shape), rec.shape)
            if row_shard is not None and rec.shape:
                box = row_block(rec.shape, *row_shard)
            t = torch.empty(box.shape, dtype=dtypes.from_name(rec.dtype))
            reader.read(key, t, box)
            out[key] = t if row_shard is None or not rec.shape else Shard(
                t, global_shape=rec.shape, global_offset=box.offset)
        return statetree.build(m.tree, out)

    def restore(self, state: Mapping[str, Any], step: int | None = None) -> int:
        """Restores ``step`` (default: the latest) into ``state`` in place, on every rank.

        Each rank reads only the parts of the chain that intersect its tensors (its shards), so
        a step saved on N ranks restores on any M. Tensors, Shards and DTensors are filled in
        place; modules get their parameters and buffers filled in place; other objects with
        ``load_state_dict`` (optimizers) are loaded from the saved state; plain values are
        replaced in their dicts and lists. Afterwards the next save can be a delta against ``step``.

        On several ranks, a rank may hold only some tensors (table-wise sharding); together the
        ranks must hold every saved tensor.

        Returns:
            The step restored.

        Raises:
            KeyMismatchError, DtypeMismatchError, ShapeMismatchError: ``state`` does not match
                what was saved; nothing was changed.
            StepNotFoundError, BrokenChainError, IntegrityError: as for :meth:`load`.
            CheckpointAborted: on several ranks, any rank's failure.
        """
        chain = self._coll.one("read_chain", lambda: self.store.chain(self._resolve(step)))
        m = chain[-1]
        plans = {}

        def check() -> set[str]:
            plans["plan"] = plan_restore(state, m, partial=self.world_size > 1)
            return plans["plan"].covered

        covered = set().union(*self._coll.all("restore_plan", check))
        if covered != set(m.tensors):
            raise KeyMismatchError(sorted(set(m.tensors) - covered), [])

        def read() -> None:
            plan = plans["plan"]
            reader = ChainReader(self.store.storage, chain, self._pool, self._executor)
            fill(plan, m, reader)
            restored = statetree.flatten(state).tensors
            self._tracker.reset({k: s.local.contiguous() for k, s in restored.items()})

        self._coll.all("restore_read", read)
        self._head = m
        self._chain = ChainState(m.chain_length, sum(c.bytes_written for c in chain[1:]),
                                 chain[0].bytes_written)
        return m.step

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

    # -- compaction and GC ----------------------------------------------------------------------

    def compact(self, upto: int | None = None) -> CompactInfo:
        """Commits a base for step ``upto`` (default: the latest) made from its chain, so its
        restore and those of later steps replay from there. Every rank calls it; see
        :mod:`deltackpt.ops.compaction`. Needs no writer lease: it may run beside training.

        Example:
            >>> import tempfile, torch
            >>> with Checkpointer(tempfile.mkdtemp()) as ckpt:
            ...     t = torch.zeros(10, 2)
            ...     _ = ckpt.save(1, {"t": t}); t[3] = 1; _ = ckpt.save(2, {"t": t})
            ...     ckpt.compact(2).chain_length
            2
        """
        return compact(self.store, self._coll, self._pool, self._executor, self._sizes, upto)

    def gc(self, retention: Retention | None = None, *, grace_seconds: float = 3600.0,
           dry_run: bool = False) -> GCReport:
        """Drops steps ``retention`` does not keep (default: keeps all) and deletes what no
        remaining step refers to, once older than ``grace_seconds``; see :mod:`deltackpt.ops.gc`.
        Runs on the coordinator; other ranks get its report."""
        return self._coll.one("gc", lambda: collect(self.store, retention or Retention(),
                                                    grace_seconds=grace_seconds, dry_run=dry_run))

    # -- tracking -------------------------------------------------------------------------------

    def track(
        self,
        model: torch.nn.Module,
        *,
        prefix: str = "model",
        optimizer: torch.optim.Optimizer | None = None,
        optimizer_prefix: str = "optim",
        canary: Canary | None = None,
    ) -> TrackHandle:
        """Marks the rows that ``model``'s embedding lookups touch, so deltas need not hash them.

        Hooks every ``nn.Embedding``, ``nn.EmbeddingBag`` and TorchRec ``EmbeddingBagCollection``;
        a delta then writes each table's marked rows, and those of ``optimizer``'s state aligned
        with the table, checked by a canary (see :mod:`deltackpt.tracking.rows`, :mod:`deltackpt.tracking.changes`).

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
        """Waits for pending I/O, releases the writer lease and the threads."""
        if self._lease is not None:
            lease.release(self.store, self._lease)
            self._lease = None
        self._executor.shutdown(wait=True)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


