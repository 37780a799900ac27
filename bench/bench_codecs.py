"""How much lz4 (alone, and blosc-lz4 with byte or bit shuffle) shrinks each kind of data a
checkpoint holds, and how fast: the measurement behind the codec choice in docs/format.md.

    python bench/bench_codecs.py [--rows 40000] [--dim 128] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import lz4.block
import numpy as np
from numcodecs import Blosc

from common import figure, json_option, write_figures  # bench/common.py


def samples(rows: int, dim: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((rows, dim)) * 0.01).astype(np.float32)
    return {
        "sorted int64 row ids (1% of 100x rows)": np.sort(
            rng.choice(rows * 100, rows, replace=False)).astype(np.int64),
        "fp32 embedding rows N(0, 0.01)": weights,
        "bf16 embedding rows (as uint16)": (weights.view(np.uint32) >> 16).astype(np.uint16),
        "fp32 Adagrad accumulators": np.abs(rng.standard_normal((rows, dim))).astype(np.float32),
        "bool mask, 1% set": rng.random(rows * dim) < 0.01,
        "int64 counters": np.arange(rows * dim // 8, dtype=np.int64),
    }


def measure(data: np.ndarray, encode, repeat: int) -> tuple[float, float]:
    out = encode(data)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        encode(data)
        times.append(time.perf_counter() - t0)
    return data.nbytes / len(out), data.nbytes / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=40_000, help="rows per sample (default 40000)")
    parser.add_argument("--dim", type=int, default=128, help="row width (default 128)")
    parser.add_argument("--repeat", type=int, default=3, help="timed repeats (default 3)")
    json_option(parser)
    args = parser.parse_args()
    rows = []
    print("| data | lz4 ratio / GB/s | blosc lz4 byte shuffle ratio / GB/s | blosc lz4 bit shuffle ratio / GB/s |")
    print("| --- | --- | --- | --- |")
    for name, data in samples(args.rows, args.dim).items():
        cells = [measure(data, lambda d: lz4.block.compress(d.tobytes(), store_size=False), args.repeat)]
        for shuffle in (Blosc.SHUFFLE, Blosc.BITSHUFFLE):
            codec = Blosc(cname="lz4", clevel=5, shuffle=shuffle, typesize=data.itemsize)
            cells.append(measure(data, codec.encode, args.repeat))
        print(f"| {name} | " + " | ".join(f"{r:.2f}x / {g:.2f}" for r, g in cells) + " |")
        for codec_name, (ratio, speed) in zip(("lz4", "blosc lz4 byte shuffle", "blosc lz4 bit shuffle"), cells):
            rows.append(figure(f"{name}: {codec_name} ratio", ratio, "x"))
            rows.append(figure(f"{name}: {codec_name} encode", speed, "GB/s"))
    write_figures(args.json, "bench_codecs", args, rows)


if __name__ == "__main__":
    main()
