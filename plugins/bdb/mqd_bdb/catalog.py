"""The catalog: which queues exist, their counters, and the queues being purged.

The worker keeps a QueueState per queue, a mirror of its catalog record.
A batch *touches* a queue before changing it (a snapshot to restore should
the transaction abort) and at its end writes the record of every touched
queue once, in the batch's transaction, so after a crash counts and next
offsets match the messages exactly and offsets are never reused. Except
where a round of held sets and gets changed no message record (every put
taken in the round): only next offsets moved, which none of its answers
shows, so its records are left as they were, to be saved with the queue's
next change or at close; a crash may then number messages again from an
older offset, as it may after any round not synced.

The queues changed most recently keep their counts in one record instead,
CAT_RECENT, which a batch rewrites whole: under a steady load, a batch that
changes a dozen queues makes one put where it would make one per queue (each
a descent of the tree and a log record of its own). A queue's own record,
written when it joins the recent ones and when it leaves them, names it for
the recent record's entries (by qid) and holds its counts when it is not
there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Final

from berkeleydb import db

from mqd.backend import QueueSize
from mqd.errors import StorageError
from mqd_bdb.config import BdbConfig
from mqd_bdb.environment import Environment
from mqd_bdb.names import decode_name, encode_name
from mqd_bdb.records import (
    CAT_FORMAT,
    CAT_NEXT_QID,
    CAT_PURGE,
    CAT_QUEUE,
    CAT_RECENT,
    CAT_RESERVED,
    CREATED,
    FORMAT_VERSION,
    INDEXED,
    META,
    MSG,
    QID,
    REC_CREATED,
    U32,
    UNIQ,
    UPGRADED,
    delete_range,
)

CHUNK: Final = 500  # records per transaction when purging a queue or counting its bodies
#: Queues the recent record holds, at most: 18 METAs are 954 bytes, under the
#: size at which a B-tree of 4 KiB pages moves a record to overflow pages.
RECENT_MAX: Final = 18
#: A queue no batch has touched for this long gives its place among the
#: recent ones to another.
RECENT_IDLE_S: Final = 1.0


class QueueState:
    """What the worker knows of one queue; its counts mirror the catalog record."""

    __slots__ = (
        "bytes",
        "changed",
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
        "touched_at",
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
        # When a message was last stored or moved in or out, or the queue
        # made (Unix time): an idle queue expires after a while without.
        self.changed = 0.0
        # When a batch last touched it, in this process: the recent record
        # gives the place of the queue untouched longest to another.
        self.touched_at = 0.0
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

    def set_meta(self, raw: bytes, at: int = 0) -> None:
        """Take the counts of the META at `raw[at:]` (its qid is this queue's)."""
        _, self.next_offset, self.items, self.bytes, self.open, head, changed, flags = (
            META.unpack_from(raw, at)
        )
        self.head_created, self.changed = head, changed
        self.indexed = bool(flags & INDEXED)

    def meta(self) -> bytes:
        flags = INDEXED if self.indexed else 0
        return META.pack(
            self.qid,
            self.next_offset,
            self.items,
            self.bytes,
            self.open,
            self.head_created,
            self.changed,
            flags,
        )

    def state(self) -> tuple[Any, ...]:
        """What a batch may change (_CHANGING, in order), to set back should its transaction abort.

        Read field by field here, not by an attrgetter: compiled, these are
        direct reads, where each of the getter's is an attribute lookup.
        """
        return (
            self.next_offset,
            self.items,
            self.bytes,
            self.open,
            self.changed,
            self.head_created,
            self.head_key,
            self.head_dirty,
            self.hint,
            self.hint_key,
            self.indexed,
        )

    def set_state(self, state: tuple[Any, ...]) -> None:
        for field, value in zip(_CHANGING, state, strict=True):
            setattr(self, field, value)

    def set_head(self, rec: tuple[bytes, bytes] | None) -> None:
        """The head is `rec` (None: the queue is empty)."""
        if rec is None or not rec[0].startswith(self.mpre):
            self.head_key, self.head_created = None, 0.0
        else:
            self.head_key = rec[0]
            self.head_created = CREATED.unpack_from(rec[1], REC_CREATED)[0]
        self.head_dirty = False

    def removed(self, key: bytes | None, size: int) -> None:
        """The message at `key` (None: the head), of `size` body bytes, left the queue."""
        self.items -= 1
        self.bytes -= size
        if key is None or self.head_key is None or key == self.head_key:
            self.head_dirty = True  # looked up at the end of the batch

    def head_is(self, key: bytes, created: float) -> None:
        """The record at `key`, made at `created`, is the queue's first."""
        self.head_key, self.head_created, self.head_dirty = key, created, False

    def head_added(self, key: bytes, created: float) -> None:
        """A record was added at `key`: it is the head if it sorts first."""
        if self.items == 1:
            self.head_is(key, created)
        elif self.head_key is None:
            self.head_dirty = True
        elif key < self.head_key:
            self.head_key, self.head_created = key, created


#: The fields of a QueueState that a batch changes.
_CHANGING = (
    "next_offset",
    "items",
    "bytes",
    "open",
    "changed",
    "head_created",
    "head_key",
    "head_dirty",
    "hint",
    "hint_key",
    "indexed",
)

#: A queue before a batch first changed it, and whether it existed then.
Snapshot = tuple[QueueState, bool, tuple[Any, ...]]


class Catalog(Environment):
    """The queues of an environment, loaded at open and saved with every batch."""

    def __init__(self, data_dir: Path, config: BdbConfig) -> None:
        super().__init__(data_dir, config)
        self.queues: dict[str, QueueState] = {}
        self.next_qid = 0
        self.purges: list[bytes] = []  # qid keys of deleted queues with records left
        self.children: dict[str, set[str]] = {}  # fanout parent -> its existing children
        self.emptied: set[str] = set()  # queues emptied since their files were compacted
        self.freed = False  # a deleted queue's records purged since the last compaction
        self.now = 0.0  # the time of the running batch
        self._touched: dict[str, Snapshot] = {}
        self._new_purges: list[bytes] = []
        self._recent: dict[str, QueueState] = {}  # queues whose counts CAT_RECENT holds
        # _recent as the running batch found it, once the batch changes which
        # queues it holds (None: it has not: the record needs no rewrite for
        # that), and whether it found none idle (none can become so while it runs).
        self._recent_before: dict[str, QueueState] | None = None
        self._recent_busy = False
        # Queues whose records lazy batches left as they were (_write_meta).
        self._unsaved: set[str] = set()

    def sizes(self) -> dict[str, QueueSize]:
        return {name: q.size() for name, q in self.queues.items()}

    def every_size(self, txn: Any, name: str, arg: None) -> dict[str, QueueSize]:
        """Job SIZES: sizes(), where the jobs before it have all run."""
        return self.sizes()

    def reopen(self) -> dict[str, QueueSize | None]:
        """After a panic: close, recover, load again. The gauges to publish."""
        before = set(self.queues)
        self.queues = {}
        self.recover()
        published: dict[str, QueueSize | None] = dict.fromkeys(before)
        published.update(self.sizes())
        return published

    def _forget_handles(self) -> None:
        for q in self.queues.values():
            q.mdb = q.udb = None

    def _load(self) -> None:
        self._check_format()
        queues: dict[str, QueueState] = {}
        cur = self.cat.cursor()
        try:
            rec = cur.set_range(CAT_QUEUE)
            while rec is not None and rec[0][:1] == CAT_QUEUE:
                raw = rec[0][1:]
                q = self._make_queue(decode_name(raw), raw, QID.unpack_from(rec[1])[0])
                q.set_meta(rec[1])
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
        self.queues = {}
        self.children = {}
        for name, q in queues.items():
            self._register(name, q)
        self.purges = purges
        self._load_recent(queues.values())

    def _load_recent(self, queues: Iterable[QueueState]) -> None:
        """Take the counts the recent record holds over those of the queues' own records."""
        self._recent, self._recent_before = {}, None
        raw = self.cat.get(CAT_RECENT)
        if not raw:
            return
        by_qid = {q.qid: q for q in queues}
        for at in range(0, len(raw), META.size):
            # A deleted queue leaves the recent record in the transaction that
            # deletes its own record, so every entry names a queue loaded above.
            q = by_qid[QID.unpack_from(raw, at)[0]]
            q.set_meta(raw, at)
            self._recent[q.name] = q

    def _check_format(self) -> None:
        """Refuse records of another format; mark a new catalog with this one."""
        raw = self.cat.get(CAT_FORMAT)
        version = None if raw is None else U32.unpack(raw)[0]
        if version == FORMAT_VERSION:
            return
        if version in UPGRADED or (raw is None and self._is_empty()):
            txn = self.env.txn_begin()
            try:
                self.cat.put(CAT_FORMAT, U32.pack(FORMAT_VERSION), txn)
                txn.commit()
            except BaseException:
                txn.abort()
                raise
            return
        found = "an older" if version is None else f"version {version} of the"
        readable = " and ".join(map(str, sorted({*UPGRADED, FORMAT_VERSION})))
        raise StorageError(
            f"data directory {self.data_dir} holds {found} record format; this version "
            f"reads versions {readable} only: drain it with the mqd version that wrote "
            "it, or move it away (see plugins/bdb/README.md, Files)"
        )

    def _is_empty(self) -> bool:
        cur = self.cat.cursor()
        try:
            return cur.first() is None
        finally:
            cur.close()

    def _make_queue(self, name: str, raw: bytes, qid: int) -> QueueState:
        """A queue object for a catalog entry; layouts set where its messages live."""
        return QueueState(name, raw, qid)

    def _find(self, name: str) -> QueueState | None:
        """The queue called `name`, its databases open; None if there is none."""
        q = self.queues.get(name)
        if q is not None and q.mdb is None:
            self._attach(q)
        return q

    def _attach(self, q: QueueState) -> None:
        """Open the queue's databases (called when `q.mdb` is None)."""

    def _used(self, q: QueueState) -> None:
        """A batch changed `q` (for keeping recently used files open)."""

    # -- changes within a batch --------------------------------------------------

    def _begin(self) -> dict[str, Snapshot]:
        """A batch starts: nothing touched yet. What _end() and _undo() take."""
        touched: dict[str, Snapshot] = {}
        self._touched = touched
        self._new_purges = []
        self._recent_before, self._recent_busy = None, False
        return touched

    def _touch(self, q: QueueState) -> None:
        """Remember `q` as it was before this batch changed it."""
        if q.name not in self._touched:
            self._touched[q.name] = (q, True, q.state())
            q.touched_at = self.now

    def _create(self, name: str) -> QueueState:
        """A new, empty queue, registered by this batch's transaction."""
        raw = encode_name(name)
        q = self._make_queue(name, raw, self.next_qid)
        self.next_qid += 1
        if q.mdb is None:
            self._attach(q)
        q.changed = q.touched_at = self.now
        # A queue deleted earlier in this batch keeps its own snapshot.
        self._touched.setdefault(name, (q, False, ()))
        self._register(name, q)
        return q

    def _register(self, name: str, q: QueueState) -> None:
        self.queues[name] = q
        parent, plus, _ = name.partition("+")
        if plus:
            self.children.setdefault(parent, set()).add(name)

    def _unregister(self, name: str) -> None:
        """`name` no longer exists (deleted, or its creation undone)."""
        if self.queues.pop(name, None) is None:
            return
        parent, plus, _ = name.partition("+")
        kids = self.children.get(parent) if plus else None
        if kids is not None:
            kids.discard(name)
            if not kids:
                del self.children[parent]

    def _write_meta(self, txn: Any, next_qid: int, lazy: bool = False) -> None:
        """Save every touched queue's counts (and the next queue id if it moved).

        `lazy`: the batch changed no message record, so of a queue that
        existed before it only the next offset and the time of the last
        change moved; such a record is left as it was (see Store.wrote) and
        saved with the queue's next change, or at close (_save_unsaved).
        """
        recent = self._recent
        rewrite = self._recent_before is not None  # a deleted queue left it
        for name, (_, existed, _) in self._touched.items():
            q = self.queues.get(name)
            if q is None:
                continue
            if q.head_dirty:
                q.set_head(self._head(txn, q) if q.items else None)
            if lazy and existed:
                self._unsaved.add(name)
            elif recent.get(name) is q or self._join_recent(txn, q):
                rewrite = True
            else:
                self._write_own(txn, q)
            self._used(q)
        if rewrite:
            self._write_recent(txn)
        if self.next_qid != next_qid:
            self.cat.put(CAT_NEXT_QID, QID.pack(self.next_qid), txn)

    def close(self) -> None:
        """Save what lazy batches left unsaved, then checkpoint and close."""
        try:
            self._save_unsaved()
        finally:
            super().close()

    def _save_unsaved(self) -> None:
        """Save the records lazy batches left as they were (_write_meta), in a
        transaction of their own: at close, so that a restart numbers the next
        messages after every offset handed out."""
        queues = [q for q in map(self.queues.get, self._unsaved) if q is not None]
        self._unsaved = set()
        if queues and self.env is not None and not self.panicked:
            self._own_txn(self._save_queues, queues)

    def _save_queues(self, txn: Any, queues: list[QueueState]) -> None:
        # Once a queue: the recent record may be written more than once, but
        # only at close.
        for q in queues:
            self._save_queue(txn, q)

    def _own_txn(self, work: Callable[..., Any], *args: Any) -> Any:
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

    def _save_queue(self, txn: Any, q: QueueState) -> None:
        """Save one queue's counts, outside a batch (in a transaction of its own: _own_txn)."""
        if self._recent.get(q.name) is q:
            self._write_recent(txn)
        else:
            self._write_own(txn, q)

    def _join_recent(self, txn: Any, q: QueueState) -> bool:
        """Give `q` a place among the recent queues, if one is free or idle."""
        recent = self._recent
        oldest = None
        if len(recent) >= RECENT_MAX:
            if self._recent_busy:
                return False
            oldest = min(recent.values(), key=_touched_at)
            if oldest.touched_at > self.now - RECENT_IDLE_S:
                self._recent_busy = True
                return False
        self._keep_recent()
        if oldest is not None:
            del recent[oldest.name]
            self._write_own(txn, oldest)  # its counts, now only there
        recent[q.name] = q
        self._write_own(txn, q)  # for a new queue, the record that names it
        return True

    def _leave_recent(self, q: QueueState) -> None:
        """`q` is being deleted: out of the recent record, which the batch rewrites."""
        if self._recent.get(q.name) is q:
            self._keep_recent()
            del self._recent[q.name]

    def _keep_recent(self) -> None:
        """Which queues are recent is about to change: keep the batch's starting set."""
        if self._recent_before is None:
            self._recent_before = dict(self._recent)

    def _write_own(self, txn: Any, q: QueueState) -> None:
        self.cat.put(CAT_QUEUE + q.raw, q.meta(), txn)

    def _write_recent(self, txn: Any) -> None:
        self.cat.put(CAT_RECENT, b"".join([q.meta() for q in self._recent.values()]), txn)

    def _committed(self, published: dict[str, QueueSize | None]) -> None:
        """The batch's transaction committed: publish the gauges it changed."""
        self._recent_before = None
        self.purges.extend(self._new_purges)
        for name in self._touched:
            q = self.queues.get(name)
            published[name] = None if q is None else q.size()
            if q is not None and not q.items:
                self.emptied.add(name)
        self._touched = {}

    def _undo(self, touched: dict[str, Snapshot], next_qid: int) -> None:
        """The batch's transaction aborted: every queue as it was before it."""
        for name, (q, existed, state) in touched.items():
            if existed:
                q.set_state(state)
                self._register(name, q)
            else:
                self._unregister(name)
        self.next_qid = next_qid
        self._touched = {}
        if self._recent_before is not None:
            self._recent = self._recent_before
        self._recent_before = None

    def _drop_catalog_entry(self, txn: Any, q: QueueState) -> None:
        self._leave_recent(q)
        with contextlib.suppress(db.DBNotFoundError):  # created in this very batch
            self.cat.delete(CAT_QUEUE + q.raw, txn)

    def _head(self, txn: Any, q: QueueState) -> tuple[bytes, bytes] | None:
        """The queue's first record, looked up."""
        cur = q.mdb.cursor(txn)
        try:
            rec = cur.set_range(q.mpre) if q.mpre else cur.first()
        finally:
            cur.close()
        return rec  # type: ignore[no-any-return]

    # -- purging deleted queues (single-file layouts) -----------------------------

    def purge_step(self) -> None:
        """Delete some records of the oldest deleted queue."""
        qkey = self.purges[0]
        txn = self.env.txn_begin()
        try:
            left = CHUNK
            for prefix in self._purge_prefixes(qkey):
                left -= delete_range(self.cat, txn, prefix, left)
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
            self.freed = True

    def _purge_prefixes(self, qkey: bytes) -> list[bytes]:
        return [MSG + qkey, UNIQ + qkey, CAT_RESERVED + qkey]

    def _schedule_purge(self, txn: Any, q: QueueState) -> None:
        self.cat.put(CAT_PURGE + q.qkey, b"", txn)
        self._new_purges.append(q.qkey)


def _touched_at(q: QueueState) -> float:
    return q.touched_at
