"""A real Aerospike node for tests and benchmarks: one started here, or one named by the user.

`MQD_AEROSPIKE_HOSTS=host:port` names a running server to use. Otherwise a
build of the server with `start`/`stop` scripts (as in `../shared/aerospike`
beside the repository, or `MQD_AEROSPIKE_DIR`) starts a fresh in-memory node
on free loopback ports, stopped again when done.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
CANDIDATES = (REPO.parent / "shared" / "aerospike",)


def server_dir() -> Path | None:
    """Where a startable server build is, if anywhere."""
    named = os.environ.get("MQD_AEROSPIKE_DIR")
    for path in (Path(named),) if named else CANDIDATES:
        if (path / "start").is_file() and (path / "stop").is_file():
            return path
    return None


def unavailable() -> str:
    """Why no server can be had ("" when one can)."""
    if os.environ.get("MQD_AEROSPIKE_HOSTS") or server_dir() is not None:
        return ""
    return (
        "no Aerospike server: set MQD_AEROSPIKE_HOSTS=host:port, or MQD_AEROSPIKE_DIR "
        "to a server build with start/stop scripts"
    )


@dataclass(frozen=True)
class Node:
    """A server to use: its "host:port", and its process when it was started here."""

    host: str
    workdir: Path | None = None

    @property
    def pid(self) -> int | None:
        """The server's process id, for freezing it; None for a server named by the user."""
        if self.workdir is None:
            return None
        return int((self.workdir / "asd.pid").read_text().split()[0])

    def storage_table(self, set_prefix: str) -> str:
        """A daemon's `[storage.aerospike]` table for this node and sets of `set_prefix`."""
        return f'\n[storage.aerospike]\nhosts = ["{self.host}"]\nset_prefix = "{set_prefix}"\n'


@contextmanager
def node(data_size: str = "", record_size: str = "") -> Iterator[Node]:
    """A server for the duration; a node started here is stopped after."""
    named = os.environ.get("MQD_AEROSPIKE_HOSTS")
    if named:
        yield Node(named.split(",")[0])
        return
    where = server_dir()
    if where is None:
        raise RuntimeError(unavailable())
    env = dict(os.environ)
    if data_size:
        env["AS_DATA_SIZE"] = data_size
    if record_size:
        env["AS_MAX_RECORD_SIZE"] = record_size
    started = subprocess.run(
        [str(where / "start")], capture_output=True, text=True, env=env, timeout=120
    )
    workdir = ""
    for part in started.stderr.split():
        if part.startswith("workdir="):
            workdir = part.removeprefix("workdir=")
    try:
        if started.returncode != 0 or not started.stdout.strip():
            raise RuntimeError(f"aerospike did not start: {started.stderr.strip()[-500:]}")
        yield Node(started.stdout.strip().splitlines()[-1], Path(workdir))
    finally:
        if workdir:
            subprocess.run([str(where / "stop"), workdir], capture_output=True, timeout=120)


#: Server counters that each count one client call: single-record reads,
#: writes and deletes (whatever their outcome) and queries, per namespace.
_CALL_COUNTERS = ("client_read_", "client_write_", "client_delete_", "pi_query_", "si_query_")
_OUTCOMES = ("success", "error", "not_found", "filtered_out", "timeout", "complete", "abort")


def calls_served(host: str, namespace: str = "test") -> int:
    """Client calls the node has answered so far (a batch counts once), by its own books.

    Benchmarks take the difference over a run: a count the machine's noise
    does not change, and one the daemon under test does not report itself.
    """
    import aerospike

    name, port = host.rsplit(":", 1)
    client = aerospike.client({"hosts": [(name, int(port))]}).connect()
    try:
        counters = _info_pairs(client.info_random_node(f"namespace/{namespace}"))
        general = _info_pairs(client.info_random_node("statistics"))
    finally:
        client.close()
    total = general.get("batch_index_initiate", 0)
    for key, value in counters.items():
        if key.startswith(_CALL_COUNTERS) and key.endswith(_OUTCOMES):
            total += value
    return total


def _info_pairs(answer: str) -> dict[str, int]:
    body = answer.split("\t", 1)[-1]
    out = {}
    for item in body.strip().split(";"):
        key, _, value = item.partition("=")
        if value.isdigit():
            out[key] = int(value)
    return out
