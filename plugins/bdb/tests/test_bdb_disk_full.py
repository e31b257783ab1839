"""A real daemon on a full disk: gets and deletes free space, sets are refused, restart works."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from pathlib import Path

import pytest
from bdb_helpers import NAMES, drain, fill_up, make, put, session, small_disk
from mqd_bdb.backend import _BdbBackend
from mqd_bdb.space import OVER, Space, put_cost
from pymemcache.client.base import Client
from pymemcache.exceptions import MemcacheServerError

from mqd.backend import Sync
from mqd.errors import StorageError
from mqd.testing.daemon import Daemon

SMALL = "cache_mb = 4\nlog_file_mb = 1\ncheckpoint_mb = 1\n"  # a 6 MiB reserve: cache + 2 log files
BODY = b"x" * 4000


def config(name: str, extra: str = "", storage: str = "") -> str:
    return (
        f'[storage]\n{storage}\n[queues."*"]\nsync = "always"\n\n[storage.{name}]\n{SMALL}{extra}'
    )


def data_bytes(data_dir: Path) -> int:
    """Blocks the data directory's files hold, the reserve aside.

    A file listed may be gone when it is looked at (a checkpoint removes old
    log files meanwhile): it then holds nothing.
    """
    total = 0
    for path in data_dir.iterdir():
        if path.name != "reserve" and path.is_file():
            with contextlib.suppress(FileNotFoundError):
                total += path.stat().st_blocks * 512
    return total


def listing(data_dir: Path) -> str:
    """Each file of the data directory with the bytes it holds: what a failure kept."""
    held = []
    for path in sorted(data_dir.iterdir()):
        with contextlib.suppress(FileNotFoundError):
            held.append(f"{path.name} {path.stat().st_blocks * 512}")
    return ", ".join(held)


def fill(client: Client, queue: str, ids: itertools.count[int]) -> tuple[int, str]:
    """Set unique bodies until refused; (how many were STORED, the refusal)."""
    for stored in range(100_000):
        try:
            client.set(queue, b"%08d" % next(ids) + BODY, noreply=False)
        except MemcacheServerError as exc:
            reply = exc.args[0]
            return stored, reply.decode() if isinstance(reply, bytes) else str(reply)
    raise AssertionError("the disk never filled")


@pytest.mark.parametrize("name", NAMES)
def test_full_disk_still_serves_gets_deletes_and_restarts(name: str, tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", "24m") as disk:
        daemon = Daemon(disk, backend=name, config_text=config(name))
        with daemon:
            assert (daemon.data_dir / "reserve").stat().st_blocks * 512 >= 6 << 20
            client = Client(daemon.address, timeout=10)
            ids = itertools.count()
            client.set("other", b"o" * 1000, noreply=False)
            stored, refusal = fill(client, "q", ids)
            assert stored > 500 and refusal == "disk full"
            assert not (daemon.data_dir / "reserve").exists()  # spent on what follows
            # What frees space works; sets stay refused meanwhile.
            assert client.get("q") is not None
            assert client.get("q/open") is not None
            assert client.get("q/close") is None
            assert client.delete("other", noreply=False)
            with pytest.raises(MemcacheServerError, match="disk full"):
                client.set("q", b"more", noreply=False)
            taken = 2
            while client.get("q") is not None:
                taken += 1
            assert taken == stored
            # Drained, the queue gives its space back, and the reserve returns
            # (within 30 s: on a loaded machine the checkpoint that frees the
            # log files can take several of the worker's looks).
            for _ in range(300):
                if (daemon.data_dir / "reserve").exists() and data_bytes(daemon.data_dir) < 4 << 20:
                    break
                client.get("q")  # each command gives the worker a turn to look
                time.sleep(0.1)
            assert (daemon.data_dir / "reserve").exists()
            assert data_bytes(daemon.data_dir) < 4 << 20, listing(daemon.data_dir)
            client.set("q", b"after", noreply=False)
            # Another writer fills the disk, then a crash: the restart recovers,
            # and gets run in the reserve's room.
            fill_up(disk / "filler")
            daemon.kill()
            daemon.start()
            client = Client(daemon.address, timeout=10)
            assert client.get("q") == b"after"
            # Full again (recovery's checkpoint may have removed a log file):
            # sets are stored while the log file, written full of zeros when
            # it was started, has room, and refused once the log must grow.
            fill_up(disk / "filler2")
            stored, refusal = fill(client, "q", ids)
            assert refusal == "disk full"
            (disk / "filler").unlink()
            (disk / "filler2").unlink()
            got = [client.get("q") for _ in range(stored + 1)]
            assert None not in got[:stored] and got[stored] is None


def test_start_on_a_full_disk_names_enospc_and_the_path(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", "16m") as disk:
        # Log files not written full of zeros ahead: recovery's log records
        # then need room (in a zeroed one they fit, and the start succeeds).
        daemon = Daemon(disk, backend="bdb", config_text=config("bdb", "zero_log_files = false\n"))
        with daemon:
            Client(daemon.address, timeout=10).set("q", b"kept", noreply=False)
        (daemon.data_dir / "reserve").unlink()
        fill_up(disk / "filler")
        with pytest.raises(RuntimeError) as failed:
            daemon.start()
        log = daemon.log()
        assert f"Error: no space left on device (ENOSPC) in {daemon.data_dir}" in log, log[-2000:]
        assert "needs recovery" not in str(failed.value).splitlines()[-1]
        (disk / "filler").unlink()
        daemon.start()
        try:
            assert Client(daemon.address, timeout=10).get("q") == b"kept"
        finally:
            daemon.kill()


def test_the_byte_guard_skips_a_log_file_removed_while_it_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "queues.db"
    data.write_bytes(b"x" * 8192)
    old_log = tmp_path / "log.0000000001"
    old_log.write_bytes(b"x" * 8192)
    listed = os.scandir

    def scandir(path: Path) -> contextlib.nullcontext[list[os.DirEntry[str]]]:
        # As the keeper thread may: the old log file goes between the listing and its stat.
        with listed(path) as found:
            entries = list(found)
        old_log.unlink()
        return contextlib.nullcontext(entries)

    monkeypatch.setattr(os, "scandir", scandir)
    held = data.stat().st_blocks * 512
    space = Space(tmp_path, reserve=0, max_disk_bytes=held + put_cost(100))
    assert space.refusal(100) is None  # the vanished log counts as nothing
    assert space.refusal(1) == OVER  # and the database file is counted exactly


@pytest.mark.parametrize("name", NAMES)
def test_max_disk_bytes_refuses_sets_before_the_disk_fills(name: str, tmp_path: Path) -> None:
    limit = 4 << 20
    daemon = Daemon(
        tmp_path, backend=name, config_text=config(name, storage=f"max_disk_bytes = {limit}\n")
    )
    with daemon:
        client = Client(daemon.address, timeout=10)
        stored, refusal = fill(client, "q", itertools.count())
        assert refusal == "out of memory storing object"
        assert stored > 100
        # A checkpoint writes the cache's dirty pages to the files while the
        # log still holds them, and a log file may start before the old one
        # goes: the directory stays under the bound through those too, sampled
        # while sets keep coming (stored once a checkpoint frees room).
        peak = 0
        for _ in range(40):
            peak = max(peak, data_bytes(daemon.data_dir))
            with contextlib.suppress(MemcacheServerError):
                client.set("q", BODY, noreply=False)
            time.sleep(0.025)
        assert peak < limit, peak
        assert client.get("q") is not None
        assert client.delete("q", noreply=False)


@pytest.mark.parametrize("name", NAMES)
def test_once_the_writes_stop_the_log_files_go(name: str, tmp_path: Path) -> None:
    """With the default checkpoint_mb, a fill and drain of 6 MB leave a dozen
    1 MiB log files. Within seconds of the last write a checkpoint removes all
    but the current one: Berkeley DB's own removal waits for the log to move
    to a new file, which an idle daemon never does."""
    daemon = Daemon(
        tmp_path, backend=name, config_text=config(name).replace("checkpoint_mb = 1\n", "")
    )
    with daemon:
        client = Client(daemon.address, timeout=10)
        for i in range(750):
            client.set("q", b"%06d" % i + BODY, noreply=False)
        taken = sorted(client.get("q")[:6] for _ in range(750))  # bdb-random: any order
        assert taken == [b"%06d" % i for i in range(750)]
        for _ in range(150):
            logs = sorted(daemon.data_dir.glob("log.*"))
            if len(logs) == 1:
                break
            time.sleep(0.1)
        assert len(logs) == 1, logs
        assert client.get("q") is None


def test_a_trickle_within_one_log_file_takes_no_checkpoint_at_each_pause(
    tmp_path: Path,
) -> None:
    """The checkpoint once writes stop is for log files to remove: with the
    current file alone there is none, and a set every 1.5 s (looks every
    second) would otherwise checkpoint, syncing every file written, at each
    pause."""

    async def body(b: _BdbBackend) -> None:
        await put(b, "q", b"first")
        await asyncio.sleep(2.5)
        env = b.worker.store.env
        before = env.txn_stat()["last_ckp"]
        for i in range(4):
            await put(b, "q", b"%d" % i)
            await asyncio.sleep(1.5)
        assert len(list((tmp_path / "data").glob("log.*"))) == 1  # the premise
        assert env.txn_stat()["last_ckp"] == before

    session("bdb", tmp_path / "data", body)


@pytest.mark.parametrize("name", NAMES)
def test_a_drain_faster_than_the_checkpoint_clock_runs_in_the_reserves_room(
    name: str, tmp_path: Path
) -> None:
    """A take logs the body it removes. In process, draining a full disk writes
    more log than the reserve holds, most of it between two ticks of the
    checkpoint clock (half a second) on a machine that is not loaded: the
    checkpoints per log file written, and the checkpoint and retry on ENOSPC,
    keep it in the reserve's room."""
    with small_disk(tmp_path / "disk", "24m") as disk:

        async def main() -> None:
            # The default checkpoint_mb: 16 MiB of log may pile up before a checkpoint.
            b = make(name, disk / "data", log_file_mb=1, cache_mb=4)
            await b.open()
            try:
                stored = 0
                with contextlib.suppress(StorageError):
                    while True:
                        await put(b, "q", b"%06d" % stored + BODY)
                        stored += 1
                assert stored > 500 and not (disk / "data" / "reserve").exists()
                taken = await drain(b, "q")
                assert sorted(m.body[:6] for m in taken) == [b"%06d" % i for i in range(stored)]
                # The premise: the drain logged more than the reserve holds.
                assert len(taken) * len(BODY) > 6 << 20
            finally:
                await b.close()

        asyncio.run(main())


