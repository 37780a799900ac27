"""Where the bytes go: the :class:`Storage` protocol, its backends, and :func:`open_storage`.

Backends: :class:`LocalStorage` (a directory), :class:`MemoryStorage` (this process's memory),
:class:`~deltackpt.storage.s3.S3Storage` (an S3-compatible bucket, ``s3://`` URLs; needs
``pip install 'deltackpt[s3]'``), and :class:`FaultInjection` wrapping any of them for tests.
:mod:`deltackpt.storage.conformance` holds the tests every backend passes.
"""

from __future__ import annotations

from .base import Capabilities, PointHook, Storage
from .faults import FaultInjection
from .local import LocalStorage
from .memory import MemoryStorage
from .schemes import OPENERS, open_storage, storage_options

__all__ = [
    "OPENERS",
    "Capabilities",
    "FaultInjection",
    "LocalStorage",
    "MemoryStorage",
    "PointHook",
    "Storage",
    "open_storage",
    "storage_options",
]
