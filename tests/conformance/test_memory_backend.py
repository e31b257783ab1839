from pathlib import Path

from mqd.backend import Backend, StorageOptions
from mqd.backends.memory import MemoryBackend
from mqd.testing.conformance import BackendConformance
from mqd.testing.many import ManyDaemonConformance


class TestMemoryConformance(BackendConformance):
    def make_backend(self, data_dir: Path) -> MemoryBackend:
        return MemoryBackend(StorageOptions(data_dir=data_dir))


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
