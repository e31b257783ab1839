"""Sync modes: group commit for ALWAYS, timed flushes for PERIODIC, none for NONE."""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from bdb_helpers import ALWAYS, FIFO_NAMES, NAMES, drain, make, put, session
from berkeleydb import db
from mqd_bdb.backend import _BdbBackend

from mqd.backend import LATER, NO_LIMITS, Message, Pending, Put, Sync
from mqd.config import Config
from mqd.connection import Connection
from mqd.errors import StorageError
from mqd.server import Server


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
                # The cancel does not withdraw a job the store has: it may run
                # later (a loaded machine's worker thread), and give back what
                # it took only then, while the gauges still show the message
                # waiting. A put made now is answered after it, by which time
                # the give-back is on its way.
                await put(b, "after", b"x")
                for _ in range(100):
                    await asyncio.sleep(0.01)
                    size = await b.size("q")
                    if size is not None and size.items == 1 and size.open == 0:
                        break
                size = await b.size("q")
                assert size is not None and (size.items, size.open) == (1, 0)
            m = await b.take("q", sync=Sync.ALWAYS)
            assert m is not None and m.body == b"precious"
            # The cancelled take is not counted. A reserve is when its job ran
            # before the cancel came (the message then went out and came back),
            # not when the cancel withdrew the job first: which, depends on how
            # soon the worker thread ran it.
            assert 1 <= m.deliveries <= 3
        finally:
            await b.close()

    asyncio.run(main())


async def put_and_settle(b: _BdbBackend, body: bytes) -> None:
    """Put `body` in q (its files then exist: its puts are quick); wait till the store is free."""
    await put(b, "q", body)
    await settle(b)


async def settle(b: _BdbBackend) -> None:
    """Wait till the worker thread neither holds nor wants the store, and has nothing to do.

    Then the next held job opens a round on the loop. A round that emptied a
    queue can set the thread to housekeeping (Store.upkeep_due), which a slow
    machine reaches in the middle of a test.
    """
    w = b.worker
    while w.lock.locked() or w._wants_store or w._ready or not w.inbox.empty():
        await asyncio.sleep(0.001)


#: Numbers the releases of every Holder, in the order they come.
RELEASES = itertools.count()


class Holder:
    """A caller that holds its replies: when its Pending ended, and how."""

    def __init__(self, backend: _BdbBackend) -> None:
        self.backend = backend
        self.pendings: list[Pending] = []
        # (error, flushes by then, its place among all holders' releases)
        self.ended: list[tuple[BaseException | None, int, int]] = []

    def hold(self, pending: Pending) -> None:
        if pending not in self.pendings:
            self.pendings.append(pending)
            pending.add(self._ended)

    def _ended(self, error: BaseException | None) -> None:
        self.ended.append((error, self.backend.worker.flushes, next(RELEASES)))

    async def released(self) -> BaseException | None:
        while len(self.ended) < len(self.pendings):
            await asyncio.sleep(0.001)
        return self.ended[-1][0]


def put_held(b: _BdbBackend, holder: Holder, body: bytes, queue: str = "q") -> None:
    """A plain put on the broker's path of held sets (put_now), answered at once."""
    stored = b.put_now(queue, Message(body), ALWAYS, False, NO_LIMITS, None, holder)
    assert stored is Put.STORED


def take_held(b: _BdbBackend, holder: Holder, queue: str) -> bytes | None:
    """A plain take on the broker's path of held gets (take_now): the body it took."""
    taken = b.take_now(queue, ALWAYS, holder)
    assert taken is not LATER
    return None if taken is None else taken.body


async def make_empty(b: _BdbBackend, *queues: str) -> None:
    """Make `queues`, empty but with their files: held sets and gets of them run in rounds."""
    for queue in queues:
        await put(b, queue, b"made")
        await drain(b, queue)
    await settle(b)


