"""The lab's side of a training round: sum the micro-batches' checked gradients, step the optimizer.

NumPy only (this runs on the lab worker, which never needs torch).  The updates are torch's
single-tensor SGD / Adam / AdamW, operation for operation in the parameters' dtype, so a round
matches ``optimizer.step()`` to rounding.  Hyperparameters come per parameter from the torch
optimizer's ``param_groups`` at each round (a learning-rate schedule applies as in torch).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

KINDS = ("sgd", "adam", "adamw")


def _assemble(blocks: Any) -> np.ndarray:
    from goblin_dask.array.core import finalize

    return finalize(blocks)


def sgd(p: np.ndarray, g: np.ndarray, state: dict, h: dict) -> np.ndarray:
    """torch.optim.sgd._single_tensor_sgd."""
    if h["maximize"]:
        g = -g
    if h["weight_decay"] != 0:
        g = g + h["weight_decay"] * p
    if h["momentum"] != 0:
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = g.copy()
        else:
            buf = buf * h["momentum"] + (1 - h["dampening"]) * g
        state["momentum_buffer"] = buf
        g = g + h["momentum"] * buf if h["nesterov"] else buf
    return p + (-h["lr"]) * g


def adam(p: np.ndarray, g: np.ndarray, state: dict, h: dict) -> np.ndarray:
    """torch.optim.adam._single_tensor_adam (AdamW: ``decoupled_weight_decay``): in one pass where it can
    (:mod:`goblin_dask.training._adam_kernel`, the same numbers), else NumPy's operations."""
    step = float(state.get("step", 0.0)) + 1
    state["step"] = step
    lr, (beta1, beta2), wd = h["lr"], h["betas"], h["weight_decay"]
    w = 1 - beta1
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    ea, eas = _state_or_zeros(state, "exp_avg", p), _state_or_zeros(state, "exp_avg_sq", p)
    if isinstance(p, np.ndarray) and isinstance(g, np.ndarray):
        from goblin_dask.training._adam_kernel import adam_step

        mx = _state_or_zeros(state, "max_exp_avg_sq", p) if h["amsgrad"] else None
        decay = 0 if wd == 0 else 1 if h["decoupled_weight_decay"] else 2
        done = adam_step(p, g, np.asarray(ea), np.asarray(eas), None if mx is None else np.asarray(mx),
                         [1 - lr * wd, wd, w, 1 - w, beta2, 1 - beta2, -step_size, bias_correction2 ** 0.5, h["eps"]],
                         bool(h["maximize"]), decay, w < 0.5)
        if done is not None:
            new_p, state["exp_avg"], state["exp_avg_sq"], new_max = done
            if new_max is not None:
                state["max_exp_avg_sq"] = new_max
            return new_p
    if h["maximize"]:
        g = -g
    if wd != 0:
        if h["decoupled_weight_decay"]:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
    ea = ea + w * (g - ea) if w < 0.5 else g - (g - ea) * (1 - w)  # torch's lerp
    eas = eas * beta2 + (1 - beta2) * g * g
    state["exp_avg"], state["exp_avg_sq"] = ea, eas
    if h["amsgrad"]:
        eas = np.maximum(_state_or_zeros(state, "max_exp_avg_sq", p), eas)
        state["max_exp_avg_sq"] = eas
    denom = np.sqrt(eas) / bias_correction2 ** 0.5 + h["eps"]
    return p + (-step_size) * (ea / denom)


def _state_or_zeros(state: dict, name: str, p: Any) -> Any:
    """``state[name]``, or zeros like ``p`` at the first step (made only then: a default argument would zero a
    parameter-sized array every step)."""
    v = state.get(name)
    return np.zeros_like(p) if v is None else v


def step(p: Any, g: Any, state: dict, h: dict) -> Any:
    """One update of ``h["kind"]``'s optimizer (NumPy arrays at the lab, ga arrays inside a local-steps program)."""
    return sgd(p, g, state, h) if h["kind"] == "sgd" else adam(p, g, state, h)


def gradient(v: Any) -> np.ndarray:
    """A gradient as a round's graph hands it to the step: its blocks, or ``["packed", result, start, stop, shape,
    dtype]``, a piece of a stage task's packed result that the step cuts itself (one task fewer per gradient)."""
    if isinstance(v, list) and len(v) == 6 and isinstance(v[0], str) and v[0] == "packed":
        return _task_outputs(v[1], [("packed", *v[2:])], [])[0]
    return _assemble(v)


