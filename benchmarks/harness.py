"""What the benchmark scripts share: servers they start and stop, free loopback
ports, a process's resident memory, a daemon's `stats`, result tables, and the
checkouts of mqd a run compares (`--against DIR`).

Every server is started on 127.0.0.1 on a free port (mqd.testing.ports),
with its files in a temporary directory, and is stopped (TERM, then KILL)
when its `with` block ends, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from loadgen import LoadResult, LoadSpec, run_load
from rich.console import Console
from rich.table import Table

# Re-exported (as X): the scripts take them from here with the rest.
from mqd.testing.ports import HOST as HOST
from mqd.testing.ports import free_port as free_port
from mqd.testing.ports import listens as listens

# Wide enough for the result tables also when output goes to a file or CI log.
console = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 200)


def rss_bytes(pid: int) -> int:
    """Resident set size of process `pid` (VmRSS), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time process `pid` (all its threads) has used so far."""
    # The command name (field 2) may hold spaces; the fields after it do not.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def find_mqd(explicit: str | None = None) -> str:
    """The mqd executable: `explicit`, else the one beside this Python, else PATH."""
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / "mqd"
    if beside.exists():
        return str(beside)
    found = shutil.which("mqd")
    if not found:
        raise SystemExit("mqd not found: install the project (pip install -e .) or pass --mqd")
    return found


@dataclass(frozen=True)
class Checkout:
    """One mqd to measure: its executable, a label for the tables, its environment."""

    label: str
    exe: str
    env: tuple[tuple[str, str], ...] = ()


REPO = Path(__file__).resolve().parent.parent


def revision(directory: Path) -> str:
    """The short commit of a checkout, with "+" if it has uncommitted changes."""
    git = ["git", "-C", str(directory)]
    rev = subprocess.run(
        [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return (rev or directory.name) + ("+" if dirty else "")


def venv_python(exe: str) -> str:
    """Which Python the venv of executable `exe` was made on, from its pyvenv.cfg.

    On a plain build of Python mqd's pipelined figures fell by up to a quarter
    (RESULTS.md, "The interpreter"), so a run names it beside each mqd it measures.
    """
    cfg = Path(exe).resolve().parent.parent / "pyvenv.cfg"
    try:
        lines = cfg.read_text().splitlines()
    except OSError:
        return "python: not in a venv"
    keys = dict(line.split(" = ", 1) for line in lines if " = " in line)
    return f"python {keys.get('version', '?')} from {keys.get('home', '?')}"


def child_json(script: str, args: Sequence[str], env: dict[str, str]) -> Any:
    """Run `script --child args` in a fresh interpreter with `env` added; the JSON it prints.

    How the in-process benchmarks measure each checkout or path on its own.
    """
    proc = subprocess.run(
        [sys.executable, script, "--child", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"measuring failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def add_checkout_options(p: argparse.ArgumentParser) -> None:
    """--mqd and --against, shared by every script that starts mqd."""
    p.add_argument("--mqd", default=None, help="mqd executable (default: beside this Python)")
    p.add_argument(
        "--against",
        metavar="DIR",
        action="append",
        default=[],
        help="also measure the mqd of another checkout (DIR/.venv/bin/mqd, as bin/setup "
        "makes it), side by side in the same run; repeatable",
    )
    p.add_argument(
        "--pure",
        action="store_true",
        help="also measure this checkout's mqd on its pure-Python path (MQD_PURE_PYTHON=1), "
        "against its compiled modules (mqd/native.py)",
    )


def checkouts(args: argparse.Namespace) -> list[Checkout]:
    """This checkout's mqd first, then each --against checkout's."""
    this = revision(REPO) if args.mqd is None else Path(args.mqd).name
    found = [Checkout(this, find_mqd(args.mqd))]
    if args.pure:
        found.append(Checkout(f"{this}-pure", found[0].exe, (("MQD_PURE_PYTHON", "1"),)))
    for d in args.against:
        exe = Path(d).resolve() / ".venv" / "bin" / "mqd"
        if not exe.exists():
            raise SystemExit(f"--against {d}: no {exe}; run bin/setup in that checkout first")
        found.append(Checkout(revision(Path(d).resolve()), str(exe)))
    if len({c.label for c in found}) < len(found):  # the same commit twice: tell them apart
        found = [Checkout(f"{c.label}#{i}", c.exe, c.env) for i, c in enumerate(found, 1)]
    return found


def mqd_serve_flags(mqd: str) -> set[str]:
    """The long options `mqd serve` accepts, so optional ones are used only if offered."""
    out = subprocess.run(
        [mqd, "serve", "--help"], capture_output=True, text=True, timeout=60, check=False
    ).stdout
    return {tok.rstrip(",") for tok in out.split() if tok.startswith("--")}


class Server:
    """A server process started for one benchmark and stopped after it.

    `argv` may contain "{port}" and "{dir}", filled with a free port and a
    fresh temporary directory (removed afterwards). `files` are written into
    that directory as they are.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        ready_timeout: float = 30.0,
        files: dict[str, str] | None = None,
        base_dir: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.env = {**os.environ, **env} if env else None
        self.port = free_port()
        # base_dir picks the disk: durability figures depend on it, so a
        # user can point it at the disk the real queues would live on.
        self._tmp = tempfile.TemporaryDirectory(prefix=f"bench-{name}-", dir=base_dir)
        self.dir = Path(self._tmp.name)
        for rel, text in (files or {}).items():
            (self.dir / rel).write_text(text)
        self.argv = [a.format(port=self.port, dir=self.dir) for a in argv]
        self.ready_timeout = ready_timeout
        self._log = open(self.dir / "server.log", "w+b")  # noqa: SIM115 (closed in stop)
        self.proc: subprocess.Popen[bytes] | None = None
        # Where autogroup scheduling is on (as in many distributions'
        # kernels), a session is a scheduling group: the server's
        # threads together then get a fair share of the cores against the
        # load generator's, instead of one share each. run_memtier.py
        # --server-session shared turns this off to show the difference.
        self.own_session = True

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> Server:
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.dir,
            env=self.env,
            # Either way a process group of its own: a Ctrl-C on the terminal
            # reaches us, not it, and stop() can end what it forked.
            start_new_session=self.own_session,
            process_group=None if self.own_session else 0,
        )
        deadline = time.monotonic() + self.ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited at start-up:\n{self.log_tail()}")
            if listens(self.proc.pid, self.port):
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not listen on port {self.port}")
            time.sleep(0.05)

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                # Its own process group holds only it and what it forked
                # (Redis's rewrite child, say): end them all.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()
        self._tmp.cleanup()

    def state(self) -> str:
        """A line on whether the process still runs, with its log's tail if not."""
        if self.proc is None:
            return "not started"
        rc = self.proc.poll()
        if rc is None:
            return f"pid {self.pid} still running on port {self.port}; log:\n{self.log_tail(2000)}"
        return f"exited with {rc}; log:\n{self.log_tail()}"

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def checked_load(server: Server, spec: LoadSpec) -> LoadResult:
    """run_load(spec) against `server`, with the server's CPU time during it;
    any failure raises with the server's state."""
    cpu = server.cpu()
    try:
        res = run_load(spec)
    except OSError as exc:
        raise RuntimeError(f"{server.name}: {exc}; {server.state()}") from exc
    if res.errors:
        raise RuntimeError(f"{server.name}: {res.errors[0]}; {server.state()}")
    res.server_cpu = server.cpu() - cpu
    return res


