"""``ga.Array``: a dask collection whose every task is a catalog operation.

The class follows ``dask.array.Array``'s shape (see DEVELOPERS' design examples): a
``HighLevelGraph`` with one layer per array, block keys ``(name, i, j, ...)`` nested
like the block grid, ``finalize`` for compute and ``_rebuild`` for persist.  Graph
values are only ``CatalogTask``, ``DataNode``, ``Alias`` and lab-only loader tasks
(:mod:`goblin_dask.array.sources`).  Names are ``<op>-<token>``: nothing a researcher
named reaches a key.  Shapes and dtypes are checked on abstract values when an array
is built, so bad input fails before anything is dispatched.

``__dask_optimize__`` culls and then inserts the lab's checks
(:func:`goblin_dask.validation.checks.insert_checks`); it never uses dask's low-level
fusion, which would hide catalog ops inside ``_execute_subgraph`` tasks.
"""

from __future__ import annotations

import bisect
import itertools
import math
import numbers
from typing import Any, Iterable, Sequence

import numpy as np
from dask.base import DaskMethodsMixin, tokenize
from dask.threaded import get as threaded_get
from dask.highlevelgraph import HighLevelGraph
from dask._task_spec import TaskRef

from goblin_dask.array.placement import placement_for
from goblin_dask.ops import CatalogTask, get
from goblin_dask.ops._factories import check_dtype
from goblin_dask.ops.spec import Aval

#: Types an operand may have besides ga.Array (anything else: the other operand's turn).
SCALAR_TYPES = (numbers.Number, np.generic, bool)


# -- chunks ---------------------------------------------------------------------------------

def normalize_chunks(chunks: Any, shape: tuple[int, ...], dtype: np.dtype, *, where: str = "chunks",
                     previous: tuple | None = None) -> tuple[tuple[int, ...], ...]:
    """Chunks as a tuple of tuples of block sizes; ``ValueError`` naming what is wrong."""
    from dask.array.core import normalize_chunks as dask_normalize

    if isinstance(chunks, dict):
        chunks = tuple(chunks.get(i, chunks.get(i - len(shape), -1)) for i in range(len(shape)))
    if isinstance(chunks, (tuple, list)) and len(chunks) != len(shape) and not all(isinstance(c, numbers.Integral) for c in chunks):
        raise ValueError(f"{where}: chunks {chunks!r} have {len(chunks)} entries for shape {shape} ({len(shape)} axes)")
    for c in chunks if isinstance(chunks, (tuple, list)) else (chunks,):
        if isinstance(c, numbers.Integral) and not isinstance(c, bool) and c <= 0 and c != -1:
            raise ValueError(f"{where}: block size {c} in chunks {chunks!r} must be positive (or -1 for the whole axis)")
    try:
        out = dask_normalize(chunks, shape, dtype=dtype, previous_chunks=previous)
    except (ValueError, TypeError, NotImplementedError) as e:
        raise ValueError(f"{where}: bad chunks {chunks!r} for shape {shape}: {e}") from None
    out = tuple(tuple(int(b) for b in c) for c in out)
    for c, n in zip(out, shape):
        if sum(c) != n or any(b < 0 for b in c):
            raise ValueError(f"{where}: chunks {c} do not add up to axis length {n} (shape {shape})")
    return out


def offsets_of(chunks: Sequence[int]) -> list[int]:
    return [0, *itertools.accumulate(chunks)]


def _block_slices(chunks: tuple[tuple[int, ...], ...], idx: tuple[int, ...]) -> tuple[slice, ...]:
    out = []
    for c, i in zip(chunks, idx):
        lo = sum(c[:i])
        out.append(slice(lo, lo + c[i]))
    return tuple(out)


def _common_chunks(*chunkings: tuple[int, ...]) -> tuple[int, ...]:
    """The coarsest chunking that refines every given chunking of one axis."""
    if all(c == chunkings[0] for c in chunkings):
        return chunkings[0]
    bounds = sorted(set().union(*(offsets_of(c) for c in chunkings)))
    return tuple(b - a for a, b in zip(bounds, bounds[1:])) or (0,)


# -- the collection ---------------------------------------------------------------------------

