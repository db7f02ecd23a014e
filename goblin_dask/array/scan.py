"""Cumulative sums and products, blocked: each block's own scan plus the previous blocks' running total.

Along the scanned axis, block ``i``'s result is ``cumsum(block i)`` (one ``cumsum``
task) ``+ carry[i]``, where ``carry[i]`` is the total of blocks ``0..i-1``: the last
slice of each block's scan (``getitem``), accumulated with ``add`` (``multiply`` for
``cumprod``).  Every task is one catalog op on one block's worth of data.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from goblin_dask.array.core import Array, asarray, astype, catalog_task, elementwise, from_graph, refuse
from goblin_dask.array.keys import block_key, new_name, part_key
from goblin_dask.array.layout import _ref, ravel
from goblin_dask.array.numpy_api import implements
from goblin_dask.ops import get
from goblin_dask.ops._factories import normalize_axes


def _scan(opname: str, combine: str, a: Any, axis: Any, dtype: Any, out: Any) -> Array:
    refuse(opname, out=out is not None)
    x = asarray(a)
    if dtype is not None:
        x = astype(x, dtype)
    if axis is None:
        x, axis = ravel(x), 0
    if x.ndim == 0:
        raise ValueError(f"{opname}: needs an array of at least one axis, got shape ()")
    ax = normalize_axes(opname, axis, x.shape)[0]
    result = get(opname).abstract_eval(x.aval, axis=ax)
    name = new_name(opname, x.name, ax)
    layer = {}
    for idx in x.block_indices():
        i = idx[ax]
        block = x.block_aval(idx)
        own = block_key(name, idx) if i == 0 else part_key(name, "block", *idx)
        layer[own] = catalog_task(own, opname, x.ref(idx), avals=[block], axis=ax)
        if i == 0:
            continue
        # the running total of the non-empty blocks before this one
        carry, carry_aval = None, None
        for p in range(i):
            pidx = idx[:ax] + (p,) + idx[ax + 1:]
            if x.chunks[ax][p] == 0:
                continue
            pkey = block_key(name, pidx) if p == 0 else part_key(name, "block", *pidx)
            last_key = part_key(name, "piece", *pidx)
            paval = x.block_aval(pidx)._replace(dtype=result.dtype)
            last_aval = paval._replace(shape=paval.shape[:ax] + (1,) + paval.shape[ax + 1:])
            if last_key not in layer:
                index = (slice(None),) * ax + (slice(paval.shape[ax] - 1, None),)
                layer[last_key] = catalog_task(last_key, "getitem", _ref(pkey), avals=[paval], index=index)
            if carry is None:
                carry, carry_aval = _ref(last_key), last_aval
            else:
                ckey = part_key(name, "partial", *pidx)
                if ckey not in layer:
                    layer[ckey] = catalog_task(ckey, combine, carry, _ref(last_key), avals=[carry_aval, last_aval])
                carry = _ref(ckey)
        key = block_key(name, idx)
        if carry is None:
            from dask._task_spec import Alias

            layer[key] = Alias(key, own)
        else:
            layer[key] = catalog_task(key, combine, _ref(own), carry, avals=[block._replace(dtype=result.dtype), carry_aval])
    return from_graph(name, layer, x.chunks, result.dtype, dependencies=[x])


@implements(np.cumsum, op="cumsum")
def cumsum(a: Any, axis: Any = None, dtype: Any = None, out: Any = None) -> Array:
    """Cumulative sum along ``axis`` (None: of the flattened array), as numpy.cumsum."""
    return _scan("cumsum", "add", a, axis, dtype, out)


@implements(np.cumprod, op="cumprod")
def cumprod(a: Any, axis: Any = None, dtype: Any = None, out: Any = None) -> Array:
    """Cumulative product along ``axis`` (None: of the flattened array), as numpy.cumprod."""
    return _scan("cumprod", "multiply", a, axis, dtype, out)


def _nan_as(a: Any, value: float) -> Array:
    x = asarray(a)
    return elementwise("where", elementwise("isnan", x), value, x) if x.dtype.kind in "fc" else x


@implements(np.nancumsum)
def nancumsum(a: Any, axis: Any = None, dtype: Any = None, out: Any = None) -> Array:
    """Cumulative sum treating NaN as zero (numpy.nancumsum)."""
    return cumsum(_nan_as(a, 0), axis=axis, dtype=dtype, out=out)


@implements(np.nancumprod)
def nancumprod(a: Any, axis: Any = None, dtype: Any = None, out: Any = None) -> Array:
    """Cumulative product treating NaN as one (numpy.nancumprod)."""
    return cumprod(_nan_as(a, 1), axis=axis, dtype=dtype, out=out)


__all__ = ["cumprod", "cumsum", "nancumprod", "nancumsum"]
