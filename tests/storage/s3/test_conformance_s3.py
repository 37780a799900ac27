"""The shipped storage conformance suite on real S3 servers (SeaweedFS and moto)."""

from __future__ import annotations

import uuid

import pytest
from s3_server import BUCKET

from deltackpt.storage import open_storage
from deltackpt.storage.conformance import StorageConformance
from deltackpt.storage.s3 import S3Storage


class TestS3Storage(StorageConformance):
    @pytest.fixture(autouse=True)
    def _server(self, s3_server):
        self.server = s3_server

    def make_storage(self, tmp_path):
        storage = open_storage(f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}", self.server.options())
        assert isinstance(storage, S3Storage)
        return storage
