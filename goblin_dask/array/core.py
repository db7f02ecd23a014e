"""``ga.Array``: a dask collection whose every task is a catalog operation.

The class follows ``dask.array.Array``'s shape (see DEVELOPERS' design examples): a
``HighLevelGraph`` with one layer per array, block keys ``(name, i, j, ...)`` nested
like the block grid, ``finalize`` for compute and ``_rebuild`` for persist.  Graph
values are only ``CatalogTask``, ``DataNode``, ``Alias`` and lab-only loader tasks
(:mod:`goblin_dask.array.sources`).  Names are ``<op>-<token>``
(:mod:`goblin_dask.array.keys`): nothing a researcher named reaches a key.  Shapes and
dtypes are checked on abstract values when an array is built, so bad input fails
before anything is dispatched.

Python's operators are the catalog's: ``x + y`` is the op that declares
``operator.add`` (``OpSpec.operator``), applied through :meth:`Array._catalog`.  Methods
and functions take NumPy's keywords; one ga cannot honour is a TypeError naming it.

``__dask_optimize__`` culls and then inserts the lab's checks
(:func:`goblin_dask.validation.checks.insert_checks`); it never uses dask's low-level
fusion, which would hide catalog ops inside ``_execute_subgraph`` tasks.
"""

from __future__ import annotations

import bisect
import itertools
import math
import numbers
import operator
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
from dask.base import DaskMethodsMixin
from dask.threaded import get as threaded_get
from dask.highlevelgraph import HighLevelGraph
from dask._task_spec import TaskRef

from goblin_dask.array.keys import block_key, new_name
from goblin_dask.array.numpy_api import implements
from goblin_dask.array.placement import placement_reason
from goblin_dask.ops import CatalogTask, get
from goblin_dask.ops._factories import check_dtype
from goblin_dask.ops.registry import by_operator
from goblin_dask.ops.spec import Aval

#: Types an operand may have besides ga.Array (anything else: the other operand's turn).
SCALAR_TYPES = (numbers.Number, np.generic, bool)


def refuse(func: str, **given: bool) -> None:
    """TypeError naming the NumPy keywords ``func`` was given that ga cannot honour.

    Pass each keyword as whether it was given a value other than NumPy's default:
    ``refuse("sum", out=out is not None, where=where is not True)``.
    """
    names = [k for k, v in given.items() if v]
    if names:
        hint = " (use the returned array)" if "out" in names else ""
        raise TypeError(f"{func}() got keyword argument(s) {', '.join(repr(n) for n in names)} that ga.Array "
                        f"does not support{hint}")


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


def _common_chunks(*chunkings: tuple[int, ...]) -> tuple[int, ...]:
    """The coarsest chunking that refines every given chunking of one axis."""
    if all(c == chunkings[0] for c in chunkings):
        return chunkings[0]
    bounds = sorted(set().union(*(offsets_of(c) for c in chunkings)))
    return tuple(b - a for a, b in zip(bounds, bounds[1:])) or (0,)


# -- Python's operators -----------------------------------------------------------------------

