"""A real daemon on each Berkeley DB backend, killed at random under load, loses nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from bdb_helpers import NAMES

from mqd.testing.soak import FanoutSoak, Soak, short_run


@pytest.mark.parametrize("name", NAMES)
def test_sigkill_under_load_loses_no_stored_message(name: str, tmp_path: Path) -> None:
    soak = Soak(tmp_path, name, producers=3, consumers=3, seed=7)
    short_run(soak)
    assert soak.books.taken and soak.books.opened


@pytest.mark.parametrize("name", NAMES)
def test_sigkill_during_fanout_sets_keeps_all_copies_or_none(name: str, tmp_path: Path) -> None:
    soak = FanoutSoak(tmp_path, name, producers=3, consumers=2, seed=11)
    short_run(soak)
    copies = soak.fanout.copies()
    # Every sent message is in all three queues or none: nothing in between.
    assert set(copies) <= {0, 3}, copies
    assert copies[3] >= len(soak.fanout.stored)
