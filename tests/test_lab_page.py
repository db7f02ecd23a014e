"""The lab's page ``/goblin/`` and its data ``/goblin/api/status``, over HTTP(S) from real processes.

The site is a ``LabNode.local(volunteers=2)`` serving its dashboard over HTTPS with
``goblin.dashboard.trust-loopback: false`` (a client on 127.0.0.1 is a stranger, as in
``test_dashboard_port``): a stranger reads totals only, a signed-in lab admin the volunteers too.
The page itself is a script polling ``/goblin/api/status``: the tests read what the page reads, during a
computation, and load the page in headless Chromium (skipped where Chromium is missing, except under
``CI=true``: there they fail); a Trainer's rounds reach both, with their loss curve.
"""

from __future__ import annotations

import json
import re

import dask
import numpy as np
import pytest

from goblin_dask import LabNode
from tests.access_helpers import headless_chromium, Site, WebClient, localhost_tls, mailbox, sign_in  # noqa: F401 (fixture)
from tests.conftest import blocked_product_graph, wait_for

ADMIN = "admin@lab.example"
BLOCK = 48


@pytest.fixture(scope="module")
def site(mailbox, tmp_path_factory):
    tls = localhost_tls(tmp_path_factory.mktemp("lab-page-tls"))
    config = {"goblin.smtp": {"host": "127.0.0.1", "port": mailbox.port, "from": "goblin lab <signin@lab.example>"},
              "goblin.admins": [ADMIN], "goblin.dashboard": {"trust-loopback": False}}
    with pytest.MonkeyPatch.context() as env, dask.config.set(config):
        env.setenv("DASK_DISTRIBUTED__SCHEDULER__DASHBOARD__TLS__CERT", str(tls.cert))
        env.setenv("DASK_DISTRIBUTED__SCHEDULER__DASHBOARD__TLS__KEY", str(tls.key))
        node = LabNode.local(volunteers=2, lab_threads=1)
    with node:
        yield Site(node, tls)


def _status(client: WebClient) -> dict:
    response = client.get("/goblin/api/status")
    assert response.status == 200 and response.headers["Content-Type"].startswith("application/json")
    return json.loads(response.body)


def test_the_page_is_served_to_anyone_with_a_strict_content_policy(site):
    page = WebClient(site, source_ip="127.0.0.41").get("/goblin/")
    assert page.status == 200 and "goblin lab node" in page.body and "/goblin/api/status" in page.body
    policy = page.headers["Content-Security-Policy"]
    nonce = re.search(r"'nonce-([^']+)'", policy).group(1)
    assert f'<script nonce="{nonce}">' in page.body and "default-src 'none'" in policy
    assert WebClient(site, source_ip="127.0.0.41").get("/goblin/").headers["Content-Security-Policy"] != policy


def test_live_numbers_during_a_computation_totals_for_strangers_volunteers_for_admins(site, mailbox):
    node = site.node
    stranger = WebClient(site, source_ip="127.0.0.42")
    before = _status(stranger)
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((8 * BLOCK, 8 * BLOCK)), rng.standard_normal((8 * BLOCK, 8 * BLOCK))
    dsk, keys, _ = blocked_product_graph(a, b, BLOCK)
    futures = node.client.get(dsk, keys, sync=False)
    seen = []

    def in_flight():
        status = _status(stranger)
        seen.append(status)
        return any(c["in_flight"] and 0 < c["done"] < c["tasks"] for c in status["computations"])

    wait_for(in_flight, "the computation in flight, part done, on /goblin/api/status", interval=0.02)
    node.client.gather(futures)
    wait_for(lambda: _status(stranger)["accepted"] >= before["accepted"] + len(keys), "every result verified")
    after = _status(stranger)
    assert after["tasks"] > before["tasks"] and after["by_method"]["freivalds"] >= len(keys)
    assert after["credit"] > before["credit"] and after["connected"] == 2 and after["overhead"] > 0
    assert not any(c["in_flight"] for c in after["computations"][-1:])
    # a stranger sees totals: no volunteer names, no addresses, no keys
    text = json.dumps(after)
    assert "volunteers" not in after and after["volunteer_count"] == 2
    # where the tasks ran: every block product went to a volunteer; counts for all, not per researcher
    assert after["placement"]["volunteer"] == before["placement"]["volunteer"] + len(keys)
    assert after["kept_settings"]["min-flops"] == "goblin.placement.min-flops"
    assert "placement_by_researcher" not in after
    for secret in [*node.volunteer_names(), *node.volunteer_addresses().values(), node.lab_worker_address(),
                   str(keys[0][0])]:
        assert secret not in text
    assert seen[-1]["tasks"] < after["tasks"]  # the numbers moved while the page polled

    admin = WebClient(site, source_ip="127.0.0.43")
    assert sign_in(admin, mailbox, ADMIN).status == 303
    rows = {v["name"]: v for v in _status(admin)["volunteers"]}
    by_researcher = _status(admin)["placement_by_researcher"]  # the lab admin's client submitted the product
    assert sum(c["volunteer"] for c in by_researcher.values()) >= len(keys)
    assert set(rows) == set(node.volunteer_names())
    report = node.report()["volunteers"]
    for name, row in rows.items():
        assert row["status"] == "running" and row["threads"] == 1 and row["memory"] > 0
        assert row["accepted"] == report[name]["accepted"] and row["credit"] == report[name]["credit"] > 0
        assert {"trust", "rejected", "banned", "late", "exposure"} <= set(row)


