"""Start-up cost: ``import deltackpt`` against ``import torch``, and the first save of a fresh process.

Every figure comes from a fresh Python process (timed inside it, so interpreter start-up is not
counted), rounds interleaved, medians reported:

  import      ``import torch`` alone, and ``import deltackpt`` (which imports torch) in another
              process, both from their compiled bytecode (an untimed process writes deltackpt's
              first), and the part of the latter after torch's import; the goal is deltackpt's
              import at most torch's + 0.1 s, that part (torch's own import swings too much from
              process to process for a difference of two processes' medians). Torch's import
              leaves the collector a few young collections short of a full collection of its
              heap, so whatever code allocates a few thousand objects after it pays for that
              (~70 ms here; 200,000 empty dicts right after ``import torch`` took 87 ms, 72 of
              them in that collection): a third process times it (``gc.collect()`` right after
              torch's import) and deltackpt's import after it apart.
  first save  a process that imports deltackpt, builds a ``Checkpointer`` on a fresh folder and
              saves a tiny state (a 256 x 64 float32 table, a bias, a step), then one changed row
              as a delta; beside it, in the same process, the same bytes written to a fresh file
              with fsync of it and its folder (the write time of the save's bytes) and
              ``torch.save`` of the state with fsync. With numba's kernel cache warm (filled by an
              untimed process first) and, unless ``--skip-cold``, empty (``NUMBA_CACHE_DIR`` a
              fresh folder: a fresh install). The goal: the first save at most 0.05 s more than the
              write time of its bytes. A third process runs the same after ``gc.collect()``
              right after its imports: the first save then no longer pays for the full
              collection torch's import left due (see above; whichever allocates first pays it).

Example:
    python bench/bench_startup.py --repeat 5
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

IMPORT = """
import gc, json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
if sys.argv[1] == "collected":
    gc.collect()
t2 = time.perf_counter()
if sys.argv[1] != "torch":
    import deltackpt
t3 = time.perf_counter()
print(json.dumps({"torch": t1 - t0, "collect": t2 - t1, "total": t3 - t0, "after": t3 - t2}))
"""

FIRST_SAVE = """
import gc, json, os, sys, time
import torch
import deltackpt
folder = sys.argv[1]
if sys.argv[2:] == ["collected"]:
    gc.collect()
