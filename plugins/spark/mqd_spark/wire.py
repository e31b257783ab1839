"""A small pipelined client for mqd's memcached text protocol, used by every Spark task.

Hand-written on purpose: pymemcache maps keys to values, so it can neither
pipeline many `set`s to one queue (one key) nor return a message's id and flags
together; the data source needs both, at bulk rates, over one socket per task.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable, Iterator
from typing import NamedTuple

log = logging.getLogger(__name__)

Address = tuple[str, int]

# A `get` line may be up to 64 KiB and name up to 8192 keys; stay below both.
MAX_GET_LINE = 60_000
MAX_GET_KEYS = 8_000
# Sets sent before their replies are read: the replies (8 bytes each) always
# fit in the socket buffers, so neither side can block the other.
STORE_BATCH = 2_000


class WireError(Exception):
    """The daemon answered with an error, or the connection failed."""


class Message(NamedTuple):
    queue: str
    id: int
    flags: int
    body: bytes


class Stored(NamedTuple):
    stored: int
    not_stored: int


def parse_servers(text: str) -> list[Address]:
    """`host:port[,host:port...]` as addresses; ValueError names the bad one."""
    servers = []
    for item in (part.strip() for part in text.split(",")):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad address {item!r}: expected host:port, port 1-65535")
        servers.append((host.strip("[]"), int(port)))
    return servers


def address_text(address: Address) -> str:
    return f"{address[0]}:{address[1]}"


class Connection:
    """One TCP connection to one mqd daemon."""

    def __init__(self, address: Address, timeout: float = 30.0) -> None:
        self.address = address
        try:
            self.sock = socket.create_connection(address, timeout=timeout)
        except OSError as error:
            raise WireError(f"cannot reach mqd at {address_text(address)}: {error}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()
        self.pos = 0

    def close(self) -> None:
        self.sock.close()

    # -- reading replies ------------------------------------------------------

    def _fill(self) -> None:
        if self.pos:
            del self.buf[: self.pos]
            self.pos = 0
        try:
            chunk = self.sock.recv(1 << 20)
        except OSError as error:
            raise WireError(f"mqd at {address_text(self.address)}: {error}") from None
        if not chunk:
            raise WireError(f"mqd at {address_text(self.address)} closed the connection")
        self.buf += chunk

    def _line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n", self.pos)
            if end >= 0:
                line = bytes(self.buf[self.pos : end])
                self.pos = end + 2
                return line
            self._fill()

    def _exact(self, size: int) -> bytes:
        while len(self.buf) - self.pos < size + 2:
            self._fill()
        data = bytes(self.buf[self.pos : self.pos + size])
        self.pos += size + 2
        return data

    def _values(self) -> list[tuple[int, int, bytes]]:
        """(id, flags, body) of each VALUE of a `gets` reply, up to END."""
        out: list[tuple[int, int, bytes]] = []
        while True:
            line = self._line()
            if line == b"END":
                return out
            parts = line.split()
            if parts[0] != b"VALUE" or len(parts) != 5:
                raise WireError(f"mqd at {address_text(self.address)}: {line.decode()}")
            out.append((int(parts[4]), int(parts[2]), self._exact(int(parts[3]))))

    def _call(self, line: bytes) -> list[tuple[int, int, bytes]]:
        try:
            self.sock.sendall(line)
        except OSError as error:
            raise WireError(f"mqd at {address_text(self.address)}: {error}") from None
        return self._values()

    # -- commands -------------------------------------------------------------

    def peek(self, queue: str) -> Message | None:
        """The queue's first waiting message, left in place; None when there is none."""
        values = self._call(b"gets %b/peek\r\n" % queue.encode())
        return Message(queue, *values[0]) if values else None

    def head(self, queue: str) -> int | None:
        """The id of the queue's first waiting message, None when there is none."""
        message = self.peek(queue)
        return message.id if message else None

    def read_ids(self, queue: str, first: int, last: int) -> Iterator[list[Message]]:
        """The messages with ids first..last still in the queue, in id order, in chunks.

        Nothing is removed: reading twice gives the same messages.
        """
        name = queue.encode()
        per_line = max(1, min(MAX_GET_KEYS, MAX_GET_LINE // (len(name) + 16)))
        for start in range(first, last + 1, per_line):
            stop = min(last + 1, start + per_line)
            keys = b" ".join(b"%b/at=%d" % (name, i) for i in range(start, stop))
            values = self._call(b"gets " + keys + b"\r\n")
            if values:
                yield [Message(queue, id_, flags, body) for id_, flags, body in values]

    def take(self, queue: str, count: int) -> list[tuple[int, int, bytes]]:
        """Removes up to `count` messages from the head: one `gets` line repeats the key."""
        key = queue.encode()
        per_line = max(1, min(MAX_GET_KEYS, MAX_GET_LINE // (len(key) + 1)))
        out: list[tuple[int, int, bytes]] = []
        while count > 0:
            n = min(count, per_line)
            out += self._call(b"gets " + b" ".join([key] * n) + b"\r\n")
            count -= n
        return out

    def remove_through(self, queue: str, last: int) -> int:
        """Removes every message at the head with an id up to `last`; the number removed.

        Correct when nothing else takes from the queue meanwhile (one consumer).
        Ids are taken in bulk, as many as can lie in head..last; if some ids in
        that range were missing (expired), a message past `last` may come too:
        it is given back at the tail rather than lost.
        """
        removed = 0
        while (head := self.head(queue)) is not None and head <= last:
            taken = self.take(queue, last - head + 1)
            extra = [(flags, body) for id_, flags, body in taken if id_ > last]
            removed += len(taken) - len(extra)
            if extra:
                log.warning("%d message(s) past id %d of %s re-queued", len(extra), last, queue)
                self.store((queue, body, flags, 0) for flags, body in extra)
                break
            if not taken:
                break
        return removed

    def store(self, rows: Iterable[tuple[str, bytes, int, int]], command: str = "set") -> Stored:
        """Enqueues (queue, body, flags, exptime) rows in order, pipelined.

        NOT_STORED replies are counted (a full queue, or a duplicate for `add`);
        any error reply raises.
        """
        verb = command.encode()
        stored = not_stored = 0
        batch: list[bytes] = []
        for queue, body, flags, exptime in rows:
            batch.append(
                b"%b %b %d %d %d\r\n%b\r\n"
                % (verb, queue.encode(), flags, exptime, len(body), body)
            )
            if len(batch) >= STORE_BATCH:
                ok, no = self._store_batch(batch)
                stored, not_stored, batch = stored + ok, not_stored + no, []
        if batch:
            ok, no = self._store_batch(batch)
            stored, not_stored = stored + ok, not_stored + no
        return Stored(stored, not_stored)

    def _store_batch(self, batch: list[bytes]) -> tuple[int, int]:
        try:
            self.sock.sendall(b"".join(batch))
        except OSError as error:
            raise WireError(f"mqd at {address_text(self.address)}: {error}") from None
        stored = not_stored = 0
        for _ in batch:
            line = self._line()
            if line == b"STORED":
                stored += 1
            elif line == b"NOT_STORED":
                not_stored += 1
            else:
                raise WireError(f"mqd at {address_text(self.address)}: {line.decode()}")
        return stored, not_stored

    def stats(self) -> dict[str, str]:
        """`stats`: the general counters and the per-queue lines, as text."""
        self.sock.sendall(b"stats\r\n")
        out: dict[str, str] = {}
        while (line := self._line()) != b"END":
            _, name, value = line.decode("utf-8", "surrogateescape").split(" ", 2)
            out[name] = value
        return out

    def queue_stats(self) -> dict[str, dict[str, int]]:
        """`stats queues` as {queue: {field: value}}."""
        self.sock.sendall(b"stats queues\r\n")
        out: dict[str, dict[str, int]] = {}
        while (line := self._line()) != b"END":
            _, name, value = line.decode("utf-8", "surrogateescape").split(" ", 2)
            queue, _, field = name[len("queue_") :].rpartition("_")
            if field == "ms":  # age_ms
                queue, _, field = queue.rpartition("_")
                field += "_ms"
            out.setdefault(queue, {})[field] = int(value)
        return out
