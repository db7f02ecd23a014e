"""Training runs on the lab's page: each finished round of a :class:`goblin_dask.training.Trainer`.

The Trainer (in the researcher's process) calls ``goblin_training_round`` after each round with
numbers only: an opaque run id it drew at random, the round, the batch's loss, the round's seconds
and the ledger's verification counts for the round.  No names, no model, no data: the lab's page
shows every run to whoever reaches the dashboard (``/goblin/api/status``'s ``training``).

Who may post: researchers, the lab admin and the lab's own processes (the handler is on the
researchers' allow-list, :data:`scheduler_plugins.admission.RESEARCHER_HANDLERS`); a volunteer may
not (it is not on :data:`~scheduler_plugins.admission.VOLUNTEER_HANDLERS`, and the handler checks the
caller's certificate again).  A run belongs to whoever posted its first round: another caller naming
the same id starts a run of its own, it never writes into someone else's.
"""

from __future__ import annotations

import math
import re
import secrets
import time
from collections import OrderedDict
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from goblin_dask.node import rpc
from goblin_dask.tls import peer_identity

#: Roles that may post a training round.
TRAINING_ROLES = frozenset({"researcher", "admin", "lab"})
#: Runs kept per owner (its least recently updated go first: one researcher's many runs never push out
#: another's; owners are the lab's credentials, so the board grows with those) and rounds kept per run
#: (the oldest go first).
RUNS_KEPT_PER_OWNER = 20
ROUNDS_KEPT = 2000
_RUN_ID = re.compile(r"[0-9a-f]{8,32}")
_COUNTS = ("tasks", "accepted", "rejected")


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"goblin_training_round: {what} must be a count, got {type(value).__name__}")
    return value


def _number(value: Any, what: str) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"goblin_training_round: {what} must be a number, got {type(value).__name__}")
    value = float(value)
    return value if math.isfinite(value) else None  # a diverged loss: shown as a gap (JSON has no NaN)


class TrainingRuns(SchedulerPlugin):
    """The latest training runs (numbers only), for ``/goblin/api/status``."""

    name = "goblin-training"

    def __init__(self, scheduler):
        self.scheduler = scheduler
        #: (role, name, run id) -> {"id", "started", "updated", "rounds": [{round, loss, seconds, accepted, ...}]}
        self.runs: OrderedDict[tuple, dict] = OrderedDict()
        scheduler.handlers[rpc.TRAINING_ROUND] = self.training_round_handler

    def training_round_handler(self, comm, run: Any = None, round: Any = None, loss: Any = None,
                               seconds: Any = None, verification: Any = None) -> dict:
        peer = peer_identity(comm)
        if peer is None or peer[0] not in TRAINING_ROLES:
            raise PermissionError("goblin lab node: only researchers and the lab post training rounds")
        return self.add_round(peer, run, round, loss, seconds, verification)

    def add_round(self, owner: tuple, run: Any, round: Any, loss: Any, seconds: Any, verification: Any) -> dict:
        if not isinstance(run, str) or not _RUN_ID.fullmatch(run):
            raise ValueError("goblin_training_round: run must be an opaque id (8-32 hex digits)")
        entry = {"round": _count(round, "round"), "loss": _number(loss, "loss"),
                 "seconds": _number(seconds, "seconds")}
        if entry["seconds"] is not None and entry["seconds"] < 0:
            raise ValueError("goblin_training_round: seconds must not be negative")
        verification = verification or {}
        if not isinstance(verification, dict):
            raise ValueError("goblin_training_round: verification must be a mapping of counts")
        entry.update({k: _count(verification.get(k, 0), k) for k in _COUNTS})
        key = (*owner, run)
        now = time.time()
        record = self.runs.pop(key, None)
        if record is None:
            ids = {r["id"] for r in self.runs.values()}
            shown = secrets.token_hex(4)  # the page's id: the lab's own draw (two owners' same id stay two runs)
            while shown in ids:
                shown = secrets.token_hex(4)
            record = {"id": shown, "started": now, "rounds": []}
        record["updated"] = now
        record["rounds"].append(entry)
        del record["rounds"][:-ROUNDS_KEPT]
        self.runs[key] = record
        owned = [k for k in self.runs if k[:-1] == tuple(owner)]  # least recently updated first
        for stale in owned[:-RUNS_KEPT_PER_OWNER]:
            del self.runs[stale]
        return {"run": record["id"], "rounds": len(record["rounds"])}

    def status(self) -> dict:
        """What the lab's page shows: each run, most recently updated last."""
        runs = []
        for record in self.runs.values():
            rounds = record["rounds"]
            last = rounds[-1]
            runs.append({"id": record["id"], "started": record["started"], "updated": record["updated"],
                         "round": last["round"], "loss": last["loss"], "seconds": last["seconds"],
                         "accepted": sum(r["accepted"] for r in rounds),
                         "rejected": sum(r["rejected"] for r in rounds),
                         "history": [[r["round"], r["loss"], r["seconds"], r["accepted"], r["rejected"]]
                                     for r in rounds]})
        return {"runs": runs}
