"""A short, bounded run of the parser fuzzer (fuzz/fuzz_parser.py), and its checks."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from mqd import protocol

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "fuzz" / "fuzz_parser.py"

pytest.importorskip("atheris", reason="atheris is installed by bin/setup --test")


@pytest.fixture(autouse=True)
def line_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fuzzer shrinks the parser's line limits for some inputs: restore them after."""
    monkeypatch.setattr(protocol, "MAX_LINE", protocol.MAX_LINE)
    monkeypatch.setattr(protocol, "MAX_GET_LINE", protocol.MAX_GET_LINE)


def fuzzer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fuzz_parser", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_bounded_fuzzing_run_finds_nothing(tmp_path: Path) -> None:
    # 10,000 inputs from the seeds, coverage-guided: a few seconds.
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--corpus",
            str(tmp_path / "corpus"),
            "-runs=10000",
            "-max_total_time=90",
            "-seed=1",
            f"-artifact_prefix={tmp_path}/",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Done 10000 runs" in result.stderr
    assert not list(tmp_path.glob("crash-*"))


def test_every_seed_passes_the_checks() -> None:
    module = fuzzer()
    seeds = sorted((ROOT / "fuzz" / "seeds").iterdir())
    assert len(seeds) >= 5
    for seed in seeds:
        module.one_input(seed.read_bytes())


def test_the_checks_catch_a_desync_and_a_growing_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    module = fuzzer()
    stream = b"\x02\x01\x00\x05set q 0 0 1\r\nx\r\n"  # 1 MiB items, one cut after "set "
    module.one_input(stream)
    real_feed = protocol.Parser.feed

    def forgets_short_reads(self: protocol.Parser, data: bytes) -> list[protocol.Command]:
        return [] if len(data) < 3 else real_feed(self, data)

    monkeypatch.setattr(protocol.Parser, "feed", forgets_short_reads)
    with pytest.raises(AssertionError, match="desync"):
        module.one_input(stream)
    monkeypatch.setattr(protocol.Parser, "feed", real_feed)

    parser = protocol.Parser(16)
    parser.feed(b"get " + b"k" * (protocol.MAX_GET_LINE - 4))  # the longest line, unfinished
    assert module.buffered(parser) == protocol.MAX_GET_LINE
    module.check_bounds(parser)
    parser._rest += b"k"  # one byte past what the parser may hold
    parser._have += 1
    with pytest.raises(AssertionError, match="holds"):
        module.check_bounds(parser)
