"""Moving a queue's messages out through named leases, against plain gets, per backend.

For each backend a daemon is started and filled with N messages of 100
bytes, twice. The first N leave through named leases: `gets q/lease=<k>/n=<chunk>`
(one line, the reply carries the chunk's messages with their ids), then
`delete q/lease=<k>` acknowledging the chunk, until the queue is empty. The
second N leave through a plain pymemcache `get` loop, one message per round
trip: the reference, in the same run. Both are checked by count and by a
digest of the bodies. Printed: rows/s of each and their ratio, the
reserve and acknowledgement times of a chunk (median), and the daemon's CPU
time per message (user plus system, all its threads) while each leg ran.

With `--against DIR` the same is measured for another checkout's mqd in the
same run, legs interleaved checkout by checkout, `--repeat` times; each
checkout's lease CPU per message is then also given as a ratio against the
first's.

This machine's cores are shared with other work: the figures are noisy, and
only ratios measured in the same run mean much.

Usage: python benchmarks/run_leases.py [--messages N] [--chunk N] [--backends memory,bdb]
       [--against DIR] [--repeat N]
"""

from __future__ import annotations

import argparse
import hashlib
import socket
import statistics
import sys
import time
from dataclasses import dataclass

from harness import (
    HOST,
    Checkout,
    add_checkout_options,
    checkouts,
    fill,
    fmt_rate,
    fmt_ratio,
    mqd,
    print_table,
)
from pymemcache.client.base import Client

BODY_SIZE = 100


def read_values(sock: socket.socket) -> list[tuple[int, bytes]]:
    """One `gets` reply: (id, body) of each VALUE, up to END.

    Parsed in place from one growing buffer: slicing the rest off after every
    value would copy a reply of many values once per value.
    """
    buf = bytearray()
    pos = 0
    found: list[tuple[int, bytes]] = []
    while True:
        line_end = buf.find(b"\r\n", pos)
        if line_end >= 0:
            line = bytes(buf[pos:line_end])
            if line == b"END":
                return found
            fields = line.split()
            if fields[0] != b"VALUE" or len(fields) != 5:
                raise RuntimeError(f"unexpected reply line {line!r}")
            start = line_end + 2
            end = start + int(fields[3])
            if len(buf) >= end + 2:
                found.append((int(fields[4]), bytes(buf[start:end])))
                pos = end + 2
                continue
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise RuntimeError("the daemon closed the connection")
        buf += chunk


def read_line(sock: socket.socket) -> bytes:
    line = b""
    while not line.endswith(b"\r\n"):
        chunk = sock.recv(1)
        if not chunk:
            raise RuntimeError("the daemon closed the connection")
        line += chunk
    return line


def through_leases(port: int, queue: str, chunk: int) -> tuple[int, str, list[float], list[float]]:
    """Empty `queue` through named leases of `chunk` messages: count, digest, times."""
    digest = hashlib.sha256()
    count = 0
    reserve_s: list[float] = []
    ack_s: list[float] = []
    with socket.create_connection((HOST, port), timeout=120) as sock:
        for n in range(sys.maxsize):
            t0 = time.perf_counter()
            sock.sendall(b"gets %b/lease=bench-%d/n=%d\r\n" % (queue.encode(), n, chunk))
            values = read_values(sock)
            reserve_s.append(time.perf_counter() - t0)
            if not values:
                return count, digest.hexdigest(), reserve_s, ack_s
            for _, body in sorted(values):
                digest.update(body)
            count += len(values)
            t0 = time.perf_counter()
            sock.sendall(b"delete %b/lease=bench-%d\r\n" % (queue.encode(), n))
            reply = read_line(sock)
            ack_s.append(time.perf_counter() - t0)
            if reply != b"DELETED\r\n":
                raise RuntimeError(f"acknowledging lease {n}: {reply!r}")
    raise AssertionError("unreachable")


def through_gets(port: int, queue: str) -> tuple[int, str]:
    """Empty `queue` with one plain get per message: count and digest."""
    digest = hashlib.sha256()
    count = 0
    client = Client((HOST, port), connect_timeout=10, timeout=60)
    try:
        while (body := client.get(queue)) is not None:
            digest.update(body)
            count += 1
    finally:
        client.close()
    return count, digest.hexdigest()


