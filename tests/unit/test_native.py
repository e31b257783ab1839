"""The compiled build of the hot modules (mqd/native.py) and its pure-Python fallback.

bin/setup builds it and bin/test runs the protocol and wire tests a second time
with MQD_PURE_PYTHON=1, so both paths are tested; these tests check the switch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mqd import native

PROBE = "import mqd.native, mqd.protocol; print(mqd.protocol.__file__); print(mqd.native.state)"


def _probe(**env: str) -> tuple[str, str]:
    """Where a fresh interpreter loads mqd.protocol from, and what mqd.native says."""
    environ = {k: v for k, v in os.environ.items() if k != native.PURE_ENV}
    environ.update(env)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=environ, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return out[0], out[1]


def _current_build() -> bool:
    try:
        manifest = json.loads((native.BUILD / native.MANIFEST).read_text())
    except OSError:
        return False
    return bool(manifest.get("sources") == native.source_digest())


def test_pure_python_when_forced() -> None:
    path, state = _probe(MQD_PURE_PYTHON="1")
    assert path.endswith("mqd/protocol.py")
    assert native.PURE_ENV in state


@pytest.mark.skipif(not _current_build(), reason="no current compiled build (bin/setup makes it)")
def test_compiled_when_built_and_current() -> None:
    for env in ({}, {native.PURE_ENV: "0"}, {native.PURE_ENV: ""}):
        path, state = _probe(**env)
        assert path.startswith(str(native.BUILD)), env
        assert path.endswith(".so"), env
        assert state == "compiled with mypyc: protocol"


def test_stale_build_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    # A build made from other sources (the manifest's digest differs): never loaded.
    monkeypatch.delenv(native.PURE_ENV, raising=False)
    monkeypatch.setattr(native, "state", native.state)  # restored afterwards
    monkeypatch.setattr(native, "_manifest", lambda: {"modules": ["protocol"], "sources": "0"})
    path: list[str] = ["/src/mqd"]
    native.activate(path)
    assert path == ["/src/mqd"]
    assert "older than the sources" in native.state


def test_source_digest_follows_every_module(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    monkeypatch.setattr(native, "PACKAGE", tmp_path)
    before = native.source_digest()
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    assert native.source_digest() != before
