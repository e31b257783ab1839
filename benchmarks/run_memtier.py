"""The queue load of the memcached and Redis worlds: mqd's backends against
memcached and Redis lists under memtier_benchmark, in one run.

The load (one key = one queue, so every set is an enqueue and every get a
dequeue; 100-byte values; 50/50 set/get; 16 connections as 4 threads x 4
clients), in two shapes: one command per round trip, and pipelined 16 deep.
On the memcached protocol memtier's parallel key pattern gives each
connection its own key (queues q1 to q16); the Redis lists are one list.

Systems, each started in turn on a free loopback port with a fresh temporary
data directory, measured in both shapes, and stopped before the next starts
(in this order, each mqd beside what it is compared with; every other round
in the reverse order, so that a machine slowing down or speeding up through
a round favours no side of a ratio):

  mqd memory                --backend memory
  memcached -t 2            the same set/get of one key: the reference
  mqd bdb always            --backend bdb, sync = "always"   (STORED means on disk)
  redis appendfsync always  LPUSH / RPOP, append-only file fsynced before each reply
  mqd bdb periodic          --backend bdb, sync = "periodic" (flushed every 1000 ms)
  redis appendfsync no      LPUSH / RPOP, append-only file, never fsynced by Redis

Each server runs in a session of its own. Under autogroup scheduling (on
where /proc/sys/kernel/sched_autogroup_enabled reads 1) a session is one
scheduling group, so a server's threads together get a fair share of the
cores against the load generator's, as one group: memcached's two threads
then get about what mqd's one event loop thread gets. With --server-session
shared each thread competes on its own, and memcached's two threads take
more of the two cores than one thread can. The ratios of mqd memory to
memcached depend on this much; benchmarks/RESULTS.md has both.

memtier_benchmark is taken from --memtier, $MEMTIER_BENCHMARK, a
`shared/tools/memtier_benchmark` beside this repository (or beside any
directory above it), or PATH; without it, the project's own generator
(benchmarks/loadgen.py) drives the same load shapes.

Usage: python benchmarks/run_memtier.py [--quick] [--test-time S] [--against DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from harness import (
    HOST,
    REPO,
    Checkout,
    Server,
    add_checkout_options,
    checked_load,
    checkouts,
    console,
    fmt_ms,
    fmt_rate,
    fmt_ratio,
    memcached,
    mqd,
    mqd_config,
    mqd_serve_flags,
    print_table,
    redis,
    venv_python,
)
from loadgen import LoadSpec

MEMCACHED = "memcached -t 2"
REDIS_ALWAYS = "redis appendfsync always"
REDIS_NO = "redis appendfsync no"
MEMORY = "mqd memory"
BDB_ALWAYS = "mqd bdb always"
BDB_PERIODIC = "mqd bdb periodic"
QUEUE = "q1"  # what memtier's --key-prefix=q --key-minimum=1 --key-maximum=1 makes


@dataclass
class Options:
    test_time: int
    warmup: float
    repeat: int
    threads: int
    clients: int
    pipelines: list[int]
    size: int
    loop: str | None
    base_dir: str | None
    own_session: bool = True  # see --server-session
    backlog: int | None = None  # see --backlog


@dataclass(frozen=True)
class Figures:
    """One measurement: total ops/s (sets plus gets), latency in ms, how many
    gets found a message per second (None where the driver cannot tell), and
    the server's CPU time per op in microseconds (user + system, all threads).

    CPU per op is the steadier figure on a shared machine: other programs
    taking the cores lower the throughput but hardly change what each op costs.
    """

    ops_per_s: float
    p50: float
    p99: float
    hits_per_s: float | None
    cpu_us: float = 0.0


@dataclass(frozen=True)
class System:
    name: str
    wire: str  # "memcache" or "resp"
    start: Callable[[Options], Server]
    note: str


# --------------------------------------------------------------------------
# Load generators
# --------------------------------------------------------------------------


class Memtier:
    """memtier_benchmark with the load its README gives, read back from its JSON output."""

    latency = "per request"

    def __init__(self, exe: str) -> None:
        self.exe = exe
        self.name = f"memtier_benchmark ({exe})"

    def measure(
        self, server: Server, wire: str, pipeline: int, seconds: float, o: Options
    ) -> Figures:
        with tempfile.TemporaryDirectory(prefix="bench-memtier-") as tmp:
            out = Path(tmp) / "out.json"
            argv = [self.exe, "-s", HOST, "-p", str(server.port), "-t", str(o.threads)]
            # memtier takes whole seconds.
            argv += ["-c", str(o.clients), f"--pipeline={pipeline}", f"--test-time={seconds:.0f}"]
            argv += ["--hide-histogram", "-d", str(o.size), f"--json-out-file={out}"]
            if wire == "memcache":
                argv += ["-P", "memcache_text", "--ratio=1:1", "--key-prefix=q"]
                argv += ["--key-minimum=1", "--key-maximum=1", "--key-pattern=P:P"]
            else:
                argv += [
                    "-P",
                    "redis",
                    f"--command=LPUSH {QUEUE} __data__",
                    f"--command=RPOP {QUEUE}",
                ]
            # The margin covers connecting and a server that stops answering
            # (memtier then waits, it does not fail).
            proc = subprocess.run(
                argv, capture_output=True, text=True, timeout=seconds + 60, check=False, cwd=tmp
            )
            if proc.returncode != 0 or not out.exists():
                raise RuntimeError(
                    f"{server.name}: memtier_benchmark exited with {proc.returncode}:\n"
                    f"{proc.stderr[-2000:]}\n{server.state()}"
                )
            totals = json.loads(out.read_text())["ALL STATS"]["Totals"]
        pct = totals["Percentile Latencies"]
        # Only the memcache protocol's gets count hits; an arbitrary --command does not.
        hits = totals.get("Hits/sec") if wire == "memcache" else None
        return Figures(
            float(totals["Ops/sec"]),
            float(pct["p50.00"]),
            float(pct["p99.00"]),
            None if hits is None else float(hits),
        )


class Loadgen:
    """The project's generator (benchmarks/loadgen.py) under the same load shapes."""

    latency = "per batch (at depth 16: the whole pipelined batch)"
    name = "benchmarks/loadgen.py"

    def __init__(self, processes: int) -> None:
        self.processes = processes

    def measure(
        self, server: Server, wire: str, pipeline: int, seconds: float, o: Options
    ) -> Figures:
        conns = o.threads * o.clients
        spec = LoadSpec(
            host=HOST,
            port=server.port,
            wire=wire,
            workload="queue",
            connections=conns,
            processes=min(self.processes, conns),
            depth=pipeline,
            duration=seconds,
            queue=QUEUE,
            size=o.size,
        )
        res = checked_load(server, spec)
        return Figures(res.ops_per_s, res.p50, res.p99, res.hits / res.elapsed)


