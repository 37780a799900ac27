"""DTensor states, and deltackpt inside a torchrun job."""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.distributed as dist

from deltackpt import Checkpointer
from dist_harness import check_ok, free_port, run_ranks

JOB = '''
import sys, torch, torch.distributed as dist
from deltackpt import Checkpointer, Shard
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
table = torch.arange(60.0).reshape(20, 3)
with Checkpointer(sys.argv[1], base_every=3) as ckpt:
    kinds = []
    for step in range(1, 5):
        table[step] += 100
        local = table[rank * 10:(rank + 1) * 10].clone()
        kinds.append(ckpt.save(step, {"t": Shard(local, global_shape=(20, 3), global_offset=(rank * 10, 0)),
                                      "step": step}).kind)
assert kinds == ["base", "delta", "delta", "base"], kinds
dist.destroy_process_group()
'''


def test_torchrun_job(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(script), str(tmp_path / "store")],
        capture_output=True, text=True, timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    with Checkpointer(tmp_path / "store", create=False) as ckpt:
        assert ckpt.steps() == [1, 2, 3, 4]
        want = torch.arange(60.0).reshape(20, 3)
        want[1:5] += 100
        assert torch.equal(ckpt.load(4)["t"], want)
        assert ckpt.store.manifest(4).world_size == 2


def dtensor_job(rank: int, world: int, root: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    table = torch.randn(11, 6, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(6, generator=torch.Generator().manual_seed(1))
    rows = distribute_tensor(table, mesh, [Shard(0)])
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {"t": rows, "b": distribute_tensor(bias, mesh, [Replicate()])})
        rows.to_local()[0] += 1  # changes row 0 of rank 0's block, row 6 on rank 1
        ckpt.save(2, {"t": rows, "b": distribute_tensor(bias, mesh, [Replicate()])})
        cols = distribute_tensor(torch.zeros(11, 6), mesh, [Shard(1)])
        target = {"t": cols, "b": distribute_tensor(torch.zeros(6), mesh, [Replicate()])}
        ckpt.restore(target, 2)
    want = table.clone()
    want[[0, 6]] += 1
    full = target["t"].full_tensor()
    dist.barrier()
    return torch.equal(full, want) and torch.equal(target["b"].to_local(), bias)


def test_dtensor_saved_row_wise_restores_column_wise(tmp_path):
    assert check_ok(run_ranks(dtensor_job, 2, str(tmp_path), str(tmp_path / "store"))) == [True, True]
