"""RESP2, the Redis wire: bytes in, requests out; arguments read with Redis'
errors; replies to bytes.

Pure, like mqd.protocol: no sockets, no storage. `Parser.feed` takes whatever
the socket delivered and returns every complete request (a list of argument
byte strings) or a `Failed` for input that Redis itself would refuse; any
split of the same input gives the same result.

Requests are parsed by hiredis' `Reader` (a maintained C parser). It is a
parser of *replies*, so three things a server needs are written here by hand:

- inline commands (`PING\\r\\n` typed in telnet), which are not RESP at all;
- Redis' request rules: every element a `$` bulk string, lengths written
  without sign or leading zeros, and bounds checked when a length *header*
  arrives (hiredis would buffer whatever length it is promised);
- where a request ends, which hiredis does not report, so that a bulk string
  too large to keep can be skipped while staying in step.

hiredis takes the common case: input that starts at a request boundary and
holds only whole, well-formed requests (a client's batch of commands). Any
other input (a request split across reads, a large value arriving in pieces,
inline commands, errors) goes to the small framing scanner below, which gives
the same requests, so the result never depends on how input was split.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import hiredis

from mqd.errors import ClientError, ProtocolError

MAX_INLINE = 64 * 1024  # Redis' PROTO_INLINE_MAX_SIZE: an inline command or a length header
MAX_MULTIBULK = 1024 * 1024  # elements in one request
# An aggregate header (array, map, set, push, attribute) of 8 digits or more,
# above MAX_MULTIBULK: hiredis would allocate its list before any check of
# ours, so such input goes to the scanner, which refuses it.
_HUGE_AGGREGATE = re.compile(rb"[*%~>|]\d{8}")
MAX_BULK_LEN = 512 * 1024 * 1024  # Redis' proto-max-bulk-len: beyond it the stream is refused
# Above this many bytes of arguments a request is read and discarded, not kept.
MAX_REQUEST_SLACK = 64 * 1024

# Redis' own error strings, where Redis has one; mqd's for the rest.
ERRORS = {
    "mbulk_header": "Protocol error: too big mbulk count string",
    "bulk_header": "Protocol error: too big bulk count string",
    "inline": "Protocol error: too big inline request",
    "quotes": "Protocol error: unbalanced quotes in request",
    "mbulk_len": "Protocol error: invalid multibulk length",
    "bulk_len": "Protocol error: invalid bulk length",
    "too_large": "object too large for cache",
    "arity": "wrong number of arguments for '{}' command",
    "unknown": "unknown command '{}'",
    "syntax": "syntax error",
    "integer": "value is not an integer or out of range",
    "positive": "value is out of range, must be positive",
    "timeout": "timeout is not a float or out of range",
    "timeout_negative": "timeout is negative",
    "timeout_range": "timeout is out of range",
    "db_index": "DB index is out of range",
    "name": "invalid queue name: 1-250 bytes, no spaces, control bytes or '/', one '+' at most",
    "subcommand": "unknown subcommand '{}'. Try {} HELP.",
    "noproto": "unsupported protocol version",
    "noauth": "Authentication required.",
    "hello_noauth": (
        "HELLO must be called with the client already authenticated, otherwise the "
        "HELLO <proto> AUTH <user> <pass> option can be used to authenticate the client "
        "and select the RESP protocol version at the same time"
    ),
    "wrongpass": "invalid username-password pair or user is disabled.",
    "client_name": "Client names cannot contain spaces, newlines or special characters.",
    "auth": (
        "AUTH <password> called without any password configured for the default user. "
        "Are you sure your configuration is correct?"
    ),
}


@dataclass(frozen=True, slots=True)
class Failed:
    """Input answered with an error; `close`: the stream cannot be followed, so it ends."""

    message: str
    close: bool = False


class CodedError(ClientError):
    """An error answered with a code of its own instead of ERR (NOPROTO)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


Request = list[bytes]


def _length(token: bytes) -> int | None:
    """A RESP length as Redis reads it (string2ll): digits, no sign, no leading zero."""
    if token.isdigit() and (token[:1] != b"0" or len(token) == 1):
        return int(token)
    return None


def _count(token: bytes) -> int | None:
    """A multibulk count: a length, or a negative number (an empty request)."""
    if token[:1] == b"-":
        value = _length(token[1:])
        return None if value is None else -value
    return _length(token)


# -- arguments --------------------------------------------------------------------


