"""Graph passes for ga.Array: cull to the requested keys, then insert the lab's checks."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from dask._task_spec import GraphNode
from dask.core import flatten


def cull(dsk: Mapping, keys: Iterable) -> dict:
    """Only the tasks ``keys`` need (values that are not GraphNodes, e.g. Futures, are leaves)."""
    out: dict = {}
    stack = [k for k in keys if k in dsk]
    while stack:
        key = stack.pop()
        if key in out:
            continue
        node = dsk[key]
        out[key] = node
        if isinstance(node, GraphNode):
            stack.extend(d for d in node.dependencies if d in dsk and d not in out)
    return out


def optimize(dsk: Mapping, keys: Any) -> dict:
    """ga.Array's ``__dask_optimize__``: cull, then put a lab-side check after every volunteer task."""
    from goblin_dask.array.sources import resolve_local
    from goblin_dask.validation.checks import insert_checks

    flat = list(flatten(keys)) if isinstance(keys, list) else list(keys)
    return insert_checks(resolve_local(cull(dict(dsk), flat)), flat)
