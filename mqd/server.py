"""The daemon: listens, admits connections, runs the life cycle.

One event loop, one thread; each client is a `mqd.connection.Connection`.
At start the descriptor limit is raised and max_connections fitted to it.
Signals: TERM/INT stop gracefully (a second one forces the exit), HUP reloads
per-queue settings and the users file. With NOTIFY_SOCKET set, systemd is
told READY=1 and STOPPING=1, and pinged with WATCHDOG=1 when WatchdogSec= is set.
With `[metrics] port` set, Prometheus metrics are served (mqd.metrics).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import ssl
import time
from collections.abc import Awaitable, Callable

from mqd import __version__, security
from mqd.backend import Backend
from mqd.broker import Broker
from mqd.config import Config, needs_restart
from mqd.connection import Connection
from mqd.errors import ConfigError, StorageError
from mqd.listener import Listener, Throttled, descriptors_in_use, raise_descriptor_limit
from mqd.metrics import Metrics
from mqd.systemd import notify, watchdog, watchdog_interval

__all__ = ["Connection", "Server", "notify", "run"]

log = logging.getLogger(__name__)

# Descriptors kept beyond those open at start and those the backend says it
# may open (Backend.descriptors()): for its log files and the like, and (an
# eighth of the limit) for clients that are being refused.
DESCRIPTOR_RESERVE = 64
REAP_MIN_S = 0.01  # the reaper's shortest sleep, however short the timeouts it enforces
GC_YOUNG = 50_000  # allocations between passes of the cycle collector over young objects


class Server:
    """Listens, tracks connections, and runs the daemon's life cycle."""

    def __init__(
        self,
        config: Config,
        backend: Backend,
        reload: Callable[[], Config] | None = None,
    ) -> None:
        self.config = config
        self.started_with = config  # what a reload cannot change (config.RESTART_ONLY)
        self.broker = Broker(backend, config)
        self.reload = reload
        self.authenticator = security.authenticator(config)
        self.auth_failures = Throttled(log, logging.WARNING)
        self.storage_failed = Throttled(log, logging.ERROR)
        self.max_connections = config.max_connections  # lowered to fit the descriptor limit
        # Whether pipelined sets and gets are started together (see
        # Connection._run_group); not while they may run at once, replies held.
        self.overlap = not backend.answers_held
        self.refused = Throttled(log, logging.WARNING)
        self._slow = Throttled(log, logging.INFO)
        self.connections: set[Connection] = set()
        self.loop: asyncio.AbstractEventLoop  # set by serve()
        self._stop: asyncio.Event | None = None
        self._signals = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.bound: tuple[str, int] | None = None
        self.metrics: Metrics | None = None
        if config.metrics_port:
            self.metrics = Metrics(config.metrics_listen, config.metrics_port)

    def admit(self, connection: Connection) -> bool:
        if len(self.connections) >= self.max_connections:
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
        tls = security.server_context(self.config)
        limit = raise_descriptor_limit()
        if self.metrics is not None:  # first: a port in use fails before storage opens
            self.metrics.start(self.loop, self.broker.stats)
        try:
            await self.broker.start()
        except (StorageError, OSError) as error:
            where = str(self.config.data_dir)
            if isinstance(error, StorageError) and where in str(error):
                raise
            reason = error.strerror if isinstance(error, OSError) and error.strerror else error
            raise StorageError(f"{where}: {reason}") from error
        self._fit_descriptors(limit)
        # Redis first: once the memcached port answers, both do.
        redis = self._listen_redis(tls)
        listener = Listener.open(
            self.config.listen, self.config.port, lambda: Connection(self), tls
        )
        await asyncio.sleep(0)  # accept whoever is already waiting before anything else
        self.bound = listener.address
        self._install_signals()
        timed = self.config.idle_timeout or self.config.command_timeout
        reaper = self.loop.create_task(self._reap()) if timed else None
        log.info(
            "mqd %s listening on %s:%d%s, backend %s",
            __version__,
            self.bound[0],
            self.bound[1],
            " (TLS)" if tls else "",
            self.broker.backend.name,
        )
        notify("READY=1")
        interval = watchdog_interval()
        pinger = self.loop.create_task(watchdog(interval)) if interval else None
        try:
            await self._stop.wait()
        finally:
            notify("STOPPING=1")
            for task in (reaper, pinger):
                if task is not None:
                    task.cancel()
            if self.metrics is not None:
                await asyncio.to_thread(self.metrics.stop)
            listener.close()
            if redis is not None:
                redis.close()
            await self._drain()
            await self.broker.stop()
            log.info("stopped")

    def _listen_redis(self, tls: ssl.SSLContext | None) -> Listener | None:
        """The Redis listener, same loop, broker and TLS, when [server.redis] asks for it."""
        config = self.config
        if config.redis_port is None:
            return None
        from mqd.redis_server import RedisConnection

        listen = config.redis_listen or config.listen
        try:
            listener = Listener.open(listen, config.redis_port, lambda: RedisConnection(self), tls)
        except OSError as error:
            where = f"{config.path}: " if config.path else ""
            raise ConfigError(
                f"{where}server.redis: cannot listen on {listen}:{config.redis_port}: {error}"
            ) from None
        log.info("redis protocol on %s:%d%s", *listener.address, " (TLS)" if tls else "")
        return listener

    def _fit_descriptors(self, limit: int) -> None:
        """Lower max_connections to what the descriptor limit leaves (one line says so)."""
        storage = self.broker.backend.descriptors()
        reserve = descriptors_in_use() + DESCRIPTOR_RESERVE + limit // 8 + storage
        fits = max(1, limit - reserve)
        if fits < self.config.max_connections:
            log.warning(
                "max_connections lowered from %d to %d: the descriptor limit is %d and %d are "
                "kept for storage and listening (raise it with ulimit -n or LimitNOFILE)",
                self.config.max_connections,
                fits,
                limit,
                reserve,
            )
        self.max_connections = min(self.config.max_connections, fits)

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
        try:
            authenticator = security.authenticator(config)
        except ConfigError as error:
            log.error("reload failed, keeping the old settings: %s", error)
            return
        unapplied = needs_restart(self.started_with, config)
        self.config = config
        self.broker.reconfigure(config)
        if authenticator is not None:  # a users file can change; auth cannot be turned off
            self.authenticator = authenticator
        logging.getLogger().setLevel(config.log_level_number)
        if unapplied:
            log.warning(
                "reloaded %s; these differ from what the daemon started with and take effect"
                " on restart only: %s",
                config.path or "settings",
                ", ".join(unapplied),
            )
        else:
            log.info("reloaded %s", config.path or "settings")

    async def _reap(self) -> None:
        """Close connections idle for idle_timeout, or slower than command_timeout to send one.

        One timer for all connections is cheaper than re-arming one per read.
        """
        idle = self.config.idle_timeout
        slow = self.config.command_timeout
        while True:
            await asyncio.sleep(max(REAP_MIN_S, min(t for t in (idle, slow, 1.0) if t) / 2))
            now = time.monotonic()
            for connection in list(self.connections):
                if connection.closed:
                    continue  # closed already, its last replies still going out
                waiting = connection.task is not None and not connection.blocked_on_client
                started = connection.command_started
                if idle and not waiting and connection.last_active < now - idle:
                    log.debug("closing an idle connection")
                    connection.close()
                elif slow and started and started < now - slow and not connection.reading_paused:
                    self._slow("closing a connection: a command took over %g s to arrive", slow)
                    connection.close()


def run(config: Config, backend: Backend, reload: Callable[[], Config] | None = None) -> None:
    """Serve until stopped, on uvloop when configured and installed."""
    # Python's cycle collector looks at its youngest objects every 700
    # allocations by default. The daemon allocates a few tracked objects per
    # message (the message, a receipt, reply tuples) and keeps many of them
    # (queued and leased messages), and those passes then cost as much as the
    # work itself: on the memory backend, 1.2 of 2.2 us of CPU per message
    # leased and acknowledged, 0.7 of 1.05 per message read by range, 0.7 of
    # 2.6 per message stored. Fewer, larger passes keep cycles collected; what
    # start-up made is frozen out of them.
    gc.freeze()
    gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])
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
