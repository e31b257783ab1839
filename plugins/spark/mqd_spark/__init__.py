"""mqd's Spark pipeline: the "mqd" PySpark data source and the `mqd pipeline` commands.

    import mqd_spark
    mqd_spark.register(spark)
    df = spark.read.format("mqd").option("queue", "jobs").load()

Importing this package does not import PySpark; register() does.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# Spark's Python workers run `python3` from PATH unless told otherwise; the data
# source needs an interpreter that has mqd_spark and pyarrow, as this one does.
# Set before a session starts (Spark reads it then); an explicit setting wins.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

__all__ = ["register", "wait_for_commits"]


def register(spark: SparkSession) -> None:
    """Makes format "mqd" available to `spark` (reads, writes, streams)."""
    from mqd_spark import drain
    from mqd_spark.source import MqdDataSource

    spark.dataSource.register(MqdDataSource)
    drain.install(spark)


def wait_for_commits(spark: SparkSession, timeout_s: float = 60.0) -> None:
    """Waits until the rows of every drain query that finished are removed."""
    from mqd_spark import drain

    drain.wait_for_commits(spark, timeout_s)
