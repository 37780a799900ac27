"""TorchRec DMP: a 1% delta beside a DCP save of the same state, and a resharded restore beside
DCP's load onto the same new plan. Needs the torchrec extra (see docs/torchrec.md).

Two gloo ranks (torch.multiprocessing.spawn, one torch thread each) build a DistributedModelParallel
of ``--tables`` tables of ``--rows`` x ``--dim`` float32 with fused row-wise Adagrad and a small
dense MLP under DDP, under plan A: table 0 table-wise on rank 0, table 1 row-wise, table 2
column-wise in two shards (ranks 0, 1), the others table-wise on rank 1. Then:

  base    one training step, then deltackpt saves step 1 (a base; marks start).
  rounds  per round: one training step whose batches look up 1% of every table's rows (distinct
          ids, half on each rank), so 1% of the rows of each table and of its momentum change;
          deltackpt saves it (a delta, rows found by the marks of deltackpt's own post-lookup
          function); dcp.save of the same state ({"model": dmp.state_dict(), "optim":
          dmp.fused_optimizer.state_dict()}) into a fresh folder.
  restore a second DMP under plan B (table 0 row-wise, table 1 table-wise on rank 1, table 2
          column-wise with its shards swapped, the others row-wise): deltackpt restores the last
          step (a fresh Checkpointer, as a restarted job opens it) and dcp.load loads the last
          DCP checkpoint into the state dicts of a third DMP under plan B, alternated,
          ``--repeat`` times each; every local value of both is compared bit for bit (any
          difference stops the bench).

Ranks run one torch thread each; numba (deltackpt's CPU hash kernels) gets NUMBA_NUM_THREADS =
CPUs // 2 unless set. Each rank first warms deltackpt up on a tiny state of its own (the kernels
compile on first use).

Timing: every op runs between barriers; its time is the maximum over the ranks. The files are
dropped from the page cache before each restore and load. Output: the median seconds of each op
and its ratio to DCP's (delta save / dcp.save, restore / dcp.load), and the bytes each wrote.

The default state, 8 tables of 1,048,576 x 64 (2.19 GB with the momentum), is the size of the
DLRM-like states of bench_distributed.py and bench_async.py. A delta's fixed cost (its fsyncs and
coordinator rounds, ~20 ms) weighs more on a small state: at ``--tables 4 --rows 262144`` (0.27 GB)
a 1% delta took 0.11x a ``dcp.save``, at the default 0.016x (one run of each, 2026-12-01).

Example:
    python bench/bench_torchrec.py
    python bench/bench_torchrec.py --tables 4 --rows 262144 --dim 64 --repeat 5 --dir /var/tmp
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch

from common import evict, figure, json_option, tree_bytes, write_figures  # bench/common.py


def plan_of(name: str, tables: int) -> dict[str, tuple]:
    plan = {"t0": ("table", 0), "t1": ("row",), "t2": ("column", (0, 1))} if name == "A" else \
        {"t0": ("row",), "t1": ("table", 1), "t2": ("column", (1, 0))}
    for i in range(3, tables):
        plan[f"t{i}"] = ("table", 1) if name == "A" else ("row",)
    return plan


def build(args: argparse.Namespace, plan: str):
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

    torch.manual_seed(args.seed)
    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows,
                                  feature_names=[f"f{i}"]) for i in range(args.tables)]
    model = torch.nn.ModuleDict({
        "sparse": EmbeddingBagCollection(tables=configs, device=torch.device("meta")),
        "dense": torch.nn.Linear(args.dim * args.tables, 1),
    })
    apply_optimizer_in_backward(RowWiseAdagrad, model["sparse"].parameters(), {"lr": 0.01})
    per_table = {}
    for name, spec in plan_of(plan, args.tables).items():
        per_table[name] = (table_wise(rank=spec[1]) if spec[0] == "table" else row_wise() if spec[0] == "row"
                           else column_wise(ranks=list(spec[1])))
    module_plan = construct_module_sharding_plan(model["sparse"], per_param_sharding=per_table,
                                                 world_size=dist.get_world_size(), device_type="cpu")
    for p in module_plan.values():
        p.compute_kernel = "fused"
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                    device=torch.device("cpu"), plan=ShardingPlan({"sparse": module_plan}),
                                    sharders=[EmbeddingBagCollectionSharder()])


def train_step(dmp, args: argparse.Namespace, rank: int, world: int, step: int, share: float) -> None:
    """One step whose lookups touch ``share`` of every table's rows (distinct, split over ranks)."""
    from torchrec import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(step)
    n = world * max(1, int(args.rows * share) // world)  # the same batch size on every rank
    ids = [torch.randperm(args.rows, generator=gen)[:n].chunk(world)[rank] for _ in range(args.tables)]
    kjt = KeyedJaggedTensor.from_lengths_sync(  # one id per bag: every feature has len(ids[0]) bags
        keys=[f"f{i}" for i in range(args.tables)], values=torch.cat(ids),
        lengths=torch.ones(sum(len(i) for i in ids), dtype=torch.int32))
    pooled = dmp.module["sparse"](kjt).values()
    dmp.module["dense"](pooled).square().mean().backward()


def timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def values(dmp) -> dict[str, list[torch.Tensor]]:
    out = {k: [s.tensor.clone() for s in v.local_shards()] if hasattr(v, "local_shards") else [v.clone()]
           for k, v in dmp.state_dict().items()}
    for fqn, entries in dmp.fused_optimizer.state_dict()["state"].items():
        for name, st in entries.items():
            out[f"optim/{fqn}/{name}"] = [s.tensor.clone() for s in st.local_shards()]
    return out


def warm(path: str) -> None:
    """Compiles deltackpt's hash kernels (numba) and warms its save path on a tiny state, on this
    rank alone, before anything is timed."""
    import deltackpt

    t = torch.zeros(4096, 16)
    with deltackpt.Checkpointer(path) as ckpt:
        ckpt.save(0, {"t": t, "m": torch.zeros(4096, 1)})
        t[7] += 1
        ckpt.mark("t", torch.tensor([7]))
        ckpt.save(1, {"t": t, "m": torch.zeros(4096, 1)})
        ckpt.restore({"t": t, "m": torch.zeros(4096, 1)})


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, scratch: str, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import deltackpt

    torch.set_num_threads(1)
    warm(os.path.join(scratch, f"warm{rank}"))  # before the process group: a world of one
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    store = os.path.join(scratch, "store")
    times: dict[str, list[float]] = {"delta save": [], "dcp.save": []}
    sizes: dict[str, int] = {}
    dmp = build(args, "A")
    with deltackpt.Checkpointer(store) as ckpt:
        ckpt.track(dmp, optimizer=dmp.fused_optimizer)
        train_step(dmp, args, rank, world, 0, args.share)
        base = []
        state = {"model": dmp, "optim": dmp.fused_optimizer}
        times["base save"] = [timed(lambda: base.append(ckpt.save(1, state)))]
        sizes["base save"] = base[0].bytes_written
        state_bytes = base[0].state_bytes
        for r in range(args.repeat):
            step = 2 + r
            train_step(dmp, args, rank, world, step, args.share)
            infos = []
            times["delta save"].append(timed(lambda: infos.append(
                ckpt.save(step, {"model": dmp, "optim": dmp.fused_optimizer}))))
            if infos[0].kind != "delta":
                raise SystemExit(f"step {step} was saved as a {infos[0].kind}: {infos[0].reason}")
            sizes["delta save"] = infos[0].bytes_written
            folder = os.path.join(scratch, f"dcp{r}")
            state = {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}
            times["dcp.save"].append(timed(lambda: dcp.save(state, checkpoint_id=folder)))
            dist.barrier()
            if rank == 0:
                sizes["dcp.save"] = tree_bytes(folder)
                if r:
                    shutil.rmtree(os.path.join(scratch, f"dcp{r - 1}"))
    last = os.path.join(scratch, f"dcp{args.repeat - 1}")
    restored, loaded = build(args, "B"), build(args, "B")
    state = {"model": loaded.state_dict(), "optim": loaded.fused_optimizer.state_dict()}
    times["restore on plan B"], times["dcp.load on plan B"] = [], []
    for _ in range(args.repeat):  # alternated, each from evicted files
        evict(store, last)
        with deltackpt.Checkpointer(store, create=False) as ckpt:
            times["restore on plan B"].append(timed(lambda: ckpt.restore(
                {"model": restored, "optim": restored.fused_optimizer})))
        evict(store, last)
        times["dcp.load on plan B"].append(timed(lambda: dcp.load(state, checkpoint_id=last)))
    a, b = values(restored), values(loaded)
    bad = [k for k in a if len(a[k]) != len(b[k]) or not all(torch.equal(x, y) for x, y in zip(a[k], b[k]))]
    if bad:
        raise SystemExit(f"rank {rank}: deltackpt's restore and DCP's load differ in {bad}")
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "sizes": sizes, "state_bytes": state_bytes}, f)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", type=int, default=8, help="tables, at least 3 (default 8)")
    p.add_argument("--rows", type=int, default=1048576, help="rows per table (default 1048576)")
    p.add_argument("--dim", type=int, default=64, help="embedding dimension, even (default 64)")
    p.add_argument("--share", type=float, default=0.01, help="rows touched per round (default 0.01)")
    p.add_argument("--repeat", type=int, default=3,
                   help="delta rounds and restore rounds; medians reported (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="where the scratch folder goes (default: the system's)")
    json_option(p)
    args = p.parse_args()
    if args.tables < 3 or args.dim % 2:
        p.error("--tables must be >= 3 and --dim even")
    import torch.multiprocessing as mp

    # deltackpt's CPU hash kernels (numba) share the cores with the other rank.
    os.environ.setdefault("NUMBA_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // 2)))
    scratch = tempfile.mkdtemp(prefix="bench_torchrec-", dir=args.dir)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = os.path.join(scratch, "result")
        mp.spawn(rank_main, args=(2, port, args, scratch, out), nprocs=2)
        with open(out) as f:
            result = json.load(f)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"DMP state: {args.tables} tables of {args.rows} x {args.dim} float32 with row-wise momentum, "
          f"{result['state_bytes']:,} B; {args.share:.1%} of the rows per delta; 2 ranks")
    times = {k: statistics.median(v) for k, v in result["times"].items()}
    print("| op | median s | vs DCP | bytes |\n|---|---|---|---|")
    for op, ref in (("base save", "dcp.save"), ("delta save", "dcp.save"), ("dcp.save", None),
                    ("restore on plan B", "dcp.load on plan B"), ("dcp.load on plan B", None)):
        ratio = f"{times[op] / times[ref]:.3f}x" if ref else ""
        print(f"| {op} | {times[op]:.3f} | {ratio} | {result['sizes'].get(op, '')} |")
    runs = result["times"]
    write_figures(args.json, "bench_torchrec", args, [
        figure(op, runs[op], peer=ref, peer_runs=runs[ref] if ref else None)
        for op, ref in (("base save", "dcp.save"), ("delta save", "dcp.save"),
                        ("restore on plan B", "dcp.load on plan B"))], state_bytes=result["state_bytes"])


if __name__ == "__main__":
    sys.exit(main())
