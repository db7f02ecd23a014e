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


def _is_array_index(i: Any) -> bool:
    return isinstance(i, (Array, np.ndarray, list)) or (hasattr(i, "dtype") and not isinstance(i, np.generic))


@implements(op="getitem")
def getitem(x: Array, index: Any) -> Array:
    """Basic indexing (ints, slices of any step, None, Ellipsis) and one integer array or boolean mask (``take``)."""
    entries = index if isinstance(index, tuple) else (index,)
    if any(_is_array_index(i) for i in entries):
        return _array_getitem(x, entries)
    index = _normalize_index(index, x.shape)
    if all(isinstance(i, slice) and i.indices(n) == (0, n, 1) for i, n in zip(index, x.shape)) and len(index) == x.ndim:
        return x  # nothing selected away (xarray's isel with stride 1): the same array, as dask.array does
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


class MultipleIndexArrays(NotImplementedError, TypeError):
    """More than one index array (NumPy's pointwise indexing): as dask.array, refused; xarray then indexes axis by axis."""


def _array_getitem(x: Array, entries: tuple) -> Array:
    """``x[..., idx, ...]`` with one concrete integer array (or boolean mask) among basic entries: getitem, then take."""
    arrays = [k for k, i in enumerate(entries) if _is_array_index(i)]
    if len(arrays) > 1:
        raise MultipleIndexArrays(f"getitem: one index array at a time on a ga.Array of shape {x.shape} (got {len(arrays)}); "
                        "index one axis after the other")
    k = arrays[0]
    if isinstance(entries[k], Array):
        raise TypeError(f"getitem: indexing with arrays whose values are computed (ga.Array) is not supported on a "
                        f"ga.Array of shape {x.shape}: the result's shape would depend on data; compute the index first")
    ind = np.asarray(entries[k])
    if ind.dtype == bool and ind.ndim > 1:
        if len(entries) != 1 or ind.shape != x.shape[:ind.ndim]:
            raise TypeError(f"getitem: a {ind.ndim}-d boolean mask must be the whole index and match the leading axes "
                            f"of shape {x.shape}, got shape {ind.shape}")
        flat = reshape(x, (-1,) + x.shape[ind.ndim:]) if ind.ndim > 1 else x
        return take(flat, np.flatnonzero(ind), axis=0)
    marker = slice(None)
    basic = _normalize_index(entries[:k] + (marker,) + entries[k + 1:], x.shape)
    p = next(j for j, e in enumerate(basic) if e is marker)
    in_axis = sum(1 for e in basic[:p] if e is not None)
    out_axis = sum(1 for e in basic[:p] if e is None or isinstance(e, slice))
    advanced = [j for j, e in enumerate(basic) if e is marker or isinstance(e, numbers.Integral)]
    apart = advanced != list(range(advanced[0], advanced[-1] + 1))  # NumPy then puts the indexed axis first
    n = x.shape[in_axis]
    if ind.dtype == bool:
        if ind.shape != (n,):
            raise IndexError(f"getitem: boolean index of shape {ind.shape} does not match axis {in_axis} with size {n} "
                             f"(shape {x.shape})")
        ind = np.flatnonzero(ind)
    elif ind.size == 0:
        ind = ind.astype(np.intp)
    elif ind.dtype.kind not in "iu":
        raise IndexError(f"getitem: index arrays must hold integers or booleans, got dtype {ind.dtype}")
    bad = ind[(ind < -n) | (ind >= n)]
    if bad.size:
        raise IndexError(f"getitem: index {int(bad.reshape(-1)[0])} is out of bounds for axis {in_axis} with size {n} "
                         f"(shape {x.shape})")
    y = getitem(x, basic) if any(not (isinstance(e, slice) and e == slice(None)) for e in basic) else x
    out = take(y, ind, axis=out_axis)
    return moveaxis(out, out_axis, 0) if apart and out_axis else out


