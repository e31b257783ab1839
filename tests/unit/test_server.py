"""The server and broker in process, with a fake transport collecting writes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqd import resp
from mqd.backend import (
    Capability,
    Holder,
    Message,
    Pending,
    Put,
    Receipt,
    StorageOptions,
    Sync,
)
from mqd.backends.memory import MemoryBackend
from mqd.config import Config
from mqd.connection import Connection
from mqd.errors import StorageError
from mqd.redis_server import RedisConnection
from mqd.server import Server


class FakeTransport:
    def __init__(self) -> None:
        self.written = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default  # plain TCP: no sslcontext


class FifoOnly(MemoryBackend):
    name = "fifo-only"
    capabilities = frozenset({Capability.FIFO})


async def converse(
    chunks: list[bytes], backend: MemoryBackend | None = None, **config: Any
) -> bytes:
    """Feed `chunks` to one connection of an in-process server; return what it wrote."""
    server = Server(Config(backend="memory", **config), backend or MemoryBackend(StorageOptions()))
    server.loop = asyncio.get_running_loop()
    await server.broker.start()
    connection = Connection(server)
    transport = FakeTransport()
    connection.connection_made(transport)  # type: ignore[arg-type]
    for chunk in chunks:
        connection.data_received(chunk)
        while connection.task is not None:
            await asyncio.sleep(0.001)
    return bytes(transport.written)


class GroupCommit(MemoryBackend):
    """A memory backend whose puts and takes complete together at the end of a loop turn.

    As a group-commit backend does: every call made in one turn shares one
    flush, counted in `flushes`.
    """

    name = "group-commit"

    def __init__(self, options: StorageOptions) -> None:
        super().__init__(options)
        self.flushes = 0
        self.calls: list[str] = []
        self._batch: list[asyncio.Future[None]] = []

    async def _flush_later(self, what: str) -> None:
        self.calls.append(what)
        future = asyncio.get_running_loop().create_future()
        if not self._batch:
            asyncio.get_running_loop().call_soon(self._flush)
        self._batch.append(future)
        await future

    def _flush(self) -> None:
        self.flushes += 1
        batch, self._batch = self._batch, []
        for future in batch:
            future.set_result(None)

    async def put(self, queue: str, message: Message, **options: Any) -> Put:
        result = await super().put(queue, message, **options)
        await self._flush_later(f"put {queue} {message.body.decode()}")
        return result

    async def take(self, queue: str, **options: Any) -> Message | None:
        message = await super().take(queue, **options)
        await self._flush_later(f"take {queue}")
        return message

    async def ack(self, receipt: Receipt, *, sync: Sync) -> bool:
        acked = await super().ack(receipt, sync=sync)
        await self._flush_later(f"ack {receipt.queue}")
        return acked


def test_pipelined_sets_and_gets_share_one_flush_and_reply_in_order() -> None:
    backend = GroupCommit(StorageOptions())
    sets = b"".join(b"set p%d 0 0 1\r\n%d\r\n" % (i % 2, i) for i in range(10))
    gets = b"get p0\r\nget p1\r\nget p0\r\n"
    reply = talk([sets + gets + b"delete p1\r\nset p0 0 0 1\r\nz\r\nget p0\r\n"], backend=backend)
    assert reply == (
        b"STORED\r\n" * 10
        + b"VALUE p0 0 1\r\n0\r\nEND\r\nVALUE p1 0 1\r\n1\r\nEND\r\nVALUE p0 0 1\r\n2\r\nEND\r\n"
        + b"DELETED\r\nSTORED\r\nVALUE p0 0 1\r\n4\r\nEND\r\n"
    )
    # The 13 sets and gets before `delete` reached the backend in order, in
    # one turn (one flush); delete waited for them; the last two shared one.
    assert backend.calls[:13] == [f"put p{i % 2} {i}" for i in range(10)] + [
        "take p0",
        "take p1",
        "take p0",
    ]
    assert backend.flushes == 2


def test_a_pipelined_close_shares_the_flush_of_the_sets_and_gets_around_it() -> None:
    backend = GroupCommit(StorageOptions())
    reply = talk(
        [
            b"set c 0 0 1\r\na\r\nset c 0 0 1\r\nb\r\nget c/open\r\n",
            b"set c 0 0 1\r\nc\r\nget c/close\r\nget c\r\nget c/close\r\nget c\r\n",
        ],
        backend=backend,
    )
    assert reply == (
        b"STORED\r\nSTORED\r\nVALUE c/open 0 1\r\na\r\nEND\r\n"
        b"STORED\r\nEND\r\nVALUE c 0 1\r\nb\r\nEND\r\nEND\r\nVALUE c 0 1\r\nc\r\nEND\r\n"
    )
    # The second read's set, acknowledgement and gets reached the backend in
    # order and shared one flush; the second /close had nothing open.
    assert backend.calls[2:] == ["put c c", "ack c", "take c", "take c"]
    assert backend.flushes == 2


def test_a_get_that_may_wait_waits_for_the_sets_before_it() -> None:
    backend = GroupCommit(StorageOptions())
    reply = talk(
        [b"set w 0 0 1\r\na\r\nset w 0 0 1\r\nb\r\nget w/t=10\r\nget w/open\r\nget w\r\n"],
        backend=backend,
    )
    assert reply == (
        b"STORED\r\nSTORED\r\nVALUE w/t=10 0 1\r\na\r\nEND\r\nVALUE w/open 0 1\r\nb\r\nEND\r\n"
        b"END\r\n"
    )


def test_a_limited_queue_keeps_a_get_behind_its_set() -> None:
    backend = GroupCommit(StorageOptions())
    chunk = b"set lim 0 0 1\r\n1\r\nget lim\r\nset lim 0 0 1\r\n2\r\nget lim\r\n"
    reply = talk([chunk], backend=backend, queues=(("lim", {"max_items": 5}),))
    assert (
        reply == b"STORED\r\nVALUE lim 0 1\r\n1\r\nEND\r\nSTORED\r\nVALUE lim 0 1\r\n2\r\nEND\r\n"
    )


class ReadOnly(MemoryBackend):
    async def put(self, queue: str, message: Message, **options: Any) -> Put:
        raise StorageError("read-only file system")


def test_storage_errors_are_logged_naming_the_data_dir(caplog: pytest.LogCaptureFixture) -> None:
    backend = ReadOnly(StorageOptions())
    reply = talk([b"set r 0 0 1\r\nx\r\n" * 3], backend=backend, data_dir=Path("/srv/mqd"))
    assert reply == b"SERVER_ERROR read-only file system\r\n" * 3
    lines = [r.getMessage() for r in caplog.records if "storage error" in r.getMessage()]
    assert lines == ["storage error in /srv/mqd: read-only file system"]  # repeats held back


def talk(chunks: list[bytes], **kwargs: Any) -> bytes:
    return asyncio.run(converse(chunks, **kwargs))


class ReserveFailsOnce(MemoryBackend):
    """A memory backend whose first reserve fails, as a store gone for a moment does,
    and whose lease renewals wait a turn, as a store's round trip does."""

    name = "reserve-fails-once"

    def __init__(self, options: StorageOptions) -> None:
        super().__init__(options)
        self.failed = False

    async def reserve_many(self, queue: str, count: int, **options: Any) -> list[Message]:
        if not self.failed:
            self.failed = True
            raise StorageError("cluster unavailable")
        return await super().reserve_many(queue, count, **options)

    async def extend_many(
        self, receipts: Sequence[Receipt], *, lease: float, sync: Sync
    ) -> list[bool]:
        await asyncio.sleep(0)
        return await super().extend_many(receipts, lease=lease, sync=sync)


