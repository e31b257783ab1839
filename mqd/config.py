"""Configuration as plain data, built in layers: defaults, the TOML file, flags.

Every key is documented in etc/mqd.toml. A bad file or value raises
ConfigError with one line naming the file, the key, the bad value and what is
allowed; `mqd serve` and `mqd check-config` print it and exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import fnmatch
import ipaddress
import logging
import math
import os
import re
import socket
import tomllib
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mqd import backend as backends
from mqd import protocol
from mqd.backend import StorageOptions, Sync
from mqd.errors import BackendLoadError, ConfigError, StorageError

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
OVERFLOW = ("reject", "drop_oldest")
LOOPS = ("asyncio", "uvloop", "auto")
#: memcached's own bound on an item (its -I): a `<bytes>` the wire can carry.
MAX_ITEM_SIZE = 1 << 30
DAEMON_ID_FILE = "daemon-id"  # in data_dir, when [storage] daemon_id is not set
#: The daemon-id files this process holds locked, for as long as it runs (owner()).
_HELD_IDS: dict[Path, int] = {}


@dataclass(frozen=True)
class QueueSettings:
    """Per-queue behaviour, from the `[queues."<glob>"]` tables that match its name."""

    max_items: int = 0  # 0: unlimited
    max_bytes: int = 0  # 0: unlimited; body bytes, open messages included
    max_item_size: int = 1 << 20
    overflow: str = "reject"
    unique: bool = False
    visibility_timeout: float = 60.0  # seconds; 0: an open message never times out
    max_deliveries: int = 0  # 0: unlimited
    dead_letter: str = ""  # "": "<queue>_dead"
    sync: Sync = Sync.ALWAYS
    idle_expiry: float = 0.0  # seconds an empty, unused queue lives on; 0: for ever

    def dead_letter_for(self, queue: str) -> str:
        return self.dead_letter or f"{queue}_dead"


@dataclass(frozen=True)
class Config:
    """Everything `mqd serve` needs, after every layer has been applied."""

    path: Path | None = None
    # [server]
    listen: str = "127.0.0.1"
    port: int = 22133
    max_connections: int = 4096
    idle_timeout: float = 0.0  # seconds; 0: never
    command_timeout: float = 30.0  # seconds one command may take to arrive; 0: no bound
    max_wait: float = 30.0  # cap on a get's /t= wait, seconds
    allow_flush_all: bool = True
    allow_shutdown: bool = False
    log_level: str = "info"
    loop: str = "auto"
    shutdown_timeout: float = 10.0
    # [server.tls]: TLS when both cert_file and key_file are set; ca_file: clients need a cert
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_ca_file: Path | None = None
    # [server.auth]: clients must log in first, with a user:password from this file
    auth_users_file: Path | None = None
    # [metrics]: Prometheus at http://<metrics_listen>:<metrics_port>/metrics; port 0: off
    metrics_listen: str = "127.0.0.1"
    metrics_port: int = 0
    # [server.redis]: the Redis listener, off unless the table is there
    redis_listen: str = ""  # "": the address of `listen`
    redis_port: int | None = None
    # [storage]
    backend: str = "bdb"
    data_dir: Path = Path("data")
    sync_interval_ms: int = 1000
    daemon_id: str = ""  # owner of this daemon's leases; "": one kept in data_dir
    reclaim_interval: float = 1.0  # seconds between reclaims on a shared store
    poll_interval_ms: int = 50  # shared store: a waiting get polls at most this often
    max_disk_bytes: int = 0  # disk backends refuse sets beyond this; 0: no bound
    # [storage.<name>] tables, by backend name: each belongs to its backend
    backend_tables: dict[str, dict[str, Any]] = field(default_factory=dict)
    # [queues."<glob>"], in file order; later matches override earlier ones
    queues: tuple[tuple[str, dict[str, Any]], ...] = ()

    @property
    def idle_expiry_used(self) -> bool:
        """Whether any queue may expire when idle: only then is there anything to sweep."""
        return any(values.get("idle_expiry") for _, values in self.queues)

    def queue_settings(self, queue: str) -> QueueSettings:
        """The settings of `queue`: defaults overlaid by every matching table in order."""
        overrides: dict[str, Any] = {}
        for pattern, values in self.queues:
            if fnmatch.fnmatchcase(queue, pattern):
                overrides.update(values)
        return dataclasses.replace(_QUEUE_DEFAULTS, **overrides) if overrides else _QUEUE_DEFAULTS

    @property
    def max_item_size(self) -> int:
        """The largest value any queue accepts: the parser buffers no more than this."""
        sizes: list[int] = [v["max_item_size"] for _, v in self.queues if "max_item_size" in v]
        return max([_QUEUE_DEFAULTS.max_item_size, *sizes])

    def storage_options(self) -> StorageOptions:
        return StorageOptions(
            config_path=self.path,
            data_dir=self.data_dir,
            sync_interval_ms=self.sync_interval_ms,
            poll_interval_ms=self.poll_interval_ms,
            max_disk_bytes=self.max_disk_bytes,
            extra=self.backend_tables.get(self.backend, {}),
        )

    def owner(self, exclusive: bool = False) -> str:
        """This daemon's id: the configured one, or one kept in the data directory.

        It owns the daemon's leases, so it must survive restarts: a restarting
        daemon returns its own leases from before at once, and only those.
        `exclusive` (a store that daemons share): the file is held locked for
        as long as this process runs, so that no other daemon takes the id.
        """
        if self.daemon_id:
            return self.daemon_id
        path = Path(self.data_dir) / DAEMON_ID_FILE
        if exclusive:
            _hold(path)
        with contextlib.suppress(FileNotFoundError):
            try:
                known = path.read_text(encoding="utf-8").strip()
            except UnicodeDecodeError:
                raise StorageError(
                    f"{path}: not UTF-8 text; it holds this daemon's id: write the id "
                    "there, or remove the file for a new one"
                ) from None
            if known:
                return known
        made = uuid.uuid4().hex
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(made + "\n")
        return made

    @property
    def log_level_number(self) -> int:
        return int(getattr(logging, self.log_level.upper()))


def _hold(path: Path) -> None:
    """Lock the daemon-id file, or refuse: two daemons with one id would each take
    the other's open messages for their own, on a store they share."""
    if path in _HELD_IDS:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    _HELD_IDS[path] = lock_exclusive(
        path,
        f"{path}: in use by another daemon; give each daemon its own data "
        "directory, or its own [storage] daemon_id",
    )


