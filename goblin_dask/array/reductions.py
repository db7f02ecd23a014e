"""Reductions over axes, as trees of catalog partials and pairwise combines.

Each block is reduced with ``keepdims=True``; partials of one output block are then
combined pairwise by the op the reduction declares (``OpSpec.combine``: ``add`` for
``sum``), in a balanced tree, so depth grows like log2 of the block count and no task
holds more than two partials.  See :mod:`goblin_dask.ops.reductions`.

Functions take NumPy's signatures; ``out=``, ``where=`` and ``initial=`` are refused
with a TypeError naming them (ga arrays are computed lazily, never written into).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
from dask._task_spec import TaskRef

from goblin_dask.array.core import Array, asarray, astype, catalog_task, elementwise, from_graph, offsets_of, refuse
from goblin_dask.array.keys import block_key, new_name, part_key
from goblin_dask.array.numpy_api import implements
from goblin_dask.ops import get
from goblin_dask.ops.reductions import moments_dtype, reduce_axes
from goblin_dask.ops.spec import Aval


def _grouped(x: Array, axes: tuple[int, ...]) -> dict[tuple, list[tuple]]:
    """Output block index (reduced axes set to 0) -> input block indices, in C order."""
    groups: dict[tuple, list[tuple]] = {}
    for idx in x.block_indices():
        groups.setdefault(tuple(0 if d in axes else i for d, i in enumerate(idx)), []).append(idx)
    return groups


def _tree(parts: list, root: tuple, name: str, out_idx: tuple, combine: Callable[[tuple, tuple, Any, Any], Any]) -> Any:
    """Combine ``parts`` pairwise; the last combine gets key ``root``, the others ``(name-tree, level, p, *out_idx)``.

    ``combine(key, (level, p), a, b)`` adds the task(s) and returns the merged part.
    """
    level = 0
    while len(parts) > 1:
        merged = []
        for p in range(0, len(parts) - 1, 2):
            key = root if len(parts) == 2 else part_key(name, "tree", level, p, *out_idx)
            merged.append(combine(key, (level, p), parts[p], parts[p + 1]))
        if len(parts) % 2:
            merged.append(parts[-1])
        parts, level = merged, level + 1
    return parts[0]


def _r(node) -> TaskRef:
    return TaskRef(node.key)


def _finish(x: Array, name: str, layer: dict, axes: tuple, keepdims: bool, dtype) -> Array:
    """Array of the tree roots (keys ``(name, *out_idx)``); squeezed when not keepdims."""
    chunks = tuple((1,) if d in axes else c for d, c in enumerate(x.chunks))
    out = from_graph(name, layer, chunks, dtype, dependencies=[x])
    if not keepdims:
        from goblin_dask.array.layout import squeeze

        out = squeeze(out, axes) if axes else out
    return out


def _simple(opname: str, x: Any, axis: Any, keepdims: bool, dtype: Any = None) -> Array:
    """A reduction op whose partials merge with its ``combine`` op (sum, prod, max, min, any, all)."""
    x = asarray(x)
    if getattr(x, "_windows_of", None) is not None:  # a sliding-window view reduced over its windows: fused
        from goblin_dask.array.rolling import fused_rolling

        fused = fused_rolling(opname, x, axis, keepdims, dtype)
        if fused is not None:
            return fused
    params = {"dtype": np.dtype(dtype).name} if dtype is not None and opname in ("sum", "prod") else {}
    op = get(opname)
    out = op.abstract_eval(x.aval, axis=axis, keepdims=keepdims, **params)  # errors before dispatch
    axes = reduce_axes(opname, x.aval, axis)
    name = new_name(opname, x.name, axes, keepdims, params)
    layer = {}
    for out_idx, members in _grouped(x, axes).items():
        root = block_key(name, out_idx)
        parts = []
        for idx in members:
            key = part_key(name, "block", *idx) if len(members) > 1 else root
            layer[key] = catalog_task(key, opname, x.ref(idx), avals=[x.block_aval(idx)], axis=axes, keepdims=True, **params)
            parts.append(layer[key])
        shape = tuple(1 if d in axes else n for d, n in enumerate(x.block_aval(members[0]).shape))
        part_aval = Aval(shape, out.dtype)

        def combine(key, _where, a, b):
            layer[key] = catalog_task(key, op.combine, _r(a), _r(b), avals=[part_aval, part_aval])
            return layer[key]

        _tree(parts, root, name, out_idx, combine)
    return _finish(x, name, layer, axes, keepdims, out.dtype)


@implements(np.sum, op="sum")
def sum(a, axis=None, dtype=None, out=None, keepdims=False, initial=None, where=True) -> Array:
    """Sum over axes (NumPy's result dtype: int64 for booleans and small ints)."""
    refuse("sum", out=out is not None, initial=initial is not None, where=where is not True)
    return _simple("sum", a, axis, keepdims, dtype)


@implements(np.prod, op="prod")
def prod(a, axis=None, dtype=None, out=None, keepdims=False, initial=None, where=True) -> Array:
    """Product over axes."""
    refuse("prod", out=out is not None, initial=initial is not None, where=where is not True)
    return _simple("prod", a, axis, keepdims, dtype)


@implements(np.max, np.amax, op="max")
def max(a, axis=None, out=None, keepdims=False, initial=None, where=True) -> Array:
    """Largest value over axes (NaN propagates)."""
    refuse("max", out=out is not None, initial=initial is not None, where=where is not True)
    return _simple("max", a, axis, keepdims)


@implements(np.min, np.amin, op="min")
def min(a, axis=None, out=None, keepdims=False, initial=None, where=True) -> Array:
    """Smallest value over axes (NaN propagates)."""
    refuse("min", out=out is not None, initial=initial is not None, where=where is not True)
    return _simple("min", a, axis, keepdims)


@implements(np.any, op="any")
def any(a, axis=None, out=None, keepdims=False, *, where=True) -> Array:
    """Whether any value over the axes is nonzero."""
    refuse("any", out=out is not None, where=where is not True)
    return _simple("any", a, axis, keepdims)


@implements(np.all, op="all")
def all(a, axis=None, out=None, keepdims=False, *, where=True) -> Array:
    """Whether every value over the axes is nonzero."""
    refuse("all", out=out is not None, where=where is not True)
    return _simple("all", a, axis, keepdims)


def _count(x: Array, axis: Any) -> int:
    return math.prod(x.shape[d] for d in reduce_axes("mean", x.aval, axis))


@implements(np.mean)
def mean(a, axis=None, dtype=None, out=None, keepdims=False, *, where=True) -> Array:
    """Arithmetic mean (float64 for integer and boolean input, as NumPy)."""
    refuse("mean", out=out is not None, where=where is not True)
    x = asarray(a)
    acc = dtype or (None if x.dtype.kind in "fc" else np.float64)
    n = _count(x, axis)
    s = _simple("sum", x, axis, keepdims, acc)
    return elementwise("divide", s, float(n) if n else float("nan"))


def _arg(kind: str, x: Any, axis: Any, keepdims: bool) -> Array:
    """argmax/argmin: per block the extreme value and its flat index, merged pairwise (first index wins)."""
    x = asarray(x)
    opname = f"arg{kind}"
    out = get(opname).abstract_eval(x.aval, axis=axis, keepdims=keepdims)
    axes = tuple(range(x.ndim)) if axis is None else reduce_axes(opname, x.aval, axis)
    partial = get(f"{opname}_partial")
    value_combine = get(kind).combine  # max -> maximum
    name = new_name(opname, x.name, axis, keepdims)
    layer = {}
    offs = [offsets_of(c) for c in x.chunks]
    for out_idx, members in _grouped(x, axes).items():
        root = block_key(name, out_idx)
        parts = []
        for idx in members:
            block = x.block_aval(idx)
            origin = tuple(o[i] for o, i in zip(offs, idx))
            vkey, ikey = part_key(name, "value", *idx), part_key(name, "index", *idx)
            if len(members) == 1:
                ikey = root
            layer[vkey] = catalog_task(vkey, kind, x.ref(idx), avals=[block], axis=axes, keepdims=True)
            layer[ikey] = catalog_task(ikey, partial.name, x.ref(idx), avals=[block],
                                       axis=None if axis is None else axes[0], offsets=origin, shape=x.shape)
            parts.append((layer[vkey], layer[ikey]))
        shape = tuple(1 for _ in range(x.ndim)) if axis is None else tuple(
            1 if d in axes else n for d, n in enumerate(x.block_aval(members[0]).shape))
        vals, idxs = Aval(shape, x.dtype), Aval(shape, np.dtype(np.int64))

        def combine(key, where, a, b):
            (va, ia), (vb, ib) = a, b
            vkey = part_key(name, "value", *where, *out_idx)  # (level, p, *out_idx): apart from the blocks' values
            layer[vkey] = catalog_task(vkey, value_combine, _r(va), _r(vb), avals=[vals, vals])
            layer[key] = catalog_task(key, partial.combine, _r(va), _r(ia), _r(vb), _r(ib), avals=[vals, idxs, vals, idxs])
            return (layer[vkey], layer[key])

        _tree(parts, root, name, out_idx, combine)
    result = _finish(x, name, layer, axes, True, np.int64)
    if axis is None:
        from goblin_dask.array.layout import reshape

        return reshape(result, (1,) * x.ndim if keepdims else ())
    if not keepdims:
        from goblin_dask.array.layout import squeeze

        result = squeeze(result, axes)
    assert result.shape == out.shape, (result.shape, out.shape)
    return result


@implements(np.argmax, op="argmax")
def argmax(a, axis=None, out=None, *, keepdims=False) -> Array:
    """Index of the largest value (first one; first NaN if any), flat when axis is None."""
    refuse("argmax", out=out is not None)
    return _arg("max", a, axis, keepdims)


@implements(np.argmin, op="argmin")
def argmin(a, axis=None, out=None, *, keepdims=False) -> Array:
    """Index of the smallest value (first one; first NaN if any), flat when axis is None."""
    refuse("argmin", out=out is not None)
    return _arg("min", a, axis, keepdims)


def _ddof(func: str, ddof: Any, correction: Any) -> Any:
    """``correction`` is the Array API's name for ``ddof`` (NumPy accepts either, not both)."""
    if correction is None:
        return ddof
    if ddof != 0:
        raise ValueError(f"{func}: ddof and correction can't be provided simultaneously")
    return correction


@implements(np.var)
def var(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False, *, where=True, mean=None, correction=None) -> Array:
    """Variance (one pass of per-block moments merged pairwise: no global mean needed first)."""
    refuse("var", out=out is not None, where=where is not True, mean=mean is not None)
    ddof = _ddof("var", ddof, correction)
    x = asarray(a)
    if dtype is not None:
        x = astype(x, dtype)
    moments = get("moments")
    moments.abstract_eval(x.aval, axis=axis)
    axes = reduce_axes("var", x.aval, axis)
    mdt = moments_dtype(x.aval)
    name = new_name(moments.name, x.name, axes)
    layer = {}
    for out_idx, members in _grouped(x, axes).items():
        root = block_key(name, (0, *out_idx))  # moments blocks have a leading axis of 2 (count-free M1, M2)
        parts = []
        for idx in members:
            block = x.block_aval(idx)
            key = part_key(name, "block", *idx) if len(members) > 1 else root
            layer[key] = catalog_task(key, moments.name, x.ref(idx), avals=[block], axis=axes)
            parts.append((layer[key], math.prod(block.shape[d] for d in axes)))
        pshape = (2,) + tuple(1 if d in axes else n for d, n in enumerate(x.block_aval(members[0]).shape))
        pav = Aval(pshape, mdt)

        def combine(key, _where, a, b):
            (pa, na), (pb, nb) = a, b
            layer[key] = catalog_task(key, moments.combine, _r(pa), _r(pb), avals=[pav, pav], n1=int(na), n2=int(nb))
            return (layer[key], na + nb)

        _tree(parts, root, name, out_idx, combine)
    chunks = ((2,),) + tuple((1,) if d in axes else c for d, c in enumerate(x.chunks))
    m2 = from_graph(name, layer, chunks, mdt, dependencies=[x])[1]
    n = _count(x, axis)
    result = elementwise("divide", m2, float(n - ddof) if n - ddof > 0 else 0.0)
    if result.dtype.kind == "c":
        result = astype(elementwise("absolute", result), np.finfo(result.dtype).dtype)
    if not keepdims:
        from goblin_dask.array.layout import squeeze

        result = squeeze(result, axes) if axes else result
    return result


@implements(np.std)
def std(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False, *, where=True, mean=None, correction=None) -> Array:
    """Standard deviation: the square root of :func:`var`."""
    return elementwise("sqrt", var(a, axis=axis, dtype=dtype, out=out, ddof=ddof, keepdims=keepdims, where=where,
                                   mean=mean, correction=correction))


# -- comparisons of whole arrays ----------------------------------------------------------------

@implements(np.allclose)
def allclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False) -> bool:
    """Whether every element of ``a`` is close to ``b``'s (computes now, as NumPy's returns a bool)."""
    from goblin_dask.array.core import isclose

    return bool(all(isclose(a, b, rtol, atol, equal_nan)).compute())


