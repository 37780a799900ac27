"""Cost of row tracking: marking inside a DLRM training step, hashing, and a 1% delta save.

One run, on the CPU, measures:

  marking     a DLRM-like training step (``--tables`` sparse EmbeddingBags of ``--rows`` x ``--dim``
              fed ``--batch`` bags of ``--pooling`` power-law ids each, a bottom and a top MLP,
              dot interactions, Adagrad on the tables and Adam on the MLPs), with the tracking
              hooks timed in place: a hook registered before and one after the tracking hook of
              every EmbeddingBag bracket it, so the figure is the marking cost inside real steps.
              The same steps on an untracked copy of the model give the step time without hooks.
  hashing     the CPU hash paths (``hash_rows``, ``hash_chunks``, and hashing gathered rows as a
              marked delta does) beside memcpy (``np.copyto`` into a pre-faulted array) and the
              xxhash library's XXH3 and XXH64 on one buffer of ``--hash-mib``, 1 thread and all.
  finding     the change sets of such a delta alone (:class:`deltackpt.tracking.changes.ChangeTracker`
              scans, no writes): from marks against from full hashing. With marks, the new
              hashes of the marked rows are taken later, by the writer from the rows it gathers,
              so they are not in this figure; the "gather + hash" row shows what they cost.
  saving      a delta after one training step that touches ``--delta`` of every table's rows
              (the same rows change in the Adagrad state): saved by a checkpointer that tracks the
              model (marks) and by one that does not (full hashing) into their own stores, beside
              ``torch.save`` of the whole state plus fsync. The marks must cover every row the
              hashes find, or the bench stops with an error (marks may hold a few more: rows a
              lookup read whose update was exactly zero). Its canary samples rows and never
              audits (an audit writes the rows its hashes find: see ``bench_async``'s audits).

Memory on this VM goes back to the host seconds after it is freed, and touching it again runs at
~0.4 GB/s instead of ~14 GB/s (see the project's baselines). So every buffer is touched before it
is timed, and before each timed save a buffer of the bytes the save will write is touched and
freed, so the page cache it fills comes from warm memory. Rounds interleave the compared
operations and medians are reported. Scratch files go to a fresh folder under ``--dir`` and are
removed at the end. Each part prints the CPU seconds other processes used meanwhile (user time
from /proc/stat less this process's): on a 2-core VM, a busy neighbour skews every figure.

The table printed last lists each goal with PASS or MISS.

Example:
    python bench/bench_tracking.py                       # 8 x 250000 x 32 tables, ~0.5 GB state
    python bench/bench_tracking.py --rows 50000 --repeat 3 --steps 10
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import numba
import numpy as np
import torch
import xxhash
from common import RowwiseAdagrad, cpu_seconds, figure, json_option, others_cpu, write_figures  # bench/common.py
from deltackpt.kernels import reference
from torch import nn

import deltackpt
from deltackpt import kernels, statetree
from deltackpt.io.threads import started_pool
from deltackpt.tracking.changes import ChangeTracker
from deltackpt.tracking.hashing import Hasher

MiB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tables", type=int, default=8, help="embedding tables")
    p.add_argument("--rows", type=int, default=250_000, help="rows per table")
    p.add_argument("--dim", type=int, default=32, help="embedding dimension (fp32)")
    p.add_argument("--batch", type=int, default=2048, help="bags per training step")
    p.add_argument("--pooling", type=int, default=20, help="ids per bag")
    p.add_argument("--steps", type=int, default=20, help="timed training steps")
    p.add_argument("--hash-mib", type=int, default=256, help="buffer hashed and copied (MiB)")
    p.add_argument("--row-bytes", type=int, default=128, help="row size for the hash paths (bytes)")
    p.add_argument("--delta", type=float, default=0.01, help="share of rows a delta changes")
    p.add_argument("--fractions", default="",
                   help="more shares of rows for the delta saves, comma-separated (e.g. 0.001,0.05,0.5)")
    p.add_argument("--optimizer", choices=("adagrad", "rowwise"), default="adagrad",
                   help="the tables' optimizer: torch's Adagrad (a sum per value, 2-d) or row-wise "
                        "Adagrad (a sum per row, 1-d; inferred aligned with its table by both "
                        "checkpointers)")
    p.add_argument("--repeat", type=int, default=5, help="timed rounds of the hash and save parts")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the scratch folder goes")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    json_option(p)
    args = p.parse_args(argv)
    for name in ("tables", "rows", "dim", "batch", "pooling", "steps", "hash_mib", "row_bytes",
                 "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.delta <= 1 or args.delta * args.rows < args.pooling:
        p.error("--delta must be in (0, 1] and cover at least --pooling rows")
    return args


# -- the model -------------------------------------------------------------------------------------


class DLRM(nn.Module):
    """A small DLRM: bottom MLP on dense features, pooled embedding bags, dot interactions, top MLP."""

    def __init__(self, tables: int, rows: int, dim: int, dense_in: int = 13):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense_in, 64), nn.ReLU(), nn.Linear(64, dim), nn.ReLU())
        self.embs = nn.ModuleList(
            nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for _ in range(tables))
        n = tables + 1
        self.register_buffer("pairs", torch.triu_indices(n, n, 1), persistent=False)
        self.top = nn.Sequential(nn.Linear(dim + n * (n - 1) // 2, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense: torch.Tensor, ids: list[torch.Tensor], offsets: torch.Tensor):
        x = self.bottom(dense)
        z = torch.stack([x] + [e(i, offsets) for e, i in zip(self.embs, ids, strict=True)], 1)
        inter = torch.bmm(z, z.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, inter], 1)).squeeze(1)


Batch = tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor]


def make_batch(args: argparse.Namespace, gen: torch.Generator, ids: list[torch.Tensor] | None = None,
               ) -> Batch:
    """A batch of power-law ids, or of the given ids per table (``pooling`` per bag)."""
    if ids is None:
        n = args.batch * args.pooling
        ids = [(torch.rand(n, generator=gen) ** 4 * args.rows).long() for _ in range(args.tables)]
    bags = ids[0].numel() // args.pooling
    offsets = torch.arange(0, bags * args.pooling, args.pooling)
    dense = torch.rand(bags, 13, generator=gen)
    labels = (torch.rand(bags, generator=gen) < 0.5).float()
    return dense, ids, offsets, labels


def make_optimizers(model: DLRM, kind: str = "adagrad") -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    sparse = (torch.optim.Adagrad if kind == "adagrad" else RowwiseAdagrad)(model.embs.parameters(), lr=0.05)
    dense = torch.optim.Adam([*model.bottom.parameters(), *model.top.parameters()], lr=1e-3)
    return sparse, dense


def train_step(model: DLRM, opts, batch: Batch) -> None:
    dense, ids, offsets, labels = batch
    for o in opts:
        o.zero_grad()
    nn.functional.binary_cross_entropy_with_logits(model(dense, ids, offsets), labels).backward()
    for o in opts:
        o.step()


# -- measuring -------------------------------------------------------------------------------------


def warm(nbytes: int) -> None:
    """Touches and frees ``nbytes``, so that the next allocation of that size finds warm pages."""
    if nbytes > 0:
        np.ones(nbytes, dtype=np.uint8)


def report_others(part: str, start: tuple[float, float] | None, t0: float) -> None:
    others = others_cpu(start, cpu_seconds())
    wall = time.perf_counter() - t0
    used = "an unknown number of" if others is None else f"{others:.1f}"  # None off Linux
    print(f"{part}: {wall:.1f} s; other processes used {used} CPU-s of {wall * os.cpu_count():.1f}")


def medians(cases: dict[str, Callable[[], object]], repeats: int,
            before: Callable[[str], None] = lambda name: None) -> dict[str, float]:
    """Median seconds per case over interleaved rounds, after one untimed call of each."""
    for fn in cases.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(repeats):
        names = list(cases)
        names = names[r % len(names):] + names[:r % len(names)]  # rotate: no fixed order bias
        for name in names:
            before(name)
            t0 = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


class HookTimer:
    """Brackets the forward hooks registered so far on ``modules`` with two timing hooks."""

    def __init__(self, modules: list[nn.Module]):
        self.seconds = 0.0
        self._t0 = 0.0
        for m in modules:
            m.register_forward_hook(self._start, prepend=True)
            m.register_forward_hook(self._stop)

    def _start(self, *_: object) -> None:
        self._t0 = time.perf_counter()

    def _stop(self, *_: object) -> None:
        self.seconds += time.perf_counter() - self._t0


def state_of(model: DLRM, sparse: torch.optim.Optimizer, dense: torch.optim.Optimizer) -> dict:
    return {"model": model, "optim": sparse, "dense": dense}


def nbytes_of(state: dict) -> int:
    total = 0
    for obj in state.values():
        sd = obj.state_dict()
        tensors = list(sd.values()) if isinstance(obj, nn.Module) else [
            v for st in sd["state"].values() for v in st.values()]
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


def measure_marking(args, model, opts, plain, plain_opts, gen) -> dict[str, float]:
    batches = [make_batch(args, gen) for _ in range(args.steps)]
    timer = HookTimer(list(model.embs))
    bare = HookTimer(list(plain.embs))  # brackets nothing: the timing hooks' own cost
    tracked_s, plain_s, hook_s, bare_s = [], [], [], []
    for b in batches:
        for m, o, t, out, hooks in ((model, opts, timer, tracked_s, hook_s),
                                    (plain, plain_opts, bare, plain_s, bare_s)):
            t.seconds = 0.0
            t0 = time.perf_counter()
            train_step(m, o, b)
            out.append(time.perf_counter() - t0)
            hooks.append(t.seconds)
    mark = statistics.median(h - b for h, b in zip(hook_s, bare_s, strict=True))
    return {"step": statistics.median(plain_s), "tracked_step": statistics.median(tracked_s),
            "mark": max(0.0, mark), "ids": args.tables * args.batch * args.pooling}


def measure_hashing(args) -> dict[str, float]:
    nbytes = (args.hash_mib * MiB) // args.row_bytes * args.row_bytes
    src = np.random.default_rng(args.seed).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.ones_like(src)  # pre-faulted, so memcpy does not measure first touches
    flat = torch.from_numpy(src)
    rows = flat.view(-1, args.row_bytes)
    picked = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(1))
    picked = picked[: max(1, int(rows.shape[0] * args.delta))].sort().values
    every = numba.config.NUMBA_NUM_THREADS

    def threads(n: int, fn: Callable[[], object]) -> Callable[[], object]:
        return lambda: (numba.set_num_threads(n), fn())

    cases = {
        "memcpy": lambda: np.copyto(dst, src),
        "xxh3": lambda: xxhash.xxh3_64_intdigest(src),
        "xxh64": lambda: xxhash.xxh64_intdigest(src),
        "hash_rows_1": threads(1, lambda: reference.hash_rows(rows)),
        "hash_chunks_1": threads(1, lambda: reference.hash_chunks(flat, MiB)),
        f"hash_rows_{every}": threads(every, lambda: reference.hash_rows(rows)),
        "marked_rows": threads(every, lambda: kernels.hash_rows(kernels.gather_rows(rows, picked))),
    }
    got = medians(cases, args.repeat)
    numba.set_num_threads(every)
    out = {name: nbytes / s / 1e9 for name, s in got.items() if name != "marked_rows"}
    out["marked_rows_s"] = got["marked_rows"]
    out["threads"] = every
    return out


def measure_saving(args, fraction, first_step, model, opts, ckpt_marks, ckpt_hash, scratch, gen) -> dict[str, float]:
    state = state_of(model, *opts)
    full = nbytes_of(state)
    k = max(args.pooling, int(args.rows * fraction) // args.pooling * args.pooling)
    pt = os.path.join(scratch, "state.pt")
    written: dict[str, list[int]] = {"marks": [], "hashes": [], "marks_tables": [], "hashes_tables": []}
    step = [first_step]

    def touch() -> None:
        step[0] += 1
        ids = [torch.randperm(args.rows, generator=gen)[:k] for _ in range(args.tables)]
        train_step(model, opts, make_batch(args, gen, ids))

    def torch_save() -> None:
        if os.path.exists(pt):
            os.remove(pt)
        with open(pt, "wb") as f:
            torch.save({name: obj.state_dict() for name, obj in state.items()}, f)
            f.flush()
            os.fsync(f.fileno())
        fd = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)
        os.close(fd)

    times: dict[str, list[float]] = {"marks": [], "hashes": [], "torch.save": []}
    delta_bytes = changed_bytes(args, k)
    for r in range(args.repeat + 1):  # the first round is a warm-up
        touch()
        order = ["marks", "hashes", "torch.save"]
        order = order[r % 3:] + order[:r % 3]
        infos = {}
        for name in order:
            warm(full if name == "torch.save" else 2 * delta_bytes)
            t0 = time.perf_counter()
            if name == "torch.save":
                torch_save()
            else:
                ck = ckpt_marks if name == "marks" else ckpt_hash
                infos[name] = ck.save(step[0], state)
            if r:
                times[name].append(time.perf_counter() - t0)
        m, h = infos["marks"], infos["hashes"]
        # Marks write every looked-up row; hashing skips the few whose update was exactly zero
        # (a sample whose top-MLP ReLUs are all off sends no gradient to its bags).
        if m.kind != "delta" or h.kind != "delta" or not (
            h.rows_changed <= m.rows_changed
            and (2 if args.optimizer == "adagrad" else 1) * args.tables * k <= m.rows_changed
        ):
            raise AssertionError(f"expected two deltas, marks covering hashes: {m} vs {h}")
        written["marks"].append(m.bytes_written)
        written["hashes"].append(h.bytes_written)
        written["marks_tables"].append(table_bytes(ckpt_marks, step[0]))
        written["hashes_tables"].append(table_bytes(ckpt_hash, step[0]))
    out = {name: statistics.median(ts) for name, ts in times.items()}
    out.update(full=full, rows=k, **{f"{n}_bytes": statistics.median(b) for n, b in written.items()})
    out.update({f"{n}_runs": ts for n, ts in times.items()})
    return out


def table_bytes(ckpt: deltackpt.Checkpointer, step: int) -> int:
    """The bytes of the tables' and their Adagrad state's chunks in step ``step``'s record: the
    delta without the MLPs and their Adam state, which change at every step."""
    m = ckpt.store.manifest(step)
    return sum(e[0] for key, rec in m.tensors.items() if key.startswith(("model/embs.", "optim/state/"))
               and not key.endswith("/step") for part in rec.parts for e in part.chunks.values())


def measure_finding(args, model, opts, gen) -> dict[str, float]:
    state = state_of(model, *opts)
    k = int(args.rows * args.delta) // args.pooling * args.pooling
    # Each tracker hashes as a checkpointer's does: on a pool of torch.get_num_threads() threads
    # and the calling one (a tracker built without a pool hashes on the calling thread alone).
    threads = torch.get_num_threads()
    pool = started_pool(threads, "bench-hash")
    marks = ChangeTracker(MiB, Hasher(pool, threads))
    hashes = ChangeTracker(MiB, Hasher(pool, threads))
    handle = marks.rows.track(model, prefix="model", optimizer=opts[0], optimizer_prefix="optim")

    def flat() -> dict[str, torch.Tensor]:
        return {key: s.local for key, s in statetree.flatten(state).tensors.items()}

    for ct in (marks, hashes):
        tensors = flat()
        ct.adopt(tensors, ct.scan(tensors))
    times: dict[str, list[float]] = {"marks": [], "hashes": []}
    for r in range(args.repeat + 1):  # the first round is a warm-up
        ids = [torch.randperm(args.rows, generator=gen)[:k] for _ in range(args.tables)]
        train_step(model, opts, make_batch(args, gen, ids))
        tensors = flat()
        found = {}
        for name in (("marks", "hashes") if r % 2 else ("hashes", "marks")):
            ct = marks if name == "marks" else hashes
            t0 = time.perf_counter()
            found[name] = ct.scan(tensors)
            if r:
                times[name].append(time.perf_counter() - t0)
            ct.adopt(tensors, found[name])
        for key, h in found["hashes"].items():
            m = found["marks"][key].changed
            if not set(h.changed.tolist()) <= set(m.tolist()):
                raise AssertionError(f"{key}: the marks miss rows the hashes found")
    handle.remove()
    pool.shutdown()
    return {name: statistics.median(ts) for name, ts in times.items()}


# -- report ----------------------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # torch's sparse Adagrad warns about invariant checks on every step.
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    print(f"{os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"numba {numba.config.NUMBA_NUM_THREADS} threads")
    # Hashing first: later parts write files, and the kernel's writeback competes for the CPUs.
    t0, cpu = time.perf_counter(), cpu_seconds()
    hashing = measure_hashing(args)
    report_others("hashing", cpu, t0)
    scratch = tempfile.mkdtemp(prefix="bench-tracking-", dir=args.dir)
    try:
        model = DLRM(args.tables, args.rows, args.dim)
        plain = copy.deepcopy(model)  # copied before tracking, so it carries no hooks
        opts, plain_opts = make_optimizers(model, args.optimizer), make_optimizers(plain, args.optimizer)
        train_step(model, opts, make_batch(args, gen))  # creates the optimizer state
        train_step(plain, plain_opts, make_batch(args, gen))
        policy = deltackpt.EveryK(every=10_000, max_delta_fraction=1.0)
        ckpt_marks = deltackpt.Checkpointer(os.path.join(scratch, "marks"), policy=policy)
        ckpt_hash = deltackpt.Checkpointer(os.path.join(scratch, "hashes"), policy=policy)
        # No audits: they take turns among the tables, one table's now and then, and the sweep
        # compares the deltas of marks alone (bench_async times the deltas that audit).
        handle = ckpt_marks.track(model, prefix="model", optimizer=opts[0], optimizer_prefix="optim",
                                  canary=deltackpt.Canary(audit_every=None))
        state = state_of(model, *opts)
        print(f"state {nbytes_of(state) / 1e6:.0f} MB: {args.tables} tables x {args.rows} x "
              f"{args.dim} fp32, their {args.optimizer} Adagrad state, MLPs and Adam state")
        ckpt_marks.save(0, state)
        ckpt_hash.save(0, state)
        t0, cpu = time.perf_counter(), cpu_seconds()
        marking = measure_marking(args, model, opts, plain, plain_opts, gen)
        report_others("marking", cpu, t0)
        ckpt_marks.save(1, state)  # takes the marks of the timed steps
        ckpt_hash.save(1, state)
        t0, cpu = time.perf_counter(), cpu_seconds()
        fractions = sorted({args.delta, *(float(f) for f in args.fractions.split(",") if f)})
        sweep = {f: measure_saving(args, f, 1000 * (i + 1), model, opts, ckpt_marks, ckpt_hash, scratch, gen)
                 for i, f in enumerate(fractions)}
        saving = sweep[args.delta]
        report_others("saving", cpu, t0)
        handle.remove()
        ckpt_marks.close()
        ckpt_hash.close()
        t0, cpu = time.perf_counter(), cpu_seconds()
        finding = measure_finding(args, model, opts, gen)
        report_others("finding", cpu, t0)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    share = marking["mark"] / marking["step"]
    half = hashing["hash_rows_1"] / hashing["memcpy"]
    ratio = saving["marks"] / saving["torch.save"]
    gb = args.hash_mib * MiB / 1e9
    n = hashing["threads"]
    rows = [
        ("training step, untracked (median)", f"{marking['step'] * 1e3:.1f} ms", "", ""),
        ("training step, tracked (median)", f"{marking['tracked_step'] * 1e3:.1f} ms", "", ""),
        (f"marking per step ({marking['ids']} ids in {args.tables} tables)",
         f"{marking['mark'] * 1e3:.3f} ms = {share:.2%} of the step", "< 1% of the step",
         verdict(share < 0.01)),
        (f"memcpy, 1 thread ({gb:.2f} GB)", f"{hashing['memcpy']:.2f} GB/s", "", ""),
        ("xxhash XXH3-64, 1 thread", f"{hashing['xxh3']:.2f} GB/s", "", ""),
        ("xxhash XXH64, 1 thread", f"{hashing['xxh64']:.2f} GB/s", "", ""),
        ("hash_chunks 1 MiB chunks, 1 thread", f"{hashing['hash_chunks_1']:.2f} GB/s", "", ""),
        (f"hash_rows {args.row_bytes} B rows, {n} threads", f"{hashing[f'hash_rows_{n}']:.2f} GB/s",
         "", ""),
        (f"hash_rows {args.row_bytes} B rows, 1 thread", f"{hashing['hash_rows_1']:.2f} GB/s "
         f"= {half:.2f}x memcpy", ">= 0.5x memcpy", verdict(half >= 0.5)),
        (f"gather + hash {args.delta:.0%} of the rows (a marked delta's re-hash)",
         f"{hashing['marked_rows_s'] * 1e3:.2f} ms", "", ""),
        (f"find a {args.delta:.0%} delta's changes, full hashing", f"{finding['hashes'] * 1e3:.1f} ms",
         "", ""),
        (f"find a {args.delta:.0%} delta's changes, marks (with the canary)",
         f"{finding['marks'] * 1e3:.1f} ms = 1/{finding['hashes'] / finding['marks']:.1f} of hashing",
         "", ""),
        (f"torch.save whole state + fsync ({saving['full'] / 1e6:.0f} MB)",
         f"{saving['torch.save'] * 1e3:.1f} ms", "", ""),
        (f"delta save, full hashing ({saving['hashes_bytes'] / 1e6:.2f} MB written)",
         f"{saving['hashes'] * 1e3:.1f} ms = 1/{saving['torch.save'] / saving['hashes']:.1f} "
         "of torch.save", "", ""),
        (f"delta save, marks ({saving['rows']} rows per table, {saving['marks_bytes'] / 1e6:.2f} MB)",
         f"{saving['marks'] * 1e3:.1f} ms = 1/{1 / ratio:.1f} of torch.save",
         "<= 1/20 of torch.save", verdict(ratio <= 1 / 20)),
    ]
    header = ("measure", "median", "goal", "result")
    widths = [max(len(r[i]) for r in [*rows, header]) for i in range(4)]
    print()
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    print()
    print("| delta | rows per table | marks s | hashing s | torch.save s | marks MB | hashing MB "
          "| changed MB | tables / changed, marks | tables / changed, hashing |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for f, sv in sweep.items():
        goal = changed_bytes(args, sv["rows"])
        print(f"| {f:.1%} | {sv['rows']} | {sv['marks']:.4f} | {sv['hashes']:.4f} | {sv['torch.save']:.4f} "
              f"| {sv['marks_bytes'] / 1e6:.2f} | {sv['hashes_bytes'] / 1e6:.2f} | {goal / 1e6:.2f} "
              f"| {sv['marks_tables_bytes'] / goal:.3f} | {sv['hashes_tables_bytes'] / goal:.3f} |")
    print("changed = changed rows x (row bytes of the table and its Adagrad state + 8); tables = the "
          "delta's bytes of the tables and their Adagrad state (its MLPs and Adam state aside); goal <= 1.1")
    write_figures(args.json, "bench_tracking", args, figures(args, marking, hashing, finding, sweep),
                  fraction=list(sweep), state_bytes=saving["full"],
                  marks_s=[sv["marks"] for sv in sweep.values()],
                  hashes_s=[sv["hashes"] for sv in sweep.values()],
                  torch_save_s=[sv["torch.save"] for sv in sweep.values()],
                  marks_bytes=[sv["marks_bytes"] for sv in sweep.values()],
                  hashes_bytes=[sv["hashes_bytes"] for sv in sweep.values()],
                  changed_row_bytes=[changed_bytes(args, sv["rows"]) for sv in sweep.values()])


def changed_bytes(args: argparse.Namespace, k: int) -> int:
    """Changed rows x (row bytes + 8) of every table and its Adagrad state, ``k`` rows a table: a
    2-d sum is a table of its own, a row-wise (1-d) sum adds 4 B to its table's rows."""
    if args.optimizer == "adagrad":
        return 2 * args.tables * k * (args.dim * 4 + 8)
    return args.tables * k * (args.dim * 4 + 4 + 8)


