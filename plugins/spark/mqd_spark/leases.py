"""Drains through named leases: exact while other consumers read the same queue.

A drain's partition names its leases instead of ids: its task reserves them
(`gets q/lease=<name>/n=<count>`) and reads what they hold in the same reply,
so every message crosses the wire once. Asking a lease again gives the same
messages, so a retried task reads what the failed attempt read. The driver
acknowledges every lease of a job that succeeded (`delete q/lease=<name>`) and
gives back those of a job that failed (`get q/lease=<name>/abort`); messages
of a lease nobody settles go back to the queue when its visibility timeout
passes. The lease names of a job are made from a random base when it is
planned, one per LEASE_ROWS messages.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import closing

import pyarrow as pa
from pyspark.sql.datasource import InputPartition

from mqd_spark import rows
from mqd_spark.wire import Address, Connection

# Messages one lease reserves: a reply of a few MB at most for small bodies
# (the daemon allows 100,000 and 64 MiB of bodies), and a task pipelines several.
LEASE_ROWS = 10_000


class LeasePartition(InputPartition):
    """Leases (name, count) of one queue on one server, read in order by one task.

    Each lease holds its messages for `hold_s` seconds after it was last named.
    """

    def __init__(
        self, server: Address, queue: str, leases: list[tuple[str, int]], hold_s: int
    ) -> None:
        super().__init__((server, queue, leases, hold_s))
        self.server, self.queue, self.leases, self.hold_s = server, queue, leases, hold_s


def new_base() -> str:
    return "spark-" + uuid.uuid4().hex


def plan(
    server: Address, queue: str, base: str, count: int, rows_per_part: int, hold_s: int
) -> list[LeasePartition]:
    """`count` messages of `queue` as partitions of about `rows_per_part`.

    A lease holds up to LEASE_ROWS messages, and fewer when a partition is to
    hold fewer, so that `partitions` cuts a small drain too.
    """
    size = max(1, min(LEASE_ROWS, rows_per_part))
    names = [
        (f"{base}-{i}", min(size, count - start)) for i, start in enumerate(range(0, count, size))
    ]
    per_part = max(1, -(-rows_per_part // size))
    return [
        LeasePartition(server, queue, names[i : i + per_part], hold_s)
        for i in range(0, len(names), per_part)
    ]


def read(partition: LeasePartition, timeout: float) -> Iterator[pa.RecordBatch]:
    with closing(Connection(partition.server, timeout)) as conn:
        for got in conn.lease_read(partition.queue, partition.leases, partition.hold_s):
            yield rows.record_batch(partition.queue, got)


def settle(partitions: Iterable[LeasePartition], *, ack: bool, timeout: float = 30.0) -> int:
    """Acknowledges (or gives back) every lease of `partitions`; the leases that held any.

    One connection per server, the commands pipelined.
    """
    by_server: dict[Address, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for p in partitions:
        by_server[p.server][p.queue] += [name for name, _ in p.leases]
    settled = 0
    for server, queues in sorted(by_server.items()):
        with closing(Connection(server, timeout)) as conn:
            for queue, names in sorted(queues.items()):
                if ack:
                    settled += conn.lease_ack(queue, names)
                else:
                    conn.lease_abort(queue, names)
    return settled
