"""Training runs on the lab's page: who may post a round (``goblin_training_round``), and what is kept.

On an in-process lab node (``tests.inprocess``), every peer presenting a real certificate of the lab's CA
over mutual TLS.  A Trainer's rounds reaching ``/goblin/api/status`` and the page in a browser, from real
processes: ``tests/test_lab_page.py``.
"""

from __future__ import annotations

import json

import pytest
from distributed.core import rpc as connect_rpc

from goblin_dask.node import rpc
from goblin_dask.tls import LabCA
from scheduler_plugins.http import lab_status
from scheduler_plugins.training import ROUNDS_KEPT, RUNS_KEPT_PER_OWNER
from tests.inprocess import run_lab

RUN = "0123456789abcdef"
ROUND = {"run": RUN, "round": 1, "loss": 2.5, "seconds": 0.75, "verification": {"tasks": 12, "accepted": 8,
                                                                                  "rejected": 0}}


def _as(lab, role: str, name: str):
    """A bare connection to the scheduler presenting ``role``/``name``'s certificate."""
    security = LabCA(lab.state_dir).issue(role, name).security()
    return connect_rpc(lab.scheduler.address, connection_args=security.get_connection_args("client"))


def _runs(lab) -> list[dict]:
    return lab_status(lab.scheduler, lab.ledger, None)["training"]["runs"]  # what a stranger's page gets


def test_a_volunteer_cannot_post_a_fake_training_run(tmp_path):
    async def body(lab):
        async with _as(lab, "volunteer", "alice") as r:  # alice is a connected volunteer
            with pytest.raises(PermissionError, match=f"'{rpc.TRAINING_ROUND}' is not allowed for volunteer alice"):
                await getattr(r, rpc.TRAINING_ROUND)(**ROUND)
        # and the handler checks the caller's role itself, behind the allow-list
        with pytest.raises(PermissionError, match="only researchers and the lab"):
            lab.plugins["goblin-training"].training_round_handler(None, **ROUND)
        assert _runs(lab) == []

    run_lab(tmp_path, body, volunteers=("alice",))


def test_a_researcher_posts_rounds_numbers_only_and_each_owner_has_its_own_runs(tmp_path):
    async def body(lab):
        async with lab.client() as client:  # researcher ada
            post = getattr(client.scheduler, rpc.TRAINING_ROUND)
            assert (await post(**ROUND))["rounds"] == 1
            assert (await post(**{**ROUND, "round": 2, "loss": 1.5, "seconds": 0.5}))["rounds"] == 2
            assert (await post(**{**ROUND, "round": 3, "loss": float("nan")}))["rounds"] == 3  # diverged: a gap
            for bad, match in [({"run": "ada's model"}, "opaque id"), ({"run": 7}, "opaque id"),
                               ({"loss": "low"}, "loss must be a number"), ({"round": -1}, "round must be a count"),
                               ({"round": True}, "round must be a count"), ({"seconds": -1.0}, "not be negative"),
                               ({"verification": {"accepted": "all"}}, "accepted must be a count"),
                               ({"verification": ["x"]}, "mapping of counts")]:
                with pytest.raises(ValueError, match=match):
                    await post(**{**ROUND, **bad})
        async with lab.client("researcher", "bea") as other:  # the same id from someone else: a run of its own
            await getattr(other.scheduler, rpc.TRAINING_ROUND)(**{**ROUND, "loss": 9.0})
        runs = _runs(lab)
        assert len(runs) == 2 and runs[0]["id"] != runs[1]["id"]
        ada, bea = runs
        assert ada["round"] == 3 and ada["loss"] is None and ada["accepted"] == 24 and ada["rejected"] == 0
        assert [h[:3] for h in ada["history"]] == [[1, 2.5, 0.75], [2, 1.5, 0.5], [3, None, 0.75]]
        assert bea["round"] == 1 and bea["history"] == [[1, 9.0, 0.75, 8, 0]]
        text = json.dumps(lab_status(lab.scheduler, lab.ledger, None))  # valid JSON (no NaN), and no names
        for drawn in (ada["id"], bea["id"]):  # the lab's random hex ids may spell "ada" or "bea" by chance
            text = text.replace(f'"{drawn}"', '""')
        assert "NaN" not in text and "ada" not in text and "bea" not in text and RUN not in text

    run_lab(tmp_path, body, volunteers=())


def test_runs_and_rounds_are_bounded(tmp_path):
    async def body(lab):
        board = lab.plugins["goblin-training"]
        board.add_round(("researcher", "bea"), "0badcafe", 1, 4.0, 0.1, {})  # bea's one run, before ada's flood
        for i in range(RUNS_KEPT_PER_OWNER + 5):
            board.add_round(("researcher", "ada"), f"{i:08x}", 1, 1.0, 0.1, {})
        for i in range(ROUNDS_KEPT + 10):
            board.add_round(("researcher", "ada"), "ffffffff", i + 1, 1.0 / (i + 1), 0.1, {})
        runs = _runs(lab)
        # runs are kept per researcher: ada's flood pushes out her own oldest runs, never bea's
        assert len(runs) == RUNS_KEPT_PER_OWNER + 1 and len(runs[-1]["history"]) == ROUNDS_KEPT
        assert [r["loss"] for r in runs].count(4.0) == 1
        assert runs[-1]["history"][0][0] == 11 and runs[-1]["round"] == ROUNDS_KEPT + 10

    run_lab(tmp_path, body, volunteers=())
