"""Daemon CPU time per operation on each Berkeley DB backend.

On a machine shared with other work, rates move by a factor of several between
runs and durable rates follow the disk; the CPU time the daemon spends per
operation moves far less, so this is the figure to compare two versions of the
code by. For each backend, in rounds: start mqd (`sync = "none"`, so the disk
does not pace it), run a fixed number of `set`s, then as many `get`s, with the
load generator of benchmarks/, and read the daemon's CPU time (all threads,
from /proc/<pid>/stat) around each. Where `perf` is installed (Debian:
linux-perf) it also counts the instructions the daemon ran, which hardly move
at all with other work on the machine. Prints the medians per operation, and
the rates for reference.

To compare two checkouts, run each one's copy of mqd back to back:

    .venv/bin/python plugins/bdb/benchmarks/bdb_daemon_cpu.py
    .venv/bin/python plugins/bdb/benchmarks/bdb_daemon_cpu.py --mqd /other/.venv/bin/mqd
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
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


PERF = shutil.which("perf")

#: One phase's figures: CPU us/op, instructions/op (0 without perf), ops/s.
Figures = tuple[float, float, float]


def one_round(backend: str, args: argparse.Namespace) -> tuple[Figures, Figures]:
    """The set phase's figures and the get phase's, of a fresh daemon."""
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
        sets = _measured(srv, replace(base, workload="set", ops=args.ops))
        gets = _measured(srv, replace(base, workload="get", ops=args.ops))
    return sets, gets


def _measured(srv: Server, spec: LoadSpec) -> Figures:
    counter = None
    if PERF is not None:
        argv = [PERF, "stat", "-x", ",", "-e", "instructions:u", "-p", str(srv.pid)]
        counter = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    before = cpu_seconds(srv.pid)
    try:
        result = checked_load(srv, spec)
    finally:
        used = cpu_seconds(srv.pid) - before
        instructions = _stop(counter)
    return used / result.ops * 1e6, instructions / result.ops, result.ops_per_s


def _stop(counter: subprocess.Popen[str] | None) -> float:
    """End `perf stat`; the instructions it counted (0 if it counted none)."""
    if counter is None:
        return 0.0
    counter.send_signal(signal.SIGINT)
    _, err = counter.communicate(timeout=30)
    for line in err.splitlines():
        fields = line.split(",")
        if len(fields) > 2 and fields[2].startswith("instructions") and fields[0].isdigit():
            return float(fields[0])
    return 0.0


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
        row = [backend]
        for phase in (0, 1):
            cpu, instructions, rate = (
                statistics.median(x) for x in zip(*(run[phase] for run in runs), strict=True)
            )
            row += [f"{cpu:.1f}", f"{instructions:,.0f}" if instructions else "-", fmt_rate(rate)]
        rows.append(row)
    print_table(
        f"daemon per operation, median of {args.rounds} round(s) of {args.ops} sets then "
        f"{args.ops} gets, {args.connections} connections, sync = none",
        [
            "backend",
            *("set us cpu", "set instructions", "set ops/s"),
            *("get us cpu", "get instructions", "get ops/s"),
        ],
        rows,
    )


if __name__ == "__main__":
    main()
