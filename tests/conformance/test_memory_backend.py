from pathlib import Path
from typing import Any

from mqd.backend import NO_LIMITS, Backend, Message, Put, StorageOptions, Sync, asks_now
from mqd.backends.memory import MemoryBackend
from mqd.testing.conformance import BackendConformance
from mqd.testing.many import ManyDaemonConformance


class TestMemoryConformance(BackendConformance):
    def make_backend(self, data_dir: Path) -> MemoryBackend:
        return MemoryBackend(StorageOptions(data_dir=data_dir))


def test_memory_answers_every_set_and_get_at_once() -> None:
    # The broker asks put_now() and take_now() first: no coroutine per command.
    b = MemoryBackend(StorageOptions())
    assert b.answers_now and not b.answers_held
    first, second = Message(b"a"), Message(b"b")
    for message in (first, second):
        assert b.put_now("q", message, Sync.ALWAYS, False, NO_LIMITS, None, None) is Put.STORED
    assert b.take_now("q", Sync.ALWAYS, None) is first
    assert b.take_now("q", Sync.ALWAYS, None) is second
    assert b.take_now("q", Sync.ALWAYS, None) is None
    assert first.deliveries == second.deliveries == 1


def test_a_subclass_that_changes_put_or_take_is_asked_those() -> None:
    class Refusing(MemoryBackend):
        async def put(self, queue: str, message: Message, **options: Any) -> Put:
            return Put.FULL

    class Holding(MemoryBackend):
        async def take(self, queue: str, **options: Any) -> Message | None:
            return None

    class BothWays(Refusing):
        def put_now(self, queue: str, message: Message, *args: Any) -> Put:
            return Put.FULL

    class Quiet(MemoryBackend):
        answers_now = False

    options = StorageOptions()
    assert asks_now(MemoryBackend(options))
    assert not asks_now(Refusing(options))
    assert not asks_now(Holding(options))
    assert asks_now(BothWays(options))  # its own put_now() stands for its own put()
    assert not asks_now(Quiet(options))


class TestMemoryManyDaemons(ManyDaemonConformance):
    """Several brokers over one in-process store, as daemons over one shared store."""

    def make_instance(self, data_dir: Path, n: int) -> MemoryBackend:
        return MemoryBackend(StorageOptions(data_dir=data_dir, extra={"share": str(data_dir)}))


class _SingleCalls(MemoryBackend):
    """The memory backend without its bulk lease calls: the Backend defaults run."""

    reserve_many = Backend.reserve_many
    ack_many = Backend.ack_many
    release_many = Backend.release_many
    extend_many = Backend.extend_many


class TestDefaultBulkCalls(BackendConformance):
    """The interface's own reserve_many and the rest, as a backend without overrides has them."""

    def make_backend(self, data_dir: Path) -> MemoryBackend:
        return _SingleCalls(StorageOptions(data_dir=data_dir))
