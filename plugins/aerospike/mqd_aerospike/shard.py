"""One queue shard's metadata record, as plain data, and what each operation does to it.

A shard is a chain of buffer records holding entries at offsets
`head <= o < tail`, and one metadata record that says which of them are
where. Offsets only grow; the entry at offset `o` lives in buffer record
`o // per`, under map key `o`, written once and never changed. What a message
is doing is kept here, in the metadata record, beside its offset:

    waiting, never handed out   cur <= o < tail, o not in `gone`
    waiting again (returned)    o in `ret`   (always below cur)
    open under a lease          o in `open`  [token, owner, deadline ms, deliveries, size, created]
    moving to a dead-letter q.  o in `mv`    [dead queue, deliveries, size, created, started ms]

so every change of state is one write of this record, made by the holder of
its lock, and the buffer records are only appended to. This module decides
those changes; mqd_aerospike.store does the round trips.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mqd.backend import Limits, Message, Put, Receipt

#: Bins of the metadata record that commits write (the lock bins are separate).
STATE_BINS = ("qn", "sh", "ns", "inc", "per", "hd", "cur", "tl", "n", "b", "lp")
MAP_BINS = ("ret", "gone", "open", "mv", "tags")
#: Dead-letter tags a queue remembers, and for how long, so a move retried by
#: another daemon is recognised and not stored twice.
TAG_KEEP_MS = 3_600_000
TAG_KEEP_MAX = 20_000


#: Queues a daemon remembers hints about (shard counts, positions) at most.
MEMO_MAX = 65536

K = TypeVar("K")
V = TypeVar("V")


class Memo(dict[K, V]):
    """What this daemon remembers about queues, all forgotten when it holds MEMO_MAX:
    queue names are client-chosen, and everything here can be read again."""

    def __setitem__(self, key: K, value: V) -> None:
        if len(self) >= MEMO_MAX and key not in self:
            self.clear()
        super().__setitem__(key, value)


@dataclass
class Meta:
    """The metadata record of one shard, as read under its lock."""

    name: bytes
    shard: int
    shards: int
    inc: int
    per: int
    head: int = 0
    cur: int = 0
    tail: int = 0
    items: int = 0
    size: int = 0
    last_put: int = 0  # Unix ms of the last message stored or moved in
    ret: dict[int, list[Any]] = field(default_factory=dict)  # o -> [deliveries, size, created]
    gone: dict[int, int] = field(default_factory=dict)
    open: dict[int, list[Any]] = field(default_factory=dict)
    mv: dict[int, list[Any]] = field(default_factory=dict)
    tags: dict[str, int] = field(default_factory=dict)
    fence: int = 0
    created: bool = False  # made by this cycle: the record did not exist
    #: Whether `tags` was read, so a commit may write it (only dead-letter
    #: moves read it; other commits leave the bin as it is).
    with_tags: bool = True

    @classmethod
    def from_bins(cls, bins: dict[str, Any], name: bytes, shard: int) -> Meta | None:
        """The state in `bins`, or None when the record holds no queue yet."""
        if bins.get("inc") is None:
            return None
        return cls(
            name=name,
            shard=shard,
            shards=int(bins["ns"]),
            inc=int(bins["inc"]),
            per=int(bins["per"]),
            head=int(bins["hd"]),
            cur=int(bins["cur"]),
            tail=int(bins["tl"]),
            items=int(bins["n"]),
            size=int(bins["b"]),
            last_put=int(bins.get("lp") or 0),
            ret=dict(bins.get("ret") or {}),
            gone=dict(bins.get("gone") or {}),
            open=dict(bins.get("open") or {}),
            mv=dict(bins.get("mv") or {}),
            tags=dict(bins.get("tags") or {}),
            fence=int(bins.get("fence") or 0),
        )

    @classmethod
    def new(cls, name: bytes, shard: int, shards: int, per: int) -> Meta:
        """A fresh incarnation: receipts of any earlier one never match it."""
        return cls(name, shard, shards, secrets.randbits(62) + 1, per, created=True)

    def bins(self, now_ms: int) -> dict[str, Any]:
        """Every bin a commit writes."""
        deadlines = [lease[2] for lease in self.open.values() if lease[2]]
        out = {
            "qn": bytearray(self.name),
            "sh": self.shard,
            "ns": self.shards,
            "inc": self.inc,
            "per": self.per,
            "hd": self.head,
            "cur": self.cur,
            "tl": self.tail,
            "n": self.items,
            "b": self.size,
            "lp": self.last_put,
            "ret": self.ret,
            "gone": self.gone,
            "open": self.open,
            "mv": self.mv,
            # The earliest lease deadline: reclaim looks only at shards whose has passed.
            "dl": min(deadlines, default=0),
        }
        if self.with_tags:
            self._prune_tags(now_ms)
            out["tags"] = self.tags
        return out

    def _prune_tags(self, now_ms: int) -> None:
        if not self.tags:
            return
        old = now_ms - TAG_KEEP_MS
        kept = sorted((ms, tag) for tag, ms in self.tags.items() if ms >= old)[-TAG_KEEP_MAX:]
        self.tags = {tag: ms for ms, tag in kept}

    # -- positions -----------------------------------------------------------

    def global_id(self, offset: int) -> int:
        """The id clients see: unique across the queue's shards."""
        return offset * self.shards + self.shard

    def waiting(self) -> int:
        return len(self.ret) + max(self.tail - self.cur, 0) - len(self.gone)

    def oldest_waiting(self) -> int | None:
        """The offset the next dequeue gets, without taking it."""
        if self.ret:
            return min(self.ret)
        cur = self.cur
        while cur in self.gone:
            cur += 1
        return cur if cur < self.tail else None

    def pop_oldest(self) -> tuple[int, int, int] | None:
        """Take the oldest waiting offset out of the waiting state.

        Returns (offset, deliveries, size); deliveries and size are -1 when
        only the entry knows them (a message never handed out).
        """
        if self.ret:
            offset = min(self.ret)
            deliveries, size, _created = self.ret.pop(offset)
            return offset, int(deliveries), int(size)
        while self.cur in self.gone:
            del self.gone[self.cur]
            self.cur += 1
        if self.cur >= self.tail:
            return None
        self.cur += 1
        return self.cur - 1, -1, -1

    def low_water(self) -> int:
        """The lowest offset still stored: buffer records wholly below it are garbage."""
        return (
            min(self.cur, *self.ret, *self.open, *self.mv)
            if (self.ret or self.open or self.mv)
            else self.cur
        )

    def take_waiting(self, offset: int) -> None:
        """Take a waiting offset out of the waiting state, wherever it is."""
        if offset in self.ret:
            del self.ret[offset]
        elif offset == self.cur:
            self.cur += 1
        else:
            self.gone[offset] = 1

    def forget_hole(self, offset: int, size: int) -> None:
        """An offset committed without its entry: out of the counters, and skipped."""
        if offset >= self.cur:
            if offset in self.gone or offset >= self.tail:
                return
            self.gone[offset] = 1
            self.items -= 1
        # Below cur a dequeue already passed it and took it out of `items`.
        self.size -= size

    def waiting_offsets(self) -> list[int]:
        """Every waiting offset, oldest first."""
        fresh = (o for o in range(self.cur, self.tail) if o not in self.gone)
        return [*sorted(self.ret), *fresh]

    def is_waiting(self, offset: int) -> bool:
        return offset in self.ret or (self.cur <= offset < self.tail and offset not in self.gone)

    def holds(self, receipt: Receipt, offset: int) -> bool:
        lease = self.open.get(offset)
        return receipt.incarnation == self.inc and lease is not None and lease[0] == receipt.token

    def shard_limits(self, limits: Limits) -> Limits:
        """A queue's limits shared out over its shards, each shard enforcing its part."""
        if self.shards == 1 or not limits:
            return limits
        return Limits(
            max_items=-(-limits.max_items // self.shards) if limits.max_items else 0,
            max_bytes=-(-limits.max_bytes // self.shards) if limits.max_bytes else 0,
            drop_oldest=limits.drop_oldest,
        )


def entry(message: Message, fence: int) -> list[Any]:
    """A buffer-record entry: what a message is, with the fencing token of its writer."""
    return [
        bytearray(message.body),
        message.flags,
        float(message.expires),
        float(message.created),
        fence,
        message.deliveries,
        message.origin,
    ]


def message_of(value: list[Any], offset: int, deliveries: int) -> Message:
    """The message an entry holds; `deliveries` -1 means the count stored in the entry."""
    body, flags, expires, created, _fence, stored, origin = value
    return Message(
        bytes(body),
        int(flags),
        float(expires),
        float(created),
        offset,
        int(stored) if deliveries < 0 else deliveries,
        origin=str(origin),
    )


def overflowing(meta: Meta, limits: Limits, adding: int) -> bool:
    return limits.overflow(meta.items, meta.size, adding)


def put_result_full(limits: Limits, size: int) -> Put | None:
    """FULL when no queue state could ever hold a body this big."""
    return Put.FULL if limits.max_bytes and size > limits.max_bytes else None
