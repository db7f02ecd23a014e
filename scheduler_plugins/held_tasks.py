"""A volunteer holds at most a few tasks at once; the rest wait for a free slot, never lost.

On by default (64); ``goblin.placement.max-held-per-volunteer: 0`` turns it off.  It was off for a while: with
it on, a computation hung under load in ``tests/test_volunteer_side.py`` (a volunteer paused mid-computation).
The cause was not here: a task the scheduler sent while the volunteer's pause was on the wire reached the paused
volunteer after it had handed back what it held, and waited there for the deadline.  The cap made that likely
(it sends tasks as slots free, all along a computation, where distributed sends them all at the start); the
volunteer now hands back a task that arrives while it is paused (``goblin_dask.volunteer.worker``).

distributed sends a ready task to a worker as soon as it picks one, however many the worker already
has: its queueing (``distributed.scheduler.worker-saturation``) applies only to root-ish tasks, and a
task with resource restrictions, as every volunteer task has, is never root-ish.  So a credential that
claims 256 threads was handed 252 of a product's 256 tasks at once, and could hold each until its
per-task deadline.  Here a volunteer holds (processing, whether running or queued on it) at most

    min(goblin.placement.max-held-per-volunteer, max(4, 2 x its claimed threads))

tasks: two per thread keeps each thread busy with one task while the next one's inputs arrive; four at
least lets a one-thread volunteer fetch across a round trip; the setting (64: two per thread of a
32-thread machine) is the most any claim earns, so one credential delays at most that many tasks by a
deadline.

How (no scan of the workers per task): the scheduler's ``valid_workers`` leaves out the volunteers
that are full (a set kept up to date by this plugin's ``transition`` hook, and by
``send_task_to_worker`` for the tasks work stealing moves).  A volunteer task left with no valid
worker only because they are all full waits in ``no-worker`` (it is "held back", and does not count
towards ``goblin.faults.no-volunteer-wait``); when a full volunteer frees a slot, the held-back tasks
are placed again, oldest first.  One counted in the report's ``holding`` section: the cap of each
volunteer and the most it ever held at once.

**Runs: a volunteer's tasks share their inputs** (issue 30).  A home downloads every input block of the tasks
it is given, and distributed's choice (the earliest start, task by task) spreads a product's tiles over the
volunteers so that each one reads every row and column panel: each home downloaded all of A and B.  So when a
graph arrives, its volunteer tasks that read only the lab's data blocks (the panels a volunteer keeps,
:func:`~goblin_dask.volunteer.panel_cache.cacheable_key`) are cut, in dask's priority order (which keeps tasks
sharing inputs together), into one run per volunteer in proportion to its threads, and each task prefers its
run's volunteer: it goes there while that volunteer has a free slot, and waits for one there ("held for" it)
while the others still have tasks of their own runs to take.  A volunteer whose run is all placed and that has
an idle thread takes the others' waiting tasks (the faster ones finish the slower ones' runs); a preference to a
volunteer that left, is paused or may not run the task is no preference, and a task reissued from a volunteer
is placed afresh.  A product's tiles in priority order go row by row: two volunteers get half the rows each,
and each downloads half of A and all of B (3/4 of the panels) instead of all of both.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin
from tornado.ioloop import PeriodicCallback

from goblin_dask import settings
from goblin_dask.roles import VOLUNTEER_RESOURCE
from goblin_dask.volunteer.panel_cache import cacheable_key

logger = logging.getLogger("goblin_dask.held_tasks")

#: The fewest tasks a volunteer may hold (unless the setting is lower).
FLOOR = 4
#: Tasks held per claimed thread.
PER_THREAD = 2
#: Held-back tasks tried per freed slot, beyond the slot itself (some may be pinned to full volunteers).
EXTRA_TRIES = 4
#: Seconds between sweeps that place held-back tasks even when no slot-freeing event was seen.
SWEEP_SECONDS = 1.0
#: Runs are cut only when each volunteer thread's run would have at least this many tasks (to share inputs).
RUN_MIN = 2


def max_held_per_volunteer() -> int:
    """``goblin.placement.max-held-per-volunteer``, checked."""
    value = settings.get("goblin.placement.max-held-per-volunteer")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"goblin.placement.max-held-per-volunteer must be a whole number of tasks (0: no cap); "
                         f"got {value!r}")
    return value


def cap_for(nthreads: int, most: int) -> int:
    """Tasks a volunteer claiming ``nthreads`` threads may hold at once, at most ``most``."""
    return min(most, max(FLOOR, PER_THREAD * max(1, int(nthreads))))


class HeldTasksPlugin(SchedulerPlugin):
    name = "goblin-held-tasks"

    def __init__(self, scheduler, admission, most: int | None = None):
        self.scheduler = scheduler
        self.admission = admission
        self.most = max_held_per_volunteer() if most is None else int(most)
        #: volunteer address -> the tasks it may hold
        self.caps: dict[str, int] = {}
        #: the volunteers holding their cap (WorkerState objects: valid_workers subtracts them as a set)
        self.full: set = set()
        #: volunteer task key -> the WorkerState holding it
        self.holder: dict[Any, Any] = {}
        #: volunteer tasks waiting only because every volunteer that may run them is full (oldest first)
        self.held_back: dict[Any, None] = {}
        #: volunteer name -> the most tasks it held at once
        self.most_held: dict[str, int] = {}
        #: volunteer task key -> the volunteer whose run it is in (see "Runs" above)
        self.preferred: dict[Any, str] = {}
        #: volunteer address -> the keys of its runs not yet placed anywhere (while any, it takes no others')
        self.owed: dict[str, set] = {}
        #: volunteer address -> tasks of its runs waiting for a free slot there (oldest first)
        self.held_for: dict[str, dict[Any, None]] = {}
        #: volunteers with an idle thread and no run left to place, to be given others' waiting tasks
        self._idle: set[str] = set()
        self._freed = 0
        self._refill_soon = False
        self._ticker: PeriodicCallback | None = None
        self._valid_workers = scheduler.valid_workers
        scheduler.valid_workers = self.valid_workers
        self._send_task_to_worker = scheduler.send_task_to_worker
        scheduler.send_task_to_worker = self.send_task_to_worker

    async def start(self, scheduler) -> None:
        self._ticker = PeriodicCallback(self.sweep, SWEEP_SECONDS * 1000)
        self._ticker.start()

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.stop()

    # -- volunteers ----------------------------------------------------------------------
    def add_worker(self, scheduler, worker: str) -> None:
        ws = scheduler.workers.get(worker)
        if ws is not None and self.admission.is_volunteer(worker):
            self.caps[worker] = cap_for(ws.nthreads, self.most)

    def remove_worker(self, scheduler, worker: str, **kwargs) -> None:
        self.caps.pop(worker, None)
        self.full = {ws for ws in self.full if ws.address != worker}  # a handful; only when a worker leaves
        self.owed.pop(worker, None)
        self.held_back.update(self.held_for.pop(worker, {}))  # no preference now: any volunteer's
        for key in [k for k, a in self.preferred.items() if a == worker]:
            del self.preferred[key]
        self._freed += 1
        self._refill_later()

    # -- runs ------------------------------------------------------------------------------
    def update_graph(self, scheduler, *, tasks: list, **kwargs) -> None:
        """Cut the graph's volunteer tasks that read only the lab's data blocks into runs (see "Runs" above)."""
        workers = scheduler.workers
        volunteers = sorted((a for a in self.caps if a in workers and workers[a].status.name == "running"))
        threads = [max(1, workers[a].nthreads) for a in volunteers]
        if len(volunteers) < 2:
            return
        new = []
        for key in tasks:
            ts = scheduler.tasks.get(key)
            if ts is not None and ts.resource_restrictions == {VOLUNTEER_RESOURCE: 1} and not ts.worker_restrictions \
                    and ts.dependencies and all(cacheable_key(d.key) for d in ts.dependencies):
                new.append(ts)
        if len(new) < RUN_MIN * sum(threads):
            return
        new.sort(key=lambda t: t.priority or ())
        total, done, start = sum(threads), 0, 0
        for addr, t in zip(volunteers, threads):
            done += t
            end = round(len(new) * done / total)
            run = [ts.key for ts in new[start:end]]
            start = end
            self.preferred.update(dict.fromkeys(run, addr))
            self.owed.setdefault(addr, set()).update(run)

    def _may_help(self, ws) -> bool:
        """May volunteer ``ws`` take a task of another's run?  Only with its own runs all placed, a thread idle and
        none of its results still to go up to the lab (over a home link the upload, not the thread, is what
        it is busy with: one more task there finishes later than at its run's volunteer)."""
        return not self.owed.get(ws.address) and len(ws.processing) + len(ws.has_what) < ws.nthreads

    def _placed(self, key) -> None:
        """``key`` left its run's waiting: placed somewhere, or done."""
        addr = self.preferred.get(key)
        if addr is not None:
            self.owed.get(addr, set()).discard(key)
            self.held_for.get(addr, {}).pop(key, None)

    def _forget(self, key) -> None:
        self._placed(key)
        self.preferred.pop(key, None)

    # -- placement -------------------------------------------------------------------------
    def valid_workers(self, ts):
        """The scheduler's ``valid_workers`` (the faults plugin's), less the full volunteers; a task of a run,
        its run's volunteer (or one idle with no run of its own left), else nobody yet."""
        valid = self._valid_workers(ts)
        owner = self.preferred.get(ts.key)
        if owner is not None and valid and ts.state != "processing":
            ows = self.scheduler.workers.get(owner)
            if ows in valid:
                self.held_back.pop(ts.key, None)
                self.held_for.get(owner, {}).pop(ts.key, None)
                if ows not in self.full:
                    return {ows}
                idle = {ws for ws in valid - self.full if self._may_help(ws)}
                if not idle:
                    self.held_for.setdefault(owner, {})[ts.key] = None  # waits for a slot there
                return idle
        if not self.full or not valid or VOLUNTEER_RESOURCE not in (ts.resource_restrictions or {}):
            self.held_back.pop(ts.key, None)
            return valid
        open_ = valid - self.full
        if open_ or ts.state == "processing":  # (processing: work stealing asking where it might move it)
            self.held_back.pop(ts.key, None)
        else:
            self.held_back.pop(ts.key, None)
            self.held_back[ts.key] = None  # to the end: the others waiting longer go first
        return open_

    def is_held_back(self, key: Any) -> bool:
        return key in self.held_back or key in self.held_for.get(self.preferred.get(key), ())

    def send_task_to_worker(self, worker: str, ts) -> None:
        """Work stealing moves a task with this (not with a transition): follow it to its new holder."""
        self._send_task_to_worker(worker, ts)
        ws = self.scheduler.workers.get(worker)
        if ws is None or worker not in self.caps or ts.processing_on is not ws:
            return
        old = self.holder.get(ts.key)
        if old is not ws:
            self.holder[ts.key] = ws
            self._took(ws)
            if old is not None:
                self._gave_back(old)

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        if start == "processing":
            if finish == "released":  # reissued (a deadline, a volunteer gone): placed afresh
                self._forget(key)
            ws = self.holder.pop(key, None)
            if ws is not None:
                self._gave_back(ws)
        if finish == "processing":
            self._placed(key)
            ts = self.scheduler.tasks.get(key)
            ws = ts.processing_on if ts is not None else None
            if ws is not None and ws.address in self.caps:
                self.holder[key] = ws
                self._took(ws)
        elif finish in ("memory", "erred", "forgotten", "released"):
            self.held_back.pop(key, None)
            if finish != "released":
                self._forget(key)

    def _took(self, ws) -> None:
        held = len(ws.processing)
        name = self.admission.names.get(ws.address, ws.address)
        if held > self.most_held.get(name, 0):
            self.most_held[name] = held
        if held >= self.caps.get(ws.address, held + 1):
            self.full.add(ws)

    def _gave_back(self, ws) -> None:
        if ws in self.full and len(ws.processing) < self.caps.get(ws.address, 0):
            self.full.discard(ws)
            self._freed += 1
            self._refill_later()
        elif self.held_for and self._may_help(ws):
            self._idle.add(ws.address)
            self._refill_later()

    def _refill_later(self) -> None:
        """Place held-back tasks once the current transitions are done (never from inside them)."""
        if self._refill_soon or not (self.held_back or self.held_for):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the scheduler's loop: the sweep places them
            return
        self._refill_soon = True
        loop.call_soon(self.refill)

    def refill(self, tries: int | None = None) -> None:
        """Send held-back tasks (oldest first) to volunteers with a free slot."""
        self._refill_soon = False
        if tries is None:
            tries = self._freed + EXTRA_TRIES
        self._freed = 0
        tasks = self.scheduler.tasks
        recommendations = {}
        for key in self._first(tries):
            del self.held_back[key]
            ts = tasks.get(key)
            if ts is not None and ts.state == "no-worker":
                recommendations[key] = "processing"  # it comes back to held_back if still no slot for it
        for key in self._for_runs():
            ts = tasks.get(key)
            if ts is not None and ts.state == "no-worker":
                recommendations[key] = "processing"  # back to its queue if its volunteer is still full
        if recommendations:
            self.scheduler.transitions(recommendations, stimulus_id=f"goblin-held-slot-{time.time()}")

    def _first(self, n: int) -> list:
        return list(itertools.islice(self.held_back, max(n, 0)))

    def _for_runs(self) -> list:
        """Tasks held for a volunteer with a free slot now, and for each idle volunteer (``_idle``) one of the
        tasks held for others (from the longest queue)."""
        workers, out = self.scheduler.workers, []
        for addr, queue in list(self.held_for.items()):
            ws = workers.get(addr)
            free = self.caps.get(addr, 0) - len(ws.processing) if ws is not None else 0
            out.extend(itertools.islice(queue, max(free, 0)))
            if not queue:
                del self.held_for[addr]
        idle, self._idle = self._idle, set()
        queues = sorted((q for q in self.held_for.values() if q), key=len, reverse=True)
        for _, queue in zip(idle, queues):
            out.append(next(iter(queue)))
        return out

    def sweep(self) -> None:
        """Once a second, in case a slot freed without a transition this plugin saw (one pass over the volunteers)."""
        workers = self.scheduler.workers
        if self.held_for:
            self._idle = {a for a in self.caps if a in workers and self._may_help(workers[a])}
        free = 0
        if self.held_back and len(self.full) < len(self.caps):
            free = sum(max(0, cap - len(workers[a].processing)) for a, cap in self.caps.items() if a in workers)
        if free or self.held_for:
            self.refill(tries=free + EXTRA_TRIES if free else 0)

    # -- report ----------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        names = self.admission.names
        return {
            "cap": {names.get(a, a): c for a, c in sorted(self.caps.items())},
            "most_held": dict(sorted(self.most_held.items())),
            "held_back": len(self.held_back) + sum(len(q) for q in self.held_for.values()),
        }
