"""The wire contract, byte for byte, against a real daemon over raw sockets."""

from __future__ import annotations

import socket
import threading
import time

from conftest import Raw, connect, store, value

from mqd.testing.daemon import Daemon

BAD = b"CLIENT_ERROR bad command line format\r\n"


def stats_of(conn: Raw, group: bytes = b"") -> dict[str, str]:
    conn.send(b"stats" + (b" " + group if group else b"") + b"\r\n")
    lines = conn.read_until(b"END\r\n").decode().splitlines()[:-1]
    return {name: val for _, name, val in (line.split(" ", 2) for line in lines)}


def test_set_get_fifo_with_flags(raw: Raw, q: str) -> None:
    store(raw, q, b"one", flags=7)
    store(raw, q, b"two\r\nwith newline")
    raw.call(b"get %b\r\n" % q.encode(), value(q, b"one", 7) + b"END\r\n")
    raw.call(b"get %b\r\n" % q.encode(), value(q, b"two\r\nwith newline") + b"END\r\n")
    raw.call(b"get %b\r\n" % q.encode(), b"END\r\n")


def test_empty_and_unknown_queue(raw: Raw, q: str) -> None:
    raw.call(b"get %b\r\n" % q.encode(), b"END\r\n")
    assert f"queue_{q}_items" not in stats_of(raw, b"queues")
    store(raw, q, b"")
    raw.call(b"get %b\r\n" % q.encode(), value(q, b"") + b"END\r\n")
    # Emptied, it still exists.
    assert stats_of(raw, b"queues")[f"queue_{q}_items"] == "0"


def test_gets_ids_grow_by_one(raw: Raw, q: str) -> None:
    for body in (b"a", b"b", b"c"):
        store(raw, q, body)
    k = q.encode()
    raw.call(b"gets %b\r\n" % k, b"VALUE %b 0 1 0\r\na\r\nEND\r\n" % k)
    raw.call(
        b"gets %b %b\r\n" % (k, k),
        b"VALUE %b 0 1 1\r\nb\r\nVALUE %b 0 1 2\r\nc\r\nEND\r\n" % (k, k),
    )
    raw.call(b"delete %b\r\n" % k, b"DELETED\r\n")
    store(raw, q, b"d")
    raw.call(b"gets %b\r\n" % k, b"VALUE %b 0 1 0\r\nd\r\nEND\r\n" % k)


def test_multi_key_get_in_order(raw: Raw, q: str) -> None:
    a, b = q + "a", q + "b"
    store(raw, a, b"1")
    store(raw, b, b"2")
    store(raw, a, b"3")
    raw.call(
        b"get %b nothere %b %b %b\r\n" % (a.encode(), b.encode(), a.encode(), a.encode()),
        value(a, b"1") + value(b, b"2") + value(a, b"3") + b"END\r\n",
    )


def test_delete_and_flush_all(raw: Raw, q: str) -> None:
    store(raw, q, b"x")
    raw.call(b"delete %b\r\n" % q.encode(), b"DELETED\r\n")
    raw.call(b"delete %b\r\n" % q.encode(), b"NOT_FOUND\r\n")
    raw.call(b"delete %b noreply\r\nversion\r\n" % q.encode(), b"VERSION 1.0.0\r\n")
    other = q + "-other"
    for name in (q, other):
        store(raw, name, b"x")
    raw.call(b"flush_all\r\n", b"OK\r\n")
    for name in (q, other):
        raw.call(b"get %b\r\n" % name.encode(), b"END\r\n")
    assert f"queue_{q}_items" not in stats_of(raw)
    store(raw, q, b"y")
    raw.call(b"flush_all noreply\r\nget %b\r\n" % q.encode(), b"END\r\n")


