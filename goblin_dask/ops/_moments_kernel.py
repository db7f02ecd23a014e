"""numba kernel of ``moments``: (sum, M2) in one pass over memory, where NumPy needs four.

NumPy computes ``sum``, then ``x - mean`` and its square (two full-size temporaries, fresh
memory each time), then their sum.  This kernel reads each block of ``CHUNK`` values once
while it is in cache: the block's own two-pass (sum, M2), merged into the running totals by
Chan et al.'s update (the one ``moments_combine`` applies between blocks), accumulated in
float64 whatever the input precision.  Partial sums run in ``LANES`` fixed lanes, so the
summation order does not depend on the machine; the lab recomputes with this same kernel when it
samples a volunteer's result (:meth:`goblin_dask.validation.checks._Check.lab_result`).
tests/test_ops_reductions.py checks it against float64 references; benchmarks/moments.py
times it against NumPy's kernel.

Two layouts are compiled: reduced axes trailing (each output from a contiguous run) and
reduced axes leading (every output advances together along rows, vectorised across them).
Any other layout, dtype or an empty reduction runs NumPy's kernel.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Callable

import numpy as np

#: Values of one output merged at a time (the block's two passes run from L1).
CHUNK = 1024
#: Rows merged at a time in the leading-axes layout.
ROWS = 64
#: Partial sums per output in the trailing-axes layout.
LANES = 8


@lru_cache(maxsize=1)
def _kernels() -> tuple[Callable, Callable]:
    import numba

    @numba.njit(cache=True, nogil=True)
    def trailing(x, out):  # x: (outer, inner) C-contiguous; out: (2, outer)
        outer, inner = x.shape
        acc = np.zeros(LANES)
        for i in range(outer):
            n, total, m2 = 0, 0.0, 0.0
            for start in range(0, inner, CHUNK):
                stop = min(start + CHUNK, inner)
                k = stop - start
                # LANES independent partial sums (a fixed order, whatever the machine),
                # which the compiler may keep in one SIMD register
                body = start + (k // LANES) * LANES
                acc[:] = 0.0
                for j in range(start, body, LANES):
                    for lane in range(LANES):
                        acc[lane] += x[i, j + lane]
                for j in range(body, stop):
                    acc[j - body] += x[i, j]
                s = acc.sum()
                mean = s / k
                acc[:] = 0.0
                for j in range(start, body, LANES):
                    for lane in range(LANES):
                        d = x[i, j + lane] - mean
                        acc[lane] += d * d
                for j in range(body, stop):
                    d = x[i, j] - mean
                    acc[j - body] += d * d
                q = acc.sum()
                if n == 0:
                    total, m2 = s, q
                else:
                    delta = mean - total / n
                    m2 += q + delta * delta * (n * k / (n + k))
                    total += s
                n += k
            out[0, i] = total
            out[1, i] = m2

    @numba.njit(cache=True, nogil=True)
    def leading(x, out):  # x: (reduced, outer) C-contiguous; out: (2, outer)
        reduced, outer = x.shape
        s = np.empty(outer)
        q = np.empty(outer)
        total = np.zeros(outer)
        m2 = np.zeros(outer)
        n = 0
        for start in range(0, reduced, ROWS):
            stop = min(start + ROWS, reduced)
            k = stop - start
            s[:] = 0.0
            for r in range(start, stop):
                for j in range(outer):
                    s[j] += x[r, j]
            q[:] = 0.0
            for r in range(start, stop):
                for j in range(outer):
                    d = x[r, j] - s[j] / k
                    q[j] += d * d
            if n == 0:
                for j in range(outer):
                    total[j] = s[j]
                    m2[j] = q[j]
            else:
                w = n * k / (n + k)
                for j in range(outer):
                    delta = s[j] / k - total[j] / n
                    m2[j] += q[j] + delta * delta * w
                    total[j] += s[j]
            n += k
        for j in range(outer):
            out[0, j] = total[j]
            out[1, j] = m2[j]

    return trailing, leading


def compile_all() -> int:
    """Compile (or load from numba's cache) both layouts for float32 and float64; returns how many."""
    trailing, leading = _kernels()
    for dt in (np.float32, np.float64):
        for kernel in (trailing, leading):
            kernel(np.ones((2, 3), dt), np.empty((2, 2), dt))
    return 4


def moments_numba(x: Any, *, axis=None, numpy_kernel: Callable[..., Any], axes: tuple[int, ...]) -> np.ndarray:
    """(sum, M2) of ``x`` over ``axes`` (already normalised), stacked on a leading axis of 2, keepdims."""
    x = np.asarray(x)
    nd, r = x.ndim, len(axes)
    inner = math.prod(x.shape[i] for i in axes)
    if x.dtype.kind != "f" or x.dtype.itemsize < 4 or inner == 0 or not x.flags.c_contiguous or r == 0:
        return numpy_kernel(x, axis=axis)
    keep_shape = tuple(1 if i in axes else n for i, n in enumerate(x.shape))
    outer = x.size // inner
    trailing, leading = _kernels()
    out = np.empty((2, outer), x.dtype)
    if axes == tuple(range(nd - r, nd)):
        trailing(x.reshape(outer, inner), out)
    elif axes == tuple(range(r)):
        leading(x.reshape(inner, outer), out)
    else:
        return numpy_kernel(x, axis=axis)
    return out.reshape((2,) + keep_shape)
