"""Which S3 client to build the S3 backend on: obstore vs s3fs vs boto3 against a local SeaweedFS.

Four workloads, each client running it the way it runs fastest (threads for the blocking clients,
one gathered batch for s3fs's async API):

* large puts / gets: ``--large`` objects of ``--large-mb`` MiB, all in parallel;
* ranged gets: ``--ranges`` random 64 KiB ranges of those objects, 16 at a time;
* small puts: ``--small`` objects of 4 KiB, 16 at a time.

Run: ``python bench/bench_s3_clients.py`` (starts and stops its own SeaweedFS).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from s3_server import ACCESS_KEY, REGION, SECRET_KEY, start_seaweedfs  # noqa: E402

RANGE = 64 << 10
SMALL = 4 << 10


def obstore_client(url: str, bucket: str, *, multipart: bool = True):
    import obstore
    from obstore.store import S3Store

    store = S3Store(bucket, endpoint=url, region=REGION, access_key_id=ACCESS_KEY,
                    secret_access_key=SECRET_KEY, client_options={"allow_http": True})

    def put(key: str, data: memoryview) -> None:
        obstore.put(store, key, data, use_multipart=multipart, chunk_size=16 << 20,
                    max_concurrency=8)

    def get(key: str) -> int:
        return len(obstore.get(store, key).bytes())

    def get_range(key: str, start: int) -> int:
        return len(obstore.get_range(store, key, start=start, length=RANGE))

    return put, get, get_range, None


def boto3_client(url: str, bucket: str):
    import io

    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    c = boto3.client("s3", endpoint_url=url, region_name=REGION, aws_access_key_id=ACCESS_KEY,
                     aws_secret_access_key=SECRET_KEY, config=Config(max_pool_connections=64))
    tc = TransferConfig(multipart_chunksize=16 << 20, max_concurrency=8)

    def put(key: str, data: memoryview) -> None:
        c.upload_fileobj(io.BytesIO(data), bucket, key, Config=tc)

    def get(key: str) -> int:
        return len(c.get_object(Bucket=bucket, Key=key)["Body"].read())

    def get_range(key: str, start: int) -> int:
        r = c.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{start + RANGE - 1}")
        return len(r["Body"].read())

    return put, get, get_range, None


def s3fs_client(url: str, bucket: str):
    import fsspec.asyn
    import s3fs

    fs = s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, endpoint_url=url,
                           client_kwargs={"region_name": REGION}, skip_instance_cache=True)

    def put(key: str, data: memoryview) -> None:
        fs.pipe_file(f"{bucket}/{key}", bytes(data))

    def get(key: str) -> int:
        return len(fs.cat_file(f"{bucket}/{key}"))

    def get_range(key: str, start: int) -> int:
        return len(fs.cat_file(f"{bucket}/{key}", start=start, end=start + RANGE))

    def batch(op: str, items: list) -> None:
        async def run():
            if op == "put":
                await asyncio.gather(*(fs._pipe_file(f"{bucket}/{k}", bytes(d)) for k, d in items))
            elif op == "get":
                await asyncio.gather(*(fs._cat_file(f"{bucket}/{k}") for k in items))
            else:
                await asyncio.gather(*(fs._cat_file(f"{bucket}/{k}", start=s, end=s + RANGE)
                                       for k, s in items))
        fsspec.asyn.sync(fs.loop, run)

    return put, get, get_range, batch


def measure(name: str, make, url: str, args) -> None:
    bucket = f"bench-{name.replace('_', '-')}-{time.monotonic_ns()}"
    import boto3
    boto3.client("s3", endpoint_url=url, region_name=REGION, aws_access_key_id=ACCESS_KEY,
                 aws_secret_access_key=SECRET_KEY).create_bucket(Bucket=bucket)
    put, get, get_range, batch = make(url, bucket)
    rng = np.random.default_rng(0)
    big = [memoryview(rng.integers(0, 255, args.large_mb << 20, dtype=np.uint8))
           for _ in range(args.large)]
    total = sum(len(b) for b in big)
    keys = [f"large/{i}" for i in range(args.large)]
    ranges = [(keys[int(rng.integers(args.large))], int(rng.integers(0, (args.large_mb << 20) - RANGE)))
              for _ in range(args.ranges)]
    small = [(f"small/{i}", memoryview(rng.integers(0, 255, SMALL, dtype=np.uint8)))
             for i in range(args.small)]

    def run(op, items, fn, workers):
        t = time.perf_counter()
        if batch is not None:
            batch(op, items)
        else:
            with ThreadPoolExecutor(workers) as ex:
                list(ex.map(lambda it: fn(*it) if isinstance(it, tuple) else fn(it), items))
        return time.perf_counter() - t

    t_put = run("put", list(zip(keys, big)), put, len(keys))
    t_get = run("get", keys, get, len(keys))
    t_rng = run("range", ranges, get_range, 16)
    t_small = run("put", small, put, 16)
    print(f"{name:8s} large put {total / t_put / 1e6:7.0f} MB/s   large get {total / t_get / 1e6:7.0f} MB/s"
          f"   ranged get {args.ranges / t_rng:6.0f}/s   small put {args.small / t_small:6.0f}/s",
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--large", type=int, default=8)
    p.add_argument("--large-mb", type=int, default=64)
    p.add_argument("--ranges", type=int, default=1000)
    p.add_argument("--small", type=int, default=500)
    p.add_argument("--clients", default="obstore,s3fs,boto3")
    args = p.parse_args()
    makers = {"obstore": obstore_client,
              "obstore-single": functools.partial(obstore_client, multipart=False),
              "s3fs": s3fs_client, "boto3": boto3_client}
    server = start_seaweedfs()
    try:
        print(f"SeaweedFS at {server.endpoint_url}; {args.large} x {args.large_mb} MiB large objects, "
              f"{args.ranges} ranges of 64 KiB, {args.small} small puts of 4 KiB; {os.cpu_count()} cores")
        for name in args.clients.split(","):
            measure(name, makers[name], server.endpoint_url, args)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
