"""Moving blocks around: slicing, transpose, reshape, rechunk, concatenate, stack.

Each output block is one catalog task (``getitem``, ``transpose``, ``reshape``,
``concatenate``...) over the input blocks it needs, or an ``Alias`` when a block is
reused as it is.  Index and shape errors are raised here, when the array is built.
Functions take NumPy's signatures and say which NumPy function they implement
(``@implements``).
"""

from __future__ import annotations

import itertools
import numbers
from typing import Any, Sequence

import numpy as np
from dask._task_spec import Alias

from goblin_dask.array.core import (
    Array, asarray, astype, block_of, blockwise, catalog_task, from_graph, normalize_chunks, offsets_of, refuse,
)
from goblin_dask.array.keys import block_key, new_name, part_key
from goblin_dask.array.numpy_api import implements
from goblin_dask.ops import get
from goblin_dask.ops._factories import normalize_axes


# -- getitem --------------------------------------------------------------------------------

def _normalize_index(index: Any, shape: tuple[int, ...]) -> tuple:
    if not isinstance(index, tuple):
        index = (index,)
    for i in index:
        if isinstance(i, (Array, np.ndarray, list)) or (hasattr(i, "dtype") and not isinstance(i, np.generic)):
            raise TypeError(
                f"getitem: indexing with arrays or lists ({type(i).__name__}) is not supported on a ga.Array of shape "
                f"{shape}; use ints, slices, None and Ellipsis")
        if not (i is None or i is Ellipsis or isinstance(i, slice) or (isinstance(i, numbers.Integral) and not isinstance(i, bool))):
            raise TypeError(f"getitem: unsupported index {i!r} for shape {shape}")
    if sum(i is Ellipsis for i in index) > 1:
        raise IndexError("getitem: an index can only have a single ellipsis ('...')")
    n_real = sum(1 for i in index if i is not None and i is not Ellipsis)
    if n_real > len(shape):
        raise IndexError(f"getitem: too many indices for shape {shape}: {index!r}")
    if Ellipsis in index:
        e = index.index(Ellipsis)
        return index[:e] + (slice(None),) * (len(shape) - n_real) + index[e + 1:]
    return index + (slice(None),) * (len(shape) - n_real)


def _slice_pieces(chunks: tuple[int, ...], s: slice) -> list[tuple[int, slice, int]]:
    """(input block, local slice, output size) of a slice along one axis, in output order."""
    n = sum(chunks)
    start, stop, step = s.indices(n)
    positions = range(start, stop, step)
    offs = offsets_of(chunks)
    pieces = []
    order = range(len(chunks)) if step > 0 else range(len(chunks) - 1, -1, -1)
    for b in order:
        lo, hi = offs[b], offs[b + 1]
        if step > 0:
            i0 = len(range(start, min(max(lo, start), stop), step))
            i1 = len(range(start, min(max(hi, start), stop), step))
        else:
            i0 = len(range(start, max(min(hi - 1, start), stop), step)) if hi - 1 < start else 0
            i1 = len(range(start, max(min(lo - 1, start), stop), step)) if lo - 1 < start else 0
        sub = positions[i0:i1]
        if len(sub):
            local_stop = sub.stop - lo
            if step < 0 and local_stop < 0:
                local_stop = None
            pieces.append((b, slice(sub.start - lo, local_stop, step), len(sub)))
    if not pieces:
        pieces.append((0, slice(0, 0, 1), 0))
    return pieces


