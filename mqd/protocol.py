"""The memcached text protocol with queue meaning: bytes in, commands out.

Pure: no sockets, no storage. `Parser.feed` takes whatever the socket
delivered and returns the complete commands it now holds; any split of the
same input gives the same commands (the parser keeps memcached's line mode,
data mode and swallow mode as explicit state). Replies are built by the small
functions at the bottom, from the wire vocabulary in `REPLY`.

At about 700 lines it is longer than most modules: the whole memcached wire
(command types, the state machine with its fast paths, and the replies) is
kept in one place, which is also the one module compiled with mypyc.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from mqd.backend import Message, Put
from mqd.errors import ClientError, ProtocolError, ServerError, UnknownCommand

MAX_NAME = 250  # bytes in a queue name
MAX_LINE = 2048  # bytes in a command line ...
MAX_GET_LINE = 65536  # ... except get/gets, which may carry many keys
MAX_GET_KEYS = 8192  # keys in one get or gets
MAX_BYTES_FIELD = 2**31 - 1  # memcached parses <bytes> as a signed 32-bit number
MAX_FLAGS = 2**32 - 1
MAX_LEASE_COUNT = 100_000  # messages one named lease holds, or one range read covers (`/n=`)
MAX_VISIBILITY_MS = 7 * 24 * 3600 * 1000  # a named lease's own visibility timeout, at most
MAX_CACHED = 4096  # keys and queue names a connection keeps parsed
MAX_CACHED_LINES = 256  # whole `get` and `set` lines a connection keeps parsed

REPLY = {
    "stored": b"STORED\r\n",
    "not_stored": b"NOT_STORED\r\n",
    "deleted": b"DELETED\r\n",
    "not_found": b"NOT_FOUND\r\n",
    "end": b"END\r\n",
    "ok": b"OK\r\n",
    "reset": b"RESET\r\n",
}

#: The per-queue `stats` figures, after `queue_<name>_`, in the order they are sent.
QUEUE_STATS = ("items", "bytes", "open", "enqueued", "dequeued", "expired", "age_ms")

BAD_FORMAT = "bad command line format"
BAD_CHUNK = "bad data chunk"
LINE_TOO_LONG = "line too long"
TOO_LARGE = "object too large for cache"

# Commands that exist in memcached but mean nothing for a queue.
UNSUPPORTED_STORAGE = frozenset({b"replace", b"append", b"prepend", b"cas"})
UNSUPPORTED_OTHER = frozenset({b"incr", b"decr", b"touch", b"gat", b"gats"})

_BAD_NAME_BYTE = re.compile(rb"[\x00-\x20\x7f/]")
_LEASE_NAME = re.compile(rb"[A-Za-z0-9._-]{1,64}")


def name_bytes(name: str) -> bytes:
    """The exact wire bytes of a queue name."""
    return name.encode("utf-8", "surrogateescape")


def name_text(raw: bytes) -> str:
    """The queue name for wire bytes: the inverse of name_bytes."""
    return raw.decode("utf-8", "surrogateescape")


def name_shown(name: str) -> str:
    """A queue name as valid UTF-8 text, for what takes nothing else (a metric's
    label): each of its bytes that are not UTF-8 written as \\xNN."""
    return name_bytes(name).decode("utf-8", "backslashreplace")


# -- commands -----------------------------------------------------------------
#
# The two that carry the load, Store and Retrieve, spell out __init__: under
# mypyc a dataclass keeps the __init__ that `dataclass` generates, which is
# interpreted Python, while one written here is compiled (a command each).


@dataclass(slots=True)
class Store:
    """`set` or `add` (add=True): enqueue `body` on `queue`."""

    add: bool
    queue: str
    flags: int
    exptime: int
    body: bytes
    noreply: bool

    def __init__(
        self, add: bool, queue: str, flags: int, exptime: int, body: bytes, noreply: bool
    ) -> None:
        self.add, self.queue, self.flags = add, queue, flags
        self.exptime, self.body, self.noreply = exptime, body, noreply


@dataclass(frozen=True, slots=True)
class Key:
    """One key of a `get`: a queue name and its options."""

    raw: bytes  # as the client wrote it, echoed in VALUE lines
    queue: str
    wait_ms: int | None = None
    open: bool = False
    close: bool = False
    abort: bool = False
    peek: bool = False
    at: int | None = None
    plain: bool = False  # no options at all: the common case, the broker's fast path
    lease: str | None = None  # `/lease=<name>`: with `count`, reserve; with `abort`, give back
    count: int = 0  # `/n=<count>`: how many messages the lease should hold, or ids from `at`
    visibility_ms: int = 0  # `/visibility=<ms>`: the lease's timeout (0: the queue's)

    @property
    def alone(self) -> bool:
        """A key whose reply is many values (a lease, a range read): it stands alone."""
        return self.lease is not None or self.count > 0


@dataclass(slots=True)
class Retrieve:
    """`get` or `gets` (with_ids) of one or more keys."""

    keys: list[Key]
    with_ids: bool

    def __init__(self, keys: list[Key], with_ids: bool) -> None:
        self.keys = keys
        self.with_ids = with_ids


@dataclass(frozen=True, slots=True)
class Delete:
    """`delete <queue>`, or with `lease` the acknowledgement of a named lease's messages."""

    queue: str
    noreply: bool
    lease: str | None = None
    to: int | None = None  # acknowledge only the lease's messages with ids up to this


