"""Three real daemons on one Aerospike node, with one killed and one frozen under load.

Producers send unique ids with `set` to any live daemon; consumers on every
daemon take them with reliable reads (`get q/t=200/open`, then `get q/close`).
While they run, daemon 0 is killed with SIGKILL (its open messages come back
through the others after the visibility timeout) at a moment none of its
consumers has a `close` on its way (see kill_holding_leases), and daemon 1 is frozen with
SIGSTOP while it holds a queue's lock, kept frozen past the lock's lease while
the others go on, and resumed: its commit must be refused or its write fenced
off. Then the books must balance:

- every message that got STORED was closed by some consumer;
- none was closed twice, and none was handed out again unless it was open on
  a daemon or connection that died;
- nothing was delivered that was never sent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aerospike
from mqd_aerospike.server import Node
from pymemcache.client.base import Client
from pymemcache.exceptions import MemcacheServerError, MemcacheUnexpectedCloseError

from mqd.testing.daemon import Daemon

from .conftest import prefix_for

QUEUE = "chaos"
LEASE_MS = 300
VISIBILITY = 3.0


def connect(daemon: Daemon) -> Client:
    return Client(daemon.address, connect_timeout=3, timeout=3)


class Books:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: set[bytes] = set()
        self.stored: set[bytes] = set()
        self.opened: Counter[bytes] = Counter()
        self.closed: Counter[bytes] = Counter()
        self.abandoned: set[bytes] = set()  # open on a connection that died
        # Per daemon: `close`s sent and not yet answered, and whether it was killed.
        self.closing: Counter[int] = Counter()
        self.killed: set[int] = set()
        self.errors: list[str] = []

    def problems(self) -> list[str]:
        out = list(self.errors)
        missing = self.stored - set(self.closed)
        if missing:
            out.append(f"{len(missing)} stored, never closed: {sorted(missing)[:5]}")
        twice = [m for m, n in self.closed.items() if n > 1]
        if twice:
            out.append(f"closed more than once: {twice[:5]}")
        again = [m for m, n in self.opened.items() if n > 1 and m not in self.abandoned]
        if again:
            out.append(f"handed out again though never abandoned: {again[:5]}")
        strange = set(self.opened) - self.sent
        if strange:
            out.append(f"delivered, never sent: {sorted(strange)[:5]}")
        return out


def produce(daemons: list[Daemon], index: int, books: Books, stop: threading.Event) -> None:
    n = 0
    target = index
    client: Client | None = None
    while not stop.is_set():
        try:
            if client is None:
                client = connect(daemons[target % len(daemons)])
            message = b"p%d-%d" % (index, n)
            n += 1
            with books.lock:
                books.sent.add(message)
            if client.set(QUEUE, message, noreply=False):
                with books.lock:
                    books.stored.add(message)
            else:
                books.errors.append(f"set of {message!r} not stored")
            time.sleep(0.002)
        except MemcacheServerError:
            continue  # SERVER_ERROR: maybe stored, maybe not; never counted as STORED
        except (MemcacheUnexpectedCloseError, OSError):
            client = None
            target += 1  # that daemon is dead or frozen: go to another
            time.sleep(0.05)


def consume(daemons: list[Daemon], index: int, books: Books, stop: threading.Event) -> None:
    daemon = daemons[index]
    client: Client | None = None
    while not stop.is_set():
        held = None
        try:
            if client is None:
                client = connect(daemon)
            held = client.get(f"{QUEUE}/t=200/open")
            if held is None:
                continue
            with books.lock:
                books.opened[held] += 1
            time.sleep(0.02)  # work on it: a kill now finds it open
            with books.lock:
                if index in books.killed:
                    raise ConnectionAbortedError("its daemon was killed")
                books.closing[index] += 1
            try:
                assert client.get(f"{QUEUE}/close") is None
            finally:
                with books.lock:
                    books.closing[index] -= 1
            with books.lock:
                books.closed[held] += 1
        except (MemcacheUnexpectedCloseError, MemcacheServerError, OSError):
            if held is not None:
                with books.lock:
                    books.abandoned.add(held)
            client = None
            time.sleep(0.1)


def config(node: Node, prefix: str, n: int) -> str:
    return f"""
[storage]
daemon_id = "d{n}"
reclaim_interval = 0.2
poll_interval_ms = 20

[storage.aerospike]
hosts = ["{node.host}"]
set_prefix = "{prefix}"
lock_lease_ms = {LEASE_MS}
total_timeout_ms = 1000

[queues."*"]
visibility_timeout = {VISIBILITY}
"""


def queue_state(node: Node, prefix: str) -> dict[str, Any]:
    """The queue's metadata record, read straight from the node."""
    host, port = node.host.rsplit(":", 1)
    client = aerospike.client({"hosts": [(host, int(port))]}).connect()
    try:
        key = ("test", f"{prefix}_meta", bytearray(b"0\0" + QUEUE.encode()))
        return dict(client.get(key)[2])
    finally:
        client.close()


