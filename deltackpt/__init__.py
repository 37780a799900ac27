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
    ClosedError,
    ConvertError,
    DeltackptError,
    DtypeMismatchError,
    HookClosedError,
    IntegrityError,
    KeyMismatchError,
    ManifestError,
    MissingChunkError,
    OutputExistsError,
    ReentrantCallError,
    SettingError,
    ShapeMismatchError,
    StateError,
    StepExistsError,
    StepNotFoundError,
    StorageFullError,
    StoreError,
    StreamGapError,
    WriterConflictError,
)
from .hooks import CheckpointHook
from .io.staging import release_staging_memory
from .ops.compaction import CompactInfo
from .ops.export import ExportInfo, export
from .ops.gc import GCReport, Retention
from .ops.importing import import_checkpoint
from .ops.verify import VerifyReport
from .policy import (
    BasePolicy,
    ChainLimit,
    ChainState,
    Decision,
    Differential,
    EveryK,
    Intermittent,
)
from .quantization import ByRestores, QuantizationError, Rowwise
from .rng import RngState
from .save.pending import SaveHandle
from .sharding import Shard
from .storage import Capabilities, LocalStorage, MemoryStorage, Storage, open_storage
from .stream import StepDelta, TensorDelta
from .tracking.marks import Canary
from .tracking.rows import TrackHandle

__all__ = [
    "BasePolicy",
    "BrokenChainError",
    "ByRestores",
    "Canary",
    "Capabilities",
    "ChainLimit",
    "ChainState",
    "CheckpointAborted",
    "CheckpointHook",
    "Checkpointer",
    "ClosedError",
    "CompactInfo",
    "ConvertError",
    "Decision",
    "DeltackptError",
    "Differential",
    "DtypeMismatchError",
    "EveryK",
    "ExportInfo",
    "GCReport",
    "HookClosedError",
    "IntegrityError",
    "Intermittent",
    "KeyMismatchError",
    "LocalStorage",
    "ManifestError",
    "MemoryStorage",
    "MissingChunkError",
    "OutputExistsError",
    "QuantizationError",
    "ReentrantCallError",
    "Retention",
    "RngState",
    "Rowwise",
    "SaveHandle",
    "SaveInfo",
    "SettingError",
    "ShapeMismatchError",
    "Shard",
    "StateError",
    "StepDelta",
    "StepExistsError",
    "StepNotFoundError",
    "Storage",
    "StorageFullError",
    "StoreError",
    "StreamGapError",
    "TensorDelta",
    "TrackHandle",
    "VerifyReport",
    "WriterConflictError",
    "export",
    "import_checkpoint",
    "open_storage",
    "release_staging_memory",
]
