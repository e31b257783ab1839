"""The shared backend conformance suite, run against each Berkeley DB backend."""

from __future__ import annotations

from pathlib import Path

from bdb_helpers import make

from mqd.backend import Backend
from mqd.testing.conformance import BackendConformance


class TestBdbConformance(BackendConformance):
    durable = True

    def make_backend(self, data_dir: Path) -> Backend:
        return make("bdb", data_dir)


class TestBdbSingleConformance(BackendConformance):
    durable = True

    def make_backend(self, data_dir: Path) -> Backend:
        return make("bdb-single", data_dir)


class TestBdbRandomConformance(BackendConformance):
    durable = True

    def make_backend(self, data_dir: Path) -> Backend:
        return make("bdb-random", data_dir)
