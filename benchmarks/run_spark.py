"""Spark pipeline benchmark: bulk ingest and export through the "mqd" data source.

In one run, against one mqd (memory backend by default) on a free loopback port:

1. the reference: a plain single-process pymemcache loop enqueues N messages
   of 100 bytes (`set`, one at a time), then dequeues them all (`get`);
2. Spark on local[2]: ingest of the same N rows from a Parquet file
   (`df.write.format("mqd")`), then export of the queue to Parquet in drain
   mode (`spark.read.format("mqd").option("mode", "drain")`);
3. the daemon's own ceiling: the load generator's pipelined sets and gets
   (8 connections, 64 deep) for the same N messages.

Every leg is checked: the count, and a digest of the sorted bodies, must equal
the input's. Spark's start-up is timed apart from the jobs. Ratios are against
the pymemcache loop of the same run.

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
from harness import HOST, checked_load, fill, fmt_rate, fmt_ratio, memcache_stats, mqd, print_table
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1_000_000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument(
        "--backend",
        default="memory",
        help="mqd backend (default memory)",
    )
    parser.add_argument("--sync", default="none", help="the queues' sync setting (bdb)")
    args = parser.parse_args()
    count, size = args.count, args.size
    data = bodies(count, size)
    expected = digest(data)
    rows: list[list[str]] = []
    config = f'[queues."*"]\nsync = "{args.sync}"\n'
    server = mqd(args.backend, config=config)
    with tempfile.TemporaryDirectory(prefix="bench-spark-") as tmp, server:
        port = server.port
        source = Path(tmp) / "in.parquet"
        pq.write_table(pa.table({"body": pa.array(data, pa.binary())}), source)

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

        # 2. Spark
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        start = time.perf_counter()
        import mqd_spark
        from pyspark.sql import SparkSession

        spark = (
            SparkSession.builder.master(args.master)
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            # several read tasks for one file, so both cores work
            .config("spark.sql.files.maxPartitionBytes", str(16 << 20))
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        mqd_spark.register(spark)
        startup = time.perf_counter() - start
        servers = f"{HOST}:{port}"

        start = time.perf_counter()
        spark.read.parquet(str(source)).write.format("mqd").option("servers", servers).option(
            "queue", "spark"
        ).mode("append").save()
        spark_in = count / (time.perf_counter() - start)
        if items(port, "spark") != count:
            raise SystemExit(f"spark ingest: {items(port, 'spark'):,} messages, want {count:,}")

        target = Path(tmp) / "out"
        start = time.perf_counter()
        reader = spark.read.format("mqd").option("servers", servers).option("queue", "spark")
        reader.option("mode", "drain").load().write.parquet(str(target))
        mqd_spark.wait_for_commits(spark)
        spark_out = count / (time.perf_counter() - start)
        check("spark export", pq.read_table(target).column("body").to_pylist(), count, expected)
        if items(port, "spark") != 0:
            raise SystemExit(f"spark export left {items(port, 'spark'):,} messages")
        spark.stop()

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

    rows.append(["ingest (set)", fmt_rate(ref_in), fmt_rate(spark_in), fmt_ratio(spark_in, ref_in)])
    rows[-1].append(fmt_rate(ceiling_in))
    rows.append(
        ["export (drain)", fmt_rate(ref_out), fmt_rate(spark_out), fmt_ratio(spark_out, ref_out)]
    )
    rows[-1].append(fmt_rate(ceiling_out))
    print_table(
        f"{count:,} messages of {size} bytes, mqd {args.backend} (sync {args.sync}), "
        f"Spark {args.master} (start-up {startup:.1f} s apart)",
        ["leg", "pymemcache loop rows/s", "Spark rows/s", "Spark/loop", "daemon ceiling ops/s"],
        rows,
    )
    print(f"count and digest {expected} checked on every leg")
    return 0


if __name__ == "__main__":
    sys.exit(main())