def test_a_lease_that_failed_leaves_the_next_leases_working() -> None:
    # Compiled, a `finally` that awaited raised the failure of an earlier lease
    # again, after a later lease had reserved its message.
    reply = talk(
        [
            b"set a 0 0 1\r\nx\r\nset b 0 0 1\r\ny\r\n",
            b"gets a/lease=A/n=1\r\n",
            b"gets b/lease=B/n=1\r\n",
            b"gets a/lease=C/n=1\r\n",
        ],
        backend=ReserveFailsOnce(StorageOptions()),
    )
    assert reply == (
        b"STORED\r\nSTORED\r\nSERVER_ERROR cluster unavailable\r\n"
        b"VALUE b/lease=B/n=1 0 1 0\r\ny\r\nEND\r\n"
        b"VALUE a/lease=C/n=1 0 1 0\r\nx\r\nEND\r\n"
    )


async def _waiting_and_producer() -> tuple[Connection, FakeTransport, Connection, FakeTransport]:
    """A connection whose `get q/t=5000` waits, and another to feed the queue."""
    server = Server(Config(backend="memory"), MemoryBackend(StorageOptions()))
    server.loop = asyncio.get_running_loop()
    await server.broker.start()
    pairs = []
    for _ in range(2):
        connection, transport = Connection(server), FakeTransport()
        connection.connection_made(transport)  # type: ignore[arg-type]
        pairs.append((connection, transport))
    (waiting, waiting_out), (producer, producer_out) = pairs
    waiting.data_received(b"get q/t=5000\r\n")
    await asyncio.sleep(0.01)
    assert waiting.task is not None and not waiting_out.written
    return waiting, waiting_out, producer, producer_out


