"""Cheating volunteers, each a real volunteer process, against a real lab node.

In every case: no wrong result is accepted (every accepted block equals numpy's), the
final answer equals numpy's, the cheater is banned (credential revoked, disconnected,
refused when it reconnects) and honest volunteers are never banned, on finite data and
on data with NaN and inf.
"""

from __future__ import annotations

import numpy as np
import pytest

import goblin_dask.array as ga
from goblin_dask.node.local import LabNode
from tests.conftest import assemble, blocked_product_graph, read_log, wait_for

BLOCK = 48
#: products run until the cheaters are caught (each run gives every volunteer work)
MAX_ROUNDS = 8


@pytest.fixture(scope="module")
def grid():
    """A lab node with two honest volunteers; each test adds its cheaters."""
    with LabNode.local(volunteers=2) as node:
        yield node


def _data(seed: int, nonfinite: bool, n: int = 6 * BLOCK):
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    if nonfinite:  # a few NaN/inf: their rows and columns of every block product are non-finite
        a[5, 7], a[n - 3, 2 * BLOCK + 1] = np.nan, np.inf
        b[BLOCK + 4, 9], b[3, n - 5] = -np.inf, np.nan
    return a, b


def _run_product(node, a, b):
    """One verified blocked product; asserts every accepted block and the answer against numpy."""
    dsk, keys, blocks = blocked_product_graph(a, b, BLOCK)
    results = node.client.get(dsk, keys)
    with np.errstate(invalid="ignore", over="ignore"):
        for key, got in zip(keys, results):  # each accepted number, not only the sum
            i, j, k = key[1:]
            want = a[i * BLOCK:(i + 1) * BLOCK, k * BLOCK:(k + 1) * BLOCK] @ b[k * BLOCK:(k + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, equal_nan=True)
        c = assemble({k[1:]: r for k, r in zip(keys, results)}, (a.shape[0], b.shape[1]), blocks)
        np.testing.assert_allclose(c, a @ b, rtol=1e-10, atol=1e-10, equal_nan=True)


def _until_banned(node, cheaters, seed, nonfinite):
    for round in range(MAX_ROUNDS):
        _run_product(node, *_data(seed + round, nonfinite))
        volunteers = node.report()["volunteers"]
        if all(volunteers[c]["banned"] for c in cheaters):
            return volunteers
    pytest.fail(f"cheaters not banned after {MAX_ROUNDS} products: {node.report()}")


def _assert_banned_and_refused(node, name):
    from goblin_dask.errors import EXIT_REFUSED, EXIT_REVOKED

    wait_for(lambda: name not in node.volunteer_names(), f"{name} to be disconnected")
    # it reconnected and the node refused it: at registration (banned), or already at the handshake (revoked)
    code = node.processes[name].wait(120)
    assert code in (EXIT_REFUSED, EXIT_REVOKED), code
    assert ("refused" if code == EXIT_REFUSED else "revoked") in read_log(node._log_path(name))


def _assert_honest_untouched(node, honest):
    report = node.report()
    volunteers = report["volunteers"]
    for name in honest:
        why = [r for r in report["rejections"] if r["volunteer"] == name]
        assert volunteers[name]["rejected"] == 0 and not volunteers[name]["banned"], (volunteers[name], why)
        assert name in node.volunteer_names()


def _cheater(node, kind, *extra):
    return node.add_volunteer(module="tests.cheaters", extra_args=("--cheat", kind, *extra))


@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "nan-inf"])
@pytest.mark.parametrize("kind", ["noise", "zeros", "element", "stale"])
def test_a_cheater_is_caught_and_banned(grid, kind, nonfinite):
    honest = grid.volunteer_names()
    cheater = _cheater(grid, kind)
    seed = 10 * ["noise", "zeros", "element", "stale"].index(kind) + nonfinite
    volunteers = _until_banned(grid, [cheater], seed=seed, nonfinite=nonfinite)
    assert volunteers[cheater]["rejected"] >= 2 and volunteers[cheater]["trust"] == 0
    _assert_banned_and_refused(grid, cheater)
    _assert_honest_untouched(grid, honest)