@implements(np.take, op="take")
def take(a: Any, indices: Any, axis: Any = None, out: Any = None, mode: str = "raise") -> Array:
    """Entries at integer ``indices`` (a concrete array, negatives from the end) along ``axis`` (None: flattened).

    Output blocks along ``axis`` hold at most one input block's length of indices; each
    gathers from the input blocks it touches (one ``take`` each), joined in index order.
    """
    refuse("take", out=out is not None, mode=mode != "raise")
    x = asarray(a)
    if isinstance(indices, Array):
        raise TypeError("take: indices must be concrete (a NumPy array or list), not a computed ga.Array")
    ind = np.asarray(indices)
    if ind.size == 0 and ind.dtype.kind not in "iu":
        ind = ind.astype(np.intp)
    if ind.dtype.kind not in "iu":
        raise TypeError(f"take: indices must be integers, got dtype {ind.dtype}")
    if axis is None:
        x, axis = ravel(x), 0
    ax = normalize_axes("take", axis, x.shape)[0]
    n = x.shape[ax]
    bad = ind[(ind < -n) | (ind >= n)]
    if bad.size:
        raise IndexError(f"take: index {int(bad.reshape(-1)[0])} is out of bounds for axis {ax} with size {n} "
                         f"(shape {x.shape})")
    if ind.ndim == 0:
        return getitem(x, (slice(None),) * ax + (int(ind),))
    if ind.ndim > 1:
        flat = take(x, ind.reshape(-1), axis=ax)
        return reshape(flat, x.shape[:ax] + ind.shape + x.shape[ax + 1:])
    ind = (ind % n if n else ind).astype(np.intp)
    step = max(max(x.chunks[ax]), 1)
    out_axis = tuple(min(step, len(ind) - s) for s in range(0, len(ind), step)) or (0,)
    offs = np.asarray(offsets_of(x.chunks[ax]))
    name = new_name("take", x.name, ind, ax)
    layer = {}
    starts = offsets_of(out_axis)
    other = [range(len(c)) if d != ax else range(1) for d, c in enumerate(x.chunks)]
    for j in range(len(out_axis)):
        sel = ind[starts[j]:starts[j + 1]]
        blocks = np.searchsorted(offs, sel, side="right") - 1
        touched = sorted(set(blocks.tolist())) or [0]
        order = np.concatenate([np.flatnonzero(blocks == b) for b in touched]) if len(sel) else np.zeros(0, np.intp)
        for rest in itertools.product(*other):
            out_idx = rest[:ax] + (j,) + rest[ax + 1:]
            key = block_key(name, out_idx)
            pieces, avals = [], []
            for b in touched:
                in_idx = rest[:ax] + (b,) + rest[ax + 1:]
                local = (sel[blocks == b] - offs[b]).astype(np.intp)
                pkey = key if len(touched) == 1 else part_key(name, "piece", *out_idx, b)
                block = x.block_aval(in_idx)
                layer[pkey] = catalog_task(pkey, "take", x.ref(in_idx), avals=[block], indices=tuple(local.tolist()),
                                           axis=ax)
                pieces.append(_ref(pkey))
                avals.append(block._replace(shape=block.shape[:ax] + (len(local),) + block.shape[ax + 1:]))
            if len(touched) == 1:
                continue
            in_order = bool((order == np.arange(len(order))).all())
            ckey = key if in_order else part_key(name, "cat", *out_idx)
            layer[ckey] = catalog_task(ckey, "concatenate", *pieces, avals=avals, axis=ax)
            if not in_order:
                perm = np.argsort(order).astype(np.intp)
                cat = avals[0]._replace(shape=avals[0].shape[:ax] + (len(sel),) + avals[0].shape[ax + 1:])
                layer[key] = catalog_task(key, "take", _ref(ckey), avals=[cat], indices=tuple(perm.tolist()), axis=ax)
    chunks = tuple(out_axis if d == ax else c for d, c in enumerate(x.chunks))
    return from_graph(name, layer, chunks, x.dtype, dependencies=[x])


# -- pad ----------------------------------------------------------------------------------------------

@implements(np.pad, op="pad")
def pad(array: Any, pad_width: Any, mode: str = "constant", *, constant_values: Any = 0,
        reflect_type: str = "even") -> Array:
    """``array`` padded as by numpy.pad (modes constant, edge, reflect, symmetric, wrap).

    constant and edge pad the first and last blocks of each axis (one ``pad`` task each, the
    other blocks reused); reflect, symmetric and wrap join slices of the array along each axis.
    """
    from goblin_dask.ops.layout import PAD_MODES, _pad_widths

    x = asarray(array)
    if not isinstance(mode, str) or mode not in PAD_MODES:
        raise ValueError(f"pad: mode {mode!r} is not supported (one of {PAD_MODES})")
    refuse("pad", reflect_type=reflect_type != "even")
    value = constant_values
    if np.ndim(value):
        v = np.unique(np.asarray(value))
        if v.size != 1:
            raise TypeError(f"pad: constant_values must be one number for every side, got {value!r}")
        value = v[0]
    value = value.item() if isinstance(value, np.generic) else value
    widths = _pad_widths("pad", x.aval, pad_width)
    get("pad").abstract_eval(x.aval, pad_width=widths, mode=mode, constant_values=value)
    if not any(b or a for b, a in widths):
        return x
    if mode in ("constant", "edge"):
        return _pad_edges(x, widths, mode, value)
    for d, (b, a) in enumerate(widths):
        if b or a:
            x = _pad_axis_slices(x, d, b, a, mode)
    return x


