"""The control plane of a save at scale, simulated in one process: W ranks x T tensors.

Drives the package's own control-plane code for every simulated rank, without processes or I/O:
``plan_local`` on every rank's state (tensors allocated but never filled), the coordinator's
``GlobalPlanner``, ``write_items``, ``summarize`` (scan summaries), ``decide``,
``build_manifest`` and ``encode_record`` (the root record and the part tables), then
``parse_manifest`` (the root alone, as ``ls`` reads it) and every part table, as a restore or
``load`` of every tensor reads and checks them. What the writers would have written is made up from
the plan (chunk sizes exact, coded chunks at their largest size, data chunk checksums
stand-ins); the metadata files' entries are real.

Two saves: a base with a new layout (every local plan sent, a new global plan), then a delta
with the layout unchanged (digests only, the plan cached) where ``--changed`` of each part's
rows or chunks changed. Message sizes are the pickles the collectives send (``(ok, value)``,
see ``deltackpt/collectives.py``): a gather delivers every rank's message to the coordinator, a
broadcast the coordinator's message to every rank, a scatter each rank its own.

Last, ``deltackpt ls`` is timed on a store of ``--ls-steps`` root records like the later save's.

Run:  python bench/bench_control_plane.py --world 1024 --tensors 1000
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from deltackpt import Shard, cli
from deltackpt.format import dtypes
from deltackpt.format.encodings import FULL, choose, dense_chunk_elems, in_pack
from deltackpt.format.layout import commit_key, pack_name
from deltackpt.format.limits import BLOSC_HEADER
from deltackpt.format.manifest import ChunkMap, Manifest
from deltackpt.format.record_checks import parse_manifest
from deltackpt.format.record_io import TableReader, checksum, encode_record
from deltackpt.format.zarr_meta import array_doc
from deltackpt.policy import BasePolicy, ChainState, EveryK
from deltackpt.save.commit import build_manifest
from deltackpt.save.decide import counts, decide
from deltackpt.save.local import plan_local, write_items
from deltackpt.save.planner import Assignment, GlobalPlan, GlobalPlanner, PartPlan, PlanRequest
from deltackpt.save.scan import PartScan, summarize
from deltackpt.save.types import Committed, Kind, SavePlan, WriteItem, WriteResult
from deltackpt.storage.local import LocalStorage
from deltackpt.store import Store
from deltackpt.tracking.changes import TensorChange, is_row_sparse

MiB = 1 << 20
DEFAULT_SIZES = (32 * MiB, 1 * MiB)  # the Checkpointer's chunk_bytes, dense_chunk_bytes
StateOf = Callable[[int, int], Mapping[str, Any]]  # (rank, step) -> state
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

    def state(self, rank: int, step: int) -> dict[str, Any]:
        """Rank ``rank``'s state (the same at every step: the layout stays). Its tensors are never
        filled: a save refuses meta tensors, and memory allocated but never touched costs no pages."""
        tensors: dict[str, Any] = {}
        for i, (name, scheme, shape, dtype) in enumerate(self.layout()):
            if scheme == "table":
                if i % self.world == rank:
                    tensors[name] = torch.empty(shape, dtype=dtype)
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
            tensors[name] = Shard(torch.empty(local, dtype=dtype),
                                  global_shape=shape, global_offset=tuple(offset))
        return {"tensors": tensors, "epoch": 0}


def changed_share(share: float) -> Changed:
    """Rows (row-sparse tensors) or chunks (dense ones) changed in a part: ``share`` of them."""

    def changed(key: str, part: PartPlan, t: torch.Tensor, sizes: tuple[int, int] = DEFAULT_SIZES) -> int:
        if is_row_sparse(t):
            return math.ceil(share * part.box.shape[0])
        n = -(-t.numel() // dense_chunk_elems(t.numel(), t.element_size(), sizes[1])) if t.numel() else 0
        return math.ceil(share * n)

    return changed


# -- what the writers would have written --------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _doc_entry(shape: tuple[int, ...], chunks: tuple[int, ...], dtype: torch.dtype) -> tuple[int, str]:
    doc = array_doc(shape, chunks, dtype)
    return len(doc), xxhash.xxh3_64_hexdigest(doc)


def _stored(decoded: int, coded: bool) -> int:
    """A chunk's stored size: raw, or a blosc chunk that could not compress (its largest size)."""
    return decoded + BLOSC_HEADER if coded else decoded


