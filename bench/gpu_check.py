"""Parity and speed of the Triton kernels on a CUDA GPU, against the reference and torch; then
the time training is blocked by background saves of a state on the GPU, beside DCP's
``async_save`` (``gpu_saves.py``).

First checks every Triton kernel bit for bit against the CPU reference on CUDA tensors of several
dtypes and odd sizes, then times each against its torch counterpart (``index_fill_``,
``index_select``) and against the device's copy bandwidth, measured in the same run with a tensor
copy. Prints the parity result, then the table; then ``gpu_saves.py``'s table (a base and a 1%
marked delta of a 2.15 GB state, ``--saves-repeat`` rounds; 0 skips it). Exits 1 if any parity
check failed. The kernels' part is sized to finish well under four minutes, most of it Triton
compiling; the saves add what four rounds (one to warm up) of a 2.15 GB base, a delta and DCP's saves take.

Example:
    python bench/gpu_check.py --size-mib 1024
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from types import ModuleType

import gpu_saves
import torch

from deltackpt import kernels
from deltackpt.kernels import reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8]
# (rows, elements per row): no rows, empty rows, short rows, one stripe, tails of every length,
# and enough rows for many programs.
SHAPES = [(0, 4), (3, 0), (1, 1), (7, 3), (5, 8), (9, 33), (4, 67), (100_003, 129)]
# (bytes, chunk_bytes), with short last chunks and a chunk longer than the data.
CHUNKINGS = [(8, 64), (1000, 96), (999, 333), (1 << 20, 4096), ((1 << 20) + 4, 65536)]


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=1024, help="hashed/copied buffer size (MiB)")
    p.add_argument(
        "--row-bytes",
        type=int,
        default=512,
        help="row size for hash_rows and gather_rows (bytes); an odd size is timed too",
    )
    p.add_argument(
        "--chunk-bytes",
        type=int,
        nargs="+",
        default=[65536, 1 << 20],
        help="chunk sizes for hash_chunks (bytes)",
    )
    p.add_argument("--mask-rows", type=int, default=100_000_000, help="mask length for mark_rows")
    p.add_argument("--mark-ids", type=int, default=10_000_000, help="ids marked per mark_rows call")
    p.add_argument(
        "--gather-ids", type=int, default=1 << 20, help="rows gathered per gather_rows call"
    )
    p.add_argument("--rep-ms", type=int, default=200, help="timing budget per measurement (ms)")
    p.add_argument("--saves-repeat", type=int, default=3, help="rounds of gpu_saves.py (0: none)")
    return p.parse_args()


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    # Random bit patterns (NaN payloads included): the kernels work on bytes, not values.
    g = torch.Generator(device).manual_seed(seed)
    n = torch.Size(shape).numel() * dtype.itemsize
    return (
        torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=g)
        .view(dtype)
        .reshape(shape)
    )


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Compared as bytes, since NaN != NaN as values. Empty tensors are skipped: one made from an
    # empty numpy array has stride 0, which a dtype view rejects.
    a, b = a.cpu(), b.cpu()
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and (
            a.numel() == 0
            or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    )


def _parity(tk: ModuleType, device: str) -> list[tuple[str, bool]]:
    """(case, bit-identical to the reference) for every parity case."""
    results: list[tuple[str, bool]] = []
    for dtype in DTYPES:
        for shape in SHAPES:
            t = _random(shape, dtype, device, seed=len(results))
            ids = torch.randint(0, max(shape[0], 1), (min(shape[0], 1000),), device=device)
            got, want = tk.hash_rows(t), reference.hash_rows(t.cpu())
            results.append((f"hash_rows {dtype} {shape}", _same_bits(got, want)))
            got, want = tk.gather_rows(t, ids), reference.gather_rows(t.cpu(), ids.cpu())
            results.append((f"gather_rows {dtype} {shape}", _same_bits(got, want)))
    for nbytes, chunk in CHUNKINGS:
        t = _random((nbytes,), torch.uint8, device, seed=len(results))
        got, want = tk.hash_chunks(t, chunk), reference.hash_chunks(t.cpu(), chunk)
        results.append((f"hash_chunks {nbytes} B by {chunk}", _same_bits(got, want)))
    for mask_dtype in (torch.bool, torch.uint8):
        for ids_dtype in (torch.int64, torch.int32):
            ids = torch.randint(-5000, 5000, (20_000,), device=device).to(ids_dtype)
            got = torch.zeros(5000, dtype=mask_dtype, device=device)
            want = torch.zeros(5000, dtype=mask_dtype, device=device)
            tk.mark_rows(got, ids)
            reference.mark_rows(want, ids)
            results.append(
                (f"mark_rows {mask_dtype} mask, {ids_dtype} ids", torch.equal(got, want))
            )
    return results


def _timings(tk: ModuleType, args: argparse.Namespace, device: str) -> list[tuple[str, float, str]]:
    """(name, median ms, rate) for every kernel and its torch counterpart."""
    from triton.testing import do_bench

    def ms(fn: Callable[[], object]) -> float:
        return do_bench(fn, rep=args.rep_ms, return_mode="median")

    def gbs(nbytes: int, t_ms: float) -> str:
        return f"{nbytes / t_ms / 1e6:.0f} GB/s"

    nbytes = (args.size_mib << 20) // args.row_bytes * args.row_bytes
    src = _random((nbytes,), torch.uint8, device, seed=1)
    dst = torch.empty_like(src)
    # Not a multiple of 16 bytes, so the compiler cannot merge a row's byte loads into words.
    odd_row = args.row_bytes + 4
    rows = src.view(-1, args.row_bytes)
    odd_rows = src[: nbytes // odd_row * odd_row].view(-1, odd_row)
    out: list[tuple[str, float, str]] = []

    t = ms(lambda: dst.copy_(src))
    out.append((f"device copy dst.copy_(src), {nbytes >> 20} MiB (bytes read)", t, gbs(nbytes, t)))
    t = ms(lambda: tk.hash_rows(rows))
    out.append((f"triton hash_rows, {args.row_bytes} B rows", t, gbs(nbytes, t)))
    t = ms(lambda: tk.hash_rows(odd_rows))
    out.append((f"triton hash_rows, {odd_row} B rows", t, gbs(odd_rows.numel(), t)))
    for chunk in args.chunk_bytes:
        t = ms(lambda c=chunk: tk.hash_chunks(src, c))
        out.append((f"triton hash_chunks, {chunk} B chunks", t, gbs(nbytes, t)))
    t = ms(lambda: kernels.hash_rows(rows, backend="torch"))
    out.append((f"reference hash_rows on host copy, {args.row_bytes} B rows", t, gbs(nbytes, t)))

    mask = torch.zeros(args.mask_rows, dtype=torch.bool, device=device)
    ids = torch.randint(0, args.mask_rows, (args.mark_ids,), device=device)
    for name, fn in (
        ("triton mark_rows", tk.mark_rows),
        ("torch index_fill_", reference.mark_rows),
    ):
        t = ms(lambda f=fn: f(mask, ids))
        out.append(
            (
                f"{name}, {args.mark_ids} ids into {args.mask_rows} rows",
                t,
                f"{args.mark_ids / t / 1e3:.0f} M ids/s",
            )
        )

    gids = torch.randint(0, rows.shape[0], (args.gather_ids,), device=device)
    moved = args.gather_ids * args.row_bytes
    for name, fn in (
        ("triton gather_rows", tk.gather_rows),
        ("torch index_select", reference.gather_rows),
    ):
        t = ms(lambda f=fn: f(rows, gids))
        out.append((f"{name}, {args.gather_ids} rows of {args.row_bytes} B", t, gbs(moved, t)))
    return out


def main() -> None:
    args = _parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check.py needs a CUDA GPU, and torch.cuda.is_available() is False here.")
    try:
        from deltackpt.kernels import triton_kernels as tk
    except ImportError as e:
        sys.exit(f"gpu_check.py needs triton: {e}")
    if tk.INTERPRETED:
        sys.exit("TRITON_INTERPRET is set: unset it, or the kernels run in the slow interpreter.")

    parity = _parity(tk, "cuda")
    failures = [name for name, ok in parity if not ok]
    for name in failures:
        print(f"PARITY FAILURE: {name}")
    same = len(parity) - len(failures)
    print(f"parity: {same} of {len(parity)} checks bit-identical to the reference")
    table = _timings(tk, args, "cuda")
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
    width = max(len(name) for name, _, _ in table)
    for name, t, rate in table:
        print(f"{name.ljust(width)}  {t:9.3f} ms  {rate}")
    if args.saves_repeat:
        gpu_saves.main(["--device", "cuda", "--repeat", str(args.saves_repeat)])
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
