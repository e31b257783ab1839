"""Whole-queue operations on disk: fanout children, redrive, idle expiry across restarts."""

from __future__ import annotations

import itertools
import socket
import time
from pathlib import Path

import pytest
from bdb_helpers import ALWAYS, FIFO_NAMES, NAMES, drain, put, session
from mqd_bdb.backend import _BdbBackend

from mqd.backend import Fanout, Limits, Message, Put
from mqd.testing.daemon import Daemon
from mqd.testing.raw import Raw


@pytest.mark.parametrize("name", NAMES)
def test_fanout_children_outlive_a_restart(name: str, tmp_path: Path) -> None:
    def limits(child: str) -> Limits:
        return Limits(max_items=1) if child == "q+one" else Limits()

    async def first(b: _BdbBackend) -> None:
        for child in ("q+all", "q+one", "other+x"):
            assert await b.create(child, sync=ALWAYS) is True

    async def second(b: _BdbBackend) -> None:
        assert sorted(await b.queues()) == ["other+x", "q+all", "q+one"]
        for i in range(3):
            stored = await b.put("q", Message(b"m%d" % i), sync=ALWAYS, fanout=Fanout(limits))
            assert stored is Put.STORED
        # A put refused by the parent's limits copies nothing.
        full = await b.put("q", Message(b"no"), sync=ALWAYS, limits=Limits(max_items=3))
        assert full is Put.FULL

    async def third(b: _BdbBackend) -> None:
        got = {q: sorted(m.body for m in await drain(b, q)) for q in await b.queues()}
        three = [b"m0", b"m1", b"m2"]
        assert got == {"q": three, "q+all": three, "q+one": [b"m0"], "other+x": []}
        assert await b.delete("q+all", sync=ALWAYS) is True
        await b.put("q", Message(b"late"), sync=ALWAYS, fanout=Fanout(limits))
        assert await b.size("q+all") is None

    session(name, tmp_path, first)
    session(name, tmp_path, second)
    session(name, tmp_path, third)


@pytest.mark.parametrize("name", NAMES)
def test_idle_time_is_kept_across_a_restart(name: str, tmp_path: Path) -> None:
    async def first(b: _BdbBackend) -> float:
        await put(b, "old", b"x")
        await b.take("old", sync=ALWAYS)
        await b.create("made", sync=ALWAYS)
        time.sleep(0.05)
        cutoff = time.time()
        await put(b, "new", b"x")
        await b.take("new", sync=ALWAYS)
        return cutoff

    cutoff = session(name, tmp_path, first)

    async def second(b: _BdbBackend) -> None:
        for queue, expired in (("new", False), ("old", True), ("made", True), ("old", False)):
            assert await b.expire_idle(queue, before=cutoff, sync=ALWAYS) is expired, queue
        assert await b.queues() == ["new"]

    session(name, tmp_path, second)


@pytest.mark.parametrize("name", NAMES)
def test_redrive_takes_the_oldest_first(name: str, tmp_path: Path) -> None:
    async def body(b: _BdbBackend) -> None:
        sent = [b"z", b"a", b"m", b"b", b"y"]
        for data in sent:
            await put(b, "dead", data)
        assert await b.redrive("dead", to="q", limit=3, sync=ALWAYS) == {"q": 3}
        assert sorted(m.body for m in await drain(b, "q")) == sorted(sent[:3])
        assert sorted(m.body for m in await drain(b, "dead")) == sorted(sent[3:])

    session(name, tmp_path, body)


@pytest.mark.parametrize("name", NAMES)
def test_the_commands_behind_a_pipelined_set_see_the_queue_it_made(
    name: str, tmp_path: Path
) -> None:
    """A set answered from a round not yet synced still runs before what follows it.

    On the single-file layouts a set that makes a queue runs in the event
    loop's round; `stats` and `flush_all`, right behind it in one write,
    must find that queue, and a message it stored before an `OK` flush must
    be gone.
    """
    with Daemon(tmp_path, backend=name) as daemon:
        conn = Raw(daemon.address)
        conn.send(b"set made1 0 0 1\r\nx\r\nflush_all\r\nget made1\r\n")
        assert conn.read_until(b"END\r\n") == b"STORED\r\nOK\r\nEND\r\n"
        conn.send(b"set made2 0 0 1\r\na\r\nflush_all\r\nset made2 0 0 1\r\nb\r\nget made2\r\n")
        assert (
            conn.read_until(b"END\r\n")
            == b"STORED\r\nOK\r\nSTORED\r\nVALUE made2 0 1\r\nb\r\nEND\r\n"
        )
        conn.send(b"set made3 0 0 2\r\nab\r\nset made4 0 0 1\r\nc\r\nstats queues\r\n")
        reply = conn.read_until(b"END\r\n").decode()
        for line in ("queue_made3_items 1", "queue_made3_bytes 2", "queue_made3_enqueued 1",
                     "queue_made4_items 1", "queue_made4_enqueued 1"):  # fmt: skip
            assert f"STAT {line}\r\n" in reply, reply
        conn.send(b"set made5 0 0 1\r\nd\r\nstats\r\n")
        assert "STAT curr_items 3\r\n" in conn.read_until(b"END\r\n").decode()


