"""Reductions, and the partial / combine steps of chunked reductions.

A chunked reduction is a tree: every block is reduced with ``keepdims=True``, then
partials are combined pairwise.  ``sum prod max min any all`` combine with themselves
(through the elementwise ``add multiply maximum minimum logical_or logical_and``);
``argmax``/``argmin`` carry global indices next to the values (``argmax_partial``,
``argmax_combine``); variance carries per-block ``(sum, M2)`` pairs (``moments``,
``moments_combine``, Chan et al.'s parallel update), so no block ever needs the global
mean.  Counts are static (block shapes are known), so they travel as params.

NumPy's reductions are already vectorized (SIMD, pairwise summation), so these ops use
NumPy's kernels, except ``moments``: NumPy needs four passes and two full-size temporaries
for it, a numba kernel one pass (:mod:`._moments_kernel`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from goblin_dask.ops import _moments_kernel
from goblin_dask.ops._factories import DTYPE_TEXT, check_dtype, matrices, normalize_axes
from goblin_dask.ops.kernels import register_warm_up
from goblin_dask.ops.registry import register
from goblin_dask.ops.spec import Aval, Cost, Exact, OpSpec, Replica


def reduce_axes(opname: str, x: Aval, axis: Any) -> tuple[int, ...]:
    """``axis`` (None, an int or a tuple) as sorted non-negative ints of ``x``."""
    if axis is None:
        return tuple(range(len(x.shape)))
    return tuple(sorted(normalize_axes(opname, axis, x.shape)))


def reduced_shape(opname: str, x: Aval, axis: Any, keepdims: bool) -> tuple[int, ...]:
    axes = reduce_axes(opname, x, axis)
    if keepdims:
        return tuple(1 if i in axes else n for i, n in enumerate(x.shape))
    return tuple(n for i, n in enumerate(x.shape) if i not in axes)


def _pass_cost(x: Aval, *rest: Any, **params: Any) -> Cost:
    return Cost(float(x.size), float(x.nbytes))


def _needs_identity(opname: str, x: Aval, axis: Any) -> None:
    axes = reduce_axes(opname, x, axis)
    if any(x.shape[i] == 0 for i in axes):
        raise ValueError(f"{opname}: zero-size reduction over axes {axes} of shape {x.shape} has no identity")


def _sum_dtype(opname: str):
    def rule(x: Aval, *, axis=None, keepdims=False, dtype=None) -> np.dtype:
        check_dtype(opname, x.dtype)
        if dtype is not None:
            return check_dtype(opname, dtype)
        return getattr(np, opname)(np.zeros((1,), dtype=x.dtype)).dtype

    return rule


def _one_matrix(*param_sets: dict):
    """Example calls of a one-operand reduction: an n x n matrix with each of ``param_sets``."""
    return lambda n, rng, dtype: [((matrices(n, rng, dtype, 1)[0],), dict(p)) for p in param_sets]


def _accumulating(name: str, doc: str, combine: str, examples) -> OpSpec:
    fn = getattr(np, name)
    return register(OpSpec(
        name=name, doc=doc,
        shape_rule=lambda x, *, axis=None, keepdims=False, dtype=None: reduced_shape(name, x, axis, keepdims),
        dtype_rule=_sum_dtype(name),
        numpy=lambda x, *, axis=None, keepdims=False, dtype=None: np.asarray(fn(x, axis=axis, keepdims=keepdims, dtype=dtype)),
        cost=_pass_cost, verify=Replica(), arity=1, params=("axis", "keepdims", "dtype"), combine=combine,
        text_params={"dtype": DTYPE_TEXT},
        examples=examples,
    ))


def _selecting(name: str, doc: str, combine: str, examples, *, boolean: bool = False) -> OpSpec:
    fn = getattr(np, name)

    def shape_rule(x, *, axis=None, keepdims=False):
        if not boolean:
            _needs_identity(name, x, axis)
        return reduced_shape(name, x, axis, keepdims)

    def dtype_rule(x, *, axis=None, keepdims=False):
        dt = check_dtype(name, x.dtype)
        return np.dtype(bool) if boolean else dt

    return register(OpSpec(
        name=name, doc=doc, shape_rule=shape_rule, dtype_rule=dtype_rule,
        numpy=lambda x, *, axis=None, keepdims=False: np.asarray(fn(x, axis=axis, keepdims=keepdims)),
        cost=_pass_cost, verify=Exact(), arity=1, params=("axis", "keepdims"), combine=combine, examples=examples,
    ))


def _truth_examples(*param_sets: dict):
    return lambda n, rng, dtype: [((rng.standard_normal((n, n)) > 1,), dict(p)) for p in param_sets]


sum_ = _accumulating("sum", "Sum over axes (all when axis is None).", "add",
                     _one_matrix({"axis": (1,), "keepdims": True}, {}))
prod = _accumulating("prod", "Product over axes (all when axis is None).", "multiply", _one_matrix({"axis": (0,)}))
max_ = _selecting("max", "Largest value over axes, propagating NaN.", "maximum", _one_matrix({"axis": (1,)}, {}))
min_ = _selecting("min", "Smallest value over axes, propagating NaN.", "minimum",
                  _one_matrix({"axis": (0,), "keepdims": True}))
any_ = _selecting("any", "True where any value over the axes is nonzero.", "logical_or", _truth_examples({"axis": (0,)}),
                  boolean=True)
all_ = _selecting("all", "True where every value over the axes is nonzero.", "logical_and",
                  _truth_examples({"axis": (1,)}), boolean=True)


# -- argmax / argmin --------------------------------------------------------------------------

def _arg_axis(opname: str, x: Aval, axis: Any) -> int | None:
    if axis is None:
        return None
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise ValueError(f"{opname}: axis must be an int or None, got {axis!r}")
    return normalize_axes(opname, axis, x.shape)[0]


def _arg_shape(opname: str):
    def rule(x, *, axis=None, keepdims=False, **_: Any):
        ax = _arg_axis(opname, x, axis)
        _needs_identity(opname, x, ax)
        return reduced_shape(opname, x, ax, keepdims)

    return rule


def _index_dtype(opname: str):
    def rule(x, **_: Any) -> np.dtype:
        check_dtype(opname, x.dtype)
        return np.dtype(np.int64)

    return rule


def _arg(fn):
    def kernel(x, *, axis=None, keepdims=False):
        return np.asarray(fn(x, axis=axis, keepdims=keepdims), dtype=np.int64)

    return kernel


def _arg_partial(fn):
    """Index of the extreme within a block, made global: ``offsets`` is the block's origin in ``shape``."""

    def kernel(x, *, axis=None, offsets=(), shape=()):
        x = np.asarray(x)
        local = fn(x, axis=axis, keepdims=True)
        if axis is None:
            where = np.unravel_index(int(local.reshape(())), x.shape)
            flat = np.ravel_multi_index(tuple(w + o for w, o in zip(where, offsets)), shape)
            return np.full((1,) * x.ndim, flat, dtype=np.int64)
        return (local + offsets[axis]).astype(np.int64)

    return kernel


