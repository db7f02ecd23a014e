"""Faults: a volunteer whose tasks fail never fails or stalls a researcher's computation.

A volunteer's task can fail three ways: its kernel raises (a bug, a broken machine, a
``MemoryError``), its process dies (a crash, the out-of-memory killer, the lender
closing the laptop), or it is pulled back from a volunteer that is resting.  In every
case the lab node, not the researcher, deals with it:

* **Errors.**  A ``task-erred`` message from a volunteer never makes the task erred.
  The error's *text* (``exception_text``, and the traceback's last lines) goes to the
  lab node's log with the volunteer's name; the pickled exception it sent is dropped,
  never unpickled nor forwarded (nothing a volunteer sent reaches a researcher's or the
  admin's process still pickled).  The task is rescheduled: on another volunteer that
  has not failed it, or, once ``goblin.faults.max-attempts`` (2) volunteers failed it or
  none is eligible, on the lab worker (trusted; the check on its result still runs).
  A task that fails on the lab worker too is genuinely bad: it errs for the researcher
  with the lab worker's error, and the volunteers it failed on are excused.
* **Crashes.**  A volunteer that disconnects while processing tasks (without being
  revoked or banned) has one failure counted; its tasks go elsewhere as usual, and they
  are not made ``KilledWorker`` because volunteers died running them (their
  ``suspicious`` count is reset): only the lab worker's crashes count towards
  ``distributed.scheduler.allowed-failures``.
* **Cooldown.**  After ``goblin.faults.max-consecutive`` (3) failures in a row (a
  result accepted by the scheduler resets the count), a volunteer gets no work for
  ``goblin.faults.cooldown`` seconds (60, doubling on each further cooldown, up to 64
  times); the tasks it holds go elsewhere.  Placement skips it (the scheduler's
  ``valid_workers``), and when every connected volunteer is excluded the work goes to
  the lab worker rather than waiting.  A volunteer keeps its cooldown across reconnects.
* **Bounces.**  A volunteer answering a ``compute-task`` with ``reschedule`` (distributed's "run it
  elsewhere") hands it back: the task goes to another volunteer (never back to it while it is not
  computed), or to the lab worker once ``goblin.faults.max-attempts`` volunteers failed or bounced it.  A
  bounce counts as a failure (towards cooldown), except from a volunteer that paused (``goblin volunteer
  pause`` hands back the tasks it has not started); so a volunteer bounces each task at most once, and a
  running one at most ``max-consecutive`` in a row before it rests.  Counted per volunteer in the report's
  ``bounces``.
* **Late.**  A volunteer whose tasks the ledger reissued for missing ``goblin.verification.deadline``
  (it held them and finished nothing) goes into cooldown at once (:meth:`FaultPlugin.rest`):
  a computation waits on one slow volunteer for one deadline, not once per task it is given.

* **No volunteer.**  A volunteer task that no volunteer can take (none connected, all paused; not one
  that waits only because the volunteers hold their most tasks, :mod:`scheduler_plugins.held_tasks`) waits
  ``goblin.faults.no-volunteer-wait`` seconds (60) for one to join, then runs on the lab worker (counted
  in ``to_lab``, logged with the setting's name): a product never waits forever, silently, on a lab whose
  volunteers are gone.

Each failure, crash and cooldown is counted in the ledger's per-volunteer record
(``failed``, ``cooldowns``) and listed, with the volunteer's name and a short reason,
in the report's ``faults`` (:meth:`FaultPlugin.report`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from distributed.core import Status
from distributed.diagnostics.plugin import SchedulerPlugin
from tornado.ioloop import PeriodicCallback

from goblin_dask import settings
from goblin_dask.roles import LAB_RESOURCE, VOLUNTEER_RESOURCE
from goblin_dask.validation.checks import is_unverified_key
from scheduler_plugins.admission import AdmissionPlugin

logger = logging.getLogger("goblin_dask.faults")

#: Characters of a volunteer's error text kept in the report (the log keeps more).
REASON_CHARS = 200
LOG_CHARS = 2000
#: Faults kept for the report (the oldest are dropped first).
FAULTS_KEPT = 1000
#: A cooldown doubles at most this many times.
MAX_DOUBLINGS = 6


def short_text(value: Any, limit: int = REASON_CHARS) -> str:
    """Untrusted text, made safe to log and report: printable, one line, at most ``limit`` characters."""
    if value is None:
        return ""
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    text = value if isinstance(value, str) else repr(value)
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _tail(traceback_text: Any, lines: int = 3) -> str:
    if not isinstance(traceback_text, str):
        return short_text(traceback_text, LOG_CHARS)
    kept = [ln.strip() for ln in traceback_text.strip().splitlines() if ln.strip()][-lines:]
    return short_text(" | ".join(kept), LOG_CHARS)


def _waits_for_a_slot(held: Any, ts: Any) -> bool:
    """Is ``ts`` held back only until a running volunteer it may go to frees a slot?  Not when every full
    volunteer it may go to is paused or gone: then it waits ``no-volunteer-wait`` like any task no volunteer
    can take (a replica restricted to a paused volunteer waited forever)."""
    if not held.is_held_back(ts.key):
        return False
    allowed = ts.worker_restrictions
    return any(ws.status == Status.running and (not allowed or ws.address in allowed) for ws in list(held.full))


class FaultPlugin(SchedulerPlugin):
    name = "goblin-faults"

    def __init__(self, scheduler, admission: AdmissionPlugin, ledger=None, *, max_consecutive: int | None = None,
                 cooldown: float | None = None, max_attempts: int | None = None, volunteer_wait: float | None = None):
        self.scheduler = scheduler
        self.admission = admission
        self.ledger = ledger
        if max_consecutive is None:
            max_consecutive = settings.get("goblin.faults.max-consecutive")
        if cooldown is None:
            cooldown = settings.get("goblin.faults.cooldown")
        if max_attempts is None:
            max_attempts = settings.get("goblin.faults.max-attempts")
        self.max_consecutive = max(1, int(max_consecutive))
        self.cooldown = float(cooldown)
        self.max_attempts = max(1, int(max_attempts))
        if volunteer_wait is None:
            volunteer_wait = settings.get("goblin.faults.no-volunteer-wait")
        self.volunteer_wait = float(volunteer_wait)
        if not self.volunteer_wait >= 0:
            raise ValueError(f"goblin.faults.no-volunteer-wait must be a number of seconds, at least 0, "
                             f"got {volunteer_wait!r}")
        #: volunteer task waiting in no-worker -> time.monotonic() it was first seen there
        self.waiting_since: dict[Any, float] = {}
        #: key -> names of the volunteers it failed on (while it is not computed)
        self.failed_on: dict[Any, set[str]] = {}
        #: key -> names of the paused volunteers that handed it back (not failures; not given to them again)
        self.bounced_on: dict[Any, set[str]] = {}
        #: volunteer name -> tasks it handed back (``reschedule``), paused or not
        self.bounces: dict[str, int] = {}
        #: volunteer name -> failures since its last success (or cooldown)
        self.in_row: dict[str, int] = {}
        #: volunteer name -> time.monotonic() its cooldown ends
        self.cooling: dict[str, float] = {}
        self._cooldowns: dict[str, int] = {}
        self.faults: deque[dict[str, Any]] = deque(maxlen=FAULTS_KEPT)
        self.rescheduled = 0  # tasks sent elsewhere after failing on a volunteer
        self.to_lab = 0  # tasks moved to the lab worker because no volunteer was eligible
        self._sweep = False
        self._ticker: PeriodicCallback | None = None

        self._task_erred = scheduler.stream_handlers["task-erred"]
        scheduler.stream_handlers["task-erred"] = self.handle_task_erred
        self._reschedule = scheduler.stream_handlers["reschedule"]
        scheduler.stream_handlers["reschedule"] = self.handle_reschedule
        self._valid_workers = scheduler.valid_workers
        scheduler.valid_workers = self.valid_workers
        self._remove_worker = scheduler.remove_worker
        scheduler.remove_worker = self.removing_worker

    # -- lifecycle -----------------------------------------------------------------
    async def start(self, scheduler) -> None:
        self._ticker = PeriodicCallback(self.tick, 500)
        self._ticker.start()

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.stop()

    # -- errors ----------------------------------------------------------------------
    def handle_task_erred(self, key: Any = None, stimulus_id: str = "", worker: str | None = None, **msg: Any) -> None:
        """Stream handler of ``task-erred``: a volunteer's failures are rescheduled, never erred."""
        if worker is None or not self.admission.is_volunteer(worker):
            try:
                self._excuse(key, worker, msg)
            except Exception:  # accounting only: the lab's error goes on as usual
                logger.exception("goblin faults: could not excuse the volunteers of %r", key)
            return self._task_erred(key=key, stimulus_id=stimulus_id, worker=worker, **msg)
        try:
            self._volunteer_erred(key, worker, stimulus_id, msg)
        except Exception:
            logger.exception("goblin faults: could not handle a failure report from volunteer %s",
                             self.admission.names.get(worker, worker))

    def _processing_on(self, key: Any, worker: str):
        try:
            ts = self.scheduler.tasks.get(key)
        except TypeError:  # an unhashable "key"
            return None
        if ts is None or ts.state != "processing" or ts.processing_on is None or ts.processing_on.address != worker:
            return None
        return ts

    def _volunteer_erred(self, key: Any, worker: str, stimulus_id: str, msg: dict) -> None:
        name = self.admission.names.get(worker, worker)
        ts = self._processing_on(key, worker)
        if ts is None:  # not a task it is running (stale, or made up): nothing to do
            logger.debug("ignored a failure report from volunteer %s for %s, a task it is not processing",
                         name, short_text(key, 120))
            return
        stimulus = f"goblin-fault-{short_text(stimulus_id, 80)}"
        if msg.get("run_id") != ts.run_id:  # an earlier run of it on the same worker: run it again
            self.scheduler._reschedule(ts.key, worker=worker, stimulus_id=stimulus)
            return
        text = short_text(msg.get("exception_text"), LOG_CHARS) or "(no error text)"
        logger.warning("volunteer %s failed task %s: %s", name, short_text(ts.key, 200), text)
        tb = _tail(msg.get("traceback_text"))
        if tb:
            logger.info("volunteer %s traceback of %s: %s", name, short_text(ts.key, 200), tb)
        self.failed_on.setdefault(ts.key, set()).add(name)
        self._blame(name, "error", ts.key, short_text(text))
        self.rescheduled += 1
        # processing -> released -> waiting -> processing elsewhere (valid_workers decides where)
        self.scheduler._reschedule(ts.key, worker=worker, stimulus_id=stimulus)
        self.scheduler.stimulus_queue_slots_maybe_opened(stimulus_id=stimulus)

    def handle_reschedule(self, key: Any = None, worker: str | None = None, stimulus_id: str = "", **msg: Any) -> None:
        """Stream handler of ``reschedule``: a volunteer handing a task back is counted (see Bounces above)."""
        if worker is None or not self.admission.is_volunteer(worker):
            return self._reschedule(key=key, worker=worker, stimulus_id=stimulus_id, **msg)
        ts = self._processing_on(key, worker)
        if ts is None:  # not a task it is running: the scheduler would ignore it too
            return None
        name = self.admission.names.get(worker, worker)
        self.bounces[name] = self.bounces.get(name, 0) + 1
        ws = self.scheduler.workers.get(worker)
        if ws is not None and ws.status == Status.paused:  # an honest pause hands back what it had not started
            self.bounced_on.setdefault(ts.key, set()).add(name)
            self._sweep = True
        else:
            logger.warning("volunteer %s handed back task %s without computing it", name, short_text(ts.key, 200))
            self.failed_on.setdefault(ts.key, set()).add(name)
            self._blame(name, "bounce", ts.key, "handed the task back (reschedule) without computing it")
        stimulus = f"goblin-bounce-{short_text(stimulus_id, 80)}"
        self.scheduler._reschedule(ts.key, worker=worker, stimulus_id=stimulus)
        self.scheduler.stimulus_queue_slots_maybe_opened(stimulus_id=stimulus)

    def _excuse(self, key: Any, worker: str | None, msg: dict) -> None:
        """The lab worker failed a task that volunteers failed: the task is bad, not them."""
        if worker is None or self._processing_on(key, worker) is None or key not in self.failed_on:
            return
        names = self.failed_on.pop(key)
        for name in sorted(names):
            record = self._record(name)
            if record is not None and getattr(record, "failed", 0) > 0:
                record.failed -= 1
            if self.in_row.get(name, 0) > 0:
                self.in_row[name] -= 1
        reason = short_text(msg.get("exception_text")) or "(no error text)"
        logger.warning("task %s failed on the lab worker too (%s): volunteer(s) %s excused", short_text(key, 200),
                       reason, ", ".join(sorted(names)))
        self._note(", ".join(sorted(names)), "excused", key, f"the task failed on the lab worker too: {reason}")

    # -- crashes ---------------------------------------------------------------------
    async def removing_worker(self, address: str, *, stimulus_id: str, expected: bool = False, close: bool = True,
                              **kwargs: Any):
        """``Scheduler.remove_worker``, counting a volunteer that dies while processing tasks."""
        try:
            if not expected:
                self._crashed(address)
        except Exception:
            logger.exception("goblin faults: could not account for the removal of %s", address)
        return await self._remove_worker(address, stimulus_id=stimulus_id, expected=expected, close=close, **kwargs)

    def _crashed(self, address: str) -> None:
        ws = self.scheduler.workers.get(address)
        if ws is None:
            try:
                ws = self.scheduler.workers.get(self.scheduler.coerce_address(address))
            except Exception:
                return
        if ws is None or not self.admission.is_volunteer(ws.address) or not ws.processing:
            return
        name = self.admission.names.get(ws.address, ws.address)
        held = list(ws.processing)
        for ts in held:
            ts.suspicious = 0  # volunteers dying is not the task's fault: no KilledWorker for it
            self.failed_on.setdefault(ts.key, set()).add(name)
        if self.admission.is_shut_out(name):  # banned or revoked: its stream closed first, no crash to count
            logger.info("banned or revoked volunteer %s left holding %d task(s); they go elsewhere", name, len(held))
            return
        reason = f"disconnected while processing {len(held)} task(s)"
        logger.warning("volunteer %s %s; they go elsewhere", name, reason)
        self._blame(name, "crash", held[0].key, reason, leaving=ws.address)

    # -- counting and cooldowns ------------------------------------------------------
    def _record(self, name: str):
        if self.ledger is None:
            return None
        from scheduler_plugins.verification import VolunteerRecord

        return self.ledger.volunteers.setdefault(name, VolunteerRecord())

    def _note(self, name: str, kind: str, key: Any, reason: str) -> None:
        self.faults.append({"time": time.time(), "volunteer": name, "kind": kind,
                            "key": short_text(key, 120) if key is not None else None, "reason": reason})

    def _blame(self, name: str, kind: str, key: Any, reason: str, leaving: str | None = None) -> None:
        record = self._record(name)
        if record is not None:
            record.failed += 1
        self._note(name, kind, key, reason)
        self._sweep = True
        if self.is_cooling(name):  # already resting: what it held when it started does not escalate it
            return
        n = self.in_row[name] = self.in_row.get(name, 0) + 1
        if n >= self.max_consecutive:
            self._cool(name, n, leaving=leaving)

    def rest(self, name: str, why: str) -> None:
        """A cooldown now for ``name`` (a missed deadline: the ledger reissued what it held), unless it rests already."""
        if self.is_cooling(name):
            return
        self._note(name, "late", None, why)
        self._cool(name, 1, why=why)

    def _cool(self, name: str, n: int, leaving: str | None = None, why: str | None = None) -> None:
        k = self._cooldowns[name] = self._cooldowns.get(name, 0) + 1
        seconds = self.cooldown * 2 ** min(k - 1, MAX_DOUBLINGS)
        self.cooling[name] = time.monotonic() + seconds
        self.in_row[name] = 0
        record = self._record(name)
        if record is not None:
            record.cooldowns += 1
        reason = f"{why or f'{n} failures in a row'}: no work for {seconds:g} s"
        logger.warning("volunteer %s: %s", name, reason)
        self._note(name, "cooldown", None, reason)
        # what it holds goes elsewhere now (not the tasks of a worker being removed: they are released anyway)
        stimulus = f"goblin-cooldown-{time.time()}"
        for addr in [a for a in self.admission.volunteers() if self.admission.names.get(a) == name and a != leaving]:
            ws = self.scheduler.workers.get(addr)
            for ts in list(ws.processing if ws is not None else ()):
                self.scheduler._reschedule(ts.key, worker=addr, stimulus_id=stimulus)

    def is_cooling(self, name: str | None) -> bool:
        until = self.cooling.get(name) if name is not None else None
        return until is not None and until > time.monotonic()

    def tick(self) -> None:
        """End cooldowns; place the waiting tasks that can now run (on a rested volunteer or the lab)."""
        now = time.monotonic()
        for name in [n for n, until in self.cooling.items() if until <= now]:
            del self.cooling[name]
            logger.info("volunteer %s: cooldown over, it gets work again", name)
            self._sweep = True
        self._no_volunteer(now)
        if not self._sweep:
            return
        self._sweep = False
        recommendations = {}
        for ts in sorted(self.scheduler.unrunnable, key=lambda t: t.priority or (), reverse=True):
            restrictions = ts.resource_restrictions or {}
            if VOLUNTEER_RESOURCE in restrictions or LAB_RESOURCE in restrictions:
                if self.valid_workers(ts):
                    recommendations[ts.key] = "processing"
        if recommendations:
            self.scheduler.transitions(recommendations, stimulus_id=f"goblin-faults-{time.time()}")

    def _no_volunteer(self, now: float) -> None:
        """Volunteer tasks that waited ``no-volunteer-wait`` seconds in no-worker go to the lab worker."""
        unrunnable = self.scheduler.unrunnable
        if not unrunnable and not self.waiting_since:
            return
        waiting, moved = {}, []
        held = self.scheduler.plugins.get("goblin-held-tasks")
        for ts in list(unrunnable):
            if VOLUNTEER_RESOURCE not in (ts.resource_restrictions or {}):
                continue
            if held is not None and _waits_for_a_slot(held, ts):  # a volunteer runs it once one has a free slot
                continue
            since = waiting[ts.key] = self.waiting_since.get(ts.key, now)
            if now - since >= self.volunteer_wait:
                moved.append(ts)
        self.waiting_since = waiting
        if not moved:
            return
        logger.warning("%d volunteer task(s) waited %g s for a volunteer (goblin.faults.no-volunteer-wait) and none "
                       "could take them: the lab worker computes them", len(moved), self.volunteer_wait)
        for ts in moved:
            self.waiting_since.pop(ts.key, None)
            self.move_to_lab(ts, f"no volunteer could take it for {self.volunteer_wait:g} s", log=False)
        self.scheduler.transitions({ts.key: "processing" for ts in moved},
                                   stimulus_id=f"goblin-no-volunteer-{time.time()}")

    # -- placement -------------------------------------------------------------------
    def valid_workers(self, ts):
        """``Scheduler.valid_workers``, less the volunteers a volunteer task may not go to now.

        Those are the volunteers it failed on and those in their cooldown.  When none is
        left but some volunteer is connected (or the task failed before), the task is
        moved to the lab worker, if it is not running (a task being placed or waiting in
        ``no-worker``; ``processing`` ones are only asked about, by work stealing).
        """
        valid = self._valid_workers(ts)
        if VOLUNTEER_RESOURCE not in (ts.resource_restrictions or {}):
            return valid
        failed = self.failed_on.get(ts.key, ())
        bounced = self.bounced_on.get(ts.key)
        if bounced:
            failed = bounced | set(failed)
        if not failed and not self.cooling:
            return valid
        names = self.admission.names
        allowed = {ws for ws in valid or () if names.get(ws.address) not in failed
                   and not self.is_cooling(names.get(ws.address))}
        if len(failed) >= self.max_attempts:
            allowed = set()
        if allowed or ts.state == "processing" or ts.processing_on is not None:
            return allowed
        if not failed and not valid:
            return allowed  # no volunteer connected at all: it waits for one, as always
        why = (f"it failed on or was handed back by {len(failed)} volunteer(s) ({', '.join(sorted(failed))})" if failed
               else "every connected volunteer is resting after failures")
        self.move_to_lab(ts, why)
        return self._valid_workers(ts)

    def move_to_lab(self, ts, why: str, log: bool = True) -> None:
        ts.resource_restrictions = {LAB_RESOURCE: 1}
        ts.worker_restrictions = None
        ts.host_restrictions = None
        ts.loose_restrictions = False
        self.to_lab += 1
        (logger.warning if log else logger.debug)("task %s goes to the lab worker: %s", short_text(ts.key, 200), why)

    # -- what happened to a task -------------------------------------------------------
    def transition(self, key, start, finish, *args, worker: str | None = None, **kwargs) -> None:
        if start == "processing" and finish == "memory" and worker:
            if self.admission.is_volunteer(worker):
                name = self.admission.names.get(worker)
                if self.in_row.get(name):
                    self.in_row[name] = 0  # a success ends a run of failures
            elif is_unverified_key(key) and self.ledger is not None:
                # the lab worker computed a volunteer task: nobody to credit or blame for it
                self.ledger.computed_by.pop(key, None)
        if finish in ("memory", "erred", "forgotten"):
            self.failed_on.pop(key, None)
            self.bounced_on.pop(key, None)

    # -- report ----------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "faults": [dict(f) for f in self.faults],
            "cooling": {n: round(until - now, 1) for n, until in sorted(self.cooling.items()) if until > now},
            "rescheduled": self.rescheduled,
            "bounces": dict(sorted(self.bounces.items())),
            "to_lab": self.to_lab,
        }
