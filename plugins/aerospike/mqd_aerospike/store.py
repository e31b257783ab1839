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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
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
    KEPT,
    LINGER,
    DeleteOp,
    Op,
    PutOp,
    ReclaimOp,
)
from mqd_aerospike.shard import MAP_BINS, STATE_BINS, Memo, Meta

log = logging.getLogger(__name__)

DONE, BUSY, RETRY = "done", "busy", "retry"

#: The bin a daemon that found the lock held writes the time into.
WANTED = "wq"

#: How many operations, and how many dequeues, wait for a shard's next cycle.
More = Callable[[], tuple[int, int]]


def _never() -> tuple[int, int]:
    return 0, 0


@dataclass
class _Kept:
    """A lock kept from one cycle to the next, with the state it guards.

    A cycle keeps its shard's lock through its commit when operations wait
    for the next cycle, or when the shard is busy (this cycle started within
    LINGER of the last one's end). The next cycle then needs no call to lock
    and read the state (it has them), and the entries it hands out were read
    by the commit before it, in the same call: one call per cycle instead of
    two. A lock kept with nothing waiting is freed after LINGER unless an
    operation comes (mqd_aerospike.lanes). A commit keeps it for at most a
    quarter of the lock's lease after taking it, and never once another
    daemon found it held (bin WANTED): that daemon gets it at the next commit.
    """

    nonce: str
    meta: Meta
    entries: dict[int, list[Any]]
    taken_ms: int
    children: list[str] | None  # the queue's fanout children; None: unknown


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
        self._kept: dict[tuple[bytes, int], _Kept] = {}
        #: When each shard's last cycle ended (monotonic seconds).
        self._ended: Memo[tuple[bytes, int], float] = Memo()
        self._hold_ms = config.lock_lease_ms // 4

    # -- the cycle -----------------------------------------------------------

    def cycle(
        self, name: bytes, shard: int, shards: int, ops: list[Op], more: More = _never
    ) -> str:
        """Serve `ops` on one shard: DONE (results set), BUSY (lock held), RETRY (lock lost).

        `more()` tells how many operations (and dequeues) are queued for the
        shard's next cycle: the lock is then kept for it (see `_Kept`).
        """
        now = time.time()
        now_ms = int(now * 1000)
        where = (name, shard)
        kept = self._kept.pop(where, None)
        busy = time.monotonic() - self._ended.get(where, -LINGER) < LINGER
        tagged = any(isinstance(o, PutOp) and o.tag for o in ops)
        fanning = any(isinstance(o, PutOp) and o.fanout for o in ops)
        children: list[str] = []
        if kept is not None and not tagged and (kept.children is not None or not fanning):
            # The lock is still ours from the last cycle, and so is the state.
            nonce, meta, entries, taken_ms = kept.nonce, kept.meta, kept.entries, kept.taken_ms
            children = kept.children or []
        else:
            locked = self._lock(name, shard, shards, ops, now_ms, tagged, fanning)
            if isinstance(locked, str):
                return locked
            nonce, meta, entries, children = locked
            taken_ms = now_ms
        meta_key = self.meta_key(name, shard)
        run = Apply(self, meta, entries, now)
        for o in ops:
            run.apply(o)
        writes = run.prepare()
        old_head = meta.head
        meta.head = meta.low_water()
        deleting = any(isinstance(o, DeleteOp) and run.results.get(id(o)) for o in ops)
        # Kept only for a while, and never once another daemon asked for it.
        coming, dequeues = more() if not deleting and now_ms - taken_ms < self._hold_ms else (0, 0)
        held = False
        try:
            if deleting:
                self._delete(meta_key, nonce, meta, old_head)
            else:
                bins = meta.bins(now_ms)
                since = taken_ms if coming or busy else None
                ahead = self._ahead(meta, run.entries, dequeues) if since else []
                if since:  # the next cycle's fanout children, as fresh as a lock would read them
                    ahead.append(Read(self.family_key(name), [op.read("kids")]))
                held = self._commit(meta_key, nonce, bins, writes, run, since, ahead)
        except ae.FilteredOut:
            self.refused += 1
            log.warning("queue %r shard %d: commit refused, lock was broken", name, shard)
            self._held.pop(where, None)
            return RETRY
        if held:
            self._held[where] = nonce
            if not any(isinstance(o, PutOp) and o.error for o in ops):  # else a hole: read again
                entries = self._keepable(meta, run.entries)
                self._kept[where] = _Kept(nonce, meta, entries, taken_ms, run.children)
        else:
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
        self._ended[where] = time.monotonic()
        return KEPT if where in self._kept else DONE

    def release(self, name: bytes, shard: int) -> None:
        """Free a lock kept by the shard's last cycle, if it still is."""
        where = (name, shard)
        kept = self._kept.pop(where, None)
        if kept is None:
            return
        with contextlib.suppress(ae.FilteredOut):  # broken meanwhile: not ours to free
            self._commit(self.meta_key(name, shard), kept.nonce, {})
        self._held.pop(where, None)

    def _lock(
        self,
        name: bytes,
        shard: int,
        shards: int,
        ops: list[Op],
        now_ms: int,
        tagged: bool,
        fanning: bool,
    ) -> str | tuple[str, Meta, dict[int, list[Any]], list[str]]:
        """Take the shard's lock and read its state: (nonce, state, entries read, fanout
        children), or the cycle's outcome when there is nothing more to do."""
        nonce = f"{self.owner}/{secrets.token_hex(6)}"
        where = (name, shard)
        creating = any(isinstance(o, PutOp) for o in ops)
        dequeues = sum(1 for o in ops if o.dequeue)
        meta_key = self.meta_key(name, shard)
        lock = self._lock_ops(nonce, now_ms, dequeues == len(ops), self._held.get(where), tagged)
        policy = {} if creating else {"exists": aerospike.POLICY_EXISTS_UPDATE}
        prefetch = self._predict(where, dequeues)
        entries: dict[int, list[Any]] = {}
        # The fanout children are read in the same call as the lock.
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
                self._commit(meta_key, nonce, {})
                self._held.pop(where, None)
                self._finish_missing(ops)
                return DONE
            meta = Meta.new(name, shard, shards, self.per)
        meta.fence = int(bins["fence"])
        meta.with_tags = tagged
        if entries and self._hints[where][3] != meta.inc:
            entries.clear()  # prefetched from an incarnation that is gone
        if meta.created and shard:
            self._ensure_first_shard(meta)
        return nonce, meta, entries, children

    def _ahead(self, meta: Meta, entries: dict[int, list[Any]], coming: int) -> list[Read]:
        """Reads of the entries the next `coming` dequeues will hand out, not yet known."""
        wanted = meta.waiting_offsets(min(coming, self.config.max_batch))
        by_record: dict[int, list[int]] = {}
        for offset in wanted:
            if offset not in entries:
                by_record.setdefault(offset // meta.per, []).append(offset)
        return [Read(self.buf_key(meta, i), [get_slots(o)]) for i, o in by_record.items()]

    def _keepable(self, meta: Meta, entries: dict[int, list[Any]]) -> dict[int, list[Any]]:
        """The entries a kept lock's next cycle may hand out without reading them:
        the oldest still waiting, at most as many as one batch holds."""
        waiting = sorted(o for o in entries if meta.is_waiting(o))[: self.config.max_batch]
        return {o: entries[o] for o in waiting}

    def _lock_ops(
        self, nonce: str, now_ms: int, dequeue_only: bool, previous: str | None, tagged: bool
    ) -> list[dict[str, Any]]:
        free = _lock_free(now_ms, previous or "")
        got, wants = free, x.Not(free)
        if dequeue_only:
            got, wants = x.And(got, has_work()), x.And(wants, has_work())
        keep = x.Unknown()
        no_fail = aerospike.EXP_WRITE_EVAL_NO_FAIL
        fence = x.Cond(x.BinExists("fence"), xa.Add(x.IntBin("fence"), 1), 1)
        lease = now_ms + self.config.lock_lease_ms
        bins = STATE_BINS + tuple(b for b in MAP_BINS if b != "tags")
        if tagged:
            bins += ("tags",)
        return [
            # Asked for while held: its holder does not keep it past its next commit.
            xo.expression_write(WANTED, x.Cond(wants, now_ms, keep).compile(), no_fail),
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
        keep_since: int | None = None,
        ahead: list[Read] | None = None,
    ) -> bool:
        """Write the state and free the lock, refused unless the lock is still ours.

        With `keep_since` (when the lock was taken, Unix ms) the lock is kept
        unless another daemon asked for it since then; True if it was kept.
        `ahead` reads the entries the next cycle will hand out, in the same
        call, into `run.entries`, and last the queue's fanout children, into
        `run.children`.

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
        if keep_since is None:
            ops.append(op.write("lo", ""))
        else:
            asked = x.And(x.BinExists(WANTED), x.GE(x.IntBin(WANTED), keep_since))
            free = x.Cond(asked, "", nonce).compile()
            no_fail = aerospike.EXP_WRITE_EVAL_NO_FAIL
            ops += [xo.expression_write("lo", free, no_fail), op.read("lo")]
        writes, ahead = writes or [], ahead or []
        if run is None or not (writes or ahead):
            found = self.call(self.client.operate, key, ops, policy=policy)[2]
            return keep_since is not None and found.get("lo") == nonce
        batch = [Write(key, ops, policy=policy), *writes, *ahead]
        done = self.call(self.client.batch_write, BatchRecords(batch)).batch_records
        commit, entries = done[0], done[1 : 1 + len(writes)]
        if ahead:
            *reads, family = done[1 + len(writes) :]
            for found in reads:
                if found.result == 0 and found.record is not None:  # else read when needed
                    run.entries.update(slots_of(found.record[2].get("s")))
            if family.result in (0, NOT_FOUND):
                kids = family.record[2].get("kids") if family.result == 0 else None
                run.children = sorted(name_text(bytes(k)) for k in kids or {})
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
        return keep_since is not None and (commit.record[2] or {}).get("lo") == nonce

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
        """Keys of the buffer records holding offsets low..high-1."""
        if high <= low:
            return []
        return [self.buf_key(meta, i) for i in range(low // meta.per, (high - 1) // meta.per + 1)]

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
