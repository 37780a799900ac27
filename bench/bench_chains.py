"""Restore time against chain length (before and after compaction), and bytes stored per policy.

Two parts, one run:

chains    One float32 table of ``--rows`` x ``--dim`` (default 2,097,152 x 64 = 512 MiB) with
          sparse updates: step 0 is a base, steps 1..max(--chain-lengths) are incremental deltas.
          Checkpointer.restore of the step at each chain length into a pre-allocated,
          pre-faulted table (store files evicted from the page cache before each restore, warm
          memory), ``--repeat`` rounds interleaved, medians; in each round, right before each
          restore, one thread reads every file of its chain (evicted) into a pre-faulted buffer:
          the floor of a restore that reads them all. Beside it, the bytes of the distinct rows
          the chain's deltas wrote (what a replay copies, each row once). Then each step is
          compacted (longest chain first, so each compaction reads the whole chain; timed), and
          the restores are timed again.
policies  A smaller table (``--policy-rows`` x ``--dim``, default 262,144 x 64 = 64 MiB) over
          ``--checkpoints`` saves (default 200) under each base-cadence policy, the same updates
          for every policy: bytes written, bytes on disk after the run, after GC with
          ``Retention(keep_last=--keep-last)``, and after compacting the oldest kept step and
          GC again; bases; worst and last chain length; restore time of the last step (median of
          ``--repeat``, as above). A PNG of cumulative bytes written per checkpoint index and of
          the chain length of every step goes to ``--out``.

Updates: between two saves, the rows looked up in one training interval get a small step
(+1e-4 x U[1, 2) on N(0, 0.01) values, so every touched row changes bits). Row ids come from
deltackpt.datasets' power-law sampler (the one behind CriteoStream: Zipf ranks, exponent
``--zipf``, scattered over the table by a keyed bijection); the lookups per interval are solved in
closed form so that the expected touched fraction per interval is ``--touched`` (default 3 %),
and the measured fraction is printed. Changes are found by the row hashes (no marks).

Every restore is checked bit for bit against an xxh3 digest of the table as it was saved, and
every kept step is restored and checked again after compaction and GC; a mismatch stops the bench.

Memory on this VM (see the project baselines): idle guest memory goes back to the host within
seconds and is slow to touch again, so the bench holds touched "reserve" memory and frees, right
before each timed restore, as much as the restore will allocate (page cache of the chain's files);
afterwards it evicts the store's files and touches the reserve again. GC runs with a grace period
of 0 s (nothing is in flight). Scratch folders live under ``--dir`` and are removed at the end.

Needs about 5x the chains table plus the longest chain's files in RAM (~4 GiB at the defaults:
restore target, reserve, a read buffer, staging) and, on disk, ``--checkpoints`` x the policy table (12.5 GiB at the defaults, for
full checkpoints every time; each store is deleted after its policy). About 3.5 minutes at the
defaults on the 2-core VM (208 s at commit 1bd9c59 while other processes took ~31 % of the cores;
up to ~7 minutes on a busier machine): ~1.2 min for the chains part, the rest for the 8 x 200 saves.

Example:
    python bench/bench_chains.py
    python bench/bench_chains.py --rows 4194304 --checkpoints 100 --dir /var/tmp --out /tmp/c.png
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

import deltackpt
from deltackpt import Checkpointer, kernels
from deltackpt.datasets._ids import PowerLawRows, zipf_pmf
from deltackpt.ops.gc import Retention
from deltackpt.policy import ChainLimit, Differential, EveryK, Intermittent

from common import (  # bench/common.py
    Reserve, cpu_seconds, evict, figure, files, json_option, others_cpu, write_figures,
)

MiB = 1 << 20
PERTURBATION = 1e-4  # times U[1, 2), added to the touched rows; far above an ulp of their values
INCREMENTAL = EveryK(10**9, max_delta_fraction=1.0)


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Prints progress, then the chain-length table and, last, the policy table (markdown).",
    )
    p.add_argument("--rows", type=int, default=2_097_152,
                   help="rows of the table of the chains part (default %(default)s)")
    p.add_argument("--dim", type=int, default=64, help="float32 values per row (default %(default)s)")
    p.add_argument("--chain-lengths", default="0,4,10,16,64",
                   help="comma-separated chain lengths to restore (default %(default)s)")
    p.add_argument("--policy-rows", type=int, default=262_144,
                   help="rows of the table of the policies part (default %(default)s)")
    p.add_argument("--checkpoints", type=int, default=200,
                   help="saves per policy (default %(default)s)")
    p.add_argument("--keep-last", type=int, default=5,
                   help="GC retention: keep the last this many steps (default %(default)s)")
    p.add_argument("--touched", type=float, default=0.03,
                   help="expected fraction of rows touched per interval (default %(default)s)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of row ids (default %(default)s)")
    p.add_argument("--repeat", type=int, default=3,
                   help="timed restores per measurement; medians are reported (default %(default)s)")
    p.add_argument("--parts", default="chains,policies",
                   help="which parts to run: chains, policies or both (default %(default)s)")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "deltackpt-chains.png"),
                   help="PNG plot path (default %(default)s; python -m bench keeps it in bench/results)")
    p.add_argument("--dir", default="/tmp", help="folder for the scratch folder (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    p.add_argument("--chunk-mib", type=int, default=32,
                   help="Checkpointer chunk_bytes in MiB (default %(default)s)")
    p.add_argument("--io-threads", type=int, default=4, help="Checkpointer io_threads (default %(default)s)")
    json_option(p)
    args = p.parse_args(argv)
    try:
        args.lengths = sorted({int(x) for x in args.chain_lengths.split(",") if x.strip()})
    except ValueError:
        p.error(f"--chain-lengths must be comma-separated ints, got {args.chain_lengths!r}")
    args.parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    if not args.parts or args.parts - {"chains", "policies"}:
        p.error("--parts takes chains, policies or both")
    if not args.lengths or args.lengths[0] < 0:
        p.error("--chain-lengths needs non-negative ints")
    if min(args.rows, args.policy_rows) < 1000 or args.dim < 1 or args.repeat < 1:
        p.error("need --rows and --policy-rows >= 1000, --dim >= 1, --repeat >= 1")
    if not 0 < args.touched < 1:
        p.error("--touched must be in (0, 1)")
    if args.checkpoints < 2 or not 1 <= args.keep_last <= args.checkpoints:
        p.error("need --checkpoints >= 2 and 1 <= --keep-last <= --checkpoints")
    return args


# -- memory, page cache, machine ----------------------------------------------------------------
# Reserve, evict, files, cpu_seconds, others_cpu: bench/common.py. Files are evicted without an
# fsync (sync=False): deltackpt fsynced them, their pages are clean.


def disk_usage(path: str) -> tuple[int, int]:
    """(bytes, files) below ``path``: the sum of file sizes (not of allocated blocks)."""
    fs = files(path)
    return sum(os.path.getsize(p) for p in fs), len(fs)


def digest(t: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(t.reshape(-1).view(torch.uint8).numpy())


def fmt_mib(n: float) -> str:
    return f"{n / MiB:,.1f}"


# -- workload -----------------------------------------------------------------------------------


class Workload:
    """The table, its updates and the row ids each interval touches (seeded, the same every time)."""

    def __init__(self, rows: int, dim: int, zipf: float, touched: float, seed: int):
        self.rows, self.dim, self.seed = rows, dim, seed
        self.sampler = PowerLawRows([rows], zipf, np.array([seed + 0x5EED], dtype=np.uint64))
        self.lookups = lookups_for(rows, zipf, touched)

    def table(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        t = torch.empty(self.rows, self.dim, dtype=torch.float32)
        piece = max(1, (64 * MiB) // (self.dim * 4))
        for lo in range(0, self.rows, piece):  # in pieces: one normal_ over the table is slower
            t[lo:lo + piece].normal_(0.0, 0.01, generator=g)
        return t

    def ids(self, interval: int) -> torch.Tensor:
        rng = np.random.default_rng([self.seed, interval])
        return torch.from_numpy(np.unique(self.sampler.sample(rng, self.lookups)[0]))

    def update(self, table: torch.Tensor, interval: int, ids: torch.Tensor | None = None) -> int:
        """Applies interval ``interval``'s step to ``table``; returns the rows touched."""
        ids = self.ids(interval) if ids is None else ids
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + interval)
        table[ids] += PERTURBATION * (1 + torch.rand(len(ids), self.dim, generator=g))
        return len(ids)


