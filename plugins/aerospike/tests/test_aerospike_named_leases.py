"""Named leases through a real daemon on a real Aerospike node."""

from __future__ import annotations

import uuid

import pytest

from mqd.testing.leases import LeaseConformance


class TestAerospikeLeases(LeaseConformance):
    backend = "aerospike"
    durable = True  # a daemon restarting finds everything in the cluster

    @pytest.fixture(scope="class")
    @classmethod
    def storage_toml(cls, aerospike_host: str) -> str:
        return f"""
[storage.aerospike]
hosts = ["{aerospike_host}"]
set_prefix = "l{uuid.uuid4().hex[:10]}"
"""
