"""Fanout children, dead-letter redrive and idle-queue expiry, through a real daemon."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import Raw, store, value
from pymemcache.client.base import Client

from mqd.testing.daemon import Daemon


def test_children_get_every_later_message(daemon: Daemon, raw: Raw, q: str) -> None:
    store(raw, q, b"before")
    mc = Client(daemon.address)
    assert mc.get(f"{q}+audit") is None  # the child comes into being here
    assert mc.get(f"{q}+billing") is None
    for text in (b"one", b"two"):
        store(raw, q, text)
    assert [mc.get(f"{q}+audit"), mc.get(f"{q}+audit")] == [b"one", b"two"]
    assert [mc.get(f"{q}+billing"), mc.get(f"{q}+billing")] == [b"one", b"two"]
    assert [mc.get(q) for _ in range(3)] == [b"before", b"one", b"two"]
    queues = mc.stats("queues")
    audit = f"queue_{q}+audit_".encode()
    # The copies count as the child's own: stored, then taken.
    assert [queues[audit + name] for name in (b"items", b"enqueued", b"dequeued")] == [0, 2, 2]
    # Deleting the parent leaves its children; a deleted child stops receiving.
    raw.call(b"delete %b\r\n" % q.encode(), b"DELETED\r\n")
    raw.call(b"delete %b+billing\r\n" % q.encode(), b"DELETED\r\n")
    store(raw, q, b"three")
    assert mc.get(f"{q}+audit") == b"three"
    assert mc.get(f"{q}+billing") is None
    mc.close()


@pytest.mark.parametrize("first", ["/open", "/t=10/open", "/close/open", "/peek", "/lease=w/n=1"])
def test_a_child_named_first_by_any_read_gets_what_comes_next(raw: Raw, q: str, first: str) -> None:
    """A consumer that only ever opens (Kestrel's reliable read) names its child so."""
    verb = b"gets" if "lease" in first else b"get"
    raw.call(b"%b %b+c%b\r\n" % (verb, q.encode(), first.encode()), b"END\r\n")
    store(raw, q, b"m")
    raw.call(b"get %b+c\r\n" % q.encode(), value(q + "+c", b"m") + b"END\r\n")


@pytest.mark.parametrize("backend", ["memory", "bdb"])
def test_a_get_waiting_on_a_child_wakes_at_a_set_to_its_parent(
    backend: str, tmp_path: Path
) -> None:
    with Daemon(tmp_path, backend=backend) as d:
        waiting = Raw(d.address)
        waiting.call(b"get jobs+audit\r\n", b"END\r\n")  # the child comes into being
        waiting.send(b"get jobs+audit/t=10000\r\n")
        time.sleep(0.3)  # it waits
        started = time.monotonic()
        store(Raw(d.address), "jobs", b"hi")
        assert waiting.read_until(b"END\r\n") == value("jobs+audit/t=10000", b"hi") + b"END\r\n"
        # Woken by the set, not at the end of its 10 s.
        assert time.monotonic() - started < 5
        waiting.call(b"get jobs\r\n", value("jobs", b"hi") + b"END\r\n")  # the parent's own
        waiting.close()


def test_a_full_child_refuses_for_itself(daemon: Daemon, raw: Raw) -> None:
    parent = "fan" + str(time.monotonic_ns())
    raw.call(b"get %b+full\r\n" % parent.encode(), b"END\r\n")
    store(raw, parent, b"1")
    store(raw, parent, b"2")  # the child holds one: the parent still says STORED
    mc = Client(daemon.address)
    stats = mc.stats("queues")
    mc.close()
    assert stats[f"queue_{parent}+full_enqueued".encode()] == 1  # the refused copy is not
    raw.call(b"get %b+full\r\n" % parent.encode(), value(parent + "+full", b"1") + b"END\r\n")
    raw.call(b"get %b+full\r\n" % parent.encode(), b"END\r\n")


def test_a_unique_child_keeps_one_copy_of_a_body(raw: Raw) -> None:
    parent = "fan" + str(time.monotonic_ns())
    raw.call(b"get %b+once\r\n" % parent.encode(), b"END\r\n")
    for body in (b"x", b"x", b"y"):
        store(raw, parent, body)  # the parent is not unique: it stores all three
    child = parent + "+once"
    raw.call(b"get %b\r\n" % child.encode(), value(child, b"x") + b"END\r\n")
    raw.call(b"get %b\r\n" % child.encode(), value(child, b"y") + b"END\r\n")
    raw.call(b"get %b\r\n" % child.encode(), b"END\r\n")


def test_redrive_command_and_cli(daemon: Daemon, raw: Raw) -> None:
    # dlx.* queues dead-letter after one delivery into "graveyard".
    queue = "dlx." + str(time.monotonic_ns())
    count = 1000
    raw.send(b"".join(b"set %b 0 0 4\r\n%04d\r\n" % (queue.encode(), i) for i in range(count)))
    assert raw.read(8 * count) == b"STORED\r\n" * count
    for _ in range(count):
        conn = Raw(daemon.address)
        conn.send(b"get %b/open\r\n" % queue.encode())
        conn.read_until(b"END\r\n")
        conn.close()  # gone without closing: to the dead letters
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        raw.send(b"stats queues\r\n")
        lines = raw.read_until(b"END\r\n")
        if b"STAT queue_graveyard_items %d\r\n" % count in lines:
            break
        time.sleep(0.05)
    raw.call(b"redrive graveyard 10\r\n", b"MOVED 10\r\n")
    raw.call(b"redrive graveyard\r\n", b"CLIENT_ERROR bad command line format\r\n")
    raw.call(b"redrive graveyard 0\r\n", b"CLIENT_ERROR bad command line format\r\n")
    host, port = daemon.address
    args = ["redrive", "graveyard", "--host", host, "--port", str(port)]
    done = subprocess.run(
        [sys.executable, "-m", "mqd", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "moved 990 message(s) from graveyard" in done.stdout
    wrong = subprocess.run(
        [sys.executable, "-m", "mqd", "redrive", "graveyard", "--port", "70000"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert wrong.returncode == 2 and "70000 is not in the range" in wrong.stderr, wrong.stderr
    bodies = []
    for _ in range(count // 100):
        raw.send(b"get " + b" ".join([queue.encode()] * 100) + b"\r\n")
        reply = raw.read_until(b"END\r\n")
        bodies += [line for line in reply.split(b"\r\n") if line[:1].isdigit()]
    bodies.sort()
    assert bodies == [b"%04d" % i for i in range(count)]
    raw.call(b"redrive nothing-here 5 elsewhere\r\n", b"MOVED 0\r\n")


def test_a_queue_read_by_range_is_not_idle(daemon: Daemon, raw: Raw) -> None:
    """A reader that follows a queue by id (`gets q/at=<next>/n=...`) names it:
    were it removed as idle, a new message would start again at id 0, before
    where the reader looks."""
    queue = "idle.r" + str(time.monotonic_ns())
    store(raw, queue, b"x")
    raw.call(b"get %b\r\n" % queue.encode(), value(queue, b"x") + b"END\r\n")
    for _ in range(10):  # 2 s of reads, four times idle_expiry (0.5 s)
        raw.call(b"gets %b/at=1/n=100\r\n" % queue.encode(), b"END\r\n")
        time.sleep(0.2)
    store(raw, queue, b"new")
    raw.call(
        b"gets %b/at=1/n=100\r\n" % queue.encode(),
        b"VALUE %b/at=1/n=100 0 3 1\r\nnew\r\nEND\r\n" % queue.encode(),
    )
    assert f"queue {queue!r} expired" not in daemon.log()


def test_idle_queue_expires_but_not_one_with_an_open_message(daemon: Daemon, raw: Raw) -> None:
    idle, held = "idle.a" + str(time.monotonic_ns()), "idle.b" + str(time.monotonic_ns())
    for name in (idle, held):
        store(raw, name, b"x")
    raw.call(b"get %b\r\n" % idle.encode(), value(idle, b"x") + b"END\r\n")
    holder = Raw(daemon.address)
    holder.call(b"get %b/open\r\n" % held.encode(), value(held + "/open", b"x") + b"END\r\n")
    deadline = time.monotonic() + 5
    gone = False
    while time.monotonic() < deadline and not gone:
        time.sleep(0.2)
        raw.send(b"stats queues\r\n")
        lines = raw.read_until(b"END\r\n")
        gone = f"queue_{idle}_items".encode() not in lines
    assert gone
    assert f"queue_{held}_items".encode() in lines
    assert f"queue {idle!r} expired" in daemon.log()
    holder.close()