@implements(np.array_equal)
def array_equal(a1, a2, equal_nan=False) -> bool:
    """Same shape and elements (computes now, as NumPy's returns a bool)."""
    if np.shape(a1) != np.shape(a2):
        return False
    same = elementwise("equal", a1, a2)
    if equal_nan:
        same = elementwise("logical_or", same, elementwise("logical_and", elementwise("isnan", a1),
                                                           elementwise("isnan", a2)))
    return bool(all(same).compute())


# -- NaN-skipping versions (what xarray calls for float data) --------------------------------------

def _nan_filled(x: Array, fill: Any) -> Array:
    return elementwise("where", elementwise("isnan", x), fill, x) if x.dtype.kind in "fc" else x


def _nan_filled_where(x: Array, y: Array, fill: Any) -> Array:
    """``y`` with ``fill`` where ``x`` is NaN (``y``'s own NaNs stay)."""
    return elementwise("where", elementwise("isnan", x), fill, y)


@implements(np.nansum)
def nansum(a, axis=None, dtype=None, out=None, keepdims=False, initial=None, where=True) -> Array:
    """Sum treating NaN as zero."""
    refuse("nansum", out=out is not None, initial=initial is not None, where=where is not True)
    x = asarray(a)
    return sum(_nan_filled(x, 0), axis=axis, dtype=dtype, keepdims=keepdims)


