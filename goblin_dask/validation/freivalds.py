"""Freivalds checks: is ``C == A @ B (+ C0)``, in O(n^2), within a rounding-error bound.

The lab draws random Gaussian vectors ``R`` at check time (never shown to the volunteer)
and compares ``(C - C0) R`` with ``A (B R)``, in float64 (complex128) whatever the
volunteer's precision.  Row ``i`` of the residual, for vector ``r``, is
``sum_j e_ij r_j`` with ``e = C - C0 - A B`` the volunteer's error; since ``r`` is
random and independent of ``e`` it is a self-normalised Gaussian sum, so an honest
residual exceeds ``z * sqrt(sum_j s_ij^2 r_j^2)`` with probability below
``2 exp(-z^2 / 2)`` whenever ``|e_ij| <= s_ij``.  The per-entry scale is
``s_ij = rho |a_i| |b_j|`` (Cauchy-Schwarz: ``|c_ij| <= sum_l |a_il b_lj| <= |a_i| |b_j|``),
computable in O(n^2); row and column norms of an operand block are computed once
while it lives (it is an operand of a whole block row or column of tasks).

``rho`` is the honest kernel's error per unit of ``|a_i| |b_j|``.  Worst-case theory
(Higham & Mary's probabilistic bound, ``sqrt(k) u``) overstates what blocked BLAS
kernels make by one to two orders of magnitude, enough to hide a wrong element of a
float32 product.  So for precisions below float64 the lab *measures* it: it computes a
few random rows of the product itself, in the volunteer's precision and in float64,
and takes the largest error ratio (floored at ``u / 4``).  For float64 and complex128
(no cheaper higher-precision reference) ``rho = sqrt(k) u``.  The rounding of
``C0 + A B`` and the check's own rounding are added as bounds.  In float64 the check's own
rounding, bounded, was as large as the volunteer's (it let every entry be biased by 16x
Higham & Mary's bound), so for real float64 the vectors are integers and the projections
are computed almost exactly (:func:`_freivalds_exact`); complex128 keeps the bounds.

Where a row of A or a column of B is all zeros, the product is exactly 0 (or C0) for every
honest kernel, and nothing else is accepted there (a -5e-324 passed a tolerance of 2.2e-308,
and ``sqrt`` of it is NaN where numpy's gives 0).

Passing that test accepts.  Failing it is not yet a rejection: the lab computes the
product exactly (float64) and compares entry by entry with Higham & Mary's
probabilistic bound ``lambda sqrt(k) u (|A| |B|)_ij``, which any honest summation
order meets, with NaN and inf exactly where numpy's product has them.  So a
miscalibration costs a recomputation, never an honest volunteer's standing, and a
rejected result already has its replacement (that product, rounded once).

Rows of A, columns of B (and rows of C0) holding NaN or inf are recomputed on the lab
(they are few) and compared the same way, with twice the bound against numpy's own
product; the finite rest is Freivalds-checked.  Integer products are checked exactly
(random 0/1 vectors, arithmetic modulo the word size, as numpy's products wrap);
boolean products are recomputed.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, NamedTuple

import numpy as np

#: Higham & Mary's lambda: the entry-wise bound fails with probability <= 2 exp(-lambda^2 / 2).
LAMBDA = 8.0
#: Standard deviations of an honest residual the projected test allows (2 exp(-z^2/2) ~ 2.5e-14).
Z = 8.0
#: Rows of the product the lab computes itself to measure an honest kernel's error.
CALIBRATION_ROWS = 8
#: Target probability that a wrong result escapes one task's check.
ESCAPE_PROBABILITY = 1e-9
_U64 = float(np.finfo(np.float64).eps) / 2
_TINY = float(np.finfo(np.float64).tiny)


def vectors_for(escape_probability: float = ESCAPE_PROBABILITY) -> int:
    """How many Gaussian vectors to draw for a target escape probability.

    A deviation whose projections exceed the tolerance by a factor ten escapes a
    Gaussian vector with probability at most P(|z| < 0.1) < 0.08, so k vectors give 0.08**k.
    """
    return max(2, math.ceil(math.log(escape_probability) / math.log(0.08)))


class Verdict(NamedTuple):
    """What the check found: ``accepted``, and the lab's own product when it computed one."""

    accepted: bool
    #: the lab's recomputation (full result), when the check needed one; else None
    recomputed: np.ndarray | None = None

    def __bool__(self) -> bool:
        return self.accepted


