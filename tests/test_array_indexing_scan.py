"""Integer-array indexing (take), pad, cumulative ops and batched einsum on ga.Array, against NumPy and xarray."""

from __future__ import annotations

import dask
import numpy as np
import pytest

import goblin_dask.array as ga
from goblin_dask.array.keys import PARTS, split_name
from goblin_dask.ops import CatalogTask, catalog

RNG = np.random.default_rng(20261204)


def values(x):
    return np.asarray(x.compute(scheduler="threads"))


def same(got, want, rtol=1e-10, atol=1e-12):
    got = values(got) if isinstance(got, ga.Array) else np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def tasks_are_catalog_ops_with_known_parts(x):
    for key, task in dict(x.__dask_graph__()).items():
        name = split_name(key[0] if isinstance(key, tuple) else key)
        assert name is not None and (name.part is None or name.part in PARTS), key
        assert isinstance(task, CatalogTask) or type(task).__name__ in ("Alias", "DataNode", "Task"), (key, task)
        if isinstance(task, CatalogTask):
            assert task.op.name in catalog()


# -- take / integer-array indexing ------------------------------------------------------------------

@pytest.mark.parametrize("chunks", [(5, 3), (2, 2), (13, 7), (1, 1)])
@pytest.mark.parametrize("idx", [[1, 5, 7], [6, 0, 0, -1, 3, 2], [], [-7], list(range(7))[::-1]])
def test_integer_array_indexing_along_each_axis(chunks, idx):
    a = RNG.standard_normal((13, 8))
    x = ga.from_array(a, chunks=chunks)
    same(x[:, idx], a[:, idx])
    same(x[np.array(idx, dtype=np.int64)], a[np.array(idx, dtype=np.int64)])
    same(np.take(x, idx, axis=1), np.take(a, idx, axis=1))
    same(ga.take(x, idx, axis=0), np.take(a, idx, axis=0))
    tasks_are_catalog_ops_with_known_parts(x[:, idx])


def test_take_mixed_with_basic_indexing_and_masks():
    a = RNG.standard_normal((9, 8, 6))
    x = ga.from_array(a, chunks=(4, 3, 5))
    idx = np.array([1, 5, 7])
    same(x[2:8, idx, ::-2], a[2:8, idx, ::-2])
    same(x[1, :, [0, 5]], a[1, :, [0, 5]])
    same(x[..., [4, 1]], a[..., [4, 1]])
    same(x[None, :, idx], a[None, :, idx])
    mask = RNG.random(8) < 0.5
    same(x[:, mask], a[:, mask])
    full = a > 0
    same(x[full], a[full])
    same(np.take(x, [[0, 3], [2, 2]], axis=2), np.take(a, [[0, 3], [2, 2]], axis=2))
    same(np.take(x, [3, 100 - 99]), np.take(a, [3, 1]))  # flattened
    ints = np.arange(20, dtype=np.int32).reshape(4, 5)
    same(ga.from_array(ints, chunks=2)[[3, 0]], ints[[3, 0]])


def test_take_errors_name_the_op_and_axis():
    x = ga.from_array(RNG.standard_normal((4, 8)), chunks=3)
    with pytest.raises(IndexError, match="index 9 is out of bounds for axis 1 with size 8"):
        x[:, [1, 9]]
    with pytest.raises(IndexError, match="take: index -5 is out of bounds for axis 0 with size 4"):
        ga.take(x, [0, -5], axis=0)
    with pytest.raises(TypeError, match="integers"):
        ga.take(x, [0.5], axis=0)
    with pytest.raises(TypeError, match="one index array at a time"):
        x[[0, 1], [1, 2]]
    with pytest.raises(TypeError, match="computed"):
        x[ga.from_array(np.array([0, 1]))]
    with pytest.raises(IndexError, match="boolean index"):
        x[:, np.ones(3, bool)]
    with pytest.raises(ValueError, match="take: axis 2 is out of bounds"):
        ga.take(x, [0], axis=2)


# -- pad ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["constant", "edge", "reflect", "symmetric", "wrap"])
@pytest.mark.parametrize("chunks", [(4, 3), (2, 5), (9, 5)])
@pytest.mark.parametrize("width", [((3, 0), (0, 0)), ((1, 2), (2, 1)), 2, ((0, 0), (4, 4))])
def test_pad_matches_numpy(mode, chunks, width):
    a = RNG.standard_normal((9, 5))
    x = ga.from_array(a, chunks=chunks)
    extra = {"constant_values": -1.5} if mode == "constant" else {}
    same(np.pad(x, width, mode=mode, **extra), np.pad(a, width, mode=mode, **extra))
    tasks_are_catalog_ops_with_known_parts(ga.pad(x, width, mode=mode, **extra))


