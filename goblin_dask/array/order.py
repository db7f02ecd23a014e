"""Order statistics on ga.Array: median, quantile, percentile (and their nan forms), sort, argsort, topk.

An order statistic needs every element of the slice it orders, so the ordered axes are first
joined into one block (``rechunk``, lab-side ``getitem``/``concatenate`` tasks, as dask's
median rechunks), and each output block is then one catalog task (:mod:`goblin_dask.ops.order`)
running NumPy's own function on whole slices: NumPy's numbers whatever the input's chunks.
The other axes keep their blocks, so a median over time of a (time, lat, lon) cube is one
task per (lat, lon) block.  A median over exactly the windows of a ``sliding_window_view``
(xarray's ``rolling(...).median()``) is a fused ``rolling_median`` instead
(:mod:`goblin_dask.array.rolling`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from goblin_dask.array.core import Array, asarray, blockwise, refuse
from goblin_dask.array.layout import ravel, rechunk, squeeze
from goblin_dask.array.linalg import even_blocks
from goblin_dask.array.numpy_api import implements
from goblin_dask.ops import get
from goblin_dask.ops.order import quantile_levels, sort_axis, topk_count
from goblin_dask.ops.reductions import reduce_axes


def _joined(x: Array, axes: tuple[int, ...]) -> Array:
    """``x`` with each of ``axes`` in one block, the other axes cut (largest first, in halves) until a block holds
    no more elements than ``x``'s largest block did, or one slice along ``axes`` (as dask's median rechunks the
    other axes "auto"): a median over time of a cube chunked one step per block is not one block of it all."""
    limit = max(math.prod(max(c, default=0) for c in x.chunks), 1)
    sizes = [n if d in axes else max(c, default=0) for d, (n, c) in enumerate(zip(x.shape, x.chunks))]
    while math.prod(sizes) > limit:
        others = [d for d in range(x.ndim) if d not in axes and sizes[d] > 1]
        if not others:
            break
        d = max(others, key=lambda a: sizes[a])
        sizes[d] = -(-sizes[d] // 2)
    chunks = tuple((n,) if d in axes else c if sizes[d] >= max(c, default=0) else even_blocks(n, sizes[d])
                   for d, (n, c) in enumerate(zip(x.shape, x.chunks)))
    return rechunk(x, chunks)


def _order_reduction(opname: str, a: Any, axis: Any, keepdims: bool, **params: Any) -> Array:
    x = asarray(a)
    axes = reduce_axes(opname, x.aval, axis)
    out = get(opname).abstract_eval(x.aval, axis=axes, keepdims=True, **params)  # errors before dispatch
    lead = len(out.shape) - x.ndim  # quantile's levels axis, first
    x = _joined(x, axes)
    task_params = {"axis": axes, "keepdims": True, **params}
    chunks = tuple((n,) for n in out.shape[:lead]) + tuple((1,) if d in axes else c for d, c in enumerate(x.chunks))
    result = blockwise(opname, chunks, out.dtype,
                       lambda idx: ((x.ref(idx[lead:]),), [x.block_aval(idx[lead:])], task_params),
                       token=(x.name, sorted(task_params.items())), dependencies=[x])
    if keepdims or not axes:
        return result
    return squeeze(result, tuple(a + lead for a in axes))


@implements(op="median")
def median_blocks(a: Any, axis: Any = None, keepdims: bool = False, skipna: bool = False) -> Array:
    """The catalog's ``median`` op on ga data (what :func:`median` and :func:`nanmedian` build)."""
    x = asarray(a)
    if getattr(x, "_windows_of", None) is not None and not keepdims:  # a rolling median: fused with its halo
        from goblin_dask.array.rolling import fused_rolling

        fused = fused_rolling("median", x, axis, keepdims, skipna=skipna)
        if fused is not None:
            return fused
    return _order_reduction("median", x, axis, keepdims, skipna=skipna)


@implements(np.median)
def median(a: Any, axis: Any = None, out: Any = None, overwrite_input: bool = False, keepdims: bool = False) -> Array:
    """Median over axes (all when None), as numpy.median: NaN where a slice holds a NaN."""
    refuse("median", out=out is not None)
    return median_blocks(a, axis, keepdims, False)


@implements(np.nanmedian)
def nanmedian(a: Any, axis: Any = None, out: Any = None, overwrite_input: bool = False, keepdims: bool = False) -> Array:
    """Median ignoring NaN (numpy.nanmedian): NaN only where a slice is all NaN."""
    refuse("nanmedian", out=out is not None)
    return median_blocks(a, axis, keepdims, True)


def _quantile(func: str, a: Any, q: Any, axis: Any, keepdims: bool, method: str, skipna: bool, scale: float = 1.0,
              **unsupported: bool) -> Array:
    refuse(func, **unsupported)
    if isinstance(q, Array):
        raise TypeError(f"{func}: q must be numbers on your machine (a float or a list of floats), not a ga.Array; "
                        "compute it first (q.compute())")
    weak = type(q) in (int, float)  # NumPy's weak scalar: the result keeps a float32 input's type
    try:
        levels = np.asanyarray(q)
        if levels.dtype.kind not in "biuf":
            raise TypeError
    except (TypeError, ValueError):
        raise TypeError(f"{func}: q must be a number or a sequence of numbers, got {q!r}") from None
    if not (np.all(levels >= 0) and np.all(levels <= scale)):
        raise ValueError(f"{func}: q must be in [0, {scale:g}], got {q!r}")
    if scale != 1.0:
        levels = np.true_divide(levels, scale)  # numpy.percentile's own step, in q's type
    q_dtype = None if weak else levels.dtype.name
    return quantile_blocks(a, quantile_levels(func, levels), axis, keepdims, skipna, method, q_dtype)


