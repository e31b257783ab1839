"""Sync modes: group commit for ALWAYS, timed flushes for PERIODIC, none for NONE."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from bdb_helpers import NAMES, make, put

from mqd.backend import Sync


@pytest.mark.parametrize("name", NAMES)
def test_concurrent_always_puts_share_flushes(name: str, tmp_path: Path) -> None:
    producers, each = 16, 50

    async def main() -> None:
        b = make(name, tmp_path)
        await b.open()
        try:

            async def producer(p: int) -> None:
                for i in range(each):
                    assert await put(b, f"q{p % 4}", b"%d-%d" % (p, i)) is not None

            await asyncio.gather(*(producer(p) for p in range(producers)))
            flushes = b.worker.flushes
            # Every put waited for a flush, yet they shared them.
            assert 0 < flushes <= producers * each / 5, flushes
            assert b.worker.batches <= producers * each / 5
            sizes = [await b.size(f"q{q}") for q in range(4)]
            assert sum(s.items for s in sizes if s) == producers * each
        finally:
            await b.close()

    asyncio.run(main())


@pytest.mark.parametrize("name", NAMES)
def test_periodic_flushes_on_time_and_none_never(name: str, tmp_path: Path) -> None:
    async def main() -> None:
        b = make(name, tmp_path, sync_interval_ms=100)
        await b.open()
        try:
            for i in range(20):
                await put(b, "none", b"%d" % i, sync=Sync.NONE)
            await asyncio.sleep(0.3)
            assert b.worker.flushes == 0
            for i in range(20):
                await put(b, "periodic", b"%d" % i, sync=Sync.PERIODIC)
            assert b.worker.flushes == 0  # not yet: within the interval
            await asyncio.sleep(0.4)
            assert b.worker.flushes == 1  # one flush for all of them
            await put(b, "always", b"x", sync=Sync.ALWAYS)
            assert b.worker.flushes == 2
        finally:
            await b.close()

    asyncio.run(main())


@pytest.mark.parametrize("name", NAMES)
def test_cancelled_take_gives_the_message_back(name: str, tmp_path: Path) -> None:
    async def main() -> None:
        b = make(name, tmp_path)
        await b.open()
        try:
            await put(b, "q", b"precious")
            task: asyncio.Future[object]
            for op in ("take", "reserve", "reserve_many"):
                if op == "take":
                    task = asyncio.ensure_future(b.take("q", sync=Sync.ALWAYS))
                elif op == "reserve":
                    task = asyncio.ensure_future(b.reserve("q", lease=0, sync=Sync.ALWAYS))
                else:
                    task = asyncio.ensure_future(b.reserve_many("q", 5, lease=0, sync=Sync.ALWAYS))
                await asyncio.sleep(0)  # the job is submitted
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                for _ in range(100):
                    await asyncio.sleep(0.01)
                    size = await b.size("q")
                    if size is not None and size.items == 1 and size.open == 0:
                        break
                size = await b.size("q")
                assert size is not None and (size.items, size.open) == (1, 0)
            m = await b.take("q", sync=Sync.ALWAYS)
            assert m is not None and m.body == b"precious"
            assert m.deliveries == 3  # the cancelled take is not counted; the reserves were
        finally:
            await b.close()

    asyncio.run(main())