def fill(server: Server, queue: str, count: int, size: int, **extra: Any) -> LoadResult:
    """Enqueue `count` messages of `size` bytes on `queue`, pipelined 64 deep."""
    spec = LoadSpec(
        host=HOST,
        port=server.port,
        workload="set",
        connections=8,
        depth=64,
        duration=None,
        ops=count,
        queue=queue,
        size=size,
        **extra,
    )
    return checked_load(server, spec)


def memcached(threads: int = 1) -> Server:
    """memcached on loopback; -U 0: no UDP listener (nothing may listen beyond TCP)."""
    argv = ["memcached", "-l", HOST, "-p", "{port}", "-t", str(threads), "-U", "0", "-m", "1024"]
    if os.geteuid() == 0:
        argv += ["-u", "nobody"]  # memcached refuses to run as root without -u
    return Server("memcached", argv)


def mqd(
    backend: str,
    *,
    exe: str | None = None,
    env: dict[str, str] | None = None,
    loop: str | None = None,
    config: str | None = None,
    name: str | None = None,
    base_dir: str | None = None,
) -> Server:
    """An mqd daemon with `backend`, its data directory a fresh temporary one.

    `config`, if given, is TOML text written to the temporary directory and
    passed with --config.
    """
    binary = find_mqd(exe)
    argv = [binary, "serve", "--backend", backend, "--listen", HOST, "--port", "{port}"]
    argv += ["--data-dir", "{dir}/data", "--log-level", "warning"]
    if loop:
        argv += ["--loop", loop]
    files: dict[str, str] = {}
    if config is not None:
        files["mqd.toml"] = config
        argv += ["--config", "{dir}/mqd.toml"]
    return Server(name or f"mqd-{backend}", argv, files=files, base_dir=base_dir, env=env)


