"""The bulk lease calls of the conformance suite: reserve_many, ack_many, release_many, extend_many.

Each must do what the single call does once per message, in order, whether a
backend overrides it or keeps the default. BackendConformance
(mqd.testing.conformance) includes these tests, so every backend runs them;
they live apart only to keep that module's length in bounds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from mqd.backend import Backend, Capability, Message, Receipt, Sync

T = TypeVar("T")

ALWAYS = Sync.ALWAYS


def _back(queue: str, message: Message) -> str | None:
    """A reclaim route that returns every message to its queue."""
    return None


async def _fill(backend: Backend, queue: str, bodies: list[bytes]) -> None:
    for body in bodies:
        await backend.put(queue, Message(body), sync=ALWAYS)


def _receipts(messages: list[Message]) -> list[Receipt]:
    found = [m.receipt for m in messages]
    assert all(r is not None for r in found)
    return [r for r in found if r is not None]


async def _reserved(
    backend: Backend, bodies: list[bytes], lease: float = 0
) -> tuple[list[Message], list[Receipt]]:
    """Store `bodies` in "q" and reserve them all: the messages and their receipts."""
    await _fill(backend, "q", bodies)
    held = await backend.reserve_many("q", len(bodies), lease=lease, sync=ALWAYS)
    assert len(held) == len(bodies)
    return held, _receipts(held)


async def _drain(backend: Backend, queue: str) -> list[bytes]:
    bodies = []
    while (message := await backend.take(queue, sync=ALWAYS)) is not None:
        bodies.append(message.body)
    return bodies


class BatchConformance:
    """Tests of the bulk calls; BackendConformance supplies `session` and `data_dir`."""

    def session(self, data_dir: Path, body: Callable[[Backend], Awaitable[T]]) -> T:
        raise NotImplementedError("BatchConformance.session")

    def test_reserve_many_opens_the_head_in_order(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            sent = [b"m%d" % i for i in range(10)]
            await _fill(b, "q", sent)
            first = await b.reserve_many("q", 4, lease=0, sync=ALWAYS)
            assert len(first) == 4
            if Capability.FIFO in b.capabilities:
                assert [m.body for m in first] == sent[:4]
                assert [m.offset for m in first] == [0, 1, 2, 3]
            receipts = _receipts(first)
            assert len(set(receipts)) == 4
            assert [r.offset for r in receipts] == [m.offset for m in first]
            assert {r.queue for r in receipts} == {"q"}
            assert all(m.deliveries == 1 for m in first)
            size = await b.size("q")
            assert size is not None and (size.items, size.open) == (10, 4)
            rest = await b.reserve_many("q", 100, lease=0, sync=ALWAYS)
            assert sorted(m.body for m in first + rest) == sorted(sent)
            assert await b.reserve_many("q", 5, lease=0, sync=ALWAYS) == []
            assert await b.reserve("q", lease=0, sync=ALWAYS) is None
            assert await b.take("q", sync=ALWAYS) is None

        self.session(data_dir, body)

    def test_reserve_many_of_an_unknown_queue(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            assert await b.reserve_many("nope", 3, lease=0, sync=ALWAYS) == []
            assert await b.size("nope") is None
            await b.create("empty", sync=ALWAYS)
            assert await b.reserve_many("empty", 3, lease=0, sync=ALWAYS) == []

        self.session(data_dir, body)

    def test_reserve_many_counts_deliveries_as_reserve_does(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            await _fill(b, "q", [b"a", b"b"])
            one = await b.reserve("q", lease=0, sync=ALWAYS)
            assert one is not None and one.receipt is not None
            assert await b.release(one.receipt, sync=ALWAYS)
            both = await b.reserve_many("q", 2, lease=0, sync=ALWAYS)
            deliveries = {m.body: m.deliveries for m in both}
            assert deliveries == {one.body: 2, (b"b" if one.body == b"a" else b"a"): 1}
            # Receipts of a bulk reservation work with the single calls too.
            assert await b.release_many(_receipts(both), sync=ALWAYS) == [True, True]
            again = await b.reserve_many("q", 2, lease=0, sync=ALWAYS)
            assert {m.body: m.deliveries for m in again} == {
                body: n + 1 for body, n in deliveries.items()
            }
            receipt = again[0].receipt
            assert receipt is not None and await b.ack(receipt, sync=ALWAYS)

        self.session(data_dir, body)

    def test_reserve_many_stops_at_max_bytes(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            bodies = [b"x" * n for n in (10, 20, 30, 40, 50)]
            await _fill(b, "q", bodies)
            got = await b.reserve_many("q", 5, lease=0, sync=ALWAYS, max_bytes=35)
            sizes = [len(m.body) for m in got]
            # The message that reaches the bound is the last one opened.
            assert sum(sizes[:-1]) < 35 <= sum(sizes)
            if Capability.FIFO in b.capabilities:
                assert sizes == [10, 20, 30]
            left = 5 - len(got)
            one = await b.reserve_many("q", 5, lease=0, sync=ALWAYS, max_bytes=1)
            assert len(one) == 1  # the first message always, however large
            rest = await b.reserve_many("q", 5, lease=0, sync=ALWAYS, max_bytes=0)
            assert len(rest) == left - 1  # 0: no bound
            size = await b.size("q")
            assert size is not None and size.open == 5

        self.session(data_dir, body)

    def test_ack_many(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            held, receipts = await _reserved(b, [b"m%d" % i for i in range(5)])
            assert await b.ack_many(receipts[:3], sync=ALWAYS) == [True, True, True]
            size = await b.size("q")
            assert size is not None and (size.items, size.open) == (2, 2)
            gone = sum(len(m.body) for m in held[:3])
            assert size.bytes == sum(len(m.body) for m in held) - gone
            # Gone leases are False, each on its own, the rest still acknowledged.
            mixed = [receipts[0], receipts[3], receipts[1]]
            assert await b.ack_many(mixed, sync=ALWAYS) == [False, True, False]
            assert await b.ack_many([], sync=ALWAYS) == []
            assert await b.ack(receipts[4], sync=ALWAYS) is True
            assert await b.ack_many(receipts, sync=ALWAYS) == [False] * 5
            size = await b.size("q")
            assert size is not None and (size.items, size.open, size.bytes) == (0, 0, 0)

        self.session(data_dir, body)

    def test_ack_many_after_delete_and_recreate(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            _, stale = await _reserved(b, [b"old1", b"old2"])
            assert await b.delete("q", sync=ALWAYS)
            _, fresh = await _reserved(b, [b"new1", b"new2"])
            assert await b.ack_many(stale, sync=ALWAYS) == [False, False]
            assert await b.release_many(stale, sync=ALWAYS) == [False, False]
            assert await b.extend_many(stale, lease=5, sync=ALWAYS) == [False, False]
            size = await b.size("q")
            assert size is not None and size.open == 2
            assert await b.ack_many(fresh, sync=ALWAYS) == [True, True]

        self.session(data_dir, body)

    def test_release_many_back_ahead_of_newer(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            held, receipts = await _reserved(b, [b"m%d" % i for i in range(4)])
            await _fill(b, "q", [b"later"])
            assert await b.release_many(receipts[:3], sync=ALWAYS) == [True] * 3
            assert await b.release_many(receipts[:3], sync=ALWAYS) == [False] * 3
            size = await b.size("q")
            assert size is not None and (size.items, size.open) == (5, 1)
            back = await _drain(b, "q")
            if Capability.FIFO in b.capabilities:
                assert back == [b"m0", b"m1", b"m2", b"later"]
            else:
                assert sorted(back) == sorted([m.body for m in held[:3]] + [b"later"])
            assert await b.ack_many(receipts[3:], sync=ALWAYS) == [True]

        self.session(data_dir, body)

    def test_release_many_among_waiting_messages(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            held, receipts = await _reserved(b, [b"m%d" % i for i in range(5)])
            await _fill(b, "q", [b"later"])
            assert await b.release(receipts[2], sync=ALWAYS)
            # Out of order, around one already back: each goes where it belongs.
            assert await b.release_many([receipts[3], receipts[0]], sync=ALWAYS) == [True] * 2
            back = await _drain(b, "q")
            expected = [held[i].body for i in (0, 2, 3)] + [b"later"]
            if Capability.FIFO in b.capabilities:
                assert back == expected
            else:
                assert sorted(back) == sorted(expected)
            assert await b.ack_many([receipts[1], receipts[4]], sync=ALWAYS) == [True] * 2

        self.session(data_dir, body)

    def test_release_many_to_dead_letters(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            held, receipts = await _reserved(b, [b"a", b"b", b"c"])
            to = ["q_dead", None, "q_dead"]
            assert await b.release_many(receipts, sync=ALWAYS, to=to) == [True] * 3
            dead = []
            while (m := await b.take("q_dead", sync=ALWAYS)) is not None:
                dead.append(m)
            assert sorted(m.body for m in dead) == sorted([held[0].body, held[2].body])
            assert all(m.origin == "q" for m in dead)
            assert all(m.deliveries == 2 for m in dead)  # kept (1), and this take
            assert await _drain(b, "q") == [held[1].body]

        self.session(data_dir, body)

    def test_extend_many_keeps_leases(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            held, receipts = await _reserved(b, [b"a", b"b", b"c"], lease=0.6)
            assert await b.ack_many(receipts[2:], sync=ALWAYS) == [True]
            assert await b.extend_many(receipts, lease=30, sync=ALWAYS) == [True, True, False]
            await asyncio.sleep(0.8)
            assert await b.reclaim(_back, sync=ALWAYS) == []
            size = await b.size("q")
            assert size is not None and size.open == 2
            # Back to a short lease: now it ends.
            assert await b.extend_many(receipts[:1], lease=0.1, sync=ALWAYS) == [True]
            await asyncio.sleep(0.3)
            ended = await b.reclaim(_back, sync=ALWAYS)
            assert [r.message.body for r in ended] == [held[0].body]
            assert await b.ack_many(receipts[:2], sync=ALWAYS) == [False, True]

        self.session(data_dir, body)
