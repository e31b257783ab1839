"""The Redis listener: RESP2 connections served by the same broker, loop and limits.

A `RedisConnection` is the memcached `Connection` with another parser and
another set of commands: admission, flow control, waiting and the hand-back
of open messages on close are the same code. Each Redis command is one method
here, turning arguments into broker calls and results into RESP replies
(mqd.resp); arity and the COMMAND table come from `COMMANDS`.

Queues are FIFO whatever the command's side: every push (LPUSH, RPUSH, SADD)
appends at the tail and every pop (RPOP, LPOP, SPOP, BRPOP, BLPOP) takes the
head, so both usual pairs, LPUSH+RPOP and RPUSH+LPOP, are first in, first out.

A little over 500 lines: one short method per command, kept beside the table
that names them, so that a command's rules are read in one place.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mqd import __version__, resp
from mqd.backend import Capability, Message, Put, QueueSize
from mqd.connection import Connection
from mqd.eager import run_together
from mqd.errors import ClientError, NotSupported, ProtocolError, ServerError, StorageError
from mqd.protocol import TOO_LARGE, Key, Retrieve, Store, name_bytes, queue_name

if TYPE_CHECKING:
    from mqd.server import Server

log = logging.getLogger(__name__)

NAMES_CACHE = 4096  # queue names whose validity a connection remembers
_ids = itertools.count(1)


# Requests that may start together (see RedisConnection.groups), by argument count.
_GROUPED = {
    3: frozenset({b"lpush", b"rpush", b"sadd"}),
    2: frozenset({b"rpop", b"lpop", b"spop"}),
}
_PUSHES = frozenset({b"lpush", b"rpush"})


class RedisConnection(Connection):
    """One Redis client connection."""

    refusal = b"-ERR max number of clients reached\r\n"
    straight_to_broker = False

    def __init__(self, server: Server) -> None:
        super().__init__(server)
        self.parser = resp.Parser(server.config.max_item_size)
        self.id = next(_ids)
        self.name = b""
        self._gets: dict[bytes, Retrieve] = {}
        # RESP2 until HELLO 3: then nulls are RESP3's, the only reply that differs here.
        self.null = resp.NIL
        self.null_array = resp.NIL_ARRAY

    async def _execute(self, request: Any) -> bytes | None:
        """Run one request: its reply, or None once the connection is closed."""
        if type(request) is resp.Failed:
            if not request.close:
                return resp.error_reply(request)
            self.out.append(resp.error_reply(request))
            self.close()
            return None
        metrics = self.server.metrics
        started = time.perf_counter() if metrics is not None else 0.0
        try:
            return await self.execute(request)
        except StorageError as error:
            self.server.storage_failed(
                "storage error in %s: %s", self.server.config.data_dir, error
            )
            if metrics is not None:
                metrics.failed_named(_label(request), error)
            return resp.error_reply(error)
        except ProtocolError as error:
            return resp.error_reply(error)
        except Exception as error:
            if metrics is not None:
                metrics.failed_named(_label(request), error)
            log.exception("redis command failed: %r", request[:1])
            return resp.error("internal error")
        finally:
            if metrics is not None:
                metrics.observe_named(_label(request), started)

    @staticmethod
    def groups(request: Any) -> bool:
        """Pushes of one value and pops of one message may start with those around them.

        Their storage calls are then made in order in one turn of the loop, so a
        group-committing backend flushes once for a pipeline of them. A push's
        length reply is read after its store: see reads_after_storing.
        """
        return type(request) is list and request[0].lower() in _GROUPED.get(len(request), ())

    def reads_after_storing(self, request: Any) -> bool:
        """A push's length reply is read once its values are stored.

        On a backend that holds answers (Berkeley DB) a store waits only where
        it cannot run at once (a queue made on the worker thread): the pops
        behind it then start once the length is read, so that it counts none
        of them. Where every store waits (a shared store), they keep starting
        with it, as docs/protocol.md allows.
        """
        return self.broker.backend.answers_held and request[0].lower() in _PUSHES

    def _login(self, request: Any) -> bytes | None:
        """Before a login only AUTH, HELLO and QUIT run (None: run it); others: NOAUTH."""
        if type(request) is resp.Failed or request[0].lower() in (b"auth", b"hello", b"quit"):
            return None
        return resp.error(resp.ERRORS["noauth"], "NOAUTH")

    def execute(self, args: list[bytes]) -> Awaitable[bytes]:
        spec = COMMANDS.get(args[0].lower())
        if spec is None:
            raise resp.client_error("unknown", resp.quoted(args[0]))
        count, arity = len(args), spec.arity
        if (arity > 0 and count != arity) or count < -arity:
            raise resp.client_error("arity", spec.name)
        return spec.run(self, args)

    # -- arguments ---------------------------------------------------------

    def get(self, raw: bytes) -> Retrieve:
        """A plain `get` of the queue `raw` names (Redis keys are queue names), made once."""
        gets = self._gets
        get = gets.get(raw)
        if get is None:
            name = queue_name(raw)
            if name is None:
                raise resp.client_error("name")
            if len(gets) >= NAMES_CACHE:
                gets.clear()  # names are client-chosen: keep the cache bounded
            get = gets[raw] = Retrieve([Key(raw, name, plain=True)], False)
        return get

    def queue(self, raw: bytes) -> str:
        return self.get(raw).keys[0].queue

    def timeout(self, raw: bytes) -> float:
        """A blocking command's timeout in seconds, at most `max_wait` (Redis' 0, for ever, too)."""
        max_wait = self.server.config.max_wait
        return min(resp.parse_timeout(raw) or max_wait, max_wait)

    # -- lists -------------------------------------------------------------

    def error_line(self, error: StorageError) -> bytes:
        return resp.error_reply(error)

    async def do_push(self, args: list[bytes]) -> bytes:
        """LPUSH, RPUSH: append the values in argument order; reply the queue's length.

        The connection holds the reply (mqd.backend.Holder), as it does a
        memcached `set`'s: on a backend that holds replies the push is made at
        once and the reply goes out once it is durable, so the pushes and
        pops of a pipeline share one commit instead of one each.
        """
        queue = self.queue(args[1])
        values = args[2:]
        # As Redis' pushes, all or nothing where it can be known beforehand: a
        # value over the queue's size limit stores none of them.
        state = self.broker.state(queue)
        if max(map(len, values), default=0) > state.max_item_size:
            raise ServerError(TOO_LARGE)
        stores = (Store(False, queue, 0, 0, body, False) for body in values)
        if len(values) > 1 and not state.limits:
            # Every value is handed to the store before any waits (a queue being
            # made), so that the values of two pushes never interleave. A queue
            # with limits takes them one by one instead: a value refused there
            # must stop the rest (a smaller one after it could still fit).
            stored = await run_together([self.broker.store(store, self) for store in stores])
            for put in stored:
                if isinstance(put, BaseException):
                    raise put
        else:
            for done, store in enumerate(stores):
                if await self.broker.store(store, self) is Put.FULL:
                    raise ServerError(f"queue full: {done} of {len(values)} values stored")
        return resp.integer(_items(await self.broker.size(queue)))

    async def do_pop(self, args: list[bytes]) -> bytes:
        """RPOP, LPOP key [count]: the head message(s)."""
        if len(args) == 2:  # held as a push is (do_push)
            message = await self.broker.take(self.queue(args[1]), holder=self)
            return resp.bulk(message.body) if message is not None else self.null
        if len(args) > 3:
            raise resp.client_error("arity", args[0].decode("latin-1").lower())
        count = resp.parse_count(args[2])
        if not count:  # as Redis 7: an empty array from a list, a null one from no key
            waiting = _items(await self.broker.size(self.queue(args[1])))
            return resp.array([]) if waiting else self.null_array
        bodies = await self._take(args[1], count)
        return resp.array(bodies) if bodies else self.null_array

    async def _take(self, raw: bytes, count: int) -> list[bytes]:
        """Up to `count` messages from the head of a queue, without waiting (`get <queue>`)."""
        get = self.get(raw)
        bodies: list[bytes] = []
        while len(bodies) < count:
            hits = await self.broker.retrieve(get, self.session)
            if not hits:
                break
            bodies.append(hits[0][1].body)
        return bodies

    async def do_bpop(self, args: list[bytes]) -> bytes:
        """BRPOP, BLPOP key [key ...] timeout: the first message of any, waiting."""
        timeout = self.timeout(args[-1])
        queues = [self.queue(raw) for raw in args[1:-1]]
        taken = await self.broker.take_first(queues, timeout, self.session)
        if taken is None:
            return self.null_array
        queue, message = taken
        return resp.array([name_bytes(queue), message.body])

    async def do_llen(self, args: list[bytes]) -> bytes:
        return resp.integer(_items(await self.broker.size(self.queue(args[1]))))

    async def do_lmove(self, args: list[bytes]) -> bytes:
        """LMOVE src dst LEFT|RIGHT LEFT|RIGHT: src's head to dst's tail, durably."""
        resp.check_sides(args[3:5])
        return await self._move(args[1], args[2], 0.0)

    async def do_blmove(self, args: list[bytes]) -> bytes:
        resp.check_sides(args[3:5])
        return await self._move(args[1], args[2], self.timeout(args[5]))

    async def do_rpoplpush(self, args: list[bytes]) -> bytes:
        return await self._move(args[1], args[2], 0.0)

    async def do_brpoplpush(self, args: list[bytes]) -> bytes:
        return await self._move(args[1], args[2], self.timeout(args[3]))

    async def _move(self, raw_source: bytes, raw_target: bytes, timeout: float) -> bytes:
        """Reserve the head of the source, store it in the target, then acknowledge it.

        A failure in between gives the message back to the source (or, after a
        crash, delivers it twice), so a move never loses one.
        """
        source, target = self.queue(raw_source), self.queue(raw_target)
        wait = int(timeout * 1000) or None
        opening = Key(raw_source, source, wait_ms=wait, open=True)
        hits = await self.broker.retrieve(Retrieve([opening], False), self.session)
        if not hits:
            return self.null
        message = hits[0][1]
        try:
            put = await self.broker.store(_copy(target, message))
        except BaseException:
            await self._end_move(raw_source, source, abort=True)
            raise
        if put is Put.FULL:
            await self._end_move(raw_source, source, abort=True)
            raise ServerError("queue full: 0 of 1 values stored")
        # Onto itself, a unique queue finds the body already there: the message
        # moved is that copy, which acknowledging would remove. It goes back
        # instead, so the rotation leaves the set as it was.
        rotated_onto_itself = put is Put.DUPLICATE and source == target
        await self._end_move(raw_source, source, abort=rotated_onto_itself)
        return resp.bulk(message.body)

    async def _end_move(self, raw: bytes, queue: str, *, abort: bool) -> None:
        key = Key(raw, queue, abort=abort, close=not abort)
        await self.broker.retrieve(Retrieve([key], False), self.session)

    async def do_lrem(self, args: list[bytes]) -> bytes:
        """LREM key count element: remove every waiting copy (backends that know bodies)."""
        queue = self.queue(args[1])
        resp.parse_integer(
            args[2]
        )  # checked as Redis does; a body index removes every copy at once
        return resp.integer(await self._discard(queue, args[3], "lrem"))

    # -- sets --------------------------------------------------------------

    async def do_sadd(self, args: list[bytes]) -> bytes:
        """SADD key member [member ...]: how many were added (a unique queue adds each once)."""
        queue = self.queue(args[1])
        added = 0
        for body in args[2:]:
            if await self.broker.store(Store(False, queue, 0, 0, body, False)) is Put.STORED:
                added += 1
        return resp.integer(added)

    async def do_spop(self, args: list[bytes]) -> bytes:
        if len(args) > 3:
            raise resp.client_error("syntax")
        if len(args) == 2:
            bodies = await self._take(args[1], 1)
            return resp.bulk(bodies[0]) if bodies else self.null
        return resp.array(await self._take(args[1], resp.parse_count(args[2])))

    async def do_sismember(self, args: list[bytes]) -> bytes:
        queue = self.queue(args[1])
        self._need_unique("sismember")
        return resp.integer(int(await self.broker.contains(queue, args[2])))

    async def do_srem(self, args: list[bytes]) -> bytes:
        queue = self.queue(args[1])
        removed = 0
        for body in args[2:]:
            removed += await self._discard(queue, body, "srem")
        return resp.integer(removed)

    async def _discard(self, queue: str, body: bytes, command: str) -> int:
        self._need_unique(command)
        return await self.broker.discard(queue, body)

    def _need_unique(self, command: str) -> None:
        backend = self.broker.backend
        if Capability.UNIQUE not in backend.capabilities:
            raise NotSupported(command, backend.name)

    # -- keys --------------------------------------------------------------

    async def do_del(self, args: list[bytes]) -> bytes:
        deleted = 0
        for raw in args[1:]:
            deleted += await self.broker.delete(self.queue(raw))
        return resp.integer(deleted)

    async def do_exists(self, args: list[bytes]) -> bytes:
        found = 0
        for raw in args[1:]:
            found += await self.broker.size(self.queue(raw)) is not None
        return resp.integer(found)

    async def do_type(self, args: list[bytes]) -> bytes:
        queue = self.queue(args[1])
        if await self.broker.size(queue) is None:
            return resp.simple("none")
        return resp.simple("set" if self.broker.settings(queue).unique else "list")

    async def do_flushall(self, args: list[bytes]) -> bytes:
        if [a.upper() for a in args[1:]] not in ([], [b"ASYNC"], [b"SYNC"]):
            raise resp.client_error("syntax")
        await self.broker.flush_all()
        return resp.OK

    # -- connection and server ---------------------------------------------

    async def do_ping(self, args: list[bytes]) -> bytes:
        if len(args) > 2:
            raise resp.client_error("arity", "ping")
        return resp.bulk(args[1]) if len(args) == 2 else resp.PONG

    async def do_echo(self, args: list[bytes]) -> bytes:
        return resp.bulk(args[1])

    async def do_quit(self, args: list[bytes]) -> bytes:
        self.out.append(resp.OK)
        self.close()
        return b""

    async def do_select(self, args: list[bytes]) -> bytes:
        if resp.parse_integer(args[1]) != 0:
            raise resp.client_error("db_index")
        return resp.OK

    async def do_auth(self, args: list[bytes]) -> bytes:
        """AUTH [user] password, against [server.auth]'s users (user `default` if none)."""
        if len(args) > 3:
            raise resp.client_error("syntax")
        self._check_login(*args[1:])
        return resp.OK

    def _check_login(self, *credentials: bytes) -> None:
        authenticator = self.server.authenticator
        user, password = credentials if len(credentials) == 2 else (b"default", credentials[0])
        if authenticator is None:
            # As Redis with no password: its user `default` takes any password,
            # and no other user exists; AUTH <password> alone is a mistake.
            if len(credentials) == 1:
                raise resp.client_error("auth")
            if user != b"default":
                raise resp.CodedError("WRONGPASS", resp.ERRORS["wrongpass"])
            return
        if not authenticator.check(user, password):
            self.server.auth_failures("authentication failed for user %r", user)
            raise resp.CodedError("WRONGPASS", resp.ERRORS["wrongpass"])
        self.locked = False

    async def do_hello(self, args: list[bytes]) -> bytes:
        """HELLO [2|3 [AUTH ...] [SETNAME name]]: RESP2, or RESP3 for clients that ask."""
        protocol = 3 if self.null is resp.NULL3 else 2
        if len(args) > 1:
            try:
                protocol = int(args[1])
            except ValueError:
                raise ClientError("Protocol version is not an integer or out of range") from None
            if protocol not in (2, 3):
                raise resp.CodedError("NOPROTO", resp.ERRORS["noproto"])
            self._hello_options(args[2:])
        if self.locked:
            raise resp.CodedError("NOAUTH", resp.ERRORS["hello_noauth"])
        self.null = resp.NULL3 if protocol == 3 else resp.NIL
        self.null_array = resp.NULL3 if protocol == 3 else resp.NIL_ARRAY
        fields: list[tuple[bytes, resp.Reply]] = [
            (b"server", b"redis"),
            (b"version", REDIS_VERSION.encode()),
            (b"proto", protocol),
            (b"id", self.id),
            (b"mode", b"standalone"),
            (b"role", b"master"),
            (b"modules", []),
        ]
        if protocol == 3:
            return resp.mapping(fields)
        return resp.array([item for pair in fields for item in pair])

    def _hello_options(self, options: list[bytes]) -> None:
        """HELLO's [AUTH user password] [SETNAME name], as Redis reads them."""
        while options:
            option = options[0].upper()
            if option == b"AUTH" and len(options) >= 3:
                self._check_login(options[1], options[2])
                options = options[3:]
                continue
            if option == b"SETNAME" and len(options) >= 2:
                self._set_name(options[1])
                options = options[2:]
                continue
            raise ClientError(f"Syntax error in HELLO option '{resp.quoted(options[0])}'")

    def _set_name(self, name: bytes) -> None:
        """CLIENT SETNAME's check, as Redis': printable ASCII but space; "" clears it."""
        if any(byte < 0x21 or byte > 0x7E for byte in name):
            raise resp.client_error("client_name")
        self.name = name

    async def do_client(self, args: list[bytes]) -> bytes:
        sub = args[1].upper()
        if sub == b"SETNAME" and len(args) == 3:
            self._set_name(args[2])
            return resp.OK
        if sub == b"GETNAME" and len(args) == 2:
            return resp.bulk(self.name) if self.name else self.null
        if sub == b"ID" and len(args) == 2:
            return resp.integer(self.id)
        if sub == b"SETINFO" and len(args) == 4:
            return resp.OK
        raise resp.client_error("subcommand", resp.quoted(args[1]), "CLIENT")

    async def do_command(self, args: list[bytes]) -> bytes:
        sub = args[1].upper() if len(args) > 1 else b""
        if not sub:
            return resp.array([spec.info() for spec in COMMANDS.values()])
        if sub == b"COUNT":
            return resp.integer(len(COMMANDS))
        if sub == b"INFO":
            found = (COMMANDS.get(name.lower()) for name in args[2:])
            return resp.array([spec.info() if spec else None for spec in found])
        if sub == b"DOCS":
            return resp.EMPTY
        raise resp.client_error("subcommand", resp.quoted(args[1]), "COMMAND")

    async def do_info(self, args: list[bytes]) -> bytes:
        """INFO: a few fields clients look for, then the figures of memcached's `stats`."""
        config = self.server.config
        broker = self.broker
        stats = await broker.stats()  # awaited apart: mypyc cannot spill it from a list display
        server: list[tuple[str, object]] = [
            ("redis_version", REDIS_VERSION),
            ("mqd_version", __version__),
            ("redis_mode", "standalone"),
            ("process_id", os.getpid()),
            ("tcp_port", config.redis_port),
            ("uptime_in_seconds", int(time.time() - broker.started)),
        ]
        sections: list[tuple[str, list[tuple[str, object]]]] = [
            ("Server", server),
            ("Clients", [("connected_clients", len(self.server.connections))]),
            ("Persistence", [("loading", 0)]),
            ("Stats", stats),
        ]
        text = "".join(
            f"# {title}\r\n" + "".join(f"{name}:{value}\r\n" for name, value in fields) + "\r\n"
            for title, fields in sections
        )
        return resp.bulk(text.encode("utf-8", "surrogateescape"))


