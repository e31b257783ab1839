"""Long SIGKILL soak of a real daemon on each durable backend.

Runs mqd.testing.soak (producers, consumers mixing plain and reliable reads,
SIGKILL at random moments, restart on the same data directory) for as many
kill cycles as asked, on each backend asked, then checks the books: every
STORED message delivered, none twice unless it was open when the daemon died,
nothing delivered that was never sent. Prints cycles and counts; exits 1 on
any problem.

The backends: the three Berkeley DB ones, and `aerospike` on a node of its
own (../shared/aerospike's start script, or MQD_AEROSPIKE_HOSTS), skipped
with the reason when there is none. Only the daemon is killed there: the
node keeps what the daemon stored, and the restarted daemon (same data
directory, so the same daemon id) gives back the leases it held.

With --fanout, runs FanoutSoak instead: producers set into a
fanout parent with two children, consumers read all three reliably, and every
STORED message must be in all three queues, every unacknowledged one in all
three or none (on Aerospike, whose copies are commits of their own, it may
be in some).

With --queues N, producers and consumers spread over N queues instead of two:
more than the catalog's recent record holds (18), so some queues keep their
counts in their own records, and queues join and leave the recent ones as
the daemon restarts.

Usage: python benchmarks/crash_soak.py [--cycles 50]
       [--backend bdb] [--producers 4] [--consumers 4] [--seed N] [--keep]
       [--fanout] [--plain-share 0.5] [--queues 2]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mqd.testing.soak import FanoutSoak, Soak

BACKENDS = ["bdb", "bdb-single", "bdb-random", "aerospike"]


class Unavailable(Exception):
    """The backend cannot be had here; why."""


@contextmanager
def storage(backend: str) -> Iterator[str]:
    """What the daemon's config needs for `backend` beyond Soak's, for the duration."""
    if backend != "aerospike":
        yield ""
        return
    try:
        from mqd_aerospike.server import node, unavailable
    except ImportError as exc:
        raise Unavailable(f"no mqd_aerospike: {exc}") from exc
    if reason := unavailable():
        raise Unavailable(reason)
    with node() as started:
        # Sets of their own: a node named by MQD_AEROSPIKE_HOSTS may hold others.
        yield started.storage_table("soak" + uuid.uuid4().hex[:8])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=50, help="kills per backend")
    parser.add_argument("--backend", choices=BACKENDS, action="append")
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--consumers", type=int, default=4)
    parser.add_argument("--min-s", type=float, default=0.2, help="shortest run between kills")
    parser.add_argument("--max-s", type=float, default=2.0, help="longest run between kills")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--fanout", action="store_true", help="a parent and two children")
    parser.add_argument(
        "--plain-share",
        type=float,
        default=Soak.plain_share,
        help="share of reads that are plain gets, the rest /open then /close (1: a queue "
        "read by plain gets only, whose puts are often taken in their own batch)",
    )
    parser.add_argument(
        "--queues", type=int, default=len(Soak.queues), help="queues to spread over (not --fanout)"
    )
    args = parser.parse_args()
    failed = False
    for backend in args.backend or BACKENDS:
        try:
            with storage(backend) as config_text:
                failed = run_one(backend, config_text, args) or failed
        except Unavailable as why:
            print(f"{backend:11} skipped: {why}", flush=True)
    return 1 if failed else 0


def run_one(backend: str, config_text: str, args: argparse.Namespace) -> bool:
    """One soak of `backend` as `args` ask; whether it found a problem."""
    workdir = Path(tempfile.mkdtemp(prefix=f"mqd-soak-{backend}-"))
    start = time.monotonic()
    if args.fanout:
        fan = FanoutSoak(workdir, backend, args.producers, args.consumers, args.seed, config_text)
        fan.fanout.atomic = backend != "aerospike"  # a commit per copy there (FanoutBooks)
        fan.run(args.cycles, args.min_s, args.max_s)
        problems = fan.problems()
        copies = fan.fanout.copies()
        print(
            f"{backend:11} {fan.kills} kills in {time.monotonic() - start:.0f} s: "
            f"{len(fan.fanout.sent)} sent, {len(fan.fanout.stored)} stored; "
            f"in 3 queues {copies[3]}, in none {copies[0]}, "
            f"in 1 or 2 {copies[1] + copies[2]}: " + ("OK" if not problems else "FAILED"),
            flush=True,
        )
    else:
        soak = Soak(workdir, backend, args.producers, args.consumers, args.seed, config_text)
        soak.plain_share = args.plain_share
        if args.queues != len(Soak.queues):
            soak.queues = soak.targets = tuple(f"crash-{i}" for i in range(args.queues))
        books = soak.run(args.cycles, args.min_s, args.max_s)
        problems = soak.problems()
        print(
            f"{backend:11} {soak.kills} kills in {time.monotonic() - start:.0f} s: "
            f"{len(books.sent)} sent, {len(books.stored)} stored, "
            f"{len(books.taken)} taken, {len(books.opened)} opened, "
            f"{len(books.lost_open)} open at a kill, {books.lost_gets} plain gets cut off "
            f"(taking {len(books.missing())} unseen): " + ("OK" if not problems else "FAILED"),
            flush=True,
        )
    for problem in problems:
        print("   ", problem)
    if args.keep or problems:
        print("    work directory:", workdir)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return bool(problems)


if __name__ == "__main__":
    sys.exit(main())
