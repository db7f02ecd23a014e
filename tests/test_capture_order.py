"""Captured order statistics (torch.sort, argsort, topk, median, nanmedian, kthvalue, quantile, nanquantile)
against torch itself.

What is promised, and so asserted: values are torch's exactly (NaN where torch has NaN); indices are the
*stable* order (equal values in ascending index order, NaN largest), which is torch's own wherever torch
defines them: ``sort``/``argsort`` with ``stable=True``, a median over a slice holding a NaN (the first NaN),
and any slice without ties.  Where torch leaves the tie order unspecified (a non-stable sort, ``topk``,
``median``, ``kthvalue``) the indices are still the stable order's and always point at the values given.
torch's median is the lower of the two middle values (numpy's averages them): inputs of even length check it.
torch's quantile with interpolation='linear' is within one rounding of torch's (its lerp is a fused multiply-add).
"""

from __future__ import annotations

import dask
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import goblin_dask  # noqa: E402
import goblin_dask.array as ga  # noqa: E402
from goblin_dask.torch_capture import UnsupportedOperator  # noqa: E402
from goblin_dask.torch_capture.aten import TABLE  # noqa: E402

DTYPES = [np.float32, np.float64]


def awkward(shape, dtype, seed=0):
    """Ties (values on a grid of halves), NaNs, an infinity, and +0.0 beside -0.0."""
    rng = np.random.default_rng(seed)
    a = np.round(rng.standard_normal(shape) * 2) / 2
    a[rng.random(shape) < 0.12] = np.nan
    flat = a.reshape(-1)
    flat[1], flat[2], flat[3] = np.inf, 0.0, -0.0
    return a.astype(dtype)


def distinct(shape, dtype, seed=0):
    """No ties, no NaN: every index torch gives is defined."""
    return np.random.default_rng(seed).permutation(np.prod(shape)).reshape(shape).astype(dtype) - 7.5


def row(target, x, *args, chunks=None, **kwargs):
    """The capture table's row for ``target`` on ``x`` (a ga array of ``chunks``), computed."""
    out = TABLE[target].fn(ga, ga.from_array(x, chunks=chunks or x.shape), *args, **kwargs)
    return tuple(o.compute(scheduler="sync") for o in out) if isinstance(out, tuple) else out.compute(scheduler="sync")


def bits(a):
    """The exact bits of ``a`` (so -0.0 differs from 0.0 and NaN equals itself)."""
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "f" else a


def same_values(got, want):
    """torch's values: shape, dtype and numbers (0.0 and -0.0 equal, NaN where torch has NaN)."""
    want = want.numpy()
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    np.testing.assert_array_equal(got, want)


def indexes_values(x, axis, indices, values):
    """``indices`` point at ``values``, bit for bit, along ``axis``."""
    assert indices.dtype == np.int64
    np.testing.assert_array_equal(bits(np.take_along_axis(x, indices, axis)), bits(values))


def unique_along(x, axis):
    """Slices along ``axis`` whose values are all distinct (where any index torch gives is defined)."""
    s = np.sort(x, axis=axis)
    return ~np.any(np.diff(s, axis=axis) == 0, axis=axis)


