"""Body counting for unique puts, built when first needed; the head's age in size()."""

from __future__ import annotations

from pathlib import Path

import pytest
from bdb_helpers import ALWAYS, FIFO_NAMES, NAMES, drain, put, session
from berkeleydb import db
from mqd_bdb.backend import _BdbBackend
from mqd_bdb.environment import ENV_FLAGS
from mqd_bdb.index import INLINE_INDEX
from mqd_bdb.names import encode_name, file_stem
from mqd_bdb.records import CAT_QUEUE, META, QID, U32, UNIQ, digest

from mqd.backend import Message


async def unique(b: _BdbBackend, queue: str, body: bytes) -> int | None:
    return await put(b, queue, body, unique=True)


@pytest.mark.parametrize("name", FIFO_NAMES)
def test_first_unique_put_counts_a_large_queue(name: str, tmp_path: Path) -> None:
    total = INLINE_INDEX * 2 + 500

    async def first(b: _BdbBackend) -> None:
        for i in range(total):
            await put(b, "q", b"%d" % (i % 1000))
        assert await unique(b, "q", b"5") is None
        assert await unique(b, "q", b"new") == total
        assert await unique(b, "q", b"new") is None
        # Counting went on with every change since.
        for _ in range(1500):
            await b.take("q", sync=ALWAYS)

    async def second(b: _BdbBackend) -> None:
        assert await unique(b, "q", b"999") is None  # one copy left, from i = 1999
        m = await b.reserve("q", lease=0, sync=ALWAYS)
        assert m is not None and m.body == b"500" and m.receipt is not None
        assert await unique(b, "q", b"500") is None  # reserved still counts
        assert await b.contains("q", b"500") is True
        assert await b.ack(m.receipt, sync=ALWAYS) is True
        assert await unique(b, "q", b"500") is not None
        rest = await drain(b, "q")
        assert len(rest) == total + 1 - 1500
        for body in (b"5", b"999", b"new", b"500"):
            assert await unique(b, "q", body) is not None

    session(name, tmp_path, first)
    session(name, tmp_path, second)


@pytest.mark.parametrize("name", FIFO_NAMES)
def test_leftovers_of_an_interrupted_count_are_cleared(name: str, tmp_path: Path) -> None:
    async def first(b: _BdbBackend) -> None:
        await put(b, "q", b"a")

    session(name, tmp_path, first)
    # As if a count had stopped half way: entries present, the queue not marked.
    env = db.DBEnv()
    env.open(str(tmp_path), ENV_FLAGS)
    try:
        if name == "bdb":
            counts = db.DB(env)
            counts.open(file_stem(encode_name("q")) + ".hash", None, db.DB_HASH, db.DB_AUTO_COMMIT)
            prefix = b""
        else:
            counts = db.DB(env)
            counts.open("queues.db", None, db.DB_BTREE, db.DB_AUTO_COMMIT)
            qid = META.unpack(counts.get(CAT_QUEUE + b"q"))[0]
            prefix = UNIQ + QID.pack(qid)
        for body in (b"ghost", b"a"):
            counts.put(prefix + digest(body), U32.pack(7), None, db.DB_AUTO_COMMIT)
        counts.close()
    finally:
        env.close()

    async def second(b: _BdbBackend) -> None:
        assert await unique(b, "q", b"ghost") == 1
        assert await unique(b, "q", b"a") is None
        await b.take("q", sync=ALWAYS)
        assert await unique(b, "q", b"a") == 2

    session(name, tmp_path, second)


@pytest.mark.parametrize("name", NAMES)
def test_random_and_unique_put_refuse_duplicates(name: str, tmp_path: Path) -> None:
    async def body(b: _BdbBackend) -> None:
        assert await unique(b, "q", b"x") == 0
        assert await unique(b, "q", b"x") is None
        plain = await put(b, "q", b"x")
        if name == "bdb-random":
            assert plain is None  # a set: the body is there already
        else:
            assert plain == 1
        size = await b.size("q")
        assert size is not None and size.items == (1 if name == "bdb-random" else 2)

    session(name, tmp_path, body)


@pytest.mark.parametrize("name", NAMES)
def test_head_created_follows_the_first_record(name: str, tmp_path: Path) -> None:
    fifo = name != "bdb-random"
    bodies = {b"m%d" % i: float(i) for i in range(1, 6)}  # body -> created

    def first_record(left: dict[bytes, float]) -> float:
        """`created` of the queue's first record: the oldest, or the least digest."""
        if not left:
            return 0.0
        if fifo:
            return min(left.values())
        return left[min(left, key=digest)]

    async def body(b: _BdbBackend) -> None:
        async def head() -> float:
            size = await b.size("q")
            assert size is not None
            return size.head_created

        for data, created in bodies.items():
            await b.put("q", Message(data, created=created), sync=ALWAYS)
        left = dict(bodies)
        assert await head() == first_record(left)
        if fifo:
            assert await head() == 1.0
        m = await b.take("q", sync=ALWAYS)
        assert m is not None
        del left[m.body]
        r = await b.reserve("q", lease=0, sync=ALWAYS)
        assert r is not None and r.receipt is not None
        m = await b.take("q", sync=ALWAYS)
        assert m is not None
        del left[m.body]
        # The open message is still in the queue, its record first if it sorts first.
        assert await head() == first_record(left)
        if fifo:
            assert await head() == 2.0
        assert await b.ack(r.receipt, sync=ALWAYS) is True
        del left[r.body]
        assert await head() == first_record(left)
        if fifo:
            assert await head() == 4.0
        await drain(b, "q")
        assert await head() == 0.0

    session(name, tmp_path, body)
