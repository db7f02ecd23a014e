"""Stage tasks: a ga computation traced once on stand-in inputs, then run as one volunteer task.

:func:`trace` calls a function of ga arrays on placeholders (one whole block each, products and
blocks never cut), and turns the catalog tasks it built into a :mod:`goblin_dask.ops.program`
(plain data: op names, literals, references).  :func:`call` then puts that program in a graph as
one :class:`CatalogTask` reading the real inputs' blocks (the same lab arrays, content-named, that a
volunteer's panel cache keeps between tasks), and gives back its outputs as ga arrays (views of
the packed result, cut on the lab after the result is verified).  The program is traced for the
inputs' shapes and dtypes once and reused for every call with those shapes.
"""

from __future__ import annotations

import contextlib
import math
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import dask
import numpy as np
from dask._task_spec import Alias, DataNode, GraphNode, List, Task, TaskRef, Tuple

from goblin_dask.array.core import Array, from_graph
from goblin_dask.array.keys import block_key, new_name
from goblin_dask.ops.program import FORMAT, PROGRAM, REF, packed_size
from goblin_dask.ops.spec import Aval, CatalogTask


class ProgramUnavailable(ValueError):
    """The computation cannot be one stage task (a step that is no catalog op on the traced values,
    an output that is not an array): it runs op by op instead."""


def _never(*_: Any) -> Any:
    raise RuntimeError("a program's placeholder was computed: it only stands in while the program is traced")


@dataclass
class Program:
    """A traced stage: its ``spec`` (the ``program`` op's parameter), the avals of its ``inputs``, the
    source tasks it reads besides them (``externals``, kept in every graph that calls it), and what
    each of the traced function's results is: ``("packed", k)``, ``("input", i)`` or ``("literal", v)``."""

    spec: tuple
    inputs: list[Aval]
    externals: dict
    external_keys: list
    results: list
    token: str = field(default_factory=lambda: secrets.token_hex(8))

    @property
    def steps(self) -> int:
        return len(self.spec[2])

    @property
    def flops(self) -> float:
        return float(self.spec[5])


@contextlib.contextmanager
def whole_blocks():
    """Build with every array in one block: no product cut for volunteers' memory or threads, no share cap
    (a program's inputs are capped as the task they are, by the lab node)."""
    from goblin_dask.array.linalg import _WORKERS, _binding

    with dask.config.set({"array.chunk-size": "1 PiB", "goblin.product.volunteer-memory": 1 << 50,
                          "goblin.product.memory-fraction": 1.0, "goblin.minimization.max-share": None,
                          "goblin.minimization.parameters-max-share": None, "scheduler": "sync"}), \
            _binding(_WORKERS, {"workers": []}):
        yield


def placeholder(aval: Aval, token: str, index: int) -> Array:
    name = new_name("program", "input", token, index)
    key = block_key(name, (0,) * len(aval.shape))
    return from_graph(name, {key: Task(key, _never, index)}, tuple((int(s),) for s in aval.shape), aval.dtype)


def single_key(a: Array) -> Any:
    keys = list(_flat(a.__dask_keys__()))
    if len(keys) != 1:
        raise ProgramUnavailable(f"an array of {len(keys)} blocks where a program needs one")
    return keys[0]


def _flat(keys: Any):
    if isinstance(keys, list):
        for k in keys:
            yield from _flat(k)
    else:
        yield keys


def trace(fn: Callable[..., Sequence[Any]], avals: Sequence[Aval]) -> Program:
    """The program of ``fn(*arrays)`` for inputs of ``avals`` (``fn`` returns a sequence of arrays)."""
    import goblin_dask.array as ga

    token = secrets.token_hex(8)
    avals = [Aval(tuple(int(s) for s in a.shape), np.dtype(a.dtype)) for a in avals]
    holders = [placeholder(a, token, i) for i, a in enumerate(avals)]
    with whole_blocks():
        results = list(fn(*holders))
        results = [ga.rechunk(r, tuple((n,) for n in r.shape)) if isinstance(r, Array) and r.npartitions > 1 else r
                   for r in results]
    where = {single_key(h): ("in", i) for i, h in enumerate(holders)}
    by_name = {h.name: i for i, h in enumerate(holders)}
    arrays = [r for r in results if isinstance(r, Array)]
    from dask.highlevelgraph import HighLevelGraph

    dsk = dict(HighLevelGraph.merge(*(r.__dask_graph__() for r in arrays)).to_dict()) if arrays else {}
    builder = _Builder(dsk, where)
    builder.avals.update({single_key(h): a for h, a in zip(holders, avals)})
    kinds, packed = [], []
    for r in results:
        if isinstance(r, Array) and r.name in by_name:
            kinds.append(("input", by_name[r.name]))
        elif isinstance(r, Array):
            kinds.append(("packed", len(packed)))
            packed.append((builder.value(single_key(r)), tuple(int(s) for s in r.shape), r.dtype.str))
        elif isinstance(r, (np.ndarray, np.generic, int, float, bool)):
            kinds.append(("literal", np.asarray(r)))
        else:
            raise ProgramUnavailable(f"a result of type {type(r).__name__}")
    spec, externals, external_keys = builder.finish(len(avals), packed)
    return Program(spec, avals, externals, external_keys, kinds)


