"""A node leaves a two-node cluster under load: nothing acknowledged is lost.

Starts two Aerospike nodes with replication 2 (the server build in
../shared/aerospike or MQD_AEROSPIKE_DIR), a backend on the first, and a
producer and a consumer on it. After a while the second node is killed with
SIGKILL; the clients go on. Sets and gets that fail while the cluster
rebalances answer SERVER_ERROR; at the end the queue is drained and every
message that was acknowledged must have come out exactly once.

Usage: python plugins/aerospike/benchmarks/aerospike_node_loss.py [--seconds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

from mqd_aerospike.backend import AerospikeBackend
from mqd_aerospike.server import server_dir

from mqd.backend import Message, Put, StorageOptions, Sync
from mqd.errors import StorageError


def start(where: Path, **env: str) -> tuple[str, Path]:
    done = subprocess.run(
        [str(where / "start")],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
        check=True,
    )
    workdir = Path(done.stderr.split("workdir=")[1].split()[0])
    return done.stdout.strip(), workdir


async def run(host: str, seconds: float, kill: float, victim: int) -> int:
    table = {"hosts": [host], "set_prefix": f"n{uuid.uuid4().hex[:8]}", "max_item_size": 4096}
    table.update(total_timeout_ms=1000, socket_timeout_ms=500, lock_lease_ms=500)
    backend = AerospikeBackend(StorageOptions(extra=table, owner="loss"))
    await backend.open()
    acked: set[bytes] = set()
    out: Counter[bytes] = Counter()
    errors = Counter[str]()
    stop = time.monotonic() + seconds
    killed_at = time.monotonic() + kill

    async def produce() -> None:
        n = 0
        while time.monotonic() < stop:
            body = b"m%d" % n
            n += 1
            try:
                if await backend.put("q", Message(body), sync=Sync.ALWAYS) is Put.STORED:
                    acked.add(body)
            except StorageError as error:
                errors[f"set: {error}"] += 1
                await asyncio.sleep(0.05)

    async def consume() -> None:
        while time.monotonic() < stop:
            try:
                m = await backend.take("q", sync=Sync.ALWAYS)
            except StorageError as error:
                errors[f"get: {error}"] += 1
                await asyncio.sleep(0.05)
                continue
            if m is None:
                await asyncio.sleep(0.002)
            else:
                out[m.body] += 1

    async def killer() -> None:
        await asyncio.sleep(max(killed_at - time.monotonic(), 0))
        os.kill(victim, signal.SIGKILL)
        print(f"node 2 killed at {kill:g} s")

    await asyncio.gather(produce(), consume(), killer())
    while True:  # drain what is left, the cluster settled
        try:
            m = await backend.take("q", sync=Sync.ALWAYS)
        except StorageError:
            await asyncio.sleep(0.2)
            continue
        if m is None:
            break
        out[m.body] += 1
    await backend.close()
    lost = acked - set(out)
    twice = [b for b, n in out.items() if n > 1]
    taken = sum(out.values())
    print(f"acknowledged {len(acked)}, taken {taken}, lost {len(lost)}, twice {len(twice)}")
    for what, n in errors.most_common():
        print(f"  {n} x SERVER_ERROR {what}")
    return 1 if lost or twice else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    where = server_dir()
    if where is None:
        print("skipped: no Aerospike server build (MQD_AEROSPIKE_DIR)")
        return 0
    first, dir1 = start(where, AS_REPLICATION="2")
    dir2 = None
    try:
        _, dir2 = start(where, AS_REPLICATION="2", AS_JOIN=str(dir1), AS_CLUSTER_SIZE="2")
        victim = int((dir2 / "asd.pid").read_text().split()[0])
        return asyncio.run(run(first, args.seconds, args.seconds / 3, victim))
    finally:
        for workdir in (dir2, dir1):
            if workdir is not None:
                subprocess.run(
                    [str(where / "stop"), str(workdir)], capture_output=True, timeout=120
                )


if __name__ == "__main__":
    sys.exit(main())
