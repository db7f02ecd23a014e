"""The lab node's dashboard port against a stranger (issue 14, part 5): real processes, real TLS.

The site is ``LabNode.local(volunteers=1)`` (the ``goblin node`` process, the lab worker and
one volunteer) with its dashboard over HTTPS and ``goblin.dashboard.trust-loopback: false``, so
that a client on 127.0.0.1 is a stranger like any other (the rule of
``scheduler_plugins.dashboard_guard``).  Each test plays its requesters from its own loopback
address (127.0.0.0/8 all reach 127.0.0.1), so the guard's per-IP bucket and the sign-in limits
per requester see them as different people.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import dask
import numpy as np
import pytest

from goblin_dask import LabNode
from tests.access_helpers import Site, WebClient, localhost_tls, mailbox, sign_in  # noqa: F401 (fixture)
from tests.conftest import wait_for

ADMIN = "admin@lab.example"


@pytest.fixture(scope="module")
def site(mailbox, tmp_path_factory):
    tls = localhost_tls(tmp_path_factory.mktemp("dashboard-tls"))
    config = {"goblin.smtp": {"host": "127.0.0.1", "port": mailbox.port, "from": "goblin lab <signin@lab.example>"},
              "goblin.admins": [ADMIN], "goblin.dashboard": {"trust-loopback": False}}
    with pytest.MonkeyPatch.context() as env, dask.config.set(config):
        env.setenv("DASK_DISTRIBUTED__SCHEDULER__DASHBOARD__TLS__CERT", str(tls.cert))
        env.setenv("DASK_DISTRIBUTED__SCHEDULER__DASHBOARD__TLS__KEY", str(tls.key))
        node = LabNode.local(volunteers=1, lab_threads=1)
    with node:
        yield Site(node, tls)


def _secrets(site: Site) -> list[str]:
    """What a stranger must not read: worker addresses, the volunteer's name, a task key."""
    return [site.node.lab_worker_address(), *site.node.volunteer_addresses(), *site.node.volunteer_names(),
            "lab-worker", "goblin-secret-task-key"]


def _private_paths(site: Site) -> list[str]:
    lab_worker = urllib.parse.quote(site.node.lab_worker_address(), safe="")
    return [
        "/info/main/workers.html", "/info/main/logs.html", f"/info/logs/{lab_worker}.html",
        f"/info/worker/{lab_worker}.html", "/info/task/goblin-secret-task-key.html", f"/info/call-stacks/{lab_worker}.html",
        "/status", "/workers", "/tasks", "/system", "/individual-plots.json", "/json/counts.json",
        "/json/identity.json", "/json/index.html", "/sitemap.json", "/metrics", "/statics/css/base.css",
        f"/proxy/{urllib.parse.urlsplit(site.base).port}/127.0.0.1/status", "/eventstream", "/api/v1",
        "/api/v1/retire_workers", "/static/js/bokeh.min.js",
    ]


def test_a_stranger_reads_no_page_of_distributeds_own(site, mailbox):
    client = site.node.client
    assert client.submit(np.add, 2, 3, key="goblin-secret-task-key").result() == 5
    stranger = WebClient(site, source_ip="127.0.0.11")
    secrets = _secrets(site)
    for path in _private_paths(site):
        for method in ("GET", "POST"):
            response = stranger.request(method, path, headers={"Content-Length": "0"} if method == "POST" else None)
            assert response.status == 403, (method, path, response.status)
            assert not [s for s in secrets if s in response.body], (path, response.body[:300])
    # What stays public: the health check, the sign-in pages, and the report's totals.
    assert stranger.get("/health").body == "ok"
    assert stranger.get("/goblin/signin").status == 200
    report = json.loads(stranger.get("/goblin/report.json").body)
    assert report["volunteer_count"] == 1 and "volunteers" not in report
    assert not [s for s in secrets if s in json.dumps(report)]

    researcher = WebClient(site, source_ip="127.0.0.12")  # signed in, but no admin
    assert sign_in(researcher, mailbox, "ada@uni.example").status == 303
    assert researcher.get("/info/main/workers.html").status == 403

    admin = WebClient(site, source_ip="127.0.0.13")
    assert sign_in(admin, mailbox, ADMIN).status == 303
    workers = admin.get("/info/main/workers.html")
    assert workers.status == 200 and site.node.volunteer_addresses()[site.node.volunteer_names()[0]] in workers.body
    lab_worker = urllib.parse.quote(site.node.lab_worker_address(), safe="")
    assert admin.get(f"/info/logs/{lab_worker}.html").status == 200
    assert admin.get("/status").status == 200
    assert set(json.loads(admin.get("/goblin/report.json").body)["volunteers"]) == set(site.node.volunteer_names())
    assert admin.post("/goblin/signout").status == 303
    assert admin.get("/info/main/workers.html").status == 403  # the session ended


