"""Real memcached clients, unchanged, against a real daemon."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import memcache
import pytest
from pymemcache import serde
from pymemcache.client.base import Client

from mqd.testing.daemon import Daemon


def test_pymemcache_round_trip(daemon: Daemon, q: str) -> None:
    client = Client(daemon.address)
    assert client.set(q, b"hello") is True
    assert client.set(q, "world") is True
    assert client.get(q) == b"hello"
    assert client.get(q) == b"world"
    assert client.get(q) is None
    assert client.delete(q, noreply=False) is True
    assert client.delete(q, noreply=False) is False


def test_pymemcache_pickle_serde_keeps_flags(daemon: Daemon, q: str) -> None:
    client = Client(daemon.address, serde=serde.pickle_serde)
    objects = [{"job": 1, "args": [1, 2]}, 42, "text", ("a", None)]
    for obj in objects:
        client.set(q, obj)
    assert [client.get(q) for _ in objects] == objects


def test_pymemcache_keys_with_options(daemon: Daemon, q: str) -> None:
    client = Client(daemon.address)
    client.set(q, b"job")
    assert client.get(f"{q}/t=100/open") == b"job"
    assert client.get(f"{q}/close") is None
    assert client.get(f"{q}/t=100") is None
    client.set(q, b"next")
    assert client.get_many([f"{q}/peek", "missing"]) == {f"{q}/peek": b"next"}
    value, offset = client.gets(q)
    assert (value, offset) == (b"next", b"1")


def test_pymemcache_add_and_stats(daemon: Daemon, q: str) -> None:
    client = Client(daemon.address)
    assert client.add(q, b"x", noreply=False) is True
    assert client.add(q, b"x", noreply=False) is False
    stats = client.stats()
    assert stats[f"queue_{q}_items".encode()] == 1
    assert client.version() == b"1.0.0"


def test_python_memcached(daemon: Daemon, q: str) -> None:
    client = memcache.Client([f"127.0.0.1:{daemon.port}"])
    assert client.set(q, {"a": 1})
    assert client.set(q, 7)
    assert client.get(q) == {"a": 1}
    assert client.get(q) == 7
    assert client.get(q) is None
    client.set(q, "x")
    assert client.get(q + "/open") == "x"
    assert client.get(q + "/close") is None
    client.disconnect_all()


@pytest.mark.skipif(
    shutil.which("memccp") is None,
    reason="needs libmemcached's tools: apt-get install libmemcached-tools (bin/setup --test does)",
)
def test_libmemcached_tools(daemon: Daemon, q: str, tmp_path: Path) -> None:
    servers = f"--servers=127.0.0.1:{daemon.port}"
    message = tmp_path / q
    message.write_bytes(b"from libmemcached\n")
    for _ in range(2):
        subprocess.run(["memccp", servers, str(message)], check=True, timeout=30)
    for _ in range(2):
        got = subprocess.run(["memccat", servers, q], capture_output=True, timeout=30)
        # memccat prints the value and then a newline of its own.
        assert (got.returncode, got.stdout) == (0, b"from libmemcached\n\n")
    assert subprocess.run(["memccat", servers, q], capture_output=True, timeout=30).returncode != 0


@pytest.mark.skipif(
    shutil.which("memcstat") is None,
    reason="needs libmemcached's tools: apt-get install libmemcached-tools (bin/setup --test does)",
)
def test_libmemcached_reads_the_version_and_stats(daemon: Daemon) -> None:
    # libmemcached refuses a server whose major version is 0 ("strtol() failed
    # to parse major version"), and with it every stats call of its clients
    # (PHP's Memcached, memcstat), which ask the version first.
    servers = f"--servers=127.0.0.1:{daemon.port}"
    ping = subprocess.run(["memcping", servers], capture_output=True, timeout=30)
    assert ping.returncode == 0, ping.stderr
    stats = subprocess.run(["memcstat", servers], capture_output=True, text=True, timeout=30)
    assert stats.returncode == 0, stats.stderr
    assert f"Server: 127.0.0.1 ({daemon.port})" in stats.stdout
    assert "\tcurr_items: " in stats.stdout
