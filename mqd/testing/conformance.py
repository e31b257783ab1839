"""The conformance suite every backend must pass.

Long (about 700 lines) because it is one class a backend subclasses once:
each test is a short scenario of the interface in mqd.backend, grouped by
topic (basics, leases, limits, fanout and redrive, uniqueness, restarts).

A backend's package runs it against itself by subclassing, for example::

    from mqd.testing.conformance import BackendConformance

    class TestMyBackend(BackendConformance):
        durable = True            # run the restart tests too

        def make_backend(self, data_dir):
            return MyBackend(StorageOptions(data_dir=data_dir))

`make_backend` is called again on the same directory to simulate a restart
when `durable` is true. Tests drive the coroutines with asyncio.run, so no
pytest plugin is needed.

What the broker builds on top of a backend is checked through a real daemon
elsewhere: named leases in mqd.testing.leases.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from mqd.backend import (
    LATER,
    NO_LIMITS,
    REDRIVE_EXPIRED,
    Backend,
    Capability,
    Fanout,
    Limits,
    Message,
    Pending,
    Put,
    Sync,
)
from mqd.protocol import name_bytes
from mqd.testing.batches import BatchConformance

T = TypeVar("T")
B = TypeVar("B", bound=Backend)

ALWAYS = Sync.ALWAYS

#: Names the protocol allows that naive storage gets wrong.
HOSTILE_NAMES = [
    "..",
    ".",
    "%2e%2e",
    "con",
    "COM1",
    "Jobs",
    "jobs",
    "JOBS",
    "a" * 250,
    "A" * 250,
    "a\\b",
    "~",
    "-rf",
    "*",
    "über",
    b"\xff\xfe\x80".decode("utf-8", "surrogateescape"),
    bytes(range(0x21, 0x7F)).replace(b"/", b"").replace(b"+", b"").decode(),
    bytes(range(0x80, 0x100)).decode("utf-8", "surrogateescape"),
]


def no_dead_letters(queue: str, message: Message) -> str | None:
    """A reclaim route that returns every message to its queue."""
    return None


class HeldAnswers:
    """A Holder (mqd.backend) that keeps what each Pending it was given ended with."""

    def __init__(self) -> None:
        self.ends: list[asyncio.Future[BaseException | None]] = []

    def hold(self, pending: Pending) -> None:
        end: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        pending.add(end.set_result)
        self.ends.append(end)

    async def released(self) -> list[BaseException | None]:
        """What every Pending held so far ended with, once all have ended."""
        return list(await asyncio.gather(*self.ends))


def run_with(backend: B, body: Callable[[B], Awaitable[T]]) -> T:
    """Open `backend`, run `body` with it in a fresh event loop, close it."""

    async def main() -> T:
        await backend.open()
        try:
            return await body(backend)
        finally:
            await backend.close()

    return asyncio.run(main())


class BackendConformance(BatchConformance):
    """Mixin of tests; subclass it and define `make_backend`."""

    durable = False

    def make_backend(self, data_dir: Path) -> Backend:
        raise NotImplementedError("BackendConformance.make_backend")

    # -- helpers -----------------------------------------------------------

    @pytest.fixture
    def data_dir(self, tmp_path: Path) -> Path:
        path = tmp_path / "data"
        path.mkdir()
        return path

    def session(self, data_dir: Path, body: Callable[[Backend], Awaitable[T]]) -> T:
        """Open a backend on `data_dir`, run `body` with it, close it."""
        return run_with(self.make_backend(data_dir), body)

    @staticmethod
    async def put(backend: Backend, queue: str, body: bytes, **fields: Any) -> int | None:
        """The new message's offset, or None when nothing was stored."""
        message = Message(body, **fields)
        stored = await backend.put(queue, message, sync=ALWAYS)
        return message.offset if stored is Put.STORED else None

    @staticmethod
    async def unique(backend: Backend, queue: str, body: bytes, **fields: Any) -> Put:
        return await backend.put(queue, Message(body, **fields), unique=True, sync=ALWAYS)

    @staticmethod
    async def reserve(backend: Backend, queue: str, lease: float = 0) -> Message:
        """Reserve the head, which the test knows is there."""
        message = await backend.reserve(queue, lease=lease, sync=ALWAYS)
        assert message is not None and message.receipt is not None
        return message

    def fifo(self, backend: Backend) -> bool:
        return Capability.FIFO in backend.capabilities

    # -- basics ------------------------------------------------------------

    def test_put_take_round_trip(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            sent = [f"m{i}".encode() for i in range(20)]
            for m in sent:
                await self.put(b, "q", m)
            got = [(await b.take("q", sync=ALWAYS)) for _ in sent]
            bodies = [m.body for m in got if m is not None]
            if self.fifo(b):
                assert bodies == sent
            else:
                assert sorted(bodies) == sorted(sent)
            assert await b.take("q", sync=ALWAYS) is None

        self.session(data_dir, body)

    def test_answers_now_are_those_put_and_take_give(self, data_dir: Path) -> None:
        # The broker asks put_now() and take_now() first when answers_now:
        # each answers, or gives LATER and put() or take() answers instead.
        async def body(b: Backend) -> None:
            holder = HeldAnswers()
            sent = [b"a", b"b", b"c"]
            now = []
            for m in sent:
                message = Message(m)
                stored = b.put_now("q", message, ALWAYS, False, NO_LIMITS, None, holder)
                now.append(stored is not LATER)
                if stored is LATER:
                    stored = await b.put("q", message, sync=ALWAYS)
                assert stored is Put.STORED
            got: list[bytes] = []
            for _ in range(len(sent) + 1):
                taken = b.take_now("q", ALWAYS, holder)
                now.append(taken is not LATER)
                if taken is LATER:
                    taken = await b.take("q", sync=ALWAYS)
                if taken is not None:
                    got.append(taken.body)
            assert (got if self.fifo(b) else sorted(got)) == sent
            if not b.answers_now:
                assert not any(now)
            # Answers given before they were durable are released once they are.
            assert await asyncio.wait_for(holder.released(), 10) == [None] * len(holder.ends)
            if not b.answers_held:
                assert not holder.ends

        self.session(data_dir, body)

    def test_fields_round_trip(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            await self.put(b, "q", b"x" * 1000, flags=2**32 - 1, expires=2e9, created=1.5e9)
            m = await b.take("q", sync=ALWAYS)
            assert m is not None
            assert (m.body, m.flags, m.expires, m.created) == (b"x" * 1000, 2**32 - 1, 2e9, 1.5e9)
            assert m.deliveries == 1

        self.session(data_dir, body)

    def test_empty_body(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            await self.put(b, "q", b"")
            m = await b.take("q", sync=ALWAYS)
            assert m is not None and m.body == b""

        self.session(data_dir, body)

    def test_offsets_grow_by_one_and_restart_after_delete(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            offsets = [await self.put(b, "q", f"{i}".encode()) for i in range(5)]
            assert offsets == [0, 1, 2, 3, 4]
            await b.take("q", sync=ALWAYS)
            assert await self.put(b, "q", b"5") == 5
            assert await b.delete("q", sync=ALWAYS) is True
            assert await self.put(b, "q", b"again") == 0

        self.session(data_dir, body)

    def test_unknown_queue_is_not_created(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            assert await b.take("nope", sync=ALWAYS) is None
            assert await b.reserve("nope", lease=0, sync=ALWAYS) is None
            assert await b.peek("nope") is None
            assert await b.size("nope") is None
            assert await b.delete("nope", sync=ALWAYS) is False
            assert "nope" not in await b.queues()

        self.session(data_dir, body)

    def test_emptied_queue_still_exists(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            await self.put(b, "q", b"a")
            await b.take("q", sync=ALWAYS)
            assert "q" in await b.queues()
            size = await b.size("q")
            assert size is not None and (size.items, size.bytes, size.open) == (0, 0, 0)

        self.session(data_dir, body)

    def test_size_counts_waiting_and_open(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            for m in (b"aa", b"bbb", b"cccc"):
                await self.put(b, "q", m, created=100.0)
            reserved = await self.reserve(b, "q")
            size = await b.size("q")
            assert size is not None
            assert (size.items, size.bytes, size.open) == (3, 9, 1)
            assert size.head_created == 100.0
            assert reserved.receipt is not None
            assert await b.ack(reserved.receipt, sync=ALWAYS) is True
            size = await b.size("q")
            assert size is not None and (size.items, size.open) == (2, 0)
            assert size.bytes == 9 - len(reserved.body)

        self.session(data_dir, body)

    def test_peek_leaves_message(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            await self.put(b, "q", b"a")
            first = await b.peek("q")
            second = await b.peek("q")
            assert first is not None and second is not None
            assert first.body == second.body == b"a"
            assert first.deliveries == 0
            taken = await b.take("q", sync=ALWAYS)
            assert taken is not None and taken.body == b"a"

        self.session(data_dir, body)

    # -- reservation -------------------------------------------------------

    def test_reserve_hides_message_until_released(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            await self.put(b, "q", b"a")
            m = await self.reserve(b, "q")
            first = m.receipt
            assert m.body == b"a" and m.deliveries == 1 and first is not None
            assert first.queue == "q" and first.offset == m.offset
            assert await b.take("q", sync=ALWAYS) is None
            assert await b.peek("q") is None
            assert await b.release(first, sync=ALWAYS) is True
            assert await b.release(first, sync=ALWAYS) is False
            again = await self.reserve(b, "q")
            assert again.offset == m.offset and again.deliveries == 2
            # A new reservation of the same message is a new lease.
            assert again.receipt is not None and again.receipt != first
            assert await b.ack(first, sync=ALWAYS) is False
            assert await b.ack(again.receipt, sync=ALWAYS) is True

        self.session(data_dir, body)

    def test_released_message_comes_before_newer(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            if not self.fifo(b):
                pytest.skip("backend is not FIFO")
            for m in (b"1", b"2", b"3"):
                await self.put(b, "q", m)
            r1 = await self.reserve(b, "q")
            r2 = await self.reserve(b, "q")
            assert r1.receipt is not None and r2.receipt is not None
            await self.put(b, "q", b"4")
            assert await b.release(r2.receipt, sync=ALWAYS) is True
            assert await b.release(r1.receipt, sync=ALWAYS) is True
            got = [await b.take("q", sync=ALWAYS) for _ in range(4)]
            assert [m.body for m in got if m] == [b"1", b"2", b"3", b"4"]

        self.session(data_dir, body)

    def test_remove_waiting_only(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            o1 = await self.put(b, "q", b"1")
            o2 = await self.put(b, "q", b"2")
            assert o1 is not None and o2 is not None
            r = await self.reserve(b, "q")
            other = o2 if r.offset == o1 else o1
            # An open message is its lease holder's: remove() leaves it.
            assert await b.remove("q", r.offset, sync=ALWAYS) is False
            assert r.receipt is not None and await b.ack(r.receipt, sync=ALWAYS) is True
            assert await b.remove("q", other, sync=ALWAYS) is True
            assert await b.remove("q", other, sync=ALWAYS) is False
            assert await b.remove("nope", 0, sync=ALWAYS) is False
            assert await b.take("q", sync=ALWAYS) is None

        self.session(data_dir, body)

    def test_read_at(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            if Capability.OFFSET not in b.capabilities:
                pytest.skip("backend has no offset reads")
            offsets = [await self.put(b, "q", f"m{i}".encode()) for i in range(5)]
            m = await b.read_at("q", offsets[3] or 0)
            assert m is not None and m.body == b"m3"
            first = offsets[0] or 0
            span = await b.read_range("q", first + 1, 2)
            assert [(m.offset, m.body) for m in span] == [(first + 1, b"m1"), (first + 2, b"m2")]
            capped = await b.read_range("q", first, 5, max_bytes=3)  # 2 bytes each: stop at 4
            assert [m.body for m in capped] == [b"m0", b"m1"]
            assert await b.read_range("q", first + 5, 100) == []
            assert await b.read_range("nope", 0, 100) == []
            assert await b.read_at("q", 99) is None
            r = await self.reserve(b, "q")
            still = await b.read_at("q", r.offset)
            assert still is not None and still.body == r.body
            size = await b.size("q")
            assert size is not None and size.items == 5

        self.session(data_dir, body)

    def test_read_at_follows_every_change(self, data_dir: Path) -> None:
        """Once used, read_at keeps seeing exactly what is in the queue, whatever changed it."""

        async def body(b: Backend) -> None:
            if Capability.OFFSET not in b.capabilities:
                pytest.skip("backend has no offset reads")
            assert await b.read_at("q", 0) is None
            expect: dict[int, bytes] = {}
            for i in range(8):
                offset = await self.put(b, "q", f"m{i}".encode())
                assert offset is not None
                expect[offset] = f"m{i}".encode()
            offsets = list(expect)

            async def present() -> dict[int, bytes]:
                found = {}
                for offset in offsets:
                    m = await b.read_at("q", offset)
                    if m is not None:
                        found[offset] = m.body
                # A range read over them all sees the same, in offset order.
                low = min(offsets)
                span = await b.read_range("q", low, max(offsets) - low + 1)
                assert [(m.offset, m.body) for m in span] == sorted(found.items())
                return found

            assert await present() == expect
            taken = await b.take("q", sync=ALWAYS)
            assert taken is not None
            del expect[taken.offset]
            assert await present() == expect
            r = await self.reserve(b, "q")  # open: still there
            assert await present() == expect
            assert r.receipt is not None and await b.release(r.receipt, sync=ALWAYS)
            assert await present() == expect
            r = await self.reserve(b, "q")
            assert r.receipt is not None and await b.ack(r.receipt, sync=ALWAYS)
            del expect[r.offset]
            assert await present() == expect
            r = await self.reserve(b, "q")
            assert r.receipt is not None and await b.release(r.receipt, sync=ALWAYS, to="q_dead")
            del expect[r.receipt.offset]  # r itself may be the dead letter now, renumbered
            assert await present() == expect
            dead = await b.read_at("q_dead", 0)
            assert dead is not None and dead.body == r.body
            head = await b.peek("q")
            assert head is not None and await b.remove("q", head.offset, sync=ALWAYS)
            del expect[head.offset]
            assert await present() == expect
            full = Limits(max_items=len(expect), drop_oldest=True)
            new = Message(b"new")
            assert await b.put("q", new, sync=ALWAYS, limits=full) is Put.STORED
            offsets.append(new.offset)
            now = await present()
            assert len(now) == len(expect) and now[new.offset] == b"new"
            assert {o: v for o, v in now.items() if o != new.offset}.items() < expect.items()
            await b.delete("q", sync=ALWAYS)
            assert await present() == {}
            again = await self.put(b, "q", b"again")
            assert again is not None
            m = await b.read_at("q", again)
            assert m is not None and m.body == b"again"

        self.session(data_dir, body)

    # -- leases ------------------------------------------------------------

    def test_expired_lease_is_reclaimed_once(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            for m in (b"1", b"2"):
                await self.put(b, "q", m)
            # Half a second: room for a busy machine between the reserve and
            # the first reclaim, which must find the lease still running.
            r = await self.reserve(b, "q", lease=0.5)
            assert r.receipt is not None
            assert await b.reclaim(no_dead_letters, sync=ALWAYS) == []
            await asyncio.sleep(0.6)
            returned = await b.reclaim(no_dead_letters, sync=ALWAYS)
            assert [(x.queue, x.message.offset, x.moved_to) for x in returned] == [
                ("q", r.offset, None)
            ]
            assert await b.reclaim(no_dead_letters, sync=ALWAYS) == []
            # The old receipt names a lease that is gone.
            assert await b.ack(r.receipt, sync=ALWAYS) is False
            assert await b.release(r.receipt, sync=ALWAYS) is False
            assert await b.extend(r.receipt, lease=10, sync=ALWAYS) is False
            again = await self.reserve(b, "q")
            assert again.offset == r.offset and again.deliveries == 2

        self.session(data_dir, body)

    def test_extend_keeps_lease(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            await self.put(b, "q", b"1")
            r = await self.reserve(b, "q", lease=0.5)
            assert r.receipt is not None
            assert await b.extend(r.receipt, lease=30, sync=ALWAYS) is True
            await asyncio.sleep(0.6)
            assert await b.reclaim(no_dead_letters, sync=ALWAYS) == []
            assert await b.ack(r.receipt, sync=ALWAYS) is True

        self.session(data_dir, body)

    def test_reclaim_by_owner_leaves_other_owners(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            for m in (b"1", b"2"):
                await self.put(b, "q", m)
            me = b.owner
            b.owner = "someone-else"
            theirs = await self.reserve(b, "q")
            b.owner = me
            mine = await self.reserve(b, "q")
            returned = await b.reclaim(no_dead_letters, sync=ALWAYS, owner=me)
            assert [x.message.offset for x in returned] == [mine.offset]
            assert theirs.receipt is not None
            assert await b.ack(theirs.receipt, sync=ALWAYS) is True

        self.session(data_dir, body)

    def test_release_to_dead_letters(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            await self.put(b, "q", b"poison", flags=3)
            r = await self.reserve(b, "q")
            assert r.receipt is not None
            assert await b.release(r.receipt, sync=ALWAYS, to="q_dead") is True
            assert await b.release(r.receipt, sync=ALWAYS, to="q_dead") is False
            size = await b.size("q")
            assert size is not None and (size.items, size.open) == (0, 0)
            dead = await b.take("q_dead", sync=ALWAYS)
            assert dead is not None and (dead.body, dead.flags) == (b"poison", 3)
            assert dead.origin == "q"
            assert await b.take("q_dead", sync=ALWAYS) is None

        self.session(data_dir, body)

    def test_reclaim_routes_to_dead_letters(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            await self.put(b, "q", b"poison")
            await self.reserve(b, "q", lease=0.1)
            await asyncio.sleep(0.2)
            returned = await b.reclaim(lambda q, m: f"{q}_dead", sync=ALWAYS)
            assert [(x.queue, x.moved_to) for x in returned] == [("q", "q_dead")]
            dead = await b.take("q_dead", sync=ALWAYS)
            assert dead is not None and dead.body == b"poison" and dead.origin == "q"
            assert await b.take("q", sync=ALWAYS) is None

        self.session(data_dir, body)

    def test_stale_receipt_after_delete_and_recreate(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            await self.put(b, "q", b"old")
            r = await self.reserve(b, "q")
            assert r.receipt is not None
            assert await b.delete("q", sync=ALWAYS) is True
            assert await self.put(b, "q", b"new") == r.offset
            fresh = await self.reserve(b, "q")
            assert fresh.receipt is not None and fresh.receipt != r.receipt
            assert await b.ack(r.receipt, sync=ALWAYS) is False
            assert await b.release(r.receipt, sync=ALWAYS) is False
            assert await b.release(fresh.receipt, sync=ALWAYS) is True
            m = await b.take("q", sync=ALWAYS)
            assert m is not None and m.body == b"new"

        self.session(data_dir, body)

    # -- limits --------------------------------------------------------------

    def test_limits_reject(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            limits = Limits(max_items=3)
            results = [
                await b.put("q", Message(f"{i}".encode()), sync=ALWAYS, limits=limits)
                for i in range(5)
            ]
            assert results == [Put.STORED] * 3 + [Put.FULL] * 2
            await self.reserve(b, "q")  # open messages count
            assert await b.put("q", Message(b"x"), sync=ALWAYS, limits=limits) is Put.FULL
            await b.take("q", sync=ALWAYS)
            assert await b.put("q", Message(b"x"), sync=ALWAYS, limits=limits) is Put.STORED
            by_bytes = Limits(max_bytes=10)
            assert await b.put("b", Message(b"x" * 11), sync=ALWAYS, limits=by_bytes) is Put.FULL
            assert await b.put("b", Message(b"x" * 6), sync=ALWAYS, limits=by_bytes) is Put.STORED
            assert await b.put("b", Message(b"x" * 6), sync=ALWAYS, limits=by_bytes) is Put.FULL

        self.session(data_dir, body)

    def test_limits_drop_oldest(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            limits = Limits(max_items=3, drop_oldest=True)
            for i in range(6):
                stored = await b.put("q", Message(f"{i}".encode()), sync=ALWAYS, limits=limits)
                assert stored is Put.STORED
            size = await b.size("q")
            assert size is not None and size.items == 3
            got = sorted([(await b.take("q", sync=ALWAYS) or Message(b"")).body for _ in range(3)])
            assert got == [b"3", b"4", b"5"]
            # Open messages are never dropped: a queue full of them refuses.
            for i in range(3):
                await b.put("q", Message(f"{i}".encode()), sync=ALWAYS, limits=limits)
                await self.reserve(b, "q")
            assert await b.put("q", Message(b"x"), sync=ALWAYS, limits=limits) is Put.FULL

        self.session(data_dir, body)

    # -- fanout, redrive, idle expiry -----------------------------------------

    def test_fanout_copies_to_existing_children(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            def limits(child: str) -> Limits:
                return Limits(max_items=2) if child == "q+small" else Limits()

            copies: list[str] = []  # the children told of their stored copies

            async def fan(text: bytes) -> Put:
                return await b.put(
                    "q", Message(text), sync=ALWAYS, fanout=Fanout(limits, copies.append)
                )

            await fan(b"before")
            for child in ("q+a", "q+b", "q+small"):
                assert await b.create(child, sync=ALWAYS) is True
            assert await b.create("q+a", sync=ALWAYS) is False
            for i in range(3):
                assert await fan(f"m{i}".encode()) is Put.STORED
            # A plain put (no fanout) and a put straight into a child stay where they are.
            await self.put(b, "q", b"alone")
            await self.put(b, "q+a", b"own")
            drained = {}
            for name in ("q", "q+a", "q+b", "q+small"):
                got = []
                while (m := await b.take(name, sync=ALWAYS)) is not None:
                    got.append(m.body)
                drained[name] = got if self.fifo(b) else sorted(got)
            expect = [b"m0", b"m1", b"m2"]
            order = (lambda x: x) if self.fifo(b) else sorted
            assert drained["q"] == order([b"before", *expect, b"alone"])
            assert drained["q+a"] == order([*expect, b"own"])
            assert drained["q+b"] == order(expect)
            assert len(drained["q+small"]) == 2  # full: refused for itself only
            assert sorted(copies) == ["q+a"] * 3 + ["q+b"] * 3 + ["q+small"] * 2  # not the refused
            copies.clear()
            # Deleting the parent leaves its children; a deleted child stops receiving.
            assert await b.delete("q", sync=ALWAYS) is True
            assert await b.delete("q+b", sync=ALWAYS) is True
            await fan(b"after")
            assert [m.body for m in [await b.take("q+a", sync=ALWAYS)] if m] == [b"after"]
            assert await b.take("q+b", sync=ALWAYS) is None
            assert sorted(copies) == ["q+a", "q+small"]

        self.session(data_dir, body)

    def test_a_put_straight_into_a_child_makes_it(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            await self.put(b, "p+own", b"own")
            fanout = Fanout(lambda child: NO_LIMITS)
            assert await b.put("p", Message(b"m"), sync=ALWAYS, fanout=fanout) is Put.STORED
            got = []
            while (m := await b.take("p+own", sync=ALWAYS)) is not None:
                got.append(m.body)
            assert sorted(got) == [b"m", b"own"]

        self.session(data_dir, body)

    def test_redrive_moves_back_where_they_died(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            for queue in ("a", "b"):
                await self.put(b, queue, queue.encode())
                r = await self.reserve(b, queue)
                assert r.receipt is not None
                assert await b.release(r.receipt, sync=ALWAYS, to="dead") is True
            await self.put(b, "dead", b"no-origin")
            assert await b.redrive("dead", to=None, limit=10, sync=ALWAYS) == {"a": 1, "b": 1}
            for queue in ("a", "b"):
                m = await b.take(queue, sync=ALWAYS)
                assert m is not None and m.body == queue.encode()
                assert (m.deliveries, m.origin) == (1, "")  # counted afresh from 0
            # One without an origin goes only where it is sent.
            assert await b.redrive("dead", to=None, limit=10, sync=ALWAYS) == {}
            assert await b.redrive("dead", to="c", limit=10, sync=ALWAYS) == {"c": 1}
            assert await b.redrive("nope", to="c", limit=10, sync=ALWAYS) == {}

        self.session(data_dir, body)

    def test_redrive_removes_expired_dead_letters(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            await self.put(b, "dead", b"old", expires=time.time() + 0.2)
            await self.put(b, "dead", b"new")
            await asyncio.sleep(0.3)
            moved = await b.redrive("dead", to="q", limit=1, sync=ALWAYS)
            assert moved == {"q": 1, REDRIVE_EXPIRED: 1}
            size = await b.size("dead")
            assert size is None or size.items == 0
            m = await b.take("q", sync=ALWAYS)
            assert m is not None and m.body == b"new"

        self.session(data_dir, body)

    def test_redrive_limit(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            for i in range(5):
                await self.put(b, "dead", f"{i}".encode())
            assert await b.redrive("dead", to="q", limit=3, sync=ALWAYS) == {"q": 3}
            size = await b.size("dead")
            assert size is not None and size.items == 2

        self.session(data_dir, body)

    def test_expire_idle(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            await self.put(b, "empty", b"x")
            await b.take("empty", sync=ALWAYS)
            await self.put(b, "full", b"x")
            await self.put(b, "open", b"x")
            await self.reserve(b, "open")
            await asyncio.sleep(0.05)
            cutoff = time.time()
            await self.put(b, "fresh", b"x")
            await b.take("fresh", sync=ALWAYS)
            assert await b.expire_idle("empty", before=cutoff, sync=ALWAYS) is True
            assert await b.size("empty") is None
            for name in ("full", "open", "fresh", "nope"):
                assert await b.expire_idle(name, before=cutoff, sync=ALWAYS) is False
            assert sorted(await b.queues()) == ["fresh", "full", "open"]

        self.session(data_dir, body)

    # -- uniqueness --------------------------------------------------------

    def test_discard(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            if Capability.UNIQUE not in b.capabilities:
                pytest.skip("backend has no uniqueness")
            for m in (b"a", b"b", b"c"):
                await self.unique(b, "q", m)
            assert await b.discard("q", b"b", sync=ALWAYS) == 1
            assert await b.discard("q", b"b", sync=ALWAYS) == 0
            assert await b.discard("nope", b"b", sync=ALWAYS) == 0
            assert await b.contains("q", b"b") is False
            size = await b.size("q")
            assert size is not None and (size.items, size.bytes) == (2, 2)

        self.session(data_dir, body)

    def test_unique_put(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            if Capability.UNIQUE not in b.capabilities:
                pytest.skip("backend has no uniqueness")
            assert await self.unique(b, "q", b"x") is Put.STORED
            assert await self.unique(b, "q", b"x", flags=7) is Put.DUPLICATE
            assert await self.unique(b, "q", b"y") is Put.STORED
            r = await self.reserve(b, "q")
            # A reserved message still counts as in the queue.
            assert await self.unique(b, "q", r.body) is Put.DUPLICATE
            assert await b.contains("q", r.body) is True
            assert r.receipt is not None and await b.ack(r.receipt, sync=ALWAYS) is True
            assert await b.contains("q", r.body) is False
            assert await self.unique(b, "q", r.body) is Put.STORED
            # Uniqueness is per queue.
            assert await self.unique(b, "other", b"x") is Put.STORED

        self.session(data_dir, body)

    def test_a_unique_fanout_child_keeps_one_copy_of_a_body(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            if Capability.UNIQUE not in b.capabilities:
                pytest.skip("backend has no uniqueness")
            copies: list[str] = []
            fanout = Fanout(lambda child: NO_LIMITS, copies.append, lambda child: child == "q+u")
            for child in ("q+u", "q+all"):
                assert await b.create(child, sync=ALWAYS) is True
            stored = [
                await b.put("q", Message(text), sync=ALWAYS, fanout=fanout)
                for text in (b"x", b"x", b"y")
            ]
            # A set-like backend stores the second x in the parent neither: no copies then.
            assert sorted(copies) == ["q+all"] * stored.count(Put.STORED) + ["q+u"] * 2
            u = await b.size("q+u")
            assert u is not None and u.items == 2

        self.session(data_dir, body)

    def test_unique_sees_messages_put_without_it(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            if Capability.UNIQUE not in b.capabilities:
                pytest.skip("backend has no uniqueness")
            await self.put(b, "q", b"x")
            assert await self.unique(b, "q", b"x") is Put.DUPLICATE
            await b.take("q", sync=ALWAYS)
            assert await self.unique(b, "q", b"x") is Put.STORED

        self.session(data_dir, body)

    # -- deleting ----------------------------------------------------------

    def test_delete_removes_everything(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            await self.put(b, "q", b"1")
            await self.put(b, "q", b"2")
            await b.reserve("q", lease=0, sync=ALWAYS)
            await self.put(b, "keep", b"k")
            assert await b.delete("q", sync=ALWAYS) is True
            assert await b.size("q") is None
            assert await b.take("q", sync=ALWAYS) is None
            assert await b.queues() == ["keep"]
            await b.flush_all(sync=ALWAYS)
            assert await b.queues() == []

        self.session(data_dir, body)

    def test_hostile_names_are_separate_and_contained(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            for name in HOSTILE_NAMES:
                await self.put(b, name, name_bytes(name))
            assert sorted(await b.queues()) == sorted(set(HOSTILE_NAMES))
            for name in HOSTILE_NAMES:
                m = await b.take(name, sync=ALWAYS)
                assert m is not None and m.body == name_bytes(name)
                assert await b.delete(name, sync=ALWAYS) is True

        self.session(data_dir, body)
        # Nothing was written beside the data directory.
        assert list(data_dir.parent.iterdir()) == [data_dir]

    def test_concurrent_puts_all_land(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            offsets = await asyncio.gather(*(self.put(b, "q", f"{i}".encode()) for i in range(200)))
            assert sorted(o for o in offsets if o is not None) == list(range(200))
            size = await b.size("q")
            assert size is not None and size.items == 200

        self.session(data_dir, body)

    # -- restarts (durable backends) -----------------------------------------

    def test_restart_keeps_messages_and_offsets(self, data_dir: Path) -> None:
        if not self.durable:
            pytest.skip("backend is not durable")

        async def first(b: Backend) -> None:
            for i in range(10):
                await self.put(b, "q", f"m{i}".encode(), flags=i)
            await b.take("q", sync=ALWAYS)

        async def second(b: Backend) -> None:
            assert await b.reclaim(no_dead_letters, sync=ALWAYS, owner=b.owner) == []
            size = await b.size("q")
            assert size is not None and (size.items, size.open) == (9, 0)
            assert await self.put(b, "q", b"m10") == 10
            m = await b.take("q", sync=ALWAYS)
            assert m is not None
            if self.fifo(b):
                assert (m.body, m.flags, m.offset) == (b"m1", 1, 1)

        self.session(data_dir, first)
        self.session(data_dir, second)

    def test_restart_returns_reserved_messages(self, data_dir: Path) -> None:
        if not self.durable:
            pytest.skip("backend is not durable")

        async def first(b: Backend) -> int:
            await self.put(b, "q", b"a")
            await self.put(b, "q", b"b")
            m = await self.reserve(b, "q")
            return m.offset

        offset = self.session(data_dir, first)

        async def second(b: Backend) -> None:
            size = await b.size("q")
            assert size is not None and (size.items, size.open) == (2, 1)
            # A lease of no deadline outlives the daemon until its owner's next start.
            assert await b.reclaim(no_dead_letters, sync=ALWAYS) == []
            returned = await b.reclaim(no_dead_letters, sync=ALWAYS, owner=b.owner)
            assert [(r.queue, r.message.offset, r.moved_to) for r in returned] == [
                ("q", offset, None)
            ]
            m = await self.reserve(b, "q")
            assert m.offset == offset and m.deliveries == 2

        self.session(data_dir, second)

    def test_restart_after_delete_starts_offsets_again(self, data_dir: Path) -> None:
        if not self.durable:
            pytest.skip("backend is not durable")

        async def first(b: Backend) -> None:
            await self.put(b, "q", b"a")
            await b.delete("q", sync=ALWAYS)

        async def second(b: Backend) -> None:
            assert await b.queues() == []
            assert await self.put(b, "q", b"b") == 0

        self.session(data_dir, first)
        self.session(data_dir, second)