@pytest.mark.parametrize("gone", ["lost", "closing"])
def test_a_get_woken_as_its_connection_is_lost_leaves_the_message(gone: str) -> None:
    async def run() -> bytes:
        waiting, waiting_out, producer, producer_out = await _waiting_and_producer()
        producer.data_received(b"set q 0 0 1\r\nx\r\n")  # wakes the waiting get...
        # ...whose client is gone before it runs again: connection_lost ran, or
        # the transport saw the reset and is closing, connection_lost to come.
        if gone == "lost":
            waiting.connection_lost(None)
        else:
            waiting_out.closed = True
        await asyncio.sleep(0.01)
        producer.data_received(b"get q\r\n")
        return bytes(producer_out.written)

    assert asyncio.run(run()) == b"STORED\r\nVALUE q 0 1\r\nx\r\nEND\r\n"


def test_a_waiting_get_answers_none_at_the_end_of_file_and_takes_nothing() -> None:
    async def run() -> tuple[bytes, bool, bytes]:
        waiting, waiting_out, producer, producer_out = await _waiting_and_producer()
        waiting.eof_received()
        await asyncio.sleep(0.01)
        producer.data_received(b"set q 0 0 1\r\nx\r\nget q\r\n")
        await asyncio.sleep(0.01)
        return bytes(waiting_out.written), waiting_out.closed, bytes(producer_out.written)

    assert asyncio.run(run()) == (b"END\r\n", True, b"STORED\r\nVALUE q 0 1\r\nx\r\nEND\r\n")


def test_missing_capability_is_a_clear_error() -> None:
    backend = FifoOnly(StorageOptions())
    reply = talk([b"add q 0 0 1\r\nx\r\nget q/at=0\r\nset q 0 0 1\r\ny\r\n"], backend=backend)
    assert reply == (
        b"SERVER_ERROR add not supported by backend fifo-only\r\n"
        b"SERVER_ERROR at not supported by backend fifo-only\r\n"
        b"STORED\r\n"
    )


def test_unique_queue_on_a_backend_without_uniqueness() -> None:
    backend = FifoOnly(StorageOptions())
    reply = talk([b"set u 0 0 1\r\nx\r\n"], backend=backend, queues=(("u", {"unique": True}),))
    assert reply == b"SERVER_ERROR unique not supported by backend fifo-only\r\n"


def test_quit_closes_after_earlier_replies() -> None:
    reply = talk([b"version\r\nquit\r\nversion\r\n"])
    assert reply == b"VERSION 1.0.0\r\n"


def test_exptime_out_of_range_is_refused_on_every_path() -> None:
    huge = b"9" * 400
    for exptime in (huge, b"18446744073709551616", b"9223372036854775808"):
        fresh = talk([b"set ex1 0 %b 1\r\nx\r\n" % exptime])
        # The name is known to the connection now: the parser's fast path.
        warm = talk([b"set ex1 0 0 1\r\nx\r\nset ex1 0 %b 1\r\nx\r\n" % exptime])
        assert fresh == b"CLIENT_ERROR bad command line format\r\n"
        assert warm == b"STORED\r\n" + fresh


def test_numbers_too_long_for_int_are_a_client_error() -> None:
    reply = talk([b"get a/t=" + b"9" * 5000 + b"\r\nversion\r\n"])
    assert reply == b"CLIENT_ERROR bad command line format\r\nVERSION 1.0.0\r\n"


stream_parts = st.sampled_from(
    [
        b"set a 1 0 3\r\nabc\r\n",
        b"set b 0 0 0\r\n\r\n",
        b"add a 0 0 3\r\nabc\r\n",
        b"get a\r\n",
        b"gets a b\r\n",
        b"get a/open\r\n",
        b"get a/close\r\n",
        b"get a/abort\r\n",
        b"get b/peek\r\n",
        b"get a/at=1\r\n",
        b"delete b\r\n",
        b"set a 0 0 1\r\nxyz",
        b"bogus\r\n",
        b"incr a 1\r\n",
        b"append a 0 0 2\r\nzz\r\n",
        b"set a 0 0 1 noreply\r\nq\r\n",
        b"stats queues\r\n",
        b"version\n",
        # exptime and option numbers beyond 64 bits, on a warm name or a fresh one
        b"set a 0 " + b"9" * 400 + b" 1\r\nx\r\n",
        b"set a 0 18446744073709551616 1\r\nx\r\n",
        b"set a 0 -9223372036854775809 1\r\nx\r\n",
        b"get a/t=" + b"9" * 5000 + b"\r\n",
    ]
)


