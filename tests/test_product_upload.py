"""What volunteers upload for a verified product: the result's bytes, not a chain's partial sums.

Issue 30 measured the 4096^2 float64 product with volunteers behind home links uploading twice its
result: max-share cut the inner axis in two, so each output block was a two-step chain whose first
partial sum went up to the lab (for its check) and down again.  The planner now cuts the output
instead when that moves less (:func:`goblin_dask.array.linalg._prefer_output_cut`); these tests count
the bytes the lab worker received from volunteers (distributed's own transfer log) on a real grid,
and check that a cheater is still caught, in an output-cut product and in a chain that remains.
"""

from __future__ import annotations

import numpy as np
import pytest

import goblin_dask.array as ga
from goblin_dask.array.linalg import _elements_moved, _inner_cut, _memory_blocks, product_blocks
from goblin_dask.node.local import LabNode
from tests.conftest import wait_for


def _apart(m: int, k: int, n: int) -> list:
    """max-share 1/4 of two distinct lab arrays, A (m x k) and B (k x n)."""
    return [(True, False, 0.25 * m * k), (False, True, 0.25 * k * n)]


@pytest.mark.parametrize("n", [1024, 2048, 4096])
def test_two_volunteers_get_whole_inner_axis_tiles(n):
    """The issue's case (two volunteer threads, two distinct arrays, memory to spare): each output
    block is one task, within max-share; the chain it replaces had two steps and moved more."""
    limits = _apart(n, n, n)
    bm, bk, bn = product_blocks(n, n, n, 8, 1e12, 2, limits)
    assert bk == n, (bm, bk, bn)
    assert bm * bk <= 0.25 * n * n and bk * bn <= 0.25 * n * n
    chain = _inner_cut(n, _memory_blocks(n, n, n, 8, 1e12, 2), limits)
    assert chain[1] < n  # what the planner did before: a chain along k
    assert _elements_moved(n, n, n, (bm, bk, bn), 2) < _elements_moved(n, n, n, chain, 2)


def test_a_gram_keeps_its_chain_when_an_output_cut_needs_many_more_tasks():
    """``A.T @ A`` with A capped: both panels come from one array, so an output cut would need 8x the
    chain's tasks (and checks): the chain stays (and what it uploads is its partial sums)."""
    assert product_blocks(1024, 2048, 1024, 8, 1e12, 1, [(True, True, 2048 * 1024 / 4)]) == (1024, 256, 1024)


def _received_from_volunteers(node) -> int:
    """Bytes the lab worker has fetched from volunteers so far (its transfer log: each volunteer result
    it read for a check)."""
    volunteers = set(node.volunteer_addresses().values())

    def count(dask_worker=None):
        return [(e.get("who"), int(e.get("total", 0))) for e in dask_worker.transfer_incoming_log]

    log = node.client.run(count, workers=[node.lab_worker_address()])[node.lab_worker_address()]
    return sum(total for who, total in log if who in volunteers)


def test_volunteers_upload_no_more_than_the_result(tmp_path):
    """On a real grid (lab node, TLS, two volunteer processes): the product equals numpy's, the
    volunteers computed it, and the bytes the lab received from them are at most the result's."""
    rng = np.random.default_rng(30)
    n = 1024
    a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    with LabNode.local(volunteers=2, state_dir=tmp_path / "lab", dashboard=False) as node, \
            node.client.as_current():
        x, y = ga.from_array(a), ga.from_array(b)
        product = x @ y
        chained = [k for k in dict(product.__dask_graph__()) if "partial" in str(k)]
        before = _received_from_volunteers(node)
        tasks_before = node.report()["tasks"]
        got = product.compute()
        after = _received_from_volunteers(node)
        report = node.report()
    np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-10)
    assert report["tasks"] - tasks_before >= 4 and report["rejected"] == 0, report  # volunteers did the work
    uploaded = after - before
    assert 0.5 * a.nbytes < uploaded <= a.nbytes, (uploaded, a.nbytes, len(chained))
    assert len(product.chunks[0]) > 1 and not chained  # output blocks cut, no chain along k


def _run_until_banned(node, cheater, make, rounds: int = 6):
    for seed in range(rounds):
        a, b, expr = make(np.random.default_rng(300 + seed))
        np.testing.assert_allclose(expr.compute(), a @ b, rtol=1e-10, atol=1e-9)
        if node.report()["volunteers"][cheater]["banned"]:
            return
    pytest.fail(f"the cheater was not banned after {rounds} products: {node.report()}")


@pytest.mark.parametrize("shape", ["output-cut", "chain"])
def test_a_cheater_is_caught_in_an_output_cut_product_and_in_a_chain(tmp_path, shape):
    """A volunteer that computes its first tasks honestly and then returns a block off by 1e-3 in one
    element: every answer equals numpy's, the cheater is banned, the honest volunteer never rejected.
    ``chain``: ``A.T @ A`` (the planner keeps a chain of matmul_accumulate steps), so the cheat lands
    on a chain step whose partial sum the next step reads only once the lab has accepted it."""
    def output_cut(rng):
        a, b = rng.standard_normal((512, 512)), rng.standard_normal((512, 512))
        return a, b, ga.from_array(a) @ ga.from_array(b)

    def chain(rng):
        x = rng.standard_normal((1024, 256))
        xx = ga.from_array(x)
        return x.T, x, xx.T @ xx

    make = output_cut if shape == "output-cut" else chain
    with LabNode.local(volunteers=1, state_dir=tmp_path / "lab", dashboard=False) as node, \
            node.client.as_current():
        honest = node.volunteer_names()
        _, _, expr = make(np.random.default_rng(0))
        keys = [k[0] if isinstance(k, tuple) else k for k in dict(expr.__dask_graph__())]
        steps = sum("partial" in str(k) for k in keys)
        assert (steps > 0) == (shape == "chain"), steps
        cheater = node.add_volunteer(module="tests.cheaters", extra_args=("--cheat", "element", "--honest-first", "2"))
        wait_for(lambda: cheater in node.volunteer_names(), "the cheater to join")
        _run_until_banned(node, cheater, make)
        volunteers = node.report()["volunteers"]
    assert volunteers[cheater]["rejected"] >= 1 and volunteers[cheater]["banned"], volunteers[cheater]
    for name in honest:
        assert volunteers[name]["rejected"] == 0 and not volunteers[name]["banned"], volunteers[name]
