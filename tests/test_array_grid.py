"""ga.Array on the embedded grid: volunteers compute the products, the lab checks them."""

from __future__ import annotations

import numpy as np
import pytest

import dask
import goblin_dask.array as ga
from goblin_dask.node.local import LabNode
from goblin_dask.ops import CatalogTask

RNG = np.random.default_rng(7)


def accepted(node) -> int:
    return node.report()["accepted"]


def test_a_product_is_computed_by_volunteers_and_verified(lab):
    a, b = RNG.standard_normal((600, 400)), RNG.standard_normal((400, 500))
    before = lab.report()
    z = ga.from_array(a, chunks=200) @ ga.from_array(b, chunks=(200, 250))
    got = z.compute()
    np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-10)
    after = lab.report()
    assert after["accepted"] > before["accepted"]
    assert after["by_method"].get("freivalds", 0) > before["by_method"].get("freivalds", 0)
    assert sum(v["accepted"] for v in after["volunteers"].values()) > sum(v["accepted"] for v in before["volunteers"].values())


def test_placement_puts_products_on_volunteers_and_cheap_steps_on_the_lab(lab):
    x = ga.from_array(RNG.standard_normal((512, 512)), chunks=256)
    graph = dict(((x @ x) + 1).__dask_graph__())
    places = {(v.op.name, v.placement) for v in graph.values() if isinstance(v, CatalogTask)}
    assert ("matmul", "volunteer") in places and ("add", "lab") in places


def test_products_built_side_by_side_are_cut_for_fewer_volunteer_threads(lab):
    """Two volunteers: one product alone is cut into output tiles for both; under
    ``concurrent_products(2)`` (two built to run at once, as a Trainer's micro-batches) each is one
    task, its inputs sent once.  The results are the same product."""
    from goblin_dask.array.linalg import concurrent_products

    rng = np.random.default_rng(11)  # its own numbers: the module's RNG feeds the tests after it
    a, b = rng.standard_normal((512, 256)), rng.standard_normal((256, 384))

    def products(z):
        return [t for t in dict(z.__dask_graph__()).values()
                if isinstance(t, CatalogTask) and t.op.name.startswith("matmul")]

    with dask.config.set({"goblin.minimization.max-share": None}):  # tiles for the threads, not for a cap
        alone = ga.from_array(a) @ ga.from_array(b)
        with concurrent_products(2):
            together = ga.from_array(a) @ ga.from_array(b)
    assert len(products(alone)) >= 2 and len(products(together)) == 1
    assert all(t.placement == "volunteer" for t in products(alone) + products(together))
    for z in (alone, together):
        np.testing.assert_allclose(z.compute(), a @ b, rtol=1e-12, atol=1e-10)
    with pytest.raises(ValueError, match="positive"), concurrent_products(0):
        pass


def test_a_graph_being_built_asks_the_lab_node_for_its_workers_once(lab, monkeypatch):
    from goblin_dask.array.linalg import one_reading_of_the_workers, volunteer_capacity

    calls = []
    real = type(lab.client).scheduler_info

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(lab.client), "scheduler_info", counted)
    with one_reading_of_the_workers():
        with one_reading_of_the_workers():  # an inner block (a captured graph inside a Trainer's round)
            seen = [volunteer_capacity() for _ in range(5)]
        seen.append(volunteer_capacity())
    assert len(calls) == 1 and seen == [seen[0]] * 6 and seen[0][1] == 2  # two one-thread volunteers
    volunteer_capacity()
    assert len(calls) == 2  # outside a block: asked each time


def test_persist_progress_and_futures(lab):
    from distributed import futures_of, progress, wait

    a = RNG.standard_normal((300, 300))
    x = ga.from_array(a, chunks=150)
    y = lab.client.persist(x @ x.T)
    progress(y, notebook=False)
    wait(futures_of(y))
    assert len(futures_of(y)) == y.npartitions
    np.testing.assert_allclose((y + 1).compute(), a @ a.T + 1, rtol=1e-12, atol=1e-10)
    s, m = dask.compute(y.sum(axis=0), y.max())
    np.testing.assert_allclose(s, (a @ a.T).sum(axis=0), rtol=1e-10, atol=1e-9)  # a column may sum to ~0
    np.testing.assert_allclose(m, (a @ a.T).max(), rtol=1e-12)


def test_random_blocks_are_generated_on_volunteers(lab):
    before = accepted(lab)
    x = ga.random.standard_normal((400, 400), chunks=200, seed=3)
    local = x.compute(scheduler="sync")
    on_grid = x.compute()
    np.testing.assert_array_equal(on_grid, local)  # same seed, same numbers, wherever they were generated
    assert accepted(lab) >= before + 4


def test_xarray_on_the_grid(lab):
    import xarray as xr

    a = RNG.standard_normal((8, 300, 200))
    da = xr.DataArray(a, dims=("time", "x", "y"), name="field")
    g = ga.from_array(da, chunks={"time": 4, "x": 150})
    mean = g.mean("time").compute()
    np.testing.assert_allclose(mean.values, a.mean(axis=0), rtol=1e-12, atol=1e-15)
    gram = xr.DataArray(g.data[0].T @ g.data[0], dims=("y", "y2")).compute()
    np.testing.assert_allclose(gram.values, a[0].T @ a[0], rtol=1e-12, atol=1e-10)


@pytest.mark.slow
def test_a_memmap_product_larger_than_the_lab_workers_memory(tmp_path):
    """A (8000 x 5000, 320 MB) streams from its file through a lab worker limited to 300 MB."""
    m, k, n = 8000, 5000, 400
    a_path = tmp_path / "a.f8"
    a = np.lib.format.open_memmap(a_path, mode="w+", dtype="f8", shape=(m, k))
    for i in range(0, m, 1000):
        a[i:i + 1000] = RNG.standard_normal((1000, k))
    a.flush()
    b = RNG.standard_normal((k, n))
    a_in = np.load(a_path, mmap_mode="r")
    assert a_in.nbytes > 300e6
    with LabNode.local(volunteers=2, state_dir=tmp_path / "lab", lab_memory_limit="300MB") as node, \
            dask.config.set({"goblin.product.volunteer-memory": "160MB"}):
        z = ga.from_array(a_in, chunks=(1000, 5000)) @ ga.from_array(b)
        col = z.sum(axis=0).compute()  # reduced on the lab side: the 32 MB product never gathers whole
        report = node.report()
    want = np.zeros(n)
    for i in range(0, m, 1000):
        want += (np.asarray(a_in[i:i + 1000]) @ b).sum(axis=0)
    np.testing.assert_allclose(col, want, rtol=1e-10, atol=1e-8)
    assert report["accepted"] > 0 and report["rejected"] == 0
