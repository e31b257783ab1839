"""A real Aerospike node for the whole test session, or the skip reason when there is none."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aerospike", reason="needs the aerospike client: pip install plugins/aerospike")

from mqd_aerospike.backend import AerospikeBackend
from mqd_aerospike.server import Node, node, unavailable

from mqd.backend import StorageOptions


@pytest.fixture(scope="session")
def aerospike_node() -> Iterator[Node]:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with node() as started:
        yield started


@pytest.fixture(scope="session")
def aerospike_host(aerospike_node: Node) -> str:
    return aerospike_node.host


def prefix_for(data_dir: Path) -> str:
    """Sets of their own for each test: the same directory reaches the same store."""
    return "t" + format(abs(hash(str(data_dir))) % (1 << 40), "x")


def make(host: str, data_dir: Path, owner: str = "local", **extra: Any) -> AerospikeBackend:
    table = {"hosts": [host], "set_prefix": prefix_for(data_dir), "max_item_size": 65536}
    table.update(extra)
    return AerospikeBackend(
        StorageOptions(data_dir=data_dir, extra=table, owner=owner, poll_interval_ms=10)
    )
