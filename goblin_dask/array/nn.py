"""Neural-network operators on ga.Arrays (``torch.nn.functional``'s signatures), one catalog task per block.

An op over some axes needs those axes whole: they are rechunked into one block, and every
block of the remaining axes is one task (``softmax`` over the last axis of a (rows, cols)
array: one task per block of rows).  ``conv2d`` is blocked over the batch axis and the
output channels (the weight's first axis); pooling over the leading (N, C) axes;
``batch_norm`` along every axis (the running statistics follow the channel blocks);
``scaled_dot_product_attention`` over batch axes q, k and v share.  Small operands (weight,
bias, statistics) travel as one block.  The ops: :mod:`goblin_dask.ops.nn`.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from goblin_dask.array.core import Array, asarray, blockwise
from goblin_dask.array.layout import rechunk
from goblin_dask.array.linalg import even_blocks, volunteer_capacity
from goblin_dask.array.numpy_api import implements
from goblin_dask import settings
from goblin_dask.ops import get


def _whole(x: Array, axes: Sequence[int] | None = None) -> Array:
    """``x`` with ``axes`` (all when None) in one block each."""
    keep = set(range(x.ndim)) if axes is None else {a % x.ndim for a in axes}
    return rechunk(x, tuple((n,) if d in keep else c for d, (n, c) in enumerate(zip(x.shape, x.chunks))))


def _zero(x: Array) -> tuple:
    return (0,) * x.ndim


def _leading(opname: str, x: Any, whole_axes: Sequence[int], extras: Sequence[Any], params: dict,
             out_chunks) -> Array:
    """One task per block of ``x``'s other axes; ``extras`` travel whole; ``out_chunks(x_chunks)`` the result's blocks."""
    op = get(opname)
    x = asarray(x)
    extras = [_whole(asarray(e)) for e in extras]
    out = op.abstract_eval(x.aval, *(e.aval for e in extras), **params)  # errors before anything is built
    whole = {a % x.ndim for a in whole_axes}
    x = _whole(x, whole)
    chunks = out_chunks(x.chunks, out.shape)

    def block(idx):
        xi = tuple(0 if d in whole else i for d, i in enumerate(idx))
        refs = [x.ref(xi)] + [e.ref(_zero(e)) for e in extras]
        avals = [x.block_aval(xi)] + [e.aval for e in extras]
        return refs, avals, params

    return blockwise(opname, chunks, out.dtype, block, token=(x.name, *[e.name for e in extras], params),
                     dependencies=[x, *extras])


def _along(opname: str, x: Any, axis: int, **params: Any) -> Array:
    x = asarray(x)
    get(opname).abstract_eval(x.aval, axis=axis, **params)
    return _leading(opname, x, [axis], [], {"axis": axis, **params}, lambda chunks, shape: chunks)


@implements(op="softmax")
def softmax(x: Any, axis: int = -1) -> Array:
    """exp(x) / sum(exp(x)) over ``axis`` (torch.softmax; the axis is taken whole)."""
    return _along("softmax", x, axis)


@implements(op="log_softmax")
def log_softmax(x: Any, axis: int = -1) -> Array:
    """x - logsumexp(x) over ``axis`` (torch.log_softmax)."""
    return _along("log_softmax", x, axis)


@implements(op="logsumexp")
def logsumexp(x: Any, axis: int = -1, keepdims: bool = False) -> Array:
    """log(sum(exp(x))) over ``axis`` (torch.logsumexp)."""
    x = asarray(x)
    out = get("logsumexp").abstract_eval(x.aval, axis=axis, keepdims=keepdims)
    ax = axis % x.ndim

    def chunks(xc, shape):
        return tuple((1,) if d == ax else c for d, c in enumerate(xc)) if keepdims else \
            tuple(c for d, c in enumerate(xc) if d != ax)

    x = _whole(x, [ax])
    return _leading_dropped("logsumexp", x, ax, keepdims, chunks(x.chunks, out.shape), out.dtype)


def _leading_dropped(opname: str, x: Array, ax: int, keepdims: bool, chunks: tuple, dtype: Any) -> Array:
    """A reduction over whole axis ``ax``: output block idx reads input block idx with ``ax`` re-inserted as 0."""

    def block(idx):
        xi = tuple(idx[:ax]) + (0,) + tuple(idx[ax + (1 if keepdims else 0):])
        return [x.ref(xi)], [x.block_aval(xi)], {"axis": ax, "keepdims": keepdims}

    return blockwise(opname, chunks, dtype, block, token=(x.name, ax, keepdims), dependencies=[x])


def layer_norm(x: Any, normalized_shape: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> Array:
    """Normalize over the trailing ``normalized_shape`` axes, then ``* weight + bias`` (F.layer_norm)."""
    x = asarray(x)
    shape = (normalized_shape,) if isinstance(normalized_shape, (int, np.integer)) else tuple(normalized_shape)
    if not shape or tuple(x.shape[x.ndim - len(shape):]) != shape or len(shape) > x.ndim:
        raise ValueError(f"layer_norm: normalized_shape {shape} is not the trailing shape of input {x.shape}")
    return _layer_norm_op(x, *[a for a in (weight, bias) if a is not None], normalized_ndim=len(shape), eps=float(eps),
                          has_weight=weight is not None, has_bias=bias is not None)


@implements(op="layer_norm")
def _layer_norm_op(x: Any, *affine: Any, normalized_ndim: int = 1, eps: float = 1e-5, has_weight: bool = False,
                   has_bias: bool = False) -> Array:
    """The op's own call (``ga.Array._catalog``): one task per block of the leading axes."""
    x = asarray(x)
    params = {"normalized_ndim": normalized_ndim, "eps": eps, "has_weight": has_weight, "has_bias": has_bias}
    get("layer_norm").abstract_eval(x.aval, *(asarray(a).aval for a in affine), **params)
    return _leading("layer_norm", x, range(x.ndim - normalized_ndim, x.ndim), affine, params, lambda chunks, s: chunks)


