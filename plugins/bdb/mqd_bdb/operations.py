"""The message operations every layout shares: put with limits, take, reserve, remove, ...

They run on the worker thread inside a batch's transaction, in terms of the
calls a layout supplies (declared at the end of mqd_bdb.store.Store).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

from berkeleydb import db

from mqd.backend import NO_LIMITS, PUT_STORED, Lease, Limits, Message, Put, Receipt
from mqd_bdb import jobs
from mqd_bdb.catalog import QueueState
from mqd_bdb.records import (
    CAT_RESERVED,
    RESERVED,
    WAITING,
    body_of,
    digest,
    lease_record,
    message_record,
    read_message,
    remarked,
    u64,
)
from mqd_bdb.store import Store

#: The fanout children the event loop knew of, by name: their limits, and
#: whether each keeps one copy of a body (its `unique`).
Children = dict[str, tuple[Limits, bool]]
NO_CHILD: Final = (NO_LIMITS, False)  # a child made in the very batch of a put
#: A fanout put's value once its parent stored it: the children that stored
#: their copies (the event loop counts them in each child's `enqueued`).
Copied = tuple[str, ...]


class Operations(Store):
    """put, take, reserve, remove, peek, contains, discard, restore."""

    def put(
        self, txn: Any, name: str, arg: tuple[Message, bool, Limits, Children | None]
    ) -> Put | Copied:
        """Store `message`; then, with `children` (fanout), a copy in each child.

        A fanout child is the queue `<name>+<child>`; it gets its copy in the
        same transaction, under its own limits and `unique` (given by the
        event loop, which knows the daemon's settings), refusing or dropping
        for itself.
        Stored, a put with `children` is worth the children that stored
        their copies (Copied) rather than PUT_STORED.
        """
        message, unique, limits, children = arg
        q = self.queues.get(name)
        if q is None:
            q = self._create(name)
        elif q.mdb is None:
            self._attach(q)
        bounded = jobs.bounded(limits)
        if bounded:
            size = len(message.body)
            # A full queue refuses a plain put before anything else; a unique
            # put of a body that is there is a duplicate however full it is.
            if not unique and not limits.drop_oldest and not _fits(q, limits, size):
                return Put.FULL
        # Keyed by body, the write itself finds a duplicate, but only after
        # drop_oldest made room: with limits, look first.
        if (bounded if self.keyed_by_body else unique) and self._duplicate(txn, q, message.body):
            return Put.DUPLICATE
        if bounded and not self._make_room(txn, q, limits, size):
            return Put.FULL
        if not self._append(txn, q, message):
            return Put.DUPLICATE
        if children is not None:
            copied = []
            for child in self.children.get(name, ()):
                # A child made in this very batch is not known to the loop
                # yet: no limits for it.
                own_limits, own_unique = children.get(child, NO_CHILD)
                copy = Message(message.body, message.flags, message.expires, message.created)
                if self.put(txn, child, (copy, own_unique, own_limits, None)) is PUT_STORED:
                    copied.append(child)
            return tuple(copied)
        return PUT_STORED

    def _make_room(self, txn: Any, q: QueueState, limits: Limits, size: int) -> bool:
        """Whether `size` more bytes fit, after dropping the oldest waiting if allowed."""
        if _fits(q, limits, size):
            return True
        if limits.max_bytes and size > limits.max_bytes:
            return False
        if not limits.drop_oldest or (limits.max_items and q.open >= limits.max_items):
            return False  # open messages are never dropped
        while limits.overflow(q.items, q.bytes, size):
            # The open messages' bytes are not counted apart: when they alone
            # fill max_bytes, every waiting message goes before FULL is known.
            rec = self._oldest_waiting(txn, q)
            if rec is None:
                return False
            self._touch(q)
            self._delete_record(txn, q, rec[0], body_of(rec[1]))
        return True

    def _append(self, txn: Any, q: QueueState, message: Message) -> bool:
        """Store `message` at the end of `q` (setting its offset); False if its body is there."""
        message.offset = q.next_offset
        if not self._write_waiting(txn, q, message):
            return False
        self._counted_in(q, message)
        return True

    def _counted_in(self, q: QueueState, message: Message) -> None:
        """`message`, its offset the queue's next, joins `q`: count it in."""
        if q.name not in self._touched:
            self._touch(q)
        offset = message.offset
        q.next_offset = offset + 1
        q.items += 1
        q.bytes += len(message.body)
        q.changed = self.now
        if self.keyed_by_body:
            key = q.mpre + digest(message.body)
            self._rewind(q, key, offset)
            q.head_added(key, message.created)
        elif q.items == 1:  # an offset-keyed append sorts after the head and the hint
            q.head_is(q.mpre + u64(offset), message.created)

    def _write_waiting(self, txn: Any, q: QueueState, message: Message) -> bool:
        """Write the record of `message`, waiting; False if keyed by body and that is there."""
        body = message.body
        value = message_record(WAITING, message)
        if self.keyed_by_body:
            try:
                q.mdb.put(q.mpre + digest(body), value, txn, db.DB_NOOVERWRITE)
            except db.DBKeyExistError:
                return False
        else:
            q.mdb.put(q.mpre + u64(message.offset), value, txn)
        if q.indexed:
            self._count_body(txn, q, body, 1)
        return True

    def _records(self, txn: Any, q: QueueState) -> Iterator[tuple[bytes, bytes]]:
        """Every message record of `q`, in key order."""
        prefix = q.mpre
        cur = q.mdb.cursor(txn)
        try:
            rec = cur.set_range(prefix)
            while rec is not None and rec[0].startswith(prefix):
                yield rec
                rec = cur.next()
        finally:
            cur.close()

    def _delete_record(self, txn: Any, q: QueueState, key: bytes, body: bytes) -> None:
        """Remove the message record at `key` (the caller touched `q`)."""
        q.mdb.delete(key, txn)
        self._deleted(txn, q, key, body)

    def _deleted(self, txn: Any, q: QueueState, key: bytes, body: bytes) -> None:
        """The message record at `key` was removed: count it out."""
        q.removed(key, len(body))
        if q.indexed:
            self._count_body(txn, q, body, -1)

    def _pop(self, txn: Any, q: QueueState, lease: Lease | None) -> Message | None:
        """Hand out the next waiting message: removed, or opened under `lease`."""
        if q.items == q.open:
            return None
        rec = self._first_waiting(txn, q) if lease else self._take_first(txn, q)
        if rec is None:
            return None
        key, value = rec
        message = read_message(value)
        message.deliveries += 1
        if q.name not in self._touched:
            self._touch(q)
        if lease is None:
            self._deleted(txn, q, key, message.body)
        else:
            offset = message.offset
            q.mdb.put(key, remarked(value, RESERVED, message.deliveries), txn)
            lease_key = CAT_RESERVED + q.qkey + u64(offset)
            self.cat.put(lease_key, lease_record(lease, key[len(q.mpre) :]), txn)
            q.open += 1
            message.receipt = Receipt(q.name, q.qid, offset, lease.token)
        # The next search starts after it: no waiting message sorts before.
        if self.keyed_by_body:
            q.hint_key = key + b"\x00"  # the least key after this one
        else:
            q.hint = message.offset + 1
        return message

    def take(self, txn: Any, name: str, arg: None) -> Message | None:
        q = self.queues.get(name)
        if q is None or q.items == q.open:
            return None
        if q.mdb is None:
            self._attach(q)
        return self._pop(txn, q, None)

    def reserve(self, txn: Any, name: str, arg: tuple[str, float]) -> Message | None:
        q = self._find(name)
        if q is None:
            return None
        owner, seconds = arg
        return self._pop(txn, q, Lease.start(owner, seconds, self.now))

    def reserve_many(self, txn: Any, name: str, arg: tuple[str, float, int, int]) -> list[Message]:
        """Up to `count` reserve()s in this transaction, stopping once `max_bytes` is reached."""
        q = self._find(name)
        if q is None:
            return []
        owner, seconds, count, max_bytes = arg
        # One lease for all of them: a receipt names the offset too, so one
        # new token tells each of these reservations from every other.
        lease = Lease.start(owner, seconds, self.now)
        opened: list[Message] = []
        size = 0
        while len(opened) < count:
            message = self._pop(txn, q, lease)
            if message is None:
                break
            opened.append(message)
            size += len(message.body)
            if max_bytes and size >= max_bytes:
                break
        return opened

    def remove(self, txn: Any, name: str, offset: int) -> bool:
        q = self._find(name)
        rec = None if q is None else self._waiting_at(txn, q, offset)
        if q is None or rec is None:
            return False
        self._touch(q)
        self._delete_record(txn, q, rec[0], body_of(rec[1]))
        return True

    def peek(self, txn: Any, name: str, arg: None) -> Message | None:
        q = self._find(name)
        if q is None or q.items == q.open:
            return None
        rec = self._first_waiting(txn, q)
        return None if rec is None else read_message(rec[1])

    def contains(self, txn: Any, name: str, body: bytes) -> bool:
        q = self._find(name)
        return q is not None and self._contains(txn, q, body)

    def discard(self, txn: Any, name: str, body: bytes) -> int:
        q = self._find(name)
        return 0 if q is None else self._discard(txn, q, body)

    def restore(self, txn: Any, name: str, message: Message) -> bool:
        """Put a taken message back where it was (its taker went away)."""
        q = self._find(name)
        if q is None:
            return False
        body = message.body
        key = q.mpre + (digest(body) if self.keyed_by_body else u64(message.offset))
        back = Message(
            body,
            message.flags,
            message.expires,
            message.created,
            message.offset,
            max(message.deliveries - 1, 0),
            origin=message.origin,
        )
        try:
            q.mdb.put(key, message_record(WAITING, back), txn, db.DB_NOOVERWRITE)
        except db.DBKeyExistError:
            return False  # bdb-random: the same body was put again meanwhile
        self._touch(q)
        q.items += 1
        q.bytes += len(body)
        if q.indexed:
            self._count_body(txn, q, body, 1)
        self._rewind(q, key, message.offset)
        q.head_added(key, message.created)
        return True


def _fits(q: QueueState, limits: Limits, size: int) -> bool:
    """Whether `size` more bytes fit in `q` as it is."""
    too_big = limits.max_bytes and size > limits.max_bytes
    return not too_big and not limits.overflow(q.items, q.bytes, size)
