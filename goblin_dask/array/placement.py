"""Where a catalog task runs: on a volunteer, or on the trusted lab worker.

Every volunteer result is checked on the lab worker before anything uses it, and every
byte a volunteer needs travels from the lab (over TLS) and back.  A task is worth
sending out only when computing it costs the lab more than checking it and shipping it.
The rule, per task (block), from the op's declared cost and verification method:

* ``Freivalds`` (products): checking is O(n^2) against O(n^3) to compute: volunteer,
  once the task has at least ``min_flops`` of work (``goblin.placement.min-flops``,
  default 1e6; below that the round trip costs more than the product) and enough flops per
  element of its operands and result (``goblin.placement.min-product-intensity``, default
  64 for float64, twice that for float32 whose products run twice as fast).  A check reads
  every element of A, B and C (in float64), so a product with a short inner axis (attention
  scores of 64-wide heads: 64 flops per element) costs the lab more to check than to compute:
  measured, a check takes about ``150 / (flops per element)`` of a float32 product's time.
* ``Recompute()`` / ``Exact()``: checking *is* computing it again, so these ops are
  declared lab-only (layout, creation, selections, comparisons).
* ``Replica()``: two volunteers compute, the lab only compares.  Worth it when the task
  ships nothing (random blocks generated from a seed), or when it is compute-dense:
  ``flops / bytes moved >= min_intensity`` (``goblin.placement.min-intensity``, default
  4 flops per byte: on this class of machine the lab spends about as much CPU shipping a
  byte over TLS as computing a few scalar flops) and ``flops >= min_flops``.  Plain
  elementwise arithmetic (well under 1 flop per byte) stays on the lab worker.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Iterable, Mapping

from goblin_dask import settings
from goblin_dask.ops.spec import Aval, CatalogTask, Freivalds, LabChain, OpSpec

logger = logging.getLogger("goblin_dask.placement")

#: Why a task stays on the lab worker, each with the setting that would send it out (None: none would).
#: The researcher's side decides the first four when it builds the graph (:func:`placement_reason`);
#: the lab node's exposure plugin the next three when the graph arrives (``scheduler_plugins.exposure``).
KEPT_AT_LAB: dict[str, str | None] = {
    "lab-only": None,  # checked by recomputing it (Recompute, Exact): sending it out saves the lab nothing
    "min-flops": "goblin.placement.min-flops",
    "min-product-intensity": "goblin.placement.min-product-intensity",
    "min-intensity": "goblin.placement.min-intensity",
    "max-share": "goblin.minimization.max-share",
    "max-exposure": "goblin.minimization.max-exposure",
    "invalid-source": None,  # reads a block naming no valid lab array
    "other": None,  # a catalog task the graph left without a lab check (never sent out unchecked)
}


def placement_reason(op: OpSpec, *operands: Any, **params: Any) -> tuple[str, str | None]:
    """``("volunteer", None)``, or ``("lab", why)`` with ``why`` a key of :data:`KEPT_AT_LAB`, for one
    task of ``op`` on ``operands`` (Avals or scalars)."""
    if op.placement == "lab":  # Recompute() and Exact(): checking it is computing it again
        return "lab", "lab-only"
    min_flops = float(settings.get("goblin.placement.min-flops"))
    min_intensity = float(settings.get("goblin.placement.min-intensity"))
    cost = op.cost_of(*operands, **params)
    avals = [Aval.of(o) for o in operands]
    if isinstance(op.verify, Freivalds):
        itemsize = max((a.dtype.itemsize for a in avals if not a.weak), default=8)
        per_element = cost.flops / max(cost.bytes / itemsize, 1.0)
        wanted = float(settings.get("goblin.placement.min-product-intensity")) * 8 / itemsize
        if cost.flops < min_flops:
            return "lab", "min-flops"
        return ("volunteer", None) if per_element >= wanted else ("lab", "min-product-intensity")
    shipped = sum(a.nbytes for a in avals if not a.weak)
    if shipped == 0 and op.arity == 0:
        return "volunteer", None
    if cost.flops < min_flops:
        return "lab", "min-flops"
    return ("volunteer", None) if cost.intensity >= min_intensity else ("lab", "min-intensity")


def placement_for(op: OpSpec, *operands: Any, **params: Any) -> str:
    """"volunteer" or "lab" for one task of ``op`` on ``operands`` (Avals or scalars)."""
    return placement_reason(op, *operands, **params)[0]


#: The settings a researcher's process has already warned about (later computations say it at INFO).
_WARNED: set[frozenset] = set()


def kept_at_lab(dsk: Mapping, keys: Iterable | None = None) -> tuple[int, Counter]:
    """``(tasks sent to volunteers, {why: tasks kept at the lab})`` among the catalog tasks of ``dsk`` that
    ``keys`` need (all of them when ``keys`` is None), as the researcher's side placed them."""
    if hasattr(dsk, "to_dict"):  # a HighLevelGraph: one dict, not a walk of its layers per key
        dsk = dsk.to_dict()
    if keys is not None:
        from dask.core import flatten

        from goblin_dask.array.graph import cull

        dsk = cull(dsk, list(flatten(keys)))
    sent, kept = 0, Counter()
    for node in dsk.values():
        for step in node.steps if isinstance(node, LabChain) else (node,):
            if isinstance(step, CatalogTask):
                if step.placement == "volunteer":
                    sent += 1
                else:
                    kept[step.why or "other"] += 1
    return sent, kept


