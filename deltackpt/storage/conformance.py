"""The tests every storage backend passes, shipped so that a new backend's test subclasses them.

Example (in a backend's test module)::

    class TestMyStorage(StorageConformance):
        def make_storage(self, tmp_path):
            return MyStorage(...)

pytest collects the subclass's inherited ``test_*`` methods; ``tmp_path`` is pytest's fixture.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..errors import StoreError
from .base import PointHook, Storage


class StorageConformance:
    """What the :class:`~deltackpt.storage.base.Storage` protocol promises, as tests."""

    def make_storage(self, tmp_path: Path) -> Storage:
        """A fresh, empty backend; ``tmp_path`` is a new directory it may use."""
        raise NotImplementedError

    def test_create_only_commit_has_one_winner_among_16_threads(self, tmp_path: Path) -> None:
        storage = self.make_storage(tmp_path)
        start = threading.Barrier(16)
        won: list[int] = []

        def race(i: int) -> None:
            start.wait()
            if storage.put_if_absent("commits/00000000000000000001.json", f"writer {i}".encode()):
                won.append(i)

        threads = [threading.Thread(target=race, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1
        assert storage.read("commits/00000000000000000001.json") == f"writer {won[0]}".encode()
        assert storage.list("commits") == ["00000000000000000001.json"]

    def test_swap_replaces_only_what_it_expects(self, tmp_path: Path) -> None:
        storage = self.make_storage(tmp_path)
        assert not storage.swap("writer.lease", b"a", b"b")  # absent, but "a" expected
        assert storage.size("writer.lease") is None
        assert storage.swap("writer.lease", None, b"a")
        assert not storage.swap("writer.lease", None, b"b")  # present, absence expected
        assert not storage.swap("writer.lease", b"x", b"b")
        assert storage.read("writer.lease") == b"a"
        assert storage.swap("writer.lease", b"a", b"bb")
        assert storage.read("writer.lease") == b"bb"
        assert not storage.swap("writer.lease", b"a", None)
        assert storage.swap("writer.lease", b"bb", None)
        assert storage.size("writer.lease") is None

    def test_swap_loses_no_update_among_8_threads(self, tmp_path: Path) -> None:
        # Each swap writes bytes of its own, as swap asks (the count, then who wrote it).
        storage = self.make_storage(tmp_path)
        storage.swap("writer.lease", None, b"0 start")
        start = threading.Barrier(8)

        def count_up(thread: int) -> None:
            start.wait()
            done = 0
            while done < 25:
                seen = storage.read("writer.lease")
                count = int(seen.split()[0]) + 1
                done += storage.swap("writer.lease", seen, f"{count} {thread}.{done}".encode())

        threads = [threading.Thread(target=count_up, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert storage.read("writer.lease").split()[0] == b"200"

    def test_write_read_size_list(self, tmp_path: Path) -> None:
        storage = self.make_storage(tmp_path)
        storage.write("steps/7-a/t/c.0", [memoryview(b"hello "), memoryview(b"world")])
        storage.write("steps/7-a/zarr.json", [memoryview(b"{}")])
        storage.write("steps/8-b/t/c.0", [memoryview(bytes(range(256)))])
        storage.sync(["steps/7-a/t/c.0", "steps/7-a/zarr.json", "steps/8-b/t/c.0"])
        assert storage.read("steps/7-a/t/c.0") == b"hello world"
        assert storage.size("steps/7-a/t/c.0") == 11
        assert storage.list("") == ["steps"]
        assert storage.list("steps") == ["7-a", "8-b"]
        assert storage.list("steps/7-a") == ["t", "zarr.json"]
        out = bytearray(5)
        assert storage.read_into("steps/7-a/t/c.0", memoryview(out), 6) == 11
        assert bytes(out) == b"world"
        out = bytearray(8)
        assert storage.read_into("steps/7-a/t/c.0", memoryview(out), 8) == 11  # past the end
        assert bytes(out[:3]) == b"rld"
        assert storage.usage("steps/7-a")[0] == 13
        assert storage.usage("steps/8-b/t/c.0")[0] == 256
        assert storage.usage("steps/8-b")[1] > 0

    def test_write_takes_each_part_as_it_comes(self, tmp_path: Path) -> None:
        # A writer streams through one buffer: a part's memory is refilled once the next is asked for.
        storage = self.make_storage(tmp_path)
        buffer = bytearray(4)

        def parts() -> Iterator[memoryview]:
            for fill in (b"aaaa", b"bbbb", b"cc"):
                buffer[: len(fill)] = fill
                yield memoryview(buffer)[: len(fill)]

        storage.write("steps/a/pack.0/c.0", parts())
        storage.sync(["steps/a/pack.0/c.0"])
        assert storage.read("steps/a/pack.0/c.0") == b"aaaabbbbcc"

    def test_files_lists_objects_only(self, tmp_path: Path) -> None:
        storage = self.make_storage(tmp_path)
        storage.write("commits/a.json", [memoryview(b"{}")])
        storage.write("commits/b.json/c", [memoryview(b"{}")])  # a folder named as a record
        storage.sync(["commits/a.json", "commits/b.json/c"])
        assert storage.list("commits") == ["a.json", "b.json"]
        assert storage.files("commits") == ["a.json"]
        assert storage.files("nothing") == []

    def test_keys_that_leave_the_store_are_refused(self, tmp_path: Path) -> None:
        storage = self.make_storage(tmp_path / "store")
        for key in ("../x", "a/../../x", "/x", "a//b", "a/./b", "a\x00b", ""):
            with pytest.raises(StoreError):
                storage.write(key, [memoryview(b"x")])
            with pytest.raises(StoreError):
                storage.read(key)
            with pytest.raises(StoreError):
                storage.put_if_absent(key, b"x")
            with pytest.raises(StoreError):
                storage.delete_tree(key)
        assert not (tmp_path / "x").exists()

    def test_write_refuses_an_existing_key(self, tmp_path: Path) -> None:
        storage = self.make_storage(tmp_path)
        storage.write("steps/a", [memoryview(b"1")])
        with pytest.raises(StoreError):
            storage.write("steps/a", [memoryview(b"2")])
        assert storage.read("steps/a") == b"1"

    def test_missing_keys(self, tmp_path: Path) -> None:
        storage = self.make_storage(tmp_path)
        with pytest.raises(FileNotFoundError):
            storage.read("nothing/here")
        with pytest.raises(FileNotFoundError):
            storage.read_into("nothing/here", memoryview(bytearray(4)))
        assert storage.size("nothing/here") is None
        assert storage.list("nothing") == []
        assert storage.usage("nothing") == (0, 0.0)
        storage.delete("nothing/here")
        storage.delete_tree("nothing")
        storage.sync_folders(["nothing"])

    def test_nothing_unfinished_is_left_by_whole_writes(self, tmp_path: Path) -> None:
        storage = self.make_storage(tmp_path)
        storage.write("steps/a/c.0", [memoryview(b"data")])
        storage.sync(["steps/a/c.0"])
        assert storage.abort_stale_uploads(float("inf")) == 0
        assert storage.read("steps/a/c.0") == b"data"

    def test_delete_and_delete_tree(self, tmp_path: Path) -> None:
        storage = self.make_storage(tmp_path)
        keys = ["steps/1-a/x/c.0", "steps/1-a/x/c.1", "steps/2-b/x/c.0"]
        for k in keys:
            storage.write(k, [memoryview(b"data")])
        storage.sync(keys)
        assert storage.put_if_absent("commits/1.json", b"{}")
        storage.delete("commits/1.json")
        assert storage.size("commits/1.json") is None
        assert storage.put_if_absent("commits/1.json", b"{}")  # the name is free again
        storage.delete_tree("steps/1-a")
        storage.sync_folders(["steps", "commits"])
        assert storage.list("steps") == ["2-b"]
        assert storage.size("steps/1-a/x/c.0") is None
        assert storage.read("steps/2-b/x/c.0") == b"data"

    def test_a_fault_at_any_point_of_a_commit_leaves_all_or_nothing(self, tmp_path: Path) -> None:
        probe = self.make_storage(tmp_path / "probe")
        phases: list[str] = []
        probe.on_point = lambda phase, key: phases.append(phase)
        assert probe.put_if_absent("commits/1.json", b"{}")
        assert phases, "a commit passes at least one durability point"
        for i in range(len(phases)):
            storage = self.make_storage(tmp_path / f"at{i}")
            storage.on_point = _fail_at(i)
            with pytest.raises(InjectedFault):
                storage.put_if_absent("commits/1.json", b"{}")
            storage.on_point = None
            present = storage.size("commits/1.json") is not None
            if i == 0:
                assert not present  # the first point comes before anything is visible
            if present:
                assert storage.read("commits/1.json") == b"{}", phases[i]
            assert storage.put_if_absent("commits/1.json", b"{}") is not present
            # Temp files (named with a leading dot) may stay behind, as after a crash; GC removes them.
            assert [n for n in storage.list("commits") if not n.startswith(".")] == ["1.json"]

    def test_a_fault_before_a_write_leaves_no_object(self, tmp_path: Path) -> None:
        storage = self.make_storage(tmp_path)
        storage.on_point = _fail_at(0)
        with pytest.raises(InjectedFault):
            storage.write("steps/a/c.0", [memoryview(b"data")])
        storage.on_point = None
        assert storage.size("steps/a/c.0") is None

    def test_sync_passes_a_durability_point(self, tmp_path: Path) -> None:
        storage = self.make_storage(tmp_path)
        storage.write("steps/a/c.0", [memoryview(b"data")])
        phases: list[str] = []
        storage.on_point = lambda phase, key: phases.append(phase)
        storage.sync(["steps/a/c.0"])
        assert phases


class InjectedFault(Exception):
    """Raised by a test's durability-point hook."""


def _fail_at(n: int) -> PointHook:
    seen = [0]

    def hook(phase: str, key: str) -> None:
        seen[0] += 1
        if seen[0] == n + 1:
            raise InjectedFault(phase)

    return hook
