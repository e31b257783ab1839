"""The layout calls of the two layouts that keep messages in order: `bdb` and `bdb-single`.

Messages are keyed by prefix + big-endian offset, so the first key is the
head. An open message stays in place, marked RESERVED. Copies of each body
are counted under its digest once the queue has seen a unique put
(mqd_bdb.index).
"""

from __future__ import annotations

from typing import Any

from mqd.backend import Message
from mqd_bdb.catalog import QueueState
from mqd_bdb.deferred import DeferredPuts
from mqd_bdb.records import WAITING, body_of, first_waiting, read_message, u64


class FifoStore(DeferredPuts):
    """Messages in offset order; PerQueueStore and SingleStore say which files hold them."""

    def _first_waiting(self, txn: Any, q: QueueState) -> tuple[bytes, bytes] | None:
        # Nearly always the message at the hint is the head, waiting: read it
        # by key. Otherwise (open messages or gaps) step with a cursor.
        key = q.mpre + u64(q.hint)
        value = q.mdb.get(key, None, txn)
        if value is not None and value[0] == WAITING:
            return key, value
        cur = q.mdb.cursor(txn)
        try:
            return first_waiting(cur, key, q.mpre)
        finally:
            cur.close()

    def _take_first(self, txn: Any, q: QueueState) -> tuple[bytes, bytes] | None:
        # One descent of the tree: the cursor that finds the head removes it
        # (a read and then a delete by key would descend twice).
        cur = q.mdb.cursor(txn)
        try:
            rec = first_waiting(cur, q.mpre + u64(q.hint), q.mpre)
            if rec is not None:
                cur.delete()
                if not q.open:
                    # With none open, nothing sorts before the hint: the
                    # record taken was the head, and the one after it is the
                    # next. Read here, one step on, rather than looked up
                    # again by the end of the batch (Catalog._head); what
                    # follows may be another queue's, or none (set_head).
                    self._touch(q)
                    q.set_head(cur.next())
            return rec
        finally:
            cur.close()

    def _oldest_waiting(self, txn: Any, q: QueueState) -> tuple[bytes, bytes] | None:
        return self._first_waiting(txn, q)

    def _waiting_at(self, txn: Any, q: QueueState, offset: int) -> tuple[bytes, bytes] | None:
        key = q.mpre + u64(offset)
        value = q.mdb.get(key, None, txn)
        return (key, value) if value is not None and value[0] == WAITING else None

    def _rewind(self, q: QueueState, key: bytes, offset: int) -> None:
        if offset < q.hint:
            q.hint = offset

    def _duplicate(self, txn: Any, q: QueueState, body: bytes) -> bool:
        return self._count_of(txn, q, body) > 0

    def _contains(self, txn: Any, q: QueueState, body: bytes) -> bool:
        return self._count_of(txn, q, body) > 0

    def _discard(self, txn: Any, q: QueueState, body: bytes) -> int:
        if not self._count_of(txn, q, body):
            return 0
        # The count says whether the body is there, not where: look through
        # the waiting messages (none sorts before the hint).
        found: list[bytes] = []
        prefix = q.mpre
        cur = q.mdb.cursor(txn)
        try:
            rec = cur.set_range(prefix + u64(q.hint))
            while rec is not None and rec[0].startswith(prefix):
                if rec[1][0] == WAITING and body_of(rec[1]) == body:
                    found.append(rec[0])
                rec = cur.next()
        finally:
            cur.close()
        if found:
            self._touch(q)
        for key in found:
            self._delete_record(txn, q, key, body)
        return len(found)

    def read_at(self, txn: Any, name: str, offset: int) -> Message | None:
        q = self._find(name)
        if q is None:
            return None
        value = q.mdb.get(q.mpre + u64(offset), None, txn)
        return None if value is None else read_message(value)

    def read_range(self, txn: Any, name: str, arg: tuple[int, int, int]) -> list[Message]:
        first, count, max_bytes = arg
        q = self._find(name)
        if q is None:
            return []
        prefix, end = q.mpre, q.mpre + u64(first + count)
        found: list[Message] = []
        size = 0
        cur = q.mdb.cursor(txn)
        try:
            rec = cur.set_range(prefix + u64(max(first, 0)))
            while rec is not None and rec[0] < end and rec[0].startswith(prefix):
                message = read_message(rec[1])
                found.append(message)
                size += len(message.body)
                if max_bytes and size >= max_bytes:
                    break
                rec = cur.next()
        finally:
            cur.close()
        return found
