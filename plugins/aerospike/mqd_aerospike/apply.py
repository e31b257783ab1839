"""The operations of one cycle applied to a shard's state in memory, in order."""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aerospike_helpers.batch.records import Write
from aerospike_helpers.operations import map_operations as mo
from aerospike_helpers.operations import operations as op

from mqd.backend import Message, Put, Receipt
from mqd.errors import StorageError
from mqd.protocol import name_bytes, name_text
from mqd_aerospike.connection import KEY_ORDERED, OPEN_ENTRY_BYTES, fence_ok, reason
from mqd_aerospike.ops import (
    DeleteOp,
    FinishMoveOp,
    HoleOp,
    LeaseOp,
    Moved,
    Op,
    PutOp,
    ReclaimOp,
    RedriveOp,
    RemoveOp,
    ReserveOp,
    TakeOp,
)
from mqd_aerospike.shard import Meta, entry, message_of

if TYPE_CHECKING:
    from mqd_aerospike.store import Store


class Apply:
    """The operations of one cycle applied to the shard's state, in order."""

    def __init__(self, store: Store, meta: Meta, entries: dict[int, list[Any]], now: float):
        self.store = store
        self.meta = meta
        self.entries = entries
        self.now = now
        self.now_ms = int(now * 1000)
        self.results: dict[int, Any] = {}
        self.writes: dict[int, list[Any]] = {}
        self.later: list[Callable[[], None]] = []  # applied once the entries they need are read
        self.wanted: set[int] = set()
        self.puts: dict[PutOp, int] = {}  # each stored put's offset
        self.keys: dict[bytes, int] = {}  # buffer record's user key -> its index
        self.opening = 0  # reserves this cycle that will open a message (open_full)

    def entry(self, offset: int) -> list[Any] | None:
        if offset not in self.entries:
            self.entries.update(self.store.read_entries(self.meta, [offset]))
        return self.entries.get(offset)

    def size_of(self, offset: int) -> int:
        found = self.entry(offset)
        return len(found[0]) if found else 0

    def apply(self, o: Op) -> None:
        meta = self.meta
        if isinstance(o, PutOp):
            self.results[id(o)] = self.put(o)
        elif isinstance(o, TakeOp | ReserveOp):
            if isinstance(o, ReserveOp) and self.open_full(o.owner):
                self.results[id(o)] = None  # as if none waited: Connection.open_room
                return
            taken = meta.pop_oldest()
            if taken is None:
                self.results[id(o)] = None
                return
            if isinstance(o, ReserveOp):
                self.opening += 1
            offset, deliveries, size = taken
            self.wanted.add(offset)
            self.later.append(lambda: self.dequeued(o, offset, deliveries, size))
        elif isinstance(o, LeaseOp):
            self.results[id(o)] = self.lease(o)
        elif isinstance(o, RemoveOp):
            self.results[id(o)] = self.remove(o.offset)
        elif isinstance(o, ReclaimOp):
            self.results[id(o)] = self.reclaim(o)
        elif isinstance(o, FinishMoveOp):
            moving = meta.mv.pop(o.offset, None)
            if moving is not None:
                meta.items -= 1
                meta.size -= int(moving[2])
            self.results[id(o)] = moving is not None
        elif isinstance(o, HoleOp):
            for offset, size in o.holes:
                meta.forget_hole(offset, size)
        elif isinstance(o, DeleteOp):
            idle = not (meta.items or meta.open or meta.mv) and meta.last_put < o.before
            self.results[id(o)] = not o.before or idle
        elif isinstance(o, RedriveOp):
            self.results[id(o)] = self.redrive(o)

    def put(self, o: PutOp) -> Put:
        meta, message = self.meta, o.message
        size = len(message.body)
        if o.tag and o.tag in meta.tags:
            return Put.DUPLICATE
        limits = meta.shard_limits(o.limits)
        if limits.max_bytes and size > limits.max_bytes:
            return Put.FULL
        while limits.overflow(meta.items, meta.size, size):
            if not limits.drop_oldest:
                return Put.FULL
            dropped = meta.pop_oldest()
            if dropped is None:
                return Put.FULL
            meta.items -= 1
            meta.size -= dropped[2] if dropped[2] >= 0 else self.size_of(dropped[0])
        offset = meta.tail
        meta.tail += 1
        meta.items += 1
        meta.size += size
        # Also where this cycle's own dequeues look: they may take it at once.
        self.writes[offset] = self.entries[offset] = entry(message, meta.fence)
        self.puts[o] = offset
        message.offset = meta.global_id(offset)
        if o.tag:
            meta.tags[o.tag] = self.now_ms
        meta.last_put = self.now_ms
        return Put.STORED

    def open_full(self, owner: str) -> bool:
        """Whether one more open message of `owner` would fill the shard's record too far."""
        meta = self.meta
        count = len(meta.open) + len(meta.mv) + self.opening + 1
        return count * (OPEN_ENTRY_BYTES + len(owner)) > self.store.open_room

    def dequeued(self, o: Op, offset: int, deliveries: int, size: int) -> None:
        meta = self.meta
        found = self.entries.get(offset)
        if size < 0:
            size = len(found[0]) if found else 0
        if found is None:  # lost with its buffer record: nothing to hand out
            meta.items -= 1
            meta.size -= size
            self.results[id(o)] = None
            return
        message = message_of(found, meta.global_id(offset), deliveries)
        message.deliveries += 1
        if isinstance(o, ReserveOp):
            token = secrets.randbits(62) + 1
            deadline = int((self.now + o.lease) * 1000) if o.lease else 0
            meta.open[offset] = [
                token,
                o.owner,
                deadline,
                message.deliveries,
                size,
                message.created,
            ]
            message.receipt = Receipt(
                meta.name.decode("utf-8", "surrogateescape"), meta.inc, message.offset, token
            )
        else:
            meta.items -= 1
            meta.size -= size
        self.results[id(o)] = message

    def lease(self, o: LeaseOp) -> bool | Moved:
        meta = self.meta
        if not meta.holds(o.receipt, o.offset):
            return False
        lease = meta.open[o.offset]
        if o.kind == "extend":
            lease[2] = int((self.now + o.lease) * 1000) if o.lease else 0
            return True
        del meta.open[o.offset]
        if o.kind == "ack":
            meta.items -= 1
            meta.size -= int(lease[4])
            return True
        if o.to is None:
            meta.ret[o.offset] = [lease[3], lease[4], lease[5]]
            return True
        return self.move(o.offset, lease, o.to)

    def move(self, offset: int, lease: list[Any], to: str, redrive: bool = False) -> Moved:
        meta = self.meta
        dest = bytearray(name_bytes(to))
        meta.mv[offset] = [dest, lease[3], lease[4], lease[5], self.now_ms, int(redrive)]
        self.wanted.add(offset)
        tag = f"{meta.inc:x}:{offset}"
        moved = Moved(offset, meta.shard, Message(b""), to, tag, redrive=redrive)
        self.later.append(lambda: self.fill(moved, int(lease[3])))
        return moved

    def fill(self, moved: Moved, deliveries: int) -> None:
        found = self.entries.get(moved.offset)
        if found is not None:
            moved.message = message_of(found, self.meta.global_id(moved.offset), deliveries)

    def remove(self, offset: int) -> bool:
        meta = self.meta
        if not meta.is_waiting(offset):
            return False
        meta.size -= int(meta.ret[offset][1]) if offset in meta.ret else self.size_of(offset)
        meta.take_waiting(offset)
        meta.items -= 1
        return True

    def redrive(self, o: RedriveOp) -> tuple[list[Moved], int]:
        """Waiting messages on their way out, as moves finished like dead-lettering;
        and how many were removed instead, having expired."""
        meta = self.meta
        moved: list[Moved] = []
        expired = 0
        waiting = meta.waiting_offsets()
        for start in range(0, len(waiting), 256):
            if len(moved) >= o.limit:
                break
            chunk = waiting[start : start + 256]
            unread = [w for w in chunk if w not in self.entries]
            self.entries.update(self.store.read_entries(meta, unread))
            for offset in chunk:
                found = self.entries.get(offset)
                if found is not None and 0 < float(found[2]) <= self.now:
                    expired += self.remove(offset)
                    continue
                to = o.to or (str(found[6]) if found is not None else "")
                if found is None or not to or len(moved) >= o.limit:
                    continue
                deliveries = int(meta.ret[offset][0]) if offset in meta.ret else int(found[5])
                meta.take_waiting(offset)
                lease = [0, "", 0, deliveries, len(found[0]), float(found[3])]
                moved.append(self.move(offset, lease, to, redrive=True))
        return moved, expired

    def reclaim(self, o: ReclaimOp) -> list[Moved]:
        meta = self.meta
        done: list[Moved] = []
        for offset, (token, to) in o.decisions.items():
            lease = meta.open.get(offset)
            if lease is not None and lease[0] == token:
                del meta.open[offset]
                if to is None:
                    meta.ret[offset] = [lease[3], lease[4], lease[5]]
                    moved = Moved(offset, meta.shard, Message(b""), "", "", returned=True)
                    self.wanted.add(offset)
                    self.later.append(functools.partial(self.fill, moved, int(lease[3])))
                    done.append(moved)
                else:
                    done.append(self.move(offset, lease, to))
            elif offset in meta.mv:
                # A move begun by some daemon, maybe still under way: finish it
                # too (the tag keeps the dead-letter queue from storing it twice),
                # so that every move this reclaim saw is done when it returns.
                moving = meta.mv[offset]
                tag = f"{meta.inc:x}:{offset}"
                dest = name_text(bytes(moving[0]))
                moved = Moved(offset, meta.shard, Message(b""), dest, tag, redrive=bool(moving[5]))
                self.wanted.add(offset)
                self.later.append(functools.partial(self.fill, moved, int(moving[1])))
                done.append(moved)
        return done

    def prepare(self) -> list[Write]:
        """Read what is still needed; the writes of the new entries, fenced by this lock."""
        missing = [o for o in self.wanted if o not in self.entries]
        if missing:
            self.entries.update(self.store.read_entries(self.meta, missing))
        for step in self.later:
            step()
        meta, store = self.meta, self.store
        by_record: dict[int, dict[int, list[Any]]] = {}
        for offset, value in self.writes.items():
            by_record.setdefault(offset // meta.per, {})[offset] = value
        fence = fence_ok(meta.fence)
        self.keys = {bytes(store.buf_key(meta, i)[2]): i for i in by_record}
        return [
            Write(
                store.buf_key(meta, index),
                [op.write("f", meta.fence), mo.map_put_items("s", slots, KEY_ORDERED)],
                policy={"expressions": fence},
            )
            for index, slots in by_record.items()
        ]

    def lost(self, key: Any, code: int, in_doubt: bool) -> None:
        """The entries of one buffer record were not written though the commit was made.

        Their sets get SERVER_ERROR. A write known to have failed leaves holes
        the counters forget; one in doubt (no answer) may have landed, and is
        left for readers to find or pass over.
        """
        index = self.keys[bytes(key[2])]
        per = self.meta.per
        for o, offset in self.puts.items():
            if offset // per == index:
                o.error = StorageError(reason(code, "entry write"))
                if not in_doubt:
                    o.hole = (offset, len(self.writes[offset][0]))
