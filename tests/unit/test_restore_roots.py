"""A restore sends the ranks the chain's root records, never their parts: each rank reads the
part tables its tensors need itself."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from helpers import assert_same_state

from deltackpt import Checkpointer


def test_a_restore_sends_the_ranks_the_root_records_of_its_chain_not_their_parts(store_path):
    state = {f"t{i}": torch.arange(4000, dtype=torch.float32).reshape(400, 10) + i for i in range(30)}
    with Checkpointer(store_path, chunk_bytes=256, memory_budget=1 << 16) as ckpt:
        ckpt.save(1, state)
        state["t3"][7] = -1.0
        ckpt.save(2, state)
        sent: list[tuple[str, bytes]] = []
        one = ckpt._coll.one

        def spy(phase, fn):
            out = one(phase, fn)
            sent.append((phase, pickle.dumps(out)))
            return out

        ckpt._coll.one = spy
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ckpt.restore(target) == 2
    assert_same_state(target, state)
    [chain] = [pickle.loads(message) for phase, message in sent if phase == "read_chain"]
    roots = {f"commits/{s:020d}.json": (Path(store_path) / f"commits/{s:020d}.json").read_bytes() for s in (1, 2)}
    assert dict(chain) == roots  # the roots as stored, nothing built from the part tables
    tables = sum(p.stat().st_size for p in Path(store_path, "steps").glob("*/parts.*"))
    assert tables > sum(map(len, roots.values()))
