"""Quick checks that the load generator counts what the server saw.

Each test starts its own memcached on a free loopback port; they are skipped
where memcached is not installed. The whole file runs in a few seconds.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from harness import Server, memcache_stats, memcached
from loadgen import LoadSpec, MemcacheWire, Plan, run_load

needs_memcached = pytest.mark.skipif(
    shutil.which("memcached") is None, reason="memcached is not installed"
)


@pytest.fixture
def server() -> Iterator[Server]:
    with memcached(threads=1) as srv:
        yield srv


def _counters(port: int) -> tuple[int, int, int]:
    st = memcache_stats(port)
    return int(st["cmd_set"]), int(st["cmd_get"]), int(st["get_hits"])


@needs_memcached
@pytest.mark.parametrize("processes", [1, 2])
def test_op_bound_is_exact(server: Server, processes: int) -> None:
    # An odd total over connections and depths that do not divide it: the
    # last batches must be cut so that exactly `ops` commands are sent.
    ops = 10_007
    before = _counters(server.port)
    res = run_load(
        LoadSpec(
            host="127.0.0.1",
            port=server.port,
            connections=7,
            processes=processes,
            depth=5,
            duration=None,
            ops=ops,
            max_seconds=30,
        )
    )
    after = _counters(server.port)
    sets, gets, hits = (a - b for a, b in zip(after, before, strict=True))
    assert res.errors == []
    assert res.ops == ops == sets + gets
    assert res.hits == hits == gets  # a set before every get on the key
    assert len(res.latencies) == res.batches


@needs_memcached
def test_duration_bound_stops_and_counts(server: Server) -> None:
    before = _counters(server.port)
    res = run_load(
        LoadSpec(host="127.0.0.1", port=server.port, connections=4, depth=16, duration=0.5)
    )
    after = _counters(server.port)
    sets, gets, _ = (a - b for a, b in zip(after, before, strict=True))
    assert res.errors == []
    assert 0 < res.ops == sets + gets
    assert 0.4 < res.elapsed < 5
    assert 0 < res.p50 <= res.p99


def test_plan_cuts_the_last_batch() -> None:
    wire = MemcacheWire("q", 10)
    plan = Plan(wire, "queue", 3)
    # A set/get cycle in batches of three: set,get,set then get,set,get.
    assert [b.data.count(b"set ") for b in plan.batches] == [2, 1]
    short = plan.batch(1, 2)
    assert short.ops == 2 and short.data.startswith(b"get q\r\nset q")


def test_unique_bodies_differ() -> None:
    plan = Plan(MemcacheWire("q", 40), "set", 4, unique=True)
    bodies = [plan.batch(i, None).data for i in range(3)]
    assert len(set(bodies)) == 3
    assert all(len(line) == 40 for b in bodies for line in b.split(b"\r\n")[1::2])
