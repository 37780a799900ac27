"""Real S3 servers for these tests, started once per session on 127.0.0.1 and stopped at its end.

``s3_server`` is each of SeaweedFS (the primary target) and moto's server mode in turn;
``s3_url`` a fresh, empty store URL in its bucket, with ``s3_options`` to reach it.
"""

from __future__ import annotations

import uuid

import pytest
from s3_server import BUCKET, S3Server, start_moto, start_seaweedfs

STARTERS = {"seaweedfs": start_seaweedfs, "moto": start_moto}


@pytest.fixture(scope="session")
def s3_servers():
    """The servers started so far, by kind; all stopped at the end of the session."""
    running: dict[str, S3Server] = {}
    yield running
    for server in running.values():
        server.stop()


@pytest.fixture(scope="session", params=sorted(STARTERS, reverse=True))
def s3_server(request, s3_servers) -> S3Server:
    kind = request.param
    if kind not in s3_servers:
        server = STARTERS[kind]()
        server.make_bucket(BUCKET)
        s3_servers[kind] = server
    return s3_servers[kind]


@pytest.fixture
def s3_options(s3_server) -> dict[str, str]:
    return s3_server.options()


@pytest.fixture
def s3_url(s3_server) -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