def test_error_replies(raw: Raw) -> None:
    raw.call(b"bogus\r\n", b"ERROR\r\n")
    raw.call(b"GET q\r\n", b"ERROR\r\n")
    raw.call(b"get\r\n", BAD)
    raw.call(b"set q 0 0\r\n", BAD)
    raw.call(b"set q 0 0 -5\r\n", BAD)
    raw.call(b"set q 0 0 xx\r\n", BAD)
    raw.call(b"delete\r\n", BAD)
    raw.call(b"version extra\r\n", BAD)
    raw.call(b"verbosity x\r\n", BAD)
    raw.call(b"verbosity 1\r\n", b"OK\r\n")
    raw.call(b"verbosity 1 noreply\r\nversion\r\n", b"VERSION 1.0.0\r\n")
    raw.call(b"stats bogus\r\n", b"ERROR\r\n")


def test_bad_keys_swallow_the_block(raw: Raw) -> None:
    for key in (b"a/b", b"a+b+c", b"+b", b"a+", b"\x01", b"q\tx", b"q\x0c", b"k" * 251):
        raw.call(b"set %b 0 0 5\r\nhello\r\n" % key, BAD)
    raw.call(b"get a+b+c\r\n", BAD)
    raw.call(b"get q\tx\r\n", BAD)
    raw.call(b"get q\r\r\n", BAD)
    raw.call(b"get q/peek/open\r\n", BAD)
    raw.call(b"get q/abort/close\r\n", BAD)
    raw.call(b"get q/nonsense\r\n", BAD)
    raw.call(b"set q x 0 1\r\nz\r\n", BAD)
    raw.call(b"set q 0 zz 1\r\nz\r\n", BAD)
    raw.call(b"version\r\n", b"VERSION 1.0.0\r\n")


def test_unsupported_commands(raw: Raw, q: str) -> None:
    for verb in (b"replace", b"append", b"prepend"):
        raw.call(
            b"%b %b 0 0 3\r\nabc\r\n" % (verb, q.encode()),
            b"CLIENT_ERROR %b not supported\r\n" % verb,
        )
    raw.call(b"cas %b 0 0 3 7\r\nabc\r\n" % q.encode(), b"CLIENT_ERROR cas not supported\r\n")
    for line in (b"incr q 1", b"decr q 1", b"touch q 10", b"gat 10 q", b"gats 10 q"):
        verb = line.split()[0]
        raw.call(line + b"\r\n", b"CLIENT_ERROR %b not supported\r\n" % verb)
    raw.call(
        b"append q 0 0 3 noreply\r\nabc\r\nincr q 1 noreply\r\nversion\r\n", b"VERSION 1.0.0\r\n"
    )
    raw.call(b"get %b\r\n" % q.encode(), b"END\r\n")


def test_bad_data_chunk(raw: Raw, q: str) -> None:
    raw.call(b"set %b 0 0 3\r\nabcde\r\n" % q.encode(), b"CLIENT_ERROR bad data chunk\r\nERROR\r\n")
    raw.call(b"get %b\r\n" % q.encode(), b"END\r\n")


def test_noreply_suppresses_everything(raw: Raw, q: str) -> None:
    k = q.encode()
    raw.send(b"set %b 0 0 1 noreply\r\na\r\n" % k)
    raw.send(b"set a/b 0 0 1 noreply\r\nb\r\n")
    raw.send(b"set small.%b 0 0 11 noreply\r\nxxxxxxxxxxx\r\n" % k)
    raw.send(b"set %b 0 0 1 noreply\r\nxyz" % k)  # a bad chunk of exactly 1+2 bytes
    raw.call(b"get %b\r\n" % k, value(q, b"a") + b"END\r\n")
    assert raw.quiet() == b""


