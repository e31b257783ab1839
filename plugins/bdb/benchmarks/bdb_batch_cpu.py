"""CPU time per job of a batch in the FIFO layouts' store, without the worker thread.

Runs Store.execute() on batches of plain puts and takes of one queue, as the
worker would, and prints the CPU time per job (the median of some rounds) for
two shapes: a queue kept empty, each put taken in its own batch (128 pairs a
batch), and a queue with 16 messages waiting, batches of 8 pairs, where every
take reads the disk. The log is never synced here: this is the cost of the
jobs and the commit alone. To compare two checkouts, run each one's copy:

    .venv/bin/python plugins/bdb/benchmarks/bdb_batch_cpu.py
    /other/.venv/bin/python plugins/bdb/benchmarks/bdb_batch_cpu.py
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from mqd_bdb import jobs
from mqd_bdb.config import BdbConfig
from mqd_bdb.per_queue import PerQueueStore
from mqd_bdb.single import SingleStore
from mqd_bdb.store import Store

from mqd.backend import NO_LIMITS, Message, Sync

LAYOUTS: dict[str, type[Store]] = {"bdb": PerQueueStore, "bdb-single": SingleStore}
BODY = b"x" * 100


def batch(pairs: int) -> list[jobs.Job]:
    """`pairs` times a plain put then a take of queue q."""
    made: list[jobs.Job] = []
    for _ in range(pairs):
        made.append((jobs.PUT, "q", (Message(BODY), False, NO_LIMITS, None), Sync.ALWAYS, None))
        made.append((jobs.TAKE, "q", None, Sync.ALWAYS, None))
    return made


def per_job_us(store: Store, pairs: int, jobs_per_round: int, rounds: int) -> float:
    """The median CPU time per job over `rounds`, in microseconds."""
    times = []
    for _ in range(rounds):
        done = 0
        cpu = time.process_time()
        while done < jobs_per_round:
            results: list[jobs.Result] = []
            store.execute(batch(pairs), results, {})
            if any(error is not None for _, error, _ in results):
                raise SystemExit(f"a job failed: {results}")
            done += len(results)
        times.append((time.process_time() - cpu) / done * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=50_000, help="jobs per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for name, layout in LAYOUTS.items():
        with tempfile.TemporaryDirectory() as tmp:
            store = layout(Path(tmp), BdbConfig.from_table({}, None, f"storage.{name}", 0))
            store.open()
            try:
                empty = per_job_us(store, 128, args.jobs, args.rounds)
                waiting: list[jobs.Result] = []
                store.execute(batch(16)[::2], waiting, {})  # 16 puts, no takes
                backlog = per_job_us(store, 8, args.jobs, args.rounds)
            finally:
                store.close()
        print(
            f"{name:11} queue kept empty: {empty:5.2f} us/job   "
            f"16 waiting: {backlog:5.2f} us/job   "
            f"(puts taken in their own batch: {getattr(store, 'paired', 0)})"
        )


if __name__ == "__main__":
    main()