@pytest.fixture(scope="module")
def browser(request, tmp_path_factory):
    """Headless Chromium trusting the site's certificate, keeping the console's log."""
    site = request.getfixturevalue("site")
    driver = headless_chromium(site.tls.spki_sha256, tmp_path_factory.mktemp("chromium-profile"), "1100,1000",
                               console_log=True)
    yield driver
    driver.quit()


def test_the_page_in_a_browser_updates_live_during_a_computation_without_console_errors(site, browser):
    from selenium.webdriver.common.by import By

    node = site.node
    browser.get(site.base + "/goblin/")
    wait_for(lambda: browser.execute_script("return document.body.dataset.updated || ''"), "the page's first poll")
    browser.execute_script("window.goblinSamePage = true")  # gone if the page reloaded
    tasks = lambda: int(browser.find_element(By.ID, "tasks").text)  # noqa: E731
    before = tasks()
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal((8 * BLOCK, 8 * BLOCK)), rng.standard_normal((8 * BLOCK, 8 * BLOCK))
    dsk, keys, _ = blocked_product_graph(a, b, BLOCK)
    futures = node.client.get(dsk, keys, sync=False)
    wait_for(lambda: tasks() > before, "the page to show new tasks during the computation")
    node.client.gather(futures)
    wait_for(lambda: tasks() >= before + len(keys), "the page to show every task")
    assert browser.execute_script("return window.goblinSamePage === true")  # live, without a reload
    assert browser.find_elements(By.CSS_SELECTOR, "#verified polyline")  # the plot over time is drawn
    assert "freivalds" in browser.find_element(By.ID, "methods").text
    wait_for(lambda: int(browser.find_element(By.ID, "sent").text) >= len(keys), "the page to show where tasks ran")
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def test_a_trainers_rounds_appear_on_the_status_and_on_the_page_with_their_loss_curve(site, browser):
    """A Trainer's rounds on the site's grid: each reaches /goblin/api/status (numbers only) and the page's table and
    loss plot, live."""
    torch = pytest.importorskip("torch")
    from selenium.webdriver.common.by import By
    from torch import nn

    from goblin_dask.training import Trainer

    node = site.node
    browser.get(site.base + "/goblin/")
    wait_for(lambda: browser.execute_script("return document.body.dataset.updated || ''"), "the page's first poll")
    browser.execute_script("window.goblinSamePage = true")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), micro_batches=2,
                      client=node.client)
    x = np.random.default_rng(7).standard_normal((32, 8)).astype(np.float32)
    y = np.tanh(x[:, :1] * 2).astype(np.float32)
    stranger = WebClient(site, source_ip="127.0.0.46")
    # read in one script: the page redraws its table and plot every second (an element found may be gone)
    latest = "const t=document.getElementById('training');return t.rows.length>1?[...t.rows[1].cells].map(c=>c.textContent):[]"
    to_volunteers = {"goblin.placement.min-flops": 0, "goblin.placement.min-intensity": 0,
                     "goblin.placement.min-product-intensity": 0}  # so that the rounds' products are checked
    with dask.config.set(to_volunteers):
        for r in (1, 2, 3):
            trainer.step(x, y)
            runs = _status(stranger)["training"]["runs"]
            assert len(runs) == 1 and runs[0]["round"] == r  # posted before step() returned
            run_id = runs[0]["id"]
            wait_for(lambda: browser.execute_script(latest)[:2] == [run_id, str(r)], f"round {r} on the page")
    run = _status(stranger)["training"]["runs"][0]
    assert [h[0] for h in run["history"]] == [1, 2, 3]
    assert [h[1] for h in run["history"]] == pytest.approx([h["loss"] for h in trainer.history], rel=1e-6)
    assert all(h[2] > 0 for h in run["history"]) and run["rejected"] == 0
    assert run["accepted"] == sum(h["verification"]["accepted"] for h in trainer.history) > 0
    assert trainer._lab_run_id not in json.dumps(run)  # the page's id is the lab's own draw
    assert browser.execute_script("return window.goblinSamePage === true")
    line = browser.execute_script("const p=document.querySelector('#loss polyline');"
                                  "return p?[p.getAttribute('points'),p.dataset.run]:null")  # the loss curve
    assert line is not None and len(line[0].split()) == 3 and line[1] == run_id  # a point per round
    assert browser.execute_script(latest)[4] == str(run["accepted"])
    assert not browser.find_element(By.ID, "no-training").is_displayed()
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def test_a_lab_admin_revokes_a_volunteer_from_the_page_with_the_xsrf_token(site, mailbox):
    """Last: it disconnects one of the site's volunteers."""
    node = site.node
    name = node.volunteer_names()[0]
    stranger = WebClient(site, source_ip="127.0.0.44")
    stranger.get("/goblin/")  # (gets its own XSRF cookie)
    assert stranger.post("/goblin/api/revoke", name=name).status == 403  # no session: the guard refuses it
    admin = WebClient(site, source_ip="127.0.0.45")
    assert sign_in(admin, mailbox, ADMIN).status == 303
    page = admin.get("/goblin/")
    assert page.status == 200 and 'name="goblin-xsrf"' in page.body
    assert _status(admin)["can_revoke"] and not _status(stranger)["can_revoke"]
    assert admin.request("POST", "/goblin/api/revoke", {"name": name}, xsrf=False).status == 403  # no XSRF token
    assert name in node.volunteer_names()
    response = admin.post("/goblin/api/revoke", name=name)
    assert response.status == 200 and json.loads(response.body) == {"revoked": name, "closed": 1}
    wait_for(lambda: name not in node.volunteer_names(), f"{name} to be disconnected")
    assert admin.post("/goblin/api/revoke", name="nobody-here").status == 404