def _weighted_sum(versions: Sequence[Any], weights: Sequence[float], dtype: np.dtype) -> np.ndarray:
    """``sum_k weights[k] * versions[k]`` in ``dtype``, in order (torch's accumulation of ``(w_k * loss_k).backward()``)."""
    total = None
    for v, w in zip(versions, weights):
        term = gradient(v)
        if w != 1:  # x * 1 is x, bit for bit: a stage task's group of micro-batches comes weighted already
            term = term * dtype.type(w)
        total = term if total is None else total + term
    return total


def _apply(hyper: Sequence[dict], params: Sequence[np.ndarray], state: Sequence[dict], weights: Sequence[float],
           grads: Sequence[Sequence[Any]]) -> tuple[list, list]:
    """The parameters and optimizer state after one step with the gradient ``sum_i weights[i] * grads[i][j]``."""
    new_params, new_state = [], []
    for j, (p, h) in enumerate(zip(params, hyper)):
        s = dict(state[j])
        p = step(p, _weighted_sum([g[j] for g in grads], weights, p.dtype), s, h)
        new_params.append(np.asarray(p, dtype=p.dtype))
        new_state.append(s)
    return new_params, new_state


def lab_round(hyper: Sequence[dict], params: Sequence[Any], state: Sequence[dict], weights: Sequence[float],
              losses: Sequence[Any], grads: Sequence[Sequence[Any]], buffers: Sequence[Any],
              loss_weights: Sequence[float] | None = None, param_shapes: Sequence[tuple] | None = None) -> dict:
    """One optimizer step from the micro-batches' results (the task at the end of a round's graph).

    ``grads[i][j]``: micro-batch i's gradient of parameter j (blocks as the graph's keys nest them);
    the gradient is ``sum_i weights[i] * grads[i][j]`` in the parameter's dtype, in micro-batch order.
    ``loss_weights``: the losses' own weights where ``grads`` come summed per group of micro-batches (then
    ``weights`` are the groups', 1 each); None: ``weights``.  ``param_shapes`` given: ``params`` is one
    :func:`flatten` vector (a round of pipelines of stage tasks, each reading its stage's piece of it).
    """
    new_params, new_state = _apply(hyper, _parameters_in(params, param_shapes)[0], state, weights, grads)
    loss_weights = weights if loss_weights is None else loss_weights
    loss = float(sum(w * float(_assemble(l)) for w, l in zip(loss_weights, losses)))
    flat, new_params = flatten(new_params)
    return {"params": new_params, "flat": flat, "state": new_state, "loss": loss,
            "buffers": [_assemble(b) for b in buffers]}


def flatten(params: Sequence[np.ndarray]) -> tuple[np.ndarray | None, list[np.ndarray]]:
    """``(flat, views)``: the parameters copied into one vector and each a view of it, where they share a dtype
    (else ``(None, params)``).  The next round's stage tasks read the vector as one value: one lab task and one
    fetch instead of one per parameter (a GPT has dozens)."""
    params = [np.asarray(p) for p in params]
    if not flattens(params):
        return None, list(params)
    flat = np.concatenate([p.reshape(-1) for p in params])
    return flat, unflatten(flat, [p.shape for p in params])


def flattens(params: Sequence[Any]) -> bool:
    """Do ``params`` travel as one :func:`flatten` vector (two or more, one dtype)?"""
    return len(params) >= 2 and len({np.dtype(p.dtype) for p in params}) == 1


def unflatten(flat: Any, shapes: Sequence[tuple], reshape: Any = np.reshape) -> list:
    """The arrays of ``shapes`` as views of :func:`flatten`'s vector; ``reshape``: ``ga.reshape`` where the program
    being traced cuts them (its first steps)."""
    out, at = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(reshape(flat[at:at + n], shape))
        at += n
    if at != flat.shape[0]:
        raise ValueError(f"a flat vector of {flat.shape[0]} numbers for arrays of {at}")
    return out


def _task_outputs(packed: np.ndarray, where: Sequence[tuple], inputs: Sequence[np.ndarray]) -> list:
    """A stage task's outputs, cut from its packed result: each ``("packed", start, stop, shape, dtype)`` a view of
    ``packed``, ``("input", j)`` the task's ``j``-th input as it came in (``inputs``), ``("literal", value)``."""
    out = []
    for w in where:
        if w[0] == "packed":
            _, a, b, shape, dt = w
            out.append(np.asarray(packed[a:b]).reshape(shape).astype(np.dtype(dt), copy=False))
        elif w[0] == "input":
            out.append(inputs[w[1]])
        else:
            out.append(np.asarray(w[1]))
    return out


def _parameters_in(params: Sequence[Any], shapes: Sequence[tuple] | None) -> tuple[list, list]:
    """The round's parameters, and the stage tasks' parameter inputs (their ``("input", j)`` outputs index these):
    the same list, or with ``shapes`` the one flat vector and its views."""
    arrays = [_assemble(p) for p in params]
    if shapes is None:
        return arrays, arrays
    return unflatten(np.asarray(arrays[0]), shapes), arrays


