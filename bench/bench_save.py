"""Save and load cost of deltackpt against the disk and against torch.save/torch.load.

One run measures, on one table of ``--rows`` x ``--dim`` float32 (default 4,194,304 x 128 = 2 GiB),
every operation below ``--repeat`` times, interleaved round by round so that drift on this noisy
VM hits all of them alike, and reports medians:

  disk        write a fresh file of the state's size in 64 MiB pieces + fsync; read it back
              after posix_fadvise(DONTNEED) on that file, into a pre-faulted buffer
  torch       torch.save(state) + fsync of the file and its folder; torch.load of it (evicted)
  dcp         torch.distributed.checkpoint.save(state) in this one process (no process group;
              its writer fsyncs its files)
  deltackpt   base save (the first save of a fresh store, into staging buffers no save has
              touched: the process's staging reserve is released before it, see
              ``deltackpt.release_staging_memory``; bench_busy measures both), a delta save after 1% of the rows
              (random) changed by a small perturbation (+1e-4..2e-4 on N(0, 0.01) values), found
              by the row hashes alone (no marks), a delta save with nothing changed; the change
              scan alone (kernels.hash_rows, XXH64 of every row: a delta save's floor);
              Checkpointer.load of the base step and of the delta step and Checkpointer.restore
              of the delta step into a pre-allocated state (files evicted before each)

Every loaded, read or restored tensor is compared bit for bit (integer views) with what was
saved, and every save's kind and changed-row count are checked, so the bench doubles as an
end-to-end correctness check; any mismatch aborts with an error.

Memory on this VM (see the baselines' "cold guest memory" notes): idle guest memory goes back to
the host within seconds and touching it again runs at ~0.4 GB/s instead of ~14 GB/s. The bench
therefore holds touched "reserve" memory of 2.2x the state's size between operations and, right
before each timed operation, frees the part of it that the operation will allocate (page cache of
the files it writes or reads, result tensors: 1.1x the state for saves, writes, reads and restore,
2.1x for torch.load and Checkpointer.load, 0.2x for delta saves and hashing), so that memory is
warm; after the operation its files are evicted from the page cache and the reserve is touched
again. Files are evicted with posix_fadvise(DONTNEED) on the bench's own scratch files only. Peak
RSS is about 4.5x the state (the state, the restore target, and the reserve or one loaded copy
plus what is left of the reserve; measured 2.5 GiB for a 512 MiB state), plus page cache.

The machine may be shared: the bench prints how much user-space CPU time other processes used
during the rounds, since that slows every operation (a halved hash rate is the usual sign).

Scratch files live in a fresh temporary folder under ``--dir`` and are removed at the end, also
on an error.

Printed last, after the goal checks, a markdown table: op; median seconds; state GB/s (state
bytes / median seconds, the same numerator on every row so the column compares like with like);
ratio of the median to torch.save's median (saves, writes, hashing) or torch.load's (loads,
reads); bytes the op wrote (files created, including metadata and commit records); every round.

Example:
    python bench/bench_save.py                      # 2 GiB state, 3 rounds
    python bench/bench_save.py --rows 1048576 --repeat 5 --dir /var/tmp
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import deltackpt
from deltackpt import kernels

from common import (  # bench/common.py
    Reserve, cpu_seconds, evict, figure, json_option, others_cpu, tree_bytes, write_figures,
)

MiB = 1 << 20
PIECE = 64 * MiB
DELTA_FRACTION = 0.01
PERTURBATION = 1e-4  # times U[1, 2), added to the changed rows; far above an ulp of their values


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Prints one line per round, then the goal checks and, last, a markdown table of medians.",
    )
    p.add_argument("--rows", type=int, default=4_194_304, help="rows of the table (default %(default)s)")
    p.add_argument("--dim", type=int, default=128, help="float32 values per row (default %(default)s)")
    p.add_argument("--repeat", type=int, default=3,
                   help="timed rounds; medians are reported (default %(default)s)")
    p.add_argument("--dir", default="/tmp", help="folder for the scratch folder (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    p.add_argument("--chunk-mib", type=int, default=32,
                   help="Checkpointer chunk_bytes in MiB (default %(default)s)")
    p.add_argument("--io-threads", type=int, default=4, help="Checkpointer io_threads (default %(default)s)")
    json_option(p)
    args = p.parse_args(argv)
    if args.rows < 100 or args.dim < 1 or args.repeat < 1:
        p.error("need --rows >= 100, --dim >= 1, --repeat >= 1")
    return args


# -- memory and page cache -------------------------------------------------------------------------


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- checks -----------------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of a float tensor, so that comparisons are bitwise (NaN, -0.0)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def check_equal(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(bits(got), bits(want)):
        raise AssertionError(f"{what}: not bit-identical to the saved tensor")


def check_base(what: str, got: torch.Tensor, now: torch.Tensor, ids: torch.Tensor,
               before: torch.Tensor) -> None:
    """``got`` must equal the state as it was at the base: ``now`` with rows ``ids`` = ``before``.

    Overwrites rows ``ids`` of ``got`` (a loaded copy, discarded afterwards) to compare the rest.
    """
    check_equal(what + " (changed rows, old values)", got[ids], before)
    got[ids] = now[ids]
    check_equal(what + " (other rows)", got, now)


# -- one round --------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, scratch: str):
        self.args = args
        self.scratch = scratch
        self.times: dict[str, list[float]] = {}
        self.written: dict[str, int] = {}
        self.extra: dict[str, Any] = {}
        g = torch.Generator().manual_seed(args.seed)
        t0 = time.perf_counter()
        table = torch.empty(args.rows, args.dim, dtype=torch.float32)
        piece = max(1, (64 * MiB) // (args.dim * 4))
        for lo in range(0, args.rows, piece):  # in pieces: one normal_ over 2 GiB is much slower
            table[lo:lo + piece].normal_(0.0, 0.01, generator=g)
        self.table = table
        self.state = {"emb": table}
        self.nbytes = table.numel() * table.element_size()
        # The restore target and read buffer: allocated and touched once, reused by every round.
        self.target = torch.full_like(table, float("nan"))
        self.gen = g
        self.reserve = Reserve(int(2.2 * self.nbytes), piece=128 * MiB)
        self.n_changed = max(1, round(DELTA_FRACTION * args.rows))
        print(f"deltackpt from {os.path.dirname(deltackpt.__file__)}; torch {torch.__version__}, "
              f"{os.cpu_count()} CPUs")
        print(f"state: {args.rows} x {args.dim} float32 = {self.nbytes / 2**30:.3f} GiB "
              f"(made in {time.perf_counter() - t0:.1f} s); scratch folder {scratch}", flush=True)

    def timed(self, op: str, fn: Callable[[], Any], written: Callable[[Any], int] | None = None,
              *, copies: float = 1.0) -> Any:
        """Times ``fn()`` after freeing the reserve memory it needs; ``copies``: the fresh memory it
        touches (page cache, results) in state sizes. Call :meth:`settle` after it."""
        self.reserve.free(int((copies + 0.1) * self.nbytes))
        t0 = time.perf_counter()
        result = fn()
        dt = time.perf_counter() - t0
        self.times.setdefault(op, []).append(dt)
        if written is not None:
            self.written[op] = written(result)
        return result

    def settle(self, *paths: str) -> None:
        """Evicts ``paths`` from the page cache and touches the reserve again."""
        for p in paths:
            if os.path.exists(p):
                evict(p)
        self.reserve.hold()

    # -- disk ---------------------------------------------------------------------------------------

    def disk(self, r: int) -> None:
        path = os.path.join(self.scratch, f"disk-{r}.bin")
        src = memoryview(self.table.reshape(-1).view(torch.uint8).numpy())

        def write() -> int:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for off in range(0, len(src), PIECE):
                    part = src[off:off + PIECE]
                    while part:
                        part = part[os.write(fd, part):]
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_dir(self.scratch)
            return os.path.getsize(path)

        self.timed("disk write + fsync (64 MiB pieces)", write, lambda n: n)
        self.settle(path)

        dst = memoryview(self.target.reshape(-1).view(torch.uint8).numpy())

        def read() -> int:
            done = 0
            with open(path, "rb", buffering=0) as f:
                while done < len(dst):
                    n = f.readinto(dst[done:done + PIECE])
                    if not n:
                        break
                    done += n
            return done

        n = self.timed("disk read (evicted, pre-faulted buffer)", read)
        if n != self.nbytes:
            raise AssertionError(f"disk read: {n} bytes, wrote {self.nbytes}")
        check_equal("disk read", self.target, self.table)
        os.unlink(path)
        self.settle()

    # -- torch.save / torch.load ------------------------------------------------------------------

    def torch_io(self, r: int) -> None:
        path = os.path.join(self.scratch, f"torch-{r}.pt")

        def save() -> int:
            with open(path, "xb") as f:
                torch.save(self.state, f)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(self.scratch)
            return os.path.getsize(path)

        self.timed("torch.save + fsync", save, lambda n: n)
        self.settle(path)
        loaded = self.timed("torch.load (evicted)", lambda: torch.load(path, weights_only=True),
                            copies=2)
        check_equal("torch.load", loaded["emb"], self.table)
        del loaded
        os.unlink(path)
        self.settle()

    def dcp(self, r: int) -> None:
        import torch.distributed.checkpoint as dcp

        path = os.path.join(self.scratch, f"dcp-{r}")
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            self.timed("DCP save (1 process)", lambda: dcp.save(self.state, checkpoint_id=path),
                       lambda _: tree_bytes(path))
            self.target.fill_(float("nan"))
            self.settle(path)
            self.timed("DCP load (1 process, in place, evicted)",
                       lambda: dcp.load({"emb": self.target}, checkpoint_id=path))
        check_equal("DCP load", self.target, self.table)
        shutil.rmtree(path)
        self.settle()

    # -- deltackpt ----------------------------------------------------------------------------------

    def deltackpt(self, r: int) -> None:
        a = self.args
        store = os.path.join(self.scratch, f"store-{r}")
        deltackpt.release_staging_memory()  # the buffers of the round before: the first base's case
        ckpt = deltackpt.Checkpointer(store, base_every=1_000_000, chunk_bytes=a.chunk_mib * MiB,
                                      io_threads=a.io_threads)
        try:
            size0 = tree_bytes(store)

            def saved(info: deltackpt.SaveInfo) -> int:
                nonlocal size0
                size1 = tree_bytes(store)
                n, size0 = size1 - size0, size1
                return n

            base = self.timed("deltackpt base save", lambda: ckpt.save(0, self.state), saved)
            if base.kind != "base":
                raise AssertionError(f"the first save of a fresh store was a {base.kind}")
            self.settle(store)

            # Change 1% of the rows, at random, by a small perturbation (untimed); keep their old
            # values to check the base step later.
            ids = torch.randperm(a.rows, generator=self.gen)[: self.n_changed].sort().values
            before = self.table[ids]
            bump = PERTURBATION * (1 + torch.rand(self.n_changed, a.dim, generator=self.gen))
            self.table.index_add_(0, ids, bump)
            self.settle()

            delta = self.timed("deltackpt 1% delta save", lambda: ckpt.save(1, self.state), saved,
                               copies=0.1)
            if delta.kind != "delta" or delta.rows_changed != self.n_changed:
                raise AssertionError(f"1% delta save: {delta.kind} with {delta.rows_changed} rows "
                                     f"changed, expected a delta of {self.n_changed}")
            self.extra.setdefault("delta_info_bytes", []).append(delta.bytes_written)
            self.settle(store)

            same = self.timed("deltackpt no-change delta save", lambda: ckpt.save(2, self.state), saved,
                              copies=0.1)
            if same.kind != "delta" or same.rows_changed != 0:
                raise AssertionError(f"no-change save: {same.kind} with {same.rows_changed} rows")
            self.settle(store)

            # The change scan alone, in the same conditions as the delta saves just timed.
            self.timed("hash_rows alone (change scan)", lambda: kernels.hash_rows(self.table), copies=0.1)
            self.settle()

            got = self.timed("deltackpt load base step", lambda: ckpt.load(0), copies=2)
            check_base("load of the base step", got["emb"], self.table, ids, before)
            del got
            self.settle(store)

            got = self.timed("deltackpt load 1% delta step", lambda: ckpt.load(1), copies=2)
            check_equal("load of the delta step", got["emb"], self.table)
            del got
            self.settle(store)

            self.target.fill_(float("nan"))
            into = {"emb": self.target}
            self.settle(store)
            step_back = self.timed("deltackpt restore 1% delta step (in place)",
                                   lambda: ckpt.restore(into, 1))
            if step_back != 1 or into["emb"] is not self.target:
                raise AssertionError("restore did not fill the pre-allocated tensor in place")
            check_equal("restore of the delta step", self.target, self.table)
        finally:
            ckpt.close()
            shutil.rmtree(store, ignore_errors=True)
        self.settle()

    def round(self, r: int) -> None:
        t0, c0 = time.perf_counter(), cpu_seconds()
        self.disk(r)
        self.torch_io(r)
        self.dcp(r)
        self.deltackpt(r)
        wall, other = time.perf_counter() - t0, others_cpu(c0, cpu_seconds())
        self.extra["wall"] = self.extra.get("wall", 0.0) + wall
        if other is not None:
            self.extra["other_cpu"] = self.extra.get("other_cpu", 0.0) + other
        line = ", ".join(f"{op.split(' (')[0]} {ts[-1]:.3f}" for op, ts in self.times.items())
        busy = "" if other is None else f", other processes {other:.1f} CPU-s"
        print(f"round {r + 1}/{self.args.repeat} ({wall:.0f} s{busy}): {line}", flush=True)


# -- report -----------------------------------------------------------------------------------------


def report(b: Bench) -> None:
    med = {op: statistics.median(ts) for op, ts in b.times.items()}
    save_ref, load_ref = med["torch.save + fsync"], med["torch.load (evicted)"]
    print()
    base, delta = med["deltackpt base save"], med["deltackpt 1% delta save"]
    paired = [bs / ts for bs, ts in zip(b.times["deltackpt base save"], b.times["torch.save + fsync"])]
    paired_d = [ds / ts for ds, ts in zip(b.times["deltackpt 1% delta save"], b.times["torch.save + fsync"])]
    row_bytes = b.args.dim * 4
    target = b.n_changed * (row_bytes + 8)
    got = b.written["deltackpt 1% delta save"]
    info = b.extra["delta_info_bytes"][-1]
    dcp_s, disk_s = med["DCP save (1 process)"], med["disk write + fsync (64 MiB pieces)"]
    paired_dcp = [bs / ds for bs, ds in zip(b.times["deltackpt base save"], b.times["DCP save (1 process)"])]
    paired_disk = [ds / bs for bs, ds in zip(b.times["deltackpt base save"],
                                             b.times["disk write + fsync (64 MiB pieces)"])]
    goals = [
        ("base save no slower than torch.save", base <= save_ref,
         f"{base:.3f} s vs {save_ref:.3f} s = {base / save_ref:.2f}x "
         f"(per round: {', '.join(f'{x:.2f}' for x in paired)})"),
        ("base save at most 0.8x DCP save", base <= 0.8 * dcp_s,
         f"{base:.3f} s vs {dcp_s:.3f} s = {base / dcp_s:.2f}x "
         f"(per round: {', '.join(f'{x:.2f}' for x in paired_dcp)})"),
        ("base save at 80% of the disk's write bandwidth or more", disk_s / base >= 0.8,
         f"{b.nbytes / base / 1e9:.2f} GB/s vs the disk write's {b.nbytes / disk_s / 1e9:.2f} GB/s = "
         f"{disk_s / base:.0%} (per round: {', '.join(f'{x:.0%}' for x in paired_disk)})"),
        ("1% delta save at most 1/5 of torch.save", delta <= save_ref / 5,
         f"{delta:.3f} s vs {save_ref / 5:.3f} s allowed = {delta / save_ref:.3f}x torch.save "
         f"(per round: {', '.join(f'{x:.3f}' for x in paired_d)})"),
    ]
    for name, ok, detail in goals:
        print(f"{'PASS' if ok else 'MISS'}: {name}: {detail}")
    other, wall, cores = b.extra.get("other_cpu"), b.extra["wall"], os.cpu_count() or 1
    if other is not None:
        share = other / (wall * cores)
        print(f"{'WARNING: ' if share > 0.05 else ''}other processes used {other:.1f} user CPU-s during "
              f"the {wall:.0f} s of rounds ({share:.0%} of {cores} cores); timings are "
              f"{'skewed by that load' if share > 0.05 else 'not much affected'}")
    print(f"delta bytes: {got:,} B on disk ({info:,} B of chunks per SaveInfo) vs "
          f"1% x rows x (row bytes + 8) = {b.n_changed} x {row_bytes + 8} = {target:,} B "
          f"-> {got / target:.3f}x")
    print()
    print(f"Medians of {b.args.repeat} rounds; state {b.nbytes:,} B "
          f"({b.args.rows} x {b.args.dim} float32); ratio = median / torch.save's median for "
          f"saves, writes and hashing, / torch.load's for loads and reads.")
    print()
    print("| op | s (median) | state GB/s | ratio | bytes written | runs (s) |")
    print("|---|---|---|---|---|---|")
    for op, s in med.items():
        is_save = any(w in op for w in ("save", "write", "hash"))
        ratio = s / (save_ref if is_save else load_ref)
        w = b.written.get(op)
        runs = ", ".join(f"{t:.3f}" for t in b.times[op])
        print(f"| {op} | {s:.3f} | {b.nbytes / s / 1e9:.2f} | {ratio:.3f} | "
              f"{'' if w is None else f'{w:,}'} | {runs} |")
    rows = []
    for op, ts in b.times.items():
        is_save = any(w in op for w in ("save", "write", "hash"))
        peer = "torch.save + fsync" if is_save else "torch.load (evicted)"
        rows.append(figure(op, ts, peer=None if op == peer else peer, peer_runs=None if op == peer else b.times[peer]))
    for op, peer in (("deltackpt base save", "DCP save (1 process)"),
                     ("deltackpt restore 1% delta step (in place)", "DCP load (1 process, in place, evicted)")):
        rows.append(figure(f"{op} vs DCP", b.times[op], peer=peer, peer_runs=b.times[peer]))
    rows.append(figure("1% delta bytes on disk", got, "B", peer="1% x rows x (row bytes + 8)", peer_runs=target))
    write_figures(b.args.json, "bench_save", b.args, rows, state_bytes=b.nbytes,
                  disk_write_s=med["disk write + fsync (64 MiB pieces)"], base_save_s=base,
                  torch_save_s=save_ref)


def warm_up(scratch: str, dim: int) -> None:
    """Runs every deltackpt path once on a tiny table, untimed: numba compiles its kernels on their
    first call, and lazily imported modules load."""
    table = torch.randn(1000, dim)
    with deltackpt.Checkpointer(os.path.join(scratch, "warm-up"), base_every=1000) as ckpt:
        ckpt.save(0, {"emb": table})
        table[::97] += 1
        ckpt.save(1, {"emb": table})
        ckpt.save(2, {"emb": table})
        check_equal("warm-up load", ckpt.load(1)["emb"], table)
        ckpt.restore({"emb": torch.zeros_like(table)}, 1)
    shutil.rmtree(os.path.join(scratch, "warm-up"))


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="deltackpt-bench-", dir=args.dir)
    try:
        warm_up(scratch, args.dim)
        b = Bench(args, scratch)
        for r in range(args.repeat):
            b.round(r)
        report(b)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
