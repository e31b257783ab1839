"""`bdb-single`: every queue in the catalog's one B-tree, keyed by (queue, offset)."""

from __future__ import annotations

from mqd_bdb.catalog import QueueState
from mqd_bdb.fifo import FifoStore
from mqd_bdb.records import MSG, UNIQ


class SingleStore(FifoStore):
    """`bdb-single`: every queue's messages and digests in the catalog's one B-tree."""

    layout_name = "bdb-single"

    def _make_queue(self, name: str, raw: bytes, qid: int) -> QueueState:
        q = QueueState(name, raw, qid)
        q.mdb = q.udb = self.cat
        q.mpre = MSG + q.qkey
        q.upre = UNIQ + q.qkey
        return q
