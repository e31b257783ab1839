"""What belongs to a connection and to this daemon, over one backend.

The broker turns parsed commands into backend calls and returns plain data
(each wire renders its own replies): which open messages a connection holds
and their visibility timers, waiting gets, message expiry on read, per-queue
settings, and the counters behind `stats`. Everything several daemons sharing
a store must agree on (leases, limits, dead-letter moves, reclaiming expired
leases) is the backend's: the broker only asks. It never touches sockets; the
server hands it a `Session` per connection.

It is longer than most modules here (under 1,000 lines) because the options of
a `get` (wait, open, close, abort, peek, at, several keys, named leases) and
the records of open messages they act on are one piece of logic; the figures
of `stats` live in mqd.stats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, Final, TypeVar, cast

from mqd import protocol, stats
from mqd.backend import (
    LATER,
    NO_LIMITS,
    PUT_STORED,
    REDRIVE_EXPIRED,
    Backend,
    Capability,
    Fanout,
    Holder,
    Limits,
    Message,
    Put,
    QueueSize,
    Receipt,
    Reclaimed,
    Sync,
    asks_now,
)
from mqd.config import Config, QueueSettings
from mqd.eager import run_together
from mqd.errors import ClientError, NotSupported, ServerError, StorageError, UnknownCommand
from mqd.protocol import Key, Retrieve, Store, fanout_parent
from mqd.stats import Counters

log = logging.getLogger(__name__)

IDLE_SWEEP: Final = 1.0  # seconds between looks for idle queues to expire
QUEUE_STATES: Final = 65536  # queues whose state is kept when idle (names are client-chosen)
THIRTY_DAYS: Final = 60 * 60 * 24 * 30  # memcached: larger exptimes are absolute Unix times
# Bodies a named lease reserves, or a range read returns, at most (and the
# message that passes it).
LEASE_BYTES: Final = 64 << 20
# Messages a named lease asks the store for in one reserve_many() call: one
# group commit each, and a bound on how long one call holds a store that
# serves everyone in turn (a Berkeley DB worker).
RESERVE_BATCH: Final = 1024
# A named lease's messages are kept in the store for a quarter more than the
# visibility timeout, and their store deadlines renewed only when a quarter of
# it has passed since the last renewal: a lease touched often costs one round
# of extend() calls per quarter timeout, not one per command, and the store
# never returns a message before this daemon's own timer would.
LEASE_SLACK: Final = 1.25

Hits = list[tuple[Key, Message]]
T = TypeVar("T")


class Session:
    """A connection as the broker sees it: its open messages and a way to flush replies."""

    __slots__ = ("closing", "flush", "gone", "open", "waiter")

    def __init__(
        self, flush: Callable[[], None] = lambda: None, closing: Callable[[], bool] = lambda: False
    ) -> None:
        self.flush = flush  # sends the replies so far, before the broker waits
        # Whether the connection is closing: lost (a reset) in the same turn
        # as the set that woke its get, before the broker heard of it.
        self.closing = closing
        self.open: dict[str, Opened] = {}
        self.waiter: asyncio.Future[str | None] | None = None  # set while a get waits
        # The client sent its end of file, or the connection is lost: no get
        # waits for it any more, nor takes what woke it (end_waits).
        self.gone = False


@dataclass(eq=False)
class Opened:
    """An open message this daemon handed out, and the receipt of its lease."""

    queue: str
    message: Message
    receipt: Receipt  # kept apart: a backend may hand the same Message out again later
    session: Session | None
    timer: asyncio.TimerHandle | None = None


class NamedLease:
    """Messages of one queue reserved under a name, held by no connection.

    Anyone who knows the name acknowledges or gives them back. One timer
    serves the whole lease: every command naming it restarts its visibility
    timeout (`timeout`, or the queue's). Commands on one lease run one at a time (`lock`).
    Its messages need no Opened record each: no connection, no timer of
    their own; each is held with the receipt it was reserved under (kept
    apart: a backend may hand the same Message out again later).
    """

    __slots__ = ("bytes", "held", "lock", "name", "queue", "renewed", "timeout", "timer")

    def __init__(self, queue: str, name: str) -> None:
        self.queue = queue
        self.name = name
        self.held: dict[int, tuple[Message, Receipt]] = {}  # by offset, in the order reserved
        self.bytes = 0  # bodies of `held`
        self.lock = asyncio.Lock()
        self.timer: asyncio.TimerHandle | None = None
        self.renewed = time.monotonic()  # when the store's deadlines were last moved
        self.timeout = 0.0  # seconds, from `/visibility=`; 0: the queue's visibility_timeout

    def drop(self, offset: int) -> None:
        """No longer hold the message at `offset` (if held)."""
        entry = self.held.pop(offset, None)
        if entry is not None:
            self.bytes -= len(entry[0].body)


class QueueState:
    """This daemon's view of one queue: settings, counters, waiting gets, open messages."""

    __slots__ = (
        "dequeued",
        "enqueued",
        "expired",
        "leases",
        "limits",
        "max_item_size",
        "opened",
        "settings",
        "sync",
        "unique",
        "used",
        "waiters",
    )

    def __init__(self, settings: QueueSettings) -> None:
        self.configure(settings)
        self.used = time.monotonic()  # last command naming the queue, for idle expiry
        self.enqueued = 0
        self.dequeued = 0
        self.expired = 0
        self.waiters: deque[asyncio.Future[str | None]] = deque()
        self.opened: dict[int, Opened] = {}  # by offset: `/open` ones (leases hold their own)
        self.leases: dict[str, NamedLease] = {}  # by name

    def configure(self, settings: QueueSettings) -> None:
        self.settings = settings
        # What every set and get reads, as fields of this (compiled) class:
        # read from the settings, each would be a dictionary lookup.
        self.sync = settings.sync
        self.unique = settings.unique
        self.max_item_size = settings.max_item_size
        limits = Limits(settings.max_items, settings.max_bytes, settings.overflow == "drop_oldest")
        # The shared instance when unbounded: a backend can tell by identity, no call.
        self.limits = limits if limits else NO_LIMITS

    def idle(self) -> bool:
        """Nothing here that forgetting would lose but counters."""
        return not self.waiters and not self.opened and not self.leases


def expiry(exptime: int, now: float) -> float | None:
    """memcached's exptime rule as an absolute time: 0 never; None if already expired."""
    if exptime == 0:
        return 0.0
    if exptime < 0:
        return None
    expires = now + exptime if exptime <= THIRTY_DAYS else float(exptime)
    return expires if expires > now else None


class Broker:
    """Queue semantics over one backend."""

    def __init__(self, backend: Backend, config: Config) -> None:
        self.backend = backend
        self.config = config
        self.started = time.time()
        self.counters = Counters()
        self.curr_connections = 0
        self._queues: dict[str, QueueState] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._unique = Capability.UNIQUE in backend.capabilities
        self._shared = Capability.SHARED in backend.capabilities
        self._loops: list[asyncio.Task[None]] = []  # periodic work, cancelled at stop
        self._pending_flush: asyncio.TimerHandle | None = None
        # One, not one per set.
        self._fanout = Fanout(self._child_limits, self._child_stored, self._child_unique)
        # The fanout children a get waits on, by parent: a set to the parent
        # copies its message into them, which no one else announces here.
        self._waiting_children: dict[str, set[str]] = {}
        # Whether a held set or get is asked of put_now() or take_now() first.
        self._ask_now = asks_now(backend)
        # Whether commands stamp QueueState.used: only idle expiry reads it,
        # and a clock read per command is a measurable part of its cost.
        self._stamp = config.idle_expiry_used
        self.stopping = False

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        """Open the backend and return the leases this daemon held when it last stopped."""
        self.backend.owner = self.config.owner(exclusive=self.backend.shared_across_processes)
        await self.backend.open()
        self.backend.listen(self._arrived)
        returned = await self.backend.reclaim(
            self._route, sync=Sync.ALWAYS, owner=self.backend.owner
        )
        self._reclaimed(returned)
        if returned:
            log.info("returned %d message(s) left open by the last run", len(returned))
        if self._shared:
            self._spawn_loop(self._reclaim_periodically())
        self._spawn_loop(self._expire_idle_periodically())

    def begin_stop(self) -> None:
        """End every wait now: waiting gets answer with what they have."""
        self.stopping = True
        for state in self._queues.values():
            for waiter in state.waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def stop(self) -> None:
        """Give back every open message, then close the backend."""
        self.begin_stop()
        for loop in self._loops:
            loop.cancel()
        if self._pending_flush is not None:
            self._pending_flush.cancel()
        calls = []
        for state in list(self._queues.values()):
            calls += [self._give_back(o) for o in sorted(state.opened.values(), key=_offset)]
            calls += [self._end_lease(state, lease) for lease in list(state.leases.values())]
        # Together: a store that commits in groups returns them in a few commits.
        for failed in await self._together(calls):
            if isinstance(failed, Exception):
                log.error("giving back an open message failed", exc_info=failed)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.backend.close()

    def reconfigure(self, config: Config) -> None:
        """Apply new per-queue settings (SIGHUP)."""
        self.config = config
        now = time.monotonic()
        stamped, self._stamp = self._stamp, config.idle_expiry_used
        for name, state in self._queues.items():
            state.configure(config.queue_settings(name))
            if not stamped:
                state.used = now  # not stamped until now: idle from here on

    def state(self, queue: str) -> QueueState:
        """The queue's state, made on first use."""
        try:
            return self._queues[queue]
        except KeyError:
            if len(self._queues) >= QUEUE_STATES:
                self._forget_idle()
            state = self._queues[queue] = QueueState(self.config.queue_settings(queue))
            return state

    def settings(self, queue: str) -> QueueSettings:
        return self.state(queue).settings

    def _forget_idle(self) -> None:
        """Keep the per-queue table bounded: drop idle queues, those without counts first."""
        quiet = [n for n, s in self._queues.items() if s.idle()]
        silent = [n for n in quiet if not (s := self._queues[n]).enqueued and not s.dequeued]
        for name in silent or quiet:
            del self._queues[name]

    # -- enqueue -----------------------------------------------------------

    async def store(self, command: Store, holder: Holder | None = None) -> Put:
        """`set` or `add`: what the backend did with the message (`holder`: Backend.put's)."""
        self.counters.cmd_set += 1
        queue = command.queue
        state = self._queues.get(queue) or self.state(queue)
        if self._stamp:
            state.used = time.monotonic()
        unique = command.add or state.unique
        if unique and not self._unique:
            raise NotSupported("add" if command.add else "unique", self.backend.name)
        if len(command.body) > state.max_item_size:
            raise ServerError(protocol.TOO_LARGE)
        now = time.time()
        expires = expiry(command.exptime, now) if command.exptime else 0.0
        if expires is None:
            return Put.STORED  # already expired: stored as nothing, as memcached does
        message = Message(command.body, command.flags, expires, now)
        result = (
            self.backend.put_now(
                queue, message, state.sync, unique, state.limits, self._fanout, holder
            )
            if holder is not None and self._ask_now
            else LATER
        )
        if result is LATER:
            result = await self.backend.put(
                queue,
                message,
                sync=state.sync,
                unique=unique,
                limits=state.limits,
                fanout=self._fanout,
                holder=holder,
            )
        if result is PUT_STORED:
            state.enqueued += 1
            if state.waiters:
                self._wake(state, queue)
            if self._waiting_children and queue in self._waiting_children:
                # Woken in vain when a full child refused its copy: it waits again.
                for child in list(self._waiting_children[queue]):
                    self._wake_queue(child)
        return result

    # -- dequeue -----------------------------------------------------------

    async def retrieve(
        self, command: Retrieve, session: Session, holder: Holder | None = None
    ) -> Hits:
        """`get` or `gets`, with every option and multiple keys: the values, in key order.

        `holder`: as for take(), for the takes of a get of several keys
        (they then share one commit instead of one each). A plain one-key
        get takes the fast path without it: the connection that wants its
        answer held calls take() itself.
        """
        keys = command.keys
        if len(keys) == 1 and keys[0].plain:
            # `get <queue>`: what most consumers send, without the general machinery.
            message = await self.take(keys[0].queue)
            return [] if message is None else [(keys[0], message)]
        if keys[0].alone:  # the parser lets a lease's or a range's key stand alone
            if keys[0].lease is not None:
                return await self._lease_retrieve(keys[0], session)
            return await self._read_range(keys[0])
        self._check_keys(keys, session)
        self.counters.cmd_get += len(keys)
        loop = asyncio.get_running_loop()
        start = loop.time()
        hits: Hits = []
        try:
            await self._pass(keys, session, hits, holder, first=True)
            waits = [k for k in keys if k.wait_ms]
            while not hits and waits and not self.stopping:
                now = loop.time()
                live = [k for k in waits if start + self._wait_of(k) > now]
                if not live:
                    break
                deadline = max(start + self._wait_of(k) for k in live)
                if not await self._wait([k.queue for k in live], deadline - now, session):
                    break
                await self._pass(live, session, hits, holder, first=False)
        except Exception:
            if not hits:
                raise
            # Messages already taken must reach the client: answer with them.
            log.exception("get failed after %d value(s); sending those", len(hits))
        self.counters.get_hits += len(hits)
        self.counters.get_misses += len(keys) - len(hits)
        return hits

    async def take_first(
        self, queues: list[str], timeout: float, session: Session
    ) -> tuple[str, Message] | None:
        """One message from the first of `queues` that has one, waiting up to `timeout` s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(timeout, self.config.max_wait)
        while True:
            for queue in queues:
                message = await self.take(queue)
                if message is not None:
                    return queue, message
            left = deadline - loop.time()
            if left <= 0 or self.stopping or not await self._wait(queues, left, session):
                return None

    def _wait_of(self, key: Key) -> float:
        return min((key.wait_ms or 0) / 1000, self.config.max_wait)

    def _check_keys(self, keys: list[Key], session: Session) -> None:
        """Refuse, before any key runs, a command that would open a second message.

        Keys run in order: one that closes or gives back a queue's open message
        (`/close`, `/abort`) lets a later key of the same command open again.
        """
        opening: set[str] = set()  # queues a key before opens
        ended: set[str] = set()  # queues whose open message a key before ends
        for key in keys:
            if key.at is not None and Capability.OFFSET not in self.backend.capabilities:
                raise NotSupported("at", self.backend.name)
            queue = key.queue
            if key.open:
                # /close/open acknowledges first, so only a bare /open clashes.
                held = queue in session.open and not key.close and queue not in ended
                if held or queue in opening:
                    raise ClientError("transaction already open")
                opening.add(queue)
            elif key.close or key.abort:
                opening.discard(queue)
                ended.add(queue)

    async def _pass(
        self,
        keys: Iterable[Key],
        session: Session,
        hits: Hits,
        holder: Holder | None,
        *,
        first: bool,
    ) -> None:
        """Serve each key once, adding what was found to `hits`."""
        for key in keys:
            message = await self._serve(key, session, holder, first)
            if message is not None:
                hits.append((key, message))

    async def _serve(
        self, key: Key, session: Session, holder: Holder | None, first: bool
    ) -> Message | None:
        queue = key.queue
        state = self.state(queue)
        if self._stamp:
            state.used = time.monotonic()
        if first:
            # Acknowledgements and aborts happen once, not again after a wait.
            if key.close:
                await self._close(session, queue)
                if not key.open:
                    return None
            if key.abort:
                opened = session.open.get(queue)
                if opened is not None:
                    await self._give_back(opened)
                return None
        if key.at is not None:
            message = await self.backend.read_at(queue, key.at)
            if message is None:
                await self._named(queue)
            return message if message is not None and not _expired(message) else None
        if key.peek:
            return await self._peek(queue)
        if key.open:
            return await self._open(queue, session)
        return await self.take(queue, counted=False, holder=holder)

    def _child_limits(self, child: str) -> Limits:
        """A fanout child's limits: its own settings, by its own name."""
        return self.state(child).limits

    def _child_unique(self, child: str) -> bool:
        """Whether a fanout child keeps one copy of a body (`unique = true` in its settings)."""
        return self.state(child).unique

    def _child_stored(self, child: str) -> None:
        """A fanout child stored its copy of a message set to its parent."""
        self.state(child).enqueued += 1

    async def take(
        self, queue: str, *, counted: bool = True, holder: Holder | None = None
    ) -> Message | None:
        """The head message of `queue`, or None: a plain `get <queue>`, counted as one get.

        Not `counted`: a key of a larger get, which counts its keys itself.
        `holder`: as for Backend.take.
        """
        counters = self.counters
        if counted:
            counters.cmd_get += 1
        state = self._queues.get(queue) or self.state(queue)
        if self._stamp:
            state.used = time.monotonic()
        while True:
            message = (
                self.backend.take_now(queue, state.sync, holder)
                if holder is not None and self._ask_now
                else LATER
            )
            if message is LATER:
                message = await self.backend.take(queue, sync=state.sync, holder=holder)
            if message is None:
                if "+" in queue:  # _named()'s test, inline: an empty get is common
                    await self._named(queue)
                break
            if message.expires and message.expires <= time.time():  # _expired, inline
                state.expired += 1
                continue
            state.dequeued += 1
            break
        if counted:
            if message is None:
                counters.get_misses += 1
            else:
                counters.get_hits += 1
        return message

    async def _named(self, queue: str) -> None:
        """A read of `queue` found nothing there. A fanout child comes into being the
        first time a client names it, whatever the read: plain, `/open`, `/peek`,
        `/at`, a range or a lease (a consumer that only opens must get copies too)."""
        if "+" in queue:
            await self.backend.create(queue, sync=self.state(queue).sync)

    async def _read_range(self, key: Key) -> Hits:
        """`gets <queue>/at=<id>/n=<count>`: the messages at ids id..id+count-1, left in place."""
        assert key.at is not None
        if Capability.OFFSET not in self.backend.capabilities:
            raise NotSupported("at", self.backend.name)
        if self._stamp:  # a queue read by range is in use: not idle (idle_expiry)
            self.state(key.queue).used = time.monotonic()
        self.counters.cmd_get += 1
        found = await self.backend.read_range(key.queue, key.at, key.count, LEASE_BYTES)
        hits = [(key, message) for message in found if not _expired(message)]
        if hits:
            self.counters.get_hits += 1
        else:
            self.counters.get_misses += 1
            await self._named(key.queue)
        return hits

    async def _peek(self, queue: str) -> Message | None:
        state = self.state(queue)
        while True:
            message = await self.backend.peek(queue)
            if message is None:
                await self._named(queue)
                return None
            if not _expired(message):
                return message
            if await self.backend.remove(queue, message.offset, sync=state.sync):
                state.expired += 1

    async def _open(self, queue: str, session: Session) -> Message | None:
        state = self.state(queue)
        settings = state.settings
        while True:
            message = await self.backend.reserve(
                queue, lease=settings.visibility_timeout, sync=settings.sync
            )
            if message is None:
                await self._named(queue)
                return None
            if not _expired(message):
                break
            assert message.receipt is not None
            if await self.backend.ack(message.receipt, sync=settings.sync):
                state.expired += 1
        assert message.receipt is not None
        opened = Opened(queue, message, message.receipt, session)
        session.open[queue] = opened
        state.opened[message.offset] = opened
        if settings.visibility_timeout:
            loop = asyncio.get_running_loop()
            opened.timer = loop.call_later(settings.visibility_timeout, self._timed_out, opened)
        return message

    async def _close(self, session: Session, queue: str) -> None:
        opened = session.open.get(queue)
        if opened is not None:
            await self._ack(opened)

    async def _ack(self, opened: Opened) -> bool:
        """Remove an open message of ours for good; False if its lease was lost."""
        self._forget(opened)
        state = self.state(opened.queue)
        # False: the lease was lost (timed out and returned, or the queue
        # deleted); the message is someone else's now and stays.
        if await self.backend.ack(opened.receipt, sync=state.sync):
            state.dequeued += 1
            return True
        return False

    def _forget(self, opened: Opened) -> None:
        """Drop the broker's record of an open message (not the message)."""
        if opened.timer is not None:
            opened.timer.cancel()
        session = opened.session
        if session is not None and session.open.get(opened.queue) is opened:
            del session.open[opened.queue]
        state = self._queues.get(opened.queue)
        offset = opened.message.offset
        if state is not None and state.opened.get(offset) is opened:
            del state.opened[offset]

    def _route(self, queue: str, message: Message) -> str | None:
        """Where an open message that comes back goes: its dead-letter queue, or None."""
        settings = self.settings(queue)
        if settings.max_deliveries and message.deliveries >= settings.max_deliveries:
            # One that has expired goes back, where the next take drops it, counted
            # as expired: a dead letter is kept to be looked at or redriven.
            return None if _expired(message) else settings.dead_letter_for(queue)
        return None

    async def _give_back(self, opened: Opened) -> None:
        """An open message of ours comes back: to its queue, or to the dead letters."""
        self._forget(opened)
        queue, message = opened.queue, opened.message
        to = self._route(queue, message)
        if await self.backend.release(opened.receipt, sync=self.settings(queue).sync, to=to):
            self._came_back(queue, message, to)

    def _reclaimed(self, ended: list[Reclaimed]) -> None:
        """Leases ended by reclaim(): settle our records, count, wake."""
        for queue, message, moved_to in ended:
            state = self._queues.get(queue)
            if state is not None:
                offset = message.offset
                opened = state.opened.get(offset)
                if opened is not None and opened.receipt == message.receipt:
                    self._forget(opened)
                for lease in state.leases.values():
                    entry = lease.held.get(offset)
                    if entry is not None and entry[1] == message.receipt:
                        lease.drop(offset)
                        break
            self._came_back(queue, message, moved_to)

    def _came_back(self, queue: str, message: Message, moved_to: str | None) -> None:
        """An open message came back to `queue`, or moved to `moved_to`: count, wake."""
        if moved_to is None:
            self._wake_queue(queue)
            return
        self.state(moved_to).enqueued += 1
        log.info(
            "message %d of %r moved to %r after %d deliveries",
            message.offset,
            queue,
            moved_to,
            message.deliveries,
        )
        self._wake_queue(moved_to)

    async def reclaim(self) -> int:
        """End every expired lease in the store, whoever held it; how many this call ended."""
        ended = await self.backend.reclaim(self._route, sync=Sync.ALWAYS)
        self._reclaimed(ended)
        return len(ended)

    async def _reclaim_periodically(self) -> None:
        """Shared stores: return the expired leases of daemons that died."""
        while True:
            await asyncio.sleep(self.config.reclaim_interval)
            try:
                await self.reclaim()
            except Exception as error:
                _retry_later("reclaiming expired leases", error)

    def _spawn_loop(self, coro: Coroutine[Any, Any, None]) -> None:
        self._loops.append(asyncio.ensure_future(coro))

    def _timed_out(self, opened: Opened) -> None:
        self._spawn(self._give_back(opened))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background broker task failed", exc_info=task.exception())

    async def end_session(self, session: Session) -> None:
        """A connection closed: its open messages go back to their queues."""
        for opened in list(session.open.values()):
            await self._give_back(opened)

    # -- named leases ------------------------------------------------------

    async def _lease_retrieve(self, key: Key, session: Session) -> Hits:
        """`get <queue>/lease=<name>/abort`, or `gets <queue>/lease=<name>/n=<count>` (with
        `/t=<ms>`, `/visibility=<ms>`)."""
        assert key.lease is not None
        self.counters.cmd_get += 1
        if key.abort:
            await self.lease_abort(key.queue, key.lease)
            return []
        wait = self._wait_of(key) if key.wait_ms else 0.0
        visibility = key.visibility_ms / 1000
        messages = await self.lease_reserve(
            key.queue, key.lease, key.count, wait, session, visibility
        )
        if messages:
            self.counters.get_hits += 1
        else:
            self.counters.get_misses += 1
        return [(key, message) for message in messages]

    async def lease_reserve(
        self,
        queue: str,
        name: str,
        count: int,
        wait: float,
        session: Session,
        visibility: float = 0.0,
    ) -> list[Message]:
        """The first `count` messages of lease `name`, reserving more from the head as needed.

        What the lease already holds comes first, so asking again gives the
        same messages. When it holds none and the queue has none, waits up to
        `wait` seconds for one. With `visibility` (seconds), that is the
        lease's visibility timeout from now on, in place of the queue's.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            state = self.state(queue)
            if self._stamp:
                state.used = time.monotonic()
            lease = state.leases.get(name) or state.leases.setdefault(name, NamedLease(queue, name))
            messages: list[Message] | None
            async with lease.lock:
                if state.leases.get(name) is not lease:
                    # Ended (given back, acknowledged) while this waited for it.
                    # (No `continue` here: mypyc can't compile one in a `with`.)
                    messages = None
                else:
                    messages = await self._lease_into(state, lease, count, visibility)
            if messages is None:
                continue
            if not messages:
                await self._named(queue)
            left = deadline - loop.time()
            if messages or left <= 0 or self.stopping:
                return messages
            if not await self._wait([queue], left, session):
                return messages

    async def _lease_into(
        self, state: QueueState, lease: NamedLease, count: int, visibility: float
    ) -> list[Message]:
        """Fill `lease` (its lock held) up to `count`; the first `count` messages it holds."""
        if visibility and visibility != lease.timeout:
            lease.timeout = visibility
            lease.renewed = -math.inf  # what it holds gets the new deadline now
        # Whether or not the reserve failed part way, what the lease holds is
        # renewed, or it ends holding nothing; then the failure is raised. Not
        # a `finally` that awaits: compiled, such a block raised a failure
        # of an earlier call again, after a later call's reserve had worked.
        failure: Exception | None = None
        try:
            await self._reserve_into(state, lease, count)
        except Exception as exc:
            failure = exc
        if lease.held:
            await self._renew(state, lease)
        else:
            self._end(state, lease)
        if failure is not None:
            raise failure
        return [message for message, _ in islice(lease.held.values(), count)]

    async def _reserve_into(self, state: QueueState, lease: NamedLease, count: int) -> None:
        """Reserve head messages into `lease` until it holds `count` or LEASE_BYTES of bodies.

        A message the lease holds that has expired since is dropped first: an
        expired message is never delivered, also not by asking a lease again.
        """
        queue = lease.queue
        settings = state.settings
        timeout = _lease_timeout(state, lease) * LEASE_SLACK
        held = lease.held
        now = time.time()
        stale = [offset for offset, (m, _) in held.items() if m.expires and m.expires <= now]
        if stale:
            dropped = [held.pop(offset) for offset in stale]
            lease.bytes -= sum(len(m.body) for m, _ in dropped)
            removed = await self.backend.ack_many([r for _, r in dropped], sync=settings.sync)
            state.expired += sum(removed)
        while len(held) < count and (not held or lease.bytes < LEASE_BYTES):
            want = min(count - len(held), RESERVE_BATCH)
            room = LEASE_BYTES - lease.bytes
            got = await self.backend.reserve_many(
                queue, want, lease=timeout, sync=settings.sync, max_bytes=room
            )
            now = time.time()
            size = kept = 0
            expired: list[Receipt] = []
            for message in got:
                receipt = message.receipt
                assert receipt is not None
                body = len(message.body)
                size += body
                if message.expires and message.expires <= now:  # _expired, inline
                    expired.append(receipt)
                else:
                    held[message.offset] = (message, receipt)
                    kept += body
            lease.bytes += kept
            if expired:
                removed = await self.backend.ack_many(expired, sync=settings.sync)
                state.expired += sum(removed)
            if len(got) < want and size < room:
                return  # the queue has no more waiting

    async def lease_ack(self, queue: str, name: str, to: int | None) -> bool:
        """`delete <queue>/lease=<name>[/to=<id>]`: remove its messages (up to id `to`) for good.

        True when at least one was removed; False when the lease held none.
        """
        state = self.state(queue)
        if self._stamp:
            state.used = time.monotonic()
        lease = state.leases.get(name)
        if lease is None:
            return False
        async with lease.lock:
            if state.leases.get(name) is not lease:
                return False
            held = lease.held
            done = sorted(held if to is None else (o for o in held if o <= to))
            removed: list[bool] = []
            if done:
                # An error leaves them all held: acknowledging again is safe.
                receipts = [held[offset][1] for offset in done]
                removed = await self.backend.ack_many(receipts, sync=state.sync)
                # Those False too: their store leases were lost, not ours now.
                if len(done) == len(held):
                    held.clear()
                    lease.bytes = 0
                else:
                    for offset in done:
                        lease.drop(offset)
                state.dequeued += sum(removed)
            if held:
                await self._renew(state, lease)
            else:
                self._end(state, lease)
        return any(removed)

    async def lease_abort(self, queue: str, name: str) -> None:
        """`get <queue>/lease=<name>/abort`: every message of the lease back to the queue."""
        state = self.state(queue)
        lease = state.leases.get(name)
        if lease is not None:
            await self._end_lease(state, lease)

    async def _end_lease(self, state: QueueState, lease: NamedLease) -> None:
        """Give back every message of `lease`, in id order, and forget it."""
        async with lease.lock:
            if state.leases.get(lease.name) is not lease:
                return
            self._end(state, lease)
            queue = lease.queue
            held = sorted(lease.held.items())
            lease.held, lease.bytes = {}, 0
            if not held:
                return
            route = self._route
            to = [route(queue, message) for _, (message, _) in held]
            returned = await self.backend.release_many(
                [receipt for _, (_, receipt) in held],
                sync=state.sync,
                to=to if any(to) else (),
            )
        for (_, (message, _)), moved_to, done in zip(held, to, returned, strict=True):
            if done:
                self._came_back(queue, message, moved_to)

    def _end(self, state: QueueState, lease: NamedLease) -> None:
        """Forget the lease's record (its messages are the caller's to settle)."""
        _cancel(lease)
        if state.leases.get(lease.name) is lease:
            del state.leases[lease.name]

    async def _renew(self, state: QueueState, lease: NamedLease) -> None:
        """The lease was named: its visibility timeout starts again."""
        timeout = _lease_timeout(state, lease)
        if not timeout:
            return
        _cancel(lease)
        loop = asyncio.get_running_loop()
        lease.timer = loop.call_later(timeout, self._lease_timed_out, state, lease)
        now = time.monotonic()
        if now - lease.renewed < timeout * (LEASE_SLACK - 1):
            return
        lease.renewed = now
        held = list(lease.held.items())
        try:
            kept = await self.backend.extend_many(
                [receipt for _, (_, receipt) in held],
                lease=timeout * LEASE_SLACK,
                sync=state.sync,
            )
        except Exception as exc:
            log.warning("renewing a lease of %r failed: %s", lease.queue, exc)
            return
        for (offset, _), still in zip(held, kept, strict=True):
            if not still:
                lease.drop(offset)  # its store lease was lost: no longer ours

    def _lease_timed_out(self, state: QueueState, lease: NamedLease) -> None:
        lease.timer = None
        self._spawn(self._end_lease(state, lease))

    async def _together(self, calls: Sequence[Coroutine[Any, Any, T]]) -> list[T | Exception]:
        """run_together(calls), a cancellation raised: their results (or errors), in order."""
        results = await run_together(calls)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result  # cancelled
        return cast(list[T | Exception], results)  # no other BaseException: raised above

    # -- waiting -----------------------------------------------------------

    async def _wait(self, queues: list[str], timeout: float, session: Session) -> bool:
        """Until a message may be in one of `queues`, or `timeout` seconds pass.

        False, at once or when woken, once the session is gone (end_waits): the
        get must then take nothing, as its client would never hear of it, and a
        wake-up meant for it goes on to the next waiter.
        """
        if session.gone:
            return False
        session.flush()
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[str | None] = loop.create_future()
        names = set(queues)
        for queue in names:
            state = self.state(queue)
            if not state.waiters:
                self.backend.watch(queue, True)
                if "+" in queue:
                    self._waiting_children.setdefault(fanout_parent(queue), set()).add(queue)
            state.waiters.append(waiter)
        timer = loop.call_later(timeout, _settle, waiter)
        session.waiter = waiter
        try:
            woken_by = await waiter
            if session.gone or session.closing():
                session.gone = True
                if woken_by is not None:
                    self._wake_queue(woken_by)
                return False
            return True
        except asyncio.CancelledError:
            # A wake-up meant for this waiter must not be lost with it.
            if waiter.done() and not waiter.cancelled() and waiter.result() is not None:
                self._wake_queue(waiter.result() or "")
            raise
        finally:
            session.waiter = None
            timer.cancel()
            for queue in names:
                state = self.state(queue)
                with contextlib.suppress(ValueError):
                    state.waiters.remove(waiter)
                if not state.waiters:
                    self.backend.watch(queue, False)
                    if "+" in queue:
                        self._unwait_child(queue)

    def _unwait_child(self, child: str) -> None:
        parent = fanout_parent(child)
        children = self._waiting_children.get(parent)
        if children is not None:
            children.discard(child)
            if not children:
                del self._waiting_children[parent]

    @staticmethod
    def interrupt(session: Session) -> None:
        """The session's connection is gone: stop its wait, if it is waiting."""
        session.gone = True
        if session.waiter is not None and not session.waiter.done():
            session.waiter.cancel()

    @staticmethod
    def end_waits(session: Session) -> None:
        """The client sent its end of file: a get that waits answers with what it has now.

        A client that closed its socket sends the same end of file as one that
        only half-closed it: a message taken for it after this could reach
        nobody, so none is.
        """
        session.gone = True
        if session.waiter is not None:
            _settle(session.waiter)

    def _arrived(self, queue: str) -> None:
        """The backend says a message may have arrived in `queue` from elsewhere."""
        self._wake_queue(queue)

    def _wake_queue(self, queue: str) -> None:
        state = self._queues.get(queue)
        if state is not None and state.waiters:
            self._wake(state, queue)

    @staticmethod
    def _wake(state: QueueState, queue: str) -> None:
        """A message arrived: wake the queue's longest-waiting get."""
        waiters = state.waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(queue)
                return

    # -- purge and sets ----------------------------------------------------

    async def delete(self, queue: str) -> bool:
        state = self.state(queue)
        self._drop_all(state)
        state.enqueued = state.dequeued = state.expired = 0
        return await self.backend.delete(queue, sync=state.sync)

    def _drop_all(self, state: QueueState) -> None:
        """Forget every open message and named lease of a queue whose messages are gone."""
        for opened in list(state.opened.values()):
            self._forget(opened)
        for lease in state.leases.values():
            _cancel(lease)
        state.leases.clear()

    def check_flush_all(self) -> None:
        if not self.config.allow_flush_all:
            raise ClientError("flush_all disabled")

    async def flush_all(self) -> None:
        self.check_flush_all()
        for state in self._queues.values():
            self._drop_all(state)
            state.enqueued = state.dequeued = state.expired = 0
        await self.backend.flush_all(sync=self.config.queue_settings("").sync)

    async def flush_all_after(self, delay: int) -> None:
        """memcached's `flush_all <delay>`: one pending flush, the latest asked for.

        The delay reads as an exptime does: over 30 days it is a Unix time. One
        that is past flushes now, before the reply, as `flush_all` does.
        """
        self.check_flush_all()
        now = time.time()
        wait = (expiry(delay, now) or now) - now
        if wait <= 0:
            await self.flush_all()
            return
        if self._pending_flush is not None:
            self._pending_flush.cancel()
        self._pending_flush = asyncio.get_running_loop().call_later(wait, self._flush_due)

    def _flush_due(self) -> None:
        self._pending_flush = None
        self._spawn(self.flush_all())

    def size(self, queue: str) -> Coroutine[Any, Any, QueueSize | None]:
        """The backend's size() of `queue`, to await.

        Handed on rather than awaited here: a coroutine fewer on every Redis
        push, whose reply is the queue's length.
        """
        return self.backend.size(queue)

    def _need_unique(self, what: str) -> None:
        if not self._unique:
            raise NotSupported(what, self.backend.name)

    async def contains(self, queue: str, body: bytes) -> bool:
        """Whether a message with this body is in the queue (backends that know bodies)."""
        self._need_unique("contains")
        return await self.backend.contains(queue, body)

    async def discard(self, queue: str, body: bytes) -> int:
        """Remove the waiting messages with this body; how many."""
        self._need_unique("discard")
        return await self.backend.discard(queue, body, sync=self.settings(queue).sync)

    async def redrive(self, dead: str, limit: int, to: str | None = None) -> int:
        """Move up to `limit` dead letters back (to `to`, or where each died); how many."""
        settings = self.settings(dead)
        moved = await self.backend.redrive(dead, to=to, limit=limit, sync=settings.sync)
        expired = moved.pop(REDRIVE_EXPIRED, 0)
        if expired:
            self.state(dead).expired += expired
        for queue, count in moved.items():
            self.state(queue).enqueued += count
            self._wake_queue(queue)
        if moved:
            log.info("redrove %d message(s) out of %r", sum(moved.values()), dead)
        return sum(moved.values())

    async def expire_idle(self) -> list[str]:
        """Delete the queues whose `idle_expiry` has passed with nothing in or done to them."""
        if not self.config.idle_expiry_used:
            return []
        now, wall = time.monotonic(), time.time()
        expired = []
        for queue in await self.backend.queues():
            state = self.state(queue)
            idle = state.settings.idle_expiry
            if not idle or state.used > now - idle or not state.idle():
                continue
            if await self.backend.expire_idle(queue, before=wall - idle, sync=state.sync):
                expired.append(queue)
                del self._queues[queue]
                log.info("queue %r expired after %g s idle", queue, idle)
        return expired

    async def _expire_idle_periodically(self) -> None:
        while True:
            await asyncio.sleep(IDLE_SWEEP)
            try:
                await self.expire_idle()
            except Exception as error:
                _retry_later("expiring idle queues", error)

    # -- introspection -----------------------------------------------------

    def reset_stats(self) -> None:
        """`stats reset`: this daemon's counters start again from zero."""
        self.counters = Counters()
        for state in self._queues.values():
            state.enqueued = state.dequeued = state.expired = 0

    async def stats(self, group: str = "") -> list[tuple[str, object]]:
        """The figures of a `stats` group: "" (general and per queue), "queues", "settings"."""
        if group == "settings":
            return stats.settings(self.config, self.backend.name)
        if group not in ("", "queues"):
            raise UnknownCommand()  # memcached's answer to an unknown stats group
        sizes = await self.backend.sizes()
        per_queue = stats.queues(sizes, self._queue_counts)
        if group == "queues":
            return per_queue
        return stats.general(self, sizes) + per_queue

    def _queue_counts(self, queue: str) -> tuple[int, int, int]:
        state = self._queues.get(queue)
        return (state.enqueued, state.dequeued, state.expired) if state else (0, 0, 0)


def _offset(opened: Opened) -> int:
    return opened.message.offset


def _cancel(lease: NamedLease) -> None:
    if lease.timer is not None:
        lease.timer.cancel()
        lease.timer = None


def _lease_timeout(state: QueueState, lease: NamedLease) -> float:
    """A named lease's visibility timeout in seconds: its own, or its queue's (0: none)."""
    return lease.timeout or state.settings.visibility_timeout


def _retry_later(what: str, error: Exception) -> None:
    """A periodic task failed: the storage's own error in a line (an outage says
    so each time round), anything else with its traceback."""
    if isinstance(error, StorageError):
        log.warning("%s failed: %s; trying again later", what, error)
    else:
        log.error("%s failed; trying again later", what, exc_info=error)


def _expired(message: Message) -> bool:
    return bool(message.expires) and message.expires <= time.time()


def _settle(waiter: asyncio.Future[str | None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
