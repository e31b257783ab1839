"""The operations of the layouts that keep messages in order: `bdb` and `bdb-single`.

Messages are keyed by prefix + big-endian offset, so the first key is the
head. A reserved message stays in place with its marker set. Copies of each
body are counted under its digest once the queue has seen a unique put
(mqd_bdb.index).
"""

from __future__ import annotations

from typing import Any

from mqd.backend import Message
from mqd_bdb.catalog import QueueState
from mqd_bdb.index import BodyIndex
from mqd_bdb.records import CAT_RESERVED, HDR, RESERVED, U32, U64, WAITING, digest, fifo_message


class FifoStore(BodyIndex):
    """Messages in offset order; the layouts say which files hold them."""

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
            ukey = q.upre + digest(body)
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

    def _first_waiting(self, cur: Any, q: QueueState) -> tuple[bytes, bytes] | None:
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
        q.head_removed(key)
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
        return None if rec is None else fifo_message(rec[0], rec[1])

    def read_at(self, txn: Any, name: str, offset: int) -> Message | None:
        q = self.queues.get(name)
        if q is None:
            return None
        if q.mdb is None:
            self._attach(q)
        key = q.mpre + U64.pack(offset)
        value = q.mdb.get(key, None, txn)
        return None if value is None else fifo_message(key, value)

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
        q.head_added(key, message.created)
        return True

    def _read_reserved(self, txn: Any, q: QueueState, offset: int, value: bytes) -> Message | None:
        if q.mdb is None:
            self._attach(q)
        key = q.mpre + U64.pack(offset)
        record = q.mdb.get(key, None, txn)
        return None if record is None else fifo_message(key, record)
