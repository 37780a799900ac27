"""Store: the committed steps of a store, their records, chains, and the create-only commit."""

from __future__ import annotations

import pytest
import torch

from deltackpt import Checkpointer, MemoryStorage, StepExistsError, StepNotFoundError, StoreError
from deltackpt.errors import BrokenChainError, ManifestError
from deltackpt.format.layout import commit_key
from deltackpt.storage import FaultInjection
from deltackpt.store import Store


def saved(steps: list[int]) -> MemoryStorage:
    storage = MemoryStorage()
    t = torch.zeros(50, 4)
    with Checkpointer(storage, base_every=3) as ckpt:
        for s in steps:
            t[s % 50] += 1
            ckpt.save(s, {"t": t})
    return storage


def test_steps_chains_and_records():
    storage = saved([1, 2, 3, 4, 5])
    store = Store(storage)
    store.check_exists()
    storage.put_if_absent("commits/.00000000000000000009.json.x.tmp", b"junk")  # a temp file
    assert store.steps() == [1, 2, 3, 4, 5]
    assert [m.step for m in store.chain(5)] == [4, 5]  # a base every three saves
    assert [m.kind for m in store.chain(3)] == ["base", "delta", "delta"]
    with pytest.raises(StepNotFoundError):
        store.manifest(6)
    m = store.manifest(5)
    assert not store.commit(m)  # create-only: a second commit of a step is refused


def test_new_steps_must_come_after_the_latest():
    store = Store(saved([1, 2]))
    store.check_new_step(3)
    with pytest.raises(StepExistsError, match="committed already"):
        store.check_new_step(2)
    with pytest.raises(StepExistsError, match="not after the latest committed step 2"):
        store.check_new_step(0)


def test_a_missing_parent_breaks_the_chain_and_a_missing_root_is_no_store():
    storage = saved([1, 2, 3])
    storage.delete(commit_key(2))
    with pytest.raises(BrokenChainError, match="step 2"):
        Store(storage).chain(3)
    with pytest.raises(StoreError, match="no deltackpt store"):
        Store(MemoryStorage()).check_exists()


class Vanishing(FaultInjection):
    """Files whose names end with ``gone`` are deleted between their sizing and their read (as a
    GC or another process may do): sized, then not found."""

    def __init__(self, inner: MemoryStorage, gone: tuple[str, ...]):
        super().__init__(inner, lambda phase, key: None)
        self.gone = gone

    def read(self, key: str) -> bytes:
        if key.endswith(self.gone):
            raise FileNotFoundError(key)
        return super().read(key)


def test_a_file_deleted_between_its_size_and_its_read_is_a_typed_error():
    with pytest.raises(StoreError, match="no deltackpt store"):
        Store(Vanishing(saved([1]), ("zarr.json",))).check_exists()
    with Checkpointer(Vanishing(saved([1, 2]), ("/parts.0",)), create=False) as ckpt:
        with pytest.raises(ManifestError, match="parts.0: the record lists a part table of .* it is missing"):
            ckpt.load(2)


def test_holds_reads_the_record_afresh_even_when_it_knows_its_bytes():
    """A delta checks twice that its parent's record is still there. The store compares the
    record's bytes with those it committed rather than parsing them again; a record that was
    replaced (another attempt of the step) or removed must still count as not held."""
    storage = MemoryStorage()
    with Checkpointer(storage) as ckpt:
        ckpt.save(1, {"t": torch.zeros(3)})
        store = ckpt.store
        attempt = store.manifest(1).attempt
        assert store.holds(1, attempt) and store.holds(1, attempt)
        assert not store.holds(1, "1-000000000000")
        data = storage.read(commit_key(1))
        other = data.replace(attempt.encode(), b"1-000000000000")
        storage.delete(commit_key(1))
        storage.put_if_absent(commit_key(1), other)
        assert not store.holds(1, attempt)
        assert store.holds(1, "1-000000000000")
        storage.delete(commit_key(1))
        assert not store.holds(1, "1-000000000000") and not store.holds(1, attempt)
