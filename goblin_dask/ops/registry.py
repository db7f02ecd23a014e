"""The catalog registry: the allow-list of operations, shared by lab node and volunteer.

It is also where a task is judged "catalog only": a registered op, called with
operands that are plain data (arrays of numeric dtypes, numbers, tuples, slices,
dtypes, references to other tasks).  The same :func:`task_violation` runs on the
scheduler (before placing a task on a volunteer) and inside the volunteer agent
(before running what it was sent).
"""

from __future__ import annotations

import functools
import re
import types
from typing import Any, Mapping

import numpy as np
from dask._task_spec import Alias, DataNode, GraphNode, List, Task, TaskRef, Tuple

from goblin_dask.ops.spec import CatalogTask, OpSpec

_CATALOG: dict[str, OpSpec] = {}
#: Other names (NumPy's ``abs``) -> the op's name.
_ALIASES: dict[str, str] = {}

#: Longest string a task may carry (op parameters such as einsum subscripts).
MAX_PARAM_STR = 256


class CatalogError(LookupError):
    """An operation that is not in this process's catalog was asked for."""


def register(spec: OpSpec) -> OpSpec:
    if spec.name in _CATALOG and _CATALOG[spec.name] is not spec or spec.name in _ALIASES:
        raise ValueError(f"catalog op {spec.name!r} declared twice")
    for alias in spec.aliases:
        if alias in _CATALOG or _ALIASES.get(alias, spec.name) != spec.name:
            raise ValueError(f"alias {alias!r} of {spec.name!r} already names another op")
        _ALIASES[alias] = spec.name
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


def volunteer_op_by_name(name: str, version: int = 1) -> OpSpec:
    """:func:`op_by_name` for a volunteer's unpickler: ops placed on the lab only are not on its list."""
    spec = op_by_name(name, version)
    if spec.placement != "volunteer":
        raise CatalogError(f"operation {name!r} runs on the lab worker only; a volunteer does not load it")
    return spec


def get(name: str) -> OpSpec:
    """The op called ``name`` or one of its aliases (``abs`` is ``absolute``)."""
    _load_all()
    name = _ALIASES.get(name, name)
    return op_by_name(name, _CATALOG[name].version if name in _CATALOG else 1)


def aliases() -> Mapping[str, str]:
    """Alias -> op name, as the ops declare them."""
    _load_all()
    return types.MappingProxyType(_ALIASES)


def by_operator(python_operator: Any) -> OpSpec | None:
    """The op a Python operator means (``operator.add`` -> ``add``), or None."""
    return _operators().get(python_operator)


@functools.cache
def _operators() -> dict:
    return {spec.operator: spec for spec in catalog().values() if spec.operator is not None}


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
    """Why ``task`` may not run on a volunteer, or None: a task of a volunteer op of the catalog on plain data.

    Ops placed on the lab only are not on a volunteer's allow-list either."""
    if isinstance(task, CatalogTask):
        if not is_registered(task.func):
            return f"{where}: op {task.func!r} is not in the catalog"
        op = task.func
        if op.name in ("program", "program_sketch"):  # a stage: every step checked as a task of its own
            from goblin_dask.ops.program import program_violation

            expected = {"program"} if op.name == "program" else {"program", "seed"}
            if set(task.kwargs) != expected or type(task.kwargs.get("seed", 0)) is not int:
                return f"{where}: a {op.name} task takes {sorted(expected)} and nothing else"
            for i, a in enumerate(task.args):
                if (why := plain_data_violation(a, f"{where} (program) operand {i}")) is not None:
                    return why
            return program_violation(task.kwargs["program"], f"{where} ({op.name})")
        if op.placement == "lab":
            return f"{where}: op {op.name} runs on the lab worker only (checking it would cost as much as computing it)"
        for i, a in enumerate(task.args):
            if (why := plain_data_violation(a, f"{where} ({op.name}) operand {i}")) is not None:
                return why
            if next(_texts(a), None) is not None:
                return f"{where} ({op.name}) operand {i}: text is no operand"
        for k, v in task.kwargs.items():
            if (why := plain_data_violation(v, f"{where} ({op.name}) parameter {k}")) is not None:
                return why
            if (why := text_violation(op, k, v)) is not None:
                return f"{where}: {why}"
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


def text_violation(op: OpSpec, param: str, value: Any) -> str | None:
    """Why parameter ``param`` of ``op`` may not carry the text in ``value``, or None.

    Text is allowed only in the op's declared ``text_params``, each string matching its grammar; a
    stage program's text is its steps' op names and their own text parameters, each checked so.
    """
    if op.name in ("program", "program_sketch") and param == "program":
        from goblin_dask.ops.program import program_violation

        return program_violation(value)
    grammar = op.text_params.get(param)
    for text in _texts(value):
        if grammar is None:
            return f"parameter {param!r} of {op.name} carries text {text[:40]!r}"
        if not _grammar(grammar).fullmatch(text):
            return f"parameter {param!r} of {op.name}: {text[:40]!r} is not in its grammar"
    return None


@functools.cache
def _grammar(pattern: str) -> re.Pattern:
    return re.compile(pattern)


def _texts(value: Any):
    if isinstance(value, str):
        yield value
    elif type(value) in (tuple, list):
        for v in value:
            yield from _texts(v)


def _callable_name(func: Any) -> str:
    mod = getattr(func, "__module__", None) or type(func).__module__
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or type(func).__qualname__
    return f"{mod}.{name}"