def _stand_in(*names: object) -> str:
    """A data chunk's checksum stand-in (the simulation has no data)."""
    return xxhash.xxh3_64_hexdigest(repr(names).encode())


def written(save: SavePlan, rank: int, items: tuple[WriteItem, ...], held: Mapping[tuple[str, str], int],
            sizes: tuple[int, int], *, plan: GlobalPlan | None) -> WriteResult:
    """What ``rank``'s writers report for ``items``, holding ``held`` rows or chunks (and the
    coordinator, which passes ``plan``, for the metadata)."""
    files: dict[tuple[str, str], ChunkMap] = {}
    pack_size = 0
    for it in items:
        t, box = it.tensor, it.part.box
        n = held[(it.key, it.part.path)]
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
    if plan is not None and save.kind == Kind.BASE:
        for tp in plan.tensors.values():
            dtype = dtypes.from_name(tp.dtype)
            for p in tp.parts:
                cs = FULL.chunk_shape(p.box.shape, dtype.itemsize, p.box.shape[0] if p.box.shape else 1, sizes,
                                      None)
                if in_pack(p.box.shape, dtype.itemsize, cs):
                    continue
                files.setdefault((tp.key, p.path), {})["zarr.json"] = _doc_entry(p.box.shape, cs, dtype)
    packs: dict[str, ChunkMap] = {}
    if pack_size:
        doc = array_doc((pack_size,), (pack_size,), torch.uint8, raw=True)
        packs[pack_name(rank)] = {"c.0": (pack_size, _stand_in(rank)),
                                  "zarr.json": (len(doc), xxhash.xxh3_64_hexdigest(doc))}
    return WriteResult(files, packs)


# -- the simulation -----------------------------------------------------------------------------


@dataclass
class Phase:
    """One phase: seconds on the coordinator (or summed over ranks, with the slowest rank), the
    bytes one rank sends (the largest message), the bytes the coordinator receives and the bytes
    every other rank receives."""

    name: str
    where: str
    seconds: float = 0.0
    max_rank_seconds: float = 0.0
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
    records: list[Manifest] = field(default_factory=list)
    record_bytes: list[int] = field(default_factory=list)  # root records
    table_bytes: list[int] = field(default_factory=list)  # all part tables of each record
    one_tensor_tables: list[int] = field(default_factory=list)  # tables a load of one tensor reads
    progress: bool = False

    def add(self, phase: Phase) -> Phase:
        phase.peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        self.phases.append(phase)
        if self.progress:
            print(f"  {phase.name}: {phase.seconds:.2f} s", file=sys.stderr, flush=True)
        return phase

    def rank_received(self, step: int) -> int:
        """Bytes a rank other than the coordinator receives in the save of ``step``."""
        return sum(p.rank_received for p in self.phases if p.name.startswith(f"{step}: "))


def _wire(value: Any) -> int:
    return len(pickle.dumps((True, value)))


def _gather(run: Run, name: str, per_rank: list[Any], seconds: list[float]) -> None:
    """Every rank's message to the coordinator, which unpickles them all."""
    messages = [pickle.dumps((True, v)) for v in per_rank]
    _, unpickle = _timed(lambda: [pickle.loads(m) for m in messages])
    sizes = [len(m) for m in messages]
    run.add(Phase(name, "every rank", sum(seconds), max(seconds), max(sizes), sum(sizes), unpickle=unpickle))


