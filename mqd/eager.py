"""Coroutines run at once up to their first real wait: Python 3.12's eager tasks, on 3.11.

Most of what a connection does never waits (the memory backend, a get that
finds a message), and creating a task for each costs more than the work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from functools import partial
from typing import Any, Final, TypeVar

T = TypeVar("T")


#: What first_wait() gives for a coroutine that ended without waiting.
FINISHED: Final = object()


def first_wait(coro: Coroutine[Any, Any, None]) -> Any:
    """Run `coro` now up to its first wait: what it waits on, or FINISHED if it ended.

    By next() on its iterator rather than send(): the end of a coroutine is
    then no StopIteration to catch, which in compiled code (a traceback
    entry made for each) costs more than a command.
    """
    return next(coro.__await__(), FINISHED)


def run_eagerly(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
    """Run `coro` now until it first waits, then as a task; None if it never waited."""
    waiting_on = first_wait(coro)
    if waiting_on is FINISHED:
        return None
    return asyncio.get_running_loop().create_task(finish(coro, waiting_on))


async def finish(step: Coroutine[Any, Any, T], waiting_on: Any) -> T:
    """Drive a coroutine that was started by hand and suspended on `waiting_on`.

    It does for one coroutine what asyncio.Task does: wait for the future it
    yielded, then resume it, until it returns. A cancellation of the task
    running this cancels the future being waited on, as Task.cancel does.
    """
    while True:
        if waiting_on is None:
            await asyncio.sleep(0)  # a bare yield: give the loop one turn
        else:
            # As Task does: the flag a future sets when it is yielded by an
            # await must be cleared before the future is awaited again.
            waiting_on._asyncio_future_blocking = False
            try:
                await waiting_on
            except asyncio.CancelledError:
                if not waiting_on.done():
                    waiting_on.cancel()
            except BaseException:
                pass  # the coroutine gets the future's exception when it resumes
        try:
            waiting_on = step.send(None)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]


class Together:
    """Coroutines run at once and driven to their ends without a task each.

    A pipeline's sets and gets on a backend that commits in groups all wait
    on futures the same storage round answers. A task per command (a Task, a
    `finish` frame, and the connection woken once per command) costs more
    than the command itself there; here each suspended coroutine is resumed
    straight from its future's done callback, and whoever waits for the group
    is woken once, when the last one returns.
    """

    __slots__ = ("_done", "_left", "_loop", "_waiting", "results", "waited")

    def __init__(self) -> None:
        self.results: list[Any] = []  # each coroutine's result (or exception), in order
        self.waited = False  # whether any of them had to wait
        self._left = 0  # coroutines still running
        self._done: asyncio.Future[None] | None = None
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._loop = asyncio.get_running_loop()

    def start(self, coro: Coroutine[Any, Any, Any]) -> bool:
        """Run `coro` now up to its first wait; its result lands in `results`.

        True if it ended without waiting.
        """
        index = len(self.results)
        self.results.append(None)
        left = self._left
        self._left = left + 1
        self._step(coro, index)
        return self._left == left

    async def wait(self) -> list[Any]:
        """Every result, in the order started; cancelling this cancels what still runs."""
        if self._left:
            self._done = self._loop.create_future()
            try:
                await self._done
            except asyncio.CancelledError:
                for future in list(self._waiting.values()):
                    future.cancel()  # as Task.cancel: each coroutine sees CancelledError
                raise
        return self.results

    def _step(self, coro: Coroutine[Any, Any, Any], index: int, _: object = None) -> None:
        self._waiting.pop(index, None)
        try:
            # A future's __await__ returns its result (or raises its error,
            # CancelledError included) once resumed: send(None) suits all.
            waiting_on = coro.send(None)
        except BaseException as exc:
            self.results[index] = exc.value if isinstance(exc, StopIteration) else exc
            self._left -= 1
            done = self._done
            if not self._left and done is not None and not done.done():
                done.set_result(None)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return
        self.waited = True
        if waiting_on is None:  # a bare yield: one turn of the loop
            self._loop.call_soon(self._step, coro, index)
            return
        waiting_on._asyncio_future_blocking = False
        self._waiting[index] = waiting_on
        waiting_on.add_done_callback(partial(self._step, coro, index))


async def run_together(calls: Iterable[Coroutine[Any, Any, T]]) -> list[T | BaseException]:
    """Each of `calls` run at once, in order, up to its first wait: their results or errors.

    A store that groups work arriving together (a group commit, a batch
    round trip) so serves them in one group, in the order they were made.
    """
    group = Together()
    for call in calls:
        group.start(call)
    return await group.wait()
