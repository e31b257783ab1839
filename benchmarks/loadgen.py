"""A cheap pipelining load generator for queue servers.

It speaks three wires: the memcached text protocol (mqd, memcached), RESP
(Redis lists) and beanstalkd's text protocol. Each wire is a small class that
knows how to build request batches and how to tell, from the raw reply bytes,
how many replies are complete. The engine around them is protocol-blind.

Why it is cheap: a batch of `depth` commands is built once and sent with one
`send`; replies are never split into lines in Python. A wire counts reply
terminators with `bytes.count`, which runs in C, and the engine compares that
count with the number of replies the batch expects. Each worker process runs
one epoll loop over its share of the connections, so the per-batch Python
cost is a handful of calls whatever the batch size.

Latency is the round trip of one batch: from the `send` of its first byte to
the arrival of its last reply (with pipelining that is the time the client
waits for the whole batch, the honest figure for a pipelining client).

Run `python benchmarks/loadgen.py --help` for the command line.
"""

from __future__ import annotations

import argparse
import itertools
import math
import multiprocessing as mp
import os
import re
import select
import socket
import sys
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

WORKLOADS = ("queue", "set", "get")

# Reply bytes as received: one recv's bytes, or several joined.
Buf = bytes | bytearray


# --------------------------------------------------------------------------
# Wires
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Command:
    """One request as it goes on the wire.

    `ops` is what the command counts for in throughput (an enqueue or a
    dequeue is one op); `replies` is how many reply units the wire's
    `complete()` counts for it once its reply has fully arrived.
    """

    data: bytes
    ops: int = 1
    replies: int = 1
    enqueue: bool = False  # carries a message body (rebuilt when bodies must differ)


class Wire:
    """Protocol specifics: requests for each workload, and reply accounting.

    `complete(buf)` must never count a reply before all of its bytes are in
    `buf`, and must equal the number of replies once they all are; it may
    undercount a half-received reply. The engine only compares it with the
    expected total, so a lower bound that becomes exact is all it needs.
    """

    name = "wire"
    # True when an error reply is counted by complete() like any other reply
    # (wires that count plain CRLFs), so it must be looked for afterwards too.
    counts_errors = True

    def __init__(self, queue: str = "q", size: int = 100) -> None:
        if size < 1:
            raise ValueError("message size must be at least 1 byte")
        self.queue = queue.encode()
        # A body with no CR, LF or protocol marker bytes in it, so that
        # counting terminators in the raw reply stream is exact.
        self.body = b"x" * size
        self.size = size

    def handshake(self) -> Command | None:
        """A request sent once per connection before the load, if any."""
        return None

    def cycle(self, workload: str) -> list[Command]:
        """One period of the command stream of `workload`."""
        if workload == "queue":
            return [self.enqueue(), self.dequeue()]
        if workload == "set":
            return [self.enqueue()]
        if workload == "get":
            return [self.dequeue()]
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")

    def enqueue(self, body: bytes | None = None) -> Command:
        """Enqueue `body` (of `size` bytes), or the wire's fixed body."""
        raise NotImplementedError

    def dequeue(self) -> Command:
        raise NotImplementedError

    def complete(self, buf: Buf) -> int:
        raise NotImplementedError

    def failed(self, buf: Buf) -> bool:
        """True if `buf` holds an error reply (which the count would never see)."""
        raise NotImplementedError

    def hits(self, buf: Buf) -> int:
        """How many messages were handed out in the replies in `buf`."""
        raise NotImplementedError

    def followup(self, buf: Buf) -> Command | None:
        """A second request that a completed batch needs (beanstalkd's deletes)."""
        return None


class MemcacheWire(Wire):
    """The memcached text protocol: `set` enqueues, `get` dequeues (mqd).

    Against memcached itself the same commands set and read one key, which
    is the reference for the cost of the protocol and the network path.
    """

    name = "memcache"
    # Errors end in neither terminator, so a batch with one never completes
    # and is caught while waiting: no scan of every completed batch needed.
    counts_errors = False

    def __init__(self, queue: str = "q", size: int = 100, get_suffix: str = "") -> None:
        super().__init__(queue, size)
        self.key = self.queue + get_suffix.encode()

    def enqueue(self, body: bytes | None = None) -> Command:
        body = body or self.body
        return Command(b"set %s 0 0 %d\r\n%s\r\n" % (self.queue, len(body), body), enqueue=True)

    def dequeue(self) -> Command:
        return Command(b"get %s\r\n" % self.key)

    def complete(self, buf: Buf) -> int:
        # Every storage reply ends in "STORED\r\n" (NOT_STORED included) and
        # every retrieval reply in "END\r\n"; neither occurs in a body.
        return buf.count(b"STORED\r\n") + buf.count(b"END\r\n")

    def failed(self, buf: Buf) -> bool:
        # ERROR, CLIENT_ERROR ..., SERVER_ERROR ... all contain it.
        return b"ERROR" in buf

    def hits(self, buf: Buf) -> int:
        return buf.count(b"VALUE ")


