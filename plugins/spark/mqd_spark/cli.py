"""`mqd pipeline ingest|export`: bulk moves between files and queues through Spark.

mqd's command line loads this module only when `mqd pipeline` is asked for,
and PySpark only once a command runs, so the daemon never imports it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import click

from mqd_spark import options as opts
from mqd_spark.wire import Address, Connection, WireError, address_text

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

FORMATS = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv"}
FLAG_TEXT = 16
NOT_TEXT = "mqd export: a message body is not UTF-8 text: export with --body-type binary"


def _servers(text: str) -> list[Address]:
    try:
        servers = list(opts.parse({"servers": text, "queue": "-"}).servers)
    except opts.OptionError as error:
        raise click.BadParameter(str(error), param_hint="--servers") from None
    for server in servers:  # fail before Spark starts, in one line
        try:
            Connection(server, timeout=5).close()
        except WireError as error:
            raise click.ClickException(str(error)) from None
    return servers


def _counter(servers: list[Address], name: str) -> int:
    total = 0
    for server in servers:
        with closing(Connection(server, timeout=5)) as conn:
            total += int(conn.stats().get(name, 0))
    return total


def _waiting(options: opts.Options) -> int:
    """Messages waiting (neither open nor leased) in the queues `options` name."""
    total = 0
    for server in options.servers:
        with closing(Connection(server, timeout=5)) as conn:
            total += sum(count for _, count in opts.waiting(options, conn))
    return total


@contextmanager
def _progress(what: str, count: Callable[[], int], total: int | None) -> Iterator[None]:
    """A progress bar with rows/s, fed by polling the daemons' counters."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    stop = threading.Event()
    columns = [
        TextColumn(what),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
    ]
    with Progress(*columns, TimeElapsedColumn(), transient=True) as progress:
        task = progress.add_task(what, total=total, rate="")
        start, base = time.monotonic(), count()

        def poll() -> None:
            while not stop.wait(0.5):
                try:
                    done = count() - base
                except WireError:
                    continue
                rate = done / max(time.monotonic() - start, 1e-9)
                progress.update(task, completed=done, rate=f"{rate:,.0f} rows/s")

        thread = threading.Thread(target=poll, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


@contextmanager
def _session(master: str) -> Iterator[SparkSession]:
    """A session on `master`, stopped at the end unless it was running before."""
    from pyspark.sql import SparkSession

    from mqd_spark.session import SetupError, start

    running = SparkSession.getActiveSession() is not None
    try:
        spark = start(master)
    except SetupError as error:
        raise click.ClickException(str(error)) from None
    try:
        yield spark
    except click.ClickException:
        raise
    except Exception as error:
        raise click.ClickException(_cause(error)) from None
    finally:
        if not running:
            spark.stop()


def _cause(error: Exception) -> str:
    """One line for a failed Spark job: the last line that mqd wrote, else the first.

    Spark's errors carry the Java and Python stacks of every task; the line
    that says what went wrong is ours, or Spark's first.
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    ours = [line for line in lines if "mqd" in line]
    return ours[-1] if ours else lines[0] if lines else type(error).__name__


def _input_format(source: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    for path in files:
        if path.suffix.lower() in FORMATS:
            return FORMATS[path.suffix.lower()]
    return "text"


def _body(df: DataFrame, column: str | None, source: Path) -> DataFrame:
    """The rows as a `body` column (plus `flags` and `exptime` when the file has them)."""
    from pyspark.sql.types import BinaryType, IntegralType, StringType

    types = {f.name: f.dataType for f in df.schema.fields}
    if column is None:
        candidates = [n for n in types if n.lower() in ("body", "value")] or (
            list(types) if len(types) == 1 else []
        )
        if not candidates:
            raise click.ClickException(
                f"{source}: no usable body column among {', '.join(types) or 'none'}: "
                "name one `body` or pass --body-column"
            )
        column = candidates[0]
    if column not in types:
        raise click.ClickException(f"{source}: no column {column!r} (has {', '.join(types)})")
    if not isinstance(types[column], StringType | BinaryType):
        raise click.ClickException(
            f"{source}: column {column!r} is {types[column].simpleString()}: "
            "the body must be string or binary"
        )
    extra = [n for n in ("flags", "exptime") if isinstance(types.get(n), IntegralType)]
    return df.select(df[column].alias("body"), *extra)


@click.group()
def pipeline() -> None:
    """Bulk moves between files and queues, through Spark."""


@pipeline.command()
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option("--queue", "-q", required=True, help="Queue to enqueue into.")
@click.option(
    "--servers", default=opts.DEFAULT_SERVERS, show_default=True, help="host:port[,host:port...]"
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["auto", "parquet", "jsonl", "csv", "text"]),
    default="auto",
    show_default=True,
    help="Input format; auto goes by the file names.",
)
@click.option("--body-column", help="Column holding the message (default: body, or the only one).")
@click.option("--add", is_flag=True, help="Enqueue with `add`: a body already queued is skipped.")
@click.option("--master", default="local[*]", show_default=True, help="Spark master URL.")
def ingest(
    source: Path,
    queue: str,
    servers: str,
    fmt: str,
    body_column: str | None,
    add: bool,
    master: str,
) -> None:
    """Enqueue one message per row (Parquet, CSV) or line (JSON lines, text) of SOURCE."""
    addresses = _servers(servers)
    fmt = _input_format(source, fmt)
    with _session(master) as spark:
        count, started = _ingest(spark, source, fmt, queue, servers, addresses, body_column, add)
    _summary("ingested", count, f"{source} ({fmt})", f"queue {queue}", addresses, started)


def _ingest(
    spark: SparkSession,
    source: Path,
    fmt: str,
    queue: str,
    servers: str,
    addresses: list[Address],
    body_column: str | None,
    add: bool,
) -> tuple[int, float]:
    reader = spark.read
    path = str(source)
    if fmt == "parquet":
        df = reader.parquet(path)
    elif fmt == "jsonl":
        df = reader.json(path)
    elif fmt == "csv":
        df = reader.option("header", True).csv(path)
    else:
        df = reader.text(path)
    df = _body(df, body_column, source)
    key = f"queue_{queue}_enqueued"
    started = time.monotonic()
    before = _counter(addresses, key)
    writer = df.write.format("mqd").option("servers", servers).option("queue", queue)
    with _progress("ingest", lambda: _counter(addresses, key), None):
        writer.option("command", "add" if add else "set").mode("append").save()
    return _counter(addresses, key) - before, started


@pipeline.command()
@click.option("--queue", "-q", required=True, help="Queue(s): a name, a,b, or a glob.")
@click.option("--to", "target", required=True, type=click.Path(path_type=Path), help="Directory.")
@click.option(
    "--format", "fmt", type=click.Choice(["parquet", "jsonl"]), default="parquet", show_default=True
)
@click.option("--drain/--peek", default=False, help="Remove what was exported.  [default: peek]")
@click.option(
    "--servers", default=opts.DEFAULT_SERVERS, show_default=True, help="host:port[,host:port...]"
)
@click.option("--limit", type=click.IntRange(min=1), help="At most this many per queue.")
@click.option(
    "--body-type",
    type=click.Choice(["auto", "binary", "string"]),
    default="auto",
    show_default=True,
    help="auto: string for jsonl, or when the first message has the text flag (16).",
)
@click.option("--master", default="local[*]", show_default=True, help="Spark master URL.")
def export(
    queue: str,
    target: Path,
    fmt: str,
    drain: bool,
    servers: str,
    limit: int | None,
    body_type: str,
    master: str,
) -> None:
    """Write a queue's messages to files in DIR (columns queue, id, flags, body)."""
    addresses = _servers(servers)
    if target.exists() and any(target.iterdir()):
        raise click.ClickException(f"{target} exists and is not empty")
    source = {"servers": servers, "queue": queue, "mode": "drain" if drain else "peek"}
    if limit:
        source["limit"] = str(limit)
    try:
        options = opts.parse(source)
    except opts.OptionError as error:
        raise click.BadParameter(str(error), param_hint="--queue") from None
    total, text = _survey(options, limit)
    as_text = body_type == "string" or (body_type == "auto" and (fmt == "jsonl" or text))

    def done() -> int:
        if drain:  # a lease reservation is one get hit for many rows: count what is left
            return max(0, total - _waiting(options))
        return _counter(addresses, "get_hits")

    with _session(master) as spark:
        count, started = _export(spark, source, target, fmt, as_text, done, total)
    how = "drained" if drain else "exported"
    _summary(how, count, f"queue {queue}", f"{target} ({fmt})", addresses, started)


def _export(
    spark: SparkSession,
    source: dict[str, str],
    target: Path,
    fmt: str,
    as_text: bool,
    done: Callable[[], int],
    total: int,
) -> tuple[int, float]:
    from pyspark.sql import functions as F

    import mqd_spark

    df = spark.read.format("mqd").options(**source).load()
    if as_text:
        # Spark would write a body that is not UTF-8 with U+FFFD in place of
        # its bytes; the export fails instead (a drain then removes nothing).
        text = df["body"].cast("string")
        df = df.withColumn(
            "body", F.when(F.is_valid_utf8(text), text).otherwise(F.raise_error(NOT_TEXT))
        )
    started = time.monotonic()
    with _progress("export", done, total):
        writer = df.write.mode("errorifexists")
        writer.parquet(str(target)) if fmt == "parquet" else writer.json(str(target))
    if source["mode"] == "drain":
        mqd_spark.wait_for_commits(spark)
    files = spark.read.parquet(str(target)) if fmt == "parquet" else spark.read.json(str(target))
    return files.count(), started


def _survey(options: opts.Options, limit: int | None) -> tuple[int, bool]:
    """Messages waiting in the matching queues now, and whether the first is text."""
    total, text = 0, None
    for server in options.servers:
        with closing(Connection(server, timeout=5)) as conn:
            for name, head, last in opts.survey(options, conn):
                total += min(last - head + 1, limit or last - head + 1)
                first = conn.peek(name) if text is None else None
                if first is not None:
                    text = bool(first.flags & FLAG_TEXT)
    return total, bool(text)


def _summary(
    how: str, count: int, source: str, target: str, servers: list[Address], started: float
) -> None:
    seconds = time.monotonic() - started
    where = ",".join(address_text(s) for s in servers)
    click.echo(
        f"{how} {count:,} rows from {source} to {target} via {where} "
        f"in {seconds:.1f} s ({count / max(seconds, 1e-9):,.0f} rows/s)"
    )
