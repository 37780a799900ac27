"""A checkpointer's saves, phase after phase, and what carries from one save to the next: the
step the next delta applies to, the chain so far, the cached global plan and the writer lease.

:meth:`Saver.stage` runs ``plan_local``, ``plan_global``, ``scan``, ``decide`` and ``stage`` on the
calling thread and returns the rest of the save, ``write`` and ``commit``, as a function the
checkpointer runs at once (a blocking save) or in the background.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future, wait
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from ..collectives import Collective
from ..collector import paused
from ..errors import BrokenChainError, StateError, StepExistsError
from ..format.layout import STEPS
from ..format.hash_files import digest
from ..format.record_io import hashes_key, table_key
from ..format.manifest import Manifest
from ..io.staging import StagingPool
from ..io.writer import StepWriter
from ..ops import lease
from ..policy import BasePolicy, ChainState
from ..quantization import QuantizePlan
from ..store import Store
from ..tracking.changes import ChangeTracker, TensorChange
from .commit import Reuse, commit, part_table
from .decide import aligned_keys, counts, decide
from .local import plan_local, write_items
from .planner import Assignment, GlobalPlanner, PartPlan, PlanRequest
from .scan import Scanned, ScanSummary, scan, settled
from .stage import open_writer, row_hash_file, stage, write
from .types import Committed, Kind, LocalState, SaveInfo, SavePlan, WriteItem, WriteResult, Written

log = logging.getLogger(__name__)


class Saver:
    """Runs the saves of one checkpointer (see :mod:`deltackpt.checkpointer` for the protocol).

    Args:
        store: the store.
        coll: the ranks that save together.
        policy: base or delta.
        tracker: the change tracker (shared with the checkpointer's ``track``, ``mark``, ``restore``).
        pool: staging buffers.
        executor: the I/O threads.
        packer: appends a delta's gathered rows to its pack beside the gathers, on one of the
            I/O threads (None: the saving thread does; see :class:`~deltackpt.io.writer.StepWriter`).
        sizes: ``(chunk_bytes, dense_chunk_bytes)``.
        quantize: the lossy-delta rules and the restores made.
        take_over: take the lease found now even if its holder looks alive or it is unreadable.
        lease_ttl: seconds without a renewal after which this writer's lease is free.
        background: the most I/O threads that write a non-blocking save's files at once.
    """

    def __init__(self, store: Store, coll: Collective, policy: BasePolicy, tracker: ChangeTracker,
                 pool: StagingPool, executor: Executor, packer: Executor | None,
                 sizes: tuple[int, int], quantize: QuantizePlan, *, take_over: bool, lease_ttl: float,
                 background: int):
        self.store = store
        self._coll = coll
        self.policy = policy
        self._tracker = tracker
        self._pool = pool
        self._executor = executor
        self._background = background
        self._sizes = sizes
        self._quantize = quantize
        self._head: Manifest | None = None  # the step the next delta applies to
        self._chain = ChainState(0, 0, 0)
        self._sent_digest: str | None = None  # this rank's last local plan, as sent
        self._local: LocalState | None = None  # this rank's last local state
        self._planner = GlobalPlanner(coll.size)  # used on the coordinator only
        self._assignment: Assignment | None = None  # the parts this rank writes
        self._parts: tuple[tuple[str, PartPlan], ...] = ()  # those parts, made of its local plan
        self._index: tuple[int, ...] = ()  # their tensors' places in the plan
        self._shapes: dict[str, tuple[int, ...]] = {}  # global shapes of its tensors, under that plan
        self._lease = lease.Claim(store.storage, ttl=lease_ttl, take_over=take_over)
        self._reuse = Reuse()  # what the records of its saves share, kept from save to save
        self._packer = packer
        self._items: tuple[tuple[tuple[str, PartPlan], ...], tuple[WriteItem, ...]] | None = None  # the last save's
        self._scanned: Scanned | None = None  # their last scan
        self._writing: list[StepWriter] = []  # the writers of a non-blocking save not yet written

    @paused()  # per-tensor objects by the thousand, no cycles: collections would walk them all
    def stage(self, step: int, state: Mapping[str, Any], t0: float, *, blocking: bool = True
              ) -> Callable[[float | None], SaveInfo]:
        """Every phase up to ``stage``; returns ``finish(blocked_seconds)``, the write and commit
        (``blocked_seconds`` None: the caller waits for them too; without ``blocking`` they run
        in the background, which then also appends a delta's small chunks to the pack).

        ``stage`` ends in a round of its own, so that a save in the background returns only once
        every rank has staged; a ``blocking`` save returns after its commit, so each rank stages
        in the write round instead, which tells every rank of any rank's failure the same way:
        a 2-rank delta is three round trips, not four."""
        storage = self.store.storage
        coordinator = self._coll.is_coordinator
        items = self._write_items(step, state)
        aligned: set[str] = set()  # the coordinator's: the tensors scanned as aligned, for the record
        attempt = self.store.new_attempt(step)  # used on the coordinator only
        # Alone, this process writes every file of the attempt: they wait for the lease to name
        # it (gate) and the save goes on meanwhile, unless decide must see the head named first.
        named = coordinator and self._coll.size == 1 and self._head_named()
        published = self._publish(attempt) if coordinator else None
        gate = published if named else None

        def decide_now(scans: list[ScanSummary]) -> SavePlan:
            plan = self._planner.plan  # on the coordinator
            aligned.update(aligned_keys(scans))
            return decide(self.policy, self._head, self._chain, plan, scans, step=step,
                          attempt=attempt, store=self.store, published=None if gate is not None else published,
                          quantize=self._quantize.choices(plan.tensors))

        def scan_here() -> tuple[ScanSummary, Scanned]:
            assert self._local is not None  # _write_items set it: every tensor this rank holds
            self._scanned = scan(self._tracker, items, self._quantize, self._scanned, self._local.flat.tensors)
            return ScanSummary.of(self._scanned.scans), self._scanned

        try:
            save, scanned = self._coll.gather("scan", scan_here, decide_now, then_phase="decide")
        except BaseException:
            if published is not None:
                wait([published])  # never left running behind a failed save
            raise
        plan = self._planner.plan if coordinator else None  # only the coordinator holds it
        writers = [open_writer(storage, save, self._coll.rank, self._pool, self._executor, self._packer,
                               blocking=blocking, gate=gate, background=self._background)]
        if coordinator:
            writers.append(StepWriter(storage, f"{STEPS}/{save.attempt}", self._pool, self._executor,
                                      gate=gate))
        mine, changes, tensors = scanned.scans, scanned.changes, scanned.tensors
        held = counts(save.kind, (it.part for it in items), mine)

        @paused()
        def stage_here() -> dict[str, TensorChange]:
            try:
                with self._pool.staging():
                    staged = stage(writers, save, items, changes, held, self._sizes, plan=plan)
                if save.kind == Kind.BASE:  # hashed now, as staged: the background may run on after
                    staged = self._tracker.hash_whole(tensors, staged)
                return staged
            except BaseException:  # every queued write ends (a pack's file holds an I/O thread)
                for w in writers:
                    w.abandon()
                raise

        staging = stage_here
        if not blocking:
            try:
                _, staged = self._coll.gather("stage", lambda: (None, stage_here()), lambda _: None,
                                              then_phase="stage")
            except BaseException:
                for w in writers:  # another rank failed: end the writes staged here
                    w.abandon()
                raise
            staging = partial(dict, staged)
            self._writing = writers
            if save.kind == Kind.BASE:
                # So that the next base stages into touched buffers alone, its writes held until
                # then (see StepWriter's hold: and two buffers left): touched once, beside this
                # one's writes.
                self._pool.warm_ahead(sum(t.nbytes for t in tensors.values()))
        assert self._assignment is not None  # _write_items set it
        table = partial(part_table, save, self._coll.rank, items, self._index, self._shapes, held,
                        sizes=self._sizes, aligned={s.key for s in mine if s.aligned}, reuse=self._reuse)
        hashed = partial(row_hash_file, save.kind, items, self._index)
        record = partial(self._commit, save, aligned)
        return partial(self._write_and_commit, save, table, hashed, record, writers, tensors, staging, gate, t0)

    def hurry(self) -> None:
        """Someone waits for the non-blocking save in flight: its files are written by every I/O
        thread free from now on, not only by the cores its training leaves."""
        for w in self._writing:
            w.hurry()

    def _publish(self, attempt: str) -> Future[None]:
        """Coordinator: starts writing the head and ``attempt`` into the lease on an I/O thread
        (at the first save, taking the lease with them), so that the write overlaps the scan;
        ``decide``, or else every file of the attempt (see :meth:`stage`), waits for it.

        It is submitted before any of the attempt's files, so an I/O thread takes it first: files
        waiting for it never hold every thread."""
        head = None if self._head is None else (self._head.step, self._head.attempt)
        return self._executor.submit(self._lease.publish, head, attempt)

    def _head_named(self) -> bool:
        """Coordinator, before :meth:`_publish`: whether the lease as this checkpointer last wrote
        it keeps the head for GC already (see :func:`deltackpt.ops.gc.holder_chain`): as its
        published head, or as the attempt of the save that committed it. Then ``decide`` may
        check the head's record without waiting for the new publish; so may a first save, which
        has no head (a fresh store's, or after a base)."""
        if self._head is None:
            return True
        held = self._lease.holding
        return held is not None and (held.lease.head == (self._head.step, self._head.attempt)
                                     or held.lease.attempt == self._head.attempt)

    def _write_and_commit(self, save: SavePlan, table: Callable[[WriteResult], tuple[bytes | None, Written]],
                          hashed: Callable[[Mapping[str, TensorChange]], list[memoryview] | None],
                          record: Callable[[list[Written]], Committed], writers: list[StepWriter],
                          tensors: dict[str, torch.Tensor], staging: Callable[[], dict[str, TensorChange]],
                          gate: Future[None] | None, t0: float, blocked: float | None) -> SaveInfo:
        """The phases after ``stage``, on the caller's thread or in the background: every rank
        stages (``staging``, unless it has staged already: it returns what was staged), writes
        its part table once its chunks are written (``table`` makes it of what was written, once
        the lease names the attempt: ``gate``, see :meth:`stage`) and a base's row hashes
        (``hashed`` makes them of the change sets staged, hashes filled in once the writes
        ended), makes them durable and sends the coordinator alone what the root needs of it;
        the coordinator commits and tells every rank what.

        Raises:
            WriterConflictError: (``gate``'s) another writer holds the lease; nothing was written."""
        storage = self.store.storage
        rank = self._coll.rank

        def files(staged: dict[str, TensorChange], result: WriteResult
                  ) -> tuple[dict[str, list[memoryview]], Written]:
            if gate is not None:
                gate.result()
            data, sent = table(result)
            out = {} if data is None else {table_key(save.attempt, rank): [memoryview(data)]}
            rows = hashed(staged)
            if rows is not None:
                out[hashes_key(save.attempt, rank)] = rows
                size, hexdigest = digest(rows)
                sent = replace(sent, hashes=(size, hexdigest), bytes_written=sent.bytes_written + size)
            return out, sent

        def write_here() -> tuple[Written, dict[str, TensorChange]]:
            staged = staging()
            return write(storage, writers, partial(files, staged), helping=blocked is None), staged

        try:
            done, staged = self._coll.gather("write", write_here, record, then_phase="commit")
        finally:
            self._writing = []
        self._advance(save.kind, done, tensors, staged)
        seconds = time.perf_counter() - t0
        info = SaveInfo(save.step, save.kind, done.bytes_written, done.state_bytes, done.rows_changed,
                        seconds, save.reason, seconds if blocked is None else blocked)
        if self._coll.is_coordinator:
            log.info("saved step %d: %s, %d B of %d B in %.3f s (%.3f s blocked)", save.step,
                     save.kind, info.bytes_written, info.state_bytes, info.seconds,
                     info.blocked_seconds)
        return info

    @paused()
    def _commit(self, save: SavePlan, aligned: set[str], written: list[Written]) -> Committed:
        """Coordinator: the root record of every rank's part table (``written``); it becomes the
        head. (The plan is the one ``save`` was staged under: the next save stages after this
        commit.)

        Raises:
            BrokenChainError: the record was withdrawn, its parent gone after ``decide`` looked
                (a fenced writer's); the next save writes a base.
        """
        manifest = commit(
            self.store, save, self._planner.plan, written, head=self._head, world_size=self._coll.size,
            policy=self.policy.name, lease=self._lease.holding, restores=self._quantize.recorded_restores,
            aligned=aligned, reuse=self._reuse)
        if manifest is None:
            parent, self._head = self._head, None
            raise BrokenChainError(save.step, parent.step if parent is not None else -1,
                                   "the step it applied to vanished during the save; nothing was "
                                   "committed and the next save writes a base")
        if save.kind == Kind.BASE or not getattr(self.policy, "differential", False):
            self._head = manifest
        return Committed(manifest.bytes_written, manifest.state_bytes, sum(w.rows_changed for w in written))

    def _write_items(self, step: int, state: Mapping[str, Any]) -> tuple[WriteItem, ...]:
        """``plan_local`` and ``plan_global``: this rank's local plan goes to the coordinator
        (only when it changed), which makes the global plan (only when some rank's changed) and
        sends each rank the parts it writes (only when it does not hold them yet)."""

        def plan_global(sent: list[PlanRequest]) -> list[Assignment | None]:
            self.store.storage.point("plan_global", "")
            return self._planner.assign(sent, self._admit)

        assignment, local = self._coll.gather("plan_local", lambda: self._plan_local(step, state),
                                              plan_global, then_phase="plan_global", per_rank=True)
        self._sent_digest = local.digest
        if assignment is not None:
            self._assignment = assignment
            self._parts, self._index = assignment.parts(local.plan)
            self._shapes = {k: s.global_shape for k, s in local.shards.items()}
        if self._assignment is None:
            raise StateError("no plan: the coordinator sent none for a first save")
        self._items = self._parts, write_items(self._parts, local, self._items)
        return self._items[1]

    def _plan_local(self, step: int, state: Mapping[str, Any]) -> tuple[PlanRequest, LocalState]:
        """This rank's local state, and what the coordinator needs of it (the plan only when it
        changed since the last save)."""
        self.store.storage.point("plan_local", "")
        local = plan_local(step, state, self._coll.rank, self._sizes, self._local)
        # Kept for the next save's plan_local, without the copies of non-contiguous tensors.
        self._local = replace(local, shards={})
        holds = None if self._assignment is None else self._assignment.tag
        return PlanRequest(step, local.digest, None if local.digest == self._sent_digest else local.plan,
                           holds), local

    @paused()
    def _advance(self, kind: Kind, done: Committed, tensors: dict[str, torch.Tensor],
                 changes: dict[str, TensorChange]) -> None:
        """After a commit: the change tracker's reference and the chain the next delta extends
        (the coordinator's head moved in :meth:`_commit`)."""
        if kind == Kind.BASE or not getattr(self.policy, "differential", False):
            unchanged = self._tracker.adopt(tensors, changes, base=kind == Kind.BASE)
            if unchanged and self._scanned is not None:
                self._scanned = settled(self._scanned, unchanged, self._tracker.chunk_elems)
        # A differential policy's deltas all apply to the base: keep it as the reference.
        self._chain = (
            ChainState(0, 0, done.bytes_written) if kind == Kind.BASE
            else ChainState(self._chain.deltas + 1, self._chain.delta_bytes + done.bytes_written,
                            self._chain.base_bytes)
        )

    def _admit(self, step: int) -> None:
        """Coordinator: ``step`` may be saved. (The lease is taken by the save's first write to
        it, see :meth:`_publish`; a committed ``step`` is reported only once this checkpointer
        holds the lease, so that of writers racing for one step each loser learns the winner.)"""
        try:
            self.store.check_new_step(step)
        except StepExistsError:
            self._lease.hold()
            raise

    def restored(self, head: Manifest | None, chain: ChainState) -> None:
        """After a restore: the next delta applies to ``head`` (None: the next save is a base)."""
        self._head = head
        self._chain = chain

    def close(self) -> None:
        """Releases the writer lease."""
        self._lease.release()