#: Where a round's sync runs, and the keys that put it there: by Linux AIO; on
#: the event loop (a loop_sync_max_us so high that it does however slow this
#: disk); on the sync thread.
SYNC_PATHS: dict[str, dict[str, Any]] = {
    "aio": {"aio_sync": True},
    "on-loop": {"aio_sync": False, "loop_sync_max_us": 1_000_000},
    "on-thread": {"aio_sync": False, "loop_sync_max_us": 0},
}
EACH_PATH = pytest.mark.parametrize("where", list(SYNC_PATHS))


def sync_session(
    name: str,
    tmp_path: Path,
    where: str,
    body: Callable[[_BdbBackend], Awaitable[None]],
    **extra: Any,
) -> None:
    """session() with a round's syncs run `where` (skipped where Linux AIO is not offered)."""

    async def checked(b: _BdbBackend) -> None:
        if where == "aio" and b.worker._aio is None:
            pytest.skip("the kernel offers no Linux AIO here")
        await body(b)

    session(name, tmp_path, checked, **SYNC_PATHS[where], **extra)


@EACH_PATH
@pytest.mark.parametrize("name", NAMES)
def test_held_answers_come_at_once_and_are_released_after_their_sync(
    name: str, where: str, tmp_path: Path
) -> None:
    async def body(b: _BdbBackend) -> None:
        await put_and_settle(b, b"first")
        holder = Holder(b)
        flushes = b.worker.flushes
        # Both answered in this turn, without waiting: one round, not yet synced.
        taken = await b.take("q", sync=ALWAYS, holder=holder)
        assert taken is not None and taken.body == b"first"
        assert await b.put("q", Message(b"second"), sync=ALWAYS, holder=holder) is Put.STORED
        assert len(holder.pendings) == 1 and not holder.ended
        assert await holder.released() is None
        assert holder.ended[0][1] > flushes  # released once a sync covered the round
        assert b.worker.rounds >= 1
        assert (b.worker.aio_flushes > 0) == (where == "aio")
        assert (b.worker.loop_flushes > 0) == (where == "on-loop")
        # The same without a coroutine each (the broker's path of held sets and gets).
        holder = Holder(b)
        now = b.take_now("q", ALWAYS, holder)
        assert isinstance(now, Message) and now.body == b"second"
        put_held(b, holder, b"third")
        assert len(holder.pendings) == 1 and not holder.ended
        assert await holder.released() is None
        assert [m.body for m in await drain(b, "q")] == [b"third"]

    sync_session(name, tmp_path, where, body)


@EACH_PATH
@pytest.mark.parametrize("name", NAMES)
def test_gauges_asked_behind_held_answers_count_what_those_did(
    name: str, where: str, tmp_path: Path
) -> None:
    """size(), sizes() and queues() asked after a held put, before its round is
    answered (and its gauges published), count that put all the same."""

    async def body(b: _BdbBackend) -> None:
        await make_empty(b, "q")
        holder = Holder(b)
        put_held(b, holder, b"one")  # in this turn's round, not yet committed
        assert [s.items for s in (await b.sizes()).values()] == [1]
        assert await b.queues() == ["q"]
        # In a round of its own, or on the thread while that holds the store.
        assert await b.put("q", Message(b"two"), sync=ALWAYS, holder=holder) is Put.STORED
        await asyncio.sleep(0)  # a round has ended: committed, maybe still syncing
        size = await b.size("q")
        assert size is not None and size.items == 2
        assert await holder.released() is None
        assert [m.body for m in await drain(b, "q")] == [b"one", b"two"]

    sync_session(name, tmp_path, where, body)