def lock_exclusive(path: Path, refusal: str) -> int:
    """An exclusive lock on `path` (made if missing), held while the returned
    descriptor stays open; StorageError(refusal) if another process holds it."""
    try:
        fd = os.open(path, os.O_RDONLY)  # a lock needs no more
    except FileNotFoundError:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StorageError(refusal) from None
    return fd


_QUEUE_DEFAULTS = QueueSettings()


# -- validation ---------------------------------------------------------------


class TableReader:
    """Reads typed values out of a TOML table, naming file and key in every error.

    Backends validate their `[storage.<name>]` table with it too, so every
    config error reads the same way.
    """

    def __init__(
        self, path: Path | None, table: dict[str, Any], prefix: str, label: str = ""
    ) -> None:
        self.path = path
        self.table = dict(table)
        self.prefix = prefix
        self.label = label  # names the value instead of file and key: "--port", "MQD_PORT"

    def fail(self, key: str, value: object, allowed: str) -> ConfigError:
        where = f"{self.path}: " if self.path else ""
        name = self.label or f"{where}{self.prefix}{key}"
        shown = str(value).lower() if isinstance(value, bool) else repr(value)  # as TOML spells it
        return ConfigError(f"{name} = {shown}: {allowed}")

    def take(self, key: str, kind: type | tuple[type, ...], allowed: str) -> Any:
        value = self.table.pop(key)
        # bool is an int in Python, but `port = true` is a mistake.
        if isinstance(value, bool) and bool not in _as_tuple(kind):
            raise self.fail(key, value, allowed)
        if not isinstance(value, kind):
            raise self.fail(key, value, allowed)
        return value

    def integer(self, key: str, low: int = 0, high: int = 2**63 - 1) -> int:
        allowed = f"must be a whole number from {low} to {high}"
        value: int = self.take(key, int, allowed)
        if not low <= value <= high:
            raise self.fail(key, value, allowed)
        return value

    def number(self, key: str, low: float = 0.0, *, above: bool = False) -> float:
        """A finite number of at least `low` (more than `low` with `above`)."""
        allowed = f"must be a finite number {'above' if above else 'of at least'} {low}"
        value = self.take(key, (int, float), allowed)
        # TOML has nan and inf: neither is a duration or a size.
        if not math.isfinite(value) or value < low or (above and value == low):
            raise self.fail(key, value, allowed)
        return float(value)

    def boolean(self, key: str) -> bool:
        return bool(self.take(key, bool, "must be true or false"))

    def string(self, key: str) -> str:
        return str(self.take(key, str, "must be a string"))

    def host(self, key: str, empty: str = "") -> str:
        """An address to listen on: an IP address or a host name, without a port.

        Checked by its spelling only (a name is resolved when the daemon
        binds): `127.0.0.1:22133` would otherwise pass, then fail at start
        with the port glued to the name. "" is allowed where `empty` says
        what it stands for.
        """
        allowed = (
            "must be an IP address or a host name, without a port"
            " (0.0.0.0: every IPv4 address, ::: every address)"
        )
        if empty:
            allowed += f' (or "": {empty})'
        value = str(self.take(key, str, allowed))
        if not (value == "" and empty) and not _is_host(value):
            raise self.fail(key, value, allowed)
        return value

    def queue(self, key: str) -> str:
        """A name the protocol allows for a queue, so that clients can reach it; or ""
        (the key's default)."""
        allowed = (
            'must be "" or a queue name: 1-250 bytes, no whitespace, control bytes or /,'
            " at most one + (a fanout child)"
        )
        value = self.take(key, str, allowed)
        if value and protocol.queue_name(protocol.name_bytes(value)) is None:
            raise self.fail(key, value, allowed)
        return str(value)

    def choice(self, key: str, choices: tuple[str, ...]) -> str:
        allowed = "must be one of " + ", ".join(f'"{c}"' for c in choices)
        value = self.take(key, str, allowed)
        if value not in choices:
            raise self.fail(key, value, allowed)
        return str(value)

    def leftovers(self, known: list[str]) -> None:
        for key, value in self.table.items():
            raise self.fail(key, value, "unknown key; known keys: " + ", ".join(known))


