"""What hostile or careless clients cost the daemon: peak memory and log volume.

    .venv/bin/python benchmarks/hostile.py [--seconds 20] [--connections 3000]

Three cases, each on a fresh `mqd serve` (memory backend unless said):
- 3,000 pipelined `get q/peek` of a 64 KiB message, sent before reading;
- one line `get q/peek q/peek ...` of 4,000 keys;
- `--connections` clients against a daemon started with `ulimit -n 1024`
  (bdb backend), for `--seconds`, under uvloop and asyncio: how many were
  served, refused, reset or left without an answer, and how many bytes of
  log that made.
Peak memory is the daemon's VmHWM (Linux). Set PYTHONPATH to another
checkout's root to measure that one instead.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mqd.testing.daemon import Daemon

BODY = b"x" * 65536


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def read_exactly(sock: socket.socket, size: int) -> None:
    while size > 0:
        chunk = sock.recv(min(size, 1 << 20))
        if not chunk:
            raise ConnectionError("closed")
        size -= len(chunk)


def reply_case(lines: bytes, replies: int) -> tuple[float, float]:
    """Base and peak RSS (MiB) of a daemon sent `lines` by a client that reads late."""
    with tempfile.TemporaryDirectory() as tmp, Daemon(Path(tmp)) as d:
        sock = socket.create_connection(d.address, timeout=60)
        sock.sendall(b"set q 0 0 %d\r\n%b\r\n" % (len(BODY), BODY))
        read_exactly(sock, len(b"STORED\r\n"))
        base = peak_rss_mib(d.pid)
        sock.sendall(lines)
        time.sleep(2.0)  # the client reads nothing for a while
        one = len(b"VALUE q/peek 0 65536\r\n") + len(BODY) + 2
        read_exactly(sock, replies * one + (5 if replies == 4000 else 5 * replies))
        sock.close()
        return base, peak_rss_mib(d.pid)


class Limited(Daemon):
    def command(self) -> list[str]:
        return ["prlimit", "--nofile=1024:1024", "--", *super().command()]


def descriptor_case(connections: int, seconds: float, loop: str) -> dict[str, int]:
    env = {"MQD_LOOP": loop}
    with tempfile.TemporaryDirectory() as tmp, Limited(Path(tmp), backend="bdb", env=env) as d:
        socks = []
        for _ in range(connections):
            try:
                sock = socket.create_connection(d.address, timeout=seconds)
            except OSError:
                break
            sock.setblocking(False)
            sock.send(b"version\r\n")
            socks.append(sock)
        outcome = {"served": 0, "refused": 0, "no answer": 0, "reset": 0}
        deadline = time.monotonic() + seconds
        answered: dict[int, bytes] = {}
        while time.monotonic() < deadline and len(answered) < len(socks):
            for i, sock in enumerate(socks):
                if i in answered:
                    continue
                try:
                    data = sock.recv(100)
                except BlockingIOError:
                    continue
                except OSError:
                    answered[i] = b"reset"
                    continue
                answered[i] = data or b"reset"
            time.sleep(0.05)
        for i in range(len(socks)):
            data = answered.get(i, b"")
            if data.startswith(b"VERSION"):
                outcome["served"] += 1
            elif data.startswith(b"ERROR"):
                outcome["refused"] += 1
            elif data == b"reset":
                outcome["reset"] += 1
            else:
                outcome["no answer"] += 1
        for sock in socks:
            sock.close()
        outcome["log bytes"] = len(d.log().encode())
        outcome["PANIC lines"] = d.log().count("PANIC")
        return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--connections", type=int, default=3000)
    parser.add_argument("--only-descriptors", action="store_true")
    args = parser.parse_args()
    if not args.only_descriptors:
        base, peak = reply_case(b"get q/peek\r\n" * 3000, 3000)
        print(f"3000 pipelined peeks of 64 KiB: base {base:.0f} MiB, peak {peak:.0f} MiB")
        base, peak = reply_case(b"get" + b" q/peek" * 4000 + b"\r\n", 4000)
        print(f"one get of 4000 peek keys:      base {base:.0f} MiB, peak {peak:.0f} MiB")
    for loop in ("uvloop", "asyncio"):
        outcome = descriptor_case(args.connections, args.seconds, loop)
        print(f"{args.connections} connections, ulimit -n 1024, {loop}: {outcome}")


if __name__ == "__main__":
    main()