@pytest.mark.parametrize("name", NAMES)
def test_a_round_answered_after_a_later_delete_does_not_bring_the_queue_back(
    name: str, tmp_path: Path
) -> None:
    """Gauges go out in the order of the commits, not of the answers.

    A round's gauges go out with its answers, after its sync; a delete the
    thread commits after that round, needing no sync, is answered first.
    The round's gauges must not then put the deleted queue back in `stats`.
    """

    async def body(b: _BdbBackend) -> None:
        await make_empty(b, "q")
        await put(b, "q", b"one")
        await put(b, "q", b"two")
        await settle(b)
        holder = Holder(b)
        with b.worker._env_lock:  # the sync thread's flush waits
            assert take_held(b, holder, "q") == b"one"
            await asyncio.sleep(0)  # the round commits; its sync is asked for
            assert await b.delete("q", sync=Sync.NONE) is True  # the thread, no sync
            assert await b.size("q") is None
        assert await holder.released() is None
        assert "q" not in await b.sizes()
        assert await b.size("q") is None

    sync_session(name, tmp_path, "on-thread", body)


@EACH_PATH
@pytest.mark.parametrize("name", FIFO_NAMES)
def test_a_round_whose_puts_it_took_itself_answers_without_a_sync(
    name: str, where: str, tmp_path: Path
) -> None:
    # Nothing of such a round is on disk to sync: no STORED message can be
    # missing after a crash, and no taken one come back; nor of a take that
    # found the queue empty. A put left over is written, and its round
    # answered only after a sync.
    async def body(b: _BdbBackend) -> None:
        await put_and_settle(b, b"first")
        await drain(b, "q")
        await settle(b)
        flushes = b.worker.flushes
        holder = Holder(b)
        assert b.take_now("q", ALWAYS, holder) is None  # a take that finds nothing: no write
        for i in range(5):
            put_held(b, holder, b"m%d" % i)
            taken = b.take_now("q", ALWAYS, holder)
            assert isinstance(taken, Message) and taken.body == b"m%d" % i
        assert len(holder.pendings) == 1
        assert await holder.released() is None
        assert holder.ended[0][1] == flushes  # released with no sync at all
        put_held(b, holder, b"m5")
        taken = b.take_now("q", ALWAYS, holder)
        assert isinstance(taken, Message) and taken.body == b"m5"
        put_held(b, holder, b"kept")
        assert len(holder.pendings) == 2
        assert await holder.released() is None
        assert holder.ended[1][1] > flushes
        assert [(m.body, m.offset) for m in await drain(b, "q")] == [(b"kept", 7)]

    sync_session(name, tmp_path, where, body)


@EACH_PATH
@pytest.mark.parametrize("name", NAMES)
def test_holders_the_sync_keeps_nothing_of_are_answered_before_it(
    name: str, where: str, tmp_path: Path
) -> None:
    # In a round that must be synced, a connection whose jobs left the
    # message records of their queues as they were (each set taken in the
    # round, each get taking one of those or finding nothing) is answered as
    # the sync starts, not once it ends. Not one that shares a queue with a
    # connection that waits: what one stored may be what the other took.
    # Where the loop syncs the round itself, and with bdb-random (whose
    # takes are not paired with the round's puts), all are answered together.
    async def body(b: _BdbBackend) -> None:
        await make_empty(b, "p", "s")
        await put_and_settle(b, b"first")
        flushes = b.worker.flushes
        backlog, paired, shared = Holder(b), Holder(b), Holder(b)
        assert take_held(b, backlog, "q") == b"first"
        put_held(b, backlog, b"kept")
        assert take_held(b, paired, "p") is None
        for i in range(3):
            put_held(b, paired, b"p%d" % i, "p")
            assert take_held(b, paired, "p") == b"p%d" % i
        put_held(b, shared, b"s0", "s")
        assert take_held(b, backlog, "s") == b"s0"
        for holder in (backlog, paired, shared):
            assert await holder.released() is None
        (_, synced, after), (_, with_shared, _) = backlog.ended[0], shared.ended[0]
        assert synced == with_shared == flushes + 1
        _, first, before = paired.ended[0]
        if where == "on-loop" or name == "bdb-random":
            assert first == synced and not b.worker.early
        else:
            assert first == flushes and before < after and b.worker.early == 1
        for queue, left in (("q", [b"kept"]), ("p", []), ("s", [])):
            assert [m.body for m in await drain(b, queue)] == left

    sync_session(name, tmp_path, where, body)


