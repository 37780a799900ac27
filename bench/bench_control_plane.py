"""The control plane of a save at scale, simulated in one process: W ranks x T tensors.

Drives the package's own control-plane code without processes or I/O: ``plan_local``,
``write_items``, ``summarize`` and ``ScanSummary`` (scans) and ``part_table`` (each writing rank's own part
table) on the ranks run in full (``--full``: the coordinator and one other rank by default), the
coordinator's ``GlobalPlanner``, ``decide``, ``describe`` (the zarr metadata of a base) and ``record_root`` (the root record), then
``parse_manifest`` (the root alone, as ``ls`` reads it), the part tables a restore of rank 1's
shards reads (those of the parts its boxes meet), and every part table, as a restore or ``load``
of every tensor reads and checks them. The other ranks exist only as the messages they
send (their local plans made from the job's layout, equal to what ``plan_local`` makes of their
states; their scans and write results from meta tensors of their parts), so no state of theirs is
allocated and a world of thousands fits in memory; each message is pickled as the collectives send
it and unpickled on the coordinator, one at a time. What the writers would have written is made up
from the plan (chunk sizes exact, coded chunks at their largest size, data chunk checksums
stand-ins); the metadata files' entries are real.

Two saves: a base with a new layout (every local plan sent, a new global plan), then a delta
with the layout unchanged (digests only, the plan cached) where ``--changed`` of each part's
rows or chunks changed. Message sizes are the pickles the collectives send (``(ok, value)``,
see ``deltackpt/collectives.py``): a gather delivers every rank's message to the coordinator, a
broadcast the coordinator's message to every rank, a scatter each rank its own.

Last, ``deltackpt ls`` is timed on a store of ``--ls-steps`` root records like the later save's.

Run:  python bench/bench_control_plane.py --world 4096 --tensors 1000
Writes bench/results/control_plane_W{world}_T{tensors}.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import pickle
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import replace
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from deltackpt import Shard, cli
from deltackpt.collector import paused
from deltackpt.format import dtypes
from deltackpt.format.encodings import choose, dense_chunk_elems, in_pack
from deltackpt.format.layout import commit_key, pack_name
from deltackpt.format.lazy_records import TableReader
from deltackpt.format.limits import BLOSC_HEADER
from deltackpt.format.manifest import ChunkMap, Manifest
from deltackpt.format.record_checks import parse_manifest
from deltackpt.format.record_io import checksum
from deltackpt.format.zarr_meta import array_doc
from deltackpt.policy import BasePolicy, ChainState, EveryK
from deltackpt.save.commit import Reuse, part_table, record_root
from deltackpt.save.decide import aligned_keys, counts, decide
from deltackpt.save.local import plan_local, write_items
from deltackpt.save.planner import Assignment, GlobalPlan, GlobalPlanner, LocalPlan, PartPlan, PlanRequest
from deltackpt.save.stage import describe
from deltackpt.save.scan import PartScan, ScanSummary, summarize
from deltackpt.save.types import Committed, Kind, LocalState, SavePlan, WriteItem, WriteResult, Written
from deltackpt.sharding import Box
from deltackpt.storage.local import LocalStorage
from deltackpt.store import Store
from deltackpt.tracking.changes import TensorChange, is_row_sparse

MiB = 1 << 20
DEFAULT_SIZES = (32 * MiB, 1 * MiB)  # the Checkpointer's chunk_bytes, dense_chunk_bytes
StateOf = Callable[[int, int], Mapping[str, Any]]  # (rank, step) -> state
PlanOf = Callable[[int, int], LocalPlan]  # (rank, step) -> the local plan of that state
Changed = Callable[[str, PartPlan, torch.Tensor], int]


# -- the simulated job --------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """A sharded job: ``tensors`` tensors over ``world`` ranks.

    ``mix`` gives the share of tensors sharded row-wise (blocks of rows over every rank, as
    ``torch.chunk`` splits: the last blocks shorter or empty), column-wise (column blocks over a
    group of ``col_group`` ranks; the other ranks hold none of it) and table-wise (the whole
    tensor on one rank). Every tenth row-wise tensor has fewer rows than ranks.
    """

    world: int
    tensors: int
    mix: tuple[float, float, float] = (0.8, 0.1, 0.1)
    col_group: int = 8
    dim: int = 64

    def layout(self) -> list[tuple[str, str, tuple[int, ...], torch.dtype]]:
        """Every tensor: name, scheme, global shape, dtype."""
        row, col, _ = self.mix
        out = []
        for i in range(self.tensors):
            at = (i + 0.5) / self.tensors
            scheme = "row" if at < row else "col" if at < row + col else "table"
            rows = self.world // 2 + i % 7 if scheme == "row" and i % 10 == 9 else 64 * self.world + 37 * i
            if scheme != "row":
                rows = 1000 + 37 * i
            dtype = torch.bfloat16 if i % 4 == 3 else torch.float32
            out.append((f"t{i:05d}", scheme, (rows, self.dim), dtype))
        return out

    def held(self, rank: int) -> Iterator[tuple[str, tuple[int, ...], torch.dtype, tuple[int, ...],
                                                 tuple[int, ...] | None]]:
        """The tensors rank ``rank`` holds: name, global shape, dtype, local shape and global
        offset (None for a whole tensor, held as a plain tensor)."""
        for i, (name, scheme, shape, dtype) in enumerate(self.layout()):
            if scheme == "table":
                if i % self.world == rank:
                    yield name, shape, dtype, tuple(list(shape)), None  # another tuple, as a Shard's box
                continue
            if scheme == "row":
                dim, ranks, at = 0, self.world, rank
            else:
                group = min(self.col_group, self.world)
                first = i * group % self.world
                dim, ranks, at = 1, group, (rank - first) % self.world
                if at >= group:
                    continue
            block = -(-shape[dim] // ranks)
            lo, hi = min(shape[dim], at * block), min(shape[dim], (at + 1) * block)
            local = list(shape)
            local[dim] = hi - lo
            offset = [0, 0]
            offset[dim] = lo
            yield name, shape, dtype, tuple(local), tuple(offset)

    def state(self, rank: int, step: int) -> dict[str, Any]:
        """Rank ``rank``'s state (the same at every step: the layout stays). Its tensors are never
        filled: a save refuses meta tensors, and memory allocated but never touched costs no pages."""
        tensors: dict[str, Any] = {}
        for name, shape, dtype, local, offset in self.held(rank):
            t = torch.empty(local, dtype=dtype)
            tensors[name] = t if offset is None else Shard(t, global_shape=shape, global_offset=offset)
        return {"tensors": tensors, "epoch": 0}

    def local_plan(self, rank: int, step: int, sizes: tuple[int, int] = DEFAULT_SIZES) -> LocalPlan:
        """What ``plan_local`` makes of :meth:`state` (the local plan rank ``rank`` sends), made
        from the layout alone: a rank simulated by its messages allocates no tensor."""
        held = [(name, f"tensors/{name}", *rest) for name, *rest in self.held(rank)]
        rows = sorted((key, dtypes.name(dtype), shape, offset or (0,) * len(shape), local)
                      for _, key, shape, dtype, local, offset in held)
        tree = {"dict": [["tensors", {"dict": [[name, {"tensor": key}] for name, key, *_ in held]}],
                         ["epoch", {"value": 0}]]}
        return LocalPlan.of(rank, rows, pickle.dumps(tree), sizes)


def changed_share(share: float) -> Changed:
    """Rows (row-sparse tensors) or chunks (dense ones) changed in a part: ``share`` of them."""

    def changed(key: str, part: PartPlan, t: torch.Tensor, sizes: tuple[int, int] = DEFAULT_SIZES) -> int:
        if is_row_sparse(t):
            return math.ceil(share * part.box.shape[0])
        n = -(-t.numel() // dense_chunk_elems(t.numel(), t.element_size(), sizes[1])) if t.numel() else 0
        return math.ceil(share * n)

    return changed


# -- what the writers would have written --------------------------------------------------------


def _stored(decoded: int, coded: bool) -> int:
    """A chunk's stored size: raw, or a blosc chunk that could not compress (its largest size)."""
    return decoded + BLOSC_HEADER if coded else decoded