class Operators:
    """Python's operators as catalog ops: each is the op that declares that operator (``OpSpec.operator``).

    Every operator goes through one hook, ``_catalog(op, *inputs)``; an operand that is no
    array or number gives NotImplemented (the other operand's turn), and so does an operator
    no catalog op declares.
    """

    __slots__ = ()

    def _catalog(self, op: str, *inputs: Any, **params: Any) -> Any:
        raise NotImplementedError

    def _operator(self, python_operator: Callable, *operands: Any) -> Any:
        spec = by_operator(python_operator)
        if spec is None or not all(_is_operand(x) for x in operands):
            return NotImplemented
        return self._catalog(spec.name, *operands)

    # arithmetic, and its reflected forms
    def __add__(self, other): return self._operator(operator.add, self, other)  # noqa: E704
    def __radd__(self, other): return self._operator(operator.add, other, self)  # noqa: E704
    def __sub__(self, other): return self._operator(operator.sub, self, other)  # noqa: E704
    def __rsub__(self, other): return self._operator(operator.sub, other, self)  # noqa: E704
    def __mul__(self, other): return self._operator(operator.mul, self, other)  # noqa: E704
    def __rmul__(self, other): return self._operator(operator.mul, other, self)  # noqa: E704
    def __truediv__(self, other): return self._operator(operator.truediv, self, other)  # noqa: E704
    def __rtruediv__(self, other): return self._operator(operator.truediv, other, self)  # noqa: E704
    def __floordiv__(self, other): return self._operator(operator.floordiv, self, other)  # noqa: E704
    def __rfloordiv__(self, other): return self._operator(operator.floordiv, other, self)  # noqa: E704
    def __mod__(self, other): return self._operator(operator.mod, self, other)  # noqa: E704
    def __rmod__(self, other): return self._operator(operator.mod, other, self)  # noqa: E704
    def __pow__(self, other): return self._operator(operator.pow, self, other)  # noqa: E704
    def __rpow__(self, other): return self._operator(operator.pow, other, self)  # noqa: E704
    def __matmul__(self, other): return self._operator(operator.matmul, self, other)  # noqa: E704
    def __rmatmul__(self, other): return self._operator(operator.matmul, other, self)  # noqa: E704
    # bitwise (logical on booleans)
    def __and__(self, other): return self._operator(operator.and_, self, other)  # noqa: E704
    def __rand__(self, other): return self._operator(operator.and_, other, self)  # noqa: E704
    def __or__(self, other): return self._operator(operator.or_, self, other)  # noqa: E704
    def __ror__(self, other): return self._operator(operator.or_, other, self)  # noqa: E704
    def __xor__(self, other): return self._operator(operator.xor, self, other)  # noqa: E704
    def __rxor__(self, other): return self._operator(operator.xor, other, self)  # noqa: E704
    def __lshift__(self, other): return self._operator(operator.lshift, self, other)  # noqa: E704
    def __rlshift__(self, other): return self._operator(operator.lshift, other, self)  # noqa: E704
    def __rshift__(self, other): return self._operator(operator.rshift, self, other)  # noqa: E704
    def __rrshift__(self, other): return self._operator(operator.rshift, other, self)  # noqa: E704
    # comparisons (Python reflects them itself: a < b falls back to b > a)
    def __eq__(self, other): return self._operator(operator.eq, self, other)  # type: ignore[override]  # noqa: E704
    def __ne__(self, other): return self._operator(operator.ne, self, other)  # type: ignore[override]  # noqa: E704
    def __lt__(self, other): return self._operator(operator.lt, self, other)  # noqa: E704
    def __le__(self, other): return self._operator(operator.le, self, other)  # noqa: E704
    def __gt__(self, other): return self._operator(operator.gt, self, other)  # noqa: E704
    def __ge__(self, other): return self._operator(operator.ge, self, other)  # noqa: E704
    # unary
    def __neg__(self): return self._operator(operator.neg, self)  # noqa: E704
    def __pos__(self): return self._operator(operator.pos, self)  # noqa: E704
    def __abs__(self): return self._operator(operator.abs, self)  # noqa: E704
    def __invert__(self): return self._operator(operator.invert, self)  # noqa: E704


def _is_operand(x: Any) -> bool:
    return isinstance(x, (Array, np.ndarray, list, tuple) + SCALAR_TYPES)


# -- the collection ---------------------------------------------------------------------------

