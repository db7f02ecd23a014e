"""``Trainer``: one verified round on the grid per optimizer step.

A round is one dask graph: for each micro-batch, the joint forward+backward graph
(:mod:`goblin_dask.training.joint`), then one task on the lab worker that sums the micro-batches'
checked gradients and steps the optimizer with torch's mathematics (:mod:`goblin_dask.training.optim`).

* **Stage tasks** (``goblin.stage.tasks``, on by default, where the model fits a volunteer): each
  micro-batch's forward and backward is one volunteer task (a ``program`` of catalog ops),
  replicated on another volunteer; the optimizer step reads the gradients straight from the
  tasks' packed results (:func:`optim.lab_round_packed`), and the new parameters, buffers and
  optimizer state stay on the lab worker for the next round (:func:`goblin_dask.array.sources.resident_array`):
  a round sends the batch and the parameters out once, and only the loss comes to this process.
* **Pipelines of stage tasks** for a model larger than one stage: the joint graph, called like a captured
  pass (:meth:`Graph.stage_plan <goblin_dask.torch_capture.graph.Graph.stage_plan>`), runs as consecutive
  stage tasks whose parameters each fit: the forward's, then one backward stage per forward stage that
  recomputes that forward (only the residual stream and its gradient cross a cut), each verified before
  the next reads it; consecutive micro-batches share a pipeline, each stage task running them in turn and
  returning one gradient (:meth:`Graph.pipelined_sum <goblin_dask.torch_capture.graph.Graph.pipelined_sum>`),
  reading its stage's parameters as one vector cut from the flat vector the lab worker kept
  (:meth:`Trainer._stage_vectors`); the optimizer step is :func:`optim.lab_round` on the lab worker.
* **Op by op** otherwise (no volunteers, an operator whose parameters alone exceed a stage, random
  operators): the joint graph built with ``ga`` calls, its products on volunteers (Freivalds-checked) and
  the rest placed and checked like any ga computation (:func:`optim.lab_round`).
* **Local steps** (``inner_steps > 1``, DiLoCo): each worker's several optimizer steps are one stage task
  returning a pseudo-gradient; the lab steps an outer optimizer with their average
  (:func:`optim.lab_outer_round_packed`).  See :class:`Trainer`.

Whichever way a round runs, its new parameters, buffers and optimizer state stay on the lab worker and the
next round's graph reads them there; this process takes them only for a checkpoint, :meth:`Trainer.state_dict`
or the end of :meth:`Trainer.fit`.

The lab's copies (this process's and the lab worker's) are the reference; they enter each round's graph
as lab arrays of kind ``"parameters"`` (not capped by ``goblin.minimization.max-share``: see
``parameters-max-share``; the batches stay data).  torch is used only to trace.
"""
from __future__ import annotations

import itertools
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import dask
import numpy as np

from goblin_dask.training import optim

_SUPPORTED = ("SGD", "Adam", "AdamW")
_ROUND_GRAPHS = itertools.count()


@dataclass
class Stage:
    """A group of consecutive top-level layers and the bytes of their parameters."""

    index: int
    layers: list[str]
    parameter_bytes: int


@dataclass
class Plan:
    """The cut of a model: ``stages``, ``micro_batches``, and the tiles' memory cap ``stage_memory``.

    * ``stages``: consecutive top-level layers grouped while their parameters fit ``stage_memory``
      (a layer larger than that is a stage of its own).  A micro-batch's forward runs stage after
      stage and its backward in reverse, as dask orders the joint graph's tasks by their data.
    * ``micro_batches``: each batch is cut into that many; their forward+backward graphs are
      independent until the lab sums their gradients, so the micro-batches of all stages are in
      flight together (no stage waits for a whole batch).
    * tiles: no volunteer task of a stage's forward or backward may hold more than ``stage_memory``
      bytes of inputs and outputs (parameters and a micro-batch's activations alike).  The round
      is built with ``goblin.product.volunteer-memory = stage_memory`` and ``memory-fraction = 1``,
      so the array layer cuts every product into tiles whose two panels and two output-sized
      blocks (the result and a chain's partial sum) fit it (:func:`goblin_dask.array.linalg.product_blocks`),
      and with ``array.chunk-size = stage_memory / 4`` so any other blockwise task (up to three
      operands and a result) fits too.  A model larger than any volunteer therefore never needs a
      whole stage on one machine: each task does.  ``None``: no cap beyond the array layer's own.

    The unit scheduled is the tile (a task), not the stage: dask places each tile on whichever
    volunteer is free, so a stage's layers are not pinned to one volunteer (no pipeline of
    stage-owning machines); what ``stage_memory`` guarantees is that every task fits under it.
    """

    stages: list[Stage]
    micro_batches: int
    stage_memory: int | None = None
    parameter_bytes: int = field(default=0)


