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
import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import aerospike
from aerospike import exception as ae
from aerospike_helpers.batch.records import BatchRecords, Read, Write
from aerospike_helpers.expressions import arithmetic as xa
from aerospike_helpers.expressions import base as x
from aerospike_helpers.expressions import map as xm
from aerospike_helpers.operations import expression_operations as xo
from aerospike_helpers.operations import map_operations as mo
from aerospike_helpers.operations import operations as op

from mqd import protocol
from mqd.backend import Message, Put, Receipt
from mqd.errors import ConfigError, StorageError
from mqd.protocol import name_bytes, name_text
from mqd_aerospike.config import AerospikeConfig
from mqd_aerospike.ops import (
    DeleteOp,
    FinishMoveOp,
    HoleOp,
    LeaseOp,
    Moved,
    Op,
    PutOp,
    ReclaimOp,
    RedriveOp,
    RemoveOp,
    ReserveOp,
    TakeOp,
)
from mqd_aerospike.shard import MAP_BINS, STATE_BINS, Meta, entry, message_of

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Bytes an entry and a buffer record need beside the bodies (measured with
#: margin: list headers, floats, the fencing bin, the record's own header).
ENTRY_OVERHEAD = 96
RECORD_OVERHEAD = 4096
FILTERED_OUT = 27
NOT_FOUND = 2
KEY_ORDERED = {"map_order": aerospike.MAP_KEY_ORDERED}

DONE, BUSY, RETRY = "done", "busy", "retry"
#: Reads of buffer records a busy server turned away are tried this often.
READ_ATTEMPTS = 5


def _lock_free(now_ms: int, previous: str) -> x._BaseExpr:
    lo = x.StrBin("lo")
    free = [x.Not(x.BinExists("lo")), x.Eq(lo, ""), x.LT(x.IntBin("lx"), now_ms)]
    if previous:
        free.append(x.Eq(lo, previous))
    return x.Or(*free)


def _has_work() -> x._BaseExpr:
    return x.Or(
        x.LT(x.IntBin("cur"), x.IntBin("tl")),
        x.GT(xm.MapSize(None, x.MapBin("ret")), 0),
    )


def _fence_ok(token: int) -> Any:
    """A buffer record accepts a write only from the newest lock holder it has seen."""
    return x.Or(x.Not(x.BinExists("f")), x.LE(x.IntBin("f"), token)).compile()


class Store:
    """A connection to the cluster and the cycles run over it."""

    def __init__(self, config: AerospikeConfig, owner: str) -> None:
        self.config = config
        self.owner = owner
        self.meta_set = f"{config.set_prefix}_meta"
        self.buf_set = f"{config.set_prefix}_buf"
        self.client: Any = None
        self.per = 1  # entries per buffer record, known once connected
        self.largest = config.max_item_size  # the largest body that fits
        self._calls = 0
        self._count = threading.Lock()
        #: Cycles whose lock was broken under them: commits refused, writes fenced off.
        self.refused = 0
        self.fenced = 0
        #: Lock nonces of this daemon's cycles that failed holding a lock.
        self._held: dict[tuple[bytes, int], str] = {}
        #: The state each shard was left in by this daemon's last cycle, to
        #: guess which entries the next dequeues will read.
        self._hints: dict[tuple[bytes, int], tuple[int, int, tuple[int, ...], int, int]] = {}

    # -- connection ----------------------------------------------------------

    def connect(self) -> None:
        cfg = self.config
        policies: dict[str, Any] = {
            "read": {"total_timeout": cfg.total_timeout_ms, "max_retries": cfg.retries},
            "write": {"total_timeout": cfg.total_timeout_ms, "max_retries": 0},
            "operate": {"total_timeout": cfg.total_timeout_ms, "max_retries": 0},
            "remove": {"total_timeout": cfg.total_timeout_ms, "max_retries": 0},
            "batch": {"total_timeout": cfg.total_timeout_ms, "max_retries": 0},
            "query": {"total_timeout": cfg.total_timeout_ms * 10},
        }
        for policy in policies.values():
            policy["socket_timeout"] = min(cfg.socket_timeout_ms, policy["total_timeout"])
        client_config: dict[str, Any] = {
            "hosts": [(h, p, cfg.tls_name) if cfg.tls_name else (h, p) for h, p in cfg.hosts],
            "policies": policies,
            "connect_timeout": cfg.connect_timeout_ms,
            "max_conns_per_node": cfg.max_conns_per_node,
            "use_shared_connection": False,
        }
        if cfg.user:
            client_config["user"] = cfg.user
            client_config["password"] = cfg.password
        if cfg.tls_name or cfg.cafile:
            tls = {"enable": True}
            for key in ("cafile", "certfile", "keyfile"):
                if getattr(cfg, key):
                    tls[key] = getattr(cfg, key)
            client_config["tls"] = tls
        where = ", ".join(f"{h}:{p}" for h, p in cfg.hosts)
        try:
            self.client = aerospike.client(client_config).connect()
        except ae.AerospikeError as error:
            reason = _reason(error)
            raise StorageError(f"cannot reach the Aerospike cluster at {where}: {reason}") from None
        self._check_namespace()

    def _check_namespace(self) -> None:
        """Size buffer records from the namespace's record limit; fail early if it is wrong."""
        ns = self.config.namespace
        names = self._info("namespaces").split(";")
        if ns not in names:
            raise ConfigError(
                f"storage.aerospike.namespace = {ns!r}: no such namespace on the cluster "
                f"(it has: {', '.join(n for n in names if n) or 'none'})"
            )
        found = self._info(f"get-config:context=namespace;id={ns}")
        limit = 1 << 20
        for item in found.split(";"):
            key, _, value = item.partition("=")
            if key == "max-record-size" and value.isdigit() and int(value):
                limit = int(value)
        room = limit - RECORD_OVERHEAD
        want = self.config.max_item_size
        if want + ENTRY_OVERHEAD > room:
            self.largest = room - ENTRY_OVERHEAD
            log.warning(
                "namespace %s: max-record-size %d holds bodies of at most %d bytes; "
                "storage.aerospike.max_item_size = %d: larger messages are refused",
                ns,
                limit,
                self.largest,
                want,
            )
        else:
            self.largest = want
        self.per = max(1, room // (self.largest + ENTRY_OVERHEAD))
        log.info(
            "aerospike namespace %s: record limit %d, %d entries of up to %d bytes per record",
            ns,
            limit,
            self.per,
            self.largest,
        )

    def _info(self, command: str) -> str:
        answer = str(self.call(self.client.info_random_node, command))
        head, _, rest = answer.partition("\t")
        return (rest if rest or head.startswith(command) else head).strip()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    @property
    def calls(self) -> int:
        """Client calls made so far (a batch is one call)."""
        return self._calls

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """One round trip to the cluster, counted; client failures become StorageError."""
        with self._count:
            self._calls += 1
        if self.client is None:
            raise StorageError("aerospike backend is not open")
        try:
            return fn(*args, **kwargs)
        except (ae.RecordNotFound, ae.FilteredOut, ae.RecordExistsError):
            raise
        except ae.RecordTooBig as error:
            raise StorageError(protocol.TOO_LARGE) from error
        except ae.AerospikeError as error:
            raise StorageError(_reason(error)) from error

    # -- keys ----------------------------------------------------------------

    def meta_key(self, name: bytes, shard: int) -> tuple[str, str, bytearray]:
        return (self.config.namespace, self.meta_set, bytearray(b"%d\0" % shard + name))

    def buf_key(self, meta: Meta, index: int) -> tuple[str, str, bytearray]:
        return self._buf_key(meta.name, meta.inc, meta.shard, index)

    def family_key(self, parent: bytes) -> tuple[str, str, bytearray]:
        """The record naming a queue's fanout children: it outlives the queue itself."""
        return (self.config.namespace, self.meta_set, bytearray(b"f\0" + parent))

    def adopt(self, child: bytes, on: bool) -> None:
        """Add `child` ("<parent>+<name>") to its parent's fanout children, or take it out."""
        parent = child.partition(b"+")[0]
        key = self.family_key(parent)
        try:
            if on:
                self.call(self.client.operate, key, [mo.map_put("kids", bytearray(child), 1)])
            else:
                remove = mo.map_remove_by_key("kids", bytearray(child), aerospike.MAP_RETURN_NONE)
                self.call(self.client.operate, key, [remove])
        except ae.RecordNotFound:
            pass

    def _buf_key(self, name: bytes, inc: int, shard: int, index: int) -> tuple[str, str, bytearray]:
        # The incarnation is part of the key: a queue deleted and made again
        # never sees a buffer record of the one before, even one written late.
        head = b"%d:%d:%d\0" % (inc, shard, index)
        return (self.config.namespace, self.buf_set, bytearray(head + name))

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
                        Read(self._buf_key(name, inc, shard, index), [_get_slots(offsets)])
                        for index, offsets in prefetch.items()
                    ]
                results = self.call(self.client.batch_write, BatchRecords(batch)).batch_records
                first = results[0]
                if first.result == NOT_FOUND:
                    raise ae.RecordNotFound()
                if first.result != 0:
                    raise StorageError(f"aerospike: lock failed with code {first.result}")
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
                        entries.update(_slots(found.record[2].get("s")))
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
        run = _Run(self, meta, entries, now)
        for o in ops:
            run.apply(o)
        writes = run.prepare()
        old_head = meta.head
        meta.head = meta.low_water()
        deleting = any(isinstance(o, DeleteOp) and run.results.get(id(o)) for o in ops)
        try:
            if deleting:
                self._delete(meta_key, nonce, meta, old_head)
            elif not self._commit(meta_key, nonce, {**meta.bins(now_ms), "lo": ""}, writes, run):
                self._held.pop(where, None)
                return RETRY
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
            got = x.And(got, _has_work())
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
            xo.expression_read("work", _has_work().compile(), aerospike.EXP_READ_EVAL_NO_FAIL),
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
        run: _Run | None = None,
    ) -> bool:
        """Write the state and free the lock, refused unless the lock is still ours.

        The cycle's new entries go in the same batch call. The server applies
        a batch's records independently, so each outcome is looked at:
        - commit refused: the lock was broken; nothing this cycle wrote is
          visible (entries past the committed tail are never read): False.
        - commit made, an entry's record refused the write (fenced off by a
          newer lock holder: the lease ran out while the call was on its way)
          or failed: that set gets SERVER_ERROR, never STORED, and its offset
          is a hole readers pass over (HoleOp corrects the counters).
        """
        policy = {"expressions": x.Eq(x.StrBin("lo"), nonce).compile()}
        ops = [op.write(name, value) for name, value in bins.items()]
        if not writes or run is None:
            self.call(self.client.operate, key, ops, policy=policy)
            return True
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
            raise StorageError(f"aerospike: commit failed with code {commit.result}")
        for write, record in zip(writes, entries, strict=True):
            if record.result != 0:
                run.lost(write.key, record.result)
        return True

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

    # -- reads without the lock -----------------------------------------------

    def read_metas(self, name: bytes, shards: Iterable[int]) -> dict[int, Meta | None]:
        keys = [self.meta_key(name, s) for s in shards]
        found = self.call(self.client.batch_read, keys).batch_records
        out: dict[int, Meta | None] = {}
        for shard, record in zip(shards, found, strict=True):
            bins = record.record[2] if record.result == 0 and record.record else None
            out[shard] = Meta.from_bins(bins, name, shard) if bins else None
        return out

    def read_entries(self, meta: Meta, offsets: Iterable[int]) -> dict[int, list[Any]]:
        by_record: dict[int, list[int]] = {}
        for offset in offsets:
            by_record.setdefault(offset // meta.per, []).append(offset)
        if not by_record:
            return {}
        entries: dict[int, list[Any]] = {}
        for attempt in range(READ_ATTEMPTS):
            batch = [Read(self.buf_key(meta, i), [_get_slots(o)]) for i, o in by_record.items()]
            found = self.call(self.client.batch_write, BatchRecords(batch)).batch_records
            failed: dict[int, list[int]] = {}
            for (index, wanted), record in zip(by_record.items(), found, strict=True):
                if record.result == 0 and record.record is not None:
                    entries.update(_slots(record.record[2].get("s")))
                elif record.result != NOT_FOUND:
                    failed[index] = wanted  # busy or timed out: an entry must never look gone
            if not failed:
                return entries
            by_record = failed
            time.sleep(0.001 * (attempt + 1))
        raise StorageError(f"aerospike: buffer records unreadable ({len(by_record)})")

    def create(self, name: bytes, shards: int) -> bool:
        """Make an empty queue unless it exists; True if made now."""
        first = Meta.new(name, 0, shards, self.per)
        try:
            self.call(
                self.client.put,
                self.meta_key(name, 0),
                first.bins(int(time.time() * 1000)),
                policy={"exists": aerospike.POLICY_EXISTS_CREATE},
            )
        except ae.RecordExistsError:
            return False
        finally:
            if b"+" in name:
                self.adopt(name, True)
        return True

    def scan_metas(self, bins: tuple[str, ...], expression: Any = None) -> list[dict[str, Any]]:
        query = self.client.query(self.config.namespace, self.meta_set)
        query.select(*bins)
        policy = {"expressions": expression} if expression is not None else {}
        found = self.call(query.results, policy)
        return [dict(record[2]) for record in found if record[2].get("inc") is not None]

    def all_metas(self) -> list[Meta]:
        found = self.scan_metas(("qn", "sh", *STATE_BINS, "ret", "gone", "open", "mv"))
        return [m for bins in found if (m := _meta(bins)) is not None]

    def reclaimable(self, now_ms: int, any_open: bool) -> list[Meta]:
        """Shards with a lease past its deadline, a move to finish, or (any_open) any lease."""
        has = [
            x.And(x.GT(x.IntBin("dl"), 0), x.LE(x.IntBin("dl"), now_ms)),
            x.GT(xm.MapSize(None, x.MapBin("mv")), 0),
        ]
        if any_open:
            has.append(x.GT(xm.MapSize(None, x.MapBin("open")), 0))
        found = self.scan_metas(("qn", *STATE_BINS, "ret", "open", "mv"), x.Or(*has).compile())
        return [m for bins in found if (m := _meta(bins)) is not None]

    def head_created(self, metas: list[Meta]) -> dict[tuple[bytes, int], float]:
        """When the oldest message of each shard was enqueued (shards holding any)."""
        out: dict[tuple[bytes, int], float] = {}
        batch = []
        for meta in metas:
            created = [float(v[2]) for v in meta.ret.values()]
            created += [float(v[5]) for v in meta.open.values()]
            created += [float(v[3]) for v in meta.mv.values()]
            if created:
                out[(meta.name, meta.shard)] = min(created)
            cur = meta.cur
            while cur in meta.gone:
                cur += 1
            if cur < meta.tail:
                batch.append((meta, cur))
        if not batch:
            return out
        reads = [Read(self.buf_key(m, cur // m.per), [_get_slots([cur])]) for m, cur in batch]
        found = self.call(self.client.batch_write, BatchRecords(reads)).batch_records
        for (meta, cur), record in zip(batch, found, strict=True):
            if record.result != 0 or record.record is None:
                continue
            value = _slots(record.record[2].get("s")).get(cur)
            if value is not None:
                where = (meta.name, meta.shard)
                out[where] = min(out.get(where, float(value[3])), float(value[3]))
        return out

    def watch_state(self, name: bytes, shards: int) -> list[tuple[int, bool]]:
        """(generation, has waiting messages) of every shard, in one call."""
        return self.watch_many({name: shards})[name]

    def watch_many(self, queues: dict[Any, int]) -> dict[Any, list[tuple[int, bool]]]:
        """(generation, has waiting messages) of every shard of every queue, in one call."""
        keys = [
            (queue, self.meta_key(_name(queue), s))
            for queue, shards in queues.items()
            for s in range(shards)
        ]
        read = [xo.expression_read("w", _has_work().compile(), aerospike.EXP_READ_EVAL_NO_FAIL)]
        batch = [Read(key, read) for _, key in keys]
        found = self.call(self.client.batch_write, BatchRecords(batch)).batch_records
        out: dict[Any, list[tuple[int, bool]]] = {}
        for (queue, _), r in zip(keys, found, strict=True):
            state = (
                (r.record[1]["gen"], bool(r.record[2].get("w"))) if r.result == 0 else (0, False)
            )
            out.setdefault(queue, []).append(state)
        return out


class _Run:
    """The operations of one cycle applied to the shard's state, in order."""

    def __init__(self, store: Store, meta: Meta, entries: dict[int, list[Any]], now: float):
        self.store = store
        self.meta = meta
        self.entries = entries
        self.now = now
        self.now_ms = int(now * 1000)
        self.results: dict[int, Any] = {}
        self.writes: dict[int, list[Any]] = {}
        self.later: list[Callable[[], None]] = []  # applied once the entries they need are read
        self.wanted: set[int] = set()
        self.puts: dict[PutOp, int] = {}  # each stored put's offset
        self.keys: dict[bytes, int] = {}  # buffer record's user key -> its index

    def entry(self, offset: int) -> list[Any] | None:
        if offset not in self.entries:
            self.entries.update(self.store.read_entries(self.meta, [offset]))
        return self.entries.get(offset)

    def size_of(self, offset: int) -> int:
        found = self.entry(offset)
        return len(found[0]) if found else 0

    def apply(self, o: Op) -> None:
        meta = self.meta
        if isinstance(o, PutOp):
            self.results[id(o)] = self.put(o)
        elif isinstance(o, TakeOp | ReserveOp):
            taken = meta.pop_oldest()
            if taken is None:
                self.results[id(o)] = None
                return
            offset, deliveries, size = taken
            self.wanted.add(offset)
            self.later.append(lambda: self.dequeued(o, offset, deliveries, size))
        elif isinstance(o, LeaseOp):
            self.results[id(o)] = self.lease(o)
        elif isinstance(o, RemoveOp):
            self.results[id(o)] = self.remove(o.offset)
        elif isinstance(o, ReclaimOp):
            self.results[id(o)] = self.reclaim(o)
        elif isinstance(o, FinishMoveOp):
            moving = meta.mv.pop(o.offset, None)
            if moving is not None:
                meta.items -= 1
                meta.size -= int(moving[2])
            self.results[id(o)] = moving is not None
        elif isinstance(o, HoleOp):
            for offset, size in o.holes:
                meta.forget_hole(offset, size)
        elif isinstance(o, DeleteOp):
            idle = not (meta.items or meta.open or meta.mv) and meta.last_put < o.before
            self.results[id(o)] = not o.before or idle
        elif isinstance(o, RedriveOp):
            self.results[id(o)] = self.redrive(o)

    def put(self, o: PutOp) -> Put:
        meta, message = self.meta, o.message
        size = len(message.body)
        if o.tag and o.tag in meta.tags:
            return Put.DUPLICATE
        limits = meta.shard_limits(o.limits)
        if limits.max_bytes and size > limits.max_bytes:
            return Put.FULL
        while limits.overflow(meta.items, meta.size, size):
            if not limits.drop_oldest:
                return Put.FULL
            dropped = meta.pop_oldest()
            if dropped is None:
                return Put.FULL
            meta.items -= 1
            meta.size -= dropped[2] if dropped[2] >= 0 else self.size_of(dropped[0])
        offset = meta.tail
        meta.tail += 1
        meta.items += 1
        meta.size += size
        # Also where this cycle's own dequeues look: they may take it at once.
        self.writes[offset] = self.entries[offset] = entry(message, meta.fence)
        self.puts[o] = offset
        message.offset = meta.global_id(offset)
        if o.tag:
            meta.tags[o.tag] = self.now_ms
        meta.last_put = self.now_ms
        return Put.STORED

    def dequeued(self, o: Op, offset: int, deliveries: int, size: int) -> None:
        meta = self.meta
        found = self.entries.get(offset)
        if size < 0:
            size = len(found[0]) if found else 0
        if found is None:  # lost with its buffer record: nothing to hand out
            meta.items -= 1
            meta.size -= size
            self.results[id(o)] = None
            return
        message = message_of(found, meta.global_id(offset), deliveries)
        message.deliveries += 1
        if isinstance(o, ReserveOp):
            token = secrets.randbits(62) + 1
            deadline = int((self.now + o.lease) * 1000) if o.lease else 0
            meta.open[offset] = [
                token,
                o.owner,
                deadline,
                message.deliveries,
                size,
                message.created,
            ]
            message.receipt = Receipt(
                meta.name.decode("utf-8", "surrogateescape"), meta.inc, message.offset, token
            )
        else:
            meta.items -= 1
            meta.size -= size
        self.results[id(o)] = message

    def lease(self, o: LeaseOp) -> bool | Moved:
        meta = self.meta
        if not meta.holds(o.receipt, o.offset):
            return False
        lease = meta.open[o.offset]
        if o.kind == "extend":
            lease[2] = int((self.now + o.lease) * 1000) if o.lease else 0
            return True
        del meta.open[o.offset]
        if o.kind == "ack":
            meta.items -= 1
            meta.size -= int(lease[4])
            return True
        if o.to is None:
            meta.ret[o.offset] = [lease[3], lease[4], lease[5]]
            return True
        return self.move(o.offset, lease, o.to)

    def move(self, offset: int, lease: list[Any], to: str, redrive: bool = False) -> Moved:
        meta = self.meta
        dest = bytearray(name_bytes(to))
        meta.mv[offset] = [dest, lease[3], lease[4], lease[5], self.now_ms, int(redrive)]
        self.wanted.add(offset)
        tag = f"{meta.inc:x}:{offset}"
        moved = Moved(offset, meta.shard, Message(b""), to, tag, redrive=redrive)
        self.later.append(lambda: self.fill(moved, int(lease[3])))
        return moved

    def fill(self, moved: Moved, deliveries: int) -> None:
        found = self.entries.get(moved.offset)
        if found is not None:
            moved.message = message_of(found, self.meta.global_id(moved.offset), deliveries)

    def remove(self, offset: int) -> bool:
        meta = self.meta
        if not meta.is_waiting(offset):
            return False
        meta.size -= int(meta.ret[offset][1]) if offset in meta.ret else self.size_of(offset)
        meta.take_waiting(offset)
        meta.items -= 1
        return True

    def redrive(self, o: RedriveOp) -> list[Moved]:
        """Waiting messages on their way out, as moves finished like dead-lettering."""
        meta = self.meta
        moved: list[Moved] = []
        waiting = meta.waiting_offsets()
        for start in range(0, len(waiting), 256):
            if len(moved) >= o.limit:
                break
            chunk = waiting[start : start + 256]
            unread = [w for w in chunk if w not in self.entries]
            self.entries.update(self.store.read_entries(meta, unread))
            for offset in chunk:
                found = self.entries.get(offset)
                to = o.to or (str(found[6]) if found is not None else "")
                if found is None or not to or len(moved) >= o.limit:
                    continue
                deliveries = int(meta.ret[offset][0]) if offset in meta.ret else int(found[5])
                meta.take_waiting(offset)
                lease = [0, "", 0, deliveries, len(found[0]), float(found[3])]
                moved.append(self.move(offset, lease, to, redrive=True))
        return moved

    def reclaim(self, o: ReclaimOp) -> list[Moved]:
        meta = self.meta
        done: list[Moved] = []
        for offset, (token, to) in o.decisions.items():
            lease = meta.open.get(offset)
            if lease is not None and lease[0] == token:
                del meta.open[offset]
                if to is None:
                    meta.ret[offset] = [lease[3], lease[4], lease[5]]
                    moved = Moved(offset, meta.shard, Message(b""), "", "", returned=True)
                    self.wanted.add(offset)
                    self.later.append(functools.partial(self.fill, moved, int(lease[3])))
                    done.append(moved)
                else:
                    done.append(self.move(offset, lease, to))
            elif offset in meta.mv:
                # A move begun by some daemon, maybe still under way: finish it
                # too (the tag keeps the dead-letter queue from storing it twice),
                # so that every move this reclaim saw is done when it returns.
                moving = meta.mv[offset]
                tag = f"{meta.inc:x}:{offset}"
                dest = name_text(bytes(moving[0]))
                moved = Moved(offset, meta.shard, Message(b""), dest, tag, redrive=bool(moving[5]))
                self.wanted.add(offset)
                self.later.append(functools.partial(self.fill, moved, int(moving[1])))
                done.append(moved)
        return done

    def prepare(self) -> list[Write]:
        """Read what is still needed; the writes of the new entries, fenced by this lock."""
        missing = [o for o in self.wanted if o not in self.entries]
        if missing:
            self.entries.update(self.store.read_entries(self.meta, missing))
        for step in self.later:
            step()
        meta, store = self.meta, self.store
        by_record: dict[int, dict[int, list[Any]]] = {}
        for offset, value in self.writes.items():
            by_record.setdefault(offset // meta.per, {})[offset] = value
        fence = _fence_ok(meta.fence)
        self.keys = {bytes(store.buf_key(meta, i)[2]): i for i in by_record}
        return [
            Write(
                store.buf_key(meta, index),
                [op.write("f", meta.fence), mo.map_put_items("s", slots, KEY_ORDERED)],
                policy={"expressions": fence},
            )
            for index, slots in by_record.items()
        ]

    def lost(self, key: Any, code: int) -> None:
        """The entries of one buffer record were not written though the commit was made."""
        index = self.keys[bytes(key[2])]
        per = self.meta.per
        for o in self.puts:
            offset = self.puts[o]
            if offset // per == index:
                reason = protocol.TOO_LARGE if code == 13 else f"aerospike: write failed ({code})"
                o.error = StorageError(reason)
                o.hole = (offset, len(self.writes[offset][0]))


def _name(queue: str | bytes) -> bytes:
    return queue if isinstance(queue, bytes) else name_bytes(queue)


def _meta(bins: dict[str, Any]) -> Meta | None:
    return Meta.from_bins(bins, bytes(bins["qn"]), int(bins["sh"]))


def _get_slots(offsets: list[int]) -> dict[str, Any]:
    found: dict[str, Any] = mo.map_get_by_key_list("s", offsets, aerospike.MAP_RETURN_KEY_VALUE)
    return found


def _slots(found: Any) -> dict[int, list[Any]]:
    """A map read's answer (a flat [k, v, k, v] list, or a dict) as a dict."""
    if not found:
        return {}
    if isinstance(found, dict):
        return {int(k): v for k, v in found.items()}
    return {int(found[i]): found[i + 1] for i in range(0, len(found), 2)}


def _reason(error: ae.AerospikeError) -> str:
    """A one-line reason for SERVER_ERROR: what failed, never a traceback."""
    if isinstance(error, ae.TimeoutError):
        return "aerospike timeout"
    if isinstance(error, ae.ClusterError) or getattr(error, "code", 0) in (-10, -1, 11):
        return "aerospike cluster unavailable"
    message = str(getattr(error, "msg", "") or type(error).__name__)
    return f"aerospike error {getattr(error, 'code', '?')}: {message}".replace("\r", " ").replace(
        "\n", " "
    )
