"""A real daemon on each Berkeley DB backend, killed at random under load, loses nothing."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
from bdb_helpers import FIFO_NAMES, NAMES
from pymemcache.client.base import Client
from pymemcache.exceptions import MemcacheServerError, MemcacheUnexpectedCloseError

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


def test_a_many_key_get_takes_nothing_more_once_its_client_is_gone(tmp_path: Path) -> None:
    """Each piece waits for its commit; a client gone by then gets no more pieces taken."""
    count = 8000
    with Daemon(tmp_path, backend="bdb") as daemon:
        conn = Raw(daemon.address)
        for _ in range(0, count, 500):
            conn.send(b"set q 0 0 1 noreply\r\nx\r\n" * 500)
        conn.call(b"version\r\n", b"VERSION 1.0.0\r\n")
        conn.send(b"get" + b" q" * count + b"\r\n")
        conn.sock.close()  # before any of the reply comes
        watch = Raw(daemon.address)

        def items() -> int:
            watch.send(b"stats\r\n")
            stats = watch.read_until(b"END\r\n")
            return int(stats.split(b"STAT curr_items ")[1].split(b"\r\n")[0])

        # Until the count stays put: a get that went on taking would bring it
        # down by hundreds between two looks.
        before, left = -1, items()
        deadline = time.monotonic() + 10
        while left != before and time.monotonic() < deadline:
            time.sleep(0.3)
            before, left = left, items()
    assert left == before and left >= count - 10 * 32, (before, left)


def test_queues_made_and_deleted_across_crashes_can_still_be_deleted(tmp_path: Path) -> None:
    """Queues made, deleted, flushed and expired while the daemon is killed again
    and again: afterwards `flush_all` deletes every queue. (A transactional remove
    of a file no handle of the run had opened could fail with ENOENT, on a log
    file removed since, until the queue was read once.)"""
    config = '[queues."*"]\nsync = "none"\n[queues."idle*"]\nidle_expiry = 1\n'
    rnd = random.Random(24337)
    errors: list[str] = []

    def load(address: tuple[str, int], until: float, seed: int) -> None:
        pick = random.Random(seed)
        client = Client(address, timeout=5)
        while time.monotonic() < until:
            n, k = pick.randint(0, 3000), pick.random()
            try:
                if k < 0.4:
                    client.set(f"q{n}", b"abc", noreply=False)
                elif k < 0.55:
                    client.delete(f"q{n}", noreply=False)
                elif k < 0.65:
                    client.set(f"idle{n}", b"z", noreply=False)
                    client.get(f"idle{n}")
                elif k < 0.7:
                    client.set("jobs", b"j", noreply=False)
                elif k < 0.75:
                    client.get(f"jobs+c{n % 50}")
                elif k < 0.755:
                    client.flush_all(noreply=False)
                else:
                    client.get(f"q{n}")
            except (OSError, MemcacheUnexpectedCloseError):
                return  # killed (a MemcacheServerError too: before it)
            except MemcacheServerError as error:
                errors.append(str(error))

    with Daemon(tmp_path, backend="bdb", config_text=config) as daemon:
        for round_ in range(6):
            until = time.monotonic() + rnd.uniform(1.0, 3.0)
            loads = [
                threading.Thread(target=load, args=(daemon.address, until + 10, round_ * 10 + i))
                for i in range(6)
            ]
            for thread in loads:
                thread.start()
            time.sleep(until - time.monotonic())
            daemon.kill()
            for thread in loads:
                thread.join()
            daemon.start()
        Raw(daemon.address).call(b"flush_all\r\n", b"OK\r\n")
        assert errors == []
        assert "No such file" not in daemon.log()
