"""Arrays made from parameters alone: zeros, ones, full, arange, eye; random blocks from a seed."""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np

from goblin_dask.array.core import Array, blockwise, normalize_chunks, offsets_of, refuse
from goblin_dask.array.numpy_api import implements
from goblin_dask.ops import get
from goblin_dask.ops._factories import check_dtype, shape_param


def _filled(opname: str, shape: Any, chunks: Any, dtype: Any, **params: Any) -> Array:
    shape = shape_param(opname, shape)
    dt = check_dtype(opname, dtype)
    chunks = normalize_chunks(chunks, shape, dt, where=opname)

    def block(idx):
        return (), None, {"shape": tuple(c[i] for c, i in zip(chunks, idx)), "dtype": dt.name, **params}

    return blockwise(opname, chunks, dt, block, token=(shape, chunks, dt.name, params))


def zeros(shape, dtype="float64", chunks="auto") -> Array:
    return _filled("zeros", shape, chunks, dtype)


def ones(shape, dtype="float64", chunks="auto") -> Array:
    return _filled("ones", shape, chunks, dtype)


def full(shape, fill_value, dtype=None, chunks="auto") -> Array:
    dtype = dtype if dtype is not None else np.asarray(fill_value).dtype
    get("full").abstract_eval(shape=shape_param("full", shape), fill_value=fill_value, dtype=np.dtype(dtype).name)
    return _filled("full", shape, chunks, dtype, fill_value=fill_value)


def _like(func: str, a: Any, dtype: Any, order: str, shape: Any, device: Any, chunks: Any) -> tuple:
    """(shape, dtype, chunks) of a new array like ``a`` (NumPy's ``*_like`` keywords; ``chunks``: ga's)."""
    refuse(func, order=order not in ("K", "A", "C"), device=device not in (None, "cpu"))
    dtype = a.dtype if dtype is None else dtype
    if shape is not None:
        return shape, dtype, chunks or "auto"
    return a.shape, dtype, chunks or getattr(a, "chunks", "auto")


@implements(np.zeros_like)
def zeros_like(a, dtype=None, order="K", subok=True, shape=None, *, device=None, chunks=None) -> Array:
    """Zeros with ``a``'s shape, dtype and blocks."""
    return zeros(*_like("zeros_like", a, dtype, order, shape, device, chunks))


@implements(np.ones_like)
def ones_like(a, dtype=None, order="K", subok=True, shape=None, *, device=None, chunks=None) -> Array:
    """Ones with ``a``'s shape, dtype and blocks."""
    return ones(*_like("ones_like", a, dtype, order, shape, device, chunks))


@implements(np.full_like)
def full_like(a, fill_value, dtype=None, order="K", subok=True, shape=None, *, device=None, chunks=None) -> Array:
    """``fill_value`` everywhere, with ``a``'s shape, dtype and blocks."""
    shape, dtype, chunks = _like("full_like", a, dtype, order, shape, device, chunks)
    return full(shape, fill_value, dtype, chunks)


def arange(start, stop=None, step=1, dtype=None, chunks="auto") -> Array:
    """Evenly spaced values like numpy.arange; each block computes its own values."""
    if stop is None:
        start, stop = 0, start
    whole = get("arange").abstract_eval(start=start, stop=stop, step=step, **({"dtype": np.dtype(dtype).name} if dtype else {}))
    n, dt = whole.shape[0], whole.dtype
    chunks = normalize_chunks(chunks, (n,), dt, where="arange")
    offs = offsets_of(chunks[0])
    exact = all(isinstance(v, (int, np.integer)) for v in (start, stop, step))

    def block(idx):
        (i,) = idx
        b_start = start + offs[i] * step
        b_stop = b_start + chunks[0][i] * step if exact else b_start + (chunks[0][i] - 0.5) * step
        return (), None, {"start": b_start, "stop": b_stop, "step": step, "dtype": dt.name}

    return blockwise("arange", chunks, dt, block, token=(start, stop, step, dt.name, chunks))


def eye(N: int, M: int | None = None, k: int = 0, dtype="float64", chunks="auto") -> Array:
    M = N if M is None else M
    dt = check_dtype("eye", dtype)
    chunks = normalize_chunks(chunks, (N, M), dt, where="eye")
    ro, co = offsets_of(chunks[0]), offsets_of(chunks[1])

    def block(idx):
        i, j = idx
        return (), None, {"n": chunks[0][i], "m": chunks[1][j], "k": k + ro[i] - co[j], "dtype": dt.name}

    return blockwise("eye", chunks, dt, block, token=(N, M, k, dt.name, chunks))


# -- random ---------------------------------------------------------------------------------

def _random(opname: str, size: Any, chunks: Any, dtype: Any, seed: Any, **params: Any) -> Array:
    shape = shape_param(opname, () if size is None else size)
    dt = check_dtype(opname, dtype)
    chunks = normalize_chunks(chunks, shape, dt, where=opname)
    seed = secrets.randbits(63) if seed is None else seed
    base = tuple(int(s) for s in (seed if isinstance(seed, (tuple, list)) else (seed,)))

    def block(idx):
        return (), None, {"shape": tuple(c[i] for c, i in zip(chunks, idx)), "dtype": dt.name, "seed": base + idx,
                          **params}

    return blockwise(opname, chunks, dt, block, token=(shape, chunks, dt.name, base, params))


class RandomModule:
    """``ga.random``: blocks generated where the task runs from ``(seed, block index)``: no data travels."""

    @staticmethod
    def standard_normal(size=None, dtype="float64", chunks="auto", seed=None) -> Array:
        return _random("random_standard_normal", size, chunks, dtype, seed)

    @staticmethod
    def normal(loc=0.0, scale=1.0, size=None, dtype="float64", chunks="auto", seed=None) -> Array:
        z = _random("random_standard_normal", size, chunks, dtype, seed)
        return z * scale + loc if (scale, loc) != (1.0, 0.0) else z

    @staticmethod
    def uniform(low=0.0, high=1.0, size=None, dtype="float64", chunks="auto", seed=None) -> Array:
        return _random("random_uniform", size, chunks, dtype, seed, low=float(low), high=float(high))

    @staticmethod
    def random(size=None, dtype="float64", chunks="auto", seed=None) -> Array:
        return _random("random_uniform", size, chunks, dtype, seed, low=0.0, high=1.0)


random = RandomModule()
