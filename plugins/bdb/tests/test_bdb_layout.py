"""Files on disk: what each layout creates, frees and keeps open."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import pytest
from bdb_helpers import ALWAYS, NAMES, drain, make, put, return_own, session
from berkeleydb import db
from mqd_bdb.backend import _BdbBackend
from mqd_bdb.environment import ENV_FLAGS
from mqd_bdb.names import encode_name, file_stem

from mqd.backend import Message
from mqd.errors import StorageError


def files(data_dir: Path) -> set[str]:
    return {p.name for p in data_dir.iterdir() if not p.name.startswith("log.")}


def test_bdb_delete_removes_the_queue_files(tmp_path: Path) -> None:
    stem = file_stem(encode_name("Jobs"))

    async def body(b: _BdbBackend) -> None:
        await put(b, "Jobs", b"x")
        assert {stem + ".btree", stem + ".hash"} <= files(tmp_path)
        assert await b.delete("Jobs", sync=ALWAYS) is True
        assert files(tmp_path) == {"LOCK", "catalog.db", "layout", "reserve"}

    session("bdb", tmp_path, body)


@pytest.mark.parametrize("name", ["bdb-single", "bdb-random"])
def test_single_file_delete_purges_records(name: str, tmp_path: Path) -> None:
    async def body(b: _BdbBackend) -> None:
        for i in range(1200):
            await put(b, "big", b"%d" % i, sync=ALWAYS)
        await put(b, "small", b"keep")
        await b.reserve("big", lease=0, sync=ALWAYS)
        assert await b.delete("big", sync=ALWAYS) is True
        assert await b.queues() == ["small"]
        # A new queue of the same name starts afresh while the old one is purged.
        assert await put(b, "big", b"new") == 0
        for _ in range(200):
            if not b.worker.store.purges:
                break
            await asyncio.sleep(0.01)
        assert not b.worker.store.purges
        assert await return_own(b) == []

    session(name, tmp_path, body)
    assert files(tmp_path) == {"LOCK", "layout", "queues.db", "reserve"}
    env = db.DBEnv()
    env.open(str(tmp_path), ENV_FLAGS)
    try:
        handle = db.DB(env)
        handle.open("queues.db", None, db.DB_BTREE, db.DB_AUTO_COMMIT)
        records = len(handle.keys())
        handle.close()
    finally:
        env.close()
    # Left: the format, two catalog entries, the recent queues' counts, the
    # next queue id, and two messages.
    assert records == 7


def test_bdb_keeps_a_bounded_number_of_files_open(tmp_path: Path) -> None:
    def open_files() -> int:
        """Queue files this process holds open (the worker thread may close one meanwhile)."""
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(FileNotFoundError):
                count += os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path) + "/q-")
        return count

    async def main() -> None:
        b = make("bdb", tmp_path, max_open_queues=3)
        await b.open()
        try:
            for round_ in range(3):
                for q in range(12):
                    await put(b, f"q{q}", b"%d" % round_)
                    assert open_files() <= 2 * 4
            for q in range(12):
                assert [m.body for m in await drain(b, f"q{q}")] == [b"0", b"1", b"2"]
        finally:
            await b.close()

    asyncio.run(main())


@pytest.mark.parametrize("name", NAMES)
def test_old_log_files_are_removed(name: str, tmp_path: Path) -> None:
    async def body(b: _BdbBackend) -> None:
        for i in range(4000):
            await put(b, "q", b"%05d" % i + b"x" * 1000, sync=ALWAYS)
        await drain(b, "q")

    session(name, tmp_path, body, log_file_mb=1)
    logs = [p for p in tmp_path.iterdir() if p.name.startswith("log.")]
    assert len(logs) <= 2


@pytest.mark.parametrize("zero", [True, False])
def test_log_files_are_zeroed_full_size_when_started(zero: bool, tmp_path: Path) -> None:
    async def body(b: _BdbBackend) -> None:
        await put(b, "q", b"one", sync=ALWAYS)

    session("bdb-single", tmp_path, body, log_file_mb=1, zero_log_files=zero)
    (log_file,) = (p for p in tmp_path.iterdir() if p.name.startswith("log."))
    full = log_file.stat().st_size >= 1 << 20
    assert full == zero


@pytest.mark.parametrize("name", NAMES)
def test_large_messages_round_trip(name: str, tmp_path: Path) -> None:
    big = bytes(range(256)) * 4096  # 1 MiB

    async def first(b: _BdbBackend) -> None:
        for i in range(3):
            await b.put("q", Message(big[i:] + big[:i]), sync=ALWAYS)

    async def second(b: _BdbBackend) -> None:
        got = sorted(m.body for m in await drain(b, "q"))
        assert got == sorted(big[i:] + big[:i] for i in range(3))

    session(name, tmp_path, first)
    session(name, tmp_path, second)


async def _put_kept(b: _BdbBackend) -> None:
    await put(b, "q", b"kept")


async def _still_kept(b: _BdbBackend) -> None:
    assert [m.body for m in await drain(b, "q")] == [b"kept"]


@pytest.mark.parametrize(
    ("wrote", "opened"),
    [("bdb", "bdb-single"), ("bdb-single", "bdb-random"), ("bdb-random", "bdb")],
)
def test_a_data_directory_opens_with_its_own_layout_only(
    wrote: str, opened: str, tmp_path: Path
) -> None:
    """Another layout would find the queues empty: it is refused, and nothing is changed."""
    session(wrote, tmp_path, _put_kept)
    assert (tmp_path / "layout").read_text() == wrote + "\n"
    before = files(tmp_path)
    with pytest.raises(StorageError, match=f"holds the queues of backend {wrote}, not of {opened}"):
        session(opened, tmp_path, _put_kept)
    assert files(tmp_path) == before
    session(wrote, tmp_path, _still_kept)


@pytest.mark.parametrize(
    ("wrote", "opened"),
    # bdb's catalog.db tells it; bdb-single's and bdb-random's queues.db, its message records.
    [("bdb", "bdb-random"), ("bdb-single", "bdb-random"), ("bdb-random", "bdb-single")],
)
def test_a_directory_from_before_the_layout_file_is_told_by_its_files(
    wrote: str, opened: str, tmp_path: Path
) -> None:
    session(wrote, tmp_path, _put_kept)
    (tmp_path / "layout").unlink()
    with pytest.raises(StorageError, match=f"holds the queues of backend {wrote}, not of {opened}"):
        session(opened, tmp_path, _put_kept)
    assert not (tmp_path / "layout").exists()
    session(wrote, tmp_path, _still_kept)
    assert (tmp_path / "layout").read_text() == wrote + "\n"


@pytest.mark.parametrize(
    ("wrote", "opened"), [("bdb-single", "bdb-random"), ("bdb-random", "bdb-single")]
)
def test_an_unmarked_single_file_without_messages_goes_to_the_first_to_open_it(
    wrote: str, opened: str, tmp_path: Path
) -> None:
    session(wrote, tmp_path, _put_kept)
    session(wrote, tmp_path, _still_kept)  # no message left: either layout reads it alike
    (tmp_path / "layout").unlink()
    session(opened, tmp_path, _empty)
    assert (tmp_path / "layout").read_text() == opened + "\n"


async def _empty(b: _BdbBackend) -> None:
    assert await b.take("q", sync=ALWAYS) is None
