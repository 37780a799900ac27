"""The S3 backend's own promises: configuration, the conditional-write probe, ranged reads,
multipart uploads, and retries through faults injected by a proxy between client and server."""

from __future__ import annotations

import re
import threading
import time
import uuid

import pytest
from s3_proxy import Fault, S3Proxy
from s3_server import BUCKET

from deltackpt import SettingError, StoreError
from deltackpt.storage import open_storage, storage_options
from deltackpt.storage.s3 import S3Storage
from deltackpt.storage.s3_config import S3Config

MiB = 1 << 20


@pytest.fixture
def proxy(s3_server):
    p = S3Proxy(s3_server.endpoint_url)
    yield p
    p.stop()


def _through(proxy: S3Proxy, s3_server, **extra) -> S3Storage:
    options = {**s3_server.options(), "endpoint_url": proxy.endpoint_url, **extra}
    storage = open_storage(f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}", options)
    assert isinstance(storage, S3Storage)
    return storage


# -- configuration (no server) --------------------------------------------------------------------

def test_options_win_over_the_environment_which_wins_over_the_aws_files(tmp_path):
    (tmp_path / "config").write_text("[profile p]\nregion = eu-north-1\nendpoint_url = http://files:1\n")
    (tmp_path / "credentials").write_text(
        "[p]\naws_access_key_id = FILEKEY\naws_secret_access_key = FILESECRET\n")
    env = {"AWS_CONFIG_FILE": str(tmp_path / "config"),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"), "AWS_PROFILE": "p"}
    files = S3Config.resolve("s3://bkt/a/b/", {}, env)
    assert (files.bucket, files.prefix, files.region, files.endpoint_url) == (
        "bkt", "a/b", "eu-north-1", "http://files:1")
    assert (files.access_key_id, files.secret_access_key) == ("FILEKEY", "FILESECRET")
    env |= {"AWS_ENDPOINT_URL": "http://env:2", "AWS_REGION": "ap-south-1",
            "AWS_ACCESS_KEY_ID": "ENVKEY", "AWS_SECRET_ACCESS_KEY": "ENVSECRET"}
    from_env = S3Config.resolve("s3://bkt", {}, env)
    assert (from_env.prefix, from_env.endpoint_url, from_env.region) == ("", "http://env:2", "ap-south-1")
    assert (from_env.access_key_id, from_env.secret_access_key) == ("ENVKEY", "ENVSECRET")
    opts = S3Config.resolve("s3://bkt/x", {"endpoint_url": "http://opt:3", "region": "us-west-2",
                                           "access_key_id": "OPTKEY", "secret_access_key": "OPTSECRET",
                                           "retry_timeout": "5", "conditional_writes": "false"}, env)
    assert (opts.endpoint_url, opts.region, opts.access_key_id, opts.secret_access_key) == (
        "http://opt:3", "us-west-2", "OPTKEY", "OPTSECRET")
    assert opts.retry_timeout == 5.0 and opts.conditional_writes is False


def test_bad_urls_and_options_are_one_line_errors():
    """Settings: SettingError, as for the library's other settings (still a ValueError)."""
    with pytest.raises(SettingError, match=r"s3://BUCKET\[/PREFIX\], got 's3:///x'"):
        open_storage("s3:///x", {})
    with pytest.raises(SettingError, match=r"unknown S3 storage_options \['anon'\]"):
        open_storage("s3://bkt/x", {"anon": True})
    with pytest.raises(SettingError, match="part_bytes must be at least 5 MiB"):
        S3Config.resolve("s3://bkt", {"part_bytes": 1024}, {})
    with pytest.raises(SettingError, match="retry_timeout has a bad value 'soon'"):
        S3Config.resolve("s3://bkt", {"retry_timeout": "soon"}, {})
    with pytest.raises(SettingError, match="'KEY' has no secret access key"):
        S3Config.resolve("s3://bkt", {"access_key_id": "KEY"}, {})
    with pytest.raises(SettingError, match="--storage-option takes KEY=VALUE, got 'region'"):
        storage_options(["region"])


# -- against the servers --------------------------------------------------------------------------

def test_a_server_that_ignores_if_none_match_is_refused_unless_opted_out(s3_server, proxy):
    # The proxy answers the probe's second create-only PUT itself, as a server that ignores the
    # precondition would.
    proxy.add(Fault("fake_ok", method="PUT", path=r"\.deltackpt-probe/", header="If-None-Match", skip=1))
    storage = _through(proxy, s3_server)
    with pytest.raises(StoreError, match=f"server at {proxy.endpoint_url} ignores If-None-Match"):
        storage.put_if_absent("commits/1.json", b"{}")
    assert storage.size("commits/1.json") is None
    unsafe = _through(proxy, s3_server, conditional_writes=False)
    assert unsafe.put_if_absent("commits/1.json", b"{}")
    assert not unsafe.put_if_absent("commits/1.json", b"{}")


@pytest.mark.parametrize("method", ["PUT", "DELETE"])
def test_a_server_that_ignores_if_match_is_refused_unless_opted_out(s3_server, proxy, method):
    # The proxy answers the probe's request with a stale If-Match itself, as a server that ignores
    # the precondition would; the writer lease's compare-and-swap relies on it.
    proxy.add(Fault("fake_ok", method=method, path=r"\.deltackpt-probe/", header="If-Match"))
    storage = _through(proxy, s3_server)
    with pytest.raises(StoreError, match=f"server at {proxy.endpoint_url} ignores If-Match on {method}"):
        storage.swap("writer.lease", None, b"lease")
    assert storage.size("writer.lease") is None
    assert [e.target for e in proxy.log if e.fault] != []
    unsafe = _through(proxy, s3_server, conditional_writes=False)
    assert unsafe.swap("writer.lease", None, b"lease")


def test_data_goes_up_unsigned_and_records_and_the_lease_signed(s3_server, proxy):
    storage = _through(proxy, s3_server, multipart_bytes=str(5 << 20), part_bytes=str(5 << 20))
    small, large = b"chunk" * 1000, bytes(range(256)) * (24 * 1024)  # 5 KB, 6 MiB in 2 parts
    storage.write("steps/1-a/pack.0/zarr.json", [memoryview(small)])
    storage.write("steps/1-a/pack.0/c.0", [memoryview(large)])
    proxy.clear()
    assert storage.put_if_absent("commits/1.json", b"{}")
    assert storage.swap("writer.lease", None, b"lease") and storage.swap("writer.lease", b"lease", b"2")
    signed = [e for e in proxy.log if e.method == "PUT"]
    assert signed and all(re.fullmatch("[0-9a-f]{64}", e.payload) for e in signed), signed
    proxy.clear()
    storage.write("steps/1-b/zarr.json", [memoryview(small)])
    storage.write("steps/1-b/pack.0/c.0", [memoryview(large)])
    data = [e for e in proxy.log if e.method == "PUT"]
    assert len(data) == 3 and {e.payload for e in data} == {"UNSIGNED-PAYLOAD"}, data
    # Every read still checks what came back against the record's checksums (test_s3_checkpoints).
    assert storage.read("steps/1-b/pack.0/c.0") == large


def test_a_read_of_part_of_an_object_downloads_only_that_part(s3_server, proxy):
    storage = _through(proxy, s3_server)
    data = bytes(range(256)) * (16 * 1024)  # 4 MiB
    storage.write("steps/1-a/pack.0/c.0", [memoryview(data)])
    proxy.clear()
    out = bytearray(64 * 1024)
    assert storage.read_into("steps/1-a/pack.0/c.0", memoryview(out), 1_000_003) == len(data)
    assert bytes(out) == data[1_000_003: 1_000_003 + len(out)]
    assert sum(e.received for e in proxy.log) == len(out)


def test_large_objects_go_up_in_parts_and_come_back_whole(s3_server, proxy):
    storage = _through(proxy, s3_server, multipart_bytes=str(5 * MiB), part_bytes=str(5 * MiB))
    data = bytes(range(251)) * (12 * MiB // 251)
    parts = [memoryview(data)[: 3 * MiB], memoryview(data)[3 * MiB:]]
    storage.write("steps/1-a/t/c.0", parts)
    uploads = [e for e in proxy.log if e.method == "PUT" and "partNumber=" in e.target]
    assert len(uploads) == 3
    assert storage.read("steps/1-a/t/c.0") == data
    with pytest.raises(StoreError, match="object exists"):
        storage.write("steps/1-a/t/c.0", parts)


@pytest.mark.parametrize("fault", [
    Fault("status", method="PUT", status=503, times=3),
    Fault("status", method="PUT", status=500, times=2),
    Fault("drop", method="PUT", times=2),
    Fault("drop_answer", method="PUT", times=1),
], ids=["503-slowdown", "500", "dropped-mid-upload", "dropped-answer"])
def test_writes_and_commits_survive_throttling_errors_and_dropped_connections(s3_server, proxy, fault):
    storage = _through(proxy, s3_server)
    proxy.add(fault)
    storage.write("steps/1-a/t/c.0", [memoryview(b"x" * 100_000)])
    assert fault.hits == fault.times
    proxy.add(Fault(fault.action, method="PUT", path=r"commits/", status=fault.status, times=fault.times))
    # A commit whose answer was lost is retried, finds its own record there, and counts as made.
    assert storage.put_if_absent("commits/00000000000000000001.json", b'{"attempt": "1-a"}')
    assert not storage.put_if_absent("commits/00000000000000000001.json", b'{"attempt": "1-b"}')
    assert storage.read("steps/1-a/t/c.0") == b"x" * 100_000


def test_reads_survive_errors_and_retries_end_at_the_deadline(s3_server, proxy):
    storage = _through(proxy, s3_server, retry_timeout="3")
    storage.write("steps/a", [memoryview(b"abc")])
    proxy.add(Fault("status", method="GET", status=503, times=2))
    proxy.add(Fault("drop", method="HEAD", times=1))
    assert storage.read("steps/a") == b"abc"
    assert storage.size("steps/a") == 3
    data = bytes(range(256)) * 4096
    storage.write("steps/b", [memoryview(data)])
    body = proxy.add(Fault("drop_body", method="GET", times=2))
    out = bytearray(300_000)
    assert storage.read_into("steps/b", memoryview(out), 5) == len(data)
    assert bytes(out) == data[5: 300_005] and body.hits == 2
    body = proxy.add(Fault("drop_body", method="GET", times=1))
    assert storage.read("steps/b") == data and body.hits == 1
    proxy.add(Fault("status", method="GET", status=500, times=10_000))
    start = time.monotonic()
    # The server's own code and message end the one-line error (its XML document would not fit).
    said = "read s3://.*/steps/a failed: .*500.*InternalError: We encountered an internal error"
    with pytest.raises(StoreError, match=said):
        storage.read("steps/a")
    assert time.monotonic() - start < 3 + 10


@pytest.mark.parametrize("fault", ["long_body", "short_body"])
def test_a_ranged_read_the_server_answers_with_other_bytes_is_a_store_error(s3_server, proxy, fault):
    """A server that answers a range with more bytes than asked (they would overrun the
    buffer) or fewer (part of it left as it was) fails the read, naming the bytes."""
    storage = _through(proxy, s3_server)
    storage.write("steps/c", [memoryview(bytes(range(100)))])
    proxy.add(Fault(fault, method="GET", header="Range"))
    out = bytearray(20)
    said = "answered more than the 20 bytes" if fault == "long_body" else "answered 12 of the 20 bytes"
    with pytest.raises(StoreError, match=f"read s3://.*/steps/c: the server {said}.* at 10"):
        storage.read_into("steps/c", memoryview(out), 10)
    assert storage.read_into("steps/c", memoryview(out), 10) == 100 and bytes(out) == bytes(range(10, 30))


def test_swap_replaces_and_removes_only_what_it_expects(s3_url, s3_options, proxy, s3_server):
    storage = open_storage(s3_url, s3_options)
    assert storage.swap("writer.lease", None, b"a")
    assert not storage.swap("writer.lease", None, b"b")
    assert not storage.swap("writer.lease", b"x", b"b")
    assert storage.swap("writer.lease", b"a", b"b")
    assert storage.read("writer.lease") == b"b"
    assert not storage.swap("writer.lease", b"a", None)
    assert storage.swap("writer.lease", b"b", None)
    assert storage.size("writer.lease") is None
    assert storage.swap("writer.lease", None, None)
    # A replace whose answer is lost is retried and finds its own bytes in place.
    through = _through(proxy, s3_server)
    assert through.swap("writer.lease", None, b"1")
    proxy.add(Fault("drop_answer", method="PUT", path="writer.lease", header="If-Match"))
    assert through.swap("writer.lease", b"1", b"2")
    assert through.read("writer.lease") == b"2"
    # Refused replaces of bytes another writer also writes are not mistaken for one's own.
    start = threading.Barrier(8)

    def count_up() -> None:
        start.wait()
        done = 0
        while done < 10:
            seen = storage.read("counter")
            done += storage.swap("counter", seen, str(int(seen) + 1).encode())

    storage.swap("counter", None, b"0")
    threads = [threading.Thread(target=count_up) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert storage.read("counter") == b"80"


def test_stale_multipart_uploads_are_aborted(s3_server, s3_url, s3_options):
    storage = open_storage(s3_url, s3_options)
    client = s3_server.client()
    key = f"{storage.config.prefix}/steps/1-dead/pack.0/c.0"
    upload = client.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
    client.upload_part(Bucket=BUCKET, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * 1000)
    elsewhere = client.create_multipart_upload(Bucket=BUCKET, Key="other-store/c.0")["UploadId"]
    if s3_server.kind == "seaweedfs":  # moto dates every upload in 2010: all look stale
        assert storage.abort_stale_uploads(time.time() - 3600) == 0
    assert storage.abort_stale_uploads(time.time() + 60) == 1
    left = client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])
    assert [u["UploadId"] for u in left if u["Key"] == key] == []
    assert elsewhere in [u["UploadId"] for u in left]
    client.abort_multipart_upload(Bucket=BUCKET, Key="other-store/c.0", UploadId=elsewhere)
