"""The verification ledger: who computed what, what was accepted, trust and bans.

The scheduler records which volunteer produced each ``unverified-`` result; the lab
worker's check tasks report verdicts on the ``goblin-verdict`` stream op (accepted
only from lab workers).  A rejection resets the volunteer's trust; past
``max_rejections`` the volunteer is banned: its credential revoked, disconnected,
refused on reconnect.  :meth:`report` is what ``LabNode.report()`` and
``/goblin/report.json`` return.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from goblin_dask.validation.checks import VERDICT_OP, is_unverified_key
from scheduler_plugins.admission import AdmissionPlugin

logger = logging.getLogger("goblin_dask.verification")


@dataclass
class VolunteerRecord:
    accepted: int = 0
    rejected: int = 0
    banned: bool = False
    #: consecutive accepted results since the last rejection (BOINC-style)
    trust: int = 0


def _as_key(key: Any) -> Any:
    return tuple(_as_key(k) for k in key) if isinstance(key, list) else key


class VerificationLedger(SchedulerPlugin):
    name = "goblin-verification"

    def __init__(self, scheduler, admission: AdmissionPlugin, *, max_rejections: int = 2):
        self.scheduler = scheduler
        self.admission = admission
        self.max_rejections = max_rejections
        self.computed_by: dict[Any, str] = {}
        self.compute_seconds = 0.0
        self.check_seconds = 0.0
        self.tasks = 0
        self.by_method: Counter[str] = Counter()
        self.volunteers: dict[str, VolunteerRecord] = {}
        scheduler.stream_handlers[VERDICT_OP] = self.on_verdict
        scheduler.handlers["goblin_report"] = lambda: self.report()

    def add_worker(self, scheduler, worker: str) -> None:
        if self.admission.is_volunteer(worker):
            self.volunteers.setdefault(self.admission.names[worker], VolunteerRecord())

    def transition(self, key, start, finish, *args, worker: str | None = None, startstops=None, **kwargs) -> None:
        if start == "processing" and finish == "memory" and worker and is_unverified_key(key):
            self.computed_by[key] = self.admission.names.get(worker, worker)
            self.tasks += 1
            for ss in startstops or ():
                if ss.get("action") == "compute":
                    self.compute_seconds += ss["stop"] - ss["start"]
        elif finish == "forgotten":
            self.computed_by.pop(key, None)

    def on_verdict(self, worker: str, key, method: str, accepted: bool, seconds: float, **kwargs) -> None:
        if worker not in self.admission.lab_workers():
            logger.warning("ignored a verdict from %s, which is not a lab worker", worker)
            return
        key = _as_key(key)
        name = self.computed_by.get(key)
        self.by_method[method] += 1
        self.check_seconds += seconds
        if name is None:
            return
        record = self.volunteers.setdefault(name, VolunteerRecord())
        if accepted:
            record.accepted += 1
            record.trust += 1
            return
        record.rejected += 1
        record.trust = 0
        logger.warning("rejected result %r of volunteer %s (%s)", key, name, method)
        if record.rejected >= self.max_rejections and not record.banned:
            record.banned = True
            logger.warning("banned volunteer %s after %d rejected results", name, record.rejected)
            self.admission.revoke(name, ban=True)

    def report(self) -> dict[str, Any]:
        accepted = sum(v.accepted for v in self.volunteers.values())
        rejected = sum(v.rejected for v in self.volunteers.values())
        return {
            "tasks": self.tasks,
            "accepted": accepted,
            "rejected": rejected,
            "by_method": dict(self.by_method),
            "volunteers": {n: vars(v).copy() for n, v in sorted(self.volunteers.items())},
            "overhead": self.check_seconds / self.compute_seconds if self.compute_seconds else 0.0,
        }
