"""The accept loop when the process is out of descriptors: it pauses, and says so once."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket

import pytest

from mqd import listener as listening
from mqd.listener import Listener, Throttled


class OutOfDescriptors:
    """A listening socket whose accept() fails with EMFILE, counting the tries."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.tries = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def setblocking(self, flag: bool) -> None:
        self.sock.setblocking(flag)

    def accept(self) -> tuple[socket.socket, object]:
        self.tries += 1
        raise OSError(errno.EMFILE, "Too many open files")

    def close(self) -> None:
        self.sock.close()


def test_accept_backs_off_on_emfile(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> int:
        sock = socket.create_server(("127.0.0.1", 0))
        failing = OutOfDescriptors(sock)
        listener = Listener(failing, asyncio.Protocol)  # type: ignore[arg-type]
        listener.resume()
        client = socket.create_connection(sock.getsockname())  # the socket stays readable
        await asyncio.sleep(1.0)
        listener.close()
        client.close()
        return failing.tries

    with caplog.at_level(logging.WARNING, logger="mqd.listener"):
        tries = asyncio.run(scenario())
    # Without the pause the loop would retry thousands of times a second.
    assert 2 <= tries <= 1.0 / listening.ACCEPT_PAUSE + 2
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "Too many open files" in warnings[0]


def test_throttled_counts_what_it_held_back(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("mqd.test.throttled")
    say = Throttled(log, logging.WARNING, interval=0.05)
    with caplog.at_level(logging.WARNING, logger="mqd.test.throttled"):
        for _ in range(100):
            say("refused %s", "x")
        asyncio.run(asyncio.sleep(0.06))
        say("refused %s", "y")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused x", "refused y (and 99 more in the last 0.05 s)"]
