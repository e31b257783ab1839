"""Prometheus metrics from a real daemon: scraped over HTTP, parsed, compared with `stats`."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import redis
from conftest import taken_port
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pymemcache.client.base import Client

from mqd.testing.daemon import Daemon
from mqd.testing.ports import free_port

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class Metered(NamedTuple):
    daemon: Daemon
    url: str  # the admin listener, http://127.0.0.1:<port>

    @property
    def address(self) -> tuple[str, int]:
        return self.daemon.address


@pytest.fixture
def metered(tmp_path: Path) -> Iterator[Metered]:
    """A daemon of its own (its counters start at zero) with metrics on a free port."""
    port = free_port()
    config = f'[metrics]\nlisten = "127.0.0.1"\nport = {port}\n'
    with Daemon(tmp_path, config_text=config) as daemon:
        yield Metered(daemon, f"http://127.0.0.1:{port}")


def scrape(metered: Metered, path: str = "/metrics") -> str:
    with urllib.request.urlopen(metered.url + path, timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        return str(reply.read().decode())


def samples(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def stats(client: Client) -> dict[str, str]:
    return {
        k.decode(): v.decode() if isinstance(v, bytes) else str(v)
        for k, v in client.stats().items()
    }


def test_metrics_hold_the_figures_of_stats(metered: Metered) -> None:
    client = Client(metered.address, timeout=5)
    for body in (b"one", b"two", b"three"):
        client.set("jobs", body)
    client.set("mail", b"hello")
    assert client.get("jobs") == b"one"
    assert client.get("jobs/open") == b"two"
    assert client.get("empty") is None
    figures = stats(client)
    got = samples(scrape(metered))

    def one(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted(labels.items())))]

    general = {
        "cmd_get": "mqd_cmd_get_total",
        "cmd_set": "mqd_cmd_set_total",
        "get_hits": "mqd_get_hits_total",
        "get_misses": "mqd_get_misses_total",
        "curr_connections": "mqd_connections",
        "total_connections": "mqd_connections_accepted_total",
        "curr_items": "mqd_items",
        "bytes": "mqd_bytes",
    }
    for stat, metric in general.items():
        assert one(metric) == float(figures[stat]), stat
    assert (figures["cmd_get"], figures["cmd_set"], figures["curr_items"]) == ("3", "4", "3")
    for queue in ("jobs", "mail"):
        for field, metric in (
            ("items", "mqd_queue_items"),
            ("bytes", "mqd_queue_bytes"),
            ("open", "mqd_queue_open"),
            ("enqueued", "mqd_queue_enqueued_total"),
            ("dequeued", "mqd_queue_dequeued_total"),
            ("expired", "mqd_queue_expired_total"),
        ):
            assert one(metric, queue=queue) == float(figures[f"queue_{queue}_{field}"]), field
        # The head's age grows between the two readings; both are of the same message.
        age = one("mqd_queue_head_age_seconds", queue=queue)
        assert float(figures[f"queue_{queue}_age_ms"]) / 1000 <= age < 60
    assert one("mqd_queue_open", queue="jobs") == 1
    assert one("mqd_build_info", backend="memory", version=figures["version"]) == 1
    assert one("mqd_uptime_seconds") >= 0
    # Latencies: one observation per command, labelled with its verb.
    assert one("mqd_command_duration_seconds_count", command="set") == 4
    assert one("mqd_command_duration_seconds_count", command="get") == 3
    assert one("mqd_command_duration_seconds_count", command="stats") == 1
    assert one("mqd_command_duration_seconds_bucket", command="set", le="+Inf") == 4
    assert one("mqd_command_duration_seconds_sum", command="set") > 0
    assert one("process_open_fds") > 0
    client.close()


def test_counters_follow_the_daemon_between_scrapes(metered: Metered) -> None:
    client = Client(metered.address, timeout=5)
    client.set("q", b"x")
    before = samples(scrape(metered))
    client.set("q", b"y")
    client.get("q")
    after = samples(scrape(metered))
    key = ("mqd_queue_enqueued_total", (("queue", "q"),))
    assert (before[key], after[key]) == (1, 2)
    assert after[("mqd_queue_dequeued_total", (("queue", "q"),))] == 1
    client.delete("q")
    gone = samples(scrape(metered))
    assert ("mqd_queue_items", (("queue", "q"),)) not in gone
    client.close()


def test_a_queue_name_that_is_not_utf8_is_labelled_with_its_bytes_escaped(
    metered: Metered,
) -> None:
    # Labels are UTF-8 text; such a name (protocol.md allows it) shows its
    # other bytes as \\xNN, and the other queues' samples go on as ever.
    client = Client(metered.address, timeout=5)
    client.set(b"caf\xe9", b"x")
    client.set("mail", b"hello")
    got = samples(scrape(metered))
    assert got[("mqd_queue_items", (("queue", "caf\\xe9"),))] == 1
    assert got[("mqd_queue_items", (("queue", "mail"),))] == 1
    client.close()


def test_only_metrics_path_is_served(metered: Metered) -> None:
    with pytest.raises(urllib.error.HTTPError) as error:
        scrape(metered, "/")
    assert error.value.code == 404


def test_metrics_are_off_by_default(daemon: Daemon) -> None:
    assert "metrics at" not in daemon.log()
    from mqd.config import Config

    assert Config().metrics_port == 0


def test_a_bad_metrics_port_is_a_config_error(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from mqd.cli import main

    path = tmp_path / "mqd.toml"
    path.write_text("[metrics]\nport = 70000\n")
    result = CliRunner().invoke(main, ["check-config", "-c", str(path)])
    assert result.exit_code == 1
    assert result.exception is None or isinstance(result.exception, SystemExit)
    expected = f"{path}: metrics.port = 70000: must be a whole number from 0 to 65535"
    assert expected in result.output


def test_a_taken_metrics_port_stops_start_up_with_one_line(tmp_path: Path) -> None:
    with taken_port() as port:
        daemon = Daemon(tmp_path, config_text=f"[metrics]\nport = {port}\n")
        with pytest.raises(RuntimeError, match="exited"):
            daemon.start()
    assert f"cannot serve metrics on 127.0.0.1:{port}" in daemon.log()
    assert "Traceback" not in daemon.log()


def test_a_loop_that_does_not_answer_gives_503(monkeypatch: pytest.MonkeyPatch) -> None:
    # A loop that never runs stands for a wedged one: the scrape must not hang
    # or report stale figures.
    from mqd import metrics

    monkeypatch.setattr(metrics, "SCRAPE_TIMEOUT", 0.2)
    wedged = asyncio.new_event_loop()

    async def never() -> list[tuple[str, object]]:
        return []

    served = metrics.Metrics("127.0.0.1", free_port())
    served.start(wedged, never)
    try:
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(f"http://127.0.0.1:{served.port}/metrics", timeout=10)
        assert error.value.code == 503
    finally:
        served.stop()
        wedged.run_until_complete(asyncio.sleep(0.01))  # let the abandoned scrape be dropped
        wedged.close()


def test_errors_and_latencies_as_exported() -> None:
    # The figures only the metrics have, through the same families a scrape gets.
    from mqd import metrics
    from mqd.errors import ClientError, StorageError
    from mqd.protocol import Delete, Store

    served = metrics.Metrics("127.0.0.1", 0)
    store = Store(False, "q", 0, 0, b"x", False)
    served.failed(store, StorageError("disk full"))
    served.failed(store, StorageError("disk full"))
    served.failed(Delete("q", False), RuntimeError("bug"))
    served.failed(store, ClientError("bad command line format"))  # the client's: not counted
    now = time.perf_counter()
    served.observe(store, now)  # ~0 s: the first bucket
    served.observe(store, now - 0.3)  # 0.3 s: the 0.5 s bucket
    served.observe(store, now - 100)  # beyond the last bound: +Inf only

    async def no_stats() -> list[tuple[str, object]]:
        return []

    served._source = no_stats
    snapshot = asyncio.run(served.snapshot())
    got = samples(generate_latest(snapshot).decode())
    assert got[("mqd_backend_errors_total", (("command", "set"),))] == 2
    assert got[("mqd_internal_errors_total", (("command", "delete"),))] == 1
    # Each command that ran has both series, at 0 until one fails.
    assert got[("mqd_backend_errors_total", (("command", "delete"),))] == 0
    assert got[("mqd_internal_errors_total", (("command", "set"),))] == 0
    assert ("mqd_backend_errors_total", (("command", "get"),)) not in got  # never ran
    set_label = ("command", "set")

    def bucket(le: str) -> float:
        return got[("mqd_command_duration_seconds_bucket", tuple(sorted([set_label, ("le", le)])))]

    expected = {"5e-05": 1, "0.25": 1, "0.5": 2, "30.0": 2, "+Inf": 3}  # cumulative
    assert {le: bucket(le) for le in expected} == expected
    assert got[("mqd_command_duration_seconds_count", (set_label,))] == 3
    assert 100.3 <= got[("mqd_command_duration_seconds_sum", (set_label,))] < 101


def test_every_queue_stat_has_its_metric() -> None:
    from mqd.metrics import QUEUE
    from mqd.protocol import QUEUE_STATS

    assert set(QUEUE) == set(QUEUE_STATS)


def test_redis_commands_are_timed_under_their_names(tmp_path: Path) -> None:
    port = free_port()
    config = f'[metrics]\nlisten = "127.0.0.1"\nport = {port}\n'
    with Daemon(tmp_path, config_text=config, redis=True) as daemon:
        host, redis_port = daemon.redis_address
        client = redis.Redis(host=host, port=redis_port)
        client.lpush("q", "x")
        client.rpop("q")
        client.close()
        found = samples(scrape(Metered(daemon, f"http://127.0.0.1:{port}")))
    count = "mqd_command_duration_seconds_count"
    assert found[(count, (("command", "redis_lpush"),))] == 1
    assert found[(count, (("command", "redis_rpop"),))] == 1
