"""goblin's settings: the ``goblin.*`` dask-config keys, with their defaults in ``goblin.yaml``.

Importing :mod:`goblin_dask` loads the defaults into dask's config, as importing distributed loads
``distributed.yaml``: ``dask.config.get("goblin")`` shows every key, and a lab node's processes
inherit the caller's values.  Readers call :func:`get` with the key only, never a default of
their own.
"""

from __future__ import annotations

import os
from typing import Any

import dask.config
import yaml

PATH = os.path.join(os.path.dirname(__file__), "goblin.yaml")

with open(PATH) as f:
    defaults: dict[str, Any] = yaml.safe_load(f)

dask.config.update_defaults(defaults)


def default(key: str) -> Any:
    """The default of ``key`` ("goblin.link.standby") in goblin.yaml; KeyError for a key it lacks."""
    value: Any = defaults
    for part in key.split("."):
        value = value[part]
    return value


def get(key: str) -> Any:
    """``dask.config.get(key)``; goblin.yaml's default where the key is missing.

    It goes missing when a caller sets a whole group to a partial dict
    (``dask.config.set({"goblin.smtp": {"host": ...}})`` replaces ``goblin.smtp``): its other keys
    keep their defaults.
    """
    return dask.config.get(key, default=default(key))


#: Keys whose value ``goblin info`` never prints (it may be pasted into an issue).
SECRET_KEYS = frozenset({"goblin.smtp.password"})


def effective_settings() -> dict[str, Any]:
    """Every ``goblin.*`` key with its value as this process sees it (secrets masked), in goblin.yaml's order."""

    def leaves(d: dict, prefix: str) -> list[str]:
        return [k for name, v in d.items() for k in (leaves(v, f"{prefix}{name}.") if isinstance(v, dict)
                                                       else [prefix + name])]

    return {key: ("***" if key in SECRET_KEYS and get(key) is not None else get(key))
            for key in leaves(defaults["goblin"], "goblin.")}
