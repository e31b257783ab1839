"""Puts taken in the same batch are never written: deferred puts, FIFO layouts.

A queue whose consumers keep up is near empty: most messages are put and
taken within one batch. Here a plain put (not unique, the queue unbounded,
not to a fanout parent with children; each child's copy is a put of its
own) gets its offset and is counted in at once, like any put, but its record
is written only when something needs it on disk. A take of a queue with no
waiting message on disk takes the oldest deferred put instead; such a pair
writes nothing but the queue's catalog record, which the batch writes anyway
(its next offset moved). As no older message waits, FIFO order is what
running the jobs one by one gives, and so are the offsets, the counts and
the gauges. An expired message is handed out as from disk: the broker drops
it and takes again. A round of held sets and gets (mqd_bdb.worker) that
wrote nothing else needs no sync: its answers go out as it commits
(Store.wrote says why that keeps every promise).

Any other job on a queue first writes the queue's deferred puts (a job that
may reach other queues writes them all); the end of the batch writes every
one left, before the catalog records and the commit. A transaction that
aborts takes its deferred puts with it: the retry runs the jobs afresh.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from mqd.backend import PUT_STORED, Limits, Message, Put
from mqd_bdb import jobs
from mqd_bdb.catalog import QueueState
from mqd_bdb.config import BdbConfig
from mqd_bdb.index import BodyIndex
from mqd_bdb.operations import Children, Copied
from mqd_bdb.records import u64

#: Jobs that may change or read queues other than the one they name.
ANY_QUEUE: Final = frozenset(
    {jobs.RELEASE, jobs.RELEASE_MANY, jobs.RECLAIM, jobs.LEASES, jobs.REDRIVE}
)

#: A queue's deferred puts, oldest first: a list, not a deque, which compiled
#: code reaches only through method lookups (and it holds a pipeline's few).
Deferred = tuple[QueueState, list[Message]]


class DeferredPuts(BodyIndex):
    """Runs a batch's jobs, deferring plain puts and pairing takes with them."""

    def __init__(self, data_dir: Path, config: BdbConfig) -> None:
        super().__init__(data_dir, config)
        # By queue name, in the running batch. A queue's entry stays when its
        # last deferred put is taken: a consumer that keeps up empties it at
        # every take, and the next put would make it anew. `_waiting` counts
        # the puts in them.
        self._deferred: dict[str, Deferred] = {}
        self._waiting = 0
        # The queues whose message records the running batch reached, None: any (written()).
        self._written: set[str] | None = set()

    def _start_run(self) -> None:
        # What an aborted transaction deferred went with it: start afresh.
        self._deferred = {}
        self._waiting = 0
        self._written = set()

    def written(self) -> set[str] | None:
        return self._written

    def quiet(self) -> bool:
        return not (self._written is None or self._written or self._waiting)

    def _wrote_to(self, name: str | None) -> None:
        """The running batch reached message records of queue `name` (None: of any)."""
        written = self._written
        if name is None:
            self._written = None
        elif written is not None:
            written.add(name)

    def run_job(self, txn: Any, op: int, name: str, arg: Any) -> Any:
        if op != jobs.PUT:
            if self._waiting:
                if op == jobs.TAKE:
                    pair = self._deferred.get(name)
                    # Whatever waits on disk is older than every deferred put.
                    if (
                        pair is not None
                        and pair[1]
                        and pair[0].items - pair[0].open == len(pair[1])
                    ):
                        return self._take_deferred(name)
                else:
                    self._write_deferred(txn, None if op in ANY_QUEUE else name)
            value = self._ops[op](txn, name, arg)
            # A take that found nothing changed nothing (consumers polling an
            # empty queue cost no sync); any other job may have.
            if value is not None or op != jobs.TAKE:
                self._wrote_to(name if op == jobs.TAKE else None)
            return value
        return self._ops[op](txn, name, arg)

    def _end_run(self, txn: Any) -> None:
        if self._waiting:
            self._write_deferred(txn, None)

    def settle(self, txn: Any, name: str) -> None:
        # Deferred puts behind messages that still wait on disk are written
        # now, between one connection's commands and the next's, not at the
        # commit, which the sync and every answer wait for. No take of this
        # transaction reaches them before it has taken one of those, from
        # disk, which its sync covers anyway; a connection's own takes,
        # already run, paired what they could.
        pair = self._deferred.get(name)
        if pair is not None and pair[1] and pair[0].items - pair[0].open > len(pair[1]):
            self._write_deferred(txn, name)

    def put(
        self, txn: Any, name: str, arg: tuple[Message, bool, Limits, Children | None]
    ) -> Put | Copied:
        message, unique, limits, children = arg
        if unique or jobs.bounded(limits) or (children is not None and name in self.children):
            # A fanout parent's copies go through put() again, each child for itself.
            self._write_deferred(txn, name)
            self._wrote_to(name if children is None else None)
            return super().put(txn, name, arg)
        q = self.queues.get(name)
        if q is None:
            q = self._create(name)
        elif q.mdb is None:
            self._attach(q)
        message.offset = q.next_offset
        self._counted_in(q, message)
        pair = self._deferred.get(name)
        if pair is None or pair[0] is not q:
            # An entry left empty may be that of a queue deleted since in
            # this batch (any other job wrote what it held): start it anew.
            self._deferred[name] = (q, [message])
        else:
            pair[1].append(message)
        self._waiting += 1
        return PUT_STORED

    def _take_deferred(self, name: str) -> Message:
        """Nothing waits on disk: hand out the oldest deferred put, never written."""
        q, waiting = self._deferred[name]
        put = waiting.pop(0)
        self._waiting -= 1
        self.paired += 1
        offset = put.offset
        # With no message open, every record of the queue is a deferred put, so
        # the one taken, the oldest, was the head: no key to make and compare.
        q.removed(q.mpre + u64(offset) if q.open else None, len(put.body))
        q.hint = offset + 1  # as after any take: no waiting message sorts before
        # A copy, as a take reads one from its record: the put's caller holds `put`.
        return put.handed_out()

    def _write_deferred(self, txn: Any, name: str | None) -> None:
        """Write the deferred puts of queue `name` (None: of every queue), in order."""
        deferred = self._deferred
        if name is None:
            pairs = list(deferred.values())
            deferred.clear()
        else:
            pair = deferred.pop(name, None)
            pairs = [] if pair is None else [pair]
        for q, waiting in pairs:
            if not waiting:
                continue  # all taken: nothing to write
            self._waiting -= len(waiting)
            self._wrote_to(q.name)
            if q.head_dirty and q.items == len(waiting):
                # The head is unknown (what was the head left the queue), and
                # these are all the queue holds (none waits on disk, none is
                # open): the oldest is the head, which the end of the batch need
                # not look up. A queue that keeps a few messages waiting under
                # a steady load ends every batch so.
                first = waiting[0]
                q.head_is(q.mpre + u64(first.offset), first.created)
            for message in waiting:
                self._write_waiting(txn, q, message)
