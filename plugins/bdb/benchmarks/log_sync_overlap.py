"""Whether a second sync in flight raises how many syncs the disk completes.

A round of `sync = "always"` writers waits for the sync of the log that
covers it; while one runs, the next round gathers, and is synced once it
ends (one sync at a time, mqd_bdb.worker). Letting that next round start its
own sync at once, overlapping the first, pays only if the disk completes
more syncs a second with two in flight than with one. This measures that,
on a file written full of zeros ahead as the log is (`zero_log_files`): N
threads each append a 4 KB record and fdatasync the file, over and over
(os.fdatasync lets go of the GIL, so N syncs are in flight), for N = 1, 2
and 4 in turn, alternating, and prints syncs a second and the sync's
latency percentiles for each.

Usage: python plugins/bdb/benchmarks/log_sync_overlap.py [--dir .] [--seconds 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

RECORD = b"r" * 4096
FILE_BYTES = 256 << 20  # written full of zeros ahead, as a log file is


class Log:
    """A file appended to in 4 KB records, each writer syncing after its own."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        zeros = b"\0" * (1 << 20)
        for _ in range(FILE_BYTES >> 20):
            os.write(self.fd, zeros)
        os.fsync(self.fd)
        self.offset = 0
        self.lock = threading.Lock()  # appends in order, as commits are

    def write_and_sync(self, until: float, latencies: list[float]) -> None:
        while time.monotonic() < until:
            with self.lock:
                os.pwrite(self.fd, RECORD, self.offset)
                self.offset = (self.offset + len(RECORD)) % FILE_BYTES
            start = time.perf_counter()
            os.fdatasync(self.fd)
            latencies.append(time.perf_counter() - start)


def run(log: Log, in_flight: int, seconds: float) -> tuple[float, list[float]]:
    """Syncs a second with `in_flight` writers, and every sync's latency."""
    per_thread: list[list[float]] = [[] for _ in range(in_flight)]
    until = time.monotonic() + seconds
    threads = [
        threading.Thread(target=log.write_and_sync, args=(until, lats)) for lats in per_thread
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    latencies = sorted(lat for lats in per_thread for lat in lats)
    return len(latencies) / seconds, latencies


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path("."), help="on the data directory's disk")
    p.add_argument("--seconds", type=float, default=3.0, help="each measure's length")
    p.add_argument("--rounds", type=int, default=3, help="rounds of 1, 2 and 4 in flight")
    a = p.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        log = Log(Path(tmp) / "log")
        try:
            for number in range(a.rounds):
                order = (1, 2, 4) if number % 2 == 0 else (4, 2, 1)
                for in_flight in order:
                    rate, lat = run(log, in_flight, a.seconds)
                    us = [lat[min(len(lat) - 1, int(len(lat) * q))] * 1e6 for q in (0.5, 0.99)]
                    print(
                        f"round {number + 1}, {in_flight} in flight: {rate:8.0f} syncs/s,"
                        f"  sync p50 {us[0]:6.0f} us  p99 {us[1]:6.0f} us"
                    )
        finally:
            os.close(log.fd)


if __name__ == "__main__":
    main()
