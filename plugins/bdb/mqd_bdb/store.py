"""The batch engine: a batch of jobs in one transaction, one failing job failing alone.

Everything here runs on the environment's worker thread (mqd_bdb.worker). The
worker hands a store a batch of jobs; the store runs them in one transaction
and, should anything in it fail, aborts and runs them again one transaction
each, so one bad job fails alone. The layouts (mqd_bdb.fifo and the modules
that use it, mqd_bdb.random_set) supply the operations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ClassVar

from berkeleydb import db

from mqd.backend import Message
from mqd.errors import StorageError
from mqd_bdb import jobs
from mqd_bdb.catalog import Catalog
from mqd_bdb.errors import storage_error
from mqd_bdb.records import CAT_RESERVED, U64


class NeedsIndex(Exception):
    """A unique put met a large queue whose bodies are not counted yet."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class Store(Catalog):
    """Runs batches of jobs against the catalog and a layout's operations."""

    #: Operations that must run in a transaction of their own.
    barrier_ops: ClassVar[frozenset[int]] = frozenset()

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._ops: dict[int, Callable[[Any, str, Any], Any]] = {
            jobs.PUT: self.put,
            jobs.TAKE: self.take,
            jobs.RESERVE: self.reserve,
            jobs.REMOVE: self.remove,
            jobs.RELEASE: self.release,
            jobs.PEEK: self.peek,
            jobs.READ_AT: self.read_at,
            jobs.DELETE: self.delete,
            jobs.RESTORE: self.restore,
            jobs.RECOVER: self.recover_reserved,
        }

    def execute(
        self, batch: list[jobs.Job], results: list[jobs.Result], published: dict[str, Any]
    ) -> None:
        """Run `batch`, appending one result per job and the gauges that changed."""
        segment: list[jobs.Job] = []
        barriers = self.barrier_ops
        for job in batch:
            if job[0] in barriers:
                if segment:
                    self._segment(segment, results, published)
                    segment = []
                self._segment([job], results, published)
            else:
                segment.append(job)
        if segment:
            self._segment(segment, results, published)

    def _segment(
        self, segment: list[jobs.Job], results: list[jobs.Result], published: dict[str, Any]
    ) -> None:
        try:
            values = self._attempt(segment, published)
        except Exception as exc:
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

    def _attempt(self, segment: list[jobs.Job], published: dict[str, Any]) -> list[Any]:
        """Run `segment` in one transaction, first counting bodies where a put needs it."""
        for _ in range(len(segment) + 1):
            try:
                return self._transaction(segment, published)
            except NeedsIndex as need:
                self.build_index(need.name)
        raise StorageError("could not count the queue's messages")

    def _transaction(self, segment: list[jobs.Job], published: dict[str, Any]) -> list[Any]:
        touched = self._begin()
        next_qid = self.next_qid
        ops = self._ops
        txn = self.env.txn_begin()
        try:
            values = [ops[job[0]](txn, job[1], job[2]) for job in segment]
            if touched or self.next_qid != next_qid:
                self._write_meta(txn, next_qid)
            txn.commit()
        except BaseException as exc:
            if isinstance(exc, db.DBRunRecoveryError):
                self.panicked = True
            with contextlib.suppress(Exception):  # a failed commit ended it already
                txn.abort()
            self._undo(touched, next_qid)
            raise
        self._committed(published)
        return values

    def trim(self) -> None:
        """Between batches: give back resources held beyond the configured limits."""

    def build_index(self, name: str) -> None:
        """Count the bodies of a queue, in transactions of their own."""
        raise NotImplementedError("Store.build_index")

    # -- operations (worker thread, inside the batch's transaction) ------------

    def put(self, txn: Any, name: str, arg: tuple[Message, bool]) -> int | None:
        raise NotImplementedError("Store.put")

    def take(self, txn: Any, name: str, arg: None) -> Message | None:
        raise NotImplementedError("Store.take")

    def reserve(self, txn: Any, name: str, arg: None) -> Message | None:
        raise NotImplementedError("Store.reserve")

    def remove(self, txn: Any, name: str, offset: int) -> bool:
        raise NotImplementedError("Store.remove")

    def release(self, txn: Any, name: str, offset: int) -> bool:
        raise NotImplementedError("Store.release")

    def peek(self, txn: Any, name: str, arg: None) -> Message | None:
        raise NotImplementedError("Store.peek")

    def read_at(self, txn: Any, name: str, offset: int) -> Message | None:
        raise NotImplementedError("Store.read_at")

    def restore(self, txn: Any, name: str, message: Message) -> bool:
        raise NotImplementedError("Store.restore")

    def delete(self, txn: Any, name: str, arg: None) -> bool:
        """Single-file layouts: forget the queue now, purge its records later."""
        q = self.queues.get(name)
        if q is None:
            return False
        self._touch(q)
        self._drop_catalog_entry(txn, q)
        self._schedule_purge(txn, q)
        del self.queues[name]
        return True

    def recover_reserved(self, txn: Any, name: str, arg: None) -> list[tuple[str, Message]]:
        by_qid = {q.qkey: q for q in self.queues.values()}
        found: list[tuple[str, Message]] = []
        cur = self.cat.cursor(txn)
        try:
            rec = cur.set_range(CAT_RESERVED)
            while rec is not None and rec[0][:1] == CAT_RESERVED:
                key, value = rec
                q = by_qid.get(key[1:5])
                if q is not None:
                    message = self._read_reserved(txn, q, U64.unpack_from(key, 5)[0], value)
                    if message is not None:
                        found.append((q.name, message))
                rec = cur.next()
        finally:
            cur.close()
        return found

    def _read_reserved(self, txn: Any, q: Any, offset: int, value: bytes) -> Message | None:
        raise NotImplementedError("Store._read_reserved")
