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
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from mqd_spark import leases
from mqd_spark.leases import LeasePartition

log = logging.getLogger(__name__)

LISTENER = "org.apache.spark.sql.util.QueryExecutionListener"
# Above a drain scan these keep only some of the rows the tasks read: the
# others would be removed without ever reaching the caller, so such a query
# gives every row back (the `limit` option bounds a drain instead).
PARTIAL = ("Limit", "TakeOrdered", "Sample", "Tail")
# How long leases are given back only once no task runs (_tasks_ended), at most.
QUIET_S = 10.0

_committers: dict[int, DrainCommitter] = {}


class DrainCommitter:
    """Settles the leases of finished queries' drain scans."""

    def __init__(self, context: Any) -> None:
        self.context = context  # the JVM's SparkContext
        # (queue, leases that held messages) of the latest acknowledgements
        self.committed: deque[tuple[str, int]] = deque(maxlen=1000)

    def onSuccess(self, funcName: str, qe: Any, durationNs: int) -> None:
        # `tail()` takes its rows from the end of the plan's output by a call,
        # not through a node of the plan: only its action's name tells.
        self._settle(qe, succeeded=True, partial="tail" in funcName.lower())

    def onFailure(self, funcName: str, qe: Any, exception: Any) -> None:
        self._settle(qe, succeeded=False)

    def _settle(self, qe: Any, *, succeeded: bool, partial: bool = False) -> None:
        try:
            self.settle(qe.executedPlan(), succeeded=succeeded, partial=partial)
        except Exception:  # a failure here must not stop Spark's listener thread
            log.exception(
                "mqd drain: settling the leases failed; their messages go back to their "
                "queues when the visibility timeout passes"
            )

    def settle(self, plan: Any, *, succeeded: bool, partial: bool = False) -> None:
        queues, settled = settle(
            plan, succeeded=succeeded, partial=partial, before_giving_back=self._tasks_ended
        )
        self.committed.extend((queue, settled) for queue in queues)

    def _tasks_ended(self) -> None:
        """Wait until the executors run no task, or QUIET_S.

        Spark reports a failed query while the tasks it cancelled may still
        run: one that reserves its lease after the leases were given back
        would hold those messages until `lease_timeout`. The executors' count
        of running tasks is all Spark offers here; other jobs' tasks make the
        wait longer, never longer than QUIET_S.
        """
        tracker = self.context.statusTracker()
        deadline = time.monotonic() + QUIET_S
        while time.monotonic() < deadline:
            if not any(e.numRunningTasks() for e in tracker.getExecutorInfos()):
                return
            time.sleep(0.02)

    class Java:
        implements = [LISTENER]


def settle(
    plan: Any,
    *,
    succeeded: bool,
    partial: bool = False,
    before_giving_back: Callable[[], None] = lambda: None,
) -> tuple[list[str], int]:
    """Settles the leases of the drain scans in a physical plan.

    Acknowledged when the query succeeded and kept every row it read (neither
    `partial` nor a node of PARTIAL in the plan), given back otherwise, after
    `before_giving_back()`. The queues acknowledged, and how many leases held
    messages.
    """
    partitions: list[LeasePartition] = []
    for node in _nodes(plan):
        name = node.getClass().getSimpleName()
        partial = partial or any(word in name for word in PARTIAL)
        if name == "BatchScanExec":
            partitions += _lease_partitions(node)
    if not partitions:
        return [], 0
    if partial and succeeded:
        log.warning("mqd drain: the query keeps only some rows read; they go back")
    ack = succeeded and not partial
    if not ack:
        before_giving_back()
    settled = leases.settle(partitions, ack=ack)
    return (sorted({p.queue for p in partitions}) if ack else []), settled


def acknowledge(df: DataFrame) -> int:
    """Removes the rows a drain DataFrame read through an action Spark does not report.

    `df.rdd` and its actions, `foreach`, `foreachPartition` and `toLocalIterator`
    run no SQL query, so no listener hears of them: their rows stay leased until
    `lease_timeout`. Call this once such an action has succeeded; it returns
    how many leases held messages.
    """
    _, settled = settle(df._jdf.queryExecution().executedPlan(), succeeded=True)
    return settled


def _nodes(plan: Any) -> Iterator[Any]:
    """Every node of a physical plan, also inside adaptive plans, query stages and caches."""
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
        if name == "InMemoryTableScanExec":
            # A cached DataFrame: the action that fills the cache ran its scans.
            stack.append(node.relation().cachedPlan())
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
    committer = DrainCommitter(spark.sparkContext._jsc.sc())
    jsession.listenerManager().register(committer)
    _committers[jsession.hashCode()] = committer
    return committer


def wait_for_commits(spark: SparkSession, timeout_s: float = 60.0) -> None:
    """Returns once Spark has delivered every finished query to the committer."""
    spark.sparkContext._jsc.sc().listenerBus().waitUntilEmpty(int(timeout_s * 1000))
