"""The lab node's scheduler (``goblin node``): a Dask scheduler with the goblin plugins.

While it runs, its state directory holds the node file (:data:`NODE_FILE`: address, dashboard
link, pid), which the ``goblin`` commands and :class:`~goblin_dask.node.local.LabNode` read, and it
holds the lock of :data:`LOCK_FILE` (``flock``, released by the kernel when the process ends, however it
ends): one node per state directory, so a second node can neither start beside it nor, when it exits,
remove the first's node file (and with it ``goblin revoke``'s way to the node that serves the credentials).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any, NamedTuple

import dask

from goblin_dask.node.process import close_on_signals

NODE_FILE = "node.json"
LOCK_FILE = "node.lock"
logger = logging.getLogger("goblin_dask.node")


def default_state_dir() -> Path:
    """``GOBLIN_STATE_DIR``, else ``~/.local/share/goblin-dask/node``."""
    return Path(os.environ.get("GOBLIN_STATE_DIR") or Path.home() / ".local" / "share" / "goblin-dask" / "node")


def read_node_file(state_dir: str | os.PathLike) -> dict[str, Any]:
    """The running node's address, dashboard link and pid; FileNotFoundError when none runs."""
    path = Path(state_dir) / NODE_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no lab node is running with state directory {state_dir} ({path} is missing)") from None


class StateDirInUse(RuntimeError):
    """Another lab node runs from this state directory."""


