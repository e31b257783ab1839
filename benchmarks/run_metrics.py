"""What Prometheus metrics cost: the same load on mqd with metrics off and on.

In one run, it starts two mqd daemons (memory backend) on free loopback
ports, one without metrics (the reference) and one with `[metrics] port`
set, and measures:

1. enqueue+dequeue throughput and batch latency (p50/p99) at 16 connections,
   one and 16 commands per write, alternating the two daemons `--repeat`
   times and keeping each one's median run; the table gives the ratio
   metrics-on/metrics-off per row (the cost of timing every command);
2. the time of one scrape of /metrics with `--queues` queues holding a
   message each (the figures are gathered on the event loop, like `stats`),
   against the time of one `stats` command on the same daemon.

Usage: python benchmarks/run_metrics.py [--quick] [--duration S]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import urllib.request

from harness import (
    HOST,
    Server,
    checked_load,
    console,
    fill,
    fmt_ms,
    fmt_rate,
    fmt_ratio,
    free_port,
    median_run,
    mqd,
    print_table,
    ratio_row,
    text_command,
)
from loadgen import LoadResult, LoadSpec


def throughput(off: Server, on: Server, duration: float, repeat: int, depths: list[int]) -> None:
    rows = []
    for depth in depths:
        runs: dict[str, list[LoadResult]] = {"off": [], "on": []}
        for _ in range(repeat):
            for name, server in (("off", off), ("on", on)):
                # workload "queue" (set+get pairs) and 100-byte bodies: the defaults
                spec = LoadSpec(HOST, server.port, connections=16, depth=depth, duration=duration)
                runs[name].append(checked_load(server, spec))
        a, b = median_run(runs["off"]), median_run(runs["on"])
        for name in runs:
            spread = ", ".join(fmt_rate(r.ops_per_s) for r in runs[name])
            console.print(f"  16 x {depth} metrics {name}: runs {spread} ops/s")
        rows.append(ratio_row(f"16 x {depth}", a, b))
    print_table(
        "enqueue+dequeue, memory backend (ops/s counts each set and each get; latency = one "
        "batch round trip, ms)",
        ["conns x depth", "off ops/s", "p50", "p99", "on ops/s", "p50", "p99", "on/off"],
        rows,
    )


def scrape(on: Server, metrics_port: int, queues: int, samples: int) -> None:
    for i in range(queues):
        fill(on, f"scrape{i}", 1, 100)
    url = f"http://{HOST}:{metrics_port}/metrics"
    scrapes, stats = [], []
    size = 0
    for _ in range(samples):
        start = time.perf_counter()
        with urllib.request.urlopen(url, timeout=60) as reply:
            size = len(reply.read())
        scrapes.append(time.perf_counter() - start)
        start = time.perf_counter()
        text_command(on.port, b"stats\r\n", b"END\r\n")
        stats.append(time.perf_counter() - start)
    a, b = statistics.median(stats) * 1000, statistics.median(scrapes) * 1000
    print_table(
        f"one scrape of /metrics against one `stats`, {queues:,} queues (median of {samples}, ms)",
        ["stats", "scrape", "scrape/stats", "scrape bytes"],
        [[fmt_ms(a), fmt_ms(b), fmt_ratio(b, a), f"{size:,}"]],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="short rows (CI smoke check)")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per run (default 3)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per row and daemon")
    parser.add_argument("--queues", type=int, default=1000, help="queues for the scrape timing")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.repeat, args.queues = 1.0, 1, 100
    metrics_port = free_port()
    config = f"[metrics]\nport = {metrics_port}\n"
    off = mqd("memory", name="mqd-metrics-off")
    on = mqd("memory", name="mqd-metrics-on", config=config)
    console.print("This machine's figures are noisy: compare ratios within one run only.")
    with off, on:
        throughput(off, on, args.duration, args.repeat, [1, 16])
        scrape(on, metrics_port, args.queues, 5 if args.quick else 20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
