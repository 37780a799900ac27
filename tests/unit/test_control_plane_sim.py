"""The control-plane simulation of ``bench/bench_control_plane.py`` against real saves.

On 1-4 gloo ranks, with the row-, column- and table-wise shardings of the N -> M tests (uneven
blocks, ranks holding nothing), a base then a delta are saved for real; the simulation, given the
same states, must build the same global plans and the same commit records (data checksums, and in
a delta the sizes and pack offsets of compressed chunks, aside: the simulation has no data).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from deltackpt.format.manifest import Manifest
from deltackpt.policy import EveryK
from dist_harness import check_ok, run_ranks

ROOT = Path(__file__).resolve().parents[2]
SIZES = (256, 32)  # chunk_bytes, dense_chunk_bytes: several chunks per part


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


sim = _load("bench_control_plane", ROOT / "bench" / "bench_control_plane.py")
reshard = _load("reshard_layouts", ROOT / "tests" / "distributed" / "test_reshard.py")


def state_of(scheme: str, world: int):
    return lambda rank, step: reshard.make_state(reshard.reference(step), scheme, rank, world, step)


def saves_job(rank: int, world: int, root: str) -> dict:
    """Every scheme on 1..world ranks: a base and a delta; rank 0 returns the global plans its
    checkpointer adopted and the committed records."""
    import torch.distributed as dist

    from deltackpt import Checkpointer
    from deltackpt.save.planner import GlobalPlanner

    adopted: list = []
    assign = GlobalPlanner.assign

    def spy(self, sent, admit):
        answers = assign(self, sent, admit)
        adopted.append(self.plan)
        return answers

    GlobalPlanner.assign = spy  # this child process's own class
    groups = {n: dist.new_group(list(range(n)), backend="gloo") for n in range(1, world + 1)}
    out = {}
    for scheme in reshard.SCHEMES:
        for n in range(1, world + 1):
            if rank < n:
                adopted.clear()
                with Checkpointer(f"{root}/{scheme}-{n}", process_group=groups[n], base_every=100,
                                  chunk_bytes=SIZES[0], dense_chunk_bytes=SIZES[1],
                                  memory_budget=4096) as ckpt:
                    for step in (1, 2):
                        ckpt.save(step, state_of(scheme, n)(rank, step))
                    if rank == 0:
                        out[(scheme, n)] = (list(adopted),
                                            [ckpt.store.manifest(s).to_doc() for s in (1, 2)])
            dist.barrier()
    return out


def comparable(record: Manifest | dict[str, Any]) -> dict[str, Any]:
    """A record as a document, without what only real data decides: the attempts and time; data
    chunks' and packs' checksums; in a delta, which chunks changed (only how many), chunk sizes and pack
    offsets (row ids are compressed) and the pack's file entries, which follow from them."""
    doc = copy.deepcopy(record if isinstance(record, dict) else record.to_doc())
    del doc["attempt"], doc["parent_attempt"], doc["created"]
    for t in doc["tensors"].values():
        for p in t["parts"]:
            if doc["kind"] == "delta":
                p["chunks"] = len(p["chunks"])
            else:
                p["chunks"] = {k: v if k == "zarr.json" else v[0] for k, v in p["chunks"].items()}
    if doc["kind"] == "delta":
        doc["packs"] = {k: sorted(files) for k, files in doc["packs"].items()}
        del doc["bytes_written"]
    else:  # a base's small parts: the pack's size follows from them, its checksum from the data
        doc["packs"] = {k: {n: e if n == "zarr.json" else e[0] for n, e in files.items()}
                        for k, files in doc["packs"].items()}
    return doc


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> dict:
    tmp = str(tmp_path_factory.mktemp("saves"))
    return check_ok(run_ranks(saves_job, 4, tmp, tmp, deadline=300))[0]


@pytest.mark.parametrize("scheme", reshard.SCHEMES)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_simulation_matches_real_save(real, scheme, world):
    plans, records = real[(scheme, world)]
    base, delta = records
    assert (base["kind"], delta["kind"]) == ("base", "delta")
    by_part = {(k, p["path"]): p["changed"] for k, t in delta["tensors"].items() for p in t["parts"]}
    run = sim.simulate(world, state_of(scheme, world), sizes=SIZES, policy=EveryK(100),
                       changed=lambda key, part, t: by_part[(key, part.path)])
    assert run.plans == plans
    assert [comparable(m) for m in run.records] == [comparable(base), comparable(delta)]
    assert run.records[1].parent_attempt == run.records[0].attempt


