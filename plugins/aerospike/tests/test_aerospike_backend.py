"""What the conformance suite cannot see: shards, growth, fencing, batching, failures."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
from mqd_aerospike.backend import AerospikeBackend
from mqd_aerospike.connection import OPEN_ENTRY_BYTES
from mqd_aerospike.server import Node

from mqd.backend import NO_LIMITS, Message, Put, Sync
from mqd.errors import ConfigError, StorageError
from mqd.testing.conformance import run_with
from mqd.testing.daemon import Daemon
from mqd.testing.ports import free_port

from .conftest import make, prefix_for

ALWAYS = Sync.ALWAYS
T = TypeVar("T")


async def fill(b: AerospikeBackend, queue: str, count: int, size: int = 0) -> None:
    for i in range(count):
        body = f"{i}".encode().ljust(size, b".")
        assert await b.put(queue, Message(body), sync=ALWAYS) is Put.STORED


async def drain(b: AerospikeBackend, queue: str) -> list[Message]:
    out = []
    while (m := await b.take(queue, sync=ALWAYS)) is not None:
        out.append(m)
    return out


# -- on the server -----------------------------------------------------------


def test_unknown_namespace_is_a_config_error(aerospike_host: str, tmp_path: Path) -> None:
    backend = make(aerospike_host, tmp_path, namespace="nope")
    with pytest.raises(
        ConfigError, match=r"storage\.aerospike\.namespace = 'nope': no such namespace"
    ):
        run_with(backend, lambda b: asyncio.sleep(0))


def test_a_daemon_names_the_file_of_an_unknown_namespace(
    aerospike_node: Node, tmp_path: Path
) -> None:
    path = tmp_path / "mqd.toml"
    table = aerospike_node.storage_table("ns") + 'namespace = "nope"\n'
    path.write_text('[storage]\nbackend = "aerospike"\n' + table)
    serve = ["serve", "--config", str(path), "--port", str(free_port())]
    result = subprocess.run(
        [sys.executable, "-m", "mqd", *serve, "--data-dir", str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        f"Error: {path}: storage.aerospike.namespace = 'nope': no such namespace on the"
        " cluster (it has: test)"
    )


def test_message_that_can_never_fit_is_refused(aerospike_host: str, tmp_path: Path) -> None:
    async def body(b: AerospikeBackend) -> None:
        with pytest.raises(StorageError, match=r"^object too large for cache$"):
            await b.put("q", Message(b"x" * 2_000_000), sync=ALWAYS)
        big = b"y" * 900_000  # over the planned size but within one record
        assert await b.put("q", Message(big), sync=ALWAYS) is Put.STORED
        taken = await b.take("q", sync=ALWAYS)
        assert taken is not None and taken.body == big

    run_with(make(aerospike_host, tmp_path, max_item_size=1 << 20), body)


def test_queue_grows_past_many_records_without_copying(aerospike_host: str, tmp_path: Path) -> None:
    """Unbounded: buffer records are chained as the tail needs them and removed behind the head."""

    async def body(b: AerospikeBackend) -> None:
        assert b._store.per == 3  # three 300 kB entries per 1 MiB record
        await fill(b, "q", 40, size=1000)
        records = await b._blocking(count_records, b)
        assert records == 14  # ceil(40 / 3): one chain, nothing moved
        got = await drain(b, "q")
        assert [int(m.body.rstrip(b".")) for m in got] == list(range(40))
        assert await b._blocking(count_records, b) == 1  # only the tail's record is left
        # Its delete removes that record too, holding only taken entries as it does.
        assert await b.delete("q", sync=ALWAYS)
        assert await b._blocking(count_records, b) == 0

    run_with(make(aerospike_host, tmp_path, max_item_size=300_000), body)


def test_a_shard_opens_no_more_than_its_record_holds(aerospike_host: str, tmp_path: Path) -> None:
    """Past its room for open messages a reserve finds none, and sets and acks go on."""

    async def body(b: AerospikeBackend) -> None:
        store = b._store
        assert store.open_room == (1 << 20) // 2  # the test node's record limit, halved
        store.open_room = 5 * (OPEN_ENTRY_BYTES + len(b.owner))  # room for five
        await fill(b, "q", 8)
        opened = await b.reserve_many("q", 8, lease=60, sync=ALWAYS)
        assert [m.body for m in opened] == [b"0", b"1", b"2", b"3", b"4"]
        assert await b.reserve("q", lease=60, sync=ALWAYS) is None
        assert await b.put("q", Message(b"8"), sync=ALWAYS) is Put.STORED
        receipt = opened[0].receipt
        assert receipt is not None and await b.ack(receipt, sync=ALWAYS)
        again = await b.reserve("q", lease=60, sync=ALWAYS)
        assert again is not None and again.body == b"5"
        assert [m.body for m in await drain(b, "q")] == [b"6", b"7", b"8"]

    run_with(make(aerospike_host, tmp_path), body)


def count_records(b: AerospikeBackend) -> int:
    store = b._store
    query = store.client.query(store.config.namespace, store.buf_set)
    return len(query.results())


def test_shards_give_unique_ids_and_fifo_within_each(aerospike_host: str, tmp_path: Path) -> None:
    async def body(b: AerospikeBackend) -> None:
        await fill(b, "jobs", 40)
        size = await b.size("jobs")
        assert size is not None and size.items == 40
        got = await drain(b, "jobs")
        assert sorted(int(m.body) for m in got) == list(range(40))
        ids = [m.offset for m in got]
        assert len(set(ids)) == 40
        by_shard: dict[int, list[int]] = {}
        for m in got:
            by_shard.setdefault(m.offset % 4, []).append(int(m.body))
        assert sorted(by_shard) == [0, 1, 2, 3]
        assert all(bodies == sorted(bodies) for bodies in by_shard.values())
        # read_at finds a message by its id in whichever shard holds it.
        await fill(b, "jobs", 8)
        size = await b.size("jobs")
        assert size is not None and size.items == 8
        one = await b.take("jobs", sync=ALWAYS)
        assert one is not None
        assert await b.read_at("jobs", one.offset) is None  # taken: gone
        # A range read gathers the ids of every shard, in id order.
        span = await b.read_range("jobs", 0, 10_000)
        offsets = [m.offset for m in span]
        assert offsets == sorted(offsets) and len(span) == 7 and one.offset not in offsets
        assert await b.read_range("jobs", 0, 10_000, max_bytes=1) == span[:1]
        rest = await drain(b, "jobs")
        assert sorted(m.offset for m in rest) == offsets
        await fill(b, "jobs", 1)
        peeked = await b.peek("jobs")
        assert peeked is not None
        found = await b.read_at("jobs", peeked.offset)
        assert found is not None and found.body == peeked.body
        assert len(rest) == 7

    run_with(make(aerospike_host, tmp_path, queue_shards={"jobs": 4}), body)


def test_one_lock_and_commit_serve_many_pending_calls(aerospike_host: str, tmp_path: Path) -> None:
    """Puts and takes queued together, interleaved: every message out exactly once."""

    async def body(b: AerospikeBackend) -> None:
        await fill(b, "q", 1)
        await drain(b, "q")
        before = b.calls
        calls: list[Coroutine[Any, Any, object]] = []
        for i in range(200):
            calls.append(b.put("q", Message(f"{i}".encode()), sync=ALWAYS))
            calls.append(b.take("q", sync=ALWAYS))
        results = await asyncio.gather(*calls)
        assert b.calls - before < 20  # 400 calls served by a few cycles
        taken = [m.body for m in results[1::2] if isinstance(m, Message)]
        taken += [m.body for m in await drain(b, "q")]
        assert sorted(taken, key=int) == [f"{i}".encode() for i in range(200)]
        assert len(taken) == 200

    run_with(make(aerospike_host, tmp_path), body)


def test_broken_lock_refuses_commit_and_fences_stale_writes(
    aerospike_host: str, tmp_path: Path
) -> None:
    """A daemon frozen past its lock's lease: its commit is refused and its entry write fenced."""

    async def body(a: AerospikeBackend) -> None:
        b = make(aerospike_host, tmp_path, owner="b", lock_lease_ms=50)
        await b.open()
        try:
            await fill(a, "q", 1)
            pause = Freeze(a)
            frozen = asyncio.ensure_future(a.put("q", Message(b"a"), sync=ALWAYS))
            await asyncio.get_running_loop().run_in_executor(None, pause.wait, 5)
            # Past a's lease: b breaks the lock, writes the same record and commits.
            await asyncio.sleep(0.1)
            assert await b.put("q", Message(b"b"), sync=ALWAYS) is Put.STORED
            pause.resume()
            assert await frozen is Put.STORED  # a ran its cycle again, under a new lock
            assert (a._store.fenced, a._store.refused) == (1, 1)
            got = [m.body for m in await drain(b, "q")]
            assert got == [b"0", b"b", b"a"]
        finally:
            await b.close()

    run_with(make(aerospike_host, tmp_path, owner="a", lock_lease_ms=50), body)