def _shape(ashape: tuple, bshape: tuple) -> tuple:
    """numpy.matmul's output shape (ValueError when the operands do not align)."""
    a2 = (1,) + tuple(ashape) if len(ashape) == 1 else tuple(ashape)
    b2 = tuple(bshape) + (1,) if len(bshape) == 1 else tuple(bshape)
    if a2[-1] != b2[-2]:
        raise ValueError(f"shapes {ashape} and {bshape} are not aligned")
    out = np.broadcast_shapes(a2[:-2], b2[:-2])
    return tuple(out) + ((a2[-2],) if len(ashape) > 1 else ()) + ((b2[-1],) if len(bshape) > 1 else ())


def check_product(c, a, b, c0=None, *, k: int | None = None, rng: np.random.Generator | None = None) -> Verdict:
    """Does ``c`` equal ``a @ b (+ c0)`` within rounding?  (1-d, 2-d or batched operands.)

    Returns a :class:`Verdict` (truthy when accepted); for a 2-d product it carries the
    lab's recomputation when the check made one, so a rejected result need not be
    computed twice.
    """
    a, b, c = np.asarray(a), np.asarray(b), np.asarray(c)
    c0 = None if c0 is None else np.asarray(c0)
    try:
        shape = _shape(a.shape, b.shape)
    except ValueError:
        return Verdict(False)
    want_dtype = np.result_type(a.dtype, b.dtype, *(() if c0 is None else (c0.dtype,)))
    if c.shape != shape or c.dtype != want_dtype:
        return Verdict(False)
    if c0 is not None:
        try:
            c0 = np.broadcast_to(c0, shape)
        except ValueError:
            return Verdict(False)
    rng = rng or np.random.default_rng()
    if a.ndim == b.ndim == 2:
        return _check_2d(c, a, b, c0, k=k, rng=rng)
    # Lift to stacks of 2-d problems.
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    full = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2]) + (a2.shape[-2], b2.shape[-1])
    c2 = c.reshape(full)
    c02 = None if c0 is None else c0.reshape(full)
    a_b = np.broadcast_to(a2, full[:-2] + a2.shape[-2:])
    b_b = np.broadcast_to(b2, full[:-2] + b2.shape[-2:])
    if c.dtype.kind == "f" and _check_stack(c2, a_b, b_b, c02, k=k, rng=rng):
        return Verdict(True)
    # Not real floating point, not finite, or suspicious: entry by entry, each decided as a 2-d product.
    for idx in np.ndindex(*full[:-2]):
        if not _check_2d(c2[idx], a_b[idx], b_b[idx], None if c02 is None else c02[idx], k=k, rng=rng):
            return Verdict(False)
    return Verdict(True)


def _check_2d(c, a, b, c0, *, k, rng) -> Verdict:
    if c.size == 0:
        return Verdict(True)
    if c.dtype.kind == "b":
        want = _lab_product(a, b, c0, c.dtype)
        return Verdict(bool(np.array_equal(c, want)), want)
    if c.dtype.kind in "iu":
        return Verdict(_check_exact(c, a, b, c0, k=k, rng=rng))
    u, inner = _unit_roundoff(c.dtype), a.shape[1]
    a_full, b_full = a, b
    work = np.dtype(np.complex128 if c.dtype.kind == "c" else np.float64)
    with np.errstate(all="ignore"):
        a_n2, b_n2 = _operand_sq_norms(a, axis=1), _operand_sq_norms(b, axis=0)
    # Rows and columns holding NaN or inf (or too large to square): the lab recomputes them.
    bad_rows, bad_cols = ~np.isfinite(a_n2), ~np.isfinite(b_n2)
    if c0 is not None:
        bad_rows |= ~_finite_rows(c0)
    every = slice(None)
    for sel, rows, cols in ((bad_rows, bad_rows, every), (bad_cols, every, bad_cols)):
        if sel.any():
            c0s = None if c0 is None else c0[rows][:, cols]
            want = _lab_product(a[rows], b[:, cols], c0s, c.dtype)
            if not _close(c[rows][:, cols], want, _entry_bound(a[rows], b[:, cols], c0s), u, inner):
                return Verdict(False)
    good_r, good_c = ~bad_rows, ~bad_cols
    if not good_r.any() or not good_c.any():
        return Verdict(True)
    whole = bool(good_r.all() and good_c.all())
    part = (lambda x: x) if whole else (lambda x: x[good_r][:, good_c])
    cg, c0g = part(c), None if c0 is None else part(c0)
    if not whole:
        a, b = a[good_r], b[:, good_c]
        a_n2, b_n2 = a_n2[good_r], b_n2[good_c]
    # Where a row of A or a column of B is all zeros, every honest kernel's product is exactly 0
    # (plus C0): not a subnormal of either sign (sqrt of one gives NaN where numpy gives 0).
    zero_r, zero_c = _zero_lines(a, a_n2, axis=1), _zero_lines(b, b_n2, axis=0)
    if zero_r.any() or zero_c.any():
        for rows, cols in ((zero_r, slice(None)), (slice(None), zero_c)):
            got = cg[rows][:, cols]
            if not np.array_equal(got, np.zeros_like(got) if c0g is None else c0g[rows][:, cols]):
                return _decide(c, a_full, b_full, c0, part, a, b, u, work)
    vectors = k or vectors_for()
    r = br = None
    if u > 1e3 * _U64:  # measured on a few rows, in the same pass over B as B R (its vectors drawn next)
        rho, r, br = _calibrate(a, b, a_n2, b_n2, rng, work, vectors)
    else:
        rho = math.sqrt(inner) * u
    verdict = None
    if c.dtype == np.float64:  # the check computed in the volunteer's own precision: almost exactly
        verdict = _freivalds_exact(cg, a, b, c0g, a_n2, b_n2, rho=rho, k=vectors, rng=rng)
    if verdict is None:
        verdict = _freivalds(cg, a, b, c0g, a_n2, b_n2, work=work, u=u, rho=rho, k=vectors, rng=rng, r=r, br=br)
    if verdict:
        return Verdict(True)
    # Suspicious: the lab computes the product itself and decides entry by entry.
    return _decide(c, a_full, b_full, c0, part, a, b, u, work)