class RespWire(Wire):
    """Redis lists over RESP: LPUSH enqueues, RPOP dequeues (FIFO)."""

    name = "resp"

    def __init__(self, queue: str = "q", size: int = 100) -> None:
        super().__init__(queue, size)
        self._key = b"$%d\r\n%s\r\n" % (len(self.queue), self.queue)

    def enqueue(self, body: bytes | None = None) -> Command:
        body = body or self.body
        return Command(
            b"*3\r\n$5\r\nLPUSH\r\n%s$%d\r\n%s\r\n" % (self._key, len(body), body), enqueue=True
        )

    def dequeue(self) -> Command:
        return Command(b"*2\r\n$4\r\nRPOP\r\n%s" % self._key)

    def complete(self, buf: Buf) -> int:
        # Integer and nil replies hold one CRLF, a bulk string two, and only
        # a bulk string's header starts with "$" followed by a digit. So
        # CRLFs minus bulk headers counts replies; a bulk whose header came
        # but not its body adds 0 or -1, never too much.
        bulks = buf.count(b"$") - buf.count(b"$-")
        return buf.count(b"\r\n") - bulks

    def failed(self, buf: Buf) -> bool:
        return buf.startswith(b"-") or b"\r\n-" in buf

    def hits(self, buf: Buf) -> int:
        return buf.count(b"$") - buf.count(b"$-")


class BeanstalkWire(Wire):
    """beanstalkd: `put` enqueues; a dequeue is `reserve-with-timeout 0` and,
    once its reply names the job, `delete <id>` (two round trips, as any
    beanstalkd consumer needs)."""

    name = "beanstalk"
    _reserved = re.compile(rb"RESERVED (\d+) ")

    def handshake(self) -> Command:
        q = self.queue
        # USING, WATCHING 2, WATCHING 1: one line each.
        return Command(b"use %s\r\nwatch %s\r\nignore default\r\n" % (q, q), 0, 3)

    def enqueue(self, body: bytes | None = None) -> Command:
        body = body or self.body
        return Command(b"put 1024 0 60 %d\r\n%s\r\n" % (len(body), body), enqueue=True)

    def dequeue(self) -> Command:
        return Command(b"reserve-with-timeout 0\r\n")

    def complete(self, buf: Buf) -> int:
        # A RESERVED reply holds two CRLFs, every other reply one: CRLFs
        # minus RESERVED headers (a lower bound while one is half in).
        return buf.count(b"\r\n") - buf.count(b"RESERVED ")

    def failed(self, buf: Buf) -> bool:
        return any(
            m in buf
            for m in (b"ERROR", b"NOT_FOUND", b"BURIED", b"DRAINING", b"EXPECTED_CRLF", b"JOB_")
        )

    def hits(self, buf: Buf) -> int:
        return buf.count(b"RESERVED ")

    def followup(self, buf: Buf) -> Command | None:
        ids = self._reserved.findall(buf)
        if not ids:
            return None
        return Command(b"".join(b"delete %s\r\n" % i for i in ids), 0, len(ids))


def make_wire(name: str, queue: str = "q", size: int = 100, get_suffix: str = "") -> Wire:
    """The wire called `name` ("memcache", "resp" or "beanstalk")."""
    if name == "memcache":
        return MemcacheWire(queue, size, get_suffix)
    if get_suffix:
        raise ValueError("get options exist only on the memcache wire")
    if name == "resp":
        return RespWire(queue, size)
    if name == "beanstalk":
        return BeanstalkWire(queue, size)
    raise ValueError(f"unknown wire {name!r}")


# --------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Batch:
    data: bytes
    ops: int
    replies: int


def _batch(cmds: Sequence[Command]) -> Batch:
    return Batch(
        b"".join(c.data for c in cmds), sum(c.ops for c in cmds), sum(c.replies for c in cmds)
    )


