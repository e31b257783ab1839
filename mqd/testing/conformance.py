"""The conformance suite every backend must pass.

A backend's package runs it against itself by subclassing, for example::

    from mqd.testing.conformance import BackendConformance

    class TestMyBackend(BackendConformance):
        durable = True            # run the restart tests too

        def make_backend(self, data_dir):
            return MyBackend(StorageOptions(data_dir=data_dir))

`make_backend` is called again on the same directory to simulate a restart
when `durable` is true. Tests drive the coroutines with asyncio.run, so no
pytest plugin is needed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from mqd.backend import Backend, Capability, Message, Sync, name_bytes

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


def run_with(backend: B, body: Callable[[B], Awaitable[T]]) -> T:
    """Open `backend`, run `body` with it in a fresh event loop, close it."""

    async def main() -> T:
        await backend.open()
        try:
            return await body(backend)
        finally:
            await backend.close()

    return asyncio.run(main())


class BackendConformance:
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
        return await backend.put(queue, Message(body, **fields), unique=False, sync=ALWAYS)

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
            reserved = await b.reserve("q", lease=0, sync=ALWAYS)
            assert reserved is not None
            size = await b.size("q")
            assert size is not None
            assert (size.items, size.bytes, size.open) == (3, 9, 1)
            assert size.head_created == 100.0
            await b.remove("q", reserved.offset, sync=ALWAYS)
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
            m = await b.reserve("q", lease=0, sync=ALWAYS)
            assert m is not None and m.body == b"a" and m.deliveries == 1
            assert await b.take("q", sync=ALWAYS) is None
            assert await b.peek("q") is None
            assert await b.release("q", m.offset, sync=ALWAYS) is True
            assert await b.release("q", m.offset, sync=ALWAYS) is False
            again = await b.reserve("q", lease=0, sync=ALWAYS)
            assert again is not None and again.offset == m.offset
            assert again.deliveries == 2

        self.session(data_dir, body)

    def test_released_message_comes_before_newer(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            if not self.fifo(b):
                pytest.skip("backend is not FIFO")
            for m in (b"1", b"2", b"3"):
                await self.put(b, "q", m)
            r1 = await b.reserve("q", lease=0, sync=ALWAYS)
            r2 = await b.reserve("q", lease=0, sync=ALWAYS)
            assert r1 is not None and r2 is not None
            await self.put(b, "q", b"4")
            await b.release("q", r2.offset, sync=ALWAYS)
            await b.release("q", r1.offset, sync=ALWAYS)
            got = [await b.take("q", sync=ALWAYS) for _ in range(4)]
            assert [m.body for m in got if m] == [b"1", b"2", b"3", b"4"]

        self.session(data_dir, body)

    def test_remove_waiting_reserved_and_missing(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            o1 = await self.put(b, "q", b"1")
            o2 = await self.put(b, "q", b"2")
            assert o1 is not None and o2 is not None
            r = await b.reserve("q", lease=0, sync=ALWAYS)
            assert r is not None
            other = o2 if r.offset == o1 else o1
            assert await b.remove("q", r.offset, sync=ALWAYS) is True
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
            assert await b.read_at("q", 99) is None
            r = await b.reserve("q", lease=0, sync=ALWAYS)
            assert r is not None
            still = await b.read_at("q", r.offset)
            assert still is not None and still.body == r.body
            size = await b.size("q")
            assert size is not None and size.items == 5

        self.session(data_dir, body)

    # -- uniqueness --------------------------------------------------------

    def test_unique_put(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            if Capability.UNIQUE not in b.capabilities:
                pytest.skip("backend has no uniqueness")
            assert await b.put("q", Message(b"x"), unique=True, sync=ALWAYS) is not None
            assert await b.put("q", Message(b"x", flags=7), unique=True, sync=ALWAYS) is None
            assert await b.put("q", Message(b"y"), unique=True, sync=ALWAYS) is not None
            r = await b.reserve("q", lease=0, sync=ALWAYS)
            assert r is not None
            # A reserved message still counts as in the queue.
            assert await b.put("q", Message(r.body), unique=True, sync=ALWAYS) is None
            await b.remove("q", r.offset, sync=ALWAYS)
            assert await b.put("q", Message(r.body), unique=True, sync=ALWAYS) is not None
            # Uniqueness is per queue.
            assert await b.put("other", Message(b"x"), unique=True, sync=ALWAYS) is not None

        self.session(data_dir, body)

    def test_unique_sees_messages_put_without_it(self, data_dir: Path) -> None:
        async def body(b: Backend) -> None:
            if Capability.UNIQUE not in b.capabilities:
                pytest.skip("backend has no uniqueness")
            await self.put(b, "q", b"x")
            assert await b.put("q", Message(b"x"), unique=True, sync=ALWAYS) is None
            await b.take("q", sync=ALWAYS)
            assert await b.put("q", Message(b"x"), unique=True, sync=ALWAYS) is not None

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
            assert await b.recover() == []
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
            m = await b.reserve("q", lease=0, sync=ALWAYS)
            assert m is not None
            return m.offset

        offset = self.session(data_dir, first)

        async def second(b: Backend) -> None:
            recovered = await b.recover()
            assert [(q, m.offset, m.deliveries) for q, m in recovered] == [("q", offset, 1)]
            size = await b.size("q")
            assert size is not None and (size.items, size.open) == (2, 1)
            assert await b.release("q", offset, sync=ALWAYS) is True
            m = await b.reserve("q", lease=0, sync=ALWAYS)
            assert m is not None and m.offset == offset and m.deliveries == 2

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