@implements(np.nanprod)
def nanprod(a, axis=None, dtype=None, out=None, keepdims=False, initial=None, where=True) -> Array:
    """Product treating NaN as one."""
    refuse("nanprod", out=out is not None, initial=initial is not None, where=where is not True)
    x = asarray(a)
    return prod(_nan_filled(x, 1), axis=axis, dtype=dtype, keepdims=keepdims)


def _valid_count(x: Array, axis: Any, keepdims: bool) -> Array:
    return sum(elementwise("logical_not", elementwise("isnan", x)), axis=axis, keepdims=keepdims)


@implements(np.nanmean)
def nanmean(a, axis=None, dtype=None, out=None, keepdims=False, *, where=True) -> Array:
    """Mean of the non-NaN values (NaN where there are none)."""
    refuse("nanmean", out=out is not None, where=where is not True)
    x = asarray(a)
    if x.dtype.kind not in "fc":
        return mean(x, axis=axis, dtype=dtype, keepdims=keepdims)
    total = nansum(x, axis=axis, dtype=dtype, keepdims=keepdims)
    return elementwise("divide", total, astype(_valid_count(x, axis, keepdims), total.dtype))


def _nan_extreme(kind: str, x: Any, axis: Any, keepdims: bool) -> Array:
    x = asarray(x)
    extreme = max if kind == "max" else min
    if x.dtype.kind not in "fc":
        return extreme(x, axis=axis, keepdims=keepdims)
    fill = -np.inf if kind == "max" else np.inf
    m = extreme(_nan_filled(x, fill), axis=axis, keepdims=keepdims)
    none = all(elementwise("isnan", x), axis=axis, keepdims=keepdims)
    return elementwise("where", none, np.nan, m)