def test_sizes(raw: Raw, q: str) -> None:
    k = b"small." + q.encode()
    raw.call(b"set %b 0 0 10\r\n%b\r\n" % (k, b"x" * 10), b"STORED\r\n")
    raw.call(
        b"set %b 0 0 11\r\n%b\r\n" % (k, b"x" * 11), b"SERVER_ERROR object too large for cache\r\n"
    )
    big = b"y" * (1 << 20)
    raw.call(b"set %b 0 0 %d\r\n%b\r\n" % (q.encode(), len(big), big), b"STORED\r\n")
    raw.call(
        b"set %b 0 0 %d\r\n%b\r\n" % (q.encode(), len(big) + 1, big + b"z"),
        b"SERVER_ERROR object too large for cache\r\n",
    )
    raw.call(b"get %b\r\n" % q.encode(), value(q, big) + b"END\r\n")


def test_line_too_long(daemon: Daemon) -> None:
    conn = connect(daemon)
    conn.call(b"x" * 3000, b"CLIENT_ERROR line too long\r\n")
    assert conn.closed()
    conn = connect(daemon)
    keys = b" ".join(b"nokey%d" % i for i in range(2000))
    conn.call(b"get " + keys + b"\r\n", b"END\r\n")


def test_limits_reject(raw: Raw, q: str) -> None:
    k = "limited." + q
    store(raw, k, b"1")
    store(raw, k, b"2")
    raw.call(b"set %b 0 0 1\r\n3\r\n" % k.encode(), b"NOT_STORED\r\n")
    raw.call(b"get %b/open\r\n" % k.encode(), value(k + "/open", b"1") + b"END\r\n")
    # An open message still counts.
    raw.call(b"set %b 0 0 1\r\n3\r\n" % k.encode(), b"NOT_STORED\r\n")
    raw.call(b"get %b/close\r\n" % k.encode(), b"END\r\n")
    store(raw, k, b"3")
    kb = "bytes." + q
    store(raw, kb, b"12345")
    store(raw, kb, b"12345")
    raw.call(b"set %b 0 0 1\r\nx\r\n" % kb.encode(), b"NOT_STORED\r\n")


def test_limits_drop_oldest(raw: Raw, q: str) -> None:
    k = "drop." + q
    for body in (b"1", b"2", b"3"):
        store(raw, k, body)
    raw.call(
        b"get %b %b %b\r\n" % ((k.encode(),) * 3), value(k, b"2") + value(k, b"3") + b"END\r\n"
    )


def test_add_and_unique(raw: Raw, q: str) -> None:
    k = q.encode()
    raw.call(b"add %b 0 0 1\r\na\r\n" % k, b"STORED\r\n")
    raw.call(b"add %b 9 0 1\r\na\r\n" % k, b"NOT_STORED\r\n")
    raw.call(b"add %b 0 0 1\r\nb\r\n" % k, b"STORED\r\n")
    raw.call(b"get %b/open\r\n" % k, value(q + "/open", b"a") + b"END\r\n")
    raw.call(b"add %b 0 0 1\r\na\r\n" % k, b"NOT_STORED\r\n")  # open still counts
    raw.call(b"get %b/close\r\n" % k, b"END\r\n")
    raw.call(b"add %b 0 0 1\r\na\r\n" % k, b"STORED\r\n")
    u = b"uniq." + k
    raw.call(b"set %b 0 0 1\r\na\r\n" % u, b"STORED\r\n")
    raw.call(b"set %b 0 0 1\r\na\r\n" % u, b"STORED\r\n")
    raw.call(b"get %b %b\r\n" % (u, u), value(u.decode(), b"a") + b"END\r\n")


def test_expiry(raw: Raw, q: str) -> None:
    k = q.encode()
    raw.call(b"set %b 0 -1 4\r\ngone\r\n" % k, b"STORED\r\n")
    raw.call(b"set %b 0 %d 4\r\npast\r\n" % (k, int(time.time()) - 3600 * 24 * 365), b"STORED\r\n")
    raw.call(b"set %b 0 1 5\r\nshort\r\n" % k, b"STORED\r\n")
    raw.call(b"set %b 0 %d 4\r\nlong\r\n" % (k, int(time.time()) + 3600), b"STORED\r\n")
    time.sleep(1.2)
    raw.call(b"get %b/peek\r\n" % k, value(q + "/peek", b"long") + b"END\r\n")
    raw.call(b"get %b\r\n" % k, value(q, b"long") + b"END\r\n")
    assert stats_of(raw, b"queues")[f"queue_{q}_expired"] == "1"