@implements(op="getitem")
def getitem(x: Array, index: Any) -> Array:
    """Basic indexing: ints, slices (any step), None and Ellipsis."""
    index = _normalize_index(index, x.shape)
    out_axes: list[list[tuple]] = []  # per output axis: (input block, local slice, size) in output order
    entries: list[tuple] = []  # per index entry: ("new",) | ("slice", axis, output axis) | ("int", axis, block, offset)
    d = 0
    for i in index:
        if i is None:
            entries.append(("new",))
            out_axes.append([(None, None, 1)])
        elif isinstance(i, slice):
            entries.append(("slice", d, len(out_axes)))
            out_axes.append(_slice_pieces(x.chunks[d], i))
            d += 1
        else:
            n = x.shape[d]
            if not -n <= i < n:
                raise IndexError(f"getitem: index {i} is out of bounds for axis {d} with size {n} (shape {x.shape})")
            entries.append(("int", d, *block_of(x.chunks[d], int(i) % n)))
            d += 1
    name = new_name("getitem", x.name, repr(index))
    chunks = tuple(tuple(p[2] for p in pieces) for pieces in out_axes)
    plain = all(e[0] == "slice" for e in entries)
    layer = {}
    for out_idx in itertools.product(*(range(len(c)) for c in chunks)):
        in_idx, local = [0] * x.ndim, []
        for e in entries:
            if e[0] == "new":
                local.append(None)
            elif e[0] == "slice":
                b, loc, _ = out_axes[e[2]][out_idx[e[2]]]
                in_idx[e[1]] = b
                local.append(loc)
            else:
                in_idx[e[1]] = e[2]
                local.append(e[3])
        in_idx = tuple(in_idx)
        key = block_key(name, out_idx)
        block = x.block_aval(in_idx)
        if plain and all(len(range(*s.indices(n))) == n and s.indices(n)[2] == 1 for s, n in zip(local, block.shape)):
            layer[key] = Alias(key, x.key(in_idx))
        else:
            layer[key] = catalog_task(key, "getitem", x.ref(in_idx), avals=[block], index=tuple(local))
    return from_graph(name, layer, chunks, x.dtype, dependencies=[x])


# -- transpose, reshape, squeeze, expand_dims -----------------------------------------------------

@implements(np.transpose, op="transpose")
def transpose(a: Any, axes: Any = None) -> Array:
    """Axes permuted (reversed when ``axes`` is None)."""
    x = asarray(a)
    axes = tuple(range(x.ndim))[::-1] if axes is None else normalize_axes("transpose", tuple(axes), x.shape)
    if len(axes) != x.ndim:
        raise ValueError(f"transpose: axes {axes} do not match shape {x.shape}")
    if axes == tuple(range(x.ndim)):
        return x

    def block(out_idx):
        idx = [0] * x.ndim
        for o, a in zip(out_idx, axes):
            idx[a] = o
        return [x.ref(tuple(idx))], [x.block_aval(tuple(idx))], {"axes": axes}

    return blockwise("transpose", tuple(x.chunks[a] for a in axes), x.dtype, block, token=(x.name, axes),
                     dependencies=[x])


@implements(np.swapaxes)
def swapaxes(a: Any, axis1: int, axis2: int) -> Array:
    x = asarray(a)
    axes = list(range(x.ndim))
    i, j = normalize_axes("swapaxes", (axis1, axis2), x.shape) if axis1 != axis2 else (axis1 % x.ndim,) * 2
    axes[i], axes[j] = axes[j], axes[i]
    return transpose(x, tuple(axes))


@implements(np.moveaxis)
def moveaxis(a: Any, source: Any, destination: Any) -> Array:
    x = asarray(a)
    src = normalize_axes("moveaxis", source, x.shape)
    dst = normalize_axes("moveaxis", destination, x.shape)
    order = [n for n in range(x.ndim) if n not in src]
    for d, s in sorted(zip(dst, src)):
        order.insert(d, s)
    return transpose(x, tuple(order))