def _layers(module: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Top-level layers in order, containers (``Sequential``, ``ModuleList``) opened: ``blocks.0``, ``blocks.1``."""
    out = []
    for name, child in module.named_children():
        full = f"{prefix}{name}"
        if type(child).__name__ in ("Sequential", "ModuleList") and len(list(child.children())):
            out.extend(_layers(child, full + "."))
        else:
            out.append((full, child))
    return out


def _plan(model: Any, micro_batches: int, stage_memory: int | None) -> Plan:
    layers = [(name, sum(p.numel() * p.element_size() for p in child.parameters()))
              for name, child in _layers(model)]
    own = sum(p.numel() * p.element_size() for p in model.parameters(recurse=False))
    if own:
        layers.insert(0, ("<root>", own))
    if not layers:
        layers = [("<root>", 0)]
    stages: list[Stage] = []
    for name, nbytes in layers:
        if stages and (stage_memory is None or stages[-1].parameter_bytes + nbytes <= stage_memory):
            stages[-1].layers.append(name)
            stages[-1].parameter_bytes += nbytes
        else:
            stages.append(Stage(len(stages), [name], nbytes))
    return Plan(stages, micro_batches, stage_memory, sum(s.parameter_bytes for s in stages))


def _groups_of(optimizer: Any, by_id: dict, what: str) -> dict[str, int]:
    """Parameter name -> the index of its group in ``optimizer.param_groups`` (each must be the model's)."""
    out: dict[str, int] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in by_id:
                raise ValueError(f"{what} holds a parameter of shape {tuple(p.shape)} that is not the model's")
            out[by_id[id(p)]] = gi
    return out


def _hyper(group: dict, kind: str) -> dict:
    def num(v: Any) -> Any:
        return float(v.item()) if hasattr(v, "item") else v

    if group.get("differentiable") or group.get("capturable"):
        raise ValueError(f"{kind}: differentiable/capturable optimizers are not supported on the grid")
    h = {"kind": "sgd" if kind == "SGD" else "adam", "lr": float(num(group["lr"])),
         "weight_decay": float(num(group.get("weight_decay", 0.0))), "maximize": bool(group.get("maximize", False))}
    if kind == "SGD":
        h.update(momentum=float(num(group.get("momentum", 0.0))), dampening=float(num(group.get("dampening", 0.0))),
                 nesterov=bool(group.get("nesterov", False)))
    else:
        h.update(betas=tuple(float(num(b)) for b in group["betas"]), eps=float(group["eps"]),
                 amsgrad=bool(group.get("amsgrad", False)),
                 decoupled_weight_decay=bool(group.get("decoupled_weight_decay", kind == "AdamW")))
    return h


class Trainer:
    """Train ``model`` on the grid: ``step(x, y) -> loss``, ``fit(batches)``, ``state_dict()``, ``plan``.

    ``loss_fn(output, target)`` is traced with the model (torch's backward, core ATen, the capture
    table); ``optimizer`` a ``torch.optim.SGD``/``Adam``/``AdamW`` over the model's parameters,
    read at each round.  ``micro_batches`` splits each batch (forward+backward graphs in parallel,
    gradients summed at the lab: torch's gradient accumulation of ``loss_i * n_i / n``); BatchNorm in
    train mode updates its running statistics micro-batch after micro-batch, as torch would.
    ``stage_memory`` caps every volunteer task of the round (see :class:`Plan`).  Dropout in train mode
    draws its masks from ``seed`` (random by default; kept in checkpoints): micro-batch ``i`` of round
    ``r`` from ``PCG64((seed, r, i, k, *block))`` for its ``k``-th random operator, as catalog
    ``random_uniform`` blocks, so replicas and the lab's checks draw the same masks.  They are not
    torch's masks (torch's generator gives other numbers); torch given the same masks trains the same.

    **Local steps** (``inner_steps=H > 1``, DiLoCo): a round is one *outer* step.  The batch is cut into
    ``micro_batches`` shards, one per worker; each worker (one stage task on a volunteer, replicated and
    checked like any stage task) takes ``H`` steps of ``optimizer`` (the *inner* optimizer, afresh each round:
    its state would cost twice the parameters' bytes each way) on ``H`` consecutive slices of its shard, and
    returns its pseudo-gradient (the parameters it started from minus those it ended with).  The lab averages
    them (weighted by the shards' sizes) and steps ``outer_optimizer`` with that as the gradient: a
    ``torch.optim.SGD`` over the model's parameters, by default DiLoCo's ``lr=0.7, momentum=0.9,
    nesterov=True``; its state stays on the lab worker.  So a round sends the parameters out and a
    pseudo-gradient back once per worker for ``H`` optimizer steps.  ``step`` returns the mean of the inner
    steps' losses (each before its own update).  Needs the round as stage tasks (see :meth:`_staged`);
    ``inner_steps=1`` is synchronous training, torch's numbers.
    """

    def __init__(self, model: Any, loss_fn: Callable, optimizer: Any, micro_batches: int = 4,
                 stage_memory: int | None = None, client: Any = None, *, checkpoint_dir: Any = None,
                 checkpoint_every: int = 0, seed: int | None = None, inner_steps: int = 1,
                 outer_optimizer: Any = None):
        kind = type(optimizer).__name__
        if kind not in _SUPPORTED or not hasattr(optimizer, "param_groups"):
            raise TypeError(f"optimizer {kind}: the grid steps torch.optim.SGD, Adam and AdamW")
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
        if not isinstance(inner_steps, int) or isinstance(inner_steps, bool) or inner_steps < 1:
            raise ValueError(f"inner_steps must be a positive int (1: synchronous training), got {inner_steps!r}")
        if outer_optimizer is not None and inner_steps == 1:
            raise ValueError("outer_optimizer steps the workers' averaged pseudo-gradients of local steps: "
                             "give inner_steps > 1 with it, or leave it out")
        if outer_optimizer is not None and (type(outer_optimizer).__name__ != "SGD"
                                            or not hasattr(outer_optimizer, "param_groups")):
            raise TypeError(f"outer_optimizer {type(outer_optimizer).__name__}: the outer step is torch.optim.SGD "
                            "(DiLoCo: lr=0.7, momentum=0.9, nesterov=True, the default)")
        self.model, self.loss_fn, self.optimizer, self.kind = model, loss_fn, optimizer, kind
        self.micro_batches, self.client, self.inner_steps = micro_batches, client, inner_steps
        named = dict(model.named_parameters())
        by_id = {id(p): n for n, p in named.items()}
        self._group_of = _groups_of(optimizer, by_id, kind)
        if inner_steps > 1 and outer_optimizer is None:
            import torch

            outer_optimizer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        #: the optimizer of the outer step with local steps (None: synchronous training)
        self.outer_optimizer = outer_optimizer
        self._outer_group_of = _groups_of(outer_optimizer, by_id, "outer_optimizer") if outer_optimizer else {}
        # parameters the optimizer does not hold are still differentiated, never stepped: keep them out
        self.param_names = [n for n in named if n in self._group_of]
        frozen = [n for n in named if n not in self._group_of]
        if frozen:
            raise ValueError(f"parameters {frozen[:3]} are not in the optimizer (freezing is not supported yet)")
        outside = [n for n in self.param_names if self._outer_group_of and n not in self._outer_group_of]
        if outside:
            raise ValueError(f"parameters {outside[:3]} are not in outer_optimizer: give it model.parameters()")
        self.buffer_names = [n for n, _ in model.named_buffers()]
        self._params = {n: named[n].detach().cpu().numpy().copy() for n in self.param_names}
        self._buffers = {n: b.detach().cpu().numpy().copy() for n, b in model.named_buffers()}
        #: the state of the optimizer the lab steps: ``optimizer``'s, or with local steps ``outer_optimizer``'s
        lab_optimizer = self.outer_optimizer or optimizer
        self._state = [self._torch_state(lab_optimizer.state.get(named[n], {})) for n in self.param_names]
        self._alias = {n: by_id[id(t)] for n, t in model.named_parameters(remove_duplicate=False)}
        self._joint: dict[tuple, Any] = {}
        self._group_programs: dict[tuple, Any] = {}  # stage programs of several micro-batches, by shapes and weights
        self.history: list[dict] = []
        self.rounds = 0
        #: the Future of the lab worker's result of the last round that kept its parameters, buffers and
        #: optimizer state there (:meth:`_sync_host` brings them here), or None
        self._resident: Any = None
        #: the round the arrays in this process are of (behind ``rounds`` while the lab worker holds newer ones)
        self._host_round = 0
        self.checkpoint_dir, self.checkpoint_every = checkpoint_dir, int(checkpoint_every or 0)
        if self.checkpoint_every and checkpoint_dir is None:
            raise ValueError("checkpoint_every needs a checkpoint_dir (e.g. the lab node's state dir)")
        if stage_memory is None and client is not None:
            stage_memory = _volunteer_stage_memory(client)
        self.plan = _plan(model, micro_batches, stage_memory)
        #: the base of the seeds random operators (dropout) draw from: micro-batch ``i`` of round ``r``
        #: draws from ``(seed, r, i, k, *block)`` (:func:`goblin_dask.torch_capture.aten.random_seed`);
        #: saved in checkpoints, so a resumed run draws the same masks
        import secrets

        self.seed = int(seed) if seed is not None else secrets.randbits(62)
        if self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")

    @staticmethod
    def _torch_state(s: dict) -> dict:
        out = {}
        for k, v in s.items():
            if v is None:
                continue
            out[k] = float(v.item()) if k == "step" else v.detach().cpu().numpy().copy()
        return out

    # -- a round ----------------------------------------------------------------------------

    def _check(self, x: np.ndarray, y: np.ndarray) -> None:
        if x.ndim == 0 or y.ndim == 0 or x.shape[0] != y.shape[0]:
            raise ValueError(f"step: inputs of shape {x.shape} and targets of shape {y.shape} need the same batch size")
        if x.shape[0] < self.micro_batches * self.inner_steps:
            raise ValueError(f"step: a batch of {x.shape[0]} cannot be cut into {self.micro_batches} micro-batches"
                             + (f" of {self.inner_steps} inner steps each" if self.inner_steps > 1 else ""))
        dtypes = {a.dtype for a in self._params.values() if a.dtype.kind == "f"}
        if x.dtype.kind == "f" and dtypes and x.dtype not in dtypes:
            raise TypeError(f"step: inputs are {x.dtype}, the model's parameters {sorted(d.name for d in dtypes)}")
        if x.dtype.kind not in "fiu" or y.dtype.kind not in "fiub":
            raise TypeError(f"step: inputs {x.dtype} / targets {y.dtype} (numeric arrays, integer token ids)")

    def _graph_for(self, x: np.ndarray, y: np.ndarray) -> Any:
        key = (x.shape, x.dtype.str, y.shape, y.dtype.str)
        if key not in self._joint:
            from goblin_dask.training.joint import trace

            self._joint[key] = trace(self.model, self.loss_fn, x, y, self.param_names, self.buffer_names)
        return self._joint[key]

    def _hyperparameters(self) -> list[dict]:
        """Each parameter's hyperparameters of ``optimizer`` (read at each round: a schedule applies)."""
        groups = [_hyper(g, self.kind) for g in self.optimizer.param_groups]
        return [groups[self._group_of[n]] for n in self.param_names]

    def _lab_hyperparameters(self) -> list[dict]:
        """Those of the optimizer the lab steps: ``optimizer``, or with local steps the outer one."""
        if self.outer_optimizer is None:
            return self._hyperparameters()
        groups = [_hyper(g, "SGD") for g in self.outer_optimizer.param_groups]
        return [groups[self._outer_group_of[n]] for n in self.param_names]

    def round_graph(self, x: Any, y: Any) -> tuple[dict, str]:
        """The round's dask graph and the key of its last task (the lab's optimizer step)."""
        x, y = np.asarray(x), np.asarray(y)
        self._check(x, y)
        from goblin_dask.array.linalg import concurrent_products, one_reading_of_the_workers

        # the micro-batches' products run side by side: none needs cutting for the volunteers' threads alone
        with one_reading_of_the_workers(), dask.config.set(self._caps()), concurrent_products(self.micro_batches):
            return self._round_graph(x, y)

    def _caps(self) -> dict:
        """The settings the round is built under: each volunteer task within ``plan.stage_memory`` (see :class:`Plan`)."""
        from goblin_dask import settings
        from goblin_dask.array.linalg import volunteer_capacity

        cap = self.plan.stage_memory
        if not cap:
            return {}
        # never looser than the settings already in force (a product task's budget, the block size)
        budget = volunteer_capacity()[0] * float(settings.get("goblin.product.memory-fraction"))
        chunk = int(dask.utils.parse_bytes(dask.config.get("array.chunk-size", "128MiB")))
        return {"goblin.product.volunteer-memory": int(min(cap, budget)), "goblin.product.memory-fraction": 1.0,
                "array.chunk-size": max(min(int(cap) // 4, chunk), 64)}

    def _round_graph(self, x: np.ndarray, y: np.ndarray) -> tuple[dict, str]:
        import goblin_dask.array as ga
        from dask._task_spec import DataNode, List, Task, TaskRef
        from dask.base import tokenize
        from dask.highlevelgraph import HighLevelGraph

        from goblin_dask.array import program as prog
        from goblin_dask.array.graph import optimize
        from goblin_dask.torch_capture.aten import random_seed

        n = x.shape[0]
        parts = np.array_split(np.arange(n), self.micro_batches)
        weights = [len(p) / n for p in parts]
        tok = tokenize(self.seed, self.rounds, id(self), next(_ROUND_GRAPHS))  # new keys for every graph built
        hyper_key, state_key, step_key = f"train-hyper-{tok}", f"train-state-{tok}", f"train-step-{tok}"
        # the model's own arrays, not the lab's data: capped by goblin.minimization.parameters-max-share
        # (x and y stay data; the optimizer state never leaves the lab worker's step)
        losses, grads = [], []
        # local steps: micro-batch i is worker i's shard, cut into the slices of its inner steps
        steps = [np.array_split(p, self.inner_steps) for p in parts] if self.inner_steps > 1 else None
        staged = self._staged(x, y, [s for shard in steps for s in shard] if steps else parts,
                              [self._params[k] for k in self.param_names], [self._buffers[k] for k in self.buffer_names])
        # stage tasks read the parameters as one flat vector (one lab task, one fetch), where they share a dtype
        flat = self._flat_shapes() if staged == "packed" else None
        params, bufs = self._model_arrays(tok, flat is not None)
        P = len(self.param_names)  # (not len(params): one flat vector)
        if steps and staged != "packed":
            raise ValueError(
                f"inner_steps={self.inner_steps}: each worker's steps run as one stage task, and this round cannot: "
                "it needs goblin.stage.tasks on, volunteers connected, the model within goblin.stage.memory-fraction "
                "of a volunteer thread's memory (one stage), no random operator (dropout), and the parameters not "
                "capped by goblin.minimization.parameters-max-share.  Use inner_steps=1 (synchronous training)")
        bufs0 = bufs
        if staged:  # the batch goes to the lab worker once; each micro-batch's stage task reads its slice of it
            xa, ya = ga.from_array(x), ga.from_array(y)
        packed, layouts = [], []
        for shard in steps or ():  # one task per worker: its inner steps, its pseudo-gradient
            self._check_share(x, y, shard)
            program = self._local_program(x, y, shard, params, bufs, flat)
            stage, _ = prog.call_packed(program, *params, *bufs, *self._slice_inputs(x, y, xa, ya, shard))
            packed.append(stage)
            layouts.append((len(shard), [len(idx) / n for idx in shard], _outputs_where(program)))
        for group in (self._stage_groups(x, y, parts) if staged == "packed" and not steps else ()):
            program = self._group_program(x, y, parts, weights, group, params, bufs, flat)
            stage, _ = prog.call_packed(program, *params, *bufs, *self._slice_inputs(x, y, xa, ya, [parts[i] for i in group]))
            where = _outputs_where(program)
            packed.append(stage)
            layouts.append((len(group), [weights[i] for i in group], where))
            # the next group's forward sees the running statistics so far
            bufs = [_cut(stage, w) if w[0] == "packed" else
                    (params + bufs)[w[1]] if w[0] == "input" else ga.from_array(np.asarray(w[1]))
                    for w in where[len(group) + P:]]
        pipelined = None if staged else self._pipelined_groups(x, y, parts, weights, params, bufs, tok)
        step_shapes = None  # the step's parameters as one flat vector (their shapes), or None: one array each
        if pipelined is not None:
            losses, grads, loss_weights, flat_params = pipelined
            if flat_params is not None:  # (the stage tasks read theirs cut from it: no array per parameter)
                params, step_shapes = [flat_params], self._flat_shapes()
        for i, idx in enumerate(parts if staged != "packed" and pipelined is None else ()):
            lo, hi = idx[0], idx[-1] + 1
            xi, yi = x[lo:hi], y[lo:hi]
            graph = self._graph_for(xi, yi)
            with random_seed((self.seed, self.rounds, i)):
                out = graph(*params, *bufs, xa[lo:hi], ya[lo:hi], slices=1) if staged else graph(*params, *bufs, xi, yi)
            out = [o if isinstance(o, ga.Array) else ga.from_array(np.asarray(o)) for o in out]
            losses.append(out[0])
            grads.append(out[1:1 + P])
            bufs = out[1 + P:]  # the next micro-batch's forward sees the running statistics so far
        # a gradient the step cuts from its stage task's packed result itself: (packed, where)
        arrays = [*params, *packed, *losses, *(g[0] if isinstance(g, tuple) else g for gs in grads for g in gs), *bufs]
        # one merge: each array's graph holds most of the others' (a dict per array cost seconds per round)
        dsk = dict(HighLevelGraph.merge(*(a.__dask_graph__() for a in arrays)).to_dict())
        dsk = optimize(dsk, [a.__dask_keys__() for a in arrays])

        def refs(a: Any) -> Any:
            if isinstance(a, tuple):  # (packed result, where): cut by the step (optim.gradient)
                return List("packed", TaskRef(a[0].__dask_keys__()[0]), *a[1])

            def nest(k):
                return List(*(nest(e) for e in k)) if isinstance(k, list) else TaskRef(k)
            return nest(a.__dask_keys__())

        dsk[hyper_key] = DataNode(hyper_key, self._lab_hyperparameters())
        if self._resident is not None:  # the state the lab worker kept from the last round
            dsk[state_key] = Task(state_key, optim.field, self._resident, "state")
        else:
            dsk[state_key] = DataNode(state_key, [dict(s) for s in self._state])
        forms = [(self._buffers[k].shape, self._buffers[k].dtype.str) for k in self.buffer_names]
        if steps:
            dsk[step_key] = Task(step_key, optim.lab_outer_round_packed, TaskRef(hyper_key),
                                 List(*(refs(p) for p in params)), TaskRef(state_key),
                                 List(*(TaskRef(p.__dask_keys__()[0]) for p in packed)), layouts, weights,
                                 List(*(refs(b) for b in bufs0)), forms, flat)
        elif staged == "packed":
            dsk[step_key] = Task(step_key, optim.lab_round_packed, TaskRef(hyper_key), List(*(refs(p) for p in params)),
                                 TaskRef(state_key), List(*(TaskRef(p.__dask_keys__()[0]) for p in packed)),
                                 layouts, List(*(refs(b) for b in bufs0)), forms, flat)
        else:
            grad_weights = list(weights) if pipelined is None else [1.0] * len(grads)  # (groups' sums: weighted)
            dsk[step_key] = Task(step_key, optim.lab_round, TaskRef(hyper_key), List(*(refs(p) for p in params)),
                                 TaskRef(state_key), grad_weights, List(*(refs(l) for l in losses)),
                                 List(*(List(*(refs(g) for g in gs)) for gs in grads)), List(*(refs(b) for b in bufs)),
                                 list(weights) if pipelined is not None else None, step_shapes)
        return dsk, step_key

    def _pipelined_groups(self, x: np.ndarray, y: np.ndarray, parts: list, weights: list, params: list,
                          bufs: list, tok: str = "") -> tuple[list, list, list, Any] | None:
        """A round of a model larger than one stage: the micro-batches in groups (:meth:`_stage_groups`), each group
        one pipeline of stage tasks that run the group's micro-batches in turn and return one gradient, their
        weighted sum (:meth:`Graph.pipelined_sum`).  ``(losses per micro-batch, [gradients] per group, the
        losses' weights, the flat vector of the parameters, or None where no stage task reads it)``, or None: a
        pipeline per micro-batch (a pass that writes its buffers, as BatchNorm's running statistics, each
        micro-batch reading the last one's; micro-batches of different shapes in a group; a pass that is no
        multi-stage pipeline).

        Where the parameters flatten (:meth:`_flat_shapes`), each stage task reads its own parameters as one
        vector cut from their flat vector on the lab worker (:meth:`_stage_vectors`): one lab task per stage (and
        one for the flat vector, which the step reads then), not one per parameter."""
        import goblin_dask.array as ga

        P = len(params)
        vectors = self._stage_vectors(tok)
        flat = (range(P), vectors) if vectors is not None else None
        losses, grads, checked = [], [], False
        for group in self._stage_groups(x, y, parts, chained=False):
            rows = [parts[i] for i in group]
            shapes = {(len(idx),) for idx in rows}
            if len(shapes) != 1:
                return None
            graph = self._graph_for(x[rows[0][0]:rows[0][-1] + 1], y[rows[0][0]:rows[0][-1] + 1])
            if not checked:  # buffers the pass leaves as they came: no micro-batch reads another's
                names = [i["name"] for i in graph.inputs]
                if any(graph.outputs[1 + P + j] != {"ref": names[P + j]} for j in range(len(bufs))):
                    return None
                checked = True
            calls = [(*params, *bufs, x[idx[0]:idx[-1] + 1], y[idx[0]:idx[-1] + 1]) for idx in rows]
            out = graph.pipelined_sum(calls, [weights[i] for i in group], range(1, 1 + P), packed=True, flat=flat)
            if out is None:
                return None
            per_call, summed = out
            losses += [o[0] if isinstance(o[0], ga.Array) else ga.from_array(np.asarray(o[0])) for o in per_call]
            grads.append(summed)
        used = vectors is not None and any(v is not None for v in vectors.made.values())
        return losses, grads, list(weights), vectors.flat if used else None

    def _stage_vectors(self, tok: str) -> Any:
        """For :meth:`Graph.pipelined_sum`'s ``flat``: ``vector(positions)``, the parameters at ``positions`` (in
        ``param_names``) as one lab array, cut from the flat vector of all of them (:func:`optim.flatten`) by one
        lab task (:func:`goblin_dask.array.sources.pieces_array`; a run of consecutive parameters is a view of
        it), made once per set of positions in a round (a forward stage and its backward read the same).  The
        flat vector is the lab worker's, kept from the last round (``vector.flat``; the step reads it too).

        None (each parameter one lab array, as the step reads them) where the parameters do not flatten (dtypes
        differ) or the round reads this process's copies (the first round, one after :meth:`_sync_host`): the
        round's graph has made those arrays, one upload each, before it knows whether the pass runs as a
        pipeline, and a flat vector sent as well would be the parameters' bytes twice.  ``vector`` returns None
        (that stage reads its parameters one by one) where ``goblin.minimization.parameters-max-share`` would
        cap the vector: a stage task holds a whole vector, and a cap applies to a whole lab array."""
        from goblin_dask.array.sources import pieces_array, share_cap

        shapes = self._flat_shapes()
        if shapes is None or self._on_host():
            return None
        flat = self._flat_parameters(tok)
        starts = np.cumsum([0] + [math.prod(s) for s in shapes]).tolist()
        made: dict[tuple, Any] = {}

        def vector(positions: Any) -> Any:
            positions = tuple(int(j) for j in positions)
            if positions not in made:
                pieces: list[list[int]] = []
                for j in positions:
                    a, b = starts[j], starts[j + 1]
                    if a == b:
                        continue
                    if pieces and pieces[-1][1] == a:
                        pieces[-1][1] = b
                    else:
                        pieces.append([a, b])
                size = sum(b - a for a, b in pieces)
                if not pieces or share_cap(size, "parameters") is not None:
                    made[positions] = None
                else:
                    made[positions] = pieces_array(flat, pieces, kind="parameters")
            return made[positions]

        vector.flat, vector.made = flat, made
        return vector

    def _stage_groups(self, x: np.ndarray, y: np.ndarray, parts: list, chained: bool | None = None) -> list[list[int]]:
        """The micro-batches each stage task runs, consecutive ones together: as few tasks as keep every
        volunteer thread busy (one, where each micro-batch reads the buffers the one before it wrote: they run
        in turn anyway; ``chained`` None: found from the pass's program), and as many as
        ``goblin.minimization.max-share`` needs, no task holding more of the batch than its share.  A task
        returns one gradient, its micro-batches' sum, whatever their number."""
        from goblin_dask.array.sources import share_cap
        from goblin_dask.torch_capture.graph import volunteer_threads

        m = len(parts)
        need = 1
        for a in (x, y):
            cap = share_cap(int(a.size))
            if cap:
                need = max(need, math.ceil(a.size / cap))
        if chained is None:
            lo, hi = parts[0][0], parts[0][-1] + 1
            program = self._micro_program(x[lo:hi], y[lo:hi])
            p = len(self.param_names)
            chained = any(kind != "input" for kind, _ in program.results[1 + p:])  # buffers the pass writes
        tasks = min(m, max(need, 1 if chained else volunteer_threads()))
        return [list(g) for g in np.array_split(np.arange(m), tasks)]

    @staticmethod
    def _check_share(x: np.ndarray, y: np.ndarray, shard: list) -> None:
        """A worker of local steps holds its whole shard: refuse one over ``goblin.minimization.max-share``."""
        from goblin_dask.array.sources import share_cap

        rows = sum(len(idx) for idx in shard)
        for what, a in (("inputs", x), ("targets", y)):
            cap = share_cap(int(a.size))
            if cap and rows * (a.size // a.shape[0]) > cap:
                raise ValueError(f"inner_steps: a worker's shard of {rows} rows of the {what} is more than "
                                 "goblin.minimization.max-share lets one volunteer hold; raise micro_batches (more, "
                                 "smaller shards) or the share")

    def _slice_inputs(self, x: np.ndarray, y: np.ndarray, xa: Any, ya: Any, slices: list) -> list:
        """A stage program's inputs after the parameters and buffers: for each of its micro-batches (rows ``idx``
        of the batch), its slice of the batch the lab worker holds, and the joint graph's lab constants."""
        out = []
        for idx in slices:
            lo, hi = idx[0], idx[-1] + 1
            graph = self._graph_for(x[lo:hi], y[lo:hi])
            out += [xa[lo:hi], ya[lo:hi], *(graph._constant(k) for k in graph._stage_names()[len(graph.inputs):])]
        return out

    def _micro_program(self, x: np.ndarray, y: np.ndarray) -> Any:
        """The stage program of one micro-batch ``(x, y)``'s forward and backward (traced once per shapes), or
        None where it cannot be one (:meth:`Graph.stage_program`)."""
        shapes = [v.shape for v in (*self._params.values(), *self._buffers.values())]
        return self._graph_for(x, y).stage_program([*shapes, x.shape, y.shape])

    def _group_program(self, x: np.ndarray, y: np.ndarray, parts: list, weights: list, group: list,
                       params: list, bufs: list, flat: list | None = None) -> Any:
        """One stage program for the micro-batches of ``group``: each one's forward and backward in turn (the
        buffers one writes read by the next), the gradients summed with the round's weights in micro-batch
        order (as the lab's step sums them, and torch accumulates them); out come each micro-batch's loss, the
        summed gradients and the buffers after the last.  Traced once per shapes and weights.  ``flat``: the
        parameters' shapes, read from one flat vector (:meth:`_traced`)."""
        import goblin_dask.array as ga

        slices = [parts[i] for i in group]
        key = ("sum", tuple((len(idx), weights[i]) for idx, i in zip(slices, group)))
        dtypes = [self._params[k].dtype for k in self.param_names]

        def body(passes, ps, bs):
            losses, total = [], None
            for i, run in zip(group, passes):
                out = run(ps, bs)
                losses.append(out[0])
                scaled = [ga.multiply(gr, dt.type(weights[i])) for gr, dt in zip(out[1:1 + len(ps)], dtypes)]
                total = scaled if total is None else [ga.add(t, s) for t, s in zip(total, scaled)]
                bs = list(out[1 + len(ps):])
            return [*losses, *total, *bs]

        return self._traced(key, x, y, slices, params, bufs, body, flat)

    def _local_program(self, x: np.ndarray, y: np.ndarray, shard: list, params: list, bufs: list,
                       flat: list | None = None) -> Any:
        """A worker's stage program of local steps: for each slice of its ``shard`` in turn, forward and backward
        then one step of the inner optimizer (:func:`optim.step` on ga arrays, from fresh
        state, this round's hyperparameters); out come each step's loss, the pseudo-gradient (start minus end)
        and the buffers after the last step.  Traced once per shapes and hyperparameters."""
        import goblin_dask.array as ga

        hyper = self._hyperparameters()
        key = ("local", tuple(len(idx) for idx in shard), repr(hyper))

        def body(passes, start, bs):
            ps, state, losses = list(start), [{} for _ in start], []
            for run in passes:
                out = run(ps, bs)
                losses.append(out[0])
                ps = [optim.step(p, g, st, h) for p, g, st, h in zip(ps, out[1:1 + len(ps)], state, hyper)]
                bs = list(out[1 + len(ps):])
            return [*losses, *(ga.subtract(a, b) for a, b in zip(start, ps)), *bs]

        return self._traced(key, x, y, shard, params, bufs, body, flat)

    def _traced(self, key: tuple, x: np.ndarray, y: np.ndarray, slices: list, params: list, bufs: list,
                body: Callable, flat: list | None = None) -> Any:
        """The stage program ``body(passes, params, buffers)`` builds, cached under ``key``: ``passes[k](params,
        buffers)`` gives the joint graph's outputs (loss, gradients, buffers after) for the batch's rows
        ``slices[k]``; the program's inputs are the parameters, the buffers, then :meth:`_slice_inputs`'.
        ``flat`` (the parameters' shapes): the parameters come as one vector (``params`` is that one array),
        cut into views by the program's first steps."""
        import goblin_dask.array as ga
        from goblin_dask.array import program as prog
        from goblin_dask.ops.spec import Aval

        key = (key, x.shape[1:], x.dtype.str, y.shape[1:], y.dtype.str, flat is not None)
        if key in self._group_programs:
            return self._group_programs[key]
        graphs = [self._graph_for(x[idx[0]:idx[-1] + 1], y[idx[0]:idx[-1] + 1]) for idx in slices]
        P_in, B = len(params), len(bufs)
        P = P_in if flat is None else len(flat)
        avals = [Aval(tuple(a.shape), a.dtype) for a in (*params, *bufs)]
        names = [g._stage_names() for g in graphs]
        for idx, g, nm in zip(slices, graphs, names):
            lo, hi = idx[0], idx[-1] + 1
            avals += [Aval(x[lo:hi].shape, x.dtype), Aval(y[lo:hi].shape, y.dtype)]
            avals += [Aval.of(g._constant_value(k)) for k in nm[len(g.inputs):]]

        def fn(*arrays):
            at, passes = P_in + B, []
            for g, nm in zip(graphs, names):
                mine = arrays[at:at + len(nm) - P - B]
                at += len(nm) - P - B
                passes.append(lambda ps, bs, g=g, nm=nm, mine=mine: g._evaluate(dict(zip(nm, [*ps, *bs, *mine]))))
            ps = list(arrays[:P_in]) if flat is None else optim.unflatten(arrays[0], flat, ga.reshape)
            return body(passes, ps, list(arrays[P_in:P_in + B]))

        self._group_programs[key] = prog.trace(fn, avals)
        return self._group_programs[key]

    def _flat_shapes(self) -> list[tuple] | None:
        """The parameters' shapes where a round reads them as one flat vector (:func:`optim.flatten`: two or more
        parameters of one dtype), else None."""
        host = [self._params[k] for k in self.param_names]
        return [tuple(p.shape) for p in host] if optim.flattens(host) else None

    def _model_arrays(self, tok: str, flat: bool = False) -> tuple[list, list]:
        """The parameters and buffers for a round's graph: the lab worker's, kept there from the last round
        (no upload), or this process's copies as lab arrays.  ``flat``: the parameters as one vector, a list of
        one array (:meth:`_flat_shapes`)."""
        if self._on_host():
            params = ([self._flat_parameters(tok)] if flat
                      else [_parameters(self._params[k]) for k in self.param_names])
            return params, [_parameters(self._buffers[k]) for k in self.buffer_names]
        from goblin_dask.array.sources import resident_array

        def kept(what: str, host: dict, names: list) -> list:
            return [resident_array(self._resident, (what, j), host[k].shape, host[k].dtype, (tok, what, j),
                                   kind="parameters") for j, k in enumerate(names)]

        params = [self._flat_parameters(tok)] if flat else kept("params", self._params, self.param_names)
        return params, kept("buffers", self._buffers, self.buffer_names)

    def _on_host(self) -> bool:
        """Does the round read this process's copies of the parameters and buffers (the first round, one after
        :meth:`load` or :meth:`_sync_host`), rather than the lab worker's, kept from the last round?"""
        return self._resident is None or self._host_round == self.rounds

    def _flat_parameters(self, tok: str) -> Any:
        """The parameters as one flat vector (:func:`optim.flatten`; they must flatten, :meth:`_flat_shapes`), a
        one-block lab array: the lab worker's, kept from the last round (its ``"flat"``), or this process's copy."""
        host = [self._params[k] for k in self.param_names]
        if self._on_host():
            return _parameters(optim.flatten(host)[0], -1)
        from goblin_dask.array.sources import resident_array

        return resident_array(self._resident, ("flat",), (sum(p.size for p in host),), host[0].dtype,
                              (tok, "flat"), kind="parameters")

    def _sync_host(self) -> None:
        """Bring the parameters, buffers and optimizer state the lab worker kept from the last round into this
        process (for a checkpoint, :meth:`state_dict`, or a round that runs op by op)."""
        if self._resident is None or self._host_round == self.rounds:
            return
        try:
            out = self._resident.result()
        except Exception as e:
            raise RuntimeError(
                f"the lab worker kept the parameters of rounds {self._host_round + 1} to {self.rounds} and they are gone "
                f"({type(e).__name__}: {e}); this process holds round {self._host_round}'s.  Take the model "
                "(state_dict, save, or fit's end) while the lab node runs, or resume from a checkpoint "
                "(checkpoint_every)") from e
        self._take(out)

    def _take(self, out: dict) -> None:
        for k, v in zip(self.param_names, out["params"]):
            self._params[k] = v
        for k, v in zip(self.buffer_names, out["buffers"]):
            self._buffers[k] = np.asarray(v, dtype=self._buffers[k].dtype).reshape(self._buffers[k].shape)
        self._state = out["state"]
        self._host_round = self.rounds

    def _staged(self, x: np.ndarray, y: np.ndarray, parts: list, params: list, bufs: list) -> str | bool:
        """Does each micro-batch run as one stage task (its forward and backward on one volunteer, replicated
        on another), rather than op by op?  Where ``goblin.stage.tasks`` is on, the lab node has volunteers,
        the model's arrays fit ``goblin.stage.memory-fraction`` of a volunteer thread's memory, the whole model
        is one stage of the plan, and its joint graph traces to a program (no random operator).  ``"packed"``:
        every output is the program's own, so the optimizer step reads them from the packed results and the
        round's parameters and state stay on the lab worker."""
        from goblin_dask.torch_capture.graph import _LazyConstant, stage_slices

        if len(self.plan.stages) != 1:
            return False
        packed = True
        for idx in {(len(p),) for p in parts}:
            lo, hi = 0, idx[0]
            graph = self._graph_for(x[lo:hi], y[lo:hi])
            env = dict(zip((i["name"] for i in graph.inputs),
                           [*params, *bufs, _LazyConstant(None, "x", x[lo:hi]), _LazyConstant(None, "y", y[lo:hi])]))
            if not stage_slices(graph, env, 1):
                return False
            program = self._micro_program(x[lo:hi], y[lo:hi])
            if program is None:
                return False
            # an output that is one of the parameters or buffers as they came in (a buffer the pass leaves as it
            # is), or a literal, the step resolves itself; anything else is cut by the lab op by op
            inputs = len(params) + len(bufs)
            packed = packed and all(kind != "input" or v < inputs for kind, v in program.results)
        return "packed" if packed else True

    def _client(self) -> Any:
        if self.client is None:
            from distributed import get_client

            self.client = get_client()
        return self.client

    def step(self, x: Any, y: Any) -> float:
        """One round on NumPy inputs: forward+backward of every micro-batch on the grid, checked; the
        optimizer step at the lab.  Returns the batch's mean loss (before the step).

        A round of stage tasks leaves the new parameters, buffers and optimizer state on the lab worker
        (the next round reads them there); :meth:`state_dict`, :meth:`save` and the end of :meth:`fit`
        bring them here.  Take them before the lab node closes."""
        from dask._task_spec import Task, TaskRef

        before = self._report()
        t0 = time.perf_counter()
        dsk, key = self.round_graph(x, y)
        client = self._client()
        # the lab worker keeps the round's result (parameters, buffers, optimizer state) for the next round's
        # graph, whichever way the round ran; only the loss comes here
        loss_key = key.replace("train-step-", "train-loss-", 1)
        dsk[loss_key] = Task(loss_key, optim.field, TaskRef(key), "loss")
        result, loss = client.get(dsk, [key, loss_key], sync=False)
        loss = float(loss.result())
        self._resident = result
        seconds = time.perf_counter() - t0
        self.rounds += 1
        self.history.append({"round": self.rounds, "loss": loss, "seconds": seconds,
                             "verification": _delta(before, self._report())})
        _post_round(self)  # the lab's page shows the run (numbers only)
        if self.checkpoint_every and self.rounds % self.checkpoint_every == 0:
            self.save(self.checkpoint_dir)
        return loss

    # -- checkpoints ------------------------------------------------------------------------

    def save(self, directory: Any) -> str:
        """Write ``directory/round-NNNNNN`` (``arrays.npz``: parameters, buffers, optimizer state, torch's RNG
        state; ``meta.json``: round, names, steps, history) and point ``directory/latest`` at it.  No pickle;
        written to a temporary name and renamed, so a crash leaves the previous checkpoint whole."""
        import json
        import os
        import shutil

        import torch

        self._sync_host()

        root = os.fspath(directory)
        os.makedirs(root, exist_ok=True)
        name = f"round-{self.rounds:06d}"
        tmp = os.path.join(root, f".{name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        arrays = {f"param/{k}": v for k, v in self._params.items()}
        arrays.update({f"buffer/{k}": v for k, v in self._buffers.items()})
        scalars: list[dict] = []
        for i, st in enumerate(self._state):
            scalars.append({k: v for k, v in st.items() if not isinstance(v, np.ndarray)})
            arrays.update({f"state/{i}/{k}": v for k, v in st.items() if isinstance(v, np.ndarray)})
        arrays["rng/torch"] = torch.get_rng_state().numpy()
        np.savez(os.path.join(tmp, "arrays.npz"), **arrays)
        meta = {"format": "goblin-dask.training/1", "round": self.rounds, "optimizer": self.kind, "seed": self.seed,
                "inner_steps": self.inner_steps,
                "param_names": self.param_names, "buffer_names": self.buffer_names, "state_scalars": scalars,
                "history": self.history}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        final = os.path.join(root, name)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with open(os.path.join(root, ".latest.tmp"), "w") as f:
            f.write(name)
        os.replace(os.path.join(root, ".latest.tmp"), os.path.join(root, "latest"))
        return final

    def load(self, path: Any) -> "Trainer":
        """Continue from a checkpoint :meth:`save` wrote (a ``round-NNNNNN`` folder, or its parent: the latest)."""
        import json
        import os

        import torch

        path = os.fspath(path)
        if os.path.exists(os.path.join(path, "latest")):
            with open(os.path.join(path, "latest")) as f:
                path = os.path.join(path, f.read().strip())
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        if meta.get("format") != "goblin-dask.training/1":
            raise ValueError(f"{path} is not a training checkpoint (format {meta.get('format')!r})")
        if meta["param_names"] != self.param_names or meta["buffer_names"] != self.buffer_names:
            raise ValueError(f"checkpoint {path} is of another model: parameters {meta['param_names'][:3]}..., "
                             f"this model has {self.param_names[:3]}...")
        if meta["optimizer"] != self.kind:
            raise ValueError(f"checkpoint {path} holds {meta['optimizer']} state, the optimizer is {self.kind}")
        local = int(meta.get("inner_steps", 1)) > 1
        if local != (self.inner_steps > 1):
            held = "the outer optimizer's (local steps)" if local else f"{meta['optimizer']}'s (synchronous training)"
            raise ValueError(f"checkpoint {path} holds {held} state; this Trainer has inner_steps={self.inner_steps}: "
                             f"resume with inner_steps={meta.get('inner_steps', 1)}")
        with np.load(os.path.join(path, "arrays.npz"), allow_pickle=False) as z:
            for k in self.param_names:
                a = z[f"param/{k}"]
                if a.shape != self._params[k].shape or a.dtype != self._params[k].dtype:
                    raise ValueError(f"checkpoint {path}: {k} is {a.dtype}{a.shape}, the model's "
                                     f"{self._params[k].dtype}{self._params[k].shape}")
                self._params[k] = a
            for k in self.buffer_names:
                self._buffers[k] = z[f"buffer/{k}"]
            state = [dict(s) for s in meta["state_scalars"]]
            for key in z.files:
                if key.startswith("state/"):
                    _, i, name = key.split("/", 2)
                    state[int(i)][name] = z[key]
            torch.set_rng_state(torch.from_numpy(z["rng/torch"].copy()))
        self._state = state
        self.rounds = int(meta["round"])
        self._resident, self._host_round = None, self.rounds
        self.seed = int(meta.get("seed", self.seed))
        self.history = list(meta["history"])
        return self

    @classmethod
    def resume(cls, path: Any, model: Any, loss_fn: Callable, optimizer: Any, **kwargs: Any) -> "Trainer":
        """A Trainer for ``model`` continuing from the checkpoint at ``path`` (see :meth:`load`)."""
        return cls(model, loss_fn, optimizer, **kwargs).load(path)

    def fit(self, batches: Iterable, progress: bool = True) -> list[dict]:
        """Run a round per ``(x, y)`` batch (``step`` records loss, seconds and the ledger's verification of each
        round in ``history``); returns the history."""
        total = len(batches) if hasattr(batches, "__len__") else None
        for done, (x, y) in enumerate(batches, 1):
            self.step(x, y)
            if progress:
                _progress_line(self.history[-1], done, total)
        if progress and sys.stderr.isatty():  # end the redrawn line
            print(file=sys.stderr, flush=True)
        self._sync_host()  # the trained model here, whatever becomes of the lab node
        return self.history

    def _report(self) -> dict | None:
        try:
            from goblin_dask.node import rpc

            c = self._client()
            return c.sync(getattr(c.scheduler, rpc.REPORT), brief=True)
        except Exception:  # a plain dask cluster without the ledger
            return None

    # -- results ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray]:
        """torch names -> NumPy arrays (parameters, tied names included, and buffers): ``model.load_state_dict`` takes it
        (through ``{k: torch.from_numpy(v)}``, or directly: torch converts)."""
        self._sync_host()
        out = {}
        for name in self.model.state_dict():
            if name in self._alias:
                out[name] = self._params[self._alias[name]].copy()
            elif name in self._buffers:
                out[name] = self._buffers[name].copy()
        return out

    def load_into(self, model: Any) -> Any:
        """Copy the trained parameters and buffers into a torch ``model`` (returns it)."""
        import torch

        model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in self.state_dict().items()})
        return model


def _outputs_where(program: Any) -> list[tuple]:
    """Where each of a stage program's results is, as the lab's step reads them: ``("packed", start, stop, shape,
    dtype)`` in its packed result, ``("input", j)`` or ``("literal", value)``."""
    from goblin_dask.array.program import layout

    at = layout(program.spec)
    return [("packed", *at[v]) if kind == "packed" else (kind, v) for kind, v in program.results]


def _cut(packed: Any, where: tuple) -> Any:
    """Output ``("packed", start, stop, shape, dtype)`` of a stage task's packed result, as a ga array."""
    import goblin_dask.array as ga

    _, start, stop, shape, dtype = where
    piece = ga.reshape(packed[start:stop], shape)
    return piece if piece.dtype == np.dtype(dtype) else ga.astype(piece, np.dtype(dtype))


def _parameters(v: np.ndarray, chunks: Any = "auto") -> Any:
    """A parameter or buffer as a lab array of kind ``"parameters"`` (a 0-d one as lab data, as ``ga.from_array``)."""
    from goblin_dask.array.sources import from_numpy_like

    return from_numpy_like(v, chunks, kind="parameters")


def _delta(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    by = {k: v - before.get("by_method", {}).get(k, 0) for k, v in after.get("by_method", {}).items()}
    return {"tasks": after.get("tasks", 0) - before.get("tasks", 0),
            "accepted": after.get("accepted", 0) - before.get("accepted", 0),
            "rejected": after.get("rejected", 0) - before.get("rejected", 0),
            "by_method": {k: v for k, v in by.items() if v}}


def _volunteer_stage_memory(client: Any) -> int | None:
    """A quarter of the smallest volunteer thread's memory (None where the workers say nothing)."""
    try:
        workers = client.scheduler_info()["workers"].values()
    except Exception:
        return None
    limits = [(w.get("memory_limit") or 0) // max(int(w.get("nthreads") or 1), 1)
              for w in workers if "goblin-volunteer" in (w.get("resources") or {})]
    limits = [m for m in limits if m]
    return min(limits) // 4 if limits else None


def _post_round(trainer: Any) -> None:
    """Report the round just finished to the lab node for its page (``goblin_training_round``): an opaque run
    id drawn once per Trainer, the round, loss, seconds and verification counts; nothing on a plain cluster."""
    import secrets

    from goblin_dask.node import rpc

    run = trainer.__dict__.setdefault("_lab_run_id", secrets.token_hex(8))
    entry = trainer.history[-1]
    counts = {k: int(v) for k, v in (entry.get("verification") or {}).items() if k in ("tasks", "accepted", "rejected")}
    try:
        loss = float(np.asarray(entry["loss"], dtype=float))
        c = trainer._client()
        c.sync(getattr(c.scheduler, rpc.TRAINING_ROUND), run=run, round=int(entry["round"]), loss=loss,
               seconds=float(entry["seconds"]), verification=counts)
    except Exception:  # a plain dask cluster (no such handler) or an older lab node: training goes on
        pass


def _progress_line(entry: dict, done: int, total: int | None, width: int = 24, tty: bool | None = None) -> None:
    """A bar (when the number of batches is known), the round's loss, seconds and verification: on a terminal
    one line redrawn in place after each round, elsewhere (a log file, a pipe) one line per round.

    ``tty``: whether stderr is a terminal (None: ask it)."""
    v, loss, seconds = entry["verification"] or {}, entry["loss"], entry["seconds"]
    bar = f"[{'#' * (width * done // total):<{width}}] {done}/{total} " if total else f"{done} rounds "
    line = (f"{bar}round {entry['round']}: loss {loss:.5f}, {seconds:.2f} s, {v.get('accepted', 0)} checked results, "
            f"{v.get('rejected', 0)} rejected")
    if sys.stderr.isatty() if tty is None else tty:
        print(f"\r{line}", end="", file=sys.stderr, flush=True)
    else:
        print(line, file=sys.stderr, flush=True)
