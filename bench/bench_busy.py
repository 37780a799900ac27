"""Saves on a busy training node: a marked delta quiet, after other processes' unsynced writes and
with every core busy elsewhere; a delta's bytes on disk against its payload; a base's direct I/O.

One run, rounds interleaved so that drift on a shared VM hits every case alike, medians reported:

  quiet       a 1% marked delta save (the tables' rows and their optimizer state, marked with
              ``Checkpointer.mark``) on an otherwise idle file system
  dirty       the same right after another process wrote ``--dirty-gib`` GiB to a file on the same
              file system without syncing it (the file is deleted after the save)
  busy        the same while ``os.cpu_count()`` other processes spin on every core
  CPU floor   a copy of ``FLOOR_MIB`` MiB on one thread (CPU work and nothing else), quiet and
              with every core busy, three times after each of those saves: how much slower any
              CPU work runs beside the spinners, the floor of the busy delta's ratio (only the
              save's waits for the disk can bring its ratio below it)
  disk floor  a write of the delta's share of the state's bytes to a fresh file in a fresh
              folder, then fsync of both (what ``torch.save`` + fsync of the changed rows
              costs), quiet and right after the same unsynced writes again: how much slower any
              durable write is then, the floor of the dirty delta's ratio
  padding     the delta step's bytes on disk (every file of its attempt folder) / its payload
              (changed rows x row bytes, plus their ids as stored, lz4-coded; counted at 8 B an id,
              the coding hid the padding)
  base        a base save's time and the bytes it wrote with O_DIRECT (counted at the storage),
              against the disk's O_DIRECT bandwidth measured in the same run (a fresh file of the
              base's size written from one aligned buffer in 32 MiB writes, then fsync): first
              staged into buffers no save has touched (a process's first base: the staging
              reserve is released before it, see ``deltackpt.release_staging_memory``), then by
              another checkpointer into the buffers the first one left (a job's later bases)

The state is DLRM-like: ``--tables`` fp32 tables of ``--rows`` x ``--dim`` with an Adagrad-style
accumulator each (row-sparse, marked) and a dense MLP of ``--dense-mib`` MiB (hashed at every
save; ``--delta`` of it changes, in one block). Defaults: 8 x 1,000,000 x 32, 2.19 GB in all.

Every delta is restored and compared bit for bit with the state it saved at the end of the run.
The machine may be shared with other jobs: the bench prints the other processes' CPU time during
the rounds. Scratch files go to a fresh folder under ``--dir``, removed at the end.

Usage: ``python bench/bench_busy.py [--repeat 3] [--tables 8 --rows 1000000 --dim 32]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from common import cpu_seconds, direct_bandwidth, figure, json_option, others_cpu, tree_bytes, write_figures
from deltackpt import Checkpointer, release_staging_memory
from deltackpt.policy import EveryK

MiB = 1 << 20
GiB = 1 << 30

DIRTY = """
import os, sys
import numpy as np
block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
with open(sys.argv[1], "wb") as f:
    for _ in range(int(sys.argv[2])):
        f.write(block)
