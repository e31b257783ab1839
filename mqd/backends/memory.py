"""The in-memory backend: fast, FIFO, gone when the process ends.

Several backends built with the same `[storage.memory] share = "<name>"` use
one store, as several daemons use one shared store: that is how the broker's
many-instance mode is tested on every run without a server.

Over 500 lines: it is the whole Backend interface on one in-memory layout,
whose queue internals every call uses, bulk lease calls included (each one
tight loop, since a named lease's cost per message is theirs).
"""

from __future__ import annotations

import bisect
import heapq
import time
from collections import deque
from collections.abc import Sequence
from typing import ClassVar

from mypy_extensions import mypyc_attr

from mqd.backend import (
    NO_LIMITS,
    PUT_STORED,
    REDRIVE_EXPIRED,
    Backend,
    Capability,
    Fanout,
    Holder,
    Lease,
    Limits,
    Message,
    Put,
    QueueSize,
    Receipt,
    Reclaimed,
    Route,
    StorageOptions,
    Sync,
    Wake,
)
from mqd.config import TableReader


class _Queue:
    __slots__ = (
        "bodies",
        "bytes",
        "incarnation",
        "indexed",
        "leases",
        "next_offset",
        "offsets",
        "reserved",
        "touched",
        "waiting",
    )

    def __init__(self, incarnation: int) -> None:
        self.incarnation = incarnation
        self.touched = time.time()  # last change, for idle expiry
        self.waiting: deque[Message] = deque()  # sorted by offset
        self.reserved: dict[int, Message] = {}
        self.leases: dict[int, Lease] = {}  # by offset, for every reserved message
        self.next_offset = 0
        self.bytes = 0
        # Two indexes of the messages in the queue (waiting and open), each
        # built on first use and kept in step from then on, so queues that
        # never need them pay one test per put and take: body -> how many
        # copies (unique puts, contains, discard), offset -> message (read_at:
        # a deque is O(n) to index in the middle, so a bisect over a long one
        # is slow).
        self.bodies: dict[bytes, int] | None = None
        self.offsets: dict[int, Message] | None = None
        self.indexed = False  # whether either index exists

    def messages(self) -> tuple[Message, ...]:
        return (*self.waiting, *self.reserved.values())

    def index(self) -> dict[bytes, int]:
        if self.bodies is None:
            self.bodies = {}
            self.indexed = True
            for message in self.messages():
                self.count(message.body, 1)
        return self.bodies

    def by_offset(self) -> dict[int, Message]:
        if self.offsets is None:
            self.offsets = {message.offset: message for message in self.messages()}
            self.indexed = True
        return self.offsets

    def count(self, body: bytes, delta: int) -> None:
        """Keep the body index, when there is one, in step."""
        bodies = self.bodies
        if bodies is None:
            return
        left = bodies.get(body, 0) + delta
        if left:
            bodies[body] = left
        else:
            del bodies[body]

    def index_add(self, message: Message) -> None:
        self.count(message.body, 1)
        if self.offsets is not None:
            self.offsets[message.offset] = message

    def index_drop(self, message: Message) -> None:
        self.count(message.body, -1)
        if self.offsets is not None:
            self.offsets.pop(message.offset, None)

    def append(self, message: Message) -> None:
        message.offset = self.next_offset
        self.next_offset += 1
        self.waiting.append(message)
        self.bytes += len(message.body)
        if self.indexed:
            self.index_add(message)

    def pop_head(self) -> Message:
        message = self.waiting.popleft()
        self.forget(message)
        return message

    def forget(self, message: Message) -> None:
        """A message leaves the queue (its offset still the queue's)."""
        self.bytes -= len(message.body)
        if self.indexed:
            self.index_drop(message)

    def find_waiting(self, offset: int) -> int | None:
        # Offsets in `waiting` are nearly contiguous, so first try where the offset
        # would be without gaps: one deque index (O(distance to an end / 64)),
        # where a bisect takes about twenty of them on a long queue.
        if self.waiting:
            guess = offset - self.waiting[0].offset
            if 0 <= guess < len(self.waiting) and self.waiting[guess].offset == offset:
                return guess
        i = bisect.bisect_left(self.waiting, offset, key=_offset)
        if i < len(self.waiting) and self.waiting[i].offset == offset:
            return i
        return None

    def unreserve(self, offset: int) -> Message:
        """Take a message out of the reserved set, lease and all (still counted)."""
        del self.leases[offset]
        return self.reserved.pop(offset)

    def requeue(self, message: Message) -> None:
        # Returned messages nearly always belong at or near the head.
        self.waiting.insert(bisect.bisect_left(self.waiting, message.offset, key=_offset), message)

    def make_room(self, limits: Limits, size: int) -> bool:
        """Whether a message of `size` bytes fits, dropping the oldest if allowed."""
        if limits.max_bytes and size > limits.max_bytes:
            return False
        while limits.overflow(len(self.waiting) + len(self.reserved), self.bytes, size):
            if not (limits.drop_oldest and self.waiting):
                return False
            self.pop_head()
        return True