def _in_forms(buffers: Sequence[Any], forms: Sequence[tuple]) -> list:
    return [np.asarray(b, dtype=np.dtype(dt)).reshape(shape) for b, (shape, dt) in zip(buffers, forms)]


def lab_round_packed(hyper: Sequence[dict], params: Sequence[Any], state: Sequence[dict], packed: Sequence[np.ndarray],
                     layouts: Sequence[tuple], buffers: Sequence[Any], buffer_forms: Sequence[tuple],
                     param_shapes: Sequence[tuple] | None = None) -> dict:
    """:func:`lab_round` on stage tasks' packed results, cut here in one task instead of one task per output.

    Task ``t`` ran ``n`` micro-batches of the round's ``weights`` and packed, in this order, their ``n``
    losses, its gradients already weighted and summed over them, and the buffers after the last:
    ``layouts[t] = (n, weights, outputs)``, each output as :func:`_task_outputs` reads it (an ``"input"`` is one
    of the parameters, then of the buffers the task read).  ``buffers``: the round's buffers as they came in;
    they come back in ``buffer_forms`` (shape, dtype), so the next round reads them as it read these.
    ``param_shapes`` given: ``params`` is one :func:`flatten` vector, as the tasks read it (their first input)."""
    params, inputs = _parameters_in(params, param_shapes)
    current = [_assemble(b) for b in buffers]
    p_count, losses, grads = len(params), [], []
    for p, (n, weights, where) in zip(packed, layouts):
        out = _task_outputs(p, where, inputs + current)
        losses.append(np.float64(sum(wt * float(l) for wt, l in zip(weights, out[:n]))))
        grads.append(out[n:n + p_count])
        current = out[n + p_count:]
    out = lab_round(hyper, params, state, [1.0] * len(packed), losses, grads, current)
    out["buffers"] = _in_forms(out["buffers"], buffer_forms)
    return out


def lab_outer_round_packed(hyper: Sequence[dict], params: Sequence[Any], state: Sequence[dict],
                           packed: Sequence[np.ndarray], layouts: Sequence[tuple], shares: Sequence[float],
                           buffers: Sequence[Any], buffer_forms: Sequence[tuple],
                           param_shapes: Sequence[tuple] | None = None) -> dict:
    """The outer step of local-steps training (DiLoCo): each task (a worker) took ``n`` optimizer steps on its
    shard, from the round's parameters, and packed its ``n`` losses, its pseudo-gradient (the parameters it
    started from minus those it ended with) and its buffers after the last step (``layouts`` as in
    :func:`lab_round_packed`).  The pseudo-gradient is the workers' average weighted by their ``shares`` of the
    batch; the outer optimizer (``hyper``: SGD, Nesterov momentum in DiLoCo) steps with it as its gradient, as
    ``torch.optim.SGD`` would.  Buffers (BatchNorm's running statistics) are the workers' average likewise.
    ``param_shapes``: as in :func:`lab_round_packed`."""
    params, inputs = _parameters_in(params, param_shapes)
    start = [_assemble(b) for b in buffers]
    p_count, loss, deltas, after = len(params), 0.0, [], []
    for p, (n, weights, where) in zip(packed, layouts):
        out = _task_outputs(p, where, inputs + start)
        loss += sum(wt * float(l) for wt, l in zip(weights, out[:n]))
        deltas.append(out[n:n + p_count])
        after.append(out[n + p_count:])
    new_params, new_state = _apply(hyper, params, state, shares, deltas)
    averaged = [_weighted_mean(versions, shares) for versions in zip(*after)] if after else start
    flat, new_params = flatten(new_params)
    return {"params": new_params, "flat": flat, "state": new_state, "loss": float(loss),
            "buffers": _in_forms(averaged, buffer_forms)}


def _weighted_mean(versions: Sequence[np.ndarray], shares: Sequence[float]) -> np.ndarray:
    """:func:`_weighted_sum` of the workers' buffers in their own dtype (integers, e.g. a count of batches: in
    float64, rounded back)."""
    dtype = np.asarray(versions[0]).dtype
    if dtype.kind in "fc":
        return _weighted_sum(versions, shares, dtype)
    return np.rint(_weighted_sum(versions, shares, np.dtype(np.float64))).astype(dtype)


def field(result: dict, name: str) -> Any:
    """One entry of a round's result (a task on the lab worker: the loss for the researcher, the optimizer
    state for the next round), the rest staying where it is."""
    return result[name]
