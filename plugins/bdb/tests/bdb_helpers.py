"""Shared by the Berkeley DB tests: the three backends by name, and a session runner."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from mqd.backend import Backend, Message, Put, StorageOptions, Sync
from mqd.testing.conformance import no_dead_letters, run_with

pytest.importorskip(
    "berkeleydb",
    reason="needs the berkeleydb module: apt-get install libdb5.3-dev; pip install -e plugins/bdb",
)

from mqd_bdb.backend import BdbBackend, BdbRandomBackend, BdbSingleBackend, _BdbBackend

T = TypeVar("T")

ALWAYS = Sync.ALWAYS

BACKENDS: dict[str, type[_BdbBackend]] = {
    "bdb": BdbBackend,
    "bdb-single": BdbSingleBackend,
    "bdb-random": BdbRandomBackend,
}
NAMES = list(BACKENDS)
FIFO_NAMES = ["bdb", "bdb-single"]


def make(name: str, data_dir: Path, sync_interval_ms: int = 1000, **extra: Any) -> _BdbBackend:
    options = StorageOptions(data_dir=data_dir, sync_interval_ms=sync_interval_ms, extra=extra)
    return BACKENDS[name](options)


def session(
    name: str, data_dir: Path, body: Callable[[_BdbBackend], Awaitable[T]], **extra: Any
) -> T:
    """Open backend `name` on `data_dir`, run `body` with it, close it."""
    return run_with(make(name, data_dir, **extra), body)


async def put(
    backend: Backend, queue: str, body: bytes, sync: Sync = ALWAYS, *, unique: bool = False
) -> int | None:
    """The new message's offset, or None when nothing was stored."""
    message = Message(body)
    stored = await backend.put(queue, message, sync=sync, unique=unique)
    return message.offset if stored is Put.STORED else None


async def return_own(backend: Backend) -> list[tuple[str, Message]]:
    """What a starting daemon does: return the leases it held; (queue, message) of each."""
    ended = await backend.reclaim(no_dead_letters, sync=ALWAYS, owner=backend.owner)
    return [(r.queue, r.message) for r in ended]


async def drain(backend: Backend, queue: str) -> list[Message]:
    """Take every waiting message of `queue`."""
    taken = []
    while (message := await backend.take(queue, sync=ALWAYS)) is not None:
        taken.append(message)
    return taken


def fill_up(path: Path) -> None:
    """Write `path` until the disk is full."""
    with open(path, "wb", buffering=0) as filler, contextlib.suppress(OSError):
        while True:
            filler.write(b"\0" * 65536)


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a full disk is simulated with a tmpfs mount: needs root")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)])
    if made.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