class Array(Operators, DaskMethodsMixin):
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

    @property
    def real(self) -> "Array":
        """The real part (the array itself unless complex): with ``imag``, what makes ga a NEP 18 duck array to xarray."""
        return self if self.dtype.kind != "c" else self._catalog("real", self)

    @property
    def imag(self) -> "Array":
        """The imaginary part (zeros unless complex)."""
        if self.dtype.kind == "c":
            return self._catalog("imag", self)
        from goblin_dask.array.creation import zeros

        return zeros(self.shape, dtype=self.dtype, chunks=self.chunks)

    def __len__(self) -> int:
        if not self.ndim:
            raise TypeError("len() of a 0-d ga.Array")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"ga.Array<shape={self.shape}, dtype={self.dtype}, chunksize={self.chunksize}, blocks={self.npartitions}>"

    __hash__ = object.__hash__

    def key(self, idx: tuple[int, ...]) -> tuple:
        return block_key(self.name, idx)

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

    # -- the catalog hook ----------------------------------------------------------------
    def _catalog(self, op: str, *inputs: Any, **params: Any) -> Array:
        """Catalog op ``op`` (a name or alias) on ``inputs``, as a ga.Array: what every operator calls.

        Elementwise ops run block by block with broadcasting (:func:`elementwise`); other ops
        through the blocked algorithm registered for them (``@implements(..., op="matmul")``).
        """
        from goblin_dask.array.numpy_api import BLOCKED

        spec = get(op)
        if spec.elementwise is not None:
            return elementwise(spec.name, *inputs, **params)
        if spec.name not in BLOCKED:
            raise TypeError(f"catalog op {spec.name!r} has no blocked algorithm in goblin_dask.array")
        return BLOCKED[spec.name](*inputs, **params)

    # -- methods (NumPy's signatures; implemented in the sibling modules) -----------------
    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True) -> Array:
        """The array as ``dtype`` (``casting`` as NumPy's: TypeError when the cast is not allowed)."""
        refuse("astype", order=order not in ("K", "A", "C"))
        if not np.can_cast(self.dtype, dtype, casting=casting):
            raise TypeError(f"astype: cannot cast {self.dtype} to {np.dtype(dtype)} according to the rule {casting!r}")
        return astype(self, dtype)

    def rechunk(self, chunks="auto") -> Array:
        """The same array in other blocks (see :func:`goblin_dask.array.rechunk`)."""
        return _layout.rechunk(self, chunks)

    def __getitem__(self, index) -> Array:
        return _layout.getitem(self, index)

    def transpose(self, *axes) -> Array:
        """Axes permuted: ``x.transpose()``, ``x.transpose(1, 0, 2)`` or ``x.transpose((1, 0, 2))``."""
        return _layout.transpose(self, axes[0] if len(axes) == 1 and not isinstance(axes[0], int) else (axes or None))

    @property
    def T(self) -> Array:
        return self.transpose()

    def reshape(self, *shape, order="C", copy=None) -> Array:
        """The same data in a new C-order shape: ``x.reshape(2, 3)`` or ``x.reshape((2, 3))``."""
        return _layout.reshape(self, shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape,
                               order=order, copy=copy)

    def ravel(self, order="C") -> Array:
        return _layout.ravel(self, order)

    def squeeze(self, axis=None) -> Array:
        return _layout.squeeze(self, axis)

    def swapaxes(self, axis1, axis2) -> Array:
        return _layout.swapaxes(self, axis1, axis2)

    def dot(self, b, out=None) -> Array:
        return _linalg.dot(self, b, out)

    def clip(self, min=None, max=None, out=None) -> Array:
        return clip(self, min, max, out)

    def round(self, decimals=0, out=None) -> Array:
        return round(self, decimals, out)

    def copy(self, order="C") -> Array:
        """The array itself: ga arrays are immutable."""
        refuse("copy", order=order not in ("K", "A", "C"))
        return self

    # reductions
    def sum(self, axis=None, dtype=None, out=None, keepdims=False, initial=None, where=True) -> Array:
        """Sum over ``axis`` (see :func:`goblin_dask.array.sum`)."""
        return _reductions.sum(self, axis=axis, dtype=dtype, out=out, keepdims=keepdims, initial=initial, where=where)

    def prod(self, axis=None, dtype=None, out=None, keepdims=False, initial=None, where=True) -> Array:
        """Product over ``axis``."""
        return _reductions.prod(self, axis=axis, dtype=dtype, out=out, keepdims=keepdims, initial=initial, where=where)

    def mean(self, axis=None, dtype=None, out=None, keepdims=False, *, where=True) -> Array:
        """Arithmetic mean over ``axis``."""
        return _reductions.mean(self, axis=axis, dtype=dtype, out=out, keepdims=keepdims, where=where)

    def max(self, axis=None, out=None, keepdims=False, initial=None, where=True) -> Array:
        """Largest value over ``axis`` (NaN propagates)."""
        return _reductions.max(self, axis=axis, out=out, keepdims=keepdims, initial=initial, where=where)

    def min(self, axis=None, out=None, keepdims=False, initial=None, where=True) -> Array:
        """Smallest value over ``axis`` (NaN propagates)."""
        return _reductions.min(self, axis=axis, out=out, keepdims=keepdims, initial=initial, where=where)

    def argmax(self, axis=None, out=None, *, keepdims=False) -> Array:
        """Index of the largest value over ``axis`` (flat when None)."""
        return _reductions.argmax(self, axis=axis, out=out, keepdims=keepdims)

    def argmin(self, axis=None, out=None, *, keepdims=False) -> Array:
        """Index of the smallest value over ``axis`` (flat when None)."""
        return _reductions.argmin(self, axis=axis, out=out, keepdims=keepdims)

    def var(self, axis=None, dtype=None, out=None, ddof=0, keepdims=False, *, where=True, mean=None,
            correction=None) -> Array:
        """Variance over ``axis``."""
        return _reductions.var(self, axis=axis, dtype=dtype, out=out, ddof=ddof, keepdims=keepdims, where=where,
                               mean=mean, correction=correction)

    def std(self, axis=None, dtype=None, out=None, ddof=0, keepdims=False, *, where=True, mean=None,
            correction=None) -> Array:
        """Standard deviation over ``axis``."""
        return _reductions.std(self, axis=axis, dtype=dtype, out=out, ddof=ddof, keepdims=keepdims, where=where,
                               mean=mean, correction=correction)

    def argsort(self, axis=-1, kind=None, order=None, *, stable=None) -> Array:
        """Indices that sort along ``axis``, in the stable order (see :func:`goblin_dask.array.argsort`)."""
        from goblin_dask.array.order import argsort

        return argsort(self, axis=axis, kind=kind, order=order, stable=stable)

    def any(self, axis=None, out=None, keepdims=False, *, where=True) -> Array:
        """Whether any value over ``axis`` is nonzero."""
        return _reductions.any(self, axis=axis, out=out, keepdims=keepdims, where=where)

    def all(self, axis=None, out=None, keepdims=False, *, where=True) -> Array:
        """Whether every value over ``axis`` is nonzero."""
        return _reductions.all(self, axis=axis, out=out, keepdims=keepdims, where=where)


