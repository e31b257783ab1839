"""The round trips: a connected client, record keys, and the lock-write-commit cycle.

Everything here blocks and runs in the backend's worker threads, never on the
event loop. One cycle serves every operation pending for one queue shard:

1. **lock**: one atomic operation on the shard's metadata record takes its lock
   if it is free, expired, or left behind by this daemon's own failed cycle,
   raises the fencing counter, and reads the state; entries the dequeues will
   probably want are read in the same batch call;
2. the operations are applied to that state in memory (mqd_aerospike.shard);
3. entries still needed are read (one batch call);
4. **commit**: the new state is written and the lock released in one
   operation that the server refuses unless the lock is still ours, in the
   same batch call as the new entries' writes, each refused by its buffer
   record if a newer lock holder's fencing token is already there. A refused
   commit changed nothing (entries beyond the committed tail are invisible),
   so the cycle is simply run again.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Iterable
from typing import Any

import aerospike
from aerospike import exception as ae
from aerospike_helpers.batch.records import BatchRecords, Read, Write
from aerospike_helpers.expressions import arithmetic as xa
from aerospike_helpers.expressions import base as x
from aerospike_helpers.operations import expression_operations as xo
from aerospike_helpers.operations import operations as op

from mqd.errors import StorageError
from mqd.protocol import name_text
from mqd_aerospike.apply import Apply
from mqd_aerospike.config import AerospikeConfig
from mqd_aerospike.connection import (
    FILTERED_OUT,
    NOT_FOUND,
    Connection,
    get_slots,
    has_work,
    reason,
    slots_of,
)
from mqd_aerospike.ops import (
    DeleteOp,
    Op,
    PutOp,
    ReclaimOp,
)
from mqd_aerospike.shard import MAP_BINS, STATE_BINS, Memo, Meta

log = logging.getLogger(__name__)

DONE, BUSY, RETRY = "done", "busy", "retry"


def _lock_free(now_ms: int, previous: str) -> x._BaseExpr:
    lo = x.StrBin("lo")
    free = [x.Not(x.BinExists("lo")), x.Eq(lo, ""), x.LT(x.IntBin("lx"), now_ms)]
    if previous:
        free.append(x.Eq(lo, previous))
    return x.Or(*free)


class Store(Connection):
    """A connection and the cycles run over it."""

    def __init__(self, config: AerospikeConfig, owner: str) -> None:
        super().__init__(config, owner)
        #: Cycles whose lock was broken under them: commits refused, writes fenced off.
        self.refused = 0
        self.fenced = 0
        #: Lock nonces of this daemon's cycles that failed holding a lock.
        self._held: dict[tuple[bytes, int], str] = {}
        #: The state each shard was left in by this daemon's last cycle, to
        #: guess which entries the next dequeues will read.
        self._hints: Memo[tuple[bytes, int], tuple[int, int, tuple[int, ...], int, int]] = Memo()

    # -- the cycle -----------------------------------------------------------

    def cycle(self, name: bytes, shard: int, shards: int, ops: list[Op]) -> str:
        """Serve `ops` on one shard: DONE (results set), BUSY (lock held), RETRY (lock lost)."""
        now = time.time()
        now_ms = int(now * 1000)
        nonce = f"{self.owner}/{secrets.token_hex(6)}"
        where = (name, shard)
        creating = any(isinstance(o, PutOp) for o in ops)
        dequeues = sum(1 for o in ops if o.dequeue)
        meta_key = self.meta_key(name, shard)
        lock = self._lock_ops(nonce, now_ms, dequeues == len(ops), self._held.get(where), ops)
        policy = {} if creating else {"exists": aerospike.POLICY_EXISTS_UPDATE}
        prefetch = self._predict(where, dequeues)
        entries: dict[int, list[Any]] = {}
        # The fanout children are read in the same call as the lock.
        fanning = any(isinstance(o, PutOp) and o.fanout for o in ops)
        children: list[str] = []
        try:
            if prefetch or fanning:
                batch = [Write(meta_key, lock, policy=policy)]
                if fanning:
                    batch.append(Read(self.family_key(name), [op.read("kids")]))
                if prefetch:
                    # A guess made before the lock tells the incarnation: the one
                    # this daemon saw last. A wrong guess costs one more read later.
                    inc = self._hints[where][3]
                    batch += [
                        Read(self._buf_key(name, inc, shard, index), [get_slots(offsets)])
                        for index, offsets in prefetch.items()
                    ]
                results = self.call(self.client.batch_write, BatchRecords(batch)).batch_records
                first = results[0]
                if first.result == NOT_FOUND:
                    raise ae.RecordNotFound()
                if first.result != 0:
                    raise StorageError(reason(first.result, "lock"))
                bins = first.record[2]
                if fanning:
                    family = results[1]
                    if family.result not in (0, NOT_FOUND):
                        raise StorageError(f"aerospike: fanout read failed ({family.result})")
                    kids = family.record[2].get("kids") if family.result == 0 else None
                    children = sorted(name_text(bytes(k)) for k in kids or {})
                for found in results[1 + fanning :]:
                    # A prefetch that failed is read again once the lock is held.
                    if found.result == 0 and found.record is not None:
                        entries.update(slots_of(found.record[2].get("s")))
            else:
                bins = self.call(self.client.operate, meta_key, lock, policy=policy)[2]
        except ae.RecordNotFound:
            self._finish_missing(ops)
            return DONE
        if bins.get("lo") != nonce:
            if dequeues == len(ops) and not bins.get("work"):
                self._finish_missing(ops)
                return DONE
            return BUSY
        self._held[where] = nonce
        meta = Meta.from_bins(bins, name, shard)
        if meta is None:
            if not creating:
                self._commit(meta_key, nonce, {"lo": ""})
                self._held.pop(where, None)
                self._finish_missing(ops)
                return DONE
            meta = Meta.new(name, shard, shards, self.per)
        meta.fence = int(bins["fence"])
        meta.with_tags = any(isinstance(o, PutOp) and o.tag for o in ops)
        if entries and self._hints[where][3] != meta.inc:
            entries.clear()  # prefetched from an incarnation that is gone
        if meta.created and shard:
            self._ensure_first_shard(meta)
        run = Apply(self, meta, entries, now)
        for o in ops:
            run.apply(o)
        writes = run.prepare()
        old_head = meta.head
        meta.head = meta.low_water()
        deleting = any(isinstance(o, DeleteOp) and run.results.get(id(o)) for o in ops)
        try:
            if deleting:
                self._delete(meta_key, nonce, meta, old_head)
            else:
                self._commit(meta_key, nonce, {**meta.bins(now_ms), "lo": ""}, writes, run)
        except ae.FilteredOut:
            self.refused += 1
            log.warning("queue %r shard %d: commit refused, lock was broken", name, shard)
            self._held.pop(where, None)
            return RETRY
        self._held.pop(where, None)
        if deleting:
            self._hints.pop(where, None)
        else:
            self._hints[where] = (
                meta.per,
                meta.cur,
                tuple(sorted(meta.ret)[:64]),
                meta.inc,
                meta.tail,
            )
            self._collect(meta, old_head)
        for o in ops:
            o.result = run.results.get(id(o))
            o.shards = meta.shards
            if isinstance(o, PutOp) and o.fanout:
                o.children = children
        return DONE

    def _lock_ops(
        self, nonce: str, now_ms: int, dequeue_only: bool, previous: str | None, ops: list[Op]
    ) -> list[dict[str, Any]]:
        got = _lock_free(now_ms, previous or "")
        if dequeue_only:
            got = x.And(got, has_work())
        keep = x.Unknown()
        no_fail = aerospike.EXP_WRITE_EVAL_NO_FAIL
        fence = x.Cond(x.BinExists("fence"), xa.Add(x.IntBin("fence"), 1), 1)
        lease = now_ms + self.config.lock_lease_ms
        bins = STATE_BINS + tuple(b for b in MAP_BINS if b != "tags")
        if any(isinstance(o, PutOp) and o.tag for o in ops):
            bins += ("tags",)
        return [
            # The fencing counter first: `got` still sees the lock as it was.
            xo.expression_write("fence", x.Cond(got, fence, keep).compile(), no_fail),
            xo.expression_write("lo", x.Cond(got, nonce, keep).compile(), no_fail),
            xo.expression_write(
                "lx", x.Cond(x.Eq(x.StrBin("lo"), nonce), lease, keep).compile(), no_fail
            ),
            xo.expression_read("work", has_work().compile(), aerospike.EXP_READ_EVAL_NO_FAIL),
            *(op.read(b) for b in ("lo", "fence", *bins)),
        ]

    def _predict(self, where: tuple[bytes, int], dequeues: int) -> dict[int, list[int]]:
        """Buffer records (index -> offsets) the next `dequeues` will likely read."""
        hint = self._hints.get(where)
        if not dequeues or hint is None:
            return {}
        per, cur, ret, _inc, tail = hint
        # Only entries committed before this daemon's last commit: those can
        # no longer change, whatever happens to the lock meanwhile.
        fresh = range(cur, min(cur + max(dequeues - len(ret), 0), tail))
        offsets = [*ret[:dequeues], *fresh]
        by_record: dict[int, list[int]] = {}
        for offset in offsets:
            by_record.setdefault(offset // per, []).append(offset)
        return by_record

    def _finish_missing(self, ops: Iterable[Op]) -> None:
        for o in ops:
            o.result = [] if isinstance(o, ReclaimOp) else (None if o.dequeue else False)

    def _commit(
        self,
        key: Any,
        nonce: str,
        bins: dict[str, Any],
        writes: list[Write] | None = None,
        run: Apply | None = None,
    ) -> None:
        """Write the state and free the lock, refused unless the lock is still ours.

        The cycle's new entries go in the same batch call. The server applies
        a batch's records independently, so each outcome is looked at:
        - commit refused: the lock was broken; nothing this cycle wrote is
          visible (entries past the committed tail are never read): FilteredOut.
        - commit made, an entry's record refused the write (fenced off by a
          newer lock holder: the lease ran out while the call was on its way)
          or failed: that set gets SERVER_ERROR, never STORED, and its offset
          is a hole readers pass over (HoleOp corrects the counters).
        """
        policy = {"expressions": x.Eq(x.StrBin("lo"), nonce).compile()}
        ops = [op.write(name, value) for name, value in bins.items()]
        if not writes or run is None:
            self.call(self.client.operate, key, ops, policy=policy)
            return
        batch = [Write(key, ops, policy=policy), *writes]
        done = self.call(self.client.batch_write, BatchRecords(batch)).batch_records
        commit, entries = done[0], done[1:]
        fenced = any(r.result == FILTERED_OUT for r in entries)
        if fenced:
            self.fenced += 1
            log.warning("queue %r: write fenced off, lock was broken", bins["qn"])
        if commit.result == FILTERED_OUT:
            raise ae.FilteredOut()
        if commit.result != 0:
            raise StorageError(reason(commit.result, "commit"))
        for write, record in zip(writes, entries, strict=True):
            if record.result != 0:
                run.lost(write.key, record.result, record.in_doubt)

    def _ensure_first_shard(self, meta: Meta) -> None:
        """A queue is listed by its shard 0: make it exist when another shard is created."""
        first = Meta(meta.name, 0, meta.shards, secrets.randbits(62) + 1, meta.per)
        with contextlib.suppress(ae.RecordExistsError):
            self.call(
                self.client.put,
                self.meta_key(meta.name, 0),
                first.bins(0),
                policy={"exists": aerospike.POLICY_EXISTS_CREATE},
            )

    def _records(self, meta: Meta, low: int, high: int) -> list[Any]:
        """Keys of the buffer records holding offsets low..high-1, and the record
        `low` is in even when that range is empty: with `low` inside it, it
        holds the entries before `low`, taken but not yet collected (_collect
        removes a record only once the head has left it)."""
        per = meta.per
        first = low // per
        last = max((high + per - 1) // per, first + (1 if low % per else 0))
        return [self.buf_key(meta, i) for i in range(first, last)]

    def _collect(self, meta: Meta, old_head: int) -> None:
        """Remove buffer records the head has left behind."""
        first, last = old_head // meta.per, meta.head // meta.per
        if last > first:
            keys = [self.buf_key(meta, i) for i in range(first, last)]
            try:
                self.call(self.client.batch_remove, keys)
            except StorageError as error:  # left for the queue's delete; counted as garbage
                log.warning("could not remove %d used buffer record(s): %s", len(keys), error)

    def _delete(self, key: Any, nonce: str, meta: Meta, old_head: int) -> None:
        policy = {"expressions": x.Eq(x.StrBin("lo"), nonce).compile()}
        self.call(self.client.remove, key, policy=policy)
        keys = self._records(meta, min(old_head, meta.head), meta.tail)
        for i in range(0, len(keys), 5000):
            self.call(self.client.batch_remove, keys[i : i + 5000])
