"""Exceptions, mirroring the wire: each protocol error class knows its reply prefix."""

from __future__ import annotations


class MqdError(Exception):
    """Root of every error mqd raises on purpose."""


class ProtocolError(MqdError):
    """An error that is answered on the wire; `prefix` starts the reply line."""

    prefix = "SERVER_ERROR"

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message


class ClientError(ProtocolError):
    """The client sent something wrong: answered with `CLIENT_ERROR <message>`."""

    prefix = "CLIENT_ERROR"


class ServerError(ProtocolError):
    """The server could not do what was asked: answered with `SERVER_ERROR <message>`."""

    prefix = "SERVER_ERROR"


class UnknownCommand(ProtocolError):
    """The command is not one mqd knows: answered with a bare `ERROR`."""

    prefix = "ERROR"


class NotSupported(ServerError):
    """The configured backend lacks a capability the command needs."""

    def __init__(self, feature: str, backend: str) -> None:
        super().__init__(f"{feature} not supported by backend {backend}")


class StorageError(ServerError):
    """The backend failed (disk full, read-only file system, ...); the daemon goes on."""


class ConfigError(MqdError):
    """The configuration is invalid; the message names file, key, value and what is allowed."""


class BackendLoadError(MqdError):
    """A backend plugin is unknown or failed to import."""