def test_pad_edge_cases_and_errors():
    ints = np.arange(12, dtype=np.int16).reshape(3, 4)
    x = ga.from_array(ints, chunks=2)
    same(np.pad(x, 1), np.pad(ints, 1))
    same(np.pad(x, ((0, 0), (1, 1)), constant_values=7), np.pad(ints, ((0, 0), (1, 1)), constant_values=7))
    same(np.pad(x, 0), ints)
    e = np.zeros((0, 3))
    same(np.pad(ga.from_array(e), ((1, 1), (0, 0))), np.pad(e, ((1, 1), (0, 0))))
    with pytest.raises(ValueError, match="pad: mode 'median'"):
        ga.pad(x, 1, mode="median")
    with pytest.raises(ValueError, match="negative"):
        ga.pad(x, -1)
    with pytest.raises(ValueError, match="exceed"):
        ga.pad(x, 5, mode="reflect")


# -- cumulative ops --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["cumsum", "cumprod", "nancumsum", "nancumprod"])
@pytest.mark.parametrize("chunks", [(3, 2, 4), (7, 5, 4), (1, 1, 1), (2, 5, 3)])
@pytest.mark.parametrize("axis", [0, 1, -1, None])
def test_cumulative_ops_match_numpy(name, chunks, axis):
    a = RNG.uniform(0.5, 1.5, (7, 5, 4))
    if name.startswith("nan"):
        a[RNG.random(a.shape) < 0.2] = np.nan
    x = ga.from_array(a, chunks=chunks)
    got = getattr(np, name)(x, axis=axis)
    same(got, getattr(np, name)(a, axis=axis))
    tasks_are_catalog_ops_with_known_parts(got)


def test_cumulative_dtypes_and_edges():
    ints = RNG.integers(-5, 5, (6, 4)).astype(np.int8)
    x = ga.from_array(ints, chunks=(2, 3))
    same(np.cumsum(x, axis=0), np.cumsum(ints, axis=0))
    same(np.cumprod(x, axis=1), np.cumprod(ints, axis=1))
    same(np.cumsum(x, axis=0, dtype=np.float32), np.cumsum(ints, axis=0, dtype=np.float32))
    b = RNG.random((5, 3)) < 0.5
    same(np.cumsum(ga.from_array(b, chunks=2), axis=0), np.cumsum(b, axis=0))
    f = RNG.standard_normal(10).astype(np.float32)
    same(ga.cumsum(ga.from_array(f, chunks=3)), np.cumsum(f), rtol=1e-5, atol=1e-6)
    e = np.zeros((0, 3))
    same(np.cumsum(ga.from_array(e), axis=0), np.cumsum(e, axis=0))
    with pytest.raises(ValueError, match="cumsum: axis 2 is out of bounds"):
        ga.cumsum(x, axis=2)


# -- batched einsum ------------------------------------------------------------------------------------

@pytest.mark.parametrize("subscripts, shapes", [
    ("bij,bjk->bik", [(4, 5, 6), (4, 6, 3)]),
    ("bij,bjk->ibk", [(4, 5, 6), (4, 6, 3)]),
    ("abc,bc->ac", [(6, 5, 4), (5, 4)]),
    ("ij,ij->i", [(7, 5), (7, 5)]),
    ("bi,bj->bij", [(3, 4), (3, 5)]),
    ("xbi,bjy->bxy", [(2, 3, 4), (3, 4, 5)]),
])
@pytest.mark.parametrize("chunk", [2, 3, 100])
def test_batched_einsum_matches_numpy(subscripts, shapes, chunk):
    ops = [RNG.standard_normal(s) for s in shapes]
    xs = [ga.from_array(o, chunks=chunk) for o in ops]
    got = np.einsum(subscripts, *xs)
    same(got, np.einsum(subscripts, *ops))
    tasks_are_catalog_ops_with_known_parts(got)


def test_batched_einsum_tasks_are_freivalds_checked_products():
    from goblin_dask.validation.checks import judge

    a, b = RNG.standard_normal((4, 5, 6)), RNG.standard_normal((4, 6, 3))
    spec = catalog()["einsum"]
    honest = spec(a, b, subscripts="bij,bjk->bik")
    assert judge(spec, (a, b), {"subscripts": "bij,bjk->bik"}, honest)
    tampered = honest.copy()
    tampered[3, 4, 2] += 1.0
    assert not judge(spec, (a, b), {"subscripts": "bij,bjk->bik"}, tampered)


# -- the xarray operations of issue 17 -------------------------------------------------------------

@pytest.fixture
def climate():
    xr = pytest.importorskip("xarray")
    import pandas as pd

    a = RNG.standard_normal((60, 8, 6))
    da = xr.DataArray(a, dims=("time", "lat", "lon"),
                      coords={"time": pd.date_range("2000-01-01", periods=60), "lat": np.linspace(-70, 70, 8)})
    return xr, da, ga.from_array(da, chunks={"time": 16, "lat": 3})


