"""The storage boundary: what a backend is, and how backends are found.

A backend stores messages and hands them back; it knows nothing of connections,
waiting, expiry or the wire. The broker (mqd.broker) builds queue semantics on
top of the few calls below. Every method is a coroutine: a backend whose work
blocks (disk syncs, network round trips) must do it off the event loop, in a
worker thread or through an async client, and should group work that arrives
together so that many writers share one flush.

Queue names are `str` decoded from the wire bytes as UTF-8 with
`surrogateescape` (name_text), so name_bytes(name) gives back the exact bytes
the client sent. Names are data: a backend must store any name the
protocol allows (`..`, `con`, names differing only in case, 250 bytes) safely
and separately.
"""

from __future__ import annotations

import abc
import difflib
import enum
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar

from mqd.errors import BackendLoadError

ENTRY_POINT_GROUP = "mqd.backends"


def name_bytes(name: str) -> bytes:
    """The exact wire bytes of a queue name."""
    return name.encode("utf-8", "surrogateescape")


def name_text(raw: bytes) -> str:
    """The queue name for wire bytes: the inverse of name_bytes."""
    return raw.decode("utf-8", "surrogateescape")


class Capability(enum.StrEnum):
    """Optional abilities a backend declares in `Backend.capabilities`."""

    UNIQUE = "unique"  # put(unique=True) refuses a body already in the queue
    OFFSET = "offset"  # read_at() finds a message by its offset
    FIFO = "fifo"  # messages come out in the order they went in
    SHARED = "shared"  # several daemons may use the same storage at once


class Sync(enum.StrEnum):
    """How durable a change must be before the call returns."""

    ALWAYS = "always"  # on stable storage before returning (group commit)
    PERIODIC = "periodic"  # flushed within `sync_interval_ms`
    NONE = "none"  # left to the operating system


@dataclass(slots=True)
class Message:
    """One message. `offset` is assigned by the backend when it is stored."""

    body: bytes
    flags: int = 0
    expires: float = 0  # Unix time after which it is never delivered; 0 = never
    created: float = 0  # Unix time it was enqueued (for the head's age in stats)
    offset: int = -1  # unique within the queue's life, never reused
    deliveries: int = 0  # hand-outs so far, counted by take() and reserve()


@dataclass(frozen=True, slots=True)
class QueueSize:
    """A queue's gauges. `items` and `bytes` include open (reserved) messages."""

    items: int
    bytes: int
    open: int
    head_created: float = 0  # `created` of the oldest message, 0 when empty


@dataclass(frozen=True)
class StorageOptions:
    """What the config gives a backend: where to keep files, how often to flush."""

    data_dir: Path = Path("data")
    sync_interval_ms: int = 1000
    extra: dict[str, Any] = field(default_factory=dict)  # the [storage.<name>] table
    config_path: Path | None = None  # the file `extra` came from, for error messages


class Backend(abc.ABC):
    """Durable storage of queues of messages.

    A message is either *waiting* (deliverable) or *reserved* (handed out by
    reserve(), awaiting remove() or release()). Reservations are stored, so a
    restart or crash makes them deliverable again (see recover()).
    """

    #: The name the backend is registered under in the `mqd.backends` group.
    name: ClassVar[str] = ""
    #: The optional abilities this backend has.
    capabilities: ClassVar[frozenset[Capability]] = frozenset()

    def __init__(self, options: StorageOptions) -> None:
        self.options = options

    async def open(self) -> None:
        """Open or create storage. Called once before any other call."""
        return None  # optional hook: nothing to open by default

    async def close(self) -> None:
        """Flush and release everything. No call follows."""
        return None  # optional hook: nothing to release by default

    async def recover(self) -> list[tuple[str, Message]]:
        """Messages that were reserved when the storage was last closed or crashed.

        Called once after open(). The broker decides, for each one, whether it is
        released or moved to a dead-letter queue; until then it stays reserved.
        """
        return []

    @abc.abstractmethod
    async def put(self, queue: str, message: Message, *, unique: bool, sync: Sync) -> int | None:
        """Append `message` to `queue` (creating the queue) and return its new offset.

        Sets `message.offset`. With `unique=True`, a body already in the queue
        (waiting or reserved) stores nothing and the call returns None; a backend
        without Capability.UNIQUE is never called with `unique=True`.
        """
        raise NotImplementedError("Backend.put")

    @abc.abstractmethod
    async def take(self, queue: str, *, sync: Sync) -> Message | None:
        """Remove and return the head waiting message, its `deliveries` raised by one.

        None when the queue is empty or unknown; an unknown queue is not created.
        """
        raise NotImplementedError("Backend.take")

    @abc.abstractmethod
    async def reserve(self, queue: str, *, lease: float, sync: Sync) -> Message | None:
        """Reserve and return the head waiting message, its stored `deliveries` raised by one.

        `lease` is the visibility timeout in seconds (0: none); a shared backend
        stores it so other daemons can return the message if this one dies.
        """
        raise NotImplementedError("Backend.reserve")

    @abc.abstractmethod
    async def remove(self, queue: str, offset: int, *, sync: Sync) -> bool:
        """Remove the message at `offset`, waiting or reserved. False if it is not there."""
        raise NotImplementedError("Backend.remove")

    @abc.abstractmethod
    async def release(self, queue: str, offset: int, *, sync: Sync) -> bool:
        """Make a reserved message waiting again, ahead of every newer message.

        False if no reserved message has that offset.
        """
        raise NotImplementedError("Backend.release")

    @abc.abstractmethod
    async def peek(self, queue: str) -> Message | None:
        """The head waiting message, left in place; None when there is none."""
        raise NotImplementedError("Backend.peek")

    async def read_at(self, queue: str, offset: int) -> Message | None:
        """The message at `offset`, waiting or reserved, left in place (Capability.OFFSET)."""
        raise NotImplementedError("Backend.read_at")

    @abc.abstractmethod
    async def delete(self, queue: str, *, sync: Sync) -> bool:
        """Remove the queue, every message in it and its storage. False if unknown.

        Offsets start again from 0 when the queue is next created.
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
        """The queue's gauges, or None when it does not exist."""
        raise NotImplementedError("Backend.size")


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
    return cls