def lookups_for(rows: int, zipf: float, touched: float) -> int:
    """Lookups per interval whose expected share of distinct rows is ``touched``:
    ``1 - mean((1 - p)^n)`` over the table's Zipf probabilities, solved for n by bisection."""
    log1m = np.log1p(-zipf_pmf(rows, zipf))

    def share(n: float) -> float:
        return float(-np.expm1(n * log1m).sum() / rows)

    lo, hi = 1.0, 1e12
    for _ in range(80):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if share(mid) < touched else (lo, mid)
    return max(1, round(hi))


def make_ckpt(path: str, args: argparse.Namespace, policy: Any) -> Checkpointer:
    return Checkpointer(path, policy=policy, chunk_bytes=args.chunk_mib * MiB, io_threads=args.io_threads)


def ckpt_chunk(ckpt: Checkpointer) -> int:
    """The chunk size a checkpointer stages with (its staging buffers' size)."""
    return ckpt._sizes[0]


def timed_restore(ckpt: Checkpointer, path: str, reserve: Reserve, target: torch.Tensor,
                  step: int, want: int) -> float:
    """One restore of ``step`` into ``target`` with the store evicted and warm memory; checked."""
    chain_bytes = sum(m.bytes_written for m in ckpt.store.chain(step))
    reserve.free(chain_bytes + MiB)  # its page cache; the staging buffers exist since the warm-up
    t0 = time.perf_counter()
    ckpt.restore({"emb": target, "step": -1}, step)
    dt = time.perf_counter() - t0
    if digest(target) != want:
        raise AssertionError(f"restore of step {step} is not bit-identical to what was saved")
    evict(path, sync=False)
    reserve.hold()
    return dt


