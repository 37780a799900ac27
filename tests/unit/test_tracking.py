"""Row tracking: marks from lookups give the same change sets as full hashing, the canary notices
unmarked updates, marks carry over uncommitted saves, and the TorchRec adapter reads KJTs."""

from __future__ import annotations

import logging
import sys
import threading
import types

import pytest
import torch
from torch import nn

from deltackpt import StateError
from deltackpt.statetree import key_part
from deltackpt.tracking.changes import ChangeTracker
from deltackpt.tracking.marks import LOG_MIN, LOG_SHARE, Canary, TableMode, TrackedTable
from deltackpt.tracking.rows import RowTracker

ROWS = 300
DIM = 8
CHUNK = 64  # bytes: 16 fp32 values per dense chunk, so 1-D row state has many chunks


class Towers(nn.Module):
    """Three tables fed as a DLRM feeds them: a bag with 1-D ids and offsets, a bag with 2-D ids,
    and a plain embedding with 2-D ids; then a small dense layer."""

    def __init__(self, sparse: bool = True, padding_idx: int | None = None):
        super().__init__()
        self.bag = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=sparse)
        self.bag2d = nn.EmbeddingBag(ROWS + 7, DIM, mode="mean", sparse=sparse)
        self.emb = nn.Embedding(ROWS - 5, DIM, sparse=sparse, padding_idx=padding_idx)
        self.top = nn.Linear(3 * DIM, 1)

    def forward(self, flat: torch.Tensor, offsets: torch.Tensor, ids2d: torch.Tensor,
                tokens: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.bag(flat, offsets), self.bag2d(ids2d), self.emb(tokens).sum(1)], 1)
        return self.top(x).sum()


def skewed(gen: torch.Generator, n: int, rows: int) -> torch.Tensor:
    """Power-law-ish ids: a few hot rows, a long cold tail."""
    return (torch.rand(n, generator=gen) ** 3 * rows).long()


def batch(gen: torch.Generator, batch_size: int = 6) -> tuple[torch.Tensor, ...]:
    lengths = torch.randint(1, 5, (batch_size,), generator=gen)
    flat = skewed(gen, int(lengths.sum()), ROWS)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    ids2d = skewed(gen, batch_size * 3, ROWS + 7).view(batch_size, 3).int()  # int32 ids too
    tokens = skewed(gen, batch_size * 2, ROWS - 5).view(batch_size, 2)
    return flat, offsets, ids2d, tokens