class Freeze:
    """Stop the backend's next commit that carries new entries, until resumed."""

    def __init__(self, backend: AerospikeBackend) -> None:
        import threading

        self.reached = threading.Event()
        self.go = threading.Event()
        store = backend._store
        original = store.call

        def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(fn, "__name__", "") == "batch_write" and _writes_buffer(args):
                store.call = original  # once
                self.reached.set()
                self.go.wait(10)
            return original(fn, *args, **kwargs)

        store.call = call

    def wait(self, timeout: float) -> bool:
        return self.reached.wait(timeout)

    def resume(self) -> None:
        self.go.set()


def _writes_buffer(args: tuple[Any, ...]) -> bool:
    records = getattr(args[0], "batch_records", [])
    return any(type(r).__name__ == "Write" and r.key[1].endswith("_buf") for r in records)


async def stopped(pid: int) -> None:
    """Wait until every thread of `pid` is stopped: kill() returns before they are."""
    deadline = time.monotonic() + 5
    while True:
        # The state is the first field after the command name, which is in brackets.
        states = []
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:
                states.append(stat.read_text().rpartition(")")[2].split()[0])
            except OSError:
                continue  # a thread that just ended
        if states and all(state in "tT" for state in states):
            return
        assert time.monotonic() < deadline, f"threads of {pid} not stopped: {states}"
        await asyncio.sleep(0.01)


