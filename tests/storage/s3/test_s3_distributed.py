"""A 2-rank save into a bucket and its restore on 1, 2 and 3 ranks (gloo), bit for bit."""

from __future__ import annotations

import uuid

import torch
import torch.distributed as dist
from dist_harness import check_ok, run_ranks
from s3_server import BUCKET

from deltackpt import Checkpointer, Shard

TABLES = {"t0": (101, 8), "t1": (37, 3)}
STEPS = (1, 2, 3, 4)


def reference(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ref = {name: torch.randn(shape, generator=gen) for name, shape in TABLES.items()}
    ref["dense"] = torch.randn(300, generator=gen)
    for s in range(1, step + 1):
        for name, (rows, _) in TABLES.items():
            ref[name][torch.randint(0, rows, (4,), generator=gen)] += 0.5
        ref["dense"][s] = float(s)
    return ref


def rows_of(t: torch.Tensor, rank: int, world: int) -> Shard:
    block = -(-t.shape[0] // world)
    lo, hi = min(t.shape[0], rank * block), min(t.shape[0], (rank + 1) * block)
    return Shard(t[lo:hi].clone(), global_shape=tuple(t.shape), global_offset=(lo,) + (0,) * (t.dim() - 1))


def state_at(ref: dict, rank: int, world: int, step: int) -> dict:
    tensors = {n: rows_of(t, rank, world) for n, t in ref.items() if n in TABLES}
    tensors["dense"] = ref["dense"].clone()  # replicated
    return {"tensors": tensors, "step": step}


def job(rank: int, world: int, url: str, options: dict) -> int:
    groups = {n: dist.new_group(list(range(n)), backend="gloo") for n in range(1, world + 1)}
    if rank < 2:
        with Checkpointer(url, storage_options=options, process_group=groups[2], base_every=100,
                          chunk_bytes=256) as ckpt:
            kinds = [ckpt.save(s, state_at(reference(s), rank, 2, s)).kind for s in STEPS]
        assert kinds == ["base", "delta", "delta", "delta"], kinds
    dist.barrier()
    checked = 0
    for m in (1, 2, 3):
        if rank >= m:
            continue
        for step in (2, STEPS[-1]):
            want = state_at(reference(step), rank, m, step)
            got = state_at({k: torch.zeros_like(v) for k, v in reference(0).items()}, rank, m, 0)
            with Checkpointer(url, storage_options=options, process_group=groups[m], create=False) as ckpt:
                assert ckpt.restore(got, step) == step
            assert got["step"] == step
            for name, x in want["tensors"].items():
                a = got["tensors"][name]
                a, b = (a.local, x.local) if isinstance(x, Shard) else (a, x)
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (m, step, name)
            checked += 1
    return checked


def test_two_ranks_save_and_one_two_or_three_restore(s3_server, tmp_path):
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    results = check_ok(run_ranks(job, 3, str(tmp_path), url, s3_server.options(), deadline=240))
    assert results == [6, 4, 2]