#: Elements of float64 temporaries a stacked check works on at a time (8 MiB): measured 1.3-1.8x
#: faster than 32 MiB groups on attention-sized stacks (fresh float64 memory costs page faults).
_STACK_ELEMENTS = 1 << 20


def _check_stack(c, a, b, c0, *, k, rng) -> bool:
    """The projected test on a stack of real products at once (attention scores, ``bmm``): True accepts.

    The same test as a 2-d check, entry by entry in NumPy's stacked products rather than a
    Python loop (a loop costs more than the products at attention sizes).  False is not a
    rejection: the caller then decides entry by entry (non-finite data, miscalibration, cheating).
    """
    m, inner, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if c.size == 0:
        return True
    if c.dtype == np.float64:  # checked entry by entry with the exact projections (see _freivalds_exact)
        return False
    stack = (-1, m, inner), (-1, inner, n), (-1, m, n)
    a3, b3, c3 = (np.reshape(x, sh) for x, sh in zip((a, b, c), stack))
    c03 = None if c0 is None else np.reshape(c0, stack[2])
    per_entry = max(1, m * inner + inner * n + 2 * m * n)
    group = max(1, _STACK_ELEMENTS // per_entry)
    vectors = k or vectors_for()
    for lo in range(0, c3.shape[0], group):
        part = slice(lo, lo + group)
        if not _freivalds_stack(c3[part], a3[part], b3[part], None if c03 is None else c03[part],
                                vectors, rng):
            return False
    return True


def _freivalds_stack(c, a, b, c0, vectors: int, rng: np.random.Generator) -> bool:
    """:func:`_freivalds` (with :func:`_calibrate`) over a stack ``(entries, rows, cols)`` in float64."""
    u, inner = _unit_roundoff(c.dtype), a.shape[-1]
    with np.errstate(all="ignore"):
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        a_n2 = np.einsum("eij,eij->ei", a64, a64)
        b_n2 = np.einsum("eij,eij->ej", b64, b64)
        if not (np.isfinite(a_n2).all() and np.isfinite(b_n2).all()):
            return False
        if c0 is not None and not np.isfinite(c0).all():
            return False
        if u > 1e3 * _U64:  # measure the honest kernel's error on a few rows of every entry
            rows = rng.choice(a.shape[1], size=min(CALIBRATION_ROWS, a.shape[1]), replace=False)
            err = np.matmul(a[:, rows], b).astype(np.float64) - a64[:, rows] @ b64
            err2 = np.einsum("eij,eij->ei", err, err)
            scale2 = a_n2[:, rows] * b_n2.sum(axis=1)[:, None]
            ratio = np.sqrt(np.where(scale2 > 0, err2, 0.0) / np.where(scale2 > 0, scale2, 1.0))
            measured = ratio.max(axis=1)
            rho = np.where(np.isfinite(measured), np.maximum(measured, u / 4), math.sqrt(inner) * u)
        else:
            rho = np.full(a.shape[0], math.sqrt(inner) * u)
        # one set of vectors for every entry: each entry's test is still against vectors drawn after
        # its result was fixed, so its escape probability is unchanged (as rows of a 2-d C share them)
        r = rng.standard_normal((b.shape[2], vectors))
        r2 = r * r
        r_norm = np.sqrt(r2.sum(axis=0))[None, None, :]
        br = b64 @ r
        d = c.astype(np.float64) if c0 is None else c.astype(np.float64) - c0.astype(np.float64)
        residual = d @ r - a64 @ br
        a_norm = np.sqrt(a_n2)[:, :, None]
        tol = Z * rho[:, None, None] * a_norm * np.sqrt(b_n2 @ r2)[:, None, :]
        check = 2 * np.sqrt(b_n2.sum(axis=1))[:, None, None] * r_norm + np.sqrt((br * br).sum(axis=1))[:, None, :]
        tol += LAMBDA * math.sqrt(max(inner, b.shape[2])) * _U64 * a_norm * check
        if c0 is not None:
            c0_norm = np.sqrt(np.einsum("eij,eij->ei", c0, c0, dtype=np.float64))[:, :, None]
            d_norm = np.sqrt(np.einsum("eij,eij->ei", d, d))[:, :, None]
            tol += (Z * u * (c0_norm + d_norm)
                    + LAMBDA * math.sqrt(max(inner, b.shape[2])) * _U64 * (2 * c0_norm + d_norm) * r_norm)
        tol += _TINY
        return bool(np.isfinite(tol).all() and np.all(np.abs(residual) <= tol))


def _decide(c, a, b, c0, part, a_good, b_good, u: float, work: np.dtype) -> Verdict:
    """Entry by entry against the exact product (float64): within ``lambda sqrt(k) u sum_l |a_il b_lj|``.

    The replacement the lab hands back is that product rounded once to the result's
    precision; where it is not finite (overflow), numpy's own product decides.
    """
    cg, c0g = part(c), None if c0 is None else part(c0)
    with np.errstate(all="ignore"):
        exact = a.astype(work, copy=False) @ b.astype(work, copy=False)
        if c0 is not None:
            exact = exact + c0
        replacement = exact.astype(c.dtype)
    if not (np.isfinite(replacement).all() and np.isfinite(cg).all()):
        replacement = _lab_product(a, b, c0, c.dtype)
    ok = _close(cg, part(replacement), _entry_bound(a_good, b_good, c0g), u, a.shape[1], part(exact))
    # a row of A or a column of B of zeros: exactly the accumulator (or 0), as any honest kernel gives
    zero = ~a_good.any(axis=1)[:, None] | ~b_good.any(axis=0)[None, :]
    if ok and zero.any():
        ok = bool(np.array_equal(cg[zero], part(replacement)[zero]))
    return Verdict(ok, replacement)


def _unit_roundoff(dtype: np.dtype) -> float:
    return float(np.finfo(dtype).eps) / 2


def _lab_product(a, b, c0, dtype) -> np.ndarray:
    """The product as the catalog's kernels compute it (matmul, then the accumulator added)."""
    with np.errstate(all="ignore"):
        p = np.matmul(a, b)
        if c0 is not None:
            p = c0 + p
    return np.asarray(p).astype(dtype, copy=False)


def _entry_bound(a, b, c0) -> tuple[np.ndarray, float]:
    """``sum_l |a_il b_lj| (+ |c0_ij|)`` in float64, as (bound / scale, scale): each entry's error scales with it.

    The scale is a power of two taken out of both operands, so the bound of data near
    the overflow threshold stays finite (an infinite bound would accept anything).
    """
    with np.errstate(all="ignore"):
        abs_a, abs_b = np.abs(a).astype(np.float64), np.abs(b).astype(np.float64)
        sa, sb = _pow2(abs_a), _pow2(abs_b)
        bound = (abs_a / sa) @ (abs_b / sb)
        if c0 is not None:
            bound += np.abs(c0).astype(np.float64) / (sa * sb)
    return bound, sa * sb


def _pow2(x: np.ndarray) -> float:
    """A power of two near the largest finite magnitude in ``x`` (1.0 when there is none)."""
    top = float(np.max(x, where=np.isfinite(x), initial=0.0))
    return math.ldexp(1.0, math.frexp(top)[1]) if top > 0 else 1.0


def _close(got, want, bound_scaled, u: float, inner: int, exact=None) -> bool:
    """NaN/inf exactly where ``want`` has them; elsewhere within the probabilistic bound.

    Of the ``exact`` product when given (one rounding error to allow for), else of ``want``
    (the lab's own result in the same precision: twice the bound).
    """
    bound, scale = bound_scaled
    if not (np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isinf(got), np.isinf(want))):
        return False
    with np.errstate(all="ignore"):
        inf = np.isinf(want)
        if inf.any() and not np.array_equal(got[inf], want[inf]):  # same signs (and phases)
            return False
        fin = np.isfinite(want)
        work = np.complex128 if got.dtype.kind == "c" else np.float64
        reference, factor = (want, 2.0) if exact is None else (exact, 1.0)
        diff = np.abs(got[fin].astype(work) / scale - reference[fin].astype(work) / scale)
        tol = factor * LAMBDA * math.sqrt(max(inner, 1)) * (u + _U64) * bound[fin] + _TINY / scale
        return bool(np.all(diff <= tol))


