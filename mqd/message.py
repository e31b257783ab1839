"""A message, the receipt of its reservation, a queue's gauges: made per command.

Apart from mqd.backend so that mypyc compiles them (mqd/native.py), which it
can't do for mqd.backend itself (a compiled plugin's backend subclasses an
interpreted Backend). The dataclasses spell out __init__: a dataclass keeps
the __init__ that `dataclass` generates, interpreted even when compiled (and
for that, QueueSize is not frozen: nothing changes one all the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


class Receipt(NamedTuple):
    """Names one reservation and no other.

    A queue deleted and recreated has a new `incarnation`, and every reserve()
    a new `token`, so a receipt from a lease that was lost (expired and
    returned, or its queue deleted) never matches a later reservation, even of
    a message at the same offset. The messages one reserve_many() opens may
    share a token: their offsets already tell them apart. A named tuple, not a
    frozen dataclass: a bulk reservation makes one per message, and a tuple is
    made in a third of the time.
    """

    queue: str
    incarnation: int
    offset: int
    token: int


@dataclass(slots=True)
class Message:
    """One message. `offset` is assigned by the backend when it is stored."""

    body: bytes
    flags: int = 0
    expires: float = 0  # Unix time after which it is never delivered; 0 = never
    created: float = 0  # Unix time it was enqueued (for the head's age in stats)
    offset: int = -1  # unique within the queue's incarnation, never reused in it
    deliveries: int = 0  # hand-outs so far, counted by take() and reserve()
    receipt: Receipt | None = None  # set by reserve(): the lease this hand-out holds
    origin: str = ""  # set on a dead letter: the queue it was moved from

    def __init__(
        self,
        body: bytes,
        flags: int = 0,
        expires: float = 0,
        created: float = 0,
        offset: int = -1,
        deliveries: int = 0,
        receipt: Receipt | None = None,
        origin: str = "",
    ) -> None:
        self.body = body
        self.flags = flags
        self.expires = expires
        self.created = created
        self.offset = offset
        self.deliveries = deliveries
        self.receipt = receipt
        self.origin = origin

    def expired(self, now: float) -> bool:
        """Whether it expired at or before `now` (Unix time): never to be delivered."""
        return bool(self.expires) and self.expires <= now

    def handed_out(self) -> Message:
        """A copy as a take hands it out: one delivery more, no lease.

        Here, not in the backend that calls it: made in this module, the
        copy skips the generic argument parsing of a call from outside.
        """
        return Message(
            self.body,
            self.flags,
            self.expires,
            self.created,
            self.offset,
            self.deliveries + 1,
            None,
            self.origin,
        )

    def __reduce__(self) -> tuple[type[Message], tuple[Any, ...]]:
        # Compiled, the class pickles by its arguments: it has no instance dict.
        return (
            Message,
            (
                self.body,
                self.flags,
                self.expires,
                self.created,
                self.offset,
                self.deliveries,
                self.receipt,
                self.origin,
            ),
        )


@dataclass(slots=True)
class QueueSize:
    """A queue's gauges. `items` and `bytes` include open (reserved) messages."""

    items: int
    bytes: int
    open: int
    head_created: float = 0  # `created` of the oldest message, 0 when empty

    def __init__(self, items: int, bytes: int, open: int, head_created: float = 0) -> None:
        self.items, self.bytes, self.open = items, bytes, open
        self.head_created = head_created
