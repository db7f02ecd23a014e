"""Layout operations: moving and viewing data without arithmetic.

Results are bitwise determined by the inputs, so replicas are compared exactly.  The
kernels are NumPy's (they return views where NumPy does); there is no numba or cupy
kernel because there is nothing to compute.  Shapes follow NumPy exactly: a shape rule
reads a zero-strided stand-in of the operand, so no data is touched.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from goblin_dask.ops._factories import check_dtype, matrices, normalize_axes, shape_param, unbroadcast
from goblin_dask.ops.registry import register
from goblin_dask.ops.spec import Aval, Cost, Exact, OpSpec


class LayoutIndexError(IndexError, ValueError):
    """An index outside an operand's shape: an IndexError, as NumPy raises, and a shape-rule ValueError."""


def _standin(aval: Aval) -> np.ndarray:
    """A zero-strided array of aval's shape: indexing it gives NumPy's result shape, touching no data."""
    return np.broadcast_to(np.empty((), dtype=np.int8), aval.shape)


def _moved_bytes(*avals: Aval, **params: Any) -> Cost:
    return Cost(0.0, 2.0 * sum(a.nbytes for a in avals))


def _same_dtype(opname: str):
    def rule(x: Aval, **params: Any) -> np.dtype:
        return check_dtype(opname, x.dtype)

    return rule


def _layout_op(name: str, doc: str, shape_rule, numpy, grad, *, examples, dtype_rule=None, arity: int | None = 1,
               params=(), text_params=None) -> OpSpec:
    return register(
        OpSpec(
            name=name,
            doc=doc,
            shape_rule=shape_rule,
            dtype_rule=dtype_rule or _same_dtype(name),
            numpy=numpy,
            cost=_moved_bytes,
            verify=Exact(),
            grad=grad,
            arity=arity,
            params=params,
            text_params=text_params or {},
            examples=examples,
        )
    )


# -- transpose -----------------------------------------------------------------------------


def _permutation(x: Aval, axes: Any) -> tuple[int, ...]:
    if axes is None:
        return tuple(range(len(x.shape)))[::-1]
    perm = normalize_axes("transpose", axes, x.shape)
    if len(perm) != len(x.shape):
        raise ValueError(f"transpose: axes {tuple(axes)} are not a permutation of the {len(x.shape)} axes of shape {x.shape}")
    return perm


def _transpose_vjp(g: Any, x: Any, *, axes: Any = None) -> tuple:
    return (np.transpose(g, np.argsort(_permutation(Aval.of(x), axes))),)


transpose = _layout_op(
    "transpose", "Permute the axes (reverse them when axes is None).",
    lambda x, *, axes=None: tuple(x.shape[i] for i in _permutation(x, axes)),
    lambda x, *, axes=None: np.transpose(x, _permutation(Aval.of(x), axes)),
    _transpose_vjp, params=("axes",),
    examples=lambda n, rng, dt: [((matrices(n, rng, dt, 1)[0],), {"axes": (1, 0)})],
)  # fmt: skip


# -- reshape, squeeze, expand_dims (all reshapes) ------------------------------------------


