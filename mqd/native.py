"""Compiled builds of the hot modules (mypyc), used when present and current.

The code is mypy-strict, so mypyc compiles it unchanged into C extensions;
the pure-Python sources stay the reference and the fallback. Each package
with hot modules has a `Native`: mqd's own (`MQD`: parser, connection, broker) and
those plugins name in the `mqd.native` entry-point group (the Berkeley DB
plugin's store and worker). `mqd build-native` (which `bin/setup` runs)
compiles every package's modules in one mypyc run, one group whose shared
library sits in mqd's build, each package's extensions in
`<package>/_native/<python tag>/`, beside the sources but never in place of
them. One run, so that a plugin's compiled code reaches mqd's compiled
classes (a Message's fields) directly: built on its own, mypyc takes another
package's classes for interpreted ones, and every field read or write of
them is a generic attribute lookup. When the package is
imported, `activate` puts that directory first on the package's search path,
so `import mqd.protocol` loads the compiled module, but only if:

- the environment variable MQD_PURE_PYTHON is unset, empty or "0"
  (set it to 1 to force the pure-Python path everywhere), and
- the build was made from exactly the sources present now (a digest of every
  module of the package, and of the packages it relies on, is kept with it:
  compiled code also relies on the types of what it imports). After any edit
  the pure-Python path is used until the next build, so a stale build is
  never run.
- the build was made by this very interpreter (its `sys.version`, which names
  the release and the build): extensions are compiled against one
  interpreter's headers, and a .venv made anew on another Python of the same
  minor version would otherwise load them.
- for a plugin, mqd's own build is in use and came from the same run (its
  code is in mqd's shared library, and compiled against mqd's).

`mqd version` says which path each package is on.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path

PURE_ENV = "MQD_PURE_PYTHON"
ENTRY_POINTS = "mqd.native"  # plugins' builds: a Native each
MANIFEST = "manifest.json"
GROUP_OWNER = "mqd"  # the package whose build holds the shared library of the run

# Compiles the modules given into extensions in place, all of them in one
# group whose shared library sits inside the package (argv[1] names it), where
# activate() finds it; mypyc's own command line puts it outside. The group is
# one C file, compiled by one gcc: most of `bin/setup`'s time (3 min 17 s on
# two cores). mypyc's multi_file (a C file a module) took 1 min 42 s, but the
# memory path then cost 2 to 6 % more CPU a command (benchmarks/run_path.py:
# 716 against 676 ns 16 per read, 1,377 against 1,356 one per read), as gcc
# no longer inlines across modules; gcc's -O2 saved 24 s. The build runs once,
# every command after it: one file.
_SETUP = """\
import sys
from mypyc.build import mypycify
from setuptools import setup
setup(
    name="mqd-native",
    ext_modules=mypycify(["--ignore-missing-imports", *sys.argv[2:]], group_name=sys.argv[1]),
    script_args=["build_ext", "--inplace"],
)
"""


class BuildError(Exception):
    """The compiled build could not be made; the message says why."""


def forced_pure() -> bool:
    return os.environ.get(PURE_ENV, "") not in ("", "0")


def _digest(roots: Sequence[Path]) -> str:
    """A digest of every module under `roots`, in a stable order."""
    h = hashlib.sha256()
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            relative = path.relative_to(root)
            if "_native" in relative.parts:
                continue
            h.update(f"{root.name}/{relative}".encode() + b"\0")
            h.update(path.read_bytes())
    return h.hexdigest()


class Native:
    """The compiled build of one package's hot modules."""

    def __init__(
        self,
        package: str,
        directory: Path,
        modules: tuple[str, ...],
        relies_on: tuple[Path, ...] = (),
    ) -> None:
        self.package = package  # the import name, e.g. "mqd_bdb"
        self.directory = directory  # the package's sources
        # Which of them to compile, dotted below the package ("backends.memory").
        self.modules = modules
        self.relies_on = relies_on  # other packages whose types the modules use
        self.build_dir = directory / "_native" / sys.implementation.cache_tag
        # What activate() found, for `mqd version` and the tests.
        self.state = "pure Python (not activated)"
        self.compiled: tuple[str, ...] = ()

    def _roots(self, base: Path | None = None) -> list[Path]:
        roots = [self.directory, *self.relies_on]
        return roots if base is None else [base / root.name for root in roots]

    def source_digest(self) -> str:
        """The digest of the sources present now (the build's must match it)."""
        return _digest(self._roots())

    def manifest(self) -> dict[str, object] | None:
        try:
            data = json.loads((self.build_dir / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def current(self) -> bool:
        """Whether there is a build of these modules made from the sources present."""
        manifest = self.manifest() or {}
        wanted = {
            "modules": list(self.modules),
            "sources": self.source_digest(),
            "python": sys.version,
        }
        return all(manifest.get(key) == value for key, value in wanted.items())

    def manifest_value(self, key: str) -> object:
        """One entry of the build's manifest (None: no build, or no such entry)."""
        return (self.manifest() or {}).get(key)

    def run_id(self) -> object:
        """Which run of `build` made this package's build (None: none there)."""
        return self.manifest_value("run")

    def activate(self, package_path: list[str]) -> None:
        """Put the compiled build first on `package_path` (the package's __path__) if usable."""
        if forced_pure():
            self.state = f"pure Python ({PURE_ENV} is set)"
            return
        manifest = self.manifest()
        if manifest is None:
            self.state = "pure Python (no compiled build: run bin/setup)"
            return
        if manifest.get("sources") != self.source_digest():
            self.state = "pure Python (the compiled build is older than the sources: run bin/setup)"
            return
        if manifest.get("python") != sys.version:
            self.state = "pure Python (the compiled build is another Python's: run bin/setup)"
            return
        modules = manifest.get("modules")
        if not isinstance(modules, list):
            self.state = "pure Python (the compiled build's manifest is damaged: run bin/setup)"
            return
        if self.package != GROUP_OWNER and (
            not MQD.compiled or manifest.get("run") != MQD.run_id()
        ):
            # Its code lives in the shared library of mqd's build: only that run's will do.
            self.state = "pure Python (not made with mqd's compiled build in use: run bin/setup)"
            return
        package_path.insert(0, str(self.build_dir / self.package))
        self.compiled = tuple(str(m) for m in modules)
        self.state = f"compiled with mypyc: {', '.join(self.compiled)}"

    def activate_subpackage(self, name: str, package_path: list[str]) -> None:
        """Put the build's part for subpackage `name` first on its __path__, if activated."""
        if any(m.startswith(name + ".") for m in self.compiled):
            package_path.insert(0, str(self.build_dir / self.package / name))


#: mqd's own hot modules, on every command's path: the memcached parser and
#: reply rendering, the connection, the broker, the message and what they share,
#: the backend interface and the memory backend; and the Redis listener's
#: commands and replies, whose Python was most of a Redis command's cost
#: (pipelined on bdb `always`, 124k to 160k ops/s interpreted, 261k compiled,
#: benchmarks/RESULTS.md). With Backend compiled, the
#: backends compiled with it are native classes: their fields and methods are
#: reached directly, not looked up by name (about a tenth of a memory command's
#: CPU time); plugins that are not compiled still subclass it (it allows them).
MQD = Native(
    "mqd",
    Path(__file__).resolve().parent,
    (
        "backend",
        "backends.memory",
        "broker",
        "connection",
        "eager",
        "message",
        "protocol",
        "redis_server",
        "resp",
        "stats",
    ),
)


def build(natives: Sequence[Native], force: bool = False) -> list[str]:
    """Compile the modules of `natives` (mqd's first) in one run unless their builds are
    current and of one run; what was done, a line each."""
    # Imported here: every start of mqd imports this module, few of them build.
    import shutil
    import subprocess
    import tempfile

    packages = [n.package for n in natives]
    if packages[0] != GROUP_OWNER:
        raise BuildError(f"the first build of a run must be {GROUP_OWNER}'s, not {packages[0]}'s")
    one_run = len({n.run_id() for n in natives}) == 1
    built = natives[0].manifest_value("packages") == packages
    if not force and one_run and built and all(n.current() for n in natives):
        return [f"{n.package}: up to date: {n.build_dir}" for n in natives]
    try:
        import mypyc  # noqa: F401  (only checking it is there)
    except ImportError:
        needed = "mypyc is needed to build; it comes with mypy: pip install mypy"
        raise BuildError(needed) from None
    roots = {root.name: root for n in natives for root in n._roots()}
    with tempfile.TemporaryDirectory(prefix="mqd-native-") as tmp:
        # mypyc writes its extensions next to the sources it compiles:
        # compile a copy, so no package directory ever holds a compiled module.
        work = Path(tmp)
        for name, root in roots.items():
            shutil.copytree(
                root,
                work / name,
                ignore=shutil.ignore_patterns("_native", "__pycache__", "*.so", "*.egg-info"),
            )
        sources = [f"{n.package}/{m.replace('.', '/')}.py" for n in natives for m in n.modules]
        run = subprocess.run(
            [sys.executable, "-c", _SETUP, f"{GROUP_OWNER}.native", *sources],
            cwd=work,
            capture_output=True,
            text=True,
            check=False,
        )
        if run.returncode != 0:
            raise BuildError(f"mypyc failed:\n{run.stdout[-4000:]}{run.stderr[-4000:]}")
        if list(work.glob("*.so")):
            outside = f"mypyc put a library outside {GROUP_OWNER}, where activate() misses it"
            raise BuildError(outside)
        # The digests of the copy compiled, should the sources change meanwhile;
        # the run's id, from all of them, ties each plugin's build to mqd's.
        digests = {n.package: _digest(n._roots(work)) for n in natives}
        run_id = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()
        staged = []
        for n in natives:
            manifest = {
                "modules": list(n.modules),
                "sources": digests[n.package],
                "run": run_id,
                "python": sys.version,
            }
            if n.package == GROUP_OWNER:
                manifest["packages"] = packages
            staging = n.build_dir.with_name(n.build_dir.name + ".new")
            shutil.rmtree(staging, ignore_errors=True)
            (staging / n.package).mkdir(parents=True)
            for so in (work / n.package).rglob("*.so"):
                target = staging / n.package / so.relative_to(work / n.package)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(so, target)
            (staging / MANIFEST).write_text(json.dumps(manifest))
            staged.append((n, staging))
    for n, staging in staged:
        old = n.build_dir.with_name(n.build_dir.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if n.build_dir.exists():
            n.build_dir.rename(old)
        staging.rename(n.build_dir)
        shutil.rmtree(old, ignore_errors=True)
    return [f"{n.package}: built {', '.join(n.modules)} into {n.build_dir}" for n in natives]


def builds() -> list[Native]:
    """mqd's build and those of the installed plugins (the `mqd.native` entry points)."""
    found = [MQD]
    for entry in entry_points(group=ENTRY_POINTS):
        try:
            plugin = entry.load()
        except ImportError:
            continue  # a plugin that can't be imported can't run either: nothing to build
        if isinstance(plugin, Native):
            found.append(plugin)
    return found
