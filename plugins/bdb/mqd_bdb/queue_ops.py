"""Operations on whole queues: create, redrive, idle expiry, delete.

Fanout children are made by create() and found in the catalog's index by
parent (copies to them are made by put(), mqd_bdb.operations).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mqd.backend import REDRIVE_EXPIRED
from mqd_bdb.catalog import QueueState
from mqd_bdb.leases import Leases
from mqd_bdb.records import WAITING, offset_of, read_message


class QueueOps(Leases):
    """create, redrive, expire_idle, delete (single-file layouts)."""

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
        count = 0
        for key, value in self._waiting_by_age(txn, q):
            message = read_message(value)
            if message.expired(self.now):
                picked.append((key, message, REDRIVE_EXPIRED))  # removed, not moved
                continue
            target = to or message.origin
            if target:  # one with nowhere to go back to stays
                picked.append((key, message, target))
                count += 1
                if count == limit:
                    break
        if not picked:
            return moved
        self._touch(q)
        q.changed = self.now
        for key, message, target in picked:
            self._delete_record(txn, q, key, message.body)
            moved[target] = moved.get(target, 0) + 1
            if target != REDRIVE_EXPIRED:
                message.deliveries, message.origin = 0, ""
                self._append(txn, self._find(target) or self._create(target), message)
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
