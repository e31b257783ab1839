"""What one sync of the log costs: log files written full of zeros ahead or not,
synced by Berkeley DB's log_flush or by Linux AIO.

Runs batches of plain puts in the single-file layout's store, as the worker
would, each followed by a sync of the log (what `sync = "always"` waits for),
in three ways, alternating: `zero_log_files = true` and false with
log_flush, which holds its caller for the whole sync; and `zero_log_files =
true` with Linux AIO's fdatasync (mqd_bdb.logsync, `aio_sync`), where the
caller, the event loop, is held only while it submits and goes on until the
end is signalled. Prints the sync's latency, how long the caller was held,
and the batch's latency, as percentiles. Run it on the file system the data
directory will live on (--dir): zeroing ahead saves a sync the update of the
file's size and blocks where the file system keeps them apart from the data
(such as ext4), and nothing on a copy-on-write one.

Usage: python plugins/bdb/benchmarks/bdb_log_sync.py [--dir .] [--batches 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bdb_batch_cpu import batch
from mqd_bdb import jobs
from mqd_bdb.config import BdbConfig
from mqd_bdb.logsync import LogSync
from mqd_bdb.single import SingleStore


def summary(seconds: list[float]) -> str:
    us = sorted(s * 1e6 for s in seconds)
    at = {p: us[min(len(us) - 1, int(len(us) * p / 100))] for p in (50, 90, 99)}
    return (
        f"p50 {at[50]:6.0f}  p90 {at[90]:6.0f}  p99 {at[99]:6.0f}  max {us[-1]:6.0f}  "
        f"mean {statistics.fmean(us):6.0f} us"
    )


def measure(where: Path, zero: bool, aio: bool, batches: int, puts: int) -> None:
    config = BdbConfig(zero_log_files=zero)
    loop = asyncio.new_event_loop()
    ended: list[asyncio.Future[OSError | None]] = []
    syncer = LogSync(loop, lambda _, error: ended[-1].set_result(error)) if aio else None
    where.mkdir(parents=True, exist_ok=True)  # --dir may name one not made yet
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        store = SingleStore(Path(tmp), config)
        store.open()
        syncs, held, commits = [], [], []
        try:
            for number in range(batches):
                results: list[jobs.Result] = []
                start = time.perf_counter()
                store.execute(batch(puts)[::2], results, {})
                ran = time.perf_counter()
                if syncer is None:
                    store.flush()
                    held.append(time.perf_counter() - ran)
                else:
                    syncer.follow(store.env)
                    ended.append(loop.create_future())
                    syncer.submit(number)
                    held.append(time.perf_counter() - ran)
                    if (error := loop.run_until_complete(ended[-1])) is not None:
                        raise SystemExit(f"a sync failed: {error}")
                syncs.append(time.perf_counter() - ran)
                commits.append(ran - start)
                if any(error is not None for _, error, _ in results):
                    raise SystemExit(f"a put failed: {results}")
        finally:
            if syncer is not None:
                syncer.close()
            loop.close()
            store.close()
    how = "Linux AIO" if aio else "log_flush"
    print(f"zero_log_files = {str(zero).lower():5}, {how:9}  sync  {summary(syncs)}")
    print(f"{'':33}  held  {summary(held)}")
    print(f"{'':33}  batch {summary(commits)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="where the data goes")
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--puts", type=int, default=8, help="100-byte puts per batch")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    for _ in range(args.repeat):
        for zero, aio in ((True, False), (False, False), (True, True)):
            measure(args.dir, zero, aio, args.batches, args.puts)


if __name__ == "__main__":
    main()