def expected(messages: int) -> str:
    """The digest of what the load generator stored: `messages` bodies of BODY_SIZE bytes."""
    return hashlib.sha256(b"x" * BODY_SIZE * messages).hexdigest()


@dataclass(frozen=True)
class Run:
    """One checkout's legs on one backend: rows/s, the daemon's CPU per row, chunk times."""

    leases_rate: float
    gets_rate: float
    leases_cpu_us: float
    gets_cpu_us: float
    reserve_ms: float
    ack_ms: float


def measure(checkout: Checkout, backend: str, messages: int, chunk: int) -> Run:
    """Both legs on a fresh daemon of `checkout`, each checked by count and digest."""
    with mqd(backend, exe=checkout.exe, env=dict(checkout.env) or None) as server:
        fill(server, "leased", messages, BODY_SIZE)
        t0, cpu0 = time.perf_counter(), server.cpu()
        count, digest, reserve_s, ack_s = through_leases(server.port, "leased", chunk)
        leased, leased_cpu = time.perf_counter() - t0, server.cpu() - cpu0
        fill(server, "plain", messages, BODY_SIZE)
        t0, cpu0 = time.perf_counter(), server.cpu()
        plain_count, plain_digest = through_gets(server.port, "plain")
        plain, plain_cpu = time.perf_counter() - t0, server.cpu() - cpu0
    want = expected(messages)
    for what, got, sha in (("leases", count, digest), ("gets", plain_count, plain_digest)):
        if got != messages or sha != want:
            raise RuntimeError(f"{backend} {what}: {got} of {messages} rows, digest {sha}")
    return Run(
        count / leased,
        plain_count / plain,
        leased_cpu / count * 1e6,
        plain_cpu / plain_count * 1e6,
        statistics.median(reserve_s[:-1]) * 1000,
        statistics.median(ack_s) * 1000,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--messages", type=int, default=100_000, help="messages moved each way")
    p.add_argument("--chunk", type=int, default=10_000, help="messages per lease (1..100000)")
    p.add_argument("--backends", default="memory,bdb", help="comma-separated backend names")
    p.add_argument("--repeat", type=int, default=1, help="runs per checkout and backend")
    add_checkout_options(p)
    a = p.parse_args(argv)
    found = checkouts(a)
    rows = []
    for backend in a.backends.split(","):
        runs: dict[str, list[Run]] = {c.label: [] for c in found}
        for _ in range(a.repeat):
            for checkout in found:
                runs[checkout.label].append(measure(checkout, backend, a.messages, a.chunk))
        first_cpu = statistics.median(r.leases_cpu_us for r in runs[found[0].label])
        for checkout in found:
            done = runs[checkout.label]
            mid = sorted(done, key=lambda r: r.leases_rate)[len(done) // 2]
            cpu = statistics.median(r.leases_cpu_us for r in done)
            rows.append(
                [
                    backend,
                    checkout.label,
                    fmt_rate(mid.leases_rate),
                    fmt_rate(mid.gets_rate),
                    fmt_ratio(mid.leases_rate, mid.gets_rate),
                    f"{cpu:.2f}",
                    ", ".join(f"{r.leases_cpu_us:.2f}" for r in done),
                    fmt_ratio(cpu, first_cpu),
                    f"{statistics.median(r.gets_cpu_us for r in done):.2f}",
                    f"{mid.reserve_ms:.1f}",
                    f"{mid.ack_ms:.1f}",
                ]
            )
    print_table(
        f"{a.messages:,} messages of {BODY_SIZE} bytes out of one queue, through named leases "
        f"of {a.chunk:,} and through plain gets (count and body digest checked); "
        f"median of {a.repeat} run(s) per checkout; CPU = the daemon's, per message",
        [
            "backend",
            "checkout",
            "leases rows/s",
            "gets rows/s",
            "leases /gets",
            "lease CPU us",
            "each run",
            f"/{found[0].label}",
            "get CPU us",
            "reserve ms",
            "ack ms",
        ],
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
