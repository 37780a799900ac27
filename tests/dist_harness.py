"""Runs a function on several gloo ranks (forkserver children with torch preloaded) and returns
each rank's result or error, killing ranks that outlive the deadline."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def by_file(fn: Callable[..., Any]) -> tuple[str, str]:
    """Where a test function lives, so a child can load it without the test's package on its
    path (pytest imports test files by path)."""
    return fn.__code__.co_filename, fn.__name__


def call(where: tuple[str, str], *args: Any) -> Any:
    """In a child: loads the file ``where[0]`` and calls its function ``where[1]``."""
    import importlib.util

    path, name = where
    spec = importlib.util.spec_from_file_location(f"_job_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)(*args)


def _child(where: tuple[str, str], rank: int, world: int, port: int, pg_timeout: float,
           out: str, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout))
    try:
        result = ("ok", call(where, rank, world, *args))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = ("error", (type(e).__name__, str(e), getattr(e, "failures", None),
                            traceback.format_exc()))
    with open(out, "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, tmp: str, *args: Any, pg_timeout: float = 15,
              deadline: float = 120) -> list[tuple[str, Any] | None]:
    """Runs ``fn(rank, world, *args)`` on ``world`` ranks; returns per rank ("ok", result),
    ("error", (type name, message, failures, traceback)) or None (killed or crashed)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "numba", "deltackpt", "dist_harness"])
    port = free_port()
    outs = [os.path.join(tmp, f"rank{r}-{port}.pkl") for r in range(world)]
    procs = [ctx.Process(target=_child, args=(by_file(fn), r, world, port, pg_timeout, outs[r], args))
             for r in range(world)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results = []
    for out in outs:
        if os.path.exists(out):
            with open(out, "rb") as f:
                results.append(pickle.load(f))
        else:
            results.append(None)
    return results


def check_ok(results: list) -> list:
    """The ranks' results, or an AssertionError showing every rank's error."""
    bad = [(r, res) for r, res in enumerate(results) if res is None or res[0] != "ok"]
    assert not bad, "\n".join(f"rank {r}: {res if res is None else res[1][3]}" for r, res in bad)
    return [res[1] for res in results]
