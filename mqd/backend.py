"""The storage boundary: what a backend is, and how backends are found.

A backend stores messages and the queue state that every daemon using the same
store must agree on: leases of open messages, limits, dead-letter moves,
reclaiming expired leases, wake-ups. It knows nothing of connections, waiting
gets, message expiry or the wire: the broker (mqd.broker) keeps those.

Every method is a coroutine: a backend whose work blocks (disk syncs, network
round trips) must do it off the event loop, in a worker thread or through an
async client, and should group work that arrives together so that many
writers share one flush. A put or take with a Holder may instead be answered
at once, before it is durable, and the holder told when it is (Pending).
Calls made in order on one event-loop turn must take effect in that order (a
connection's pipelined commands rely on it).

Queue names are `str` decoded from the wire bytes as UTF-8 with
`surrogateescape` (mqd.protocol.name_text), so mqd.protocol.name_bytes(name)
gives back the exact bytes the client sent. Names are data: a backend must store any name the
protocol allows (`..`, `con`, names differing only in case, 250 bytes) safely
and separately.

Over 500 lines: the docstrings here are the whole contract a backend
implements (plugins/README.md), bulk lease calls and their defaults, and the
held answers (Holder, Pending), included.
"""

from __future__ import annotations

import abc
import difflib
import enum
import logging
import secrets
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar, Final, NamedTuple, Protocol, cast

from mypy_extensions import mypyc_attr

from mqd.eager import run_together
from mqd.errors import BackendLoadError
from mqd.message import Message as Message
from mqd.message import QueueSize as QueueSize
from mqd.message import Receipt as Receipt

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "mqd.backends"

#: The methods every backend defines: Backend's abstract ones. Named here as
#: well, because compiled (mqd/native.py) Backend keeps no record of them for
#: abc to refuse a subclass that lacks one; load() checks them instead.
REQUIRED_METHODS: Final = (
    "ack",
    "delete",
    "extend",
    "peek",
    "put",
    "queues",
    "reclaim",
    "release",
    "remove",
    "reserve",
    "size",
    "take",
)


class Capability(enum.StrEnum):
    """Optional abilities a backend declares in `Backend.capabilities`."""

    UNIQUE = "unique"  # put(unique=True), contains() and discard() know bodies
    OFFSET = "offset"  # read_at() finds a message by its offset
    FIFO = "fifo"  # messages come out in the order they went in
    SHARED = "shared"  # several daemons may use the same storage at once


class Sync(enum.StrEnum):
    """How durable a change must be before the call returns."""

    ALWAYS = "always"  # on stable storage before returning (group commit)
    PERIODIC = "periodic"  # flushed within `sync_interval_ms`
    NONE = "none"  # left to the operating system


class Put(enum.Enum):
    """What put() did."""

    STORED = "stored"  # stored; `message.offset` is set
    DUPLICATE = "duplicate"  # unique put of a body already in the queue: nothing stored
    FULL = "full"  # the limits allow no more and nothing may be dropped: nothing stored


#: Put.STORED for the per-command paths: an enum member read off its class
#: costs a class attribute lookup (~50 ns here), a module global does not.
PUT_STORED = Put.STORED


class Later(enum.Enum):
    """What put_now() and take_now() give when they cannot answer at once."""

    LATER = "later"


LATER: Final = Later.LATER


@dataclass(frozen=True, slots=True)
class Limits:
    """A queue's bounds, applied by put() atomically with the write."""

    max_items: int = 0  # 0: no bound; open messages count
    max_bytes: int = 0  # 0: no bound; bodies only, open messages count
    drop_oldest: bool = False  # full: drop the oldest waiting message(s) instead of refusing

    def __bool__(self) -> bool:
        return bool(self.max_items or self.max_bytes)

    def overflow(self, items: int, size: int, adding: int) -> bool:
        """Whether a queue of `items` messages and `size` bytes is full for `adding` more."""
        return bool(
            (self.max_items and items >= self.max_items)
            or (self.max_bytes and size + adding > self.max_bytes)
        )


NO_LIMITS = Limits()

