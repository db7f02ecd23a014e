"""numba kernel of a stage task's fingerprint: random-sign block sums in one pass over the outputs.

Each element's sign comes from a splitmix64 stream seeded by (seed, output, row), 64 signs per draw,
so the lab and a volunteer compute the same signs from the seed alone and the sign vectors never
travel; sums run in float64 in a fixed order (the same on every machine).  NumPy would need the sign
vectors materialised (several passes and temporaries per row): ~10x slower, measured on a GPT's gradients.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@lru_cache(maxsize=1)
def _kernel() -> Callable:
    import numba

    @numba.njit(inline="always")
    def draw(state):  # splitmix64's output function: 64 signs
        z = (state ^ (state >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    @numba.njit(inline="always")
    def pairwise(a):
        return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))

    @numba.njit(cache=True, nogil=True, error_model="numpy")
    def project(v, seed, block, out, stats):  # v: 1-d float; out: (2, blocks); stats: max|v|, sum v^2, finite
        # One pass over v for both rows and the statistics, each sum kept in 8 partial sums (element i in
        # sum i % 8, added pairwise at the end of its block): independent sums the processor runs side by side
        # (2x faster than one running sum), in an order fixed by the code alone, so the same on every machine.
        n = v.shape[0]
        blocks = out.shape[1]
        state0 = np.uint64(seed) ^ np.uint64(0xD1B54A32D192ED03)
        state1 = np.uint64(seed) ^ (np.uint64(2) * np.uint64(0xD1B54A32D192ED03))
        row0, row1 = np.zeros(8), np.zeros(8)
        squares, tops, nonfinite = np.zeros(8), np.zeros(8), np.zeros(8)
        signs0, signs1 = np.empty(64), np.empty(64)
        for b in range(blocks):
            row0[:] = 0.0
            row1[:] = 0.0
            start = b * block
            stop = min(n, start + block)
            for i0 in range(start, stop, 64):
                state0 += np.uint64(0x9E3779B97F4A7C15)
                state1 += np.uint64(0x9E3779B97F4A7C15)
                z0, z1 = draw(state0), draw(state1)
                for j in range(64):
                    signs0[j] = 1.0 - 2.0 * float((z0 >> np.uint64(j)) & np.uint64(1))
                    signs1[j] = 1.0 - 2.0 * float((z1 >> np.uint64(j)) & np.uint64(1))
                m = min(64, stop - i0)
                for k in range(0, m - m % 8, 8):
                    for lane in range(8):
                        x = np.float64(v[i0 + k + lane])  # float() keeps a float32 a float32 in numba
                        squares[lane] += x * x
                        tops[lane] = max(tops[lane], abs(x))
                        nonfinite[lane] += x * 0.0  # NaN once any x is NaN or infinite
                        row0[lane] += x * signs0[k + lane]
                        row1[lane] += x * signs1[k + lane]
                for j in range(m - m % 8, m):
                    x = np.float64(v[i0 + j])
                    squares[0] += x * x
                    tops[0] = max(tops[0], abs(x))
                    nonfinite[0] += x * 0.0
                    row0[0] += x * signs0[j]
                    row1[0] += x * signs1[j]
            out[0, b] = pairwise(row0)
            out[1, b] = pairwise(row1)
        stats[0], stats[1] = tops.max(), pairwise(squares)
        stats[2] = 1.0 if np.isfinite(pairwise(nonfinite)) else 0.0

    return project


#: Rows of signs per block: the kernel computes two (a fingerprint's rows, ``SKETCH_ROWS``).
ROWS = 2


def block_projections(values: np.ndarray, seed: int, rows: int, block: int) -> tuple[np.ndarray, float, float] | None:
    """(projections, largest magnitude, norm) of ``values``, or None where a value is not finite.

    Projections: (rows, ceil(n / block)) float64, each block of ``values`` summed with random signs."""
    if rows != ROWS:
        raise ValueError(f"the sketch kernel projects on {ROWS} rows of signs, not {rows}")
    v = np.ascontiguousarray(values.reshape(-1))
    if v.dtype not in (np.float32, np.float64):
        v = v.astype(np.float64)
    out = np.zeros((rows, -(-v.size // block)))
    stats = np.zeros(3)
    _kernel()(v, np.uint64(seed % (1 << 64)), block, out, stats)
    if not stats[2]:
        return None
    return out, float(stats[0]), float(np.sqrt(stats[1]))
