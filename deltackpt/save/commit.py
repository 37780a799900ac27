"""The commit phase of a save, on the coordinator: the step's record from every rank's files."""

from __future__ import annotations

import time
from typing import Any

from ..errors import StateError, StepExistsError
from ..format.encodings import Encoding, chunk_shape
from ..format.layout import pack_name
from ..format.manifest import ChunkMap, Manifest, PartRecord, TensorRecord
from ..ops.lease import Lease
from ..ops.lease import check as check_lease
from ..store import Store
from .decide import itemsize, tensor_bytes
from .types import Kind, SavePlan, WriteResult


def build_manifest(save: SavePlan, results: list[WriteResult], *, head: Manifest | None,
                   world_size: int, policy: dict[str, Any], sizes: tuple[int, int]) -> Manifest:
    """The commit record of a save: every part with the chunks every rank wrote for it, and
    the files of every pack."""
    step, kind, attempt, plan, changed = save.step, save.kind, save.attempt, save.plan, save.changed
    files: dict[tuple[str, str], ChunkMap] = {}
    packs: dict[str, ChunkMap] = {}
    for r in results:
        for where, chunks in r.files.items():
            files.setdefault(where, {}).update(chunks)
        packs.update(r.packs)
    tensors = {}
    for t in plan.tensors.values():
        enc = Encoding.of(kind, t.global_shape)
        parts = tuple(
            PartRecord(p.box.offset, p.box.shape, p.path,
                       chunk_shape(enc, p.box.shape, itemsize(t.dtype), changed[(t.key, p.path)], *sizes),
                       changed[(t.key, p.path)], files.get((t.key, p.path), {}),
                       pack_name(p.writer) if kind == Kind.DELTA and changed[(t.key, p.path)] else None)
            for p in t.parts
        )
        tensors[t.key] = TensorRecord(t.dtype, t.global_shape, enc, parts)
    delta = head is not None and kind == Kind.DELTA
    if kind == Kind.DELTA and head is None:
        raise StateError(f"step {step}: a delta needs the step it applies to")
    return Manifest(
        step=step,
        kind=kind,
        attempt=attempt,
        parent=head.step if head is not None and delta else None,
        parent_attempt=head.attempt if head is not None and delta else None,
        base=head.base if head is not None and delta else step,
        chain_length=head.chain_length + 1 if head is not None and delta else 0,
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


def commit(store: Store, save: SavePlan, results: list[WriteResult], *, head: Manifest | None,
           world_size: int, policy: str, sizes: tuple[int, int], lease: Lease | None) -> Manifest:
    """Coordinator: the commit record from every rank's files, created only if absent, while
    ``lease`` still holds.

    Raises:
        WriterConflictError: another writer took the lease over.
        StepExistsError: another writer committed the step meanwhile.
    """
    manifest = build_manifest(
        save, results, head=head, world_size=world_size,
        policy={"name": policy, "decision": str(save.kind), "reason": save.reason}, sizes=sizes)
    if lease is None:
        raise StepExistsError(f"step {save.step}: the coordinator holds no writer lease")
    check_lease(store, lease)
    if not store.commit(manifest):
        raise StepExistsError(f"step {save.step} was committed by another writer meanwhile")
    return manifest
