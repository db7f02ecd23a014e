"""A volunteer aligns what it fetched before computing with it (goblin_dask.volunteer.worker.realign).

Arrays received from the lab are views into the message's buffer at whatever offset their frame landed.  NumPy
runs a product with an unaligned strided operand in its own loop, not BLAS, and rounds otherwise than the lab's
recomputation on an aligned copy: an honest stage task with outputs that are zero but for rounding was rejected.
"""

from __future__ import annotations

import numpy as np

from goblin_dask.volunteer.worker import realign


def _unaligned(shape, dtype) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.zeros(n + 64, dtype=np.uint8)
    at = next(o for o in range(1, 64) if (raw.ctypes.data + o) % np.dtype(dtype).itemsize)
    return raw[at:at + n].view(dtype).reshape(shape)


def test_fetched_arrays_that_are_not_aligned_are_replaced_by_aligned_copies_and_the_rest_kept():
    rng = np.random.default_rng(0)
    w = _unaligned((48, 40), np.float32)
    w[...] = rng.standard_normal(w.shape)
    assert not w.flags.aligned
    kept = rng.standard_normal((8, 8)).astype(np.float32)
    data = {"w": w, "kept": kept, "number": 3}
    realign(data)
    assert data["w"].flags.aligned and data["w"].flags.c_contiguous
    np.testing.assert_array_equal(data["w"], w)
    assert data["kept"] is kept and data["number"] == 3


def test_a_product_with_a_realigned_transposed_weight_is_the_aligned_products_bit_for_bit():
    """What the lab recomputes (aligned) and what the volunteer computes after realign agree to the bit."""
    rng = np.random.default_rng(72)
    a = rng.standard_normal((72, 72)).astype(np.float32)
    w = _unaligned((12, 72), np.float32)  # a shape NumPy 2 multiplies otherwise when w is unaligned (here: 9e-6)
    w[...] = rng.standard_normal(w.shape)
    data = {"w": w}
    realign(data)
    np.testing.assert_array_equal(a @ data["w"].T, a @ np.array(w).T)
