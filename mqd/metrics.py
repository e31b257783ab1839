"""Prometheus metrics on a separate admin listener: the figures of `stats`, and latencies.

Served by prometheus_client's own WSGI app on a small threaded HTTP server,
not on the event loop. Why: prometheus_client already does the HTTP part well
(content negotiation between the text and OpenMetrics formats, gzip, HEAD),
formatting a scrape of many queues does not block the loop for its whole
length (the thread shares the GIL with it), and it needs no HTTP dependency
beyond prometheus-client (serving it from the loop would take aiohttp or an
ASGI server). The figures themselves are gathered on the
loop, by the same code as the `stats` command (`run_coroutine_threadsafe`), so
both always agree and no broker state is read from another thread. A wedged
loop makes a scrape answer 503 instead of stale figures.

Off unless `[metrics] port` is set; prometheus-client is imported only then.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from mqd.errors import MqdError, ProtocolError, StorageError
from mqd.protocol import Command, FlushAll, Retrieve, Store, name_shown
from mqd.stats import queue_stat

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

log = logging.getLogger(__name__)

PATH = "/metrics"
SCRAPE_TIMEOUT = 10.0  # seconds the event loop has to gather the figures
# Command latencies, in seconds: from tens of microseconds (memory backend) to
# a long-polling get's wait.
LATENCY_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

StatsSource = Callable[[], Awaitable[list[tuple[str, object]]]]  # Broker.stats

# `stats` name -> (metric name, type, help). Counters get `_total` appended by
# prometheus_client. Numeric stats not listed here are exported as gauges
# named mqd_<stat>, so every figure of `stats` is scraped.
GENERAL: dict[str, tuple[str, str, str]] = {
    "uptime": ("mqd_uptime_seconds", "gauge", "Seconds since the daemon started."),
    "curr_connections": ("mqd_connections", "gauge", "Open client connections."),
    "total_connections": ("mqd_connections_accepted", "counter", "Client connections accepted."),
    "cmd_get": ("mqd_cmd_get", "counter", "Keys asked for by get and gets."),
    "cmd_set": ("mqd_cmd_set", "counter", "set and add commands."),
    "get_hits": ("mqd_get_hits", "counter", "Keys that got a message."),
    "get_misses": ("mqd_get_misses", "counter", "Keys that got no message."),
    "curr_items": ("mqd_items", "gauge", "Messages in all queues, open ones included."),
    "bytes": ("mqd_bytes", "gauge", "Body bytes in all queues, open ones included."),
}
SKIPPED = frozenset({"pid", "time"})  # process_* metrics and the scrape's own time cover these
INFO = ("version", "backend")
# Per-queue stats `queue_<name>_<stat>` (protocol.QUEUE_STATS): stat -> (metric
# name, type, help, scale). A stat not listed is exported as a gauge.
QUEUE: dict[str, tuple[str, str, str, float]] = {
    "items": ("mqd_queue_items", "gauge", "Messages in the queue, open ones included.", 1),
    "bytes": ("mqd_queue_bytes", "gauge", "Body bytes in the queue, open ones included.", 1),
    "open": ("mqd_queue_open", "gauge", "Messages reserved by /open and not yet closed.", 1),
    "age_ms": (
        "mqd_queue_head_age_seconds",
        "gauge",
        "Age of the oldest message in the queue.",
        0.001,
    ),
    "enqueued": ("mqd_queue_enqueued", "counter", "Messages stored in the queue.", 1),
    "dequeued": ("mqd_queue_dequeued", "counter", "Messages taken or acknowledged.", 1),
    "expired": ("mqd_queue_expired", "counter", "Messages dropped on expiry.", 1),
}


def command_name(command: Command) -> str:
    """The memcached verb a parsed command came from, as the latency label.

    "failed" stands for lines the parser answered with an error by itself.
    """
    if type(command) is Store:
        return "add" if command.add else "set"
    if type(command) is Retrieve:
        return "gets" if command.with_ids else "get"
    if type(command) is FlushAll:
        return "flush_all"
    return type(command).__name__.lower()


def families(pairs: Iterable[tuple[str, object]]) -> Iterator[Metric]:
    """Prometheus metric families holding the figures of one `stats` reply."""
    from prometheus_client.metrics_core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        InfoMetricFamily,
    )

    def family(name: str, kind: str, doc: str, labels: list[str] | None = None) -> Metric:
        if kind == "counter":
            return CounterMetricFamily(name, doc, labels=labels)
        return GaugeMetricFamily(name, doc, labels=labels)

    general: list[Metric] = []
    info: dict[str, str] = {}
    per_queue = {stat: family(*spec[:3], labels=["queue"]) for stat, spec in QUEUE.items()}
    for name, raw in pairs:
        if name in SKIPPED:
            continue
        if name in INFO:
            info[name] = str(raw)
            continue
        value = _number(raw)
        if value is None:
            continue
        per_queue_stat = queue_stat(name)
        if per_queue_stat is not None:
            queue, stat = per_queue_stat
            spec = QUEUE.get(stat, (f"mqd_queue_{stat}", "gauge", f"stats queue_<q>_{stat}", 1))
            metric = per_queue.get(stat) or per_queue.setdefault(
                stat, family(*spec[:3], labels=["queue"])
            )
            labels = {"queue": name_shown(queue)}
            metric.add_sample(_sample_name(metric), labels, value * spec[3])
            continue
        metric_name, kind, doc = GENERAL.get(name, (f"mqd_{name}", "gauge", f"stats {name}"))
        general.append(family(metric_name, kind, doc))
        general[-1].add_sample(_sample_name(general[-1]), {}, value)
    yield from general
    yield from per_queue.values()
    if info:
        yield InfoMetricFamily("mqd_build", "Version and storage backend.", value=info)


def _sample_name(metric: Metric) -> str:
    return metric.name + "_total" if metric.type == "counter" else metric.name


def _number(raw: object) -> float | None:
    if isinstance(raw, bool):
        return float(raw)
    if isinstance(raw, int | float):
        return float(raw)
    try:
        return float(str(raw))
    except ValueError:
        return None


class Latencies:
    """Command latencies as histogram buckets, kept on the event loop.

    Hand-written rather than prometheus_client's Histogram: that one takes a
    lock for each observation (1.7 us here), this a bisect and an increment
    (0.4 us), and it is paid on every command. Only the loop writes it; the
    scrape copies it on the loop, so no lock is needed.
    """

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last: above every bound
        self.total = 0.0

    def copy(self) -> Latencies:
        copy = Latencies()
        copy.counts, copy.total = list(self.counts), self.total
        return copy

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative counts per upper bound, as Prometheus' `le` buckets."""
        out: list[tuple[str, float]] = []
        seen = 0
        for bound, count in zip([*map(str, LATENCY_BUCKETS), "+Inf"], self.counts, strict=True):
            seen += count
            out.append((bound, seen))
        return out


