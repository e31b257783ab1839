"""Queues in one transactional Berkeley DB environment.

Everything here runs on the environment's worker thread (mqd_bdb.worker), but
flush(), trickle() and checkpoint(), which the keeper thread calls: no database
handle is shared between threads, only the environment, opened DB_THREAD. The
worker hands a store a batch of jobs; the store runs them in one
transaction and, should anything in it fail, aborts and runs them again one
transaction each, so one bad job fails alone.

Every layout keeps a *catalog* of B-tree records, keyed by a one-byte kind:

    CAT_QUEUE    + name             -> META: qid, next offset, counts, head, flags
    CAT_RESERVED + qid + offset     -> the message key suffix (reserved index)
    CAT_PURGE    + qid              -> a deleted queue whose records remain
    CAT_NEXT_QID                    -> the next queue id

Counts and the next offset are written once per touched queue per batch, in
the batch's transaction, so after a crash they match the messages exactly and
offsets are never reused. The reserved index lets recover() find reserved
messages without reading every message.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import struct
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ClassVar

from berkeleydb import db

from mqd.backend import Message, QueueSize
from mqd.errors import StorageError
from mqd_bdb import jobs
from mqd_bdb.config import BdbConfig
from mqd_bdb.names import decode_name, encode_name, file_stem

CAT_QUEUE = b"\x00"
CAT_RESERVED = b"\x01"
CAT_PURGE = b"\x02"
CAT_NEXT_QID = b"\x03"
MSG = b"\x10"  # + qid + ...: messages, in the single-file layouts
UNIQ = b"\x11"  # + qid + digest: copies of a body, in bdb-single

QID = struct.Struct(">I")
U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
CREATED = struct.Struct(">d")
#: qid, next offset, items, bytes, open, head's created, flags (INDEXED).
META = struct.Struct(">IQQQQdB")
INDEXED = 1  # META flag: the queue's copies of each body are counted
#: A FIFO message: reserved marker, flags, expires, created, deliveries; body follows.
HDR = struct.Struct(">BIddI")
HDR_CREATED = 13
#: A bdb-random message: marker, offset, flags, expires, created, deliveries; body follows.
RHDR = struct.Struct(">BQIddI")
RHDR_CREATED = 21
WAITING = 0
RESERVED = 1

ENV_FLAGS = (
    db.DB_CREATE
    | db.DB_INIT_TXN
    | db.DB_INIT_LOG
    | db.DB_INIT_LOCK
    | db.DB_INIT_MPOOL
    | db.DB_RECOVER  # replay the log: every file consistent whatever the last exit
    | db.DB_PRIVATE  # one process; regions in its memory, no stale region files
    | db.DB_THREAD  # the keeper thread syncs and checkpoints beside the worker
)
CHUNK = 500  # records per transaction when purging a queue or counting its bodies
INLINE_INDEX = 1000  # a queue this small has its bodies counted inside the batch

_REASONS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EIO: "I/O error",
    errno.EMFILE: "too many open files",
    errno.ENFILE: "too many open files",
    errno.EISDIR: "a directory is in the way",
    errno.ENOMEM: "out of memory",
    errno.EFBIG: "file too large",
}


def storage_error(exc: BaseException) -> StorageError:
    """The StorageError to answer for `exc`, with a short reason fit for a reply line."""
    if isinstance(exc, StorageError):
        return exc
    code: Any = None
    if isinstance(exc, db.DBError) and exc.args:
        code = exc.args[0]
    elif isinstance(exc, OSError):
        code = exc.errno
    reason = _REASONS.get(code) if isinstance(code, int) else None
    if reason is None:
        if isinstance(exc, db.DBRunRecoveryError):
            reason = "database needs recovery"
        elif isinstance(exc, db.DBLockNotGrantedError | db.DBLockDeadlockError):
            reason = "lock timeout"
        else:
            detail = exc.args[-1] if isinstance(exc, db.DBError) and exc.args else exc
            reason = f"storage error: {detail}"
    text = "".join(c if c.isprintable() else " " for c in reason)
    error = StorageError(text[:200])
    error.__cause__ = exc
    return error


def _digest(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=16).digest()


class _NeedsIndex(Exception):
    """A unique put met a large queue whose bodies are not counted yet."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _Queue:
    """What the worker knows of one queue; its counts mirror the catalog record."""

    __slots__ = (
        "bytes",
        "head_created",
        "head_dirty",
        "head_key",
        "hint",
        "hint_key",
        "indexed",
        "items",
        "mdb",
        "mpre",
        "name",
        "next_offset",
        "open",
        "qid",
        "qkey",
        "raw",
        "stem",
        "udb",
        "upre",
    )

    def __init__(self, name: str, raw: bytes, qid: int) -> None:
        self.name = name
        self.raw = raw
        self.qid = qid
        self.qkey = QID.pack(qid)
        self.next_offset = 0
        self.items = 0
        self.bytes = 0
        self.open = 0
        # The head is the queue's least key, waiting or reserved. Its key is
        # known once a batch has seen it (None: unknown or empty); head_dirty
        # asks the end of the batch to look it up.
        self.head_created = 0.0
        self.head_key: bytes | None = None
        self.head_dirty = False
        # No waiting message sorts before the hint: take() starts looking there
        # instead of stepping over every reserved message at the head again.
        self.hint = 0  # an offset, in the FIFO layouts
        self.hint_key = b""  # a key, in bdb-random
        # Whether copies of each body are counted (FIFO layouts). Only queues
        # that have seen a unique put pay for the counting.
        self.indexed = False
        self.mdb: Any = None  # database holding the messages
        self.mpre = b""  # their key prefix in it
        self.udb: Any = None  # database counting copies of each body (FIFO)
        self.upre = b""
        self.stem = ""  # bdb: file name stem

    def size(self) -> QueueSize:
        return QueueSize(self.items, self.bytes, self.open, self.head_created)

    def meta(self) -> bytes:
        flags = INDEXED if self.indexed else 0
        return META.pack(
            self.qid, self.next_offset, self.items, self.bytes, self.open, self.head_created, flags
        )

    def state(self) -> tuple[Any, ...]:
        return (
            self.next_offset,
            self.items,
            self.bytes,
            self.open,
            self.head_created,
            self.head_key,
            self.head_dirty,
            self.hint,
            self.hint_key,
            self.indexed,
        )

    def set_state(self, state: tuple[Any, ...]) -> None:
        (
            self.next_offset,
            self.items,
            self.bytes,
            self.open,
            self.head_created,
            self.head_key,
            self.head_dirty,
            self.hint,
            self.hint_key,
            self.indexed,
        ) = state

    def set_head(self, rec: tuple[bytes, bytes] | None, created_at: int) -> None:
        """The head is `rec` (None: the queue is empty)."""
        if rec is None or not rec[0].startswith(self.mpre):
            self.head_key, self.head_created = None, 0.0
        else:
            self.head_key = rec[0]
            self.head_created = CREATED.unpack_from(rec[1], created_at)[0]
        self.head_dirty = False