@settings(max_examples=150, deadline=None)
@given(st.lists(stream_parts, min_size=1, max_size=15), st.data())
def test_any_split_gives_the_same_replies(parts: list[bytes], data: st.DataObject) -> None:
    whole = b"".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(whole)), max_size=6)))
    chunks = [whole[a:b] for a, b in zip([0, *cuts], [*cuts, len(whole)], strict=True)]
    # stats lines carry ages; drop them from the comparison.
    assert _stable(talk([whole])) == _stable(talk(chunks))


def _stable(reply: bytes) -> bytes:
    return b"\n".join(line for line in reply.split(b"\n") if b"_age_ms" not in line)


class Holding(MemoryBackend):
    """A memory backend that answers holders at once and releases them at the turn's end.

    As the Berkeley DB backends do with a round: `fail` is the error the
    release carries (the round undone), and `seen` what the client had been
    sent at each release. With `wait`, it answers as the thread does: later,
    holding nothing.
    """

    name = "holding"
    answers_held = True

    def __init__(self, options: StorageOptions) -> None:
        super().__init__(options)
        self.fail: BaseException | None = None
        self.wait = False
        self.seen: list[bytes] = []
        self.transport = FakeTransport()
        self.manual = False  # rounds end when the test says (cut), not with the turn
        self._pending: Pending | None = None

    async def _hold(self, holder: Holder | None) -> None:
        if self.wait:
            await asyncio.sleep(0)
            return
        if holder is None:
            return
        if self._pending is None:
            self._pending = Pending()
            if not self.manual:
                asyncio.get_running_loop().call_soon(self._release)
        holder.hold(self._pending)

    def cut(self) -> Pending:
        """End the open round, not yet released: as a round that syncs while the next runs."""
        pending, self._pending = self._pending, None
        assert pending is not None
        return pending

    def _release(self) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None
        self.seen.append(bytes(self.transport.written))
        pending.end(self.fail)

    async def put(self, queue: str, message: Message, **options: Any) -> Put:
        await self._hold(options.get("holder"))
        return await super().put(queue, message, **options)

    async def take(self, queue: str, **options: Any) -> Message | None:
        await self._hold(options.get("holder"))
        return await super().take(queue, **options)


async def _holding_connection(
    kind: type[Connection] = Connection,
) -> tuple[Holding, Server, Connection]:
    """A connection of a server over a Holding backend, writing to its transport."""
    backend = Holding(StorageOptions())
    server = Server(Config(backend="memory"), backend)
    server.loop = asyncio.get_running_loop()
    await server.broker.start()
    connection = kind(server)
    connection.connection_made(backend.transport)  # type: ignore[arg-type]
    return backend, server, connection


def test_held_replies_go_out_on_release_or_become_the_error() -> None:
    async def main() -> None:
        backend, _, connection = await _holding_connection()
        transport = backend.transport

        async def send(data: bytes) -> bytes:
            before = len(transport.written)
            releases = len(backend.seen)
            connection.data_received(data)
            assert len(transport.written) == before  # held: nothing sent yet
            while len(backend.seen) == releases:
                await asyncio.sleep(0)
            assert len(backend.seen[-1]) == before  # nor at the release itself
            return bytes(transport.written[before:])

        ok = await send(b"set q 0 0 1\r\na\r\nset q 0 0 1\r\nb\r\nget q\r\n")
        assert ok == b"STORED\r\nSTORED\r\nVALUE q 0 1\r\na\r\nEND\r\n"
        backend.fail = StorageError("disk full")
        voided = await send(b"set q 0 0 1\r\nc\r\nget q\r\nset q 0 0 1 noreply\r\nd\r\n")
        assert voided == b"SERVER_ERROR disk full\r\n" * 2  # noreply stays silent
        backend.fail = None  # (this fake undoes nothing; the connection goes on)
        assert await send(b"set q 0 0 1\r\ne\r\n") == b"STORED\r\n"
        # quit closes once the held replies before it are out.
        sent = len(transport.written)
        connection.data_received(b"set q 0 0 1\r\nf\r\nquit\r\nset q 0 0 1\r\ng\r\n")
        assert not transport.closed
        while not transport.closed:
            await asyncio.sleep(0)
        assert transport.written[sent:] == b"STORED\r\n"

    asyncio.run(main())


