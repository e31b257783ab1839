"""Berkeley DB storage for mqd: the `bdb`, `bdb-single` and `bdb-random` backends."""

from mqd_bdb.backend import BdbBackend, BdbRandomBackend, BdbSingleBackend

__all__ = ["BdbBackend", "BdbRandomBackend", "BdbSingleBackend"]