# Redis clients and tools that gate features on the server's version read
# `redis_version`; the commands here behave as Redis 7.0's do.
REDIS_VERSION = "7.0.0"


def _label(request: list[bytes]) -> str:
    """The metrics label of a request: `redis_<command>`, from a bounded set."""
    spec = COMMANDS.get(request[0].lower())
    return f"redis_{spec.name}" if spec else "redis_unknown"


def _items(size: QueueSize | None) -> int:
    """A queue's length as Redis counts it: 0 for one that does not exist."""
    return size.items if size else 0


def _copy(queue: str, message: Message) -> Store:
    # An absolute expiry time is a valid memcached exptime (beyond 30 days).
    exptime = math.ceil(message.expires) if message.expires else 0
    return Store(False, queue, message.flags, exptime, message.body, False)


Handler = Callable[[RedisConnection, list[bytes]], Awaitable[bytes]]


@dataclass(frozen=True)
class Spec:
    """One command: its name, Redis' arity rule, flags and key positions (for COMMAND)."""

    name: str
    arity: int  # n: exactly n arguments with the name; -n: at least n
    run: Handler
    flags: tuple[str, ...] = ()
    keys: tuple[int, int, int] = (0, 0, 0)  # first key, last key (-1: to the end), step

    def info(self) -> resp.Reply:
        first, last, step = self.keys
        return [self.name.encode(), self.arity, list(self.flags), first, last, step]