@implements(op="quantile")
def quantile_blocks(a: Any, q: Any, axis: Any = None, keepdims: bool = False, skipna: bool = False,
                    method: str = "linear", q_dtype: Any = None) -> Array:
    """The catalog's ``quantile`` op on ga data (``q`` in [0, 1]; what the quantile and percentile functions build)."""
    return _order_reduction("quantile", a, axis, keepdims, q=q, skipna=skipna, method=method, q_dtype=q_dtype)


def _given(out: Any, weights: Any, interpolation: Any) -> dict[str, bool]:
    return {"out": out is not None, "weights": weights is not None,
            "interpolation (use method=)": interpolation is not None}


@implements(np.quantile)
def quantile(a: Any, q: Any, axis: Any = None, out: Any = None, overwrite_input: bool = False, method: str = "linear",
             keepdims: bool = False, *, weights: Any = None, interpolation: Any = None) -> Array:
    """Quantiles ``q`` (a number or a 1-d sequence in [0, 1]) over axes, as numpy.quantile: q's axis first."""
    return _quantile("quantile", a, q, axis, keepdims, method, False, **_given(out, weights, interpolation))


@implements(np.nanquantile)
def nanquantile(a: Any, q: Any, axis: Any = None, out: Any = None, overwrite_input: bool = False,
                method: str = "linear", keepdims: bool = False, *, weights: Any = None, interpolation: Any = None) -> Array:
    """Quantiles ignoring NaN (numpy.nanquantile): what xarray's ``.quantile()`` calls."""
    return _quantile("nanquantile", a, q, axis, keepdims, method, True, **_given(out, weights, interpolation))


@implements(np.percentile)
def percentile(a: Any, q: Any, axis: Any = None, out: Any = None, overwrite_input: bool = False,
               method: str = "linear", keepdims: bool = False, *, weights: Any = None, interpolation: Any = None) -> Array:
    """Percentiles ``q`` in [0, 100] (numpy.percentile: the quantiles ``q / 100``)."""
    return _quantile("percentile", a, q, axis, keepdims, method, False, 100.0, **_given(out, weights, interpolation))


@implements(np.nanpercentile)
def nanpercentile(a: Any, q: Any, axis: Any = None, out: Any = None, overwrite_input: bool = False,
                  method: str = "linear", keepdims: bool = False, *, weights: Any = None,
                  interpolation: Any = None) -> Array:
    """Percentiles ignoring NaN (numpy.nanpercentile)."""
    return _quantile("nanpercentile", a, q, axis, keepdims, method, True, 100.0, **_given(out, weights, interpolation))


# -- sort, argsort, topk ---------------------------------------------------------------------------

def _along_axis(opname: str, a: Any, axis: Any, **params: Any) -> Array:
    """One ``opname`` task per block of ``a`` joined along ``axis`` (None: of the flattened array)."""
    x = asarray(a)
    if axis is None:
        x, axis = ravel(x), 0
    ax = sort_axis(opname, x.aval, axis)
    out = get(opname).abstract_eval(x.aval, axis=ax, **params)  # errors before dispatch
    x = _joined(x, (ax,))
    task_params = {"axis": ax, **params}
    chunks = tuple((out.shape[d],) if d == ax else c for d, c in enumerate(x.chunks))
    return blockwise(opname, chunks, out.dtype, lambda idx: ((x.ref(idx),), [x.block_aval(idx)], task_params),
                     token=(x.name, sorted(task_params.items())), dependencies=[x])


def _sort_kind(func: str, kind: Any, order: Any, stable: Any) -> None:
    refuse(func, order=order is not None)
    if kind not in (None, "quicksort", "mergesort", "heapsort", "stable") or stable not in (None, True, False):
        raise ValueError(f"{func}: kind must be one of NumPy's ('quicksort', 'mergesort', 'heapsort', 'stable') and "
                         f"stable True, False or None, got kind={kind!r}, stable={stable!r}")


@implements(np.sort, op="sort")
def sort(a: Any, axis: Any = -1, kind: Any = None, order: Any = None, *, stable: Any = None) -> Array:
    """Values sorted along ``axis`` (None: the flattened array), NaN last, as numpy.sort (any ``kind``: one result)."""
    _sort_kind("sort", kind, order, stable)
    return _along_axis("sort", a, axis)


@implements(np.argsort, op="argsort")
def argsort(a: Any, axis: Any = -1, kind: Any = None, order: Any = None, *, stable: Any = None) -> Array:
    """Indices that sort ``a`` along ``axis``, always in the stable order (equal values keep their index order).

    NumPy's default ``kind`` may order ties either way; the stable order is one it allows, and the one the lab
    can check exactly.
    """
    _sort_kind("argsort", kind, order, stable)
    return _along_axis("argsort", a, axis)


@implements(op="topk")
def topk(a: Any, k: int, axis: int = -1) -> Array:
    """The ``k`` largest values along ``axis`` in descending order (``k < 0``: the ``-k`` smallest, ascending), as
    dask.array.topk; NaN counts as largest (NumPy's sort puts it last)."""
    x = asarray(a)
    topk_count("topk", x.aval, k, sort_axis("topk", x.aval, axis))
    return _along_axis("topk", x, axis, k=int(k))


@implements(op="argtopk")
def argtopk(a: Any, k: int, axis: int = -1) -> Array:
    """Indices of :func:`topk`'s values (equal values in index order), as dask.array.argtopk."""
    x = asarray(a)
    topk_count("argtopk", x.aval, k, sort_axis("argtopk", x.aval, axis))
    return _along_axis("argtopk", x, axis, k=int(k))


__all__ = ["argsort", "argtopk", "median", "nanmedian", "nanpercentile", "nanquantile", "percentile", "quantile", "sort",
           "topk"]
