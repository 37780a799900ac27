"""Checkpoints in S3: deltackpt on a local SeaweedFS beside deltackpt on a local directory and
beside DCP's fsspec writer (s3fs) to the same server, in one run.

State (DLRM-like, as ``bench_distributed.py``): ``--tables`` tables of ``--rows`` x 128 float32
with a row-wise Adagrad accumulator (rows,) float32 each, a dense MLP with Adam moments and a step
counter; the defaults give 2,192,687,636 B (the project baselines' peer state); ``--rows`` scales
it down. One process, no process group.

Per round and target: base save (step 0, a fresh store), restore of it into pre-allocated tensors,
then 1% of every table's rows and accumulators change and a delta save (step 1) follows; DCP has no
deltas, so its "delta" row is a save of the same step-1 state. Every restore is checked bit for
bit. Then, for deltackpt on S3, one more 1% delta goes through a counting proxy on 127.0.0.1:
request and answer bytes (request lines, headers and bodies) over the wire, beside the bytes the
delta stored.

Run: ``python bench/bench_s3.py [--rows N] [--rounds R]`` (starts a SeaweedFS of its own for each
S3 target's round and stops it after, which removes its data; needs ``pip install -e '.[test]' s3fs``). Prints a line per op and round, then a markdown table of
medians.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from common import Reserve, evict, figure, json_option, write_figures  # noqa: E402
from s3_proxy import S3Proxy  # noqa: E402
from s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Server, start_seaweedfs  # noqa: E402

from deltackpt import Checkpointer  # noqa: E402

BUCKET = "bench"


def make_state(args: argparse.Namespace) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    tables = {f"t{i}": torch.randn(args.rows, 128, generator=gen) * 0.01 for i in range(args.tables)}
    accs = {f"t{i}": torch.rand(args.rows, generator=gen) for i in range(args.tables)}
    mlp = {f"l{i}": torch.randn(1024, 1024, generator=gen) for i in range(4)}
    adam = {k: {"exp_avg": torch.zeros_like(v), "exp_avg_sq": torch.zeros_like(v)} for k, v in mlp.items()}
    return {"tables": tables, "adagrad": accs, "mlp": mlp, "adam": adam,
            "step": torch.zeros((), dtype=torch.int64)}


def tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    return {k: t for key, v in state.items() for k, t in tensors(v, f"{prefix}/{key}").items()}


def change_one_percent(state: dict[str, Any], args: argparse.Namespace, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = max(1, args.rows // 100)
    for name, table in state["tables"].items():
        ids = torch.randperm(args.rows, generator=gen)[:n]
        table[ids] += 1e-4
        state["adagrad"][name][ids] += 1.0
    state["step"] += 1


def zeros_like(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return {k: zeros_like(v) for k, v in state.items()}


def same(a: Any, b: Any) -> bool:
    ta, tb = tensors(a), tensors(b)
    return ta.keys() == tb.keys() and all(
        torch.equal(ta[k].reshape(-1).view(torch.uint8), tb[k].reshape(-1).view(torch.uint8)) for k in ta)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Deltackpt:
    """One writer kept open across the round's saves (as in training); each restore opens the
    store afresh (as a restarted job)."""

    def __init__(self, url: str, options: dict[str, str] | None):
        self.url, self.options = url, options
        self.writer = Checkpointer(url, storage_options=options)

    def save(self, step: int, state: dict[str, Any]) -> tuple[str, int]:
        info = self.writer.save(step, state)
        return info.kind, info.bytes_written

    def restore(self, target: dict[str, Any], step: int) -> None:
        with Checkpointer(self.url, storage_options=self.options, create=False) as ckpt:
            ckpt.restore(target, step)

    def close(self) -> None:
        self.writer.close()


class DCP:
    def __init__(self, url: str, endpoint: str):
        self.url = url
        self.fs = {"key": ACCESS_KEY, "secret": SECRET_KEY, "endpoint_url": endpoint,
                   "client_kwargs": {"region_name": REGION}}

    def save(self, step: int, state: dict[str, Any]) -> tuple[str, int]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        dcp.save(state, storage_writer=FsspecWriter(f"{self.url}/{step}", **self.fs))
        return "full", 0

    def close(self) -> None:
        pass

    def restore(self, target: dict[str, Any], step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        dcp.load(target, storage_reader=FsspecReader(f"{self.url}/{step}", **self.fs))


def run_round(name: str, lib: Any, args: argparse.Namespace, times: dict[str, list[float]],
              local: str | None) -> None:
    state = make_state(args)
    t = timed(lambda: lib.save(0, state))
    times.setdefault(f"{name}: base save", []).append(t)
    if local:
        evict(local)
    target = zeros_like(state)
    t = timed(lambda: lib.restore(target, 0))
    if not same(target, state):
        raise SystemExit(f"{name}: the restored base differs from the state saved")
    times.setdefault(f"{name}: restore", []).append(t)
    del target
    change_one_percent(state, args, seed=1)
    kind = ""

    def delta() -> None:
        nonlocal kind
        kind = lib.save(1, state)[0]

    t = timed(delta)
    if kind not in ("delta", "full"):
        raise SystemExit(f"{name}: the 1% change was saved as a {kind}")
    times.setdefault(f"{name}: 1% delta save", []).append(t)
    lib.close()
    print(f"{name:20s} base save {times[f'{name}: base save'][-1]:7.2f} s   restore "
          f"{times[f'{name}: restore'][-1]:7.2f} s   1% delta save {t:7.2f} s", flush=True)


def wire_bytes(server, args: argparse.Namespace) -> tuple[int, int, int, dict[str, int]]:
    """Bytes a 1% delta of deltackpt puts on the wire to S3, the bytes it stores and its requests
    by method."""
    proxy = S3Proxy(server.endpoint_url)
    try:
        url = f"s3://{BUCKET}/wire-{uuid.uuid4().hex[:8]}"
        options = {**server.options(), "endpoint_url": proxy.endpoint_url}
        state = make_state(args)
        lib = Deltackpt(url, options)
        lib.save(0, state)
        change_one_percent(state, args, seed=2)
        proxy.clear()
        kind, stored = lib.save(1, state)
        log = list(proxy.log)  # the save's requests, not those of the lease's release at close
        lib.close()
        if kind != "delta":
            raise SystemExit(f"the 1% change was saved as a {kind}")
        sent = sum(e.wire_sent for e in log)
        received = sum(e.wire_received for e in log)
        methods: dict[str, int] = {}
        for e in log:
            methods[e.method] = methods.get(e.method, 0) + 1
        return sent, received, stored, methods
    finally:
        proxy.stop()


@contextlib.contextmanager
def fresh_server() -> Iterator[S3Server]:
    """A SeaweedFS of its own for one target's round: stopping it removes its data, so the run
    never holds more than one round of one target on disk (all rounds of the full state in one
    server filled 21 GB)."""
    server = start_seaweedfs()
    try:
        server.make_bucket(BUCKET)
        yield server
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=524_288, help="rows per table (default 524,288)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--targets", default="s3,local,dcp-s3fs")
    json_option(p)
    args = p.parse_args()
    targets = args.targets.split(",")
    if "dcp-s3fs" in targets and importlib.util.find_spec("s3fs") is None:
        print("s3fs is not installed: no DCP column")
        targets.remove("dcp-s3fs")
    nbytes = sum(t.numel() * t.element_size() for t in tensors(make_state(args)).values())
    scratch = tempfile.mkdtemp(prefix="bench-s3-", dir=os.environ.get("BENCH_DIR", "."))
    reserve = Reserve(0)
    try:
        print(f"state {nbytes:,} B ({args.tables} tables of {args.rows:,} x 128 fp32 + Adagrad, "
              f"dense MLP + Adam); a fresh local SeaweedFS per S3 round; {os.cpu_count()} cores",
              flush=True)
        times: dict[str, list[float]] = {}
        for r in range(args.rounds):
            for target in targets:
                tag = uuid.uuid4().hex[:8]
                if target == "s3":
                    with fresh_server() as server:
                        lib: Any = Deltackpt(f"s3://{BUCKET}/{tag}", server.options())
                        run_round("deltackpt s3", lib, args, times, None)
                elif target == "local":
                    path = os.path.join(scratch, tag)
                    run_round("deltackpt local dir", Deltackpt(path, None), args, times, path)
                    shutil.rmtree(path)
                else:
                    with fresh_server() as server:
                        lib = DCP(f"s3://{BUCKET}/dcp-{tag}", server.endpoint_url)
                        run_round("DCP fsspec s3fs", lib, args, times, None)
            reserve.hold()
        with fresh_server() as server:
            sent, received, stored, methods = wire_bytes(server, args)
        print(f"\n| op | median s | GB/s of state |\n| --- | --- | --- |")
        for op, ts in times.items():
            m = statistics.median(ts)
            print(f"| {op} | {m:.2f} | {nbytes / m / 1e9:.2f} |")
        print(f"\n1% delta on S3: {stored:,} B stored; {sent:,} B sent and {received:,} B received over "
              f"the wire ({sent / stored:.3f}x the stored bytes sent); {sum(methods.values())} "
              f"requests ({', '.join(f'{n} {m}' for m, n in sorted(methods.items()))})")
        rows = []
        for op, ts in times.items():
            lib, what = op.split(": ", 1)
            peer = next((f"{p}: {what}" for p in ("DCP fsspec s3fs", "deltackpt local dir")
                         if p != lib and f"{p}: {what}" in times), None)
            rows.append(figure(op, ts, peer=peer, peer_runs=times.get(peer or "")))
        rows.append(figure("1% delta on S3: bytes sent over the wire", sent, "B", peer="bytes stored",
                           peer_runs=stored))
        write_figures(args.json, "bench_s3", args, rows, state_bytes=nbytes)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
