"""``deltackpt demo``: sparse row updates on embedding-sized tables, checkpointed, then restored.

Each training step updates a small random set of rows in every table (as an embedding lookup
with a row-wise Adagrad optimizer would), checkpoints every few steps, prints one line per
checkpoint, and finally restores a middle step and the latest step from the store alone and
checks them bit for bit against copies kept in memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

from .checkpointer import Checkpointer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path", default="deltackpt-demo",
                   help="folder for the demo's stores; each run makes a new store inside "
                        "(default: ./deltackpt-demo)")
    p.add_argument("--tables", type=int, default=4, help="embedding tables (default 4)")
    p.add_argument("--rows", type=int, default=250_000, help="rows per table (default 250000)")
    p.add_argument("--dim", type=int, default=64, help="embedding dimension (default 64)")
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps (default 5)")
    p.add_argument("--base-every", type=int, default=5,
                   help="a full base every N checkpoints (default 5)")
    p.add_argument("--touch", type=float, default=0.002,
                   help="fraction of each table's rows updated per step (default 0.002)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object per line")


def _check(args: argparse.Namespace) -> None:
    for name in ("tables", "rows", "dim", "steps", "every", "base_every"):
        if getattr(args, name) < 1:
            raise SystemExit(f"deltackpt demo: error: --{name.replace('_', '-')} must be >= 1, "
                             f"got {getattr(args, name)}")
    if not 0 < args.touch <= 1:
        raise SystemExit(f"deltackpt demo: error: --touch must be in (0, 1], got {args.touch}")


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def run_demo(args: argparse.Namespace) -> int:
    _check(args)
    gen = torch.Generator().manual_seed(args.seed)
    tables = {f"t{i}": torch.randn(args.rows, args.dim, generator=gen) * 0.01
              for i in range(args.tables)}
    accum = {k: torch.zeros(args.rows) for k in tables}
    state = {"tables": tables, "adagrad": accum, "step": 0}
    os.makedirs(args.path, exist_ok=True)
    path = tempfile.mkdtemp(prefix=time.strftime("run-%Y%m%d-%H%M%S-"), dir=args.path)
    say = (lambda doc: print(json.dumps(doc))) if args.json else None
    touched = max(1, int(args.rows * args.touch))
    checkpoints = [s for s in range(args.every, args.steps + 1, args.every)]
    middle = checkpoints[len(checkpoints) // 2] if checkpoints else None
    kept: dict[str, torch.Tensor] = {}
    totals = {"written": 0, "full": 0}
    if not args.json:
        print(f"store {path}: {args.tables} tables x {args.rows} rows x {args.dim}, "
              f"{touched} rows touched per table per step, checkpoint every {args.every} steps")
        print(f"{'step':>6} {'kind':<6} {'rows changed':>12} {'written':>11} {'full':>11} "
              f"{'ratio':>7} {'save s':>7}")
    with Checkpointer(path, base_every=args.base_every) as ckpt:
        for step in range(1, args.steps + 1):
            for k, w in tables.items():
                ids = torch.randint(0, args.rows, (touched,), generator=gen)
                grad = torch.randn(touched, args.dim, generator=gen) * 0.01
                accum[k].index_add_(0, ids, grad.pow(2).mean(1))
                w.index_add_(0, ids, -0.1 * grad / (accum[k][ids].sqrt() + 1e-8)[:, None])
            state["step"] = step
            if step % args.every:
                continue
            info = ckpt.save(step, state)
            totals["written"] += info.bytes_written
            totals["full"] += info.state_bytes
            if step == middle:
                kept = {k: t.clone() for k, t in tables.items()}
            row = {"step": step, "kind": info.kind, "rows_changed": info.rows_changed,
                   "bytes_written": info.bytes_written, "full_bytes": info.state_bytes,
                   "seconds": round(info.seconds, 4)}
            if say:
                say(row)
            else:
                print(f"{step:>6} {info.kind:<6} {info.rows_changed:>12} "
                      f"{info.bytes_written / 1e6:>8.2f} MB {info.state_bytes / 1e6:>8.2f} MB "
                      f"{info.state_bytes / max(1, info.bytes_written):>6.1f}x {info.seconds:>7.3f}")
    ok = True
    if middle is not None:
        with Checkpointer(path, create=False) as fresh:
            t0 = time.perf_counter()
            loaded = fresh.load(middle)
            mid_s = time.perf_counter() - t0
            ok &= all(_bits_equal(loaded["tables"][k], kept[k]) for k in kept)
            target = {"tables": {k: torch.zeros_like(t) for k, t in tables.items()},
                      "adagrad": {k: torch.zeros_like(t) for k, t in accum.items()}, "step": 0}
            t0 = time.perf_counter()
            fresh.restore(target, checkpoints[-1])
            last_s = time.perf_counter() - t0
            ok &= all(_bits_equal(target["tables"][k], tables[k]) for k in tables)
            ok &= all(_bits_equal(target["adagrad"][k], accum[k]) for k in accum)
            ok &= target["step"] == checkpoints[-1]
        summary = {"store": path, "checkpoints": len(checkpoints),
                   "bytes_written": totals["written"], "full_bytes": totals["full"],
                   "restore_middle_step": middle, "restore_middle_s": round(mid_s, 3),
                   "restore_latest_s": round(last_s, 3), "bit_exact": ok}
        if say:
            say(summary)
        else:
            print(f"wrote {totals['written'] / 1e6:.1f} MB for {len(checkpoints)} checkpoints, "
                  f"{totals['full'] / max(1, totals['written']):.1f}x less than full checkpoints "
                  f"({totals['full'] / 1e6:.1f} MB)")
            print(f"restored step {middle} in {mid_s:.2f} s and step {checkpoints[-1]} in "
                  f"{last_s:.2f} s from the store alone: "
                  f"{'bit-exact' if ok else 'MISMATCH'}")
    if not ok:
        print("deltackpt demo: error: a restored step differs from the state saved", file=sys.stderr)
    return 0 if ok else 1
