"""The lab node's scheduler (``goblin node``): a Dask scheduler with the goblin plugins.

While it runs, its state directory holds the node file (:data:`NODE_FILE`: address, dashboard
link, pid), which the ``goblin`` commands and :class:`~goblin_dask.node.local.LabNode` read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import dask

from goblin_dask.node.process import close_on_signals

NODE_FILE = "node.json"


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


def _write_node_file(state_dir: Path, info: dict[str, Any]) -> None:
    tmp = state_dir / (NODE_FILE + ".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(state_dir / NODE_FILE)


async def serve_node(host: str, port: int, dashboard_port: int | None, state_dir: str | os.PathLike,
                     ready=None) -> None:
    """Run the lab node's scheduler until it is closed (``goblin node``)."""
    from distributed import Scheduler

    import scheduler_plugins
    from goblin_dask import link
    from goblin_dask.credentials import admin_credential
    from goblin_dask.tls import LabCA

    link.install_lab_side()  # before the scheduler listens: volunteers' bytes are read as data only
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    admin_credential(state_dir)  # so `goblin revoke` & co. can reach the node
    node_credential = LabCA(state_dir).issue("lab", "lab-node")
    dashboard = dashboard_port is not None
    scheduler = Scheduler(host=host, port=port, dashboard=dashboard, protocol="tls",
                          security=node_credential.security(),
                          dashboard_address=f"{host}:{dashboard_port}" if dashboard else None,
                          validate=False)
    plugins = scheduler_plugins.install(scheduler, state_dir)
    link.install_scheduler_side(scheduler, plugins["goblin-admission"])
    async with scheduler:
        close_on_signals(scheduler)
        info = {"address": scheduler.address, "dashboard_link": _dashboard_link(scheduler, host), "pid": os.getpid()}
        _write_node_file(state_dir, info)
        if ready is not None:
            ready(info)
        try:
            await scheduler.finished()
        finally:
            (state_dir / NODE_FILE).unlink(missing_ok=True)


def _dashboard_link(scheduler, host: str) -> str | None:
    port = scheduler.services.get("dashboard") and scheduler.http_server.port
    scheme = "https" if dask.config.get("distributed.scheduler.dashboard.tls.cert", None) else "http"
    return f"{scheme}://{host}:{port}/status" if port else None