def _partial_shape(opname: str):
    def rule(x, *, axis=None, offsets=(), shape=()):
        ax = _arg_axis(opname, x, axis)
        _needs_identity(opname, x, ax)
        if len(offsets) != len(x.shape) or len(shape) != len(x.shape):
            raise ValueError(f"{opname}: offsets {offsets} and shape {shape} must have one entry per axis of {x.shape}")
        return reduced_shape(opname, x, ax, True)

    return rule


def _arg_combine(better):
    """Index of the better of two candidates; ties (and two NaNs) take the smaller index, as NumPy does."""

    def kernel(v1, i1, v2, i2):
        v1, v2, i1, i2 = np.asarray(v1), np.asarray(v2), np.asarray(i1), np.asarray(i2)
        n1, n2 = np.isnan(v1) if v1.dtype.kind in "fc" else False, np.isnan(v2) if v2.dtype.kind in "fc" else False
        take2 = (better(v2, v1) & ~n1) | (n2 & ~n1)
        tie = (v1 == v2) | (n1 & n2)
        return np.where(take2, i2, np.where(tie, np.minimum(i1, i2), i1)).astype(np.int64)

    return kernel


def _combine_shape(opname: str):
    def rule(v1, i1, v2, i2):
        if not (v1.shape == i1.shape == v2.shape == i2.shape):
            raise ValueError(f"{opname}: values and indices must share one shape, got {v1.shape}, {i1.shape}, {v2.shape}, {i2.shape}")
        return v1.shape

    return rule