class RowWiseAdagrad(torch.optim.Optimizer):
    """DLRM's row-wise Adagrad: one accumulator value per row (a 1-D state aligned with the
    table), updating only the rows in the sparse gradient."""

    def __init__(self, params, lr: float = 0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.coalesce()
                ids, vals = g.indices()[0], g.values()
                acc = self.state[p].setdefault("sum", torch.zeros(p.shape[0]))
                acc.index_add_(0, ids, vals.pow(2).mean(1))
                p.index_add_(0, ids, -group["lr"] * vals / (acc[ids].sqrt() + 1e-8)[:, None])


def optimizers(kind: str, model: Towers) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    tables = [model.bag.weight, model.bag2d.weight, model.emb.weight]
    sparse = {
        "sgd": lambda: torch.optim.SGD(tables, lr=0.5),
        "adagrad": lambda: torch.optim.Adagrad(tables, lr=0.5),
        "sparse_adam": lambda: torch.optim.SparseAdam(tables, lr=0.05),
        "rowwise_adagrad": lambda: RowWiseAdagrad(tables),
    }[kind]()
    return sparse, torch.optim.SGD(model.top.parameters(), lr=0.1)


def flat_state(model: nn.Module, opt: torch.optim.Optimizer, dense: torch.optim.Optimizer,
               ) -> dict[str, torch.Tensor]:
    """The flat keys a save of ``{"model": model, "optim": opt, "dense": dense}`` uses, built by
    hand from the documented scheme."""
    out = {f"model/{key_part(k)}": v.detach() for k, v in model.state_dict().items()}
    for prefix, o in (("optim", opt), ("dense", dense)):
        for i, st in o.state_dict()["state"].items():
            out.update({f"{prefix}/state/{i}/{key_part(n)}": v for n, v in st.items()
                        if isinstance(v, torch.Tensor)})
    return out


def train_step(model: Towers, opts, gen: torch.Generator) -> None:
    for o in opts:
        o.zero_grad()
    model(*batch(gen)).backward()
    for o in opts:
        o.step()


def same_changes(got, want) -> None:
    assert set(got) == set(want)
    for key in want:
        g, w = got[key].changed, want[key].changed
        assert (g is None) == (w is None), key
        if w is not None:
            assert torch.equal(g, w), f"{key}: marks {g.tolist()} != hashes {w.tolist()}"


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "sparse_adam", "rowwise_adagrad"])
def test_marks_give_the_hashes_change_sets(kind, caplog):
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    model = Towers()
    opt, dense = optimizers(kind, model)
    tracked = ChangeTracker(CHUNK)
    # A sample as large as the table (~63% of the rows, drawn with replacement) on every
    # save: proves the hashes kept for unmarked rows stay current.
    handle = tracked.rows.track(model, prefix="model", optimizer=opt, canary=Canary(fraction=1.0))
    assert handle.keys == ("model/bag.weight", "model/bag2d.weight", "model/emb.weight")
    # The oracle hashes everything; the 1-d row-wise sums, which the tracked tables' marks infer
    # aligned, it is told are, so that both count their changes in rows (elements).
    oracle = ChangeTracker(CHUNK, aligned={f"optim/state/{i}/sum": k for i, k in enumerate(handle.keys)}
                           if kind == "rowwise_adagrad" else None)
    aligned = set()
    for step in range(7):
        if step:
            train_step(model, (opt, dense), gen)
        tensors = flat_state(model, opt, dense)
        got, want = tracked.scan(tensors), oracle.scan(tensors)
        same_changes(got, want)
        if step >= 2:  # from the second save on, tables and optimizer state use marks
            partial = {k for k, c in got.items() if c.partial}
            table_state = {k for k in tensors if k.startswith("optim/state/") and
                           not k.endswith("/step")}
            assert partial == set(handle.keys) | table_state
            aligned |= table_state
        tracked.adopt(tensors, got)
        oracle.adopt(tensors, want)
    assert bool(aligned) == (kind != "sgd")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_tracked_table_missing_from_the_state_is_warned_of_once_unless_the_rank_holds_it(caplog):
    emb = nn.Embedding(50, 4)
    tracker = ChangeTracker(CHUNK)
    tracker.rows.track(emb, prefix="model")
    other = {"model/other": torch.zeros(3)}
    tracker.scan(other, held={"model/other", "model/weight"})  # a replica another rank writes
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    tracker.scan(other)
    tracker.scan(other)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == ["tracked table 'model/weight' is not in the saved state, so its marks go "
                      "unused; check the prefix given to track()"]


def test_canary_notices_weight_decay(caplog):
    gen = torch.Generator().manual_seed(2)
    torch.manual_seed(2)
    model = Towers(sparse=False)
    opt = torch.optim.AdamW([model.bag.weight, model.bag2d.weight, model.emb.weight],
                            lr=0.01, weight_decay=0.1)
    dense = torch.optim.SGD(model.top.parameters(), lr=0.1)
    tracked, oracle = ChangeTracker(CHUNK), ChangeTracker(CHUNK)
    tracked.rows.track(model, prefix="model", optimizer=opt)
    for step in range(4):
        if step:
            train_step(model, (opt, dense), gen)
        tensors = flat_state(model, opt, dense)
        with caplog.at_level(logging.WARNING, logger="deltackpt.tracking.changes"):
            got, want = tracked.scan(tensors), oracle.scan(tensors)
        same_changes(got, want)  # exact all the same
        tracked.adopt(tensors, got)
        oracle.adopt(tensors, want)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # The first delta (step 2) catches it, once per table; after that the tables hash.
    assert len(warned) == 3
    for key in ("model/bag.weight", "model/bag2d.weight", "model/emb.weight"):
        assert sum(repr(key) in w for w in warned) == 1
    assert all(t.mode is TableMode.HASHING for t in tracked.rows.tables())


