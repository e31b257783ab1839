"""The asyncio reactor: connections in, parsed commands to the broker, replies out.

One event loop, one thread. Each connection runs its commands strictly in
order; replies are gathered and written once per batch of input, which is what
makes pipelining cheap. Signals: TERM/INT stop gracefully (a second one forces
the exit), HUP reloads per-queue settings. With NOTIFY_SOCKET set, systemd is
told READY=1 and STOPPING=1.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, cast

from mqd import __version__, protocol
from mqd.backend import Backend, Put
from mqd.broker import Broker, Session
from mqd.config import Config
from mqd.errors import ConfigError, ProtocolError, ServerError, StorageError, UnknownCommand
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

log = logging.getLogger(__name__)

PENDING_HIGH = 4096  # parsed commands waiting on one connection before it stops reading
TOO_MANY_CONNECTIONS = b"ERROR Too many open connections\r\n"
STORED = REPLY["stored"]


class Connection(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.broker = server.broker
        self.parser = protocol.Parser(server.config.max_item_size)
        self.session = Session(self.flush)
        self.transport: asyncio.Transport | None = None
        self.pending: deque[protocol.Command] = deque()
        self.out: list[bytes] = []
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        self.last_active = time.monotonic()
        self._writable: asyncio.Future[None] | None = None
        self._reading_paused = False

    # -- asyncio.Protocol ----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, hence the cast.
        self.transport = cast(asyncio.Transport, transport)
        if not self.server.admit(self):
            self.transport.write(TOO_MANY_CONNECTIONS)
            self.transport.close()
            self.closed = True

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.last_active = time.monotonic()
        commands = self.parser.feed(data)
        if not commands:
            return
        self.pending.extend(commands)
        if len(self.pending) > PENDING_HIGH and not self._reading_paused:
            assert self.transport is not None
            self.transport.pause_reading()
            self._reading_paused = True
        if self.task is None:
            self.process()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
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

    def process(self) -> None:
        """Run pending commands now, until one has to wait; a task finishes the rest.

        Most commands never wait (the memory backend, a get that finds a
        message), and running them directly here saves creating a task for
        every read, which costs more than parsing and executing a command.
        """
        step = self.drain()
        try:
            waiting_on = step.send(None)
        except StopIteration:
            return
        self.task = self.server.loop.create_task(self.finish(step, waiting_on))

    async def finish(self, step: Coroutine[Any, Any, None], waiting_on: Any) -> None:
        try:
            await finish(step, waiting_on)
        except asyncio.CancelledError:
            pass
        finally:
            self.task = None

    async def drain(self) -> None:
        """Run every pending command in order, gathering replies; then send them."""
        pending = self.pending
        out = self.out
        broker = self.broker
        while pending and not self.closed:
            if self._writable is not None:  # the client is not reading its replies
                self.flush()
                await self._writable
            if self._reading_paused and len(pending) < PENDING_HIGH // 2:
                assert self.transport is not None
                self.transport.resume_reading()
                self._reading_paused = False
            command = pending.popleft()
            kind = type(command)
            try:
                # The two commands that carry the load skip the dispatch table.
                if kind is Store:
                    stored = await broker.store(command)  # type: ignore[arg-type]
                    if command.noreply:  # type: ignore[union-attr]
                        continue
                    if stored is Put.STORED:
                        reply = STORED
                    else:
                        reply = protocol.store_reply(command, stored)  # type: ignore[arg-type]
                elif kind is Retrieve:
                    hits = await broker.retrieve(command, self.session)  # type: ignore[arg-type]
                    reply = protocol.values_reply(hits, command.with_ids)  # type: ignore[union-attr]
                else:
                    result = await _DISPATCH[kind](self, command)
                    if result is None:
                        continue
                    reply = result
            except ProtocolError as error:
                if not getattr(command, "noreply", False):
                    out.append(protocol.error_line(error))
                continue
            except Exception:
                log.exception("command failed: %r", command)
                out.append(protocol.error_line(ServerError("internal error")))
                continue
            out.append(reply)
        self.flush()

    def flush(self) -> None:
        """Send every reply gathered so far."""
        if self.out and self.transport is not None and not self.closed:
            self.transport.write(b"".join(self.out))
        self.out.clear()

    def close(self) -> None:
        self.flush()
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # -- one method per command type ----------------------------------------

    async def _delete(self, command: Delete) -> bytes | None:
        found = await self.broker.delete(command.queue)
        if command.noreply:
            return None
        return REPLY["deleted"] if found else REPLY["not_found"]

    async def _flush_all(self, command: FlushAll) -> bytes | None:
        if command.delay:
            self.broker.flush_all_later(command.delay)
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


async def finish(step: Coroutine[Any, Any, None], waiting_on: Any) -> None:
    """Drive a coroutine that was started by hand and suspended on `waiting_on`.

    It does for one coroutine what asyncio.Task does: wait for the future it
    yielded, then resume it, until it returns. (Python 3.12's eager tasks do
    this natively; this keeps 3.11 supported.) A cancellation of the task
    running this cancels the future being waited on, as Task.cancel does.
    """
    while True:
        if waiting_on is None:
            await asyncio.sleep(0)  # a bare yield: give the loop one turn
        else:
            # As Task does: the flag a future sets when it is yielded by an
            # await must be cleared before the future is awaited again.
            waiting_on._asyncio_future_blocking = False
            try:
                await waiting_on
            except asyncio.CancelledError:
                if not waiting_on.done():
                    waiting_on.cancel()
            except BaseException:
                pass  # the coroutine gets the future's exception when it resumes
        try:
            waiting_on = step.send(None)
        except StopIteration:
            return


class Server:
    """Listens, tracks connections, and runs the daemon's life cycle."""

    def __init__(
        self,
        config: Config,
        backend: Backend,
        reload: Callable[[], Config] | None = None,
    ) -> None:
        self.config = config
        self.broker = Broker(backend, config)
        self.reload = reload
        self.connections: set[Connection] = set()
        self.loop: asyncio.AbstractEventLoop  # set by serve()
        self._stop: asyncio.Event | None = None
        self._signals = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.bound: tuple[str, int] | None = None

    def admit(self, connection: Connection) -> bool:
        if len(self.connections) >= self.config.max_connections:
            log.warning("refused a connection: max_connections (%d) reached", len(self.connections))
            return False
        self.connections.add(connection)
        self.broker.curr_connections = len(self.connections)
        self.broker.counters.total_connections += 1
        return True

    def forget(self, connection: Connection) -> None:
        self.connections.discard(connection)
        self.broker.curr_connections = len(self.connections)

    def spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = self.loop.create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def request_stop(self, why: str) -> None:
        log.info("stopping: %s", why)
        if self._stop is not None:
            self._stop.set()

    async def serve(self) -> None:
        """Run until stopped by a signal or the shutdown command."""
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            await self.broker.start()
        except StorageError as error:
            where = str(self.config.data_dir)
            if where in str(error):
                raise
            raise StorageError(f"{where}: {error}") from error
        server = await self.loop.create_server(
            lambda: Connection(self),
            self.config.listen,
            self.config.port,
            reuse_address=True,
            backlog=1024,
        )
        sock = server.sockets[0].getsockname()
        self.bound = (sock[0], sock[1])
        self._install_signals()
        idle = self.loop.create_task(self._reap_idle()) if self.config.idle_timeout else None
        log.info(
            "mqd %s listening on %s:%d, backend %s",
            __version__,
            self.bound[0],
            self.bound[1],
            self.broker.backend.name,
        )
        notify("READY=1")
        try:
            await self._stop.wait()
        finally:
            notify("STOPPING=1")
            if idle is not None:
                idle.cancel()
            server.close()
            await self._drain()
            await self.broker.stop()
            log.info("stopped")

    async def _drain(self) -> None:
        """Finish in-flight commands within `shutdown_timeout`, then close connections."""
        self.broker.begin_stop()
        for connection in list(self.connections):
            if connection.transport is not None:
                connection.transport.pause_reading()
        running = [c.task for c in self.connections if c.task is not None]
        if running:
            _, late = await asyncio.wait(running, timeout=self.config.shutdown_timeout)
            for task in late:
                task.cancel()
        for connection in list(self.connections):
            connection.close()
        # Give connection_lost callbacks (which give back open messages) a turn.
        await asyncio.sleep(0)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.config.shutdown_timeout)

    def _install_signals(self) -> None:
        self.loop.add_signal_handler(signal.SIGTERM, self._on_stop_signal, "SIGTERM")
        self.loop.add_signal_handler(signal.SIGINT, self._on_stop_signal, "SIGINT")
        self.loop.add_signal_handler(signal.SIGHUP, self._on_reload)

    def _on_stop_signal(self, name: str) -> None:
        self._signals += 1
        if self._signals > 1:
            log.warning("second %s: exiting now", name)
            os._exit(1)
        self.request_stop(name)

    def _on_reload(self) -> None:
        if self.reload is None:
            return
        try:
            config = self.reload()
        except ConfigError as error:
            log.error("reload failed, keeping the old settings: %s", error)
            return
        self.config = config
        self.broker.reconfigure(config)
        logging.getLogger().setLevel(config.log_level_number)
        log.info("reloaded %s", config.path or "settings")

    async def _reap_idle(self) -> None:
        # One timer for all connections is cheaper than re-arming one per read.
        timeout = self.config.idle_timeout
        while True:
            await asyncio.sleep(min(timeout, 1.0))
            cutoff = time.monotonic() - timeout
            for connection in list(self.connections):
                if connection.task is None and connection.last_active < cutoff:
                    log.debug("closing an idle connection")
                    connection.close()


def notify(state: str) -> None:
    """Tell systemd about our state, if it is listening (Type=notify).

    The protocol is one datagram on a Unix socket; a dependency for that would
    be larger than this function.
    """
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return
    if path.startswith("@"):  # abstract namespace
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(path)
            sock.sendall(state.encode())
    except OSError as error:
        log.warning("could not notify systemd (%s): %s", state, error)


def run(config: Config, backend: Backend, reload: Callable[[], Config] | None = None) -> None:
    """Serve until stopped, on uvloop when configured and installed."""
    use_uvloop = config.loop in ("uvloop", "auto")
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            if config.loop == "uvloop":
                raise ConfigError(
                    "server.loop = 'uvloop' but uvloop is not installed: pip install uvloop"
                ) from None
            use_uvloop = False
    if use_uvloop:
        uvloop.run(Server(config, backend, reload).serve())
    else:
        asyncio.run(Server(config, backend, reload).serve())
