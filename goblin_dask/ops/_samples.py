"""Example calls of every catalog op, drawn inside each op's domain.

Shared by the tests and ``benchmarks/gpu_check.py`` so that both exercise every op the
same way.  Each op declares its own (``OpSpec.examples``); elementwise ops get operands
drawn from their declared domain.
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
        spec.elementwise.loop(*([np.dtype(dtype)] * spec.arity))
        return True
    except TypeError:
        return False


def draw(spec: OpSpec, i: int, shape: tuple, dtype: Any, rng: np.random.Generator) -> np.ndarray:
    """Operand ``i`` of elementwise op ``spec``: values in its domain, in ``dtype``."""
    dt = np.dtype(dtype)
    if spec.name == "where" and i == 0:
        return rng.random(shape) < 0.5
    domain = spec.elementwise.domain or ()
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
    if spec.elementwise is not None:
        dt = _elementwise_dtype(spec, dtype)
        return [(tuple(draw(spec, i, (n, n), dt, rng) for i in range(spec.arity)), {})]
    if spec.examples is None:
        raise LookupError(f"op {name} declares no examples (OpSpec.examples)")
    return spec.examples(n, rng, np.dtype(dtype))
