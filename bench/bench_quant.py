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
store    One float32 table (``--table-rows`` x 128, default 32 MiB) over ``--checkpoints`` saves
         (default 200), the updates of ``bench/bench_chains.py`` (Zipf row ids, ~3 % of rows per
         interval), per base-cadence policy, exact and quantized (``quantize={"emb":
         Rowwise(...)}``; bases exact): bytes a delta writes per changed row and its ratio to
         the exact delta's, the median time of the run's delta saves beside the exact run's,
         bytes written, bytes on disk, capacity against full checkpoints (``checkpoints x
         table`` over the bytes on disk), and the last step's worst restored error over its
         recorded chain bound (checked to be at most 1).
dlrm     The example DLRM on the Criteo-like stream, trained ``--dlrm-steps`` saving every 2
         steps; it fails 1, 3 or 10 times and resumes from the latest step each time (a fresh
         model, restored): evaluation loss (16 held-out batches) relative to the same run with
         exact steps, at 8, 4 (adaptive) and 2 (adaptive) bits. Reported, not asserted.

Example:
    python bench/bench_quant.py
    python bench/bench_quant.py --parts kernels --rows 1048576
    python bench/bench_quant.py --parts store --checkpoints 50
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import numba
import torch

from deltackpt import Checkpointer, Rowwise
from deltackpt.kernels import rowwise
from deltackpt.policy import EveryK, Intermittent

from common import figure, json_option, write_figures  # bench/common.py

INCREMENTAL_POLICY = EveryK(10**9, max_delta_fraction=1.0)  # one base, then deltas only

WIDTH = 128


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=262_144, help="rows of the kernels part")
    p.add_argument("--repeat", type=int, default=5, help="timed runs; the median is reported")
    p.add_argument("--table-rows", type=int, default=65_536, help="rows of the store part's table")
    p.add_argument("--checkpoints", type=int, default=200, help="saves of the store part")
    p.add_argument("--touched", type=float, default=0.03, help="share of rows an interval touches")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the row ids")
    p.add_argument("--dlrm-scale", type=float, default=0.001, help="Criteo table scale of the DLRM part")
    p.add_argument("--dlrm-steps", type=int, default=44, help="training steps of the DLRM part")
    p.add_argument("--parts", default="kernels,store,dlrm", help="comma-separated parts to run")
    p.add_argument("--dir", default="/tmp", help="folder for the scratch stores")
    p.add_argument("--seed", type=int, default=0)
    json_option(p)
    return p.parse_args(argv)


def _median(fn: Callable[[], object], repeat: int) -> float:
    fn()  # compiles / warms up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _errors(x: torch.Tensor, bits: int, scale_dtype: torch.dtype) -> tuple[float, float]:
    """(worst |error| over the row's theoretical bound, RMS error) at this scale dtype."""
    packed, _ = rowwise.quantize_rows(x, bits, scale_dtype=scale_dtype)
    y = rowwise.dequantize_rows(packed, bits, x.shape[1], torch.float32, scale_dtype=scale_dtype)
    theory = (x.max(1).values - x.min(1).values) / (2 * (2**bits - 1))
    err = (y - x).abs()
    return float((err / theory[:, None]).max()), float(err.pow(2).mean().sqrt())


