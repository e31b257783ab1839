"""Spark pipeline benchmark: bulk ingest and export through the "mqd" data source.

In one run, against one mqd (memory backend by default) on a free loopback port:

1. the reference: a plain single-process pymemcache loop enqueues N messages
   of 100 bytes (`set`, one at a time), then dequeues them all (`get`);
2. Spark on local[2]: ingest of the same N rows from a Parquet file (row
   groups of 100,000 rows, as Spark writes them, so that it can split the
   file) with `df.write.format("mqd")...save()`, then export of the queue to
   Parquet, first in peek mode (the queue stays), then in drain mode;
3. the daemon's own ceiling: the load generator's pipelined sets and gets
   (8 connections, 64 deep) for the same N messages.

Every leg is checked: the count, and a digest of the sorted bodies, must equal
the input's. Spark's start-up, and a warm-up of each leg on 20,000 rows (the
first job of a session pays for the JVM's compilation and the Python
workers' start), are timed apart from the measured jobs. Ratios are against
the pymemcache loop of the same run; both export legs against the loop's `get`.
The daemon's CPU time per row during each Spark leg shows what bounds it.

Usage: python benchmarks/run_spark.py [--count 1000000] [--size 100] [--backend memory]
       [--sync none] [--master local[2]]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from harness import (
    HOST,
    Server,
    checked_load,
    fill,
    fmt_rate,
    fmt_ratio,
    memcache_stats,
    mqd,
    print_table,
)
from loadgen import LoadSpec
from pymemcache.client.base import Client


def bodies(count: int, size: int) -> list[bytes]:
    """Distinct bodies of exactly `size` bytes."""
    pad = b"x" * size
    return [(b"%010d" % i + pad)[:size] for i in range(count)]


def digest(values: Iterable[bytes]) -> str:
    h = hashlib.sha256()
    for value in sorted(values):
        h.update(len(value).to_bytes(4, "big"))
        h.update(value)
    return h.hexdigest()[:16]


def check(what: str, got: list[bytes], count: int, expected: str) -> None:
    if len(got) != count or digest(got) != expected:
        raise SystemExit(f"{what}: {len(got):,} rows, digest {digest(got)}; want {count:,}")


def items(port: int, queue: str) -> int:
    return int(memcache_stats(port).get(f"queue_{queue}_items", 0))


def spark_legs(
    args: argparse.Namespace, server: Server, source: Path, out: Path, queue: str
) -> list[tuple[float, float]]:
    """Ingest, peek export and drain export through Spark, unchecked: for each, the
    seconds it took and the daemon's CPU seconds meanwhile."""
    import mqd_spark
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    assert spark is not None
    servers = f"{HOST}:{server.port}"
    legs = []
    start, cpu = time.perf_counter(), server.cpu()
    spark.read.parquet(str(source)).write.format("mqd").option("servers", servers).option(
        "queue", queue
    ).save()
    legs.append((time.perf_counter() - start, server.cpu() - cpu))
    for mode in ("peek", "drain"):
        start, cpu = time.perf_counter(), server.cpu()
        reader = spark.read.format("mqd").option("servers", servers).option("queue", queue)
        if args.partitions:
            reader = reader.option("partitions", str(args.partitions))
        reader.option("mode", mode).load().write.parquet(str(out / mode))
        mqd_spark.wait_for_commits(spark)
        legs.append((time.perf_counter() - start, server.cpu() - cpu))
    return legs


def write_source(path: Path, data: list[bytes]) -> None:
    pq.write_table(pa.table({"body": pa.array(data, pa.binary())}), path, row_group_size=100_000)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1_000_000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--backend", default="memory", help="mqd backend (default memory)")
    parser.add_argument("--sync", default="none", help="the queues' sync setting (bdb)")
    parser.add_argument("--partitions", type=int, help="read partitions per queue")
    args = parser.parse_args()
    count, size = args.count, args.size
    data = bodies(count, size)
    expected = digest(data)
    rows: list[list[str]] = []
    config = f'[queues."*"]\nsync = "{args.sync}"\n'
    server = mqd(args.backend, config=config)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-spark-") as tmp, server:
        port = server.port
        source = Path(tmp) / "in.parquet"
        write_source(source, data)

        # 1. the plain pymemcache loop
        client = Client((HOST, port))
        start = time.perf_counter()
        for body in data:
            client.set("ref", body, noreply=False)
        ref_in = count / (time.perf_counter() - start)
        start = time.perf_counter()
        out = []
        while (body := client.get("ref")) is not None:
            out.append(body)
        ref_out = count / (time.perf_counter() - start)
        client.close()
        check("pymemcache loop", out, count, expected)
        del out

        # 2. Spark: start-up and a warm-up on a few rows, then the measured legs
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        start = time.perf_counter()
        import mqd_spark
        from pyspark.sql import SparkSession

        spark = (
            SparkSession.builder.master(args.master)
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        mqd_spark.register(spark)
        warm = Path(tmp) / "warm.parquet"
        write_source(warm, data[:20_000])
        spark_legs(args, server, warm, Path(tmp) / "warm", "warmup")
        startup = time.perf_counter() - start

        target = Path(tmp) / "out"
        measured = spark_legs(args, server, source, target, "spark")
        spark.stop()
        for mode in ("peek", "drain"):
            got = pq.read_table(target / mode).column("body").to_pylist()
            check(f"spark export ({mode})", got, count, expected)
        if items(port, "spark") != 0:
            raise SystemExit(f"spark export left {items(port, 'spark'):,} messages")

        # 3. the daemon's ceiling, by the load generator
        ceiling_in = fill(server, "gen", count, size).ops_per_s
        spec = LoadSpec(
            host=HOST,
            port=port,
            workload="get",
            connections=8,
            depth=64,
            duration=None,
            ops=count,
            queue="gen",
            size=size,
        )
        ceiling_out = checked_load(server, spec).ops_per_s

    names = ("ingest (set)", "export (peek)", "export (drain)")
    for name, ref, (took, cpu), ceiling in zip(
        names,
        (ref_in, ref_out, ref_out),
        measured,
        (ceiling_in, ceiling_out, ceiling_out),
        strict=True,
    ):
        got = count / took
        rows.append(
            [
                name,
                fmt_rate(ref),
                fmt_rate(got),
                fmt_ratio(got, ref),
                f"{cpu / count * 1e6:.1f}",
                fmt_rate(ceiling),
            ]
        )
    print_table(
        f"{count:,} messages of {size} bytes, mqd {args.backend} (sync {args.sync}), "
        f"Spark {args.master} (start-up and warm-up {startup:.1f} s apart)",
        [
            "leg",
            "pymemcache loop rows/s",
            "Spark rows/s",
            "Spark/loop",
            "daemon CPU µs/row",
            "daemon ceiling ops/s",
        ],
        rows,
    )
    print(f"count and digest {expected} checked on every leg")
    load_after = os.getloadavg()
    print(f"load average (1 min) {load_before[0]:.1f} before, {load_after[0]:.1f} after, 2 cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
