"""Queue semantics shared by every backend.

The broker turns parsed commands into backend calls and reply bytes: waiting
gets, open (reserved) messages per connection, visibility timeouts, delivery
counts and dead-lettering, expiry, per-queue limits and overflow, and the
counters behind `stats`. It never touches sockets; the server hands it a
`Session` per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, fields
from typing import Any

from mqd import __version__, protocol
from mqd.backend import Backend, Capability, Message
from mqd.config import Config, QueueSettings
from mqd.errors import ClientError, NotSupported, ServerError, UnknownCommand
from mqd.protocol import REPLY, Key, Retrieve, Store

log = logging.getLogger(__name__)

SETTINGS_CACHE = 65536  # queues whose resolved settings are remembered
THIRTY_DAYS = 60 * 60 * 24 * 30  # memcached: larger exptimes are absolute Unix times

STORED = REPLY["stored"]
NOT_STORED = REPLY["not_stored"]
END = REPLY["end"]


@dataclass
class Counters:
    """memcached's general counters; `stats reset` zeroes them."""

    cmd_get: int = 0
    cmd_set: int = 0
    get_hits: int = 0
    get_misses: int = 0
    total_connections: int = 0


@dataclass
class QueueCounters:
    """Per-queue counters; `stats reset` zeroes them."""

    enqueued: int = 0
    dequeued: int = 0
    expired: int = 0


class Session:
    """A connection as the broker sees it: its open messages and a way to flush replies."""

    __slots__ = ("flush", "open", "waiter")

    def __init__(self, flush: Callable[[], None] = lambda: None) -> None:
        self.flush = flush  # sends the replies so far, before the broker waits
        self.open: dict[str, Lease] = {}
        self.waiter: asyncio.Future[str | None] | None = None  # set while a get waits


