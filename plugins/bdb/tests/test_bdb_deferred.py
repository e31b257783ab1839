"""Puts taken within their own batch (mqd_bdb.deferred): the same outcome as one by one."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from bdb_helpers import ALWAYS, FIFO_NAMES, drain, put, session
from mqd_bdb.backend import _BdbBackend

from mqd.backend import Fanout, Limits, Message, Put

Call = Callable[[_BdbBackend], Awaitable[Any]]


def _put(queue: str, body: bytes, created: float, unique: bool = False) -> Call:
    async def call(b: _BdbBackend) -> Any:
        message = Message(body, flags=len(body), created=created)
        stored = await b.put(queue, message, sync=ALWAYS, unique=unique)
        return stored.name, message.offset if stored is Put.STORED else None

    return call


def _take(queue: str) -> Call:
    async def call(b: _BdbBackend) -> Any:
        m = await b.take(queue, sync=ALWAYS)
        return None if m is None else (m.body, m.offset, m.flags, m.created, m.deliveries)

    return call


def _peek(queue: str) -> Call:
    async def call(b: _BdbBackend) -> Any:
        m = await b.peek(queue)
        return None if m is None else (m.body, m.offset)

    return call


def _read_at(queue: str, offset: int) -> Call:
    async def call(b: _BdbBackend) -> Any:
        m = await b.read_at(queue, offset)
        return None if m is None else (m.body, m.offset)

    return call


async def in_one_batch(b: _BdbBackend, calls: list[Call]) -> list[Any]:
    """Run `calls` in one transaction: a batch of the worker thread's, or a round on the loop.

    They are made in one turn of the loop, so they are one bundle.
    """
    before = b.worker.batches + b.worker.rounds
    results = await asyncio.gather(*(call(b) for call in calls))
    assert b.worker.batches + b.worker.rounds == before + 1
    return results


def script(seed: int) -> list[Call]:
    """Puts and takes on two queues, with a few reads, unique puts and puts of a new queue."""
    rng = random.Random(seed)
    calls: list[Call] = []
    for i in range(300):
        queue = rng.choice("aab")
        roll = rng.random()
        if roll < 0.45:
            calls.append(_put(queue, b"%s%d" % (queue.encode(), i), float(i)))
        elif roll < 0.9:
            calls.append(_take(queue))
        elif roll < 0.93:
            calls.append(_peek(queue))
        elif roll < 0.96:
            calls.append(_read_at(queue, rng.randrange(i // 2 + 1)))
        else:
            calls.append(_put(queue, b"%s%d" % (queue.encode(), i - 3), float(i), True))
    calls.append(_put(f"c{seed}", b"new", 1.0))
    return calls


async def _state(b: _BdbBackend) -> Any:
    return {q: await b.size(q) for q in sorted(await b.queues())}


@pytest.mark.parametrize("name", FIFO_NAMES)
@pytest.mark.parametrize("seed", [1, 2])
def test_one_batch_gives_what_one_by_one_gives(name: str, seed: int, tmp_path: Path) -> None:
    """Offsets, FIFO order, gauges, and what a restart finds, batched or not."""
    calls = script(seed)

    async def backlog(b: _BdbBackend) -> None:
        for i in range(3):  # older messages on disk, handed out before any new one
            await put(b, "a", b"old%d" % i)

    async def batched(b: _BdbBackend) -> Any:
        await backlog(b)
        paired = b.worker.store.paired
        results = await in_one_batch(b, calls)
        assert b.worker.store.paired > paired + 20
        return results, await _state(b)

    async def one_by_one(b: _BdbBackend) -> Any:
        await backlog(b)
        results = [await call(b) for call in calls]
        assert b.worker.store.paired == 0
        return results, await _state(b)

    together, apart = tmp_path / "together", tmp_path / "apart"
    assert session(name, together, batched) == session(name, apart, one_by_one)

    async def after_restart(b: _BdbBackend) -> Any:
        state = await _state(b)
        left = {q: [(m.body, m.offset) for m in await drain(b, q)] for q in await b.queues()}
        return state, left, await put(b, "a", b"next")

    assert session(name, together, after_restart) == session(name, apart, after_restart)


def _delete(queue: str) -> Call:
    async def call(b: _BdbBackend) -> Any:
        return await b.delete(queue, sync=ALWAYS)

    return call


@pytest.mark.parametrize("name", FIFO_NAMES)
def test_a_queue_deleted_and_made_again_in_the_batch_of_a_pair(name: str, tmp_path: Path) -> None:
    """A put and its take, the queue deleted, then put to again: all in one batch, as one by one.

    The pair leaves the queue's entry of deferred puts empty; the put after
    the delete must go to the queue made anew, not to the one deleted.
    """
    calls = [
        _peek("other"),  # not a quick job: the whole bundle goes to the worker thread
        _put("q", b"a", 1.0),
        _take("q"),
        _delete("q"),
        _put("q", b"b", 2.0),
        _put("q", b"c", 3.0),
        _take("q"),
    ]

    async def batched(b: _BdbBackend) -> Any:
        return await in_one_batch(b, calls), await _state(b)

    async def one_by_one(b: _BdbBackend) -> Any:
        return [await call(b) for call in calls], await _state(b)

    together, apart = tmp_path / "together", tmp_path / "apart"
    assert session(name, together, batched) == session(name, apart, one_by_one)

    async def after_restart(b: _BdbBackend) -> Any:
        return await _state(b), [(m.body, m.offset) for m in await drain(b, "q")]

    left = session(name, together, after_restart)
    assert left == session(name, apart, after_restart)
    assert [body for body, _ in left[1]] == [b"c"]


@pytest.mark.parametrize("name", FIFO_NAMES)
def test_paired_take_does_not_come_back_after_a_restart(name: str, tmp_path: Path) -> None:
    async def body(b: _BdbBackend) -> None:
        calls = [_put("q", b"m%d" % i, 0.0) if i % 2 == 0 else _take("q") for i in range(20)]
        results = await in_one_batch(b, calls)
        bodies = [b"m%d" % i for i in range(0, 20, 2)]
        assert results[1::2] == [(m, i, len(m), 0.0, 1) for i, m in enumerate(bodies)]
        assert b.worker.store.paired == 10
        size = await b.size("q")
        assert size is not None and (size.items, size.bytes) == (0, 0)

    session(name, tmp_path, body)

    async def after(b: _BdbBackend) -> None:
        assert await b.take("q", sync=ALWAYS) is None
        assert await put(b, "q", b"next") == 10  # offsets handed out are not reused

    session(name, tmp_path, after)


CHILD = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from pathlib import Path
    from mqd.backend import Message, StorageOptions, Sync
    from mqd_bdb.backend import BdbBackend, BdbSingleBackend

    classes = {"bdb": BdbBackend, "bdb-single": BdbSingleBackend}

    async def main():
        b = classes[sys.argv[1]](StorageOptions(data_dir=Path(sys.argv[2])))
        await b.open()
        await b.put("q", Message(b"old"), sync=Sync.ALWAYS)
        calls = []
        for i in range(10):
            calls.append(b.put("q", Message(b"new%d" % i), sync=Sync.ALWAYS))
            calls.append(b.take("q", sync=Sync.ALWAYS))
        results = await asyncio.gather(*calls)
        print(b.worker.store.paired, *(m.body.decode() for m in results[1::2]), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("name", FIFO_NAMES)
def test_sigkill_after_a_paired_batch_brings_back_only_what_waits(
    name: str, tmp_path: Path
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, name, str(tmp_path)], capture_output=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    paired, *taken = proc.stdout.decode().split()
    assert int(paired) == 9  # the first take got the message on disk
    assert taken == ["old", *(f"new{i}" for i in range(9))]

    async def check(b: _BdbBackend) -> None:
        size = await b.size("q")
        assert size is not None and (size.items, size.bytes) == (1, 4)
        assert [(m.body, m.offset) for m in await drain(b, "q")] == [(b"new9", 10)]
        assert await put(b, "q", b"next") == 11

    session(name, tmp_path, check)


@pytest.mark.parametrize("name", FIFO_NAMES)
def test_deferred_put_read_in_its_own_batch(name: str, tmp_path: Path) -> None:
    async def body(b: _BdbBackend) -> None:
        calls = [
            _put("q", b"one", 1.0),
            _read_at("q", 0),
            _put("q", b"two", 2.0),
            _peek("q"),
            _put("q", b"three", 3.0),
            _put("q", b"two", 4.0, unique=True),  # counts what was deferred
            _take("q"),
            _take("q"),
            _put("q", b"four", 5.0),
            _take("q"),  # the head on disk, before the deferred put
        ]
        assert await in_one_batch(b, calls) == [
            ("STORED", 0),
            (b"one", 0),
            ("STORED", 1),
            (b"one", 0),
            ("STORED", 2),
            ("DUPLICATE", None),
            (b"one", 0, 3, 1.0, 1),
            (b"two", 1, 3, 2.0, 1),
            ("STORED", 3),
            (b"three", 2, 5, 3.0, 1),
        ]
        size = await b.size("q")
        assert size is not None and (size.items, size.bytes, size.head_created) == (1, 4, 5.0)

    session(name, tmp_path, body)

    async def after(b: _BdbBackend) -> None:
        assert await b.contains("q", b"four") and not await b.contains("q", b"two")
        assert [(m.body, m.offset) for m in await drain(b, "q")] == [(b"four", 3)]

    session(name, tmp_path, after)


@pytest.mark.parametrize("name", FIFO_NAMES)
def test_a_batch_whose_puts_are_all_its_queue_holds_makes_the_oldest_the_head(
    name: str, tmp_path: Path
) -> None:
    """A steady load over a queue with a message waiting: each batch takes it
    from disk and writes its last puts, which are then the head. Where a
    message is open behind the one taken, the open one becomes the head."""

    async def body(b: _BdbBackend) -> None:
        for queue in ("q", "r"):
            await b.put(queue, Message(b"old", created=1.0), sync=ALWAYS)
        # r: "old" waits again at the head, "later" stays open behind it.
        await b.put("r", Message(b"later", created=1.5), sync=ALWAYS)
        first = await b.reserve("r", lease=60.0, sync=ALWAYS)
        assert await b.reserve("r", lease=60.0, sync=ALWAYS) is not None
        assert first is not None and first.receipt is not None
        assert await b.release(first.receipt, sync=ALWAYS)
        calls = [
            call
            for queue in ("q", "r")
            for call in (
                _put(queue, b"a", 2.0),
                _take(queue),  # "old", from disk: the head is gone
                _put(queue, b"b", 3.0),
                _put(queue, b"c", 4.0),
                _take(queue),  # "a", never written
            )
        ]
        results = await in_one_batch(b, calls)
        assert [r[0] for r in results[1::5] + results[4::5]] == [b"old", b"old", b"a", b"a"]
        sizes = {queue: await b.size(queue) for queue in ("q", "r")}
        assert {q: (s.items, s.open, s.head_created) for q, s in sizes.items() if s} == {
            "q": (2, 0, 3.0),
            "r": (3, 1, 1.5),
        }

    session(name, tmp_path, body)

    async def after(b: _BdbBackend) -> None:
        size = await b.size("q")
        assert size is not None and (size.items, size.head_created) == (2, 3.0)
        assert [(m.body, m.created) for m in await drain(b, "q")] == [(b"b", 3.0), (b"c", 4.0)]

    session(name, tmp_path, after)


@pytest.mark.parametrize("name", FIFO_NAMES)
def test_fanout_copies_taken_in_their_batch(name: str, tmp_path: Path) -> None:
    """A parent's put is written; its children's copies pair like plain puts."""

    def limits(child: str) -> Limits:
        return Limits(max_items=1) if child == "p+one" else Limits()

    def fan(body: bytes) -> Call:
        async def call(b: _BdbBackend) -> Any:
            return (await b.put("p", Message(body), sync=ALWAYS, fanout=Fanout(limits))).name

        return call

    async def body(b: _BdbBackend) -> None:
        for child in ("p+all", "p+one"):
            assert await b.create(child, sync=ALWAYS) is True
        calls = [fan(b"m0"), _take("p+all"), fan(b"m1"), _take("p+one"), fan(b"m2")]
        assert await in_one_batch(b, calls) == [
            "STORED",
            (b"m0", 0, 0, 0.0, 1),
            "STORED",
            (b"m0", 0, 0, 0.0, 1),
            "STORED",
        ]
        assert b.worker.store.paired == 1  # p+one's copy was bounded: written, then taken
        sizes = [await b.size(q) for q in ("p", "p+all", "p+one")]
        assert [s.items if s else None for s in sizes] == [3, 2, 1]

    session(name, tmp_path, body)

    async def after(b: _BdbBackend) -> None:
        got = {q: [(m.body, m.offset) for m in await drain(b, q)] for q in await b.queues()}
        assert got == {
            "p": [(b"m0", 0), (b"m1", 1), (b"m2", 2)],
            "p+all": [(b"m1", 1), (b"m2", 2)],
            "p+one": [(b"m2", 1)],  # m1 found it full
        }

    session(name, tmp_path, after)
