"""The researcher sign-in pages on a real lab node's dashboard, over HTTPS, with e-mail through a real SMTP server.

The site is ``LabNode.local(volunteers=0)`` (the ``goblin node`` process and the lab worker)
started with ``goblin.smtp`` and ``goblin.admins`` in dask config and its dashboard served
over TLS, so the pages are the ones ``scheduler_plugins.install`` puts on a lab node's
dashboard, and a credential approved there connects to that node.  Codes go through an
aiosmtpd server in this process.  The HTTP tests check status codes, headers and cookies
(verifying the server's certificate); the browser tests drive headless Chromium through the
same pages a researcher and an admin use.
"""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys

import dask
import numpy as np
import pytest

from goblin_dask import LabNode, connect
from tests.access_helpers import headless_chromium, Mailbox, Site, WebClient, localhost_tls, mailbox, sign_in  # noqa: F401 (fixture)
from tests.conftest import wait_for

ADMIN = "admin@lab.example"


@pytest.fixture(scope="module")
def site(mailbox, tmp_path_factory):
    """A lab node whose dashboard serves the sign-in pages over HTTPS and e-mails codes through ``mailbox``."""
    tls = localhost_tls(tmp_path_factory.mktemp("dashboard-tls"))
    config = {"goblin.smtp": {"host": "127.0.0.1", "port": mailbox.port, "from": "goblin lab <signin@lab.example>"},
              "goblin.admins": [ADMIN],
              "goblin.signin": {"codes-per-ip": 1000}}  # every test's client is 127.0.0.1
    with pytest.MonkeyPatch.context() as env, dask.config.set(config):
        env.setenv("DASK_DISTRIBUTED__SCHEDULER__DASHBOARD__TLS__CERT", str(tls.cert))
        env.setenv("DASK_DISTRIBUTED__SCHEDULER__DASHBOARD__TLS__KEY", str(tls.key))
        node = LabNode.local(volunteers=0, lab_threads=1)
    with node:
        yield Site(node, tls)


# -- HTTP -------------------------------------------------------------------------------


def test_the_lab_nodes_dashboard_serves_the_sign_in_page_over_https(site):
    assert site.node.dashboard_link.startswith("https://127.0.0.1:") and site.node.dashboard_link.endswith("/status")
    client = WebClient(site)
    assert client.get("/status").status == 200  # the dashboard itself, on the same server
    page = client.get("/goblin/signin")
    assert page.status == 200 and '<label for="email">E-mail address</label>' in page.body
    assert "not set up on this lab node" not in page.body  # the node took goblin.smtp from the caller's config
    assert "default-src 'none'" in page.headers["Content-Security-Policy"] and "<script" not in page.body
    xsrf = page.cookie("_xsrf")
    assert all(flag in xsrf for flag in ("HttpOnly", "SameSite=Strict", "Secure"))


def test_an_e_mailed_code_opens_a_session_with_a_strict_cookie(site, mailbox):
    client = WebClient(site)

    signed_in = sign_in(client, mailbox, "ada@uni.example")
    message = mailbox.to("ada@uni.example")[-1]
    assert message["From"] == "goblin lab <signin@lab.example>"
    assert signed_in.status == 303 and signed_in.headers["Location"] == "/goblin/access"
    session = signed_in.cookie("goblin_session")
    assert all(flag in session for flag in ("HttpOnly", "SameSite=Strict", "Secure"))
    access = client.get("/goblin/access")
    assert access.status == 200 and "Signed in as ada@uni.example" in access.body
    assert '<label for="purpose">Research purpose' in access.body

    assert client.post("/goblin/signout").status == 303
    assert client.get("/goblin/access").status == 302


def test_a_code_works_once(site, mailbox):
    client = WebClient(site)
    client.get("/goblin/signin")
    sent = len(mailbox.to("once@uni.example"))
    client.post("/goblin/signin", email="once@uni.example")
    code = mailbox.next_code("once@uni.example", sent)
    assert client.post("/goblin/signin/code", email="once@uni.example", code=code).status == 303
    again = WebClient(site)
    again.get("/goblin/signin")
    replay = again.post("/goblin/signin/code", email="once@uni.example", code=code)
    assert replay.status == 403 and "already used" in replay.body and "goblin_session" not in again.cookies


def test_forms_without_the_xsrf_token_are_refused(site, mailbox):
    client = WebClient(site)
    client.get("/goblin/signin")
    refused = client.request("POST", "/goblin/signin", {"email": "csrf@uni.example"}, xsrf=False)
    assert refused.status == 403 and "not sent from this site" in refused.body
    forged = client.request("POST", "/goblin/signin", {"email": "csrf@uni.example", "_xsrf": "2|00|00|00"}, xsrf=False)
    assert forged.status == 403
    assert mailbox.to("csrf@uni.example") == []


