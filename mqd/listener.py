"""Listening sockets that survive running out of descriptors, for any wire.

The event loops' own servers answer EMFILE by logging a traceback for every
failed accept (uvloop retries at once: thousands of lines a second), so mqd
accepts by hand: on EMFILE it stops accepting for a moment and says so once.
Connections are handed to `loop.connect_accepted_socket`, with TLS when a
context is given, so every wire gets the same behaviour.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import socket
import ssl
import time
from collections.abc import Callable

from mqd.eager import run_eagerly

log = logging.getLogger(__name__)

ACCEPT_BATCH = (
    64  # connections accepted per readiness event, so one listener cannot starve the loop
)
ACCEPT_PAUSE = 0.25  # seconds without accepting after the process ran out of descriptors
HANDSHAKE_TIMEOUT = 10.0  # seconds a TLS client has to finish its handshake
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class Throttled:
    """Logs a repeated event at most once per `interval` seconds, counting the rest.

    The standard logging module has no rate limit, and one line per event is
    what filled disks with 9,000 lines a second.
    """

    def __init__(self, logger: logging.Logger, level: int, interval: float = 10.0) -> None:
        self.logger = logger
        self.level = level
        self.interval = interval
        self._next = 0.0
        self._held = 0

    def __call__(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self._held += 1
            return
        if self._held:
            message += f" (and {self._held} more in the last {self.interval:g} s)"
        self._held = 0
        self._next = now + self.interval
        self.logger.log(self.level, message, *args)


def raise_descriptor_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20  # the kernel's usual nr_open
    if soft == resource.RLIM_INFINITY or soft >= hard:
        return soft if soft != resource.RLIM_INFINITY else hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    except (ValueError, OSError) as error:
        log.warning("could not raise the descriptor limit from %d to %d: %s", soft, hard, error)
        return soft


def descriptors_in_use() -> int:
    """Descriptors the process holds now (Linux's /proc; elsewhere a guess of 32)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 32


class Listener:
    """Accepts connections on `sock` into protocols made by `factory`."""

    def __init__(
        self,
        sock: socket.socket,
        factory: Callable[[], asyncio.Protocol],
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.sock = sock
        self.factory = factory
        self.tls = tls
        self.loop = asyncio.get_running_loop()
        self._accepting = False
        self._closed = False
        self._handshakes: set[asyncio.Task[None]] = set()
        self._out_of_descriptors = Throttled(log, logging.WARNING)
        self._failed = Throttled(log, logging.INFO)
        sock.setblocking(False)

    @classmethod
    def open(
        cls,
        host: str,
        port: int,
        factory: Callable[[], asyncio.Protocol],
        tls: ssl.SSLContext | None = None,
        backlog: int = 1024,
    ) -> Listener:
        """Bind and listen on `host`:`port` (0: any free port) and start accepting.

        Name resolution blocks: this runs once, at start-up, before any client.
        """
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(backlog)
        except OSError:
            sock.close()
            raise
        listener = cls(sock, factory, tls)
        listener.resume()
        return listener

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return str(host), int(port)

    def resume(self) -> None:
        if not self._accepting and not self._closed:
            self.loop.add_reader(self.sock.fileno(), self._accept)
            self._accepting = True

    def pause(self) -> None:
        if self._accepting:
            self.loop.remove_reader(self.sock.fileno())
            self._accepting = False

    def close(self) -> None:
        self.pause()
        self._closed = True
        self.sock.close()
        for task in self._handshakes:
            task.cancel()

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                if error.errno in _OUT_OF_RESOURCES:
                    self._out_of_descriptors(
                        "cannot accept connections: %s; pausing accepts for %g s",
                        error.strerror,
                        ACCEPT_PAUSE,
                    )
                    self.pause()
                    self.loop.call_later(ACCEPT_PAUSE, self.resume)
                    return
                # ECONNABORTED and the like: that client is gone, the next may not be.
                self._failed("accept failed: %s", error)
                continue
            conn.setblocking(False)
            # Eagerly: a plain connection is made within this call, as the
            # loops' own servers do, so a client that connects and leaves at
            # once is gone before the next one is counted.
            task = run_eagerly(self._connect(conn))
            if task is not None:
                self._handshakes.add(task)
                task.add_done_callback(self._handshakes.discard)

    async def _connect(self, conn: socket.socket) -> None:
        try:
            if self.tls is None:
                await self.loop.connect_accepted_socket(self.factory, conn)
            else:
                await self.loop.connect_accepted_socket(
                    self.factory, conn, ssl=self.tls, ssl_handshake_timeout=HANDSHAKE_TIMEOUT
                )
        except (TimeoutError, OSError, ssl.SSLError) as error:
            self._failed("a connection failed before it started: %s", error)
            conn.close()
