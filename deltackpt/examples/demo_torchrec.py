"""``deltackpt demo --torchrec``: the demo's DLRM as a TorchRec DistributedModelParallel on 2 ranks.

Needs the torchrec extra (``docs/torchrec.md``). Two gloo ranks (spawned here) build the DLRM of
:mod:`deltackpt.examples.dlrm` (same tables, MLPs and dot interaction) with its tables in a
TorchRec ``EmbeddingBagCollection``, sharded by plan A (table ``i``: table-wise on rank ``i % 2``
when ``i % 3 == 0``, row-wise when ``i % 3 == 1``, column-wise in two shards otherwise), fused
row-wise Adagrad in the tables and Adam on the MLPs under DDP. Each rank trains on its half of
every batch of the Criteo-like stream (one id per sample and table, so pooling gives the same
bits under every plan). Then:

1. Saves every ``--every`` steps with marks, a base every ``--base-every`` saves; one line per
   checkpoint. The state at the end goes into a second store, for the check in 3.
2. Builds the model again under plan B (table-wise tables become row-wise and row-wise ones
   table-wise; table-wise tables and column shards move to the other rank) and restores the
   restore step into it; every local value of tables and fused optimizer is compared bit for
   bit with the saved step.
3. Restores the same step into a model built afresh under plan A, trains on to the end and
   compares every value with the end of the uninterrupted run. (Trained on under plan B, the
   values drift from the uninterrupted run's in the last bits here, while the restored step is
   bit-exact: TorchRec sums the gradients of an id that a batch repeats in an order that depends
   on the plan, and Criteo-like batches repeat hot ids. ``tests/distributed/test_torchrec.py``
   resumes under another plan with batches that do not, and gets identical runs.)

Column-wise tables keep their two column shards in both plans, which keeps the fused optimizer's
row-wise state exact (see :mod:`deltackpt.integrations.torchrec`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

from ..checkpointer import Checkpointer
from ..datasets import CriteoConfig, CriteoStream
from ..errors import DeltackptError
from .dlrm import DLRM, DLRMConfig

WORLD = 2


def check_installed() -> None:
    """Raises DeltackptError unless torchrec imports."""
    try:
        import torchrec  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to import means the extra is missing
        raise DeltackptError(
            f"--torchrec needs torchrec ({type(e).__name__}: {e}); install it with "
            "pip install 'deltackpt[torchrec]' && pip install --no-deps torchrec==1.9.2") from None


class TorchRecDLRM(nn.Module):
    """:class:`~deltackpt.examples.dlrm.DLRM` with its tables in one EmbeddingBagCollection."""

    def __init__(self, config: DLRMConfig, ebc: nn.Module):
        super().__init__()
        dense = DLRM(DLRMConfig(table_sizes=(1,) * config.num_tables, embedding_dim=config.embedding_dim,
                                bottom_mlp=config.bottom_mlp, top_mlp=config.top_mlp))
        self.sparse = ebc
        self.bottom, self.top = dense.bottom, dense.top
        self._rows: torch.Tensor
        self._cols: torch.Tensor
        self.register_buffer("_rows", dense._rows, persistent=False)
        self.register_buffer("_cols", dense._cols, persistent=False)

    def forward(self, dense: torch.Tensor, features: Any) -> torch.Tensor:
        x = self.bottom(dense)
        pooled = self.sparse(features).values().view(x.shape[0], -1, x.shape[1])
        vectors = torch.cat([x.unsqueeze(1), pooled], dim=1)
        products = torch.bmm(vectors, vectors.transpose(1, 2))[:, self._rows, self._cols]
        return self.top(torch.cat([x, products], dim=1)).squeeze(1)


def layouts(plan: str, tables: int) -> list[tuple[str, int]]:
    """(layout, rank) of each table under plan "A" or "B": B makes A's table-wise tables row-wise
    and its row-wise ones table-wise, and puts every table-wise table and column shard on the
    other rank."""
    out = []
    for i in range(tables):
        kind, rank = ("table", "row", "column")[i % 3], i % WORLD
        if plan == "B":
            kind, rank = {"table": "row", "row": "table"}.get(kind, kind), 1 - rank
        out.append((kind, rank))
    return out


def build(config: DLRMConfig, plan: str, seed: int) -> tuple[Any, torch.optim.Optimizer]:
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    torch.manual_seed(seed)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=config.embedding_dim, num_embeddings=rows,
                                 feature_names=[f"f{i}"]) for i, rows in enumerate(config.table_sizes)]
    model = TorchRecDLRM(config, EmbeddingBagCollection(tables=tables, device=torch.device("meta")))
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse.parameters(), {"lr": 0.05})
    per_table = {}
    for i, (kind, rank) in enumerate(layouts(plan, config.num_tables)):
        per_table[f"t{i}"] = (table_wise(rank=rank) if kind == "table" else row_wise() if kind == "row"
                              else column_wise(ranks=[rank, 1 - rank]))
    module_plan = construct_module_sharding_plan(model.sparse, per_param_sharding=per_table,
                                                 world_size=WORLD, device_type="cpu")
    for p in module_plan.values():
        p.compute_kernel = "fused"
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=ShardingPlan({"sparse": module_plan}),
                                   sharders=[EmbeddingBagCollectionSharder()])
    dense = [p for n, p in dmp.named_parameters() if ".sparse." not in f".{n}"]
    return dmp, torch.optim.Adam(dense, lr=1e-3)


def train_step(dmp: Any, opt: torch.optim.Optimizer, stream: CriteoStream, step: int, rank: int) -> float:
    from torchrec import KeyedJaggedTensor

    batch = stream.batch(step)
    half = slice(rank * batch.labels.shape[0] // WORLD, (rank + 1) * batch.labels.shape[0] // WORLD)
    ids = batch.indices[:, half]
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(ids.shape[0])],
                                              values=ids.reshape(-1),
                                              lengths=torch.ones(ids.numel(), dtype=torch.int32))
    opt.zero_grad()
    loss = nn.functional.binary_cross_entropy_with_logits(dmp(batch.dense[half], kjt), batch.labels[half])
    loss.backward()
    opt.step()
    return loss.item()


def state(dmp: Any, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": dmp, "optim": dmp.fused_optimizer, "dense_optim": opt, "step": step}


def mismatches(dmp: Any, saved: dict[str, Any]) -> tuple[int, list[str]]:
    """Compares every local shard of the DMP's tables and fused optimizer state (in TorchRec's
    own layout) with a loaded global state; returns (values compared, keys that differ)."""
    n, bad = 0, []
    for key, value in dmp.state_dict().items():
        shards = value.local_shards() if hasattr(value, "local_shards") else []
        parts = [(tuple(s.metadata.shard_offsets), s.tensor) for s in shards] if shards or hasattr(
            value, "local_shards") else [((0,) * value.dim(), value)]
        for offset, t in parts:
            box = tuple(slice(o, o + s) for o, s in zip(offset, t.shape))
            n += t.numel()
            if not torch.equal(saved["model"][key][box], t):
                bad.append(key)
    for fqn, entries in dmp.fused_optimizer.state_dict()["state"].items():
        for name, value in entries.items():
            whole = saved["optim"]["state"][fqn][name]  # (rows, column shards)
            for s in value.local_shards():
                o, t = s.metadata.shard_offsets[0], s.tensor
                want = whole[o:o + t.numel(), 0] if whole.shape[1] == 1 else whole[:, o // whole.shape[0]]
                n += t.numel()
                if not torch.equal(want, t):
                    bad.append(f"optim/{fqn}/{name}")
    return n, sorted(set(bad))


def _rank(rank: int, port: int, args: argparse.Namespace, run_dir: str, pick: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    data = CriteoConfig(scale=args.scale, max_rows=args.max_rows, batch_size=args.batch_size, seed=args.seed)
    config = DLRMConfig.for_criteo(data, embedding_dim=args.dim, bottom_mlp=(64, args.dim))
    stream = CriteoStream(data)
    store, final = os.path.join(run_dir, "store"), os.path.join(run_dir, "final")
    say = print if rank == 0 else (lambda *a, **k: None)
    dmp, opt = build(config, "A", args.seed)
    saves = []
    with Checkpointer(store, base_every=args.base_every) as ckpt:
        ckpt.track(dmp, optimizer=dmp.fused_optimizer)
        for step in range(1, args.steps + 1):
            train_step(dmp, opt, stream, step, rank)
            if step % args.every == 0:
                info = ckpt.save(step, state(dmp, opt, step))
                saves.append({"step": step, "kind": info.kind, "bytes": info.bytes_written,
                              "state_bytes": info.state_bytes, "seconds": info.seconds})
                say(json.dumps({"event": "saved", **saves[-1]}) if args.json else
                    f"step {step:>6}: {info.kind:<5} {info.bytes_written / 1e6:9.2f} MB of "
                    f"{info.state_bytes / 1e6:.2f} MB in {info.seconds:.3f} s", flush=True)
    with Checkpointer(final) as ckpt:
        ckpt.save(args.steps, state(dmp, opt, args.steps))
    del dmp, opt
    dmp, opt = build(config, "B", args.seed + 1)
    with Checkpointer(store, create=False) as ckpt:
        t0 = time.perf_counter()
        ckpt.restore(state(dmp, opt, 0), pick)
        seconds = time.perf_counter() - t0
        restored = mismatches(dmp, ckpt.load(pick))
    del dmp, opt
    dmp, opt = build(config, "A", args.seed + 1)
    with Checkpointer(store, create=False) as ckpt:
        ckpt.restore(state(dmp, opt, 0), pick)
    for step in range(pick + 1, args.steps + 1):
        train_step(dmp, opt, stream, step, rank)
    with Checkpointer(final, create=False) as ckpt:
        resumed = mismatches(dmp, ckpt.load(args.steps))
    with open(os.path.join(run_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"saves": saves, "restore_seconds": seconds, "restored": restored,
                   "resumed": resumed}, f)
    dist.destroy_process_group()


def run(args: argparse.Namespace, pick: int) -> int:
    """Runs the TorchRec demo; 0 if every check passed, else 1."""
    check_installed()
    os.makedirs(args.path, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix=time.strftime("torchrec-%Y%m%d-%H%M%S-"), dir=args.path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, port, args, run_dir, pick)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        codes = [p.exitcode for p in procs]
        raise DeltackptError(f"a rank of the TorchRec demo failed (exit codes {codes})")
    results = []
    for r in range(WORLD):
        with open(os.path.join(run_dir, f"rank{r}.json")) as f:
            results.append(json.load(f))
    ok = all(not res["restored"][1] and not res["resumed"][1] for res in results)
    saves = results[0]["saves"]
    deltas = [s["bytes"] for s in saves if s["kind"] == "delta"]
    summary = {
        "event": "done", "store": os.path.join(run_dir, "store"), "ok": ok, "restore_step": pick,
        "restored_values": sum(res["restored"][0] for res in results),
        "restored_mismatches": sorted({k for res in results for k in res["restored"][1]}),
        "resumed_values": sum(res["resumed"][0] for res in results),
        "resumed_mismatches": sorted({k for res in results for k in res["resumed"][1]}),
        "restore_seconds": max(res["restore_seconds"] for res in results),
        "delta_vs_full": (sum(deltas) / len(deltas) / saves[0]["state_bytes"]) if deltas else None,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        bad_restore, bad_resume = summary["restored_mismatches"], summary["resumed_mismatches"]
        same = "identical to the uninterrupted run"
        print(f"restored step {pick} under plan B on {WORLD} ranks in {summary['restore_seconds']:.2f} s: "
              f"{summary['restored_values']} values, "
              f"{'DIFFERENT: ' + ', '.join(bad_restore) if bad_restore else 'bit-exact'}")
        print(f"restored it under plan A and trained on to step {args.steps}: "
              f"{summary['resumed_values']} values, "
              + ("DIFFERENT: " + ", ".join(bad_resume) if bad_resume else same))
        if deltas:
            print(f"deltas: {summary['delta_vs_full']:.4f} of a full checkpoint on average; "
                  f"store {summary['store']}")
    if not ok:
        print("deltackpt: error: a restored state differs from the state saved (see above)",
              file=sys.stderr)
    return 0 if ok else 1
