"""Order statistics: ``median``, ``quantile`` (their NaN-skipping forms by ``skipna``) and ``sort``,
``argsort``, ``topk``, ``argtopk`` along axes of one block.

A task holds every element it orders: the blocked functions (:mod:`goblin_dask.array.order`)
first join the ordered axes into one block, as dask's median does, so each task is NumPy's
own call on whole slices and gives NumPy's numbers.

Verification follows the catalog's rule. A median or quantile interpolates (arithmetic on
the selected values): a second volunteer recomputes it in the same O(n) as the first, so
these are :class:`Replica` (compared within rounding) and may run on volunteers. ``sort``,
``argsort`` and the top-k ops only select and permute: checking is computing again, bit for
bit (:class:`Exact`), so they run on the lab worker. ``argsort`` and ``argtopk`` are always
the *stable* order (ties keep their index order), so the lab's recomputation is determined.
"""

from __future__ import annotations

import math
import operator
import warnings
from typing import Any

import numpy as np

from goblin_dask.ops._factories import DTYPE_TEXT, check_dtype, matrices, normalize_axes
from goblin_dask.ops.reductions import reduce_axes, reduced_shape
from goblin_dask.ops.registry import register
from goblin_dask.ops.spec import Aval, Cost, Exact, OpSpec, Replica

#: NumPy's quantile methods (numpy.quantile's ``method``): the grammar of the text parameter.
QUANTILE_METHODS = ("inverted_cdf", "averaged_inverted_cdf", "closest_observation", "interpolated_inverted_cdf", "hazen",
                    "weibull", "linear", "median_unbiased", "normal_unbiased", "lower", "higher", "midpoint", "nearest")
METHOD_TEXT = "|".join(QUANTILE_METHODS)


