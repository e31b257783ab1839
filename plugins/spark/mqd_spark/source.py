"""The "mqd" PySpark data source: batch and streaming reads and writes over the wire.

A peek reads by message id (`gets <q>/at=<id>/n=<count>`), so a task that is
retried reads exactly the rows it read before, and nothing leaves the queue.
A drain reads through named leases (mqd_spark.leases): its rows leave the
queue only once Spark reports that the job (mqd_spark.drain) or the
micro-batch (`MqdLeaseStreamReader.commit`) that read them succeeded.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import BinaryType, IntegralType, StringType, StructType

from mqd_spark import leases, rows
from mqd_spark import options as opts
from mqd_spark.wire import Address, Connection, WireError, address_text, parse_servers

SCHEMA = "queue string, id long, flags long, body binary"


class MqdPartition(InputPartition):
    """Messages first..last (ids) of one queue on one server, for a peek."""

    def __init__(self, server: Address, queue: str, first: int, last: int) -> None:
        super().__init__((server, queue, first, last))
        self.server, self.queue, self.first, self.last = server, queue, first, last


def split(
    server: Address, queue: str, first: int, last: int, parts: int | None
) -> list[MqdPartition]:
    """first..last cut into `parts` ranges (default: one per ROWS_PER_PARTITION ids)."""
    size = last - first + 1
    if size <= 0:
        return []
    parts = min(size, parts or -(-size // opts.ROWS_PER_PARTITION))
    step = -(-size // parts)
    return [
        MqdPartition(server, queue, lo, min(last, lo + step - 1))
        for lo in range(first, last + 1, step)
    ]


def rows_per_part(options: opts.Options, count: int) -> int:
    return -(-count // options.partitions) if options.partitions else opts.ROWS_PER_PARTITION


def read_partition(partition: InputPartition, timeout: float) -> Iterator[pa.RecordBatch]:
    if isinstance(partition, leases.LeasePartition):
        yield from leases.read(partition, timeout)
    elif isinstance(partition, MqdPartition):
        with closing(Connection(partition.server, timeout)) as conn:
            for chunk in conn.read_ids(partition.queue, partition.first, partition.last):
                yield rows.record_batch(partition.queue, chunk)
    # Otherwise it is the one empty partition Spark reads where the plan had
    # none (nothing waiting, no queue matched): no rows.


class MqdDataSource(DataSource):
    """Registered as format "mqd" by mqd_spark.register(spark)."""

    @classmethod
    def name(cls) -> str:
        return "mqd"

    def schema(self) -> str:
        opts.parse(self.options)  # load() fails here, in one line, on a bad option
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return MqdReader(opts.parse(self.options))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        options = opts.parse(self.options)
        if options.mode == "peek" and "mode" in {k.lower() for k in self.options}:
            return MqdStreamReader(options)
        return MqdLeaseStreamReader(options)  # drain: the default for streams

    def writer(self, schema: StructType, overwrite: bool) -> MqdWriter:
        return MqdWriter(_write_options(self.options, schema, overwrite), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> MqdStreamWriter:
        return MqdStreamWriter(_write_options(self.options, schema, overwrite), schema)


class MqdReader(DataSourceReader):
    def __init__(self, options: opts.Options) -> None:
        self.options = options

    def partitions(self) -> Sequence[InputPartition]:
        """Peek: each queue's ids from its head to its tail (or `limit`), as they are now.

        Drain: as many messages as are waiting now (or `limit`), as leases.
        """
        out: list[InputPartition] = []
        limit = self.options.limit
        base = leases.new_base()
        for server in self.options.servers:
            with closing(Connection(server, self.options.timeout)) as conn:
                if self.options.mode == "drain":
                    for queue, count in opts.waiting(self.options, conn):
                        count = min(count, limit or count)
                        per_part = rows_per_part(self.options, count)
                        out += leases.plan(
                            server, queue, base, count, per_part, self.options.lease_timeout
                        )
                    continue
                found = opts.survey(self.options, conn)
                opts.check_range_reads(conn, found)
                for queue, head, last in found:
                    if limit is not None:
                        last = min(last, head + limit - 1)
                    out += split(server, queue, head, last, self.options.partitions)
        return out

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(partition, self.options.timeout)


def _key(server: Address, queue: str) -> str:
    return f"{address_text(server)}/{queue}"


def _unkey(key: str) -> tuple[Address, str]:
    address, _, queue = key.partition("/")
    return parse_servers(address)[0], queue


class MqdStreamReader(DataSourceStreamReader):
    """A peek stream: offsets are {"host:port/queue": next id}; a batch reads ids start..end-1.

    Nothing leaves the queue; a restart from the checkpoint resumes at the
    committed offsets.
    """

    def __init__(self, options: opts.Options) -> None:
        self.options = options

    def _heads(self) -> dict[str, tuple[int, int]]:
        """For each queue now: its head id and one past its last id."""
        out = {}
        for server in self.options.servers:
            with closing(Connection(server, self.options.timeout)) as conn:
                found = opts.survey(self.options, conn)
                opts.check_range_reads(conn, found)
            for queue, head, last in found:
                out[_key(server, queue)] = (head, last + 1)
        return out

    def initialOffset(self) -> dict[str, int]:
        return {key: head for key, (head, _) in self._heads().items()}

    def getDefaultReadLimit(self) -> ReadLimit:
        return _read_limit(self.options)

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        end = dict(start)
        for key, (head, after) in self._heads().items():
            if key not in start:
                # A queue that appeared (or filled) after the start: it joins at its
                # head, read from the next batch on, so that every batch is by id.
                end[key] = head
                continue
            begin = start[key]
            if isinstance(limit, ReadMaxRows):
                after = min(after, begin + limit.max_rows)
            end[key] = max(begin, after)
        return end

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        out: list[InputPartition] = []
        for key, after in end.items():
            server, queue = _unkey(key)
            first = start.get(key, after)
            out += split(server, queue, first, after - 1, self.options.partitions)
        return out

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(partition, self.options.timeout)

    def commit(self, end: dict[str, int]) -> None:
        """Nothing to do: a peek stream removes nothing."""


def _read_limit(options: opts.Options) -> ReadLimit:
    return ReadAllAvailable() if options.limit is None else ReadMaxRows(options.limit)


# The lease base of a drain stream, in its offsets beside the queues' positions.
LEASE = "lease"
Offset = dict[str, str | list[int]]


class MqdLeaseStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """A drain stream: each micro-batch of a queue is a set of named leases.

    Offsets are {"lease": base, "host:port/queue": [batch, messages]}: batch b
    of a queue holds up to `messages` messages in leases "<base>-<b>-<i>",
    reserved by the batch's tasks. `commit(end)` acknowledges the batch's
    leases; a query restarted from its checkpoint replays its last batch
    under the same names and so reads the same messages (while the daemon
    that holds them runs). Other consumers of the queue never get them.

    Spark commits batch k only when it plans batch k+1; when no more
    messages are waiting, an empty batch is planned so that the last one's
    messages leave the queue (and its leases do not reach their timeout).
    Under `trigger(availableNow=True)` the query reads what was waiting when
    it started (`prepareForTriggerAvailableNow`), and that empty batch comes
    before it stops too.
    """

    def __init__(self, options: opts.Options) -> None:
        self.options = options
        # Messages per queue a query under availableNow may still read; None: no bound.
        self.budget: dict[str, int] | None = None

    def prepareForTriggerAvailableNow(self) -> None:
        self.budget = {}
        for server in self.options.servers:
            with closing(Connection(server, self.options.timeout)) as conn:
                for queue, count in opts.waiting(self.options, conn):
                    self.budget[_key(server, queue)] = count

    def initialOffset(self) -> Offset:
        return {LEASE: leases.new_base()}

    def getDefaultReadLimit(self) -> ReadLimit:
        return _read_limit(self.options)

    def latestOffset(self, start: Offset, limit: ReadLimit) -> Offset:
        end = dict(start)
        for server in self.options.servers:
            with closing(Connection(server, self.options.timeout)) as conn:
                found = opts.waiting(self.options, conn)
            for queue, count in found:
                key = _key(server, queue)
                if isinstance(limit, ReadMaxRows):
                    count = min(count, limit.max_rows)
                if self.budget is not None:
                    count = min(count, self.budget.get(key, 0))
                    if count <= 0:
                        continue
                    self.budget[key] -= count
                end[key] = [_batch(start, key) + 1, count]
        if end == start:  # nothing new: plan an empty batch if the last one held messages
            for key, value in start.items():
                if key != LEASE and isinstance(value, list) and value[1] > 0:
                    end[key] = [value[0] + 1, 0]
        return end

    def _leases(self, end: Offset, key: str) -> list[leases.LeasePartition]:
        """The partitions of the batch that ends at `end` for queue `key`."""
        value = end[key]
        assert isinstance(value, list)
        batch, count = value
        server, queue = _unkey(key)
        base = f"{end[LEASE]}-{batch - 1}"
        per_part = rows_per_part(self.options, count)
        return leases.plan(server, queue, base, count, per_part, self.options.lease_timeout)

    def partitions(self, start: Offset, end: Offset) -> Sequence[InputPartition]:
        return [
            p
            for key in end
            if key != LEASE and _batch(end, key) > _batch(start, key)
            for p in self._leases(end, key)
        ]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(partition, self.options.timeout)

    def commit(self, end: Offset) -> None:
        """Acknowledges the leases of the batch that ended at `end` (again: a no-op)."""
        leases.settle(
            [p for key in end if key != LEASE for p in self._leases(end, key)],
            ack=True,
            timeout=self.options.timeout,
        )


def _batch(offset: Offset, key: str) -> int:
    value = offset.get(key)
    return value[0] if isinstance(value, list) else 0


@dataclass
class Written(WriterCommitMessage):
    stored: int
    not_stored: int


def _write_options(options: Mapping[str, str], schema: StructType, overwrite: bool) -> opts.Options:
    """Checks the options and the columns before any task runs."""
    if overwrite:
        raise opts.OptionError(
            'mqd write: save mode "overwrite" is not supported: messages are appended to a '
            'queue; use .mode("append")'
        )
    fields = {f.name.lower(): f.dataType for f in schema.fields}
    parsed = opts.parse(options, need_queue="queue" not in fields)
    if len(parsed.queues) > 1 or (parsed.queue and opts.GLOB_CHARS & set(parsed.queue)):
        raise opts.OptionError("mqd option queue: a write needs one queue name, not a list or glob")
    body = fields.get("body")
    if not isinstance(body, StringType | BinaryType):
        raise opts.OptionError(
            f"mqd write: needs a `body` column of string or binary, got "
            f"{body.simpleString() if body else 'none'} (columns: {', '.join(fields)})"
        )
    for name in ("flags", "exptime"):
        if name in fields and not isinstance(fields[name], IntegralType):
            raise opts.OptionError(f"mqd write: column `{name}` must be an integer")
    if "queue" in fields and not isinstance(fields["queue"], StringType):
        raise opts.OptionError("mqd write: column `queue` must be a string")
    return parsed


class MqdWriter(DataSourceArrowWriter):
    """Each task writes its rows, in order, over one pipelined connection.

    A retried task writes its rows again: at-least-once, unless the queue is
    `unique` or the `command` option is `add`, which store a body only once.
    """

    def __init__(self, options: opts.Options, schema: StructType) -> None:
        self.options = options
        text = isinstance(
            next(f.dataType for f in schema.fields if f.name.lower() == "body"), StringType
        )
        flags = options.flags
        self.spec = rows.CommandSpec(
            verb=options.command,
            queue=options.queue,
            flags=(rows.FLAG_TEXT if text else 0) if flags is None else flags,
            exptime=options.exptime,
        )

    def write(self, iterator: Iterator[pa.RecordBatch]) -> Written:
        from pyspark import TaskContext

        context = TaskContext.get()
        index = context.partitionId() if context else 0
        server = self.options.servers[index % len(self.options.servers)]
        with closing(Connection(server, self.options.timeout)) as conn:
            result = conn.store_blocks(
                block for batch in iterator for block in rows.commands(batch, self.spec)
            )
        if result.not_stored and self.spec.verb == "set":
            # A set is refused only by a full queue (overflow = "reject"): the
            # task fails, so that a drain feeding this write gives its rows back.
            # For `add`, NOT_STORED is also the answer to a body already queued.
            raise WireError(
                f"mqd at {address_text(server)}: {result.not_stored} of "
                f"{result.stored + result.not_stored} rows were not stored (NOT_STORED): "
                'the queue is full and its overflow is "reject"'
            )
        return Written(result.stored, result.not_stored)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Nothing to do: rows are in their queues as soon as each task stored them."""


class MqdStreamWriter(DataSourceStreamArrowWriter):
    """The streaming sink: each micro-batch's tasks write like MqdWriter's."""

    def __init__(self, options: opts.Options, schema: StructType) -> None:
        self.batch = MqdWriter(options, schema)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> Written:
        return self.batch.write(iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to do: rows are in their queues as soon as each task stored them."""
