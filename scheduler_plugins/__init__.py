"""Dask scheduler plugins that turn a scheduler into a goblin lab node.

Use as ``dask scheduler --preload scheduler_plugins`` (state directory from the
``GOBLIN_STATE_DIR`` environment variable or dask config ``goblin.state-dir``), or
call :func:`install` on a Scheduler before it starts.
"""

from __future__ import annotations

import os

from goblin_dask import settings
from goblin_dask.credentials import LabKeys
from scheduler_plugins.admission import AdmissionPlugin
from scheduler_plugins.catalog_only import CatalogOnlyPlugin
from scheduler_plugins.dashboard_guard import install_dashboard_guard
from scheduler_plugins.http import install_routes
from scheduler_plugins.exposure import ExposurePlugin
from scheduler_plugins.faults import FaultPlugin
from scheduler_plugins.held_tasks import HeldTasksPlugin, max_held_per_volunteer
from scheduler_plugins.minimization import MinimizationPlugin
from scheduler_plugins.signin import install_signin
from scheduler_plugins.stream_guard import StreamGuardPlugin
from scheduler_plugins.researcher_keys import ResearcherKeysPlugin
from scheduler_plugins.training import TrainingRuns
from scheduler_plugins.verification import VerificationLedger
from scheduler_plugins.volunteer_cache import VolunteerCachePlugin


def install(scheduler, state_dir: str | os.PathLike) -> dict:
    """Add the goblin plugins to ``scheduler``; returns them by name."""
    if "goblin-admission" in scheduler.plugins:
        return {n: p for n, p in scheduler.plugins.items() if n.startswith("goblin-")}
    keys = LabKeys(state_dir)
    admission = AdmissionPlugin(scheduler, keys)
    stream_guard = StreamGuardPlugin(scheduler, admission)  # what volunteers may say on their worker stream
    catalog_only = CatalogOnlyPlugin(scheduler, admission)
    minimization = MinimizationPlugin(scheduler)  # after placement: it judges what volunteers get
    ledger = VerificationLedger(scheduler, admission, max_rejections=int(settings.get("goblin.max-rejections")),
                                state_dir=state_dir)  # the volunteers' credit is kept there
    exposure = ExposurePlugin(scheduler, admission)  # after the ledger: it places replicas first
    faults = FaultPlugin(scheduler, admission, ledger)  # last: it reschedules what volunteers failed
    # after faults: it leaves full volunteers out of its valid_workers (none with the setting at 0: no cap)
    held = HeldTasksPlugin(scheduler, admission) if max_held_per_volunteer() else None
    training = TrainingRuns(scheduler)  # researchers' training rounds, for the lab's page
    cache = VolunteerCachePlugin(scheduler, admission)  # placement prefers volunteers holding a task's inputs
    researcher_keys = ResearcherKeysPlugin(scheduler)  # after catalog_only (it wraps scatter): each sees its own
    no_replicas(scheduler)
    plugins = tuple(p for p in (admission, stream_guard, catalog_only, minimization, ledger, exposure, faults, held,
                                training, cache, researcher_keys) if p is not None)
    for plugin in plugins:
        scheduler.add_plugin(plugin, name=plugin.name)
    install_routes(scheduler, ledger)
    if "dashboard" in scheduler.services:  # researcher sign-in pages, on the dashboard port only
        install_dashboard_guard(scheduler, install_signin(scheduler, state_dir))  # the guard: after every route
    admission.authorize_handlers()  # last: it wraps the handlers the others installed
    return {p.name: p for p in plugins}


def no_replicas(scheduler) -> None:
    """Nothing copies the lab's data around: the lab worker holds the only verified copy.

    distributed's active memory manager would drop replicas it judges redundant and ask
    workers (volunteers included) to acquire others; ``retire_workers`` moves a retiring
    worker's data onto the others (volunteers included).  Both are off on a lab node
    (``replicate`` and ``rebalance``: see :mod:`scheduler_plugins.catalog_only`).
    """
    amm = scheduler.extensions.get("amm")
    if amm is not None:
        amm.stop()
        del scheduler.extensions["amm"]

    def refused(op: str, why: str):
        def handler(*args, **kwargs):
            raise PermissionError(f"goblin lab node refuses '{op}': {why}")

        return handler

    scheduler.handlers["amm_handler"] = refused("amm_handler", "the active memory manager is off on a lab node")
    scheduler.handlers["retire_workers"] = refused(
        "retire_workers", "it copies a worker's data onto other workers, volunteers included (use goblin revoke)")


def dask_setup(scheduler) -> None:
    state_dir = os.environ.get("GOBLIN_STATE_DIR") or settings.get("goblin.state-dir")
    if not state_dir:
        raise RuntimeError("goblin scheduler plugins need a state directory: set GOBLIN_STATE_DIR")
    install(scheduler, state_dir)
