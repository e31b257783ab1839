"""The Redis listener benchmark: LPUSH/RPOP on mqd's Redis listener, against
mqd's memcached listener (set/get) on the same backend and against Redis
itself, all in one run and driven by memtier_benchmark.

Loads (the shapes of /work/shared/tools/README; 16 connections as 4 threads
x 4 connections, 100-byte values, one queue):

  memcached wire   -P memcache_text --ratio=1:1, key q1: every set an enqueue, every get a dequeue
  Redis wire       -P redis --command="LPUSH q __data__" --command="RPOP q"

Systems, each started on free loopback ports with a fresh temporary data
directory, measured, and stopped before the next starts:

  mqd memory       one daemon, both listeners: memcached wire, then Redis wire
  redis            redis-server, no persistence (--save "" --appendonly no)
  mqd bdb always   one daemon, both listeners, [queues."*"] sync = "always"
  redis always     redis-server --appendonly yes --appendfsync always

Printed: ops/s (every LPUSH and every RPOP counts), p50/p99 latency in ms,
and the ratios mqd Redis / mqd memcached (target >= 0.85) and mqd Redis /
Redis (for bdb: target >= 1.0 against appendfsync always).

Usage: python benchmarks/run_redis.py [--quick] [--test-time S] [--pipeline 1,16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from harness import (
    HOST,
    Server,
    console,
    find_mqd,
    fmt_ms,
    fmt_rate,
    fmt_ratio,
    free_port,
    listens,
    mqd,
    print_table,
)

# Where the project's shared tools sit beside a checkout of the repository.
SHARED_MEMTIER = Path(__file__).resolve().parents[2] / "shared" / "tools" / "memtier_benchmark"
MEMCACHE_LOAD = ["-P", "memcache_text", "--ratio=1:1", "--key-prefix=q", "--key-minimum=1"]
MEMCACHE_LOAD += ["--key-maximum=1", "--key-pattern=P:P"]
REDIS_LOAD = ["-P", "redis", "--command=LPUSH q __data__", "--command=RPOP q"]


@dataclass
class Result:
    ops: float
    p50: float
    p99: float


@dataclass
class Options:
    memtier: str
    test_time: int
    repeat: int
    threads: int
    clients: int
    size: int
    exe: str
    loop: str | None
    base_dir: str | None


def memtier(o: Options, port: int, load: list[str], pipeline: int) -> Result:
    """One memtier_benchmark run; its JSON totals."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        argv = [o.memtier, "-s", HOST, "-p", str(port), "-t", str(o.threads), "-c", str(o.clients)]
        argv += [f"--pipeline={pipeline}", f"--test-time={o.test_time}", "--hide-histogram"]
        argv += ["-d", str(o.size), f"--json-out-file={out.name}", *load]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=o.test_time + 120)
        if done.returncode != 0:
            raise RuntimeError(f"memtier_benchmark failed: {done.stderr[-2000:]}")
        totals = json.loads(Path(out.name).read_text())["ALL STATS"]["Totals"]
    latencies = totals["Percentile Latencies"]
    return Result(totals["Ops/sec"], latencies["p50.00"], latencies["p99.00"])


def median(results: list[Result]) -> Result:
    return sorted(results, key=lambda r: r.ops)[len(results) // 2]


def mqd_both(o: Options, backend: str, sync: str) -> tuple[Server, int]:
    """An mqd daemon serving both wires; returns it and its Redis port."""
    redis_port = free_port()
    config = f'[server.redis]\nport = {redis_port}\n\n[queues."*"]\nsync = "{sync}"\n'
    server = mqd(backend, exe=o.exe, loop=o.loop, config=config, base_dir=o.base_dir).start()
    deadline = time.monotonic() + 30
    while not listens(server.pid, redis_port):
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"mqd did not listen on its Redis port: {server.state()}")
        time.sleep(0.05)
    return server, redis_port


def redis_server(o: Options, persistence: list[str], name: str) -> Server:
    argv = ["redis-server", "--bind", HOST, "--port", "{port}", "--dir", "{dir}", "--save", ""]
    return Server(name, argv + persistence, base_dir=o.base_dir).start()


