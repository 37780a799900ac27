"""1-d state with one value per row of a table (row-wise Adagrad sums) rides with the table's rows:
inferred for a tracked table's optimizer state and, by hashing, for optimizer state shaped
row-wise, declared with ``Checkpointer(aligned=...)`` for a plain dict, refused with a typed error
naming the key when the declaration does not fit; a delta then holds exactly the changed values,
by marks and by hashing, and every step restores bit-exact, also along chains whose earlier deltas
stored the state in dense chunks."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

import deltackpt
from deltackpt import Checkpointer, MemoryStorage, Shard, StateError
from deltackpt.format.encodings import dense_chunk_elems
from deltackpt.io.reader import ChainReader
from deltackpt.io.staging import StagingPool
from dist_harness import check_ok, run_ranks
from helpers import same_bits

ROWS, DIM = 20_000, 16


class NeverBase:
    name = "never_base"

    def decide(self, chain, delta_bytes, full_bytes):
        return deltackpt.Decision("delta", "test policy: always a delta")


def record(ckpt: Checkpointer, step: int) -> dict[str, tuple[str, list[int]]]:
    """Each changed tensor's encoding and the rows (elements) step ``step``'s delta holds."""
    m = ckpt.store.manifest(step)
    out: dict[str, tuple[str, list[int]]] = {}
    with ThreadPoolExecutor(1) as executor:
        reader = ChainReader(ckpt.store.storage, [m], StagingPool(4, 1 << 20, pin=False), executor)
        for key, rec in m.tensors.items():
            ids = [i for part in rec.parts if part.changed
                   for i in rec.encoding.changes(reader, m, key, rec, part)[0].tolist()]
            if ids:
                out[key] = (rec.encoding.name, sorted(ids))
    return out


def dict_state(g: torch.Generator, rows: int = ROWS) -> dict:
    return {"model": {"emb": torch.randn(rows, DIM, generator=g), "bias": torch.randn(DIM, generator=g)},
            "optim": {"acc": torch.rand(rows, generator=g), "step": torch.tensor(0)}}


def touch(s: dict, rows: torch.Tensor) -> None:
    s["model"]["emb"][rows] += 1.0
    s["optim"]["acc"][rows] += 0.5


@pytest.mark.parametrize("by_marks", [False, True])
@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.05])
def test_declared_state_rides_with_its_table(by_marks, fraction):
    g = torch.Generator().manual_seed(0)
    big = 10 * ROWS  # so that 0.1% is rows enough for a chunk's fixed bytes not to count
    s = dict_state(g, big)
    storage = MemoryStorage()
    with Checkpointer(storage, policy=NeverBase(), aligned={"optim/acc": "model/emb"}) as ckpt:
        if by_marks:
            ckpt.mark("model/emb", torch.empty(0, dtype=torch.int64))  # tracked from the base on
        ckpt.save(0, s)
        rows = torch.randperm(big, generator=g)[: int(big * fraction)].sort().values
        touch(s, rows)
        if by_marks:
            ckpt.mark("model/emb", rows)
        info = ckpt.save(1, s)
        assert record(ckpt, 1) == {"model/emb": ("rows", rows.tolist()), "optim/acc": ("rows", rows.tolist())}
        goal = rows.numel() * (DIM * 4 + 4 + 8)
        assert info.bytes_written <= 1.1 * goal, (info.bytes_written, goal)
        got = ckpt.load(1)
        assert same_bits(got["model"]["emb"], s["model"]["emb"]) and same_bits(got["optim"]["acc"], s["optim"]["acc"])


def chunk_elements(rows: torch.Tensor) -> list[int]:
    """The elements of the dense chunks (of 1 KiB) of the state that hold ``rows``."""
    ce = dense_chunk_elems(ROWS, 4, 1024)
    return [e for c in sorted(set((rows // ce).tolist())) for e in range(c * ce, min(ROWS, (c + 1) * ce))]


class RowwiseAdagrad(torch.optim.Optimizer):
    """Adagrad with one accumulator per row (as FBGEMM's row-wise Adagrad keeps it)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.to_dense()
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = torch.zeros(p.shape[0])
                touched = grad.abs().sum(1) > 0
                state["sum"][touched] += grad[touched].pow(2).mean(1)
                p[touched] -= group["lr"] * grad[touched] / (state["sum"][touched].sqrt() + 1e-10)[:, None]


def train_step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    opt.zero_grad()
    model(ids).sum().backward()
    opt.step()


@pytest.mark.parametrize("rows, inferred", [(ROWS, True), (DIM, False)])
def test_a_tracked_tables_rowwise_state_is_inferred_unless_ambiguous(rows, inferred):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(rows, DIM))
    opt = RowwiseAdagrad(model.parameters())
    train_step(model, opt, torch.tensor([0, 1]))
    state = {"model": model, "optim": opt}
    with Checkpointer(MemoryStorage(), policy=NeverBase()) as ckpt:
        ckpt.track(model, prefix="model", optimizer=opt)
        ckpt.save(0, state)
        ids = torch.tensor([3, 7, rows - 1])
        train_step(model, opt, ids)
        ckpt.save(1, state)
        got = record(ckpt, 1)
        assert got["model/0.weight"] == ("rows", ids.tolist())
        # A table as wide as it is long: its 1-d state may be per column, so it is not inferred,
        # and its one dense chunk holds all of it.
        assert got["optim/state/0/sum"] == (("rows", ids.tolist()) if inferred else ("chunks", list(range(rows))))
        loaded = ckpt.load(1)
        assert same_bits(loaded["optim"]["state"][0]["sum"], opt.state[model[0].weight]["sum"])


