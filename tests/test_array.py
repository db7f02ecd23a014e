"""ga.Array against NumPy (float64 references), computed by dask's synchronous scheduler.

The same graphs run on the grid in test_array_grid.py; here every operation of the
array API is checked on random inputs with uneven blocks, broadcasting, size-1 and
empty dimensions.  ``scheduler="sync"`` keeps these off any default client.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import dask
import goblin_dask.array as ga
from goblin_dask.ops import CatalogTask, catalog
from goblin_dask.ops._samples import computes_on, draw

RNG = np.random.default_rng(20261203)


def ev(x):
    return np.asarray(x.compute(scheduler="sync"))


def close(got, want, rtol=1e-10, atol=1e-12):
    want = np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, equal_nan=True)


ELEMENTWISE = sorted(n for n, s in catalog().items() if s.elementwise is not None)


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_every_elementwise_op_with_broadcasting_and_uneven_blocks(name):
    spec = catalog()[name]
    dt = "float64" if computes_on(spec, "float64") else "int64"
    shapes = [(7, 5), (5,), (7, 1)][: spec.arity]
    chunks = [(3, 2), (2,), (4, 1)][: spec.arity]
    arrays = [draw(spec, i, s, dt, RNG) for i, s in enumerate(shapes)]
    with np.errstate(all="ignore"):
        want = spec.numpy(*arrays)
        got = ev(getattr(ga, name)(*(ga.from_array(a, chunks=c) for a, c in zip(arrays, chunks))))
    assert got.dtype == want.dtype
    close(got, want, rtol=1e-12)


def test_operators_scalars_and_numpy_ufuncs():
    a, b = RNG.standard_normal((6, 4)), RNG.standard_normal((4,))
    x, y = ga.from_array(a, chunks=(4, 3)), ga.from_array(b, chunks=2)
    close(ev(x + y * 2 - 1 / x), a + b * 2 - 1 / a)
    close(ev(2 ** abs(x) // 1 % 3), 2 ** np.abs(a) // 1 % 3)
    close(ev(-x), -a)
    assert ev(x > y).dtype == bool and (ev(x > y) == (a > b)).all()
    close(ev(np.exp(x) + np.sin(y)), np.exp(a) + np.sin(b))
    close(ev(np.maximum(x, 0.5)), np.maximum(a, 0.5))
    x32 = ga.from_array(a.astype(np.float32), chunks=3)
    assert (x32 * 2.0).dtype == np.float32 and (x32 + np.float64(1)).dtype == np.float64  # NEP 50
    close(ev(ga.where(x > 0, x, y)), np.where(a > 0, a, b))
    close(ev(x.clip(-0.5, 0.5)), np.clip(a, -0.5, 0.5))
    assert ev(x.astype("int32")).dtype == np.int32
    close(ev(np.round(x)), np.round(a))


def test_bad_input_fails_before_dispatch():
    x = ga.from_array(np.ones((4, 3)), chunks=2)
    with pytest.raises(ValueError, match=r"\(4, 3\).*\(4, 3\)|\(4, 3\) and \(4, 3\)"):
        x @ x
    with pytest.raises(ValueError, match="broadcast|shape"):
        x + ga.ones((5,))
    with pytest.raises(TypeError, match="dtype"):
        ga.from_array(np.array(["a", "b"]))
    with pytest.raises(TypeError, match="dtype"):
        ga.from_array(np.zeros(3, dtype=[("f", "f8")]))
    with pytest.raises(ValueError, match="chunks"):
        ga.from_array(np.ones((4, 3)), chunks=(3, 3, 3))
    with pytest.raises(ValueError, match="chunks"):
        ga.from_array(np.ones((4, 3)), chunks=((1, 1), (3,)))
    with pytest.raises(ValueError, match="chunks"):
        ga.from_array(np.ones((4, 3)), chunks=0)
    with pytest.raises(IndexError):
        x[4]
    with pytest.raises(TypeError, match="computed"):
        x[x > 0]
    with pytest.raises(TypeError, match="not supported on ga.Array") as e:
        np.unique(x)
    assert "call numpy.unique on the numpy result (x.compute()" in str(e.value)  # what to do instead
    with pytest.raises(TypeError, match="catalog operation.*x.compute"):
        np.gcd(x, x)
    with pytest.raises(ValueError, match="formula"):
        ga.formula("__import__('os')", a=x)


REDUCTIONS = ["sum", "prod", "mean", "max", "min", "var", "std", "any", "all"]


@pytest.mark.parametrize("name", REDUCTIONS)
@pytest.mark.parametrize("axis", [None, 0, 1, (0, 2), -1])
@pytest.mark.parametrize("keepdims", [False, True])
def test_reductions(name, axis, keepdims):
    a = RNG.uniform(0.5, 1.5, (5, 6, 4))
    if name in ("any", "all"):
        a = a > 1.2
    x = ga.from_array(a, chunks=(2, 4, 3))
    want = getattr(np, name)(a, axis=axis, keepdims=keepdims)
    got = ev(getattr(x, name)(axis=axis, keepdims=keepdims))
    assert got.dtype == np.asarray(want).dtype
    close(got, want, rtol=1e-11)


@pytest.mark.parametrize("name", ["argmax", "argmin"])
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_arg_reductions_with_ties_and_nan(name, axis):
    a = RNG.integers(0, 3, (7, 9)).astype(float)  # many ties: the first index must win
    x = ga.from_array(a, chunks=(3, 4))
    assert (ev(getattr(ga, name)(x, axis=axis)) == getattr(np, name)(a, axis=axis)).all()
    a[2, 5] = a[5, 1] = np.nan
    x = ga.from_array(a, chunks=(3, 4))
    assert (ev(getattr(ga, name)(x, axis=axis)) == getattr(np, name)(a, axis=axis)).all()


@pytest.mark.parametrize("name", ["nansum", "nanmean", "nanmax", "nanmin", "nanvar", "nanstd", "nanargmax", "nanargmin", "nanprod"])
def test_nan_reductions(name):
    a = RNG.standard_normal((6, 5))
    a[a > 1.0] = np.nan
    x = ga.from_array(a, chunks=(4, 2))
    for axis in (None, 0, 1):
        close(ev(getattr(np, name)(x, axis=axis)), getattr(np, name)(a, axis=axis))


@pytest.mark.parametrize("name", ["nanvar", "nanstd"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.complex128])
def test_nan_variance_of_rows_holding_inf_is_numpys(name, dtype):
    """An inf makes the variance NaN in NumPy (inf - inf); the NaN-skipping must skip the NaNs of the data only,
    and a row with no degrees of freedom left is NaN too (found by an outside suite: inf and 0.0 before)."""
    a = np.array([[np.inf, 1, 2, 3], [-np.inf, np.inf, 0, 1], [np.nan, np.inf, 1, 2], [1, 2, np.nan, 4],
                  [np.nan] * 4, [-np.inf, -np.inf, 1, 2], [np.nan, np.nan, np.nan, 5.0]]).astype(dtype)
    x = ga.from_array(a, chunks=(3, 2))
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for axis in (None, 0, 1):
            for ddof in (0, 1, 2):
                got, want = ev(getattr(ga, name)(x, axis=axis, ddof=ddof)), getattr(np, name)(a, axis=axis, ddof=ddof)
                assert got.dtype == want.dtype
                np.testing.assert_allclose(got, want, rtol=1e-6 if dtype == np.float32 else 1e-12, equal_nan=True)


def test_reductions_on_nan_inf_ints_and_empty():
    a = np.array([[1.0, np.inf, 2.0], [np.nan, 0.0, -np.inf]])
    x = ga.from_array(a, chunks=1)
    close(ev(x.sum(axis=1)), a.sum(axis=1))
    close(ev(x.max(axis=0)), a.max(axis=0))
    i = RNG.integers(-100, 100, (9, 4)).astype(np.int32)
    xi = ga.from_array(i, chunks=(4, 3))
    assert ev(xi.sum()).dtype == i.sum().dtype and ev(xi.sum()) == i.sum()
    close(ev(xi.mean(axis=0)), i.mean(axis=0))
    close(ev(xi.var(axis=0)), i.var(axis=0))
    e = ga.from_array(np.zeros((0, 3)))
    close(ev(e.sum(axis=0)), np.zeros(3))
    with pytest.raises(ValueError, match="zero-size"):
        e.max(axis=0)


def test_float32_results_stay_float32_and_close():
    a = RNG.standard_normal((300, 40)).astype(np.float32)
    x = ga.from_array(a, chunks=(70, 40))
    assert x.sum(axis=0).dtype == np.float32 and x.var().dtype == np.float32
    close(ev(x.mean(axis=0)), a.astype(np.float64).mean(axis=0), rtol=1e-5, atol=1e-6)
    close(ev(x.std()), a.astype(np.float64).std(), rtol=1e-5)


@pytest.mark.parametrize("shapes", [((7, 5), (5, 3)), ((1, 5), (5, 1)), ((5,), (5, 4)), ((6, 5), (5,)), ((5,), (5,)),
                                    ((3, 0), (0, 4)), ((0, 4), (4, 2)), ((2, 6, 5), (5, 3)), ((2, 6, 5), (2, 5, 4))])
def test_matmul_shapes(shapes):
    a, b = (RNG.standard_normal(s) for s in shapes)
    x, y = ga.from_array(a, chunks=2), ga.from_array(b, chunks=3)
    close(ev(x @ y), a @ b)
    close(ev(np.matmul(x, y)), a @ b)


def test_blocked_product_accumulates_along_k_within_the_memory_budget():
    a, b = RNG.standard_normal((300, 500)), RNG.standard_normal((500, 200))
    # 200 KB per task: k must be split (volunteer tiles: tiles this small would be the lab's, one task)
    with dask.config.set({"goblin.product.volunteer-memory": 800_000, "goblin.placement.min-product-intensity": 1}):
        z = ga.from_array(a) @ ga.from_array(b)
    graph = dict(z.__dask_graph__())
    ops = {v.op.name for v in graph.values() if isinstance(v, CatalogTask)}
    assert "matmul_accumulate" in ops
    close(ev(z), a @ b)
    from goblin_dask.array.linalg import product_blocks

    bm, bk, bn = product_blocks(300, 500, 200, 8, 200_000, 2)
    assert 8 * (bm * bk + bk * bn + 2 * bm * bn) <= 200_000
    assert product_blocks(8192, 8192, 8192, 8, 3e9, 2) == (4096, 8192, 4096)


def test_a_product_whose_tiles_would_stay_on_the_lab_is_one_lab_task():
    """max-share cuts a product of lab arrays into tiles a volunteer may see; tiles that small fail the
    placement rule, so every one would run on the lab: the lab computes the product whole instead."""
    a, b = RNG.standard_normal((256, 64)), RNG.standard_normal((64, 256))
    z = ga.from_array(a) @ ga.from_array(b)  # lab arrays: a volunteer's tile holds at most 4096 of each
    steps = [v for v in dict(z.__dask_graph__()).values() if isinstance(v, CatalogTask) and v.op.name.startswith("matmul")]
    assert len(steps) == 1 and steps[0].placement == "lab"
    close(ev(z), a @ b)
    with dask.config.set({"goblin.placement.min-product-intensity": 1}):  # the same tiles, now worth a volunteer
        z = ga.from_array(a) @ ga.from_array(b)
    steps = [v for v in dict(z.__dask_graph__()).values() if isinstance(v, CatalogTask) and v.op.name.startswith("matmul")]
    assert len(steps) > 1 and {v.placement for v in steps} == {"volunteer"}
    close(ev(z), a @ b)


def test_matmul_add_folds_the_bias_into_each_blocks_first_step():
    from collections import Counter

    from goblin_dask.array.linalg import matmul_add

    a, b, bias = RNG.standard_normal((300, 500)), RNG.standard_normal((500, 200)), RNG.standard_normal(200)
    # k split: a chain per output block (volunteer tiles, as above)
    with dask.config.set({"goblin.product.volunteer-memory": 800_000, "goblin.placement.min-product-intensity": 1}):
        z = matmul_add(ga.from_array(a), ga.from_array(b), ga.from_array(bias, chunks=70))
    ops = Counter(v.op.name for v in dict(z.__dask_graph__()).values() if isinstance(v, CatalogTask))
    assert "add" not in ops and "matmul" not in ops and ops["matmul_accumulate"] >= 2, ops
    close(ev(z), a @ b + bias)
    # not a bias row of b's width (a full matrix, a wider dtype): the product, then an add, as NumPy
    full = RNG.standard_normal((300, 200))
    close(ev(matmul_add(ga.from_array(a), ga.from_array(b), ga.from_array(full))), a @ b + full)
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    wide = matmul_add(ga.from_array(a32), ga.from_array(b32), ga.from_array(bias))
    assert wide.dtype == np.float64
    close(ev(wide), (a32 @ b32).astype(np.float64) + bias, rtol=1e-5, atol=1e-4)


def test_tensordot_einsum_dot():
    a, b = RNG.standard_normal((4, 5, 6)), RNG.standard_normal((6, 5, 3))
    x, y = ga.from_array(a, chunks=(3, 2, 4)), ga.from_array(b, chunks=(4, 5, 2))
    close(ev(ga.tensordot(x, y, axes=((1, 2), (1, 0)))), np.tensordot(a, b, axes=((1, 2), (1, 0))))
    close(ev(np.tensordot(x, y, axes=1)), np.tensordot(a, b, axes=1))
    m, n = RNG.standard_normal((5, 4)), RNG.standard_normal((4, 3))
    xm, xn = ga.from_array(m, chunks=2), ga.from_array(n, chunks=3)
    for sub, ops in (("ij,jk->ik", (m, n)), ("ij,jk->ki", (m, n)), ("ij->ji", (m,)), ("ij->i", (m,)),
                     ("ij,kj->ik", (m, n.T.copy()))):
        gops = [ga.from_array(o, chunks=2) for o in ops]
        close(ev(ga.einsum(sub, *gops)), np.einsum(sub, *ops))
    close(ev(xm.dot(xn)), m.dot(n))
    with pytest.raises(ValueError):
        ga.tensordot(x, y, axes=((0,), (0,)))


@pytest.mark.parametrize("index", [
    (slice(1, 6), slice(None, None, 2)), (slice(None, None, -1), 3), (-1,), (Ellipsis, 1), (None, slice(2, 3), None),
    (slice(8, 1, -3), slice(-2, None)), (slice(5, 2), slice(None)), (2, -3), (slice(None), None, slice(1, None, 4)),
])
def test_getitem(index):
    a = RNG.standard_normal((9, 7))
    x = ga.from_array(a, chunks=(4, 3))
    close(ev(x[index]), a[index])


def test_layout_ops():
    a = RNG.standard_normal((6, 4, 5))
    x = ga.from_array(a, chunks=(4, 3, 2))
    close(ev(x.T), a.T)
    close(ev(x.transpose(1, 0, 2)), a.transpose(1, 0, 2))
    close(ev(np.transpose(x, (2, 0, 1))), np.transpose(a, (2, 0, 1)))
    for shape in [(24, 5), (6, 20), (120,), (2, 3, 4, 5), (-1, 10), (6, 4, 5, 1)]:
        close(ev(x.reshape(shape)), a.reshape(shape))
    close(ev(ga.concatenate([x, x[:2]], axis=0)), np.concatenate([a, a[:2]], axis=0))
    close(ev(ga.concatenate([x, ga.from_array(a[:, :, :1], chunks=1)], axis=-1)), np.concatenate([a, a[:, :, :1]], axis=-1))
    close(ev(ga.stack([x, x + 1], axis=1)), np.stack([a, a + 1], axis=1))
    close(ev(ga.squeeze(x[:, :1], 1)), a[:, 0])
    close(ev(ga.expand_dims(x, (0, 3))), np.expand_dims(a, (0, 3)))
    close(ev(ga.broadcast_to(ga.from_array(a[:1, :, :1]), (3, 4, 5))), np.broadcast_to(a[:1, :, :1], (3, 4, 5)))
    close(ev(ga.moveaxis(x, 0, -1)), np.moveaxis(a, 0, -1))
    mixed = ga.concatenate([ga.from_array(a[:, :, :2].astype(np.float32)), x[:, :, 2:]], axis=2)
    assert mixed.dtype == np.float64


def test_rechunk_keeps_values():
    a = RNG.standard_normal((10, 9))
    x = ga.from_array(a, chunks=(3, 4)) + 0  # not source-backed: a real rechunk
    for chunks in [(5, 9), (1, 2), ((4, 6), (2, 2, 5)), (10, 1), "auto"]:
        y = x.rechunk(chunks)
        close(ev(y), a + 0)
    assert x.rechunk((5, 3)).chunks == ((5, 5), (3, 3, 3))
    src = ga.from_array(a, chunks=3).rechunk(5)  # cut again at the source
    assert all(not isinstance(v, CatalogTask) for v in dict(src.__dask_graph__()).values())


def test_creation():
    close(ev(ga.zeros((5, 3), chunks=2)), np.zeros((5, 3)))
    close(ev(ga.ones((4,), dtype="int16", chunks=3)), np.ones(4, np.int16))
    close(ev(ga.full((3, 4), 2.5, chunks=(2, 3))), np.full((3, 4), 2.5))
    for args in [(10,), (2, 17, 3), (5.0, -3.0, -0.7), (0, 1, 0.1)]:
        close(ev(ga.arange(*args, chunks=3)), np.arange(*args), rtol=1e-12, atol=1e-12)
        assert ga.arange(*args).dtype == np.arange(*args).dtype
    for k in (-2, 0, 3):
        close(ev(ga.eye(6, 7, k=k, chunks=(4, 3))), np.eye(6, 7, k=k))


def test_random_is_deterministic_per_seed_and_well_distributed():
    x = ga.random.standard_normal((400, 300), chunks=(100, 150), seed=5)
    a, b = ev(x), ev(ga.random.standard_normal((400, 300), chunks=(100, 150), seed=5))
    assert (a == b).all() and not (a == ev(ga.random.standard_normal((400, 300), chunks=(100, 150), seed=6))).all()
    assert abs(a.mean()) < 0.02 and abs(a.std() - 1) < 0.02
    blocks = {a[i:i + 100, j:j + 150].tobytes() for i in range(0, 400, 100) for j in range(0, 300, 150)}
    assert len(blocks) == 8  # every block has its own stream
    u = ev(ga.random.uniform(-2, 3, size=(1000,), chunks=300, seed=1))
    assert u.min() >= -2 and u.max() < 3 and abs(u.mean() - 0.5) < 0.15
    graph = dict(x.__dask_graph__())
    assert all(isinstance(v, CatalogTask) and v.placement == "volunteer" for v in graph.values())


def test_formula():
    a, b = RNG.standard_normal((8, 6)), RNG.uniform(0, 2, (6,))
    x, y = ga.from_array(a, chunks=(3, 4)), ga.from_array(b, chunks=4)
    got = ev(ga.formula("a * exp(-b) + c", a=x, b=y, c=2.0))
    close(got, a * np.exp(-b) + 2.0)
    task = next(v for v in dict(ga.formula("alpha * beta", alpha=x, beta=y).__dask_graph__()).values()
                if isinstance(v, CatalogTask) and v.op.name == "formula")
    assert "alpha" not in task.kwargs["expr"] and "x0" in task.kwargs["expr"]


def test_memmap_blocks_are_read_on_the_lab_side(tmp_path):
    path = tmp_path / "data.f8"
    a = RNG.standard_normal((50, 40))
    mm = np.memmap(path, dtype="f8", mode="w+", shape=a.shape)
    mm[:] = a
    mm.flush()
    x = ga.from_array(np.memmap(path, dtype="f8", mode="r", shape=a.shape), chunks=(20, 15))
    graph = dict(x.__dask_graph__())
    assert not any(isinstance(v, np.ndarray) or getattr(v, "value", None) is not None for v in graph.values())
    close(ev(x.T @ x), a.T @ a)
    close(ev(x.rechunk((25, 40)).sum(axis=0)), a.sum(axis=0))


def test_a_file_rewritten_in_place_is_another_array_and_its_old_blocks_are_not_served(tmp_path):
    """Same size, mtime put back: the ctime still tells, so the new content gets a new key (a volunteer's
    cached panel of the old one is never taken for it), and the old array's blocks refuse to read it."""
    import os

    path = tmp_path / "data.f8"
    a = RNG.standard_normal((30, 20))
    a.tofile(path)
    before = os.stat(path)
    old = ga.from_array(np.memmap(path, dtype="f8", mode="r", shape=a.shape), chunks=10)
    close(ev(old.sum(axis=0)), a.sum(axis=0))
    b = a[::-1].copy()
    b.tofile(path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_size == before.st_size and os.stat(path).st_mtime_ns == before.st_mtime_ns
    new = ga.from_array(np.memmap(path, dtype="f8", mode="r", shape=a.shape), chunks=10)
    assert new.name != old.name and new._source.token != old._source.token
    close(ev(new[:5]), b[:5])
    with pytest.raises(RuntimeError, match="changed after from_array read it"):
        ev(old.sum(axis=0))


def test_dask_protocol():
    from dask._task_spec import Alias, DataNode, Task

    a = RNG.standard_normal((6, 6))
    x = ga.from_array(a, chunks=4)
    s, p = dask.compute(x.sum(), x @ x, scheduler="sync")
    close(np.asarray(s), a.sum())
    close(p, a @ a)
    (y,) = dask.persist(x * 2, scheduler="sync")
    close(ev(y + 1), a * 2 + 1)
    assert dask.base.tokenize(x + 1) == dask.base.tokenize(x + 1)
    z = (x @ x).sum(axis=0)
    optimized = Array_optimize(z)
    for key, node in optimized.items():
        assert isinstance(node, (CatalogTask, DataNode, Alias, Task)) and not getattr(node, "has_subgraph", lambda: False)(), key
        assert not isinstance(node, Task) or isinstance(node, CatalogTask) or node.func.__module__.startswith("goblin_dask")


def Array_optimize(z):
    return z.__dask_optimize__(dict(z.__dask_graph__()), z.__dask_keys__())


def test_keys_are_opaque_even_for_named_xarray_data():
    import xarray as xr

    da = xr.DataArray(RNG.standard_normal((4, 3)), dims=("patient", "visit"), name="secret_measure",
                      attrs={"units": "mmHg"})
    g = ga.from_array(da, chunks={"patient": 2})
    text = repr(list(dict(g.data.__dask_graph__()).keys()))
    assert "secret" not in text and "patient" not in text and "mmHg" not in text
    assert g.data.chunks == ((2, 2), (3,))


def test_xarray_round_trip():
    import xarray as xr

    a = RNG.standard_normal((6, 4, 5))
    ds = xr.Dataset({"t": (("time", "lat", "lon"), a), "label": ("time", np.array(list("abcdef")))},
                    coords={"time": np.arange(6), "lat": np.linspace(-1, 1, 4)}, attrs={"title": "x"})
    g = ga.from_array(ds, chunks={"time": 4, "lon": 2})
    assert isinstance(g.t.data, ga.Array) and isinstance(g.label.data, np.ndarray) and g.attrs == ds.attrs
    with dask.config.set(scheduler="sync"):
        close(g.t.mean("time").compute().values, a.mean(axis=0))
        close((g.t * 2 + 1).sum(("lat", "lon")).compute().values, (a * 2 + 1).sum(axis=(1, 2)))
        close(g.t.std("lon").values, a.std(axis=2))
        close(g.t.max().values, a.max())
        close(g.t.isel(time=slice(1, 5), lon=0).compute().values, a[1:5, :, 0])
        close(g.t.transpose("lon", "time", "lat").values, a.transpose(2, 0, 1))
        close(xr.concat([g.t, g.t], dim="time").values, np.concatenate([a, a]))
        close(g.t.where(g.t > 0).sum("time").values, np.where(a > 0, a, 0).sum(axis=0))
        m = ga.from_array(xr.DataArray(a[0], dims=("lat", "lon")), chunks=2)
        n = ga.from_array(xr.DataArray(a[1].T, dims=("lon", "k")), chunks=3)
        close((m @ n).values, a[0] @ a[1].T)
        close(xr.dot(m, n, dim="lon").values, a[0] @ a[1].T)
        computed = g.compute()
    assert isinstance(computed.t.data, np.ndarray)
    xr.testing.assert_allclose(computed, ds)


# -- the API is the catalog's -------------------------------------------------------------------

OPERATOR_OPS = sorted(n for n, s in catalog().items() if s.operator is not None)


def _dunder(python_operator) -> str:
    return f"__{python_operator.__name__.strip('_')}__"


@pytest.mark.parametrize("name", OPERATOR_OPS)
def test_every_catalog_operator_is_a_written_out_dunder_of_ga_array(name):
    import inspect
    import operator

    spec = catalog()[name]
    py = spec.operator
    method = inspect.getattr_static(ga.Array, _dunder(py))
    assert getattr(method, "__module__", None) == "goblin_dask.array.core", (name, method)
    if spec.elementwise is None:  # matmul: the blocked product
        arrays = [RNG.standard_normal((5, 4)), RNG.standard_normal((4, 3))]
        chunks = [(2, 3), (3, 1)]
    else:
        dt = "float64" if computes_on(spec, "float64") else "int64"
        shapes, chunks = [(7, 5), (5,)][: spec.arity], [(3, 2), (2,)][: spec.arity]
        arrays = [draw(spec, i, s, dt, RNG) for i, s in enumerate(shapes)]
    gas = [ga.from_array(a, chunks=c) for a, c in zip(arrays, chunks)]
    with np.errstate(all="ignore"):
        want, got = py(*arrays), ev(py(*gas))
        assert got.dtype == want.dtype
        close(got, want, rtol=1e-12)
        if len(arrays) == 2:  # the reflected form (or, for comparisons, Python's swapped one)
            left = arrays[0].tolist() if spec.elementwise is None else arrays[0].flat[0].item()
            want, got = py(left, arrays[1]), ev(py(left, gas[1]))
            assert got.dtype == np.asarray(want).dtype
            close(got, want, rtol=1e-12)
    if len(arrays) == 2 and py not in (operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge):
        reflected = inspect.getattr_static(ga.Array, _dunder(py).replace("__", "__r", 1))
        assert reflected.__module__ == "goblin_dask.array.core"


def test_ga_array_operators_are_only_the_catalogs():
    import operator

    x = ga.from_array(np.arange(6.0).reshape(2, 3), chunks=2)
    with pytest.raises(TypeError, match="unsupported operand"):
        divmod(x, 2)  # no catalog op declares divmod
    with pytest.raises(TypeError):
        x + "text"  # not an operand: NotImplemented, then Python's TypeError
    declared = {s.operator for s in catalog().values() if s.operator is not None}
    assert operator.add in declared and operator.matmul in declared


@pytest.mark.parametrize("op", sorted(__import__("goblin_dask.array.numpy_api", fromlist=["BLOCKED"]).BLOCKED))
def test_catalog_hook_computes_every_blocked_op_like_its_numpy_kernel(op):
    spec = catalog()[op]
    for operands, params in spec.examples(5, np.random.default_rng(7), "float64"):
        arrays = [ga.from_array(o, chunks=2) if isinstance(o, np.ndarray) else o for o in operands]
        x = next(a for a in arrays if isinstance(a, ga.Array))
        got, want = ev(x._catalog(op, *arrays, **params)), np.asarray(spec.numpy(*operands, **params))
        assert got.dtype == want.dtype, params
        close(got, want, rtol=1e-12)


def _ufunc_definition(name: str) -> str:
    """What ``goblin_dask/array/ufuncs.py`` has for an elementwise op (printed when one is missing)."""
    spec = catalog()[name]
    params = ", ".join({1: ("x",), 2: ("x1", "x2")}.get(spec.arity, tuple(f"x{i + 1}" for i in range(spec.arity))))
    return f'def {name}({params}, /) -> Array:\n    """{spec.doc}"""\n    return elementwise("{name}", {params})\n'


def test_ufuncs_module_lists_exactly_the_catalogs_elementwise_ops_and_aliases():
    import inspect

    from goblin_dask.array import ufuncs
    from goblin_dask.ops.registry import aliases

    ops = {n for n, s in catalog().items() if s.elementwise is not None}
    declared = {alias: name for alias, name in aliases().items() if name in ops}
    missing, extra = sorted(ops - set(ufuncs.__all__)), sorted(set(ufuncs.__all__) - ops - set(declared))
    assert not missing, "add to goblin_dask/array/ufuncs.py:\n\n" + "\n\n".join(_ufunc_definition(n) for n in missing)
    assert not extra, f"not elementwise catalog ops nor their aliases: {extra}"
    assert set(declared) <= set(ufuncs.__all__), sorted(set(declared) - set(ufuncs.__all__))
    source = inspect.getsource(ufuncs)
    for name in ops:
        f = getattr(ga, name)
        assert f is getattr(ufuncs, name) and f.__name__ == name, name
        assert f"def {name}(" in source or name in ("where", "clip"), f"{name} is not written out"
        if name not in ("where", "clip"):  # written in core.py, with NumPy's optional arguments
            assert f.__doc__ == catalog()[name].doc, name
            assert len(inspect.signature(f).parameters) == catalog()[name].arity, name
    for alias, name in declared.items():
        assert getattr(ga, alias) is getattr(ga, name), alias


def test_numpy_dispatch_is_declared_at_the_definitions():
    from goblin_dask.array import numpy_api
    from goblin_dask.ops.registry import aliases

    for func, impl in numpy_api.HANDLED.items():
        assert impl.__module__.startswith("goblin_dask.array."), (func, impl)
        assert getattr(impl.__module__ and __import__(impl.__module__, fromlist=["_"]), impl.__name__) is impl, impl
    assert numpy_api.HANDLED[np.sum] is ga.sum and numpy_api.HANDLED[np.nanvar] is ga.nanvar
    a = RNG.uniform(0.5, 2.0, (5, 4))
    x = ga.from_array(a, chunks=2)
    for alias, name in aliases().items():  # NumPy's ufuncs by their other names: np.abs, np.true_divide ...
        ufunc = getattr(np, alias, None)
        if isinstance(ufunc, np.ufunc) and catalog()[name].arity == 2:
            close(ev(ufunc(x, x + 1)), ufunc(a, a + 1))
        elif isinstance(ufunc, np.ufunc) and catalog()[name].elementwise.loop is not None and name != "invert":
            close(ev(ufunc(x)), ufunc(a))
    assert (ev(np.bitwise_not(x > 1)) == np.bitwise_not(a > 1)).all()
    with pytest.raises(TypeError, match="conjugate"):
        np.conjugate(x)
    close(ev(np.ravel(x)), a.ravel())
    close(ev(np.var(x, axis=0, correction=1)), np.var(a, axis=0, correction=1))
    assert np.allclose(x, a) and np.array_equal(x, a) and not np.array_equal(x, a + 1)
    close(ev(np.concatenate([x, x], axis=1, dtype=np.float32)), np.concatenate([a, a], axis=1, dtype=np.float32),
          rtol=1e-6)
    close(ev(np.zeros_like(x, shape=(3,))), np.zeros(3))


def test_unknown_keywords_are_type_errors_naming_them():
    import inspect

    x = ga.from_array(np.ones((4, 3)), chunks=2)
    calls = {
        "keepdim": [lambda: ga.sum(x, axis=0, keepdim=True), lambda: x.sum(axis=0, keepdim=True),
                    lambda: x.mean(keepdim=True), lambda: ga.nanvar(x, keepdim=True)],
        "out": [lambda: ga.exp(x, out=x), lambda: np.sum(x, out=np.empty(3)), lambda: x.max(out=x),
                lambda: ga.concatenate([x, x], out=x), lambda: np.dot(x, x.T, out=np.empty((4, 4)))],
        "initial": [lambda: ga.sum(x, initial=1)],
        "where": [lambda: x.all(where=x > 0)],
        "mean": [lambda: ga.var(x, mean=x.mean(axis=0))],
        "order": [lambda: ga.zeros((2,), order="F"), lambda: x.reshape(12, order="F"), lambda: ga.ravel(x, order="F")],
        "dtype": [lambda: ga.einsum("ij->ji", x, dtype="float32")],
        "chunk": [lambda: x.rechunk(chunk=2), lambda: ga.from_array(np.ones(3), chunk=2)],
        "axes": [lambda: ga.elementwise("exp", x, axes=0)],  # an op's parameters are the op's to refuse
    }
    for keyword, fns in calls.items():
        for f in fns:
            with pytest.raises(TypeError, match=f"'{keyword}'"):
                f()
    assert ga.sum(x, axis=0, keepdims=True).shape == (1, 3)
    # nothing swallows keywords: only formula's variables and an op's parameters (checked by the op) are free-form
    for name in ga.__all__:
        f = getattr(ga, name)
        if callable(f) and not isinstance(f, type) and name not in ("formula", "elementwise"):
            kinds = [p.kind for p in inspect.signature(f).parameters.values()]
            assert inspect.Parameter.VAR_KEYWORD not in kinds, name
    for name, member in vars(ga.Array).items():
        if callable(member) and not name.startswith("__dask"):
            kinds = [p.kind for p in inspect.signature(member).parameters.values()]
            assert inspect.Parameter.VAR_KEYWORD not in kinds or name in ("__array_ufunc__", "_catalog"), name


def test_help_lists_the_methods_and_signatures_are_real():
    import inspect
    import pydoc

    text = pydoc.render_doc(ga.Array, renderer=pydoc.plaintext)
    for method in ("sum(self, axis=None, dtype=None, out=None, keepdims=False", "__add__(self, other)", "__matmul__",
                   "var(self, axis=None", "argmax(self, axis=None, out=None, *, keepdims=False)", "astype(self, dtype"):
        assert method in text, method
    assert list(inspect.signature(ga.sum).parameters)[:5] == ["a", "axis", "dtype", "out", "keepdims"]
    assert "x1" in inspect.signature(ga.add).parameters


def test_formula_ignores_variables_it_does_not_use():
    a, b = RNG.standard_normal((5, 4)), RNG.standard_normal((5, 4))
    x, y = ga.from_array(a, chunks=2), ga.from_array(b, chunks=2)
    z = ga.formula("a * 2 + exp(a)", a=x, b=y, unused_scale=3.0)
    close(ev(z), a * 2 + np.exp(a))
    tasks = [v for v in dict(z.__dask_graph__()).values() if isinstance(v, CatalogTask) and v.op.name == "formula"]
    assert tasks and all(len(t.args) == 1 for t in tasks)  # y never reaches the task
    assert y.name not in repr(dict(z.__dask_graph__()).keys())
    close(ev(ga.formula("text + 1", text=x)), a + 1)  # the expression's own parameter is positional-only
    with pytest.raises(ValueError, match="uses none"):
        ga.formula("2 + 3", a=x)
