"""Sliding windows and rolling reductions on ga.Array and on ga-backed xarray, against NumPy and xarray (float64)."""

from __future__ import annotations

import subprocess
import sys

import dask
import numpy as np
import pytest

import goblin_dask.array as ga
from goblin_dask.ops import CatalogTask, Exact, Replica, get

RNG = np.random.default_rng(20261205)
swv = np.lib.stride_tricks.sliding_window_view


def values(x):
    return np.asarray(x.compute(scheduler="threads"))


def catalog_tasks(x):
    return [t for t in dict(x.__dask_graph__()).values() if isinstance(t, CatalogTask)]


def op_names(x):
    return {t.op.name for t in catalog_tasks(x)}


CASES = [  # shape, chunks, window_shape, axis
    ((30, 7), (4, 3), 7, 0),  # window longer than a block: the halo spans two blocks
    ((30, 7), (10, 7), 3, 0),
    ((30, 7), (4, 3), (5, 3), (0, 1)),  # halos along two axes (corner blocks too)
    ((30, 7), (11, 4), (2, 7), (1, 0)),
    ((13,), (5,), 13, 0),  # one window: the whole axis
    ((12, 5, 4), (5, 2, 4), 4, -3),
    ((9, 6), (4, 4), (3, 2), None),
]


@pytest.mark.parametrize("shape, chunks, window, axis", CASES)
def test_sliding_window_view_and_its_fused_reductions_match_numpy(shape, chunks, window, axis):
    a = RNG.standard_normal(shape)
    x = ga.from_array(a, chunks=chunks)
    view = np.lib.stride_tricks.sliding_window_view(x, window, axis=axis)
    want = swv(a, window, axis=axis)
    assert isinstance(view, ga.Array) and view.shape == want.shape
    np.testing.assert_array_equal(values(view), want)
    trailing = tuple(range(a.ndim, want.ndim))
    for reduce in (np.sum, np.max, np.min, np.prod):
        got = reduce(view, axis=trailing)
        assert op_names(got) & {"rolling_sum", "rolling_max", "rolling_min", "rolling_prod"}
        assert "sliding_window" not in op_names(got)  # fused: the view itself is never built
        np.testing.assert_allclose(values(got), reduce(want, axis=trailing), rtol=1e-12)
    for reduce, kw in ((np.var, {}), (np.std, {"ddof": 1}), (np.nanstd, {}), (np.nanvar, {"ddof": 1})):
        got = reduce(view, axis=trailing, **kw)
        assert op_names(got) & {"rolling_var", "rolling_std"} and "sliding_window" not in op_names(got)
        np.testing.assert_allclose(values(got), reduce(want, axis=trailing, **kw), rtol=1e-12)
    # any other use of the view reads its sliding_window blocks
    np.testing.assert_allclose(values(np.mean(view, axis=trailing)), want.mean(axis=trailing), rtol=1e-12)
    np.testing.assert_allclose(values(view[..., 0] * 2.0), want[..., 0] * 2.0, rtol=1e-12)


def test_fused_rolling_keeps_numpys_dtypes():
    i = RNG.integers(-5, 5, (20, 3))
    x = ga.from_array(i, chunks=(6, 3))
    v = ga.sliding_window_view(x, 4, axis=0)
    for reduce in (np.sum, np.max):
        got, want = values(reduce(v, axis=-1)), reduce(swv(i, 4, axis=0), axis=-1)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    b = ga.from_array(i > 0, chunks=(6, 3))
    counts = np.sum(ga.sliding_window_view(b, 4, axis=0), axis=-1)
    np.testing.assert_array_equal(values(counts), swv(i > 0, 4, axis=0).sum(axis=-1))


def test_each_rolling_task_reads_one_block_and_its_halo_only():
    a = RNG.standard_normal((40, 6))
    x = ga.from_array(a, chunks=(8, 3))
    out = np.sum(ga.sliding_window_view(x, 5, axis=0), axis=-1)
    tasks = [t for t in catalog_tasks(out) if t.op.name == "rolling_sum"]
    assert len(tasks) == out.npartitions == 10
    graph = dict(out.__dask_graph__())
    shapes = {}
    for key, task in graph.items():
        if isinstance(task, CatalogTask) and task.op.name == "rolling_sum":
            (ref,) = task.dependencies
            shapes[key[1:]] = np.shape(dask.get(graph, ref))
    for idx, shape in shapes.items():
        rows = out.chunks[0][idx[0]]
        assert shape == (rows + 4, out.chunks[1][idx[1]]), (idx, shape)  # its rows, 4 after them, its columns


