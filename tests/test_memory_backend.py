from pathlib import Path

from mqd.backend import StorageOptions
from mqd.backends.memory import MemoryBackend
from mqd.testing.conformance import BackendConformance


class TestMemoryConformance(BackendConformance):
    def make_backend(self, data_dir: Path) -> MemoryBackend:
        return MemoryBackend(StorageOptions(data_dir=data_dir))