def _stand_in(*names: object) -> str:
    """A data chunk's checksum stand-in (the simulation has no data)."""
    return xxhash.xxh3_64_hexdigest(repr(names).encode())


def written(save: SavePlan, rank: int, items: tuple[WriteItem, ...], held: Sequence[int],
            sizes: tuple[int, int]) -> WriteResult:
    """What ``rank``'s writers report for ``items``, holding ``held`` rows or chunks."""
    files: dict[tuple[str, str], ChunkMap] = {}
    pack_size = 0
    for it, n in zip(items, held):
        t, box = it.tensor, it.part.box
        enc = choose(save.kind, tuple(t.shape), False)
        cs = enc.chunk_shape(box.shape, t.element_size(), n, sizes, None)
        names = [(a.chunk(i), _stored(a.chunk_bytes, a.coded))
                 for a in enc.arrays(t.dtype, box.shape, cs, n) for i in range(n if enc.sparse else a.chunks)]
        chunks: ChunkMap = {}
        packed = not enc.whole or in_pack(box.shape, t.element_size(), cs)
        for i, (name, size) in enumerate(names):
            if not packed:
                chunks[name] = (size, _stand_in(it.key, it.part.path, i))
            else:
                chunks[name] = (size, _stand_in(it.key, it.part.path, name), pack_size)
                pack_size += size
        files[(it.key, it.part.path)] = chunks
    packs: dict[str, ChunkMap] = {}
    if pack_size:
        doc = array_doc((pack_size,), (pack_size,), torch.uint8, raw=True)
        packs[pack_name(rank)] = {"c.0": (pack_size, _stand_in(rank)),
                                  "zarr.json": (len(doc), xxhash.xxh3_64_hexdigest(doc))}
    return WriteResult(files, packs)


