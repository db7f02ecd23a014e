"""Order statistics on ga.Array (median, quantile, percentile and their nan forms, sort, argsort, topk), against NumPy
float64 and xarray-on-NumPy: NaN rows, all-NaN rows, ties, empty axes, odd chunkings, and on a real grid."""

from __future__ import annotations

import warnings

import dask
import numpy as np
import pytest

import goblin_dask.array as ga
from goblin_dask.ops import CatalogTask, Exact, Replica, get
from goblin_dask.validation.checks import judge

RNG = np.random.default_rng(20261205)
swv = np.lib.stride_tricks.sliding_window_view


def values(x):
    return np.asarray(x.compute(scheduler="sync"))


def numpy_quietly(fn, *args, **kwargs):
    """NumPy's reference, without its all-NaN / empty-slice RuntimeWarnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.asarray(fn(*args, **kwargs))


def catalog_tasks(x):
    return [t for t in dict(x.__dask_graph__()).values() if isinstance(t, CatalogTask)]


def awkward(shape=(17, 11)):
    """NaN scattered, one all-NaN row and one all-NaN column, ties (a rounded column), an infinity."""
    a = RNG.standard_normal(shape)
    a[RNG.random(shape) < 0.1] = np.nan
    a[3, :] = np.nan
    a[:, 5] = np.nan
    a[:, 2] = np.round(a[:, 2])
    a[7, 7] = np.inf
    return a


CHUNKINGS = [(17, 11), (4, 3), (1, 11), (5, (2, 9)), ((16, 1), 1)]


@pytest.mark.parametrize("chunks", CHUNKINGS, ids=str)
@pytest.mark.parametrize("axis", [None, 0, 1, -1, (0, 1)], ids=str)
@pytest.mark.parametrize("keepdims", [False, True])
def test_median_and_nanmedian_give_numpys_numbers_across_chunks(chunks, axis, keepdims):
    a = awkward()
    x = ga.from_array(a, chunks=chunks)
    for fn in (np.median, np.nanmedian):
        got = values(fn(x, axis=axis, keepdims=keepdims))
        want = numpy_quietly(fn, a, axis=axis, keepdims=keepdims)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)  # the same NumPy call on the same slices: bit for bit


@pytest.mark.parametrize("chunks", CHUNKINGS, ids=str)
@pytest.mark.parametrize("q", [0.5, 0.0, [0.1, 0.5, 0.9, 1.0]], ids=str)
@pytest.mark.parametrize("axis", [None, 0, (1,), (0, 1)], ids=str)
def test_quantile_and_percentile_and_their_nan_forms_give_numpys_numbers(chunks, q, axis):
    a = awkward()
    x = ga.from_array(a, chunks=chunks)
    for fn, levels in ((np.quantile, q), (np.nanquantile, q), (np.percentile, np.multiply(q, 100)),
                       (np.nanpercentile, np.multiply(q, 100))):
        for method, keepdims in (("linear", False), ("nearest", True), ("hazen", False)):
            got = values(fn(x, levels, axis=axis, method=method, keepdims=keepdims))
            want = numpy_quietly(fn, a, levels, axis=axis, method=method, keepdims=keepdims)
            assert got.dtype == want.dtype and got.shape == want.shape, (fn, method)
            np.testing.assert_array_equal(got, want)


def test_ga_functions_match_numpy_and_keep_numpys_dtypes():
    i = RNG.integers(-3, 3, (9, 8))  # many ties
    x = ga.from_array(i, chunks=(2, 3))
    for got, want in ((ga.median(x, axis=0), np.median(i, axis=0)), (ga.quantile(x, 0.3, axis=1), np.quantile(i, 0.3, axis=1)),
                      (ga.quantile(x, [0.3], axis=1, method="lower"), np.quantile(i, [0.3], axis=1, method="lower")),
                      (ga.percentile(x, 40), np.percentile(i, 40)), (ga.nanmedian(x), np.nanmedian(i))):
        g = values(got)
        assert g.dtype == want.dtype and g.shape == want.shape
        np.testing.assert_array_equal(g, want)
    f = RNG.standard_normal((9, 8)).astype(np.float32)
    for fn, q in ((np.nanquantile, [0.2, 0.7]), (np.nanquantile, 0.2), (np.quantile, np.float32(0.2)),
                  (np.quantile, np.array([0.25, 0.5], np.float32)), (np.quantile, np.array([0, 1])),
                  (np.percentile, 20), (np.percentile, 20.0), (np.nanpercentile, [20, 70]),
                  (np.percentile, np.array([20, 70], np.float32))):
        got = values(fn(ga.from_array(f, chunks=4), q, axis=0))
        want = fn(f, q, axis=0)  # float32 for a Python number q, promoted with an array's or NumPy scalar's type
        assert got.dtype == want.dtype, (fn, q)
        np.testing.assert_array_equal(got, want)
    b = RNG.random((7, 4)) < 0.5
    np.testing.assert_array_equal(values(ga.median(ga.from_array(b, chunks=3), axis=0)), np.median(b, axis=0))


def test_empty_and_tiny_inputs_are_numpys_too():
    for shape, axis in (((0, 5), 0), ((5, 0), 0), ((0, 5), 1), ((1, 5), 0), ((5,), None), ((1,), 0)):
        a = RNG.standard_normal(shape)
        x = ga.from_array(a, chunks=2)
        for fn in (np.median, np.nanmedian):
            got, want = values(fn(x, axis=axis)), numpy_quietly(fn, a, axis=axis)
            assert got.shape == want.shape
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(values(np.sort(x, axis=-1)), np.sort(a, axis=-1))
    s = np.asarray(2.5)
    np.testing.assert_array_equal(values(ga.median(ga.asarray(s))), np.median(s))


def test_the_ordered_axes_are_joined_and_the_others_keep_their_blocks():
    a = RNG.standard_normal((30, 12, 8))
    x = ga.from_array(a, chunks=(30, 5, 4))  # time already whole: nothing moves
    out = np.nanmedian(x, axis=0)
    tasks = [t for t in catalog_tasks(out) if t.op.name == "median"]
    assert len(tasks) == 3 * 2 and out.chunks == ((5, 5, 2), (4, 4))  # one task per (lat, lon) block
    np.testing.assert_array_equal(values(out), np.nanmedian(a, axis=0))


@pytest.mark.parametrize("chunks", [(7, 5, 4), (1, 12, 8), (3, 1, 8)], ids=str)
def test_joining_an_axis_keeps_each_block_no_larger_than_the_inputs(chunks):
    """A cube chunked one time step per block: a median over time is not one block of all of it."""
    a = RNG.standard_normal((30, 12, 8))
    x = ga.from_array(a, chunks=chunks)
    largest = int(np.prod([max(c) for c in x.chunks]))
    for out, name in ((np.nanmedian(x, axis=0), "median"), (np.sort(x, axis=0), "sort"),
                      (np.quantile(x, [0.5], axis=0), "quantile")):
        tasks = [t for t in catalog_tasks(out) if t.op.name == name]
        graph = dict(out.__dask_graph__())
        for t in tasks:
            (ref,) = t.dependencies
            block = np.shape(dask.get(graph, ref))
            assert block[0] == 30 and np.prod(block) <= max(largest, 30), (name, block)
        assert len(tasks) > 1
    np.testing.assert_array_equal(values(np.nanmedian(x, axis=0)), np.nanmedian(a, axis=0))
    np.testing.assert_array_equal(values(np.sort(x, axis=0)), np.sort(a, axis=0))


@pytest.mark.parametrize("chunks", [(17, 11), (4, 3), (1, 2), ((16, 1), (10, 1))], ids=str)
@pytest.mark.parametrize("axis", [0, 1, -1, None], ids=str)
def test_sort_and_argsort_give_numpys_order_nan_last_ties_stable(chunks, axis):
    a = awkward()
    a[:, 0] = 1.0  # a column of ties
    x = ga.from_array(a, chunks=chunks)
    np.testing.assert_array_equal(values(np.sort(x, axis=axis)), np.sort(a, axis=axis))
    idx = values(np.argsort(x, axis=axis))
    assert idx.dtype == np.intp
    np.testing.assert_array_equal(idx, np.argsort(a, axis=axis, kind="stable"))
    # numpy's default kind may order ties either way: ga's order sorts the values just the same
    flat = a.reshape(-1) if axis is None else a
    np.testing.assert_array_equal(np.take_along_axis(flat, idx, axis=-1 if axis is None else axis),
                                  np.sort(a, axis=axis))
    np.testing.assert_array_equal(values(ga.sort(x, axis=axis, kind="heapsort")), np.sort(a, axis=axis))


def reference_topk(a, k, axis):
    """k > 0: the k largest descending, NaN largest, equal values in index order; k < 0: the -k smallest ascending."""
    a = np.moveaxis(a, axis, -1)
    n = a.shape[-1]
    if k < 0:
        idx = np.argsort(a, axis=-1, kind="stable")[..., :-k]
    else:
        rank = np.where(np.isnan(a), np.inf, a)  # NaN first, then by value
        keys = [np.arange(n) * np.ones_like(a), -rank, ~np.isnan(a)]  # lexsort: last key primary
        idx = np.lexsort(keys, axis=-1)[..., :k]
    return np.moveaxis(np.take_along_axis(a, idx, -1), -1, axis), np.moveaxis(idx, -1, axis)


@pytest.mark.parametrize("chunks", [(17, 11), (4, 3), (1, 11)], ids=str)
@pytest.mark.parametrize("k, axis", [(3, 0), (-4, 1), (11, -1), (-17, 0), (1, 1)])
def test_topk_and_argtopk_take_the_largest_or_smallest_in_order(chunks, k, axis):
    a = awkward()
    a[:, 1] = 0.5  # ties
    a[2, :] = 0.5
    x = ga.from_array(a, chunks=chunks)
    want_v, want_i = reference_topk(a, k, axis)
    np.testing.assert_array_equal(values(ga.topk(x, k, axis=axis)), want_v)
    np.testing.assert_array_equal(values(ga.argtopk(x, k, axis=axis)), want_i)


def test_order_ops_are_declared_as_the_catalog_says():
    for name in ("median", "quantile", "rolling_median"):
        assert isinstance(get(name).verify, Replica) and get(name).placement == "volunteer"
    for name in ("sort", "argsort", "topk", "argtopk"):
        assert isinstance(get(name).verify, Exact) and get(name).placement == "lab"
    a = awkward((9, 8))
    for name, params in (("median", {"axis": (0,), "keepdims": True, "skipna": True}),
                         ("quantile", {"q": (0.2, 0.8), "axis": (1,), "keepdims": True, "skipna": True})):
        honest = get(name)(a, **params)
        assert judge(get(name), (a,), params, honest)
        tampered = honest.copy()
        tampered.flat[np.flatnonzero(np.isfinite(tampered))[0]] += 1e-6
        assert not judge(get(name), (a,), params, tampered)
        nan_moved = honest.copy()
        nan_moved.flat[np.flatnonzero(np.isnan(honest))[0]] = 0.0  # a NaN slice reported as a number
        assert not judge(get(name), (a,), params, nan_moved)
    honest = get("argsort")(a, axis=1)
    swapped = honest.copy()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]
    assert judge(get("argsort"), (a,), {"axis": 1}, honest) and not judge(get("argsort"), (a,), {"axis": 1}, swapped)


def test_bad_input_is_refused_before_dispatch_with_what_to_do():
    x = ga.from_array(RNG.standard_normal((6, 4)), chunks=3)
    with pytest.raises(ValueError, match=r"quantile: q must be in \[0, 1\], got 1.5"):
        np.quantile(x, 1.5)
    with pytest.raises(ValueError, match=r"nanpercentile: q must be in \[0, 100\], got \[10, 120\]"):
        np.nanpercentile(x, [10, 120])
    with pytest.raises(ValueError, match="q must be in"):
        ga.quantile(x, float("nan"))
    with pytest.raises(ValueError, match=r"q must be a number or a 1-d sequence, got shape \(2, 2\); call it once per row"):
        ga.quantile(x, [[0.1, 0.2], [0.3, 0.4]])
    with pytest.raises(TypeError, match=r"q must be numbers on your machine.*q.compute\(\)"):
        ga.quantile(x, ga.from_array(np.array([0.5])))
    with pytest.raises(ValueError, match="method 'cubic' is not one of NumPy's"):
        ga.quantile(x, 0.5, method="cubic")
    with pytest.raises(TypeError, match="'weights'"):
        np.quantile(x, 0.5, weights=np.ones((6, 4)))
    with pytest.raises(TypeError, match=r"'interpolation \(use method=\)'"):
        ga.quantile(x, 0.5, interpolation="linear")
    with pytest.raises(TypeError, match="'out'.*use the returned array"):
        np.median(x, out=np.empty(4))
    with pytest.raises(ValueError, match=r"median: axis 2 is out of bounds for shape \(6, 4\)"):
        np.median(x, axis=2)
    with pytest.raises(TypeError, match=r"median: not defined for complex128 data.*x.astype\(float\)"):
        ga.median(x.astype(np.complex128))
    with pytest.raises(TypeError, match="quantile: not defined for bool data"):
        ga.quantile(x > 0, 0.5)
    with pytest.raises(ValueError, match=r"topk: k=5 must be nonzero and at most the length 4 of axis 1 \(shape \(6, 4\)\)"):
        ga.topk(x, 5)
    with pytest.raises(ValueError, match="k=0 must be nonzero"):
        ga.argtopk(x, 0, axis=0)
    with pytest.raises(TypeError, match="'order'"):
        np.sort(x, order="f")
    with pytest.raises(ValueError, match="sort: kind must be one of NumPy's"):
        np.sort(x, kind="bogo")
    with pytest.raises(ValueError, match="sort: needs an array of at least one axis"):
        ga.sort(ga.asarray(np.asarray(1.0)))


def test_a_function_still_outside_the_catalog_is_named_with_what_to_do():
    x = ga.from_array(RNG.standard_normal((6, 4)), chunks=3)
    for fn in (np.partition, np.argpartition, np.unique):
        with pytest.raises(TypeError, match=f"numpy.{fn.__name__} is not supported on ga.Array") as e:
            fn(x) if fn is np.unique else fn(x, 2)
        assert f"call numpy.{fn.__name__} on the numpy result (x.compute()" in str(e.value)
    with pytest.raises(TypeError, match=r"np.sort\(x, axis\) is a partition for every kth \(ga.topk"):
        np.partition(x, 1, axis=0)
    with pytest.raises(TypeError, match=r"np.argsort\(x, axis\) is an argpartition for every kth"):
        np.argpartition(x, 1)
    # and what it suggests is right: a sorted array is a partition
    a = np.asarray(x)
    for kth in range(4):
        part = values(np.sort(x, axis=-1))
        assert (part[:, :kth] <= part[:, kth:kth + 1]).all() and (part[:, kth + 1:] >= part[:, kth:kth + 1]).all()
        np.testing.assert_array_equal(part[:, kth], np.partition(a, kth, axis=-1)[:, kth])


# -- rolling medians and xarray ---------------------------------------------------------------------

@pytest.mark.parametrize("shape, chunks, window, axis", [((30, 7), (4, 3), 7, 0), ((30, 7), (11, 4), (2, 7), (1, 0)),
                                                         ((13,), (5,), 13, 0), ((12, 5, 4), (5, 2, 4), 4, -3)])
def test_a_median_over_windows_is_a_fused_rolling_median(shape, chunks, window, axis):
    a = RNG.standard_normal(shape)
    a[RNG.random(shape) < 0.15] = np.nan
    x = ga.from_array(a, chunks=chunks)
    view = ga.sliding_window_view(x, window, axis=axis)
    want = swv(a, window, axis=axis)
    trailing = tuple(range(a.ndim, want.ndim))
    for fn in (np.median, np.nanmedian):
        out = fn(view, axis=trailing)
        names = {t.op.name for t in catalog_tasks(out)}
        assert "rolling_median" in names and "sliding_window" not in names and "median" not in names
        np.testing.assert_array_equal(values(out), numpy_quietly(fn, want, axis=trailing))
    # a quantile of the windows takes the general path: sliding_window blocks, one quantile task each
    np.testing.assert_array_equal(values(np.nanquantile(view, [0.25, 0.75], axis=trailing)),
                                  numpy_quietly(np.nanquantile, want, [0.25, 0.75], axis=trailing))


@pytest.fixture(scope="module")
def climate():
    xr = pytest.importorskip("xarray")
    import pandas as pd

    a = RNG.standard_normal((120, 9, 6))
    a[RNG.random(a.shape) < 0.05] = np.nan
    a[10:20, 2, 3] = np.nan  # a gap longer than a 7-day window
    coords = {"time": pd.date_range("2001-01-01", periods=120), "lat": np.linspace(-60, 60, 9)}
    da = xr.DataArray(a, dims=("time", "lat", "lon"), coords=coords, name="t2m")
    g = xr.DataArray(ga.from_array(a, chunks=(23, 4, 6)), dims=da.dims, coords=coords, name="t2m")
    return xr, da, g


def close(got, want):
    assert isinstance(got.data, np.ndarray) and got.dims == want.dims and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got.values), np.asarray(want.values), rtol=1e-12)  # NaNs where xarray's


@pytest.mark.parametrize("kw", [{}, {"center": True}, {"min_periods": 3}, {"center": True, "min_periods": 1}],
                         ids=["plain", "center", "min_periods", "center-min_periods"])
def test_xarray_rolling_median_gives_xarrays_numbers(climate, kw):
    xr, da, g = climate
    with dask.config.set(scheduler="sync"):
        got = g.rolling(time=7, **kw).median()
        assert isinstance(got.data, ga.Array)
        names = {t.op.name for t in catalog_tasks(got.data)}
        assert "rolling_median" in names and "sliding_window" not in names, names
        close(got.compute(), da.rolling(time=7, **kw).median())
        close(g.rolling(time=4, lat=3, **kw).median().compute(), da.rolling(time=4, lat=3, **kw).median())


@pytest.mark.parametrize("q", [0.5, [0.05, 0.5, 0.95]], ids=str)
@pytest.mark.parametrize("dim", ["time", ["time", "lon"], None], ids=str)
def test_xarray_quantile_and_median_give_xarrays_numbers(climate, q, dim):
    xr, da, g = climate
    with dask.config.set(scheduler="sync"):
        got = g.quantile(q, dim=dim)
        assert isinstance(got.data, ga.Array)
        close(got.compute(), da.quantile(q, dim=dim))
        close(g.quantile(q, dim=dim, skipna=False).compute(), da.quantile(q, dim=dim, skipna=False))
        close(g.quantile(q, dim=dim, method="nearest").compute(), da.quantile(q, dim=dim, method="nearest"))
        close(g.median(dim).compute(), da.median(dim))
        close(g.median(dim, skipna=False).compute(), da.median(dim, skipna=False))
        close(g.to_dataset().quantile(q, dim=dim).compute()["t2m"], da.to_dataset().quantile(q, dim=dim)["t2m"])


def test_xarray_argsort_is_the_stable_order(climate):
    xr, da, g = climate
    got = g.argsort()
    assert isinstance(got.data, ga.Array)
    np.testing.assert_array_equal(got.compute().values, np.argsort(da.values, axis=-1, kind="stable"))


# -- on a real grid -----------------------------------------------------------------------------------

def test_medians_and_quantiles_on_the_grid_are_computed_by_volunteers_and_verified(lab, climate):
    xr, da, g = climate
    # a median is ~3 flops per element, under the default placement threshold: send it out anyway
    with dask.config.set({"goblin.placement.min-flops": 0, "goblin.placement.min-intensity": 0}):
        rolling = g.rolling(time=7, center=True).median()
        quant = g.quantile([0.1, 0.9], dim="time")
        ordered = ga.sort(g.data, axis=0)
    placed = {(t.op.name, t.placement) for t in catalog_tasks(rolling.data) + catalog_tasks(quant.data)}
    assert ("rolling_median", "volunteer") in placed and ("quantile", "volunteer") in placed
    assert {t.placement for t in catalog_tasks(ordered) if t.op.name == "sort"} == {"lab"}
    before = lab.report()
    got_rolling, got_quant = rolling.compute(), quant.compute()
    close(got_rolling, da.rolling(time=7, center=True).median())
    close(got_quant, da.quantile([0.1, 0.9], dim="time"))
    np.testing.assert_array_equal(ordered.compute(), np.sort(da.values, axis=0))
    after = lab.report()
    assert after["rejected"] == before["rejected"]
    by_volunteers = lambda r: sum(v["accepted"] for v in r["volunteers"].values())  # noqa: E731
    assert by_volunteers(after) >= by_volunteers(before) + rolling.data.npartitions + quant.data.npartitions