def _pad_edges(x: Array, widths: tuple, mode: str, value: Any) -> Array:
    params = {"mode": mode, **({"constant_values": value} if mode == "constant" else {})}
    name = new_name("pad", x.name, widths, params)
    last = [n - 1 for n in x.numblocks]
    layer = {}
    for idx in x.block_indices():
        w = tuple((b if i == 0 else 0, a if i == l else 0) for (b, a), i, l in zip(widths, idx, last))
        key = block_key(name, idx)
        if any(p or q for p, q in w):
            layer[key] = catalog_task(key, "pad", x.ref(idx), avals=[x.block_aval(idx)], pad_width=w, **params)
        else:
            layer[key] = Alias(key, x.key(idx))
    chunks = tuple(tuple(c + (b if i == 0 else 0) + (a if i == len(cs) - 1 else 0) for i, c in enumerate(cs))
                   for cs, (b, a) in zip(x.chunks, widths))
    return from_graph(name, layer, chunks, x.dtype, dependencies=[x])


def _pad_axis_slices(x: Array, d: int, before: int, after: int, mode: str) -> Array:
    n = x.shape[d]
    most = {"reflect": n - 1, "symmetric": n, "wrap": n}[mode]
    if max(before, after) > most:
        raise ValueError(f"pad: widths ({before}, {after}) along axis {d} exceed what mode {mode!r} can take from an "
                         f"axis of size {n} (at most {most})")

    def along(s: slice) -> Array:
        return getitem(x, (slice(None),) * d + (s,))

    if mode == "reflect":
        left, right = along(slice(before, 0, -1)), along(slice(n - 2, n - 2 - after, -1) if n - 2 - after >= 0 else slice(n - 2, None, -1))
    elif mode == "symmetric":
        left = along(slice(before - 1, None, -1)) if before else None
        right = along(slice(n - 1, n - 1 - after, -1) if n - 1 - after >= 0 else slice(n - 1, None, -1))
    else:
        left, right = along(slice(n - before, n)), along(slice(0, after))
    parts = [p for p, w in ((left, before), (x, 1), (right, after)) if w and p is not None]
    return concatenate(parts, axis=d)


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


@implements(op="gather")
def gather(x: Any, index: Any, axis: int) -> Array:
    """``torch.gather``: ``out[i][j] = x[index[i][j]][j]`` along ``axis``; ``index`` (integers, negatives from the
    end) is an operand, a ga.Array or NumPy array of x's rank, at most x's extent along the other axes.

    One ``gather`` task per index block, over x cut to the index's extent and whole along ``axis``.
    """
    x, ind = asarray(x), asarray(index)
    ax = normalize_axes("gather", axis, x.shape)[0]
    get("gather").abstract_eval(x.aval, ind.aval, axis=ax)
    if any(i < n for d, (i, n) in enumerate(zip(ind.shape, x.shape)) if d != ax):
        x = getitem(x, tuple(slice(None) if d == ax else slice(0, i) for d, i in enumerate(ind.shape)))
    want = tuple((x.shape[ax],) if d == ax else c for d, c in enumerate(ind.chunks))
    if x.chunks != want:
        x = rechunk(x, want)

    def block(idx):
        xi = tuple(0 if d == ax else i for d, i in enumerate(idx))
        return (x.ref(xi), ind.ref(idx)), (x.block_aval(xi), ind.block_aval(idx)), {"axis": ax}

    return blockwise("gather", ind.chunks, x.dtype, block, token=(x.name, ind.name, ax), dependencies=[x, ind])


__all__ = ["broadcast_to", "concatenate", "expand_dims", "getitem", "moveaxis", "pad", "ravel", "rechunk", "reshape",
           "squeeze", "stack", "swapaxes", "take", "transpose", "gather"]
