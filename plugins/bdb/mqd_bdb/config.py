"""The `[storage.<backend>]` table: tuning for the Berkeley DB environment."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mqd.errors import ConfigError


@dataclass(frozen=True)
class BdbConfig:
    """Tuning of one environment. Every field is a key of the config table."""

    #: Berkeley DB page cache. Messages are not held in Python memory, so this
    #: is most of what the backend adds to the daemon's resident size.
    cache_mb: int = 32
    #: Database page size in bytes (512-65536, a power of two); 0 lets
    #: Berkeley DB choose from the file system's block size.
    page_size: int = 0
    #: In-memory log buffer; a batch larger than this is written in pieces.
    log_buffer_kb: int = 256
    #: Size of each log file before a new one is started.
    log_file_mb: int = 10
    #: Checkpoint once this much log has been written since the last one...
    checkpoint_mb: int = 16
    #: ...or this long after the last one if anything changed. Checkpoints
    #: bound recovery time and let old log files be removed.
    checkpoint_s: float = 60.0
    #: Most operations run in one transaction and share one flush.
    max_batch: int = 512
    #: `bdb` only: queues whose two files are kept open at once (2 descriptors
    #: each); the least recently used are closed beyond this.
    max_open_queues: int = 256
    #: Locks and lock objects the environment can hold at once.
    max_locks: int = 20000

    @classmethod
    def from_table(cls, table: Mapping[str, Any], where: str) -> BdbConfig:
        """Validate a config table; ConfigError names the key and what is allowed."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in table.items():
            spec = known.get(key)
            if spec is None:
                allowed = ", ".join(sorted(known))
                raise ConfigError(f"{where}: unknown key {key!r} (allowed: {allowed})")
            values[key] = _check(where, key, value, spec.default)
        config = cls(**values)
        if config.page_size and (
            config.page_size & (config.page_size - 1) or not 512 <= config.page_size <= 65536
        ):
            raise ConfigError(
                f"{where}: page_size must be 0 or a power of two from 512 to 65536,"
                f" got {config.page_size}"
            )
        return config


def _check(where: str, key: str, value: Any, default: Any) -> Any:
    minimum = 0 if key == "page_size" else 1
    if isinstance(default, float):
        ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        if not ok:
            raise ConfigError(f"{where}: {key} must be a positive number, got {value!r}")
        return float(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}")
    return value
