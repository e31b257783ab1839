"""Reliable reads: open, close, abort, disconnect, visibility timeout, dead letters."""

from __future__ import annotations

import time

from conftest import Raw, connect, store, value

from mqd.testing.daemon import Daemon


def gets(conn: Raw, key: str) -> bytes:
    conn.send(b"gets %b\r\n" % key.encode())
    return conn.read_until(b"END\r\n")


def test_open_then_disconnect_delivers_again(daemon: Daemon, q: str) -> None:
    first = connect(daemon)
    store(first, q, b"job")
    store(first, q, b"later")
    first.call(b"get %b/open\r\n" % q.encode(), value(q + "/open", b"job") + b"END\r\n")
    first.close()
    second = connect(daemon)
    wait_until_nothing_open(second, q)
    # Given back ahead of the newer message.
    second.call(b"get %b/open\r\n" % q.encode(), value(q + "/open", b"job") + b"END\r\n")


def wait_until_nothing_open(conn: Raw, queue: str) -> None:
    """The server notices a closed connection a moment after the client closes it."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        conn.send(b"stats queues\r\n")
        if f"STAT queue_{queue}_open 0\r\n".encode() in conn.read_until(b"END\r\n"):
            return
        time.sleep(0.01)
    raise AssertionError(f"{queue} still has an open message")


def test_close_is_final(daemon: Daemon, q: str) -> None:
    conn = connect(daemon)
    store(conn, q, b"job")
    conn.call(b"get %b/open\r\n" % q.encode(), value(q + "/open", b"job") + b"END\r\n")
    conn.call(b"get %b/close\r\n" % q.encode(), b"END\r\n")
    conn.close()
    time.sleep(0.2)
    other = connect(daemon)
    other.call(b"get %b/open\r\n" % q.encode(), b"END\r\n")
    other.call(b"get %b/peek\r\n" % q.encode(), b"END\r\n")


def test_visibility_timeout_delivers_again_with_count(daemon: Daemon, q: str) -> None:
    k = "vt." + q
    holder, other = connect(daemon), connect(daemon)
    store(holder, k, b"job")
    # visibility_timeout = 0.5 s in the test config; wait for it. Timed from
    # before the open, so that a slow test process cannot make it look early.
    start = time.monotonic()
    holder.call(b"get %b/open\r\n" % k.encode(), value(k + "/open", b"job") + b"END\r\n")
    other.call(b"get %b\r\n" % k.encode(), b"END\r\n")
    other.call(
        b"get %b/t=3000/open\r\n" % k.encode(), value(k + "/t=3000/open", b"job") + b"END\r\n"
    )
    assert 0.45 < time.monotonic() - start < 2.5
    # The first holder lost its claim: its close acknowledges nothing.
    holder.call(b"get %b/close\r\n" % k.encode(), b"END\r\n")
    other.call(b"get %b/abort\r\n" % k.encode(), b"END\r\n")
    other.call(b"get %b/peek\r\n" % k.encode(), value(k + "/peek", b"job") + b"END\r\n")


def test_max_deliveries_moves_to_dead_letters(daemon: Daemon, q: str) -> None:
    k = "dl." + q
    conn = connect(daemon)
    store(conn, k, b"poison")
    store(conn, k, b"fine")
    for _ in range(2):  # max_deliveries = 2
        conn.call(b"get %b/open\r\n" % k.encode(), value(k + "/open", b"poison") + b"END\r\n")
        conn.call(b"get %b/abort\r\n" % k.encode(), b"END\r\n")
    conn.call(b"get %b\r\n" % k.encode(), value(k, b"fine") + b"END\r\n")
    dead = k + "_dead"
    conn.call(b"get %b\r\n" % dead.encode(), value(dead, b"poison") + b"END\r\n")


def test_dead_letter_after_timeouts_and_named_queue(daemon: Daemon, q: str) -> None:
    k = "dlx." + q
    conn = connect(daemon)
    store(conn, k, b"once")
    conn.call(b"get %b/open\r\n" % k.encode(), value(k + "/open", b"once") + b"END\r\n")
    conn.close()  # disconnect returns it: after 1 delivery it is dead
    other = connect(daemon)
    other.call(b"get graveyard/t=3000\r\n", value("graveyard/t=3000", b"once") + b"END\r\n")
    other.call(b"get %b\r\n" % k.encode(), b"END\r\n")


def test_delivery_count_survives_timeouts(daemon: Daemon, q: str) -> None:
    k = "dl." + q  # visibility_timeout 0.3 s, max_deliveries 2
    conn = connect(daemon)
    store(conn, k, b"slow")
    conn.call(b"get %b/open\r\n" % k.encode(), value(k + "/open", b"slow") + b"END\r\n")
    time.sleep(0.6)  # timed out: delivered once
    conn.call(b"get %b/open\r\n" % k.encode(), value(k + "/open", b"slow") + b"END\r\n")
    time.sleep(0.6)  # timed out after the second delivery: dead
    conn.call(b"get %b\r\n" % k.encode(), b"END\r\n")
    dead = k + "_dead"
    conn.call(b"get %b\r\n" % dead.encode(), value(dead, b"slow") + b"END\r\n")


def test_a_key_that_ends_the_open_message_lets_a_later_key_open(daemon: Daemon, q: str) -> None:
    # "For each key in order": a /close or /abort before an /open of one command.
    conn = connect(daemon)
    for body in (b"m1", b"m2", b"m3"):
        store(conn, q, body)
    conn.call(b"get %b/open\r\n" % q.encode(), value(q + "/open", b"m1") + b"END\r\n")
    conn.call(
        b"get %b/close %b/open\r\n" % (q.encode(), q.encode()),
        value(q + "/open", b"m2") + b"END\r\n",
    )
    conn.call(
        b"get %b/abort %b/open\r\n" % (q.encode(), q.encode()),
        value(q + "/open", b"m2") + b"END\r\n",
    )
    # An /open before the key that would end it still clashes, and runs nothing.
    conn.call(
        b"get %b/open %b/close\r\n" % (q.encode(), q.encode()),
        b"CLIENT_ERROR transaction already open\r\n",
    )
    conn.call(b"get %b/close\r\n" % q.encode(), b"END\r\n")
    conn.call(b"get %b\r\n" % q.encode(), value(q, b"m3") + b"END\r\n")


def test_one_open_message_per_queue_per_connection(daemon: Daemon, q: str) -> None:
    conn = connect(daemon)
    a, b = q + "a", q + "b"
    for key in (a, a, b):
        store(conn, key, b"m")
    conn.call(
        b"get %b/open %b/open\r\n" % (a.encode(), a.encode()),
        b"CLIENT_ERROR transaction already open\r\n",
    )
    # Nothing was taken by the refused command.
    conn.call(
        b"get %b/open %b/open\r\n" % (a.encode(), b.encode()),
        value(a + "/open", b"m") + value(b + "/open", b"m") + b"END\r\n",
    )
    stats = gets(conn, a)
    assert stats == b"VALUE %b 0 1 1\r\nm\r\nEND\r\n" % a.encode()
