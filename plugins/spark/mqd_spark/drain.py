"""Batch drains: the rows a job read leave their queues only when the job succeeded.

A batch read has no commit step in PySpark's data source API, so the driver
listens for finished queries (a QueryExecutionListener, through py4j): when a
query succeeds, the id ranges its drain scans planned are removed from their
queues, in id order; when it fails, nothing is removed and a rerun reads the
same rows again. Spark delivers that event on its listener thread just before
the action returns; wait_for_commits() waits for it.
"""

from __future__ import annotations

import logging
import pickle
from collections import deque
from collections.abc import Iterator
from contextlib import closing
from typing import Any

from pyspark.sql import SparkSession

from mqd_spark.source import MqdPartition
from mqd_spark.wire import Address, Connection, address_text

log = logging.getLogger(__name__)

LISTENER = "org.apache.spark.sql.util.QueryExecutionListener"
# Above a drain scan these keep only some of the rows the tasks read: the
# others would be removed without ever reaching the caller, so such a query
# removes nothing (the `limit` option bounds a drain instead).
PARTIAL = ("Limit", "TakeOrdered", "Sample")

_committers: dict[int, DrainCommitter] = {}


class DrainCommitter:
    """Removes what a successful query's drain scans read."""

    def __init__(self) -> None:
        # (server, queue, last id, number removed) of the latest commits
        self.committed: deque[tuple[str, str, int, int]] = deque(maxlen=1000)

    def onSuccess(self, funcName: str, qe: Any, durationNs: int) -> None:
        try:
            self.commit(qe.executedPlan())
        except Exception:  # a failure here must not stop Spark's listener thread
            log.exception("mqd drain: removing the rows read failed; they stay in the queue")

    def onFailure(self, funcName: str, qe: Any, exception: Any) -> None:
        """The query failed: its rows stay in their queues, to be read again."""

    def commit(self, plan: Any) -> None:
        partitions: list[MqdPartition] = []
        partial = False
        for node in _nodes(plan):
            name = node.getClass().getSimpleName()
            partial = partial or any(word in name for word in PARTIAL)
            if name == "BatchScanExec":
                partitions += [p for p in _mqd_partitions(node) if p.drain]
        if not partitions:
            return
        if partial:
            log.warning("mqd drain: the query keeps only some rows read; nothing removed")
            return
        last: dict[tuple[Address, str], int] = {}
        for p in partitions:
            key = (p.server, p.queue)
            last[key] = max(last.get(key, p.last), p.last)
        for (server, queue), end in sorted(last.items()):
            with closing(Connection(server)) as conn:
                removed = conn.remove_through(queue, end)
            self.committed.append((address_text(server), queue, end, removed))

    class Java:
        implements = [LISTENER]


def _nodes(plan: Any) -> Iterator[Any]:
    """Every node of a physical plan, also inside adaptive plans and query stages."""
    stack = [plan]
    while stack:
        node = stack.pop()
        name = node.getClass().getSimpleName()
        if name == "AdaptiveSparkPlanExec":
            stack.append(node.executedPlan())
            continue
        if name.endswith("QueryStageExec"):
            stack.append(node.plan())
            continue
        yield node
        children = node.children().iterator()
        while children.hasNext():
            stack.append(children.next())


def _mqd_partitions(scan: Any) -> Iterator[MqdPartition]:
    partitions = scan.inputPartitions().iterator()
    while partitions.hasNext():
        partition = partitions.next()
        if not hasattr(partition, "pickedPartition"):
            return
        data = bytes(partition.pickedPartition())
        if b"mqd_spark.source" not in data:  # another Python data source's partition
            return
        value = pickle.loads(data)
        if isinstance(value, MqdPartition):
            yield value


def install(spark: SparkSession) -> DrainCommitter | None:
    """Adds the committer to a classic session once; None on Spark Connect (no drain)."""
    jsession = getattr(spark, "_jsparkSession", None)
    if jsession is None:
        return None
    if jsession.hashCode() in _committers:
        return _committers[jsession.hashCode()]
    from pyspark.java_gateway import ensure_callback_server_started

    gateway = spark.sparkContext._gateway
    assert gateway is not None
    ensure_callback_server_started(gateway)  # type: ignore[no-untyped-call]
    committer = DrainCommitter()
    jsession.listenerManager().register(committer)
    _committers[jsession.hashCode()] = committer
    return committer


def wait_for_commits(spark: SparkSession, timeout_s: float = 60.0) -> None:
    """Returns once Spark has delivered every finished query to the committer."""
    spark.sparkContext._jsc.sc().listenerBus().waitUntilEmpty(int(timeout_s * 1000))
