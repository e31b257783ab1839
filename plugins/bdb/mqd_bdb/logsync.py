"""Syncs of the log that leave the event loop free: Linux AIO's fdatasync.

A round's `always` replies wait until the log is on disk (mqd_bdb.worker).
Synced on the event loop, each sync stops every connection for as long as the
disk takes; synced on a thread, the answer comes back through the GIL, which a
busy loop holds. Linux AIO (io_submit of IOCB_CMD_FDSYNC, kernel 4.18 and
later) has a kernel worker sync the file while the loop goes on, and signals
the end on an eventfd the loop watches: no Python thread is woken at all.

Commits write the log to the OS (DB_TXN_WRITE_NOSYNC), so an fdatasync of the
file the last commit went to puts a round on disk. Berkeley DB syncs a log
file itself before it starts the next one (__log_newfile flushes the log
first), so the earlier files need nothing; the old file is synced once more
anyway when the syncs move on, which costs next to nothing then.

Written with ctypes rather than a binding: the one there is (python-libaio)
loads the system's libaio, packaged under different names across Debian
releases (libaio1, libaio1t64), and spends more per submit than the system
call itself, where all this needs is three system calls on one fixed structure.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import platform
import struct
from collections.abc import Callable
from typing import Any, Final

log = logging.getLogger("mqd.bdb")

#: io_setup, io_destroy, io_getevents, io_submit, by machine (asm-generic for arm64).
_CALLS: Final = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
IOCB_CMD_FDSYNC: Final = 3
IOCB_FLAG_RESFD: Final = 1  # signal the end on aio_resfd (an eventfd)
#: struct iocb (64 bytes): data, key, rw_flags, opcode, reqprio, fildes,
#: buf, nbytes, offset, reserved2, flags, resfd.
_IOCB: Final = struct.Struct("=QIiHhIQQqQII")
#: struct io_event (32 bytes): data, obj, res, res2.
_EVENT: Final = struct.Struct("=QQqq")
_EVENTS: Final = 4  # the most completions read at once (one sync is in flight at a time)
#: What io_submit answers where the kernel or the file system cannot do it.
UNSUPPORTED: Final = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM})

#: Called on the event loop when a sync ends: (its number, None or the OSError).
Done = Callable[[int, OSError | None], None]


class LogSync:
    """fdatasync of the log file the last commit went to, answered on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, done: Done) -> None:
        calls = _CALLS.get(platform.machine())
        if calls is None:
            raise OSError(errno.ENOSYS, f"no Linux AIO system calls known for {platform.machine()}")
        self._setup, self._destroy, self._getevents, self._submit = calls
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall
        self._syscall.restype = ctypes.c_long
        self.loop = loop
        self.done = done
        self._ctx = ctypes.c_ulong(0)
        self._call(self._setup, 1, ctypes.byref(self._ctx))
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._iocb = ctypes.create_string_buffer(_IOCB.size)
        self._iocbs = (ctypes.c_void_p * 1)(ctypes.addressof(self._iocb))
        self._events = ctypes.create_string_buffer(_EVENT.size * _EVENTS)
        self._file = 0  # the log file's number
        self._fd = -1  # and a descriptor of it, opened to sync it
        self._next = ""  # the path of the file after it
        self.in_flight = 0
        loop.add_reader(self._efd, self._reap)

    @classmethod
    def open(cls, loop: asyncio.AbstractEventLoop, done: Done) -> LogSync | None:
        """One, or None (logged) where the kernel offers no Linux AIO."""
        try:
            return cls(loop, done)
        except OSError as exc:
            log.warning("log syncs on the event loop or the sync thread: no Linux AIO (%s)", exc)
            return None

    def _call(self, number: int, *args: Any) -> int:
        result: int = self._syscall(number, *args)
        if result < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        return result

    def follow(self, env: Any) -> None:
        """Aim at the log file the last commit was written to (the store's lock held).

        Until the next file exists, that is the one aimed at: whether it does
        is a stat, far cheaper than log_stat() every round, which is asked
        only then (and the first time) which file the log is in: its
        `cur_file`, where records are being written. Not `disk_file`: that is
        where Berkeley DB last synced the log itself, and as commits do not
        sync, it stays in the old file after a switch until Berkeley DB next
        syncs for reasons of its own; syncing that file would leave the
        rounds written since the switch unsynced.
        """
        if self._fd >= 0 and not os.access(self._next, os.F_OK):
            return
        number = env.log_stat()["cur_file"]
        if number == self._file:
            return
        fd = os.open(env.log_file((number, 0)), os.O_RDONLY | os.O_CLOEXEC)
        self._next = env.log_file((number + 1, 0))
        old, self._fd, self._file = self._fd, fd, number
        if old >= 0:
            try:
                os.fdatasync(old)
            finally:
                os.close(old)

    def submit(self, number: int) -> None:
        """Start the sync of what the log file holds now; `done(number, ...)` when it ends.

        Raises OSError if the kernel refuses (UNSUPPORTED: it never will).
        """
        _IOCB.pack_into(
            self._iocb, 0, number, 0, 0, IOCB_CMD_FDSYNC, 0, self._fd,
            0, 0, 0, 0, IOCB_FLAG_RESFD, self._efd,
        )  # fmt: skip
        self._call(self._submit, self._ctx, 1, self._iocbs)
        self.in_flight += 1

    def _reap(self, wait: bool = False) -> None:
        """Answer the syncs that ended (`wait`: block until one has)."""
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            if not wait:
                return
        got = self._call(self._getevents, self._ctx, int(wait), _EVENTS, self._events, None)
        for index in range(got):
            number, _, res, _ = _EVENT.unpack_from(self._events, index * _EVENT.size)
            self.in_flight -= 1
            self.done(number, None if res >= 0 else OSError(-res, os.strerror(-res)))

    def close(self) -> None:
        """Answer the sync still in flight, if any, then let go of the kernel's context."""
        self.loop.remove_reader(self._efd)
        try:
            while self.in_flight:
                self._reap(wait=True)
        finally:
            os.close(self._efd)
            if self._fd >= 0:
                os.close(self._fd)
            # Its only failure, a context already gone, leaves nothing to undo.
            self._syscall(self._destroy, self._ctx)
