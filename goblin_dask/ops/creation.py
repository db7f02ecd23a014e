"""Array creation: blocks made where the task runs, so no input data travels.

These ops take no operands, only static params (one block's shape and values).  Their
results are bitwise determined by the params: replicas are compared exactly.  NumPy's
kernels are memory-bound fills, so there is no numba or cupy kernel.
"""

from __future__ import annotations

import math
from numbers import Number
from typing import Any

import numpy as np

from goblin_dask.ops._factories import DTYPE_TEXT, check_dtype, shape_param
from goblin_dask.ops.registry import register
from goblin_dask.ops.spec import Cost, Exact, OpSpec, Verification


def number_param(opname: str, name: str, value: Any) -> Any:
    if not isinstance(value, (Number, np.generic)) or isinstance(value, np.generic) and value.dtype.kind not in "biufc":
        raise TypeError(f"{opname}: {name} must be a number, got {value!r}")
    return value


def creation_op(name: str, doc: str, numpy, shape_and_dtype, params: tuple[str, ...], examples,
                verify: Verification = Exact()) -> OpSpec:
    """Declare an operand-less op from ``shape_and_dtype(**params) -> (shape, dtype)``.

    ``examples(n, rng, dtype) -> [params, ...]``: example calls (they take no operands)."""

    def cost(**p: Any) -> Cost:
        shape, dtype = shape_and_dtype(**p)
        n = math.prod(shape)
        return Cost(float(n), float(n * dtype.itemsize))  # one write per element

    return register(
        OpSpec(
            name=name,
            doc=doc,
            shape_rule=lambda **p: shape_and_dtype(**p)[0],
            dtype_rule=lambda **p: shape_and_dtype(**p)[1],
            numpy=numpy,
            cost=cost,
            verify=verify,
            arity=0,
            params=params,
            text_params={"dtype": DTYPE_TEXT},
            examples=lambda n, rng, dtype: [((), p) for p in examples(n, rng, dtype)],
        )
    )


def _filled(opname: str):
    def rule(*, shape: Any = (), dtype: Any = "float64") -> tuple:
        return shape_param(opname, shape), check_dtype(opname, dtype)

    return rule


zeros = creation_op(
    "zeros", "A block of zeros.", lambda *, shape=(), dtype="float64": np.zeros(shape, dtype=dtype),
    _filled("zeros"), ("shape", "dtype"), lambda n, rng, dtype: [{"shape": (n, n), "dtype": dtype}],
)  # fmt: skip
ones = creation_op(
    "ones", "A block of ones.", lambda *, shape=(), dtype="float64": np.ones(shape, dtype=dtype),
    _filled("ones"), ("shape", "dtype"), lambda n, rng, dtype: [{"shape": (n, n), "dtype": dtype}],
)  # fmt: skip


def _full_rule(*, shape: Any = (), fill_value: Any = 0.0, dtype: Any = None) -> tuple:
    number_param("full", "fill_value", fill_value)
    dt = np.asarray(fill_value).dtype if dtype is None else dtype
    return shape_param("full", shape), check_dtype("full", dt)


full = creation_op(
    "full", "A block filled with one value.",
    lambda *, shape=(), fill_value=0.0, dtype=None: np.full(shape, fill_value, dtype=dtype),
    _full_rule, ("shape", "fill_value", "dtype"),
    lambda n, rng, dtype: [{"shape": (n, n), "fill_value": 2.5, "dtype": dtype}],
)  # fmt: skip


def _arange_bounds(start: Any, stop: Any, step: Any) -> tuple:
    if stop is None:  # arange(n) counts from 0, as numpy's does
        start, stop = 0, start
    for name, v in (("start", start), ("stop", stop), ("step", step)):
        number_param("arange", name, v)
    if step == 0:
        raise ValueError("arange: step must not be zero")
    return start, stop, step


def _arange_rule(*, start: Any = 0, stop: Any = None, step: Any = 1, dtype: Any = None) -> tuple:
    start, stop, step = _arange_bounds(start, stop, step)
    length = max(0, math.ceil((stop - start) / step))
    dt = np.result_type(start, stop, step) if dtype is None else dtype
    return (length,), check_dtype("arange", dt)


arange = creation_op(
    "arange", "Evenly spaced values start, start + step, ... below stop (one block's values).",
    lambda *, start=0, stop=None, step=1, dtype=None: np.arange(*_arange_bounds(start, stop, step), dtype=dtype),
    _arange_rule, ("start", "stop", "step", "dtype"),
    lambda n, rng, dtype: [{"start": 0, "stop": n * n, "step": 1, "dtype": dtype}],
)  # fmt: skip


def _eye_rule(*, n: Any, m: Any = None, k: Any = 0, dtype: Any = "float64") -> tuple:
    shape = shape_param("eye", (n, n if m is None else m))
    if not isinstance(k, (int, np.integer)) or type(k) is bool:
        raise ValueError(f"eye: k must be an int, got {k!r}")
    return shape, check_dtype("eye", dtype)


eye = creation_op(
    "eye", "A block with ones on the k-th diagonal and zeros elsewhere.",
    lambda *, n, m=None, k=0, dtype="float64": np.eye(n, m, k=k, dtype=dtype),
    _eye_rule, ("n", "m", "k", "dtype"), lambda n, rng, dtype: [{"n": n, "k": 1, "dtype": dtype}],
)  # fmt: skip