for _kind, _fn, _better in (("max", np.argmax, np.greater), ("min", np.argmin, np.less)):
    register(OpSpec(
        name=f"arg{_kind}", doc=f"Index of the {'largest' if _kind == 'max' else 'smallest'} value (flat when axis is None).",
        shape_rule=_arg_shape(f"arg{_kind}"), dtype_rule=_index_dtype(f"arg{_kind}"), numpy=_arg(_fn),
        cost=_pass_cost, verify=Exact(), arity=1, params=("axis", "keepdims"),
        examples=_one_matrix({"axis": 1}, {}) if _kind == "max" else _one_matrix({"axis": 0, "keepdims": True}),
    ))
    register(OpSpec(
        name=f"arg{_kind}_partial", doc=f"Global index of a block's {_kind} (keepdims), from the block's offsets in the whole shape.",
        shape_rule=_partial_shape(f"arg{_kind}_partial"), dtype_rule=_index_dtype(f"arg{_kind}_partial"),
        numpy=_arg_partial(_fn), cost=_pass_cost, verify=Exact(), arity=1, params=("axis", "offsets", "shape"),
        combine=f"arg{_kind}_combine",
        examples=lambda n, rng, dtype: [
            ((matrices(n, rng, dtype, 1)[0],), {"axis": 0, "offsets": (n, 0), "shape": (3 * n, n)}),
            ((matrices(n, rng, dtype, 1)[0],), {"offsets": (0, n), "shape": (n, 2 * n)}),
        ],
    ))
    register(OpSpec(
        name=f"arg{_kind}_combine", doc=f"Combine two (value, index) candidates of an arg{_kind}: the better value's index.",
        shape_rule=_combine_shape(f"arg{_kind}_combine"), dtype_rule=lambda v1, i1, v2, i2: np.dtype(np.int64),
        numpy=_arg_combine(_better), cost=_pass_cost, verify=Exact(), arity=4,
        examples=lambda n, rng, dtype: [(
            (rng.standard_normal((1, n)).astype(dtype), np.zeros((1, n), np.int64),
             rng.standard_normal((1, n)).astype(dtype), np.ones((1, n), np.int64)), {})],
    ))


# -- variance: (sum, M2) moments -------------------------------------------------------------

def moments_dtype(x: Aval, **_: Any) -> np.dtype:
    """Moments are computed in the input's float type (float64 for integers and booleans), as np.var does."""
    dt = check_dtype("moments", x.dtype)
    return dt if dt.kind in "fc" else np.dtype(np.float64)


def _moments_shape(x: Aval, *, axis=None) -> tuple[int, ...]:
    return (2,) + reduced_shape("moments", x, axis, True)


def _moments_numpy(x, *, axis=None):
    x = np.asarray(x)
    dt = moments_dtype(Aval.of(x))
    axes = reduce_axes("moments", Aval.of(x), axis)
    n = math.prod(x.shape[i] for i in axes)
    s = np.sum(x, axis=axes, keepdims=True, dtype=dt)
    if n == 0:
        return np.stack([s, np.zeros_like(s)])
    dev = x - s / n
    m2 = np.sum((dev * np.conj(dev)).real if dt.kind == "c" else dev * dev, axis=axes, keepdims=True, dtype=dt)
    return np.stack([s, m2.astype(dt)])


def _moments_combine_shape(p1: Aval, p2: Aval, *, n1: int = 0, n2: int = 0) -> tuple[int, ...]:
    if p1.shape != p2.shape or not p1.shape or p1.shape[0] != 2:
        raise ValueError(f"moments_combine: partials must share a shape (2, ...), got {p1.shape} and {p2.shape}")
    if not all(isinstance(n, (int, np.integer)) and n >= 0 for n in (n1, n2)):
        raise ValueError(f"moments_combine: counts must be non-negative ints, got n1={n1!r}, n2={n2!r}")
    return p1.shape


def _moments_combine(p1, p2, *, n1: int = 0, n2: int = 0):
    p1, p2 = np.asarray(p1), np.asarray(p2)
    if n1 == 0:
        return p2.copy()
    if n2 == 0:
        return p1.copy()
    delta = p2[0] / n2 - p1[0] / n1
    sq = (delta * np.conj(delta)).real if p1.dtype.kind == "c" else delta * delta
    return np.stack([p1[0] + p2[0], p1[1] + p2[1] + sq * (n1 * n2 / (n1 + n2))]).astype(p1.dtype)


def _moments_numba(x, *, axis=None):
    axes = reduce_axes("moments", Aval.of(np.asarray(x)), axis)
    return _moments_kernel.moments_numba(x, axis=axis, numpy_kernel=_moments_numpy, axes=axes)


register_warm_up(_moments_kernel.compile_all)


register(OpSpec(
    name="moments", doc="Per-block (sum, sum of squared deviations) over axes, stacked on a new leading axis of 2.",
    shape_rule=_moments_shape, dtype_rule=moments_dtype, numpy=_moments_numpy, numba=_moments_numba,
    cost=lambda x, **p: Cost(4.0 * x.size, float(x.nbytes)), verify=Replica(), arity=1, params=("axis",),
    combine="moments_combine", examples=_one_matrix({"axis": (0,)}, {}),
))
register(OpSpec(
    name="moments_combine", doc="Merge two (sum, M2) partials of n1 and n2 elements (Chan et al.'s update).",
    shape_rule=_moments_combine_shape, dtype_rule=lambda p1, p2, **k: check_dtype("moments_combine", p1.dtype),
    numpy=_moments_combine, cost=lambda p1, p2, **k: Cost(6.0 * p1.size, 3.0 * p1.nbytes), verify=Replica(),
    arity=2, params=("n1", "n2"), examples=lambda n, rng, dtype: [(
        tuple(np.stack([m[:1], np.abs(m[1:2])]) for m in matrices(n, rng, dtype)), {"n1": 3, "n2": 5})],
))
