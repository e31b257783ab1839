"""The life cycle of one Berkeley DB environment: lock, open, recover, close.

flush(), trickle(), checkpoint(), log_end() and log_files() are the only
calls made from the keeper thread; they use the environment alone (opened
DB_THREAD), never a database handle, which stay on the worker thread.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from berkeleydb import db

from mqd.config import DAEMON_ID_FILE, lock_exclusive
from mqd.errors import StorageError
from mqd_bdb.config import BdbConfig
from mqd_bdb.errors import storage_error
from mqd_bdb.records import DIGEST_SIZE, MSG, QID, U64, UNIQ
from mqd_bdb.space import RESERVE_FILE, Space, is_disk_full, no_room

LAYOUT_FILE = "layout"  # in data_dir: the backend whose layout wrote it (Environment)

ENV_FLAGS = (
    db.DB_CREATE
    | db.DB_INIT_TXN
    | db.DB_INIT_LOG
    | db.DB_INIT_LOCK
    | db.DB_INIT_MPOOL
    | db.DB_RECOVER  # replay the log: every file consistent whatever the last exit
    | db.DB_PRIVATE  # one process; regions in its memory, no stale region files
    | db.DB_THREAD  # the keeper thread syncs and checkpoints beside the worker
)


class Environment:
    """One environment in `data_dir`, held by this process alone, and its catalog file."""

    #: The catalog's file (shared with the messages in the single-file layouts).
    catalog_file: ClassVar[str] = "queues.db"
    #: The backend whose layout this is, kept in the data directory's `layout`
    #: file: another layout would open the directory and find its queues empty.
    layout_name: ClassVar[str] = ""

    def __init__(self, data_dir: Path, config: BdbConfig) -> None:
        self.data_dir = data_dir
        self.config = config
        self.env: Any = None
        self.cat: Any = None
        self.panicked = False
        self.space = Space(data_dir, config.reserve_bytes, config.max_disk_bytes)
        self._lock_fd: int | None = None
        self._layout_unknown = False  # an unmarked queues.db: which layout, its records say

    def open(self) -> None:
        """Open (creating, recovering) the environment and load what it holds."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            self._check_layout()
            try:
                self._open_env()
            except Exception as exc:
                # Recovery writes to the log too: on a full disk, spend the
                # reserve on it and try once more.
                if not (self.disk_full(exc) and self.space.release()):
                    raise
                self._close_env()
                self._open_env()
            if self._layout_unknown:
                self._check_single_file_layout()
            self.space.dirty = self.dirty_bytes
            self.space.start(lambda: self.checkpoint(True))
        except BaseException as exc:
            self._close_env()
            self._unlock()
            if isinstance(exc, Exception) and self.disk_full(exc):
                raise StorageError(
                    f"no space left on device (ENOSPC) in {self.data_dir}: free some, "
                    "then start again"
                ) from exc
            if isinstance(exc, db.DBRunRecoveryError) and (damaged := self._damaged_files()):
                raise StorageError(
                    "database needs recovery, and recovery failed on "
                    + ", ".join(str(path) for path in damaged)
                    + " (Berkeley DB's verification finds it truncated or damaged):"
                    " restore it from a backup, or move it aside (what it held is lost),"
                    " then start again"
                ) from exc
            raise

    def _damaged_files(self) -> list[Path]:
        """The database files of data_dir that fail Berkeley DB's verification.

        For a recovery that failed: Berkeley DB names the file only on its
        error stream, which the binding does not expose. Each file is read
        whole, which is what a start that cannot go on may spend.
        """
        others = {LAYOUT_FILE, DAEMON_ID_FILE, RESERVE_FILE, "LOCK"}
        damaged = []
        for path in sorted(self.data_dir.iterdir()):
            name = path.name
            if name in others or name.startswith(("log.", "__db.")) or not path.is_file():
                continue
            handle = db.DB()  # verify() closes it, whatever it finds
            try:
                handle.verify(str(path))
            except db.DBError:
                damaged.append(path)
        return damaged

    def dirty_bytes(self) -> int:
        """Bytes of the cache's dirty pages: they reach the files at the next checkpoint."""
        try:
            totals, files = self.env.memp_stat()
        except db.DBError:
            return 0  # a panicked environment: the put that asked fails on its own
        page = max((f["pagesize"] for f in files.values()), default=totals["pagesize"])
        return int(totals["page_dirty"]) * int(page)

    def disk_full(self, exc: BaseException) -> bool:
        """Whether `exc` comes of a full disk.

        Not only ENOSPC: Berkeley DB may call it a panic, or, when the cache
        is all dirty pages it cannot write out, an I/O error ("unable to
        allocate space from the buffer cache"); on a file system with no room
        left, those are the full disk too. So they are once the reserve is out:
        the room its release made (another thread may have released it just
        now) says nothing of the write that failed.
        """
        return (
            is_disk_full(exc)
            or self.space.out
            or no_room(self.data_dir, self.config.log_buffer_kb << 10)
        )

    def close(self) -> None:
        """Checkpoint and close everything; raises the first error met, after trying all."""
        first: BaseException | None = None
        try:
            if self.env is not None and not self.panicked:
                self.env.txn_checkpoint(0, 0, db.DB_FORCE)
        except Exception as exc:
            first = exc
        error = self._close_env()
        self._unlock()
        if first is not None or error is not None:
            raise storage_error(first or error)  # type: ignore[arg-type]

    def recover(self) -> None:
        """After a panic: close and open again, running recovery."""
        self._close_env()
        self._open_env()
        self.panicked = False

    def _lock(self) -> None:
        self._lock_fd = lock_exclusive(
            self.data_dir / "LOCK", f"data directory {self.data_dir} is in use by another process"
        )

    def _check_layout(self) -> None:
        """Refuse a data directory that another layout's backend wrote; mark a new one.

        A directory from before that file existed is told by its catalog's file:
        `catalog.db` is bdb's, `queues.db` is bdb-single's or bdb-random's
        (which one, its records tell once the environment is open:
        _check_single_file_layout).
        """
        if not self.layout_name:
            return
        marker = self.data_dir / LAYOUT_FILE
        try:
            found = marker.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            found = ""
        except UnicodeDecodeError:
            raise StorageError(
                f"{marker}: not UTF-8 text; it names the backend that wrote this "
                "directory (bdb, bdb-single or bdb-random)"
            ) from None
        if not found:
            per_queue = (self.data_dir / "catalog.db").exists()
            single_file = (self.data_dir / "queues.db").exists()
            if per_queue and single_file:
                return  # both: put together by hand; left as it is
            if per_queue:
                found = "bdb"
            elif single_file:
                if self.layout_name != "bdb":
                    self._layout_unknown = True  # bdb-single's or bdb-random's
                    return
                found = "bdb-single or bdb-random"
            else:
                found = self.layout_name  # a new directory
            if found == self.layout_name:
                marker.write_text(self.layout_name + "\n")
        if found != self.layout_name:
            raise self._other_layout(found)

    def _check_single_file_layout(self) -> None:
        """Tell an unmarked `queues.db` as bdb-single's or bdb-random's; refuse or mark it.

        By the key of its first message record: (queue id, offset) in
        bdb-single, (queue id, body digest) in bdb-random; a copy of a body
        (UNIQ) is bdb-single's alone. Without messages either opens it alike.
        """
        self._layout_unknown = False
        cursor = self.cat.cursor()
        try:
            first = cursor.set_range(MSG)
        finally:
            cursor.close()
        found = self.layout_name
        if first is not None:
            key = first[0]
            if key.startswith(UNIQ) or (
                key.startswith(MSG) and len(key) == len(MSG) + QID.size + U64.size
            ):
                found = "bdb-single"
            elif key.startswith(MSG) and len(key) == len(MSG) + QID.size + DIGEST_SIZE:
                found = "bdb-random"
        if found != self.layout_name:
            raise self._other_layout(found)
        (self.data_dir / LAYOUT_FILE).write_text(self.layout_name + "\n")

    def _other_layout(self, found: str) -> StorageError:
        return StorageError(
            f"data directory {self.data_dir} holds the queues of backend {found}, "
            f"not of {self.layout_name}: start it with that backend, or give "
            f"{self.layout_name} a data directory of its own"
        )

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _open_env(self) -> None:
        c = self.config
        env = db.DBEnv()
        cache = c.cache_mb << 20
        env.set_cachesize(cache >> 30, cache & ((1 << 30) - 1), 1)
        env.set_lg_bsize(c.log_buffer_kb << 10)
        env.set_lg_max(c.log_file_mb << 20)
        env.set_lk_max_locks(c.max_locks)
        env.set_lk_max_objects(c.max_locks)
        # Commits write the log to the OS but do not sync it: it is synced once
        # per batch or round (group commit) for the callers that asked for it.
        env.set_flags(db.DB_TXN_WRITE_NOSYNC, 1)
        env.log_set_config(db.DB_LOG_AUTO_REMOVE, 1)
        env.log_set_config(db.DB_LOG_ZERO, int(c.zero_log_files))
        # The store is used by one thread at a time (Worker.lock), so a lock wait
        # can only be for a lock that thread holds in another transaction: fail
        # it rather than hang.
        env.set_timeout(2_000_000, db.DB_SET_LOCK_TIMEOUT)
        self.env = env
        env.open(str(self.data_dir), ENV_FLAGS, 0o600)
        self.cat = self._open_db(self.catalog_file, db.DB_BTREE)
        self._load()

    def _close_env(self) -> BaseException | None:
        first: BaseException | None = None
        for handle in self._handles():
            try:
                handle.close(db.DB_NOSYNC)
            except Exception as exc:
                first = first or exc
        self.cat = None
        self._forget_handles()
        if self.env is not None:
            try:
                self.env.close()
            except Exception as exc:
                first = first or exc
            self.env = None
        return first

    def _load(self) -> None:
        """Read what the catalog holds (after the environment opened)."""

    def _handles(self) -> Iterable[Any]:
        """Every open database handle, catalog last."""
        return [] if self.cat is None else [self.cat]

    def _forget_handles(self) -> None:
        """The handles _handles() gave were closed: drop every reference to them."""

    def _open_db(self, filename: str, dbtype: int) -> Any:
        handle = db.DB(self.env)
        try:
            if self.config.page_size:
                handle.set_pagesize(self.config.page_size)
            handle.open(filename, None, dbtype, db.DB_CREATE | db.DB_AUTO_COMMIT, 0o600)
        except BaseException:
            handle.close()
            raise
        return handle

    # -- upkeep (also from the keeper thread) ----------------------------------

    def flush(self) -> None:
        """Force the log to stable storage: the one sync of a batch."""
        self.env.log_flush()

    def trickle(self, percent: int) -> None:
        """Write dirty pages out until `percent` of the cache is clean."""
        self.env.memp_trickle(percent)

    def checkpoint(self, force: bool, log_mb: int | None = None) -> None:
        """Write dirty pages and a checkpoint if `log_mb` (default: checkpoint_mb;
        0: any) of log has accumulated since the last one, or if `force`; remove
        the log files it leaves unneeded.

        DB_LOG_AUTO_REMOVE alone removes them only when the log moves to a new
        file: after a drain, with nothing more written, they would stay.
        """
        if force:
            self.env.txn_checkpoint(0, 0, db.DB_FORCE)
        else:
            mb = self.config.checkpoint_mb if log_mb is None else log_mb
            self.env.txn_checkpoint(mb << 10, 0)
        self.env.log_archive(db.DB_ARCH_REMOVE)

    def log_end(self) -> tuple[int, int]:
        """Where the log ends (file, offset): unchanged between two looks, nothing was written."""
        stat = self.env.log_stat()
        return stat["cur_file"], stat["cur_offset"]

    def log_files(self) -> int:
        """How many log files there are, the current one among them."""
        return len(self.env.log_archive(db.DB_ARCH_LOG))