# -- the simulation -----------------------------------------------------------------------------


@dataclass
class Phase:
    """One phase: seconds on the coordinator and on the slowest other rank simulated in full (for
    a broadcast or scatter, the seconds a rank takes to unpickle what it receives), the bytes one
    rank sends (the largest message), the bytes the coordinator receives and the bytes a rank other
    than the coordinator receives (the largest)."""

    name: str
    where: str
    seconds: float = 0.0
    other_seconds: float = 0.0
    sent_max: int = 0
    received: int = 0
    rank_received: int = 0
    peak_rss_mib: float = 0.0
    unpickle: float = 0.0  # the coordinator's, of what a gather brought it


@dataclass
class Run:
    """Every phase of both saves, the records, and the objects the tests compare."""

    phases: list[Phase] = field(default_factory=list)
    plans: list[GlobalPlan] = field(default_factory=list)
    records: list[Manifest] = field(default_factory=list)  # as parsed: parts read on first use
    roots: list[bytes] = field(default_factory=list)  # root records
    table_bytes: list[int] = field(default_factory=list)  # all part tables of each record
    one_tensor_tables: list[int] = field(default_factory=list)  # tables a load of one tensor reads
    # per record, what a restore of one rank's shards reads: tables, bytes of its own, of others'
    restore_reads: list[tuple[int, int, int]] = field(default_factory=list)
    progress: bool = False

    @property
    def record_bytes(self) -> list[int]:
        return [len(r) for r in self.roots]

    def add(self, phase: Phase) -> Phase:
        phase.peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        self.phases.append(phase)
        if self.progress:
            print(f"  {phase.name}: {phase.seconds:.2f} s, {phase.peak_rss_mib:.0f} MiB", file=sys.stderr,
                  flush=True)
        return phase

    def rank_received(self, step: int) -> int:
        """Bytes a rank other than the coordinator receives in the save of ``step``."""
        return sum(p.rank_received for p in self.phases if p.name.startswith(f"{step}: "))


