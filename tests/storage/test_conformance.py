"""The shipped storage conformance suite, run on the local and in-memory backends."""

from __future__ import annotations

from deltackpt.storage import LocalStorage, MemoryStorage
from deltackpt.storage.conformance import StorageConformance


class TestLocalStorage(StorageConformance):
    def make_storage(self, tmp_path):
        return LocalStorage(tmp_path)


class TestMemoryStorage(StorageConformance):
    def make_storage(self, tmp_path):
        return MemoryStorage()