def _freivalds(c, a, b, c0, a_n2, b_n2, *, work: np.dtype, u: float, rho: float, k: int,
               rng: np.random.Generator, r: np.ndarray | None = None, br: np.ndarray | None = None) -> bool:
    """The projected test: every |((C - C0) R - A (B R))_iv| within z honest standard deviations.

    ``r`` and ``br``: the vectors and ``B R`` when the caller drew and computed them (:func:`_calibrate`)."""
    inner, m = a.shape[1], max(a.shape[1], b.shape[1])
    if r is None:
        r = rng.standard_normal((b.shape[1], k))
    r2 = r * r
    r_norm = np.sqrt(r2.sum(axis=0))[None, :]
    with np.errstate(all="ignore"):
        if br is None:
            br = _times(b, r, work)
        if c0 is None:
            dr, c0_norm, c_norm = _times(c, r, work), None, None
        else:
            dr, c0_norm, c_norm = _difference_terms(c, c0, r, work)
        residual = dr - _times(a, br, work)
        a_norm = np.sqrt(a_n2)[:, None]
        tol = Z * rho * a_norm * np.sqrt(b_n2 @ r2)[None, :]  # z sqrt(sum_j (rho |a_i| |b_j| r_j)^2)
        # rounding of the check itself (float64 products, each bounded through |c_ij| <= |a_i| |b_j|)
        check = 2 * math.sqrt(b_n2.sum()) * r_norm + np.sqrt(_sq_norms(br, axis=0))[None, :]
        tol += LAMBDA * math.sqrt(m) * _U64 * a_norm * check
        if c0 is not None:
            # the volunteer's rounding of c0 + a @ b (a Gaussian projection of errors within u |c_ij|,
            # and within u |c0_ij| for a kernel that accumulates into c0), and the check's own of
            # c @ r, c0 @ r and their difference
            tol += Z * u * (c0_norm + c_norm) + 2 * LAMBDA * math.sqrt(m) * _U64 * (c0_norm + c_norm) * r_norm
        tol += _TINY
        # an infinite tolerance (data near overflow) proves nothing: let the lab recompute
        return bool(np.isfinite(tol).all() and np.all(np.abs(residual) <= tol))