@implements(np.reshape, op="reshape")
def reshape(a: Any, /, shape: Any = None, order: str = "C", *, newshape: Any = None, copy: Any = None) -> Array:
    """Same data in a new C-order shape (blocks are regrouped first, as dask.array does).

    ``newshape`` is NumPy's older name for ``shape``; ``copy`` is moot (ga arrays are immutable).
    """
    from dask.array.reshape import reshape_rechunk

    refuse("reshape", order=order != "C")
    if newshape is not None:
        if shape is not None:
            raise TypeError("reshape: give shape or newshape, not both")
        shape = newshape
    if shape is None:
        raise TypeError("reshape() missing required argument 'shape'")
    x = asarray(a)
    shape = (shape,) if isinstance(shape, numbers.Integral) else tuple(int(s) for s in shape)
    out_shape = get("reshape").abstract_eval(x.aval, shape=shape).shape  # resolves -1; ValueError when sizes differ
    if out_shape == x.shape:
        return x
    name = new_name("reshape", x.name, out_shape)
    if x.npartitions == 1 or x.size == 0:
        key = block_key(name, (0,) * len(out_shape))
        src = x if x.npartitions == 1 else rechunk(x, tuple((n,) for n in x.shape))
        zero = (0,) * x.ndim
        layer = {key: catalog_task(key, "reshape", src.ref(zero), avals=[src.block_aval(zero)], shape=out_shape)}
        return from_graph(name, layer, tuple((n,) for n in out_shape), x.dtype, dependencies=[src])
    try:
        inchunks, outchunks, _, _ = reshape_rechunk(x.shape, out_shape, x.chunks)
    except NotImplementedError:  # axes regroup across groups (e.g. (6, 4, 5) -> (12, 10)): go through 1-d
        if x.ndim == 1 or len(out_shape) == 1:
            raise
        return reshape(reshape(x, (x.size,)), out_shape)
    x2 = rechunk(x, inchunks)
    layer = {}
    in_idx = itertools.product(*(range(len(c)) for c in inchunks))
    out_idx = itertools.product(*(range(len(c)) for c in outchunks))
    for i, o in zip(in_idx, out_idx):
        key = block_key(name, o)
        block_shape = tuple(c[j] for c, j in zip(outchunks, o))
        layer[key] = catalog_task(key, "reshape", x2.ref(i), avals=[x2.block_aval(i)], shape=block_shape)
    return from_graph(name, layer, outchunks, x.dtype, dependencies=[x2])


@implements(np.ravel)
def ravel(a: Any, order: str = "C") -> Array:
    """The array as 1-d, in C order."""
    refuse("ravel", order=order not in ("C", "K", "A"))
    return reshape(a, -1)


@implements(np.squeeze, op="squeeze")
def squeeze(a: Any, axis: Any = None) -> Array:
    x = asarray(a)
    axes = tuple(i for i, n in enumerate(x.shape) if n == 1) if axis is None else normalize_axes("squeeze", axis, x.shape)
    for a in axes:
        if x.shape[a] != 1:
            raise ValueError(f"squeeze: axis {a} of shape {x.shape} has size {x.shape[a]}, not 1")
    if not axes:
        return x
    return _per_block(x, "squeeze", tuple(c for i, c in enumerate(x.chunks) if i not in axes), axis=axes)


@implements(np.expand_dims, op="expand_dims")
def expand_dims(a: Any, axis: Any) -> Array:
    x = asarray(a)
    axis = (axis,) if isinstance(axis, numbers.Integral) else tuple(axis)
    axes = normalize_axes("expand_dims", axis, x.shape, ndim=x.ndim + len(axis))
    chunks, it = [], iter(x.chunks)
    for i in range(x.ndim + len(axes)):
        chunks.append((1,) if i in axes else next(it))
    return _per_block(x, "expand_dims", tuple(chunks), axis=axes, insert=axes)


def _per_block(x: Array, opname: str, chunks: tuple, insert: tuple = (), **params: Any) -> Array:
    """A shape-only op applied to every block; output axes in ``insert`` are new (block index 0)."""
    drop = set(params.get("axis", ())) if opname == "squeeze" else set()

    def block(out_idx):
        kept = iter(i for d, i in enumerate(out_idx) if d not in insert)
        idx = tuple(0 if d in drop else next(kept) for d in range(x.ndim))
        return [x.ref(idx)], [x.block_aval(idx)], params

    return blockwise(opname, chunks, x.dtype, block, token=(x.name, params), dependencies=[x])


