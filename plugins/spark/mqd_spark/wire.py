"""A small pipelined client for mqd's memcached text protocol, used by every Spark task.

Hand-written on purpose: pymemcache maps keys to values, so it can neither
pipeline many `set`s to one queue (one key) nor return a message's id and flags
together; the data source needs both, at bulk rates, over one socket per task.
"""

from __future__ import annotations

import socket
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple, TypeVar

Address = tuple[str, int]

# The daemon ends a range read's reply once its bodies reach this many bytes.
RANGE_BYTES = 64 << 20
# Storage commands per pipelined block: two blocks' replies (8 bytes each)
# stay far below what the daemon holds for a client that is still sending.
STORE_BATCH = 5_000
RECV_SIZE = 1 << 18
# Characters no queue name may hold (a regular expression, also for Arrow's
# kernels): a space or control byte would break the command line apart, and
# `/` starts the options after the name.
QUEUE_BREAKERS = r"[\x00-\x20\x7f/]"
MAX_QUEUE_BYTES = 250  # memcached's longest key
MAX_FLAGS = 2**32 - 1  # flags are 32 bits unsigned on the wire

T = TypeVar("T")
R = TypeVar("R")


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


class Columns(NamedTuple):
    """Messages of one queue as columns, the shape Arrow batches are built from."""

    ids: list[int]
    flags: list[int]
    bodies: list[bytes]

    def extend(self, other: Columns) -> None:
        self.ids.extend(other.ids)
        self.flags.extend(other.flags)
        self.bodies.extend(other.bodies)


# One VALUE line of a `gets` reply: flags, size, id (the key is ours, not parsed).
_STORED = b"STORED\r\n"


