"""How `mqd stats` and `mqd redrive` reach a running daemon: address, TLS, login.

The options are those of the daemon's own settings seen from the client's
side: `[server.tls]` (the daemon's certificate checked against --ca-file or
the system's CAs; --cert-file and --key-file for a daemon that asks clients
for one) and `[server.auth]` (memcached's text-protocol login, a first `set`
whose data is `<user> <password>`).
"""

from __future__ import annotations

import functools
import ssl
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import click

if TYPE_CHECKING:
    from pymemcache.client.base import Client

F = TypeVar("F", bound=Callable[..., Any])

LOGIN_KEY = "mqd-login"  # the key of the login `set`: the daemon reads only its data
UNAUTHENTICATED = "the daemon asks clients to log in: give --user (and MQD_PASSWORD)"
CLOSED = "the connection closed without a memcached reply (a TLS or HTTP port?)"


@dataclass(frozen=True)
class Remote:
    """Where a running daemon is and how to connect to it."""

    host: str
    port: int
    tls: ssl.SSLContext | None = None
    user: str | None = None
    password: str | None = None

    def __str__(self) -> str:
        return host_port(self.host, self.port)

    def client(self, timeout: float) -> Client:
        """A pymemcache client of the daemon, connected and logged in.

        Raises click.ClickException with the reason when it cannot connect or
        log in.
        """
        from pymemcache.client.base import Client
        from pymemcache.exceptions import MemcacheClientError, MemcacheError

        client = Client(
            (self.host, self.port), connect_timeout=5, timeout=timeout, tls_context=self.tls
        )
        try:
            try:
                client.version()  # connects now, so that a refusal says so here
            except MemcacheClientError as refused:
                if self.user is None or reason(refused) != UNAUTHENTICATED:
                    raise
                # Only a daemon that asks for it gets the login: to another,
                # the `set` would store the password as a message.
                login = f"{self.user} {self.password or ''}".encode()
                client.set(LOGIN_KEY, login, noreply=False)  # STORED, or CLIENT_ERROR raised
        except (OSError, MemcacheError) as error:
            client.close()
            doing = f"log in to {self} as {self.user!r}" if self.user else f"reach {self}"
            why = reason(error)
            if self.tls is not None and why == CLOSED:
                # TLS 1.3 ends the handshake before the daemon checks the
                # client's certificate: a refusal shows as the close.
                why = (
                    "the daemon closed the connection after the TLS handshake: it asks for a"
                    " client certificate (--cert-file), or refused the one given"
                )
            raise click.ClickException(f"cannot {doing}: {why}") from None
        return client


def host_port(host: str, port: int) -> str:
    """`host:port` as a URL spells it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def reason(error: Exception) -> str:
    """What went wrong with a client call, never empty (pymemcache's close carries no text)."""
    if isinstance(error, ssl.SSLError):
        return f"TLS: {error.reason or error}"
    # pymemcache's errors carry the reply's text as bytes.
    first = error.args[0] if len(error.args) == 1 else None
    text = first.decode(errors="replace") if isinstance(first, bytes) else str(error)
    if text == "unauthenticated":
        return UNAUTHENTICATED
    return text or CLOSED


def daemon_options(command: F) -> F:
    """The options of a command that talks to a running daemon; it gets `daemon: Remote`."""
    options = [
        click.option("--host", default="127.0.0.1", show_default=True, help="Daemon address."),
        click.option(
            "--port",
            type=click.IntRange(0, 65535),
            default=22133,
            show_default=True,
            help="Daemon port.",
        ),
        click.option("--tls", is_flag=True, help="Connect over TLS (a daemon with [server.tls])."),
        click.option(
            "--ca-file",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            help="CA certificates to check the daemon's certificate with; implies --tls.  "
            "[default: the system's]",
        ),
        click.option(
            "--cert-file",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            help="Client certificate (PEM), for a daemon that asks for one; implies --tls.",
        ),
        click.option(
            "--key-file",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            help="The client certificate's key (PEM).  [default: in --cert-file]",
        ),
        click.option("--user", help="Log in as this user (a daemon with [server.auth])."),
        click.option(
            "--password",
            envvar="MQD_PASSWORD",
            help="The user's password; better in the environment variable MQD_PASSWORD, "
            "which other users cannot read as they can a command line.  "
            "[default: asked for]",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    inner = command

    # wraps() copies the options click attached (__click_params__) and the help.
    @functools.wraps(command)
    def with_daemon(**kwargs: Any) -> Any:
        kwargs["daemon"] = _daemon(
            kwargs.pop("host"),
            kwargs.pop("port"),
            kwargs.pop("tls"),
            kwargs.pop("ca_file"),
            kwargs.pop("cert_file"),
            kwargs.pop("key_file"),
            kwargs.pop("user"),
            kwargs.pop("password"),
        )
        return inner(**kwargs)

    return cast(F, with_daemon)


def _daemon(
    host: str,
    port: int,
    tls: bool,
    ca_file: Path | None,
    cert_file: Path | None,
    key_file: Path | None,
    user: str | None,
    password: str | None,
) -> Remote:
    # click.ClickException rather than BadParameter: one line, as every other
    # error of the command line, not click's usage text with it.
    context = None
    if key_file is not None and cert_file is None:
        raise click.ClickException("--key-file goes with --cert-file")
    if tls or ca_file or cert_file:
        try:
            context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
        except (OSError, ssl.SSLError) as error:
            raise click.ClickException(
                f"--ca-file {ca_file}: no CA certificate (PEM) there: {reason(error)}"
            ) from None
        if cert_file is not None:
            try:
                context.load_cert_chain(cert_file, key_file)
            except (OSError, ssl.SSLError) as error:
                hint = "" if key_file else " (is its key in it? if not, give --key-file)"
                raise click.ClickException(
                    f"--cert-file {cert_file}"
                    + (f" with --key-file {key_file}" if key_file else "")
                    + f": cannot use it{hint}: {reason(error)}"
                ) from None
    if user is not None and password is None:
        if not sys.stdin.isatty():
            raise click.ClickException(
                f"--user {user} needs a password: set MQD_PASSWORD (or give --password)"
            )
        password = click.prompt(f"password of {user}", hide_input=True, err=True)
    return Remote(host, port, context, user, password)
