"""How bin/test shares the suite out among its pytest-xdist worker processes.

A pytest plugin, loaded for every run by pyproject.toml (`-p mqd.testing.groups`).

Each test module goes to one worker whole (xdist's `loadscope`), and so do
all the Spark tests, which share one Spark session (a JVM), and all the
Aerospike tests, which share one Aerospike node: a run starts each of those
once, as a run in one process does, rather than once a worker, where several
JVMs at once would slow every test on a small machine.

The grouping is a scheduler of our own rather than xdist's `xdist_group`
marks because those need `--dist loadgroup`, whose groups pytest 9 no longer
sees (xdist renames the tests' ids, which pytest 9 stopped reading).
"""

from __future__ import annotations

from typing import Any

import pytest

GROUPS = {"plugins/spark/": "spark", "plugins/aerospike/": "aerospike"}


def scope_of(nodeid: str) -> str | None:
    """The group a test belongs to, or None: its module's."""
    for prefix, group in GROUPS.items():
        if nodeid.startswith(prefix):
            return group
    return None


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's, when it is there
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class Grouped(LoadScopeScheduling):  # type: ignore[misc]  # xdist is untyped
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid) or super()._split_scope(nodeid)

    return Grouped(config, log)
