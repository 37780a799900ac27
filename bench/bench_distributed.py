"""Distributed save and restore: deltackpt beside torch.distributed.checkpoint (DCP), 1/2/4 ranks.

One run measures, on a DLRM-like state (default: 8 tables of 524,288 x 128 float32, a row-wise
Adagrad accumulator of (rows,) float32 per table, a replicated dense MLP with Adam moments and a
step counter; 2,192,687,636 B, the project baselines' peer state):

  two ranks   each rank holds its row block of every table and accumulator (as deltackpt.Shard,
              and the same memory as DTensor Shard(0) on a CPU gloo device mesh for DCP) and a
              replica of the dense state. Per round: deltackpt base save (step 0, fresh store);
              1% of the rows of every table and of their accumulators change in place (random
              rows, +1e-4..2e-4 on N(0, 0.01) weights, +U[0, 1) on the accumulators); deltackpt
              delta save (step 1; changes found by the row and chunk hashes, no marks); dcp.save
              of the same (delta-step) state; dcp.load into pre-allocated shards; deltackpt
              restore of step 1 into the same pre-allocated shards (a fresh Checkpointer, as a
              restarted job would open). Then the 1% change is undone for the next round.
  1 and 4     the last round's deltackpt store and DCP checkpoint (both written by 2 ranks)
  ranks       restored / loaded into row-wise shards of the right size for that world size
              (torch.chunk blocks), again deltackpt restore beside dcp.load.

Every restore and load is compared bit for bit (integer views) with the state saved: on two
ranks with the live state; on 1 and 4 ranks with a regenerated copy (the state is a pure
function of the seed, table and row block, so any rank can rebuild any rows). Each save's kind
and changed-row count are checked too. Any mismatch stops the bench with an error.

Timing: every timed op runs between two barriers; each rank times its own op and the op's time
is the maximum over the ranks. Reads are "evicted": the checkpoint files are dropped from the
page cache (posix_fadvise(DONTNEED) on the bench's own files) before each load or restore.
Memory on this VM goes back to the host within seconds of being freed and is slow to touch
again (project baselines, "cold guest memory"), so every rank holds touched "reserve" memory and
frees the part an op will allocate (page cache, DCP's read buffers) right before timing it.

Ranks: torch.multiprocessing.spawn, gloo, one torch thread each; numba (deltackpt's CPU hash
kernels) gets NUMBA_NUM_THREADS = CPUs // ranks unless set. Each launch warms both libraries up
on a tiny state first. DCP uses FileSystemWriter defaults (sync_files=True, one thread);
deltackpt writes with fsync as always.

Output: a line per round, the bytes each save wrote, then (last) a markdown table: op, world
size, median seconds, GB/s (state bytes / median seconds, the same numerator on every row, so a
delta save's figure is an effective rate) and the ratio of the median to DCP's median for the
same op and world size (deltackpt saves against dcp.save, restores against dcp.load).

--profile adds, after the timed rounds of each launch, one untimed round with rank 0's deltackpt
ops under cProfile and prints, before the table, the top functions of the calling thread and the
self time of the Python threads started meanwhile (deltackpt's I/O threads), summed over them.

Memory: about 4.2x the state over all ranks (state or expected copy, target, reserve; a peak of
~11 GiB RSS over all processes at the default size), plus page cache; disk: about 3x the state
(the current round's store and DCP checkpoint, the last round's kept for the 1- and 4-rank
launches). Scratch lives in a fresh folder under --dir, removed at the end. At the default size
the whole run takes about 3.5 minutes on the 2-core VM (more when other processes are busy).

Example:
    python bench/bench_distributed.py --repeat 3
    python bench/bench_distributed.py --tables 4 --rows 131072 --dim 64 --repeat 5 --dir /var/tmp
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import os
import pickle
import pstats
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import torch

from common import (  # bench/common.py
    Reserve, cpu_seconds, evict, figure, json_option, others_cpu, tree_bytes, write_figures,
)

MiB = 1 << 20
BLOCK = 65536  # rows generated per seeded generator: any rank can rebuild any rows
DELTA_FRACTION = 0.01
PERTURBATION = 1e-4
MLP_BOTTOM = (13, 512, 256, 128)
MLP_TOP = (479, 1024, 1024, 512, 256, 1)

OPS = {  # op -> (library, kind) ; kind decides the DCP reference for the ratio
    "deltackpt base save": ("deltackpt", "save"),
    "deltackpt 1% delta save": ("deltackpt", "save"),
    "DCP save": ("dcp", "save"),
    "deltackpt restore (delta step)": ("deltackpt", "load"),
    "DCP load": ("dcp", "load"),
}
DCP_REF = {"save": "DCP save", "load": "DCP load"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Prints a line per round, then a markdown table of medians (last).",
    )
    p.add_argument("--tables", type=int, default=8, help="embedding tables (default %(default)s)")
    p.add_argument("--rows", type=int, default=524_288, help="rows per table (default %(default)s)")
    p.add_argument("--dim", type=int, default=128, help="float32 values per row (default %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="timed rounds per launch; medians are reported "
                   "(default %(default)s)")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="folder for the scratch folder "
                   "(default %(default)s)")
    p.add_argument("--worlds", default="1,4", help="world sizes for the extra restore launches, "
                   "comma-separated; 2 ranks are always measured (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    p.add_argument("--chunk-mib", type=int, default=32, help="Checkpointer chunk_bytes in MiB "
                   "(default %(default)s)")
    p.add_argument("--io-threads", type=int, default=4, help="Checkpointer io_threads (default %(default)s)")
    p.add_argument("--profile", action="store_true", help="one extra untimed round per launch with "
                   "rank 0's deltackpt ops under cProfile; prints the top functions")
    p.add_argument("--profile-lines", type=int, default=25, help="functions listed per profiled op "
                   "(default %(default)s)")
    json_option(p)
    args = p.parse_args(argv)
    try:
        args.world_list = sorted({int(w) for w in args.worlds.split(",") if w.strip()} - {2})
    except ValueError:
        p.error(f"--worlds must be comma-separated ints, got {args.worlds!r}")
    if args.tables < 1 or args.rows < 8 or args.dim < 1 or args.repeat < 1:
        p.error("need --tables >= 1, --rows >= 8, --dim >= 1, --repeat >= 1")
    if any(w < 1 or w > args.rows for w in args.world_list):
        p.error("world sizes must be in [1, rows]")
    return args


# -- the state ---------------------------------------------------------------------------------------


def row_block(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s rows [lo, hi) of a row-wise sharding (torch.chunk's blocks, as DTensor
    Shard(0) and deltackpt's row_block split)."""
    block = -(-rows // world)
    lo = min(rows, rank * block)
    return lo, min(rows, lo + block)


def table_rows(args: argparse.Namespace, t: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [lo, hi) of table ``t`` and of its accumulator at the base step (step 0)."""
    w = torch.empty(hi - lo, args.dim)
    acc = torch.empty(hi - lo)
    for b0 in range(lo - lo % BLOCK, hi, BLOCK):
        n = min(BLOCK, args.rows - b0)
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + t * 10_007 + b0 // BLOCK)
        wb = torch.empty(n, args.dim).normal_(0.0, 0.01, generator=g)
        ab = torch.rand(n, generator=g)
        a, b = max(b0, lo), min(b0 + n, hi)
        w[a - lo:b - lo] = wb[a - b0:b - b0]
        acc[a - lo:b - lo] = ab[a - b0:b - b0]
    return w, acc


def dense_state(args: argparse.Namespace) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The replicated dense part: MLP parameters, Adam moments; the same on every rank."""
    def mlp(sizes: tuple[int, ...]) -> torch.nn.Sequential:
        layers: list[torch.nn.Module] = []
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers[:-1])

    torch.manual_seed(args.seed)
    dense = torch.nn.ModuleDict({"bot": mlp(MLP_BOTTOM), "top": mlp(MLP_TOP)})
    model, optim = {}, {}
    for k, v in dense.state_dict().items():
        model["dense." + k] = v.detach().clone()
        optim["dense." + k + ".exp_avg"] = torch.randn_like(v)
        optim["dense." + k + ".exp_avg_sq"] = torch.rand_like(v)
    optim["step"] = torch.tensor(1000)
    return model, optim


class Delta:
    """The 1% change of table ``t``: sorted global row ids and what is added to them."""

    def __init__(self, args: argparse.Namespace, t: int):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + t * 10_007 + 999_983)
        n = max(1, round(DELTA_FRACTION * args.rows))
        self.ids = torch.randperm(args.rows, generator=g)[:n].sort().values
        self.bump = PERTURBATION * (1 + torch.rand(n, args.dim, generator=g))
        self.acc_bump = torch.rand(n, generator=g)

    def local(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        keep = (self.ids >= lo) & (self.ids < hi)
        return self.ids[keep] - lo, self.bump[keep], self.acc_bump[keep]


class LocalState:
    """This rank's tensors (its row block of every table and accumulator, the dense replica) and
    views of them as a deltackpt state (Shards) and as a DCP state (DTensors)."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int, mesh: Any, *,
                 fill: str = "state"):
        self.args, self.rank, self.world = args, rank, world
        self.lo, self.hi = row_block(args.rows, rank, world)
        self.w: list[torch.Tensor] = []
        self.acc: list[torch.Tensor] = []
        for t in range(args.tables):
            if fill == "state":
                w, acc = table_rows(args, t, self.lo, self.hi)
            else:  # a restore target: pre-allocated, touched
                w = torch.full((self.hi - self.lo, args.dim), float("nan"))
                acc = torch.full((self.hi - self.lo,), float("nan"))
            self.w.append(w)
            self.acc.append(acc)
        self.dense_model, self.dense_optim = dense_state(args)
        if fill != "state":
            for d in (self.dense_model, self.dense_optim):
                for k, v in d.items():
                    d[k] = torch.zeros_like(v)
        self.mesh = mesh
        self.applied: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [*self.w, *self.acc, *self.dense_model.values(), *self.dense_optim.values()]

    def keys(self) -> list[tuple[str, str, torch.Tensor]]:
        out = [("model", f"emb.{t}.weight", w) for t, w in enumerate(self.w)]
        out += [("model", k, v) for k, v in self.dense_model.items()]
        out += [("optim", f"emb.{t}.rowwise_adagrad_sum", a) for t, a in enumerate(self.acc)]
        out += [("optim", k, v) for k, v in self.dense_optim.items()]
        return out

    def _sharded(self, key: str) -> bool:
        return key.startswith("emb.")

    def deltackpt_state(self) -> dict[str, dict[str, Any]]:
        from deltackpt import Shard

        out: dict[str, dict[str, Any]] = {"model": {}, "optim": {}}
        for top, key, t in self.keys():
            if self._sharded(key):
                gshape = (self.args.rows, *t.shape[1:])
                t = Shard(t, global_shape=gshape, global_offset=(self.lo, *(0,) * (t.dim() - 1)))
            out[top][key] = t
        return out

    def dcp_state(self) -> dict[str, dict[str, Any]]:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor import Shard as DShard

        out: dict[str, dict[str, Any]] = {"model": {}, "optim": {}}
        for top, key, t in self.keys():
            if self._sharded(key):
                gshape = torch.Size((self.args.rows, *t.shape[1:]))
                t = DTensor.from_local(t, self.mesh, [DShard(0)], run_check=False, shape=gshape,
                                       stride=torch.empty(gshape, device="meta").stride())
            out[top][key] = t
        return out

    def apply_delta(self) -> None:
        """Changes 1% of the rows of every table and their accumulators, in place."""
        assert self.applied is None
        self.applied = []
        for t in range(self.args.tables):
            ids, bump, acc_bump = Delta(self.args, t).local(self.lo, self.hi)
            self.applied.append((ids, self.w[t][ids].clone(), self.acc[t][ids].clone()))
            self.w[t].index_add_(0, ids, bump)
            self.acc[t].index_add_(0, ids, acc_bump)

    def undo_delta(self) -> None:
        assert self.applied is not None
        for t, (ids, w_before, acc_before) in enumerate(self.applied):
            self.w[t][ids] = w_before
            self.acc[t][ids] = acc_before
        self.applied = None

    def fill_nan(self) -> None:
        for t in self.tensors():
            if t.is_floating_point():
                t.fill_(float("nan"))
            else:
                t.fill_(-1)


def changed_rows_expected(args: argparse.Namespace) -> int:
    return args.tables * max(1, round(DELTA_FRACTION * args.rows))


def state_bytes(args: argparse.Namespace) -> int:
    model, optim = dense_state(args)
    dense = sum(v.numel() * v.element_size() for d in (model, optim) for v in d.values())
    return args.tables * args.rows * (args.dim + 1) * 4 + dense


# -- checks ------------------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view, so that comparisons are bitwise (NaN payloads, -0.0)."""
    if not t.is_floating_point():
        return t
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def check_equal(what: str, got: LocalState, want: LocalState) -> None:
    for (top, key, a), (_, _, b) in zip(got.keys(), want.keys()):
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(bits(a), bits(b)):
            raise AssertionError(f"{what}: {top}/{key} on rank {got.rank} of {got.world} is not "
                                 f"bit-identical to the saved state")


# -- memory and page cache: Reserve, evict, tree_bytes in bench/common.py --------------------------


# -- profiling ---------------------------------------------------------------------------------------


def _label(code: Any) -> str:
    if isinstance(code, str):
        return code
    return f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}({code.co_name})"