def _reshape_shape(x: Aval, *, shape: Any) -> tuple[int, ...]:
    shape = shape_param("reshape", shape, allow_unknown=True)
    known = math.prod(n for n in shape if n != -1)
    if shape.count(-1) > 1 or (-1 in shape and known == 0):
        raise ValueError(f"reshape: cannot infer the -1 dimension of {shape} for shape {x.shape}")
    if -1 in shape:
        if x.size % known:
            raise ValueError(f"reshape: cannot reshape shape {x.shape} (size {x.size}) into {shape}")
        shape = tuple(x.size // known if n == -1 else n for n in shape)
    if math.prod(shape) != x.size:
        raise ValueError(f"reshape: cannot reshape shape {x.shape} (size {x.size}) into {shape}")
    return shape


def _reshape_back(g: Any, x: Any, **params: Any) -> tuple:
    return (np.reshape(g, np.shape(x)),)


reshape = _layout_op(
    "reshape", "Same data in a new shape (C order; one -1 is inferred).",
    _reshape_shape, lambda x, *, shape: np.reshape(x, _reshape_shape(Aval.of(x), shape=shape)),
    _reshape_back, params=("shape",),
    examples=lambda n, rng, dt: [((matrices(n, rng, dt, 1)[0],), {"shape": (-1,)})],
)  # fmt: skip


def _squeeze_axes(x: Aval, axis: Any) -> tuple[int, ...]:
    if axis is None:
        return tuple(i for i, n in enumerate(x.shape) if n == 1)
    axes = normalize_axes("squeeze", axis, x.shape)
    for i in axes:
        if x.shape[i] != 1:
            raise ValueError(f"squeeze: axis {i} of shape {x.shape} has size {x.shape[i]}, not 1")
    return axes


squeeze = _layout_op(
    "squeeze", "Remove axes of size 1 (all of them when axis is None).",
    lambda x, *, axis=None: tuple(n for i, n in enumerate(x.shape) if i not in _squeeze_axes(x, axis)),
    lambda x, *, axis=None: np.squeeze(x, axis=_squeeze_axes(Aval.of(x), axis)),
    _reshape_back, params=("axis",),
    examples=lambda n, rng, dt: [((matrices(n, rng, dt, 1)[0][:1],), {"axis": (0,)})],
)  # fmt: skip


def _expand_shape(x: Aval, *, axis: Any) -> tuple[int, ...]:
    n_new = 1 if isinstance(axis, (int, np.integer)) else len(axis) if isinstance(axis, (tuple, list)) else 0
    axes = normalize_axes("expand_dims", axis, x.shape, ndim=len(x.shape) + n_new)
    rest = iter(x.shape)
    return tuple(1 if i in axes else next(rest) for i in range(len(x.shape) + len(axes)))


expand_dims = _layout_op(
    "expand_dims", "Insert axes of size 1 at the given positions of the result.",
    _expand_shape, lambda x, *, axis: np.reshape(x, _expand_shape(Aval.of(x), axis=axis)),
    _reshape_back, params=("axis",),
    examples=lambda n, rng, dt: [((matrices(n, rng, dt, 1)[0],), {"axis": (0,)})],
)  # fmt: skip


# -- broadcast_to ---------------------------------------------------------------------------


def _broadcast_to_shape(x: Aval, *, shape: Any) -> tuple[int, ...]:
    shape = shape_param("broadcast_to", shape)
    try:
        ok = len(shape) >= len(x.shape) and np.broadcast_shapes(x.shape, shape) == shape
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"broadcast_to: shape {x.shape} does not broadcast to {shape}")
    return shape


broadcast_to = _layout_op(
    "broadcast_to", "A read-only view of x broadcast to a shape.",
    _broadcast_to_shape, lambda x, *, shape: np.broadcast_to(x, _broadcast_to_shape(Aval.of(x), shape=shape)),
    lambda g, x, *, shape: (unbroadcast(g, np.shape(x)),), params=("shape",),
    examples=lambda n, rng, dt: [((rng.standard_normal(n).astype(dt),), {"shape": (n, n)})],
)  # fmt: skip


# -- getitem --------------------------------------------------------------------------------


def _basic_index(index: Any) -> tuple:
    """index as a tuple of ints, slices, None and Ellipsis; ValueError for anything else."""
    index = index if isinstance(index, tuple) else (index,)

    def basic_int(v: Any) -> bool:
        return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))

    for entry in index:
        ok = entry is None or entry is Ellipsis or basic_int(entry)
        if isinstance(entry, slice):
            ok = all(p is None or basic_int(p) for p in (entry.start, entry.stop, entry.step)) and entry.step != 0
        if not ok:
            raise ValueError(
                f"getitem: index entry {entry!r} is not an int, slice of ints, None or Ellipsis "
                "(fancy and boolean indexing are not catalog operations)"
            )
    return index


def _getitem_shape(x: Aval, *, index: Any) -> tuple[int, ...]:
    try:
        return _standin(x)[_basic_index(index)].shape
    except IndexError as e:
        raise LayoutIndexError(f"getitem: index {index!r} for shape {x.shape}: {e}") from None


def _getitem_vjp(g: Any, x: Any, *, index: Any) -> tuple:
    out = np.zeros(np.shape(x), dtype=np.result_type(g))
    out[_basic_index(index)] = g
    return (out,)