#: The key of redrive()'s result that counts the dead letters it found expired
#: and removed rather than moved: no queue is named "", so it names none.
REDRIVE_EXPIRED: Final = ""


@dataclass(frozen=True, slots=True)
class Lease:
    """What a local backend stores with an open message: the record behind a Receipt."""

    owner: str  # the daemon that holds it
    deadline: float  # Unix time after which reclaim() ends it; 0 = none
    token: int  # this reservation's number, unique across daemons

    def expired(self, now: float) -> bool:
        return 0 < self.deadline <= now

    @classmethod
    def start(cls, owner: str, lease: float, now: float) -> Lease:
        """A new lease of `lease` seconds (0: no deadline) with a fresh token."""
        return cls(owner, now + lease if lease else 0.0, secrets.randbits(63))


class Reclaimed(NamedTuple):
    """A lease that ended: the message went back to `queue`, or on to `moved_to`.

    `message.receipt` still names the lease that ended, so its holder can tell.
    """

    queue: str
    message: Message
    moved_to: str | None  # the dead-letter queue, or None when it was returned


#: Where an open message that comes back goes: the dead-letter queue's name, or
#: None to return it to its queue. Called by reclaim() for each expired lease,
#: with the message's stored delivery count.
Route = Callable[[str, Message], "str | None"]


@dataclass(frozen=True)
class StorageOptions:
    """What the config gives a backend: where to keep files, how often to flush."""

    data_dir: Path = Path("data")
    sync_interval_ms: int = 1000
    extra: dict[str, Any] = field(default_factory=dict)  # the [storage.<name>] table
    config_path: Path | None = None  # the file `extra` came from, for error messages
    owner: str = "local"  # this daemon's id, the owner of the leases it takes
    poll_interval_ms: int = 50  # shared backends: how often a watched queue is polled
    max_disk_bytes: int = (
        0  # disk backends: refuse puts once their files hold this much; 0: no bound
    )


Wake = Callable[[str], None]


def _uncounted(child: str) -> None:
    """Fanout.stored's default: a caller that counts no copies."""


def _not_unique(child: str) -> bool:
    """Fanout.unique's default: copies stored whatever the child holds."""
    return False


@dataclass(frozen=True, slots=True)
class Fanout:
    """What a put to a fanout parent asks the daemon of its children, and tells it.

    `limits(child)` gives a child's limits, and `unique(child)` whether it
    stores a body it already holds (True: not, as put()'s `unique`; asked
    only of a backend with Capability.UNIQUE), both asked before its copy
    is stored; `stored(child)` is told of each copy stored (a full child's
    refused copy and a duplicate are not), on the event loop, before put()
    returns: the daemon counts it in the child's `enqueued`.
    """

    limits: Callable[[str], Limits]
    stored: Callable[[str], None] = _uncounted
    unique: Callable[[str], bool] = _not_unique


class Pending:
    """Answers a backend gave before they were durable: their holders hear when they are.

    A backend that answers from a transaction it commits later (so that every
    answer of a turn of the event loop shares one commit and one sync) makes
    one Pending per such transaction, and ends it once the transaction is
    synced as each call's `sync` asked, or with the error that undid it.
    """

    __slots__ = ("_released",)

    def __init__(self) -> None:
        self._released: list[Callable[[BaseException | None], None]] = []

    def add(self, released: Callable[[BaseException | None], None]) -> None:
        """Call `released` when this ends: with None, or with the error that voided it."""
        self._released.append(released)

    def end(self, error: BaseException | None) -> None:
        released, self._released = self._released, []
        for call in released:
            try:
                call(error)
            except Exception:  # one holder's fault must not keep the others waiting
                log.exception("releasing held answers failed")


class Holder(Protocol):
    """A caller that can hold back what depends on an answer (a connection's replies)."""

    def hold(self, pending: Pending) -> None:
        """Send nothing that depends on answers given from now on until `pending` ends.

        If it ends with an error, those answers are void: their puts were not
        stored, their takes were undone (the messages wait again).
        """


