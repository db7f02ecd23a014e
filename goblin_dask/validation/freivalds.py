"""Freivalds checks: is ``C == A @ B (+ C0)``, in O(n^2), within a rounding-error bound.

The lab draws random vectors ``R`` at check time (never shown to the volunteer) and
compares ``C R`` with ``A (B R)`` (plus ``C0 R``).  In floating point the residual is
compared with a probabilistic rounding bound (Higham & Mary 2019): an entry of an
honest product deviates by at most ``lam * sqrt(k) * u * sum_l |a_il b_lj|`` with u the
unit roundoff of the volunteer's dtype and k the inner dimension; Cauchy-Schwarz,
``sum_l |a_il b_lj| <= ||a_i|| ||b_j||``, keeps the bound computable in O(n^2), and
independent entry errors add in quadrature along each projection.  Integer products
are checked exactly.  NaN and inf must sit exactly where numpy's product puts them:
rows of A and columns of B holding non-finite values are recomputed (they are few),
the finite rest is Freivalds-checked.
"""

from __future__ import annotations

import math

import numpy as np

#: Multiplier on the probabilistic rounding bound (Higham & Mary's lambda).
LAMBDA = 8.0
#: Target probability that a wrong result escapes one task's check.
ESCAPE_PROBABILITY = 1e-9
_U64 = float(np.finfo(np.float64).eps) / 2


def vectors_for(escape_probability: float = ESCAPE_PROBABILITY) -> int:
    """How many Gaussian vectors to draw for a target escape probability.

    A deviation of C whose projections exceed the tolerance by a factor ten escapes a
    Gaussian vector with probability at most P(|z| < 0.1) < 0.08, so k vectors give 0.08**k.
    """
    return max(2, math.ceil(math.log(escape_probability) / math.log(0.08)))


def _shape(ashape: tuple, bshape: tuple) -> tuple:
    """numpy.matmul's output shape (ValueError when the operands do not align)."""
    a2 = (1,) + tuple(ashape) if len(ashape) == 1 else tuple(ashape)
    b2 = tuple(bshape) + (1,) if len(bshape) == 1 else tuple(bshape)
    if a2[-1] != b2[-2]:
        raise ValueError(f"shapes {ashape} and {bshape} are not aligned")
    out = np.broadcast_shapes(a2[:-2], b2[:-2])
    return tuple(out) + ((a2[-2],) if len(ashape) > 1 else ()) + ((b2[-1],) if len(bshape) > 1 else ())


def check_product(c, a, b, c0=None, *, k: int | None = None, rng: np.random.Generator | None = None) -> bool:
    """True when ``c`` equals ``a @ b (+ c0)`` within rounding (1-d, 2-d or batched operands)."""
    a, b, c = np.asarray(a), np.asarray(b), np.asarray(c)
    c0 = None if c0 is None else np.asarray(c0)
    try:
        shape = _shape(a.shape, b.shape)
    except ValueError:
        return False
    want_dtype = np.result_type(a.dtype, b.dtype, *(() if c0 is None else (c0.dtype,)))
    if c.shape != shape or c.dtype != want_dtype:
        return False
    # Lift to stacks of 2-d problems.
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    full = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2]) + (a2.shape[-2], b2.shape[-1])
    c2 = c.reshape(full)
    c02 = None if c0 is None else np.broadcast_to(c0.reshape(c0.shape if c0.ndim == len(full) else shape), shape).reshape(full)
    a_b = np.broadcast_to(a2, full[:-2] + a2.shape[-2:])
    b_b = np.broadcast_to(b2, full[:-2] + b2.shape[-2:])
    rng = rng or np.random.default_rng()
    for idx in np.ndindex(*full[:-2]):
        if not _check_2d(c2[idx], a_b[idx], b_b[idx], None if c02 is None else c02[idx], k=k, rng=rng):
            return False
    return True