#: A queue before a batch first changed it, and whether it existed then.
_Snapshot = tuple[_Queue, bool, tuple[Any, ...]]


class Store:
    """One environment in `data_dir` and the catalog; subclasses lay out the messages."""

    #: Operations that must run in a transaction of their own.
    barrier_ops: ClassVar[frozenset[int]] = frozenset()
    #: The catalog's file (shared with the messages in the single-file layouts).
    catalog_file: ClassVar[str] = "queues.db"
    #: Where `created` sits in a message record.
    created_at: ClassVar[int] = HDR_CREATED

    def __init__(self, data_dir: Path, config: BdbConfig) -> None:
        self.data_dir = data_dir
        self.config = config
        self.env: Any = None
        self.cat: Any = None
        self.queues: dict[str, _Queue] = {}
        self.next_qid = 0
        self.purges: list[bytes] = []  # qid keys of deleted queues with records left
        self.panicked = False
        self._touched: dict[str, _Snapshot] = {}
        self._new_purges: list[bytes] = []
        self._lock_fd: int | None = None
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
            jobs.RECOVER: self.recover,
        }

    # -- life cycle ----------------------------------------------------------

    def open(self) -> dict[str, QueueSize]:
        """Open (creating, recovering) the environment; the gauges of every queue."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            self._open_env()
        except BaseException:
            self._close_env()
            self._unlock()
            raise
        return self.sizes()

    def close(self) -> None:
        """Checkpoint and close everything; raises the first error met, after trying all."""
        first: BaseException | None = None
        try:
            if self.env is not None and not self.panicked:
                self.env.txn_checkpoint(0, 0, db.DB_FORCE)
        except Exception as exc:
            first = exc
        error = self._close_env()
        self._unlock()
        if first is not None or error is not None:
            raise storage_error(first or error)  # type: ignore[arg-type]

    def reopen(self) -> dict[str, QueueSize | None]:
        """After a panic: close, recover, load again. The gauges to publish."""
        before = set(self.queues)
        self._close_env()
        self.queues = {}
        self._open_env()
        self.panicked = False
        published: dict[str, QueueSize | None] = dict.fromkeys(before)
        published.update(self.sizes())
        return published

    def sizes(self) -> dict[str, QueueSize]:
        return {name: q.size() for name, q in self.queues.items()}

    def _lock(self) -> None:
        fd = os.open(self.data_dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StorageError(
                f"data directory {self.data_dir} is in use by another process"
            ) from None
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _open_env(self) -> None:
        c = self.config
        env = db.DBEnv()
        cache = c.cache_mb << 20
        env.set_cachesize(cache >> 30, cache & ((1 << 30) - 1), 1)
        env.set_lg_bsize(c.log_buffer_kb << 10)
        env.set_lg_max(c.log_file_mb << 20)
        env.set_lk_max_locks(c.max_locks)
        env.set_lk_max_objects(c.max_locks)
        # Commits write the log to the OS but do not sync it: the worker syncs
        # once per batch (group commit) for the callers that asked for it.
        env.set_flags(db.DB_TXN_WRITE_NOSYNC, 1)
        env.log_set_config(db.DB_LOG_AUTO_REMOVE, 1)
        # All work is on one thread, so a lock wait can only be for a lock this
        # very thread holds in another transaction: fail it rather than hang.
        env.set_timeout(2_000_000, db.DB_SET_LOCK_TIMEOUT)
        self.env = env
        env.open(str(self.data_dir), ENV_FLAGS, 0o600)
        self.cat = self._open_db(self.catalog_file, db.DB_BTREE)
        self._load()

    def _close_env(self) -> BaseException | None:
        first: BaseException | None = None
        for handle in self._handles():
            try:
                handle.close(db.DB_NOSYNC)
            except Exception as exc:
                first = first or exc
        self.cat = None
        for q in self.queues.values():
            q.mdb = q.udb = None
        if self.env is not None:
            try:
                self.env.close()
            except Exception as exc:
                first = first or exc
            self.env = None
        return first

    def _handles(self) -> Iterable[Any]:
        """Every open database handle, catalog last."""
        return [] if self.cat is None else [self.cat]

    def _open_db(self, filename: str, dbtype: int) -> Any:
        handle = db.DB(self.env)
        try:
            if self.config.page_size:
                handle.set_pagesize(self.config.page_size)
            handle.open(filename, None, dbtype, db.DB_CREATE | db.DB_AUTO_COMMIT, 0o600)
        except BaseException:
            handle.close()
            raise
        return handle

    def _load(self) -> None:
        queues: dict[str, _Queue] = {}
        cur = self.cat.cursor()
        try:
            rec = cur.set_range(CAT_QUEUE)
            while rec is not None and rec[0][:1] == CAT_QUEUE:
                raw = rec[0][1:]
                qid, next_offset, items, nbytes, nopen, head, flags = META.unpack(rec[1])
                q = self._make_queue(decode_name(raw), raw, qid)
                q.next_offset, q.items, q.bytes, q.open = next_offset, items, nbytes, nopen
                q.head_created = head
                q.indexed = bool(flags & INDEXED)
                queues[q.name] = q
                rec = cur.next()
            rec = cur.set_range(CAT_PURGE)
            purges = []
            while rec is not None and rec[0][:1] == CAT_PURGE:
                purges.append(rec[0][1:])
                rec = cur.next()
        finally:
            cur.close()
        raw_qid = self.cat.get(CAT_NEXT_QID)
        self.next_qid = QID.unpack(raw_qid)[0] if raw_qid else 0
        self.queues = queues
        self.purges = purges

    def _make_queue(self, name: str, raw: bytes, qid: int) -> _Queue:
        """A queue object for a catalog entry; subclasses set where its messages live."""
        return _Queue(name, raw, qid)

    # -- batches -------------------------------------------------------------

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
            except _NeedsIndex as need:
                self.build_index(need.name)
        raise StorageError("could not count the queue's messages")

    def _transaction(self, segment: list[jobs.Job], published: dict[str, Any]) -> list[Any]:
        touched: dict[str, _Snapshot] = {}
        self._touched = touched
        self._new_purges = []
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
            self._restore(touched)
            self.next_qid = next_qid
            raise
        finally:
            self._touched = {}
        self.purges.extend(self._new_purges)
        for name in touched:
            q = self.queues.get(name)
            published[name] = None if q is None else q.size()
        return values

    def _touch(self, q: _Queue) -> None:
        """Remember `q` as it was before this batch changed it."""
        if q.name not in self._touched:
            self._touched[q.name] = (q, True, q.state())

    def _restore(self, touched: dict[str, _Snapshot]) -> None:
        for name, (q, existed, state) in touched.items():
            if existed:
                q.set_state(state)
                self.queues[name] = q
            else:
                self.queues.pop(name, None)

    def _write_meta(self, txn: Any, next_qid: int) -> None:
        cat = self.cat
        for name in self._touched:
            q = self.queues.get(name)
            if q is None:
                continue
            if q.head_dirty:
                q.set_head(self._head(txn, q) if q.items else None, self.created_at)
            cat.put(CAT_QUEUE + q.raw, q.meta(), txn)
            self._used(q)
        if self.next_qid != next_qid:
            cat.put(CAT_NEXT_QID, QID.pack(self.next_qid), txn)

    def _create(self, name: str) -> _Queue:
        """A new, empty queue, registered by this batch's transaction."""
        raw = encode_name(name)
        q = self._make_queue(name, raw, self.next_qid)
        self.next_qid += 1
        if q.mdb is None:
            self._attach(q)
        # A queue deleted earlier in this batch keeps its own snapshot.
        self._touched.setdefault(name, (q, False, ()))
        self.queues[name] = q
        return q

    def _attach(self, q: _Queue) -> None:
        """Open the queue's databases (called when `q.mdb` is None)."""

    def _used(self, q: _Queue) -> None:
        """A batch changed `q` (for keeping recently used files open)."""

    def _drop_catalog_entry(self, txn: Any, q: _Queue) -> None:
        with contextlib.suppress(db.DBNotFoundError):  # created in this very batch
            self.cat.delete(CAT_QUEUE + q.raw, txn)

    def _head(self, txn: Any, q: _Queue) -> tuple[bytes, bytes] | None:
        """The queue's first record, looked up."""
        cur = q.mdb.cursor(txn)
        try:
            rec = cur.set_range(q.mpre) if q.mpre else cur.first()
        finally:
            cur.close()
        return rec  # type: ignore[no-any-return]

    def _head_removed(self, q: _Queue, key: bytes) -> None:
        """The record at `key` is gone: if it was the head, look the head up at the end."""
        if q.head_key is None or key == q.head_key:
            q.head_dirty = True

    def _head_added(self, q: _Queue, key: bytes, created: float) -> None:
        """A record was added at `key`: it is the head if it sorts first."""
        if q.items == 1:
            q.head_key, q.head_created, q.head_dirty = key, created, False
        elif q.head_key is None:
            q.head_dirty = True
        elif key < q.head_key:
            q.head_key, q.head_created = key, created

    # -- maintenance -----------------------------------------------------------

    def flush(self) -> None:
        """Force the log to stable storage: the one sync of a batch."""
        self.env.log_flush()

    def trickle(self, percent: int) -> None:
        """Write dirty pages out until `percent` of the cache is clean."""
        self.env.memp_trickle(percent)

    def checkpoint(self, force: bool) -> None:
        """Write dirty pages and a checkpoint if enough log has accumulated (or `force`)."""
        if force:
            self.env.txn_checkpoint(0, 0, db.DB_FORCE)
        else:
            self.env.txn_checkpoint(self.config.checkpoint_mb << 10, 0)

    def trim(self) -> None:
        """Between batches: give back resources held beyond the configured limits."""

    def purge_step(self) -> None:
        """Delete some records of the oldest deleted queue (single-file layouts)."""
        qkey = self.purges[0]
        txn = self.env.txn_begin()
        try:
            left = CHUNK
            for prefix in self._purge_prefixes(qkey):
                left -= _delete_range(self.cat, txn, prefix, left)
                if not left:
                    break
            else:
                self.cat.delete(CAT_PURGE + qkey, txn)
            txn.commit()
        except BaseException:
            with contextlib.suppress(Exception):
                txn.abort()
            raise
        if left:
            self.purges.pop(0)

    def _purge_prefixes(self, qkey: bytes) -> list[bytes]:
        return [MSG + qkey, UNIQ + qkey, CAT_RESERVED + qkey]

    def _schedule_purge(self, txn: Any, q: _Queue) -> None:
        self.cat.put(CAT_PURGE + q.qkey, b"", txn)
        self._new_purges.append(q.qkey)

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

    def recover(self, txn: Any, name: str, arg: None) -> list[tuple[str, Message]]:
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

    def _read_reserved(self, txn: Any, q: _Queue, offset: int, value: bytes) -> Message | None:
        raise NotImplementedError("Store._read_reserved")


