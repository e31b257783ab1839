"""The `mqd` command line: serve, check-config, backends, stats, redrive, version."""

from __future__ import annotations

import logging
import sys
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from mqd import __version__
from mqd import backend as backends
from mqd import config as configuration
from mqd.errors import ConfigError, MqdError
from mqd.protocol import QUEUE_STATS, name_bytes, queue_name
from mqd.reach import Remote, daemon_options, host_port, reason
from mqd.stats import queue_stat

if TYPE_CHECKING:
    from rich.console import RenderableType

config_option = click.option(
    "--config",
    "-c",
    "config_path",
    # Not checked here: config.load says what is wrong with it, in one line.
    type=click.Path(readable=False, path_type=Path),
    envvar="MQD_CONFIG",
    help="TOML config file (see etc/mqd.toml).",
)


def _backend(cfg: configuration.Config) -> backends.Backend:
    """The configured backend, built (its options validated) but not opened."""
    try:
        return backends.load(cfg.backend)(cfg.storage_options())
    except MqdError as error:
        raise click.ClickException(str(error)) from None


def _load(config_path: Path | None, **overrides: Any) -> configuration.Config:
    try:
        return configuration.load(config_path, **overrides)
    except MqdError as error:
        raise click.ClickException(str(error)) from None


class PluginGroup(click.Group):
    """Built-in commands, plus those other distributions add in the `mqd.commands`
    entry-point group; a plugin's module is imported only when its command runs."""

    # Commands that a distribution of the project adds, and how to get them.
    OPTIONAL = {"pipeline": "mqd-spark: pip install -e plugins/spark (bin/setup installs it)"}

    def _plugins(self) -> dict[str, metadata.EntryPoint]:
        return {p.name: p for p in metadata.entry_points(group="mqd.commands")}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self._plugins()})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = super().get_command(ctx, name)
        if command is not None:
            return command
        point = self._plugins().get(name)
        if point is None:
            if name in self.OPTIONAL:
                raise click.UsageError(f"`mqd {name}` needs {self.OPTIONAL[name]}")
            return None
        loaded = point.load()
        return loaded if isinstance(loaded, click.Command) else None


@click.group(
    cls=PluginGroup,
    context_settings={"auto_envvar_prefix": "MQD", "help_option_names": ["-h", "--help"]},
)
@click.version_option(__version__, "--version", "-V", prog_name="mqd")
def main() -> None:
    """mqd: a message-queue daemon that speaks the memcached text protocol."""


