"""Writer fencing: one writer per store; a stale lease is taken over only explicitly."""

from __future__ import annotations

import socket

import pytest
import torch

from deltackpt import Checkpointer
from deltackpt.errors import WriterConflictError


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