def _wire(value: Any) -> int:
    return len(pickle.dumps((True, value)))


class Ranks:
    """The simulated ranks: those in ``full`` run every phase on their state; the others exist
    only as the messages they send, made from ``plan_of`` and their parts, and no state of theirs
    is allocated, so a world of thousands fits in one process.

    A phase on every rank is timed on the ranks simulated in full (the coordinator's seconds, and
    the slowest other's); what a gather delivers to the coordinator is every rank's message,
    pickled as the collectives send it and unpickled there, one at a time.
    """

    def __init__(self, world: int, state_of: StateOf, plan_of: PlanOf | None, full: Collection[int] | None,
                 sizes: tuple[int, int]):
        self.world, self.state_of, self.plan_of, self.sizes = world, state_of, plan_of, sizes
        self.full = set(range(world)) if full is None else set(full)
        if 0 not in self.full or (plan_of is None and len(self.full) < world):
            raise ValueError("the coordinator (rank 0) runs in full, and other ranks need plan_of")
        self.locals: dict[int, LocalState] = {}  # the last local state of each rank run in full

    def each(self, fn: Callable[[int], Any], *, timed: bool = False) -> Iterator[tuple[int, Any, float]]:
        """``fn(rank)`` on every rank, with its seconds (0 on ranks not run in full); ``timed``:
        ``fn`` returns its value and the seconds it counts."""
        for r in range(self.world):
            t0 = time.perf_counter()
            out = fn(r)
            seconds = time.perf_counter() - t0
            if timed:
                out, seconds = out
            yield r, out, seconds if r in self.full else 0.0

    def gather(self, run: Run, name: str, fn: Callable[[int], Any], *, timed: bool = False) -> list[Any]:
        """Every rank's ``fn(rank)``, as the coordinator receives it (unpickled there); see
        :meth:`each` for ``timed``."""
        received, sizes, seconds, unpickle = [], [], {}, 0.0
        for r, value, s in self.each(fn, timed=timed):
            message = pickle.dumps((True, value))
            t0 = time.perf_counter()
            with paused():  # as deltackpt/wire.py unpickles a gather
                received.append(pickle.loads(message)[1])
            unpickle += time.perf_counter() - t0
            sizes.append(len(message))
            seconds[r] = s
        run.add(Phase(name, "every rank", seconds[0], max((v for r, v in seconds.items() if r), default=0.0),
                      max(sizes), sum(sizes), unpickle=unpickle))
        return received

    def local(self, step: int, r: int) -> LocalPlan | LocalState:
        """``plan_local`` on a rank run in full (its last local state kept as a saver keeps it),
        the local plan alone on another."""
        if r not in self.full:
            assert self.plan_of is not None
            return self.plan_of(r, step)
        last = self.locals.get(r)
        local = plan_local(step, self.state_of(r, step), r, self.sizes,
                           None if last is None else replace(last, shards={}))
        self.locals[r] = local
        return local

    def items(self, plan: GlobalPlan, r: int, parts: tuple[tuple[str, PartPlan], ...]) -> tuple[WriteItem, ...]:
        """The parts rank ``r`` writes with its tensors: a rank not run in full holds meta tensors
        of its parts' shapes."""
        if r in self.full:
            return write_items(parts, self.locals[r])
        return tuple(WriteItem(key, p, _meta(p.box.shape, plan.tensors[key].dtype)) for key, p in parts)