class Array(DaskMethodsMixin):
    """An n-dimensional array cut into blocks, computed by catalog operations on the grid."""

    __array_priority__ = 11  # ahead of numpy, behind xarray (which wraps us)

    def __init__(self, dask_graph: Any, name: str, chunks: tuple[tuple[int, ...], ...], dtype: Any,
                 source: "Any | None" = None):
        if not isinstance(dask_graph, HighLevelGraph):
            dask_graph = HighLevelGraph.from_collections(name, dask_graph, dependencies=())
        self.dask = dask_graph
        self.name = name
        self.chunks = tuple(tuple(int(b) for b in c) for c in chunks)
        self.dtype = np.dtype(dtype)
        self._source = source  # how to re-block the lab's data directly (from_array), or None

    # -- dask collection protocol ----------------------------------------------------
    def __dask_graph__(self) -> HighLevelGraph:
        return self.dask

    def __dask_layers__(self) -> tuple[str, ...]:
        return (self.name,)

    def __dask_keys__(self) -> list:
        if self.ndim == 0:
            return [(self.name,)]

        def nest(prefix: tuple, depth: int):
            if depth == self.ndim:
                return (self.name, *prefix)
            return [nest(prefix + (i,), depth + 1) for i in range(len(self.chunks[depth]))]

        return nest((), 0)

    def __dask_tokenize__(self):
        return self.name

    @staticmethod
    def __dask_optimize__(dsk, keys, **kwargs):
        from goblin_dask.array.graph import optimize

        return optimize(dsk, keys)

    __dask_scheduler__ = staticmethod(threaded_get)

    def __dask_postcompute__(self):
        return finalize, ()

    def __dask_postpersist__(self):
        return self._rebuild, ()

    def _rebuild(self, dsk, *, rename=None):
        name = (rename or {}).get(self.name, self.name)
        return Array(dsk, name, self.chunks, self.dtype)

    # -- metadata ------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(sum(c) for c in self.chunks)

    @property
    def ndim(self) -> int:
        return len(self.chunks)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def numblocks(self) -> tuple[int, ...]:
        return tuple(len(c) for c in self.chunks)

    @property
    def npartitions(self) -> int:
        return math.prod(self.numblocks)

    @property
    def chunksize(self) -> tuple[int, ...]:
        return tuple(max(c) if c else 0 for c in self.chunks)

    @property
    def aval(self) -> Aval:
        return Aval(self.shape, self.dtype)

    def __len__(self) -> int:
        if not self.ndim:
            raise TypeError("len() of a 0-d ga.Array")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"ga.Array<shape={self.shape}, dtype={self.dtype}, chunksize={self.chunksize}, blocks={self.npartitions}>"

    __hash__ = object.__hash__

    def key(self, idx: tuple[int, ...]) -> tuple:
        return (self.name, *idx)

    def ref(self, idx: tuple[int, ...]) -> TaskRef:
        return TaskRef(self.key(idx))

    def block_aval(self, idx: tuple[int, ...]) -> Aval:
        return Aval(tuple(c[i] for c, i in zip(self.chunks, idx)), self.dtype)

    def block_indices(self) -> Iterable[tuple[int, ...]]:
        return itertools.product(*(range(n) for n in self.numblocks))

    # -- conversion ----------------------------------------------------------------------
    def __array__(self, dtype=None, copy=None):
        out = np.asarray(self.compute())
        return out.astype(dtype, copy=False) if dtype is not None else out

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        from goblin_dask.array.numpy_api import array_ufunc

        return array_ufunc(ufunc, method, inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        from goblin_dask.array.numpy_api import array_function

        return array_function(func, types, args, kwargs)

    def __bool__(self) -> bool:
        if self.size != 1:
            raise ValueError(f"the truth value of a ga.Array of shape {self.shape} is ambiguous")
        return bool(self.compute())

    def __float__(self) -> float:
        return float(self.compute())

    def __int__(self) -> int:
        return int(self.compute())

    # -- methods (implemented in the sibling modules) --------------------------------------
    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True) -> "Array":
        return astype(self, dtype)

    def rechunk(self, chunks="auto") -> "Array":
        from goblin_dask.array.layout import rechunk

        return rechunk(self, chunks)

    def __getitem__(self, index) -> "Array":
        from goblin_dask.array.layout import getitem

        return getitem(self, index)

    def transpose(self, *axes) -> "Array":
        from goblin_dask.array.layout import transpose

        return transpose(self, axes[0] if len(axes) == 1 and not isinstance(axes[0], int) else (axes or None))

    @property
    def T(self) -> "Array":
        return self.transpose()

    def reshape(self, *shape, order="C") -> "Array":
        from goblin_dask.array.layout import reshape

        if order != "C":
            raise ValueError(f"reshape: only C order is supported, got order={order!r}")
        return reshape(self, shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape)

    def ravel(self) -> "Array":
        return self.reshape(-1)

    def squeeze(self, axis=None) -> "Array":
        from goblin_dask.array.layout import squeeze

        return squeeze(self, axis)

    def dot(self, other) -> "Array":
        from goblin_dask.array.linalg import dot

        return dot(self, other)

    def __matmul__(self, other):
        from goblin_dask.array.linalg import matmul

        return matmul(self, other) if _is_operand(other) else NotImplemented

    def __rmatmul__(self, other):
        from goblin_dask.array.linalg import matmul

        return matmul(other, self) if _is_operand(other) else NotImplemented

    def clip(self, min=None, max=None) -> "Array":
        return clip(self, min, max)

    def round(self, decimals: int = 0) -> "Array":
        if decimals != 0:
            raise ValueError("round: only decimals=0 is in the catalog (rint)")
        return elementwise("rint", self)

    def copy(self) -> "Array":
        return self