def test_too_many_code_requests_get_a_429_page(site, mailbox):
    client = WebClient(site)
    client.get("/goblin/signin")
    for _ in range(3):
        assert client.post("/goblin/signin", email="eager@uni.example").status == 200
    limited = client.post("/goblin/signin", email="EAGER@uni.example")
    assert limited.status == 429 and "Too many sign-in codes requested" in limited.body
    assert 0 < int(limited.headers["Retry-After"]) <= 600
    assert len(mailbox.to("eager@uni.example")) == 3  # each page came after its e-mail was accepted


def test_an_undeliverable_code_gets_a_502_page(site, mailbox):
    mailbox.bounce.add("bounce@uni.example")
    client = WebClient(site)
    client.get("/goblin/signin")
    failed = client.post("/goblin/signin", email="bounce@uni.example")
    assert failed.status == 502 and "could not send the sign-in code" in failed.body
    assert mailbox.to("bounce@uni.example") == []


def test_a_request_approved_with_the_goblin_command_connects(site, mailbox):
    client = WebClient(site)
    assert sign_in(client, mailbox, "lovelace@uni.example").status == 303
    assert client.post("/goblin/access", name="Ada Lovelace", affiliation="Analytical Engines",
                       purpose="Bernoulli numbers").status == 303
    assert "Your access request is pending" in client.get("/goblin/access").body
    assert site.registry.get("lovelace@uni.example").credential_path is None

    def goblin(*args):
        return subprocess.run([sys.executable, "-m", "goblin_dask.cli", "researchers", *args,
                               "--state-dir", str(site.state_dir)], capture_output=True, text=True)

    assert "pending   lovelace@uni.example  Ada Lovelace" in goblin("list", "--status", "pending").stdout
    unfiled = goblin("approve", "babbage@uni.example")
    assert unfiled.returncode == 1 and "no access request from that address" in unfiled.stderr
    approved = goblin("approve", "Lovelace@Uni.Example")
    assert approved.returncode == 0, approved.stderr
    path = approved.stdout.strip()
    assert path == str(site.state_dir / "researchers" / "lovelace-uni-example.credential")
    assert "your credential is ready" in client.get("/goblin/access").body
    with connect(site.node.address, credential=path, timeout=30) as researcher:
        assert researcher.submit(np.subtract, 9, 4).result() == 5


def test_pages_need_a_session_and_the_admin_page_an_admin(site, mailbox):
    client = WebClient(site)
    client.get("/goblin/signin")
    for path in ("/goblin/access", "/goblin/admin"):
        response = client.get(path)
        assert response.status == 302 and response.headers["Location"].startswith("/goblin/signin")
    assert client.post("/goblin/access", name="x", affiliation="y", purpose="z").status == 403

    sign_in(client, mailbox, "mallory@uni.example")
    assert client.post("/goblin/access", name="Mallory", affiliation="Uni", purpose="p").status == 303
    assert client.get("/goblin/admin").status == 403
    assert client.post("/goblin/admin", email="mallory@uni.example", decision="approve").status == 403
    assert site.registry.get("mallory@uni.example").status == "pending"
    assert client.post("/goblin/signin/code", email="not an address", code="123456").status == 400


# -- the pages in headless Chromium ---------------------------------------------------


@pytest.fixture(scope="module")
def browser(request, tmp_path_factory):
    """Headless Chromium trusting the site's certificate (by its key's pin) and nothing else new."""
    site = request.getfixturevalue("site")
    driver = headless_chromium(site.tls.spki_sha256, tmp_path_factory.mktemp("chromium-profile"), "1000,800",
                               console_log=False)
    yield driver
    driver.quit()


class Visit:
    """One person's visit in the shared browser (it starts by forgetting the previous person's cookies)."""

    def __init__(self, browser, site: Site, mailbox: Mailbox):
        self.browser, self.site, self.mailbox = browser, site, mailbox
        self.open("/goblin/signin")
        browser.delete_all_cookies()

    def open(self, path: str) -> None:
        self.browser.get(self.site.base + path)

    def fill(self, **fields) -> None:
        from selenium.webdriver.common.by import By

        for label_for, value in fields.items():
            field = self.browser.find_element(By.ID, label_for)
            field.clear()
            field.send_keys(value)

    def press(self, button) -> None:
        """Click a form's ``button`` and wait for the page the server answers with (every form here posts)."""
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.expected_conditions import staleness_of

        from selenium.common.exceptions import WebDriverException

        page = self.browser.find_element(By.TAG_NAME, "html")
        button.click()

        def next_page_loaded() -> bool:
            try:
                return bool(staleness_of(page)(self.browser)
                            and self.browser.execute_script("return document.readyState") == "complete")
            except WebDriverException:  # mid-navigation Chromium may answer "node does not belong to the document"
                return False

        wait_for(next_page_loaded, "the next page")

    def submit(self) -> None:
        """Press the main form's button."""
        from selenium.webdriver.common.by import By

        self.press(self.browser.find_element(By.CSS_SELECTOR, "main form button[type=submit]"))

    def request_code(self, address: str) -> int:
        """Ask for a code on the sign-in page; returns how many e-mails ``address`` had before."""
        self.open("/goblin/signin")
        sent = len(self.mailbox.to(address))
        self.fill(email=address)
        self.submit()
        return sent

    def enter_code(self, address: str, code: str) -> None:
        self.fill(code=code)
        self.submit()

    def sign_in(self, address: str) -> None:
        sent = self.request_code(address)
        self.enter_code(address, self.mailbox.next_code(address, sent))
        assert self.heading() == "Research access", self.text()

    def heading(self) -> str:
        from selenium.webdriver.common.by import By

        return self.browser.find_element(By.TAG_NAME, "h1").text

    def text(self) -> str:
        from selenium.webdriver.common.by import By

        return self.browser.find_element(By.TAG_NAME, "main").text

    def decide(self, address: str, decision: str) -> None:
        from selenium.webdriver.common.by import By

        self.open("/goblin/admin")
        row = self.browser.find_element(By.CSS_SELECTOR, f"tr[data-email='{address}']")
        self.press(row.find_element(By.CSS_SELECTOR, f"button[value='{decision}']"))


