"""A writer for the kill-mid-save tests: saves the steps of :func:`reference` after the store's
latest, one after the other, until it is killed; prints ``saved STEP`` after each commit."""

from __future__ import annotations

import torch

from deltackpt import Checkpointer


def reference(step: int) -> dict:
    """The state at ``step``: rows of a table and a slice of a dense tensor change per step."""
    gen = torch.Generator().manual_seed(7)
    emb = torch.randn(20_000, 32, generator=gen)
    dense = torch.randn(50_000, generator=gen)
    for s in range(1, step + 1):
        emb[torch.randint(0, 20_000, (200,), generator=gen)] += 1
        dense[s * 10: s * 10 + 10] = s
    return {"emb": emb, "dense": dense, "step": step}


def save_forever(url: str, options: dict) -> None:
    with Checkpointer(url, storage_options=options, take_over=True, base_every=4) as ckpt:
        step = (ckpt.latest_step() or 0) + 1
        while True:
            ckpt.save(step, reference(step))
            print("saved", step, flush=True)
            step += 1
