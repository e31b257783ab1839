"""A real daemon on each Berkeley DB backend, killed at random under load, loses nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from bdb_helpers import FIFO_NAMES, NAMES

from mqd.testing.daemon import Daemon
from mqd.testing.raw import Raw
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


def _bodies(reply: bytes) -> list[bytes]:
    """The values of a get's reply, in order (each value here is one line)."""
    lines = reply.split(b"\r\n")
    return [lines[i + 1] for i, line in enumerate(lines) if line.startswith(b"VALUE ")]


@pytest.mark.parametrize("name", NAMES)
def test_a_many_key_get_answers_only_what_a_kill_cannot_bring_back(
    name: str, tmp_path: Path
) -> None:
    """The takes of a get of many keys share commits; its reply comes once they are on disk."""
    sent = [b"m%03d" % i for i in range(100)]
    with Daemon(tmp_path, backend=name) as daemon:
        conn = Raw(daemon.address)
        for body in sent:
            conn.call(b"set q 0 0 4\r\n%b\r\n" % body, b"STORED\r\n")
        # 70 keys: more than one piece (GET_PIECE), with an unknown queue among them.
        conn.send(b"get " + b" ".join([b"q"] * 35 + [b"nothing"] + [b"q"] * 35) + b"\r\n")
        taken = _bodies(conn.read_until(b"END\r\n"))
        daemon.kill()
        daemon.start()
        conn = Raw(daemon.address)
        conn.send(b"get " + b" ".join([b"q"] * 100) + b"\r\n")
        left = _bodies(conn.read_until(b"END\r\n"))
    assert len(taken) == 70 and len(left) == 30
    if name in FIFO_NAMES:
        assert taken + left == sent
    else:
        assert sorted(taken + left) == sent
