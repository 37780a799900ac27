"""The checkpoint collectives: objects between ranks in fixed-size frames (every size of message
and reply arrives whole, whether it fits one frame or needs the second round, and nothing but the
root receives another rank's message), and a closed checkpointer lets go of its process group."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from dist_harness import check_ok, run_ranks


def message(rank: int, size: int) -> bytes:
    return bytes([rank % 251]) * size


def wire_job(rank: int, world: int, sizes: list[int], reply_size: int) -> dict:
    from deltackpt.wire import Wire

    wire = Wire(dist.group.WORLD, rank, world, root=1)
    received: list = []

    def reply(got: list) -> list:
        received.extend(got)
        return [message(r, reply_size + r) for r in range(world)]

    def one(got: list) -> bytes:
        return b"r" * reply_size

    return {
        "frame": wire.frame,
        "all": wire.all_gather(message(rank, sizes[rank])),
        "one": wire.broadcast(message(7, reply_size) if rank == 1 else None),
        "per_rank": wire.gather_reply(message(rank, sizes[rank]), reply, per_rank=True),
        "received": list(received),
        "shared": wire.gather_reply(("x", message(rank, sizes[rank])), one, per_rank=False),
        # The group still lines up after the rounds above.
        "after": wire.all_gather(rank),
    }


@pytest.mark.parametrize("sizes, reply_size", [
    ([10, 20, 30], 40),  # everything fits one frame
    ([10, 40_000, 30], 40),  # one rank's message needs the second round
    ([10, 20, 30], 50_000),  # the replies need the second round
    ([70_000, 40_000, 90_000], 60_000),  # every message and reply does
])
def test_every_message_arrives_whole(tmp_path, sizes, reply_size):
    world = len(sizes)
    results = check_ok(run_ranks(wire_job, world, str(tmp_path), sizes, reply_size))
    for rank, got in enumerate(results):
        assert got["frame"] < max(40_000, reply_size)  # the large cases do take the second round
        assert got["all"] == [message(r, sizes[r]) for r in range(world)]
        assert got["one"] == message(7, reply_size)
        assert got["per_rank"] == message(rank, reply_size + rank)
        assert got["received"] == ([message(r, sizes[r]) for r in range(world)] if rank == 1 else [])
        assert got["shared"] == b"r" * reply_size
        assert got["after"] == list(range(world))


class Collects:
    """Unpickles to whether the cyclic collector runs meanwhile."""

    def __reduce__(self):
        return gc.isenabled, ()


def paused_job(rank: int, world: int) -> list[bool]:
    from deltackpt.wire import Wire

    wire = Wire(dist.group.WORLD, rank, world, root=0)
    return wire.gather_reply(Collects(), lambda got: got + [gc.isenabled()], per_rank=False)


def test_the_root_unpickles_and_answers_a_gather_with_the_collector_paused(tmp_path):
    # The coordinator receives thousands of local plans at once: collections of the objects
    # they unpickle to took most of the time.
    results = check_ok(run_ranks(paused_job, 2, str(tmp_path)))
    assert results == [[False, False, False]] * 2
    assert gc.isenabled()


def close_job(rank: int, world: int, root: str) -> bool:
    from deltackpt import Checkpointer, Shard

    table = torch.arange(40.0).reshape(20, 2)
    ckpt = Checkpointer(root)
    for step in (1, 2):
        table[step] += 1
        ckpt.save(step, {"t": Shard(table[rank * 10:(rank + 1) * 10].clone(), global_shape=(20, 2),
                                    global_offset=(rank * 10, 0))})
    ckpt.close()
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    # Kept alive by the (closed) checkpointer, the group's worker threads would run on into the
    # interpreter's exit and could abort it while dropping their last collective's tensors.
    return group() is None


def test_a_closed_checkpointer_lets_go_of_the_process_group(tmp_path):
    assert check_ok(run_ranks(close_job, 2, str(tmp_path), str(tmp_path / "store"))) == [True, True]


def rounds_job(rank: int, world: int, root: str) -> list[tuple[str, list[str]]]:
    import deltackpt
    from deltackpt.collectives import Collective

    phases: list[str] = []
    real = Collective.gather

    def gather(self, phase, *args, **kwargs):
        phases.append(phase)
        return real(self, phase, *args, **kwargs)

    Collective.gather = gather
    table = torch.arange(4000.0).reshape(400, 10) + rank
    shard = deltackpt.Shard(table, global_shape=(800, 10), global_offset=(400 * rank, 0))
    saves = []
    with deltackpt.Checkpointer(root) as ckpt:
        ckpt.save(1, {"t": shard})
        for step, blocking in ((2, True), (3, False)):
            table[::7] += 1
            phases.clear()
            info = ckpt.save(step, {"t": shard}, blocking=blocking)
            saves.append((info.kind if blocking else info.result().kind, list(phases)))
    return saves


def test_a_blocking_save_stages_in_the_write_round(tmp_path):
    # A background save needs its own round for stage: it returns once every rank has staged.
    got = check_ok(run_ranks(rounds_job, 2, str(tmp_path), str(tmp_path / "store")))
    assert got == [[("delta", ["plan_local", "scan", "write"]),
                    ("delta", ["plan_local", "scan", "stage", "write"])]] * 2
