"""Background saves against blocking ones and ``torch.distributed.checkpoint.async_save``, side by
side in one run: how long training is blocked per checkpoint, how long a save takes to commit,
how much slower training runs while a save finishes behind it, the host memory a save adds, and
how long the first save of a fresh process blocks.

The state is a DLRM-like model, the state of ``bench_distributed.py``: ``--tables`` sparse
EmbeddingBags of ``--rows`` x ``--dim`` float32 rows with row-wise Adagrad (one sum per row, 1-d)
and a small dense MLP with Adagrad; the checkpointer tracks the tables with their optimizer, so a
delta writes the rows training marked and their sums. The default size is ~2.2 GB (8 tables of
524,288 x 128); ``--quick`` is 64 MiB (4 tables of 65,536 x 64). ``--model tracking`` is instead
the tracked model of ``bench_tracking.py``: its DLRM (a bottom and a top MLP, dot interactions,
Adam on the MLPs) with row-wise Adagrad on 8 tables of 250,000 x 32 (256 MB; ``--quick`` 4 of
100,000 x 32), each training step a batch of bags of 20 distinct ids a table. Each round, in turn:

  blocking    training steps while ``track()`` warms the first base's staging buffers in fresh
              memory (the process's staging reserve is released first, see
              ``deltackpt.release_staging_memory``), as a job trains before its first checkpoint;
              a base, then ``DELTAS_TIMED`` times a training step touching ``--delta`` of every
              table's rows and a delta, then another training step and a later base of the same
              checkpointer (each delta a sample: a job's deltas mostly follow deltas, not a
              base, and one delta a round made three samples of a noisy figure)
  background  the same with ``blocking=False``: the blocked time (the call), the time to commit
              (``SaveInfo.seconds``; waited for at once, so its writes run on every I/O thread,
              see ``SaveHandle.result``), the host memory added from before the checkpointer was
              built to the first base's commit (peak resident memory, ``VmHWM`` after
              ``clear_refs``, above the resident memory then; the training steps' own included)
  beside      a background base and ``DELTAS_BESIDE`` deltas again, with training steps run one
              after another while each finishes behind them: their mean time per save (the
              training's pace, slow steps and all), and the time to commit (its writes on the
              cores training leaves; the buffers of the rounds before, left in the reserve: a
              job's steady state)
  bare writer training steps beside a thread that only writes as many bytes as that base (once)
              and the last delta (``DELTAS_BESIDE`` times) wrote (a fresh file, O_DIRECT from
              one aligned buffer, fsync): the least any background writer of those bytes costs
              the training on this machine
  alone       ``--steps`` training steps with no save running, their mean time
  DCP         ``async_save`` (default stager) of the same state after the base's and after the
              delta's training step (DCP has no deltas: both are full saves): blocked until its
              future is returned, then until it is done; the memory it added
  over budget a background base with ``memory_budget`` a quarter of the state: it stages what
              fits, writes it, stages the rest, and returns once the last piece is staged
  GIL         a pure-Python loop (it holds the GIL all the time, as no training step does) alone
              and while a background base, then a 1% marked delta, finishes: how much of the GIL
              the save's threads take, and how long each then takes to commit
  fresh       in a new process, the blocked time of the first background save right after the
              checkpointer is built, and of two later ones (the kernels warm in the background:
              loading them holds the GIL for most of their ~0.5 s here, so the saves that come
              meanwhile wait for it); in another, the same ``FRESH_AFTER`` seconds after it is built,
              as a job's first checkpoint comes after some training, and each later save as long
              after the last one committed (matrix products meanwhile): a save that follows the
              last one at once is faster, the first or a later one alike
  after       a background base, ``SETTLE_STEPS`` training steps and a delta of their changes
              (untimed), then ``DELTAS_TIMED`` times a training step and a background delta: a job's
              deltas mostly come long after a base, while the deltas of ``background`` come in the
              first second after it, its memory just given back; then a training step and the next
              base, as a job's bases after its first come (the later base of ``background`` comes
              a second after the first)
  warm-up     the training steps of ``blocking`` and ``background`` while ``track()`` warms the
              staging buffers: their mean time, and the seconds until the buffers are touched
  right after a background base right after ``track()``, the reserve released: into fresh memory,
              the warm-up just started (a job that saves before it trains)
  lost        once ``track()`` has warmed the buffers and a base is saved, ``LOST_ROUNDS`` times in
              turn a background delta, a blocking one and none, each after a training step and
              followed by ``STEPS_AFTER`` timed ones (then a blocking save of their changes,
              untimed, so that each timed delta holds one step's rows): the training time a delta
              costs, its call plus how much longer the steps after it took than those after none
              of the same round (a background delta's writes slow the steps they run beside)
  audits      a background base and ``AUDITS`` deltas with ``Canary(audit_every=AUDITS)``, so
              that each table is audited (hashed whole, on the blocked path) at one of them: the
              slowest delta's blocked time against their median (the tables take turns)

The staging budget of the background and blocking saves is the state's size (``--budget-mib``
changes it), so a base is staged whole. Medians over ``--repeat`` rounds; the last table gives
each goal's ratio. The machine is shared: every figure carries the noise of other processes,
whose CPU time is printed per round.

Example:
    python bench/bench_async.py --quick
    python bench/bench_async.py --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import torch
from torch import nn

import deltackpt
from deltackpt import Checkpointer, statetree

sys.path.insert(0, os.path.dirname(__file__))
import bench_tracking  # noqa: E402
from common import (  # noqa: E402
    RowwiseAdagrad, cpu_seconds, direct_bandwidth, figure, json_option, others_cpu, write_figures,
)

MiB = 1 << 20
AUDITS = 8  # the audits part's deltas, and its audit_every
DELTAS_TIMED = 3  # deltas a round between the blocking and background rounds' base and later base
DELTAS_BESIDE = 4  # background deltas a round with training beside them (and bare writers of their bytes)
LOST_ROUNDS = 4  # rounds of a background delta, a blocking one and none, each timed with the steps after it
STEPS_AFTER = 3  # training steps timed after each (the writes of a 1% delta end within two here)
SETTLE_STEPS = 60  # training steps between a base and the deltas "long after" it (~3 s at the full size)
FRESH_AFTER = 1.0  # seconds between building the checkpointer and the first save, past the kernels' warm-up
WARM_LIMIT = 60.0  # the most seconds of training while track() warms the first base's buffers
RIGHT_AFTER = "base background right after track(), into fresh memory: blocked s"
SIZES = {  # --model: its default --tables, --rows and --dim, then those of --quick
    "dlrm-like": ((8, 524_288, 128), (4, 65_536, 64)),
    "tracking": ((8, 250_000, 32), (4, 100_000, 32)),
}
QUICK_STEPS = 5
POOLING = 20  # ids a bag of the tracking model

Model = tuple[nn.Module, tuple[torch.optim.Optimizer, torch.optim.Optimizer], dict, Callable[[int], None]]


def build(args: argparse.Namespace) -> Model:
    """The model, its optimizers (the tables', tracked, then the dense layers'), the state saved and
    a training step (``step(n)`` looks up ``n`` rows of every table)."""
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    if args.model == "tracking":
        return tracking_model(args, gen)
    model = nn.ModuleDict({
        "tables": nn.ModuleList(nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True)
                                for _ in range(args.tables)),
        "mlp": nn.Sequential(nn.Linear(args.dim, 64), nn.ReLU(), nn.Linear(64, 1)),
    })
    opts = RowwiseAdagrad(model["tables"].parameters(), lr=0.01), torch.optim.Adagrad(model["mlp"].parameters())
    state = {"model": model, "optim": opts[0], "dense_optim": opts[1], "step": 0}
    return model, opts, state, lambda n: train_step(model, opts, args.rows, n, gen)


def tracking_model(args: argparse.Namespace, gen: torch.Generator) -> Model:
    """``bench_tracking.py``'s DLRM (a bottom and a top MLP, dot interactions; row-wise Adagrad on the
    tables, Adam on the MLPs), each step a batch of bags of ``POOLING`` distinct ids a table, as
    its delta saves train."""
    model = bench_tracking.DLRM(args.tables, args.rows, args.dim)
    opts = bench_tracking.make_optimizers(model, "rowwise")
    shape = argparse.Namespace(tables=args.tables, rows=args.rows, pooling=POOLING)

    def step(n: int) -> None:
        k = max(POOLING, n // POOLING * POOLING)
        ids = [torch.randperm(args.rows, generator=gen)[:k] for _ in range(args.tables)]
        bench_tracking.train_step(model, opts, bench_tracking.make_batch(shape, gen, ids))

    return model, opts, {"model": model, "optim": opts[0], "dense_optim": opts[1], "step": 0}, step


def train_step(model: nn.Module, opts: tuple[torch.optim.Optimizer, ...], rows: int, n: int,
               gen: torch.Generator) -> None:
    for opt in opts:
        opt.zero_grad()
    pooled = sum(t(torch.randint(0, rows, (n, 1), generator=gen)) for t in model["tables"])
    model["mlp"](pooled).sum().backward()
    for opt in opts:
        opt.step()


def resident(field: str = "VmRSS") -> int:
    """This process's resident memory (``VmRSS``) or its peak since the last reset (``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_added(run: Callable[[], object]) -> tuple[object, float]:
    """``run()`` and the resident memory it added at its peak, in MiB."""
    before = resident()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the resident memory now
    out = run()
    return out, (resident("VmHWM") - before) / MiB


