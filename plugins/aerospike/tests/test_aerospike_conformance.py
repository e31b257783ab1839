"""The conformance suite, one daemon and many, on a real Aerospike node."""

from __future__ import annotations

from pathlib import Path

import pytest

from mqd.backend import Backend
from mqd.testing.conformance import BackendConformance
from mqd.testing.many import ManyDaemonConformance

from .conftest import make


class TestAerospike(BackendConformance):
    durable = True  # a daemon restarting finds everything in the cluster

    @pytest.fixture(autouse=True)
    def _host(self, aerospike_host: str) -> None:
        self.host = aerospike_host

    def make_backend(self, data_dir: Path) -> Backend:
        return make(self.host, data_dir)


class TestAerospikeShared(ManyDaemonConformance):
    @pytest.fixture(autouse=True)
    def _host(self, aerospike_host: str) -> None:
        self.host = aerospike_host

    def make_instance(self, data_dir: Path, n: int) -> Backend:
        return make(self.host, data_dir, owner=f"daemon-{n}", lock_lease_ms=200)
