"""Berkeley DB and OS errors as the StorageError a caller is answered with."""

from __future__ import annotations

import errno
from typing import Any

from berkeleydb import db

from mqd.errors import StorageError

_REASONS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EIO: "I/O error",
    errno.EMFILE: "too many open files",
    errno.ENFILE: "too many open files",
    errno.EISDIR: "a directory is in the way",
    errno.ENOMEM: "out of memory",
    errno.EFBIG: "file too large",
}


def storage_error(exc: BaseException) -> StorageError:
    """The StorageError to answer for `exc`, with a short reason fit for a reply line."""
    if isinstance(exc, StorageError):
        return exc
    code: Any = None
    if isinstance(exc, db.DBError) and exc.args:
        code = exc.args[0]
    elif isinstance(exc, OSError):
        code = exc.errno
    reason = _REASONS.get(code) if isinstance(code, int) else None
    if reason is None:
        if isinstance(exc, db.DBRunRecoveryError):
            reason = "database needs recovery"
        elif isinstance(exc, db.DBLockNotGrantedError | db.DBLockDeadlockError):
            reason = "lock timeout"
        else:
            detail = exc.args[-1] if isinstance(exc, db.DBError) and exc.args else exc
            reason = f"storage error: {detail}"
    text = "".join(c if c.isprintable() else " " for c in reason)
    error = StorageError(text[:200])
    error.__cause__ = exc
    return error
