"""goblin-dask: verified scientific computing on volunteer machines.

Import-light on purpose: the lab node, the array API and the catalog load on first use.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LabNode", "connect", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("LabNode", "connect"):
        from goblin_dask import lab

        return getattr(lab, name)
    raise AttributeError(f"module 'goblin_dask' has no attribute {name!r}")