def test_a_flood_of_dashboard_requests_does_not_starve_the_scheduler(site):
    """Four clients loop on the bokeh ``/status`` page while a 0.5 s job runs: it finishes in time."""
    stop, answers = threading.Event(), []

    def flood(ip: str):
        client = WebClient(site, source_ip=ip)
        while not stop.is_set():
            answers.append(client.get("/status").status)

    threads = [threading.Thread(target=flood, args=(f"127.0.0.{21 + i}",), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(answers) >= 55, "55 requests of the flood")
        started = time.monotonic()
        site.node.client.submit(time.sleep, 0.5, pure=False).result(timeout=30)
        took = time.monotonic() - started
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert took < 5, f"a 0.5 s job took {took:.1f} s under the flood"  # today's main: over 10 s
    assert set(answers) <= {403, 429} and len(answers) >= 55
    # the bucket bounds each IP's unauthenticated requests; the others still get in
    assert WebClient(site, source_ip="127.0.0.29").get("/goblin/signin").status == 200


def test_a_stranger_cannot_burn_or_block_the_admins_sign_in(site, mailbox):
    """Code requests and wrong codes from a stranger leave the admin's e-mailed code and quota alone."""
    admin, stranger = WebClient(site, source_ip="127.0.0.31"), WebClient(site, source_ip="127.0.0.32")
    admin.get("/goblin/signin")
    sent = len(mailbox.to(ADMIN))
    assert admin.post("/goblin/signin", email=ADMIN).status == 200
    code = mailbox.next_code(ADMIN, sent)

    stranger.get("/goblin/signin")
    for _ in range(3):
        assert stranger.post("/goblin/signin", email=ADMIN).status == 200
    assert stranger.post("/goblin/signin", email=ADMIN).status == 429
    wrong = f"{(int(code) + 1) % 10**6:06d}"
    for _ in range(6):
        assert stranger.post("/goblin/signin/code", email=ADMIN, code=wrong).status == 403

    assert admin.post("/goblin/signin", email=ADMIN).status == 200  # the admin's next request is not refused
    signed_in = admin.post("/goblin/signin/code", email=ADMIN, code=code)  # and the first code still works
    assert signed_in.status == 303 and signed_in.cookie("goblin_session")
    assert admin.get("/goblin/admin").status == 200


def test_on_every_interface_loopback_is_no_admin(tmp_path):
    """``goblin node --host 0.0.0.0``: by default the guard trusts loopback only when the dashboard listens on
    loopback alone, so here 127.0.0.1 needs a session like anyone."""
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    proc = subprocess.Popen([sys.executable, "-m", "goblin_dask.cli", "node", "--host", "0.0.0.0", "--port", "0",
                             "--dashboard-port", "0", "--state-dir", str(state)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    try:
        wait_for(lambda: (state / "node.json").exists() or proc.poll() is not None, "the node")
        assert proc.poll() is None
        port = urllib.parse.urlsplit(json.loads((state / "node.json").read_text())["dashboard_link"]).port
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(base + "/health", timeout=30) as ok:
            assert ok.read() == b"ok"
        for path in ("/info/main/workers.html", "/status", "/json/identity.json"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(base + path, timeout=30)
            assert refused.value.code == 403
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="CI tests the installed distribution (.ci/run)")
def test_ci_tests_the_installed_distribution():
    import sysconfig

    import goblin_dask
    import scheduler_plugins

    site_packages = Path(sysconfig.get_paths()["purelib"]).resolve()
    for module in (goblin_dask, scheduler_plugins):
        assert site_packages in Path(module.__file__).resolve().parents, module.__file__
    assert (Path(goblin_dask.__file__).parent / "access" / "templates" / "signin.html").is_file()