@dataclass(frozen=True, slots=True)
class FlushAll:
    delay: int
    noreply: bool


@dataclass(frozen=True, slots=True)
class Redrive:
    """mqd's `redrive <dead> <max> [<to>]`: dead letters back where they died, or to `to`."""

    dead: str
    limit: int
    to: str | None


@dataclass(frozen=True, slots=True)
class Stats:
    args: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Version:
    pass


@dataclass(frozen=True, slots=True)
class Verbosity:
    noreply: bool


@dataclass(frozen=True, slots=True)
class Quit:
    pass


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


@dataclass(frozen=True, slots=True)
class Failed:
    """A command that is answered with an error line; `close` ends the connection."""

    error: ProtocolError
    noreply: bool = False
    close: bool = False

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Failed)
            and type(self.error) is type(other.error)
            and self.error.message == other.error.message
            and (self.noreply, self.close) == (other.noreply, other.close)
        )

    def __hash__(self) -> int:
        return hash((type(self.error), self.error.message, self.noreply, self.close))


Command = (
    Store
    | Retrieve
    | Delete
    | FlushAll
    | Redrive
    | Stats
    | Version
    | Verbosity
    | Quit
    | Shutdown
    | Failed
)


def _bad(noreply: bool = False) -> Failed:
    return Failed(ClientError(BAD_FORMAT), noreply)


# -- tokens -------------------------------------------------------------------


def _unsigned(token: bytes, high: int) -> int | None:
    """`token` as an integer in [0, high], or None."""
    # Longer tokens cannot be in range (and int() refuses over 4300 digits).
    if not token.isdigit() or len(token) > 20:
        return None
    value = int(token)
    return value if value <= high else None


def _signed(token: bytes) -> int | None:
    """`token` as a 64-bit signed integer, or None: every `exptime` goes through it."""
    digits = token[1:] if token[:1] == b"-" else token
    if not digits.isdigit() or len(digits) > 19:  # more digits cannot fit in 64 bits
        return None
    value = int(token)
    return value if -(2**63) <= value < 2**63 else None


def tokens_of(line: bytes) -> list[bytes]:
    """A command line's tokens: memcached separates them by spaces alone.

    A tab or another control byte is part of its token, so in a key it makes
    a bad key rather than two keys; runs of spaces count as one.
    """
    tokens = line.split(b" ")
    if b"" in tokens:
        tokens = [token for token in tokens if token]
    return tokens


