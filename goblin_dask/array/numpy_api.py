"""NumPy's protocols (NEP 13 ufuncs, NEP 18 functions) mapped onto catalog operations.

As in dask.array, each ga function names the NumPy functions it implements where it is
defined (``@implements(np.sum)``); a NumPy ufunc applied to a ga.Array is the catalog's
elementwise op of that name or alias (``np.abs`` is ``absolute``, ``np.true_divide`` is
``divide``).  Anything else raises a TypeError naming the function (the grid computes its
catalog only).  This is also how xarray reaches the data (``np.nanmean``, ``np.where``,
``np.isnan`` ...).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from goblin_dask.ops import CatalogError, OpSpec, get

#: NumPy function -> the ga function that implements it (filled by :func:`implements`).
HANDLED: dict[Callable, Callable] = {}
#: Catalog op that is no elementwise op -> the ga function computing it block by block (``matmul``).
BLOCKED: dict[str, Callable] = {}


def implements(*numpy_functions: Callable | None, op: str | None = None):
    """Register the decorated ga function for ``numpy_functions`` (None, a function this NumPy lacks, is
    skipped) and, with ``op``, as the blocked algorithm of that catalog op (what ga.Array's operators use)."""

    def register(impl: Callable) -> Callable:
        for f in numpy_functions:
            if f is not None:
                HANDLED[f] = impl
        if op is not None:
            BLOCKED[get(op).name] = impl
        return impl

    return register


def ufunc_op(ufunc: np.ufunc) -> OpSpec | None:
    """The elementwise catalog op a NumPy ufunc is, by its name or an alias the op declares; None if none."""
    try:
        spec = get(ufunc.__name__)
    except CatalogError:
        return None
    return spec if spec.elementwise is not None else None


def _ok_types(types) -> bool:
    from goblin_dask.array.core import Array

    return all(issubclass(t, (Array, np.ndarray)) for t in types)


def array_ufunc(ufunc: np.ufunc, method: str, inputs: tuple, kwargs: dict) -> Any:
    from goblin_dask.array.core import SCALAR_TYPES, Array, astype, elementwise

    if not all(isinstance(x, (Array, np.ndarray) + SCALAR_TYPES) for x in inputs):
        return NotImplemented
    if method != "__call__" or kwargs.get("out") is not None:
        return NotImplemented
    if ufunc in HANDLED:  # a ufunc with its own blocked algorithm (matmul)
        return HANDLED[ufunc](*inputs, **kwargs)
    extra = dict(kwargs)
    extra.pop("out", None)
    dtype = extra.pop("dtype", None)
    if extra.get("casting", "same_kind") == "same_kind":
        extra.pop("casting", None)
    spec = ufunc_op(ufunc)
    if spec is None or extra:
        raise TypeError(f"numpy.{ufunc.__name__}{' with ' + str(sorted(extra)) if extra else ''} is not a goblin catalog "
                        f"operation; the grid computes catalog operations only: "
                        f"{OUTSIDE_THE_CATALOG.format(call=f'numpy.{ufunc.__name__}')}")
    out = elementwise(spec.name, *inputs)
    return out if dtype is None else astype(out, dtype)


#: What to do about an operation outside the catalog (every refusal of one says it).
OUTSIDE_THE_CATALOG = ("compute the operand first and call {call} on the numpy result (x.compute(), on your machine), "
                       "or use the catalog's operations (goblin_dask.ops.catalog() lists them)")


#: NumPy functions outside the catalog with a near catalog operation: what their refusal suggests first.
NEAREST = {
    "partition": "np.sort(x, axis) is a partition for every kth (ga.topk(x, k, axis) takes the k largest)",
    "argpartition": "np.argsort(x, axis) is an argpartition for every kth (ga.argtopk(x, k, axis): the k largest)",
}


def array_function(func: Callable, types, args: tuple, kwargs: dict) -> Any:
    if args and getattr(args[0], "_windows_of", None) is not None:  # a sliding-window view reduced over its windows
        from goblin_dask.array.rolling import fused_numpy_call

        fused = fused_numpy_call(func, args, kwargs)
        if fused is not None:
            return fused
    impl = HANDLED.get(func)
    if impl is None:
        nearest = NEAREST.get(func.__name__)
        raise TypeError(f"numpy.{func.__name__} is not supported on ga.Array: it is not a goblin catalog operation; "
                        + (f"{nearest}, or " if nearest else "")
                        + OUTSIDE_THE_CATALOG.format(call=f'numpy.{func.__name__}'))
    if not _ok_types(types):
        return NotImplemented
    return impl(*args, **kwargs)