Driver = Memtier | Loadgen


def autogroup() -> str:
    """Whether the kernel groups threads by session, the case --server-session is for."""
    try:
        on = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return "unknown"
    return "on" if on else "off"


def find_memtier(explicit: str | None) -> str | None:
    """memtier_benchmark: `explicit`, $MEMTIER_BENCHMARK, shared/tools/ up the tree, PATH."""
    if explicit:
        return explicit
    if os.environ.get("MEMTIER_BENCHMARK"):
        return os.environ["MEMTIER_BENCHMARK"]
    for d in REPO.parents:
        candidate = d / "shared" / "tools" / "memtier_benchmark"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("memtier_benchmark")


# --------------------------------------------------------------------------
# Systems
# --------------------------------------------------------------------------


def _mqd(backend: str, sync: str | None, c: Checkout, label: str) -> Callable[[Options], Server]:
    def start(o: Options) -> Server:
        config = mqd_config(sync) if sync else None
        return mqd(
            backend,
            exe=c.exe,
            env=dict(c.env),
            loop=o.loop,
            config=config,
            name=label,
            base_dir=o.base_dir,
        )

    return start


MQD_SYSTEMS = [  # name, backend, sync, note
    (MEMORY, "memory", None, "memory only"),
    (BDB_ALWAYS, "bdb", "always", 'sync = "always"'),
    (BDB_PERIODIC, "bdb", "periodic", 'sync = "periodic", 1000 ms'),
]
OTHER_SYSTEMS = [
    System(MEMCACHED, "memcache", lambda o: memcached(threads=2), "memory only"),
    System(REDIS_NO, "resp", lambda o: redis("no", o.base_dir), "AOF, no fsync"),
    System(REDIS_ALWAYS, "resp", lambda o: redis("always", o.base_dir), "AOF, fsync each write"),
]


#: The order of a round: each mqd system just before what its ratio compares it with.
ORDER = [MEMORY, MEMCACHED, BDB_ALWAYS, REDIS_ALWAYS, BDB_PERIODIC, REDIS_NO]