# -- building graphs ------------------------------------------------------------------------

def from_graph(name: str, layer: dict, chunks, dtype, dependencies: Sequence[Array] = (), source=None) -> Array:
    graph = HighLevelGraph.from_collections(name, layer, dependencies=list(dependencies))
    return Array(graph, name, chunks, dtype, source=source)


def catalog_task(key: Any, opname: str, *operands: Any, avals: Sequence[Any] | None = None,
                 placement: str | None = None, why: str | None = None, **params: Any) -> CatalogTask:
    """A CatalogTask placed by cost (see :mod:`goblin_dask.array.placement`), or at ``placement`` when given
    (a product the lab computes itself, whatever its tiles' sizes, and ``why``)."""
    op = get(opname)
    if placement is None:
        placement, why = placement_reason(op, *(avals if avals is not None else operands), **params)
    return CatalogTask(key, op, *operands, placement=placement, why=why, **params)


#: What :func:`blockwise` asks for each output block: ``(operands, their avals or None, params)``.
BlockTask = Callable[[tuple], "tuple[Sequence[Any], Sequence[Any] | None, Mapping[str, Any]]"]


def blockwise(opname: str, chunks: tuple[tuple[int, ...], ...], dtype: Any, block: BlockTask, *,
              token: Sequence[Any], dependencies: Sequence[Array] = ()) -> Array:
    """An array of one catalog task of ``opname`` per output block.

    ``block(index)`` gives the block's operands (TaskRefs to input blocks, or literals),
    their avals (for placement; None: the operands) and the op's parameters.  The array
    is named ``new_name(opname, *token)``, its keys ``(name, *index)``.
    """
    name = new_name(opname, *token)
    layer = {}
    for idx in itertools.product(*(range(len(c)) for c in chunks)):
        operands, avals, params = block(idx)
        key = block_key(name, idx)
        layer[key] = catalog_task(key, opname, *operands, avals=avals, **params)
    return from_graph(name, layer, chunks, dtype, dependencies=dependencies)


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


# -- metadata functions (NumPy's, on ga.Arrays) -------------------------------------------------

@implements(np.shape)
def shape(a) -> tuple[int, ...]:
    return asarray(a).shape


@implements(np.ndim)
def ndim(a) -> int:
    return asarray(a).ndim


@implements(np.size)
def size(a, axis=None) -> int:
    a = asarray(a)
    return a.size if axis is None else a.shape[axis]


@implements(np.result_type)
def result_type(*arrays_and_dtypes) -> np.dtype:
    return np.result_type(*(a.dtype if isinstance(a, Array) else a for a in arrays_and_dtypes))


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
    """One elementwise catalog op (a name or alias) block by block, with NumPy broadcasting and aligned blocks."""
    op = get(opname)
    operands = [_as_operand(a) for a in args]
    full = [a.aval if isinstance(a, Array) else a for a in operands]
    out = op.abstract_eval(*full, **params)  # raises ValueError / TypeError before anything runs
    ndim = len(out.shape)
    arrays = [a for a in operands if isinstance(a, Array)]
    if not arrays:
        raise TypeError(f"{op.name}: needs at least one array operand")
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
                a = _layout.rechunk(a, want)
        aligned.append(a)

    def block(idx):
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
        return refs, avals, params

    return blockwise(op.name, chunks, out.dtype, block, token=(*[a.name if isinstance(a, Array) else a for a in aligned],
                                                                params),
                     dependencies=[a for a in aligned if isinstance(a, Array)])


