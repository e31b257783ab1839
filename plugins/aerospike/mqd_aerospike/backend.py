"""The Aerospike backend as the broker sees it: batching, shards, wake-ups and reclaim.

Calls are queued per queue shard; one task per shard runs cycles
(mqd_aerospike.store) in the worker threads, each serving everything queued
for that shard when it starts: one lock and one commit for many operations.

A little over 500 lines: it is the whole Backend interface (each call a short
method turning into queued operations) plus the per-shard cycle scheduling;
the record layout, the cycles and the operations live in their own modules.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from mqd import protocol
from mqd.backend import (
    NO_LIMITS,
    REDRIVE_EXPIRED,
    Backend,
    Capability,
    Fanout,
    Holder,
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
from mqd.protocol import name_bytes, name_text
from mqd_aerospike.config import AerospikeConfig
from mqd_aerospike.lanes import Lanes
from mqd_aerospike.ops import (
    DeleteOp,
    FinishMoveOp,
    LeaseOp,
    Moved,
    Op,
    PutOp,
    ReclaimOp,
    RedriveOp,
    RemoveOp,
    ReserveOp,
    TakeOp,
)
from mqd_aerospike.shard import Memo, Meta, message_of

log = logging.getLogger(__name__)

T = TypeVar("T")

INSTALL_HINT = "the aerospike backend needs the aerospike client: pip install 'aerospike>=19,<20'"


class AerospikeBackend(Backend):
    """Queues in an Aerospike namespace, shared by every daemon that points at it."""

    name = "aerospike"
    capabilities = frozenset({Capability.SHARED, Capability.FIFO, Capability.OFFSET})
    shared_across_processes = True

    def __init__(self, options: StorageOptions) -> None:
        super().__init__(options)
        self.config = AerospikeConfig.from_table(
            options.extra, options.config_path, options.poll_interval_ms
        )
        self._store: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._shards: Memo[str, int] = Memo()  # queue -> shard count, as stored
        self._lanes = Lanes(self._cycle, self.config.max_batch, self._shards.__setitem__)
        self._looking: dict[str, asyncio.Future[int | None]] = {}
        self._empty: Memo[tuple[str, int], bool] = Memo()  # last seen: nothing waiting there
        self._turn = random.randrange(1 << 16)  # where this daemon's gets and sets start
        self._homes: Memo[str, int] = Memo()  # the shard this daemon's sets go to now, by queue
        self._adopted: Memo[str, bool] = Memo()  # fanout children this daemon's sets made
        self._watched: dict[str, int] = {}
        self._seen: dict[str, tuple[int, ...]] = {}
        self._poller: asyncio.Task[None] | None = None

    # -- life cycle ------------------------------------------------------------

    async def open(self) -> None:
        try:
            from mqd_aerospike.store import Store
        except ImportError as exc:
            raise StorageError(f"{INSTALL_HINT} ({exc})") from exc
        self._pool = ThreadPoolExecutor(self.config.threads, thread_name_prefix="aerospike")
        store = Store(self.config, self.owner)
        await self._blocking(store.connect)
        self._store = store
        self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        if self._lanes.tasks:
            await asyncio.gather(*self._lanes.tasks, return_exceptions=True)
        pool, store = self._pool, self._store
        self._pool = None  # no call starts from here on
        loop = asyncio.get_running_loop()
        if pool is not None:
            # A call whose caller was cancelled still runs in its thread: the
            # client must outlive it (closing it under a running call crashes).
            await loop.run_in_executor(None, pool.shutdown, True)
        if store is not None:
            await loop.run_in_executor(None, store.close)
            self._store = None

    @property
    def calls(self) -> int:
        """Round trips to the cluster so far (a batch counts once)."""
        return int(self._store.calls) if self._store is not None else 0

    async def _blocking(self, fn: Any, *args: Any) -> Any:
        if self._pool is None:
            raise StorageError("aerospike backend is not open")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _cycle(self, name: bytes, shard: int, shards: int, batch: list[Op]) -> str:
        return str(await self._blocking(self._store.cycle, name, shard, shards, batch))

    async def _shard_count(self, queue: str) -> int | None:
        """How many shards the queue has; None when it does not exist."""
        known = self._shards.get(queue)
        if known is not None:
            return known
        looking = self._looking.get(queue)
        if looking is None:  # one read answers every call asking at once
            looking = self._looking[queue] = asyncio.ensure_future(self._read_shards(queue))
            looking.add_done_callback(lambda _: self._looking.pop(queue, None))
        return await asyncio.shield(looking)

    async def _read_shards(self, queue: str) -> int | None:
        metas = await self._blocking(self._store.read_metas, name_bytes(queue), [0])
        first = metas.get(0)
        if first is None:
            return None
        self._shards[queue] = first.shards
        return int(first.shards)

    def _order(self, shards: int) -> list[int]:
        self._turn += 1
        return [(self._turn + i) % shards for i in range(shards)]

    # -- messages --------------------------------------------------------------

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
        if unique:
            raise StorageError("unique not supported by backend aerospike")
        if "+" in queue and queue not in self._adopted:
            # `set jobs+audit ...` makes the child as a get of it does: create()
            # enters it among its parent's children, so that it gets copies.
            await self.create(queue, sync=sync)
            self._adopted[queue] = True
        op = await self._put(queue, message, limits, "", fanout is not None)
        if op.result is Put.STORED and fanout is not None:
            # Each child's copy is its own commit, made before the reply: one
            # atomic step across queues would need transactions, which the
            # Community Edition does not have.
            m = message
            copies = await asyncio.gather(
                *(
                    self._put(
                        child, Message(m.body, m.flags, m.expires, m.created), fanout.limits(child)
                    )
                    for child in op.children
                )
            )
            for child, copy in zip(op.children, copies, strict=True):
                if copy.result is Put.STORED:
                    fanout.stored(child)
        return op.result or Put.FULL

    async def create(self, queue: str, *, sync: Sync) -> bool:
        made = bool(
            await self._blocking(
                self._store.create, name_bytes(queue), self.config.shards_for(queue)
            )
        )
        return made

    async def redrive(self, dead: str, *, to: str | None, limit: int, sync: Sync) -> dict[str, int]:
        shards = await self._shard_count(dead)
        counts: dict[str, int] = {}
        if shards is None or limit <= 0:
            return counts
        left = limit
        for shard in self._order(shards):
            if left <= 0:
                break
            op = RedriveOp(to=to or "", limit=left)
            done = await self._lanes.submit(dead, shard, op, shards)
            if not done:
                continue  # a shard never written to: nothing there
            moved: list[Moved]
            moved, expired = done
            await asyncio.gather(*(self._finish_move(dead, m) for m in moved))
            left -= len(moved)
            for m in moved:
                counts[m.to] = counts.get(m.to, 0) + 1
            if expired:
                counts[REDRIVE_EXPIRED] = counts.get(REDRIVE_EXPIRED, 0) + expired
        return counts

    async def expire_idle(self, queue: str, *, before: float, sync: Sync) -> bool:
        shards = await self._shard_count(queue)
        if shards is None:
            return False
        cutoff = int(before * 1000)
        results = [
            await self._lanes.submit(queue, s, DeleteOp(before=cutoff), shards)
            for s in range(shards)
        ]
        if all(results):
            self._forget(queue, shards)
            if "+" in queue:
                await self._blocking(self._store.adopt, name_bytes(queue), False)
        return all(results)

    async def _put(
        self, queue: str, message: Message, limits: Limits, tag: str = "", fanout: bool = False
    ) -> PutOp:
        if self._store is None:
            raise StorageError("aerospike backend is not open")
        if len(message.body) > self._store.largest:
            raise StorageError(protocol.TOO_LARGE)
        shards = self._shards.get(queue)
        if shards is None:
            shard, shards = 0, self.config.shards_for(queue)
        elif tag:
            shard = sum(tag.encode()) % shards  # the same shard every time: it holds the tag
        else:
            shard = self._put_shard(queue, shards)
        op = PutOp(message=message, limits=limits, tag=tag, fanout=fanout)
        # Not skipped as empty by a get that follows while this set is on its way.
        self._empty.pop((queue, shard), None)
        await self._lanes.submit(queue, shard, op, shards)
        if op.result is Put.STORED:
            self._empty.pop((queue, shard), None)
        return op

    def _put_shard(self, queue: str, shards: int) -> int:
        """The shard a set goes to: one whose cycle is under way, so that it
        joins the next batch there, or else the next in this daemon's turn."""
        home = self._homes.get(queue)
        if home is not None and self._lanes.busy(queue, home):
            return home
        self._turn += 1
        self._homes[queue] = home = self._turn % shards
        return home

    async def take(self, queue: str, *, sync: Sync, holder: Holder | None = None) -> Message | None:
        return await self._dequeue(queue, TakeOp)

    async def reserve(self, queue: str, *, lease: float, sync: Sync) -> Message | None:
        return await self._dequeue(queue, ReserveOp, lease=lease, owner=self.owner)

    async def reserve_many(
        self, queue: str, count: int, *, lease: float, sync: Sync, max_bytes: int = 0
    ) -> list[Message]:
        # Waves of reserve()s made together, so that each shard's lane serves
        # a wave in a cycle or two; no wave so large that it could reach
        # `max_bytes` before its last message, as no body is over `largest`.
        if self._store is None:
            raise StorageError("aerospike backend is not open")
        opened: list[Message] = []
        size = 0
        while len(opened) < count and not (max_bytes and size >= max_bytes):
            wave = count - len(opened)
            if max_bytes:
                wave = min(wave, max(1, (max_bytes - size) // self._store.largest))
            calls = (self.reserve(queue, lease=lease, sync=sync) for _ in range(wave))
            got = await asyncio.gather(*calls, return_exceptions=True)
            found = [m for m in got if isinstance(m, Message)]
            opened += found
            size += sum(len(m.body) for m in found)
            for error in got:
                if isinstance(error, BaseException) and not opened:
                    raise error
            if len(found) < wave:
                break  # dry, or failed: what was opened is the caller's
        return opened

    async def _dequeue(self, queue: str, kind: type[Op], **fields: Any) -> Message | None:
        passed = -1  # a shard this get found empty in its turn: what comes later is not its
        if queue not in self._shards:
            # A queue this daemon has not seen: its sets go to shard 0 (_put), so
            # the get queues there at once, in the order of the commands, rather
            # than first reading the shard count. Awaiting that read would let
            # the set and the gets pipelined behind this one reach the lane
            # first: they would take its message, or this get the set's.
            op = kind(**fields)
            found = await self._lanes.submit(queue, 0, op, self.config.shards_for(queue))
            if found is not None:
                return found  # type: ignore[no-any-return]
            if op.shards == 1:
                return None
            self._empty[(queue, 0)] = True
            passed = 0
        shards = await self._shard_count(queue)
        if shards is None:
            return None
        order = [shard for shard in self._order(shards) if shard != passed]
        for shard in order:
            if shards > 1 and self._empty.get((queue, shard)):
                continue
            found = await self._lanes.submit(queue, shard, kind(**fields), shards)
            if found is not None:
                return found  # type: ignore[no-any-return]
            self._empty[(queue, shard)] = True
        if shards == 1:
            return None
        # Every shard looked empty to this daemon: one read tells which are not.
        states = await self._blocking(self._store.watch_state, name_bytes(queue), shards)
        for shard in order:
            waiting = states[shard][1]
            self._empty[(queue, shard)] = not waiting
            if waiting:
                found = await self._lanes.submit(queue, shard, kind(**fields), shards)
                if found is not None:
                    return found  # type: ignore[no-any-return]
        return None

    async def _lease(self, receipt: Receipt, **fields: Any) -> Any:
        shards = await self._shard_count(receipt.queue)
        if shards is None:
            return False
        shard, offset = receipt.offset % shards, receipt.offset // shards
        op = LeaseOp(receipt=receipt, offset=offset, **fields)
        return await self._lanes.submit(receipt.queue, shard, op, shards)

    async def ack(self, receipt: Receipt, *, sync: Sync) -> bool:
        return bool(await self._lease(receipt, kind="ack"))

    async def extend(self, receipt: Receipt, *, lease: float, sync: Sync) -> bool:
        return bool(await self._lease(receipt, kind="extend", lease=lease))

    async def release(self, receipt: Receipt, *, sync: Sync, to: str | None = None) -> bool:
        done = await self._lease(receipt, kind="release", to=to)
        if isinstance(done, Moved):
            await self._finish_move(receipt.queue, done)
            return True
        if done:
            shards = self._shards.get(receipt.queue) or 1
            self._empty.pop((receipt.queue, receipt.offset % shards), None)
        return bool(done)

    async def _finish_move(self, queue: str, moved: Moved) -> bool:
        """Store a moving message in its dead-letter queue (once, by its tag), then forget it.

        True if this call was the one that finished the move.
        """
        m = moved.message
        if moved.redrive:
            copy = Message(m.body, m.flags, m.expires, m.created)
        else:
            copy = Message(m.body, m.flags, m.expires, m.created, deliveries=m.deliveries)
            copy.origin = queue
        await self._put(moved.to, copy, NO_LIMITS, moved.tag)
        shards = self._shards.get(queue) or 1
        op = FinishMoveOp(offset=moved.offset)
        return bool(await self._lanes.submit(queue, moved.shard, op, shards))

    async def remove(self, queue: str, offset: int, *, sync: Sync) -> bool:
        shards = await self._shard_count(queue)
        if shards is None or offset < 0:
            return False
        op = RemoveOp(offset=offset // shards)
        return bool(await self._lanes.submit(queue, offset % shards, op, shards))

    async def peek(self, queue: str) -> Message | None:
        shards = await self._shard_count(queue)
        if shards is None:
            return None
        metas = await self._blocking(self._store.read_metas, name_bytes(queue), range(shards))
        for shard in self._order(shards):
            meta = metas.get(shard)
            offset = meta.oldest_waiting() if meta is not None else None
            if meta is None or offset is None:
                continue
            entries = await self._blocking(self._store.read_entries, meta, [offset])
            if offset in entries:
                deliveries = int(meta.ret[offset][0]) if offset in meta.ret else -1
                return message_of(entries[offset], meta.global_id(offset), deliveries)
        return None

    async def read_at(self, queue: str, offset: int) -> Message | None:
        found = await self.read_range(queue, offset, 1)
        return found[0] if found else None

    async def read_range(
        self, queue: str, first: int, count: int, max_bytes: int = 0
    ) -> list[Message]:
        # One batch read of the shards' metadata, then one of the entries each
        # shard holds in the range: offset = local offset * shards + shard.
        shards = await self._shard_count(queue)
        offsets = range(max(first, 0), first + count)
        if shards is None or not offsets:
            return []
        touched = sorted({offset % shards for offset in offsets[:shards]})
        metas = await self._blocking(self._store.read_metas, name_bytes(queue), touched)
        wanted: dict[int, list[int]] = {}
        for offset in offsets:
            meta = metas.get(offset % shards)
            local = offset // shards
            if meta is not None and (local in meta.open or meta.is_waiting(local)):
                wanted.setdefault(meta.shard, []).append(local)
        found: list[Message] = []
        for shard, locals_ in wanted.items():
            meta = metas[shard]
            assert meta is not None
            entries = await self._blocking(self._store.read_entries, meta, locals_)
            for local in locals_:
                if local not in entries:
                    continue
                lease = meta.open.get(local)
                if lease is not None:
                    deliveries = int(lease[3])
                else:
                    deliveries = int(meta.ret[local][0]) if local in meta.ret else -1
                found.append(message_of(entries[local], local * shards + shard, deliveries))
        found.sort(key=_offset_of)
        if max_bytes:
            size = 0
            for i, message in enumerate(found):
                size += len(message.body)
                if size >= max_bytes:
                    return found[: i + 1]
        return found

    # -- reclaim ---------------------------------------------------------------

    async def reclaim(
        self, route: Route, *, sync: Sync, owner: str | None = None
    ) -> list[Reclaimed]:
        now_ms = int(time.time() * 1000)
        metas = await self._blocking(self._store.reclaimable, now_ms, owner is not None)
        out: list[Reclaimed] = []
        for meta in metas:
            queue = name_text(meta.name)
            self._shards.setdefault(queue, meta.shards)
            decisions = await self._decide(queue, meta, route, now_ms, owner)
            if not decisions:
                continue
            op = ReclaimOp(decisions=decisions)
            done: list[Moved] = await self._lanes.submit(queue, meta.shard, op, meta.shards)
            returned = [m for m in done if m.returned]
            moving = [m for m in done if not m.returned]
            if returned:
                self._empty.pop((queue, meta.shard), None)
                self._wake(queue)
            out += [Reclaimed(queue, m.message, None) for m in returned]
            finished = await asyncio.gather(*(self._finish_move(queue, m) for m in moving))
            for moved, mine in zip(moving, finished, strict=True):
                self._wake(moved.to)
                if mine:  # another daemon finishing the same move reports it
                    out.append(Reclaimed(queue, moved.message, moved.to))
        return out

    async def _decide(
        self, queue: str, meta: Meta, route: Route, now_ms: int, owner: str | None
    ) -> dict[int, tuple[int, str | None]]:
        """Where each lease that has ended goes: back (None) or to a dead-letter queue."""
        ended = {
            offset: lease
            for offset, lease in meta.open.items()
            if (lease[2] and lease[2] <= now_ms) or (owner is not None and lease[1] == owner)
        }
        decisions: dict[int, tuple[int, str | None]] = {}
        if ended:
            entries = await self._blocking(self._store.read_entries, meta, list(ended))
            for offset, lease in ended.items():
                found = entries.get(offset)
                message = (
                    message_of(found, meta.global_id(offset), int(lease[3]))
                    if found is not None
                    else Message(b"", offset=meta.global_id(offset), deliveries=int(lease[3]))
                )
                decisions[offset] = (int(lease[0]), route(queue, message))
        for offset, moving in meta.mv.items():
            decisions[offset] = (0, name_text(bytes(moving[0])))
        return decisions

    # -- queues ----------------------------------------------------------------

    async def delete(self, queue: str, *, sync: Sync) -> bool:
        shards = await self._shard_count(queue)
        if shards is None:
            return False
        results = await asyncio.gather(
            *(self._lanes.submit(queue, s, DeleteOp(), shards) for s in range(shards))
        )
        self._forget(queue, shards)
        if "+" in queue:
            await self._blocking(self._store.adopt, name_bytes(queue), False)
        return any(results)

    def _forget(self, queue: str, shards: int) -> None:
        self._shards.pop(queue, None)
        self._homes.pop(queue, None)
        self._adopted.pop(queue, None)
        for s in range(shards):
            self._empty.pop((queue, s), None)

    async def flush_all(self, *, sync: Sync) -> None:
        for queue in await self.queues():
            await self.delete(queue, sync=sync)

    async def queues(self) -> list[str]:
        found = await self._blocking(self._store.scan_metas, ("qn", "inc"))
        return sorted({name_text(bytes(bins["qn"])) for bins in found})

    async def size(self, queue: str) -> QueueSize | None:
        shards = await self._shard_count(queue)
        if shards is None:
            return None
        metas = await self._blocking(self._store.read_metas, name_bytes(queue), range(shards))
        found = [m for m in metas.values() if m is not None]
        if not found:
            self._shards.pop(queue, None)
            return None
        return (await self._gauges({queue: found}))[queue]

    async def sizes(self) -> dict[str, QueueSize]:
        metas = await self._blocking(self._store.all_metas)
        grouped: dict[str, list[Meta]] = {}
        for meta in metas:
            grouped.setdefault(name_text(meta.name), []).append(meta)
        return await self._gauges(grouped)

    async def _gauges(self, grouped: dict[str, list[Meta]]) -> dict[str, QueueSize]:
        """Gauges summed over shards; the oldest message's age needs its entry read."""
        every = [m for metas in grouped.values() for m in metas]
        heads = await self._blocking(self._store.head_created, every)
        out = {}
        for queue, metas in grouped.items():
            created = [heads[(m.name, m.shard)] for m in metas if (m.name, m.shard) in heads]
            out[queue] = QueueSize(
                items=sum(m.items for m in metas),
                bytes=sum(m.size for m in metas),
                open=sum(len(m.open) for m in metas),
                head_created=min(created, default=0.0),
            )
        return out

    # -- wake-ups ---------------------------------------------------------------

    def watch(self, queue: str, on: bool) -> None:
        count = self._watched.get(queue, 0) + (1 if on else -1)
        if count > 0:
            self._watched[queue] = count
        else:
            self._watched.pop(queue, None)
            self._seen.pop(queue, None)

    async def _poll(self) -> None:
        """Wake gets waiting here when another daemon changed a watched queue."""
        interval = self.config.poll_interval_ms / 1000
        loop = asyncio.get_running_loop()
        began = loop.time()
        while True:
            # A poll every interval, the time the last one took included.
            await asyncio.sleep(max(began + interval - loop.time(), 0))
            began = loop.time()
            if not self._watched or self._store is None:
                continue
            watched = {q: self._shards.get(q) or 1 for q in self._watched}
            try:
                states = await self._blocking(self._store.watch_many, watched)
            except StorageError as error:
                log.debug("wake-up poll failed: %s", error)
                continue
            for queue, shard_states in states.items():
                generations = tuple(gen for gen, _ in shard_states)
                waiting = any(w for _, w in shard_states)
                if waiting and self._seen.get(queue) != generations:
                    for shard, (_, w) in enumerate(shard_states):
                        if w:
                            self._empty.pop((queue, shard), None)
                    self._wake(queue)
                self._seen[queue] = generations


def _offset_of(message: Message) -> int:
    return message.offset