class Plan:
    """The batches a connection sends, in order, for a workload and depth.

    The command stream repeats the wire's cycle; a batch is the next `depth`
    commands of it. The distinct batches are built once (there are at most
    len(cycle) of them); a connection with an op quota gets a shorter last
    batch so that the total is exact.

    With `unique`, every enqueued body differs (a per-run nonce and a
    counter, padded to the size), for servers that store a body only once
    (mqd's bdb-random, queues with `unique = true`); batches are then built
    as they are sent, which costs a little generator time.
    """

    def __init__(self, wire: Wire, workload: str, depth: int, unique: bool = False) -> None:
        if depth < 1:
            raise ValueError("depth must be at least 1")
        self.wire = wire
        self.cycle = wire.cycle(workload)
        self.depth = depth
        self.unique = unique
        self._seq = itertools.count()
        self._nonce = os.urandom(6).hex().encode()  # lower-case hex: no protocol marker
        n = len(self.cycle)
        period = math.lcm(n, depth) // depth  # batches before the stream repeats
        self.batches = [self._slice(i * depth, depth) for i in range(period)]

    def body(self) -> bytes:
        tag = b"%s-%d-" % (self._nonce, next(self._seq))
        if len(tag) > self.wire.size:
            raise ValueError(f"unique bodies need at least {len(tag)} bytes")
        return tag.ljust(self.wire.size, b"x")

    def _slice(self, start: int, count: int) -> Batch:
        n = len(self.cycle)
        cmds = [self.cycle[(start + k) % n] for k in range(count)]
        if self.unique:
            cmds = [self.wire.enqueue(self.body()) if c.enqueue else c for c in cmds]
        return _batch(cmds)

    def batch(self, index: int, ops_left: int | None) -> Batch:
        """Batch number `index`, cut short if fewer than depth ops remain."""
        if self.unique:
            count = self.depth if ops_left is None else min(self.depth, ops_left)
            return self._slice(index * self.depth, count)
        b = self.batches[index % len(self.batches)]
        if ops_left is None or b.ops <= ops_left:
            return b
        return self._slice(index * self.depth, ops_left)


# --------------------------------------------------------------------------
# Engine
# --------------------------------------------------------------------------


@dataclass
class LoadSpec:
    """Everything a run needs; picklable, so workers get a copy."""

    host: str
    port: int
    wire: str = "memcache"
    workload: str = "queue"
    connections: int = 1
    processes: int = 1
    depth: int = 1
    duration: float | None = 5.0  # seconds; None: bounded by `ops` only
    ops: int | None = None  # total ops across all connections
    queue: str = "q"
    size: int = 100
    get_suffix: str = ""  # e.g. "/t=100" for waiting gets on mqd
    unique: bool = False  # every enqueued body different (see Plan)
    timeout: float = 30.0  # no reply for this long is an error
    max_seconds: float = 3600.0  # hard stop, whatever else is set


@dataclass
class LoadResult:
    """Merged figures of one run. `ops` counts enqueues plus dequeues."""

    ops: int
    hits: int
    batches: int
    elapsed: float
    latencies: array[float] = field(repr=False)
    errors: list[str] = field(default_factory=list)
    # The server's CPU seconds during the run, when the caller measured them.
    server_cpu: float | None = None

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def cpu_us_per_op(self) -> float | None:
        """The server's CPU time per op in microseconds, if measured."""
        if self.server_cpu is None or not self.ops:
            return None
        return self.server_cpu / self.ops * 1e6

    def percentile(self, p: float) -> float:
        """Batch round-trip latency percentile `p` (0-100), in milliseconds."""
        lat = sorted(self.latencies)
        if not lat:
            return math.nan
        k = min(len(lat) - 1, max(0, math.ceil(p / 100 * len(lat)) - 1))
        return lat[k] * 1000.0

    @property
    def p50(self) -> float:
        return self.percentile(50)

    @property
    def p99(self) -> float:
        return self.percentile(99)

    def summary(self) -> str:
        return (
            f"{self.ops_per_s:,.0f} ops/s  p50 {self.p50:.3f} ms  p99 {self.p99:.3f} ms  "
            f"({self.ops:,} ops, {self.hits:,} messages out, {self.batches:,} batches "
            f"in {self.elapsed:.2f} s)"
        )