def _broadcast(run: Run, name: str, value: Any, seconds: float, unpickle: float = 0.0) -> None:
    """The coordinator's ``value`` to every rank."""
    n = _wire(value)
    run.add(Phase(name, "coordinator", seconds, unpickle, n, 0, n))


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def simulate(world: int, state_of: StateOf, *, changed: Changed, sizes: tuple[int, int] = DEFAULT_SIZES,
             policy: BasePolicy | None = None, progress: bool = False) -> Run:
    """A base with a new layout, then a delta with the same layout, on ``world`` simulated ranks
    whose states ``state_of(rank, step)`` gives; ``changed`` says what changed in each part for the
    delta."""
    run, policy = Run(progress=progress), policy or EveryK(100)
    planner, head, chain = GlobalPlanner(world), None, ChainState(0, 0, 0)
    digests: dict[int, str] = {}
    assigned: dict[int, Assignment] = {}
    for step in (1, 2):
        # plan_local, on every rank: the local plan, or its digest alone when unchanged.
        sent, seconds, locals_ = [], [], {}
        for r in range(world):
            local, s = _timed(lambda: plan_local(step, state_of(r, step), r, sizes))
            sent.append(PlanRequest(step, local.digest, None if digests.get(r) == local.digest else local.plan,
                                    assigned[r].tag if r in assigned else None))
            digests[r] = local.digest
            locals_[r] = local
            seconds.append(s)
        _gather(run, f"{step}: plan_local", sent, seconds)
        # plan_global, on the coordinator: each rank receives its own parts (when it lacks them).
        answers, s = _timed(lambda: planner.assign(sent, lambda _: None))
        messages = [pickle.dumps((True, a)) for a in answers]
        largest = max(messages, key=len)
        _, unpickle = _timed(lambda: pickle.loads(largest))
        run.add(Phase(f"{step}: plan_global", "coordinator", s, unpickle, len(largest), 0, len(largest)))
        assigned.update((r, a) for r, a in enumerate(answers) if a is not None)
        plan = planner.plan
        run.plans.append(plan)
        items, seconds = [], []
        for r in range(world):
            out, s = _timed(lambda: write_items(assigned[r].parts, locals_[r]))
            items.append(out)
            seconds.append(s)
        run.add(Phase(f"{step}: write_items", "every rank", sum(seconds), max(seconds)))
        # scan, on every rank: a summary of each part it writes, to the coordinator.
        scans, seconds = [], []
        for r in range(world):
            out, s = _timed(lambda: _scan(items[r], changed if head is not None else None, sizes))
            scans.append(out)
            seconds.append(s)
        _gather(run, f"{step}: scan", scans, seconds)
        everyone = [x for per in scans for x in per]
        save, s = _timed(lambda: decide(policy, head, chain, plan, everyone, step=step, attempt=f"{step}-sim"))
        _broadcast(run, f"{step}: decide", save, s)
        results, seconds = [], []
        for r in range(world):
            out, s = _timed(lambda: written(save, r, items[r], counts(save.kind, ((i.key, i.part) for i in items[r]),
                                                                      scans[r]),
                                            sizes, plan=plan if r == 0 else None))
            results.append(out)
            seconds.append(s)
        _gather(run, f"{step}: stage", [None] * world, [0.0] * world)
        _broadcast(run, f"{step}: stage (outcome)", None, 0.0)
        _gather(run, f"{step}: write results", results, seconds)
        record, s = _timed(lambda: build_manifest(
            save, plan, counts(save.kind, plan.parts(), everyone), results, head=head, world_size=world,
            policy={"name": policy.name, "decision": str(save.kind), "reason": save.reason}, sizes=sizes))
        run.add(Phase(f"{step}: build_manifest", "coordinator", s))
        (root, tables), s = _timed(lambda: encode_record(record))
        table_bytes = sum(len(t) for t in tables.values())
        run.add(Phase(f"{step}: encode_record", "coordinator", s, 0.0, len(root) + table_bytes))
        rows = sum(r.changed for r in record.tensors.values() if len(r.shape) >= 2)
        _broadcast(run, f"{step}: commit", Committed(record.bytes_written, record.state_bytes, rows), 0.0)
        del results, scans, everyone, items, locals_, sent
        parsed, s = _timed(lambda: parse_manifest(root, f"commits/{step}", _reader(tables)))
        run.add(Phase(f"{step}: parse root (ls; reader)", "every reader", s, 0.0, 0, len(root)))
        fresh = parse_manifest(root, f"commits/{step}", _reader(tables))
        one = next(iter(fresh.tensors), None)
        _, s = _timed(lambda: one is not None and tuple(fresh.tensors[one].parts))
        run.add(Phase(f"{step}: one tensor's part tables (load of one key; reader)", "every reader", s, 0.0,
                      0, sum(len(tables[r]) for r in {p.rank for p in fresh.tensors[one].parts}) if one else 0))
        _, s = _timed(lambda: [tuple(t.parts) for t in parsed.tensors.values()])
        run.add(Phase(f"{step}: every part table (restore, load; reader)", "every reader", s, 0.0, 0,
                      table_bytes))
        tables_read = len({p.rank for p in parsed.tensors[one].parts}) if one is not None else 0
        run.records.append(parsed)
        run.record_bytes.append(len(root))
        run.table_bytes.append(table_bytes)
        run.one_tensor_tables.append(tables_read)
        head = record
        chain = ChainState(0, 0, record.bytes_written) if save.kind == Kind.BASE else ChainState(
            chain.deltas + 1, chain.delta_bytes + record.bytes_written, chain.base_bytes)
    return run


