"""Compiled builds of the hot modules (mypyc), used when present and current.

The code is mypy-strict, so mypyc compiles it unchanged into C extensions;
the pure-Python sources stay the reference and the fallback. `mqd build-native`
(which `bin/setup` runs) compiles `MODULES` into `mqd/_native/<python tag>/`,
beside the sources but never in place of them. When the package is
imported, `activate` puts that directory first on the package's search path,
so `import mqd.protocol` loads the compiled module, but only if:

- the environment variable MQD_PURE_PYTHON is unset, empty or "0"
  (set it to 1 to force the pure-Python path), and
- the build was made from exactly the sources present now (a digest of every
  module of the package is kept with it: compiled code also relies on the
  types of what it imports). After any edit the pure-Python path is used
  until the next build, so a stale build is never run.

`mqd version` says which path is in use.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

# Modules of the `mqd` package to compile, without ".py": those on every
# command's path that mypyc compiles and whose tests pass compiled.
MODULES = ("protocol",)
PURE_ENV = "MQD_PURE_PYTHON"

PACKAGE = Path(__file__).resolve().parent
BUILD = PACKAGE / "_native" / sys.implementation.cache_tag
MANIFEST = "manifest.json"

# What activate() found, for `mqd version` and the tests.
state = "pure Python (not activated)"
compiled: tuple[str, ...] = ()


def source_digest(package: Path | None = None) -> str:
    """A digest of every module of the package (or a copy of it), in a stable order."""
    package = package or PACKAGE
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        if "_native" in path.relative_to(package).parts:
            continue
        h.update(str(path.relative_to(package)).encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()


def _manifest() -> dict[str, object] | None:
    try:
        data = json.loads((BUILD / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def forced_pure() -> bool:
    return os.environ.get(PURE_ENV, "") not in ("", "0")


def activate(package_path: list[str]) -> None:
    """Put the compiled build first on `package_path` (mqd.__path__) if it may be used."""
    global state, compiled
    if forced_pure():
        state = f"pure Python ({PURE_ENV} is set)"
        return
    manifest = _manifest()
    if manifest is None:
        state = "pure Python (no compiled build: run bin/setup)"
        return
    if manifest.get("sources") != source_digest():
        state = "pure Python (the compiled build is older than the sources: run bin/setup)"
        return
    modules = manifest.get("modules")
    if not isinstance(modules, list):
        state = "pure Python (the compiled build's manifest is damaged: run bin/setup)"
        return
    package_path.insert(0, str(BUILD / "mqd"))
    compiled = tuple(str(m) for m in modules)
    state = f"compiled with mypyc: {', '.join(compiled)}"


class BuildError(Exception):
    """The compiled build could not be made; the message says why."""


def build(force: bool = False) -> str:
    """Compile MODULES unless an up-to-date build is there; return what was done."""
    # Imported here: every start of mqd imports this module, few of them build.
    import shutil
    import subprocess
    import tempfile

    if not force and _manifest() == {"modules": list(MODULES), "sources": source_digest()}:
        return f"up to date: {BUILD}"
    try:
        import mypyc  # noqa: F401  (only checking it is there)
    except ImportError:
        raise BuildError("mypyc is needed to build; it comes with mypy: pip install mypy") from None
    with tempfile.TemporaryDirectory(prefix="mqd-native-") as tmp:
        # mypyc writes its extensions next to the sources it compiles: compile
        # a copy, so the package directory itself never holds a compiled module.
        work = Path(tmp)
        shutil.copytree(
            PACKAGE, work / "mqd", ignore=shutil.ignore_patterns("_native", "__pycache__", "*.so")
        )
        run = subprocess.run(
            [sys.executable, "-m", "mypyc", *(f"mqd/{m}.py" for m in MODULES)],
            cwd=work,
            capture_output=True,
            text=True,
            check=False,
        )
        if run.returncode != 0:
            raise BuildError(f"mypyc failed:\n{run.stdout[-4000:]}{run.stderr[-4000:]}")
        if list(work.glob("*.so")):
            # Several modules compiled together share a runtime library that
            # mypyc puts outside the package, where activate() does not look.
            raise BuildError("MODULES may name one module: several need a shared library")
        # The digest of the copy compiled, should the sources change meanwhile.
        manifest = {"modules": list(MODULES), "sources": source_digest(work / "mqd")}
        staging = BUILD.with_name(BUILD.name + ".new")
        shutil.rmtree(staging, ignore_errors=True)
        (staging / "mqd").mkdir(parents=True)
        for so in (work / "mqd").glob("*.so"):
            shutil.copy2(so, staging / "mqd" / so.name)
        (staging / MANIFEST).write_text(json.dumps(manifest))
    old = BUILD.with_name(BUILD.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if BUILD.exists():
        BUILD.rename(old)
    staging.rename(BUILD)
    shutil.rmtree(old, ignore_errors=True)
    return f"built {', '.join(MODULES)} into {BUILD}"