def test_peek_at_abort(raw: Raw, q: str) -> None:
    k = q.encode()
    store(raw, q, b"a")
    store(raw, q, b"b")
    raw.call(b"get %b/peek\r\n" % k, value(q + "/peek", b"a") + b"END\r\n")
    raw.call(b"get %b/at=1\r\n" % k, value(q + "/at=1", b"b") + b"END\r\n")
    raw.call(b"get %b/at=9\r\n" % k, b"END\r\n")
    raw.call(b"get %b/open\r\n" % k, value(q + "/open", b"a") + b"END\r\n")
    raw.call(b"get %b/open\r\n" % k, b"CLIENT_ERROR transaction already open\r\n")
    raw.call(b"get %b/abort\r\n" % k, b"END\r\n")
    raw.call(b"get %b/abort\r\n" % k, b"END\r\n")
    raw.call(b"get %b/open\r\n" % k, value(q + "/open", b"a") + b"END\r\n")
    raw.call(b"get %b/close/open\r\n" % k, value(q + "/close/open", b"b") + b"END\r\n")
    raw.call(b"get %b/close\r\n" % k, b"END\r\n")
    raw.call(b"get %b\r\n" % k, b"END\r\n")


def test_range_read(raw: Raw, q: str) -> None:
    """`gets <q>/at=<id>/n=<count>`: what is still there of ids id..id+count-1, in order."""
    k = q.encode()
    for body in (b"a", b"b", b"c", b"d", b"e"):
        store(raw, q, body)
    raw.call(b"set %b 0 1 4\r\ngone\r\n" % k, b"STORED\r\n")  # id 5, expires in 1 s
    raw.call(b"get %b\r\n" % k, value(q, b"a") + b"END\r\n")  # id 0 leaves
    raw.call(b"get %b/open\r\n" % k, value(q + "/open", b"b") + b"END\r\n")  # id 1 is open
    key = f"{q}/at=0/n=4"

    def ids(*pairs: tuple[int, bytes]) -> bytes:
        return b"".join(b"VALUE %b 0 1 %d\r\n%b\r\n" % (key.encode(), i, body) for i, body in pairs)

    raw.call(b"gets %b\r\n" % key.encode(), ids((1, b"b"), (2, b"c"), (3, b"d")) + b"END\r\n")
    plain = b"".join(value(key, body) for body in (b"b", b"c", b"d"))
    raw.call(b"get %b\r\n" % key.encode(), plain + b"END\r\n")
    raw.call(b"gets %b/at=50/n=3\r\n" % k, b"END\r\n")
    raw.call(b"gets nosuch%b/at=0/n=3\r\n" % k, b"END\r\n")
    time.sleep(1.2)
    tail = f"{q}/at=4/n=100000".encode()
    raw.call(b"gets %b\r\n" % tail, b"VALUE %b 0 1 4\r\ne\r\nEND\r\n" % tail)
    raw.call(b"get %b\r\n" % k, value(q, b"c") + b"END\r\n")  # nothing was removed
    for bad in (b"/n=3", b"/at=0/n=0", b"/at=0/n=100001", b"/at=0/n=2/peek", b"/at=0/n=2/t=5"):
        raw.call(b"gets %b%b\r\n" % (k, bad), b"CLIENT_ERROR bad command line format\r\n")
    raw.call(b"gets %b/at=0/n=2 %b\r\n" % (k, k), b"CLIENT_ERROR bad command line format\r\n")


