"""The torch side of :func:`goblin_dask.torch_capture`: ``torch.export`` to core ATen, then the table.

Imported only when ``capture`` is called: ``import goblin_dask`` never loads torch.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

import numpy as np

from goblin_dask.torch_capture import aten
from goblin_dask.torch_capture.graph import Graph, UnsupportedOperator, encode


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - the capture extra
        raise ImportError("goblin_dask.torch_capture needs torch: pip install 'goblin-dask[capture]'") from e
    return torch


def _dtype_name(dt: Any) -> str:
    torch = _torch()
    name = str(dt).removeprefix("torch.")
    if dt == torch.bool:
        return "bool"
    try:
        return np.dtype(name).name
    except TypeError:
        raise UnsupportedOperator(f"dtype {dt}", why="NumPy has no such dtype") from None


def _decompositions() -> Any:
    """torch's core-ATen decompositions, less those of the composite operators the table maps whole
    (:data:`~goblin_dask.torch_capture.aten.KEEP_WHOLE`)."""
    torch = _torch()
    table = torch.export.default_decompositions()
    for target in aten.KEEP_WHOLE:
        _, name, overload = target.split(".")
        table.pop(getattr(getattr(torch.ops.aten, name), overload), None)
    return table


def _export(module: Any, args: tuple) -> Any:
    """The core-ATen ExportedProgram, with dim 0 of the inputs a symbolic batch size where the model allows."""
    torch = _torch()
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if tensors and all(t.ndim >= 1 for t in tensors) and len({t.shape[0] for t in tensors}) == 1:
        batch = torch.export.Dim("batch")
        dynamic = tuple({0: batch} if isinstance(a, torch.Tensor) else None for a in args)
        try:
            ep = torch.export.export(module, args, dynamic_shapes=dynamic)
            return ep.run_decompositions(_decompositions())
        except Exception:  # the model specializes its batch size (or torch cannot tell): static shapes
            pass
    return torch.export.export(module, args).run_decompositions(_decompositions())


def _target(node: Any) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    if hasattr(t, "_schema") or type(t).__name__ == "OpOverload":
        return str(t)  # "aten.addmm.default"
    return f"{getattr(t, '__module__', '')}.{getattr(t, '__name__', repr(t))}"


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)\n(?P<code>[^\n]*)')


def where(node: Any) -> str:
    """The module path (``nn_module_stack``) and the model's source line (``stack_trace``) of a node."""
    parts = []
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, cls = list(stack.values())[-1]
        parts.append(f"in module {path or '<root>'!r} ({cls.rsplit('.', 1)[-1] if isinstance(cls, str) else cls})")
    frames = list(_FRAME.finditer(node.meta.get("stack_trace") or ""))
    if frames:
        torch_dir = os.path.dirname(_torch().__file__)
        user = [f for f in frames if not f["file"].startswith(torch_dir)]
        f = (user or frames)[-1]
        parts.append(f'at {f["file"]}:{f["line"]} in {f["fn"]}: {f["code"].strip()}')
    return ", ".join(parts) if parts else "(no source location recorded)"


def _shape(val: Any) -> list | None:
    shape = getattr(val, "shape", None)
    if shape is None:
        return None
    return [int(s) if isinstance(s, int) or str(s).lstrip("-").isdigit() else str(s) for s in shape]


def fx_arg(torch: Any, v: Any, names: dict) -> Any:
    """An fx node's argument as the Graph IR's JSON value (``names``: fx node -> IR name)."""
    if isinstance(v, torch.fx.Node):
        return {"ref": names[v]}
    if isinstance(v, torch.dtype):
        return {"dtype": _dtype_name(v)}
    if isinstance(v, (torch.device, torch.layout, torch.memory_format)):
        return None
    if isinstance(v, (list, tuple)):
        return [fx_arg(torch, x, names) for x in v]
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise TypeError(f"a symbolic value {v} outside a graph node")
    return encode(v)


