"""Real Redis clients, unchanged, against a real daemon's Redis listener.

Every client runs the same contract: FIFO of three messages both ways
(LPUSH+RPOP, RPUSH+LPOP), BRPOP timing out and then woken by an LPUSH from
another connection, SADD/SCARD/SISMEMBER/SREM/SPOP on a unique queue, and a
message crossing from memcached to Redis and back. The Python clients run it
from `contract` below; PHP and Node run tests/clients/contract.php and
tests/clients/ioredis/contract.js, which print each step's result as JSON.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
from pymemcache.client.base import Client

from mqd.testing.daemon import Daemon

CLIENTS = Path(__file__).parent.parent / "clients"
IOREDIS = CLIENTS / "ioredis"
TIMEOUT = 60  # seconds any one client's whole contract may take


@dataclass
class Names:
    queue: str
    unique: str  # matches [queues."uniq.*"] unique = true in the shared config
    from_memcached: str
    to_memcached: str

    def args(self) -> list[str]:
        return [self.queue, self.unique, self.from_memcached, self.to_memcached]


@pytest.fixture
def names(daemon: Daemon, q: str) -> Iterator[Names]:
    n = Names(q, "uniq." + q, "in." + q, "out." + q)
    mc = Client(daemon.address)
    mc.set(n.from_memcached, b"from memcached")
    yield n
    assert mc.get(n.to_memcached) == b"from redis"
    mc.close()


def waker(daemon: Daemon, queue: str) -> Callable[[], None]:
    """Starts a timer that LPUSHes `woken` from another connection 0.3 s later."""

    def push() -> None:
        host, port = daemon.redis_address
        redis.Redis(host=host, port=port).lpush(queue, "woken")

    def start() -> None:
        threading.Timer(0.3, push).start()

    return start


def check(results: dict[str, Any], names: Names) -> None:
    assert results["fifo_lpush_rpop"] == ["m1", "m2", "m3", None]
    assert results["fifo_rpush_lpop"] == ["m1", "m2", "m3", None]
    got, waited = results["brpop_timeout"]
    assert not got
    assert 0.9 <= waited < 5
    assert list(results["brpop_woken"]) == [names.queue, "woken"]
    assert results["sadd"] == 2
    assert results["scard"] == 2
    assert [int(x) for x in results["sismember"]] == [1, 0]
    assert results["srem"] == 1
    assert results["spop"] == ["b", None, 0]
    assert results["from_memcached"] == "from memcached"
    assert results["to_memcached"] == 1


async def contract(client: Any, names: Names, wake: Callable[[], None]) -> dict[str, Any]:
    """The contract over any client whose methods are redis-py's, sync or async."""

    async def call(method: str, *args: Any, **options: Any) -> Any:
        result = getattr(client, method)(*args, **options)
        return await result if inspect.isawaitable(result) else result

    q, u = names.queue, names.unique
    out: dict[str, Any] = {}
    for push, pop in (("lpush", "rpop"), ("rpush", "lpop")):
        for m in ("m1", "m2", "m3"):
            await call(push, q, m)
        out[f"fifo_{push}_{pop}"] = [await call(pop, q) for _ in range(4)]
    start = time.monotonic()
    got = await call("brpop", [q], timeout=1)
    out["brpop_timeout"] = [got, time.monotonic() - start]
    wake()
    out["brpop_woken"] = await call("brpop", [q], timeout=10)
    out["sadd"] = await call("sadd", u, "a", "b", "a")
    out["scard"] = await call("scard", u)
    out["sismember"] = [await call("sismember", u, "a"), await call("sismember", u, "z")]
    out["srem"] = await call("srem", u, "a")
    out["spop"] = [await call("spop", u), await call("spop", u), await call("scard", u)]
    out["from_memcached"] = await call("rpop", names.from_memcached)
    out["to_memcached"] = await call("lpush", names.to_memcached, "from redis")
    return out


def test_redis_py(daemon: Daemon, names: Names) -> None:
    host, port = daemon.redis_address
    client = redis.Redis(host=host, port=port, decode_responses=True, socket_timeout=20)
    check(asyncio.run(contract(client, names, waker(daemon, names.queue))), names)
    client.close()


def test_redis_py_asyncio(daemon: Daemon, names: Names) -> None:
    async def run() -> dict[str, Any]:
        host, port = daemon.redis_address
        client = redis.asyncio.Redis(host=host, port=port, decode_responses=True)
        try:
            return await contract(client, names, waker(daemon, names.queue))
        finally:
            await client.aclose()

    check(asyncio.run(run()), names)


class RedisCli:
    """redis-cli, one process (one connection) per command, as a redis-py-like client."""

    def __init__(self, port: int) -> None:
        self.port = port

    def __getattr__(self, command: str) -> Callable[..., Any]:
        def run(*args: Any, timeout: float | None = None) -> Any:
            words = [str(a) for arg in args for a in (arg if isinstance(arg, list) else [arg])]
            if timeout is not None:
                words.append(str(timeout))
            argv = ["redis-cli", "-p", str(self.port), command.upper(), *words]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT, check=True)
            return self.parse(done.stdout)

        return run

    @staticmethod
    def parse(output: str) -> Any:
        lines = output.splitlines()
        if len(lines) > 1:
            return lines
        if not lines or not lines[0]:
            return None  # redis-cli prints nil as an empty line when not on a terminal
        return int(lines[0]) if lines[0].lstrip("-").isdigit() else lines[0]


@pytest.mark.skipif(
    shutil.which("redis-cli") is None,
    reason="needs redis-cli: apt-get install redis-tools (bin/setup --test does)",
)
def test_redis_cli(daemon: Daemon, names: Names) -> None:
    assert daemon.redis_port is not None
    cli = RedisCli(daemon.redis_port)
    check(asyncio.run(contract(cli, names, waker(daemon, names.queue))), names)


def run_script(argv: list[str], daemon: Daemon, names: Names) -> dict[str, Any]:
    """Run a client's contract script; LPUSH from here when it says it is waiting."""
    command = [*argv, str(daemon.redis_port), *names.args()]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(TIMEOUT, proc.kill)
    watchdog.start()
    results: dict[str, Any] = {}
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            step = json.loads(line)
            results[step["step"]] = step["value"]
            if step["step"] == "waiting":
                waker(daemon, names.queue)()
        _, errors = proc.communicate()
    finally:
        watchdog.cancel()
    assert proc.returncode == 0, errors
    return results


def php_has_redis() -> bool:
    if shutil.which("php") is None:
        return False
    modules = subprocess.run(["php", "-m"], capture_output=True, text=True, timeout=30).stdout
    return "redis" in modules.split()


@pytest.mark.skipif(
    not php_has_redis(),
    reason="needs PHP with phpredis: apt-get install php-cli php-redis (bin/setup --test does)",
)
def test_phpredis(daemon: Daemon, names: Names) -> None:
    check(run_script(["php", str(CLIENTS / "contract.php")], daemon, names), names)


@pytest.mark.skipif(
    shutil.which("node") is None or not (IOREDIS / "node_modules" / "ioredis").is_dir(),
    reason="needs node and ioredis: bin/setup --test runs npm ci in tests/clients/ioredis",
)
def test_ioredis(daemon: Daemon, names: Names) -> None:
    check(run_script(["node", str(IOREDIS / "contract.js")], daemon, names), names)
