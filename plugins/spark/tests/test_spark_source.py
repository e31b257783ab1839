"""The "mqd" data source on a real local Spark session against real daemons."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mqd_spark
import pytest
from pymemcache.client.base import Client
from pyspark import TaskContext, cloudpickle
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql.functions import col, concat_ws, spark_partition_id, udf
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.types import BinaryType
from spark_helpers import (
    FULL,
    FULL_ITEMS,
    Consumer,
    fill,
    items,
    open_count,
    servers,
    take_all,
)

from mqd.testing.daemon import Daemon

pytest_plugins = ("spark_helpers",)


def read(spark: SparkSession, daemon: Daemon | str, queue: str, **options: str) -> DataFrame:
    reader = spark.read.format("mqd").option(
        "servers", daemon if isinstance(daemon, str) else servers(daemon)
    )
    for key, value in {"queue": queue, **options}.items():
        reader = reader.option(key, value)
    return reader.load()


def bodies(n: int, prefix: str = "m") -> list[bytes]:
    return [f"{prefix}{i:05d}".encode() for i in range(n)]


def test_peek_twice_gives_the_same_rows(spark: SparkSession, mqd: Daemon, q: str) -> None:
    fill(mqd, q, bodies(50))
    first = read(spark, mqd, q, partitions="3").collect()
    second = read(spark, mqd, q, partitions="3").collect()
    assert first == second
    assert [r.body for r in sorted(first, key=lambda r: r.id)] == bodies(50)
    assert {r.queue for r in first} == {q} and len({r.id for r in first}) == 50
    assert items(mqd, q) == 50


def test_drain_removes_exactly_what_it_read(spark: SparkSession, mqd: Daemon, q: str) -> None:
    fill(mqd, q, bodies(40))
    rows = read(spark, mqd, q, mode="drain", limit="25", partitions="2").collect()
    mqd_spark.wait_for_commits(spark)
    assert sorted(r.body for r in rows) == bodies(40)[:25]
    assert take_all(mqd, q) == bodies(40)[25:]


@pytest.mark.parametrize("mode", ["peek", "drain"])
def test_a_read_with_nothing_waiting_gives_no_rows(
    spark: SparkSession, mqd: Daemon, q: str, mode: str
) -> None:
    # Spark reads one empty partition of its own where the plan has none.
    fill(mqd, q, [b"gone"])
    assert take_all(mqd, q) == [b"gone"]
    assert read(spark, mqd, q, mode=mode).collect() == []
    assert read(spark, mqd, q + "-never-made", mode=mode).collect() == []
    mqd_spark.wait_for_commits(spark)
    fill(mqd, q, [b"later"])
    assert read(spark, mqd, q, mode=mode).collect()[0].body == b"later"


def test_write_keeps_order_within_each_partition(spark: SparkSession, mqd: Daemon, q: str) -> None:
    df = spark.range(0, 400, 1, 4).select(
        concat_ws(":", spark_partition_id(), col("id")).alias("body")
    )
    # The call exactly as users write it: no .mode("append").
    df.write.format("mqd").option("servers", servers(mqd)).option("queue", q).save()
    got = [b.decode().split(":") for b in take_all(mqd, q)]
    assert len(got) == 400
    assert sorted(int(n) for _, n in got) == list(range(400))
    for part in {p for p, _ in got}:
        seq = [int(n) for p, n in got if p == part]
        assert seq == sorted(seq)


def test_write_flags_exptime_and_queue_columns(
    spark: SparkSession, memory_mqd: Daemon, q: str
) -> None:
    df = spark.createDataFrame(
        [(b"a", 7, 0, q + "x"), (b"b", 9, 0, q + "y")],
        "body binary, flags int, exptime int, queue string",
    )
    df.write.format("mqd").option("servers", servers(memory_mqd)).mode("append").save()
    rows = read(spark, memory_mqd, f"{q}x,{q}y").collect()
    assert sorted((r.queue, r.flags, r.body) for r in rows) == [
        (q + "x", 7, b"a"),
        (q + "y", 9, b"b"),
    ]


def test_add_makes_a_retried_write_idempotent(
    spark: SparkSession, memory_mqd: Daemon, q: str
) -> None:
    df = spark.createDataFrame([(f"r{i}",) for i in range(20)], "body string")
    for _ in range(2):
        df.write.format("mqd").option("servers", servers(memory_mqd)).option("queue", q).option(
            "command", "add"
        ).mode("append").save()
    assert sorted(take_all(memory_mqd, q)) == sorted(f"r{i}".encode() for i in range(20))


def _fails_once(body: bytes) -> bytes:
    """Raises in partition 1 on its first attempt only (the retry succeeds)."""
    context = TaskContext.get()
    if context is not None and context.partitionId() == 1 and context.attemptNumber() == 0:
        raise RuntimeError("injected task failure")
    return body


def _always_fails(body: bytes) -> bytes:
    context = TaskContext.get()
    if context is not None and context.partitionId() == 0:
        raise RuntimeError("injected job failure")
    return body


# Spark's workers cannot import this test module: ship the functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]
fails_once = udf(_fails_once, BinaryType(), useArrow=False)
always_fails = udf(_always_fails, BinaryType(), useArrow=False)


def test_drain_with_a_retried_task_loses_and_duplicates_nothing(
    spark: SparkSession, mqd: Daemon, q: str
) -> None:
    fill(mqd, q, bodies(60))
    df = read(spark, mqd, q, mode="drain", partitions="3")
    out = [r.body for r in df.select(fails_once("body").alias("body")).collect()]
    mqd_spark.wait_for_commits(spark)
    assert sorted(out) == bodies(60)
    assert items(mqd, q) == 0


def test_drain_of_a_failed_job_removes_nothing(spark: SparkSession, mqd: Daemon, q: str) -> None:
    fill(mqd, q, bodies(30))
    df = read(spark, mqd, q, mode="drain", partitions="3")
    with pytest.raises(Exception, match="injected job failure"):
        df.select(always_fails("body")).collect()
    mqd_spark.wait_for_commits(spark)
    assert items(mqd, q) == 30
    rerun = read(spark, mqd, q, mode="drain", partitions="3").collect()
    mqd_spark.wait_for_commits(spark)
    assert sorted(r.body for r in rerun) == bodies(30)
    assert items(mqd, q) == 0


@pytest.mark.parametrize(
    "keep_some",
    [lambda df: df.limit(3).collect(), lambda df: df.tail(3)],
    ids=["limit", "tail"],
)
def test_drain_that_keeps_only_some_rows_removes_nothing(
    spark: SparkSession, memory_mqd: Daemon, q: str, keep_some: Callable[[DataFrame], list[Row]]
) -> None:
    fill(memory_mqd, q, bodies(10))
    assert len(keep_some(read(spark, memory_mqd, q, mode="drain"))) == 3
    mqd_spark.wait_for_commits(spark)
    assert items(memory_mqd, q) == 10
    assert open_count(memory_mqd, q) == 0


def test_a_cached_drain_is_settled_by_the_action_that_fills_the_cache(
    spark: SparkSession, memory_mqd: Daemon, q: str
) -> None:
    fill(memory_mqd, q, bodies(30))
    df = read(spark, memory_mqd, q, mode="drain", partitions="2").cache()
    try:
        assert df.count() == 30
        mqd_spark.wait_for_commits(spark)
        assert items(memory_mqd, q) == 0
        assert sorted(r.body for r in df.collect()) == bodies(30)  # from the cache
    finally:
        df.unpersist()


def test_rows_read_through_the_rdd_leave_once_acknowledged(
    spark: SparkSession, memory_mqd: Daemon, q: str
) -> None:
    fill(memory_mqd, q, bodies(20))
    df = read(spark, memory_mqd, q, mode="drain", partitions="2")
    assert sorted(r.body for r in df.rdd.collect()) == bodies(20)
    mqd_spark.wait_for_commits(spark)
    # No SQL query ran, so no listener heard of it: the rows are still leased.
    assert (items(memory_mqd, q), open_count(memory_mqd, q)) == (20, 20)
    assert mqd_spark.acknowledge(df) == 2
    assert items(memory_mqd, q) == 0


def test_a_write_that_a_full_queue_refuses_fails_and_its_drain_gives_back(
    spark: SparkSession, memory_mqd: Daemon, q: str
) -> None:
    full = FULL + q
    fill(memory_mqd, q, bodies(FULL_ITEMS * 2))
    df = read(spark, memory_mqd, q, mode="drain").select("body").coalesce(1)
    with pytest.raises(Exception, match="rows were not stored \\(NOT_STORED\\)"):
        df.write.format("mqd").option("servers", servers(memory_mqd)).option("queue", full).save()
    mqd_spark.wait_for_commits(spark)
    assert take_all(memory_mqd, q) == bodies(FULL_ITEMS * 2)  # none lost
    assert take_all(memory_mqd, full) == bodies(FULL_ITEMS)


def test_a_peek_beside_open_messages_reads_the_same_rows_every_time(
    spark: SparkSession, memory_mqd: Daemon, q: str, tmp_path: Path
) -> None:
    fill(memory_mqd, q, bodies(10))
    holders = [Client(memory_mqd.address) for _ in range(3)]
    try:
        assert [c.get(q + "/open") for c in holders] == bodies(3)
        df = read(spark, memory_mqd, q)
        first = sorted(r.body for r in df.collect())
        fill(memory_mqd, q, bodies(3, "late"))
        assert sorted(r.body for r in df.collect()) == first == bodies(10)[3:]
        # A peek stream started now reads the late ones in a later batch, none skipped.
        fill(memory_mqd, q, bodies(2, "later"))
        query = start_stream(spark, memory_mqd, q, tmp_path, mode="peek")
        query.processAllAvailable()
        fill(memory_mqd, q, bodies(2, "last"))
        query.processAllAvailable()
        query.stop()
        expected = bodies(10)[3:] + bodies(3, "late") + bodies(2, "later") + bodies(2, "last")
        assert sorted(streamed(spark, tmp_path)) == sorted(expected)
    finally:
        for client in holders:
            client.close()


def test_an_available_now_stream_removes_its_last_batch(
    spark: SparkSession, memory_mqd: Daemon, q: str, tmp_path: Path
) -> None:
    fill(memory_mqd, q, bodies(100))
    query = start_stream(spark, memory_mqd, q, tmp_path, available_now=True, max_messages="30")
    assert query.awaitTermination(120)
    assert query.exception() is None
    assert sorted(streamed(spark, tmp_path)) == bodies(100)
    assert (items(memory_mqd, q), open_count(memory_mqd, q)) == (0, 0)


def test_a_glob_passes_over_a_queue_name_that_is_not_utf8(
    spark: SparkSession, memory_mqd: Daemon, q: str
) -> None:
    with socket.create_connection(memory_mqd.address) as sock:
        sock.sendall(b"set " + q.encode() + b"\xff 0 0 2\r\nno\r\n")
        assert sock.recv(100) == b"STORED\r\n"
    fill(memory_mqd, q + "a", [b"yes"])
    assert [r.body for r in read(spark, memory_mqd, q + "*").collect()] == [b"yes"]
    assert [r.body for r in read(spark, memory_mqd, q + "*", mode="drain").collect()] == [b"yes"]
    mqd_spark.wait_for_commits(spark)
    assert items(memory_mqd, q + "a") == 0


def test_several_queues_by_glob_on_several_servers(
    spark: SparkSession, mqd: Daemon, memory_mqd: Daemon, q: str
) -> None:
    fill(mqd, q + ".a", [b"1", b"2"])
    fill(memory_mqd, q + ".b", [b"3"])
    fill(memory_mqd, q + "_other", [b"no"])
    rows = read(spark, servers(mqd, memory_mqd), q + ".*").collect()
    assert sorted((r.queue, r.body) for r in rows) == [
        (q + ".a", b"1"),
        (q + ".a", b"2"),
        (q + ".b", b"3"),
    ]


def start_stream(
    spark: SparkSession,
    daemon: Daemon,
    queue: str,
    tmp_path: Path,
    *,
    available_now: bool = False,
    **options: str,
) -> StreamingQuery:
    """A stream of `queue` (a drain unless `options` say) into Parquet under
    tmp_path/out, checkpointed; batch after batch, or what is there (`available_now`)."""
    reader = spark.readStream.format("mqd").option("servers", servers(daemon))
    for key, value in {"queue": queue, **options}.items():
        reader = reader.option(key, value)
    writer = (
        reader.load()
        .writeStream.format("parquet")
        .option("path", str(tmp_path / "out"))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
    )
    if available_now:
        return writer.trigger(availableNow=True).start()
    return writer.trigger(processingTime="0 seconds").start()


def streamed(spark: SparkSession, tmp_path: Path) -> list[bytes]:
    """The bodies a stream of start_stream wrote so far."""
    return [r.body for r in spark.read.parquet(str(tmp_path / "out")).collect()]


def stop_after_batches(query: StreamingQuery, batches: int) -> None:
    """Stops `query` mid-stream, once `batches` batches with rows are done."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert query.exception() is None
        if sum(1 for p in query.recentProgress if p["numInputRows"] > 0) >= batches:
            break
        time.sleep(0.1)
    query.stop()


