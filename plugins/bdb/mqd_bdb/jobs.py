"""What the event loop hands the worker thread: one tuple per backend call."""

from __future__ import annotations

import asyncio
from typing import Any

from mqd.backend import Sync

# Operation codes, the first item of a Job; the argument each takes.
PUT = 0  # (message, unique, limits, {child: limits} or None) -> Put
TAKE = 1  # None -> Message | None
RESERVE = 2  # (owner, lease seconds) -> Message | None, its receipt set
ACK = 3  # receipt -> bool
RELEASE = 4  # (receipt, dead-letter queue or None) -> bool
EXTEND = 5  # (receipt, lease seconds) -> bool
LEASES = 6  # owner or None -> [(queue, message)]: the leases reclaim() ends
RECLAIM = 7  # (receipt, dead-letter queue or None, owner or None) -> bool
REMOVE = 8  # offset -> bool
PEEK = 9  # None -> Message | None
READ_AT = 10  # offset -> Message | None
CONTAINS = 11  # body -> bool
DISCARD = 12  # body -> int
DELETE = 13  # None -> bool
RESTORE = 14  # message: give back a taken message whose caller went away
CREATE = 15  # None -> bool
REDRIVE = 16  # (to or None, limit) -> {queue: how many moved there}
EXPIRE_IDLE = 17  # before (Unix time) -> bool
READ_RANGE = 18  # (first offset, count, max bytes) -> [Message]
# Leases in bulk (Backend.reserve_many and the rest): one job, one transaction.
RESERVE_MANY = 19  # (owner, lease seconds, count, max_bytes) -> [Message], receipts set
ACK_MANY = 20  # [receipt], all of the job's queue -> [bool]
RELEASE_MANY = 21  # [(receipt, dead-letter queue or None)], of the job's queue -> [bool]
EXTEND_MANY = 22  # ([receipt] of the job's queue, lease seconds) -> [bool]

#: The Store method that runs each operation.
METHODS = {
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
}

#: (operation, queue name, argument, sync or None for reads, future or None).
Job = tuple[int, str, Any, Sync | None, "asyncio.Future[Any] | None"]

#: (job, error or None, value): what the worker reports for each job.
Result = tuple[Job, BaseException | None, Any]

#: What a job run on the event loop gives when it has to go to the worker thread.
LATER: Any = object()