"""

SPIN = "while True: pass"
FLOOR_MIB = 64


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tables", type=int, default=8, help="embedding tables (default %(default)s)")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows per table (default %(default)s)")
    p.add_argument("--dim", type=int, default=32, help="fp32 values per row (default %(default)s)")
    p.add_argument("--dense-mib", type=int, default=140, help="dense MLP size (default %(default)s)")
    p.add_argument("--delta", type=float, default=0.01, help="share of rows a delta changes")
    p.add_argument("--dirty-gib", type=float, default=1.5, help="other process's unsynced writes")
    p.add_argument("--repeat", type=int, default=3, help="rounds (default %(default)s)")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the scratch folder goes")
    json_option(p)
    return p.parse_args(argv)


def make_state(args: argparse.Namespace) -> dict:
    gen = torch.Generator().manual_seed(0)
    tables = {f"t{i}": torch.randn(args.rows, args.dim, generator=gen) * 0.01 for i in range(args.tables)}
    accum = {f"t{i}": torch.rand(args.rows, args.dim, generator=gen) for i in range(args.tables)}
    dense = torch.randn(args.dense_mib * MiB // 4 // 1024, 1024, generator=gen)
    return {"model": {"emb": tables, "mlp": dense}, "optim": {"accum": accum}, "step": 0}


def touch(ckpt: Checkpointer, state: dict, args: argparse.Namespace, gen: torch.Generator) -> int:
    """One training step's worth of changes: ``--delta`` of every table's rows, marked."""
    n = int(args.rows * args.delta)
    for name, table in state["model"]["emb"].items():
        ids = torch.randint(0, args.rows, (n,), generator=gen).unique()
        table[ids] += 1e-3
        state["optim"]["accum"][name][ids] += 1e-2
        ckpt.mark(f"model/emb/{name}", ids)
        ckpt.mark(f"optim/accum/{name}", ids)
    mlp = state["model"]["mlp"].view(-1)
    mlp[: int(mlp.numel() * args.delta)] += 1e-4  # the same share of the dense weights, in a block
    state["step"] += 1
    return state["step"]


def payload(ckpt: Checkpointer, step: int) -> int:
    m = ckpt.store.manifest(step)
    total = 0
    for rec in m.tensors.values():
        itemsize = torch.empty((), dtype=getattr(torch, rec.dtype)).element_size()
        for part in rec.parts:
            if rec.encoding.name == "rows":  # the rows, and their ids as stored (coded)
                total += part.changed * int(torch.tensor(part.shape[1:]).prod()) * itemsize
                total += sum(c[0] for name, c in part.chunks.items() if name.startswith("ids/"))
            else:
                ce = part.chunk_shape[0]
                n = int(torch.tensor(part.shape).prod()) if part.shape else 1
                total += sum(min(ce, n - int(c[2:]) * ce) * itemsize for c in part.chunks)
    return total


class DirectCount:
    """Counts the bytes a LocalStorage writes with O_DIRECT (through its DirectWriter)."""

    def __init__(self, storage):
        self.bytes = 0
        writer = storage._writer
        real = writer._write_direct

        def counted(fd, data):
            n = real(fd, data)
            self.bytes += n
            return n

        writer._write_direct = counted


def cpu_work(src: np.ndarray, dst: np.ndarray) -> float:
    """Seconds of the CPU floor's job: the median of three copies of ``src`` into ``dst``."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def disk_work(scratch: str, data: np.ndarray) -> float:
    """Seconds of the disk floor's job: ``data`` written to a fresh file in a fresh folder, both
    fsync-ed (the folder and file are removed after)."""
    folder = tempfile.mkdtemp(dir=scratch)
    t0 = time.perf_counter()
    fd = os.open(os.path.join(folder, "f"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    seconds = time.perf_counter() - t0
    shutil.rmtree(folder)
    return seconds


def timed_save(ckpt: Checkpointer, state: dict, step: int) -> float:
    t0 = time.perf_counter()
    info = ckpt.save(step, state)
    seconds = time.perf_counter() - t0
    if info.kind != "delta":
        raise SystemExit(f"step {step} was saved as a {info.kind}, not a delta")
    return seconds


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    scratch = tempfile.mkdtemp(prefix="bench_busy.", dir=args.dir)
    try:
        return run(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def warm_up(scratch: str) -> None:
    """Compiles and loads what the first save would (numba kernels, thread pools) on a tiny store."""
    with Checkpointer(os.path.join(scratch, "warm")) as ckpt:
        t = torch.randn(1000, 8)
        ckpt.save(0, {"t": t, "v": torch.randn(5000)})
        t[::10] += 1
        ckpt.mark("t", torch.arange(0, 1000, 10))
        ckpt.save(1, {"t": t, "v": torch.randn(5000)})
    shutil.rmtree(os.path.join(scratch, "warm"))


def run(args: argparse.Namespace, scratch: str) -> int:
    warm_up(scratch)
    state = make_state(args)
    state_bytes = sum(t.numel() * t.element_size() for t in [
        *state["model"]["emb"].values(), *state["optim"]["accum"].values(), state["model"]["mlp"]])
    gen = torch.Generator().manual_seed(1)
    ckpt = Checkpointer(os.path.join(scratch, "store"), policy=EveryK(10_000))
    count = DirectCount(ckpt.store.storage)
    times: dict[str, list[float]] = {"quiet": [], "dirty": [], "busy": []}
    floor: dict[str, list[float]] = {"quiet": [], "busy": []}
    disk_floor: dict[str, list[float]] = {"quiet": [], "dirty": []}
    src = np.random.default_rng(0).integers(0, 256, FLOOR_MIB * MiB, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touched before it is timed
    written = np.random.default_rng(1).integers(0, 256, int(state_bytes * args.delta), dtype=np.uint8)
    base_s, cold_s, disk = [], [], []
    saved: dict[int, dict] = {}
    ratio = []
    cpu0 = cpu_seconds()
    for r in range(args.repeat):
        # A base (a fresh store each round) and the disk's O_DIRECT bandwidth beside it.
        if r:
            ckpt.close()
            shutil.rmtree(os.path.join(scratch, "store"))
            ckpt = Checkpointer(os.path.join(scratch, "store"), policy=EveryK(10_000))
            count = DirectCount(ckpt.store.storage)
        disk.append(direct_bandwidth(scratch, state_bytes))
        release_staging_memory()
        cold_path = os.path.join(scratch, "cold")
        with Checkpointer(cold_path, policy=EveryK(10_000)) as first:
            cold_count = DirectCount(first.store.storage)
            t0 = time.perf_counter()
            first.save(state["step"], state)
            cold_s.append(time.perf_counter() - t0)
        cold_direct = cold_count.bytes
        shutil.rmtree(cold_path)
        t0 = time.perf_counter()
        ckpt.save(state["step"], state)
        base_s.append(time.perf_counter() - t0)
        direct = count.bytes
        timed_save(ckpt, state, touch(ckpt, state, args, gen))  # marks start with this one
        for case in times:
            step = touch(ckpt, state, args, gen)
            if case == "dirty":
                noise = os.path.join(scratch, "other.bin")
                dirty = [sys.executable, "-c", DIRTY, noise, str(int(args.dirty_gib * 16))]
                subprocess.run(dirty, check=True)
                times[case].append(timed_save(ckpt, state, step))
                os.unlink(noise)
                subprocess.run(dirty, check=True)  # the same writes again, for the disk floor
                disk_floor[case].append(disk_work(scratch, written))
                os.unlink(noise)
            elif case == "busy":
                spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(os.cpu_count() or 2)]
                try:
                    time.sleep(0.5)
                    times[case].append(timed_save(ckpt, state, step))
                    floor[case].append(cpu_work(src, dst))
                finally:
                    for p in spinners:
                        p.kill()
                        p.wait()
            else:
                times[case].append(timed_save(ckpt, state, step))
                floor[case].append(cpu_work(src, dst))
                disk_floor[case].append(disk_work(scratch, written))
            m = ckpt.store.manifest(step)
            ratio.append(tree_bytes(os.path.join(scratch, "store", "steps", m.attempt)) / payload(ckpt, step))
            if r == args.repeat - 1:
                saved[step] = {k: v.clone() for k, v in state["model"]["emb"].items()}
    others = others_cpu(cpu0, cpu_seconds())
    for step, emb in saved.items():
        got = ckpt.load(step)["model"]["emb"]
        for k, v in emb.items():
            if not torch.equal(got[k], v):
                raise SystemExit(f"step {step}: {k} restored differently")
    ckpt.close()

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"state {state_bytes / 1e9:.2f} GB, {args.tables} tables x {args.rows} x {args.dim} fp32 "
          f"+ accumulators + {args.dense_mib} MiB dense; {args.delta:.0%} of rows per delta; "
          f"{args.repeat} rounds; {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
    if others is not None:
        print(f"other processes' user CPU time during the rounds: {others:.1f} s (the machine is shared)")
    print("| measure | median | runs | ratio | goal |")
    print("| --- | --- | --- | --- | --- |")
    runs = lambda v, digits=3: ", ".join(f"{x:.{digits}f}" for x in v)  # noqa: E731
    print(f"| delta, quiet | {med['quiet']:.3f} s | {runs(times['quiet'])} | 1.00 | |")
    print(f"| delta, after {args.dirty_gib} GiB of another process's unsynced writes | {med['dirty']:.3f} s "
          f"| {runs(times['dirty'])} | {med['dirty'] / med['quiet']:.2f}x quiet | <= 1.5x |")
    print(f"| delta, every core busy in other processes | {med['busy']:.3f} s | {runs(times['busy'])} "
          f"| {med['busy'] / med['quiet']:.2f}x quiet | <= 2x |")
    dq, dd = statistics.median(disk_floor["quiet"]), statistics.median(disk_floor["dirty"])
    print(f"| disk floor: {written.nbytes / 1e6:.1f} MB written and fsync-ed, after the unsynced writes "
          f"| {dd:.4f} s | {runs(disk_floor['dirty'], 4)} | {dd / dq:.2f}x quiet ({dq:.4f} s: "
          f"{runs(disk_floor['quiet'], 4)}) | the dirty delta's floor |")
    fq, fb = statistics.median(floor["quiet"]), statistics.median(floor["busy"])
    print(f"| CPU floor: a {FLOOR_MIB} MiB copy on one thread, every core busy | {fb:.4f} s "
          f"| {runs(floor['busy'], 4)} | {fb / fq:.2f}x quiet ({fq:.4f} s: {runs(floor['quiet'], 4)}) "
          "| the busy delta's floor |")
    print(f"| delta bytes on disk / payload | {statistics.median(ratio):.4f} | "
          f"{runs(ratio, 4)} | | <= 1.01 |")
    bw = statistics.median(disk)
    for what, secs, wrote in (("first base, untouched staging", cold_s, cold_direct),
                              ("base, touched staging", base_s, direct)):
        b = statistics.median(secs)
        print(f"| {what} ({wrote / 1e9:.2f} of {state_bytes / 1e9:.2f} GB written direct) | {b:.3f} s "
              f"| {runs(secs)} | {state_bytes / b / 1e9:.2f} GB/s = {state_bytes / b / 1e9 / bw:.0%} "
              f"of the disk's O_DIRECT {bw:.2f} GB/s ({', '.join(f'{x:.2f}' for x in disk)}) | >= 85% |")
    write_figures(args.json, "bench_busy", args, [
        figure("1% delta, quiet", times["quiet"]),
        figure(f"1% delta, after {args.dirty_gib} GiB of unsynced writes", times["dirty"], peer="quiet",
               peer_runs=times["quiet"]),
        figure("1% delta, every core busy", times["busy"], peer="quiet", peer_runs=times["quiet"]),
        figure(f"CPU floor: {FLOOR_MIB} MiB copy on one thread, every core busy", floor["busy"], peer="quiet",
               peer_runs=floor["quiet"]),
        figure(f"disk floor: write + fsync of {written.nbytes / 1e6:.1f} MB, after {args.dirty_gib} GiB of "
               "unsynced writes", disk_floor["dirty"], peer="quiet", peer_runs=disk_floor["quiet"]),
        figure("delta bytes on disk / payload", ratio, "x"),
        figure("base save", [state_bytes / x / 1e9 for x in base_s], "GB/s", peer="disk O_DIRECT write",
               peer_runs=disk),
        figure("first base save, untouched staging", [state_bytes / x / 1e9 for x in cold_s], "GB/s",
               peer="disk O_DIRECT write", peer_runs=disk),
    ], state_bytes=state_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