def test_honest_for_twenty_tasks_then_cheating(grid):
    honest = grid.volunteer_names()
    cheater = _cheater(grid, "element", "--honest-first", "20")
    volunteers = _until_banned(grid, [cheater], seed=50, nonfinite=False)
    assert volunteers[cheater]["accepted"] >= 20  # it had earned trust; its products are checked anyway
    _assert_banned_and_refused(grid, cheater)
    _assert_honest_untouched(grid, honest)


@pytest.mark.slow
def test_two_cheaters_at_once(grid):
    honest = grid.volunteer_names()
    cheaters = [_cheater(grid, "zeros"), _cheater(grid, "stale")]
    _until_banned(grid, cheaters, seed=60, nonfinite=True)
    for name in cheaters:
        _assert_banned_and_refused(grid, name)
    _assert_honest_untouched(grid, honest)


def test_replicas_catch_a_cheater_on_ops_no_product_check_covers(grid):
    """Random blocks (replica method): a second volunteer recomputes; on disagreement the lab decides."""
    honest = grid.volunteer_names()
    cheater = _cheater(grid, "noise")
    for seed in range(MAX_ROUNDS):
        x = ga.random.standard_normal((6 * BLOCK, 6 * BLOCK), chunks=BLOCK, seed=seed)
        np.testing.assert_array_equal(x.compute(), x.compute(scheduler="sync"))  # the same numbers as here
        if grid.report()["volunteers"][cheater]["banned"]:
            break
    report = grid.report()
    assert report["volunteers"][cheater]["banned"], report
    assert report["by_method"].get("replica", 0) > 0
    _assert_banned_and_refused(grid, cheater)
    _assert_honest_untouched(grid, honest)


@pytest.fixture
def impatient_grid(monkeypatch, tmp_path):
    """A lab node with a 2 s deadline and trust (accepting on it: opt-in) earned after 16 verified results."""
    monkeypatch.setenv("DASK_GOBLIN__VERIFICATION__DEADLINE", "2")
    monkeypatch.setenv("DASK_GOBLIN__VERIFICATION__TRUST_THRESHOLD", "16")
    monkeypatch.setenv("DASK_GOBLIN__VERIFICATION__ACCEPT_ON_TRUST", "true")
    with LabNode.local(volunteers=2, state_dir=tmp_path / "lab") as node:
        yield node


