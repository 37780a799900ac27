"""The ``deltackpt`` command line: ls, show, restore, verify, compact, gc, export, import, tail, demo.

Every command takes ``--help``; commands that print data take ``--json``. Bad input prints one
line naming the problem and exits with status 1 (2 for a bad command line), without a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from .checkpointer import Checkpointer
from .errors import DeltackptError, ManifestError
from .ops.gc import GCReport, Retention
from .restore.files import write_step
from .sizes import fmt_bytes
from .storage import open_storage, storage_options
from .store import Store


def progress_bar(total: int, desc: str):
    """A byte-counting progress bar on a terminal; silent otherwise."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False,
                disable=not sys.stderr.isatty())


def _store(path: str, options: dict[str, str] | None = None) -> Store:
    store = Store(open_storage(path, options))
    store.check_exists()
    return store


def _options(args: argparse.Namespace) -> dict[str, str]:
    return storage_options(args.storage_option)


def _print_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _report(args: argparse.Namespace, doc: Any, text: str) -> None:
    """What a command did: ``doc`` as JSON with ``--json``, else ``text``."""
    if args.json:
        _print_json(doc)
    else:
        print(text)


def cmd_ls(args: argparse.Namespace) -> int:
    store = _store(args.path, _options(args))
    rows: list[dict[str, Any]] = []
    for step in store.steps():
        try:  # the records' own fields: a listing reads no tree or tensor (verify checks those)
            m = store.summary(step)
        except DeltackptError as e:  # a corrupt record, or one that cannot be read: listed, the listing goes on
            rows.append({"step": step, "kind": "corrupt" if isinstance(e, ManifestError) else "unreadable",
                         "error": str(e)})
            continue
        chain: list[int] | None
        try:  # where a restore starts: the base, or a later one compaction made
            chain = [c.step for c in store.summary_chain(step)]
        except DeltackptError:
            chain = None
        rows.append({
            "step": step, "kind": m.kind, "parent": m.parent, "base": m.base,
            "chain_length": m.chain_length, "restore_chain": chain,
            "bytes_written": m.bytes_written, "state_bytes": m.state_bytes,
            "world_size": m.world_size, "created": m.created, "lossy": m.lossy,
        })
    if args.json:
        _print_json(rows)
        return 0
    if not rows:
        print(f"no committed steps in {store.storage.url}")
        return 0
    print(f"{'step':>10} {'kind':<7} {'parent':>10} {'restores from':>15} {'written':>11} "
          f"{'of state':>11} world  values")
    for r in rows:
        if r["kind"] in ("corrupt", "unreadable"):
            print(f"{r['step']:>10} {r['kind']:<7} {r['error']}")
            continue
        parent = "-" if r["parent"] is None else r["parent"]
        chain = r["restore_chain"]
        start = "broken chain" if chain is None else f"{chain[0]} (+{len(chain) - 1})"
        print(f"{r['step']:>10} {r['kind']:<7} {parent:>10} {start:>15} "
              f"{fmt_bytes(r['bytes_written']):>11} {fmt_bytes(r['state_bytes']):>11} {r['world_size']:>5}  "
              f"{'lossy' if r['lossy'] else 'exact'}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    store = _store(args.path, _options(args))
    m = store.manifest(args.step)
    chain = [c.step for c in store.chain(args.step)]
    if args.json:
        doc = m.to_doc()
        doc["chain"] = chain
        _print_json(doc)
        return 0
    print(f"step {m.step}: {m.kind}, chain {' -> '.join(map(str, chain))}, "
          f"{fmt_bytes(m.bytes_written)} written of a {fmt_bytes(m.state_bytes)} state")
    print(f"policy {m.policy.get('name')}: {m.policy.get('reason')}")
    if m.lossy:
        print("lossy: restored values of the tensors marked below lie within their bound of those saved")
    for key, choice in (m.quantize or {}).get("tensors", {}).items():
        print(f"quantize {key}: {choice['scheme']} by {choice['pattern']!r}: {choice['reason']}")
    print(f"{'tensor':<40} {'dtype':<9} {'shape':<18} {'encoding':<8} {'changed':>9} {'bytes':>11}  values")
    for key, rec in m.tensors.items():
        loss = "exact" if rec.lossy is None else (
            f"{rec.lossy.scheme or 'lossy'}, bound {rec.lossy.bound:.3g}, chain bound {rec.lossy.chain_bound:.3g}")
        print(f"{key:<40} {rec.dtype:<9} {str(list(rec.shape)):<18} {rec.encoding.name:<8} "
              f"{rec.changed:>9} {fmt_bytes(rec.nbytes_written):>11}  {loss}")
        if args.chunks:
            for part in rec.parts:
                for name, entry in part.chunks.items():
                    where = f"{part.path}/{name}" if part.path else name
                    packed = f" in {part.pack} at {entry[2]}" if part.pack and len(entry) == 3 else ""
                    print(f"    {where:<36} {entry[0]:>12} xxh3:{entry[1]}{packed}")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    with (Checkpointer(args.path, create=False, storage_options=_options(args)) as ckpt,
          progress_bar(ckpt.store.manifest(args.step).state_bytes, "restore") as bar):
        written = write_step(ckpt, args.step, args.out, world_size=args.world_size, keys=args.keys,
                             overwrite=args.force, progress=bar.update)
    _report(args, {"step": args.step, "files": written},
            "\n".join(f"wrote step {args.step} to {path}" for path in written))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    ckpt = Checkpointer(args.path, create=False, storage_options=_options(args))
    try:
        steps = [args.step] if args.step is not None else ckpt.steps()
        total = sum(_step_bytes(ckpt.store, s) for s in steps)
        with progress_bar(total, "verify") as bar:
            report = ckpt.verify(args.step, progress=bar.update)
    finally:
        ckpt.close()
    if args.json:
        _print_json({"ok": report.ok, "steps": report.steps, "chunks": report.chunks,
                     "bytes": report.bytes, "problems": [asdict(p) for p in report.problems]})
    else:
        for p in report.problems:
            print(f"step {p.step}: {p.kind}: {p.detail}")
        verdict = "ok" if report.ok else f"{len(report.problems)} problem(s)"
        print(f"verified {len(report.steps)} step(s), {report.chunks} chunks, "
              f"{fmt_bytes(report.bytes)}: {verdict}")
    return 0 if report.ok else 1


def _step_bytes(store: Store, step: int) -> int:
    try:
        return sum(m.bytes_written for m in store.chain(step))
    except DeltackptError:
        return 0


def _retention(args: argparse.Namespace) -> Retention | None:
    if not (math.isfinite(args.grace) and args.grace >= 0):
        raise DeltackptError(f"--grace must be a finite number >= 0, got {args.grace}")
    if args.keep_last is None and args.keep_every is None and not args.keep:
        return None
    if args.keep_last is None:
        raise DeltackptError("--keep-every and --keep need --keep-last (how many recent steps to keep)")
    for flag, value in (("--keep-last", args.keep_last), ("--keep-every", args.keep_every)):
        if value is not None and value < 1:
            raise DeltackptError(f"{flag} must be a positive integer, got {value}")
    return Retention(args.keep_last, args.keep_every, frozenset(args.keep))


def _print_gc(report: GCReport, as_json: bool, extra: dict[str, Any] | None = None) -> None:
    if as_json:
        _print_json({**(extra or {}), **asdict(report)})
        return
    verb = "would remove" if report.dry_run else "removed"
    for path in report.deleted:
        print(f"{verb} {path}")
    print(f"{verb} {len(report.dropped_steps)} step record(s) {report.dropped_steps}, "
          f"{len(report.deleted)} folder(s)/file(s), {fmt_bytes(report.freed_bytes)}; "
          f"{len(report.young)} younger than the grace period kept")


def cmd_compact(args: argparse.Namespace) -> int:
    retention = _retention(args)
    with Checkpointer(args.path, create=False, storage_options=_options(args)) as ckpt:
        info = ckpt.compact(args.upto)
        report = ckpt.gc(retention, grace_seconds=args.grace) if retention else None
    doc = {"step": info.step, "compacted": info.done, "chain_length": info.chain_length,
           "bytes_written": info.bytes_written, "seconds": round(info.seconds, 3)}
    if args.json:
        _print_json({**doc, "gc": asdict(report) if report else None})
        return 0
    if info.done:
        print(f"compacted step {info.step}: a chain of {info.chain_length} records into a base of "
              f"{fmt_bytes(info.bytes_written)} in {info.seconds:.2f} s")
    else:
        print(f"step {info.step} already restores from a base; nothing to do")
    if report:
        _print_gc(report, False)
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    with Checkpointer(args.path, create=False, storage_options=_options(args)) as ckpt:
        report = ckpt.gc(_retention(args), grace_seconds=args.grace, dry_run=args.dry_run)
    _print_gc(report, args.json)
    return 0


def _add_retention(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep-last", type=int, default=None, metavar="K",
                   help="keep the newest K steps restorable")
    p.add_argument("--keep-every", type=int, default=None, metavar="N",
                   help="also keep every step divisible by N")
    p.add_argument("--keep", type=int, nargs="*", default=[], metavar="STEP",
                   help="also keep these steps (tagged)")
    p.add_argument("--grace", type=float, default=3600.0, metavar="SECONDS",
                   help="delete unreferenced data only when older than this (default 3600); "
                        "must exceed the longest save")


def cmd_export(args: argparse.Namespace) -> int:
    from .ops.export import export

    store = _store(args.path, _options(args))
    steps = store.steps()
    step = args.step if args.step is not None or not steps else steps[-1]
    total = store.manifest(step).state_bytes if step is not None else 0
    with progress_bar(total, f"export {args.to}") as bar:
        info = export(store.storage, args.step, args.to, args.out, world_size=args.world_size,
                      keys=args.keys, prefix=args.prefix, dtype=args.dtype, overwrite=args.force,
                      shard_bytes=args.shard_bytes, memory_budget=args.memory_budget,
                      progress=bar.update)
    _report(args, asdict(info), f"exported step {info.step} to {info.out} ({info.format}): "
            f"{info.tensors} tensors, {fmt_bytes(info.bytes)} in {info.seconds:.2f} s")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from .ops.importing import import_checkpoint

    info = import_checkpoint(args.src, args.path, args.step, storage_options=_options(args))
    _report(args, asdict(info), f"imported {args.src} as a {info.kind} at step {info.step} of "
            f"{args.path}: {fmt_bytes(info.bytes_written)} written in {info.seconds:.2f} s")
    return 0


def cmd_tail(args: argparse.Namespace) -> int:
    from .tail import write_step_json, write_step_safetensors

    with Checkpointer(args.path, create=False, storage_options=_options(args)) as ckpt:
        for delta in ckpt.deltas(since=args.from_step):
            if args.out:
                path = write_step_safetensors(delta, args.out)
                print(json.dumps({"step": delta.step, "kind": delta.kind, "file": path}), flush=True)
            else:
                write_step_json(delta, sys.stdout)
    return 0


def _add_path(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="the store: a directory or s3://BUCKET/PREFIX")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting of the store's backend, repeatable; for s3://: endpoint_url, "
                        "region, access_key_id, secret_access_key (else the AWS_* environment "
                        "variables and ~/.aws files), conditional_writes, retry_timeout")