class _Store:
    """The queues, and every backend handle that uses them."""

    def __init__(self) -> None:
        self.queues: dict[str, _Queue] = {}
        self.children: dict[str, set[str]] = {}  # fanout parent -> its existing children
        self.incarnations = 0
        self.handles: list[MemoryBackend] = []
        self.shared = False  # more than one handle: others' waiters are woken on a put

    def create(self, name: str) -> _Queue:
        self.incarnations += 1
        q = self.queues[name] = _Queue(self.incarnations)
        parent, plus, _ = name.partition("+")
        if plus:
            self.children.setdefault(parent, set()).add(name)
        return q

    def delete(self, name: str) -> bool:
        if self.queues.pop(name, None) is None:
            return False
        parent, plus, _ = name.partition("+")
        kids = self.children.get(parent) if plus else None
        if kids is not None:
            kids.discard(name)
            if not kids:
                del self.children[parent]
        return True

    def arrived(self, queue: str, by: MemoryBackend) -> None:
        """Wake every other handle's waiters: a message may be in `queue` now."""
        for handle in self.handles:
            if handle is not by:
                handle._wake(queue)


#: Stores shared by name within this process.
_SHARED: dict[str, _Store] = {}


# Compiled (mqd/native.py), yet tests subclass it to change what a backend can do.
@mypyc_attr(allow_interpreted_subclasses=True)
class MemoryBackend(Backend):
    """Queues in process memory. `sync` has no meaning here and is ignored.

    Sets and plain gets are answered by put_now() and take_now(); in a
    subclass that changes put() or take(), by those instead
    (mqd.backend.asks_now).
    """

    name = "memory"
    answers_now = True
    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.UNIQUE, Capability.OFFSET, Capability.FIFO, Capability.SHARED}
    )

    def __init__(self, options: StorageOptions) -> None:
        super().__init__(options)
        reader = TableReader(options.config_path, dict(options.extra), "storage.memory.")
        share = reader.string("share") if "share" in options.extra else ""
        reader.leftovers(["share"])
        if share:
            self._store = _SHARED.setdefault(share, _Store())
        else:
            self._store = _Store()
        self._queues = self._store.queues

    async def open(self) -> None:
        self._store.handles.append(self)
        self._store.shared = len(self._store.handles) > 1

    async def close(self) -> None:
        if self in self._store.handles:
            self._store.handles.remove(self)
        self._store.shared = len(self._store.handles) > 1

    def listen(self, wake: Wake) -> None:
        self._wake = wake

    def _live(self, receipt: Receipt) -> _Queue | None:
        """The receipt's queue if its lease is still the one held there."""
        q = self._queues.get(receipt.queue)
        if q is None or q.incarnation != receipt.incarnation:
            return None
        lease = q.leases.get(receipt.offset)
        return q if lease is not None and lease.token == receipt.token else None

    async def put(
        self,
        queue: str,
        message: Message,
        *,
        sync: Sync,
        unique: bool = False,
        limits: Limits = NO_LIMITS,
        fanout: Fanout | None = None,
        holder: Holder | None = None,
    ) -> Put:
        return self.put_now(queue, message, sync, unique, limits, fanout, holder)

    def put_now(
        self,
        queue: str,
        message: Message,
        sync: Sync,
        unique: bool,
        limits: Limits,
        fanout: Fanout | None,
        holder: Holder | None,
    ) -> Put:
        q = self._queues.get(queue)
        if q is None:
            q = self._store.create(queue)
        if unique and message.body in q.index():
            return Put.DUPLICATE
        if limits is not NO_LIMITS and limits and not q.make_room(limits, len(message.body)):
            return Put.FULL
        # q.append(message), inline: this is every set's path.
        body = message.body
        message.offset = q.next_offset
        q.next_offset += 1
        q.waiting.append(message)
        q.bytes += len(body)
        if q.indexed:
            q.index_add(message)
        q.touched = message.created or time.time()
        store = self._store
        if store.shared:
            store.arrived(queue, self)
        if fanout is not None and store.children and queue in store.children:
            for child in store.children[queue]:
                if self._copy(child, message, fanout.limits(child), fanout.unique(child)):
                    fanout.stored(child)
        return PUT_STORED

    def _copy(self, child: str, message: Message, limits: Limits, unique: bool) -> bool:
        """A fanout child's own copy of a message stored in its parent; False: refused
        (full, or a duplicate where the child is `unique`)."""
        q = self._queues[child]
        if unique and message.body in q.index():
            return False
        if limits and not q.make_room(limits, len(message.body)):
            return False
        q.append(Message(message.body, message.flags, message.expires, message.created))
        q.touched = message.created or time.time()
        if self._store.shared:
            self._store.arrived(child, self)
        return True

    async def take(self, queue: str, *, sync: Sync, holder: Holder | None = None) -> Message | None:
        return self.take_now(queue, sync, holder)

    def take_now(self, queue: str, sync: Sync, holder: Holder | None) -> Message | None:
        q = self._queues.get(queue)
        if q is None or not q.waiting:
            return None
        # q.pop_head(), inline: this is every get's path.
        message = q.waiting.popleft()
        q.bytes -= len(message.body)
        if q.indexed:
            q.index_drop(message)
        message.deliveries += 1
        return message

    async def reserve(self, queue: str, *, lease: float, sync: Sync) -> Message | None:
        q = self._queues.get(queue)
        if q is None or not q.waiting:
            return None
        message = q.waiting.popleft()
        message.deliveries += 1
        held = Lease.start(self.owner, lease, time.time())
        q.reserved[message.offset] = message
        q.leases[message.offset] = held
        message.receipt = Receipt(queue, q.incarnation, message.offset, held.token)
        return message

    async def ack(self, receipt: Receipt, *, sync: Sync) -> bool:
        q = self._live(receipt)
        if q is None:
            return False
        q.forget(q.unreserve(receipt.offset))
        return True

    async def release(self, receipt: Receipt, *, sync: Sync, to: str | None = None) -> bool:
        q = self._live(receipt)
        if q is None:
            return False
        self._return(receipt.queue, q, q.unreserve(receipt.offset), to)
        return True

    def _return(self, queue: str, q: _Queue, message: Message, to: str | None) -> None:
        """An open message comes back: to its queue, or moved to the dead letters `to`."""
        if to is None:
            q.requeue(message)
            arrived = queue
        else:
            q.forget(message)
            dead = self._queues.get(to) or self._store.create(to)
            message.origin = queue
            dead.append(message)
            dead.touched = q.touched = time.time()
            arrived = to
        if self._store.shared:
            self._store.arrived(arrived, self)

    async def extend(self, receipt: Receipt, *, lease: float, sync: Sync) -> bool:
        q = self._live(receipt)
        if q is None:
            return False
        held = q.leases[receipt.offset]
        deadline = time.time() + lease if lease else 0.0
        q.leases[receipt.offset] = Lease(held.owner, deadline, held.token)
        return True

    # -- leases in bulk: one pass each, no call per message ------------------

    async def reserve_many(
        self, queue: str, count: int, *, lease: float, sync: Sync, max_bytes: int = 0
    ) -> list[Message]:
        q = self._queues.get(queue)
        if q is None or not q.waiting:
            return []
        # One lease record for all of them: it is immutable (extend() puts a
        # new one), and a receipt names its offset too, so one new token per
        # call tells each reservation from every other.
        held = Lease.start(self.owner, lease, time.time())
        token, incarnation = held.token, q.incarnation
        waiting, reserved, leases = q.waiting, q.reserved, q.leases
        opened: list[Message] = []
        size = 0
        for _ in range(min(count, len(waiting))):
            message = waiting.popleft()
            offset = message.offset
            message.deliveries += 1
            reserved[offset] = message
            leases[offset] = held
            message.receipt = Receipt(queue, incarnation, offset, token)
            opened.append(message)
            if max_bytes:
                size += len(message.body)
                if size >= max_bytes:
                    break
        return opened

    async def ack_many(self, receipts: Sequence[Receipt], *, sync: Sync) -> list[bool]:
        done: list[bool] = []
        name: str | None = None
        q: _Queue | None = None
        for receipt in receipts:
            if receipt.queue != name:  # a lease's receipts are all of one queue
                name = receipt.queue
                q = self._queues.get(name)
            offset = receipt.offset
            # self._live(receipt), inline: once per message acknowledged.
            lease = (
                None if q is None or q.incarnation != receipt.incarnation else q.leases.get(offset)
            )
            if lease is None or lease.token != receipt.token:
                done.append(False)
                continue
            assert q is not None
            del q.leases[offset]
            message = q.reserved.pop(offset)
            q.bytes -= len(message.body)  # q.forget(message), inline
            if q.indexed:
                q.index_drop(message)
            done.append(True)
        return done

    async def release_many(
        self, receipts: Sequence[Receipt], *, sync: Sync, to: Sequence[str | None] = ()
    ) -> list[bool]:
        done: list[bool] = []
        back: dict[str, list[Message]] = {}  # by queue: messages returned there
        for receipt, dead in zip(receipts, to or [None] * len(receipts), strict=True):
            q = self._live(receipt)
            done.append(q is not None)
            if q is None:
                continue
            message = q.unreserve(receipt.offset)
            if dead is None:
                back.setdefault(receipt.queue, []).append(message)
            else:
                self._return(receipt.queue, q, message, dead)
        for queue, messages in back.items():
            self._requeue_all(queue, messages)
        return done

    def _requeue_all(self, queue: str, messages: list[Message]) -> None:
        """Messages come back to `queue`, each ahead of every newer one waiting.

        Put back one by one, each is inserted into the deque, O(queue) apiece;
        a lease given back nearly always comes from before every waiting
        message, so it goes in front in one step, else the two are merged.
        """
        q = self._queues[queue]
        messages.sort(key=_offset)
        if not q.waiting or messages[-1].offset < q.waiting[0].offset:
            q.waiting.extendleft(reversed(messages))
        else:
            q.waiting = deque(heapq.merge(q.waiting, messages, key=_offset))
        if self._store.shared:
            for _ in messages:
                self._store.arrived(queue, self)  # each may serve one waiting get

    async def extend_many(
        self, receipts: Sequence[Receipt], *, lease: float, sync: Sync
    ) -> list[bool]:
        done: list[bool] = []
        deadline = time.time() + lease if lease else 0.0
        for receipt in receipts:
            q = self._live(receipt)
            done.append(q is not None)
            if q is not None:
                held = q.leases[receipt.offset]
                q.leases[receipt.offset] = Lease(held.owner, deadline, held.token)
        return done

    async def reclaim(
        self, route: Route, *, sync: Sync, owner: str | None = None
    ) -> list[Reclaimed]:
        now = time.time()
        ended: list[Reclaimed] = []
        for name, q in list(self._queues.items()):
            if not q.leases:
                continue
            due = [
                offset
                for offset, lease in q.leases.items()
                if lease.expired(now) or (owner is not None and lease.owner == owner)
            ]
            for offset in due:
                message = q.unreserve(offset)
                to = route(name, message)
                self._return(name, q, message, to)
                ended.append(Reclaimed(name, message, to))
        return ended

    async def remove(self, queue: str, offset: int, *, sync: Sync) -> bool:
        q = self._queues.get(queue)
        i = q.find_waiting(offset) if q is not None else None
        if q is None or i is None:
            return False
        message = q.waiting[i]
        del q.waiting[i]
        q.forget(message)
        return True

    async def peek(self, queue: str) -> Message | None:
        q = self._queues.get(queue)
        return q.waiting[0] if q is not None and q.waiting else None

    async def read_at(self, queue: str, offset: int) -> Message | None:
        q = self._queues.get(queue)
        if q is None:
            return None
        return q.by_offset().get(offset)

    async def read_range(
        self, queue: str, first: int, count: int, max_bytes: int = 0
    ) -> list[Message]:
        q = self._queues.get(queue)
        if q is None:
            return []
        get = q.by_offset().get
        # Offsets at and past next_offset hold nothing yet: not looked up.
        offsets = range(max(first, 0), min(first + count, q.next_offset))
        if not max_bytes:
            return [m for m in map(get, offsets) if m is not None]
        found: list[Message] = []
        size = 0
        for message in map(get, offsets):
            if message is not None:
                found.append(message)
                size += len(message.body)
                if size >= max_bytes:
                    break
        return found

    async def contains(self, queue: str, body: bytes) -> bool:
        q = self._queues.get(queue)
        return q is not None and body in q.index()

    async def discard(self, queue: str, body: bytes, *, sync: Sync) -> int:
        q = self._queues.get(queue)
        if q is None or body not in q.index():
            return 0
        kept: deque[Message] = deque()
        removed = 0
        for message in q.waiting:
            if message.body == body:
                q.forget(message)
                removed += 1
            else:
                kept.append(message)
        q.waiting = kept
        return removed

    async def create(self, queue: str, *, sync: Sync) -> bool:
        if queue in self._queues:
            return False
        self._store.create(queue)
        return True

    async def redrive(self, dead: str, *, to: str | None, limit: int, sync: Sync) -> dict[str, int]:
        q = self._queues.get(dead)
        moved: dict[str, int] = {}
        if q is None:
            return moved
        kept: deque[Message] = deque()
        now = time.time()
        count = 0
        while q.waiting and count < limit:
            message = q.waiting.popleft()
            expired = message.expired(now)
            target = REDRIVE_EXPIRED if expired else to or message.origin
            if not target and not expired:
                kept.append(message)  # nowhere to go back to: it stays
                continue
            q.forget(message)
            moved[target] = moved.get(target, 0) + 1
            if expired:
                continue
            count += 1
            message.deliveries, message.origin, message.receipt = 0, "", None
            dest = self._queues.get(target) or self._store.create(target)
            dest.append(message)
            dest.touched = now
        kept.extend(q.waiting)
        q.waiting = kept
        q.touched = time.time()
        if self._store.shared:
            for target in moved.keys() - {REDRIVE_EXPIRED}:
                self._store.arrived(target, self)
        return moved

    async def expire_idle(self, queue: str, *, before: float, sync: Sync) -> bool:
        q = self._queues.get(queue)
        if q is None or q.waiting or q.reserved or q.touched >= before:
            return False
        return self._store.delete(queue)

    async def delete(self, queue: str, *, sync: Sync) -> bool:
        return self._store.delete(queue)

    async def flush_all(self, *, sync: Sync) -> None:
        self._queues.clear()
        self._store.children.clear()

    async def queues(self) -> list[str]:
        return list(self._queues)

    async def size(self, queue: str) -> QueueSize | None:
        q = self._queues.get(queue)
        if q is None:
            return None
        # The oldest message's time, waiting or open; 0 when there is none.
        head = q.waiting[0].created if q.waiting else 0.0
        for message in q.reserved.values():
            if not head or message.created < head:
                head = message.created
        return QueueSize(
            items=len(q.waiting) + len(q.reserved),
            bytes=q.bytes,
            open=len(q.reserved),
            head_created=head,
        )


def _offset(message: Message) -> int:
    return message.offset
