"""The canary's promise: a sample of distinct unmarked rows per delta, found with the documented
probability, and a full audit every N deltas and at each base that catches any stray change."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from deltackpt import Canary, Checkpointer, EveryK, MemoryStorage, SettingError

ROWS = 1000
WARNING = "changed in rows that no lookup marked"


def _tracked(canary: Canary, base_every: int = 1000) -> tuple[Checkpointer, torch.Tensor]:
    """A checkpointer saving an embedding whose lookups mark its rows, tracked from its first
    save on; returns it and the table (``state()`` is what it saves)."""
    ckpt = Checkpointer(MemoryStorage(), policy=EveryK(base_every), chunk_bytes=4096,
                        memory_budget=1 << 16)
    emb = nn.Embedding(ROWS, 4)
    ckpt.track(emb, prefix="m", canary=canary)
    ckpt.emb = emb  # type: ignore[attr-defined]
    ckpt.save(0, {"m": emb})  # hashes the table, starts recording
    return ckpt, emb.weight


def _change(ckpt: Checkpointer, table: torch.Tensor, stray: list[int]) -> None:
    """Row 0 changes after a lookup marked it; rows ``stray`` change unmarked."""
    ckpt.emb(torch.tensor([0]))
    with torch.no_grad():
        table[0] += 1
        table[stray] += 1


def _warned(caplog) -> int:
    return sum(WARNING in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def _delta_with_strays(ckpt: Checkpointer, table: torch.Tensor, step: int, stray: list[int],
                       caplog) -> bool:
    """Saves a delta with one marked change and unmarked changes to rows ``stray``; returns
    whether the canary (or an audit) noticed them."""
    before = _warned(caplog)
    _change(ckpt, table, stray)
    with caplog.at_level(logging.WARNING):
        info = ckpt.save(step, {"m": ckpt.emb})
    assert info.kind == "delta"
    return _warned(caplog) > before


def test_a_full_sample_draws_every_row_once(caplog):
    # Drawn with replacement, 1000 draws of 1000 rows miss a given row 37% of the time.
    for trial in range(12):
        ckpt, table = _tracked(Canary(fraction=1.0, min_rows=1, audit_every=None, seed=trial))
        assert _delta_with_strays(ckpt, table, 1, [1 + 83 * trial], caplog)
        assert torch.equal(ckpt.load(1)["m"]["weight"], table)
        ckpt.close()


def test_the_documented_detection_probability_holds():
    """200 trials of one delta with 2 stray rows of 1000, 300 distinct rows sampled: the
    documented probability is 1 - C(998, 300) / C(1000, 300) = 0.5102. The seeds are fixed, so
    the count is deterministic; the tolerance of 5 standard deviations (+-35 of 200) would pass
    any seed of a correct sampler except with probability below 1e-6."""
    canary = Canary(fraction=0.3, min_rows=1, audit_every=None)
    p = canary.detection_probability(ROWS, 2)
    assert p == pytest.approx(1 - (700 * 699) / (1000 * 999))
    trials, found = 200, 0
    for trial in range(trials):
        ckpt, table = _tracked(Canary(fraction=0.3, min_rows=1, audit_every=None, seed=trial))
        logs = _Counter()
        logging.getLogger("deltackpt").addHandler(logs)
        try:
            _change(ckpt, table, [5 + trial, 500 + trial])
            ckpt.save(1, {"m": ckpt.emb})
        finally:
            logging.getLogger("deltackpt").removeHandler(logs)
        found += logs.count > 0
        ckpt.close()
    sd = (trials * p * (1 - p)) ** 0.5
    assert abs(found - trials * p) <= 5 * sd, (found, trials * p)


class _Counter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += WARNING in record.getMessage()


def test_detection_probability_edges():
    c = Canary(fraction=0.0, min_rows=10, audit_every=None)
    assert c.detection_probability(100, 0) == 0.0
    assert c.detection_probability(100, 1) == pytest.approx(0.1)
    assert c.detection_probability(100, 91) == 1.0
    assert Canary(min_rows=1024).detection_probability(1000, 1) == 1.0


@pytest.mark.parametrize("bad", [{"fraction": 1.5}, {"min_rows": 0}, {"audit_every": 0}])
def test_bad_settings_are_named(bad):
    (name, value), = bad.items()
    with pytest.raises(SettingError, match=f"{name} must .*, got {value}"):
        Canary(**bad)


@pytest.mark.parametrize("every", [1, 3])
def test_the_audit_always_catches_a_stray_change_and_writes_it(caplog, every):
    # One row sampled of 1000 per delta: the canary alone would almost never see it.
    ckpt, table = _tracked(Canary(fraction=0.0, min_rows=1, audit_every=every, seed=7))
    for step in range(1, every + 1):
        stray = [400 + step]
        caught = _delta_with_strays(ckpt, table, step, stray, caplog)
        if step < every:
            continue
        assert caught
        assert torch.equal(ckpt.load(step)["m"]["weight"], table)  # every stray row is in the store
    ckpt.close()


def test_an_audit_without_strays_keeps_the_marks(caplog):
    ckpt, table = _tracked(Canary(fraction=0.0, min_rows=1, audit_every=2, seed=1))
    for step in range(1, 6):
        assert not _delta_with_strays(ckpt, table, step, [], caplog)
        assert torch.equal(ckpt.load(step)["m"]["weight"], table)
    assert ckpt.save(6, {"m": ckpt.emb}).rows_changed == 0  # still by marks: nothing marked
    ckpt.close()


def test_a_base_rehashes_so_later_audits_compare_with_what_it_stored(caplog):
    # A stray change that a base stored must not look like a stray change to a later audit:
    # the base hashes the table whole once staged. One row sampled per delta (seeded), an audit
    # at every third delta since the last audit or base, a base every fourth save.
    ckpt, table = _tracked(Canary(fraction=0.0, min_rows=1, audit_every=3, seed=3), base_every=4)
    for step in (1, 2, 3):  # 3 is an audit, of a table without strays
        assert not _delta_with_strays(ckpt, table, step, [], caplog), step
    with torch.no_grad():
        table[9] += 5  # stray, then a base
    with caplog.at_level(logging.WARNING):
        assert ckpt.save(4, {"m": ckpt.emb}).kind == "base"
    assert torch.equal(ckpt.load(4)["m"]["weight"], table)
    for step in (5, 6, 7):  # 7 is the third delta since the base: an audit
        assert not _delta_with_strays(ckpt, table, step, [], caplog), step
        assert torch.equal(ckpt.load(step)["m"]["weight"], table)
    ckpt.close()


def test_the_tables_of_a_tracker_take_turns_to_audit(caplog):
    # Each of four tables has a stray change right after the base. One row sampled per delta
    # (seeded: it misses them), an audit every 8 deltas: each table's audit finds its own stray
    # at a delta of its own, all within 8 deltas of the base, so no delta hashes every table.
    ckpt = Checkpointer(MemoryStorage(), chunk_bytes=4096, memory_budget=1 << 16)
    tables = nn.ModuleDict({f"t{i}": nn.Embedding(ROWS, 4) for i in range(4)})
    ckpt.track(tables, prefix="m", canary=Canary(fraction=0.0, min_rows=1, audit_every=8, seed=5))
    assert ckpt.save(0, {"m": tables}).kind == "base"
    with torch.no_grad():
        for i, t in enumerate(tables.values()):
            t.weight[500 + i] += 1
    found: dict[str, int] = {}
    for step in range(1, 9):
        caplog.clear()
        for t in tables.values():
            t(torch.tensor([step]))
            with torch.no_grad():
                t.weight[step] += 1
        with caplog.at_level(logging.WARNING):
            assert ckpt.save(step, {"m": tables}).kind == "delta"
        for r in caplog.records:
            assert "the audit found" in r.getMessage()
            found[next(k for k in tables if f"'m/{k}.weight'" in r.getMessage())] = step
    assert sorted(found) == list(tables)
    assert len(set(found.values())) == 4, found
    restored = ckpt.load(8)["m"]
    assert all(torch.equal(restored[f"{k}.weight"], t.weight) for k, t in tables.items())
    ckpt.close()
