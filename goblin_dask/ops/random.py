"""Random blocks, generated where the task runs from a seed: no input data travels.

``numpy.random.Generator(PCG64(seed))`` is deterministic, so replicas agree and the lab
can recompute any block.  ``seed`` is a non-negative int or a tuple of them (the array
layer passes ``(user_seed, block index...)``, which PCG64's SeedSequence mixes into
independent streams).  No cupy kernel: cupy's generators give other numbers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from goblin_dask.ops._factories import check_dtype, shape_param
from goblin_dask.ops.creation import creation_op, number_param
from goblin_dask.ops.spec import Replica


def _seed(opname: str, seed: Any) -> Any:
    parts = seed if isinstance(seed, (tuple, list)) else (seed,)
    if not parts or not all(isinstance(p, (int, np.integer)) and type(p) is not bool and p >= 0 for p in parts):
        raise ValueError(f"{opname}: seed must be a non-negative int or a tuple of them, got {seed!r}")
    return [int(p) for p in parts] if isinstance(seed, (tuple, list)) else int(seed)


def _generator(opname: str, seed: Any) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(_seed(opname, seed)))


def _random_rule(opname: str):
    def rule(*, shape: Any = (), dtype: Any = "float64", seed: Any = None, low: Any = 0.0, high: Any = 1.0) -> tuple:
        dt = check_dtype(opname, dtype)
        if dt not in (np.float32, np.float64):
            raise TypeError(f"{opname}: unsupported dtype {dt} (float32 or float64)")
        _seed(opname, seed)
        number_param(opname, "low", low)
        number_param(opname, "high", high)
        return shape_param(opname, shape), dt

    return rule


def _standard_normal(*, shape: Any = (), dtype: Any = "float64", seed: Any) -> np.ndarray:
    return _generator("random_standard_normal", seed).standard_normal(shape, dtype=np.dtype(dtype))


def _uniform(*, shape: Any = (), low: Any = 0.0, high: Any = 1.0, dtype: Any = "float64", seed: Any) -> np.ndarray:
    # low + (high - low) * u, as Generator.uniform computes it, but in the requested precision
    dt = np.dtype(dtype)
    u = _generator("random_uniform", seed).random(shape, dtype=dt)
    u *= dt.type(high - low)
    u += dt.type(low)
    return u


random_standard_normal = creation_op(
    "random_standard_normal", "Standard normal samples from PCG64(seed).", _standard_normal,
    _random_rule("random_standard_normal"), ("shape", "dtype", "seed"),
    lambda n, rng, dtype: [{"shape": (n, n), "dtype": dtype, "seed": 7}], verify=Replica(),
)  # fmt: skip
random_uniform = creation_op(
    "random_uniform", "Uniform samples in [low, high) from PCG64(seed).", _uniform,
    _random_rule("random_uniform"), ("shape", "low", "high", "dtype", "seed"),
    lambda n, rng, dtype: [{"shape": (n, n), "low": -1.0, "high": 2.0, "dtype": dtype, "seed": (7, 1)}], verify=Replica(),
)  # fmt: skip
