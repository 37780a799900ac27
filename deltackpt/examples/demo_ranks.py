"""The demo's restore on several ranks: spawned gloo ranks each restore a step into their
row-wise shards and compare them with the state saved at that step."""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import socket
import tempfile
import time
import warnings
from typing import Any

import torch

from .. import statetree
from ..checkpointer import Checkpointer
from ..format import dtypes
from ..sharding import Shard, row_block
from .snapshots import Snapshot, plain, same_bits


def restore_on_ranks(store: str, options: dict[str, str], step: int, world: int, want: Snapshot,
                     timeout: float = 600.0) -> list[dict[str, Any]]:
    """Restores ``step`` on ``world`` spawned gloo ranks, each into its row-wise shards, and has
    each rank compare its shards with ``want``; returns each rank's report (``ok``, ``error``)."""
    methods = mp.get_all_start_methods()
    ctx: Any = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
    if "forkserver" in methods:
        ctx.set_forkserver_preload(["torch", "torch.distributed", "deltackpt.examples.demo_ranks"])
    with tempfile.TemporaryDirectory(prefix="deltackpt-demo-") as tmp:
        reference = os.path.join(tmp, "reference.pt")
        torch.save(want[0], reference)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(r, world, port, store, options, step, reference, outs[r]))
                 for r in range(world)]
        for p in procs:
            p.start()
        end = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        results = []
        for r, (p, path) in enumerate(zip(procs, outs)):
            if p.is_alive():
                p.kill()
                p.join()
            if os.path.exists(path):
                with open(path) as f:
                    res = json.load(f)
                if "tree" in res and res.pop("tree") != want[1]:
                    res.update(ok=False, mismatched=res.get("mismatched", []) + ["<skeleton>"])
            else:
                res = {"rank": r, "ok": False, "error": f"rank {r} died (exit code {p.exitcode})"}
            results.append(res)
    return results


def _rank_main(rank: int, world: int, port: int, store: str, options: dict[str, str], step: int,
               reference: str,
               out: str) -> None:
    """One rank: restore ``step`` into empty row-wise shards, compare them with the reference."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": rank, "ok": False}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
        with Checkpointer(store, create=False, process_group=dist.group.WORLD,
                          storage_options=options) as ckpt:
            m = ckpt.store.manifest(step)
            targets: dict[str, torch.Tensor | Shard] = {}
            for key, rec in m.tensors.items():
                # Garbage bytes first, so a tensor the restore skipped cannot pass the check.
                box = row_block(rec.shape, rank, world) if rec.shape else None
                local = torch.empty(box.shape if box else (), dtype=dtypes.from_name(rec.dtype))
                local.reshape(-1).view(torch.uint8).fill_(0xA5)
                targets[key] = local if box is None else Shard(
                    local, global_shape=rec.shape, global_offset=box.offset)
            state = statetree.build(m.tree, targets)
            t0 = time.perf_counter()
            ckpt.restore(state, step)
            result["seconds"] = round(time.perf_counter() - t0, 4)
        want = torch.load(reference, mmap=True, weights_only=True)
        bad, rows, nbytes = [], [], 0
        for key, t in targets.items():
            ref = want[key]
            if isinstance(t, Shard):
                ref = ref.narrow(0, t.global_offset[0], t.local.shape[0])
                if key.startswith("model/embeddings."):
                    rows.append((t.global_offset[0], t.global_offset[0] + t.local.shape[0]))
                t = t.local
            nbytes += t.numel() * t.element_size()
            if not same_bits(t, ref):
                bad.append(key)
        result.update(ok=not bad, mismatched=bad, tensors=len(targets), bytes=nbytes,
                      table_rows=sum(hi - lo for lo, hi in rows),
                      tree=plain(statetree.flatten(state).tree))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        with open(out + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(out + ".tmp", out)
        if dist.is_initialized():
            dist.destroy_process_group()