class _Conn:
    __slots__ = ("batch", "buf", "expected", "followed", "index", "ops", "sock", "t0")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf: bytes | bytearray = b""
        self.index = 0
        self.ops = 0
        self.expected = 0
        self.t0 = 0.0
        self.followed = False
        self.batch: Batch | None = None


def _send(sock: socket.socket, data: bytes) -> None:
    sent = sock.send(data)
    if sent < len(data):
        # Rare (a batch larger than the socket buffer): finish blocking.
        # The server's replies are bounded by one batch, so this can't stall.
        sock.setblocking(True)
        try:
            sock.sendall(data[sent:])
        finally:
            sock.setblocking(False)


def _handshake(sock: socket.socket, wire: Wire, timeout: float) -> None:
    cmd = wire.handshake()
    if cmd is None:
        return
    sock.settimeout(timeout)
    sock.sendall(cmd.data)
    buf = bytearray()
    while buf.count(b"\r\n") < cmd.replies:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("server closed the connection during the handshake")
        buf += chunk
    if wire.failed(buf):
        raise ConnectionError(f"handshake failed: {bytes(buf)!r}")


def _quotas(total: int | None, n: int) -> list[int | None]:
    if total is None:
        return [None] * n
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def _worker(
    spec: LoadSpec,
    quotas: list[int | None],
    start: Any,
    results: Any,
) -> None:
    """One process: connect, wait for the common start, drive the load."""
    try:
        results.put(_drive(spec, quotas, start))
    except BaseException as exc:  # reported, not raised: the parent collects
        results.put({"error": f"{type(exc).__name__}: {exc}"})


