"""`bdb-random`: every queue a set, keyed by (queue, body digest) in the catalog's file.

A put is one write, and a body already in the queue (waiting or open) is not
stored again, whatever `unique` says. take() hands out the first waiting
message in digest order: no fixed order, one B-tree lookup. A lease record
holds the digest, so an open message is found from its receipt at once.
"""

from __future__ import annotations

from typing import Any

from mqd_bdb.catalog import QueueState
from mqd_bdb.queue_ops import QueueOps
from mqd_bdb.records import CAT_RESERVED, MSG, WAITING, digest, first_waiting, offset_of


class RandomStore(QueueOps):
    """Messages keyed by queue and body digest, so each body is stored once per queue."""

    layout_name = "bdb-random"

    keyed_by_body = True

    def _make_queue(self, name: str, raw: bytes, qid: int) -> QueueState:
        q = QueueState(name, raw, qid)
        q.mdb = self.cat
        q.mpre = MSG + q.qkey
        q.hint_key = q.mpre
        return q

    def _purge_prefixes(self, qkey: bytes) -> list[bytes]:
        return [MSG + qkey, CAT_RESERVED + qkey]

    def _first_waiting(self, txn: Any, q: QueueState) -> tuple[bytes, bytes] | None:
        cur = self.cat.cursor(txn)
        try:
            return first_waiting(cur, q.hint_key, q.mpre)
        finally:
            cur.close()

    def _take_first(self, txn: Any, q: QueueState) -> tuple[bytes, bytes] | None:
        cur = self.cat.cursor(txn)
        try:
            rec = first_waiting(cur, q.hint_key, q.mpre)
            if rec is not None:
                cur.delete()  # where the cursor is: no second search
        finally:
            cur.close()
        return rec

    def _oldest_waiting(self, txn: Any, q: QueueState) -> tuple[bytes, bytes] | None:
        # Not indexed by age: read through the queue (only a full queue with
        # overflow = "drop_oldest" asks).
        oldest: tuple[bytes, bytes] | None = None
        for rec in self._records(txn, q):
            if rec[1][0] == WAITING and (
                oldest is None or offset_of(rec[1]) < offset_of(oldest[1])
            ):
                oldest = rec
        return oldest

    def _waiting_at(self, txn: Any, q: QueueState, offset: int) -> tuple[bytes, bytes] | None:
        # No index by offset: the broker removes the head it just peeked at,
        # so look there first, then through the queue.
        head = self._first_waiting(txn, q)
        if head is not None and offset_of(head[1]) == offset:
            return head
        for rec in self._records(txn, q):
            if rec[1][0] == WAITING and offset_of(rec[1]) == offset:
                return rec
        return None

    def _rewind(self, q: QueueState, key: bytes, offset: int) -> None:
        if key < q.hint_key:
            q.hint_key = key

    def _duplicate(self, txn: Any, q: QueueState, body: bytes) -> bool:
        return bool(self.cat.exists(q.mpre + digest(body), txn))

    def _contains(self, txn: Any, q: QueueState, body: bytes) -> bool:
        return bool(self.cat.exists(q.mpre + digest(body), txn))

    def _discard(self, txn: Any, q: QueueState, body: bytes) -> int:
        key = q.mpre + digest(body)
        value = self.cat.get(key, None, txn)
        if value is None or value[0] != WAITING:
            return 0
        self._touch(q)
        self._delete_record(txn, q, key, body)
        return 1