#: Bytes of ``work``-precision temporaries a check converts at a time: the lab never copies a
#: whole float32 operand into float64 (fresh memory costs page faults, and the lab's memory is the
#: grid's).  256 KiB stays in the core's L2 cache: measured 1.6-2x faster than 4 MiB blocks for
#: ``C r`` of a 2048 x 768 float32 C (AMD EPYC and Skylake-X alike), and faster than 64 KiB blocks.
_CHUNK_BYTES = 1 << 18


def _rows_per_chunk(x: np.ndarray, work: np.dtype) -> int:
    return max(1, _CHUNK_BYTES // max(1, x.shape[1] * work.itemsize))


def _times(x: np.ndarray, y: np.ndarray, work: np.dtype, norms: bool = False) -> Any:
    """``x @ y`` in ``work`` precision, for a large ``x`` and a thin ``y``, a block of rows of ``x`` at a time.

    ``norms``: also the row norms of ``x`` (a column), from the same blocks: ``(x @ y, norms)``."""
    if x.dtype == work and not norms:
        return x @ y
    out = np.empty((x.shape[0], y.shape[1]), np.result_type(work, y.dtype))
    row_norms = np.empty((x.shape[0], 1)) if norms else None
    step = _rows_per_chunk(x, work)
    for i in range(0, x.shape[0], step):
        xi = x[i:i + step].astype(work, copy=False)
        np.matmul(xi, y, out=out[i:i + step])
        if norms:
            row_norms[i:i + step, 0] = np.sqrt(_sq_norms(xi, axis=1))
    return (out, row_norms) if norms else out


def _difference_terms(c, c0, r, work: np.dtype):
    """``(C - C0) r`` and the row norms of ``C0`` and of ``C``, in ``work``, a block of rows at a time.

    Computed as ``C r - C0 r``: a bias broadcast over the rows (``c0`` a row repeated) is projected
    once, not once per row, and neither ``C0`` nor ``C - C0`` is ever materialised.
    """
    cr, c_norm = _times(c, r, work, norms=True)
    if c0.ndim == 2 and c0.shape[0] > 1 and c0.strides[0] == 0:
        row = c0[:1].astype(work)
        c0r = row @ r
        c0_norm = np.full((c.shape[0], 1), math.sqrt(float(_sq_norms(row, axis=1)[0])))
    else:
        c0r, c0_norm = _times(c0, r, work, norms=True)
    return cr - c0r, c0_norm, c_norm


def _calibrate(a, b, a_n2, b_n2, rng: np.random.Generator, work: np.dtype, vectors: int):
    """An honest kernel's error on this data, per unit of |a_i| |b_j|, measured on a few rows; and the
    test's Gaussian vectors ``R`` (drawn after the rows) with ``B R``, from the same pass over B.

    The lab computes random rows of the product in the volunteer's precision (as the
    catalog kernel does) and in float64; the largest ratio ``|e_s| / (|a_s| |B|_F)``
    (floored at ``u / 4``) stands for every row.  Returns ``(rho, R, B R)``.
    """
    u = _unit_roundoff(np.result_type(a.dtype, b.dtype))
    rows = rng.choice(a.shape[0], size=min(CALIBRATION_ROWS, a.shape[0]), replace=False)
    r = rng.standard_normal((b.shape[1], vectors))
    with np.errstate(all="ignore"):
        exact, br = _times_both(a[rows], b, r, work)
        err = np.matmul(a[rows], b).astype(work) - exact
        err2, scale2 = _sq_norms(err, axis=1), a_n2[rows] * b_n2.sum()
        ratio = np.sqrt(err2[scale2 > 0] / scale2[scale2 > 0])
    measured = float(ratio.max(initial=0.0))
    rho = max(measured, u / 4) if math.isfinite(measured) else math.sqrt(a.shape[1]) * u
    return rho, r, br


def _times_both(s: np.ndarray, x: np.ndarray, r: np.ndarray, work: np.dtype):
    """``(s @ x, x @ r)`` in ``work`` precision, for a few rows ``s``, a large ``x`` and a thin ``r``: one
    conversion of each block of rows of ``x`` serves both (it is the check's largest cost)."""
    s = s.astype(work, copy=False)
    if x.dtype == work:
        return s @ x, x @ r
    left = np.zeros((s.shape[0], x.shape[1]), work)
    right = np.empty((x.shape[0], r.shape[1]), np.result_type(work, r.dtype))
    step = _rows_per_chunk(x, work)
    for i in range(0, x.shape[0], step):
        xi = x[i:i + step].astype(work)
        left += s[:, i:i + step] @ xi
        np.matmul(xi, r, out=right[i:i + step])
    return left, right


def _finite_rows(x: np.ndarray) -> np.ndarray:
    """Rows of ``x`` (2-d) holding only finite numbers; a row broadcast down ``x`` (a bias) is looked at once."""
    if x.shape[0] > 1 and x.strides[0] == 0:
        return np.full(x.shape[0], bool(np.isfinite(x[0]).all()))
    return np.isfinite(x).all(axis=1)


def _zero_lines(x: np.ndarray, sq_norms: np.ndarray, axis: int) -> np.ndarray:
    """Rows (axis=1) or columns (axis=0) of ``x`` that are all zeros, from their squared norms: a line
    of norm 0 is all zeros or holds only numbers whose squares underflow, which one look tells apart."""
    zero = sq_norms == 0
    if zero.any():
        lines = np.flatnonzero(zero)
        zero[lines] = ~(x[lines].any(axis=1) if axis == 1 else x[:, lines].any(axis=0))
    return zero


def _sq_norms(x: np.ndarray, axis: int) -> np.ndarray:
    """Squared 2-norms (float64) of the rows (axis=1) or columns (axis=0), without an n^2 temporary."""
    work = np.complex128 if x.dtype.kind == "c" else np.float64
    return np.einsum("ij,ij->j" if axis == 0 else "ij,ij->i", x, x.conj(), dtype=work).real


def _operand_sq_norms(x: np.ndarray, axis: int) -> np.ndarray:
    """:func:`_sq_norms` of an operand, remembered while it lives: a block of A (B) is an
    operand of every task of its block row (column), and its norms cost a pass over it."""
    if x.size < 1 << 16:
        return _sq_norms(x, axis)
    key = (id(x), axis)
    hit = _NORMS.get(key)
    if hit is not None and hit[0]() is x:
        return hit[1]
    norms = _sq_norms(x, axis)
    try:
        _NORMS[key] = (weakref.ref(x), norms)
        weakref.finalize(x, _NORMS.pop, key, None)
    except TypeError:  # not weak-referenceable
        pass
    return norms


_NORMS: dict[tuple[int, int], tuple[weakref.ref, np.ndarray]] = {}


def _check_exact(c, a, b, c0, *, k, rng) -> bool:
    """Integer products: exact Freivalds with random 0/1 vectors (escape <= 2**-k).

    numpy's integer products wrap modulo the word size, and so do ``C r`` and
    ``A (B r)``: the check works in that ring.
    """
    k = max(k or 0, math.ceil(-math.log2(ESCAPE_PROBABILITY)))
    r = rng.integers(0, 2, size=(b.shape[1], k)).astype(c.dtype)
    with np.errstate(over="ignore"):
        lhs = c @ r - (0 if c0 is None else c0.astype(c.dtype) @ r)
        rhs = a.astype(c.dtype) @ (b.astype(c.dtype) @ r)
    return bool(np.array_equal(lhs, rhs))


# -- float64: the projections computed (almost) exactly --------------------------------------
#
# In float64 the check's own arithmetic has the volunteer's precision, and bounding its rounding
# (``lambda sqrt(n) u |c_i| |r|``) allowed systematic errors far beyond an honest kernel's.  So for
# real float64 the vectors are integers (Gaussian draws in steps of 1/256 of a standard deviation,
# below 2**12) and each large operand is split by rows into a part on a coarse grid, whose products
# with integers are exact in any summation order (BLAS or not, any blocking or thread count), and a
# small remainder whose rounding is negligible.  The check's error is then a few units of
# ``|projection|``: the tolerance is the volunteer's rounding alone.

#: Gaussian vectors are rounded to multiples of 1/_R_STEP (integers after scaling by it), clipped at
#: 8 standard deviations: every entry is an integer of magnitude below 2**_R_BITS.
_R_STEP = 256.0
_R_BITS = 12
#: Largest row exponent split exactly (the grid offset 1.5 * 2**(e + 52 - bits) must stay finite).
_MAX_EXPONENT = 960


def _integer_vectors(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    g = np.clip(rng.standard_normal((n, k)), -8.0, 8.0)
    return np.rint(g * _R_STEP)


def _row_exponents(x: np.ndarray, bits: int) -> np.ndarray | None:
    """Per row ``e`` with ``max |x_i| < 2**e``, raised so the grid 2**(e - bits) is no finer than
    float64's smallest subnormal; None when a row is too large to split."""
    if x.shape[1] == 0:
        top = np.zeros(x.shape[0])
    else:
        top = np.maximum(np.max(x, axis=1), -np.min(x, axis=1)).astype(np.float64)  # no |x| temporary
    e = np.maximum(np.frexp(top)[1].astype(np.int64), bits - 1073)
    if e.size and int(e.max()) > _MAX_EXPONENT:
        return None
    return e


def _split_times(x: np.ndarray, y: np.ndarray, bits: int):
    """``(x_hi @ y, x_lo @ y, e)`` with ``x = x_hi + x_lo`` exactly, ``x_hi`` on the grid ``2**(e_i - bits)``
    (at most ``bits`` bits per entry), ``|x_lo| <= 2**(e_i - bits - 1)``; None when a row is too large
    to split.  A block of rows at a time, in two buffers reused for every block (fresh temporaries cost
    page faults: measured 10x slower)."""
    out_hi = np.empty((x.shape[0], y.shape[1]))
    out_lo = np.empty((x.shape[0], y.shape[1]))
    e_all = np.empty(x.shape[0], np.int64)
    step = max(1, _CHUNK_BYTES // max(1, x.shape[1] * 8))
    hi_buf, lo_buf = np.empty((min(step, x.shape[0]), x.shape[1])), np.empty((min(step, x.shape[0]), x.shape[1]))
    for i in range(0, x.shape[0], step):
        xi = x[i:i + step]
        rows = xi.shape[0]
        e = _row_exponents(xi, bits)
        if e is None:
            return None
        e_all[i:i + rows] = e
        hi, lo, sigma = hi_buf[:rows], lo_buf[:rows], 1.5 * np.ldexp(1.0, e + 52 - bits)[:, None]
        np.add(xi, sigma, out=hi)  # rounds x to the grid: (x + sigma) - sigma
        np.subtract(hi, sigma, out=hi)
        np.subtract(xi, hi, out=lo)
        np.matmul(hi, y, out=out_hi[i:i + rows])
        np.matmul(lo, y, out=out_lo[i:i + rows])
    return out_hi, out_lo, e_all


def _gamma(n: int) -> float:
    return n * _U64 / (1 - n * _U64)


def _exact_projection(x: np.ndarray, r: np.ndarray):
    """``x @ r`` for integer vectors ``r`` (``|r| < 2**_R_BITS``), and a bound on its error, entry by entry;
    None when ``x`` is too large to split."""
    n = x.shape[1]
    bits = 51 - _R_BITS - max(1, math.ceil(math.log2(max(n, 2))))
    split = _split_times(x, r, bits)
    if split is None:
        return None
    hi, lo, e = split
    with np.errstate(all="ignore"):
        xr = hi + lo  # hi exact; lo's rounding below, and one rounding of the sum
        lo_norm = math.sqrt(n) * np.ldexp(1.0, e - bits - 1)[:, None]  # |x_lo_i| bound
        err = _U64 * np.abs(xr) + _gamma(n) * lo_norm * np.sqrt((r * r).sum(axis=0))[None, :] + _TINY
    return xr, err


def _exact_times(a: np.ndarray, a_norm: np.ndarray, y: np.ndarray):
    """``a @ y`` for a general float64 ``y`` (few columns), and a bound on its error entry by entry; None
    when the split would leave float64's range.  Both are split: the products of the coarse parts
    are exact, the rest are small."""
    k = a.shape[1]
    both = 51 - max(1, math.ceil(math.log2(max(k, 2))))
    ba = both // 2
    by = both - ba
    ey = _row_exponents(y.T, by)
    if ey is None or a.shape[0] == 0:
        return None
    sigma_y = 1.5 * np.ldexp(1.0, ey + 52 - by)[None, :]
    y_hi = (y + sigma_y) - sigma_y
    y_lo = y - y_hi
    split = _split_times(a, np.concatenate([y_hi, y_lo], axis=1), ba)
    if split is None:
        return None
    t_hi, t_lo, ea = split
    # the exact products live on the grid 2**(ea_i - ba + ey_v - by): it must not underflow
    if int(ea.min()) - ba + int(ey.min()) - by < -1074 or int(ea.max()) + int(ey.max()) + 4 > 1023:
        return None
    v = y.shape[1]
    exact, hi_lo = t_hi[:, :v], t_hi[:, v:]  # a_hi @ y_hi (exact), a_hi @ y_lo
    lo_y = t_lo[:, :v] + t_lo[:, v:]  # a_lo @ y
    with np.errstate(all="ignore"):
        ay = exact + (hi_lo + lo_y)
        a_lo_norm = math.sqrt(k) * np.ldexp(1.0, ea - ba - 1)[:, None]
        y_norm = np.sqrt((y * y).sum(axis=0))[None, :]
        y_lo_norm = math.sqrt(k) * np.ldexp(1.0, ey - by - 1)[None, :]
        err = (_gamma(k) * ((a_norm + a_lo_norm) * y_lo_norm + a_lo_norm * (y_norm + y_lo_norm))
               + 3 * _U64 * (np.abs(exact) + np.abs(hi_lo) + np.abs(lo_y)) + _TINY)
    return ay, err


def _freivalds_exact(c, a, b, c0, a_n2, b_n2, *, rho: float, k: int, rng: np.random.Generator) -> bool | None:
    """The projected test for real float64, with the projections computed almost exactly (see above).

    True accepts; False is suspicious (the caller decides entry by entry); None: data too near
    float64's range to split (the caller falls back to the bounded float64 test)."""
    r = _integer_vectors(b.shape[1], k, rng)
    r2 = r * r
    parts = [_exact_projection(b, r), _exact_projection(c, r)]
    if c0 is not None:
        parts.append(_exact_projection(c0, r))
    if any(p is None for p in parts):
        return None
    (y, y_err), (cr, cr_err) = parts[0], parts[1]
    a_norm = np.sqrt(a_n2)[:, None]
    ay = _exact_times(a, a_norm, y)
    if ay is None:
        return None
    ay, ay_err = ay
    with np.errstate(all="ignore"):
        dr = cr if c0 is None else cr - parts[2][0]
        residual = dr - ay
        # the volunteer's rounding: z sqrt(sum_j (rho |a_i| |b_j| r_j)^2)
        tol = Z * rho * a_norm * np.sqrt(b_n2 @ r2)[None, :]
        # the check's own: the projections, y's error carried through a, and the differences
        tol += cr_err + ay_err + a_norm * np.sqrt((y_err * y_err).sum(axis=0))[None, :]
        tol += 2 * _U64 * (np.abs(cr) + np.abs(ay))
        if c0 is not None:
            c0r, c0r_err = parts[2]
            r_top = float(np.abs(r).max(initial=0.0))
            c0_norm = np.sqrt(_sq_norms(c0, axis=1))[:, None]
            c_norm = np.sqrt(_sq_norms(c, axis=1))[:, None]
            # the volunteer's rounding of c0 + a @ b: within u |c_ij| (and u |c0_ij| when it accumulates)
            tol += Z * _U64 * (c0_norm + c_norm) * r_top + c0r_err + 2 * _U64 * np.abs(c0r)
        return bool(np.isfinite(tol).all() and np.all(np.abs(residual) <= tol))
