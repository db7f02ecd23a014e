"""ga functions composed of other ga functions: no catalog op of their own, every task is one of theirs.

``fmod`` (C's remainder, the sign of x), ``hardsigmoid``/``hardswish`` (torch's piecewise
activations), ``tril``/``triu`` (a ``where`` against a concrete triangular mask) and
``one_hot``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from goblin_dask.array.core import Array, asarray, astype
from goblin_dask.array.creation import arange
from goblin_dask.array.layout import expand_dims
from goblin_dask.array.numpy_api import implements
from goblin_dask.array import ufuncs as _u


@implements(np.fmod)
def fmod(x1: Any, x2: Any, /) -> Array:
    """C's fmod: ``x1 - trunc(x1 / x2) * x2``, with the sign of ``x1`` (``sign(x1) * remainder(|x1|, |x2|)``, exact)."""
    x1 = asarray(x1) if not isinstance(x1, Array) and not isinstance(x2, Array) else x1

    def mag(v):
        if isinstance(v, Array):
            return _u.absolute(v)
        return abs(v) if isinstance(v, (int, float)) else np.absolute(v)  # a Python number stays weakly typed

    return _u.multiply(_u.sign(x1), _u.remainder(mag(x1), mag(x2)))


def hardsigmoid(x: Any, /) -> Array:
    """``clip(x + 3, 0, 6) / 6`` (torch.nn.functional.hardsigmoid)."""
    return _u.divide(_u.clip(_u.add(x, 3), 0, 6), 6)


def hardswish(x: Any, /) -> Array:
    """``x * clip(x + 3, 0, 6) / 6`` (torch.nn.functional.hardswish)."""
    return _u.divide(_u.multiply(x, _u.clip(_u.add(x, 3), 0, 6)), 6)


def _triangle(name: str, m: Any, k: int, lower: bool) -> Array:
    m = asarray(m)
    if m.ndim < 2:
        raise ValueError(f"{name}: needs at least 2 dimensions, got shape {m.shape}")
    rows, cols = m.shape[-2:]
    mask = np.tri(rows, cols, k, dtype=bool) if lower else ~np.tri(rows, cols, k - 1, dtype=bool)
    return _u.where(mask, m, np.zeros((), dtype=m.dtype))


@implements(np.tril)
def tril(m: Any, k: int = 0) -> Array:
    """Zeros above the k-th diagonal of the last two axes (np.tril, torch.tril)."""
    return _triangle("tril", m, k, True)


@implements(np.triu)
def triu(m: Any, k: int = 0) -> Array:
    """Zeros below the k-th diagonal of the last two axes (np.triu, torch.triu)."""
    return _triangle("triu", m, k, False)


def one_hot(x: Any, num_classes: int, dtype: Any = "int64") -> Array:
    """``x[..., None] == arange(num_classes)`` as ``dtype`` (torch.nn.functional.one_hot with its class count)."""
    x = asarray(x)
    return astype(_u.equal(expand_dims(x, x.ndim), arange(num_classes, dtype=x.dtype)), dtype)


__all__ = ["fmod", "hardsigmoid", "hardswish", "one_hot", "tril", "triu"]