getitem = _layout_op(
    "getitem", "Basic indexing x[index] with ints, slices, None and Ellipsis.",
    _getitem_shape, lambda x, *, index: np.asarray(x)[_basic_index(index)],
    _getitem_vjp, params=("index",),
    examples=lambda n, rng, dt: [((matrices(n, rng, dt, 1)[0],), {"index": (slice(1, None, 2), 0)})],
)  # fmt: skip


# -- astype -----------------------------------------------------------------------------------


def _astype_dtype(x: Aval, *, dtype: Any) -> np.dtype:
    check_dtype("astype", x.dtype)
    return check_dtype("astype", dtype)


def _astype_vjp(g: Any, x: Any, *, dtype: Any) -> tuple:
    source = np.result_type(x)
    return (np.asarray(g).astype(source) if source.kind in "fc" else None,)


astype = _layout_op(
    "astype", "x converted to another numeric dtype (NumPy's unsafe casting, a copy).",
    lambda x, *, dtype: x.shape, lambda x, *, dtype: np.asarray(x).astype(check_dtype("astype", dtype)),
    _astype_vjp, dtype_rule=_astype_dtype, params=("dtype",), text_params={"dtype": r"[<>]?[a-z]+[0-9]*"},
    examples=lambda n, rng, dt: [((matrices(n, rng, dt, 1)[0],), {"dtype": "float32"})],
)  # fmt: skip


# -- concatenate, stack -----------------------------------------------------------------------


def _joined_dtype(*xs: Aval, axis: int = 0) -> np.dtype:
    """NumPy converts every operand to an array first, so Python numbers are not weak here."""
    return np.result_type(*(check_dtype("concatenate/stack", a.dtype) for a in xs))


def _joined(opname: str, avals: tuple[Aval, ...]) -> None:
    if not avals:
        raise ValueError(f"{opname}: needs at least one array")
    if any(a.shape == () for a in avals) and opname == "concatenate":
        raise ValueError(f"concatenate: zero-dimensional arrays cannot be concatenated (shapes {[a.shape for a in avals]})")


def _concatenate_shape(*xs: Aval, axis: int = 0) -> tuple[int, ...]:
    _joined("concatenate", xs)
    ax = normalize_axes("concatenate", axis, xs[0].shape)[0]
    shapes = [a.shape for a in xs]
    if any(len(s) != len(shapes[0]) or s[:ax] + s[ax + 1 :] != shapes[0][:ax] + shapes[0][ax + 1 :] for s in shapes):
        raise ValueError(f"concatenate: shapes {' and '.join(map(str, shapes))} differ outside axis {axis}")
    return shapes[0][:ax] + (sum(s[ax] for s in shapes),) + shapes[0][ax + 1 :]


def _concatenate_vjp(g: Any, *xs: Any, axis: int = 0) -> tuple:
    ax = normalize_axes("concatenate", axis, np.shape(xs[0]))[0]
    return tuple(np.split(g, np.cumsum([np.shape(x)[ax] for x in xs])[:-1], axis=ax))


concatenate = _layout_op(
    "concatenate", "Join arrays along an existing axis.",
    _concatenate_shape, lambda *xs, axis=0: np.concatenate(xs, axis=axis),
    _concatenate_vjp, dtype_rule=_joined_dtype, arity=None, params=("axis",),
    examples=lambda n, rng, dt: [(tuple(matrices(n, rng, dt)), {"axis": 0})],
)  # fmt: skip


def _stack_shape(*xs: Aval, axis: int = 0) -> tuple[int, ...]:
    _joined("stack", xs)
    shapes = [a.shape for a in xs]
    if any(s != shapes[0] for s in shapes):
        raise ValueError(f"stack: shapes {' and '.join(map(str, shapes))} are not all equal")
    ax = normalize_axes("stack", axis, shapes[0], ndim=len(shapes[0]) + 1)[0]
    return shapes[0][:ax] + (len(xs),) + shapes[0][ax:]


def _stack_vjp(g: Any, *xs: Any, axis: int = 0) -> tuple:
    ax = normalize_axes("stack", axis, np.shape(xs[0]), ndim=np.ndim(xs[0]) + 1)[0]
    return tuple(np.moveaxis(g, ax, 0))


stack = _layout_op(
    "stack", "Join arrays of one shape along a new axis.",
    _stack_shape, lambda *xs, axis=0: np.stack(xs, axis=axis),
    _stack_vjp, dtype_rule=_joined_dtype, arity=None, params=("axis",),
    examples=lambda n, rng, dt: [(tuple(matrices(n, rng, dt)), {"axis": 1})],
)  # fmt: skip


