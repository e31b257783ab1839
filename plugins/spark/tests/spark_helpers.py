"""Shared by the Spark tests (each names it in `pytest_plugins`): one Spark session for
all of them, as start-up is slow; real daemons per backend; seeding and checking queues
with a plain memcached client."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from pymemcache.client.base import Client

pytest.importorskip("pyspark", reason="needs PySpark: pip install -e plugins/spark")

import mqd_spark
from pyspark.sql import SparkSession

from mqd.testing.daemon import Daemon

# Two task threads; a failed task is tried once more (local[N,F]), as on a
# cluster, so that a task failure can be injected and retried in one job.
MASTER = "local[2,2]"


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    session = (
        SparkSession.builder.master(MASTER)
        .appName("mqd-spark tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    mqd_spark.register(session)
    yield session
    session.stop()


@pytest.fixture(scope="session", params=["memory", "bdb"])
def mqd(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    backend = request.param
    with Daemon(tmp_path_factory.mktemp(f"mqd-{backend}"), backend=backend) as daemon:
        yield daemon


# On memory_mqd, queues named FULL... hold at most FULL_ITEMS messages and refuse more.
FULL = "full"
FULL_ITEMS = 5


@pytest.fixture(scope="session")
def memory_mqd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    config = f'[queues."{FULL}*"]\nmax_items = {FULL_ITEMS}\noverflow = "reject"\n'
    with Daemon(tmp_path_factory.mktemp("mqd-extra"), config_text=config) as daemon:
        yield daemon


@pytest.fixture
def q() -> str:
    return "s" + uuid.uuid4().hex[:12]


def servers(*daemons: Daemon) -> str:
    return ",".join(f"127.0.0.1:{d.port}" for d in daemons)


def fill(daemon: Daemon, queue: str, bodies: list[bytes]) -> None:
    client = Client(daemon.address)
    for body in bodies:
        assert client.set(queue, body, noreply=False)
    client.close()


def items(daemon: Daemon, queue: str, field: str = "items") -> int:
    client = Client(daemon.address)
    stats = client.stats("queues")
    client.close()
    return int(stats.get(f"queue_{queue}_{field}".encode(), 0))


def open_count(daemon: Daemon, queue: str) -> int:
    """Messages of `queue` open or leased."""
    return items(daemon, queue, "open")


def take_all(daemon: Daemon, queue: str) -> list[bytes]:
    client = Client(daemon.address)
    out = []
    while (body := client.get(queue)) is not None:
        out.append(body)
    client.close()
    return out


class Consumer(threading.Thread):
    """A plain pymemcache consumer beside Spark: takes from `queue` one message at a time,
    about `rate` a second, until told to stop and the queue is empty (or 120 s passed)."""

    def __init__(self, daemon: Daemon, queue: str, rate: float = 1000) -> None:
        super().__init__(daemon=True)
        self.address, self.queue, self.pause = daemon.address, queue, 1 / rate
        self.got: list[bytes] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        client = Client(self.address)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            body = client.get(self.queue)
            if body is None:
                if self.stopping.is_set():
                    break
                time.sleep(0.01)
                continue
            self.got.append(body)
            time.sleep(self.pause)
        client.close()

    def finish(self) -> list[bytes]:
        """What it took, once the queue is empty."""
        self.stopping.set()
        self.join(130)
        assert not self.is_alive()
        return self.got