@pytest.mark.slow
def test_replication_falls_with_trust_and_deadlines_reissue_held_tasks(impatient_grid):
    node = impatient_grid
    honest = node.volunteer_names()
    # Replica-method blocks: all replicated while trust is low, fewer and fewer as it grows.
    replicated = []
    for seed in range(5):
        before = node.report()["by_method"]
        x = ga.random.standard_normal((8 * BLOCK, 8 * BLOCK), chunks=BLOCK, seed=100 + seed)
        np.testing.assert_array_equal(x.compute(), x.compute(scheduler="sync"))
        after = node.report()["by_method"]
        pairs = sum(after.get(m, 0) - before.get(m, 0) for m in ("replica", "audit"))
        replicated.append(pairs // 2)
    assert replicated[0] >= 16 and replicated[-1] < replicated[0] / 2, replicated
    assert after.get("trusted", 0) > 0 and node.report()["rejected"] == 0
    # A volunteer that holds its tasks and never returns them: they are reissued elsewhere.
    staller = _cheater(node, "stall")
    _run_product(node, *_data(70, nonfinite=False, n=4 * BLOCK))
    report = node.report()
    assert report["reissued"] >= 1 and report["volunteers"][staller]["late"] >= 1, report
    assert not report["volunteers"][staller]["banned"]  # late is not wrong
    _assert_honest_untouched(node, honest)


def test_the_lab_worker_knows_which_volunteer_sent_each_result_it_checks(grid):
    """Verdicts blame the peer whose bytes were checked: the lab worker notes it when it fetches them."""
    from goblin_dask.validation.checks import unverified_key

    a, b = _data(90, nonfinite=False, n=2 * BLOCK)
    dsk, keys, _ = blocked_product_graph(a, b, BLOCK)
    grid.client.get(dsk, keys)
    lab = grid.lab_worker_address()
    sources = grid.client.run(lambda dask_worker: dict(dask_worker.goblin_fetched_from), workers=[lab])[lab]
    volunteers = set(grid.volunteer_addresses().values())
    assert all(sources.get(unverified_key(key)) in volunteers for key in keys), (sources, volunteers)


def test_a_result_the_lab_worker_computed_itself_is_credited_to_nobody(tmp_path):
    """Seen in CI: a banned cheater credited with accepted results.  The lab worker had fetched two of its
    blocks, the cheater was removed, the blocks were computed again on the lab worker itself, and the check
    of the lab's own bytes read the note of that earlier fetch.  Here the note is left by hand for every
    block of a volunteer that has gone, and the lab worker computes them all: nobody is credited."""
    import dask
    from dask.core import flatten

    from goblin_dask.validation.checks import unverified_key

    with dask.config.set({"goblin.faults.no-volunteer-wait": 1.0}), \
            LabNode.local(volunteers=0, state_dir=tmp_path / "lab", dashboard=False) as node:
        name = node.add_volunteer(node.enroll("gone"))
        address = node.volunteer_addresses()[name]
        node.kill_volunteer(name)
        wait_for(lambda: name not in node.volunteer_names(), f"{name} removed")
        x = ga.random.standard_normal((2 * BLOCK, 2 * BLOCK), chunks=BLOCK, seed=21)
        keys = [unverified_key(k) for k in flatten(x.__dask_keys__())]
        lab = node.lab_worker_address()
        node.client.run(lambda dask_worker: dask_worker.goblin_fetched_from.update(dict.fromkeys(keys, address)),
                        workers=[lab])
        np.testing.assert_array_equal(x.compute(), x.compute(scheduler="sync"))
        report = node.report()
    assert report["by_method"].get("sample", 0) >= len(keys), report["by_method"]  # the lab checked them all
    assert report["volunteers"][name]["accepted"] == 0, report["volunteers"]


@pytest.fixture
def auditing(monkeypatch):
    """The lab audits every replica pair (``audit-rate`` 1.0): the colluders are caught at once, deterministically."""
    import dask

    with dask.config.set({"goblin.verification.audit-rate": 1.0}):
        yield


def test_two_credentials_of_one_person_agreeing_on_wrong_blocks_are_caught_by_the_labs_own_checks(auditing):
    """Replica agreement is no proof: one person's two volunteers return the same wrong block (0.5
    everywhere) for every random task, each confirming the other's; the lab's own audits catch and ban both,
    and the researcher's array is numpy's.

    A grid with no volunteer connected keeps volunteer tasks waiting for one (``scheduler_plugins.faults``):
    what the banned pair leaves undone goes to an honest volunteer that joins after the bans (a computation
    started after the bans with nobody to join is what hung the first version of this test)."""
    with LabNode.local(volunteers=0) as node:
        pair = [_cheater(node, "half"), _cheater(node, "half")]
        x = ga.random.standard_normal((4 * BLOCK, 4 * BLOCK), chunks=BLOCK, seed=7)
        future = node.client.compute(x)
        wait_for(lambda: all(node.report()["volunteers"].get(name, {}).get("banned") for name in pair),
                 "the lab's audits to ban both", timeout=600)
        report = node.report()
        assert report["by_method"].get("audit", 0) >= 2 and report["accepted"] == 0, report
        for name in pair:
            assert "audit" in {r["method"] for r in report["rejections"] if r["volunteer"] == name}, report
            _assert_banned_and_refused(node, name)
        honest = node.add_volunteer()
        np.testing.assert_array_equal(future.result(), x.compute(scheduler="sync"))  # no 0.5 block accepted
        _assert_honest_untouched(node, [honest])
