"""Shared fixtures: real lab nodes and volunteer processes on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from dask._task_spec import DataNode, TaskRef

from goblin_dask.node.local import LabNode
from goblin_dask.ops import CatalogTask, get
from goblin_dask.validation.checks import insert_checks

# The lab node's processes import the test modules' functions (the lab shares the
# researcher's environment); volunteers never import them.
_ROOT = str(Path(__file__).resolve().parent.parent)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(scope="session")
def lab():
    """One embedded grid (lab node + 2 volunteer processes) shared by the session's tests."""
    with LabNode.local(volunteers=2) as node:
        yield node


def wait_for(predicate, what: str, timeout: float = 60.0, interval: float = 0.05):
    """Poll until ``predicate()`` is true (waiting on an event, not timing anything)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def volunteer_cache_stats(node, name: str) -> dict:
    """What volunteer ``name``'s cache did, from its own status page (``/api/status``), as the volunteer sees it."""
    import json
    import urllib.request

    from goblin_dask.volunteer import CONTROL_FILE, TOKEN_FILE

    vdir = node.state_dir / "volunteers" / name
    url = json.loads((vdir / CONTROL_FILE).read_text())["url"]
    token = (vdir / TOKEN_FILE).read_text().strip()
    req = urllib.request.Request(url + "/api/status", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["cache"]


def blocked_product_graph(a: np.ndarray, b: np.ndarray, block: int):
    """Graph of C = A @ B by blocks: one matmul task per (i, j, k), opaque keys like the array layer's.

    Returns (graph, keys of the block products, block counts); key[1:] is (i, j, k).
    """
    from dask.base import tokenize

    tok = tokenize(a, b, block)
    src_a, src_b, prod = f"source-{tok[:16]}", f"source-{tok[16:]}", f"matmul-{tok}"
    dsk = {}
    nb_i, nb_k, nb_j = (-(-a.shape[0] // block), -(-a.shape[1] // block), -(-b.shape[1] // block))
    for i in range(nb_i):
        for k in range(nb_k):
            dsk[(src_a, i, k)] = DataNode((src_a, i, k), a[i * block:(i + 1) * block, k * block:(k + 1) * block])
    for k in range(nb_k):
        for j in range(nb_j):
            dsk[(src_b, k, j)] = DataNode((src_b, k, j), b[k * block:(k + 1) * block, j * block:(j + 1) * block])
    keys = []
    for i in range(nb_i):
        for j in range(nb_j):
            for k in range(nb_k):
                key = (prod, i, j, k)
                dsk[key] = CatalogTask(key, get("matmul"), TaskRef((src_a, i, k)), TaskRef((src_b, k, j)))
                keys.append(key)
    return insert_checks(dsk), keys, (nb_i, nb_j, nb_k)


def assemble(results: dict, shape, blocks) -> np.ndarray:
    nb_i, nb_j, nb_k = blocks
    rows = []
    for i in range(nb_i):
        rows.append(np.concatenate([sum(results[(i, j, k)] for k in range(nb_k)) for j in range(nb_j)], axis=1))
    return np.concatenate(rows, axis=0)


@contextlib.contextmanager
def rogue_scheduler(tmp_path, preload: str = "tests.rogue_preload", env: dict | None = None):
    """A compromised lab node's scheduler: a plain dask scheduler (no goblin plugins) under ``preload``,
    holding a certificate of the lab's own CA.  Yields (client, node credential, stolen state directory)."""
    from distributed import Client

    from goblin_dask.tls import LabCA

    # The compromised node holds the lab's own keys: it is the lab's CA that signed it.
    state = tmp_path / "stolen-lab-state"
    node_cred = LabCA(state).issue("lab", "lab-node")
    for part in ("ca", "cert", "key"):
        (tmp_path / f"node-{part}.pem").write_text(getattr(node_cred, part))
    sched_file = tmp_path / "scheduler.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    sched = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                              "--port", "0", "--no-dashboard", "--scheduler-file", str(sched_file),
                              "--preload", preload,
                              "--protocol", "tls", "--tls-ca-file", str(tmp_path / "node-ca.pem"),
                              "--tls-cert", str(tmp_path / "node-cert.pem"), "--tls-key", str(tmp_path / "node-key.pem")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    try:
        wait_for(sched_file.exists, "the rogue scheduler")
        client = Client(scheduler_file=str(sched_file), timeout=60, security=node_cred.security())
        try:
            yield client, node_cred, state
        finally:
            client.close()
    finally:
        kill_group(sched)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
    proc.wait()


def start_goblin_volunteer(address: str, state: Path, name: str, log: Path, env: dict | None = None,
                           args: tuple[str, ...] = ()) -> subprocess.Popen:
    """``python -m goblin_dask.volunteer ADDRESS [ARGS]`` with a credential ``name`` of the lab CA in ``state``."""
    from goblin_dask.credentials import issue_credential

    token = issue_credential(state, "volunteer", name).encode()
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "goblin_dask.volunteer", address, "--state-dir",
                                 str(log.parent / f"{name}-state"), *args], stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {}), "GOBLIN_TOKEN": token})


@pytest.fixture
def rogue_node(tmp_path):
    """A compromised lab node: a plain dask scheduler (no goblin plugins) with one goblin volunteer.

    Yields (client, volunteer_address, volunteer_log_path, marker_path).
    """
    with rogue_scheduler(tmp_path) as (client, _, state):
        log = tmp_path / "volunteer.log"
        vol = start_goblin_volunteer(client.scheduler.address, state, "victim", log)
        try:
            wait_for(lambda: len(client.scheduler_info()["workers"]) == 1, "the volunteer to join the rogue node")
            address = next(iter(client.scheduler_info()["workers"]))
            yield client, address, log, tmp_path / "pwned", vol
        finally:
            kill_group(vol)


def read_log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""