@main.command()
@config_option
@click.option(
    "--listen",
    envvar="MQD_LISTEN",
    metavar="HOST",
    help="Address to listen on.  [default: 127.0.0.1]",
)
@click.option(
    "--port", envvar="MQD_PORT", metavar="PORT", help="TCP port, 0-65535.  [default: 22133]"
)
@click.option(
    "--redis-port",
    envvar="MQD_REDIS_PORT",
    metavar="PORT",
    help="Also serve the Redis protocol on this TCP port ([server.redis]).  [default: off]",
)
@click.option(
    "--backend",
    envvar="MQD_BACKEND",
    metavar="NAME",
    help="Storage backend by name (see `mqd backends`).",
)
@click.option(
    "--data-dir",
    envvar="MQD_DATA_DIR",
    metavar="DIR",
    help="Directory for the backend's files.  [default: data; etc/mqd.toml sets /var/lib/mqd]",
)
@click.option(
    "--log-level",
    envvar="MQD_LOG_LEVEL",
    metavar="LEVEL",
    help=f"Logging level: {', '.join(configuration.LOG_LEVELS)}.  [default: info]",
)
@click.option(
    "--loop",
    envvar="MQD_LOOP",
    metavar="LOOP",
    help="Event loop: asyncio, uvloop or auto (uvloop when installed).  [default: auto]",
)
@click.pass_context
def serve(ctx: click.Context, /, config_path: Path | None, **flags: str | None) -> None:
    """Run the daemon in the foreground until SIGTERM."""
    from mqd import server

    overrides = _overrides(ctx, flags)
    cfg = _load(config_path, **overrides)
    logging.basicConfig(
        level=cfg.log_level_number,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    storage = _backend(cfg)
    try:
        server.run(cfg, storage, reload=lambda: configuration.load(config_path, **overrides))
    except ConfigError as error:
        # The backend finds some settings wrong only once it reaches its
        # store (an Aerospike namespace the cluster lacks): name the file too.
        text = str(error)
        if cfg.path is not None and not text.startswith(f"{cfg.path}:"):
            text = f"{cfg.path}: {text}"
        raise click.ClickException(text) from None
    except MqdError as error:
        raise click.ClickException(str(error)) from None
    except OSError as error:
        raise click.ClickException(f"cannot serve on {cfg.listen}:{cfg.port}: {error}") from None


def _overrides(
    ctx: click.Context, flags: dict[str, str | None]
) -> dict[str, configuration.Override]:
    """The flags given, as text naming where each came from, for the config to validate."""
    out: dict[str, configuration.Override] = {}
    for param in ctx.command.params:
        text = flags.get(param.name or "")
        if param.name is None or text is None:
            continue
        from_env = ctx.get_parameter_source(param.name) is ParameterSource.ENVIRONMENT
        source = str(param.envvar) if from_env else param.opts[0]
        out[param.name] = configuration.Override(source, text)
    return out


@main.command("check-config")
@config_option
def check_config(config_path: Path | None) -> None:
    """Validate a config file and the backend it names; exit non-zero if bad."""
    from mqd import security

    cfg = _load(config_path)
    try:
        tls = security.server_context(cfg)
        auth = security.authenticator(cfg)
    except MqdError as error:
        raise click.ClickException(str(error)) from None
    caps = ", ".join(sorted(c.value for c in _backend(cfg).capabilities))
    click.echo(f"{cfg.path or 'defaults'}: OK")
    click.echo(
        f"listen {host_port(cfg.listen, cfg.port)}, backend {cfg.backend} ({caps}),"
        f" data {cfg.data_dir}"
    )
    if tls is not None:
        click.echo(f"TLS, clients {'need' if cfg.tls_ca_file else 'need no'} certificate")
    if auth is not None:
        click.echo(f"clients log in with a user from {cfg.auth_users_file}")
    if cfg.metrics_port:
        click.echo(f"metrics http://{host_port(cfg.metrics_listen, cfg.metrics_port)}/metrics")
    if cfg.redis_port is not None:
        click.echo(f"redis listen {host_port(cfg.redis_listen or cfg.listen, cfg.redis_port)}")
    for pattern, values in cfg.queues:
        settings = ", ".join(f"{k}={getattr(v, 'value', v)}" for k, v in values.items())
        click.echo(f'queues."{pattern}": {settings}')


@main.command("backends")
def list_backends() -> None:
    """List the installed storage backends and their capabilities."""
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "distribution", "version", "capabilities")
    for name, point in sorted(backends.available().items()):
        dist = point.dist
        try:
            caps = ", ".join(sorted(c.value for c in backends.load(name).capabilities))
        except MqdError as error:
            caps = f"[red]{error}[/red]"
        table.add_row(name, dist.name if dist else "?", dist.version if dist else "?", caps)
    Console().print(table)


@main.command()
@daemon_options
@click.option("--watch", is_flag=True, help="Refresh the tables until Ctrl-C (or --count).")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=2.0,
    show_default=True,
    help="Seconds between refreshes with --watch.",
)
@click.option(
    "--count",
    type=click.IntRange(min=1),
    help="With --watch: stop after this many refreshes.  [default: never]",
)
def stats(daemon: Remote, watch: bool, interval: float, count: int | None) -> None:
    """Show a running daemon's counters and queues as tables."""
    from rich.console import Console

    console = Console()
    client = daemon.client(timeout=5)

    def read() -> dict[str, str]:
        try:
            return {_text(k): _text(v) for k, v in client.stats().items()}
        except (OSError, Exception) as error:
            raise click.ClickException(
                f"cannot read stats from {daemon}: {reason(error)}"
            ) from None

    try:
        if not watch:
            _print(console, _stats_tables(read(), f"mqd at {daemon}"))
            return
        _watch(console, read, f"mqd at {daemon}", interval, count)
    except KeyboardInterrupt:
        pass
    finally:
        client.close()


def _print(console: Any, tables: RenderableType) -> None:
    """Print `tables`: to a pipe or a file, in lines as long as they need (no
    terminal's width to fit, and every name and figure whole on its line)."""
    if not console.is_terminal:
        unbounded = console.options.update_width(1 << 20)
        console.width = max(console.width, console.measure(tables, options=unbounded).maximum)
    console.print(tables)


def _watch(console: Any, read: Any, title: str, interval: float, count: int | None) -> None:
    """Redraw the tables every `interval` s: in place on a terminal, one after another else."""
    import itertools
    import time

    from rich.live import Live

    def frame(n: int) -> RenderableType:
        return _stats_tables(read(), f"{title}, {time.strftime('%H:%M:%S')} (refresh {n})")

    refreshes = range(1, count + 1) if count else itertools.count(1)
    if not console.is_terminal:  # a pipe or a file: every refresh, in order
        for n in refreshes:
            if n > 1:
                time.sleep(interval)
            _print(console, frame(n))
        return
    with Live(console=console, auto_refresh=False) as live:
        for n in refreshes:
            if n > 1:
                time.sleep(interval)
            live.update(frame(n), refresh=True)


