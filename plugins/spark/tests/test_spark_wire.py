"""The bulk paths the data source's tasks use (Arrow batches to pipelined commands and
back), against a real daemon, without Spark: awkward bodies, replies split across
reads, NOT_STORED and error replies, and named leases."""

from __future__ import annotations

import time
from contextlib import closing
from pathlib import Path

import pyarrow as pa
import pytest
from mqd_spark import leases, rows
from mqd_spark import options as opts
from mqd_spark.wire import Connection, WireError
from spark_helpers import take_all

from mqd.testing.daemon import Daemon

pytest_plugins = ("spark_helpers",)

# Bodies that look like the protocol's own lines, an empty one, and one much
# larger than a read from the socket, so that a reply is split mid-body.
AWKWARD = [
    b"END",
    b"END\r\n",
    b"VALUE x 0 5 1\r\nhello\r\n",
    b"STORED\r\n",
    b"",
    b"\r\n\r\n",
    bytes(range(256)) * 2000,
    b"last",
]


def spec(queue: str | None, verb: str = "set") -> rows.CommandSpec:
    return rows.CommandSpec(verb=verb, queue=queue, flags=3, exptime=0)


def store(daemon: Daemon, batch: pa.RecordBatch, command: rows.CommandSpec) -> tuple[int, int]:
    with closing(Connection(daemon.address)) as conn:
        return tuple(conn.store_blocks(rows.commands(batch, command)))  # type: ignore[return-value]


def test_awkward_bodies_round_trip_in_order(memory_mqd: Daemon, q: str) -> None:
    batch = pa.RecordBatch.from_pydict({"body": pa.array(AWKWARD, pa.binary())})
    assert store(memory_mqd, batch, spec(q)) == (len(AWKWARD), 0)
    with closing(Connection(memory_mqd.address)) as conn:
        head = conn.head(q)
        assert head is not None
        chunks = list(conn.read_ids(q, head, head + len(AWKWARD) - 1, rows=3))
    got = pa.Table.from_batches([rows.record_batch(q, chunk) for chunk in chunks])
    assert got.column("body").to_pylist() == AWKWARD
    assert got.column("id").to_pylist() == list(range(head, head + len(AWKWARD)))
    assert set(got.column("flags").to_pylist()) == {3}
    assert set(got.column("queue").to_pylist()) == {q}
    assert take_all(memory_mqd, q) == AWKWARD  # reading by id removed nothing


def test_read_ids_go_on_past_a_cut_reply(memory_mqd: Daemon, q: str) -> None:
    """A range's reply ends past 64 MiB of bodies: the rest is asked for, and comes."""
    bodies = [b"%02d" % i + b"x" * ((1 << 20) - 2) for i in range(66)]  # 1 MiB each
    batch = pa.RecordBatch.from_pydict({"body": pa.array(bodies, pa.binary())})
    assert store(memory_mqd, batch, spec(q)) == (66, 0)
    with closing(Connection(memory_mqd.address)) as conn:
        head = conn.head(q)
        assert head is not None
        chunks = list(conn.read_ids(q, head, head + 65, rows=100))
    assert [len(c.ids) for c in chunks] == [64, 2]
    assert [i for c in chunks for i in c.ids] == list(range(head, head + 66))
    assert [b for c in chunks for b in c.bodies] == bodies


def test_row_columns_override_the_options(memory_mqd: Daemon, q: str) -> None:
    batch = pa.RecordBatch.from_pydict(
        {
            "body": pa.array(["a", "b", "c"], pa.string()),
            "queue": pa.array([q + "x", None, q + "x"], pa.string()),
            "flags": pa.array([7, None, 9], pa.int32()),
            "exptime": pa.array([None, 0, -1], pa.int64()),
        }
    )
    # exptime -1: stored as already expired, so never delivered (memcached's rule).
    assert store(memory_mqd, batch, spec(q)) == (3, 0)
    with closing(Connection(memory_mqd.address)) as conn:
        x = list(conn.lease_read(q + "x", [("a", 5)]))
        plain = list(conn.lease_read(q, [("a", 5)]))
    assert [(c.bodies, c.flags) for c in x] == [([b"a"], [7])]
    assert [(c.bodies, c.flags) for c in plain] == [([b"b"], [3])]


def test_add_counts_what_was_not_stored(memory_mqd: Daemon, q: str) -> None:
    batch = pa.RecordBatch.from_pydict({"body": pa.array([b"a", b"a", b"b"] * 3000)})
    assert store(memory_mqd, batch, spec(q, "add")) == (2, 8998)
    assert sorted(take_all(memory_mqd, q)) == [b"a", b"b"]


