"""Aerospike backend benchmark: throughput, latency, Aerospike calls per message, wake-ups.

Starts one in-memory Aerospike node (the server build in ../shared/aerospike
or MQD_AEROSPIKE_DIR; or uses MQD_AEROSPIKE_HOSTS=host:port), then for
shards = 1 and shards = 8 an mqd daemon on it, and measures:

- enqueue+dequeue: C producer connections (`set`, each waiting for STORED)
  and C consumer connections (`get q/t=200`) at once, for C = 1, 8, 50;
  messages out per second, the consumers' p50/p99 round trip, and Aerospike
  calls per message (every call the node answered during the run, by its own
  counters, over the messages that went through);
- the same load on mqd's memory backend in the same run, as the reference the
  ratios are given against;
- producers alone (16 connections): calls per message stored, where batching
  (one lock and one commit for every pending set) shows;
- cross-daemon wake-up: a `get q/t=2000` waiting on daemon B, a `set` on
  daemon A; the time from A's STORED to B's VALUE, against the poll interval.

Every figure on this 2-core machine shares it with the node, the daemon and
the load generator: read the ratios and the calls per message (which noise
does not change), not the absolute rates.

Usage: python benchmarks/run_aerospike.py [--quick] [--duration S]
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
import uuid
from dataclasses import replace

from harness import (
    HOST,
    Server,
    checked_load,
    console,
    fmt_ms,
    fmt_rate,
    fmt_ratio,
    mqd,
    print_table,
)
from loadgen import LoadResult, LoadSpec

POLL_MS = 50


def config(host: str, prefix: str, shards: int) -> str:
    return f"""
[storage]
poll_interval_ms = {POLL_MS}

[storage.aerospike]
hosts = ["{host}"]
set_prefix = "{prefix}"
shards = {shards}
max_item_size = 4096
"""


def pair(
    server: Server, connections: int, duration: float, queue: str
) -> tuple[LoadResult, LoadResult]:
    """Producers and consumers at once; (producers' result, consumers' result)."""
    base = LoadSpec(host=HOST, port=server.port, connections=connections, duration=duration)
    produce = replace(base, workload="set", queue=queue, size=100)
    consume = replace(base, workload="get", queue=queue, get_suffix="/t=200")
    out: dict[str, LoadResult] = {}

    def run(name: str, spec: LoadSpec) -> None:
        out[name] = checked_load(server, spec)

    threads = [
        threading.Thread(target=run, args=("p", produce)),
        threading.Thread(target=run, args=("c", consume)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out["p"], out["c"]


def reference(connections: list[int], duration: float) -> dict[int, float]:
    """msgs/s of the memory backend under the same load: what the ratios are against."""
    rates = {}
    with mqd("memory", config="") as server:
        for c in connections:
            _, consumed = pair(server, c, duration, f"ref{c}")
            rates[c] = consumed.hits / consumed.elapsed
    return rates


def wake_ups(host: str, prefix: str, samples: int) -> list[float]:
    """Seconds from a set's STORED on one daemon to a waiting get's VALUE on another."""
    text = config(host, prefix, 1)
    delays = []
    with (
        mqd("aerospike", config=text, name="mqd-a") as a,
        mqd("aerospike", config=text, name="mqd-b") as b,
    ):
        setter = socket.create_connection((HOST, a.port))
        getter = socket.create_connection((HOST, b.port))
        for i in range(samples):
            getter.sendall(b"get wake/t=2000\r\n")
            time.sleep(0.1 + (i % 7) / 100)  # the get is waiting, at a varied phase of the poll
            setter.sendall(b"set wake 0 0 1\r\nx\r\n")
            _read_until(setter, b"STORED\r\n")
            stored = time.monotonic()
            _read_until(getter, b"END\r\n")
            delays.append(time.monotonic() - stored)
        setter.close()
        getter.close()
    return delays


def _read_until(sock: socket.socket, end: bytes) -> bytes:
    buf = b""
    while not buf.endswith(end):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {buf!r}")
        buf += chunk
    return buf


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 s per row, fewer wake-ups")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per row")
    args = parser.parse_args()
    try:
        from mqd_aerospike.server import calls_served, node, unavailable
    except ImportError:
        console.print("mqd-aerospike is not installed: pip install -e plugins/aerospike")
        return 0
    reason = unavailable()
    if reason:
        console.print(f"skipped: {reason}")
        return 0
    duration = 2.0 if args.quick else args.duration
    connections = [1, 8, 50]
    rows = []
    with node(data_size="2G") as server_node:
        host = server_node.host
        ref = reference(connections, duration)
        for shards in (1, 8):
            prefix = f"b{uuid.uuid4().hex[:8]}"
            with mqd("aerospike", config=config(host, prefix, shards)) as server:
                for c in connections:
                    before = calls_served(host)
                    produced, consumed = pair(server, c, duration, f"q{c}")
                    calls = calls_served(host) - before
                    rate = consumed.hits / consumed.elapsed
                    rows.append(
                        [
                            str(shards),
                            str(c),
                            fmt_rate(rate),
                            fmt_ratio(rate, ref[c]),
                            fmt_ms(consumed.p50),
                            fmt_ms(consumed.p99),
                            fmt_ms(produced.p99),
                            f"{calls / max(consumed.hits, 1):.2f}",
                        ]
                    )
                before = calls_served(host)
                stored = checked_load(
                    server,
                    LoadSpec(
                        host=HOST,
                        port=server.port,
                        workload="set",
                        connections=16,
                        duration=duration,
                        queue="solo",
                    ),
                )
                calls = calls_served(host) - before
                rows.append(
                    [
                        str(shards),
                        "16 producers alone",
                        fmt_rate(stored.ops_per_s),
                        "",
                        "",
                        "",
                        fmt_ms(stored.p99),
                        f"{calls / max(stored.ops, 1):.2f}",
                    ]
                )
        print_table(
            f"mqd aerospike, {duration:g} s per row (msgs/s: messages out;"
            " ratio against mqd memory, same load, same run)",
            [
                "shards",
                "consumers (+ as many producers)",
                "msgs/s",
                "vs memory",
                "get p50",
                "get p99",
                "set p99",
                "calls/msg",
            ],
            rows,
        )
        delays = wake_ups(host, f"w{uuid.uuid4().hex[:8]}", 20 if args.quick else 60)
        p50, p99, top = (
            x * 1000 for x in (percentile(delays, 50), percentile(delays, 99), max(delays))
        )
        console.print(
            f"cross-daemon wake-up over {len(delays)} sets: p50 {p50:.1f} ms, p99 {p99:.1f} ms,"
            f" max {top:.1f} ms (poll interval {POLL_MS} ms)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