def _is_operand(x: Any) -> bool:
    return isinstance(x, (Array, np.ndarray, list, tuple) + SCALAR_TYPES)


# reductions as methods
def _add_reduction_methods() -> None:
    from goblin_dask.array import reductions

    for name in ("sum", "prod", "mean", "max", "min", "argmax", "argmin", "var", "std", "any", "all"):
        def method(self, *args, _f=getattr(reductions, name), **kwargs):
            return _f(self, *args, **kwargs)

        method.__name__ = name
        method.__doc__ = getattr(reductions, name).__doc__
        setattr(Array, name, method)


# arithmetic operators
_BINARY = {
    "add": "add", "sub": "subtract", "mul": "multiply", "truediv": "divide", "floordiv": "floor_divide",
    "mod": "remainder", "pow": "power", "and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor",
    "lshift": "left_shift", "rshift": "right_shift",
}
_COMPARE = {"eq": "equal", "ne": "not_equal", "lt": "less", "le": "less_equal", "gt": "greater", "ge": "greater_equal"}
_UNARY = {"neg": "negative", "pos": "positive", "abs": "absolute", "invert": "invert"}


def _add_operators() -> None:
    def binary(op, reflected):
        def method(self, other):
            if not _is_operand(other):
                return NotImplemented
            return elementwise(op, other, self) if reflected else elementwise(op, self, other)

        return method

    for dunder, op in _BINARY.items():
        setattr(Array, f"__{dunder}__", binary(op, False))
        setattr(Array, f"__r{dunder}__", binary(op, True))
    for dunder, op in _COMPARE.items():
        setattr(Array, f"__{dunder}__", binary(op, False))
    for dunder, op in _UNARY.items():
        setattr(Array, f"__{dunder}__", lambda self, _op=op: elementwise(_op, self))


_add_operators()


# -- building graphs ------------------------------------------------------------------------

def new_name(prefix: str, *args: Any) -> str:
    return f"{prefix}-{tokenize(prefix, *args)}"


def from_graph(name: str, layer: dict, chunks, dtype, dependencies: Sequence[Array] = (), source=None) -> Array:
    graph = HighLevelGraph.from_collections(name, layer, dependencies=list(dependencies))
    return Array(graph, name, chunks, dtype, source=source)


def catalog_task(key: Any, opname: str, *operands: Any, avals: Sequence[Any] | None = None, **params: Any) -> CatalogTask:
    """A CatalogTask placed by cost (see :mod:`goblin_dask.array.placement`)."""
    op = get(opname)
    placement = placement_for(op, *(avals if avals is not None else operands), **params)
    return CatalogTask(key, op, *operands, placement=placement, **params)


def finalize(results: Any) -> np.ndarray:
    """Assemble block results nested like the keys into one numpy array."""
    from dask.array.core import concatenate3

    if not isinstance(results, list):
        return np.asarray(results)
    depth, r = 0, results
    while isinstance(r, list):
        depth, r = depth + 1, r[0]
    if depth == 1 and not np.ndim(r):  # 0-d array: one block
        return np.asarray(results[0])
    return np.asarray(concatenate3(results))


# -- conversion from the lab's data -------------------------------------------------------------

def asarray(x: Any, dtype=None, chunks="auto") -> Array:
    """``x`` as a ga.Array (unchanged when it already is one)."""
    if isinstance(x, Array):
        return x if dtype is None else astype(x, dtype)
    if dtype is not None:
        x = np.asarray(x, dtype=dtype)
    return from_array(x, chunks=chunks)


def from_array(x: Any, chunks: Any = "auto"):
    """The lab's data as blocks: a numpy array, an ``np.memmap``, or an xarray object.

    Blocks are cut where the data is (the lab worker reads each block of a memmap from
    its file); only the numbers travel on, never names, attributes or file paths.  An
    ``xarray.DataArray``/``Dataset`` comes back as the same xarray object whose numeric
    variables are ga.Arrays (names and attributes stay in the researcher's process).
    ``chunks`` may be ``"auto"``, an int, a tuple (per axis) or, for xarray, a dict by dim.
    """
    from goblin_dask.array import sources

    if isinstance(x, Array):
        return x if chunks == "auto" else x.rechunk(chunks)
    xr_out = sources.from_xarray(x, chunks)
    if xr_out is not None:
        return xr_out
    return sources.from_numpy_like(x, chunks)


