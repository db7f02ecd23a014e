"""The checks themselves, against numpy float64 references (no grid: see test_verification_grid)."""

from __future__ import annotations

import numpy as np
import pytest
from dask._task_spec import DataNode, Task, TaskRef

from goblin_dask.ops import CatalogTask, get
from goblin_dask.validation.checks import accept, insert_checks, is_unverified_key, same_result
from goblin_dask.validation.freivalds import ESCAPE_PROBABILITY, check_product, vectors_for
from scheduler_plugins.verification import TrustPolicy
from tests.cheaters import corrupt

RNG = np.random.default_rng(2024)


def _operands(kind: str, n: int, dtype):
    shape = (n, n + 3), (n + 3, n - 1)
    if kind == "normal":
        a, b = (RNG.standard_normal(s) for s in shape)
    elif kind == "positive":  # partial sums grow: the largest rounding errors of a blocked kernel
        a, b = (RNG.random(s) for s in shape)
    elif kind == "offset":  # mean far above the spread
        a, b = (1 + 1e-3 * RNG.standard_normal(s) for s in shape)
    elif kind == "scaled":  # rows and columns over ten orders of magnitude
        a = RNG.standard_normal(shape[0]) * 10.0 ** RNG.uniform(-5, 5, (shape[0][0], 1))
        b = RNG.standard_normal(shape[1]) * 10.0 ** RNG.uniform(-5, 5, (1, shape[1][1]))
    elif kind == "huge":  # near float64's range: squares would overflow
        a, b = (RNG.standard_normal(s) * 1e150 for s in shape)
    else:
        raise ValueError(kind)
    return a.astype(dtype), b.astype(dtype)


DTYPES = [np.float32, np.float64, np.complex64, np.complex128]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("kind", ["normal", "positive", "offset", "scaled"])
@pytest.mark.parametrize("n", [16, 200, 700])
def test_honest_products_are_accepted_without_recomputation(dtype, kind, n):
    a, b = _operands(kind, n, dtype)
    if np.dtype(dtype).kind == "c":
        a = a + 1j * _operands(kind, n, dtype)[0]
    verdict = check_product(a @ b, a, b)
    assert verdict.accepted and verdict.recomputed is None  # not even suspicious


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("kind", ["normal", "positive", "offset", "scaled"])
@pytest.mark.parametrize("cheat", ["noise", "zeros", "element"])
@pytest.mark.parametrize("n", [64, 1024])
def test_wrong_products_are_rejected(dtype, kind, cheat, n):
    a, b = _operands(kind, n, dtype)
    c = a @ b
    wrong = corrupt(cheat, c, {})
    assert not np.array_equal(wrong, c)
    verdict = check_product(wrong, a, b)
    assert not verdict.accepted
    # the lab's own product comes with the rejection, equal to numpy's
    want = a.astype(np.float64) @ b.astype(np.float64)
    tol = 1e-5 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(verdict.recomputed, want, rtol=tol, atol=tol * np.abs(want).max())


def test_a_stale_result_and_a_transposed_one_are_rejected():
    a, b = _operands("normal", 300, np.float64)
    a2, b2 = _operands("normal", 300, np.float64)
    assert not check_product(a2 @ b2, a, b)
    square = a[:, :300] @ b[:300, :300]
    assert not check_product(square.T.copy(), a[:, :300], b[:300, :300])


