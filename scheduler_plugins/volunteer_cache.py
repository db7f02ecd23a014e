"""Placement prefers the volunteer that already holds a task's inputs.

A volunteer keeps the lab's input blocks it received (:mod:`goblin_dask.volunteer.panel_cache`) and says
which on its worker stream (``goblin-cached``: keys added, keys removed; validated by
:mod:`scheduler_plugins.stream_guard`, which bans a volunteer sending a malformed one).  The
scheduler does not list the volunteer among the keys' holders (a volunteer is no source of the
lab's data: nobody fetches from it); it only lowers that volunteer's estimated transfer cost for a
task reading those keys (``Scheduler.get_comm_cost``, which ``worker_objective`` and work stealing
use), so distributed's own choice (earliest start: queue plus transfer) picks it while it is not
busier than the transfer it saves.

The hint is untrusted and costs a liar nothing but itself: at most
:data:`~goblin_dask.volunteer.panel_cache.MAX_HINT_KEYS` keys per volunteer are believed, only keys of the
lab's data blocks are accepted, and a volunteer that claims keys it lacks attracts tasks that it
then fetches the inputs of (or computes wrong and is rejected: every result is checked against the
lab's own copy).  Cost per placement decision: a set lookup per input of the task, per candidate.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from goblin_dask.volunteer.panel_cache import HINT_OP, MAX_HINT_KEYS

logger = logging.getLogger("goblin_dask.volunteer_cache")


class VolunteerCachePlugin(SchedulerPlugin):
    name = "goblin-volunteer-cache"

    def __init__(self, scheduler, admission):
        self.scheduler = scheduler
        self.admission = admission
        #: volunteer address -> keys it says it holds (at most MAX_HINT_KEYS)
        self.held: dict[str, set] = {}
        self.hints = 0
        scheduler.stream_handlers[HINT_OP] = self.cached
        self._get_comm_cost = scheduler.get_comm_cost
        scheduler.get_comm_cost = self.get_comm_cost

    def cached(self, worker: str | None = None, add=(), remove=(), **kwargs: Any) -> None:
        """``goblin-cached`` from volunteer ``worker`` (already validated by the stream guard)."""
        if worker is None or not self.admission.is_volunteer(worker) or worker not in self.scheduler.workers:
            return
        self.hints += 1
        held = self.held.setdefault(worker, set())
        held.difference_update(remove)
        for key in add:
            if len(held) >= MAX_HINT_KEYS:
                break
            held.add((sys.intern(key[0]), *key[1:]))  # honest volunteers name the same blocks: one name kept

    def remove_worker(self, scheduler, worker: str, **kwargs) -> None:
        self.held.pop(worker, None)

    def get_comm_cost(self, ts, ws) -> float:
        cost = self._get_comm_cost(ts, ws)
        held = self.held.get(ws.address)
        if held and cost > 0:
            saved = sum(dts.get_nbytes() for dts in ts.dependencies
                        if dts.key in held and ws not in (dts.who_has or ()))
            if saved:
                cost = max(0.0, cost - saved / self.scheduler.bandwidth)
        return cost
