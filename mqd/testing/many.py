"""The many-instance mode of the conformance suite: several daemons, one store.

Every backend that declares Capability.SHARED runs it. Each "daemon" is a real
Broker over its own backend handle, all handles on one store, as separate
mqd processes would be::

    from mqd.testing.many import ManyDaemonConformance

    class TestMyBackendShared(ManyDaemonConformance):
        def make_instance(self, data_dir, n):
            return MyBackend(StorageOptions(data_dir=data_dir, extra=...))

`make_instance(data_dir, n)` builds the backend of daemon number `n`; every
call with the same `data_dir` must reach the same store.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from mqd.backend import Backend, Put
from mqd.broker import Broker, Session
from mqd.config import Config
from mqd.protocol import Retrieve, Store, parse_key

T = TypeVar("T")

INSTANCES = 3
WAKE_BOUND = 1.0  # seconds: far below a get's wait, far above any poll interval used here


def store_command(queue: str, body: bytes) -> Store:
    return Store(add=False, queue=queue, flags=0, exptime=0, body=body, noreply=False)


def get_command(*keys: str) -> Retrieve:
    parsed = [parse_key(k.encode()) for k in keys]
    assert all(parsed), keys
    return Retrieve([k for k in parsed if k is not None], with_ids=False)


class ManyDaemonConformance:
    """Mixin of tests with several brokers sharing one store; define `make_instance`."""

    #: Per-queue settings every daemon gets: [queues."<glob>"] tables.
    queue_tables: tuple[tuple[str, dict[str, Any]], ...] = ()

    def make_instance(self, data_dir: Path, n: int) -> Backend:
        raise NotImplementedError("ManyDaemonConformance.make_instance")

    @pytest.fixture
    def data_dir(self, tmp_path: Path) -> Path:
        path = tmp_path / "data"
        path.mkdir()
        return path

    def config(self, data_dir: Path, n: int, **queue: Any) -> Config:
        tables = self.queue_tables + ((("*", queue),) if queue else ())
        return Config(
            daemon_id=f"daemon-{n}",
            data_dir=data_dir,
            reclaim_interval=0.05,
            poll_interval_ms=10,
            queues=tables,
        )

    async def start(self, data_dir: Path, n: int, **queue: Any) -> Broker:
        broker = Broker(self.make_instance(data_dir, n), self.config(data_dir, n, **queue))
        await broker.start()
        return broker

    def run(self, data_dir: Path, body: Callable[[list[Broker]], Awaitable[T]], **queue: Any) -> T:
        """Start INSTANCES brokers on one store, run `body`, stop them all."""

        async def main() -> T:
            brokers = [await self.start(data_dir, n, **queue) for n in range(INSTANCES)]
            try:
                return await asyncio.wait_for(body(brokers), 60)
            finally:
                for broker in brokers:
                    await broker.stop()

        return asyncio.run(main())

    # -- the tests -----------------------------------------------------------

    def test_no_loss_no_duplicates_with_reliable_consumers(self, data_dir: Path) -> None:
        per_producer = 150
        sent = {f"{n}-{i}".encode() for n in range(INSTANCES) for i in range(per_producer)}
        closed: Counter[bytes] = Counter()
        abandoned: set[bytes] = set()
        rng = random.Random(7)

        async def produce(broker: Broker, n: int) -> None:
            for i in range(per_producer):
                assert await broker.store(store_command("q", f"{n}-{i}".encode())) is Put.STORED
                if i % 10 == 0:
                    await asyncio.sleep(0)

        async def consume(broker: Broker) -> None:
            while sum(closed.values()) < len(sent):
                session = Session()
                hits = await broker.retrieve(get_command("q/t=50/open"), session)
                if not hits:
                    continue
                body = hits[0][1].body
                if rng.random() < 0.05:
                    abandoned.add(body)  # the client goes away without closing
                    await broker.end_session(session)
                    continue
                await broker.retrieve(get_command("q/close"), session)
                closed[body] += 1

        async def body(brokers: list[Broker]) -> None:
            work = [produce(b, n) for n, b in enumerate(brokers)]
            work += [consume(b) for b in brokers for _ in range(2)]
            await asyncio.gather(*work)

        self.run(data_dir, body, visibility_timeout=30)
        assert set(closed) == sent
        assert [b for b, times in closed.items() if times > 1] == []

    def test_lease_survives_restart_of_another_daemon(self, data_dir: Path) -> None:
        async def body(brokers: list[Broker]) -> None:
            a, b = brokers[0], brokers[1]
            await a.store(store_command("q", b"held"))
            session = Session()
            hits = await a.retrieve(get_command("q/open"), session)
            assert [m.body for _, m in hits] == [b"held"]
            await b.stop()
            brokers[1] = await self.start(data_dir, 1, visibility_timeout=30)
            size = await a.size("q")
            assert size is not None and (size.items, size.open) == (1, 1)
            assert await brokers[1].retrieve(get_command("q"), Session()) == []
            await a.retrieve(get_command("q/close"), session)
            size = await a.size("q")
            assert size is not None and size.items == 0

        self.run(data_dir, body, visibility_timeout=30)

    def test_dead_daemons_leases_return_after_visibility_timeout(self, data_dir: Path) -> None:
        async def body(brokers: list[Broker]) -> None:
            dead = self.make_instance(data_dir, 9)
            dead.owner = "daemon-9"
            await dead.open()
            await brokers[0].store(store_command("q", b"orphan"))
            # Daemon 9 opens the message and dies: no broker of its own returns it.
            assert await dead.reserve("q", lease=0.2, sync=brokers[0].settings("q").sync)
            await dead.close()
            loop = asyncio.get_running_loop()
            start = loop.time()
            hits = await brokers[1].retrieve(get_command("q/t=5000/open"), Session())
            assert [(m.body, m.deliveries) for _, m in hits] == [(b"orphan", 2)]
            assert loop.time() - start < 0.2 + WAKE_BOUND

        self.run(data_dir, body, visibility_timeout=30)

    def test_named_lease_is_held_by_the_daemon_that_made_it(self, data_dir: Path) -> None:
        async def body(brokers: list[Broker]) -> None:
            a, b = brokers[0], brokers[1]
            for text in (b"1", b"2", b"3"):
                await a.store(store_command("q", text))
            held = [m.offset for m in await a.lease_reserve("q", "job", 2, 0, Session())]
            assert len(held) == 2
            # The store keeps them open for every daemon: counted, and hidden.
            size = await b.size("q")
            assert size is not None and (size.items, size.open) == (3, 2)
            hits = await b.retrieve(get_command("q", "q"), Session())
            assert len(hits) == 1 and hits[0][1].offset not in held
            # The lease is a's: another daemon does not know its name.
            assert await b.lease_ack("q", "job", None) is False
            # Named now and then through a, it outlives several visibility
            # timeouts, though every daemon reclaims expired leases meanwhile.
            # Named every 0.2 s against a 0.8 s timeout (1.0 s in the store):
            # room for a busy machine to stall a step without the lease ending.
            for _ in range(10):
                await asyncio.sleep(0.2)
                assert await b.retrieve(get_command("q"), Session()) == []
                again = await a.lease_reserve("q", "job", 2, 0, Session())
                assert [m.offset for m in again] == held
            size = await b.size("q")
            assert size is not None and (size.items, size.open) == (2, 2)
            assert await a.lease_ack("q", "job", None) is True
            size = await b.size("q")
            assert size is not None and (size.items, size.open) == (0, 0)

        self.run(data_dir, body, visibility_timeout=0.8)

    def test_stale_receipt_after_delete_and_recreate(self, data_dir: Path) -> None:
        async def body(brokers: list[Broker]) -> None:
            a, b = brokers[0], brokers[1]
            await a.store(store_command("q", b"old"))
            session = Session()
            assert await a.retrieve(get_command("q/open"), session)
            assert await b.delete("q") is True
            await b.store(store_command("q", b"new"))
            await a.retrieve(get_command("q/close"), session)
            hits = await b.retrieve(get_command("q"), Session())
            assert [m.body for _, m in hits] == [b"new"]

        self.run(data_dir, body, visibility_timeout=30)

    def test_limits_hold_across_daemons(self, data_dir: Path) -> None:
        async def body(brokers: list[Broker]) -> list[Put]:
            work = [
                b.store(store_command("q", f"{n}-{i}".encode()))
                for i in range(20)
                for n, b in enumerate(brokers)
            ]
            results = await asyncio.gather(*work)
            size = await brokers[0].size("q")
            assert size is not None and size.items == 10
            return list(results)

        results = self.run(data_dir, body, max_items=10)
        assert results.count(Put.STORED) == 10
        assert results.count(Put.FULL) == len(results) - 10

    def test_set_on_one_daemon_wakes_get_on_another(self, data_dir: Path) -> None:
        async def body(brokers: list[Broker]) -> list[float]:
            loop = asyncio.get_running_loop()
            delays = []
            for i in range(20):
                waiting = asyncio.ensure_future(
                    brokers[1].retrieve(get_command("q/t=5000"), Session())
                )
                await asyncio.sleep(0.01)
                sent = loop.time()
                await brokers[0].store(store_command("q", f"{i}".encode()))
                hits = await waiting
                delays.append(loop.time() - sent)
                assert [m.body for _, m in hits] == [f"{i}".encode()]
            return delays

        delays = self.run(data_dir, body)
        assert max(delays) < WAKE_BOUND

    def test_dead_letters_moved_once_when_two_daemons_reclaim(self, data_dir: Path) -> None:
        count = 40

        async def body(brokers: list[Broker]) -> None:
            dead = self.make_instance(data_dir, 9)
            dead.owner = "daemon-9"
            await dead.open()
            sync = brokers[0].settings("q").sync
            for i in range(count):
                await brokers[0].store(store_command("q", f"{i}".encode()))
                assert await dead.reserve("q", lease=0.1, sync=sync)
            await dead.close()
            await asyncio.sleep(0.15)
            # Two daemons reclaim at once (their periodic reclaims may join in).
            moved = await asyncio.gather(brokers[1].reclaim(), brokers[2].reclaim())
            dlq = await brokers[0].size("q_dead")
            queue = await brokers[0].size("q")
            assert dlq is not None and dlq.items == count
            assert queue is not None and queue.items == 0
            assert sum(moved) <= count  # the periodic reclaim may have taken some

        self.run(data_dir, body, max_deliveries=1, visibility_timeout=30)

    def test_fanout_child_made_on_one_daemon_gets_sets_on_another(self, data_dir: Path) -> None:
        async def body(brokers: list[Broker]) -> None:
            a, b = brokers[0], brokers[1]
            await a.store(store_command("q", b"before"))
            assert await b.retrieve(get_command("q+audit"), Session()) == []  # made here
            for text in (b"1", b"2"):
                await a.store(store_command("q", text))
            got = [
                m.body for _, m in await b.retrieve(get_command("q+audit", "q+audit"), Session())
            ]
            assert got == [b"1", b"2"]
            session = Session()
            hits = await b.retrieve(get_command("q+audit/open"), session)
            assert hits == []
            await a.store(store_command("q", b"3"))
            hits = await b.retrieve(get_command("q+audit/open"), session)
            assert [m.body for _, m in hits] == [b"3"]
            # Open/close on the child does not touch the parent.
            await b.retrieve(get_command("q+audit/close"), session)
            parent = await a.size("q")
            assert parent is not None and (parent.items, parent.open) == (4, 0)

        self.run(data_dir, body)

    def test_two_redrives_at_once_move_each_dead_letter_once(self, data_dir: Path) -> None:
        count = 1000

        async def body(brokers: list[Broker]) -> None:
            a = brokers[0]
            backend = a.backend
            sync = a.settings("q").sync
            for i in range(count):
                await a.store(store_command("q", f"{i}".encode()))
                m = await backend.reserve("q", lease=0, sync=sync)
                assert m is not None and m.receipt is not None
                assert await backend.release(m.receipt, sync=sync, to="q_dead")
            moved = await asyncio.gather(
                *(b.redrive("q_dead", 100) for b in brokers[1:] for _ in range(10))
            )
            assert sum(moved) == count
            dead = await a.size("q_dead")
            assert dead is not None and dead.items == 0
            got: Counter[bytes] = Counter()
            while hits := await a.retrieve(get_command("q"), Session()):
                assert hits[0][1].deliveries == 1
                got[hits[0][1].body] += 1
            assert got == Counter(f"{i}".encode() for i in range(count))

        self.run(data_dir, body)
