"""Copies of each body counted per queue, for unique puts in the FIFO layouts.

A FIFO layout keys messages by offset, so finding a body needs a second
index: per queue, body digest -> how many waiting or open messages carry it.
Only queues that have seen a unique put pay for it. The first unique put on a
queue counts its messages, inline for up to INLINE_INDEX of them, in chunks
of their own transactions beyond; counting then goes on with every change.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Final

from mqd_bdb.catalog import CHUNK, QueueState
from mqd_bdb.queue_ops import QueueOps
from mqd_bdb.records import U32, body_of, delete_range, digest
from mqd_bdb.store import NeedsIndex

INLINE_INDEX: Final = 1000  # a queue this small has its bodies counted inside the batch


class BodyIndex(QueueOps):
    """The counting of bodies, for a layout whose queues have `udb` and `upre`."""

    def _count_body(self, txn: Any, q: QueueState, body: bytes, delta: int) -> None:
        key = q.upre + digest(body)
        raw = q.udb.get(key, None, txn)
        count = (U32.unpack(raw)[0] if raw else 0) + delta
        if count > 0:
            q.udb.put(key, U32.pack(count), txn)
        elif raw:
            q.udb.delete(key, txn)

    def _clear_index(self, txn: Any, q: QueueState, limit: int) -> int:
        """Delete up to `limit` leftovers of an unfinished count; how many were."""
        return delete_range(q.udb, txn, q.upre, limit)

    def _count_chunk(
        self, txn: Any, q: QueueState, after: bytes | None, limit: int
    ) -> bytes | None:
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
                counts[digest(body_of(rec[1]))] += 1
                last = rec[0]
                limit -= 1
                rec = cur.next()
        finally:
            cur.close()
        for body_digest, count in counts.items():
            key = q.upre + body_digest
            raw = q.udb.get(key, None, txn)
            q.udb.put(key, U32.pack(count + (U32.unpack(raw)[0] if raw else 0)), txn)
        return last

    def _index_inline(self, txn: Any, q: QueueState) -> None:
        """Count the bodies of a small queue inside the batch's transaction."""
        if q.items > INLINE_INDEX:
            raise NeedsIndex(q.name)
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
        while self._own_txn(self._clear_index, q, CHUNK):
            pass  # leftovers of a count that a crash interrupted
        after = self._own_txn(self._count_chunk, q, None, CHUNK)
        while after is not None:
            after = self._own_txn(self._count_chunk, q, after, CHUNK)
        q.indexed = True
        try:
            self._own_txn(self._save_queue, q)
        except BaseException:
            q.indexed = False
            raise

    def _count_of(self, txn: Any, q: QueueState, body: bytes) -> int:
        """How many messages of `q` carry `body`, counting the queue first if need be."""
        if not q.indexed:
            self._index_inline(txn, q)
        raw = q.udb.get(q.upre + digest(body), None, txn)
        return U32.unpack(raw)[0] if raw else 0
