"""Loopback ports for the servers that tests and benchmarks start, and proof they took them.

A port is drawn below the kernel's ephemeral range (32768 and up by
default), which every client socket and every bind to port 0 on the machine
draws from: a client connecting elsewhere cannot take it in the moment
between the draw and the server's bind. Where the tests run in several
processes (pytest-xdist), each draws from a span of its own, so two of them
never hand out the same port, nor take the port of a daemon the other
restarts. A draw is still a guess about the rest of the machine; `listens`
tells whether the server itself holds the port, which a connection that
reaches some other program cannot.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path
from typing import Final

HOST: Final = "127.0.0.1"
LOW: Final = 10000
HIGH: Final = 32000  # below 32768, where the ephemeral range starts by default
_LISTEN: Final = "0A"  # the state column of /proc/net/tcp for LISTEN


def span() -> tuple[int, int]:
    """The ports this process draws from: all of LOW to HIGH, or its pytest-xdist worker's share."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2:
        return LOW, HIGH
    width = (HIGH - LOW) // count
    start = LOW + int(worker[2:]) % count * width
    return start, start + width


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to right now, drawn from span()."""
    low, high = span()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, high)
        with socket.socket() as sock:
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # a crowded span: let the kernel choose
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def listens(pid: int, port: int) -> bool:
    """Whether process `pid` itself has a listening TCP socket on `port`."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return False
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:
            continue
    return False
