"""Cumulative ops (scans): ``cumsum`` and ``cumprod`` along one axis of a block.

A blocked scan (:mod:`goblin_dask.array.scan`) runs the op on every block and adds
(multiplies) the running total of the previous blocks, so each task is one block's scan
or one elementwise ``add``/``multiply``.  A second volunteer can recompute a block's scan
as cheaply as the first (O(block)), so the ops are verified by :class:`Replica` (exact
for integers, within rounding for floats) and may run on volunteers.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from goblin_dask.ops._factories import check_dtype, matrices, normalize_axes
from goblin_dask.ops.registry import register
from goblin_dask.ops.spec import Aval, OpSpec, Replica, elementwise_cost


def _axis(opname: str, x: Aval, axis: Any) -> int:
    if len(x.shape) == 0:
        raise ValueError(f"{opname}: needs an array of at least one axis, got shape ()")
    return normalize_axes(opname, axis, x.shape)[0]


def _scan_op(name: str, doc: str, kernel: Callable, grad: Any) -> OpSpec:
    def shape_rule(x: Aval, *, axis: int) -> tuple[int, ...]:
        _axis(name, x, axis)
        return x.shape

    def dtype_rule(x: Aval, *, axis: int) -> np.dtype:
        return kernel(np.zeros(1, check_dtype(name, x.dtype))).dtype

    def run(x: Any, *, axis: int) -> Any:
        return kernel(x, axis=_axis(name, Aval.of(x), axis))

    return register(
        OpSpec(
            name=name, doc=doc, shape_rule=shape_rule, dtype_rule=dtype_rule, numpy=run,
            cost=elementwise_cost, verify=Replica(), grad=grad, arity=1, params=("axis",),
            examples=lambda n, rng, dt: [((matrices(n, rng, dt, 1)[0],), {"axis": 0}),
                                         ((matrices(n, rng, dt, 1)[0],), {"axis": -1})],
        )  # fmt: skip
    )


def _cumsum_vjp(g: Any, x: Any, *, axis: int) -> tuple:
    ax = _axis("cumsum", Aval.of(x), axis)
    return (np.flip(np.cumsum(np.flip(g, ax), axis=ax), ax),)


cumsum = _scan_op("cumsum", "Cumulative sum along an axis (np.cumsum).", np.cumsum, _cumsum_vjp)
cumprod = _scan_op("cumprod", "Cumulative product along an axis (np.cumprod).", np.cumprod, None)
