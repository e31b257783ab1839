"""`bdb`: per queue a B-tree file of messages and a Hash file of body counts.

`delete` frees a queue's files at once; the least recently used queues' files
are closed beyond `max_open_queues`.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from berkeleydb import db

from mqd.errors import StorageError
from mqd_bdb import jobs
from mqd_bdb.catalog import CHUNK, QueueState
from mqd_bdb.config import BdbConfig
from mqd_bdb.fifo import FifoStore
from mqd_bdb.names import file_stem
from mqd_bdb.records import CAT_RESERVED, delete_range
from mqd_bdb.store import COMPACT_MIN_BYTES

log = logging.getLogger("mqd.bdb")


class PerQueueStore(FifoStore):
    """`bdb`: per queue a B-tree file of messages and a Hash file of body digests."""

    layout_name = "bdb"

    barrier_ops = frozenset({jobs.DELETE, jobs.EXPIRE_IDLE})  # dbremove needs handles closed
    files_per_queue = True
    catalog_file = "catalog.db"

    def __init__(self, data_dir: Path, config: BdbConfig) -> None:
        super().__init__(data_dir, config)
        self._lru: OrderedDict[str, QueueState] = OrderedDict()  # queues with open files

    def _make_queue(self, name: str, raw: bytes, qid: int) -> QueueState:
        q = QueueState(name, raw, qid)
        q.stem = file_stem(raw)
        return q

    def _open_env(self) -> None:
        super()._open_env()
        self._remove_orphans()

    def _handles(self) -> Iterable[Any]:
        handles = [h for q in self._lru.values() for h in (q.mdb, q.udb) if h is not None]
        self._lru.clear()
        return [*handles, *super()._handles()]

    def _used(self, q: QueueState) -> None:
        if self._lru.get(q.name) is q:
            self._lru.move_to_end(q.name)

    def _attach(self, q: QueueState) -> None:
        mdb = self._open_db(q.stem + ".btree", db.DB_BTREE)
        try:
            udb = self._open_db(q.stem + ".hash", db.DB_HASH)
        except BaseException:
            mdb.close(db.DB_NOSYNC)
            raise
        old = self._lru.pop(q.name, None)
        if old is not None and old is not q:
            _close_files(old)
        q.mdb, q.udb = mdb, udb
        self._lru[q.name] = q

    def _detach(self, q: QueueState) -> None:
        if self._lru.get(q.name) is q:
            del self._lru[q.name]
        _close_files(q)

    def trim(self) -> None:
        while len(self._lru) > self.config.max_open_queues:
            _close_files(self._lru.popitem(last=False)[1])

    def _compact(self, emptied: list[QueueState], freed: bool) -> None:
        # Compacting truncates the files, which costs a pass over the cache:
        # only files grown past a small size (a queue kept near empty is not).
        for q in emptied:
            btree, table = (self.data_dir / (q.stem + suffix) for suffix in (".btree", ".hash"))
            with contextlib.suppress(FileNotFoundError):
                if btree.stat().st_size + table.stat().st_size >= COMPACT_MIN_BYTES:
                    if q.mdb is None:
                        self._attach(q)
                    q.mdb.compact(flags=db.DB_FREE_SPACE)
                    q.udb.compact(flags=db.DB_FREE_SPACE)

    def _clear_index(self, txn: Any, q: QueueState, limit: int) -> int:
        q.udb.truncate(txn)  # the file holds this queue's counts only
        return 0

    def _remove_orphans(self) -> None:
        """Files of a queue whose creating batch failed: empty, and in no catalog entry.

        A queue file that holds messages is never removed: no catalog entry
        naming it means the catalog was removed or replaced by hand, and the
        start is refused, naming the file. A queue the catalog counts messages
        in whose B-tree file is gone was being deleted when the daemon died: a
        delete that a kill cuts off can leave the file removed while recovery
        brings the catalog entry back (seen under kill -9 while clients delete
        and make queues). That delete is finished here, with a warning naming
        the file: the files already show it done, and a delete not yet
        answered may have taken effect or not, as its client sees it.
        """
        known = {q.stem: q for q in self.queues.values()}
        present = set()
        orphans = []
        for path in self.data_dir.iterdir():
            stem, dot, suffix = path.name.rpartition(".")
            if not (dot and suffix in ("btree", "hash") and stem[:2] in ("q-", "h-")):
                continue
            if stem in known:
                present.add(path.name)
            else:
                if suffix == "btree" and self._holds_records(path.name):
                    raise StorageError(
                        f"{path} holds messages, but {self.data_dir / self.catalog_file} "
                        "names no queue for it (was the catalog removed or replaced?): "
                        "restore the catalog, or move the file away"
                    )
                orphans.append(path.name)
        for stem, q in known.items():
            if q.items and stem + ".btree" not in present:
                self._finish_delete(q, stem + ".hash" in present)
        for name in orphans:
            self.env.dbremove(name, None, None, db.DB_AUTO_COMMIT)

    def _finish_delete(self, q: QueueState, hashed: bool) -> None:
        log.warning(
            "%s is missing: queue %r (%d message(s) in %s) was being deleted when the "
            "daemon stopped; its delete is finished now",
            self.data_dir / (q.stem + ".btree"),
            q.name,
            q.items,
            self.catalog_file,
        )
        txn = self.env.txn_begin()
        try:
            if hashed:
                self.env.dbremove(q.stem + ".hash", None, txn)
            while delete_range(self.cat, txn, CAT_RESERVED + q.qkey, CHUNK):
                pass
            self._drop_catalog_entry(txn, q)
        except BaseException:
            txn.abort()
            raise
        txn.commit()
        self._unregister(q.name)

    def _holds_records(self, filename: str) -> bool:
        handle = db.DB(self.env)
        try:
            handle.open(filename, None, db.DB_BTREE, db.DB_RDONLY)
            cursor = handle.cursor()
            try:
                return cursor.first() is not None
            finally:
                cursor.close()
        except db.DBError:
            return False  # not a database that can be read: nothing to keep in it
        finally:
            handle.close()

    def delete(self, txn: Any, name: str, arg: None) -> bool:
        q = self.queues.get(name)
        if q is None:
            return False
        self._touch(q)
        if q.mdb is None:
            # Opened first: after crash recovery, a transactional remove of a
            # file no handle of this run has opened could fail on a log file
            # that is gone (ENOENT), until the queue was read once.
            self._attach(q)
        self._detach(q)
        self.env.dbremove(q.stem + ".btree", None, txn)
        self.env.dbremove(q.stem + ".hash", None, txn)
        while delete_range(self.cat, txn, CAT_RESERVED + q.qkey, CHUNK):
            pass
        self._drop_catalog_entry(txn, q)
        self._unregister(name)
        return True


def _close_files(q: QueueState) -> None:
    mdb, udb = q.mdb, q.udb
    q.mdb = q.udb = None
    for handle in (mdb, udb):
        if handle is not None:
            handle.close(db.DB_NOSYNC)
