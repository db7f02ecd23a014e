"""goblin-dask: verified scientific computing on volunteer machines.

Import-light on purpose: the lab node, the array API and the catalog load on first use.  Importing
it loads the ``goblin.*`` dask-config defaults (:mod:`goblin_dask.settings`, ``goblin.yaml``).
"""

from __future__ import annotations

from typing import Any

from goblin_dask import settings  # noqa: F401  (the goblin.* defaults into dask's config)

__version__ = "0.1.0"
__all__ = ["Graph", "LabNode", "capture", "connect", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("LabNode", "connect"):
        from goblin_dask.node import local

        return getattr(local, name)
    if name in ("capture", "Graph"):  # PyTorch models as catalog graphs; torch loads only when capture runs
        import importlib

        return getattr(importlib.import_module("goblin_dask.torch_capture"), name)
    raise AttributeError(f"module 'goblin_dask' has no attribute {name!r}")