@pytest.mark.parametrize("path, inferred", [
    (("state", 0, "sum"), True),  # a torch optimizer's state_dict: by parameter index
    (("state", "emb.weight", "emb.momentum1"), True),  # a keyed (fused) optimizer's: by parameter name
    (("acc",), False),  # a plain dict's: declared, never guessed
])
def test_hashing_infers_rowwise_optimizer_state_from_the_shapes(path, inferred):
    """Without track() or a declaration, a 1-d optimizer state with one value per row of a table
    rides with the rows by hashing: the delta holds exactly the changed values, within the bytes
    goal; elsewhere in the state it stays in dense chunks."""
    g = torch.Generator().manual_seed(2)
    big = 10 * ROWS
    emb, acc = torch.randn(big, DIM, generator=g), torch.rand(big, generator=g)
    optim: dict = {}
    node = optim
    for name in path[:-1]:
        node = node.setdefault(name, {})
    node[path[-1]] = acc
    key = "/".join(["optim", *map(str, path)])
    with Checkpointer(MemoryStorage(), policy=NeverBase()) as ckpt:
        ckpt.save(0, {"model": {"emb": emb}, "optim": optim})
        rows = torch.randperm(big, generator=g)[: big // 100].sort().values
        emb[rows] += 1.0
        acc[rows] += 0.5
        info = ckpt.save(1, {"model": {"emb": emb}, "optim": optim})
        held = record(ckpt, 1)
        assert held["model/emb"] == ("rows", rows.tolist())
        assert held[key][0] == ("rows" if inferred else "chunks")
        if inferred:
            assert held[key][1] == rows.tolist()
            assert info.bytes_written <= 1.1 * rows.numel() * (DIM * 4 + 4 + 8), info.bytes_written
        loaded = ckpt.load(1)["optim"]
        for name in path:
            loaded = loaded[name]
        assert same_bits(loaded, acc)


@pytest.mark.parametrize("acc, table, why", [
    (torch.zeros(ROWS - 1), torch.zeros(ROWS, DIM), "rows"),
    (torch.zeros(ROWS, 2), torch.zeros(ROWS, DIM), "2-d"),
    (torch.zeros(DIM), torch.zeros(DIM), "1-d table"),
])
def test_a_declaration_that_does_not_fit_is_refused_naming_the_key(acc, table, why):
    with Checkpointer(MemoryStorage(), aligned={"optim/acc": "model/emb"}) as ckpt:
        with pytest.raises(StateError, match="optim/acc"):
            ckpt.save(0, {"model": {"emb": table}, "optim": {"acc": acc}})
    with pytest.raises(StateError, match="aligned"):
        Checkpointer(MemoryStorage(), aligned={"optim/acc": "optim/acc"})
    with pytest.raises(StateError, match="aligned must map flat keys"):  # was a bare ValueError
        Checkpointer(MemoryStorage(), aligned=["optim/acc"])


@pytest.mark.parametrize("first_aligned", [False, True])
def test_chains_mixing_dense_and_row_deltas_of_the_state_restore_bit_exact(first_aligned):
    """The first deltas store the state one way; a checkpointer declared the other way restores
    the chain and extends it; every step restores bit-exact, and after the restore the next delta
    holds exactly the rows touched."""
    g = torch.Generator().manual_seed(1)
    s = dict_state(g)
    storage = MemoryStorage()
    saved = {}
    kw = dict(policy=NeverBase(), chunk_bytes=4096, dense_chunk_bytes=1024, memory_budget=1 << 16)
    declared = {"aligned": {"optim/acc": "model/emb"}}
    with Checkpointer(storage, **kw, **(declared if first_aligned else {})) as ckpt:
        for step in range(4):
            if step:
                touch(s, torch.randint(0, ROWS, (50,), generator=g))
            ckpt.save(step, s)
            saved[step] = {k: v.clone() for k, v in s["optim"].items()} | {"emb": s["model"]["emb"].clone()}
    with Checkpointer(storage, **kw, **({} if first_aligned else declared)) as ckpt:
        ckpt.restore(s, 3)
        for step in range(4, 8):
            touch(s, torch.randint(0, ROWS, (50,), generator=g))
            ckpt.save(step, s)
            saved[step] = {k: v.clone() for k, v in s["optim"].items()} | {"emb": s["model"]["emb"].clone()}
        encodings = {ckpt.store.manifest(step).tensors["optim/acc"].encoding.name for step in range(1, 8)}
        assert encodings == {"rows", "chunks"}
        for step in (3, 5, 7):
            got = dict_state(torch.Generator().manual_seed(9))
            ckpt.restore(got, step)
            assert same_bits(got["optim"]["acc"], saved[step]["acc"]), step
            assert same_bits(got["model"]["emb"], saved[step]["emb"]), step
        touched = torch.tensor([5, 500, 5000])
        touch(got, touched)
        ckpt.save(9, got)
        held = record(ckpt, 9)
        assert held["model/emb"] == ("rows", touched.tolist())
        assert held["optim/acc"] == (("rows", touched.tolist()) if not first_aligned
                                     else ("chunks", chunk_elements(touched)))


def split_job(rank: int, world: int, root: str) -> str:
    half = ROWS // 2
    emb, acc = torch.zeros(ROWS, DIM), torch.zeros(ROWS)
    state = {"model": {"emb": Shard(emb[rank * half:(rank + 1) * half].clone(), global_shape=(ROWS, DIM),
                                    global_offset=(rank * half, 0))},
             "optim": {"acc": Shard(acc[rank * half:(rank + 1) * half].clone(), global_shape=(ROWS,),
                                    global_offset=(rank * half,))}}
    with Checkpointer(f"{root}/store", aligned={"optim/acc": "model/emb"} if rank == 0 else None) as ckpt:
        try:
            ckpt.save(0, state)
        except deltackpt.DeltackptError as e:
            return str(e)
    return "saved"


def test_ranks_that_disagree_on_an_alignment_are_refused_naming_the_key(tmp_path):
    for why in check_ok(run_ranks(split_job, 2, str(tmp_path), str(tmp_path), deadline=120)):
        assert "optim/acc" in why and "aligned" in why, why


def sharded_state_job(rank: int, world: int, root: str) -> tuple[list[str], bool]:
    """A table and its optimizer-shaped row-wise state split unevenly by rows over the ranks, beside
    a layer split by columns as wide as each rank's rows: a hashing delta; the encodings it chose,
    and whether the step loads back bit for bit."""
    g = torch.Generator().manual_seed(3)
    emb, acc = torch.randn(ROWS, DIM, generator=g), torch.rand(ROWS, generator=g)
    cut = ROWS // 2 + 100
    lo, hi = (0, cut) if rank == 0 else (cut, ROWS)

    def state() -> dict:
        return {"model": {"emb": Shard(emb[lo:hi].clone(), global_shape=(ROWS, DIM), global_offset=(lo, 0)),
                          "dense": Shard(torch.ones(4, hi - lo), global_shape=(4, ROWS), global_offset=(0, lo))},
                "optim": {"state": {0: {"sum": Shard(acc[lo:hi].clone(), global_shape=(ROWS,),
                                                     global_offset=(lo,))}}}}

    with Checkpointer(f"{root}/store", policy=NeverBase()) as ckpt:
        ckpt.save(0, state())
        touched = torch.arange(0, ROWS, 97)
        emb[touched] += 1.0
        acc[touched] += 0.5
        ckpt.save(1, state())
        m = ckpt.store.manifest(1)
        encodings = [m.tensors[k].encoding.name for k in ("model/emb", "optim/state/0/sum")]
        got = ckpt.load(1)
    same = same_bits(got["model"]["emb"], emb) and same_bits(got["optim"]["state"][0]["sum"], acc)
    return encodings, same


def test_ranks_infer_rowwise_state_from_their_own_shards(tmp_path):
    """Each rank infers the state row-wise from its own shards, also where its row count is another
    tensor's width there (only a table's own columns make it ambiguous): the delta holds rows."""
    for encodings, same in check_ok(run_ranks(sharded_state_job, 2, str(tmp_path), str(tmp_path), deadline=120)):
        assert encodings == ["rows", "rows"] and same, (encodings, same)
