"""Many small tensors: a base, a one-row delta, the next one-row delta and a load of a state of N
tiny tensors (an LLM's parameters, optimizer state and buffers), against ``torch.save`` /
``torch.load`` of the same state, with the files and the record size each base costs; then a
load through a chain of ten one-row deltas against the load through one (every delta's record
lists every tensor, so each delta of the chain costs a read of its record and a look at each
tensor's entry in it), and a restore through that chain into the live state (a job's resume)
against ``torch.load`` and a copy of each tensor into the state.

Run: ``python bench/bench_small_tensors.py [--tensors 20000] [--repeat 3] [--dir DIR]``.
Prints one line per measure (the median of ``--repeat`` runs); ``--json PATH`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from deltackpt import Checkpointer, EveryK

from common import figure, json_option, write_figures  # bench/common.py


def small_state(n: int, seed: int = 0) -> dict:
    """``n`` tensors in the shapes of a small transformer's pieces: biases, norms, small weights,
    step counters, in groups of five per layer."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(64,), (64,), (16, 64), (64, 16), ()]
    state = {}
    for i in range(n):
        shape = shapes[i % len(shapes)]
        state[f"layer{i // len(shapes)}/p{i % len(shapes)}"] = torch.randn(shape, generator=gen)
    return state


def files_and_bytes(path: str) -> tuple[int, int]:
    n = size = 0
    for d, _, fs in os.walk(path):
        for f in fs:
            n += 1
            size += os.path.getsize(os.path.join(d, f))
    return n, size


CHAIN = 10  # deltas before the last load


def run(n: int, where: str) -> dict[str, float]:
    state = small_state(n)
    out: dict[str, float] = {}
    pt = os.path.join(where, "state.pt")
    t0 = time.perf_counter()
    torch.save(state, pt)
    out["torch.save s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    torch.load(pt, weights_only=True)
    out["torch.load s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    loaded = torch.load(pt, weights_only=True)
    for k, t in state.items():
        t.copy_(loaded[k])
    out["torch.load and copy into the state s"] = time.perf_counter() - t0
    del loaded
    root = os.path.join(where, "store")
    with Checkpointer(root, policy=EveryK(1000)) as ckpt:
        t0 = time.perf_counter()
        ckpt.save(0, state)
        out["base save s"] = time.perf_counter() - t0
        files, nbytes = files_and_bytes(root)
        out["base files"] = files
        out["base bytes"] = nbytes
        # The root record and its part tables.
        folder = os.path.join(root, "steps", ckpt.store.manifest(0).attempt)
        out["record bytes"] = os.path.getsize(os.path.join(root, "commits", f"{0:020d}.json")) + sum(
            os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.startswith("parts."))
        state["layer0/p2"][3, 5] += 1
        t0 = time.perf_counter()
        info = ckpt.save(1, state)
        out["one-row delta s"] = time.perf_counter() - t0
        assert info.kind == "delta", info
        # The next delta: what the first one after a base encodes once (its root's entries, its
        # unchanged parts) is kept for the deltas after it.
        state["layer0/p2"][3, 6] += 1
        t0 = time.perf_counter()
        ckpt.save(2, state)
        out["next delta s"] = time.perf_counter() - t0
        for step in range(3, 1 + CHAIN):  # one row each, for a load through a longer chain
            state["layer0/p2"][3, step] += 1
            ckpt.save(step, state)
    with Checkpointer(root, create=False) as ckpt:
        t0 = time.perf_counter()
        ckpt.load(1)
        out["load s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ckpt.load(CHAIN)
        out[f"load after {CHAIN} deltas s"] = time.perf_counter() - t0
    with Checkpointer(root, create=False) as ckpt:  # a job's resume: into its live state
        t0 = time.perf_counter()
        ckpt.restore(state, CHAIN)
        out[f"restore after {CHAIN} deltas s"] = time.perf_counter() - t0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=20_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    json_option(p)
    args = p.parse_args()
    runs: dict[str, list[float]] = {}
    for _ in range(args.repeat):
        where = tempfile.mkdtemp(dir=args.dir)
        try:
            for k, v in run(args.tensors, where).items():
                runs.setdefault(k, []).append(v)
        finally:
            shutil.rmtree(where)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"{args.tensors} tensors, median of {args.repeat}:")
    for k, v in med.items():
        print(f"  {k:<20} {v:.3f}" if v < 1000 else f"  {k:<20} {v:.0f}")
    print(f"  {'base / torch.save':<20} {med['base save s'] / med['torch.save s']:.3f}")
    peers = {"base save s": "torch.save s", "one-row delta s": "torch.save s", "next delta s": "torch.save s",
             "load s": "torch.load s", f"load after {CHAIN} deltas s": "load s",
             f"restore after {CHAIN} deltas s": "torch.load and copy into the state s"}
    write_figures(args.json, "bench_small_tensors", args, [
        figure(k.removesuffix(" s"), v, "s" if k.endswith(" s") else ("files" if k == "base files" else "B"),
               peer=peers[k].removesuffix(" s") if k in peers else None, peer_runs=runs.get(peers.get(k, "")))
        for k, v in runs.items()])


if __name__ == "__main__":
    main()