# -- part 1: restore time against chain length ---------------------------------------------------


@dataclass
class ChainRow:
    length: int
    records: int = 0
    chain_bytes: int = 0
    kept_rows: int = 0  # distinct rows the chain's deltas wrote: each is copied once by a replay
    read: list[float] = field(default_factory=list)  # reading the chain's files, the floor
    before: list[float] = field(default_factory=list)
    after: list[float] = field(default_factory=list)
    compact_s: float | None = None
    compact_bytes: int | None = None
    records_after: int = 0


def run_chains(args: argparse.Namespace, scratch: str) -> list[ChainRow]:
    w = Workload(args.rows, args.dim, args.zipf, args.touched, args.seed)
    path = os.path.join(scratch, "chains")
    nbytes = args.rows * args.dim * 4
    print(f"\n== chains: {args.rows:,} x {args.dim} float32 = {nbytes / MiB:,.0f} MiB, "
          f"{w.lookups:,} Zipf({args.zipf}) lookups per interval", flush=True)
    t0 = time.perf_counter()
    table = w.table()
    target = torch.full_like(table, float("nan"))  # the restore target: touched once, reused
    n = max(args.lengths)
    ckpt = make_ckpt(path, args, INCREMENTAL)
    digests, touched, delta_bytes = {}, [], []
    info = ckpt.save(0, {"emb": table, "step": 0})
    if info.kind != "base":
        raise AssertionError(f"step 0 is a {info.kind}")
    digests[0] = digest(table)
    base_bytes = info.bytes_written
    written = torch.zeros(args.rows, dtype=torch.bool)
    kept = {0: 0}
    for s in range(1, n + 1):
        ids = w.ids(s)
        written[ids] = True
        kept[s] = int(written.sum())
        touched.append(w.update(table, s, ids) / args.rows)
        info = ckpt.save(s, {"emb": table, "step": s})
        if info.kind != "delta" or info.rows_changed != round(touched[-1] * args.rows):
            raise AssertionError(f"step {s}: {info.kind} of {info.rows_changed} rows, "
                                 f"{round(touched[-1] * args.rows)} touched")
        delta_bytes.append(info.bytes_written)
        digests[s] = digest(table)
    print(f"saved a base of {fmt_mib(base_bytes)} MiB and {n} deltas of {fmt_mib(statistics.median(delta_bytes))} "
          f"MiB (median) in {time.perf_counter() - t0:.1f} s; touched per interval "
          f"{100 * min(touched):.2f}-{100 * max(touched):.2f} % of rows", flush=True)
    del table  # the digests stand in for it from here on

    rows = [ChainRow(L) for L in args.lengths]
    for r in rows:
        chain = ckpt.store.chain(r.length)
        r.records, r.chain_bytes = len(chain), sum(m.bytes_written for m in chain)
        r.kept_rows = kept[r.length]
    reserve = Reserve(max(r.chain_bytes for r in rows) + 4 * ckpt_chunk(ckpt))
    evict(path, sync=False)
    timed_restore(ckpt, path, reserve, target, 0, digests[0])  # warm-up: pool, threads, caches
    dirs = {r.length: [os.path.join(path, "steps", m.attempt) for m in ckpt.store.chain(r.length)] for r in rows}
    buf = np.ones(max(sum(disk_usage(d)[0] for d in ds) for ds in dirs.values()) + MiB, dtype=np.uint8)
    refs: dict[str, list[float]] = {"read": [], "hash": []}
    for _ in range(args.repeat):
        refs["read"].append(read_files(dirs[0][:1], buf, reserve))
        t1 = time.perf_counter()
        kernels.hash_rows(target)
        refs["hash"].append(time.perf_counter() - t1)
        for r in rows:
            r.read.append(read_files(dirs[r.length], buf, reserve))
            r.before.append(timed_restore(ckpt, path, reserve, target, r.length, digests[r.length]))
        print("  restore s before compaction: " + ", ".join(f"{r.length}: {r.before[-1]:.3f}" for r in rows),
              flush=True)
    for r in sorted(rows, key=lambda r: -r.length):  # longest first: each reads its whole chain
        if r.length == 0:
            continue
        reserve.free(r.chain_bytes + nbytes + 2 * ckpt_chunk(ckpt))
        t1 = time.perf_counter()
        ci = ckpt.compact(r.length)
        r.compact_s = time.perf_counter() - t1
        evict(path, sync=False)
        reserve.hold()
        if not ci.done or ci.chain_length != r.records:
            raise AssertionError(f"compaction of step {r.length}: {ci}")
        r.compact_bytes = ci.bytes_written
    for r in rows:
        r.records_after = len(ckpt.store.chain(r.length))
    for _ in range(args.repeat):
        for r in rows:
            r.after.append(timed_restore(ckpt, path, reserve, target, r.length, digests[r.length]))
        print("  restore s after compaction:  " + ", ".join(f"{r.length}: {r.after[-1]:.3f}" for r in rows),
              flush=True)
    ckpt.close()
    reserve.resize(0)
    shutil.rmtree(path, ignore_errors=True)
    return rows, refs


