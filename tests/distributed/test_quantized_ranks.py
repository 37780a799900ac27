"""Quantized deltas saved on 2 ranks (row- and column-wise shards) restore on 1 and 2 ranks
within the recorded bound; the exact tensors of the same store stay bit-exact."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from deltackpt import Checkpointer, Decision, Rowwise, Shard
from dist_harness import check_ok, run_ranks

ROWS, COLS = 60, 10


class _Deltas:
    name = "deltas"

    def decide(self, chain, delta_bytes, full_bytes):
        return Decision("delta", "always")


def reference(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ref = {"emb": torch.randn(ROWS, COLS, generator=g) * 0.1, "acc": torch.randn(ROWS, COLS, generator=g)}
    for _ in range(step):
        ids = torch.randint(0, ROWS, (5,), generator=g)
        ref["emb"][ids] += 0.05
        ref["acc"][ids] += 1.0
    return ref


def shard(t: torch.Tensor, dim: int, rank: int, world: int) -> Shard:
    block = -(-t.shape[dim] // world)
    lo, hi = min(t.shape[dim], rank * block), min(t.shape[dim], (rank + 1) * block)
    offset = [0, 0]
    offset[dim] = lo
    return Shard(t.narrow(dim, lo, hi - lo).clone(), global_shape=tuple(t.shape), global_offset=tuple(offset))


def job(rank: int, world: int, root: str) -> float:
    one = dist.new_group([0], backend="gloo")
    worst = 0.0
    for dim in (0, 1):
        path = f"{root}/d{dim}"
        with Checkpointer(path, policy=_Deltas(), quantize={"emb": Rowwise(bits=4)}, chunk_bytes=256,
                          memory_budget=4096) as ckpt:
            for step in range(3):
                ref = reference(step)
                ckpt.save(step, {k: shard(v, dim, rank, world) for k, v in ref.items()})
        dist.barrier()
        with open(os.path.join(path, "commits", f"{2:020d}.json")) as f:
            bound = json.load(f)["tensors"]["emb"]["lossy"]["chain_bound"]
        ref = reference(2)
        for m, group in ((world, None), (1, one)):
            if rank >= m:
                continue
            got = {k: shard(torch.zeros_like(v), 0, rank, m) for k, v in ref.items()}
            with Checkpointer(path, process_group=group, create=False) as ckpt:
                ckpt.restore(got, 2)
            want = {k: shard(v, 0, rank, m) for k, v in ref.items()}
            assert torch.equal(got["acc"].local, want["acc"].local), (dim, m)
            err = float((got["emb"].local - want["emb"].local).abs().max())
            assert err <= bound, (dim, m, err, bound)
            worst = max(worst, err)
        dist.barrier()
    return worst


def test_quantized_deltas_across_ranks(tmp_path):
    results = check_ok(run_ranks(job, 2, str(tmp_path), str(tmp_path), deadline=200))
    assert max(results) > 0  # rows were quantized