#: Client timeouts short enough that a frozen node is an error within a test.
SHORT_TIMEOUTS: dict[str, Any] = {"total_timeout_ms": 500, "socket_timeout_ms": 250}
UNREACHABLE = r"^aerospike (timeout|cluster unavailable)"


def freezable(node: Node) -> int:
    """The node's process id (the test is skipped for a node not started here)."""
    if node.pid is None:
        pytest.skip("the server was not started here: cannot freeze it")
    return node.pid


@contextlib.asynccontextmanager
async def frozen(pid: int) -> AsyncIterator[None]:
    """The node stopped (SIGSTOP, every thread) for the body, resumed after it."""
    os.kill(pid, signal.SIGSTOP)
    try:
        await stopped(pid)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def once_back(call: Callable[[], Awaitable[T]]) -> T:
    """`call()`'s result once the client has found the resumed node again by itself."""
    deadline = time.monotonic() + 20
    while True:
        try:
            return await call()
        except StorageError:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)


def test_frozen_server_gives_server_error_and_recovery(
    aerospike_node: Node, tmp_path: Path
) -> None:
    pid = freezable(aerospike_node)

    async def body(b: AerospikeBackend) -> None:
        await fill(b, "q", 1)
        async with frozen(pid):
            started = time.monotonic()
            with pytest.raises(StorageError, match=UNREACHABLE):
                await b.put("q", Message(b"lost?"), sync=ALWAYS)
            assert time.monotonic() - started < 5
        stored = await once_back(lambda: b.put("q", Message(b"after"), sync=ALWAYS))
        assert stored is Put.STORED
        bodies = [m.body for m in await drain(b, "q")]
        # Acknowledged messages are all there; the refused one may be too (at least once).
        assert bodies[0] == b"0" and bodies[-1] == b"after"
        assert set(bodies) <= {b"0", b"lost?", b"after"}

    short = make(aerospike_node.host, tmp_path, lock_lease_ms=200, **SHORT_TIMEOUTS)
    run_with(short, body)