def read_files(folders: list[str], buf: np.ndarray, reserve: Reserve) -> float:
    """Seconds to read every file below ``folders`` (evicted) into ``buf``, pre-faulted, on one
    thread: the floor of a restore that reads them all."""
    names = sorted(f for folder in folders for f in files(folder))
    reserve.free(sum(os.path.getsize(f) for f in names) + MiB)
    t0 = time.perf_counter()
    view, at = memoryview(buf), 0
    for f in names:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(view[at:]):
                at += n
    dt = time.perf_counter() - t0
    evict(*folders, sync=False)
    reserve.hold()
    return dt


def chains_table(rows: list[ChainRow], refs: dict[str, list[float]], args: argparse.Namespace) -> str:
    nbytes = args.rows * args.dim * 4
    ref = statistics.median(rows[0].before)
    ref_read = statistics.median(rows[0].read)
    out = [
        f"Restore of the step at each chain length, {args.rows:,} x {args.dim} float32 "
        f"({nbytes / MiB:,.0f} MiB), ~{100 * args.touched:g} % of rows touched per interval, "
        f"incremental deltas; medians of {args.repeat} (files evicted, warm memory):",
        "",
        "| chain length | records read | MiB read | MiB of rows kept from deltas | reading its files s "
        "| x chain 0 | restore s before | x chain 0 | x reading its files | compaction s "
        "| restore s after compaction | records after | x chain 0 | runs before / after (s) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        b, a, rd = statistics.median(r.before), statistics.median(r.after), statistics.median(r.read)
        out.append(
            f"| {r.length} | {r.records} | {fmt_mib(r.chain_bytes)} | {fmt_mib(r.kept_rows * args.dim * 4)} | "
            f"{rd:.3f} | {rd / ref_read:.2f} | {b:.3f} | {b / ref:.2f} | {b / rd:.2f} | "
            f"{'-' if r.compact_s is None else f'{r.compact_s:.2f}'} | {a:.3f} | {r.records_after} | "
            f"{a / ref:.2f} | {' '.join(f'{x:.3f}' for x in r.before)} / {' '.join(f'{x:.3f}' for x in r.after)} |"
        )
    out += [
        "",
        f"References in the same rounds: reading the base's files (evicted) into a pre-faulted buffer "
        f"{statistics.median(refs['read']):.3f} s ({' '.join(f'{x:.3f}' for x in refs['read'])}); "
        f"kernels.hash_rows of the table (a restore re-hashes what it restored, for the next delta) "
        f"{statistics.median(refs['hash']):.3f} s ({' '.join(f'{x:.3f}' for x in refs['hash'])}).",
    ]
    return "\n".join(out)


# -- part 2: bytes stored per policy -----------------------------------------------------------


def policies() -> list[tuple[str, Any]]:
    return [
        ("full every time: EveryK(1)", EveryK(1)),
        ("EveryK(10)", EveryK(10)),
        ("EveryK(50)", EveryK(50)),
        ("Intermittent(0.5)", Intermittent(0.5)),
        ("Intermittent(1.0)", Intermittent(1.0)),
        ("Differential(EveryK(10))", Differential(EveryK(10))),
        ("ChainLimit(8)", ChainLimit(8)),
        ("incremental only: EveryK(1e9, 1.0)", INCREMENTAL),
    ]


@dataclass
class PolicyRow:
    name: str
    written: list[int]  # bytes written by each save
    chain: list[int]  # restore chain length of each step (deltas replayed)
    bases: int
    disk: tuple[int, int]
    disk_gc: tuple[int, int]
    disk_cgc: tuple[int, int]
    restore: list[float]
    compacted: int | None  # step compacted before the second GC (None: it was a base already)
    seconds: float


def run_policies(args: argparse.Namespace, scratch: str) -> list[PolicyRow]:
    w = Workload(args.policy_rows, args.dim, args.zipf, args.touched, args.seed + 1)
    nbytes = args.policy_rows * args.dim * 4
    n = args.checkpoints
    print(f"\n== policies: {args.policy_rows:,} x {args.dim} float32 = {nbytes / MiB:,.1f} MiB, {n} checkpoints, "
          f"{w.lookups:,} Zipf({args.zipf}) lookups per interval", flush=True)
    t0 = time.perf_counter()
    ids = [None] + [w.ids(i) for i in range(1, n)]
    shares = [len(x) / args.policy_rows for x in ids[1:]]
    union10 = len(torch.unique(torch.cat(ids[1:11]))) / args.policy_rows
    print(f"row ids of {n - 1} intervals in {time.perf_counter() - t0:.1f} s: touched per interval "
          f"{100 * statistics.mean(shares):.2f} % (mean; {100 * min(shares):.2f}-{100 * max(shares):.2f}), "
          f"over 10 intervals {100 * union10:.1f} %", flush=True)
    reserve = Reserve(0)
    target = torch.full((args.policy_rows, args.dim), float("nan"))
    out = []
    for i, (name, policy) in enumerate(policies()):
        t1 = time.perf_counter()
        path = os.path.join(scratch, f"policy-{i}")
        table = w.table()
        ckpt = make_ckpt(path, args, policy)
        written, kinds, digests = [], [], {}
        for s in range(n):
            if s:
                w.update(table, s, ids[s])
            info = ckpt.save(s, {"emb": table, "step": s})
            written.append(info.bytes_written)
            kinds.append(info.kind)
            digests[s] = digest(table)
        del table
        steps = ckpt.steps()
        chain = [ckpt.store.manifest(s).chain_length for s in steps]
        disk = disk_usage(path)
        last = steps[-1]
        reserve.resize(sum(m.bytes_written for m in ckpt.store.chain(last)) + 4 * ckpt_chunk(ckpt))
        evict(path, sync=False)
        timed_restore(ckpt, path, reserve, target, last, digests[last])  # warm-up
        restore = [timed_restore(ckpt, path, reserve, target, last, digests[last]) for _ in range(args.repeat)]
        keep = Retention(keep_last=args.keep_last)
        ckpt.gc(keep, grace_seconds=0)
        disk_gc = disk_usage(path)
        oldest = ckpt.steps()[-args.keep_last]
        ci = ckpt.compact(oldest)
        ckpt.gc(keep, grace_seconds=0)
        disk_cgc = disk_usage(path)
        kept = ckpt.steps()
        if not set(steps[-args.keep_last:]) <= set(kept):
            raise AssertionError(f"{name}: GC dropped a step of the last {args.keep_last}: kept {kept}")
        for s in kept:  # every kept step still restores bit-exact
            timed_restore(ckpt, path, reserve, target, s, digests[s])
        ckpt.close()
        shutil.rmtree(path, ignore_errors=True)
        row = PolicyRow(name, written, chain, kinds.count("base"), disk, disk_gc, disk_cgc, restore,
                        oldest if ci.done else None, time.perf_counter() - t1)
        out.append(row)
        print(f"  {name}: {row.bases} bases, {fmt_mib(sum(written))} MiB written, worst chain {max(chain)}, "
              f"restore of step {last} {statistics.median(restore):.3f} s; {row.seconds:.1f} s", flush=True)
    reserve.resize(0)
    return out


def policies_table(rows: list[PolicyRow], args: argparse.Namespace) -> str:
    nbytes = args.policy_rows * args.dim * 4
    full = sum(rows[0].written)
    k = args.keep_last
    out = [
        f"{args.checkpoints} checkpoints of a {args.policy_rows:,} x {args.dim} float32 table "
        f"({nbytes / MiB:,.1f} MiB), ~{100 * args.touched:g} % of rows touched per interval. "
        f"MiB = 2^20 B. Written: chunk bytes of every save. On disk: sizes of every file of the store "
        f"(files in parentheses). GC: Retention(keep_last={k}), grace 0 s; "
        f"+compact: compact the oldest kept step, then GC again. "
        f"Restore: step {args.checkpoints - 1}, median of {args.repeat} (files evicted, warm memory).",
        "",
        "| policy | bases | worst chain | last chain | MiB written | x full | MiB on disk after run "
        f"| after GC keep_last={k} | after compact + GC | restore last s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r.name} | {r.bases} | {max(r.chain)} | {r.chain[-1]} | {fmt_mib(sum(r.written))} | "
            f"{sum(r.written) / full:.3f} | {fmt_mib(r.disk[0])} ({r.disk[1]:,}) | "
            f"{fmt_mib(r.disk_gc[0])} ({r.disk_gc[1]:,}) | "
            f"{fmt_mib(r.disk_cgc[0])} ({r.disk_cgc[1]:,}){' [a base]' if r.compacted is None else ''} | "
            f"{statistics.median(r.restore):.3f} |"
        )
    return "\n".join(out)


def plot(rows: list[PolicyRow], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5.4), dpi=90)
    styles = ["-", "--", "-.", ":"]
    for i, r in enumerate(rows):
        style = dict(label=r.name, ls=styles[i % 4], lw=2.2 - 0.3 * (i % 4))
        ax1.plot(range(len(r.written)), np.cumsum(r.written) / 2**30, **style)
        ax2.step(range(len(r.chain)), r.chain, where="post", **style)
    nbytes = args.policy_rows * args.dim * 4
    ax1.set_yscale("log")
    ax1.set_xlabel("checkpoint index")
    ax1.set_ylabel("cumulative bytes written (GiB, log scale)")
    ax1.set_title(f"bytes written: {args.policy_rows:,} x {args.dim} fp32 ({nbytes / MiB:.0f} MiB), "
                  f"~{100 * args.touched:g} % rows / interval", fontsize=10)
    ax1.grid(True, which="both", alpha=0.3)
    ax2.set_yscale("symlog", linthresh=1)
    ticks = [t for t in (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if t <= max(max(r.chain) for r in rows) * 1.5]
    ax2.set_yticks(ticks, [str(t) for t in ticks])
    ax2.set_xlabel("checkpoint index")
    ax2.set_ylabel("deltas a restore of the step replays (symlog)")
    ax2.set_title("restore chain length of each step", fontsize=10)
    ax2.grid(True, which="both", alpha=0.3)
    handles, labels = ax1.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out)
    plt.close(fig)
    print(f"\nplot: {args.out} ({os.path.getsize(args.out) / 1024:.0f} KiB)")