def test_bench_job_shards_unevenly_and_leaves_ranks_empty():
    job = sim.Job(world=6, tensors=20, col_group=4)
    states = [job.state(r, 1)["tensors"] for r in range(job.world)]
    run = sim.simulate(job.world, job.state, changed=sim.changed_share(0.1))
    plan = run.plans[-1]
    schemes = {f"tensors/{name}": scheme for name, scheme, *_ in job.layout()}
    assert set(plan.tensors) == set(schemes)
    assert set(schemes.values()) == {"row", "col", "table"}
    short = [n for n, t in plan.tensors.items() if schemes[n] == "row" and t.global_shape[0] < job.world]
    assert short
    for name, t in plan.tensors.items():
        holders = [r for r in range(job.world) if name.removeprefix("tensors/") in states[r]]
        want = {"row": job.world, "col": 4, "table": 1}[schemes[name]]
        assert len(holders) == want, name
        if schemes[name] == "row" and t.global_shape[0] < job.world:
            assert t.count < job.world  # ranks with no rows write nothing
    assert [m.kind for m in run.records] == ["base", "delta"]
    # the layout stays: the second save sends digests only and reuses the plan
    sent = [p for p in run.phases if p.name == "2: plan_local"][0]
    assert sent.sent_max < 200
    assert run.plans[0] is run.plans[1]


def test_no_rank_but_the_coordinator_receives_what_grows_with_the_world():
    runs = {w: sim.simulate(w, sim.Job(world=w, tensors=20, col_group=4).state,
                            changed=sim.changed_share(0.1)) for w in (6, 48)}
    for w, run in runs.items():
        # a later save, the layout unchanged: a few hundred bytes (the decision, the totals)
        assert run.rank_received(2) < 1024, (w, run.rank_received(2))
        coordinator = sum(p.received for p in run.phases if p.name.startswith("2: ") and "reader" not in p.name)
        assert coordinator > w * 100  # every rank's digest, scans and write results
    # a new layout: each rank receives its own parts, about as many in a world 8x the size
    first = {w: run.rank_received(1) for w, run in runs.items()}
    parts = {w: sum(t.count for t in run.plans[0].tensors.values()) for w, run in runs.items()}
    assert parts[48] > 6 * parts[6] and first[48] < 1.5 * first[6], (parts, first)


@pytest.mark.parametrize("world,tensors,col_group", [(1, 5, 8), (6, 20, 4), (9, 31, 8)])
def test_a_rank_simulated_by_its_messages_sends_what_plan_local_makes(world, tensors, col_group):
    from deltackpt.save.local import plan_local

    job = sim.Job(world=world, tensors=tensors, col_group=col_group)
    for rank in range(world):
        local = plan_local(1, job.state(rank, 1), rank, sim.DEFAULT_SIZES)
        made = job.local_plan(rank, 1)
        assert made == local.plan and made.digest() == local.digest, rank


def test_ranks_simulated_by_their_messages_give_the_plans_and_records_of_ranks_run_in_full():
    job = sim.Job(world=6, tensors=20, col_group=4)
    runs = [sim.simulate(job.world, job.state, changed=sim.changed_share(0.1), full=full, plan_of=job.local_plan)
            for full in (None, {0, 3})]
    assert runs[0].plans == runs[1].plans
    assert [comparable(m) for m in runs[0].records] == [comparable(m) for m in runs[1].records]
    # every message alike (not the record: a root's size varies with its commit time)
    messages = [[(p.name, p.received, p.sent_max, p.rank_received) for p in run.phases
                 if "reader" not in p.name and "record" not in p.name] for run in runs]
    assert messages[0] == messages[1]
    assert runs[0].rank_received(2) == runs[1].rank_received(2)
    with pytest.raises(ValueError):
        sim.simulate(job.world, job.state, changed=sim.changed_share(0.1), full={1, 2}, plan_of=job.local_plan)


def test_each_rank_sends_the_coordinator_its_table_listing_not_its_parts():
    # The write phase's message (a part table's size and checksum, the pack's files, totals) stays
    # the same size when each rank writes four times the parts; the tables grow instead.
    runs = {t: sim.simulate(8, sim.Job(world=8, tensors=t, col_group=4).state, changed=sim.changed_share(0.1))
            for t in (20, 80)}
    write = {t: [p for p in run.phases if p.name.endswith("part table (write)")] for t, run in runs.items()}
    for t in runs:
        assert [p.sent_max < 400 for p in write[t]] == [True, True], (t, [p.sent_max for p in write[t]])
    assert all(a.sent_max < 1.2 * b.sent_max for a, b in zip(write[80], write[20]))
    assert runs[80].table_bytes[1] > 3 * runs[20].table_bytes[1]
    root = [p for p in runs[80].phases if p.name.endswith("record_root")]
    assert [p.seconds > 0 for p in root] == [True, True]
