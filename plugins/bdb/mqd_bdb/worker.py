"""Where an environment's Berkeley DB work runs: the event loop and three threads.

A plain put, take or ack whose caller holds its reply back (a connection,
see mqd.backend.Holder) runs at once on the event loop, when the store is
free, in a transaction left open for the rest of that turn of the loop: a
round. At the end of the turn the round commits without a sync; if any of
its jobs asked for `Sync.ALWAYS` and it changed a message record (more than
puts it took itself and takes that found nothing: Store.wrote), the log is
synced, and the round's holders send their replies once that sync has ended
(or the error instead, if the round failed and was undone); but a holder
whose jobs left the message records of their queues as they were is
answered as the sync starts (_answer_early). With `aio_sync`,
the kernel syncs the log file while the loop goes on (mqd_bdb.logsync; but a
round of one job a connection the loop syncs itself where syncs are fast:
_nothing_to_overlap), and the next round stays open until GATHER_TURNS turns
of the loop after that sync ended are over (unless it wrote nothing, _free):
one commit and one sync for all that came meanwhile, and longer while the
connections that sync answered have not sent their next command (at most
one sync's duration, and MAX_GATHER_S). That is a group commit with no
future per job. Without Linux AIO, the loop syncs there and then where
syncs take under `loop_sync_max_us`, as Redis does; otherwise the sync
thread syncs while the loop goes on, the next round again staying open
until it is done. Bundles of quick jobs from callers that await futures run
in the same rounds, and are answered after the same syncs.

Everything else goes to the worker thread: the event loop hands jobs over in
bundles and awaits their futures. The worker takes whatever has arrived
(up to `max_batch` jobs) and runs it in one transaction, committed without
a sync. If a job asked for `Sync.ALWAYS`, the log is synced once for the
batch before any result is handed back (group commit); and since writers
answered by one sync tend to come back together, the worker first waits a
little (at most one sync's duration) for as many writers as the last sync
had, running what they send: one sync for all of them costs less than two.
All results of a sync go back to the loop in one call_soon_threadsafe.

Between batches the worker closes idle files and purges deleted queues. The
keeper thread syncs the log for `Sync.PERIODIC`, writes dirty pages out ahead
of time and checkpoints, so that none of that stalls the worker; it and the
sync thread use the environment alone (opened DB_THREAD for them), never a
database handle. The store itself is used by one thread at a time, under
`Worker.lock`: the worker thread holds it for each of its batches and its
housekeeping, the event loop for a round (it never waits for it: a job that
finds the store busy goes to the thread, as does every job made while the
thread has jobs of the loop's not yet answered, so jobs run in the order made).

Over 500 lines: the places work runs share one lock, one order of answers and
one sync sequence, and keeping them in one module keeps that order in view.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final

from mqd.backend import LATER, Holder, Later, Message, Pending, QueueSize, Sync
from mqd_bdb import jobs
from mqd_bdb.errors import storage_error
from mqd_bdb.logsync import UNSUPPORTED, LogSync
from mqd_bdb.store import Store

log = logging.getLogger("mqd.bdb")

STOP: Final = -1  # operation code of the job that closes the store and ends the thread
CHECK_S: Final = 1.0  # how often the keeper looks at the cache and the log while changes come
TRICKLE_PERCENT: Final = 20  # the keeper writes dirty pages out until this much is clean
MAX_GATHER_S: Final = 0.002  # the longest a sync waits for more writers, or a round for clients
MAX_BATCH_BYTES: Final = 8 << 20  # a batch of large messages ends after this many body bytes
REPEAT_LOG_S: Final = 60.0  # the keeper logs a failure that repeats once in this long
#: Turns of the loop a round left open during a sync stays open at least once
#: it has ended, to take in the next command of the clients the sync
#: answered. Each turn polls the sockets without waiting; one command per
#: round trip under memtier's load (16 connections), 4 turns did 9 % more than
#: 2 (five pairs, every pair), with 12-13 commands a sync against 9-10; 3 and
#: 6 did less than 4, and so did ending after the first turn that read
#: nothing. Beyond them, the round waits for the rest of those clients
#: (Worker._awaited).
GATHER_TURNS: Final = 4

ALWAYS: Final = Sync.ALWAYS
PERIODIC: Final = Sync.PERIODIC

Published = dict[str, QueueSize | None]
Deliver = Callable[[list[jobs.Result], Published], None]


#: A committed round awaiting its sync: (sync number or 0, round, results, gauges, error).
Unsynced = tuple[int, "Round", list[jobs.Result], Published, BaseException | None]


class Round:
    """Quick jobs run on the event loop in one transaction, until the turn ends."""

    __slots__ = (
        "cause",
        "error",
        "futures",
        "held",
        "number",
        "pendings",
        "periodic",
        "queue",
        "results",
        "runs",
        "taken",
        "txn",
        "writers",
    )

    def __init__(self, txn: Any) -> None:
        self.txn = txn
        # Each holder of its answers, in order, with the Pending it holds for:
        # one each, so that those the sync keeps nothing of can go first
        # (Worker._answer_early).
        self.pendings: dict[Holder, Pending] = {}
        # The holder that ran the last job, and that job's queue: a run of jobs
        # (a connection's pipeline) is looked at once, not once a job.
        self.held: Holder | None = None
        self.queue: str | None = None
        self.runs: list[tuple[Holder, str]] = []  # (holder, queue) of each run
        self.results: list[jobs.Result] = []  # of the jobs with futures, answered at the end
        # Given back if the sync fails, unless their holder was answered first.
        self.taken: list[tuple[jobs.Job, Message, Holder]] = []
        self.writers = 0  # its jobs that asked for Sync.ALWAYS
        # Whether a job with a future ran in it: synced as asked whatever the
        # store wrote, as its caller may show what a sync must keep (`gets`
        # shows the id of a message that a put of the round numbered).
        self.futures = False
        self.periodic = False  # whether any asked for Sync.PERIODIC
        self.error: BaseException | None = None  # a job failed: the round is undone
        self.cause: BaseException | None = None  # what it met (a panic makes the thread recover)
        self.number = 0  # its place among the store's commits (Worker._numbered)

    def ran(self, sync: Sync | None) -> None:
        """One of its jobs ran, asking for `sync`."""
        if sync is ALWAYS:
            self.writers += 1
        elif sync is PERIODIC:
            self.periodic = True

    def fail(self, exc: BaseException) -> BaseException:
        """A job of the round met `exc`: the round is undone; the StorageError to answer."""
        self.cause = exc
        self.error = storage_error(exc)
        return self.error


class Worker:
    """Runs `store` on a thread of its own; `deliver` is called on `loop` with results."""

    def __init__(
        self,
        store: Store,
        loop: asyncio.AbstractEventLoop,
        deliver: Deliver,
        sync_interval_s: float,
    ) -> None:
        self.store = store
        self.loop = loop
        self.deliver = deliver
        self.sync_interval_s = sync_interval_s
        self.max_batch = store.config.max_batch
        self.inbox: queue.SimpleQueue[list[jobs.Job]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="mqd-bdb", daemon=True)
        self._keeper = threading.Thread(target=self._keep, name="mqd-bdb-keeper", daemon=True)
        self._syncer = threading.Thread(target=self._sync, name="mqd-bdb-sync", daemon=True)
        # Rounds committed and awaiting the sync that covers them, in order
        # (with their sync number, 0 for those that need none but must not
        # answer before the ones ahead of them); the sync thread's target.
        self._unsynced: deque[Unsynced] = deque()
        self._seq = 0
        self._syncing = False  # whether a sync the loop asked for has not answered yet
        self._end_due = False  # whether the open round ends once it has
        # The holders the last sync answered that have not run a job in the
        # open round since, and until when a round waits for them.
        self._awaited: set[Holder] = set()
        self._awaited_until = 0.0
        # Capped as the thread's wait for writers is: each turn of the wait
        # polls the sockets, and a slow disk's sync takes milliseconds.
        self._awaited_max_s = MAX_GATHER_S
        # The round numbers to sync up to, None to stop: a queue rather than a
        # condition, as each handover costs the sync thread the GIL, which
        # the loop then waits to take back (one take per ask, not several).
        self._sync_asks: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._env_lock = threading.Lock()  # held by the sync thread while it syncs, and by a reopen
        # The keeper's state, under its condition: the environment is used by
        # it only while `_env_open`; changes since it last looked; when
        # periodic writes must be synced by.
        self._keeper_cond = threading.Condition(threading.Lock())
        self._env_open = False
        self._changed = False
        self._periodic_due: float | None = None
        self._keeper_stop = False
        self._busy = False
        self._ready: deque[jobs.Job] = deque()  # taken from the inbox, not yet run
        self.lock = threading.Lock()  # held by whoever uses the store (see above)
        self._loop_round: Round | None = None  # the event loop's open round
        self._outstanding = 0  # jobs handed to the thread, not yet answered
        self._wants_store = False  # set by the thread while it waits for the lock
        self._opened: asyncio.Future[dict[str, QueueSize]] | None = None
        self._expected = 0  # writers the last sync answered
        self._sync_s = 0.0  # how long a sync takes, on average
        self._loop_sync_max_s = store.config.loop_sync_max_us / 1e6
        self._aio: LogSync | None = None  # Linux AIO's syncs, if on and there
        self._aio_started = 0.0  # when the sync in flight was submitted
        # Counters, for tests and stats.
        self.batches = 0
        self.jobs = 0
        self.flushes = 0
        self.loop_flushes = 0  # of those, run on the event loop
        self.aio_flushes = 0  # of those, by Linux AIO
        self.rounds = 0  # rounds run on the event loop
        self.early = 0  # holders of synced rounds answered as the sync started
        self.free = 0  # rounds committed and answered while a sync ran (_free)
        # Gauges go out in the order the store committed them: a round's with
        # its answers, after its sync, may come after those of a batch the
        # thread committed later (a queue's delete), which they must not undo.
        # Commits are numbered under the store's lock (_numbered).
        self._commits = 0
        self._gauges_next = 1  # the commit whose gauges go out next
        self._gauges_held: dict[int, Published] = {}  # later ones, till it has

    # -- loop side -----------------------------------------------------------

    async def start(self) -> dict[str, QueueSize]:
        """Start the thread and open the store; the gauges of every queue."""
        self._opened = self.loop.create_future()
        self.thread.start()
        sizes = await self._opened
        if self.store.config.aio_sync:
            self._aio = LogSync.open(self.loop, self._aio_synced)
        return sizes

    async def stop(self) -> None:
        """Finish every job submitted so far, close the store, end the thread."""
        done: asyncio.Future[None] = self.loop.create_future()
        self.inbox.put([(STOP, "", None, None, done)])
        # Not a `finally` that awaits (see Broker._lease_into).
        failure: BaseException | None = None
        try:
            await done
        except BaseException as exc:
            failure = exc
        await asyncio.to_thread(self.thread.join)
        if self._aio is not None:
            self._aio.close()  # after answering the sync in flight
            self._aio = None
        if failure is not None:
            raise failure

    def submit(self, bundle: list[jobs.Job]) -> None:
        """Run jobs, in order: in this turn's round if they are quick, else on the thread.

        Their futures are answered once the round (or the thread's batch) is
        synced; should the round fail, the thread runs them again, where a
        failing job fails alone.
        """
        r = self._here(bundle)
        if r is None:
            self._hand_over(bundle)
            return
        for index, job in enumerate(bundle):
            if not self._run_in(r, job):
                # The rest waits for the round's end, and is run again with it.
                r.results.extend((later, None, None) for later in bundle[index + 1 :])
                return

    def _hand_over(self, bundle: list[jobs.Job]) -> None:
        self._outstanding += len(bundle)
        self.inbox.put(bundle)

    def _delivered(self, results: list[jobs.Result], published: Published, number: int) -> None:
        self._outstanding -= sum(1 for result in results if result[0][4] is not None)
        self.deliver(results, self._in_order(number, published))

    def _numbered(self) -> int:
        """The next commit's number (the store's lock held: commits are in its order)."""
        self._commits += 1
        return self._commits

    def _in_order(self, number: int, published: Published) -> Published:
        """The gauges to publish now that commit `number`'s have come: its own and any
        later ones held for it, in commit order (none while an earlier one is awaited)."""
        if number != self._gauges_next:
            self._gauges_held[number] = published
            return {}
        self._gauges_next += 1
        held = self._gauges_held
        if not held:
            return published
        merged = dict(published)
        while self._gauges_next in held:
            merged.update(held.pop(self._gauges_next))
            self._gauges_next += 1
        return merged

    def run_now(self, job: jobs.Job, holder: Holder) -> Any:
        """Run a quick job here, in this turn's round: its value, or LATER if it can't.

        A job that fails raises its StorageError, and voids the round. (The
        path of every held set and get: _run_in without a result to keep.)
        """
        r = self._loop_round
        if r is None:
            r = self._here((job,))
            if r is None:
                return LATER
        elif r.error is not None or self._outstanding or not self.store.quick(job):
            return LATER
        settled = None  # the queue another caller's run of jobs ended on
        if holder is not r.held:
            settled = r.queue
            if holder not in r.pendings:
                pending = r.pendings[holder] = Pending()
                holder.hold(pending)
                self._awaited.discard(holder)
            r.held = holder
            r.queue = None
        name = job[1]
        if name != r.queue:
            r.queue = name
            r.runs.append((holder, name))
        try:
            if settled is not None:
                self.store.settle(r.txn, settled)
            value = self.store.run_job(r.txn, job[0], name, job[2])
        except Exception as exc:
            raise r.fail(exc) from exc
        r.ran(job[3])
        if value is not None and job[0] == jobs.TAKE:
            r.taken.append((job, value, holder))
        self.jobs += 1
        return value

    def size_in_round(self, queue: str) -> QueueSize | Later | None:
        """`queue`'s size as this turn's open round leaves it; LATER if none is open
        (or the thread has jobs made before this call still to run).

        While a round is open the loop holds the store, so its counts, which
        already include what the round's held puts and takes did, are read
        directly: a reply made in the round (a Redis push's length) then
        counts the commands before it, as the published gauges do not yet.
        """
        if self._loop_round is None or self._outstanding:
            return LATER
        q = self.store.queues.get(queue)
        return None if q is None else q.size()

    def settled(self) -> bool:
        """Whether the gauges delivered so far include what every job made so far did.

        Not while a round is open, a committed round awaits its answer (its
        gauges go out with it, once synced), or the thread has jobs of the
        loop's not yet answered: a held set has its answer, and the next
        command of its pipeline runs, before any of that.
        """
        return (
            self._loop_round is None
            and not self._unsynced
            and not self._outstanding
            and not self._gauges_held
        )

    def _here(self, bundle: Sequence[jobs.Job]) -> Round | None:
        """This turn's round, opened if need be, if `bundle` may run in it; else None."""
        store = self.store
        r = self._loop_round
        if r is not None:
            ready = r.error is None and not self._outstanding
            return r if ready and all(map(store.quick, bundle)) else None
        # Jobs the thread has not answered go first; the thread may want or hold the store.
        if self._outstanding or self._wants_store or not self.lock.acquire(blocking=False):
            return None
        try:
            if not (store.loop_ready() and all(map(store.quick, bundle))):
                self.lock.release()
                return None
            txn = store.begin()
        except BaseException:
            self.lock.release()
            raise
        r = self._loop_round = Round(txn)
        if self._awaiting():
            # The first round since the last sync ended: it waits for the
            # rest of the connections that sync answered, as one open then
            # would have (_synced).
            self.loop.call_soon(self._end_after, 0)
        else:
            self.loop.call_soon(self._end_round)
        return r

    def _run_in(self, r: Round, job: jobs.Job) -> bool:
        """Run `job` in round `r`, its result kept; False if it failed (voiding the round)."""
        try:
            value = self.store.run_job(r.txn, job[0], job[1], job[2])
        except Exception as exc:
            r.fail(exc)
            r.results.append((job, None, None))
            return False
        r.ran(job[3])
        r.futures = True
        r.results.append((job, None, value))
        self.jobs += 1
        return True

    def _end_round(self) -> None:
        """The turn is over: commit the round, sync it if asked, answer it.

        While a sync runs, the round stays open instead, and ends as that sync
        does: what comes meanwhile could not be synced sooner anyway, and one
        commit and one sync for all of it cost less than several. Unless it
        needs no sync of its own (_free): then it commits and is answered now.
        """
        r = self._loop_round
        assert r is not None
        free = False
        if r.error is None and self._syncing:
            free = self._free(r)
            if not free:
                self._end_due = True
                return
        self._loop_round = None
        r.number = self._numbered()
        store = self.store
        published: Published = {}
        error = r.error
        committed = False
        aio: LogSync | None = None
        try:
            if error is None:
                store.commit(r.txn, published, lazy=not r.futures)
                committed = True
                if r.writers and not (r.futures or store.wrote()):
                    # Its puts were all taken in it, never written, and its
                    # other jobs took those or found nothing: there is nothing
                    # to sync, and its answers go out now (Store.wrote).
                    r.writers = 0
                if r.writers and not self._nothing_to_overlap(r):
                    aio = self._aim()
            else:
                store.abort(r.txn, r.cause)
        except Exception as exc:
            error = storage_error(exc)
            if store.disk_full(exc):
                store.space.release()  # room for what frees space; puts are refused
        finally:
            self.lock.release()
        self.rounds += 1
        results = r.results
        if not committed and results:
            # Undone: the thread runs them again, each failing alone if it must.
            self._hand_over([result[0] for result in results])
            results = []
        if store.upkeep_due():
            self.inbox.put([])  # the thread's housekeeping: it looks between bundles
        if committed and r.writers:
            # One sync at a time: a round that ran while one did ended only
            # once it had answered (_end_due), so none is in flight here.
            self._seq += 1
            self._unsynced.append((self._seq, r, results, published, None))
            self._syncing = True
            if aio is not None and self._submit(aio, self._seq):
                # The kernel syncs while the loop goes on; _aio_synced answers.
                self._answer_early(r)
            elif self._sync_s < self._loop_sync_max_s:
                # A fast disk: the loop syncs the round itself, as Redis does.
                # Handing the sync to the thread and back costs two wake-ups
                # and two GIL hand-offs, more than such a sync takes.
                self.loop_flushes += 1
                self._synced(self._seq, self._flush())
            else:
                # The sync thread syncs the log while the loop goes on: the
                # next round runs meanwhile, and its sync covers all that came
                # since.
                self._sync_asks.put(self._seq)
                self._answer_early(r)
        elif self._unsynced:
            if free and committed:
                # Its holders wait for nothing ahead: answered now. Its gauges
                # go out in order, after those of the rounds ahead.
                self.free += 1
                pendings, r.pendings = r.pendings, {}
                for pending in pendings.values():
                    pending.end(None)
            self._unsynced.append((0, r, results, published, error))  # after those ahead
        else:
            self._answer(r, results, published, error)

    def _free(self, r: Round) -> bool:
        """Whether round `r`, ending while a sync runs, may commit and be answered at once.

        Yes when it changed no message record and leaves none to write (its
        sets were taken in it, its gets took those or found nothing: a
        pipelining client whose consumer keeps up), ran no job with a
        future, and none of its holders still awaits a sync: such a round
        needs no sync of its own (Store.wrote), and its answers depend on
        nothing the sync in flight must keep. Otherwise it waits for that sync
        to end, and ends with the next (_end_due). Under a steady load with
        a backlog in a few queues, the connections of the others go on at
        the pace of their own round trips, not of those queues' syncs.
        """
        if r.futures or not self.store.quiet():
            return False
        pendings = r.pendings
        return not any(holder in pendings for u in self._unsynced for holder in u[1].pendings)

    def _answer_early(self, r: Round) -> None:
        """Answer now, before its sync, each holder of round `r` that the sync keeps nothing of.

        That is a holder whose jobs ran on queues whose message records the
        round left as they were (Store.written): its sets were taken in the
        round, its gets took those or found nothing. As for a round that
        wrote nothing (Store.wrote), a crash can lose no message such
        answers stored nor bring back one they took. A queue a holder that
        waits for the sync used makes every holder that used it wait too:
        a message one connection stored may be what the other took. And a
        holder answered first must not be held by an earlier round as well:
        only this round awaits a sync (one at a time).

        Under a steady load, queues whose consumers keep up are answered
        without waiting for the disk, while queues with a backlog are synced;
        their connections' next commands run meanwhile.
        """
        if r.futures or len(self._unsynced) != 1:
            return
        written = self.store.written()
        if written is None:
            return
        runs = r.runs
        waiting = {holder for holder, name in runs if name in written}
        while True:
            shared = {name for holder, name in runs if holder in waiting}
            more = {holder for holder, name in runs if name in shared} - waiting
            if not more:
                break
            waiting |= more
        pendings = r.pendings
        early = [holder for holder in pendings if holder not in waiting]
        if not early:
            return
        self.early += len(early)
        for holder in early:
            pendings.pop(holder).end(None)
        r.taken = [taken for taken in r.taken if taken[2] in waiting]

    def _nothing_to_overlap(self, r: Round) -> bool:
        """Whether round `r` is best synced by the loop itself, even with Linux AIO.

        Yes when each of its connections ran one job and syncs are fast: one
        command per round trip, and as the round waited for the connections
        the last sync answered, none of them sends anything before its reply,
        so the loop would have nothing to do while the kernel synced. The
        loop's own sync ends sooner, with no kernel worker to wake and no
        eventfd to hear (126 against 192 us at p50 in bdb_log_sync.py).
        """
        return r.writers <= len(r.pendings) and self._sync_s < self._loop_sync_max_s

    def _aim(self) -> LogSync | None:
        """Linux AIO, aimed at the log file the round's commit went to; None: sync otherwise."""
        aio = self._aio
        if aio is not None:
            try:
                aio.follow(self.store.env)
            except Exception as exc:
                self._give_up_aio(aio, exc)
                return None
        return aio

    def _submit(self, aio: LogSync, seq: int) -> bool:
        """Have the kernel sync the log up to round `seq`; False if it refused."""
        try:
            aio.submit(seq)
        except OSError as exc:
            if exc.errno in UNSUPPORTED:
                self._give_up_aio(aio, exc)
            return False
        self._aio_started = time.monotonic()
        return True

    def _give_up_aio(self, aio: LogSync, exc: BaseException) -> None:
        """Linux AIO cannot sync this log: from now on the loop or the sync thread does
        (logged once, not once a round)."""
        log.warning("log syncs by Linux AIO stopped, synced otherwise from now on: %s", exc)
        self._aio = None
        aio.close()  # nothing is in flight: one sync at a time (see _end_round)

    def _aio_synced(self, seq: int, error: OSError | None) -> None:
        """Linux AIO's sync of round `seq` ended."""
        if error is None:
            self._sync_s += (time.monotonic() - self._aio_started - self._sync_s) / 8
            self.flushes += 1
            self.aio_flushes += 1
        self._synced(seq, None if error is None else storage_error(error))

    def _synced(self, done: int, error: BaseException | None) -> None:
        """The log is synced up to round `done` (or could not be): answer those rounds."""
        unsynced = self._unsynced
        answered: list[Holder] = []
        while unsynced and unsynced[0][0] <= done:
            seq, r, results, published, failed = unsynced.popleft()
            answered += r.pendings
            if seq and error is not None:
                for job, message, _ in r.taken:
                    self.give_back(job, message)
                results = self._unflushed(results, error)
                failed = error
            self._answer(r, results, published, failed)
        self._note(error is None, False)
        self._syncing = self._seq > done
        if self._syncing:
            return
        # The next round waits for the clients just answered to send their
        # next command (one command per round trip, they send it at once),
        # up to one sync's duration: all of it is answered after the next
        # sync rather than the one after, and the syncs are fewer and larger.
        # Under 16 connections one command per round trip, rounds grew from
        # about 10 commands to 15, and did 10 to 25 % more
        # (benchmarks/RESULTS.md).
        awaited = self._awaited = set(answered)
        self._awaited_until = time.monotonic() + min(self._sync_s, self._awaited_max_s)
        open_round = self._loop_round
        if open_round is not None:
            awaited.difference_update(open_round.pendings)
        if self._end_due:
            # The open round ends a few turns of the loop later, not here:
            # what this turn still reads joins it, and so does what the next
            # turns read.
            self._end_due = False
            self._end_after(GATHER_TURNS)

    def _end_after(self, turns: int) -> None:
        """End the open round once `turns` more turns of the loop are over and no one is awaited."""
        if turns or self._awaiting():
            self.loop.call_soon(self._end_after, max(turns - 1, 0))
        else:
            self._end_round()

    def _awaiting(self) -> bool:
        """Whether a round waits for connections the last sync answered.

        Never while a sync runs: each turn polls the sockets, which takes the
        core from the sync's kernel worker.
        """
        return bool(self._awaited) and not self._syncing and time.monotonic() < self._awaited_until

    def _answer(
        self,
        r: Round,
        results: list[jobs.Result],
        published: Published,
        error: BaseException | None,
    ) -> None:
        self._note(False, r.periodic)
        published = self._in_order(r.number, published)
        if results or published:
            self.deliver(results, published)
        for pending in r.pendings.values():
            pending.end(error)

    def _sync(self) -> None:
        """The sync thread: sync the log whenever the loop asks, then tell it."""
        asks = self._sync_asks
        while (target := asks.get()) is not None:
            self._post(self._synced, target, self._flush())

    def _flush(self) -> BaseException | None:
        """Sync the log on this thread, timing it; the error to answer if it failed."""
        try:
            with self._env_lock:
                start = time.monotonic()
                self.store.flush()
                self._sync_s += (time.monotonic() - start - self._sync_s) / 8
        except Exception as exc:
            return storage_error(exc)
        self.flushes += 1
        return None

    def give_back(self, job: jobs.Job, value: Any) -> None:
        """Undo a take or reserve whose result nobody will see."""
        if isinstance(value, Message):
            if job[0] == jobs.TAKE:
                self.inbox.put([(jobs.RESTORE, job[1], value, job[3], None)])
            elif job[0] == jobs.RESERVE:
                self.inbox.put([(jobs.RELEASE, job[1], (value.receipt, None), job[3], None)])
        elif job[0] == jobs.RESERVE_MANY and value:
            ends = [(message.receipt, None) for message in value]
            self.inbox.put([(jobs.RELEASE_MANY, job[1], ends, job[3], None)])

    # -- worker thread ---------------------------------------------------------

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            log.warning("event loop closed before the storage worker could answer")

    def _run(self) -> None:
        opened = self._opened
        assert opened is not None
        try:
            self.store.open()
            sizes = self.store.sizes()
        except BaseException as exc:
            self._post(_settle, opened, storage_error(exc), None)
            return
        self._env_open = True
        self._keeper.start()
        self._syncer.start()
        self._post(_settle, opened, None, sizes)
        self._serve()

    def _take(self, timeout: float | None) -> bool:
        """Move a bundle from the inbox to the ready jobs; False if none came in time."""
        try:
            if timeout is None:
                self._ready.extend(self.inbox.get())
            elif timeout <= 0:
                self._ready.extend(self.inbox.get_nowait())
            else:
                self._ready.extend(self.inbox.get(timeout=timeout))
        except queue.Empty:
            return False
        return True

    def _serve(self) -> None:
        while True:
            idle = not self._ready and not self._take(0.0 if self.store.purges else None)
            self._wants_store = True  # the loop opens no round meanwhile: no starving
            with self.lock:
                self._wants_store = False
                if self._serve_once(idle):
                    return

    def _serve_once(self, idle: bool) -> bool:
        """Run what is ready (if anything), then housekeeping; True once the store is closed."""
        store = self.store
        try:
            if self._ready:
                synced, periodic, stop = self._round()
                self._note(synced, periodic)
                if stop is not None:
                    self._close(stop)
                    return True
            store.trim()
            store.upkeep()
            if idle and store.purges:
                store.purge_step()
        except Exception:
            # Never let the thread die: the jobs of a batch were answered
            # already; this is housekeeping, to be tried again.
            log.exception("Berkeley DB housekeeping failed")
            time.sleep(0.01)
        return False

    def _note(self, synced: bool, periodic: bool) -> None:
        """Tell the keeper about a round: changes to checkpoint, periodic writes to sync."""
        with self._keeper_cond:
            if not self._changed:
                self._changed = True
                self._keeper_cond.notify()
            if synced:
                self._periodic_due = None  # that sync covered them
            elif periodic and self._periodic_due is None:
                self._periodic_due = time.monotonic() + self.sync_interval_s
                self._keeper_cond.notify()

    def _pause_keeper(self) -> None:
        """Keep the keeper off the environment (before closing it)."""
        with self._keeper_cond:
            self._env_open = False
            while self._busy:
                self._keeper_cond.wait()

    def _resume_keeper(self) -> None:
        with self._keeper_cond:
            self._env_open = True
            self._keeper_cond.notify()

    def _round(self) -> tuple[bool, bool, jobs.Job | None]:
        """Run batches up to one sync; (synced, any PERIODIC job, the STOP job if met)."""
        results: list[jobs.Result] = []
        published: Published = {}
        writers, periodic, stop = self._batch(results, published)
        if writers and stop is None and writers < self._expected:
            deadline = time.monotonic() + min(self._sync_s, MAX_GATHER_S)
            while writers < self._expected and stop is None:
                left = deadline - time.monotonic()
                if not self._ready and (left <= 0 or not self._take(left)):
                    break
                more, more_periodic, stop = self._batch(results, published)
                writers += more
                periodic = periodic or more_periodic
        if writers:
            self._expected = writers
            error = self._flush()
            if error is not None:
                results = self._unflushed(results, error)
        if results or published:
            self._post(self._delivered, results, published, self._numbered())
        return writers > 0, periodic, stop

    def _batch(
        self, results: list[jobs.Result], published: Published
    ) -> tuple[int, bool, jobs.Job | None]:
        """Run one batch of ready jobs; (jobs awaiting a sync, any PERIODIC, STOP if met)."""
        ready = self._ready
        stop: jobs.Job | None = None
        batch: list[jobs.Job] = []
        limit = self.max_batch
        room = MAX_BATCH_BYTES
        while True:
            while ready and len(batch) < limit and room > 0:
                job = ready.popleft()
                if job[0] == STOP:
                    stop = job
                    break
                batch.append(job)
                if job[0] == jobs.PUT:
                    room -= len(job[2][0].body)
            if stop is not None or len(batch) >= limit or room <= 0 or not self._take(0):
                break
        writers = 0
        periodic = False
        for job in batch:
            sync = job[3]
            if sync is ALWAYS:
                writers += 1
            elif sync is PERIODIC:
                periodic = True
        store = self.store
        done = len(results)
        try:
            if store.panicked:
                self._pause_keeper()
                with self._env_lock:  # no sync of the environment being replaced
                    published.update(store.reopen())
                self._resume_keeper()
                log.warning("Berkeley DB environment in %s recovered", store.data_dir)
            store.execute(batch, results, published)
        except Exception as exc:
            error = storage_error(exc)
            answered = {id(result[0]) for result in results[done:]}
            results.extend((job, error, None) for job in batch if id(job) not in answered)
        self.batches += 1
        self.jobs += len(batch)
        return writers, periodic, stop

    def _unflushed(self, results: list[jobs.Result], error: BaseException) -> list[jobs.Result]:
        """The log could not be synced: fail the ALWAYS jobs, undoing their takes."""
        failed: list[jobs.Result] = []
        for job, exc, value in results:
            if job[3] is ALWAYS and exc is None:
                self.give_back(job, value)
                failed.append((job, error, None))
            else:
                failed.append((job, exc, value))
        return failed

    def _close(self, stop: jobs.Job) -> None:
        log.debug(
            "Berkeley DB worker: %d jobs in %d batches and %d rounds on the event loop, "
            "%d log syncs of %.0f us (%d on the event loop), %d puts taken in their own batch, "
            "%d connections answered before their round's sync",
            self.jobs,
            self.batches,
            self.rounds,
            self.flushes,
            self._sync_s * 1e6,
            self.loop_flushes,
            self.store.paired,
            self.early,
        )
        with self._keeper_cond:
            self._keeper_stop = True
            self._env_open = False
            self._keeper_cond.notify()
        self._keeper.join()
        self._sync_asks.put(None)
        self._syncer.join()  # after the last sync the loop asked for
        error: BaseException | None = None
        try:
            self.store.close()
        except Exception as exc:
            error = storage_error(exc)
        if stop[4] is not None:
            self._post(_settle, stop[4], error, None)

    # -- keeper thread -------------------------------------------------------

    def _keep(self) -> None:
        store = self.store
        cond = self._keeper_cond
        next_look = time.monotonic() + CHECK_S
        last_checkpoint = time.monotonic()
        pending = False  # changes not yet covered by a timed checkpoint
        log_end = None  # where the log ended at the last look
        failed, failed_logged = "", 0.0  # the last upkeep failure, and when it was logged
        while True:
            with cond:
                while True:
                    if self._keeper_stop:
                        return
                    now = time.monotonic()
                    due = self._periodic_due
                    changes = self._changed or pending
                    sync_due = due is not None and now >= due
                    look = changes and now >= next_look
                    if self._env_open and (sync_due or look):
                        break
                    wake = next_look if changes else None
                    if due is not None:
                        wake = due if wake is None else min(wake, due)
                    cond.wait(None if wake is None else max(wake - now, 0.001))
                if sync_due:
                    self._periodic_due = None
                if look:
                    self._changed = False
                self._busy = True  # the environment stays open until this ends
            try:
                if sync_due:
                    store.flush()
                    self.flushes += 1
                if look:
                    next_look = now + CHECK_S
                    pending = True
                    store.space.gauge()
                    store.trickle(TRICKLE_PERCENT)
                    # Once nothing was written for a look, a checkpoint (if
                    # anything was since the last) where there are log files
                    # before the current one: they go now, not a checkpoint_s
                    # later, so a drained queue gives its log back. Not for
                    # the current file alone: under a slow trickle of sets
                    # that was a checkpoint every few seconds, syncing each
                    # file written since, and removing nothing.
                    quiet = store.log_end() == log_end and store.log_files() > 1
                    timed = now - last_checkpoint >= store.config.checkpoint_s
                    store.checkpoint(timed, 0 if quiet else None)
                    log_end = store.log_end()  # a checkpoint's own record is not a write
                    if timed or quiet:
                        last_checkpoint = now
                        pending = False
            except Exception as exc:
                # Writing dirty pages out may be what fills the disk first.
                if not (store.disk_full(exc) and store.space.release()):
                    # Tried again each look: a failure that lasts (a full disk,
                    # a file-size limit) is logged in full once, then a line a minute.
                    if str(exc) != failed:
                        log.exception("Berkeley DB upkeep failed")
                        failed, failed_logged = str(exc), now
                    elif now - failed_logged >= REPEAT_LOG_S:
                        log.error("Berkeley DB upkeep still fails: %s", exc)
                        failed_logged = now
            else:
                failed = ""
            finally:
                with cond:
                    self._busy = False
                    cond.notify_all()


def _settle(future: asyncio.Future[Any], error: BaseException | None, value: Any) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