def test_float32_single_element_off_by_1e_3_is_detected_at_large_sizes():
    for n in (256, 1024, 2048):
        a, b = _operands("normal", n, np.float32)
        c = a @ b
        for trial in range(3):
            wrong = c.copy()
            wrong.flat[RNG.integers(c.size)] *= np.float32(1 + 1e-3)
            if abs(wrong - c).max() > 1e-3 * 0.5 * np.abs(c).max():  # a full-size element
                assert not check_product(wrong, a, b), (n, trial)
        assert not check_product(corrupt("element", c, {}), a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_stacked_products_are_checked_at_once_and_every_entry_counts(dtype):
    """Attention-shaped stacks (64 entries) go through the stacked check; one wrong element of one
    entry, a wrong entry, a NaN where numpy has none, or an honest NaN all get their right verdict."""
    a = RNG.standard_normal((16, 4, 128, 64)).astype(dtype)
    b = RNG.standard_normal((16, 4, 64, 128)).astype(dtype)
    c = a @ b
    assert check_product(c, a, b)
    for e in (0, 37, 63):
        wrong = c.copy()
        wrong.reshape(64, 128, 128)[e, 5, 9] *= dtype(1 + 1e-3)
        assert not check_product(wrong, a, b), e
    wrong = c.copy()
    wrong[3, 2] = b[3, 2].T @ a[3, 2].T  # another entry's numbers in the right shape
    assert not check_product(wrong, a, b)
    nan = c.copy()
    nan[1, 1, 0, 0] = np.nan
    assert not check_product(nan, a, b)
    a_nan = a.copy()
    a_nan[2, 3, 7, 0] = np.nan  # NaN in an operand: numpy's row of NaNs is the honest answer
    assert check_product(a_nan @ b, a_nan, b)
    bias = RNG.standard_normal((128,)).astype(dtype)  # with an accumulator, broadcast
    assert check_product(bias + a @ b, a, b, bias)
    assert not check_product(bias + a @ b + dtype(1e-2), a, b, bias)


def test_an_honest_but_less_accurate_kernel_is_recomputed_never_rejected():
    """Rounding errors 50 times BLAS's (but within what theory allows): suspicious, then cleared by the lab."""
    a, b = _operands("normal", 600, np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    bound = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    u = np.finfo(np.float32).eps / 2
    sloppy = (exact + np.sqrt(600) * u * bound * RNG.uniform(-1, 1, exact.shape)).astype(np.float32)
    verdict = check_product(sloppy, a, b)
    assert verdict.accepted and verdict.recomputed is not None
    np.testing.assert_allclose(verdict.recomputed, exact, rtol=1e-6, atol=1e-6 * np.abs(exact).max())


def test_data_near_overflow_is_checked_not_waved_through():
    a, b = _operands("huge", 100, np.float64)
    c = a @ b
    assert check_product(c, a, b)
    assert not check_product(corrupt("element", c, {}), a, b)


def test_nan_and_inf_must_sit_exactly_where_numpy_puts_them():
    a, b = _operands("normal", 120, np.float64)
    a[3, 5], a[50, 0], b[7, 9], b[0, 100] = np.nan, np.inf, -np.inf, np.nan
    with np.errstate(invalid="ignore"):
        c = a @ b
    assert np.isnan(c).any() and np.isinf(c).any()
    assert check_product(c, a, b)
    for cheat in ("noise", "zeros", "element"):
        assert not check_product(corrupt(cheat, c, {}), a, b), cheat
    inf_at = np.argwhere(np.isinf(c))[0]
    for wrong_value in (np.nan, -c[tuple(inf_at)], 1e300):
        wrong = c.copy()
        wrong[tuple(inf_at)] = wrong_value
        assert not check_product(wrong, a, b)
    nan_at = np.argwhere(np.isnan(c))[0]
    wrong = c.copy()
    wrong[tuple(nan_at)] = np.inf
    assert not check_product(wrong, a, b)
    finite = c.copy()
    finite[~np.isfinite(finite)] = 0.0
    assert not check_product(finite, a, b)


def test_accumulating_products_batches_and_vectors():
    a, b = _operands("normal", 150, np.float32)
    c0 = RNG.standard_normal((a.shape[0], b.shape[1])).astype(np.float32) * 100
    c = get("matmul_accumulate")(c0.copy(), a, b)
    assert check_product(c, a, b, c0)
    assert not check_product(corrupt("element", c, {}), a, b, c0)
    assert not check_product(c, a, b, c0 * 0)
    batch_a, batch_b = RNG.standard_normal((3, 40, 30)), RNG.standard_normal((30, 20))
    assert check_product(batch_a @ batch_b, batch_a, batch_b)
    assert not check_product(corrupt("element", batch_a @ batch_b, {}), batch_a, batch_b)
    v = RNG.standard_normal(30)
    assert check_product(batch_a[0] @ v, batch_a[0], v) and not check_product(batch_a[0] @ v + 1e-6, batch_a[0], v)
    assert not check_product(np.zeros((40, 21)), batch_a[0], batch_b)  # wrong shape
    assert not check_product((batch_a[0] @ batch_b).astype(np.float32), batch_a[0], batch_b)  # wrong dtype


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
def test_a_linear_layers_bias_is_checked_as_one_row(dtype):
    """``bias + x @ w``, the bias broadcast over the rows (a Linear's product): the check projects the bias
    once.  Honest results pass without a recomputation, also when the bias cancels the product; a
    wrong element, a wrong bias and noise are caught."""
    x, w = RNG.standard_normal((300, 64)).astype(dtype), RNG.standard_normal((64, 90)).astype(dtype)
    bias = RNG.standard_normal(90).astype(dtype)
    c0 = np.broadcast_to(bias, (300, 90))
    assert c0.strides[0] == 0  # the form the check takes apart
    c = get("matmul_accumulate")(bias, x, w)
    assert check_product(c, x, w, bias).recomputed is None
    assert check_product(c, x, w, c0).recomputed is None
    cancel = -(x[:1] @ w)[0]  # row 0 of the result near zero: rounding there is all the bias's
    assert check_product(get("matmul_accumulate")(cancel, x, w), x, w, cancel)
    for cheat in ("noise", "element"):
        assert not check_product(corrupt(cheat, c, {}), x, w, bias), cheat
    small = c.copy()
    small[17, 3] += dtype(1e-3) * np.abs(c[17]).max()  # one entry, off by a thousandth of its row's largest
    assert not check_product(small, x, w, bias)
    assert not check_product(c, x, w, bias * dtype(1.001))  # the bias of another model


def test_integer_and_boolean_products_are_exact():
    a, b = RNG.integers(-2**20, 2**20, (80, 90)).astype(np.int32), RNG.integers(-2**20, 2**20, (90, 70)).astype(np.int32)
    with np.errstate(over="ignore"):
        c = a @ b  # wraps around modulo 2**32, as the volunteer's kernel does
    assert check_product(c, a, b)
    wrong = c.copy()
    wrong[10, 10] += 1
    assert not check_product(wrong, a, b)
    p, q = RNG.random((50, 60)) < 0.05, RNG.random((60, 40)) < 0.05
    assert check_product(p @ q, p, q)
    flipped = p @ q
    flipped[0, 0] = ~flipped[0, 0]
    assert not check_product(flipped, p, q)


def test_enough_vectors_for_the_escape_target():
    k = vectors_for()
    assert 0.08 ** k < ESCAPE_PROBABILITY <= 0.08 ** (k - 1)


@pytest.mark.parametrize("op, operands, params", [
    ("matmul", ((50, 40), (40, 30)), {}),
    ("tensordot", ((6, 5, 7), (7, 5, 4)), {"axes": ([1, 2], [1, 0])}),
    ("einsum", ((3, 20, 10), (3, 10, 8)), {"subscripts": "bij,bjk->bki"}),
])
def test_accept_returns_honest_results_and_replaces_wrong_ones(op, operands, params):
    spec = get(op)
    args = [RNG.standard_normal(s) for s in operands]
    honest = spec(*args, **params)
    want = spec.numpy(*args, **params)
    assert accept("k", honest, *args, op=spec, params=params) is honest
    for cheat in ("noise", "element"):
        replaced = accept("k", corrupt(cheat, honest, {}), *args, op=spec, params=params)
        np.testing.assert_allclose(replaced, want, rtol=1e-13, atol=1e-13)
    assert accept("k", honest[..., :-1], *args, op=spec, params=params).shape == want.shape


def test_same_result_exact_for_integers_within_rounding_for_floats():
    x = RNG.standard_normal(1000)
    assert same_result(x, x * (1 + 1e-15))
    assert not same_result(x, x * (1 + 1e-9))
    assert not same_result(x, x.astype(np.float32))
    i = np.arange(10)
    assert same_result(i, i.copy()) and not same_result(i, i + np.eye(10, dtype=int)[0])
    assert not same_result(np.array([1.0, np.nan]), np.array([1.0, np.inf]))
    assert same_result(np.array([1.0, np.nan]), np.array([1.0, np.nan]))
    # a sum of many terms: its rounding scales with the terms, not with the (cancelled) result
    terms = RNG.standard_normal((100_000, 1)) * 1e6
    s = terms.sum(axis=0)
    assert same_result(s + 1e-7, s, (terms,))  # another summation order
    assert not same_result(s + 1e-2, s, (terms,))


def test_trust_lowers_replication_and_sampling_never_to_zero():
    """Only where the lab opts in to acceptance on trust; by default trust changes nothing."""
    default = TrustPolicy(threshold=10, min_replica_rate=0.05, sample_rate=0.1, min_sample_rate=0.01)
    assert {default.replica_rate(t) for t in (0, 10, 10**6)} == {default.sampling_rate(t) for t in (0, 10**6)} == {1.0}
    policy = TrustPolicy(threshold=10, min_replica_rate=0.05, sample_rate=0.1, min_sample_rate=0.01,
                         accept_on_trust=True)
    assert [policy.replica_rate(t) for t in (0, 9)] == [1.0, 1.0]
    rates = [policy.replica_rate(t) for t in (10, 20, 100, 10_000)]
    assert rates == sorted(rates, reverse=True) and rates[0] == 1.0 and rates[-1] == 0.05
    samples = [policy.sampling_rate(t) for t in (10, 20, 1000, 10**6)]
    assert samples == sorted(samples, reverse=True) and samples[-1] == 0.01


def _random_check(seed=(3, 0)):
    from goblin_dask.validation.checks import _Check

    params = {"shape": (16, 16), "dtype": "float64", "seed": seed}
    op = get("random_standard_normal")
    return _Check(("unverified-random_standard_normal-" + "ab" * 16, 0), op, (), params, ()), op(**params)


def test_an_audit_decides_an_agreeing_pair_by_the_labs_own_recomputation():
    """Two replicas agreeing on a wrong block: without the audit both are accepted (what one person's two
    credentials get away with); with it the lab recomputes, rejects both and uses its own numbers. An honest
    agreeing pair passes the audit."""
    replica = ("unverified-random_standard_normal-" + "cd" * 16, 0)
    check, honest = _random_check()
    wrong = np.full_like(honest, 0.5)
    assert check.compare_replicas(wrong, replica, wrong.copy()) is wrong  # the hole the audit closes
    assert [v[1:3] for v in check.verdicts] == [("replica", True), ("replica", True)]
    check, honest = _random_check()
    got = check.compare_replicas(wrong, replica, wrong.copy(), audit=True)
    np.testing.assert_array_equal(got, honest)
    assert [v[1:3] for v in check.verdicts] == [("audit", False), ("audit", False)]
    assert check.verdicts[0][0] == check.raw_key and check.verdicts[1][0] == replica
    check, honest = _random_check()
    assert check.compare_replicas(honest, replica, honest.copy(), audit=True) is honest
    assert [v[1:3] for v in check.verdicts] == [("audit", True), ("audit", True)]
    check, honest = _random_check()  # a disagreement is the replica path's, audited or not
    check.compare_replicas(wrong, replica, honest.copy(), audit=True)
    assert [v[1:3] for v in check.verdicts] == [("replica", False), ("replica", True)]


def test_an_audit_of_a_stage_task_runs_the_program_on_the_lab_and_compares_with_both():
    """A ``program`` task's replica is a fingerprint for a seed the lab draws; colluders who fingerprint the
    same wrong outputs agree with each other, and the audit (the program run by the lab) rejects both."""
    from goblin_dask.ops.program import PROGRAM, _example_program, sketch
    from goblin_dask.validation.checks import _Check, _Replica

    rng = np.random.default_rng(8)
    a, b = rng.standard_normal((8, 8)), rng.standard_normal((8, 8))
    params = {"program": _example_program(8, np.dtype(np.float64))}
    honest = PROGRAM(a, b, **params)
    wrong = np.full_like(honest, 0.5)
    replica_key = ("unverified-program_sketch-" + "ef" * 16, 0)
    for first, audit, want in [(wrong, False, [("replica", True)] * 2), (wrong, True, [("audit", False)] * 2),
                               (honest, True, [("audit", True)] * 2)]:
        check = _Check(("unverified-program-" + "12" * 16, 0), PROGRAM, (a, b), params, ())
        replica = _Replica.of(check)
        fingerprint = sketch(first, params["program"], replica.params["seed"])  # the colluder's replica
        got = check.compare_replicas(first, replica_key, fingerprint, replica, audit=audit)
        assert [v[1:3] for v in check.verdicts] == want
        np.testing.assert_array_equal(got, first if want[0][1] else honest)


def test_a_forced_verification_method_outside_the_overrides_is_refused_before_dispatch():
    import dask

    src = "data-0123456789abcdef"
    dsk = {src: DataNode(src, np.ones((2, 2))),
           ("matmul-0123456789abcdef", 0): CatalogTask(("matmul-0123456789abcdef", 0), get("matmul"), TaskRef(src), TaskRef(src))}
    with dask.config.set({"goblin.verification.method": "trust-me"}):
        with pytest.raises(ValueError, match="goblin.verification.method = 'trust-me'"):
            insert_checks(dsk, list(dsk))
    with dask.config.set({"goblin.verification.method": "replica"}):
        assert insert_checks(dsk, list(dsk))[("matmul-0123456789abcdef", 0)].kwargs["method"] == "replica"


def test_insert_checks_puts_volunteer_tasks_under_unverified_keys():
    src = ("source-0123456789abcdef", 0)
    dsk = {src: DataNode(src, np.ones((4, 4))),
           ("matmul-0123456789abcdef", 0): CatalogTask(("matmul-0123456789abcdef", 0), get("matmul"), TaskRef(src), TaskRef(src)),
           ("add-0123456789abcdef", 0): CatalogTask(("add-0123456789abcdef", 0), get("add"), TaskRef(src), 1, placement="lab")}
    out = insert_checks(dsk, list(dsk))
    raw = ("unverified-matmul-0123456789abcdef", 0)
    assert is_unverified_key(raw) and isinstance(out[raw], CatalogTask)
    check = out[("matmul-0123456789abcdef", 0)]
    assert isinstance(check, Task) and check.func is accept and raw in check.dependencies
    assert check.kwargs["method"] is None and check.kwargs["refs"] == (src, src)  # None: the op's own verification
    assert out[("add-0123456789abcdef", 0)] is dsk[("add-0123456789abcdef", 0)]  # on the lab: nothing to check
    assert check({raw: np.full((4, 4), 4.0), src: np.ones((4, 4))}).sum() == 64


@pytest.mark.parametrize("dtype", [np.float32, np.complex64], ids=lambda d: np.dtype(d).name)
def test_low_precision_checks_convert_by_blocks_of_rows(monkeypatch, dtype):
    """The float64 work copies are made a few rows at a time; the verdicts are those of the whole-copy check."""
    from goblin_dask.validation import freivalds

    monkeypatch.setattr(freivalds, "_CHUNK_BYTES", 5 * 8 * 130)  # 5 rows of a 130-wide float64 block: many chunks
    a, b = _operands("normal", 127, dtype)
    if np.dtype(dtype).kind == "c":
        a = a + 1j * _operands("normal", 127, dtype)[0]
    c0 = (RNG.standard_normal((a.shape[0], b.shape[1])) * 10).astype(dtype)
    c = get("matmul_accumulate")(c0.copy(), a, b)
    assert freivalds._rows_per_chunk(a, np.dtype(np.complex128 if np.dtype(dtype).kind == "c" else np.float64)) <= 5
    assert check_product(a @ b, a, b).recomputed is None
    assert check_product(c, a, b, c0).recomputed is None
    for cheat in ("noise", "element"):
        assert not check_product(corrupt(cheat, a @ b, {}), a, b)
        assert not check_product(corrupt(cheat, c, {}), a, b, c0)


# -- float64: systematic errors far beyond rounding, and signed zeros (issue 29, items 5 and 10) -------


def _hm_bound(a, b):
    """Higham & Mary's entry-wise probabilistic bound for the float64 product (lambda = 8)."""
    return 8.0 * np.sqrt(a.shape[1]) * np.finfo(np.float64).eps / 2 * (np.abs(a) @ np.abs(b))


def _float64_attacks(a, b):
    c = a @ b
    bound = _hm_bound(a, b)
    yield "every entry biased by 16x the bound", c + 16 * bound
    one = c.copy()
    one[RNG.integers(c.shape[0]), RNG.integers(c.shape[1])] += 500 * bound.max()
    yield "one entry off by 500x the bound", one
    x, y = RNG.standard_normal(c.shape[0]), RNG.standard_normal(c.shape[1])
    rank1 = np.outer(x, y)
    rank1 *= 4 * np.median(bound / np.abs(rank1))  # half the entries beyond 4x the bound
    assert (np.abs(rank1) > bound).mean() > 2 / 3
    yield "a rank-1 perturbation, 2/3 of its entries beyond the bound", c + rank1


@pytest.mark.parametrize("kind", ["normal", "positive", "offset"])
def test_float64_systematic_errors_beyond_rounding_are_rejected(kind):
    a, b = _operands(kind, 512, np.float64)
    for trial in range(3):
        for name, wrong in _float64_attacks(a, b):
            verdict = check_product(wrong, a, b)
            assert not verdict.accepted, (kind, name, trial)
            np.testing.assert_allclose(verdict.recomputed, a @ b, rtol=1e-12, atol=1e-12 * np.abs(a @ b).max())
    # with an accumulator (a linear layer's bias) and in a stack (bmm): the same
    c0 = RNG.standard_normal((1, b.shape[1]))
    for name, wrong in _float64_attacks(a, b):
        assert not check_product(wrong + c0, a, b, c0), name
    stack_a, stack_b = np.stack([a[:128, :128]] * 3), np.stack([b[:128, :128]] * 3)
    good = stack_a @ stack_b
    for name, wrong in _float64_attacks(a[:128, :128], b[:128, :128]):
        bad = good.copy()
        bad[1] = wrong
        assert not check_product(bad, stack_a, stack_b), name


def _blocked(a, b, block):
    out = np.zeros((a.shape[0], b.shape[1]))
    for lo in range(0, a.shape[1], block):
        out += a[:, lo:lo + block] @ b[lo:lo + block]
    return out


HONEST_FLOAT64 = {
    "matmul": lambda a, b: a @ b,
    "einsum (numpy's own loop)": lambda a, b: np.einsum("ij,jk->ik", a, b, optimize=False),
    "blocks of 7 summed": lambda a, b: _blocked(a, b, 7),
    "blocks of 128 summed": lambda a, b: _blocked(a, b, 128),
    "row by row (dot products)": lambda a, b: np.stack([row @ b for row in a]),
    "transposed": lambda a, b: (b.T @ a.T).T.copy(),
}


@pytest.mark.parametrize("kind", ["normal", "positive", "offset", "scaled"])
@pytest.mark.parametrize("threads", [1, 2])
def test_float64_honest_results_computed_every_way_are_accepted_without_recomputation(kind, threads):
    pytest.importorskip("threadpoolctl")
    from threadpoolctl import threadpool_limits

    a, b = _operands(kind, 300, np.float64)
    with threadpool_limits(limits=threads):
        results = {name: kernel(a, b) for name, kernel in HONEST_FLOAT64.items()}
    for name, c in results.items():
        for _ in range(3):
            verdict = check_product(c, a, b)
            assert verdict.accepted and verdict.recomputed is None, (name, kind, threads)
    # a thin inner dimension, and a long one
    for shape in (((257, 3), (3, 301)), ((40, 5000), (5000, 33))):
        x, y = RNG.standard_normal(shape[0]), RNG.standard_normal(shape[1])
        for name, kernel in HONEST_FLOAT64.items():
            assert check_product(kernel(x, y), x, y).recomputed is None, (name, shape)


def test_a_signed_subnormal_where_the_product_is_exactly_zero_is_rejected():
    a, b = _operands("normal", 200, np.float64)
    a[::3] = 0.0  # rows of zeros (padding, a layer's dead units)
    b[:, ::5] = 0.0
    c = a @ b
    assert check_product(c, a, b).recomputed is None
    assert check_product(-0.0 * (c == 0) + c, a, b)  # -0.0: an honest kernel may give either zero
    for tiny in (-5e-324, 5e-324, -1e-310):
        wrong = c.copy()
        wrong[c == 0] = tiny
        verdict = check_product(wrong, a, b)
        assert not verdict.accepted, tiny
        assert not np.isnan(np.sqrt(verdict.recomputed[c == 0])).any()
        one = c.copy()
        one[3, 7] = tiny  # a single one, in a zero row
        assert not check_product(one, a, b), tiny
    c0 = RNG.standard_normal((1, b.shape[1]))
    assert check_product(c + c0, a, b, c0)
    wrong = c + c0
    wrong[0] = np.nextafter(wrong[0], np.inf)  # one ulp off where the product adds exactly 0 to c0
    assert not check_product(wrong, a, b, c0)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_zero_lines_found_from_the_norms_tell_tiny_lines_from_zero_ones(dtype):
    """The check finds all-zero rows of A and columns of B from the squared norms it computes anyway; a
    line whose squares underflow to 0 without being zeros is not taken for one (its product need not
    be exactly 0), and a wrong number where the product is exactly 0 is still rejected."""
    a, b = _operands("normal", 120, dtype)
    tiny = np.finfo(dtype).tiny * 4 if dtype == np.float32 else 1e-170  # squares: 0 in float64 for 1e-170
    a[::4] = 0.0
    a[1] = tiny  # not a zero row: sum of squares underflows in float64 (for float64), tiny but exact otherwise
    b[:, ::7] = 0.0
    want = a.astype(np.float64) @ b.astype(np.float64)
    c = (a @ b).astype(dtype)
    verdict = check_product(c, a, b)
    assert want[1].any() and verdict.accepted
    if dtype == np.float32:  # the tight test accepts (float64: a row of norm 0 in float64 is left to the lab)
        assert verdict.recomputed is None
    wrong = c.copy()
    wrong[0, 3] = np.finfo(dtype).smallest_subnormal  # row 0 of A is zeros: the product is exactly 0 there
    assert not check_product(wrong, a, b)
    wrong = c.copy()
    wrong[5, 7] = -np.finfo(dtype).smallest_subnormal  # column 7 of B is zeros
    assert not check_product(wrong, a, b)
    bias = RNG.standard_normal((1, b.shape[1])).astype(dtype)
    c0 = np.broadcast_to(bias, c.shape)  # a bias row broadcast down the rows: finiteness looked at once
    assert check_product((c + c0).astype(dtype), a, b, c0)
    bad = bias.copy()
    bad[0, 2] = np.inf
    got = (a @ b + bad).astype(dtype)
    assert check_product(got, a, b, np.broadcast_to(bad, c.shape))  # inf where numpy puts it
    got[4, 2] = 0.0
    assert not check_product(got, a, b, np.broadcast_to(bad, c.shape))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_pointwise_result_is_compared_element_by_element_not_against_the_blocks_largest(dtype):
    """How far the generic replica rule lets a wide-range result's small entries move: 64 eps of the block's
    largest magnitude (for ``exp`` over [-40, 5] in float32, 1.1e-3 beside entries of 4e-18).  Ops that every
    honest kernel computes to a few ulps of each element are compared element by element: a tiny entry made
    negative or 1000x larger is refused; another libm's rounding (8 ulps), a flushed subnormal, are accepted."""
    from goblin_dask.ops import get as op

    exp = op("exp")
    x = np.linspace(-40, 5, 4096).astype(dtype)
    want = exp(x)
    band = 64 * np.finfo(dtype).eps * float(want.max())
    small = want < band / 1e3
    assert small.sum() > 500  # entries the block rule cannot tell from zero
    for wrong in (np.where(small, -want, want), np.where(small, want * 1000, want)):
        assert same_result(wrong, want, (x,))  # the generic rule: inside its band
        assert not exp.compare(wrong, want, (x,), {})
    honest = want.copy()
    for _ in range(8):
        honest = np.nextafter(honest, np.inf).astype(dtype)
    assert exp.compare(honest, want, (x,), {})
    rounded = np.exp(x.astype(np.float64)).astype(dtype)  # a correctly rounded kernel
    assert exp.compare(rounded, want, (x,), {}) and exp.compare(want, rounded, (x,), {})
    flushed = np.where(want < np.finfo(dtype).tiny, 0, want).astype(dtype)
    assert exp.compare(flushed, want, (x,), {})
    assert op("sin").compare is None  # trigonometry keeps the block rule (kernels differ near its zeros)
