"""The `[storage.<backend>]` table: tuning for the Berkeley DB environment."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mqd.config import TableReader

#: The keys whose value may be 0 (the others must be at least 1).
_ZERO_OK = frozenset({"page_size", "reserve_mb", "loop_sync_max_us"})
#: Upper bounds, where the default bound (2**63 - 1) is more than the
#: environment takes: Berkeley DB's API takes these sizes as C ints (the log
#: file's and buffer's in bytes, the checkpoint's in KiB), and a cache of
#: over 1 TiB is beyond any machine this runs on (Berkeley DB's own limit is 10 TB).
_HIGH: dict[str, int] = {
    "cache_mb": 1 << 20,
    "log_buffer_kb": 1 << 20,
    "log_file_mb": (2**31 - 1) >> 20,
    "checkpoint_mb": (2**31 - 1) >> 10,
    "max_locks": 2**31 - 1,
}
#: Fields that come from [storage], not from the backend's own table.
_FROM_STORAGE = frozenset({"max_disk_bytes"})


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
    #: Write each new log file full of zeros when it is started, so that a sync
    #: of the log writes its data only, not also the file's new size and
    #: blocks: on ext4 that makes each sync about a third cheaper, for a pause
    #: of a few ms per log file. Of no use on copy-on-write file systems
    #: (btrfs, ZFS), which write a zeroed block anew anyway.
    zero_log_files: bool = True
    #: Checkpoint once this much log has been written since the last one...
    checkpoint_mb: int = 16
    #: ...or this long after the last one if anything changed. Checkpoints
    #: bound recovery time and let old log files be removed.
    checkpoint_s: float = 60.0
    #: A round's sync is done by the kernel while the event loop goes on (Linux
    #: AIO's fdatasync, mqd_bdb.logsync), where the kernel offers it; false, or
    #: where it does not, loop_sync_max_us decides where the sync runs.
    aio_sync: bool = True
    #: A round's sync runs on the event loop itself while syncs take less than
    #: this on average (handing it to the sync thread and back costs more than
    #: a fast sync), on the sync thread otherwise, so that a slow disk does not
    #: hold up queues that do not wait for it; 0: always on the sync thread.
    loop_sync_max_us: int = 1000
    #: Most operations run in one transaction and share one flush.
    max_batch: int = 512
    #: `bdb` only: queues whose two files are kept open at once (2 descriptors
    #: each); the least recently used are closed beyond this.
    max_open_queues: int = 256
    #: Locks and lock objects the environment can hold at once.
    max_locks: int = 20000
    #: A file of this many MiB kept in the data directory and removed when the
    #: disk fills, so that gets, deletes and checkpoints (which free space)
    #: still have room for their log and for the cache's dirty pages; 0 (the
    #: default) sizes it so: cache_mb + 2 * log_file_mb.
    reserve_mb: int = 0
    #: [storage] max_disk_bytes: sets are refused (`SERVER_ERROR out of memory
    #: storing object`) once the data directory's files (the reserve aside) hold
    #: this many bytes; 0: no bound.
    max_disk_bytes: int = 0

    @classmethod
    def from_table(
        cls, table: Mapping[str, Any], path: Path | None, where: str, max_disk_bytes: int = 0
    ) -> BdbConfig:
        """Validate a config table; ConfigError names file, key, value and what is allowed."""
        reader = TableReader(path, dict(table), f"{where}.")
        fields = [f for f in dataclasses.fields(cls) if f.name not in _FROM_STORAGE]
        values: dict[str, Any] = {}
        for spec in fields:
            if spec.name not in reader.table:
                continue
            if isinstance(spec.default, bool):
                values[spec.name] = reader.boolean(spec.name)
            elif isinstance(spec.default, float):
                values[spec.name] = reader.number(spec.name, 0.0, above=True)
            else:
                low = 0 if spec.name in _ZERO_OK else 1
                values[spec.name] = reader.integer(spec.name, low, _HIGH.get(spec.name, 2**63 - 1))
        reader.leftovers([spec.name for spec in fields])
        config = cls(**values, max_disk_bytes=max_disk_bytes)
        memory_mb = (os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) >> 20
        if config.cache_mb > memory_mb:
            # Berkeley DB would fail to make the region, and say only that the
            # environment "needs recovery".
            allowed = f"must be at most this machine's memory, {memory_mb} MiB"
            raise reader.fail("cache_mb", config.cache_mb, allowed)
        size = config.page_size
        if size and (size & (size - 1) or not 512 <= size <= 65536):
            allowed = "must be 0 or a power of two from 512 to 65536"
            raise reader.fail("page_size", size, allowed)
        return config

    @property
    def reserve_bytes(self) -> int:
        """The reserve file's size."""
        return (self.reserve_mb or self.cache_mb + 2 * self.log_file_mb) << 20
