"""A real daemon on an Aerospike node, killed at random under load, loses nothing.

The node lives on; the daemon restarts on the same data directory, so with
the same daemon id, and gives back the leases it held (mqd.testing.soak).
"""

from __future__ import annotations

from pathlib import Path

from mqd_aerospike.server import Node

from mqd.testing.soak import FanoutSoak, Soak, short_run

from .conftest import prefix_for


def test_sigkill_under_load_loses_no_stored_message(aerospike_node: Node, tmp_path: Path) -> None:
    config = aerospike_node.storage_table(prefix_for(tmp_path))
    soak = Soak(tmp_path, "aerospike", producers=3, consumers=3, seed=7, config_text=config)
    short_run(soak)
    assert soak.books.taken and soak.books.opened


def test_sigkill_during_fanout_sets_keeps_every_stored_copy(
    aerospike_node: Node, tmp_path: Path
) -> None:
    config = aerospike_node.storage_table(prefix_for(tmp_path))
    soak = FanoutSoak(tmp_path, "aerospike", producers=3, consumers=2, seed=11, config_text=config)
    # Each copy is a commit of its own (plugins/aerospike/README.md, Fanout): a
    # set the kill cut off may have left some; every STORED one left all three.
    soak.fanout.atomic = False
    short_run(soak)
    assert soak.fanout.copies()[3] >= len(soak.fanout.stored)