def client_error(key: str, *args: object) -> ClientError:
    """The error `ERRORS[key]`, filled in, to raise for a command's bad arguments."""
    return ClientError(ERRORS[key].format(*args))


def parse_integer(raw: bytes) -> int:
    """A Redis integer argument (string2ll: optional minus, digits, 64-bit)."""
    digits = raw[1:] if raw[:1] == b"-" else raw
    if not digits.isdigit() or (digits[:1] == b"0" and raw != b"0"):  # "-0" too
        raise client_error("integer")
    value = int(raw)
    if not -(2**63) <= value < 2**63:
        raise client_error("integer")
    return value


def parse_count(raw: bytes) -> int:
    """A non-negative count argument (LPOP, RPOP, SPOP)."""
    value = parse_integer(raw)
    if value < 0:
        raise client_error("positive")
    return value


#: A hexadecimal float as strtold reads one: "0x", digits with a point, a binary exponent.
_HEX_FLOAT = re.compile(
    rb"[+-]?0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?[0-9]+)?"
)
#: A number whose digits before its exponent are not all zeros.
_NONZERO = re.compile(rb"[+-]?(?:0[xX][0.]*[1-9a-fA-F]|[0.]*[1-9])")


def parse_timeout(raw: bytes) -> float:
    """A blocking command's timeout in seconds (a float, not negative)."""
    # Python's float() also takes "0_1" and " 1 ", which Redis' strtold does not;
    # strtold takes a hexadecimal float ("0x1p-3"), which float() does not, and
    # float.fromhex() also without its "0x" ("a"), which strtold does not.
    # Redis reads at most 5119 characters.
    if b"_" in raw or raw != raw.strip() or len(raw) >= 5120:
        raise client_error("timeout")
    try:
        value = float(raw)
    except ValueError:
        if not _HEX_FLOAT.fullmatch(raw):
            raise client_error("timeout") from None
        value = float.fromhex(raw.decode("ascii"))
    if math.isnan(value):
        raise client_error("timeout")
    if value == 0 and _NONZERO.match(raw):
        value = math.ulp(0.0)  # below a double's range, not nothing: strtold's long double
    if value < 0:
        raise client_error("timeout_negative")
    if value * 1000 >= 2**63:  # Redis keeps a timeout in milliseconds, in 64 bits
        raise client_error("timeout_range")
    return value


def check_sides(sides: list[bytes]) -> None:
    """LMOVE's sides are checked; a queue has one order, so they mean nothing more."""
    for side in sides:
        if side.upper() not in (b"LEFT", b"RIGHT"):
            raise client_error("syntax")


# -- inline commands ------------------------------------------------------------

# Redis' sdssplitargs: words, "double quoted" with C escapes, 'single quoted';
# a closing quote must end the word.
_WORD = re.compile(rb'\s*(?:"((?:\\.|[^"\\])*)"|\'((?:\\\'|[^\'])*)\'|([^\s"\']+))(?=\s|$)', re.S)
_ESCAPES = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"b": b"\b", b"a": b"\a"}
_ESCAPE = re.compile(rb"\\(x[0-9a-fA-F]{2}|.)", re.S)


def _unescape(match: re.Match[bytes]) -> bytes:
    code = match.group(1)
    if code[:1] == b"x" and len(code) == 3:
        return bytes([int(code[1:], 16)])
    return _ESCAPES.get(code, code)


def split_inline(line: bytes) -> list[bytes] | None:
    """The arguments of an inline command, or None if its quotes do not balance."""
    if b'"' not in line and b"'" not in line:
        return line.split()
    args: list[bytes] = []
    pos = 0
    end = len(line.rstrip())
    while pos < end:
        match = _WORD.match(line, pos)
        if match is None:
            return None
        double, single, bare = match.groups()
        if double is not None:
            args.append(_ESCAPE.sub(_unescape, double))
        elif single is not None:
            args.append(single.replace(b"\\'", b"'"))
        else:
            args.append(bare)
        pos = match.end()
    return args


# -- the parser -------------------------------------------------------------------


