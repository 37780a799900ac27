"""Time training is blocked by a background save of a state on the GPU, beside DCP's
``async_save`` of the same state: a base, then a 1% marked delta.

The state lives on ``--device`` (CUDA by default): ``--tables`` fp32 tables of ``--rows`` x
``--dim``, each with a row-wise accumulator of its shape (Adagrad's sum), as a plain dict. Each
round (``--repeat``, medians reported) saves into a fresh store, after a first round that warms
up (not counted):

  base      ``save(step, state, blocking=False)``: blocked = until the call returns (the rows
            copied into the pinned staging buffers), commit = until its ``result()``
  1% delta  ``--delta`` of every table's rows and accumulator rows changed on the device and
            marked (``Checkpointer.mark``), then the same
  DCP       ``torch.distributed.checkpoint.async_save`` of the same state (default stager):
            blocked = until it returns its future, commit = until the future is done; DCP has no
            deltas, so its save after the delta's change is a full one

Right after each call returns the state changes again on the device; each step is then loaded and
compared bit for bit with the state at the call (the bench stops on a mismatch).

``gpu_check.py`` runs it after the kernel checks. It runs on the CPU too (``--device cpu``, the
path ``bench_async.py`` measures in detail), which the tests do at a tiny size.

Example:
    python bench/gpu_saves.py --tables 8 --rows 524288 --dim 64
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from deltackpt import Checkpointer

MiB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="where the state lives (default %(default)s)")
    p.add_argument("--tables", type=int, default=8, help="tables (default %(default)s)")
    p.add_argument("--rows", type=int, default=524_288, help="rows a table (default %(default)s)")
    p.add_argument("--dim", type=int, default=64, help="fp32 values a row (default %(default)s)")
    p.add_argument("--delta", type=float, default=0.01, help="share of rows a delta changes")
    p.add_argument("--repeat", type=int, default=3, help="rounds (default %(default)s)")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the scratch folder goes")
    return p.parse_args(argv)


def make_state(args: argparse.Namespace) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator(args.device).manual_seed(0)
    shape = (args.rows, args.dim)
    return {"tables": {f"t{i}": torch.randn(shape, generator=gen, device=args.device) for i in range(args.tables)},
            "accum": {f"t{i}": torch.rand(shape, generator=gen, device=args.device) for i in range(args.tables)}}


def change(state: dict[str, dict[str, torch.Tensor]], args: argparse.Namespace, gen: torch.Generator,
           ckpt: Checkpointer | None = None) -> None:
    """A training step's worth of changes on the device: ``--delta`` of every table's rows, and
    their accumulator rows; marked in ``ckpt`` if given."""
    n = max(1, int(args.delta * args.rows))
    for name, table in state["tables"].items():
        ids = torch.randperm(args.rows, generator=gen, device=args.device)[:n]
        table[ids] += 1e-3
        state["accum"][name][ids] += 1e-2
        if ckpt is not None:
            ckpt.mark(f"tables/{name}", ids)
            ckpt.mark(f"accum/{name}", ids)


def snapshot(state: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    return {group: {k: t.to("cpu", copy=True) for k, t in tensors.items()} for group, tensors in state.items()}


def check(ckpt: Checkpointer, step: int, want: dict[str, dict[str, torch.Tensor]]) -> None:
    got = ckpt.load(step)
    for group, tensors in want.items():
        for k, t in tensors.items():
            if not torch.equal(got[group][k].view(torch.int32), t.view(torch.int32)):
                raise SystemExit(f"step {step}: {group}/{k} differs from the state at the call")


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("gpu_saves.py --device cuda needs a CUDA GPU; --device cpu runs it on the CPU")
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not dist.is_initialized():  # a world of one on an in-process store: no port to take
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    state = make_state(args)
    nbytes = sum(t.nbytes for tensors in state.values() for t in tensors.values())
    budget = -(-nbytes // (32 * MiB)) * 32 * MiB + 64 * MiB  # a base fits: training waits for copies alone
    gen = torch.Generator(args.device).manual_seed(1)
    root = tempfile.mkdtemp(prefix="deltackpt-gpu-saves-", dir=args.dir)
    times: dict[str, list[float]] = {}

    def note(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    try:
        for r in range(args.repeat + 1):
            with Checkpointer(os.path.join(root, f"r{r}"), base_every=1000, memory_budget=budget) as ckpt:
                for what, step in (("base", 0), ("1% delta", 1)):
                    if step:
                        change(state, args, gen, ckpt)
                    synchronize(args.device)  # training's work so far is done before the call
                    want = snapshot(state)
                    t0 = time.perf_counter()
                    handle = ckpt.save(step, state, blocking=False)
                    note(f"{what}: blocked s", time.perf_counter() - t0)
                    change(state, args, gen)  # training goes on at once
                    info = handle.result()
                    note(f"{what}: to commit s", time.perf_counter() - t0)
                    if info.kind != what.split()[-1]:
                        raise SystemExit(f"step {step} was saved as a {info.kind}, not a {what}")
                    check(ckpt, step, want)
            for what in ("base", "1% delta"):
                if what != "base":
                    change(state, args, gen)
                synchronize(args.device)
                path = os.path.join(root, f"dcp-r{r}-{what.split()[-1]}")
                t0 = time.perf_counter()
                future = dcp.async_save(state, checkpoint_id=path)
                note(f"{what} DCP async_save: blocked s", time.perf_counter() - t0)
                future.result()
                note(f"{what} DCP async_save: to commit s", time.perf_counter() - t0)
                shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(os.path.join(root, f"r{r}"), ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # The first round warms up (kernels, staging buffers, DCP's first call): not counted.
    med = {name: statistics.median(v[1:]) for name, v in times.items()}
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"\nbackground saves on {args.device} ({name}): {args.tables} tables of {args.rows} x {args.dim} "
          f"fp32 + accumulators, {nbytes / 1e9:.2f} GB; medians of {args.repeat}")
    print("| save | blocked s | to commit s | DCP async_save blocked s | DCP to commit s | blocked / DCP's |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for what in ("base", "1% delta"):
        mine, theirs = med[f"{what}: blocked s"], med[f"{what} DCP async_save: blocked s"]
        print(f"| {what} | {mine:.4f} | {med[f'{what}: to commit s']:.4f} | {theirs:.4f} "
              f"| {med[f'{what} DCP async_save: to commit s']:.4f} | {mine / theirs:.3f} |")
    return med


if __name__ == "__main__":
    main()