def test_uncommitted_marks_reach_the_next_save():
    table = torch.zeros(50, 4)
    ct = ChangeTracker(CHUNK)
    ct.rows.mark("t", torch.tensor([1]))  # before the first save: the base hashes anyway
    ch = ct.scan({"t": table})
    assert ch["t"].changed is None
    ct.adopt({"t": table}, ch)
    table[[3, 9]] += 1
    ct.rows.mark("t", torch.tensor([9, 3, 3]))
    failed = ct.scan({"t": table})  # this save fails: no adopt
    assert failed["t"].changed.tolist() == [3, 9]
    table[20] += 1
    ct.rows.mark("t", torch.tensor([20], dtype=torch.int32))
    ch = ct.scan({"t": table})
    assert ch["t"].partial and ch["t"].changed.tolist() == [3, 9, 20]
    ct.adopt({"t": table}, ch)
    ch = ct.scan({"t": table})
    assert ch["t"].changed.tolist() == []


def test_empty_table():
    table = torch.zeros(0, 4)
    ct = ChangeTracker(CHUNK)
    ct.rows.mark("t", torch.tensor([], dtype=torch.long))
    ct.adopt({"t": table}, ct.scan({"t": table}))
    ch = ct.scan({"t": table})
    assert ch["t"].partial and ch["t"].changed.tolist() == []


def test_restore_restarts_marks():
    table = torch.zeros(40, 4)
    ct = ChangeTracker(CHUNK)
    ct.rows.mark("t", torch.tensor([0]))
    ct.adopt({"t": table}, ct.scan({"t": table}))
    ct.rows.mark("t", torch.tensor([5]))
    ct.scan({"t": table})  # a failed save leaves row 5 pending
    restored = torch.ones(40, 4)
    ct.reset({"t": restored})
    ch = ct.scan({"t": restored})
    assert ch["t"].partial and ch["t"].changed.tolist() == []


def test_padding_rows_are_marked_harmlessly():
    gen = torch.Generator().manual_seed(3)
    model = Towers(padding_idx=0)
    opt, dense = optimizers("adagrad", model)
    tracked, oracle = ChangeTracker(CHUNK), ChangeTracker(CHUNK)
    tracked.rows.track(model, optimizer=opt)
    for step in range(3):
        if step:
            train_step(model, (opt, dense), gen)
        tensors = flat_state(model, opt, dense)
        got, want = tracked.scan(tensors), oracle.scan(tensors)
        for key, w in want.items():
            if w.changed is not None:
                extra = set(got[key].changed.tolist()) - set(w.changed.tolist())
                assert extra <= ({0} if key.endswith("emb.weight") or "/2/" in key else set())
        tracked.adopt(tensors, got)
        oracle.adopt(tensors, want)


def test_resized_table_is_hashed_again():
    model = nn.Sequential(nn.Embedding(30, 4))
    ct = ChangeTracker(CHUNK)
    ct.rows.track(model, prefix="")
    tensors = {"0.weight": model[0].weight.detach()}
    ct.adopt(tensors, ct.scan(tensors))
    model[0] = nn.Embedding(60, 4)  # a new, larger table under the same name: not hooked
    model[0](torch.tensor([59]))
    tensors = {"0.weight": model[0].weight.detach()}
    assert ct.scan(tensors)["0.weight"].changed is None


def test_remove_stops_marking_and_warns_on_a_wrong_prefix(caplog):
    model = nn.Sequential(nn.EmbeddingBag(20, 4))
    rows = RowTracker()
    handle = rows.track(model, prefix="net")
    with caplog.at_level(logging.WARNING, logger="deltackpt.tracking.rows"):
        assert rows.resolve({"model/0.weight": model[0].weight}) == []
        rows.resolve({"model/0.weight": model[0].weight})
    assert [r.getMessage().count("'net/0.weight'") for r in caplog.records] == [1]
    handle.remove()
    assert rows.tables() == [] and not model[0]._forward_hooks


def test_tracking_twice_replaces_the_hook():
    model = nn.Sequential(nn.Embedding(20, 4))
    rows = RowTracker()
    rows.track(model)
    opt = torch.optim.Adagrad(model.parameters())
    rows.track(model, optimizer=opt)
    assert len(model[0]._forward_hooks) == 1
    (table,) = rows.tables()
    assert table.optimizer == (opt, "optim")


def test_mark_rejects_float_ids():
    with pytest.raises(StateError, match="int64 or int32"):
        RowTracker().mark("t", torch.tensor([1.0]))
    with pytest.raises(ValueError, match="fraction"):
        Canary(fraction=2.0)
    assert Canary(fraction=0.01, min_rows=5).sample_size(1000) == 10
    assert Canary().sample_size(100) == 100


# -- TorchRec adapter, against a stand-in for torchrec's public API ------------------------------


