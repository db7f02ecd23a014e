"""The stage-task fingerprint's kernel against its definition, written plainly in NumPy.

Each block of ``SKETCH_BLOCK`` values is summed with random signs, two rows of them, the signs drawn 64 at a
time from a splitmix64 stream per row (seeded by the seed and the row, advanced once per 64 values, restarted
at each block's start); with the values' largest magnitude and norm.  The kernel sums in partial sums in an
order of its own, so it agrees with the definition to rounding, not bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from goblin_dask.ops._sketch_kernel import block_projections

MASK = (1 << 64) - 1


def _signs(seed: int, row: int, blocks: list[int]) -> list[np.ndarray]:
    """Per block of the given lengths, its signs (+1 / -1) for ``row``, by the definition."""
    state = (seed ^ ((row + 1) * 0xD1B54A32D192ED03)) & MASK
    out = []
    for length in blocks:
        signs = []
        for i0 in range(0, length, 64):
            state = (state + 0x9E3779B97F4A7C15) & MASK
            z = state
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
            z ^= z >> 31
            signs += [1.0 - 2.0 * ((z >> j) & 1) for j in range(min(64, length - i0))]
        out.append(np.array(signs))
    return out


def _reference(v: np.ndarray, seed: int, block: int):
    v = v.astype(np.float64)
    edges = list(range(0, v.size, block)) + [v.size]
    lengths = [b - a for a, b in zip(edges[:-1], edges[1:])]
    rows = [[float(np.dot(v[a:a + n], s)) for a, n, s in zip(edges, lengths, _signs(seed, r, lengths))]
            for r in range(2)]
    return np.array(rows), float(np.abs(v).max(initial=0.0)), float(np.sqrt(np.dot(v, v)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n, block", [(1, 256), (63, 256), (256, 256), (1000, 256), (70_001, 256), (777, 100)])
def test_the_kernel_gives_the_definitions_projections_to_rounding(dtype, n, block):
    rng = np.random.default_rng(n)
    v = (rng.standard_normal(n) * np.exp(rng.uniform(-6, 6, n))).astype(dtype)
    seed = int(rng.integers(1 << 63))
    got, top, norm = block_projections(v, seed, 2, block)
    want, want_top, want_norm = _reference(v, seed, block)
    assert got.shape == want.shape == (2, -(-n // block))
    scale = np.array([np.abs(v[a:a + block].astype(np.float64)).sum() for a in range(0, n, block)])
    assert np.all(np.abs(got - want) <= 1e-13 * scale + 1e-300)
    assert top == want_top
    assert norm == pytest.approx(want_norm, rel=1e-13)


def test_a_value_that_is_not_finite_gives_none_and_an_overflowing_norm_does_not():
    v = np.ones(1000)
    for bad in (np.nan, np.inf, -np.inf):
        w = v.copy()
        w[517] = bad
        assert block_projections(w, 7, 2, 256) is None
        assert block_projections(w.astype(np.float32), 7, 2, 256) is None
    huge = np.full(300, 1e200)
    got, top, norm = block_projections(huge, 7, 2, 256)
    assert top == 1e200 and norm == np.inf and np.all(np.isfinite(got))


def test_the_kernel_projects_on_two_rows_only():
    with pytest.raises(ValueError, match="2 rows"):
        block_projections(np.ones(10), 1, 3, 256)
