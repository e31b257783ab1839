"""systemd: the notification protocol from a real daemon, and bin/install-service as written."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from mqd.testing.daemon import Daemon

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def notify_socket() -> Iterator[tuple[socket.socket, str]]:
    """A fake systemd: a datagram socket in the abstract namespace (no path-length limit)."""
    name = f"mqd-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    yield sock, "@" + name
    sock.close()


Notify = tuple[socket.socket, str]


def messages(sock: socket.socket, until: str, times: int = 1, wait: float = 5.0) -> list[str]:
    """Datagrams received until `times` of them equal `until` (fails after `wait` seconds)."""
    got: list[str] = []
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        got.append(sock.recv(4096).decode())
        if got.count(until) == times:
            return got
    raise AssertionError(f"no {times} x {until} within {wait}s; got {got}")


# Linux's value (asm-generic/socket.h); Python's socket module does not export it.
SO_TIMESTAMP = 29


def ping_arrivals(sock: socket.socket, count: int) -> list[float]:
    """Kernel arrival times of the next `count` WATCHDOG=1 datagrams.

    SO_TIMESTAMP must be on before they arrive: the kernel stamps a datagram
    as it queues it, and one queued without a stamp reads as received now.
    """
    stamp = struct.Struct("@ll")  # struct timeval
    arrivals: list[float] = []
    while len(arrivals) < count:
        data, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(stamp.size))
        assert data == b"WATCHDOG=1", data
        ((level, kind, raw),) = ancillary
        assert (level, kind) == (socket.SOL_SOCKET, SO_TIMESTAMP)
        seconds, micros = stamp.unpack(raw[: stamp.size])
        arrivals.append(seconds + micros / 1e6)
    return arrivals


def test_ready_watchdog_and_stopping(
    tmp_path: Path, notify_socket: tuple[socket.socket, str]
) -> None:
    sock, address = notify_socket
    # WatchdogSec=0.4s: pings every 0.2 s.
    env = {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "400000"}
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMP, 1)
    daemon = Daemon(tmp_path, env=env).start()
    try:
        assert messages(sock, "READY=1")[-1] == "READY=1"
        arrivals = ping_arrivals(sock, 4)
        # Four pings 0.2 s apart span 0.6 s as the kernel saw them arrive, however
        # late the test reads them; pings sent back to back would span far less.
        assert 0.55 < arrivals[-1] - arrivals[0] < 4, arrivals
        assert daemon.stop() == 0
        assert messages(sock, "STOPPING=1")[-1] == "STOPPING=1"
    finally:
        daemon.kill()


def test_no_pings_for_another_process(
    tmp_path: Path, notify_socket: tuple[socket.socket, str]
) -> None:
    sock, address = notify_socket
    # WATCHDOG_PID names the process meant to ping; here it is not the daemon.
    env = {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "200000", "WATCHDOG_PID": "1"}
    with Daemon(tmp_path, env=env) as daemon:
        assert messages(sock, "READY=1")[-1] == "READY=1"
        sock.settimeout(0.6)
        with pytest.raises(TimeoutError):
            sock.recv(4096)
        sock.settimeout(5)
        daemon.stop()
        assert messages(sock, "STOPPING=1") == ["STOPPING=1"]


def test_the_unit_has_a_watchdog() -> None:
    unit = (ROOT / "systemd" / "mqd.service").read_text()
    assert "\nWatchdogSec=30s\n" in unit
    assert "\nType=notify\n" in unit
    assert "\nRestart=on-failure\n" in unit


needs_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed (bin/setup --test installs the systemd package)",
)


def install(*args: str) -> subprocess.CompletedProcess[str]:
    """bin/install-service; always with arguments, never onto this machine's /opt and /etc."""
    assert args
    command = [str(ROOT / "bin" / "install-service"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def verify(unit: Path) -> subprocess.CompletedProcess[str]:
    command = ["systemd-analyze", "verify", str(unit)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


@needs_analyze
@pytest.mark.timeout(600)  # two installs into a fresh venv, each allowed 300 s (install())
def test_install_service_stages_a_verified_unit(tmp_path: Path) -> None:
    root = tmp_path / "root"
    builds = [ROOT / "build", ROOT / "plugins" / "bdb" / "build"]
    built_before = [b.exists() for b in builds]
    result = install("--root", str(root))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "systemd-analyze verify: OK" in result.stdout
    mqd = root / "opt" / "mqd" / ".venv" / "bin" / "mqd"
    config = root / "etc" / "mqd" / "mqd.toml"
    unit = root / "etc" / "systemd" / "system" / "mqd.service"
    assert os.access(mqd, os.X_OK)
    assert config.read_text() == (ROOT / "etc" / "mqd.toml").read_text()
    assert (root / "opt" / "mqd" / "README.md").is_file()
    text = unit.read_text()
    assert f"ExecStart={mqd} serve --config {config}\n" in text
    for line in text.splitlines():  # every path the unit names is under the root
        if "/opt/mqd" in line or "/etc/mqd" in line:
            assert str(root) in line, line
    # The unit as installed passes systemd's own check (the script ran it too).
    checked = verify(unit)
    assert checked.returncode == 0, checked.stderr
    # The installed daemon is a working mqd from its own venv.
    version = subprocess.run([str(mqd), "version"], capture_output=True, text=True, timeout=60)
    assert version.stdout.startswith("mqd ")

    # A second run keeps an operator's edited config and leaves a unit that still verifies.
    config.write_text('[server]\nport = 22199\n[storage]\nbackend = "memory"\n')
    again = install("--root", str(root))
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"keeping the existing {config}" in again.stdout
    assert "port = 22199" in config.read_text()
    assert verify(unit).returncode == 0
    # Built from a copy: the checkout gains no build/ directories.
    assert [b.exists() for b in builds] == built_before


@needs_analyze
def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    # The check the install relies on fails where it should: a unit whose
    # ExecStart does not exist.
    unit = tmp_path / "mqd.service"
    text = (ROOT / "systemd" / "mqd.service").read_text()
    unit.write_text(text.replace("/opt/mqd/.venv/bin/mqd", str(tmp_path / "missing" / "mqd")))
    checked = verify(unit)
    assert checked.returncode != 0
    assert "is not executable" in checked.stderr


def test_install_service_refuses_unknown_arguments() -> None:
    result = install("--prefix-typo", "/x")
    assert result.returncode == 2
    assert "unknown argument: --prefix-typo" in result.stderr


def test_a_wedged_loop_stops_the_pings(
    notify_socket: Notify, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pings come from the event loop itself: while it is blocked, none
    # go out, which is what lets systemd's watchdog see a wedged daemon.
    from mqd.systemd import watchdog

    sock, address = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    arrivals: list[float] = []
    done = threading.Event()

    def listen() -> None:
        sock.settimeout(0.05)
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                sock.recv(64)
                arrivals.append(time.monotonic())

    listener = threading.Thread(target=listen)
    listener.start()

    async def run() -> float:
        pinger = asyncio.get_running_loop().create_task(watchdog(0.05))
        await asyncio.sleep(0.2)
        wedged = time.monotonic()
        time.sleep(0.6)  # blocks the loop, as a runaway computation would
        await asyncio.sleep(0.2)
        pinger.cancel()
        return wedged

    wedged = asyncio.run(run())
    done.set()
    listener.join()
    before = [t for t in arrivals if t < wedged]
    during = [t for t in arrivals if wedged + 0.05 < t < wedged + 0.55]
    after = [t for t in arrivals if t > wedged + 0.6]
    assert len(before) >= 2 and after
    assert during == []
