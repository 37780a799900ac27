"""The pieces of a save between plan and commit: change summaries, array metadata, chunk writes
and the commit record.

``sizes`` is ``(chunk_bytes, dense_chunk_bytes)``, the same on every rank (the planner checks),
so the coordinator, which writes every array's metadata, and the rank that writes a part's chunks
agree on the chunk grid.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..format import dtypes
from ..format.encodings import chunk_shape
from ..format.layout import pack_name, part_folder
from ..format.manifest import ChunkMap, Manifest, PartRecord, TensorRecord
from ..io.writer import StepWriter
from ..policy import BasePolicy, ChainState
from ..tracking.changes import TensorChange, is_row_sparse
from .planner import GlobalPlan, PartPlan, TensorPlan


@dataclass(frozen=True)
class PartScan:
    """What changed in one part, as the rank that writes it found.

    Attributes:
        key: the tensor.
        path: the part.
        complete: False when there is nothing to compare with: the part must be written whole.
        changed: rows (row-sparse tensors) or chunks (dense ones) changed.
        delta_bytes: what a delta of them writes, about.
    """

    key: str
    path: str
    complete: bool
    changed: int
    delta_bytes: int


def summarize(key: str, path: str, t: torch.Tensor, change: TensorChange, chunk_elems: int) -> PartScan:
    if change.changed is None:
        return PartScan(key, path, False, 0, 0)
    n = change.changed.numel()
    if is_row_sparse(t):
        return PartScan(key, path, True, n, n * (t[0].numel() * t.element_size() + 8))
    return PartScan(key, path, True, n, n * chunk_elems * t.element_size())


def decide(policy: BasePolicy, head: Manifest | None, chain: ChainState, plan: GlobalPlan,
           scans: list[PartScan]) -> tuple[str, str, dict[tuple[str, str], int]]:
    """Coordinator: base or delta, why, and the rows or chunks each part will hold."""
    if head is None:
        kind, reason = "base", "no earlier step saved or restored by this checkpointer"
    elif not all(s.complete for s in scans):
        kind, reason = "base", "a tensor is new, or its dtype, shape or layout changed"
    else:
        full_bytes = sum(tensor_bytes(t) for t in plan.tensors.values())
        decision = policy.decide(chain, sum(s.delta_bytes for s in scans), full_bytes)
        kind, reason = decision.kind, decision.reason
    if kind == "base":
        return kind, reason, {(t.key, p.path): p.box.shape[0] if p.box.shape else 1
                              for t in plan.tensors.values() for p in t.parts}
    return kind, reason, {(s.key, s.path): s.changed for s in scans}


def encoding(kind: str, shape: tuple[int, ...]) -> str:
    """How a tensor is stored in a step of this kind."""
    if kind == "base":
        return "full"
    return "rows" if len(shape) >= 2 else "chunks"


def itemsize(dtype_name: str) -> int:
    return torch.empty((), dtype=dtypes.from_name(dtype_name)).element_size()


def tensor_bytes(t: TensorPlan) -> int:
    return math.prod(t.global_shape) * itemsize(t.dtype)


def describe(writer: StepWriter, plan: GlobalPlan, kind: str, changed: dict[tuple[str, str], int],
             sizes: tuple[int, int]) -> None:
    """Coordinator: writes the zarr metadata of every array and group of the step (of a base;
    a delta's chunks go into packs, which their writers describe)."""
    folders = {""}
    if kind == "base":
        for t in plan.tensors.values():
            for p in t.parts:
                cs = chunk_shape("full", p.box.shape, itemsize(t.dtype), changed[(t.key, p.path)], *sizes)
                writer.array(t.key, p.path, p.box.shape, cs, dtypes.from_name(t.dtype))
                names = part_folder(t.key, p.path).split("/")
                folders.update("/".join(names[:i]) for i in range(1, len(names)))
    writer.groups(sorted(folders))


def write_part(writer: StepWriter, kind: str, key: str, part: PartPlan, t: torch.Tensor,
               change: TensorChange, n: int, sizes: tuple[int, int]) -> TensorChange:
    """The part's writer: queues the chunks of its part ``t``. Returns ``change``, with the
    hashes of what a delta wrote filled in where the change set left them to the writer."""
    enc = encoding(kind, tuple(t.shape))
    cs = chunk_shape(enc, part.box.shape, t.element_size(), n, *sizes)
    hashes = torch.empty(n, dtype=torch.int64) if change.partial and change.hashes is None else None
    if enc == "full":
        writer.full(key, part.path, t, cs)
        return change
    if enc == "rows":
        writer.rows(key, part.path, t, change.changed, part.box.offset[0], cs[0], hash_into=hashes)
    else:
        writer.chunks(key, part.path, t, change.changed.tolist(), cs[0], hash_into=hashes)
    return change if hashes is None else replace(change, hashes=hashes)


def build_manifest(*, step: int, kind: str, attempt: str, head: Manifest | None, world_size: int,
                   policy: dict[str, Any], plan: GlobalPlan, changed: dict[tuple[str, str], int],
                   files: dict[tuple[str, str], ChunkMap], packs: dict[str, ChunkMap],
                   sizes: tuple[int, int]) -> Manifest:
    """The commit record of a save: every part with the chunks every rank wrote for it, and
    the files of every pack."""
    tensors = {}
    for t in plan.tensors.values():
        enc = encoding(kind, t.global_shape)
        parts = tuple(
            PartRecord(p.box.offset, p.box.shape, p.path,
                       chunk_shape(enc, p.box.shape, itemsize(t.dtype), changed[(t.key, p.path)], *sizes),
                       changed[(t.key, p.path)], files.get((t.key, p.path), {}),
                       pack_name(p.writer) if kind == "delta" and changed[(t.key, p.path)] else None)
            for p in t.parts
        )
        tensors[t.key] = TensorRecord(t.dtype, t.global_shape, enc, parts)
    delta = kind == "delta"
    return Manifest(
        step=step,
        kind=kind,
        attempt=attempt,
        parent=head.step if delta else None,
        parent_attempt=head.attempt if delta else None,
        base=head.base if delta else step,
        chain_length=head.chain_length + 1 if delta else 0,
        world_size=world_size,
        created=time.time(),
        policy=policy,
        tree=plan.tree,
        tensors=tensors,
        packs=packs,
        # Files only: a packed chunk's bytes are counted in its pack's files.
        bytes_written=sum(e[0] for chunks in [*files.values(), *packs.values()]
                          for e in chunks.values() if len(e) == 2),
        state_bytes=sum(tensor_bytes(t) for t in plan.tensors.values()),
    )
