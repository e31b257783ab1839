"""Storage failures become StorageError for the call that met them; the rest goes on."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from bdb_helpers import ALWAYS, NAMES, drain, fill_up, make, put, session, small_disk
from berkeleydb import db
from mqd_bdb import jobs
from mqd_bdb.backend import _BdbBackend
from mqd_bdb.catalog import QueueState
from mqd_bdb.config import BdbConfig
from mqd_bdb.names import encode_name, file_stem
from mqd_bdb.single import SingleStore
from mqd_bdb.space import no_room

from mqd.backend import Capability, Message
from mqd.errors import ConfigError, StorageError


def test_directory_in_the_way_of_a_new_queue(tmp_path: Path) -> None:
    blocked = tmp_path / (file_stem(encode_name("blocked")) + ".btree")

    async def body(b: _BdbBackend) -> None:
        await put(b, "fine", b"1")
        blocked.mkdir()
        with pytest.raises(StorageError):
            await put(b, "blocked", b"x")
        assert await b.queues() == ["fine"]
        assert await b.size("blocked") is None
        # Other queues go on, in the same batch as a failing job too.
        results = await asyncio.gather(
            put(b, "fine", b"2"), put(b, "blocked", b"y"), put(b, "fine", b"3"),
            return_exceptions=True,
        )  # fmt: skip
        assert results[0] == 1 and results[2] == 2
        assert isinstance(results[1], StorageError)
        blocked.rmdir()
        assert await put(b, "blocked", b"z") == 0
        assert [m.body for m in await drain(b, "fine")] == [b"1", b"2", b"3"]

    session("bdb", tmp_path, body)


@pytest.mark.parametrize("name", NAMES)
def test_one_failing_job_fails_alone(name: str, tmp_path: Path) -> None:
    async def body(b: _BdbBackend) -> None:
        store = b.worker.store
        real = store._ops[jobs.PUT]

        def flaky_put(txn: Any, queue: str, arg: tuple[Message, bool]) -> Any:
            if arg[0].body == b"poison":
                raise db.DBError(errno.EIO, "Input/output error")
            return real(txn, queue, arg)

        store._ops[jobs.PUT] = flaky_put
        bodies = [b"a", b"b", b"poison", b"c", b"d"]
        results = await asyncio.gather(
            *(put(b, "q", body) for body in bodies), return_exceptions=True
        )
        error = results[2]
        assert isinstance(error, StorageError) and str(error) == "I/O error"
        assert [r for i, r in enumerate(results) if i != 2] == [0, 1, 2, 3]
        size = await b.size("q")
        assert size is not None and size.items == 4
        got = [m.body for m in await drain(b, "q")]
        if Capability.FIFO in b.capabilities:
            assert got == [b"a", b"b", b"c", b"d"]
        else:
            assert sorted(got) == [b"a", b"b", b"c", b"d"]

    session(name, tmp_path, body)


@pytest.mark.parametrize("name", NAMES)
def test_a_damaged_file_that_recovery_fails_on_is_named(name: str, tmp_path: Path) -> None:
    async def fill(b: _BdbBackend) -> None:
        await put(b, "q", b"one")
        await put(b, "q", b"two")

    session(name, tmp_path, fill)
    stem = file_stem(encode_name("q"))
    damaged = tmp_path / (f"{stem}.hash" if name == "bdb" else "queues.db")
    with damaged.open("r+b") as f:
        f.truncate(100)  # as a copy cut short leaves it

    async def nothing(b: _BdbBackend) -> None:
        raise AssertionError("opened a damaged environment")

    with pytest.raises(StorageError) as failed:
        session(name, tmp_path, nothing)
    assert str(failed.value) == (
        f"database needs recovery, and recovery failed on {damaged} (Berkeley DB's"
        " verification finds it truncated or damaged): restore it from a backup, or move it"
        " aside (what it held is lost), then start again"
    )


def test_a_queue_is_set_back_as_it_was() -> None:
    """What an undone batch may have changed in a queue: state() takes it, set_state()
    puts it back, field for field."""
    q = QueueState("q", b"q", 1)
    before = (5, 4, 300, 1, 12.5, 10.25, b"head", True, 3, b"hint", True)
    q.set_state(before)
    assert q.state() == before
    assert (q.next_offset, q.items, q.bytes, q.open, q.hint, q.hint_key) == (
        5,
        4,
        300,
        1,
        3,
        b"hint",
    )
    q.set_state((0, 0, 0, 0, 0.0, 0.0, None, False, 0, b"", False))
    assert q.state() != before


@pytest.mark.parametrize("name", NAMES)
def test_panic_reopens_the_environment(name: str, tmp_path: Path) -> None:
    async def body(b: _BdbBackend) -> None:
        await put(b, "q", b"kept")
        store = b.worker.store
        calls: Counter[int] = Counter()

        def panicking(op: int) -> None:
            real = store._ops[op]

            def once(txn: Any, queue: str, arg: Any) -> Any:
                calls[op] += 1
                if calls[op] == 1:
                    raise db.DBRunRecoveryError(-30973, "DB_RUNRECOVERY: Fatal error, run recovery")
                return real(txn, queue, arg)

            store._ops[op] = once

        # On the worker thread (a peek runs there), the job that met the
        # panic fails alone; the next batch recovers first.
        panicking(jobs.PEEK)
        env = store.env
        with pytest.raises(StorageError, match="needs recovery"):
            await b.peek("q")
        peeked = await b.peek("q")
        assert peeked is not None and peeked.body == b"kept" and not store.panicked
        assert store.env is not env  # recovered: a new environment
        env = store.env
        # On the event loop (a take runs there once the thread is done with
        # the store), the panic undoes the round; the thread recovers and
        # runs it again.
        while b.worker.lock.locked():
            await asyncio.sleep(0.001)
        panicking(jobs.TAKE)
        taken = await b.take("q", sync=ALWAYS)
        assert taken is not None and taken.body == b"kept" and calls[jobs.TAKE] == 2
        assert b.worker.rounds and not store.panicked
        assert store.env is not env  # recovered before the take ran again
        assert await put(b, "q", b"after") == 1
        assert [m.body for m in await drain(b, "q")] == [b"after"]

    session(name, tmp_path, body)


@pytest.mark.parametrize("name", NAMES)
def test_full_disk_loses_nothing_acknowledged(name: str, tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", "4m") as disk:

        async def main() -> None:
            b = make(name, disk / "data", log_file_mb=1, cache_mb=4, reserve_mb=1)
            await b.open()
            acked = []
            error: StorageError | None = None
            try:
                for i in range(10_000):
                    body = b"%05d" % i + b"x" * 1000
                    try:
                        await put(b, "q", body)
                    except StorageError as exc:
                        error = exc
                        break
                    acked.append(body)
                # A failed log write says so; a cache that cannot write out its
                # dirty pages says I/O error.
                assert error is not None and str(error) in ("disk full", "I/O error")
                assert len(acked) > 100
                size = await b.size("q")
                assert size is not None and size.items == len(acked)
                # A read may fail too while the cache cannot write out dirty
                # pages; the worker goes on and answers once there is room.
                with contextlib.suppress(StorageError):
                    await b.peek("q")
                grow()
                head = await b.peek("q")
                assert head is not None
                got = [m.body for m in await drain(b, "q")]
                if Capability.FIFO in b.capabilities:
                    assert got[: len(acked)] == acked
                else:
                    assert set(acked) <= set(got)
                assert len(got) - len(acked) <= 1  # the failed put may have landed
            finally:
                grow()
                await b.close()

        def grow() -> None:
            subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)

        asyncio.run(main())


def test_an_io_error_with_no_room_or_the_reserve_out_is_the_full_disk(tmp_path: Path) -> None:
    # What Berkeley DB says when the cache is all dirty pages it cannot write out.
    cache_full = db.DBError(errno.EIO, "unable to allocate space from the buffer cache")
    with small_disk(tmp_path / "disk", "4m") as disk:
        store = SingleStore(disk / "data", BdbConfig(cache_mb=1, log_file_mb=1, reserve_mb=1))
        store.open()
        try:
            assert not store.disk_full(cache_full)
            fill_up(disk / "filler")
            assert store.disk_full(cache_full)
            # Another thread met the full disk first and released the reserve:
            # there is room now, but the write that failed did not have it.
            assert store.space.release()
            assert not no_room(store.data_dir, 64 << 10)
            assert store.disk_full(cache_full)
        finally:
            (disk / "filler").unlink()
            store.close()


@pytest.mark.parametrize(
    ("name", "key", "value", "error"),
    [
        ("bdb", "cache", 3, r"storage\.bdb\.cache = 3: unknown key; known keys: cache_mb"),
        (
            "bdb-single",
            "cache_mb",
            "big",
            r"storage\.bdb-single\.cache_mb = 'big': must be a whole",
        ),
        ("bdb-random", "page_size", 1000, r"page_size = 1000: must be 0 or a power of two"),
        ("bdb", "zero_log_files", 1, r"storage\.bdb\.zero_log_files = 1: must be true or false"),
        ("bdb-single", "aio_sync", "yes", r"bdb-single\.aio_sync = 'yes': must be true or false"),
    ],
)
def test_bad_options_are_config_errors(
    name: str, key: str, value: Any, error: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=error):
        make(name, tmp_path, **{key: value})


def test_good_options_are_taken(tmp_path: Path) -> None:
    make("bdb", tmp_path, cache_mb=8, page_size=8192, checkpoint_s=5, zero_log_files=False)
    make("bdb", tmp_path, aio_sync=False)


def test_calls_before_open_fail_cleanly(tmp_path: Path) -> None:
    b = make("bdb", tmp_path)
    with pytest.raises(StorageError, match="not open"):
        asyncio.run(b.take("q", sync=ALWAYS))
