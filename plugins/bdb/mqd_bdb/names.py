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

from mqd.backend import name_bytes as encode_name
from mqd.backend import name_text as decode_name

__all__ = ["decode_name", "encode_name", "escape", "file_stem", "stem_name", "unescape"]

#: Bytes that stand for themselves in a file name.
SAFE = frozenset(b"abcdefghijklmnopqrstuvwxyz0123456789_-")
#: Longest escaped name used as is; far below NAME_MAX (255) with prefix and
#: suffix, and below the ~143 bytes that encrypting file systems allow.
MAX_ESCAPED = 120

_HEX = frozenset(b"0123456789abcdef")


def escape(raw: bytes) -> str:
    """`raw` with every byte outside `SAFE` written as `%xx`."""
    return "".join(chr(b) if b in SAFE else f"%{b:02x}" for b in raw)


def unescape(text: str) -> bytes:
    """The bytes escape() was given; ValueError for text escape() cannot produce."""
    data = text.encode("ascii")
    out = bytearray()
    i = 0
    while i < len(data):
        b = data[i]
        if b == 0x25:  # '%'
            pair = data[i + 1 : i + 3]
            if len(pair) != 2 or not set(pair) <= _HEX:
                raise ValueError(f"bad escape in {text!r}")
            value = int(pair, 16)
            if value in SAFE:
                raise ValueError(f"needless escape in {text!r}")
            out.append(value)
            i += 3
        elif b in SAFE:
            out.append(b)
            i += 1
        else:
            raise ValueError(f"unescaped byte in {text!r}")
    return bytes(out)


def file_stem(raw: bytes) -> str:
    """The file name stem for a queue: `q-<escaped>`, or `h-<digest>` when too long."""
    escaped = escape(raw)
    if len(escaped) <= MAX_ESCAPED:
        return "q-" + escaped
    return "h-" + hashlib.blake2b(raw, digest_size=20).hexdigest()


def stem_name(stem: str) -> bytes | None:
    """The queue name a `q-` stem stands for; None for a digest (`h-`) stem."""
    if stem.startswith("q-"):
        return unescape(stem[2:])
    if stem.startswith("h-"):
        return None
    raise ValueError(f"not a queue file stem: {stem!r}")
