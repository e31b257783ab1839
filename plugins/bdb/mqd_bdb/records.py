"""The record format: catalog keys, message and lease records, and their codecs.

Every layout keeps a *catalog* of B-tree records, keyed by a one-byte kind:

    CAT_QUEUE    + name             -> META: qid, next offset, counts, head, last change, flags
    CAT_RESERVED + qid + offset     -> LEASE: the open message's lease
    CAT_PURGE    + qid              -> a deleted queue whose records remain
    CAT_NEXT_QID                    -> the next queue id
    CAT_FORMAT                      -> FORMAT_VERSION of the records below
    CAT_RECENT                      -> META of each recently changed queue, newer
                                       than the one under its CAT_QUEUE key

The qid is given once, when a queue is created, and never again: it is the
queue's *incarnation* in a Receipt, so a receipt from before a delete matches
nothing in the queue created after it. In the single-file layouts the messages
live in the catalog's file too, under MSG (and body counts under UNIQ),
followed by the qid.

A message record is REC (marker, offset, flags, expires, created, deliveries,
length of `origin`), then `origin` (the queue a dead letter came from), then
the body. Its key is the queue's prefix and a *suffix*: the big-endian offset
in the FIFO layouts, the body's digest in bdb-random. A lease record is LEASE
(deadline, token, length of the suffix), the suffix, then the owner's id.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, Final

from mqd.backend import Lease, Message
from mqd.protocol import name_bytes, name_text

CAT_QUEUE: Final = b"\x00"
CAT_RESERVED: Final = b"\x01"
CAT_PURGE: Final = b"\x02"
CAT_NEXT_QID: Final = b"\x03"
CAT_FORMAT: Final = b"\x04"
CAT_RECENT: Final = b"\x05"
MSG: Final = b"\x10"  # + qid + ...: messages, in the single-file layouts
UNIQ: Final = b"\x11"  # + qid + digest: copies of a body, in bdb-single

#: Version 1 (no CAT_FORMAT record) had no leases, origins or offsets in FIFO records.
FORMAT_VERSION: Final = 3
#: Versions read as this one, and marked with it when opened: version 2 had no
#: CAT_RECENT record, which reads the same as an empty one.
UPGRADED: Final = frozenset({2})

QID: Final = struct.Struct(">I")
U32: Final = struct.Struct(">I")
U64: Final = struct.Struct(">Q")
CREATED: Final = struct.Struct(">d")


def u64(number: int) -> bytes:
    """`number` packed as U64 does: compiled, int.to_bytes is a direct call, where
    a Struct's pack is a method looked up on every key made."""
    return number.to_bytes(8, "big")


#: qid, next offset, items, bytes, open, head's created, last change, flags (INDEXED).
META: Final = struct.Struct(">IQQQQddB")
INDEXED: Final = 1  # META flag: the queue's copies of each body are counted
#: A message: marker, offset, flags, expires, created, deliveries, origin length.
REC: Final = struct.Struct(">BQIddIH")
REC_CREATED: Final = 21  # where `created` sits in REC
REC_ORIGIN: Final = REC.size - 2  # where the origin's length sits
REC_BODY: Final = REC.size  # where the origin, then the body, start
WAITING: Final = 0
RESERVED: Final = 1
#: A lease: deadline, token, length of the message key suffix.
LEASE: Final = struct.Struct(">dQB")


DIGEST_SIZE: Final = 16


def digest(body: bytes) -> bytes:
    """The 128-bit digest a body is counted (FIFO) or keyed (bdb-random) under."""
    return hashlib.blake2b(body, digest_size=DIGEST_SIZE).digest()


def message_record(marker: int, message: Message) -> bytes:
    """The record of `message` (its offset set) in state `marker`."""
    origin = name_bytes(message.origin) if message.origin else b""
    head = REC.pack(
        marker,
        message.offset,
        message.flags,
        message.expires,
        message.created,
        message.deliveries,
        len(origin),
    )
    return head + origin + message.body if origin else head + message.body


def body_of(value: bytes) -> bytes:
    """The body in a message record."""
    return value[REC.size + (value[REC_ORIGIN] << 8 | value[REC_ORIGIN + 1]) :]


def read_message(value: bytes) -> Message:
    """The message a record holds."""
    _, offset, flags, expires, created, deliveries, size = REC.unpack_from(value)
    if not size:
        return Message(value[REC_BODY:], flags, expires, created, offset, deliveries)
    start = REC_BODY + size
    origin = name_text(value[REC_BODY:start])
    return Message(value[start:], flags, expires, created, offset, deliveries, origin=origin)


def offset_of(value: bytes) -> int:
    """The offset in a message record."""
    return U64.unpack_from(value, 1)[0]  # type: ignore[no-any-return]


def remarked(value: bytes, marker: int, deliveries: int | None = None) -> bytes:
    """The record `value` in state `marker`, its delivery count changed if given."""
    if deliveries is None:
        return bytes((marker,)) + value[1:]
    head = list(REC.unpack_from(value))
    head[0], head[5] = marker, deliveries
    return REC.pack(*head) + value[REC.size :]


def lease_record(lease: Lease, suffix: bytes) -> bytes:
    owner = name_bytes(lease.owner)
    return LEASE.pack(lease.deadline, lease.token, len(suffix)) + suffix + owner


def read_lease(value: bytes) -> tuple[Lease, bytes]:
    """The lease and the message key suffix a lease record holds."""
    deadline, token, size = LEASE.unpack_from(value)
    end = LEASE.size + size
    return Lease(name_text(value[end:]), deadline, token), value[LEASE.size : end]


def first_waiting(cur: Any, start: bytes, prefix: bytes) -> tuple[bytes, bytes] | None:
    """Move `cur` to the first waiting message at or after `start` under `prefix`."""
    rec = cur.set_range(start)
    while rec is not None and rec[0].startswith(prefix):
        if rec[1][0] == WAITING:
            return rec  # type: ignore[no-any-return]
        rec = cur.next()
    return None


def delete_range(handle: Any, txn: Any, prefix: bytes, limit: int) -> int:
    """Delete up to `limit` records whose keys start with `prefix`; how many were."""
    done = 0
    cur = handle.cursor(txn)
    try:
        rec = cur.set_range(prefix)
        while rec is not None and rec[0].startswith(prefix) and done < limit:
            cur.delete()
            done += 1
            rec = cur.next()
    finally:
        cur.close()
    return done
