"""Operations on whole queues: fanout copies, create, redrive, idle expiry, delete.

A fanout child is the queue `<parent>+<child>`; a message stored in the
parent is copied, in the same transaction, into every child that exists, each
copy under the child's own limits (given by the event loop, which knows the
daemon's settings). Children are found in the catalog's index by parent.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mqd.backend import NO_LIMITS, Limits, Message, Put
from mqd_bdb.catalog import QueueState
from mqd_bdb.leases import Leases
from mqd_bdb.records import WAITING, offset_of, read_message

#: The limits of the children the event loop knew of, by child name.
ChildLimits = dict[str, Limits]


class QueueOps(Leases):
    """put with fanout, create, redrive, expire_idle, delete (single-file layouts)."""

    def put(
        self, txn: Any, name: str, arg: tuple[Message, bool, Limits, ChildLimits | None]
    ) -> Put:
        message, unique, limits, children = arg
        stored = self._put(txn, name, message, unique, limits)
        if stored is Put.STORED and children is not None:
            for child in self.children.get(name, ()):
                # Each child its own copy, under its own limits: a full one
                # refuses or drops for itself. A child made in this very
                # batch is not known to the loop yet: no limits for it.
                copy = Message(message.body, message.flags, message.expires, message.created)
                self._put(txn, child, copy, False, children.get(child, NO_LIMITS))
        return stored

    def create(self, txn: Any, name: str, arg: None) -> bool:
        if name in self.queues:
            return False
        self._create(name)
        return True

    def redrive(self, txn: Any, name: str, arg: tuple[str | None, int]) -> dict[str, int]:
        """Move up to `limit` waiting messages, oldest first, to `to` or where they died."""
        to, limit = arg
        q = self._find(name)
        moved: dict[str, int] = {}
        if q is None or limit <= 0:
            return moved
        picked = []
        for key, value in self._waiting_by_age(txn, q):
            message = read_message(value)
            target = to or message.origin
            if target:  # one with nowhere to go back to stays
                picked.append((key, message, target))
                if len(picked) == limit:
                    break
        if not picked:
            return moved
        self._touch(q)
        q.changed = self.now
        for key, message, target in picked:
            self._delete_record(txn, q, key, message.body)
            message.deliveries, message.origin = 0, ""
            self._append(txn, self._find(target) or self._create(target), message)
            moved[target] = moved.get(target, 0) + 1
        return moved

    def expire_idle(self, txn: Any, name: str, before: float) -> bool:
        q = self.queues.get(name)
        if q is None or q.items or q.changed >= before:
            return False
        return self.delete(txn, name, None)

    def delete(self, txn: Any, name: str, arg: None) -> bool:
        """Single-file layouts: forget the queue now, purge its records later."""
        q = self.queues.get(name)
        if q is None:
            return False
        self._touch(q)
        self._drop_catalog_entry(txn, q)
        self._schedule_purge(txn, q)
        self._unregister(name)
        return True

    def _waiting_by_age(self, txn: Any, q: QueueState) -> Iterator[tuple[bytes, bytes]]:
        """The waiting messages' records, oldest first."""
        waiting = (rec for rec in self._records(txn, q) if rec[1][0] == WAITING)
        if self.keyed_by_body:  # in digest order: sort them
            yield from sorted(waiting, key=lambda rec: offset_of(rec[1]))
        else:
            yield from waiting
