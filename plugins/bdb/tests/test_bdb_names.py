"""Queue names are data: every name the protocol allows is stored separately and safely."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from bdb_helpers import ALWAYS, NAMES, put, session
from hypothesis import given
from hypothesis import strategies as st
from mqd_bdb.backend import _BdbBackend
from mqd_bdb.names import MAX_ESCAPED, decode_name, encode_name, escape, file_stem

from mqd.testing.conformance import HOSTILE_NAMES

#: Every byte the protocol allows in a queue name.
ALLOWED = bytes(b for b in range(0x21, 0x100) if b not in (0x7F, ord("/"), ord("+")))


def hostile_names() -> list[str]:
    names = set(HOSTILE_NAMES)
    names.update(decode_name(bytes([b])) for b in ALLOWED)  # every allowed byte alone
    names.add(decode_name(ALLOWED[:250]))
    names.add(decode_name(ALLOWED[-250:]))
    names.add(decode_name((ALLOWED * 2)[100:350]))
    names.update(["a" * 249 + "B", "a" * 249 + "b", "%2E%2E", "%2e", "%", "%%", "q-x", "h-x"])
    names.update(
        ["LOCK", "catalog.db", "queues.db", "reserve", "log.0000000001", "__db.001", "CON", "nul"]
    )
    assert all(1 <= len(encode_name(n)) <= 250 for n in names)
    return sorted(names)


@pytest.mark.parametrize("name", NAMES)
def test_hostile_names_round_trip_and_stay_inside(name: str, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    names = hostile_names()

    async def first(b: _BdbBackend) -> None:
        for n in names:
            assert await put(b, n, encode_name(n)) == 0
        assert sorted(await b.queues()) == names

    async def second(b: _BdbBackend) -> None:
        assert sorted(await b.queues()) == names
        for n in names:
            size = await b.size(n)
            assert size is not None and size.items == 1
            m = await b.take(n, sync=ALWAYS)
            assert m is not None and m.body == encode_name(n)
        for n in names[::2]:
            assert await b.delete(n, sync=ALWAYS) is True
        assert sorted(await b.queues()) == names[1::2]

    session(name, data_dir, first)
    session(name, data_dir, second)
    assert sorted(os.listdir(tmp_path)) == ["data"]
    for entry in os.scandir(data_dir):
        assert entry.is_file(follow_symlinks=False), entry.name
        assert len(entry.name.encode()) <= 255
        assert entry.name.isascii() and entry.name.isprintable()
        assert not any(c.isupper() for c in entry.name.removeprefix("LOCK"))
    if name == "bdb":
        stems = {e.name.rsplit(".", 1)[0] for e in os.scandir(data_dir) if "-" in e.name[:2]}
        assert stems == {file_stem(encode_name(n)) for n in names[1::2]}
    else:
        assert sorted(e.name for e in os.scandir(data_dir) if not e.name.startswith("log.")) == [
            "LOCK",
            "layout",
            "queues.db",
            "reserve",
        ]


def test_stems_are_distinct_and_safe() -> None:
    names = hostile_names()
    stems = {file_stem(encode_name(n)) for n in names}
    assert len(stems) == len(names)
    assert len({s.lower() for s in stems}) == len(names)  # also case-insensitively
    for n in names:
        stem = file_stem(encode_name(n))
        assert len(stem) + len(".btree") <= 255
        assert stem not in (".", "..")
        escaped = escape(encode_name(n))
        if len(escaped) <= MAX_ESCAPED:
            assert stem == "q-" + escaped
        else:
            assert stem.startswith("h-") and len(stem) == 2 + 40


@given(st.binary(min_size=1, max_size=250), st.binary(min_size=1, max_size=250))
def test_stems_of_different_names_differ(raw: bytes, other: bytes) -> None:
    stem = file_stem(raw)
    assert set(stem) <= set("abcdefghijklmnopqrstuvwxyz0123456789_-%")
    assert (stem == file_stem(other)) == (raw == other)
    assert encode_name(decode_name(raw)) == raw
