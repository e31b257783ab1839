"""The [storage.aerospike] table and the backend's registration: no server needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aerospike", reason="needs the aerospike client: pip install plugins/aerospike")

from mqd_aerospike.backend import AerospikeBackend
from mqd_aerospike.config import AerospikeConfig

from mqd.backend import StorageOptions
from mqd.errors import ConfigError


@pytest.mark.parametrize(
    ("table", "says"),
    [
        (
            {"hosts": "127.0.0.1:3000"},
            "storage.aerospike.hosts = '127.0.0.1:3000': must be a non-empty list of \"host:port\"",
        ),
        ({"hosts": ["127.0.0.1"]}, "storage.aerospike.hosts"),
        ({"hosts": []}, "storage.aerospike.hosts"),
        ({"namespace": 3}, "storage.aerospike.namespace = 3: must be a string"),
        ({"shards": 0}, "storage.aerospike.shards = 0: must be a whole number from 1 to 1024"),
        ({"queue_shards": {"jobs.*": "8"}}, "storage.aerospike.queue_shards.\"jobs.*\" = '8'"),
        ({"lock_lease_ms": 10}, "storage.aerospike.lock_lease_ms = 10"),
        ({"set_prefix": ""}, "storage.aerospike.set_prefix = ''"),
        ({"host": ["x:1"]}, "storage.aerospike.host = ['x:1']: unknown key; known keys: hosts,"),
    ],
)
def test_config_errors_name_file_key_and_allowed_values(table: dict[str, Any], says: str) -> None:
    path = Path("/etc/mqd/mqd.toml")
    with pytest.raises(ConfigError) as error:
        AerospikeConfig.from_table(table, path)
    assert str(error.value).startswith(f"{path}: {says}")


def test_config_reads_hosts_and_shards_by_queue() -> None:
    config = AerospikeConfig.from_table(
        {"hosts": ["10.0.0.1:3000", "[::1]:3100"], "shards": 2, "queue_shards": {"jobs.*": 8}},
        None,
    )
    assert config.hosts == (("10.0.0.1", 3000), ("::1", 3100))
    assert (config.shards_for("jobs.x"), config.shards_for("other")) == (8, 2)


def test_backend_is_listed_with_its_capabilities() -> None:
    from click.testing import CliRunner

    from mqd.cli import main

    result = CliRunner().invoke(main, ["backends"], terminal_width=200)
    assert result.exit_code == 0
    line = next(row for row in result.output.splitlines() if "aerospike" in row)
    assert "mqd-aerospike" in line and "shared" in line and "offset" in line


def test_options_come_from_the_storage_table() -> None:
    options = StorageOptions(extra={"hosts": ["127.0.0.1:1"], "shards": 3}, poll_interval_ms=7)
    backend = AerospikeBackend(options)
    assert backend.config.hosts == (("127.0.0.1", 1),)
    assert (backend.config.shards, backend.config.poll_interval_ms) == (3, 7)


def test_every_key_is_documented_in_the_example_config() -> None:
    example = Path(__file__).resolve().parents[3] / "etc" / "mqd.toml"
    text = example.read_text()
    block = text[text.index("# [storage.aerospike]") :].split("\n\n")[0]
    documented = {
        line[2:].split("=")[0].strip()
        for line in block.splitlines()
        if line.startswith("# ") and "=" in line and not line.startswith("# [")
    }
    own = set(AerospikeConfig.__dataclass_fields__) - {"poll_interval_ms"}
    assert documented == own


def test_what_a_daemon_remembers_per_queue_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from mqd_aerospike import shard

    monkeypatch.setattr(shard, "MEMO_MAX", 3)
    memo: shard.Memo[str, int] = shard.Memo()
    for i in range(10):
        memo[f"q{i}"] = i
        assert len(memo) <= 3
    memo["q9"] = 0  # a key it holds is replaced, not a reason to forget
    assert memo["q9"] == 0