def _delete_range(handle: Any, txn: Any, prefix: bytes, limit: int) -> int:
    """Delete up to `limit` records whose keys start with `prefix`; how many were."""
    done = 0
    cur = handle.cursor(txn)
    try:
        rec = cur.set_range(prefix)
        while rec is not None and rec[0].startswith(prefix) and done < limit:
            cur.delete()
            done += 1
            rec = cur.next()
    finally:
        cur.close()
    return done


class FifoStore(Store):
    """Messages keyed by prefix + big-endian offset, so the first key is the head.

    A reserved message stays in place with its marker set. Copies of each body
    are counted under its digest once the queue has seen a unique put.
    """

    # -- counting bodies -------------------------------------------------------

    def _count_body(self, txn: Any, q: _Queue, body: bytes, delta: int) -> None:
        key = q.upre + _digest(body)
        raw = q.udb.get(key, None, txn)
        count = (U32.unpack(raw)[0] if raw else 0) + delta
        if count > 0:
            q.udb.put(key, U32.pack(count), txn)
        elif raw:
            q.udb.delete(key, txn)

    def _clear_index(self, txn: Any, q: _Queue, limit: int) -> int:
        """Delete up to `limit` leftovers of an unfinished count; how many were."""
        return _delete_range(q.udb, txn, q.upre, limit)

    def _count_chunk(self, txn: Any, q: _Queue, after: bytes | None, limit: int) -> bytes | None:
        """Count the bodies of up to `limit` messages after key `after`; the last key seen."""
        counts: Counter[bytes] = Counter()
        last = None
        cur = q.mdb.cursor(txn)
        try:
            if after is not None:
                rec = cur.set_range(after + b"\x00")
            else:
                rec = cur.set_range(q.mpre) if q.mpre else cur.first()
            while rec is not None and rec[0].startswith(q.mpre) and limit:
                counts[_digest(rec[1][HDR.size :])] += 1
                last = rec[0]
                limit -= 1
                rec = cur.next()
        finally:
            cur.close()
        for digest, count in counts.items():
            key = q.upre + digest
            raw = q.udb.get(key, None, txn)
            q.udb.put(key, U32.pack(count + (U32.unpack(raw)[0] if raw else 0)), txn)
        return last

    def _index_inline(self, txn: Any, q: _Queue) -> None:
        """Count the bodies of a small queue inside the batch's transaction."""
        if q.items > INLINE_INDEX:
            raise _NeedsIndex(q.name)
        self._touch(q)
        while self._clear_index(txn, q, CHUNK):
            pass
        self._count_chunk(txn, q, None, q.items + 1)
        q.indexed = True

    def build_index(self, name: str) -> None:
        q = self.queues.get(name)
        if q is None or q.indexed:
            return
        if q.mdb is None:
            self._attach(q)
        while self._chunk_txn(self._clear_index, q, CHUNK):
            pass  # leftovers of a count that a crash interrupted
        after = self._chunk_txn(self._count_chunk, q, None, CHUNK)
        while after is not None:
            after = self._chunk_txn(self._count_chunk, q, after, CHUNK)
        q.indexed = True
        try:
            self._chunk_txn(self._save_meta, q)
        except BaseException:
            q.indexed = False
            raise

    def _save_meta(self, txn: Any, q: _Queue) -> None:
        self.cat.put(CAT_QUEUE + q.raw, q.meta(), txn)

    def _chunk_txn(self, work: Callable[..., Any], *args: Any) -> Any:
        """`work(txn, *args)` in a transaction of its own."""
        txn = self.env.txn_begin()
        try:
            value = work(txn, *args)
            txn.commit()
        except BaseException:
            with contextlib.suppress(Exception):
                txn.abort()
            raise
        return value

    # -- operations ------------------------------------------------------------

    def put(self, txn: Any, name: str, arg: tuple[Message, bool]) -> int | None:
        message, unique = arg
        body = message.body
        q = self.queues.get(name)
        if q is None:
            q = self._create(name)
        elif q.mdb is None:
            self._attach(q)
        if q.indexed or unique:
            if not q.indexed:
                self._index_inline(txn, q)
            ukey = q.upre + _digest(body)
            raw = q.udb.get(ukey, None, txn)
            count = U32.unpack(raw)[0] if raw else 0
            if count and unique:
                return None
            q.udb.put(ukey, U32.pack(count + 1), txn)
        self._touch(q)
        offset = q.next_offset
        key = q.mpre + U64.pack(offset)
        created = message.created
        q.mdb.put(
            key,
            HDR.pack(WAITING, message.flags, message.expires, created, message.deliveries) + body,
            txn,
        )
        q.next_offset = offset + 1
        q.items += 1
        q.bytes += len(body)
        if q.items == 1:
            q.head_key, q.head_created, q.head_dirty = key, created, False
        message.offset = offset
        return offset

    def _first_waiting(self, cur: Any, q: _Queue) -> tuple[bytes, bytes] | None:
        """Move `cur` to the head waiting message of `q`; None if there is none."""
        prefix = q.mpre
        rec = cur.set_range(prefix + U64.pack(q.hint))
        while rec is not None and rec[0].startswith(prefix):
            if rec[1][0] == WAITING:
                return rec  # type: ignore[no-any-return]
            rec = cur.next()
        return None

    def _pop(self, txn: Any, name: str, reserve: bool) -> Message | None:
        q = self.queues.get(name)
        if q is None or q.items == q.open:
            return None
        if q.mdb is None:
            self._attach(q)
        mdb = q.mdb
        # Nearly always the message at the hint is the head, waiting: take it
        # by key. Otherwise (reserved messages or gaps) look with a cursor.
        key = q.mpre + U64.pack(q.hint)
        value = mdb.get(key, None, txn)
        if value is None or value[0] != WAITING:
            cur = mdb.cursor(txn)
            try:
                rec = self._first_waiting(cur, q)
            finally:
                cur.close()
            if rec is None:
                return None
            key, value = rec
        _, flags, expires, created, deliveries = HDR.unpack_from(value)
        body = value[HDR.size :]
        deliveries += 1
        offset = U64.unpack_from(key, len(key) - 8)[0]
        if name not in self._touched:
            self._touch(q)
        if reserve:
            mdb.put(key, HDR.pack(RESERVED, flags, expires, created, deliveries) + body, txn)
            self.cat.put(CAT_RESERVED + q.qkey + U64.pack(offset), b"", txn)
            q.open += 1
        else:
            mdb.delete(key, txn)
            q.items -= 1
            q.bytes -= len(body)
            if key == q.head_key or q.head_key is None:
                q.head_dirty = True
            if q.indexed:
                self._count_body(txn, q, body, -1)
        q.hint = offset + 1
        return Message(body, flags, expires, created, offset, deliveries)

    def take(self, txn: Any, name: str, arg: None) -> Message | None:
        return self._pop(txn, name, False)

    def reserve(self, txn: Any, name: str, arg: None) -> Message | None:
        return self._pop(txn, name, True)

    def remove(self, txn: Any, name: str, offset: int) -> bool:
        q = self.queues.get(name)
        if q is None:
            return False
        if q.mdb is None:
            self._attach(q)
        key = q.mpre + U64.pack(offset)
        value = q.mdb.get(key, None, txn)
        if value is None:
            return False
        self._touch(q)
        q.mdb.delete(key, txn)
        if value[0] == RESERVED:
            self.cat.delete(CAT_RESERVED + q.qkey + U64.pack(offset), txn)
            q.open -= 1
        body = value[HDR.size :]
        if q.indexed:
            self._count_body(txn, q, body, -1)
        q.items -= 1
        q.bytes -= len(body)
        self._head_removed(q, key)
        return True

    def release(self, txn: Any, name: str, offset: int) -> bool:
        q = self.queues.get(name)
        if q is None or not q.open:
            return False
        if q.mdb is None:
            self._attach(q)
        key = q.mpre + U64.pack(offset)
        value = q.mdb.get(key, None, txn)
        if value is None or value[0] != RESERVED:
            return False
        self._touch(q)
        q.mdb.put(key, bytes((WAITING,)) + value[1:], txn)
        self.cat.delete(CAT_RESERVED + q.qkey + U64.pack(offset), txn)
        q.open -= 1
        q.hint = min(q.hint, offset)
        return True

    def peek(self, txn: Any, name: str, arg: None) -> Message | None:
        q = self.queues.get(name)
        if q is None or q.items == q.open:
            return None
        if q.mdb is None:
            self._attach(q)
        cur = q.mdb.cursor(txn)
        try:
            rec = self._first_waiting(cur, q)
        finally:
            cur.close()
        return None if rec is None else _fifo_message(rec[0], rec[1])

    def read_at(self, txn: Any, name: str, offset: int) -> Message | None:
        q = self.queues.get(name)
        if q is None:
            return None
        if q.mdb is None:
            self._attach(q)
        key = q.mpre + U64.pack(offset)
        value = q.mdb.get(key, None, txn)
        return None if value is None else _fifo_message(key, value)

    def restore(self, txn: Any, name: str, message: Message) -> bool:
        q = self.queues.get(name)
        if q is None:
            return False
        if q.mdb is None:
            self._attach(q)
        key = q.mpre + U64.pack(message.offset)
        if q.mdb.exists(key, txn):
            return False
        self._touch(q)
        deliveries = max(message.deliveries - 1, 0)
        value = HDR.pack(WAITING, message.flags, message.expires, message.created, deliveries)
        q.mdb.put(key, value + message.body, txn)
        if q.indexed:
            self._count_body(txn, q, message.body, 1)
        q.items += 1
        q.bytes += len(message.body)
        q.hint = min(q.hint, message.offset)
        self._head_added(q, key, message.created)
        return True

    def _read_reserved(self, txn: Any, q: _Queue, offset: int, value: bytes) -> Message | None:
        if q.mdb is None:
            self._attach(q)
        key = q.mpre + U64.pack(offset)
        record = q.mdb.get(key, None, txn)
        return None if record is None else _fifo_message(key, record)


