"""``deltackpt demo``: the main job. Trains the example DLRM with delta checkpoints, then restores.

1. Trains :class:`~deltackpt.examples.DLRM` on the Criteo-like stream of
   :mod:`deltackpt.datasets` on the CPU, saving through a :class:`~deltackpt.CheckpointHook`
   every ``--every`` steps (rows tracked from the lookups), a base every ``--base-every`` saves,
   into a fresh run folder under ``--path``; one line per checkpoint.
2. Restores a delta from the middle of the run on ``--ranks`` spawned gloo ranks, each filling
   its row-wise shard of every tensor through ``Checkpointer(..., process_group=...).restore``,
   and checks each shard bit for bit against a copy of the state taken when that step was saved.
3. Restores the same step on one rank (this process) into a model built from another seed,
   trains on to the end and checks every tensor of model and optimizer state against the
   uninterrupted run, bit for bit.
4. Plots the bytes of each checkpoint against a full checkpoint (``checkpoint-bytes.png``).

Exits 1 if any check fails. Run ``deltackpt demo --help`` for the options.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

from .. import statetree
from ..checkpointer import Checkpointer, SaveInfo
from ..datasets import CriteoConfig
from ..errors import DeltackptError
from ..hooks import CheckpointHook
from ..quantization import Rowwise
from ..save.pending import SaveHandle
from ..storage import storage_options
from . import SPARSE_OPTIMIZERS, deterministic, dlrm_run, train
from . import demo_report as report
from .demo_ranks import restore_on_ranks
from .snapshots import Snapshot, differences, same_bits, snapshot

THREADS = 1
"""Intra-op threads while training: the DLRM's ops are small, so more threads cost more than they
give (and stall on a busy machine), and both runs use the same count at every step."""

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Train the example DLRM on a Criteo-like click stream with delta checkpoints, restore a "
        "step from the middle on several ranks and check it bit for bit, resume from it and "
        "check the resumed run against the uninterrupted one, and plot the bytes written.")
    p.add_argument("--path", default="deltackpt-demo",
                   help="folder for the runs; each run makes a new folder inside, holding the "
                        "store and the plot (default: ./deltackpt-demo)")
    opt = p.add_argument
    opt("--scale", type=float, default=0.05, metavar="F",
        help="table sizes as a fraction of Criteo Kaggle's 26 tables of 33.8 M rows "
             "(default 0.05: 1.69 M rows)")
    opt("--max-rows", type=int, default=None, metavar="N", help="cap on the rows of any one table")
    opt("--dim", type=int, default=16, metavar="N", help="embedding dimension (default 16)")
    opt("--batch-size", type=int, default=512, metavar="N", help="samples per step (default 512)")
    opt("--steps", type=int, default=400, metavar="N", help="training steps (default 400)")
    opt("--every", type=int, default=40, metavar="K", help="checkpoint every K steps (default 40)")
    opt("--base-every", type=int, default=5, metavar="N",
        help="a full base every N checkpoints, deltas between (default 5)")
    opt("--blocking", action="store_true",
        help="save synchronously (by default a save returns once the state is staged and "
             "writes in the background)")
    opt("--restore-step", type=int, default=None, metavar="STEP",
        help="the checkpoint to restore and resume from (default: a delta near the middle)")
    opt("--ranks", type=int, default=2, metavar="M",
        help="gloo processes restoring the step, each its rows of every tensor (default 2)")
    opt("--optimizer", choices=SPARSE_OPTIMIZERS, default="adagrad",
        help="optimizer of the embedding tables (default adagrad; the MLPs use Adam)")
    opt("--seed", type=int, default=0, metavar="N", help="seed of data and model (default 0)")
    opt("--quantize", type=int, choices=(8, 4, 2), default=None, metavar="BITS",
        help="also train the same run with the embedding rows its deltas write quantized to "
             "BITS bits (8, 4 or 2; row-wise, adaptive range below 8), check a restore of it "
             "against the bound its record gives, and plot its bytes beside the exact run's")
    opt("--store", default=None, metavar="URL",
        help="where the checkpoints go: a directory or s3://BUCKET/PREFIX; each run saves into a "
             "new folder (prefix) inside (default: the run's folder under --path)")
    opt("--storage-option", action="append", default=[], metavar="KEY=VALUE",
        help="a setting of the --store backend, repeatable (for s3://: endpoint_url, region, "
             "access_key_id, secret_access_key; else the AWS_* environment variables)")
    opt("--torchrec", action="store_true",
        help="the same DLRM as a TorchRec DistributedModelParallel on 2 ranks, restored under "
             "another sharding plan (needs the torchrec extra; --ranks, --optimizer, --quantize and "
             "--store do not apply)")
    opt("--json", action="store_true", help="print one JSON object per line")


def checkpoint_steps(args: argparse.Namespace) -> list[int]:
    return list(range(args.every, args.steps + 1, args.every))


def _check(args: argparse.Namespace) -> None:
    """Raises DeltackptError naming the first bad option."""
    for name in ("dim", "batch_size", "steps", "every", "base_every", "ranks"):
        if getattr(args, name) < 1:
            raise DeltackptError(f"--{name.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(args, name)}")
    if args.seed < 0:
        raise DeltackptError(f"--seed must be >= 0, got {args.seed}")
    if args.ranks > 16:
        raise DeltackptError(f"--ranks must be at most 16, got {args.ranks}")
    if not args.scale > 0 or args.scale > 1:
        raise DeltackptError(f"--scale must be in (0, 1], got {args.scale}")
    if args.max_rows is not None and args.max_rows < 2:
        raise DeltackptError(f"--max-rows must be >= 2, got {args.max_rows}")
    if os.path.exists(args.path) and not os.path.isdir(args.path):
        raise DeltackptError(f"--path {args.path} exists and is not a folder")
    steps = checkpoint_steps(args)
    if len(steps) < 2:
        raise DeltackptError(f"--steps ({args.steps}) must allow two checkpoints every --every "
                             f"({args.every}) steps, so that one can be restored and resumed")
    if args.restore_step is not None and args.restore_step not in [
            s for s in steps if s < args.steps]:
        raise DeltackptError(
            f"--restore-step must be a checkpoint before the last step ({args.every}, "
            f"{2 * args.every}, ... < {args.steps}), got {args.restore_step}")


def pick_restore_step(args: argparse.Namespace) -> int:
    """A delta near the middle of the run, deep in its chain if several are as near.

    The kinds are predicted from the base cadence (a delta that outgrows half a base turns into a
    base; the step is then still restored and checked, and shown as a base)."""
    if args.restore_step is not None:
        return args.restore_step
    steps = [s for s in checkpoint_steps(args) if s < args.steps]
    deltas = [s for i, s in enumerate(steps) if i % args.base_every] or steps
    return min(deltas, key=lambda s: (abs(2 * s - args.steps), -s))


def run_demo(args: argparse.Namespace) -> int:
    _check(args)
    if args.torchrec:
        from .demo_torchrec import run

        return run(args, pick_restore_step(args))
    t_start = time.perf_counter()
    out = report.Output(as_json=args.json)
    data = CriteoConfig(scale=args.scale, max_rows=args.max_rows, batch_size=args.batch_size,
                        seed=args.seed)
    shapes = {"embedding_dim": args.dim, "bottom_mlp": (64, args.dim)}
    os.makedirs(args.path, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix=time.strftime("run-%Y%m%d-%H%M%S-"), dir=args.path)
    store = (f"{args.store.rstrip('/')}/{os.path.basename(run_dir)}" if args.store
             else os.path.join(run_dir, "store"))
    options = storage_options(args.storage_option)
    plot_path = os.path.join(run_dir, "checkpoint-bytes.png")
    pick = pick_restore_step(args)
    with warnings.catch_warnings(), deterministic(args.seed, threads=THREADS):
        # Adagrad and SparseAdam build sparse tensors without invariant checks and warn once.
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        saves, kept, final, chain = train_with_checkpoints(data, args, shapes, store, options, pick, out)
        t0 = time.perf_counter()
        ranks = restore_on_ranks(store, options, pick, args.ranks, kept[0])
        ranks_ok = all(r.get("ok") for r in ranks)
        out.restored(pick, chain, saves, ranks, ranks_ok, time.perf_counter() - t0)
        resumed = resume(data, args, shapes, store, options, pick, kept, final, out)
        lossy = (quantized_run(data, args, shapes, os.path.join(run_dir, f"store-q{args.quantize}"),
                               pick, out) if args.quantize else None)
    report.plot_bytes(plot_path, saves, args, quantized=lossy["saves"] if lossy else None)
    ok = ranks_ok and resumed["ok"] and (lossy is None or lossy["ok"])
    out.done(store, plot_path, ok, time.perf_counter() - t_start)
    if not ok:
        print("deltackpt: error: a restored state differs from the state saved (see above)",
              file=sys.stderr)
    return 0 if ok else 1


def train_with_checkpoints(
    data: CriteoConfig, args: argparse.Namespace, shapes: dict[str, Any], store: str,
    options: dict[str, str], pick: int, out: report.Output, quantize: dict[str, Rowwise] | None = None,
) -> tuple[list[dict[str, Any]], list[Snapshot], Snapshot, list[int]]:
    """The uninterrupted run, saving every ``args.every`` steps through the hook (with
    ``quantize``, the Checkpointer's quantization rules).

    Returns:
        The checkpoints' reports, a list holding a copy of the state saved at ``pick``, a copy
        of the state at the end, and the chain of ``pick``.
    """
    state, loss = dlrm_run(data, sparse_optimizer=args.optimizer, seed=args.seed, **shapes)
    tables = [k for k in statetree.flatten({"model": state.model}).tensors
              if k.startswith("model/embeddings.")]
    rows_total = sum(data.table_sizes)
    out.start(args, store, rows_total, torch.get_num_threads())
    saves: list[dict[str, Any]] = []
    kept: list[Snapshot] = []
    t0 = time.perf_counter()
    with Checkpointer(store, base_every=args.base_every, quantize=quantize,
                      storage_options=options) as ckpt:
        def on_save(info: SaveInfo) -> None:
            m = ckpt.store.manifest(info.step)
            changed = sum(m.tensors[k].changed for k in tables)
            saves.append(out.checkpoint(info, changed, rows_total))

        def on_staged(step: int) -> None:  # the state is the saved one until training goes on
            if step == pick:
                kept.append(snapshot(state))

        with _DemoHook(ckpt, state, every=args.every, on_staged=on_staged, on_save=on_save,
                       blocking=args.blocking) as hook, out.progress(args.steps, "train") as bar:
            hook.bar = bar
            train(state, loss, args.steps, hook=hook)
            hook.flush()
        chain = [m.step for m in ckpt.store.chain(pick)]
    out.trained(args.steps, time.perf_counter() - t0, saves)
    return saves, kept, snapshot(state), chain


def quantized_run(data: CriteoConfig, args: argparse.Namespace, shapes: dict[str, Any], store: str,
                  pick: int, out: report.Output) -> dict[str, Any]:
    """The same run with its deltas' embedding rows quantized to ``args.quantize`` bits, then a
    restore of ``pick`` into a model from another seed, checked against the state saved there:
    each tensor within the chain bound its record gives (bit for bit where it gives none)."""
    rule = Rowwise(bits=args.quantize, adaptive=args.quantize < 8)
    saves, kept, _, _ = train_with_checkpoints(data, args, shapes, store, {}, pick, out,
                                               quantize={"model/embeddings.*": rule})
    state, _ = dlrm_run(data, sparse_optimizer=args.optimizer, seed=args.seed + 1, **shapes)
    with Checkpointer(store, create=False) as ckpt:
        ckpt.restore(state, pick)
        record = ckpt.store.manifest(pick)
    (got, got_tree), (want, want_tree) = snapshot(state, copy=False), kept.pop()
    worst, bound, bad = 0.0, 0.0, [] if got_tree == want_tree else ["<skeleton>"]
    for key, rec in record.tensors.items():
        if rec.lossy is None:
            bad += [] if same_bits(got[key], want[key]) else [key]
            continue
        err = float((got[key].double() - want[key].double()).abs().max()) if got[key].numel() else 0.0
        worst, bound = max(worst, err), max(bound, rec.lossy.chain_bound)
        bad += [] if err <= rec.lossy.chain_bound else [key]
    result = {"scheme": rule.scheme, "step": pick, "lossy_tensors": sum(
        r.lossy is not None for r in record.tensors.values()), "worst_error": worst,
        "bound": bound, "out_of_bound": bad, "ok": not bad, "saves": saves}
    out.quantized(result)
    return result


class _DemoHook(CheckpointHook):
    """The hook, reporting each save once it committed and advancing the progress bar."""

    def __init__(self, *args: Any, on_staged: Any, on_save: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._on_staged = on_staged
        self._on_save = on_save
        self._pending: list[SaveHandle] = []
        self.bar: Any = None

    def on_step_end(self, step: int) -> SaveInfo | SaveHandle | None:
        out = super().on_step_end(step)
        if out is not None:
            self._on_staged(out.step)
            if isinstance(out, SaveInfo):
                self._on_save(out)
            else:
                self._pending.append(out)
        while self._pending and self._pending[0].done():
            self._on_save(self._pending.pop(0).result())
        if self.bar is not None:
            self.bar.update(1)
        return out

    def flush(self) -> None:
        """Reports the saves still in flight, once they committed."""
        while self._pending:
            self._on_save(self._pending.pop(0).result())


def resume(
    data: CriteoConfig, args: argparse.Namespace, shapes: dict[str, Any], store: str,
    options: dict[str, str], step: int, at_step: list[Snapshot], final: Snapshot, out: report.Output,
) -> dict[str, Any]:
    """Restores ``step`` on this rank into a model from another seed, trains to the end and
    compares with the state saved at ``step`` and with the uninterrupted run's final state.
    ``at_step`` holds the copy saved at ``step``; it is emptied once compared, to free it."""
    state, loss = dlrm_run(data, sparse_optimizer=args.optimizer, seed=args.seed + 1, **shapes)
    t0 = time.perf_counter()
    with Checkpointer(store, create=False, storage_options=options) as ckpt:
        ckpt.restore(state, step)
    restore_s = time.perf_counter() - t0
    bad_at_step = differences(snapshot(state, copy=False), at_step.pop())
    t0 = time.perf_counter()
    with out.progress(args.steps - step, "resume") as bar:
        while state.step < args.steps:
            train(state, loss, state.step + 1)
            bar.update(1)
    got = snapshot(state, copy=False)
    bad_final = differences(got, final)
    result = {"step": step, "until": args.steps, "restore_seconds": restore_s,
              "train_seconds": time.perf_counter() - t0, "tensors": len(got[0]),
              "bytes": sum(t.numel() * t.element_size() for t in got[0].values()),
              "mismatched_at_step": bad_at_step, "mismatched": bad_final,
              "ok": not bad_at_step and not bad_final}
    out.resumed(result)
    return result