def lock_holder(node: Node, prefix: str) -> str:
    bins = queue_state(node, prefix)
    return str(bins.get("lo") or "") if bins.get("lx", 0) > time.time() * 1000 else ""


def kill_holding_leases(
    daemons: list[Daemon], index: int, books: Books, node: Node, prefix: str
) -> bool:
    """SIGKILL daemon `index` once it holds open messages; False if it never did in time.

    Never while one of its consumers waits for the answer to a `close`: the
    daemon may have removed that message and died before saying so, and a
    message nobody can tell was closed or lost would leave the books unbalanced
    either way. Killed between a `get` and its `close`, each message it held
    stays open in the store and must come back through the others.
    """
    owner = f"d{index}"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        leases = queue_state(node, prefix).get("open") or {}
        if any(lease[1] == owner for lease in leases.values()):
            with books.lock:
                if not books.closing[index]:
                    daemons[index].kill()
                    books.killed.add(index)
                    return True
        time.sleep(0.01)
    with books.lock:
        daemons[index].kill()
        books.killed.add(index)
    return False


def freeze_holding_lock(daemon: Daemon, node: Node, prefix: str, owner: str) -> bool:
    """SIGSTOP `daemon` at a moment the queue's lock is its own; False if never caught so."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if lock_holder(node, prefix).startswith(owner + "/"):
            daemon.signal(signal.SIGSTOP)
            if lock_holder(node, prefix).startswith(owner + "/"):
                return True
            daemon.signal(signal.SIGCONT)
    daemon.signal(signal.SIGSTOP)
    return False


def test_three_daemons_one_killed_one_frozen_lose_and_double_nothing(
    aerospike_node: Node, tmp_path: Path
) -> None:
    prefix = prefix_for(tmp_path)
    daemons = []
    for n in range(3):
        workdir = tmp_path / f"d{n}"
        workdir.mkdir()
        daemons.append(Daemon(workdir, "aerospike", config(aerospike_node, prefix, n)).start())
    books = Books()
    stop_producing, stop_consuming = threading.Event(), threading.Event()
    threads = [
        threading.Thread(target=produce, args=(daemons, i, books, stop_producing)) for i in range(3)
    ]
    threads += [
        threading.Thread(target=consume, args=(daemons, n, books, stop_consuming))
        for n in range(len(daemons))
        for _ in range(2)
    ]
    try:
        for t in threads:
            t.start()
        time.sleep(1.0)
        killed_holding = kill_holding_leases(daemons, 0, books, aerospike_node, prefix)
        time.sleep(0.5)
        caught = freeze_holding_lock(daemons[1], aerospike_node, prefix, "d1")
        time.sleep(LEASE_MS / 1000 * 3)  # the others break its lock and go on
        daemons[1].signal(signal.SIGCONT)
        time.sleep(1.0)
        stop_producing.set()
        deadline = time.monotonic() + VISIBILITY + 10
        while time.monotonic() < deadline and not books.stored <= set(books.closed):
            time.sleep(0.2)
        stop_consuming.set()
        for t in threads:
            t.join(10)
        log = daemons[1].log()
        refused = log.count("commit refused, lock was broken")
        fenced = log.count("write fenced off, lock was broken")
        print(
            f"stored {len(books.stored)}, closed {sum(books.closed.values())}, "
            f"abandoned {len(books.abandoned)}; killed holding leases: {killed_holding}; "
            f"frozen while holding the lock: {caught}; "
            f"its commits refused {refused}, writes fenced {fenced}"
        )
        problems = books.problems()
        assert not problems, "\n".join(problems) + "\n" + log[-3000:]
        assert len(books.stored) > 200
        assert killed_holding, "daemon 0 never held an open message"
        assert caught, "daemon 1 was never caught holding the lock"
        assert refused + fenced >= 1, log[-3000:]
    finally:
        stop_producing.set()
        stop_consuming.set()
        for d in daemons:
            if d.process is not None and d.process.poll() is None:
                os.kill(d.pid, signal.SIGCONT)
            d.kill()


def test_a_second_daemon_on_the_same_data_dir_without_an_id_is_refused(
    aerospike_node: Node, tmp_path: Path
) -> None:
    """Its id, kept in the data directory, would be the first one's: each would
    take the other's open messages for its own."""
    config = '[storage]\nbackend = "aerospike"\n' + aerospike_node.storage_table(
        prefix_for(tmp_path)
    )
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    with Daemon(tmp_path / "a", "aerospike", config) as first:
        second = Daemon(tmp_path / "b", "aerospike", config)
        second.data_dir = first.data_dir
        done = subprocess.run(second.command(), capture_output=True, text=True, timeout=60)
        assert done.returncode == 1
        assert done.stderr.strip() == (
            f"Error: {first.data_dir / 'daemon-id'}: in use by another daemon; give each "
            "daemon its own data directory, or its own [storage] daemon_id"
        )
        assert first.process is not None and first.process.poll() is None