class Parser:
    """Incremental parser of one connection's requests.

    `max_bulk` is the largest argument kept in memory (the largest message any
    queue accepts): a larger bulk string is read and discarded as it arrives,
    and its request is answered with `object too large for cache`.
    """

    def __init__(self, max_bulk: int = 1 << 20) -> None:
        self.max_bulk = max_bulk
        self.max_request = max_bulk + MAX_REQUEST_SLACK
        self.closed = False
        self._reader = hiredis.Reader()
        self._buf = bytearray()  # input not yet consumed by the scanner
        self._left = 0  # elements of the current request still to come
        self._args: list[bytes] = []
        self._kept = 0  # argument bytes of the current request so far
        self._need = 0  # bytes of the current bulk string (with its \r\n) still to come
        self._swallow = 0  # bytes of a refused bulk string still to discard
        self._refused = False  # the current request is too large: discard, then answer

    @property
    def partial(self) -> bool:
        """Whether part of a request has arrived and the rest has not."""
        return bool(self._buf or self._left or self._swallow)

    def feed(self, data: bytes) -> list[Request | Failed]:
        """Take more input and return every request it completes, in order."""
        if self.closed or not data:
            return []
        if not self.partial and data[:1] == b"*" and _HUGE_AGGREGATE.search(data) is None:
            requests = self._whole(data)
            if requests is not None:
                return requests
        return self._scan(data)

    def _whole(self, data: bytes) -> list[Request | Failed] | None:
        """hiredis' parse of `data` if it is exactly whole, canonical requests; else None.

        Canonical means every element a `$` bulk string with its length written
        plainly: the bytes such requests take are then known from what hiredis
        returns, so comparing that with len(data) proves hiredis read the same
        thing the scanner would (it also accepts RESP3 types and `+strings`,
        which are not requests).
        """
        out: list[Request | Failed] = []
        expected = 0
        try:
            self._reader.feed(data)
            while (request := self._reader.gets()) is not False:
                size = self._canonical_size(request, data, expected)
                if size is None:
                    break
                expected += size
                if request:
                    out.append(request)
            else:
                if expected == len(data):
                    return out
        except hiredis.ProtocolError:
            pass
        self._reader = hiredis.Reader()  # it holds a part or an error: start afresh
        return None

    def _canonical_size(self, request: object, data: bytes, start: int) -> int | None:
        """The bytes `request` takes, written canonically; None if the scanner must decide.

        `*<count>\r\n`, then `$<length>\r\n<bytes>\r\n` an element, from
        `start` in `data`: each element's header must begin where that layout
        puts it, with `$` (other types' sizes could add up to the same). This runs
        for every request: one loop over its elements, which mypyc compiles.
        (Joining the elements and a table of their lengths' shapes, the way that
        is fastest interpreted, made `feed` three times as slow compiled: 620 to
        656 ns a request of a pipeline of LPUSH and RPOP, against 198 to 211.)
        """
        if type(request) is not list:
            return None
        count = len(request)
        if count > MAX_MULTIBULK:
            return None
        payload = 0
        size = 3 + _digits(count)
        max_bulk = self.max_bulk
        end = len(data)
        if start >= end or data[start] != 42:  # "*": not a push (">") read as a list
            return None
        for element in request:
            if type(element) is not bytes:
                return None
            at = start + size
            if at >= end or data[at] != 36:  # "$"
                return None
            length = len(element)
            if length > max_bulk:
                return None
            payload += length
            size += 5 + length + _digits(length)
        return None if payload > self.max_request else size

    def _scan(self, data: bytes) -> list[Request | Failed]:
        """The framing scanner: any input, any split, Redis' rules and errors.

        Input waits in a bytearray, which grows in place while a large value
        arrives in pieces; what is consumed is cut off once per call.
        """
        buf = self._buf
        buf += data
        if self._need and len(buf) < self._need:
            return []  # the rest of a value: nothing to look at yet
        out: list[Request | Failed] = []
        pos = 0
        size = len(buf)
        while pos < size:
            if self._swallow:
                skipped = min(self._swallow, size - pos)
                self._swallow -= skipped
                pos += skipped
                if not self._swallow:
                    self._element_done(out)
            elif self._need:
                end = pos + self._need
                if end > size:
                    break
                # As Redis does, the two bytes after the data are skipped unread.
                self._args.append(bytes(buf[pos : end - 2]))
                self._need = 0
                pos = end
                self._element_done(out)
            elif not self._left and buf[pos] != 42:  # not "*": an inline command
                newline = buf.find(b"\n", pos)
                if newline < 0:
                    if size - pos > MAX_INLINE:
                        return self._fatal(out, ERRORS["inline"])
                    break
                args = split_inline(bytes(buf[pos:newline]))
                pos = newline + 1
                if args is None:
                    return self._fatal(out, ERRORS["quotes"])
                if args:
                    out.append(args)
            else:
                newline = buf.find(b"\r\n", pos)
                if newline < 0:
                    if size - pos > MAX_INLINE:
                        header = "bulk_header" if self._left else "mbulk_header"
                        return self._fatal(out, ERRORS[header])
                    break
                failure = self._header(buf[pos], bytes(buf[pos + 1 : newline]))
                if failure is not None:
                    return self._fatal(out, failure)
                pos = newline + 2
        del buf[:pos]
        return out

    def _header(self, kind: int, token: bytes) -> str | None:
        """Take a `*<count>` or `$<length>` line; a protocol error's message, or None."""
        if not self._left:
            count = _count(token)
            if count is None or count > MAX_MULTIBULK:
                return ERRORS["mbulk_len"]
            self._left = max(count, 0)
            return None
        if kind != 36:  # "$"
            return f"Protocol error: expected '$', got '{chr(kind)}'"
        length = _length(token)
        if length is None or length > MAX_BULK_LEN:
            return ERRORS["bulk_len"]
        self._kept += length
        if self._refused or length > self.max_bulk or self._kept > self.max_request:
            self._refused = True
            self._args.clear()
            self._swallow = length + 2
        else:
            self._need = length + 2
        return None

    def _element_done(self, out: list[Request | Failed]) -> None:
        self._left -= 1
        if self._left:
            return
        if self._refused:
            out.append(Failed(ERRORS["too_large"]))
        else:
            out.append(self._args)
        self._args = []
        self._kept = 0
        self._refused = False

    def _fatal(self, out: list[Request | Failed], message: str) -> list[Request | Failed]:
        """Input Redis would refuse and close on: answer it, then read no more."""
        self.closed = True
        self._buf.clear()
        out.append(Failed(message, close=True))
        return out


