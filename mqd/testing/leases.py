"""Named leases against a real daemon, on any backend: the wire contract of `/lease=`.

The backend suite (mqd.testing.conformance) calls a backend directly; named
leases are the broker's, built on every backend's reserve/ack/release/extend,
so they are checked here through a real `mqd serve` process and real clients
(raw sockets for exact bytes, pymemcache for what a stock client can do). A
backend's package runs them by subclassing::

    from mqd.testing.leases import LeaseConformance

    class TestMyBackendLeases(LeaseConformance):
        backend = "mine"
        durable = True            # messages survive a restart: check what leases do

Override the `storage_toml` fixture to add `[storage.<name>]` tables. One
daemon serves a class's tests (each test uses queue names of its own); the
restart tests start their own.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pymemcache.client.base import Client

from mqd.testing.daemon import Daemon
from mqd.testing.raw import Raw

VISIBILITY = 0.8  # seconds, for queues named vt.*
BAD = b"CLIENT_ERROR bad command line format\r\n"

QUEUES_TOML = f"""
[server]
max_wait = 5

[queues."vt.*"]
visibility_timeout = {VISIBILITY}

[queues."dl.*"]
max_deliveries = 1
"""

Values = list[tuple[int, bytes]]  # (id, body) of each VALUE of a reply


def read_values(conn: Raw) -> Values:
    """The VALUE blocks of one `gets` reply, up to its END: (id, body) of each."""
    found: Values = []
    while True:
        line = conn.read_until(b"\r\n")
        if line == b"END\r\n":
            return found
        fields = line.split()
        assert fields[0] == b"VALUE" and len(fields) == 5, line
        body = conn.read(int(fields[3]) + 2)[:-2]
        found.append((int(fields[4]), body))


class LeaseConformance:
    """Mixin of tests of named leases; set `backend` (and `durable`, `fifo`, `offset`)."""

    backend = "memory"
    durable = False  # messages survive a daemon restart
    fifo = True  # messages come out in id order
    offset = True  # `/at=<id>` reads work

    # -- fixtures and helpers ----------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def storage_toml(cls) -> str:
        """Extra config for the backend (a `[storage.<name>]` table)."""
        return ""

    @classmethod
    def start_daemon(cls, workdir: Path, storage_toml: str) -> Daemon:
        return Daemon(workdir, cls.backend, QUEUES_TOML + storage_toml).start()

    @pytest.fixture(scope="class")
    @classmethod
    def lease_daemon(
        cls, tmp_path_factory: pytest.TempPathFactory, storage_toml: str
    ) -> Iterator[Daemon]:
        daemon = cls.start_daemon(tmp_path_factory.mktemp("leases"), storage_toml)
        try:
            yield daemon
        finally:
            daemon.kill()

    @pytest.fixture
    def conn(self, lease_daemon: Daemon) -> Iterator[Raw]:
        conn = Raw(lease_daemon.address)
        yield conn
        conn.close()

    @staticmethod
    def name(prefix: str = "q") -> str:
        """A queue name no other test uses (`prefix` picks its settings)."""
        return f"{prefix}.{uuid.uuid4().hex[:10]}"

    @staticmethod
    def fill(conn: Raw, queue: str, count: int) -> None:
        """Store m0, m1, ... in `queue`, pipelined."""
        conn.send(
            b"".join(
                b"set %b 0 0 %d\r\nm%d\r\n" % (queue.encode(), len(b"m%d" % i), i)
                for i in range(count)
            )
        )
        assert conn.read(len(b"STORED\r\n") * count) == b"STORED\r\n" * count

    @staticmethod
    def lease(conn: Raw, queue: str, name: str, n: int, wait_ms: int | None = None) -> Values:
        wait = b"/t=%d" % wait_ms if wait_ms is not None else b""
        conn.send(b"gets %b/lease=%b/n=%d%b\r\n" % (queue.encode(), name.encode(), n, wait))
        return read_values(conn)

    @staticmethod
    def ack(conn: Raw, queue: str, name: str, to: int | None = None) -> bytes:
        upto = b"/to=%d" % to if to is not None else b""
        conn.send(b"delete %b/lease=%b%b\r\n" % (queue.encode(), name.encode(), upto))
        return conn.read_until(b"\r\n")

    @staticmethod
    def abort(conn: Raw, queue: str, name: str) -> None:
        conn.call(b"get %b/lease=%b/abort\r\n" % (queue.encode(), name.encode()), b"END\r\n")

    @staticmethod
    def take_all(conn: Raw, queue: str, at_most: int = 50) -> list[bytes]:
        """Plain gets until the queue is empty: the bodies, in order."""
        conn.send(b"gets" + b" %b" % queue.encode() * at_most + b"\r\n")
        return [body for _, body in read_values(conn)]

    @staticmethod
    def gauges(conn: Raw, queue: str) -> dict[str, int]:
        conn.send(b"stats queues\r\n")
        lines = conn.read_until(b"END\r\n").decode().splitlines()
        prefix = f"STAT queue_{queue}_"
        return {
            line[len(prefix) :].split()[0]: int(line.split()[2])
            for line in lines
            if line.startswith(prefix)
        }

    # -- reserve, acknowledge, give back -----------------------------------

    def test_reserve_then_acknowledge(self, conn: Raw) -> None:
        queue = self.name()
        self.fill(conn, queue, 5)
        held = self.lease(conn, queue, "job-1", 3)
        assert len(held) == 3 and len({i for i, _ in held}) == 3
        if self.fifo:
            assert held == [(0, b"m0"), (1, b"m1"), (2, b"m2")]
        assert self.gauges(conn, queue)["open"] == 3
        assert self.ack(conn, queue, "job-1") == b"DELETED\r\n"
        assert self.ack(conn, queue, "job-1") == b"NOT_FOUND\r\n"
        rest = self.take_all(conn, queue)
        assert sorted(rest + [b for _, b in held]) == [b"m%d" % i for i in range(5)]
        gauges = self.gauges(conn, queue)
        assert (gauges["items"], gauges["open"]) == (0, 0)

    def test_asking_again_returns_what_the_lease_holds_first(self, conn: Raw) -> None:
        queue = self.name()
        self.fill(conn, queue, 6)
        first = self.lease(conn, queue, "stream", 2)
        again = self.lease(conn, queue, "stream", 2)
        assert again == first
        more = self.lease(conn, queue, "stream", 4)
        assert more[:2] == first and len(more) == 4
        assert self.lease(conn, queue, "stream", 1) == first[:1]
        assert self.gauges(conn, queue)["open"] == 4
        # Asking for more than the queue has: what there is, then the same again.
        everything = self.lease(conn, queue, "stream", 100)
        assert everything[:4] == more and len(everything) == 6
        assert self.lease(conn, queue, "stream", 100) == everything
        self.abort(conn, queue, "stream")

    def test_leased_messages_are_hidden_from_other_consumers(
        self, conn: Raw, lease_daemon: Daemon
    ) -> None:
        queue = self.name()
        self.fill(conn, queue, 4)
        held = self.lease(conn, queue, "a", 2)
        other = Raw(lease_daemon.address)
        try:
            rest = self.take_all(other, queue)
            assert sorted(rest + [b for _, b in held]) == [b"m0", b"m1", b"m2", b"m3"]
            assert self.take_all(other, queue) == []
            # Another lease gets nothing of this one's.
            assert self.lease(other, queue, "b", 5) == []
            gauges = self.gauges(other, queue)
            assert (gauges["items"], gauges["open"]) == (2, 2)
        finally:
            other.close()
        assert self.ack(conn, queue, "a") == b"DELETED\r\n"

    def test_leased_messages_are_read_by_id(self, conn: Raw) -> None:
        if not self.offset:
            pytest.skip(f"{self.backend} has no read by id")
        queue = self.name()
        self.fill(conn, queue, 3)
        held = self.lease(conn, queue, "x", 3)
        for offset, body in held:
            key = b"%b/at=%d" % (queue.encode(), offset)
            conn.send(b"gets %b\r\n" % key)
            assert read_values(conn) == [(offset, body)]
        assert self.lease(conn, queue, "x", 3) == held  # still leased
        self.abort(conn, queue, "x")

    def test_abort_gives_everything_back_ahead_of_newer_messages(self, conn: Raw) -> None:
        queue = self.name()
        self.fill(conn, queue, 5)
        held = self.lease(conn, queue, "job", 3)
        conn.call(b"set %b 0 0 5\r\nlater\r\n" % queue.encode(), b"STORED\r\n")
        self.abort(conn, queue, "job")
        self.abort(conn, queue, "job")  # nothing held: still END
        assert self.ack(conn, queue, "job") == b"NOT_FOUND\r\n"
        back = self.take_all(conn, queue)
        if self.fifo:
            assert back == [b"m0", b"m1", b"m2", b"m3", b"m4", b"later"]
        else:
            assert sorted(back) == sorted([b"m0", b"m1", b"m2", b"m3", b"m4", b"later"])
        assert {b for _, b in held} <= set(back)

    def test_partial_acknowledgement_up_to_an_id(self, conn: Raw) -> None:
        queue = self.name()
        self.fill(conn, queue, 5)
        held = sorted(self.lease(conn, queue, "s", 5))
        cut = held[1][0]
        assert self.ack(conn, queue, "s", to=cut) == b"DELETED\r\n"
        assert self.ack(conn, queue, "s", to=cut) == b"NOT_FOUND\r\n"  # those are gone
        assert sorted(self.lease(conn, queue, "s", 5)) == held[2:]
        self.abort(conn, queue, "s")
        back = self.take_all(conn, queue)
        assert sorted(back) == sorted(body for _, body in held[2:])
        if self.fifo:
            assert back == [body for _, body in held[2:]]

    def test_a_lease_outlives_its_connection(self, lease_daemon: Daemon) -> None:
        queue = self.name()
        first = Raw(lease_daemon.address)
        self.fill(first, queue, 3)
        held = self.lease(first, queue, "spark-7", 2)
        first.close()
        time.sleep(0.2)  # the close is seen and handled
        second = Raw(lease_daemon.address)
        try:
            assert self.lease(second, queue, "spark-7", 2) == held
            assert self.ack(second, queue, "spark-7") == b"DELETED\r\n"
            assert len(self.take_all(second, queue)) == 1
        finally:
            second.close()

    def test_two_connections_reserving_one_lease_at_once(self, lease_daemon: Daemon) -> None:
        queue = self.name()
        a, b = Raw(lease_daemon.address), Raw(lease_daemon.address)
        try:
            self.fill(a, queue, 40)
            line = b"gets %b/lease=both/n=30\r\n" % queue.encode()
            a.send(line)
            b.send(line)
            got_a, got_b = read_values(a), read_values(b)
            assert got_a == got_b and len(got_a) == 30
            assert self.gauges(a, queue)["open"] == 30
            assert self.ack(b, queue, "both") == b"DELETED\r\n"
            assert len(self.take_all(a, queue)) == 10
        finally:
            a.close()
            b.close()

    def test_a_large_lease_in_several_reservations(self, conn: Raw) -> None:
        # More than the daemon asks its backend for at once (RESERVE_BATCH).
        queue = self.name()
        self.fill(conn, queue, 2500)
        held = self.lease(conn, queue, "big", 2100)
        if self.fifo:
            assert held == [(i, b"m%d" % i) for i in range(2100)]
        else:  # 2100 messages, each once
            assert len({body for _, body in held}) == len(held) == 2100
        assert self.lease(conn, queue, "big", 2100) == held
        cut = sorted(held)[999][0]
        assert self.ack(conn, queue, "big", to=cut) == b"DELETED\r\n"
        rest = self.lease(conn, queue, "big", 3000)
        assert rest[:1100] == [v for v in held if v[0] > cut] and len(rest) == 1500
        gauges = self.gauges(conn, queue)
        assert (gauges["items"], gauges["open"]) == (1500, 1500)
        assert self.ack(conn, queue, "big") == b"DELETED\r\n"
        assert self.gauges(conn, queue)["items"] == 0

    def test_names_are_per_queue_and_separate(self, conn: Raw) -> None:
        one, two = self.name(), self.name()
        self.fill(conn, one, 2)
        self.fill(conn, two, 2)
        a = self.lease(conn, one, "same", 1)
        b = self.lease(conn, two, "same", 1)
        c = self.lease(conn, one, "other", 1)
        assert len(a) == len(b) == len(c) == 1 and a != c
        assert self.ack(conn, one, "same") == b"DELETED\r\n"
        assert self.lease(conn, two, "same", 1) == b  # untouched by one's acknowledgement
        self.abort(conn, one, "other")
        self.abort(conn, two, "same")
        assert len(self.take_all(conn, one)) == 1
        assert len(self.take_all(conn, two)) == 2

    def test_wait_for_a_message(self, conn: Raw, lease_daemon: Daemon) -> None:
        queue = self.name()
        conn.send(b"gets %b/lease=w/n=3/t=3000\r\n" % queue.encode())
        time.sleep(0.2)
        assert conn.quiet(0.1) == b""  # waiting
        producer = Raw(lease_daemon.address)
        try:
            producer.call(b"set %b 0 0 3\r\nnew\r\n" % queue.encode(), b"STORED\r\n")
        finally:
            producer.close()
        started = time.monotonic()
        assert [body for _, body in read_values(conn)] == [b"new"]
        assert time.monotonic() - started < 2.5
        # An empty queue and no wait: END at once.
        assert self.lease(conn, self.name(), "w", 3) == []
        self.abort(conn, queue, "w")

    def test_noreply_acknowledgement(self, conn: Raw) -> None:
        queue = self.name()
        self.fill(conn, queue, 2)
        self.lease(conn, queue, "n", 2)
        conn.send(b"delete %b/lease=n noreply\r\n" % queue.encode())
        conn.call(b"version\r\n", b"VERSION ")
        conn.read_until(b"\r\n")
        assert self.gauges(conn, queue)["items"] == 0

    # -- time and restarts -------------------------------------------------

    def test_visibility_timeout_returns_an_untouched_lease(self, conn: Raw) -> None:
        queue = self.name("vt")
        self.fill(conn, queue, 3)
        held = self.lease(conn, queue, "slow", 2)
        # Named within each timeout, the lease holds on past several timeouts.
        for _ in range(4):
            time.sleep(VISIBILITY * 0.6)
            assert self.gauges(conn, queue)["open"] == 2
            assert self.lease(conn, queue, "slow", 2) == held
        time.sleep(VISIBILITY * 1.5)
        assert self.gauges(conn, queue)["open"] == 0
        assert self.ack(conn, queue, "slow") == b"NOT_FOUND\r\n"
        back = self.take_all(conn, queue)
        assert sorted(back) == [b"m0", b"m1", b"m2"]
        if self.fifo:
            assert back == [b"m0", b"m1", b"m2"]

    def test_partial_acknowledgement_renews_the_rest(self, conn: Raw) -> None:
        queue = self.name("vt")
        self.fill(conn, queue, 4)
        held = sorted(self.lease(conn, queue, "r", 4))
        for offset, _ in held[:3]:
            time.sleep(VISIBILITY / 2)
            assert self.ack(conn, queue, "r", to=offset) == b"DELETED\r\n"
        assert self.lease(conn, queue, "r", 4) == held[3:]
        self.abort(conn, queue, "r")

    def test_a_lease_with_a_visibility_timeout_of_its_own(self, conn: Raw) -> None:
        queue = self.name("vt")
        self.fill(conn, queue, 3)
        conn.send(b"gets %b/lease=long/n=2/visibility=60000\r\n" % queue.encode())
        held = read_values(conn)
        assert len(held) == 2
        assert len(self.lease(conn, queue, "short", 1)) == 1
        time.sleep(VISIBILITY * 2)  # past the queue's timeout, not the long lease's
        assert self.ack(conn, queue, "short") == b"NOT_FOUND\r\n"
        assert self.gauges(conn, queue)["open"] == 2
        # Named again without /visibility=, it keeps its own timeout.
        assert self.lease(conn, queue, "long", 2) == held
        time.sleep(VISIBILITY * 2)
        assert self.gauges(conn, queue)["open"] == 2
        assert self.ack(conn, queue, "long") == b"DELETED\r\n"
        assert len(self.take_all(conn, queue)) == 1
        # Shorter than the queue's (60 s here): back after its own.
        other = self.name()
        self.fill(conn, other, 1)
        conn.send(b"gets %b/lease=quick/n=1/visibility=300\r\n" % other.encode())
        assert len(read_values(conn)) == 1
        assert self.take_all(conn, other) == []
        time.sleep(1.0)
        assert self.take_all(conn, other) == [b"m0"]

    def test_given_back_past_max_deliveries_goes_to_the_dead_letters(self, conn: Raw) -> None:
        queue = self.name("dl")
        self.fill(conn, queue, 2)
        self.lease(conn, queue, "d", 1)
        self.abort(conn, queue, "d")
        assert len(self.take_all(conn, f"{queue}_dead")) == 1
        assert len(self.take_all(conn, queue)) == 1

    def test_given_back_past_max_deliveries_when_expired_is_dropped(self, conn: Raw) -> None:
        queue = self.name("dl")
        conn.call(b"set %b 0 1 5\r\nshort\r\n" % queue.encode(), b"STORED\r\n")
        assert [body for _, body in self.lease(conn, queue, "d", 1)] == [b"short"]
        time.sleep(1.1)  # exptime is in whole seconds
        self.abort(conn, queue, "d")
        assert self.take_all(conn, f"{queue}_dead") == []
        assert self.take_all(conn, queue) == []
        gauges = self.gauges(conn, queue)
        assert (gauges["items"], gauges["expired"]) == (0, 1)

    def test_redrive_removes_expired_dead_letters_and_counts_them(self, conn: Raw) -> None:
        queue = self.name("dl")
        dead = f"{queue}_dead".encode()
        conn.call(b"set %b 0 1 3\r\nold\r\n" % dead, b"STORED\r\n")
        conn.call(b"set %b 0 0 3\r\nnew\r\n" % dead, b"STORED\r\n")
        time.sleep(1.1)  # exptime is in whole seconds
        conn.call(b"redrive %b 1 %b\r\n" % (dead, queue.encode()), b"MOVED 1\r\n")
        gauges = self.gauges(conn, dead.decode())
        assert (gauges["items"], gauges["expired"]) == (0, 1)
        assert self.take_all(conn, queue) == [b"new"]
        assert self.gauges(conn, queue)["expired"] == 0

    def test_expired_messages_are_dropped_not_leased(self, conn: Raw) -> None:
        queue = self.name()
        conn.call(b"set %b 0 1 4\r\ngone\r\n" % queue.encode(), b"STORED\r\n")
        conn.call(b"set %b 0 0 4\r\nkept\r\n" % queue.encode(), b"STORED\r\n")
        time.sleep(1.1)  # exptime is in whole seconds
        assert [body for _, body in self.lease(conn, queue, "e", 5)] == [b"kept"]
        gauges = self.gauges(conn, queue)
        assert (gauges["items"], gauges["open"], gauges["expired"]) == (1, 1, 1)
        assert self.ack(conn, queue, "e") == b"DELETED\r\n"

    def test_a_held_message_that_expires_is_dropped_when_asked_again(self, conn: Raw) -> None:
        queue = self.name()
        conn.call(b"set %b 0 1 5\r\nshort\r\n" % queue.encode(), b"STORED\r\n")
        conn.call(b"set %b 0 0 4\r\nlong\r\n" % queue.encode(), b"STORED\r\n")
        assert sorted(body for _, body in self.lease(conn, queue, "p", 5)) == [b"long", b"short"]
        time.sleep(1.1)  # exptime is in whole seconds
        assert [body for _, body in self.lease(conn, queue, "p", 5)] == [b"long"]
        gauges = self.gauges(conn, queue)
        assert (gauges["items"], gauges["open"], gauges["expired"]) == (1, 1, 1)
        assert self.ack(conn, queue, "p") == b"DELETED\r\n"

    def test_restart_gives_leased_messages_back(self, tmp_path: Path, storage_toml: str) -> None:
        if not self.durable:
            pytest.skip(f"{self.backend} keeps nothing across a restart")
        daemon = self.start_daemon(tmp_path, storage_toml)
        try:
            queue = self.name()
            conn = Raw(daemon.address)
            self.fill(conn, queue, 4)
            self.lease(conn, queue, "a", 2)
            conn.close()
            daemon.restart()  # a clean stop
            conn = Raw(daemon.address)
            assert self.gauges(conn, queue)["open"] == 0
            assert self.ack(conn, queue, "a") == b"NOT_FOUND\r\n"
            assert len(self.lease(conn, queue, "b", 3)) == 3
            conn.close()
            daemon.kill()  # a crash
            daemon.start()
            conn = Raw(daemon.address)
            assert self.gauges(conn, queue)["open"] == 0
            # The name is free again: a new lease, which finds every message waiting.
            again = self.lease(conn, queue, "b", 4)
            assert sorted(again) == [(i, b"m%d" % i) for i in range(4)]
            assert self.ack(conn, queue, "b") == b"DELETED\r\n"
            assert self.gauges(conn, queue)["items"] == 0
            conn.close()
        finally:
            daemon.kill()

    # -- errors and stock clients ------------------------------------------

    @pytest.mark.parametrize(
        "line",
        [
            b"gets q/lease=a",
            b"gets q/n=5",
            b"gets q/lease=a/n=0",
            b"gets q/lease=a/n=100001",
            b"gets q/lease=a/n=x",
            b"gets q/lease=/n=1",
            b"gets q/lease=a*b/n=1",
            b"gets q/lease=" + b"a" * 65 + b"/n=1",
            b"gets q/lease=a/n=1/open",
            b"gets q/lease=a/n=1/close",
            b"gets q/lease=a/n=1/peek",
            b"gets q/lease=a/n=1/at=3",
            b"gets q/lease=a/n=1/abort",
            b"gets q/lease=a/n=1/n=2",
            b"gets q/lease=a/lease=b/n=1",
            b"gets q/lease=a/n=1/visibility=0",
            b"gets q/lease=a/abort/visibility=5",
            b"gets q/visibility=5",
            b"get q/lease=a/abort/t=5",
            b"get q/lease=a/open",
            b"gets q/lease=a/n=1 q",
            b"gets q q/lease=a/abort",
            b"delete q/lease=a/bogus",
            b"delete q/to=5",
            b"delete q/lease=a/to=-1",
            b"delete q/lease=a/to=1/to=2",
            b"delete q/lease=",
        ],
    )
    def test_bad_combinations(self, conn: Raw, line: bytes) -> None:
        conn.call(line + b"\r\n", BAD)

    def test_bad_noreply_acknowledgement_is_silent(self, conn: Raw) -> None:
        conn.send(b"delete q/lease=a/bogus noreply\r\n")
        conn.call(b"version\r\n", b"VERSION ")
        conn.read_until(b"\r\n")

    def test_a_stock_client(self, lease_daemon: Daemon) -> None:
        queue = self.name()
        client = Client(lease_daemon.address, connect_timeout=5, timeout=5)
        try:
            for i in range(3):
                assert client.set(queue, b"m%d" % i, noreply=False)
            body, offset = client.gets(f"{queue}/lease=pm/n=1")
            assert body is not None and offset is not None
            assert client.gets(f"{queue}/lease=pm/n=1") == (body, offset)
            assert client.get(f"{queue}/lease=pm/abort") is None
            body, offset = client.gets(f"{queue}/lease=pm/n=1")
            assert client.delete(f"{queue}/lease=pm/to={int(offset)}", noreply=False) is True
            assert client.delete(f"{queue}/lease=pm", noreply=False) is False
            left = [client.get(queue) for _ in range(3)]
            assert left[2] is None
            assert sorted([body, *left[:2]]) == [b"m0", b"m1", b"m2"]
        finally:
            client.close()
