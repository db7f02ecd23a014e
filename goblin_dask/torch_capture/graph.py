"""``Graph``: a captured model as plain data, interpreted with ``ga`` calls.

The IR is a list of nodes, each ``{"name", "op", "args", "kwargs", "shape", "dtype"}``:
``op`` is the ATen operator (a row of :data:`goblin_dask.torch_capture.aten.TABLE`), ``args`` and
``kwargs`` plain JSON values where ``{"ref": name}`` is an earlier node, an input or a
constant, ``{"dtype": "float32"}`` a dtype and ``{"float": "inf"}`` a non-finite number;
``shape`` has ints, and a string (``"s0"``, ``"6*s0"``) for a symbolic batch size.
:meth:`Graph.to_json` writes exactly that list; the constants (the model's parameters and
buffers) are NumPy arrays that stay with the lab (``.npz``, read with ``allow_pickle=False``)
and enter a computation through ``ga.from_array``.  No torch, no pickle.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import numpy as np

FORMAT = "goblin-dask.capture/1"

logger = logging.getLogger("goblin_dask.capture")


class UnsupportedOperator(NotImplementedError):
    """A torch operator the catalog cannot compute (yet): names the operator and where it is in the model."""

    def __init__(self, target: str, where: str = "", why: str = ""):
        self.target, self.where, self.why = target, where, why
        msg = f"{target} is not supported by goblin-dask's catalog"
        if why:
            msg += f" ({why})"
        if where:
            msg += f"\n  {where}"
        msg += ("\n  what to do: run that part of the model in torch on your machine and capture the rest, or "
                "express it with operators the catalog maps (goblin_dask.ops.catalog() lists its operations)")
        super().__init__(msg)


def encode(value: Any) -> Any:
    """A translated argument as JSON: refs, dtypes and non-finite floats tagged, tuples as lists."""
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot encode {value!r}")


def _decode(value: Any, env: Mapping[str, Any]) -> Any:
    if isinstance(value, list):
        return [_decode(v, env) for v in value]
    if isinstance(value, dict):
        if "ref" in value:
            return env[value["ref"]]
        if "dtype" in value:
            return np.dtype(value["dtype"])
        if "float" in value:
            return float(value["float"])
        raise ValueError(f"unknown tagged value {value!r}")
    return value


def _whole(x: Any) -> Any:
    """A node's result in one block when it fits ``array.chunk-size``.

    Products are cut into blocks for the volunteers; everything between them (bias adds,
    norms, activations, the reshapes and transposes of attention heads) runs on the lab
    worker, where each block is one more task: cut the same way, a GPT-style decoder's
    glue was three quarters of its ~1,900 tasks per pass.  The next product cuts its
    operands again to its own blocks."""
    import goblin_dask.array as ga

    if isinstance(x, ga.Array) and x.npartitions > 1 and x.nbytes <= _chunk_bytes():
        return ga.rechunk(x, tuple((n,) for n in x.shape))
    return x


def _chunk_bytes() -> int:
    import dask

    return int(dask.utils.parse_bytes(dask.config.get("array.chunk-size", "128MiB")))


def _refs(value: Any) -> list[str]:
    if isinstance(value, list):
        return [r for v in value for r in _refs(v)]
    if isinstance(value, dict) and "ref" in value:
        return [value["ref"]]
    return []


class Graph:
    """A captured model: call it with NumPy or ga arrays, get ga arrays (``.compute()``: NumPy).

    ``inputs``: ``[{"name", "shape", "dtype", "example"}]`` (a string in ``shape`` is the batch
    size, any value at call time; ``example``: the captured example's shape, which :attr:`ops`
    builds the computation for); ``constants``: name -> NumPy array (lab data); ``nodes``: the IR;
    ``outputs``: refs of the model's results; ``single``: the model returned one tensor.
    """

    def __init__(self, inputs: Sequence[dict], constants: Mapping[str, np.ndarray], nodes: Sequence[dict],
                 outputs: Sequence[Any], *, single: bool = False, constant_specs: Mapping[str, dict] | None = None,
                 ops: Sequence[str] | None = None):
        self.inputs = [dict(i) for i in inputs]
        self.constants = {k: np.asarray(v) for k, v in constants.items()}
        self.nodes = [dict(n) for n in nodes]
        self.outputs = list(outputs)
        self.single = bool(single)
        self.constant_specs = dict(constant_specs or {k: {"shape": list(v.shape), "dtype": v.dtype.name}
                                                      for k, v in self.constants.items()})
        self._ops = frozenset(ops) if ops is not None else None
        #: constant name -> its ga.Array, for the client ``_lab_client`` (its id, or None: no client)
        self._lab: dict[str, Any] = {}
        self._lab_client: str | None = None
        #: node name -> its value, for the nodes computed from constants alone (:meth:`_folded`)
        self._fold: dict[str, np.ndarray] | None = None
        self._fold_ops: frozenset[str] = frozenset()
        #: for a joint forward+backward graph (:mod:`goblin_dask.training.joint`): the outputs the forward alone
        #: makes (the loss, the buffers after it); :meth:`stage_plan` then cuts the forward and recomputes it
        self.forward_outputs: tuple[int, ...] | None = None
        self._check()

    # -- checks --------------------------------------------------------------------------------

    def _check(self) -> None:
        from goblin_dask.torch_capture import aten

        known = {i["name"] for i in self.inputs} | set(self.constant_specs)
        for name, spec in self.constant_specs.items():
            if name not in self.constants:
                raise ValueError(f"constant {name!r} is missing (the graph's .npz)")
            have = self.constants[name]
            if list(have.shape) != list(spec["shape"]) or have.dtype != np.dtype(spec["dtype"]):
                raise ValueError(f"constant {name!r} is {have.dtype}{list(have.shape)}, "
                                 f"the graph says {spec['dtype']}{spec['shape']}")
        for n in self.nodes:
            if n["op"] not in aten.TABLE:
                raise UnsupportedOperator(n["op"], why="no row in goblin_dask.torch_capture.aten.TABLE")
            for r in _reads(n):
                if r not in known:
                    raise ValueError(f"node {n['name']!r} reads {r!r} before it is defined")
            known.add(n["name"])
        for r in _refs(list(self.outputs)):
            if r not in known:
                raise ValueError(f"output {r!r} is not defined")

    @property
    def ops(self) -> frozenset[str]:
        """The catalog operations the graph's computation uses (found by building it for the example shapes)."""
        if self._ops is None:
            self._ops = self._trace_ops()
        return self._ops

    def _trace_ops(self) -> frozenset[str]:
        example = [np.zeros(i.get("example") or [2 if isinstance(s, str) else s for s in i["shape"]], dtype=i["dtype"])
                   for i in self.inputs]
        import goblin_dask.array as ga

        outs = [ga.from_array(r) if isinstance(r, np.ndarray) else r for r in self._op_by_op(self._inputs(example))]
        return frozenset(_catalog_ops(outs)) | self._fold_ops  # the folded nodes' ops ran once, at the lab

    # -- running -------------------------------------------------------------------------------

    def _constant(self, name: str) -> Any:
        """Constant ``name`` as a lab array, on the lab worker of the client a compute would use now.

        Kept per client: a graph first called under one lab node (or none) and then under another must
        not hand the second one Futures of the first (their keys do not exist there)."""
        from goblin_dask.array.sources import from_numpy_like

        self._lab_cache()
        if name not in self._lab:
            v = self._constant_value(name)
            # every pass reads the parameters again: on the lab worker once, whatever their size; a model's
            # parameters and buffers, not the lab's data (goblin.minimization.parameters-max-share)
            self._lab[name] = v[()] if v.ndim == 0 else from_numpy_like(v, "auto", upload_min_bytes=1,
                                                                        kind="parameters")
        return self._lab[name]

    def _lab_cache(self) -> dict:
        """The lab arrays of the constants (:meth:`_constant`, :meth:`_flat_constant`) for the client a compute
        would use now, emptied when that client changes."""
        from goblin_dask.array.sources import upload_client

        client = upload_client()
        client_id = None if client is None else client.id
        if client_id != self._lab_client:
            self._lab, self._lab_client = {}, client_id
        return self._lab

    def _constant_value(self, name: str) -> np.ndarray:
        """A constant of the model, or a node folded from them (:meth:`_folded`)."""
        v = self.constants.get(name)
        return v if v is not None else self._folded()[name]

    def _folded(self) -> dict[str, np.ndarray]:
        """The nodes whose inputs are all constants (a Linear's transposed weight, the float mask made
        from a boolean buffer, the position embeddings' rows), computed once from the lab's copy of the
        constants and read from then on as constants themselves.

        Each pass then skips their lab tasks, and what volunteers receive is a lab array named by its
        content (``source-<hash>``), which their panel cache keeps between passes: a weight used
        transposed used to be a new key, sent again, every pass.  Not folded: random operators (each
        pass draws anew), nodes with no input (nothing to save) and results that outgrow their inputs
        (broadcasts stay lazy)."""
        if self._fold is not None:
            return self._fold
        import goblin_dask.array as ga
        from goblin_dask.torch_capture import aten

        fold: dict[str, np.ndarray] = {}
        env: dict[str, Any] = {k: _LazyConstant(None, k, v) for k, v in self.constants.items()}
        ops: set[str] = set()
        for n in self.nodes:
            refs = _reads(n)
            if not refs or any(r not in env for r in refs) or "random" in aten.TABLE[n["op"]].needs:
                continue
            try:
                out = _run_node(n, env, ga, aten)
                value = out.compute(scheduler="sync") if isinstance(out, ga.Array) else out
            except Exception:  # the pass itself will say what is wrong, with the node's place
                continue
            if not isinstance(value, np.ndarray):
                continue
            inputs = sum(env[r].value.nbytes for r in set(refs))
            if value.nbytes > max(4 * inputs, 1 << 20):
                continue
            ops.update(_catalog_ops([out]))
            fold[n["name"]] = value
            env[n["name"]] = _LazyConstant(None, n["name"], value)
        self._fold, self._fold_ops = fold, frozenset(ops)
        return fold

    def __call__(self, *args: Any, slices: int | None = None) -> Any:
        """The outputs for ``args``: as stage tasks on a lab node with volunteers (``slices`` of the batch,
        None: chosen by :func:`stage_slices`), else op by op."""
        import goblin_dask.array as ga

        env = self._inputs(args)
        staged = self._staged(env, slices)
        results = staged if staged is not None else self._op_by_op(env)
        results = tuple(ga.from_array(r) if isinstance(r, np.ndarray) else r for r in results)
        return results[0] if self.single else results

    def _op_by_op(self, env: dict[str, Any]) -> tuple:
        """The outputs for the inputs in ``env``, each node its own catalog tasks."""
        for name in self.constant_specs:
            env[name] = _LazyConstant(self, name)
        for name in self._folded():
            env[name] = _LazyConstant(self, name)
        return self._evaluate(env)

    def _inputs(self, args: Sequence[Any]) -> dict[str, Any]:
        """The call's inputs by name, checked against the captured dtypes and shapes."""
        import goblin_dask.array as ga

        if len(args) != len(self.inputs):
            raise TypeError(f"the graph takes {len(self.inputs)} inputs, got {len(args)}")
        env: dict[str, Any] = {}
        for spec, x in zip(self.inputs, args):
            if not isinstance(x, ga.Array):
                x = np.asarray(x)
            want = np.dtype(spec["dtype"])
            if x.dtype != want:
                raise TypeError(f"input {spec['name']!r}: dtype {x.dtype}, the model was captured with {want}")
            shape = spec["shape"]
            if len(x.shape) != len(shape) or any(not isinstance(s, str) and s != d for s, d in zip(shape, x.shape)):
                raise ValueError(f"input {spec['name']!r}: shape {tuple(x.shape)}, the model takes "
                                 f"{tuple(shape)} (a name is a batch size of any value)")
            env[spec["name"]] = x if isinstance(x, ga.Array) else _LazyConstant(None, spec["name"], x)
        return env

    def _evaluate(self, env: dict[str, Any]) -> tuple:
        """The outputs, node after node (``env``: the inputs, constants and folded nodes by name)."""
        import goblin_dask.array as ga
        from goblin_dask.array.linalg import one_reading_of_the_workers
        from goblin_dask.torch_capture import aten

        folded = self._folded()
        with one_reading_of_the_workers():  # every product of the pass is sized against one view of them
            for n in self.nodes:
                if n["name"] in folded:
                    continue
                try:
                    out = _run_node(n, env, ga, aten)
                except Exception as e:
                    e.capture_node = n["name"]  # which node's row refused (capture reports its place in the model)
                    raise
                env[n["name"]] = _whole(out)
        return tuple(_resolve(_decode(o, env)) for o in self.outputs)

    # -- stage tasks ---------------------------------------------------------------------------

    def _stage_names(self) -> list[str]:
        """What a stage program reads, in order: the inputs, then the constants and folded nodes it uses."""
        used = set()
        folded = self._folded()
        for n in self.nodes:
            if n["name"] not in folded:
                used.update(_reads(n))
        used.update(_refs(list(self.outputs)))
        lab = [k for k in self.constant_specs if k in used] + [k for k in folded if k in used]
        return [i["name"] for i in self.inputs] + lab

    def constant_groups(self) -> list[tuple[np.dtype, list[str]]]:
        """The constants and folded nodes a stage program reads (:meth:`_stage_names`), grouped by dtype in order:
        the program reads each group as one flat vector (:meth:`_flat_constant`), one lab task and one fetch per
        pass instead of one per constant (a GPT has dozens)."""
        groups: dict[str, list[str]] = {}
        for k in self._stage_names()[len(self.inputs):]:
            groups.setdefault(self._constant_value(k).dtype.str, []).append(k)
        return [(np.dtype(dt), names) for dt, names in groups.items()]

    def _flat_constant(self, names: Sequence[str]) -> Any:
        """Constants ``names`` (one dtype) as one flat lab array, on the lab worker of the current client (kept
        as :meth:`_constant` keeps each: its content names it, so the volunteers' panel cache keeps it)."""
        lab, key = self._lab_cache(), ("flat", *names)
        if key not in lab:
            from goblin_dask.array.sources import from_numpy_like

            lab[key] = from_numpy_like(self.flat_constant_value(names), -1, upload_min_bytes=1, kind="parameters")
        return lab[key]

    def flat_constant_value(self, names: Sequence[str]) -> np.ndarray:
        """Constants ``names`` (one dtype, a group of :meth:`constant_groups`) raveled into one vector: what
        :meth:`stage_program` reads for them."""
        return np.concatenate([np.asarray(self._constant_value(k)).reshape(-1) for k in names])

    def stage_program(self, shapes: Sequence[tuple]) -> Any:
        """The whole graph as one stage program for inputs of ``shapes`` (traced once per shapes), or None
        where it cannot be one (:class:`goblin_dask.array.program.ProgramUnavailable`).  The program reads
        the inputs, then one flat vector per dtype of the constants (:meth:`constant_groups`)."""
        from goblin_dask.array import program as prog

        key = tuple(tuple(int(d) for d in s) for s in shapes)
        cache = self.__dict__.setdefault("_programs", {})
        if key not in cache and self._draws_random():
            # a random operator's seed is a literal of its task, set when the graph is built: a program
            # traced once would draw the same numbers every call
            cache[key] = None
        if key not in cache:
            import goblin_dask.array as ga
            from goblin_dask.ops.spec import Aval

            names = self._stage_names()
            groups = self.constant_groups()
            avals = [Aval(s, np.dtype(i["dtype"])) for s, i in zip(key, self.inputs)]
            avals += [Aval((sum(self._constant_value(k).size for k in group),), dt) for dt, group in groups]

            from goblin_dask.training.optim import unflatten

            def fn(*arrays):
                env = dict(zip(names, arrays[:len(self.inputs)]))
                for flat, (_, group) in zip(arrays[len(self.inputs):], groups):
                    env.update(zip(group, unflatten(flat, [self._constant_value(k).shape for k in group], ga.reshape)))
                return self._evaluate(env)

            try:
                cache[key] = prog.trace(fn, avals)
            except (prog.ProgramUnavailable, NotImplementedError, TypeError) as e:
                logger.info("the captured graph runs op by op, not as one stage task: %s", e)
                cache[key] = None
        return cache[key]

    def rows_mixed(self) -> str | None:
        """The first node that mixes rows of the batch (:func:`rows_mixed`), or None: the pass may run on slices
        of the batch (found once per graph)."""
        if "_rows_mixed" not in self.__dict__:
            try:
                self.__dict__["_rows_mixed"] = rows_mixed(self)
            except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:  # an IR it cannot read
                logger.info("cannot tell whether the captured graph keeps rows whole (%s): one slice", e)
                self.__dict__["_rows_mixed"] = "(unreadable)"
        return self.__dict__["_rows_mixed"]

    def _draws_random(self) -> bool:
        from goblin_dask.torch_capture import aten

        return any("random" in aten.TABLE[n["op"]].needs for n in self.nodes)

    def stage_plan(self, env: Mapping[str, Any], budget: float) -> list[Stage] | None:
        """The pass cut into consecutive stages whose own arrays (constants, folded nodes, inputs with no batch
        axis) each fit ``budget`` bytes, in the order of the nodes (a pipeline: activations cross each cut once);
        None where one node alone reads more than that.

        A joint forward+backward graph (:attr:`forward_outputs` set) is cut on its forward only: stage ``k``'s
        backward runs in a stage of its own after the later stages' backwards, recomputing stage ``k``'s forward
        from the stage's inputs rather than receiving its activations (:meth:`_backward_stages`)."""
        folded = self._folded()
        inputs = [i["name"] for i in self.inputs]
        lab = set(self.constant_specs) | set(folded)
        _, batched = _input_shapes(self, env)
        held_inputs = {n for n, b in zip(inputs, batched) if not b}
        nodes = [n for n in self.nodes if n["name"] not in folded]
        own = {n["name"]: {r for r in _reads(n) if r in lab or r in held_inputs} for n in nodes}
        sizes = _held_sizes(self, env)
        if any(sum(sizes[r] for r in reads) > budget for reads in own.values()):
            return None
        outputs = _refs(list(self.outputs))
        forward = nodes
        if self.forward_outputs is not None:
            wanted = {r for k in self.forward_outputs for r in _refs([self.outputs[k]])}
            ancestors = _ancestors(nodes, wanted)
            forward = [n for n in nodes if n["name"] in ancestors]
            outputs = [r for r in outputs if r in ancestors]
        bounds = self._cuts(forward, [own[n["name"]] for n in forward], sizes, env, budget, outputs)
        if bounds is None:
            return None
        groups = [forward[a:b] for a, b in zip(bounds, bounds[1:])]
        if self.forward_outputs is not None and len(groups) > 1:
            backward = self._backward_stages(nodes, groups, own, sizes, budget)
            if backward is None:  # a backward stage would hold more than the budget: cut the joint graph as it is
                bounds = self._cuts(nodes, [own[n["name"]] for n in nodes], sizes, env, budget, _refs(list(self.outputs)))
                if bounds is None:
                    return None
                groups = [nodes[a:b] for a, b in zip(bounds, bounds[1:])]
            else:
                groups = groups + backward
        elif self.forward_outputs is not None:
            groups = [nodes]
        return _stages(groups, inputs, lab, _refs(list(self.outputs)))

    def _backward_stages(self, nodes: Sequence[dict], forward: list[list[dict]], own: Mapping[str, set],
                         sizes: Mapping[str, int], budget: float) -> list[list[dict]] | None:
        """The backward of a joint graph whose forward is cut into ``forward`` stages: one stage per forward
        stage, last first, each the nodes of its forward stage (recomputed there: only the stage's inputs and the
        gradient reaching its outputs cross, never the activations its backward reads) and the gradient nodes
        that read them.  A gradient node goes to the latest forward stage whose values it reads, and no later
        than the gradients it reads (the backward runs from the last stage to the first); one that reads no
        forward value, no earlier than the gradients that read it.  A node made from
        the model's own arrays alone (a weight transposed for the backward's products) is made again in each
        stage that reads it, never sent from one to the next; so is a view of a gradient (its source crosses
        instead, the same bytes, or none more where the source crosses anyway).  None where a backward stage's own arrays would
        exceed ``budget``."""
        stage_of = {n["name"]: k for k, group in enumerate(forward) for n in group}
        last = len(forward) - 1
        by_name = {n["name"]: n for n in nodes}
        free: set[str] = set()  # backward nodes that read only the model's arrays (or other such nodes)
        backward_of: dict[str, int] = {}
        for n in nodes:
            if n["name"] in stage_of:
                continue
            reads = _reads(n)
            if all(r in own[n["name"]] or r in free for r in reads):
                free.add(n["name"])
                continue
            k = max((stage_of[r] for r in reads if r in stage_of), default=last)
            k = min([k, *(backward_of[r] for r in reads if r in backward_of)])
            backward_of[n["name"]] = k
        # a gradient node that reads no forward value (a view or transpose of a gradient, a sum of two) goes down
        # to the stage of its readers: made where it is read, it crosses no cut (last node first: its readers
        # are placed by then)
        readers: dict[str, list[str]] = {}
        for n in nodes:
            for r in _reads(n):
                readers.setdefault(r, []).append(n["name"])
        for n in reversed(nodes):
            name = n["name"]
            if name in backward_of and not any(r in stage_of for r in _reads(n)):
                later = [backward_of[c] for c in readers.get(name, ()) if c in backward_of]
                if later:
                    backward_of[name] = min(backward_of[name], max(later))
        unread = free & set(_refs(list(self.outputs)))  # outputs of free nodes: made by the first backward stage
        stages = []
        for k in range(last, -1, -1):
            grads = [n for n in nodes if backward_of.get(n["name"]) == k]
            if not grads:
                continue
            def copied(r: str) -> bool:  # made again here: a free node, or a view of a gradient another stage made
                return r in free or (backward_of.get(r, k) != k and by_name[r]["op"] in _VIEWS)

            needed, stack = set(), [r for n in grads for r in _reads(n) if copied(r)]
            if not stages:
                stack += unread
            while stack:
                r = stack.pop()
                if r not in needed:
                    needed.add(r)
                    stack += [q for q in _reads(by_name[r]) if copied(q)]
            group = list(forward[k]) + [n for n in nodes if backward_of.get(n["name"]) == k or n["name"] in needed]
            held = set().union(*(own[n["name"]] for n in group))
            if sum(sizes[r] for r in held) > budget:
                return None
            stages.append(group)
        return stages

    def _cuts(self, nodes: Sequence[dict], own: Sequence[set], sizes: Mapping[str, int], env: Mapping[str, Any],
              budget: float, outputs: Sequence[str]) -> list[int] | None:
        """Where to cut ``nodes`` (``[0, cut, ..., len(nodes)]``): the fewest stages whose own arrays each fit
        ``budget`` (each stage is a trip through the lab), and among those the fewest activation bytes crossing
        the cuts (a cut inside an MLP sends its hidden layer, 4x the residual stream).  None where every such
        cut has a tuple of arrays live across it (a program returns arrays only)."""
        crossing = self._crossing_bytes(nodes, env, outputs)
        n = len(nodes)
        best: list[tuple | None] = [None] * (n + 1)  # best[e]: (stages, bytes, previous cut) for nodes[:e]
        best[0] = (0, 0.0, None)
        for start in range(n):
            if best[start] is None or (start and math.isinf(crossing[start])):
                continue
            stages, sent, _ = best[start]
            sent += crossing[start] if start else 0.0
            held: set[str] = set()
            total = 0
            for end in range(start + 1, n + 1):
                for r in own[end - 1] - held:
                    held.add(r)
                    total += sizes[r]
                if total > budget:
                    break
                if best[end] is None or (stages + 1, sent) < best[end][:2]:
                    best[end] = (stages + 1, sent, start)
        if best[n] is None:
            return None
        bounds, at = [n], n
        while at:
            at = best[at][2]
            bounds.append(at)
        return bounds[::-1]

    def _crossing_bytes(self, nodes: Sequence[dict], env: Mapping[str, Any], outputs: Sequence[str]) -> list[float]:
        """Per position ``p`` in ``nodes``: the bytes of the values made before ``p`` that a node from ``p`` on,
        or one of ``outputs``, reads (what a cut there sends through the lab), from each node's recorded shape and dtype
        with the call's batch size in its symbols."""
        symbols = {}
        for i, shape in zip(self.inputs, _input_shapes(self, env)[0]):
            for s, d in zip(i["shape"], shape):
                if isinstance(s, str) and s.isidentifier():
                    symbols[s] = int(d)
        size = {n["name"]: _value_bytes(n, symbols) for n in nodes}
        position = {n["name"]: k for k, n in enumerate(nodes)}
        last_read = {}
        for k, n in enumerate(nodes):
            for r in _reads(n):
                if r in position:
                    last_read[r] = k
        for r in outputs:
            if r in position:
                last_read[r] = len(nodes)
        delta = [0.0] * (len(nodes) + 2)  # a value crosses every cut after it is made, up to its last reader
        tuples = [0] * (len(nodes) + 2)  # (counted apart: inf - inf would make the sums after it NaN)
        for r, k in last_read.items():
            counts, amount = (tuples, 1) if math.isinf(size[r]) else (delta, size[r])
            counts[position[r] + 1] += amount
            counts[k + 1] -= amount
        out, running, live = [], 0.0, 0
        for p in range(len(nodes) + 1):
            running += delta[p]
            live += tuples[p]
            out.append(math.inf if live else running)
        return out

    def _stage_program_of(self, stage: Stage, names: Sequence[str], avals: Sequence[Any],
                          literals: Mapping[str, Any]) -> tuple[Any, dict]:
        """One stage of a :meth:`stage_plan` as a program reading the arrays ``names`` of ``avals``, with the
        earlier stages' values that are no arrays (sizes, shapes) bound as ``literals``: ``(program or None,
        {output: value} of its outputs that are no arrays)``, cached per shapes and literals."""
        from goblin_dask.array import program as prog

        cache = self.__dict__.setdefault("_programs", {})
        key = ("stage", stage.nodes, tuple((tuple(a.shape), str(a.dtype)) for a in avals),
               tuple(sorted((k, repr(v)) for k, v in literals.items())))
        if key not in cache:
            members = set(stage.nodes)
            nodes = [n for n in self.nodes if n["name"] in members]
            static: dict[str, Any] = {}

            def fn(*arrays):
                import goblin_dask.array as ga
                from goblin_dask.array.linalg import one_reading_of_the_workers
                from goblin_dask.torch_capture import aten

                env = {**literals, **dict(zip(names, arrays))}
                with one_reading_of_the_workers():
                    for n in nodes:
                        env[n["name"]] = _whole(_run_node(n, env, ga, aten))
                static.update({o: env[o] for o in stage.outputs if not isinstance(env[o], ga.Array)})
                return [env[o] for o in stage.outputs]

            try:
                cache[key] = (prog.trace(fn, avals), static)
            except (prog.ProgramUnavailable, NotImplementedError, TypeError) as e:
                logger.info("the captured graph runs op by op, not as stage tasks: %s", e)
                cache[key] = (None, {})
        return cache[key]

    def _staged(self, env: dict[str, Any], slices: int | None = None) -> tuple | None:
        """The outputs as stage tasks, one per slice of the batch (:func:`stage_slices`) and stage of the model
        (:meth:`stage_plan`), or None: op by op."""
        from goblin_dask.array import program as prog

        slices = stage_slices(self, env, slices, whole=False)
        if not slices:
            return None
        if self._draws_random():  # a random operator's seed is a literal of its task (see stage_program)
            return None
        plan = self.stage_plan(env, stage_budget())
        if plan is None:
            return None
        if len(plan) > 1:
            return self._pipelined(env, plan, slices)
        import goblin_dask.array as ga

        names = self._stage_names()
        inputs = [env[i["name"]] for i in self.inputs]
        inputs = [x.array() if isinstance(x, _LazyConstant) else x for x in inputs]
        batched = [bool(i["shape"]) and isinstance(i["shape"][0], str) for i in self.inputs]
        batch = min((x.shape[0] for x, b in zip(inputs, batched) if b), default=1)
        slices = 1 if not any(batched) else min(slices, batch)
        bounds = [(b * batch // slices, (b + 1) * batch // slices) for b in range(slices)]
        lab = [self._flat_constant(group) for _, group in self.constant_groups()]
        parts = []
        for lo, hi in bounds:
            xs = [x[lo:hi] if b and slices > 1 else x for x, b in zip(inputs, batched)]
            program = self.stage_program([x.shape for x in xs])
            if program is None:
                return None
            parts.append(prog.call(program, *xs, *lab))
        if len(parts) == 1:
            return tuple(parts[0])
        return tuple(ga.concatenate(list(outs), axis=0) for outs in zip(*parts))

    def _pipelined(self, env: dict[str, Any], plan: list[Stage], slices: int) -> tuple | None:
        """The outputs of a model cut into stages: per slice of the batch, one stage task per stage, each reading
        the activations the stages before it produced (verified at the lab, then sent on: volunteers behind
        NAT never reach one another), so activations cross each cut once and a volunteer holds one stage's
        parameters only."""
        import goblin_dask.array as ga
        from goblin_dask.array import program as prog
        from goblin_dask.ops.spec import Aval

        calls = {i["name"]: env[i["name"]] for i in self.inputs}
        calls = {k: x.array() if isinstance(x, _LazyConstant) else x for k, x in calls.items()}
        batched = {i["name"]: bool(i["shape"]) and isinstance(i["shape"][0], str) for i in self.inputs}
        batch = min((x.shape[0] for k, x in calls.items() if batched[k]), default=1)
        slices = 1 if not any(batched.values()) else min(slices, batch)
        parts = []
        for b in range(slices):
            lo, hi = b * batch // slices, (b + 1) * batch // slices
            values: dict[str, Any] = {k: x[lo:hi] if batched[k] and slices > 1 else x for k, x in calls.items()}
            for stage in plan:
                names, xs, literals = [], [], {}
                for r in stage.inputs:
                    x = values[r] if r in values else self._constant(r)
                    if r in values and r not in calls and not isinstance(x, ga.Array):
                        literals[r] = x  # a size or shape an earlier stage computed: the same for every call
                    else:
                        names.append(r)
                        xs.append(x)
                program, static = self._stage_program_of(stage, names, [Aval.of(x) for x in xs], literals)
                if program is None:
                    return None
                values.update(zip(stage.outputs, prog.call(program, *xs)))
                values.update(static)
            lab = {k: _LazyConstant(self, k) for k in self.constant_specs if k not in values}
            lab.update({k: _LazyConstant(self, k) for k in self._folded() if k not in values})
            parts.append(tuple(_resolve(_decode(o, {**lab, **values})) for o in self.outputs))
        if len(parts) == 1:
            return parts[0]
        return tuple(ga.concatenate(list(outs), axis=0) for outs in zip(*parts))

    def pipelined_sum(self, calls: Sequence[Sequence[Any]], weights: Sequence[float], summed: Sequence[int],
                      packed: bool = False, flat: tuple[Sequence[int], Callable] | None = None
                      ) -> tuple[list[tuple], list[Any]] | None:
        """Several calls (a Trainer's consecutive micro-batches) as one pipeline of stage tasks, each task running
        its stage for every call in turn: the outputs at ``summed`` (a joint graph's gradients) come back once,
        ``sum_i weights[i] * output_i`` in the output's dtype in call order (as the lab's step sums them, and torch
        accumulates them), the others per call.  A stage's parameters are fetched once for all the calls, a
        gradient crosses once, and the lab handles one task per stage instead of one per call and stage.

        Returns ``(per call: its outputs, the summed ones None; the summed outputs)``; with ``packed``, each summed
        output as ``(the stage task's packed result, (start, stop, shape, dtype))`` (:func:`program.layout`), for
        a lab task that cuts them itself rather than one task per cut.  None where the calls
        do not run as one multi-stage pipeline (one stage, op by op, a random operator, a summed output another
        stage reads).  A call input that is the same array in every call (a parameter) is read once per stage task;
        the others (the batch) per call.

        ``flat``: ``(positions, vector)``: the call inputs at ``positions`` (a Trainer's parameters: the same arrays
        in every call, one dtype) that a stage task reads come as one vector, ``vector(their positions)``, a
        one-block 1-d array of them raveled in that order (one lab task and one input per stage task instead of
        one per parameter), cut into views by the program's first steps; ``vector`` returning None: that stage
        reads them one by one."""
        import goblin_dask.array as ga
        from goblin_dask.array import program as prog
        from goblin_dask.ops.spec import Aval

        envs = [self._inputs(args) for args in calls]
        if not stage_slices(self, envs[0], 1, whole=False) or self._draws_random():
            return None
        plan = self.stage_plan(envs[0], stage_budget())
        if plan is None or len(plan) < 2:
            return None
        sums = {k: self.outputs[k]["ref"] for k in summed
                if isinstance(self.outputs[k], dict) and "ref" in self.outputs[k]}
        if len(sums) != len(summed) or len(set(sums.values())) != len(sums):
            return None
        made = {o for stage in plan for o in stage.outputs}
        if not set(sums.values()) <= made or any(r in stage.inputs for stage in plan for r in sums.values()):
            return None
        values: list[dict[str, Any]] = []
        for env in envs:
            values.append({k: x.array() if isinstance(x, _LazyConstant) else x for k, x in env.items()})
        shared = {k: x for k, x in values[0].items() if all(v[k] is x for v in values)}
        position = {i["name"]: j for j, i in enumerate(self.inputs)}
        flat_positions = set(flat[0]) if flat is not None else set()
        total: dict[str, Any] = {}
        for stage in plan:
            common = [r for r in stage.inputs if r in shared or (r not in values[0] and r not in total)]
            own = [r for r in stage.inputs if r not in common]
            grouped = sorted((r for r in common if r in shared and position.get(r) in flat_positions
                              and isinstance(shared[r], ga.Array)), key=position.get)
            vector = flat[1]([position[r] for r in grouped]) if grouped else None
            if vector is None:
                grouped = []
            common = [r for r in common if r not in grouped]
            xs = [vector] if grouped else []
            xs += [shared[r] if r in shared else self._constant(r) for r in common]
            literals = []
            for v in values:
                literals.append({r: v[r] for r in own if not isinstance(v[r], ga.Array)})
                xs += [v[r] for r in own if isinstance(v[r], ga.Array)]
            program, static = self._group_stage_program(stage, common, own, [Aval.of(x) for x in xs], literals,
                                                        [float(w) for w in weights], tuple(sorted(sums.values())),
                                                        tuple((r, tuple(shared[r].shape)) for r in grouped))
            if program is None:
                return None
            whole, arrays = prog.call_packed(program, *xs)
            kept = [o for o in stage.outputs if o not in sums.values() and o not in static[0]]
            out = [prog.result(program, whole, arrays, xs, k) for k in range(len(values) * len(kept))]
            for i, v in enumerate(values):
                v.update(zip(kept, out[i * len(kept):(i + 1) * len(kept)]))
                v.update(static[i])
            where = prog.layout(program.spec)
            for k, o in enumerate([o for o in stage.outputs if o in sums.values()], start=len(out)):
                kind, at = program.results[k]
                total[o] = (whole, where[at]) if packed and kind == "packed" else \
                    prog.result(program, whole, arrays, xs, k)
        lab = {k: _LazyConstant(self, k) for k in self.constant_specs}
        lab.update({k: _LazyConstant(self, k) for k in self._folded()})
        per_call = []
        for v in values:
            per_call.append(tuple(None if k in sums else _resolve(_decode(o, {**lab, **v}))
                                  for k, o in enumerate(self.outputs)))
        return per_call, [total[sums[k]] for k in summed]

    def _group_stage_program(self, stage: Stage, common: Sequence[str], own: Sequence[str], avals: Sequence[Any],
                             literals: Sequence[Mapping[str, Any]], weights: Sequence[float],
                             sums: Sequence[str], flat: Sequence[tuple[str, tuple]] = ()) -> tuple[Any, list[dict]]:
        """:meth:`pipelined_sum`'s program of one stage: it reads the ``common`` arrays once, then each call's
        ``own`` arrays (those not bound in its ``literals``), and returns each call's outputs but ``sums``, then
        the weighted sums.  ``flat`` (``(name, shape)`` in order): before all that, one vector of those arrays
        raveled, cut into views by the program's first steps.  ``(program or None, per call {output: value} of
        its outputs that are no arrays)``, cached per shapes, literals and weights."""
        from goblin_dask.array import program as prog

        cache = self.__dict__.setdefault("_programs", {})
        key = ("group", stage.nodes, tuple((tuple(a.shape), str(a.dtype)) for a in avals),
               tuple(tuple(sorted((k, repr(v)) for k, v in lit.items())) for lit in literals), tuple(weights),
               tuple(sums), tuple(flat))
        if key not in cache:
            members = set(stage.nodes)
            nodes = [n for n in self.nodes if n["name"] in members]
            static: list[dict] = [{} for _ in literals]

            def fn(*arrays):
                import goblin_dask.array as ga
                from goblin_dask.array.linalg import one_reading_of_the_workers
                from goblin_dask.torch_capture import aten
                from goblin_dask.training.optim import unflatten

                base = {}
                if flat:  # the views are cut once, for every call
                    base.update(zip((r for r, _ in flat), unflatten(arrays[0], [s for _, s in flat], ga.reshape)))
                    arrays = arrays[1:]
                base.update(zip(common, arrays))
                at, outs, total = len(common), [], {}
                for i, (lit, w) in enumerate(zip(literals, weights)):
                    mine = [r for r in own if r not in lit]
                    env = {**lit, **base, **dict(zip(mine, arrays[at:at + len(mine)]))}
                    at += len(mine)
                    with one_reading_of_the_workers():
                        for n in nodes:
                            env[n["name"]] = _whole(_run_node(n, env, ga, aten))
                    for o in stage.outputs:
                        if o in sums:
                            term = ga.multiply(env[o], env[o].dtype.type(w))
                            total[o] = term if o not in total else ga.add(total[o], term)
                        elif isinstance(env[o], ga.Array):
                            outs.append(env[o])
                        else:
                            static[i][o] = env[o]
                return [*outs, *(total[o] for o in stage.outputs if o in sums)]

            try:
                cache[key] = (prog.trace(fn, avals), static)
            except (prog.ProgramUnavailable, NotImplementedError, TypeError) as e:
                logger.info("the captured graph's calls run one pipeline each, not together: %s", e)
                cache[key] = (None, static)
        return cache[key]

    # -- the form with no pickle ---------------------------------------------------------------

    def to_dict(self) -> dict:
        return {"format": FORMAT, "inputs": self.inputs, "constants": self.constant_specs, "nodes": self.nodes,
                "outputs": self.outputs, "single": self.single, "ops": sorted(self.ops)}

    def to_json(self) -> str:
        """The graph as JSON text (the constants' names, shapes and dtypes, not their values)."""
        return json.dumps(self.to_dict(), allow_nan=False)

    @classmethod
    def from_json(cls, text: str, constants: Any = None) -> "Graph":
        """A graph from :meth:`to_json`'s text; ``constants``: a mapping of arrays or an ``.npz`` path."""
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise ValueError(f"not a captured graph (format {d.get('format')!r}, expected {FORMAT!r})")
        if constants is None:
            constants = {}
        elif isinstance(constants, (str, os.PathLike)):
            with np.load(constants, allow_pickle=False) as z:
                constants = {k: z[k] for k in z.files}
        return cls(d["inputs"], constants, d["nodes"], d["outputs"], single=d["single"],
                   constant_specs=d["constants"], ops=d.get("ops"))

    def save(self, path: str | os.PathLike) -> tuple[str, str]:
        """Write ``path.json`` (the IR) and ``path.npz`` (the constants); returns both paths."""
        base = os.fspath(path)
        for ext in (".json", ".npz"):
            if base.endswith(ext):
                base = base[: -len(ext)]
        with open(base + ".json", "w") as f:
            f.write(self.to_json())
        np.savez(base + ".npz", **self.constants)
        return base + ".json", base + ".npz"

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Graph":
        """The graph :meth:`save` wrote (``path.json`` + ``path.npz``)."""
        base = os.fspath(path)
        for ext in (".json", ".npz"):
            if base.endswith(ext):
                base = base[: -len(ext)]
        with open(base + ".json") as f:
            return cls.from_json(f.read(), base + ".npz")

    def __repr__(self) -> str:
        shapes = ", ".join(f"{i['dtype']}{list(i['shape'])}" for i in self.inputs)
        return f"<goblin_dask.Graph ({shapes}) -> {len(self.outputs)} output(s), {len(self.nodes)} nodes>"


#: ops whose result is their input's elements rearranged: a backward stage makes its own copy rather than read another's
_VIEWS = frozenset({"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.permute.default",
                    "aten.t.default", "aten.transpose.int", "aten.expand.default", "aten.unsqueeze.default",
                    "aten.squeeze.dim", "aten.squeeze.dims"})


def _reads(node: dict) -> list[str]:
    """The names a node reads."""
    return _refs(node["args"]) + _refs(list(node["kwargs"].values()))


def _ancestors(nodes: Sequence[dict], wanted: set[str]) -> set[str]:
    """The names among ``nodes`` that ``wanted`` depends on (themselves included)."""
    by_name = {n["name"]: n for n in nodes}
    seen, stack = set(), [w for w in wanted if w in by_name]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        stack.extend(r for r in _reads(by_name[name]) if r in by_name and r not in seen)
    return seen


def _stages(groups: Sequence[Sequence[dict]], inputs: Sequence[str], lab: set[str], outputs: Sequence[str]) -> list[Stage]:
    """:class:`Stage` s of node ``groups`` run in that order.  A name a group makes that an earlier group made too
    (a forward recomputed for its backward) stays that group's own: what later groups read comes from the group
    that made it first."""
    made: dict[str, int] = {}
    for s, group in enumerate(groups):
        for n in group:
            made.setdefault(n["name"], s)
    read_later: list[set[str]] = [set() for _ in groups]
    for s, group in enumerate(groups):
        inside = {n["name"] for n in group}
        for n in group:
            for r in _reads(n):
                if r not in inside and r in made:
                    read_later[made[r]].add(r)
    for r in outputs:
        if r in made:
            read_later[made[r]].add(r)
    plan, earlier = [], []
    for s, group in enumerate(groups):
        inside, reads = {n["name"] for n in group}, []
        for n in group:
            for r in _reads(n):
                if r not in reads and r not in inside:
                    reads.append(r)
        # the stage's inputs in a fixed order: the call's inputs, the model's arrays, then earlier stages' values
        order = [r for r in inputs if r in reads] + [r for r in reads if r in lab] + [r for r in earlier if r in reads]
        missing = [r for r in reads if r not in order]
        if missing:
            raise ValueError(f"stage {s} reads {missing[:3]}, which no earlier stage makes")
        mine = [n["name"] for n in group if made[n["name"]] == s and n["name"] in read_later[s]]
        plan.append(Stage(tuple(n["name"] for n in group), tuple(order), tuple(mine)))
        earlier += mine
    return plan


def _value_bytes(node: dict, symbols: Mapping[str, int]) -> float:
    """A node's value's bytes from its recorded shape (symbols such as ``128*s23`` evaluated with ``symbols``); 0 for
    a size (``sym_size``, Python arithmetic on sizes); infinite for a value with no shape (a tuple of arrays: a
    program returns arrays, so no cut may fall where one is live)."""
    import ast

    shape, dtype = node.get("shape"), node.get("dtype")
    if not isinstance(shape, list) or not dtype:
        return 0.0 if node["op"].startswith(("aten.sym_", "_operator.")) else math.inf

    def value(e: ast.AST) -> float:
        if isinstance(e, ast.Constant) and isinstance(e.value, (int, float)):
            return float(e.value)
        if isinstance(e, ast.Name):
            return float(symbols.get(e.id, 1))
        if isinstance(e, ast.BinOp) and isinstance(e.op, (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod)):
            a, b = value(e.left), value(e.right)
            return {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}.get(type(e.op), a)
        return 1.0

    n = 1.0
    for d in shape:
        try:
            n *= value(ast.parse(d, mode="eval").body) if isinstance(d, str) else float(d)
        except SyntaxError:
            n *= 1.0
    try:
        return n * np.dtype(dtype).itemsize
    except TypeError:
        return 0.0


# -- rows along the batch ------------------------------------------------------------------------

#: operators computed element by element (with broadcasting): row i of the result reads row i of the operands only
_ELEMENTWISE = frozenset({
    "abs", "neg", "exp", "expm1", "log", "log1p", "log2", "log10", "sqrt", "rsqrt", "reciprocal", "sin", "cos",
    "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "floor", "ceil", "round", "trunc", "sign", "square",
    "logical_not", "bitwise_not", "isnan", "isinf", "isfinite", "sigmoid", "relu", "erf", "silu", "mish",
    "hardswish", "hardsigmoid", "gelu", "elu", "leaky_relu", "softplus", "add", "sub", "rsub", "mul", "div",
    "maximum", "minimum", "atan2", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor",
    "bitwise_and", "bitwise_or", "bitwise_xor", "remainder", "hypot", "fmod", "__lshift__", "__rshift__",
    "bitwise_left_shift", "bitwise_right_shift", "pow", "where", "clamp", "clamp_min", "clamp_max", "masked_fill",
    "_to_copy", "to", "clone", "alias", "detach", "contiguous", "lift_fresh_copy", "copy", "copy_", "full_like",
    "bernoulli",
    # layout: the batch axis moves, its rows stay whole (the shape check below sees where it went)
    "permute", "transpose", "t", "unsqueeze", "squeeze", "expand", "stack",
})

#: operators whose dim argument names the axes they combine elements along: (position, keyword, default), the
#: default ``"all"`` where None or an empty list means every axis
_AXIS_ARGS: dict[str, tuple[int | None, str, Any]] = {
    **{op: (1, "dim", "all") for op in (
        "aten.sum.dim_IntList", "aten.mean.dim", "aten.amax.default", "aten.amin.default", "aten.any.dim",
        "aten.any.dims", "aten.all.dim", "aten.all.dims", "aten.argmax.default", "aten.argmin.default",
        "aten.var.dim", "aten.var.correction", "aten.var_mean.correction", "aten.logsumexp.default",
        "aten.prod.dim_int", "aten.max.dim", "aten.min.dim", "aten.median.dim", "aten.nanmedian.dim",
        "aten.cumsum.default", "aten._softmax.default", "aten._log_softmax.default", "aten.select.int",
        "aten.index_select.default", "aten.gather.default", "aten.scatter.value")},
    "aten.unbind.int": (1, "dim", 0), "aten.cat.default": (1, "dim", 0),
    "aten.sort.default": (1, "dim", -1), "aten.sort.stable": (None, "dim", -1),
    "aten.argsort.default": (1, "dim", -1), "aten.argsort.stable": (None, "dim", -1),
    "aten.topk.default": (2, "dim", -1), "aten.kthvalue.default": (2, "dim", -1),
    "aten.split.Tensor": (2, "dim", 0), "aten.split_with_sizes.default": (2, "dim", 0),
    "aten.slice_scatter.default": (2, "dim", 0),
}

#: operators that take the batch size (a ``sym_size`` of the batch axis, or arithmetic on it) as a shape
_SIZED = frozenset({"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.expand.default",
                    "aten.zeros.default", "aten.full.default", "aten.empty.memory_format", "aten.new_zeros.default"})
_RESHAPES = frozenset({"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default"})
_REDUCED_TAIL = {"aten.max_pool2d_with_indices.default": 2, "aten.avg_pool2d.default": 2,
                 "aten._adaptive_avg_pool2d.default": 2, "aten.tril.default": 2, "aten.triu.default": 2}


def _batch_coefficient(expr: str) -> int | None:
    """``k`` where ``expr`` is ``k * symbol`` (``"s0"``, ``"16*s0"``), else None (``"s0 - 1"``, ``"s0**2"``)."""
    import ast

    def coef(e: ast.AST) -> int | None:
        if isinstance(e, ast.Name):
            return 1
        if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Mult):
            for a, b in ((e.left, e.right), (e.right, e.left)):
                if isinstance(a, ast.Constant) and isinstance(a.value, int) and a.value > 0:
                    c = coef(b)
                    return None if c is None else a.value * c
        return None

    try:
        return coef(ast.parse(expr, mode="eval").body)
    except SyntaxError:
        return None


def _axis_arg(node: dict, pos: int | None, key: str, default: Any) -> Any:
    args, kwargs = node["args"], node["kwargs"]
    if key in kwargs:
        return kwargs[key]
    if pos is not None and len(args) > pos:
        return args[pos]
    return default


def rows_mixed(graph: "Graph") -> str | None:
    """The first node whose result mixes rows of the batch (a reduction over it, a scan or sort along it, a
    product contracting it, a slice of it, an operator this check cannot vouch for), or None: every row of
    every value reads the same row of the inputs only, and the pass may run on slices of the batch.

    Each value's batch axes are the axes of its recorded shape that carry the batch symbol, for the values that
    read a batched input (or the batch size) at all; the rest are the same for every row."""
    batched: dict[str, list[int] | None] = {}  # name -> batch axes (None: a tuple of values)
    exprs: dict[str, set[str]] = {}  # name -> the batch expressions of the values it holds
    sizes: set[str] = set()  # the sizes computed from the batch size
    for i in graph.inputs:
        shape = i["shape"]
        if shape and isinstance(shape[0], str):
            batched[i["name"]] = [0]
            exprs[i["name"]] = {shape[0]}
    for n in graph.nodes:
        op, name, reads = n["op"], n["name"], _reads(n)
        tensors = [r for r in reads if r in batched]
        symbolic = [r for r in reads if r in sizes]
        if op.startswith("_operator.") and op != "_operator.getitem" or op == "aten.sym_size.int":
            if tensors and op == "aten.sym_size.int":
                axis = n["args"][1] if len(n["args"]) > 1 else n["kwargs"].get("dim")
                ndim = len(_shape_of(graph, n["args"][0]["ref"]) or [])
                if isinstance(axis, int) and ndim and axis % ndim in (batched[tensors[0]] or [0]):
                    sizes.add(name)
            elif tensors:
                return name
            elif symbolic:
                sizes.add(name)
            continue
        if not tensors and not symbolic:
            continue
        if symbolic and op not in _SIZED:
            return name  # the batch size as a value (arange over it, x / x.shape[0]): a slice's is not the batch's
        shape = n.get("shape")
        if op == "_operator.getitem":
            if not isinstance(shape, list):
                return name
            axes = [k for k, d in enumerate(shape) if isinstance(d, str)]
            if len(axes) != 1 or not {shape[axes[0]]} <= exprs[tensors[0]]:
                return name
            batched[name], exprs[name] = axes, {shape[axes[0]]}
            continue
        if any(batched[r] is None for r in tensors):
            return name  # a tuple read other than by getitem
        base = op.split(".")[1] if op.startswith("aten.") else op
        held = {r: batched[r] for r in tensors}
        first = n["args"][0] if n["args"] else None
        first = first["ref"] if isinstance(first, dict) and "ref" in first else None
        if first is None and n["args"] and isinstance(n["args"][0], list) and _refs(n["args"][0]):
            ndim = len(_shape_of(graph, _refs(n["args"][0])[0]) or [])  # cat: its tensors' rank
        else:
            ndim = len(_shape_of(graph, first) or []) if first else 0
        if op in _AXIS_ARGS:
            dims = _axis_arg(n, *_AXIS_ARGS[op])
            if dims is None or dims == "all" or dims == []:
                return name
            dims = dims if isinstance(dims, list) else [dims]
            if not all(isinstance(d, int) for d in dims):
                return name
            dims = {d % max(ndim, 1) for d in dims}
            if op == "aten.cat.default":
                mixed = any(set(held[r]) & dims for r in held)
            else:
                mixed = first in held and set(held[first]) & dims
                if op in ("aten.gather.default", "aten.scatter.value"):
                    mixed = mixed or any(set(a) & dims for a in held.values())
            if mixed:
                return name
        elif op == "aten.slice.Tensor":
            dim = _axis_arg(n, 1, "dim", 0) % max(ndim, 1)
            start, end, step = (_axis_arg(n, k, key, d) for k, key, d in ((2, "start", None), (3, "end", None),
                                                                         (4, "step", 1)))
            whole = start in (None, 0) and (end is None or (isinstance(end, int) and end >= 1 << 62)) and step == 1
            if first in held and dim in held[first] and not whole:
                return name
        elif op in _REDUCED_TAIL:
            if first not in held or any(r != first for r in held) or max(held[first]) >= ndim - _REDUCED_TAIL[op]:
                return name
        elif op == "aten.constant_pad_nd.default":
            if first not in held or len(held) > 1 or max(held[first]) >= ndim - len(n["args"][1]) // 2:
                return name
        elif op == "aten.native_layer_norm.default":
            if first not in held or len(held) > 1 or max(held[first]) >= ndim - len(n["args"][1]):
                return name
        elif op in ("aten._native_batch_norm_legit_no_training.default", "aten.convolution.default"):
            if held != {first: [0]}:  # per row: the statistics and weights are the model's, none of them batched
                return name
        elif op == "aten.embedding.default":
            if n["args"][0].get("ref") in held:
                return name
        elif op == "aten.index.Tensor":
            index = n["args"][1]
            if first in held and (held[first] != [0] or (index and index[0] is not None)
                                  or any(r in held for r in _refs(index))):
                return name
        elif op in ("aten.mm.default", "aten.bmm.default", "aten.matmul.default", "aten.addmm.default",
                    "aten.baddbmm.default"):
            a, b = (n["args"][1:3] if op in ("aten.addmm.default", "aten.baddbmm.default") else n["args"][:2])
            for operand, contracted in ((a, lambda k: k - 1), (b, lambda k: k - 2 if k >= 2 else 0)):
                r = operand.get("ref") if isinstance(operand, dict) else None
                k = len(_shape_of(graph, r) or []) if r else 0
                if r in held and contracted(k) in held[r]:
                    return name
        elif op in _RESHAPES:
            pass  # checked on its shape below
        elif base not in _ELEMENTWISE and op not in _SIZED:
            return name  # an operator this check does not know: not vouched for
        if not isinstance(shape, list):
            if op in _AXIS_ARGS or op in _REDUCED_TAIL or op == "aten.native_layer_norm.default" or \
                    op == "aten._native_batch_norm_legit_no_training.default":
                batched[name] = None  # a tuple: its getitems are checked
                exprs[name] = set().union(*(exprs[r] for r in tensors)) if tensors else set()
                continue
            return name
        axes = [k for k, d in enumerate(shape) if isinstance(d, str)]
        if len(axes) != 1 or _batch_coefficient(shape[axes[0]]) is None:
            return name  # the batch gone (a reduction or contraction over it), doubled, or its size changed
        mine = shape[axes[0]]
        before = set().union(*(exprs[r] for r in tensors)) if tensors else set()
        if op in _RESHAPES:
            # a reshape keeps rows whole when the axes before the batch hold as many elements before and after it
            # ([s, 16, 32] <-> [16*s, 32], [5, s, 8] <-> [5, 2*s, 4]; never [s, 6] -> [2, 3*s])
            ahead = [_shape_of(graph, r)[:held[r][0]] for r in held] + [shape[:axes[0]]]
            if any(not all(isinstance(d, int) for d in a) for a in ahead) or len({math.prod(a) for a in ahead}) > 1:
                return name
        elif tensors and mine not in before:
            return name  # the batch axis's size changed (x[1:], a pad, a cat along it)
        batched[name], exprs[name] = axes, {mine}
    return None


def _shape_of(graph: "Graph", name: str | None) -> list | None:
    if name is None:
        return None
    shapes = graph.__dict__.get("_shapes")
    if shapes is None:
        shapes = {i["name"]: i["shape"] for i in graph.inputs}
        shapes.update({k: v["shape"] for k, v in graph.constant_specs.items()})
        shapes.update({n["name"]: n.get("shape") for n in graph.nodes})
        graph.__dict__["_shapes"] = shapes
    return shapes.get(name)


class Stage(NamedTuple):
    """One stage of a pass cut for volunteers' memory (:meth:`Graph.stage_plan`): the names of its ``nodes``,
    in order; what it reads (``inputs``: the call's inputs, the model's arrays, earlier stages' values); which
    of its values later stages or the model's outputs read (``outputs``)."""

    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


class _LazyConstant:
    """Lab data a node may read as a ga array (``ga.from_array``, made only when read) or, in the
    argument positions a row asks for concretely (``take``'s indices), as its NumPy array: a
    constant of the model (or a node folded from them), or an input given as NumPy (an embedding's
    token ids)."""

    __slots__ = ("graph", "name", "value", "lab")

    def __init__(self, graph: Graph | None, name: str, value: np.ndarray | None = None):
        self.graph, self.name, self.value, self.lab = graph, name, value, None

    def numpy(self) -> np.ndarray:
        return self.graph._constant_value(self.name) if self.graph is not None else self.value

    def array(self) -> Any:
        if self.graph is not None:
            return self.graph._constant(self.name)
        if self.lab is None:
            import goblin_dask.array as ga

            self.lab = self.value[()] if self.value.ndim == 0 else ga.from_array(self.value)
        return self.lab


def _run_node(n: dict, env: Mapping[str, Any], ga: Any, aten: Any) -> Any:
    """One node of the IR: its row of ``aten.TABLE`` on its arguments (read from ``env``)."""
    r = aten.TABLE[n["op"]]
    if r.concrete == "all":
        a = _decode(n["args"], env)
        kw = {k: _decode(v, env) for k, v in n["kwargs"].items()}
    else:
        a = [_resolve(v, i in r.concrete) for i, v in enumerate(_decode(n["args"], env))]
        kw = {k: _resolve(_decode(v, env)) for k, v in n["kwargs"].items()}
    out = r.fn(ga, *a, **kw)
    if isinstance(out, ga.Array) and n.get("dtype") and out.dtype != np.dtype(n["dtype"]):
        out = ga.astype(out, n["dtype"])  # torch's type promotion where NumPy's differs
    return out


def _catalog_ops(outs: Sequence[Any]) -> set[str]:
    """The catalog operations in the dask graphs of ``outs``."""
    from goblin_dask.ops import CatalogTask

    names = set()
    for o in outs:
        if hasattr(o, "__dask_graph__"):
            for task in dict(o.__dask_graph__()).values():
                if isinstance(task, CatalogTask):
                    names.add(task.op.name)
    return names


def _resolve(v: Any, concrete: bool = False) -> Any:
    if isinstance(v, _LazyConstant):
        return v.numpy() if concrete else v.array()
    if isinstance(v, list):
        return [_resolve(x, concrete) for x in v]
    return v


def volunteer_threads() -> int:
    """The task threads of the volunteers connected now (the lab node's one reading of its workers)."""
    from goblin_dask.array.linalg import _workers_info
    from goblin_dask.roles import VOLUNTEER_RESOURCE

    return sum(int(w.get("nthreads", 1)) for w in _workers_info() if VOLUNTEER_RESOURCE in (w.get("resources") or {}))


def stage_budget() -> float:
    """Bytes of a model's own arrays one stage task may hold: ``goblin.stage.memory-fraction`` of the smallest
    volunteer thread's memory."""
    from goblin_dask import settings
    from goblin_dask.array.linalg import volunteer_capacity

    memory, _ = volunteer_capacity()
    return memory * float(settings.get("goblin.stage.memory-fraction"))


def _input_shapes(graph: Graph, env: Mapping[str, Any]) -> tuple[list[tuple], list[bool]]:
    """The call's input shapes, and which inputs have a batch axis."""
    xs = [env[i["name"]] for i in graph.inputs]
    shapes = [x.value.shape if isinstance(x, _LazyConstant) else x.shape for x in xs]
    return shapes, [bool(i["shape"]) and isinstance(i["shape"][0], str) for i in graph.inputs]


def _held_sizes(graph: Graph, env: Mapping[str, Any]) -> dict[str, int]:
    """Bytes of each of the model's own arrays (constants, folded nodes, inputs with no batch axis): what a stage
    task reading one holds whatever its slice of the batch."""
    shapes, batched = _input_shapes(graph, env)
    sizes = {i["name"]: int(math.prod(s)) * np.dtype(i["dtype"]).itemsize
             for s, b, i in zip(shapes, batched, graph.inputs) if not b}
    sizes.update({k: graph._constant_value(k).nbytes for k in [*graph.constant_specs, *graph._folded()]})
    return sizes


def _held_bytes(graph: Graph, env: Mapping[str, Any], names: Iterable[str]) -> int:
    """:func:`_held_sizes` summed over ``names``."""
    sizes = _held_sizes(graph, env)
    return sum(sizes.get(k, 0) for k in names)


def stage_slices(graph: Graph, env: Mapping[str, Any], slices: int | None = None, *, whole: bool = True) -> int:
    """How many stage tasks a pass is cut into along the batch (0: none, run op by op).

    Stage tasks need a lab node with volunteers (``goblin.stage.tasks``, on by default) and a model
    whose arrays besides the batch (constants, and inputs with no batch axis: a Trainer's parameters)
    fit ``goblin.stage.memory-fraction`` of the smallest volunteer thread's memory (``whole``; else the
    caller cuts the model into stages that each fit, :meth:`Graph.stage_plan`), none of them over
    ``goblin.minimization.parameters-max-share``'s cap; a larger model runs op by op, its products cut
    into tiles.  ``slices`` given: that many.  Else one task per
    volunteer thread, at most one per batch row, at least ``1 / max-share`` when an input is capped
    lab data, so that no task holds more of it than a product tile would."""
    from goblin_dask import settings
    from goblin_dask.array.sources import share_cap, upload_client

    if not settings.get("goblin.stage.tasks") or upload_client() is None:
        return 0
    threads = volunteer_threads()
    if not threads:
        return 0
    shapes, batched = _input_shapes(graph, env)
    if whole and _held_bytes(graph, env, graph._stage_names()) > stage_budget():
        return 0
    # a stage task holds every parameter whole: not where goblin.minimization.parameters-max-share caps them
    lab = [graph._constant_value(k).size for k in graph._stage_names()[len(graph.inputs):]]
    lab += [int(np.prod(s)) for s, b in zip(shapes, batched) if not b]
    if any(share_cap(n, "parameters") is not None for n in lab):
        return 0
    if slices is not None:
        return _rows_kept(graph, int(slices))
    outputs = [n for n in graph.nodes if n["name"] in set(_refs(list(graph.outputs)))]
    if not any(batched) or not all(n.get("shape") and isinstance(n["shape"][0], str) for n in outputs):
        return 1
    batch = min(s[0] for s, b in zip(shapes, batched) if b)
    need = 1
    for s, b in zip(shapes, batched):
        cap = share_cap(int(np.prod(s))) if b else None
        if cap:
            need = max(need, math.ceil(int(np.prod(s)) / cap))
    return _rows_kept(graph, int(max(1, min(batch, max(threads, need)))))


def _rows_kept(graph: Graph, slices: int) -> int:
    """``slices``, or 1 where a node of ``graph`` mixes rows of the batch (a slice's ``x.mean(0)`` or
    ``x.cumsum(0)`` is not the batch's): one stage task for the whole batch is always right."""
    if slices > 1 and graph.rows_mixed() is not None:
        logger.info("the captured graph runs as one stage task, not on slices of the batch: node %r mixes rows",
                    graph.rows_mixed())
        return 1
    return slices
