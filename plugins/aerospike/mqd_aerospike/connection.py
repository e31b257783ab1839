"""The connection to the cluster: keys, counted calls, and the calls that need no lock."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import aerospike
from aerospike import exception as ae
from aerospike_helpers.batch.records import BatchRecords, Read
from aerospike_helpers.expressions import base as x
from aerospike_helpers.expressions import map as xm
from aerospike_helpers.operations import expression_operations as xo
from aerospike_helpers.operations import map_operations as mo

from mqd import protocol
from mqd.errors import ConfigError, StorageError
from mqd.protocol import name_bytes
from mqd_aerospike.config import AerospikeConfig
from mqd_aerospike.shard import STATE_BINS, Meta

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Bytes an entry and a buffer record need beside the bodies (measured with
#: margin: list headers, floats, the fencing bin, the record's own header).
ENTRY_OVERHEAD = 96
RECORD_OVERHEAD = 4096
FILTERED_OUT = 27
NOT_FOUND = 2
#: What an open message takes of its shard's metadata record, besides its
#: owner's name: its offset and [token, owner, deadline, deliveries, size,
#: created] (39 bytes with a 4-byte owner, measured: 26,624 filled 1 MiB).
OPEN_ENTRY_BYTES = 48
KEY_ORDERED = {"map_order": aerospike.MAP_KEY_ORDERED}

#: Reads of buffer records a busy server turned away are tried this often.
READ_ATTEMPTS = 5


def has_work() -> x._BaseExpr:
    return x.Or(
        x.LT(x.IntBin("cur"), x.IntBin("tl")),
        x.GT(xm.MapSize(None, x.MapBin("ret")), 0),
    )


def fence_ok(token: int) -> Any:
    """A buffer record accepts a write only from the newest lock holder it has seen."""
    return x.Or(x.Not(x.BinExists("f")), x.LE(x.IntBin("f"), token)).compile()


class Connection:
    """A connected client: keys, counted calls, reads, and writes that need no lock."""

    def __init__(self, config: AerospikeConfig, owner: str) -> None:
        self.config = config
        self.owner = owner
        self.meta_set = f"{config.set_prefix}_meta"
        self.buf_set = f"{config.set_prefix}_buf"
        self.client: Any = None
        self.per = 1  # entries per buffer record, known once connected
        self.largest = config.max_item_size  # the largest body that fits
        # Bytes of a shard's metadata record its open messages may take: half
        # the record limit, known once connected. Beyond, a reserve finds
        # nothing (mqd_aerospike.apply), where a commit of the record would
        # fail, and every later one with it, set and ack alike.
        self.open_room = 1 << 19
        self._calls = 0
        self._count = threading.Lock()

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
        self.open_room = limit // 2
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

    # -- reads without the lock -----------------------------------------------

    def read_metas(self, name: bytes, shards: Iterable[int]) -> dict[int, Meta | None]:
        keys = [self.meta_key(name, s) for s in shards]
        found = self.call(self.client.batch_read, keys).batch_records
        out: dict[int, Meta | None] = {}
        for shard, record in zip(shards, found, strict=True):
            if record.result not in (0, NOT_FOUND):
                # Unreachable or timed out: the queue may well be there, and
                # must not be answered as empty or missing.
                raise StorageError(reason(record.result, "queue record read"))
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
            batch = [Read(self.buf_key(meta, i), [get_slots(o)]) for i, o in by_record.items()]
            found = self.call(self.client.batch_write, BatchRecords(batch)).batch_records
            failed: dict[int, list[int]] = {}
            for (index, wanted), record in zip(by_record.items(), found, strict=True):
                if record.result == 0 and record.record is not None:
                    entries.update(slots_of(record.record[2].get("s")))
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
        reads = [Read(self.buf_key(m, cur // m.per), [get_slots([cur])]) for m, cur in batch]
        found = self.call(self.client.batch_write, BatchRecords(reads)).batch_records
        for (meta, cur), record in zip(batch, found, strict=True):
            if record.result != 0 or record.record is None:
                continue
            value = slots_of(record.record[2].get("s")).get(cur)
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
        read = [xo.expression_read("w", has_work().compile(), aerospike.EXP_READ_EVAL_NO_FAIL)]
        batch = [Read(key, read) for _, key in keys]
        found = self.call(self.client.batch_write, BatchRecords(batch)).batch_records
        out: dict[Any, list[tuple[int, bool]]] = {}
        for (queue, _), r in zip(keys, found, strict=True):
            state = (
                (r.record[1]["gen"], bool(r.record[2].get("w"))) if r.result == 0 else (0, False)
            )
            out.setdefault(queue, []).append(state)
        return out


def _name(queue: str | bytes) -> bytes:
    return queue if isinstance(queue, bytes) else name_bytes(queue)


def _meta(bins: dict[str, Any]) -> Meta | None:
    return Meta.from_bins(bins, bytes(bins["qn"]), int(bins["sh"]))


def get_slots(offsets: list[int]) -> dict[str, Any]:
    found: dict[str, Any] = mo.map_get_by_key_list("s", offsets, aerospike.MAP_RETURN_KEY_VALUE)
    return found


def slots_of(found: Any) -> dict[int, list[Any]]:
    """A map read's answer (a flat [k, v, k, v] list, or a dict) as a dict."""
    if not found:
        return {}
    if isinstance(found, dict):
        return {int(k): v for k, v in found.items()}
    return {int(found[i]): found[i + 1] for i in range(0, len(found), 2)}


#: Result codes that say the cluster, not the request, is the trouble.
UNREACHABLE = (-15, -11, -10, -1, 11)


def reason(code: int, text: str = "") -> str:
    """A one-line reason for SERVER_ERROR from a result code: what failed, never a traceback."""
    if code == 9:
        return "aerospike timeout"
    if code in UNREACHABLE:
        return "aerospike cluster unavailable"
    if code == 13:
        return protocol.TOO_LARGE
    if code == FILTERED_OUT:  # a write that checks the lock's fence: a newer holder's
        return f"aerospike: {text or 'write'} refused, another daemon took the queue's lock"
    line = " ".join(text.split()) or "failed"
    return f"aerospike error {code}: {line}"


def _reason(error: ae.AerospikeError) -> str:
    if isinstance(error, ae.ClusterError):
        return reason(11)
    code = getattr(error, "code", None)
    return reason(code if isinstance(code, int) else -1, str(getattr(error, "msg", "") or ""))
