"""A small DLRM-like model as a TorchRec DistributedModelParallel on gloo, for the TorchRec tests
and the bench: four tables sharded by a named plan, fused row-wise Adagrad in the tables, dense
layers under DDP with their own Adagrad, and batches that depend only on the step and the rank."""

from __future__ import annotations

import functools
import subprocess
import sys

import torch
import torch.distributed as dist
from torch import nn

TABLES = {"t0": (400, 8), "t1": (530, 8), "t2": (610, 8), "t3": (290, 4)}
BATCH = 8  # per rank

# Plans by name: table -> ("table", rank) | ("row",) | ("column", ranks of its 2 column shards).
PLANS = {
    "A2": {"t0": ("table", 0), "t1": ("row",), "t2": ("column", (0, 1)), "t3": ("table", 1)},
    "B2": {"t0": ("row",), "t1": ("table", 1), "t2": ("column", (1, 0)), "t3": ("row",)},
    "C1": {"t0": ("table", 0), "t1": ("row",), "t2": ("column", (0, 0)), "t3": ("table", 0)},
    "D3": {"t0": ("row",), "t1": ("table", 2), "t2": ("column", (2, 1)), "t3": ("row",)},
    # t2 in one piece: its row-wise optimizer state has 1 column shard instead of 2.
    "T2": {"t0": ("table", 1), "t1": ("row",), "t2": ("table", 0), "t3": ("table", 1)},
}


@functools.cache
def torchrec_missing() -> str | None:
    """Why torchrec cannot be imported, or None. Tried in a child process: importing torchrec
    imports triton, which the kernel tests need imported only after they set TRITON_INTERPRET."""
    done = subprocess.run([sys.executable, "-c", "import torchrec"], capture_output=True, text=True)
    if done.returncode == 0:
        return None
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return (f"torchrec is not importable ({last}); install it with pip install deltackpt[torchrec], "
            "then pip install --no-deps torchrec==1.9.2")


class DLRM(nn.Module):
    def __init__(self, ebc: nn.Module, dims: int):
        super().__init__()
        self.sparse = ebc
        self.dense = nn.Sequential(nn.Linear(dims + 4, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, kjt, x):
        return self.dense(torch.cat([self.sparse(kjt).values(), x], dim=1)).squeeze(1)


def build(plan: str, *, seed: int = 0, tracker: bool = False, dtensor: bool = False):
    """(dmp, dense optimizer) on this rank, under plan ``plan``; ``tracker`` adds TorchRec's
    ModelDeltaTracker (ID_ONLY); ``dtensor``: state dicts hold DTensors (``output_dtensor``)
    instead of ShardedTensors."""
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
    configs = [EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"])
               for n, (r, d) in TABLES.items()]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    model = DLRM(ebc, sum(d for _, d in TABLES.values()))
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse.parameters(), {"lr": 0.05, "eps": 1e-8})
    world = dist.get_world_size()
    per_table = {}
    for name, spec in PLANS[plan].items():
        if spec[0] == "table":
            per_table[name] = table_wise(rank=spec[1])
        elif spec[0] == "row":
            per_table[name] = row_wise()
        else:
            per_table[name] = column_wise(ranks=list(spec[1]))
    module_plan = construct_module_sharding_plan(model.sparse, per_param_sharding=per_table,
                                                 world_size=world, device_type="cpu")
    for p in module_plan.values():
        p.compute_kernel = "fused"
    kwargs = {}
    env = ShardingEnv(world, dist.get_rank(), dist.group.WORLD, output_dtensor=dtensor)
    dmp = DistributedModelParallel(model, env=env,
                                   device=torch.device("cpu"), plan=ShardingPlan({"sparse": module_plan}),
                                   sharders=[EmbeddingBagCollectionSharder()], **kwargs)
    if tracker:
        from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode

        dmp.init_torchrec_delta_tracker(DeltaTrackerConfig(tracking_mode=TrackingMode.ID_ONLY))
    dense = [p for n, p in dmp.named_parameters() if "dense" in n]
    return dmp, torch.optim.Adagrad(dense, lr=0.05)


def batch(step: int, rank: int, hot: float = 1.0):
    """Rank ``rank``'s batch of ``step``: one id per table and sample (so that pooling is exact
    under every plan), drawn from the first ``hot`` share of each table's rows."""
    from torchrec import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(1000 * step + rank)
    ids = [torch.randint(0, max(1, int(rows * hot)), (BATCH,), generator=gen) for rows, _ in TABLES.values()]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f_{n}" for n in TABLES], values=torch.cat(ids),
        lengths=torch.ones(BATCH * len(TABLES), dtype=torch.int32))
    x = torch.randn(BATCH, 4, generator=gen)
    y = (torch.rand(BATCH, generator=gen) > 0.5).float()
    return kjt, x, y


def train_step(dmp, opt, step: int, rank: int, hot: float = 1.0) -> float:
    kjt, x, y = batch(step, rank, hot)
    opt.zero_grad()
    loss = nn.functional.binary_cross_entropy_with_logits(dmp(kjt, x), y)
    loss.backward()
    opt.step()
    return loss.item()


def state(dmp, opt, step: int) -> dict:
    return {"model": dmp, "optim": dmp.fused_optimizer, "dense_optim": opt, "step": step}


def local_values(dmp) -> dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]:
    """Every local shard of the DMP's tables and fused optimizer state, read from TorchRec's own
    state dicts: (global offsets, a copy) by key, the optimizer's under ``optim/<fqn>/<name>``."""
    out = {}
    for key, st in dmp.state_dict().items():
        out[f"model/{key}"] = _shards(st) if _sharded(st) else [((0,) * st.dim(), st.clone())]
    for fqn, entries in dmp.fused_optimizer.state_dict()["state"].items():
        for name, st in entries.items():
            out[f"optim/{fqn}/{name}"] = _shards(st)
    return out


def _sharded(st) -> bool:
    return hasattr(st, "local_shards") or hasattr(st, "to_local")


def _shards(st) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """(global offsets, a copy) of each local shard of a ShardedTensor or of a DTensor over
    TorchRec's LocalShardsWrapper, read through TorchRec's own accessors."""
    if hasattr(st, "local_shards"):
        return [(tuple(s.metadata.shard_offsets), s.tensor.clone()) for s in st.local_shards()]
    local = st.to_local()
    return [(tuple(int(o) for o in offset), t.clone())
            for t, offset in zip(local.local_shards(), local.local_offsets())]


def check_against(loaded: dict, values: dict) -> int:
    """Asserts every local value equals the saved global state (TorchRec's momentum layout:
    column shard j of a table at ``[j * rows, (j+1) * rows)``); returns the values compared."""
    n = 0
    for key, parts in values.items():
        if key.startswith("model/"):
            saved = loaded["model"][key.removeprefix("model/")]
            for offset, t in parts:
                box = tuple(slice(o, o + s) for o, s in zip(offset, t.shape))
                assert torch.equal(saved[box], t), key
                n += t.numel()
            continue
        _, fqn, name = key.split("/")
        saved = loaded["optim"]["state"][fqn][name]  # (rows, column shards)
        rows = saved.shape[0]
        for (o,), t in parts:
            want = saved[o:o + t.numel(), 0] if saved.shape[1] == 1 else saved[:, o // rows]
            assert torch.equal(want, t), (key, o)
            n += t.numel()
    return n