# Compiled (mqd/native.py), so that the backends mqd and its plugins compile are
# native classes too; plugins that are not compiled subclass it all the same.
@mypyc_attr(allow_interpreted_subclasses=True)
class Backend(abc.ABC):
    """Durable storage of queues of messages, and the queue state daemons share.

    A message is either *waiting* (deliverable) or *open*: handed out by
    reserve() under a **lease** that is stored with it (owner daemon, deadline,
    token), until ack() removes it, release() gives it back, or reclaim()
    returns it once the deadline has passed. Everything that decides whether a
    message is delivered, kept or moved lives here, not in a daemon's memory,
    so a backend that declares Capability.SHARED can serve many daemons.

    Calls on a lease take its Receipt and have no effect, returning False,
    when the lease is gone (acknowledged, returned, reclaimed, or the queue
    deleted, even if it was recreated since).
    """

    #: The name the backend is registered under in the `mqd.backends` group.
    name: ClassVar[str] = ""
    #: The optional abilities this backend has.
    capabilities: ClassVar[frozenset[Capability]] = frozenset()
    #: Whether put() and take() may answer a Holder before the answer is durable.
    answers_held: ClassVar[bool] = False
    #: Whether put_now() and take_now() may answer; the broker asks them first
    #: (unless a subclass changed put() or take() alone: asks_now()).
    answers_now: ClassVar[bool] = False
    #: Whether daemons in other processes use the same storage: two of them with
    #: one daemon id would each return the other's open messages as their own,
    #: so the id kept in the data directory is held locked (Config.owner).
    shared_across_processes: ClassVar[bool] = False

    def __init__(self, options: StorageOptions) -> None:
        self.options = options
        self.owner = options.owner
        self._wake: Wake = _ignore

    async def open(self) -> None:
        """Open or create storage. Called once before any other call."""
        return None  # optional hook: nothing to open by default

    async def close(self) -> None:
        """Flush and release everything. No call follows."""
        return None  # optional hook: nothing to release by default

    def descriptors(self) -> int:
        """File descriptors the open backend may open later, at most: kept from connections."""
        return 0

    # -- messages ------------------------------------------------------------

    @abc.abstractmethod
    async def put(
        self,
        queue: str,
        message: Message,
        *,
        sync: Sync,
        unique: bool = False,
        limits: Limits = NO_LIMITS,
        fanout: Fanout | None = None,
        holder: Holder | None = None,
    ) -> Put:
        """Append `message` to `queue`, creating the queue; set `message.offset`.

        With `unique=True` a body already in the queue (waiting or open)
        stores nothing: Put.DUPLICATE. A backend without Capability.UNIQUE is
        never called with it. `limits` are checked and applied in the same
        atomic step as the write, so daemons sharing the store never hold more
        together: when the queue is full, the oldest waiting messages are
        dropped if `limits.drop_oldest` (and Put.FULL is returned only when
        open messages alone fill it), otherwise nothing is stored and the
        result is Put.FULL. A body larger than `limits.max_bytes` is FULL.

        With `fanout`, a message stored in `queue` is also stored, in the same
        atomic step (one group commit), in each of its fanout children that
        exists: the queues named `<queue>+<child>`. Each copy is checked
        against the limits `fanout.limits(child)` gives, and a full child
        refuses or drops for itself, as a child that is `fanout.unique`
        refuses a body it holds; each copy stored is told to
        `fanout.stored(child)`. The result speaks of `queue` alone.

        With a `holder`, a backend may answer before the write is as durable
        as `sync` asks, provided it first calls `holder.hold()` with the
        Pending that says when it is. Backends that answer only once it is
        (or that keep nothing on disk) ignore it.
        """
        raise NotImplementedError("Backend.put")

    @abc.abstractmethod
    async def take(self, queue: str, *, sync: Sync, holder: Holder | None = None) -> Message | None:
        """Remove and return the head waiting message, its `deliveries` raised by one.

        None when the queue is empty or unknown; an unknown queue is not created.
        A `holder` is as for put().
        """
        raise NotImplementedError("Backend.take")

    def put_now(
        self,
        queue: str,
        message: Message,
        sync: Sync,
        unique: bool,
        limits: Limits,
        fanout: Fanout | None,
        holder: Holder,
    ) -> Put | Later:
        """put(), answered at once; LATER if it cannot be.

        The caller then awaits put(). Asked only of backends that answer now
        (answers_now), on the path of every set: a plain call costs less there
        than a coroutine to make, run and end. A backend that answers held
        (answers_held) has its answer held by `holder` as put() would.
        """
        return LATER

    def take_now(self, queue: str, sync: Sync, holder: Holder) -> Message | Later | None:
        """take(), answered at once, its answer held by `holder`; LATER if it cannot be
        (as put_now())."""
        return LATER

    @abc.abstractmethod
    async def reserve(self, queue: str, *, lease: float, sync: Sync) -> Message | None:
        """Open the head waiting message under a lease held by `self.owner`.

        Returns it with its stored `deliveries` raised by one and `receipt`
        set. `lease` is the visibility timeout in seconds: after it, reclaim()
        returns the message; 0 means no deadline (only the owner, or its next
        start, gives it back).
        """
        raise NotImplementedError("Backend.reserve")

    @abc.abstractmethod
    async def ack(self, receipt: Receipt, *, sync: Sync) -> bool:
        """Remove the open message the lease holds. False if the lease is gone."""
        raise NotImplementedError("Backend.ack")

    @abc.abstractmethod
    async def release(self, receipt: Receipt, *, sync: Sync, to: str | None = None) -> bool:
        """End the lease: the message waits again, ahead of every newer message.

        With `to`, the message moves to that (dead-letter) queue instead, as
        one atomic step, with `origin` set to its queue and its delivery count
        kept. False, and nothing moves, if the lease is gone.
        """
        raise NotImplementedError("Backend.release")

    @abc.abstractmethod
    async def extend(self, receipt: Receipt, *, lease: float, sync: Sync) -> bool:
        """Move the lease's deadline to `lease` seconds from now. False if it is gone."""
        raise NotImplementedError("Backend.extend")

    # -- leases in bulk ------------------------------------------------------
    #
    # What a named lease does to many messages at once, as one call. Each has
    # the effect of the single call once per message, in order, and a backend
    # that commits in groups commits one call in one group (one sync for
    # Sync.ALWAYS). The defaults below make the single calls; a backend
    # overrides them when it can do many for less than many times one.

    async def reserve_many(
        self, queue: str, count: int, *, lease: float, sync: Sync, max_bytes: int = 0
    ) -> list[Message]:
        """Open up to `count` head waiting messages, one after another, as reserve() would.

        Each comes back as reserve() returns it: its stored `deliveries`
        raised by one and a `receipt` of its own, held by `self.owner` for
        `lease` seconds (0: no deadline); in the order they were opened (id
        order on a FIFO backend). Fewer than `count` when the queue has no
        more waiting, or once the bodies opened by this call add up to
        `max_bytes` or more (0: no bound): the message that reaches it is the
        last, so one message is always opened if there is one. Expired
        messages are opened like any other (what to do with them is the
        caller's business). An unknown queue gives [] and is not created.

        An error raised means nothing was opened: one met after some were
        opened ends the call with those (the next call meets it again).

        The default calls reserve() once per message, each after the last
        returned, which is what makes the `max_bytes` stop exact.
        """
        opened: list[Message] = []
        size = 0
        while len(opened) < count and not (max_bytes and size >= max_bytes):
            try:
                message = await self.reserve(queue, lease=lease, sync=sync)
            except Exception:
                if not opened:
                    raise
                break  # those opened must reach the caller, or they stay open unseen
            if message is None:
                break
            opened.append(message)
            size += len(message.body)
        return opened

    async def ack_many(self, receipts: Sequence[Receipt], *, sync: Sync) -> list[bool]:
        """ack() each receipt, in order: for each, whether its message was removed.

        False for a lease that is gone, as ack() answers. An error raised
        leaves it unknown which of them took effect (a backend that commits
        the call in one transaction applies all or none); each may be tried
        again, and is False if it had.
        """
        return await _together([self.ack(r, sync=sync) for r in receipts])

    async def release_many(
        self, receipts: Sequence[Receipt], *, sync: Sync, to: Sequence[str | None] = ()
    ) -> list[bool]:
        """release() each receipt, in order, to the dead-letter queue `to[i]` (None: back).

        An empty `to` returns every message to its queue. Each message waits
        again ahead of every newer one (so a lease given back in id order
        comes back in id order), or moves to its dead-letter queue as one
        atomic step. For each, whether its lease was still held; an error
        raised leaves it unknown which took effect, as with ack_many().
        """
        ends = to or [None] * len(receipts)
        calls = [self.release(r, sync=sync, to=d) for r, d in zip(receipts, ends, strict=True)]
        return await _together(calls)

    async def extend_many(
        self, receipts: Sequence[Receipt], *, lease: float, sync: Sync
    ) -> list[bool]:
        """extend() each receipt's lease to `lease` seconds from now: whether each is held."""
        return await _together([self.extend(r, lease=lease, sync=sync) for r in receipts])

    @abc.abstractmethod
    async def reclaim(
        self, route: Route, *, sync: Sync, owner: str | None = None
    ) -> list[Reclaimed]:
        """End every lease whose deadline has passed, and with `owner` every lease it holds.

        Each message goes back to its queue ahead of newer ones, or to the
        dead-letter queue `route` names, exactly once even when several daemons
        reclaim at the same moment. A daemon calls it with its own id when it
        starts (its leases from before are returned at once, other daemons'
        live leases are left alone); shared backends are reclaimed periodically.
        """
        raise NotImplementedError("Backend.reclaim")

    @abc.abstractmethod
    async def remove(self, queue: str, offset: int, *, sync: Sync) -> bool:
        """Remove the waiting message at `offset` (an expired one). False if not waiting there."""
        raise NotImplementedError("Backend.remove")

    @abc.abstractmethod
    async def peek(self, queue: str) -> Message | None:
        """The head waiting message, left in place; None when there is none."""
        raise NotImplementedError("Backend.peek")

    async def read_at(self, queue: str, offset: int) -> Message | None:
        """The message at `offset`, waiting or open, left in place (Capability.OFFSET)."""
        raise NotImplementedError("Backend.read_at")

    async def read_range(
        self, queue: str, first: int, count: int, max_bytes: int = 0
    ) -> list[Message]:
        """The messages at offsets first..first+count-1, waiting or open, in offset order,
        left in place (Capability.OFFSET).

        With `max_bytes`, the list ends with the message that brings its bodies
        to `max_bytes` or more. This default reads each offset in turn; a
        backend that can read a range at once overrides it.
        """
        found: list[Message] = []
        size = 0
        for offset in range(first, first + count):
            message = await self.read_at(queue, offset)
            if message is not None:
                found.append(message)
                size += len(message.body)
                if max_bytes and size >= max_bytes:
                    break
        return found

    async def contains(self, queue: str, body: bytes) -> bool:
        """Whether a message with this body is in the queue, waiting or open (UNIQUE)."""
        raise NotImplementedError("Backend.contains")

    async def discard(self, queue: str, body: bytes, *, sync: Sync) -> int:
        """Remove the waiting messages with this body; how many (Capability.UNIQUE)."""
        raise NotImplementedError("Backend.discard")

    # -- queues --------------------------------------------------------------

    async def create(self, queue: str, *, sync: Sync) -> bool:
        """Make `queue` exist, empty, if it does not: a fanout child comes into being so.

        True when it was made now.
        """
        raise NotImplementedError("Backend.create")

    async def redrive(self, dead: str, *, to: str | None, limit: int, sync: Sync) -> dict[str, int]:
        """Move up to `limit` waiting messages out of the dead-letter queue `dead`, oldest first.

        Each goes to `to`, or with `to` None to the queue it died in
        (`origin`; a message with none stays), with its delivery count back at
        0 and no origin. Each message moves exactly once, also when several
        daemons redrive the same queue at once. Returns how many went where.
        A message that has expired is removed instead, never moved (it would
        never be delivered), and counted under REDRIVE_EXPIRED, outside `limit`.
        """
        raise NotImplementedError("Backend.redrive")

    async def expire_idle(self, queue: str, *, before: float, sync: Sync) -> bool:
        """Delete `queue` if it is empty, has no open message, and no message was stored
        or moved into it since `before` (Unix time), in one atomic step; True if deleted.
        """
        raise NotImplementedError("Backend.expire_idle")

    @abc.abstractmethod
    async def delete(self, queue: str, *, sync: Sync) -> bool:
        """Remove the queue, every message and lease in it, and its storage. False if unknown.

        Offsets start again from 0 when the queue is next created, in a new
        incarnation: receipts from before match nothing.
        """
        raise NotImplementedError("Backend.delete")

    async def flush_all(self, *, sync: Sync) -> None:
        """Delete every queue."""
        for queue in await self.queues():
            await self.delete(queue, sync=sync)

    @abc.abstractmethod
    async def queues(self) -> list[str]:
        """Every queue that exists (emptied queues included)."""
        raise NotImplementedError("Backend.queues")

    @abc.abstractmethod
    async def size(self, queue: str) -> QueueSize | None:
        """The queue's gauges, global across daemons; None when it does not exist."""
        raise NotImplementedError("Backend.size")

    async def sizes(self) -> dict[str, QueueSize]:
        """Every queue's gauges; a remote backend answers in one round trip if it can."""
        found: dict[str, QueueSize] = {}
        for queue in await self.queues():
            size = await self.size(queue)
            if size is not None:
                found[queue] = size
        return found

    # -- wake-ups ------------------------------------------------------------

    def listen(self, wake: Wake) -> None:
        """Register the callback the broker is woken by.

        The backend calls `wake(queue)` on the event loop when a message may
        have arrived in `queue` through someone else: another daemon, or
        another handle on the same store. (The broker wakes its own waiters
        for what it stores itself.) A local backend calls it at once; a shared
        one within its poll interval for every watched queue.
        """
        self._wake = wake

    def watch(self, queue: str, on: bool) -> None:
        """Gets are now waiting on `queue` (`on`), or no longer: what a poller polls."""
        return None  # optional hook: a backend that pushes wake-ups needs no list


