"""Two researchers on one real lab node: each sees and fetches only what its own client submitted.

The attack is the one another researcher would write: list the lab's keys (``has_what``, ``who_has``,
``processing``), then fetch one (``gather``, a future of that key, a graph naming it under a dummy task).
Real processes, real TLS, 127.0.0.1 (the session's ``lab`` fixture).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from distributed import Future

from goblin_dask import connect
from goblin_dask.credentials import issue_credential
from tests.conftest import wait_for


def hold_until(path: str) -> int:
    """A task that stays processing until ``path`` exists (runs on the lab worker)."""
    while not Path(path).exists():
        time.sleep(0.02)
    return 7


def _researcher(lab, tmp_path, name):
    path = issue_credential(lab.state_dir, "researcher", name).save(tmp_path / f"{name}.credential")
    return connect(lab.address, credential=path, timeout=30)


def _keys_listed(answer: dict) -> set:
    return {k for keys in answer.values() for k in keys}


def test_a_researcher_never_sees_or_fetches_another_researchers_keys(lab, tmp_path):
    secret = np.random.default_rng(29).standard_normal((64, 64))
    release = tmp_path / "release"
    with _researcher(lab, tmp_path, "ada-iso") as ada, _researcher(lab, tmp_path, "bea-iso") as bea:
        product = ada.submit(np.multiply, secret, 3.0, key="ada-product")
        scattered = ada.scatter(secret + 1.0)
        np.testing.assert_array_equal(product.result(), secret * 3.0)
        running = ada.submit(hold_until, str(release), key="ada-running")
        wait_for(lambda: "ada-running" in _keys_listed(ada.processing()), "ada's task to be processing")
        mine = {product.key, scattered.key}

        # ada, and the lab's admin, see ada's keys
        assert mine <= _keys_listed(ada.has_what()) and mine <= set(ada.who_has())
        assert mine <= _keys_listed(lab.client.has_what())

        # bea sees none of them, whichever way she asks
        assert not (mine | {"ada-running"}) & _keys_listed(bea.has_what())
        assert not (mine | {"ada-running"}) & set(bea.who_has())
        assert {k: list(v) for k, v in bea.sync(bea.scheduler.who_has, keys=[product.key]).items()} == {product.key: []}
        assert "ada-running" not in _keys_listed(bea.processing())
        assert bea.sync(bea.scheduler.get_task_status, keys=[product.key]) == {product.key: None}
        assert not mine & set(bea.sync(bea.scheduler.nbytes, summary=False))

        # and fetches none of them
        for key in mine:
            with pytest.raises(PermissionError, match="another researcher submitted"):
                bea.sync(bea.scheduler.gather, keys=[key])
        desired = Future(product.key, client=bea)  # a future of her key, as a shared Variable would hand over
        bea._send_to_scheduler({"op": "client-desires-keys", "keys": [product.key], "client": bea.id})
        with pytest.raises(PermissionError, match="another researcher submitted"):
            desired.result()
        desired.release()
        with pytest.raises(PermissionError, match="another researcher submitted"):  # a dummy task under her key
            bea.get({product.key: (np.zeros, 1), "bea-reads-ada": (np.add, product.key, 0.0)}, "bea-reads-ada")
        with pytest.raises(PermissionError, match="another researcher submitted"):
            bea.scatter({product.key: np.zeros(1)})  # overwriting it

        # the very same task is no secret: either could compute it alone, so they share it
        same = bea.submit(np.multiply, secret, 3.0, key=product.key)
        np.testing.assert_array_equal(same.result(), secret * 3.0)

        # nothing bea did touched ada's results
        release.touch()
        assert running.result() == 7
        np.testing.assert_array_equal(ada.gather(product), secret * 3.0)
        np.testing.assert_array_equal(ada.gather(scattered), secret + 1.0)
        # bea's own work is hers as usual
        assert bea.submit(np.add, 2, 3, key="bea-own").result() == 5
        assert "bea-own" in set(bea.who_has())


def test_a_researchers_verified_product_on_volunteers_works_as_before(lab, tmp_path):
    """The narrowed view does not get in the way of the normal path: volunteers compute, the lab checks."""
    import goblin_dask.array as ga

    rng = np.random.default_rng(30)
    a, b = rng.standard_normal((300, 200)), rng.standard_normal((200, 250))
    with _researcher(lab, tmp_path, "cid-iso") as cid:
        z = ga.from_array(a, chunks=100) @ ga.from_array(b, chunks=100)
        np.testing.assert_allclose(cid.compute(z).result(), a @ b, rtol=1e-12, atol=1e-10)
