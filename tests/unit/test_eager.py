"""eager.Together: coroutines driven from their futures' callbacks, results in order."""

from __future__ import annotations

import asyncio

import pytest

from mqd.eager import Together


async def _answer(future: asyncio.Future[int], add: int) -> int:
    return await future + add


async def _now(value: int) -> int:
    return value


async def _fails() -> int:
    raise ValueError("bad")


async def _twice(first: asyncio.Future[int], second: asyncio.Future[int]) -> int:
    await asyncio.sleep(0)  # a bare yield between the waits
    return await first + await second


def test_results_come_in_the_order_started_whatever_order_they_finish_in() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        late, early, a, b = (loop.create_future() for _ in range(4))
        group = Together()
        group.start(_answer(late, 1))
        group.start(_now(7))
        group.start(_answer(early, 2))
        group.start(_fails())
        group.start(_twice(a, b))
        assert group.waited
        loop.call_soon(early.set_result, 10)
        loop.call_later(0.01, late.set_result, 20)
        loop.call_soon(a.set_result, 100)
        loop.call_later(0.005, b.set_result, 200)
        results = await group.wait()
        assert results[:3] == [21, 7, 12]
        assert isinstance(results[3], ValueError)
        assert results[4] == 300

    asyncio.run(main())


def test_a_group_that_never_waits_is_done_at_once() -> None:
    async def main() -> None:
        group = Together()
        for value in range(3):
            group.start(_now(value))
        assert not group.waited
        assert await group.wait() == [0, 1, 2]

    asyncio.run(main())


def test_cancelling_the_wait_cancels_what_still_runs() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        pending: asyncio.Future[int] = loop.create_future()
        group = Together()
        group.start(_now(1))
        group.start(_answer(pending, 1))
        waiter = asyncio.ensure_future(group.wait())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        # The future a command waited on is cancelled, as Task.cancel does,
        # so the command sees CancelledError (a backend gives back what it took).
        assert pending.cancelled()
        await asyncio.sleep(0)
        assert isinstance(group.results[1], asyncio.CancelledError)

    asyncio.run(main())