@functools.lru_cache(maxsize=65536)
def _meta(shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    return torch.empty(shape, dtype=dtypes.from_name(dtype), device="meta")


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _scatter(run: Run, name: str, values: list[Any], seconds: float) -> Phase:
    """The coordinator's ``values[r]`` to each rank ``r``; the largest is unpickled, timed."""
    messages = [pickle.dumps((True, v)) for v in values]
    largest = max(messages[1:] or messages, key=len)
    _, unpickle = _timed(lambda: pickle.loads(largest))
    return run.add(Phase(name, "coordinator", seconds, unpickle, len(largest), 0, len(largest)))


class Described:
    """Stands for the coordinator's metadata writer in :func:`~deltackpt.save.stage.describe`:
    counts the arrays it would describe."""

    def __init__(self) -> None:
        self.arrays = 0

    def array(self, *args: Any, **kwargs: Any) -> None:
        self.arrays += 1

    def groups(self, folders: list[str]) -> None:
        pass


def simulate(world: int, state_of: StateOf, *, changed: Changed, sizes: tuple[int, int] = DEFAULT_SIZES,
             policy: BasePolicy | None = None, progress: bool = False, full: Collection[int] | None = None,
             plan_of: PlanOf | None = None, every_table: bool = True) -> Run:
    """A base with a new layout, then a delta with the same layout, on ``world`` simulated ranks
    whose states ``state_of(rank, step)`` gives; ``changed`` says what changed in each part for the
    delta. The ranks in ``full`` (default: all; rank 0 always) run every phase on their state; the
    others only send their messages, their local plans given by ``plan_of(rank, step)``.
    ``every_table``: time reading every part table (what a ``load`` of every tensor builds, which
    holds every part at once)."""
    run, policy = Run(progress=progress), policy or EveryK(100)
    ranks = Ranks(world, state_of, plan_of, full, sizes)
    planner, head, chain = GlobalPlanner(world), None, ChainState(0, 0, 0)
    digests: dict[int, str] = {}
    assigned: dict[int, Assignment] = {}
    sent_plans: dict[int, LocalPlan] = {}  # each rank's local plan, as it made it
    mine: dict[int, tuple[tuple[tuple[str, PartPlan], ...], tuple[int, ...]]] = {}  # its parts, their places
    reuses: dict[int, Reuse] = {}  # what the records of each rank run in full share from save to save
    coordinator_reuse = Reuse()
    for step in (1, 2):
        # plan_local, on every rank: the local plan, or its digest alone when unchanged.
        def request(r: int) -> PlanRequest:
            local = ranks.local(step, r)
            plan, digest = (local.plan, local.digest) if isinstance(local, LocalState) else (local, local.digest())
            sent_plans[r] = plan
            sent = PlanRequest(step, digest, None if digests.get(r) == digest else plan,
                               assigned[r].tag if r in assigned else None)
            digests[r] = digest
            return sent

        sent = ranks.gather(run, f"{step}: plan_local", request)
        # plan_global, on the coordinator: each rank receives its own parts (when it lacks them).
        answers, s = _timed(lambda: planner.assign(sent, lambda _: None))
        del sent
        phase = _scatter(run, f"{step}: plan_global", answers, s)
        assigned.update((r, a) for r, a in enumerate(answers) if a is not None)

        def parts(r: int) -> None:  # a rank that receives its assignment makes its parts of it
            if answers[r] is not None:
                mine[r] = answers[r].parts(sent_plans[r])

        made = {r: s for r, _, s in ranks.each(parts)}
        phase.other_seconds += max((v for r, v in made.items() if r), default=0.0)
        del answers
        plan = planner.plan
        run.plans.append(plan)
        seconds = {r: s for r, _, s in ranks.each(lambda r: ranks.items(plan, r, mine[r][0]))}
        run.add(Phase(f"{step}: write_items", "every rank", seconds[0], max(v for r, v in seconds.items() if r)
                      if world > 1 else 0.0))
        # scan, on every rank: what changed in each part it writes, summed up for the coordinator.
        def scans_of(r: int) -> list[PartScan]:
            return _scan(ranks.items(plan, r, mine[r][0]), changed if head is not None else None, sizes)

        summaries = ranks.gather(run, f"{step}: scan", lambda r: ScanSummary.of(scans_of(r)))
        save, s = _timed(lambda: decide(policy, head, chain, plan, summaries, step=step, attempt=f"{step}-sim"))
        _scatter(run, f"{step}: decide", [save] * world, s)
        described = Described()
        _, s = _timed(lambda: describe(described, save, plan, sizes))  # type: ignore[arg-type]
        run.add(Phase(f"{step}: describe ({described.arrays} arrays)", "coordinator", s))
        ranks.gather(run, f"{step}: stage", lambda r: None)
        _scatter(run, f"{step}: stage (outcome)", [None] * world, 0.0)

        # write: each rank's part table of what its writers wrote (timed), its listing to the coordinator.
        tables: dict[int, bytes] = {}

        def table(r: int) -> tuple[Written, float]:
            items = ranks.items(plan, r, mine[r][0])
            scans = scans_of(r)  # kept by the rank since its scan
            held = counts(save.kind, (i.part for i in items), scans)
            result = written(save, r, items, held, sizes)
            shapes = {it.key: plan.tensors[it.key].global_shape for it in items}
            # A rank run in full keeps what its saves share, as its checkpointer does (the
            # others' would hold every part of the job).
            reuse = reuses.setdefault(r, Reuse()) if r in ranks.full else None
            (data, sent), s = _timed(lambda: part_table(save, r, items, mine[r][1], shapes, held, result,
                                                         sizes, {s.key for s in scans if s.aligned}, reuse))
            if data is not None:
                tables[r] = data
            return sent, s  # the table alone: the writes are made up

        sent = ranks.gather(run, f"{step}: part table (write)", table, timed=True)
        root, s = _timed(lambda: record_root(
            save, plan, sent, head=head, world_size=world,
            policy={"name": policy.name, "decision": str(save.kind), "reason": save.reason},
            aligned=aligned_keys(summaries), reuse=coordinator_reuse))
        table_bytes = sum(len(t) for t in tables.values())
        run.add(Phase(f"{step}: record_root", "coordinator", s, 0.0, len(root)))
        record = parse_manifest(root, commit_key(step), _reader(tables))
        _scatter(run, f"{step}: commit", [Committed(record.bytes_written, record.state_bytes,
                                                    sum(w.rows_changed for w in sent))] * world, 0.0)
        reader = 1 if world > 1 else 0
        _readers(run, step, root, tables, every_table, reader,
                 {k: sh.box for k, sh in ranks.locals[reader].shards.items()} if reader in ranks.locals else {})
        run.table_bytes.append(table_bytes)
        head = record
        chain = ChainState(0, 0, record.bytes_written) if save.kind == Kind.BASE else ChainState(
            chain.deltas + 1, chain.delta_bytes + record.bytes_written, chain.base_bytes)
    return run


def _readers(run: Run, step: int, root: bytes, tables: dict[int, bytes], every_table: bool, rank: int,
             boxes: Mapping[str, Box]) -> None:
    """What readers of the record take: the root alone (``ls``), the part tables a restore of
    rank ``rank``'s shards (``boxes``, by key) reads, one tensor's part tables (a ``load`` of one
    key) and, with ``every_table``, every table (a restore or ``load`` of every tensor)."""
    where = f"commits/{step}"
    parsed, s = _timed(lambda: parse_manifest(root, where, _reader(tables)))
    run.add(Phase(f"{step}: parse root (ls; reader)", "every reader", s, 0.0, 0, len(root)))
    read: set[int] = set()
    mine = parse_manifest(root, where, _reader(tables, read))
    _, s = _timed(lambda: [mine.tensors[k].parts_meeting(box) for k, box in boxes.items()])
    others = sum(len(tables[r]) for r in read if r != rank)
    run.add(Phase(f"{step}: rank {rank}'s shards' part tables (restore; reader)", "every reader", s, 0.0, 0,
                  others + len(root)))
    run.restore_reads.append((len(read), len(tables.get(rank, b"")), others))
    one = next(iter(parsed.tensors), None)
    _, s = _timed(lambda: one is not None and tuple(parsed.tensors[one].parts))
    owners = {p.rank for p in parsed.tensors[one].parts} if one is not None else set()
    run.add(Phase(f"{step}: one tensor's part tables (load of one key; reader)", "every reader", s, 0.0,
                  0, sum(len(tables[r]) for r in owners)))
    if every_table:
        every = parse_manifest(root, where, _reader(tables))
        _, s = _timed(lambda: [tuple(t.parts) for t in every.tensors.values()])
        del every
        run.add(Phase(f"{step}: every part table (restore, load; reader)", "every reader", s, 0.0, 0,
                      sum(map(len, tables.values()))))
    run.records.append(parse_manifest(root, where, _reader(tables)))
    run.roots.append(root)
    run.one_tensor_tables.append(len(owners))


def _reader(tables: dict[int, bytes], read: set[int] | None = None) -> TableReader:
    """Reads a part table from memory, checked as a store checks it; notes each rank's table
    read in ``read``."""
    def reading(key: str, size: int, digest: str) -> bytes:
        rank = int(key.rsplit(".", 1)[1])
        if read is not None:
            read.add(rank)
        data = tables[rank]
        assert len(data) == size and checksum(data) == digest
        return data
    return reading


def time_ls(root: bytes, steps: int) -> float:
    """Seconds ``deltackpt ls --json`` takes on a local store of ``steps`` root records like
    ``root`` (a base every 10 steps, deltas between); ls reads roots only, so no table is
    written."""
    doc = json.loads(root)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(LocalStorage(tmp))
        store.create()
        for step in range(steps):
            base = step - step % 10
            doc.update(step=step, attempt=f"{step}-sim", kind="base" if step == base else "delta",
                       parent=None if step == base else step - 1, base=base, chain_length=step - base,
                       parent_attempt=None if step == base else f"{step - 1}-sim")
            store.storage.put_if_absent(commit_key(step), json.dumps(doc).encode())
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert cli.main(["ls", tmp, "--json"]) == 0
        seconds = time.perf_counter() - t0
        assert len(json.loads(out.getvalue())) == steps
    return seconds


def _scan(items: tuple[WriteItem, ...], changed: Changed | None, sizes: tuple[int, int]) -> list[PartScan]:
    out = []
    for it in items:
        ids = None if changed is None else torch.empty(changed(it.key, it.part, it.tensor), dtype=torch.int64,
                                                       device="meta")
        out.append(summarize(it.key, it.part.path, it.tensor, TensorChange(ids, None),
                             lambda t: dense_chunk_elems(t.numel(), t.element_size(), sizes[1])))
    return out


# -- the bench ----------------------------------------------------------------------------------


def table(run: Run, job: Job) -> str:
    lines = [f"W = {job.world} ranks x T = {job.tensors} tensors, mix {job.mix}; "
             f"root records {', '.join(f'{b / MiB:.3f} MiB' for b in run.record_bytes)}; part tables "
             f"{', '.join(f'{b / MiB:.1f} MiB' for b in run.table_bytes)}; a load of one tensor reads "
             f"{', '.join(map(str, run.one_tensor_tables))} tables; a restore of rank 1's shards reads "
             f"{', '.join(f'{n} tables ({own:,} B its own, {others:,} B others)' for n, own, others in run.restore_reads)}"
             f"; received by a "
             f"rank other than the coordinator: {run.rank_received(1):,} B (new layout), "
             f"{run.rank_received(2):,} B (a later save)",
             "", "| phase | where | s (coordinator) | s (another rank: slowest in full / unpickling) "
             "| s (coordinator unpickles a gather) | MB sent by a rank (max) | MB received by the coordinator "
             "| MB received by another rank | peak RSS MiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for p in run.phases:
        lines.append(f"| {p.name} | {p.where} | {p.seconds:.4f} | {p.other_seconds:.4f} | {p.unpickle:.4f} | "
                     f"{p.sent_max / 1e6:.3f} | {p.received / 1e6:.3f} | {p.rank_received / 1e6:.3f} | "
                     f"{p.peak_rss_mib:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--mix", default="0.8,0.1,0.1", help="shares row-, column-, table-wise")
    ap.add_argument("--col-group", type=int, default=8, help="ranks a column-wise tensor spans")
    ap.add_argument("--changed", type=float, default=0.01, help="share of rows/chunks a delta writes")
    ap.add_argument("--full", default="0,1",
                    help="ranks run in full, comma-separated, or 'all' (the others send their messages only)")
    ap.add_argument("--every-table", action=argparse.BooleanOptionalAction, default=True,
                    help="time reading every part table (a load of every tensor: it holds every part)")
    ap.add_argument("--ls-steps", type=int, default=300,
                    help="steps of a store whose `deltackpt ls` is timed (0: none)")
    ap.add_argument("--json", metavar="PATH", default=None,
                    help="where the figures go as JSON (default bench/results/control_plane_W{W}_T{T}.json)")
    args = ap.parse_args()
    row, col, tab = (float(x) for x in args.mix.split(","))
    job = Job(args.world, args.tensors, (row, col, tab), args.col_group)
    full = None if args.full == "all" else {int(r) for r in args.full.split(",") if int(r) < job.world}
    states = {r: job.state(r, 1) for r in (range(job.world) if full is None else full)}
    t0 = time.perf_counter()
    run = simulate(job.world, lambda r, _: states[r], changed=changed_share(args.changed), progress=True,
                   full=full, plan_of=job.local_plan, every_table=args.every_table)
    parts = sum(t.count for t in run.plans[-1].tensors.values())
    text = table(run, job)
    print(text)
    print(f"\n{parts} parts; simulation wall {time.perf_counter() - t0:.0f} s")
    from common import figure, write_figures  # bench/common.py: on sys.path when run as a script

    rows = []
    for p in run.phases:
        rows.append(figure(f"{p.name} (coordinator)", p.seconds))
        rows.append(figure(f"{p.name} (another rank)", p.other_seconds))
        rows.append(figure(f"{p.name}: MB received by the coordinator", p.received / 1e6, "MB"))
        rows.append(figure(f"{p.name}: MB received by another rank", p.rank_received / 1e6, "MB"))
    if args.ls_steps:
        seconds = time_ls(run.roots[-1], args.ls_steps)
        print(f"deltackpt ls of {args.ls_steps} steps (a base every 10) of this job's later save's "
              f"root record: {seconds:.3f} s")
        rows.append(figure(f"ls of {args.ls_steps} steps", seconds))
    rows += [figure(f"root record of save {i + 1}", b / MiB, "MiB") for i, b in enumerate(run.record_bytes)]
    rows += [figure(f"restore of rank 1's shards, save {i + 1}: others' part tables read", others / MiB, "MiB")
             for i, (_, _, others) in enumerate(run.restore_reads)]
    rows += [figure(f"part tables of save {i + 1}", b / MiB, "MiB") for i, b in enumerate(run.table_bytes)]
    out = args.json or str(Path(__file__).parent / "results" / f"control_plane_W{job.world}_T{job.tensors}.json")
    write_figures(out, "bench_control_plane", args, rows, parts=parts, record_bytes=run.record_bytes,
                  phases=[vars(p) for p in run.phases])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