class Snapshot:
    """Every figure of one scrape, copied on the event loop."""

    def __init__(
        self,
        stats: list[tuple[str, object]],
        latencies: dict[str, Latencies],
        errors: dict[tuple[str, str], int],
    ) -> None:
        self.stats = stats
        self.latencies = latencies
        self.errors = errors

    def collect(self) -> Iterator[Metric]:
        """Prometheus metric families (a snapshot is a prometheus_client collector)."""
        from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily

        yield from families(self.stats)
        histogram = HistogramMetricFamily(
            "mqd_command_duration_seconds",
            "Time from starting a command to its reply (a get's /t= wait included).",
            labels=["command"],
        )
        for name, latency in sorted(self.latencies.items()):
            histogram.add_metric([name], latency.buckets(), latency.total)
        yield histogram
        # Every command that ran has its error series, at 0 until one fails:
        # a rate() or an alert on them then sees a series from the start.
        commands = sorted({*self.latencies, *(command for _, command in self.errors)})
        for kind, doc in ERRORS.items():
            counter = CounterMetricFamily(f"mqd_{kind}_errors", doc, labels=["command"])
            for command in commands:
                counter.add_metric([command], self.errors.get((kind, command), 0))
            yield counter


ERRORS = {
    "backend": "Commands answered SERVER_ERROR because storage failed.",
    "internal": "Commands answered SERVER_ERROR internal error (logged with a traceback).",
}


