"""The three Berkeley DB backends, as the broker sees them.

Each call becomes one job for the environment's worker thread and one future
to await; the gauges size() and queues() answer from are refreshed by the
worker after every batch, so they cost no trip to the thread.
"""

from __future__ import annotations

import asyncio
import importlib
from typing import TYPE_CHECKING, Any, ClassVar

from mqd.backend import Backend, Capability, Message, QueueSize, StorageOptions, Sync
from mqd.errors import StorageError
from mqd_bdb import jobs
from mqd_bdb.config import BdbConfig

if TYPE_CHECKING:
    from mqd_bdb.store import Store
    from mqd_bdb.worker import Worker

INSTALL_HINT = (
    "the Berkeley DB backends need the berkeleydb module: install the system's "
    "Berkeley DB headers (Debian: apt-get install libdb5.3-dev) and then "
    "pip install berkeleydb (see plugins/bdb/README.md)"
)


class _BdbBackend(Backend):
    """A Berkeley DB environment in `options.data_dir`, worked by one thread."""

    #: The module in mqd_bdb and the Store class in it that lay out the messages.
    layout: ClassVar[tuple[str, str]] = ("", "")

    def __init__(self, options: StorageOptions) -> None:
        super().__init__(options)
        self.config = BdbConfig.from_table(
            options.extra, options.config_path, f"storage.{self.name}"
        )
        self._sizes: dict[str, QueueSize] = {}
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
        self._sizes = await worker.start()
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

    def _send(self) -> None:
        outbox, self._outbox = self._outbox, []
        if outbox and self._worker is not None:
            self._worker.submit(outbox)

    def _deliver(self, results: list[jobs.Result], published: dict[str, QueueSize | None]) -> None:
        sizes = self._sizes
        for name, size in published.items():
            if size is None:
                sizes.pop(name, None)
            else:
                sizes[name] = size
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

    async def recover(self) -> list[tuple[str, Message]]:
        result: list[tuple[str, Message]] = await self._call(jobs.RECOVER, "", None, None)
        return result

    async def put(self, queue: str, message: Message, *, unique: bool, sync: Sync) -> int | None:
        result: int | None = await self._call(jobs.PUT, queue, (message, unique), sync)
        return result

    async def take(self, queue: str, *, sync: Sync) -> Message | None:
        result: Message | None = await self._call(jobs.TAKE, queue, None, sync)
        return result

    async def reserve(self, queue: str, *, lease: float, sync: Sync) -> Message | None:
        result: Message | None = await self._call(jobs.RESERVE, queue, None, sync)
        return result

    async def remove(self, queue: str, offset: int, *, sync: Sync) -> bool:
        result: bool = await self._call(jobs.REMOVE, queue, offset, sync)
        return result

    async def release(self, queue: str, offset: int, *, sync: Sync) -> bool:
        result: bool = await self._call(jobs.RELEASE, queue, offset, sync)
        return result

    async def peek(self, queue: str) -> Message | None:
        result: Message | None = await self._call(jobs.PEEK, queue, None, None)
        return result

    async def delete(self, queue: str, *, sync: Sync) -> bool:
        result: bool = await self._call(jobs.DELETE, queue, None, sync)
        return result

    async def queues(self) -> list[str]:
        return list(self._sizes)

    async def size(self, queue: str) -> QueueSize | None:
        return self._sizes.get(queue)


class BdbBackend(_BdbBackend):
    """Per queue, a B-tree file of messages in order and a Hash file of body digests."""

    name = "bdb"
    capabilities = frozenset({Capability.UNIQUE, Capability.OFFSET, Capability.FIFO})
    layout = ("per_queue", "PerQueueStore")

    async def read_at(self, queue: str, offset: int) -> Message | None:
        result: Message | None = await self._call(jobs.READ_AT, queue, offset, None)
        return result


class BdbSingleBackend(_BdbBackend):
    """Every queue in one B-tree file keyed by (queue, offset): one file descriptor."""

    name = "bdb-single"
    capabilities = frozenset({Capability.UNIQUE, Capability.OFFSET, Capability.FIFO})
    layout = ("single", "SingleStore")

    async def read_at(self, queue: str, offset: int) -> Message | None:
        result: Message | None = await self._call(jobs.READ_AT, queue, offset, None)
        return result


class BdbRandomBackend(_BdbBackend):
    """Every queue in one file as a set: each body once per queue, taken in no fixed order.

    put() returns None for a body already in the queue whatever `unique` says.
    """

    name = "bdb-random"
    capabilities = frozenset({Capability.UNIQUE})
    layout = ("random_set", "RandomStore")