def test_range_read_stops_past_64_mib(raw: Raw, q: str) -> None:
    """A range's reply ends with the message that brings its bodies to 64 MiB."""
    body = b"x" * (1 << 20)
    for _ in range(66):
        store(raw, q, body)
    key = f"{q}/at=0/n=66".encode()
    expect = b"".join(b"VALUE %b 0 %d %d\r\n%b\r\n" % (key, len(body), i, body) for i in range(64))
    raw.send(b"gets %b\r\n" % key)
    reply = bytearray()  # read here: Raw's buffer is built for short replies
    while len(reply) < len(expect) + 5:
        reply += raw.sock.recv(1 << 20)
    assert reply == expect + b"END\r\n"


def test_waiting_get_is_woken_by_set(daemon: Daemon, q: str) -> None:
    consumer, producer = connect(daemon), connect(daemon)
    k = q.encode()
    consumer.send(b"get %b/t=3000\r\n" % k)
    time.sleep(0.1)
    start = time.monotonic()
    store(producer, q, b"hi")
    assert consumer.read_until(b"END\r\n") == value(q + "/t=3000", b"hi") + b"END\r\n"
    # Woken by the set, not by the 3 s timeout (with room for a busy machine).
    assert time.monotonic() - start < 2.5


def test_a_waiting_get_whose_client_closed_takes_nothing(daemon: Daemon, q: str) -> None:
    producer, k = connect(daemon), q.encode()
    gone = connect(daemon)
    gone.send(b"get %b/t=5000\r\n" % k)
    time.sleep(0.1)
    gone.close()  # an end of file, as from a client whose own timeout ran out
    time.sleep(0.1)
    store(producer, q, b"kept")
    time.sleep(0.1)  # the get that waited had its turn to take it
    producer.call(b"get %b\r\n" % k, value(q, b"kept") + b"END\r\n")


def test_a_waiting_get_answers_at_once_when_its_client_half_closes(daemon: Daemon, q: str) -> None:
    half = connect(daemon)
    half.send(b"get %b/t=5000\r\nversion\r\n" % q.encode())
    time.sleep(0.1)
    start = time.monotonic()
    half.sock.shutdown(socket.SHUT_WR)
    assert half.read_until(b"VERSION 1.0.0\r\n") == b"END\r\nVERSION 1.0.0\r\n"
    assert half.closed()
    assert time.monotonic() - start < 1.5  # not when the wait ends (max_wait: 2 s)


def test_multi_key_wait_is_woken_by_either(daemon: Daemon, q: str) -> None:
    consumer, producer = connect(daemon), connect(daemon)
    a, b = q + "a", q + "b"
    consumer.send(b"get %b/t=3000 %b/t=3000\r\n" % (a.encode(), b.encode()))
    time.sleep(0.1)
    store(producer, b, b"B")
    assert consumer.read_until(b"END\r\n") == value(b + "/t=3000", b"B") + b"END\r\n"


def test_wait_times_out_in_order(raw: Raw, q: str) -> None:
    start = time.monotonic()
    raw.call(b"get %b/t=300\r\nversion\r\n" % q.encode(), b"END\r\nVERSION 1.0.0\r\n")
    assert 0.25 < time.monotonic() - start < 2.0


def test_waits_are_capped_by_max_wait(raw: Raw, q: str) -> None:
    start = time.monotonic()
    raw.call(b"get %b/t=60000\r\n" % q.encode(), b"END\r\n")  # max_wait = 2 in the test config
    assert 1.8 < time.monotonic() - start < 4


def test_pipelined_replies_come_in_order(daemon: Daemon, q: str) -> None:
    conn = connect(daemon)
    k = q.encode()
    batch = b"".join(b"set %b 0 0 2\r\n%02d\r\n" % (k, i) for i in range(100))
    batch += b"get %b/t=1000\r\n" % k * 101
    expected = b"STORED\r\n" * 100
    expected += b"".join(value(q + "/t=1000", b"%02d" % i) + b"END\r\n" for i in range(100))
    expected += b"END\r\n"
    conn.send(batch)
    assert conn.read(len(expected)) == expected