def _check_2d(c, a, b, c0, *, k, rng) -> bool:
    if c.size == 0:
        return True
    if c.dtype.kind in "biu":
        return _check_exact(c, a, b, c0, k=k, rng=rng)
    bad_rows = ~np.isfinite(a).all(axis=1)
    bad_cols = ~np.isfinite(b).all(axis=0)
    if c0 is not None:
        bad_rows |= ~np.isfinite(c0).all(axis=1)
    with np.errstate(all="ignore"):
        if bad_rows.any():
            want = a[bad_rows] @ b + (0 if c0 is None else c0[bad_rows])
            if not _same_values(c[bad_rows], want):
                return False
        if bad_cols.any():
            want = a @ b[:, bad_cols] + (0 if c0 is None else c0[:, bad_cols])
            if not _same_values(c[:, bad_cols], want):
                return False
    good_r, good_c = ~bad_rows, ~bad_cols
    if not good_r.any() or not good_c.any():
        return True
    if good_r.all() and good_c.all():
        cg, ag, bg, c0g = c, a, b, c0
    else:
        cg, ag, bg = c[good_r][:, good_c], a[good_r], b[:, good_c]
        c0g = None if c0 is None else c0[good_r][:, good_c]
    if not np.isfinite(cg).all():
        return False
    return _freivalds(cg, ag, bg, c0g, k=k or vectors_for(), rng=rng)


def _same_values(got: np.ndarray, want: np.ndarray) -> bool:
    """Exact agreement of the non-finite pattern, close agreement elsewhere."""
    fin = np.isfinite(want)
    scale = float(np.abs(want[fin]).max(initial=0.0))
    return (
        np.array_equal(np.isnan(got), np.isnan(want))
        and np.array_equal(np.isposinf(got), np.isposinf(want))
        and np.array_equal(np.isneginf(got), np.isneginf(want))
        and bool(np.allclose(got[fin], want[fin], rtol=1e-4, atol=1e-6 * (scale + 1.0)))
    )


def _freivalds(c, a, b, c0, *, k: int, rng: np.random.Generator) -> bool:
    u = float(np.finfo(c.dtype).eps) / 2
    work = np.complex128 if c.dtype.kind == "c" else np.float64
    c, a, b = (x.astype(work, copy=False) for x in (c, a, b))
    r = rng.standard_normal((b.shape[1], k))
    r2 = r * r
    residual = c @ r - a @ (b @ r)
    # the volunteer's rounding in each entry, projected in quadrature
    a_norm = np.sqrt(_sq_norms(a, axis=1))[:, None]
    b_norm2 = _sq_norms(b, axis=0)[None, :]
    scale = a_norm * np.sqrt(b_norm2 @ r2)
    inner = a.shape[1]
    tol = LAMBDA * math.sqrt(inner) * (u + _U64) * scale
    # rounding of the check itself, and of the addend
    tol += LAMBDA * _U64 * math.sqrt(c.shape[1]) * np.sqrt(_abs2(c) @ r2)
    if c0 is not None:
        c0 = c0.astype(work, copy=False)
        residual -= c0 @ r
        tol += LAMBDA * (u + _U64) * math.sqrt(c.shape[1]) * np.sqrt(_abs2(c0) @ r2)
    tol += np.finfo(np.float64).tiny
    return bool(np.all(np.abs(residual) <= tol))


def _abs2(x: np.ndarray) -> np.ndarray:
    return (x * x.conj()).real if x.dtype.kind == "c" else x * x


def _sq_norms(x: np.ndarray, axis: int) -> np.ndarray:
    return np.einsum("ij,ij->j" if axis == 0 else "ij,ij->i", x, x.conj()).real


def _check_exact(c, a, b, c0, *, k, rng) -> bool:
    """Integer products: exact Freivalds with random 0/1 vectors (escape <= 2**-k)."""
    k = max(k or 0, math.ceil(-math.log2(ESCAPE_PROBABILITY)))
    r = rng.integers(0, 2, size=(b.shape[1], k)).astype(c.dtype)
    with np.errstate(over="ignore"):
        lhs = c @ r - (0 if c0 is None else c0 @ r)
        rhs = a @ (b @ r)
    return bool(np.array_equal(lhs, rhs))