def test_held_redis_replies_count_what_came_before_and_become_resp_errors() -> None:
    """A Redis push and pop hold their replies as a set and get do: one release
    answers a pipeline of them, a push's length counts the commands before it,
    and a failed round voids each reply with a RESP error, not a memcached line."""

    async def main() -> None:
        backend, _, connection = await _holding_connection(RedisConnection)
        transport = backend.transport

        async def send(*requests: list[bytes]) -> bytes:
            before, releases = len(transport.written), len(backend.seen)
            # A request is written as an array of bulk strings, as replies are.
            connection.data_received(b"".join(map(resp.array, requests)))
            assert len(transport.written) == before  # held: nothing sent yet
            while len(backend.seen) == releases:
                await asyncio.sleep(0)
            return bytes(transport.written[before:])

        ok = await send([b"RPUSH", b"q", b"a"], [b"LPUSH", b"q", b"b", b"c"], [b"RPOP", b"q"])
        assert ok == b":1\r\n:3\r\n$1\r\na\r\n"
        assert backend.seen  # one release answered all three
        backend.fail = StorageError("disk full")
        voided = await send([b"RPUSH", b"q", b"d"], [b"RPOP", b"q"])
        assert voided == b"-ERR disk full\r\n" * 2

    asyncio.run(main())


def test_a_pipeline_read_in_parts_is_answered_part_by_part_after_each_round() -> None:
    # The second part of a pipeline can run in the next round while the
    # first round syncs: its replies wait for that next round, not the first.
    async def main() -> None:
        backend, _, connection = await _holding_connection()
        transport = backend.transport
        backend.manual = True
        connection.data_received(b"set q 0 0 1\r\na\r\nget q\r\n")
        first = backend.cut()
        connection.data_received(b"set q 0 0 1\r\nb\r\nset q 0 0 1\r\nc\r\n")
        second = backend.cut()
        connection.data_received(b"get q\r\n")
        third = backend.cut()
        assert transport.written == b""
        first.end(None)
        assert transport.written == b"STORED\r\nVALUE q 0 1\r\na\r\nEND\r\n"
        second.end(StorageError("disk full"))
        voided = b"SERVER_ERROR disk full\r\n" * 2
        assert transport.written == b"STORED\r\nVALUE q 0 1\r\na\r\nEND\r\n" + voided
        third.end(None)  # (this fake undid nothing: b is there)
        assert transport.written.endswith(voided + b"VALUE q 0 1\r\nb\r\nEND\r\n")
        # quit in the last part closes once every part before it is out.
        sent = len(transport.written)
        connection.data_received(b"set q 0 0 1\r\nd\r\n")
        fourth = backend.cut()
        connection.data_received(b"set q 0 0 1\r\ne\r\nquit\r\n")
        fifth = backend.cut()
        fourth.end(None)
        assert transport.written[sent:] == b"STORED\r\n" and not transport.closed
        fifth.end(None)
        assert transport.written[sent:] == b"STORED\r\n" * 2 and transport.closed

    asyncio.run(main())


def test_after_a_group_waited_the_next_commands_hold_their_replies_again() -> None:
    async def main() -> None:
        backend, server, connection = await _holding_connection()
        transport = backend.transport
        backend.wait = True  # the backend's thread answers, later
        server.overlap = True  # as after any command waited: pipelines go as groups
        connection.data_received(b"set q 0 0 1\r\na\r\nset q 0 0 1\r\nb\r\nget q\r\n")
        assert connection.task is not None  # the group waits
        while connection.task is not None:
            await asyncio.sleep(0)
        assert transport.written == b"STORED\r\nSTORED\r\nVALUE q 0 1\r\na\r\nEND\r\n"
        # Its waiting must not keep pipelines grouped: the next ones hold.
        assert not server.overlap
        backend.wait = False
        connection.data_received(b"get q\r\nget q\r\n")
        assert connection.task is None and len(backend.seen) == 0
        while not backend.seen:
            await asyncio.sleep(0)
        assert transport.written.endswith(b"VALUE q 0 1\r\nb\r\nEND\r\nEND\r\n")

    asyncio.run(main())


def test_a_periodic_task_failing_on_its_storage_logs_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An outage makes reclaim fail each time round: a line each, no traceback."""
    from mqd import broker

    with caplog.at_level(logging.WARNING, logger="mqd.broker"):
        broker._retry_later("reclaiming expired leases", StorageError("cluster unavailable"))
        broker._retry_later("expiring idle queues", ValueError("a bug"))
    outage, bug = caplog.records
    assert outage.getMessage() == (
        "reclaiming expired leases failed: cluster unavailable; trying again later"
    )
    assert outage.exc_info is None and outage.levelname == "WARNING"
    assert bug.exc_info is not None and bug.levelname == "ERROR"