# -- elementwise ------------------------------------------------------------------------------

def _as_operand(x: Any) -> Any:
    if isinstance(x, Array):
        return x
    if isinstance(x, (bool, int, float, complex)):
        return x
    if isinstance(x, np.generic):
        check_dtype("ga", x.dtype)
        return x
    a = np.asarray(x)
    if a.ndim == 0:
        check_dtype("ga", a.dtype)
        return a[()]
    return asarray(a)


def elementwise(opname: str, *args: Any, **params: Any) -> Array:
    """One catalog op applied block by block, with NumPy broadcasting and aligned blocks."""
    op = get(opname)
    operands = [_as_operand(a) for a in args]
    full = [a.aval if isinstance(a, Array) else a for a in operands]
    out = op.abstract_eval(*full, **params)  # raises ValueError / TypeError before anything runs
    ndim = len(out.shape)
    arrays = [a for a in operands if isinstance(a, Array)]
    if not arrays:
        raise TypeError(f"{opname}: needs at least one array operand")
    # Unify the chunks of every axis that is not broadcast.
    chunks = []
    for d in range(ndim):
        along = [a.chunks[d - (ndim - a.ndim)] for a in arrays
                 if d - (ndim - a.ndim) >= 0 and a.shape[d - (ndim - a.ndim)] == out.shape[d] and out.shape[d] != 1]
        chunks.append(_common_chunks(*along) if along else (out.shape[d],))
    chunks = tuple(chunks)
    aligned = []
    for a in operands:
        if isinstance(a, Array):
            want = tuple(chunks[d + ndim - a.ndim] if a.shape[d] == out.shape[d + ndim - a.ndim] and a.shape[d] != 1
                         else a.chunks[d] for d in range(a.ndim))
            if want != a.chunks:
                from goblin_dask.array.layout import rechunk

                a = rechunk(a, want)
        aligned.append(a)
    name = new_name(opname, *[a.name if isinstance(a, Array) else a for a in aligned], params)
    layer = {}
    for idx in itertools.product(*(range(len(c)) for c in chunks)):
        refs, avals = [], []
        for a in aligned:
            if isinstance(a, Array):
                aidx = tuple(0 if a.shape[d] == 1 and out.shape[d + ndim - a.ndim] != 1 else idx[d + ndim - a.ndim]
                             for d in range(a.ndim))
                refs.append(a.ref(aidx))
                avals.append(a.block_aval(aidx))
            else:
                refs.append(a)
                avals.append(a)
        key = (name, *idx)
        layer[key] = catalog_task(key, opname, *refs, avals=avals, **params)
    return from_graph(name, layer, chunks, out.dtype, dependencies=[a for a in aligned if isinstance(a, Array)])


def astype(x: Array, dtype: Any) -> Array:
    dt = check_dtype("astype", dtype)
    if dt == x.dtype:
        return x
    return elementwise("astype", x, dtype=dt.str if dt.byteorder not in "=|" else dt.name)


def where(cond: Any, x: Any = None, y: Any = None) -> Array:
    """``x`` where ``cond`` is true, else ``y`` (the one-argument form is not supported)."""
    if x is None or y is None:
        raise TypeError("where: needs cond, x and y (the one-argument form has a data-dependent shape)")
    return elementwise("where", cond, x, y)


def clip(x: Any, a_min: Any = None, a_max: Any = None) -> Array:
    x = asarray(x)
    lo = -np.inf if a_min is None else a_min
    hi = np.inf if a_max is None else a_max
    if x.dtype.kind in "iub":
        info = np.iinfo(x.dtype) if x.dtype.kind != "b" else None
        lo = (info.min if info else 0) if a_min is None else a_min
        hi = (info.max if info else 1) if a_max is None else a_max
    return elementwise("clip", x, lo, hi)


def formula(text: str, **variables: Any) -> Array:
    """``formula("a * exp(-b) + c", a=x, b=y, c=2.0)``: one fused catalog kernel over the variables.

    The expression language is parsed with ``ast`` against an allow-list
    (:mod:`goblin_dask.ops.formula`); variable names never travel: the task carries a
    canonical expression over ``x0..xN``.
    """
    from goblin_dask.ops.formula import compile_formula

    names = list(variables)
    expr = compile_formula(text, names)
    return elementwise("formula", *(variables[n] for n in names), expr=expr)


def block_of(chunks: tuple[int, ...], position: int) -> tuple[int, int]:
    """(block index, offset within it) of ``position`` along an axis."""
    offs = offsets_of(chunks)
    b = bisect.bisect_right(offs, position) - 1
    b = min(b, len(chunks) - 1)
    return b, position - offs[b]


__all__ = ["Array", "asarray", "astype", "clip", "elementwise", "formula", "from_array", "where"]
