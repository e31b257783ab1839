"""The figures behind `stats`: memcached's general lines, per-queue lines, settings.

Gauges come from the store (global when several daemons share it); counters
are this daemon's own. One home for the names, so every view of them (the
`stats` command, metrics, `mqd stats`) says the same.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from mqd import __version__
from mqd.backend import QueueSize
from mqd.config import Config
from mqd.protocol import QUEUE_STATS

if TYPE_CHECKING:
    from mqd.broker import Broker

Figures = list[tuple[str, object]]


@dataclass
class Counters:
    """memcached's general counters, for this daemon; `stats reset` zeroes them."""

    cmd_get: int = 0
    cmd_set: int = 0
    get_hits: int = 0
    get_misses: int = 0
    total_connections: int = 0


def general(broker: Broker, sizes: dict[str, QueueSize]) -> Figures:
    """memcached's general lines, in memcached's order, then mqd's own."""
    now = time.time()
    counters = broker.counters
    return [
        ("pid", os.getpid()),
        ("uptime", int(now - broker.started)),
        ("time", int(now)),
        ("version", __version__),
        ("curr_connections", broker.curr_connections),
        *((f.name, getattr(counters, f.name)) for f in fields(counters)),
        ("curr_items", sum(s.items for s in sizes.values())),
        ("bytes", sum(s.bytes for s in sizes.values())),
        ("backend", broker.backend.name),
    ]


def queues(sizes: dict[str, QueueSize], counts: Callable[[str], tuple[int, int, int]]) -> Figures:
    """`queue_<name>_<stat>` lines, by queue name; `counts` gives enqueued, dequeued, expired."""
    lines: Figures = []
    now = time.time()
    for queue, gauges in sorted(sizes.items()):
        age = int((now - gauges.head_created) * 1000) if gauges.head_created else 0
        values = (gauges.items, gauges.bytes, gauges.open, *counts(queue), max(age, 0))
        prefix = "queue_" + queue + "_"
        lines.extend(zip([prefix + n for n in QUEUE_STATS], values, strict=True))
    return lines


def queue_stat(name: str) -> tuple[str, str] | None:
    """(queue, stat) of a `queue_<name>_<stat>` line's name; None for a general one."""
    if not name.startswith("queue_"):
        return None
    stat = next((s for s in QUEUE_STATS if name.endswith("_" + s)), None)
    return None if stat is None else (name[len("queue_") : -len(stat) - 1], stat)


def settings(config: Config, backend: str) -> Figures:
    """memcached's `stats settings` names, for what mqd has, then mqd's own."""
    return [
        ("maxconns", config.max_connections),
        ("tcpport", config.port),
        ("inter", config.listen),
        ("item_size_max", config.max_item_size),
        ("idle_timeout", int(config.idle_timeout)),
        ("flush_enabled", "yes" if config.allow_flush_all else "no"),
        ("shutdown_command", "yes" if config.allow_shutdown else "no"),
        ("num_threads", 1),
        ("backend", backend),
        ("max_wait", config.max_wait),
    ]
