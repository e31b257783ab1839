"""Restarts, clean and by SIGKILL: reserved messages, counts and offsets survive."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from bdb_helpers import ALWAYS, FIFO_NAMES, NAMES, drain, put, return_own, session
from mqd_bdb import jobs
from mqd_bdb.backend import _BdbBackend
from mqd_bdb.catalog import RECENT_IDLE_S, RECENT_MAX

from mqd.backend import Capability, Limits, Message, Receipt
from mqd.testing.conformance import no_dead_letters


@pytest.mark.parametrize("name", NAMES)
def test_restart_keeps_counts_reservations_and_offsets(name: str, tmp_path: Path) -> None:
    async def first(b: _BdbBackend) -> tuple[list[int], int]:
        for i in range(30):
            await put(b, "a", b"a%d" % i)
            await put(b, "b", b"b%d" % i)
        reserved = []
        for _ in range(4):
            m = await b.reserve("a", lease=0, sync=ALWAYS)
            assert m is not None
            reserved.append(m.offset)
        left = sum(len(b"b%d" % i) for i in range(30))
        for _ in range(10):
            m = await b.take("b", sync=ALWAYS)
            assert m is not None
            left -= len(m.body)
        await put(b, "empty", b"x")
        await b.take("empty", sync=ALWAYS)
        return reserved, left

    reserved, left = session(name, tmp_path, first)

    async def second(b: _BdbBackend) -> None:
        assert sorted(await b.queues()) == ["a", "b", "empty"]
        a, bb, empty = await b.size("a"), await b.size("b"), await b.size("empty")
        assert a is not None and (a.items, a.open) == (30, 4)
        assert bb is not None and (bb.items, bb.open, bb.bytes) == (20, 0, left)
        assert empty is not None and (empty.items, empty.bytes, empty.open) == (0, 0, 0)
        # Leases of no deadline stay until their owner starts again.
        assert await b.reclaim(no_dead_letters, sync=ALWAYS) == []
        recovered = await return_own(b)
        assert sorted((q, m.offset) for q, m in recovered) == [("a", o) for o in sorted(reserved)]
        assert all(m.deliveries == 1 for _, m in recovered)
        assert await return_own(b) == []
        a = await b.size("a")
        assert a is not None and (a.items, a.open) == (30, 0)
        # Offsets continue; nothing handed out is reused.
        assert await put(b, "a", b"new") == 30
        assert await put(b, "empty", b"y") == 1
        again = await drain(b, "a")
        assert len(again) == 31
        back = [m for m in again if m.offset in reserved]
        assert sorted(m.offset for m in back) == sorted(reserved)
        assert all(m.deliveries == 2 for m in back)
        if Capability.FIFO in b.capabilities:
            # Returned messages come first, in their order.
            assert [m.offset for m in again[:4]] == sorted(reserved)

    session(name, tmp_path, second)


@pytest.mark.parametrize("name", NAMES)
def test_counts_of_more_queues_than_the_recent_record_holds(name: str, tmp_path: Path) -> None:
    # Queues beyond RECENT_MAX keep their counts in their own records; one
    # deleted leaves the recent record, one idle gives its place to another,
    # and one that is only read from is not idle.
    names = [f"q{i}" for i in range(RECENT_MAX + 6)]

    def bodies(queue: str) -> list[bytes]:
        return [b"%s-%d" % (queue.encode(), j) for j in range(int(queue[1:]) % 4 + 1)]

    async def first(b: _BdbBackend) -> None:
        for queue in names:
            for body in bodies(queue):
                await put(b, queue, body)
        recent = b.worker.store._recent
        assert list(recent) == names[:RECENT_MAX]
        assert await b.take("q0", sync=ALWAYS) is not None
        assert await b.take("q20", sync=ALWAYS) is not None
        assert await b.delete("q1", sync=ALWAYS) is True
        await asyncio.sleep(RECENT_IDLE_S + 0.2)
        await put(b, "q0", b"q0-late")  # q0 and q2 are busy again: they keep their places
        assert await b.take("q2", sync=ALWAYS) is not None
        await put(b, "late", b"one")  # into q1's place
        await put(b, "later", b"two")  # into the place of q3, the longest idle
        assert "q1" not in recent and "q3" not in recent
        assert {"q0", "q2", "late", "later"} <= set(recent) and len(recent) == RECENT_MAX

    session(name, tmp_path, first)
    left = {queue: bodies(queue) for queue in names}
    left["q0"] = [*left["q0"][1:], b"q0-late"]
    left["q2"] = left["q2"][1:]
    left["q20"] = left["q20"][1:]
    del left["q1"]
    left.update(late=[b"one"], later=[b"two"])
    puts = {queue: len(bodies(queue)) for queue in names}
    puts.update(q0=puts["q0"] + 1, late=1, later=1)

    async def second(b: _BdbBackend) -> None:
        assert sorted(await b.queues()) == sorted(left)
        for queue, waiting in left.items():
            size = await b.size(queue)
            assert size is not None, queue
            assert (size.items, size.bytes) == (len(waiting), sum(map(len, waiting))), queue
            if name != "bdb-random":  # offsets go on from the last put
                assert await put(b, queue, b"next") == puts[queue], queue
        assert await put(b, "q1", b"anew") == 0

    session(name, tmp_path, second)


@pytest.mark.parametrize("name", NAMES)
def test_a_queue_deleted_last_is_gone_after_a_restart(name: str, tmp_path: Path) -> None:
    # The delete's own transaction takes it out of the recent record.
    async def first(b: _BdbBackend) -> None:
        await put(b, "kept", b"one")
        await put(b, "gone", b"two")
        assert await b.delete("gone", sync=ALWAYS) is True

    session(name, tmp_path, first)
    _only_queue_after_restart(name, tmp_path, "kept", [b"one"])


@pytest.mark.parametrize("name", NAMES)
def test_a_failed_commit_leaves_the_recent_queues_as_they_were(name: str, tmp_path: Path) -> None:
    async def first(b: _BdbBackend) -> None:
        await put(b, "old", b"one")
        store = b.worker.store
        with b.worker.lock:
            before = dict(store._recent)
            txn = store.begin()
            store.run_job(txn, jobs.PUT, "new", (Message(b"x"), False, Limits(), None))
            store._end_run(txn)
            store._write_meta(txn, store._opened[1])  # what commit() does first
            assert set(store._recent) == {"old", "new"}
            store.abort(txn)  # as if the commit had failed
            assert store._recent == before
        await put(b, "old", b"two")
        assert await b.queues() == ["old"]

    session(name, tmp_path, first)
    _only_queue_after_restart(name, tmp_path, "old", [b"one", b"two"])


def _only_queue_after_restart(name: str, tmp_path: Path, queue: str, waiting: list[bytes]) -> None:
    """Started again, the backend holds `queue` alone, with `waiting` in it."""

    async def check(b: _BdbBackend) -> None:
        assert await b.queues() == [queue]
        size = await b.size(queue)
        assert size is not None
        assert (size.items, size.bytes) == (len(waiting), sum(map(len, waiting)))

    session(name, tmp_path, check)


@pytest.mark.parametrize("name", NAMES)
def test_leases_survive_a_restart_of_their_owner_only(name: str, tmp_path: Path) -> None:
    async def first(b: _BdbBackend) -> dict[str, tuple[bytes, Receipt]]:
        for body in (b"one", b"two", b"three"):
            await put(b, "q", body)
        held: dict[str, tuple[bytes, Receipt]] = {}
        for role, owner, lease in (("held", "A", 0.0), ("expiring", "A", 0.2), ("mine", "B", 0)):
            b.owner = owner
            m = await b.reserve("q", lease=lease, sync=ALWAYS)
            assert m is not None and m.receipt is not None
            held[role] = (m.body, m.receipt)
        return held

    held = session(name, tmp_path, first)
    time.sleep(0.3)

    async def second(b: _BdbBackend) -> None:
        b.owner = "B"
        ended = await return_own(b)
        # B's own lease and A's expired one come back; A's live lease stays.
        back = sorted([held["expiring"][0], held["mine"][0]])
        assert sorted(m.body for _, m in ended) == back
        size = await b.size("q")
        assert size is not None and (size.items, size.open) == (3, 1)
        # A receipt names its lease across restarts, and no other.
        assert await b.ack(held["mine"][1], sync=ALWAYS) is False
        assert await b.extend(held["held"][1], lease=30, sync=ALWAYS) is True
        assert await b.ack(held["held"][1], sync=ALWAYS) is True
        assert await b.ack(held["held"][1], sync=ALWAYS) is False
        assert sorted(m.body for m in await drain(b, "q")) == back

    session(name, tmp_path, second)


@pytest.mark.parametrize("name", NAMES)
def test_offsets_not_reused_after_emptying_and_restart(name: str, tmp_path: Path) -> None:
    async def fill(b: _BdbBackend) -> None:
        for i in range(5):
            await put(b, "q", b"%d" % i)
        assert len(await drain(b, "q")) == 5

    async def next_offset(b: _BdbBackend) -> int | None:
        offset = await put(b, "q", b"next")
        assert len(await drain(b, "q")) == 1
        return offset

    session(name, tmp_path, fill)
    assert session(name, tmp_path, next_offset) == 5
    assert session(name, tmp_path, next_offset) == 6


CHILD = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from pathlib import Path
    from mqd.backend import Message, StorageOptions, Sync
    from mqd_bdb.backend import BdbBackend, BdbRandomBackend, BdbSingleBackend

    classes = {"bdb": BdbBackend, "bdb-single": BdbSingleBackend, "bdb-random": BdbRandomBackend}
    name, data_dir = sys.argv[1], Path(sys.argv[2])

    async def main():
        b = classes[name](StorageOptions(data_dir=data_dir))
        await b.open()
        await b.reclaim(lambda q, m: None, sync=Sync.ALWAYS, owner=b.owner)
        async def producer(p):
            for i in range(100):
                body = b"%d-%d" % (p, i)
                await b.put("q%d" % (p % 3), Message(body), sync=Sync.ALWAYS)
                print("put", p % 3, body.decode(), flush=True)
        await asyncio.gather(*(producer(p) for p in range(6)))
        for q in range(3):
            for _ in range(20):
                m = await b.take(f"q{q}", sync=Sync.ALWAYS)
                print("take", q, m.body.decode(), flush=True)
            m = await b.reserve(f"q{q}", lease=0, sync=Sync.ALWAYS)
            print("reserve", q, m.body.decode(), m.offset, flush=True)
        # Unsynced work in flight when the process dies may or may not land.
        tasks = [asyncio.ensure_future(b.put("q0", Message(b"late%d" % i), sync=Sync.NONE))
                 for i in range(50)]
        await asyncio.sleep(0)
        os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("name", NAMES)
def test_sigkill_loses_nothing_acknowledged(name: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, name, str(tmp_path)],
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    acked: dict[int, set[str]] = {0: set(), 1: set(), 2: set()}
    reserved: dict[int, tuple[str, int]] = {}
    for line in proc.stdout.decode().splitlines():
        kind, q, body, *rest = line.split()
        if kind == "put":
            acked[int(q)].add(body)
        elif kind == "take":
            acked[int(q)].discard(body)
        else:
            reserved[int(q)] = (body, int(rest[0]))
    assert sum(len(v) for v in acked.values()) == 600 - 60

    async def check(b: _BdbBackend) -> None:
        sizes = {q: await b.size(f"q{q}") for q in range(3)}
        recovered = await return_own(b)
        assert sorted((qn, m.body.decode(), m.offset) for qn, m in recovered) == sorted(
            (f"q{q}", body, offset) for q, (body, offset) in reserved.items()
        )
        for q in range(3):
            size = sizes[q]
            assert size is not None
            got = {m.body.decode() for m in await drain(b, f"q{q}")}
            late = {body for body in got if body.startswith("late")}
            assert got - late == acked[q]  # the open message came back
            assert size.items == len(got) and size.open == 1
            assert await put(b, f"q{q}", b"after") == 200 + (len(late) if q == 0 else 0)

    session(name, tmp_path, check)


@pytest.mark.parametrize("name", FIFO_NAMES)
def test_read_at_and_peek_after_restart(name: str, tmp_path: Path) -> None:
    async def first(b: _BdbBackend) -> None:
        for i in range(3):
            await put(b, "q", b"m%d" % i, sync=ALWAYS)
        await b.reserve("q", lease=0, sync=ALWAYS)

    async def second(b: _BdbBackend) -> None:
        m = await b.read_at("q", 0)
        assert m is not None and m.body == b"m0" and m.deliveries == 1
        head = await b.peek("q")
        assert head is not None and head.body == b"m1"

    session(name, tmp_path, first)
    session(name, tmp_path, second)


def test_data_dir_in_use_is_refused(tmp_path: Path) -> None:
    async def body(b: _BdbBackend) -> None:
        from bdb_helpers import make

        from mqd.errors import StorageError

        other = make("bdb", tmp_path)
        with pytest.raises(StorageError, match="in use"):
            await other.open()

    session("bdb", tmp_path, body)
    assert os.path.exists(tmp_path / "LOCK")


def test_queue_files_without_their_catalog_are_refused_not_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """catalog.db gone: the queue files that hold messages stay, and the start
    fails naming one. A queue's B-tree file gone, as a delete leaves it when the
    daemon dies before its commit is synced: the delete is finished, with a
    warning naming the file, and the other queues are as they were."""
    from bdb_helpers import make

    from mqd.errors import StorageError

    async def fill(b: _BdbBackend) -> None:
        for i in range(5):
            await put(b, "kept", b"m%d" % i)

    async def refused() -> None:
        b = make("bdb", tmp_path)
        try:
            with pytest.raises(StorageError) as failed:
                await b.open()
        finally:
            await b.close()
        raise failed.value

    session("bdb", tmp_path, fill)
    files = sorted(p.name for p in tmp_path.glob("q-*"))
    assert len(files) == 2
    saved = (tmp_path / "catalog.db").read_bytes()
    (tmp_path / "catalog.db").unlink()
    with pytest.raises(StorageError, match=r"q-.*\.btree holds messages, but .*catalog\.db"):
        asyncio.run(refused())
    assert sorted(p.name for p in tmp_path.glob("q-*")) == files
    (tmp_path / "catalog.db").write_bytes(saved)

    async def five(b: _BdbBackend) -> None:
        assert [m.body for m in await drain(b, "kept")] == [b"m%d" % i for i in range(5)]

    session("bdb", tmp_path, five)
    session("bdb", tmp_path, fill)

    async def other(b: _BdbBackend) -> None:
        await put(b, "other", b"o")

    session("bdb", tmp_path, other)
    btree = tmp_path / "q-kept.btree"
    btree.unlink()

    async def finished(b: _BdbBackend) -> None:
        assert await b.size("kept") is None
        assert sorted(await b.queues()) == ["other"]
        assert [m.body for m in await drain(b, "other")] == [b"o"]

    session("bdb", tmp_path, finished)
    assert f"{btree} is missing: queue 'kept' (5 message(s) in catalog.db)" in caplog.text
    assert not (tmp_path / "q-kept.hash").exists()