def queue_name(raw: bytes) -> str | None:
    """The queue name `raw` names, or None if the protocol does not allow it.

    One `+` may join a fanout child's name to its parent's (`jobs+audit`).
    """
    if not 0 < len(raw) <= MAX_NAME or _BAD_NAME_BYTE.search(raw):
        return None
    if b"+" in raw:
        parent, _, child = raw.partition(b"+")
        if not parent or not child or b"+" in child:
            return None
    return name_text(raw)


def fanout_parent(name: str) -> str:
    """The parent of fanout child `name` (`jobs` of `jobs+audit`)."""
    return name.partition("+")[0]


_FLAG_OPTIONS = {b"open": "open", b"close": "close", b"abort": "abort", b"peek": "peek"}
# Options that make no sense together (Kestrel's combinations otherwise).
_CLASHES = (
    {"peek", "open"},
    {"peek", "close"},
    {"peek", "abort"},
    {"abort", "close"},
    {"abort", "open"},
)
# The option sets of keys whose reply is many values: a lease's reserve (and
# wait) or give-back, and a range read by id.
_MANY_FORMS = (
    {"lease", "count"},
    {"lease", "count", "wait_ms"},
    {"lease", "count", "visibility"},
    {"lease", "count", "wait_ms", "visibility"},
    {"lease", "abort"},
    {"at", "count"},
)


def parse_key(raw: bytes) -> Key | None:
    """A `get` key with its `/option`s, or None if it is malformed."""
    name, slash, rest = raw.partition(b"/")
    queue = queue_name(name)
    if queue is None:
        return None
    if not slash:
        return Key(raw, queue, plain=True)
    seen: set[str] = set()
    wait_ms: int | None = None
    at: int | None = None
    lease: str | None = None
    count: int | None = 0
    visibility: int | None = 0
    for option in rest.split(b"/"):
        flag = _FLAG_OPTIONS.get(option)
        if flag is not None:
            key = flag
        elif option.startswith(b"t="):
            key, wait_ms = "wait_ms", _unsigned(option[2:], 2**63)
            if wait_ms is None:
                return None
        elif option.startswith(b"at="):
            key, at = "at", _unsigned(option[3:], 2**63)
            if at is None:
                return None
        elif option.startswith(b"lease="):
            key, lease = "lease", lease_name(option[6:])
            if lease is None:
                return None
        elif option.startswith(b"visibility="):
            key, visibility = "visibility", _unsigned(option[11:], MAX_VISIBILITY_MS)
            if not visibility:
                return None
        elif option.startswith(b"n="):
            key, count = "count", _unsigned(option[2:], MAX_LEASE_COUNT)
            if not count:
                return None
        else:
            return None
        if key in seen:
            return None
        seen.add(key)
    if ("lease" in seen or "count" in seen or "visibility" in seen) and seen not in _MANY_FORMS:
        return None
    if "at" in seen and len(seen) > 1 and "count" not in seen:
        return None
    if any(clash <= seen for clash in _CLASHES):
        return None
    # Arguments spelled out: compiled by mypyc, Key(**fields) fails on the bool fields.
    return Key(
        raw,
        queue,
        wait_ms=wait_ms,
        open="open" in seen,
        close="close" in seen,
        abort="abort" in seen,
        peek="peek" in seen,
        at=at,
        lease=lease,
        count=count or 0,
        visibility_ms=visibility or 0,
    )


def lease_name(raw: bytes) -> str | None:
    """A named lease's name (1-64 bytes of `[A-Za-z0-9._-]`), or None if it is not one."""
    return raw.decode("ascii") if _LEASE_NAME.fullmatch(raw) else None


# -- the parser ----------------------------------------------------------------