@implements(np.nanmax)
def nanmax(a, axis=None, out=None, keepdims=False, initial=None, where=True) -> Array:
    """Largest non-NaN value (NaN where all are NaN)."""
    refuse("nanmax", out=out is not None, initial=initial is not None, where=where is not True)
    return _nan_extreme("max", a, axis, keepdims)


@implements(np.nanmin)
def nanmin(a, axis=None, out=None, keepdims=False, initial=None, where=True) -> Array:
    """Smallest non-NaN value (NaN where all are NaN)."""
    refuse("nanmin", out=out is not None, initial=initial is not None, where=where is not True)
    return _nan_extreme("min", a, axis, keepdims)


@implements(np.nanargmax)
def nanargmax(a, axis=None, out=None, *, keepdims=False) -> Array:
    """Index of the largest non-NaN value."""
    refuse("nanargmax", out=out is not None)
    return argmax(_nan_filled(asarray(a), -np.inf), axis=axis, keepdims=keepdims)


@implements(np.nanargmin)
def nanargmin(a, axis=None, out=None, *, keepdims=False) -> Array:
    """Index of the smallest non-NaN value."""
    refuse("nanargmin", out=out is not None)
    return argmin(_nan_filled(asarray(a), np.inf), axis=axis, keepdims=keepdims)


