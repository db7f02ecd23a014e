"""goblin-dask: verified scientific computing on volunteer machines.

Import-light on purpose: the lab node, the array API and the catalog load on first use.  Importing
it loads the ``goblin.*`` dask-config defaults (:mod:`goblin_dask.settings`, ``goblin.yaml``).
"""

import importlib

importlib.import_module("goblin_dask.settings")  # the goblin.* defaults into dask's config

__version__ = "0.1.0"
__all__ = ["Graph", "LabNode", "capture", "connect", "__version__"]


def __getattr__(name: str):
    if name in ("LabNode", "connect"):
        from goblin_dask.node import local

        return getattr(local, name)
    if name in ("capture", "Graph"):  # PyTorch models as catalog graphs; torch loads only when capture runs
        return getattr(importlib.import_module("goblin_dask.torch_capture"), name)
    raise AttributeError(f"module 'goblin_dask' has no attribute {name!r}")


def __dir__() -> list[str]:
    """What a researcher uses (``dir(goblin_dask)``, tab completion): the public names, not the imports."""
    return sorted(__all__)
