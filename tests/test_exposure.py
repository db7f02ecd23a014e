"""What a volunteer may learn: the per-task cap (max-share) and the account of exposure."""

from __future__ import annotations

import numpy as np
import pytest

from goblin_dask.array.linalg import product_blocks, share_limits
from scheduler_plugins.exposure import Coverage, _getitem, _transform


# -- block sizing under the cap -------------------------------------------------------------------

def _task_elements(bm, bk, bn, limits):
    return [ia * bm * bk + ib * bk * bn for ia, ib, _ in limits]


@pytest.mark.parametrize("m,k,n,workers,budget", [
    (1024, 2048, 1024, 1, 1e12),     # the issue's A.T @ A, one volunteer, plenty of memory
    (1024, 2048, 1024, 2, 1e12),
    (256, 384, 256, 2, 2**19),       # memory-bound and capped
    (100, 100, 100, 4, 1e12),
    (4096, 64, 4096, 8, 1e12),       # outer-product shaped
])
def test_product_blocks_respect_max_share(m, k, n, workers, budget):
    same = [(True, True, 0.25 * m * k)]                       # A.T @ A: both panels from one array
    apart = [(True, False, 0.25 * m * k), (False, True, 0.25 * k * n)]
    for limits in (same, apart):
        bm, bk, bn = product_blocks(m, k, n, 8, budget, workers, limits)
        assert 1 <= bm <= m and 1 <= bk <= k and 1 <= bn <= n
        for used, (_, _, cap) in zip(_task_elements(bm, bk, bn, limits), limits):
            assert used <= cap, (m, k, n, bm, bk, bn, limits)
    # no limits: as before
    assert product_blocks(m, k, n, 8, budget, workers) == product_blocks(m, k, n, 8, budget, workers, ())


def test_issue_case_cuts_the_inner_axis_first():
    # whole-array panels before; now a chain of 256-row steps, output block kept whole
    assert product_blocks(1024, 2048, 1024, 8, 1e12, 1) == (1024, 2048, 1024)
    assert product_blocks(1024, 2048, 1024, 8, 1e12, 1, [(True, True, 2048 * 1024 / 4)]) == (1024, 256, 1024)


