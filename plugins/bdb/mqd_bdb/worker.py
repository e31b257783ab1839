"""The two threads that do an environment's Berkeley DB work.

The event loop puts jobs in an inbox and awaits their futures. The *executor*
takes whatever has arrived (up to `max_batch` jobs) and runs it in one
transaction, committed without a sync. A batch with a `Sync.ALWAYS` job goes
to the *flusher*, which syncs the log once for every batch committed since its
last sync and then hands all their results to the loop in one
call_soon_threadsafe. While the flusher waits for the disk, the executor runs
the next batch: a sync covers everything that arrived during the one before
(group commit), and the disk is never idle while writers wait.

Results leave in the order their batches ran. Between batches the executor
syncs for `Sync.PERIODIC`, checkpoints, closes idle files and purges deleted
queues. Only the executor touches database handles; the flusher uses the
environment alone, which is opened DB_THREAD for it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from mqd.backend import Message, QueueSize, Sync
from mqd_bdb import jobs
from mqd_bdb.store import Store, storage_error

log = logging.getLogger("mqd.bdb")

STOP = -1  # operation code of the job that closes the store and ends the threads
CHECK_S = 1.0  # how often to consider a checkpoint while changes are being made

ALWAYS = Sync.ALWAYS
PERIODIC = Sync.PERIODIC

Published = dict[str, QueueSize | None]
Deliver = Callable[[list[jobs.Result], Published], None]
#: What a batch hands on: its results, the gauges it changed, whether to sync
#: first, and how many of its jobs wait for that sync.
_Done = tuple[list[jobs.Result], Published, bool, int]
MAX_GATHER_S = 0.002  # the longest a sync waits for more writers


class Worker:
    """Runs `store` on threads of its own; `deliver` is called on `loop` with results."""

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
        self._ready: deque[jobs.Job] = deque()  # taken from the inbox, not yet run
        self.thread = threading.Thread(target=self._run, name="mqd-bdb", daemon=True)
        self._flusher = threading.Thread(target=self._flush_loop, name="mqd-bdb-sync", daemon=True)
        self._opened: asyncio.Future[dict[str, QueueSize]] | None = None
        # Batches handed to the flusher and not yet posted to the loop.
        self._done: deque[_Done] = deque()
        self._unposted = 0
        self._cond = threading.Condition(threading.Lock())
        self._stopping = False
        self._expected = 0  # writers the last sync answered
        self._sync_s = 0.0  # how long a sync takes, on average
        # Counters, for tests and stats.
        self.batches = 0
        self.jobs = 0
        self.flushes = 0

    # -- loop side -----------------------------------------------------------

    async def start(self) -> dict[str, QueueSize]:
        """Start the threads and open the store; the gauges of every queue."""
        self._opened = self.loop.create_future()
        self.thread.start()
        return await self._opened

    async def stop(self) -> None:
        """Finish every job submitted so far, close the store, end the threads."""
        done: asyncio.Future[None] = self.loop.create_future()
        self.inbox.put([(STOP, "", None, None, done)])
        try:
            await done
        finally:
            await asyncio.to_thread(self.thread.join)

    def submit(self, bundle: list[jobs.Job]) -> None:
        """Hand jobs to the executor, in order."""
        self.inbox.put(bundle)

    def give_back(self, job: jobs.Job, value: Any) -> None:
        """Undo a take or reserve whose result nobody will see."""
        if isinstance(value, Message):
            if job[0] == jobs.TAKE:
                self.inbox.put([(jobs.RESTORE, job[1], value, job[3], None)])
            elif job[0] == jobs.RESERVE:
                self.inbox.put([(jobs.RELEASE, job[1], value.offset, job[3], None)])

    # -- executor thread -------------------------------------------------------

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            log.warning("event loop closed before the storage worker could answer")

    def _run(self) -> None:
        opened = self._opened
        assert opened is not None
        try:
            sizes = self.store.open()
        except BaseException as exc:
            self._post(_settle, opened, storage_error(exc), None)
            return
        self._flusher.start()
        self._post(_settle, opened, None, sizes)
        self._serve()

    def _serve(self) -> None:
        store = self.store
        inbox = self.inbox
        periodic_due: float | None = None
        next_check = 0.0
        last_checkpoint = time.monotonic()
        changed = False  # since the last checkpoint
        while True:
            if store.purges:
                timeout: float | None = 0.0
            else:
                due = [periodic_due] if periodic_due is not None else []
                if changed:
                    due.append(next_check)
                timeout = max(0.0, min(due) - time.monotonic()) if due else None
            ready = self._ready
            if not ready:
                try:
                    if timeout is None:
                        ready.extend(inbox.get())
                    elif timeout <= 0:
                        ready.extend(inbox.get_nowait())
                    else:
                        ready.extend(inbox.get(timeout=timeout))
                except queue.Empty:
                    pass
            idle = not ready
            try:
                if ready:
                    always, periodic, stop = self._batch()
                    changed = True
                    if periodic and periodic_due is None:
                        periodic_due = time.monotonic() + self.sync_interval_s
                    if always:
                        periodic_due = None  # that sync covers the periodic writes too
                    if stop is not None:
                        self._close(stop)
                        return
                now = time.monotonic()
                if periodic_due is not None and now >= periodic_due:
                    periodic_due = None
                    self._hand_on(([], {}, True, 0))
                if changed and now >= next_check:
                    next_check = now + CHECK_S
                    force = now - last_checkpoint >= store.config.checkpoint_s
                    store.checkpoint(force)
                    if force:
                        last_checkpoint = now
                        changed = False
                store.trim()
                if idle and store.purges:
                    store.purge_step()
            except Exception:
                # Never let the thread die: the jobs of a batch were answered
                # already; this is housekeeping, to be tried again.
                log.exception("Berkeley DB housekeeping failed")
                time.sleep(0.01)

    def _batch(self) -> tuple[bool, bool, jobs.Job | None]:
        """Run one batch. (any ALWAYS job, any PERIODIC job, the STOP job if met)."""
        inbox = self.inbox
        ready = self._ready
        stop: jobs.Job | None = None
        batch: list[jobs.Job] = []
        limit = self.max_batch
        while True:
            while ready and len(batch) < limit:
                job = ready.popleft()
                if job[0] == STOP:
                    stop = job
                    break
                batch.append(job)
            if stop is not None or len(batch) >= limit:
                break
            try:
                ready.extend(inbox.get_nowait())
            except queue.Empty:
                break
        writers = 0
        periodic = False
        for job in batch:
            sync = job[3]
            if sync is ALWAYS:
                writers += 1
            elif sync is PERIODIC:
                periodic = True
        always = writers > 0
        results: list[jobs.Result] = []
        published: Published = {}
        store = self.store
        try:
            if store.panicked:
                self._quiesce()
                published.update(store.reopen())
                log.warning("Berkeley DB environment in %s recovered", store.data_dir)
            store.execute(batch, results, published)
        except Exception as exc:
            error = storage_error(exc)
            answered = {id(result[0]) for result in results}
            results.extend((job, error, None) for job in batch if id(job) not in answered)
        self.batches += 1
        self.jobs += len(batch)
        if results or published:
            self._hand_on((results, published, always, writers))
        return always, periodic, stop

    def _hand_on(self, done: _Done) -> None:
        """Post a batch's results now, or after the sync it or an earlier batch awaits."""
        with self._cond:
            if done[2] or self._unposted:
                self._done.append(done)
                self._unposted += 1
                self._cond.notify()
                return
        self._post(self.deliver, done[0], done[1])

    def _quiesce(self) -> None:
        """Wait until the flusher has posted everything (before the environment closes)."""
        with self._cond:
            while self._unposted:
                self._cond.wait()

    def _close(self, stop: jobs.Job) -> None:
        error: BaseException | None = None
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._flusher.join()
        log.debug(
            "Berkeley DB worker: %d jobs in %d batches, %d log syncs",
            self.jobs,
            self.batches,
            self.flushes,
        )
        try:
            self.store.close()
        except Exception as exc:
            error = storage_error(exc)
        if stop[4] is not None:
            self._post(_settle, stop[4], error, None)

    # -- flusher thread ------------------------------------------------------

    def _flush_loop(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while not self._done and not self._stopping:
                    cond.wait()
                if not self._done:
                    return  # stopping, and everything posted
                self._gather()
                taken = list(self._done)
                self._done.clear()
            try:
                self._sync(taken)
            except Exception:
                log.exception("Berkeley DB sync failed")
            with cond:
                self._unposted -= len(taken)
                cond.notify_all()

    def _gather(self) -> None:
        """Wait a little for the writers the last sync answered (holding the condition).

        A sync starts as soon as one batch needs it; writers that come back a
        moment later would wait for a whole second sync. So when fewer waiting
        writers are in than the last sync had, wait up to one sync's duration
        for the rest: one sync for all of them is shorter than two.
        """
        expected = self._expected
        if expected <= 1 or self._stopping:
            return
        deadline = time.monotonic() + min(self._sync_s, MAX_GATHER_S)
        while True:
            writers = sum(done[3] for done in self._done)
            if writers == 0 or writers >= expected:
                return
            left = deadline - time.monotonic()
            if left <= 0 or self._stopping:
                return
            self._cond.wait(left)

    def _sync(self, taken: list[_Done]) -> None:
        results: list[jobs.Result] = []
        published: Published = {}
        for done in taken:
            results.extend(done[0])
            published.update(done[1])
        if any(done[2] for done in taken):
            self._expected = sum(done[3] for done in taken)
            try:
                start = time.monotonic()
                self.store.flush()
                self._sync_s += (time.monotonic() - start - self._sync_s) / 8
                self.flushes += 1
            except Exception as exc:
                results = self._unflushed(results, storage_error(exc))
        if results or published:
            self._post(self.deliver, results, published)

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


def _settle(future: asyncio.Future[Any], error: BaseException | None, value: Any) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
