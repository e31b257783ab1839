"""The `[storage.aerospike]` table: where the cluster is and how the queues use it."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mqd.config import TableReader

#: Set names are at most 63 bytes; the prefix leaves room for the suffixes.
MAX_PREFIX = 50


@dataclass(frozen=True)
class AerospikeConfig:
    """Every field is a key of the config table (queue_shards is a sub-table)."""

    #: Seed nodes, "host:port"; the client discovers the rest of the cluster.
    hosts: tuple[tuple[str, int], ...] = (("127.0.0.1", 3000),)
    namespace: str = "test"
    #: Sets are "<prefix>_meta" (one record per queue shard) and "<prefix>_buf".
    set_prefix: str = "mqd"
    user: str = ""
    password: str = ""
    #: TLS is used when tls_name is set: the name on the server's certificate.
    tls_name: str = ""
    cafile: str = ""
    certfile: str = ""
    keyfile: str = ""
    connect_timeout_ms: int = 2000
    #: Per call: the whole call, and each network attempt of it.
    total_timeout_ms: int = 2000
    socket_timeout_ms: int = 1000
    #: Extra attempts for reads; writes are never retried by the client, since
    #: a retried commit whose first attempt landed would look refused.
    retries: int = 2
    #: Connections the client may open to each node.
    max_conns_per_node: int = 128
    #: Threads making blocking client calls, off the event loop.
    threads: int = 8
    #: How long a queue shard's lock is held at most before the next requester may break it.
    lock_lease_ms: int = 1000
    #: From [storage] poll_interval_ms: how often queues that gets wait on are
    #: polled for messages other daemons put.
    poll_interval_ms: int = 50
    #: The largest message body to plan buffer records for: entries per record
    #: are as many as fit at this size, and larger bodies are refused.
    max_item_size: int = 1 << 20
    #: Operations one lock and one commit may serve at most.
    max_batch: int = 512
    #: Shards of a new queue; `queue_shards` overrides it by glob, last match wins.
    shards: int = 1
    queue_shards: tuple[tuple[str, int], ...] = field(default=())

    def shards_for(self, queue: str) -> int:
        count = self.shards
        for pattern, value in self.queue_shards:
            if fnmatch.fnmatchcase(queue, pattern):
                count = value
        return count

    @classmethod
    def from_table(
        cls, table: Mapping[str, Any], path: Path | None, poll_interval_ms: int = 50
    ) -> AerospikeConfig:
        """Validate the table; ConfigError names file, key, value and what is allowed."""
        reader = TableReader(path, dict(table), "storage.aerospike.")
        values: dict[str, Any] = {"poll_interval_ms": poll_interval_ms}
        if "hosts" in reader.table:
            values["hosts"] = _hosts(reader)
        for key in (
            "namespace",
            "set_prefix",
            "user",
            "password",
            "tls_name",
            "cafile",
            "certfile",
            "keyfile",
        ):
            if key in reader.table:
                values[key] = reader.string(key)
        limits = {
            "connect_timeout_ms": (1, 600_000),
            "total_timeout_ms": (1, 600_000),
            "socket_timeout_ms": (1, 600_000),
            "retries": (0, 100),
            "max_conns_per_node": (1, 100_000),
            "threads": (1, 1024),
            "lock_lease_ms": (50, 600_000),
            "max_item_size": (1, 8 << 20),
            "max_batch": (1, 100_000),
            "shards": (1, 1024),
        }
        for key, (low, high) in limits.items():
            if key in reader.table:
                values[key] = reader.integer(key, low, high)
        if "queue_shards" in reader.table:
            values["queue_shards"] = _queue_shards(reader)
        own = [name for name in cls.__dataclass_fields__ if name != "poll_interval_ms"]
        reader.leftovers(own)
        config = cls(**values)
        if not config.namespace:
            raise reader.fail("namespace", config.namespace, "must name a namespace")
        prefix = config.set_prefix
        if not prefix or len(prefix) > MAX_PREFIX or not prefix.isascii() or "\0" in prefix:
            allowed = f"must be 1 to {MAX_PREFIX} ASCII characters"
            raise reader.fail("set_prefix", prefix, allowed)
        return config


def _hosts(reader: TableReader) -> tuple[tuple[str, int], ...]:
    allowed = 'must be a non-empty list of "host:port" strings, e.g. ["127.0.0.1:3000"]'
    raw = reader.take("hosts", list, allowed)
    hosts = []
    for item in raw:
        host, colon, port = item.rpartition(":") if isinstance(item, str) else ("", "", "")
        if not (host and colon and port.isdigit() and 0 < int(port) < 65536):
            raise reader.fail("hosts", raw, allowed)
        hosts.append((host.strip("[]"), int(port)))
    if not hosts:
        raise reader.fail("hosts", raw, allowed)
    return tuple(hosts)


def _queue_shards(reader: TableReader) -> tuple[tuple[str, int], ...]:
    allowed = 'must be a table of queue glob = shards (1 to 1024), e.g. {"jobs.*" = 8}'
    raw = reader.take("queue_shards", dict, allowed)
    out = []
    for pattern, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1024:
            raise reader.fail(f'queue_shards."{pattern}"', value, allowed)
        out.append((pattern, value))
    return tuple(out)