def test_a_frozen_server_is_an_error_for_a_queue_this_daemon_never_read(
    aerospike_node: Node, tmp_path: Path
) -> None:
    """Not an empty or missing queue: another daemon's messages are there all along."""
    pid = freezable(aerospike_node)

    async def body(b: AerospikeBackend) -> None:
        await fill(b, "theirs", 2)
        other = make(aerospike_node.host, tmp_path / "other", owner="other", **SHORT_TIMEOUTS)
        await other.open()
        try:
            async with frozen(pid):
                with pytest.raises(StorageError, match=UNREACHABLE):
                    await other.take("theirs", sync=ALWAYS)
                with pytest.raises(StorageError, match=UNREACHABLE):
                    await other.delete("theirs", sync=ALWAYS)
        finally:
            await other.close()
        got = await once_back(lambda: drain(b, "theirs"))
        assert [m.body for m in got] == [b"0", b"1"]

    short = make(aerospike_node.host, tmp_path, lock_lease_ms=200, **SHORT_TIMEOUTS)
    run_with(short, body)


def test_sets_on_one_daemon_wake_gets_on_another_within_the_poll_interval(
    aerospike_host: str, tmp_path: Path
) -> None:
    async def body(a: AerospikeBackend) -> None:
        b = make(aerospike_host, tmp_path, owner="b")
        await b.open()
        woken: asyncio.Queue[str] = asyncio.Queue()
        b.listen(woken.put_nowait)
        try:
            await fill(a, "q", 1)
            await drain(b, "q")
            b.watch("q", True)
            await asyncio.sleep(0.05)
            sent = time.monotonic()
            await a.put("q", Message(b"hello"), sync=ALWAYS)
            assert await asyncio.wait_for(woken.get(), 2) == "q"
            assert time.monotonic() - sent < 1.0
            b.watch("q", False)
        finally:
            await b.close()

    run_with(make(aerospike_host, tmp_path), body)


def test_a_move_finished_twice_is_stored_once(aerospike_host: str, tmp_path: Path) -> None:
    """The dead-letter queue remembers a move's tag across other commits."""

    async def body(b: AerospikeBackend) -> None:
        first = await b._put("dead", Message(b"moved"), NO_LIMITS, "1f:7")
        assert first.result is Put.STORED
        await fill(b, "dead", 3)  # ordinary commits in between
        await drain(b, "dead")
        again = await b._put("dead", Message(b"moved"), NO_LIMITS, "1f:7")
        assert again.result is Put.DUPLICATE
        assert await b.take("dead", sync=ALWAYS) is None

    run_with(make(aerospike_host, tmp_path), body)


def test_entry_fenced_off_after_its_commit_is_an_error_and_a_hole(
    aerospike_host: str, tmp_path: Path
) -> None:
    """Commit made, entry write refused (its lease ran out on the way): not STORED, skipped."""

    async def body(b: AerospikeBackend) -> None:
        await fill(b, "q", 1)
        store = b._store
        meta = store.read_metas(b"q", [0])[0]
        assert meta is not None
        record = store.buf_key(meta, 0)
        store.client.put(record, {"f": 1 << 62})  # as if a far newer holder wrote there
        fenced = r"^aerospike: entry write refused, another daemon took the queue's lock$"
        with pytest.raises(StorageError, match=fenced):
            await b.put("q", Message(b"lost"), sync=ALWAYS)
        store.client.put(record, {"f": 0})
        await fill(b, "q", 1)
        await asyncio.sleep(0.1)  # the counters' correction is its own cycle
        size = await b.size("q")
        assert size is not None and (size.items, size.bytes) == (2, 2)
        assert [m.body for m in await drain(b, "q")] == [b"0", b"0"]
        size = await b.size("q")
        assert size is not None and (size.items, size.bytes) == (0, 0)

    run_with(make(aerospike_host, tmp_path), body)


def test_redrive_of_a_sharded_queue_some_of_whose_shards_were_never_written(
    aerospike_host: str, tmp_path: Path
) -> None:
    async def body(b: AerospikeBackend) -> None:
        await fill(b, "dead", 2)  # two of its four shards
        assert await b.redrive("dead", to="q", limit=5, sync=ALWAYS) == {"q": 2}
        assert sorted(m.body for m in await drain(b, "q")) == [b"0", b"1"]

    run_with(make(aerospike_host, tmp_path, shards=4), body)


