"""Operations queued per queue shard, and the task per shard that serves them in cycles.

A cycle (mqd_aerospike.store) takes everything queued for its shard when it
starts, so calls that arrive together share one lock and one commit.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from mqd.errors import StorageError
from mqd.protocol import name_bytes
from mqd_aerospike.ops import HoleOp, Op, PutOp

log = logging.getLogger(__name__)

BACKOFF_FIRST = 0.0005
BACKOFF_MAX = 0.05

#: Runs one cycle in a worker thread: (queue name, shard, shard count, batch) -> outcome.
Cycle = Callable[[bytes, int, int, list[Op]], Awaitable[str]]


@dataclass
class _Lane:
    """The operations queued for one shard, and whether a task is serving them."""

    pending: list[Op] = field(default_factory=list)
    running: bool = False


class Lanes:
    """Every shard's queue of operations, served one cycle at a time per shard."""

    def __init__(self, cycle: Cycle, max_batch: int, seen: Callable[[str, int], None]) -> None:
        self._cycle = cycle
        self._max_batch = max_batch
        self._seen = seen  # told each queue's shard count as cycles find it
        self._lanes: dict[tuple[str, int], _Lane] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    def busy(self, queue: str, shard: int) -> bool:
        """Whether a cycle is under way on the shard (what is submitted now joins the next)."""
        lane = self._lanes.get((queue, shard))
        return lane is not None and lane.running

    def submit(self, queue: str, shard: int, op: Op, shards: int = 1) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        op.future = loop.create_future()
        lane = self._lanes.get((queue, shard))
        if lane is None:
            lane = self._lanes[(queue, shard)] = _Lane()
        lane.pending.append(op)
        if not lane.running:
            lane.running = True
            task = loop.create_task(self._serve(queue, shard, lane, shards))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        return op.future

    async def _serve(self, queue: str, shard: int, lane: _Lane, shards: int) -> None:
        name = name_bytes(queue)
        backoff = BACKOFF_FIRST
        try:
            while lane.pending:
                batch = lane.pending[: self._max_batch]
                del lane.pending[: len(batch)]
                try:
                    outcome = await self._cycle(name, shard, shards, batch)
                except Exception as error:
                    failure = error if isinstance(error, StorageError) else _wrap(error)
                    for o in batch:
                        if not o.future.done():
                            o.future.set_exception(failure)
                    continue
                if outcome == "done":
                    backoff = BACKOFF_FIRST
                    holes = []
                    for o in batch:
                        if o.shards:
                            self._seen(queue, o.shards)
                        if isinstance(o, PutOp) and o.hole is not None:
                            holes.append(o.hole)
                        if o.future.done():
                            continue
                        if o.error is not None:
                            o.future.set_exception(o.error)
                        else:
                            o.future.set_result(o.result)
                    if holes:
                        self.submit(queue, shard, HoleOp(holes=holes), shards).add_done_callback(
                            _log_failure
                        )
                    continue
                lane.pending[0:0] = batch
                if outcome == "busy":
                    await asyncio.sleep(backoff * random.uniform(0.5, 1.5))
                    backoff = min(backoff * 2, BACKOFF_MAX)
        finally:
            lane.running = False
            if not lane.pending:
                self._lanes.pop((queue, shard), None)


def _log_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("could not correct a queue's counters: %s", future.exception())


def _wrap(error: Exception) -> StorageError:
    log.error("aerospike backend failed", exc_info=error)
    return StorageError(f"aerospike backend failed: {type(error).__name__}")