class FakeKJT:
    """The part of torchrec's KeyedJaggedTensor the adapter may use."""

    def __init__(self, keys: list[str], values: torch.Tensor, lengths: torch.Tensor):
        self._keys, self._values, self._lengths = keys, values, lengths

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        return torch.cat([torch.zeros(1, dtype=torch.long), self._lengths.cumsum(0)])

    def length_per_key(self) -> list[int]:
        return self._lengths.view(len(self._keys), -1).sum(1).tolist()


@pytest.fixture
def fake_torchrec(monkeypatch):
    """Registers a module named as torchrec's, holding EmbeddingBagCollectionInterface."""
    mod = types.ModuleType("torchrec.modules.embedding_modules")

    class EmbeddingBagCollectionInterface(nn.Module):
        pass

    class EmbeddingBagCollection(EmbeddingBagCollectionInterface):
        """Like torchrec's: an nn.EmbeddingBag per table, called per feature; ``fused`` reads the
        weights directly, as FusedEmbeddingBagCollection does."""

        def __init__(self, tables: dict[str, list[str]], fused: bool = False):
            super().__init__()
            self._configs = [types.SimpleNamespace(name=n, feature_names=f)
                             for n, f in tables.items()]
            self.embedding_bags = nn.ModuleDict({n: nn.EmbeddingBag(40, 4) for n in tables})
            self.fused = fused

        def embedding_bag_configs(self):
            return self._configs

        def forward(self, features: FakeKJT | dict) -> torch.Tensor:
            if isinstance(features, dict):  # torchrec takes a TensorDict too
                return torch.zeros(1, 4)
            values = dict(zip(features.keys(), torch.split(features.values(),
                                                           features.length_per_key())))
            out = []
            for cfg in self._configs:
                bag = self.embedding_bags[cfg.name]
                for f in cfg.feature_names:
                    if self.fused:
                        out.append(nn.functional.embedding_bag(values[f], bag.weight,
                                                               torch.tensor([0])))
                    else:
                        out.append(bag(values[f], torch.tensor([0])))
            return torch.cat(out, 1)

    mod.EmbeddingBagCollectionInterface = EmbeddingBagCollectionInterface
    mod.EmbeddingBagCollection = EmbeddingBagCollection
    monkeypatch.setitem(sys.modules, "torchrec.modules.embedding_modules", mod)
    return mod


@pytest.mark.parametrize("fused", [False, True])
def test_torchrec_collection_marks_by_feature(fake_torchrec, fused):
    model = nn.Module()
    model.sparse = fake_torchrec.EmbeddingBagCollection({"t1": ["f1", "f2"], "t2": ["f3"]}, fused)
    ct = ChangeTracker(CHUNK)
    handle = ct.rows.track(model, prefix="model")
    assert handle.keys == ("model/sparse.embedding_bags.t1.weight",
                           "model/sparse.embedding_bags.t2.weight")
    # The collection's own nn.EmbeddingBag modules are not hooked a second time.
    assert not any(b._forward_hooks for b in model.sparse.embedding_bags.values())
    tensors = {f"model/{key_part(k)}": v.detach() for k, v in model.state_dict().items()}
    ct.adopt(tensors, ct.scan(tensors))
    kjt = FakeKJT(["f1", "f2", "f3"], torch.tensor([1, 2, 7, 7, 30, 5]),
                  torch.tensor([2, 0, 1, 1, 1, 1]))
    model.sparse(kjt)
    marked = {t.name: t.mask.nonzero().flatten().tolist() for t in ct.rows.tables()}
    assert marked == {"model/sparse.embedding_bags.t1.weight": [1, 2, 7],
                      "model/sparse.embedding_bags.t2.weight": [5, 30]}


def test_torchrec_collection_rejects_other_inputs(fake_torchrec):
    ebc = fake_torchrec.EmbeddingBagCollection({"t1": ["f1"]})
    rows = RowTracker()
    rows.track(ebc, prefix="")
    with pytest.raises(StateError, match="KeyedJaggedTensor"):
        ebc({"f1": torch.tensor([1])})


