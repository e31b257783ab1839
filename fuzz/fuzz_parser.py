"""Coverage-guided fuzzing of the memcached parser (mqd.protocol.Parser) with atheris.

    .venv/bin/python fuzz/fuzz_parser.py --minutes 10        # fuzz for ten minutes
    .venv/bin/python fuzz/fuzz_parser.py -runs=20000         # a bounded run (the test suite's)
    .venv/bin/python fuzz/fuzz_parser.py crash-<sha1>        # replay one input

Each input is a byte stream and a way to cut it into reads. The checks:
- no exception escapes `Parser.feed`, whatever the bytes;
- no desync: the stream fed whole, fed in the input's pieces and fed byte by
  byte gives the same commands (and so the same replies);
- bounded buffers: after every read the parser holds no more than one line
  (MAX_GET_LINE) or one data block (max_item_size + 2) of unconsumed input,
  and its per-connection caches stay bounded.
Half the inputs run with the line limits shrunk (see LINE_LIMITS).

New inputs that reach new code go to --corpus (default .fuzz-corpus/, not
committed); fuzz/seeds/ holds the starting inputs and fuzz/memcached.dict the
protocol's words, both committed. Any other argument is libFuzzer's
(-help=1 lists them). A failing input is written to crash-<sha1> in the
current directory and replays with the last form above.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["mqd"]):
    from mqd import protocol
    from mqd.protocol import Parser

HERE = Path(__file__).resolve().parent
CACHE_LIMIT = 4096  # entries in each of the parser's per-connection caches
BYTE_BY_BYTE = 1024  # longest input also fed one byte per read
# Small enough that the fuzzer reaches large-value swallowing, large enough for
# the seeds' values.
ITEM_SIZES = (16, 64, 1 << 20)
# The parser's line limits, real and shrunk: inputs of a few hundred bytes
# then reach the "line too long" paths that the real limits (2 KiB, 64 KiB)
# put beyond what the fuzzer usually generates. The code is the same; only
# the module constants it reads change.
LINE_LIMITS = ((protocol.MAX_LINE, protocol.MAX_GET_LINE), (40, 120))


def buffered(parser: Parser) -> int:
    """Bytes of input the parser holds without having consumed them."""
    return max(parser._have, len(parser._rest) + sum(len(c) for c in parser._chunks))


def check_bounds(parser: Parser) -> None:
    limit = max(protocol.MAX_GET_LINE, parser.max_item_size + 2)
    held = buffered(parser)
    if held > limit:
        raise AssertionError(f"parser holds {held} bytes of input, more than {limit}")
    if len(parser._keys) > CACHE_LIMIT or len(parser._names) > CACHE_LIMIT:
        raise AssertionError("a per-connection cache outgrew its bound")


def feed_pieces(stream: bytes, cuts: list[int], max_item_size: int) -> list[protocol.Command]:
    parser = Parser(max_item_size)
    out: list[protocol.Command] = []
    start = 0
    for cut in [*cuts, len(stream)]:
        out.extend(parser.feed(stream[start:cut]))
        check_bounds(parser)
        start = cut
    return out


def decode(data: bytes) -> tuple[int, list[int], bytes]:
    """An input as (max_item_size, cut positions, stream).

    Byte 0 picks the item size (and, from 3 up, shrunk line limits), byte 1
    the number of cuts (0-8), then two bytes per cut; the rest is the stream.
    A plain layout rather than FuzzedDataProvider's, so the seeds are easy to
    write by hand.
    """
    mode = data[0] if data else len(ITEM_SIZES) - 1
    protocol.MAX_LINE, protocol.MAX_GET_LINE = LINE_LIMITS[mode // len(ITEM_SIZES) % 2]
    max_item_size = ITEM_SIZES[mode % len(ITEM_SIZES)]
    ncuts = data[1] % 9 if len(data) > 1 else 0
    head = 2 + 2 * ncuts
    raw = [int.from_bytes(data[i : i + 2], "big") for i in range(2, head, 2)]
    stream = data[head:]
    return max_item_size, sorted(c % (len(stream) + 1) for c in raw), stream


def one_input(data: bytes) -> None:
    max_item_size, cuts, stream = decode(data)
    whole = feed_pieces(stream, [], max_item_size)
    pieces = feed_pieces(stream, cuts, max_item_size)
    if pieces != whole:
        raise AssertionError(f"desync at cuts {cuts}:\n whole: {whole}\n split: {pieces}")
    # Byte by byte costs time quadratic in a partial line's length (the parser
    # joins what it holds with each read): kept to short inputs for speed.
    if len(stream) <= BYTE_BY_BYTE:
        single = feed_pieces(stream, list(range(1, len(stream))), max_item_size)
        if single != whole:
            raise AssertionError(f"desync byte by byte:\n whole: {whole}\n bytes: {single}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0], add_help=False)
    parser.add_argument("--minutes", type=float, help="fuzz for this long, then stop")
    parser.add_argument("--corpus", type=Path, default=Path(".fuzz-corpus"))
    ours, libfuzzer = parser.parse_known_args()
    args = [sys.argv[0], "-max_len=8192", f"-dict={HERE / 'memcached.dict'}"]
    if ours.minutes is not None:
        args.append(f"-max_total_time={int(ours.minutes * 60)}")
    replaying = any(not a.startswith("-") for a in libfuzzer)
    if not replaying:
        ours.corpus.mkdir(parents=True, exist_ok=True)
        args += [str(ours.corpus), str(HERE / "seeds")]
    atheris.Setup(args + libfuzzer, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
