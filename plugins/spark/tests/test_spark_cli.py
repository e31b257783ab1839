"""`mqd pipeline ingest|export` in process (on the shared session) and as commands."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mqd_spark
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from pyspark.sql import SparkSession
from spark_helpers import fill, items, open_count, servers

from mqd import cli
from mqd.testing.daemon import Daemon
from mqd.testing.ports import free_port

pytest_plugins = ("spark_helpers",)


def mqd_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "mqd", *args]


def test_parquet_round_trip_gives_back_the_same_rows(
    spark: SparkSession, mqd: Daemon, q: str, tmp_path: Path
) -> None:
    rows = [f"row {i} é" for i in range(300)]
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"n": list(range(300)), "body": rows}), source)
    runner = CliRunner()
    result = runner.invoke(
        cli.main, ["pipeline", "ingest", str(source), "--queue", q, "--servers", servers(mqd)]
    )
    assert result.exit_code == 0, result.output
    assert "ingested 300 rows" in result.output
    assert items(mqd, q) == 300
    out = tmp_path / "out"
    args = ["--queue", q, "--to", str(out), "--format", "parquet", "--drain"]
    result = runner.invoke(cli.main, ["pipeline", "export", *args, "--servers", servers(mqd)])
    assert result.exit_code == 0, result.output
    assert "drained 300 rows" in result.output
    table = pq.read_table(out).sort_by("id")
    assert table.column("body").to_pylist() == rows
    assert set(table.column("queue").to_pylist()) == {q}
    assert items(mqd, q) == 0


def test_jsonl_export_peeks_by_default(
    spark: SparkSession, memory_mqd: Daemon, q: str, tmp_path: Path
) -> None:
    fill(memory_mqd, q, [b"a", b"b"])
    out = tmp_path / "out"
    args = ["--queue", q, "--to", str(out), "--format", "jsonl", "--servers", servers(memory_mqd)]
    result = CliRunner().invoke(cli.main, ["pipeline", "export", *args])
    assert result.exit_code == 0, result.output
    assert "exported 2 rows" in result.output
    lines = sorted(spark.read.json(str(out)).select("body").collect())
    assert [r.body for r in lines] == ["a", "b"]
    assert items(memory_mqd, q) == 2


def test_a_jsonl_drain_of_a_body_that_is_not_text_fails_and_removes_nothing(
    spark: SparkSession, memory_mqd: Daemon, q: str, tmp_path: Path
) -> None:
    fill(memory_mqd, q, [b"plain", b"\xff\xfe\x80"])
    args = ["--queue", q, "--to", str(tmp_path / "out"), "--format", "jsonl", "--drain"]
    result = CliRunner().invoke(
        cli.main, ["pipeline", "export", *args, "--servers", servers(memory_mqd)]
    )
    assert result.exit_code == 1
    assert "a message body is not UTF-8 text: export with --body-type binary" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    mqd_spark.wait_for_commits(spark)
    assert items(memory_mqd, q) == 2 and open_count(memory_mqd, q) == 0


def test_ingest_text_lines(spark: SparkSession, memory_mqd: Daemon, q: str, tmp_path: Path) -> None:
    source = tmp_path / "lines.txt"
    source.write_text("one\ntwo\nthree\n")
    args = ["pipeline", "ingest", str(source), "-q", q, "--servers", servers(memory_mqd)]
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 0, result.output
    assert items(memory_mqd, q) == 3


def test_ingest_without_a_body_column_names_the_columns(
    spark: SparkSession, memory_mqd: Daemon, q: str, tmp_path: Path
) -> None:
    source = tmp_path / "in.csv"
    source.write_text("a,b\n1,2\n")
    args = ["pipeline", "ingest", str(source), "-q", q, "--servers", servers(memory_mqd)]
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 1
    assert "no usable body column among a, b" in result.output
    assert items(memory_mqd, q) == 0


def test_unreachable_daemon_fails_before_spark_starts(tmp_path: Path) -> None:
    port = free_port()
    args = ["pipeline", "export", "-q", "x", "--to", str(tmp_path / "o"), "--servers"]
    result = CliRunner().invoke(cli.main, [*args, f"127.0.0.1:{port}"])
    assert result.exit_code == 1
    assert f"cannot reach mqd at 127.0.0.1:{port}" in result.output
    assert "Traceback" not in result.output


def test_missing_java_is_named(memory_mqd: Daemon, tmp_path: Path) -> None:
    source = tmp_path / "lines.txt"
    source.write_text("x\n")
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(Path(sys.executable).parent)  # no java on it
    args = ["pipeline", "ingest", str(source), "-q", "x", "--servers", servers(memory_mqd)]
    done = subprocess.run(mqd_command(*args), env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "Java not found" in done.stderr and "default-jre-headless" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_daemon_command_line_does_not_import_pyspark() -> None:
    code = (
        "import sys; from click.testing import CliRunner; from mqd import cli; "
        "r = CliRunner().invoke(cli.main, ['--help']); assert 'pipeline' in r.output, r.output; "
        "print('pyspark' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


def test_pipeline_without_mqd_spark_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli.PluginGroup, "_plugins", lambda self: {})
    result = CliRunner().invoke(cli.main, ["pipeline", "ingest", "x"])
    assert result.exit_code == 2
    assert "`mqd pipeline` needs mqd-spark: pip install -e plugins/spark" in result.output
