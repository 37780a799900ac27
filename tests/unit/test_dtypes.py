"""Every dtype a store holds saves, deltas and restores bit for bit (the bits, never a conversion)."""

from __future__ import annotations

import pytest
import torch

from deltackpt import Checkpointer
from deltackpt.format import dtypes
from helpers import same_bits


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (0 or 1 for bool): NaN payloads included."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


@pytest.mark.parametrize("name", sorted(dtypes.NAMES))
def test_every_dtype_saves_deltas_and_restores_bit_for_bit(store_path, name):
    dtype = dtypes.from_name(name)
    gen = torch.Generator().manual_seed(0)
    state = {"rows": random_bits((40, 6), dtype, gen), "flat": random_bits((300,), dtype, gen)}
    saved = []
    with Checkpointer(store_path, dense_chunk_bytes=64) as ckpt:
        ckpt.save(0, state)
        saved.append({k: t.clone() for k, t in state.items()})
        for row in (3, 17):  # one at a time: index_put is not implemented for every dtype
            state["rows"][row] = random_bits((6,), dtype, gen)
        state["flat"][100:110] = random_bits((10,), dtype, gen)
        assert ckpt.save(1, state).kind == "delta"
        saved.append({k: t.clone() for k, t in state.items()})
        for step, want in enumerate(saved):
            got = ckpt.load(step)
            assert all(same_bits(got[k], want[k]) for k in want), (name, step)
        target = {k: torch.zeros_like(t) for k, t in state.items()}
        ckpt.restore(target, 0)
        assert all(same_bits(target[k], saved[0][k]) for k in target), name
