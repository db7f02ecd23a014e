"""Saying where work ran (issue 31): ``report()`` and the lab page count the catalog tasks sent to volunteers and
those kept at the lab with why, in all and per researcher; a computation none of whose tasks leaves the lab says
so once in the researcher's own log, naming the setting that would send them out.

Real processes: the session's lab node with its two volunteer agents, researchers connecting with credentials
from ``goblin researchers issue``.
"""

from __future__ import annotations

import logging

import dask
import numpy as np
from click.testing import CliRunner

import goblin_dask.array as ga
from goblin_dask import connect
from goblin_dask.array.placement import kept_at_lab
from goblin_dask.cli import main as goblin
from tests.conftest import wait_for

PLACEMENT_LOG = "goblin_dask.placement"


def _researcher(lab, name: str) -> str:
    result = CliRunner().invoke(goblin, ["researchers", "issue", name, "--state-dir", str(lab.state_dir)])
    assert result.exit_code == 0, result.output
    return result.stdout.strip()


def _mine(client, name: str) -> dict:
    from goblin_dask.node import rpc

    report = client.sync(getattr(client.scheduler, rpc.REPORT))
    assert set(report["placement_by_researcher"]) <= {name}  # a researcher sees its own row only
    return report["placement_by_researcher"].get(name, {"volunteer": 0, "lab": 0, "kept": {}})


def _records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == PLACEMENT_LOG]


def test_a_small_product_kept_at_the_lab_is_counted_with_why_and_said_once_in_the_researchers_log(
        lab, caplog, monkeypatch):
    from goblin_dask.array import placement

    monkeypatch.setattr(placement, "_WARNED", set())  # a fresh researcher's process: no earlier test warned it
    path = _researcher(lab, "where-small")
    rng = np.random.default_rng(310)
    a, b = rng.standard_normal((40, 30)), rng.standard_normal((30, 20))
    caplog.set_level(logging.INFO, logger=PLACEMENT_LOG)
    with connect(lab.address, credential=path, timeout=30, set_as_default=False) as client:
        total_before = lab.report()["placement"]
        product = ga.from_array(a, chunks=20) @ ga.from_array(b, chunks=10)
        sent, kept = kept_at_lab(product.__dask_graph__(), product.__dask_keys__())
        assert sent == 0 and set(kept) == {"min-flops"}  # 40*30*20*2 flops, far below 1e6
        np.testing.assert_allclose(product.compute(scheduler=client.get), a @ b, rtol=1e-12, atol=1e-12)
        mine = _mine(client, "where-small")
        assert mine == {"volunteer": 0, "lab": sum(kept.values()), "kept": {"min-flops": sum(kept.values())}}
        records = _records(caplog)
        assert len(records) == 1, [r.getMessage() for r in records]  # once for the computation, not per task
        message = records[0].getMessage()
        assert records[0].levelno == logging.WARNING
        assert f"all {sum(kept.values())} catalog task(s) of this computation run on the lab worker" in message
        assert "below goblin.placement.min-flops = 1e+06" in message and "would send them out" in message

        # the next computation says it again, once, at INFO (the warning was given)
        (ga.from_array(a, chunks=20) @ ga.from_array(b, chunks=10)).sum().compute(scheduler=client.get)
        records = _records(caplog)
        assert len(records) == 2 and records[1].levelno == logging.INFO
        total_after = lab.report()["placement"]  # the lab admin's report: all researchers
        assert total_after["kept"]["min-flops"] >= total_before.get("kept", {}).get("min-flops", 0) + len(kept) + 1
        assert lab.report()["placement_by_researcher"]["where-small"]["lab"] >= mine["lab"]

        # lower min-flops (the setting named) and the same product goes out: nothing said
        with dask.config.set({"goblin.placement.min-flops": 0, "goblin.placement.min-product-intensity": 0}):
            product = ga.from_array(a, chunks=20) @ ga.from_array(b, chunks=10)
            sent, _ = kept_at_lab(product.__dask_graph__(), product.__dask_keys__())
            assert sent > 0
            np.testing.assert_allclose(product.compute(scheduler=client.get), a @ b, rtol=1e-12, atol=1e-12)
        assert len(_records(caplog)) == 2
        assert _mine(client, "where-small")["volunteer"] == sent


def test_a_product_that_goes_to_volunteers_counts_them_and_says_nothing(lab, caplog):
    path = _researcher(lab, "where-big")
    other = _researcher(lab, "where-other")
    rng = np.random.default_rng(311)
    a, b = rng.standard_normal((512, 384)), rng.standard_normal((384, 256))
    caplog.set_level(logging.INFO, logger=PLACEMENT_LOG)
    with connect(lab.address, credential=path, timeout=30, set_as_default=False) as client:
        before = lab.report()
        product = ga.from_array(a, chunks=128) @ ga.from_array(b, chunks=128)
        sent, kept = kept_at_lab(product.__dask_graph__(), product.__dask_keys__())
        assert sent > 0 and not kept
        np.testing.assert_allclose(product.compute(scheduler=client.get), a @ b, rtol=1e-12, atol=1e-12)
        assert _mine(client, "where-big") == {"volunteer": sent, "lab": 0, "kept": {}}
        wait_for(lambda: lab.report()["accepted"] >= before["accepted"] + sent, "every volunteer result accepted")
        assert lab.report()["placement"]["volunteer"] == before["placement"]["volunteer"] + sent
    assert _records(caplog) == []
    with connect(lab.address, credential=other, timeout=30, set_as_default=False) as client:
        assert _mine(client, "where-other") == {"volunteer": 0, "lab": 0, "kept": {}}  # not where-big's row


def test_tasks_the_lab_keeps_over_max_share_are_counted_as_such(lab):
    """``exp`` of a 256x256 lab array in two blocks of half of it each: the researcher's side sends them out (its
    thresholds lowered), but each task would hold half of the array, over ``max-share`` (1/4): the lab node keeps
    them, and counts them under ``max-share``."""
    path = _researcher(lab, "where-share")
    x = np.random.default_rng(312).standard_normal((256, 256))
    with connect(lab.address, credential=path, timeout=30, set_as_default=False) as client, \
            dask.config.set({"goblin.placement.min-flops": 0, "goblin.placement.min-intensity": 0}):
        y = np.exp(ga.from_array(x, chunks=(128, 256)))
        sent, kept = kept_at_lab(y.__dask_graph__(), y.__dask_keys__())
        assert sent == 2 and not kept
        np.testing.assert_allclose(y.compute(scheduler=client.get), np.exp(x), rtol=1e-12, atol=0)
        mine = _mine(client, "where-share")
    assert mine == {"volunteer": 0, "lab": 2, "kept": {"max-share": 2}}
