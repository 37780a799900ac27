"""open_storage: one opener per URL scheme, plain paths as local ones."""

from __future__ import annotations

import pytest
from helpers import assert_runs_fresh

from deltackpt import SettingError
from deltackpt.storage import LocalStorage, MemoryStorage, open_storage


def test_plain_paths_and_file_urls_open_local_storage(tmp_path):
    for url in (str(tmp_path), tmp_path, f"file://{tmp_path}"):
        storage = open_storage(url)
        assert isinstance(storage, LocalStorage) and storage.root == str(tmp_path)


def test_a_storage_object_is_returned_as_it_is():
    storage = MemoryStorage()
    assert open_storage(storage) is storage
    with pytest.raises(SettingError, match="'region'"):
        open_storage(storage, {"region": "x"})


def test_unknown_schemes_and_options_are_refused(tmp_path):
    with pytest.raises(SettingError, match="no storage backend for scheme 'gopher'.*known: \\['file'"):
        open_storage("gopher://host/store")
    with pytest.raises(SettingError, match="takes no storage_options, got \\['anon'\\]"):
        open_storage(str(tmp_path), {"anon": True})
    # An empty path (an unset variable, say) opened the working folder as a store; an object
    # that is no storage failed later with an AttributeError.
    with pytest.raises(SettingError, match="a store's path must be a non-empty string, got ''"):
        open_storage("")
    with pytest.raises(SettingError, match="a store is a path, a URL or a Storage, got int"):
        open_storage(5)  # type: ignore[arg-type]


def test_the_s3_client_loads_with_the_first_s3_url(tmp_path):
    code = ("import sys, deltackpt\n"
            f"deltackpt.Checkpointer({str(tmp_path)!r}).close()\n"
            "assert 'deltackpt.storage.s3' not in sys.modules, 'a local store loaded the S3 client'\n"
            "from deltackpt.storage import open_storage\n"
            "s = open_storage('s3://bucket/prefix', {'endpoint_url': 'http://127.0.0.1:9', 'region': 'us-east-1',\n"
            "                                        'access_key_id': 'k', 'secret_access_key': 's'})\n"
            "assert type(s).__name__ == 'S3Storage' and 'deltackpt.storage.s3' in sys.modules\n")
    assert_runs_fresh(code)
