"""The record format: catalog keys, message records, and their codecs.

Every layout keeps a *catalog* of B-tree records, keyed by a one-byte kind:

    CAT_QUEUE    + name             -> META: qid, next offset, counts, head, flags
    CAT_RESERVED + qid + offset     -> the message key suffix (reserved index)
    CAT_PURGE    + qid              -> a deleted queue whose records remain
    CAT_NEXT_QID                    -> the next queue id

In the single-file layouts the messages live in the catalog's file too, under
MSG (and body counts under UNIQ), followed by the queue id.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

from mqd.backend import Message

CAT_QUEUE = b"\x00"
CAT_RESERVED = b"\x01"
CAT_PURGE = b"\x02"
CAT_NEXT_QID = b"\x03"
MSG = b"\x10"  # + qid + ...: messages, in the single-file layouts
UNIQ = b"\x11"  # + qid + digest: copies of a body, in bdb-single

QID = struct.Struct(">I")
U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
CREATED = struct.Struct(">d")
#: qid, next offset, items, bytes, open, head's created, flags (INDEXED).
META = struct.Struct(">IQQQQdB")
INDEXED = 1  # META flag: the queue's copies of each body are counted
#: A FIFO message: reserved marker, flags, expires, created, deliveries; body follows.
HDR = struct.Struct(">BIddI")
HDR_CREATED = 13
#: A bdb-random message: marker, offset, flags, expires, created, deliveries; body follows.
RHDR = struct.Struct(">BQIddI")
RHDR_CREATED = 21
WAITING = 0
RESERVED = 1


def digest(body: bytes) -> bytes:
    """The 128-bit digest a body is counted (FIFO) or keyed (bdb-random) under."""
    return hashlib.blake2b(body, digest_size=16).digest()


def fifo_message(key: bytes, value: bytes) -> Message:
    _, flags, expires, created, deliveries = HDR.unpack_from(value)
    offset = U64.unpack_from(key, len(key) - 8)[0]
    return Message(value[HDR.size :], flags, expires, created, offset, deliveries)


def random_message(value: bytes) -> Message:
    _, offset, flags, expires, created, deliveries = RHDR.unpack_from(value)
    return Message(value[RHDR.size :], flags, expires, created, offset, deliveries)


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
