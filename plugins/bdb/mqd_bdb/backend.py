"""The three Berkeley DB backends, as the broker sees them.

A plain put or take with a holder runs at once on the event loop when it can
(mqd_bdb.worker, rounds); every other call becomes one job for the
environment's worker thread and one future to await. The gauges size(),
sizes() and queues() answer from are published after every batch and round,
so they cost no trip to the thread; while a round is open on the loop,
size() reads that round's own counts instead (Worker.size_in_round). Where
jobs made before the call have not published theirs yet (a round not yet
answered, jobs on the thread), the answer is a job of its own after them:
a pipelined set that made a queue and the `stats` or `flush_all` behind it
see the queue.

These backends are not Capability.SHARED: one daemon holds the data
directory (flock on LOCK), so the broker wakes its own waiters and listen()
and watch() need nothing; leases are stored all the same, so a restart
returns exactly the leases the daemon held (reclaim with its owner id).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import resource
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from mqd.backend import (
    LATER,
    NO_LIMITS,
    PUT_STORED,
    Backend,
    Capability,
    Fanout,
    Holder,
    Later,
    Limits,
    Message,
    Put,
    QueueSize,
    Receipt,
    Reclaimed,
    Route,
    StorageOptions,
    Sync,
)
from mqd.errors import StorageError
from mqd_bdb import jobs
from mqd_bdb.config import BdbConfig

if TYPE_CHECKING:
    from mqd_bdb.operations import Copied
    from mqd_bdb.store import Store
    from mqd_bdb.worker import Worker

log = logging.getLogger("mqd.bdb")

MIN_OPEN_QUEUES = 8  # queues kept open whatever the descriptor limit
INSTALL_HINT = (
    "the Berkeley DB backends need the berkeleydb module: install the system's "
    "Berkeley DB headers (Debian: apt-get install libdb5.3-dev) and then "
    "pip install berkeleydb (see plugins/bdb/README.md)"
)


class _BdbBackend(Backend):
    """A Berkeley DB environment in `options.data_dir`, worked by one thread."""

    answers_held = True
    answers_now = True
    #: The module in mqd_bdb and the Store class in it that lay out the messages.
    layout: ClassVar[tuple[str, str]] = ("", "")

    def __init__(self, options: StorageOptions) -> None:
        super().__init__(options)
        self.config = BdbConfig.from_table(
            options.extra, options.config_path, f"storage.{self.name}", options.max_disk_bytes
        )
        self._sizes: dict[str, QueueSize] = {}
        # Fanout parent -> its existing children, as the published gauges tell.
        self._children: dict[str, set[str]] = {}
        self._worker: Worker | None = None
        self._outbox: list[jobs.Job] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- life cycle ----------------------------------------------------------

    async def open(self) -> None:
        module, class_name = self.layout
        try:
            from mqd_bdb.worker import Worker

            store_class: type[Store] = getattr(
                importlib.import_module(f"mqd_bdb.{module}"), class_name
            )
        except ImportError as exc:
            raise StorageError(f"{INSTALL_HINT} ({exc})") from exc
        loop = asyncio.get_running_loop()
        worker = Worker(
            store_class(self.options.data_dir, self.config),
            loop,
            self._deliver,
            self.options.sync_interval_ms / 1000,
        )
        self._sizes = {}
        self._children = {}
        self._publish(await worker.start())
        self._loop = loop
        self._worker = worker

    async def close(self) -> None:
        self._send()
        worker, self._worker = self._worker, None
        if worker is not None:
            await worker.stop()

    @property
    def worker(self) -> Worker:
        """The worker thread's handle (its counters show batching at work)."""
        if self._worker is None:
            raise StorageError(f"backend {self.name} is not open")
        return self._worker

    def _call(self, op: int, queue: str, arg: Any, sync: Sync | None) -> asyncio.Future[Any]:
        worker, loop = self._worker, self._loop
        if worker is None or loop is None:
            raise StorageError(f"backend {self.name} is not open")
        future = loop.create_future()
        outbox = self._outbox
        outbox.append((op, queue, arg, sync, future))
        if len(outbox) == 1:
            # Jobs made in one turn of the loop go to the worker together:
            # one wake-up of its thread instead of one per job.
            loop.call_soon(self._send)
        return future

    def _now(self, op: int, queue: str, arg: Any, sync: Sync, holder: Holder) -> Any:
        """Run a job at once, its reply held (Worker.run_now); LATER if it can't be."""
        worker = self._worker
        if worker is None or self._outbox:  # jobs made before it go first
            return LATER
        return worker.run_now((op, queue, arg, sync, None), holder)

    def _send(self) -> None:
        outbox, self._outbox = self._outbox, []
        if outbox and self._worker is not None:
            self._worker.submit(outbox)

    def _publish(self, published: Mapping[str, QueueSize | None]) -> None:
        """Take the worker's gauges: a queue's, or None for a queue that is gone."""
        sizes, children = self._sizes, self._children
        for name, size in published.items():
            if size is None:
                if sizes.pop(name, None) is not None and "+" in name:
                    parent = name.partition("+")[0]
                    kids = children.get(parent)
                    if kids is not None:
                        kids.discard(name)
                        if not kids:
                            del children[parent]
            else:
                if "+" in name and name not in sizes:
                    children.setdefault(name.partition("+")[0], set()).add(name)
                sizes[name] = size

    def _deliver(self, results: list[jobs.Result], published: dict[str, QueueSize | None]) -> None:
        self._publish(published)
        for job, error, value in results:
            future = job[4]
            if future is None:
                continue
            if future.cancelled():
                # The caller went away: a message taken for it must not be lost.
                if error is None and self._worker is not None:
                    self._worker.give_back(job, value)
            elif error is None:
                future.set_result(value)
            else:
                future.set_exception(error)

    # -- the interface ---------------------------------------------------------

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
        if holder is not None:
            now = self.put_now(queue, message, sync, unique, limits, fanout, holder)
            if now is not LATER:
                return now
        children = None
        if fanout is not None and queue in self._children:
            # `fanout` reads the daemon's settings: call it here, on the loop.
            children = {
                child: (fanout.limits(child), fanout.unique(child))
                for child in self._children[queue]
            }
        result: Put | Copied = await self._call(
            jobs.PUT, queue, (message, unique, limits, children), sync
        )
        if isinstance(result, tuple):
            assert fanout is not None  # for mypy: only a put with children is worth Copied
            for child in result:
                fanout.stored(child)
            return PUT_STORED
        return result

    def put_now(
        self,
        queue: str,
        message: Message,
        sync: Sync,
        unique: bool,
        limits: Limits,
        fanout: Fanout | None,
        holder: Holder,
    ) -> Put | Later:
        if fanout is not None and queue in self._children:
            # Copies to fanout children never run on the loop (Store.quick):
            # put() asks `fanout` for their limits, once, for the worker thread.
            return LATER
        arg = (message, unique, limits, None)
        result: Put | Later = self._now(jobs.PUT, queue, arg, sync, holder)
        return result

    async def take(self, queue: str, *, sync: Sync, holder: Holder | None = None) -> Message | None:
        if holder is not None:
            now = self.take_now(queue, sync, holder)
            if now is not LATER:
                return now
        result: Message | None = await self._call(jobs.TAKE, queue, None, sync)
        return result

    def take_now(self, queue: str, sync: Sync, holder: Holder) -> Message | Later | None:
        result: Message | Later | None = self._now(jobs.TAKE, queue, None, sync, holder)
        return result

    async def reserve(self, queue: str, *, lease: float, sync: Sync) -> Message | None:
        result: Message | None = await self._call(jobs.RESERVE, queue, (self.owner, lease), sync)
        return result

    async def ack(self, receipt: Receipt, *, sync: Sync) -> bool:
        result: bool = await self._call(jobs.ACK, receipt.queue, receipt, sync)
        return result

    async def release(self, receipt: Receipt, *, sync: Sync, to: str | None = None) -> bool:
        result: bool = await self._call(jobs.RELEASE, receipt.queue, (receipt, to), sync)
        return result

    async def extend(self, receipt: Receipt, *, lease: float, sync: Sync) -> bool:
        result: bool = await self._call(jobs.EXTEND, receipt.queue, (receipt, lease), sync)
        return result

    async def reserve_many(
        self, queue: str, count: int, *, lease: float, sync: Sync, max_bytes: int = 0
    ) -> list[Message]:
        arg = (self.owner, lease, count, max_bytes)
        result: list[Message] = await self._call(jobs.RESERVE_MANY, queue, arg, sync)
        return result

    # The other bulk calls are one job when their receipts are of one queue
    # (a named lease's always are), else the single calls, made together.

    async def ack_many(self, receipts: Sequence[Receipt], *, sync: Sync) -> list[bool]:
        queue = _one_queue(receipts)
        if queue is None:
            return await super().ack_many(receipts, sync=sync)
        result: list[bool] = await self._call(jobs.ACK_MANY, queue, list(receipts), sync)
        return result

    async def release_many(
        self, receipts: Sequence[Receipt], *, sync: Sync, to: Sequence[str | None] = ()
    ) -> list[bool]:
        queue = _one_queue(receipts)
        if queue is None:
            return await super().release_many(receipts, sync=sync, to=to)
        ends = list(zip(receipts, to or [None] * len(receipts), strict=True))
        result: list[bool] = await self._call(jobs.RELEASE_MANY, queue, ends, sync)
        return result

    async def extend_many(
        self, receipts: Sequence[Receipt], *, lease: float, sync: Sync
    ) -> list[bool]:
        queue = _one_queue(receipts)
        if queue is None:
            return await super().extend_many(receipts, lease=lease, sync=sync)
        arg = (list(receipts), lease)
        result: list[bool] = await self._call(jobs.EXTEND_MANY, queue, arg, sync)
        return result

    async def reclaim(
        self, route: Route, *, sync: Sync, owner: str | None = None
    ) -> list[Reclaimed]:
        # The worker lists the leases to end; `route` runs here, on the loop,
        # since it reads the daemon's settings; then each lease still due
        # ends in the worker, all in one batch.
        due: list[tuple[str, Message]] = await self._call(jobs.LEASES, "", owner, None)
        routes = [route(queue, message) for queue, message in due]
        ended = await asyncio.gather(
            *(
                self._call(jobs.RECLAIM, queue, (message.receipt, to, owner), sync)
                for (queue, message), to in zip(due, routes, strict=True)
            ),
            return_exceptions=True,
        )
        reclaimed: list[Reclaimed] = []
        for (queue, message), to, result in zip(due, routes, ended, strict=True):
            if isinstance(result, BaseException):
                # Left open and due: the next reclaim() tries again.
                log.warning("returning message %d of %r failed: %s", message.offset, queue, result)
            elif result:
                reclaimed.append(Reclaimed(queue, message, to))
        return reclaimed

    async def remove(self, queue: str, offset: int, *, sync: Sync) -> bool:
        result: bool = await self._call(jobs.REMOVE, queue, offset, sync)
        return result

    async def peek(self, queue: str) -> Message | None:
        result: Message | None = await self._call(jobs.PEEK, queue, None, None)
        return result

    async def contains(self, queue: str, body: bytes) -> bool:
        result: bool = await self._call(jobs.CONTAINS, queue, body, None)
        return result

    async def discard(self, queue: str, body: bytes, *, sync: Sync) -> int:
        result: int = await self._call(jobs.DISCARD, queue, body, sync)
        return result

    async def create(self, queue: str, *, sync: Sync) -> bool:
        result: bool = await self._call(jobs.CREATE, queue, None, sync)
        return result

    async def redrive(self, dead: str, *, to: str | None, limit: int, sync: Sync) -> dict[str, int]:
        result: dict[str, int] = await self._call(jobs.REDRIVE, dead, (to, limit), sync)
        return result

    async def expire_idle(self, queue: str, *, before: float, sync: Sync) -> bool:
        result: bool = await self._call(jobs.EXPIRE_IDLE, queue, before, sync)
        return result

    async def delete(self, queue: str, *, sync: Sync) -> bool:
        result: bool = await self._call(jobs.DELETE, queue, None, sync)
        return result

    async def queues(self) -> list[str]:
        return list(await self.sizes())

    async def size(self, queue: str) -> QueueSize | None:
        worker = self._worker
        if worker is not None:
            live = worker.size_in_round(queue)
            if live is not LATER:
                return live
            if not self._settled(worker):
                return (await self.sizes()).get(queue)
        return self._sizes.get(queue)

    async def sizes(self) -> dict[str, QueueSize]:
        worker = self._worker
        if worker is None or self._settled(worker):
            return dict(self._sizes)
        # The commands before this one may have run in a round not yet
        # answered (a pipelined set that made a queue, then `stats` or
        # `flush_all`): a job after theirs reads what they left.
        result: dict[str, QueueSize] = await self._call(jobs.SIZES, "", None, None)
        return result

    def _settled(self, worker: Worker) -> bool:
        """Whether the published gauges include what every job made so far did."""
        return not self._outbox and worker.settled()


