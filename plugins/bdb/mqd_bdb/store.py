"""The batch engine: a batch of jobs in one transaction, one failing job failing alone.

Everything here runs on one thread at a time (mqd_bdb.worker): the
environment's worker thread, which hands a store a batch of jobs to run in one
transaction and, should anything in it fail, has it aborted and run again one
transaction each, so one bad job fails alone; or the event loop, which runs
quick jobs one by one in a transaction it opens (begin) and ends (commit or
abort) once per turn. mqd_bdb.operations, mqd_bdb.leases and
mqd_bdb.queue_ops run the jobs in terms of the few calls a layout
(mqd_bdb.fifo and the modules that use it, mqd_bdb.random_set) supplies,
declared at the end of Store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Final

from berkeleydb import db

from mqd.errors import StorageError
from mqd_bdb import jobs
from mqd_bdb.catalog import Catalog, QueueState
from mqd_bdb.config import BdbConfig
from mqd_bdb.errors import storage_error
from mqd_bdb.space import LOOK_S

log = logging.getLogger("mqd.bdb")

COMPACT_MIN_BYTES: Final = 1 << 20  # a single-file layout's file is not compacted below this


class NeedsIndex(Exception):
    """A unique put met a large queue whose bodies are not counted yet."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class Store(Catalog):
    """Runs batches of jobs against the catalog and a layout's operations."""

    #: Operations that must run in a transaction of their own.
    barrier_ops: ClassVar[frozenset[int]] = frozenset()

    def __init__(self, data_dir: Path, config: BdbConfig) -> None:
        super().__init__(data_dir, config)
        self._compacted = self._checkpointed = 0.0
        self.paired = 0  # puts a take handed out in their own batch, never written (for tests)
        self._opened: tuple[dict[str, Any], int] = ({}, 0)  # the open transaction's undo
        self._ops: dict[int, Callable[[Any, str, Any], Any]] = {
            op: getattr(self, method)
            for op, method in jobs.METHODS.items()
            if hasattr(self, method)  # read_at, read_range: the FIFO layouts only
        }

    #: Whether a new queue gets files of its own (creating them may sync).
    files_per_queue: ClassVar[bool] = False

    def loop_ready(self) -> bool:
        """Whether quick jobs may run on the event loop now (quick() says which).

        Not during recovery, in the full-disk mode or while the disk is short
        of room (a take the loop ran could not be retried in the reserve's
        room), or with `max_disk_bytes` (each put is weighed against the disk
        first). `out` is read too: the keeper may gauge `low` just as another
        thread releases the reserve.
        """
        space = self.space
        return not (self.panicked or space.out or space.low or space.max_disk_bytes)

    def quick(self, job: jobs.Job) -> bool:
        """Whether `job` may run on the event loop: a plain put, a take or an ack, no file to open.

        What stays off the loop: every other job, and a put that opens or
        creates files, counts a queue's bodies, drops the oldest message, or
        copies to fanout children.
        """
        op = job[0]
        q = self.queues.get(job[1])
        if op == jobs.PUT:
            if q is None:
                if self.files_per_queue:
                    return False
            elif q.mdb is None:
                return False
            _, unique, limits, children = job[2]
            return not (unique or children is not None or jobs.bounded(limits))
        return (op == jobs.TAKE or op == jobs.ACK) and (q is None or q.mdb is not None)

    def upkeep_due(self) -> bool:
        """Whether trim(), upkeep() or purge_step() has work now (asked after a round)."""
        if self.purges or self.space.out:
            return True
        return bool(self.emptied or self.freed) and time.monotonic() - self._compacted >= LOOK_S

    def execute(
        self, batch: list[jobs.Job], results: list[jobs.Result], published: dict[str, Any]
    ) -> None:
        """Run `batch`, appending one result per job and the gauges that changed."""
        segment: list[jobs.Job] = []
        barriers = self.barrier_ops
        for job in self._admit(batch, results):
            if job[0] in barriers:
                if segment:
                    self._segment(segment, results, published)
                    segment = []
                self._segment([job], results, published)
            else:
                segment.append(job)
        if segment:
            self._segment(segment, results, published)

    def _admit(self, batch: list[jobs.Job], results: list[jobs.Result]) -> list[jobs.Job]:
        """The jobs of `batch` to run; the puts the disk has no room for are answered here."""
        space = self.space
        if not space.out and not space.max_disk_bytes:
            return batch
        if space.out:
            self.upkeep()  # room may be back
        admitted = []
        for job in batch:
            reason = space.refusal(len(job[2][0].body)) if job[0] == jobs.PUT else None
            if reason is None:
                admitted.append(job)
            else:
                results.append((job, StorageError(reason), None))
        return admitted

    def _segment(
        self,
        segment: list[jobs.Job],
        results: list[jobs.Result],
        published: dict[str, Any],
        again: bool = False,
    ) -> None:
        try:
            values = self._attempt(segment, published)
        except Exception as exc:
            if self.disk_full(exc) and not again and self._free_disk():
                # What frees space runs in the room made, puts are refused.
                rest = self._admit(segment, results)
                if rest:
                    self._segment(rest, results, published, again=True)
                return
            if len(segment) == 1 or self.panicked:
                error = storage_error(exc)
                results.extend((job, error, None) for job in segment)
                return
            # Find the job that failed: each alone, in order, in its own transaction.
            for job in segment:
                try:
                    (value,) = self._attempt([job], published)
                except Exception as exc:
                    results.append((job, storage_error(exc), None))
                else:
                    results.append((job, None, value))
            return
        results.extend((job, None, value) for job, value in zip(segment, values, strict=True))

    def _free_disk(self) -> bool:
        """The disk is full: release the reserve (if still in), checkpoint so that
        the log files recovery no longer needs go; whether there may be room now.

        The checkpoint is what a full disk usually needs: the log grows by
        `checkpoint_mb` between checkpoints, more than a small disk may hold.
        """
        released = self.space.release()
        try:
            self.checkpoint(True)
        except Exception as exc:
            if not self.disk_full(exc):
                log.warning("checkpoint on a full disk failed: %s", exc)
            return released
        self._checkpointed = time.monotonic()
        return True

    def _attempt(self, segment: list[jobs.Job], published: dict[str, Any]) -> list[Any]:
        """Run `segment` in one transaction, first counting bodies where a put needs it."""
        for _ in range(len(segment) + 1):
            try:
                return self._transaction(segment, published)
            except NeedsIndex as need:
                self.build_index(need.name)
        raise StorageError("could not count the queue's messages")

    def _transaction(self, segment: list[jobs.Job], published: dict[str, Any]) -> list[Any]:
        txn = self.begin()
        try:
            values = [self.run_job(txn, op, name, arg) for op, name, arg, _, _ in segment]
        except BaseException as exc:
            self.abort(txn, exc)
            raise
        self.commit(txn, published)
        return values

    # A transaction that jobs run in one at a time: a batch's (above), or a
    # round of quick jobs run on the event loop as they come (mqd_bdb.worker).

    def begin(self) -> Any:
        """Open a transaction for jobs to run in (run_job); end it with commit() or abort()."""
        self._opened = (self._begin(), self.next_qid)
        self.now = time.time()
        txn = self.env.txn_begin()
        self._start_run()
        return txn

    def commit(self, txn: Any, published: dict[str, Any], lazy: bool = False) -> None:
        """Write what the jobs left to write, commit (no sync), publish the gauges they changed.

        `lazy`: no caller shows a message's offset (a held set or get does
        not), so a transaction that changed no message record (quiet) need
        not save its queues' records either: it then writes nothing at all
        (Catalog._write_meta). If that fails, it is all undone (abort) and
        the error raised.
        """
        touched, next_qid = self._opened
        try:
            lazy = lazy and self.quiet()
            self._end_run(txn)
            if touched or self.next_qid != next_qid:
                self._write_meta(txn, next_qid, lazy)
            txn.commit()
        except BaseException as exc:
            self.abort(txn, exc)
            raise
        self._committed(published)

    def abort(self, txn: Any, exc: BaseException | None = None) -> None:
        """Undo the open transaction: in the files and in the catalog's memory."""
        if isinstance(exc, db.DBRunRecoveryError):
            self.panicked = True
        with contextlib.suppress(Exception):  # a failed commit ended it already
            txn.abort()
        touched, next_qid = self._opened
        self._undo(touched, next_qid)

    def _start_run(self) -> None:
        """A transaction opened: jobs are about to run in it."""

    def run_job(self, txn: Any, op: int, name: str, arg: Any) -> Any:
        """The value of one job, run in the open transaction `txn`."""
        return self._ops[op](txn, name, arg)

    def _end_run(self, txn: Any) -> None:
        """The jobs of a transaction ran: write what they left for the end."""

    def settle(self, txn: Any, name: str) -> None:
        """A caller's run of jobs on queue `name` ended, others' may follow in `txn`:
        write now what the end of the transaction need not wait for."""

    def wrote(self) -> bool:
        """Whether the last transaction changed a message record (asked once it committed).

        False only where nothing but the catalog's records changed: every
        put was taken in the same transaction and never written, and every
        other job was a take, finding a message so or none
        (mqd_bdb.deferred). Such a transaction needs no sync before its
        answers go out: after a crash, no message it stored can be missing
        and none it took can come back. What is lost is its queues' next
        offsets, which then number the next messages as they would have
        numbered its own, ids no plain set or get shows (`gets` runs
        through futures, whose rounds are synced all the same). A round
        of held jobs does not even write them (commit, `lazy`).
        """
        written = self.written()
        return written is None or bool(written)

    def quiet(self) -> bool:
        """Whether the open transaction has changed no message record so far, and has
        none left to write at its end: committed now, it would need no sync (wrote())."""
        return False

    def written(self) -> set[str] | None:
        """The queues whose message records the last transaction changed; None: any may have.

        What wrote() says, queue by queue: the answers of jobs on the other
        queues need no sync (Worker._answer_early).
        """
        return None

    def trim(self) -> None:
        """Between batches: give back resources held beyond the configured limits."""

    def upkeep(self) -> None:
        """Between batches: give the space of emptied queues back; restore the reserve."""
        now = time.monotonic()
        if (self.emptied or self.freed) and now - self._compacted >= LOOK_S:
            self._compacted = now
            emptied, freed, self.emptied, self.freed = self.emptied, self.freed, set(), False
            self._compact([q for q in map(self.queues.get, emptied) if q and not q.items], freed)
        if self.space.out:
            # Old log files go at a checkpoint: while short of room, one as
            # soon as a log file's worth is written (gets log the bodies they
            # remove: a drain writes fast), and one on the clock to look.
            self.checkpoint(False, self.config.log_file_mb)
            if now - self._checkpointed >= LOOK_S:
                self._checkpointed = now
                self.checkpoint(True)
                self.space.look()

    def _compact(self, emptied: list[QueueState], freed: bool) -> None:
        """Return the free pages of the files of `emptied` queues to the file system.

        Here one file holds every queue (`freed`: a deleted one's records were
        purged): compacting it reads all of it, so only once at least half of
        it is free.
        """
        if not emptied and not freed:
            return
        size = os.stat(self.data_dir / self.catalog_file).st_size
        held = sum(q.bytes for q in self.queues.values())
        if size > COMPACT_MIN_BYTES and 2 * held < size:
            self.cat.compact(flags=db.DB_FREE_SPACE)

    def build_index(self, name: str) -> None:
        """Count the bodies of a queue, in transactions of their own."""
        raise NotImplementedError("Store.build_index")

    # -- what a layout supplies ------------------------------------------------

    #: Whether a message's key is its body's digest (a put of a body already
    #: there stores nothing) rather than its offset (mqd_bdb.records). The
    #: layouts search for waiting messages from q.hint_key, or q.hint.
    keyed_by_body: ClassVar[bool] = False

    def _first_waiting(self, txn: Any, q: QueueState) -> tuple[bytes, bytes] | None:
        """The record of the next waiting message to hand out; None if there is none."""
        raise NotImplementedError("Store._first_waiting")

    def _take_first(self, txn: Any, q: QueueState) -> tuple[bytes, bytes] | None:
        """Remove the record _first_waiting() finds, and return it."""
        rec = self._first_waiting(txn, q)
        if rec is not None:
            q.mdb.delete(rec[0], txn)
        return rec

    def _oldest_waiting(self, txn: Any, q: QueueState) -> tuple[bytes, bytes] | None:
        """The record of the waiting message put first (what drop_oldest drops)."""
        raise NotImplementedError("Store._oldest_waiting")

    def _waiting_at(self, txn: Any, q: QueueState, offset: int) -> tuple[bytes, bytes] | None:
        """The record of the waiting message at `offset`; None if no message waits there."""
        raise NotImplementedError("Store._waiting_at")

    def _rewind(self, q: QueueState, key: bytes, offset: int) -> None:
        """A message at `key` waits (again): let the next search find it."""
        raise NotImplementedError("Store._rewind")

    def _duplicate(self, txn: Any, q: QueueState, body: bytes) -> bool:
        """Whether `body` is in `q` (asked before a unique or a limited put)."""
        raise NotImplementedError("Store._duplicate")

    def _contains(self, txn: Any, q: QueueState, body: bytes) -> bool:
        raise NotImplementedError("Store._contains")

    def _discard(self, txn: Any, q: QueueState, body: bytes) -> int:
        raise NotImplementedError("Store._discard")

    def _count_body(self, txn: Any, q: QueueState, body: bytes, delta: int) -> None:
        """Keep the count of copies of `body` (queues with `indexed` set; mqd_bdb.index)."""
        raise NotImplementedError("Store._count_body")