def test_capped_weights_cut_the_output_not_the_inner_axis():
    """``activations @ weights`` with the weights capped: disjoint output blocks, each checked once,
    rather than a chain whose full-size partial sums travel out and back at every step."""
    from goblin_dask.array.linalg import _elements_moved

    for (m, k, n) in ((2048, 256, 768), (2048, 1024, 256), (4096, 512, 2048)):
        limits = [(False, True, 0.25 * k * n)]
        bm, bk, bn = product_blocks(m, k, n, 4, 1e12, 2, limits)
        assert bk == k and bk * bn <= 0.25 * k * n, (m, k, n, bm, bk, bn)
        chain = (bm, k // 4, n)
        assert _elements_moved(m, k, n, (bm, bk, bn), 2) < _elements_moved(m, k, n, chain, 2)


def test_share_limits_follow_the_lab_arrays():
    import dask

    with dask.config.set({"goblin.minimization.small-array": 0}):  # these arrays are small
        _share_limits_follow_the_lab_arrays()


def _share_limits_follow_the_lab_arrays():
    import dask

    import goblin_dask.array as ga

    rng = np.random.default_rng(0)
    a = ga.from_array(rng.standard_normal((64, 32)), chunks=16)
    b = ga.from_array(rng.standard_normal((32, 8)), chunks=16)
    (lim,) = share_limits(a.T, a)
    assert lim == (True, True, 0.25 * 64 * 32)
    assert sorted(share_limits(a, b)) == sorted([(True, False, 512.0), (False, True, 64.0)])
    assert share_limits(a.T @ a, a.T @ a) == ()                      # products are aggregates: not counted
    assert share_limits((a - a.mean(axis=0)).T, b)[0][:2] == (True, False)  # elementwise results are
    with dask.config.set({"goblin.minimization.max-share": 1.0}):
        assert share_limits(a.T, a) == ()
    # the same data cut in other blocks is the same lab array
    assert share_limits(a.rechunk(8).T, a) == share_limits(a.T, a)


def test_a_small_broadcast_array_does_not_shrink_products():
    """A vector of column means (a lab array of its own once it is NumPy) sits in every block of
    ``x - mean``: capping it would cut the product into 1x1 tasks; small arrays are exempt."""
    import goblin_dask.array as ga
    from goblin_dask.array.sources import lab_arrays

    rng = np.random.default_rng(1)
    heart = rng.standard_normal((384, 256))
    x = ga.from_array(heart, chunks=128)
    mean = ga.from_array(heart.mean(axis=0), chunks=128)
    centered = x - mean
    assert len(lab_arrays(centered)) == 2
    assert [lim[2] for lim in share_limits(centered.T, centered)] == [0.25 * heart.size]
    cov = centered.T @ centered
    assert min(min(c) for c in cov.chunks) >= 64, cov.chunks
    np.testing.assert_allclose(cov.compute(scheduler="sync"), (heart - heart.mean(0)).T @ (heart - heart.mean(0)),
                               rtol=1e-10)


# -- the scheduler's bookkeeping -----------------------------------------------------------------

def test_coverage_counts_distinct_elements():
    cov = Coverage((8, 4))
    cov.add(((0, 4), (0, 4)))
    cov.add(((0, 4), (0, 4)))          # the same block twice: counted once
    assert cov.covered() == 16
    cov.add(((2, 6), (1, 3)))          # overlapping
    assert cov.covered() == 16 + 4
    cov.add(((0, 8), (0, 4)))
    assert cov.covered() == 32 == cov.size
    scalar = Coverage(())
    scalar.add(())
    assert scalar.covered() == 1


def test_lineage_through_layout_ops():
    piece = ("a0", ((256, 512), (0, 256)), (0, 1))                    # block (1, 0) of a 256-chunked array
    (t,) = _transform("transpose", {"axes": (1, 0)}, (piece,), single=True)
    assert t == ("a0", ((256, 512), (0, 256)), (1, 0))
    (g,) = _transform("getitem", {"index": (slice(0, 96), slice(10, 20))}, (t,), single=True)
    assert g == ("a0", ((266, 276), (0, 96)), (1, 0))                 # rows of A.T are columns of A
    (row,) = _transform("getitem", {"index": (3, slice(None))}, (piece,), single=True)
    assert row == ("a0", ((259, 260), (0, 256)), (1,))
    # several operands, reshape, concatenate: the box is kept, the axes are not
    assert _transform("concatenate", {"axis": 0}, (piece, t), single=False)[0][2] is None
    assert _transform("reshape", {"shape": (65536,)}, (piece,), single=True)[0][2] is None
    assert _getitem(("a0", ((0, 4), (0, 4)), None), (slice(0, 1), slice(0, 1)))[1] == ((0, 4), (0, 4))


# -- on a real grid ----------------------------------------------------------------------------

def _messages(path) -> list[bytes]:
    data, out, at = path.read_bytes(), [], 0
    while at + 8 <= len(data):
        n = int.from_bytes(data[at:at + 8], "little")
        out.append(data[at + 8:at + 8 + n])
        at += 8 + n
    return out


def test_gram_of_a_lab_array_sends_no_volunteer_more_than_a_quarter(tmp_path):
    import dask

    import goblin_dask.array as ga
    from goblin_dask.array.sources import lab_arrays
    from goblin_dask.node.local import LabNode
    from tests.test_minimization import _pieces

    rng = np.random.default_rng(20261203)
    a = rng.standard_normal((2048, 1024))
    with LabNode.local(volunteers=0, state_dir=tmp_path / "lab", dashboard=False) as node, node.client.as_current():
        curious = node.add_volunteer(module="tests.curious")
        pid = node.processes[curious].pid
        x = ga.from_array(a, chunks=(256, 256))
        (aid,) = lab_arrays(x)
        got = dask.compute(x.T @ x)[0]
        report = node.report()

    np.testing.assert_allclose(got, a.T @ a, rtol=1e-10, atol=1e-9)
    mine = report["volunteers"][curious]
    assert mine["accepted"] >= 2 and mine["rejected"] == 0, report  # the volunteer did the products
    quarter = a.size // 4
    messages = _messages(node.state_dir / f"messages-{pid}.bin")
    per_message = [_pieces(m, a)["distinct"] for m in messages if len(m) >= 8 * 1024]
    assert max(per_message) > 0, "the volunteer never received the data it computed on?"
    assert max(per_message) <= quarter, per_message
    # the account: what the recorder saw, as a fraction of A
    seen = _pieces((node.state_dir / f"received-{pid}.bin").read_bytes(), a)["distinct"] / a.size
    assert set(report["exposure"]) == {curious}
    assert set(report["exposure"][curious]) == {aid}
    assert report["exposure"][curious][aid] == pytest.approx(seen, abs=1e-9)
    assert seen > 0.25  # over many tasks it learnt more than one task may send: that is what the account is for


def test_max_exposure_spreads_blocks_over_volunteers(tmp_path, monkeypatch):
    import dask

    import goblin_dask.array as ga
    from goblin_dask.array.sources import lab_arrays
    from goblin_dask.node.local import LabNode

    rng = np.random.default_rng(7)
    a = rng.standard_normal((512, 256))
    monkeypatch.setenv("DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING", "False")
    with dask.config.set({"goblin.minimization.max-exposure": 0.6}), \
            LabNode.local(volunteers=2, state_dir=tmp_path / "lab", dashboard=False) as node, \
            node.client.as_current():
        x = ga.from_array(a, chunks=128)
        (aid,) = lab_arrays(x)
        got = dask.compute(x.T @ x)[0]
        report = node.report()
    np.testing.assert_allclose(got, a.T @ a, rtol=1e-10, atol=1e-9)
    exposure = report["exposure"]
    assert len(exposure) == 2, report  # both volunteers got blocks
    for name, arrays in exposure.items():
        assert 0 < arrays[aid] <= 0.6 + 1e-12, exposure
        assert report["volunteers"][name]["rejected"] == 0
    assert report["accepted"] >= 2


def test_a_task_reissued_at_its_deadline_stays_within_max_exposure(tmp_path, monkeypatch):
    """Issue 29: a deadline reissue restricted the task to every other volunteer, replacing the exposure plan's
    pin, so the volunteer left took the holder's blocks too (0.75 of an array under a 0.5 cap).  Now the
    reissued task is pinned again within the cap, or the lab computes it."""
    import dask

    import goblin_dask.array as ga
    from goblin_dask.array.sources import lab_arrays
    from goblin_dask.node.local import LabNode

    rng = np.random.default_rng(8)
    a = rng.standard_normal((512, 256))
    cap = 0.5
    monkeypatch.setenv("DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING", "False")
    with dask.config.set({"goblin.minimization.max-exposure": cap, "goblin.verification.deadline": 2.0}), \
            LabNode.local(volunteers=1, state_dir=tmp_path / "lab", dashboard=False) as node, \
            node.client.as_current():
        [honest] = node.volunteer_names()
        holder = node.add_volunteer(module="tests.hostile", extra_args=("--attack", "hold", "--keep", "64"))
        x = ga.from_array(a, chunks=128)
        (aid,) = lab_arrays(x)
        got = dask.compute(x.T @ x)[0]
        report = node.report()
    np.testing.assert_allclose(got, a.T @ a, rtol=1e-10, atol=1e-9)
    assert report["reissued"] >= 1 and report["volunteers"][holder]["late"] >= 1, report["volunteers"]
    exposure = report["exposure"]
    assert exposure.get(holder, {}).get(aid, 0) > 0, exposure  # it was given blocks (and held them)
    for name, arrays in exposure.items():
        assert arrays[aid] <= cap + 1e-12, exposure