class Parser:
    """Incremental parser of one connection's input.

    `max_item_size` is the largest data block kept in memory: a larger one is
    read and discarded as it arrives (memcached's swallow state) and answered
    with SERVER_ERROR, so a client cannot make the daemon buffer it.
    """

    def __init__(self, max_item_size: int = 1 << 20) -> None:
        self.max_item_size = max_item_size
        self._rest = b""  # input not yet consumed
        self._chunks: list[bytes] = []  # a data block arriving in pieces
        self._have = 0  # bytes in _rest and _chunks together
        self._need = 0  # bytes of data block (with its \r\n) still to come
        self._store: tuple[bool, str, int, int, bool] | None = None
        self._swallow = 0  # bytes still to discard
        self._after_swallow: Failed | None = None
        self.closed = False  # set after a fatal error; feed() then returns nothing
        # Whether part of a command has arrived and the rest has not: set by
        # feed() (an attribute, not a property: it is read after every read).
        self.partial = False
        # Keys and names are parsed once per connection (bounded: client-chosen).
        self._keys: dict[bytes, Key | None] = {}
        self._names: dict[bytes, str | None] = {}
        # So are the plain `get <key>` lines, and the `set` lines that take the
        # fast path in feed() (queue, flags, exptime, bytes): a client sends
        # the same few again and again, and one lookup of the whole line
        # costs less than slicing, splitting and converting it every time.
        self._get_lines: dict[bytes, Key] = {}
        self._set_lines: dict[bytes, tuple[str, int, int, int]] = {}

    def feed(self, data: bytes) -> list[Command]:
        """Take more input and return every command it completes, in order."""
        if self.closed:
            return []
        if self._need and self._have + len(data) < self._need:
            # Most of a large value: keep the pieces, join them once at the end.
            self._chunks.append(data)
            self._have += len(data)
            self.partial = True
            return []
        if self._have and not self._need and not self._swallow and b"\n" not in data:
            return self._line_piece(data)
        if self._chunks:
            data = self._rest + b"".join(self._chunks) + data
            self._chunks.clear()
        elif self._rest:
            data = self._rest + data
        out: list[Command] = []
        pos = 0
        size = len(data)
        while pos < size:
            if self._swallow:
                taken = min(self._swallow, size - pos)
                pos += taken
                self._swallow -= taken
                if self._swallow:
                    break
                assert self._after_swallow is not None
                out.append(self._after_swallow)
                self._after_swallow = None
                continue
            if self._need:
                end = pos + self._need
                if end > size:
                    break
                out.append(self._finish_store(data, pos, end))
                pos = end
                continue
            newline = data.find(b"\n", pos)
            if newline < 0:
                # Less a last \r: it may end the line, whose \n has not come yet.
                held = size - pos - (data[size - 1] == 13)
                if held > MAX_LINE and held > self._line_limit(data, pos):
                    return [*out, self._too_long()]
                break
            end = newline - 1 if newline > pos and data[newline - 1] == 13 else newline
            if end - pos > MAX_LINE and end - pos > self._line_limit(data, pos):
                return [*out, self._too_long()]
            line = data[pos:end]
            pos = newline + 1
            # Fast paths for the two commands that carry the load; anything
            # unusual about them falls through to the general path below,
            # which gives the same result (the property tests check both).
            # Inline: every get and set comes here.
            parsed = self._set_lines.get(line)
            if parsed is not None:
                block = pos + parsed[3] + 2
                if block <= size and data[block - 2] == 13 and data[block - 1] == 10:
                    body = data[pos : block - 2]
                    out.append(Store(False, parsed[0], parsed[1], parsed[2], body, False))
                    pos = block
                    continue
            elif (key := self._get_lines.get(line)) is not None:
                out.append(Retrieve([key], False))
                continue
            elif line[:4] == b"get ":
                key = self._keys.get(line[4:])
                if key is not None:
                    if len(self._get_lines) < MAX_CACHED_LINES:
                        self._get_lines[line] = key
                    out.append(Retrieve([key], False))
                    continue
            elif line[:4] == b"set ":
                tokens = line.split(b" ")
                if len(tokens) == 5:
                    nbytes = tokens[4]
                    block = pos + int(nbytes) + 2 if nbytes.isdigit() else 0
                    # 0 < block: compiled by mypyc, a negative slice start is an error.
                    if 0 < block <= size and data[block - 2 : block] == b"\r\n":
                        # A plain set whose block is complete. Only what is
                        # surely in range is taken here (9 digits < 2**32,
                        # 18 < 2**63); anything else takes the general path,
                        # whose checks are the rule.
                        queue = self._names.get(tokens[1])
                        flags, exptime = tokens[2], tokens[3]
                        if (
                            queue is not None
                            and flags.isdigit()
                            and exptime.isdigit()
                            and len(flags) <= 9
                            and len(exptime) <= 18
                            and block - 2 - pos <= self.max_item_size
                        ):
                            parsed = (queue, int(flags), int(exptime), block - 2 - pos)
                            if len(self._set_lines) < MAX_CACHED_LINES:
                                self._set_lines[line] = parsed
                            body = data[pos : block - 2]
                            out.append(Store(False, queue, parsed[1], parsed[2], body, False))
                            pos = block
                            continue
            command = self._command(line)
            if command is not None:
                out.append(command)
        if pos < size:
            self._rest = data[pos:]
            self._have = size - pos
            self.partial = True
        else:  # the usual end of a read: nothing of a line held
            self._rest = b""
            self._have = 0
            self.partial = self._need > 0 or self._swallow > 0
        return out

    def _line_piece(self, data: bytes) -> list[Command]:
        """More of a line whose newline has not come: kept, not joined to what is held.

        Joining at every read, and looking for the newline from the line's
        start, would cost time quadratic in the line's length when it comes
        in small reads; the pieces are joined once, when the newline comes.
        """
        if self._chunks or len(self._rest) >= 5:
            self._chunks.append(data)
        else:
            self._rest += data  # the line's first bytes together: _line_limit reads them
        self._have += len(data)
        self.partial = True
        # Less a last \r, as in feed: it may end the line, whose \n has not come yet.
        held = self._have - data.endswith(b"\r")
        if held > MAX_LINE and held > self._line_limit(self._rest, 0):
            return [self._too_long()]
        return []

    @staticmethod
    def _line_limit(data: bytes, pos: int) -> int:
        if data.startswith(b"get ", pos) or data.startswith(b"gets ", pos):
            return MAX_GET_LINE
        return MAX_LINE

    def _too_long(self) -> Failed:
        self.closed = True
        self._rest = b""
        self._chunks.clear()
        self._have = self._need = self._swallow = 0
        self.partial = False
        return Failed(ClientError(LINE_TOO_LONG), close=True)

    def _finish_store(self, data: bytes, start: int, end: int) -> Command:
        assert self._store is not None
        add, queue, flags, exptime, noreply = self._store
        self._need = 0
        self._store = None
        if data[end - 2 : end] != b"\r\n":
            return Failed(ClientError(BAD_CHUNK), noreply)
        return Store(add, queue, flags, exptime, data[start : end - 2], noreply)

    def _command(self, line: bytes) -> Command | None:
        tokens = tokens_of(line)
        if not tokens:
            return Failed(UnknownCommand())
        handler = _HANDLERS.get(tokens[0])
        if handler is None:
            if tokens[0] in UNSUPPORTED_OTHER:
                name = tokens[0].decode()
                return Failed(ClientError(f"{name} not supported"), tokens[-1] == b"noreply")
            return Failed(UnknownCommand())
        return handler(self, tokens)

    def _name(self, raw: bytes) -> str | None:
        names = self._names
        try:
            return names[raw]
        except KeyError:
            name = queue_name(raw)
            if len(names) < MAX_CACHED:
                names[raw] = name
            return name

    def _storage(self, tokens: list[bytes]) -> Command | None:
        """Start a storage command; its reply waits for the data block, so None."""
        noreply = tokens[-1] == b"noreply"
        nbytes = _unsigned(tokens[4], MAX_BYTES_FIELD) if len(tokens) > 4 else None
        if nbytes is None:
            return _bad(noreply)
        error: ProtocolError | None = None
        verb = tokens[0]
        if verb in UNSUPPORTED_STORAGE:
            error = ClientError(f"{verb.decode()} not supported")
        elif len(tokens) != 5 + noreply:
            error = ClientError(BAD_FORMAT)
        else:
            queue = self._name(tokens[1])
            flags = _unsigned(tokens[2], MAX_FLAGS)
            exptime = _signed(tokens[3])
            if queue is None or flags is None or exptime is None:
                error = ClientError(BAD_FORMAT)
            elif nbytes > self.max_item_size:
                error = ServerError(TOO_LARGE)
        if error is not None:
            self._swallow = nbytes + 2
            self._after_swallow = Failed(error, noreply)
            return None
        self._store = (verb == b"add", queue, flags, exptime, noreply)  # type: ignore[assignment]
        self._need = nbytes + 2
        return None

    def _retrieve(self, tokens: list[bytes]) -> Command:
        if len(tokens) < 2:
            return _bad()
        if len(tokens) > MAX_GET_KEYS + 1:
            return Failed(ClientError(f"too many keys (at most {MAX_GET_KEYS})"))
        cache = self._keys
        keys = []
        for raw in tokens[1:]:
            try:
                key = cache[raw]
            except KeyError:
                key = parse_key(raw)
                if len(cache) < MAX_CACHED:
                    cache[raw] = key
            if key is None:
                return _bad()
            keys.append(key)
        if len(keys) > 1 and any(key.alone for key in keys):
            return _bad()  # a lease's or a range's reply is many values of one key
        return Retrieve(keys, tokens[0] == b"gets")

    def _delete(self, tokens: list[bytes]) -> Command:
        noreply = tokens[-1] == b"noreply"
        rest = tokens[2 : len(tokens) - noreply]
        # memcached still accepts a legacy zero hold time: `delete <key> 0`.
        if len(tokens) < 2 or rest not in ([], [b"0"]):
            return _bad(noreply)
        name, slash, options = tokens[1].partition(b"/")
        queue = self._name(name)
        if queue is None:
            return _bad(noreply)
        if not slash:
            return Delete(queue, noreply)
        return _lease_delete(queue, options, noreply)

    def _flush_all(self, tokens: list[bytes]) -> Command:
        noreply = tokens[-1] == b"noreply"
        rest = tokens[1 : len(tokens) - noreply]
        delay = _unsigned(rest[0], 2**63) if len(rest) == 1 else 0
        if len(rest) > 1 or delay is None:
            return _bad(noreply)
        return FlushAll(delay, noreply)

    def _redrive(self, tokens: list[bytes]) -> Command:
        if len(tokens) not in (3, 4):
            return _bad()
        dead = self._name(tokens[1])
        limit = _unsigned(tokens[2], MAX_BYTES_FIELD)
        to = self._name(tokens[3]) if len(tokens) == 4 else None
        if dead is None or not limit or (len(tokens) == 4 and to is None):
            return _bad()
        return Redrive(dead, limit, to)

    def _stats(self, tokens: list[bytes]) -> Command:
        return Stats(tuple(tokens[1:]))

    def _version(self, tokens: list[bytes]) -> Command:
        return Version() if len(tokens) == 1 else _bad()

    def _verbosity(self, tokens: list[bytes]) -> Command:
        noreply = tokens[-1] == b"noreply"
        if len(tokens) != 2 + noreply or _unsigned(tokens[1], 2**63) is None:
            return _bad(noreply)
        return Verbosity(noreply)

    def _quit(self, tokens: list[bytes]) -> Command:
        return Quit() if len(tokens) == 1 else _bad()

    def _shutdown(self, tokens: list[bytes]) -> Command:
        # memcached's `shutdown graceful`: every mqd shutdown is graceful.
        return Shutdown() if tokens[1:] in ([], [b"graceful"]) else _bad()