def cmd_demo(args: argparse.Namespace) -> int:
    from .examples.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deltackpt", description="Incremental checkpoints of sparse PyTorch models in a zarr v3 store.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("ls", help="list committed steps")
    _add_path(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("show", help="one step's tensors, chain and checksums")
    _add_path(p)
    p.add_argument("step", type=int, help="the step")
    p.add_argument("--chunks", action="store_true", help="list every chunk with size and checksum")
    p.add_argument("--json", action="store_true", help="print the whole commit record as JSON")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("restore", help="write a step as state-dict file(s) (torch.load-able)")
    _add_path(p)
    p.add_argument("--step", type=int, required=True, help="the step to restore")
    p.add_argument("--out", required=True,
                   help="output file, or folder with --world-size (read with torch.load(weights_only=True))")
    p.add_argument("--world-size", type=int, default=None,
                   help="write one file per rank of a row-wise sharding over this many ranks: "
                        "{step, rank, world_size, state (local rows), shards (global shape and "
                        "offset by key)}")
    p.add_argument("--keys", nargs="+", default=None, metavar="PATTERN",
                   help="only these tensors (flat keys, prefixes or globs), written as a flat dict by key")
    p.add_argument("--force", action="store_true", help="replace the files to write if they exist")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_restore)

    p = sub.add_parser("verify", help="check chains, sizes and checksums of every chunk")
    _add_path(p)
    p.add_argument("--step", type=int, default=None, help="only this step's chain (default: all)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("compact", help="fold a step's chain into a new base (then GC if --keep-last)")
    _add_path(p)
    p.add_argument("--upto", type=int, default=None, help="the step (default: the latest)")
    _add_retention(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_compact)

    p = sub.add_parser("gc", help="drop steps not retained and delete unreferenced data")
    _add_path(p)
    _add_retention(p)
    p.add_argument("--dry-run", action="store_true", help="list what would go, delete nothing")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("export", help="write a step as a DCP checkpoint, safetensors or a torch.save file")
    _add_path(p)
    p.add_argument("--step", type=int, default=None, help="the step (default: the latest)")
    p.add_argument("--to", required=True, choices=["dcp", "safetensors", "torch"], help="the format")
    p.add_argument("out", help="the folder (dcp, safetensors) or file (torch) to create")
    p.add_argument("--world-size", type=int, default=None, metavar="M",
                   help="dcp: lay tensors out as the row blocks of M ranks")
    p.add_argument("--keys", nargs="+", default=None, metavar="PATTERN",
                   help="only these tensors (flat keys, prefixes or globs), flat by dotted name")
    p.add_argument("--prefix", default=None,
                   help="only the state under this key (e.g. model), named relative to it")
    p.add_argument("--dtype", default=None, help="convert floating-point tensors (e.g. bfloat16)")
    p.add_argument("--shard-bytes", type=int, default=5 << 30, metavar="N",
                   help="safetensors: split files above N bytes (default 5 GiB)")
    p.add_argument("--memory-budget", type=int, default=256 << 20, metavar="N",
                   help="bytes of reads in flight plus the block being written (default 256 MiB)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", help="commit a DCP checkpoint, safetensors or torch.save file as a base")
    p.add_argument("src", help="a DCP folder, a safetensors file or folder, or a torch.save file")
    _add_path(p)
    p.add_argument("--step", type=int, required=True, help="the step to commit it as")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("tail", help="print what changed at each step after --from, as JSON lines")
    _add_path(p)
    p.add_argument("--from", dest="from_step", type=int, default=None, metavar="S",
                   help="the step the consumer holds (default: from the first step)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write step-<S>.safetensors files here instead, one line per step printed")
    p.set_defaults(func=cmd_tail)

    p = sub.add_parser("demo", help="the main job: train a DLRM with checkpoints, restore it on "
                                    "several ranks and resume it, bit for bit")
    from .examples.demo import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:
        # The reader of our output went away (`deltackpt ls ... | head`): stop quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (DeltackptError, OSError) as e:
        print(f"deltackpt: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("deltackpt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