def quantile_levels(opname: str, q: Any) -> float | tuple[float, ...]:
    """``q`` as a float or a flat tuple of floats in [0, 1]; ValueError naming the op otherwise."""
    try:
        a = np.asarray(q, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{opname}: q must be a number or a sequence of numbers in [0, 1], got {q!r}") from None
    if a.ndim > 1:
        raise ValueError(f"{opname}: q must be a number or a 1-d sequence, got shape {a.shape}; "
                         "call it once per row of q")
    if not (np.all(a >= 0) and np.all(a <= 1)):
        raise ValueError(f"{opname}: quantiles must be in the range [0, 1], got {q!r}")
    return float(a) if a.ndim == 0 else tuple(float(v) for v in a)


def _method(opname: str, method: Any) -> str:
    if method not in QUANTILE_METHODS:
        raise ValueError(f"{opname}: method {method!r} is not one of NumPy's: {', '.join(QUANTILE_METHODS)}")
    return method


def _skipna(opname: str, skipna: Any) -> bool:
    if not isinstance(skipna, (bool, np.bool_)):
        raise TypeError(f"{opname}: skipna must be True or False, got {skipna!r}")
    return bool(skipna)


def _quiet(fn, *args, **kwargs):
    """NumPy's call without its RuntimeWarnings (an all-NaN or empty slice is NaN, as NumPy returns)."""
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.asarray(fn(*args, **kwargs))


def _order_dtype(opname: str, x: Aval, refused: str = "c") -> np.dtype:
    dt = check_dtype(opname, x.dtype)
    if dt.kind in refused:
        raise TypeError(f"{opname}: not defined for {dt} data here (it orders real numbers); "
                        "cast it first (x.astype(float))")
    return dt


# -- median, quantile (Replica) -------------------------------------------------------------------

def _median_kernel(x, *, axis=None, keepdims=False, skipna=False):
    axes = reduce_axes("median", Aval.of(x), axis)
    return _quiet(np.nanmedian if _skipna("median", skipna) else np.median, x, axis=axes, keepdims=keepdims)


def _median_shape(x: Aval, *, axis=None, keepdims=False, skipna=False) -> tuple[int, ...]:
    _skipna("median", skipna)
    return reduced_shape("median", x, axis, keepdims)


def _median_dtype(x: Aval, **params: Any) -> np.dtype:
    return _median_kernel(np.zeros((1,), _order_dtype("median", x))).dtype


def quantile_q(q: Any, q_dtype: Any) -> Any:
    """The ``q`` NumPy is given: a Python float when ``q_dtype`` is None (NumPy's weak scalar: the result keeps a
    float32 input's type), else an array of ``q_dtype`` (NumPy promotes the result with it)."""
    if q_dtype is None and np.ndim(q) == 0:
        return float(q)
    return np.asarray(q, dtype=check_dtype("quantile", q_dtype or np.float64))


def _quantile_kernel(x, *, q, axis=None, keepdims=False, skipna=False, method="linear", q_dtype=None):
    axes = reduce_axes("quantile", Aval.of(x), axis)
    fn = np.nanquantile if _skipna("quantile", skipna) else np.quantile
    q = quantile_q(quantile_levels("quantile", q), q_dtype)
    return _quiet(fn, x, q, axis=axes, keepdims=keepdims, method=_method("quantile", method))


def _quantile_shape(x: Aval, *, q, axis=None, keepdims=False, skipna=False, method="linear",
                    q_dtype=None) -> tuple[int, ...]:
    levels = quantile_levels("quantile", q)
    _skipna("quantile", skipna)
    _method("quantile", method)
    return (() if isinstance(levels, float) else (len(levels),)) + reduced_shape("quantile", x, axis, keepdims)


def _quantile_dtype(x: Aval, *, q, method="linear", q_dtype=None, **params: Any) -> np.dtype:
    """NumPy's: float64 for integers, else the input's float type promoted with a non-weak q's; the input's type
    for the selecting methods ('lower')."""
    return _quantile_kernel(np.zeros((1,), _order_dtype("quantile", x, "bc")), q=q, method=method,
                            q_dtype=q_dtype).dtype


def _select_cost(x: Aval, **params: Any) -> Cost:
    """Introselect: a few passes over the ordered slices (per level for quantile)."""
    q = params.get("q", 0.5)
    levels = 1 if np.ndim(q) == 0 else max(len(q), 1)
    return Cost(3.0 * x.size * levels, float(x.nbytes))


def _with_nan_rows(n, rng, dtype):
    """An n x n block with a NaN row and NaNs scattered (the first output element stays finite)."""
    x = matrices(n, rng, dtype, 1)[0]
    if x.dtype.kind == "f" and n > 2:
        x[n - 1, :] = np.nan
        x[1, 1:] = np.nan
    return x


median = register(OpSpec(
    name="median", doc="Median over axes (np.median; np.nanmedian with skipna), all axes when axis is None.",
    shape_rule=_median_shape, dtype_rule=_median_dtype, numpy=_median_kernel, cost=_select_cost, verify=Replica(),
    arity=1, params=("axis", "keepdims", "skipna"),
    examples=lambda n, rng, dt: [((_with_nan_rows(n, rng, dt),), {"axis": (1,), "keepdims": True, "skipna": True}),
                                 ((matrices(n, rng, dt, 1)[0],), {"axis": (0,)}),
                                 ((matrices(n, rng, dt, 1)[0],), {})],
))

quantile = register(OpSpec(
    name="quantile", doc="Quantiles q over axes (np.quantile; np.nanquantile with skipna); q's axis first.",
    shape_rule=_quantile_shape, dtype_rule=_quantile_dtype, numpy=_quantile_kernel, cost=_select_cost,
    verify=Replica(), arity=1, params=("q", "axis", "keepdims", "skipna", "method", "q_dtype"),
    text_params={"method": METHOD_TEXT, "q_dtype": DTYPE_TEXT},
    examples=lambda n, rng, dt: [
        ((_with_nan_rows(n, rng, dt),), {"q": (0.1, 0.5, 0.9), "axis": (1,), "keepdims": True, "skipna": True}),
        ((matrices(n, rng, dt, 1)[0],), {"q": 0.25, "axis": (0,), "method": "midpoint"}),
        ((matrices(n, rng, dt, 1)[0],), {"q": (0.0, 1.0), "method": "hazen", "q_dtype": "float32"})],
))


# -- sort, argsort, topk, argtopk (Exact: lab-only) ------------------------------------------------

def sort_axis(opname: str, x: Aval, axis: Any) -> int:
    """``axis`` as a non-negative int of ``x`` (an array of at least one axis)."""
    if len(x.shape) == 0:
        raise ValueError(f"{opname}: needs an array of at least one axis, got shape ()")
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise ValueError(f"{opname}: axis must be an int, got {axis!r}")
    return normalize_axes(opname, axis, x.shape)[0]


def topk_count(opname: str, x: Aval, k: Any, axis: int) -> int:
    """``k`` checked: a nonzero int with ``|k|`` at most the axis' length."""
    try:
        k = operator.index(k)
    except TypeError:
        raise TypeError(f"{opname}: k must be an int, got {k!r}") from None
    n = x.shape[axis]
    if k == 0 or abs(k) > n:
        raise ValueError(f"{opname}: k={k} must be nonzero and at most the length {n} of axis {axis} "
                         f"(shape {x.shape}); k > 0 takes the largest, k < 0 the smallest")
    return k


def stable_argsort(x: Any, axis: int) -> np.ndarray:
    return np.argsort(x, axis=axis, kind="stable")


def argtopk_kernel(x: Any, *, k: int, axis: int = -1) -> np.ndarray:
    """Indices of the ``k`` largest (``k > 0``: descending, ties by ascending index, NaN largest, as NumPy's sort
    puts NaN last) or the ``-k`` smallest (ascending, ties by ascending index)."""
    x = np.asarray(x)
    ax = sort_axis("argtopk", Aval.of(x), axis)
    k = topk_count("argtopk", Aval.of(x), k, ax)
    if k < 0:
        return np.take(stable_argsort(x, ax), np.arange(-k), axis=ax)
    n = x.shape[ax]
    # the stable ascending order of the reversed axis, reversed: descending values, ties in ascending index
    order = (n - 1) - np.flip(stable_argsort(np.flip(x, ax), ax), ax)
    return np.take(order, np.arange(k), axis=ax)


def _topk_kernel(x: Any, *, k: int, axis: int = -1) -> np.ndarray:
    return np.take_along_axis(np.asarray(x), argtopk_kernel(x, k=k, axis=axis), axis=axis)


def _sort_kernel(x: Any, *, axis: int = -1) -> np.ndarray:
    return np.sort(x, axis=sort_axis("sort", Aval.of(x), axis), kind="stable")


def _argsort_kernel(x: Any, *, axis: int = -1) -> np.ndarray:
    return stable_argsort(x, sort_axis("argsort", Aval.of(x), axis))


def _sort_cost(x: Aval, **params: Any) -> Cost:
    n = max((x.shape[params.get("axis", -1)] if x.shape else 1), 2)
    return Cost(float(x.size) * math.log2(n), 2.0 * x.nbytes)


def _same_shape(opname: str):
    def rule(x: Aval, *, axis: int = -1) -> tuple[int, ...]:
        sort_axis(opname, x, axis)
        return x.shape

    return rule


def _topk_shape(opname: str):
    def rule(x: Aval, *, k: int, axis: int = -1) -> tuple[int, ...]:
        ax = sort_axis(opname, x, axis)
        k = topk_count(opname, x, k, ax)
        return tuple(abs(k) if d == ax else n for d, n in enumerate(x.shape))

    return rule


def _ties(n, rng, dt):
    """A block with ties and NaNs (sort's order of equal and missing values is what these examples pin)."""
    x = np.round(matrices(n, rng, dt, 1)[0])
    if x.dtype.kind == "f" and n > 2:
        x[1, ::2] = np.nan
    return x


def _sort_examples(n, rng, dt):
    return [((_ties(n, rng, dt),), {"axis": -1}), ((matrices(n, rng, dt, 1)[0],), {"axis": 0})]


def _topk_examples(n, rng, dt):
    k = max(1, n // 2)
    return [((_ties(n, rng, dt),), {"k": k, "axis": -1}), ((matrices(n, rng, dt, 1)[0],), {"k": -k, "axis": 0})]


for _name, _doc, _kernel, _index in (
        ("sort", "Values sorted along an axis (np.sort; NaN last).", _sort_kernel, False),
        ("argsort", "Indices that sort along an axis, stable (np.argsort(kind='stable')).", _argsort_kernel, True)):
    register(OpSpec(
        name=_name, doc=_doc, shape_rule=_same_shape(_name),
        dtype_rule=(lambda x, _n=_name, **p: (_order_dtype(_n, x), np.dtype(np.intp))[1]) if _index
        else (lambda x, _n=_name, **p: _order_dtype(_n, x)),
        numpy=_kernel, cost=_sort_cost, verify=Exact(), arity=1, params=("axis",), examples=_sort_examples,
    ))

for _name, _doc, _kernel, _index in (
        ("topk", "The k largest values along an axis, descending (k < 0: the -k smallest, ascending).", _topk_kernel,
         False),
        ("argtopk", "Indices of topk's values (ties in index order).", argtopk_kernel, True)):
    register(OpSpec(
        name=_name, doc=_doc, shape_rule=_topk_shape(_name),
        dtype_rule=(lambda x, _n=_name, **p: (_order_dtype(_n, x), np.dtype(np.intp))[1]) if _index
        else (lambda x, _n=_name, **p: _order_dtype(_n, x)),
        numpy=_kernel, cost=_sort_cost, verify=Exact(), arity=1, params=("k", "axis"), examples=_topk_examples,
    ))
