"""A queue a thousand times one record: 1,000,000 messages of 1 KiB in, then out in FIFO order.

Starts an in-memory Aerospike node big enough for about 1 GB of messages
(the server build in ../shared/aerospike or MQD_AEROSPIKE_DIR; or
MQD_AEROSPIKE_HOSTS=host:port) and one mqd daemon on it. Producer
connections enqueue numbered messages (`set`, pipelined a window at a time),
each its own numbers in order; then consumer connections drain the queue
(`get`), and each consumer must see every producer's numbers in increasing
order (the queue is FIFO), every message exactly once over all of them. The
daemon's resident memory is sampled as the queue grows and shrinks: it must
stay flat, since messages live in the cluster, not in the daemon.

Usage: python plugins/aerospike/benchmarks/aerospike_million.py [--count 1000000]
       [--size 1024] [--producers 8] [--consumers 8] [--window 100]
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mqd_aerospike.server import calls_served, node, unavailable

from mqd.testing.daemon import Daemon


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Conn:
    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_connection(address, timeout=60)
        self.buf = bytearray()

    def need(self, size: int) -> None:
        while len(self.buf) < size:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("closed")
            self.buf += chunk

    def line(self) -> bytes:
        while (end := self.buf.find(b"\r\n")) < 0:
            self.need(len(self.buf) + 1)
        out = bytes(self.buf[:end])
        del self.buf[: end + 2]
        return out

    def value(self) -> bytes | None:
        head = self.line()
        if head == b"END":
            return None
        size = int(head.split()[3])
        self.need(size + 2)
        body = bytes(self.buf[:size])
        del self.buf[: size + 2]
        if self.line() != b"END":
            raise AssertionError("a get answered more than one value")
        return body


def produce(
    address: tuple[str, int],
    me: int,
    first: int,
    last: int,
    size: int,
    window: int,
    done: list[int],
) -> None:
    """Messages first..last-1, numbered with this producer's index, in order."""
    conn = Conn(address)
    pad = b"." * (size - 12)
    for start in range(first, last, window):
        stop = min(start + window, last)
        conn.sock.sendall(
            b"".join(
                b"set big 0 0 %d\r\n%02d%010d%b\r\n" % (size, me, i, pad)
                for i in range(start, stop)
            )
        )
        for _ in range(start, stop):
            if conn.line() != b"STORED":
                raise AssertionError("a set was not STORED")
        done.append(stop - start)


def consume(
    address: tuple[str, int], seen: list[bytes], stop: threading.Event, window: int
) -> None:
    """Take messages until told to stop; each producer's must come in its order."""
    conn = Conn(address)
    last: dict[bytes, int] = {}
    while not stop.is_set():
        conn.sock.sendall(b"get big\r\n" * window)
        for _ in range(window):
            body = conn.value()
            if body is None:
                continue
            producer, number = body[:2], int(body[2:12])
            if number <= last.get(producer, -1):
                raise AssertionError(f"producer {producer!r}: {number} after {last[producer]}")
            last[producer] = number
            seen.append(body[:12])


def sample(
    daemon: Daemon,
    phase: str,
    progress: Callable[[], int],
    done: threading.Event,
    out: list[tuple[str, int, float]],
) -> None:
    while not done.wait(2.0):
        out.append((phase, progress(), rss_mb(daemon.pid)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1_000_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument("--consumers", type=int, default=8)
    parser.add_argument("--window", type=int, default=100, help="commands sent before reading")
    args = parser.parse_args()
    reason = unavailable()
    if reason:
        print(f"skipped: {reason}")
        return 0
    count, size, window = args.count, args.size, args.window
    data_gb = max(2, (count * (size + 200)) // (1 << 30) + 2)
    samples: list[tuple[str, int, float]] = []
    with node(data_size=f"{data_gb}G") as server, tempfile.TemporaryDirectory() as work:
        text = (
            f'[storage.aerospike]\nhosts = ["{server.host}"]\n'
            f'set_prefix = "m{uuid.uuid4().hex[:8]}"\nmax_item_size = {size + 64}\n'
        )
        with Daemon(Path(work), "aerospike", text, args=("--log-level", "warning")) as daemon:
            calls_before = calls_served(server.host)
            share = -(-count // args.producers)
            bounds = [(i * share, min((i + 1) * share, count)) for i in range(args.producers)]
            progress: list[int] = []

            def stored() -> int:
                return sum(progress)

            done = threading.Event()
            watcher = threading.Thread(
                target=sample, args=(daemon, "filling", stored, done, samples)
            )
            started = time.monotonic()
            watcher.start()
            with ThreadPoolExecutor(args.producers) as pool:
                jobs = [
                    pool.submit(produce, daemon.address, i, lo, hi, size, window, progress)
                    for i, (lo, hi) in enumerate(bounds)
                ]
                for job in jobs:
                    job.result()
            filled = time.monotonic() - started
            done.set()
            watcher.join()
            size_line = memcache_items(daemon.address)
            samples.append(("full", count, rss_mb(daemon.pid)))
            calls_in = calls_served(server.host) - calls_before
            seen: list[bytes] = []
            stop, done = threading.Event(), threading.Event()
            watcher = threading.Thread(
                target=sample, args=(daemon, "draining", lambda: len(seen), done, samples)
            )
            started = time.monotonic()
            watcher.start()
            with ThreadPoolExecutor(args.consumers) as pool:
                jobs = [
                    pool.submit(consume, daemon.address, seen, stop, window)
                    for _ in range(args.consumers)
                ]
                while len(seen) < count and not any(j.done() for j in jobs):
                    time.sleep(0.2)
                stop.set()
                for job in jobs:
                    job.result()
            drained = time.monotonic() - started
            done.set()
            watcher.join()
            samples.append(("empty", len(seen), rss_mb(daemon.pid)))
            calls_all = calls_served(server.host) - calls_before
    unique = len(set(seen))
    print(f"{count:,} messages of {size} bytes ({count * size / 1e9:.2f} GB); {size_line}")
    print(
        f"enqueue, {args.producers} producers: {filled:.1f} s, {count / filled:,.0f} msgs/s, "
        f"{calls_in / count:.3f} Aerospike calls/msg"
    )
    print(
        f"dequeue, {args.consumers} consumers: {drained:.1f} s, {len(seen) / drained:,.0f} msgs/s, "
        f"{(calls_all - calls_in) / max(len(seen), 1):.3f} Aerospike calls/msg"
    )
    print(f"out: {len(seen):,} messages, {unique:,} different; each producer's in its order")
    print(f"daemon RSS (MB), sampled every 2 s ({len(samples)} samples; about 12 shown):")
    for phase, at, mb in samples[:: max(len(samples) // 12, 1)] + samples[-1:]:
        print(f"  {phase:9} {at:>10,}  {mb:7.1f}")
    sizes = [mb for _, _, mb in samples]
    print(f"RSS: min {min(sizes):.1f} MB, max {max(sizes):.1f} MB")
    ok = len(seen) == count and unique == count
    print("OK" if ok else "FAILED: messages lost or repeated")
    return 0 if ok else 1


def memcache_items(address: tuple[str, int]) -> str:
    """The queue's gauges from `stats`, as the daemon reports them."""
    conn = Conn(address)
    conn.sock.sendall(b"stats\r\n")
    found = []
    while (line := conn.line()) != b"END":
        if line.startswith((b"STAT queue_big_items", b"STAT queue_big_bytes")):
            found.append(line.decode().removeprefix("STAT queue_big_"))
    return "at full: " + ", ".join(found)


if __name__ == "__main__":
    sys.exit(main())
