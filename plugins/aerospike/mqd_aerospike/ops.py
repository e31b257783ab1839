"""What the daemon asks of one queue shard; a cycle serves a batch of these under one lock."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from mqd.backend import Limits, Message, Put, Receipt


@dataclass(eq=False)
class Op:
    """One request; `future` gets the result once the cycle that served it has committed."""

    future: asyncio.Future[Any] = field(init=False, repr=False)
    result: Any = None
    #: Only dequeues: a cycle made of them takes the lock only when a message waits.
    dequeue: bool = field(default=False, init=False)
    #: The queue's shard count, as the cycle found it stored.
    shards: int = field(default=0, init=False)
    #: Set instead of a result when this operation alone failed in its cycle.
    error: Exception | None = field(default=None, init=False)


@dataclass(eq=False)
class PutOp(Op):
    message: Message = field(default_factory=lambda: Message(b""))
    limits: Limits = field(default_factory=Limits)
    #: Dead-letter moves: a move of this tag already stored is not stored again.
    tag: str = ""
    #: Whether the caller copies the message to the queue's fanout children,
    #: which the cycle then reads into `children`.
    fanout: bool = False
    children: list[str] = field(default_factory=list)
    #: (offset, size) when the commit landed but the entry's write did not:
    #: a hole the queue's counters must forget (HoleOp).
    hole: tuple[int, int] | None = None
    result: Put | None = None


@dataclass(eq=False)
class TakeOp(Op):
    def __post_init__(self) -> None:
        self.dequeue = True


@dataclass(eq=False)
class ReserveOp(Op):
    lease: float = 0.0
    owner: str = ""

    def __post_init__(self) -> None:
        self.dequeue = True


@dataclass(eq=False)
class LeaseOp(Op):
    """ack (to is None, back False), release (back True, or to a dead-letter queue) or extend."""

    receipt: Receipt = field(default_factory=lambda: Receipt("", 0, 0, 0))
    offset: int = 0  # the offset within the shard
    kind: str = "ack"  # "ack", "release", "extend"
    to: str | None = None
    lease: float = 0.0


@dataclass(eq=False)
class RemoveOp(Op):
    offset: int = 0


@dataclass(eq=False)
class ReclaimOp(Op):
    """End leases still as reclaim saw them: offset -> (token, dead-letter queue or None)."""

    decisions: dict[int, tuple[int, str | None]] = field(default_factory=dict)


@dataclass(eq=False)
class FinishMoveOp(Op):
    """The message moving to a dead-letter queue is stored there: forget it here."""

    offset: int = 0


@dataclass(eq=False)
class HoleOp(Op):
    """Offsets committed whose entries were never written: (offset, size) each."""

    holes: list[tuple[int, int]] = field(default_factory=list)


@dataclass(eq=False)
class DeleteOp(Op):
    """Delete the shard; with `before` only if it is empty and nothing came in since (Unix ms)."""

    before: int = 0


@dataclass(eq=False)
class RedriveOp(Op):
    """Move up to `limit` waiting messages to `to`, or to where each died when `to` is ""."""

    to: str = ""
    limit: int = 0


@dataclass
class Moved:
    """A message a cycle took out of its queue on its way to a dead-letter queue."""

    offset: int  # within the shard
    shard: int
    message: Message
    to: str
    tag: str
    returned: bool = False  # reclaim only: sent back to its queue instead
    redrive: bool = False  # out of a dead-letter queue: delivery count and origin start again