def figures(args, marking, hashing, finding, sweep) -> list[dict]:
    """The figures of :func:`main` as rows for ``--json``."""
    rows = [
        figure("marking per step", marking["mark"], peer="training step", peer_runs=marking["step"]),
        figure("find a delta's changes, marks", finding["marks"], peer="full hashing",
               peer_runs=finding["hashes"]),
    ]
    rows += [figure(label, hashing[name], "GB/s", peer="memcpy, 1 thread", peer_runs=hashing["memcpy"])
             for name, label in (("xxh3", "xxhash XXH3-64, 1 thread"), ("xxh64", "xxhash XXH64, 1 thread"),
                                 ("hash_rows_1", f"hash_rows {args.row_bytes} B rows, 1 thread"))]
    for f, sv in sweep.items():
        for how in ("marks", "hashes"):
            rows.append(figure(f"{f:.1%} delta save, {'marks' if how == 'marks' else 'hashing'}",
                               sv[f"{how}_runs"], peer="torch.save + fsync", peer_runs=sv["torch.save_runs"]))
        rows.append(figure(f"{f:.1%} delta bytes, marks", sv["marks_bytes"], "B",
                           peer="changed rows x (row bytes + 8)", peer_runs=changed_bytes(args, sv["rows"])))
        for how, name in (("marks", "marks"), ("hashes", "hashing")):
            rows.append(figure(f"{f:.1%} delta bytes of the tables and their state, {name}",
                               sv[f"{how}_tables_bytes"], "B", peer="changed rows x (row bytes + 8)",
                               peer_runs=changed_bytes(args, sv["rows"])))
    return rows


if __name__ == "__main__":
    main()