@pytest.mark.slow  # about 10 s with Chromium's start
def test_researcher_signs_in_requests_access_and_is_approved(browser, site, mailbox, tmp_path):
    researcher = Visit(browser, site, mailbox)
    assert researcher.heading() == "Sign in" and browser.title == "Sign in · goblin lab node"
    screenshot = tmp_path / "signin.png"
    browser.save_screenshot(str(screenshot))
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 5000

    researcher.sign_in("hopper@navy.example")
    researcher.fill(name="Grace Hopper", affiliation="US Navy", purpose="Compiling tables of arc tangents")
    researcher.submit()
    assert "Your access request is pending" in researcher.text()

    admin = Visit(browser, site, mailbox)
    admin.sign_in(ADMIN)
    assert "review access requests" in admin.text()
    admin.open("/goblin/admin")
    assert "Grace Hopper" in admin.text() and "Compiling tables of arc tangents" in admin.text()
    admin.decide("hopper@navy.example", "approve")
    assert admin.heading() == "Access requests" and "approved" in admin.text()

    researcher = Visit(browser, site, mailbox)
    researcher.sign_in("hopper@navy.example")
    assert "your credential is ready" in researcher.text()
    assert "hopper-navy-example.credential" in researcher.text()
    assert "BEGIN" not in browser.page_source  # no key material on the page
    path = site.registry.get("hopper@navy.example").credential_path
    with connect(site.node.address, credential=path, timeout=30) as client:
        assert client.submit(np.multiply, 6, 7).result() == 42


def test_wrong_and_expired_codes_are_refused_in_the_browser(browser, site, mailbox):
    visit = Visit(browser, site, mailbox)
    code = visit.mailbox.next_code("typo@uni.example", visit.request_code("typo@uni.example"))
    wrong = f"{(int(code) + 1) % 10**6:06d}"
    for left in ("4 tries", "3 tries", "2 tries", "1 try"):
        visit.enter_code("typo@uni.example", wrong)
        assert f"Wrong code ({left} left)" in visit.text()
    visit.enter_code("typo@uni.example", wrong)
    assert "last try" in visit.text() and "Request a new code" in visit.text()
    visit.open("/goblin/access")
    assert visit.heading() == "Sign in"  # no session came of it

    code = visit.mailbox.next_code("late@uni.example", visit.request_code("late@uni.example"))
    with sqlite3.connect(site.registry.path) as db:  # as if the ten minutes had passed
        db.execute("UPDATE codes SET expires_at = expires_at - 600 WHERE email = 'late@uni.example'")
    visit.enter_code("late@uni.example", code)
    assert "This sign-in code has expired" in visit.text()


def test_the_rate_limit_page_in_the_browser(browser, site, mailbox):
    visit = Visit(browser, site, mailbox)
    for _ in range(3):
        visit.request_code("impatient@uni.example")
        assert visit.heading() == "Enter your sign-in code"
    visit.request_code("impatient@uni.example")
    assert visit.heading() == "Too many sign-in codes requested"
    assert re.search(r"new code in \d+ minutes?", visit.text())


def test_a_refused_request_gets_nothing(browser, site, mailbox):
    researcher = Visit(browser, site, mailbox)
    researcher.sign_in("eve@evil.example")
    researcher.fill(name="Eve", affiliation="Evil Corp", purpose="Mining the lab's data")
    researcher.submit()

    admin = Visit(browser, site, mailbox)
    admin.sign_in(ADMIN)
    admin.decide("eve@evil.example", "refuse")
    assert "refused" in admin.text()

    researcher = Visit(browser, site, mailbox)
    researcher.sign_in("eve@evil.example")
    assert "Your access request was refused" in researcher.text()
    researcher.open("/goblin/admin")
    assert researcher.heading() == "Only a lab admin may see this page"
    request = site.registry.get("eve@evil.example")
    assert request.status == "refused" and request.credential_path is None
    assert not (site.state_dir / "researchers" / "eve-evil-example.credential").exists()