IDLE = {"<method 'get' of '_queue.SimpleQueue' objects>"}  # an executor worker waiting for work


class ThreadProfiles:
    """A cProfile profiler in every Python thread started while installed (an executor's worker
    threads); :meth:`totals` sums their self time per function, at any moment."""

    def __init__(self) -> None:
        self._profs: list[cProfile.Profile] = []
        self._lock = threading.Lock()

    def _start(self, frame: Any, event: str, arg: Any) -> None:
        sys.setprofile(None)
        prof = cProfile.Profile()
        with self._lock:
            self._profs.append(prof)
        prof.enable()

    def install(self) -> None:
        threading.setprofile(self._start)

    def uninstall(self) -> None:
        threading.setprofile(None)  # type: ignore[arg-type]

    def totals(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        with self._lock:
            profs = list(self._profs)
        for prof in profs:
            for e in prof.getstats():
                t = out.setdefault(_label(e.code), [0.0, 0])
                t[0] += e.inlinetime
                t[1] += e.callcount
        return out

    @staticmethod
    def diff(before: dict[str, list[float]], after: dict[str, list[float]], lines: int) -> str:
        rows = []
        for k, (tt, n) in after.items():
            tt0, n0 = before.get(k, (0.0, 0))
            if k not in IDLE and (tt - tt0 > 0 or n - n0 > 0):
                rows.append((tt - tt0, n - n0, k))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        out = [f"I/O threads: {total:.3f} s of self time in all (idle waits for work left out), "
               f"top {lines} functions:",
               "   ncalls  tottime  function"]
        out += [f"{n:9d} {tt:8.3f}  {k}" for tt, n, k in rows[:lines]]
        return "\n".join(out)


# -- one rank ----------------------------------------------------------------------------------------


class Rank:
    """Timing, settling and profiling on one rank of a launch."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int, scratch: str, share: int):
        import torch.distributed as dist

        self.dist = dist
        self.args, self.rank, self.world, self.scratch = args, rank, world, scratch
        self.share = share
        self.reserve = Reserve(int(2.2 * share))
        self.times: dict[str, list[float]] = {}
        self.errors: dict[str, str] = {}
        self.info: dict[str, Any] = {}
        self.profiles: dict[str, str] = {}
        self.profiling = False
        self.threads = ThreadProfiles()
        self.last: dict[str, float] = {}

    def barrier(self) -> None:
        self.dist.barrier()

    def max_over_ranks(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())

    def timed(self, op: str, fn: Any, *, free: float, catch: bool = False) -> Any:
        """Runs ``fn`` between barriers after freeing ``free`` x this rank's share of reserve;
        records the max over ranks. ``catch``: a failure (any BaseException, as DCP's
        CheckpointException) is recorded for the op instead of raised."""
        self.reserve.free(int(free * self.share))
        self.barrier()
        err: BaseException | None = None
        result = None
        on = self.profiling and self.rank == 0 and op.startswith("deltackpt")
        prof = cProfile.Profile() if on else None
        threads0 = self.threads.totals() if prof is not None else {}
        t0 = time.perf_counter()
        try:
            result = prof.runcall(fn) if prof is not None else fn()
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if not catch:
                raise
            err = e
        dt = time.perf_counter() - t0
        self.barrier()
        failed = self.max_over_ranks(1.0 if err is not None else 0.0)
        dt = self.max_over_ranks(dt)
        if prof is not None:
            s = io.StringIO()
            st = pstats.Stats(prof, stream=s).strip_dirs()
            st.sort_stats("cumulative").print_stats(self.args.profile_lines)
            st.sort_stats("tottime").print_stats(self.args.profile_lines)
            s.write(ThreadProfiles.diff(threads0, self.threads.totals(), self.args.profile_lines))
            self.profiles[f"{op}, {self.world} ranks, rank 0 ({dt:.3f} s max over ranks)"] = s.getvalue()
        if failed:
            msg = f"{type(err).__name__}: {err}" if err is not None else "failed on another rank"
            self.errors.setdefault(op, msg[:2000])
            return None
        self.last[op] = dt
        if not self.profiling:
            self.times.setdefault(op, []).append(dt)
        return result

    def start_profiling(self) -> None:
        """From here on: rank 0's deltackpt ops under cProfile, untimed."""
        self.profiling = True
        self.last = {}
        if self.rank == 0:
            self.threads.install()

    def round_line(self, r: int) -> str:
        what = "profiled round" if self.profiling else f"round {r + 1}/{self.args.repeat}"
        ops = self.last if self.profiling else {op: ts[-1] for op, ts in self.times.items()}
        return f"[{self.world} ranks] {what}: " + ", ".join(f"{op} {t:.3f}" for op, t in ops.items())

    def settle(self, *paths: str) -> None:
        """Evicts ``paths`` from the page cache (rank 0) and touches the reserve again."""
        self.barrier()
        if self.rank == 0:
            evict(*(p for p in paths if os.path.exists(p)))
        self.reserve.hold()
        self.barrier()

    def rm(self, *paths: str) -> None:
        self.barrier()
        if self.rank == 0:
            for p in paths:
                shutil.rmtree(p, ignore_errors=True)
        self.barrier()

    def result(self) -> dict[str, Any]:
        return {"times": self.times, "errors": self.errors, "info": self.info, "profiles": self.profiles}


def checkpointer(args: argparse.Namespace, path: str, **kw: Any) -> Any:
    import deltackpt

    kw.setdefault("chunk_bytes", args.chunk_mib * MiB)
    # The accumulators (1-d, a value per row, in a plain dict) ride with their tables' rows.
    kw.setdefault("aligned", {f"optim/emb.{t}.rowwise_adagrad_sum": f"model/emb.{t}.weight"
                              for t in range(args.tables)})
    return deltackpt.Checkpointer(path, base_every=1 << 30, io_threads=args.io_threads,
                                  timeout=datetime.timedelta(minutes=5), **kw)


def restore_delta_step(R: Rank, args: argparse.Namespace, store: str, ck_dcp: str, target: LocalState,
                       want: LocalState, world: int) -> None:
    """Times deltackpt's restore of step 1 into ``target`` (emptied first) and checks it bit for bit."""
    target.fill_nan()
    R.settle(store, ck_dcp)
    ck = checkpointer(args, store, create=False)
    try:
        step = R.timed("deltackpt restore (delta step)", lambda: ck.restore(target.deltackpt_state(), 1),
                       free=2.1)
    finally:
        ck.close()
    if step != 1:
        raise AssertionError(f"restore returned step {step}, expected 1")
    check_equal(f"deltackpt restore of the delta step, {world} ranks", target, want)


def warm_up(args: argparse.Namespace, rank: int, world: int, mesh: Any, scratch: str) -> None:
    """Both libraries once on a tiny state (imports, numba kernels, DCP planners)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    tiny = argparse.Namespace(**{**vars(args), "tables": 2, "rows": max(8, world * 4), "dim": 8})
    st = LocalState(tiny, rank, world, mesh)
    tgt = LocalState(tiny, rank, world, mesh, fill="target")
    path = os.path.join(scratch, f"warm-{world}")
    with checkpointer(args, os.path.join(path, "dck"), memory_budget=1 << 20, chunk_bytes=4096) as ck:
        ck.save(0, st.deltackpt_state())
        st.apply_delta()
        ck.save(1, st.deltackpt_state())
        ck.restore(tgt.deltackpt_state(), 1)
    check_equal("warm-up restore", tgt, st)
    try:
        dcp.save(st.dcp_state(), checkpoint_id=os.path.join(path, "dcp"))
        dcp.load(tgt.dcp_state(), checkpoint_id=os.path.join(path, "dcp"))
    except BaseException as e:  # noqa: BLE001 - reported by the timed ops
        print(f"rank {rank}: DCP warm-up failed: {type(e).__name__}: {e}", flush=True)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def init_rank(rank: int, world: int, port: int) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=5))
    return init_device_mesh("cpu", (world,))


def finish_rank(out: str, rank: int, result: dict[str, Any]) -> None:
    import torch.distributed as dist

    with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def two_rank_job(rank: int, world: int, port: int, args: argparse.Namespace, scratch: str, out: str) -> None:
    """The save phase on two ranks: base save, delta save, DCP save, DCP load, deltackpt restore."""
    import torch.distributed.checkpoint as dcp

    t_start = time.perf_counter()
    mesh = init_rank(rank, world, port)
    t_init = time.perf_counter()
    warm_up(args, rank, world, mesh, scratch)
    t0 = time.perf_counter()
    state = LocalState(args, rank, world, mesh)
    target = LocalState(args, rank, world, mesh, fill="target")
    R = Rank(args, rank, world, scratch, state.nbytes)
    if rank == 0:
        print(f"[2 ranks] process group {t_init - t_start:.1f} s, warm-up {t0 - t_init:.1f} s, state and "
              f"target built in {time.perf_counter() - t0:.1f} s ({state.nbytes / 1e9:.3f} GB on rank 0)",
              flush=True)
    want_rows = changed_rows_expected(args)

    def one_round(r: int) -> None:
        name = "prof" if R.profiling else str(r)
        store, ck_dcp = os.path.join(scratch, f"dck-{name}"), os.path.join(scratch, f"dcp-{name}")
        R.rm(store, ck_dcp)
        R.settle()
        ck = checkpointer(args, store)
        try:
            base = R.timed("deltackpt base save", lambda: ck.save(0, state.deltackpt_state()), free=1.1)
            if base is not None and base.kind != "base":
                raise AssertionError(f"the first save of a fresh store was a {base.kind}")
            R.settle(store)
            state.apply_delta()
            R.settle()
            delta = R.timed("deltackpt 1% delta save", lambda: ck.save(1, state.deltackpt_state()), free=0.2)
            if delta.kind != "delta" or delta.rows_changed != want_rows:
                raise AssertionError(f"1% delta save: a {delta.kind} with {delta.rows_changed} rows changed, "
                                     f"expected a delta of {want_rows}")
        finally:
            ck.close()
        R.settle(store)
        if rank == 0 and not R.profiling:
            R.info.setdefault("deltackpt base bytes", []).append(base.bytes_written)
            R.info.setdefault("deltackpt delta bytes", []).append(delta.bytes_written)
            changed = want_rows * (args.dim * 4 + 4 + 8)
            R.info["changed rows x (row bytes of a table and its accumulator + 8)"] = changed
            R.info.setdefault("delta bytes / that (goal <= 1.1)", []).append(round(delta.bytes_written / changed, 3))
            R.info["deltackpt store bytes (base + delta, all files)"] = tree_bytes(store)

        if not R.profiling:
            R.timed("DCP save", lambda: dcp.save(state.dcp_state(), checkpoint_id=ck_dcp), free=1.1,
                    catch=True)
            R.settle(ck_dcp)
            if rank == 0 and os.path.isdir(ck_dcp):
                R.info["DCP checkpoint bytes"] = tree_bytes(ck_dcp)
            if "DCP save" not in R.errors:
                target.fill_nan()
                R.settle(ck_dcp)
                R.timed("DCP load", lambda: dcp.load(target.dcp_state(), checkpoint_id=ck_dcp),
                        free=2.1, catch=True)
                if "DCP load" not in R.errors:
                    check_equal("DCP load, 2 ranks", target, state)

        restore_delta_step(R, args, store, ck_dcp, target, state, 2)
        state.undo_delta()
        R.settle(store, ck_dcp)
        if rank == 0:
            print(R.round_line(r), flush=True)

    for r in range(args.repeat):
        one_round(r)
        if r < args.repeat - 1:  # the last round's store and DCP checkpoint serve the other launches
            R.rm(os.path.join(scratch, f"dck-{r}"), os.path.join(scratch, f"dcp-{r}"))
    if args.profile:
        R.start_profiling()
        one_round(-1)
        R.rm(os.path.join(scratch, "dck-prof"), os.path.join(scratch, "dcp-prof"))
    finish_rank(out, rank, R.result())


def restore_job(rank: int, world: int, port: int, args: argparse.Namespace, scratch: str, out: str) -> None:
    """Restore of the 2-rank delta step (deltackpt) and load of the 2-rank DCP checkpoint on ``world``
    ranks, into row-wise shards of this world size."""
    import torch.distributed.checkpoint as dcp

    t_start = time.perf_counter()
    mesh = init_rank(rank, world, port)
    t_init = time.perf_counter()
    warm_up(args, rank, world, mesh, scratch)
    t0 = time.perf_counter()
    want = LocalState(args, rank, world, mesh)
    want.apply_delta()  # the saved delta step
    target = LocalState(args, rank, world, mesh, fill="target")
    R = Rank(args, rank, world, scratch, want.nbytes)
    if rank == 0:
        print(f"[{world} ranks] process group {t_init - t_start:.1f} s, warm-up {t0 - t_init:.1f} s, "
              f"expected state and target built in {time.perf_counter() - t0:.1f} s "
              f"({want.nbytes / 1e9:.3f} GB on rank 0)", flush=True)
    last = args.repeat - 1
    store, ck_dcp = os.path.join(scratch, f"dck-{last}"), os.path.join(scratch, f"dcp-{last}")
    have_dcp = os.path.isdir(ck_dcp)

    def one_round(r: int) -> None:
        if have_dcp and not R.profiling:
            target.fill_nan()
            R.settle(store, ck_dcp)
            R.timed("DCP load", lambda: dcp.load(target.dcp_state(), checkpoint_id=ck_dcp), free=2.1,
                    catch=True)
            if "DCP load" not in R.errors:
                check_equal(f"DCP load, {world} ranks", target, want)
        restore_delta_step(R, args, store, ck_dcp, target, want, world)
        if rank == 0:
            print(R.round_line(r), flush=True)

    for r in range(args.repeat):
        one_round(r)
    if args.profile:
        R.start_profiling()
        one_round(-1)
    finish_rank(out, rank, R.result())


# -- launching ---------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(job: Any, world: int, args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    """Runs ``job`` on ``world`` spawned ranks; returns rank 0's results."""
    import torch.multiprocessing as mp

    out = tempfile.mkdtemp(prefix=f"results-{world}-", dir=scratch)
    env_set = "NUMBA_NUM_THREADS" in os.environ
    old = os.environ.get("NUMBA_NUM_THREADS")
    if not env_set:
        os.environ["NUMBA_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
    try:
        t0, c0 = time.perf_counter(), cpu_seconds(children=True)
        mp.spawn(job, args=(world, free_port(), args, scratch, out), nprocs=world, join=True)
        wall, c1 = time.perf_counter() - t0, cpu_seconds(children=True)
    finally:
        if not env_set:
            os.environ.pop("NUMBA_NUM_THREADS", None)
        elif old is not None:
            os.environ["NUMBA_NUM_THREADS"] = old
    with open(os.path.join(out, "rank0.pkl"), "rb") as f:
        res = pickle.load(f)
    res["wall"] = wall
    res["other_cpu"] = others_cpu(c0, c1)  # this process and its waited-for ranks are not "others"
    return res


# -- report ------------------------------------------------------------------------------------------


def report(args: argparse.Namespace, results: dict[int, dict[str, Any]], nbytes: int) -> None:
    for world, res in sorted(results.items()):
        for key, text in res["profiles"].items():
            print(f"\n### cProfile: {key}\n```\n{text.strip()}\n```")
    print()
    for world, res in sorted(results.items(), key=lambda kv: (kv[0] != 2, kv[0])):
        for key, v in res["info"].items():
            print(f"{key}: {v if not isinstance(v, list) else ', '.join(f'{x:,}' for x in v)}")
        for op, err in res["errors"].items():
            print(f"ERROR {op} on {world} ranks: {err}")
        busy = "" if res["other_cpu"] is None else (
            f", other processes used {res['other_cpu']:.0f} CPU-s "
            f"({100 * res['other_cpu'] / res['wall'] / (os.cpu_count() or 1):.0f}% of the CPUs)")
        print(f"{world} ranks: launch wall {res['wall']:.0f} s{busy}; runs (s): " + "; ".join(
            f"{op} " + " ".join(f"{t:.3f}" for t in ts) for op, ts in res["times"].items()))
    print()
    print(f"Medians of {args.repeat} rounds. State {nbytes:,} B ({args.tables} tables x {args.rows} x "
          f"{args.dim} float32 + accumulators + dense). GB/s = state bytes / median s (an effective rate "
          f"for the delta save). Ratio = median / DCP's median for the same op and world size "
          f"(saves / dcp.save, restores / dcp.load); < 1 means deltackpt is faster. Reads evicted from "
          f"the page cache; all checkpoints written by 2 ranks.")
    print()
    print("| op | world size | s (median) | GB/s | ratio to DCP |")
    print("|---|---|---|---|---|")
    for world, res in sorted(results.items(), key=lambda kv: (kv[0] != 2, kv[0])):
        med = {op: statistics.median(ts) for op, ts in res["times"].items()}
        for op in OPS:
            if op not in med and op not in res["errors"]:
                continue
            if op not in med:
                print(f"| {op} | {world} | failed | | |")
                continue
            ref = DCP_REF[OPS[op][1]]
            ratio = f"{med[op] / med[ref]:.2f}" if ref in med and med[ref] > 0 else "n/a"
            print(f"| {op} | {world} | {med[op]:.3f} | {nbytes / med[op] / 1e9:.2f} | {ratio} |")
    rows = []
    for world, res in sorted(results.items(), key=lambda kv: (kv[0] != 2, kv[0])):
        for op in OPS:
            if op in res["times"]:
                ref = DCP_REF[OPS[op][1]]
                mine = ref == op or ref not in res["times"]
                rows.append(figure(f"{op}, {world} ranks", res["times"][op], peer=None if mine else ref,
                                   peer_runs=None if mine else res["times"][ref]))
        info, changed = res["info"], "changed rows x (row bytes of a table and its accumulator + 8)"
        if info.get("deltackpt delta bytes"):  # the row-wise accumulators ride with their rows
            rows.append(figure(f"deltackpt 1% delta bytes, {world} ranks", info["deltackpt delta bytes"], "B",
                               peer=changed, peer_runs=info[changed]))
    write_figures(args.json, "bench_distributed", args, rows, state_bytes=nbytes)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import deltackpt

    nbytes = state_bytes(args)
    scratch = tempfile.mkdtemp(prefix="bench_distributed-", dir=args.dir)
    print(f"deltackpt from {os.path.dirname(deltackpt.__file__)}; torch {torch.__version__}; "
          f"{os.cpu_count()} CPUs; load average {open('/proc/loadavg').read().split()[:3]}")
    print(f"state: {args.tables} tables x {args.rows} x {args.dim} float32 + accumulators + dense = "
          f"{nbytes:,} B; 1% delta = {changed_rows_expected(args):,} rows; scratch {scratch}", flush=True)
    t0 = time.perf_counter()
    results: dict[int, dict[str, Any]] = {}
    try:
        results[2] = launch(two_rank_job, 2, args, scratch)
        for world in args.world_list:
            results[world] = launch(restore_job, world, args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\ntotal wall {time.perf_counter() - t0:.0f} s; load average "
          f"{open('/proc/loadavg').read().split()[:3]}")
    report(args, results, nbytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
