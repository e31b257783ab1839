"""One memcached-protocol client connection: parsed commands in, replies out, bounded.

Each connection runs its commands strictly in order; replies are gathered and
written once per batch of input, which is what makes pipelining cheap, and
consecutive sets and plain gets are started together so a group-commit
backend flushes once for them. What one client can make the daemon hold is
bounded: a connection stops reading while many parsed commands wait, and runs
no more commands while its unsent replies pass WRITE_HIGH. On a backend that
answers holders at once (mqd.backend.Holder) plain sets and gets run
straight through and their replies wait, in order, until the backend says
what they answer is durable.

Over 500 lines: the connection's whole life (admission, pipelining, replies
held and bounded, one handler per command) is one state machine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar, Final, Protocol, cast

from mypy_extensions import mypyc_attr

from mqd import __version__, protocol
from mqd.backend import PUT_STORED, Pending, Put
from mqd.broker import Session
from mqd.eager import FINISHED, Together, finish, first_wait
from mqd.errors import ProtocolError, ServerError, StorageError, UnknownCommand
from mqd.protocol import (
    REPLY,
    Delete,
    Failed,
    FlushAll,
    Quit,
    Redrive,
    Retrieve,
    Shutdown,
    Stats,
    Store,
    Verbosity,
    Version,
)

if TYPE_CHECKING:
    from mqd.server import Server

log = logging.getLogger(__name__)

PENDING_HIGH: Final = 4096  # parsed commands waiting on one connection before it stops reading
INPUT_HIGH: Final = 1 << 20  # ... or bytes of input behind them
WRITE_HIGH: Final = 256 * 1024  # unsent reply bytes above which a connection runs no more commands
GROUP_MAX: Final = 32  # sets and plain gets of one pipeline started together, at most
GET_PIECE: Final = 32  # keys of a many-key get run at a time, so its reply is built in pieces
FLUSH_AT: Final = 64 * 1024  # gathered reply bytes sent at once rather than at the end of a batch
ADMIT_GRACE: Final = 0.25  # seconds a connection over max_connections waits for a slot ...
ADMIT_RETRY: Final = 0.05  # ... looking every this often
REFUSED_LINGER: Final = 0.5  # seconds a refused client has to read its error line
TOO_MANY_CONNECTIONS: Final = b"ERROR Too many open connections\r\n"
END: Final = REPLY["end"]
STORED: Final = REPLY["stored"]
UNAUTHENTICATED: Final = b"CLIENT_ERROR unauthenticated\r\n"
BAD_TOKEN: Final = b"CLIENT_ERROR bad authentication token format\r\n"
AUTH_FAILED: Final = b"CLIENT_ERROR authentication failure\r\n"


class CommandParser(Protocol):
    """What a connection reads commands with: memcached's (mqd.protocol) or RESP's."""

    @property
    def partial(self) -> bool:
        """Whether a command has begun to arrive but is not whole yet."""

    def feed(self, data: bytes) -> list[Any]:
        """The commands `data` completes, in order."""


# Compiled (mqd/native.py), yet the Redis listener's connection subclasses it.
@mypyc_attr(allow_interpreted_subclasses=True)
class Connection(asyncio.Protocol):
    """One client connection."""

    refusal: ClassVar[bytes] = TOO_MANY_CONNECTIONS  # the reply when max_connections are open
    #: Whether a group of sets and gets calls the broker itself (memcached's
    #: commands) rather than through _execute (a protocol that answers its own way).
    straight_to_broker: ClassVar[bool] = True

    def __init__(self, server: Server) -> None:
        self.server = server
        self.broker = server.broker
        self.parser: CommandParser = protocol.Parser(server.config.max_item_size)
        self.session = Session(self.flush, self._closing_transport)
        self.transport: asyncio.Transport | None = None
        self.pending: deque[Any] = deque()  # memcached commands, or RESP requests
        self.out: list[bytes] = []
        self.task: asyncio.Task[None] | None = None
        self.closed = True  # until admitted: nothing it sends is run
        self.admitted = False
        self.early: list[bytes] | None = []  # input before admission; None once refused
        self.locked = server.authenticator is not None  # until the client logs in
        self.last_active = time.monotonic()  # when the last complete command arrived
        self.command_started = 0.0  # when the command still arriving began; 0: none
        self.pending_bytes = 0
        self.out_bytes = 0
        self._writable: asyncio.Future[None] | None = None
        self._reading_paused = False
        # Replies held until the backend says what they answer is durable
        # (mqd.backend.Holder): from this index of `out` on, while `_held`.
        self._held: Pending | None = None
        self._held_from = 0
        # A pipeline read in two parts can have its second part run in the
        # next round while the first round syncs: that round's Pending, and
        # the index of `out` its replies start at, wait here (rounds end in
        # the order they ran, so these end after `_held`, in this order).
        self._held_later: list[tuple[Pending, int]] = []
        self._unheld: asyncio.Future[None] | None = None  # set once nothing is held
        self._closing = False  # closed, the held replies still to send
        self._eof = False  # the client half-closed: close once all it sent is answered

    # -- asyncio.Protocol ----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, hence the cast.
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=WRITE_HIGH)
        if self.server.admit(self):
            self.admitted, self.closed = True, False
            return
        # Clients that just left may not be counted out yet (their end of
        # file is read later): wait a moment for a slot before refusing.
        self.transport.pause_reading()
        self.server.loop.call_later(ADMIT_RETRY, self._admit_late, ADMIT_GRACE)

    def _admit_late(self, left: float) -> None:
        assert self.transport is not None
        if self.transport.is_closing():
            return
        if not self.server.admit(self):
            if left > 0:
                self.server.loop.call_later(ADMIT_RETRY, self._admit_late, left - ADMIT_RETRY)
            else:
                self.transport.resume_reading()
                self.refuse()
            return
        self.transport.resume_reading()
        self.admitted, self.closed = True, False
        early, self.early = self.early or [], None
        for data in early:
            self.data_received(data)

    def refuse(self) -> None:
        """Say why, then close once the client has read it (closing at once resets it)."""
        assert self.transport is not None
        self.early = None
        self.server.refused(
            "refused a connection: max_connections (%d) reached", len(self.server.connections)
        )
        self.transport.write(self.refusal)
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the client sees the line, then EOF, and closes
        self.server.loop.call_later(REFUSED_LINGER, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            # Before admission, kept (reading is paused, but not at once on
            # every loop); once refused, read and dropped, so that no reset
            # loses the error line.
            if self.early is not None and not self.admitted:
                self.early.append(data)
                assert self.transport is not None
                self.transport.pause_reading()
            return
        parser = self.parser
        commands = parser.feed(data)
        now = time.monotonic()
        if not commands:
            if not self.command_started:
                self.command_started = now
            return
        self.last_active = now
        self.command_started = now if parser.partial else 0.0
        pending = self.pending
        pending.extend(commands)
        self.pending_bytes += len(data)
        if (
            len(pending) > PENDING_HIGH or self.pending_bytes > INPUT_HIGH
        ) and not self._reading_paused:
            assert self.transport is not None
            self.transport.pause_reading()
            self._reading_paused = True
        if self.task is not None:
            return  # the running drain() takes them in turn
        # Run them now, until one has to wait; a task finishes the rest. Most
        # commands never wait (the memory backend, a get that finds a
        # message), and running them directly here saves creating a task for
        # every read, which costs more than parsing and executing a command.
        # (eager.run_eagerly, inline: this is every read's path.)
        step = self.drain()
        waiting_on = first_wait(step)
        if waiting_on is FINISHED:
            return
        self.task = asyncio.get_running_loop().create_task(finish(step, waiting_on))
        self.server.overlap = True  # something waited: overlapping may pay again

    def _closing_transport(self) -> bool:
        return self.transport is not None and self.transport.is_closing()

    @property
    def reading_paused(self) -> bool:
        return self._reading_paused

    @property
    def blocked_on_client(self) -> bool:
        """Whether replies wait for the client to read them."""
        return self._writable is not None

    def eof_received(self) -> bool:
        """The client sent all it will (it half-closed): answer all of it, then close.

        As memcached does. Returning False would have the transport close at
        once, dropping the replies still held for their sync, and with them
        the messages their gets took. A get that waits for a message answers
        at once with none: the client may have closed its socket for good.
        """
        if self.closed:
            return False
        self._eof = True
        self.broker.end_waits(self.session)
        if self.transport is not None and self.transport.get_extra_info("sslcontext"):
            # TLS closes at the client's end of file whatever this returns (it
            # would only log that): replies held then are lost, see the README.
            return False
        if self.task is None and not self.pending:
            self.close()  # after the held replies, if any (_released)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.admitted:
            return
        self.server.forget(self)
        waiter = self._writable
        if waiter is not None and not waiter.done():
            waiter.cancel()
        self.broker.interrupt(self.session)
        if self.task is None:
            self.server.spawn(self.broker.end_session(self.session))
        else:
            # The running command finishes first, so nothing it took is lost.
            self.task.add_done_callback(
                lambda _: self.server.spawn(self.broker.end_session(self.session))
            )

    def pause_writing(self) -> None:
        self._writable = self.server.loop.create_future()

    def resume_writing(self) -> None:
        waiter, self._writable = self._writable, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- running commands ----------------------------------------------------

    async def drain(self) -> None:
        """Run every pending command in order, gathering replies; then send them.

        Consecutive sets, plain gets and bare `/close`s are started together (see
        `_run_group`); every other command waits for those before it.
        """
        try:
            pending = self.pending
            server = self.server
            broker = self.broker
            out = self.out
            while pending and not self.closed:
                if self._writable is not None or self.out_bytes >= WRITE_HIGH:
                    await self._until_client_reads()
                command = pending.popleft()
                kind = type(command)
                reply: bytes | None
                if self.locked:
                    login = self._login(command)
                    reply = await self._execute(command) if login is None else login
                elif (
                    server.overlap and pending and self.groups(command) and self.groups(pending[0])
                ):
                    await self._run_group(command)
                    continue
                elif server.metrics is not None:
                    reply = await self._execute(command)
                # The two commands that carry the load, run here rather than
                # through _execute: one coroutine fewer for each.
                elif kind is Store:
                    store = cast(Store, command)
                    try:
                        stored = await broker.store(store, self)
                    except Exception as error:
                        reply = self._failure(store, error)
                    else:
                        reply = (
                            STORED
                            if stored is PUT_STORED and not store.noreply
                            else _store_reply(store, stored)
                        )
                elif (
                    kind is Retrieve
                    and len(keys := cast(Retrieve, command).keys) == 1
                    and keys[0].plain
                    and not cast(Retrieve, command).with_ids
                ):
                    key = keys[0]
                    try:
                        message = await broker.take(key.queue, holder=self)
                    except Exception as error:
                        reply = self._failure(command, error)
                    else:
                        reply = (
                            END
                            if message is None
                            else protocol.single_value(key.raw, message.flags, message.body)
                        )
                else:
                    reply = await self._execute(command)
                if reply:  # as _emit does, inline on the hot path
                    out.append(reply)
                    self.out_bytes += len(reply)
                    if self.out_bytes >= FLUSH_AT:
                        self.flush()
            self.flush()
            self.pending_bytes = 0
            if self._eof and not pending:
                self.close()  # all the client sent is answered (eof_received)
            if self._reading_paused and not self.closed:
                assert self.transport is not None
                self.transport.resume_reading()
                self._reading_paused = False
                if self.parser.partial:
                    self.command_started = time.monotonic()
        except asyncio.CancelledError:
            pass
        finally:
            self.task = None

    async def _execute(self, command: Any) -> bytes | None:
        """Run one command: its reply, or None when it has none (noreply).

        (Any: a subclass's protocol has requests of its own, e.g. RESP's.)
        """
        kind = type(command)
        metrics = self.server.metrics
        started = time.perf_counter() if metrics is not None else 0.0
        try:
            if kind is Store:
                stored = await self.broker.store(command)
                return _store_reply(command, stored)
            if kind is Retrieve:
                keys = command.keys
                if len(keys) > GET_PIECE and all(k.plain or k.peek or k.at for k in keys):
                    return await self._retrieve_in_pieces(command)
                # Its takes share a commit, their reply held until it is synced;
                # but with metrics, which time each command to its reply, every
                # command is answered once durable (sets too, above).
                holder = self if metrics is None else None
                hits = await self.broker.retrieve(command, self.session, holder)
                return protocol.values_reply(hits, command.with_ids)
            return await _DISPATCH[kind](self, command)
        except Exception as error:
            return self._failure(command, error)
        finally:
            if metrics is not None:
                metrics.observe(command, started)

    def _failure(self, command: Any, error: Exception) -> bytes | None:
        """The reply to a command that raised `error` (None: noreply), logged and counted."""
        metrics = self.server.metrics
        noreply = getattr(command, "noreply", False)
        if isinstance(error, StorageError):
            self.server.storage_failed(
                "storage error in %s: %s", self.server.config.data_dir, error
            )
            if metrics is not None:
                metrics.failed(command, error)
            return None if noreply else protocol.error_line(error)
        if isinstance(error, ProtocolError):
            return None if noreply else protocol.error_line(error)
        if metrics is not None:
            metrics.failed(command, error)
        log.exception("command failed: %r", command, exc_info=error)
        return protocol.error_line(ServerError("internal error"))

    async def _run_group(self, first: Any) -> None:
        """Start `first` and the sets and plain gets right behind it together; reply in order.

        Each is run now up to its first wait, in order, so their storage calls
        are made in this turn of the loop, in order: a backend that commits
        in groups commits them together instead of one flush per command.
        Replies go out in order once all of them are complete (one wake-up
        of this connection for the group, not one per command).
        When none of them waited (a backend that answers at once, as memory
        does), or the backend holds replies (the next commands may run at
        once again), overlapping is turned off once the group is done, until
        something waits again: one command after another costs less then.
        """
        pending = self.pending
        group = Together()
        through_execute = self.server.metrics is not None or not self.straight_to_broker
        broker = self.broker
        commands: list[Any] = []
        command = first
        while True:
            commands.append(command)
            if through_execute:
                ended = group.start(self._execute(command))
            elif isinstance(command, Store):
                # Straight to the broker: a coroutine fewer per command than
                # _execute, which matters when each one waits.
                ended = group.start(broker.store(command))
            else:
                ended = group.start(broker.retrieve(command, self.session))
            if not (pending and len(commands) < GROUP_MAX and self.groups(pending[0])):
                break
            if not ended and self.reads_after_storing(command):
                break  # the rest start once its reply is made (see reads_after_storing)
            command = pending.popleft()
        results = await group.wait()
        if not group.waited or self.broker.backend.answers_held:
            # After the wait, which made this connection a task and so turned
            # overlapping on again.
            self.server.overlap = False
        for command, result in zip(commands, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    return  # cancelled: the connection is going away
                reply = self._failure(command, result)
            elif through_execute:
                reply = result
            elif isinstance(command, Store):
                reply = _store_reply(command, result)
            else:
                reply = protocol.values_reply(result, command.with_ids)
            if reply:
                self._emit(reply)

    @staticmethod
    def groups(command: Any) -> bool:
        """Whether `command` may start before the one ahead of it completes (one storage call).

        Sets, plain gets and bare `/close` acknowledgements: each is one
        storage write that no later command of the pipeline depends on.
        """
        kind = type(command)
        if kind is Store:
            return True
        if kind is not Retrieve or len(command.keys) != 1:
            return False
        key = command.keys[0]
        return key.plain or _closes_only(key)

    def reads_after_storing(self, command: Any) -> bool:
        """Whether `command`'s reply reads the store after its write, so that the
        commands grouped behind it must not start while that write waits.

        None here: a set's reply is what its store did.
        """
        return False

    def _emit(self, reply: bytes) -> None:
        self.out.append(reply)
        self.out_bytes += len(reply)
        if self.out_bytes >= FLUSH_AT:
            self.flush()

    def hold(self, pending: Pending) -> None:
        """The replies from here on wait for `pending` (mqd.backend.Holder)."""
        held = self._held
        if held is None:
            self._held = pending
            self._held_from = len(self.out)
            pending.add(self._released)
        elif pending is not held:
            later = self._held_later
            if not later or later[-1][0] is not pending:
                later.append((pending, len(self.out)))
                pending.add(self._released)

    def _released(self, error: BaseException | None) -> None:
        """What the held replies answer is durable; or it was undone, and each says why.

        Only the replies of the Pending that ended go: those of a later one
        (self._held_later) wait for it in turn.
        """
        out = self.out
        later = self._held_later
        end = later[0][1] if later else len(out)
        if error is not None:
            if not isinstance(error, StorageError):
                error = StorageError(str(error))
            line = self.error_line(error)
            for index in range(self._held_from, end):
                out[index] = line
            self.server.storage_failed(
                "storage error in %s: %s", self.server.config.data_dir, error
            )
        transport = self.transport
        closing = self._closing  # close() came while they were held
        to_client = (
            transport is not None and not transport.is_closing() if closing else not self.closed
        )
        if later:
            self._held, start = later.pop(0)
            self._held_from = start - end
            self._held_later = [(pending, at - end) for pending, at in later]
            self._send(to_client, end)
            return
        self._held = None
        self._send(to_client)
        unheld, self._unheld = self._unheld, None
        if unheld is not None and not unheld.done():
            unheld.set_result(None)
        if closing:
            self._closing = False
            if transport is not None:
                transport.close()

    def error_line(self, error: StorageError) -> bytes:
        """The reply that stands for each held reply `error` voided, in this protocol."""
        return protocol.error_line(error)

    def flush(self) -> None:
        """Send every reply gathered so far (held replies once they are released)."""
        if self._held is None:
            self._send(not self.closed)

    def _send(self, to_client: bool, end: int = -1) -> None:
        """Write `out` (its first `end` replies) to the client if `to_client` (it is
        still there); either way, drop them from `out`."""
        out = self.out
        if end < 0 or end == len(out):
            if out and to_client and self.transport is not None:
                self.transport.write(b"".join(out))  # one reply: join returns it, no copy
            out.clear()
            self.out_bytes = 0
            return
        sent = out[:end]  # the rest waits for a later Pending (_released)
        del out[:end]
        self.out_bytes -= sum(map(len, sent))
        if sent and to_client and self.transport is not None:
            self.transport.write(b"".join(sent))

    async def _retrieve_in_pieces(self, command: Retrieve) -> bytes:
        """A get of many keys that take or look without waiting, answered GET_PIECE keys at a time.

        The reply bytes are those of the whole; what is held at once is one
        piece's values, and the next piece waits while the client is not reading.
        """
        keys = command.keys
        for first in range(0, len(keys), GET_PIECE):
            if self.closed:
                break  # the client is gone: take nothing more for it
            piece = Retrieve(keys[first : first + GET_PIECE], command.with_ids)
            hits = await self.broker.retrieve(piece, self.session, self)
            self.out.append(protocol.values_reply(hits, command.with_ids)[: -len(END)])
            # The piece's takes may wait for their commit: the next piece waits
            # with them, so that one piece's values are held at most.
            await self._until_client_reads()
        return END

    async def _until_client_reads(self) -> None:
        """Until the replies gathered so far are written and the client reads them.

        The output bound: a client that does not read its replies gets no more
        commands run, also while its replies are held for their sync (which
        fills no socket buffer until it ends).
        """
        self.flush()
        if self._held is not None:
            self._unheld = self.server.loop.create_future()
            await self._unheld
        if self._writable is not None:
            await self._writable

    def _login(self, command: Any) -> bytes | None:
        """memcached's text-protocol login: the first `set`'s data is `<user> <password>`.

        Returns the reply (b"" under noreply, as for any command), or None for
        a command that runs anyway (a fatal parse error).
        """
        if isinstance(command, Failed) and command.close:
            return None
        reply = self._login_reply(command)
        return b"" if getattr(command, "noreply", False) else reply

    def _login_reply(self, command: Any) -> bytes:
        if not isinstance(command, Store) or command.add:
            return UNAUTHENTICATED
        user, space, password = command.body.partition(b" ")
        if not space:
            return BAD_TOKEN
        assert self.server.authenticator is not None
        if not self.server.authenticator.check(user, password):
            self.server.auth_failures("authentication failed for user %r", user)
            return AUTH_FAILED
        self.locked = False
        return REPLY["stored"]

    def close(self) -> None:
        if self._held is not None:
            self._closing = True  # once the held replies are out (_released)
            self.closed = True
            return
        self.flush()
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # -- one method per command type ----------------------------------------

    async def _delete(self, command: Delete) -> bytes | None:
        if command.lease is None:
            found = await self.broker.delete(command.queue)
        else:
            found = await self.broker.lease_ack(command.queue, command.lease, command.to)
        if command.noreply:
            return None
        return REPLY["deleted"] if found else REPLY["not_found"]

    async def _flush_all(self, command: FlushAll) -> bytes | None:
        if command.delay:
            await self.broker.flush_all_after(command.delay)
        else:
            await self.broker.flush_all()
        return None if command.noreply else REPLY["ok"]

    async def _redrive(self, command: Redrive) -> bytes:
        moved = await self.broker.redrive(command.dead, command.limit, command.to)
        return protocol.moved_reply(moved)

    async def _stats(self, command: Stats) -> bytes:
        if command.args == (b"reset",):
            self.broker.reset_stats()
            return REPLY["reset"]
        if len(command.args) > 1:
            raise UnknownCommand()
        group = command.args[0].decode("ascii", "replace") if command.args else ""
        return protocol.stats_reply(await self.broker.stats(group))

    async def _version(self, command: Version) -> bytes:
        return b"VERSION %b\r\n" % __version__.encode()

    async def _verbosity(self, command: Verbosity) -> bytes | None:
        return None if command.noreply else REPLY["ok"]

    async def _quit(self, command: Quit) -> None:
        self.close()

    async def _shutdown(self, command: Shutdown) -> bytes:
        if not self.server.config.allow_shutdown:
            raise UnknownCommand()
        self.out.append(REPLY["ok"])
        self.flush()
        self.server.request_stop("shutdown command")
        return b""

    async def _failed(self, command: Failed) -> None:
        if not command.noreply:
            self.out.append(protocol.error_line(command.error))
        if command.close:
            self.close()


def _closes_only(key: protocol.Key) -> bool:
    """`get <queue>/close`: an acknowledgement and nothing else."""
    return (
        key.close
        and not (key.open or key.abort or key.peek or key.lease)
        and key.at is None
        and key.wait_ms is None
    )


def _store_reply(command: Store, stored: Put) -> bytes | None:
    if command.noreply:
        return None
    return STORED if stored is PUT_STORED else protocol.store_reply(command, stored)


_Handler = Callable[[Connection, Any], Awaitable[bytes | None]]
_DISPATCH: dict[type, _Handler] = {
    Delete: Connection._delete,
    FlushAll: Connection._flush_all,
    Redrive: Connection._redrive,
    Stats: Connection._stats,
    Version: Connection._version,
    Verbosity: Connection._verbosity,
    Quit: Connection._quit,
    Shutdown: Connection._shutdown,
    Failed: Connection._failed,
}
