"""Loading a backend by name from the `mqd.backends` entry-point group."""

from __future__ import annotations

from importlib import metadata
from typing import Any

import pytest

from mqd import backend
from mqd.backend import REQUIRED_METHODS, Backend, Message, Put
from mqd.errors import BackendLoadError


class _PutOnly(Backend):
    """A plugin's backend that defines put() and nothing else it must."""

    name = "put-only"

    async def put(self, queue: str, message: Message, **options: Any) -> Put:
        return Put.STORED


class _Point:
    """An entry point of the group, as importlib.metadata gives one."""

    name = "put-only"
    dist = None

    def load(self) -> type[Backend]:
        return _PutOnly


def test_a_backend_lacking_a_required_method_is_refused_naming_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(metadata, "entry_points", lambda group: [_Point()])
    with pytest.raises(BackendLoadError) as refused:
        backend.load("put-only")
    lacking = ", ".join(m for m in REQUIRED_METHODS if m != "put")
    assert str(refused.value) == (
        f"backend 'put-only' from unknown distribution does not define {lacking}"
        " (mqd.backend.Backend: every backend does)"
    )


def test_every_installed_backend_loads() -> None:
    names = set(backend.available())
    assert {"memory", "bdb", "bdb-single", "bdb-random"} <= names
    for name in names:
        assert backend.load(name).name == name


def test_the_required_methods_are_the_abstract_ones() -> None:
    abstract = getattr(Backend, "__abstractmethods__", None)
    if not abstract:
        pytest.skip("compiled, Backend keeps no abstract methods; the pure-Python run checks")
    assert set(REQUIRED_METHODS) == set(abstract)
