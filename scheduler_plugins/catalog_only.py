"""Catalog-only placement: volunteers get catalog operations and nothing else.

``update_graph`` judges every new task with the catalog's allow-list
(:func:`goblin_dask.ops.task_violation`).  Catalog tasks under an ``unverified-`` key
(whose only consumer is a lab check, see goblin_dask.validation) are restricted to the
``goblin-volunteer`` resource; other catalog tasks, and fused chains of lab-placed ones
(:class:`goblin_dask.ops.spec.LabChain`), run on the lab worker;
everything else (dask glue, a researcher's own function) to ``goblin-lab``, the
trusted lab worker.  A non-catalog task that a researcher pinned to a volunteer is
replaced by one that raises the refusal, so the researcher gets a clear error and the
volunteer never sees it.  Scheduler handlers that would run code on workers or push
the lab's data to them are wrapped to reach the lab worker only, or refused.
"""

from __future__ import annotations

import logging
from typing import Any

from dask._task_spec import Task
from distributed.diagnostics.plugin import SchedulerPlugin

from goblin_dask.array.placement import KEPT_AT_LAB
from goblin_dask.ops import task_violation
from goblin_dask.ops.spec import CatalogTask, LabChain
from goblin_dask.validation.checks import is_unverified_key
from goblin_dask.roles import LAB_RESOURCE, VOLUNTEER_RESOURCE
from scheduler_plugins.admission import AdmissionPlugin

logger = logging.getLogger("goblin_dask.catalog_only")

#: Scheduler handlers refused outright on a lab node, and why.
REFUSED_SCHEDULER_HANDLERS = {
    "register_worker_plugin": "worker plugins run code on every worker, volunteers included",
    "register_nanny_plugin": "nanny plugins run code on every worker's nanny",
    "register_scheduler_plugin": "scheduler plugins are installed by the lab node itself",
    "run_function": "run_on_scheduler would run a researcher's code inside the lab node",
    "proxy": "proxy forwards arbitrary messages to workers",
    "replicate": "replicate copies the lab's data onto volunteers",
    "set_restrictions": "placement is decided by the lab node",
    "dump_cluster_state_to_url": "writes the lab node's state to an arbitrary URL",
}


def refused(message: str):
    """Run in place of a task that was refused (on the lab worker): raise the refusal."""
    raise PermissionError(message)


class PlacementCount:
    """How many catalog tasks went to volunteers and how many the lab kept, and why, in all and per researcher.

    Counted where placement is decided: when a graph arrives (the researcher's side wrote each lab-placed
    task's reason into it, :attr:`CatalogTask.why`), and when the exposure plugin keeps a volunteer task at the
    lab (:meth:`kept_instead`).  A task the lab already holds is not counted again.
    """

    def __init__(self) -> None:
        self.total = _empty_count()
        #: {researcher's name: counts} for the graphs researchers (and lab admins) submitted
        self.by_researcher: dict[str, dict[str, Any]] = {}

    def _entries(self, who: str | None):
        yield self.total
        if who is not None:
            yield self.by_researcher.get(who) or self.by_researcher.setdefault(who, _empty_count())

    def sent(self, who: str | None) -> None:
        for entry in self._entries(who):
            entry["volunteer"] += 1

    def kept(self, who: str | None, why: str) -> None:
        for entry in self._entries(who):
            entry["lab"] += 1
            entry["kept"][why] = entry["kept"].get(why, 0) + 1

    def kept_steps(self, who: str | None, spec: Any) -> None:
        """Count the catalog tasks of a lab-placed task (a LabChain's steps one by one) under their ``why``; a
        reason the lab does not know (a graph is the researcher's to write) counts as ``other``."""
        try:
            steps = tuple(spec.steps) if isinstance(spec, LabChain) else (spec,)
        except TypeError:
            return
        for step in steps:
            if isinstance(step, CatalogTask):
                why = getattr(step, "why", None)
                self.kept(who, why if type(why) is str and why in KEPT_AT_LAB else "other")

    def kept_instead(self, who: str | None, why: str) -> None:
        """A task counted as sent stays at the lab after all (the exposure plugin's caps)."""
        for entry in self._entries(who):
            entry["volunteer"] = max(0, entry["volunteer"] - 1)
        self.kept(who, why)

    def report(self, researcher: str | None = None, only: bool = False) -> tuple[dict, dict]:
        """``(totals, {researcher: counts})``; ``only``: just ``researcher``'s own row (a researcher asking)."""
        rows = {n: c for n, c in sorted(self.by_researcher.items()) if not only or n == researcher}
        copy = lambda c: {**c, "kept": dict(sorted(c["kept"].items()))}  # noqa: E731
        return copy(self.total), {n: copy(c) for n, c in rows.items()}


def _empty_count() -> dict[str, Any]:
    return {"volunteer": 0, "lab": 0, "kept": {}}