SHAPES_DIMS = [((5, 8), 1), ((5, 8), 0), ((5, 8), -1), ((5, 8), -2), ((3, 4, 6), 1), ((3, 4, 6), -1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape, dim", SHAPES_DIMS, ids=str)
@pytest.mark.parametrize("descending", [False, True])
def test_sort_and_argsort_are_torchs_stable_sort(dtype, shape, dim, descending):
    x = awkward(shape, dtype, seed=len(shape) + dim)
    want = torch.sort(torch.from_numpy(x), dim=dim, descending=descending, stable=True)
    for chunks in (None, (2,) * len(shape)):
        for target, kw in (("aten.sort.stable", {"stable": True}), ("aten.sort.default", {})):
            values, indices = row(target, x, dim=dim, descending=descending, chunks=chunks, **kw)
            np.testing.assert_array_equal(bits(values), bits(want.values.numpy()))  # bit for bit: -0.0 stays -0.0
            np.testing.assert_array_equal(indices, want.indices.numpy())
            assert indices.dtype == np.int64
        # torch's non-stable sort: the same values; its tie order is its own, ours the stable one
        same_values(values, torch.sort(torch.from_numpy(x), dim=dim, descending=descending).values)
        for target, kw in (("aten.argsort.stable", {"stable": True}), ("aten.argsort.default", {})):
            np.testing.assert_array_equal(row(target, x, dim=dim, descending=descending, chunks=chunks, **kw),
                                          torch.argsort(torch.from_numpy(x), dim=dim, descending=descending,
                                                        stable=True).numpy())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape, dim", SHAPES_DIMS, ids=str)
@pytest.mark.parametrize("largest", [True, False])
def test_topk_gives_torchs_values_in_the_stable_order(dtype, shape, dim, largest):
    x = awkward(shape, dtype, seed=3 + dim)
    tx = torch.from_numpy(x)
    n = x.shape[dim]
    for k in (1, 3, n):
        want = torch.topk(tx, k, dim=dim, largest=largest)
        stable = torch.sort(tx, dim=dim, descending=largest, stable=True)
        for sorted_ in (True, False):
            values, indices = row("aten.topk.default", x, k, dim, largest, sorted_, chunks=(2,) * len(shape))
            same_values(values, want.values)
            np.testing.assert_array_equal(indices, stable.indices.narrow(dim, 0, k).numpy())
            indexes_values(x, dim, indices, values)
        distinct_x = distinct(shape, dtype, seed=k)
        d_want = torch.topk(torch.from_numpy(distinct_x), k, dim=dim, largest=largest)
        np.testing.assert_array_equal(row("aten.topk.default", distinct_x, k, dim, largest)[1], d_want.indices.numpy())
    values, indices = row("aten.topk.default", x, 0, dim)  # torch: empty results
    assert values.shape == indices.shape == tuple(0 if d == dim % x.ndim else s for d, s in enumerate(x.shape))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("length", [7, 8])  # odd, and even: the lower middle value, not the mean
@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_median_and_nanmedian_are_torchs_lower_median_with_its_nan_rules(dtype, length, keepdim, dim):
    x = awkward((6, length), dtype, seed=length)
    x[4, :] = np.nan if dim in (1, -1) else x[4, :]  # an all-NaN slice
    x[:, 2] = np.nan if dim == 0 else x[:, 2]
    x[5, 3] = np.nan  # a slice with one NaN
    tx = torch.from_numpy(x)
    axis = dim % x.ndim
    for target, fn in (("aten.median.dim", torch.median), ("aten.nanmedian.dim", torch.nanmedian)):
        want = fn(tx, dim=dim, keepdim=keepdim)
        values, indices = row(target, x, dim, keepdim, chunks=(4, 3))
        same_values(values, want.values)
        assert indices.dtype == np.int64 and indices.shape == tuple(want.indices.shape)
        held = indices if keepdim else np.expand_dims(indices, axis)
        np.testing.assert_array_equal(np.take_along_axis(x, held, axis), values if keepdim else
                                      np.expand_dims(values, axis))  # NaN at a NaN
        defined = unique_along(np.where(np.isnan(x), np.arange(x.size).reshape(x.shape) + 1e6, x), axis)
        if target == "aten.median.dim":  # torch: a slice holding a NaN gives its first NaN
            defined |= np.any(np.isnan(x), axis=axis)
        else:  # torch: an all-NaN slice's index is whichever NaN its selection left first
            defined &= ~np.all(np.isnan(x), axis=axis)
        want_i = want.indices.numpy()
        flat = lambda a: a if not keepdim else np.squeeze(a, axis)  # noqa: E731
        np.testing.assert_array_equal(flat(indices)[defined], flat(want_i)[defined])
    for target, fn in (("aten.median.default", torch.median), ("aten.nanmedian.default", torch.nanmedian)):
        same_values(row(target, x, chunks=(4, 3)), fn(tx))
        clean = x[[0, 1, 2, 3]][:, [0, 1, 3, 4, 5]]
        same_values(row(target, np.ascontiguousarray(clean)), fn(torch.from_numpy(np.ascontiguousarray(clean))))


def test_median_of_an_even_count_is_the_lower_middle_not_the_mean():
    x = np.array([[4.0, 1.0, 3.0, 2.0], [1.0, 1.0, 2.0, 2.0]])
    assert row("aten.median.default", x) == 2.0 == torch.median(torch.from_numpy(x)).item()
    values, indices = row("aten.median.dim", x, 1)
    np.testing.assert_array_equal(values, [2.0, 1.0])
    np.testing.assert_array_equal(values, torch.median(torch.from_numpy(x), dim=1).values.numpy())
    np.testing.assert_array_equal(indices[:1], [3])


@pytest.mark.parametrize("dtype", DTYPES + [np.int64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_kthvalue_is_torchs(dtype, dim):
    x = awkward((5, 6), np.float64, seed=dim + 9)
    x = np.nan_to_num(x, posinf=9).astype(dtype) if dtype == np.int64 else x.astype(dtype)
    tx = torch.from_numpy(x)
    for k in (1, 2, x.shape[dim]):
        for keepdim in (False, True):
            want = torch.kthvalue(tx, k, dim=dim, keepdim=keepdim)
            values, indices = row("aten.kthvalue.default", x, k, dim, keepdim, chunks=(2, 4))
            same_values(values, want.values)
            held = indices if keepdim else np.expand_dims(indices, dim % 2)
            np.testing.assert_array_equal(np.take_along_axis(x, held, dim % 2), values if keepdim else
                                          np.expand_dims(values, dim % 2))
    d = distinct((5, 6), dtype)
    np.testing.assert_array_equal(row("aten.kthvalue.default", d, 3, dim)[1],
                                  torch.kthvalue(torch.from_numpy(d), 3, dim=dim).indices.numpy())


def test_integer_data_sorts_and_medians_as_torch():
    x = np.random.default_rng(4).integers(-5, 5, (6, 9)).astype(np.int64)
    tx = torch.from_numpy(x)
    for descending in (False, True):
        want = torch.sort(tx, dim=1, descending=descending, stable=True)
        values, indices = row("aten.sort.stable", x, dim=1, descending=descending, stable=True)
        np.testing.assert_array_equal(values, want.values.numpy())
        np.testing.assert_array_equal(indices, want.indices.numpy())
    same_values(row("aten.median.default", x), torch.median(tx))
    values, indices = row("aten.median.dim", x, 0)
    same_values(values, torch.median(tx, dim=0).values)
    indexes_values(x, 0, indices[None], values[None])


def test_a_0d_tensor_orders_as_one_element():
    x = np.array(2.5, dtype=np.float32)
    tx = torch.from_numpy(x)
    for target, args, want in (("aten.sort.default", (), torch.sort(tx)), ("aten.topk.default", (1,), torch.topk(tx, 1)),
                               ("aten.median.dim", (0,), torch.median(tx, 0)),
                               ("aten.nanmedian.dim", (-1,), torch.nanmedian(tx, -1)),
                               ("aten.kthvalue.default", (1,), torch.kthvalue(tx, 1))):
        values, indices = row(target, x, *args)
        same_values(values, want.values)
        same_values(indices, want.indices)


INTERPOLATIONS = ["linear", "lower", "higher", "midpoint", "nearest"]


def same_quantiles(got, want, x, interpolation):
    """torch's quantiles: shape, dtype, NaN and infinities exactly; the numbers exactly too, except 'linear' within
    one rounding of ``x``'s largest finite magnitude (torch's lerp is a fused multiply-add, NumPy's two steps)."""
    want = want.numpy()
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    if interpolation != "linear":
        np.testing.assert_array_equal(got, want)
        return
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isfinite(want)], want[~np.isfinite(want)])
    finite = np.isfinite(want)
    ulp = np.spacing(np.max(np.abs(x[np.isfinite(x)])))
    assert np.all(np.abs(got[finite] - want[finite]) <= ulp), np.max(np.abs(got[finite] - want[finite])) / ulp


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("dim", [None, 0, 1, -1])
@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
def test_quantile_and_nanquantile_are_torchs(dtype, dim, keepdim, interpolation):
    """torch.quantile (NaN where a slice holds one) and torch.nanquantile (of the values that are not NaN; NaN for an
    all-NaN slice), q a number or a tensor (its axis first), over data with ties, NaN, an infinity and signed zeros,
    and over distinct random values (where 'linear' interpolates in earnest)."""
    awk = awkward((6, 7), dtype, seed=11)
    awk[4, :] = np.nan  # an all-NaN row
    awk[:, 5] = np.nan  # an all-NaN column
    rand = np.random.default_rng(12).standard_normal((6, 7)).astype(dtype) * 3
    rand[2, 3] = np.nan
    for x in (awk, rand):
        tx = torch.from_numpy(x)
        for q in (0.3, 0.5, np.array([0.0, 0.1, 0.25, 0.5, 0.9, 1.0], dtype)):
            tq = torch.from_numpy(q) if isinstance(q, np.ndarray) else q
            for target, fn in (("aten.quantile", torch.quantile), ("aten.nanquantile", torch.nanquantile)):
                want = fn(tx, tq, dim=dim, keepdim=keepdim, interpolation=interpolation)
                overload = ".default" if isinstance(q, np.ndarray) else ".scalar"
                got = row(target + overload, x, q, dim, keepdim, interpolation=interpolation, chunks=(4, 3))
                same_quantiles(got, want, x, interpolation)


def test_quantile_refuses_what_it_cannot_give_with_what_to_do():
    x = np.arange(12.0).reshape(3, 4)
    with pytest.raises(NotImplementedError, match="torch's are linear, lower, higher, midpoint, nearest"):
        row("aten.quantile.scalar", x, 0.5, 1, interpolation="cubic")

    class ComputedLevels(nn.Module):
        def forward(self, x):
            return torch.quantile(x, torch.sigmoid(x[0, :2]), dim=1)

    with pytest.raises(UnsupportedOperator, match="q computed by the model: give q as a number or a "
                                                  "tensor the model holds"):
        goblin_dask.capture(ComputedLevels(), (torch.randn(4, 6),))


class Quantiles(nn.Module):
    """torch.quantile and nanquantile in the forms a model writes them: q a float or a buffer, each interpolation,
    per row (any batch size) or over the batch and the whole tensor (torch fixes the batch size then)."""

    def __init__(self, dtype, whole: bool):
        super().__init__()
        self.whole = whole
        self.register_buffer("levels", torch.tensor([0.1, 0.5, 0.9], dtype=dtype))

    def forward(self, x):
        if self.whole:
            return torch.quantile(x, self.levels, dim=0, keepdim=True), torch.quantile(x, 0.75), \
                torch.nanquantile(x, 0.4, 0, interpolation="nearest")
        return (torch.quantile(x, 0.3, dim=1), torch.nanquantile(x, 0.5, dim=-1, interpolation="midpoint"),
                x.quantile(0.6, dim=1, interpolation="nearest"), x.nanquantile(self.levels, 1, interpolation="lower"),
                torch.quantile(x, 0.2, 1, True, interpolation="higher"), torch.quantile(x, self.levels, -1))


INTERPOLATIONS_OF = {False: ["linear", "midpoint", "nearest", "lower", "higher", "linear"],
                     True: ["linear", "linear", "nearest"]}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("whole", [False, True], ids=["per-row", "whole"])
def test_a_captured_model_of_quantiles_matches_torch_without_a_sort(dtype, whole):
    """Kept whole at export (decomposed, torch's quantile is a sort, which only the lab may run): the catalog's
    quantile, a Replica op volunteers may compute."""
    model = Quantiles(torch.float32 if dtype == np.float32 else torch.float64, whole).eval()
    g = goblin_dask.capture(model, (torch.from_numpy(awkward((4, 6), dtype)),))
    assert "quantile" in g.ops and not {"sort", "argsort", "topk", "argtopk"} & set(g.ops), g.ops
    for batch in (4,) if whole else (4, 5, 9):
        for x in (awkward((batch, 6), dtype, seed=batch),
                  np.random.default_rng(batch).standard_normal((batch, 6)).astype(dtype)):
            got = [o.compute(scheduler="threads") for o in g(x)]
            with torch.no_grad():
                want = model(torch.from_numpy(x))
            assert len(got) == len(want) == len(INTERPOLATIONS_OF[whole])
            for gv, wv, interpolation in zip(got, want, INTERPOLATIONS_OF[whole]):
                same_quantiles(gv, wv, x, interpolation)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter_src_is_torchs_for_the_indices_order_statistics_write(dim):
    """The backward of sort/topk/median/kthvalue: ``x.scatter(dim, index, src)`` with distinct indices per slice,
    as many as the axis holds (sort) or fewer (topk, median)."""
    rng = np.random.default_rng(dim + 5)
    x = rng.standard_normal((4, 5, 6))
    n = x.shape[dim]
    for m in (n, 2, 1):
        index = np.argsort(rng.random(x.shape), axis=dim, kind="stable").take(np.arange(m), axis=dim)
        src = rng.standard_normal(index.shape)
        src.reshape(-1)[::7] = -0.0
        want = torch.from_numpy(x).scatter(dim, torch.from_numpy(index), torch.from_numpy(src))
        got = TABLE["aten.scatter.src"].fn(ga, ga.from_array(x, chunks=(2, 3, 4)), dim, ga.from_array(index),
                                           ga.from_array(src)).compute(scheduler="sync")
        np.testing.assert_array_equal(bits(got), bits(want.numpy()))  # -0.0 written stays -0.0
    twice = np.zeros((2, 3), np.int64)  # every index 0: torch writes one of the values there, unspecified which
    src = np.array([[-0.0, 5.0, 1.0], [2.0, np.nan, 3.0]])
    got = TABLE["aten.scatter.src"].fn(ga, ga.from_array(np.ones((2, 3))), 1, ga.from_array(twice),
                                       ga.from_array(src)).compute(scheduler="sync")
    assert got[0, 0] in src[0] and np.isnan(got[1, 0]) and np.array_equal(got[:, 1:], np.ones((2, 2)))


# -- captured models: the export path (which overloads torch writes, its argument forms) -------------------------

class Orders(nn.Module):
    """Every order operator, with torch's positional, keyword and default argument forms."""

    def forward(self, x):
        s = torch.sort(x, dim=-1, descending=True, stable=True)
        a = torch.sort(x, 0)
        t = torch.topk(x, 3)
        b = torch.topk(x, 2, dim=0, largest=False)
        m = torch.median(x, dim=-1, keepdim=True)
        k = torch.kthvalue(x, 2, 1)
        n = torch.nanmedian(x, 0)
        return (s.values, s.indices, a.values, t.values, t.indices, b.values, torch.median(x), m.values, m.indices,
                k.values, n.values, torch.argsort(x, dim=1, descending=True, stable=True), torch.msort(x),
                torch.nanmedian(x))


@pytest.fixture(scope="module", params=DTYPES, ids=lambda d: np.dtype(d).name)
def orders(request):
    dtype = request.param
    model = Orders().eval()
    return model, dtype, goblin_dask.capture(model, (torch.from_numpy(awkward((4, 6), dtype)),))


@pytest.mark.parametrize("batch", [4, 5, 2])
def test_a_captured_model_of_order_operators_matches_torch(orders, batch):
    model, dtype, g = orders
    assert {"sort", "argsort", "topk", "argtopk", "quantile"} <= set(g.ops)
    x = awkward((batch, 6), dtype, seed=batch)
    got = [o.compute(scheduler="threads") for o in g(x)]
    with torch.no_grad():
        want = model(torch.from_numpy(x))
    stable_indices = {1: torch.sort(torch.from_numpy(x), dim=-1, descending=True, stable=True).indices,
                      11: torch.argsort(torch.from_numpy(x), dim=1, descending=True, stable=True)}
    for i, (gv, wv) in enumerate(zip(got, want)):
        if wv.dtype == torch.int64:  # indices: torch's where stable=True; else they point at torch's values
            if i in stable_indices:
                np.testing.assert_array_equal(gv, stable_indices[i].numpy())
            continue
        same_values(gv, wv)
    indexes_values(x, 1, got[4], got[3])  # topk's indices point at its values
    indexes_values(x, 1, got[8], got[7])  # median's (keepdim=True)


# -- on a real grid ---------------------------------------------------------------------------------------------

class Ranker(nn.Module):
    """Scores from a linear layer, then their order statistics: the top 3 per row, the median, a stable ranking, a
    quartile.
    Integer weights and inputs make every score exact in float32 (and full of ties), so the grid's scores are
    torch's bit for bit and so is every order statistic of them."""

    def __init__(self):
        super().__init__()
        self.score = nn.Linear(16, 12)
        with torch.no_grad():
            self.score.weight.copy_(torch.randint(-3, 4, (12, 16)))
            self.score.bias.copy_(torch.randint(-3, 4, (12,)))

    def forward(self, x):
        s = self.score(x)
        top = torch.topk(s, 3, dim=1)
        m = torch.median(s, dim=1)
        return top.values, m.values, m.indices, torch.sort(s, dim=1, descending=True, stable=True).indices, \
            torch.median(s), torch.quantile(s, 0.25, dim=1)


@pytest.mark.parametrize("stage_tasks", [True, False], ids=["stage-tasks", "op-by-op"])
def test_a_captured_ranking_model_on_the_grid_gives_torchs_order_and_is_verified(lab, stage_tasks):
    """As stage tasks, the whole pass (product and order statistics) is a volunteer's program, replicated; op by
    op, the product goes to volunteers (Freivalds), the median's quantile too (replicated), and sort/topk, which
    only an exact recomputation checks, stay at the lab."""
    from goblin_dask.ops import CatalogTask

    torch.manual_seed(7)
    model = Ranker().eval()
    x = np.random.default_rng(7).integers(-4, 5, (40, 16)).astype(np.float32)
    g = goblin_dask.capture(model, (torch.from_numpy(x[:8]),))
    with dask.config.set({"goblin.placement.min-flops": 0, "goblin.placement.min-intensity": 0,
                          "goblin.placement.min-product-intensity": 0, "goblin.stage.tasks": stage_tasks}):
        before = lab.report()
        outs = g(x)
        placed = {(t.op.name, t.placement) for o in outs for t in dict(o.__dask_graph__()).values()
                  if isinstance(t, CatalogTask)}
        got = [o.compute() for o in outs]
    after = lab.report()
    if stage_tasks:
        assert ("program", "volunteer") in placed
        assert after["by_method"].get("replica", 0) > before["by_method"].get("replica", 0)
    else:
        assert {("topk", "lab"), ("argtopk", "lab"), ("argsort", "lab"), ("quantile", "volunteer")} <= placed
        assert any(op.startswith("matmul") and where == "volunteer" for op, where in placed)
        for method in ("freivalds", "replica"):  # the product, and the median (quantile) a second volunteer redoes
            assert after["by_method"].get(method, 0) > before["by_method"].get(method, 0)
    with torch.no_grad():
        want = model(torch.from_numpy(x))
        scores = model.score(torch.from_numpy(x))
    assert len(np.unique(scores.numpy())) < scores.numel() // 4  # ties, many
    for i in (0, 1, 4, 5):  # integer scores: quantile's interpolation is exact, so torch's numbers bit for bit
        same_values(got[i], want[i])
    np.testing.assert_array_equal(got[3], want[3].numpy())  # stable=True: torch's indices exactly
    indexes_values(scores.numpy(), 1, got[2][:, None], got[1][:, None])  # median's indices point at its values
    assert after["rejected"] == before["rejected"]
    assert sum(v["accepted"] for v in after["volunteers"].values()) > sum(
        v["accepted"] for v in before["volunteers"].values())
