"""Durable backends benchmark: mqd's Berkeley DB backends against Redis lists
and beanstalkd, all writing to disk, in one run.

Systems, each started in turn on a free loopback port with a fresh temporary
data directory and stopped before the next one starts (so none of them
competes with another for the disk):

  mqd bdb            sync = "always"   (STORED after the flush; group commit)
  mqd bdb            sync = "periodic" (flushed every sync_interval_ms = 1000)
  mqd bdb-single     sync = "always"
  mqd bdb-random     sync = "always"
  redis always       appendonly yes, appendfsync always;   LPUSH / RPOP
  redis everysec     appendonly yes, appendfsync everysec; LPUSH / RPOP
  beanstalkd -f 0    binlog, fsync after every write;      put / reserve+delete

For each: enqueue throughput of 16 producer connections, each waiting for its
reply before sending the next message (how a producer that needs the ack
behaves), then 16 consumers draining what was stored. The table gives the
enqueue ratios against Redis (appendfsync always) and beanstalkd -f 0.

With --depth N, also: throughput of enqueue+dequeue pairs on an empty queue,
then the same after filling the queue with N messages, and the daemon's RSS
at that depth.

Usage: python benchmarks/run_bdb.py [--quick] [--duration S] [--depth 10000000]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from harness import (
    HOST,
    Checkout,
    Server,
    add_checkout_options,
    checked_load,
    checkouts,
    console,
    fill,
    fmt_ms,
    fmt_rate,
    fmt_ratio,
    median_run,
    memcache_stats,
    mqd,
    mqd_config,
    mqd_serve_flags,
    print_table,
    redis,
)
from loadgen import LoadResult, LoadSpec

REDIS_ALWAYS = "redis always"
BEANSTALKD = "beanstalkd -f 0"


@dataclass
class Options:
    duration: float
    repeat: int
    connections: int
    pipeline: int
    loop: str | None
    exe: str
    base_dir: str | None
    size: int
    depth: int
    depth_backend: str
    depth_sync: str
    depth_repeat: int


@dataclass(frozen=True)
class System:
    name: str
    wire: str
    start: Callable[[Options], Server]
    note: str


def _mqd(backend: str, sync: str, c: Checkout) -> Callable[[Options], Server]:
    def start(o: Options) -> Server:
        return mqd(
            backend,
            exe=c.exe,
            env=dict(c.env),
            loop=o.loop,
            config=mqd_config(sync),
            name=f"mqd-{backend}-{sync}",
            base_dir=o.base_dir,
        )

    return start


def _redis(fsync: str) -> Callable[[Options], Server]:
    return lambda o: redis(fsync, o.base_dir)


def _beanstalkd(o: Options) -> Server:
    argv = ["beanstalkd", "-l", HOST, "-p", "{port}", "-b", "{dir}", "-f", "0"]
    return Server("beanstalkd", argv, base_dir=o.base_dir)


MQD_SYSTEMS = [  # name, backend, sync, note
    ("mqd bdb always", "bdb", "always", 'sync = "always"'),
    ("mqd bdb periodic", "bdb", "periodic", 'sync = "periodic", 1000 ms'),
    ("mqd bdb-single", "bdb-single", "always", 'sync = "always"'),
    ("mqd bdb-random", "bdb-random", "always", 'sync = "always"'),
]
OTHER_SYSTEMS = [
    System(REDIS_ALWAYS, "resp", _redis("always"), "appendonly, appendfsync always"),
    System("redis everysec", "resp", _redis("everysec"), "appendonly, appendfsync everysec"),
    System(BEANSTALKD, "beanstalk", _beanstalkd, "binlog, fsync every write"),
]
SYSTEM_NAMES = [name for name, *_ in MQD_SYSTEMS] + [s.name for s in OTHER_SYSTEMS]


def systems(wanted: set[str], mqds: list[Checkout]) -> list[System]:
    """The systems named in `wanted`, each mqd one once per checkout (labelled if several)."""
    out = []
    for name, backend, sync, note in MQD_SYSTEMS:
        if name in wanted:
            for c in mqds:
                label = f"{name} @{c.label}" if len(mqds) > 1 else name
                out.append(System(label, "memcache", _mqd(backend, sync, c), note))
    return out + [s for s in OTHER_SYSTEMS if s.name in wanted]


@dataclass
class Row:
    system: System
    enqueue: LoadResult
    dequeue: LoadResult


def measure(system: System, o: Options) -> Row:
    """Start `system`, run the producers then the consumers, stop it."""
    with system.start(o) as srv:
        base = LoadSpec(
            host=HOST,
            port=srv.port,
            wire=system.wire,
            connections=o.connections,
            depth=o.pipeline,
            duration=o.duration,
            queue="bench",
            size=o.size,
            # Every body different: bdb-random stores a body once, and the
            # others then pay the same (realistic) price.
            unique=True,
        )
        # A short warm-up on another queue: files created, caches touched.
        checked_load(
            srv, replace(base, workload="queue", duration=min(1.0, o.duration), queue="warm")
        )
        enq = checked_load(srv, replace(base, workload="set"))
        # Bounded by what was stored, so every get finds a message.
        deq = checked_load(srv, replace(base, workload="get", ops=enq.ops))
    console.print(f"  {system.name}: enqueue {enq.summary()}")
    console.print(f"  {' ' * len(system.name)}  dequeue {deq.summary()}")
    return Row(system, enq, deq)


def _median_row(runs: list[Row]) -> Row:
    """Each direction's median run (enqueue and dequeue separately)."""
    enq = median_run([r.enqueue for r in runs])
    deq = median_run([r.dequeue for r in runs])
    return Row(runs[0].system, enq, deq)


