from pathlib import Path

from mqd.backend import StorageOptions
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