g = torch.Generator().manual_seed(0)
state = {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g), "step": 1}
t0 = time.perf_counter()
ckpt = deltackpt.Checkpointer(os.path.join(folder, "store"))
info = ckpt.save(0, state)
t1 = time.perf_counter()
state["w"][3] += 1
state["step"] = 2
delta = ckpt.save(1, state)
t2 = time.perf_counter()
ckpt.close()
assert info.kind == "base" and delta.kind == "delta", (info, delta)
data = os.urandom(info.bytes_written)
t3 = time.perf_counter()
with open(os.path.join(folder, "raw"), "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
fd = os.open(folder, os.O_RDONLY)
os.fsync(fd)
os.close(fd)
t4 = time.perf_counter()
with open(os.path.join(folder, "state.pt"), "wb") as f:
    torch.save(state, f)
    f.flush()
    os.fsync(f.fileno())
t5 = time.perf_counter()
print(json.dumps({"first save": t1 - t0, "first delta": t2 - t1, "write": t4 - t3, "torch.save": t5 - t4,
                  "bytes": info.bytes_written}))
"""


def child(code: str, *argv: str, env: dict[str, str] | None = None) -> dict[str, float]:
    """Runs ``code`` in a fresh interpreter; returns the JSON it printed last."""
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                         env=env, check=False)
    if out.returncode:
        raise SystemExit(f"child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def first_save(scratch: str, env: dict[str, str] | None = None, *argv: str) -> dict[str, float]:
    folder = tempfile.mkdtemp(dir=scratch)
    try:
        return child(FIRST_SAVE, folder, *argv, env=env)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=5, help="rounds; medians are reported (default %(default)s)")
    p.add_argument("--skip-cold", action="store_true", help="no first save with an empty kernel cache")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the scratch folder goes")
    json_option(p)
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    scratch = tempfile.mkdtemp(prefix="bench_startup-", dir=args.dir)
    runs: dict[str, list[float]] = {}

    def note(name: str, value: float) -> None:
        runs.setdefault(name, []).append(value)

    try:
        # Untimed: fills numba's cache, warms the page cache of the modules, and writes their
        # bytecode, as a first import does where Python may write it (pip compiles torch's at
        # install; an editable deltackpt's would otherwise compile at every import where
        # PYTHONDONTWRITEBYTECODE is set).
        first_save(scratch, env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"})
        for r in range(args.repeat):
            for lib in (("torch", "deltackpt") if r % 2 else ("deltackpt", "torch")):
                got = child(IMPORT, lib)
                note(f"import {lib}", got["total"])
                if lib == "deltackpt":  # torch's import swings 1.1-1.7 s from process to process
                    note("import deltackpt after torch", got["after"])
            got = child(IMPORT, "collected")
            note("full collection due after torch's import", got["collect"])
            note("import deltackpt after torch and that collection", got["after"])
            warm = first_save(scratch)
            for k in ("first save", "first delta", "write", "torch.save"):
                note(f"{k}, warm kernel cache", warm[k])
            note("bytes of the first save", warm["bytes"])
            collected = first_save(scratch, None, "collected")
            note("first save after that collection, warm kernel cache", collected["first save"])
            note("write after that collection, warm kernel cache", collected["write"])
            if not args.skip_cold:
                cache = tempfile.mkdtemp(dir=scratch)
                cold = first_save(scratch, env=dict(os.environ, NUMBA_CACHE_DIR=cache))
                shutil.rmtree(cache, ignore_errors=True)
                note("first save, empty kernel cache", cold["first save"])
                note("write, empty kernel cache", cold["write"])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    extra = med["import deltackpt after torch"]
    over = med["first save, warm kernel cache"] - med["write, warm kernel cache"]
    over_collected = (med["first save after that collection, warm kernel cache"]
                      - med["write after that collection, warm kernel cache"])
    print(f"medians of {args.repeat} fresh processes each")
    print("| figure | median s | runs | goal |\n|---|---|---|---|")
    goals = {"import deltackpt after torch": f"<= 0.1 s: {'PASS' if extra <= 0.1 else 'MISS'}",
             "first save, warm kernel cache": f"<= write + 0.05 s: {'PASS' if over <= 0.05 else 'MISS'} "
                                              f"(+{over:.3f} s)",
             "first save after that collection, warm kernel cache":
                 f"<= write + 0.05 s: {'PASS' if over_collected <= 0.05 else 'MISS'} (+{over_collected:.3f} s)"}
    for k, v in runs.items():
        print(f"| {k} | {med[k]:.4g} | {', '.join(f'{x:.4g}' for x in v)} | {goals.get(k, '')} |")
    rows = [
        figure("import torch", runs["import torch"]),
        figure("import deltackpt (torch included)", runs["import deltackpt"], peer="import torch",
               peer_runs=runs["import torch"]),
        figure("import deltackpt after torch, same process", runs["import deltackpt after torch"]),
        figure("full collection due after torch's import (gc.collect())",
               runs["full collection due after torch's import"]),
        figure("import deltackpt after torch and that collection, same process",
               runs["import deltackpt after torch and that collection"]),
        figure("first save of a fresh process, warm kernel cache", runs["first save, warm kernel cache"],
               peer="write + fsync of its bytes", peer_runs=runs["write, warm kernel cache"]),
        figure("first save of a fresh process after the collection due, warm kernel cache",
               runs["first save after that collection, warm kernel cache"], peer="write + fsync of its bytes",
               peer_runs=runs["write after that collection, warm kernel cache"]),
        figure("first delta of a fresh process", runs["first delta, warm kernel cache"]),
        figure("torch.save + fsync of the same state", runs["torch.save, warm kernel cache"]),
    ]
    if not args.skip_cold:
        rows.append(figure("first save of a fresh process, empty kernel cache", runs["first save, empty kernel cache"],
                           peer="write + fsync of its bytes", peer_runs=runs["write, empty kernel cache"]))
    write_figures(args.json, "bench_startup", args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
