"""Room on the disk: a reserve file for the work that frees space, a guard for puts.

Every change, a `get` or a `delete` included, writes the log first, so on a
full disk nothing could be taken or deleted: the disk would stay full. The
data directory therefore holds `reserve`, a file of `reserve_mb` allocated
blocks: room for the log and for the cache's dirty pages, which need disk
blocks of their own when they are written out. When a write meets ENOSPC
the file is removed and the work retried in the room it leaves; from then
on puts are refused (`disk full`) while everything else goes on. Once the
file system has room for the reserve twice over (drained queues give space
back, checkpoints remove old log files) it is allocated again and puts are
accepted.

`max_disk_bytes` bounds what the data directory may hold: puts are refused
with `out of memory storing object` (memcached's reply for a full cache)
once its files (the reserve aside), with what a checkpoint and the next log
file will add to them and what the puts since it was measured will add,
reach it.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from berkeleydb import db

log = logging.getLogger("mqd.bdb")

RESERVE_FILE = "reserve"
LOG_PREFIX = "log."  # Berkeley DB's log files: log.0000000001, ...
SCAN_S = 0.1  # the data directory's size is read again after this long
LOOK_S = 0.5  # while the reserve is out: how often to look for room again
FULL = "disk full"
OVER = "out of memory storing object"
# A record's key and headers, and its share of the index pages, more than
# enough: a 4,008-byte body fills a 4,096-byte overflow page.
RECORD_BYTES = 128


def put_cost(size: int) -> int:
    """Bytes a put of `size` body bytes adds before the next scan can see them.

    Its record goes to the log at once, and into a database page that a
    checkpoint writes to a file while the log still holds the record: twice.
    """
    return 2 * (size + RECORD_BYTES)


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` is ENOSPC (or a quota), from the OS or from Berkeley DB."""
    code = exc.args[0] if isinstance(exc, db.DBError) and exc.args else None
    if isinstance(exc, OSError):
        code = exc.errno
    if code in (errno.ENOSPC, errno.EDQUOT):
        return True
    cause = exc.__cause__
    return cause is not None and cause is not exc and is_disk_full(cause)


def no_room(data_dir: Path, need: int) -> bool:
    """Whether the file system of `data_dir` has less than `need` bytes free."""
    try:
        st = os.statvfs(data_dir)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < need


class Space:
    """The reserve file and the byte guard of one data directory."""

    def __init__(self, data_dir: Path, reserve: int, max_disk_bytes: int) -> None:
        #: Bytes of the cache's dirty pages, set once the environment is open.
        self.dirty: Callable[[], int] = lambda: 0
        self.path = data_dir / RESERVE_FILE
        self.data_dir = data_dir
        self.reserve = reserve
        self.max_disk_bytes = max_disk_bytes
        self.out = False  # the reserve was released: puts are refused
        # Short of room (less than the reserve twice over, or the reserve out
        # since the last gauge()): a write may meet ENOSPC, so every job runs
        # on the worker thread, whose batches free room and retry on ENOSPC.
        self.low = False
        self._used = 0  # the data directory's bytes at the last scan ...
        self._added = 0  # ... and what the puts since will add (put_cost)
        self._scanned = 0.0
        self._looked = 0.0

    def keep(self) -> None:
        """Allocate the reserve if it is missing and fits (at open, and once room is back)."""
        if not self.reserve:
            return
        try:
            if self.path.stat().st_blocks * 512 >= self.reserve:
                return
        except FileNotFoundError:
            pass
        if no_room(self.data_dir, 2 * self.reserve):
            return  # leave it out until the disk has room for more than the reserve
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.reserve)
            os.fsync(fd)
        except OSError:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            return
        os.close(fd)

    def start(self, checkpoint: Callable[[], None]) -> None:
        """At open: make the reserve; with no room for it, refuse puts until there is."""
        if not self.reserve or self.path.exists():
            self.keep()
        else:
            checkpoint()  # old log files go: room, perhaps
            self.keep()
            if not self.path.exists():
                self.out = True
                self._looked = time.monotonic()
                log.warning(
                    "no room for the %d MiB reserve in %s: refusing sets until there is",
                    self.reserve >> 20,
                    self.data_dir,
                )
        self.gauge()

    def release(self) -> bool:
        """The disk is full: remove the reserve; False if there was none to remove."""
        if self.out or not self.reserve:
            return False
        self.out = self.low = True
        self._looked = time.monotonic()
        try:
            self.path.unlink()
        except FileNotFoundError:
            return False
        log.warning(
            "disk full in %s: released the %d MiB reserve; refusing sets until there is room",
            self.data_dir,
            self.reserve >> 20,
        )
        return True

    def gauge(self) -> None:
        """Now and then (the keeper thread): whether the file system is short of room."""
        self.low = bool(self.reserve) and (self.out or no_room(self.data_dir, 2 * self.reserve))

    def refusal(self, size: int) -> str | None:
        """Why a put of `size` body bytes is refused now, or None."""
        if self.out:
            return FULL
        if not self.max_disk_bytes:
            return None
        now = time.monotonic()
        if now - self._scanned >= SCAN_S:
            self._used = self._scan()
            self._added = 0
            self._scanned = now
        cost = put_cost(size)
        if self._used + self._added + cost > self.max_disk_bytes:
            return OVER
        self._added += cost
        return None

    def look(self) -> bool:
        """While the reserve is out, now and then: True once it is back (puts accepted)."""
        now = time.monotonic()
        if not self.out or now - self._looked < LOOK_S:
            return False
        self._looked = now
        self.keep()
        if self.path.exists() and self.path.stat().st_blocks * 512 >= self.reserve:
            self.out = False
            log.warning("room again in %s: reserve restored, accepting sets", self.data_dir)
            return True
        return False

    def _scan(self) -> int:
        """Bytes the data directory's files (the reserve aside) hold, or soon will.

        Beyond what is allocated now, two things arrive without a put: the
        cache's dirty pages, written to the files at a checkpoint while the
        log still holds their records, and the next log file, which Berkeley
        DB starts (zeroed ahead, by default) before the old ones can go. So
        both are counted: the dirty pages, and room for one more log file as
        large as the largest there.
        """
        total = largest_log = 0
        with os.scandir(self.data_dir) as entries:
            for entry in entries:
                if entry.name != RESERVE_FILE and entry.is_file(follow_symlinks=False):
                    try:
                        size = entry.stat(follow_symlinks=False).st_blocks * 512
                    except FileNotFoundError:
                        continue  # a log file the keeper thread removed meanwhile
                    total += size
                    if entry.name.startswith(LOG_PREFIX):
                        largest_log = max(largest_log, size)
        return total + largest_log + self.dirty()
