"""What one command costs on mqd's memory path, in process: no sockets, no kernel.

A connection of the real server (mqd.server.Connection over the memory
backend) is fed what a client sends, 8 sets and 8 gets per read (a client
pipelining 16 deep) or one command per read, and writes its replies to a
transport that only counts them. The figure is CPU time per command, best of
many short rounds (the minimum is the round least disturbed by other programs), for
the pure-Python modules and for the compiled ones (mqd/native.py), each in
its own interpreter. For the pure path, cProfile splits the time by module:
parser and reply rendering (protocol), broker, backend, server.

Over the network the kernel's work per read and write comes on top; the
figures here are the part of the cost that the Python code decides.

Usage: python benchmarks/run_path.py [--commands N]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import subprocess
import sys
import time
from collections import Counter
from typing import Any

from harness import fmt_ratio, print_table

BODY = b"x" * 100
SET = b"set q1 0 0 %d\r\n%b\r\n" % (len(BODY), BODY)
GET = b"get q1\r\n"
SHAPES = {"16 per read": [(SET + GET) * 8], "1 per read": [SET, GET]}
ROUND = 2048  # commands per timed round
LAYERS = {  # file name -> layer (files not listed count as "other")
    "protocol.py": "protocol (parser, replies)",
    "broker.py": "broker",
    "memory.py": "backend (memory)",
    "backend.py": "backend (memory)",
    "server.py": "server",
}


class CountingTransport:
    """What Connection needs of a transport; the replies are only counted."""

    def __init__(self) -> None:
        self.sent = 0

    def write(self, data: bytes) -> None:
        self.sent += len(data)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


async def _measure(commands: int) -> dict[str, Any]:
    """In this interpreter: ns per command per shape, and the pure path's split."""
    from mqd import backend, native
    from mqd import config as configuration
    from mqd.server import Connection, Server

    cfg = configuration.load(None, backend="memory")
    server = Server(cfg, backend.load("memory")(cfg.storage_options()))
    server.loop = asyncio.get_running_loop()
    await server.broker.start()
    conn = Connection(server)
    transport = CountingTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    out: dict[str, Any] = {"state": native.state, "ns": {}, "split": {}}
    for shape, reads in SHAPES.items():
        per_read = sum(r.count(b"\r\n") - r.count(b"set ") for r in reads) / len(reads)
        # Many short rounds: on a shared machine the shortest is the one no
        # other program interrupted.
        reads_per_round = max(1, int(ROUND / per_read / len(reads)))
        rounds = max(9, commands // ROUND)
        for _ in range(reads_per_round):  # warm-up: caches, the queue's first use
            for data in reads:
                conn.data_received(data)
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(reads_per_round):
                for data in reads:
                    conn.data_received(data)
            best = min(best, (time.perf_counter() - t0) / (reads_per_round * len(reads) * per_read))
        out["ns"][shape] = best * 1e9
        if not native.compiled:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(rounds * reads_per_round // 4):
                for data in reads:
                    conn.data_received(data)
            profile.disable()
            split: Counter[str] = Counter()
            stats: dict[tuple[str, int, str], tuple[Any, ...]] = pstats.Stats(profile).stats  # type: ignore[attr-defined]
            for (path, _line, _func), (_cc, _nc, tottime, *_rest) in stats.items():
                split[LAYERS.get(os.path.basename(path), "other (event loop glue, builtins)")] += (
                    tottime
                )
            total = sum(split.values())
            out["split"][shape] = {k: v / total for k, v in split.most_common()}
    if transport.sent == 0:
        raise RuntimeError("the connection sent no replies")
    return out


def _run(pure: bool, commands: int) -> dict[str, Any]:
    env = {**os.environ, "MQD_PURE_PYTHON": "1" if pure else "0"}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", "--commands", str(commands)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"measuring failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--commands", type=int, default=600_000, help="commands per shape and path")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(asyncio.run(_measure(a.commands))))
        return 0
    pure = _run(True, a.commands)
    fast = _run(False, a.commands)
    rows = []
    for shape in SHAPES:
        ns_pure, ns_fast = pure["ns"][shape], fast["ns"][shape]
        rows.append(
            [
                shape,
                f"{ns_pure:.0f}",
                f"{ns_fast:.0f}",
                fmt_ratio(ns_fast, ns_pure),
                f"{1e9 / ns_fast:,.0f}",
            ]
        )
    print_table(
        f"CPU per command on the memory path, in process, best of {a.commands // ROUND} rounds "
        f"of {ROUND} (ns); "
        f"pure: {pure['state']}; compiled: {fast['state']}",
        ["commands", "pure ns", "compiled ns", "compiled/pure", "compiled commands/s"],
        rows,
    )
    layers = sorted({k for split in pure["split"].values() for k in split})
    print_table(
        "where the pure path's time goes (cProfile, own time by module; cProfile's own "
        "cost per call inflates the layers that make many small calls)",
        ["layer", *SHAPES],
        [[layer, *(f"{pure['split'][s].get(layer, 0):.0%}" for s in SHAPES)] for layer in layers],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
