"""TLS and password authentication for the daemon's listeners, whatever wire they speak.

`server_context` builds the `ssl.SSLContext` a listener wraps its connections
in (`[server.tls]`); `Authenticator` checks a user and password against a users
file in memcached's `-Y` format (`[server.auth]`). Neither knows a protocol: the
memcached text wire takes the credentials from its first `set`, another wire
from its own command.
"""

from __future__ import annotations

import hmac
import ssl
from pathlib import Path

from mqd.config import Config
from mqd.errors import ConfigError


def tls_context(cert_file: Path, key_file: Path, ca_file: Path | None = None) -> ssl.SSLContext:
    """A server-side context; with `ca_file`, clients must present a certificate it signed.

    Raises OSError or ssl.SSLError when a file cannot be read or used.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    if ca_file is not None:
        context.load_verify_locations(cafile=ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def server_context(config: Config) -> ssl.SSLContext | None:
    """The `[server.tls]` context, or None without TLS; a bad file is a ConfigError."""
    cert, key, ca = config.tls_cert_file, config.tls_key_file, config.tls_ca_file
    if cert is None or key is None:
        return None
    for name, path in (("cert_file", cert), ("key_file", key), ("ca_file", ca)):
        if path is not None and not path.is_file():
            raise _config_error(config, f"server.tls.{name}", path, "cannot read: no such file")
    try:
        return tls_context(cert, key, ca)
    except (OSError, ssl.SSLError) as error:
        reason = getattr(error, "reason", None) or getattr(error, "strerror", None) or error
        files = f"cert_file {str(cert)!r}, key_file {str(key)!r}, ca_file {str(ca)!r}"
        raise ConfigError(
            f"{config.path or 'settings'}: server.tls: cannot use {files}: {reason}"
        ) from None


def _config_error(config: Config, key: str, value: object, allowed: str) -> ConfigError:
    where = f"{config.path}: " if config.path else ""
    return ConfigError(f"{where}{key} = {str(value)!r}: {allowed}")


class Authenticator:
    """Users and passwords from a file of `user:password` lines (memcached's `-Y` file)."""

    def __init__(self, users: dict[bytes, bytes]) -> None:
        self._users = list(users.items())

    @classmethod
    def from_file(cls, path: Path) -> Authenticator:
        """Read `path`; OSError, or ValueError naming a line that is not `user:password`."""
        users: dict[bytes, bytes] = {}
        for number, line in enumerate(path.read_bytes().splitlines(), 1):
            if not line.strip():
                continue
            user, colon, password = line.partition(b":")
            if not colon or not user:
                raise ValueError(f"line {number} is not user:password")
            users[user] = password
        if not users:
            raise ValueError("no user:password line")
        return cls(users)

    def check(self, user: bytes, password: bytes) -> bool:
        """Whether `password` is `user`'s, taking as long whichever user or password is wrong.

        Every entry is compared with hmac.compare_digest, so neither a user
        name nor a password prefix can be found by timing the answer.
        """
        found = False
        for known_user, known_password in self._users:
            same_user = hmac.compare_digest(known_user, user)
            same_password = hmac.compare_digest(known_password, password)
            found |= same_user & same_password
        return found


def authenticator(config: Config) -> Authenticator | None:
    """The `[server.auth]` authenticator, or None without one; a bad file is a ConfigError."""
    path = config.auth_users_file
    if path is None:
        return None
    try:
        return Authenticator.from_file(path)
    except OSError as error:
        reason = f"cannot read: {error.strerror}"
    except ValueError as error:
        reason = f"must hold user:password lines: {error}"
    raise _config_error(config, "server.auth.users_file", path, reason)