def test_rolling_ops_are_declared_like_the_catalog_says():
    assert isinstance(get("sliding_window").verify, Exact) and get("sliding_window").placement == "lab"
    for kind in ("sum", "prod", "max", "min", "var", "std"):
        spec = get(f"rolling_{kind}")
        assert isinstance(spec.verify, Replica) and spec.placement == "volunteer"
    from goblin_dask.validation.checks import judge

    a = RNG.standard_normal((10, 4))
    params = {"window_shape": (3,), "axis": (0,)}
    honest = get("rolling_sum")(a, **params)
    np.testing.assert_allclose(honest, swv(a, 3, axis=0).sum(axis=-1), rtol=1e-14)
    assert judge(get("rolling_sum"), (a,), params, honest)
    tampered = honest.copy()
    tampered[7, 2] += 1e-6
    assert not judge(get("rolling_sum"), (a,), params, tampered)


def test_sliding_window_errors_name_the_op_and_shape():
    x = ga.from_array(RNG.standard_normal((6, 4)), chunks=3)
    with pytest.raises(ValueError, match=r"sliding_window: window 7 along axis 0 is larger than the axis \(shape \(6, 4\)\)"):
        ga.sliding_window_view(x, 7, axis=0)
    with pytest.raises(ValueError, match=r"sliding_window: window_shape \(2, 2\) and axis \(0,\) differ"):
        ga.sliding_window_view(x, (2, 2), axis=0)
    with pytest.raises(ValueError, match=r"sliding_window_view: axis \(0, 0\) repeats an axis"):
        ga.sliding_window_view(x, (2, 2), axis=(0, 0))
    with pytest.raises(ValueError, match=r"sliding_window: axis 2 is out of bounds for an array of shape \(6, 4\)"):
        ga.sliding_window_view(x, 2, axis=2)
    with pytest.raises(TypeError, match="writeable"):
        ga.sliding_window_view(x, 2, axis=0, writeable=True)


# -- xarray -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def climate():
    xr = pytest.importorskip("xarray")
    import pandas as pd

    a = RNG.standard_normal((365, 40, 30))
    a[RNG.random(a.shape) < 0.02] = np.nan
    coords = {"time": pd.date_range("2001-01-01", periods=365), "lat": np.linspace(-60, 60, 40)}
    da = xr.DataArray(a, dims=("time", "lat", "lon"), coords=coords, name="t2m")
    g = xr.DataArray(ga.from_array(a, chunks=(73, 40, 30)), dims=da.dims, coords=coords, name="t2m")
    return xr, da, g


def close(got, want):
    """xarray's numbers, NaNs exactly where xarray puts them (assert_allclose requires matching NaNs)."""
    np.testing.assert_allclose(np.asarray(got.values), np.asarray(want.values), rtol=1e-12)
    assert got.dims == want.dims and got.dtype == want.dtype


@pytest.mark.parametrize("kw", [{}, {"center": True}, {"min_periods": 3}, {"center": True, "min_periods": 1}],
                         ids=["plain", "center", "min_periods", "center-min_periods"])
def test_xarray_rolling_reductions_give_xarrays_numbers(climate, kw):
    xr, da, g = climate
    with dask.config.set(scheduler="threads"):
        for red in ("mean", "sum", "max", "min", "count", "std", "var", "prod"):
            got = getattr(g.rolling(time=7, **kw), red)()
            assert isinstance(got.data, ga.Array), (red, type(got.data))
            close(got.compute(), getattr(da.rolling(time=7, **kw), red)())


def test_xarray_rolling_means_are_fused_rolling_sums(climate):
    xr, da, g = climate
    for red, fused in (("mean", "rolling_sum"), ("sum", "rolling_sum"), ("max", "rolling_max"), ("min", "rolling_min"),
                       ("std", "rolling_std"), ("var", "rolling_var"), ("prod", "rolling_prod"), ("count", "rolling_sum")):
        ops = op_names(getattr(g.rolling(time=7, center=True), red)().data)
        assert fused in ops and "sliding_window" not in ops, (red, ops)


def test_xarray_multi_dim_rolling_datasets_and_construct(climate):
    xr, da, g = climate
    with dask.config.set(scheduler="threads"):
        close(g.rolling(time=5, lat=3).mean().compute(), da.rolling(time=5, lat=3).mean())
        close(g.rolling(time=4, lat=2, center=True).max().compute(), da.rolling(time=4, lat=2, center=True).max())
        got = g.to_dataset().rolling(time=7).mean().compute()
        close(got["t2m"], da.to_dataset().rolling(time=7).mean()["t2m"])
        close(g.rolling(time=3).construct("window").compute(), da.rolling(time=3).construct("window"))
        anomaly = g - g.rolling(time=31, center=True, min_periods=1).mean()
        close(anomaly.compute(), da - da.rolling(time=31, center=True, min_periods=1).mean())


