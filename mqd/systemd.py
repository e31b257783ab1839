"""systemd's notification protocol: READY=1, STOPPING=1 and the watchdog's WATCHDOG=1.

The protocol is one datagram on a Unix socket named by NOTIFY_SOCKET; a
dependency for that would be larger than this module.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(state: str) -> None:
    """Tell systemd about our state, if it is listening (Type=notify)."""
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


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings: half of WatchdogSec=, or None when it is off.

    As sd_watchdog_enabled(3): WATCHDOG_USEC gives the timeout, and
    WATCHDOG_PID, when set, must be this process.
    """
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2 / 1_000_000


async def watchdog(interval: float) -> None:
    """Ping systemd's watchdog from the event loop until cancelled.

    The pings come from a coroutine, not a thread, on purpose: when the loop
    is wedged they stop, and systemd restarts the daemon.
    """
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)
