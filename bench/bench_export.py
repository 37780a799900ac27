"""Export of a DLRM-like state to DCP, safetensors and torch.save, beside DCP's own conversion.

The state (default: the project's 2.2 GB peer state: 8 tables of 524,288 x 128 float32, a row-wise
Adagrad accumulator per table, a dense MLP with Adam moments, a step counter; ``--scale`` shrinks
the tables) is saved as a base (step 0) and a 1%-row delta (step 1) into a deltackpt store, and
with ``dcp.save`` as a DCP checkpoint of the same step-1 state. Then, each in a fresh process with
the source files dropped from the page cache first, ``--repeat`` times:

  deltackpt export --to torch / safetensors / dcp   (step 1: replays the base and the delta)
  dcp_to_torch_save                                  (DCP's own DCP -> torch.save conversion)

Each run reports its wall time (the operation only, imports excluded) and the peak resident memory
it added over the process's resident memory right before the operation (``VmHWM`` minus
``VmRSS``). The goal for an export's added memory is the largest tensor + the memory budget +
256 MiB. Every output is checked against the state saved (bit for bit, in the parent, once per
format) and the outputs are removed between runs.

Run: ``python bench/bench_export.py [--scale 0.25] [--repeat 3] [--dir DIR]``.
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
import time

import torch

from common import MiB, evict, figure, json_option, tree_bytes, write_figures

TABLES = 8
ROWS = 524_288
DIM = 128


def make_state(scale: float, seed: int = 0) -> dict:
    rows = max(1, int(ROWS * scale))
    g = torch.Generator().manual_seed(seed)
    tables = {f"t{i}": torch.randn(rows, DIM, generator=g) * 0.01 for i in range(TABLES)}
    accs = {f"t{i}": torch.rand(rows, generator=g) for i in range(TABLES)}
    mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
                              torch.nn.ReLU(), torch.nn.Linear(256, 1))
    dense = {k: v.detach().clone() for k, v in mlp.state_dict().items()}
    moments = {k: (torch.zeros_like(v), torch.zeros_like(v)) for k, v in dense.items()}
    return {"model": {"tables": tables, "dense": dense},
            "optim": {"acc": accs, "exp_avg": {k: m[0] for k, m in moments.items()},
                      "exp_avg_sq": {k: m[1] for k, m in moments.items()}},
            "step": torch.tensor(1)}


def touch_one_percent(state: dict, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, t in state["model"]["tables"].items():
        ids = torch.randperm(t.shape[0], generator=g)[: max(1, t.shape[0] // 100)]
        t[ids] += 1e-4
        state["optim"]["acc"][name][ids] += 0.5


def child(op: str, src: str, out: str, budget: int) -> None:
    """Runs one operation in this (fresh) process and prints its figures as JSON."""
    import torch._subclasses.fake_tensor  # noqa: F401 - imports are not timed, for either side
    import torch.distributed.checkpoint  # noqa: F401
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import deltackpt
    base = _status("VmRSS")
    t0 = time.perf_counter()
    if op == "dcp_to_torch_save":
        dcp_to_torch_save(src, out)
    else:
        deltackpt.export(src, 1, op, out, memory_budget=budget)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")  # not ru_maxrss: Linux carries the parent's over fork and exec
    print(json.dumps({"seconds": seconds, "added": peak - base, "base": base}))


def _status(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:")) * 1024


def run_child(op: str, src: str, out: str, budget: int) -> dict:
    evict(src)
    done = subprocess.run([sys.executable, __file__, "--child", op, src, out, str(budget)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{op} failed:\n{done.stderr}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    figures["bytes"] = tree_bytes(out)
    return figures


def check(op: str, out: str, want: dict) -> None:
    """The output holds the step-1 state bit for bit."""
    from deltackpt.statetree import flatten

    flat = {k: s.local for k, s in flatten(want).tensors.items()}
    if op in ("torch", "dcp_to_torch_save"):
        got = {k: s.local for k, s in flatten(torch.load(out, weights_only=True)).tensors.items()}
    elif op == "safetensors":
        from safetensors.torch import load_file

        got = {k.replace(".", "/"): v for f in os.listdir(out) if f.endswith(".safetensors")
               for k, v in load_file(os.path.join(out, f)).items()}
        flat = {k.replace(".", "/"): v for k, v in flat.items()}
    else:
        from torch.distributed.checkpoint import load

        template = {k: torch.empty_like(v) for k, v in flat.items()}
        nested = _nest(template)
        load(nested, checkpoint_id=out)
        got = {k: s.local for k, s in flatten(nested).tensors.items()}
    for k, v in flat.items():
        if k not in got or not _same(got[k], v):
            raise SystemExit(f"{op}: {k} differs from the state saved")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _nest(flat: dict) -> dict:
    root: dict = {}
    for k, v in flat.items():
        node = root
        *parts, last = k.split("/")
        for p in parts:
            node = node.setdefault(p, {})
        node[last] = v
    return root


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the tables' rows")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--budget", type=int, default=256 * MiB, help="the export's memory budget")
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp folder)")
    json_option(parser)
    args = parser.parse_args()
    import deltackpt
    import torch.distributed.checkpoint as dcp

    scratch = tempfile.mkdtemp(dir=args.dir, prefix="bench_export.")
    try:
        state = make_state(args.scale)
        store, dcp_dir = os.path.join(scratch, "store"), os.path.join(scratch, "dcp")
        with deltackpt.Checkpointer(store) as ckpt:
            ckpt.save(0, state)
            touch_one_percent(state)
            state["step"] += 1
            assert ckpt.save(1, state).kind == "delta"
        dcp.save(state, checkpoint_id=dcp_dir)
        total = sum(t.nbytes for t in _tensors(state))
        largest = max(t.nbytes for t in _tensors(state))
        print(f"state: {total:,} B in {len(_tensors(state))} tensors, largest {largest:,} B; "
              f"budget {args.budget // MiB} MiB; goal for added memory: "
              f"{(largest + args.budget + 256 * MiB) / MiB:.0f} MiB")
        print(f"{'operation':<28} {'seconds (median)':>17} {'all runs':>24} {'added MiB (max)':>16} {'output MiB':>11}")
        times: dict[str, list[float]] = {}
        added: dict[str, list[float]] = {}
        for op in ("dcp_to_torch_save", "torch", "safetensors", "dcp"):
            out = os.path.join(scratch, f"out.{op}")
            src = dcp_dir if op == "dcp_to_torch_save" else store
            runs = []
            for i in range(args.repeat):
                runs.append(run_child(op, src, out, args.budget))
                if i == 0:
                    check(op, out, state)
                shutil.rmtree(out, ignore_errors=True) if os.path.isdir(out) else os.unlink(out)
            secs = [r["seconds"] for r in runs]
            times[op], added[op] = secs, [r["added"] / MiB for r in runs]
            name = f"export --to {op}" if op != "dcp_to_torch_save" else "DCP dcp_to_torch_save"
            print(f"{name:<28} {statistics.median(secs):>17.2f} {' '.join(f'{s:.2f}' for s in secs):>24} "
                  f"{max(r['added'] for r in runs) / MiB:>16.0f} {runs[0]['bytes'] / MiB:>11.0f}", flush=True)
        rows = []
        for op in ("torch", "safetensors", "dcp"):
            rows.append(figure(f"export --to {op}", times[op], peer="DCP dcp_to_torch_save",
                               peer_runs=times["dcp_to_torch_save"]))
            rows.append(figure(f"export --to {op}: memory added (peak RSS - RSS before)", added[op], "MiB",
                               peer="DCP dcp_to_torch_save", peer_runs=added["dcp_to_torch_save"]))
        write_figures(args.json, "bench_export", args, rows, state_bytes=total)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _tensors(state: dict) -> list[torch.Tensor]:
    from deltackpt.statetree import flatten

    return [s.local for s in flatten(state).tensors.values()]


if __name__ == "__main__":
    main()
