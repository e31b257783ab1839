"""What the event loop hands the worker thread: one tuple per backend call."""

from __future__ import annotations

import asyncio
from typing import Any, Final

from mqd.backend import NO_LIMITS, Limits, Sync

# Operation codes, the first item of a Job; the argument each takes.
PUT: Final = 0  # (message, unique, limits, {child: (limits, unique)} or None) -> Put, Copied
TAKE: Final = 1  # None -> Message | None
RESERVE: Final = 2  # (owner, lease seconds) -> Message | None, its receipt set
ACK: Final = 3  # receipt -> bool
RELEASE: Final = 4  # (receipt, dead-letter queue or None) -> bool
EXTEND: Final = 5  # (receipt, lease seconds) -> bool
LEASES: Final = 6  # owner or None -> [(queue, message)]: the leases reclaim() ends
RECLAIM: Final = 7  # (receipt, dead-letter queue or None, owner or None) -> bool
REMOVE: Final = 8  # offset -> bool
PEEK: Final = 9  # None -> Message | None
READ_AT: Final = 10  # offset -> Message | None
CONTAINS: Final = 11  # body -> bool
DISCARD: Final = 12  # body -> int
DELETE: Final = 13  # None -> bool
RESTORE: Final = 14  # message: give back a taken message whose caller went away
CREATE: Final = 15  # None -> bool
REDRIVE: Final = 16  # (to or None, limit) -> {queue: how many moved there}
EXPIRE_IDLE: Final = 17  # before (Unix time) -> bool
READ_RANGE: Final = 18  # (first offset, count, max bytes) -> [Message]
# Leases in bulk (Backend.reserve_many and the rest): one job, one transaction.
RESERVE_MANY: Final = 19  # (owner, lease seconds, count, max_bytes) -> [Message], receipts set
ACK_MANY: Final = 20  # [receipt], all of the job's queue -> [bool]
RELEASE_MANY: Final = 21  # [(receipt, dead-letter queue or None)], of the job's queue -> [bool]
EXTEND_MANY: Final = 22  # ([receipt] of the job's queue, lease seconds) -> [bool]
SIZES: Final = 23  # None -> {queue: QueueSize}: every queue's, as the jobs before it left it

#: The Store method that runs each operation.
METHODS: Final = {
    PUT: "put",
    TAKE: "take",
    RESERVE: "reserve",
    ACK: "ack",
    RELEASE: "release",
    EXTEND: "extend",
    LEASES: "leases",
    RECLAIM: "reclaim",
    REMOVE: "remove",
    PEEK: "peek",
    READ_AT: "read_at",
    CONTAINS: "contains",
    DISCARD: "discard",
    DELETE: "delete",
    RESTORE: "restore",
    CREATE: "create",
    REDRIVE: "redrive",
    EXPIRE_IDLE: "expire_idle",
    READ_RANGE: "read_range",
    RESERVE_MANY: "reserve_many",
    ACK_MANY: "ack_many",
    RELEASE_MANY: "release_many",
    EXTEND_MANY: "extend_many",
    SIZES: "every_size",
}

#: (operation, queue name, argument, sync or None for reads, future or None).
Job = tuple[int, str, Any, Sync | None, "asyncio.Future[Any] | None"]

#: (job, error or None, value): what the worker reports for each job.
Result = tuple[Job, BaseException | None, Any]

#: mqd.backend.NO_LIMITS, held here as a Final: compiled, a static, where the
#: imported name is a dictionary lookup.
UNBOUNDED: Final = NO_LIMITS


def bounded(limits: Limits) -> bool:
    """Whether a put's `limits` bound its queue.

    The broker passes the shared NO_LIMITS for an unbounded queue: told by
    identity, without reading fields of a class compiled apart (each read a
    dictionary lookup), on the path of every put.
    """
    return limits is not UNBOUNDED and bool(limits.max_items or limits.max_bytes)
