"""The verification ledger: who computed what, what was accepted, trust, replicas, deadlines, bans.

The scheduler records which volunteer produced each ``unverified-`` result; the lab
worker's check tasks (:mod:`goblin_dask.validation.checks`) attach their verdicts to
their own task metadata, read here when the scheduler accepts the check's result (only
from lab workers; a check run the scheduler cancelled, because its input was lost and
recomputed elsewhere, does not count).

Every replica-method result is replicated on a volunteer of a different person (as the admin
enrolled them: ``goblin enroll --person``), or recomputed by the lab when there is none.
Replica agreement alone is no proof (two people may collude, or one person hold credentials
enrolled as two), and they agree on whatever they return, so the lab audits: for each replica
pair it draws, from its own random generator and never from the task, whether it recomputes
the task itself even when the two agree (``goblin.verification.audit-rate``, 0.05).  A
cheater who returns wrong numbers on ``k`` tasks, every one replicated by a colluder,
escapes with probability ``(1 - audit_rate) ** k``; the draw stays on the lab (the
volunteers never see it), so cheating on fewer tasks only lowers ``k``.

Acceptance on trust is opt-in (``goblin.verification.accept-on-trust``, false), after
BOINC's adaptive replication: a volunteer's ``trust`` is its number of
consecutive verified results; a rejection (or a missed deadline) resets it.  Below
``goblin.verification.trust-threshold`` (10) every replica-method result is replicated; above it the
replication rate falls as ``threshold / trust`` down to ``min-replica-rate`` (0.05),
and an unreplicated result is recomputed by the lab with probability
``sample-rate * threshold / trust`` (at least ``min-sample-rate``); the rest are
accepted on trust.  Products are always Freivalds-checked (cheap, whatever the trust).
The lab worker asks for that decision on the ``goblin_policy`` handler; the replica
task it then submits is restricted here to volunteers other than the first one (when
none is connected, or the last of them leaves before running it, the lab worker computes it).

A rejected result costs the volunteer its trust; at ``goblin.max-rejections`` (2)
rejections it is banned: its credential revoked, disconnected, refused on reconnect; so is every other
credential of its person (``AdmissionPlugin.ban_person``), and no new one is enrolled for them.

Credit: the verified work of each volunteer, in floating-point operations from the catalog's
cost model (``OpSpec.cost`` of the checked task, computed by the lab worker on the operands it
holds), added only for accepted results; kept in ``STATE_DIR/credit.json`` across restarts.
A volunteer asks for its own record on ``goblin_volunteer_status`` (the name is its certificate's).

Deadlines are per task: a volunteer task given to a volunteer is due ``goblin.verification.deadline``
seconds (300) after the volunteer could start it: ``deadline * (1 + ahead // threads)``, where ``ahead`` is
the number of tasks it already held when it was given this one and ``threads`` its claimed task threads
(it runs them that many at a time).  A task held past that without its result is reissued to another
volunteer, the holder marked ``late`` and put in cooldown (``scheduler_plugins.faults``: what else it holds
goes elsewhere too), even if it finishes other tasks meanwhile: finishing one task now and then no longer
keeps the others held.

:meth:`VerificationLedger.report` is what ``LabNode.report()`` and
``/goblin/report.json`` return.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin
from tornado.ioloop import PeriodicCallback

from goblin_dask import settings
from goblin_dask.node import rpc
from goblin_dask.roles import LAB_RESOURCE, VOLUNTEER_RESOURCE
from goblin_dask.tls import peer_identity
from goblin_dask.validation.checks import UNVERIFIED_PREFIX, VERDICTS, as_key, is_unverified_key
from scheduler_plugins.admission import AdmissionPlugin

logger = logging.getLogger("goblin_dask.verification")

#: Verdicts arriving after the scheduler forgot the result still find who computed it.
_FORGOTTEN_KEPT = 100_000
#: The volunteers' credit in the node's state directory (kept across restarts).
CREDIT_FILE = "credit.json"
#: Rejections listed in the report (the oldest are dropped first).
_REJECTIONS_KEPT = 1000


@dataclass
class VolunteerRecord:
    accepted: int = 0
    rejected: int = 0
    banned: bool = False
    #: consecutive verified results since the last rejection or missed deadline (BOINC-style)
    trust: int = 0
    #: times its tasks were reissued elsewhere for missing their deadline
    late: int = 0
    #: its tasks that failed (an error, or it died while processing them; scheduler_plugins.faults)
    failed: int = 0
    #: times it was given no work for a while after failures in a row
    cooldowns: int = 0
    #: floating-point operations of its accepted results (the catalog's cost model), across restarts
    credit: float = 0.0


@dataclass(frozen=True)
class TrustPolicy:
    """How much checking a volunteer's replica-method results get (``goblin.verification.*``).

    By default every result is replicated (or recomputed by the lab) whatever the volunteer's
    trust; only with ``accept_on_trust`` do the rates below fall with trust (BOINC's adaptive
    replication) and some results go unchecked.  Either way the lab recomputes ``audit_rate``
    of the replica pairs itself, even when they agree: two credentials of one person agree on
    whatever they like.  A cheater whose wrong results on ``k`` tasks are all "confirmed" by a
    colluding replica escapes every audit with probability ``(1 - audit_rate) ** k`` (at 0.05:
    0.60 for 10 tasks, 0.077 for 50, 0.006 for 100); the lab pays about ``audit_rate`` times the
    volunteers' compute for it."""

    threshold: int
    min_replica_rate: float
    sample_rate: float
    min_sample_rate: float
    accept_on_trust: bool = False
    audit_rate: float = 0.05

    def __post_init__(self):
        if not isinstance(self.accept_on_trust, bool):
            raise ValueError(f"goblin.verification.accept-on-trust = {self.accept_on_trust!r}: true or false")
        if not 0.0 < self.audit_rate <= 1.0:  # (NaN fails too)
            raise ValueError(f"goblin.verification.audit-rate = {self.audit_rate!r}: a share of replica pairs in "
                             "(0, 1], e.g. 0.05; the lab must draw some checks of its own, because two agreeing "
                             "replicas may be one person's")

    @classmethod
    def from_config(cls) -> "TrustPolicy":
        audit = settings.get("goblin.verification.audit-rate")
        try:
            audit = float(audit)
        except (TypeError, ValueError):
            raise ValueError(f"goblin.verification.audit-rate = {audit!r}: a number in (0, 1], e.g. 0.05") from None
        return cls(int(settings.get("goblin.verification.trust-threshold")),
                   float(settings.get("goblin.verification.min-replica-rate")),
                   float(settings.get("goblin.verification.sample-rate")),
                   float(settings.get("goblin.verification.min-sample-rate")),
                   accept_on_trust=settings.get("goblin.verification.accept-on-trust"),
                   audit_rate=audit)

    def replica_rate(self, trust: int) -> float:
        if trust < self.threshold or not self.accept_on_trust:
            return 1.0
        # (a threshold of 0 trusts a volunteer with no record yet: the floor, not a division by 0)
        return max(self.min_replica_rate, self.threshold / trust) if trust else self.min_replica_rate

    def sampling_rate(self, trust: int) -> float:
        """Of the results not replicated."""
        if trust < self.threshold or not self.accept_on_trust:
            return 1.0
        return max(self.min_sample_rate, self.sample_rate * self.threshold / trust) if trust else self.min_sample_rate