# -- take (integer-array indexing) --------------------------------------------------------------


def _take_axis(opname: str, x: Aval, axis: Any) -> int:
    return normalize_axes(opname, axis, x.shape)[0]


def _take_indices(x: Aval, indices: Any, axis: Any) -> tuple[int, np.ndarray]:
    """(axis, indices as an intp array); LayoutIndexError naming the op and axis for an index out of range."""
    ax = _take_axis("take", x, axis)
    idx = np.asarray(indices)
    if idx.size == 0:
        idx = idx.astype(np.intp)
    if idx.dtype.kind not in "iu":
        raise ValueError(f"take: indices must be integers, got {indices!r}")
    n = x.shape[ax]
    bad = idx[(idx < -n) | (idx >= n)]
    if bad.size:
        raise LayoutIndexError(f"take: index {int(bad.reshape(-1)[0])} is out of bounds for axis {ax} with size {n} "
                               f"(shape {x.shape})")
    return ax, idx.astype(np.intp)


def _take_shape(x: Aval, *, indices: Any, axis: int) -> tuple[int, ...]:
    ax, idx = _take_indices(x, indices, axis)
    return x.shape[:ax] + idx.shape + x.shape[ax + 1 :]


def _take(x: Any, *, indices: Any, axis: int) -> Any:
    ax, idx = _take_indices(Aval.of(x), indices, axis)
    return np.take(x, idx, axis=ax)


def _take_vjp(g: Any, x: Any, *, indices: Any, axis: int) -> tuple:
    ax, idx = _take_indices(Aval.of(x), indices, axis)
    out = np.zeros(np.shape(x), dtype=np.result_type(g))
    moved = np.moveaxis(out, ax, 0)
    gm = np.moveaxis(np.asarray(g), tuple(range(ax, ax + idx.ndim)), tuple(range(idx.ndim)))
    np.add.at(moved, idx.reshape(-1), gm.reshape((-1,) + moved.shape[1:]))
    return (out,)


take = _layout_op(
    "take", "Integer-array indexing: x's entries at integer indices along one axis (np.take).",
    _take_shape, _take, _take_vjp, params=("indices", "axis"),
    examples=lambda n, rng, dt: [((matrices(n, rng, dt, 1)[0],), {"indices": (n - 1, 0, -1, 1 % n, 0), "axis": 1}),
                                 ((matrices(n, rng, dt, 1)[0],), {"indices": (), "axis": 0})],
)  # fmt: skip


# -- pad --------------------------------------------------------------------------------------------

PAD_MODES = ("constant", "edge", "reflect", "symmetric", "wrap")


def _pad_widths(opname: str, x: Aval, pad_width: Any) -> tuple[tuple[int, int], ...]:
    """NumPy's pad_width (an int, a pair, or a pair per axis) as one (before, after) pair per axis."""
    try:
        w = np.asarray(pad_width)
        if w.dtype.kind not in "iu" and not (w.size == 0 and len(x.shape) == 0):
            raise ValueError
        w = np.broadcast_to(w.astype(np.int64), (len(x.shape), 2))
    except (ValueError, TypeError):
        raise ValueError(f"{opname}: pad_width {pad_width!r} is not an int, a pair, or a pair per axis of shape {x.shape}") from None
    if (w < 0).any():
        raise ValueError(f"{opname}: pad_width {pad_width!r} has negative widths")
    return tuple((int(b), int(a)) for b, a in w)


def _pad_shape(x: Aval, *, pad_width: Any, mode: str = "constant", constant_values: Any = 0) -> tuple[int, ...]:
    if mode not in PAD_MODES:
        raise ValueError(f"pad: mode {mode!r} is not one of {PAD_MODES}")
    widths = _pad_widths("pad", x, pad_width)
    for d, ((b, a), n) in enumerate(zip(widths, x.shape)):
        if mode != "constant" and n == 0 and (b or a):
            raise ValueError(f"pad: cannot pad the empty axis {d} of shape {x.shape} in mode {mode!r}")
    if not isinstance(constant_values, (int, float, bool, np.number, np.bool_)):
        raise ValueError(f"pad: constant_values must be one number, got {constant_values!r}")
    return tuple(n + b + a for n, (b, a) in zip(x.shape, widths))


