"""The Redis listener byte for byte, against a real daemon."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Raw, store, taken_port, value
from hypothesis import given, settings
from hypothesis import strategies as st

from mqd import config
from mqd.testing.daemon import Daemon
from mqd.testing.ports import free_port


def request(*args: bytes | str) -> bytes:
    out = b"*%d\r\n" % len(args)
    for arg in args:
        raw = arg.encode() if isinstance(arg, str) else arg
        out += b"$%d\r\n%b\r\n" % (len(raw), raw)
    return out


@pytest.fixture
def red(daemon: Daemon) -> Iterator[Raw]:
    conn = Raw(daemon.redis_address)
    yield conn
    conn.close()


def test_lpush_rpop_is_fifo(red: Raw, q: str) -> None:
    red.call(request("LPUSH", q, "a", "b") + request("RPUSH", q, "c"), b":2\r\n:3\r\n")
    red.call(request("LLEN", q), b":3\r\n")
    red.call(request("RPOP", q), b"$1\r\na\r\n")
    red.call(request("LPOP", q, "5"), b"*2\r\n$1\r\nb\r\n$1\r\nc\r\n")
    red.call(request("RPOP", q) + request("RPOP", q, "2"), b"$-1\r\n*-1\r\n")
    red.call(request("LLEN", q) + request("LLEN", "nosuchqueue"), b":0\r\n:0\r\n")


def test_pipelined_and_split_at_every_byte(red: Raw, q: str) -> None:
    data = request("RPUSH", q, "x\r\ny") + request("RPOP", q) + b"PING\r\n"
    for byte in data:
        red.send(bytes([byte]))
    assert red.read(21) == b":1\r\n$4\r\nx\r\ny\r\n+PONG\r\n"


def test_blocking_pop_times_out_then_is_woken(daemon: Daemon, red: Raw, q: str) -> None:
    start = time.monotonic()
    red.call(request("BRPOP", q, "0.3"), b"*-1\r\n")
    assert time.monotonic() - start >= 0.29
    start = time.monotonic()
    red.call(request("BRPOP", q, "0x1.4p-2"), b"*-1\r\n")  # hexadecimal, as strtold: 0.3125
    assert time.monotonic() - start >= 0.3
    start = time.monotonic()
    red.call(request("BRPOP", q, "1e-400"), b"*-1\r\n")  # not 0 (no timeout) but next to it
    assert time.monotonic() - start < 1.5  # max_wait = 2 in the test config
    other = Raw(daemon.redis_address)
    timer = threading.Timer(0.2, other.send, [request("LPUSH", q, "late")])
    timer.start()
    red.call(request("BLPOP", "empty" + q, q, "5"), request(q, "late"))
    timer.join()
    assert other.read(4) == b":1\r\n"
    other.close()


def test_cross_protocol(daemon: Daemon, red: Raw, raw: Raw, q: str) -> None:
    store(raw, q, b"from memcached", flags=7)
    red.call(request("RPOP", q), b"$14\r\nfrom memcached\r\n")
    red.call(request("LPUSH", q, "from redis"), b":1\r\n")
    raw.call(b"get " + q.encode() + b"\r\n", value(q, b"from redis") + b"END\r\n")


def test_sets_on_a_unique_queue(red: Raw, q: str) -> None:
    u = "uniq." + q
    red.call(request("SADD", u, "a", "b", "a"), b":2\r\n")
    red.call(request("SADD", u, "b"), b":0\r\n")
    red.call(request("SCARD", u) + request("TYPE", u), b":2\r\n+set\r\n")
    red.call(request("SPOP", u), b"$1\r\na\r\n")
    red.call(request("SPOP", u, "3"), b"*1\r\n$1\r\nb\r\n")
    red.call(request("SPOP", u, "3") + request("SPOP", u), b"*0\r\n$-1\r\n")


def test_a_unique_queue_moved_onto_itself_keeps_its_members(red: Raw, q: str) -> None:
    u = "uniq." + q
    red.call(request("RPUSH", u, "s1", "s2"), b":2\r\n")
    red.call(request("RPOPLPUSH", u, u) + request("LLEN", u), b"$2\r\ns1\r\n:2\r\n")
    red.call(request("LMOVE", u, u, "LEFT", "RIGHT") + request("LLEN", u), b"$2\r\ns1\r\n:2\r\n")
    red.call(request("LPOP", u, "5"), b"*2\r\n$2\r\ns1\r\n$2\r\ns2\r\n")


def test_a_move_waits_no_longer_than_max_wait(red: Raw, q: str) -> None:
    start = time.monotonic()
    red.call(request("BLMOVE", q, q + "b", "LEFT", "LEFT", "1e12"), b"$-1\r\n")
    red.call(request("BRPOPLPUSH", q, q + "b", "1e12"), b"$-1\r\n")
    assert time.monotonic() - start < 6  # max_wait = 2 in the test config


def test_keys(red: Raw, q: str) -> None:
    red.call(request("TYPE", q) + request("EXISTS", q, q), b"+none\r\n:0\r\n")
    red.call(request("RPUSH", q, "x") + request("TYPE", q), b":1\r\n+list\r\n")
    red.call(request("EXISTS", q, q, "no" + q), b":2\r\n")
    red.call(request("DEL", q, "no" + q) + request("EXISTS", q), b":1\r\n:0\r\n")


def test_a_full_queue_refuses_the_values_that_do_not_fit(red: Raw, q: str) -> None:
    limited = "limited." + q  # max_items = 2
    red.call(request("RPUSH", limited, "1", "2", "3"), b"-ERR queue full: 2 of 3 values stored\r\n")
    red.call(request("LLEN", limited), b":2\r\n")


def test_a_push_stops_at_the_first_value_a_full_queue_refuses(red: Raw, q: str) -> None:
    limited = "bytes." + q  # max_bytes = 10: a smaller value after a refused one must not go in
    red.call(
        request("RPUSH", limited, "aaaaaaaa", "bbbbb", "c"),
        b"-ERR queue full: 1 of 3 values stored\r\n",
    )
    red.call(request("LPOP", limited, "10"), b"*1\r\n$8\r\naaaaaaaa\r\n")


def test_a_push_with_a_value_over_the_size_limit_stores_none(red: Raw, q: str) -> None:
    small = "small." + q  # max_item_size = 10
    red.call(
        request("RPUSH", small, "ok", "0123456789a", "ok2"),
        b"-ERR object too large for cache\r\n",
    )
    red.call(request("LLEN", small) + request("RPUSH", small, "0123456789"), b":0\r\n:1\r\n")


def test_a_pop_of_none_is_an_empty_array_from_a_list_and_null_from_no_key(red: Raw, q: str) -> None:
    red.call(request("LPOP", q, "0") + request("RPUSH", q, "a"), b"*-1\r\n:1\r\n")
    red.call(request("LPOP", q, "0") + request("RPOP", q, "0"), b"*0\r\n*0\r\n")
    red.call(request("LLEN", q), b":1\r\n")


def test_lmove_moves_the_head_to_the_tail(red: Raw, q: str) -> None:
    red.call(request("RPUSH", q, "1", "2"), b":2\r\n")
    red.call(request("LMOVE", q, "done" + q, "RIGHT", "LEFT"), b"$1\r\n1\r\n")
    red.call(request("RPOPLPUSH", q, "done" + q), b"$1\r\n2\r\n")
    red.call(request("LMOVE", q, "done" + q, "UP", "LEFT"), b"-ERR syntax error\r\n")
    red.call(request("BLMOVE", q, "done" + q, "LEFT", "LEFT", "0.1"), b"$-1\r\n")
    red.call(request("LLEN", q), b":0\r\n")
    red.call(request("LPOP", "done" + q, "3"), b"*2\r\n$1\r\n1\r\n$1\r\n2\r\n")


def test_connection_commands(red: Raw) -> None:
    red.call(b"PING\r\n" + request("PING", "hi"), b"+PONG\r\n$2\r\nhi\r\n")
    red.call(request("ECHO", "a\r\nb"), b"$4\r\na\r\nb\r\n")
    red.call(
        request("SELECT", "0") + request("SELECT", "1"), b"+OK\r\n-ERR DB index is out of range\r\n"
    )
    red.call(request("CLIENT", "SETNAME", "w1"), b"+OK\r\n")
    red.call(request("CLIENT", "GETNAME"), b"$2\r\nw1\r\n")
    red.send(request("HELLO", "2", "SETNAME", "w2"))
    assert red.read_until(b"$7\r\nmodules\r\n*0\r\n").startswith(b"*14\r\n$6\r\nserver\r\n")
    red.call(request("CLIENT", "GETNAME"), b"$2\r\nw2\r\n")
    red.call(request("HELLO", "4"), b"-NOPROTO unsupported protocol version\r\n")
    red.send(request("COMMAND", "COUNT"))
    assert red.read_until(b"\r\n")[:1] == b":"
    red.send(request("COMMAND", "INFO", "lpush", "nosuch"))
    assert red.read_until(b"$-1\r\n").startswith(b"*2\r\n*6\r\n$5\r\nlpush\r\n:-3\r\n")
    red.call(request("QUIT"), b"+OK\r\n")
    assert red.closed()


def test_info_has_the_stats_figures(red: Raw, q: str) -> None:
    red.call(request("RPUSH", q, "x"), b":1\r\n")
    red.send(request("INFO"))
    head = red.read_until(b"\r\n")
    text = red.read(int(head[1:-2]) + 2).decode()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    assert fields["loading"] == "0"
    assert fields[f"queue_{q}_items"] == "1"
    assert int(fields["cmd_set"]) >= 1


@pytest.mark.parametrize(
    ("sent", "reply"),
    [
        (request("NOSUCH", "a"), b"-ERR unknown command 'NOSUCH'\r\n"),
        (b"nosuch a b\r\n", b"-ERR unknown command 'nosuch'\r\n"),
        (request("LPUSH", "q"), b"-ERR wrong number of arguments for 'lpush' command\r\n"),
        (request("LLEN"), b"-ERR wrong number of arguments for 'llen' command\r\n"),
        (request("RPOP", "q", "1", "2"), b"-ERR wrong number of arguments for 'rpop' command\r\n"),
        (request("RPOP", "q", "x"), b"-ERR value is not an integer or out of range\r\n"),
        (request("LPOP", "q", "-1"), b"-ERR value is out of range, must be positive\r\n"),
        (request("BRPOP", "q", "soon"), b"-ERR timeout is not a float or out of range\r\n"),
        (request("BRPOP", "q", "0_1"), b"-ERR timeout is not a float or out of range\r\n"),
        (request("BRPOP", "q", " 0.1"), b"-ERR timeout is not a float or out of range\r\n"),
        (request("BRPOP", "q", "-1"), b"-ERR timeout is negative\r\n"),
        (request("BRPOP", "q", "1e300"), b"-ERR timeout is out of range\r\n"),
        (request("BLMOVE", "q", "r", "LEFT", "RIGHT", "inf"), b"-ERR timeout is out of range"),
        (request("BRPOP", "q", "nan"), b"-ERR timeout is not a float or out of range\r\n"),
        (request("BRPOP", "q", "0x1g"), b"-ERR timeout is not a float or out of range\r\n"),
        (request("BRPOP", "q", "a"), b"-ERR timeout is not a float or out of range\r\n"),
        (request("BLPOP", "q", "1p3"), b"-ERR timeout is not a float or out of range\r\n"),
        (request("BRPOP", "q", "1" * 5120), b"-ERR timeout is not a float or out of range\r\n"),
        (request("SELECT", "x"), b"-ERR value is not an integer or out of range\r\n"),
        (request("SELECT", "-0"), b"-ERR value is not an integer or out of range\r\n"),
        (request("SELECT", "00"), b"-ERR value is not an integer or out of range\r\n"),
        (request("AUTH", "pw"), b"-ERR AUTH <password> called without any password configured"),
        (request("AUTH", "u", "pw"), b"-WRONGPASS invalid username-password pair or user is"),
        (request("AUTH", "default", "pw"), b"+OK\r\n"),
        (request("HELLO", "2", "AUTH", "u", "pw"), b"-WRONGPASS invalid username-password"),
        (
            request("CLIENT", "SETNAME", "a b"),
            b"-ERR Client names cannot contain spaces, newlines or special characters.\r\n",
        ),
        (
            request("HELLO", "2", "SETNAME", "a\nb"),
            b"-ERR Client names cannot contain spaces, newlines or special characters.\r\n",
        ),
        (request("CLIENT", "SETNAME", ""), b"+OK\r\n"),
        (request("LPUSH", "a b", "x"), b"-ERR invalid queue name: 1-250 bytes, no spaces, "),
        (request("LPUSH", "small.q", "x" * 11), b"-ERR object too large for cache\r\n"),
        (request("CLIENT", "KILL"), b"-ERR unknown subcommand 'KILL'. Try CLIENT HELP.\r\n"),
        (request("HELLO", "2", "SETNAME"), b"-ERR Syntax error in HELLO option 'SETNAME'\r\n"),
        (request("HELLO", "x"), b"-ERR Protocol version is not an integer or out of range\r\n"),
    ],
)
def test_errors_keep_the_connection_in_step(red: Raw, sent: bytes, reply: bytes) -> None:
    red.send(sent + b"PING\r\n")
    assert red.read_until(b"\r\n").startswith(reply)
    assert red.read_until(b"+PONG\r\n").endswith(b"+PONG\r\n")


def test_oversized_bulk_is_refused_in_step(red: Raw, q: str) -> None:
    big = b"x" * ((1 << 20) + 1)
    red.call(
        request("LPUSH", q, big) + request("LLEN", q), b"-ERR object too large for cache\r\n:0\r\n"
    )


@pytest.mark.parametrize(
    ("sent", "reply"),
    [
        (b"*1\r\n$2000000000\r\n", b"-ERR Protocol error: invalid bulk length\r\n"),
        (b"*x\r\n", b"-ERR Protocol error: invalid multibulk length\r\n"),
        (b"*1\r\n:1\r\n", b"-ERR Protocol error: expected '$', got ':'\r\n"),
        (b'ECHO "open\r\n', b"-ERR Protocol error: unbalanced quotes in request\r\n"),
    ],
)
def test_bad_framing_is_answered_then_closed(red: Raw, sent: bytes, reply: bytes) -> None:
    red.call(request("PING") + sent, b"+PONG\r\n" + reply)
    assert red.closed()


stream_parts = st.sampled_from(
    [
        request("RPUSH", "split.q", "v\r\n1"),
        request("RPOP", "split.q"),
        b"PING\r\n",
        request("ECHO", b"\x00\xff"),
        request("NOSUCH"),
        request("LLEN"),
        b"*0\r\n",
    ]
)


@settings(max_examples=25, deadline=None)
@given(st.lists(stream_parts, min_size=1, max_size=12), st.data())
def test_any_split_of_a_pipeline_gets_the_same_replies(
    daemon: Daemon, parts: list[bytes], data: st.DataObject
) -> None:
    end = request("ECHO", "end-of-stream")
    stream = b"".join(parts) + end
    replies = []
    for cuts in ([], data.draw(st.lists(st.integers(1, len(stream) - 1), max_size=6))):
        conn = Raw(daemon.redis_address)
        conn.send(request("DEL", "split.q"))
        conn.read_until(b"\r\n")
        last = 0
        for cut in [*sorted(cuts), len(stream)]:
            conn.send(stream[last:cut])
            time.sleep(0.001)
            last = cut
        replies.append(conn.read_until(b"end-of-stream\r\n"))
        conn.close()
    assert replies[0] == replies[1]


def test_hello_3_switches_nulls_to_resp3(red: Raw, q: str) -> None:
    red.send(request("HELLO", "3"))
    assert red.read_until(b"$7\r\nmodules\r\n*0\r\n").startswith(b"%7\r\n$6\r\nserver\r\n")
    red.call(request("RPOP", q) + request("BRPOP", q, "0.01"), b"_\r\n_\r\n")
    red.call(request("RPUSH", q, "x") + request("RPOP", q), b":1\r\n$1\r\nx\r\n")


def test_the_listener_is_off_unless_the_table_is_there() -> None:
    assert config.load().redis_port is None
    assert config.parse({"server": {"redis": {}}}) == {"redis_listen": "", "redis_port": 6379}
    fields = config.parse({"server": {"redis": {"listen": "127.0.0.2", "port": 0}}})
    assert (fields["redis_listen"], fields["redis_port"]) == ("127.0.0.2", 0)


def test_the_config_table_turns_the_listener_on(tmp_path: Path) -> None:
    port = free_port()
    with Daemon(tmp_path, config_text=f"[server.redis]\nport = {port}\n"):
        conn = Raw(("127.0.0.1", port))
        conn.call(b"PING\r\n", b"+PONG\r\n")
        conn.close()


def test_a_taken_redis_port_stops_start_up_with_a_clear_error(tmp_path: Path) -> None:
    with taken_port() as port:
        daemon = Daemon(tmp_path, config_text=f"[server.redis]\nport = {port}\n")
        with pytest.raises(RuntimeError, match=f"server.redis: cannot listen on 127.0.0.1:{port}"):
            daemon.start()
        assert "Traceback" not in daemon.log()


def test_a_consumer_that_leaves_while_waiting_takes_nothing(
    daemon: Daemon, red: Raw, q: str
) -> None:
    gone = Raw(daemon.redis_address)
    gone.send(request("BRPOP", q, "5"))
    time.sleep(0.1)
    gone.close()  # an end of file, as from a worker that exits: no reset
    time.sleep(0.1)
    red.call(request("LPUSH", q, "kept"), b":1\r\n")
    time.sleep(0.1)  # the pop that waited had its turn to take it
    red.call(request("RPOP", q), b"$4\r\nkept\r\n")


def test_redis_connections_count_against_max_connections(tmp_path: Path) -> None:
    with Daemon(tmp_path, config_text="[server]\nmax_connections = 1\n", redis=True) as d:
        time.sleep(0.3)  # the start-up probes' connections are gone
        first = Raw(d.redis_address)
        first.call(b"PING\r\n", b"+PONG\r\n")
        second = Raw(d.redis_address)
        assert second.read_until(b"\r\n") == b"-ERR max number of clients reached\r\n"
        assert second.closed()
        first.close()


def test_stop_answers_a_waiting_pop_and_exits(tmp_path: Path) -> None:
    d = Daemon(tmp_path, redis=True).start()
    try:
        waiting = Raw(d.redis_address)
        waiting.send(request("BLPOP", "q", "20"))
        time.sleep(0.2)
        started = time.monotonic()
        d.signal(signal.SIGTERM)
        assert waiting.read(5) == b"*-1\r\n"
        assert d.process is not None
        assert d.process.wait(10) == 0
        assert time.monotonic() - started < 5
    finally:
        d.kill()


def test_members_of_a_unique_queue(red: Raw, q: str) -> None:
    u = "uniq." + q
    red.call(request("SADD", u, "a", "b"), b":2\r\n")
    red.call(request("SISMEMBER", u, "a") + request("SISMEMBER", u, "z"), b":1\r\n:0\r\n")
    red.call(request("SREM", u, "a", "z") + request("SCARD", u), b":1\r\n:1\r\n")
    red.call(request("SISMEMBER", u, "a") + request("SPOP", u), b":0\r\n$1\r\nb\r\n")


def test_the_reliable_queue_pattern(red: Raw, q: str) -> None:
    """LMOVE to a processing queue, then LREM once the work is done."""
    jobs, processing = "uniq.jobs" + q, "uniq.processing" + q
    red.call(request("RPUSH", jobs, "j1", "j2"), b":2\r\n")
    red.call(request("LMOVE", jobs, processing, "RIGHT", "LEFT"), b"$2\r\nj1\r\n")
    red.call(request("LLEN", jobs) + request("LLEN", processing), b":1\r\n:1\r\n")
    red.call(request("LREM", processing, "1", "j1"), b":1\r\n")
    red.call(
        request("LLEN", processing) + request("LREM", processing, "x", "j1"),
        b":0\r\n-ERR value is not an integer or out of range\r\n",
    )


def test_a_push_reaches_fanout_children(red: Raw, raw: Raw, q: str) -> None:
    raw.call(b"get " + q.encode() + b"+audit\r\n", b"END\r\n")  # naming the child creates it
    red.call(request("LPUSH", q, "m"), b":1\r\n")
    red.call(request("RPOP", q + "+audit") + request("RPOP", q), b"$1\r\nm\r\n$1\r\nm\r\n")


def test_pipelined_pushes_and_pops_on_a_durable_backend_stay_in_order(tmp_path: Path) -> None:
    """On bdb, pipelined one-value pushes and pops share rounds: order must hold, and
    each push's length counts the commands before it."""
    with Daemon(tmp_path, backend="bdb", redis=True) as d:
        conn = Raw(d.redis_address)
        bodies = [b"m%02d" % i for i in range(40)]
        conn.send(b"".join(request("RPUSH", "q", b) + request("RPOP", "q") for b in bodies[:20]))
        conn.send(b"".join(request("LPUSH", "q", b) for b in bodies[20:]))
        conn.send(b"".join(request("RPOP", "q") for _ in bodies[20:]) + request("RPOP", "q"))
        replies = conn.read_until(b"$-1\r\n")
        popped = [line for line in replies.split(b"\r\n") if line.startswith(b"m")]
        assert popped == bodies
        lengths = [int(line[1:]) for line in replies.split(b"\r\n") if line.startswith(b":")]
        assert lengths == [1] * 20 + list(range(1, 21))
        conn.call(request("LPUSH", "q", "a"), b":1\r\n")
        conn.call(request("LPUSH", "q", "b"), b":2\r\n")
        conn.call(request("LLEN", "q"), b":2\r\n")
        conn.close()
