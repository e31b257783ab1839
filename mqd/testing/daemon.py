"""A real `mqd serve` process on a free loopback port, for tests and benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from mqd.testing.ports import free_port, listens

START_TIMEOUT = 20.0


class Daemon:
    """Runs `python -m mqd serve` with a config written to `workdir/mqd.toml`.

    The data directory is `workdir/data`, kept across restart() so durable
    backends can be tested across crashes; the log is `workdir/mqd.log`.
    """

    def __init__(
        self,
        workdir: Path,
        backend: str = "memory",
        config_text: str = "",
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        redis: bool = False,
    ) -> None:
        self.workdir = workdir
        self.backend = backend
        self.config_path = workdir / "mqd.toml"
        self.config_path.write_text(config_text)
        self.data_dir = workdir / "data"
        self.log_path = workdir / "mqd.log"
        self.args = args
        self.env = {**os.environ, **(env or {})}
        self.port = free_port()
        self.redis_port = free_port() if redis else None  # the Redis listener's
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    @property
    def redis_address(self) -> tuple[str, int]:
        assert self.redis_port is not None, "Daemon(redis=True) starts the Redis listener"
        return ("127.0.0.1", self.redis_port)

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "mqd",
            "serve",
            "--config",
            str(self.config_path),
            "--listen",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--backend",
            self.backend,
            "--data-dir",
            str(self.data_dir),
            *(["--redis-port", str(self.redis_port)] if self.redis_port else []),
            *self.args,
        ]

    def start(self) -> Daemon:
        """Start the process and wait until it accepts connections."""
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.env
            )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mqd exited with {self.process.returncode}:\n{self.log()}")
            # Its own sockets, not a connection: that could reach another
            # program on the port, where this one failed to bind.
            if listens(self.pid, self.port) and (
                not self.redis_port or listens(self.pid, self.redis_port)
            ):
                return self
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"mqd did not start within {START_TIMEOUT}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then wait; returns the exit code (SIGKILL after `timeout`)."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL: a crash, as far as the daemon can tell."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def restart(self) -> Daemon:
        self.stop()
        return self.start()

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.kill()
