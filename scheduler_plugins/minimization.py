"""Data minimization, enforced where tasks are placed, not left to convention.

What a volunteer receives with a task is its key, its dependencies' keys, its run_spec
(op name, operands, parameters) and its annotations.  For every task placed on a
volunteer this plugin requires opaque keys (``<op>-<hex token>`` plus block indices:
no user-given names; exactly the shapes :mod:`goblin_dask.array.keys` makes), strips annotations, and admits only the string parameters the
catalog needs (einsum subscripts, canonical formulas, dtype names), each checked
against its grammar.  A task that would break a rule is refused with a clear error to
the researcher (it runs, on the lab worker, as a task that raises) instead of being sent.
"""

from __future__ import annotations

import logging
from typing import Any

from dask._task_spec import Task
from distributed.diagnostics.plugin import SchedulerPlugin

from goblin_dask.array import keys
from goblin_dask.ops import catalog
from goblin_dask.ops.registry import text_violation
from goblin_dask.ops.spec import CatalogTask, LabChain
from goblin_dask.validation.checks import UNVERIFIED_PREFIX
from goblin_dask.roles import LAB_RESOURCE, VOLUNTEER_RESOURCE
from scheduler_plugins.catalog_only import refused

logger = logging.getLogger("goblin_dask.minimization")

#: Key prefixes that name no data besides the catalog's ops: the array layer's plumbing
#: (its intermediate parts, ``-partial``, ``-tree`` ..., are ``keys.PARTS``: code, never data).
PLUMBING_PREFIXES = frozenset(keys.PLUMBING)


def key_violation(key: Any) -> str | None:
    """Why ``key`` may name data (user-given names), or None when it is opaque."""
    parts = key if isinstance(key, tuple) else (key,)
    name, indices = parts[0], parts[1:]
    bare = name[len(UNVERIFIED_PREFIX):] if isinstance(name, str) and name.startswith(UNVERIFIED_PREFIX) else name
    split = keys.split_name(bare)
    if split is None or not (split.prefix in catalog() or split.prefix in PLUMBING_PREFIXES):
        return f"key {name!r} is not an opaque '<operation>-<token>' key"
    if not all(isinstance(i, int) for i in indices):
        return f"key {key!r} has non-integer block indices"
    return None


def string_violation(spec: CatalogTask) -> str | None:
    """Why ``spec`` carries text a volunteer may not receive: text only in the op's declared
    ``text_params``, matching their grammars (the same rule the volunteer applies)."""
    for i, a in enumerate(spec.args):
        if isinstance(a, str):
            return f"operand {i} of {spec.func.name} is a string"
    for name, value in spec.kwargs.items():
        if (why := text_violation(spec.func, name, value)) is not None:
            return why
    return None


class MinimizationPlugin(SchedulerPlugin):
    name = "goblin-minimization"

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.refused: list[str] = []

    def update_graph(self, scheduler, *, tasks: list, **kwargs: Any) -> None:
        for key in tasks:
            ts = scheduler.tasks.get(key)
            if ts is None or ts.resource_restrictions != {VOLUNTEER_RESOURCE: 1}:
                continue
            why = self.violation(ts)
            if why is None:
                ts.annotations = {}
                continue
            message = f"refused to send task {ts.key!r} to a volunteer: {why} (data minimization)"
            logger.warning(message)
            self.refused.append(message)
            ts.run_spec = Task(ts.key, refused, message)
            ts.resource_restrictions = {LAB_RESOURCE: 1}

    def violation(self, ts) -> str | None:
        spec = ts.run_spec
        if isinstance(spec, LabChain):  # catalog_only never places one there; should anything else
            return "a fused chain of lab-only tasks runs on the lab worker only"
        for k in (ts.key, *(d.key for d in ts.dependencies)):
            if (why := key_violation(k)) is not None:
                return why
        if isinstance(spec, CatalogTask):
            return string_violation(spec)
        return None