def test_a_scan_finds_exactly_what_changed_in_tensors_hashed_together_and_apart():
    # Small tensors are hashed in one call and compared in one pass over their joined hashes;
    # large, non-contiguous and 1-d tensors apart. Changes at the first and last hash of a
    # tensor must land on that tensor alone, and each tensor's change set must be exactly the
    # one its own hashes give.
    gen = torch.Generator().manual_seed(11)
    state = {f"s{i}": torch.randn(3 + i % 4, 5, generator=gen) for i in range(300)}
    state["v"] = torch.randn(1000, generator=gen)  # dense: by chunks
    state["big"] = torch.randn(5000, 8, generator=gen)  # over SMALL_TENSOR_BYTES
    state["strided"] = torch.randn(8, 6, generator=gen).t()  # not contiguous
    tracker = ChangeTracker(256)
    tracker.adopt(state, tracker.hash_whole(state, tracker.scan(state)), base=True)
    edits = {"s0": [0], "s17": [0, 2], "s18": [-1], "s299": [-1], "v": [999], "big": [0, 4999],
             "strided": [5]}
    for key, rows in edits.items():
        for r in rows:
            state[key][r] += 1
    changes = tracker.scan(state)
    assert list(changes) == list(state)
    for key, t in state.items():
        ref = tracker._refs[key]
        want = (tracker.hash(t, tracker.by_rows(key, t)) != ref.hashes).nonzero().flatten()
        assert torch.equal(changes[key].changed, want), key
        assert bool(want.numel()) == (key in edits), key


def test_unchanged_tensors_keep_their_change_set_and_reference_from_save_to_save():
    # A delta of thousands of tiny tensors, one of them changed, makes no new object for the others.
    state = {f"s{i}": torch.randn(4, 5) for i in range(50)} | {"v": torch.randn(100)}
    tracker = ChangeTracker(256)
    tracker.adopt(state, tracker.hash_whole(state, tracker.scan(state)), base=True)
    first = tracker.scan(state)
    tracker.adopt(state, first)
    refs = dict(tracker._refs)
    state["s3"][1] += 1
    second = tracker.scan(state)
    assert second["s3"].changed.tolist() == [1]
    tracker.adopt(state, second)
    for key in state:
        if key != "s3":
            assert second[key] is first[key], key
            assert tracker._refs[key] is refs[key], key


def test_scans_stay_exact_over_saves_that_reuse_the_joined_references():
    # The references of small tensors hashed together are kept joined from one commit to the
    # next. Over saves that change, add, drop and reshape tensors, fail before committing, track
    # a table by marks (whose references are updated in place) and stop tracking it, each scan
    # must give every tensor exactly what its hashes against the last commit give.
    gen = torch.Generator().manual_seed(5)
    state = {f"s{i}": torch.randn(2 + i % 3, 4, generator=gen) for i in range(40)}
    state["v"] = torch.randn(300, generator=gen)
    state["m"] = torch.randn(30, 4, generator=gen)
    tracker = ChangeTracker(64)
    hash_of = ChangeTracker(64)  # hashes only: the oracle

    def check(changes, committed):
        assert set(changes) == set(state)
        for key, t in state.items():
            old = committed.get(key)
            if old is None or old.shape != t.shape or old.dtype != t.dtype:
                assert changes[key].changed is None, key
                continue
            by_rows = t.dim() >= 2
            want = (hash_of.hash(t, by_rows) != hash_of.hash(old, by_rows)).nonzero().flatten()
            assert torch.equal(changes[key].changed, want), (key, changes[key].changed, want)

    committed: dict[str, torch.Tensor] = {}
    for save in range(12):
        if save:
            for key in ("s0", f"s{save}", f"s{39 - save}", "v"):
                state[key].view(-1)[(save * 7) % state[key].numel()] += 1
        if save == 3:
            state["new"] = torch.randn(3, 4, generator=gen)
        if save == 5:
            del state["s20"]
            state["s21"] = torch.randn(9, 4, generator=gen)
        if 4 <= save < 8:  # tracked by marks, its references updated in place
            state["m"][save] += 1
            tracker.rows.mark("m", torch.tensor([save]))
        if save == 8:
            tracker.rows.untrack([], ["m"])
            state["m"][0] += 1
        changes = tracker.scan(state)
        check(changes, committed)
        if save in (2, 9):  # this save fails: nothing is adopted
            continue
        if save == 0:
            changes = tracker.hash_whole(state, changes)
        tracker.adopt(state, changes, base=save == 0)
        committed = {k: t.clone() for k, t in state.items()}


