"""Kill a real daemon at random moments under load; check that no message is lost.

Producers send unique message ids with `set`; consumers take them with plain
`get` and with reliable reads (`get q/open`, then `get q/close`). The daemon
runs with `sync = "always"` and is killed with SIGKILL at random moments and
started again on the same data directory; clients reconnect and go on. At the
end the queues are drained and the books must balance:

- every message that got `STORED` was delivered, but for as many as there
  were plain `get`s whose reply the kill cut off (a plain get removes the
  message before it answers: at most once, as the protocol says);
- no message was delivered twice, except one that a reliable read had open
  (not acknowledged by a `/close` reply) when the daemon died;
- no message was delivered that was never sent.

FanoutSoak does the same with a fanout parent and two children: producers
`set` into the parent only, consumers read all three reliably, and the books
must show every STORED message in all three queues, and every unacknowledged
one in all three or in none (one transaction stores every copy).

Any durable backend will do: the daemon's config is CONFIG and what the
backend needs besides (an Aerospike node's address). Used by the durable
backends' crash tests (a short run each) and benchmarks/crash_soak.py (long
runs).
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from mqd.testing.daemon import Daemon

CONFIG = '[queues."*"]\nsync = "always"\n'
QUEUES = ("crash-a", "crash-b")


class Gone(Exception):
    """The connection died (the daemon was killed)."""


class Client:
    """A raw memcached-text connection that reports a dead daemon as Gone."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_connection(address, timeout=10)
        self.buf = b""

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError as exc:
            raise Gone(str(exc)) from exc

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            try:
                chunk = self.sock.recv(65536)
            except OSError as exc:
                raise Gone(str(exc)) from exc
            if not chunk:
                raise Gone("connection closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def get(self, key: str) -> bytes | None:
        """One `get`; the value, or None for END alone."""
        self.send(b"get %b\r\n" % key.encode())
        line = self.line()
        if line == b"END":
            return None
        if not line.startswith(b"VALUE "):
            raise AssertionError(f"unexpected reply to get {key}: {line!r}")
        data = self.line()
        end = self.line()
        if end != b"END":
            raise AssertionError(f"unexpected end of get {key}: {end!r}")
        return data


@dataclass
class Books:
    """What the clients saw, filled in by their threads (appends are thread-safe)."""

    sent: set[bytes] = field(default_factory=set)  # every id a set was tried for
    stored: set[bytes] = field(default_factory=set)  # ids that got STORED
    taken: list[bytes] = field(default_factory=list)  # plain gets and closed reads
    opened: list[bytes] = field(default_factory=list)  # every id a /open returned
    lost_open: set[bytes] = field(default_factory=set)  # open when the daemon died
    lost_gets: int = 0  # plain gets cut off by a kill: each may have taken one
    errors: list[str] = field(default_factory=list)

    def missing(self) -> set[bytes]:
        """Stored messages no client saw."""
        return self.stored - set(self.taken) - set(self.opened)

    def check(self) -> list[str]:
        """What is wrong, if anything."""
        problems = list(self.errors)
        seen = set(self.taken) | set(self.opened)
        missing = self.missing()
        if len(missing) > self.lost_gets:
            problems.append(
                f"{len(missing)} stored message(s) never delivered, {self.lost_gets} plain"
                f" get(s) cut off: {_few(missing)}"
            )
        strange = seen - self.sent
        if strange:
            problems.append(f"{len(strange)} message(s) delivered but never sent: {_few(strange)}")
        finals = Counter(self.taken)
        twice = {m for m, n in finals.items() if n > 1}
        if twice:
            problems.append(f"{len(twice)} message(s) taken more than once: {_few(twice)}")
        # A message handed out again must have been open when the daemon died.
        handouts = Counter(self.taken) + Counter(self.opened)
        closed = Counter(self.taken)
        for message, n in handouts.items():
            if n > 1 and message not in self.lost_open:
                problems.append(f"message {message!r} delivered {n} times, never lost open")
                break
        if not closed and self.stored:
            problems.append("nothing was taken")
        return problems


def _few(items: set[bytes]) -> str:
    return ", ".join(repr(m) for m in sorted(items)[:5])


class Soak:
    """Drives a daemon with producers and consumers while killing it."""

    #: The queues producers write to, and every queue consumers read.
    targets: tuple[str, ...] = QUEUES
    queues: tuple[str, ...] = QUEUES
    #: The share of reads that are plain `get`s; the rest are `/open` then `/close`.
    plain_share = 0.5

    def __init__(
        self,
        workdir: Path,
        backend: str,
        producers: int = 3,
        consumers: int = 3,
        seed: int | None = None,
        config_text: str = "",
    ) -> None:
        self.daemon = Daemon(workdir, backend=backend, config_text=CONFIG + config_text)
        self.producers = producers
        self.consumers = consumers
        self.random = random.Random(seed)
        self.books = Books()
        self.kills = 0
        self._stop_producing = threading.Event()
        self._stop_consuming = threading.Event()
        self._lock = threading.Lock()
        self._keep_books()

    def _keep_books(self) -> None:
        """Set up what the books need beyond Books; nothing here."""

    # -- client threads ----------------------------------------------------

    def _connect(self, stop: threading.Event) -> Client | None:
        while not stop.is_set():
            try:
                return Client(self.daemon.address)
            except OSError:
                time.sleep(0.02)
        return None

    def _produce(self, index: int) -> None:
        rng = random.Random(index)
        n = 0
        client = self._connect(self._stop_producing)
        while client is not None and not self._stop_producing.is_set():
            message = b"p%d-%d" % (index, n)
            n += 1  # a new id for every attempt: a retry could store a copy
            queue = rng.choice(self.targets)
            with self._lock:
                self.books.sent.add(message)
            try:
                client.send(b"set %b 0 0 %d\r\n%b\r\n" % (queue.encode(), len(message), message))
                reply = client.line()
            except Gone:
                client.close()
                client = self._connect(self._stop_producing)
                continue  # stored or not: it may be delivered, at most once
            if reply == b"STORED":
                with self._lock:
                    self.books.stored.add(message)
            elif not reply.startswith(b"SERVER_ERROR"):
                self.books.errors.append(f"set answered {reply!r}")
        if client is not None:
            client.close()

    def _consume(self, index: int) -> None:
        rng = random.Random(1000 + index)
        client = self._connect(self._stop_consuming)
        while client is not None and not self._stop_consuming.is_set():
            queue = rng.choice(self.queues)
            open_message = None
            plain = rng.random() < self.plain_share
            try:
                if plain:
                    message = client.get(queue)
                    if message is not None:
                        self._took(queue, message)
                else:
                    open_message = client.get(queue + "/open")
                    if open_message is not None:
                        self._opened(queue, open_message)
                        if client.get(queue + "/close") is not None:
                            self.books.errors.append("/close returned a value")
                        open_message = None
                if rng.random() < 0.05:
                    time.sleep(0.001)
            except Gone:
                with self._lock:
                    if open_message is not None:
                        self._lost_open(queue, open_message)
                    elif plain:
                        self.books.lost_gets += 1
                client.close()
                client = self._connect(self._stop_consuming)
        if client is not None:
            client.close()

    # -- the run -------------------------------------------------------------

    def run(self, cycles: int, min_s: float = 0.2, max_s: float = 1.0) -> Books:
        """Kill and restart the daemon `cycles` times under load, then drain and stop."""
        self.daemon.start()
        self._prepare()
        threads = [
            threading.Thread(target=self._produce, args=(i,), daemon=True)
            for i in range(self.producers)
        ] + [
            threading.Thread(target=self._consume, args=(i,), daemon=True)
            for i in range(self.consumers)
        ]
        for thread in threads:
            thread.start()
        try:
            for _ in range(cycles):
                time.sleep(self.random.uniform(min_s, max_s))
                self.daemon.kill()
                self.kills += 1
                self.daemon.start()
            time.sleep(self.random.uniform(min_s, max_s))
            self._stop_producing.set()
            for thread in threads[: self.producers]:
                thread.join(30)
            self._drain()
            self._stop_consuming.set()
            for thread in threads[self.producers :]:
                thread.join(30)
            self._drain()
        finally:
            self._stop_producing.set()
            self._stop_consuming.set()
            self.daemon.kill()
        return self.books

    def problems(self) -> list[str]:
        """What the books show went wrong (none when they balance)."""
        return self.books.check()

    def _prepare(self) -> None:
        """Set up queues before the clients start; nothing to do here."""

    def _took(self, queue: str, message: bytes) -> None:
        self.books.taken.append(message)

    def _opened(self, queue: str, message: bytes) -> None:
        self.books.opened.append(message)

    def _lost_open(self, queue: str, message: bytes) -> None:
        self.books.lost_open.add(message)

    def _drain(self) -> None:
        """Take what is left, until every queue stays empty for a moment."""
        client = Client(self.daemon.address)
        try:
            quiet_since = time.monotonic()
            while time.monotonic() - quiet_since < 0.5:
                got = False
                for queue in self.queues:
                    message = client.get(queue)
                    if message is not None:
                        self._took(queue, message)
                        got = True
                if got:
                    quiet_since = time.monotonic()
                else:
                    time.sleep(0.02)
        finally:
            client.close()


FANOUT_PARENT = "fan"
FANOUT_QUEUES = (FANOUT_PARENT, FANOUT_PARENT + "+a", FANOUT_PARENT + "+b")


@dataclass
class FanoutBooks:
    """What the clients of a fanout soak saw, per queue."""

    sent: set[bytes] = field(default_factory=set)
    stored: set[bytes] = field(default_factory=set)
    # queue -> every hand-out (/open and the final drain), repeats included
    seen: dict[str, list[bytes]] = field(
        default_factory=lambda: {queue: [] for queue in FANOUT_QUEUES}
    )
    # queue -> messages open there when the daemon died
    lost_open: dict[str, set[bytes]] = field(
        default_factory=lambda: {queue: set() for queue in FANOUT_QUEUES}
    )
    errors: list[str] = field(default_factory=list)
    #: Whether one commit stores every copy, so that a set the kill cut off
    #: left all or none. Not on Aerospike: its Community Edition has no
    #: multi-record transactions, and each copy is a commit of its own.
    atomic: bool = True

    def copies(self) -> Counter[int]:
        """How many sent messages ended in 0, 1, 2 or 3 of the queues."""
        where = {queue: set(seen) for queue, seen in self.seen.items()}
        return Counter(sum(m in found for found in where.values()) for m in self.sent)

    def check(self) -> list[str]:
        """What is wrong, if anything."""
        problems = list(self.errors)
        where = {queue: set(seen) for queue, seen in self.seen.items()}
        partial: list[bytes] = []
        short: list[bytes] = []
        for message in self.sent:
            found = [queue for queue, got in where.items() if message in got]
            if message in self.stored and len(found) < len(where):
                short.append(message)
            elif self.atomic and 0 < len(found) < len(where):
                partial.append(message)
        if short:
            problems.append(f"{len(short)} STORED message(s) missing a copy: {_few(set(short))}")
        if partial:
            problems.append(
                f"{len(partial)} unacknowledged message(s) in some queues only: "
                f"{_few(set(partial))}"
            )
        for queue, seen in self.seen.items():
            strange = set(seen) - self.sent
            if strange:
                problems.append(f"{queue}: {len(strange)} never sent: {_few(strange)}")
            again = {m for m, n in Counter(seen).items() if n > 1} - self.lost_open[queue]
            if again:
                problems.append(f"{queue}: {len(again)} delivered twice: {_few(again)}")
        if self.stored and not all(self.seen.values()):
            problems.append("a queue delivered nothing")
        return problems


class FanoutSoak(Soak):
    """The soak on a fanout parent and two children, all read reliably."""

    targets = (FANOUT_PARENT,)
    queues = FANOUT_QUEUES
    plain_share = 0.0  # a plain get cut off by a kill would lose a copy

    fanout: FanoutBooks

    def _keep_books(self) -> None:
        self.fanout = FanoutBooks()
        # The producers' bookkeeping (sent, stored) is shared with Soak's.
        self.books.sent = self.fanout.sent
        self.books.stored = self.fanout.stored
        self.books.errors = self.fanout.errors

    def problems(self) -> list[str]:
        return self.fanout.check()

    def _prepare(self) -> None:
        """Make the children exist (a `get` names them) before any parent `set`."""
        client = Client(self.daemon.address)
        try:
            for child in self.queues[1:]:
                if client.get(child) is not None:
                    self.fanout.errors.append(f"new child {child} was not empty")
        finally:
            client.close()

    def _took(self, queue: str, message: bytes) -> None:
        self.fanout.seen[queue].append(message)

    def _opened(self, queue: str, message: bytes) -> None:
        self.fanout.seen[queue].append(message)

    def _lost_open(self, queue: str, message: bytes) -> None:
        self.fanout.lost_open[queue].add(message)


def short_run(soak: Soak, cycles: int = 4) -> None:
    """A durable backend's crash test: `cycles` kills under load, and books that balance."""
    soak.run(cycles, min_s=0.3, max_s=1.0)
    problems = soak.problems()
    assert not problems, "\n".join(problems) + "\n" + soak.daemon.log()[-3000:]
    assert soak.kills == cycles
    assert len(soak.books.stored) > 100, "too little was stored for the kills to matter"