def _fifo_message(key: bytes, value: bytes) -> Message:
    _, flags, expires, created, deliveries = HDR.unpack_from(value)
    offset = U64.unpack_from(key, len(key) - 8)[0]
    return Message(value[HDR.size :], flags, expires, created, offset, deliveries)


class PerQueueStore(FifoStore):
    """`bdb`: per queue a B-tree file of messages and a Hash file of body digests."""

    barrier_ops = frozenset({jobs.DELETE})  # dbremove needs the handles closed
    catalog_file = "catalog.db"

    def __init__(self, data_dir: Path, config: BdbConfig) -> None:
        super().__init__(data_dir, config)
        self._lru: OrderedDict[str, _Queue] = OrderedDict()  # queues with open files

    def _make_queue(self, name: str, raw: bytes, qid: int) -> _Queue:
        q = _Queue(name, raw, qid)
        q.stem = file_stem(raw)
        return q

    def _open_env(self) -> None:
        super()._open_env()
        self._remove_orphans()

    def _handles(self) -> Iterable[Any]:
        handles = [h for q in self._lru.values() for h in (q.mdb, q.udb) if h is not None]
        self._lru.clear()
        return [*handles, *super()._handles()]

    def _used(self, q: _Queue) -> None:
        if self._lru.get(q.name) is q:
            self._lru.move_to_end(q.name)

    def _attach(self, q: _Queue) -> None:
        mdb = self._open_db(q.stem + ".btree", db.DB_BTREE)
        try:
            udb = self._open_db(q.stem + ".hash", db.DB_HASH)
        except BaseException:
            mdb.close(db.DB_NOSYNC)
            raise
        old = self._lru.pop(q.name, None)
        if old is not None and old is not q:
            _close_files(old)
        q.mdb, q.udb = mdb, udb
        self._lru[q.name] = q

    def _detach(self, q: _Queue) -> None:
        if self._lru.get(q.name) is q:
            del self._lru[q.name]
        _close_files(q)

    def trim(self) -> None:
        while len(self._lru) > self.config.max_open_queues:
            _close_files(self._lru.popitem(last=False)[1])

    def _clear_index(self, txn: Any, q: _Queue, limit: int) -> int:
        q.udb.truncate(txn)  # the file holds this queue's counts only
        return 0

    def _remove_orphans(self) -> None:
        """Files of a queue whose creating batch failed: empty, and in no catalog entry."""
        known = {q.stem for q in self.queues.values()}
        for path in self.data_dir.iterdir():
            stem, dot, suffix = path.name.rpartition(".")
            queue_file = dot and suffix in ("btree", "hash") and stem[:2] in ("q-", "h-")
            if queue_file and stem not in known:
                self.env.dbremove(path.name, None, None, db.DB_AUTO_COMMIT)

    def delete(self, txn: Any, name: str, arg: None) -> bool:
        q = self.queues.get(name)
        if q is None:
            return False
        self._touch(q)
        self._detach(q)
        self.env.dbremove(q.stem + ".btree", None, txn)
        self.env.dbremove(q.stem + ".hash", None, txn)
        while _delete_range(self.cat, txn, CAT_RESERVED + q.qkey, CHUNK):
            pass
        self._drop_catalog_entry(txn, q)
        del self.queues[name]
        return True


