"""`bdb-random`: every queue a set, keyed by (queue, body digest) in the catalog's file."""

from __future__ import annotations

from typing import Any

from berkeleydb import db

from mqd.backend import Message
from mqd_bdb.catalog import QueueState
from mqd_bdb.records import (
    CAT_RESERVED,
    MSG,
    RESERVED,
    RHDR,
    RHDR_CREATED,
    U64,
    WAITING,
    digest,
    random_message,
)
from mqd_bdb.store import Store


class RandomStore(Store):
    """`bdb-random`: messages keyed by queue and body digest, so each body is stored once.

    take() returns the first waiting message in digest order: no fixed order,
    one B-tree lookup. The reserved index maps a reserved offset to its digest.
    """

    created_at = RHDR_CREATED

    def _make_queue(self, name: str, raw: bytes, qid: int) -> QueueState:
        q = QueueState(name, raw, qid)
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
        key = q.mpre + digest(message.body)
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
        q.head_added(key, created)
        message.offset = offset
        return offset

    def _first_waiting(self, cur: Any, q: QueueState) -> tuple[bytes, bytes] | None:
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
                q.head_removed(key)
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

    def _find(self, txn: Any, q: QueueState, offset: int) -> tuple[bytes, bytes | None] | None:
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
        q.head_removed(key)
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
        return None if rec is None else random_message(rec[1])

    def restore(self, txn: Any, name: str, message: Message) -> bool:
        q = self.queues.get(name)
        if q is None:
            return False
        key = q.mpre + digest(message.body)
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
        q.head_added(key, message.created)
        return True

    def _read_reserved(self, txn: Any, q: QueueState, offset: int, value: bytes) -> Message | None:
        record = self.cat.get(q.mpre + value, None, txn)
        return None if record is None else random_message(record)