def _spec(name: str, arity: int, run: Handler, flags: str = "", keys: str = "") -> Spec:
    positions = tuple(int(k) for k in keys.split()) if keys else (0, 0, 0)
    return Spec(name, arity, run, tuple(flags.split()), positions)  # type: ignore[arg-type]


C = RedisConnection
COMMANDS: dict[bytes, Spec] = {
    spec.name.encode(): spec
    for spec in (
        _spec("lpush", -3, C.do_push, "write denyoom fast", "1 1 1"),
        _spec("rpush", -3, C.do_push, "write denyoom fast", "1 1 1"),
        _spec("lpop", -2, C.do_pop, "write fast", "1 1 1"),
        _spec("rpop", -2, C.do_pop, "write fast", "1 1 1"),
        _spec("blpop", -3, C.do_bpop, "write noscript", "1 -2 1"),
        _spec("brpop", -3, C.do_bpop, "write noscript", "1 -2 1"),
        _spec("llen", 2, C.do_llen, "readonly fast", "1 1 1"),
        _spec("lmove", 5, C.do_lmove, "write denyoom", "1 2 1"),
        _spec("blmove", 6, C.do_blmove, "write denyoom noscript", "1 2 1"),
        _spec("rpoplpush", 3, C.do_rpoplpush, "write denyoom", "1 2 1"),
        _spec("brpoplpush", 4, C.do_brpoplpush, "write denyoom noscript", "1 2 1"),
        _spec("lrem", 4, C.do_lrem, "write", "1 1 1"),
        _spec("sadd", -3, C.do_sadd, "write denyoom fast", "1 1 1"),
        _spec("spop", -2, C.do_spop, "write fast", "1 1 1"),
        _spec("scard", 2, C.do_llen, "readonly fast", "1 1 1"),
        _spec("sismember", 3, C.do_sismember, "readonly fast", "1 1 1"),
        _spec("srem", -3, C.do_srem, "write fast", "1 1 1"),
        _spec("del", -2, C.do_del, "write", "1 -1 1"),
        _spec("exists", -2, C.do_exists, "readonly fast", "1 -1 1"),
        _spec("type", 2, C.do_type, "readonly fast", "1 1 1"),
        _spec("flushall", -1, C.do_flushall, "write"),
        _spec("flushdb", -1, C.do_flushall, "write"),
        _spec("ping", -1, C.do_ping, "fast"),
        _spec("echo", 2, C.do_echo, "fast"),
        _spec("quit", -1, C.do_quit, "fast"),
        _spec("select", 2, C.do_select, "loading stale fast"),
        _spec("auth", -2, C.do_auth, "noscript loading stale fast"),
        _spec("hello", -1, C.do_hello, "noscript loading stale fast"),
        _spec("client", -2, C.do_client, "admin noscript loading stale"),
        _spec("command", -1, C.do_command, "loading stale"),
        _spec("info", -1, C.do_info, "loading stale"),
    )
}