class Connection:
    """One TCP connection to one mqd daemon.

    Bulk commands are pipelined one request ahead: the next request is sent
    before the previous one's reply is read, so the daemon never waits for
    this client. A request's reply is at most a few hundred KiB, which the
    daemon holds while this side sends its next request (it stops reading
    only past 256 KiB of unread replies, after the socket buffers fill).
    """

    def __init__(self, address: Address, timeout: float = 30.0) -> None:
        self.address = address
        try:
            self.sock = socket.create_connection(address, timeout=timeout)
        except OSError as error:
            raise WireError(f"cannot reach mqd at {address_text(address)}: {error}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Replies arrive here; `pos` is where the unread part starts. Kept as
        # bytes so that a message's body is one slice, not a copy of a copy.
        self.data = b""
        self.pos = 0

    def close(self) -> None:
        self.sock.close()

    def _error(self, what: object) -> WireError:
        return WireError(f"mqd at {address_text(self.address)}: {what}")

    # -- the transport -------------------------------------------------------

    def _send(self, data: bytes | memoryview) -> None:
        try:
            self.sock.sendall(data)
        except OSError as error:
            raise self._error(error) from None

    def _fill(self) -> None:
        try:
            chunk = self.sock.recv(RECV_SIZE)
        except OSError as error:
            raise self._error(error) from None
        if not chunk:
            raise WireError(f"mqd at {address_text(self.address)} closed the connection")
        self.data = self.data[self.pos :] + chunk if self.pos < len(self.data) else chunk
        self.pos = 0

    def _line(self) -> bytes:
        while (end := self.data.find(b"\r\n", self.pos)) < 0:
            self._fill()
        line = self.data[self.pos : end]
        self.pos = end + 2
        return line

    def _pipeline(
        self, requests: Iterable[tuple[bytes | memoryview, T]], read: Callable[[T], R]
    ) -> Iterator[R]:
        """Sends each request, reading each reply (by `read(tag)`) once the next one is sent."""
        previous: list[T] = []
        for request, tag in requests:
            self._send(request)
            if previous:
                yield read(previous.pop())
            previous.append(tag)
        if previous:
            yield read(previous.pop())

    # -- retrieval replies ----------------------------------------------------

    def _columns(self, out: Columns) -> None:
        """Appends the id, flags and body of each VALUE of one `gets` reply, up to END."""
        # A task spends most of its time in this loop: it splits each VALUE
        # line (a third faster than a regular expression) and reads on in the
        # buffer it has, until a line or a body is cut off by the end of it.
        ids, flags, bodies = out.ids, out.flags, out.bodies
        while True:
            data, pos = self.data, self.pos
            find, size = data.find, len(data)
            while (end := find(b"\r\n", pos)) >= 0:
                head = data[pos:end]
                fields = head.split(b" ")
                if len(fields) != 5 or fields[0] != b"VALUE" or not fields[3].isdigit():
                    self.pos = end + 2
                    if head == b"END":
                        return
                    raise self._error(head.decode("utf-8", "replace"))
                start = end + 2
                stop = start + int(fields[3])
                if size < stop + 2:
                    break  # the body is not all here yet: parse the line again after
                try:
                    flags.append(int(fields[2]))
                    ids.append(int(fields[4]))
                except ValueError:
                    raise self._error(head.decode("utf-8", "replace")) from None
                bodies.append(data[start:stop])
                pos = stop + 2
            self.pos = pos
            self._fill()

    def _reply(self, _: object = None) -> Columns:
        """One `gets` reply as columns."""
        out = Columns([], [], [])
        self._columns(out)
        return out

    def _call(self, line: bytes) -> Columns:
        self._send(line)
        return self._reply()

    # -- commands -------------------------------------------------------------

    def peek(self, queue: str) -> Message | None:
        """The queue's first waiting message, left in place; None when there is none."""
        got = self._call(b"gets %b/peek\r\n" % queue.encode())
        return Message(queue, got.ids[0], got.flags[0], got.bodies[0]) if got.ids else None

    def head(self, queue: str) -> int | None:
        """The id of the queue's first waiting message, None when there is none."""
        message = self.peek(queue)
        return message.id if message else None

    def read_ids(self, queue: str, first: int, last: int, rows: int = 8192) -> Iterator[Columns]:
        """The messages with ids first..last still in the queue, in chunks of up to `rows`.

        Range reads (`gets <q>/at=<id>/n=<count>`), pipelined; nothing is
        removed, so reading twice gives the same messages. They come in id
        order, except that the rest of a range whose reply the daemon cut at
        RANGE_BYTES comes one chunk later.
        """
        name = queue.encode()
        ranges = deque((lo, min(last, lo + rows - 1)) for lo in range(first, last + 1, rows))

        def requests() -> Iterator[tuple[bytes, int]]:
            while ranges:
                lo, hi = ranges.popleft()
                yield b"gets %b/at=%d/n=%d\r\n" % (name, lo, hi - lo + 1), hi

        while ranges:  # again for the rests of cut replies, met after the last was sent
            for got, hi in self._pipeline(requests(), lambda hi: (self._reply(), hi)):
                if got.ids and got.ids[-1] < hi and sum(map(len, got.bodies)) >= RANGE_BYTES:
                    ranges.appendleft((got.ids[-1] + 1, hi))
                if got.ids:
                    yield got

    # -- named leases (docs/protocol.md, "Named leases") ------------------------

    def lease_read(
        self, queue: str, leases: Iterable[tuple[str, int]], hold_s: int = 0
    ) -> Iterator[Columns]:
        """Reserves each (name, count) lease and yields what it holds, in order.

        With `hold_s`, each lease holds its messages that many seconds after
        it was last named (`/visibility=`), not the queue's visibility timeout.

        Asking again gives the same messages while the lease lives: a retried
        task reads exactly what the failed attempt read (and more, up to
        `count`, if that one had found the queue short).
        """
        name = queue.encode()
        hold = b"/visibility=%d" % (hold_s * 1000) if hold_s else b""
        lines = (
            (b"gets %b/lease=%b/n=%d%b\r\n" % (name, lease.encode(), n, hold), None)
            for lease, n in leases
        )
        for got in self._pipeline(lines, self._reply):
            if got.ids:
                yield got

    def lease_ack(self, queue: str, leases: Iterable[str]) -> int:
        """Removes every message of each lease for good; how many leases held any."""
        name = queue.encode()
        lines = ((b"delete %b/lease=%b\r\n" % (name, lease.encode()), None) for lease in leases)
        deleted = 0
        for line in self._pipeline(lines, lambda _: self._line()):
            if line == b"DELETED":
                deleted += 1
            elif line != b"NOT_FOUND":
                raise self._error(line.decode("utf-8", "replace"))
        return deleted

    def lease_abort(self, queue: str, leases: Iterable[str]) -> None:
        """Gives every message of each lease back to the head of the queue."""
        name = queue.encode()
        lines = ((b"get %b/lease=%b/abort\r\n" % (name, lease.encode()), None) for lease in leases)
        for got in self._pipeline(lines, self._reply):
            if got.ids:
                raise self._error("an abort answered with messages")

    # -- storage ----------------------------------------------------------------

    def store_blocks(self, blocks: Iterable[tuple[bytes | memoryview, int]]) -> Stored:
        """Sends blocks of `count` storage commands each, pipelined; their replies counted.

        NOT_STORED replies are counted (a full queue, or a duplicate for `add`);
        any error reply raises.
        """
        stored = not_stored = 0
        for ok, no in self._pipeline(blocks, self._store_replies):
            stored, not_stored = stored + ok, not_stored + no
        return Stored(stored, not_stored)

    def _store_replies(self, count: int) -> tuple[int, int]:
        """Reads `count` storage replies: (STORED, NOT_STORED); raises on any other."""
        expected = _STORED * count
        while len(self.data) - self.pos < len(expected):
            # Every reply but an unlikely bare ERROR is 8 bytes or longer: a
            # short read waits for more, unless the replies are all here.
            if self.data.count(b"\n", self.pos) >= count:
                break
            self._fill()
        if self.data.startswith(expected, self.pos):
            self.pos += len(expected)
            return count, 0
        stored = not_stored = 0
        for _ in range(count):
            line = self._line()
            if line == b"STORED":
                stored += 1
            elif line == b"NOT_STORED":
                not_stored += 1
            else:
                raise self._error(line.decode("utf-8", "replace"))
        return stored, not_stored

    def store(self, rows: Iterable[tuple[str, bytes, int, int]], command: str = "set") -> Stored:
        """Enqueues (queue, body, flags, exptime) rows in order, pipelined."""
        verb = command.encode()
        block: list[bytes] = []

        def blocks() -> Iterator[tuple[bytes, int]]:
            for queue, body, flags, exptime in rows:
                block.append(
                    b"%b %b %d %d %d\r\n%b\r\n"
                    % (verb, queue.encode(), flags, exptime, len(body), body)
                )
                if len(block) == STORE_BATCH:
                    yield b"".join(block), len(block)
                    block.clear()
            if block:
                yield b"".join(block), len(block)

        return self.store_blocks(blocks())

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
