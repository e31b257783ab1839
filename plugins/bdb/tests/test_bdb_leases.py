"""Leases, limits and dead letters as Berkeley DB stores them: atomic, exact, durable."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from bdb_helpers import ALWAYS, FIFO_NAMES, NAMES, drain, make, put, session
from berkeleydb import db
from mqd_bdb.backend import _BdbBackend
from mqd_bdb.environment import ENV_FLAGS
from mqd_bdb.names import encode_name, file_stem
from mqd_bdb.records import CAT_FORMAT, CAT_QUEUE, CAT_RECENT, U32

from mqd.backend import Limits, Message, Put
from mqd.errors import StorageError
from mqd.testing.conformance import no_dead_letters


@pytest.mark.parametrize("name", NAMES)
def test_concurrent_reclaims_return_each_lease_once(name: str, tmp_path: Path) -> None:
    async def body(b: _BdbBackend) -> None:
        for i in range(20):
            await put(b, "q", b"m%d" % i)
        for _ in range(10):
            assert await b.reserve("q", lease=0.1, sync=ALWAYS) is not None
        await asyncio.sleep(0.2)
        to_dead = await asyncio.gather(
            *(b.reclaim(lambda q, m: "dead", sync=ALWAYS) for _ in range(3))
        )
        ended = [r for batch in to_dead for r in batch]
        assert sorted(r.message.offset for r in ended) == sorted({r.message.offset for r in ended})
        assert len(ended) == 10 and all(r.moved_to == "dead" for r in ended)
        q, dead = await b.size("q"), await b.size("dead")
        assert q is not None and (q.items, q.open) == (10, 0)
        assert dead is not None and dead.items == 10
        letters = await drain(b, "dead")
        assert {m.origin for m in letters} == {"q"}
        assert all(m.deliveries == 2 for m in letters)  # one reserve, kept; one take

    session(name, tmp_path, body)


def test_dead_letter_move_is_one_transaction(tmp_path: Path) -> None:
    blocked = tmp_path / (file_stem(encode_name("dead")) + ".btree")

    async def body(b: _BdbBackend) -> None:
        await put(b, "q", b"poison")
        m = await b.reserve("q", lease=0, sync=ALWAYS)
        assert m is not None and m.receipt is not None
        blocked.mkdir()  # the dead-letter queue's file cannot be made
        with pytest.raises(StorageError):
            await b.release(m.receipt, sync=ALWAYS, to="dead")
        # Rolled back whole: still open under the same lease, nothing moved.
        size = await b.size("q")
        assert size is not None and (size.items, size.open) == (1, 1)
        assert await b.size("dead") is None
        blocked.rmdir()
        assert await b.release(m.receipt, sync=ALWAYS, to="dead") is True
        assert await b.ack(m.receipt, sync=ALWAYS) is False

    async def after(b: _BdbBackend) -> None:
        letter = await b.take("dead", sync=ALWAYS)
        assert letter is not None and (letter.body, letter.origin) == (b"poison", "q")
        assert letter.deliveries == 2
        assert await b.take("q", sync=ALWAYS) is None

    session("bdb", tmp_path, body)
    session("bdb", tmp_path, after)


@pytest.mark.parametrize("name", NAMES)
def test_limits_hold_for_puts_in_one_batch(name: str, tmp_path: Path) -> None:
    async def body(b: _BdbBackend) -> None:
        refuse, drop = Limits(max_items=5), Limits(max_items=5, drop_oldest=True)
        results = await asyncio.gather(
            *(b.put("r", Message(b"%d" % i), sync=ALWAYS, limits=refuse) for i in range(20))
        )
        assert results.count(Put.STORED) == 5 and results.count(Put.FULL) == 15
        results = await asyncio.gather(
            *(b.put("d", Message(b"%d" % i), sync=ALWAYS, limits=drop) for i in range(20))
        )
        assert results == [Put.STORED] * 20
        by_bytes = Limits(max_bytes=10, drop_oldest=True)
        for i in range(10):
            assert (
                await b.put("b", Message(b"%03d" % i), sync=ALWAYS, limits=by_bytes) is Put.STORED
            )

    async def after(b: _BdbBackend) -> None:
        r, d, by = await b.size("r"), await b.size("d"), await b.size("b")
        assert r is not None and d is not None and by is not None
        assert (r.items, d.items, by.items, by.bytes) == (5, 5, 3, 9)
        assert sorted(m.body for m in await drain(b, "d")) == [b"%d" % i for i in range(15, 20)]
        assert sorted(m.body for m in await drain(b, "b")) == [b"007", b"008", b"009"]

    session(name, tmp_path, body)
    session(name, tmp_path, after)


@pytest.mark.parametrize("name", NAMES)
def test_remove_and_discard_touch_waiting_messages_only(name: str, tmp_path: Path) -> None:
    async def body(b: _BdbBackend) -> None:
        offsets = {}
        for i in range(6):
            data = b"m%d" % i
            offsets[data] = await put(b, "q", data, unique=True)
        opened = await b.reserve("q", lease=0, sync=ALWAYS)
        assert opened is not None and opened.receipt is not None
        # A waiting message that is not the head is found by its offset too.
        waiting = sorted(set(offsets) - {opened.body})
        far = waiting[-1]
        assert await b.remove("q", offsets[far] or 0, sync=ALWAYS) is True
        assert await b.remove("q", offsets[far] or 0, sync=ALWAYS) is False
        assert await b.remove("q", opened.offset, sync=ALWAYS) is False
        assert await b.discard("q", opened.body, sync=ALWAYS) == 0  # open: its holder's
        assert await b.contains("q", opened.body) is True
        assert await b.discard("q", waiting[0], sync=ALWAYS) == 1
        assert await b.contains("q", waiting[0]) is False
        size = await b.size("q")
        assert size is not None and (size.items, size.open) == (4, 1)
        assert await b.ack(opened.receipt, sync=ALWAYS) is True
        left = sorted(m.body for m in await drain(b, "q"))
        assert left == sorted(set(waiting) - {far, waiting[0]})

    session(name, tmp_path, body)


@pytest.mark.parametrize("name", FIFO_NAMES)
def test_discard_removes_every_waiting_copy(name: str, tmp_path: Path) -> None:
    async def body(b: _BdbBackend) -> None:
        for data in (b"x", b"y", b"x", b"x", b"z"):
            await put(b, "q", data)
        opened = await b.reserve("q", lease=0, sync=ALWAYS)
        assert opened is not None and opened.body == b"x"
        assert await b.discard("q", b"x", sync=ALWAYS) == 2
        assert await b.contains("q", b"x") is True  # the open copy
        assert [m.body for m in await drain(b, "q")] == [b"y", b"z"]

    session(name, tmp_path, body)


@pytest.mark.parametrize("name", NAMES)
def test_data_of_the_previous_format_is_refused(name: str, tmp_path: Path) -> None:
    catalog = "catalog.db" if name == "bdb" else "queues.db"
    env = db.DBEnv()
    env.open(str(tmp_path), ENV_FLAGS)
    try:
        handle = db.DB(env)
        handle.open(catalog, None, db.DB_BTREE, db.DB_CREATE | db.DB_AUTO_COMMIT)
        handle.put(CAT_QUEUE + b"q", b"\x00" * 45, None, db.DB_AUTO_COMMIT)
        handle.close()
    finally:
        env.close()

    async def main() -> None:
        b = make(name, tmp_path)
        with pytest.raises(StorageError, match=r"older record format.*README"):
            await b.open()

    asyncio.run(main())
    # Nothing was changed: it is refused again, and the lock was let go.
    asyncio.run(main())


@pytest.mark.parametrize("name", NAMES)
def test_data_of_format_2_is_read_and_marked_3(name: str, tmp_path: Path) -> None:
    async def first(b: _BdbBackend) -> None:
        for body in (b"one", b"two"):
            await put(b, "q", body)

    session(name, tmp_path, first)
    # Format 2 kept every queue's counts in its own record, and had no recent one.
    catalog = "catalog.db" if name == "bdb" else "queues.db"
    env = db.DBEnv()
    env.open(str(tmp_path), ENV_FLAGS)
    try:
        handle = db.DB(env)
        handle.open(catalog, None, db.DB_BTREE, db.DB_AUTO_COMMIT)
        assert U32.unpack(handle.get(CAT_FORMAT))[0] == 3
        handle.put(CAT_QUEUE + b"q", handle.get(CAT_RECENT), None, db.DB_AUTO_COMMIT)
        handle.delete(CAT_RECENT, None, db.DB_AUTO_COMMIT)
        handle.put(CAT_FORMAT, U32.pack(2), None, db.DB_AUTO_COMMIT)
        handle.close()
    finally:
        env.close()

    async def second(b: _BdbBackend) -> None:
        size = await b.size("q")
        assert size is not None and (size.items, size.bytes) == (2, 6)
        if name != "bdb-random":
            assert await put(b, "q", b"three") == 2
        assert U32.unpack(b.worker.store.cat.get(CAT_FORMAT))[0] == 3

    session(name, tmp_path, second)


def test_stale_receipts_after_delete(tmp_path: Path) -> None:
    async def body(b: _BdbBackend) -> None:
        await put(b, "q", b"old")
        m = await b.reserve("q", lease=0, sync=ALWAYS)
        assert m is not None and m.receipt is not None
        assert await b.delete("q", sync=ALWAYS) is True
        assert await put(b, "q", b"new") == m.offset
        fresh = await b.reserve("q", lease=0, sync=ALWAYS)
        assert fresh is not None and fresh.receipt is not None
        assert fresh.receipt.incarnation != m.receipt.incarnation
        for call in (b.ack(m.receipt, sync=ALWAYS), b.extend(m.receipt, lease=5, sync=ALWAYS)):
            assert await call is False
        assert await b.reclaim(no_dead_letters, sync=ALWAYS, owner=b.owner) != []
        assert [x.body for x in await drain(b, "q")] == [b"new"]

    session("bdb-single", tmp_path, body)