@implements(np.nanvar)
def nanvar(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False, *, where=True, mean=None,
           correction=None) -> Array:
    """Variance of the non-NaN values."""
    refuse("nanvar", out=out is not None, where=where is not True, mean=mean is not None)
    ddof = _ddof("nanvar", ddof, correction)
    x = asarray(a)
    if x.dtype.kind not in "fc":
        return var(x, axis=axis, dtype=dtype, ddof=ddof, keepdims=keepdims)
    mu = nanmean(x, axis=axis, dtype=dtype, keepdims=True)
    dev = elementwise("subtract", x, mu)
    sq = elementwise("square", elementwise("absolute", dev) if dev.dtype.kind == "c" else dev)
    # skip the entries that were NaN, and only those: a NaN deviation of an inf (inf - inf, or a mean
    # that is NaN from +inf and -inf) makes the variance NaN, as in NumPy, never inf or 0
    total = sum(_nan_filled_where(x, sq, 0), axis=axis, keepdims=keepdims)
    dof = elementwise("subtract", astype(_valid_count(x, axis, keepdims), total.dtype), ddof)
    # no degrees of freedom left (all NaN, or ddof >= the count): NaN, as NumPy's nanvar
    return elementwise("where", elementwise("greater", dof, 0), elementwise("divide", total, dof), np.nan)


@implements(np.nanstd)
def nanstd(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False, *, where=True, mean=None,
           correction=None) -> Array:
    """Standard deviation of the non-NaN values."""
    return elementwise("sqrt", nanvar(a, axis=axis, dtype=dtype, out=out, ddof=ddof, keepdims=keepdims, where=where,
                                      mean=mean, correction=correction))


__all__ = ["all", "allclose", "any", "argmax", "argmin", "array_equal", "max", "mean", "min", "nanargmax", "nanargmin",
           "nanmax", "nanmean", "nanmin", "nanprod", "nanstd", "nansum", "nanvar", "prod", "std", "sum", "var"]