@dataclass(eq=False)
class Lease:
    """An open message: reserved in the backend, held by one session."""

    queue: str
    message: Message
    session: Session | None
    timer: asyncio.TimerHandle | None = None


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
        self._queue_counters: dict[str, QueueCounters] = {}
        self._settings: dict[str, QueueSettings] = {}
        self._waiters: dict[str, deque[asyncio.Future[str | None]]] = {}
        self._leases: dict[str, dict[int, Lease]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._unique = Capability.UNIQUE in backend.capabilities
        self.stopping = False

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        """Open the backend and settle what was open when it last stopped."""
        await self.backend.open()
        recovered = await self.backend.recover()
        for queue, message in recovered:
            await self._give_back(Lease(queue, message, None))
        if recovered:
            log.info("returned %d message(s) left open by the last run", len(recovered))

    def begin_stop(self) -> None:
        """End every wait now: waiting gets answer with what they have."""
        self.stopping = True
        for waiters in self._waiters.values():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def stop(self) -> None:
        """Give back every open message, then close the backend."""
        self.begin_stop()
        for leases in list(self._leases.values()):
            for lease in list(leases.values()):
                await self._give_back(lease)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.backend.close()

    def reconfigure(self, config: Config) -> None:
        """Apply new per-queue settings (SIGHUP)."""
        self.config = config
        self._settings.clear()

    def settings(self, queue: str) -> QueueSettings:
        """The queue's settings, resolved once and cached."""
        try:
            return self._settings[queue]
        except KeyError:
            if len(self._settings) >= SETTINGS_CACHE:
                self._settings.clear()  # names are client-chosen: keep the cache bounded
            settings = self._settings[queue] = self.config.queue_settings(queue)
            return settings

    def _counters(self, queue: str) -> QueueCounters:
        try:
            return self._queue_counters[queue]
        except KeyError:
            counters = self._queue_counters[queue] = QueueCounters()
            return counters

    # -- enqueue -----------------------------------------------------------

    async def store(self, command: Store) -> bytes:
        """`set` or `add`."""
        self.counters.cmd_set += 1
        queue = command.queue
        settings = self._settings.get(queue) or self.settings(queue)
        unique = command.add or settings.unique
        if unique and not self._unique:
            feature = "add" if command.add else "unique"
            raise NotSupported(feature, self.backend.name)
        if len(command.body) > settings.max_item_size:
            raise ServerError(protocol.TOO_LARGE)
        now = time.time()
        expires = expiry(command.exptime, now) if command.exptime else 0.0
        if expires is None:
            return STORED  # already expired: stored as nothing, as memcached does
        message = Message(command.body, command.flags, expires, now)
        if settings.max_items or settings.max_bytes:
            lock = self._locks.get(queue)
            if lock is None:
                lock = self._locks[queue] = asyncio.Lock()
            async with lock:
                if not await self._make_room(queue, settings, len(command.body)):
                    return NOT_STORED
                offset = await self.backend.put(queue, message, unique=unique, sync=settings.sync)
        else:
            offset = await self.backend.put(queue, message, unique=unique, sync=settings.sync)
        if offset is None:  # the body is already in the queue
            return NOT_STORED if command.add else STORED
        self._counters(queue).enqueued += 1
        if self._waiters:
            self._wake(queue)
        return STORED

    async def _make_room(self, queue: str, settings: QueueSettings, size: int) -> bool:
        """Whether one more message of `size` bytes fits, dropping the oldest if allowed."""
        if settings.max_bytes and size > settings.max_bytes:
            return False
        while True:
            gauges = await self.backend.size(queue)
            if gauges is None:
                return True
            full = (settings.max_items and gauges.items >= settings.max_items) or (
                settings.max_bytes and gauges.bytes + size > settings.max_bytes
            )
            if not full:
                return True
            if settings.overflow != "drop_oldest":
                return False
            dropped = await self.backend.take(queue, sync=settings.sync)
            if dropped is None:  # everything left is open: nothing may be dropped
                return False
            log.debug("queue %r full: dropped message %d", queue, dropped.offset)

    # -- dequeue -----------------------------------------------------------

    async def retrieve(self, command: Retrieve, session: Session) -> bytes:
        """`get` or `gets`, with every option and multiple keys."""
        keys = command.keys
        if len(keys) == 1 and keys[0].plain:
            # `get <queue>`: what most consumers send, without the general machinery.
            key = keys[0]
            self.counters.cmd_get += 1
            message = await self._take(key.queue)
            if message is None:
                self.counters.get_misses += 1
                return END
            self.counters.get_hits += 1
            if command.with_ids:
                return protocol.value(key.raw, message.flags, message.body, message.offset) + END
            return protocol.single_value(key.raw, message.flags, message.body)
        self._check_keys(keys, session)
        self.counters.cmd_get += len(keys)
        loop = asyncio.get_running_loop()
        start = loop.time()
        out: list[bytes] = []
        try:
            hits = await self._pass(keys, session, command.with_ids, out, first=True)
            waits = [k for k in keys if k.wait_ms]
            while not hits and waits and not self.stopping:
                now = loop.time()
                live = [k for k in waits if start + self._wait_of(k) > now]
                if not live:
                    break
                deadline = max(start + self._wait_of(k) for k in live)
                await self._wait([k.queue for k in live], deadline - now, session)
                hits = await self._pass(live, session, command.with_ids, out, first=False)
        except Exception:
            if not out:
                raise
            # Messages already taken must reach the client: answer with them.
            log.exception("get failed after %d value(s); sending those", len(out))
        self.counters.get_hits += len(out)
        self.counters.get_misses += len(keys) - len(out)
        out.append(END)
        return b"".join(out)

    def _wait_of(self, key: Key) -> float:
        return min((key.wait_ms or 0) / 1000, self.config.max_wait)

    def _check_keys(self, keys: list[Key], session: Session) -> None:
        opening: set[str] = set()
        for key in keys:
            if key.at is not None and Capability.OFFSET not in self.backend.capabilities:
                raise NotSupported("at", self.backend.name)
            if key.open:
                # /close/open acknowledges first, so only a bare /open clashes.
                held = key.queue in session.open and not key.close
                if held or key.queue in opening:
                    raise ClientError("transaction already open")
                opening.add(key.queue)

    async def _pass(
        self,
        keys: list[Key] | tuple[Key, ...],
        session: Session,
        ids: bool,
        out: list[bytes],
        *,
        first: bool,
    ) -> int:
        """Serve each key once; return how many VALUEs were added to `out`."""
        hits = 0
        for key in keys:
            message = await self._serve(key, session, first)
            if message is not None:
                offset = message.offset if ids else None
                out.append(protocol.value(key.raw, message.flags, message.body, offset))
                hits += 1
        return hits

    async def _serve(self, key: Key, session: Session, first: bool) -> Message | None:
        queue = key.queue
        if first:
            # Acknowledgements and aborts happen once, not again after a wait.
            if key.close:
                await self._close(session, queue)
                if not key.open:
                    return None
            if key.abort:
                lease = session.open.get(queue)
                if lease is not None:
                    await self._give_back(lease)
                return None
        if key.at is not None:
            message = await self.backend.read_at(queue, key.at)
            return message if message is not None and not _expired(message) else None
        if key.peek:
            return await self._peek(queue)
        if key.open:
            return await self._open(queue, session)
        return await self._take(queue)

    async def _take(self, queue: str) -> Message | None:
        settings = self._settings.get(queue) or self.settings(queue)
        while True:
            message = await self.backend.take(queue, sync=settings.sync)
            if message is None:
                return None
            if _expired(message):
                self._counters(queue).expired += 1
                continue
            self._counters(queue).dequeued += 1
            return message

    async def _peek(self, queue: str) -> Message | None:
        while True:
            message = await self.backend.peek(queue)
            if message is None or not _expired(message):
                return message
            if await self.backend.remove(queue, message.offset, sync=self.settings(queue).sync):
                self._counters(queue).expired += 1

    async def _open(self, queue: str, session: Session) -> Message | None:
        settings = self.settings(queue)
        while True:
            message = await self.backend.reserve(
                queue, lease=settings.visibility_timeout, sync=settings.sync
            )
            if message is None:
                return None
            if not _expired(message):
                break
            await self.backend.remove(queue, message.offset, sync=settings.sync)
            self._counters(queue).expired += 1
        lease = Lease(queue, message, session)
        session.open[queue] = lease
        self._leases.setdefault(queue, {})[message.offset] = lease
        if settings.visibility_timeout:
            loop = asyncio.get_running_loop()
            lease.timer = loop.call_later(settings.visibility_timeout, self._timed_out, lease)
        return message

    async def _close(self, session: Session, queue: str) -> None:
        lease = session.open.get(queue)
        if lease is None:
            return
        self._forget(lease)
        if await self.backend.remove(queue, lease.message.offset, sync=self.settings(queue).sync):
            self._counters(queue).dequeued += 1

    def _forget(self, lease: Lease) -> None:
        """Drop the broker's record of an open message (not the message)."""
        if lease.timer is not None:
            lease.timer.cancel()
        if lease.session is not None and lease.session.open.get(lease.queue) is lease:
            del lease.session.open[lease.queue]
        leases = self._leases.get(lease.queue)
        if leases is not None:
            leases.pop(lease.message.offset, None)
            if not leases:
                del self._leases[lease.queue]

    async def _give_back(self, lease: Lease) -> None:
        """An open message comes back: to its queue, or to the dead letters."""
        self._forget(lease)
        queue, message = lease.queue, lease.message
        settings = self.settings(queue)
        if settings.max_deliveries and message.deliveries >= settings.max_deliveries:
            dead = settings.dead_letter_for(queue)
            dead_settings = self.settings(dead)
            copy = Message(message.body, message.flags, message.expires, message.created)
            # Stored in the dead letters before removal: a crash in between
            # delivers it twice rather than never.
            await self.backend.put(dead, copy, unique=False, sync=dead_settings.sync)
            await self.backend.remove(queue, message.offset, sync=settings.sync)
            self._counters(dead).enqueued += 1
            log.info(
                "message %d of %r moved to %r after %d deliveries",
                message.offset,
                queue,
                dead,
                message.deliveries,
            )
            self._wake(dead)
            return
        if await self.backend.release(queue, message.offset, sync=settings.sync):
            self._wake(queue)

    def _timed_out(self, lease: Lease) -> None:
        self._spawn(self._give_back(lease))

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
        for lease in list(session.open.values()):
            await self._give_back(lease)

    # -- waiting -----------------------------------------------------------

    async def _wait(self, queues: list[str], timeout: float, session: Session) -> None:
        """Until a message may be in one of `queues`, or `timeout` seconds pass."""
        session.flush()
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[str | None] = loop.create_future()
        names = set(queues)
        for queue in names:
            self._waiters.setdefault(queue, deque()).append(waiter)
        timer = loop.call_later(timeout, _settle, waiter)
        session.waiter = waiter
        try:
            await waiter
        except asyncio.CancelledError:
            # A wake-up meant for this waiter must not be lost with it.
            if waiter.done() and not waiter.cancelled() and waiter.result() is not None:
                self._wake(waiter.result() or "")
            raise
        finally:
            session.waiter = None
            timer.cancel()
            for queue in names:
                waiters = self._waiters.get(queue)
                if waiters is None:
                    continue
                with contextlib.suppress(ValueError):
                    waiters.remove(waiter)
                if not waiters:
                    del self._waiters[queue]

    @staticmethod
    def interrupt(session: Session) -> None:
        """The session's connection is gone: stop its wait, if it is waiting."""
        if session.waiter is not None and not session.waiter.done():
            session.waiter.cancel()

    def _wake(self, queue: str) -> None:
        """A message arrived in `queue`: wake its longest-waiting get."""
        waiters = self._waiters.get(queue)
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(queue)
                return

    # -- purge -------------------------------------------------------------

    async def delete(self, queue: str) -> bool:
        for lease in list(self._leases.get(queue, {}).values()):
            self._forget(lease)
        self._queue_counters.pop(queue, None)
        return await self.backend.delete(queue, sync=self.settings(queue).sync)

    def check_flush_all(self) -> None:
        if not self.config.allow_flush_all:
            raise ClientError("flush_all disabled")

    async def flush_all(self) -> None:
        self.check_flush_all()
        for leases in list(self._leases.values()):
            for lease in list(leases.values()):
                self._forget(lease)
        self._queue_counters.clear()
        await self.backend.flush_all(sync=self.settings("").sync)

    def flush_all_later(self, delay: float) -> None:
        """memcached's `flush_all <delay>`."""
        loop = asyncio.get_running_loop()
        loop.call_later(delay, self._spawn, self.flush_all())

    # -- introspection -----------------------------------------------------

    async def stats(self, args: tuple[bytes, ...]) -> bytes:
        if args == (b"reset",):
            self.counters = Counters()
            for counters in self._queue_counters.values():
                counters.enqueued = counters.dequeued = counters.expired = 0
            return REPLY["reset"]
        if args == (b"queues",):
            lines, _, _ = await self._queue_stats()
            return b"".join(lines) + END
        if args == (b"settings",):
            return b"".join(protocol.stat(k, v) for k, v in self._settings_stats()) + END
        if args:
            raise UnknownCommand()  # memcached's answer to an unknown stats group
        lines, items, size = await self._queue_stats()
        now = time.time()
        general = [
            ("pid", os.getpid()),
            ("uptime", int(now - self.started)),
            ("time", int(now)),
            ("version", __version__),
            ("curr_connections", self.curr_connections),
            *((f.name, getattr(self.counters, f.name)) for f in fields(self.counters)),
            ("curr_items", items),
            ("bytes", size),
            ("backend", self.backend.name),
        ]
        head = [protocol.stat(name, value) for name, value in general]
        return b"".join(head + lines) + END

    def _settings_stats(self) -> list[tuple[str, object]]:
        """memcached's `stats settings` names, for what mqd has, then mqd's own."""
        config = self.config
        return [
            ("maxconns", config.max_connections),
            ("tcpport", config.port),
            ("inter", config.listen),
            ("item_size_max", config.max_item_size),
            ("idle_timeout", int(config.idle_timeout)),
            ("flush_enabled", "yes" if config.allow_flush_all else "no"),
            ("shutdown_command", "yes" if config.allow_shutdown else "no"),
            ("num_threads", 1),
            ("backend", self.backend.name),
            ("max_wait", config.max_wait),
        ]

    async def _queue_stats(self) -> tuple[list[bytes], int, int]:
        lines: list[bytes] = []
        items = size = 0
        now = time.time()
        for queue in sorted(await self.backend.queues()):
            gauges = await self.backend.size(queue)
            if gauges is None:
                continue
            counters = self._counters(queue)
            age = int((now - gauges.head_created) * 1000) if gauges.head_created else 0
            items += gauges.items
            size += gauges.bytes
            prefix = "queue_" + queue + "_"
            for name, value in (
                ("items", gauges.items),
                ("bytes", gauges.bytes),
                ("open", gauges.open),
                ("enqueued", counters.enqueued),
                ("dequeued", counters.dequeued),
                ("expired", counters.expired),
                ("age_ms", max(age, 0)),
            ):
                lines.append(protocol.stat(prefix + name, value))
        return lines, items, size


def _expired(message: Message) -> bool:
    return bool(message.expires) and message.expires <= time.time()


def _settle(waiter: asyncio.Future[str | None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
