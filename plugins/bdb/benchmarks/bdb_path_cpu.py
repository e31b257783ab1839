"""CPU time a held command costs on the Berkeley DB path, in process, against memory's.

A connection of the real server (mqd.connection.Connection) is fed reads of
N sets and N plain gets of one queue, interleaved, as a client pipelining
2N deep sends them; after each read the event loop turns until the read's
replies are written (on bdb, once its round has ended). The daemon runs
`sync = "always"` on a data directory of its own. With "paired" every set is
taken in its own round, so no round writes a message or waits for a sync: the
figure is what the loop's code costs, without the disk. With "backlog" the
queue keeps one message, so every round writes one and deletes one, and is
synced (Linux AIO where the kernel offers it). The figure is CPU time of the
process (all threads, user and system) per command, the best of many rounds;
two depths split it into a cost per command and a cost per read (a round).

Usage: python plugins/bdb/benchmarks/bdb_path_cpu.py [--pairs 8,32] [--rounds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

from run_path import SET, CountingTransport

GET = b"get q1\r\n"
READS = 64  # reads per timed round


class SignallingTransport(CountingTransport):
    """Counts replies, and says when some were written."""

    def __init__(self) -> None:
        super().__init__()
        self.written = asyncio.Event()

    def write(self, data: bytes) -> None:
        super().write(data)
        self.written.set()


async def _measure(backend_name: str, shape: str, pairs: int, rounds: int) -> float:
    """ns of CPU per command, best round."""
    from mqd import backend
    from mqd import config as configuration
    from mqd.connection import Connection
    from mqd.server import Server

    with tempfile.TemporaryDirectory(prefix="bdb-path-") as tmp:
        toml = Path(tmp) / "mqd.toml"
        toml.write_text('[queues."*"]\nsync = "always"\n')
        cfg = configuration.load(toml, backend=backend_name, data_dir=Path(tmp) / "data")
        server = Server(cfg, backend.load(backend_name)(cfg.storage_options()))
        server.loop = asyncio.get_running_loop()
        await server.broker.start()
        conn = Connection(server)
        transport = SignallingTransport()
        conn.connection_made(transport)  # type: ignore[arg-type]

        async def send(data: bytes) -> None:
            transport.written.clear()
            conn.data_received(data)
            await transport.written.wait()

        if shape == "backlog":
            await send(SET)
        data = (SET + GET) * pairs
        for _ in range(200):  # warm-up
            await send(data)
        best = float("inf")
        for _ in range(rounds):
            started = time.process_time()
            for _ in range(READS):
                await send(data)
            best = min(best, (time.process_time() - started) / (READS * 2 * pairs))
        await server.broker.stop()
    return best * 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", default="8,32", help="set/get pairs per read, comma-separated")
    p.add_argument("--rounds", type=int, default=30, help="timed rounds of 64 reads")
    a = p.parse_args(argv)
    depths = [int(x) for x in a.pairs.split(",")]
    found: dict[tuple[str, str], dict[int, float]] = {}
    for backend_name, shape in (("memory", "paired"), ("bdb", "paired"), ("bdb", "backlog")):
        row = found[(backend_name, shape)] = {}
        for pairs in depths:
            row[pairs] = uvloop.run(_measure(backend_name, shape, pairs, a.rounds))
        figures = "  ".join(f"{2 * n} a read: {ns:6.0f} ns" for n, ns in row.items())
        line = f"{backend_name:6} {shape:7}  {figures}"
        if len(depths) >= 2:
            lo, hi = depths[0], depths[-1]
            per_cmd = (row[hi] * 2 * hi - row[lo] * 2 * lo) / (2 * (hi - lo))
            per_read = row[lo] * 2 * lo - per_cmd * 2 * lo
            line += f"  | {per_cmd:5.0f} ns a command + {per_read / 1000:5.1f} us a read"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
