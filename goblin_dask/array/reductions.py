"""Reductions over axes, as trees of catalog partials and pairwise combines.

Each block is reduced with ``keepdims=True``; partials of one output block are then
combined pairwise (a balanced tree, so depth grows like log2 of the block count and no
task holds more than two partials).  See :mod:`goblin_dask.ops.reductions`.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from goblin_dask.array.core import Array, asarray, astype, catalog_task, elementwise, from_graph, new_name, offsets_of
from goblin_dask.ops import get
from goblin_dask.ops.reductions import moments_dtype, reduce_axes
from goblin_dask.ops.spec import Aval

_COMBINE = {"sum": "add", "prod": "multiply", "max": "maximum", "min": "minimum", "any": "logical_or", "all": "logical_and"}


def _check_out(out: Any, where: Any = True) -> None:
    if out is not None:
        raise TypeError("ga reductions do not write into out=; use the returned array")
    if where is not True:
        raise TypeError("ga reductions do not take where=; mask with ga.where first")


def _grouped(x: Array, axes: tuple[int, ...]) -> dict[tuple, list[tuple]]:
    """Output block index (reduced axes set to 0) -> input block indices, in C order."""
    groups: dict[tuple, list[tuple]] = {}
    for idx in x.block_indices():
        groups.setdefault(tuple(0 if d in axes else i for d, i in enumerate(idx)), []).append(idx)
    return groups


def _tree(layer: dict, name: str, out_idx: tuple, parts: list, combine: Callable[[Any, Any, Any], Any]) -> Any:
    """Combine ``parts`` pairwise; the root gets key ``(name, *out_idx)``."""
    level = 0
    while len(parts) > 1:
        merged = []
        for p in range(0, len(parts) - 1, 2):
            last = len(parts) == 2
            key = (name, *out_idx) if last else (f"{name}-tree", level, p, *out_idx)
            merged.append(combine(key, parts[p], parts[p + 1]))
        if len(parts) % 2:
            merged.append(parts[-1])
        parts, level = merged, level + 1
    return parts[0]


def _finish(x: Array, name: str, layer: dict, roots: dict, axes: tuple, keepdims: bool, dtype) -> Array:
    """Array of the tree roots; squeezed when not keepdims."""
    from dask._task_spec import Alias

    chunks = tuple((1,) if d in axes else c for d, c in enumerate(x.chunks))
    for out_idx, root in roots.items():
        key = (name, *out_idx)
        if root.key != key:
            layer[key] = Alias(key, root.key)
    out = from_graph(name, layer, chunks, dtype, dependencies=[x])
    if not keepdims:
        from goblin_dask.array.layout import squeeze

        out = squeeze(out, axes) if axes else out
    return out


def _simple(opname: str, x: Any, axis: Any, keepdims: bool, dtype: Any = None) -> Array:
    x = asarray(x)
    params = {"dtype": np.dtype(dtype).name} if dtype is not None and opname in ("sum", "prod") else {}
    out = get(opname).abstract_eval(x.aval, axis=axis, keepdims=keepdims, **params)  # errors before dispatch
    axes = reduce_axes(opname, x.aval, axis)
    name = new_name(opname, x.name, axes, keepdims, params)
    layer, roots = {}, {}
    combine_op = _COMBINE[opname]
    for out_idx, members in _grouped(x, axes).items():
        parts = []
        for idx in members:
            key = (f"{name}-block", *idx) if len(members) > 1 else (name, *out_idx)
            layer[key] = catalog_task(key, opname, x.ref(idx), avals=[x.block_aval(idx)], axis=axes, keepdims=True, **params)
            parts.append(layer[key])
        shape = tuple(1 if d in axes else n for d, n in enumerate(x.block_aval(members[0]).shape))
        part_aval = Aval(shape, out.dtype)

        def combine(key, a, b):
            layer[key] = catalog_task(key, combine_op, _r(a), _r(b), avals=[part_aval, part_aval])
            return layer[key]

        roots[out_idx] = _tree(layer, name, out_idx, parts, combine)
    return _finish(x, name, layer, roots, axes, keepdims, out.dtype)


def _r(node):
    from dask._task_spec import TaskRef

    return TaskRef(node.key)


def sum(x, axis=None, dtype=None, out=None, keepdims=False, where=True, **kwargs):
    """Sum over axes (NumPy's result dtype: int64 for booleans and small ints)."""
    _check_out(out, where)
    return _simple("sum", x, axis, keepdims, dtype)


def prod(x, axis=None, dtype=None, out=None, keepdims=False, where=True, **kwargs):
    """Product over axes."""
    _check_out(out, where)
    return _simple("prod", x, axis, keepdims, dtype)


def max(x, axis=None, out=None, keepdims=False, where=True, **kwargs):
    """Largest value over axes (NaN propagates)."""
    _check_out(out, where)
    return _simple("max", x, axis, keepdims)


def min(x, axis=None, out=None, keepdims=False, where=True, **kwargs):
    """Smallest value over axes (NaN propagates)."""
    _check_out(out, where)
    return _simple("min", x, axis, keepdims)


def any(x, axis=None, out=None, keepdims=False, where=True, **kwargs):
    """Whether any value over the axes is nonzero."""
    _check_out(out, where)
    return _simple("any", x, axis, keepdims)


def all(x, axis=None, out=None, keepdims=False, where=True, **kwargs):
    """Whether every value over the axes is nonzero."""
    _check_out(out, where)
    return _simple("all", x, axis, keepdims)


def _count(x: Array, axis: Any) -> int:
    return math.prod(x.shape[d] for d in reduce_axes("mean", x.aval, axis))


def mean(x, axis=None, dtype=None, out=None, keepdims=False, where=True, **kwargs):
    """Arithmetic mean (float64 for integer and boolean input, as NumPy)."""
    _check_out(out, where)
    x = asarray(x)
    acc = dtype or (None if x.dtype.kind in "fc" else np.float64)
    n = _count(x, axis)
    s = _simple("sum", x, axis, keepdims, acc)
    return elementwise("divide", s, float(n) if n else float("nan"))


def _arg(kind: str, x: Any, axis: Any, keepdims: bool) -> Array:
    x = asarray(x)
    opname = f"arg{kind}"
    out = get(opname).abstract_eval(x.aval, axis=axis, keepdims=keepdims)
    axes = tuple(range(x.ndim)) if axis is None else reduce_axes(opname, x.aval, axis)
    name = new_name(opname, x.name, axis, keepdims)
    layer, roots = {}, {}
    offs = [offsets_of(c) for c in x.chunks]
    for out_idx, members in _grouped(x, axes).items():
        parts = []
        for idx in members:
            block = x.block_aval(idx)
            origin = tuple(o[i] for o, i in zip(offs, idx))
            vkey, ikey = (f"{name}-value", *idx), (f"{name}-index", *idx)
            if len(members) == 1:
                ikey = (name, *out_idx)
            layer[vkey] = catalog_task(vkey, kind, x.ref(idx), avals=[block], axis=axes, keepdims=True)
            layer[ikey] = catalog_task(ikey, f"{opname}_partial", x.ref(idx), avals=[block],
                                       axis=None if axis is None else axes[0], offsets=origin, shape=x.shape)
            parts.append((layer[vkey], layer[ikey]))
        shape = tuple(1 for _ in range(x.ndim)) if axis is None else tuple(
            1 if d in axes else n for d, n in enumerate(x.block_aval(members[0]).shape))
        vals, idxs = Aval(shape, x.dtype), Aval(shape, np.dtype(np.int64))

        def combine(key, a, b):
            (va, ia), (vb, ib) = a, b
            vkey = (f"{key[0]}-v", *key[1:])
            layer[vkey] = catalog_task(vkey, "maximum" if kind == "max" else "minimum", _r(va), _r(vb), avals=[vals, vals])
            layer[key] = catalog_task(key, f"{opname}_combine", _r(va), _r(ia), _r(vb), _r(ib), avals=[vals, idxs, vals, idxs])
            return (layer[vkey], layer[key])

        roots[out_idx] = _tree(layer, name, out_idx, parts, combine)[1]
    result = _finish(x, name, layer, roots, axes, True, np.int64)
    if axis is None:
        from goblin_dask.array.layout import reshape

        return reshape(result, (1,) * x.ndim if keepdims else ())
    if not keepdims:
        from goblin_dask.array.layout import squeeze

        result = squeeze(result, axes)
    assert result.shape == out.shape, (result.shape, out.shape)
    return result


def argmax(x, axis=None, out=None, keepdims=False, **kwargs):
    """Index of the largest value (first one; first NaN if any), flat when axis is None."""
    _check_out(out)
    return _arg("max", x, axis, keepdims)


def argmin(x, axis=None, out=None, keepdims=False, **kwargs):
    """Index of the smallest value (first one; first NaN if any), flat when axis is None."""
    _check_out(out)
    return _arg("min", x, axis, keepdims)


def var(x, axis=None, dtype=None, out=None, ddof=0, keepdims=False, where=True, **kwargs):
    """Variance (one pass of per-block moments merged pairwise: no global mean needed first)."""
    _check_out(out, where)
    x = asarray(x)
    if dtype is not None:
        x = astype(x, dtype)
    get("moments").abstract_eval(x.aval, axis=axis)
    axes = reduce_axes("var", x.aval, axis)
    mdt = moments_dtype(x.aval)
    name = new_name("moments", x.name, axes)
    layer, roots = {}, {}
    for out_idx, members in _grouped(x, axes).items():
        parts = []
        for idx in members:
            block = x.block_aval(idx)
            key = (f"{name}-block", *idx) if len(members) > 1 else (f"{name}-root", *out_idx)
            layer[key] = catalog_task(key, "moments", x.ref(idx), avals=[block], axis=axes)
            parts.append((layer[key], math.prod(block.shape[d] for d in axes)))
        pshape = (2,) + tuple(1 if d in axes else n for d, n in enumerate(x.block_aval(members[0]).shape))
        pav = Aval(pshape, mdt)

        def combine(key, a, b):
            (pa, na), (pb, nb) = a, b
            layer[key] = catalog_task(key, "moments_combine", _r(pa), _r(pb), avals=[pav, pav], n1=int(na), n2=int(nb))
            return (layer[key], na + nb)

        roots[out_idx] = _tree(layer, f"{name}-root", out_idx, parts, combine)[0]
    # moments blocks have a leading axis of 2: build that array, then take M2 and divide
    from dask._task_spec import Alias

    chunks = ((2,),) + tuple((1,) if d in axes else c for d, c in enumerate(x.chunks))
    for out_idx, root in roots.items():
        key = (name, 0, *out_idx)
        layer[key] = Alias(key, root.key)
    moments = from_graph(name, layer, chunks, mdt, dependencies=[x])
    m2 = moments[1]
    n = _count(x, axis)
    result = elementwise("divide", m2, float(n - ddof) if n - ddof > 0 else 0.0)
    if result.dtype.kind == "c":
        result = astype(elementwise("absolute", result), np.finfo(result.dtype).dtype)
    if not keepdims:
        from goblin_dask.array.layout import squeeze

        result = squeeze(result, axes) if axes else result
    return result


def std(x, axis=None, dtype=None, out=None, ddof=0, keepdims=False, where=True, **kwargs):
    """Standard deviation: the square root of :func:`var`."""
    return elementwise("sqrt", var(x, axis=axis, dtype=dtype, out=out, ddof=ddof, keepdims=keepdims, where=where))


# -- NaN-skipping versions (what xarray calls for float data) --------------------------------------

def _nan_filled(x: Array, fill: Any) -> Array:
    return elementwise("where", elementwise("isnan", x), fill, x) if x.dtype.kind in "fc" else x


def nansum(x, axis=None, dtype=None, out=None, keepdims=False, **kwargs):
    """Sum treating NaN as zero."""
    x = asarray(x)
    return sum(_nan_filled(x, 0), axis=axis, dtype=dtype, out=out, keepdims=keepdims)


def nanprod(x, axis=None, dtype=None, out=None, keepdims=False, **kwargs):
    """Product treating NaN as one."""
    x = asarray(x)
    return prod(_nan_filled(x, 1), axis=axis, dtype=dtype, out=out, keepdims=keepdims)


def _valid_count(x: Array, axis: Any, keepdims: bool) -> Array:
    return sum(elementwise("logical_not", elementwise("isnan", x)), axis=axis, keepdims=keepdims)


def nanmean(x, axis=None, dtype=None, out=None, keepdims=False, **kwargs):
    """Mean of the non-NaN values (NaN where there are none)."""
    x = asarray(x)
    if x.dtype.kind not in "fc":
        return mean(x, axis=axis, dtype=dtype, out=out, keepdims=keepdims)
    total = nansum(x, axis=axis, dtype=dtype, out=out, keepdims=keepdims)
    return elementwise("divide", total, astype(_valid_count(x, axis, keepdims), total.dtype))


def _nan_extreme(kind: str, x, axis, keepdims):
    x = asarray(x)
    if x.dtype.kind not in "fc":
        return (max if kind == "max" else min)(x, axis=axis, keepdims=keepdims)
    fill = -np.inf if kind == "max" else np.inf
    m = (max if kind == "max" else min)(_nan_filled(x, fill), axis=axis, keepdims=keepdims)
    none = all(elementwise("isnan", x), axis=axis, keepdims=keepdims)
    return elementwise("where", none, np.nan, m)


def nanmax(x, axis=None, out=None, keepdims=False, **kwargs):
    """Largest non-NaN value (NaN where all are NaN)."""
    _check_out(out)
    return _nan_extreme("max", x, axis, keepdims)


def nanmin(x, axis=None, out=None, keepdims=False, **kwargs):
    """Smallest non-NaN value (NaN where all are NaN)."""
    _check_out(out)
    return _nan_extreme("min", x, axis, keepdims)


def nanargmax(x, axis=None, out=None, keepdims=False, **kwargs):
    """Index of the largest non-NaN value."""
    x = asarray(x)
    return argmax(_nan_filled(x, -np.inf), axis=axis, out=out, keepdims=keepdims)


def nanargmin(x, axis=None, out=None, keepdims=False, **kwargs):
    """Index of the smallest non-NaN value."""
    x = asarray(x)
    return argmin(_nan_filled(x, np.inf), axis=axis, out=out, keepdims=keepdims)


def nanvar(x, axis=None, dtype=None, out=None, ddof=0, keepdims=False, **kwargs):
    """Variance of the non-NaN values."""
    x = asarray(x)
    if x.dtype.kind not in "fc":
        return var(x, axis=axis, dtype=dtype, out=out, ddof=ddof, keepdims=keepdims)
    mu = nanmean(x, axis=axis, dtype=dtype, keepdims=True)
    dev = elementwise("subtract", x, mu)
    sq = elementwise("square", elementwise("absolute", dev) if dev.dtype.kind == "c" else dev)
    total = nansum(sq, axis=axis, keepdims=keepdims)
    count = astype(_valid_count(x, axis, keepdims), total.dtype)
    return elementwise("divide", total, elementwise("subtract", count, ddof))


def nanstd(x, axis=None, dtype=None, out=None, ddof=0, keepdims=False, **kwargs):
    """Standard deviation of the non-NaN values."""
    return elementwise("sqrt", nanvar(x, axis=axis, dtype=dtype, out=out, ddof=ddof, keepdims=keepdims))