def systems(mqds: list[Checkout]) -> list[System]:
    """Every system in ORDER; each mqd one once per checkout (labelled when there are several)."""
    out = []
    for name, backend, sync, note in MQD_SYSTEMS:
        for c in mqds:
            label = f"{name} @{c.label}" if len(mqds) > 1 else name
            out.append(System(label, "memcache", _mqd(backend, sync, c, label), note))
    return sorted(out + OTHER_SYSTEMS, key=lambda s: ORDER.index(s.name.split(" @")[0]))


def measure(system: System, driver: Driver, o: Options) -> dict[int, Figures]:
    """Start `system`, measure each pipeline depth after a short warm-up, stop it."""
    server = system.start(o)
    server.own_session = o.own_session
    with server as srv:
        if o.warmup > 0:
            driver.measure(srv, system.wire, 1, o.warmup, o)
        figures = {}
        for p in o.pipelines:
            if o.backlog is not None and system.wire == "memcache":
                set_backlog(srv.port, o.backlog, o)
            cpu = srv.cpu()
            f = driver.measure(srv, system.wire, p, o.test_time, o)
            ops = f.ops_per_s * o.test_time
            figures[p] = replace(f, cpu_us=(srv.cpu() - cpu) / ops * 1e6 if ops else 0.0)
    for p, f in figures.items():
        console.print(
            f"  {system.name}, pipeline {p}: {fmt_rate(f.ops_per_s)} ops/s  "
            f"p50 {fmt_ms(f.p50)} ms  p99 {fmt_ms(f.p99)} ms  gets hit {_hit_share(f)}  "
            f"server CPU {f.cpu_us:.2f} us/op"
        )
    return figures


def set_backlog(port: int, holding: int, o: Options) -> None:
    """Leave queues q1 to q`holding` one message each and the other connections' queues empty.

    Under the queue load every get finds a message, so each queue keeps the
    backlog it starts with; what a figure left behind (a connection's last
    set without its get) otherwise decides it. On mqd Berkeley DB `always`,
    a queue with a message writes and syncs one at each round of its
    connection, where one whose consumer keeps up pairs its sets with its
    gets and writes nothing (benchmarks/RESULTS.md).
    """
    queues = o.threads * o.clients
    body = b"b" * o.size
    request = b"".join(b"delete q%d\r\n" % n for n in range(1, queues + 1))
    request += b"".join(
        b"set q%d 0 0 %d\r\n%s\r\n" % (n, len(body), body) for n in range(1, holding + 1)
    )
    with socket.create_connection((HOST, port), timeout=30) as s:
        s.sendall(request)
        replies = b""
        while replies.count(b"\r\n") < queues + holding:
            chunk = s.recv(65536)
            if not chunk:
                raise RuntimeError(f"port {port} closed the connection while queues were set up")
            replies += chunk
    if replies.count(b"STORED\r\n") != holding:
        raise RuntimeError(f"port {port}: setting up the backlog answered {replies[-200:]!r}")


def _median(runs: list[Figures]) -> Figures:
    """The run with the median throughput (its own latencies with it)."""
    rate = statistics.median_low([r.ops_per_s for r in runs])
    return next(r for r in runs if r.ops_per_s == rate)


# --------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------


def results_table(
    results: dict[str, dict[int, Figures]], chosen: list[System], driver: Driver, o: Options
) -> None:
    ref = results.get(MEMCACHED)
    rows = []
    for s in chosen:
        row = [s.name, s.note]
        for p in o.pipelines:
            f = results[s.name][p]
            row += [fmt_rate(f.ops_per_s), _hit_share(f), fmt_ms(f.p50), fmt_ms(f.p99)]
            row.append(fmt_ratio(f.ops_per_s, ref[p].ops_per_s) if ref else "-")
            row.append(f"{f.cpu_us:.2f}")
        rows.append(row)
    columns = ["system", "durability"]
    for p in o.pipelines:
        columns += [f"pipeline {p} ops/s", "hits", "p50", "p99", "/memcached", "CPU us/op"]
    print_table(
        f"{o.threads * o.clients} connections, 50/50 set/get, a queue each (Redis: one list), "
        f"{o.size}-byte values, "
        f"{o.test_time:g} s per figure, median of {o.repeat}; driver: {driver.name}; "
        f"latency {driver.latency}, ms; hits: share of gets that found a message; "
        "CPU us/op: the server's CPU time (user + system) per op",
        columns,
        rows,
    )


def _hit_share(f: Figures) -> str:
    """Gets that found a message, as a share of all gets (half the ops)."""
    if f.hits_per_s is None or not f.ops_per_s:
        return "-"
    return f"{f.hits_per_s / (f.ops_per_s / 2):.0%}"