def _one_queue(receipts: Sequence[Receipt]) -> str | None:
    """The queue every receipt names, or None when there are none or several."""
    if not receipts:
        return None
    queue = receipts[0].queue
    return queue if all(r.queue == queue for r in receipts) else None


class _FifoBdbBackend(_BdbBackend):
    """The layouts that keep messages keyed by offset: reads by offset and by range."""

    capabilities = frozenset({Capability.UNIQUE, Capability.OFFSET, Capability.FIFO})

    async def read_at(self, queue: str, offset: int) -> Message | None:
        result: Message | None = await self._call(jobs.READ_AT, queue, offset, None)
        return result

    async def read_range(
        self, queue: str, first: int, count: int, max_bytes: int = 0
    ) -> list[Message]:
        result: list[Message] = await self._call(
            jobs.READ_RANGE, queue, (first, count, max_bytes), None
        )
        return result


class BdbBackend(_FifoBdbBackend):
    """Per queue, a B-tree file of messages in order and a Hash file of body digests."""

    name = "bdb"
    layout = ("per_queue", "PerQueueStore")

    async def open(self) -> None:
        # A queue's files take 2 descriptors while open. Beyond max_open_queues
        # they are closed after each round, so a round may open a file pair
        # for each of its (up to max_batch) jobs first. An eighth of the
        # process' limit (as the daemon raised it) goes to both, and the daemon
        # keeps that many from its connections (descriptors()): Berkeley DB is
        # never left without a descriptor to open a file with. It panics then,
        # and every command waits for its recovery.
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        fits = max(MIN_OPEN_QUEUES, limit // 8 // 4) if limit != resource.RLIM_INFINITY else 0
        config = self.config
        if fits and fits < max(config.max_open_queues, config.max_batch):
            lowered = dataclasses.replace(
                config,
                max_open_queues=min(config.max_open_queues, fits),
                max_batch=min(config.max_batch, fits),
            )
            log.warning(
                "storage.bdb.max_open_queues lowered from %d to %d and max_batch from %d to %d: "
                "the descriptor limit is %d (raise it with ulimit -n or LimitNOFILE)",
                config.max_open_queues,
                lowered.max_open_queues,
                config.max_batch,
                lowered.max_batch,
                limit,
            )
            self.config = lowered
        await super().open()

    def descriptors(self) -> int:
        return 2 * (self.config.max_open_queues + self.config.max_batch)


class BdbSingleBackend(_FifoBdbBackend):
    """Every queue in one B-tree file keyed by (queue, offset): one file descriptor."""

    name = "bdb-single"
    layout = ("single", "SingleStore")


class BdbRandomBackend(_BdbBackend):
    """Every queue in one file as a set: each body once per queue, taken in no fixed order.

    put() of a body already in the queue is Put.DUPLICATE whatever `unique` says.
    """

    name = "bdb-random"
    capabilities = frozenset({Capability.UNIQUE})
    layout = ("random_set", "RandomStore")