def run_kernels(args: argparse.Namespace, out: list[dict]) -> None:
    numba.set_num_threads(1)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.rows, WIDTH, generator=g) * 0.01
    small = x[: max(1, args.rows // 10)].clone()
    gb = x.nbytes / 1e9
    print(f"kernels: {args.rows} x {WIDTH} float32 rows ({x.nbytes / 2**20:.0f} MiB), one thread, "
          f"median of {args.repeat}")
    print(f"{'codec':<22} {'bytes/row':>9} {'encode GB/s':>12} {'decode GB/s':>12}")
    for bits in rowwise.BITS:
        packed, _ = rowwise.quantize_rows(x, bits)
        enc = gb / _median(lambda b=bits: rowwise.quantize_rows(x, b), args.repeat)
        dec = gb / _median(lambda b=bits, p=packed: rowwise.dequantize_rows(p, b, WIDTH, torch.float32),
                         args.repeat)
        print(f"{f'deltackpt {bits}-bit':<22} {packed.shape[1]:>9} {enc:>12.2f} {dec:>12.2f}")
        out.append(figure(f"{bits}-bit encode, one thread", enc, "GB/s"))
        if bits <= 4:
            t = _median(lambda b=bits: rowwise.quantize_rows(small, b, adaptive=True), 3)
            out.append(figure(f"{bits}-bit adaptive encode, one thread", small.nbytes / 1e9 / t, "GB/s"))
            print(f"{f'deltackpt {bits}-bit adaptive':<22} {packed.shape[1]:>9} "
                  f"{small.nbytes / 1e9 / t:>12.3f} {dec:>12.2f}")
    ops = torch.ops.quantized
    for name, pack, unpack in [("byte", ops.embedding_bag_byte_prepack, ops.embedding_bag_byte_unpack),
                               ("4bit", ops.embedding_bag_4bit_prepack, ops.embedding_bag_4bit_unpack),
                               ("2bit", ops.embedding_bag_2bit_prepack, ops.embedding_bag_2bit_unpack)]:
        packed = pack(x)
        enc = gb / _median(lambda p=pack: p(x), args.repeat)
        dec = gb / _median(lambda u=unpack, q=packed: u(q), args.repeat)
        print(f"{f'torch {name}_prepack':<22} {packed.shape[1]:>9} {enc:>12.2f} {dec:>12.2f}")
        out.append(figure(f"torch {name}_prepack encode, one thread", enc, "GB/s"))
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


QUANTIZE = [("exact", None), ("8-bit", Rowwise(bits=8)), ("4-bit adaptive", Rowwise(bits=4, adaptive=True)),
            ("2-bit adaptive", Rowwise(bits=2, adaptive=True))]


def run_store(args: argparse.Namespace, scratch: str, out: list[dict]) -> None:
    """Bytes per changed row of a delta, and capacity over ``--checkpoints`` saves, per policy."""
    from bench_chains import INCREMENTAL, Workload, disk_usage  # bench/bench_chains.py

    w = Workload(args.table_rows, WIDTH, args.zipf, args.touched, args.seed)
    n = args.checkpoints
    full = args.table_rows * WIDTH * 4
    print(f"\nstore: {args.table_rows:,} x {WIDTH} float32 ({full / 2**20:.1f} MiB), {n} checkpoints, "
          f"~{100 * args.touched:g} % of rows touched per interval (Zipf {args.zipf}); capacity = "
          f"{n} full checkpoints / bytes on disk after the run; bases are always exact")
    print(f"{'policy':<26} {'deltas':<15} {'B/changed row':>13} {'vs exact':>8} {'written MiB':>11} "
          f"{'disk MiB':>9} {'capacity':>9} {'max err/bound':>13}")
    ids = [None] + [w.ids(i) for i in range(1, n)]
    policies = [("incremental only", INCREMENTAL), ("Intermittent(1.0)", Intermittent(1.0)),
                ("EveryK(50)", EveryK(50))]
    for pname, policy in policies:
        exact_per_row = exact_s = None
        for qname, rule in QUANTIZE:
            path = os.path.join(scratch, f"{pname}-{qname}".replace(" ", "_"))
            table = w.table()
            written = 0
            delta_bytes = delta_rows = 0
            delta_s: list[float] = []
            with Checkpointer(path, policy=policy, quantize={"emb": rule} if rule else None) as ckpt:
                for step in range(n):
                    if step:
                        w.update(table, step, ids[step])
                    info = ckpt.save(step, {"emb": table})
                    written += info.bytes_written
                    if info.kind == "delta":
                        delta_bytes += info.bytes_written
                        delta_rows += info.rows_changed
                        delta_s.append(info.seconds)
                got = ckpt.load(n - 1)["emb"]
                bound = ckpt.store.manifest(n - 1).tensors["emb"].lossy
            err = float((got - table).abs().max())
            ratio = err / bound.chain_bound if bound else (0.0 if err == 0 else float("inf"))
            if rule is None and err:
                raise AssertionError(f"{pname}: the exact store restored with an error of {err}")
            if ratio > 1:
                raise AssertionError(f"{pname} {qname}: error {err} beyond the recorded bound")
            per_row = delta_bytes / max(1, delta_rows)
            exact_per_row = exact_per_row or per_row
            median_s = statistics.median(delta_s) if delta_s else 0.0
            exact_s = exact_s or median_s
            disk = disk_usage(path)[0]
            print(f"{pname:<26} {qname:<15} {per_row:>13.1f} {exact_per_row / per_row:>7.2f}x "
                  f"{written / 2**20:>11.1f} {disk / 2**20:>9.1f} {n * full / disk:>8.1f}x {ratio:>13.3f}",
                  flush=True)
            out.append(figure(f"{pname}, {qname}: bytes per changed row", per_row, "B", peer="exact",
                              peer_runs=exact_per_row))
            out.append(figure(f"{pname}, {qname}: capacity vs full checkpoints", n * full / disk, "x"))
            out.append(figure(f"{pname}, {qname}: delta save, median of the run's", median_s, "s",
                              peer="exact", peer_runs=exact_s))
            shutil.rmtree(path, ignore_errors=True)


def run_dlrm(args: argparse.Namespace, scratch: str, out: list[dict]) -> None:
    """Evaluation loss of a DLRM run that fails and resumes from its latest (quantized) step
    1, 3 or 10 times, against the same run resumed from exact steps (which matches the run with
    no failure bit for bit)."""
    from deltackpt.datasets import CriteoConfig
    from deltackpt.examples import deterministic, dlrm_run, train

    warnings.filterwarnings("ignore", message="Sparse invariant checks")  # Adagrad's, once
    data = CriteoConfig(scale=args.dlrm_scale, batch_size=128)
    shapes = {"embedding_dim": 16, "bottom_mlp": (32, 16), "top_mlp": (32,)}
    steps, every = args.dlrm_steps, 2

    def run(rule: Rowwise | None, restores: int) -> tuple[float, int]:
        path = os.path.join(scratch, f"dlrm-{rule.scheme if rule else 'exact'}-{restores}")
        fail_at = {round(steps * (i + 1) / (restores + 1)) // every * every for i in range(restores)}
        with deterministic(0, threads=1):
            state, loss = dlrm_run(data, **shapes)
            quantize = {"model/emb*": rule} if rule else None
            with Checkpointer(path, policy=INCREMENTAL_POLICY, quantize=quantize) as ckpt:
                while state.step < steps:
                    train(state, loss, state.step + every)
                    ckpt.save(state.step, state)
                    if state.step in fail_at:  # a failure: a fresh model resumes from this step
                        fresh, loss = dlrm_run(data, seed=state.step, **shapes)
                        ckpt.restore(fresh, state.step)
                        state = fresh
            with torch.no_grad():
                value = sum(float(loss(10**6 + i)) for i in range(16)) / 16
        shutil.rmtree(path, ignore_errors=True)
        return value, len(fail_at)

    print(f"\nDLRM on the Criteo-like stream (scale {args.dlrm_scale}, {steps} steps, a save every "
          f"{every}): evaluation loss after failing and resuming from the latest step, relative "
          f"to resuming from exact steps")
    exact, _ = run(None, 0)
    print(f"  exact: {exact:.6f}")
    for rule in (Rowwise(8), Rowwise(4, adaptive=True), Rowwise(2, adaptive=True)):
        cells = []
        for restores in (1, 3, 10):
            got, made = run(rule, restores)
            cells.append(f"{made} restores {100 * (got - exact) / exact:+.4f} %")
            out.append(figure(f"DLRM {rule.scheme}, {made} restores: eval loss vs exact", 100 * (got - exact) / exact,
                              "%"))
        print(f"  {rule.scheme:<10} " + ", ".join(cells), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    parts = args.parts.split(",")
    out: list[dict] = []
    if "kernels" in parts:
        run_kernels(args, out)
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        if "store" in parts:
            run_store(args, scratch, out)
        if "dlrm" in parts:
            run_dlrm(args, scratch, out)
    write_figures(args.json, "bench_quant", args, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