def _close_files(q: _Queue) -> None:
    mdb, udb = q.mdb, q.udb
    q.mdb = q.udb = None
    for handle in (mdb, udb):
        if handle is not None:
            handle.close(db.DB_NOSYNC)


class SingleStore(FifoStore):
    """`bdb-single`: every queue's messages and digests in the catalog's one B-tree."""

    def _make_queue(self, name: str, raw: bytes, qid: int) -> _Queue:
        q = _Queue(name, raw, qid)
        q.mdb = q.udb = self.cat
        q.mpre = MSG + q.qkey
        q.upre = UNIQ + q.qkey
        return q


class RandomStore(Store):
    """`bdb-random`: messages keyed by queue and body digest, so each body is stored once.

    take() returns the first waiting message in digest order: no fixed order,
    one B-tree lookup. The reserved index maps a reserved offset to its digest.
    """

    created_at = RHDR_CREATED

    def _make_queue(self, name: str, raw: bytes, qid: int) -> _Queue:
        q = _Queue(name, raw, qid)
        q.mdb = self.cat
        q.mpre = MSG + q.qkey
        q.hint_key = q.mpre
        return q

    def _purge_prefixes(self, qkey: bytes) -> list[bytes]:
        return [MSG + qkey, CAT_RESERVED + qkey]

    def put(self, txn: Any, name: str, arg: tuple[Message, bool]) -> int | None:
        message = arg[0]
        q = self.queues.get(name)
        if q is None:
            q = self._create(name)
        key = q.mpre + _digest(message.body)
        offset = q.next_offset
        created = message.created
        value = RHDR.pack(
            WAITING, offset, message.flags, message.expires, created, message.deliveries
        )
        try:
            self.cat.put(key, value + message.body, txn, db.DB_NOOVERWRITE)
        except db.DBKeyExistError:
            return None
        self._touch(q)
        q.next_offset = offset + 1
        q.items += 1
        q.bytes += len(message.body)
        if key < q.hint_key:
            q.hint_key = key
        self._head_added(q, key, created)
        message.offset = offset
        return offset

    def _first_waiting(self, cur: Any, q: _Queue) -> tuple[bytes, bytes] | None:
        prefix = q.mpre
        rec = cur.set_range(q.hint_key)
        while rec is not None and rec[0].startswith(prefix):
            if rec[1][0] == WAITING:
                return rec  # type: ignore[no-any-return]
            rec = cur.next()
        return None

    def _pop(self, txn: Any, name: str, reserve: bool) -> Message | None:
        q = self.queues.get(name)
        if q is None or q.items == q.open:
            return None
        cur = self.cat.cursor(txn)
        try:
            rec = self._first_waiting(cur, q)
            if rec is None:
                return None
            key, value = rec
            _, offset, flags, expires, created, deliveries = RHDR.unpack_from(value)
            body = value[RHDR.size :]
            deliveries += 1
            self._touch(q)
            if reserve:
                value = RHDR.pack(RESERVED, offset, flags, expires, created, deliveries) + body
                cur.put(key, value, db.DB_CURRENT)
            else:
                cur.delete()
                q.items -= 1
                q.bytes -= len(body)
                self._head_removed(q, key)
        finally:
            cur.close()
        q.hint_key = key + b"\x00"  # the least key after this one
        if reserve:
            self.cat.put(CAT_RESERVED + q.qkey + U64.pack(offset), key[len(q.mpre) :], txn)
            q.open += 1
        return Message(body, flags, expires, created, offset, deliveries)

    def take(self, txn: Any, name: str, arg: None) -> Message | None:
        return self._pop(txn, name, False)

    def reserve(self, txn: Any, name: str, arg: None) -> Message | None:
        return self._pop(txn, name, True)

    def _find(self, txn: Any, q: _Queue, offset: int) -> tuple[bytes, bytes | None] | None:
        """(message key, reserved index key or None) of the message at `offset`."""
        rkey = CAT_RESERVED + q.qkey + U64.pack(offset)
        suffix = self.cat.get(rkey, None, txn)
        if suffix is not None:
            return q.mpre + suffix, rkey
        # A waiting message has no index by offset: look through the queue.
        # The broker removes by offset only what it reserved, so this is rare.
        want = U64.pack(offset)
        prefix = q.mpre
        cur = self.cat.cursor(txn)
        try:
            rec = cur.set_range(prefix)
            while rec is not None and rec[0].startswith(prefix):
                if rec[1][1:9] == want:
                    return rec[0], None
                rec = cur.next()
        finally:
            cur.close()
        return None

    def remove(self, txn: Any, name: str, offset: int) -> bool:
        q = self.queues.get(name)
        if q is None:
            return False
        found = self._find(txn, q, offset)
        if found is None:
            return False
        key, rkey = found
        value = self.cat.get(key, None, txn)
        if value is None:
            return False
        self._touch(q)
        self.cat.delete(key, txn)
        if rkey is not None:
            self.cat.delete(rkey, txn)
            q.open -= 1
        q.items -= 1
        q.bytes -= len(value) - RHDR.size
        self._head_removed(q, key)
        return True

    def release(self, txn: Any, name: str, offset: int) -> bool:
        q = self.queues.get(name)
        if q is None or not q.open:
            return False
        rkey = CAT_RESERVED + q.qkey + U64.pack(offset)
        suffix = self.cat.get(rkey, None, txn)
        if suffix is None:
            return False
        key = q.mpre + suffix
        value = self.cat.get(key, None, txn)
        if value is None or value[0] != RESERVED:
            return False
        self._touch(q)
        self.cat.put(key, bytes((WAITING,)) + value[1:], txn)
        self.cat.delete(rkey, txn)
        q.open -= 1
        if key < q.hint_key:
            q.hint_key = key
        return True

    def peek(self, txn: Any, name: str, arg: None) -> Message | None:
        q = self.queues.get(name)
        if q is None or q.items == q.open:
            return None
        cur = self.cat.cursor(txn)
        try:
            rec = self._first_waiting(cur, q)
        finally:
            cur.close()
        return None if rec is None else _random_message(rec[1])

    def read_at(self, txn: Any, name: str, offset: int) -> Message | None:
        q = self.queues.get(name)
        if q is None:
            return None
        found = self._find(txn, q, offset)
        if found is None:
            return None
        value = self.cat.get(found[0], None, txn)
        return None if value is None else _random_message(value)

    def restore(self, txn: Any, name: str, message: Message) -> bool:
        q = self.queues.get(name)
        if q is None:
            return False
        key = q.mpre + _digest(message.body)
        deliveries = max(message.deliveries - 1, 0)
        value = RHDR.pack(
            WAITING, message.offset, message.flags, message.expires, message.created, deliveries
        )
        try:
            self.cat.put(key, value + message.body, txn, db.DB_NOOVERWRITE)
        except db.DBKeyExistError:
            return False  # the same body was put again meanwhile
        self._touch(q)
        q.items += 1
        q.bytes += len(message.body)
        if key < q.hint_key:
            q.hint_key = key
        self._head_added(q, key, message.created)
        return True

    def _read_reserved(self, txn: Any, q: _Queue, offset: int, value: bytes) -> Message | None:
        record = self.cat.get(q.mpre + value, None, txn)
        return None if record is None else _random_message(record)


def _random_message(value: bytes) -> Message:
    _, offset, flags, expires, created, deliveries = RHDR.unpack_from(value)
    return Message(value[RHDR.size :], flags, expires, created, offset, deliveries)
