"""Queue names to file names and back, safely on any file system.

A queue name is data: up to 250 arbitrary bytes. Only `[a-z0-9_-]` pass into a
file name unchanged; every other byte, upper-case letters included (two names
that differ only in case must not meet on a case-insensitive file system),
becomes `%` and two lower-case hex digits. So no file name is ever `.`, `..`,
a device name such as `con`, or contains a path separator. An escaped name
longer than `MAX_ESCAPED` characters is replaced by a digest of the name; the
catalog keeps the real name either way.
"""

from __future__ import annotations

import hashlib

from mqd.protocol import name_bytes as encode_name
from mqd.protocol import name_text as decode_name

__all__ = ["decode_name", "encode_name", "escape", "file_stem"]

#: Bytes that stand for themselves in a file name.
SAFE = frozenset(b"abcdefghijklmnopqrstuvwxyz0123456789_-")
#: Longest escaped name used as is; far below NAME_MAX (255) with prefix and
#: suffix, and below the ~143 bytes that encrypting file systems allow.
MAX_ESCAPED = 120


def escape(raw: bytes) -> str:
    """`raw` with every byte outside `SAFE` written as `%xx`."""
    return "".join(chr(b) if b in SAFE else f"%{b:02x}" for b in raw)


def file_stem(raw: bytes) -> str:
    """The file name stem for a queue: `q-<escaped>`, or `h-<digest>` when too long."""
    escaped = escape(raw)
    if len(escaped) <= MAX_ESCAPED:
        return "q-" + escaped
    return "h-" + hashlib.blake2b(raw, digest_size=20).hexdigest()
