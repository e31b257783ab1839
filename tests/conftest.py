"""Fixtures: a real daemon on a loopback port, and a raw-socket client for byte-exact checks."""

from __future__ import annotations

import contextlib
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from mqd.testing.daemon import Daemon
from mqd.testing.raw import Raw as Raw  # the tests import it from here

# One daemon serves most tests; each test uses its own queue names (see `q`).
SHARED_CONFIG = """
[server]
max_wait = 2
allow_shutdown = false

[queues."limited.*"]
max_items = 2

[queues."bytes.*"]
max_bytes = 10

[queues."drop.*"]
max_items = 2
overflow = "drop_oldest"

[queues."vt.*"]
visibility_timeout = 0.5

[queues."dl.*"]
visibility_timeout = 0.3
max_deliveries = 2

[queues."dlx.*"]
max_deliveries = 1
dead_letter = "graveyard"

[queues."uniq.*"]
unique = true

[queues."small.*"]
max_item_size = 10
[queues."idle.*"]
idle_expiry = 0.5
[queues."fan*+full"]
max_items = 1
[queues."fan*+once"]
unique = true
"""


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with Daemon(tmp_path_factory.mktemp("mqd"), config_text=SHARED_CONFIG, redis=True) as d:
        yield d


@pytest.fixture
def q() -> str:
    """A queue name no other test uses."""
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def raw(daemon: Daemon) -> Iterator[Raw]:
    conn = Raw(daemon.address)
    yield conn
    conn.close()


def connect(daemon: Daemon) -> Raw:
    return Raw(daemon.address)


def store(conn: Raw, queue: str, body: bytes, flags: int = 0, exptime: int = 0) -> None:
    head = b"set %b %d %d %d\r\n" % (queue.encode(), flags, exptime, len(body))
    conn.call(head + body + b"\r\n", b"STORED\r\n")


def value(key: str, body: bytes, flags: int = 0) -> bytes:
    return b"VALUE %b %d %d\r\n%b\r\n" % (key.encode(), flags, len(body), body)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    """A loopback port another socket listens on, for start-up errors."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield int(taken.getsockname()[1])
