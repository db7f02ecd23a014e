"""NumPy's protocols (NEP 13 ufuncs, NEP 18 functions) mapped onto catalog operations.

Like ``_HANDLED_FUNCTIONS`` in dask.array: a NumPy function or ufunc applied to a
ga.Array becomes the catalog op of the same meaning; anything else raises a TypeError
naming the function (the grid computes its catalog only).  This is also how xarray
reaches the data (``np.nanmean``, ``np.where``, ``np.isnan`` ...).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from goblin_dask.ops import catalog

HANDLED: dict[Callable, Callable] = {}

#: NumPy ufunc name -> catalog op name, where they differ.
UFUNC_ALIASES = {"true_divide": "divide", "abs": "absolute", "conjugate": None, "mod": "remainder"}


def implements(*funcs: Callable):
    def register(impl):
        for f in funcs:
            HANDLED[f] = impl
        return impl

    return register


def _ok_types(types) -> bool:
    from goblin_dask.array.core import Array

    return all(issubclass(t, (Array, np.ndarray)) for t in types)


def array_ufunc(ufunc, method: str, inputs: tuple, kwargs: dict):
    from goblin_dask.array.core import Array, SCALAR_TYPES, elementwise

    if not all(isinstance(x, (Array, np.ndarray) + SCALAR_TYPES) for x in inputs):
        return NotImplemented
    if method != "__call__" or kwargs.get("out") is not None:
        return NotImplemented
    if ufunc is np.matmul:
        from goblin_dask.array.linalg import matmul

        return matmul(*inputs)
    name = UFUNC_ALIASES.get(ufunc.__name__, ufunc.__name__)
    extra = {k: v for k, v in kwargs.items() if k != "out"}
    if extra.get("dtype") is not None:
        dtype = extra.pop("dtype")
        return elementwise(name, *inputs).astype(dtype)
    extra.pop("dtype", None)
    if extra.get("casting", "same_kind") == "same_kind":
        extra.pop("casting", None)
    if name not in catalog() or extra:
        raise TypeError(f"numpy.{ufunc.__name__}{' with ' + str(sorted(extra)) if extra else ''} is not a goblin catalog "
                        f"operation; the grid computes catalog operations only")
    return elementwise(name, *inputs)


def array_function(func, types, args, kwargs):
    impl = HANDLED.get(func)
    if impl is None:
        raise TypeError(f"numpy.{func.__name__} is not supported on ga.Array: it is not a goblin catalog operation")
    if not _ok_types(types):
        return NotImplemented
    return impl(*args, **kwargs)


def _register() -> None:
    from goblin_dask.array import core, creation, layout, linalg, reductions

    for name in ("sum", "prod", "mean", "max", "min", "argmax", "argmin", "var", "std", "any", "all", "nansum",
                 "nanprod", "nanmean", "nanmax", "nanmin", "nanargmax", "nanargmin", "nanvar", "nanstd"):
        HANDLED[getattr(np, name)] = getattr(reductions, name)
    HANDLED[np.amax], HANDLED[np.amin] = reductions.max, reductions.min
    for name in ("concatenate", "stack", "transpose", "reshape", "squeeze", "expand_dims", "broadcast_to", "moveaxis",
                 "swapaxes"):
        HANDLED[getattr(np, name)] = getattr(layout, name)
    for name in ("tensordot", "dot"):
        HANDLED[getattr(np, name)] = getattr(linalg, name)
    HANDLED[np.einsum] = linalg.einsum
    HANDLED[np.where] = core.where
    HANDLED[np.clip] = core.clip
    HANDLED[np.ravel] = lambda x, order="C": layout.reshape(x, -1)
    HANDLED[np.round] = lambda x, decimals=0, out=None: core.asarray(x).round(decimals)
    HANDLED[np.around] = HANDLED[np.round]
    HANDLED[np.astype] = lambda x, dtype, copy=True, **kw: core.astype(core.asarray(x), dtype)
    HANDLED[np.shape] = lambda x: x.shape
    HANDLED[np.ndim] = lambda x: x.ndim
    HANDLED[np.size] = lambda x, axis=None: x.size if axis is None else x.shape[axis]
    HANDLED[np.zeros_like] = lambda x, dtype=None, **kw: creation.zeros_like(x, dtype)
    HANDLED[np.ones_like] = lambda x, dtype=None, **kw: creation.ones_like(x, dtype)
    HANDLED[np.full_like] = lambda x, fill_value, dtype=None, **kw: creation.full_like(x, fill_value, dtype)
    HANDLED[np.result_type] = lambda *args: np.result_type(*(a.dtype if isinstance(a, core.Array) else a for a in args))
    HANDLED[np.isclose] = _isclose
    HANDLED[np.allclose] = lambda a, b, rtol=1e-05, atol=1e-08, equal_nan=False: bool(
        reductions.all(_isclose(a, b, rtol, atol, equal_nan)).compute())
    HANDLED[np.array_equal] = lambda a, b, equal_nan=False: np.shape(a) == np.shape(b) and bool(
        reductions.all(core.elementwise("equal", a, b)).compute())


def _isclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    from goblin_dask.array.core import elementwise

    close = elementwise("less_equal", elementwise("absolute", elementwise("subtract", a, b)),
                        elementwise("add", atol, elementwise("multiply", rtol, elementwise("absolute", b))))
    if equal_nan:
        both = elementwise("logical_and", elementwise("isnan", a), elementwise("isnan", b))
        close = elementwise("logical_or", close, both)
    return close