@pytest.mark.parametrize("name", NAMES)
def test_short_of_room_every_job_runs_in_the_worker_threads_batches(
    name: str, tmp_path: Path
) -> None:
    """Under the reserve twice over, nothing runs in an event loop's round (a
    take there that met ENOSPC could not be run again in the reserve's room);
    once room is back, rounds resume."""
    with small_disk(tmp_path / "disk", "24m") as disk:

        async def exchange(b: _BdbBackend) -> None:
            """A set and a get, each waiting for its sync."""
            assert await put(b, "q", b"x" * 100) is not None
            taken = await b.take("q", sync=Sync.ALWAYS)
            assert taken is not None and taken.body == b"x" * 100

        async def rounds_while(b: _BdbBackend, low: bool) -> int:
            """Exchange until the keeper has gauged the disk `low` or not (it
            looks every second while changes come); the rounds run meanwhile."""
            for _ in range(200):
                await exchange(b)
                if b.worker.store.space.low is low:
                    break
                await asyncio.sleep(0.02)
            assert b.worker.store.space.low is low
            while b.worker.lock.locked():
                await asyncio.sleep(0.001)
            before = b.worker.rounds
            for _ in range(20):
                await exchange(b)
            return b.worker.rounds - before

        async def main() -> None:
            b = make(name, disk / "data", log_file_mb=1, cache_mb=4)  # a 6 MiB reserve
            await b.open()
            try:
                assert await rounds_while(b, low=False) > 0  # the premise: rounds run
                st = os.statvfs(disk)
                with open(disk / "filler", "wb") as filler:
                    os.posix_fallocate(filler.fileno(), 0, st.f_bavail * st.f_frsize - (8 << 20))
                assert await rounds_while(b, low=True) == 0
                (disk / "filler").unlink()
                assert await rounds_while(b, low=False) > 0
            finally:
                await b.close()

        asyncio.run(main())
