"""`mqd pipeline export --master spark://...` on a real standalone cluster on loopback.

The master and the worker come from the pyspark package itself (bin/spark-class),
bound to 127.0.0.1, web UIs on port 0; both are stopped with their children.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pyspark
import pytest
from spark_helpers import fill, items, servers

from mqd.testing.daemon import Daemon
from mqd.testing.ports import free_port

SPARK_HOME = Path(pyspark.__file__).parent
START_TIMEOUT = 90.0

pytest_plugins = ("spark_helpers",)


def spark_class(name: str, *args: str, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_NO_DAEMONIZE": "1",
        "PYSPARK_PYTHON": sys.executable,
    }
    with open(log, "ab") as out:
        return subprocess.Popen(
            [str(SPARK_HOME / "bin" / "spark-class"), name, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: stopped with its children
        )


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def wait_for(condition: str, check: object, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if callable(check) and check():
            return
        time.sleep(0.3)
    raise RuntimeError(f"{condition} not within {START_TIMEOUT}s:\n{log.read_text()[-3000:]}")


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("spark-cluster")
    port = free_port()
    url = f"spark://127.0.0.1:{port}"
    master_log, worker_log = work / "master.log", work / "worker.log"
    master = spark_class(
        "org.apache.spark.deploy.master.Master",
        *("--host", "127.0.0.1", "--port", str(port), "--webui-port", "0"),
        log=master_log,
    )
    worker = None
    try:
        wait_for("master", lambda: listening(port), master_log)
        worker = spark_class(
            "org.apache.spark.deploy.worker.Worker",
            *("--host", "127.0.0.1", "--webui-port", "0", "--cores", "2", "--memory", "2g"),
            *("--work-dir", str(work / "work"), url),
            log=worker_log,
        )
        wait_for("worker", lambda: "Successfully registered" in worker_log.read_text(), worker_log)
        yield url
    finally:
        if worker is not None:
            stop(worker)
        stop(master)


@pytest.mark.timeout(300)
def test_export_on_a_standalone_cluster(
    cluster: str, memory_mqd: Daemon, q: str, tmp_path: Path
) -> None:
    bodies = [f"c{i}".encode() for i in range(100)]
    fill(memory_mqd, q, bodies)
    out = tmp_path / "out"
    args = ["pipeline", "export", "-q", q, "--to", str(out), "--drain", "--master", cluster]
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}
    done = subprocess.run(
        [sys.executable, "-m", "mqd", *args, "--servers", servers(memory_mqd)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "drained 100 rows" in done.stdout
    assert sorted(pq.read_table(out).column("body").to_pylist()) == sorted(bodies)
    assert items(memory_mqd, q) == 0