#: A host name's spelling (RFC 1123): dot-separated labels of letters, digits
#: and inner hyphens, the last not all digits (that would be a bad IPv4 address).
_HOST_NAME = re.compile(
    r"((?!-)[A-Za-z0-9-]{1,63}(?<!-)\.)*(?![0-9]+\.?$)(?!-)[A-Za-z0-9-]{1,63}(?<!-)\.?"
)


def _is_host(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return len(value) <= 253 and _HOST_NAME.fullmatch(value) is not None
    return True


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


_SERVER_KEYS: dict[str, str] = {
    "listen": "host",
    "port": "port",
    "max_connections": "positive",
    "idle_timeout": "number",
    "command_timeout": "number",
    "max_wait": "number",
    "allow_flush_all": "boolean",
    "allow_shutdown": "boolean",
    "log_level": "log_level",
    "loop": "loop",
    "shutdown_timeout": "number",
}
_TLS_KEYS: dict[str, str] = {"cert_file": "path", "key_file": "path", "ca_file": "path"}
_AUTH_KEYS: dict[str, str] = {"users_file": "path"}
_REDIS_KEYS: dict[str, str] = {"listen": "host_or_empty", "port": "port"}
REDIS_PORT = 6379  # [server.redis] without a port: Redis' own
_FLAG_ONLY_KEYS: dict[str, str] = {"redis_port": "port"}  # flags of a key in a sub-table
_STORAGE_KEYS: dict[str, str] = {
    "backend": "backend",
    "data_dir": "path",
    "sync_interval_ms": "positive",
    "daemon_id": "string",
    "reclaim_interval": "positive_number",
    "poll_interval_ms": "positive",
    "max_disk_bytes": "count",
}
_METRICS_KEYS: dict[str, str] = {"listen": "host", "port": "port"}
_QUEUE_KEYS: dict[str, str] = {
    "max_items": "count",
    "max_bytes": "count",
    "max_item_size": "item_size",
    "overflow": "overflow",
    "unique": "boolean",
    "visibility_timeout": "number",
    "max_deliveries": "count",
    "dead_letter": "queue",
    "sync": "sync",
    "idle_expiry": "number",
}


def _read(check: TableReader, kinds: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, kind in kinds.items():
        if key not in check.table:
            continue
        if kind == "string":
            out[key] = check.string(key)
        elif kind == "host":
            out[key] = check.host(key)
        elif kind == "host_or_empty":
            out[key] = check.host(key, empty="the address of server.listen")
        elif kind == "queue":
            out[key] = check.queue(key)
        elif kind == "path":
            out[key] = Path(check.string(key))
        elif kind == "port":
            out[key] = check.integer(key, 0, 65535)
        elif kind == "positive":
            out[key] = check.integer(key, 1)
        elif kind == "item_size":
            out[key] = check.integer(key, 1, MAX_ITEM_SIZE)
        elif kind == "count":
            out[key] = check.integer(key, 0)
        elif kind == "number":
            out[key] = check.number(key)
        elif kind == "positive_number":
            out[key] = check.number(key, above=True)
        elif kind == "boolean":
            out[key] = check.boolean(key)
        elif kind == "log_level":
            out[key] = check.choice(key, LOG_LEVELS)
        elif kind == "loop":
            out[key] = check.choice(key, LOOPS)
        elif kind == "overflow":
            out[key] = check.choice(key, OVERFLOW)
        elif kind == "sync":
            out[key] = Sync(check.choice(key, tuple(s.value for s in Sync)))
        elif kind == "backend":
            out[key] = _backend_name(check, key)
    check.leftovers(list(kinds))
    return out


def _backend_name(check: TableReader, key: str) -> str:
    name = check.string(key)
    if name not in backends.available():
        try:
            backends.load(name)
        except BackendLoadError as error:  # says what is installed and the nearest name
            raise check.fail(key, name, str(error)) from None
    return name


def _table(check: TableReader, key: str) -> dict[str, Any]:
    if key not in check.table:
        return {}
    return dict(check.take(key, dict, "must be a table"))


def parse(data: dict[str, Any], path: Path | None = None) -> dict[str, Any]:
    """Validate a parsed TOML document; return the Config fields it sets."""
    top = TableReader(path, data, "")
    server = _table(top, "server")
    storage = _table(top, "storage")
    queues = _table(top, "queues")
    metrics = _table(top, "metrics")
    top.leftovers(["server", "storage", "queues", "metrics"])

    server_check = TableReader(path, server, "server.")
    tls = _read(TableReader(path, _table(server_check, "tls"), "server.tls."), _TLS_KEYS)
    auth = _read(TableReader(path, _table(server_check, "auth"), "server.auth."), _AUTH_KEYS)
    redis = _table(server_check, "redis") if "redis" in server else None
    fields = _read(server_check, _SERVER_KEYS)
    if tls:
        for key in ("cert_file", "key_file"):
            if key not in tls:
                where = f"{path}: " if path else ""
                raise ConfigError(f"{where}server.tls.{key}: missing: [server.tls] needs {key}")
        fields.update({f"tls_{key}": value for key, value in tls.items()})
    if "users_file" in auth:
        fields["auth_users_file"] = auth["users_file"]
    for key, value in _read(TableReader(path, metrics, "metrics."), _METRICS_KEYS).items():
        fields[f"metrics_{key}"] = value
    if redis is not None:
        listener = _read(TableReader(path, redis, "server.redis."), _REDIS_KEYS)
        fields["redis_listen"] = listener.get("listen", "")
        fields["redis_port"] = listener.get("port", REDIS_PORT)
    storage_check = TableReader(path, storage, "storage.")
    # Tables are backends' options, validated by the backend chosen (which
    # --backend may change after the file is read).
    tables = {k: storage_check.table.pop(k) for k, v in storage.items() if isinstance(v, dict)}
    fields.update(_read(storage_check, _STORAGE_KEYS))
    if tables:
        fields["backend_tables"] = tables

    patterns = []
    for pattern, values in queues.items():
        if not isinstance(values, dict):
            raise top.fail(f'queues."{pattern}"', values, "must be a table of queue settings")
        check = TableReader(path, values, f'queues."{pattern}".')
        patterns.append((pattern, _read(check, _QUEUE_KEYS)))
    if patterns:
        fields["queues"] = tuple(patterns)
    return fields


@dataclass(frozen=True)
class Override:
    """A setting given as text by a flag or an environment variable, and which one."""

    source: str  # "--port", "MQD_PORT": named in the error when the value is bad
    text: str


_INTEGER = re.compile(r"[+-]?[0-9]+")
_NUMERIC = re.compile(r"[+-]?[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?")


def _from_text(key: str, override: Override) -> Any:
    """`override` converted as its key's kind and validated exactly as the file's value."""
    kind = _SERVER_KEYS.get(key) or _FLAG_ONLY_KEYS.get(key) or _STORAGE_KEYS[key]
    text = override.text.strip()
    value: object = override.text
    if kind in ("port", "positive", "count") and _INTEGER.fullmatch(text):
        value = int(text)
    elif kind in ("number", "positive_number") and _NUMERIC.fullmatch(text):
        value = float(text)
    elif kind == "boolean" and text.lower() in ("true", "false"):
        value = text.lower() == "true"
    check = TableReader(None, {key: value}, "", label=override.source)
    return _read(check, {key: kind})[key]


def load(path: Path | None = None, **overrides: Any) -> Config:
    """Defaults, then the file at `path` (if any), then `overrides` that are not None.

    An `Override` (text from a flag or the environment) is converted and
    validated like the file's values; other values are taken as they are.
    """
    fields: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
        except UnicodeDecodeError as exc:
            byte = exc.object[exc.start]
            raise ConfigError(
                f"{path}: not valid TOML: byte 0x{byte:02x} at offset {exc.start} "
                "is not UTF-8 text, which TOML files must be"
            ) from exc
        fields = parse(data, path)
    for key, value in overrides.items():
        if isinstance(value, Override):
            fields[key] = _from_text(key, value)
        elif value is not None:
            fields[key] = value
    config = Config(path=path, **fields)
    _check_ports(config)
    return config


#: Settings read once, at start: a reload (SIGHUP) that changes one says so
#: instead of claiming it applied. By field, with the key it comes from.
RESTART_ONLY: dict[str, str] = {
    "listen": "server.listen",
    "port": "server.port",
    "max_connections": "server.max_connections",
    "idle_timeout": "server.idle_timeout",
    "command_timeout": "server.command_timeout",
    "loop": "server.loop",
    "tls_cert_file": "server.tls.cert_file",
    "tls_key_file": "server.tls.key_file",
    "tls_ca_file": "server.tls.ca_file",
    "redis_listen": "server.redis.listen",
    "redis_port": "server.redis.port",
    "metrics_listen": "metrics.listen",
    "metrics_port": "metrics.port",
    "backend": "storage.backend",
    "data_dir": "storage.data_dir",
    "sync_interval_ms": "storage.sync_interval_ms",
    "daemon_id": "storage.daemon_id",
    "poll_interval_ms": "storage.poll_interval_ms",
    "max_disk_bytes": "storage.max_disk_bytes",
    "backend_tables": "storage.<backend>",
}


def needs_restart(old: Config, new: Config) -> list[str]:
    """The keys whose change from `old` to `new` takes effect only on a restart."""
    return [key for name, key in RESTART_ONLY.items() if getattr(old, name) != getattr(new, name)]


_ANY_ADDRESS = frozenset({"", "0.0.0.0", "::"})


def _same_address(host: str, other: str) -> bool:
    """Whether listeners on `host` and `other` would bind one address.

    Two spellings (`localhost`, `127.0.0.1`) are resolved to tell, to the
    address a listener binds (the first the resolver gives, as
    mqd.listener does); only for listeners that share a port number, so
    start-up resolves nothing otherwise. A name that does not resolve fails
    at its own bind, saying so.
    """
    if host == other or {host, other} & _ANY_ADDRESS:
        return True
    bound = _bound_address(host)
    return bound is not None and bound == _bound_address(other)


def _bound_address(host: str) -> str | None:
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError):
        return None
    return str(infos[0][4][0])


def _check_ports(config: Config) -> None:
    """Each listener needs a port of its own: a clash would show only once the
    second bind failed, after the first listener had started."""
    listeners = [("server.port (--port)", config.listen, config.port)]
    if config.redis_port is not None:
        redis_listen = config.redis_listen or config.listen
        listeners.append(("server.redis.port (--redis-port)", redis_listen, config.redis_port))
    if config.metrics_port:
        listeners.append(("metrics.port", config.metrics_listen, config.metrics_port))
    for at, (key, host, port) in enumerate(listeners):
        for other, other_host, other_port in listeners[at + 1 :]:
            if port and port == other_port and _same_address(host, other_host):
                where = f"{config.path}: " if config.path else ""
                raise ConfigError(
                    f"{where}{key} and {other} are both {port} on {host}:"
                    " each listener needs a port of its own"
                )
