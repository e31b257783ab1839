"""The RESP parser alone: bytes in, requests out, for any split of the input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqd import resp
from mqd.resp import Failed, Parser, split_inline

TOO_LARGE = Failed("object too large for cache")


def request(*args: bytes) -> bytes:
    out = b"*%d\r\n" % len(args)
    for arg in args:
        out += b"$%d\r\n%b\r\n" % (len(arg), arg)
    return out


def feed(data: bytes, max_bulk: int = 1 << 20) -> list[object]:
    return list(Parser(max_bulk).feed(data))


def feed_split(data: bytes, cuts: list[int], max_bulk: int = 1 << 20) -> list[object]:
    parser = Parser(max_bulk)
    out: list[object] = []
    last = 0
    for cut in [*sorted(cuts), len(data)]:
        out += parser.feed(data[last:cut])
        last = cut
    return out


def test_multibulk_requests_in_one_read() -> None:
    data = request(b"LPUSH", b"q", b"a\r\nb") + request(b"RPOP", b"q") + request(b"PING")
    assert feed(data) == [[b"LPUSH", b"q", b"a\r\nb"], [b"RPOP", b"q"], [b"PING"]]


def test_whole_canonical_input_is_parsed_by_hiredis(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_scan(self: Parser, data: bytes) -> list[object]:
        raise AssertionError("the scanner was used")

    monkeypatch.setattr(Parser, "_scan", no_scan)
    assert Parser().feed(request(b"SADD", b"s", b"") + b"*0\r\n") == [[b"SADD", b"s", b""]]


def test_inline_commands() -> None:
    assert feed(b"PING\r\nlpush q  hello\n\r\n  \r\nECHO \"a b\\x41\\n\" 'c\\'d'\r\n") == [
        [b"PING"],
        [b"lpush", b"q", b"hello"],
        [b"ECHO", b"a bA\n", b"c'd"],
    ]


def test_inline_then_multibulk_then_inline() -> None:
    data = b"PING\r\n" + request(b"ECHO", b"x") + b"PING\r\n"
    assert feed(data) == [[b"PING"], [b"ECHO", b"x"], [b"PING"]]


def test_empty_and_null_multibulk_are_skipped() -> None:
    assert feed(b"*0\r\n*-1\r\n" + request(b"PING")) == [[b"PING"]]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"*x\r\n", "Protocol error: invalid multibulk length"),
        (b"*01\r\n", "Protocol error: invalid multibulk length"),
        (b"*1048577\r\n", "Protocol error: invalid multibulk length"),
        # hiredis would have made a list of that many elements first.
        (b"*4294967295\r\n", "Protocol error: invalid multibulk length"),
        # Sizes that add up to a canonical request's, in types that are none.
        (b"*2\r\n=8\r\ntxt:ECHO\r\n+0123456789\r\n", "Protocol error: expected '$', got '='"),
        (b"*1\r\n$x\r\n", "Protocol error: invalid bulk length"),
        (b"*1\r\n$-1\r\n", "Protocol error: invalid bulk length"),
        (b"*1\r\n$03\r\nabc\r\n", "Protocol error: invalid bulk length"),
        (b"*1\r\n$536870913\r\n", "Protocol error: invalid bulk length"),
        (b"*1\r\n:5\r\n", "Protocol error: expected '$', got ':'"),
        (b"*1\r\n+OK\r\n", "Protocol error: expected '$', got '+'"),
        (b"*2\r\n$1\r\na\r\n*1\r\n", "Protocol error: expected '$', got '*'"),
        (b'SET "a b\r\n', "Protocol error: unbalanced quotes in request"),
        (b'SET "a"b\r\n', "Protocol error: unbalanced quotes in request"),
        (b"x" * (resp.MAX_INLINE + 1), "Protocol error: too big inline request"),
        (b"*" + b"1" * (resp.MAX_INLINE + 1), "Protocol error: too big mbulk count string"),
        (b"*1\r\n$" + b"1" * (resp.MAX_INLINE + 1), "Protocol error: too big bulk count string"),
    ],
)
def test_bad_framing_is_answered_and_ends_the_stream(data: bytes, message: str) -> None:
    parser = Parser()
    assert parser.feed(data) == [Failed(message, close=True)]
    assert parser.closed
    assert parser.feed(request(b"PING")) == []


def test_requests_before_bad_framing_are_kept() -> None:
    assert feed(request(b"PING") + b"*1\r\n:1\r\n") == [
        [b"PING"],
        Failed("Protocol error: expected '$', got ':'", close=True),
    ]


def test_oversized_bulk_is_skipped_and_the_stream_stays_in_step() -> None:
    data = request(b"LPUSH", b"q", b"x" * 11, b"y") + request(b"PING")
    assert feed(data, max_bulk=10) == [TOO_LARGE, [b"PING"]]
    # Arriving in pieces, it is discarded as it comes, never kept whole.
    parser = Parser(max_bulk=10)
    assert parser.feed(b"*3\r\n$5\r\nLPUSH\r\n$1\r\nq\r\n$100000\r\n") == []
    for _ in range(9):
        assert parser.feed(b"z" * 10000) == []
        assert not parser._buf
    assert parser.feed(b"z" * 10000 + b"\r\n" + request(b"PING")) == [TOO_LARGE, [b"PING"]]


def test_a_bulk_of_exactly_the_limit_is_kept() -> None:
    assert feed(request(b"LPUSH", b"q", b"x" * 10), max_bulk=10) == [[b"LPUSH", b"q", b"x" * 10]]


def test_too_many_argument_bytes_in_one_request_are_refused() -> None:
    args = [b"SADD", b"s"] + [b"m" * 1000] * 80
    assert feed(request(*args) + request(b"PING"), max_bulk=1000) == [TOO_LARGE, [b"PING"]]


def test_large_value_in_many_pieces() -> None:
    body = bytes(range(256)) * 4096  # 1 MiB
    data = request(b"RPUSH", b"q", body) + request(b"RPOP", b"q")
    pieces = [data[i : i + 1000] for i in range(0, len(data), 1000)]
    parser = Parser()
    out: list[object] = []
    for piece in pieces:
        out += parser.feed(piece)
    assert out == [[b"RPUSH", b"q", body], [b"RPOP", b"q"]]


def test_split_inline_quotes() -> None:
    assert split_inline(b"a 'b c' \"d\\te\"") == [b"a", b"b c", b"d\te"]
    assert split_inline(b"  ") == []
    assert split_inline(b"'unterminated") is None


# -- any split, the same requests --------------------------------------------------

arg = st.binary(max_size=40)
word = st.binary(min_size=1, max_size=8).filter(
    lambda w: all(c > 32 and c not in b"\"'" for c in w)
)


@st.composite
def requests(draw: st.DrawFn) -> tuple[bytes, list[object]]:
    kind = draw(st.sampled_from(["bulk", "bulk", "inline", "empty", "large"]))
    if kind == "bulk":
        args = draw(st.lists(arg, min_size=1, max_size=5))
        return request(*args), [args]
    if kind == "inline":
        args = draw(st.lists(word, min_size=1, max_size=4).filter(lambda a: a[0][:1] != b"*"))
        return b" ".join(args) + draw(st.sampled_from([b"\r\n", b"\n"])), [args]
    if kind == "empty":
        return draw(st.sampled_from([b"*0\r\n", b"*-1\r\n", b"\r\n"])), []
    return request(b"LPUSH", b"q", b"x" * draw(st.integers(41, 200))), [TOO_LARGE]


fatal = st.sampled_from([b"*1\r\n:1\r\n", b"*1\r\n$-3\r\n", b"*?\r\n", b"'\r\n"])


@settings(max_examples=300, deadline=None)
@given(st.lists(requests(), min_size=1, max_size=10), st.one_of(st.none(), fatal), st.data())
def test_any_split_gives_the_same_requests(
    parts: list[tuple[bytes, list[object]]], bad: bytes | None, data: st.DataObject
) -> None:
    stream = b"".join(raw for raw, _ in parts)
    expected = [r for _, rs in parts for r in rs]
    if bad is not None:
        stream += bad + request(b"PING")
    whole = feed(stream, max_bulk=40)
    if bad is not None:
        assert type(whole[-1]) is Failed and whole[-1].close
        whole = whole[:-1]
    assert whole == expected
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=8))
    assert feed_split(stream, cuts, max_bulk=40) == feed(stream, max_bulk=40)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.data())
def test_random_bytes_never_raise_and_split_the_same(junk: bytes, data: st.DataObject) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(junk)), max_size=6))
    assert feed_split(junk, cuts, max_bulk=40) == feed(junk, max_bulk=40)


# -- replies ------------------------------------------------------------------------


def test_reply_encoding() -> None:
    assert (
        resp.encode([b"q", None, 3, "OK", [b""]])
        == b"*5\r\n$1\r\nq\r\n$-1\r\n:3\r\n+OK\r\n*1\r\n$0\r\n\r\n"
    )
    assert resp.array(None) == b"*-1\r\n"
    assert resp.error("unknown command 'a\r\nb'") == b"-ERR unknown command 'a  b'\r\n"
    assert resp.error_reply(resp.CodedError("NOPROTO", "unsupported protocol version")) == (
        b"-NOPROTO unsupported protocol version\r\n"
    )