def test_other_xarray_data_still_takes_xarrays_own_path(climate):
    xr, da, g = climate
    small = da.isel(lat=slice(0, 4))
    want = small.rolling(time=7).mean()
    expected = swv(np.pad(small.values, ((6, 0), (0, 0), (0, 0)), constant_values=np.nan), 7, axis=0)
    assert want.shape == small.shape and np.isnan(want.values[:6]).all()
    np.testing.assert_allclose(want.values[6:], expected[6:].mean(axis=-1), rtol=1e-12)
    import dask.array as dska

    on_dask = small.copy(data=dska.from_array(small.values, chunks=(73, 4, 30))).rolling(time=7).mean()
    assert isinstance(on_dask.data, dska.Array)
    close(on_dask.compute(), want)


def test_bottleneck_and_numbagg_moving_functions_are_kept_off_ga_data(climate):
    """With bottleneck or numbagg installed, xarray would hand ga data to dask.array's map_overlap."""
    xr, da, g = climate
    from xarray.core import duck_array_ops

    r = g.rolling(time=7)

    def boom(*args, **kwargs):
        raise AssertionError("a moving-window function of bottleneck/numbagg reached ga data")

    got = r._array_reduce(array_agg_func=duck_array_ops.sum, bottleneck_move_func=boom, numbagg_move_func=boom,
                          rolling_agg_func=None, keep_attrs=False, fillna=0,
                          sliding_window_view_kwargs={"automatic_rechunk": False})
    close(got.compute(scheduler="threads"), da.rolling(time=7).sum())


@pytest.mark.parametrize("order", ["ga-first", "xarray-first"])
def test_the_xarray_hook_holds_whichever_is_imported_first(order):
    imports = ["import goblin_dask.array as ga", "import xarray as xr"]
    code = "; ".join(imports if order == "ga-first" else imports[::-1]) + (
        "; import numpy as np, dask; a = np.arange(60.).reshape(20, 3)"
        "; g = xr.DataArray(ga.from_array(a, chunks=(6, 3)), dims=('t', 'x'))"
        "; got = g.rolling(t=4).mean().compute(scheduler='sync').values"
        "; want = xr.DataArray(a, dims=('t', 'x')).rolling(t=4).mean().values"
        "; np.testing.assert_allclose(got, want, rtol=1e-12); print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# -- on a real grid -----------------------------------------------------------------------------------

def test_xarray_rolling_on_the_grid_is_computed_by_volunteers_and_verified(lab, climate):
    xr, da, g = climate
    # a 7-row window is ~1 flop per byte moved, under the default placement threshold: send it out anyway
    with dask.config.set({"goblin.placement.min-flops": 0, "goblin.placement.min-intensity": 0}):
        mean = g.rolling(time=7, center=True).mean()
        biggest = g.rolling(time=7, min_periods=2).max()
    placed = {(t.op.name, t.placement) for t in catalog_tasks(mean.data) + catalog_tasks(biggest.data)}
    assert ("rolling_sum", "volunteer") in placed and ("rolling_max", "volunteer") in placed
    before = lab.report()
    # DataArray.compute hands the ga arrays to dask; dask.compute(DataArray) would apply dask.array's graph
    # optimization to them (found here: nothing then reaches a volunteer, the lab computes it all)
    got_mean, got_max = mean.compute(), biggest.compute()
    close(got_mean, da.rolling(time=7, center=True).mean())
    close(got_max, da.rolling(time=7, min_periods=2).max())
    after = lab.report()
    replicated = lambda r: sum(r["by_method"].get(m, 0) for m in ("replica", "audit", "sample", "trusted"))  # noqa: E731
    assert replicated(after) >= replicated(before) + mean.data.npartitions
    assert after["rejected"] == before["rejected"]
    by_volunteers = lambda r: sum(v["accepted"] for v in r["volunteers"].values())  # noqa: E731
    assert by_volunteers(after) >= by_volunteers(before) + mean.data.npartitions


def test_xarray_rolling_on_the_grid_without_forcing_placement(lab, climate):
    xr, da, g = climate
    got = g.rolling(time=7).sum().compute()
    close(got, da.rolling(time=7).sum())
