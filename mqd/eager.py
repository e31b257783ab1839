"""Coroutines run at once up to their first real wait: Python 3.12's eager tasks, on 3.11.

Most of what a connection does never waits (the memory backend, a get that
finds a message), and creating a task for each costs more than the work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_eagerly(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
    """Run `coro` now until it first waits, then as a task; None if it never waited."""
    try:
        waiting_on = coro.send(None)
    except StopIteration:
        return None
    return asyncio.get_running_loop().create_task(finish(coro, waiting_on))


def start(coro: Coroutine[Any, Any, T]) -> tuple[bool, Any]:
    """Run `coro` now until it first waits: (True, its result) or (False, a task finishing it).

    No tuple of futures: a command that never waits (most, on the memory
    backend) costs no allocation beyond the tuple.
    """
    try:
        waiting_on = coro.send(None)
    except StopIteration as stop:
        return True, stop.value
    return False, asyncio.get_running_loop().create_task(finish(coro, waiting_on))


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