# (what, numerator, denominator, target) for the ratio table; names without the checkout.
RATIOS = [
    ("bdb always / redis always", BDB_ALWAYS, REDIS_ALWAYS, ">= 1.0"),
    ("bdb always / mqd memory", BDB_ALWAYS, MEMORY, ">= 0.5 pipelined"),
    ("mqd memory / memcached -t 2", MEMORY, MEMCACHED, ">= 1.0"),
]


def _targets(mqds: list[Checkout], measured: set[str]) -> list[tuple[str, str, str, str]]:
    """The RATIOS there are figures for: (label, numerator, denominator, target)."""
    out = []
    for c in mqds:
        for what, num, den, target in RATIOS:
            a, b = _name(num, c, mqds), _name(den, c, mqds)
            if a in measured and b in measured:
                out.append((f"{what} @{c.label}" if len(mqds) > 1 else what, a, b, target))
    return out


def _name(base: str, c: Checkout, mqds: list[Checkout]) -> str:
    """The name of system `base` of checkout `c` (mqd systems carry the checkout's label)."""
    if base.startswith("mqd ") and len(mqds) > 1:
        return f"{base} @{c.label}"
    return base


def ratio_table(results: dict[str, dict[int, Figures]], mqds: list[Checkout], o: Options) -> None:
    rows = []
    for label, num, den, target in _targets(mqds, set(results)):
        top, bottom = results[num], results[den]
        rows.append(
            [
                label,
                *(fmt_ratio(top[p].ops_per_s, bottom[p].ops_per_s) for p in o.pipelines),
                target,
            ]
        )
    # What durability costs Redis in the same run: the yardstick for the row
    # "bdb always / mqd memory", whose target asks as much of mqd.
    redis_always, redis_no = results.get(REDIS_ALWAYS), results.get(REDIS_NO)
    if redis_always is not None and redis_no is not None:
        rows.append(
            [
                "redis always / redis no",
                *(fmt_ratio(redis_always[p].ops_per_s, redis_no[p].ops_per_s) for p in o.pipelines),
                "reference",
            ]
        )
    ref = results.get(MEMCACHED)
    if ref is not None:
        for c in mqds:
            mem = results.get(_name(MEMORY, c, mqds))
            if mem is not None:
                rows.append(
                    [
                        f"CPU per op: mqd memory @{c.label} / memcached -t 2",
                        *(fmt_ratio(mem[p].cpu_us, ref[p].cpu_us) for p in o.pipelines),
                        "lower is better",
                    ]
                )
    for c in mqds[1:]:
        for base, *_ in MQD_SYSTEMS:
            a, b = results.get(_name(base, mqds[0], mqds)), results.get(_name(base, c, mqds))
            if a is None or b is None:
                continue
            rows.append(
                [
                    f"{base}: @{mqds[0].label} / @{c.label}",
                    *(fmt_ratio(a[p].ops_per_s, b[p].ops_per_s) for p in o.pipelines),
                    "",
                ]
            )
            rows.append(
                [
                    f"{base} CPU per op: @{mqds[0].label} / @{c.label}",
                    *(fmt_ratio(a[p].cpu_us, b[p].cpu_us) for p in o.pipelines),
                    "lower is better",
                ]
            )
    print_table(
        "throughput ratios, same run",
        ["ratio", *(f"pipeline {p}" for p in o.pipelines), "target"],
        rows,
    )


