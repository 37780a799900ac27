"""What ``deltackpt demo`` prints (lines or one JSON object per line) and the plot it draws.

Lines go through ``tqdm.write``, so a progress bar on a terminal's stderr never breaks them; the
bar is shown only when stderr is a terminal.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from ..checkpointer import SaveInfo
from ..sizes import fmt_bytes


class Output:
    """The demo's output: text lines, or JSON objects with an ``"event"`` field.

    Events, in order: ``start``, one ``checkpoint`` per save, ``trained``, ``restore`` (the
    ranks), ``resume``, ``done``.
    """

    def __init__(self, *, as_json: bool):
        self.as_json = as_json

    def _emit(self, event: str, doc: dict[str, Any], text: str | Sequence[str]) -> None:
        if self.as_json:
            tqdm.write(json.dumps({"event": event, **doc}), file=sys.stdout)
            return
        for line in [text] if isinstance(text, str) else text:
            tqdm.write(line, file=sys.stdout)

    def progress(self, total: int, desc: str) -> tqdm:
        """A step-counting bar on stderr, only if stderr is a terminal."""
        return tqdm(total=total, desc=desc, unit="step", leave=False, file=sys.stderr,
                    dynamic_ncols=True, disable=not sys.stderr.isatty())

    def start(self, args: argparse.Namespace, store: str, rows: int, threads: int) -> None:
        doc = {"store": store, "tables": 26, "rows": rows, "dim": args.dim, "scale": args.scale,
               "batch_size": args.batch_size, "steps": args.steps, "every": args.every,
               "base_every": args.base_every, "optimizer": args.optimizer, "ranks": args.ranks,
               "threads": threads}
        opt = {"adagrad": "Adagrad", "sgd": "SGD", "sparse_adam": "SparseAdam"}[args.optimizer]
        self._emit("start", doc, [
            f"deltackpt demo: DLRM with 26 embedding tables, {rows:,} rows x {args.dim} "
            f"(Criteo Kaggle sizes x {args.scale:g}); {opt} on the tables, Adam on the MLPs",
            f"training {args.steps} steps of {args.batch_size} samples on {threads} CPU "
            f"thread{'s' if threads > 1 else ''}, "
            f"a checkpoint every {args.every} steps, a base every {args.base_every} checkpoints",
            f"store: {store}",
            "",
            f"{'step':>6}  {'kind':<5}  {'table rows changed':>18}  {'written':>10}  "
            f"{'full ckpt':>10}  {'smaller':>7}  {'save':>7}  {'blocked':>7}",
        ])

    def checkpoint(self, info: SaveInfo, rows_changed: int, rows_total: int) -> dict[str, Any]:
        doc = {"step": info.step, "kind": info.kind, "rows_changed": rows_changed,
               "rows_total": rows_total, "bytes_written": info.bytes_written,
               "full_bytes": info.state_bytes,
               "ratio": round(info.state_bytes / max(1, info.bytes_written), 2),
               "seconds": round(info.seconds, 4), "blocked_seconds": round(info.blocked_seconds, 4)}
        share = 100 * rows_changed / rows_total
        self._emit("checkpoint", doc,
                   f"{info.step:>6}  {info.kind:<5}  {rows_changed:>10,} {share:>5.1f} %"
                   f"  {fmt_bytes(info.bytes_written):>10}  {fmt_bytes(info.state_bytes):>10}"
                   f"  {doc['ratio']:>6.1f}x  {info.seconds:>5.2f} s  {info.blocked_seconds:>5.2f} s")
        return doc

    def trained(self, steps: int, seconds: float, saves: list[dict[str, Any]]) -> None:
        written = sum(s["bytes_written"] for s in saves)
        full = sum(s["full_bytes"] for s in saves)
        save_s = sum(s["seconds"] for s in saves)
        blocked_s = sum(s["blocked_seconds"] for s in saves)
        deltas = [s for s in saves if s["kind"] == "delta"]
        doc = {"steps": steps, "seconds": round(seconds, 3), "save_seconds": round(save_s, 3),
               "blocked_seconds": round(blocked_s, 3),
               "checkpoints": len(saves), "bytes_written": written, "full_bytes": full}
        lines = ["",
                 f"trained {steps} steps in {seconds:.1f} s, blocked {blocked_s:.1f} s of it by "
                 f"{len(saves)} saves ({save_s:.1f} s from call to commit); wrote {fmt_bytes(written)} where full checkpoints write "
                 f"{fmt_bytes(full)} ({full / max(1, written):.1f}x less)"]
        if deltas:
            frac = sum(s["rows_changed"] for s in deltas) / sum(s["rows_total"] for s in deltas)
            ratio = (sum(s["full_bytes"] for s in deltas)
                     / max(1, sum(s["bytes_written"] for s in deltas)))
            lines.append(f"a delta writes {ratio:.1f}x less than a full checkpoint on average, "
                         f"with {100 * frac:.1f} % of table rows changed per interval")
        self._emit("trained", doc, lines)

    def restored(self, step: int, chain: list[int], saves: list[dict[str, Any]],
                 ranks: list[dict[str, Any]], ok: bool, seconds: float) -> None:
        kind = next(s["kind"] for s in saves if s["step"] == step)
        doc = {"step": step, "kind": kind, "chain": chain, "ranks": len(ranks), "bit_exact": ok,
               "seconds": round(seconds, 3), "per_rank": ranks}
        lines = [f"restored step {step} ({kind}, chain {' -> '.join(map(str, chain))}) on "
                 f"{len(ranks)} rank{'s' if len(ranks) > 1 else ''}, each reading its rows of "
                 f"every tensor: {'bit-exact' if ok else 'MISMATCH'} against the state saved "
                 f"at step {step}"]
        for r in ranks:
            if "error" in r:
                lines.append(f"  rank {r['rank']}: failed: {r['error']}")
                continue
            bad = f"; differs: {', '.join(r['mismatched'])}" if r["mismatched"] else ""
            lines.append(f"  rank {r['rank']}: {r['table_rows']:,} table rows, "
                         f"{fmt_bytes(r['bytes'])} restored in {r['seconds']:.2f} s{bad}")
        lines.append(f"  {seconds:.1f} s in all, starting the processes and checking included")
        self._emit("restore", doc, lines)

    def resumed(self, r: dict[str, Any]) -> None:
        doc = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
        doc["bit_exact"] = doc.pop("ok")
        at = "bit-exact" if not r["mismatched_at_step"] else \
            f"MISMATCH in {', '.join(r['mismatched_at_step'])}"
        end = (f"all {r['tensors']} tensors of model and optimizer state "
               f"({fmt_bytes(r['bytes'])}) match the uninterrupted run bit for bit"
               if not r["mismatched"] else
               f"MISMATCH with the uninterrupted run in {', '.join(r['mismatched'])}")
        self._emit("resume", doc, [
            f"restored step {r['step']} on 1 rank into a model built from another seed in "
            f"{r['restore_seconds']:.2f} s: {at}",
            f"resumed training to step {r['until']} in {r['train_seconds']:.1f} s: {end}"])

    def quantized(self, result: dict[str, Any]) -> None:
        saves = result["saves"]
        written = sum(s["bytes_written"] for s in saves)
        full = sum(s["full_bytes"] for s in saves)
        deltas = [s for s in saves if s["kind"] == "delta"]
        ratio = sum(s["full_bytes"] for s in deltas) / max(1, sum(s["bytes_written"] for s in deltas))
        doc = {k: v for k, v in result.items() if k != "saves"}
        doc.update(bytes_written=written, full_bytes=full)
        verdict = ("within the bound" if result["ok"]
                   else f"OUT OF BOUND: {', '.join(result['out_of_bound'])}")
        self._emit("quantized", doc, [
            "",
            f"with {result['scheme']} deltas (bases exact): wrote {fmt_bytes(written)} where full "
            f"checkpoints write {fmt_bytes(full)} ({full / max(1, written):.1f}x less); a delta "
            f"writes {ratio:.1f}x less than a full checkpoint on average",
            f"restored step {result['step']}: {result['lossy_tensors']} lossy tensors, worst error "
            f"{result['worst_error']:.3g}, recorded bound {result['bound']:.3g}: {verdict}; every "
            f"other tensor bit for bit"])

    def done(self, store: str, plot: str, ok: bool, seconds: float) -> None:
        self._emit("done", {"store": store, "plot": plot, "bit_exact": ok,
                            "seconds": round(seconds, 3)}, [
            "",
            f"store: {store}  (try: deltackpt ls {store})",
            f"plot:  {plot}",
            f"{'all checks passed' if ok else 'CHECKS FAILED'} in {seconds:.1f} s"])


def plot_bytes(path: str, saves: list[dict[str, Any]], args: argparse.Namespace,
               quantized: list[dict[str, Any]] | None = None) -> None:
    """Bytes written per checkpoint against a full checkpoint, and their running totals, as a PNG;
    with ``quantized``, the same run's checkpoints with quantized deltas beside them.

    Uses matplotlib's Agg canvas directly, leaving pyplot and the global backend alone.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    mib = float(1 << 20)
    steps = [s["step"] for s in saves]
    written = [s["bytes_written"] / mib for s in saves]
    full = [s["full_bytes"] / mib for s in saves]
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    width = 0.7 * args.every
    colors = ["tab:blue" if s["kind"] == "base" else "tab:orange" for s in saves]
    left.bar(steps, written, width=width, color=colors)
    edges = [steps[0] - width, *steps, steps[-1] + width]
    left.plot(edges, [full[0], *full, full[-1]], drawstyle="steps-mid", color="black",
              linestyle="--", linewidth=1)
    for s, w, f, kind in zip(steps, written, full, (s["kind"] for s in saves)):
        if kind == "delta":
            left.annotate(f"{f / max(w, 1e-9):.0f}x", (s, w), textcoords="offset points",
                          xytext=(0, 3), ha="center", fontsize=8)
    # Bars on a log axis grow from its bottom: put it well below the smallest delta.
    left.set_yscale("log")
    left.set_ylim(min(written) / 8, max(full) * 20)  # room for the legend above the bars
    left.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    if len(steps) <= 16:
        left.set_xticks(steps)
        right.set_xticks(steps)
    left.set_xlabel("training step")
    left.set_ylabel("MiB written (log scale)")
    left.set_title("bytes per checkpoint (delta: x times smaller than full)")
    left.legend(handles=[Patch(color="tab:blue", label="base (full)"),
                         Patch(color="tab:orange", label="delta (changed rows and chunks)"),
                         Line2D([], [], color="black", linestyle="--", label="a full checkpoint"),
                         *([Line2D([], [], color="tab:red", marker="_", linestyle="",
                                   label=f"{args.quantize}-bit deltas")] if quantized else [])],
                loc="upper center", ncols=4 if quantized else 3, fontsize=8)
    total_w, total_f, acc_w, acc_f = [], [], 0.0, 0.0
    for w, f in zip(written, full):
        acc_w, acc_f = acc_w + w, acc_f + f
        total_w.append(acc_w)
        total_f.append(acc_f)
    right.plot(steps, total_f, marker="o", markersize=3, color="black", linestyle="--",
               label="full checkpoints")
    right.plot(steps, total_w, marker="o", markersize=3, color="tab:orange",
               label="deltackpt (bases + deltas)")
    if quantized:
        q_steps = [s["step"] for s in quantized]
        q_written = [s["bytes_written"] / mib for s in quantized]
        left.scatter(q_steps, q_written, marker="_", s=120, color="tab:red", zorder=3)
        acc = 0.0
        q_total = [acc := acc + w for w in q_written]
        right.plot(q_steps, q_total, marker="o", markersize=3, color="tab:red",
                   label=f"{args.quantize}-bit deltas (bases exact): {total_f[-1] / max(q_total[-1], 1e-9):.1f}x less")
    right.set_xlabel("training step")
    right.set_ylabel("MiB written in total")
    right.set_title(f"written in total: {total_f[-1] / max(total_w[-1], 1e-9):.1f}x less")
    right.legend(loc="upper left", fontsize=8)
    rows = saves[0]["rows_total"]
    fig.suptitle(f"deltackpt demo: DLRM, {rows:,} embedding rows x {args.dim}, a checkpoint every "
                 f"{args.every} steps, a base every {args.base_every}")
    fig.savefig(path, dpi=110)
