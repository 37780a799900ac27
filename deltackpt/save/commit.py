"""The commit phase of a save, on the coordinator: the step's record from every rank's files."""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from typing import Any

from ..collector import paused
from ..errors import StateError, StepExistsError, WriterConflictError
from ..format.encodings import choose, in_pack
from ..format.layout import commit_key, pack_name
from ..format.lossy import Lossy
from ..format.manifest import (
    FORMAT,
    LOSSY_FORMAT,
    ChunkMap,
    Manifest,
    PartRecord,
    TensorRecord,
)
from ..format.record_io import encode_record
from ..ops.gc import holder_chain
from ..ops.lease import Holding
from ..ops.lease import read as read_lease
from ..store import Store
from ..quantization import Rowwise
from .decide import itemsize, tensor_bytes
from .planner import GlobalPlan
from .types import Kind, SavePlan, WriteResult


@paused()
def build_manifest(save: SavePlan, plan: GlobalPlan, changed: Mapping[tuple[str, str], int],
                   results: list[WriteResult], *, head: Manifest | None, world_size: int,
                   policy: dict[str, Any], sizes: tuple[int, int],
                   restores: int | None = None, aligned: Collection[str] = ()) -> Manifest:
    """The commit record of a save: every part of ``plan``, holding ``changed`` rows or chunks
    (by tensor key and part path), with the chunks every rank wrote for it, and the files of
    every pack; each lossy tensor's scheme and bounds, and with ``restores`` (the checkpointer
    has ``quantize=``) the quantization decisions, in a format-5 record. ``aligned``: the 1-d
    tensors whose changes are rows (see :class:`~deltackpt.save.scan.PartScan`)."""
    step, kind, attempt = save.step, save.kind, save.attempt
    files: dict[tuple[str, str], ChunkMap] = {}
    packs: dict[str, ChunkMap] = {}
    bounds: dict[str, float] = {}
    for r in results:
        for where, chunks in r.files.items():
            files.setdefault(where, {}).update(chunks)
        packs.update(r.packs)
        for key, bound in r.bounds.items():
            bounds[key] = max(bounds.get(key, 0.0), bound)
    tensors = {}
    for t in plan.tensors.values():
        rule = save.quantize[t.key].rule if t.key in save.quantize else None
        enc = choose(kind, t.global_shape, rule is not None, t.key in aligned)
        parts = tuple(
            PartRecord(p.box.offset, p.box.shape, p.path, cs,
                       changed[(t.key, p.path)], chunks,
                       # A part without chunks (nothing changed, or no elements) is in no pack.
                       pack_name(p.writer) if chunks and (kind == Kind.DELTA or in_pack(
                           p.box.shape, itemsize(t.dtype), cs)) else None, p.writer)
            for p in t.parts
            for cs in [enc.chunk_shape(p.box.shape, itemsize(t.dtype), changed[(t.key, p.path)], sizes, rule)]
            for chunks in [files.get((t.key, p.path), {})]
        )
        tensors[t.key] = TensorRecord(t.dtype, t.global_shape, enc, parts,
                                      lossy_record(kind, t.key, head, rule, bounds.get(t.key, 0.0)))
    lossy = any(r.lossy is not None for r in tensors.values())
    quantize = None if restores is None else {
        "restores": restores, "tensors": {k: c.to_doc() for k, c in sorted(save.quantize.items())}}
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
        quantize=quantize,
        format=LOSSY_FORMAT if lossy or restores is not None else FORMAT,
    )


def lossy_record(kind: Kind, key: str, head: Manifest | None, rule: Rowwise | None,
                 bound: float) -> Lossy | None:
    """A tensor's loss in a new step: this step's quantization, and what the chain carries."""
    held = head.tensors.get(key) if kind == Kind.DELTA and head is not None else None
    carried = held.lossy.chain_bound if held is not None and held.lossy is not None else 0.0
    if rule is not None and kind == Kind.DELTA:
        return Lossy(rule.scheme, bound, max(carried, bound))
    return Lossy(None, 0.0, carried) if carried > 0 else None


def commit(store: Store, save: SavePlan, plan: GlobalPlan, changed: Mapping[tuple[str, str], int],
           results: list[WriteResult], *, head: Manifest | None, world_size: int, policy: str,
           sizes: tuple[int, int], lease: Holding | None,
           restores: int | None = None, aligned: Collection[str] = ()) -> Manifest | None:
    """Coordinator: the commit record from every rank's files (see :func:`build_manifest`),
    created only if absent while ``lease`` holds, and kept only if ``lease`` still holds and the
    parent is still there once the record exists. None when the parent was gone (nothing is committed then).

    Raises:
        WriterConflictError: another writer took the lease over (the record is withdrawn unless
            the new holder builds on it, see :func:`withdraw`).
        StepExistsError: another writer committed the step meanwhile.
    """
    manifest = build_manifest(
        save, plan, changed, results, head=head, world_size=world_size,
        policy={"name": policy, "decision": str(save.kind), "reason": save.reason}, sizes=sizes,
        restores=restores, aligned=aligned)
    if lease is None:
        raise StepExistsError(f"step {save.step}: the coordinator holds no writer lease")
    lease.check()
    if not store.commit(manifest):
        lease.check()
        raise StepExistsError(f"step {save.step} was committed by another writer meanwhile")
    try:
        lease.check()
    except WriterConflictError:
        withdraw(store, manifest)
        raise
    if (manifest.parent is not None and manifest.parent_attempt is not None
            and not store.holds(manifest.parent, manifest.parent_attempt)):
        store.withdraw(manifest.step)  # the parent went after decide looked (a fenced writer's)
        return None
    return manifest


def withdraw(store: Store, manifest: Manifest) -> None:
    """Removes the record of a writer that was taken over between its lease checks, unless the
    new holder builds on it. The new holder publishes its head before it checks that the head
    exists; this reads the lease before and after removing the record, and puts the record back
    if the new holder's chain took it in meanwhile."""
    key = commit_key(manifest.step)
    mine = {key: encode_record(manifest)[0]}  # read from here once removed

    def built_on() -> bool:
        holder = read_lease(store.storage)[1]
        return holder is not None and manifest.attempt in {
            m.attempt for m in holder_chain(store, holder, mine)}

    if built_on():
        return
    store.withdraw(manifest.step)
    if built_on():
        store.storage.put_if_absent(key, mine[key])