def round_table(
    rounds: list[dict[str, dict[int, Figures]]], mqds: list[Checkout], o: Options
) -> None:
    """The target ratios of each round, from figures taken minutes apart at most.

    On a machine whose speed drifts, the ratio of two medians can pair a
    system's fast round with the other's slow one; these are the spread.
    """
    rows = []
    for label, num, den, target in _targets(mqds, set(rounds[0])):
        cells = []
        for p in o.pipelines:
            each = [
                r[num][p].ops_per_s / r[den][p].ops_per_s for r in rounds if r[den][p].ops_per_s
            ]
            cells.append(
                " ".join(f"{x:.2f}" for x in each) + f" (median {statistics.median(each):.2f})"
                if each
                else "-"
            )
        rows.append([label, *cells, target])
    print_table(
        "throughput ratios, round by round",
        ["ratio", *(f"pipeline {p}" for p in o.pipelines), "target"],
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    """Measure every system in both shapes and print the figures and the ratios."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 s per figure (a smoke check)")
    p.add_argument("--test-time", type=int, default=None, help="seconds per figure (default 10)")
    p.add_argument("--repeat", type=int, default=1, help="rounds over all systems, medians")
    p.add_argument("--threads", type=int, default=4, help="memtier -t (connections = t x c)")
    p.add_argument("--clients", type=int, default=4, help="memtier -c, per thread")
    p.add_argument("--pipelines", default="1,16", help="pipeline depths, comma-separated")
    p.add_argument("--size", type=int, default=100, help="value bytes")
    p.add_argument(
        "--warmup",
        type=float,
        default=1.0,
        help="seconds of one command per round trip before a system's first figure; "
        "it and each figure leave a message waiting in some queues (0 and --pipelines 16: "
        "queues whose consumers keep up)",
    )
    p.add_argument("--loop", default="uvloop", help="mqd --loop value, if mqd offers the flag")
    p.add_argument("--tmpdir", default=None, help="where data directories go (default: TMPDIR)")
    p.add_argument(
        "--generator",
        choices=("auto", "memtier", "loadgen"),
        default="auto",
        help="auto: memtier_benchmark when found, else benchmarks/loadgen.py",
    )
    p.add_argument("--memtier", default=None, help="memtier_benchmark executable")
    p.add_argument(
        "--processes", type=int, default=1, help="loadgen.py worker processes (default 1)"
    )
    p.add_argument(
        "--systems",
        default=None,
        help="comma-separated names to run (default all): "
        + ", ".join([n for n, *_ in MQD_SYSTEMS] + [s.name for s in OTHER_SYSTEMS]),
    )
    p.add_argument(
        "--server-session",
        choices=("own", "shared"),
        default="own",
        help="own: each server in a session of its own, so under autogroup scheduling its "
        "threads share one scheduling group against memtier's (much as a daemon in a "
        "control group of its own under systemd); shared: in memtier's session, each "
        "server thread scheduled against each memtier thread",
    )
    p.add_argument(
        "--backlog",
        type=int,
        default=None,
        help="before each figure of the memcached protocol's systems, leave one message in "
        "queues q1 to qN and none in the other connections' queues (default: as the warm-up "
        "and the figure before left them)",
    )
    add_checkout_options(p)
    a = p.parse_args(argv)
    mqds = checkouts(a)
    o = Options(
        test_time=a.test_time or (3 if a.quick else 10),
        warmup=a.warmup,
        repeat=a.repeat,
        threads=a.threads,
        clients=a.clients,
        pipelines=[int(x) for x in a.pipelines.split(",") if x],
        size=a.size,
        loop=a.loop if all("--loop" in mqd_serve_flags(c.exe) for c in mqds) else None,
        base_dir=a.tmpdir,
        own_session=a.server_session == "own",
        backlog=a.backlog,
    )
    if a.backlog is not None and not 0 <= a.backlog <= o.threads * o.clients:
        p.error(f"--backlog must be 0 to {o.threads * o.clients}, one queue a connection")
    memtier = find_memtier(a.memtier) if a.generator != "loadgen" else None
    if a.generator == "memtier" and memtier is None:
        p.error("memtier_benchmark not found: give --memtier PATH")
    driver: Driver = Memtier(memtier) if memtier else Loadgen(a.processes)
    chosen = systems(mqds)
    if a.systems:
        wanted = {n.strip() for n in a.systems.split(",")}
        chosen = [s for s in chosen if s.name.split(" @")[0] in wanted]
        if not chosen:
            p.error(f"no system matches {a.systems!r}")
    missing = [b for b in ("memcached", "redis-server") if not shutil.which(b)]
    if missing:
        chosen = [s for s in chosen if not any(s.name.startswith(m[:5]) for m in missing)]
        console.print(f"not installed, skipped: {', '.join(missing)}")
    console.print(
        f"driver: {driver.name}; "
        + "; ".join(f"mqd @{c.label}: {c.exe} ({venv_python(c.exe)})" for c in mqds)
        + f"; loop {o.loop or 'default'}; data under {a.tmpdir or tempfile.gettempdir()}"
        + f"; servers in {a.server_session} sessions (autogroup {autogroup()})"
    )
    # Rounds over all systems rather than one system's runs back to back: a
    # burst of other activity on the machine then hits every system alike.
    # Every other round runs in the reverse order, so that a steady drift of
    # the machine's speed lifts each side of a ratio alike over two rounds.
    rounds = [
        {s.name: measure(s, driver, o) for s in (chosen if i % 2 == 0 else chosen[::-1])}
        for i in range(o.repeat)
    ]
    results = {
        s.name: {p: _median([r[s.name][p] for r in rounds]) for p in o.pipelines} for s in chosen
    }
    results_table(results, chosen, driver, o)
    ratio_table(results, mqds, o)
    if o.repeat > 1:
        round_table(rounds, mqds, o)
    return 0


if __name__ == "__main__":
    sys.exit(main())