def measure(o: Options, backend: str, sync: str, redis_args: list[str], pipeline: int) -> list[str]:
    """One table row: mqd memcached, mqd Redis and Redis, alternated `repeat` times."""
    runs: dict[str, list[Result]] = {"mc": [], "mqd": [], "redis": []}
    for _ in range(o.repeat):
        server, redis_port = mqd_both(o, backend, sync)
        try:
            runs["mc"].append(memtier(o, server.port, MEMCACHE_LOAD, pipeline))
            runs["mqd"].append(memtier(o, redis_port, REDIS_LOAD, pipeline))
        finally:
            server.stop()
        reference = redis_server(o, redis_args, "redis")
        try:
            runs["redis"].append(memtier(o, reference.port, REDIS_LOAD, pipeline))
        finally:
            reference.stop()
    mc, red, ref = (median(runs[k]) for k in ("mc", "mqd", "redis"))
    cells = [fmt_rate(mc.ops), fmt_rate(red.ops), f"{fmt_ms(red.p50)}/{fmt_ms(red.p99)}"]
    cells += [fmt_rate(ref.ops), f"{fmt_ms(ref.p50)}/{fmt_ms(ref.p99)}"]
    return [*cells, fmt_ratio(red.ops, mc.ops), fmt_ratio(red.ops, ref.ops)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 s runs, once (a smoke check)")
    p.add_argument("--test-time", type=int, default=None, help="seconds per run (default 5)")
    p.add_argument("--repeat", type=int, default=None, help="runs per system, medians (default 3)")
    p.add_argument("--pipeline", default="1,16", help="comma-separated pipeline depths")
    p.add_argument("--threads", type=int, default=4, help="memtier threads")
    p.add_argument("--clients", type=int, default=4, help="memtier connections per thread")
    p.add_argument("--size", type=int, default=100, help="value bytes")
    p.add_argument("--backends", default="memory,bdb", help="memory, bdb or both")
    p.add_argument("--loop", default="uvloop", help="mqd --loop value")
    p.add_argument("--mqd", default=None, help="mqd executable (default: beside this Python)")
    p.add_argument(
        "--memtier", default=None, help="memtier_benchmark (default: shared/tools, PATH)"
    )
    p.add_argument("--tmpdir", default=None, help="where data directories go (default: TMPDIR)")
    a = p.parse_args(argv)
    tool = a.memtier or (str(SHARED_MEMTIER) if SHARED_MEMTIER.exists() else None)
    tool = tool or shutil.which("memtier_benchmark")
    if tool is None:
        p.error("memtier_benchmark not found: pass --memtier PATH")
    if shutil.which("redis-server") is None:
        p.error("redis-server not found: apt-get install redis-server")
    o = Options(
        memtier=tool,
        test_time=a.test_time or (2 if a.quick else 5),
        repeat=a.repeat or (1 if a.quick else 3),
        threads=a.threads,
        clients=a.clients,
        size=a.size,
        exe=find_mqd(a.mqd),
        loop=a.loop,
        base_dir=a.tmpdir,
    )
    connections = o.threads * o.clients
    console.print(
        f"memtier_benchmark, {connections} connections, {o.size}-byte values, "
        f"{o.test_time} s per run, median of {o.repeat}; data under "
        f"{a.tmpdir or os.environ.get('TMPDIR', '/tmp')}. A shared machine: figures are noisy."
    )
    setups = {
        "memory": ("memory", "none", ["--appendonly", "no"], "redis: no persistence"),
        "bdb": (
            "bdb",
            "always",
            ["--appendonly", "yes", "--appendfsync", "always"],
            "redis: always",
        ),
    }
    rows = []
    for name in a.backends.split(","):
        backend, sync, redis_args, reference = setups[name.strip()]
        for pipeline in (int(d) for d in a.pipeline.split(",")):
            label = f"mqd {backend} (sync {sync}) vs {reference}, pipeline {pipeline}"
            rows.append([label, *measure(o, backend, sync, redis_args, pipeline)])
    columns = ["load: LPUSH+RPOP (mqd memcached: set+get)", "mqd memcached ops/s"]
    columns += ["mqd redis ops/s", "p50/p99 ms", "redis ops/s", "p50/p99 ms"]
    columns += ["mqd redis / mqd memcached", "mqd redis / redis"]
    print_table("Redis listener", columns, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