#: The least width of the `mqd stats` queue column on a terminal, longer names
#: folding under it: with the seven figures beside it, 80 columns.
NAME_WIDTH = 12


def _stats_tables(values: dict[str, str], title: str) -> RenderableType:
    """The general counters and the per-queue table of one `stats` reply."""
    from rich.console import Group
    from rich.table import Table

    general = Table("stat", "value", title=title)
    queues: dict[str, dict[str, str]] = {}
    for key, value in values.items():
        per_queue_stat = queue_stat(key)
        if per_queue_stat is None:
            general.add_row(key, value)
        else:
            queue, stat = per_queue_stat
            queues.setdefault(queue, {})[stat] = value
    per_queue = Table(title="queues")
    # Names are data: shown whole, on one line where the width allows, so they
    # can be copied (always, to a pipe or a file: _print); on a terminal too
    # narrow, a name folds onto more lines rather than squeezing out the
    # figures, which stay whole on theirs.
    longest = max((len(name) for name in queues), default=5)
    per_queue.add_column("queue", overflow="fold", min_width=min(longest, NAME_WIDTH))
    for name in QUEUE_STATS:
        widest = max((len(figures.get(name, "")) for figures in queues.values()), default=1)
        per_queue.add_column(name, justify="right", overflow="fold", min_width=widest)
    for name in sorted(queues):
        per_queue.add_row(name, *(queues[name].get(f, "") for f in QUEUE_STATS))
    return Group(general, per_queue)


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


REDRIVE_BATCH = 500  # messages per round trip: progress stays live on a large queue


@main.command()
@click.argument("dead_letters")
@click.option("--to", "to", default=None, help="Queue to move them to.  [default: where each died]")
@click.option("--max", "most", type=click.IntRange(min=1), default=None, help="Move at most N.")
@daemon_options
def redrive(dead_letters: str, to: str | None, most: int | None, daemon: Remote) -> None:
    """Move messages out of a dead-letter queue, back where they died (or --to a queue)."""
    from pymemcache.exceptions import MemcacheError
    from rich.progress import Progress

    for name in (dead_letters, to):
        if name is not None and queue_name(name_bytes(name)) is None:
            raise click.BadParameter(f"{name!r} is not a queue name")
    client = daemon.client(timeout=30)
    try:
        items = client.stats("queues").get(f"queue_{dead_letters}_items".encode(), b"0")
        wanted = min(int(items), most) if most else int(items)
        moved = 0
        with Progress(transient=True) as progress:
            task = progress.add_task(f"redrive {dead_letters}", total=wanted)
            while most is None or moved < most:
                batch = min(REDRIVE_BATCH, most - moved) if most else REDRIVE_BATCH
                line = b"redrive %b %d" % (name_bytes(dead_letters), batch)
                reply = client.raw_command(line + (b" " + name_bytes(to) if to else b""))
                if not reply.startswith(b"MOVED "):
                    raise click.ClickException(f"{daemon}: {reply.decode(errors='replace')}")
                count = int(reply.split()[1])
                moved += count
                progress.update(task, completed=moved)
                if count < batch:
                    break
    except (OSError, MemcacheError) as error:
        raise click.ClickException(f"{daemon}: {reason(error)}") from None
    finally:
        client.close()
    where = to or "the queues they died in"
    click.echo(f"moved {moved} message(s) from {dead_letters} to {where}")


@main.command()
def version() -> None:
    """Print mqd's version, the Python it runs on and whether its hot modules run compiled."""
    import platform

    from mqd import native

    click.echo(f"mqd {__version__}")
    # The installation the venv was made from: builds of one release differ
    # in speed (README, The interpreter), so a benchmark says which one it measured.
    click.echo(f"python {platform.python_version()} from {sys.base_prefix}")
    for build in native.builds():
        click.echo(f"modules of {build.package}: {build.state}")


@main.command("build-native")
@click.option("--force", is_flag=True, help="Rebuild even when the build is up to date.")
def build_native(force: bool) -> None:
    """Compile the hot modules of mqd and its plugins with mypyc (bin/setup does this)."""
    from mqd import native

    if native.forced_pure():
        click.echo(f"{native.PURE_ENV} is set: nothing built, mqd runs pure Python")
        return
    try:
        for line in native.build(native.builds(), force):
            click.echo(line)
    except native.BuildError as error:
        raise click.ClickException(str(error)) from None


if __name__ == "__main__":
    main()
