"""Where a durable round's time goes, one command per round trip: mqd bdb
`sync = "always"` beside Redis `appendfsync always`, under memtier's queue load
(benchmarks/run_memtier.py, pipeline 1).

Both servers answer a round of commands after one sync of their log, from one
thread. Between two syncs that thread sends the last round's replies, polls
the sockets, reads and runs the next commands, and writes its log. Recording
the server's sync and poll system calls (`perf record` on their tracepoints:
four events a round, too few to slow the server) cuts each round into:

  replies      from the end of a sync to the first poll (the replies sent)
  poll         time inside the polls
  between      from the first poll to the end of the last, outside the polls
               (mqd keeps a round open for a few turns of its loop after a
               sync, so that the clients that sync answered join the next one)
  work         from the last poll to the next sync (reads, commands, commit,
               the log write)
  sync         the fdatasync of the log

The table gives each phase's mean in microseconds and per command (commands
a round: ops/s times the mean round). It needs `perf` (Debian: linux-perf)
and the right to trace (root, or kernel.perf_event_paranoid <= -1 and
tracefs readable).

Usage: python benchmarks/round_phases.py [--seconds S] [--memtier PATH] [--mqd PATH]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from harness import Server, find_mqd, mqd, mqd_config, print_table, redis
from run_memtier import Figures, Memtier, Options, find_memtier

PHASES = ("replies", "poll", "between", "work", "sync")
#: The tracepoints recorded: a sync's and a poll's entry and exit (uvloop polls
#: with epoll_pwait, Redis with epoll_wait).
EVENTS = [
    f"syscalls:sys_{edge}_{call}"
    for call in ("fdatasync", "epoll_pwait", "epoll_wait")
    for edge in ("enter", "exit")
]
WARMUP_S = 2.0  # of the load before recording starts


def record(pid: int, seconds: float, out: Path) -> list[tuple[float, str]]:
    """The server's sync and poll events for `seconds`: (time in µs, name) of its busiest thread."""
    argv = ["perf", "record", "-q", "-o", str(out), "-p", str(pid)]
    argv += [arg for event in EVENTS for arg in ("-e", event)]
    proc = subprocess.run(
        [*argv, "--", "sleep", str(seconds)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"perf record failed (tracing rights?): {proc.stderr.strip()[-500:]}")
    script = subprocess.run(
        ["perf", "script", "-i", str(out), "-F", "tid,time,event"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    events = []
    for line in script.splitlines():
        tid, stamp, event = line.split()[:3]
        events.append(
            (int(tid), float(stamp.rstrip(":")) * 1e6, event.rstrip(":").split("sys_")[1])
        )
    busiest = Counter(tid for tid, _, _ in events).most_common(1)[0][0]
    return [(t, name) for tid, t, name in events if tid == busiest]


def phases(events: list[tuple[float, str]]) -> list[dict[str, float]]:
    """Each whole round's phases in µs (see the module's docstring)."""
    rounds: list[dict[str, float]] = []
    sync_from = synced = first_poll = poll_from = last_poll_out = polling = 0.0
    for t, name in events:
        if name == "enter_fdatasync":
            if synced and last_poll_out:
                rounds.append(
                    {
                        "replies": first_poll - synced,
                        "poll": polling,
                        "between": last_poll_out - first_poll - polling,
                        "work": t - last_poll_out,
                        "sync": synced - sync_from,
                    }
                )
            sync_from, synced, first_poll, last_poll_out, polling = t, 0.0, 0.0, 0.0, 0.0
        elif name == "exit_fdatasync" and sync_from:
            synced = t
        elif name.startswith("enter_epoll") and synced:
            first_poll = first_poll or t
            poll_from = t
        elif name.startswith("exit_epoll") and first_poll:
            last_poll_out = t
            polling += t - poll_from
    return rounds


def measure(
    label: str, server: Server, wire: str, driver: Memtier, o: Options, seconds: float
) -> list[str]:
    """One row: the server under memtier's load, its rounds recorded meanwhile."""
    figures: list[Figures] = []
    load = threading.Thread(
        target=lambda: figures.append(driver.measure(server, wire, 1, o.test_time, o))
    )
    with tempfile.TemporaryDirectory(prefix="bench-phases-") as tmp:
        load.start()
        time.sleep(WARMUP_S)
        events = record(server.pid, seconds, Path(tmp) / "perf.data")
        load.join()
    if not figures:
        raise SystemExit(f"{label}: memtier_benchmark failed (see above)\n{server.state()}")
    rounds = phases(events)
    if not rounds:
        raise SystemExit(
            f"{label}: no whole round on its busiest thread (a sync on another?)\n{server.state()}"
        )
    ops = figures[0].ops_per_s
    means = {k: statistics.fmean(r[k] for r in rounds) for k in PHASES}
    total = sum(means.values())
    per_round = ops * total / 1e6
    cells = [f"{means[k]:.0f} ({means[k] / per_round:.1f})" for k in PHASES]
    return [label, f"{ops:,.0f}", f"{per_round:.1f}", *cells, f"{total:.0f}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=3.0, help="seconds recorded per server")
    p.add_argument("--memtier", default=None, help="memtier_benchmark executable")
    p.add_argument("--mqd", default=None, help="mqd executable (default: beside this Python)")
    a = p.parse_args(argv)
    memtier = find_memtier(a.memtier)
    missing = [t for t in ("perf", "redis-server") if not shutil.which(t)]
    if memtier is None:
        missing.append("memtier_benchmark (--memtier PATH)")
    if missing or memtier is None:
        p.error(f"not found: {', '.join(missing)}")
    o = Options(
        test_time=int(WARMUP_S + a.seconds + 3),
        warmup=0.0,
        repeat=1,
        threads=4,
        clients=4,
        pipelines=[1],
        size=100,
        loop=None,
        base_dir=None,
    )
    driver = Memtier(memtier)
    exe = find_mqd(a.mqd)
    # Each server made only when its turn comes: making one makes its data directory.
    servers: list[tuple[str, str, Callable[[], Server]]] = [
        ("mqd bdb always", "memcache", lambda: mqd("bdb", exe=exe, config=mqd_config("always"))),
        ("redis appendfsync always", "resp", lambda: redis("always")),
    ]
    rows = []
    for label, wire, make in servers:
        with make() as server:
            rows.append(measure(label, server, wire, driver, o, a.seconds))
    print_table(
        "one command per round trip, 16 connections; phase means in µs a round "
        "(in brackets: a command)",
        ["server", "ops/s", "commands a round", *PHASES, "round"],
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
