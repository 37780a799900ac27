"""Writer fencing: one writer per store; a stale lease is taken over only explicitly."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from deltackpt import Checkpointer, SettingError
from deltackpt.errors import WriterConflictError
from deltackpt.ops import lease


def test_second_writer_fails_fast_naming_the_holder(store_path):
    first = Checkpointer(store_path)
    first.save(1, {"t": torch.zeros(3)})
    second = Checkpointer(store_path)
    with pytest.raises(WriterConflictError, match=f"another writer holds .*{socket.gethostname()}"):
        second.save(2, {"t": torch.ones(3)})
    assert second.steps() == [1]
    second.load(1)  # reading needs no lease
    first.save(2, {"t": torch.ones(3)})
    first.close()
    second.save(3, {"t": torch.ones(3)})  # released by close()
    second.close()


def test_take_over_fences_the_old_writer(store_path):
    t = torch.zeros(100, 4)
    old = Checkpointer(store_path)
    old.save(1, {"t": t})  # then the job hangs or dies, keeping the lease
    new = Checkpointer(store_path, take_over=True)
    new.restore({"t": t})
    t[7] = 1
    assert new.save(2, {"t": t}).kind == "delta"
    with pytest.raises(WriterConflictError, match="taken over"):
        old.save(3, {"t": t * 2})
    assert new.steps() == [1, 2]
    new.save(3, {"t": t * 3})
    new.close()
    old.close()  # does not drop the new holder's lease: it is gone with new.close()
    with Checkpointer(store_path) as third:
        third.save(4, {"t": torch.zeros(3)})


@pytest.mark.parametrize("ttl", [0, -1, float("nan"), float("inf"), 3600.5, "30", True])
def test_lease_ttl_must_be_seconds_up_to_an_hour(store_path, ttl):
    with pytest.raises(SettingError, match=f"above 0 and at most 3600, got {ttl!r}"):
        Checkpointer(store_path, lease_ttl=ttl)


def test_holder_renews_its_lease_and_releases_it(store_path):
    with Checkpointer(store_path, lease_ttl=0.3) as ckpt:
        ckpt.save(1, {"t": torch.zeros(3)})
        first = lease.read(ckpt.store.storage)[1]
        time.sleep(0.5)
        later = lease.read(ckpt.store.storage)[1]
        assert later.holder == first.holder and later.epoch == first.epoch
        assert later.renewed > first.renewed
        assert time.time() - later.renewed < 0.3  # never expired
        ckpt.save(2, {"t": torch.ones(3)})  # still the holder
    assert lease.read(ckpt.store.storage) == (None, None)


def test_lease_names_the_head_and_the_save_in_flight(store_path):
    with Checkpointer(store_path) as ckpt:
        ckpt.save(1, {"t": torch.zeros(3)})
        after_first = lease.read(ckpt.store.storage)[1]
        assert after_first.head is None
        assert after_first.attempt == ckpt.store.manifest(1).attempt
        ckpt.save(2, {"t": torch.ones(3)})
        now = lease.read(ckpt.store.storage)[1]
        assert now.head == (1, ckpt.store.manifest(1).attempt)
        assert now.attempt == ckpt.store.manifest(2).attempt


def test_first_save_takes_the_lease_naming_its_save_in_one_write(store_path, monkeypatch):
    """The first save's lease write takes the lease and publishes the save in flight at once, on
    an I/O thread beside the scan, not on the saving thread before it."""
    takers: list[str] = []
    original = lease.acquire

    def acquire(*args, **kwargs):
        takers.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(lease, "acquire", acquire)
    with Checkpointer(store_path) as ckpt:
        ckpt.save(1, {"t": torch.zeros(3)})
        taken = lease.read(ckpt.store.storage)[1]
        assert taken.epoch == 1 and taken.attempt == ckpt.store.manifest(1).attempt
        assert taken.renewed == taken.since  # not written again after it was taken
    assert len(takers) == 1 and takers[0].startswith("deltackpt-io"), takers
