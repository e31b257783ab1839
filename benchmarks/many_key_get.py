"""How long a `get` of many keys takes, on a real daemon per backend.

A get names up to 8192 keys. Each case sends one such get on one connection
and times it to its `END`, several rounds:

- `empty`: every key a different queue that does not exist (`END` alone);
- `taking`: the same queue named N times, holding N messages (all taken).

    .venv/bin/python benchmarks/many_key_get.py --backends bdb,memory --keys 100,2000,6000

Prints keys per second over the rounds, and the p50 and worst time of a get.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from mqd.testing.daemon import Daemon
from mqd.testing.raw import Raw


def _get(conn: Raw, keys: list[bytes]) -> tuple[float, bytes]:
    started = time.perf_counter()
    conn.send(b"get " + b" ".join(keys) + b"\r\n")
    reply = conn.read_until(b"END\r\n")
    return time.perf_counter() - started, reply


def _fill(conn: Raw, count: int) -> None:
    conn.send(b"set q 0 0 4 noreply\r\nbody\r\n" * count)
    conn.call(b"version\r\n", b"VERSION ")  # every set before it is done
    conn.read_until(b"\r\n")


def measure(backend: str, counts: list[int], rounds: int) -> None:
    with tempfile.TemporaryDirectory() as workdir, Daemon(Path(workdir), backend) as daemon:
        conn = Raw(daemon.address, timeout=120)
        for count in counts:
            for case in ("empty", "taking"):
                times = []
                for round_ in range(rounds):
                    if case == "empty":
                        keys = [b"u%d-%d" % (round_, i) for i in range(count)]
                    else:
                        _fill(conn, count)
                        keys = [b"q"] * count
                    took, reply = _get(conn, keys)
                    values = reply.count(b"VALUE ")
                    if values != (count if case == "taking" else 0):
                        raise SystemExit(f"{backend} {case} {count}: {values} values")
                    times.append(took)
                p50 = statistics.median(times)
                print(
                    f"  {backend:10} {case:6} {count:5} keys: {count / p50:12,.0f} keys/s"
                    f"  p50 {p50 * 1000:8.2f} ms  worst {max(times) * 1000:8.2f} ms"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="bdb,memory")
    parser.add_argument("--keys", default="100,2000,6000", help="key counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    counts = [int(k) for k in args.keys.split(",")]
    for backend in args.backends.split(","):
        measure(backend, counts, args.rounds)


if __name__ == "__main__":
    main()
