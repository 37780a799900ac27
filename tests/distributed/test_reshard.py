"""N -> M restore for every pair in {1, 2, 3, 4}, row-, column- and table-wise crosswise,
after chains with several deltas that rewrite each other's rows, optimizer-like state included."""

from __future__ import annotations

import torch
import torch.distributed as dist

from deltackpt import Checkpointer, Shard
from dist_harness import check_ok, run_ranks

SCHEMES = ("row", "col", "table")
TABLES = {"t0": (101, 8), "t1": (64, 5), "t2": (37, 3), "tiny": (2, 8)}
STEPS = (1, 2, 3, 4, 5)


def reference(step: int) -> dict[str, torch.Tensor]:
    """The global state at ``step``: a few rows of each table change per step."""
    gen = torch.Generator().manual_seed(0)
    ref = {name: torch.randn(shape, generator=gen) for name, shape in TABLES.items()}
    ref.update({f"acc_{name}": torch.zeros(shape[0]) for name, shape in TABLES.items()})
    ref["dense"] = torch.randn(50, generator=gen)
    ref["mlp"] = torch.randn(6, 5, generator=gen)
    for s in range(1, step + 1):
        for name, (rows, _) in TABLES.items():
            # Row 1 changes at every step: later deltas overwrite earlier ones' rows.
            ids = torch.cat([torch.randint(0, rows, (3,), generator=gen), torch.tensor([1])])
            ref[name][ids] += 0.5
            ref[f"acc_{name}"][ids] += 1.0
        if s % 2 == 0:
            ref["dense"][s] = float(s)
    return ref


def layout(name: str, t: torch.Tensor, scheme: str, rank: int, world: int) -> Shard | torch.Tensor | None:
    """This rank's part of a global tensor under a sharding scheme (None: the rank holds none)."""
    if name in ("dense", "mlp"):
        return t.clone()  # replicated
    table = name.removeprefix("acc_")
    if scheme == "table":
        owner = sorted(TABLES).index(table) % world
        return t.clone() if owner == rank else None
    dim = 0 if scheme == "row" or t.dim() == 1 else 1
    size = t.shape[dim]
    block = -(-size // world)
    lo, hi = min(size, rank * block), min(size, (rank + 1) * block)
    local = t.narrow(dim, lo, hi - lo).clone()
    offset = [0] * t.dim()
    offset[dim] = lo
    return Shard(local, global_shape=tuple(t.shape), global_offset=tuple(offset))


def make_state(ref: dict, scheme: str, rank: int, world: int, step: int) -> dict:
    tensors = {}
    for name, t in ref.items():
        part = layout(name, t, scheme, rank, world)
        if part is not None:
            tensors[name] = part
    return {"tensors": tensors, "step": step}


def local_of(x):
    return x.local if isinstance(x, Shard) else x


def reshard_job(rank: int, world: int, root: str) -> int:
    groups = {n: dist.new_group(list(range(n)), backend="gloo") for n in range(1, world + 1)}
    checked = 0
    for scheme in SCHEMES:
        for n in range(1, world + 1):
            if rank < n:
                state = make_state(reference(STEPS[0]), scheme, rank, n, STEPS[0])
                with Checkpointer(f"{root}/{scheme}-{n}", process_group=groups[n], base_every=100,
                                  chunk_bytes=256, memory_budget=4096, dense_chunk_bytes=32) as ckpt:
                    kinds = []
                    for step in STEPS:
                        ref = reference(step)
                        for name, x in state["tensors"].items():
                            local_of(x).copy_(local_of(layout(name, ref[name], scheme, rank, n)))
                        state["step"] = step
                        kinds.append(ckpt.save(step, state).kind)
                    assert kinds == ["base"] + ["delta"] * (len(STEPS) - 1), kinds
            dist.barrier()
    for scheme in SCHEMES:
        for n in range(1, world + 1):
            for target in SCHEMES:
                for m in range(1, world + 1):
                    if rank >= m:
                        continue
                    for step in (STEPS[2], STEPS[-1]):
                        want = make_state(reference(step), target, rank, m, step)
                        got = make_state({k: torch.zeros_like(v) for k, v in reference(0).items()},
                                         target, rank, m, 0)
                        with Checkpointer(f"{root}/{scheme}-{n}", process_group=groups[m],
                                          create=False, memory_budget=1 << 20, chunk_bytes=256) as ckpt:
                            assert ckpt.restore(got, step) == step
                        assert got["step"] == step
                        for name, x in want["tensors"].items():
                            a, b = local_of(got["tensors"][name]), local_of(x)
                            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), \
                                (scheme, n, target, m, step, name)
                        checked += 1
    return checked


def test_restore_every_n_to_m_crosswise(tmp_path):
    results = check_ok(run_ranks(reshard_job, 4, str(tmp_path), str(tmp_path), deadline=300))
    # rank r takes part in every restore with m > r: 3 x 4 x 3 x (4 - r) x 2 steps
    assert results == [3 * 4 * 3 * (4 - r) * 2 for r in range(4)]
