"""Graph passes for ga.Array: cull to the requested keys, insert the lab's checks, fuse lab-only chains."""

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


def _fusable(key: Any, node: Any) -> bool:
    """A task that may join a lab chain: a catalog task placed on the lab worker, under its own key.

    Not: volunteer tasks, their ``unverified-`` twins, the lab's checks (``accept``), source blocks
    (``lab_block`` / ``read_block``: the exposure plugin reads their ``lab_array=``), Aliases, data.
    """
    from goblin_dask.ops.spec import CatalogTask
    from goblin_dask.validation.checks import is_unverified_key

    return type(node) is CatalogTask and node.placement == "lab" and not is_unverified_key(key)


def fuse_lab_chains(dsk: Mapping, keys: Iterable) -> dict:
    """Fuse linear chains of lab-placed catalog tasks into single :class:`~goblin_dask.ops.spec.LabChain` tasks.

    A task joins the task that reads it when both are fusable (:func:`_fusable`), it is not
    among ``keys`` and that task is its only dependent; where a task could take several such
    predecessors it takes the first it reads (the others stay as they are): chains, not trees.
    The fused task keeps the key of the chain's last task; the chain's other keys leave the graph.
    """
    from goblin_dask.ops.spec import LabChain

    outputs = set(flatten(keys)) if isinstance(keys, list) else set(keys)
    dependents: dict = {}
    for k, node in dsk.items():
        if isinstance(node, GraphNode):
            for d in node.dependencies:
                if d in dsk:
                    dependents.setdefault(d, []).append(k)
    fusable = {k for k, node in dsk.items() if _fusable(k, node)}
    # prev[c] = the one predecessor c takes into its chain
    prev: dict = {}
    for k in fusable:
        if k in outputs:
            continue
        users = dependents.get(k, ())
        if len(users) != 1 or users[0] not in fusable:
            continue
        c = users[0]
        if c in prev:
            continue
        # deterministic: c's first dependency (in argument order) that qualifies
        candidates = [d for d in _ordered_deps(dsk[c])
                      if d in fusable and d not in outputs and dependents.get(d) == [c]]
        prev[c] = candidates[0]
    if not prev:
        return dict(dsk)
    taken = set(prev.values())  # tasks merged into a later one
    out: dict = {}
    for k, node in dsk.items():
        if k in taken:
            continue
        if k not in prev:
            out[k] = node
            continue
        chain = [k]
        while chain[-1] in prev:
            chain.append(prev[chain[-1]])
        out[k] = LabChain(k, [dsk[s] for s in reversed(chain)])
    return out


def _ordered_deps(node: GraphNode) -> list:
    """``node``'s dependencies in the order its arguments name them."""
    from dask._task_spec import TaskRef

    seen: dict = {}

    def walk(a: Any) -> None:
        if isinstance(a, TaskRef):
            seen.setdefault(a.key, None)
        elif isinstance(a, GraphNode):
            for sub in (*getattr(a, "args", ()), *getattr(a, "kwargs", {}).values()):
                walk(sub)
            for d in sorted(a.dependencies, key=repr):  # whatever the walk did not name
                seen.setdefault(d, None)
        elif isinstance(a, (tuple, list)):
            for sub in a:
                walk(sub)
        elif isinstance(a, dict):
            for sub in a.values():
                walk(sub)

    for a in (*node.args, *node.kwargs.values()):
        walk(a)
    for d in sorted(node.dependencies, key=repr):
        seen.setdefault(d, None)
    return [d for d in seen if d in node.dependencies]


def optimize(dsk: Mapping, keys: Any) -> dict:
    """ga.Array's ``__dask_optimize__``: cull, put a lab-side check after every volunteer task, then
    fuse the chains of lab-only tasks (``goblin.graph.fuse-lab-chains``, default on)."""
    from goblin_dask import settings
    from goblin_dask.array.sources import resolve_local
    from goblin_dask.validation.checks import insert_checks

    flat = list(flatten(keys)) if isinstance(keys, list) else list(keys)
    dsk = insert_checks(resolve_local(cull(dict(dsk), flat)), flat)
    if settings.get("goblin.graph.fuse-lab-chains"):
        dsk = fuse_lab_chains(dsk, flat)
    return dsk
