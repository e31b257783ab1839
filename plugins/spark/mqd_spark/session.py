"""A Spark session for the pipeline commands, with clear errors for what is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

JAVA_HINT = (
    "install a Java 17+ runtime (Debian: apt-get install default-jre-headless; "
    "bin/setup does it) or set JAVA_HOME"
)


class SetupError(Exception):
    """Something the pipeline needs is missing; the message says what to do."""


def check_java() -> str:
    """The java executable Spark will start; SetupError when there is none that runs."""
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    if not java or not os.access(java, os.X_OK):
        raise SetupError(f"Java not found: {JAVA_HINT}")
    try:
        subprocess.run([java, "-version"], capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as error:
        raise SetupError(f"Java at {java} does not run ({error}): {JAVA_HINT}") from None
    return java


def start(master: str = "local[*]", app_name: str = "mqd pipeline") -> SparkSession:
    """A session on `master` with format "mqd" registered (an existing session is reused)."""
    check_java()
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise SetupError("PySpark is missing: pip install -e plugins/spark") from None
    import mqd_spark

    builder: SparkSession.Builder = SparkSession.builder
    spark = (
        builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.pyspark.python", os.environ["PYSPARK_PYTHON"])
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    mqd_spark.register(spark)
    return spark