def _lease_delete(queue: str, options: bytes, noreply: bool) -> Command:
    """`delete <queue>/lease=<name>[/to=<id>]`: the lease's acknowledgement."""
    lease: str | None = None
    to: int | None = None
    parts = options.split(b"/")
    if len(parts) > 2:
        return _bad(noreply)
    for option in parts:
        if option.startswith(b"lease=") and lease is None:
            lease = lease_name(option[6:])
            if lease is None:
                return _bad(noreply)
        elif option.startswith(b"to=") and len(parts) == 2 and to is None:
            to = _unsigned(option[3:], 2**63)
            if to is None:
                return _bad(noreply)
        else:
            return _bad(noreply)
    if lease is None:
        return _bad(noreply)
    return Delete(queue, noreply, lease, to)


_HANDLERS: dict[bytes, Callable[[Parser, list[bytes]], Command | None]] = {
    b"set": Parser._storage,
    b"add": Parser._storage,
    b"replace": Parser._storage,
    b"append": Parser._storage,
    b"prepend": Parser._storage,
    b"cas": Parser._storage,
    b"get": Parser._retrieve,
    b"gets": Parser._retrieve,
    b"delete": Parser._delete,
    b"flush_all": Parser._flush_all,
    b"redrive": Parser._redrive,
    b"stats": Parser._stats,
    b"version": Parser._version,
    b"verbosity": Parser._verbosity,
    b"quit": Parser._quit,
    b"shutdown": Parser._shutdown,
}