def _replica_key(raw_key: Any) -> Any:
    """A fresh opaque ``unverified-<op>-<token>`` key with the same block indices."""
    name = raw_key[0] if isinstance(raw_key, tuple) else raw_key
    from goblin_dask.array.keys import split_name

    parts = split_name(str(name)[len(UNVERIFIED_PREFIX):])  # <op>-<token>[-<part>]: the op is the prefix
    op = parts.prefix if parts is not None else "replica"
    fresh = f"{UNVERIFIED_PREFIX}{op}-{secrets.token_hex(16)}"
    return (fresh,) + tuple(raw_key[1:]) if isinstance(raw_key, tuple) else fresh


class VerificationLedger(SchedulerPlugin):
    name = "goblin-verification"

    def __init__(self, scheduler, admission: AdmissionPlugin, *, max_rejections: int = 2,
                 policy: TrustPolicy | None = None, deadline: float | None = None,
                 state_dir: str | os.PathLike | None = None):
        self.scheduler = scheduler
        self.admission = admission
        self.max_rejections = max_rejections
        self.policy = policy or TrustPolicy.from_config()
        self.deadline = float(deadline if deadline is not None else settings.get("goblin.verification.deadline"))
        self.computed_by: dict[Any, str] = {}
        #: volunteer address -> name, kept after it leaves (its results may still be under check)
        self.addresses: dict[str, str] = {}
        self._forgotten: OrderedDict[Any, str] = OrderedDict()
        #: replica key -> names of the volunteers it must not run on
        self.replicas: dict[Any, frozenset[str]] = {}
        #: tasks restricted to some volunteers (replicas, reissued tasks) -> the names they must not run on
        self.restricted: dict[Any, frozenset[str]] = {}
        self.compute_seconds = 0.0
        self.check_seconds = 0.0
        self.check_cpu_seconds = 0.0
        self.replica_seconds = 0.0
        self.tasks = 0
        self.reissued = 0
        self.by_method: Counter[str] = Counter()
        self.volunteers: dict[str, VolunteerRecord] = {}
        #: the latest rejections, each with its volunteer, key, method and reason
        self.rejections: deque[dict[str, Any]] = deque(maxlen=_REJECTIONS_KEPT)
        #: volunteer task being processed -> (its volunteer's address, when it is due: the per-task deadline)
        self._due: dict[Any, tuple[str, float]] = {}
        self._rng = random.Random(secrets.randbits(64))
        self._deadlines: PeriodicCallback | None = None
        #: where credit is kept across restarts (None: not kept)
        self.credit_file = Path(state_dir) / CREDIT_FILE if state_dir is not None else None
        self._credit_dirty = False
        self._credit_flush: PeriodicCallback | None = None
        self.load_credit()
        scheduler.handlers[rpc.REPORT] = self.report_handler
        scheduler.handlers[rpc.POLICY] = self.policy_handler
        scheduler.handlers[rpc.VOLUNTEER_STATUS] = self.volunteer_status_handler

    # -- lifecycle -----------------------------------------------------------------
    async def start(self, scheduler) -> None:
        interval = max(0.25, min(self.deadline / 4, 30.0))
        self._deadlines = PeriodicCallback(self.check_deadlines, interval * 1000)
        self._deadlines.start()
        if self.credit_file is not None:
            self._credit_flush = PeriodicCallback(self.save_credit, 1000)
            self._credit_flush.start()

    async def close(self) -> None:
        if self._deadlines is not None:
            self._deadlines.stop()
        if self._credit_flush is not None:
            self._credit_flush.stop()
        self.save_credit()

    # -- credit, kept across restarts ------------------------------------------------
    def load_credit(self) -> None:
        if self.credit_file is None or not self.credit_file.exists():
            return
        try:
            kept = json.loads(self.credit_file.read_text())["credit"]
            for name, flops in kept.items():
                self.volunteers.setdefault(str(name), VolunteerRecord()).credit = float(flops)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            logger.error("could not read the volunteers' credit from %s: %s", self.credit_file, e)

    def save_credit(self) -> None:
        """Write the credit when it changed (atomically: a crash leaves the old file or the new one)."""
        if self.credit_file is None or not self._credit_dirty:
            return
        self._credit_dirty = False
        data = {"unit": "flop", "credit": {n: v.credit for n, v in sorted(self.volunteers.items()) if v.credit}}
        tmp = self.credit_file.with_name(f".{self.credit_file.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self.credit_file)
        except OSError as e:
            self._credit_dirty = True
            logger.error("could not save the volunteers' credit to %s: %s", self.credit_file, e)

    def volunteer_status_handler(self, comm) -> dict:
        """A volunteer's own record (its name from its certificate, never from what it says)."""
        role, name = peer_identity(comm) or ("", "")
        if role != "volunteer":
            raise PermissionError("goblin lab node: only a volunteer asks for its own status")
        record = self.volunteers.get(name) or VolunteerRecord()
        return {"name": name, "credit": record.credit, "accepted": record.accepted, "rejected": record.rejected,
                "trust": record.trust, "late": record.late,
                "banned": record.banned or name in getattr(self.admission, "banned", ())}

    def add_worker(self, scheduler, worker: str) -> None:
        if self.admission.is_volunteer(worker):
            name = self.admission.names[worker]
            self.addresses[worker] = name
            self.volunteers.setdefault(name, VolunteerRecord())

    def remove_worker(self, scheduler, worker: str, **kwargs) -> None:
        # tasks restricted to some volunteers (replicas, reissued tasks) that only it could run
        stranded = {}
        for key, excluded in list(self.restricted.items()):
            ts = scheduler.tasks.get(key)
            if ts is None:
                del self.restricted[key]
            elif ts.state in ("released", "waiting", "no-worker") and worker in (ts.worker_restrictions or ()):
                self._place(ts, excluded)
                if ts.state == "no-worker":
                    stranded[key] = "processing"  # or it stays there, if nobody can take it yet
        if stranded:
            scheduler.transitions(stranded, stimulus_id=f"goblin-restricted-{time.time()}")

    # -- placement of replicas -----------------------------------------------------
    def update_graph(self, scheduler, *, tasks: list, **kwargs: Any) -> None:
        for key in tasks:
            excluded = self.replicas.get(key)
            ts = scheduler.tasks.get(key)
            if excluded is None or ts is None or ts.resource_restrictions != {VOLUNTEER_RESOURCE: 1}:
                continue
            self._place(ts, excluded)

    def may_run(self, key, name: str | None, excluded=None) -> bool:
        """May volunteer ``name`` run task ``key``?  Not one of ``excluded`` (default: the names ``key`` is
        restricted away from), nor, for a replica, any credential of the person whose result it checks: one
        person's two credentials agree on whatever they like (issue 29)."""
        if name in (self.restricted.get(key, ()) if excluded is None else excluded):
            return False
        checked = self.replicas.get(key)
        return not checked or self.admission.person(name) not in {self.admission.person(n) for n in checked}

    def _restrict(self, ts, excluded) -> bool:
        """Only volunteers :meth:`may_run` ``ts`` besides ``excluded`` may run it; False when none is connected."""
        eligible = {a for a in self.admission.volunteers() if self.may_run(ts.key, self.admission.names.get(a), excluded)}
        if not eligible:
            return False
        ts.worker_restrictions = eligible
        ts.loose_restrictions = False
        self.restricted[ts.key] = frozenset(excluded)
        return True

    def _place(self, ts, excluded) -> None:
        """On a volunteer not ``excluded``; when none is connected, the lab worker computes ``ts``
        (a replica never goes to the volunteer whose result it checks, nor waits for one that left)."""
        if self._restrict(ts, excluded):
            return
        ts.resource_restrictions = {LAB_RESOURCE: 1}
        ts.worker_restrictions = None
        ts.loose_restrictions = False
        self.restricted.pop(ts.key, None)
        logger.info("task %r goes to the lab worker: no volunteer but %s may run it", ts.key,
                    ", ".join(sorted(excluded)) or "none")

    # -- what volunteers computed ----------------------------------------------------
    def transition(self, key, start, finish, *args, worker: str | None = None, startstops=None, metadata=None,
                   **kwargs) -> None:
        if finish == "forgotten":  # (one in memory may be lost with its worker and computed again)
            self.restricted.pop(key, None)
        if start == "processing":
            self._due.pop(key, None)
        elif finish == "processing" and is_unverified_key(key):
            self._given(key)
        if start == "processing" and finish == "memory" and metadata and VERDICTS in metadata:
            self.on_verdicts(worker, **metadata[VERDICTS])
        if start == "processing" and finish == "memory" and worker and is_unverified_key(key):
            seconds = sum(ss["stop"] - ss["start"] for ss in startstops or () if ss.get("action") == "compute")
            if key in self.replicas:  # a replica is verification work, wherever it ran
                self.replica_seconds += seconds
            if not self.admission.is_volunteer(worker):
                # the lab worker computed a volunteer task (moved there after failures, or kept there by
                # the exposure cap): nobody's result to credit or blame, and no volunteer's compute time
                self.computed_by.pop(key, None)
                return
            self.computed_by[key] = self.admission.names.get(worker, worker)
            self.tasks += 1
            if key not in self.replicas:
                self.compute_seconds += seconds
        elif finish == "forgotten" and key in self.computed_by:
            self._forgotten[key] = self.computed_by.pop(key)
            while len(self._forgotten) > _FORGOTTEN_KEPT:
                self._forgotten.popitem(last=False)

    def _who(self, key) -> str | None:
        return self.computed_by.get(key) or self._forgotten.get(key)

    # -- verdicts and policy (from the lab worker only) ----------------------------
    def on_verdicts(self, worker: str, verdicts: list, seconds: float = 0.0, cpu_seconds: float = 0.0,
                    flops: float = 0.0, **kwargs) -> None:
        """The verdicts of one check task, read from its metadata when the scheduler accepted its result."""
        if not self.admission.is_lab(worker):
            logger.warning("ignored verdicts from %s, which is not a lab worker", worker)
            return
        self.check_seconds += float(seconds)
        self.check_cpu_seconds += float(cpu_seconds)
        for key, method, accepted, *rest in verdicts:
            source = rest[0] if rest else None
            reason = str(rest[1]) if len(rest) > 1 and rest[1] else ""
            name = self.addresses.get(source) if source else None
            self.on_verdict(as_key(key), str(method), bool(accepted), name=name, reason=reason, flops=flops)

    def on_verdict(self, key, method: str, accepted: bool, name: str | None = None, reason: str = "",
                   flops: float = 0.0) -> None:
        """``name``: the volunteer whose bytes were checked, when the lab worker knows it;
        ``reason``: why the result was rejected; ``flops``: the task's work by the catalog's cost
        model (the lab worker's figure; credited only when the result is accepted)."""
        name = name or self._who(key)
        self.by_method[method] += 1
        self.replicas.pop(key, None)
        self._forgotten.pop(key, None)
        if name is None:
            return
        record = self.volunteers.setdefault(name, VolunteerRecord())
        if accepted:
            record.accepted += 1
            flops = float(flops)
            if flops > 0 and flops == flops and flops != float("inf"):
                record.credit += flops
                self._credit_dirty = True
            if method != "trusted":  # only verified results earn trust
                record.trust += 1
            return
        record.rejected += 1
        record.trust = 0
        reason = reason or f"failed the {method} check"
        self.rejections.append({"volunteer": name, "key": repr(key)[:200], "method": method, "reason": reason,
                                "time": time.time()})
        logger.warning("rejected result %r of volunteer %s (%s): %s", key, name, method, reason)
        if record.rejected >= self.max_rejections and not record.banned:
            record.banned = True
            self.admission.ban_person(name, f"{record.rejected} rejected results (last: {reason})")

    def policy_handler(self, comm, key=None) -> dict:
        if (peer_identity(comm) or ("",))[0] != "lab":
            raise PermissionError("goblin lab node: only the lab worker asks how to verify a result")
        return self.decide(as_key(key))

    def decide(self, key) -> dict:
        """How to verify the replica-method result ``key``: replicate it (and whether the lab audits the
        pair), sample it, or trust it (only with ``accept-on-trust``)."""
        name = self._who(key)
        trust = self.volunteers[name].trust if name in self.volunteers else 0
        others = self.admission.has_volunteer_besides(name)
        timeout = 4 * self.deadline
        if self._rng.random() < self.policy.replica_rate(trust):
            if others:
                replica = _replica_key(key)
                self.replicas[replica] = frozenset({name} if name else ())
                # the lab's own check of this pair, drawn here (never sent to a volunteer, not from the key)
                audit = self._rng.random() < self.policy.audit_rate
                return {"replica": replica, "sample": False, "audit": audit, "trust": trust, "timeout": timeout}
            return {"replica": None, "sample": True, "trust": trust}  # nobody to replicate on: the lab checks
        sample = self._rng.random() < self.policy.sampling_rate(trust)
        return {"replica": None, "sample": sample, "trust": trust}

    # -- deadlines -----------------------------------------------------------------
    def _given(self, key) -> None:
        """A volunteer task starts processing on a worker: when it is due, if that worker is a volunteer."""
        ts = self.scheduler.tasks.get(key)
        ws = ts.processing_on if ts is not None else None
        if ws is None or not self.admission.is_volunteer(ws.address):
            return
        ahead = max(0, len(ws.processing) - 1)  # what it held already: it runs them `nthreads` at a time
        self._due[key] = (ws.address, time.time() + self.deadline * (1 + ahead // max(1, int(ws.nthreads))))

    def check_deadlines(self) -> None:
        """Reissue elsewhere each volunteer task held past its deadline; its holder is late and rests."""
        now = time.time()
        overdue: dict[str, list] = {}
        for key, (addr, due) in self._due.items():
            if due < now:
                overdue.setdefault(addr, []).append(key)
        for addr, keys in overdue.items():
            ws = self.scheduler.workers.get(addr)
            tasks = self.scheduler.tasks
            held = [tasks[k] for k in keys if k in tasks and ws is not None and tasks[k].processing_on is ws]
            if not held:
                continue
            name = self.admission.names.get(addr, addr)
            moved = 0
            exposure = self.scheduler.plugins.get("goblin-exposure")
            for ts in held:
                if self._restrict(ts, self.replicas.get(ts.key, frozenset()) | {name}):
                    if exposure is not None:  # within max-exposure still, or on the lab worker
                        exposure.replan_when_released(ts.key)
                    self.scheduler._reschedule(ts.key, worker=addr, stimulus_id=f"goblin-deadline-{now}")
                    moved += 1
            if moved:
                record = self.volunteers.setdefault(name, VolunteerRecord())
                record.late += 1
                record.trust = 0
                self.reissued += moved
                logger.warning("volunteer %s missed its deadline: %d task(s) reissued elsewhere", name, moved)
                faults = self.scheduler.plugins.get("goblin-faults")
                if faults is not None and hasattr(faults, "rest"):  # no more work for it until it has rested
                    faults.rest(name, f"held {moved} task(s) past their {self.deadline:g} s deadline")

    # -- report --------------------------------------------------------------------
    def _bans(self) -> list[dict[str, Any]]:
        return [dict(b) for b in getattr(self.admission, "bans", ())]

    def report_handler(self, comm=None, brief: bool = False) -> dict[str, Any]:
        """``goblin_report``: a researcher sees only its own row of ``placement_by_researcher``.  ``brief``: only
        the counters (tasks, accepted, rejected, by method), what a Trainer reads twice a round: the whole
        report walks every lab array's exposure account, which grows with every round's batch."""
        if brief is True:
            return self.counters()
        role, name = (peer_identity(comm) if comm is not None else None) or (None, None)
        return self.report(researcher=name if role == "researcher" else None)

    def counters(self) -> dict[str, Any]:
        """Tasks, results accepted and rejected, verdicts by method: the head of :meth:`report`."""
        return {"tasks": self.tasks, "accepted": sum(v.accepted for v in self.volunteers.values()),
                "rejected": sum(v.rejected for v in self.volunteers.values()), "by_method": dict(self.by_method)}

    def report(self, researcher: str | None = None) -> dict[str, Any]:
        """The ledger's report; ``researcher``: narrow the per-researcher counts to that researcher's own."""
        verification = self.check_seconds + self.replica_seconds
        return {
            **self.counters(),
            "volunteers": {n: {**vars(v), "banned": v.banned or n in getattr(self.admission, "banned", ())}
                           for n, v in sorted(self.volunteers.items())},
            "overhead": verification / self.compute_seconds if self.compute_seconds else 0.0,
            "reissued": self.reissued,
            # floating-point operations of all accepted volunteer results (each volunteer's: "volunteers")
            "credit": sum(v.credit for v in self.volunteers.values()),
            "failed": sum(v.failed for v in self.volunteers.values()),
            # each failure, crash and cooldown, with the volunteer's name and why (scheduler_plugins.faults)
            "faults": faults.report() if (faults := self.scheduler.plugins.get("goblin-faults")) else {},
            # each volunteer's cap on tasks held at once and the most it held (scheduler_plugins.held_tasks)
            "holding": held.report() if (held := self.scheduler.plugins.get("goblin-held-tasks")) else {},
            # each refused worker or message and each ban, with the reason
            "refusals": [{"kind": "refused", **r} for r in getattr(self.admission, "refusals", ())]
            + [{"kind": "banned", "volunteer": b["name"], "reason": b["reason"]} for b in self._bans()],
            # each ban ({"name", "reason", "time"}): rejected results, refused stream messages, the lab's refusals
            "bans": self._bans(),
            # {volunteer: calls and stream messages refused over its call budget} (admission.CallBudget)
            "over_budget": dict(calls.refused) if (calls := getattr(self.admission, "calls", None)) else {},
            # the latest rejected results, with the reason
            "rejections": [dict(r) for r in self.rejections],
            # {volunteer: {lab array id: fraction of its elements received}} (scheduler_plugins.exposure)
            "exposure": exposure.report() if (exposure := self.scheduler.plugins.get("goblin-exposure")) else {},
            # the same, summed over each person's credentials (what max-exposure bounds; goblin enroll --person)
            "exposure_by_person": exposure.report(by_person=True) if exposure else {},
            # {volunteer: {"believed", "unsent"}}: its cache hints counted, and keys it named but was never sent
            "cache_hints": hints.report() if (hints := self.scheduler.plugins.get("goblin-volunteer-cache")) else {},
            # catalog tasks sent to volunteers, and kept at the lab with why ({reason: count}; the reasons and the
            # settings that would send them out: goblin_dask.array.placement.KEPT_AT_LAB), in all and per researcher
            **dict(zip(("placement", "placement_by_researcher"), placement.count.report(researcher, researcher is not None)
                       if (placement := self.scheduler.plugins.get("goblin-catalog-only")) else ({}, {}))),
            "seconds": {"compute": self.compute_seconds, "check": self.check_seconds,
                        "check_cpu": self.check_cpu_seconds, "replicas": self.replica_seconds},
        }