# -- replies ----------------------------------------------------------------------

OK = b"+OK\r\n"
PONG = b"+PONG\r\n"
NIL = b"$-1\r\n"  # a missing value
NIL_ARRAY = b"*-1\r\n"  # a missing list of values (BLPOP's timeout, LPOP with a count)
EMPTY = b"*0\r\n"
NULL3 = b"_\r\n"  # RESP3's null, for clients that asked for it with HELLO 3

Reply = bytes | int | str | None | list["Reply"]


def simple(text: str) -> bytes:
    return b"+%b\r\n" % text.encode()


def integer(value: int) -> bytes:
    return b":%d\r\n" % value


def bulk(value: bytes | None) -> bytes:
    if value is None:
        return NIL
    return b"$%d\r\n%b\r\n" % (len(value), value)


def array(items: Iterable[Reply] | None) -> bytes:
    """An array reply; items are bulk (bytes, None), integer (int) or simple (str) values."""
    if items is None:
        return NIL_ARRAY
    parts = [encode(item) for item in items]
    return b"*%d\r\n%b" % (len(parts), b"".join(parts))


def mapping(pairs: list[tuple[bytes, Reply]]) -> bytes:
    """A RESP3 map reply (HELLO 3)."""
    parts = [encode(key) + encode(value) for key, value in pairs]
    return b"%%%d\r\n%b" % (len(parts), b"".join(parts))


def encode(value: Reply) -> bytes:
    if isinstance(value, bytes) or value is None:
        return bulk(value)
    if isinstance(value, bool):
        return integer(int(value))
    if isinstance(value, int):
        return integer(value)
    if isinstance(value, str):
        return simple(value)
    return array(value)


def error(message: str, code: str = "ERR") -> bytes:
    """An error reply; CR and LF would end it early, so they become spaces (as in Redis)."""
    text = f"-{code} {message}".replace("\r", " ").replace("\n", " ")
    return text.encode("utf-8", "surrogateescape") + b"\r\n"


def error_reply(failure: ProtocolError | Failed) -> bytes:
    """The one place an exception or a refused request becomes an error reply."""
    if isinstance(failure, Failed):
        return error(failure.message)
    return error(failure.message or "error", getattr(failure, "code", "ERR"))


def _digits(n: int) -> int:
    """How many decimal digits `n` (>= 0) is written with."""
    digits = 1
    while n >= 10:
        n //= 10
        digits += 1
    return digits


def quoted(raw: bytes, limit: int = 128) -> str:
    """Client bytes for an error message, as Redis shows them (cut at `limit`)."""
    return raw[:limit].decode("utf-8", "replace")