def comparison(rows: list[Row], o: Options) -> None:
    by_name = {r.system.name: r for r in rows}
    redis = by_name.get(REDIS_ALWAYS)
    bean = by_name.get(BEANSTALKD)
    table = []
    for r in rows:
        table.append(
            [
                r.system.name,
                r.system.note,
                fmt_rate(r.enqueue.ops_per_s),
                fmt_ms(r.enqueue.p50),
                fmt_ms(r.enqueue.p99),
                fmt_rate(r.dequeue.ops_per_s),
                fmt_ms(r.dequeue.p50),
                fmt_ms(r.dequeue.p99),
                fmt_ratio(r.enqueue.ops_per_s, redis.enqueue.ops_per_s) if redis else "-",
                fmt_ratio(r.enqueue.ops_per_s, bean.enqueue.ops_per_s) if bean else "-",
            ]
        )
    print_table(
        f"{o.connections} producers then {o.connections} consumers, {o.pipeline} command(s) "
        f"per write, median of {o.repeat} round(s) of {o.duration:g} s runs; "
        f"{o.size}-byte messages; latency = one round trip (beanstalkd's dequeue: "
        "reserve then delete), ms",
        [
            "system",
            "durability",
            "enqueue/s",
            "p50",
            "p99",
            "dequeue/s",
            "p50",
            "p99",
            "enq vs redis always",
            "enq vs beanstalkd",
        ],
        table,
    )


