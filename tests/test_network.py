"""The lab and its volunteers on a real network: NAT, home-broadband links, links that drop, restarts.

Each test builds its own :class:`tests.nettestbed.Testbed` (network namespaces, veth pairs, nftables
masquerade, tc tbf, a delay relay; the real ``goblin node``, ``goblin enroll`` and ``goblin volunteer`` in
them) and removes it afterwards, whatever happened.  They need root, iproute2, nftables and conntrack: elsewhere they
skip, except under ``CI=true``, where they fail (CI installs them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.nettestbed import HOME_LAN_HOST, Testbed, unavailable_reason

N, CHUNK = 1024, 256  # 64 block products: a few seconds on the shaped links, tasks on both volunteers


@pytest.fixture
def testbed(tmp_path):
    """``testbed(**options)`` builds a :class:`Testbed` (up to 2); all are torn down when the test ends."""
    beds: list[Testbed] = []

    def make(**options) -> Testbed:
        why = unavailable_reason()
        if why is not None:
            if os.environ.get("CI") == "true":
                pytest.fail(f"the network testbed cannot be built under CI: {why}")
            pytest.skip(f"the network testbed cannot be built here: {why}")
        bed = Testbed(tmp_path / f"bed{len(beds)}", **options)
        beds.append(bed)
        return bed.start()

    yield make
    for bed in beds:
        bed.close()


def operands(seed: int):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((N, N)), rng.standard_normal((N, N))


def product(a, b) -> np.ndarray:
    """The verified product on the lab node (the researcher's default client)."""
    import goblin_dask.array as ga

    return (ga.from_array(a, chunks=CHUNK) @ ga.from_array(b, chunks=CHUNK)).compute()


def assert_matches_numpy(c, a, b):
    np.testing.assert_allclose(c, a @ b, rtol=1e-10, atol=1e-10)


def wait_until_processing(bed: Testbed, admin, name: str) -> str:
    """Wait until volunteer ``name`` holds tasks of the running product; returns its address."""
    found = {}

    def holding():
        address = bed.volunteer_address(name)
        found["address"] = address
        return address is not None and bool(admin.processing(workers=[address]).get(address))

    bed.wait_for(holding, f"{name} to hold tasks", 120, interval=0.05)
    return found["address"]


def test_volunteers_behind_nat_compute_a_verified_product_and_the_lab_cannot_reach_them(testbed):
    bed = testbed()
    home = bed.homes[0]
    # the volunteer opens no listening socket at all (its link to the lab is outbound; no status page here)
    listening = subprocess.run(["ip", "netns", "exec", home.host, "ss", "-Hltn"], capture_output=True, text=True)
    assert listening.returncode == 0 and listening.stdout.strip() == ""

    bed.client()
    a, b = operands(1)
    assert_matches_numpy(product(a, b), a, b)
    report = bed.report()
    assert report["rejected"] == 0
    for h in bed.homes:  # both volunteers computed, and their bytes went through their home's NAT and link
        assert report["volunteers"][h.volunteer]["accepted"] > 0
    bed.wait_for(lambda: all(v["up"] > 0 and v["down"] > 0 for v in bed.relayed_bytes().values()),
                 "the relay's byte counts", 10)

    # something listening at home is reachable at home, and not from the lab: no route into the home's
    # network, and the home router takes no new connection from outside
    bed.spawn("listener", home.host, [sys.executable, "-c", "import socket, time; s = socket.socket(); "
                                      "s.bind(('0.0.0.0', 9999)); s.listen(); time.sleep(3600)"])
    bed.wait_for(lambda: bed.try_connect(home.host, HOME_LAN_HOST, 9999) is None, "the listener at home", 30)
    assert bed.try_connect(bed.lab, HOME_LAN_HOST, 9999) is not None
    assert bed.try_connect(bed.lab, home.public, 9999) is not None
    assert bed.try_connect(bed.lab, home.public, 22) is not None


@pytest.mark.slow
def test_a_home_link_down_30_s_mid_product(testbed):
    """The product completes with numpy's numbers; the volunteer computes again once its link is back."""
    bed = testbed()
    bed.client()
    admin, home = bed.admin(), bed.homes[0]
    a, b = operands(2)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(product, a, b)
        old = wait_until_processing(bed, admin, home.volunteer)
        bed.link_down(home)
        time.sleep(30)  # the outage itself
        bed.link_up(home)
        back = time.monotonic()
        assert_matches_numpy(running.result(), a, b)
    bed.wait_for(lambda: bed.volunteer_address(home.volunteer) not in (None, old), f"{home.volunteer} to rejoin", 120)
    print(f"{home.volunteer} admitted again {time.monotonic() - back:.1f} s after its link returned")
    assert home.process.poll() is None  # the same agent, never exited
    before = bed.tasks_done(home.volunteer)
    a, b = operands(3)
    assert_matches_numpy(product(a, b), a, b)
    assert bed.tasks_done(home.volunteer) > before


@pytest.mark.slow
def test_an_agent_restarted_while_its_link_is_down_replaces_its_stale_registration(testbed):
    """Its old connections are half-open at the lab (no FIN arrived: the router rebooted and forgot them), and
    dead-after is long here: only the
    new connection, proven by the same certificate, can end them; the old registration's tasks are reissued."""
    bed = testbed(env={"DASK_GOBLIN__LINK__DEAD_AFTER": "600"})
    bed.client()
    admin, home = bed.admin(), bed.homes[0]
    a, b = operands(4)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(product, a, b)
        old = wait_until_processing(bed, admin, home.volunteer)
        bed.link_down(home)
        bed.stop(home.volunteer, signal.SIGKILL)  # its FIN and RST die on the dropped link
        bed.start_volunteer(home)
        bed.wait_for(lambda: "cannot reach lab node" in bed.log_tail(home.volunteer, 200),
                     "the new agent to retry while the link is down", 120)
        assert old in bed.workers()  # the lab still holds the old registration
        bed.link_up(home, router_rebooted=True)  # nothing of the old connections ever reaches the lab
        back = time.monotonic()
        bed.wait_for(lambda: bed.volunteer_address(home.volunteer) not in (None, old), "the new agent's admission", 120)
        print(f"{home.volunteer} restarted: admitted {time.monotonic() - back:.1f} s after its link returned")
        assert_matches_numpy(running.result(), a, b)
    assert old not in bed.workers()
    assert home.process.poll() is None
    assert "rejoined from" in bed.log_tail("node", 400) and f"registration at {old}" in bed.log_tail("node", 400)
    before = bed.tasks_done(home.volunteer)
    a, b = operands(5)
    assert_matches_numpy(product(a, b), a, b)
    assert bed.tasks_done(home.volunteer) > before


@pytest.mark.slow
def test_a_silent_volunteer_is_removed_after_dead_after_and_its_tasks_reissued(testbed):
    bed = testbed(env={"DASK_GOBLIN__LINK__DEAD_AFTER": "6"})
    bed.client()
    admin, (gone, stays) = bed.admin(), bed.homes
    a, b = operands(6)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(product, a, b)
        address = wait_until_processing(bed, admin, gone.volunteer)
        bed.link_down(gone)  # for good
        bed.wait_for(lambda: gone.volunteer not in bed.volunteer_names(), "the silent volunteer's removal", 120)
        assert_matches_numpy(running.result(), a, b)
    assert f"at {address} silent for" in bed.log_tail("node", 400)
    assert stays.volunteer in bed.volunteer_names()  # the one that heartbeats stays


@pytest.mark.slow
def test_volunteers_rejoin_a_restarted_lab_node_on_their_own(testbed):
    bed = testbed()
    old = {h.volunteer: bed.volunteer_address(h.volunteer) for h in bed.homes}
    bed.close_clients()
    bed.stop("node", signal.SIGTERM)
    bed.start_node()
    bed.wait_for_node()
    bed.wait_for(lambda: all(bed.volunteer_address(h.volunteer) not in (None, old[h.volunteer]) for h in bed.homes),
                 "both volunteers to rejoin the restarted node", 180)
    assert all(h.process.poll() is None for h in bed.homes)  # the same agents
    bed.client()
    a, b = operands(7)
    assert_matches_numpy(product(a, b), a, b)
    report = bed.report()
    assert report["rejected"] == 0 and sum(v["accepted"] for v in report["volunteers"].values()) > 0


def test_doctor_names_the_lab_workers_port_closed_in_the_lab_firewall(testbed):
    """`goblin doctor` from the lab's network passes; once the lab's firewall drops the lab worker's port (the
    scheduler's stays open), it names that port and what to open, and exits non-zero."""
    from goblin_dask.errors import EXIT_GAVE_UP
    from tests.nettestbed import LAB_PUBLIC, LAB_WORKER_PORT

    bed = testbed(homes_count=0, delay=None)
    credential = bed.enroll("doctor-vol", bed.workdir / "doctor-vol.credential")

    def doctor() -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", bed.research, sys.executable, "-m", "goblin_dask.cli", "doctor",
                               bed.address, "--credential", str(credential), "--timeout", "5"],
                              capture_output=True, text=True, timeout=300)

    lab_worker = f"tls://{LAB_PUBLIC}:{LAB_WORKER_PORT}"
    healthy = doctor()
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert f"ok   lab worker: {lab_worker} reachable" in healthy.stdout, healthy.stdout

    subprocess.run(["ip", "netns", "exec", bed.lab, "nft", "-f", "-"], check=True, text=True, input=f"""
table ip firewall {{
  chain input {{ type filter hook input priority filter; iifname "lan" tcp dport {LAB_WORKER_PORT} drop; }}
}}
""")
    closed = doctor()
    assert closed.returncode == EXIT_GAVE_UP, closed.stdout + closed.stderr
    assert [line.split(":")[0] for line in closed.stdout.splitlines()] == [
        "ok   credential", "ok   TLS", "ok   role", "FAIL lab worker"], closed.stdout
    assert (f"FAIL lab worker: the lab worker's port {lab_worker} cannot be reached: open it in the lab's firewall"
            in closed.stdout), closed.stdout
