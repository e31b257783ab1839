"""Shared by the Spark tests: seeding and checking queues with a plain memcached client."""

from __future__ import annotations

from pymemcache.client.base import Client

from mqd.testing.daemon import Daemon


def servers(*daemons: Daemon) -> str:
    return ",".join(f"127.0.0.1:{d.port}" for d in daemons)


def fill(daemon: Daemon, queue: str, bodies: list[bytes]) -> None:
    client = Client(daemon.address)
    for body in bodies:
        assert client.set(queue, body, noreply=False)
    client.close()


def items(daemon: Daemon, queue: str) -> int:
    client = Client(daemon.address)
    stats = client.stats("queues")
    client.close()
    return int(stats.get(f"queue_{queue}_items".encode(), 0))


def take_all(daemon: Daemon, queue: str) -> list[bytes]:
    client = Client(daemon.address)
    out = []
    while (body := client.get(queue)) is not None:
        out.append(body)
    client.close()
    return out
