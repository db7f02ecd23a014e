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

from typing import Any

from goblin_dask import settings
from goblin_dask.ops.spec import Aval, Freivalds, OpSpec

def placement_for(op: OpSpec, *operands: Any, **params: Any) -> str:
    """"volunteer" or "lab" for one task of ``op`` on ``operands`` (Avals or scalars)."""
    if op.placement == "lab":  # Recompute() and Exact(): checking it is computing it again
        return "lab"
    min_flops = float(settings.get("goblin.placement.min-flops"))
    min_intensity = float(settings.get("goblin.placement.min-intensity"))
    cost = op.cost_of(*operands, **params)
    avals = [Aval.of(o) for o in operands]
    if isinstance(op.verify, Freivalds):
        itemsize = max((a.dtype.itemsize for a in avals if not a.weak), default=8)
        per_element = cost.flops / max(cost.bytes / itemsize, 1.0)
        wanted = float(settings.get("goblin.placement.min-product-intensity")) * 8 / itemsize
        return "volunteer" if cost.flops >= min_flops and per_element >= wanted else "lab"
    shipped = sum(a.nbytes for a in avals if not a.weak)
    if shipped == 0 and op.arity == 0:
        return "volunteer"
    return "volunteer" if cost.flops >= min_flops and cost.intensity >= min_intensity else "lab"
