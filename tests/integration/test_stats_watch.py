"""`mqd stats --watch`: a bounded number of refreshes of the tables from a real daemon."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pymemcache.client.base import Client

from mqd.testing.daemon import Daemon


def watch(daemon: Daemon, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "mqd", "stats", "--port", str(daemon.port), "--watch"]
    return subprocess.Popen(
        [*command, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


@pytest.fixture
def lone(tmp_path: Path) -> Iterator[Daemon]:
    """A daemon of its own: the shared one's many queues would crowd the table."""
    with Daemon(tmp_path) as daemon:
        yield daemon


def test_watch_refreshes_the_tables(lone: Daemon, q: str) -> None:
    daemon = lone
    client = Client(daemon.address, timeout=5)
    client.set(q, b"first")
    proc = watch(daemon, "--count", "3", "--interval", "1")
    assert proc.stdout is not None
    # Read the first refresh up to the queue's row, then change what it shows.
    seen = ""
    deadline = time.monotonic() + 20
    while q not in seen and time.monotonic() < deadline:
        seen += proc.stdout.readline()
    assert "(refresh 1)" in seen
    client.set(q, b"second")
    out = proc.stdout.read()  # the same buffered reader: nothing is skipped
    proc.wait(30)
    client.close()
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    frames = (seen + out).split("(refresh ")[1:]
    assert [f[0] for f in frames] == ["1", "2", "3"]
    rows = [next(line for line in f.splitlines() if q in line) for f in frames]
    # Columns: queue, items, bytes, ...: one message at first, two after the set.
    assert rows[0].split("│")[2].strip() == "1"
    assert rows[-1].split("│")[2].strip() == "2"


def test_watch_on_a_terminal_redraws_in_place(daemon: Daemon) -> None:
    proc = watch(daemon, "--count", "2", "--interval", "0.2", env={"FORCE_COLOR": "1"})
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "(refresh 2)" in out
    assert "\x1b[" in out  # cursor movement: the second frame overwrites the first


def test_watch_needs_a_positive_count(daemon: Daemon) -> None:
    proc = watch(daemon, "--count", "0")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "Invalid value for '--count'" in err
