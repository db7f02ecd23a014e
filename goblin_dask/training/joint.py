"""The joint forward+backward graph of a model and its loss, taken from torch, as a :class:`Graph`.

Why torch's own backward (``torch.func.grad_and_value`` traced by ``make_fx`` and lowered to core
ATen) rather than reverse mode over the captured forward: the gradients are torch's exact
mathematics (the same decompositions torch runs), every backward operator lands in the same
table as the forward (:mod:`goblin_dask.torch_capture.aten`), and BatchNorm's running statistics
come out of the same functionalized trace.  Only a handful of backward operators need rows
(``convolution_backward`` as two convolutions, ``index_put`` as a one-hot product, ``scatter``,
``slice_scatter``, ``var_mean``).  Imported only when a Trainer is built: torch lives here.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from goblin_dask.torch_capture import aten
from goblin_dask.torch_capture.export import _dtype_name, _shape, _target, fx_arg, where
from goblin_dask.torch_capture.graph import Graph, UnsupportedOperator


def _decompositions(torch: Any) -> dict:
    """Core ATen, plus the normalizations lowered to mean/var arithmetic (their backward reads saved statistics)."""
    from torch._decomp import core_aten_decompositions, get_decompositions

    a = torch.ops.aten
    table = dict(core_aten_decompositions())
    table.update(get_decompositions([a.native_batch_norm, a._native_batch_norm_legit_functional,
                                     a._native_batch_norm_legit, a._native_batch_norm_legit_no_training,
                                     a.native_layer_norm]))
    return table


def trace(model: Any, loss_fn: Callable, x: Any, y: Any, param_names: Sequence[str],
          buffer_names: Sequence[str]) -> Graph:
    """The Graph of ``(*params, *buffers, x, y) -> (loss, *grads, *buffers after the forward)``.

    The model runs in its current mode (train: BatchNorm uses batch statistics and updates its
    running ones, which come back as outputs).  Shapes are the example's (one graph per micro-batch shape).
    """
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names, bnames = list(param_names), list(buffer_names)

    def loss_of(params, buffers, x, y):
        state = {**dict(zip(names, params)), **dict(zip(bnames, buffers))}
        out = torch.func.functional_call(model, state, (x,))
        return loss_fn(out, y), [state[b] for b in bnames]

    def joint(params, buffers, x, y):
        grads, (loss, after) = torch.func.grad_and_value(loss_of, has_aux=True)(params, buffers, x, y)
        return (loss, *grads, *after)

    named = dict(model.named_parameters())
    named_buffers = dict(model.named_buffers())
    params = [named[n].detach() for n in names]
    buffers = [named_buffers[n].detach().clone() for n in bnames]
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    # the math attention backend: attention's backward as products and softmax, not one fused kernel
    with sdpa_kernel([SDPBackend.MATH]):
        gm = make_fx(torch.func.functionalize(joint, remove="mutations"), decomposition_table=_decompositions(torch),
                     tracing_mode="fake", record_stack_traces=True)(params, buffers, xt, yt)
    graph = _to_graph(torch, gm, [*params, *buffers, xt, yt])
    # the loss and the buffers after the forward: what the forward alone makes (a stage plan recomputes it)
    graph.forward_outputs = (0, *range(1 + len(names), 1 + len(names) + len(bnames)))
    return graph


def _place(node: Any) -> str:
    """Where ``node`` is in the model; a node with no source line is one torch's autograd wrote: a gradient."""
    if node.meta.get("stack_trace"):
        return where(node)
    return ("in the backward pass (torch's gradient of a forward operator; the forward itself maps: capture the "
            "model for inference, or train that part in torch)")


def _to_graph(torch: Any, gm: Any, examples: Sequence[Any]) -> Graph:
    import goblin_dask.array as ga

    inputs, constants, nodes, outputs, names = [], {}, [], [], {}

    def arg(v: Any) -> Any:
        return fx_arg(torch, v, names)

    placeholders = iter(examples)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            t = next(placeholders)
            names[node] = node.name
            inputs.append({"name": node.name, "shape": [int(s) for s in t.shape], "dtype": _dtype_name(t.dtype),
                           "example": [int(s) for s in t.shape]})
            continue
        if node.op == "get_attr":  # a tensor constant torch lifted into the trace
            names[node] = node.name
            constants[node.name] = getattr(gm, node.target).detach().cpu().numpy().copy()
            continue
        if node.op == "output":
            outputs = [arg(o) for o in node.args[0]]
            continue
        target = _target(node)
        if target in aten.SKIP:
            continue
        lacks = aten.missing(target, ga)
        if lacks is None:
            raise UnsupportedOperator(target, _place(node), "no row in goblin_dask.torch_capture.aten.TABLE")
        if lacks:
            raise UnsupportedOperator(target, _place(node), f"ga.{', ga.'.join(lacks)} not in goblin_dask.array yet")
        val = node.meta.get("val")
        names[node] = node.name
        nodes.append({"name": node.name, "op": target, "args": arg(list(node.args)),
                      "kwargs": {k: arg(v) for k, v in node.kwargs.items()},
                      "shape": _shape(val) if isinstance(val, torch.Tensor) else None,
                      "dtype": _dtype_name(val.dtype) if isinstance(val, torch.Tensor) else None})
    return Graph(inputs, constants, nodes, outputs, single=False)


def ops_of(gm_graph: Graph) -> list[str]:
    """The ATen operators a joint graph uses (for error messages and the report)."""
    return sorted({n["op"] for n in gm_graph.nodes})


__all__ = ["trace", "ops_of"]
