"""Example calls of every catalog op, drawn inside each op's domain.

Shared by the tests and ``benchmarks/gpu_check.py`` so that both exercise every op the
same way; an op this module does not know gets one float operand and no params.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from goblin_dask.ops.registry import catalog
from goblin_dask.ops.spec import OpSpec

_DEFAULT_DOMAIN = (-3.0, 3.0)


def computes_on(spec: OpSpec, dtype: Any) -> bool:
    """Whether an elementwise op accepts operands of ``dtype`` (bitwise ops refuse floats)."""
    try:
        spec.extra["loop"](*([np.dtype(dtype)] * spec.arity))
        return True
    except TypeError:
        return False


def draw(spec: OpSpec, i: int, shape: tuple, dtype: Any, rng: np.random.Generator) -> np.ndarray:
    """Operand ``i`` of elementwise op ``spec``: values in its domain, in ``dtype``."""
    dt = np.dtype(dtype)
    if spec.name == "where" and i == 0:
        return rng.random(shape) < 0.5
    domain = spec.extra.get("domain") or ()
    lo, hi = domain[i] if i < len(domain) else _DEFAULT_DOMAIN
    if dt.kind == "b":
        return rng.random(shape) < 0.5
    if dt.kind in "iu":
        lo = max(lo, 0) if dt.kind == "u" else lo
        return rng.integers(int(np.ceil(lo)), max(int(np.floor(hi)), int(np.ceil(lo)) + 1), size=shape, endpoint=False).astype(dt)
    return rng.uniform(lo, hi, size=shape).astype(dt)


def _elementwise_dtype(spec: OpSpec, dtype: Any) -> np.dtype:
    return np.dtype(dtype) if computes_on(spec, dtype) else np.dtype("int64")


def example_calls(name: str, n: int, rng: np.random.Generator, dtype: Any = "float64") -> list[tuple[tuple, dict]]:
    """A few ``(operands, params)`` of op ``name`` on blocks about ``n`` x ``n``."""
    spec = catalog()[name]
    if "loop" in spec.extra:
        dt = _elementwise_dtype(spec, dtype)
        return [(tuple(draw(spec, i, (n, n), dt, rng) for i in range(spec.arity)), {})]
    a, b = (rng.standard_normal((n, n)).astype(dtype) for _ in range(2))
    v = rng.standard_normal(n).astype(dtype)
    table: dict[str, list[tuple[tuple, dict]]] = {
        "matmul": [((a, b), {}), ((a, v), {})],
        "matmul_accumulate": [((a, a, b), {})],
        "tensordot": [((a, b), {"axes": 1}), ((a, b), {"axes": ((0,), (1,))})],
        "einsum": [((a, b), {"subscripts": "ij,jk->ik"}), ((a, b), {"subscripts": "ij,kj->ik"}), ((a,), {"subscripts": "ij->ji"})],
        "formula": [((a, b), {"expr": "x0 * exp(-x1) + x0 / (1 + x1 * x1)"}), ((a, b), {"expr": "where(x0 > x1, sigmoid(x0), tanh(x1))"})],
        "transpose": [((a,), {"axes": (1, 0)})],
        "reshape": [((a,), {"shape": (-1,)})],
        "getitem": [((a,), {"index": (slice(1, None, 2), 0)})],
        "concatenate": [((a, b), {"axis": 0})],
        "stack": [((a, b), {"axis": 1})],
        "astype": [((a,), {"dtype": "float32"})],
        "broadcast_to": [((v,), {"shape": (n, n)})],
        "squeeze": [((a[:1],), {"axis": (0,)})],
        "expand_dims": [((a,), {"axis": (0,)})],
        "zeros": [((), {"shape": (n, n), "dtype": dtype})],
        "ones": [((), {"shape": (n, n), "dtype": dtype})],
        "full": [((), {"shape": (n, n), "fill_value": 2.5, "dtype": dtype})],
        "arange": [((), {"start": 0, "stop": n * n, "step": 1, "dtype": dtype})],
        "eye": [((), {"n": n, "k": 1, "dtype": dtype})],
        "random_standard_normal": [((), {"shape": (n, n), "dtype": dtype, "seed": 7})],
        "random_uniform": [((), {"shape": (n, n), "low": -1.0, "high": 2.0, "dtype": dtype, "seed": (7, 1)})],
        "sum": [((a,), {"axis": (1,), "keepdims": True}), ((a,), {})],
        "prod": [((a,), {"axis": (0,)})],
        "max": [((a,), {"axis": (1,)}), ((a,), {})],
        "min": [((a,), {"axis": (0,), "keepdims": True})],
        "any": [((a > 1,), {"axis": (0,)})],
        "all": [((a > -3,), {"axis": (1,)})],
        "argmax": [((a,), {"axis": 1}), ((a,), {})],
        "argmin": [((a,), {"axis": 0, "keepdims": True})],
        "argmax_partial": [((a,), {"axis": 0, "offsets": (n, 0), "shape": (3 * n, n)}), ((a,), {"offsets": (0, n), "shape": (n, 2 * n)})],
        "argmin_partial": [((a,), {"axis": 1, "offsets": (0, n), "shape": (n, 2 * n)})],
        "argmax_combine": [((a[:1], np.zeros((1, n), np.int64), b[:1], np.ones((1, n), np.int64)), {})],
        "argmin_combine": [((a[:1], np.zeros((1, n), np.int64), b[:1], np.ones((1, n), np.int64)), {})],
        "moments": [((a,), {"axis": (0,)}), ((a,), {})],
        "moments_combine": [((np.stack([a[:1], np.abs(a[1:2])]), np.stack([b[:1], np.abs(b[1:2])])), {"n1": 3, "n2": 5})],
    }
    return table.get(name, [((a,), {})])