@pytest.mark.parametrize("name", NAMES)
def test_a_client_that_half_closes_hears_every_reply(name: str, tmp_path: Path) -> None:
    """A pipeline sent, then the client's end of file: every command is answered
    (its replies held for their sync as ever), and then the connection closes."""

    def half_closed(address: tuple[str, int], request: bytes) -> bytes:
        with socket.create_connection(address, timeout=10) as s:
            s.sendall(request)
            s.shutdown(socket.SHUT_WR)
            got = b""
            while chunk := s.recv(65536):
                got += chunk
            return got

    with Daemon(tmp_path, backend=name) as daemon:
        Raw(daemon.address).call(b"set hx 0 0 1\r\nX\r\n", b"STORED\r\n")
        request = b"set hx 0 0 1\r\nA\r\nget hx\r\n"
        assert half_closed(daemon.address, request) == b"STORED\r\nVALUE hx 0 1\r\nX\r\nEND\r\n"
        # An open message is handed out, then back in the queue as its client is gone.
        request = b"get hx/open\r\n"
        assert half_closed(daemon.address, request) == b"VALUE hx/open 0 1\r\nA\r\nEND\r\n"
        conn = Raw(daemon.address)
        for _ in range(100):  # returned within a turn or two of the close
            conn.send(b"get hx/peek\r\n")
            if conn.read_until(b"END\r\n") == b"VALUE hx/peek 0 1\r\nA\r\nEND\r\n":
                break
            time.sleep(0.01)
        conn.call(b"get hx\r\n", b"VALUE hx 0 1\r\nA\r\nEND\r\n")


@pytest.mark.parametrize("name", NAMES)
def test_a_client_that_does_not_read_gets_no_more_than_the_output_bound(
    name: str, tmp_path: Path
) -> None:
    """Replies held for their sync count towards the 256 KiB a client may leave
    unread: a client that pipelines gets and never reads takes a few messages
    (what the socket buffers and the bound hold), not all it asked for."""
    count, size = 200, 100_000
    with Daemon(tmp_path, backend=name) as daemon:
        producer = Raw(daemon.address)
        for i in range(count):  # distinct bodies: bdb-random keeps one of each
            body = b"%06d" % i + b"x" * (size - 6)
            producer.send(b"set big 0 0 %d\r\n%b\r\n" % (size, body))
        assert producer.read(len(b"STORED\r\n") * count) == b"STORED\r\n" * count
        with socket.socket() as stalled:
            # A fixed receive buffer (no autotuning), as a slow client's.
            stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            stalled.connect(daemon.address)
            stalled.sendall(b"get big\r\n" * count)
            time.sleep(2)
            producer.call(b"version\r\n", b"VERSION 1.0.0\r\n")  # others are served
            producer.send(b"stats queues\r\n")
            stats = producer.read_until(b"END\r\n")
            left = int(stats.split(b"STAT queue_big_items ")[1].split(b"\r\n")[0])
            assert count - left <= count // 2, f"{count - left} of {count} taken"


def _resp(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in args)


@pytest.mark.parametrize("name", FIFO_NAMES)  # bdb-random keeps no order
def test_pushes_of_many_values_that_make_a_queue_do_not_interleave(
    name: str, tmp_path: Path
) -> None:
    """As Redis' pushes are atomic: three clients' 50-value RPUSHes, sent at once
    to a queue not yet made, each come out in one run."""
    with Daemon(tmp_path, backend=name, redis=True) as daemon:
        for round_ in range(3):
            queue = b"new%d" % round_
            clients = [Raw(daemon.redis_address) for _ in range(3)]
            for c, client in enumerate(clients):
                client.send(_resp(b"RPUSH", queue, *(b"%d-%02d" % (c, i) for i in range(50))))
            for client in clients:
                assert client.read_until(b"\r\n").startswith(b":")
            reader = clients[0]
            reader.send(_resp(b"LPOP", queue, b"200"))
            reply = reader.read_until(b"\r\n")
            assert reply == b"*150\r\n"
            owners = []
            for _ in range(150):
                reader.read_until(b"\r\n")  # the value's $5 line
                owners.append(reader.read_until(b"\r\n").split(b"-")[0])
            assert [owner for owner, _ in itertools.groupby(owners)] == [b"0", b"1", b"2"]
            for client in clients:
                client.close()


@pytest.mark.parametrize("name", NAMES)
def test_a_push_that_makes_a_queue_counts_none_of_the_pops_behind_it(
    name: str, tmp_path: Path
) -> None:
    """A push's length counts exactly the commands before it, as Redis' does,
    also where its store waits for the queue to be made."""
    with Daemon(tmp_path, backend=name, redis=True) as daemon:
        conn = Raw(daemon.redis_address)
        for _ in range(3):
            conn.send(_resp(b"LPUSH", b"k", b"a") + _resp(b"RPOP", b"k"))
            assert conn.read(len(b":1\r\n$1\r\na\r\n")) == b":1\r\n$1\r\na\r\n"
            conn.send(
                _resp(b"DEL", b"k") + _resp(b"RPUSH", b"k", b"a") + _resp(b"RPUSH", b"k", b"b")
            )
            conn.send(_resp(b"RPOP", b"k") + _resp(b"RPOP", b"k") + _resp(b"LLEN", b"k"))
            expected = b":1\r\n:1\r\n:2\r\n$1\r\na\r\n$1\r\nb\r\n:0\r\n"
            assert conn.read(len(expected)) == expected
            conn.send(_resp(b"DEL", b"k"))
            assert conn.read(4) == b":1\r\n"
