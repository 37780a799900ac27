"""deltackpt: incremental checkpointing for sparse PyTorch models.

Saves bases and deltas (changed embedding rows, changed dense chunks) into a zarr v3 store and
restores any committed step bit-exactly.

Example:
    >>> import tempfile, torch
    >>> import deltackpt
    >>> with deltackpt.Checkpointer(tempfile.mkdtemp(), base_every=5) as ckpt:
    ...     emb = torch.zeros(1000, 16)
    ...     _ = ckpt.save(0, {"emb": emb})
    ...     emb[7] += 1
    ...     ckpt.save(1, {"emb": emb}).kind
    'delta'
"""

from __future__ import annotations

from .checkpointer import Checkpointer, SaveInfo
from .errors import (
    BrokenChainError,
    CheckpointAborted,
    DeltackptError,
    DtypeMismatchError,
    HookClosedError,
    IntegrityError,
    KeyMismatchError,
    ManifestError,
    MissingChunkError,
    ShapeMismatchError,
    StateError,
    StepExistsError,
    StepNotFoundError,
    StorageFullError,
    StoreError,
)
from .hooks import CheckpointHook
from .policy import BasePolicy, Decision, EveryK
from .sharding import Shard
from .storage import LocalStorage, MemoryStorage, Storage, open_storage
from .tracking.rows import Canary, TrackHandle

__all__ = [
    "BasePolicy",
    "BrokenChainError",
    "Canary",
    "CheckpointAborted",
    "CheckpointHook",
    "Checkpointer",
    "Decision",
    "DeltackptError",
    "DtypeMismatchError",
    "EveryK",
    "HookClosedError",
    "IntegrityError",
    "KeyMismatchError",
    "LocalStorage",
    "MemoryStorage",
    "ManifestError",
    "MissingChunkError",
    "SaveInfo",
    "ShapeMismatchError",
    "Shard",
    "StateError",
    "StepExistsError",
    "StepNotFoundError",
    "Storage",
    "StorageFullError",
    "StoreError",
    "TrackHandle",
    "open_storage",
]