@implements(np.broadcast_to, op="broadcast_to")
def broadcast_to(array: Any, shape: Sequence[int], subok: bool = False, *, chunks: Any = None) -> Array:
    """``array`` repeated along new and size-1 axes to ``shape`` (``chunks``: of the new axes)."""
    x = asarray(array)
    shape = tuple(int(s) for s in shape)
    get("broadcast_to").abstract_eval(x.aval, shape=shape)
    if shape == x.shape:
        return x
    lead = len(shape) - x.ndim
    out_chunks = []
    for d, n in enumerate(shape):
        xd = d - lead
        if xd >= 0 and x.shape[xd] == n:
            out_chunks.append(x.chunks[xd])
        else:
            out_chunks.append(normalize_chunks("auto", (n,), x.dtype)[0] if chunks is None else normalize_chunks(chunks, shape, x.dtype)[d])
    out_chunks = tuple(out_chunks)

    def block(idx):
        in_idx = tuple(0 if x.shape[d] == 1 and shape[d + lead] != 1 else idx[d + lead] for d in range(x.ndim))
        bshape = tuple(c[i] for c, i in zip(out_chunks, idx))
        return [x.ref(in_idx)], [x.block_aval(in_idx)], {"shape": bshape}

    return blockwise("broadcast_to", out_chunks, x.dtype, block, token=(x.name, shape, out_chunks), dependencies=[x])


# -- rechunk ----------------------------------------------------------------------------------

def _axis_plan(old: tuple[int, ...], new: tuple[int, ...]) -> list[list[tuple[int, slice]]]:
    """For each new block along an axis: the (old block, local slice) pieces that make it."""
    old_offs, plan, pos = offsets_of(old), [], 0
    for size in new:
        pieces, start, end = [], pos, pos + size
        while start < end:
            b, off = block_of(old, start)
            take = min(end, old_offs[b + 1]) - start
            pieces.append((b, slice(off, off + take)))
            start += take
        if not pieces:
            b, _ = block_of(old, min(pos, max(sum(old) - 1, 0)))
            pieces.append((b, slice(0, 0)))
        plan.append(pieces)
        pos = end
    return plan


def rechunk(x: Any, chunks: Any = "auto") -> Array:
    """The same array in other blocks (cut again at the source when the data is the lab's)."""
    x = asarray(x)
    chunks = normalize_chunks(chunks, x.shape, x.dtype, where="rechunk", previous=x.chunks)
    if chunks == x.chunks:
        return x
    if x._source is not None:
        return x._source.blocks(chunks)
    name = new_name("rechunk", x.name, chunks)
    plans = [_axis_plan(o, n) for o, n in zip(x.chunks, chunks)]
    layer = {}
    for out_idx in itertools.product(*(range(len(c)) for c in chunks)):
        grid = [plans[d][j] for d, j in enumerate(out_idx)]
        piece_refs = {}
        for combo in itertools.product(*(range(len(g)) for g in grid)):
            in_idx = tuple(grid[d][c][0] for d, c in enumerate(combo))
            local = tuple(grid[d][c][1] for d, c in enumerate(combo))
            block = x.block_aval(in_idx)
            if all(s.start == 0 and s.stop == n for s, n in zip(local, block.shape)):
                piece_refs[combo] = x.ref(in_idx)
            else:
                pkey = part_key(name, "piece", *out_idx, *combo)
                layer[pkey] = catalog_task(pkey, "getitem", x.ref(in_idx), avals=[block], index=local)
                piece_refs[combo] = _ref(pkey)
        key = block_key(name, out_idx)
        if len(piece_refs) == 1:
            (ref,) = piece_refs.values()
            layer[key] = Alias(key, ref.key)
            continue
        # concatenate along the last axis first, then upward
        current = piece_refs
        shapes = [len(g) for g in grid]
        for d in range(x.ndim - 1, -1, -1):
            if shapes[d] == 1:
                continue
            merged = {}
            for prefix in itertools.product(*(range(s) for s in shapes[:d])):
                rest = tuple(range(1) for _ in shapes[d + 1:])
                for suffix in itertools.product(*rest):
                    parts = [current[prefix + (c,) + suffix] for c in range(shapes[d])]
                    last = d == 0 or all(s == 1 for s in shapes[:d])
                    ckey = key if last else part_key(name, "cat", d, *out_idx, *prefix)
                    part_avals = [_piece_aval(x, grid, prefix + (c,) + suffix, d) for c in range(shapes[d])]
                    layer[ckey] = catalog_task(ckey, "concatenate", *parts, avals=part_avals, axis=d)
                    merged[prefix + (0,) + suffix] = _ref(ckey)
            current = merged
            shapes[d] = 1
    return from_graph(name, layer, chunks, x.dtype, dependencies=[x])


