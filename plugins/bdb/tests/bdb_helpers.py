"""Shared by the Berkeley DB tests: the three backends, by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mqd.backend import Backend, StorageOptions

pytest.importorskip(
    "berkeleydb",
    reason="needs the berkeleydb module: apt-get install libdb5.3-dev; pip install -e plugins/bdb",
)

from mqd_bdb.backend import BdbBackend, BdbRandomBackend, BdbSingleBackend

BACKENDS: dict[str, type[Backend]] = {
    "bdb": BdbBackend,
    "bdb-single": BdbSingleBackend,
    "bdb-random": BdbRandomBackend,
}


def make(name: str, data_dir: Path, **extra: Any) -> Backend:
    return BACKENDS[name](StorageOptions(data_dir=data_dir, extra=extra))