def test_an_error_reply_raises_and_names_it(memory_mqd: Daemon, q: str) -> None:
    batch = pa.RecordBatch.from_pydict({"body": pa.array([b"ok", b"x" * (2 << 20)])})
    with pytest.raises(WireError, match="too large"):
        store(memory_mqd, batch, spec(q))


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        ({"body": pa.array([b"a", None])}, "no body"),
        ({"body": pa.array([b"a"]), "queue": pa.array(["two words"])}, "space"),
        ({"body": pa.array([b"a"]), "queue": pa.array(["a/b"])}, "'/'"),
        ({"body": pa.array([b"a"]), "queue": pa.array([""])}, "empty or over 250 bytes"),
        ({"body": pa.array([b"a"]), "queue": pa.array(["é" * 126])}, "empty or over 250 bytes"),
        ({"body": pa.array([b"a", b"b"]), "flags": pa.array([1, -1])}, "outside 0 to 4294967295"),
        ({"body": pa.array([b"a"]), "flags": pa.array([2**32])}, "outside 0 to 4294967295"),
    ],
)
def test_rows_that_cannot_be_sent_are_refused(columns: dict[str, pa.Array], message: str) -> None:
    batch = pa.RecordBatch.from_pydict(columns)
    with pytest.raises(ValueError, match=message):
        list(rows.commands(batch, spec("q")))


def test_a_row_without_a_queue_needs_the_option() -> None:
    batch = pa.RecordBatch.from_pydict(
        {"body": pa.array([b"a"]), "queue": pa.array([None], pa.string())}
    )
    with pytest.raises(ValueError, match="no queue"):
        list(rows.commands(batch, spec(None)))


def test_leases_read_again_acknowledge_and_give_back(memory_mqd: Daemon, q: str) -> None:
    bodies = [b"%05d" % i for i in range(25)]
    store(memory_mqd, pa.RecordBatch.from_pydict({"body": pa.array(bodies)}), spec(q))
    plan = [("job-0", 10), ("job-1", 10)]
    with closing(Connection(memory_mqd.address)) as conn:
        first = [c.bodies for c in conn.lease_read(q, plan)]
        again = [c.bodies for c in conn.lease_read(q, plan)]  # a retried task
        assert first == again == [bodies[:10], bodies[10:20]]
        assert take_all(memory_mqd, q) == bodies[20:]  # leased ones are no one else's
        assert conn.lease_ack(q, ["job-0"]) == 1
        conn.lease_abort(q, ["job-1"])
        assert conn.lease_ack(q, ["job-0", "job-1", "never"]) == 0
    assert take_all(memory_mqd, q) == bodies[10:20]  # given back; job-0's are gone


def test_leases_hold_for_the_time_asked(tmp_path: Path, q: str) -> None:
    """`hold_s` outlasts the queue's visibility timeout; a lease without it does not."""
    with Daemon(tmp_path, config_text='[queues."*"]\nvisibility_timeout = 0.5\n') as daemon:
        bodies = [b"%05d" % i for i in range(4)]
        store(daemon, pa.RecordBatch.from_pydict({"body": pa.array(bodies)}), spec(q))
        with closing(Connection(daemon.address)) as conn:
            held = [c.bodies for c in conn.lease_read(q, [("long", 2)], hold_s=60)]
            short = [c.bodies for c in conn.lease_read(q, [("short", 2)])]
            assert held == [bodies[:2]] and short == [bodies[2:]]
            time.sleep(1.5)
            assert take_all(daemon, q) == bodies[2:]  # the short lease's came back
            assert conn.lease_ack(q, ["long", "short"]) == 1


def test_partitions_cut_a_drain_smaller_than_a_lease() -> None:
    parts = leases.plan(("127.0.0.1", 1), "q", "b", 30, rows_per_part=8, hold_s=60)
    assert [[n for _, n in p.leases] for p in parts] == [[8], [8], [8], [6]]
    assert len({name for p in parts for name, _ in p.leases}) == 4
    big = leases.plan(("127.0.0.1", 1), "q", "b", 25_000, rows_per_part=100_000, hold_s=60)
    assert [[n for _, n in p.leases] for p in big] == [[10_000, 10_000, 5_000]]


def test_a_peek_on_a_backend_without_reads_by_id_is_refused_at_planning(
    tmp_path: Path, q: str
) -> None:
    with Daemon(tmp_path, backend="bdb-random") as daemon:
        store(daemon, pa.RecordBatch.from_pydict({"body": pa.array([b"x"])}), spec(q))
        with closing(Connection(daemon.address)) as conn:
            found = opts.survey(opts.parse({"queue": q}), conn)
            assert [name for name, _, _ in found] == [q]
            with pytest.raises(opts.OptionError, match="use mode=drain"):
                opts.check_range_reads(conn, found)
