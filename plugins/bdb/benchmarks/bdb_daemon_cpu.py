"""Daemon CPU time per operation on each Berkeley DB backend.

On a machine shared with other work, rates move by a factor of several between
runs and durable rates follow the disk; the CPU time the daemon spends per
operation moves far less, so this is the figure to compare two versions of the
code by. For each backend, in rounds: start mqd (`sync = "none"`, so the disk
does not pace it), run a fixed number of `set`s, then as many `get`s, with the
load generator of benchmarks/, and read the daemon's CPU time (all threads,
from /proc/<pid>/stat) around each. Prints the median per operation, and the
rates for reference.

To compare two checkouts, run each one's copy of mqd back to back:

    .venv/bin/python plugins/bdb/benchmarks/bdb_daemon_cpu.py
    .venv/bin/python plugins/bdb/benchmarks/bdb_daemon_cpu.py --mqd /other/.venv/bin/mqd
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

from harness import HOST, Server, checked_load, fmt_rate, mqd, print_table
from loadgen import LoadSpec

BACKENDS = ["bdb", "bdb-single", "bdb-random"]
CONFIG = '[queues."*"]\nsync = "none"\n'


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process `pid`, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_round(backend: str, args: argparse.Namespace) -> tuple[float, float, float, float]:
    """(set CPU us/op, get CPU us/op, set ops/s, get ops/s) of a fresh daemon."""
    with mqd(backend, exe=args.mqd, config=CONFIG, name=f"mqd-{backend}") as srv:
        base = LoadSpec(
            host=HOST,
            port=srv.port,
            connections=args.connections,
            depth=args.pipeline,
            duration=None,
            queue="cpu",
            unique=True,
        )
        checked_load(srv, replace(base, workload="queue", ops=2000, queue="warm"))
        figures = []
        for workload in ("set", "get"):
            figures.append(_measured(srv, replace(base, workload=workload, ops=args.ops)))
    (set_us, set_rate), (get_us, get_rate) = figures
    return set_us, get_us, set_rate, get_rate


def _measured(srv: Server, spec: LoadSpec) -> tuple[float, float]:
    before = cpu_seconds(srv.pid)
    result = checked_load(srv, spec)
    used = cpu_seconds(srv.pid) - before
    return used / result.ops * 1e6, result.ops_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=40_000, help="sets, then gets, per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--pipeline", type=int, default=1)
    parser.add_argument("--backend", choices=BACKENDS, action="append")
    parser.add_argument("--mqd", help="the mqd executable (default: beside this Python)")
    args = parser.parse_args()
    rows = []
    for backend in args.backend or BACKENDS:
        runs = [one_round(backend, args) for _ in range(args.rounds)]
        set_us, get_us, set_rate, get_rate = (statistics.median(x) for x in zip(*runs, strict=True))
        rows.append(
            [backend, f"{set_us:.1f}", f"{get_us:.1f}", fmt_rate(set_rate), fmt_rate(get_rate)]
        )
    print_table(
        f"daemon CPU per operation, median of {args.rounds} round(s) of {args.ops} sets then "
        f"{args.ops} gets, {args.connections} connections, sync = none",
        ["backend", "set us cpu/op", "get us cpu/op", "set ops/s", "get ops/s"],
        rows,
    )


if __name__ == "__main__":
    main()
