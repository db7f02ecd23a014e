"""``goblin_dask.array`` (import as ``ga``): dask-style arrays computed by the grid's catalog.

``ga.Array`` is a real dask collection (``dask.compute``, ``persist``,
``distributed.progress``, ``.visualize``) whose tasks are catalog operations, placed by
cost (:mod:`goblin_dask.array.placement`) and verified on the lab worker before use.
Every elementwise catalog op is a function here (:mod:`goblin_dask.array.ufuncs`:
``ga.exp``, ``ga.add``, ``ga.sigmoid`` ..., and the aliases the ops declare, ``ga.abs``);
NumPy's functions reach the ga function that says it implements them (``np.sum(x)`` is
``ga.sum(x)``, see :mod:`goblin_dask.array.numpy_api`).
"""

from goblin_dask.array.core import (
    Array, asarray, astype, blockwise, elementwise, formula, from_array, isclose, round,
)
from goblin_dask.array.creation import arange, eye, full, full_like, ones, ones_like, random, zeros, zeros_like
from goblin_dask.array.layout import (
    broadcast_to, concatenate, expand_dims, gather, getitem, moveaxis, pad, ravel, rechunk, reshape, squeeze, stack, swapaxes,
    take, transpose,
)
from goblin_dask.array.linalg import dot, einsum, matmul, tensordot
from goblin_dask.array.nn import (
    adaptive_avg_pool2d, avg_pool2d, batch_norm, conv2d, layer_norm, log_softmax, logsumexp, max_pool2d,
    scaled_dot_product_attention, softmax,
)
from goblin_dask.array.placement import placement_for
from goblin_dask.array.composite import fmod, hardsigmoid, hardswish, one_hot, tril, triu
from goblin_dask.array.order import (
    argsort, argtopk, median, nanmedian, nanpercentile, nanquantile, percentile, quantile, sort, topk,
)
from goblin_dask.array.scan import cumprod, cumsum, nancumprod, nancumsum
from goblin_dask.array.rolling import sliding_window_view  # also routes xarray's rolling windows here
from goblin_dask.array.reductions import (
    all, allclose, any, argmax, argmin, array_equal, max, mean, min, nanargmax, nanargmin, nanmax, nanmean, nanmin,
    nanprod, nanstd, nansum, nanvar, prod, std, sum, var,
)
from goblin_dask.array.ufuncs import *  # noqa: F401,F403  (every elementwise op: see ufuncs.__all__)
from goblin_dask.array import ufuncs as _ufuncs

__all__ = [
    "Array", "all", "allclose", "any", "arange", "argmax", "argmin", "array_equal", "asarray", "astype", "blockwise",
    "broadcast_to", "concatenate", "dot", "einsum", "elementwise", "expand_dims", "eye", "formula", "from_array",
    "full", "full_like", "gather", "getitem", "isclose", "matmul", "max", "mean", "min", "moveaxis", "nanargmax", "nanargmin",
    "nanmax", "nanmean", "nanmin", "nanprod", "nanstd", "nansum", "nanvar", "ones", "ones_like",
    "prod", "random", "ravel", "rechunk", "reshape", "round", "squeeze", "stack", "std", "sum", "swapaxes",
    "tensordot", "transpose", "var", "zeros", "zeros_like",
]
__all__ += ["cumprod", "cumsum", "nancumprod", "nancumsum", "pad", "take"]
__all__ += ["sliding_window_view"]
__all__ += ["argsort", "argtopk", "median", "nanmedian", "nanpercentile", "nanquantile", "percentile", "quantile", "sort",
            "topk"]
__all__ += ["fmod", "hardsigmoid", "hardswish", "one_hot", "tril", "triu"]
__all__ += _ufuncs.__all__
from goblin_dask.array import nn as _nn  # noqa: E402

__all__ += _nn.__all__