def capture(module: Any, example_inputs: tuple, *, dynamic_batch: bool = True) -> Graph:
    """``module`` (a ``torch.nn.Module``) as a :class:`Graph` of catalog operations.

    Exported with ``torch.export`` and decomposed to core ATen, with dim 0 of the inputs a
    symbolic batch size where the model allows (else the example's shapes).  Parameters and
    buffers become the graph's constants (NumPy arrays, lab data).  An operator the table or
    ``ga`` lacks raises :class:`UnsupportedOperator` naming it, its module and source line.
    """
    torch = _torch()
    import goblin_dask.array as ga
    from torch.export.graph_signature import InputKind, OutputKind

    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    was_training = getattr(module, "training", False)
    if hasattr(module, "eval"):
        module.eval()
    try:
        with warnings.catch_warnings():  # torch's own deprecation noise from inside export
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            if dynamic_batch:
                ep = _export(module, example_inputs)
            else:
                ep = torch.export.export(module, example_inputs).run_decompositions(_decompositions())
    finally:
        if was_training:
            module.train()

    example_shapes = [tuple(a.shape) for a in example_inputs if isinstance(a, torch.Tensor)]
    sig = ep.graph_signature
    kinds = {s.arg.name: s for s in sig.input_specs}
    inputs, constants = [], {}
    for spec in sig.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.USER_INPUT:
            continue
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            t = ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[spec.target]
            constants[name] = t.detach().cpu().numpy().copy()
        else:
            raise UnsupportedOperator(f"input kind {spec.kind.name} ({name})", why="not an inference graph")
    for spec in sig.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            raise UnsupportedOperator(f"{spec.kind.name} of {spec.target}",
                                      why="the model changes its state when called; capture takes a pure forward")

    nodes: list[dict] = []
    outputs: list = []
    names: dict[Any, str] = {}

    def arg(v: Any) -> Any:
        return fx_arg(torch, v, names)

    for node in ep.graph_module.graph.nodes:
        if node.op == "placeholder":
            names[node] = node.name
            if kinds[node.name].kind == InputKind.USER_INPUT:
                val = node.meta.get("val")
                if not isinstance(val, torch.Tensor):
                    raise UnsupportedOperator(f"input {node.name}", why="inputs must be tensors")
                example = [int(d) for d in example_shapes[len(inputs)]]
                inputs.append({"name": node.name, "shape": _shape(val), "dtype": _dtype_name(val.dtype),
                               "example": example})
            continue
        if node.op == "output":
            out = node.args[0]
            outputs = [arg(o) for o in out]
            continue
        if node.op != "call_function":
            raise UnsupportedOperator(f"{node.op} {node.target}", where(node), "only call_function nodes are mapped")
        target = _target(node)
        if target in aten.SKIP:
            continue
        lacks = aten.missing(target, ga)
        if lacks is None:
            raise UnsupportedOperator(target, where(node), "no row in goblin_dask.torch_capture.aten.TABLE")
        if lacks:
            raise UnsupportedOperator(target, where(node), f"ga.{', ga.'.join(lacks)} not in goblin_dask.array yet")
        if target == "_operator.getitem" and isinstance(node.args[0], torch.fx.Node):
            producer = _target(node.args[0])
            why = aten.partial_refusal(producer, node.args[1])
            if why is not None:  # torch's result there has a shape and numbers: never a stand-in for it
                raise UnsupportedOperator(producer, where(node), why)
        val = node.meta.get("val")
        try:
            a, kw = arg(list(node.args)), {k: arg(v) for k, v in node.kwargs.items()}
        except TypeError as e:
            raise UnsupportedOperator(target, where(node), str(e)) from None
        names[node] = node.name
        nodes.append({"name": node.name, "op": target, "args": a, "kwargs": kw,
                      "shape": _shape(val) if isinstance(val, torch.Tensor) else None,
                      "dtype": _dtype_name(val.dtype) if isinstance(val, torch.Tensor) else None})

    single = ep.call_spec.out_spec.is_leaf()  # the model returned one tensor, not a tuple
    graph = Graph(inputs, constants, nodes, outputs, single=single)

    # Build the computation once for the example's shapes: a row whose ga call refuses these
    # arguments fails here, at capture, with the operator's place in the model.
    by_name = {n.name: n for n in ep.graph_module.graph.nodes}
    try:
        graph._ops = graph._trace_ops()
    except Exception as e:
        name = getattr(e, "capture_node", None)
        if name is None:
            raise
        raise UnsupportedOperator(_target(by_name[name]), where(by_name[name]), f"{type(e).__name__}: {e}") from e
    return graph
