"""Background saves: how long training is blocked per checkpoint, how much slower training steps
run while a save writes behind them, and how long a save takes to commit, against blocking saves
and ``torch.distributed.checkpoint.async_save`` of the same state.

The state is a DLRM-like model: ``--tables`` sparse EmbeddingBags of ``--rows`` x ``--dim`` float32
rows with Adagrad (its per-row sum doubles the tables' bytes) and a small dense MLP; the
checkpointer tracks the tables, so a delta writes the rows training marked. Each round, in turn:

  base        a blocking base; a background base (blocked time, then commit latency); DCP
              ``async_save`` (blocked until its future is returned, then until it is done)
  delta       a training step touching ``--delta`` of every table's rows, then a blocking delta;
              the same again with a background delta
  steps       ``--steps`` training steps alone, then the same number right after a background
              delta started (its write and commit run beside them)

Also timed once, in a fresh process each: the first save's blocked time (the hash kernels are
warmed in the background when the checkpointer is built, so the first save should block no
longer than later ones). Medians over ``--repeat`` rounds. The machine is shared: every figure
carries the noise of other processes, which is printed per round.

Example:
    python bench/bench_async.py --tables 8 --rows 131072 --dim 64 --repeat 3
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

import torch
from torch import nn

import deltackpt
from deltackpt import Checkpointer

sys.path.insert(0, os.path.dirname(__file__))
from common import cpu_seconds, figure, json_option, others_cpu, write_figures  # noqa: E402


def build(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    torch.manual_seed(args.seed)
    model = nn.ModuleDict({
        "tables": nn.ModuleList(nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True)
                                for _ in range(args.tables)),
        "mlp": nn.Sequential(nn.Linear(args.dim, 64), nn.ReLU(), nn.Linear(64, 1)),
    })
    opt = torch.optim.Adagrad(model.parameters(), lr=0.01)
    return model, opt, {"model": model, "optim": opt, "step": 0}


def train_step(model: nn.Module, opt: torch.optim.Optimizer, rows: int, n: int, gen: torch.Generator) -> None:
    opt.zero_grad()
    pooled = sum(t(torch.randint(0, rows, (n, 1), generator=gen)) for t in model["tables"])
    model["mlp"](pooled).sum().backward()
    opt.step()


def first_save(args: argparse.Namespace, folder: str) -> float:
    """The blocked time of the first background save in a fresh process."""
    code = (
        "import sys, time, torch, deltackpt\n"
        "ckpt = deltackpt.Checkpointer(sys.argv[1])\n"
        "time.sleep(float(sys.argv[2]))\n"
        "t = torch.randn(20000, 32)\n"
        "print(ckpt.save(1, {'t': t}, blocking=False).blocked_seconds)\n"
        "ckpt.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", code, folder, str(args.warm_wait)], check=True,
                         capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=131_072)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--delta", type=float, default=0.01, help="share of rows a delta's step touches")
    p.add_argument("--steps", type=int, default=10, help="training steps timed beside a save")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--warm-wait", type=float, default=1.0,
                   help="seconds between building the checkpointer and the first save")
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--seed", type=int, default=0)
    json_option(p)
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="deltackpt-bench-async-", dir=args.dir)
    print(f"deltackpt from {os.path.dirname(deltackpt.__file__)}; torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs")
    model, opt, state = build(args)
    gen = torch.Generator().manual_seed(args.seed)
    train_step(model, opt, args.rows, 1, gen)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 2
    touched = max(1, int(args.delta * args.rows))
    print(f"state: {args.tables} tables of {args.rows} x {args.dim} with Adagrad, ~{nbytes / 2**20:.0f} MiB; "
          f"a delta's step touches {touched} rows a table")
    figures: dict[str, list[float]] = {}

    def note(name: str, value: float) -> None:
        figures.setdefault(name, []).append(value)

    try:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29533")
            dist.init_process_group("gloo", rank=0, world_size=1)
        have_dcp = hasattr(dcp, "async_save")
    except Exception as e:  # noqa: BLE001 - the bench runs without DCP
        print(f"no DCP async_save: {e}")
        have_dcp = False
    for r in range(args.repeat):
        start = cpu_seconds()
        step = 100 * r
        for blocking in (True, False):
            path = os.path.join(root, f"r{r}-{blocking}")
            with Checkpointer(path, base_every=1000) as ckpt:
                ckpt.track(model, prefix="model", optimizer=opt)
                for what, at in (("base", step + 1), ("1% delta", step + 2)):
                    if what != "base":
                        train_step(model, opt, args.rows, touched, gen)
                    t0 = time.perf_counter()
                    out = ckpt.save(at, state, blocking=blocking)
                    blocked = time.perf_counter() - t0
                    info = out if blocking else out.result()
                    mode = "blocking" if blocking else "background"
                    note(f"{what} {mode}: blocked s", blocked)
                    note(f"{what} {mode}: to commit s", info.seconds)
                if not blocking:
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        train_step(model, opt, args.rows, touched, gen)
                    alone = (time.perf_counter() - t0) / args.steps
                    train_step(model, opt, args.rows, touched, gen)
                    handle = ckpt.save(step + 3, state, blocking=False)
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        train_step(model, opt, args.rows, touched, gen)
                    beside = (time.perf_counter() - t0) / args.steps
                    handle.result()
                    note("train step alone ms", 1000 * alone)
                    note("train step beside a background delta ms", 1000 * beside)
            shutil.rmtree(path)
        if have_dcp:
            path = os.path.join(root, f"dcp{r}")
            sd = {"model": model.state_dict(), "optim": opt.state_dict()}
            t0 = time.perf_counter()
            fut = dcp.async_save(sd, checkpoint_id=path)
            blocked = time.perf_counter() - t0
            fut.result()
            note("DCP async_save base: blocked s", blocked)
            note("DCP async_save base: to commit s", time.perf_counter() - t0)
            shutil.rmtree(path, ignore_errors=True)
        note("first background save of a fresh process: blocked s",
             first_save(args, os.path.join(root, f"fresh{r}")))
        print(f"round {r + 1}/{args.repeat}: other processes {others_cpu(start, cpu_seconds()) or 0:.1f} CPU-s")
    print()
    print("| figure | median | runs |")
    print("| --- | --- | --- |")
    for name, values in figures.items():
        print(f"| {name} | {statistics.median(values):.3f} | {', '.join(f'{v:.3f}' for v in values)} |")
    write_figures(args.json, "bench_async", args, [figure(name, values, unit, peer=peer, peer_runs=figures.get(peer))
                                                   for name, values in figures.items()
                                                   for unit, peer in [peer_of(name)]], state_bytes=nbytes)
    shutil.rmtree(root, ignore_errors=True)


def peer_of(name: str) -> tuple[str, str | None]:
    """The unit of figure ``name`` and the figure measured beside it that it is compared with."""
    unit = "ms" if name.endswith(" ms") else "s"
    if name.startswith("base background"):
        return unit, name.replace("base background", "DCP async_save base")
    if name.startswith("1% delta background"):
        return unit, name.replace("background", "blocking")
    if name == "train step beside a background delta ms":
        return unit, "train step alone ms"
    return unit, None


if __name__ == "__main__":
    main()