def test_stream_restarted_from_its_checkpoint_is_exactly_once(
    spark: SparkSession, mqd: Daemon, q: str, tmp_path: Path
) -> None:
    fill(mqd, q, bodies(120))
    stop_after_batches(start_stream(spark, mqd, q, tmp_path, max_messages="20"), 2)
    assert len(streamed(spark, tmp_path)) < 120
    fill(mqd, q, bodies(30, "late"))
    query = start_stream(spark, mqd, q, tmp_path, max_messages="20")
    query.processAllAvailable()
    query.stop()
    assert sorted(streamed(spark, tmp_path)) == sorted(bodies(120) + bodies(30, "late"))
    # Spark commits a batch when it plans the next: only the last batch may remain.
    assert items(mqd, q) <= 20


def test_drain_beside_another_consumer_is_exactly_once(
    spark: SparkSession, mqd: Daemon, q: str
) -> None:
    fill(mqd, q, bodies(3000))
    # Slow enough to leave Spark some even when it is slow to plan (10 s alone).
    consumer = Consumer(mqd, q, rate=300)
    consumer.start()
    df = read(spark, mqd, q, mode="drain", partitions="3")
    # a task fails once and is retried while the consumer keeps taking
    drained = [r.body for r in df.select(fails_once("body").alias("body")).collect()]
    mqd_spark.wait_for_commits(spark)
    taken = consumer.finish()
    assert drained and taken  # both got some: they really ran side by side
    assert sorted(drained + taken) == bodies(3000)
    assert items(mqd, q) == 0