def batch_norm(x: Any, running_mean: Any, running_var: Any, weight: Any = None, bias: Any = None,
               training: bool = False, momentum: float = 0.1, eps: float = 1e-5) -> Array:
    """Eval-mode batch norm with running statistics over channel axis 1 (F.batch_norm, training=False)."""
    if training:
        raise ValueError("batch_norm: only eval mode (training=False) is a catalog operation; compute the batch "
                         "statistics with ga.mean / ga.var and pass them as running_mean / running_var")
    return _batch_norm_op(x, *[a for a in (running_mean, running_var, weight, bias) if a is not None], eps=float(eps),
                          has_weight=weight is not None, has_bias=bias is not None)


@implements(op="batch_norm")
def _batch_norm_op(x: Any, *stats: Any, eps: float = 1e-5, has_weight: bool = False, has_bias: bool = False) -> Array:
    """The op's own call (``ga.Array._catalog``): blocked like ``x``, the statistics cut by its channel blocks."""
    op = get("batch_norm")
    x = asarray(x)
    stats = [asarray(a) for a in stats]
    params = {"eps": eps, "has_weight": has_weight, "has_bias": has_bias}
    out = op.abstract_eval(x.aval, *(s.aval for s in stats), **params)
    stats = [rechunk(s, (x.chunks[1],)) for s in stats]

    def block(idx):
        refs = [x.ref(idx)] + [s.ref((idx[1],)) for s in stats]
        return refs, [x.block_aval(idx)] + [s.block_aval((idx[1],)) for s in stats], params

    return blockwise("batch_norm", x.chunks, out.dtype, block, token=(x.name, *[s.name for s in stats], params),
                     dependencies=[x, *stats])


def _int_or_pair(v: Any) -> Any:
    return tuple(int(a) for a in v) if isinstance(v, (tuple, list)) else v