def test_xarray_groupby_isel_dot_cumsum_on_ga_data(climate):
    xr, da, g = climate
    w = xr.DataArray(RNG.standard_normal((8, 6)), dims=("lat", "lon"))
    gw = ga.from_array(w, chunks=4)
    with dask.config.set(scheduler="threads"):
        cases = [
            (g.groupby("time.month").mean(), da.groupby("time.month").mean()),
            (g.isel(lat=[1, 5, 7]), da.isel(lat=[1, 5, 7])),
            (g.isel(lat=[7, -1, 0], time=[3, 40]), da.isel(lat=[7, -1, 0], time=[3, 40])),
            (g.sel(lat=[-70.0, 70.0]), da.sel(lat=[-70.0, 70.0])),
            (xr.dot(g, gw, dim="lat"), xr.dot(da, w, dim="lat")),
            (xr.dot(g, gw, dim=("lat", "lon")), xr.dot(da, w, dim=("lat", "lon"))),
            (g.cumsum("time"), da.cumsum("time")),
            (g.cumprod("lon"), da.cumprod("lon")),
            (g.pad(time=(2, 1), mode="edge"), da.pad(time=(2, 1), mode="edge")),
        ]
        for got, want in cases:
            assert isinstance(got.data, ga.Array), type(got.data)
            xr.testing.assert_allclose(got.compute(), want)


def test_xarray_rolling_gives_xarrays_numbers_on_ga_data(climate):
    """xarray sends a dask collection's windows to dask.array (it failed there on ``x._meta``); ga routes them to
    ga.sliding_window_view, and a reduction over the windows is one fused rolling task per block."""
    xr, da, g = climate
    with dask.config.set(scheduler="threads"):
        for kw in ({}, {"center": True}, {"min_periods": 3}):
            for red in ("mean", "sum", "max", "std"):
                got, want = getattr(g.rolling(time=7, **kw), red)(), getattr(da.rolling(time=7, **kw), red)()
                assert isinstance(got.data, ga.Array), type(got.data)
                np.testing.assert_allclose(got.values, want.values, rtol=1e-12)
                tasks_are_catalog_ops_with_known_parts(got.data)
    ops = {t.op.name for t in dict(g.rolling(time=7).mean().data.__dask_graph__()).values() if isinstance(t, CatalogTask)}
    assert "rolling_sum" in ops and "sliding_window" not in ops


def test_new_ops_verification_and_placement():
    from goblin_dask.ops import Exact, Freivalds, Replica, get
    from goblin_dask.ops.layout import LayoutIndexError

    assert isinstance(get("take").verify, Exact) and get("take").placement == "lab"
    assert isinstance(get("pad").verify, Exact) and get("pad").placement == "lab"
    for name in ("cumsum", "cumprod"):
        assert isinstance(get(name).verify, Replica) and get(name).placement == "volunteer"
    assert isinstance(get("einsum").verify, Freivalds)
    with pytest.raises(LayoutIndexError, match="take: index 8 is out of bounds for axis 1 with size 8"):
        get("take").abstract_eval(np.zeros((3, 8)), indices=(1, 8), axis=1)
    with pytest.raises(ValueError, match="take: axis 2 is out of bounds"):
        get("take")(np.zeros((3, 8)), indices=(1,), axis=2)
    with pytest.raises(ValueError, match="pad: mode 'mean'"):
        get("pad").abstract_eval(np.zeros((3, 8)), pad_width=1, mode="mean")


def test_scan_tasks_are_one_block_each():
    x = ga.from_array(RNG.standard_normal((12, 4)), chunks=(3, 4))
    graph = dict(ga.cumsum(x, axis=0).__dask_graph__())
    ops = sorted(t.op.name for t in graph.values() if isinstance(t, CatalogTask))
    # 4 block scans, 3 last slices, 2 running totals, 3 corrections
    assert ops.count("cumsum") == 4 and ops.count("getitem") == 3 and ops.count("add") == 5


def test_on_the_grid_take_pad_scan_and_batched_einsum_pass_the_lab_filters(lab):
    a = RNG.standard_normal((400, 300))
    x = ga.from_array(a, chunks=(100, 150))
    b, c = RNG.standard_normal((6, 120, 130)), RNG.standard_normal((6, 130, 110))
    idx = [399, 0, 7, 250, 251, -2]
    before = lab.report()["by_method"].get("freivalds", 0)
    with dask.config.set({"goblin.placement.min-product-intensity": 0}):  # these small blocks go out all the same
        einsum = np.einsum("bij,bjk->bik", ga.from_array(b, chunks=(2, 60, 130)), ga.from_array(c, chunks=(3, 130, 55)))
    results = dask.compute(x[idx], np.pad(x, ((2, 3), (1, 0)), mode="reflect"), np.cumsum(x, axis=0), einsum)
    wants = [a[idx], np.pad(a, ((2, 3), (1, 0)), mode="reflect"), np.cumsum(a, axis=0), np.einsum("bij,bjk->bik", b, c)]
    for got, want in zip(results, wants):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    assert lab.report()["by_method"].get("freivalds", 0) > before  # the batched einsum blocks went to volunteers