def asks_now(backend: Backend) -> bool:
    """Whether the broker asks `backend`'s put_now() and take_now() first.

    When its class answers now, and neither put() nor take() was changed
    below the class that defines the plain call standing for it: a subclass
    that changes put() alone (one that refuses, holds or counts) is asked
    put(), not the put_now() it inherited, without having to say so.
    """
    cls = type(backend)
    return backend.answers_now and all(
        issubclass(_defined_in(cls, now), _defined_in(cls, later))
        for now, later in (("put_now", "put"), ("take_now", "take"))
    )


def _defined_in(cls: type, method: str) -> type:
    """The class, of `cls` and those it derives from, whose `method` it has."""
    return next(c for c in cls.__mro__ if method in vars(c))


def _ignore(queue: str) -> None:
    return None


async def _together(calls: list[Coroutine[Any, Any, bool]]) -> list[bool]:
    """run_together(calls), with the first error raised."""
    results = await run_together(calls)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return cast(list[bool], results)  # no errors among them: checked above


def available() -> dict[str, metadata.EntryPoint]:
    """Every registered backend entry point, by name."""
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def load(name: str) -> type[Backend]:
    """The backend class registered as `name`, or a BackendLoadError that says why not."""
    points = available()
    point = points.get(name)
    if point is None:
        close = difflib.get_close_matches(name, list(points), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        known = ", ".join(sorted(points)) or "none"
        raise BackendLoadError(f"unknown backend {name!r} (installed: {known}){hint}")
    dist = point.dist.name if point.dist else "unknown distribution"
    try:
        cls = point.load()
    except Exception as exc:
        raise BackendLoadError(
            f"backend {name!r} from {dist} failed to load: {type(exc).__name__}: {exc}"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise BackendLoadError(f"backend {name!r} from {dist} is not an mqd.backend.Backend")
    missing = [m for m in REQUIRED_METHODS if getattr(cls, m) is getattr(Backend, m)]
    if missing:
        raise BackendLoadError(
            f"backend {name!r} from {dist} does not define {', '.join(missing)}"
            " (mqd.backend.Backend: every backend does)"
        )
    return cls
