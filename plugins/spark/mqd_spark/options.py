"""The data source's options, checked once, with errors that name the option and what is allowed."""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass

from mqd_spark.wire import (
    MAX_FLAGS,
    MAX_QUEUE_BYTES,
    QUEUE_BREAKERS,
    Address,
    Connection,
    WireError,
    parse_servers,
)

log = logging.getLogger(__name__)

DEFAULT_SERVERS = "127.0.0.1:22133"
MODES = ("peek", "drain")
COMMANDS = ("set", "add")
GLOB_CHARS = frozenset("*?[")
# A partition reads this many ids by default; `partitions` overrides it per queue.
ROWS_PER_PARTITION = 100_000
# How long a drain's leases hold their messages unnamed, by default: longer
# than a job or micro-batch runs, so that none goes back to its queue (to be
# read again) while the job that read it still runs. If the driver dies, its
# messages go back after this.
LEASE_TIMEOUT_S = 3600
MAX_LEASE_TIMEOUT_S = 7 * 24 * 3600  # the daemon's bound on a lease's own timeout


class OptionError(ValueError):
    """A bad option: the message is one line naming the option and what is allowed."""


@dataclass(frozen=True)
class Options:
    servers: tuple[Address, ...]
    queues: tuple[str, ...]  # names or globs; empty when the rows name their queue
    mode: str
    limit: int | None  # at most this many messages per queue and server
    partitions: int | None  # per queue and server; None: one per ROWS_PER_PARTITION ids
    command: str  # for writes: set, or add (a body already in the queue is not stored again)
    exptime: int
    flags: int | None
    timeout: float
    lease_timeout: int  # seconds a drain's lease holds its messages after it was last named

    @property
    def queue(self) -> str | None:
        """The one queue a write goes to (None: the rows' queue column decides)."""
        return self.queues[0] if self.queues else None


def parse(options: Mapping[str, str], *, need_queue: bool = True) -> Options:
    """Checks every option the data source knows; unknown ones are left to Spark."""
    opts = {k.lower(): v for k, v in options.items()}
    try:
        servers = tuple(parse_servers(opts.get("servers", DEFAULT_SERVERS)))
    except ValueError as error:
        raise OptionError(f"mqd option servers: {error}") from None
    queues = tuple(q.strip() for q in opts.get("queue", "").split(",") if q.strip())
    if need_queue and not queues:
        raise OptionError(
            "mqd option queue is missing: name a queue, several (a,b) or a glob (jobs.*)"
        )
    for name in queues:
        if len(name.encode()) > MAX_QUEUE_BYTES or re.search(QUEUE_BREAKERS, name) or "+" in name:
            raise OptionError(
                f"mqd option queue: bad queue name {name!r}: 1-{MAX_QUEUE_BYTES} bytes, no "
                "spaces, control characters, '/' or '+'"
            )
    mode = opts.get("mode", "peek").lower()
    if mode not in MODES:
        raise OptionError(f"mqd option mode={mode!r}: must be one of {', '.join(MODES)}")
    command = opts.get("command", "set").lower()
    if command not in COMMANDS:
        raise OptionError(f"mqd option command={command!r}: must be one of {', '.join(COMMANDS)}")
    limit_key = "max_messages" if "max_messages" in opts else "limit"
    return Options(
        servers=servers,
        queues=queues,
        mode=mode,
        limit=_number(opts, limit_key, minimum=1),
        partitions=_number(opts, "partitions", minimum=1),
        command=command,
        exptime=_number(opts, "exptime", minimum=-(2**31)) or 0,
        flags=_number(opts, "flags", minimum=0, maximum=MAX_FLAGS),
        timeout=float(_number(opts, "timeout", minimum=1) or 30),
        lease_timeout=_number(opts, "lease_timeout", minimum=1, maximum=MAX_LEASE_TIMEOUT_S)
        or LEASE_TIMEOUT_S,
    )


def _number(
    opts: Mapping[str, str], key: str, *, minimum: int, maximum: int = 2**63 - 1
) -> int | None:
    if key not in opts:
        return None
    text = opts[key].strip()
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if not minimum <= value <= maximum:
        bound = f"from {minimum} to {maximum}" if maximum < 2**63 - 1 else f">= {minimum}"
        raise OptionError(f"mqd option {key}={text!r}: must be a whole number {bound}")
    return value


def _matching(options: Options, stats: Mapping[str, object]) -> list[str]:
    """The queues `options` name: its plain names, and the queues in `stats` its globs match.

    A glob passes over a queue whose name is not UTF-8 (the protocol allows
    one): the `queue` column is a string, so its rows could not be given.
    """
    names = {q for q in options.queues if not GLOB_CHARS & set(q)}
    globs = [q for q in options.queues if GLOB_CHARS & set(q)]
    for queue in stats:
        if any(fnmatch.fnmatchcase(queue, g) for g in globs):
            if _is_utf8(queue):
                names.add(queue)
            else:
                log.warning("mqd: queue %a is passed over: its name is not UTF-8", queue)
    return sorted(names)


def _is_utf8(name: str) -> bool:
    """False for a name decoded with surrogateescape from bytes that are not UTF-8."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return True


def _waiting(counts: Mapping[str, int]) -> int:
    return counts.get("items", 0) - counts.get("open", 0)


def survey(options: Options, conn: Connection) -> list[tuple[str, int, int]]:
    """(queue, head id, last id) of each matching queue with messages on one server, now.

    The head is the first waiting message, and the last id assumes the waiting
    messages' ids have no gaps from it (head + waiting - 1): never past the
    real last id, so a range planned now holds only messages there now. With
    gaps (messages taken from the middle: expired, acknowledged by id, moved
    to a dead-letter queue) it is lower than the real one, and a read stops
    that many ids early: a later read gets the rest, never a wrong row.
    """
    stats = conn.queue_stats()
    out = []
    for queue in _matching(options, stats):
        head = conn.head(queue)
        if head is not None:
            out.append((queue, head, head + _waiting(stats.get(queue, {})) - 1))
    return out


def check_range_reads(conn: Connection, found: list[tuple[str, int, int]]) -> None:
    """OptionError, before any task runs, when the daemon cannot read by id (a peek's way)."""
    if not found:
        return
    queue, head, _ = found[0]
    try:
        list(conn.read_ids(queue, head, head))
    except WireError as error:
        raise OptionError(
            f"mqd option mode=peek: {error}: a peek reads by id (gets <q>/at=<id>), which this "
            "backend does not do; use mode=drain"
        ) from None


def waiting(options: Options, conn: Connection) -> list[tuple[str, int]]:
    """(queue, messages waiting: neither open nor leased) of each matching queue on one server."""
    stats = conn.queue_stats()
    out = []
    for queue in _matching(options, stats):
        if (count := _waiting(stats.get(queue, {}))) > 0:
            out.append((queue, count))
    return out