def lock_state_dir(state_dir: str | os.PathLike) -> int:
    """Take the state directory's lock for this process (its fd: keep it open while the node runs).

    StateDirInUse, naming the running node's address and pid, when another process holds it.
    """
    import fcntl

    path = Path(state_dir) / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = running_node(state_dir) or {}
        raise StateDirInUse(
            f"the state directory {state_dir} is in use by the lab node at {holder.get('address') or '(starting)'} "
            f"(pid {holder.get('pid', '?')}): one node per state directory; stop that one first, or give this "
            f"one another --state-dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid()}).encode())
    return fd


def running_node(state_dir: str | os.PathLike) -> dict[str, Any] | None:
    """``{"pid", "address"}`` of the node holding the state directory's lock (address None while it starts,
    or when its node file is gone), or None when no node runs from it."""
    import fcntl

    path = Path(state_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # held: a node runs
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        try:
            pid = json.loads(os.pread(fd, 256, 0) or b"{}").get("pid")
        except ValueError:
            pid = None
    finally:
        os.close(fd)
    try:
        info = read_node_file(state_dir)
    except (FileNotFoundError, ValueError):
        info = {}
    return {"pid": pid, "address": info.get("address") if info.get("pid") == pid else None}


def _write_node_file(state_dir: Path, info: dict[str, Any]) -> None:
    tmp = state_dir / (NODE_FILE + ".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(state_dir / NODE_FILE)


class LabWorkerOptions(NamedTuple):
    """How ``goblin node`` runs its trusted lab worker (see :func:`serve_node`)."""

    nthreads: int = 2
    memory_limit: str = "auto"
    port: int = 0  # the port volunteers reach it on (their standby connections)


async def serve_node(host: str, port: int, dashboard_port: int | None, state_dir: str | os.PathLike,
                     ready=None, lab_worker: LabWorkerOptions | None = None) -> None:
    """Run the lab node's scheduler until it is closed (``goblin node``).

    ``lab_worker``: also run the trusted lab worker (a child process, restarted if it dies):
    the lab's data, its checks and its lab-only ops run there, so a node without one computes
    nothing.  None: the caller starts it (``LabNode.local`` does, with its own log).  StateDirInUse
    when another node runs from ``state_dir``.
    """
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = lock_state_dir(state_dir)  # first: a second node on this directory touches nothing of the first's
    try:
        await _serve_node(host, port, dashboard_port, state_dir, ready, lab_worker)
    finally:
        os.close(lock)


async def _serve_node(host, port, dashboard_port, state_dir: Path, ready, lab_worker) -> None:
    from distributed import Scheduler

    import scheduler_plugins
    from goblin_dask import link
    from goblin_dask.credentials import admin_credential
    from goblin_dask.errors import PortInUseError, check_port_free
    from goblin_dask.node.process import quiet_monitors
    from goblin_dask.tls import LabCA

    check_port_free(host, port, "the scheduler", "--port")  # before anything starts, named
    if dashboard_port is not None:
        check_port_free(host, dashboard_port, "the dashboard", "--dashboard-port")
    link.install_lab_side()  # before the scheduler listens: volunteers' bytes are read as data only
    quiet_monitors()  # before the scheduler starts its periodic callbacks
    admin_credential(state_dir)  # so `goblin revoke` & co. can reach the node
    node_credential = LabCA(state_dir).issue("lab", "lab-node")
    dashboard = dashboard_port is not None
    scheduler_class = Scheduler if dashboard else _without_http_port(Scheduler)
    scheduler = scheduler_class(host=host, port=port, dashboard=dashboard, protocol="tls",
                                security=node_credential.security(),
                                dashboard_address=f"{host}:{dashboard_port}" if dashboard else None,
                                validate=False)
    plugins = scheduler_plugins.install(scheduler, state_dir)
    link.install_scheduler_side(scheduler, plugins["goblin-admission"])
    async with scheduler:
        if dashboard and dashboard_port and scheduler.http_server.port != dashboard_port:
            # distributed moves a taken dashboard port to a random one; the lab page's address would move
            await scheduler.close()
            raise PortInUseError(f"the dashboard port {dashboard_port} on {host} was taken while the node started: "
                                 f"stop what holds it or pick another with --dashboard-port")
        close_on_signals(scheduler)
        info = {"address": scheduler.address, "dashboard_link": _dashboard_link(scheduler, host), "pid": os.getpid()}
        _write_node_file(state_dir, info)
        if ready is not None:
            ready(info)
        supervisor = None
        if lab_worker is not None:
            supervisor = asyncio.ensure_future(_supervise_lab_worker(scheduler.address, host, state_dir, lab_worker))
        try:
            await scheduler.finished()
        finally:
            if supervisor is not None:
                supervisor.cancel()
                await asyncio.gather(supervisor, return_exceptions=True)
            try:  # its own node file only (the lock makes it so; a file rewritten by hand stays)
                if read_node_file(state_dir).get("pid") == os.getpid():
                    (state_dir / NODE_FILE).unlink(missing_ok=True)
            except (FileNotFoundError, ValueError):
                pass


async def _supervise_lab_worker(address: str, host: str, state_dir: Path, options: LabWorkerOptions) -> None:
    """Run the lab worker as a child process until cancelled; start it again when it dies
    (its log: ``STATE_DIR/logs/lab-worker.log``)."""
    import subprocess
    import sys

    from goblin_dask.credentials import issue_credential
    from goblin_dask.roles import LAB_WORKER_NAME

    credential = issue_credential(state_dir, "lab", LAB_WORKER_NAME).save(state_dir / "lab-worker.credential")
    (state_dir / "logs").mkdir(exist_ok=True, mode=0o700)
    args = [sys.executable, "-m", "goblin_dask.cli", "lab-worker", address, "--credential", str(credential),
            "--nthreads", str(options.nthreads), "--memory-limit", str(options.memory_limit), "--host", host,
            "--port", str(options.port)]
    delay = 1.0
    while True:
        with open(state_dir / "logs" / "lab-worker.log", "ab") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        started = asyncio.get_running_loop().time()
        try:
            while proc.poll() is None:
                await asyncio.sleep(0.5)
        except asyncio.CancelledError:
            proc.terminate()
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.wait), 10)
            except asyncio.TimeoutError:
                proc.kill()
            raise
        ran = asyncio.get_running_loop().time() - started
        delay = 1.0 if ran > 60 else min(delay * 2, 60.0)
        logger.warning("lab worker exited with code %s after %.0f s; starting it again in %.0f s",
                       proc.returncode, ran, delay)
        await asyncio.sleep(delay)


def _without_http_port(scheduler_class):
    """``scheduler_class`` listening on no HTTP port (``goblin node --no-dashboard``): distributed's scheduler
    serves /health, /metrics and its other routes without a dashboard too, on 8787 (or any free port when
    that is taken).  Its routes are still built (the goblin plugins add theirs to them); nothing serves them."""
    from distributed.http.routing import RoutingApplication
    from tornado.httpserver import HTTPServer

    class NoHTTPPortScheduler(scheduler_class):
        def start_http_server(self, routes, dashboard_address, default_port=0, ssl_options=None):
            self.http_application = RoutingApplication(routes)
            self.http_server = HTTPServer(self.http_application)  # never listens; stopped with nothing to stop

    return NoHTTPPortScheduler


def _dashboard_link(scheduler, host: str) -> str | None:
    port = scheduler.services.get("dashboard") and scheduler.http_server.port
    scheme = "https" if dask.config.get("distributed.scheduler.dashboard.tls.cert", None) else "http"
    return f"{scheme}://{host}:{port}/status" if port else None


def lab_page(dashboard_link: str | None) -> str | None:
    """The lab's page (``/goblin/``, everyone's) on the dashboard of ``dashboard_link`` (``/status``: the admin's)."""
    return dashboard_link.rsplit("/status", 1)[0] + "/goblin/" if dashboard_link else None