class _Collector:
    """What prometheus_client's app calls (in the HTTP thread) at each scrape."""

    def __init__(self, loop: asyncio.AbstractEventLoop, snapshot: Callable[[], Any]) -> None:
        self.loop = loop
        self.snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        future = asyncio.run_coroutine_threadsafe(self.snapshot(), self.loop)
        try:
            snapshot: Snapshot = future.result(SCRAPE_TIMEOUT)
        except TimeoutError:
            future.cancel()
            raise LoopTimeout() from None
        return list(snapshot.collect())


class LoopTimeout(Exception):
    """The event loop did not gather the figures within SCRAPE_TIMEOUT."""


class _Handler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics: " + format, *args)


class Metrics:
    """The admin listener, and the figures only it has (latencies, errors by command)."""

    def __init__(self, listen: str, port: int) -> None:
        self.listen = listen
        self.port = port
        self.latencies: dict[str, Latencies] = {}
        self.errors: dict[tuple[str, str], int] = {}  # (kind, command) -> count
        self._source: StatsSource | None = None
        self._httpd: Any = None
        self._thread: threading.Thread | None = None
        self.bound: tuple[str, int] | None = None

    # -- hooks called by the server for every command ----------------------

    def observe(self, command: Command, started: float) -> None:
        self.observe_named(command_name(command), started)

    def observe_named(self, name: str, started: float) -> None:
        """A command's time under the label `name` (another wire names its own commands)."""
        seconds = time.perf_counter() - started
        latency = self.latencies.get(name)
        if latency is None:
            latency = self.latencies[name] = Latencies()
        latency.counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        latency.total += seconds

    def failed(self, command: Command, error: Exception) -> None:
        self.failed_named(command_name(command), error)

    def failed_named(self, name: str, error: Exception) -> None:
        if isinstance(error, StorageError):
            kind = "backend"
        elif not isinstance(error, ProtocolError):
            kind = "internal"
        else:
            return  # the client's mistake, not the daemon's
        key = (kind, name)
        self.errors[key] = self.errors.get(key, 0) + 1

    async def snapshot(self) -> Snapshot:
        """Every figure, read on the event loop (the broker's state lives there)."""
        assert self._source is not None
        stats = await self._source()
        latencies = {name: latency.copy() for name, latency in self.latencies.items()}
        return Snapshot(stats, latencies, dict(self.errors))

    # -- the listener ------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop, source: StatsSource) -> tuple[str, int]:
        """Listen on `listen`:`port` in a thread of its own; return the bound address."""
        from prometheus_client import CollectorRegistry, make_wsgi_app
        from prometheus_client.exposition import ThreadingWSGIServer
        from prometheus_client.process_collector import ProcessCollector

        self._source = source
        registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        registry.register(_Collector(loop, self.snapshot))
        metrics_app = make_wsgi_app(registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            # prometheus_client answers on every path; only /metrics is ours.
            if environ.get("PATH_INFO") != PATH:
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [b"metrics are at /metrics\n"]
            try:
                return metrics_app(environ, start_response)  # type: ignore[no-any-return]
            except LoopTimeout:
                start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
                return [b"the event loop did not answer in time\n"]

        try:
            family = socket.getaddrinfo(
                self.listen, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0][0]
        except OSError as error:
            raise MqdError(f"metrics.listen = {self.listen!r}: {error}") from None

        class Server(ThreadingWSGIServer):
            address_family = family

        try:
            self._httpd = make_server(self.listen, self.port, app, Server, handler_class=_Handler)
        except OSError as error:
            raise MqdError(f"cannot serve metrics on {self.listen}:{self.port}: {error}") from None
        address = self._httpd.socket.getsockname()
        self.bound = (address[0], address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="mqd-metrics", daemon=True
        )
        self._thread.start()
        log.info("metrics at http://%s:%d%s", self.bound[0], self.bound[1], PATH)
        return self.bound

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(5)
        self._httpd = None
