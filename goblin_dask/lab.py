"""Compatibility names: the lab node's modules are in :mod:`goblin_dask.node`, one per role.

``from goblin_dask.lab import LabNode`` keeps working; new code imports from ``goblin_dask.node.*``.
"""

from __future__ import annotations

from typing import Any

from goblin_dask.node.local import LabNode, LabNodeStartError, connect
from goblin_dask.node.process import run_async
from goblin_dask.node.scheduler import default_state_dir, read_node_file, serve_node

__all__ = ["LabNode", "LabNodeStartError", "connect", "default_state_dir", "read_node_file", "run_async",
           "serve_lab_worker", "serve_node"]


def __getattr__(name: str) -> Any:
    if name == "serve_lab_worker":  # imports distributed's worker: on use only
        from goblin_dask.node.lab_worker import serve_lab_worker

        return serve_lab_worker
    raise AttributeError(f"module 'goblin_dask.lab' has no attribute {name!r}")
