"""What the event loop hands the worker thread: one tuple per backend call."""

from __future__ import annotations

import asyncio
from typing import Any

from mqd.backend import Sync

# Operation codes, the first item of a Job.
PUT = 0
TAKE = 1
RESERVE = 2
REMOVE = 3
RELEASE = 4
PEEK = 5
READ_AT = 6
DELETE = 7
RESTORE = 8  # give back a taken message whose caller went away
RECOVER = 9

#: (operation, queue name, argument, sync or None for reads, future or None).
Job = tuple[int, str, Any, Sync | None, "asyncio.Future[Any] | None"]

#: (job, error or None, value): what the worker reports for each job.
Result = tuple[Job, BaseException | None, Any]
