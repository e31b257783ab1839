"""Throughput of the Berkeley DB backends themselves, without the daemon.

N concurrent producers put unique 100-byte messages, then N consumers take
them all, on one event loop, as the broker would call the backend. Prints
operations per second, batches and flushes for each backend and sync mode.
With --mixed, N clients instead each put and take in turn on the one queue,
which stays near empty (memtier's queue load): most messages are taken in the
batch that put them, and never written (the count of such is printed).

Usage: python plugins/bdb/benchmarks/bdb_backend_bench.py [--count 50000]
       [--producers 16] [--sync always] [--backend bdb] [--unique] [--mixed]
       [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import tempfile
import threading
import time
from pathlib import Path

from mqd_bdb.backend import BdbBackend, BdbRandomBackend, BdbSingleBackend, _BdbBackend

from mqd.backend import Message, StorageOptions, Sync

BACKENDS: dict[str, type[_BdbBackend]] = {
    "bdb": BdbBackend,
    "bdb-single": BdbSingleBackend,
    "bdb-random": BdbRandomBackend,
}


async def run(
    name: str, data_dir: Path, count: int, producers: int, sync: Sync, unique: bool, mixed: bool
) -> None:
    backend = BACKENDS[name](StorageOptions(data_dir=data_dir))
    await backend.open()
    per = count // producers
    pad = b"x" * 88

    async def producer(p: int) -> None:
        for i in range(per):
            body = b"%05d-%05d-" % (p, i) + pad
            await backend.put("q", Message(body, created=time.time()), unique=unique, sync=sync)

    async def consumer() -> int:
        n = 0
        while await backend.take("q", sync=sync) is not None:
            n += 1
        return n

    w = backend.worker
    if mixed:
        await run_mixed(backend, per, producers, pad, sync)
        return
    # CPU time (all threads) per operation moves far less than wall-clock
    # rates when the machine is shared: compare code by it.
    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(producer(p) for p in range(producers)))
    put_s, put_cpu = time.perf_counter() - start, time.process_time() - cpu
    b0, f0 = w.batches, w.flushes
    start, cpu = time.perf_counter(), time.process_time()
    taken = sum(await asyncio.gather(*(consumer() for _ in range(producers))))
    take_s, take_cpu = time.perf_counter() - start, time.process_time() - cpu
    kind = "unique" if unique else "plain"
    put_us, take_us = put_cpu / (per * producers) * 1e6, take_cpu / max(taken, 1) * 1e6
    print(
        f"{name:11} {sync.value:8} {kind:6} put {per * producers / put_s:9,.0f}/s "
        f"{put_us:5.1f} us cpu/op ({b0} batches, {f0} flushes)   "
        f"take {taken / take_s:9,.0f}/s {take_us:5.1f} us cpu/op "
        f"({w.batches - b0} batches, {w.flushes - f0} flushes)"
    )
    await backend.close()


async def run_mixed(backend: _BdbBackend, per: int, clients: int, pad: bytes, sync: Sync) -> None:
    """Each client puts and takes in turn, `per` times: a queue whose consumers keep up.

    Half the clients start with a take, so that each batch holds puts and takes
    alike, as when memtier's connections drift out of step.
    """

    async def client(c: int) -> None:
        for i in range(per):
            body = b"%05d-%05d-" % (c, i) + pad
            if c % 2:
                await backend.take("q", sync=sync)
            await backend.put("q", Message(body, created=time.time()), sync=sync)
            if not c % 2:
                await backend.take("q", sync=sync)

    w = backend.worker
    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(client(c) for c in range(clients)))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    ops = 2 * per * clients
    print(
        f"{backend.name:11} {sync.value:8} mixed  {ops / wall:9,.0f} ops/s "
        f"{cpu / ops * 1e6:5.1f} us cpu/op ({w.batches} batches, {w.flushes} flushes, "
        f"{getattr(w.store, 'paired', 0)} puts taken in their own batch)"
    )
    await backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=50_000)
    parser.add_argument("--producers", type=int, default=16)
    parser.add_argument("--sync", choices=[s.value for s in Sync], action="append")
    parser.add_argument("--backend", choices=list(BACKENDS), action="append")
    parser.add_argument("--dir", type=Path, help="where to put data (default: a temp dir)")
    parser.add_argument("--unique", action="store_true", help="unique puts (as `add` makes)")
    parser.add_argument("--mixed", action="store_true", help="each client puts, then takes")
    parser.add_argument("--profile", action="store_true", help="profile the worker thread")
    args = parser.parse_args()
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        original = threading.Thread.run

        def profiled(self: threading.Thread) -> None:
            if self.name == "mqd-bdb":
                profiler.runcall(original, self)
            else:
                original(self)

        threading.Thread.run = profiled  # type: ignore[method-assign]
    for name in args.backend or list(BACKENDS):
        for sync in args.sync or ["always"]:
            with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                asyncio.run(
                    run(
                        name,
                        Path(tmp),
                        args.count,
                        args.producers,
                        Sync(sync),
                        args.unique,
                        args.mixed,
                    )
                )
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
