"""Arrays made from parameters alone: zeros, ones, full, arange, eye; random blocks from a seed."""

from __future__ import annotations

import itertools

import secrets
from typing import Any

import numpy as np

from goblin_dask.array.core import Array, catalog_task, from_graph, new_name, normalize_chunks, offsets_of
from goblin_dask.ops import get
from goblin_dask.ops._factories import check_dtype, shape_param


def _filled(opname: str, shape: Any, chunks: Any, dtype: Any, **params: Any) -> Array:
    shape = shape_param(opname, shape)
    dt = check_dtype(opname, dtype)
    chunks = normalize_chunks(chunks, shape, dt, where=opname)
    name = new_name(opname, shape, chunks, dt.name, params)
    layer = {}
    for idx in itertools.product(*(range(len(c)) for c in chunks)):
        key = (name, *idx)
        block = tuple(c[i] for c, i in zip(chunks, idx))
        layer[key] = catalog_task(key, opname, shape=block, dtype=dt.name, **params)
    return from_graph(name, layer, chunks, dt)


def zeros(shape, dtype="float64", chunks="auto") -> Array:
    return _filled("zeros", shape, chunks, dtype)


def ones(shape, dtype="float64", chunks="auto") -> Array:
    return _filled("ones", shape, chunks, dtype)


def full(shape, fill_value, dtype=None, chunks="auto") -> Array:
    dtype = dtype if dtype is not None else np.asarray(fill_value).dtype
    get("full").abstract_eval(shape=shape_param("full", shape), fill_value=fill_value, dtype=np.dtype(dtype).name)
    return _filled("full", shape, chunks, dtype, fill_value=fill_value)


def zeros_like(x, dtype=None, chunks=None) -> Array:
    return zeros(x.shape, dtype or x.dtype, chunks or getattr(x, "chunks", "auto"))


def ones_like(x, dtype=None, chunks=None) -> Array:
    return ones(x.shape, dtype or x.dtype, chunks or getattr(x, "chunks", "auto"))


def full_like(x, fill_value, dtype=None, chunks=None) -> Array:
    return full(x.shape, fill_value, dtype or x.dtype, chunks or getattr(x, "chunks", "auto"))


def arange(start, stop=None, step=1, dtype=None, chunks="auto") -> Array:
    """Evenly spaced values like numpy.arange; each block computes its own values."""
    if stop is None:
        start, stop = 0, start
    whole = get("arange").abstract_eval(start=start, stop=stop, step=step, **({"dtype": np.dtype(dtype).name} if dtype else {}))
    n, dt = whole.shape[0], whole.dtype
    chunks = normalize_chunks(chunks, (n,), dt, where="arange")
    name = new_name("arange", start, stop, step, dt.name, chunks)
    offs, layer = offsets_of(chunks[0]), {}
    exact = all(isinstance(v, (int, np.integer)) for v in (start, stop, step))
    for i, size in enumerate(chunks[0]):
        b_start = start + offs[i] * step
        b_stop = b_start + size * step if exact else b_start + (size - 0.5) * step
        key = (name, i)
        layer[key] = catalog_task(key, "arange", start=b_start, stop=b_stop, step=step, dtype=dt.name)
    return from_graph(name, layer, chunks, dt)


def eye(N: int, M: int | None = None, k: int = 0, dtype="float64", chunks="auto") -> Array:
    M = N if M is None else M
    dt = check_dtype("eye", dtype)
    chunks = normalize_chunks(chunks, (N, M), dt, where="eye")
    name = new_name("eye", N, M, k, dt.name, chunks)
    ro, co = offsets_of(chunks[0]), offsets_of(chunks[1])
    layer = {}
    for i, j in itertools.product(range(len(chunks[0])), range(len(chunks[1]))):
        key = (name, i, j)
        layer[key] = catalog_task(key, "eye", n=chunks[0][i], m=chunks[1][j], k=k + ro[i] - co[j], dtype=dt.name)
    return from_graph(name, layer, chunks, dt)


# -- random ---------------------------------------------------------------------------------

def _random(opname: str, size: Any, chunks: Any, dtype: Any, seed: Any, **params: Any) -> Array:
    shape = shape_param(opname, () if size is None else size)
    dt = check_dtype(opname, dtype)
    chunks = normalize_chunks(chunks, shape, dt, where=opname)
    seed = secrets.randbits(63) if seed is None else seed
    base = tuple(int(s) for s in (seed if isinstance(seed, (tuple, list)) else (seed,)))
    name = new_name(opname, shape, chunks, dt.name, base, params)
    layer = {}
    for idx in itertools.product(*(range(len(c)) for c in chunks)):
        key = (name, *idx)
        block = tuple(c[i] for c, i in zip(chunks, idx))
        layer[key] = catalog_task(key, opname, shape=block, dtype=dt.name, seed=base + idx, **params)
    return from_graph(name, layer, chunks, dt)


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