def test_stats(raw: Raw, q: str) -> None:
    before = stats_of(raw)
    store(raw, q, b"abc")
    store(raw, q, b"de")
    raw.call(b"get %b/open\r\n" % q.encode(), value(q + "/open", b"abc") + b"END\r\n")
    raw.call(b"get %b-none\r\n" % q.encode(), b"END\r\n")
    stats = stats_of(raw)
    for name in ("pid", "uptime", "time", "version", "curr_connections", "total_connections"):
        assert name in stats
    grew = {n: int(stats[n]) - int(before[n]) for n in ("cmd_get", "cmd_set", "get_hits")}
    assert grew == {"cmd_get": 2, "cmd_set": 2, "get_hits": 1}
    assert int(stats["get_misses"]) - int(before["get_misses"]) == 1
    assert int(stats["curr_items"]) - int(before["curr_items"]) == 2
    assert int(stats["bytes"]) - int(before["bytes"]) == 5
    assert (stats[f"queue_{q}_items"], stats[f"queue_{q}_bytes"], stats[f"queue_{q}_open"]) == (
        "2",
        "5",
        "1",
    )
    assert (stats[f"queue_{q}_enqueued"], stats[f"queue_{q}_dequeued"]) == ("2", "0")
    assert int(stats[f"queue_{q}_age_ms"]) >= 0
    raw.call(b"stats reset\r\n", b"RESET\r\n")
    after = stats_of(raw)
    assert after["cmd_set"] == "0" and after[f"queue_{q}_enqueued"] == "0"
    assert after[f"queue_{q}_items"] == "2"
    queues = stats_of(raw, b"queues")
    assert all(name.startswith("queue_") for name in queues)


def test_shutdown_disabled(raw: Raw) -> None:
    raw.call(b"shutdown\r\n", b"ERROR\r\n")
    raw.call(b"shutdown graceful\r\n", b"ERROR\r\n")
    raw.call(b"shutdown now\r\n", BAD)


def test_stats_settings(raw: Raw, daemon: Daemon) -> None:
    settings = stats_of(raw, b"settings")
    assert settings["tcpport"] == str(daemon.port)
    assert (settings["inter"], settings["item_size_max"]) == ("127.0.0.1", "1048576")
    assert (settings["flush_enabled"], settings["shutdown_command"]) == ("yes", "no")


def test_concurrent_producers_and_consumers(daemon: Daemon, q: str) -> None:
    n, producers = 300, 4
    got: list[bytes] = []
    lock = threading.Lock()

    def produce(p: int) -> None:
        conn = connect(daemon)
        for i in range(n):
            store(conn, q, b"%d-%d" % (p, i))

    def consume() -> None:
        conn = connect(daemon)
        while True:
            conn.send(b"get %b/t=500\r\n" % q.encode())
            reply = conn.read_until(b"END\r\n")
            if reply == b"END\r\n":
                return
            with lock:
                got.append(reply.split(b"\r\n")[1])

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    threads += [threading.Thread(target=consume) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(got) == sorted(b"%d-%d" % (p, i) for p in range(producers) for i in range(n))


def test_slow_reader_gets_every_reply_in_order(daemon: Daemon, q: str) -> None:
    # Far more replies than the socket buffers hold, and far more pipelined
    # commands than a connection parses ahead: both kinds of back-pressure.
    conn = connect(daemon)
    body = b"x" * 10_000
    count = 3_000
    k = q.encode()
    conn.send(b"".join(b"set %b 0 0 %d\r\n%b\r\n" % (k, len(body), body) for _ in range(count)))
    assert conn.read(8 * count) == b"STORED\r\n" * count
    conn.send(b"gets %b\r\n" % k * count)
    time.sleep(0.5)  # let the server fill every buffer while nobody reads
    for offset in range(count):
        expected = b"VALUE %b 0 %d %d\r\n%b\r\nEND\r\n" % (k, len(body), offset, body)
        assert conn.read(len(expected)) == expected