class _Builder:
    """Catalog tasks -> program steps, in an order where every step follows what it reads."""

    def __init__(self, dsk: dict, where: dict):
        self.dsk, self.where = dsk, dict(where)
        self.steps: list = []
        self.external_keys: list = []
        self.flops = 0.0
        #: key -> Aval (or None where unknown): for the steps' costs
        self.avals: dict = {}

    def value(self, key: Any) -> tuple:
        """The internal reference of ``key``'s value, building what it needs first (no recursion)."""
        stack = [key]
        while stack:
            k = stack[-1]
            if k in self.where:
                stack.pop()
                continue
            node = self.dsk.get(k)
            if node is None:
                raise ProgramUnavailable(f"{k!r} is outside the traced graph")
            if type(node) is Alias:
                target = node.target.key if isinstance(node.target, TaskRef) else node.target
                if target in self.where:
                    self.where[k] = self.where[target]
                    self.avals[k] = self.avals.get(target)
                    stack.pop()
                else:
                    stack.append(target)
                continue
            if type(node) is not CatalogTask:  # a source of the lab's (a constant): read as an input
                self._external(k)
                stack.pop()
                continue
            missing = [d for d in node.dependencies if d not in self.where]
            if missing:
                stack.extend(missing)
                continue
            args = tuple(self._arg(a) for a in node.args)
            kwargs = tuple((name, self._arg(v)) for name, v in sorted(node.kwargs.items()))
            op = node.func
            self._account(k, op, node)
            self.steps.append((op.name, op.version, args, kwargs))
            self.where[k] = ("step", len(self.steps) - 1)
            stack.pop()
        return self.where[key]

    def _account(self, key: Any, op: Any, node: CatalogTask) -> None:
        """The step's result aval and flops, where its operands' avals are known (the program's cost)."""
        try:
            operands = [self._aval(a) for a in node.args]
            params = {n: self._literal(v) for n, v in node.kwargs.items()}
            self.avals[key] = op.abstract_eval(*operands, **params)
            self.flops += float(op.cost_of(*operands, **params).flops)
        except Exception:
            self.avals[key] = None

    def _aval(self, a: Any) -> Any:
        if isinstance(a, TaskRef):
            known = self.avals.get(a.key)
            if known is None:
                raise LookupError(a.key)
            return known
        return self._literal(a)

    def _literal(self, a: Any) -> Any:
        if isinstance(a, DataNode):
            return a.value
        if isinstance(a, (List, Tuple)):
            return [self._aval(x) for x in a.args]
        return a

    def _external(self, key: Any) -> None:
        from goblin_dask.array.graph import cull

        sub = cull(self.dsk, [key])
        if any(k in self.where and self.where[k][0] == "in" for k in sub):
            raise ProgramUnavailable(f"{key!r} is no catalog task but reads the program's inputs")
        self.where[key] = ("ext", len(self.external_keys))
        self.external_keys.append(key)

    def _arg(self, a: Any) -> Any:
        if isinstance(a, TaskRef):
            return self.where[a.key]
        if type(a) is List:
            return [self._arg(x) for x in a.args]
        if type(a) is Tuple:
            return tuple(self._arg(x) for x in a.args)
        if type(a) is DataNode:
            return a.value
        if isinstance(a, GraphNode):
            raise ProgramUnavailable(f"a nested {type(a).__name__} in a catalog task")
        if type(a) in (tuple, list):
            return type(a)(self._arg(x) for x in a)
        return a

    def finish(self, n_inputs: int, packed: list) -> tuple[tuple, dict, list]:
        n_ext = len(self.external_keys)

        def index(ref: tuple) -> int:
            kind, i = ref
            return i if kind == "in" else n_inputs + i if kind == "ext" else n_inputs + n_ext + i

        def final(v: Any) -> Any:
            if type(v) is tuple and len(v) == 2 and v[0] in ("in", "ext", "step") and type(v[1]) is int:
                return (REF, index(v))
            if type(v) in (tuple, list):
                return type(v)(final(x) for x in v)
            return v

        steps = tuple((name, version, tuple(final(a) for a in args), tuple((k, final(v)) for k, v in kwargs))
                      for name, version, args, kwargs in self.steps)
        dtypes = [np.dtype(d) for _, _, d in packed]
        result = np.result_type(*dtypes) if dtypes else np.dtype(np.float32)
        if result.kind not in "fc" or any(d.kind in "iub" for d in dtypes):
            result = np.dtype(np.float64) if result.kind != "c" else result  # integers exactly (up to 2^53)
        outputs = tuple((index(ref), shape, dtype) for ref, shape, dtype in packed)
        spec = (FORMAT, n_inputs + n_ext, steps, outputs, result.str, float(self.flops))
        from goblin_dask.array.graph import cull

        externals = cull(self.dsk, self.external_keys) if self.external_keys else {}
        return spec, externals, list(self.external_keys)


