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

    @numba.njit(cache=True, nogil=True)
    def project(v, seed, rows, block, out, stats):  # v: 1-d float; out: (rows, blocks); stats: max|v|, sum v^2, finite
        n = v.shape[0]
        blocks = out.shape[1]
        top, squares, finite = 0.0, 0.0, 1.0
        for i in range(n):
            x = float(v[i])
            if not np.isfinite(x):
                finite = 0.0
                break
            squares += x * x
            a = abs(x)
            if a > top:
                top = a
        stats[0], stats[1], stats[2] = top, squares, finite
        if finite == 0.0:
            return
        for r in range(rows):
            state = np.uint64(seed) ^ (np.uint64(r + 1) * np.uint64(0xD1B54A32D192ED03))
            for b in range(blocks):
                acc = 0.0
                start = b * block
                stop = min(n, start + block)
                for i0 in range(start, stop, 64):
                    state += np.uint64(0x9E3779B97F4A7C15)
                    z = state
                    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
                    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
                    z = z ^ (z >> np.uint64(31))
                    for i in range(i0, min(i0 + 64, stop)):
                        bit = (z >> np.uint64(i - i0)) & np.uint64(1)
                        acc += float(v[i]) * (1.0 - 2.0 * float(bit))
                out[r, b] = acc

    return project


def block_projections(values: np.ndarray, seed: int, rows: int, block: int) -> tuple[np.ndarray, float, float] | None:
    """(projections, largest magnitude, norm) of ``values``, or None where a value is not finite.

    Projections: (rows, ceil(n / block)) float64, each block of ``values`` summed with random signs."""
    v = np.ascontiguousarray(values.reshape(-1))
    if v.dtype not in (np.float32, np.float64):
        v = v.astype(np.float64)
    out = np.zeros((rows, -(-v.size // block)))
    stats = np.zeros(3)
    _kernel()(v, np.uint64(seed % (1 << 64)), rows, block, out, stats)
    if not stats[2]:
        return None
    return out, float(stats[0]), float(np.sqrt(stats[1]))
