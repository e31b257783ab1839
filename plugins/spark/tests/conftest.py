"""One Spark session for every Spark test (start-up is slow), and real daemons per backend."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator

import pytest

pytest.importorskip("pyspark", reason="needs PySpark: pip install -e plugins/spark")

from pyspark.sql import SparkSession

import mqd_spark
from mqd.testing.daemon import Daemon

# Two task threads; a failed task is tried once more (local[N,F]), as on a
# cluster, so that a task failure can be injected and retried in one job.
MASTER = "local[2,2]"


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
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
def mqd(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    backend = request.param
    with Daemon(tmp_path_factory.mktemp(f"mqd-{backend}"), backend=backend) as daemon:
        yield daemon


@pytest.fixture(scope="session")
def memory_mqd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with Daemon(tmp_path_factory.mktemp("mqd-extra")) as daemon:
        yield daemon


@pytest.fixture
def q() -> str:
    return "s" + uuid.uuid4().hex[:12]
