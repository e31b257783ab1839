"""The in-memory backend: fast, FIFO, gone when the process ends."""

from __future__ import annotations

import bisect
from collections import deque

from mqd.backend import Backend, Capability, Message, QueueSize, StorageOptions, Sync


class _Queue:
    __slots__ = ("bodies", "bytes", "next_offset", "reserved", "waiting")

    def __init__(self) -> None:
        self.waiting: deque[Message] = deque()  # sorted by offset
        self.reserved: dict[int, Message] = {}
        self.next_offset = 0
        self.bytes = 0
        # Body -> how many copies are in the queue. Built on the first unique
        # put only, so queues that never use uniqueness pay nothing for it.
        self.bodies: dict[bytes, int] | None = None

    def index(self) -> dict[bytes, int]:
        if self.bodies is None:
            self.bodies = {}
            for message in (*self.waiting, *self.reserved.values()):
                self.count(message.body, 1)
        return self.bodies

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

    def forget(self, message: Message) -> None:
        self.bytes -= len(message.body)
        self.count(message.body, -1)


class MemoryBackend(Backend):
    """Queues in process memory. `sync` has no meaning here and is ignored."""

    name = "memory"
    capabilities = frozenset({Capability.UNIQUE, Capability.OFFSET, Capability.FIFO})

    def __init__(self, options: StorageOptions) -> None:
        super().__init__(options)
        self._queues: dict[str, _Queue] = {}

    async def put(self, queue: str, message: Message, *, unique: bool, sync: Sync) -> int | None:
        q = self._queues.get(queue)
        if q is None:
            q = self._queues[queue] = _Queue()
        if unique and message.body in q.index():
            return None
        offset = message.offset = q.next_offset
        q.next_offset = offset + 1
        q.waiting.append(message)
        q.bytes += len(message.body)
        if q.bodies is not None:
            q.count(message.body, 1)
        return offset

    async def take(self, queue: str, *, sync: Sync) -> Message | None:
        q = self._queues.get(queue)
        if q is None or not q.waiting:
            return None
        message = q.waiting.popleft()
        q.bytes -= len(message.body)
        if q.bodies is not None:
            q.count(message.body, -1)
        message.deliveries += 1
        return message

    async def reserve(self, queue: str, *, lease: float, sync: Sync) -> Message | None:
        q = self._queues.get(queue)
        if q is None or not q.waiting:
            return None
        message = q.waiting.popleft()
        message.deliveries += 1
        q.reserved[message.offset] = message
        return message

    def _find_waiting(self, q: _Queue, offset: int) -> int | None:
        i = bisect.bisect_left(q.waiting, offset, key=_offset)
        if i < len(q.waiting) and q.waiting[i].offset == offset:
            return i
        return None

    async def remove(self, queue: str, offset: int, *, sync: Sync) -> bool:
        q = self._queues.get(queue)
        if q is None:
            return False
        message = q.reserved.pop(offset, None)
        if message is None:
            i = self._find_waiting(q, offset)
            if i is None:
                return False
            message = q.waiting[i]
            del q.waiting[i]
        q.forget(message)
        return True

    async def release(self, queue: str, offset: int, *, sync: Sync) -> bool:
        q = self._queues.get(queue)
        message = q.reserved.pop(offset, None) if q is not None else None
        if q is None or message is None:
            return False
        # Released messages nearly always belong at or near the head.
        q.waiting.insert(bisect.bisect_left(q.waiting, offset, key=_offset), message)
        return True

    async def peek(self, queue: str) -> Message | None:
        q = self._queues.get(queue)
        return q.waiting[0] if q is not None and q.waiting else None

    async def read_at(self, queue: str, offset: int) -> Message | None:
        q = self._queues.get(queue)
        if q is None:
            return None
        if offset in q.reserved:
            return q.reserved[offset]
        i = self._find_waiting(q, offset)
        return None if i is None else q.waiting[i]

    async def delete(self, queue: str, *, sync: Sync) -> bool:
        return self._queues.pop(queue, None) is not None

    async def flush_all(self, *, sync: Sync) -> None:
        self._queues.clear()

    async def queues(self) -> list[str]:
        return list(self._queues)

    async def size(self, queue: str) -> QueueSize | None:
        q = self._queues.get(queue)
        if q is None:
            return None
        heads = [m.created for m in q.reserved.values()]
        if q.waiting:
            heads.append(q.waiting[0].created)
        return QueueSize(
            items=len(q.waiting) + len(q.reserved),
            bytes=q.bytes,
            open=len(q.reserved),
            head_created=min(heads, default=0),
        )


def _offset(message: Message) -> int:
    return message.offset