def _pad(x: Any, *, pad_width: Any, mode: str = "constant", constant_values: Any = 0) -> Any:
    widths = _pad_widths("pad", Aval.of(x), pad_width)
    _pad_shape(Aval.of(x), pad_width=widths, mode=mode, constant_values=constant_values)
    extra = {"constant_values": constant_values} if mode == "constant" else {}
    return np.pad(x, widths, mode=mode, **extra)


def _pad_vjp(g: Any, x: Any, *, pad_width: Any, mode: str = "constant", constant_values: Any = 0) -> tuple:
    if mode != "constant":
        raise NotImplementedError(f"pad: no gradient for mode {mode!r}")
    widths = _pad_widths("pad", Aval.of(x), pad_width)
    return (np.asarray(g)[tuple(slice(b, b + n) for (b, _), n in zip(widths, np.shape(x)))],)


pad = _layout_op(
    "pad", "x padded along each axis (np.pad: constant, edge, reflect, symmetric or wrap).",
    _pad_shape, _pad, _pad_vjp, params=("pad_width", "mode", "constant_values"),
    text_params={"mode": "|".join(PAD_MODES)},
    examples=lambda n, rng, dt: [((matrices(n, rng, dt, 1)[0],), {"pad_width": ((1, 2), (0, 3)), "mode": m,
                                                                  **({"constant_values": 2} if m == "constant" else {})})
                                 for m in PAD_MODES],
)  # fmt: skip


# -- gather (torch.gather / np.take_along_axis: the indices are an operand) -----------------------


def _gather_check(x: Aval, index: Aval, axis: Any) -> int:
    if np.dtype(index.dtype).kind not in "iu":
        raise ValueError(f"gather: the index must be integers, got dtype {index.dtype}")
    if len(index.shape) != len(x.shape):
        raise ValueError(f"gather: index shape {index.shape} and x shape {x.shape} differ in rank")
    ax = _take_axis("gather", x, axis)
    for d, (i, n) in enumerate(zip(index.shape, x.shape)):
        if d != ax and i > n:
            raise ValueError(f"gather: index shape {index.shape} exceeds x shape {x.shape} along axis {d}")
    return ax


def _gather_shape(x: Aval, index: Aval, *, axis: int) -> tuple[int, ...]:
    _gather_check(x, index, axis)
    return tuple(index.shape)


def _gather_dtype(x: Aval, index: Aval, *, axis: int) -> np.dtype:
    return check_dtype("gather", x.dtype)


def _gather(x: Any, index: Any, *, axis: int) -> Any:
    ax = _gather_check(Aval.of(x), Aval.of(index), axis)
    n = x.shape[ax]
    if index.size and ((index < -n) | (index >= n)).any():
        raise LayoutIndexError(f"gather: an index is out of bounds for axis {ax} with size {n} (shape {x.shape})")
    x = x[tuple(slice(None) if d == ax else slice(0, i) for d, i in enumerate(index.shape))]
    return np.take_along_axis(x, index.astype(np.intp), axis=ax)


def _gather_vjp(g: Any, x: Any, index: Any, *, axis: int) -> tuple:
    ax = _gather_check(Aval.of(x), Aval.of(index), axis)
    out = np.zeros(np.shape(x), dtype=np.result_type(g))
    view = out[tuple(slice(None) if d == ax else slice(0, i) for d, i in enumerate(np.shape(index)))]
    grid = list(np.indices(np.shape(index), sparse=True))
    grid[ax] = np.asarray(index) % max(np.shape(x)[ax], 1)
    np.add.at(view, tuple(grid), g)
    return (out, None)


gather = _layout_op(
    "gather", "x's entries at an integer index array along one axis (torch.gather, np.take_along_axis).",
    _gather_shape, _gather, _gather_vjp, dtype_rule=_gather_dtype, arity=2, params=("axis",),
    examples=lambda n, rng, dt: [((matrices(n, rng, dt, 1)[0], rng.integers(-n, n, size=(max(n - 1, 1), 2 * n))),
                                  {"axis": 1}),
                                 ((matrices(n, rng, dt, 1)[0], rng.integers(0, n, size=(n, n))), {"axis": 0})],
)  # fmt: skip