class _CountingPuts:
    """A Berkeley DB handle that counts the calls of its `put`."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self.puts = 0

    def put(self, *args: Any) -> Any:
        self.puts += 1
        return self._handle.put(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


@pytest.mark.parametrize("name", FIFO_NAMES)
def test_a_round_whose_puts_it_took_itself_leaves_the_catalog_till_close(
    name: str, tmp_path: Path
) -> None:
    # Only the queue's next offset moved, which no held answer shows: its
    # catalog record is not rewritten (the round writes nothing at all), but
    # saved at close, so the next start numbers after every offset handed out.
    async def body(b: _BdbBackend) -> None:
        await make_empty(b, "q")  # "made", offset 0
        store = b.worker.store
        counting = store.cat = _CountingPuts(store.cat)
        try:
            holder = Holder(b)
            for i in range(5):  # offsets 1 to 5
                put_held(b, holder, b"m%d" % i)
                assert take_held(b, holder, "q") == b"m%d" % i
            assert await holder.released() is None
            assert counting.puts == 0
            # A round that writes saves the record as it does every other.
            put_held(b, holder, b"m5")
            assert await holder.released() is None
            assert counting.puts > 0
            assert [(m.body, m.offset) for m in await drain(b, "q")] == [(b"m5", 6)]
            holder = Holder(b)
            put_held(b, holder, b"m6")
            assert take_held(b, holder, "q") == b"m6"
            assert await holder.released() is None
        finally:
            store.cat = counting._handle

    session(name, tmp_path, body)

    async def after(b: _BdbBackend) -> int | None:
        return await put(b, "q", b"next")

    assert session(name, tmp_path, after) == 8


@pytest.mark.parametrize("name", FIFO_NAMES)
def test_puts_behind_a_backlog_are_written_as_the_next_connection_runs(
    name: str, tmp_path: Path
) -> None:
    # A connection's puts to a queue with messages waiting on disk are
    # written as soon as another connection's jobs run, not at the commit:
    # a take reaches them only after one from disk, which the sync covers
    # anyway. Puts to a queue with none waiting stay deferred for the
    # takes of any connection in the round to pair with.
    async def body(b: _BdbBackend) -> None:
        await make_empty(b, "p")
        await put_and_settle(b, b"old")
        store = b.worker.store
        paired = store.paired
        producer, consumer = Holder(b), Holder(b)
        put_held(b, producer, b"new")
        assert take_held(b, consumer, "q") == b"old"
        assert take_held(b, consumer, "q") == b"new"
        assert store.paired == paired  # written, then taken from disk
        put_held(b, producer, b"p0", "p")
        assert take_held(b, consumer, "p") == b"p0"
        assert store.paired == paired + 1
        assert await producer.released() is None and await consumer.released() is None
        assert producer.ended[0][1] == consumer.ended[0][1] > 0  # one round, synced
        assert await drain(b, "q") == [] and await drain(b, "p") == []

    session(name, tmp_path, body)

    async def after(b: _BdbBackend) -> None:
        assert await drain(b, "q") == [] and await drain(b, "p") == []

    session(name, tmp_path, after)


@pytest.mark.parametrize("name", FIFO_NAMES)
def test_a_round_that_needs_no_sync_is_answered_while_one_runs(name: str, tmp_path: Path) -> None:
    # While the sync of a round that wrote runs, a round whose sets were
    # all taken in it commits and is answered at once: nothing of it is on
    # disk to wait for. Not a round with a holder still awaiting that sync,
    # whose answers must keep their order: that one waits for the sync.
    async def body(b: _BdbBackend) -> None:
        await make_empty(b, "p")
        await put_and_settle(b, b"old")
        w = b.worker
        writer, pipeliner = Holder(b), Holder(b)
        with w._env_lock:  # the sync thread's sync cannot end meanwhile
            put_held(b, writer, b"new")  # behind "old": its round is synced
            while not w._syncing:
                await asyncio.sleep(0)
            put_held(b, pipeliner, b"p0", "p")
            assert take_held(b, pipeliner, "p") == b"p0"
            assert await asyncio.wait_for(pipeliner.released(), 10) is None
            assert w.free == 1 and w._syncing and not writer.ended
            put_held(b, writer, b"w0", "p")
            assert take_held(b, writer, "p") == b"w0"
            await asyncio.sleep(0.05)
            assert w.free == 1 and not writer.ended  # its round waits for the sync
        assert await writer.released() is None
        assert len(writer.ended) == 2
        assert pipeliner.ended[0][2] < writer.ended[0][2] < writer.ended[1][2]
        assert [m.body for m in await drain(b, "q")] == [b"old", b"new"]
        assert await drain(b, "p") == []

    session(name, tmp_path, body, **SYNC_PATHS["on-thread"])


@EACH_PATH
@pytest.mark.parametrize("name", NAMES)
def test_a_round_waits_for_the_connections_the_last_sync_answered(
    name: str, where: str, tmp_path: Path
) -> None:
    # One command per round trip, the clients a sync answered each send their
    # next command at once, some turns of the loop apart: the round the first
    # of them opens waits for the rest, so one sync answers them all; and for
    # at most about one sync's duration, should one not come back.
    async def body(b: _BdbBackend) -> None:
        await put_and_settle(b, b"first")
        # Syncs that took half a second, and a wait for clients up to that:
        # long enough for this test's turns of the loop, short enough for the
        # last wait, and under the on-loop path's loop_sync_max_us.
        b.worker._sync_s = b.worker._awaited_max_s = 0.5
        early, late = Holder(b), Holder(b)
        put_held(b, early, b"a1")
        put_held(b, late, b"b1")
        assert await early.released() is None and await late.released() is None
        assert early.ended[0][1] == late.ended[0][1]  # one round, one sync
        put_held(b, early, b"a2")
        for _ in range(20):  # well beyond GATHER_TURNS
            await asyncio.sleep(0)
        assert not early.ended[1:]  # its round still waits for `late`
        put_held(b, late, b"b2")
        assert await early.released() is None and await late.released() is None
        assert early.ended[1][1] == late.ended[1][1]  # released by the same sync
        # `late` does not come back this time: the wait ends on its own.
        put_held(b, early, b"a3")
        assert await asyncio.wait_for(early.released(), 10) is None
        assert len(late.pendings) == 2
        bodies = [b"first", b"a1", b"b1", b"a2", b"b2", b"a3"]
        # Sorted: bdb-random hands them out in any order.
        assert sorted(m.body for m in await drain(b, "q")) == sorted(bodies)

    sync_session(name, tmp_path, where, body)


@pytest.mark.parametrize("name", NAMES)
def test_a_round_of_one_job_a_connection_is_synced_by_the_loop(name: str, tmp_path: Path) -> None:
    # One command per round trip, nothing comes while a round syncs: the loop
    # syncs it itself, even with Linux AIO. A connection that ran more (a
    # pipeline) may send more meanwhile: the kernel syncs that round.
    async def body(b: _BdbBackend) -> None:
        await put_and_settle(b, b"first")
        worker = b.worker
        bodies = (str(i).encode() for i in range(100))  # distinct: bdb-random is a set
        for jobs_each, on_loop in ((1, 1), (2, 0), (1, 1)):
            worker._sync_s = 0.0  # fast syncs, whatever this disk's are
            loop_flushes, aio_flushes = worker.loop_flushes, worker.aio_flushes
            holders = [Holder(b), Holder(b)]
            for holder in holders:
                for _ in range(jobs_each):
                    message = Message(next(bodies))
                    stored = b.put_now("q", message, ALWAYS, False, NO_LIMITS, None, holder)
                    assert stored is Put.STORED
            for holder in holders:
                assert await holder.released() is None
            assert worker.loop_flushes - loop_flushes == on_loop
            assert worker.aio_flushes - aio_flushes == 1 - on_loop

    sync_session(name, tmp_path, "aio", body)


class _FailingOnce:
    """A Berkeley DB handle, but the next call of its `method` fails with EIO.

    The store's handle is replaced, not its method: the store may be compiled.
    """

    def __init__(self, handle: Any, method: str) -> None:
        self._handle = handle
        self._method = method
        self.failed = False

    def __getattr__(self, name: str) -> Any:
        if name != self._method or self.failed:
            return getattr(self._handle, name)

        def fail(*args: Any) -> Any:
            self.failed = True
            raise db.DBError(errno.EIO, "I/O error")

        return fail


@pytest.mark.parametrize("name", NAMES)
def test_a_failed_round_voids_its_held_answers_and_loses_nothing(name: str, tmp_path: Path) -> None:
    async def body(b: _BdbBackend) -> None:
        await put_and_settle(b, b"kept")
        store = b.worker.store
        # The round's commit writes the queue's catalog record: that fails.
        failing = store.cat = _FailingOnce(store.cat, "put")
        holder = Holder(b)
        taken = await b.take("q", sync=ALWAYS, holder=holder)
        assert taken is not None and taken.body == b"kept"
        assert await b.put("q", Message(b"void"), sync=ALWAYS, holder=holder) is Put.STORED
        error = await holder.released()
        assert failing.failed
        assert isinstance(error, StorageError) and "I/O error" in str(error)
        # Undone: the take gave nothing away, the put stored nothing.
        assert [m.body for m in await drain(b, "q")] == [b"kept"]
        size = await b.size("q")
        assert size is not None and size.items == 0

    session(name, tmp_path, body)


def fail_next_sync(b: _BdbBackend) -> Callable[[], bool]:
    """The next sync of a round fails with EIO; a function telling whether it did.

    Berkeley DB's log_flush fails; or, with Linux AIO, the kernel's answer is
    replaced with EIO. Call the function before the store is used again.
    """
    worker = b.worker
    aio = worker._aio
    if aio is None:
        store = worker.store
        env = store.env
        failing = store.env = _FailingOnce(env, "log_flush")

        def ended() -> bool:
            store.env = env
            return failing.failed

        return ended
    answer = aio.done
    failed: list[int] = []

    def fail(number: int, error: OSError | None) -> None:
        aio.done = answer
        failed.append(number)
        answer(number, OSError(errno.EIO, os.strerror(errno.EIO)))

    aio.done = fail
    return lambda: bool(failed)


@EACH_PATH
@pytest.mark.parametrize("name", NAMES)
def test_a_failed_sync_fails_its_round(name: str, where: str, tmp_path: Path) -> None:
    """Its held answers are the error; the messages its takes took are given back.

    But not those of a holder answered before the sync (it needed nothing of
    it): a message it stored and took itself stays taken.
    """

    async def body(b: _BdbBackend) -> None:
        await make_empty(b, "p")
        await put_and_settle(b, b"kept")
        failed = fail_next_sync(b)
        holder, paired = Holder(b), Holder(b)
        taken = await b.take("q", sync=ALWAYS, holder=holder)
        assert taken is not None and taken.body == b"kept"
        assert await b.put("q", Message(b"unsure"), sync=ALWAYS, holder=holder) is Put.STORED
        put_held(b, paired, b"pair", "p")
        assert take_held(b, paired, "p") == b"pair"
        error = await holder.released()
        assert failed()
        assert isinstance(error, StorageError) and "I/O error" in str(error)
        early = where != "on-loop" and name != "bdb-random"
        assert await paired.released() is (None if early else error)
        if not early:  # failed with the round: its take is given back too
            assert [m.body for m in await drain_all(b, "p", 1)] == [b"pair"]
        # Committed, not known to be on disk: the take is given back (the
        # client was told it failed); the put may stay, as an unacknowledged
        # set may have landed. The worker thread gives it back: a take the
        # loop runs first may not see it yet, so drain until both are out.
        bodies = [m.body for m in await drain_all(b, "q", 2)]
        assert sorted(bodies) == [b"kept", b"unsure"]
        assert await drain(b, "p") == []

    sync_session(name, tmp_path, where, body)


async def drain_all(b: _BdbBackend, queue: str, count: int) -> list[Message]:
    """Drain `queue` until `count` messages are out (the worker thread gives some back)."""
    taken: list[Message] = []
    for _ in range(500):
        taken += await drain(b, queue)
        if len(taken) >= count:
            break
        await asyncio.sleep(0.01)
    return taken


def newest_log_file(env: Any) -> Path:
    """The log file with the highest number: the one commits are being written to."""
    directory = Path(env.log_file((1, 0))).parent
    return max(directory.glob("log.*"), key=lambda path: int(path.name.split(".")[1]))


@pytest.mark.parametrize(("size", "per_round"), [(64 << 10, 4), (1 << 10, 64)])
@pytest.mark.parametrize("name", NAMES)
def test_aio_syncs_follow_the_log_into_new_files(
    name: str, size: int, per_round: int, tmp_path: Path
) -> None:
    """Rounds of sets fill 1 MiB log files; after every round the file synced is the
    newest log file, and every set is there after a restart. Small sets: Berkeley DB's
    own idea of where it last synced lags behind the file written after a switch."""
    count = (3 << 20) // size + per_round  # 3 MiB: the syncs move on twice at least
    bodies = [i.to_bytes(4, "big") * (size // 4) for i in range(count)]

    async def fill(b: _BdbBackend) -> None:
        await put_and_settle(b, b"first")
        aio = b.worker._aio
        assert aio is not None
        env = b.worker.store.env
        files = set()
        for i in range(0, len(bodies), per_round):
            holder = Holder(b)
            for body in bodies[i : i + per_round]:
                assert await b.put("q", Message(body), sync=ALWAYS, holder=holder) is Put.STORED
            assert await holder.released() is None
            # What was synced is the file the log is being written to.
            assert os.fstat(aio._fd).st_ino == os.stat(newest_log_file(env)).st_ino
            files.add(aio._file)
        assert len(files) >= 3, files
        assert b.worker.aio_flushes >= len(bodies) // per_round

    async def check(b: _BdbBackend) -> None:
        taken = [m.body for m in await drain(b, "q")]
        assert sorted(taken) == sorted([b"first", *bodies])

    sync_session(name, tmp_path, "aio", fill, log_file_mb=1)
    session(name, tmp_path, check, log_file_mb=1)


@pytest.mark.parametrize("fault", ["pipe", "log_stat"])
@pytest.mark.parametrize("name", NAMES)
def test_where_aio_cannot_sync_the_loop_does_from_then_on(
    name: str, fault: str, tmp_path: Path
) -> None:
    """Linux AIO is given up for good, the round synced on the event loop, its answers
    released as usual. `pipe`: io_submit refuses an fdatasync of a pipe (EINVAL);
    `log_stat`: a next log file is there, and which file the log is in is not found."""

    async def put_two(b: _BdbBackend, first: bytes, second: bytes) -> None:
        # Two jobs of one connection: a round the kernel syncs (a round of one
        # job each the loop syncs itself, _nothing_to_overlap).
        holder = Holder(b)
        for body in (first, second):
            assert await b.put("q", Message(body), sync=ALWAYS, holder=holder) is Put.STORED
        assert await holder.released() is None

    async def body(b: _BdbBackend) -> None:
        await put_and_settle(b, b"first")
        await put_two(b, b"second", b"second+")
        aio = b.worker._aio
        assert aio is not None and aio._fd >= 0
        store = b.worker.store
        env = store.env
        if fault == "pipe":
            read, write = os.pipe()
            os.close(aio._fd)
            aio._fd = read  # closed with the rest when the worker gives Linux AIO up
            os.close(write)
        else:
            aio._next = str(tmp_path)  # a path that exists: the log seems to have moved on
            store.env = _FailingOnce(env, "log_stat")
        loop_flushes = b.worker.loop_flushes
        try:
            await put_two(b, b"third", b"third+")
        finally:
            store.env = env
        assert b.worker._aio is None
        assert b.worker.loop_flushes == loop_flushes + 1
        assert await b.put("q", Message(b"fourth"), sync=ALWAYS) is Put.STORED
        bodies = sorted(m.body for m in await drain(b, "q"))
        assert bodies == [b"first", b"fourth", b"second", b"second+", b"third", b"third+"]

    # Without Linux AIO the loop syncs however slow this disk is (else a slow
    # one would send the sync to the thread).
    sync_session(name, tmp_path, "aio", body, loop_sync_max_us=1_000_000)


class Recorder:
    """A caller that holds its replies, noting how each Pending ended."""

    def __init__(self) -> None:
        self.ended: list[BaseException | None] = []

    def hold(self, pending: Pending) -> None:
        pending.add(self.ended.append)


@pytest.mark.parametrize("name", NAMES)
def test_close_answers_the_sync_in_flight(name: str, tmp_path: Path) -> None:
    recorder = Recorder()

    async def main() -> None:
        b = make(name, tmp_path)
        await b.open()
        try:
            if b.worker._aio is None:
                pytest.skip("the kernel offers no Linux AIO here")
            await put_and_settle(b, b"first")
            assert await b.put("q", Message(b"last"), sync=ALWAYS, holder=recorder) is Put.STORED
            assert not recorder.ended
        finally:
            await b.close()

    asyncio.run(main())
    assert recorder.ended == [None]
    bodies = sorted(m.body for m in session(name, tmp_path, lambda b: drain(b, "q")))
    assert bodies == [b"first", b"last"]


class _CountingTransport:
    """A transport that notes, with each write, how many syncs the worker had done by then."""

    def __init__(self, backend: _BdbBackend) -> None:
        self.backend = backend
        self.writes: list[tuple[bytes, int]] = []

    def write(self, data: bytes) -> None:
        self.writes.append((data, self.backend.worker.flushes))

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def is_closing(self) -> bool:
        return False


@pytest.mark.parametrize("where", ["aio", "on-thread"])
@pytest.mark.parametrize("name", NAMES)
def test_a_pipeline_read_in_parts_hears_each_part_after_its_own_sync(
    name: str, where: str, tmp_path: Path
) -> None:
    # While a round syncs, the next part of a connection's pipeline runs in
    # the next round: its replies wait for that round's sync, not this one's.
    async def main() -> None:
        b = make(name, tmp_path, **SYNC_PATHS[where])
        server = Server(Config(backend=name), b)
        server.loop = asyncio.get_running_loop()
        await server.broker.start()
        try:
            if where == "aio" and b.worker._aio is None:
                pytest.skip("the kernel offers no Linux AIO here")
            await put_and_settle(b, b"first")
            connection = Connection(server)
            transport = _CountingTransport(b)
            connection.connection_made(transport)  # type: ignore[arg-type]
            before = b.worker.flushes
            expected = [
                (b"VALUE q 0 5\r\nfirst\r\nEND\r\nSTORED\r\n", before + 1),
                (b"STORED\r\nVALUE q 0 1\r\na\r\nEND\r\n", before + 2),
            ]
            connection.data_received(b"get q\r\nset q 0 0 1\r\na\r\n")
            for _ in range(1000):  # its round ends within a turn or two
                if b.worker._syncing:  # and its sync is under way
                    break
                await asyncio.sleep(0)
            assert b.worker._syncing and not transport.writes
            connection.data_received(b"set q 0 0 1\r\nb\r\nget q\r\n")
            whole = sum(len(data) for data, _ in expected)
            for _ in range(10_000):  # at most about 10 s
                if sum(len(data) for data, _ in transport.writes) >= whole:
                    break
                await asyncio.sleep(0.001)
            assert transport.writes == expected
        finally:
            server.broker.begin_stop()
            await b.close()

    asyncio.run(main())
