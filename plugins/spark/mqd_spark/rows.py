"""Arrow record batches to and from the wire, a whole batch at a time.

A write turns each batch into one block of storage commands with Arrow's
compute kernels (no Python work per row): the commands of a batch are the
elements of one binary array, so its data buffer is the block to send. A
read turns the columns a `gets` reply was parsed into straight into a batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from mqd_spark.wire import MAX_FLAGS, MAX_QUEUE_BYTES, QUEUE_BREAKERS, STORE_BATCH, Columns

SCHEMA = pa.schema(
    [("queue", pa.string()), ("id", pa.int64()), ("flags", pa.int64()), ("body", pa.binary())]
)
# pymemcache's serializers mark a str body with this flag (FLAG_TEXT) and give
# str back for it; a string `body` column is written with it unless flags say otherwise.
FLAG_TEXT = 16


def record_batch(queue: str, columns: Columns) -> pa.RecordBatch:
    """Messages of one queue as a batch of the read schema."""
    return pa.RecordBatch.from_arrays(
        [
            pa.repeat(pa.scalar(queue, pa.string()), len(columns.ids)),
            pa.array(columns.ids, pa.int64()),
            pa.array(columns.flags, pa.int64()),
            pa.array(columns.bodies, pa.binary()),
        ],
        schema=SCHEMA,
    )


@dataclass(frozen=True)
class CommandSpec:
    """What a write puts in each command where a row's own column does not say."""

    verb: str  # set or add
    queue: str | None
    flags: int
    exptime: int


def commands(batch: pa.RecordBatch, spec: CommandSpec) -> Iterator[tuple[memoryview, int]]:
    """The batch's rows as blocks of up to STORE_BATCH storage commands, in row order.

    ValueError for a row without a body or a queue, with a queue name that
    would break the command line, or with flags the protocol does not take:
    found before any of the batch is sent, not by the daemon half way.
    """
    columns = {name.lower(): batch.column(i) for i, name in enumerate(batch.schema.names)}
    body = columns["body"]
    if body.null_count:
        raise ValueError("mqd write: a row has no body (null)")
    body = body.cast(pa.binary())
    parts: list[pa.Array | pa.Scalar] = [_text(spec.verb + " ")]
    queue = columns.get("queue")
    if queue is None:
        parts.append(_text(f"{spec.queue} "))
    else:
        if spec.queue is not None:
            queue = pc.fill_null(queue, spec.queue)
        elif queue.null_count:
            raise ValueError("mqd write: a row has no queue (null) and no queue option is set")
        if pc.any(pc.match_substring_regex(queue, QUEUE_BREAKERS)).as_py():
            raise ValueError("mqd write: a queue column value holds a space, control byte or '/'")
        queue = queue.cast(pa.binary())
        if not _within(pc.binary_length(queue), 1, MAX_QUEUE_BYTES):
            raise ValueError(
                f"mqd write: a queue column value is empty or over {MAX_QUEUE_BYTES} bytes"
            )
        parts += [queue, _text(" ")]
    for name, default in (("flags", spec.flags), ("exptime", spec.exptime)):
        column = columns.get(name)
        if column is None:
            parts.append(_text(f"{default} "))
            continue
        column = pc.fill_null(column, default)
        if name == "flags" and not _within(column, 0, MAX_FLAGS):
            raise ValueError(f"mqd write: a flags column value is outside 0 to {MAX_FLAGS}")
        parts += [column.cast(pa.string()).cast(pa.binary()), _text(" ")]
    parts += [
        pc.binary_length(body).cast(pa.string()).cast(pa.binary()),
        _text("\r\n"),
        body,
        _text("\r\n"),
    ]
    joined = pc.binary_join_element_wise(*parts, _text(""))
    for start in range(0, len(joined), STORE_BATCH):
        block = joined.slice(start, STORE_BATCH)
        yield _data(block), len(block)


def _within(values: pa.Array, low: int, high: int) -> bool:
    """Whether every value of an integer array lies in low..high (an empty array does)."""
    bounds = pc.min_max(values).as_py()
    return bounds["min"] is None or (low <= bounds["min"] and bounds["max"] <= high)


def _text(text: str) -> pa.Scalar:
    return pa.scalar(text.encode(), pa.binary())


def _data(array: pa.Array) -> memoryview:
    """The bytes of a binary array's elements, back to back: its data buffer, no copy."""
    _, offsets, data = array.buffers()
    ends = memoryview(offsets).cast("i")
    return memoryview(data)[ends[array.offset] : ends[array.offset + len(array)]]
