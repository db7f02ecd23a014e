"""Placement prefers the volunteer that already holds a task's inputs.

A volunteer keeps the lab's input blocks it received (:mod:`goblin_dask.volunteer.panel_cache`) and says
which on its worker stream (``goblin-cached``: keys added, keys removed; validated by
:mod:`scheduler_plugins.stream_guard`, which bans a volunteer sending a malformed one).  The
scheduler does not list the volunteer among the keys' holders (a volunteer is no source of the
lab's data: nobody fetches from it); it only lowers that volunteer's estimated transfer cost for a
task reading those keys (``Scheduler.get_comm_cost``, which ``worker_objective`` and work stealing
use), so distributed's own choice (earliest start: queue plus transfer) picks it while it is not
busier than the transfer it saves.

The hint is untrusted and costs a liar nothing but itself: only keys of the lab's data blocks that the
lab sent that volunteer (inputs of tasks it was given, the latest :data:`SENT_KEPT`) are believed, at most
:data:`~goblin_dask.volunteer.panel_cache.MAX_HINT_KEYS` of them; the rest are counted and ignored.  Before,
a volunteer could name blocks it never received (their names follow from one task's) and look cheapest for
every task reading them, then sit on those tasks until their deadlines (issue 29).  A volunteer that holds
what it was sent and stalls is the per-task deadline's (:mod:`scheduler_plugins.verification`); one that
computes wrong is rejected (every result is checked against the lab's own copy).  Cost per placement
decision: a set lookup per input of the task, per candidate; per task sent to a volunteer, one per input.

The volunteer also keeps the other inputs the lab sent it (results the lab accepted: a stage's input, which its
backward stage reads again after the later stages ran) while the lab holds them.  Those need no hint: this plugin
believes what it sent, for as long as the key stays in memory, and when the key leaves memory it tells each
volunteer it sent the key to (``free-keys``, on the worker stream, ahead of any later task that could read a
new value of the key): a kept copy of an earlier value would differ from the lab's by rounding.  So a stage's
backward goes to a volunteer that ran its forward, and the stage's input crosses to it once.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from goblin_dask.volunteer.panel_cache import HINT_OP, MAX_HINT_KEYS, cacheable_key

logger = logging.getLogger("goblin_dask.volunteer_cache")

#: Lab data blocks remembered per volunteer as sent to it (the latest first kept): what its hints may name.
SENT_KEPT = 4 * MAX_HINT_KEYS


class VolunteerCachePlugin(SchedulerPlugin):
    name = "goblin-volunteer-cache"

    def __init__(self, scheduler, admission):
        self.scheduler = scheduler
        self.admission = admission
        #: volunteer address -> keys it says it holds (at most MAX_HINT_KEYS, each one the lab sent it)
        self.held: dict[str, set] = {}
        #: volunteer name -> lab data blocks the lab sent it (inputs of its tasks; the latest SENT_KEPT)
        self.sent: dict[str, OrderedDict] = {}
        #: volunteer name -> keys its hints named that the lab never sent it (ignored)
        self.unsent: dict[str, int] = {}
        self.hints = 0
        #: key in memory -> volunteer addresses it was sent to (as a task's input; lab data blocks aside)
        self.lent: dict[Any, set] = {}
        scheduler.stream_handlers[HINT_OP] = self.cached
        self._get_comm_cost = scheduler.get_comm_cost
        scheduler.get_comm_cost = self.get_comm_cost

    def cached(self, worker: str | None = None, add=(), remove=(), **kwargs: Any) -> None:
        """``goblin-cached`` from volunteer ``worker`` (already validated by the stream guard)."""
        if worker is None or not self.admission.is_volunteer(worker) or worker not in self.scheduler.workers:
            return
        self.hints += 1
        held = self.held.setdefault(worker, set())
        held.difference_update(tuple(k) for k in remove)
        name = self.admission.names.get(worker, worker)
        sent = self.sent.get(name, {})
        for key in add:
            key = (sys.intern(key[0]), *key[1:])  # honest volunteers name the same blocks: one name kept
            if key not in sent:
                self.unsent[name] = self.unsent.get(name, 0) + 1
            elif len(held) < MAX_HINT_KEYS:
                held.add(key)

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        """A task going to a volunteer: its inputs are sent to it.  A key leaving memory: the volunteers it was
        sent to let their copies go."""
        if start == "memory" and key in self.lent:
            self._let_go(key)
        if finish != "processing":
            return
        ts = self.scheduler.tasks.get(key)
        ws = ts.processing_on if ts is not None else None
        if ws is None or not self.admission.is_volunteer(ws.address):
            return
        name = self.admission.names.get(ws.address, ws.address)
        sent = self.sent.get(name)
        for dts in ts.dependencies:
            if cacheable_key(dts.key):
                if sent is None:
                    sent = self.sent[name] = OrderedDict()
                sent[dts.key] = None
                sent.move_to_end(dts.key)
                if len(sent) > SENT_KEPT:
                    sent.popitem(last=False)
            elif dts.state == "memory":
                self.lent.setdefault(dts.key, set()).add(ws.address)

    def report(self) -> dict[str, dict[str, int]]:
        """``{volunteer: {"believed": keys counted as held now, "unsent": keys named that it was never sent}}``."""
        names = {n for n in self.unsent} | {self.admission.names.get(a, a) for a in self.held}
        believed: dict[str, int] = {}
        for addr, held in self.held.items():
            name = self.admission.names.get(addr, addr)
            believed[name] = believed.get(name, 0) + len(held)
        return {n: {"believed": believed.get(n, 0), "unsent": self.unsent.get(n, 0)} for n in sorted(names)}

    def _let_go(self, key) -> None:
        stimulus = f"goblin-lab-released-{time.time()}"
        for address in self.lent.pop(key):
            comm = self.scheduler.stream_comms.get(address)
            if comm is not None:
                comm.send({"op": "free-keys", "keys": [key], "stimulus_id": stimulus})

    def remove_worker(self, scheduler, worker: str, **kwargs) -> None:
        self.held.pop(worker, None)
        for key, holders in list(self.lent.items()):  # (a volunteer leaving is rare beside placements)
            holders.discard(worker)
            if not holders:
                del self.lent[key]

    def get_comm_cost(self, ts, ws) -> float:
        cost = self._get_comm_cost(ts, ws)
        held = self.held.get(ws.address, ())
        if (held or self.lent) and cost > 0:
            saved = sum(dts.get_nbytes() for dts in ts.dependencies
                        if (dts.key in held or ws.address in self.lent.get(dts.key, ()))
                        and ws not in (dts.who_has or ()))
            if saved:
                cost = max(0.0, cost - saved / self.scheduler.bandwidth)
        return cost
