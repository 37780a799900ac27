"""Row-wise quantized deltas: kernel speed beside torch's own ops, error by scale dtype, and what
a quantized store saves.

kernels  ``--rows`` x 128 float32 rows N(0, 0.01) (default 262,144 = 128 MiB), one thread (numba
         and torch): encode and decode GB/s (of the float32 rows) of
         ``deltackpt.kernels.rowwise`` at 8, 4 and 2 bits (and adaptive at 4 and 2, on a tenth of
         the rows: it is ~100x slower), beside ``torch.ops.quantized.embedding_bag_byte_prepack``,
         ``embedding_bag_4bit_prepack`` and ``embedding_bag_2bit_prepack`` and their unpack ops;
         bytes per quantized row; and, per scale dtype (float32 / float16), the worst error over
         the bound ``(max - min) / (2 (2^b - 1))`` and the RMS error, on N(0, 0.01) rows and on
         N(1, 0.01) rows (an offset far larger than the spread): why 8 bits keeps float32 scales
         and 4 and 2 bits take float16 ones. Best of ``--repeat`` runs.
store    One float32 table (``--table-rows`` x 128) saved as a base then ``--deltas`` deltas that
         each touch ``--touched`` of the rows (power-law ids), exact and quantized
         (``quantize={"table": Rowwise(...)}``): bytes each delta writes per changed row, its
         ratio to the exact delta's, and the worst restored error over the recorded bound.

Example:
    python bench/bench_quant.py
    python bench/bench_quant.py --parts kernels --rows 1048576
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable

import numba
import torch

from deltackpt.kernels import rowwise

WIDTH = 128


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=262_144, help="rows of the kernels part")
    p.add_argument("--repeat", type=int, default=5, help="timed runs; the best is reported")
    p.add_argument("--table-rows", type=int, default=200_000, help="rows of the store part's table")
    p.add_argument("--deltas", type=int, default=5, help="deltas of the store part")
    p.add_argument("--touched", type=float, default=0.05, help="fraction of rows a delta changes")
    p.add_argument("--parts", default="kernels,store", help="comma-separated parts to run")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _best(fn: Callable[[], object], repeat: int) -> float:
    fn()  # compiles / warms up
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _errors(x: torch.Tensor, bits: int, scale_dtype: torch.dtype) -> tuple[float, float]:
    """(worst |error| over the row's theoretical bound, RMS error) at this scale dtype."""
    packed, _ = rowwise.quantize_rows(x, bits, scale_dtype=scale_dtype)
    y = rowwise.dequantize_rows(packed, bits, x.shape[1], torch.float32, scale_dtype=scale_dtype)
    theory = (x.max(1).values - x.min(1).values) / (2 * (2**bits - 1))
    err = (y - x).abs()
    return float((err / theory[:, None]).max()), float(err.pow(2).mean().sqrt())


def run_kernels(args: argparse.Namespace) -> None:
    numba.set_num_threads(1)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.rows, WIDTH, generator=g) * 0.01
    small = x[: max(1, args.rows // 10)].clone()
    gb = x.nbytes / 1e9
    print(f"kernels: {args.rows} x {WIDTH} float32 rows ({x.nbytes / 2**20:.0f} MiB), one thread, "
          f"best of {args.repeat}")
    print(f"{'codec':<22} {'bytes/row':>9} {'encode GB/s':>12} {'decode GB/s':>12}")
    for bits in rowwise.BITS:
        packed, _ = rowwise.quantize_rows(x, bits)
        enc = gb / _best(lambda b=bits: rowwise.quantize_rows(x, b), args.repeat)
        dec = gb / _best(lambda b=bits, p=packed: rowwise.dequantize_rows(p, b, WIDTH, torch.float32),
                         args.repeat)
        print(f"{f'deltackpt {bits}-bit':<22} {packed.shape[1]:>9} {enc:>12.2f} {dec:>12.2f}")
        if bits <= 4:
            t = _best(lambda b=bits: rowwise.quantize_rows(small, b, adaptive=True), 1)
            print(f"{f'deltackpt {bits}-bit adaptive':<22} {packed.shape[1]:>9} "
                  f"{small.nbytes / 1e9 / t:>12.3f} {dec:>12.2f}")
    ops = torch.ops.quantized
    for name, pack, unpack in [("byte", ops.embedding_bag_byte_prepack, ops.embedding_bag_byte_unpack),
                               ("4bit", ops.embedding_bag_4bit_prepack, ops.embedding_bag_4bit_unpack),
                               ("2bit", ops.embedding_bag_2bit_prepack, ops.embedding_bag_2bit_unpack)]:
        packed = pack(x)
        enc = gb / _best(lambda p=pack: p(x), args.repeat)
        dec = gb / _best(lambda u=unpack, q=packed: u(q), args.repeat)
        print(f"{f'torch {name}_prepack':<22} {packed.shape[1]:>9} {enc:>12.2f} {dec:>12.2f}")
    print(f"exact row: {WIDTH * 4} bytes")
    tiny = torch.rand(small.shape, generator=g) * 1e-6
    theory = (tiny.max(1).values - tiny.min(1).values) / 510
    theirs = (ops.embedding_bag_byte_unpack(ops.embedding_bag_byte_prepack(tiny)) - tiny).abs()
    ours = (rowwise.dequantize_rows(rowwise.quantize_rows(tiny, 8)[0], 8, WIDTH, torch.float32) - tiny).abs()
    print(f"U(0, 1e-6) rows, worst 8-bit error / bound: torch {float((theirs / theory[:, None]).max()):.2f}, "
          f"deltackpt {float((ours / theory[:, None]).max()):.4f}")
    print("\nerror by scale dtype (worst |error| / ((max - min) / (2 (2^b - 1))), RMS error):")
    for offset in (0.0, 1.0):
        for bits in rowwise.BITS:
            cells = []
            for sd in (torch.float32, torch.float16):
                worst, rms = _errors(small + offset, bits, sd)
                cells.append(f"{str(sd).split('.')[1]}: worst {worst:.4f}, rms {rms:.3e}")
            print(f"  N({offset:g}, 0.01) {bits}-bit  " + "  |  ".join(cells))


def run_store(args: argparse.Namespace) -> None:
    import deltackpt
    from deltackpt.datasets import PowerLaw  # noqa: F401 - the power-law row ids

    raise NotImplementedError


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    parts = args.parts.split(",")
    if "kernels" in parts:
        run_kernels(args)
    if "store" in parts:
        with tempfile.TemporaryDirectory():
            run_store(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
