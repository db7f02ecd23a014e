"""Sliding windows and rolling reductions, blocked with a halo (as dask's ``map_overlap``).

``sliding_window_view(x, window_shape, axis)`` (NumPy's, through ``__array_function__``)
first builds the *halo array*: block ``i`` along a window axis holds the rows of output
block ``i`` plus the ``window - 1`` rows after them, cut from the next input block(s) by
lab-side ``getitem``/``concatenate`` tasks.  Each output block is then one task on one halo
block, so a task reads exactly the numbers its windows need:

* reduced over exactly its window axes (``np.sum(view, axis=-1)``: what xarray's
  ``rolling(...).sum/mean/max/min/count`` do), the view is never built: one fused
  ``rolling_sum`` / ``rolling_prod`` / ``rolling_max`` / ``rolling_min`` / ``rolling_median`` task per block
  (Replica-checked, placed like any Replica op: on volunteers when compute-dense enough);
* otherwise each block of the view is a ``sliding_window`` task (a lab-only layout op
  holding ``prod(window_shape)`` copies of its block).

xarray treats a ga.Array as a dask collection, so ``Variable.rolling_window`` sends it to
``dask.array``'s ``sliding_window_view`` (which needs a dask.array's ``_meta`` and builds
dask tasks), never to ``__array_function__``; :func:`install_xarray_hook` routes ga data to
the function here instead, and keeps bottleneck's and numbagg's moving-window functions
(which xarray would also hand to dask) off ga data.  It is installed when
``goblin_dask.array`` is imported, at once if xarray is loaded, else when xarray is.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from typing import Any

import numpy as np

from goblin_dask.array.core import Array, asarray, blockwise, offsets_of, refuse
from goblin_dask.array.layout import concatenate, getitem, rechunk
from goblin_dask.array.numpy_api import implements
from goblin_dask.ops import get
from goblin_dask.ops.reductions import reduce_axes
from goblin_dask.ops.rolling import ROLLING_REDUCTIONS, window_params


def _halo(x: Array, windows: tuple[int, ...], axes: tuple[int, ...]) -> Array:
    """Block ``i`` along each window axis: output block ``i``'s rows and the ``window - 1`` after them."""
    for a, w in zip(axes, windows):
        if w == 1:
            continue
        n = x.shape[a]
        m = n - w + 1
        offs = offsets_of(x.chunks[a])
        ranges = [(lo, min(hi, m)) for lo, hi in zip(offs[:-1], offs[1:]) if lo < m] or [(0, 0)]
        segments = []
        for lo, hi in ranges:
            seg = getitem(x, (slice(None),) * a + (slice(lo, hi + w - 1),))
            segments.append(rechunk(seg, tuple((hi + w - 1 - lo,) if d == a else c for d, c in enumerate(seg.chunks))))
        x = concatenate(segments, axis=a) if len(segments) > 1 else segments[0]
    return x


