"""Leases: the stored record of an open message, and the calls that end or extend one.

The bulk calls (ack_many and the rest) run the single ones in a loop: they
are one job, so one transaction and one sync for all of them.

reserve() (mqd_bdb.operations) writes a lease record beside the message,
marked RESERVED, in the same transaction. Every call here finds the lease by
its receipt and checks the queue's incarnation (its qid, never reused) and
the token before touching anything, so a stale receipt matches nothing.
Reclaiming is two steps: leases() lists the leases to end; the event loop
routes each (dead letters or back) and reclaim() ends each one that is still
due, so a lease acknowledged or extended in between is left alone.
"""

from __future__ import annotations

from typing import Any

from mqd.backend import Lease, Message, Receipt
from mqd_bdb.catalog import QueueState
from mqd_bdb.operations import Operations
from mqd_bdb.records import (
    CAT_RESERVED,
    U64,
    WAITING,
    body_of,
    lease_record,
    offset_of,
    read_lease,
    read_message,
    remarked,
    u64,
)

#: What a receipt found: the queue, the lease record's key, the lease, the message's key.
Found = tuple[QueueState, bytes, Lease, bytes]


class Leases(Operations):
    """ack, release, extend, and the two steps of reclaim."""

    def _lease(self, txn: Any, receipt: Receipt) -> Found | None:
        """The lease `receipt` names, if it is still held."""
        q = self._find(receipt.queue)
        if q is None or q.qid != receipt.incarnation:
            return None
        lease_key = CAT_RESERVED + q.qkey + u64(receipt.offset)
        raw = self.cat.get(lease_key, None, txn)
        if raw is None:
            return None
        lease, suffix = read_lease(raw)
        if lease.token != receipt.token:
            return None
        return q, lease_key, lease, q.mpre + suffix

    def ack(self, txn: Any, name: str, receipt: Receipt) -> bool:
        found = self._lease(txn, receipt)
        if found is None:
            return False
        q, lease_key, _, key = found
        value = q.mdb.get(key, None, txn)
        self._touch(q)
        self.cat.delete(lease_key, txn)
        q.open -= 1
        if value is not None:
            self._delete_record(txn, q, key, body_of(value))
        return True

    def release(self, txn: Any, name: str, arg: tuple[Receipt, str | None]) -> bool:
        receipt, to = arg
        found = self._lease(txn, receipt)
        return found is not None and self._end(txn, found, to)

    def _end(self, txn: Any, found: Found, to: str | None) -> bool:
        """End the lease: the message waits again, or moves to the dead letters `to`."""
        q, lease_key, _, key = found
        value = q.mdb.get(key, None, txn)
        self._touch(q)
        self.cat.delete(lease_key, txn)
        q.open -= 1
        if value is None:
            return True
        if to is None:
            q.mdb.put(key, remarked(value, WAITING), txn)
            self._rewind(q, key, offset_of(value))
            return True
        message = read_message(value)
        self._delete_record(txn, q, key, message.body)
        q.changed = self.now
        message.origin = q.name
        # In bdb-random a dead-letter queue that holds the body already keeps
        # that copy: a set holds each body once.
        self._append(txn, self._find(to) or self._create(to), message)
        return True

    def extend(self, txn: Any, name: str, arg: tuple[Receipt, float]) -> bool:
        receipt, seconds = arg
        found = self._lease(txn, receipt)
        if found is None:
            return False
        q, lease_key, lease, key = found
        deadline = self.now + seconds if seconds else 0.0
        longer = Lease(lease.owner, deadline, lease.token)
        self.cat.put(lease_key, lease_record(longer, key[len(q.mpre) :]), txn)
        return True

    def ack_many(self, txn: Any, name: str, receipts: list[Receipt]) -> list[bool]:
        return [self.ack(txn, name, receipt) for receipt in receipts]

    def release_many(
        self, txn: Any, name: str, ends: list[tuple[Receipt, str | None]]
    ) -> list[bool]:
        return [self.release(txn, name, end) for end in ends]

    def extend_many(self, txn: Any, name: str, arg: tuple[list[Receipt], float]) -> list[bool]:
        receipts, seconds = arg
        return [self.extend(txn, name, (receipt, seconds)) for receipt in receipts]

    def leases(self, txn: Any, name: str, owner: str | None) -> list[tuple[str, Message]]:
        """Every open message whose lease has expired, or is held by `owner`."""
        now = self.now
        by_qid = {q.qkey: q for q in self.queues.values()}
        due: list[tuple[QueueState, int, Lease, bytes]] = []
        cur = self.cat.cursor(txn)
        try:
            rec = cur.set_range(CAT_RESERVED)
            while rec is not None and rec[0][:1] == CAT_RESERVED:
                q = by_qid.get(rec[0][1:5])  # None: a deleted queue, its records purged soon
                if q is not None:
                    lease, suffix = read_lease(rec[1])
                    if lease.expired(now) or (owner is not None and lease.owner == owner):
                        due.append((q, U64.unpack_from(rec[0], 5)[0], lease, suffix))
                rec = cur.next()
        finally:
            cur.close()
        found: list[tuple[str, Message]] = []
        for q, offset, lease, suffix in due:
            if q.mdb is None:
                self._attach(q)
            value = q.mdb.get(q.mpre + suffix, None, txn)
            if value is not None:
                message = read_message(value)
                message.receipt = Receipt(q.name, q.qid, offset, lease.token)
                found.append((q.name, message))
        return found

    def reclaim(self, txn: Any, name: str, arg: tuple[Receipt, str | None, str | None]) -> bool:
        """End a lease leases() listed, if it is still due (not extended meanwhile)."""
        receipt, to, owner = arg
        found = self._lease(txn, receipt)
        if found is None:
            return False
        lease = found[2]
        if not (lease.expired(self.now) or (owner is not None and lease.owner == owner)):
            return False
        return self._end(txn, found, to)