def task(program: Program, operands: Sequence[Any], *tokens: Any) -> tuple[Any, dict]:
    """``(key, layer)``: the program's task on ``operands`` (TaskRefs to one-block inputs), and the graph it needs."""
    name = new_name("program", program.token, *tokens)
    key = block_key(name, (0,))
    layer = dict(program.externals)
    layer[key] = CatalogTask(key, PROGRAM, *operands, *(TaskRef(k) for k in program.external_keys),
                             placement="volunteer", program=program.spec)
    return key, layer


def call_packed(program: Program, *inputs: Any) -> tuple[Array, list[Array]]:
    """The program's task on ``inputs`` (ga arrays or NumPy): its packed result as a one-block ga array, and
    the inputs as the one-block arrays it reads.  For a caller that cuts the outputs itself (a training
    round's optimizer step reads its gradients straight from the packed results)."""
    import goblin_dask.array as ga

    if len(inputs) != len(program.inputs):
        raise TypeError(f"the program takes {len(program.inputs)} inputs, got {len(inputs)}")
    arrays = []
    for i, (x, aval) in enumerate(zip(inputs, program.inputs)):
        x = x if isinstance(x, Array) else ga.from_array(np.asarray(x))
        if tuple(x.shape) != aval.shape or x.dtype != aval.dtype:
            raise ValueError(f"program input {i}: {x.dtype}{tuple(x.shape)}, traced for {aval.dtype}{aval.shape}")
        if x.npartitions > 1:
            x = ga.rechunk(x, tuple((n,) for n in x.shape))
        arrays.append(x)
    spec = program.spec
    key, layer = task(program, [TaskRef(single_key(a)) for a in arrays], *(a.name for a in arrays))
    return from_graph(key[0], layer, ((packed_size(spec),),), np.dtype(spec[4]), dependencies=arrays), arrays


def layout(spec: tuple) -> list[tuple[int, int, tuple[int, ...], str]]:
    """Where each output lies in a program's packed result: ``(start, stop, shape, dtype)``."""
    out, at = [], 0
    for _, shape, dtype in spec[3]:
        n = math.prod(shape)
        out.append((at, at + n, tuple(shape), dtype))
        at += n
    return out


def call(program: Program, *inputs: Any) -> list[Any]:
    """The traced function's results for ``inputs`` (ga arrays or NumPy), computed as one program task."""
    packed, arrays = call_packed(program, *inputs)
    return [result(program, packed, arrays, inputs, k) for k in range(len(program.results))]


def result(program: Program, packed: Array, arrays: list[Array], inputs: Sequence[Any], k: int) -> Any:
    """Result ``k`` of a :func:`call_packed` (``packed``, ``arrays``) on ``inputs``: cut from the packed result, one
    of the inputs it returns as it came, or a literal."""
    import goblin_dask.array as ga

    kind, v = program.results[k]
    if kind == "input":
        return inputs[v] if isinstance(inputs[v], Array) else arrays[v]
    if kind == "literal":
        return v
    start, stop, shape, dtype = layout(program.spec)[v]
    piece = ga.reshape(packed[start:stop], shape)
    return piece if piece.dtype == np.dtype(dtype) else ga.astype(piece, np.dtype(dtype))
