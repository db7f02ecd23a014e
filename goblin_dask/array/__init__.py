"""``goblin_dask.array`` (import as ``ga``): dask-style arrays computed by the grid's catalog.

``ga.Array`` is a real dask collection (``dask.compute``, ``persist``,
``distributed.progress``, ``.visualize``) whose tasks are catalog operations, placed by
cost (:mod:`goblin_dask.array.placement`) and verified on the lab worker before use.
"""

from goblin_dask.array.core import Array, asarray, astype, clip, elementwise, formula, from_array, where
from goblin_dask.array.creation import arange, eye, full, full_like, ones, ones_like, random, zeros, zeros_like
from goblin_dask.array.layout import (
    broadcast_to, concatenate, expand_dims, getitem, moveaxis, rechunk, reshape, squeeze, stack, swapaxes, transpose,
)
from goblin_dask.array.linalg import dot, einsum, matmul, tensordot
from goblin_dask.array.placement import placement_for
from goblin_dask.array.reductions import (
    all, any, argmax, argmin, max, mean, min, nanargmax, nanargmin, nanmax, nanmean, nanmin, nanprod, nanstd, nansum,
    nanvar, prod, std, sum, var,
)
from goblin_dask.array import core as _core, numpy_api as _numpy_api


def _ufunc(name):
    def f(*args, **params):
        return elementwise(name, *args, **params)

    f.__name__ = name
    f.__doc__ = f"Elementwise {name} (catalog op ``{name}``)."
    return f


# Every elementwise catalog op as a function: ga.exp, ga.add, ga.sigmoid, ga.isnan ...
for _name, _spec in __import__("goblin_dask.ops", fromlist=["catalog"]).catalog().items():
    if "loop" in _spec.extra and _name not in globals():
        globals()[_name] = _ufunc(_name)
abs = globals()["absolute"]

_core._add_reduction_methods()
_numpy_api._register()

__all__ = ["Array", "arange", "asarray", "concatenate", "dot", "einsum", "formula", "from_array", "full", "matmul",
           "ones", "random", "rechunk", "reshape", "stack", "tensordot", "transpose", "where", "zeros"]