def _piece_aval(x: Array, grid, combo, upto: int):
    """Aval of a (partly concatenated) piece: axes after ``upto`` are already whole."""
    from goblin_dask.ops.spec import Aval

    shape = []
    for d, g in enumerate(grid):
        if d > upto:
            shape.append(sum(s.stop - s.start for _, s in g))
        else:
            s = g[combo[d]][1]
            shape.append(s.stop - s.start)
    return Aval(tuple(shape), x.dtype)


def _ref(key):
    from dask._task_spec import TaskRef

    return TaskRef(key)


# -- concatenate / stack ------------------------------------------------------------------------

def _cast_all(func: str, arrays: list, dtype: Any, casting: str) -> tuple[list, np.dtype]:
    """The arrays in ``dtype`` (default: their result type), each cast allowed by ``casting`` as in NumPy."""
    dtype = np.result_type(*(a.dtype for a in arrays)) if dtype is None else np.dtype(dtype)
    for a in arrays:
        if not np.can_cast(a.dtype, dtype, casting=casting):
            raise TypeError(f"{func}: cannot cast {a.dtype} to {dtype} according to the rule {casting!r}")
    return [astype(a, dtype) for a in arrays], dtype


@implements(np.concatenate)
def concatenate(arrays: Sequence[Any], /, axis: int = 0, out: Any = None, *, dtype: Any = None,
                casting: str = "same_kind") -> Array:
    """The arrays joined along ``axis`` (blocks are reused as they are)."""
    refuse("concatenate", out=out is not None)
    arrays = [asarray(a) for a in arrays]
    if not arrays:
        raise ValueError("concatenate: needs at least one array")
    get("concatenate").abstract_eval(*(a.aval for a in arrays), axis=axis)  # shapes, dtypes, axis
    ndim = arrays[0].ndim
    axis = normalize_axes("concatenate", axis, arrays[0].shape)[0]
    arrays, dtype = _cast_all("concatenate", arrays, dtype, casting)
    from goblin_dask.array.core import _common_chunks

    common = [_common_chunks(*(a.chunks[d] for a in arrays)) if d != axis else None for d in range(ndim)]
    arrays = [rechunk(a, tuple(a.chunks[d] if d == axis else common[d] for d in range(ndim))) for a in arrays]
    chunks = tuple(sum((a.chunks[axis] for a in arrays), ()) if d == axis else common[d] for d in range(ndim))
    name = new_name("concatenate", [a.name for a in arrays], axis)
    layer, base = {}, 0
    for a in arrays:
        for idx in a.block_indices():
            out_idx = tuple(i + base if d == axis else i for d, i in enumerate(idx))
            key = block_key(name, out_idx)
            layer[key] = Alias(key, a.key(idx))
        base += a.numblocks[axis]
    return from_graph(name, layer, chunks, dtype, dependencies=arrays)


@implements(np.stack)
def stack(arrays: Sequence[Any], axis: int = 0, out: Any = None, *, dtype: Any = None, casting: str = "same_kind") -> Array:
    """The arrays joined along a new axis."""
    refuse("stack", out=out is not None)
    arrays = [asarray(a) for a in arrays]
    if not arrays:
        raise ValueError("stack: needs at least one array")
    get("stack").abstract_eval(*(a.aval for a in arrays), axis=axis)
    axis = normalize_axes("stack", axis, arrays[0].shape, ndim=arrays[0].ndim + 1)[0]
    return concatenate([expand_dims(a, axis) for a in arrays], axis=axis, dtype=dtype, casting=casting)


__all__ = ["broadcast_to", "concatenate", "expand_dims", "getitem", "moveaxis", "ravel", "rechunk", "reshape",
           "squeeze", "stack", "swapaxes", "transpose"]
