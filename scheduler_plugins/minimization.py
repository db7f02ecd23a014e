"""Data minimization, enforced where tasks are placed, not left to convention.

What a volunteer receives with a task is its key, its dependencies' keys, its run_spec
(op name, operands, parameters) and its annotations.  For every task placed on a
volunteer this plugin requires opaque keys (``<op>-<hex token>`` plus block indices:
no user-given names), strips annotations, and admits only the string parameters the
catalog needs (einsum subscripts, canonical formulas, dtype names), each checked
against its grammar.  A task that would break a rule is refused with a clear error to
the researcher (it runs, on the lab worker, as a task that raises) instead of being sent.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from dask._task_spec import Task
from distributed.diagnostics.plugin import SchedulerPlugin

from goblin_dask.ops import catalog
from goblin_dask.ops.spec import CatalogTask
from goblin_dask.roles import LAB_RESOURCE, VOLUNTEER_RESOURCE
from scheduler_plugins.catalog_only import refused

logger = logging.getLogger("goblin_dask.minimization")

#: Fixed words the array layer appends to an opaque name for a task's intermediate parts
#: (``matmul-<token>-partial``, a reduction's ``-tree``/``-block``/``-root`` ...): code, never data.
KEY_SUFFIXES = ("partial", "tree", "block", "value", "index", "root")
_TOKEN = re.compile(r"^(?:unverified-)?(?P<prefix>[a-z][a-z0-9_]*)-[0-9a-f]{8,}"
                    rf"(?:-(?:{'|'.join(KEY_SUFFIXES)}))?$")
#: Key prefixes that name no data: catalog ops plus the array layer's plumbing.
PLUMBING_PREFIXES = frozenset({"array", "block", "source", "lab_block", "from_array", "rechunk", "chunk"})

#: Grammar of each string parameter a volunteer may receive.
STRING_PARAMS = {
    "subscripts": re.compile(r"^[a-zA-Z]*(,[a-zA-Z]*)*(->[a-zA-Z]*)?$"),
    "expr": re.compile(r"^[x0-9a-z_+\-*/%().,<>=!&|~ e]*$"),
    "dtype": re.compile(r"^(bool|u?int(8|16|32|64)|float(16|32|64)|complex(64|128))$"),
}


def key_violation(key: Any) -> str | None:
    """Why ``key`` may name data (user-given names), or None when it is opaque."""
    parts = key if isinstance(key, tuple) else (key,)
    name, indices = parts[0], parts[1:]
    match = _TOKEN.match(name) if isinstance(name, str) else None
    if match is None or not (match["prefix"] in catalog() or match["prefix"] in PLUMBING_PREFIXES):
        return f"key {name!r} is not an opaque '<operation>-<token>' key"
    if not all(isinstance(i, int) for i in indices):
        return f"key {key!r} has non-integer block indices"
    return None


def string_violation(spec: CatalogTask) -> str | None:
    for i, a in enumerate(spec.args):
        if isinstance(a, str):
            return f"operand {i} of {spec.func.name} is a string"
    for name, value in spec.kwargs.items():
        for v in _strings(value):
            grammar = STRING_PARAMS.get(name)
            if grammar is None or len(v) > 256 or not grammar.match(v):
                return f"parameter {name!r} of {spec.func.name} carries text {v[:40]!r}"
    return None


def _strings(value: Any):
    if isinstance(value, str):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _strings(v)


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
        for k in (ts.key, *(d.key for d in ts.dependencies)):
            if (why := key_violation(k)) is not None:
                return why
        if isinstance(spec, CatalogTask):
            return string_violation(spec)
        return None
