"""Cross-daemon wake-up: a `get q/t=...` waiting on one broker, woken by a `set` on another.

Both brokers share one in-process memory store (`[storage.memory] share`), the
many-daemon mode the conformance suite runs, so this measures the broker and
the store's wake-up path alone, with no network. For a shared backend over a
network (Aerospike) see run_aerospike.py, which measures it across processes.

    .venv/bin/python benchmarks/run_wakeup.py [--samples 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from mqd.backend import StorageOptions
from mqd.backends.memory import MemoryBackend
from mqd.broker import Broker, Session
from mqd.config import Config
from mqd.testing.many import get_command, store_command


async def measure(samples: int, data: Path) -> list[float]:
    """Seconds from each set on daemon 0 to the wait it ends on daemon 1."""
    brokers = []
    for n in range(2):
        backend = MemoryBackend(StorageOptions(data_dir=data, extra={"share": str(data)}))
        broker = Broker(backend, Config(daemon_id=f"daemon-{n}", data_dir=data))
        await broker.start()
        brokers.append(broker)
    loop = asyncio.get_running_loop()
    delays = []
    try:
        for _ in range(samples):
            waiting = asyncio.ensure_future(brokers[1].retrieve(get_command("q/t=5000"), Session()))
            await asyncio.sleep(0)  # the get is now waiting
            sent = loop.time()
            await brokers[0].store(store_command("q", b"x"))
            if not await waiting:
                raise SystemExit("a waiting get timed out instead of being woken")
            delays.append(loop.time() - sent)
    finally:
        for broker in brokers:
            await broker.stop()
    return sorted(delays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-wakeup-") as data:
        delays = asyncio.run(measure(args.samples, Path(data)))

    def ms(q: float) -> str:
        return f"{delays[min(int(q * len(delays)), len(delays) - 1)] * 1e3:.3f} ms"

    print(
        f"cross-daemon wake-up, {len(delays)} samples: "
        f"p50 {ms(0.5)}, p99 {ms(0.99)}, max {delays[-1] * 1e3:.3f} ms"
    )


if __name__ == "__main__":
    main()