def side_by_side(rows: list[Row], mqds: list[Checkout]) -> None:
    """Each mqd system's figures per checkout, and the ratios to the first checkout."""
    by_name = {r.system.name: r for r in rows}
    table = []
    for name, *_ in MQD_SYSTEMS:
        runs = [by_name.get(f"{name} @{c.label}") for c in mqds]
        first = runs[0]
        if first is None:
            continue
        for c, r in zip(mqds[1:], runs[1:], strict=True):
            if r is None:
                continue
            row = [f"{name}: {mqds[0].label} vs {c.label}"]
            for mine, theirs in ((first.enqueue, r.enqueue), (first.dequeue, r.dequeue)):
                row += [fmt_rate(mine.ops_per_s), fmt_rate(theirs.ops_per_s)]
                row.append(fmt_ratio(mine.ops_per_s, theirs.ops_per_s))
                row += [_cpu(mine), _cpu(theirs)]
                row.append(fmt_ratio(mine.cpu_us_per_op or 0, theirs.cpu_us_per_op or 0))
            table.append(row)
    half = ["against", "ratio", "CPU us/op", "against", "ratio"]
    print_table(
        "checkouts side by side (same run, medians as above; CPU: the server's user + system "
        "time per op, steadier than throughput on a shared machine)",
        ["system", "enqueue/s", *half, "dequeue/s", *half],
        table,
    )


def _cpu(r: LoadResult) -> str:
    return "-" if r.cpu_us_per_op is None else f"{r.cpu_us_per_op:.1f}"


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            # A log file may be removed while we walk.
            with contextlib.suppress(FileNotFoundError):
                total += (Path(root) / f).stat().st_size
    return total