# -- replies ------------------------------------------------------------------


def value(key: bytes, flags: int, body: bytes, offset: int | None = None) -> bytes:
    """One `VALUE` block; with `offset` it is the `gets` form."""
    if offset is None:
        return b"VALUE %b %d %d\r\n%b\r\n" % (key, flags, len(body), body)
    return b"VALUE %b %d %d %d\r\n%b\r\n" % (key, flags, len(body), offset, body)


def single_value(key: bytes, flags: int, body: bytes) -> bytes:
    """A whole `get` reply of one VALUE, built in one step (the common reply)."""
    return b"VALUE %b %d %d\r\n%b\r\nEND\r\n" % (key, flags, len(body), body)


def store_reply(command: Store, result: Put) -> bytes:
    """`set` is refused only by a full queue; `add` also by a body already there."""
    if result is Put.STORED or (result is Put.DUPLICATE and not command.add):
        return REPLY["stored"]
    return REPLY["not_stored"]


def values_reply(hits: list[tuple[Key, Message]], with_ids: bool) -> bytes:
    """A whole `get`/`gets` reply: a VALUE block per message found, then END."""
    if not hits:
        return REPLY["end"]
    if len(hits) == 1 and not with_ids:
        key, message = hits[0]
        return single_value(key.raw, message.flags, message.body)
    out = [value(k.raw, m.flags, m.body, m.offset if with_ids else None) for k, m in hits]
    out.append(REPLY["end"])
    return b"".join(out)


def moved_reply(count: int) -> bytes:
    """The reply to `redrive`: how many messages moved."""
    return b"MOVED %d\r\n" % count


def stats_reply(figures: list[tuple[str, object]]) -> bytes:
    """STAT lines, then END."""
    return b"".join([stat(name, val) for name, val in figures]) + REPLY["end"]


def stat(name: str | bytes, val: object) -> bytes:
    """One `STAT` line."""
    if isinstance(name, str):
        name = name_bytes(name)
    return b"STAT %b %b\r\n" % (name, str(val).encode())


def error_line(error: ProtocolError) -> bytes:
    """The reply line for an error: the one place exceptions become wire bytes."""
    if isinstance(error, UnknownCommand) or not error.message:
        return error.prefix.encode() + b"\r\n"
    return f"{error.prefix} {error.message}\r\n".encode("utf-8", "surrogateescape")