def _pipelined(port: int, request: bytes, done: Callable[[bytes], bool]) -> bytes:
    """Send `request` in one write; what came back once `done` says it is all there."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        reply = b""
        while not done(reply):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
        return reply


def _ended(reply: bytes) -> bool:
    return reply.endswith(b"END\r\n")


def _resp(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def test_gets_pipelined_around_a_set_keep_order_on_a_queue_new_to_the_daemon(
    aerospike_node: Node, tmp_path: Path
) -> None:
    """A daemon's first commands on a queue it filled (b, c) before a restart, in
    one write: each get takes the head in turn, and the set's message comes last."""
    config = '[storage]\nbackend = "aerospike"\n' + aerospike_node.storage_table(
        prefix_for(tmp_path)
    )

    def v(body: bytes, key: bytes = b"@", cas: bytes = b"") -> bytes:
        return b"VALUE %s 0 1%s\r\n%s\r\nEND\r\n" % (key, cas, body)

    stored, end = b"STORED\r\n", b"END\r\n"
    pipelines = [
        (b"get @\r\nset @ 0 0 1\r\nd\r\nget @\r\n", v(b"b") + stored + v(b"c")),
        (
            b"get @\r\nget @\r\nget @\r\nset @ 0 0 1\r\nd\r\nget @\r\n",
            v(b"b") + v(b"c") + end + stored + v(b"d"),
        ),
        (b"get @/open\r\nset @ 0 0 1\r\nd\r\nget @\r\n", v(b"b", b"@/open") + stored + v(b"c")),
        (
            b"gets @\r\nset @ 0 0 1\r\nd\r\ngets @\r\ngets @\r\n",
            v(b"b", cas=b" 0") + stored + v(b"c", cas=b" 1") + v(b"d", cas=b" 2"),
        ),
    ]
    with Daemon(tmp_path, "aerospike", config) as d:
        for i in range(len(pipelines)):
            fill_request = b"set j%d 0 0 1\r\nb\r\nset j%d 0 0 1\r\nc\r\n" % (i, i)
            reply = _pipelined(d.port, fill_request, lambda r: r.count(b"STORED") == 2)
            assert reply == stored * 2
        d.restart()  # a daemon that has not seen the queues
        for i, (pipeline, expected) in enumerate(pipelines):
            q = b"j%d" % i
            want = expected.replace(b"@", q)
            assert _pipelined(d.port, pipeline.replace(b"@", q), _at_least(len(want))) == want, i


def _at_least(size: int) -> Callable[[bytes], bool]:
    return lambda reply: len(reply) >= size


def test_a_get_pipelined_behind_a_set_sees_it(aerospike_node: Node, tmp_path: Path) -> None:
    """`set q` then `get q` in one write: the get gets what the set was told is STORED,
    on a queue this daemon has not seen yet, on one it has, and on a sharded one
    whose shards it last saw empty."""
    table = aerospike_node.storage_table(prefix_for(tmp_path)) + 'queue_shards = { "sh*" = 2 }\n'
    with Daemon(
        tmp_path, "aerospike", '[storage]\nbackend = "aerospike"\n' + table, redis=True
    ) as d:
        assert d.redis_port is not None
        for i in range(8):
            for q in (b"new%d" % i, b"again", b"sh-again"):
                request = b"set %s 0 0 1\r\nx\r\nget %s\r\n" % (q, q)
                reply = _pipelined(d.port, request, _ended)
                assert reply == b"STORED\r\nVALUE %s 0 1\r\nx\r\nEND\r\n" % q, (i, q)
                for _ in range(2):  # every shard seen empty: the next get may skip them
                    assert _pipelined(d.port, b"get %s\r\n" % q, _ended) == b"END\r\n"
            # A get before a set, on a sharded queue new to the daemon: not the set's.
            q = b"sh-new%d" % i
            request = b"get %s\r\nset %s 0 0 1\r\nx\r\n" % (q, q)
            assert _pipelined(d.port, request, lambda r: r.endswith(b"STORED\r\n")) == (
                b"END\r\nSTORED\r\n"
            ), i
            # RPUSH then LPOP: the pop gets the value (the push's length may count the pop).
            q = b"rnew%d" % i
            request = _resp(b"RPUSH", q, b"x") + _resp(b"LPOP", q)
            reply = _pipelined(
                d.redis_port, request, lambda r: r.endswith((b"$1\r\nx\r\n", b"$-1\r\n"))
            )
            assert reply in (b":1\r\n$1\r\nx\r\n", b":0\r\n$1\r\nx\r\n"), (i, reply)