def test_the_first_delta_after_a_base_compares_with_the_base_hashes_kept_joined(monkeypatch):
    # A base's small tensors, hashed in one call by hash_whole, stay joined as the references of
    # the next delta's scan: it neither joins 20,000 references again nor sizes their pieces.
    state = {f"s{i}": torch.randn(4, 5) for i in range(50)} | {"v": torch.randn(100)}
    tracker = ChangeTracker(256)
    tracker.adopt(state, tracker.hash_whole(state, tracker.scan(state)), base=True)
    joined = []
    monkeypatch.setattr(torch, "cat", lambda *a, **k: joined.append(a) or torch.tensor([]))
    monkeypatch.setattr(tracker, "_piece", lambda *a: pytest.fail("a piece sized again"))
    state["s7"][2] += 1
    changes = tracker.scan(state)
    assert not joined
    assert {k for k, ch in changes.items() if ch.changed.numel()} == {"s7"}
    assert changes["s7"].changed.tolist() == [2]


@pytest.mark.parametrize("marked", [0, 5, LOG_MIN + 7, 3_000, 9_000])
def test_a_take_gives_every_marked_row_once_sorted_whether_logged_or_found_in_the_mask(marked):
    """A CPU table logs the rows it marks (its log growing from LOG_MIN) up to LOG_SHARE of its
    rows, past that the take passes over the mask: either way each take gives the rows marked
    since the one before, sorted, each once, and the next log starts empty."""
    rows = 40_000  # a log of up to 2,500 rows
    gen = torch.Generator().manual_seed(marked)
    table = TrackedTable(("t",), None, None, Canary())
    table.begin(rows, torch.device("cpu"))
    for _ in range(2):
        ids = torch.randint(0, rows, (marked,), generator=gen)
        for piece in ids.split(700):  # duplicates within and across the marks
            table.mark(torch.cat([piece, piece[:50]]))
        table.mark(torch.tensor([7, 7], dtype=torch.int32))
        assert (table.log is None) == (len(set(ids.tolist()) | {7}) > rows * LOG_SHARE)
        got = table.take()
        table.settle()
        assert got.tolist() == sorted(set(ids.tolist()) | {7})
        assert not table.mask.any() and table.logged == 0 and table.log is not None


def test_rows_marked_by_another_thread_during_takes_reach_exactly_one_take():
    rows, batch = 200_000, 500
    table = TrackedTable(("t",), None, None, Canary())
    table.begin(rows, torch.device("cpu"))
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(0))
    done = threading.Event()

    def marker() -> None:
        for piece in order.split(batch):
            table.mark(piece)
        done.set()

    thread = threading.Thread(target=marker)
    thread.start()
    taken = []
    while not done.is_set():
        taken += table.take().tolist()
        table.settle()
    thread.join()
    taken += table.take().tolist()
    assert len(taken) == rows and set(taken) == set(range(rows))


def test_a_mark_out_of_range_sets_the_ids_before_it():
    table = TrackedTable(("t",), None, None, Canary())
    table.begin(10, torch.device("cpu"))
    with pytest.raises(IndexError, match="row id 10 is out of range for 10 rows"):
        table.mark(torch.tensor([3, 1, 10, 2]))
    assert table.take().tolist() == [1, 3]


def test_a_change_undone_after_a_failed_save_is_no_change_and_a_new_one_is_found():
    # The scans of the same tensors keep how they split them and the change sets they found;
    # those of the tensors found changed at the last scan are made again even when the save
    # that scanned them failed (nothing adopted): undone, such a change is none.
    state = {f"s{i}": torch.randn(3, 4) for i in range(30)} | {"big": torch.randn(40_000)}
    tracker = ChangeTracker(64)
    tracker.adopt(state, tracker.hash_whole(state, tracker.scan(state)), base=True)
    was = state["s4"][1, 2].item()
    state["s4"][1, 2] = was + 1
    assert tracker.scan(state)["s4"].changed.tolist() == [1]  # this save fails: no adopt
    state["s4"][1, 2] = was
    again = tracker.scan(state)
    assert not any(ch.changed.numel() for ch in again.values())
    tracker.adopt(state, again)
    state["s9"][2, 0] += 1
    state["big"][39_000] += 1
    found = tracker.scan(state)
    assert {k: ch.changed.tolist() for k, ch in found.items() if ch.changed.numel()} == {
        "s9": [2], "big": [39_000 * 4 // 64]}
    tracker.adopt(state, found)
    assert not any(ch.changed.numel() for ch in tracker.scan(state).values())
