"""The catalog registry: the allow-list of operations, shared by lab node and volunteer.

It is also where a task is judged "catalog only": a registered op, called with
operands that are plain data (arrays of numeric dtypes, numbers, tuples, slices,
dtypes, references to other tasks).  The same :func:`task_violation` runs on the
scheduler (before placing a task on a volunteer) and inside the volunteer agent
(before running what it was sent).
"""

from __future__ import annotations

import types
from typing import Any, Mapping

import numpy as np
from dask._task_spec import Alias, DataNode, GraphNode, List, Task, TaskRef, Tuple

from goblin_dask.ops.spec import CatalogTask, OpSpec

_CATALOG: dict[str, OpSpec] = {}

#: Longest string a task may carry (op parameters such as einsum subscripts).
MAX_PARAM_STR = 256


class CatalogError(LookupError):
    """An operation that is not in this process's catalog was asked for."""


def register(spec: OpSpec) -> OpSpec:
    if spec.name in _CATALOG and _CATALOG[spec.name] is not spec:
        raise ValueError(f"catalog op {spec.name!r} declared twice")
    _CATALOG[spec.name] = spec
    return spec


def catalog() -> Mapping[str, OpSpec]:
    """The registry: op name -> :class:`OpSpec` (read-only)."""
    _load_all()
    return types.MappingProxyType(_CATALOG)


def op_by_name(name: str, version: int = 1) -> OpSpec:
    """Resolve an op from this process's catalog (what unpickling a task calls)."""
    _load_all()
    spec = _CATALOG.get(name)
    if spec is None:
        raise CatalogError(f"operation {name!r} is not in the goblin catalog")
    if spec.version != version:
        raise CatalogError(f"operation {name!r} v{version} requested, this catalog has v{spec.version}")
    return spec


def get(name: str) -> OpSpec:
    return op_by_name(name, _CATALOG[name].version if name in _CATALOG else 1)


def is_registered(op: Any) -> bool:
    return isinstance(op, OpSpec) and _CATALOG.get(op.name) is op


_loaded = False


def _load_all() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        import goblin_dask.ops  # noqa: F401  (registers every op module)


def plain_data_violation(value: Any, where: str = "argument") -> str | None:
    """Why ``value`` is not plain data a volunteer may receive, or None."""
    if value is None or value is Ellipsis or isinstance(value, (bool, int, float, complex)):
        return None
    if isinstance(value, np.generic):
        return None if value.dtype.kind in "biufc" else f"{where}: numpy scalar of dtype {value.dtype}"
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biufc" or value.dtype.fields is not None:
            return f"{where}: array of dtype {value.dtype} (only plain numeric arrays travel)"
        return None
    if isinstance(value, np.dtype):
        return None if value.kind in "biufc" and value.fields is None else f"{where}: dtype {value!r}"
    if isinstance(value, str):
        return None if len(value) <= MAX_PARAM_STR else f"{where}: string of {len(value)} characters"
    if isinstance(value, slice):
        for part in (value.start, value.stop, value.step):
            if (why := plain_data_violation(part, where)) is not None:
                return why
        return None
    if isinstance(value, TaskRef) and type(value) is TaskRef:
        return None
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        for i, v in enumerate(value):
            if (why := plain_data_violation(v, f"{where}[{i}]")) is not None:
                return why
        return None
    if isinstance(value, GraphNode):
        return task_violation(value, where)
    return f"{where}: object of type {type(value).__module__}.{type(value).__qualname__}"


def task_violation(task: Any, where: str = "task") -> str | None:
    """Why ``task`` may not run on a volunteer, or None when it is catalog-only."""
    if isinstance(task, CatalogTask):
        if not is_registered(task.func):
            return f"{where}: op {task.func!r} is not in the catalog"
        for i, a in enumerate(task.args):
            if (why := plain_data_violation(a, f"{where} ({task.func.name}) operand {i}")) is not None:
                return why
        for k, v in task.kwargs.items():
            if (why := plain_data_violation(v, f"{where} ({task.func.name}) parameter {k}")) is not None:
                return why
        return None
    if type(task) in (List, Tuple):
        for i, a in enumerate(task.args):
            if (why := plain_data_violation(a, f"{where}[{i}]")) is not None:
                return why
        return None
    if type(task) is DataNode:
        return plain_data_violation(task.value, f"{where} (data)")
    if type(task) is Alias:
        return None
    if isinstance(task, Task):
        return f"{where}: calls {_callable_name(task.func)}, which is not a catalog operation"
    return f"{where}: {type(task).__qualname__} is not a catalog task"


def _callable_name(func: Any) -> str:
    mod = getattr(func, "__module__", None) or type(func).__module__
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or type(func).__qualname__
    return f"{mod}.{name}"