def _drive(spec: LoadSpec, quotas: list[int | None], start: Any) -> dict[str, Any]:
    wire = make_wire(spec.wire, spec.queue, spec.size, spec.get_suffix)
    plan = Plan(wire, spec.workload, spec.depth, spec.unique)
    conns: dict[int, _Conn] = {}
    limits: dict[int, int | None] = {}
    for quota in quotas:
        sock = socket.create_connection((spec.host, spec.port), timeout=spec.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _handshake(sock, wire, spec.timeout)
        sock.setblocking(False)
        conns[sock.fileno()] = _Conn(sock)
        limits[sock.fileno()] = quota
    if start is not None:
        start.wait()

    lat: array[float] = array("d")
    record = lat.append
    clock = time.perf_counter
    complete, failed, hits_of, followup = wire.complete, wire.failed, wire.hits, wire.followup
    has_followup = type(wire).followup is not Wire.followup
    check_after = wire.counts_errors
    recv = socket.socket.recv
    total_ops = hits = batches = 0
    errors: list[str] = []
    t_start = clock()
    deadline = t_start + min(spec.duration or spec.max_seconds, spec.max_seconds)
    ep = select.epoll()
    live = 0

    def launch(fd: int, c: _Conn) -> bool:
        limit = limits[fd]
        left = None if limit is None else limit - c.ops
        if left is not None and left <= 0:
            return False
        b = plan.batch(c.index, left)
        c.batch = b
        c.expected = b.replies
        c.followed = False
        c.t0 = clock()
        _send(c.sock, b.data)
        return True

    for fd, c in conns.items():
        ep.register(fd, select.EPOLLIN)
        if launch(fd, c):
            live += 1
        else:
            ep.unregister(fd)

    last_progress = clock()
    while live:
        events = ep.poll(1.0)
        now = clock()
        if not events:
            if now - last_progress > spec.timeout:
                errors.append(f"no reply for {spec.timeout:.0f} s; {live} connections waiting")
                break
            continue
        last_progress = now
        for fd, _ev in events:
            c = conns[fd]
            # 64 KiB: a larger size makes every recv allocate (and the
            # allocator mmap) a big buffer, which costs more than the copy.
            chunk = recv(c.sock, 65536)
            if not chunk:
                errors.append("server closed a connection")
                ep.unregister(fd)
                live -= 1
                continue
            # Usually a batch's replies come in one recv: then count on the
            # received bytes themselves and copy nothing.
            if c.buf:
                c.buf += chunk
                buf = c.buf
            else:
                buf = chunk
            # Cheap filter first: every reply of every wire ends in CRLF.
            if not buf.endswith(b"\r\n") or complete(buf) < c.expected:
                if failed(buf):
                    errors.append(f"error reply: {bytes(buf[-200:])!r}")
                    ep.unregister(fd)
                    live -= 1
                elif buf is chunk:
                    c.buf = bytearray(chunk)
                continue
            if check_after and failed(buf):
                errors.append(f"error reply: {bytes(buf[-200:])!r}")
                ep.unregister(fd)
                live -= 1
                continue
            if has_followup and not c.followed:
                hits += hits_of(buf)
                more = followup(buf)
                if more is not None:
                    c.followed = True
                    c.expected = more.replies
                    c.buf = b""
                    _send(c.sock, more.data)
                    continue
            elif not has_followup:
                hits += hits_of(buf)
            t = clock()
            record(t - c.t0)
            batches += 1
            assert c.batch is not None
            c.ops += c.batch.ops
            total_ops += c.batch.ops
            c.index += 1
            c.buf = b""
            if t >= deadline or not launch(fd, c):
                ep.unregister(fd)
                live -= 1
    elapsed = clock() - t_start
    ep.close()
    for c in conns.values():
        c.sock.close()
    return {
        "ops": total_ops,
        "hits": hits,
        "batches": batches,
        "elapsed": elapsed,
        "lat": lat.tobytes(),
        "errors": errors,
    }


def run_load(spec: LoadSpec) -> LoadResult:
    """Run one load as `spec` says and return the merged figures.

    Connections are spread round-robin over `spec.processes` worker
    processes; all of them connect first and start together, so the
    connection set-up is not in the figures.
    """
    if spec.duration is None and spec.ops is None:
        raise ValueError("bound the load: give a duration, an op count, or both")
    if spec.connections < 1 or spec.processes < 1:
        raise ValueError("need at least one connection and one process")
    procs = min(spec.processes, spec.connections)
    quotas = _quotas(spec.ops, spec.connections)
    shares = [quotas[i::procs] for i in range(procs)]
    if procs == 1:
        # In-process: no fork, no pickling; what tests and small runs want.
        parts = [_drive(spec, shares[0], None)]
    else:
        # epoll makes this Linux-only anyway; fork starts workers at once.
        ctx = mp.get_context("fork")
        start = ctx.Barrier(procs)
        results = ctx.Queue()
        workers = [
            ctx.Process(target=_worker, args=(spec, share, start, results), daemon=True)
            for share in shares
        ]
        for w in workers:
            w.start()
        parts = []
        wait = spec.max_seconds + spec.timeout + 60
        for _ in workers:
            parts.append(results.get(timeout=wait))
        for w in workers:
            w.join(10)
    errors: list[str] = []
    lat: array[float] = array("d")
    ops = hits = batches = 0
    elapsed = 0.0
    for part in parts:
        if "error" in part:
            errors.append(part["error"])
            continue
        ops += part["ops"]
        hits += part["hits"]
        batches += part["batches"]
        elapsed = max(elapsed, part["elapsed"])
        lat.frombytes(part["lat"])
        errors.extend(part["errors"])
    return LoadResult(ops, hits, batches, elapsed, lat, errors)


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Pipelining load generator for memcached-protocol queues, Redis, beanstalkd."
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=22133)
    p.add_argument("--wire", choices=("memcache", "resp", "beanstalk"), default="memcache")
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="queue",
        help="queue: enqueue+dequeue pairs; set: enqueue only; get: dequeue only",
    )
    p.add_argument("-c", "--connections", type=int, default=16)
    p.add_argument("-P", "--processes", type=int, default=1)
    p.add_argument("-d", "--depth", type=int, default=1, help="commands per write")
    p.add_argument("--duration", type=float, default=5.0, help="seconds (0: ops bound only)")
    p.add_argument("--ops", type=int, default=None, help="total ops across connections")
    p.add_argument("--queue", default="q")
    p.add_argument("--size", type=int, default=100, help="message bytes")
    p.add_argument("--get-suffix", default="", help="appended to the key of gets, e.g. /t=100")
    p.add_argument("--unique", action="store_true", help="make every enqueued body different")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: run one load and print its figures."""
    a = _parser().parse_args(argv)
    spec = LoadSpec(
        host=a.host,
        port=a.port,
        wire=a.wire,
        workload=a.workload,
        connections=a.connections,
        processes=a.processes,
        depth=a.depth,
        duration=a.duration or None,
        ops=a.ops,
        queue=a.queue,
        size=a.size,
        get_suffix=a.get_suffix,
        unique=a.unique,
    )
    res = run_load(spec)
    print(res.summary())
    for e in res.errors[:10]:
        print("error:", e, file=sys.stderr)
    return 1 if res.errors else 0


if __name__ == "__main__":
    sys.exit(main())
