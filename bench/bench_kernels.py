"""CPU cost of the reference kernels: hash throughput, mark_rows rate and hash collisions.

Hash throughput of ``hash_rows`` and ``hash_chunks`` is measured beside a memcpy of the same
buffer (``np.copyto`` into a pre-faulted array) and the ``xxhash`` library's XXH64 and XXH3 on
it, all in one run, so the figures are comparable on this machine. Every measurement is warmed
up first (numba compiles on the first call), the rounds interleave the measurements so that drift
hits all of them alike, and medians are reported. The collision count hashes many random rows and
counts repeated hashes, which for a 64-bit hash should be zero.

Example:
    python bench/bench_kernels.py --size-mib 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numba
import numpy as np
import torch
import xxhash

from deltackpt.kernels import reference

from common import figure, json_option, write_figures  # bench/common.py


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=512, help="hashed/copied buffer size (MiB)")
    p.add_argument("--row-bytes", type=int, default=512, help="row size for hash_rows (bytes)")
    p.add_argument(
        "--chunk-bytes", type=int, default=1 << 20, help="chunk size for hash_chunks (bytes)"
    )
    p.add_argument("--repeats", type=int, default=7, help="timed rounds; medians are reported")
    p.add_argument("--mask-rows", type=int, default=10_000_000, help="mask length for mark_rows")
    p.add_argument("--mark-ids", type=int, default=1_000_000, help="ids marked per mark_rows call")
    p.add_argument("--collision-rows", type=int, default=10_000_000, help="random rows hashed")
    p.add_argument("--collision-cols", type=int, default=16, help="fp32 values per random row")
    p.add_argument(
        "--piece-rows",
        type=int,
        default=1_000_000,
        help="rows generated and hashed at a time, to bound memory",
    )
    p.add_argument("--seed", type=int, default=0)
    json_option(p)
    return p.parse_args()


def _with_threads(n: int, fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        numba.set_num_threads(n)
        return fn()

    return run


def _rounds(cases: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Wall seconds of every round per case, rounds interleaved, after one warm-up call each."""
    for fn in cases.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def _throughput(args: argparse.Namespace, out: list[dict]) -> list[tuple[str, str, str]]:
    nbytes = args.size_mib << 20
    nbytes -= nbytes % args.row_bytes
    # Filling both buffers faults their pages in: this VM hands idle memory back to the host, and
    # a first touch inside a timed call would be counted as hashing or copying time.
    src = np.random.default_rng(args.seed).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.ones_like(src)
    rows = torch.from_numpy(src).view(-1, args.row_bytes)
    flat = torch.from_numpy(src)
    all_threads = numba.config.NUMBA_NUM_THREADS

    cases: dict[str, Callable[[], object]] = {
        "memcpy (np.copyto), 1 thread": lambda: np.copyto(dst, src),
        "xxhash.xxh64, 1 thread": lambda: xxhash.xxh64_intdigest(src),
        "xxhash.xxh3_64, 1 thread": lambda: xxhash.xxh3_64_intdigest(src),
    }
    for n in sorted({1, all_threads}):
        threads = "1 thread" if n == 1 else f"{n} threads"
        cases[f"hash_rows {args.row_bytes} B rows, {threads}"] = _with_threads(
            n, lambda: reference.hash_rows(rows)
        )
        cases[f"hash_chunks {args.chunk_bytes} B chunks, {threads}"] = _with_threads(
            n, lambda: reference.hash_chunks(flat, args.chunk_bytes)
        )
    times = _rounds(cases, args.repeats)
    numba.set_num_threads(all_threads)
    copy = [nbytes / t / 1e9 for t in times["memcpy (np.copyto), 1 thread"]]
    for name, ts in times.items():
        mine = name.startswith("memcpy")
        out.append(figure(name, [nbytes / t / 1e9 for t in ts], "GB/s", peer=None if mine else "memcpy, 1 thread",
                          peer_runs=None if mine else copy))
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    return [
        (name, f"{s * 1e3:.1f} ms", f"{nbytes / s / 1e9:.2f} GB/s") for name, s in medians.items()
    ]


def _mark_rate(args: argparse.Namespace, out: list[dict]) -> list[tuple[str, str, str]]:
    mask = torch.zeros(args.mask_rows, dtype=torch.bool)
    ids = torch.randint(
        0, args.mask_rows, (args.mark_ids,), generator=torch.Generator().manual_seed(args.seed)
    )
    ts = _rounds({"mark": lambda: reference.mark_rows(mask, ids)}, args.repeats)["mark"]
    s = statistics.median(ts)
    name = f"mark_rows, {args.mark_ids} ids into {args.mask_rows} rows"
    out.append(figure(name, [args.mark_ids / t / 1e6 for t in ts], "M ids/s"))
    return [(name, f"{s * 1e3:.2f} ms", f"{args.mark_ids / s / 1e6:.1f} M ids/s")]


def _collisions(args: argparse.Namespace, out: list[dict]) -> list[tuple[str, str, str]]:
    rng = np.random.default_rng(args.seed + 1)
    hashes = np.empty(args.collision_rows, dtype=np.int64)
    t0 = time.perf_counter()
    for start in range(0, args.collision_rows, args.piece_rows):
        n = min(args.piece_rows, args.collision_rows - start)
        piece = rng.random((n, args.collision_cols), dtype=np.float32)
        hashes[start : start + n] = reference.hash_rows(torch.from_numpy(piece)).numpy()
    elapsed = time.perf_counter() - t0
    hashes.sort()
    repeats = int(np.count_nonzero(hashes[1:] == hashes[:-1]))
    # Birthday bound: n(n-1)/2 pairs, each equal with probability 2^-64.
    expected = args.collision_rows * (args.collision_rows - 1) / 2 / 2.0**64
    name = f"collisions: {args.collision_rows} random rows of {args.collision_cols} fp32"
    out.append(figure(name, repeats, "repeated hashes", peer="expected", peer_runs=expected))
    return [
        (
            name,
            f"{elapsed:.1f} s incl. generation",
            f"{repeats} repeated hashes (expected {expected:.1e})",
        )
    ]


def main() -> None:
    args = _parse_args()
    print(
        f"{os.cpu_count()} CPUs, numba threads {numba.config.NUMBA_NUM_THREADS}, "
        f"torch {torch.__version__}, xxhash {xxhash.VERSION}, {args.repeats} timed rounds"
    )
    rows: list[dict] = []
    table = _throughput(args, rows) + _mark_rate(args, rows) + _collisions(args, rows)
    write_figures(args.json, "bench_kernels", args, rows)
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    print()
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


if __name__ == "__main__":
    main()
