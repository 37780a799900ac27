"""``python -m bench``: every bench of ``bench/`` at one size, its figures written to ``bench/results/``.

Each bench runs as its own process (``python bench/<bench>.py <options of the size> --json FILE``),
one after the other, so a bench stays runnable alone and a crash or a hang in one does not stop
the others. Every bench times deltackpt and its peers (the disk, memcpy, xxhash, ``torch.save``,
DCP, ...) alternately in the same process and reports medians of at least 3 rounds. Then:

* ``RESULTS/<bench>.json``: the bench's figures (rows of median, every round, the peer and the
  ratio), the data behind the plots, its options, the command, the date, the machine (CPUs,
  memory, load average before and after) and the versions (deltackpt's commit, torch, numpy, ...);
  a bench that failed or was skipped says so with the end of its output;
* ``RESULTS/summary.md``: the key figures first, then every bench's rows, of every bench's last
  results in ``RESULTS`` (a run with ``--only`` adds to those an earlier run left);
* ``RESULTS/*.png`` (matplotlib, the ``bench`` extra): delta bytes and time against the change
  fraction, restore time against the chain length, base save time against the state size beside
  the disk's write bandwidth.

Sizes: ``--quick`` (6 minutes on an idle 2-core machine, 40 at load 11-20), the full size by default
(the benches' own defaults: 30 to 42 minutes on an idle 2-core machine), ``--size tiny`` (seconds
per bench: for the test that keeps this command working). ``--only`` and ``--skip`` take bench
names. A bench whose modules do not import (TorchRec, SeaweedFS, DCP's s3fs) is skipped with the
reason.

Example:
    python -m bench --quick
    python -m bench --only bench_save,bench_chains --out /tmp/results
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = "bench/results"  # the default --out, from ROOT
SIZES = ("tiny", "quick", "full")


@dataclass(frozen=True)
class Bench:
    """One bench script and the options it runs with at each size.

    Attributes:
        name: the script's stem (``bench/<name>.py``).
        sizes: per size, the option lists of its runs (one process per list; several lists run it
            at several sizes, e.g. bench_save for the base-save-vs-state-size plot).
        needs: modules that must import, or a ``bin:NAME`` executable on PATH; else it is skipped.
        takes_dir: whether it takes ``--dir`` (the folder its scratch folder goes in).
    """

    name: str
    sizes: dict[str, tuple[tuple[str, ...], ...]]
    needs: tuple[str, ...] = field(default=())
    takes_dir: bool = True


def _same(args: str, *more: str) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(shlex.split(a)) for a in (args, *more))


BENCHES: tuple[Bench, ...] = (
    Bench("bench_startup", {
        "tiny": _same("--repeat 3 --skip-cold"),
        "quick": _same("--repeat 3"),
        "full": _same("--repeat 5"),
    }),
    Bench("bench_kernels", {
        "tiny": _same("--size-mib 8 --repeats 3 --mask-rows 100000 --mark-ids 10000 --collision-rows 10000 "
                      "--piece-rows 10000"),
        "quick": _same("--size-mib 128 --repeats 5 --collision-rows 1000000"),
        "full": _same(""),
    }, takes_dir=False),
    Bench("bench_save", {
        "tiny": _same("--rows 4096 --dim 64 --repeat 3", "--rows 16384 --dim 64 --repeat 3"),
        "quick": _same("--rows 131072 --dim 128 --repeat 3", "--rows 262144 --dim 128 --repeat 3",
                       "--rows 524288 --dim 128 --repeat 3"),
        "full": _same("--rows 1048576 --repeat 3", "--rows 2097152 --repeat 3", "--repeat 3"),
    }),
    Bench("bench_memory", {
        "tiny": _same("--tables 2 --rows 8192 --dim 32 --repeat 3"),
        "quick": _same("--tables 4 --rows 65536 --dim 64 --repeat 3"),
        "full": _same("--repeat 3"),
    }),
    Bench("bench_tracking", {
        "tiny": _same("--tables 2 --rows 20000 --dim 32 --batch 256 --steps 3 --hash-mib 8 --repeat 3 "
                      "--fractions 0.001,0.01,0.05,0.2,0.5 --optimizer rowwise"),
        "quick": _same("--tables 4 --rows 100000 --dim 32 --batch 1024 --steps 5 --hash-mib 64 --repeat 3 "
                       "--fractions 0.001,0.01,0.05,0.2,0.5 --optimizer rowwise"),
        "full": _same("--fractions 0.001,0.01,0.05,0.2,0.5 --optimizer rowwise"),
    }),
    Bench("bench_chains", {
        "tiny": _same("--rows 20000 --dim 32 --chain-lengths 0,4 --policy-rows 5000 --checkpoints 12 --repeat 3"),
        "quick": _same("--rows 262144 --dim 64 --chain-lengths 0,4,10,16,64 --policy-rows 65536 "
                       "--checkpoints 50 --repeat 3"),
        # Then the chains of issue 14's state: its bytes in one table, 1 % of rows a delta, uniformly.
        "full": _same("--chain-lengths 0,4,10,16,64",
                      "--parts chains --rows 4194304 --dim 128 --touched 0.01 --zipf 0 "
                      "--chain-lengths 0,4,10,16,64"),
    }),
    Bench("bench_distributed", {
        "tiny": _same("--tables 2 --rows 4096 --dim 32 --repeat 3 --worlds 1"),
        "quick": _same("--tables 4 --rows 131072 --dim 64 --repeat 3 --worlds 1,4"),
        "full": _same("--repeat 3"),
    }),
    Bench("bench_busy", {
        "tiny": _same("--tables 2 --rows 20000 --dim 32 --dense-mib 4 --dirty-gib 0.05 --repeat 3"),
        "quick": _same("--tables 4 --rows 250000 --dim 32 --dense-mib 32 --dirty-gib 0.5 --repeat 3"),
        "full": _same("--repeat 3"),
    }),
    Bench("bench_async", {
        "tiny": _same("--tables 2 --rows 8192 --dim 32 --steps 3 --repeat 3"),
        "quick": _same("--tables 4 --rows 65536 --dim 64 --steps 5 --repeat 3"),
        # The tracked model of bench_tracking, then the 2.2 GB state (the key figures' run).
        "full": _same("--model tracking --repeat 3", "--repeat 3"),
    }),
    Bench("bench_small_tensors", {
        "tiny": _same("--tensors 200 --repeat 3"),
        "quick": _same("--tensors 5000 --repeat 3"),
        "full": _same("--repeat 3"),
    }),
    Bench("bench_quant", {
        "tiny": _same("--rows 4096 --repeat 3 --table-rows 4096 --checkpoints 8 --parts kernels,store"),
        "quick": _same("--rows 65536 --repeat 3 --table-rows 16384 --checkpoints 50 --dlrm-steps 20"),
        "full": _same(""),
    }),
    Bench("bench_export", {
        "tiny": _same("--scale 0.002 --repeat 3"),
        "quick": _same("--scale 0.05 --repeat 3"),
        "full": _same("--repeat 3"),
    }),
    Bench("bench_control_plane", {
        "tiny": _same("--world 8 --tensors 10"),
        "quick": _same("--world 128 --tensors 100"),
        "full": _same("--world 1024 --tensors 1000"),
    }, takes_dir=False),
    Bench("bench_codecs", {
        "tiny": _same("--rows 2000 --repeat 3"),
        "quick": _same("--rows 20000 --repeat 3"),
        "full": _same("--repeat 3"),
    }, takes_dir=False),
    Bench("bench_s3", {
        "tiny": _same("--tables 2 --rows 4096 --rounds 3 --targets s3,local"),
        "quick": _same("--tables 4 --rows 32768 --rounds 3"),
        "full": _same("--rounds 3"),
    }, needs=("obstore", "bin:weed"), takes_dir=False),  # its scratch folder: $BENCH_DIR
    Bench("bench_torchrec", {
        "tiny": _same("--tables 3 --rows 4096 --dim 16 --repeat 3"),
        "quick": _same("--tables 4 --rows 65536 --dim 64 --repeat 3"),
        "full": _same("--repeat 3"),
    }, needs=("torchrec",)),
)


def missing(bench: Bench) -> list[str]:
    """The modules or executables ``bench`` needs that are not there (an executable on the PATH
    or beside this Python's, as pip installs one into a virtual environment not activated)."""
    out = []
    for need in bench.needs:
        if need.startswith("bin:"):
            name = need[4:]
            beside = os.path.join(os.path.dirname(sys.executable), name)
            if shutil.which(name) is None and not os.path.exists(beside):
                out.append(need)
        elif importlib.util.find_spec(need) is None:
            out.append(need)
    return out


def machine() -> dict[str, Any]:
    """CPUs, memory and load of this machine."""
    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version(), "load_average": os.getloadavg()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
        with open("/proc/meminfo") as f:
            info["memory_bytes"] = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    return info


def versions() -> dict[str, Any]:
    """deltackpt's commit and the versions of the libraries the figures depend on."""
    out: dict[str, Any] = {}
    for name in ("torch", "numpy", "zarr", "numcodecs", "numba", "xxhash", "triton", "torchrec", "obstore"):
        try:
            from importlib.metadata import version

            out[name] = version(name)
        except Exception:  # noqa: BLE001 - not installed
            out[name] = None
    git = ["git", "-C", ROOT]
    try:
        out["deltackpt_commit"] = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                                                 check=True).stdout.strip()
        # Changes to tracked files but the results a run writes as it goes (bench/results).
        out["deltackpt_dirty"] = bool(subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no", "--", ".", f":(exclude){RESULTS}"],
            capture_output=True, text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        out["deltackpt_commit"] = None
    return out


def run_bench(bench: Bench, size: str, scratch: str, timeout: float) -> dict[str, Any]:
    """Runs every option list of ``bench`` at ``size``; returns its result document."""
    doc: dict[str, Any] = {"bench": bench.name, "size": size,
                           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           "machine": machine(), "runs": []}
    lost = missing(bench)
    if lost:
        doc.update(status="skipped", error=f"not installed: {', '.join(lost)}")
        return doc
    t0 = time.perf_counter()
    env = dict(os.environ, BENCH_DIR=scratch, PYTHONUNBUFFERED="1")
    for i, options in enumerate(bench.sizes[size]):
        out = os.path.join(scratch, f"{bench.name}.{i}.json")
        script = [os.path.join("bench", f"{bench.name}.py"), *options]
        if bench.name == "bench_chains":  # its policy plot goes beside the other plots
            script += ["--out", os.path.join(scratch, "chains.png")]
        if bench.takes_dir:
            script += ["--dir", scratch]
        cmd = [sys.executable, *script, "--json", out]
        print(f"$ python {shlex.join(script)}", flush=True)
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            status, text = ("ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})",
                            proc.stdout + proc.stderr)
        except subprocess.TimeoutExpired as e:
            status = f"timed out after {timeout:.0f} s"
            text = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        run: dict[str, Any] = {"command": shlex.join(["python", *script]), "status": status}
        if status == "ok" and os.path.exists(out):
            with open(out) as f:
                run.update(json.load(f))
        else:
            run["status"] = status if status != "ok" else "no figures written"
            run["output_tail"] = text[-3000:]
        doc["runs"].append(run)
    doc["wall_s"] = time.perf_counter() - t0
    doc["load_average_after"] = os.getloadavg()
    doc["status"] = "ok" if all(r["status"] == "ok" for r in doc["runs"]) else "failed"
    return doc


# -- the summary ------------------------------------------------------------------------------------

KEY: tuple[tuple[str, tuple[str, ...]], ...] = (
    # (bench, name prefixes of its rows shown first in summary.md and the README)
    ("bench_kernels", ("memcpy", "xxhash.xxh3_64", "hash_rows 512 B rows, 1 thread")),
    ("bench_save", ("disk write", "disk read", "deltackpt base save", "deltackpt 1% delta save",
                    "deltackpt load base step", "deltackpt restore", "1% delta bytes")),
    ("bench_distributed", ("deltackpt base save", "deltackpt 1% delta save", "deltackpt 1% delta bytes",
                           "deltackpt restore")),
    ("bench_memory", ("deltackpt", "DCP load")),
    ("bench_tracking", ("marking per step",) + tuple(f"{f} delta" for f in ("0.1%", "1.0%", "5.0%", "20.0%", "50.0%"))),
    ("bench_chains", ("restore after",)),
    ("bench_startup", ("",)),
    ("bench_busy", ("1% delta", "base save")),
    ("bench_async", ("base background: blocked", "base background right after track()",
                     "base background, long after the first", "1% delta background: blocked",
                     "1% delta background, long after a base",
                     "1% delta background, every table audited", "1% delta background: training time lost",
                     "first background save", "train step beside")),
    ("bench_small_tensors", ("base save", "one-row delta", "next delta", "load", "restore after 10 deltas")),
    ("bench_quant", ("incremental only, 8-bit", "8-bit encode")),
    ("bench_export", ("export",)),
    ("bench_control_plane", ("1: plan_global (coordinator)", "1: record_root (coordinator)", "ls of",
                             "root record of save")),
    ("bench_s3", ("deltackpt s3",)),
    ("bench_torchrec", ("delta save", "restore on plan B")),
)


def _num(x: float | None, unit: str = "") -> str:
    if x is None:
        return ""
    if unit == "B" or abs(x) >= 1e5:
        return f"{x:,.0f}"
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def _row_line(bench: str, r: dict[str, Any], many: bool, state: int | None) -> str:
    where = f" ({state / 1e6:,.0f} MB)" if many and state else ""
    ratio = "" if r.get("ratio") is None else f"{r['ratio']:.3g}"
    runs = ", ".join(_num(v, r["unit"]) for v in r["runs"]) if len(r["runs"]) > 1 else ""
    return (f"| {bench} | {r['name']}{where} | {_num(r['median'], r['unit'])} {r['unit']} | "
            f"{r.get('peer', '')} | {_num(r.get('peer_median'), r['unit'])} | {ratio} | {runs} |")


HEADER = ("| bench | figure | median | peer | peer median | ratio | runs |\n"
          "|---|---|---:|---|---:|---:|---|")


def results(out: str) -> list[dict[str, Any]]:
    """The results each bench's last run left in the folder ``out``, in :data:`BENCHES`' order."""
    docs = []
    for b in BENCHES:
        path = os.path.join(out, f"{b.name}.json")
        if os.path.exists(path):
            with open(path) as f:
                docs.append(json.load(f))
    return docs


def _grouped(docs: list[dict[str, Any]], what: Callable[[dict[str, Any]], str]) -> str:
    """``what(doc)`` of the docs, each distinct value once, with the benches it holds for when
    they differ."""
    groups: dict[str, list[str]] = {}
    for d in docs:
        groups.setdefault(what(d), []).append(d["bench"])
    return "; ".join(v if len(groups) == 1 else f"{v} ({', '.join(b)})" for v, b in groups.items())


def summary(docs: list[dict[str, Any]]) -> str:
    """The markdown of ``summary.md`` of bench results (each with the command that ran it): the
    key figures, then every bench's rows and its status."""
    first = docs[0] if docs else {}
    ver = first.get("versions", {})

    def commit(d: dict[str, Any]) -> str:
        v = d.get("versions", {})
        return f"{(v.get('deltackpt_commit') or '?')[:10]}{' (uncommitted changes)' if v.get('deltackpt_dirty') else ''}"

    dates = sorted(d.get("date", "?") for d in docs) or ["?"]
    when = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
    commands = _grouped(docs, lambda d: f"`{d.get('command', '?')}`")
    lines = [f"# Bench results\n\n{commands} from {when}; deltackpt {_grouped(docs, commit)}; "
             f"torch {ver.get('torch')}; {first.get('machine', {}).get('cpus')} CPUs "
             f"({first.get('machine', {}).get('cpu')}), load average at the start "
             f"{', '.join(f'{x:.1f}' for x in first.get('machine', {}).get('load_average', ()))}.\n",
             "Medians over the rounds (every round in the last column); ratio = median / the peer's median "
             "measured in the same run (< 1: deltackpt is faster or smaller).\n",
             "## Key figures\n", "Of a bench run at several sizes, the largest.\n", HEADER]
    by_name = {d["bench"]: d for d in docs}
    for bench, prefixes in KEY:
        doc = by_name.get(bench)
        runs = [r for r in doc["runs"] if r["status"] == "ok"] if doc else []
        if runs:  # the last run: of a bench run at several sizes, the largest
            for r in runs[-1]["rows"]:
                if any(r["name"].startswith(p) for p in prefixes):
                    lines.append(_row_line(bench, r, len(runs) > 1, runs[-1]["series"].get("state_bytes")))
    lines.append("\n## Status\n\n| bench | status | wall s | commands |\n|---|---|---:|---|")
    for d in docs:
        cmds = "; ".join(f"`{r['command']}`" if "command" in r else "" for r in d["runs"])
        lines.append(f"| {d['bench']} | {d['status']}{': ' + d['error'] if d.get('error') else ''} | "
                     f"{d.get('wall_s', 0):.0f} | {cmds} |")
    for d in docs:
        lines.append(f"\n## {d['bench']}\n")
        for run in d["runs"]:
            if run["status"] != "ok":
                tail = run.get("output_tail", "").strip().splitlines()[-5:]
                lines.append(f"`{run.get('command', '')}`: {run['status']}\n\n```\n" + "\n".join(tail) + "\n```\n")
                continue
            lines += [f"`{run['command']}`\n", HEADER]
            lines += [_row_line(d["bench"], r, False, None) for r in run["rows"]]
            lines.append("")
    return "\n".join(lines) + "\n"


# -- the plots --------------------------------------------------------------------------------------


def _series(docs: dict[str, dict[str, Any]], bench: str) -> list[dict[str, Any]]:
    doc = docs.get(bench)
    return [r["series"] for r in (doc["runs"] if doc else ()) if r["status"] == "ok"]


def plots(docs: dict[str, dict[str, Any]], out: str) -> list[str]:
    """Writes the PNG plots whose data the benches gave; returns their paths."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    written = []

    def save(fig: Figure, name: str) -> None:
        path = os.path.join(out, name)
        fig.tight_layout()
        FigureCanvasAgg(fig).print_png(path)
        written.append(path)

    for s in _series(docs, "bench_tracking"):
        fig = Figure(figsize=(10, 4))
        t, b = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
        x = [100 * f for f in s["fraction"]]
        t.plot(x, s["marks_s"], "o-", label="deltackpt, marks")
        t.plot(x, s["hashes_s"], "s-", label="deltackpt, hashing")
        t.plot(x, s["torch_save_s"], "k--", label="torch.save + fsync (whole state)")
        t.set(xscale="log", yscale="log", xlabel="rows changed (%)", ylabel="delta save (s)",
              title=f"delta save time, {s['state_bytes'] / 1e6:,.0f} MB state")
        b.plot(x, s["marks_bytes"], "o-", label="deltackpt, marks")
        b.plot(x, s["hashes_bytes"], "s-", label="deltackpt, hashing")
        b.plot(x, s["changed_row_bytes"], "k--", label="changed rows x (row bytes + 8)")
        b.set(xscale="log", yscale="log", xlabel="rows changed (%)", ylabel="bytes written",
              title="delta bytes")
        for ax in (t, b):
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        save(fig, "delta_vs_fraction.png")
    for s in _series(docs, "bench_chains"):
        if "chain_length" not in s:
            continue
        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        ax.plot(s["chain_length"], s["restore_s"], "o-", label="restore, chain replayed")
        ax.plot(s["chain_length"], s["restore_compacted_s"], "s-", label="restore after compaction")
        ax.set(xlabel="deltas in the chain", ylabel="restore (s)", title="restore time vs chain length",
               ylim=(0, None))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, "restore_vs_chain.png")
    saves = sorted(_series(docs, "bench_save"), key=lambda s: s["state_bytes"])
    if saves:
        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        gb = [s["state_bytes"] / 1e9 for s in saves]
        bw = statistics.median(s["state_bytes"] / s["disk_write_s"] for s in saves) / 1e9
        ax.plot(gb, [s["base_save_s"] for s in saves], "o-", label="deltackpt base save")
        ax.plot(gb, [s["torch_save_s"] for s in saves], "s-", label="torch.save + fsync")
        ax.plot([0, max(gb)], [0, max(gb) / bw], "k--", label=f"disk write + fsync, {bw:.2f} GB/s")
        ax.set(xlabel="state (GB)", ylabel="seconds", title="base save vs state size", xlim=(0, None),
               ylim=(0, None))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, "base_vs_size.png")
    return written


# -- the command ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    # Both options set "size": each must carry the default, or the first one's (None) wins.
    p.add_argument("--quick", action="store_const", const="quick", dest="size", default="full",
                   help="the quick sizes (minutes in all)")
    p.add_argument("--size", choices=SIZES, default="full", help="the size to run (default: full)")
    p.add_argument("--only", default="", help="comma-separated bench names to run (default: all)")
    p.add_argument("--skip", default="", help="comma-separated bench names not to run")
    p.add_argument("--out", default=os.path.join(ROOT, RESULTS), help=f"results folder (default {RESULTS})")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the benches' scratch folder goes")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds a bench process may run (default: 900 quick or tiny, 5400 full)")
    args = p.parse_args(argv)
    names = {b.name for b in BENCHES}
    for opt in ("only", "skip"):
        picked = {x for x in getattr(args, opt).split(",") if x}
        if picked - names:
            p.error(f"--{opt}: no bench named {', '.join(sorted(picked - names))}; have {', '.join(sorted(names))}")
        setattr(args, opt, picked)
    if args.timeout is None:
        args.timeout = 5400.0 if args.size == "full" else 900.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)])
    os.makedirs(args.out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="deltackpt-bench-", dir=args.dir)
    docs = []
    try:
        for bench in BENCHES:
            if (args.only and bench.name not in args.only) or bench.name in args.skip:
                continue
            ver = versions()  # before the run: the code it measured
            doc = run_bench(bench, args.size, scratch, args.timeout)
            doc.update(command=command, versions=ver)
            with open(os.path.join(args.out, f"{bench.name}.json"), "w") as f:
                json.dump(doc, f, indent=1, default=str)
                f.write("\n")
            print(f"{bench.name}: {doc['status']}{': ' + doc['error'] if doc.get('error') else ''} "
                  f"({doc.get('wall_s', 0):.0f} s)", flush=True)
            docs.append(doc)
        if os.path.exists(os.path.join(scratch, "chains.png")):
            shutil.copy(os.path.join(scratch, "chains.png"), os.path.join(args.out, "chains_policies.png"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    latest = results(args.out)  # this run's and those earlier runs left of the benches it skipped
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(summary(latest))
    for path in plots({d["bench"]: d for d in latest}, args.out):
        print(f"plot: {path}")
    print(f"summary: {os.path.join(args.out, 'summary.md')}")
    return 0 if all(d["status"] in ("ok", "skipped") for d in docs) else 1


if __name__ == "__main__":
    sys.exit(main())