@implements(op="conv2d")
def conv2d(input: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
           groups: int = 1) -> Array:
    """2-d convolution of NCHW ``input`` with OIHW ``weight`` (F.conv2d; padding as ints only).

    One task per (batch block, output-channel block), each sized so that its input, weight,
    im2col patches and output fit the volunteers' per-task memory (as blocked products are);
    each is im2col + matmul, checked by Freivalds.
    """
    op = get("conv2d")
    x, w = asarray(input), asarray(weight)
    b = None if bias is None else asarray(bias)
    params = {"stride": _int_or_pair(stride), "padding": _int_or_pair(padding), "dilation": _int_or_pair(dilation),
              "groups": groups}
    out = op.abstract_eval(x.aval, w.aval, *([b.aval] if b is not None else []), **params)
    x = _whole(x, [1, 2, 3])
    w = _whole(w, [1, 2, 3] if groups == 1 else None)
    nb, ob = _conv_blocks(x, w, out, groups)
    if max(x.chunks[0]) > nb:
        x = rechunk(x, (even_blocks(x.shape[0], nb), *x.chunks[1:]))
    if groups == 1 and max(w.chunks[0]) > ob:
        w = rechunk(w, (even_blocks(w.shape[0], ob), *w.chunks[1:]))
    b = None if b is None else rechunk(b, (w.chunks[0],))
    chunks = (x.chunks[0], w.chunks[0], (out.shape[2],), (out.shape[3],))

    def block(idx):
        n, o = idx[0], idx[1]
        refs = [x.ref((n, 0, 0, 0)), w.ref((o, 0, 0, 0))] + ([b.ref((o,))] if b is not None else [])
        avals = [x.block_aval((n, 0, 0, 0)), w.block_aval((o, 0, 0, 0))] + ([b.block_aval((o,))] if b is not None else [])
        return refs, avals, params

    deps = [x, w] + ([b] if b is not None else [])
    return blockwise("conv2d", chunks, out.dtype, block, token=(*[d.name for d in deps], params), dependencies=deps)


def _conv_blocks(x: Array, w: Array, out: Any, groups: int) -> tuple[int, int]:
    """Largest (images, output channels) per conv2d task whose bytes fit a volunteer task's memory.

    A task holds its images, its filters, the im2col patches (images x Ho x Wo x C/groups x kh x kw)
    and its output; the budget is the blocked products' (``goblin.product.memory-fraction`` of a
    volunteer thread's memory).  Halves the larger side until it fits (or both are 1).
    """
    budget, _ = volunteer_capacity()
    budget *= float(settings.get("goblin.product.memory-fraction"))
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    ho, wo = out.shape[2], out.shape[3]
    isz = out.dtype.itemsize
    nb, ob = max(x.chunks[0]), (max(w.chunks[0]) if groups == 1 else o)

    def size(nb: int, ob: int) -> float:
        return isz * (nb * c * h * wd + ob * cg * kh * kw + nb * ho * wo * c * kh * kw + nb * ob * ho * wo)

    while size(nb, ob) > budget and (nb > 1 or (ob > 1 and groups == 1)):
        if nb > 1 and (groups != 1 or ob == 1 or nb * c * h * wd + nb * ho * wo * c * kh * kw >= ob * cg * kh * kw):
            nb = (nb + 1) // 2
        else:
            ob = (ob + 1) // 2
    return nb, ob


def _pool(opname: str, x: Any, params: dict) -> Array:
    x = asarray(x)
    return _leading(opname, x, [-2, -1], [], params,
                    lambda chunks, shape: tuple(chunks[:-2]) + ((shape[-2],), (shape[-1],)))