def until_warm(ckpt: Checkpointer, nbytes: int, work: Callable[[], None]) -> list[float]:
    """Seconds of each ``work()`` run one after another until the staging pool of ``ckpt`` holds
    touched buffers for a base of ``nbytes`` (within its budget), as ``track()`` has them warmed, or
    for ``WARM_LIMIT`` seconds."""
    pool, end = ckpt._pool, time.monotonic() + WARM_LIMIT
    need = min(pool.buffers, -(-nbytes // pool.nbytes)) * pool.nbytes
    return while_pending(lambda: pool.touched_bytes() >= need or time.monotonic() > end, work)


def while_pending(done: Callable[[], bool], work: Callable[[], None]) -> list[float]:
    """Seconds of each ``work()`` run one after another until ``done()`` (at least one)."""
    times = timed(work, 1)
    while not done():
        times += timed(work, 1)
    return times


def beside_writer(folder: str, nbytes: int, work: Callable[[], None]) -> tuple[list[float], float]:
    """Seconds of each ``work()`` run while another thread writes ``nbytes`` to a fresh file with
    O_DIRECT from one aligned buffer (then fsync), and that writer's GB/s: what any writer of as
    many bytes costs the work beside it on this machine, with no staging, hashing or commit."""
    done = threading.Event()
    out: list[float] = []

    def write() -> None:
        try:
            out.append(direct_bandwidth(folder, nbytes))
        finally:
            done.set()

    writer = threading.Thread(target=write, name="bare-writer")
    writer.start()
    times = while_pending(done.is_set, work)
    writer.join()
    if not out:
        raise RuntimeError("the bare writer failed (its error is printed above)")
    return times, out[0]


def timed(work: Callable[[], None], n: int) -> list[float]:
    """Seconds of each of ``n`` runs of ``work()``."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        work()
        times.append(time.perf_counter() - t0)
    return times


def spin() -> None:
    """Pure-Python work of about a millisecond, holding the GIL throughout."""
    x = 0
    for i in range(20_000):
        x += i


FIRST_AFTER = (f"first background save of a fresh process, {FRESH_AFTER:g} s after building its checkpointer: "
               "blocked s")
LATER_AFTER = (f"later background saves of that process, each {FRESH_AFTER:g} s after the last one committed: "
               "blocked s")
FRESH = """
import sys, time, torch, deltackpt
torch.set_num_threads(1)
ckpt = deltackpt.Checkpointer(sys.argv[1], base_every=1)
t = torch.randn(20000, 32)
m = torch.randn(256, 256)
after = float(sys.argv[2])
blocked = []
for step in (1, 2, 3):
    end = time.perf_counter() + after
    while time.perf_counter() < end:  # training between checkpoints
        m @ m
    t += 1
    h = ckpt.save(step, {'t': t}, blocking=False)
    blocked.append(h.blocked_seconds)
    h.result()
ckpt.close()
print(*blocked)
"""


def fresh_process(folder: str, after: float = 0.0) -> list[float]:
    """The blocked times of the first three background saves (bases of a 2.4 MiB tensor) of a
    fresh process, each after ``after`` seconds of matrix products: the first since the
    checkpointer was built, each later one since the last save committed. (A save that follows
    the last one at once finds the caches and the core as it left them: one that follows a
    pause, idle or busy, blocked ~1.5x as long here, the first save or a later one alike.)"""
    out = subprocess.run([sys.executable, "-c", FRESH, folder, str(after)], check=True, capture_output=True,
                         text=True)
    return [float(v) for v in out.stdout.split()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=tuple(SIZES), default="dlrm-like",
                   help="the state of bench_distributed.py, or the tracked model of bench_tracking.py")
    p.add_argument("--quick", action="store_true",
                   help=f"the small size (--steps {QUICK_STEPS} and, by model, --tables, --rows and --dim " + ", ".join(
                       f"{m}: {' x '.join(map(str, q))}" for m, (_, q) in SIZES.items()) + ")")
    p.add_argument("--tables", type=int, help="tables (default by model: " + ", ".join(
        f"{m}: {d[0]}" for m, (d, _) in SIZES.items()) + ")")
    p.add_argument("--rows", type=int, help="rows of a table (default by model)")
    p.add_argument("--dim", type=int, help="floats a row (default by model)")
    p.add_argument("--delta", type=float, default=0.01, help="share of rows a delta's step touches")
    p.add_argument("--steps", type=int, default=10, help="training steps timed with no save running")
    p.add_argument("--budget-mib", type=int, default=None,
                   help="staging budget of the saves (default: the state's size)")
    p.add_argument("--save-threads", type=int, default=2,
                   help="threads of each checkpointer (training runs on one thread)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--seed", type=int, default=0)
    json_option(p)
    args = p.parse_args()
    full, quick = SIZES[args.model]
    for name, default in zip(("tables", "rows", "dim"), quick if args.quick else full):
        if getattr(args, name) is None or args.quick:
            setattr(args, name, default)
    if args.quick:
        args.steps = QUICK_STEPS
    torch.set_num_threads(1)  # one training thread; the saves' threads run beside it
    root = tempfile.mkdtemp(prefix="deltackpt-bench-async-", dir=args.dir)
    print(f"deltackpt from {os.path.dirname(deltackpt.__file__)}; torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, 1 training thread, {args.save_threads} threads a checkpointer")
    model, opts, state, train_step_of = build(args)
    opt = opts[0]  # the tables', tracked
    train_step_of(1)
    nbytes = sum(s.local.nbytes for s in statetree.flatten(state).tensors.values())
    chunk = 32 * MiB
    budget = args.budget_mib * MiB if args.budget_mib else max(2, -(-nbytes // chunk)) * chunk
    touched = max(1, int(args.delta * args.rows))
    print(f"state ({args.model}): {args.tables} tables of {args.rows} x {args.dim} with row-wise Adagrad, "
          f"{nbytes / 1e9:.2f} GB; "
          f"a delta's step touches {touched} rows a table; staging budget {budget / MiB:.0f} MiB")
    figures: dict[str, list[float]] = {}

    def note(name: str, value: float) -> None:
        figures.setdefault(name, []).append(value)

    def train() -> None:
        train_step_of(touched)

    try:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        if not dist.is_initialized():  # a world of one on an in-process store: no port to take
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        have_dcp = hasattr(dcp, "async_save")
    except Exception as e:  # noqa: BLE001 - the bench runs without DCP
        print(f"no DCP async_save: {e}")
        have_dcp = False

    def dcp_save(what: str, path: str) -> None:
        sd = {"model": model.state_dict(), "optim": opt.state_dict(), "dense_optim": opts[1].state_dict()}
        t0 = time.perf_counter()

        def run() -> None:
            fut = dcp.async_save(sd, checkpoint_id=path)
            note(f"{what} DCP async_save: blocked s", time.perf_counter() - t0)
            fut.result()

        _, added = memory_added(run)
        note(f"{what} DCP async_save: to commit s", time.perf_counter() - t0)
        if what == "base":
            note("base DCP async_save: memory added MiB", added)
        shutil.rmtree(path, ignore_errors=True)

    for r in range(args.repeat):
        start = cpu_seconds()
        step = 100 * r
        def base_then_delta(name: str, labels: tuple[str, ...],
                            save: Callable[[Checkpointer, str, int], None]) -> None:
            """Training steps while ``track()`` warms the staging buffers of the first base, that
            base, then after a training step each a delta (or a later base, for the label "later
            base"), each saved by ``save(ckpt, label, step)`` into a fresh store of its own."""
            path = os.path.join(root, f"r{r}-{name}")
            before = resident()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the peak (VmHWM) starts again from the resident memory now
            with Checkpointer(path, base_every=len(labels) - 1 if "later base" in labels else 1000,
                              memory_budget=budget, threads=args.save_threads) as ckpt:
                ckpt.track(model, prefix="model", optimizer=opt)
                warming = until_warm(ckpt, nbytes, train)
                if name != "beside":  # the others stage into buffers touched before
                    note("train step beside the staging pool's warm-up ms", 1000 * statistics.mean(warming))
                    note("seconds from track() to the first base's buffers touched", sum(warming))
                for i, what in enumerate(labels):
                    if i:
                        train()
                    save(ckpt, what, step + 1 + i)
                    if not i and name == "background":
                        note("base background: memory added since track() MiB", (resident("VmHWM") - before) / MiB)
            shutil.rmtree(path)

        def blocking(ckpt: Checkpointer, what: str, at: int) -> None:
            note(f"{what} blocking: blocked s", ckpt.save(at, state).blocked_seconds)

        def background(ckpt: Checkpointer, what: str, at: int) -> None:
            info = ckpt.save(at, state, blocking=False).result()
            note(f"{what} background: blocked s", info.blocked_seconds)
            note(f"{what} background: to commit s", info.seconds)

        def beside(ckpt: Checkpointer, what: str, at: int) -> None:
            handle = ckpt.save(at, state, blocking=False)
            steps = while_pending(handle.done, train)
            info = handle.result()
            note(f"train step beside a background {what} ms", 1000 * statistics.mean(steps))
            note(f"{what} background, training beside: to commit s", info.seconds)
            written[what] = info.bytes_written

        # The first base of each stages into buffers track() touched while training went on, in
        # fresh memory, as a process's first base does (a closed checkpointer's are left to the
        # next one); the later base of the same checkpointer into those, as a job's later bases.
        for name, save in (("blocking", blocking), ("background", background)):
            deltackpt.release_staging_memory()
            base_then_delta(name, ("base", *["1% delta"] * DELTAS_TIMED, "later base"), save)
        # Training beside the saves (its steps would grow the delta above, so apart from it).
        written: dict[str, int] = {}
        # A delta finishes within a step or two: DELTAS_BESIDE of them a round, each a sample.
        base_then_delta("beside", ("base", *["delta"] * DELTAS_BESIDE), beside)
        for what, size in written.items():  # the machine's floor: beside a bare writer of as many bytes
            for _ in range(1 if what == "base" else DELTAS_BESIDE):
                steps, gbps = beside_writer(root, size, train)
                note(f"train step beside a bare writer of the {what}'s bytes ms", 1000 * statistics.mean(steps))
                note(f"bare writer of the {what}'s bytes, training beside: GB/s", gbps)
        note("train step alone ms", 1000 * statistics.mean(timed(train, args.steps)))
        if have_dcp:
            dcp_save("base", os.path.join(root, f"dcp{r}-base"))
            train()
            dcp_save("1% delta", os.path.join(root, f"dcp{r}-delta"))
        path = os.path.join(root, f"r{r}-over")
        with Checkpointer(path, memory_budget=max(2 * chunk, budget // 4 // chunk * chunk),
                          threads=args.save_threads) as ckpt:
            info = ckpt.save(step + 1, state, blocking=False).result()
            note("base over the budget (1/4 of the state), background: blocked s", info.blocked_seconds)
            note("base over the budget (1/4 of the state), background: to commit s", info.seconds)
        shutil.rmtree(path)
        path = os.path.join(root, f"r{r}-gil")
        alone = statistics.median(timed(spin, 200))
        note("pure-Python loop alone ms", 1000 * alone)
        with Checkpointer(path, memory_budget=budget, threads=args.save_threads) as ckpt:
            ckpt.track(model, prefix="model", optimizer=opt)
            for i, what in enumerate(("base", "1% delta")):
                if i:
                    train()
                handle = ckpt.save(step + 1 + i, state, blocking=False)
                beside = statistics.median(while_pending(handle.done, spin))
                note(f"pure-Python loop beside a background {what} ms", 1000 * beside)
                note(f"{what} background, pure-Python loop beside: to commit s", handle.result().seconds)
        shutil.rmtree(path)
        path = os.path.join(root, f"r{r}-after")
        # The save after the timed deltas is the next base, and the settling steps' delta is a
        # delta however many rows they touched (about half of them).
        policy = deltackpt.EveryK(every=2 + DELTAS_TIMED, max_delta_fraction=1.0)
        with Checkpointer(path, policy=policy, memory_budget=budget, threads=args.save_threads) as ckpt:
            ckpt.track(model, prefix="model", optimizer=opt)
            ckpt.save(step + 1, state, blocking=False).result()
            for _ in range(SETTLE_STEPS):
                train()
            ckpt.save(step + 2, state, blocking=False).result()  # the settling steps' changes
            for i in range(DELTAS_TIMED):
                train()
                note("1% delta background, long after a base: blocked s",
                     ckpt.save(step + 3 + i, state, blocking=False).result().blocked_seconds)
            train()
            info = ckpt.save(step + 3 + DELTAS_TIMED, state, blocking=False).result()
            assert info.kind == "base", info
            note("base background, long after the first: blocked s", info.blocked_seconds)
        shutil.rmtree(path)
        path = os.path.join(root, f"r{r}-audits")
        with Checkpointer(path, memory_budget=budget, threads=args.save_threads) as ckpt:
            ckpt.track(model, prefix="model", optimizer=opt, canary=deltackpt.Canary(audit_every=AUDITS))
            ckpt.save(step + 1, state, blocking=False).result()
            blocked = []
            for i in range(AUDITS):
                train()
                handle = ckpt.save(step + 2 + i, state, blocking=False)
                blocked.append(handle.blocked_seconds)
                handle.result()
            note(f"1% delta background, every table audited in {AUDITS} deltas: slowest blocked s", max(blocked))
            note(f"1% delta background, every table audited in {AUDITS} deltas: median blocked s",
                 statistics.median(blocked))
        shutil.rmtree(path)
        path = os.path.join(root, f"r{r}-lost")
        with Checkpointer(path, base_every=1000, memory_budget=budget, threads=args.save_threads) as ckpt:
            ckpt.track(model, prefix="model", optimizer=opt)
            until_warm(ckpt, nbytes, train)
            ckpt.save(step + 1, state, blocking=False).result()
            ckpt.save(step + 2, state)  # the steps of the warm-up: the deltas below hold one step's rows
            lost = {"background": [], "blocking": []}
            for at in range(step + 3, step + 3 + 6 * (LOST_ROUNDS + 1), 6):  # a round not counted first
                after = {}
                for i, mode in enumerate(("background", "blocking", "none")):
                    train()
                    t0 = time.perf_counter()
                    handle = ckpt.save(at + 2 * i, state, blocking=False) if mode == "background" else None
                    if mode == "blocking":
                        ckpt.save(at + 2 * i, state)
                    call = time.perf_counter() - t0
                    after[mode] = call + sum(timed(train, STEPS_AFTER))
                    if handle is not None:
                        handle.result()
                    ckpt.save(at + 2 * i + 1, state)  # the steps after it
                if at > step + 3:
                    for mode in lost:
                        lost[mode].append(after[mode] - after["none"])
            for mode, values in lost.items():
                note(f"1% delta {mode}: training time lost ms", 1000 * statistics.median(values))
        shutil.rmtree(path)
        deltackpt.release_staging_memory()  # a first base with no training since track()
        path = os.path.join(root, f"r{r}-fresh")
        with Checkpointer(path, memory_budget=budget, threads=args.save_threads) as ckpt:
            ckpt.track(model, prefix="model", optimizer=opt)
            note(RIGHT_AFTER, ckpt.save(step + 1, state, blocking=False).result().blocked_seconds)
        shutil.rmtree(path)
        first, *later = fresh_process(os.path.join(root, f"fresh{r}"))
        note("first background save of a fresh process: blocked s", first)
        note("later background saves of that process: blocked s", statistics.median(later))
        first, *later = fresh_process(os.path.join(root, f"fresh-after{r}"), FRESH_AFTER)
        note(FIRST_AFTER, first)
        note(LATER_AFTER, statistics.median(later))
        print(f"round {r + 1}/{args.repeat}: other processes {others_cpu(start, cpu_seconds()) or 0:.1f} CPU-s",
              flush=True)
    report(figures, budget)
    write_figures(args.json, "bench_async", args, [figure(name, values, unit, peer=peer, peer_runs=figures.get(peer))
                                                   for name, values in figures.items()
                                                   for unit, peer in [peer_of(name)]],
                  state_bytes=nbytes, budget_bytes=budget)
    shutil.rmtree(root, ignore_errors=True)


def report(figures: dict[str, list[float]], budget: int) -> None:
    """Prints every figure, then each goal's ratio of medians."""
    med = {name: statistics.median(values) for name, values in figures.items()}
    print()
    print("| figure | median | runs |")
    print("| --- | --- | --- |")
    for name, values in figures.items():
        print(f"| {name} | {med[name]:.3f} | {', '.join(f'{v:.3f}' for v in values)} |")
    goals = [
        ("1% delta blocked / its blocking save (goal <= 0.25)",
         med["1% delta background: blocked s"] / med["1% delta blocking: blocked s"]),
        ("1% delta long after a base blocked / its blocking save (goal <= 0.25)",
         med["1% delta background, long after a base: blocked s"] / med["1% delta blocking: blocked s"]),
        ("base blocked, s (goal <= 0.35 at 2.2 GB)", med["base background: blocked s"]),
        ("base right after track() blocked, s (goal <= 0.35 at 2.2 GB)", med[RIGHT_AFTER]),
        ("later base of the same checkpointer blocked, s (goal <= 0.35 at 2.2 GB)",
         med["later base background: blocked s"]),
        ("base long after the first blocked, s (goal <= 0.35 at 2.2 GB)",
         med["base background, long after the first: blocked s"]),
        ("base call to commit / its blocking save (goal <= 1.3)",
         med["base background: to commit s"] / med["base blocking: blocked s"]),
        ("1% delta call to commit / its blocking save (goal <= 1.3)",
         med["1% delta background: to commit s"] / med["1% delta blocking: blocked s"]),
        ("later base call to commit / its blocking save (goal <= 1.3)",
         med["later base background: to commit s"] / med["later base blocking: blocked s"]),
        ("train step beside a background base / alone (goal <= 1.1)",
         med["train step beside a background base ms"] / med["train step alone ms"]),
        ("train step beside a background delta / alone (goal <= 1.1)",
         med["train step beside a background delta ms"] / med["train step alone ms"]),
        ("training time lost to a 1% delta, background / blocking (its call and the slower steps after it)",
         med["1% delta background: training time lost ms"] / med["1% delta blocking: training time lost ms"]),
        ("train step beside the staging pool's warm-up of a base's buffers / alone (goal <= 1.1)",
         med["train step beside the staging pool's warm-up ms"] / med["train step alone ms"]),
        ("train step beside a bare writer of the base's bytes / alone (the machine's floor)",
         med["train step beside a bare writer of the base's bytes ms"] / med["train step alone ms"]),
        ("train step beside a bare writer of the delta's bytes / alone (the machine's floor)",
         med["train step beside a bare writer of the delta's bytes ms"] / med["train step alone ms"]),
        ("memory a background base added since track() - staging budget, MiB (goal <= 64)",
         med["base background: memory added since track() MiB"] - budget / MiB),
        ("pure-Python loop beside a background base / alone",
         med["pure-Python loop beside a background base ms"] / med["pure-Python loop alone ms"]),
        ("pure-Python loop beside a background 1% delta / alone",
         med["pure-Python loop beside a background 1% delta ms"] / med["pure-Python loop alone ms"]),
        ("1% delta call to commit, pure-Python loop beside / its blocking save",
         med["1% delta background, pure-Python loop beside: to commit s"] / med["1% delta blocking: blocked s"]),
        (f"slowest / median blocked of {AUDITS} background deltas auditing every table once",
         med[f"1% delta background, every table audited in {AUDITS} deltas: slowest blocked s"]
         / med[f"1% delta background, every table audited in {AUDITS} deltas: median blocked s"]),
        ("first background save of a fresh process / later ones (goal <= 1)",
         med["first background save of a fresh process: blocked s"]
         / med["later background saves of that process: blocked s"]),
        (f"first background save {FRESH_AFTER:g} s after its checkpointer is built / later ones as long after "
         "the last (goal <= 1)",
         med[FIRST_AFTER] / med[LATER_AFTER]),
    ]
    if "base DCP async_save: blocked s" in med:
        goals += [
            ("base blocked / DCP async_save's (goal < 1)",
             med["base background: blocked s"] / med["base DCP async_save: blocked s"]),
            ("1% delta blocked / DCP async_save's (goal < 1)",
             med["1% delta background: blocked s"] / med["1% delta DCP async_save: blocked s"]),
        ]
    print()
    print("| goal | ratio of medians |")
    print("| --- | --- |")
    for name, value in goals:
        print(f"| {name} | {value:.3f} |")


def peer_of(name: str) -> tuple[str, str | None]:
    """The unit of figure ``name`` and the figure measured beside it that it is compared with."""
    unit = "ms" if name.endswith(" ms") else "MiB" if name.endswith(" MiB") else "GB/s" if name.endswith(" GB/s") else "s"
    for what in ("base", "1% delta", "later base"):
        if name.startswith(f"{what} background: blocked"):
            return unit, f"{what.removeprefix('later ')} DCP async_save: blocked s"
        if name.startswith((f"{what} background: to commit", f"{what} background, pure-Python loop beside")):
            return unit, f"{what} blocking: blocked s"
    if name == "1% delta background: training time lost ms":
        return unit, "1% delta blocking: training time lost ms"
    if name == "base background: memory added since track() MiB":
        return unit, "base DCP async_save: memory added MiB"
    if name.startswith("train step beside"):
        return unit, "train step alone ms"
    if name.startswith("pure-Python loop beside"):
        return unit, "pure-Python loop alone ms"
    if name in ("base background, long after the first: blocked s", RIGHT_AFTER):
        return unit, "base DCP async_save: blocked s"
    if name == "1% delta background, long after a base: blocked s":
        return unit, "1% delta blocking: blocked s"
    if name.endswith("deltas: slowest blocked s"):
        return unit, name.replace("slowest", "median")
    if name == "first background save of a fresh process: blocked s":
        return unit, "later background saves of that process: blocked s"
    if name == FIRST_AFTER:
        return unit, LATER_AFTER
    return unit, None


if __name__ == "__main__":
    main()