# -- main -------------------------------------------------------------------------------------------


def warm_up(scratch: str, dim: int) -> None:
    """Runs every path once on a tiny table (imports, thread pools, numba compilation)."""
    path = os.path.join(scratch, "warm-up")
    t = torch.randn(4096, dim)
    with make_ckpt(path, argparse.Namespace(chunk_mib=1, io_threads=2), INCREMENTAL) as ckpt:
        ckpt.save(0, {"emb": t, "step": 0})
        t[::7] += 1
        ckpt.save(1, {"emb": t, "step": 1})
        ckpt.restore({"emb": torch.empty_like(t), "step": 0}, 1)
        ckpt.compact(1)
        ckpt.gc(Retention(keep_last=1), grace_seconds=0)
    shutil.rmtree(path)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    print(f"deltackpt from {os.path.dirname(deltackpt.__file__)}; torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs; {' '.join(sys.argv)}", flush=True)
    os.makedirs(args.dir, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="deltackpt-chains-", dir=args.dir)
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    try:
        warm_up(scratch, args.dim)
        chains = run_chains(args, scratch) if "chains" in args.parts else None
        policy_rows = run_policies(args, scratch) if "policies" in args.parts else None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    cpu1 = cpu_seconds()
    if policy_rows:
        plot(policy_rows, args)
    wall = time.perf_counter() - t0
    print(f"\nwall time {wall:.0f} s", end="")
    others = others_cpu(cpu0, cpu1)
    if others is not None:
        share = others / (wall * (os.cpu_count() or 1))
        print(f"; other processes used {others:.0f} CPU s ({100 * share:.0f} % of the cores)"
              + ("  WARNING: timings are skewed" if share > 0.05 else ""), end="")
    print("\n")
    if chains:
        print(chains_table(*chains, args) + "\n")
    if policy_rows:
        print(policies_table(policy_rows, args))
    rows, series = figures(chains, policy_rows)
    write_figures(args.json, "bench_chains", args, rows, **series)
    return 0