@implements(op="max_pool2d")
def max_pool2d(x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
               ceil_mode: bool = False, return_indices: bool = False) -> Array:
    """Largest value of each window of the last two axes (F.max_pool2d; no indices)."""
    if return_indices:
        raise TypeError("max_pool2d() got return_indices=True, which ga does not support")
    return _pool("max_pool2d", x, {"kernel_size": _int_or_pair(kernel_size), "stride": _int_or_pair(stride),
                                   "padding": _int_or_pair(padding), "dilation": _int_or_pair(dilation),
                                   "ceil_mode": bool(ceil_mode)})


@implements(op="avg_pool2d")
def avg_pool2d(x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
               count_include_pad: bool = True, divisor_override: Any = None) -> Array:
    """Mean of each window of the last two axes (F.avg_pool2d)."""
    return _pool("avg_pool2d", x, {"kernel_size": _int_or_pair(kernel_size), "stride": _int_or_pair(stride),
                                   "padding": _int_or_pair(padding), "ceil_mode": bool(ceil_mode),
                                   "count_include_pad": bool(count_include_pad), "divisor_override": divisor_override})


@implements(op="adaptive_avg_pool2d")
def adaptive_avg_pool2d(x: Any, output_size: Any) -> Array:
    """Mean over torch's adaptive bins of the last two axes (F.adaptive_avg_pool2d)."""
    size = tuple(output_size) if isinstance(output_size, (tuple, list)) else output_size
    return _pool("adaptive_avg_pool2d", x, {"output_size": size})


def scaled_dot_product_attention(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Any = None) -> Array:
    """softmax(q k^T * scale + mask) v (F.scaled_dot_product_attention, no dropout).

    Blocked over the batch axes when q, k and v share them (and a mask has none); else one task.
    """
    if dropout_p:
        raise TypeError("scaled_dot_product_attention() got dropout_p != 0, which ga does not support")
    mask = () if attn_mask is None else (attn_mask,)
    return _attention_op(query, key, value, *mask, causal=bool(is_causal), scale=None if scale is None else float(scale))


@implements(op="scaled_dot_product_attention")
def _attention_op(query: Any, key: Any, value: Any, *mask: Any, causal: bool = False, scale: Any = None) -> Array:
    """The op's own call (``ga.Array._catalog``)."""
    op = get("scaled_dot_product_attention")
    q, k, v = asarray(query), asarray(key), asarray(value)
    mask = asarray(mask[0]) if mask else None
    params = {"causal": causal, "scale": scale}
    out = op.abstract_eval(q.aval, k.aval, v.aval, *([mask.aval] if mask is not None else []), **params)
    batched = q.shape[:-2] == k.shape[:-2] == v.shape[:-2] and (mask is None or mask.ndim <= 2)
    if batched:
        q = _whole(q, [-2, -1])
        k = rechunk(k, q.chunks[:-2] + ((k.shape[-2],), (k.shape[-1],)))
        v = rechunk(v, q.chunks[:-2] + ((v.shape[-2],), (v.shape[-1],)))
        chunks = q.chunks[:-2] + ((out.shape[-2],), (out.shape[-1],))
    else:
        q, k, v = _whole(q), _whole(k), _whole(v)
        chunks = tuple((n,) for n in out.shape)
    mask = None if mask is None else _whole(mask)
    nb = len(chunks) - 2

    def block(idx):
        arrays = [(a, (tuple(idx[:nb]) + (0, 0)) if batched else _zero(a)) for a in (q, k, v)]
        if mask is not None:
            arrays.append((mask, _zero(mask)))
        return [a.ref(i) for a, i in arrays], [a.block_aval(i) for a, i in arrays], params

    deps = [q, k, v] + ([mask] if mask is not None else [])
    return blockwise("scaled_dot_product_attention", chunks, out.dtype, block,
                     token=(*[d.name for d in deps], params), dependencies=deps)


__all__ = [
    "adaptive_avg_pool2d", "avg_pool2d", "batch_norm", "conv2d", "layer_norm", "log_softmax", "logsumexp",
    "max_pool2d", "scaled_dot_product_attention", "softmax",
]
