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

`--against DIR` measures another checkout's pure path beside them (its mqd
imported from DIR, e.g. the tree before a change), `--repeat N` alternates
N interpreters per path.

Usage: python benchmarks/run_path.py [--commands N] [--repeat N] [--against DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import importlib
import json
import os
import pstats
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from harness import child_json, fmt_ratio, print_table, revision

BODY = b"x" * 100
SET = b"set q1 0 0 %d\r\n%b\r\n" % (len(BODY), BODY)
GET = b"get q1\r\n"
SHAPES = {"16 per read": [(SET + GET) * 8], "1 per read": [SET, GET]}
# Sets and gets apart: a round's sets, timed, then as many gets, timed.
APART = {"16 per read": (SET * 16, GET * 16), "1 per read": (SET, GET)}
APART_COLUMNS = [f"{verb}, {shape}" for shape in APART for verb in ("set", "get")]
ROUND = 2048  # commands per timed round
LAYERS = {  # file name -> layer (files not listed count as "other")
    "protocol.py": "protocol (parser, replies)",
    "broker.py": "broker",
    "memory.py": "backend (memory)",
    "backend.py": "backend (memory)",
    "server.py": "server (connection, life cycle)",
    "connection.py": "server (connection, life cycle)",
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

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass


def _connection_class() -> Any:
    """mqd's Connection: in its own module, or in the server module in older trees."""
    for module in ("mqd.connection", "mqd.server"):
        try:
            return importlib.import_module(module).Connection
        except (ImportError, AttributeError):
            continue
    raise RuntimeError("no mqd Connection class found")


async def _measure(commands: int) -> dict[str, Any]:
    """In this interpreter: ns per command per shape, and the pure path's split."""
    from mqd import backend, native
    from mqd import config as configuration
    from mqd.server import Server

    Connection = _connection_class()
    cfg = configuration.load(None, backend="memory")
    server = Server(cfg, backend.load("memory")(cfg.storage_options()))
    server.loop = asyncio.get_running_loop()
    await server.broker.start()
    conn = Connection(server)
    transport = CountingTransport()
    conn.connection_made(transport)
    # A tree without mqd/native.py imports this checkout's (an editable install's finder),
    # which then was never activated: that tree has no compiled modules.
    own = Path(native.__file__).parent == Path(configuration.__file__).parent
    # Trees before plugins had builds kept mqd's on the module itself.
    build: Any = getattr(native, "MQD", native)
    state = build.state if own else "pure Python (no compiled modules in that tree)"
    out: dict[str, Any] = {"state": state, "ns": {}, "split": {}}
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
        if not (own and build.compiled):
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
    out["apart"] = _apart(conn, commands)
    if transport.sent == 0:
        raise RuntimeError("the connection sent no replies")
    return out


def _apart(conn: Any, commands: int) -> dict[str, float]:
    """ns per set and per get, each timed alone, in each shape (best rounds)."""
    found: dict[str, float] = {}
    for shape, (sets, gets) in APART.items():
        per_read = sets.count(b"set ")
        reads_per_round = max(1, ROUND // 2 // per_read)
        best = {"set": float("inf"), "get": float("inf")}
        for _ in range(max(9, commands // ROUND)):
            for verb, data in (("set", sets), ("get", gets)):
                t0 = time.perf_counter()
                for _ in range(reads_per_round):
                    conn.data_received(data)
                spent = (time.perf_counter() - t0) / (reads_per_round * per_read)
                best[verb] = min(best[verb], spent)
        for verb, spent in best.items():
            found[f"{verb}, {shape}"] = spent * 1e9
    return found


def _run(pure: bool, commands: int, tree: str | None = None) -> dict[str, Any]:
    """Measure in a fresh interpreter; `tree`: another checkout whose mqd it imports."""
    env = {"MQD_PURE_PYTHON": "1" if pure else "0"}
    if tree is not None:
        env["PYTHONPATH"] = tree
    result: dict[str, Any] = child_json(__file__, ["--commands", str(commands)], env)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--commands", type=int, default=600_000, help="commands per shape and path")
    p.add_argument("--repeat", type=int, default=1, help="interpreters per path, alternated")
    p.add_argument(
        "--against",
        metavar="DIR",
        action="append",
        default=[],
        help="also the pure path of another checkout's mqd (imported from DIR); repeatable",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(asyncio.run(_measure(a.commands))))
        return 0
    # Rounds alternate the interpreters, so a burst of other activity on the
    # machine does not fall on one of them only; each keeps its best round.
    runs: dict[str, list[dict[str, Any]]] = {"pure": [], "compiled": []}
    for tree in a.against:
        runs[f"{revision(Path(tree))} pure"] = []
    for _ in range(a.repeat):
        runs["pure"].append(_run(True, a.commands))
        runs["compiled"].append(_run(False, a.commands))
        for tree in a.against:
            runs[f"{revision(Path(tree))} pure"].append(_run(True, a.commands, tree))
    best = {name: {s: min(r["ns"][s] for r in rs) for s in SHAPES} for name, rs in runs.items()}
    rows = []
    for name in runs:
        rows.append(
            [name, runs[name][0]["state"]]
            + [f"{best[name][s]:.0f}" for s in SHAPES]
            + [fmt_ratio(best[name][s], best["pure"][s]) for s in SHAPES]
        )
    print_table(
        f"CPU per command on the memory path, in process, ns (best of {a.commands // ROUND} "
        f"rounds of {ROUND} commands, in each of {a.repeat} interpreter(s))",
        ["mqd", "modules", *(f"{s} ns" for s in SHAPES), *(f"{s} /pure" for s in SHAPES)],
        rows,
    )
    apart = {
        n: {c: min(r["apart"][c] for r in rs) for c in APART_COLUMNS} for n, rs in runs.items()
    }
    print_table(
        "sets and gets apart, ns of CPU per command (same interpreters)",
        ["mqd", *(f"{c} ns" for c in APART_COLUMNS), *(f"{c} /pure" for c in APART_COLUMNS)],
        [
            [name]
            + [f"{apart[name][c]:.0f}" for c in APART_COLUMNS]
            + [fmt_ratio(apart[name][c], apart["pure"][c]) for c in APART_COLUMNS]
            for name in runs
        ],
    )
    pure = runs["pure"][0]
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