def figures(chains: tuple[list[ChainRow], dict[str, list[float]]] | None,
            policy_rows: list[PolicyRow] | None) -> tuple[list[dict], dict[str, Any]]:
    """The figures of both parts as rows for ``--json``, and the restore times by chain length."""
    out: list[dict] = []
    series: dict[str, Any] = {}
    if chains:
        rows, refs = chains
        base = rows[0].before
        out.append(figure("read the base's files (evicted)", refs["read"]))
        for r in rows:
            out.append(figure(f"restore after {r.length} deltas", r.before, peer=f"restore after {rows[0].length} deltas",
                              peer_runs=base))
            out.append(figure(f"read the files of a {r.length}-delta chain (evicted)", r.read,
                              peer="read the base's files (evicted)", peer_runs=rows[0].read))
            out.append(figure(f"restore after {r.length} deltas, over reading its files", r.before,
                              peer=f"read the files of a {r.length}-delta chain (evicted)", peer_runs=r.read))
        for r in rows:
            if r.length:
                out.append(figure(f"compacted step of a {r.length}-delta chain, restore", r.after,
                                  peer=f"restore after {rows[0].length} deltas", peer_runs=base))
        series.update(chain_length=[r.length for r in rows],
                      restore_s=[statistics.median(r.before) for r in rows],
                      restore_compacted_s=[statistics.median(r.after) for r in rows],
                      chain_bytes=[r.chain_bytes for r in rows])
    if policy_rows:
        full = sum(policy_rows[0].written)
        for r in policy_rows:
            out.append(figure(f"bytes written, {r.name}", sum(r.written), "B", peer=policy_rows[0].name,
                              peer_runs=full))
    return out, series


if __name__ == "__main__":
    sys.exit(main())