@implements(getattr(np, "astype", None))  # NumPy >= 2.1
def astype(x: Array, dtype: Any, /, *, copy: bool = True, device: Any = None) -> Array:
    """``x`` as ``dtype`` (NumPy's ``astype`` function; ``copy`` is moot: ga arrays are immutable)."""
    refuse("astype", device=device not in (None, "cpu"))
    x = asarray(x)
    dt = check_dtype("astype", dtype)
    if dt == x.dtype:
        return x
    return elementwise("astype", x, dtype=dt.str if dt.byteorder not in "=|" else dt.name)


@implements(np.where)
def where(condition: Any, x: Any = None, y: Any = None, /) -> Array:
    """``x`` where ``condition`` is true, else ``y`` (the one-argument form is not supported)."""
    if x is None or y is None:
        raise TypeError("where: needs condition, x and y (the one-argument form has a data-dependent shape)")
    return elementwise("where", condition, x, y)


@implements(np.clip)
def clip(a: Any, a_min: Any = None, a_max: Any = None, out: Any = None, *, min: Any = None, max: Any = None) -> Array:
    """``a`` limited to ``[a_min, a_max]`` (``min=``/``max=`` as NumPy 2.1's keywords); None: no limit."""
    refuse("clip", out=out is not None)
    if min is not None or max is not None:
        if a_min is not None or a_max is not None:
            raise ValueError("clip: give the limits as a_min/a_max or as min=/max=, not both")
        a_min, a_max = min, max
    a = asarray(a)
    lo = -np.inf if a_min is None else a_min
    hi = np.inf if a_max is None else a_max
    if a.dtype.kind in "iub":
        info = np.iinfo(a.dtype) if a.dtype.kind != "b" else None
        lo = (info.min if info else 0) if a_min is None else a_min
        hi = (info.max if info else 1) if a_max is None else a_max
    return elementwise("clip", a, lo, hi)


@implements(np.round, np.around)
def round(a: Any, decimals: int = 0, out: Any = None) -> Array:
    """Round to the nearest integer, ties to even (only ``decimals=0``: the catalog's ``rint``)."""
    refuse("round", out=out is not None)
    if decimals != 0:
        raise ValueError("round: only decimals=0 is in the catalog (rint)")
    return elementwise("rint", asarray(a))


@implements(np.isclose)
def isclose(a: Any, b: Any, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False) -> Array:
    """``|a - b| <= atol + rtol * |b|`` elementwise (NaN close to NaN only with ``equal_nan``)."""
    close = elementwise("less_equal", elementwise("absolute", elementwise("subtract", a, b)),
                        elementwise("add", atol, elementwise("multiply", rtol, elementwise("absolute", b))))
    if equal_nan:
        both = elementwise("logical_and", elementwise("isnan", a), elementwise("isnan", b))
        close = elementwise("logical_or", close, both)
    return close


def formula(text: str, /, **variables: Any) -> Array:
    """``formula("a * exp(-b) + c", a=x, b=y, c=2.0)``: one fused catalog kernel over the variables.

    The expression language is parsed with ``ast`` against an allow-list
    (:mod:`goblin_dask.ops.formula`); variable names never travel: the task carries a
    canonical expression over ``x0..xN``.  Variables the expression does not use are
    ignored, as ``numexpr.evaluate(text, local_dict=...)`` ignores them.
    """
    from goblin_dask.ops.formula import formula_over

    expr, used = formula_over(text, list(variables))
    return elementwise("formula", *(variables[n] for n in used), expr=expr)


def block_of(chunks: tuple[int, ...], position: int) -> tuple[int, int]:
    """(block index, offset within it) of ``position`` along an axis."""
    offs = offsets_of(chunks)
    b = bisect.bisect_right(offs, position) - 1
    b = min(b, len(chunks) - 1)
    return b, position - offs[b]


__all__ = ["Array", "Operators", "asarray", "astype", "blockwise", "clip", "elementwise", "formula", "from_array",
           "isclose", "round", "where"]

# The sibling modules build on this one; Array's methods call them.
from goblin_dask.array import layout as _layout, linalg as _linalg, reductions as _reductions  # noqa: E402
