"""Marks on a TorchRec DMP: from TorchRec's ModelDeltaTracker (ID_ONLY) and from deltackpt's own
post-lookup function give the same deltas as hashing, row for row; the canary catches a row
changed without a lookup."""

from __future__ import annotations

import pytest

import trec_model as tm
from dist_harness import check_ok, run_ranks

# torchrec is imported in the ranks only (see trec_model.torchrec_missing).
if tm.torchrec_missing():
    pytest.skip(tm.torchrec_missing(), allow_module_level=True)

STEPS, EVERY, HOT = 12, 3, 0.5


def marked_run(rank, world, path, source, bump):
    """Plan A2, batches from the first half of each table; saves every EVERY steps. ``source``:
    "hashing" (no tracking), "hooks" (deltackpt's own) or "tracker" (TorchRec's). ``bump``
    changes the rows of t3 that no lookup touches before the third save (many rows: the canary
    samples, so a single stray row is found only with the chance that the sample hits it)."""
    import deltackpt
    from deltackpt.tracking.marks import TableMode

    dmp, opt = tm.build("A2", tracker=source == "tracker")
    with deltackpt.Checkpointer(path) as ckpt:
        keys = ()
        if source != "hashing":
            keys = ckpt.track(dmp, optimizer=dmp.fused_optimizer,
                              canary=deltackpt.Canary(fraction=1.0)).keys
        kinds = []
        for step in range(1, STEPS + 1):
            tm.train_step(dmp, opt, step, rank, HOT)
            if bump and step == 2 * EVERY + 1:
                for s in dmp.state_dict()["sparse.embedding_bags.t3.weight"].local_shards():
                    s.tensor[int(HOT * s.tensor.shape[0]):] += 1.0  # never looked up
            if step % EVERY == 0:
                kinds.append(ckpt.save(step, tm.state(dmp, opt, step)).kind)
        exact = tm.check_against(ckpt.load(STEPS), tm.local_values(dmp))
        modes = {t.name: t.mode for t in ckpt._tracker.rows.tables()}
    return kinds, keys, {k: m is TableMode.ON for k, m in modes.items()}, exact


def delta_rows(path: str) -> dict[int, dict[str, list[int]]]:
    """Every delta step's written row ids, by tensor key (row-sparse tensors)."""
    import deltackpt
    from deltackpt.io.reader import ChainReader

    out = {}
    with deltackpt.Checkpointer(path, create=False) as ckpt:
        for step in ckpt.steps():
            chain = ckpt.store.chain(step)
            m = chain[-1]
            if m.kind != "delta":
                continue
            reader = ChainReader(ckpt.store.storage, chain, ckpt._pool, ckpt._executor)
            out[step] = {key: sorted(i for p in rec.parts if p.changed
                                     for i in reader.ids(m, key, p).tolist())
                         for key, rec in m.tensors.items() if len(rec.shape) >= 2}
    return out


@pytest.fixture(scope="module")
def hashed(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hashing") / "store")
    results = check_ok(run_ranks(marked_run, 2, str(tmp_path_factory.mktemp("h")), path, "hashing",
                                 False, deadline=300))
    return path, results


@pytest.mark.parametrize("source", ["tracker", "hooks"])
def test_marks_give_the_deltas_of_hashing(hashed, tmp_path, source):
    path = str(tmp_path / "store")
    results = check_ok(run_ranks(marked_run, 2, str(tmp_path), path, source, False, deadline=300))
    for kinds, keys, on, exact in results:
        assert kinds == ["base", "delta", "delta", "delta"]
        assert keys and all(on.values()) and len(on) == len(keys), on  # marks were used throughout
        assert exact > 0
    want = delta_rows(hashed[0])
    got = delta_rows(path)
    assert got == want
    momentum = "optim/state/sparse.embedding_bags.t2.weight/t2.momentum1"
    weight = "model/sparse.embedding_bags.t2.weight"
    assert all(got[s][momentum] for s in got) and all(got[s][weight] for s in got)


def test_canary_catches_a_row_changed_without_a_lookup(tmp_path):
    path = str(tmp_path / "store")
    results = check_ok(run_ranks(marked_run, 2, str(tmp_path), path, "hooks", True, deadline=300))
    t3 = "model/sparse.embedding_bags.t3.weight"
    for kinds, keys, on, exact in results:
        assert exact > 0  # the last step restores bit for bit, the bumped row included
        if t3 in on:
            assert on[t3] is False  # hashed from the canary's find on
    rows = delta_rows(path)
    untouched = list(range(int(HOT * tm.TABLES["t3"][0]), tm.TABLES["t3"][0]))
    assert rows[3 * EVERY][t3][-len(untouched):] == untouched
