"""mqd's Spark pipeline: the "mqd" PySpark data source and the `mqd pipeline` commands.

    import mqd_spark
    mqd_spark.register(spark)
    df = spark.read.format("mqd").option("queue", "jobs").load()

Importing this package does not import PySpark; register() does.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

# Spark's Python workers run `python3` from PATH unless told otherwise; the data
# source needs an interpreter that has mqd_spark and pyarrow, as this one does.
# Set before a session starts (Spark reads it then); an explicit setting wins.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

__all__ = ["acknowledge", "register", "wait_for_commits"]


def register(spark: SparkSession) -> None:
    """Makes format "mqd" available to `spark` (reads, writes, streams)."""
    from mqd_spark import drain
    from mqd_spark.source import MqdDataSource

    spark.dataSource.register(MqdDataSource)
    drain.install(spark)
    _append_by_default()


def _append_by_default() -> None:
    """Makes `df.write.format("mqd").save()` append, as a write to a queue only can.

    Spark refuses its default save mode (ErrorIfExists) for any Python data source
    that is not a catalog table, and no option of the data source API changes that
    default; so DataFrameWriter.save is wrapped, once per process: for format
    "mqd" with the mode left at that default, it asks for append. Other formats
    and explicit modes ("overwrite", "ignore") go through untouched.
    """
    from pyspark.sql.readwriter import DataFrameWriter

    save = DataFrameWriter.save
    if getattr(save, "_mqd_appends", False):
        return

    @functools.wraps(save)
    def appending_save(
        self: DataFrameWriter, path: str | None = None, format: str | None = None, **kw: Any
    ) -> None:
        source = format or self._jwrite.source()
        if (
            kw.get("mode") is None
            and str(source).lower() == "mqd"
            and self._jwrite.curmode().toString() == "ErrorIfExists"
        ):
            kw["mode"] = "append"
        save(self, path, format, **kw)

    appending_save._mqd_appends = True  # type: ignore[attr-defined]
    DataFrameWriter.save = appending_save  # type: ignore[method-assign,assignment]


def wait_for_commits(spark: SparkSession, timeout_s: float = 60.0) -> None:
    """Waits until the rows of every drain query that finished are removed."""
    from mqd_spark import drain

    drain.wait_for_commits(spark, timeout_s)


def acknowledge(df: DataFrame) -> int:
    """Removes the rows a drain read through `df.rdd`, `foreachPartition` or `toLocalIterator`.

    Those actions run no SQL query, so the listener that removes a drain's
    rows never hears of them. Returns how many leases held messages.
    """
    from mqd_spark import drain

    return drain.acknowledge(df)
