"""open_storage: one opener per URL scheme, plain paths as local ones."""

from __future__ import annotations

import pytest

from deltackpt import StoreError
from deltackpt.storage import LocalStorage, MemoryStorage, open_storage


def test_plain_paths_and_file_urls_open_local_storage(tmp_path):
    for url in (str(tmp_path), tmp_path, f"file://{tmp_path}"):
        storage = open_storage(url)
        assert isinstance(storage, LocalStorage) and storage.root == str(tmp_path)


def test_a_storage_object_is_returned_as_it_is():
    storage = MemoryStorage()
    assert open_storage(storage) is storage
    with pytest.raises(StoreError, match="'region'"):
        open_storage(storage, {"region": "x"})


def test_unknown_schemes_and_options_are_refused(tmp_path):
    with pytest.raises(StoreError, match="no storage backend for scheme 'gopher'.*known: \\['file'"):
        open_storage("gopher://host/store")
    with pytest.raises(StoreError, match="takes no storage_options, got \\['anon'\\]"):
        open_storage(str(tmp_path), {"anon": True})