def submitter(scheduler, client: str | None = None, key: Any = None) -> str | None:
    """The name of the researcher (or lab admin) whose graph brought a task: by its client, else by the key's
    owners (``scheduler_plugins.researcher_keys``); None for the lab's own clients (its checker's replicas)."""
    keys = scheduler.plugins.get("goblin-researcher-keys")
    if keys is None:
        return None
    if client is not None:
        peers = [keys.clients.get(client)]
    else:
        peers = sorted(keys.owners.get(key, ()))
    return next((name for role, name in filter(None, peers) if role in ("researcher", "admin")), None)


class CatalogOnlyPlugin(SchedulerPlugin):
    name = "goblin-catalog-only"

    def __init__(self, scheduler, admission: AdmissionPlugin):
        self.scheduler = scheduler
        self.admission = admission
        self.placed = {"volunteer": 0, "lab": 0, "refused": 0}
        self.count = PlacementCount()
        for op, why in REFUSED_SCHEDULER_HANDLERS.items():
            scheduler.handlers[op] = _refuser(op, why)
        self._broadcast = scheduler.handlers["broadcast"]
        scheduler.handlers["broadcast"] = self.broadcast
        self._scatter = scheduler.handlers["scatter"]
        scheduler.handlers["scatter"] = self.scatter
        self._rebalance = scheduler.handlers["rebalance"]
        scheduler.handlers["rebalance"] = self.rebalance

    # -- placement ---------------------------------------------------------------
    def update_graph(self, scheduler, *, tasks: list, client: str | None = None, **kwargs: Any) -> None:
        who = submitter(scheduler, client=client)
        for key in tasks:
            ts = scheduler.tasks.get(key)
            if ts is None or ts.run_spec is None:
                continue
            self.place(ts, who)

    def place(self, ts, who: str | None = None) -> None:
        spec = ts.run_spec
        fresh = ts.state == "released"  # not a task the lab holds already (a graph naming it again)
        if isinstance(spec, LabChain):
            # lab-only by construction (no volunteer's allow-list takes it); refused where pinned
            # to a volunteer exactly when one of its steps would have been, unfused
            why = next((w for step in spec.steps
                        if (w := task_violation(step, where=f"task {step.key!r} (in {ts.key!r})")) is not None), None)
        else:
            why = task_violation(spec, where=f"task {ts.key!r}")
        if why is None and isinstance(spec, CatalogTask) and spec.placement == "volunteer" and is_unverified_key(ts.key):
            # only under an unverified- key: its one consumer is the lab's check task
            ts.resource_restrictions = {VOLUNTEER_RESOURCE: 1}
            self.placed["volunteer"] += 1
            if fresh:
                self.count.sent(who)
            return
        pinned = [w for w in (ts.worker_restrictions or ()) if self.admission.is_volunteer(w)]
        if why is not None and pinned:
            names = ", ".join(self.admission.names.get(w, w) for w in pinned)
            message = f"refused: {why}; it cannot run on volunteer {names} (volunteers run catalog operations only)"
            logger.warning(message)
            ts.run_spec = Task(ts.key, refused, message)
            self.placed["refused"] += 1
        ts.worker_restrictions = None
        ts.host_restrictions = None
        ts.loose_restrictions = False
        ts.resource_restrictions = {LAB_RESOURCE: 1}
        self.placed["lab"] += 1
        if fresh:  # last, once the task is placed: what a graph carries never stops placement
            self.count.kept_steps(who, spec)

    # -- wrapped handlers --------------------------------------------------------
    def _lab_only(self, workers, what: str) -> list[str]:
        lab = self.admission.lab_workers()
        if workers is None:
            return lab
        volunteers = [w for w in workers if self.admission.is_volunteer(w)]
        if volunteers:
            names = ", ".join(self.admission.names.get(w, w) for w in volunteers)
            raise PermissionError(f"{what} refused for volunteer {names}: volunteers run catalog operations only")
        return list(workers)

    async def broadcast(self, *, msg: dict, workers=None, hosts=None, **kwargs):
        # client.run / client.run_coroutine / restart / ... reach the lab worker only
        if hosts is not None:
            workers = [w for w in self.scheduler.workers if self.scheduler.workers[w].host in hosts]
        targets = self._lab_only(workers, f"'{msg.get('op')}' on workers")
        return await self._broadcast(msg=msg, workers=targets, **kwargs)

    async def scatter(self, *, data, workers=None, client=None, broadcast=False, timeout=2):
        targets = self._lab_only(workers, "scatter")
        return await self._scatter(data=data, workers=targets, client=client, broadcast=broadcast, timeout=timeout)

    async def rebalance(self, *, keys=None, workers=None, **kwargs):
        return await self._rebalance(keys=keys, workers=self._lab_only(workers, "rebalance"), **kwargs)


def _refuser(op: str, why: str):
    def handler(*args, **kwargs):
        raise PermissionError(f"goblin lab node refuses '{op}': {why}")

    return handler
