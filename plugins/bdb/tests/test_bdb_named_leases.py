"""Named leases through a real daemon on each Berkeley DB backend."""

from __future__ import annotations

import pytest

from mqd.testing.leases import LeaseConformance

pytest.importorskip("berkeleydb", reason="needs the berkeleydb module: pip install -e plugins/bdb")


class TestBdbLeases(LeaseConformance):
    backend = "bdb"
    durable = True


class TestBdbSingleLeases(LeaseConformance):
    backend = "bdb-single"
    durable = True


class TestBdbRandomLeases(LeaseConformance):
    backend = "bdb-random"
    durable = True
    fifo = False
    offset = False