def _reader(tables: dict[int, bytes]) -> TableReader:
    """Reads a part table from memory, checked as a store checks it."""
    def read(key: str, size: int, digest: str) -> bytes:
        data = tables[int(key.rsplit(".", 1)[1])]
        assert len(data) == size and checksum(data) == digest
        return data
    return read


def time_ls(record: Manifest, steps: int) -> float:
    """Seconds ``deltackpt ls --json`` takes on a local store of ``steps`` root records like
    ``record`` (a base every 10 steps, deltas between); ls reads roots only, so no table is
    written."""
    root, _ = encode_record(record)
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
             f"{', '.join(map(str, run.one_tensor_tables))} tables; received by a "
             f"rank other than the coordinator: {run.rank_received(1):,} B (new layout), "
             f"{run.rank_received(2):,} B (a later save)",
             "", "| phase | where | s (coordinator / per rank mean) | s (slowest rank / unpickle) "
             "| s (coordinator unpickles a gather) | MB sent by a rank (max) | MB received by the coordinator "
             "| MB received by another rank | peak RSS MiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for p in run.phases:
        mean = p.seconds / job.world if p.where == "every rank" else p.seconds
        lines.append(f"| {p.name} | {p.where} | {mean:.4f} | {p.max_rank_seconds:.4f} | {p.unpickle:.4f} | "
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
    ap.add_argument("--ls-steps", type=int, default=300,
                    help="steps of a store whose `deltackpt ls` is timed (0: none)")
    ap.add_argument("--json", metavar="PATH", default=None,
                    help="where the figures go as JSON (default bench/results/control_plane_W{W}_T{T}.json)")
    args = ap.parse_args()
    row, col, tab = (float(x) for x in args.mix.split(","))
    job = Job(args.world, args.tensors, (row, col, tab), args.col_group)
    t0 = time.perf_counter()
    run = simulate(job.world, job.state, changed=changed_share(args.changed), progress=True)
    parts = sum(len(t.parts) for t in run.plans[-1].tensors.values())
    text = table(run, job)
    print(text)
    print(f"\n{parts} parts; simulation wall {time.perf_counter() - t0:.0f} s")
    from common import figure, write_figures  # bench/common.py: on sys.path when run as a script

    rows = []
    for p in run.phases:
        mean = p.seconds / job.world if p.where == "every rank" else p.seconds
        rows.append(figure(f"{p.name} ({'per rank mean' if p.where == 'every rank' else p.where})", mean))
        rows.append(figure(f"{p.name}: MB received per rank", p.received / 1e6, "MB"))
    if args.ls_steps:
        seconds = time_ls(run.records[-1], args.ls_steps)
        print(f"deltackpt ls of {args.ls_steps} steps (a base every 10) of this job's later save's "
              f"root record: {seconds:.3f} s")
        rows.append(figure(f"ls of {args.ls_steps} steps", seconds))
    rows += [figure(f"root record of save {i + 1}", b / MiB, "MiB") for i, b in enumerate(run.record_bytes)]
    rows += [figure(f"part tables of save {i + 1}", b / MiB, "MiB") for i, b in enumerate(run.table_bytes)]
    out = args.json or str(Path(__file__).parent / "results" / f"control_plane_W{job.world}_T{job.tensors}.json")
    write_figures(out, "bench_control_plane", args, rows, parts=parts, record_bytes=run.record_bytes,
                  phases=[vars(p) for p in run.phases])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