def mqd_config(sync: str, interval_ms: int = 1000) -> str:
    """TOML for a daemon whose every queue has `sync`."""
    return f'[storage]\nsync_interval_ms = {interval_ms}\n\n[queues."*"]\nsync = "{sync}"\n'


def redis(fsync: str, base_dir: str | None = None) -> Server:
    """Redis with its append-only file on, fsync policy `fsync` (always, everysec, no)."""
    argv = ["redis-server", "--bind", HOST, "--port", "{port}", "--dir", "{dir}"]
    # No RDB snapshots: the append-only file is the durability under test.
    argv += ["--save", "", "--appendonly", "yes", "--appendfsync", fsync]
    return Server(f"redis-{fsync}", argv, base_dir=base_dir)


def text_command(port: int, request: bytes, end: bytes, timeout: float = 30.0) -> bytes:
    """Send one request on a fresh connection and read until the reply ends with `end`."""
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        s.sendall(request)
        buf = b""
        while not buf.endswith(end):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        return buf


def memcache_stats(port: int) -> dict[str, str]:
    """The `stats` lines of a memcached-protocol server, as a dict."""
    raw = text_command(port, b"stats\r\n", b"END\r\n")
    out = {}
    for line in raw.decode(errors="replace").splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0] == "STAT":
            out[parts[1]] = parts[2]
    return out


def median_run(results: list[LoadResult]) -> LoadResult:
    """The run of median throughput: one lucky or unlucky run does not make a ratio."""
    return sorted(results, key=lambda r: r.ops_per_s)[len(results) // 2]


def ratio_row(label: str, reference: LoadResult, measured: LoadResult) -> list[str]:
    """A table row: ops/s, p50 and p99 of the reference, then of the measured, then their ratio."""
    return [
        label,
        fmt_rate(reference.ops_per_s),
        fmt_ms(reference.p50),
        fmt_ms(reference.p99),
        fmt_rate(measured.ops_per_s),
        fmt_ms(measured.p50),
        fmt_ms(measured.p99),
        fmt_ratio(measured.ops_per_s, reference.ops_per_s),
    ]


def fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def fmt_ms(x: float) -> str:
    return f"{x:.3f}"


def fmt_ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A table on the terminal; plain text when output is not a terminal."""
    # The title goes on its own line: as a table title it would wrap to the
    # width of a narrow table.
    console.print()
    console.print(title, style="bold")
    table = Table()
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
