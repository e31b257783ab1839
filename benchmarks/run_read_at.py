"""Reading a long memory-backend queue by message id, in process: `get q/at=<id>`'s cost.

A queue of N 100-byte messages (default 1,000,000) is filled with put(),
read at random ids with read_at() (what `get q/at=<id>` and the Spark data
source's reads do), then drained with take(). Printed: puts/s, the first
read (which may build an index), reads/s after it, takes/s, all CPU time in
one interpreter per checkout. `--against DIR` measures another checkout's
memory backend beside this one (its mqd imported from DIR), in the same run.

Usage: python benchmarks/run_read_at.py [--messages N] [--reads N] [--against DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from harness import child_json, fmt_rate, fmt_ratio, print_table, revision


async def _measure(messages: int, reads: int) -> dict[str, float]:
    from mqd.backend import Message, StorageOptions, Sync
    from mqd.backends.memory import MemoryBackend

    backend = MemoryBackend(StorageOptions())
    await backend.open()
    body = b"x" * 100
    t0 = time.process_time()
    for _ in range(messages):
        await backend.put("q", Message(body), unique=False, sync=Sync.NONE)
    put = time.process_time() - t0
    ids = [random.randrange(messages) for _ in range(reads)]
    t0 = time.process_time()
    first = await backend.read_at("q", ids[0])
    first_read = time.process_time() - t0
    t0 = time.process_time()
    for offset in ids:
        found = await backend.read_at("q", offset)
        if found is None or found.offset != offset:
            raise RuntimeError(f"read_at({offset}) found {found!r}")
    read = time.process_time() - t0
    t0 = time.process_time()
    while await backend.take("q", sync=Sync.NONE) is not None:
        pass
    take = time.process_time() - t0
    await backend.close()
    if first is None:
        raise RuntimeError("the first read found nothing")
    return {
        "put/s": messages / put,
        "first read ms": first_read * 1000,
        "reads/s": reads / read,
        "take/s": messages / take,
    }


def _run(messages: int, reads: int, tree: str | None) -> dict[str, float]:
    env = {} if tree is None else {"PYTHONPATH": tree}
    args = ["--messages", str(messages), "--reads", str(reads)]
    result: dict[str, float] = child_json(__file__, args, env)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--messages", type=int, default=1_000_000, help="messages in the queue")
    p.add_argument("--reads", type=int, default=20_000, help="random reads by id")
    p.add_argument("--against", metavar="DIR", action="append", default=[], help="repeatable")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(asyncio.run(_measure(a.messages, a.reads))))
        return 0
    runs: dict[str, dict[str, Any]] = {"this checkout": _run(a.messages, a.reads, None)}
    for tree in a.against:
        runs[revision(Path(tree))] = _run(a.messages, a.reads, tree)
    here = runs["this checkout"]
    rows = [
        [
            name,
            fmt_rate(r["put/s"]),
            f"{r['first read ms']:.1f}",
            fmt_rate(r["reads/s"]),
            fmt_rate(r["take/s"]),
            fmt_ratio(r["reads/s"], here["reads/s"]),
        ]
        for name, r in runs.items()
    ]
    print_table(
        f"memory backend, one queue of {a.messages:,} messages, {a.reads:,} random reads by id "
        "(CPU time, in process)",
        ["mqd", "put/s", "first read ms", "reads/s", "take/s", "reads /this"],
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