def say_where(dsk: Mapping, keys: Iterable | None = None) -> None:
    """Once per computation, in the researcher's process: when none of its catalog tasks goes to a volunteer,
    say so, why, and the setting that would send them out (a WARNING the first time, INFO after).

    Only the researcher's side of placement is known here; the lab node may also keep a task a volunteer would
    get (``max-share``, ``max-exposure``): ``report()["placement"]`` counts both."""
    sent, kept = kept_at_lab(dsk, keys)
    if sent or not kept:
        return
    parts, settings_named = [], []
    for why, n in kept.most_common():
        setting = KEPT_AT_LAB.get(why)
        if setting is not None:
            settings_named.append(setting)
            parts.append(f"{n} below {setting} = {settings.get(setting):g}")
        elif why == "lab-only":
            parts.append(f"{n} lab-only (checked by computing them again)")
        else:
            parts.append(f"{n} {why}")
    total = sum(kept.values())
    message = (f"goblin: all {total} catalog task(s) of this computation run on the lab worker, none on "
               f"volunteers: {', '.join(parts)}.")
    if settings_named:
        message += (f" Larger blocks (chunks=...), or a lower {' / '.join(settings_named)}, would send them out; "
                    "below these the lab computes them faster than it could check and ship them.")
    key = frozenset(settings_named)
    level = logging.WARNING if settings_named and key not in _WARNED else logging.INFO
    _WARNED.add(key)
    logger.log(level, message)


def say_where_submitted(expr: Any) -> None:
    """:func:`say_where` for what a distributed Client submits (``Client._graph_to_futures``'s expression): its
    graphs are the ``HLGExpr`` s in it, each culled to its own output keys (a whole graph when it names none)."""
    from dask._expr import HLGExpr

    graphs, keys = {}, []
    for node in expr.walk():
        if isinstance(node, HLGExpr):
            hlg = node.hlg
            graphs.update(hlg.to_dict() if hasattr(hlg, "to_dict") else hlg)
            out = node.output_keys
            keys.extend(out if out is not None else hlg.keys())
    if graphs:
        say_where(graphs, keys)


def watch(client: Any) -> Any:
    """Make ``client`` (a researcher's, to a lab node) say in this process, once per computation it submits,
    when none of the computation's tasks goes to a volunteer (:func:`say_where`).  Returns ``client``."""
    submit = client._graph_to_futures
    if getattr(submit, "_goblin_watched", False):
        return client

    def graph_to_futures(expr, keys, *args, **kwargs):
        try:
            say_where_submitted(expr)
        except Exception:  # a log line never stops a computation
            logger.debug("could not tell where a computation's tasks run", exc_info=True)
        return submit(expr, keys, *args, **kwargs)

    graph_to_futures._goblin_watched = True
    client._graph_to_futures = graph_to_futures
    return client
