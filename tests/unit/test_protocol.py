"""The parser alone: bytes in, commands out, for any split of the input."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mqd.errors import ClientError, ServerError, UnknownCommand
from mqd.protocol import (
    Delete,
    Failed,
    FlushAll,
    Key,
    Parser,
    Quit,
    Retrieve,
    Stats,
    Store,
    Verbosity,
    Version,
    error_line,
    parse_key,
    value,
)

BAD = Failed(ClientError("bad command line format"))


def feed(data: bytes, max_item_size: int = 1 << 20) -> list[object]:
    return list(Parser(max_item_size).feed(data))


def test_set_and_get() -> None:
    assert feed(b"set q 5 0 3\r\nabc\r\nget q\r\n") == [
        Store(False, "q", 5, 0, b"abc", False),
        Retrieve([Key(b"q", "q", plain=True)], False),
    ]


def test_bare_newline_and_noreply() -> None:
    assert feed(b"add q 0 -1 2 noreply\nab\r\ngets a b\n") == [
        Store(True, "q", 0, -1, b"ab", True),
        Retrieve([Key(b"a", "a", plain=True), Key(b"b", "b", plain=True)], True),
    ]


def test_body_may_hold_newlines() -> None:
    assert feed(b"set q 0 0 4\r\n\r\n\r\n\r\n") == [Store(False, "q", 0, 0, b"\r\n\r\n", False)]


def test_options() -> None:
    key = parse_key(b"jobs/close/open/t=500")
    assert key == Key(b"jobs/close/open/t=500", "jobs", wait_ms=500, open=True, close=True)
    assert parse_key(b"jobs/at=7") == Key(b"jobs/at=7", "jobs", at=7)
    assert parse_key(b"jobs/peek/t=1") == Key(b"jobs/peek/t=1", "jobs", wait_ms=1, peek=True)
    for bad in (
        b"jobs/peek/open",
        b"jobs/abort/close",
        b"jobs/open/open",
        b"jobs/t=x",
        b"jobs/t=-1",
        b"jobs/at=1/open",
        b"jobs/",
        b"jobs//open",
        b"jobs/bogus",
        b"/open",
        b"a+b+c",
        b"+b",
        b"a+",
        b"a+/open",
        b"a\x01b",
        b"x" * 251,
    ):
        assert parse_key(bad) is None, bad
    assert parse_key(b"x" * 250 + b"/open") is not None
    assert parse_key(b"jobs+audit/open") == Key(b"jobs+audit/open", "jobs+audit", open=True)


def test_lease_options() -> None:
    raw = b"jobs/lease=spark-1.a_B/n=100000/t=50"
    assert parse_key(raw) == Key(raw, "jobs", wait_ms=50, lease="spark-1.a_B", count=100000)
    assert parse_key(b"jobs/n=3/lease=x") == Key(b"jobs/n=3/lease=x", "jobs", lease="x", count=3)
    assert parse_key(b"jobs/lease=x/abort") == Key(
        b"jobs/lease=x/abort", "jobs", abort=True, lease="x"
    )
    assert parse_key(b"jobs/lease=" + b"x" * 64 + b"/n=1") is not None
    raw = b"jobs/lease=x/n=5/visibility=604800000/t=9"
    assert parse_key(raw) == Key(
        raw, "jobs", wait_ms=9, lease="x", count=5, visibility_ms=604_800_000
    )
    for bad in (
        b"jobs/lease=x",
        b"jobs/n=1",
        b"jobs/lease=x/n=0",
        b"jobs/lease=x/n=100001",
        b"jobs/lease=x/n=",
        b"jobs/lease=/n=1",
        b"jobs/lease=" + b"x" * 65 + b"/n=1",
        b"jobs/lease=a+b/n=1",
        b"jobs/lease=a\xffb/n=1",
        b"jobs/lease=x/n=1/open",
        b"jobs/lease=x/n=1/close",
        b"jobs/lease=x/n=1/peek",
        b"jobs/lease=x/n=1/at=1",
        b"jobs/lease=x/n=1/abort",
        b"jobs/lease=x/abort/t=1",
        b"jobs/lease=x/lease=y/n=1",
        b"jobs/abort/n=1",
        b"jobs/lease=x/n=1/visibility=0",
        b"jobs/lease=x/n=1/visibility=604800001",
        b"jobs/lease=x/abort/visibility=5",
        b"jobs/lease=x/visibility=5",
        b"jobs/visibility=5",
        b"jobs/open/visibility=5",
        b"jobs/at=1/n=2/visibility=5",
    ):
        assert parse_key(bad) is None, bad


def test_range_options() -> None:
    raw = b"jobs/at=7/n=100000"
    assert parse_key(raw) == Key(raw, "jobs", at=7, count=100000)
    assert parse_key(b"jobs/n=2/at=0") == Key(b"jobs/n=2/at=0", "jobs", at=0, count=2)
    for bad in (
        b"jobs/at=1/n=0",
        b"jobs/at=1/n=100001",
        b"jobs/at=1/n=2/peek",
        b"jobs/at=1/n=2/open",
        b"jobs/at=1/n=2/t=5",
        b"jobs/at=1/n=2/abort",
        b"jobs/at=1/at=2/n=2",
        b"jobs/n=2/t=5",
        b"jobs/n=2/peek",
    ):
        assert parse_key(bad) is None, bad


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b"get\r\n", BAD),
        (b"set q 0 0\r\n", BAD),
        (b"set q 0 0 -1\r\n", BAD),
        (b"set q 0 0 abc\r\n", BAD),
        (b"bogus\r\n", Failed(UnknownCommand())),
        (b"\r\n", Failed(UnknownCommand())),
        (b"SET q 0 0 1\r\n", Failed(UnknownCommand())),
        (b"incr q 1\r\n", Failed(ClientError("incr not supported"))),
        (b"touch q 1 noreply\r\n", Failed(ClientError("touch not supported"), noreply=True)),
        (b"delete q\r\n", Delete("q", False)),
        (b"delete q 0 noreply\r\n", Delete("q", True)),
        (b"delete q 5\r\n", BAD),
        (b"delete q/open\r\n", BAD),
        (b"delete q/lease=a\r\n", Delete("q", False, "a")),
        (b"delete q/to=9/lease=a noreply\r\n", Delete("q", True, "a", 9)),
        (b"delete q/lease=a/to=0 0\r\n", Delete("q", False, "a", 0)),
        (b"delete q/to=9\r\n", BAD),
        (b"delete q/lease=a/to=x\r\n", BAD),
        (b"delete q/lease=a/to=1/to=2\r\n", BAD),
        (b"delete q/lease=a/lease=b\r\n", BAD),
        (b"delete q/lease=a/open\r\n", BAD),
        (
            b"delete q/lease=a/bogus noreply\r\n",
            Failed(ClientError("bad command line format"), True),
        ),
        (b"gets q/lease=a/n=1 q\r\n", BAD),
        (b"get q q/lease=a/abort\r\n", BAD),
        (b"flush_all\r\n", FlushAll(0, False)),
        (b"flush_all 10 noreply\r\n", FlushAll(10, True)),
        (b"stats queues\r\n", Stats((b"queues",))),
        (b"version\r\n", Version()),
        (b"verbosity 1\r\n", Verbosity(False)),
        (b"verbosity\r\n", BAD),
        (b"quit\r\n", Quit()),
        # Tokens are separated by spaces alone, as memcached's are: a tab or
        # another control byte stays in its key, which is then a bad key.
        (b"get a\tb\r\n", BAD),
        (b"get a b\x0bc\r\n", BAD),
        (b"get a\r\r\n", BAD),
        (b"delete q\x0c\r\n", BAD),
        (b"  delete   q  \r\n", Delete("q", False)),
    ],
)
def test_lines(line: bytes, expected: object) -> None:
    assert feed(line) == [expected]


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"set a/b 0 0 1\r\nx\r\n", ClientError("bad command line format")),
        (b"set q x 0 1\r\nx\r\n", ClientError("bad command line format")),
        (b"set q 4294967296 0 1\r\nx\r\n", ClientError("bad command line format")),
        (b"set q 0 0 1 junk\r\nx\r\n", ClientError("bad command line format")),
        (b"set q\tx 0 0 1\r\nx\r\n", ClientError("bad command line format")),
        (b"set q\x0c 0 0 1\r\nx\r\n", ClientError("bad command line format")),
        (b"set q 0 0 1\r\nxyz\r\n", ClientError("bad data chunk")),
        (b"replace q 0 0 1\r\nx\r\n", ClientError("replace not supported")),
        (b"cas q 0 0 1 99\r\nx\r\n", ClientError("cas not supported")),
        (b"set q 0 0 11\r\nxxxxxxxxxxx\r\n", ServerError("object too large for cache")),
    ],
)
def test_storage_errors_swallow_the_block(data: bytes, error: Exception) -> None:
    commands = feed(data + b"version\r\n", max_item_size=10)
    assert commands[0] == Failed(error)  # type: ignore[arg-type]
    # The data block was consumed: the next line is read as a command...
    # except after a bad chunk, where the rest of the wrong-sized block is a line.
    assert commands[-1] == Version()


def test_too_large_is_discarded_as_it_arrives() -> None:
    parser = Parser(max_item_size=10)
    assert parser.feed(b"set q 0 0 100000\r\n") == []
    for _ in range(10):
        assert parser.feed(b"x" * 10000) == []
        assert parser._have == 0  # nothing kept
    assert parser.feed(b"\r\nversion\r\n") == [
        Failed(ServerError("object too large for cache")),
        Version(),
    ]


def test_line_too_long_closes() -> None:
    parser = Parser()
    # 2048 bytes and a \r may still be a line and its end; 2049 bytes cannot.
    assert parser.feed(b"x" * 2048 + b"\r") == []
    assert parser.feed(b"x") == [Failed(ClientError("line too long"), close=True)]
    assert parser.feed(b"version\r\n") == []
    assert Parser().feed(b"x" * 2049) == [Failed(ClientError("line too long"), close=True)]
    # The limit is the line's, without its end: \r\n and \n alike.
    for end in (b"\r\n", b"\n"):
        (command,) = Parser().feed(b"x" * 2048 + end)
        assert command == Failed(UnknownCommand())
        (command,) = Parser().feed(b"x" * 2049 + end)
        assert command == Failed(ClientError("line too long"), close=True)
    keys = b" ".join([b"k%d" % i for i in range(5000)])
    assert len(keys) > 2048
    (command,) = Parser().feed(b"get " + keys + b"\r\n")
    assert isinstance(command, Retrieve) and len(command.keys) == 5000
    (too_long,) = Parser().feed(b"get " + b"k" * 70000)
    assert isinstance(too_long, Failed) and too_long.close


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_long_lines_in_small_reads(step: int) -> None:
    """A line held in pieces: the same commands and limits as when it comes whole."""

    def pieces(data: bytes) -> list[object]:
        parser = Parser()
        return [c for i in range(0, len(data), step) for c in parser.feed(data[i : i + step])]

    many = b"get " + b" ".join([b"k%d" % i for i in range(5000)]) + b"\r\nversion\r\n"
    assert pieces(many) == feed(many)
    assert [type(c) for c in pieces(many)] == [Retrieve, Version]
    closed = [Failed(ClientError("line too long"), close=True)]
    assert pieces(b"get " + b"k" * 70000) == closed
    assert pieces(b"x" * 2050) == closed
    assert pieces(b"x" * 2049) == closed
    assert pieces(b"x" * 2048 + b"\r") == []
    assert pieces(b"x" * 2048 + b"\r\n") == [Failed(UnknownCommand())]
    # A set line in pieces, its block after it: held apart, then joined.
    store = b"set " + b"q" * 200 + b" 0 0 2\r\nab\r\n"
    assert pieces(store) == feed(store) and len(feed(store)) == 1


def test_replies() -> None:
    assert value(b"q/open", 3, b"ab") == b"VALUE q/open 3 2\r\nab\r\n"
    assert value(b"q", 0, b"", 12) == b"VALUE q 0 0 12\r\n\r\n"
    assert error_line(UnknownCommand()) == b"ERROR\r\n"
    assert error_line(ClientError("bad data chunk")) == b"CLIENT_ERROR bad data chunk\r\n"


# -- any split of any valid stream gives the same commands ---------------------

names = st.binary(min_size=1, max_size=12).filter(
    lambda b: all(c > 0x20 and c != 0x7F and c not in b"/+" for c in b)
)
options = st.sampled_from(
    [
        b"",
        b"/open",
        b"/close",
        b"/close/open",
        b"/t=10",
        b"/peek",
        b"/at=3",
        b"/abort",
        b"/lease=a/n=5",
        b"/lease=a/abort",
    ]
)
bodies = st.binary(max_size=40)


@st.composite
def commands(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 9))
    name = draw(names)
    if kind <= 2:
        body = draw(bodies)
        verb = draw(st.sampled_from([b"set", b"add", b"replace"]))
        tail = draw(st.sampled_from([b"", b" noreply"]))
        size = len(body) + draw(st.sampled_from([0, 0, 0, 1]))  # sometimes a bad chunk
        return b"%b %b %d 0 %d%b\r\n%b\r\n" % (
            verb,
            name,
            draw(st.integers(0, 9)),
            size,
            tail,
            body,
        )
    if kind <= 5:
        keys = draw(st.lists(st.tuples(names, options), min_size=1, max_size=3))
        return b"get " + b" ".join(n + o for n, o in keys) + draw(st.sampled_from([b"\r\n", b"\n"]))
    return draw(
        st.sampled_from(
            [
                b"delete q\r\n",
                b"delete q/lease=a/to=7 noreply\r\n",
                b"stats\r\n",
                b"bogus\r\n",
                b"incr a 1\r\n",
                b"version\n",
                b"\r\n",
            ]
        )
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(commands(), min_size=1, max_size=12), st.data())
def test_any_split_gives_the_same_commands(stream: list[bytes], data: st.DataObject) -> None:
    whole = b"".join(stream)
    expected = feed(whole)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(whole)), max_size=8)))
    parser = Parser()
    got: list[object] = []
    start = 0
    for cut in [*cuts, len(whole)]:
        got.extend(parser.feed(whole[start:cut]))
        start = cut
    assert got == expected
    byte_by_byte = Parser()
    assert [c for i in range(len(whole)) for c in byte_by_byte.feed(whole[i : i + 1])] == expected


@settings(max_examples=300, deadline=None)
@given(st.lists(commands(), min_size=1, max_size=12), st.data())
def test_lines_seen_before_give_what_they_gave(stream: list[bytes], data: st.DataObject) -> None:
    """A connection keeps its `get` and `set` lines parsed: sent again, in one
    read or in pieces, they give the commands they gave the first time."""
    whole = b"".join(stream)
    expected = feed(whole)
    seen = Parser()
    assume(seen.feed(whole) == expected and not seen.partial and not seen.closed)
    assert seen.feed(whole) == expected
    cut = data.draw(st.integers(0, len(whole)))
    assert [*seen.feed(whole[:cut]), *seen.feed(whole[cut:])] == expected
