"""What one sync of the log costs, with log files written full of zeros ahead or not.

Runs batches of plain puts in the single-file layout's store, as the worker
would, each followed by a sync of the log (what `sync = "always"` waits for),
once with `zero_log_files = true` and once with false, alternating, and
prints the sync's and the batch's latency percentiles. Run it on the file
system the data directory will live on (--dir): zeroing ahead saves a sync
the update of the file's size and blocks where the file system keeps them
apart from the data (such as ext4), and nothing on a copy-on-write one.

Usage: python plugins/bdb/benchmarks/bdb_log_sync.py [--dir .] [--batches 20000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bdb_batch_cpu import batch
from mqd_bdb import jobs
from mqd_bdb.config import BdbConfig
from mqd_bdb.single import SingleStore


def summary(seconds: list[float]) -> str:
    us = sorted(s * 1e6 for s in seconds)
    at = {p: us[min(len(us) - 1, int(len(us) * p / 100))] for p in (50, 90, 99)}
    return (
        f"p50 {at[50]:6.0f}  p90 {at[90]:6.0f}  p99 {at[99]:6.0f}  max {us[-1]:6.0f}  "
        f"mean {statistics.fmean(us):6.0f} us"
    )


def measure(where: Path, zero: bool, batches: int, puts: int) -> None:
    config = BdbConfig(zero_log_files=zero)
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        store = SingleStore(Path(tmp), config)
        store.open()
        syncs, commits = [], []
        try:
            for _ in range(batches):
                results: list[jobs.Result] = []
                start = time.perf_counter()
                store.execute(batch(puts)[::2], results, {})
                ran = time.perf_counter()
                store.flush()
                syncs.append(time.perf_counter() - ran)
                commits.append(ran - start)
                if any(error is not None for _, error, _ in results):
                    raise SystemExit(f"a put failed: {results}")
        finally:
            store.close()
    print(f"zero_log_files = {str(zero).lower():5}  sync  {summary(syncs)}")
    print(f"{'':22}  batch {summary(commits)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="where the data goes")
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--puts", type=int, default=8, help="100-byte puts per batch")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    for _ in range(args.repeat):
        for zero in (True, False):
            measure(args.dir, zero, args.batches, args.puts)


if __name__ == "__main__":
    main()
