"""Sliding windows: ``sliding_window`` (NumPy's ``sliding_window_view``) and fused rolling reductions.

A task gets one block *with its halo* (the ``window - 1`` rows after it along each window
axis, joined on the lab by :mod:`goblin_dask.array.rolling`), so a volunteer receives only
the numbers its windows read.  ``rolling_sum`` (``prod``, ``max``, ``min``) reduces every
window of that block at once: its result has ``window - 1`` fewer rows along each window
axis, exactly ``np.<reduce>(sliding_window_view(block, window_shape, axis), axis=<window
axes>)``.  A second volunteer recomputes it as cheaply as the first (O(block x window)), so
these ops are verified by :class:`Replica` and may run on volunteers.  ``sliding_window``
itself only copies (every element ``prod(window_shape)`` times): a layout op, checked by
computing it again, so lab-only.
"""

from __future__ import annotations

import math
import operator
import warnings
from typing import Any, Callable

import numpy as np

from goblin_dask.ops._factories import check_dtype, matrices
from goblin_dask.ops.registry import register
from goblin_dask.ops.spec import Aval, Cost, Exact, OpSpec, Replica

_window_view = np.lib.stride_tricks.sliding_window_view


def window_params(opname: str, x: Aval, window_shape: Any, axis: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(window_shape, axis)`` as tuples of ints, checked against ``x``'s shape (NumPy's rules)."""
    windows = (window_shape,) if np.ndim(window_shape) == 0 else tuple(window_shape)
    try:
        windows = tuple(operator.index(w) for w in windows)
    except TypeError:
        raise TypeError(f"{opname}: window_shape {window_shape!r} must be ints") from None
    ndim = len(x.shape)
    if axis is None:
        axes = tuple(range(ndim))
    else:
        axes = (axis,) if np.ndim(axis) == 0 else tuple(axis)
        try:
            axes = tuple(operator.index(a) for a in axes)
        except TypeError:
            raise TypeError(f"{opname}: axis {axis!r} must be ints") from None
    if len(windows) != len(axes):
        raise ValueError(f"{opname}: window_shape {windows} and axis {axes} differ in length (shape {x.shape})")
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"{opname}: axis {a} is out of bounds for an array of shape {x.shape}")
    axes = tuple(a % ndim for a in axes)
    if any(w < 0 for w in windows):
        raise ValueError(f"{opname}: window_shape {windows} has negative sizes")
    for a, w in zip(axes, windows):
        if w > x.shape[a]:
            raise ValueError(f"{opname}: window {w} along axis {a} is larger than the axis (shape {x.shape})")
    return windows, axes


def _trimmed(x: Aval, windows: tuple[int, ...], axes: tuple[int, ...]) -> list[int]:
    shape = list(x.shape)
    for a, w in zip(axes, windows):
        shape[a] -= w - 1
    return shape


def _examples(extra: dict) -> Callable:
    def examples(n, rng, dt):
        x = matrices(n, rng, dt, 1)[0]
        w = max(1, min(3, x.shape[0]))
        return [((x,), {"window_shape": (w,), "axis": (0,), **extra}),
                ((x,), {"window_shape": (w, min(2, x.shape[1])), "axis": (0, 1), **extra})]

    return examples


# -- sliding_window (layout, lab-only) ------------------------------------------------------------

def _window_shape_rule(x: Aval, *, window_shape: Any, axis: Any = None) -> tuple[int, ...]:
    windows, axes = window_params("sliding_window", x, window_shape, axis)
    return tuple(_trimmed(x, windows, axes)) + windows


def _sliding_window(x: Any, *, window_shape: Any, axis: Any = None) -> Any:
    windows, axes = window_params("sliding_window", Aval.of(x), window_shape, axis)
    return _window_view(x, windows, axis=axes)


sliding_window = register(
    OpSpec(
        name="sliding_window",
        doc="Every window of x as new trailing axes (np.lib.stride_tricks.sliding_window_view).",
        shape_rule=_window_shape_rule,
        dtype_rule=lambda x, **params: check_dtype("sliding_window", x.dtype),
        numpy=_sliding_window,
        cost=lambda x, **params: Cost(0.0, 2.0 * x.nbytes * math.prod(window_params(
            "sliding_window", x, params["window_shape"], params.get("axis"))[0])),
        verify=Exact(), arity=1, params=("window_shape", "axis"),
        examples=_examples({}),
    )  # fmt: skip
)


# -- rolling reductions (Replica, volunteers) --------------------------------------------------------

#: The fused reductions: ``rolling_<kind>``.  var and std take ``ddof`` and ``skipna`` (NumPy's nanvar/nanstd),
#: median ``skipna`` (NumPy's nanmedian: xarray's ``rolling(...).median()``).
ROLLING_REDUCTIONS = ("sum", "prod", "max", "min", "var", "std", "median")
#: The parameters of each fused reduction that takes any.
ROLLING_PARAMS = {"var": ("ddof", "skipna"), "std": ("ddof", "skipna"), "median": ("skipna",)}


def _moment_params(opname: str, ddof: Any, skipna: Any) -> tuple[int, bool]:
    if isinstance(ddof, bool) or not isinstance(ddof, (int, np.integer)) or ddof < 0:
        raise TypeError(f"{opname}: ddof must be a non-negative int, got {ddof!r}")
    if not isinstance(skipna, (bool, np.bool_)):
        raise TypeError(f"{opname}: skipna must be True or False, got {skipna!r}")
    return int(ddof), bool(skipna)


def _rolling_op(kind: str) -> OpSpec:
    name = f"rolling_{kind}"
    moments = kind in ("var", "std")
    extra = ROLLING_PARAMS.get(kind, ())

    def reducer(view: Any, axes: tuple[int, ...], params: dict) -> Any:
        if not extra:
            return getattr(np, kind)(view, axis=axes)
        ddof, skipna = _moment_params(name, params.get("ddof", 0), params.get("skipna", False))
        with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
            # windows of padding only (NaN) have no degrees of freedom: NaN, as NumPy gives, without its warning
            warnings.simplefilter("ignore", RuntimeWarning)
            fn = getattr(np, ("nan" if skipna else "") + kind)
            return fn(view, axis=axes, ddof=ddof) if moments else fn(view, axis=axes)

    def shape_rule(x: Aval, *, window_shape: Any, axis: Any, **params: Any) -> tuple[int, ...]:
        windows, axes = window_params(name, x, window_shape, axis)
        if extra:
            _moment_params(name, params.get("ddof", 0), params.get("skipna", False))
        return tuple(_trimmed(x, windows, axes))

    def dtype_rule(x: Aval, *, window_shape: Any, axis: Any, **params: Any) -> np.dtype:
        with np.errstate(all="ignore"):
            return np.asarray(reducer(np.zeros((1, 2), check_dtype(name, x.dtype)), (1,), {})).dtype

    def run(x: Any, *, window_shape: Any, axis: Any, **params: Any) -> Any:
        windows, axes = window_params(name, Aval.of(x), window_shape, axis)
        n = len(x.shape)
        view = _window_view(x, windows, axis=axes)
        if math.prod(view.shape[:n]) == 0:  # no window at all: an empty result, as numpy's shape says
            return np.empty(view.shape[:n], dtype=dtype_rule(Aval.of(x), window_shape=windows, axis=axes))
        return reducer(view, tuple(range(n, n + len(windows))), params)

    def cost(x: Aval, *, window_shape: Any, axis: Any, **params: Any) -> Cost:
        windows, axes = window_params(name, x, window_shape, axis)
        out = math.prod(_trimmed(x, windows, axes))
        per_window = math.prod(windows) * (4 if moments else 3 if kind == "median" else 1)
        return Cost(float(out * per_window), float(x.nbytes + out * x.dtype.itemsize))

    return register(
        OpSpec(
            name=name, doc=f"np.{kind} of every window of x (the windows of sliding_window_view, fused).",
            shape_rule=shape_rule, dtype_rule=dtype_rule, numpy=run, cost=cost, verify=Replica(),
            arity=1, params=("window_shape", "axis") + extra,
            examples=_examples({"ddof": 1, "skipna": True} if moments else {"skipna": True} if extra else {}),
        )  # fmt: skip
    )


rolling_sum, rolling_prod, rolling_max, rolling_min, rolling_var, rolling_std, rolling_median = (
    _rolling_op(k) for k in ROLLING_REDUCTIONS)
