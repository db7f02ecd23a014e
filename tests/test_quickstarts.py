"""The docs' three quickstarts run as written (issue 31): the lab admin's, the volunteer's and the researcher's,
on one real grid: ``goblin node`` with its lab worker, a ``goblin volunteer`` process joining with a credential
from ``goblin enroll``, a researcher connecting with a credential from ``goblin researchers issue`` and computing
a product that volunteers compute and the lab verifies.

Every ```bash and ```python block of the pages runs as the page writes it, in order, with only the page's
example values put in place (:data:`EXAMPLE_VALUES`: the lab's host name, its ports, its state directory) and
the install lines left out (``python3 -m venv ... && pip install .``: the environment running the tests is that
install).  Each role works in its own directory, with its own HOME, and gets its files as the pages say: the
admin hands the credential files over, the volunteer makes its file private.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path


from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "docs" / "quickstart"


def blocks(page: str, language: str) -> list[list[str]]:
    """The ```language blocks of ``docs/quickstart/PAGE.md``, each as its lines (bash) or its one text (python)."""
    text = (QUICKSTART / f"{page}.md").read_text()
    found = re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)
    if language == "bash":
        return [[line for line in b.splitlines() if line.strip()] for b in found]
    return [[b] for b in found]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _is_install(line: str) -> bool:
    return line.startswith("python3 -m venv ") and line.endswith("pip install .")


class Grid:
    """The roles' directories and environment, and the processes the pages start (stopped at the end)."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        scheduler, dashboard, lab_worker = _free_ports(3)
        self.state = tmp / "srv-goblin"
        #: the pages' example values -> this grid's; nothing else of a command changes
        self.values = {"/srv/goblin": str(self.state), "lab.example": "127.0.0.1", "0.0.0.0": "127.0.0.1",
                       "8786": str(scheduler), "8787": str(dashboard), "8788": str(lab_worker)}
        self.processes: list[subprocess.Popen] = []

    def env(self, role: str) -> dict[str, str]:
        home = self.tmp / role / "home"
        home.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GOBLIN_", "XDG_"))}
        bin_dir = os.path.dirname(sys.executable)  # the install's `goblin` and `python` first
        return {**env, "HOME": str(home), "PATH": bin_dir + os.pathsep + env.get("PATH", ""),
                "XDG_STATE_HOME": str(home / ".local" / "state"), "XDG_CACHE_HOME": str(home / ".cache")}

    def cwd(self, role: str) -> Path:
        path = self.tmp / role
        path.mkdir(parents=True, exist_ok=True)
        return path

    def put(self, text: str) -> str:
        for example in sorted(self.values, key=len, reverse=True):
            text = text.replace(example, self.values[example])
        return text

    def run(self, role: str, line: str, timeout: float = 120) -> subprocess.CompletedProcess:
        done = subprocess.run(["bash", "-c", self.put(line)], cwd=self.cwd(role), env=self.env(role),
                              capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{line!r} as the {role} ran it:\n{done.stdout}\n{done.stderr[-4000:]}"
        return done

    def start(self, role: str, line: str) -> Path:
        log = self.cwd(role) / f"process-{len(self.processes)}.log"
        with open(log, "w") as out:
            self.processes.append(subprocess.Popen(["bash", "-c", "exec " + self.put(line)], cwd=self.cwd(role),
                                                   env=self.env(role), stdout=out, stderr=subprocess.STDOUT,
                                                   start_new_session=True))
        return log

    def stop(self) -> None:
        for proc in reversed(self.processes):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.processes):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _admin_report(address: str, state: Path) -> dict:
    from goblin_dask import connect
    from goblin_dask.node import rpc

    with connect(address, credential=str(state / "admin.credential"), timeout=30, set_as_default=False) as client:
        report = client.sync(getattr(client.scheduler, rpc.REPORT))
        workers = client.scheduler_info(n_workers=-1)["workers"]
    return {**report, "connected": len(workers)}


def test_the_lab_admin_volunteer_and_researcher_quickstarts_run_as_written(tmp_path):
    grid = Grid(tmp_path)
    admin, volunteer, researcher = blocks("lab-admin", "bash"), blocks("volunteer", "bash"), \
        blocks("researcher", "bash")
    try:
        # -- the lab admin: 1. install and start the node, 2. enroll a volunteer, 3. let a researcher in
        install, start = admin[0]
        assert _is_install(install) and start.startswith("goblin node ")
        node_log = grid.start("admin", start)
        wait_for(lambda: "goblin lab node at tls://" in node_log.read_text() or grid.processes[0].poll() is not None,
                 "the node's banner", timeout=120)
        banner = node_log.read_text()
        assert grid.processes[0].poll() is None, banner
        address = re.search(r"goblin lab node at (tls://\S+)", banner).group(1)
        assert address == grid.put("tls://lab.example:8786"), banner
        # the banner links the lab page, everyone's, not the admin's /status; and that page is served there
        page = re.search(r"^lab page: (\S+)", banner, flags=re.M).group(1)
        assert page == grid.put("http://lab.example:8787/goblin/"), banner
        with urllib.request.urlopen(page, timeout=30) as response:
            assert response.status == 200 and "goblin lab node" in response.read().decode()
        for enroll in admin[1]:  # alice's credential, and her second GPU's (--person alice)
            grid.run("admin", enroll)
        alice = grid.cwd("admin") / "alice.credential"
        assert alice.is_file() and oct(alice.stat().st_mode & 0o777) == "0o600"
        persons = json.loads((grid.state / "volunteers.json").read_text())["volunteers"]
        assert {n: e["person"] for n, e in persons.items()} == {"alice": "alice", "alice-gpu1": "alice"}, persons
        (issue,) = admin[2]
        issued = grid.run("admin", issue).stdout.strip()
        assert issued == str(grid.state / "researchers" / "bob.credential") and Path(issued).is_file()

        # -- the volunteer: 1. install, 2. join with the file the admin handed over (made private as the page says)
        (install,) = volunteer[0]
        assert _is_install(install)
        shutil.copy(alice, grid.cwd("volunteer") / "alice.credential")
        grid.run("volunteer", "chmod 600 alice.credential")
        (join,) = volunteer[1]
        assert join.startswith("goblin volunteer tls://lab.example:8786 --token alice.credential")
        volunteer_log = grid.start("volunteer", join)
        wait_for(lambda: _admin_report(address, grid.state)["connected"] >= 2 or grid.processes[1].poll() is not None,
                 "the volunteer to join (the lab worker and it)", timeout=120, interval=0.5)
        assert grid.processes[1].poll() is None, volunteer_log.read_text()

        # -- the lab admin: 4. check it, as bob
        (doctor,) = admin[3]
        checked = grid.run("admin", doctor).stdout
        assert [line.split(":")[0] for line in checked.splitlines()] == [
            "ok   credential", "ok   TLS", "ok   role", "ok   lab worker", "ok   task"], checked
        assert "researcher 'bob'" in checked and "matches numpy" in checked

        # -- the researcher: install, then on the lab's grid with the file the admin handed over: check, compute
        assert [_is_install(line) for line in researcher[0]] == [True]
        shutil.copy(issued, grid.cwd("researcher") / "bob.credential")
        os.chmod(grid.cwd("researcher") / "bob.credential", 0o600)
        grid.values["NAME.credential"] = "bob.credential"  # the page's name for the file the researcher got
        (doctor,) = researcher[1]
        assert "ok   task" in grid.run("researcher", doctor).stdout
        on_the_grid = blocks("researcher", "python")[1][0]
        assert 'credential="NAME.credential"' in on_the_grid
        before = _admin_report(address, grid.state)
        done = subprocess.run([sys.executable, "-c", grid.put(on_the_grid)], cwd=grid.cwd("researcher"),
                              env=grid.env("researcher"), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
        assert 0 <= float(done.stdout.split()[-1]) < 1e-9  # against numpy's a @ a.T of the same a, in the snippet
        after = _admin_report(address, grid.state)
        sent = after["placement_by_researcher"]["bob"]["volunteer"] - before["placement_by_researcher"]["bob"]["volunteer"]
        assert sent > 0, after["placement_by_researcher"]  # blocks of bob's product went to the volunteer ...
        assert after["accepted"] - before["accepted"] >= sent and after["rejected"] == 0  # ... and the lab verified them

        # -- the volunteer: 3. control it
        status, pause, resume = volunteer[2]
        said = grid.run("volunteer", status).stdout
        assert re.search(r"\b[1-9]\d* tasks done", said), said  # it computed tasks ...
        # ... and shows the lab's record of them once it asked for it again (every LAB_REFRESH seconds)
        wait_for(lambda: re.search(r"verified [1-9]", grid.run("volunteer", status).stdout),
                 "the volunteer's status to show its verified work", timeout=60, interval=1.0)
        grid.run("volunteer", pause)
        grid.run("volunteer", resume)
        assert grid.processes[1].poll() is None
    finally:
        grid.stop()
