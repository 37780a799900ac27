"""Memory above the state: how much a save, a restore or a load adds to a process that holds the state.

Each operation runs in a fresh process (imports and warm-up untimed) that first builds the state
(``--tables`` tables of ``--rows`` x ``--dim`` float32 with row-wise accumulators, a dense layer
with two moments), or the pre-allocated target of a restore, then resets the kernel's peak-RSS
counter (``/proc/self/clear_refs``), runs the operation once and reports its peak resident memory
(``VmHWM``) minus its resident memory right before it: the memory the operation added above the
state. deltackpt's base save, 1% delta save, in-place restore of the delta step and load beside
``torch.save``, ``torch.load``, DCP's save and DCP's in-place load of the same state, rounds
interleaved, medians reported. Linux only.

Example:
    python bench/bench_memory.py --rows 262144 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from common import figure, json_option, write_figures  # bench/common.py

CHILD = """
import json, os, sys, warnings
import torch
import deltackpt
import torch.distributed.checkpoint as dcp

warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming the intent is to ... in a single process"
op, folder, tables, rows, dim, step = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])

def state(fill):
    g = torch.Generator().manual_seed(0)
    make = (lambda *s: torch.randn(*s, generator=g)) if fill else (lambda *s: torch.zeros(*s))
    return {"emb": {f"t{i}": make(rows, dim) for i in range(tables)},
            "acc": {f"t{i}": make(rows) for i in range(tables)},
            "dense": {"w": make(1024, 1024), "m": make(1024, 1024), "v": make(1024, 1024)}}

def status(field):
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field + ":"))

store, pt, dc = (os.path.join(folder, n) for n in ("store", "state.pt", "dcp"))
s = state(op in ("prepare", "torch.save", "DCP save", "deltackpt base save", "deltackpt 1% delta save"))
if op == "prepare":
    torch.save(s, pt)
    dcp.save(s, checkpoint_id=dc)
    with deltackpt.Checkpointer(store) as ckpt:
        ckpt.save(0, s)
        for i in range(tables):
            s["emb"][f"t{i}"][:: 100] += 1
            s["acc"][f"t{i}"][:: 100] += 1
        ckpt.save(1, s)
    print(json.dumps({"state": sum(t.nbytes for d in s.values() for t in d.values())}))
    sys.exit()
run = {
    "torch.save": lambda: torch.save(s, os.path.join(folder, "out.pt")),
    "DCP save": lambda: dcp.save(s, checkpoint_id=os.path.join(folder, "out.dcp")),
    "deltackpt base save": lambda: ckpt.save(0, s),
    "deltackpt 1% delta save": lambda: ckpt.save(step, s),
    "torch.load": lambda: s.update(torch.load(pt, weights_only=True)),
    "DCP load (in place)": lambda: dcp.load(s, checkpoint_id=dc),
    "deltackpt restore (in place)": lambda: ckpt.restore(s, 1),
    "deltackpt load": lambda: s.update(ckpt.load(1)),
}[op]
fresh = op == "deltackpt base save"
ckpt = deltackpt.Checkpointer(os.path.join(folder, "out") if fresh else store, create=fresh)
if op == "deltackpt 1% delta save":
    ckpt.restore({k: dict(v) for k, v in s.items()}, 1)  # the change tracker adopts step 1
    for i in range(tables):
        s["emb"][f"t{i}"][1 :: 100] += 1
deltackpt.kernels.warm()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS
before = status("VmRSS")
run()
print(json.dumps({"added": status("VmHWM") - before}))
ckpt.close()
"""

OPS = ("torch.save", "DCP save", "deltackpt base save", "deltackpt 1% delta save",
       "torch.load", "DCP load (in place)", "deltackpt restore (in place)", "deltackpt load")
PEERS = {"deltackpt base save": "torch.save", "deltackpt 1% delta save": "torch.save",
         "deltackpt restore (in place)": "DCP load (in place)", "deltackpt load": "torch.load"}


def child(op: str, folder: str, args: argparse.Namespace, step: int = 0) -> dict[str, int]:
    """Runs ``op`` in a fresh process; a delta save saves ``step`` (one not in the store yet)."""
    out = subprocess.run([sys.executable, "-c", CHILD, op, folder, str(args.tables), str(args.rows), str(args.dim),
                          str(step)],
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{op} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", type=int, default=8, help="tables (default %(default)s)")
    p.add_argument("--rows", type=int, default=262_144, help="rows per table (default %(default)s)")
    p.add_argument("--dim", type=int, default=128, help="float32 values per row (default %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="rounds; medians are reported (default %(default)s)")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the scratch folder goes")
    json_option(p)
    args = p.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="bench_memory-", dir=args.dir)
    added: dict[str, list[float]] = {op: [] for op in OPS}
    try:
        state = child("prepare", scratch, args)["state"]
        for r in range(args.repeat):
            for op in OPS[r % len(OPS):] + OPS[:r % len(OPS)]:
                added[op].append(child(op, scratch, args, step=2 + r)["added"] / 2**20)
                for leftover in ("out", "out.pt", "out.dcp"):
                    path = os.path.join(scratch, leftover)
                    shutil.rmtree(path) if os.path.isdir(path) else (os.path.exists(path) and os.unlink(path))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"state {state / 2**20:.0f} MiB ({args.tables} tables of {args.rows} x {args.dim} float32, "
          f"accumulators, a dense layer and its moments); memory added above it, MiB, medians of {args.repeat}")
    print("| op | MiB added (median) | runs | vs |\n|---|---|---|---|")
    for op, v in added.items():
        peer = PEERS.get(op)
        vs = f"{statistics.median(v) / max(statistics.median(added[peer]), 1e-9):.3f}x {peer}" if peer else ""
        print(f"| {op} | {statistics.median(v):.1f} | {', '.join(f'{x:.1f}' for x in v)} | {vs} |")
    write_figures(args.json, "bench_memory", args, [
        figure(f"{op}: memory added", v, "MiB", peer=PEERS.get(op), peer_runs=added.get(PEERS.get(op, "")))
        for op, v in added.items()], state_bytes=state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