def depth_test(o: Options) -> None:
    """Throughput on an empty queue, then with `o.depth` messages queued.

    Three figures: the queue before it is filled (the daemon holds nothing),
    and after the fill, alternately, the deep queue and an empty queue
    beside it (`repeat` times each, medians). The alternation puts both
    under the same conditions (disk cache, other load on the machine), so
    their ratio is the cost of depth alone.
    """
    queue = "deep"
    with mqd(
        o.depth_backend,
        exe=o.exe,
        loop=o.loop,
        config=mqd_config(o.depth_sync),
        name=f"mqd-{o.depth_backend}-depth",
        base_dir=o.base_dir,
    ) as srv:
        pairs = LoadSpec(
            host=HOST,
            port=srv.port,
            workload="queue",
            connections=o.connections,
            depth=o.pipeline,
            duration=o.duration,
            queue=queue,
            size=o.size,
            unique=True,
        )
        beside = replace(pairs, queue="shallow")
        checked_load(srv, replace(pairs, duration=min(1.0, o.duration), queue="warm"))
        before = checked_load(srv, pairs)
        rss_empty = srv.rss()
        console.print(f"  empty queue, before the fill: {before.summary()}")
        t0 = time.monotonic()
        filled = fill(srv, queue, o.depth, o.size, unique=True, max_seconds=4 * 3600)
        console.print(f"  filled {o.depth:,} in {time.monotonic() - t0:.0f} s: {filled.summary()}")
        items = memcache_stats(srv.port).get(f"queue_{queue}_items", "?")
        deeps: list[LoadResult] = []
        shallows: list[LoadResult] = []
        for _ in range(o.depth_repeat):
            deeps.append(checked_load(srv, pairs))
            console.print(f"  deep queue:              {deeps[-1].summary()}")
            shallows.append(checked_load(srv, beside))
            console.print(f"  empty queue beside it:   {shallows[-1].summary()}")
        deep, shallow = median_run(deeps), median_run(shallows)
        rss_deep = srv.rss()
        disk = _dir_bytes(srv.dir / "data")

    def row(name: str, n: str, r: LoadResult, rss: str, on_disk: str) -> list[str]:
        return [name, n, fmt_rate(r.ops_per_s), fmt_ms(r.p50), fmt_ms(r.p99), rss, on_disk]

    print_table(
        f"depth: {o.depth_backend} sync = {o.depth_sync}, enqueue+dequeue pairs, "
        f"{o.connections} connections x {o.pipeline} deep; after the fill, medians of "
        f"{o.depth_repeat} alternated runs (target: within 10%; RSS < 100 MB)",
        ["queue", "items", "ops/s", "p50", "p99", "daemon RSS MB", "data on disk MB"],
        [
            row("empty, before the fill", "0", before, f"{rss_empty / 2**20:.1f}", ""),
            row("empty, beside the deep one", "0", shallow, "", ""),
            row(
                f"{o.depth:,} deep",
                items,
                deep,
                f"{rss_deep / 2**20:.1f}",
                f"{disk / 2**20:.0f}",
            ),
        ],
    )
    console.print(
        f"deep/empty throughput: {fmt_ratio(deep.ops_per_s, before.ops_per_s)} against the "
        f"queue before the fill, {fmt_ratio(deep.ops_per_s, shallow.ops_per_s)} against the "
        f"empty queue beside it; fill rate {fmt_rate(filled.ops_per_s)} msgs/s "
        "(8 connections x 64 deep)"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the comparison (and the depth test if asked) and print the tables."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short runs (CI smoke check)")
    p.add_argument("--duration", type=float, default=None, help="seconds per run (default 5)")
    p.add_argument(
        "--repeat", type=int, default=None, help="rounds over all systems, medians (default 3)"
    )
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--pipeline", type=int, default=1, help="commands per write (default 1)")
    p.add_argument("--loop", default="uvloop", help="mqd --loop value, if mqd offers the flag")
    add_checkout_options(p)
    p.add_argument("--tmpdir", default=None, help="where data directories go (default: TMPDIR)")
    p.add_argument("--size", type=int, default=100, help="message bytes")
    p.add_argument(
        "--systems",
        default=None,
        help="comma-separated names to run (default all): " + ", ".join(SYSTEM_NAMES),
    )
    p.add_argument("--depth", type=int, default=0, help="also run the depth test with N messages")
    p.add_argument("--depth-backend", default="bdb")
    p.add_argument("--depth-sync", default="always", choices=("always", "periodic", "none"))
    p.add_argument(
        "--depth-repeat", type=int, default=None, help="alternated runs after the fill (default 3)"
    )
    p.add_argument("--no-compare", action="store_true", help="skip the comparison (depth only)")
    a = p.parse_args(argv)
    mqds = checkouts(a)
    exe = mqds[0].exe
    o = Options(
        duration=a.duration or (2.0 if a.quick else 5.0),
        repeat=a.repeat or (1 if a.quick else 3),
        connections=a.connections,
        pipeline=a.pipeline,
        loop=a.loop if "--loop" in mqd_serve_flags(exe) else None,
        exe=exe,
        base_dir=a.tmpdir,
        size=a.size,
        depth=a.depth,
        depth_backend=a.depth_backend,
        depth_sync=a.depth_sync,
        depth_repeat=a.depth_repeat or (1 if a.quick else 3),
    )
    wanted = set(SYSTEM_NAMES)
    if a.systems:
        wanted = {n.strip() for n in a.systems.split(",")}
        unknown = wanted - set(SYSTEM_NAMES)
        if unknown:
            p.error(f"unknown systems: {', '.join(sorted(unknown))}")
    chosen = systems(wanted, mqds)
    missing = [b for b in ("redis-server", "beanstalkd") if not shutil.which(b)]
    if missing and not a.no_compare:
        chosen = [s for s in chosen if not any(m.split("-")[0] in s.name for m in missing)]
        console.print(f"not installed, skipped: {', '.join(missing)}")
    console.print(
        f"mqd{' --loop ' + o.loop if o.loop else ''}; {o.duration:g} s per run; data under "
        f"{a.tmpdir or os.environ.get('TMPDIR', '/tmp')}"
    )
    if not a.no_compare:
        # Rounds over all systems rather than one system's runs back to back:
        # a burst of other activity on the machine then hits every system
        # in one round instead of all runs of one system.
        rounds = [[measure(s, o) for s in chosen] for _ in range(o.repeat)]
        rows = [_median_row([r[i] for r in rounds]) for i in range(len(chosen))]
        comparison(rows, o)
        if len(mqds) > 1:
            side_by_side(rows, mqds)
    if o.depth:
        depth_test(o)
    return 0


if __name__ == "__main__":
    sys.exit(main())