def _trimmed_chunks(halo: Array, windows: tuple[int, ...], axes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    chunks = list(halo.chunks)
    for a, w in zip(axes, windows):
        chunks[a] = tuple(c - (w - 1) for c in chunks[a])
    return tuple(chunks)


@implements(np.lib.stride_tricks.sliding_window_view, op="sliding_window")
def sliding_window_view(x: Any, window_shape: Any, axis: Any = None, *, subok: bool = False, writeable: bool = False,
                        automatic_rechunk: Any = None) -> Array:
    """Every window of ``x`` as new trailing axes (NumPy's ``sliding_window_view``), blocked with a halo.

    A reduction over exactly the window axes (``np.sum(view, axis=-1)``) becomes one fused
    ``rolling_<op>`` task per block (sum, prod, max, min, var, std, median); anything else reads
    ``sliding_window`` blocks.
    """
    refuse("sliding_window_view", writeable=bool(writeable))
    x = asarray(x)
    windows, axes = window_params("sliding_window", x.aval, window_shape, axis)
    if len(set(axes)) != len(axes):
        raise ValueError(f"sliding_window_view: axis {axes} repeats an axis (ga.Array of shape {x.shape}); "
                         "one window per axis")
    halo = _halo(x, windows, axes)
    params = {"window_shape": windows, "axis": axes}
    chunks = _trimmed_chunks(halo, windows, axes) + tuple((w,) for w in windows)
    out = blockwise("sliding_window", chunks, x.dtype,
                    lambda idx: ((halo.ref(idx[:x.ndim]),), [halo.block_aval(idx[:x.ndim])], params),
                    token=(halo.name, windows, axes), dependencies=[halo])
    out._windows_of = (halo, windows, axes)
    return out


def fused_rolling(kind: str, x: Array, axis: Any, keepdims: bool, dtype: Any = None, **params: Any) -> Array | None:
    """``np.<kind>`` of a :func:`sliding_window_view` over exactly its window axes, as ``rolling_<kind>`` tasks on
    its halo blocks (``params``: var's and std's ``ddof``, ``skipna``; median's ``skipna``); None when ``x`` is no
    such view or the reduction is another one."""
    view = getattr(x, "_windows_of", None)
    if view is None or kind not in ROLLING_REDUCTIONS or keepdims:
        return None
    halo, windows, axes = view
    try:
        reduced = reduce_axes("sum", x.aval, axis)
    except (TypeError, ValueError):
        return None
    if sorted(reduced) != list(range(halo.ndim, x.ndim)):
        return None
    op = f"rolling_{kind}"
    params = {"window_shape": windows, "axis": axes, **params}
    out_dtype = get(op).abstract_eval(halo.block_aval((0,) * halo.ndim), **params).dtype
    if dtype is not None and np.dtype(dtype) != out_dtype:
        return None
    return blockwise(op, _trimmed_chunks(halo, windows, axes), out_dtype,
                     lambda idx: ((halo.ref(idx),), [halo.block_aval(idx)], params),
                     token=(halo.name, windows, axes), dependencies=[halo])


#: NumPy reductions that a view reduced over its windows fuses into: function -> (kind, NaN-skipping).
_NUMPY_REDUCTIONS = {np.sum: ("sum", False), np.prod: ("prod", False), np.max: ("max", False), np.amax: ("max", False),
                     np.min: ("min", False), np.amin: ("min", False), np.var: ("var", False), np.std: ("std", False),
                     np.nanvar: ("var", True), np.nanstd: ("std", True), np.median: ("median", False),
                     np.nanmedian: ("median", True)}
_DEFAULTS = {"out": None, "initial": None, "where": True, "mean": None, "correction": None, "overwrite_input": False}


def fused_numpy_call(func: Any, args: tuple, kwargs: dict) -> Array | None:
    """``func(view, axis=..., ...)`` (NumPy's dispatch) as a fused rolling reduction, or None."""
    entry = _NUMPY_REDUCTIONS.get(func)
    if entry is None or not args or len(args) > 2:
        return None
    kind, skipna = entry
    kw = dict(kwargs)
    axis = args[1] if len(args) == 2 else kw.pop("axis", None)
    keepdims, dtype, ddof = kw.pop("keepdims", False), kw.pop("dtype", None), kw.pop("ddof", 0)
    if any(k not in _DEFAULTS or v is not _DEFAULTS[k] and not (k == "where" and v is True) for k, v in kw.items()):
        return None
    params = {"ddof": ddof, "skipna": skipna} if kind in ("var", "std") else {}
    if kind == "median":
        params = {"skipna": skipna}
    if kind not in ("var", "std") and ddof != 0:
        return None
    return fused_rolling(kind, args[0], axis, bool(keepdims), dtype, **params)


# -- xarray ---------------------------------------------------------------------------------------

def _xarray_sliding_window_view(original):
    @functools.wraps(original)
    def sliding_window_view_(array, window_shape, axis=None, **kwargs):
        if isinstance(array, Array):
            kwargs.pop("automatic_rechunk", None)
            kwargs.pop("subok", None)
            kwargs.pop("writeable", None)
            return sliding_window_view(array, window_shape, axis=axis, **kwargs)
        return original(array, window_shape, axis=axis, **kwargs)

    sliding_window_view_._goblin = True
    return sliding_window_view_


def _xarray_array_reduce(original):
    @functools.wraps(original)
    def _array_reduce(self, array_agg_func, bottleneck_move_func, numbagg_move_func, *args, **kwargs):
        if isinstance(getattr(self.obj, "data", None), Array):  # their moving functions would go through dask.array
            bottleneck_move_func = numbagg_move_func = None
        return original(self, array_agg_func, bottleneck_move_func, numbagg_move_func, *args, **kwargs)

    _array_reduce._goblin = True
    return _array_reduce


def _patch(module: Any) -> None:
    swv = getattr(module, "sliding_window_view", None)
    if module.__name__.endswith("duck_array_ops") and swv is not None and not getattr(swv, "_goblin", False):
        module.sliding_window_view = _xarray_sliding_window_view(swv)
    cls = getattr(module, "DataArrayRolling", None)
    if cls is not None and "_array_reduce" in vars(cls) and not getattr(cls._array_reduce, "_goblin", False):
        cls._array_reduce = _xarray_array_reduce(cls._array_reduce)


#: xarray's modules :func:`_patch` adapts (rolling moved to ``xarray.computation`` in 2025).
XARRAY_MODULES = ("xarray.core.duck_array_ops", "xarray.computation.rolling", "xarray.core.rolling")


class _XarrayHook(importlib.abc.MetaPathFinder):
    """Patches each of :data:`XARRAY_MODULES` right after xarray imports it."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in XARRAY_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch
        return spec


def install_xarray_hook() -> None:
    """Route xarray's rolling windows on ga data here (idempotent)."""
    for name in XARRAY_MODULES:
        if name in sys.modules:
            _patch(sys.modules[name])
    if not any(isinstance(f, _XarrayHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _XarrayHook())


install_xarray_hook()

__all__ = ["sliding_window_view"]