def test_stream_beside_another_consumer_is_exactly_once(
    spark: SparkSession, mqd: Daemon, q: str, tmp_path: Path
) -> None:
    fill(mqd, q, bodies(2000))
    # Slow enough to leave the stream some even when it is slow to start (20 s alone).
    consumer = Consumer(mqd, q, rate=100)
    consumer.start()
    stop_after_batches(start_stream(spark, mqd, q, tmp_path, max_messages="200"), 2)
    query = start_stream(
        spark, mqd, q, tmp_path, max_messages="200"
    )  # restarted from its checkpoint
    query.processAllAvailable()
    query.stop()
    taken = consumer.finish()
    got = streamed(spark, tmp_path)
    assert got and taken
    assert sorted(got + taken) == bodies(2000)


def test_stream_sink_moves_rows_between_queues(
    spark: SparkSession, memory_mqd: Daemon, q: str, tmp_path: Path
) -> None:
    fill(memory_mqd, q, bodies(50))
    stream = (
        spark.readStream.format("mqd")
        .option("servers", servers(memory_mqd))
        .option("queue", q)
        .load()
    )
    query = (
        stream.select("body")
        .writeStream.format("mqd")
        .option("servers", servers(memory_mqd))
        .option("queue", q + "_out")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    query.processAllAvailable()
    query.stop()
    assert sorted(take_all(memory_mqd, q + "_out")) == bodies(50)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"queue": "x", "mode": "empty"}, "mqd option mode='empty': must be one of peek, drain"),
        ({"queue": "my queue"}, "mqd option queue: bad queue name 'my queue'"),
        ({}, "mqd option queue is missing"),
        ({"queue": "x", "servers": "nohost"}, "mqd option servers: bad address 'nohost'"),
        ({"queue": "x", "limit": "-3"}, "mqd option limit='-3': must be a whole number >= 1"),
        (
            {"queue": "x", "lease_timeout": "0"},
            "mqd option lease_timeout='0': must be a whole number from 1 to 604800",
        ),
    ],
)
def test_bad_option_fails_at_load_naming_it(
    spark: SparkSession, options: dict[str, str], message: str
) -> None:
    reader = spark.read.format("mqd")
    for key, value in options.items():
        reader = reader.option(key, value)
    with pytest.raises(Exception, match=message.replace("(", r"\(")) as caught:
        reader.load()
    assert "at org.apache" not in str(caught.value)


def test_write_without_a_body_column_fails_at_save(
    spark: SparkSession, memory_mqd: Daemon, q: str
) -> None:
    df = spark.createDataFrame([(1,)], "n int")
    with pytest.raises(Exception, match="needs a `body` column of string or binary"):
        df.write.format("mqd").option("servers", servers(memory_mqd)).option("queue", q).mode(
            "append"
        ).save()
    assert items(memory_mqd, q) == 0
