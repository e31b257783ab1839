"""Batch drains: the rows a job read leave their queues only when the job succeeded.

A batch read has no commit step in PySpark's data source API, so the driver
listens for finished queries (a QueryExecutionListener, through py4j): when a
query succeeds, the leases its drain scans' tasks reserved are acknowledged
(their messages removed for good); when it fails, they are given back to
their queues, to be read again. Spark delivers that event on its listener
thread just before the action returns; wait_for_commits() waits for it.
"""

from __future__ import annotations

import logging
import pickle
from collections import deque
from collections.abc import Iterator
from typing import Any

from pyspark.sql import SparkSession

from mqd_spark import leases
from mqd_spark.leases import LeasePartition

log = logging.getLogger(__name__)

LISTENER = "org.apache.spark.sql.util.QueryExecutionListener"
# Above a drain scan these keep only some of the rows the tasks read: the
# others would be removed without ever reaching the caller, so such a query
# gives every row back (the `limit` option bounds a drain instead).
PARTIAL = ("Limit", "TakeOrdered", "Sample")

_committers: dict[int, DrainCommitter] = {}


class DrainCommitter:
    """Settles the leases of finished queries' drain scans."""

    def __init__(self) -> None:
        # (queue, leases that held messages) of the latest acknowledgements
        self.committed: deque[tuple[str, int]] = deque(maxlen=1000)

    def onSuccess(self, funcName: str, qe: Any, durationNs: int) -> None:
        self._settle(qe, succeeded=True)

    def onFailure(self, funcName: str, qe: Any, exception: Any) -> None:
        self._settle(qe, succeeded=False)

    def _settle(self, qe: Any, *, succeeded: bool) -> None:
        try:
            self.settle(qe.executedPlan(), succeeded=succeeded)
        except Exception:  # a failure here must not stop Spark's listener thread
            log.exception(
                "mqd drain: settling the leases failed; their messages go back to their "
                "queues when the visibility timeout passes"
            )

    def settle(self, plan: Any, *, succeeded: bool) -> None:
        partitions: list[LeasePartition] = []
        partial = False
        for node in _nodes(plan):
            name = node.getClass().getSimpleName()
            partial = partial or any(word in name for word in PARTIAL)
            if name == "BatchScanExec":
                partitions += _lease_partitions(node)
        if not partitions:
            return
        if partial and succeeded:
            log.warning("mqd drain: the query keeps only some rows read; they go back")
        ack = succeeded and not partial
        settled = leases.settle(partitions, ack=ack)
        if ack:
            for queue in sorted({p.queue for p in partitions}):
                self.committed.append((queue, settled))

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


def _lease_partitions(scan: Any) -> Iterator[LeasePartition]:
    partitions = scan.inputPartitions().iterator()
    while partitions.hasNext():
        partition = partitions.next()
        if not hasattr(partition, "pickedPartition"):
            return
        data = bytes(partition.pickedPartition())
        if b"mqd_spark.leases" not in data:  # a peek, or another Python data source
            return
        value = pickle.loads(data)
        if isinstance(value, LeasePartition):
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
