"""The compiled builds of the hot modules (mqd/native.py) and their pure-Python fallback.

bin/setup builds them and bin/test runs the protocol, wire and Berkeley DB
tests a second time with MQD_PURE_PYTHON=1, so both paths are tested; these
tests check the switch, for mqd's build and the Berkeley DB plugin's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mqd import native

# A module of each build (one in a subpackage), and the build itself.
MODULES = {"mqd.protocol": "mqd", "mqd.backends.memory": "mqd", "mqd_bdb.worker": "mqd_bdb"}
PROBE = """\
import importlib, sys
from mqd import native
module = importlib.import_module(sys.argv[1])
build = {b.package: b for b in native.builds()}[sys.argv[2]]
print(module.__file__)
print(build.state)
"""


def _builds() -> dict[str, native.Native]:
    return {b.package: b for b in native.builds()}


def _probe(module: str, **env: str) -> tuple[str, str]:
    """Where a fresh interpreter loads `module` from, and what its build says."""
    environ = {k: v for k, v in os.environ.items() if k != native.PURE_ENV}
    environ.update(env)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, module, MODULES[module]],
        env=environ,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return out[0], out[1]


def test_the_plugin_build_is_found() -> None:
    builds = _builds()
    assert set(builds) == {"mqd", "mqd_bdb"}
    assert "worker" in builds["mqd_bdb"].modules
    # The plugin's compiled code relies on mqd's types: an edit there makes it stale too.
    assert native.MQD.directory in builds["mqd_bdb"].relies_on


@pytest.mark.parametrize("module", MODULES)
def test_pure_python_when_forced(module: str) -> None:
    path, state = _probe(module, MQD_PURE_PYTHON="1")
    assert path.endswith(module.replace(".", "/") + ".py")
    assert native.PURE_ENV in state


@pytest.mark.parametrize("module", MODULES)
def test_compiled_when_built_and_current(module: str) -> None:
    build = _builds()[MODULES[module]]
    if not build.current():
        pytest.skip(f"no current compiled build of {build.package} (bin/setup makes it)")
    for env in ({}, {native.PURE_ENV: "0"}, {native.PURE_ENV: ""}):
        path, state = _probe(module, **env)
        assert path.startswith(str(build.build_dir)), env
        assert path.endswith(".so"), env
        assert state == f"compiled with mypyc: {', '.join(build.modules)}"
    # One run built them all: the plugin's code sits in mqd's shared library.
    assert build.run_id() == native.MQD.run_id()
    assert native.MQD.manifest_value("packages") == list(_builds())


def _plugin_build(run: object, monkeypatch: pytest.MonkeyPatch) -> tuple[native.Native, list[str]]:
    """The Berkeley DB plugin's build, current but made in run `run`, activated."""
    monkeypatch.delenv(native.PURE_ENV, raising=False)
    plugin = _builds()["mqd_bdb"]
    build = native.Native("mqd_bdb", plugin.directory, plugin.modules, plugin.relies_on)
    manifest = {
        "modules": list(plugin.modules),
        "sources": build.source_digest(),
        "run": run,
        "python": sys.version,
    }
    monkeypatch.setattr(build, "manifest", lambda: manifest)
    path = ["/src/mqd_bdb"]
    build.activate(path)
    return build, path


def test_a_plugin_build_of_another_run_than_mqds_is_not_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its code would be in another run's shared library, compiled against other types.
    monkeypatch.setattr(native.MQD, "compiled", ("message",))
    monkeypatch.setattr(native.MQD, "manifest", lambda: {"run": "mqd's run"})
    build, path = _plugin_build("another run", monkeypatch)
    assert path == ["/src/mqd_bdb"]
    assert "not made with mqd's compiled build" in build.state
    build, path = _plugin_build("mqd's run", monkeypatch)
    assert path[0] == str(build.build_dir / "mqd_bdb")
    assert build.state.startswith("compiled with mypyc")


def test_a_plugin_build_is_not_used_when_mqd_runs_pure_python(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(native.MQD, "compiled", ())
    monkeypatch.setattr(native.MQD, "manifest", lambda: {"run": "mqd's run"})
    build, path = _plugin_build("mqd's run", monkeypatch)
    assert path == ["/src/mqd_bdb"]
    assert "not made with mqd's compiled build" in build.state


def test_a_run_must_start_with_mqds_build() -> None:
    plugin = _builds()["mqd_bdb"]
    with pytest.raises(native.BuildError, match="must be mqd's"):
        native.build([plugin])


def test_stale_build_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    # A build made from other sources (the manifest's digest differs): never loaded.
    monkeypatch.delenv(native.PURE_ENV, raising=False)
    build = native.Native("mqd", native.MQD.directory, ("protocol",))
    monkeypatch.setattr(build, "manifest", lambda: {"modules": ["protocol"], "sources": "0"})
    path: list[str] = ["/src/mqd"]
    build.activate(path)
    assert path == ["/src/mqd"]
    assert "older than the sources" in build.state


def test_source_digest_follows_every_module_and_what_it_relies_on(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "c.py").write_text("z = 3\n")
    build = native.Native("pkg", tmp_path / "pkg", ("a",), relies_on=(tmp_path / "base",))
    digests = {build.source_digest()}
    (tmp_path / "pkg" / "sub" / "b.py").write_text("y = 3\n")
    digests.add(build.source_digest())
    (tmp_path / "base" / "c.py").write_text("z = 4\n")
    digests.add(build.source_digest())
    assert len(digests) == 3


def test_a_build_made_by_another_python_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    # Compiled against another interpreter's headers (a .venv made anew on
    # another release): never loaded, and not current, so bin/setup rebuilds it.
    monkeypatch.delenv(native.PURE_ENV, raising=False)
    build = native.Native("mqd", native.MQD.directory, ("protocol",))
    manifest = {"modules": ["protocol"], "sources": build.source_digest(), "python": "3.11.0 (x)"}
    monkeypatch.setattr(build, "manifest", lambda: manifest)
    path: list[str] = ["/src/mqd"]
    build.activate(path)
    assert path == ["/src/mqd"]
    assert "another Python's" in build.state
    assert not build.current()
    manifest["python"] = sys.version
    assert build.current()
    build.activate(path)
    assert path[0] == str(build.build_dir / "mqd")
